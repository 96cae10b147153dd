//! Launching a group of nodes of one block: chunking for locality, attributing a failure to the
//! first failing invocation, gathering inputs (shared once, earlier outputs in order reused,
//! others as row lists) and running the block's kernel plan or batching rules.

use std::borrow::Cow;

use super::*;
use crate::memo::InvocationKeys;

/// Where invocation `row`'s value of a launch output lies.
pub(super) fn slot_of(o: &BV, row: usize) -> Result<Slot, RunError> {
    match o {
        BV::Shared(OpValue::Tensor(t)) => Ok(Slot {
            tensor: t.clone(),
            at: At::Whole,
        }),
        BV::Batched(OpValue::Tensor(t)) => Ok(Slot {
            tensor: t.clone(),
            at: At::Row(row as u32),
        }),
        // Gather views: the invocation's own row of the table, where it lies.
        BV::Rows(r) => match r.part_ref(row) {
            Some((t, at)) => Ok(Slot {
                tensor: t.clone(),
                at: at.map_or(At::Whole, |a| At::Row(a as u32)),
            }),
            None => Err(RunError::new("internal: block output has too few rows")),
        },
        _ => Err(RunError::new("internal: block output is not a tensor")),
    }
}

/// Per-invocation input values above this many elements are keyed by their buffer (a weight:
/// one tensor for every invocation) instead of compared element by element (memoizing is for
/// small keys such as token ids).
const MEMO_MAX_ELEMENTS: usize = 64;

/// The elements of `t` as bit patterns, tagged with the element type (floats by their bits:
/// `-0.0` and `0.0`, or two NaNs, differ — a key, not a comparison of values).
fn push_bits(t: &Tensor, key: &mut Vec<u64>) -> Option<()> {
    use tumble_ir::DType;
    match t.dtype() {
        DType::Float32 => {
            key.push(1);
            key.extend(t.as_slice::<f32>()?.iter().map(|v| u64::from(v.to_bits())));
        }
        DType::Float64 => {
            key.push(2);
            key.extend(t.as_slice::<f64>()?.iter().map(|v| v.to_bits()));
        }
        DType::Int32 => {
            key.push(3);
            key.extend(t.as_slice::<i32>()?.iter().map(|&v| v as u32 as u64));
        }
        DType::Int64 => {
            key.push(4);
            key.extend(t.as_slice::<i64>()?.iter().map(|&v| v as u64));
        }
        DType::Bool => {
            key.push(5);
            key.extend(t.as_slice::<bool>()?.iter().map(|&v| u64::from(v)));
        }
    }
    Some(())
}

/// Appends host value `t` to an invocation's key: its shape, then its elements (small values) or
/// its buffer's identity (large ones, and floats when `floats_by_identity`: while recording for a
/// backward, and for a model weight — a 64-element bias compared element by element made a
/// small model's keys 150 words long, for a value that is the same tensor every time). True when keyed by
/// identity (the key then names `t`'s buffer: whoever keeps the key must keep `t`).
fn push_value_key(t: &Tensor, floats_by_identity: bool, key: &mut Vec<u64>) -> Option<bool> {
    key.extend(t.shape().iter().map(|&d| d as u64));
    key.push(u64::MAX);
    if keyed_by_identity(t, floats_by_identity) {
        key.push(t.buffer_id() as u64);
        Some(true)
    } else {
        push_bits(t, key)?;
        Some(false)
    }
}

/// Whether [`push_value_key`] keys `t` by its buffer rather than its elements.
fn keyed_by_identity(t: &Tensor, floats_by_identity: bool) -> bool {
    t.len() > MEMO_MAX_ELEMENTS || (floats_by_identity && t.dtype().is_float())
}

/// `TUMBLE_NO_MEMO=1`: every invocation of a launch computes its own results.
fn memo_enabled() -> bool {
    !tumble_limits::switch_on!("TUMBLE_NO_MEMO")
}

impl Dfg<'_> {
    /// Runs `block` for the nodes `ids`: one batched call, or for a block with per-invocation
    /// weights, calls over chunks whose per-instance inputs fit in cache.
    pub(super) fn launch(&mut self, block_id: u32, ids: &[u32]) -> Result<(), RunError> {
        // Every launch reads the job's packed weights, whoever owns the graph (a run's
        // mini-batch, a serving session, a recorded forward): outside the cache each GEMM stage
        // packs its weight again (sessions did, until the twenty-eighth session).
        let _weights = crate::gemm::WeightCache::enter(&self.exec.weights);
        let threads = self.opts.threads + self.lent.map_or(0, Lending::share);
        let chunk = self.exec.chunk_size(block_id, threads);
        if let Some((groups, rest)) = self.weight_groups(block_id, ids) {
            for group in &groups {
                self.launch_part(block_id, group)?;
            }
            for part in rest.chunks(chunk) {
                self.launch_part(block_id, part)?;
            }
            return Ok(());
        }
        for part in ids.chunks(chunk) {
            self.launch_part(block_id, part)?;
        }
        Ok(())
    }

    /// The invocations of a launch of `block_id` grouped by the weight tensors they pass to its
    /// products' chosen-weight inputs ([`crate::Executable`]'s `chosen_weights`), in the order
    /// they come: the groups of two or more, each to launch whole with its weights passed once
    /// ([`Dfg::gather`] finds them the same tensor everywhere), and the rest (a weight met once,
    /// or computed rather than a value) to launch as before. `None`: no group of two.
    fn weight_groups(&self, block_id: u32, ids: &[u32]) -> Option<(Vec<Vec<u32>>, Vec<u32>)> {
        let inputs = self.grouped_weights(block_id)?;
        if ids.len() < 2 {
            return None;
        }
        let mut index: std::collections::HashMap<Vec<usize>, usize> =
            std::collections::HashMap::new();
        let mut groups: Vec<Vec<u32>> = Vec::new();
        // Per invocation, its group (`None`: an input computed, not a value).
        let mut group_of: Vec<Option<usize>> = Vec::with_capacity(ids.len());
        for &id in ids {
            let key: Option<Vec<usize>> = self.nodes.get(id as usize).and_then(|n| {
                inputs
                    .iter()
                    .map(|&i| match n.args.get(i as usize) {
                        Some(Arg::Val(t)) if self.is_model_weight(t) => Some(t.buffer_id()),
                        _ => None,
                    })
                    .collect()
            });
            group_of.push(key.map(|key| {
                let next = groups.len();
                let g = *index.entry(key).or_insert(next);
                if g == next {
                    groups.push(Vec::new());
                }
                if let Some(group) = groups.get_mut(g) {
                    group.push(id);
                }
                g
            }));
        }
        let whole = |g: &Option<usize>| g.and_then(|g| groups.get(g)).is_some_and(|g| g.len() > 1);
        if !group_of.iter().any(whole) {
            return None;
        }
        // The rest keep the order they came in (their chunks then are those of before).
        let rest: Vec<u32> = ids
            .iter()
            .zip(&group_of)
            .filter(|(_, g)| !whole(g))
            .map(|(&id, _)| id)
            .collect();
        let whole: Vec<Vec<u32>> = groups.into_iter().filter(|g| g.len() > 1).collect();
        Some((whole, rest))
    }

    /// The inputs of `block_id` whose model weights group its launches (its products'
    /// per-instance weights, [`crate::Executable`]'s `chosen_weights`); `None` when there are
    /// none, or while recording for a backward (a recorded forward keeps its launches as the
    /// reuse analysis planned them: the backward sums a weight's gradient by where it came from).
    fn grouped_weights(&self, block_id: u32) -> Option<&[u32]> {
        let inputs = self.exec.chosen_weights.get(block_id as usize)?;
        (!inputs.is_empty() && self.launch_log.is_none()).then_some(inputs.as_slice())
    }

    /// One launch of `block_id` over `part` (a chunk or group of a launch's invocations), its
    /// bookkeeping timed as `outputs`.
    fn launch_part(&mut self, block_id: u32, part: &[u32]) -> Result<(), RunError> {
        if let Some(instance) = self.stopped_instance() {
            self.failed_instance = Some(instance);
            self.stop_fired = Some(instance);
            return Err(RunError::new(
                "stopped: its request timed out or its client went away",
            ));
        }
        // What the launch spends outside its gather and kernels is its bookkeeping.
        let t0 = Instant::now();
        let inner = self.profile.time_gather + self.profile.time_kernels;
        let r = self.launch_attributed(block_id, part);
        let inner = self.profile.time_gather + self.profile.time_kernels - inner;
        self.profile.time_outputs += t0.elapsed().saturating_sub(inner);
        r
    }

    /// [`Dfg::launch_batch`]; when a launch of several invocations fails, each runs alone so that
    /// the error is the first failing invocation's own and names its instance
    /// (`failed_instance`) instead of the whole mini-batch. Launches compute and store values
    /// only, so running the others alone changes nothing but the time of a run that fails anyway.
    pub(super) fn launch_attributed(&mut self, block_id: u32, ids: &[u32]) -> Result<(), RunError> {
        let Err(batch_error) = self.launch_batch(block_id, ids) else {
            return Ok(());
        };
        let instance_of = |dfg: &Self, id: u32| dfg.nodes.get(id as usize).map(|n| n.instance);
        if ids.len() > 1 {
            for &id in ids {
                if let Err(e) = self.launch_batch(block_id, &[id]) {
                    self.failed_instance = instance_of(self, id);
                    return Err(e);
                }
            }
        }
        self.failed_instance = ids.first().and_then(|&id| instance_of(self, id));
        Err(batch_error)
    }

    /// Runs `block` for the nodes `ids` as one batched call; invocations identical to an earlier
    /// one of the launch (see [`Dfg::identical_invocations`]) take its results instead of rows
    /// of their own.
    pub(super) fn launch_batch(&mut self, block_id: u32, ids: &[u32]) -> Result<(), RunError> {
        if ids
            .first()
            .and_then(|&i| self.nodes.get(i as usize))
            .is_some_and(|n| n.ragged)
        {
            return match self.launch_ragged(block_id, ids) {
                Err(e) if ids.len() == 1 => Err(self.locate_ragged(block_id, ids, e)),
                r => r,
            };
        }
        if let Some(keys) = self.job_memo_keys(block_id, ids) {
            return self.launch_with_job_memo(block_id, ids, keys);
        }
        self.launch_computing(block_id, ids, None)
    }

    /// The job-memo keys of a launch's invocations ([`crate::memo`]): `None` when the launch
    /// cannot use the memo (off, recording for a backward, a block with random draws or without
    /// a product: `Executable::memo_blocks`); per invocation none when an input is computed
    /// (only invocations of host values are kept). A key is the block, then each input's
    /// [`push_value_key`].
    fn job_memo_keys(&self, block_id: u32, ids: &[u32]) -> Option<InvocationKeys> {
        // (On a device a launch's outputs may live there: kept rows are a host idea.)
        if self.launch_log.is_some()
            || self.exec.device.is_some()
            || !self.opts.job_memo
            || !self.exec.memo_blocks.get(block_id as usize).copied()?
            || self.exec.memo.trial(block_id) == Some(false)
        {
            return None;
        }
        let mut keys = InvocationKeys::with_capacity(ids.len());
        let mut any = false;
        for &id in ids {
            any |= keys.push_with(|words| {
                let Some(args) = self.nodes.get(id as usize).map(|n| &n.args) else {
                    return false;
                };
                // A computed input: no key (looked at before any is built, as most launches of
                // a step's block read a state).
                if args.iter().any(|a| matches!(a, Arg::Lazy(_))) {
                    return false;
                }
                words.push(u64::from(block_id));
                args.iter().all(|a| match a {
                    Arg::Val(t) => push_value_key(t, self.small_weight(t), words).is_some(),
                    Arg::Lazy(_) => false,
                })
            });
        }
        if !any {
            // None of them can be kept or found: a block whose invocations all read computed
            // values (an RNN step merged with its input transform) stops being looked at,
            // instead of staying on trial, its launches scanned, for the whole job
            // (`JobMemo::record_unkeyed`).
            self.exec.memo.record_unkeyed(block_id, ids.len());
            return None;
        }
        Some(keys)
    }

    /// [`Dfg::launch_batch`] for invocations some of which an earlier launch of the job may have
    /// computed: those take the kept results (invocations of one launch taking the same ones join
    /// one class of identical invocations, as a launch's own repeats do), the others run, and
    /// what they computed is kept for later launches.
    fn launch_with_job_memo(
        &mut self,
        block_id: u32,
        ids: &[u32],
        keys: InvocationKeys,
    ) -> Result<(), RunError> {
        let found = self.exec.memo.lookup(&keys);
        if self.exec.memo.trial(block_id).is_none() {
            // Repeats: kept results found, and keys met earlier in this launch.
            let mut distinct: crate::intern::WordMap<&[u64], ()> = Default::default();
            let (mut seen, mut repeats) = (0, 0);
            for (f, k) in found.iter().zip(keys.iter()) {
                let Some(k) = k else { continue };
                seen += 1;
                if f.is_some() || distinct.insert(k, ()).is_some() {
                    repeats += 1;
                }
            }
            self.exec.memo.record(block_id, seen, repeats);
        }
        let mut run = Vec::with_capacity(ids.len());
        // The keys of those that run, for `identical_invocations` (which keys them alike).
        let mut run_keys = Vec::with_capacity(ids.len());
        // Per invocation that runs with a key: the tensors its key names by identity, which the
        // memo must hold while it keeps the key (read now: a launch consumes its arguments).
        let mut pinned: Vec<Vec<Tensor>> = Vec::new();
        for ((&id, f), k) in ids.iter().zip(&found).zip(keys.iter()) {
            if f.is_none() {
                run.push(id);
                run_keys.push(k);
                if k.is_some() {
                    pinned.push(self.identity_keyed_args(id));
                }
            }
        }
        // The others first: when their launch fails, nothing of this one is stored, so that
        // running its invocations one by one (`launch_attributed`) starts from where it was.
        if !run.is_empty() {
            self.launch_computing(block_id, &run, Some(&run_keys))?;
        }
        self.profile.job_memoized += (ids.len() - run.len()) as u64;
        let mut first: crate::intern::WordMap<&[u64], u32> = Default::default();
        let mut classes = Vec::new();
        let (mut hit_ids, mut hit_outs) = (Vec::new(), Vec::new());
        for ((&id, f), k) in ids.iter().zip(&found).zip(keys.iter()) {
            let (Some(results), Some(k)) = (f, k) else {
                continue;
            };
            hit_ids.push(id);
            hit_outs.push(Outs::from_vec(
                results
                    .iter()
                    .map(|r| Slot {
                        tensor: r.tensor.clone(),
                        at: r.row.map_or(At::Whole, At::Row),
                    })
                    .collect(),
            ));
            // Invocations of this launch that took the same kept results: one class.
            match first.get(k) {
                Some(&rep) => classes.push((id, rep)),
                None => {
                    first.insert(k, id);
                }
            }
        }
        self.store_outputs(&hit_ids, hit_outs);
        for (id, rep) in classes {
            self.join_memo_class(id, rep);
        }
        // Keep what ran: each entry a row of the launch's output where every row it computed has
        // a key (all go in, so the output held is what the memo counts, but for the launch at
        // which it fills up), else a copy of the row.
        let every_row_kept = pinned.len() == run.len();
        let mut pinned = pinned.into_iter();
        for ((&id, f), k) in ids.iter().zip(&found).zip(keys.iter()) {
            let (None, Some(k)) = (f, k) else { continue };
            let Some(pins) = pinned.next() else { break };
            let Some(Some(outs)) = self.nodes.get(id as usize).map(|n| n.out.as_ref()) else {
                continue;
            };
            let results = (0..)
                .map_while(|i| outs.get(i))
                .map(|slot| slot.kept(every_row_kept))
                .collect::<Result<Vec<_>, _>>();
            if let Ok(results) = results {
                self.exec.memo.insert(k, results.into_boxed_slice(), &pins);
            }
        }
        Ok(())
    }

    /// A model weight small enough to be keyed by its elements otherwise (a bias): keyed by its
    /// identity instead (only small floats are looked up).
    fn small_weight(&self, t: &Tensor) -> bool {
        t.len() <= MEMO_MAX_ELEMENTS && t.dtype().is_float() && self.is_model_weight(t)
    }

    /// The host values of node `id` that a key names by buffer identity (see
    /// [`push_value_key`]).
    fn identity_keyed_args(&self, id: u32) -> Vec<Tensor> {
        self.nodes.get(id as usize).map_or_else(Vec::new, |n| {
            n.args
                .iter()
                .filter_map(|a| match a {
                    Arg::Val(t) if keyed_by_identity(t, self.small_weight(t)) => Some(t.clone()),
                    _ => None,
                })
                .collect()
        })
    }

    /// Runs `block` for the nodes `ids`, each repeat of an identical invocation of the launch
    /// taking its results; `keys`: their job-memo keys where the launch has them (per
    /// invocation, in order), which [`Dfg::identical_invocations`] reads instead of keying them
    /// again.
    fn launch_computing(
        &mut self,
        block_id: u32,
        ids: &[u32],
        keys: Option<&[Option<&[u64]>]>,
    ) -> Result<(), RunError> {
        let (per_node, kept, ran) = match self.identical_invocations(block_id, ids, keys) {
            Some((distinct, of)) => {
                let (outs, kept) = self.run_launch(block_id, &distinct)?;
                self.profile.memoized += (ids.len() - distinct.len()) as u64;
                let outs = of
                    .iter()
                    .map(|&k| {
                        outs.get(k).cloned().ok_or_else(|| {
                            RunError::new("internal: memoized invocation without a result")
                        })
                    })
                    .collect::<Result<Vec<_>, _>>()?;
                for (&id, &k) in ids.iter().zip(&of) {
                    match distinct.get(k) {
                        Some(&rep) if rep != id => self.join_memo_class(id, rep),
                        _ => {}
                    }
                }
                (outs, kept, Cow::Owned(distinct))
            }
            None => {
                let (outs, kept) = self.run_launch(block_id, ids)?;
                (outs, kept, Cow::Borrowed(ids))
            }
        };
        self.store_outputs(ids, per_node);
        if let Some(log) = &mut self.launch_log {
            // The backward differentiates the invocations that ran; the others' adjoints are
            // added to theirs (`memo_class`), which is their sum's vjp.
            log.push(ran.into_owned());
            self.kept.push(kept);
        }
        Ok(())
    }

    /// The invocations of a launch that compute something new, when some repeat an earlier one:
    /// the distinct ones and, per invocation, its distinct one's position. Two invocations of a
    /// block without random draws compute the same results when their inputs are the same: a
    /// small value the host holds compared by content (a token id: a mini-batch's leaves repeat
    /// ",", "the", "."), a larger one (a weight) by identity, and a computed one by the
    /// invocation that computed it, once that one took an identical invocation's results (the
    /// forget gate over two leaves of one word). (The zoo's outputs are byte-identical with it
    /// on and off.) `None`: nothing repeats, an input is computed by an invocation of its own
    /// (a recurrent state, different per invocation), or memoizing is off (`TUMBLE_NO_MEMO=1`).
    /// While recording for a backward, float inputs are compared by identity only, so that
    /// invocations taking one's results read the same parameters — the same gradients.
    ///
    /// Keys are the job memo's (the block, then each input's [`push_value_key`]; a computed
    /// input as its class and output): `known` gives those the memo already built (per
    /// invocation, `None` for one with a computed input), the others are built here, every
    /// key in one buffer.
    fn identical_invocations(
        &self,
        block_id: u32,
        ids: &[u32],
        known: Option<&[Option<&[u64]>]>,
    ) -> Option<(Vec<u32>, Vec<usize>)> {
        if ids.len() < 2 || !memo_enabled() {
            return None;
        }
        let floats_by_identity = self.launch_log.is_some();
        if !self.exec.pure_blocks.get(block_id as usize).copied()? {
            return None;
        }
        // Per invocation: its key (`Known`: the memo's; `Built(j)`: `built`'s `j`th),
        // or `Own` (an input computed by an invocation no other one repeated makes it unlike the
        // others: a recurrent state, most of a launch of steps — known before hashing the rest
        // of its inputs).
        enum Place<'k> {
            Known(&'k [u64]),
            Built(usize),
            Own,
        }
        let mut built = InvocationKeys::with_capacity(ids.len());
        let mut places = Vec::with_capacity(ids.len());
        // The classes of an invocation's computed inputs, in order: looked up once, before any
        // hashing, and read again when its key is built.
        let mut reps: Vec<u32> = Vec::new();
        for (i, &id) in ids.iter().enumerate() {
            if let Some(&Some(key)) = known.and_then(|k| k.get(i)) {
                places.push(Place::Known(key));
                continue;
            }
            reps.clear();
            let args = &self.nodes.get(id as usize)?.args;
            let mut own = false;
            for a in args {
                if let Arg::Lazy(r) = a {
                    match self.memo_class.get(r.node as usize) {
                        Some(&rep) if rep != NO_CLASS => reps.push(rep),
                        // Before any invocation repeated, the whole launch is unlike.
                        _ if self.memo_class.is_empty() => return None,
                        _ => {
                            own = true;
                            break;
                        }
                    }
                }
            }
            if own {
                places.push(Place::Own);
                continue;
            }
            let mut rep_of_lazy = reps.iter();
            let keyed = built.push_with(|key| {
                key.push(u64::from(block_id));
                args.iter().all(|a| match a {
                    Arg::Val(t) => {
                        let by_identity = floats_by_identity || self.small_weight(t);
                        push_value_key(t, by_identity, key).is_some()
                    }
                    // Every computed input has its class in `reps` (the walk above).
                    Arg::Lazy(r) => rep_of_lazy.next().is_some_and(|&rep| {
                        key.extend([u64::MAX - 1, u64::from(rep), u64::from(r.output)]);
                        true
                    }),
                })
            });
            if !keyed {
                return None;
            }
            places.push(Place::Built(built.len() - 1));
        }
        let mut index: crate::intern::WordMap<&[u64], usize> =
            crate::intern::WordMap::with_capacity_and_hasher(ids.len(), Default::default());
        let mut distinct = Vec::new();
        let mut of = Vec::with_capacity(ids.len());
        for (&id, place) in ids.iter().zip(&places) {
            let key = match place {
                Place::Known(key) => Some(*key),
                Place::Built(j) => built.get(*j),
                Place::Own => None,
            };
            let Some(key) = key else {
                distinct.push(id);
                of.push(distinct.len() - 1);
                continue;
            };
            let k = *index.entry(key).or_insert_with(|| {
                distinct.push(id);
                distinct.len() - 1
            });
            of.push(k);
        }
        (distinct.len() < ids.len()).then_some((distinct, of))
    }

    /// Invocation `id` took the results of `rep` (an invocation of its launch that ran): both
    /// join `rep`'s class, which [`Dfg::identical_invocations`] compares their readers by.
    fn join_memo_class(&mut self, id: u32, rep: u32) {
        let need = (id.max(rep) as usize) + 1;
        if self.memo_class.len() < need {
            self.memo_class.resize(need.max(self.nodes.len()), NO_CLASS);
        }
        for n in [id, rep] {
            if let Some(c) = self.memo_class.get_mut(n as usize) {
                *c = rep;
            }
        }
    }

    /// Runs `block` for the nodes `ids` as one batched call: each node's results, and what the
    /// launch kept for a backward.
    fn run_launch(
        &mut self,
        block_id: u32,
        ids: &[u32],
    ) -> Result<(Vec<Outs>, Option<crate::kept::Kept>), RunError> {
        let block = self.block(block_id)?;
        let b = ids.len();
        let first_span = ids
            .first()
            .and_then(|&i| self.nodes.get(i as usize))
            .map(|n| n.span)
            .unwrap_or_default();
        if let Err(stop) = tumble_limits::poll() {
            let mut e = tumble_interp::machine::limit_error(stop, vec![self.growth()], "");
            e.span = Some(first_span);
            return Err(e);
        }
        // Before the launch allocates: at most every node's result for every row (an upper bound:
        // row programs keep fewer), which must fit in what is left of the memory budget.
        let launch_bytes = self
            .exec
            .row_bytes
            .get(block_id as usize)
            .map_or(0, |r| r.saturating_mul(b));
        if launch_bytes >= tumble_ops::RESERVE_ABOVE {
            if let Err(stop) = tumble_limits::reserve(launch_bytes) {
                return Err(RunError::at(
                    first_span,
                    format!("in block {} ({b} invocations): {stop}", block.name),
                ));
            }
        }
        let t0 = Instant::now();
        // Recording for a backward that differentiates this launch from what it keeps: inputs
        // stacked the backward's way, the operators one by one, every value kept.
        let inputs = match self.keep {
            Some(_) => {
                if self.records_sums() {
                    for i in 0..block.inputs.len() {
                        self.materialize_sums(i, ids)?;
                    }
                }
                self.stacked_inputs(block.inputs.len(), ids, true)?
            }
            None => (0..block.inputs.len())
                .map(|i| self.gather(block_id, i, ids))
                .collect::<Result<Vec<_>, _>>()?,
        };
        self.profile.time_gather += t0.elapsed();
        if self.exec.dynamic_bytes.get(block_id as usize) == Some(&true) {
            // The static estimate above counted `?` sizes as 0: the invocations' own shapes say
            // what the operators will allocate (kept with their shape key when recorded).
            let bytes = ids
                .iter()
                .filter_map(|&id| self.nodes.get(id as usize))
                .map(|n| n.out_shapes.op_bytes)
                .fold(0, usize::saturating_add);
            if bytes >= tumble_ops::RESERVE_ABOVE && bytes > launch_bytes {
                if let Err(stop) = tumble_limits::reserve(bytes) {
                    return Err(RunError::at(
                        first_span,
                        format!("in block {} ({b} invocations): {stop}", block.name),
                    ));
                }
            }
        }
        let t1 = Instant::now();
        let threads = self.opts.threads + self.lent.map_or(0, Lending::share);
        let mut octx = OpCtx {
            rng: &mut self.launch_rng,
        };
        // The inputs go with the match (moved or dropped): the producers they reference may be
        // released below.
        let ran = {
            let inputs = inputs;
            match (self.keep, self.exec.plans.get(block_id as usize)) {
                (Some(mode), _) => {
                    let mut ops = LaunchOps {
                        octx: &mut octx,
                        stats: &mut self.profile.ops,
                        fast: mode.eval,
                        threads,
                    };
                    let memo = Some(&mut self.shared_memo);
                    let fusions = self.exec.kept_fusions.get(block_id as usize);
                    let fusions = fusions.map(|f| f.for_vjps(mode.fast_vjps));
                    run_block_kept(block, inputs, b, &mut ops, memo, fusions)
                        .and_then(|k| Ok((k.outputs(block)?, Some(k))))
                }
                (None, Some(plan)) => crate::fused::run_planned_on(
                    self.exec.device.as_deref(),
                    block,
                    plan,
                    &inputs,
                    b,
                    &mut crate::fused::LaunchCtx::new(
                        &mut octx,
                        &mut self.profile.ops,
                        &mut self.profile.fused,
                        threads,
                    ),
                )
                .map(|outs| (outs, None)),
                (None, None) => run_block_with(
                    block,
                    &inputs,
                    b,
                    &mut LaunchOps::new(&mut octx, &mut self.profile.ops, threads),
                )
                .map(|outs| (outs, None)),
            }
        };
        let (outs, kept) = match ran {
            Ok(r) => r,
            Err(m) => return Err(self.launch_failure(block_id, ids, first_span, m)),
        };
        self.profile.record_launch(&block.name, b, t1.elapsed());
        for o in &outs {
            if let BV::Batched(OpValue::Tensor(t)) = o {
                self.produced(t);
            }
        }
        let per_node = (0..ids.len())
            .map(|row| match outs.as_slice() {
                [o] => slot_of(o, row).map(Outs::One),
                _ => outs
                    .iter()
                    .map(|o| slot_of(o, row))
                    .collect::<Result<Vec<_>, _>>()
                    .map(Outs::from_vec),
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok((per_node, kept))
    }

    /// The failure `message` of a launch of `block_id` for the nodes `ids`, invoked at `site` (the
    /// first's), as a located error: at the operator that fails with that very message — found
    /// by running the block again node by node on its gathered inputs
    /// ([`batched::failing_node`]), a cold path only a failing run takes — with the invocation as
    /// the call that led there; at the invocation otherwise: no operator fails that way, a launch
    /// of several invocations (`launch_attributed` runs each alone next, and locates that one),
    /// an interrupt, a passed time limit, a memory budget or an internal error (where running the
    /// block again would only repeat it, or fail elsewhere for another reason).
    fn launch_failure(
        &mut self,
        block_id: u32,
        ids: &[u32],
        site: Span,
        message: String,
    ) -> RunError {
        let Ok(block) = self.block(block_id) else {
            return RunError::at(site, message);
        };
        let text = format!("in block {}: {message}", block.name);
        let retry = ids.len() == 1
            && tumble_limits::stop_requested().is_none()
            && !message.contains("memory budget")
            && !message.contains("internal:")
            && !message.contains("internal error");
        let node = if retry {
            self.failing_node(block_id, ids)
                .filter(|(_, m)| *m == message)
                .map(|(i, _)| i)
        } else {
            None
        };
        super::error_at_node(block, node, site, text)
    }

    /// A ragged launch's failure `e` (reported at the invocation, "in block NAME: message"),
    /// located like any launch's ([`Dfg::launch_failure`]): the block's operators are the same
    /// whichever way its rows were grouped, so a launch of one invocation is run again node by
    /// node as a plain launch.
    fn locate_ragged(&mut self, block_id: u32, ids: &[u32], e: RunError) -> RunError {
        let Ok(block) = self.block(block_id) else {
            return e;
        };
        let prefix = format!("in block {}: ", block.name);
        match (e.span, e.message.strip_prefix(&prefix)) {
            (Some(site), Some(message)) if e.trace.is_empty() && !e.internal => {
                let message = message.to_string();
                self.launch_failure(block_id, ids, site, message)
            }
            _ => e,
        }
    }

    /// [`batched::failing_node`] of a launch of `block_id` for the nodes `ids`, on inputs gathered
    /// as an inference launch gathers them; the profile's counts are left as the failed launch
    /// left them.
    fn failing_node(&mut self, block_id: u32, ids: &[u32]) -> Option<(usize, String)> {
        let block = self.block(block_id).ok()?;
        let counted = self.profile.clone();
        let inputs = (0..block.inputs.len())
            .map(|i| self.gather(block_id, i, ids))
            .collect::<Result<Vec<_>, _>>();
        let found = inputs.ok().and_then(|inputs| {
            let mut stats = crate::batched::OpStats::default();
            let mut octx = OpCtx {
                rng: &mut self.launch_rng,
            };
            let mut ops = LaunchOps::new(&mut octx, &mut stats, 1);
            crate::batched::failing_node(block, &inputs, ids.len(), &mut ops)
        });
        self.profile = counted;
        found
    }

    /// Input `i` of a launch: passed once if the same for every node, the producer's batch itself
    /// if it is exactly these rows in order, else a list of the rows where they lie (gather
    /// fusion) or stacked.
    pub(super) fn gather(&mut self, block: u32, i: usize, ids: &[u32]) -> Result<BV, RunError> {
        if self.records_sums() {
            self.materialize_sums(i, ids)?;
        }
        let args: Vec<&Arg> = ids
            .iter()
            .filter_map(|&id| self.nodes.get(id as usize).and_then(|n| n.args.get(i)))
            .collect();
        let shared_expected = self.reuse.is_shared(block, i);
        // Same concrete tensor everywhere (a weight): pass it once. A launch of one invocation
        // trivially passes "the same" tensor everywhere; a per-instance input there is still a
        // batch of one (else the plan's dense and row stages, which want batched activations,
        // would fall back to the reference kernels: Berxit under `--scheduler eager`).
        // (A weight the program chose per instance is a weight even alone in its launch: the
        // products then run as in a launch of its weight group, to the same bits.)
        let per_instance = matches!(
            self.reuse.inputs.get(block as usize).and_then(|v| v.get(i)),
            Some(crate::reuse::InputReuse::PerInstance)
        ) && !(self
            .grouped_weights(block)
            .is_some_and(|w| w.contains(&(i as u32)))
            && matches!(args.first(), Some(Arg::Val(t)) if self.is_model_weight(t)));
        if let Some(Arg::Val(first)) = args.first().filter(|_| args.len() > 1 || !per_instance) {
            if args
                .iter()
                .all(|a| matches!(a, Arg::Val(t) if t.same_tensor(first)))
            {
                self.profile.shared_inputs += 1;
                return Ok(BV::Shared(OpValue::Tensor(first.clone())));
            }
        }
        // One computed value read by every invocation (a slice of weights recorded once for the
        // backward): passed once too.
        if let Some(first) = self.one_computed_value(&args, args.len() > 1 || !per_instance) {
            self.profile.shared_inputs += 1;
            let t = self.whole_value(first)?;
            return Ok(BV::Shared(OpValue::Tensor(t)));
        }
        if shared_expected {
            self.profile.reuse_misses += 1;
        }
        // Exactly rows 0..b of one earlier launch's output: no copy.
        if let Some(t) = self.whole_batch(&args)? {
            self.profile.zero_copy_inputs += 1;
            return Ok(BV::Batched(OpValue::Tensor(t)));
        }
        // Rows of earlier outputs (or whole computed tensors) for the plan to read in place: the
        // gather is fused into the kernels (GEMM packing, row programs) instead of copied here.
        if self.opts.gather_fusion && !self.exec.plans.is_empty() {
            let mut parts = crate::batched::RowRefsBuilder::with_capacity(args.len());
            for a in &args {
                match a {
                    Arg::Val(t) => parts.push(t, None),
                    Arg::Lazy(r) => {
                        let s = self.slot(r)?;
                        match s.at {
                            At::Whole => parts.push(&s.tensor, None),
                            At::Row(x) => parts.push(&s.tensor, Some(x as usize)),
                            // A ragged launch's rows of one instance: copied out.
                            At::Rows { .. } => parts.push(&s.value().map_err(RunError::new)?, None),
                        }
                    }
                }
            }
            if let Some(rows) = parts.finish() {
                self.profile.row_list_inputs += 1;
                return Ok(BV::Rows(rows));
            }
        }
        self.profile.gathered_inputs += 1;
        let rows = args
            .iter()
            .map(|a| match a {
                Arg::Val(t) => Ok(t.clone()),
                Arg::Lazy(r) => self.slot(r)?.value().map_err(RunError::new),
            })
            .collect::<Result<Vec<_>, _>>()?;
        // A copy of every row (a weight gathered per invocation is megabytes a row): within the
        // memory budget, checked before it is made.
        let bytes = rows
            .iter()
            .map(|t| t.len().saturating_mul(t.dtype().size()))
            .fold(0usize, usize::saturating_add);
        if bytes >= tumble_ops::RESERVE_ABOVE {
            tumble_limits::reserve(bytes).map_err(|stop| {
                RunError::new(format!(
                    "input {i} of a launch of {} invocations ({}): {stop}",
                    args.len(),
                    tumble_limits::bytes_text(bytes)
                ))
            })?;
        }
        let refs: Vec<&Tensor> = rows.iter().collect();
        Tensor::stack(&refs)
            .map(|t| BV::Batched(OpValue::Tensor(t)))
            .map_err(|e| RunError::new(format!("internal: gather: {e}")))
    }
}
