//! Type inference: Hindley–Milner over functions, tuples and ADTs, with tensor shapes checked through
//! each operator's relation.
//!
//! Operator relations need their inputs' types; when an input is still an inference variable (e.g. a
//! parameter of an un-annotated lambda passed to `@foldl`), the application is *deferred* and retried
//! as unification makes progress, like Relay's constraint solver. Calls check non-lambda arguments
//! first and push the expected function type into lambda arguments, so the common cases resolve
//! without deferral.

use crate::env::{check_distinct_params, plural, substitute_params, suggest, GlobalSig, Tables};
use crate::exhaustive::{missing_case, Pat};
use crate::unify::{Mismatch, Subst};
use std::collections::HashMap;
use tumble_ir::*;
use tumble_ops::{OpDef, RelError};

/// The most parts an expression's type may have (see the end of `infer`): far above any
/// program's, far below what would exhaust the machine.
const MAX_TYPE_PARTS: usize = 1 << 16;

/// How a diagnostic names a call: as written (`fast_exp`), the operator it stands for with it.
fn called(op: &OpDef, alias: Option<&str>) -> String {
    match alias {
        Some(a) => format!("`{a}` (an alias of `{}`)", op.name),
        None => format!("`{}`", op.name),
    }
}

enum Deferred {
    Op {
        op: &'static OpDef,
        /// The alias the call was written with (`fast_exp` for `exp`), for its diagnostics.
        alias: Option<&'static str>,
        args: Vec<Ty>,
        arg_spans: Vec<Span>,
        attrs: Attrs,
        result: Ty,
        span: Span,
        quiet: bool,
    },
    Proj {
        tuple: Ty,
        index: u32,
        result: Ty,
        span: Span,
        quiet: bool,
    },
}

pub struct Checker<'t> {
    pub tables: &'t Tables,
    pub globals: HashMap<String, GlobalSig>,
    pub subst: Subst,
    pub diags: Vec<Diagnostic>,
    /// Prelude globals the module's own definitions left out, and what of the module's each
    /// depended on (`prelude_merge`): an unknown global among them says so.
    pub left_out: HashMap<String, String>,
    /// Constraints waiting for types, each with a variable it waits on (unbound when it was
    /// last tried): it is tried again only once that one is bound. Every function's check
    /// retries what is waiting, and a chain of unannotated functions left one constraint each
    /// waiting on its callers: retried whole, 10,000 of them took 8.9 s to check.
    /// (Boxed: the list is moved whole at every retry.)
    deferred: Vec<(Option<TyVar>, Box<Deferred>)>,
    scope: tumble_ir::scope::Scope<Ty>,
    type_params: Vec<String>,
    /// Errors reported so far; deferred constraints created after an error stay quiet, since an
    /// unresolved type there is usually a consequence of that error.
    errors_at_start_of_def: usize,
    /// Generic globals whose return type is not written and not inferred yet: each is checked
    /// before the others ([`Checker::infer_return`]), its return type then written into its
    /// signature in terms of its type parameters, so every use instantiates it afresh.
    pub pending_returns: std::collections::HashSet<String>,
    /// The generic global whose return type is being inferred.
    inferring: Option<String>,
    /// The type parameters of the closures being checked, `fn [A](%x: A) { .. }`, each an
    /// inference variable of its closure (a closure has one type, which its uses determine; a
    /// `let`-bound closure is not generalized).
    closure_params: Vec<(String, Ty)>,
}

fn bool_scalar() -> Ty {
    Ty::scalar(DType::Bool)
}

/// The span of the value an expression evaluates to (the body at the end of a `let` chain), so type
/// errors point at the result, not the whole block.
fn tail_span(e: &Expr) -> Span {
    let mut e = e;
    while let ExprKind::Let(_, body) = &e.kind {
        e = body;
    }
    e.span
}

fn callee_name(e: &Expr) -> String {
    match &e.kind {
        ExprKind::Global(n) => format!("`@{n}`"),
        ExprKind::Local(n) => format!("`%{n}`"),
        _ => "the function".to_string(),
    }
}

fn ordinal(i: usize) -> String {
    let n = i + 1;
    let suffix = match (n % 10, n % 100) {
        (1, 11) | (2, 12) | (3, 13) => "th",
        (1, _) => "st",
        (2, _) => "nd",
        (3, _) => "rd",
        _ => "th",
    };
    format!("{n}{suffix}")
}

impl<'t> Checker<'t> {
    pub fn new(tables: &'t Tables) -> Self {
        Checker {
            tables,
            globals: HashMap::new(),
            subst: Subst::default(),
            diags: Vec::new(),
            left_out: HashMap::new(),
            deferred: Vec::new(),
            scope: Default::default(),
            type_params: Vec::new(),
            errors_at_start_of_def: 0,
            pending_returns: Default::default(),
            inferring: None,
            closure_params: Vec::new(),
        }
    }

    fn error_count(&self) -> usize {
        self.diags.iter().filter(|d| d.is_error()).count()
    }

    fn quiet(&self) -> bool {
        self.error_count() > self.errors_at_start_of_def
    }

    fn err(&mut self, d: Diagnostic) {
        self.diags.push(d);
    }

    fn show(&self, t: &Ty) -> String {
        for_message(&self.subst.resolve(t)).to_string()
    }

    fn mismatch(&mut self, span: Span, what: String, m: Mismatch) {
        let m = Mismatch {
            expected: for_message(&m.expected),
            found: for_message(&m.found),
            ..m
        };
        let d = if m.occurs {
            Diagnostic::error(span, format!("{what}: the type would be infinite"))
                .with_note(format!("{} occurs inside {}", m.expected, m.found))
        } else {
            Diagnostic::error(
                span,
                format!("{what}: expected {}, found {}", m.expected, m.found),
            )
        };
        self.err(d);
    }

    fn lower(&mut self, te: &TypeExpr) -> Ty {
        let tables = self.tables;
        let params = self.type_params.clone();
        let mut diags = Vec::new();
        let subst = &mut self.subst;
        let ty = tables.lower_type(te, &params, &mut || Some(subst.fresh()), &mut diags);
        self.diags.extend(diags);
        match self.closure_params.is_empty() {
            true => ty,
            false => substitute_params(&ty, &self.closure_params),
        }
    }

    /// The signature of a global from its annotations (missing pieces are fresh variables, shared by
    /// every use: un-annotated globals are inferred monomorphically).
    pub fn declare_global(&mut self, def: &GlobalDef) -> GlobalSig {
        self.type_params = def.type_params.iter().map(|p| p.name.clone()).collect();
        check_distinct_params(&def.type_params, "", &mut self.diags);
        let params: Vec<Ty> = def
            .func
            .params
            .iter()
            .map(|p| match &p.ann {
                Some(te) => self.lower(te),
                None => self.subst.fresh(),
            })
            .collect();
        let ret = match &def.func.ret {
            Some(te) => self.lower(te),
            None => self.subst.fresh(),
        };
        let params_known = !params.iter().any(contains_var);
        let ty = Ty::Func(params, Box::new(ret));
        // A missing annotation is one variable shared by every use: in a generic function it
        // would take the function's own type parameters out to its callers (`@d(@d(%x))` with
        // `def @d[A](%x: A) { (%x, %x) }` typed `(A, A)`, and run-time errors after it). A
        // missing return type alone (TVM's prelude writes `@compose` so) is inferred from the
        // body before any use ([`Checker::infer_return`]).
        if !def.type_params.is_empty() && def.func.ret.is_none() && params_known {
            self.pending_returns.insert(def.name.name.clone());
        } else if !def.type_params.is_empty() && contains_var(&ty) {
            self.err(
                Diagnostic::error(
                    def.name.span,
                    format!(
                        "`@{}` has type parameters, so its parameters' and return types must be \
                         written out: they are not inferred",
                        def.name.name
                    ),
                )
                .with_note("e.g. `def @f[A](%x: A) -> (A, A) { (%x, %x) }`"),
            );
        }
        GlobalSig {
            type_params: self.type_params.clone(),
            ty,
            span: def.name.span,
        }
    }

    pub fn check_global(&mut self, def: &mut GlobalDef) {
        self.errors_at_start_of_def = self.error_count();
        self.type_params = def.type_params.iter().map(|p| p.name.clone()).collect();
        let Some(sig) = self.globals.get(&def.name.name).cloned() else {
            return;
        };
        let Ty::Func(params, ret) = sig.ty else {
            return;
        };
        let names: Vec<Ident> = def.func.params.iter().map(|p| p.name.clone()).collect();
        check_distinct_params(&names, "%", &mut self.diags);
        let mark = self.scope.len();
        for (p, t) in def.func.params.iter_mut().zip(params) {
            p.ty = Some(t.clone());
            self.scope.push((p.name.name.clone(), t));
        }
        let body_ty = self.infer(&mut def.func.body, Some(&ret));
        if let Err(m) = self.subst.unify(&ret, &body_ty) {
            let span = tail_span(&def.func.body);
            self.mismatch(
                span,
                format!(
                    "the body of `@{}` does not have its declared return type",
                    def.name.name
                ),
                m,
            );
        }
        self.scope.truncate(mark);
        self.solve_deferred(false);
    }

    /// Checks generic global `def`, whose return type is not written, and writes the type its
    /// body has — in terms of its type parameters — into its signature. Checked before any
    /// global that could use it; one that calls itself, or another such global, must have its
    /// return type written.
    pub fn infer_return(&mut self, def: &mut GlobalDef) {
        let name = def.name.name.clone();
        self.inferring = Some(name.clone());
        self.check_global(def);
        self.inferring = None;
        self.pending_returns.remove(&name);
        let Some(sig) = self.globals.get(&name) else {
            return;
        };
        let ty = self.subst.resolve(&sig.ty);
        if contains_var(&ty) {
            if !self.quiet() {
                self.err(
                    Diagnostic::error(
                        def.name.span,
                        format!(
                            "`@{name}` has type parameters and its return type cannot be \
                             inferred from its body: write it out"
                        ),
                    )
                    .with_note("e.g. `def @f[A](%x: A) -> (A, A) { (%x, %x) }`"),
                );
            }
            return;
        }
        if let Some(sig) = self.globals.get_mut(&name) {
            sig.ty = ty;
        }
    }

    fn instantiate(&mut self, sig: &GlobalSig) -> Ty {
        let map: Vec<(String, Ty)> = sig
            .type_params
            .iter()
            .map(|p| (p.clone(), self.subst.fresh()))
            .collect();
        substitute_params(&sig.ty, &map)
    }

    pub fn infer(&mut self, e: &mut Expr, expected: Option<&Ty>) -> Ty {
        let span = e.span;
        let ty = match &mut e.kind {
            ExprKind::Local(name) => self.infer_local(name, span),
            ExprKind::Global(name) if self.pending_returns.contains(name.as_str()) => {
                let inferring = self.inferring.clone().unwrap_or_default();
                let message = if *name == inferring {
                    format!(
                        "`@{name}` has type parameters and calls itself, so its return type \
                         must be written out: it is not inferred"
                    )
                } else {
                    format!(
                        "`@{inferring}` and `@{name}` have type parameters and no return type: \
                         write out the return type of `@{name}`, which `@{inferring}` uses"
                    )
                };
                self.err(Diagnostic::error(span, message));
                self.subst.fresh()
            }
            ExprKind::Global(name) => match self.globals.get(name.as_str()).cloned() {
                Some(sig) => self.instantiate(&sig),
                None => {
                    let mut d = Diagnostic::error(span, format!("unknown global `@{name}`"));
                    if let Some(why) = self.left_out.get(name.as_str()) {
                        d = d.with_note(format!(
                            "the prelude's `@{name}` was left out: it depends on {why}, which \
                             this module's own definitions replace"
                        ));
                    } else if let Some(s) = suggest(name, self.globals.keys().map(String::as_str)) {
                        d = d.with_note(format!("did you mean `@{s}`?"));
                    }
                    self.err(d);
                    self.subst.fresh()
                }
            },
            ExprKind::Ctor(name) => {
                let name = name.clone();
                match self.ctor_type(&name, span) {
                    Some((fields, adt)) if fields.is_empty() => adt,
                    Some((fields, adt)) => Ty::Func(fields, Box::new(adt)),
                    None => self.subst.fresh(),
                }
            }
            ExprKind::Op(name) => {
                // Known operators in value position were made closures before checking
                // (`eta`): only unknown ones get here.
                let mut d = Diagnostic::error(span, format!("unknown operator `{name}`"));
                if matches!(name.as_str(), "inf" | "nan" | "infinity") {
                    d = d.with_note(format!(
                        "a float literal carries its type: write `{name}f` (and `-{name}f`) for \
                         a float32 {name}"
                    ));
                }
                self.err(d);
                self.subst.fresh()
            }
            ExprKind::Lit(l) => Ty::scalar(l.dtype()),
            ExprKind::Tuple(es) => {
                let hints: Option<Vec<Ty>> = expected.and_then(|t| match self.subst.shallow(t) {
                    Ty::Tuple(ts) if ts.len() == es.len() => Some(ts),
                    _ => None,
                });
                let tys = es
                    .iter_mut()
                    .enumerate()
                    .map(|(i, e)| {
                        let hint = hints.as_ref().and_then(|h| h.get(i)).cloned();
                        self.infer(e, hint.as_ref())
                    })
                    .collect();
                Ty::Tuple(tys)
            }
            ExprKind::Proj(inner, index) => {
                let index = *index;
                let t = self.infer(inner, None);
                self.project(t, index, span)
            }
            ExprKind::Call(call) => self.infer_call(call, span, expected),
            ExprKind::Let(bindings, body) => {
                let mark = self.scope.len();
                for b in bindings.iter_mut() {
                    self.infer_let(b);
                }
                let t = self.infer(body, expected);
                self.scope.truncate(mark);
                t
            }
            ExprKind::Fn(func) => self.infer_function(func, expected),
            ExprKind::If(c, t, f) => {
                let ct = self.infer(c, Some(&bool_scalar()));
                if self.subst.unify(&bool_scalar(), &ct).is_err() {
                    let found = self.show(&ct);
                    self.err(Diagnostic::error(
                        c.span,
                        format!(
                            "`if` condition must be a bool scalar Tensor[(), bool], found {found}"
                        ),
                    ));
                }
                let tt = self.infer(t, expected);
                let ft = self.infer(f, Some(&tt));
                if let Err(m) = self.subst.unify(&tt, &ft) {
                    self.err(
                        Diagnostic::error(
                            tail_span(f),
                            format!(
                                "`if` branches have different types: the then-branch has {}, the else-branch {}",
                                for_message(&m.expected),
                                for_message(&m.found)
                            ),
                        )
                        .with_secondary(tail_span(t), "then-branch value"),
                    );
                }
                tt
            }
            ExprKind::Match {
                scrutinee,
                arms,
                complete,
            } => {
                let st = self.infer(scrutinee, None);
                let result = match expected {
                    Some(t) => t.clone(),
                    None => self.subst.fresh(),
                };
                for (i, arm) in arms.iter_mut().enumerate() {
                    let mark = self.scope.len();
                    self.check_pattern(&mut arm.pattern, &st);
                    self.check_pattern_vars_distinct(&arm.pattern);
                    let bt = self.infer(&mut arm.body, Some(&result));
                    if let Err(m) = self.subst.unify(&result, &bt) {
                        let what = if i == 0 {
                            "this match arm has the wrong type".to_string()
                        } else {
                            "match arms have different types".to_string()
                        };
                        self.mismatch(tail_span(&arm.body), what, m);
                    }
                    self.scope.truncate(mark);
                }
                if arms.is_empty() {
                    self.err(Diagnostic::error(span, "`match` needs at least one arm"));
                } else if *complete {
                    let pats: Vec<Pat> =
                        arms.iter().map(|a| Pat::from_pattern(&a.pattern)).collect();
                    if let Some(w) = missing_case(&pats, self.tables) {
                        self.err(
                            Diagnostic::error(
                                span,
                                format!("non-exhaustive match: `{w}` is not covered"),
                            )
                            .with_note("add an arm for it, or write `match?` for a partial match"),
                        );
                    }
                }
                result
            }
        };
        // A type that doubles at each step — `let %b = (%a, %a)` line after line, or through a
        // polymorphic `@dup: A -> (A, A)` applied to its own result — has 2^n parts after n
        // steps: 80 lines took the checker's time and memory past any machine (outside the
        // memory budget). Such an expression is an error, and its type stops growing there.
        let ty = if self.subst.size_at_most(&ty, MAX_TYPE_PARTS) >= MAX_TYPE_PARTS {
            self.err(Diagnostic::error(
                span,
                format!(
                    "this expression's type has more than {MAX_TYPE_PARTS} parts (a type that \
                     doubles at each step?); tumble cannot check types this large"
                ),
            ));
            self.subst.fresh()
        } else {
            ty
        };
        e.ty = Some(ty.clone());
        ty
    }

    fn infer_local(&mut self, name: &str, span: Span) -> Ty {
        if let Some(t) = self.scope.lookup(name) {
            return t.clone();
        }
        let mut d = Diagnostic::error(span, format!("unknown variable `%{name}`"));
        if let Some(s) = suggest(name, self.scope.names()) {
            d = d.with_note(format!("did you mean `%{s}`?"));
        } else if let Some((known, _)) = name
            .split_once('/')
            .filter(|(head, _)| self.scope.lookup(head).is_some())
        {
            d = d.with_note(format!(
                "a `/` before a letter continues a name (as in TVM's `%a/b`): for a division \
                 write `%{known} / ...` with spaces"
            ));
        }
        self.err(d);
        self.subst.fresh()
    }

    fn infer_let(&mut self, b: &mut LetBinding) {
        let declared = b.var.ann.as_ref().map(|te| self.lower(&te.clone()));
        let is_fn = matches!(b.value.kind, ExprKind::Fn(_));
        // A let-bound function may call itself (Relay's `let %f = fn ... { %f(...) }`).
        let var_ty = match (&declared, is_fn) {
            (Some(t), _) => t.clone(),
            (None, true) => self.subst.fresh(),
            (None, false) => {
                let vt = self.infer(&mut b.value, None);
                b.var.ty = Some(vt.clone());
                self.scope.push((b.var.name.name.clone(), vt));
                return;
            }
        };
        let mark = self.scope.len();
        if is_fn {
            self.scope.push((b.var.name.name.clone(), var_ty.clone()));
        }
        let vt = self.infer(&mut b.value, Some(&var_ty));
        self.scope.truncate(mark);
        if let Err(m) = self.subst.unify(&var_ty, &vt) {
            let span = tail_span(&b.value);
            self.mismatch(
                span,
                format!(
                    "the value bound to `%{}` does not have its declared type",
                    b.var.name.name
                ),
                m,
            );
        }
        b.var.ty = Some(var_ty.clone());
        self.scope.push((b.var.name.name.clone(), var_ty));
    }

    fn infer_function(&mut self, func: &mut Function, expected: Option<&Ty>) -> Ty {
        let hints: Option<(Vec<Ty>, Ty)> = expected.and_then(|t| match self.subst.shallow(t) {
            Ty::Func(ps, r) if ps.len() == func.params.len() => Some((ps, *r)),
            _ => None,
        });
        let names: Vec<Ident> = func.params.iter().map(|p| p.name.clone()).collect();
        check_distinct_params(&names, "%", &mut self.diags);
        // A closure's type parameters are inference variables of its own: each closure has one
        // type (a `let`-bound closure is not generalized), which its uses determine.
        check_distinct_params(&func.type_params, "", &mut self.diags);
        let outer = (self.type_params.len(), self.closure_params.len());
        for p in &func.type_params {
            let v = self.subst.fresh();
            self.type_params.push(p.name.clone());
            self.closure_params.push((p.name.clone(), v));
        }
        let mut param_tys = Vec::with_capacity(func.params.len());
        for (i, p) in func.params.iter_mut().enumerate() {
            let t = match (&p.ann, &hints) {
                (Some(te), _) => {
                    let te = te.clone();
                    self.lower(&te)
                }
                (None, Some((hs, _))) => hs.get(i).cloned().unwrap_or_else(|| self.subst.fresh()),
                (None, None) => self.subst.fresh(),
            };
            p.ty = Some(t.clone());
            param_tys.push(t);
        }
        let ret = match (&func.ret, &hints) {
            (Some(te), _) => {
                let te = te.clone();
                self.lower(&te)
            }
            (None, Some((_, r))) => r.clone(),
            (None, None) => self.subst.fresh(),
        };
        let mark = self.scope.len();
        for (p, t) in func.params.iter().zip(&param_tys) {
            self.scope.push((p.name.name.clone(), t.clone()));
        }
        let bt = self.infer(&mut func.body, Some(&ret));
        if let Err(m) = self.subst.unify(&ret, &bt) {
            let span = tail_span(&func.body);
            self.mismatch(
                span,
                "the function body does not have its declared return type".into(),
                m,
            );
        }
        self.scope.truncate(mark);
        self.type_params.truncate(outer.0);
        self.closure_params.truncate(outer.1);
        Ty::Func(param_tys, Box::new(ret))
    }

    /// Field types and result type of a constructor, with fresh variables for the ADT's parameters.
    fn ctor_type(&mut self, name: &str, span: Span) -> Option<(Vec<Ty>, Ty)> {
        let tables = self.tables;
        let Some(info) = tables.ctors.get(name) else {
            let mut d = Diagnostic::error(span, format!("unknown constructor `{name}`"));
            if let Some(s) = suggest(name, tables.ctors.keys().map(String::as_str)) {
                d = d.with_note(format!("did you mean `{s}`?"));
            }
            self.err(d);
            return None;
        };
        let params = tables
            .adts
            .get(&info.adt)
            .map(|a| a.params.clone())
            .unwrap_or_default();
        let map: Vec<(String, Ty)> = params
            .iter()
            .map(|p| (p.clone(), self.subst.fresh()))
            .collect();
        let fields = info
            .fields
            .iter()
            .map(|f| substitute_params(f, &map))
            .collect();
        let adt = Ty::Adt(info.adt.clone(), map.into_iter().map(|(_, t)| t).collect());
        Some((fields, adt))
    }

    fn project(&mut self, t: Ty, index: u32, span: Span) -> Ty {
        let mut shallow = self.subst.shallow(&t);
        if matches!(shallow, Ty::Var(_)) {
            self.solve_deferred(false);
            shallow = self.subst.shallow(&t);
        }
        match shallow {
            Ty::Tuple(ts) => match ts.get(index as usize) {
                Some(t) => t.clone(),
                None => {
                    self.err(Diagnostic::error(
                        span,
                        format!(
                            "tuple index {index} is out of range: the tuple has {} field{}: {}",
                            ts.len(),
                            plural(ts.len()),
                            for_message(&Ty::Tuple(ts.clone()))
                        ),
                    ));
                    self.subst.fresh()
                }
            },
            Ty::Var(_) => {
                let result = self.subst.fresh();
                let quiet = self.quiet();
                self.deferred.push((
                    None,
                    Box::new(Deferred::Proj {
                        tuple: t,
                        index,
                        result: result.clone(),
                        span,
                        quiet,
                    }),
                ));
                result
            }
            other => {
                let found = self.show(&other);
                self.err(Diagnostic::error(
                    span,
                    format!(
                        "cannot take field .{index} of a value of type {found}: it is not a tuple"
                    ),
                ));
                self.subst.fresh()
            }
        }
    }

    fn infer_call(&mut self, call: &mut Call, span: Span, expected: Option<&Ty>) -> Ty {
        match &call.callee.kind {
            ExprKind::Op(name) => {
                let name = name.clone();
                self.infer_op_call(&name, call, span)
            }
            ExprKind::Ctor(name) => {
                let name = name.clone();
                self.reject_attrs(call);
                let fields_adt = self.ctor_type(&name, call.callee.span);
                let Some((fields, adt)) = fields_adt else {
                    for a in call.args.iter_mut() {
                        self.infer(a, None);
                    }
                    return self.subst.fresh();
                };
                call.callee.ty = Some(Ty::Func(fields.clone(), Box::new(adt.clone())));
                // Knowing the result type first lets a wrong field be blamed, not the whole value.
                // A failure here is reported by the caller, which unifies the result again.
                if let Some(t) = expected {
                    let _ = self.subst.unify(t, &adt);
                }
                self.check_arity(
                    span,
                    &format!("constructor `{name}`"),
                    "field",
                    fields.len(),
                    call.args.len(),
                );
                self.check_args(&name, &fields, &mut call.args, "constructor");
                adt
            }
            _ => {
                self.reject_attrs(call);
                let ct = self.infer(&mut call.callee, None);
                let what = callee_name(&call.callee);
                let (params, ret) = match self.subst.shallow(&ct) {
                    Ty::Func(ps, r) => (ps, *r),
                    Ty::Var(_) => {
                        let ps: Vec<Ty> = call.args.iter().map(|_| self.subst.fresh()).collect();
                        let r = self.subst.fresh();
                        let ft = Ty::Func(ps.clone(), Box::new(r.clone()));
                        // Cannot fail: `ct` is an unbound variable that does not occur in fresh ones.
                        let _ = self.subst.unify(&ct, &ft);
                        (ps, r)
                    }
                    other => {
                        let found = self.show(&other);
                        self.err(Diagnostic::error(
                            call.callee.span,
                            format!(
                                "cannot call {what}: it has type {found}, which is not a function"
                            ),
                        ));
                        for a in call.args.iter_mut() {
                            self.infer(a, None);
                        }
                        return self.subst.fresh();
                    }
                };
                self.check_arity(span, &what, "argument", params.len(), call.args.len());
                self.check_args(&what, &params, &mut call.args, "function");
                ret
            }
        }
    }

    /// Reports `{subject} takes {want} {noun}s, found {got}` when the counts differ.
    fn check_arity(&mut self, span: Span, subject: &str, noun: &str, want: usize, got: usize) {
        if want != got {
            self.err(Diagnostic::error(
                span,
                format!("{subject} takes {want} {noun}{}, found {got}", plural(want)),
            ));
        }
    }

    fn reject_attrs(&mut self, call: &Call) {
        if let Some(a) = call.attrs.0.first() {
            self.err(Diagnostic::error(
                a.span,
                format!(
                    "keyword attribute `{}` is only allowed on operator calls such as `nn.dense(..., units=4)`",
                    a.name
                ),
            ));
        }
    }

    /// Checks arguments against parameter types; lambdas last, so their parameters get types from the
    /// other arguments first (`@foldl(fn (%a, %b) { add(%a, %b) }, %init, %xs)`).
    fn check_args(&mut self, what: &str, params: &[Ty], args: &mut [Expr], kind: &str) {
        let order: Vec<usize> = (0..args.len())
            .filter(|&i| !matches!(args[i].kind, ExprKind::Fn(_)))
            .chain((0..args.len()).filter(|&i| matches!(args[i].kind, ExprKind::Fn(_))))
            .collect();
        for i in order {
            let Some(arg) = args.get_mut(i) else { continue };
            let Some(p) = params.get(i) else {
                self.infer(arg, None);
                continue;
            };
            let at = self.infer(arg, Some(p));
            if let Err(m) = self.subst.unify(p, &at) {
                let label = if kind == "constructor" {
                    format!("the {} field of `{what}`", ordinal(i))
                } else {
                    format!("the {} argument of {what}", ordinal(i))
                };
                self.mismatch(tail_span(arg), format!("{label} has the wrong type"), m);
            }
        }
    }

    fn infer_op_call(&mut self, name: &str, call: &mut Call, span: Span) -> Ty {
        let arg_tys: Vec<Ty> = call.args.iter_mut().map(|a| self.infer(a, None)).collect();
        let result = self.subst.fresh();
        call.callee.ty = Some(Ty::Func(arg_tys.clone(), Box::new(result.clone())));
        let Some(op) = tumble_ops::lookup(name) else {
            let mut d = Diagnostic::error(call.callee.span, format!("unknown operator `{name}`"));
            if matches!(name, "ref" | "ref_read" | "ref_write") {
                d = d.with_note(
                    "Relay's mutable references are not supported: tumble's programs are pure \
                     (thread the value through the calls instead)",
                );
            } else if let Some(s) = suggest(name, tumble_ops::all().iter().map(|o| o.name)) {
                d = d.with_note(format!("did you mean `{s}`?"));
            } else {
                d = d.with_note("run `tumble ops` to list the operators tumble knows");
            }
            self.err(d);
            return result;
        };
        if !op.takes(call.args.len()) {
            if name == "variance" && call.args.len() == 1 {
                // PyTorch's `var(x)` and numpy's take one: Relay's takes the mean too.
                self.err(
                    Diagnostic::error(span, "`variance` takes 2 arguments, found 1").with_note(
                        "Relay's variance takes the mean as its second argument: \
                         `variance(%x, mean(%x, axis=[1], keepdims=True), axis=[1], keepdims=True)`",
                    ),
                );
                return result;
            }
            match op.alt_arity {
                None => self.check_arity(
                    span,
                    &format!("`{name}`"),
                    "argument",
                    op.arity,
                    call.args.len(),
                ),
                // Two call forms: the relation's message says what each form takes.
                Some(_) => {
                    let msg = (op.relation)(&arg_tys, &call.attrs)
                        .err()
                        .map(|e| e.message)
                        .unwrap_or_else(|| {
                            format!(
                                "`{name}` takes {} arguments, found {}",
                                op.arity_text(),
                                call.args.len()
                            )
                        });
                    self.err(Diagnostic::error(span, msg));
                }
            }
            return result;
        }
        if let Err((attr, msg)) = tumble_ops::check_attrs(op, &call.attrs) {
            let at = attr
                .and_then(|a| call.attrs.get_attr(&a).map(|a| a.span))
                .unwrap_or(span);
            self.err(Diagnostic::error(at, msg));
            return result;
        }
        if name == "db.concurrent" {
            // The identity on any type: its result is its argument's type, resolved or not. As a
            // deferred relation it would wait for the argument to be resolved, which a tuple
            // holding `Nil` or `None` only is through the result (`db.concurrent((f(x), Nil))`
            // returned as a `(T, List[U])`).
            if let Err(m) = self.subst.unify(&result, &arg_tys[0]) {
                self.mismatch(
                    span,
                    "the result of `db.concurrent` has the wrong type".into(),
                    m,
                );
            }
            return result;
        }
        let arg_spans: Vec<Span> = call.args.iter().map(tail_span).collect();
        let quiet = self.quiet();
        self.deferred.push((
            None,
            Box::new(Deferred::Op {
                op,
                alias: tumble_ops::alias_name(name),
                args: arg_tys,
                arg_spans,
                attrs: call.attrs.clone(),
                result: result.clone(),
                span,
                quiet,
            }),
        ));
        self.solve_last();
        result
    }

    /// Tries the most recently deferred constraint right away (the common case: inputs known).
    fn solve_last(&mut self) {
        if let Some((_, d)) = self.deferred.pop() {
            if let Some(waiting) = self.try_solve(*d) {
                self.deferred.push(waiting);
            }
        }
    }

    /// Applies every deferred constraint whose inputs are now known, until no progress. With `last`,
    /// the ones still unsolved become errors (unless they follow an earlier error).
    pub fn solve_deferred(&mut self, last: bool) {
        loop {
            let pending = {
                let n = self.deferred.len();
                std::mem::replace(&mut self.deferred, Vec::with_capacity(n))
            };
            let before = pending.len();
            for (waits, d) in pending {
                if waits.is_some_and(|v| !self.subst.is_bound(v)) {
                    self.deferred.push((waits, d));
                    continue;
                }
                if let Some(waiting) = self.try_solve(*d) {
                    self.deferred.push(waiting);
                }
            }
            if self.deferred.len() == before {
                break;
            }
        }
        if last {
            for (_, d) in std::mem::take(&mut self.deferred) {
                match *d {
                    Deferred::Op { op, alias, span, quiet: false, .. } => self.err(
                        Diagnostic::error(
                            span,
                            format!("cannot infer the types of the arguments of {} here", called(op, alias)),
                        )
                        .with_note("add a type annotation to the variables it uses, e.g. `%x: Tensor[(1, 256), float32]`"),
                    ),
                    Deferred::Proj { span, quiet: false, .. } => self.err(
                        Diagnostic::error(span, "cannot infer the type of this tuple")
                            .with_note("add a type annotation to the variable being projected"),
                    ),
                    _ => {}
                }
            }
        }
    }

    /// A type variable `d` still waits on (its inputs not all known yet), if any.
    fn waits_on(&self, d: &Deferred) -> Option<TyVar> {
        match d {
            Deferred::Op { args, .. } => args.iter().find_map(|t| self.subst.first_unbound(t)),
            Deferred::Proj { tuple, .. } => match self.subst.shallow(tuple) {
                Ty::Var(v) => Some(v),
                _ => None,
            },
        }
    }

    /// Solves one constraint if its inputs are resolved; otherwise hands it back with a variable
    /// it waits on.
    fn try_solve(&mut self, d: Deferred) -> Option<(Option<TyVar>, Box<Deferred>)> {
        if let Some(v) = self.waits_on(&d) {
            return Some((Some(v), Box::new(d)));
        }
        match d {
            Deferred::Op {
                op,
                alias,
                args,
                arg_spans,
                attrs,
                result,
                span,
                quiet: _,
            } => {
                let resolved: Vec<Ty> = args.iter().map(|t| self.subst.resolve(t)).collect();
                match (op.relation)(&resolved, &attrs) {
                    Ok(t) => {
                        if let Err(m) = self.subst.unify(&result, &t) {
                            self.mismatch(
                                span,
                                format!("the result of {} has the wrong type", called(op, alias)),
                                m,
                            );
                        }
                    }
                    Err(RelError { message, arg }) => {
                        let at = arg.and_then(|i| arg_spans.get(i).copied()).unwrap_or(span);
                        // The relations name their operator: a call written with an alias says so.
                        let message = match alias {
                            Some(a) => match message.strip_prefix(op.name) {
                                Some(rest) if rest.starts_with(':') => {
                                    format!("{a} (an alias of `{}`){rest}", op.name)
                                }
                                _ => message,
                            },
                            None => message,
                        };
                        let mut d = Diagnostic::error(at, message);
                        if at != span {
                            d = d.with_secondary(
                                span,
                                format!("in this call to {}", called(op, alias)),
                            );
                        }
                        self.err(d);
                    }
                }
                None
            }
            Deferred::Proj {
                tuple,
                index,
                result,
                span,
                quiet: _,
            } => {
                let t = self.project(tuple, index, span);
                if let Err(m) = self.subst.unify(&result, &t) {
                    self.mismatch(span, format!("field .{index} has the wrong type"), m);
                }
                None
            }
        }
    }

    /// Binds the pattern's variables (pushed on the scope) and checks it against `expected`.
    fn check_pattern(&mut self, p: &mut Pattern, expected: &Ty) {
        p.ty = Some(expected.clone());
        match &mut p.kind {
            PatternKind::Wildcard => {}
            PatternKind::Var(v) => {
                let t = match &v.ann {
                    Some(te) => {
                        let te = te.clone();
                        let ann = self.lower(&te);
                        if let Err(m) = self.subst.unify(&ann, expected) {
                            self.mismatch(
                                p.span,
                                format!("the annotation of `%{}` does not match the value being matched", v.name.name),
                                m,
                            );
                        }
                        ann
                    }
                    None => expected.clone(),
                };
                v.ty = Some(t.clone());
                self.scope.push((v.name.name.clone(), t));
            }
            PatternKind::Ctor { name, args } => {
                let cname = name.name.clone();
                let Some((fields, adt)) = self.ctor_type(&cname, name.span) else {
                    for a in args.iter_mut() {
                        let f = self.subst.fresh();
                        self.check_pattern(a, &f);
                    }
                    return;
                };
                if let Err(m) = self.subst.unify(&adt, expected) {
                    self.err(Diagnostic::error(
                        p.span,
                        format!(
                            "pattern `{cname}` matches values of type {}, but the value being matched has type {}",
                            for_message(&m.expected),
                            for_message(&m.found)
                        ),
                    ));
                }
                // `Nil` and `Nil()` are the same; otherwise the field count must match.
                if args.len() != fields.len() {
                    self.err(Diagnostic::error(
                        p.span,
                        format!(
                            "constructor `{cname}` has {} field{}, but the pattern has {}",
                            fields.len(),
                            plural(fields.len()),
                            args.len()
                        ),
                    ));
                }
                for (a, f) in args.iter_mut().zip(fields.iter()) {
                    self.check_pattern(a, f);
                }
            }
            PatternKind::Tuple(ps) => {
                let elems = match self.subst.shallow(expected) {
                    Ty::Tuple(ts) if ts.len() == ps.len() => ts,
                    Ty::Var(_) => {
                        let ts: Vec<Ty> = ps.iter().map(|_| self.subst.fresh()).collect();
                        let _ = self.subst.unify(expected, &Ty::Tuple(ts.clone()));
                        ts
                    }
                    other => {
                        let found = self.show(&other);
                        self.err(Diagnostic::error(
                            p.span,
                            format!(
                                "a tuple pattern with {} field{} cannot match a value of type {found}",
                                ps.len(),
                                plural(ps.len())
                            ),
                        ));
                        ps.iter().map(|_| self.subst.fresh()).collect()
                    }
                };
                for (q, t) in ps.iter_mut().zip(elems.iter()) {
                    self.check_pattern(q, t);
                }
            }
        }
    }

    fn check_pattern_vars_distinct(&mut self, p: &Pattern) {
        let mut seen: Vec<Ident> = Vec::new();
        collect_pattern_vars(p, &mut seen);
        check_distinct_params(&seen, "%", &mut self.diags);
    }
}

/// Writes still-unknown parts of a type as `_` in messages (users never see `?t12`).
fn for_message(t: &Ty) -> Ty {
    match t {
        Ty::Var(_) => Ty::Param("_".into()),
        Ty::Tuple(ts) => Ty::Tuple(ts.iter().map(for_message).collect()),
        Ty::Adt(n, ts) => Ty::Adt(n.clone(), ts.iter().map(for_message).collect()),
        Ty::Func(ps, r) => Ty::Func(
            ps.iter().map(for_message).collect(),
            Box::new(for_message(r)),
        ),
        Ty::Tensor { .. } | Ty::Param(_) => t.clone(),
    }
}

fn collect_pattern_vars(p: &Pattern, out: &mut Vec<Ident>) {
    match &p.kind {
        PatternKind::Wildcard => {}
        PatternKind::Var(v) => out.push(v.name.clone()),
        PatternKind::Ctor { args, .. } => args.iter().for_each(|a| collect_pattern_vars(a, out)),
        PatternKind::Tuple(ps) => ps.iter().for_each(|a| collect_pattern_vars(a, out)),
    }
}

/// Whether `t` holds an inference variable (a type left to inference).
fn contains_var(t: &Ty) -> bool {
    match t {
        Ty::Var(_) => true,
        Ty::Tensor { .. } | Ty::Param(_) => false,
        Ty::Tuple(ts) | Ty::Adt(_, ts) => ts.iter().any(contains_var),
        Ty::Func(ps, r) => ps.iter().any(contains_var) || contains_var(r),
    }
}
