//! Generic traversals of the syntax tree.

use crate::ast::*;
use crate::span::Span;
use crate::types::Ty;

/// Calls `f` on every expression, pre-order. Recursion depth is bounded by the parser's nesting limit.
pub fn walk_exprs_mut(module: &mut Module, f: &mut dyn FnMut(&mut Expr)) {
    for def in module.defs_mut() {
        walk_expr_mut(&mut def.func.body, f);
    }
}

pub fn walk_expr_mut(e: &mut Expr, f: &mut dyn FnMut(&mut Expr)) {
    f(e);
    match &mut e.kind {
        ExprKind::Local(_)
        | ExprKind::Global(_)
        | ExprKind::Ctor(_)
        | ExprKind::Op(_)
        | ExprKind::Lit(_) => {}
        ExprKind::Tuple(es) => es.iter_mut().for_each(|e| walk_expr_mut(e, f)),
        ExprKind::Proj(e, _) => walk_expr_mut(e, f),
        ExprKind::Call(c) => {
            walk_expr_mut(&mut c.callee, f);
            c.args.iter_mut().for_each(|e| walk_expr_mut(e, f));
        }
        ExprKind::Let(bs, body) => {
            for b in bs {
                walk_expr_mut(&mut b.value, f);
            }
            walk_expr_mut(body, f);
        }
        ExprKind::Fn(func) => walk_expr_mut(&mut func.body, f),
        ExprKind::If(c, t, e) => {
            walk_expr_mut(c, f);
            walk_expr_mut(t, f);
            walk_expr_mut(e, f);
        }
        ExprKind::Match {
            scrutinee, arms, ..
        } => {
            walk_expr_mut(scrutinee, f);
            arms.iter_mut().for_each(|a| walk_expr_mut(&mut a.body, f));
        }
    }
}

/// Resets every span to the default and every checker annotation to `None`, so that two modules can
/// be compared for structure alone (e.g. `parse(print(m)) == m`).
pub fn erase_spans_and_types(module: &mut Module) {
    let z = Span::default();
    for item in &mut module.items {
        match item {
            Item::Type(t) => {
                t.span = z;
                t.name.span = z;
                t.params.iter_mut().for_each(|p| p.span = z);
                for c in &mut t.ctors {
                    c.span = z;
                    c.name.span = z;
                    c.fields.iter_mut().for_each(erase_type_expr);
                }
            }
            Item::Def(d) => {
                d.span = z;
                d.name.span = z;
                d.type_params.iter_mut().for_each(|p| p.span = z);
                erase_function(&mut d.func);
            }
        }
    }
}

fn erase_function(func: &mut Function) {
    func.span = Span::default();
    func.type_params
        .iter_mut()
        .for_each(|p| p.span = Span::default());
    func.params.iter_mut().for_each(erase_param);
    func.attrs
        .0
        .iter_mut()
        .for_each(|a| a.span = Span::default());
    if let Some(t) = &mut func.ret {
        erase_type_expr(t);
    }
    erase_expr(&mut func.body);
}

fn erase_param(p: &mut Param) {
    p.name.span = Span::default();
    p.ty = None;
    if let Some(t) = &mut p.ann {
        erase_type_expr(t);
    }
}

fn erase_type_expr(t: &mut TypeExpr) {
    t.span = Span::default();
    match &mut t.kind {
        TypeExprKind::Tensor { .. } | TypeExprKind::Hole => {}
        TypeExprKind::Tuple(ts) => ts.iter_mut().for_each(erase_type_expr),
        TypeExprKind::Func { params, ret } => {
            params.iter_mut().for_each(erase_type_expr);
            erase_type_expr(ret);
        }
        TypeExprKind::Named { args, .. } => args.iter_mut().for_each(erase_type_expr),
    }
}

fn erase_pattern(p: &mut Pattern) {
    p.span = Span::default();
    p.ty = None;
    match &mut p.kind {
        PatternKind::Wildcard => {}
        PatternKind::Var(v) => erase_param(v),
        PatternKind::Ctor { name, args } => {
            name.span = Span::default();
            args.iter_mut().for_each(erase_pattern);
        }
        PatternKind::Tuple(ps) => ps.iter_mut().for_each(erase_pattern),
    }
}

fn erase_expr(e: &mut Expr) {
    walk_expr_mut(e, &mut |e| {
        e.span = Span::default();
        e.ty = None;
        match &mut e.kind {
            ExprKind::Call(c) => c.attrs.0.iter_mut().for_each(|a| a.span = Span::default()),
            ExprKind::Let(bs, _) => {
                for b in bs {
                    b.span = Span::default();
                    erase_param(&mut b.var);
                }
            }
            ExprKind::Fn(func) => {
                // The body is visited by the walk itself; erase the rest here.
                func.span = Span::default();
                func.type_params
                    .iter_mut()
                    .for_each(|p| p.span = Span::default());
                func.params.iter_mut().for_each(erase_param);
                func.attrs
                    .0
                    .iter_mut()
                    .for_each(|a| a.span = Span::default());
                if let Some(t) = &mut func.ret {
                    erase_type_expr(t);
                }
            }
            ExprKind::Match { arms, .. } => {
                for a in arms {
                    a.span = Span::default();
                    erase_pattern(&mut a.pattern);
                }
            }
            _ => {}
        }
    });
}

/// Calls `f` on every type slot the checker fills (expressions, parameters, let variables, patterns).
pub fn walk_types_mut(module: &mut Module, f: &mut dyn FnMut(&mut Ty)) {
    for def in module.defs_mut() {
        walk_function_types(&mut def.func, f);
    }
}

fn walk_param_type(p: &mut Param, f: &mut dyn FnMut(&mut Ty)) {
    if let Some(t) = &mut p.ty {
        f(t);
    }
}

fn walk_function_types(func: &mut Function, f: &mut dyn FnMut(&mut Ty)) {
    for p in &mut func.params {
        walk_param_type(p, f);
    }
    walk_expr_types(&mut func.body, f);
}

fn walk_pattern_types(p: &mut Pattern, f: &mut dyn FnMut(&mut Ty)) {
    if let Some(t) = &mut p.ty {
        f(t);
    }
    match &mut p.kind {
        PatternKind::Wildcard => {}
        PatternKind::Var(v) => walk_param_type(v, f),
        PatternKind::Ctor { args, .. } => args.iter_mut().for_each(|a| walk_pattern_types(a, f)),
        PatternKind::Tuple(ps) => ps.iter_mut().for_each(|a| walk_pattern_types(a, f)),
    }
}

fn walk_expr_types(e: &mut Expr, f: &mut dyn FnMut(&mut Ty)) {
    walk_expr_mut(e, &mut |e| {
        if let Some(t) = &mut e.ty {
            f(t);
        }
        match &mut e.kind {
            ExprKind::Let(bs, _) => bs.iter_mut().for_each(|b| walk_param_type(&mut b.var, f)),
            ExprKind::Fn(func) => func.params.iter_mut().for_each(|p| walk_param_type(p, f)),
            ExprKind::Match { arms, .. } => arms
                .iter_mut()
                .for_each(|a| walk_pattern_types(&mut a.pattern, f)),
            _ => {}
        }
    });
}
