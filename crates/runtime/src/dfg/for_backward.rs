//! Recording for the backward pass ([`crate::backward`]): the launches in order, node arguments
//! kept after their launch, and — when the backward is to differentiate from kept values instead
//! of recomputing — every launch run operator by operator with all its values kept.

use super::*;

/// What the forward recorded for the backward pass ([`Dfg::take_backward_record`]).
pub(crate) struct BackwardRecord {
    /// The launches in order: the nodes each computed.
    pub log: Vec<Vec<u32>>,
    /// Per launch, what it kept.
    pub kept: Vec<Option<Kept>>,
    /// The invocations computed once for identical ones.
    pub twins: Twins,
}

/// Per node id, the invocation whose results it holds when it took an identical one's
/// ([`Dfg::identical_invocations`]; the launch log lists only that one).
pub(crate) struct Twins(Vec<u32>);

impl Twins {
    /// The node that computed `node`'s results: itself, or the twin it took them from.
    pub(crate) fn canonical(&self, node: u32) -> u32 {
        match self.0.get(node as usize) {
            Some(&c) if c != NO_CLASS => c,
            _ => node,
        }
    }

    /// `(node, the node it took its results from)` for every invocation that took a twin's.
    pub(crate) fn aliases(&self) -> impl Iterator<Item = (u32, u32)> + '_ {
        (0u32..)
            .zip(&self.0)
            .filter(|&(n, &c)| c != NO_CLASS && c != n)
            .map(|(n, &c)| (n, c))
    }
}

impl Dfg<'_> {
    /// Records for the backward pass: every launch's nodes in order, and node arguments kept
    /// after their launch. Every float value must stay on the graph for the backward to see it,
    /// so nothing is computed off it: no host scalars, and a computed input stays a reference to
    /// its node instead of becoming a value. With `keep`, launches run their operators one by
    /// one with `keep` tried before each reference kernel (instead of the fused plans) and keep
    /// every value, so the backward need not recompute them. With `sums` (and the runtime's sum
    /// fusion on), `add`s of computed tensors stay deferred sums as in a forward-only run: no
    /// launch of their own, their terms added where a launch reads them; the backward hands a
    /// sum's adjoint to its terms ([`Dfg::sum_terms`]).
    pub(crate) fn record_for_backward(&mut self, keep: Option<crate::kept::KeptMode>, sums: bool) {
        self.launch_log = Some(Vec::new());
        self.keep = keep;
        self.backward_sums = sums;
        // The backward reads every output the forward computed.
        self.opts.early_release = false;
    }

    /// The terms of node `id` if it is a deferred sum (sum fusion): its value is their sum, so
    /// its adjoint is each term's.
    pub(crate) fn sum_terms(&self, id: u32) -> Option<&[Arg]> {
        self.nodes
            .get(id as usize)
            .filter(|n| n.sum)
            .map(|n| n.args.as_slice())
    }

    /// The launches so far, in order (the nodes each computed), what each kept (see
    /// [`Dfg::record_for_backward`]), and the invocations that took an identical one's results
    /// instead (`(node, the node it took them from)`: its adjoint is that node's), taken out of
    /// the graph; recording stops.
    pub(crate) fn take_backward_record(&mut self) -> BackwardRecord {
        BackwardRecord {
            log: self.launch_log.take().unwrap_or_default(),
            kept: std::mem::take(&mut self.kept),
            // A copy: launches of the backward's recomputed forward still ask which computed
            // inputs are one value ([`Dfg::one_computed_value`]).
            twins: Twins(self.memo_class.clone()),
        }
    }

    /// The `n_inputs` inputs of a launch of nodes `ids` the way the backward differentiates
    /// them: a tensor passed to every row (one buffer and shape) once, else the rows stacked
    /// (`fast`: f32 rows copied where they lie, without a tensor per row first).
    pub(crate) fn stacked_inputs(
        &self,
        n_inputs: usize,
        ids: &[u32],
        fast: bool,
    ) -> Result<Vec<BV>, RunError> {
        let internal = |m: &str| RunError::new(format!("internal: backward: {m}"));
        let nodes = ids
            .iter()
            .map(|&id| {
                self.nodes
                    .get(id as usize)
                    .ok_or_else(|| internal("unknown node"))
            })
            .collect::<Result<Vec<_>, _>>()?;
        let mut inputs: Vec<BV> = Vec::with_capacity(n_inputs);
        for i in 0..n_inputs {
            let args: Vec<&Arg> = nodes
                .iter()
                .map(|n| n.args.get(i).ok_or_else(|| internal("missing argument")))
                .collect::<Result<_, _>>()?;
            let shared = match args.first() {
                Some(Arg::Val(f)) => args.iter().all(
                    |a| matches!(a, Arg::Val(t) if t.shares_buffer(f) && t.shape() == f.shape()),
                ),
                _ => false,
            };
            if shared {
                if let Some(Arg::Val(f)) = args.first() {
                    inputs.push(BV::Shared(OpValue::Tensor(f.clone())));
                    continue;
                }
            }
            // One computed value read by every row (a slice of weights recorded once): passed
            // once, its adjoint the sum over the rows (as the forward's launch passed it).
            let one_expected = nodes
                .first()
                .is_some_and(|n| self.reuse.is_shared(n.block, i));
            if let Some(first) = self.one_computed_value(&args, args.len() > 1 || one_expected) {
                inputs.push(BV::Shared(OpValue::Tensor(self.whole_value(first)?)));
                continue;
            }
            // Exactly rows 0..b of one earlier launch's output, in order: that output itself.
            if fast && kept_zero_copy_enabled() {
                if let Some(t) = self.whole_batch(&args)? {
                    inputs.push(BV::Batched(OpValue::Tensor(t)));
                    continue;
                }
            }
            if fast {
                if let Some(t) = self.stack_f32(&args) {
                    inputs.push(BV::Batched(OpValue::Tensor(t)));
                    continue;
                }
            }
            let rows = args
                .iter()
                .map(|a| match a {
                    Arg::Val(t) => Ok(t.clone()),
                    Arg::Lazy(r) => self
                        .concrete(*r)?
                        .ok_or_else(|| internal("input not computed")),
                })
                .collect::<Result<Vec<_>, _>>()?;
            let refs: Vec<&Tensor> = rows.iter().collect();
            inputs.push(BV::Batched(OpValue::Tensor(
                Tensor::stack(&refs).map_err(|e| internal(&e.to_string()))?,
            )));
        }
        Ok(inputs)
    }

    /// The one computed value every invocation of a launch reads as its input (`args`, one per
    /// invocation): the same output of one node, or of identical invocations computed once (a
    /// weight derived in `@main` — `reshape(%V)`, `transpose(%W)` — by every instance: twins of
    /// one node), passed once and its adjoint the rows' sum; `None` otherwise or when `allowed`
    /// is false. (Stacked instead, a weight derived per instance was one weight per row in the
    /// backward: a weight-sized gradient per row, 31× the forward.)
    pub(crate) fn one_computed_value(&self, args: &[&Arg], allowed: bool) -> Option<LazyRef> {
        let canonical = |r: &LazyRef| LazyRef {
            node: match self.memo_class.get(r.node as usize) {
                Some(&c) if c != NO_CLASS => c,
                _ => r.node,
            },
            output: r.output,
        };
        let Some(Arg::Lazy(first)) = args.first().filter(|_| allowed) else {
            return None;
        };
        // Twins count only while recording for a backward: in a plain run a weight derived per
        // instance is a derived parameter already, and a product that took twins' rows as one
        // weight would give an instance other bits than in other company.
        if self.launch_log.is_none() {
            return args
                .iter()
                .all(|a| matches!(a, Arg::Lazy(r) if r == first))
                .then_some(*first);
        }
        let c = canonical(first);
        // The first reader's own reference: every twin holds the value, and the node that ran
        // may have been released already (nothing names it once its twins took its results).
        args.iter()
            .all(|a| matches!(a, Arg::Lazy(r) if r == first || canonical(r) == c))
            .then_some(*first)
    }

    /// The output of one earlier launch when `args` are exactly its rows 0..b in order (no copy
    /// needed: the stacked input would equal it), else `None`.
    pub(super) fn whole_batch(&self, args: &[&Arg]) -> Result<Option<Tensor>, RunError> {
        let mut batch: Option<&Tensor> = None;
        for (k, a) in args.iter().enumerate() {
            let Arg::Lazy(r) = a else {
                return Ok(None);
            };
            let s = self.slot(r)?;
            match (batch, s.row()) {
                (None, Some(0)) if k == 0 => batch = Some(&s.tensor),
                (Some(t), Some(row)) if row as usize == k && t.shares_buffer(&s.tensor) => {}
                _ => return Ok(None),
            }
        }
        // All of its rows (stacking them would give the same tensor: rows of its inner shape).
        Ok(batch
            .filter(|t| t.shape().first() == Some(&args.len()))
            .cloned())
    }

    /// A launch input stacked from its rows where they lie (f32 values of one shape), without a
    /// copy of each row first; `None` where a row is not such a value (the general path then
    /// copies).
    fn stack_f32(&self, args: &[&Arg]) -> Option<Tensor> {
        let mut data: Vec<f32> = Vec::new();
        let mut row_shape: Option<&[usize]> = None;
        for a in args {
            let (v, shape) = match a {
                Arg::Val(t) => (t.as_f32()?, t.shape()),
                Arg::Lazy(r) => self.f32_view(*r)?,
            };
            match row_shape {
                None => {
                    row_shape = Some(shape);
                    // A recycled buffer when one fits: a launch's stacked inputs, every step.
                    data = tumble_tensor::pool::with_capacity_f32(v.len() * args.len());
                }
                Some(s) if s != shape => return None,
                Some(_) => {}
            }
            data.extend_from_slice(v);
        }
        let mut shape = vec![args.len()];
        shape.extend_from_slice(row_shape?);
        Tensor::from_vec(shape, data).ok()
    }
}

/// Launch inputs that are exactly an earlier launch's output are kept as that output, not
/// copied (`TUMBLE_NO_KEPT_ZERO_COPY=1` copies them, the A/B baseline).
fn kept_zero_copy_enabled() -> bool {
    !tumble_limits::switch_on!("TUMBLE_NO_KEPT_ZERO_COPY")
}
