//! Specialization of higher-order functions on the closures they are given. `@map(fn (%c) {..},
//! %children)` makes the interpreter build a closure value, and every element then goes through a
//! call of an unknown function: a frame for the closure, with its value kept for `SelfRef`. When a
//! closure captures nothing (after [`crate::consts`] most of the zoo's closures capture only
//! weights, which it removes), the callee can be cloned with that argument fixed: calls of the
//! parameter become direct calls of the closure's body (made a global of its own), the recursive
//! calls pass it along no more, and [`crate::inline_leaves`] can then copy a small body (a block
//! invocation, a projection) into the loop.
//!
//! A call `@g(.., e, ..)` qualifies when `e` is `MakeClosure(c)` or a slot bound once by a `let` to
//! it, `c` captures nothing and does not refer to itself, `g` is not the entry and makes no closure
//! that captures a slot (the clone renumbers its slots), and the parameter is used only as a callee,
//! passed unchanged to `g` itself, or as a value (then the closure is made where it is read).
//! Specializations are shared per (function, parameter, closure); bounded in rounds and in the
//! number of functions added.

use std::collections::HashMap;

use crate::program::{CaptureFrom, Code, Lambda, Program};

/// Functions a program may grow by through specialization.
const MAX_NEW: usize = 128;
const MAX_ROUNDS: usize = 4;

/// One specialization: `function` with parameter `param` fixed to the closure `closure`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Specialized {
    pub function: String,
    pub param: u32,
    pub closure: String,
    pub name: String,
}

/// Specializes the qualifying calls; returns the specializations made.
pub fn specialize(program: &mut Program, entry: &str) -> Vec<Specialized> {
    let entry_global = program.global_index.get(entry).copied();
    let mut made: HashMap<(u32, u32, u32), u32> = HashMap::new();
    let mut as_global: HashMap<u32, u32> = HashMap::new();
    let mut report = Vec::new();
    let mut retargeted: Vec<usize> = Vec::new();
    for _ in 0..MAX_ROUNDS {
        let mut changed = false;
        let reached = program.reached_from(entry_global, |_| false);
        for l in 0..program.lambdas.len() {
            if !reached.get(l).copied().unwrap_or(false) {
                continue;
            }
            let requests = requests_in(program, l, entry_global);
            for (path, g, i, c) in requests {
                if made.len() >= MAX_NEW && !made.contains_key(&(g, i, c)) {
                    continue;
                }
                let g2 = match made.get(&(g, i, c)) {
                    Some(&g2) => g2,
                    None => {
                        let g2 = clone_fixed(program, g, i, c, &mut as_global);
                        made.insert((g, i, c), g2);
                        let name = |gl: u32| {
                            program
                                .globals
                                .get(gl as usize)
                                .and_then(|&x| program.lambdas.get(x as usize))
                                .map_or_else(String::new, |x| x.name.clone())
                        };
                        report.push(Specialized {
                            function: name(g),
                            param: i,
                            closure: program
                                .lambdas
                                .get(c as usize)
                                .map_or_else(String::new, |x| x.name.clone()),
                            name: name(g2),
                        });
                        g2
                    }
                };
                if let Some(lambda) = program.lambdas.get_mut(l) {
                    retarget(&mut lambda.body, &path, g2, i);
                    changed = true;
                    retargeted.push(l);
                }
            }
        }
        if !changed {
            break;
        }
    }
    retargeted.sort_unstable();
    retargeted.dedup();
    for l in retargeted {
        drop_unread_closures(program, l);
    }
    report
}

/// Removes from lambda `l` the `let` bindings of closures that nothing reads any more (the
/// specialized call no longer passes them): building one was an evaluation step, an allocation
/// and a `let` continuation per call of `l` (TreeLSTM's `%add2`, once per inner node).
fn drop_unread_closures(program: &mut Program, l: usize) {
    let reads = crate::merge::slot_uses(program, l);
    let unread = |s: u32| reads.get(s as usize) == Some(&0);
    let Some(lambda) = program.lambdas.get_mut(l) else {
        return;
    };
    lambda.body.visit_mut(&mut |c| {
        // A `let` left without bindings is its body (which may itself be a `let`).
        while let Code::Let { binds, body, .. } = c {
            binds.retain(|(s, v)| !(matches!(v, Code::MakeClosure(_)) && unread(*s)));
            if !binds.is_empty() {
                break;
            }
            let body = std::mem::replace(&mut **body, Code::Phase);
            *c = body;
        }
    });
}

/// The qualifying calls in lambda `l`: (path to the call in the body, callee, parameter,
/// closure), at most one per call, deepest calls last so retargeting by path stays valid.
fn requests_in(
    program: &Program,
    l: usize,
    entry: Option<u32>,
) -> Vec<(Vec<usize>, u32, u32, u32)> {
    let Some(lambda) = program.lambdas.get(l) else {
        return Vec::new();
    };
    let closures = let_bound_closures(lambda);
    let mut out = Vec::new();
    let mut path = Vec::new();
    find_calls(&lambda.body, &mut path, &mut |p, code| {
        let Code::CallGlobal { global, args, .. } = code else {
            return;
        };
        if Some(*global) == entry {
            return;
        }
        for (i, a) in args.iter().enumerate() {
            let c = match a {
                Code::MakeClosure(c) => Some(*c),
                Code::Slot(s) => closures.get(s).copied(),
                _ => None,
            };
            if let Some(c) = c {
                if closure_ok(program, c) && callee_ok(program, *global, i as u32) {
                    out.push((p.to_vec(), *global, i as u32, c));
                    return;
                }
            }
        }
    });
    // Retargeting removes an argument: later paths must not pass through an earlier call's
    // arguments, so handle the deepest first.
    out.reverse();
    out
}

/// Calls `f` with each code node and its path (child indices from the body) in pre-order.
fn find_calls(code: &Code, path: &mut Vec<usize>, f: &mut impl FnMut(&[usize], &Code)) {
    f(path, code);
    let mut i = 0;
    code.for_each_child(|k| {
        path.push(i);
        find_calls(k, path, f);
        path.pop();
        i += 1;
    });
}

fn at_path<'a>(code: &'a mut Code, path: &[usize]) -> Option<&'a mut Code> {
    let Some((&first, rest)) = path.split_first() else {
        return Some(code);
    };
    let mut i = 0;
    let mut found = None;
    code.for_each_child_mut(|k| {
        if i == first {
            found = Some(k);
        }
        i += 1;
    });
    at_path(found?, rest)
}

/// Slots bound exactly once, by a `let`, to a closure.
fn let_bound_closures(lambda: &Lambda) -> HashMap<u32, u32> {
    let mut writes: HashMap<u32, usize> = HashMap::new();
    let mut closure: HashMap<u32, u32> = HashMap::new();
    lambda.body.visit(&mut |c| match c {
        Code::Let { binds, .. } => {
            for (s, v) in binds {
                *writes.entry(*s).or_default() += 1;
                if let Code::MakeClosure(m) = v {
                    closure.insert(*s, *m);
                }
            }
        }
        Code::Match { arms, .. } => {
            for (p, _) in arms {
                p.for_each_slot(&mut |s| *writes.entry(s).or_default() += 1);
            }
        }
        _ => {}
    });
    closure.retain(|s, _| *s >= lambda.n_params && writes.get(s) == Some(&1));
    closure.retain(|s, _| !lambda.captures.iter().any(|(_, t)| t == s));
    closure
}

fn closure_ok(program: &Program, c: u32) -> bool {
    let Some(lambda) = program.lambdas.get(c as usize) else {
        return false;
    };
    let mut self_ref = false;
    lambda
        .body
        .visit(&mut |k| self_ref |= matches!(k, Code::SelfRef));
    lambda.captures.is_empty() && !self_ref
}

/// Whether global `g`'s parameter `i` can be fixed: `g` makes no closure capturing a slot (its
/// clone renumbers slots) and the parameter is not captured.
fn callee_ok(program: &Program, g: u32, i: u32) -> bool {
    let Some(lambda) = program
        .globals
        .get(g as usize)
        .and_then(|&l| program.lambdas.get(l as usize))
    else {
        return false;
    };
    if i >= lambda.n_params || !lambda.captures.is_empty() {
        return false;
    }
    let mut ok = true;
    lambda.body.visit(&mut |k| {
        if let Code::MakeClosure(m) = k {
            if let Some(made) = program.lambdas.get(*m as usize) {
                ok &= made
                    .captures
                    .iter()
                    .all(|(from, _)| !matches!(from, CaptureFrom::Slot(_)));
            }
        }
    });
    ok
}

/// The global calling lambda `c` directly (made once per closure).
fn global_for(program: &mut Program, c: u32, as_global: &mut HashMap<u32, u32>) -> u32 {
    if let Some(&g) = as_global.get(&c) {
        return g;
    }
    let g = program.globals.len() as u32;
    program.globals.push(c);
    as_global.insert(c, g);
    g
}

/// Clones global `g` with parameter `i` fixed to closure `c`; returns the new global.
fn clone_fixed(
    program: &mut Program,
    g: u32,
    i: u32,
    c: u32,
    as_global: &mut HashMap<u32, u32>,
) -> u32 {
    let gc = global_for(program, c, as_global);
    let Some(&l) = program.globals.get(g as usize) else {
        return g;
    };
    let Some(mut lambda) = program.lambdas.get(l as usize).cloned() else {
        return g;
    };
    let closure_name = program
        .lambdas
        .get(c as usize)
        .map_or_else(String::new, |x| x.name.clone());
    lambda.name = format!("{}[{}={}#{c}]", lambda.name, i, closure_name);
    let g2 = program.globals.len() as u32;
    lambda.body.visit_mut(&mut |k| match k {
        Code::Call { operands, span } if matches!(operands.first(), Some(Code::Slot(s)) if *s == i) => {
            let args: Vec<Code> = operands.drain(1..).collect();
            *k = Code::CallGlobal {
                global: gc,
                args,
                span: *span,
            };
        }
        Code::CallGlobal { global, args, .. }
            if *global == g && matches!(args.get(i as usize), Some(Code::Slot(s)) if *s == i) =>
        {
            *global = g2;
            args.remove(i as usize);
        }
        _ => {}
    });
    // Any other read of the parameter is the closure value itself.
    lambda.body.visit_mut(&mut |k| {
        if matches!(k, Code::Slot(s) if *s == i) {
            *k = Code::MakeClosure(c);
        }
    });
    // Parameter `i` is read nowhere now (`g` makes no closure capturing a slot).
    lambda.remove_unread_param(i);
    let l2 = program.lambdas.len() as u32;
    program.lambdas.push(lambda);
    program.globals.push(l2);
    g2
}

/// Points the call at `path` to `g2`, dropping its argument `i`.
fn retarget(body: &mut Code, path: &[usize], g2: u32, i: u32) {
    if let Some(Code::CallGlobal { global, args, .. }) = at_path(body, path) {
        if (i as usize) < args.len() {
            args.remove(i as usize);
            *global = g2;
        }
    }
}
