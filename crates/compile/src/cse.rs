//! Common subexpressions inside blocks. A plainly written cell repeats itself: an LSTM whose
//! gates each take `split(nn.dense(%x, %W), 3)` again, `concatenate((%x, %h))` spelled once
//! per gate. Every copy was computed — three products of the same rows by the same weight,
//! horizontally fused into one GEMM three times as wide. A node that applies the same pure
//! operator with the same attributes to the same operands as an earlier node is that node
//! (random draws are never merged: each is a draw of its own). Exact: the merged node computes
//! the very values the copies did. `--no-cse` keeps every copy.

use std::collections::HashMap;

use crate::blocks::{is_pure_op, renumbered, BArg, BVal, Block, BlockNode};
use crate::program::Program;

/// Merges repeated nodes in every block of `program`; returns how many nodes went.
pub fn eliminate(program: &mut Program) -> usize {
    program.blocks.iter_mut().map(eliminate_in).sum()
}

/// A block value as a key: inputs and nodes by index, literals by contents (small ones; a
/// large literal only equals itself).
#[derive(Clone, PartialEq, Eq, Hash)]
enum Key {
    Input(u32),
    Node(u32),
    Field(u32, u32),
    Const(String),
    /// Marks a tuple argument (`concatenate`'s) apart from a single one.
    Tuple,
}

/// Elements up to which two literals are compared by value.
const SMALL_LITERAL: usize = 64;

fn key(v: &BVal) -> Key {
    match v {
        BVal::Input(i) => Key::Input(*i),
        BVal::Node(n) => Key::Node(*n),
        BVal::Field(n, f) => Key::Field(*n, *f),
        BVal::Const(t) if t.len() <= SMALL_LITERAL => Key::Const(format!(
            "{:?}{:?}{:?}",
            t.dtype(),
            t.shape(),
            t.to_f64_vec()
        )),
        BVal::Const(t) => Key::Const(format!("buffer {}", t.buffer_id())),
    }
}

fn eliminate_in(block: &mut Block) -> usize {
    let old = std::mem::take(&mut block.nodes);
    let mut nodes: Vec<BlockNode> = Vec::with_capacity(old.len());
    // Old node index → the node that computes it in the new list.
    let mut map: Vec<BVal> = Vec::with_capacity(old.len());
    let mut seen: HashMap<(String, Vec<Vec<Key>>, String), u32> = HashMap::new();
    let mut merged = 0;
    for node in old {
        let node = node.renumbered(&map);
        if is_pure_op(node.op) {
            let k = (
                node.op.name.to_string(),
                node.args
                    .iter()
                    .map(|a| match a {
                        BArg::One(v) => vec![key(v)],
                        BArg::Tuple(vs) => std::iter::once(Key::Tuple)
                            .chain(vs.iter().map(key))
                            .collect(),
                    })
                    .collect(),
                format!(
                    "{:?}",
                    node.attrs
                        .0
                        .iter()
                        .map(|a| (&a.name, &a.value))
                        .collect::<Vec<_>>()
                ),
            );
            if let Some(&same) = seen.get(&k) {
                map.push(BVal::Node(same));
                merged += 1;
                continue;
            }
            seen.insert(k, nodes.len() as u32);
        }
        map.push(BVal::Node(nodes.len() as u32));
        nodes.push(node);
    }
    block.outputs = block.outputs.iter().map(|v| renumbered(v, &map)).collect();
    block.nodes = nodes;
    merged
}
