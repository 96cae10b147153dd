//! Entry parameters as per-run constants. Model weights are `@main` arguments, and a recursive
//! model passes them down every call and captures them in every closure (TreeLSTM's `@treelstm`
//! takes six weights and its `@map` closures capture them again), so the interpreter clones,
//! stores and drops each weight several times per tree node. This pass finds the slots that
//! always hold exactly the entry's `k`-th argument and reads [`Code::Param`]`(k)` there instead:
//! captures of such values disappear, and parameters of globals that always receive them are
//! removed (with the arguments at every call site).
//!
//! The analysis is flow-insensitive and context-insensitive: per lambda and slot, the join over
//! every value ever written there (arguments at every call site, captured values at every creation
//! site, `let` and pattern bindings). A value is abstracted to what it is *itself* (exactly entry
//! argument `k`, or something else) and, separately, what its contents may be (the join over the
//! fields of a tuple, ADT or closure at any depth), so that matching `Some(%w)` against an option
//! that only ever holds `%W` binds `%w` to `%W`, while the option itself is not `%W`. Callables are
//! tracked as in the other analyses; a call whose callee is unknown makes the pass do nothing.

use std::collections::BTreeSet;

use crate::absint::FnRef;
use crate::program::{CaptureFrom, Code, Pat, Program};

/// What a value is, in the three-point lattice bottom < exactly argument `k` < anything.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
enum Is {
    #[default]
    Nothing,
    Param(u32),
    Other,
}

impl Is {
    fn join(self, o: Is) -> Is {
        match (self, o) {
            (Is::Nothing, x) | (x, Is::Nothing) => x,
            (Is::Param(a), Is::Param(b)) if a == b => Is::Param(a),
            _ => Is::Other,
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Default)]
struct CV {
    /// The value itself.
    is: Is,
    /// Anything inside it, at any depth (nothing for a tensor).
    inner: Is,
    fns: BTreeSet<FnRef>,
}

impl CV {
    fn other() -> CV {
        CV {
            is: Is::Other,
            inner: Is::Other,
            fns: BTreeSet::new(),
        }
    }

    fn callable(f: FnRef) -> CV {
        CV {
            is: Is::Other,
            inner: Is::Other,
            fns: [f].into_iter().collect(),
        }
    }

    fn join(&self, o: &CV) -> CV {
        CV {
            is: self.is.join(o.is),
            inner: self.inner.join(o.inner),
            fns: self.fns.union(&o.fns).copied().collect(),
        }
    }

    /// A tuple, ADT or closure holding these values. One with a field that has no value yet (a
    /// parameter of a closure that is made but never called) has none either: evaluation is
    /// strict, so it is never built. Joining that field's bottom into the contents instead would
    /// let `(%p, %W).0` in such dead code read as `%W` — a read of the wrong weight that derived
    /// parameters, evaluated once per run whatever is called, then ran (seed 1504143).
    fn holding<'a>(fields: impl IntoIterator<Item = &'a CV>) -> CV {
        let mut out = CV {
            is: Is::Other,
            inner: Is::Nothing,
            fns: BTreeSet::new(),
        };
        let mut unbuilt = false;
        for f in fields {
            unbuilt |= f.is == Is::Nothing;
            out.inner = out.inner.join(f.is).join(f.inner);
            out.fns.extend(f.fns.iter().copied());
        }
        if unbuilt {
            out.is = Is::Nothing;
            out.inner = Is::Nothing;
        }
        out
    }

    /// A value found inside this one.
    fn field(&self) -> CV {
        CV {
            is: self.inner,
            inner: self.inner,
            fns: self.fns.clone(),
        }
    }
}

/// What the pass did, for `explain` and the tests.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ConstReport {
    /// Reads of a slot that became reads of an entry argument.
    pub reads: usize,
    /// Closure captures removed.
    pub captures: usize,
    /// Parameters of globals removed, as `(global name, parameter position)`.
    pub params: Vec<(String, u32)>,
}

struct Analyzer<'p> {
    program: &'p Program,
    /// Per lambda, per slot: the join of every value written there.
    slots: Vec<Vec<CV>>,
    results: Vec<CV>,
    reached: Vec<bool>,
    changed: bool,
    /// A call whose callee the analysis cannot see: its conclusions would not be sound.
    lost: bool,
    /// The entry's arguments that are model weights: tensors, with no contents.
    weights: &'p [bool],
}

impl Analyzer<'_> {
    /// Entry argument `k`; one that is not a weight may be a list or tuple of anything.
    fn param(&self, k: u32) -> CV {
        let tensor = self.weights.get(k as usize).copied().unwrap_or(false);
        CV {
            is: Is::Param(k),
            inner: if tensor { Is::Nothing } else { Is::Other },
            fns: BTreeSet::new(),
        }
    }

    fn write(&mut self, lambda: u32, slot: u32, v: &CV) {
        if let Some(s) = self
            .slots
            .get_mut(lambda as usize)
            .and_then(|l| l.get_mut(slot as usize))
        {
            let j = s.join(v);
            if j != *s {
                *s = j;
                self.changed = true;
            }
        }
        if let Some(r) = self.reached.get_mut(lambda as usize) {
            if !*r {
                *r = true;
                self.changed = true;
            }
        }
    }

    fn call_lambda(&mut self, lambda: u32, args: &[CV]) -> CV {
        for (i, a) in args.iter().enumerate() {
            self.write(lambda, i as u32, a);
        }
        self.results
            .get(lambda as usize)
            .cloned()
            .unwrap_or_else(CV::other)
    }

    fn apply(&mut self, callee: &CV, args: &[CV]) -> CV {
        if callee.fns.is_empty() {
            self.lost = true;
            return CV::other();
        }
        let mut out = CV::default();
        for f in callee.fns.clone() {
            let r = match f {
                FnRef::Lambda(l) => self.call_lambda(l, args),
                FnRef::Global(g) => match self.program.globals.get(g as usize) {
                    Some(&l) => self.call_lambda(l, args),
                    None => CV::other(),
                },
                FnRef::Ctor => CV::holding(args),
            };
            out = out.join(&r);
        }
        out
    }

    fn bind(&mut self, me: u32, pat: &Pat, v: &CV, env: &mut [CV]) {
        match pat {
            Pat::Wild => {}
            Pat::Bind(s) => {
                if let Some(e) = env.get_mut(*s as usize) {
                    *e = v.clone();
                }
                self.write(me, *s, v);
            }
            Pat::Ctor(_, ps) | Pat::Tuple(ps) => {
                let f = v.field();
                for p in ps {
                    self.bind(me, p, &f, env);
                }
            }
        }
    }

    fn eval(&mut self, code: &Code, env: &mut Vec<CV>, me: u32) -> CV {
        match code {
            Code::Slot(s) => env.get(*s as usize).cloned().unwrap_or_default(),
            Code::Param(k) => self.param(*k),
            Code::SelfRef => CV::callable(FnRef::Lambda(me)),
            Code::Global(g) => CV::callable(FnRef::Global(*g)),
            Code::Ctor(_) => CV::callable(FnRef::Ctor),
            Code::Lit(_) | Code::Phase => CV::other(),
            Code::Ghost(_, body) => self.eval(body, env, me),
            Code::Tuple(es) | Code::Concurrent(es) | Code::CallCtor { args: es, .. } => {
                let vs: Vec<CV> = es.iter().map(|e| self.eval(e, env, me)).collect();
                CV::holding(&vs)
            }
            Code::Proj(e, _, _) => self.eval(e, env, me).field(),
            Code::CallOp { args, .. } | Code::InvokeBlock { args, .. } => {
                for e in args {
                    self.eval(e, env, me);
                }
                CV::other()
            }
            Code::CallGlobal { global, args, .. } => {
                let vs: Vec<CV> = args.iter().map(|e| self.eval(e, env, me)).collect();
                match self.program.globals.get(*global as usize) {
                    Some(&l) => self.call_lambda(l, &vs),
                    None => CV::other(),
                }
            }
            Code::Call { operands, .. } => {
                let vs: Vec<CV> = operands.iter().map(|e| self.eval(e, env, me)).collect();
                match vs.split_first() {
                    Some((callee, args)) => self.apply(callee, args),
                    None => CV::other(),
                }
            }
            Code::Let { binds, body, .. } => {
                for (slot, value) in binds {
                    let v = self.eval(value, env, me);
                    if let Some(e) = env.get_mut(*slot as usize) {
                        *e = v.clone();
                    }
                    self.write(me, *slot, &v);
                }
                self.eval(body, env, me)
            }
            Code::MakeClosure(l) => {
                let mut held = Vec::new();
                if let Some(lambda) = self.program.lambdas.get(*l as usize) {
                    for &(from, target) in &lambda.captures {
                        let v = match from {
                            CaptureFrom::Slot(s) => {
                                env.get(s as usize).cloned().unwrap_or_default()
                            }
                            CaptureFrom::SelfRef => CV::callable(FnRef::Lambda(me)),
                            CaptureFrom::Param(k) => self.param(k),
                        };
                        self.write(*l, target, &v);
                        held.push(v);
                    }
                }
                // Calling the closure runs its own lambda only: the callables it captured are
                // reached through its slots, not through this value.
                let mut out = CV::holding(&held);
                out.fns = [FnRef::Lambda(*l)].into_iter().collect();
                out
            }
            Code::If(c, t, f) => {
                self.eval(c, env, me);
                let tv = self.eval(t, env, me);
                let fv = self.eval(f, env, me);
                tv.join(&fv)
            }
            Code::Match {
                scrutinee, arms, ..
            } => {
                let sv = self.eval(scrutinee, env, me);
                let mut out = CV::default();
                for (pat, body) in arms {
                    self.bind(me, pat, &sv, env);
                    let v = self.eval(body, env, me);
                    out = out.join(&v);
                }
                out
            }
        }
    }
}

/// Per lambda, per slot: the entry argument the slot always holds, if any. `None` when the
/// analysis cannot see every call.
fn analyze(
    program: &Program,
    entry_lambda: u32,
    n_entry_params: u32,
    weights: &[bool],
) -> Option<Vec<Vec<Option<u32>>>> {
    let n = program.lambdas.len();
    let mut a = Analyzer {
        program,
        slots: program
            .lambdas
            .iter()
            .map(|l| vec![CV::default(); l.n_slots as usize])
            .collect(),
        results: vec![CV::default(); n],
        reached: vec![false; n],
        changed: true,
        lost: false,
        weights,
    };
    for k in 0..n_entry_params {
        a.write(entry_lambda, k, &a.param(k));
    }
    // Every fact only grows, so this terminates; the bound is a guard (then nothing is used).
    let mut rounds = 0;
    while a.changed {
        rounds += 1;
        if rounds > 256 || a.lost {
            return None;
        }
        a.changed = false;
        for l in 0..n {
            if !a.reached.get(l).copied().unwrap_or(false) {
                continue;
            }
            let Some(lambda) = program.lambdas.get(l) else {
                continue;
            };
            let mut env = a.slots.get(l).cloned().unwrap_or_default();
            let r = a.eval(&lambda.body, &mut env, l as u32);
            if let Some(old) = a.results.get_mut(l) {
                let j = old.join(&r);
                if j != *old {
                    *old = j;
                    a.changed = true;
                }
            }
        }
    }
    if a.lost {
        return None;
    }
    Some(
        a.slots
            .iter()
            .map(|l| {
                l.iter()
                    .map(|v| match v.is {
                        Is::Param(k) => Some(k),
                        _ => None,
                    })
                    .collect()
            })
            .collect(),
    )
}

/// Rewrites reads of slots that always hold an entry argument into [`Code::Param`], drops the
/// captures that become dead, and removes such parameters of globals called only directly.
/// Records the entry in [`Program::params_of`].
pub fn bind_entry_params(program: &mut Program, entry: &str, weights: &[bool]) -> ConstReport {
    let mut report = ConstReport::default();
    let Some(&g_entry) = program.global_index.get(entry) else {
        return report;
    };
    let Some(&l_entry) = program.globals.get(g_entry as usize) else {
        return report;
    };
    let n_entry = program
        .lambdas
        .get(l_entry as usize)
        .map_or(0, |l| l.n_params);
    if program.params_of.is_some_and(|g| g != g_entry) {
        return report;
    }
    let Some(mut facts) = analyze(program, l_entry, n_entry, weights) else {
        return report;
    };
    program.params_of = Some(g_entry);
    captures_from_params(program, &mut facts);
    for (l, lambda) in program.lambdas.iter_mut().enumerate() {
        let Some(per_slot) = facts.get(l) else {
            continue;
        };
        lambda.body.visit_mut(&mut |c| {
            if let Code::Slot(s) = c {
                if let Some(Some(k)) = per_slot.get(*s as usize) {
                    *c = Code::Param(*k);
                    report.reads += 1;
                }
            }
        });
        let before = lambda.captures.len();
        lambda
            .captures
            .retain(|(_, target)| !matches!(per_slot.get(*target as usize), Some(Some(_))));
        report.captures += before - lambda.captures.len();
    }
    report.params = remove_dead_params(program, g_entry, &facts);
    report
}

/// A closure's capture reads a slot of the lambda that makes it. Where that slot always holds
/// entry argument `k` in every maker, the capture reads `k` itself (the slot may no longer be
/// set: its own capture or parameter is dropped); otherwise the slot is kept as it is in every
/// maker (its fact is forgotten), so the capture still finds it.
fn captures_from_params(program: &mut Program, facts: &mut [Vec<Option<u32>>]) {
    let mut makers: Vec<Vec<u32>> = vec![Vec::new(); program.lambdas.len()];
    for (l, lambda) in program.lambdas.iter().enumerate() {
        lambda.body.visit(&mut |c| {
            if let Code::MakeClosure(m) = c {
                if let Some(v) = makers.get_mut(*m as usize) {
                    v.push(l as u32);
                }
            }
        });
    }
    let fact = |facts: &[Vec<Option<u32>>], l: u32, s: u32| {
        facts
            .get(l as usize)
            .and_then(|f| f.get(s as usize))
            .copied()
            .flatten()
    };
    for (m, lambda) in program.lambdas.iter_mut().enumerate() {
        let Some(by) = makers.get(m) else {
            continue;
        };
        for (from, _) in &mut lambda.captures {
            let CaptureFrom::Slot(s) = *from else {
                continue;
            };
            let ks: BTreeSet<Option<u32>> = by.iter().map(|&l| fact(facts, l, s)).collect();
            match ks.into_iter().collect::<Vec<_>>().as_slice() {
                [Some(k)] => *from = CaptureFrom::Param(*k),
                _ => {
                    for &l in by {
                        if let Some(f) = facts
                            .get_mut(l as usize)
                            .and_then(|f| f.get_mut(s as usize))
                        {
                            *f = None;
                        }
                    }
                }
            }
        }
    }
}

/// Removes parameters that always hold an entry argument (now never read) from globals that are
/// only ever called directly, with the argument at each call site.
fn remove_dead_params(
    program: &mut Program,
    g_entry: u32,
    facts: &[Vec<Option<u32>>],
) -> Vec<(String, u32)> {
    // Globals referenced as values (called through closures): their arity must stay.
    let mut as_value = BTreeSet::new();
    // Lambdas made by more than one lambda's code: renumbering one maker's slots would break the
    // others' captures.
    let mut makers: Vec<BTreeSet<u32>> = vec![BTreeSet::new(); program.lambdas.len()];
    // Call sites whose argument in a removable position is not a plain read (it may have effects).
    let mut impure: BTreeSet<(u32, u32)> = BTreeSet::new();
    for (l, lambda) in program.lambdas.iter().enumerate() {
        lambda.body.visit(&mut |c| match c {
            Code::Global(g) => {
                as_value.insert(*g);
            }
            Code::MakeClosure(m) => {
                if let Some(s) = makers.get_mut(*m as usize) {
                    s.insert(l as u32);
                }
            }
            Code::CallGlobal { global, args, .. } => {
                for (i, a) in args.iter().enumerate() {
                    if !matches!(a, Code::Param(_)) {
                        impure.insert((*global, i as u32));
                    }
                }
            }
            _ => {}
        });
    }
    let mut removed = Vec::new();
    for g in 0..program.globals.len() as u32 {
        if g == g_entry || as_value.contains(&g) {
            continue;
        }
        let Some(&l) = program.globals.get(g as usize) else {
            continue;
        };
        let Some(lambda) = program.lambdas.get(l as usize) else {
            continue;
        };
        let made_here: Vec<u32> = makers
            .iter()
            .enumerate()
            .filter(|(_, m)| m.contains(&l))
            .map(|(i, _)| i as u32)
            .collect();
        if made_here
            .iter()
            .any(|&m| makers.get(m as usize).is_some_and(|s| s.len() > 1))
        {
            continue;
        }
        let per_slot = facts.get(l as usize).cloned().unwrap_or_default();
        // Highest first: removing a parameter renumbers only the slots above it.
        let dead: Vec<u32> = (0..lambda.n_params)
            .rev()
            .filter(|&p| {
                matches!(per_slot.get(p as usize), Some(Some(_))) && !impure.contains(&(g, p))
            })
            .collect();
        if dead.is_empty() {
            continue;
        }
        let name = lambda.name.clone();
        for &p in &dead {
            remove_param(program, g, l, p, &made_here);
            removed.push((name.clone(), p));
        }
    }
    removed
}

/// Removes parameter `p` of global `g` (lambda `l`): slots above `p` move down by one, in `l`'s
/// code and in the captures of the closures it makes (`made`), and every direct call drops its
/// argument `p`.
fn remove_param(program: &mut Program, g: u32, l: u32, p: u32, made: &[u32]) {
    if let Some(lambda) = program.lambdas.get_mut(l as usize) {
        lambda.remove_unread_param(p);
    }
    for &m in made {
        if let Some(closure) = program.lambdas.get_mut(m as usize) {
            for (from, _) in &mut closure.captures {
                if let CaptureFrom::Slot(s) = from {
                    if *s > p {
                        *s -= 1;
                    }
                }
            }
        }
    }
    for lambda in &mut program.lambdas {
        lambda.body.visit_mut(&mut |c| {
            if let Code::CallGlobal { global, args, .. } = c {
                if *global == g && (p as usize) < args.len() {
                    args.remove(p as usize);
                }
            }
        });
    }
}
