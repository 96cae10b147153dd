//! Products in the layout the kernels batch: a model written with column vectors, as the
//! textbook writes an RNN (`h' = tanh(W·x + U·h + b)`, `h: (256, 1)`), says `nn.dense(%W,
//! transpose(%h))` — the weight on the left, the instance's vector as a one-row right operand —
//! and transposes vectors back and forth. Batched, that is one matrix-vector product per
//! instance (the right operand differs per instance, so each is packed as a weight of its own):
//! BiRNN in that form ran 5.1–5.8× slower than written with row vectors, with the same outputs
//! (`bench/plain_layouts.py`).
//!
//! Per block, with the reuse analysis' facts on which inputs are one value per launch:
//! - `transpose(x)` of a 2-D `x` with a dimension of 1 is `reshape(x)` (the same elements in
//!   the same order: a view instead of a copy);
//! - `nn.dense(A, B)` with `A` shared (a weight) and `B` one row of the instance's is
//!   `reshape(nn.dense(B, A))`: `A·Bᵀ` is an `(N, 1)` column holding the elements of the row
//!   `B·Aᵀ`, so the product becomes the batched GEMM of every instance's row against the packed
//!   weight;
//! - `transpose(nn.dense(A, B))` with `A` shared and `B` the instance's is `nn.dense(B, A)`;
//! - `nn.dense(x, W)` of an instance's 1-D vector `x` is the product of its one row, reshaped
//!   back;
//! - an elementwise operator whose instance operands are reshapes from one other shape runs in
//!   that shape (shared operands reshaped to it), with one reshape after it: a chain of them
//!   over column vectors runs on the products' rows, as row programs and GEMM epilogues;
//! - columns concatenated along axis 0 are their rows concatenated along axis 1, reshaped;
//! - `max`/`min` over every axis of a tensor of rank 2 or more is the same extreme of its
//!   last-axis rows' extremes (extremes do not round);
//! - a broadcast product summed over one axis, `sum(multiply(A, v), axis=[1])` of `A: (N, K)`
//!   and a row `v: (1, K)` (or over axis 0 with a column), is `nn.dense(v, A)`, reshaped;
//! - a `reshape` of a `reshape` is one `reshape`, a `reshape` to the type it has is its
//!   operand.
//!
//! Products, reshapes and transposes nothing reads any more go. Each product's terms are the
//! same products summed over the same `K`; `--no-canonical-products` keeps the blocks as
//! written.

use tumble_ir::{AttrValue, Attrs, DType, Dim, Span, Ty};

use tumble_ops::OpDef;

use crate::blocks::{
    attr, is_pure_op, renumbered, value_ty, BArg, BVal, Block, BlockInput, BlockNode,
};
use crate::program::Program;
use crate::reuse::ReuseAnalysis;

/// Rewrites every block of `program`; returns how many rewrites it made.
/// `for_gradients`: the rewrites a gradient would tell apart stay off (see
/// [`Rewriter::extreme_by_rows`]).
pub fn canonicalize(program: &mut Program, reuse: &ReuseAnalysis, for_gradients: bool) -> usize {
    let mut count = 0;
    for (b, block) in program.blocks.iter_mut().enumerate() {
        let varying = reuse.varying_inputs(b);
        // A block the entry never reaches has no facts: left alone.
        if varying.len() != block.inputs.len() {
            continue;
        }
        count += canonicalize_block(block, &varying, for_gradients);
    }
    count
}

/// A block's node list being rebuilt, and what is known of its values.
struct Rewriter<'b> {
    inputs: &'b [BlockInput],
    /// Per block input: differs between the invocations of a launch.
    varying: &'b [bool],
    nodes: Vec<BlockNode>,
    /// Per new node: computed only from shared values.
    shared: Vec<bool>,
    reshape: &'static OpDef,
    dense: &'static OpDef,
    transpose: &'static OpDef,
    /// The span and inlining calls of the node being rewritten: the nodes made in its place
    /// point where it did.
    span: Span,
    calls: Vec<Span>,
    /// Compiled for a backward pass: no rewrite whose gradient differs at ties.
    for_gradients: bool,
}

impl Rewriter<'_> {
    fn ty(&self, v: &BVal) -> Ty {
        value_ty(self.inputs, &self.nodes, v)
    }

    /// One value for every invocation of a launch: a shared input, a literal, or a pure node of
    /// those only.
    fn is_shared(&self, v: &BVal) -> bool {
        match v {
            BVal::Input(i) => !self.varying.get(*i as usize).copied().unwrap_or(true),
            BVal::Const(_) => true,
            BVal::Node(n) | BVal::Field(n, _) => {
                self.shared.get(*n as usize).copied().unwrap_or(false)
            }
        }
    }

    fn push(&mut self, n: BlockNode) -> BVal {
        let s = is_pure_op(n.op)
            && n.args
                .iter()
                .all(|a| a.values().iter().all(|v| self.is_shared(v)));
        self.shared.push(s);
        self.nodes.push(n);
        BVal::Node(self.nodes.len() as u32 - 1)
    }

    /// `reshape(x)` to `ty`: `x` itself when it has that type, one reshape of `x`'s operand when
    /// `x` is a reshape, else a new reshape node; and whether that is simpler than a reshape of
    /// `x`.
    fn reshape_to(&mut self, x: BVal, ty: &Ty) -> (BVal, bool) {
        if &self.ty(&x) == ty {
            return (x, true);
        }
        let Some(dims) = known_dims(ty) else {
            return (x, false);
        };
        let mut src = x;
        let mut simpler = false;
        if let BVal::Node(n) = &src {
            if let Some(m) = self.nodes.get(*n as usize) {
                if let (true, Some(BArg::One(inner))) = (m.op.name == "reshape", m.args.first()) {
                    let inner = inner.clone();
                    if &self.ty(&inner) == ty {
                        return (inner, true);
                    }
                    src = inner;
                    simpler = true;
                }
            }
        }
        // A 0 in `newshape` copies the input's dimension unless `allowzero` says it is a size.
        let mut attrs = vec![];
        if dims.contains(&0) {
            attrs.push(attr("allowzero", AttrValue::Bool(true)));
        }
        attrs.insert(
            0,
            attr(
                "newshape",
                AttrValue::List(dims.into_iter().map(AttrValue::Int).collect()),
            ),
        );
        let v = self.push(BlockNode {
            op: self.reshape,
            args: vec![BArg::One(src)],
            attrs: Attrs(attrs),
            ty: ty.clone(),
            span: self.span,
            calls: self.calls.clone(),
        });
        (v, simpler)
    }

    /// `nn.dense(rows, weight)` of type `ty`, with the attributes of the product it replaces.
    fn dense(&mut self, rows: BVal, weight: BVal, attrs: Attrs, ty: Ty) -> BVal {
        self.push(BlockNode {
            op: self.dense,
            args: vec![BArg::One(rows), BArg::One(weight)],
            attrs,
            ty,
            span: self.span,
            calls: self.calls.clone(),
        })
    }

    /// The value of `node` (its operands already renumbered) in the new list, and whether it
    /// was rewritten.
    fn rewrite(&mut self, node: BlockNode) -> (BVal, bool) {
        self.span = node.span;
        self.calls.clone_from(&node.calls);
        let one = |i: usize| match node.args.get(i) {
            Some(BArg::One(v)) => Some(v.clone()),
            _ => None,
        };
        match node.op.name {
            "transpose" if node.args.len() == 1 && is_swap(&node.attrs) => {
                let Some(x) = one(0) else {
                    return (self.push(node), false);
                };
                match (dims2(&self.ty(&x)), &x) {
                    // A row or a column: the same elements in the same order.
                    (Some((a, b)), _) if a == 1 || b == 1 => (self.reshape_to(x, &node.ty).0, true),
                    // (A · Bᵀ)ᵀ = B · Aᵀ, with the instance's operand as the rows.
                    (Some(_), BVal::Node(d)) => match self.swappable(*d) {
                        Some((a, b)) => (self.dense(b, a, Attrs::default(), node.ty.clone()), true),
                        None => (self.push(node), false),
                    },
                    _ => (self.push(node), false),
                }
            }
            "nn.dense" if dense_attrs_plain(&node.attrs) => {
                let (Some(a), Some(b)) = (one(0), one(1)) else {
                    return (self.push(node), false);
                };
                if let Some(v) = self.one_hot_product(&a, &b, &node.ty) {
                    return (v, true);
                }
                let out = node.ty.as_tensor().map(|(d, dt)| (d.to_vec(), dt));
                match out {
                    // A·Bᵀ (N, 1) holds the elements of the row B·Aᵀ (1, N).
                    Some((d, DType::Float32))
                        if d.len() == 2
                            && dims2(&self.ty(&b)).map(|(m, _)| m) == Some(1)
                            && self.is_shared(&a)
                            && !self.is_shared(&b) =>
                    {
                        let row = Ty::tensor(vec![Dim::Known(1), d[0]], DType::Float32);
                        let p = self.dense(b, a, Attrs::default(), row);
                        (self.reshape_to(p, &node.ty).0, true)
                    }
                    // A vector times a weight: the product of its one row, reshaped back (its
                    // elementwise tail then follows it onto the row).
                    Some((d, DType::Float32))
                        if d.len() == 1 && self.is_shared(&b) && !self.is_shared(&a) =>
                    {
                        let at = self.ty(&a);
                        let k = known_dims(&at).and_then(|d| match d[..] {
                            [k] => Some(k),
                            _ => None,
                        });
                        match (k, d[0].known(), at.as_tensor().map(|(_, dt)| dt)) {
                            (Some(k), Some(n), Some(dt)) => {
                                let row_in = Ty::tensor(vec![Dim::Known(1), Dim::Known(k)], dt);
                                let (x, _) = self.reshape_to(a, &row_in);
                                let row_out =
                                    Ty::tensor(vec![Dim::Known(1), Dim::Known(n)], DType::Float32);
                                let p = self.dense(x, b, node.attrs.clone(), row_out);
                                (self.reshape_to(p, &node.ty).0, true)
                            }
                            _ => (self.push(node), false),
                        }
                    }
                    _ => (self.push(node), false),
                }
            }
            "max" | "min" => match self.extreme_by_rows(&node) {
                Some(v) => (v, true),
                None => (self.push(node), false),
            },
            "sum" => match self.summed_product(&node) {
                Some(v) => (v, true),
                None => (self.push(node), false),
            },
            "nn.batch_matmul" => match self.batch_matmul_as_dense(&node) {
                Some(v) => (v, true),
                None => (self.push(node), false),
            },
            // Columns stacked along axis 0 are the concatenation of their rows, reshaped: the
            // parts then lie as rows, which a product reads in place.
            "concatenate" => match self.column_concat(&node) {
                Some((parts, total, dtype)) => {
                    let rows: Vec<BVal> = parts
                        .into_iter()
                        .map(|(v, n)| {
                            let row = Ty::tensor(vec![Dim::Known(1), Dim::Known(n)], dtype);
                            self.reshape_to(v, &row).0
                        })
                        .collect();
                    let cat = self.push(BlockNode {
                        op: node.op,
                        args: vec![BArg::Tuple(rows)],
                        attrs: Attrs(vec![attr("axis", AttrValue::Int(1))]),
                        ty: Ty::tensor(vec![Dim::Known(1), Dim::Known(total)], dtype),
                        span: node.span,
                        calls: node.calls.clone(),
                    });
                    (self.reshape_to(cat, &node.ty).0, true)
                }
                None => (self.push(node), false),
            },
            "reshape" if node.args.len() == 1 && known_dims(&node.ty).is_some() => match one(0) {
                Some(x) => self.reshape_to(x, &node.ty),
                None => (self.push(node), false),
            },
            _ if self.is_elementwise(&node) => match self.through_reshapes(&node) {
                Some((operands, row_ty)) => {
                    // The operands' own layout first, each shared one reshaped to it (once per
                    // launch, or once per run as a derived parameter).
                    let args = operands
                        .into_iter()
                        .map(|o| {
                            BArg::One(match o {
                                Operand::Row(v) => v,
                                Operand::Shared(v, ty) => self.reshape_to(v, &ty).0,
                            })
                        })
                        .collect();
                    let ty = node.ty.clone();
                    let row = self.push(BlockNode {
                        ty: row_ty,
                        args,
                        ..node
                    });
                    (self.reshape_to(row, &ty).0, true)
                }
                None => (self.push(node), false),
            },
            _ => (self.push(node), false),
        }
    }

    /// `max(x)` or `min(x)` over every axis of a tensor of rank 2 or more (a convergence test's
    /// `max(abs(h2 - h))`) is the same extreme of each last-axis row's extreme: a row reduction,
    /// which row programs and the fast one-axis paths compute, then one over what is left.
    /// Extremes do not round, so the value is the same; a reduction over several axes at once ran
    /// the reference's permute and f64 copy, and over an instance's rows of different lengths
    /// once per group of equal lengths (1.47× the row-first form on sets of 512).
    /// (Not for gradients: with ties the reference shares an extreme's gradient evenly among
    /// the elements that attain it, the row-first form among the tied rows first.)
    fn extreme_by_rows(&mut self, node: &BlockNode) -> Option<BVal> {
        if self.for_gradients
            || node.attrs.ints("axis").ok()?.is_some()
            || node.attrs.bool("exclude").ok()? == Some(true)
            || node.args.len() != 1
        {
            return None;
        }
        let Some(BArg::One(x)) = node.args.first() else {
            return None;
        };
        let xt = self.ty(x);
        let (dims, dtype) = xt.as_tensor()?;
        let (last, outer) = dims.split_last()?;
        if outer.is_empty() || last.known() == Some(0) {
            return None;
        }
        let keepdims = node.attrs.bool("keepdims").ok()?.unwrap_or(false);
        let mut inner_dims = outer.to_vec();
        if keepdims {
            inner_dims.push(Dim::Known(1));
        }
        let mut attrs = vec![attr(
            "axis",
            AttrValue::List(vec![AttrValue::Int(outer.len() as i64)]),
        )];
        if keepdims {
            attrs.push(attr("keepdims", AttrValue::Bool(true)));
        }
        let rows = self.push(BlockNode {
            op: node.op,
            args: node.args.clone(),
            attrs: Attrs(attrs),
            ty: Ty::tensor(inner_dims, dtype),
            span: node.span,
            calls: node.calls.clone(),
        });
        Some(self.push(BlockNode {
            args: vec![BArg::One(rows)],
            ..node.clone()
        }))
    }

    /// A matrix-vector product written as a broadcast product summed over one axis, as ports
    /// of `(W * h).sum(-1)` say: `sum(multiply(A, v), axis=[1])` of f32 `A: (N, K)` and
    /// `v: (1, K)` (either operand order) is the row `v · Aᵀ`, `nn.dense(v, A)`; over axis 0,
    /// of `A: (K, N)` and `v: (K, 1)`, it is `nn.dense(vᵀ, Aᵀ)`. Reshaped to the sum's type
    /// (`keepdims` either way). The `(N, K)` product of every instance was written and summed
    /// (a hypernetwork's generated matrix times its state: 3.1× the product's time). Static
    /// shapes only, so the multiply left unread cannot fail and goes. The product accumulates
    /// in f32, as every `nn.dense` does, where the reference engine's `sum` folds the rounded
    /// products in f64: on a row whose terms cancel (`1 + 1e8 - 1e8`) the result is the f32
    /// product's (0, not 1) — a user's `nn.dense` of the same operands gives the same;
    /// `--no-canonical-products` keeps the reference's bits.
    fn summed_product(&mut self, node: &BlockNode) -> Option<BVal> {
        let [axis] = node.attrs.ints("axis").ok()??[..] else {
            return None;
        };
        if node.attrs.bool("exclude").ok()? == Some(true) || node.args.len() != 1 {
            return None;
        }
        let Some(BArg::One(BVal::Node(m))) = node.args.first() else {
            return None;
        };
        let mul = self.nodes.get(*m as usize)?;
        if mul.op.name != "multiply" || mul.args.len() != 2 {
            return None;
        }
        let (Some(BArg::One(x)), Some(BArg::One(y))) = (mul.args.first(), mul.args.get(1)) else {
            return None;
        };
        let f32_2d = |v: &BVal| {
            let t = self.ty(v);
            match t.as_tensor() {
                Some((_, DType::Float32)) => dims2(&t),
                _ => None,
            }
        };
        let (dx, dy) = (f32_2d(x)?, f32_2d(y)?);
        // The matrix and the vector (the operand of the vector's shape), whichever each is.
        let operands = |is_vector: fn((i64, i64)) -> bool| match (is_vector(dx), is_vector(dy)) {
            (false, true) => Some(((x.clone(), dx), (y.clone(), dy))),
            (true, false) => Some(((y.clone(), dy), (x.clone(), dx))),
            _ => None,
        };
        let f32_row = |n: i64| Ty::tensor(vec![Dim::Known(1), Dim::Known(n)], DType::Float32);
        let product = match axis {
            1 | -1 => {
                let ((a, (n, k)), (v, (_, kv))) = operands(|(m, _)| m == 1)?;
                if k != kv {
                    return None;
                }
                self.dense(v, a, Attrs::default(), f32_row(n))
            }
            0 | -2 => {
                let ((a, (k, n)), (v, (kv, _))) = operands(|(_, n)| n == 1)?;
                if k != kv {
                    return None;
                }
                let (row, _) = self.reshape_to(v, &f32_row(k));
                let at = Ty::tensor(vec![Dim::Known(n), Dim::Known(k)], DType::Float32);
                let a = self.transpose(a, &[1, 0], at);
                self.dense(row, a, Attrs::default(), f32_row(n))
            }
            _ => return None,
        };
        Some(self.reshape_to(product, &node.ty).0)
    }

    /// `nn.batch_matmul(x, y)` of f32 `(G, M, K)` and `(G', N, K)` (or `(G', K, N)` without
    /// `transpose_b`) where one side has a batch of 1, broadcast over the other's: one product.
    /// With `x`'s batch 1, every `x · y[g]ᵀ` is a slice of the columns of `x · Yᵀ` for `Y` the
    /// `G·N` rows of `y` — a dense against a weight when `y` is one (a bilinear form's
    /// `x · V[g]`, a capsule's transforms: per invocation, the product ran on the reference's
    /// loops, 0.5 GFLOP/s); with `y`'s batch 1, `x`'s `G·M` rows times `y[0]ᵀ`.
    fn batch_matmul_as_dense(&mut self, node: &BlockNode) -> Option<BVal> {
        let flag =
            |name: &str, default: bool| node.attrs.bool(name).ok().map(|b| b.unwrap_or(default));
        let (false, tb) = (flag("transpose_a", false)?, flag("transpose_b", true)?) else {
            return None;
        };
        let plain_dtype = match node.attrs.get("out_dtype") {
            None | Some(AttrValue::None) => true,
            Some(AttrValue::Str(d)) => d.is_empty() || d == "float32",
            _ => false,
        };
        if !plain_dtype {
            return None;
        }
        let (Some(BArg::One(x)), Some(BArg::One(y))) = (node.args.first(), node.args.get(1)) else {
            return None;
        };
        let (x, y) = (x.clone(), y.clone());
        if self.is_shared(&x) && self.is_shared(&y) {
            return None;
        }
        let f32_dims = |ty: &Ty| match ty.as_tensor() {
            Some((_, DType::Float32)) => known_dims(ty),
            _ => None,
        };
        let (xs, ys, out) = (
            f32_dims(&self.ty(&x))?,
            f32_dims(&self.ty(&y))?,
            f32_dims(&node.ty)?,
        );
        let (&[gx, m, k], &[gy, a, b], &[g, om, on]) = (&xs[..], &ys[..], &out[..]) else {
            return None;
        };
        let (n, yk) = if tb { (a, b) } else { (b, a) };
        if yk != k || om != m || on != n || !(gx == 1 || gy == 1) {
            return None;
        }
        let ty = |d: &[i64]| {
            Ty::tensor(
                d.iter().map(|&v| Dim::Known(v)).collect::<Vec<_>>(),
                DType::Float32,
            )
        };
        // `y` as rows of length K.
        let y = match tb {
            true => y,
            false => self.transpose(y, &[0, 2, 1], ty(&[gy, n, k])),
        };
        if gx == 1 {
            let (rows, _) = self.reshape_to(x, &ty(&[m, k]));
            let (w, _) = self.reshape_to(y, &ty(&[gy * n, k]));
            let p = self.dense(rows, w, Attrs::default(), ty(&[m, gy * n]));
            if m == 1 {
                return Some(self.reshape_to(p, &node.ty).0);
            }
            let (p3, _) = self.reshape_to(p, &ty(&[m, g, n]));
            Some(self.transpose(p3, &[1, 0, 2], node.ty.clone()))
        } else {
            let (rows, _) = self.reshape_to(x, &ty(&[gx * m, k]));
            let (w, _) = self.reshape_to(y, &ty(&[n, k]));
            let p = self.dense(rows, w, Attrs::default(), ty(&[gx * m, n]));
            Some(self.reshape_to(p, &node.ty).0)
        }
    }

    /// `transpose(x, axes)` of type `ty`.
    /// `nn.dense(one_hot(i, 1f, 0f, depth), W)` of a shared `W (units, depth)`: the product of
    /// a row of zeros but one is row `i` of `Wᵀ` — `take(transpose(W), i)`, the transpose once
    /// per run as a derived parameter — and zeros where `i` is outside `[0, depth)`, as
    /// `one_hot` has no one there: `where(0 <= i < depth, take(..), 0f)`. An embedding written
    /// with `one_hot` (a PyTorch `F.one_hot` then a linear layer) ran `depth` times the
    /// multiply-adds of the lookup, 18× the `take` form. The other terms' sum, zeros unless `W`
    /// holds an infinity or a NaN, is added (once per run). `None` where `a` is not such a
    /// `one_hot` (other on/off values, another axis or dtype) or `W` not shared.
    fn one_hot_product(&mut self, a: &BVal, w: &BVal, out_ty: &Ty) -> Option<BVal> {
        let BVal::Node(n) = a else {
            return None;
        };
        let oh = self.nodes.get(*n as usize)?;
        if oh.op.name != "one_hot" || !self.is_shared(w) {
            return None;
        }
        let [BArg::One(idx), BArg::One(BVal::Const(on)), BArg::One(BVal::Const(off))] =
            oh.args.as_slice()
        else {
            return None;
        };
        let unit =
            |t: &tumble_tensor::Tensor, v: f64| t.len() == 1 && t.scalar_as_f64().ok() == Some(v);
        let (oh_dims, oh_dtype) = oh.ty.as_tensor()?;
        let (idx_dims, idx_dtype) = self.ty(idx).as_tensor().map(|(d, t)| (d.to_vec(), t))?;
        let axis = match oh.attrs.get("axis") {
            None | Some(AttrValue::None) => -1,
            Some(AttrValue::Int(a)) => *a,
            _ => return None,
        };
        let last = axis == -1 || axis == idx_dims.len() as i64;
        let depth = oh_dims.last()?.known()?;
        let (units, k) = dims2(&self.ty(w))?;
        let (out_dims, out_dtype) = out_ty.as_tensor()?;
        if !unit(on, 1.0)
            || !unit(off, 0.0)
            || !last
            || oh_dtype != DType::Float32
            || out_dtype != DType::Float32
            || k != depth
            || !matches!(idx_dtype, DType::Int32 | DType::Int64)
            || out_dims.len() != idx_dims.len() + 1
        {
            return None;
        }
        let idx = idx.clone();
        let out_dims = out_dims.to_vec();
        let op = |name| tumble_ops::lookup(name);
        let (take, ge, lt, and, expand, select) = (
            op("take")?,
            op("greater_equal")?,
            op("less")?,
            op("logical_and")?,
            op("expand_dims")?,
            op("where")?,
        );
        let int = |v: i64| match idx_dtype {
            DType::Int32 => tumble_tensor::Tensor::scalar_i32(v as i32),
            _ => tumble_tensor::Tensor::scalar_i64(v),
        };
        let wt = self.transpose(
            w.clone(),
            &[1, 0],
            Ty::tensor(vec![Dim::Known(depth), Dim::Known(units)], DType::Float32),
        );
        let rows = self.node(
            take,
            vec![wt, idx.clone()],
            vec![attr("axis", AttrValue::Int(0))],
            Ty::tensor(out_dims.clone(), DType::Float32),
        );
        let flags = Ty::tensor(idx_dims.clone(), DType::Bool);
        let lo = self.node(
            ge,
            vec![idx.clone(), BVal::Const(int(0))],
            vec![],
            flags.clone(),
        );
        let hi = self.node(
            lt,
            vec![idx, BVal::Const(int(depth))],
            vec![],
            flags.clone(),
        );
        let inside = self.node(and, vec![lo, hi], vec![], flags);
        let mut col = idx_dims;
        col.push(Dim::Known(1));
        let inside = self.node(
            expand,
            vec![inside],
            vec![attr("axis", AttrValue::Int(-1))],
            Ty::tensor(col, DType::Bool),
        );
        let zero = BVal::Const(tumble_tensor::Tensor::scalar_f32(0.0));
        let out_ty = Ty::tensor(out_dims, DType::Float32);
        let picked = self.node(
            select,
            vec![inside, rows, zero.clone()],
            vec![],
            out_ty.clone(),
        );
        // The product's other terms, `0 · W[:, k]`, are zeros, or NaN where a row of `W` holds
        // an infinity or a NaN: added, so a non-finite weight spoils the result as the product
        // does (a shared value: computed once per run, as a derived parameter).
        let (mul, sum, add) = (op("multiply")?, op("sum")?, op("add")?);
        let zeroed = self.node(
            mul,
            vec![w.clone(), zero],
            vec![],
            Ty::tensor(vec![Dim::Known(units), Dim::Known(depth)], DType::Float32),
        );
        let others = self.node(
            sum,
            vec![zeroed],
            vec![attr("axis", AttrValue::List(vec![AttrValue::Int(1)]))],
            Ty::tensor(vec![Dim::Known(units)], DType::Float32),
        );
        Some(self.node(add, vec![picked, others], vec![], out_ty))
    }

    /// A node of operator `op` on `args`, where the node being rewritten was.
    fn node(
        &mut self,
        op: &'static OpDef,
        args: Vec<BVal>,
        attrs: Vec<tumble_ir::attrs::Attr>,
        ty: Ty,
    ) -> BVal {
        self.push(BlockNode {
            op,
            args: args.into_iter().map(BArg::One).collect(),
            attrs: Attrs(attrs),
            ty,
            span: self.span,
            calls: self.calls.clone(),
        })
    }

    fn transpose(&mut self, x: BVal, axes: &[i64], ty: Ty) -> BVal {
        self.push(BlockNode {
            op: self.transpose,
            args: vec![BArg::One(x)],
            attrs: Attrs(vec![attr(
                "axes",
                AttrValue::List(axes.iter().map(|&a| AttrValue::Int(a)).collect()),
            )]),
            ty,
            span: self.span,
            calls: self.calls.clone(),
        })
    }

    /// The operands `(A, B)` of `nn.dense(A, B)` at node `d` when `A` is shared, `B` is not and
    /// the product is a plain 2-D f32 one.
    fn swappable(&self, d: u32) -> Option<(BVal, BVal)> {
        let m = self.nodes.get(d as usize)?;
        if m.op.name != "nn.dense" || !dense_attrs_plain(&m.attrs) {
            return None;
        }
        if !matches!(m.ty.as_tensor(), Some((dims, DType::Float32)) if dims.len() == 2) {
            return None;
        }
        let (Some(BArg::One(a)), Some(BArg::One(b))) = (m.args.first(), m.args.get(1)) else {
            return None;
        };
        (self.is_shared(a) && !self.is_shared(b)).then(|| (a.clone(), b.clone()))
    }

    /// `concatenate` of 2-D columns `(n_i, 1)` along axis 0.
    fn column_concat(&self, node: &BlockNode) -> Option<Columns> {
        let axis = match node.attrs.get("axis") {
            None | Some(AttrValue::None) => 0,
            Some(AttrValue::Int(a)) => *a,
            _ => return None,
        };
        let (out, dtype) = node.ty.as_tensor()?;
        if !matches!(axis, 0 | -2) || out.len() != 2 || out.get(1)?.known()? != 1 {
            return None;
        }
        let [BArg::Tuple(vs)] = node.args.as_slice() else {
            return None;
        };
        let mut parts = Vec::with_capacity(vs.len());
        for v in vs {
            let (n, one) = dims2(&self.ty(v))?;
            if one != 1 {
                return None;
            }
            parts.push((v.clone(), n));
        }
        let total = parts.iter().map(|(_, n)| n).sum();
        Some((parts, total, dtype))
    }

    /// An elementwise operator (numpy broadcasting allowed by the operator but not used here:
    /// every operand has the node's shape), all of it known.
    fn is_elementwise(&self, node: &BlockNode) -> bool {
        use tumble_ops::FusionClass;
        // `nn.bias_add`'s bias is a vector along `axis`, not an operand of the data's shape,
        // even when the data is a vector too: moved onto a row, it would be retyped as one
        // (`nn.prelu`'s alpha and `sequence_mask`'s lengths likewise).
        if !matches!(
            node.op.class,
            FusionClass::Elementwise | FusionClass::Broadcast
        ) || !is_pure_op(node.op)
            || node.args.is_empty()
            || matches!(node.op.name, "nn.bias_add" | "nn.prelu" | "sequence_mask")
        {
            return false;
        }
        let Some(shape) = known_dims(&node.ty) else {
            return false;
        };
        node.args.iter().all(|a| match a {
            BArg::One(v) => known_dims(&self.ty(v)).as_ref() == Some(&shape),
            BArg::Tuple(_) => false,
        })
    }

    /// An elementwise node whose instance operands are reshapes from one other shape (shared
    /// operands whatever they are) as the same operator in that shape: its operands there and
    /// its type there. A chain of elementwise operators over column vectors then runs on the
    /// rows the products made, in the row programs and GEMM epilogues, with one reshape at its
    /// end.
    fn through_reshapes(&self, node: &BlockNode) -> Option<(Vec<Operand>, Ty)> {
        let (_, dtype) = node.ty.as_tensor()?;
        let shape = known_dims(&node.ty)?;
        let elems = |d: &[i64]| d.iter().product::<i64>();
        let reshaped = |v: &BVal| -> Option<(BVal, Vec<i64>)> {
            let BVal::Node(n) = v else { return None };
            let m = self.nodes.get(*n as usize)?;
            let (true, Some(BArg::One(inner))) = (m.op.name == "reshape", m.args.first()) else {
                return None;
            };
            let d = known_dims(&self.ty(inner))?;
            (d != shape && elems(&d) == elems(&shape)).then(|| (inner.clone(), d))
        };
        // The layout is the instance's values'.
        let mut row: Option<Vec<i64>> = None;
        for a in &node.args {
            let BArg::One(v) = a else { return None };
            if self.is_shared(v) {
                continue;
            }
            if let Some((_, d)) = reshaped(v) {
                match &row {
                    None => row = Some(d),
                    Some(r) if *r == d => {}
                    Some(_) => return None,
                }
            }
        }
        let row = row?;
        let dims: Vec<Dim> = row.iter().map(|&d| Dim::Known(d)).collect();
        let mut out = Vec::with_capacity(node.args.len());
        for a in &node.args {
            let BArg::One(v) = a else { return None };
            if self.is_shared(v) {
                let dt = self.ty(v).as_tensor()?.1;
                out.push(Operand::Shared(v.clone(), Ty::tensor(dims.clone(), dt)));
                continue;
            }
            match reshaped(v) {
                Some((inner, d)) if d == row => out.push(Operand::Row(inner)),
                _ => return None,
            }
        }
        Some((out, Ty::tensor(dims, dtype)))
    }
}

fn canonicalize_block(block: &mut Block, varying: &[bool], for_gradients: bool) -> usize {
    let (Some(reshape), Some(dense), Some(transpose)) = (
        tumble_ops::lookup("reshape"),
        tumble_ops::lookup("nn.dense"),
        tumble_ops::lookup("transpose"),
    ) else {
        return 0;
    };
    let old = std::mem::take(&mut block.nodes);
    let mut r = Rewriter {
        inputs: &block.inputs,
        varying,
        nodes: Vec::with_capacity(old.len()),
        shared: Vec::with_capacity(old.len()),
        reshape,
        dense,
        transpose,
        span: Span::default(),
        calls: Vec::new(),
        for_gradients,
    };
    // Old node index → its value in the new list (a rewritten node may become another's value).
    let mut map: Vec<BVal> = Vec::with_capacity(old.len());
    let mut rewrites = 0;
    for node in old {
        let (value, rewritten) = r.rewrite(node.renumbered(&map));
        rewrites += usize::from(rewritten);
        map.push(value);
    }
    let nodes = r.nodes;
    block.outputs = block.outputs.iter().map(|v| renumbered(v, &map)).collect();
    block.nodes = nodes;
    if rewrites > 0 {
        // The products, reshapes, transposes and one-hot rows the rewrites left behind (none can
        // fail at run time). Only those: a user's
        // dead operator that can fail at run time (an integer division by zero) still fails as
        // the reference engine's does.
        block.drop_dead_nodes(|n| {
            matches!(n.op.name, "nn.dense" | "reshape" | "transpose" | "one_hot")
                || (n.op.name == "multiply" && known_dims(&n.ty).is_some())
        });
    }
    rewrites
}

/// The parts of a concatenation of columns, each with its length; the total length; the dtype.
type Columns = (Vec<(BVal, i64)>, i64, DType);

/// An operand of an elementwise node moved to its operands' layout.
enum Operand {
    /// The tensor a `reshape` operand reshaped.
    Row(BVal),
    /// A shared value, to reshape to this type.
    Shared(BVal, Ty),
}

/// `units` and `out_dtype` left at their defaults (a product the swap keeps as it is).
pub(crate) fn dense_attrs_plain(attrs: &Attrs) -> bool {
    attrs.iter().all(|a| matches!(a.value, AttrValue::None))
}

/// A transpose of a 2-D tensor that swaps its axes (`axes` absent, `None` or `[1, 0]`).
fn is_swap(attrs: &Attrs) -> bool {
    match attrs.get("axes") {
        None | Some(AttrValue::None) => true,
        Some(AttrValue::List(v)) => matches!(v.as_slice(), [AttrValue::Int(1), AttrValue::Int(0)]),
        _ => false,
    }
}

/// The two known dimensions of a 2-D tensor type.
pub(crate) fn dims2(ty: &Ty) -> Option<(i64, i64)> {
    match ty.as_tensor()?.0 {
        [a, b] => Some((a.known()?, b.known()?)),
        _ => None,
    }
}

fn known_dims(ty: &Ty) -> Option<Vec<i64>> {
    ty.as_tensor()?.0.iter().map(|d| d.known()).collect()
}
