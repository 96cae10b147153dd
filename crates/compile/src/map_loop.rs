//! Functions with the shape of the prelude's `@map`, found once per program so that the evaluator
//! runs them as a loop ([`crate::program::Natives::map_loops`]).
//!
//! `@map` and its copies specialized on a closure recurse once per list element:
//!
//! ```text
//! def @g(.., %xs, ..) {
//!   match (%xs) {
//!     Cons(%x, %rest) => { let %r = db.concurrent((E, @g(.., %rest, ..))); Cons(%r.0, %r.1) },
//!     Nil => Nil,                      // possibly under ghost operators
//!   }
//! }
//! ```
//!
//! Interpreted, each element costs a call, a frame, a match, a concurrent join and a cell. Its
//! meaning is simple: `E` with `%x` bound to each element in turn, every one from the inline
//! depth the call started at, then the list of the values at the deepest depth any reached (the
//! final `Nil`'s ghosts included). The evaluator does exactly that when the function qualifies:
//! `E` reads no slot of the arm but `%x` (not `%rest`, not `%r`), the recursive call passes the
//! function's own parameters unchanged but for `%rest` in the list's place, and the `Nil` arm is
//! the empty list (under ghosts or not).

use crate::program::{Code, Pat, Program};

/// What a qualifying function's body says, with references into it.
#[derive(Clone, Copy)]
pub struct MapLoopParts<'p> {
    /// The parameter holding the list.
    pub list: u32,
    /// The slot `%x` the element is bound to while `elem` runs.
    pub elem_slot: u32,
    /// The element's code `E`.
    pub elem: &'p Code,
    /// Ghost operators around the final `Nil` (0 when none).
    pub nil_ghosts: u32,
}

/// The parts of global `global`'s body, if it has `@map`'s shape (see the module's comment).
pub fn map_loop_parts(program: &Program, global: u32) -> Option<MapLoopParts<'_>> {
    let natives = &program.natives;
    let lambda = program
        .lambdas
        .get(*program.globals.get(global as usize)? as usize)?;
    if !lambda.captures.is_empty() {
        return None;
    }
    let Code::Match {
        scrutinee, arms, ..
    } = &lambda.body
    else {
        return None;
    };
    let Code::Slot(list) = **scrutinee else {
        return None;
    };
    if list >= lambda.n_params {
        return None;
    }
    let [(cons_pat, cons_arm), (nil_pat, nil_arm)] = arms.as_slice() else {
        return None;
    };
    let Pat::Ctor(c, fields) = cons_pat else {
        return None;
    };
    let [Pat::Bind(x), Pat::Bind(rest)] = fields.as_slice() else {
        return None;
    };
    if *c != natives.cons
        || !matches!(nil_pat, Pat::Ctor(n, fs) if *n == natives.nil && fs.is_empty())
    {
        return None;
    }
    let (mut nil_ghosts, mut nil_value) = (0u32, nil_arm);
    while let Code::Ghost(n, body) = nil_value {
        nil_ghosts = nil_ghosts.checked_add(*n)?;
        nil_value = body;
    }
    let is_nil = match nil_value {
        Code::Ctor(n) => *n == natives.nil,
        Code::CallCtor { ctor, args } => *ctor == natives.nil && args.is_empty(),
        _ => false,
    };
    if !is_nil {
        return None;
    }
    let Code::Let { binds, body } = cons_arm else {
        return None;
    };
    let [(r, Code::Concurrent(elems))] = binds.as_slice() else {
        return None;
    };
    let [elem, Code::CallGlobal {
        global: again,
        args,
        ..
    }] = elems.as_slice()
    else {
        return None;
    };
    let passes_along = *again == global
        && args.len() == lambda.n_params as usize
        && args.iter().enumerate().all(|(i, a)| match a {
            Code::Slot(s) if i as u32 == list => s == rest,
            Code::Slot(s) => *s == i as u32,
            _ => false,
        });
    let cell = matches!(&**body, Code::CallCtor { ctor, args } if *ctor == natives.cons
        && matches!(args.as_slice(), [Code::Proj(a, 0, _), Code::Proj(b, 1, _)]
            if matches!(**a, Code::Slot(s) if s == *r) && matches!(**b, Code::Slot(s) if s == *r)));
    let mut reads_arm_slots = false;
    elem.visit(&mut |c| {
        if matches!(c, Code::Slot(s) if s == rest || s == r) {
            reads_arm_slots = true;
        }
    });
    (passes_along && cell && !reads_arm_slots).then_some(MapLoopParts {
        list,
        elem_slot: *x,
        elem,
        nil_ghosts,
    })
}

/// Per global: whether the evaluator runs it as a loop.
pub fn find(program: &Program) -> Vec<bool> {
    (0..program.globals.len() as u32)
        .map(|g| map_loop_parts(program, g).is_some())
        .collect()
}
