//! Which global functions grain coarsening may inline into the block of their caller.
//!
//! A user who writes a cell as an ordinary helper (`def @gelu(%x) { ... }`, `def @attention(...)`)
//! means the same static block as one who marks it `Primitive=1`, and more: a helper called inside
//! a larger expression belongs to that expression's block (Berxit's Q/K/V projections inside
//! `@split_heads(..)` calls fuse horizontally only once they are in one block). A function is
//! inlinable when its body is straight-line tensor work — pure operators, `let`s, tuples,
//! projections, literals and calls to other inlinable functions, no recursion — over parameters
//! and a result that are tensors or tuples of tensors. `Primitive=1` functions keep their own
//! blocks (the user drew that boundary).

use std::collections::HashMap;
use tumble_ir::{Expr, ExprKind, Function, Module, Ty};

use crate::blocks::joins_blocks;

/// Inlined bodies are added to a block only while it has fewer nodes than this, so that a chain of
/// helpers each calling the next twice cannot make a block (and the compile time) exponential.
pub const MAX_INLINED_NODES: usize = 4096;

/// A function is inlined only while its body, with everything it inlines in turn, has at most this
/// many operator calls. Cells and helpers are small (Berxit's attention helpers: tens); without a
/// bound, a chain of N helpers each calling the next inlined the whole rest of the chain into every
/// one of them (O(N²) block nodes: 5,000 globals took 9 s and 1.5 GB to run).
pub const MAX_INLINED_OPS: usize = 256;

/// ... and at most this many calls, counted the same way: helpers that only forward to the next
/// have no operators, and a chain of 10,000 of them, each inlined whole into the one before it,
/// took 14 s to compile (at least the operators' bound, so that bound is met first where a helper
/// computes anything).
pub const MAX_INLINED_CALLS: usize = MAX_INLINED_OPS;

/// The inlinable functions of `module`, by name.
pub fn inlinable(module: &Module) -> HashMap<String, &Function> {
    let defs: HashMap<&str, &Function> = module
        .defs()
        .filter(|d| d.type_params.is_empty() && !d.func.attrs.is_primitive())
        .filter(|d| {
            d.func
                .params
                .iter()
                .all(|p| p.ty.as_ref().is_some_and(tensors_only))
                && d.func.body.ty.as_ref().is_some_and(tensors_only)
        })
        .map(|d| (d.name.name.as_str(), &d.func))
        .collect();
    // Straight-line bodies: their own operator calls and the globals they call (with repeats).
    let mut bodies: HashMap<&str, (usize, Vec<&str>)> = HashMap::new();
    for (name, f) in &defs {
        let mut body = (0, Vec::new());
        if straight_line(&f.body, &mut body) {
            bodies.insert(name, body);
        }
    }
    // Expanded sizes, callees first. A function on a cycle, calling a function that is not
    // inlinable, or too large once expanded is not inlinable.
    let names: Vec<&str> = bodies.keys().copied().collect();
    let index: HashMap<&str, usize> = names.iter().enumerate().map(|(i, &n)| (n, i)).collect();
    let callees: Vec<Vec<usize>> = names
        .iter()
        .map(|n| {
            // A callee that is not straight-line gets an index past the end: never sized.
            let calls = bodies.get(n).map_or(&[][..], |(_, c)| c.as_slice());
            calls
                .iter()
                .map(|g| index.get(g).copied().unwrap_or(usize::MAX))
                .collect()
        })
        .collect();
    let (order, on_cycle) = crate::callgraph::callees_first(&callees);
    // (operators, calls) of each inlinable function once expanded.
    let mut size: Vec<Option<(usize, usize)>> = vec![None; names.len()];
    for f in order {
        if on_cycle[f] {
            continue;
        }
        let own = names
            .get(f)
            .and_then(|n| bodies.get(n))
            .map_or(0, |(own, _)| *own);
        let total = callees[f]
            .iter()
            .try_fold((own, callees[f].len()), |(ops, calls), &g| {
                let (o, c) = size.get(g).copied().flatten()?;
                Some((ops.checked_add(o)?, calls.checked_add(c)?))
            });
        size[f] =
            total.filter(|&(ops, calls)| ops <= MAX_INLINED_OPS && calls <= MAX_INLINED_CALLS);
    }
    names
        .iter()
        .zip(&size)
        .filter(|(_, s)| s.is_some())
        .filter_map(|(&n, _)| defs.get(n).map(|f| (n.to_string(), *f)))
        .collect()
}

fn tensors_only(t: &Ty) -> bool {
    match t {
        Ty::Tensor { .. } => true,
        Ty::Tuple(ts) => ts.iter().all(tensors_only),
        _ => false,
    }
}

/// The body is pure straight-line tensor work; its operator calls are counted in `body.0` and the
/// globals it calls pushed to `body.1` (once per call).
fn straight_line<'e>(e: &'e Expr, body: &mut (usize, Vec<&'e str>)) -> bool {
    match &e.kind {
        ExprKind::Local(_) | ExprKind::Lit(_) => true,
        ExprKind::Tuple(es) => es.iter().all(|x| straight_line(x, body)),
        ExprKind::Proj(inner, _) => straight_line(inner, body),
        ExprKind::Let(bs, rest) => {
            bs.iter().all(|b| straight_line(&b.value, body)) && straight_line(rest, body)
        }
        ExprKind::Call(c) => {
            let callee_ok = match &c.callee.kind {
                ExprKind::Op(n) => {
                    body.0 += 1;
                    tumble_ops::lookup(n).is_some_and(joins_blocks)
                }
                ExprKind::Global(g) => {
                    body.1.push(g.as_str());
                    true
                }
                _ => false,
            };
            callee_ok && c.args.iter().all(|a| straight_line(a, body))
        }
        _ => false,
    }
}
