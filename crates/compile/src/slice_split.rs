//! Weight-take splits: a block found automatically that takes a matrix out of a model weight by
//! an index each invocation computes — a typed-edge GNN's `take(%Ws, %type)`, the edge's type
//! read from the instance's list, beside the neighbour's row — is split so that the take, with
//! the integer work that computes its index, is an invocation of its own.
//!
//! Why: inside a block the slice is a per-invocation value like any other, copied out for every
//! invocation (a 64 KiB matrix per edge) and read by the product as a weight that differs per
//! invocation, so the product runs invocation by invocation. Alone, the take is a weight-slice
//! block that the runtime runs on the host at record time: one slice per weight and index for
//! the job, itself a model weight (the runtime's weight slices), so the products that read it
//! group their invocations by it — one GEMM per edge type instead of one per edge.
//!
//! A take qualifies when its table is an entry parameter bound to a model weight at the site, its
//! index has one integer element, its table holds matrices (a row of an embedding table is a
//! lookup the gather kernel reads in place, not a weight) and the nodes its index depends on
//! are pure and integral (the host computes them again, cheaply). The consumer reads the slice
//! as its last input; the producer's site is scheduled as the site was.

use crate::blocks::{integral, is_pure_op, needed_by, BArg, BVal, Block, BlockNode};
use crate::program::Program;
use crate::split::{cut_with, split_nodes_in_rounds, Cut, Split, REST};

/// The name of a split's producer.
const SLICE: &str = "/slice";

/// Splits each weight take that qualifies off the blocks of automatic sites; returns what it split.
pub fn split_weight_takes(program: &mut Program, weights: &[bool]) -> Vec<Split> {
    split_nodes_in_rounds(
        program,
        weights,
        &|b| slice_take(b, &[], false).is_some(),
        &plan_slice,
    )
}

/// The first node of `b` that takes a matrix out of input `w` by one integer — `w` a weight
/// operand at the site (`weight_operands`; not checked when `check_weights` is false).
fn slice_take(b: &Block, weight_operands: &[bool], check_weights: bool) -> Option<usize> {
    b.nodes.iter().position(|n| {
        matrix_take(b, n)
            .is_some_and(|(w, _)| !check_weights || weight_operands.get(w as usize) == Some(&true))
    })
}

/// Node `n` of `b` as a weight take: a row-mode `take` out of input `w`'s matrices (a table of
/// rank 3 or more — a row of a table of vectors, `(1, H)`, is a lookup, not a weight) by a value
/// of one integer, `()` or `(1)`; `w` and that value.
fn matrix_take<'b>(b: &Block, n: &'b BlockNode) -> Option<(u32, &'b BVal)> {
    let [BArg::One(BVal::Input(w)), BArg::One(idx)] = n.args.as_slice() else {
        return None;
    };
    let one_int = matches!(b.val_ty(idx).as_tensor(),
        Some((dims, dt)) if dt.is_int() && dims.len() <= 1 && dims.iter().all(|d| d.known() == Some(1)));
    let matrices =
        matches!(b.val_ty(&BVal::Input(*w)).as_tensor(), Some((dims, _)) if dims.len() >= 3);
    (n.op.name == "take" && tumble_ops::takes_rows(&n.attrs) && one_int && matrices)
        .then_some((*w, idx))
}

/// `b` cut at its first qualifying weight take: the producer computes the take and its index,
/// the consumer everything else; `None` when no take qualifies or the block is nothing but one.
fn plan_slice(b: &Block, weight_operands: &[bool]) -> Option<Cut> {
    let k = slice_take(b, weight_operands, true)?;
    let needed = needed_by(b, k);
    // The index's own computation: pure integer work the host repeats for the slice.
    let integral = b
        .nodes
        .iter()
        .enumerate()
        .all(|(j, n)| j == k || !needed[j] || (is_pure_op(n.op) && integral(&n.ty)));
    if !integral {
        return None;
    }
    // A slice read only inside its block (a product's weight) is read as it lies by the GEMM
    // stage — no copy — one matrix-vector product per invocation: from the cache, that costs
    // about what grouping saves until the slices outgrow it (a typed-edge GGNN folding its
    // edges: H=128, 64 KiB slices, 4% slower split; H=256 even; H=512, 1 MiB, 1.5× faster). A
    // slice the block returns is copied per invocation and read as a weight that differs per
    // invocation by every product after it: split at any size (H=128, 1.5×).
    let returned = b.outputs.iter().any(|v| v.node() == Some(k));
    // (A `?` size counts as 0: not known to be large.)
    let bytes = b.nodes.get(k).map_or(0, |n| tumble_ops::value_bytes(&n.ty));
    if !returned && bytes < SAME_BLOCK_MIN_BYTES {
        return None;
    }
    cut_with(b, k, &needed, SLICE, REST)
}

/// The smallest slice split off a block that only reads it inside (above).
const SAME_BLOCK_MIN_BYTES: usize = 512 << 10;

/// Whether `b` is a weight take the runtime can run as an indexed weight slice — its last node,
/// the one output, a row-mode `take` out of input `w`'s matrices (a table of rank 3 or more) by a
/// value of one integer that the block's other nodes, pure integer and boolean work, compute —
/// and if so, `w` and the value indexing it. (Whether `w` is a model weight is the caller's.)
pub fn weight_take_block(b: &Block) -> Option<(u32, BVal)> {
    let (last, before) = b.nodes.split_last()?;
    let [BVal::Node(k)] = b.outputs.as_slice() else {
        return None;
    };
    let (w, idx) = matrix_take(b, last)?;
    let integral = before.iter().all(|n| is_pure_op(n.op) && integral(&n.ty));
    (*k as usize == before.len() && integral).then(|| (w, idx.clone()))
}
