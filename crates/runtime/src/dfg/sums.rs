//! Deferred sums (sum fusion): an invocation of a block that only adds two same-shaped f32
//! tensors is not launched; its terms are kept, chains flatten into n-ary sums, zero literals drop
//! out, and the rows are added in order when a launch (or the host) first reads them.

use super::*;

/// The most terms one deferred sum holds. Flattening copies the inner sum's terms, so a fold over
/// a long list would copy O(n²) terms (and keep every partial sum's list alive); past this many,
/// the `add` is recorded as an ordinary invocation whose launch materializes the inner sum.
pub(super) const MAX_SUM_TERMS: usize = 32;

/// How many distinct shapes of deferred sums [`Dfg::sum_shapes`] keeps a list for (a model sums
/// a few: its hidden states, its losses).
const SUM_SHAPE_LISTS: usize = 8;

/// True for a small f32 tensor of zeros (a fold's initial `zeros(..)`): adding it changes nothing.
pub(super) fn is_zero_term(t: &Tensor) -> bool {
    t.len() <= 1 << 16
        && t.as_slice::<f32>()
            .is_some_and(|v| v.iter().all(|&x| x == 0.0))
}

/// An argument's shape, borrowed from its tensor or held through its node's shared list of output
/// shapes (a clone of the list's `Rc`, so the graph can be added to meanwhile).
enum ShapeOf<'t> {
    Val(&'t Tensor),
    Node(std::rc::Rc<super::Shapes>, usize),
}

impl ShapeOf<'_> {
    fn get(&self) -> &[usize] {
        match self {
            ShapeOf::Val(t) => t.shape(),
            ShapeOf::Node(rc, i) => rc.get(*i).map_or(&[], Vec::as_slice),
        }
    }
}

impl Dfg<'_> {
    /// A one-shape list for deferred sums of `shape` (a term that is a field of a tuple, such as
    /// a tree node's `h`, has a list of two): shared by every such sum, from a short list.
    fn sum_shapes(&mut self, shape: &[usize]) -> std::rc::Rc<super::Shapes> {
        if let Some(rc) = self.sum_shape_lists.iter().find(|rc| rc[0] == shape) {
            return rc.clone();
        }
        let rc = std::rc::Rc::new(super::Shapes::of(vec![shape.to_vec()]));
        if self.sum_shape_lists.len() < SUM_SHAPE_LISTS {
            self.sum_shape_lists.push(rc.clone());
        }
        rc
    }

    /// The terms of `a` when it is a deferred sum not yet added up (a chain flattens into them).
    fn unlaunched_sum_terms(&self, a: &Arg) -> Option<&[Arg]> {
        match a {
            Arg::Lazy(r) => self
                .nodes
                .get(r.node as usize)
                .filter(|n| n.sum && n.out.is_none())
                .map(|n| n.args.as_slice()),
            Arg::Val(_) => None,
        }
    }

    fn shapes_of<'t>(&self, a: &'t Arg) -> Result<ShapeOf<'t>, RunError> {
        match a {
            Arg::Val(t) => Ok(ShapeOf::Val(t)),
            Arg::Lazy(r) => self
                .nodes
                .get(r.node as usize)
                .filter(|n| (r.output as usize) < n.out_shapes.len())
                .map(|n| ShapeOf::Node(n.out_shapes.clone(), r.output as usize))
                .ok_or_else(|| RunError::new("internal: unknown lazy value")),
        }
    }

    /// Whether `add`s of computed tensors become deferred sums in this graph: sum fusion on, and
    /// not recording for a backward that launches them ([`Dfg::record_for_backward`]'s `sums`).
    pub(super) fn records_sums(&self) -> bool {
        self.opts.sum_fusion && (self.launch_log.is_none() || self.backward_sums)
    }

    /// A deferred sum whose terms are all computed, added on the host (it is read outside any
    /// launch: a result, a condition, an operator outside a block).
    pub(super) fn sum_on_host(&self, node: &Node) -> Result<Option<Tensor>, RunError> {
        if !node.args.iter().all(|a| self.arg_ready(a)) {
            return Ok(None);
        }
        let shape = node.out_shapes.first().cloned().unwrap_or_default();
        let n = shape.iter().product();
        let mut acc = Vec::with_capacity(n);
        self.sum_terms_into(&mut acc, n, &node.args)?;
        Tensor::from_vec(shape, acc)
            .map(Some)
            .map_err(|e| RunError::new(format!("internal: sum: {e}")))
    }

    /// Appends the sum of `terms` (each `n` floats) to `out`: the first term copied, the others
    /// added in order — `(t1 + t2) + t3`, the reference's association, where a zero start
    /// `0 + t1` would turn a `-0.0` first term into `+0.0`.
    pub(super) fn sum_terms_into(
        &self,
        out: &mut Vec<f32>,
        n: usize,
        terms: &[Arg],
    ) -> Result<(), RunError> {
        let start = out.len();
        let Some((first, rest)) = terms.split_first() else {
            out.resize(start + n, 0.0);
            return Ok(());
        };
        out.extend_from_slice(self.term(first, n)?);
        let acc = out.get_mut(start..).unwrap_or_default();
        for a in rest {
            // The CPU's widest vectors (the same additions, element by element).
            crate::simd::update(acc, self.term(a, n)?, |d, s| d + s);
        }
        Ok(())
    }

    /// The `n` floats of one term of a deferred sum, where they lie.
    fn term<'a>(&'a self, a: &'a Arg, n: usize) -> Result<&'a [f32], RunError> {
        let (t, at) = match a {
            Arg::Val(t) => (t, At::Whole),
            Arg::Lazy(r) => {
                let s = self.slot(r)?;
                (&s.tensor, s.at)
            }
        };
        let all = t
            .as_slice::<f32>()
            .ok_or_else(|| RunError::new("internal: sum term is not f32"))?;
        let row_len: usize = t.shape().get(1..).map_or(1, |d| d.iter().product());
        match at {
            At::Whole => all.get(..n),
            At::Row(r) => all.get(r as usize * n..(r as usize + 1) * n),
            At::Rows { start, .. } => {
                let from = start as usize * row_len;
                all.get(from..from + n)
            }
        }
        .filter(|s| s.len() == n)
        .ok_or_else(|| RunError::new("internal: sum term has another shape"))
    }

    /// Computes the deferred sums that input `i` of a launch over `ids` reads (each
    /// once) into one batch, row by row, so that the launch finds ordinary rows of an earlier
    /// output (contiguous when it reads them in this order: no copy at all).
    pub(super) fn materialize_sums(&mut self, i: usize, ids: &[u32]) -> Result<(), RunError> {
        let unmaterialized = |dfg: &Self, id: u32| match dfg.nodes.get(id as usize)?.args.get(i)? {
            Arg::Lazy(r) => dfg
                .nodes
                .get(r.node as usize)
                .is_some_and(|n| n.sum && n.out.is_none())
                .then_some(r.node),
            Arg::Val(_) => None,
        };
        if !ids.iter().any(|&id| unmaterialized(self, id).is_some()) {
            return Ok(());
        }
        let mut seen = crate::intern::WordSet::default();
        let todo: Vec<u32> = ids
            .iter()
            .filter_map(|&id| unmaterialized(self, id))
            .filter(|&s| seen.insert(s))
            .collect();
        let Some(&first) = todo.first() else {
            return Ok(());
        };
        let Some(first_shapes) = self.nodes.get(first as usize).map(|n| n.out_shapes.clone())
        else {
            return Err(RunError::new("internal: unknown sum"));
        };
        let shape: &[usize] = first_shapes.first().map_or(&[], Vec::as_slice);
        let len: usize = shape.iter().product();
        let mut data = tumble_tensor::pool::with_capacity_f32(todo.len() * len);
        let mut terms = 0;
        for (k, &id) in todo.iter().enumerate() {
            let node = self
                .nodes
                .get(id as usize)
                .ok_or_else(|| RunError::new("internal: unknown sum"))?;
            // Nodes recorded with one shape key share their shapes (`Dfg::shape_cache`): one
            // pointer comparison instead of comparing the shapes, for all but the odd one.
            if !std::rc::Rc::ptr_eq(&node.out_shapes, &first_shapes)
                && node.out_shapes.first().map(Vec::as_slice) != Some(shape)
            {
                return Err(RunError::new(
                    "internal: sums of different shapes in one input",
                ));
            }
            debug_assert_eq!(data.len(), k * len);
            self.sum_terms_into(&mut data, len, &node.args)?;
            terms += node.args.len() as u64;
        }
        let mut batch_shape = Vec::with_capacity(shape.len() + 1);
        batch_shape.push(todo.len());
        batch_shape.extend_from_slice(shape);
        let batch = Tensor::from_vec(batch_shape, data)
            .map_err(|e| RunError::new(format!("internal: sum: {e}")))?;
        self.produced(&batch);
        let outs = (0..todo.len()).map(|k| {
            Outs::One(Slot {
                tensor: batch.clone(),
                at: At::Row(k as u32),
            })
        });
        self.store_outputs(&todo, outs);
        self.profile.sum_terms += terms;
        Ok(())
    }

    /// Sum fusion: the value of `add(a, b)` as a deferred sum, or `None` to record it normally
    /// (no uncomputed term, or shapes that would broadcast).
    pub(super) fn try_sum(
        &mut self,
        block_id: u32,
        args: &[Arg],
        span: Span,
        ctx: &InstanceCtx,
    ) -> Result<Option<Value>, RunError> {
        let instance = ctx.instance;
        if !args.iter().any(|a| matches!(a, Arg::Lazy(_))) {
            return Ok(None);
        }
        // The terms' one shape, compared where the nodes keep it (shape lists shared through the
        // shape cache compare by pointer).
        let first = self.shapes_of(&args[0])?;
        for a in &args[1..] {
            let other = self.shapes_of(a)?;
            let same = match (&first, &other) {
                (ShapeOf::Node(x, i), ShapeOf::Node(y, j))
                    if std::rc::Rc::ptr_eq(x, y) && i == j =>
                {
                    true
                }
                _ => first.get() == other.get(),
            };
            if !same {
                return Ok(None);
            }
        }
        let count = args
            .iter()
            .map(|a| self.unlaunched_sum_terms(a).map_or(1, <[Arg]>::len))
            .sum();
        let mut terms = Vec::with_capacity(count);
        for a in args {
            match (a, self.unlaunched_sum_terms(a)) {
                (_, Some(inner)) => terms.extend(inner.iter().cloned()),
                (Arg::Val(t), None) if is_zero_term(t) => {}
                (_, None) => terms.push(a.clone()),
            }
        }
        if terms.len() > MAX_SUM_TERMS {
            return Ok(None);
        }
        self.profile.sums += 1;
        if let [Arg::Lazy(r)] = terms[..] {
            // `x + 0`: the value is `x` itself.
            return Ok(Some(Value::Lazy(r)));
        }
        let depth = terms
            .iter()
            .map(|a| self.arg_depth(a))
            .max()
            .unwrap_or(1)
            .saturating_sub(1);
        let id = self.reserve_node(ctx.pending)?;
        // A term's own shape list when it is exactly the sum's (one output: the usual case),
        // else the list shared by sums of this shape: no allocation either way.
        let out_shapes = match first {
            ShapeOf::Node(rc, 0) if rc.len() == 1 => rc,
            other => self.sum_shapes(other.get()),
        };
        let life = self.recorded(&terms, release::output_bytes(&out_shapes));
        self.nodes.push(Node {
            block: block_id,
            args: terms,
            depth,
            key: 0,
            out_shapes,
            out: None,
            span,
            sum: true,
            instance,
            ragged: false,
            life,
        });
        // Never launched: a sum the host lets go of unread (a fold's partial sum, flattened into
        // the next) is released from the watch list, and its terms with it.
        self.try_release(id);
        Ok(Some(Value::Lazy(LazyRef {
            node: id,
            output: 0,
        })))
    }
}
