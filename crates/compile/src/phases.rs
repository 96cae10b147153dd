//! Automatic program phases (ACROBAT §4.1 and appendix A.3). The stages of the entry function — typically the
//! recursion over the instance, then an output layer on its result — are separated by a phase
//! boundary, so the output layer of every instance waits until all instances are through the
//! recursion and then runs as one launch, instead of trickling out at each instance's own depth.
//!
//! Heuristic: in the entry function's top-level `let` chain, a boundary goes before the first
//! element that invokes a block directly, or calls a function that does (a second recursion: a
//! refinement loop after an encoder, whose steps otherwise start at each instance's own depth and
//! launch two or three at a time), when an earlier element of the current phase called a
//! function that (transitively) invokes blocks. An explicit `db.phase_change()` starts a new phase
//! and suppresses the automatic boundary there. Every instance runs the top-level chain exactly
//! once, so every instance reaches every boundary.

use crate::program::{code_reaches, Code, Program};

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
    let does_tensor_work =
        crate::program::lambdas_reaching(program, |c| matches!(c, Code::InvokeBlock { .. }));
    let globals = program.globals.clone();
    let Some(lambda) = program.lambdas.get_mut(l as usize) else {
        return Vec::new();
    };
    let Code::Let { binds, body, .. } = &mut lambda.body else {
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
        } else if called && starts_tensor_work(&value, &does_tensor_work, &globals) {
            inserted.push(i);
            new_binds.push((phase_slot, Code::Phase));
            called = false;
        }
        called |= code_reaches(&value, &does_tensor_work, &globals);
        new_binds.push((slot, value));
    }
    if called && starts_tensor_work(body, &does_tensor_work, &globals) {
        inserted.push(n);
        new_binds.push((phase_slot, Code::Phase));
    }
    *binds = new_binds;
    if !inserted.is_empty() {
        lambda.n_slots += 1;
    }
    inserted
}

/// Does evaluating `code` do tensor work: invoke a block, or call a function that does (a
/// second recursion after the first: a refinement loop, a decoder after an encoder)? Making a
/// closure is not running it.
fn starts_tensor_work(code: &Code, tensor_fns: &[bool], globals: &[u32]) -> bool {
    invokes_block(code)
        || (!matches!(code, Code::MakeClosure(_)) && code_reaches(code, tensor_fns, globals))
}

fn invokes_block(code: &Code) -> bool {
    let mut found = false;
    code.visit(&mut |c| found |= matches!(c, Code::InvokeBlock { .. }));
    found
}
