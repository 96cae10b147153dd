//! A query against an instance's rows recognized in a block — a decoder's attention over its
//! encoder's states, a pointer network's choice among its inputs — so that an executor can run
//! it over every instance's rows where they lie instead of per group of equal lengths, each
//! group's rows stacked first.
//!
//! The forms (per instance, `L` its rows, `m` query rows of width `d`):
//!
//! ```text
//! %s = nn.dense(%q, %M)                      // %q: (m, d), %M: (L, d) inputs → (m, L)
//! %s' = multiply(%s, c)                      // optional, a scalar literal either side
//! then either                                // attention:
//!   %p = nn.softmax(%s', axis=-1)
//!   %o = nn.dense(%p, transpose(%M))         // (m, d): the rows weighted by %p
//! or                                         // a choice:
//!   %o = argmax(%s', axis=[-1])              // (m,) int32, the first best
//! ```
//!
//! — exactly these nodes, each read only as shown, `%o` the block's one output.

use crate::attention::one;
use crate::blocks::{BArg, BVal, Block, BlockNode};

/// What a query block computes from its scores.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Then {
    /// The rows weighted by the scores' softmax: `(m, d)` f32.
    Attend,
    /// The index of each query row's best score: `(m,)` int32.
    Argmax,
}

/// Where a block of a query form reads its operands.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Query {
    /// The block input holding the query rows, `(m, d)` of static shape.
    pub q: u32,
    /// The block input holding the instance's rows, `(?, d)`.
    pub rows: u32,
    /// The scores' scale (`c`; 1 without the multiply).
    pub scale: f32,
    pub then: Then,
}

/// An `nn.dense` as the plain product `x · wᵀ` in f32 (no `units` other than the weight's rows,
/// no other output dtype).
fn plain_dense(n: &BlockNode) -> bool {
    n.op.name == "nn.dense"
        && matches!(
            n.attrs.str("out_dtype").ok().flatten(),
            None | Some("") | Some("float32")
        )
        && matches!(n.ty.as_tensor(), Some((_, tumble_ir::DType::Float32)))
}

/// `block`'s query form, if it has it.
pub fn find(block: &Block) -> Option<Query> {
    let [output] = block.outputs.as_slice() else {
        return None;
    };
    let node = |v: &BVal| match v {
        BVal::Node(n) => block.nodes.get(*n as usize),
        _ => None,
    };
    let input = |v: &BVal| match v {
        BVal::Input(i) => Some(*i),
        _ => None,
    };
    let out = node(output)?;
    // The last of the scores' two axes, as an integer (softmax) or a list of one (argmax).
    let last_axis = |n: &BlockNode| {
        matches!(
            n.attrs.int("axis").ok().flatten(),
            None | Some(-1) | Some(1)
        )
    };
    let last_axes = |n: &BlockNode| {
        matches!(
            n.attrs.ints("axis").ok().flatten().as_deref(),
            Some([-1]) | Some([1])
        )
    };
    // Read back from the output: the scores, and what follows them.
    let (then, scores, rows_read, mut count) = match out.op.name {
        "argmax" => {
            let plain = last_axes(out)
                && !out.attrs.bool("keepdims").ok().flatten().unwrap_or(false)
                && !out.attrs.bool("exclude").ok().flatten().unwrap_or(false)
                && !out
                    .attrs
                    .bool("select_last_index")
                    .ok()
                    .flatten()
                    .unwrap_or(false);
            if !plain {
                return None;
            }
            (Then::Argmax, one(&out.args, 0)?, None, 1)
        }
        "nn.dense" if plain_dense(out) => {
            let soft = node(one(&out.args, 0)?).filter(|n| n.op.name == "nn.softmax")?;
            if !last_axis(soft) {
                return None;
            }
            let t = node(one(&out.args, 1)?).filter(|n| n.op.name == "transpose")?;
            if !matches!(
                t.attrs.ints("axes").ok().flatten().as_deref(),
                None | Some([1, 0])
            ) {
                return None;
            }
            (
                Then::Attend,
                one(&soft.args, 0)?,
                Some(input(one(&t.args, 0)?)?),
                3,
            )
        }
        _ => return None,
    };
    let mut scores = scores;
    let mut scale = 1f32;
    if let Some(m) = node(scores).filter(|n| n.op.name == "multiply") {
        let (s, c) = match (one(&m.args, 0)?, one(&m.args, 1)?) {
            (BVal::Const(c), s) | (s, BVal::Const(c)) => (s, c),
            _ => return None,
        };
        scale = *c.as_f32().filter(|c| c.len() == 1)?.first()?;
        scores = s;
        count += 1;
    }
    let qk = node(scores).filter(|n| plain_dense(n))?;
    let q = input(one(&qk.args, 0)?)?;
    let rows = input(one(&qk.args, 1)?)?;
    if rows_read.is_some_and(|r| r != rows) || q == rows {
        return None;
    }
    count += 1;
    // Exactly the form's nodes, each read once but the output.
    if block.nodes.len() != count {
        return None;
    }
    let mut reads = vec![0u32; block.nodes.len()];
    for n in &block.nodes {
        for a in &n.args {
            match a {
                BArg::One(BVal::Node(i)) => *reads.get_mut(*i as usize)? += 1,
                BArg::One(BVal::Field(..)) | BArg::Tuple(_) => return None,
                BArg::One(_) => {}
            }
        }
    }
    if reads.iter().filter(|&&r| r != 1).count() != 1 {
        return None;
    }
    // The query of static shape, the rows of any length, both f32 rows of the same width.
    let dims = |i: u32| block.inputs.get(i as usize)?.ty.as_tensor();
    let (qd, qt) = dims(q)?;
    let (rd, rt) = dims(rows)?;
    let f32s = qt == tumble_ir::DType::Float32 && rt == tumble_ir::DType::Float32;
    let width = |d: &[tumble_ir::Dim]| d.get(1).and_then(|x| x.known());
    if !f32s
        || qd.len() != 2
        || rd.len() != 2
        || qd.iter().any(|d| d.known().is_none())
        || width(qd).is_none()
        || width(qd) != width(rd)
    {
        return None;
    }
    Some(Query {
        q,
        rows,
        scale,
        then,
    })
}
