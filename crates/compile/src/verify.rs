//! The IR verifier: the invariants of a lowered [`Program`] that the executors rely on, checked
//! in one place (as cranelift's verifier checks its IR) instead of being re-checked defensively at
//! run time. It runs after lowering and after every static pass in debug builds (so every test
//! runs it), and on demand through [`verify`].
//!
//! What it checks:
//! - every index is in range: globals, lambdas, constructors, blocks, sites, frame slots;
//! - frames: parameters and captured values fit the frame, capture targets are distinct and
//!   are not parameters, a closure's captured sources exist in the frame that makes it;
//! - arities: constructor calls and patterns match the constructor's field count, operator calls
//!   the operator's arity, block invocations the block's inputs, and each site is invoked for
//!   the block it was recorded for;
//! - blocks: nodes refer only to inputs and earlier nodes, projections only to fields of tuple
//!   results, outputs to existing values, operator arities match.

use std::fmt;

use crate::blocks::{value_ty, BArg, BVal, Block};
use crate::program::{CaptureFrom, Code, Lambda, Pat, Program};
use crate::slot_set::SlotSet;
use tumble_ir::Ty;

/// One broken invariant: where (a function or block) and what.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VerifyError {
    pub place: String,
    pub message: String,
}

impl fmt::Display for VerifyError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.place, self.message)
    }
}

/// [`verify`], and what holds of a finished program only (one read back from a compiled file):
/// a global with a native form takes the native's arguments — between the static passes a
/// global's parameters can change before its native form is dropped.
pub fn verify_finished(program: &Program) -> Vec<VerifyError> {
    let mut errors = verify(program);
    let natives = &program.natives;
    // The loop tables are made after the static passes, one entry per global (or none); the
    // natives' is made at lowering, before passes that add globals, so it may be shorter.
    if natives.by_global.len() > program.globals.len() {
        errors.push(VerifyError {
            place: "program".into(),
            message: format!(
                "the table of functions that run natively has {} entries for {} globals",
                natives.by_global.len(),
                program.globals.len()
            ),
        });
    }
    let tables = [
        ("map loops", natives.map_loops.len()),
        ("fold loops", natives.fold_loops.len()),
        ("scan loops", natives.scan_loops.len()),
    ];
    for (what, len) in tables {
        if len != 0 && len != program.globals.len() {
            errors.push(VerifyError {
                place: "program".into(),
                message: format!(
                    "the table of {what} has {len} entries for {} globals",
                    program.globals.len()
                ),
            });
        }
    }
    let loops = natives.map_loops.iter().any(Option::is_some)
        || natives.fold_loops.iter().any(Option::is_some)
        || natives.scan_loops.iter().any(Option::is_some);
    if loops || natives.by_global.iter().any(Option::is_some) {
        for (name, at) in [("Cons", natives.cons), ("Nil", natives.nil)] {
            if program.ctor_index.get(name) != Some(&at) {
                errors.push(VerifyError {
                    place: "program".into(),
                    message: format!(
                        "the native list functions take constructor {at} for `{name}`, which is \
                         not the prelude's `{name}`"
                    ),
                });
            }
        }
    }
    for (g, native) in program.natives.by_global.iter().enumerate() {
        let Some(native) = native else { continue };
        // Only the prelude's own function of the native's name (or a copy of it, `hd#2`) runs
        // natively: `@hd` running as `@tl` would return another value of the same type.
        let named = program.global_index.get(native.name()) == Some(&(g as u32))
            || program
                .globals
                .get(g)
                .and_then(|&l| program.lambdas.get(l as usize))
                .is_some_and(|l| {
                    l.name
                        .strip_prefix(native.name())
                        .is_some_and(|rest| rest.starts_with('#'))
                });
        if !named {
            errors.push(VerifyError {
                place: format!("global {g}"),
                message: format!(
                    "runs natively as `@{}`, but is not the prelude's `@{}`",
                    native.name(),
                    native.name()
                ),
            });
        }
        let lambda = program
            .globals
            .get(g)
            .and_then(|&l| program.lambdas.get(l as usize));
        match lambda {
            Some(l) if l.n_params as usize != native.arity() => errors.push(VerifyError {
                place: format!("function `{}`", l.name),
                message: format!(
                    "runs natively as `@{}`, which takes {} arguments, but takes {}",
                    native.name(),
                    native.arity(),
                    l.n_params
                ),
            }),
            Some(_) => {}
            None => errors.push(VerifyError {
                place: format!("global {g}"),
                message: "has a native form but no function".into(),
            }),
        }
    }
    errors
}

/// Every broken invariant of `program` (empty: it is well formed).
pub fn verify(program: &Program) -> Vec<VerifyError> {
    let mut v = Verifier {
        program,
        errors: Vec::new(),
        place: String::new(),
    };
    v.program_tables();
    let mut global = vec![false; program.lambdas.len()];
    for &l in &program.globals {
        if let Some(g) = global.get_mut(l as usize) {
            *g = true;
        }
    }
    for (i, lambda) in program.lambdas.iter().enumerate() {
        v.place = format!("function `{}` (lambda {i})", lambda.name);
        v.lambda(lambda, global[i]);
    }
    for (i, block) in program.blocks.iter().enumerate() {
        v.place = format!("block `{}` (block {i})", block.name);
        v.block(block);
    }
    v.errors
}

/// Panics with every broken invariant when `program` is malformed: a bug in the compiler, never
/// in the user's program. Called after lowering and after each pass in debug builds only.
pub(crate) fn debug_check(program: &Program, after: &str) {
    if cfg!(debug_assertions) {
        let errors = verify(program);
        assert!(
            errors.is_empty(),
            "internal: the IR verifier found {} problem(s) after {after}:\n{}",
            errors.len(),
            errors
                .iter()
                .map(ToString::to_string)
                .collect::<Vec<_>>()
                .join("\n")
        );
    }
}

struct Verifier<'p> {
    program: &'p Program,
    errors: Vec<VerifyError>,
    place: String,
}

impl Verifier<'_> {
    fn fail(&mut self, message: String) {
        self.errors.push(VerifyError {
            place: self.place.clone(),
            message,
        });
    }

    fn program_tables(&mut self) {
        let p = self.program;
        self.place = "program".into();
        for (g, &l) in p.globals.iter().enumerate() {
            if l as usize >= p.lambdas.len() {
                self.fail(format!(
                    "global {g} names lambda {l}, but there are {}",
                    p.lambdas.len()
                ));
            }
        }
        for (name, &g) in &p.global_index {
            if g as usize >= p.globals.len() {
                self.fail(format!("global `@{name}` has index {g} past the globals"));
            }
        }
        for (name, &c) in &p.ctor_index {
            match p.ctors.get(c as usize) {
                Some(e) if &e.name == name => {}
                Some(e) => self.fail(format!(
                    "constructor `{name}` has index {c}, which is `{}`",
                    e.name
                )),
                None => self.fail(format!("constructor `{name}` has index {c} past the table")),
            }
        }
        for (s, site) in p.sites.iter().enumerate() {
            if site.block as usize >= p.blocks.len() {
                self.fail(format!(
                    "site {s} names block {} past the blocks",
                    site.block
                ));
            }
        }
    }

    /// `global`: the lambda is a global's function, called through its global and never made
    /// as a closure, so it has no closure to refer to (the machine would stop on `SelfRef`
    /// there with an internal error).
    fn lambda(&mut self, lambda: &Lambda, global: bool) {
        if lambda.n_params > lambda.n_slots {
            self.fail(format!(
                "{} parameters in a frame of {} slots",
                lambda.n_params, lambda.n_slots
            ));
        }
        let mut targets: Vec<u32> = Vec::with_capacity(lambda.captures.len());
        for (_, slot) in &lambda.captures {
            if *slot >= lambda.n_slots || *slot < lambda.n_params {
                self.fail(format!(
                    "a captured value goes to slot {slot}, outside slots {}..{} after the parameters",
                    lambda.n_params, lambda.n_slots
                ));
            }
            if targets.contains(slot) {
                self.fail(format!("two captured values go to slot {slot}"));
            }
            targets.push(*slot);
        }
        self.defined_before_read(lambda);
        let mut self_ref = false;
        // `visit` walks iteratively: bodies can nest deeply.
        lambda.body.visit(&mut |code| {
            self.code(code, lambda.n_slots);
            match code {
                Code::Let { binds, drops, .. } => {
                    for (slot, _) in binds {
                        self.slot(*slot, lambda.n_slots, "bound by a `let`");
                    }
                    for &(at, slot) in drops {
                        self.slot(slot, lambda.n_slots, "dropped by a `let`");
                        if at as usize >= binds.len() {
                            self.fail(format!(
                                "a `let` of {} bindings drops slot {slot} after binding {at}",
                                binds.len()
                            ));
                        }
                    }
                    if drops.windows(2).any(|w| w[0].0 > w[1].0) {
                        self.fail("a `let`'s drops are not in binding order".into());
                    }
                }
                Code::Match { arms, .. } => {
                    for (pat, _) in arms {
                        self.pat(pat, lambda.n_slots);
                    }
                }
                Code::SelfRef => self_ref = true,
                _ => {}
            }
        });
        if global && self_ref {
            self.fail("refers to itself as a closure, but is a global function".into());
        }
    }

    /// Every slot `lambda`'s code reads (or a closure it makes captures) has been set on every
    /// path that reaches the read, in evaluation order (operands left to right): a parameter, a
    /// captured value, a `let` binding or a pattern variable evaluated before. A frame keeps its
    /// slots, so a binding counts after its `let` ends too — block formation takes a `let`'s
    /// body out as a later operand (`invoke b with (let $8 = ..; $8), $8.1`) — while one made in
    /// a branch counts after the branch only if every arm made it. Lowering never makes code that
    /// reads a slot otherwise; a damaged compiled file could, and the machine would stop on it
    /// with an internal error. Walked iteratively, like the rest (bodies nest deeply); slots out
    /// of range are reported by the range checks and skipped here.
    fn defined_before_read(&mut self, lambda: &Lambda) {
        enum Work<'c> {
            Code(&'c Code),
            Define(u32),
            /// A `let` drops the slot: a read after it is a read of nothing.
            Undefine(u32),
            /// A conditional's arms start: each starts from the state here.
            BranchBegin,
            /// An arm starts, with its pattern's variables set.
            ArmBegin(Vec<u32>),
            /// An arm ends: what it set is met with what the arms before it set.
            ArmEnd,
            /// The conditional ends: what every arm set stays set.
            BranchEnd,
        }
        struct Branch {
            start: SlotSet,
            every_arm: Option<SlotSet>,
        }
        let n_slots = lambda.n_slots as usize;
        let mut defined = SlotSet::new(n_slots);
        // In the frame and not set (a slot past the frame is the range checks' to report).
        let unset = |d: &SlotSet, s: u32| (s as usize) < n_slots && !d.contains(s);
        for p in 0..lambda.n_params {
            defined.insert(p);
        }
        for (_, s) in &lambda.captures {
            defined.insert(*s);
        }
        let mut branches: Vec<Branch> = Vec::new();
        let mut unset_reads: Vec<u32> = Vec::new();
        let mut work = vec![Work::Code(&lambda.body)];
        let mut children: Vec<&Code> = Vec::new();
        while let Some(w) = work.pop() {
            let code = match w {
                Work::Code(c) => c,
                Work::Define(s) => {
                    defined.insert(s);
                    continue;
                }
                Work::Undefine(s) => {
                    defined.remove(s);
                    continue;
                }
                Work::BranchBegin => {
                    branches.push(Branch {
                        start: defined.clone(),
                        every_arm: None,
                    });
                    continue;
                }
                Work::ArmBegin(slots) => {
                    if let Some(b) = branches.last() {
                        defined.clone_from(&b.start);
                    }
                    slots.into_iter().for_each(|s| defined.insert(s));
                    continue;
                }
                Work::ArmEnd => {
                    if let Some(b) = branches.last_mut() {
                        match &mut b.every_arm {
                            Some(every) => every.meet(&defined),
                            None => b.every_arm = Some(defined.clone()),
                        }
                    }
                    continue;
                }
                Work::BranchEnd => {
                    if let Some(b) = branches.pop() {
                        defined = b.every_arm.unwrap_or(b.start);
                    }
                    continue;
                }
            };
            match code {
                Code::Slot(s) if unset(&defined, *s) => unset_reads.push(*s),
                Code::MakeClosure(l) => {
                    if let Some(l) = self.program.lambdas.get(*l as usize) {
                        for (from, _) in &l.captures {
                            if let CaptureFrom::Slot(s) = from {
                                if unset(&defined, *s) {
                                    unset_reads.push(*s);
                                }
                            }
                        }
                    }
                }
                Code::Let { binds, body, drops } => {
                    work.push(Work::Code(body));
                    for (i, (s, value)) in binds.iter().enumerate().rev() {
                        for d in crate::program::dropped_after(drops, i) {
                            work.push(Work::Undefine(d));
                        }
                        work.push(Work::Define(*s));
                        work.push(Work::Code(value));
                    }
                }
                Code::If(cond, then, otherwise) => {
                    work.push(Work::BranchEnd);
                    for arm in [otherwise, then] {
                        work.push(Work::ArmEnd);
                        work.push(Work::Code(arm));
                        work.push(Work::ArmBegin(Vec::new()));
                    }
                    work.push(Work::BranchBegin);
                    work.push(Work::Code(cond));
                }
                Code::Match {
                    scrutinee, arms, ..
                } => {
                    work.push(Work::BranchEnd);
                    for (pat, arm) in arms.iter().rev() {
                        let mut slots = Vec::new();
                        pat.for_each_slot(&mut |s| slots.push(s));
                        work.push(Work::ArmEnd);
                        work.push(Work::Code(arm));
                        work.push(Work::ArmBegin(slots));
                    }
                    work.push(Work::BranchBegin);
                    work.push(Work::Code(scrutinee));
                }
                _ => {
                    // Operands run left to right: pushed in reverse.
                    children.clear();
                    code.for_each_child(|k| children.push(k));
                    work.extend(children.drain(..).rev().map(Work::Code));
                }
            }
        }
        unset_reads.sort_unstable();
        unset_reads.dedup();
        for s in unset_reads {
            self.fail(format!("slot {s} is read where nothing has set it"));
        }
    }

    fn slot(&mut self, slot: u32, n_slots: u32, what: &str) {
        if slot >= n_slots {
            self.fail(format!(
                "slot {slot} {what}, but the frame has {n_slots} slots"
            ));
        }
    }

    fn global(&mut self, g: u32) {
        if g as usize >= self.program.globals.len() {
            self.fail(format!(
                "global {g} is used, but there are {}",
                self.program.globals.len()
            ));
        }
    }

    fn ctor_arity(&mut self, c: u32) -> Option<usize> {
        match self.program.ctors.get(c as usize) {
            Some(e) => Some(e.arity),
            None => {
                self.fail(format!(
                    "constructor {c} is used, but there are {}",
                    self.program.ctors.len()
                ));
                None
            }
        }
    }

    /// The checks of one code node (its children are visited by the caller).
    fn code(&mut self, code: &Code, n_slots: u32) {
        match code {
            Code::Slot(s) => self.slot(*s, n_slots, "is read"),
            Code::Global(g) => self.global(*g),
            Code::Param(k) => {
                let entry = self.program.params_of.and_then(|g| {
                    let l = *self.program.globals.get(g as usize)?;
                    self.program.lambdas.get(l as usize)
                });
                match entry {
                    None => self.fail(format!(
                        "entry argument {k} is read, but no entry function is recorded"
                    )),
                    Some(e) if *k >= e.n_params + self.program.derived_count() => {
                        self.fail(format!(
                            "entry argument {k} is read, but `{}` takes {} and {} are derived",
                            e.name,
                            e.n_params,
                            self.program.derived_count()
                        ))
                    }
                    Some(_) => {}
                }
            }
            Code::CallGlobal { global, args, .. } => {
                self.global(*global);
                // As its lambda takes (a pass that removes a parameter fixes the calls; a native
                // prelude function's lambda takes what the native does until its parameters
                // change, when the native form is dropped).
                let want = self
                    .program
                    .globals
                    .get(*global as usize)
                    .and_then(|&l| self.program.lambdas.get(l as usize))
                    .map(|l| (l.name.clone(), l.n_params as usize));
                if let Some((name, arity)) = want {
                    if arity != args.len() {
                        self.fail(format!(
                            "`{name}` takes {arity} arguments, called with {}",
                            args.len()
                        ));
                    }
                }
            }
            Code::Ctor(c) => {
                self.ctor_arity(*c);
            }
            Code::CallCtor { ctor, args } => {
                if let Some(arity) = self.ctor_arity(*ctor) {
                    if arity != args.len() {
                        let name = self.program.ctors[*ctor as usize].name.clone();
                        self.fail(format!(
                            "constructor `{name}` takes {arity} fields, called with {}",
                            args.len()
                        ));
                    }
                }
            }
            Code::CallOp { op, args, .. } => {
                if args.len() != op.arity && Some(args.len()) != op.alt_arity {
                    self.fail(format!(
                        "operator `{}` takes {} arguments, called with {}",
                        op.name,
                        op.arity,
                        args.len()
                    ));
                }
            }
            Code::Call { operands, .. } => {
                if operands.is_empty() {
                    self.fail("a call without a callee".into());
                }
            }
            Code::MakeClosure(index) => match self.program.lambdas.get(*index as usize) {
                None => self.fail(format!(
                    "closure of lambda {index}, but there are {}",
                    self.program.lambdas.len()
                )),
                Some(l) => {
                    for (from, _) in &l.captures {
                        match from {
                            CaptureFrom::Slot(s) => {
                                self.slot(*s, n_slots, "is captured by a closure made here")
                            }
                            CaptureFrom::Param(k) => self.code(&Code::Param(*k), n_slots),
                            CaptureFrom::SelfRef => {}
                        }
                    }
                }
            },
            Code::InvokeBlock {
                block, site, args, ..
            } => match self.program.blocks.get(*block as usize) {
                None => self.fail(format!(
                    "block {block} is invoked, but there are {}",
                    self.program.blocks.len()
                )),
                Some(b) => {
                    if b.inputs.len() != args.len() {
                        self.fail(format!(
                            "block `{}` takes {} inputs, invoked with {}",
                            b.name,
                            b.inputs.len(),
                            args.len()
                        ));
                    }
                    match self.program.sites.get(*site as usize) {
                        Some(s) if s.block == *block => {}
                        Some(s) => self.fail(format!(
                            "site {site} was recorded for block {}, but invokes block {block}",
                            s.block
                        )),
                        None => self.fail(format!(
                            "site {site} is used, but there are {}",
                            self.program.sites.len()
                        )),
                    }
                }
            },
            Code::SelfRef
            | Code::Lit(_)
            | Code::Tuple(_)
            | Code::Proj(..)
            | Code::Let { .. }
            | Code::Ghost(..)
            | Code::Phase
            | Code::Concurrent(_)
            | Code::If(..)
            | Code::Match { .. } => {}
        }
    }

    fn pat(&mut self, pat: &Pat, n_slots: u32) {
        let mut stack = vec![pat];
        while let Some(p) = stack.pop() {
            match p {
                Pat::Wild => {}
                Pat::Bind(s) => self.slot(*s, n_slots, "is bound by a pattern"),
                Pat::Ctor(c, ps) => {
                    if let Some(arity) = self.ctor_arity(*c) {
                        if arity != ps.len() {
                            self.fail(format!(
                                "a pattern gives constructor {c} {} fields, it has {arity}",
                                ps.len()
                            ));
                        }
                    }
                    stack.extend(ps);
                }
                Pat::Tuple(ps) => stack.extend(ps),
            }
        }
    }

    fn block(&mut self, block: &Block) {
        let before = self.errors.len();
        for (i, node) in block.nodes.iter().enumerate() {
            let n_args = node.args.len();
            if n_args != node.op.arity && Some(n_args) != node.op.alt_arity {
                self.fail(format!(
                    "node {i} (`{}`) takes {} arguments, has {n_args}",
                    node.op.name, node.op.arity
                ));
            }
            for arg in &node.args {
                match arg {
                    BArg::One(v) => self.bval(block, v, i, &format!("node {i}")),
                    BArg::Tuple(vs) => {
                        for v in vs {
                            self.bval(block, v, i, &format!("node {i}"));
                        }
                    }
                }
            }
        }
        if block.outputs.is_empty() {
            self.fail("the block has no outputs".into());
        }
        for v in &block.outputs {
            self.bval(block, v, block.nodes.len(), "an output");
        }
        if self.errors.len() == before {
            self.node_types(block);
        }
    }

    /// Each node's recorded type is what its operator's type rule gives for the recorded types
    /// of its arguments (up to `?` sizes): a node reading another value, or a type altered in a
    /// compiled file, would otherwise compute something else than the program says, silently.
    /// Run only on a block whose indices are in range (checked before, in [`Verifier::block`]).
    fn node_types(&mut self, block: &Block) {
        let ty_of = |v: &BVal| value_ty(&block.inputs, &block.nodes, v);
        for (i, node) in block.nodes.iter().enumerate() {
            let args: Vec<Ty> = node
                .args
                .iter()
                .map(|a| match a {
                    BArg::One(v) => ty_of(v),
                    BArg::Tuple(vs) => Ty::Tuple(vs.iter().map(ty_of).collect()),
                })
                .collect();
            match (node.op.relation)(&args, &node.attrs) {
                Ok(t) if compatible(&t, &node.ty) => {}
                Ok(t) => self.fail(format!(
                    "node {i} (`{}`) is recorded as {}, but its arguments make it {t}",
                    node.op.name, node.ty
                )),
                Err(e) => self.fail(format!(
                    "node {i} (`{}`) does not apply to its recorded arguments: {}",
                    node.op.name, e.message
                )),
            }
        }
    }

    /// A value read by node `before` (or, with `before == nodes.len()`, by the outputs).
    fn bval(&mut self, block: &Block, v: &BVal, before: usize, reader: &str) {
        match v {
            BVal::Input(i) => {
                if *i as usize >= block.inputs.len() {
                    self.fail(format!(
                        "{reader} reads input {i}, but the block has {}",
                        block.inputs.len()
                    ));
                }
            }
            BVal::Node(n) => {
                if *n as usize >= before {
                    self.fail(format!(
                        "{reader} reads node {n}, which does not come before it"
                    ));
                }
            }
            BVal::Field(n, f) => {
                if *n as usize >= before {
                    self.fail(format!(
                        "{reader} reads a field of node {n}, which does not come before it"
                    ));
                } else if let Some(node) = block.nodes.get(*n as usize) {
                    match &node.ty {
                        Ty::Tuple(ts) if (*f as usize) < ts.len() => {}
                        ty => self.fail(format!(
                            "{reader} reads field {f} of node {n}, whose result is {ty}"
                        )),
                    }
                }
            }
            BVal::Const(_) => {}
        }
    }
}

/// The same type up to `?` sizes: the same tuple structure and dtypes, the same ranks, and each
/// size equal or unknown on either side.
fn compatible(a: &Ty, b: &Ty) -> bool {
    match (a, b) {
        (
            Ty::Tensor {
                shape: sa,
                dtype: da,
            },
            Ty::Tensor {
                shape: sb,
                dtype: db,
            },
        ) => {
            da == db
                && sa.len() == sb.len()
                && sa
                    .iter()
                    .zip(sb)
                    .all(|(x, y)| match (x.known(), y.known()) {
                        (Some(p), Some(q)) => p == q,
                        _ => true,
                    })
        }
        (Ty::Tuple(xs), Ty::Tuple(ys)) => {
            xs.len() == ys.len() && xs.iter().zip(ys).all(|(x, y)| compatible(x, y))
        }
        _ => a == b,
    }
}
