//! Static hoisting (ACROBAT §4.1 and appendix A): a taint analysis that finds the block invocations
//! inside recursion or iteration that do not depend on the recursive state — an RNN's input
//! transform `W·x`, a TreeLSTM leaf's `W·x` — so the scheduler can give them their dataflow depth
//! (0 for work on instance data) instead of the instance's inline depth. They then batch across all
//! positions of all instances instead of one launch per step.
//!
//! **What is recursive state.** A value carries the state of recursive function `L` when it was
//! computed in one activation of `L` and reaches another: an argument computed in this activation
//! (by a block or a call: *fresh*) passed to a recursive call of `L` (TreeLSTM's child states flow
//! back up, an RNN's `h` flows forward), or the result of a recursive call of `L`. The taint is the
//! set of such functions; block results carry the union of their inputs' taints. A taint only
//! counts while its function is active: when a result leaves the outermost activation of `L`, `L`
//! is dropped from it (the recursion is over; whoever uses the result next is not inside it).
//! Values passed through unchanged (weights, the list being walked, its elements) are not fresh
//! and stay clean.
//!
//! **Precision.** Functions are analyzed per context — the abstract values of their arguments,
//! taints included — so a helper called from inside and outside a recursion is judged separately
//! per context; a site is hoisted only if it is clean in every context that reaches it (the runtime
//! cannot tell contexts apart; code duplication, [`crate::dup`], separates call sites where it
//! matters). Tuples and ADT values are collapsed to the join of their contents; closures are
//! tracked by the lambdas they may be, their captured values joined over creation sites; recursion
//! is solved by iterating to a fixpoint.

use std::collections::{BTreeSet, HashMap};

use crate::absint::{Abstract, CallMemo, FnRef};
use crate::program::{Code, Program};

#[derive(Clone, Debug, PartialEq, Eq, Hash, Default, PartialOrd, Ord)]
struct AV {
    /// Nothing reaches here yet (the start of a fixpoint iteration).
    bottom: bool,
    /// Computed in the current activation (by a block or a call) rather than received.
    fresh: bool,
    /// The recursive functions (lambda indices) whose state this value carries.
    taint: BTreeSet<u32>,
    fns: BTreeSet<FnRef>,
}

impl Abstract for AV {
    fn bottom() -> AV {
        AV {
            bottom: true,
            ..AV::default()
        }
    }

    fn join(&self, o: &AV) -> AV {
        if self.bottom {
            return o.clone();
        }
        if o.bottom {
            return self.clone();
        }
        AV {
            bottom: false,
            fresh: self.fresh || o.fresh,
            taint: self.taint.union(&o.taint).copied().collect(),
            fns: self.fns.union(&o.fns).copied().collect(),
        }
    }

    fn callables(fns: BTreeSet<FnRef>) -> AV {
        AV {
            fns,
            ..AV::default()
        }
    }

    /// A captured value is received by the closure's body, whatever its freshness where the
    /// closure was made; its taint stays.
    fn captured(self) -> AV {
        self.received()
    }
}

impl AV {
    fn received(mut self) -> AV {
        self.fresh = false;
        self
    }
}

/// What the analysis found, per block-invocation site.
#[derive(Clone, Debug, Default)]
pub struct HoistAnalysis {
    /// Per site: reached from the entry and independent of recursive state in every context.
    pub hoisted: Vec<bool>,
    /// Per site: reached at all.
    pub reached: Vec<bool>,
    /// Per site, per operand: carries recursive state in some context (empty — nothing known —
    /// for a site not reached, or when the analysis did not settle). What [`crate::split`]
    /// splits a block by.
    pub tainted_operands: Vec<Vec<bool>>,
}

/// Contexts (sets of active functions) a call is evaluated in per round before it is evaluated
/// as if every function were active.
const MAX_CONTEXTS: usize = 8;

struct Analyzer<'p> {
    program: &'p Program,
    /// Calls, in the context of the functions active around them (what a body's taints depend
    /// on).
    calls: CallMemo<AV, Vec<u32>>,
    /// Lambdas with an activation on the analysis stack, with their multiplicity.
    active: HashMap<u32, u32>,
    /// Nonzero while a call is evaluated as if every function were active (see `call`).
    saturated: u32,
    captures: HashMap<u32, Vec<AV>>,
    seen: Vec<bool>,
    tainted: Vec<bool>,
    tainted_operands: Vec<Vec<bool>>,
    changed: bool,
}

/// Analyzes `program` from global `entry`; every entry parameter is clean (weights and instance
/// data alike are given, not computed by the recursion).
pub fn analyze(program: &Program, entry: &str) -> HoistAnalysis {
    let n_sites = program.sites.len();
    let mut a = Analyzer {
        program,
        calls: CallMemo::new(),
        active: HashMap::new(),
        saturated: 0,
        captures: HashMap::new(),
        seen: vec![false; n_sites],
        tainted: vec![false; n_sites],
        tainted_operands: vec![Vec::new(); n_sites],
        changed: true,
    };
    let entry_lambda = program
        .global_index
        .get(entry)
        .and_then(|g| program.globals.get(*g as usize))
        .copied();
    if let Some(l) = entry_lambda {
        let n = program.lambdas.get(l as usize).map_or(0, |x| x.n_params);
        let args = vec![AV::default(); n as usize];
        // Summaries and captures only grow, so this terminates; the bound is a guard.
        for _ in 0..64 {
            a.changed = false;
            a.calls.new_round();
            a.seen.iter_mut().for_each(|x| *x = false);
            a.tainted.iter_mut().for_each(|x| *x = false);
            a.tainted_operands.iter_mut().for_each(Vec::clear);
            a.call(l, args.clone(), Vec::new());
            if !a.changed {
                break;
            }
        }
        if a.changed {
            // Not settled within the bound: nothing is hoisted (always right, only slower).
            a.tainted.iter_mut().for_each(|x| *x = true);
            a.tainted_operands.iter_mut().for_each(Vec::clear);
        }
    }
    // An operand never seen tainted is clean only where the analysis settled and saw the site.
    let settled = !a.changed;
    let tainted_operands = a
        .tainted_operands
        .into_iter()
        .zip(&a.seen)
        .map(|(t, &seen)| match settled && seen {
            true => t,
            false => Vec::new(),
        })
        .collect();
    HoistAnalysis {
        hoisted: a
            .seen
            .iter()
            .zip(&a.tainted)
            .map(|(&s, &t)| s && !t)
            .collect(),
        reached: a.seen,
        tainted_operands,
    }
}

impl Analyzer<'_> {
    fn is_active(&self, l: u32) -> bool {
        self.saturated > 0 || self.active.get(&l).is_some_and(|&n| n > 0)
    }

    /// Drops taints of functions that are no longer active.
    fn live(&self, mut v: AV) -> AV {
        v.taint.retain(|l| self.is_active(*l));
        v
    }

    fn call(&mut self, lambda: u32, args: Vec<AV>, captured: Vec<AV>) -> AV {
        let recursive = self.is_active(lambda);
        // Fresh values handed to another activation of an active function are its loop-carried
        // state.
        let args: Vec<AV> = args
            .into_iter()
            .map(|a| {
                let carried = recursive && !a.bottom && a.fresh;
                let mut a = a.received();
                if carried {
                    a.taint.insert(lambda);
                }
                a
            })
            .collect();
        // A call met in more than MAX_CONTEXTS sets of active functions in one round (functions
        // reaching each other along many paths: their number grows exponentially with the
        // functions of a cycle) is evaluated once more as if every function were active, and so
        // is everything it calls: a taint for every active function is a superset of any real
        // context's, so the result only hoists less (13 mutually recursive functions took 11 s
        // to compile; an audit's find).
        let saturated = self.saturated > 0 || self.calls.contexts(lambda, &args) >= MAX_CONTEXTS;
        let context: Vec<u32> = if saturated {
            vec![u32::MAX]
        } else {
            let mut active: Vec<u32> = self
                .active
                .iter()
                .filter(|(_, &n)| n > 0)
                .map(|(&l, _)| l)
                .collect();
            active.sort_unstable();
            active
        };
        let result = match self.program.lambdas.get(lambda as usize) {
            None => AV::default(),
            Some(l) => match self.calls.enter(lambda, &args, context) {
                Some(summary) => summary,
                None => {
                    self.saturated += u32::from(saturated);
                    *self.active.entry(lambda).or_default() += 1;
                    let mut env: Vec<AV> = vec![AV::bottom(); l.n_slots as usize];
                    for (i, a) in args.iter().enumerate() {
                        if let Some(s) = env.get_mut(i) {
                            *s = a.clone();
                        }
                    }
                    for ((_, slot), v) in l.captures.iter().zip(captured) {
                        if let Some(s) = env.get_mut(*slot as usize) {
                            *s = v.received();
                        }
                    }
                    let r = self.eval(&l.body, &mut env, lambda);
                    if let Some(n) = self.active.get_mut(&lambda) {
                        *n -= 1;
                    }
                    self.saturated -= u32::from(saturated);
                    let (summary, grew) = self.calls.leave(lambda, args, &r.received());
                    self.changed |= grew;
                    summary
                }
            },
        };
        let mut out = result;
        if recursive && !out.bottom {
            out.taint.insert(lambda);
        }
        let mut out = self.live(out);
        out.fresh = true;
        out
    }

    fn apply(&mut self, callee: &AV, args: Vec<AV>) -> AV {
        if callee.fns.is_empty() {
            // Unknown callee: its result may carry any state.
            let mut out = args.iter().fold(AV::default(), |a, b| a.join(b));
            out.fresh = true;
            return out;
        }
        let mut out = AV::bottom();
        for f in callee.fns.clone() {
            let r = match f {
                FnRef::Lambda(l) => {
                    let captured = self.captures.get(&l).cloned().unwrap_or_default();
                    self.call(l, args.clone(), captured)
                }
                FnRef::Global(g) => match self.program.globals.get(g as usize) {
                    Some(&l) => self.call(l, args.clone(), Vec::new()),
                    None => AV::default(),
                },
                FnRef::Ctor => args.iter().fold(AV::default(), |a, b| a.join(b)),
            };
            out = out.join(&r);
        }
        out
    }

    fn eval(&mut self, code: &Code, env: &mut Vec<AV>, me: u32) -> AV {
        match code {
            Code::Slot(s) => env.get(*s as usize).cloned().unwrap_or_else(AV::bottom),
            Code::SelfRef => AV::callables([FnRef::Lambda(me)].into_iter().collect()),
            Code::Global(g) => AV::callables([FnRef::Global(*g)].into_iter().collect()),
            Code::Ctor(_) => AV::callables([FnRef::Ctor].into_iter().collect()),
            // Weights: received, not computed in any activation.
            Code::Lit(_) | Code::Param(_) | Code::Phase => AV::default(),
            Code::Ghost(_, body) => self.eval(body, env, me),
            Code::Tuple(es) | Code::Concurrent(es) => self.join_all(es, env, me),
            Code::CallCtor { args, .. } => self.join_all(args, env, me),
            Code::Proj(e, _, _) => self.eval(e, env, me),
            Code::CallOp { args, .. } => {
                let mut out = self.join_all(args, env, me);
                out.fns.clear();
                out.fresh = true;
                out
            }
            Code::CallGlobal { global, args, .. } => {
                let avs: Vec<AV> = args.iter().map(|e| self.eval(e, env, me)).collect();
                match self.program.globals.get(*global as usize) {
                    Some(&l) => self.call(l, avs, Vec::new()),
                    None => AV::default(),
                }
            }
            Code::Call { operands, .. } => {
                let mut avs: Vec<AV> = operands.iter().map(|e| self.eval(e, env, me)).collect();
                if avs.is_empty() {
                    return AV::default();
                }
                let callee = avs.remove(0);
                self.apply(&callee, avs)
            }
            Code::InvokeBlock { site, args, .. } => {
                let mut out = AV::default();
                let mut any = false;
                let mut operands = Vec::with_capacity(args.len());
                for e in args {
                    let v = self.eval(e, env, me);
                    any |= !v.bottom;
                    operands.push(!v.bottom && v.taint.iter().any(|&l| self.is_active(l)));
                    out = out.join(&v);
                }
                if let Some(t) = self.tainted_operands.get_mut(*site as usize) {
                    t.resize(operands.len(), false);
                    t.iter_mut().zip(&operands).for_each(|(t, &o)| *t |= o);
                }
                let out = self.live(out);
                if any || args.is_empty() {
                    if let Some(s) = self.seen.get_mut(*site as usize) {
                        *s = true;
                    }
                    if !out.taint.is_empty() {
                        if let Some(t) = self.tainted.get_mut(*site as usize) {
                            *t = true;
                        }
                    }
                }
                AV {
                    bottom: false,
                    fresh: true,
                    taint: out.taint,
                    fns: BTreeSet::new(),
                }
            }
            Code::Let { binds, body, .. } => {
                crate::absint::bind_lets(binds, env, |value, env| self.eval(value, env, me));
                self.eval(body, env, me)
            }
            Code::MakeClosure(l) => crate::absint::make_closure(
                self.program,
                *l,
                me,
                env,
                &mut self.captures,
                &mut self.changed,
                |_| AV::default(),
            ),
            Code::If(c, t, f) => {
                let cv = self.eval(c, env, me);
                let tv = self.eval(t, env, me);
                let fv = self.eval(f, env, me);
                // Which arm ran depends on the condition: the result carries its taint.
                let mut out = tv.join(&fv);
                out.taint.extend(cv.taint);
                out
            }
            Code::Match {
                scrutinee, arms, ..
            } => {
                let sv = self.eval(scrutinee, env, me);
                let mut out = AV::bottom();
                for (pat, body) in arms {
                    crate::absint::bind(pat, &sv, env);
                    let v = self.eval(body, env, me);
                    out = out.join(&v);
                }
                if arms.len() > 1 {
                    out.taint.extend(sv.taint);
                }
                out
            }
        }
    }

    fn join_all(&mut self, es: &[Code], env: &mut Vec<AV>, me: u32) -> AV {
        let mut out = AV::default();
        for e in es {
            let v = self.eval(e, env, me);
            out = out.join(&v);
        }
        out
    }
}
