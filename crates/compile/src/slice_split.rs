//! Weight-take splits: a block found automatically that takes a matrix out of a model weight by
//! an index each invocation computes — a typed-edge GNN's `take(%Ws, %type)`, the edge's type
//! read from the instance's list, beside the neighbour's row — is split so that the take, with
//! the integer work that computes its index, is an invocation of its own.
//!
//! Why: inside a block the slice is a per-invocation value like any other, copied out for every
//! invocation (a 64 KiB matrix per edge) and read by the product as a weight that differs per
//! invocation, so the product runs invocation by invocation. Alone, the take is a weight-slice
//! block that the runtime runs on the host at record time: one slice per weight and index for
//! the job, itself a model weight ([`tumble_runtime`'s weight slices), so the products that read
//! it group their invocations by it — one GEMM per edge type instead of one per edge.
//!
//! A take qualifies when its table is an entry parameter bound to a model weight at the site, its
//! index has one integer element, its table holds matrices (a row of an embedding table is a
//! lookup the gather kernel reads in place, not a weight) and the nodes its index depends on
//! are pure and integral (the host computes them again, cheaply). The consumer reads the slice
//! as its last input; the producer's site is scheduled as the site was.

use crate::blocks::{
    inputs_read, is_pure_op, part_of, BArg, BVal, Block, BlockInput, OutputShape, Part,
};
use crate::program::Program;
use crate::split::{split_sites, Cut, Split};

/// The name of a split's producer.
const SLICE: &str = "/slice";
/// The name of a split's consumer.
const REST: &str = "/rest";

/// At most this many takes are split off one block (one per round).
const MAX_ROUNDS: usize = 4;

/// Splits each weight take that qualifies off the blocks of automatic sites; returns what it split.
pub fn split_weight_takes(program: &mut Program, weights: &[bool]) -> Vec<Split> {
    let candidate = |program: &Program, block: u32, _site: u32| -> Option<Vec<bool>> {
        let b = program.blocks.get(block as usize)?;
        (!b.primitive && slice_take(b, &[], false).is_some()).then(Vec::new)
    };
    let plan = |b: &Block, _: &[bool], weight_operands: &[bool]| plan_slice(b, weight_operands);
    let mut report = Vec::new();
    for _ in 0..MAX_ROUNDS {
        let made = split_sites(program, weights, &candidate, &plan, None);
        if made.is_empty() {
            break;
        }
        report.extend(made);
    }
    report
}

/// The first node of `b` that takes a matrix out of input `w` by one integer — `w` a weight
/// operand at the site (`weight_operands`; not checked when `check_weights` is false).
fn slice_take(b: &Block, weight_operands: &[bool], check_weights: bool) -> Option<usize> {
    b.nodes.iter().position(|n| {
        let (Some(BArg::One(BVal::Input(w))), Some(BArg::One(idx))) =
            (n.args.first(), n.args.get(1))
        else {
            return false;
        };
        let one_int = matches!(b.val_ty(idx).as_tensor(),
            Some((dims, dt)) if dt.is_int() && dims.len() <= 1
                && dims.iter().all(|d| d.known() == Some(1)));
        // A table of matrices; a row of a table of vectors (`(1, H)`) is a lookup.
        let matrix =
            matches!(b.val_ty(&BVal::Input(*w)).as_tensor(), Some((dims, _)) if dims.len() >= 3);
        n.op.name == "take"
            && n.args.len() == 2
            && tumble_ops::takes_rows(&n.attrs)
            && one_int
            && matrix
            && (!check_weights || weight_operands.get(*w as usize) == Some(&true))
    })
}

/// The backward closure of node `k` in `b`: the nodes its value depends on, `k` included.
fn closure(b: &Block, k: usize) -> Vec<bool> {
    let mut needed = vec![false; b.nodes.len()];
    if let Some(x) = needed.get_mut(k) {
        *x = true;
    }
    for j in (0..b.nodes.len()).rev() {
        if !needed[j] {
            continue;
        }
        for v in b
            .nodes
            .get(j)
            .map_or(&[][..], |x| &x.args)
            .iter()
            .flat_map(BArg::values)
        {
            if let Some(m) = v.node() {
                if let Some(x) = needed.get_mut(m) {
                    *x = true;
                }
            }
        }
    }
    needed
}

/// The nodes of `b` other than `k` that its outputs depend on, reading `k`'s value as an input
/// (it is the producer's).
fn consumer_live(b: &Block, k: usize) -> Vec<bool> {
    let mut live = vec![false; b.nodes.len()];
    let mark = |v: &BVal, live: &mut Vec<bool>| {
        if let Some(m) = v.node() {
            if m != k {
                if let Some(x) = live.get_mut(m) {
                    *x = true;
                }
            }
        }
    };
    for v in &b.outputs {
        mark(v, &mut live);
    }
    for j in (0..b.nodes.len()).rev() {
        if live[j] {
            for v in b
                .nodes
                .get(j)
                .map_or(&[][..], |x| &x.args)
                .iter()
                .flat_map(BArg::values)
            {
                mark(v, &mut live);
            }
        }
    }
    live
}

/// `b` cut at its first qualifying weight take: the producer computes the take and its index,
/// the consumer everything else; `None` when no take qualifies or the block is nothing but one.
fn plan_slice(b: &Block, weight_operands: &[bool]) -> Option<Cut> {
    let k = slice_take(b, weight_operands, true)?;
    let needed = closure(b, k);
    // The index's own computation: pure integer work the host repeats for the slice.
    let integral = b.nodes.iter().enumerate().all(|(j, n)| {
        j == k
            || !needed[j]
            || (is_pure_op(n.op)
                && matches!(n.ty.as_tensor(), Some((_, dt)) if dt.is_int() || dt == tumble_ir::DType::Bool))
    });
    let live = consumer_live(b, k);
    if !integral || !live.iter().any(|&l| l) {
        return None;
    }
    let producer_nodes: Vec<usize> = (0..b.nodes.len()).filter(|&j| needed[j]).collect();
    let consumer_nodes: Vec<usize> = (0..b.nodes.len()).filter(|&j| live[j]).collect();
    let out = BVal::Node(k as u32);
    let p_in = inputs_read(b, &producer_nodes, &[]);
    let c_in = inputs_read(b, &consumer_nodes, &b.outputs);
    let producer = part_of(
        b,
        Part {
            nodes: &producer_nodes,
            inputs: &p_in,
            cut: Vec::new(),
            outputs: std::slice::from_ref(&out),
            output_shape: OutputShape::Single,
            primitive: false,
            name: format!("{}{SLICE}", b.name),
        },
    )?;
    let cut_input = BlockInput {
        name: format!("{} (slice)", producer.name),
        ty: b.val_ty(&out),
    };
    let consumer = part_of(
        b,
        Part {
            nodes: &consumer_nodes,
            inputs: &c_in,
            cut: vec![(out, cut_input)],
            outputs: &b.outputs,
            output_shape: b.output_shape,
            primitive: false,
            name: format!("{}{REST}", b.name),
        },
    )?;
    Some((producer, consumer, p_in, c_in))
}
