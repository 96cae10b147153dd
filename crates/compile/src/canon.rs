//! Products in the layout the kernels batch: a model written with column vectors, as the
//! textbook writes an RNN (`h' = tanh(W·x + U·h + b)`, `h: (256, 1)`), says `nn.dense(%W,
//! transpose(%h))` — the weight on the left, the instance's vector as a one-row right operand —
//! and transposes vectors back and forth. Batched, that is one matrix-vector product per
//! instance (the right operand differs per instance, so each is packed as a weight of its own):
//! BiRNN in that form ran 5.4× slower than written with row vectors, with the same outputs.
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
//! - a `reshape` of a `reshape` is one `reshape`, a `reshape` to the type it has is its
//!   operand.
//!
//! Products, reshapes and transposes nothing reads any more go. Each product's terms are the
//! same products summed over the same `K`; `--no-canonical-products` keeps the blocks as
//! written.

use tumble_ir::attrs::Attr;
use tumble_ir::{AttrValue, Attrs, DType, Dim, Span, Ty};

use crate::blocks::{is_pure_op, BArg, BVal, Block, BlockNode};
use crate::program::Program;
use crate::reuse::ReuseAnalysis;

/// Rewrites every block of `program`; returns how many rewrites it made.
pub fn canonicalize(program: &mut Program, reuse: &ReuseAnalysis) -> usize {
    let mut count = 0;
    for (b, block) in program.blocks.iter_mut().enumerate() {
        let varying = reuse.varying_inputs(b);
        // A block the entry never reaches has no facts: left alone.
        if varying.len() != block.inputs.len() {
            continue;
        }
        count += canonicalize_block(block, &varying);
    }
    count
}

fn canonicalize_block(block: &mut Block, varying: &[bool]) -> usize {
    let (Some(reshape), Some(dense)) = (
        tumble_ops::lookup("reshape"),
        tumble_ops::lookup("nn.dense"),
    ) else {
        return 0;
    };
    let old = std::mem::take(&mut block.nodes);
    let mut nodes: Vec<BlockNode> = Vec::with_capacity(old.len());
    // Old node index → its value in the new list (a rewritten node may become another's value).
    let mut map: Vec<BVal> = Vec::with_capacity(old.len());
    // New node index → computed only from shared values.
    let mut shared_node: Vec<bool> = Vec::with_capacity(old.len());
    let mut rewrites = 0;
    let remap = |v: &BVal, map: &[BVal]| -> BVal {
        match v {
            BVal::Node(n) => map.get(*n as usize).cloned().unwrap_or(BVal::Node(*n)),
            // Only tensor-valued nodes are ever replaced; tuple nodes keep a node of their own.
            BVal::Field(n, f) => match map.get(*n as usize) {
                Some(BVal::Node(m)) => BVal::Field(*m, *f),
                _ => BVal::Field(*n, *f),
            },
            other => other.clone(),
        }
    };
    for node in old {
        let args: Vec<BArg> = node
            .args
            .iter()
            .map(|a| match a {
                BArg::One(v) => BArg::One(remap(v, &map)),
                BArg::Tuple(vs) => BArg::Tuple(vs.iter().map(|v| remap(v, &map)).collect()),
            })
            .collect();
        let node = BlockNode { args, ..node };
        let is_shared = |v: &BVal, nodes: &[BlockNode], shared_node: &[bool]| match v {
            BVal::Input(i) => !varying.get(*i as usize).copied().unwrap_or(true),
            BVal::Const(_) => true,
            BVal::Node(n) | BVal::Field(n, _) => {
                shared_node.get(*n as usize).copied().unwrap_or(false)
                    && nodes.get(*n as usize).is_some_and(|m| is_pure_op(m.op))
            }
        };
        let ty_of = |v: &BVal, nodes: &[BlockNode]| -> Option<Ty> {
            match v {
                BVal::Node(n) => nodes.get(*n as usize).map(|m| m.ty.clone()),
                other => Some(block.val_ty(other)),
            }
        };
        let one = |i: usize| match node.args.get(i) {
            Some(BArg::One(v)) => Some(v.clone()),
            _ => None,
        };
        let mut push = |nodes: &mut Vec<BlockNode>, shared_node: &mut Vec<bool>, n: BlockNode| {
            let s = n.args.iter().all(|a| match a {
                BArg::One(v) => is_shared(v, nodes, shared_node),
                BArg::Tuple(vs) => vs.iter().all(|v| is_shared(v, nodes, shared_node)),
            });
            shared_node.push(s && is_pure_op(n.op));
            nodes.push(n);
            BVal::Node(nodes.len() as u32 - 1)
        };
        let value = match node.op.name {
            "transpose" if node.args.len() == 1 && is_swap(&node.attrs) => {
                let x = one(0);
                let xt = x.as_ref().and_then(|x| ty_of(x, &nodes));
                match (x, xt.as_ref().and_then(dims2)) {
                    // A row or a column: the same elements in the same order.
                    (Some(x), Some((a, b))) if a == 1 || b == 1 => {
                        rewrites += 1;
                        fold_reshape(
                            &mut nodes,
                            &mut shared_node,
                            &mut push,
                            reshape,
                            x,
                            &node.ty,
                            &ty_of,
                        )
                        .0
                    }
                    // (A · Bᵀ)ᵀ = B · Aᵀ, with the instance's operand as the rows.
                    (Some(BVal::Node(d)), Some(_)) => {
                        match swappable(d, &nodes, &is_shared, &shared_node) {
                            Some((a, b)) => {
                                rewrites += 1;
                                let n = BlockNode {
                                    op: dense,
                                    args: vec![BArg::One(b), BArg::One(a)],
                                    attrs: Attrs::default(),
                                    ty: node.ty.clone(),
                                };
                                push(&mut nodes, &mut shared_node, n)
                            }
                            None => push(&mut nodes, &mut shared_node, node),
                        }
                    }
                    _ => push(&mut nodes, &mut shared_node, node),
                }
            }
            "nn.dense" if node.attrs.is_empty() || dense_attrs_plain(&node.attrs) => {
                let (a, b) = (one(0), one(1));
                let bt = b.as_ref().and_then(|b| ty_of(b, &nodes));
                let rows_of_b = bt.as_ref().and_then(dims2).map(|(m, _)| m);
                let f32_out =
                    matches!(node.ty.as_tensor(), Some((d, DType::Float32)) if d.len() == 2);
                match (a, b) {
                    (Some(a), Some(b))
                        if f32_out
                            && rows_of_b == Some(1)
                            && is_shared(&a, &nodes, &shared_node)
                            && !is_shared(&b, &nodes, &shared_node) =>
                    {
                        // A·Bᵀ (N, 1) holds the elements of the row B·Aᵀ (1, N).
                        let n_out = node.ty.as_tensor().and_then(|(d, _)| d.first().copied());
                        let row_ty = Ty::tensor(
                            vec![Dim::Known(1), n_out.unwrap_or(Dim::Any)],
                            DType::Float32,
                        );
                        rewrites += 1;
                        let d = push(
                            &mut nodes,
                            &mut shared_node,
                            BlockNode {
                                op: dense,
                                args: vec![BArg::One(b), BArg::One(a)],
                                attrs: Attrs::default(),
                                ty: row_ty,
                            },
                        );
                        fold_reshape(
                            &mut nodes,
                            &mut shared_node,
                            &mut push,
                            reshape,
                            d,
                            &node.ty,
                            &ty_of,
                        )
                        .0
                    }
                    // A vector times a weight: the product of its one row, reshaped back (its
                    // elementwise tail then follows it onto the row).
                    (Some(a), Some(b))
                        if matches!(node.ty.as_tensor(), Some((d, DType::Float32)) if d.len() == 1)
                            && is_shared(&b, &nodes, &shared_node)
                            && !is_shared(&a, &nodes, &shared_node) =>
                    {
                        let at = ty_of(&a, &nodes);
                        let k = at.as_ref().and_then(known_dims).and_then(|d| match d[..] {
                            [k] => Some(k),
                            _ => None,
                        });
                        let n = known_dims(&node.ty).and_then(|d| d.first().copied());
                        match (k, n, at.and_then(|t| t.as_tensor().map(|(_, dt)| dt))) {
                            (Some(k), Some(n), Some(dt)) => {
                                rewrites += 1;
                                let row_in = Ty::tensor(vec![Dim::Known(1), Dim::Known(k)], dt);
                                let (x, _) = fold_reshape(
                                    &mut nodes,
                                    &mut shared_node,
                                    &mut push,
                                    reshape,
                                    a,
                                    &row_in,
                                    &ty_of,
                                );
                                let row_out =
                                    Ty::tensor(vec![Dim::Known(1), Dim::Known(n)], DType::Float32);
                                let d = push(
                                    &mut nodes,
                                    &mut shared_node,
                                    BlockNode {
                                        op: dense,
                                        args: vec![BArg::One(x), BArg::One(b)],
                                        attrs: node.attrs.clone(),
                                        ty: row_out,
                                    },
                                );
                                fold_reshape(
                                    &mut nodes,
                                    &mut shared_node,
                                    &mut push,
                                    reshape,
                                    d,
                                    &node.ty,
                                    &ty_of,
                                )
                                .0
                            }
                            _ => push(&mut nodes, &mut shared_node, node),
                        }
                    }
                    _ => push(&mut nodes, &mut shared_node, node),
                }
            }
            // Columns stacked along axis 0 are the concatenation of their rows, reshaped: the
            // parts then lie as rows, which a product reads in place.
            "concatenate" if column_concat(&node, &nodes, &ty_of).is_some() => {
                match column_concat(&node, &nodes, &ty_of) {
                    Some((parts, total, dtype)) => {
                        rewrites += 1;
                        let mut rows = Vec::with_capacity(parts.len());
                        for (v, n) in parts {
                            let row = Ty::tensor(vec![Dim::Known(1), Dim::Known(n)], dtype);
                            let (r, _) = fold_reshape(
                                &mut nodes,
                                &mut shared_node,
                                &mut push,
                                reshape,
                                v,
                                &row,
                                &ty_of,
                            );
                            rows.push(r);
                        }
                        let cat = push(
                            &mut nodes,
                            &mut shared_node,
                            BlockNode {
                                op: node.op,
                                args: vec![BArg::Tuple(rows)],
                                attrs: Attrs(vec![Attr {
                                    name: "axis".into(),
                                    value: AttrValue::Int(1),
                                    span: Span::default(),
                                }]),
                                ty: Ty::tensor(vec![Dim::Known(1), Dim::Known(total)], dtype),
                            },
                        );
                        fold_reshape(
                            &mut nodes,
                            &mut shared_node,
                            &mut push,
                            reshape,
                            cat,
                            &node.ty,
                            &ty_of,
                        )
                        .0
                    }
                    None => push(&mut nodes, &mut shared_node, node),
                }
            }
            "reshape" if node.args.len() == 1 && known_dims(&node.ty).is_some() => match one(0) {
                Some(x) => {
                    let (v, simpler) = fold_reshape(
                        &mut nodes,
                        &mut shared_node,
                        &mut push,
                        reshape,
                        x,
                        &node.ty,
                        &ty_of,
                    );
                    rewrites += usize::from(simpler);
                    v
                }
                None => push(&mut nodes, &mut shared_node, node),
            },
            _ if is_elementwise(&node, &ty_of, &nodes) => {
                match through_reshapes(&node, &nodes, &is_shared, &shared_node, &ty_of) {
                    Some((args, row_ty)) => {
                        // The operands' own layout first, each shared one reshaped to it (once
                        // per launch, or once per run as a derived parameter).
                        let mut new_args = Vec::with_capacity(args.len());
                        for a in args {
                            new_args.push(BArg::One(match a {
                                Operand::Row(v) => v,
                                Operand::Shared(v, ty) => {
                                    fold_reshape(
                                        &mut nodes,
                                        &mut shared_node,
                                        &mut push,
                                        reshape,
                                        v,
                                        &ty,
                                        &ty_of,
                                    )
                                    .0
                                }
                            }));
                        }
                        rewrites += 1;
                        let row = push(
                            &mut nodes,
                            &mut shared_node,
                            BlockNode {
                                ty: row_ty.clone(),
                                args: new_args,
                                ..node.clone()
                            },
                        );
                        fold_reshape(
                            &mut nodes,
                            &mut shared_node,
                            &mut push,
                            reshape,
                            row,
                            &node.ty,
                            &ty_of,
                        )
                        .0
                    }
                    None => push(&mut nodes, &mut shared_node, node),
                }
            }
            _ => push(&mut nodes, &mut shared_node, node),
        };
        map.push(value);
    }
    block.outputs = block.outputs.iter().map(|v| remap(v, &map)).collect();
    block.nodes = nodes;
    if rewrites > 0 {
        drop_dead_nodes(block);
    }
    rewrites
}

/// `reshape(x)` to `ty`: `x` itself when it has that type, one reshape of `x`'s operand when `x`
/// is a reshape, else a new reshape node; and whether that is simpler than a reshape of `x`.
#[allow(clippy::too_many_arguments)]
fn fold_reshape(
    nodes: &mut Vec<BlockNode>,
    shared_node: &mut Vec<bool>,
    push: &mut impl FnMut(&mut Vec<BlockNode>, &mut Vec<bool>, BlockNode) -> BVal,
    reshape: &'static tumble_ops::OpDef,
    x: BVal,
    ty: &Ty,
    ty_of: &impl Fn(&BVal, &[BlockNode]) -> Option<Ty>,
) -> (BVal, bool) {
    if ty_of(&x, nodes).as_ref() == Some(ty) {
        return (x, true);
    }
    let Some(dims) = known_dims(ty) else {
        return (x, false);
    };
    let mut src = x;
    let mut simpler = false;
    if let BVal::Node(n) = &src {
        if let Some(m) = nodes.get(*n as usize) {
            if m.op.name == "reshape" {
                if let Some(BArg::One(inner)) = m.args.first() {
                    if ty_of(inner, nodes).as_ref() == Some(ty) {
                        return (inner.clone(), true);
                    }
                    src = inner.clone();
                    simpler = true;
                }
            }
        }
    }
    let attrs = Attrs(vec![Attr {
        name: "newshape".into(),
        value: AttrValue::List(dims.into_iter().map(AttrValue::Int).collect()),
        span: Span::default(),
    }]);
    let v = push(
        nodes,
        shared_node,
        BlockNode {
            op: reshape,
            args: vec![BArg::One(src)],
            attrs,
            ty: ty.clone(),
        },
    );
    (v, simpler)
}

/// The operands `(A, B)` of `nn.dense(A, B)` at node `d` when `A` is shared, `B` is not and the
/// product is a plain 2-D f32 one.
fn swappable(
    d: u32,
    nodes: &[BlockNode],
    is_shared: &impl Fn(&BVal, &[BlockNode], &[bool]) -> bool,
    shared_node: &[bool],
) -> Option<(BVal, BVal)> {
    let m = nodes.get(d as usize)?;
    if m.op.name != "nn.dense" || !(m.attrs.is_empty() || dense_attrs_plain(&m.attrs)) {
        return None;
    }
    if !matches!(m.ty.as_tensor(), Some((dims, DType::Float32)) if dims.len() == 2) {
        return None;
    }
    let (Some(BArg::One(a)), Some(BArg::One(b))) = (m.args.first(), m.args.get(1)) else {
        return None;
    };
    (is_shared(a, nodes, shared_node) && !is_shared(b, nodes, shared_node))
        .then(|| (a.clone(), b.clone()))
}

/// The parts of a concatenation of columns, each with its length; the total length; the dtype.
type Columns = (Vec<(BVal, i64)>, i64, DType);

/// `concatenate` of 2-D columns `(n_i, 1)` along axis 0.
fn column_concat(
    node: &BlockNode,
    nodes: &[BlockNode],
    ty_of: &impl Fn(&BVal, &[BlockNode]) -> Option<Ty>,
) -> Option<Columns> {
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
        let (n, one) = dims2(&ty_of(v, nodes)?)?;
        if one != 1 {
            return None;
        }
        parts.push((v.clone(), n));
    }
    let total = parts.iter().map(|(_, n)| n).sum();
    Some((parts, total, dtype))
}

/// An operand of an elementwise node moved to its operands' layout.
enum Operand {
    /// The tensor a `reshape` operand reshaped.
    Row(BVal),
    /// A shared value, to reshape to this type.
    Shared(BVal, Ty),
}

/// An elementwise operator (numpy broadcasting allowed by the operator but not used here: every
/// operand has the node's shape), all of it known.
fn is_elementwise(
    node: &BlockNode,
    ty_of: &impl Fn(&BVal, &[BlockNode]) -> Option<Ty>,
    nodes: &[BlockNode],
) -> bool {
    use tumble_ops::FusionClass;
    if !matches!(
        node.op.class,
        FusionClass::Elementwise | FusionClass::Broadcast
    ) || !is_pure_op(node.op)
        || node.args.is_empty()
    {
        return false;
    }
    let Some(shape) = known_dims(&node.ty) else {
        return false;
    };
    node.args.iter().all(|a| match a {
        BArg::One(v) => ty_of(v, nodes).and_then(|t| known_dims(&t)).as_ref() == Some(&shape),
        BArg::Tuple(_) => false,
    })
}

/// An elementwise node whose operands are reshapes from one other shape (or shared values) as
/// the same operator in that shape: its operands there and its type there. A chain of
/// elementwise operators over column vectors then runs on the rows the products made, in the
/// row programs and GEMM epilogues, with one reshape at its end.
fn through_reshapes(
    node: &BlockNode,
    nodes: &[BlockNode],
    is_shared: &impl Fn(&BVal, &[BlockNode], &[bool]) -> bool,
    shared_node: &[bool],
    ty_of: &impl Fn(&BVal, &[BlockNode]) -> Option<Ty>,
) -> Option<(Vec<Operand>, Ty)> {
    let (_, dtype) = node.ty.as_tensor()?;
    let shape = known_dims(&node.ty)?;
    let elems = |d: &[i64]| d.iter().product::<i64>();
    let reshaped = |v: &BVal| -> Option<(BVal, Vec<i64>)> {
        let BVal::Node(n) = v else { return None };
        let m = nodes.get(*n as usize)?;
        if m.op.name != "reshape" {
            return None;
        }
        let Some(BArg::One(inner)) = m.args.first() else {
            return None;
        };
        let d = known_dims(&ty_of(inner, nodes)?)?;
        (d != shape && elems(&d) == elems(&shape)).then(|| (inner.clone(), d))
    };
    // The layout is the instance's values' (a shared operand is reshaped to it, whatever it is).
    let mut row: Option<Vec<i64>> = None;
    for a in &node.args {
        let BArg::One(v) = a else { return None };
        if is_shared(v, nodes, shared_node) {
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
        match reshaped(v) {
            _ if is_shared(v, nodes, shared_node) => {
                let dt = ty_of(v, nodes)?.as_tensor()?.1;
                out.push(Operand::Shared(v.clone(), Ty::tensor(dims.clone(), dt)));
            }
            Some((inner, d)) if d == row => out.push(Operand::Row(inner)),
            _ => return None,
        }
    }
    Some((out, Ty::tensor(dims, dtype)))
}

/// `units` and `out_dtype` left at their defaults (a product the swap keeps as it is).
fn dense_attrs_plain(attrs: &Attrs) -> bool {
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
fn dims2(ty: &Ty) -> Option<(i64, i64)> {
    match ty.as_tensor()?.0 {
        [a, b] => Some((a.known()?, b.known()?)),
        _ => None,
    }
}

fn known_dims(ty: &Ty) -> Option<Vec<i64>> {
    ty.as_tensor()?.0.iter().map(|d| d.known()).collect()
}

/// Removes the products, reshapes and transposes whose results nothing reads (the rewrites left
/// them behind). Only those: a user's dead operator that can fail at run time (an integer
/// division by zero) still fails as the reference engine's does.
fn drop_dead_nodes(block: &mut Block) {
    let n = block.nodes.len();
    let mut live = vec![false; n];
    let mark = |v: &BVal, live: &mut Vec<bool>| {
        if let BVal::Node(m) | BVal::Field(m, _) = v {
            if let Some(l) = live.get_mut(*m as usize) {
                *l = true;
            }
        }
    };
    for v in &block.outputs {
        mark(v, &mut live);
    }
    for i in (0..n).rev() {
        let node = &block.nodes[i];
        if !matches!(node.op.name, "nn.dense" | "reshape" | "transpose") {
            live[i] = true;
        }
        if live[i] {
            for a in &node.args {
                match a {
                    BArg::One(v) => mark(v, &mut live),
                    BArg::Tuple(vs) => vs.iter().for_each(|v| mark(v, &mut live)),
                }
            }
        }
    }
    if live.iter().all(|&l| l) {
        return;
    }
    let mut index: Vec<u32> = vec![0; n];
    let mut kept = Vec::with_capacity(n);
    for (i, node) in std::mem::take(&mut block.nodes).into_iter().enumerate() {
        if live[i] {
            index[i] = kept.len() as u32;
            kept.push(node);
        }
    }
    let renumber = |v: &BVal| match v {
        BVal::Node(m) => BVal::Node(index[*m as usize]),
        BVal::Field(m, f) => BVal::Field(index[*m as usize], *f),
        other => other.clone(),
    };
    for node in &mut kept {
        for a in &mut node.args {
            match a {
                BArg::One(v) => *v = renumber(v),
                BArg::Tuple(vs) => vs.iter_mut().for_each(|v| *v = renumber(v)),
            }
        }
    }
    block.outputs = block.outputs.iter().map(renumber).collect();
    block.nodes = kept;
}
