//! Functions that recurse once per list element with the shape of the prelude's `@map` or
//! `@foldl`, found once per program so that the evaluator runs them as loops
//! ([`crate::program::Natives::map_loops`], [`crate::program::Natives::fold_loops`]).
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
//!
//! The check runs once per program ([`find`]); the evaluator keeps what it found
//! ([`MapLoop`](crate::program::MapLoop)) and reaches the element code at its fixed place ([`elem_of`]).
//!
//! `@foldl` and its specialized copies (a child sum's `@foldl(%add, @hd(%xs), @tl(%xs))`):
//!
//! ```text
//! def @g(.., %acc, .., %xs, ..) {
//!   match (%xs) {
//!     Cons(%x, %rest) => @g(.., S, .., %rest, ..),   // S in %acc's place, the rest unchanged
//!     Nil => %acc,                                     // possibly under ghost operators
//!   }
//! }
//! ```
//!
//! Interpreted, each element costs a call, a match and a tail call. Its meaning: `S` with `%x`
//! bound to each element in turn and `%acc` to the value so far, one after the other (the inline
//! depth carried from each to the next, as the recursion carries it), then the final `Nil`'s
//! ghosts and the last value. The evaluator does that when `S` reads no slot of the arm but `%x`
//! (the recursive call evaluates `S` before `%rest`, and the frame it reads is the call's, so the
//! same values and effects in the same order) ([`find_folds`], [`fold_step_of`]).
//!
//! A scan — an RNN over a list that returns the list of its states, as a recursion:
//!
//! ```text
//! def @g(.., %h, .., %xs, ..) {
//!   match (%xs) {
//!     Cons(%x, %rest) => {
//!       let %s1 = S1; .. let %sn = Sn;
//!       Cons(Y, @g(.., A, .., %rest, ..))   // A in %h's place, the rest unchanged
//!     },
//!     Nil => Nil,                            // possibly under ghost operators
//!   }
//! }
//! ```
//!
//! with `Y` and `A` each one of the `%si` or a field of it (`%s.0`: an LSTM's output `h` of its
//! state `(h, c)`). Interpreted, each element costs a call, a frame, a match, the `let`s, the
//! operands' continuation, the return and a cell. Its meaning: the bindings with `%x` bound to
//! each element in turn and `%h` to the state so far, one element after the other (the inline
//! depth carried from each to the next), the list of the `Y`s, and the final `Nil`'s ghosts.
//! The evaluator does that when each `Si` reads no slot of the arm but `%x` and the bindings
//! before it (not the list, the tail, nor its own or later bindings): the recursion evaluates
//! the bindings, then `Y` and `A` (reads of a slot, without effects), then enters the next call,
//! so the same values and effects in the same order ([`find_scans`], [`scan_binds_of`]).

use crate::program::{Code, FoldLoop, MapLoop, Pat, Program, ScanLoop};

/// The element code `E` of a body of `@map`'s shape: the first element of the `db.concurrent`
/// bound by the `Cons` arm's `let` (the place [`find`] checked).
pub fn elem_of(body: &Code) -> Option<&Code> {
    let Code::Match { arms, .. } = body else {
        return None;
    };
    let (_, Code::Let { binds, .. }) = arms.first()? else {
        return None;
    };
    let (_, Code::Concurrent(elems)) = binds.first()? else {
        return None;
    };
    elems.first()
}

/// A global's body as a recursion over a list: `match` on list parameter `list`, a `Cons(%x,
/// %rest)` arm and a `Nil` arm (its value under `nil_ghosts` ghost operators), the function
/// capturing nothing — what `@map`'s and `@foldl`'s shapes share.
struct ListRecursion<'p> {
    lambda: &'p crate::program::Lambda,
    list: u32,
    x: u32,
    rest: u32,
    cons_arm: &'p Code,
    nil_value: &'p Code,
    nil_ghosts: u32,
}

fn list_recursion(program: &Program, global: u32) -> Option<ListRecursion<'_>> {
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
    Some(ListRecursion {
        lambda,
        list,
        x: *x,
        rest: *rest,
        cons_arm,
        nil_value,
        nil_ghosts,
    })
}

/// A list recursion whose `Nil` arm is the empty list and whose `Cons` arm is a `let` chain —
/// what `@map`'s and a scan's shapes share: the recursion, the chain's bindings and its body.
fn let_recursion_to_empty(program: &Program, global: u32) -> Option<LetRecursion<'_>> {
    let nil = program.natives.nil;
    let r = list_recursion(program, global)?;
    let ends_in_empty = match r.nil_value {
        Code::Ctor(n) => *n == nil,
        Code::CallCtor { ctor, args } => *ctor == nil && args.is_empty(),
        _ => false,
    };
    let Code::Let { binds, body, .. } = r.cons_arm else {
        return None;
    };
    ends_in_empty.then_some(LetRecursion { binds, body, r })
}

/// [`let_recursion_to_empty`]'s finding.
struct LetRecursion<'p> {
    r: ListRecursion<'p>,
    binds: &'p [(u32, Code)],
    body: &'p Code,
}

/// How global `global` runs as a loop, if its body has `@map`'s shape (see the module's comment).
fn map_loop_of(program: &Program, global: u32) -> Option<MapLoop> {
    let natives = &program.natives;
    let LetRecursion { r, binds, body } = let_recursion_to_empty(program, global)?;
    let (lambda, list, x, rest, nil_ghosts) = (r.lambda, r.list, r.x, r.rest, r.nil_ghosts);
    let [(r, Code::Concurrent(elems))] = binds else {
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
            Code::Slot(s) if i as u32 == list => *s == rest,
            Code::Slot(s) => *s == i as u32,
            _ => false,
        });
    let cell = matches!(body, Code::CallCtor { ctor, args } if *ctor == natives.cons
        && matches!(args.as_slice(), [Code::Proj(a, 0, _), Code::Proj(b, 1, _)]
            if matches!(**a, Code::Slot(s) if s == *r) && matches!(**b, Code::Slot(s) if s == *r)));
    let mut reads_arm_slots = false;
    elem.visit(&mut |c| {
        if matches!(c, Code::Slot(s) if *s == rest || s == r) {
            reads_arm_slots = true;
        }
    });
    let at_its_place = elem_of(&lambda.body).is_some_and(|e| std::ptr::eq(e, elem));
    (passes_along && cell && !reads_arm_slots && at_its_place).then_some(MapLoop {
        list,
        elem_slot: x,
        nil_ghosts,
    })
}

/// Per global: how the evaluator runs it as a loop, if it does.
pub fn find(program: &Program) -> Vec<Option<MapLoop>> {
    (0..program.globals.len() as u32)
        .map(|g| map_loop_of(program, g))
        .collect()
}

/// The step code `S` of a body of `@foldl`'s shape: the recursive call's argument in the
/// accumulator's place (the place [`find_folds`] checked).
pub fn fold_step_of(body: &Code, fl: FoldLoop) -> Option<&Code> {
    let Code::Match { arms, .. } = body else {
        return None;
    };
    let (_, Code::CallGlobal { args, .. }) = arms.first()? else {
        return None;
    };
    args.get(fl.acc as usize)
}

/// How global `global` runs as a left fold, if its body has `@foldl`'s shape (see the module's
/// comment).
fn fold_loop_of(program: &Program, global: u32) -> Option<FoldLoop> {
    let r = list_recursion(program, global)?;
    let (lambda, list, x, rest) = (r.lambda, r.list, r.x, r.rest);
    let (cons_arm, nil_value, nil_ghosts) = (r.cons_arm, r.nil_value, r.nil_ghosts);
    let Code::Slot(acc) = *nil_value else {
        return None;
    };
    if acc >= lambda.n_params || acc == list {
        return None;
    }
    let Code::CallGlobal {
        global: again,
        args,
        ..
    } = cons_arm
    else {
        return None;
    };
    let passes_along = *again == global
        && args.len() == lambda.n_params as usize
        && args.iter().enumerate().all(|(i, a)| match a {
            _ if i as u32 == acc => true,
            Code::Slot(s) if i as u32 == list => *s == rest,
            Code::Slot(s) => *s == i as u32,
            _ => false,
        });
    let step = args.get(acc as usize)?;
    let mut reads_rest = false;
    step.visit(&mut |c| {
        // The list parameter holds the current tail in the recursion, the original list in the
        // loop: a step reading it (or the tail) runs interpreted.
        if matches!(c, Code::Slot(s) if *s == rest || *s == list) {
            reads_rest = true;
        }
    });
    let fl = FoldLoop {
        list,
        acc,
        elem_slot: x,
        nil_ghosts,
    };
    let at_its_place = fold_step_of(&lambda.body, fl).is_some_and(|s| std::ptr::eq(s, step));
    (passes_along && !reads_rest && at_its_place).then_some(fl)
}

/// Per global: how the evaluator runs it as a left fold, if it does.
pub fn find_folds(program: &Program) -> Vec<Option<FoldLoop>> {
    (0..program.globals.len() as u32)
        .map(|g| fold_loop_of(program, g))
        .collect()
}

/// The `let` bindings of the step of a body of a scan's shape (the place [`find_scans`]
/// checked).
pub fn scan_binds_of(body: &Code) -> Option<&[(u32, Code)]> {
    let Code::Match { arms, .. } = body else {
        return None;
    };
    let (_, Code::Let { binds, .. }) = arms.first()? else {
        return None;
    };
    Some(binds)
}

/// `Slot(s)` (`(s, None)`) or `Slot(s).i` (`(s, Some((i, span)))`) for a slot `s` bound by
/// `binds`; `None` for anything else.
fn bound_part(code: &Code, binds: &[(u32, Code)]) -> Option<(u32, Option<(u32, tumble_ir::Span)>)> {
    let bound = |s: u32| binds.iter().any(|(b, _)| *b == s);
    match code {
        Code::Slot(s) if bound(*s) => Some((*s, None)),
        Code::Proj(inner, i, span) => match **inner {
            Code::Slot(s) if bound(s) => Some((s, Some((*i, *span)))),
            _ => None,
        },
        _ => None,
    }
}

/// How global `global` runs as a scan, if its body has a scan's shape (see the module's
/// comment).
fn scan_loop_of(program: &Program, global: u32) -> Option<ScanLoop> {
    let natives = &program.natives;
    let LetRecursion { r, binds, body } = let_recursion_to_empty(program, global)?;
    let (lambda, list, x, rest, nil_ghosts) = (r.lambda, r.list, r.x, r.rest, r.nil_ghosts);
    let Code::CallCtor { ctor, args: cell } = body else {
        return None;
    };
    let [y, Code::CallGlobal {
        global: again,
        args,
        ..
    }] = cell.as_slice()
    else {
        return None;
    };
    if *ctor != natives.cons || *again != global || args.len() != lambda.n_params as usize {
        return None;
    }
    let head = bound_part(y, binds)?;
    // The state: the one argument that is not passed along (a binding or a field of one).
    let mut acc = None;
    for (i, a) in args.iter().enumerate() {
        let i = i as u32;
        match (a, bound_part(a, binds)) {
            (_, Some(next)) if i != list && acc.is_none() => acc = Some((i, next)),
            (Code::Slot(v), None) if i == list && *v == rest => {}
            (Code::Slot(v), None) if i != list && *v == i => {}
            _ => return None,
        }
    }
    let (acc, next) = acc?;
    // Each binding reads the element, parameters and the bindings before it only: the list
    // parameter holds the current tail in the recursion but the original list in the loop.
    for (k, (_, step)) in binds.iter().enumerate() {
        let mut reads_arm = false;
        step.visit(&mut |c| {
            if let Code::Slot(v) = c {
                let later = binds
                    .get(k..)
                    .is_some_and(|bs| bs.iter().any(|(b, _)| b == v));
                if *v == rest || *v == list || later {
                    reads_arm = true;
                }
            }
        });
        if reads_arm {
            return None;
        }
    }
    let at_its_place = scan_binds_of(&lambda.body).is_some_and(|b| std::ptr::eq(b, binds));
    at_its_place.then_some(ScanLoop {
        list,
        acc,
        elem_slot: x,
        head,
        next,
        nil_ghosts,
    })
}

/// Per global: how the evaluator runs it as a scan, if it does (the shapes of `@map`, `@foldl`
/// and a scan exclude each other).
pub fn find_scans(program: &Program) -> Vec<Option<ScanLoop>> {
    (0..program.globals.len() as u32)
        .map(|g| scan_loop_of(program, g))
        .collect()
}
