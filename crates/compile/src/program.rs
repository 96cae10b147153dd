//! The executable program (the IR the executors and the static passes share): the typed module
//! with names resolved to frame slots, globals and constructors to indices, closures converted
//! (captures listed explicitly) and literals pre-built, so the evaluation loop does no name
//! lookups. [`crate::lower`] makes it from a typed module; [`crate::verify`] states its
//! invariants; `Display` ([`crate::print`]) prints it for snapshots and `explain`.

use std::collections::HashMap;
use tumble_ir::{Attrs, Span};
use tumble_ops::OpDef;
use tumble_tensor::Tensor;

use crate::blocks::Block;

#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub enum Code {
    Slot(u32),
    /// The closure being run (a let-bound function calling itself).
    SelfRef,
    Global(u32),
    /// A constructor used as a value: a field-less one is the value itself, others are functions.
    Ctor(u32),
    Lit(Tensor),
    /// Argument `k` of the run's entry function ([`Program::params_of`]): a model weight read
    /// where the program would otherwise have passed it down as an argument or captured it
    /// ([`crate::consts`]).
    Param(u32),
    Tuple(Vec<Code>),
    Proj(Box<Code>, u32, Span),
    CallOp {
        #[serde(with = "tumble_ops::by_name")]
        op: &'static OpDef,
        args: Vec<Code>,
        attrs: Attrs,
        span: Span,
    },
    CallCtor {
        ctor: u32,
        args: Vec<Code>,
    },
    CallGlobal {
        global: u32,
        args: Vec<Code>,
        /// The call, for the call trace of a run-time error inside the callee.
        span: Span,
    },
    /// `operands[0]` is the callee, the rest are the arguments.
    Call {
        operands: Vec<Code>,
        span: Span,
    },
    Let {
        binds: Vec<(u32, Code)>,
        body: Box<Code>,
        /// `(i, slot)`: the slot is cleared once bind `i` is made — its value read for the last
        /// time by then on every path ([`crate::drops`]), so the frame stops holding it (an
        /// early release can free a launch output it named). Sorted by `i`; empty until that
        /// pass, which runs last.
        drops: Vec<(u32, u32)>,
    },
    /// Index into [`Program::lambdas`].
    MakeClosure(u32),
    /// Runs static block `block` on the evaluated `args` (see [`Program::blocks`]). `site` indexes
    /// [`Program::sites`], where the static analyses record what they found about this call.
    InvokeBlock {
        block: u32,
        site: u32,
        args: Vec<Code>,
        span: Span,
    },
    /// Ghost operators (ACROBAT §4.1, Fig. 3): advance the instance's inline depth by `n` as if `n`
    /// blocks had run, then evaluate the body. Inserted in the shorter arms of a conditional so that
    /// what follows lines up at the same depth whichever arm an instance took.
    Ghost(u32, Box<Code>),
    /// `db.phase_change()`: a program-phase boundary (ACROBAT §4.1). The batching runtime holds each
    /// instance here until every instance has finished the phase; elsewhere it is `()`.
    Phase,
    /// `db.concurrent((e1, ..., en))`: the elements are independent, so the executors give each the
    /// same starting inline depth (ACROBAT §4.1); the value is the tuple.
    Concurrent(Vec<Code>),
    If(Box<Code>, Box<Code>, Box<Code>),
    Match {
        scrutinee: Box<Code>,
        arms: Vec<(Pat, Code)>,
        span: Span,
    },
}

/// The one place that knows where `Code` nests: a match calling `$f` on each child of `$code`,
/// iterating child lists with `$iter` (`iter` or `iter_mut`), for the shared and the mutable walk.
macro_rules! code_children {
    ($code:expr, $f:ident, $iter:ident) => {
        match $code {
            Code::Slot(_)
            | Code::SelfRef
            | Code::Global(_)
            | Code::Ctor(_)
            | Code::Lit(_)
            | Code::Param(_)
            | Code::MakeClosure(_)
            | Code::Phase => {}
            Code::Ghost(_, b) | Code::Proj(b, _, _) => $f(b),
            Code::Tuple(es)
            | Code::Concurrent(es)
            | Code::CallOp { args: es, .. }
            | Code::CallCtor { args: es, .. }
            | Code::CallGlobal { args: es, .. }
            | Code::InvokeBlock { args: es, .. }
            | Code::Call { operands: es, .. } => es.$iter().for_each($f),
            Code::Let { binds, body, .. } => {
                binds.$iter().for_each(|(_, v)| $f(v));
                $f(body);
            }
            Code::If(a, b, c) => {
                $f(a);
                $f(b);
                $f(c);
            }
            Code::Match {
                scrutinee, arms, ..
            } => {
                $f(scrutinee);
                arms.$iter().for_each(|(_, b)| $f(b));
            }
        }
    };
}

impl Code {
    /// Calls `f` on each piece of code directly inside this one (not into other functions'
    /// bodies).
    pub fn for_each_child<'a>(&'a self, mut f: impl FnMut(&'a Code)) {
        code_children!(self, f, iter)
    }

    /// [`Code::for_each_child`], mutably (same order).
    pub fn for_each_child_mut<'a>(&'a mut self, mut f: impl FnMut(&'a mut Code)) {
        code_children!(self, f, iter_mut)
    }

    /// Calls `f` on this code and everything inside it, iteratively (no recursion on the Rust
    /// stack however deep the code nests).
    pub fn visit(&self, f: &mut impl FnMut(&Code)) {
        let mut stack = vec![self];
        while let Some(c) = stack.pop() {
            f(c);
            c.for_each_child(|k| stack.push(k));
        }
    }

    /// [`Code::visit`], mutably, in the same order.
    pub fn visit_mut(&mut self, f: &mut impl FnMut(&mut Code)) {
        let mut stack = vec![self];
        while let Some(c) = stack.pop() {
            f(c);
            c.for_each_child_mut(|k| stack.push(k));
        }
    }
}

/// The slots a `let` clears once its bind `i` is made, from its `drops` ([`Code::Let`]: sorted
/// by binding, so one binding's entries are a run, found by bisection — the evaluator asks at
/// every binding of a long chain).
pub fn dropped_after(drops: &[(u32, u32)], i: usize) -> impl Iterator<Item = u32> + '_ {
    let first = drops.partition_point(|&(at, _)| (at as usize) < i);
    drops
        .get(first..)
        .unwrap_or_default()
        .iter()
        .take_while(move |&&(at, _)| at as usize == i)
        .map(|&(_, slot)| slot)
}

/// Does `code` call, reference as a value, or make a closure of a lambda flagged in `lambdas`
/// (indexed like [`Program::lambdas`]; `globals` maps globals to their lambdas)? The call-graph
/// question the automatic phases and the concurrency pass ask of one piece of code, with
/// [`lambdas_reaching`]'s answer per lambda.
pub fn code_reaches(code: &Code, lambdas: &[bool], globals: &[u32]) -> bool {
    let flagged = |l: u32| lambdas.get(l as usize) == Some(&true);
    let mut found = false;
    code.visit(&mut |c| match c {
        Code::CallGlobal { global, .. } | Code::Global(global) => {
            found |= globals.get(*global as usize).is_some_and(|&l| flagged(l));
        }
        Code::MakeClosure(l) => found |= flagged(*l),
        _ => {}
    });
    found
}

/// Per lambda: does it, or anything it may call or create (globals it references, closures it
/// makes, transitively), contain code for which `direct` holds? Call-graph reachability shared by
/// the automatic phases and code duplication.
pub fn lambdas_reaching(program: &Program, direct: impl Fn(&Code) -> bool) -> Vec<bool> {
    lambdas_reaching_past(program, direct, |_| false)
}

/// [`lambdas_reaching`], where a call of a global for which `opaque` holds does not reach what
/// its body does (a native prelude function's body never runs where it is called); its uses as
/// a value still do.
pub fn lambdas_reaching_past(
    program: &Program,
    direct: impl Fn(&Code) -> bool,
    opaque: impl Fn(u32) -> bool,
) -> Vec<bool> {
    let n = program.lambdas.len();
    let mut reach = vec![false; n];
    let mut edges: Vec<Vec<u32>> = vec![Vec::new(); n];
    for (i, l) in program.lambdas.iter().enumerate() {
        l.body.visit(&mut |c| {
            reach[i] |= direct(c);
            match c {
                Code::CallGlobal { global, .. } if opaque(*global) => {}
                Code::CallGlobal { global, .. } | Code::Global(global) => {
                    if let Some(&t) = program.globals.get(*global as usize) {
                        edges[i].push(t);
                    }
                }
                Code::MakeClosure(t) => edges[i].push(*t),
                _ => {}
            }
        });
    }
    let mut changed = true;
    while changed {
        changed = false;
        for i in 0..n {
            if !reach[i]
                && edges[i]
                    .iter()
                    .any(|&t| reach.get(t as usize) == Some(&true))
            {
                reach[i] = true;
                changed = true;
            }
        }
    }
    reach
}

#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub enum Pat {
    Wild,
    Bind(u32),
    Ctor(u32, Vec<Pat>),
    Tuple(Vec<Pat>),
}

impl Pat {
    /// Calls `f` on every slot the pattern binds.
    pub fn for_each_slot(&self, f: &mut impl FnMut(u32)) {
        match self {
            Pat::Wild => {}
            Pat::Bind(s) => f(*s),
            Pat::Ctor(_, ps) | Pat::Tuple(ps) => ps.iter().for_each(|q| q.for_each_slot(f)),
        }
    }

    /// [`Pat::for_each_slot`], mutably (for renumbering).
    pub fn for_each_slot_mut(&mut self, f: &mut impl FnMut(&mut u32)) {
        match self {
            Pat::Wild => {}
            Pat::Bind(s) => f(s),
            Pat::Ctor(_, ps) | Pat::Tuple(ps) => ps.iter_mut().for_each(|q| q.for_each_slot_mut(f)),
        }
    }
}

/// One block-invocation site of the program and what the static analyses concluded about it.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct Site {
    pub block: u32,
    pub span: Span,
    /// Static hoisting (ACROBAT §4.1, appendix A): the invocation does not depend on recursive state,
    /// so it is scheduled by its dataflow depth alone, batching across all positions and instances.
    pub hoisted: bool,
    /// The call whose callee's body this invocation was copied from ([`crate::inline_leaves`]):
    /// a run-time error here names that call, as it would have from the callee's frame.
    pub inlined_from: Option<Span>,
}

#[derive(Debug, Clone, Copy, serde::Serialize, serde::Deserialize)]
pub enum CaptureFrom {
    Slot(u32),
    SelfRef,
    /// Argument `k` of the entry function (see [`Code::Param`]).
    Param(u32),
}

/// A function body with its frame layout: parameters occupy slots `0..n_params`, captured values the
/// slots listed in `captures`, and every let/pattern variable a slot of its own.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct Lambda {
    pub name: String,
    pub n_params: u32,
    pub n_slots: u32,
    pub captures: Vec<(CaptureFrom, u32)>,
    pub body: Code,
}

impl Lambda {
    /// Removes parameter `p`, which no code reads any more: the slots above it move down by one
    /// in this lambda's code. Closures this lambda makes capture its slots by number, and calls
    /// pass the argument: the caller fixes those.
    pub fn remove_unread_param(&mut self, p: u32) {
        let mut shift = |s: &mut u32| {
            if *s > p {
                *s -= 1;
            }
        };
        self.n_params -= 1;
        self.n_slots -= 1;
        self.body.visit_mut(&mut |c| match c {
            Code::Slot(s) => shift(s),
            Code::Let { binds, drops, .. } => {
                binds.iter_mut().for_each(|(s, _)| shift(s));
                drops.iter_mut().for_each(|(_, s)| shift(s));
            }
            Code::Match { arms, .. } => arms
                .iter_mut()
                .for_each(|(pat, _)| pat.for_each_slot_mut(&mut shift)),
            _ => {}
        });
    }
}

#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct CtorEntry {
    pub name: String,
    pub adt: String,
    pub arity: usize,
}

/// A prelude list function the evaluator runs as one native step instead of interpreting its
/// body: they only rebuild list cells (no tensors, no closures, no blocks), and interpreted they
/// cost a match, a call and a constructor per element — BiRNN's two `@rev`s and `@zip` were a
/// third of its host program's steps; a chart read with `@nth` per split point spent 3 million
/// host-scalar invocations on its indices.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum Native {
    /// `@hd(xs)`: the first element; an error on `Nil`.
    Hd,
    /// `@tl(xs)`: all but the first element; an error on `Nil`.
    Tl,
    /// `@zip(xs, ys)`: pairs, as long as the shorter list.
    Zip,
    /// `@rev(xs)`.
    Rev,
    /// `@concat(xs, ys)`: xs then ys.
    Concat,
    /// `@nth(xs, n)`: element `n`; an error past the end. Native only where `n` is a value at
    /// hand (not one a launch has yet to compute).
    Nth,
    /// `@update(xs, n, v)`: `xs` with element `n` replaced by `v`; an error past the end.
    Update,
    /// `@length(xs)`: the number of elements, an `int32` scalar.
    Length,
}

impl Native {
    const ALL: [Native; 8] = [
        Native::Hd,
        Native::Tl,
        Native::Zip,
        Native::Rev,
        Native::Concat,
        Native::Nth,
        Native::Update,
        Native::Length,
    ];

    /// The native form of prelude global `name`.
    pub fn of_prelude(name: &str) -> Option<Native> {
        Native::ALL.into_iter().find(|n| n.name() == name)
    }

    /// How many arguments it takes.
    pub fn arity(self) -> usize {
        match self {
            Native::Hd | Native::Tl | Native::Rev | Native::Length => 1,
            Native::Zip | Native::Concat | Native::Nth => 2,
            Native::Update => 3,
        }
    }

    /// The operand that is an element index, whose value the native step needs at hand.
    pub fn index_operand(self) -> Option<usize> {
        match self {
            Native::Nth | Native::Update => Some(1),
            _ => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Native::Hd => "hd",
            Native::Tl => "tl",
            Native::Zip => "zip",
            Native::Rev => "rev",
            Native::Concat => "concat",
            Native::Nth => "nth",
            Native::Update => "update",
            Native::Length => "length",
        }
    }
}

/// The list constructors and which globals run natively ([`Native`]).
#[derive(Debug, Clone, Default, serde::Serialize, serde::Deserialize)]
pub struct Natives {
    /// Per global index: its native form, if it has one.
    pub by_global: Vec<Option<Native>>,
    /// The constructors `Cons` and `Nil` of the prelude's `List`.
    pub cons: u32,
    pub nil: u32,
    /// The evaluator's shortcuts, which change the number of evaluation steps and nothing else:
    /// `let %r = db.concurrent((e1, .., en)); C(%r.0, .., %r.n-1)` — the prelude's `@map` step,
    /// kept by its specialized copies — runs as one constructor whose operands are evaluated
    /// concurrently (each from the same inline depth), without the tuple, the slot and the
    /// projections; and a block invocation whose operands are all variables, fields of them or
    /// literals, bound by a `let` or passed as an operand or a cell's element, is performed
    /// where it is read instead of in steps of its own, as is a native prelude call (`@hd`,
    /// `@tl`, ..) of such operands.
    pub fast_steps: bool,
    /// Per global: it has the shape of the prelude's `@map` and the evaluator runs it as a loop
    /// over the list ([`crate::map_loop`]; found with the fast steps on, after the static passes).
    pub map_loops: Vec<Option<MapLoop>>,
    /// Per global: it has the shape of the prelude's `@foldl` and the evaluator runs it as a loop
    /// over the list ([`crate::map_loop::find_folds`]; with the fast steps on, after the passes).
    pub fold_loops: Vec<Option<FoldLoop>>,
    /// Per global: it has the shape of a scan (an RNN over a list returning the list of its
    /// states) and the evaluator runs it as a loop over the list ([`crate::map_loop::find_scans`];
    /// with the fast steps on, after the passes).
    pub scan_loops: Vec<Option<ScanLoop>>,
}

/// What the evaluator needs of a function run as a loop over a list ([`crate::map_loop`]); its
/// element code is at a fixed place in the body ([`crate::map_loop::elem_of`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct MapLoop {
    /// The parameter holding the list.
    pub list: u32,
    /// The slot the element is bound to while the element code runs.
    pub elem_slot: u32,
    /// Ghost operators around the final `Nil` (0 when none).
    pub nil_ghosts: u32,
}

/// What the evaluator needs of a function run as a left fold over a list
/// ([`crate::map_loop::find_folds`]); its step code is at a fixed place in the body
/// ([`crate::map_loop::fold_step_of`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct FoldLoop {
    /// The parameter holding the list.
    pub list: u32,
    /// The parameter holding the accumulator (the step's value replaces it per element).
    pub acc: u32,
    /// The slot the element is bound to while the step code runs.
    pub elem_slot: u32,
    /// Ghost operators around the final `Nil` arm's accumulator (0 when none).
    pub nil_ghosts: u32,
}

/// What the evaluator needs of a function run as a scan over a list
/// ([`crate::map_loop::find_scans`]); its step's `let` bindings are at a fixed place in the
/// body ([`crate::map_loop::scan_binds_of`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ScanLoop {
    /// The parameter holding the list.
    pub list: u32,
    /// The parameter holding the state (replaced per element by `next`).
    pub acc: u32,
    /// The slot the element is bound to while the step's bindings run.
    pub elem_slot: u32,
    /// The output list's element and the next state: a slot the step's bindings set, whole
    /// (`None`) or its field `i` (`Some((i, span of the projection))`).
    pub head: (u32, Option<(u32, Span)>),
    pub next: (u32, Option<(u32, Span)>),
    /// Ghost operators around the final `Nil` (0 when none).
    pub nil_ghosts: u32,
}

impl Natives {
    /// The native form of a call of global `g`, if any.
    pub fn of(&self, g: u32) -> Option<Native> {
        self.by_global.get(g as usize).copied().flatten()
    }

    /// How global `g` runs as a loop, if it does ([`Natives::map_loops`]).
    pub fn map_loop(&self, g: u32) -> Option<MapLoop> {
        self.map_loops.get(g as usize).copied().flatten()
    }

    /// Whether global `g` runs as a loop.
    pub fn is_map_loop(&self, g: u32) -> bool {
        self.map_loop(g).is_some()
    }

    /// How global `g` runs as a scan, if it does ([`Natives::scan_loops`]).
    pub fn scan_loop(&self, g: u32) -> Option<ScanLoop> {
        self.scan_loop_ref(g).copied()
    }

    /// [`Natives::scan_loop`] by reference (the evaluator keeps it in its continuations).
    pub fn scan_loop_ref(&self, g: u32) -> Option<&ScanLoop> {
        self.scan_loops.get(g as usize).and_then(Option::as_ref)
    }

    /// How global `g` runs as a left fold, if it does ([`Natives::fold_loops`]).
    pub fn fold_loop(&self, g: u32) -> Option<FoldLoop> {
        self.fold_loops.get(g as usize).copied().flatten()
    }
}

impl Program {
    /// Per lambda, the slots of the enclosing frame its closures capture (what making one
    /// reads there).
    pub fn slot_captures(&self) -> Vec<Vec<u32>> {
        self.lambdas
            .iter()
            .map(|l| {
                l.captures
                    .iter()
                    .filter_map(|(from, _)| match from {
                        CaptureFrom::Slot(s) => Some(*s),
                        CaptureFrom::Param(_) | CaptureFrom::SelfRef => None,
                    })
                    .collect()
            })
            .collect()
    }

    /// The entry function [`Code::Param`] reads the arguments of.
    pub fn entry_lambda(&self) -> Option<&Lambda> {
        let g = self.params_of?;
        let l = *self.globals.get(g as usize)?;
        self.lambdas.get(l as usize)
    }

    /// The number of derived parameters ([`Program::derived`]).
    pub fn derived_count(&self) -> u32 {
        self.derived
            .iter()
            .map(|d| d.block.outputs.len() as u32)
            .sum()
    }

    /// Per lambda: whether global `entry`'s body reaches it through calls, global references
    /// and closures; a global for which `opaque` holds is not entered (a native's body does not
    /// run).
    pub fn reached_from(&self, entry: Option<u32>, opaque: impl Fn(u32) -> bool) -> Vec<bool> {
        let lambda_of = |g: u32| self.globals.get(g as usize).copied();
        let mut reached = vec![false; self.lambdas.len()];
        let mut stack: Vec<u32> = entry.and_then(lambda_of).into_iter().collect();
        while let Some(l) = stack.pop() {
            match reached.get_mut(l as usize) {
                Some(r) if !*r => *r = true,
                _ => continue,
            }
            if let Some(lambda) = self.lambdas.get(l as usize) {
                lambda.body.visit(&mut |c| match c {
                    Code::CallGlobal { global, .. } | Code::Global(global) if !opaque(*global) => {
                        stack.extend(lambda_of(*global));
                    }
                    Code::MakeClosure(m) => stack.push(*m),
                    _ => {}
                });
            }
        }
        reached
    }

    /// Drops the native form of every global whose parameters no longer match it.
    pub fn prune_natives(&mut self) {
        for (g, slot) in self.natives.by_global.iter_mut().enumerate() {
            let params = self
                .globals
                .get(g)
                .and_then(|&l| self.lambdas.get(l as usize))
                .map(|l| l.n_params as usize);
            if slot.is_some_and(|n| params != Some(n.arity())) {
                *slot = None;
            }
        }
    }
}

#[derive(Debug, serde::Serialize, serde::Deserialize)]
pub struct Program {
    /// Every function body: globals and lambdas alike.
    pub lambdas: Vec<Lambda>,
    /// Global index → index into `lambdas`.
    pub globals: Vec<u32>,
    #[serde(serialize_with = "tumble_ir::serial::sorted")]
    pub global_index: HashMap<String, u32>,
    pub ctors: Vec<CtorEntry>,
    #[serde(serialize_with = "tumble_ir::serial::sorted")]
    pub ctor_index: HashMap<String, u32>,
    /// Static blocks referenced by `Code::InvokeBlock` (empty without coarsening).
    pub blocks: Vec<Block>,
    /// Every `Code::InvokeBlock` site, by its `site` index.
    pub sites: Vec<Site>,
    /// Why `Primitive=1` functions could not become blocks (they run as ordinary code instead).
    pub notes: Vec<(Span, String)>,
    /// Input-less operator work computed at compile time (constant folding), for `explain`.
    pub folded: Vec<Span>,
    /// Functions whose calls join their caller's block (see [`crate::inline`]), sorted, for
    /// `explain`.
    pub inlined: Vec<String>,
    /// The global whose arguments [`Code::Param`] reads (set by [`crate::consts`]); an executor
    /// keeps the arguments it starts this global with.
    pub params_of: Option<u32>,
    /// Prelude functions evaluated natively (empty: all interpreted).
    pub natives: Natives,
    /// Weight transforms computed once per run ([`crate::derived`]): their outputs are entry
    /// arguments numbered after the entry's own, in order.
    pub derived: Vec<crate::derived::Derived>,
}
