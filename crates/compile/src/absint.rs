//! Pieces shared by the compile-time abstract interpretations (parameter reuse, hoisting): what a
//! callable may be, how a pattern binds a collapsed value, how closures capture.

use std::collections::{BTreeSet, HashMap, HashSet};
use std::hash::Hash;

use crate::program::{CaptureFrom, Code, Pat, Program};

/// A callable an abstract value may be.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub(crate) enum FnRef {
    Lambda(u32),
    Global(u32),
    Ctor,
}

/// An abstract value of one of the analyses.
pub(crate) trait Abstract: Clone + PartialEq {
    fn bottom() -> Self;
    /// The value that is exactly these callables.
    fn callables(fns: BTreeSet<FnRef>) -> Self;
    fn join(&self, other: &Self) -> Self;
    /// The value as the closure's body sees it (an analysis may forget facts local to the
    /// creating activation).
    fn captured(self) -> Self {
        self
    }
}

/// Evaluates a `let` chain's bindings in order, each into its slot of `env`.
pub(crate) fn bind_lets<A>(
    binds: &[(u32, Code)],
    env: &mut Vec<A>,
    mut eval: impl FnMut(&Code, &mut Vec<A>) -> A,
) {
    for (slot, value) in binds {
        let v = eval(value, env);
        if let Some(s) = env.get_mut(*slot as usize) {
            *s = v;
        }
    }
}

/// Binds every variable of `p` to `v`: ADT and tuple contents are collapsed into one value.
pub(crate) fn bind<A: Abstract>(p: &Pat, v: &A, env: &mut [A]) {
    match p {
        Pat::Wild => {}
        Pat::Bind(s) => {
            if let Some(slot) = env.get_mut(*s as usize) {
                *slot = v.clone();
            }
        }
        Pat::Ctor(_, ps) | Pat::Tuple(ps) => ps.iter().for_each(|q| bind(q, v, env)),
    }
}

/// Making closure `l` inside lambda `me` with environment `env`: joins the captured values into
/// `captures[l]` (over all creation sites) and returns the closure's value. Sets `changed` when
/// the joined captures grew (the fixpoint must go on). `param` is the value of an entry argument.
pub(crate) fn make_closure<A: Abstract>(
    program: &Program,
    l: u32,
    me: u32,
    env: &[A],
    captures: &mut HashMap<u32, Vec<A>>,
    changed: &mut bool,
    param: impl Fn(u32) -> A,
) -> A {
    let mut captured = Vec::new();
    if let Some(lambda) = program.lambdas.get(l as usize) {
        for (from, _) in &lambda.captures {
            captured.push(match from {
                CaptureFrom::Slot(s) => env.get(*s as usize).cloned().unwrap_or_else(A::bottom),
                CaptureFrom::SelfRef => A::callables([FnRef::Lambda(me)].into_iter().collect()),
                CaptureFrom::Param(k) => param(*k),
            });
        }
    }
    let entry = captures
        .entry(l)
        .or_insert_with(|| vec![A::bottom(); captured.len()]);
    for (old, new) in entry.iter_mut().zip(captured) {
        let j = old.join(&new.captured());
        if j != *old {
            *old = j;
            *changed = true;
        }
    }
    A::callables([FnRef::Lambda(l)].into_iter().collect())
}

/// The call table of an analysis's fixpoint: each call's summary (the join of what its body
/// returned, per lambda and abstract arguments), the calls on the analysis stack, and the calls
/// already evaluated in this round. `C` is what else a body's result depends on (hoisting: the
/// functions active around it; reuse: nothing). A call met again takes its summary: evaluating a
/// body anew per call took time exponential in the depth of a chain of functions that each call
/// the next twice (40 levels: the compiler never finished).
pub(crate) struct CallMemo<A, C = ()> {
    summaries: HashMap<(u32, Vec<A>), A>,
    in_progress: HashSet<(u32, Vec<A>)>,
    done: HashSet<(u32, Vec<A>, C)>,
    /// Per call, the contexts it was evaluated in this round.
    contexts: HashMap<(u32, Vec<A>), usize>,
}

impl<A: Abstract + Eq + Hash, C: Eq + Hash> CallMemo<A, C> {
    pub(crate) fn new() -> Self {
        CallMemo {
            summaries: HashMap::new(),
            in_progress: HashSet::new(),
            done: HashSet::new(),
            contexts: HashMap::new(),
        }
    }

    /// In how many contexts `lambda` on `args` was evaluated this round.
    pub(crate) fn contexts(&self, lambda: u32, args: &[A]) -> usize {
        self.contexts
            .get(&(lambda, args.to_vec()))
            .copied()
            .unwrap_or(0)
    }

    /// Starts a round of the fixpoint: every call is evaluated again, once.
    pub(crate) fn new_round(&mut self) {
        self.done.clear();
        self.contexts.clear();
    }

    /// Before evaluating `lambda` on `args` in `context`: its summary so far when the call is
    /// on the stack (recursion) or was evaluated this round in this context; else `None`, and
    /// the call is marked begun (end it with [`CallMemo::leave`]).
    pub(crate) fn enter(&mut self, lambda: u32, args: &[A], context: C) -> Option<A> {
        let key = (lambda, args.to_vec());
        let context = (lambda, key.1.clone(), context);
        if self.in_progress.contains(&key) || self.done.contains(&context) {
            return Some(self.summaries.get(&key).cloned().unwrap_or_else(A::bottom));
        }
        self.done.insert(context);
        *self.contexts.entry(key.clone()).or_default() += 1;
        self.in_progress.insert(key);
        None
    }

    /// After evaluating a call begun by [`CallMemo::enter`]: joins `result` into its summary.
    /// Returns the summary and whether it grew (then the fixpoint must go on).
    pub(crate) fn leave(&mut self, lambda: u32, args: Vec<A>, result: &A) -> (A, bool) {
        let key = (lambda, args);
        self.in_progress.remove(&key);
        let old = self.summaries.get(&key).cloned().unwrap_or_else(A::bottom);
        let new = old.join(result);
        if new == old {
            (new, false)
        } else {
            self.summaries.insert(key, new.clone());
            (new, true)
        }
    }
}
