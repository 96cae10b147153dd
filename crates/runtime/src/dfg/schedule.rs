//! Scheduling a flush: which pending nodes launch together and in what order — by depth
//! (inline or dataflow; nodes waiting on an uncomputed input parked on its producer, small
//! launches of weight-bound blocks deferred) or by DyNet's agenda.

use super::*;
use crate::intern::WordMap;
use std::rc::Rc;

/// How many nodes ahead of the one looked at the level loop prefetches (its argument list at
/// half that distance).
const PREFETCH_NODES: usize = 8;

/// `TUMBLE_NO_NODE_PREFETCH=1` turns the level loop's prefetching off (a hint: results never
/// depend on it).
fn node_prefetch_enabled() -> bool {
    !tumble_limits::switch_on!("TUMBLE_NO_NODE_PREFETCH")
}

/// What [`Dfg::prefetch_node`] fetches.
#[derive(Clone, Copy)]
enum Prefetch {
    Node,
    Args,
    Producers,
}

/// The pending nodes a flush of a few levels left, by depth: the next flush adds the nodes
/// recorded meanwhile instead of sorting every pending node again. (A session flushing `--cell-levels` levels per step sorted the whole
/// backlog at every step: one 20,000-token BiRNN request took 15 s at 8 levels, against 0.7 s
/// flushed whole.)
#[derive(Default)]
pub(super) struct Held {
    levels: BTreeMap<u32, Vec<u32>>,
    /// Nodes waiting for an input, by the node that computes it, still parked: a level's nodes
    /// blocked behind deeper ones (the inline depth follows the program's calls, not the data)
    /// were put back at their level and looked at again by every later flush.
    waiting: WordMap<u32, Vec<u32>>,
}

impl Held {
    fn is_empty(&self) -> bool {
        self.levels.is_empty() && self.waiting.is_empty()
    }

    pub(super) fn len(&self) -> usize {
        self.ids().count()
    }

    fn ids(&self) -> impl Iterator<Item = u32> + '_ {
        self.levels
            .values()
            .chain(self.waiting.values())
            .flatten()
            .copied()
    }
}

impl Dfg<'_> {
    pub fn has_pending(&self) -> bool {
        !self.pending.is_empty() || !self.held.is_empty()
    }

    /// Nodes recorded so far, run or not: what a long-lived [`crate::session::BatchSession`]
    /// bounds, since nodes are only freed with the whole graph (their large outputs may go
    /// earlier, see `release`).
    pub fn node_count(&self) -> usize {
        self.nodes.len()
    }

    /// Instances (by number) whose launches stop the flush once they are no longer wanted: between launches,
    /// a stop that fired fails the flush with [`Dfg::failed_instance`] naming its instance (a
    /// session answers it and restarts the others). A flush could otherwise run for many
    /// seconds on the work of a request already answered 504 or whose client left.
    pub fn set_stops(&mut self, stops: Vec<(u32, tumble_interp::StopWhen)>) {
        self.stops = stops;
    }

    /// The instance of the first stop that has fired, if any.
    pub(super) fn stopped_instance(&self) -> Option<u32> {
        if self.stops.is_empty() {
            return None;
        }
        let now = Instant::now();
        self.stops
            .iter()
            .find(|(_, s)| s.fired(now).is_some())
            .map(|&(i, _)| i)
    }

    /// Whether a node of `instance` is still pending.
    pub fn has_pending_of(&self, instance: u32) -> bool {
        self.pending
            .iter()
            .copied()
            .chain(self.held.ids())
            .any(|id| {
                self.nodes
                    .get(id as usize)
                    .is_some_and(|n| n.instance == instance)
            })
    }

    /// Evaluates every pending node, in batched launches chosen by the scheduler.
    pub fn flush(&mut self) -> Result<(), RunError> {
        self.flush_levels(usize::MAX)
    }

    /// [`Dfg::flush`] that stops once `levels` depth levels have launched, leaving the deeper
    /// nodes pending (the inline and dataflow-depth schedulers; the agenda flushes everything).
    /// A continuous-batching session flushes this way so that instances arriving meanwhile join
    /// the level the running ones have reached instead of waiting for their whole trees.
    pub fn flush_levels(&mut self, levels: usize) -> Result<(), RunError> {
        if !self.has_pending() {
            return Ok(());
        }
        self.profile.flushes += 1;
        let mut pending = std::mem::take(&mut self.pending);
        let flushed = match self.opts.scheduler {
            // The agenda sorts its own way: the held nodes join the others.
            Scheduler::Agenda => {
                pending.extend(std::mem::take(&mut self.held).ids());
                self.flush_agenda(pending)
            }
            _ => self.flush_by_depth(pending, levels.max(1)),
        };
        self.settle_live_bytes();
        flushed
    }

    /// The shallowest depth among the nodes not yet run (`None` when none is pending).
    pub fn frontier_depth(&self) -> Option<u32> {
        let recorded = self
            .pending
            .iter()
            .filter_map(|&id| self.nodes.get(id as usize).map(|n| n.depth))
            .min();
        let held = self.held.levels.keys().next().copied();
        let parked = (self.held.waiting.values().flatten())
            .filter_map(|&id| self.nodes.get(id as usize).map(|n| n.depth))
            .min();
        recorded.into_iter().chain(held).chain(parked).min()
    }

    /// Whether every lazy tensor inside `v` has been computed (iterative: results can be long
    /// lists).
    pub fn is_computed(&self, v: &Value) -> bool {
        !self.find_uncomputed(v, |_| false)
    }

    /// The lazy tensors inside `v` not computed yet.
    pub fn uncomputed(&self, v: &Value) -> Vec<LazyRef> {
        let mut out = Vec::new();
        self.find_uncomputed(v, |r| {
            out.push(r);
            true
        });
        out
    }

    /// Hands each lazy tensor inside `v` not computed yet to `found` until it returns false;
    /// whether there was any.
    fn find_uncomputed(&self, v: &Value, mut found: impl FnMut(LazyRef) -> bool) -> bool {
        // Shared composites are looked into once (a result holding one subtree twice, n levels
        // deep, has 2^n paths over n nodes).
        let mut seen: std::collections::HashSet<*const ()> = Default::default();
        let mut first = |p: *const (), shared: bool| !shared || seen.insert(p);
        let mut any = false;
        let mut stack = vec![v];
        while let Some(v) = stack.pop() {
            match v {
                Value::Lazy(r) if !self.lazy_ready(*r) => {
                    any = true;
                    if !found(*r) {
                        return true;
                    }
                }
                Value::Tuple(t) if first(Rc::as_ptr(t).cast(), Rc::strong_count(t) > 1) => {
                    stack.extend(t.0.iter());
                }
                Value::Adt(a) if first(Rc::as_ptr(a).cast(), Rc::strong_count(a) > 1) => {
                    stack.extend(a.fields.iter());
                }
                _ => {}
            }
        }
        any
    }

    /// Crosses the computed ones off `waiting` (from its end, stopping at the first that is not:
    /// each is looked at once after it is computed) and says whether any is left.
    pub fn still_uncomputed(&self, waiting: &mut Vec<LazyRef>) -> bool {
        while let Some(&r) = waiting.last() {
            if !self.lazy_ready(r) {
                return true;
            }
            waiting.pop();
        }
        false
    }

    /// Inline-depth and dataflow-depth scheduling: all nodes of one (depth, block, shapes) launch
    /// together, depths in increasing order.
    pub(super) fn flush_by_depth(
        &mut self,
        pending: Vec<u32>,
        max_levels: usize,
    ) -> Result<(), RunError> {
        let t0 = Instant::now();
        // The nodes an earlier flush of a few levels left come sorted already; only the ones
        // recorded since are sorted in.
        let Held {
            mut levels,
            waiting,
        } = std::mem::take(&mut self.held);
        // Pending invocations per launch key, for deferring small launches while more of the
        // same key are still to come. Not in a flush of a few levels: instances join between
        // such flushes, so more of a key are always to come, and a deep instance's one node
        // per level waited flush after flush (a 30-level tree took 461 one-level steps with a
        // small tree joining at each, against 61 alone).
        let deferring = max_levels == usize::MAX && self.exec.defer_below.iter().any(|&d| d > 1);
        for id in pending {
            if let Some(n) = self.nodes.get(id as usize) {
                levels.entry(n.depth).or_default().push(id);
            }
        }
        let mut remaining = match deferring {
            true => {
                self.deferral_counts(levels.values().chain(waiting.values()).flatten().copied())
            }
            false => WordMap::default(),
        };
        // Nodes waiting for an input, by the node that computes it: released to the level after
        // the one that launches it, instead of being looked at again at every level between
        // (NestedRNN's chains behind deferred launches made that quadratic).
        let mut waiting_on: WordMap<u32, Vec<u32>> = waiting;
        self.profile.time_schedule += t0.elapsed();
        let mut launched_levels = 0;
        let prefetch = node_prefetch_enabled();
        while let Some((depth, ids)) = levels.pop_first() {
            if launched_levels == max_levels {
                // Out of levels: everything not launched stays for the next flush as it is,
                // sorted by level or parked on its producer.
                levels.entry(depth).or_default().extend(ids);
                self.held = Held {
                    levels,
                    waiting: waiting_on,
                };
                return Ok(());
            }
            let t0 = Instant::now();
            let mut groups: BTreeMap<(u32, u64), Vec<u32>> = BTreeMap::new();
            let mut later = Vec::new();
            for (k, &id) in ids.iter().enumerate() {
                if prefetch {
                    self.prefetch_node(ids.get(k + PREFETCH_NODES).copied(), Prefetch::Node);
                    self.prefetch_node(ids.get(k + PREFETCH_NODES / 2).copied(), Prefetch::Args);
                    self.prefetch_node(
                        ids.get(k + PREFETCH_NODES / 4).copied(),
                        Prefetch::Producers,
                    );
                }
                match self.blocking_input(id) {
                    None => {
                        if let Some(n) = self.nodes.get(id as usize) {
                            groups.entry((n.block, n.key)).or_default().push(id);
                        }
                    }
                    Some(Some(p)) => waiting_on.entry(p).or_default().push(id),
                    Some(None) => later.push(id),
                }
            }
            if deferring {
                // A small group of a weight-bound block waits one level when more invocations
                // of its key are pending and another group launches at this level (so every
                // level makes progress and the flush ends).
                let defer = |k: &(u32, u64), n: usize| {
                    n < self
                        .exec
                        .defer_below
                        .get(k.0 as usize)
                        .copied()
                        .unwrap_or(0)
                        && remaining.get(k).is_some_and(|&r| r > n)
                };
                let mut waiting: Vec<(u32, u64)> = groups
                    .iter()
                    .filter(|(k, ids)| defer(k, ids.len()))
                    .map(|(k, _)| *k)
                    .collect();
                if waiting.len() == groups.len() {
                    // Every group could wait: the fullest (relative to its threshold) launches.
                    let fill = |k: &(u32, u64)| {
                        let below = self
                            .exec
                            .defer_below
                            .get(k.0 as usize)
                            .copied()
                            .unwrap_or(1);
                        groups.get(k).map_or(0, Vec::len) as f64 / below.max(1) as f64
                    };
                    if let Some(i) = (0..waiting.len())
                        .max_by(|&a, &b| fill(&waiting[a]).total_cmp(&fill(&waiting[b])))
                    {
                        waiting.swap_remove(i);
                    }
                }
                for k in waiting {
                    if let Some(ids) = groups.remove(&k) {
                        self.profile.deferred += ids.len() as u64;
                        later.extend(ids);
                    }
                }
                for (k, ids) in &groups {
                    if let Some(r) = remaining.get_mut(k) {
                        *r = r.saturating_sub(ids.len());
                    }
                }
            }
            if !later.is_empty() {
                levels.entry(depth + 1).or_default().extend(later);
            }
            if groups.is_empty() && levels.is_empty() && !waiting_on.is_empty() {
                return Err(RunError::new("internal: dataflow graph has a cycle"));
            }
            self.profile.time_schedule += t0.elapsed();
            if !groups.is_empty() {
                launched_levels += 1;
            }
            let mut groups = groups.into_iter();
            while let Some(((block, _), ids)) = groups.next() {
                if let Err(e) = self.launch(block, &ids) {
                    if self.stop_fired.is_some() {
                        // A stop between launches: nothing is half done. What did not launch
                        // stays pending, so the session goes on with the other instances.
                        let unlaunched = ids.into_iter().chain(groups.flat_map(|(_, g)| g));
                        self.hold_unlaunched(depth, unlaunched, levels, waiting_on);
                    }
                    return Err(e);
                }
                for id in ids {
                    if let Some(ws) = waiting_on.remove(&id) {
                        levels.entry(depth + 1).or_default().extend(ws);
                    }
                }
            }
        }
        if !waiting_on.is_empty() {
            return Err(RunError::new(
                "internal: a node waits for an input no launch computes",
            ));
        }
        Ok(())
    }

    /// After a flush stopped between launches: every node not computed — `unlaunched` (at
    /// `depth`), the later levels and the parked nodes — is held for the next flush, the parked
    /// ones at their own depth (their producer may have launched just before the stop).
    fn hold_unlaunched(
        &mut self,
        depth: u32,
        unlaunched: impl Iterator<Item = u32>,
        mut levels: BTreeMap<u32, Vec<u32>>,
        waiting_on: WordMap<u32, Vec<u32>>,
    ) {
        let back: Vec<u32> = unlaunched.filter(|&id| self.not_computed(id)).collect();
        levels.entry(depth).or_default().extend(back);
        for id in waiting_on.into_values().flatten() {
            if let Some(n) = self.nodes.get(id as usize) {
                levels.entry(n.depth).or_default().push(id);
            }
        }
        levels.retain(|_, ids| !ids.is_empty());
        self.held = Held {
            levels,
            waiting: WordMap::default(),
        };
    }

    /// Per launch key of a deferring block, how many of `ids` it has.
    fn deferral_counts(&self, ids: impl Iterator<Item = u32>) -> WordMap<(u32, u64), usize> {
        let mut remaining: WordMap<(u32, u64), usize> = WordMap::default();
        for n in ids.filter_map(|id| self.nodes.get(id as usize)) {
            if self.defers(n) {
                *remaining.entry((n.block, n.key)).or_default() += 1;
            }
        }
        remaining
    }

    /// Whether node `n`'s block defers small launches (see `flush_by_depth`).
    fn defers(&self, n: &Node) -> bool {
        self.exec
            .defer_below
            .get(n.block as usize)
            .is_some_and(|&d| d > 1)
    }

    /// Whether node `id` has not been computed (a stopped flush keeps it for the next).
    fn not_computed(&self, id: u32) -> bool {
        self.nodes.get(id as usize).is_some_and(|n| n.out.is_none())
    }

    /// Forgets the pending nodes of `instance` (its request was answered: a timeout or a client
    /// gone), so later flushes compute only the others'. Their producers' outputs stay until
    /// the graph is dropped.
    pub fn drop_pending_of(&mut self, instance: u32) {
        let other = |d: &Dfg<'_>, id: &u32| {
            d.nodes
                .get(*id as usize)
                .is_some_and(|n| n.instance != instance)
        };
        let pending = std::mem::take(&mut self.pending);
        self.pending = pending.into_iter().filter(|id| other(self, id)).collect();
        let mut held = std::mem::take(&mut self.held);
        held.levels.retain(|_, ids| {
            ids.retain(|id| other(self, id));
            !ids.is_empty()
        });
        held.waiting.retain(|_, ids| {
            ids.retain(|id| other(self, id));
            !ids.is_empty()
        });
        self.held = held;
    }

    /// Prefetches what [`Dfg::blocking_input`] will read of node `id`: the node, its argument
    /// list (whose address the node holds: asked for a node prefetched earlier, so reading it
    /// rarely stalls) or the nodes that compute its arguments.
    #[inline]
    fn prefetch_node(&self, id: Option<u32>, what: Prefetch) {
        let Some(n) = id.and_then(|id| self.nodes.get(id as usize)) else {
            return;
        };
        match what {
            Prefetch::Node => crate::simd::prefetch_value(n),
            Prefetch::Args => crate::simd::prefetch_value(n.args.as_slice()),
            Prefetch::Producers => {
                for a in &n.args {
                    if let Arg::Lazy(r) = a {
                        if let Some(m) = self.nodes.get(r.node as usize) {
                            crate::simd::prefetch_value(m);
                        }
                    }
                }
            }
        }
    }

    /// `None` when every input of node `id` is computed; else `Some` of a recorded node not run
    /// yet that computes one of them (a deferred sum's term rather than the sum), or `Some(None)`
    /// if there is none to wait for.
    pub(super) fn blocking_input(&self, id: u32) -> Option<Option<u32>> {
        let n = self.nodes.get(id as usize)?;
        for a in &n.args {
            let Arg::Lazy(r) = a else {
                continue;
            };
            let Some(m) = self.nodes.get(r.node as usize) else {
                return Some(None);
            };
            if m.out.is_some() {
                continue;
            }
            if !m.sum {
                return Some(Some(r.node));
            }
            for t in &m.args {
                if let Arg::Lazy(q) = t {
                    if !self.lazy_ready(*q) {
                        return Some(Some(q.node));
                    }
                }
            }
        }
        None
    }

    /// DyNet's agenda: repeatedly launch the group of ready nodes with the same signature whose
    /// shallowest node is shallowest (larger group on ties).
    pub(super) fn flush_agenda(&mut self, pending: Vec<u32>) -> Result<(), RunError> {
        let t0 = Instant::now();
        let pending_set: crate::intern::WordSet<u32> = pending.iter().copied().collect();
        let mut waiting: WordMap<u32, usize> = WordMap::default();
        let mut consumers: WordMap<u32, Vec<u32>> = WordMap::default();
        let mut ready: BTreeMap<(u32, u64), Vec<u32>> = BTreeMap::new();
        for &id in &pending {
            let Some(n) = self.nodes.get(id as usize) else {
                continue;
            };
            let mut count = 0;
            let mut deps = Vec::new();
            for a in &n.args {
                self.arg_deps(a, &mut deps);
            }
            for dep in deps {
                if pending_set.contains(&dep) {
                    count += 1;
                    consumers.entry(dep).or_default().push(id);
                }
            }
            if count == 0 {
                ready.entry((n.block, n.key)).or_default().push(id);
            } else {
                waiting.insert(id, count);
            }
        }
        self.profile.time_schedule += t0.elapsed();
        loop {
            let t0 = Instant::now();
            let pick = ready
                .iter()
                .map(|(k, ids)| {
                    let d = ids
                        .iter()
                        .filter_map(|&i| self.nodes.get(i as usize).map(|n| n.depth))
                        .min()
                        .unwrap_or(0);
                    (d, std::cmp::Reverse(ids.len()), *k)
                })
                .min()
                .map(|(_, _, k)| k);
            let Some(k) = pick else { break };
            let ids = ready.remove(&k).unwrap_or_default();
            self.profile.time_schedule += t0.elapsed();
            if let Err(e) = self.launch(k.0, &ids) {
                if self.stop_fired.is_some() {
                    // A stop between launches: what did not launch stays pending (see
                    // `hold_unlaunched`).
                    let left: Vec<u32> = pending
                        .iter()
                        .copied()
                        .filter(|&id| self.not_computed(id))
                        .collect();
                    self.pending.extend(left);
                }
                return Err(e);
            }
            let t0 = Instant::now();
            for id in ids {
                for c in consumers.remove(&id).unwrap_or_default() {
                    if let Some(w) = waiting.get_mut(&c) {
                        *w -= 1;
                        if *w == 0 {
                            waiting.remove(&c);
                            if let Some(n) = self.nodes.get(c as usize) {
                                ready.entry((n.block, n.key)).or_default().push(c);
                            }
                        }
                    }
                }
            }
            self.profile.time_schedule += t0.elapsed();
        }
        if waiting.is_empty() {
            Ok(())
        } else {
            Err(RunError::new("internal: dataflow graph has a cycle"))
        }
    }
}
