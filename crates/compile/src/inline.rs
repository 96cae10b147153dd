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

use std::collections::{HashMap, HashSet};
use tumble_ir::{Expr, ExprKind, Function, Module, Ty};

use crate::blocks::is_pure_op;

/// Inlined bodies are added to a block only while it has fewer nodes than this, so that a chain of
/// helpers each calling the next twice cannot make a block (and the compile time) exponential.
pub const MAX_INLINED_NODES: usize = 4096;

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
    // Straight-line bodies, with the globals each calls.
    let mut calls: HashMap<&str, HashSet<&str>> = HashMap::new();
    for (name, f) in &defs {
        let mut called = HashSet::new();
        if straight_line(&f.body, &mut called) {
            calls.insert(name, called);
        }
    }
    // Drop functions that call something not inlinable, until nothing changes; what remains calls
    // only inlinable functions. Recursion (a cycle) cannot be straight-line work that ends, so a
    // function on a cycle is dropped too.
    loop {
        let keep: HashSet<&str> = calls.keys().copied().collect();
        let before = calls.len();
        calls.retain(|_, called| called.iter().all(|g| keep.contains(g)));
        if calls.len() == before {
            break;
        }
    }
    let on_cycle: Vec<&str> = calls
        .keys()
        .copied()
        .filter(|&f| reaches(f, f, &calls))
        .collect();
    for f in on_cycle {
        calls.remove(f);
    }
    calls
        .keys()
        .filter_map(|&n| defs.get(n).map(|f| (n.to_string(), *f)))
        .collect()
}

fn tensors_only(t: &Ty) -> bool {
    match t {
        Ty::Tensor { .. } => true,
        Ty::Tuple(ts) => ts.iter().all(tensors_only),
        _ => false,
    }
}

/// The body is pure straight-line tensor work; the globals it calls are added to `called`.
fn straight_line<'e>(e: &'e Expr, called: &mut HashSet<&'e str>) -> bool {
    match &e.kind {
        ExprKind::Local(_) | ExprKind::Lit(_) => true,
        ExprKind::Tuple(es) => es.iter().all(|x| straight_line(x, called)),
        ExprKind::Proj(inner, _) => straight_line(inner, called),
        ExprKind::Let(bs, body) => {
            bs.iter().all(|b| straight_line(&b.value, called)) && straight_line(body, called)
        }
        ExprKind::Call(c) => {
            let callee_ok = match &c.callee.kind {
                ExprKind::Op(n) => tumble_ops::lookup(n).is_some_and(is_pure_op),
                ExprKind::Global(g) => {
                    called.insert(g.as_str());
                    true
                }
                _ => false,
            };
            callee_ok && c.args.iter().all(|a| straight_line(a, called))
        }
        _ => false,
    }
}

/// `to` is reachable from `from` by one or more calls.
fn reaches(from: &str, to: &str, calls: &HashMap<&str, HashSet<&str>>) -> bool {
    let mut seen = HashSet::new();
    let mut stack: Vec<&str> = calls
        .get(from)
        .map(|c| c.iter().copied().collect())
        .unwrap_or_default();
    while let Some(f) = stack.pop() {
        if f == to {
            return true;
        }
        if seen.insert(f) {
            if let Some(c) = calls.get(f) {
                stack.extend(c.iter().copied());
            }
        }
    }
    false
}
