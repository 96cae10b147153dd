//! The batching rules: how one operator runs once for a whole launch — its batched operands (a
//! leading batch axis) and shared ones (the same for every invocation) turned into the plain
//! operands and attributes of one call (axes shifted past the batch axis, broadcasting operands
//! padded to one per-instance rank), or `None` where no rule applies and the launch runs the
//! operator per invocation. The backward reads the same rules: the batched operator is a plain
//! one, so its vjp is the plain vjp.

use tumble_ir::{AttrValue, Attrs};
use tumble_ops::{FusionClass, OpDef, OpValue};
use tumble_tensor::Tensor;

use super::{broadcast_batch, BV};

fn per_instance_rank(v: &BV) -> usize {
    match v {
        BV::Shared(OpValue::Tensor(t)) => t.rank(),
        BV::Batched(OpValue::Tensor(t)) => t.rank().saturating_sub(1),
        _ => 0,
    }
}

fn batched_tensor(v: &BV) -> Option<&Tensor> {
    match v {
        BV::Batched(OpValue::Tensor(t)) => Some(t),
        _ => None,
    }
}

fn with_attr(attrs: &Attrs, name: &str, value: AttrValue) -> Attrs {
    let mut out = attrs.clone();
    match out.0.iter_mut().find(|a| a.name == name) {
        Some(a) => a.value = value,
        None => out.0.push(tumble_ir::attrs::Attr {
            name: name.to_string(),
            value,
            span: tumble_ir::Span::default(),
        }),
    }
    out
}

/// A per-instance axis (possibly negative) as a non-negative axis of the batched tensor.
fn shift_axis(axis: i64, rank: usize) -> Option<i64> {
    let r = rank as i64;
    let a = if axis < 0 { axis + r } else { axis };
    (0..r).contains(&a).then_some(a + 1)
}

fn ints(v: &[i64]) -> AttrValue {
    AttrValue::List(v.iter().map(|&x| AttrValue::Int(x)).collect())
}

/// How to run `op` once on the whole batch: the operands and attributes to pass, or `None`.
pub(crate) fn rule(
    op: &OpDef,
    attrs: &Attrs,
    args: &[BV],
    b: usize,
) -> Option<(Vec<OpValue>, Attrs)> {
    let rank = |i: usize| args.get(i).map_or(0, per_instance_rank);
    let name = op.name;
    match name {
        // Elementwise and broadcasting operators: pad batched operands to the result's per-instance
        // rank so numpy broadcasting lines the batch axis up; shared operands broadcast as they are.
        _ if matches!(op.class, FusionClass::Elementwise | FusionClass::Broadcast)
            && !matches!(
                name,
                "nn.bias_add" | "full" | "full_like" | "nn.prelu" | "sequence_mask"
            ) =>
        {
            let r = (0..args.len()).map(rank).max().unwrap_or(0);
            let plain = args
                .iter()
                .map(|a| match a {
                    BV::Shared(v) => Some(v.clone()),
                    BV::Batched(OpValue::Tensor(t)) => pad_batched(t, r).map(OpValue::Tensor),
                    // Materialized before rules are asked.
                    BV::Batched(_) | BV::Rows(_) => None,
                })
                .collect::<Option<Vec<_>>>()?;
            Some((plain, attrs.clone()))
        }
        "nn.bias_add" => {
            let data = batched_tensor(args.first()?)?;
            let BV::Shared(bias) = args.get(1)? else {
                return None;
            };
            let axis = attrs.int("axis").ok()?.unwrap_or(1);
            let axis = shift_axis(axis, rank(0))?;
            Some((
                vec![OpValue::Tensor(data.clone()), bias.clone()],
                with_attr(attrs, "axis", AttrValue::Int(axis)),
            ))
        }
        // Each instance's data filled with one shared value.
        "full_like" => {
            let x = batched_tensor(args.first()?)?;
            let BV::Shared(v) = args.get(1)? else {
                return None;
            };
            Some((vec![OpValue::Tensor(x.clone()), v.clone()], attrs.clone()))
        }
        // A shared alpha along the same axis one further in.
        "nn.prelu" => {
            let x = batched_tensor(args.first()?)?;
            let BV::Shared(alpha) = args.get(1)? else {
                return None;
            };
            let axis = shift_axis(attrs.int("axis").ok()?.unwrap_or(1), rank(0))?;
            Some((
                vec![OpValue::Tensor(x.clone()), alpha.clone()],
                with_attr(attrs, "axis", AttrValue::Int(axis)),
            ))
        }
        // Shared statistics along the same axis one further in.
        "nn.batch_norm" => {
            let x = batched_tensor(args.first()?)?;
            let mut plain = vec![OpValue::Tensor(x.clone())];
            for a in args.get(1..5)? {
                let BV::Shared(v) = a else {
                    return None;
                };
                plain.push(v.clone());
            }
            let axis = shift_axis(attrs.int("axis").ok()?.unwrap_or(1), rank(0))?;
            Some((plain, with_attr(attrs, "axis", AttrValue::Int(axis))))
        }
        // The per-instance axes (all of them by default) one further in.
        "nn.l2_normalize" => {
            let x = batched_tensor(args.first()?)?;
            let axes = batched_axes(attrs, rank(0))?;
            Some((
                vec![OpValue::Tensor(x.clone())],
                with_attr(attrs, "axis", ints(&axes)),
            ))
        }
        // The batch axis not padded; a shared pad value.
        "nn.pad" => {
            let x = batched_tensor(args.first()?)?;
            let Some(AttrValue::List(rows)) = attrs.get("pad_width") else {
                return None;
            };
            let mut rows = rows.clone();
            rows.insert(0, ints(&[0, 0]));
            let mut plain = vec![OpValue::Tensor(x.clone())];
            if let Some(v) = args.get(1) {
                let BV::Shared(v) = v else {
                    return None;
                };
                plain.push(v.clone());
            }
            Some((plain, with_attr(attrs, "pad_width", AttrValue::List(rows))))
        }
        // Rows times a shared matrix, as nn.dense's rule (a 2-D lhs transposed is not rows).
        "nn.matmul" if !attrs.bool("transpose_a").ok()?.unwrap_or(false) => {
            let x = batched_tensor(args.first()?)?;
            let BV::Shared(w) = args.get(1)? else {
                return None;
            };
            Some((vec![OpValue::Tensor(x.clone()), w.clone()], attrs.clone()))
        }
        "nn.dense" => {
            let x = batched_tensor(args.first()?)?;
            let BV::Shared(w) = args.get(1)? else {
                return None;
            };
            Some((vec![OpValue::Tensor(x.clone()), w.clone()], attrs.clone()))
        }
        "nn.softmax" | "nn.log_softmax" => {
            let x = batched_tensor(args.first()?)?;
            let axis = attrs.int("axis").ok()?.unwrap_or(-1);
            let axis = shift_axis(axis, rank(0))?;
            Some((
                vec![OpValue::Tensor(x.clone())],
                with_attr(attrs, "axis", AttrValue::Int(axis)),
            ))
        }
        "nn.layer_norm" => {
            let x = batched_tensor(args.first()?)?;
            let (BV::Shared(g), BV::Shared(be)) = (args.get(1)?, args.get(2)?) else {
                return None;
            };
            let axis = attrs.int("axis").ok()?.unwrap_or(-1);
            let axis = shift_axis(axis, rank(0))?;
            Some((
                vec![OpValue::Tensor(x.clone()), g.clone(), be.clone()],
                with_attr(attrs, "axis", AttrValue::Int(axis)),
            ))
        }
        "sum" | "prod" | "mean" | "max" | "min" | "all" | "any" | "argmax" | "argmin" => {
            let x = batched_tensor(args.first()?)?;
            let shifted = batched_axes(attrs, rank(0))?;
            if matches!(name, "argmax" | "argmin") && shifted.len() != 1 {
                return None;
            }
            let attrs = with_attr(attrs, "axis", ints(&shifted));
            let attrs = with_attr(&attrs, "exclude", AttrValue::Bool(false));
            Some((vec![OpValue::Tensor(x.clone())], attrs))
        }
        // A reduction of `(data - mean)²`: the mean (each instance's, or one for all) broadcast
        // onto the data with the batch axis lined up, the axes shifted past it.
        "variance" => {
            let x = batched_tensor(args.first()?)?;
            let r = rank(0);
            // The mean keeps the data's rank (the relation's rule): a shared one (a weight's, a
            // few values) is repeated per instance, so that its gradient comes back as the
            // batch's rows, which the backward sums as any shared operand's.
            let m = match args.get(1)? {
                BV::Shared(OpValue::Tensor(t)) => broadcast_batch(t, b).ok()?,
                BV::Batched(OpValue::Tensor(t)) => pad_batched(t, r)?,
                _ => return None,
            };
            let m = OpValue::Tensor(m);
            let shifted = batched_axes(attrs, r)?;
            let attrs = with_attr(attrs, "axis", ints(&shifted));
            let attrs = with_attr(&attrs, "exclude", AttrValue::Bool(false));
            Some((vec![OpValue::Tensor(x.clone()), m], attrs))
        }
        "concatenate" => {
            let BV::Batched(OpValue::Tuple(ts)) = args.first()? else {
                return None;
            };
            let r = ts.first().map_or(0, |t| t.rank().saturating_sub(1));
            let axis = shift_axis(attrs.int("axis").ok()?.unwrap_or(0), r)?;
            Some((
                vec![OpValue::Tuple(ts.clone())],
                with_attr(attrs, "axis", AttrValue::Int(axis)),
            ))
        }
        // Each instance's value broadcast to the shape: the batch padded to that rank, then
        // broadcast with the batch axis in front.
        "broadcast_to" => {
            let x = batched_tensor(args.first()?)?;
            let shape = attrs.ints("shape").ok()??;
            let x = pad_batched(x, shape.len())?;
            let mut s = vec![b as i64];
            s.extend(shape);
            Some((
                vec![OpValue::Tensor(x)],
                with_attr(attrs, "shape", ints(&s)),
            ))
        }
        // Each instance's indices, the new axis among the per-instance ones; shared on and off
        // values.
        "one_hot" => {
            let idx = batched_tensor(args.first()?)?;
            let (BV::Shared(on), BV::Shared(off)) = (args.get(1)?, args.get(2)?) else {
                return None;
            };
            let axis = shift_axis(attrs.int("axis").ok()?.unwrap_or(-1), rank(0) + 1)?;
            Some((
                vec![OpValue::Tensor(idx.clone()), on.clone(), off.clone()],
                with_attr(attrs, "axis", AttrValue::Int(axis)),
            ))
        }
        "stack" => {
            let BV::Batched(OpValue::Tuple(ts)) = args.first()? else {
                return None;
            };
            // The new axis goes among the per-instance ones: rank + 1 places for it.
            let r = ts.first().map_or(0, |t| t.rank().saturating_sub(1));
            let axis = shift_axis(attrs.int("axis").ok()?.unwrap_or(0), r + 1)?;
            Some((
                vec![OpValue::Tuple(ts.clone())],
                with_attr(attrs, "axis", AttrValue::Int(axis)),
            ))
        }
        "split" => {
            let x = batched_tensor(args.first()?)?;
            let axis = shift_axis(attrs.int("axis").ok()?.unwrap_or(0), rank(0))?;
            Some((
                vec![OpValue::Tensor(x.clone())],
                with_attr(attrs, "axis", AttrValue::Int(axis)),
            ))
        }
        "reshape" => {
            let x = batched_tensor(args.first()?)?;
            let newshape = attrs.ints("newshape").ok()??;
            let mut s = vec![b as i64];
            s.extend(newshape);
            Some((
                vec![OpValue::Tensor(x.clone())],
                with_attr(attrs, "newshape", ints(&s)),
            ))
        }
        // Batched matrices (attention heads): fold the batch into batch_matmul's own batch axis.
        "nn.batch_matmul" => {
            let x = match args.first()? {
                BV::Batched(OpValue::Tensor(t)) => t.clone(),
                BV::Shared(OpValue::Tensor(t)) => broadcast_batch(t, b).ok()?,
                _ => return None,
            };
            let y = match args.get(1)? {
                BV::Batched(OpValue::Tensor(t)) => t.clone(),
                BV::Shared(OpValue::Tensor(t)) => broadcast_batch(t, b).ok()?,
                _ => return None,
            };
            let (xs, ys) = (x.shape().to_vec(), y.shape().to_vec());
            if xs.len() != 4 || ys.len() != 4 || xs[1] != ys[1] {
                return None;
            }
            let fold = |t: &Tensor, s: &[usize]| t.reshape(vec![s[0] * s[1], s[2], s[3]]).ok();
            Some((
                vec![
                    OpValue::Tensor(fold(&x, &xs)?),
                    OpValue::Tensor(fold(&y, &ys)?),
                ],
                attrs.clone(),
            ))
        }
        // Along an axis of each instance's value: the same axis one further in.
        "reverse" | "repeat" => {
            let x = batched_tensor(args.first()?)?;
            let axis = shift_axis(attrs.int("axis").ok()??, rank(0))?;
            Some((
                vec![OpValue::Tensor(x.clone())],
                with_attr(attrs, "axis", AttrValue::Int(axis)),
            ))
        }
        // Each instance's own data by its own indices (both of the value's rank): one axis
        // further in.
        "gather" => {
            let (BV::Batched(OpValue::Tensor(x)), BV::Batched(OpValue::Tensor(idx))) =
                (args.first()?, args.get(1)?)
            else {
                return None;
            };
            let axis = shift_axis(attrs.int("axis").ok()??, rank(0))?;
            Some((
                vec![OpValue::Tensor(x.clone()), OpValue::Tensor(idx.clone())],
                with_attr(attrs, "axis", AttrValue::Int(axis)),
            ))
        }
        // Scans along an axis; without one, over each instance's elements in order (its value
        // flattened: the batch's rows).
        "cumsum" | "cumprod" => {
            let x = batched_tensor(args.first()?)?;
            match attrs.int("axis").ok()? {
                Some(a) => {
                    let axis = shift_axis(a, rank(0))?;
                    Some((
                        vec![OpValue::Tensor(x.clone())],
                        with_attr(attrs, "axis", AttrValue::Int(axis)),
                    ))
                }
                None => {
                    let n: usize = x.shape().get(1..)?.iter().product();
                    let rows = x.reshape(vec![b, n]).ok()?;
                    Some((
                        vec![OpValue::Tensor(rows)],
                        with_attr(attrs, "axis", AttrValue::Int(1)),
                    ))
                }
            }
        }
        // Each instance tiled alike: the batch axis repeated once (reps no longer than the
        // value's rank, which would add axes in front of the batch's).
        "tile" => {
            let x = batched_tensor(args.first()?)?;
            let reps = attrs.ints("reps").ok()??;
            let r = rank(0);
            if reps.len() > r {
                return None;
            }
            let mut all = vec![1i64; 1 + r - reps.len()];
            all.extend(reps);
            Some((
                vec![OpValue::Tensor(x.clone())],
                with_attr(attrs, "reps", ints(&all)),
            ))
        }
        "transpose" => {
            let x = batched_tensor(args.first()?)?;
            let r = rank(0) as i64;
            let axes: Vec<i64> = match attrs.ints("axes").ok()? {
                None => (0..r).rev().collect(),
                Some(v) if v.is_empty() => (0..r).rev().collect(),
                Some(v) => v.iter().map(|&a| if a < 0 { a + r } else { a }).collect(),
            };
            let mut s = vec![0];
            s.extend(axes.iter().map(|a| a + 1));
            Some((
                vec![OpValue::Tensor(x.clone())],
                with_attr(attrs, "axes", ints(&s)),
            ))
        }
        // A slice of every instance's value: the same slice one axis further in, stated with
        // `axes` so the batch axis is taken whole and `begin`/`end`/`strides` keep their entries.
        // Without it each row was copied out whole to slice it (Berxit's exit head copied 384 KB
        // per instance per exit to read one row).
        "strided_slice" => {
            let x = batched_tensor(args.first()?)?;
            let r = rank(0) as i64;
            let begin = attrs.ints("begin").ok()??;
            let end = attrs.ints("end").ok()??;
            if begin.len() != end.len() || begin.is_empty() {
                return None;
            }
            let axes: Vec<i64> = match attrs.ints("axes").ok()? {
                Some(listed) => listed
                    .iter()
                    .map(|&a| shift_axis(a, r as usize))
                    .collect::<Option<_>>()?,
                None if begin.len() as i64 <= r => (1..=begin.len() as i64).collect(),
                None => return None,
            };
            if axes.len() != begin.len() {
                return None;
            }
            Some((
                vec![OpValue::Tensor(x.clone())],
                with_attr(attrs, "axes", ints(&axes)),
            ))
        }
        "expand_dims" => {
            let x = batched_tensor(args.first()?)?;
            let axis = attrs.int("axis").ok()??;
            let axis = if axis >= 0 { axis + 1 } else { axis };
            Some((
                vec![OpValue::Tensor(x.clone())],
                with_attr(attrs, "axis", AttrValue::Int(axis)),
            ))
        }
        "squeeze" => {
            let x = batched_tensor(args.first()?)?;
            let r = rank(0) as i64;
            let axes: Vec<i64> = match attrs.ints("axis").ok()? {
                None => (0..r)
                    .filter(|&a| x.shape().get(a as usize + 1) == Some(&1))
                    .collect(),
                Some(v) => v.iter().map(|&a| if a < 0 { a + r } else { a }).collect(),
            };
            let s: Vec<i64> = axes.iter().map(|a| a + 1).collect();
            Some((
                vec![OpValue::Tensor(x.clone())],
                with_attr(attrs, "axis", ints(&s)),
            ))
        }
        // Lookups in per-invocation data, one axis further in: shared indices (`take(%p, 0,
        // axis=0)` of a batched vector) are the same lookup in every row; per-invocation ones (a
        // loss's `take(log_probs, %label)`) make the batch axis take's batch dimension, each row
        // looked up by its own indices.
        "take" if matches!(args.first(), Some(BV::Batched(_))) => {
            let x = batched_tensor(args.first()?)?;
            if attrs.int("batch_dims").ok()?.unwrap_or(0) != 0 {
                return None;
            }
            let axis = shift_axis(attrs.int("axis").ok()??, rank(0))?;
            let attrs = with_attr(attrs, "axis", AttrValue::Int(axis));
            match args.get(1)? {
                BV::Shared(idx) => Some((vec![OpValue::Tensor(x.clone()), idx.clone()], attrs)),
                BV::Batched(OpValue::Tensor(idx)) if idx.shape().first() == x.shape().first() => {
                    Some((
                        vec![OpValue::Tensor(x.clone()), OpValue::Tensor(idx.clone())],
                        with_attr(&attrs, "batch_dims", AttrValue::Int(1)),
                    ))
                }
                _ => None,
            }
        }
        "take" => {
            // An embedding lookup: shared table, per-invocation indices along axis 0.
            let BV::Shared(data) = args.first()? else {
                return None;
            };
            let idx = batched_tensor(args.get(1)?)?;
            let axis = attrs.int("axis").ok()??;
            let batch_dims = attrs.int("batch_dims").ok()?.unwrap_or(0);
            if axis != 0 || batch_dims != 0 {
                return None;
            }
            Some((
                vec![data.clone(), OpValue::Tensor(idx.clone())],
                attrs.clone(),
            ))
        }
        _ => None,
    }
}

/// The axes a reduction of per-instance rank `r` reduces (its `axis` and `exclude`), as axes of
/// the batched tensor (past the batch axis); `None` where they are not all per-instance axes or
/// there is none (a scalar per instance: an empty list would mean every axis, the batch's too).
fn batched_axes(attrs: &Attrs, r: usize) -> Option<Vec<i64>> {
    let listed = attrs.ints("axis").ok()?;
    let exclude = attrs.bool("exclude").ok()?.unwrap_or(false);
    let mut axes: Vec<i64> = match &listed {
        None => (0..r as i64).collect(),
        Some(v) if v.is_empty() => (0..r as i64).collect(),
        Some(v) => v
            .iter()
            .map(|&a| if a < 0 { a + r as i64 } else { a })
            .collect(),
    };
    if exclude && listed.is_some_and(|v| !v.is_empty()) {
        axes = (0..r as i64).filter(|a| !axes.contains(a)).collect();
    }
    if axes.is_empty() || axes.iter().any(|&a| !(0..r as i64).contains(&a)) {
        return None;
    }
    Some(axes.iter().map(|a| a + 1).collect())
}

/// `(B, s...)` reshaped to `(B, 1, ..., 1, s...)` with per-instance rank `r`.
fn pad_batched(t: &Tensor, r: usize) -> Option<Tensor> {
    let own = t.rank().checked_sub(1)?;
    if own >= r {
        return Some(t.clone());
    }
    let mut shape = Vec::with_capacity(r + 1);
    shape.push(*t.shape().first()?);
    shape.extend(std::iter::repeat_n(1, r - own));
    shape.extend_from_slice(&t.shape()[1..]);
    t.reshape(shape).ok()
}
