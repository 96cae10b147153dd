//! Early release: a computed node's outputs are freed as soon as no recorded node still reads
//! them and no host value names them, instead of with the whole graph when the mini-batch ends,
//! so the buffer pool hands them to later launches of the same run: MV-RNN's per-node matrices
//! (64 KiB each) no longer pile up to 86 MB a mini-batch, and a process's first run touches
//! fewer fresh pages.
//!
//! Two facts decide it. Readers: each recorded node counts the nodes whose arguments read it and
//! have not launched (a launch, or a deferred sum added up, hands its arguments to
//! [`Dfg::store_outputs`]). Claims: whether a host value (an instance's frames, its continuation
//! stack, a finished result) may name it, found by a scan of those values before a flush
//! ([`Dfg::scan_claims`]), which starts a new claims epoch. A host program can only name a node it
//! named at the scan or one recorded since, so a node recorded in the current epoch counts as
//! claimed, one the last scan did not find as free for good — the evaluator pays nothing (no
//! counting per value copy), and a scan runs only once enough output bytes were recorded to be
//! worth its walk ([`Dfg::wants_scan`]). A node no node reads that may still be claimed waits on
//! the watch list for the next scan. The eager scheduler launches while instances run and never
//! scans: it releases nothing.

use super::*;
use crate::intern::WordSet;
use std::collections::HashMap;
use std::sync::atomic::Ordering;

/// By default a scan of the host's values runs before a flush once this many output bytes were
/// recorded since the last scan, and at least [`SCAN_BYTES_PER_VISIT`] per value the job's last
/// scan walked: a scan's cost is the values it walks, its gain the bytes it lets go. StackRNN-small
/// (82 small flushes over 64 parsers' stacks and recursions, 11,000-24,000 values a scan) then
/// scans once or twice per job; MV-RNN and TreeLSTM (one flush after whole trees, when the
/// instances hold only their inputs) before every flush.
pub const RELEASE_SCAN_BYTES: usize = 1 << 20;

/// Recorded output bytes a scan must be able to free per value the last one walked.
const SCAN_BYTES_PER_VISIT: u64 = 512;

/// Bytes of outputs of these shapes, f32 assumed (the scan's trigger is a size class, not an
/// exact figure).
pub(super) fn output_bytes(shapes: &[Vec<usize>]) -> u64 {
    let elems: usize = shapes.iter().map(|s| s.iter().product::<usize>()).sum();
    elems as u64 * 4
}

/// What early release knows of a node.
#[derive(Clone, Copy)]
pub(super) struct Life {
    /// The claims epoch in which a host value may still name it: the node's recording (a new node
    /// is named by the value its invocation returned) or the last scan that found it. Older than
    /// [`Dfg::epoch`]: no host value names it.
    claimed: u32,
    /// Which of its outputs a host value named (bit `k` for output `k`, the last bit for every
    /// later one) in epoch `claimed`: all of them from its recording (the host holds the value
    /// its invocation returned), those the scan met after a scan. While it is claimed, computed
    /// and read by no node, the outputs no host value names are freed: a block returning
    /// `(y, z)` whose `y` a decoder keeps in a list let its `z` (64 KB a step) pile up with it.
    named: u64,
    /// Recorded nodes whose arguments read this node's outputs and have not launched yet (one per
    /// argument: a node reading it twice counts twice).
    readers: u32,
    /// Its outputs were freed ([`Dfg::try_release`]): nothing may read them again.
    pub(super) released: bool,
    /// On [`Dfg::watch`]: unread by nodes but possibly named by the host when last looked at.
    watched: bool,
}

/// A read of outputs [`Dfg::try_release`] freed: a bug in the reader counts or the scan's roots.
pub(super) fn released_error() -> RunError {
    RunError::new(
        "internal: a value was read after its early release (`--no-early-release` avoids it)",
    )
}

impl Dfg<'_> {
    /// Whether outputs are freed before the graph is (see [`crate::Options::early_release`]).
    pub(super) fn releasing(&self) -> bool {
        self.opts.early_release && self.launch_log.is_none()
    }

    /// A node reading `args`, with outputs of `out_bytes`, is being recorded: its producers count
    /// one more reader each, the bytes count towards the next scan, and the node starts claimed
    /// (the host holds the value its invocation returns).
    pub(super) fn recorded(&mut self, args: &[Arg], out_bytes: u64) -> Life {
        if self.releasing() {
            self.bytes_since_scan += out_bytes;
            for a in args {
                if let Arg::Lazy(r) = a {
                    if let Some(p) = self.nodes.get_mut(r.node as usize) {
                        p.life.readers += 1;
                    }
                }
            }
        }
        Life {
            claimed: self.epoch,
            named: u64::MAX,
            readers: 0,
            released: false,
            watched: false,
        }
    }

    /// Nodes `ids` are computed (a launch, ragged or not, or deferred sums added up): each gets
    /// its outputs, gives back the arguments it read (kept for the backward, which reads them),
    /// and one nobody reads or names (a value the host dropped before the launch) goes at once.
    pub(super) fn store_outputs(&mut self, ids: &[u32], outs: impl IntoIterator<Item = Outs>) {
        let keep_args = self.launch_log.is_some();
        let detach = self.releasing() && detach_named();
        let epoch = self.epoch;
        let mut read = Vec::new();
        // One copy per row however many nodes hold it: invocations that took an identical one's
        // results share its rows, and copies of their own would make them look unlike to the
        // launches that read them (a computed input of more than a few elements is compared by
        // its buffer).
        let mut copies: std::collections::HashMap<(usize, At), Slot> = Default::default();
        let outs: Vec<Outs> = outs.into_iter().collect();
        let held = if detach {
            self.held_rows(ids, &outs, epoch)
        } else {
            Default::default()
        };
        for (&id, mut out) in ids.iter().zip(outs) {
            if let Some(n) = self.nodes.get_mut(id as usize) {
                // A result the last scan found the host holding (an instance's final value,
                // computed in the same launch as other instances' intermediates) is copied out
                // of the launch's output, which would otherwise stay alive, every other row
                // released, for as long as the host holds this one: a list re-stacked by a
                // `concatenate` recursion kept every launch's output (395 MB against 1.3 MB at
                // `--batch 1`). Nodes recorded since the scan (`named` all set) are not.
                if detach && n.life.claimed == epoch && n.life.named != u64::MAX {
                    detach_rows(&mut out, n.life.named, &held, &mut copies);
                }
                n.out = Some(out);
                if !keep_args {
                    read.append(&mut n.args);
                }
            }
        }
        self.consumed(read);
        for &id in ids {
            if self
                .nodes
                .get(id as usize)
                .is_some_and(|n| n.life.readers == 0)
            {
                self.try_release(id);
            }
        }
    }

    /// Per launch output (by buffer), how many of its leading rows the host held at the last
    /// scan among nodes `ids` about to get `outs` ([`detach_rows`] leaves an output whose rows
    /// are mostly held whole: copying them out would free little).
    fn held_rows(&self, ids: &[u32], outs: &[Outs], epoch: u32) -> HashMap<usize, usize> {
        let mut held: HashMap<usize, usize> = HashMap::new();
        for (&id, out) in ids.iter().zip(outs) {
            let Some(n) = self.nodes.get(id as usize) else {
                continue;
            };
            if n.life.claimed != epoch || n.life.named == u64::MAX {
                continue;
            }
            let slots: &[Slot] = match out {
                Outs::One(s) => std::slice::from_ref(s),
                Outs::Many(v) => v,
            };
            for (k, s) in slots.iter().enumerate() {
                let rows = match s.at {
                    At::Row(_) => 1,
                    At::Rows { len, .. } => len as usize,
                    At::Whole => continue,
                };
                if n.life.named & (1 << k.min(63)) != 0 {
                    *held.entry(s.tensor.buffer_id()).or_default() += rows;
                }
            }
        }
        held
    }

    /// A node has launched (or a deferred sum was added up or dropped): it no longer reads
    /// `args`, and producers no one reads any more may be released.
    fn consumed(&mut self, args: Vec<Arg>) {
        if !self.releasing() {
            return;
        }
        for a in args {
            if let Arg::Lazy(r) = a {
                let last = match self.nodes.get_mut(r.node as usize) {
                    Some(p) => {
                        p.life.readers = p.life.readers.saturating_sub(1);
                        p.life.readers == 0
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
    /// names them; one the host may still name goes on the watch list. An unread, unclaimed
    /// deferred sum that was never added up is dropped with its terms.
    pub(super) fn try_release(&mut self, id: u32) {
        if !self.releasing() {
            return;
        }
        let epoch = self.epoch;
        let Some(n) = self.nodes.get_mut(id as usize) else {
            return;
        };
        if n.life.released || n.life.readers > 0 {
            return;
        }
        if n.life.claimed == epoch {
            if n.life.named != u64::MAX {
                if let Some(Outs::Many(slots)) = &mut n.out {
                    let mut freed = 0;
                    for (k, s) in slots.iter_mut().enumerate().take(63) {
                        if n.life.named & (1 << k) == 0 && !s.is_released() {
                            freed += s.freed_bytes();
                            *s = Slot::released();
                        }
                    }
                    self.live_bytes = self.live_bytes.saturating_sub(freed);
                }
            }
            if !n.life.watched {
                n.life.watched = true;
                self.watch.push(id);
            }
            return;
        }
        if n.out.is_none() && !n.sum {
            // Not computed yet (a pending node the host let go of): its launch computes it.
            return;
        }
        n.life.released = true;
        let terms = std::mem::take(&mut n.args);
        let freed = match n.out.take() {
            Some(Outs::One(s)) => s.freed_bytes(),
            Some(Outs::Many(v)) => v.iter().map(Slot::freed_bytes).sum::<u64>(),
            None => 0,
        };
        self.live_bytes = self.live_bytes.saturating_sub(freed);
        // An unlaunched sum's terms (a launched node has no arguments left).
        self.consumed(terms);
    }

    /// Whether a scan of the host's values ([`Dfg::scan_claims`]) is worth running before the
    /// next flush: enough output bytes were recorded since the last one.
    pub fn wants_scan(&self) -> bool {
        let last_visits = self.exec.last_scan_visits.load(Ordering::Relaxed);
        let bound = match self.opts.release_scan_bytes {
            // Before every flush (the tests).
            0 => 0,
            b => (b as u64).max(last_visits.saturating_mul(SCAN_BYTES_PER_VISIT)),
        };
        // The eager scheduler has launched everything by the time it flushes.
        self.releasing()
            && self.opts.scheduler != Scheduler::Eager
            && self.bytes_since_scan >= bound
    }

    /// Starts a new claims epoch: `roots` hands over every value the host holds (each instance's
    /// [`tumble_interp::Machine::visit_values`], the results not yet read); the nodes they name
    /// stay claimed, every other one is free once no node reads it. Then the watched nodes the
    /// host let go of are released.
    pub fn scan_claims(&mut self, roots: impl FnOnce(&mut dyn FnMut(&Value))) {
        if !self.releasing() {
            return;
        }
        self.epoch += 1;
        let epoch = self.epoch;
        let nodes = &mut self.nodes;
        let mut walk = Walk {
            seen: WordSet::default(),
            deep: Vec::new(),
            visits: 0,
            mark: &mut |r: LazyRef| {
                if let Some(n) = nodes.get_mut(r.node as usize) {
                    if n.life.claimed != epoch {
                        n.life.claimed = epoch;
                        n.life.named = 0;
                    }
                    n.life.named |= 1 << r.output.min(63);
                }
            },
        };
        roots(&mut |v: &Value| walk.root(v));
        let visits = walk.visits;
        self.exec.last_scan_visits.store(visits, Ordering::Relaxed);
        self.bytes_since_scan = 0;
        self.profile.release_scans += 1;
        for id in std::mem::take(&mut self.watch) {
            if let Some(n) = self.nodes.get_mut(id as usize) {
                n.life.watched = false;
            }
            self.try_release(id);
        }
    }

    /// A launch produced the output buffer `t` holds.
    pub(super) fn produced(&mut self, t: &Tensor) {
        self.produced_watched(t.watch(), (t.len() * t.dtype().size()) as u64);
    }

    /// [`Dfg::produced`] of a buffer watched by `watch`, of `bytes`.
    pub(super) fn produced_watched(&mut self, watch: tumble_tensor::BufferWatch, bytes: u64) {
        if let std::collections::hash_map::Entry::Vacant(e) = self.counted.entry(watch.buffer_id())
        {
            e.insert((watch, bytes));
            self.counted_since_settle += 1;
            self.live_bytes += bytes;
            self.profile.activation_bytes = self.profile.activation_bytes.max(self.live_bytes);
        }
    }

    /// After a flush: the launch outputs still held by some tensor, and their bytes as the live
    /// bytes (see [`Dfg::counted`]) — when the buffers counted since the last look are at least
    /// an eighth of them all. A look walks every buffer counted, and an instance that flushes
    /// at every step (a branch on a computed value) adds a few buffers a flush to many that
    /// live: looking at each flush made its run quadratic (20,000 steps: 1.6 s of 2.2 in these
    /// looks). Skipped, `live_bytes` stays an upper bound, as within a flush.
    pub(super) fn settle_live_bytes(&mut self) {
        if self.counted.len() > 8 * self.counted_since_settle + SETTLE_ALWAYS_BELOW {
            return;
        }
        self.counted_since_settle = 0;
        self.counted.retain(|_, (w, _)| w.alive());
        self.live_bytes = self.counted.values().map(|(_, b)| b).sum();
    }
}

/// Buffers counted below which every flush settles the live bytes ([`Dfg::settle_live_bytes`]).
const SETTLE_ALWAYS_BELOW: usize = 256;

/// A walk of the host's values for the lazy tensors inside them (see [`Dfg::scan_claims`]).
struct Walk<'m> {
    /// Shared tuples, constructor values and closures already walked (a value with one owner
    /// cannot be met twice, so only shared ones are recorded).
    seen: WordSet<*const ()>,
    /// Values met deeper than [`WALK_DEPTH`], walked from the top again.
    deep: Vec<Value>,
    /// Values walked, leaves included (the scan's cost).
    visits: u64,
    mark: &'m mut dyn FnMut(LazyRef),
}

/// Recursion depth of [`Walk::walk`] before a value is set aside (a list is walked along its tail
/// without recursing; a tree nested this deep in a head position goes to [`Walk::deep`]).
const WALK_DEPTH: u32 = 256;

impl Walk<'_> {
    fn root(&mut self, v: &Value) {
        self.visits += 1;
        self.walk(v, 0);
        while let Some(v) = self.deep.pop() {
            self.walk(&v, 0);
        }
    }

    /// Walks `v`: the last field of a composite in the loop (a list's tail), the others by
    /// recursion.
    fn walk(&mut self, mut v: &Value, depth: u32) {
        loop {
            let fields: &[Value] = match v {
                Value::Lazy(r) => {
                    (self.mark)(*r);
                    return;
                }
                Value::Tensor(_) => return,
                Value::Tuple(t) => {
                    if !self.first_time(t) {
                        return;
                    }
                    &t.0
                }
                Value::Adt(a) => {
                    if !self.first_time(a) {
                        return;
                    }
                    &a.fields
                }
                Value::Closure(c) => {
                    if !self.first_time(c) {
                        return;
                    }
                    match &**c {
                        tumble_interp::Closure::Lambda { captured, .. } => captured,
                        _ => return,
                    }
                }
            };
            self.visits += fields.len() as u64;
            let Some((last, rest)) = fields.split_last() else {
                return;
            };
            for f in rest {
                if matches!(f, Value::Tensor(_)) {
                    continue;
                }
                if depth >= WALK_DEPTH {
                    self.deep.push(f.clone());
                } else {
                    self.walk(f, depth + 1);
                }
            }
            v = last;
        }
    }

    /// Whether the composite behind `rc` is met for the first time.
    fn first_time<T>(&mut self, rc: &std::rc::Rc<T>) -> bool {
        std::rc::Rc::strong_count(rc) == 1 || self.seen.insert(std::rc::Rc::as_ptr(rc).cast())
    }
}

/// `TUMBLE_NO_DETACH_NAMED=1`: results the host holds stay rows of their launch's output (the
/// A/B switch of [`detach_rows`]; the values are the same).
fn detach_named() -> bool {
    !tumble_limits::switch_on!("TUMBLE_NO_DETACH_NAMED")
}

/// `TUMBLE_DETACH_HELD=1`: rows the host holds are copied out of their launch's output even
/// where it holds most of its rows (the A/B switch of [`detach_rows`]'s `held` rule).
fn held_mostly() -> bool {
    !tumble_limits::switch_on!("TUMBLE_DETACH_HELD")
}

/// Launch outputs below this many bytes keep the results the host holds as their rows: what they
/// would keep alive is small, and a copy per result costs (BiRNN's per-token classes, MV-RNN's
/// roots: 2% slower copied).
const DETACH_FROM_BYTES: usize = 256 << 10;

/// The outputs `named` (bit `k` for output `k`) of `out` that are a part of a larger tensor — a
/// row or rows of a launch's output of at least [`DETACH_FROM_BYTES`], at most half of it, of
/// which the host holds at most half the rows in all (`held`, by buffer) — as tensors of their
/// own. An output the host holds mostly stays whole: an early-exit transformer's layer output
/// is named row by row by every sentence still running, and copying each out (onto freshly
/// faulted memory, 25 MB a layer at batch 64) freed nothing.
fn detach_rows(
    out: &mut Outs,
    named: u64,
    held: &HashMap<usize, usize>,
    copies: &mut std::collections::HashMap<(usize, At), Slot>,
) {
    let slots: &mut [Slot] = match out {
        Outs::One(s) => std::slice::from_mut(s),
        Outs::Many(v) => v,
    };
    for (k, s) in slots.iter_mut().enumerate() {
        if named & (1 << k.min(63)) == 0 || matches!(s.at, At::Whole) || s.is_released() {
            continue;
        }
        let whole = s.tensor.len();
        let part: usize = match s.at {
            At::Row(_) => s
                .tensor
                .shape()
                .get(1..)
                .map_or(whole, |d| d.iter().product()),
            At::Rows { len, .. } => {
                len as usize
                    * s.tensor
                        .shape()
                        .get(1..)
                        .map_or(1, |d| d.iter().product::<usize>())
            }
            At::Whole => whole,
        };
        if whole * s.tensor.dtype().size() < DETACH_FROM_BYTES || part * 2 > whole {
            continue;
        }
        let rows = s.tensor.shape().first().copied().unwrap_or(1);
        if held_mostly() && held.get(&s.tensor.buffer_id()).copied().unwrap_or(0) * 2 > rows {
            continue;
        }
        let key = (s.tensor.buffer_id(), s.at);
        if let Some(c) = copies.get(&key) {
            *s = c.clone();
        } else if let Ok(t) = s.value() {
            *s = Slot {
                tensor: t,
                at: At::Whole,
            };
            copies.insert(key, s.clone());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lazy(node: u32) -> Value {
        Value::Lazy(LazyRef { node, output: 0 })
    }

    /// Every lazy tensor is found once however the values nest: a long list (walked along its
    /// tail), a tree nested far deeper than the recursion bound in head position, values shared
    /// between roots and inside one, and closures' captures.
    #[test]
    fn the_walk_finds_every_lazy_value_once() {
        let n = 100_000u32;
        let mut list = Value::adt(0, Vec::new());
        for i in 0..n {
            list = Value::adt(1, vec![lazy(i), list]);
        }
        let mut deep = lazy(n);
        for _ in 0..3 * WALK_DEPTH {
            deep = Value::adt(
                2,
                vec![deep, Value::Tensor(tumble_tensor::Tensor::scalar_f32(0.0))],
            );
        }
        let shared = Value::tuple(vec![lazy(n + 1), lazy(n + 2)]);
        let closure = Value::Closure(std::rc::Rc::new(tumble_interp::Closure::Lambda {
            lambda: 0,
            captured: vec![shared.clone(), lazy(n + 3)],
        }));
        let roots = [
            list,
            deep,
            shared.clone(),
            Value::tuple(vec![shared, closure]),
        ];
        let mut found = vec![0u32; n as usize + 4];
        let mut mark = |r: LazyRef| found[r.node as usize] += 1;
        let mut walk = Walk {
            seen: WordSet::default(),
            deep: Vec::new(),
            visits: 0,
            mark: &mut mark,
        };
        for r in &roots {
            walk.root(r);
        }
        assert!(walk.visits > u64::from(n));
        // The shared tuple's lazies are met once (the tuple is walked once).
        assert!(found.iter().all(|&c| c == 1), "{:?}", &found[n as usize..]);
    }
}
