//! Early release: a computed node's outputs are freed as soon as no recorded node still reads
//! them and no host value names them, instead of with the whole graph when the mini-batch ends,
//! so the buffer pool hands them to later launches of the same run: MV-RNN's per-node matrices
//! (64 KiB each) no longer pile up to 86 MB a mini-batch, and a process's first run touches
//! fewer fresh pages.
//!
//! Two counts decide it. Readers: each recorded node counts the nodes whose arguments read it and
//! have not launched (a launch, a deferred sum added up, hands its arguments to
//! [`Dfg::consumed`]). Claims: every `Value::Lazy` the runtime gives the evaluator holds a clone
//! of the node's token ([`tumble_interp::Hold`]), so the host's claims are the token's count less
//! the node's own. A node no node reads that the host still names waits on a watch list, looked
//! at again once it has doubled. Only nodes whose outputs reach `Options::release_min_bytes` get a
//! token; a graph whose blocks all stay under it tracks nothing.

use super::*;

/// By default early release tracks only nodes whose outputs take at least this many bytes per
/// invocation (MV-RNN's per-node matrices, a sentence's activations): counting the host's claims
/// on every value cost the evaluator 10% on StackRNN-small, whose 1 KiB rows gain nothing from it.
pub const RELEASE_MIN_BYTES: usize = 16 << 10;

/// A read of outputs [`Dfg::try_release`] freed: a bug in the reader counts or claims.
pub(super) fn released_error() -> RunError {
    RunError::new(
        "internal: a value was read after its early release (`--no-early-release` avoids it)",
    )
}

impl Dfg<'_> {
    /// A claim token for a node whose outputs have these shapes (f32 assumed: the bound is a
    /// size class, not an exact figure), or none if they are not tracked.
    pub(super) fn token_for(&self, shapes: &[Vec<usize>]) -> Option<std::rc::Rc<()>> {
        let elems: usize = shapes.iter().map(|s| s.iter().product::<usize>()).sum();
        (self.releasing() && elems.saturating_mul(4) >= self.opts.release_min_bytes)
            .then(|| std::rc::Rc::new(()))
    }

    /// A host value naming `r`, holding a claim on its node (see [`Dfg::try_release`]).
    pub(super) fn claim(&self, r: LazyRef) -> Value {
        let hold = match self
            .nodes
            .get(r.node as usize)
            .and_then(|n| n.token.as_ref())
        {
            Some(token) => Hold::on(token),
            None => Hold::NONE,
        };
        Value::Lazy(r, hold)
    }

    /// Whether outputs are freed before the graph is (see [`crate::Options::early_release`]).
    pub(super) fn releasing(&self) -> bool {
        self.opts.early_release && self.launch_log.is_none()
    }

    /// A node about to be recorded reads `args`: their producers count one more reader each.
    pub(super) fn count_readers(&mut self, args: &[Arg]) {
        if !self.releasing() {
            return;
        }
        for a in args {
            if let Arg::Lazy(r) = a {
                if let Some(p) = self.nodes.get_mut(r.node as usize) {
                    p.readers += 1;
                }
            }
        }
    }

    /// A node has launched (or a deferred sum was added up or dropped): it no longer reads
    /// `args`, and producers no one reads any more may be released.
    pub(super) fn consumed(&mut self, args: Vec<Arg>) {
        if !self.releasing() {
            return;
        }
        for a in args {
            if let Arg::Lazy(r) = a {
                let last = match self.nodes.get_mut(r.node as usize) {
                    Some(p) => {
                        p.readers = p.readers.saturating_sub(1);
                        p.readers == 0
                    }
                    None => false,
                };
                if last {
                    self.try_release(r.node);
                }
            }
        }
    }

    /// Frees node `id`'s outputs if it is computed, no recorded node reads them and no host value
    /// names them; one the host still names goes on the watch list. An unread, unclaimed deferred
    /// sum that was never added up is dropped with its terms.
    pub(super) fn try_release(&mut self, id: u32) {
        if !self.releasing() {
            return;
        }
        let Some(n) = self.nodes.get_mut(id as usize) else {
            return;
        };
        if n.released || n.readers > 0 {
            return;
        }
        let Some(token) = &n.token else {
            return;
        };
        if !unclaimed(token) {
            if !n.watched {
                n.watched = true;
                self.watch.push(id);
            }
            return;
        }
        if n.out.is_none() && !n.sum {
            // Not computed yet (a pending node the host let go of): its launch computes it.
            return;
        }
        n.released = true;
        let terms = std::mem::take(&mut n.args);
        let mut freed = 0u64;
        match n.out.take() {
            Some(Outs::One(s)) => freed += s.freed_bytes(),
            Some(Outs::Many(v)) => freed += v.iter().map(Slot::freed_bytes).sum::<u64>(),
            None => {}
        }
        self.live_bytes = self.live_bytes.saturating_sub(freed);
        // An unlaunched sum's terms (a launched node has no arguments left).
        self.consumed(terms);
    }

    /// Releases the watched nodes the host no longer names (at a flush's start or after a launch,
    /// once the list has doubled since the last look: amortized constant cost however long the
    /// host keeps the values it names, e.g. a stack of phrases across a parser's every step).
    pub(super) fn release_unclaimed(&mut self) {
        if self.watch.is_empty() {
            return;
        }
        let watch = std::mem::take(&mut self.watch);
        for id in watch {
            if let Some(n) = self.nodes.get_mut(id as usize) {
                n.watched = false;
            }
            self.try_release(id);
        }
        self.watch_checked = self.watch.len();
    }

    /// [`Dfg::release_unclaimed`] if the watch list has doubled since it last ran.
    pub(super) fn release_unclaimed_amortized(&mut self) {
        if self.watch.len() >= 2 * self.watch_checked + 64 {
            self.release_unclaimed();
        }
    }

    /// A launch produced `bytes` of new outputs.
    pub(super) fn produced(&mut self, bytes: u64) {
        self.live_bytes += bytes;
        self.profile.activation_bytes = self.profile.activation_bytes.max(self.live_bytes);
    }
}
