//! Index splits: a block found automatically that computes an integer scalar from an instance's
//! integer vector — a counted loop's token `take(%toks, %k)` before its embedding lookup, an
//! edge's source `take(%src, %k)` before the neighbour's row — has that integer work split off as
//! an invocation of its own, which the runtime computes on the host at record time (its host
//! scalars).
//!
//! Why: inside a block, the vector is a ragged input (`(?)`: one length per instance), so the
//! ragged executor runs the little `take` once per group of equal lengths (a counter-loop RNN over
//! 128 SST sentences: 792 groups per mini-batch, 1.8× the list-written RNN), and what reads the
//! index waits for the launch. Split off, the index is a host value when the block is invoked: the
//! lookup reads no ragged input, and with every input known it is hoisted like the list-written
//! RNN's, one launch over every token.
//!
//! The producer is the integer closure of one scalar the rest of the block reads (views of it —
//! `expand_dims` to the `(1)` an embedding lookup takes — stay with the rest, so that the
//! producer returns a scalar), pure integer and boolean nodes over integer inputs, literals and
//! any input's shape (`take(shape_of(%x), 0)`),
//! reading an input of a size not known statically (otherwise nothing is ragged and the block
//! gains nothing). Its site is scheduled as the site was.

use crate::blocks::{frontier, inputs_read, integral, is_pure_op, needed_by, BArg, BVal, Block};
use crate::program::Program;
use crate::split::{cut_at, split_nodes_in_rounds, Cut, Split, REST, VIEWS};
use tumble_ir::Ty;

/// The name of a split's producer.
const INDEX: &str = "/index";

/// Splits the integer index work that qualifies off the blocks of automatic sites; returns what
/// it split.
pub fn split_indices(program: &mut Program, weights: &[bool]) -> Vec<Split> {
    split_nodes_in_rounds(program, weights, &|b| index_cut(b).is_some(), &|b, _| {
        plan_index(b)
    })
}

/// Of at most one element, by its static shape.
fn scalar_like(t: &Ty) -> bool {
    matches!(t.as_tensor(), Some((dims, _)) if dims.iter().all(|d| d.known() == Some(1)))
}

/// The node of `b` whose integer closure to split off: a scalar the rest of the block reads,
/// computed by pure integer nodes from integer inputs (one of a size not known statically),
/// literals and inputs' shapes; `None` when there is none or the block is nothing but integer
/// work.
fn index_cut(b: &Block) -> Option<usize> {
    // Integer work: pure integral nodes over integer inputs, literals and each other — and the
    // shape of any input (`shape_of(%x)`: its size, whatever its dtype).
    let mut ints: Vec<bool> = Vec::with_capacity(b.nodes.len());
    for n in &b.nodes {
        let shape = tumble_ops::SHAPE_READERS.contains(&n.op.name);
        let reads_ints = n.args.iter().flat_map(BArg::values).all(|v| match v {
            BVal::Input(i) => shape || b.inputs.get(*i as usize).is_some_and(|x| integral(&x.ty)),
            BVal::Node(m) | BVal::Field(m, _) => ints.get(*m as usize).copied().unwrap_or(false),
            BVal::Const(_) => true,
        });
        ints.push(is_pure_op(n.op) && reads_ints && integral(&n.ty));
    }
    if ints.iter().all(|&x| x) {
        return None;
    }
    // Views at the frontier go to the rest, until the values crossing are the scalars they view.
    loop {
        let cut = frontier(b, &ints);
        let view = cut.iter().filter_map(BVal::node).find(|&m| {
            b.nodes
                .get(m)
                .is_some_and(|x| VIEWS.contains(&x.op.name) || x.op.name == "cast")
                && b.nodes
                    .get(m)
                    .and_then(|x| x.args.first())
                    .and_then(|a| a.values().first())
                    .and_then(BVal::node)
                    .is_some_and(|src| ints.get(src).copied().unwrap_or(false))
        });
        match view {
            Some(m) => ints[m] = false,
            None => break,
        }
    }
    let ragged_input = |needed: &[bool]| {
        let nodes: Vec<usize> = (0..b.nodes.len()).filter(|&j| needed[j]).collect();
        inputs_read(b, &nodes, &[]).iter().any(|&i| {
            b.inputs.get(i).is_some_and(|x| {
                x.ty.as_tensor()
                    .is_some_and(|(dims, _)| dims.iter().any(|d| d.known().is_none()))
            })
        })
    };
    frontier(b, &ints)
        .iter()
        .filter_map(|v| match v {
            BVal::Node(m) => Some(*m as usize),
            _ => None,
        })
        .find(|&k| {
            b.nodes.get(k).is_some_and(|n| scalar_like(&n.ty)) && ragged_input(&needed_by(b, k))
        })
}

/// `b` cut at its first qualifying index: the producer computes it, the consumer everything
/// else; `None` when none qualifies.
fn plan_index(b: &Block) -> Option<Cut> {
    cut_at(b, index_cut(b)?, INDEX, REST)
}
