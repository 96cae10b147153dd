//! Operators passed as values (`@map(nn.relu, %xs)`, which Relay allows) become functions of their
//! positional arguments: `fn (%op.0) { nn.relu(%op.0) }`. The checker and everything after it then
//! see an ordinary closure, typed by its use like any unannotated one. (They were an error whose
//! suggested fix gave a two-argument operator one argument.)

use tumble_ir::{Attrs, Call, Expr, ExprKind, Function, Ident, Param};

/// Rewrites every operator in value position of `e` (not a call's callee) that the op table
/// knows; unknown ones stay for the checker to report. Recursion follows the expression's
/// nesting, which the parser bounds.
pub(crate) fn expand_operator_values(e: &mut Expr) {
    match &mut e.kind {
        ExprKind::Op(name) => {
            let Some(op) = tumble_ops::lookup(name) else {
                return;
            };
            let span = e.span;
            let names: Vec<String> = (0..op.arity).map(|k| format!("op.{k}")).collect();
            let params = names
                .iter()
                .map(|n| Param {
                    name: Ident::new(n.clone(), span),
                    ann: None,
                    ty: None,
                })
                .collect();
            let args = names
                .into_iter()
                .map(|n| Expr::new(ExprKind::Local(n), span))
                .collect();
            let callee = Expr::new(ExprKind::Op(name.clone()), span);
            let body = Expr::new(
                ExprKind::Call(Call {
                    callee: Box::new(callee),
                    args,
                    attrs: Attrs::default(),
                }),
                span,
            );
            e.kind = ExprKind::Fn(Box::new(Function {
                type_params: Vec::new(),
                params,
                attrs: Attrs::default(),
                ret: None,
                body: Box::new(body),
                span,
            }));
        }
        ExprKind::Call(c) => {
            if !matches!(c.callee.kind, ExprKind::Op(_)) {
                expand_operator_values(&mut c.callee);
            }
            c.args.iter_mut().for_each(expand_operator_values);
        }
        ExprKind::Local(_) | ExprKind::Global(_) | ExprKind::Ctor(_) | ExprKind::Lit(_) => {}
        ExprKind::Tuple(es) => es.iter_mut().for_each(expand_operator_values),
        ExprKind::Proj(inner, _) => expand_operator_values(inner),
        ExprKind::Let(bs, body) => {
            for b in bs {
                expand_operator_values(&mut b.value);
            }
            expand_operator_values(body);
        }
        ExprKind::Fn(f) => expand_operator_values(&mut f.body),
        ExprKind::If(c, t, f) => {
            expand_operator_values(c);
            expand_operator_values(t);
            expand_operator_values(f);
        }
        ExprKind::Match {
            scrutinee, arms, ..
        } => {
            expand_operator_values(scrutinee);
            arms.iter_mut()
                .for_each(|a| expand_operator_values(&mut a.body));
        }
    }
}
