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

use crate::blocks::{BArg, BVal, Block};
use crate::program::{CaptureFrom, Code, Lambda, Pat, Program};
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
    for (g, native) in program.natives.by_global.iter().enumerate() {
        let Some(native) = native else { continue };
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
    for (i, lambda) in program.lambdas.iter().enumerate() {
        v.place = format!("function `{}` (lambda {i})", lambda.name);
        v.lambda(lambda);
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

    fn lambda(&mut self, lambda: &Lambda) {
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
        // `visit` walks iteratively: bodies can nest deeply.
        lambda.body.visit(&mut |code| {
            self.code(code, lambda.n_slots);
            match code {
                Code::Let { binds, .. } => {
                    for (slot, _) in binds {
                        self.slot(*slot, lambda.n_slots, "bound by a `let`");
                    }
                }
                Code::Match { arms, .. } => {
                    for (pat, _) in arms {
                        self.pat(pat, lambda.n_slots);
                    }
                }
                _ => {}
            }
        });
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
