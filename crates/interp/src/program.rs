//! The interpreter's program: the typed module with names resolved to frame slots, globals and
//! constructors to indices, closures converted (captures listed explicitly) and literals pre-built.
//! Lowering once keeps the evaluation loop free of name lookups.

use std::collections::HashMap;
use tumble_check::TypedModule;
use tumble_ir::{Attrs, Expr, ExprKind, Function, Literal, Pattern, PatternKind, Span, Ty};
use tumble_ops::OpDef;
use tumble_tensor::Tensor;

#[derive(Debug)]
pub enum Code {
    Slot(u32),
    /// The closure being run (a let-bound function calling itself).
    SelfRef,
    Global(u32),
    /// A constructor used as a value: a field-less one is the value itself, others are functions.
    Ctor(u32),
    Lit(Tensor),
    Tuple(Vec<Code>),
    Proj(Box<Code>, u32, Span),
    CallOp {
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
    },
    /// `operands[0]` is the callee, the rest are the arguments.
    Call {
        operands: Vec<Code>,
        span: Span,
    },
    Let {
        binds: Vec<(u32, Code)>,
        body: Box<Code>,
    },
    /// Index into [`Program::lambdas`].
    MakeClosure(u32),
    If(Box<Code>, Box<Code>, Box<Code>),
    Match {
        scrutinee: Box<Code>,
        arms: Vec<(Pat, Code)>,
        span: Span,
    },
}

#[derive(Debug)]
pub enum Pat {
    Wild,
    Bind(u32),
    Ctor(u32, Vec<Pat>),
    Tuple(Vec<Pat>),
}

#[derive(Debug, Clone, Copy)]
pub enum CaptureFrom {
    Slot(u32),
    SelfRef,
}

/// A function body with its frame layout: parameters occupy slots `0..n_params`, captured values the
/// slots listed in `captures`, and every let/pattern variable a slot of its own.
#[derive(Debug)]
pub struct Lambda {
    pub name: String,
    pub n_params: u32,
    pub n_slots: u32,
    pub captures: Vec<(CaptureFrom, u32)>,
    pub body: Code,
}

#[derive(Debug, Clone)]
pub struct CtorEntry {
    pub name: String,
    pub adt: String,
    pub arity: usize,
}

#[derive(Debug)]
pub struct Program {
    /// Every function body: globals and lambdas alike.
    pub lambdas: Vec<Lambda>,
    /// Global index → index into `lambdas`.
    pub globals: Vec<u32>,
    pub global_index: HashMap<String, u32>,
    pub ctors: Vec<CtorEntry>,
    pub ctor_index: HashMap<String, u32>,
}

#[derive(Debug, Clone)]
pub struct LowerError {
    pub message: String,
    pub span: Span,
}

impl Program {
    pub fn lower(typed: &TypedModule) -> Result<Program, LowerError> {
        let mut ctors = Vec::new();
        let mut ctor_index = HashMap::new();
        for td in typed.module.type_defs() {
            for c in &td.ctors {
                ctor_index.insert(c.name.name.clone(), ctors.len() as u32);
                ctors.push(CtorEntry {
                    name: c.name.name.clone(),
                    adt: td.name.name.clone(),
                    arity: c.fields.len(),
                });
            }
        }
        let mut global_index = HashMap::new();
        for (i, d) in typed.module.defs().enumerate() {
            global_index.insert(d.name.name.clone(), i as u32);
        }
        let mut lw = Lowerer {
            global_index: &global_index,
            ctor_index: &ctor_index,
            fns: Vec::new(),
            lambdas: Vec::new(),
        };
        let mut globals = Vec::new();
        for d in typed.module.defs() {
            globals.push(lw.function(&d.name.name, &d.func, None)?);
        }
        Ok(Program {
            lambdas: lw.lambdas,
            globals,
            global_index,
            ctors,
            ctor_index,
        })
    }
}

struct FnScope {
    /// Visible names, innermost last.
    names: Vec<(String, u32)>,
    n_slots: u32,
    captures: Vec<(CaptureFrom, u32)>,
    /// The let-bound name of this function, if it may call itself.
    self_name: Option<String>,
}

struct Lowerer<'a> {
    global_index: &'a HashMap<String, u32>,
    ctor_index: &'a HashMap<String, u32>,
    fns: Vec<FnScope>,
    lambdas: Vec<Lambda>,
}

enum Resolved {
    Slot(u32),
    SelfRef,
}

fn err(span: Span, message: impl Into<String>) -> LowerError {
    LowerError {
        message: message.into(),
        span,
    }
}

impl Lowerer<'_> {
    fn function(
        &mut self,
        name: &str,
        func: &Function,
        self_name: Option<String>,
    ) -> Result<u32, LowerError> {
        let mut scope = FnScope {
            names: Vec::new(),
            n_slots: 0,
            captures: Vec::new(),
            self_name,
        };
        for p in &func.params {
            scope.names.push((p.name.name.clone(), scope.n_slots));
            scope.n_slots += 1;
        }
        self.fns.push(scope);
        let body = self.expr(&func.body);
        let scope = self.fns.pop();
        let body = body?;
        let scope = scope.ok_or_else(|| err(func.span, "internal: scope stack underflow"))?;
        self.lambdas.push(Lambda {
            name: name.to_string(),
            n_params: func.params.len() as u32,
            n_slots: scope.n_slots,
            captures: scope.captures,
            body,
        });
        Ok(self.lambdas.len() as u32 - 1)
    }

    /// The current function's scope size and capture count, to pop a block's names afterwards.
    fn mark(&self) -> (usize, usize) {
        self.fns
            .last()
            .map_or((0, 0), |f| (f.names.len(), f.captures.len()))
    }

    /// Drops the names bound since `mark`; captures made meanwhile were inserted at the front and stay.
    fn restore(&mut self, (names, captures): (usize, usize)) {
        if let Some(f) = self.fns.last_mut() {
            let added = f.captures.len() - captures;
            f.names.truncate(names + added);
        }
    }

    fn new_slot(&mut self, name: &str) -> u32 {
        match self.fns.last_mut() {
            Some(f) => {
                let s = f.n_slots;
                f.n_slots += 1;
                f.names.push((name.to_string(), s));
                s
            }
            None => 0,
        }
    }

    /// Finds `name` in function scope `depth`, capturing it from enclosing functions as needed.
    fn resolve(&mut self, name: &str, depth: usize) -> Option<Resolved> {
        let f = self.fns.get(depth)?;
        if let Some((_, s)) = f.names.iter().rev().find(|(n, _)| n == name) {
            return Some(Resolved::Slot(*s));
        }
        if f.self_name.as_deref() == Some(name) {
            return Some(Resolved::SelfRef);
        }
        let outer = self.resolve(name, depth.checked_sub(1)?)?;
        let f = self.fns.get_mut(depth)?;
        let slot = f.n_slots;
        f.n_slots += 1;
        // Captured names sit below every local, so later bindings still shadow them.
        f.names.insert(0, (name.to_string(), slot));
        let from = match outer {
            Resolved::Slot(s) => CaptureFrom::Slot(s),
            Resolved::SelfRef => CaptureFrom::SelfRef,
        };
        f.captures.push((from, slot));
        Some(Resolved::Slot(slot))
    }

    fn exprs(&mut self, es: &[Expr]) -> Result<Vec<Code>, LowerError> {
        es.iter().map(|e| self.expr(e)).collect()
    }

    fn expr(&mut self, e: &Expr) -> Result<Code, LowerError> {
        Ok(match &e.kind {
            ExprKind::Local(n) => {
                let depth = self.fns.len().saturating_sub(1);
                match self.resolve(n, depth) {
                    Some(Resolved::Slot(s)) => Code::Slot(s),
                    Some(Resolved::SelfRef) => Code::SelfRef,
                    None => return Err(err(e.span, format!("unbound variable `%{n}`"))),
                }
            }
            ExprKind::Global(n) => Code::Global(self.global(n, e.span)?),
            ExprKind::Ctor(n) => Code::Ctor(self.ctor(n, e.span)?),
            ExprKind::Op(n) => {
                return Err(err(e.span, format!("operator `{n}` used as a value")));
            }
            ExprKind::Lit(l) => Code::Lit(literal(l)),
            ExprKind::Tuple(es) => Code::Tuple(self.exprs(es)?),
            ExprKind::Proj(inner, i) => Code::Proj(Box::new(self.expr(inner)?), *i, e.span),
            ExprKind::Call(call) => match &call.callee.kind {
                ExprKind::Op(n) => Code::CallOp {
                    op: tumble_ops::lookup(n)
                        .ok_or_else(|| err(call.callee.span, format!("unknown operator `{n}`")))?,
                    args: self.exprs(&call.args)?,
                    attrs: call.attrs.clone(),
                    span: e.span,
                },
                ExprKind::Ctor(n) => Code::CallCtor {
                    ctor: self.ctor(n, call.callee.span)?,
                    args: self.exprs(&call.args)?,
                },
                ExprKind::Global(n) => Code::CallGlobal {
                    global: self.global(n, call.callee.span)?,
                    args: self.exprs(&call.args)?,
                },
                _ => {
                    let mut operands = vec![self.expr(&call.callee)?];
                    operands.extend(self.exprs(&call.args)?);
                    Code::Call {
                        operands,
                        span: e.span,
                    }
                }
            },
            ExprKind::Let(bindings, body) => {
                let mark = self.mark();
                let mut binds = Vec::with_capacity(bindings.len());
                for b in bindings {
                    let value = match &b.value.kind {
                        ExprKind::Fn(func) => Code::MakeClosure(self.function(
                            &format!("%{}", b.var.name.name),
                            func,
                            Some(b.var.name.name.clone()),
                        )?),
                        _ => self.expr(&b.value)?,
                    };
                    let slot = self.new_slot(&b.var.name.name);
                    binds.push((slot, value));
                }
                let body = self.expr(body)?;
                self.restore(mark);
                Code::Let {
                    binds,
                    body: Box::new(body),
                }
            }
            ExprKind::Fn(func) => Code::MakeClosure(self.function("fn", func, None)?),
            ExprKind::If(c, t, f) => Code::If(
                Box::new(self.expr(c)?),
                Box::new(self.expr(t)?),
                Box::new(self.expr(f)?),
            ),
            ExprKind::Match {
                scrutinee, arms, ..
            } => {
                let scrutinee = Box::new(self.expr(scrutinee)?);
                let mut out = Vec::with_capacity(arms.len());
                for arm in arms {
                    let mark = self.mark();
                    let pat = self.pattern(&arm.pattern)?;
                    let body = self.expr(&arm.body)?;
                    self.restore(mark);
                    out.push((pat, body));
                }
                Code::Match {
                    scrutinee,
                    arms: out,
                    span: e.span,
                }
            }
        })
    }

    fn pattern(&mut self, p: &Pattern) -> Result<Pat, LowerError> {
        Ok(match &p.kind {
            PatternKind::Wildcard => Pat::Wild,
            PatternKind::Var(v) => Pat::Bind(self.new_slot(&v.name.name)),
            PatternKind::Ctor { name, args } => Pat::Ctor(
                self.ctor(&name.name, name.span)?,
                args.iter()
                    .map(|a| self.pattern(a))
                    .collect::<Result<_, _>>()?,
            ),
            PatternKind::Tuple(ps) => Pat::Tuple(
                ps.iter()
                    .map(|a| self.pattern(a))
                    .collect::<Result<_, _>>()?,
            ),
        })
    }

    fn global(&self, n: &str, span: Span) -> Result<u32, LowerError> {
        self.global_index
            .get(n)
            .copied()
            .ok_or_else(|| err(span, format!("unknown global `@{n}`")))
    }

    fn ctor(&self, n: &str, span: Span) -> Result<u32, LowerError> {
        self.ctor_index
            .get(n)
            .copied()
            .ok_or_else(|| err(span, format!("unknown constructor `{n}`")))
    }
}

fn literal(l: &Literal) -> Tensor {
    use tumble_ir::DType;
    match *l {
        Literal::Bool(b) => Tensor::scalar_bool(b),
        Literal::Int(v, DType::Int64) => Tensor::scalar_i64(v),
        Literal::Int(v, DType::Float32) => Tensor::scalar_f32(v as f32),
        Literal::Int(v, DType::Float64) => Tensor::scalar_f64(v as f64),
        Literal::Int(v, _) => Tensor::scalar_i32(v as i32),
        Literal::Float(v, DType::Float64) => Tensor::scalar_f64(v),
        Literal::Float(v, _) => Tensor::scalar_f32(v as f32),
    }
}

/// The parameter types of a global, for decoding its arguments.
pub fn param_types(typed: &TypedModule, global: &str) -> Option<(Vec<Ty>, Ty)> {
    match &typed.globals.get(global)?.ty {
        Ty::Func(ps, r) => Some((ps.clone(), (**r).clone())),
        _ => None,
    }
}
