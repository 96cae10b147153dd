//! Parameter-reuse analysis (ACROBAT §5.1): for every input of every static block, is it the same
//! value for every invocation, so a batched launch passes it once instead of gathering it?
//!
//! An abstract interpretation of the lowered program. Each value is abstracted to whether it may
//! differ between instances (`varying`) and, if not, the set of *sources* it is computed from
//! (`@main` parameters bound to model weights, and literal sites). A block input is **shared** when
//! every visit sees it non-varying and computed from the same sources: then it is one value for the
//! whole mini-batch. Functions are analyzed per context — the abstract values of their arguments —
//! which is at least as precise as 1-call-site sensitivity; closures are tracked by the lambdas they
//! may be, with captured values joined over creation sites. Tuples and ADT values are collapsed to the
//! join of their contents. Recursion is solved by iterating to a fixpoint.
//!
//! An input that is derived from parameters but from *different* parameters at different call sites
//! (BiRNN's forward and backward weights into one `@rnn`) is reported as such: it is what code
//! duplication (ACROBAT §5.1) fixes.

use std::collections::{BTreeSet, HashMap};

use crate::absint::{Abstract, CallMemo, FnRef};
use crate::program::{Code, Program};

#[derive(Clone, Debug, PartialEq, Eq, Hash, Default, PartialOrd, Ord)]
struct AV {
    /// No value reaches here yet (the start of a fixpoint iteration).
    bottom: bool,
    varying: bool,
    sources: BTreeSet<u64>,
    fns: BTreeSet<FnRef>,
}

impl Abstract for AV {
    fn bottom() -> AV {
        AV {
            bottom: true,
            ..AV::default()
        }
    }

    fn callables(fns: BTreeSet<FnRef>) -> AV {
        AV {
            fns,
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
            varying: self.varying || o.varying,
            sources: self.sources.union(&o.sources).copied().collect(),
            fns: self.fns.union(&o.fns).copied().collect(),
        }
    }
}

impl AV {
    fn shared_from(source: u64) -> AV {
        AV {
            sources: [source].into_iter().collect(),
            ..AV::default()
        }
    }

    fn varying() -> AV {
        AV {
            varying: true,
            ..AV::default()
        }
    }

    fn with_varying(mut self, v: bool) -> AV {
        self.varying |= v;
        self
    }
}

/// What the analysis concluded for one block input.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum InputReuse {
    /// One value for every invocation: passed once per launch.
    Shared,
    /// Differs between instances (or positions): gathered per invocation.
    PerInstance,
    /// Derived only from parameters, but from different ones at different call sites: each call
    /// site alone would be shared (code duplication makes it so).
    SharedPerCallSite,
    /// The block is never reached from the entry point.
    Unreached,
}

#[derive(Clone, Debug, Default, serde::Serialize, serde::Deserialize)]
pub struct ReuseAnalysis {
    /// Per block, per input.
    pub inputs: Vec<Vec<InputReuse>>,
    /// Per parameter of the entry (then per derived parameter, numbered after them): bound to a
    /// model weight. The runtime knows the weights among an instance's arguments by it (a
    /// weight a program chooses per instance is still one of them: `Executable`'s weight groups).
    pub param_is_weight: Vec<bool>,
}

impl ReuseAnalysis {
    /// The inputs of `block` (block number `b`) that an `nn.dense` reads as its weight and that
    /// were found per instance: a weight chosen by an `if` or a `match` on instance data (two
    /// experts of a gate, a matrix per node kind) is still one of a few model weights, which a
    /// launch groups its invocations by (the runtime's weight groups), where MV-RNN's per-word
    /// matrices are all different.
    pub fn chosen_weights(&self, block: &crate::Block, b: usize) -> Vec<u32> {
        let mut inputs: Vec<u32> = block
            .nodes
            .iter()
            .filter(|n| n.op.name == "nn.dense")
            .filter_map(|n| match n.args.get(1) {
                Some(crate::BArg::One(crate::BVal::Input(i))) => Some(*i),
                _ => None,
            })
            .filter(|&i| {
                // (Or one weight per call site where code duplication is off: a few weights.)
                matches!(
                    self.inputs.get(b).and_then(|v| v.get(i as usize)),
                    Some(InputReuse::PerInstance | InputReuse::SharedPerCallSite)
                )
            })
            .collect();
        inputs.sort_unstable();
        inputs.dedup();
        inputs
    }

    /// Per input of `block`: may it differ between the invocations of one mini-batch (everything
    /// but one value per mini-batch, or per call site under code duplication)? The view
    /// [`crate::ragged::analyze`] takes.
    pub fn varying_inputs(&self, block: usize) -> Vec<bool> {
        self.inputs.get(block).map_or_else(Vec::new, |v| {
            v.iter()
                .map(|r| !matches!(r, InputReuse::Shared | InputReuse::SharedPerCallSite))
                .collect()
        })
    }

    pub fn is_shared(&self, block: u32, input: usize) -> bool {
        matches!(
            self.inputs.get(block as usize).and_then(|v| v.get(input)),
            Some(InputReuse::Shared)
        )
    }
}

/// Per block input: was it ever varying, and which source sets were seen.
#[derive(Clone, Default)]
struct InputFacts {
    seen: bool,
    varying: bool,
    source_sets: BTreeSet<BTreeSet<u64>>,
}

struct Analyzer<'p> {
    program: &'p Program,
    calls: CallMemo<AV>,
    captures: HashMap<u32, Vec<AV>>,
    facts: Vec<Vec<InputFacts>>,
    changed: bool,
    /// Literal sites get source ids above the parameters'.
    next_literal: HashMap<usize, u64>,
    n_params: u64,
    /// The entry's parameters that are model weights (what [`Code::Param`] reads).
    weights: Vec<bool>,
}

/// Analyzes `program` from global `entry`, whose parameters flagged in `param_is_weight` are model
/// parameters (the same for every instance); the others come from the instances.
pub fn analyze(program: &Program, entry: &str, param_is_weight: &[bool]) -> ReuseAnalysis {
    // Derived parameters (weight transforms, numbered after the entry's own) are weights too.
    let mut weights = param_is_weight.to_vec();
    if !program.derived.is_empty() {
        let n_entry = program
            .entry_lambda()
            .map_or(weights.len(), |l| l.n_params as usize);
        weights.resize(n_entry, false);
        weights.resize(n_entry + program.derived_count() as usize, true);
    }
    let mut a = Analyzer {
        program,
        calls: CallMemo::new(),
        captures: HashMap::new(),
        facts: program
            .blocks
            .iter()
            .map(|b| vec![InputFacts::default(); b.inputs.len()])
            .collect(),
        changed: true,
        next_literal: HashMap::new(),
        n_params: weights.len() as u64,
        weights,
    };
    let entry_lambda = program
        .global_index
        .get(entry)
        .and_then(|g| program.globals.get(*g as usize))
        .copied();
    let mut settled = true;
    if let Some(l) = entry_lambda {
        let args: Vec<AV> = param_is_weight
            .iter()
            .enumerate()
            .map(|(i, &w)| {
                if w {
                    AV::shared_from(i as u64)
                } else {
                    AV::varying()
                }
            })
            .collect();
        // Fixpoint: summaries and captured values only grow, so this terminates; the bound is a guard.
        for _ in 0..64 {
            a.changed = false;
            // A round evaluates each call once; what it records (block input facts, joins) is
            // the same however often the same call is met, and a change found means another round.
            a.calls.new_round();
            for f in a.facts.iter_mut().flatten() {
                *f = InputFacts::default();
            }
            a.call(l, args.clone(), Vec::new());
            if !a.changed {
                break;
            }
        }
        // Not settled within the bound: nothing is claimed shared (every input read per
        // instance, which is always right, only slower).
        settled = !a.changed;
    }
    let inputs = a
        .facts
        .iter()
        .map(|per_block| {
            per_block
                .iter()
                .map(|f| {
                    if !settled {
                        InputReuse::PerInstance
                    } else if !f.seen {
                        InputReuse::Unreached
                    } else if f.varying {
                        InputReuse::PerInstance
                    } else if f.source_sets.len() == 1 {
                        InputReuse::Shared
                    } else {
                        InputReuse::SharedPerCallSite
                    }
                })
                .collect()
        })
        .collect();
    ReuseAnalysis {
        inputs,
        param_is_weight: a.weights,
    }
}

impl Analyzer<'_> {
    fn call(&mut self, lambda: u32, args: Vec<AV>, captured: Vec<AV>) -> AV {
        let Some(l) = self.program.lambdas.get(lambda as usize) else {
            return AV::varying();
        };
        if let Some(summary) = self.calls.enter(lambda, &args, ()) {
            return summary;
        }
        let mut env: Vec<AV> = vec![AV::bottom(); l.n_slots as usize];
        for (i, a) in args.iter().enumerate() {
            if let Some(s) = env.get_mut(i) {
                *s = a.clone();
            }
        }
        for ((_, slot), v) in l.captures.iter().zip(captured) {
            if let Some(s) = env.get_mut(*slot as usize) {
                *s = v;
            }
        }
        let result = self.eval(&l.body, &mut env, lambda);
        let (summary, grew) = self.calls.leave(lambda, args, &result);
        self.changed |= grew;
        summary
    }

    fn apply(&mut self, callee: &AV, args: Vec<AV>) -> AV {
        if callee.fns.is_empty() {
            // Nothing known about what is called: its result may be anything.
            return AV::varying();
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
                    None => AV::varying(),
                },
                FnRef::Ctor => args.iter().fold(AV::default(), |a, b| a.join(b)),
            };
            out = out.join(&r);
        }
        out.with_varying(callee.varying)
    }

    fn eval(&mut self, code: &Code, env: &mut Vec<AV>, me: u32) -> AV {
        match code {
            Code::Slot(s) => env.get(*s as usize).cloned().unwrap_or_else(AV::bottom),
            Code::SelfRef => AV::callables([FnRef::Lambda(me)].into_iter().collect()),
            Code::Global(g) => AV::callables([FnRef::Global(*g)].into_iter().collect()),
            Code::Ctor(_) => AV::callables([FnRef::Ctor].into_iter().collect()),
            Code::Lit(_) => {
                let addr = code as *const Code as usize;
                let n = self.n_params + self.next_literal.len() as u64;
                let id = *self.next_literal.entry(addr).or_insert(n);
                AV::shared_from(id)
            }
            Code::Phase => AV::default(),
            Code::Param(k) => param_value(&self.weights, *k),
            Code::Ghost(_, body) => self.eval(body, env, me),
            Code::Tuple(es) | Code::Concurrent(es) => {
                let mut out = AV::default();
                for e in es {
                    let v = self.eval(e, env, me);
                    out = out.join(&v);
                }
                out
            }
            Code::Proj(e, _, _) => self.eval(e, env, me),
            Code::CallOp { op, args, .. } => {
                let mut out = AV::default();
                for e in args {
                    let v = self.eval(e, env, me);
                    out = out.join(&v);
                }
                // Each instance draws its own random numbers.
                out.with_varying(op.name.starts_with("random."))
            }
            Code::CallCtor { args, .. } => {
                let mut out = AV::default();
                for e in args {
                    let v = self.eval(e, env, me);
                    out = out.join(&v);
                }
                out
            }
            Code::CallGlobal { global, args, .. } => {
                let avs: Vec<AV> = args.iter().map(|e| self.eval(e, env, me)).collect();
                match self.program.globals.get(*global as usize) {
                    Some(&l) => self.call(l, avs, Vec::new()),
                    None => AV::varying(),
                }
            }
            Code::Call { operands, .. } => {
                let mut avs: Vec<AV> = operands.iter().map(|e| self.eval(e, env, me)).collect();
                if avs.is_empty() {
                    return AV::varying();
                }
                let callee = avs.remove(0);
                self.apply(&callee, avs)
            }
            Code::InvokeBlock { block, args, .. } => {
                let mut out = AV::default();
                for (i, e) in args.iter().enumerate() {
                    let v = self.eval(e, env, me);
                    if let Some(f) = self
                        .facts
                        .get_mut(*block as usize)
                        .and_then(|b| b.get_mut(i))
                    {
                        if !v.bottom {
                            f.seen = true;
                            f.varying |= v.varying;
                            f.source_sets.insert(v.sources.clone());
                        }
                    }
                    out = out.join(&v);
                }
                out.fns.clear();
                out
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
                |k| param_value(&self.weights, k),
            ),
            Code::If(c, t, f) => {
                let cv = self.eval(c, env, me);
                let tv = self.eval(t, env, me);
                let fv = self.eval(f, env, me);
                tv.join(&fv).with_varying(cv.varying)
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
                out.with_varying(sv.varying && arms.len() > 1)
            }
        }
    }
}

/// Entry argument `k`: shared when it is a weight.
fn param_value(weights: &[bool], k: u32) -> AV {
    if weights.get(k as usize).copied().unwrap_or(false) {
        AV::shared_from(u64::from(k))
    } else {
        AV::varying()
    }
}
