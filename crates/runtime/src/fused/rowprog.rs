//! Fused f32 row programs: their IR and the compiler from a row-program stage and its operands'
//! signatures.
//!
//! A row program is compiled from the block, the stage and its operands' signatures (batched or
//! shared, per-instance shape) — never from their values — so it is compiled once per signature and
//! reused by every later launch (`Options::row_cache`); each launch only binds the operands'
//! row pointers and runs it.

use std::collections::HashMap;
use std::sync::Arc;

use tumble_compile::plan::{RowOperands, ValKey};
use tumble_compile::{BArg, BVal, Block};
use tumble_ir::{AttrValue, DType, Ty};
use tumble_ops::OpValue;

use crate::batched::BV;

#[derive(Clone, Copy, Debug)]
pub(super) enum Src {
    /// A batched operand: row r is `ext[e][r][off..]`.
    Ext(usize),
    /// A shared vector, the same for every row.
    Shared(usize),
    /// The per-row scratch buffer.
    Scratch,
    /// A shared single value, broadcast (bound per launch: an input may differ between launches).
    Scalar(usize),
}

#[derive(Clone, Copy, Debug)]
pub(super) struct Opd {
    pub(super) src: Src,
    pub(super) off: usize,
    pub(super) len: usize,
}

#[derive(Clone, Copy, Debug)]
pub(super) enum Un {
    Sigmoid,
    Tanh,
    Exp,
    Log,
    Sqrt,
    Rsqrt,
    Abs,
    Neg,
    Relu,
    Copy,
    Erf,
}

impl Un {
    /// The row-program instruction of operator `name`, if it has one.
    pub(super) fn of(name: &str) -> Option<Un> {
        Some(match name {
            "sigmoid" => Un::Sigmoid,
            "tanh" => Un::Tanh,
            "exp" => Un::Exp,
            "log" => Un::Log,
            "sqrt" => Un::Sqrt,
            "rsqrt" => Un::Rsqrt,
            "abs" => Un::Abs,
            "negative" => Un::Neg,
            "nn.relu" => Un::Relu,
            "copy" => Un::Copy,
            "erf" => Un::Erf,
            _ => return None,
        })
    }
}

#[derive(Clone, Copy, Debug)]
pub(super) enum Bin {
    Add,
    Sub,
    Mul,
    Div,
    Max,
    Min,
    Pow,
}

#[derive(Debug)]
pub(super) enum Instr {
    Unary(Un, usize, Opd),
    Binary(Bin, usize, Opd, Opd),
    Clip(usize, Opd, f32, f32),
    Concat(usize, Vec<Opd>),
    Softmax(usize, Opd, bool),
    LayerNorm(usize, Opd, Option<Opd>, Option<Opd>, f64),
}

/// A value inside a row program: a view of an operand (splits are views, not copies).
#[derive(Clone, Debug)]
pub(super) enum RVal {
    One(Opd),
    Tuple(Vec<Opd>),
}

/// What a row program knows of one external operand.
#[derive(Clone, PartialEq, Eq, Hash, Debug)]
pub(super) enum OpSig {
    /// Batched f32, with its per-instance shape.
    Batched(Vec<usize>),
    /// Shared f32, with its shape.
    Shared(Vec<usize>),
    /// Anything else (another dtype, a tuple): no row program.
    Other,
}

pub(super) fn sig_of(v: &BV) -> OpSig {
    match v {
        BV::Batched(OpValue::Tensor(t)) if t.dtype() == DType::Float32 => {
            OpSig::Batched(t.shape().get(1..).unwrap_or(&[]).to_vec())
        }
        BV::Rows(r) if r.dtype() == DType::Float32 => OpSig::Batched(r.shape().to_vec()),
        BV::Shared(OpValue::Tensor(t)) if t.dtype() == DType::Float32 => {
            OpSig::Shared(t.shape().to_vec())
        }
        _ => OpSig::Other,
    }
}

/// A compiled row program.
#[derive(Debug)]
pub struct RowProg {
    /// Per external operand, where it is bound (`Ext`, `Shared` or `Scalar`, with its width).
    pub(super) held: Vec<Opd>,
    /// Per-instance leading dims of the rows (the batch axis excluded).
    pub(super) lead_tail: Vec<usize>,
    pub(super) scratch_len: usize,
    pub(super) instrs: Vec<Instr>,
    /// Live values copied out: node, its fields' operands, whether it is a tuple.
    pub(super) outs: Vec<(usize, Vec<Opd>, bool)>,
    /// The flat output (index in `outs`' fields, in order) that is exactly the last
    /// instruction's destination and overlaps no other output: computed straight into the
    /// output row where the rows are written into preallocated outputs (epilogues, split rows).
    pub(super) last_into: Option<usize>,
}

impl Instr {
    /// The scratch range an instruction writes: its start and length.
    pub(super) fn dest(&self) -> (usize, usize) {
        match self {
            Instr::Unary(_, d, a)
            | Instr::Clip(d, a, ..)
            | Instr::Softmax(d, a, _)
            | Instr::LayerNorm(d, a, ..) => (*d, a.len),
            Instr::Binary(_, d, a, bb) => (*d, a.len.max(bb.len)),
            Instr::Concat(d, parts) => (*d, parts.iter().map(|p| p.len).sum()),
        }
    }
}

/// See [`RowProg::last_into`].
pub(super) fn last_into(instrs: &[Instr], outs: &[(usize, Vec<Opd>, bool)]) -> Option<usize> {
    let (d, len) = instrs.last()?.dest();
    let flat: Vec<&Opd> = outs.iter().flat_map(|(_, os, _)| os.iter()).collect();
    let overlaps = |o: &Opd| matches!(o.src, Src::Scratch) && o.off < d + len && d < o.off + o.len;
    let mut hits = flat.iter().enumerate().filter(|(_, o)| overlaps(o));
    match (hits.next(), hits.next()) {
        (Some((k, o)), None) if o.off == d && o.len == len => Some(k),
        _ => None,
    }
}

/// Row programs compiled so far, per (stage, operand signatures); `None` records that the
/// signature has no row program, so it is not retried at every launch.
pub(super) type RowCache = HashMap<(usize, Vec<OpSig>), Option<Arc<RowProg>>>;

/// Whether two operands' leading dims describe the same rows: equal once the shorter is padded
/// with 1s in front, as broadcasting aligns them — `(1, L)` and `(L)` do, but `(L, 1)` and
/// `(1, L)` broadcast against each other to `L × L` rows (a pairwise sum over a sentence's
/// tokens) and do not, though both strip to `(L)`.
pub(super) fn same_rows(a: &[usize], b: &[usize]) -> bool {
    let n = a.len().max(b.len());
    let at = |l: &[usize], i: usize| match (i + l.len()).checked_sub(n) {
        Some(j) => l.get(j).copied().unwrap_or(1),
        None => 1,
    };
    (0..n).all(|i| at(a, i) == at(b, i))
}

/// The row width of a shared operand of shape `shape` read row by row alongside batched rows of
/// per-instance leading dims `lead`, when its own leading dims (leading 1s dropped) are the last
/// of `lead`: broadcasting then repeats it for every instance (and every outer index), so row `r`
/// of the launch reads its row `r % rows`. `None` otherwise (or with no batched operand).
/// `TUMBLE_NO_SHARED_ROWS=1`: such a stage is no row program (it runs operator by operator).
pub(super) fn shared_rows_width(shape: &[usize], lead: Option<&[usize]>) -> Option<usize> {
    if tumble_limits::switch_on!("TUMBLE_NO_SHARED_ROWS") {
        return None;
    }
    let (&w, own) = shape.split_last()?;
    let own = &own[own.iter().take_while(|&&d| d == 1).count()..];
    (w > 0 && !own.is_empty() && lead?.ends_with(own)).then_some(w)
}

/// Compiles the row program of nodes `ns` for operands of signature `sig`.
pub(super) fn compile_rows(
    block: &Block,
    ns: &[usize],
    ops: &RowOperands,
    sig: &[OpSig],
    live_out: &[bool],
) -> Option<RowProg> {
    // The rows: the longest leading dims of the batched operands, which must all describe the
    // same rows (size-1 per-instance dims broadcast, so (B, 1, n) and (B, n) line up).
    let mut lead_tail: Option<Vec<usize>> = None;
    for s in sig {
        if let OpSig::Batched(p) = s {
            let tail = p.split_last().map_or(&[][..], |(_, tail)| tail);
            match &lead_tail {
                None => lead_tail = Some(tail.to_vec()),
                Some(l) if same_rows(l, tail) => {
                    if tail.len() > l.len() {
                        lead_tail = Some(tail.to_vec());
                    }
                }
                Some(_) => return bail(6),
            }
        }
    }
    let mut held_opd: Vec<Opd> = Vec::with_capacity(sig.len());
    let (mut n_ext, mut n_shared, mut n_scalar) = (0, 0, 0);
    for s in sig {
        match s {
            OpSig::Other => return bail(1),
            OpSig::Batched(p) => {
                // A scalar per instance (a length, a temperature) is a one-wide row: each row
                // reads its own as a splat.
                let w = p.last().copied().unwrap_or(1);
                if w == 0 {
                    return bail(4);
                }
                held_opd.push(Opd {
                    src: Src::Ext(n_ext),
                    off: 0,
                    len: w,
                });
                n_ext += 1;
            }
            OpSig::Shared(shape) => {
                let len: usize = shape.iter().product();
                if len == 1 {
                    held_opd.push(Opd {
                        src: Src::Scalar(n_scalar),
                        off: 0,
                        len: 1,
                    });
                    n_scalar += 1;
                } else if shape.iter().rev().skip(1).all(|&d| d == 1) {
                    // A shared row vector (n) or (1, n): broadcast to every row.
                    held_opd.push(Opd {
                        src: Src::Shared(n_shared),
                        off: 0,
                        len,
                    });
                    n_shared += 1;
                } else if let Some(w) = shared_rows_width(shape, lead_tail.as_deref()) {
                    // A shared matrix whose rows are those of every instance (a transformer's
                    // positional embeddings (L, d) added to each sentence's (L, d), a CRF's
                    // transitions): read as a batched operand whose rows repeat it, instance after
                    // instance ([`super::rowexec::bind`]).
                    held_opd.push(Opd {
                        src: Src::Ext(n_ext),
                        off: 0,
                        len: w,
                    });
                    n_ext += 1;
                } else {
                    return bail(7);
                }
            }
        }
    }
    let Some(lead_tail) = lead_tail else {
        // Nothing batched: not a row program (the batching rules compute shared values once).
        return bail(8);
    };
    // Every result must describe the same rows: a node that reads only shared operands (a
    // weight's `divide`) next to per-instance work of another row shape would be computed once
    // per row and come out with the rows of the other operands (found by the program generator,
    // seed 17871: a (1, 2) result returned as (4, 2)).
    // A tuple result (`split`) is checked field by field: a shared `split` next to per-instance
    // rows of another shape came out with their rows too (program generator, seed 2200278: a
    // (1, 3) field returned as (3, 3)).
    for &n in ns {
        let Some(ty) = block.nodes.get(n).map(|node| &node.ty) else {
            continue;
        };
        let parts = match ty {
            Ty::Tuple(fields) => fields.as_slice(),
            other => std::slice::from_ref(other),
        };
        for part in parts {
            let Some((dims, _)) = part.as_tensor() else {
                return bail(9);
            };
            let known: Option<Vec<usize>> =
                dims.iter().map(|d| d.known().map(|x| x as usize)).collect();
            match known {
                Some(d)
                    if same_rows(
                        d.get(..d.len().saturating_sub(1)).unwrap_or(&[]),
                        &lead_tail,
                    ) => {}
                Some(_) => return bail(9),
                None => {}
            }
        }
    }
    let mut bld = Builder {
        scratch_len: 0,
        instrs: Vec::new(),
    };
    // The program's value of each node compiled so far, by node index (a search of a list per
    // operand made a stage of n operators cost n² to compile).
    let mut env: crate::intern::WordMap<usize, RVal> = Default::default();
    let lookup = |v: &BVal, env: &crate::intern::WordMap<usize, RVal>| -> Option<Opd> {
        let inside = match v {
            BVal::Node(k) => env.get(&(*k as usize)).map(|r| match r {
                RVal::One(o) => Some(*o),
                RVal::Tuple(_) => None,
            }),
            BVal::Field(k, f) => env.get(&(*k as usize)).map(|r| match r {
                RVal::Tuple(os) => os.get(*f as usize).copied(),
                RVal::One(_) => None,
            }),
            _ => None,
        };
        match inside {
            Some(found) => found,
            None => {
                let key = ValKey::of(v);
                ops.keys
                    .iter()
                    .position(|k| *k == key)
                    .and_then(|h| held_opd.get(h).copied())
            }
        }
    };
    for &i in ns {
        let node = block.nodes.get(i)?;
        let one = |j: usize, env: &crate::intern::WordMap<usize, RVal>| -> Option<Opd> {
            match node.args.get(j) {
                Some(BArg::One(v)) => lookup(v, env),
                _ => None,
            }
        };
        let alloc = |len: usize, bld: &mut Builder| {
            let off = bld.scratch_len;
            bld.scratch_len += len;
            Opd {
                src: Src::Scratch,
                off,
                len,
            }
        };
        let bin = |name: &str| match name {
            "add" | "nn.bias_add" => Some(Bin::Add),
            "subtract" => Some(Bin::Sub),
            "multiply" => Some(Bin::Mul),
            "divide" => Some(Bin::Div),
            "maximum" => Some(Bin::Max),
            "minimum" => Some(Bin::Min),
            "power" => Some(Bin::Pow),
            _ => None,
        };
        let name = node.op.name;
        let result = if let Some(u) = Un::of(name) {
            let Some(a) = one(0, &env) else {
                return bail(9);
            };
            let d = alloc(a.len, &mut bld);
            bld.instrs.push(Instr::Unary(u, d.off, a));
            RVal::One(d)
        } else if let Some(op) = bin(name) {
            let (Some(a), Some(b)) = (one(0, &env), one(1, &env)) else {
                return bail(10);
            };
            let len = a.len.max(b.len);
            if (a.len != len && a.len != 1) || (b.len != len && b.len != 1) {
                return bail(11);
            }
            let d = alloc(len, &mut bld);
            bld.instrs.push(Instr::Binary(op, d.off, a, b));
            RVal::One(d)
        } else {
            match name {
                "clip" => {
                    let Some(a) = one(0, &env) else {
                        return bail(12);
                    };
                    let lo = node
                        .attrs
                        .float("a_min")
                        .ok()
                        .flatten()
                        .unwrap_or(f64::NEG_INFINITY) as f32;
                    let hi = node
                        .attrs
                        .float("a_max")
                        .ok()
                        .flatten()
                        .unwrap_or(f64::INFINITY) as f32;
                    let d = alloc(a.len, &mut bld);
                    bld.instrs.push(Instr::Clip(d.off, a, lo, hi));
                    RVal::One(d)
                }
                "split" => {
                    let Some(a) = one(0, &env) else {
                        return bail(13);
                    };
                    let bounds: Vec<usize> = match node.attrs.get("indices_or_sections") {
                        Some(AttrValue::Int(s)) if *s > 0 && a.len % (*s as usize) == 0 => {
                            let w = a.len / *s as usize;
                            (0..=*s as usize).map(|k| k * w).collect()
                        }
                        Some(AttrValue::List(is)) => {
                            let mut v = vec![0];
                            for x in is {
                                match x {
                                    AttrValue::Int(k) if *k >= 0 && (*k as usize) <= a.len => {
                                        v.push(*k as usize)
                                    }
                                    _ => return bail(14),
                                }
                            }
                            v.push(a.len);
                            v
                        }
                        _ => return bail(15),
                    };
                    if bounds.windows(2).any(|w| w[1] < w[0]) {
                        return bail(16);
                    }
                    RVal::Tuple(
                        bounds
                            .windows(2)
                            .map(|w| Opd {
                                src: a.src,
                                off: a.off + w[0],
                                len: w[1] - w[0],
                            })
                            .collect(),
                    )
                }
                "concatenate" => {
                    let Some(BArg::Tuple(vs)) = node.args.first() else {
                        return bail(17);
                    };
                    let parts = vs
                        .iter()
                        .map(|v| lookup(v, &env))
                        .collect::<Option<Vec<_>>>();
                    let Some(parts) = parts else {
                        return bail(18);
                    };
                    if parts.iter().any(|p| matches!(p.src, Src::Scalar(_))) {
                        return bail(19);
                    }
                    let d = alloc(parts.iter().map(|p| p.len).sum(), &mut bld);
                    bld.instrs.push(Instr::Concat(d.off, parts));
                    RVal::One(d)
                }
                "nn.softmax" | "nn.log_softmax" => {
                    let Some(a) = one(0, &env) else {
                        return bail(20);
                    };
                    let d = alloc(a.len, &mut bld);
                    bld.instrs
                        .push(Instr::Softmax(d.off, a, name == "nn.log_softmax"));
                    RVal::One(d)
                }
                "nn.layer_norm" => {
                    let (Some(a), Some(g), Some(be)) = (one(0, &env), one(1, &env), one(2, &env))
                    else {
                        return bail(21);
                    };
                    if g.len != a.len || be.len != a.len {
                        return bail(22);
                    }
                    // f64 as the reference's: an epsilon below f32's least (1e-50) is not 0.
                    let eps = node.attrs.float("epsilon").ok().flatten().unwrap_or(1e-5);
                    let center = node.attrs.bool("center").ok().flatten().unwrap_or(true);
                    let scale = node.attrs.bool("scale").ok().flatten().unwrap_or(true);
                    let d = alloc(a.len, &mut bld);
                    bld.instrs.push(Instr::LayerNorm(
                        d.off,
                        a,
                        scale.then_some(g),
                        center.then_some(be),
                        eps,
                    ));
                    RVal::One(d)
                }
                _ => return bail(23),
            }
        };
        // The node's static type must agree with the row layout (per-instance rank = lead rank).
        let expect_rank = 1 + lead_tail.len(); // batched rank = lead + 1 = per-instance rank + 1
        let node_rank = match &node.ty {
            Ty::Tuple(ts) => ts.first().and_then(rank),
            t => rank(t),
        };
        if node_rank != Some(expect_rank) {
            return bail(24);
        }
        env.insert(i, result);
    }
    let outs: Vec<(usize, Vec<Opd>, bool)> = ns
        .iter()
        .filter(|&&i| live_out.get(i).copied().unwrap_or(false))
        .filter_map(|&i| {
            env.get(&i).map(|r| match r {
                RVal::One(o) => (i, vec![*o], false),
                RVal::Tuple(os) => (i, os.clone(), true),
            })
        })
        .collect();
    let last_into = last_into(&bld.instrs, &outs);
    Some(RowProg {
        held: held_opd,
        lead_tail,
        scratch_len: bld.scratch_len,
        instrs: bld.instrs,
        outs,
        last_into,
    })
}

pub(super) struct Builder {
    pub(super) scratch_len: usize,
    pub(super) instrs: Vec<Instr>,
}

/// Why a row program did not apply (printed with `TUMBLE_DEBUG_FUSION=1`, for development).
pub(super) fn bail<T>(site: u32) -> Option<T> {
    // Read once: bailing happens per launch for shared-only segments.
    if tumble_limits::switch_on!("TUMBLE_DEBUG_FUSION") {
        eprintln!("row program fell back at check {site}");
    }
    None
}

fn rank(t: &Ty) -> Option<usize> {
    t.as_tensor().map(|(d, _)| d.len())
}
