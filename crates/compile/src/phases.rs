//! Automatic program phases (ACROBAT §4.1 and appendix A.3). The stages of the entry function — typically the
//! recursion over the instance, then an output layer on its result — are separated by a phase
//! boundary, so the output layer of every instance waits until all instances are through the
//! recursion and then runs as one launch, instead of trickling out at each instance's own depth.
//!
//! Heuristic: in the entry function's top-level `let` chain, a boundary goes before the first
//! element that invokes a block directly when an earlier element of the current phase called a
//! function that (transitively) invokes blocks. An explicit `db.phase_change()` starts a new phase
//! and suppresses the automatic boundary there. Every instance runs the top-level chain exactly
//! once, so every instance reaches every boundary.

use crate::program::{Code, Program};

/// Where boundaries were added: the index, in the entry's top-level chain, of the element each one
/// precedes.
pub fn insert(program: &mut Program, entry: &str) -> Vec<usize> {
    let Some(&l) = program
        .global_index
        .get(entry)
        .and_then(|g| program.globals.get(*g as usize))
    else {
        return Vec::new();
    };
    let does_tensor_work = tensor_functions(program);
    let globals = program.globals.clone();
    let Some(lambda) = program.lambdas.get_mut(l as usize) else {
        return Vec::new();
    };
    let Code::Let { binds, body } = &mut lambda.body else {
        return Vec::new();
    };
    let mut inserted = Vec::new();
    let mut called = false;
    let mut new_binds = Vec::with_capacity(binds.len() + 1);
    let phase_slot = lambda.n_slots;
    let n = binds.len();
    let elements = std::mem::take(binds);
    for (i, (slot, value)) in elements.into_iter().enumerate() {
        if matches!(value, Code::Phase) {
            called = false;
        } else if called && invokes_block(&value) {
            inserted.push(i);
            new_binds.push((phase_slot, Code::Phase));
            called = false;
        }
        called |= calls_into(&value, &does_tensor_work, &globals);
        new_binds.push((slot, value));
    }
    if called && invokes_block(body) {
        inserted.push(n);
        new_binds.push((phase_slot, Code::Phase));
    }
    *binds = new_binds;
    if !inserted.is_empty() {
        lambda.n_slots += 1;
    }
    inserted
}

/// Per lambda: does running it (transitively, through any call it makes) invoke a block?
fn tensor_functions(program: &Program) -> Vec<bool> {
    let n = program.lambdas.len();
    let mut direct = vec![false; n];
    let mut callees: Vec<Vec<u32>> = vec![Vec::new(); n];
    for (i, l) in program.lambdas.iter().enumerate() {
        visit(&l.body, &mut |c| match c {
            Code::InvokeBlock { .. } => direct[i] = true,
            Code::CallGlobal { global, .. } | Code::Global(global) => {
                if let Some(&t) = program.globals.get(*global as usize) {
                    callees[i].push(t);
                }
            }
            Code::MakeClosure(t) => callees[i].push(*t),
            _ => {}
        });
    }
    // Propagate to a fixpoint (a function that may call or create a block-invoking one does work).
    let mut changed = true;
    while changed {
        changed = false;
        for i in 0..n {
            if !direct[i]
                && callees[i]
                    .iter()
                    .any(|&c| direct.get(c as usize) == Some(&true))
            {
                direct[i] = true;
                changed = true;
            }
        }
    }
    direct
}

fn invokes_block(code: &Code) -> bool {
    let mut found = false;
    visit(code, &mut |c| {
        found |= matches!(c, Code::InvokeBlock { .. })
    });
    found
}

/// Does `code` call a function, or a closure made from a lambda, that invokes blocks?
fn calls_into(code: &Code, tensor_fns: &[bool], globals: &[u32]) -> bool {
    let mut found = false;
    let works = |l: u32| tensor_fns.get(l as usize) == Some(&true);
    visit(code, &mut |c| match c {
        Code::CallGlobal { global, .. } | Code::Global(global) => {
            found |= globals.get(*global as usize).is_some_and(|&l| works(l));
        }
        Code::MakeClosure(l) => found |= works(*l),
        _ => {}
    });
    found
}

/// Calls `f` on `code` and everything inside it (not into other functions' bodies).
pub fn visit(code: &Code, f: &mut impl FnMut(&Code)) {
    let mut stack = vec![code];
    while let Some(c) = stack.pop() {
        f(c);
        match c {
            Code::Slot(_)
            | Code::SelfRef
            | Code::Global(_)
            | Code::Ctor(_)
            | Code::Lit(_)
            | Code::MakeClosure(_)
            | Code::Phase => {}
            Code::Ghost(_, b) | Code::Proj(b, _, _) => stack.push(b),
            Code::Tuple(es)
            | Code::Concurrent(es)
            | Code::CallOp { args: es, .. }
            | Code::CallCtor { args: es, .. }
            | Code::CallGlobal { args: es, .. }
            | Code::InvokeBlock { args: es, .. }
            | Code::Call { operands: es, .. } => stack.extend(es.iter()),
            Code::Let { binds, body } => {
                stack.push(body);
                stack.extend(binds.iter().map(|(_, v)| v));
            }
            Code::If(a, b, c) => {
                stack.push(a);
                stack.push(b);
                stack.push(c);
            }
            Code::Match {
                scrutinee, arms, ..
            } => {
                stack.push(scrutinee);
                stack.extend(arms.iter().map(|(_, b)| b));
            }
        }
    }
}
