//! Inlining of small leaf functions, and of forwarders (a body that only calls another function
//! on its parameters), into the host program. A call costs the interpreter a frame:
//! installing the arguments, a return continuation, dropping the frame. The prelude's `@hd` and
//! `@tl` and the wrappers a `Primitive=1` function leaves behind (a body that only invokes its
//! block) are called several times per tree node, so their bodies are copied into the callers.
//!
//! A callee qualifies when its body calls nothing and makes no closures (so it is no recursion,
//! and no closure captures its frame's slots) and is small. Arguments that are plain reads
//! (slots, entry arguments, literals, fields of those) replace the parameter where it is read;
//! any other argument is bound by a `let` to a new slot of the caller first, in order, so every
//! effect happens as before. Each block invocation copied gets a site of its own, so the
//! analyses after this one (hoisting) judge every copy in its place.

use tumble_ir::Span;

use crate::program::{Code, Lambda, Pat, Program};

/// Code nodes a callee's body may have to be copied.
const MAX_BODY: usize = 24;

/// Rounds of inlining: a function whose only calls were of leaves is a leaf after one round.
const ROUNDS: usize = 3;

/// Inlines calls of small leaf functions, in rounds; returns how many calls were inlined.
pub fn inline_leaves(program: &mut Program, entry: &str) -> usize {
    let mut total = 0;
    for _ in 0..ROUNDS {
        let n = inline_round(program, entry);
        total += n;
        if n == 0 {
            break;
        }
    }
    total
}

fn inline_round(program: &mut Program, entry: &str) -> usize {
    let entry_lambda = program
        .global_index
        .get(entry)
        .and_then(|&g| program.globals.get(g as usize))
        .copied();
    // Per global: a copy of the callee when it qualifies.
    let leaves: Vec<Option<Lambda>> = program
        .globals
        .iter()
        .enumerate()
        .map(|(g, &l)| {
            let lambda = program.lambdas.get(l as usize)?;
            let qualifies = is_leaf(program, lambda) || is_forwarder(lambda, g as u32);
            (Some(l) != entry_lambda && qualifies).then(|| lambda.clone())
        })
        .collect();
    if leaves.iter().all(Option::is_none) {
        return 0;
    }
    let mut inlined = 0;
    let mut sites = std::mem::take(&mut program.sites);
    for lambda in &mut program.lambdas {
        let mut n_slots = lambda.n_slots;
        lambda.body.visit_mut(&mut |c| {
            let Code::CallGlobal { global, args, span } = c else {
                return;
            };
            let Some(Some(callee)) = leaves.get(*global as usize) else {
                return;
            };
            if args.len() != callee.n_params as usize {
                return;
            }
            let args = std::mem::take(args);
            *c = expand(callee, args, *span, &mut n_slots, &mut sites);
            inlined += 1;
        });
        lambda.n_slots = n_slots;
    }
    program.sites = sites;
    inlined
}

/// No calls, no closures, small, and nothing in it fails on its own except a block invocation
/// (whose error then names the inlined call through its site): a failing `match?` or operator
/// would lose the callee's frame from the error's call trace.
fn is_leaf(program: &Program, lambda: &Lambda) -> bool {
    if !lambda.captures.is_empty() {
        return false;
    }
    let mut size = 0;
    let mut leaf = true;
    lambda.body.visit(&mut |c| {
        size += 1;
        leaf &= match c {
            Code::CallGlobal { .. }
            | Code::Call { .. }
            | Code::CallOp { .. }
            | Code::MakeClosure(_)
            | Code::SelfRef
            | Code::Global(_)
            | Code::Phase => false,
            Code::Match { arms, .. } => total(program, arms),
            _ => true,
        };
    });
    leaf && size <= MAX_BODY
}

/// A body that only calls another global on reads of the parameters — `specialize`'s lifted
/// closure around a recursive call, `fn (%c) { @treelstm(%c, ..) }`, through which a tree's
/// `@map` reached every child: a call, a frame and a tail call per child where the caller can
/// call the target itself. The call is in tail position, so it leaves no frame in an error's call
/// trace with or without the forwarder; a call of itself is not a forwarder.
fn is_forwarder(lambda: &Lambda, this: u32) -> bool {
    lambda.captures.is_empty()
        && matches!(&lambda.body, Code::CallGlobal { global, args, .. }
            if *global != this && args.iter().all(is_read))
}

/// Whether some arm matches every value: a variable or `_`, or one arm per constructor of the
/// type whose fields are all variables or `_`.
fn total(program: &Program, arms: &[(Pat, Code)]) -> bool {
    let any = |p: &Pat| matches!(p, Pat::Wild | Pat::Bind(_));
    if arms.iter().any(|(p, _)| any(p)) {
        return true;
    }
    let mut covered = std::collections::BTreeSet::new();
    let mut adt = None;
    for (p, _) in arms {
        if let Pat::Ctor(c, fields) = p {
            if fields.iter().all(any) {
                covered.insert(*c);
                adt = program.ctors.get(*c as usize).map(|e| e.adt.as_str());
            }
        }
    }
    let Some(adt) = adt else {
        return false;
    };
    let all = program.ctors.iter().filter(|e| e.adt == adt).count();
    covered.len() == all
}

/// Whether `code` only reads (no effects, no steps of its own): it may be evaluated later, more
/// than once or not at all.
fn is_read(code: &Code) -> bool {
    match code {
        Code::Slot(_) | Code::Param(_) | Code::Lit(_) => true,
        Code::Proj(inner, _, _) => is_read(inner),
        _ => false,
    }
}

/// The callee's body for these arguments, with its slots renumbered into the caller's frame.
fn expand(
    callee: &Lambda,
    args: Vec<Code>,
    call: Span,
    n_slots: &mut u32,
    sites: &mut Vec<crate::program::Site>,
) -> Code {
    let base = *n_slots;
    // The callee's own (non-parameter) slots go after the caller's.
    let own = callee.n_slots.saturating_sub(callee.n_params);
    *n_slots += own;
    let mut binds = Vec::new();
    let mut by_param: Vec<Code> = Vec::with_capacity(args.len());
    for arg in args {
        if is_read(&arg) {
            by_param.push(arg);
        } else {
            let s = *n_slots;
            *n_slots += 1;
            binds.push((s, arg));
            by_param.push(Code::Slot(s));
        }
    }
    let mut body = callee.body.clone();
    let mut map = Renumber {
        n_params: callee.n_params,
        base,
        by_param: &by_param,
        sites,
        call,
    };
    map.code(&mut body);
    if binds.is_empty() {
        body
    } else {
        Code::Let {
            binds,
            body: Box::new(body),
            drops: Vec::new(),
        }
    }
}

struct Renumber<'a> {
    n_params: u32,
    base: u32,
    by_param: &'a [Code],
    sites: &'a mut Vec<crate::program::Site>,
    call: Span,
}

impl Renumber<'_> {
    fn slot(&self, s: u32) -> u32 {
        self.base + s - self.n_params
    }

    /// Recursive, and does not descend into a substituted argument (its slots are the caller's);
    /// the body is at most [`MAX_BODY`] nodes.
    fn code(&mut self, c: &mut Code) {
        match c {
            Code::Slot(s) if *s < self.n_params => {
                if let Some(a) = self.by_param.get(*s as usize) {
                    *c = a.clone();
                }
                return;
            }
            Code::Slot(s) => *s = self.slot(*s),
            Code::Let { binds, .. } => {
                for (s, _) in binds.iter_mut() {
                    *s = self.slot(*s);
                }
            }
            Code::Match { arms, .. } => {
                for (pat, _) in arms.iter_mut() {
                    pat.for_each_slot_mut(&mut |s| *s = self.slot(*s));
                }
            }
            Code::InvokeBlock { site, .. } => {
                if let Some(mut s) = self.sites.get(*site as usize).cloned() {
                    s.inlined_from = Some(self.call);
                    *site = self.sites.len() as u32;
                    self.sites.push(s);
                }
            }
            _ => {}
        }
        c.for_each_child_mut(|k| self.code(k));
    }
}
