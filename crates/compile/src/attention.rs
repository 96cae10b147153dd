//! Scaled dot-product attention recognized in a block, so that an executor can run it as one
//! kernel over each instance's rows where they lie instead of operator by operator.
//!
//! The form (per instance, `L` its sequence length, `H` heads of width `d`):
//!
//! ```text
//! %q' = transpose(%q, axes=[1, 0, 2])          // %q, %k, %v: (L, H, d) inputs
//! %k' = transpose(%k, axes=[1, 0, 2])
//! %v' = transpose(%v, axes=[1, 0, 2])
//! %s  = nn.batch_matmul(%q', %k', transpose_a=False, transpose_b=True)    // (H, L, L)
//! %s' = multiply(%s, c)                        // optional, a scalar literal either side
//!                                               // (or divide(%s, c): a scale of 1 / c)
//! %p  = nn.softmax(%s', axis=-1)
//! %o  = nn.batch_matmul(%p, %v', transpose_a=False, transpose_b=False)    // (H, L, d)
//! return transpose(%o, axes=[1, 0, 2])         // (L, H, d)
//! ```
//!
//! — exactly these nodes, in any order, each read only as shown. It is what the ragged analysis
//! leaves as the mixing segment of a BERT layer ([`crate::ragged`]): the row-wise projections
//! before it, the output projection after it. The transposes are layout only: a kernel reading
//! row `a` of head `h` at `a·H·d + h·d` computes the same values without them.

use crate::blocks::{BArg, BVal, Block};

/// Where a block of the attention form reads its operands (see the module's comment).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Attention {
    /// The block inputs holding Q, K and V, each `(L, heads, width)`.
    pub q: u32,
    pub k: u32,
    pub v: u32,
    pub heads: usize,
    pub width: usize,
    /// The scores' scale (`c`; 1 without the multiply).
    pub scale: f32,
}

/// The one tensor argument of an operand list, if that is what `args` is.
pub(crate) fn one(args: &[BArg], i: usize) -> Option<&BVal> {
    match args.get(i)? {
        BArg::One(v) => Some(v),
        BArg::Tuple(_) => None,
    }
}

/// `block`'s attention form, if it has it.
pub fn find(block: &Block) -> Option<Attention> {
    let [output] = block.outputs.as_slice() else {
        return None;
    };
    let named = |v: &BVal, name: &str| match v {
        BVal::Node(n) => block.nodes.get(*n as usize).filter(|x| x.op.name == name),
        _ => None,
    };
    let swap_01 = |n: &crate::blocks::BlockNode| matches!(n.attrs.ints("axes"), Ok(Some(a)) if a == [1, 0, 2]);
    // Read back from the output: transpose(batch_matmul(softmax(..), transpose(%v))).
    let out = named(output, "transpose")?;
    if !swap_01(out) {
        return None;
    }
    let pv = named(one(&out.args, 0)?, "nn.batch_matmul")?;
    // The operator's defaults: transpose_a=False, transpose_b=True; a product in another dtype
    // than its f32 operands' (`out_dtype`) is not the f32 kernel's.
    let flags = |n: &crate::blocks::BlockNode| {
        (
            n.attrs.bool("transpose_a").ok().flatten().unwrap_or(false),
            n.attrs.bool("transpose_b").ok().flatten().unwrap_or(true),
            matches!(
                n.attrs.str("out_dtype").ok().flatten(),
                None | Some("") | Some("float32")
            ),
        )
    };
    if flags(pv) != (false, false, true) {
        return None;
    }
    let soft = named(one(&pv.args, 0)?, "nn.softmax")?;
    let axis = soft.attrs.int("axis").ok().flatten().unwrap_or(-1);
    if axis != -1 && axis != 2 {
        return None;
    }
    // The scores, scaled or not.
    let mut scores = one(&soft.args, 0)?;
    let mut scale = 1f32;
    let mut nodes_seen = 0;
    if let Some(m) = named(scores, "multiply") {
        let (a, b) = (one(&m.args, 0)?, one(&m.args, 1)?);
        let (s, c) = match (a, b) {
            (BVal::Const(c), s) | (s, BVal::Const(c)) => (s, c),
            _ => return None,
        };
        // A scalar f32 literal (an f32 times it is what the multiply computes).
        let c = c.as_f32().filter(|c| c.len() == 1)?;
        scale = *c.first()?;
        scores = s;
        nodes_seen += 1;
    } else if let Some(d) = named(scores, "divide") {
        // `divide(%s, c)`, as PyTorch's `scores / math.sqrt(d)` exports: a scale of 1 / c (the
        // same products for a power of two, within an ulp otherwise).
        let (BVal::Const(c), s) = (one(&d.args, 1)?, one(&d.args, 0)?) else {
            return None;
        };
        let c = *c.as_f32().filter(|c| c.len() == 1)?.first()?;
        // (A divisor whose reciprocal overflows or is subnormal stays a division.)
        let inverse = 1.0 / c;
        if !c.is_normal() || !inverse.is_normal() {
            return None;
        }
        scale = inverse;
        scores = s;
        nodes_seen += 1;
    }
    let qk = named(scores, "nn.batch_matmul")?;
    if flags(qk) != (false, true, true) {
        return None;
    }
    let input_of = |v: &BVal| -> Option<u32> {
        let t = named(v, "transpose")?;
        if !swap_01(t) {
            return None;
        }
        match one(&t.args, 0)? {
            BVal::Input(i) => Some(*i),
            _ => None,
        }
    };
    let q = input_of(one(&qk.args, 0)?)?;
    let k = input_of(one(&qk.args, 1)?)?;
    let v = input_of(one(&pv.args, 1)?)?;
    // Exactly the form's nodes: three input transposes, two products, the softmax, the output
    // transpose and the optional multiply — nothing else computed, nothing else read.
    nodes_seen += 7;
    if block.nodes.len() != nodes_seen {
        return None;
    }
    let mut reads = vec![0u32; block.nodes.len()];
    for n in &block.nodes {
        for a in &n.args {
            match a {
                BArg::One(BVal::Node(i)) | BArg::One(BVal::Field(i, _)) => {
                    *reads.get_mut(*i as usize)? += 1
                }
                BArg::Tuple(_) => return None,
                BArg::One(_) => {}
            }
        }
    }
    if reads.iter().filter(|&&r| r != 1).count() != 1 {
        // Every node is read once but the output transpose, read by none.
        return None;
    }
    // Q, K and V: (L, heads, width) f32 tensors of the same heads and width.
    let dims = |i: u32| -> Option<(usize, usize)> {
        let (d, dtype) = block.inputs.get(i as usize)?.ty.as_tensor()?;
        if dtype != tumble_ir::DType::Float32 || d.len() != 3 {
            return None;
        }
        let known = |j: usize| usize::try_from(d.get(j)?.known()?).ok();
        Some((known(1)?, known(2)?))
    };
    let (heads, width) = dims(q)?;
    if dims(k)? != (heads, width) || dims(v)? != (heads, width) || heads == 0 || width == 0 {
        return None;
    }
    Some(Attention {
        q,
        k,
        v,
        heads,
        width,
        scale,
    })
}
