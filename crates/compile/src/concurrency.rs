//! Independent calls found and run side by side (what `db.concurrent` states by hand).
//!
//! The inline depth scheduler gives a block invocation the depth at which its instance reaches
//! it in program order. A recursion written plainly — `let %hl = @enc(%l); let %hr = @enc(%r);`
//! — then puts the right subtree's work after all of the left subtree's: a node's depth is its
//! post-order position, siblings of one tree and nodes of equal height in different trees land
//! at different depths, and launches stay narrow (a binary-tree encoder over 100 random trees:
//! 154 launches of mean batch 8.5, against 31 of 42 with the calls in `db.concurrent`). Where
//! consecutive `let` bindings each call a function that does tensor work and none reads another's
//! result, they are rewritten as one `db.concurrent` of the calls and a projection per binding:
//! each call then starts at the same depth and the join continues from the deepest. Calls that
//! are operands of one expression (`tanh(nn.dense(@enc(%l), %W) + nn.dense(@enc(%r), %U))`) are
//! independent by construction and are taken the same way, into a `let` before the expression.
//!
//! Evaluation order and values are unchanged: the machine still evaluates the elements one after
//! the other, in the bindings' order (so random draws and run-time errors come in the same order);
//! only the depths the recorded invocations get differ. A binding's slot is set when the bindings
//! after it are evaluated, and is set only at the join after the rewrite, so a binding that reads
//! an earlier one's slot (or captures it in a closure) ends the run.

use tumble_ir::Span;

use crate::program::{code_reaches, Code, Program};

/// Independent calls made concurrent in one function.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Concurrent {
    /// The function (lambda) whose `let` chain was rewritten.
    pub function: String,
    /// How many calls each rewritten run holds, in the order found.
    pub calls: Vec<usize>,
}

/// Rewrites every run of two or more consecutive, mutually independent `let` bindings whose
/// values call tensor-working functions into one concurrent evaluation; returns what it did.
pub fn find(program: &mut Program) -> Vec<Concurrent> {
    let does_tensor_work =
        crate::program::lambdas_reaching(program, |c| matches!(c, Code::InvokeBlock { .. }));
    let globals = program.globals.clone();
    let captures = program.slot_captures();
    let facts = Facts {
        tensor_fns: &does_tensor_work,
        globals: &globals,
        captures: &captures,
    };
    let mut out = Vec::new();
    for lambda in &mut program.lambdas {
        let mut next_slot = lambda.n_slots;
        let mut calls = Vec::new();
        rewrite_all(&mut lambda.body, &facts, &mut next_slot, &mut calls);
        if !calls.is_empty() {
            lambda.n_slots = next_slot;
            out.push(Concurrent {
                function: lambda.name.clone(),
                calls,
            });
        }
    }
    out
}

struct Facts<'a> {
    tensor_fns: &'a [bool],
    globals: &'a [u32],
    captures: &'a [Vec<u32>],
}

impl Facts<'_> {
    /// Is `code` a call of a function that does tensor work (directly, through a global used as
    /// a value, or through a closure it makes and passes on)? A bare closure is not a call.
    /// Whether the call waits on a computed tensor (data-dependent control flow) is left to the
    /// run: an element that waited is followed as written there (the evaluator's
    /// `Kont::Concurrent`), while a loop whose `if` tests host scalars (a counter against a
    /// length) runs beside its sibling.
    fn is_candidate(&self, code: &Code) -> bool {
        !matches!(code, Code::MakeClosure(_)) && code_reaches(code, self.tensor_fns, self.globals)
    }

    /// Does `code` read frame slot `s` (directly, or by capturing it in a closure it makes)?
    fn reads_slot(&self, code: &Code, s: u32) -> bool {
        let mut found = false;
        code.visit(&mut |c| match c {
            Code::Slot(k) => found |= *k == s,
            Code::MakeClosure(l) => {
                found |= self
                    .captures
                    .get(*l as usize)
                    .is_some_and(|cs| cs.contains(&s));
            }
            _ => {}
        });
        found
    }
}

/// Rewrites the `let` chains and operand lists in `code` and everything inside it. Outermost
/// first, iteratively (no recursion on the Rust stack however deep the code nests): a rewrite
/// keeps every call it moves inside the rewritten code, where the walk then reaches it, and
/// leaves no run to rewrite again.
fn rewrite_all(code: &mut Code, facts: &Facts, next_slot: &mut u32, calls: &mut Vec<usize>) {
    code.visit_mut(&mut |c| match c {
        Code::Let { binds, .. } => rewrite_let(binds, facts, next_slot, calls),
        _ => rewrite_operands(c, facts, next_slot, calls),
    });
}

/// The operands of a call, a constructor or a tuple: independent of each other by construction,
/// evaluated left to right. Two or more calls among them are evaluated first, side by side —
/// `f(@g(a), @g(b))` becomes `let %t = concurrent(@g(a), @g(b)); f(%t.0, %t.1)` — when every
/// operand before the last of them is one of them or has no effect (a variable, a literal, a
/// field of a variable), so the order of evaluation is unchanged.
fn rewrite_operands(code: &mut Code, facts: &Facts, next_slot: &mut u32, calls: &mut Vec<usize>) {
    let operands = match code {
        Code::CallOp { args, .. }
        | Code::CallCtor { args, .. }
        | Code::CallGlobal { args, .. }
        | Code::InvokeBlock { args, .. } => args,
        Code::Call { operands, .. } => operands,
        Code::Tuple(elems) => elems,
        _ => return,
    };
    let is_call: Vec<bool> = operands.iter().map(|o| facts.is_candidate(o)).collect();
    let Some(last) = is_call.iter().rposition(|&c| c) else {
        return;
    };
    let in_order = operands
        .iter()
        .zip(&is_call)
        .take(last)
        .all(|(o, &call)| call || no_effect(o));
    if is_call.iter().filter(|&&c| c).count() < 2 || !in_order {
        return;
    }
    let t = *next_slot;
    *next_slot += 1;
    let mut moved = Vec::new();
    for (o, call) in operands.iter_mut().zip(is_call) {
        if call {
            let span = span_of(o);
            let at = moved.len() as u32;
            moved.push(std::mem::replace(
                o,
                Code::Proj(Box::new(Code::Slot(t)), at, span),
            ));
        }
    }
    calls.push(moved.len());
    let body = std::mem::replace(code, Code::Tuple(Vec::new()));
    *code = Code::Let {
        binds: vec![(t, Code::Concurrent(moved))],
        body: Box::new(body),
        drops: Vec::new(),
    };
}

/// Code whose evaluation has no effect and cannot fail: taking it later changes nothing.
fn no_effect(code: &Code) -> bool {
    match code {
        Code::Slot(_) | Code::Param(_) | Code::Lit(_) | Code::Global(_) | Code::SelfRef => true,
        Code::Proj(inner, ..) => matches!(**inner, Code::Slot(_) | Code::Param(_)),
        _ => false,
    }
}

/// One `let` chain: each maximal run of independent calls becomes
/// `let %t = concurrent(calls..); let %x_i = %t.i; ..`.
fn rewrite_let(
    binds: &mut Vec<(u32, Code)>,
    facts: &Facts,
    next_slot: &mut u32,
    calls: &mut Vec<usize>,
) {
    let is_call: Vec<bool> = binds.iter().map(|(_, v)| facts.is_candidate(v)).collect();
    if is_call.iter().filter(|&&c| c).count() < 2 {
        return;
    }
    let old = std::mem::take(binds);
    let mut run: Vec<(u32, Code)> = Vec::new();
    let flush = |run: &mut Vec<(u32, Code)>,
                 binds: &mut Vec<(u32, Code)>,
                 next_slot: &mut u32,
                 calls: &mut Vec<usize>| {
        if run.len() < 2 {
            binds.append(run);
            return;
        }
        let t = *next_slot;
        *next_slot += 1;
        calls.push(run.len());
        let (slots, values): (Vec<u32>, Vec<Code>) = std::mem::take(run).into_iter().unzip();
        let spans: Vec<Span> = values.iter().map(span_of).collect();
        binds.push((t, Code::Concurrent(values)));
        for (i, (slot, span)) in slots.into_iter().zip(spans).enumerate() {
            binds.push((slot, Code::Proj(Box::new(Code::Slot(t)), i as u32, span)));
        }
    };
    for ((slot, value), call) in old.into_iter().zip(is_call) {
        let independent = call && !run.iter().any(|(s, _)| facts.reads_slot(&value, *s));
        if independent {
            run.push((slot, value));
        } else {
            flush(&mut run, binds, next_slot, calls);
            if call {
                run.push((slot, value));
            } else {
                binds.push((slot, value));
            }
        }
    }
    flush(&mut run, binds, next_slot, calls);
}

/// The call's span, for the projection (which cannot fail: the concurrent value is a tuple).
fn span_of(code: &Code) -> Span {
    match code {
        Code::CallGlobal { span, .. } | Code::Call { span, .. } => *span,
        _ => Span::default(),
    }
}
