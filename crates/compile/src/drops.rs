//! Slots cleared after their last read: a `let` drops the values its frame will not read again
//! ([`Code::Let`]'s `drops`), so the host stops naming them while the frame lives on.
//!
//! A frame holds every value it bound until it returns. Most frames are short (a tree node's
//! call), but one that spans many flushes pins everything it ever bound: an early-exit
//! transformer's `@main` binds each layer's output `%x1` … `%x12` in one frame of nested `let`s
//! and `if`s, so every layer's output stayed named by the host until the sentence ended. The
//! batching runtime's early release frees a launch output only when no host value names it; a
//! named row of a large launch output is instead copied out so that the rest can go
//! (`detach_rows` in the runtime) — and with every layer's rows named to the end, those copies
//! piled up too, each on freshly faulted memory. Dropped after its last read, a layer's output
//! goes once the next layer's launch has read it.
//!
//! The analysis is liveness over one frame's code, backwards in the evaluator's order: operands
//! left to right, a `let`'s bindings in order and then its body, a conditional's condition and
//! then one arm, a `match`'s scrutinee and then one arm (whose pattern binds its variables). A
//! slot whose every later read is gone once bind `i` is made — read for the last time inside
//! bind `i`'s code, or bound by it and never read — is dropped right after bind `i`. A slot
//! read by a later operand of an enclosing expression (block formation moves a `let`'s body out
//! as a later operand: `invoke b with (let $8 = ..; $8), $8.1`) is live there, so it is kept.
//! Concurrent elements are taken in order: an element the runtime splits off as a fiber runs on
//! a copy of the frame, so what a later element drops is still in the fiber's copy.
//!
//! Functions the evaluator runs as loops (`@map`, `@foldl` and scan shapes,
//! [`crate::map_loop`]) drop nothing: their element code runs many times in one frame and the
//! evaluator reads some of its slots itself. Only the evaluator's `let` path applies drops; its
//! shortcuts that bind without it (a concurrent cell, a call taken at once) just keep the slots,
//! as before. The pass runs last, after every rewrite of the code; the verifier checks that no
//! slot is read after a drop on any path.

use crate::program::{Code, Program};
use crate::slot_set::SlotSet;

/// Code nested deeper than this in one function gets no drops (the analysis recurses).
const MAX_DEPTH: usize = 4096;

/// Sets the drops of every `let` in every function not run as a loop; returns how many slots
/// are dropped in all.
pub fn insert(program: &mut Program) -> usize {
    let mut looped = vec![false; program.lambdas.len()];
    let natives = &program.natives;
    for (g, &l) in program.globals.iter().enumerate() {
        let g = g as u32;
        let is_loop = natives.map_loop(g).is_some()
            || natives.fold_loop(g).is_some()
            || natives.scan_loop_ref(g).is_some();
        if let Some(flag) = looped.get_mut(l as usize) {
            *flag |= is_loop;
        }
    }
    let captures = program.slot_captures();
    let mut total = 0;
    for (i, lambda) in program.lambdas.iter_mut().enumerate() {
        if looped.get(i) == Some(&true) {
            continue;
        }
        let mut cx = Liveness::new(&captures);
        cx.live(&mut lambda.body, SlotSet::new(lambda.n_slots as usize));
        if cx.too_deep {
            lambda.body.visit_mut(&mut |c| {
                if let Code::Let { drops, .. } = c {
                    drops.clear();
                }
            });
        } else {
            total += cx.dropped;
        }
    }
    total
}

struct Liveness<'a> {
    /// Per lambda, the slots of the enclosing frame its closures capture.
    captures: &'a [Vec<u32>],
    depth: usize,
    too_deep: bool,
    dropped: usize,
}

impl<'a> Liveness<'a> {
    fn new(captures: &'a [Vec<u32>]) -> Self {
        Liveness {
            captures,
            depth: 0,
            too_deep: false,
            dropped: 0,
        }
    }

    /// The slots live before `code`, given those live after it; sets the drops of the `let`s
    /// inside it.
    fn live(&mut self, code: &mut Code, mut after: SlotSet) -> SlotSet {
        if self.too_deep {
            return after;
        }
        self.depth += 1;
        if self.depth > MAX_DEPTH {
            self.too_deep = true;
            return after;
        }
        let before = match code {
            Code::Slot(s) => {
                after.insert(*s);
                after
            }
            Code::MakeClosure(l) => {
                for &s in self.captures.get(*l as usize).into_iter().flatten() {
                    after.insert(s);
                }
                after
            }
            Code::Let { binds, body, drops } => {
                let mut live = self.live(body, after);
                let mut found: Vec<(u32, u32)> = Vec::new();
                for (i, (slot, value)) in binds.iter_mut().enumerate().rev() {
                    // `live`: what is read after bind `i` is made.
                    let mut before_bind = live.clone();
                    before_bind.remove(*slot);
                    let before_value = self.live(value, before_bind.clone());
                    for s in before_value.minus(&before_bind) {
                        if !live.contains(s) {
                            found.push((i as u32, s));
                        }
                    }
                    if !live.contains(*slot) {
                        found.push((i as u32, *slot));
                    }
                    live = before_value;
                }
                found.sort_unstable();
                found.dedup();
                self.dropped += found.len();
                *drops = found;
                live
            }
            Code::If(cond, then, otherwise) => {
                let mut arms = self.live(then, after.clone());
                arms.union(&self.live(otherwise, after));
                self.live(cond, arms)
            }
            Code::Match {
                scrutinee, arms, ..
            } => {
                let mut any = SlotSet::new(0);
                for (pat, arm) in arms.iter_mut() {
                    let mut live = self.live(arm, after.clone());
                    pat.for_each_slot(&mut |s| live.remove(s));
                    any.union(&live);
                }
                self.live(scrutinee, any)
            }
            _ => {
                let mut children: Vec<&mut Code> = Vec::new();
                code.for_each_child_mut(|c| children.push(c));
                for c in children.into_iter().rev() {
                    after = self.live(c, after);
                }
                after
            }
        };
        self.depth -= 1;
        before
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tumble_ir::Span;

    fn slot(s: u32) -> Code {
        Code::Slot(s)
    }

    fn tuple(items: Vec<Code>) -> Code {
        Code::Tuple(items)
    }

    fn let_(binds: Vec<(u32, Code)>, body: Code) -> Code {
        Code::Let {
            binds,
            body: Box::new(body),
            drops: Vec::new(),
        }
    }

    fn drops_of(code: &Code) -> Vec<(u32, u32)> {
        match code {
            Code::Let { drops, .. } => drops.clone(),
            _ => Vec::new(),
        }
    }

    fn run(mut body: Code, n_slots: u32) -> Code {
        Liveness::new(&[]).live(&mut body, SlotSet::new(n_slots as usize));
        body
    }

    /// `let $1 = f($0); let $2 = g($1); ($2, $2)`: the parameter goes after the first binding,
    /// `$1` after the second, `$2` is read by the body and kept.
    #[test]
    fn a_chain_drops_each_value_after_its_last_reader() {
        let body = let_(
            vec![(1, tuple(vec![slot(0)])), (2, tuple(vec![slot(1)]))],
            tuple(vec![slot(2), slot(2)]),
        );
        assert_eq!(drops_of(&run(body, 3)), vec![(0, 0), (1, 1)]);
    }

    /// A value one arm of a later `if` reads is kept past the bindings; a binding never read is
    /// dropped at once.
    #[test]
    fn a_value_an_arm_reads_is_kept_and_an_unread_binding_goes() {
        let body = let_(
            vec![(1, tuple(vec![slot(0)])), (2, tuple(vec![]))],
            Code::If(
                Box::new(slot(1)),
                Box::new(slot(0)),
                Box::new(tuple(vec![])),
            ),
        );
        assert_eq!(drops_of(&run(body, 3)), vec![(1, 2)]);
    }

    /// A slot an inner `let` binds and a later operand of the enclosing call reads (block
    /// formation's shape) is not dropped inside it.
    #[test]
    fn a_slot_read_by_a_later_operand_is_kept() {
        let inner = let_(vec![(1, tuple(vec![slot(0)]))], slot(1));
        let code = Code::Call {
            operands: vec![inner, Code::Proj(Box::new(slot(1)), 0, Span::default())],
            span: Span::default(),
        };
        let out = run(code, 2);
        let Code::Call { operands, .. } = &out else {
            panic!("not a call")
        };
        // The parameter is read for the last time in the inner binding; `$1` is kept.
        assert_eq!(drops_of(&operands[0]), vec![(0, 0)]);
    }
}
