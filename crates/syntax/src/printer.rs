//! Syntax tree → canonical text, chosen so that parsing the text gives the same tree back.
//!
//! Canonical means: operators print as ordinary calls (`add(%a, %b)`, never infix), bindings print
//! one per line with `let` (numbered ones in TVM's graph form, `%0 = e;`), blocks indent by two
//! spaces, and wherever the tree could be read back
//! differently the printer adds braces or parentheses:
//! - a `let` that is not the direct content of a block (a call argument, a binding's value, the body
//!   of another `let`) prints as a `{ ... }` block, so that it is not merged into an outer chain;
//! - a callee or projected expression that is not an atom prints in parentheses, and so does a
//!   literal (`(1).0`, since `1.0` would read as a float).
//!
//! Recursion follows the tree's nesting, which the parser bounds; a chain of bindings is a loop.

use std::fmt::Write;
use tumble_ir::attrs::Attr;
use tumble_ir::{
    AttrValue, DType, Expr, ExprKind, Function, GlobalDef, Item, Literal, MatchArm, Module, Param,
    Pattern, PatternKind, TypeDef, TypeExpr, TypeExprKind,
};

pub(crate) fn print_module(m: &Module) -> String {
    let mut p = Printer { out: String::new() };
    if let Some(v) = &m.version {
        p.out.push_str("#[version = ");
        p.string(v);
        p.out.push_str("]\n");
    }
    for (i, item) in m.items.iter().enumerate() {
        if i > 0 || m.version.is_some() {
            p.out.push('\n');
        }
        match item {
            Item::Type(t) => p.type_def(t),
            Item::Def(d) => p.def(d),
        }
        p.out.push('\n');
    }
    p.out
}

pub(crate) fn print_expr(e: &Expr) -> String {
    let mut p = Printer { out: String::new() };
    p.content(e, 0);
    p.out
}

pub(crate) fn print_type(t: &TypeExpr) -> String {
    let mut p = Printer { out: String::new() };
    p.ty(t);
    p.out
}

struct Printer {
    out: String,
}

impl Printer {
    fn indent(&mut self, level: usize) {
        for _ in 0..level {
            self.out.push_str("  ");
        }
    }

    fn comma_list<T>(&mut self, items: &[T], mut each: impl FnMut(&mut Self, &T)) {
        for (i, item) in items.iter().enumerate() {
            if i > 0 {
                self.out.push_str(", ");
            }
            each(self, item);
        }
    }

    fn type_def(&mut self, t: &TypeDef) {
        self.out.push_str("type ");
        self.out.push_str(&t.name.name);
        self.type_params(&t.params);
        self.out.push_str(" {\n");
        for c in &t.ctors {
            self.indent(1);
            self.out.push_str(&c.name.name);
            if !c.fields.is_empty() {
                self.out.push('(');
                self.comma_list(&c.fields, |p, t| p.ty(t));
                self.out.push(')');
            }
            self.out.push_str(",\n");
        }
        self.out.push('}');
    }

    fn type_params(&mut self, params: &[tumble_ir::Ident]) {
        if !params.is_empty() {
            self.out.push('[');
            self.comma_list(params, |p, i| p.out.push_str(&i.name));
            self.out.push(']');
        }
    }

    fn def(&mut self, d: &GlobalDef) {
        self.out.push_str("def @");
        self.out.push_str(&d.name.name);
        self.type_params(&d.type_params);
        self.function(&d.func, 0);
    }

    /// `(params, attrs) -> T { body }`
    fn function(&mut self, f: &Function, level: usize) {
        self.out.push('(');
        self.comma_list(&f.params, |p, param| p.param(param));
        if !f.params.is_empty() && !f.attrs.is_empty() {
            self.out.push_str(", ");
        }
        self.attrs(&f.attrs.0);
        self.out.push(')');
        if let Some(t) = &f.ret {
            self.out.push_str(" -> ");
            self.ty(t);
        }
        self.out.push(' ');
        self.block(&f.body, level);
    }

    fn param(&mut self, p: &Param) {
        self.out.push('%');
        self.out.push_str(&p.name.name);
        if let Some(t) = &p.ann {
            self.out.push_str(": ");
            self.ty(t);
        }
    }

    fn attrs(&mut self, attrs: &[Attr]) {
        self.comma_list(attrs, |p, a| {
            p.out.push_str(&a.name);
            p.out.push('=');
            p.attr_value(&a.value);
        });
    }

    fn attr_value(&mut self, v: &AttrValue) {
        match v {
            AttrValue::Int(n) => {
                let _ = write!(self.out, "{n}");
            }
            // With TVM's `f` suffix (its lexer reads a float only with one); an infinity as
            // its `inff`.
            AttrValue::Float(x) if x.is_infinite() => {
                self.out.push_str(if *x > 0.0 { "inff" } else { "-inff" });
            }
            AttrValue::Float(x) => {
                let _ = write!(self.out, "{x:?}f");
            }
            AttrValue::Bool(b) => self.out.push_str(if *b { "True" } else { "False" }),
            AttrValue::Str(s) => self.string(s),
            AttrValue::List(vs) => {
                self.out.push('[');
                self.comma_list(vs, |p, v| p.attr_value(v));
                self.out.push(']');
            }
            AttrValue::None => self.out.push_str("None"),
        }
    }

    /// A string literal with exactly the escapes the lexer reads back.
    fn string(&mut self, s: &str) {
        self.out.push('"');
        for c in s.chars() {
            match c {
                '"' => self.out.push_str("\\\""),
                '\\' => self.out.push_str("\\\\"),
                '\n' => self.out.push_str("\\n"),
                '\t' => self.out.push_str("\\t"),
                '\r' => self.out.push_str("\\r"),
                c if c.is_control() => {
                    let _ = write!(self.out, "\\u{{{:x}}}", u32::from(c));
                }
                c => self.out.push(c),
            }
        }
        self.out.push('"');
    }

    // ---- types --------------------------------------------------------------------------------

    fn ty(&mut self, t: &TypeExpr) {
        match &t.kind {
            TypeExprKind::Tensor { shape, dtype } => {
                self.out.push_str("Tensor[(");
                self.comma_list(shape, |p, d| {
                    let _ = write!(p.out, "{d}");
                });
                let _ = write!(self.out, "), {dtype}]");
            }
            TypeExprKind::Tuple(ts) => {
                self.out.push('(');
                self.comma_list(ts, |p, t| p.ty(t));
                if ts.len() == 1 {
                    self.out.push(',');
                }
                self.out.push(')');
            }
            TypeExprKind::Func { params, ret } => {
                self.out.push_str("fn (");
                self.comma_list(params, |p, t| p.ty(t));
                self.out.push_str(") -> ");
                self.ty(ret);
            }
            TypeExprKind::Named { name, args } => {
                self.out.push_str(name);
                if !args.is_empty() {
                    self.out.push('[');
                    self.comma_list(args, |p, t| p.ty(t));
                    self.out.push(']');
                }
            }
            TypeExprKind::Hole => self.out.push('_'),
        }
    }

    // ---- patterns -----------------------------------------------------------------------------

    fn pattern(&mut self, p: &Pattern) {
        match &p.kind {
            PatternKind::Wildcard => self.out.push('_'),
            PatternKind::Var(v) => self.param(v),
            PatternKind::Ctor { name, args } => {
                self.out.push_str(&name.name);
                if !args.is_empty() {
                    self.out.push('(');
                    self.comma_list(args, |pr, a| pr.pattern(a));
                    self.out.push(')');
                }
            }
            PatternKind::Tuple(ps) => {
                self.out.push('(');
                self.comma_list(ps, |pr, a| pr.pattern(a));
                if ps.len() == 1 {
                    self.out.push(',');
                }
                self.out.push(')');
            }
        }
    }

    // ---- expressions --------------------------------------------------------------------------

    /// `{`, the content on its own lines one level deeper, `}` at `level`.
    fn block(&mut self, e: &Expr, level: usize) {
        self.out.push_str("{\n");
        self.indent(level + 1);
        self.content(e, level + 1);
        self.out.push('\n');
        self.indent(level);
        self.out.push('}');
    }

    /// What goes inside a block: a `let` chain prints flat, one binding per line.
    fn content(&mut self, e: &Expr, level: usize) {
        let ExprKind::Let(bindings, body) = &e.kind else {
            return self.expr(e, level);
        };
        for b in bindings {
            // A numbered variable is TVM's graph form, `%0 = e;` (its `let` takes only names); a
            // sequenced value (`e1; e2`) binds a name no source can spell.
            let name = &b.var.name.name;
            if name.starts_with(crate::parser::SEQUENCED) {
                self.expr(&b.value, level);
                self.out.push_str(";\n");
                self.indent(level);
                continue;
            }
            if name.is_empty() || !name.bytes().all(|c| c.is_ascii_digit()) {
                self.out.push_str("let ");
            }
            self.param(&b.var);
            self.out.push_str(" = ");
            self.expr(&b.value, level);
            self.out.push_str(";\n");
            self.indent(level);
        }
        self.expr(body, level);
    }

    /// An expression in any position; `level` is the indentation of the line it starts on.
    fn expr(&mut self, e: &Expr, level: usize) {
        match &e.kind {
            ExprKind::Local(n) => {
                self.out.push('%');
                self.out.push_str(n);
            }
            ExprKind::Global(n) => {
                self.out.push('@');
                self.out.push_str(n);
            }
            ExprKind::Ctor(n) | ExprKind::Op(n) => self.out.push_str(n),
            ExprKind::Lit(l) => self.literal(l),
            ExprKind::Tuple(es) => {
                self.out.push('(');
                self.comma_list(es, |p, e| p.expr(e, level));
                if es.len() == 1 {
                    self.out.push(',');
                }
                self.out.push(')');
            }
            ExprKind::Proj(inner, i) => {
                self.operand(inner, level);
                let _ = write!(self.out, ".{i}");
            }
            ExprKind::Call(c) => {
                self.operand(&c.callee, level);
                self.out.push('(');
                self.comma_list(&c.args, |p, e| p.expr(e, level));
                if !c.args.is_empty() && !c.attrs.is_empty() {
                    self.out.push_str(", ");
                }
                self.attrs(&c.attrs.0);
                self.out.push(')');
            }
            ExprKind::Let(..) => self.block(e, level),
            ExprKind::Fn(f) => {
                self.out.push_str("fn ");
                self.type_params(&f.type_params);
                self.function(f, level);
            }
            ExprKind::If(c, t, f) => {
                self.out.push_str("if (");
                self.expr(c, level);
                self.out.push_str(") ");
                self.block(t, level);
                self.out.push_str(" else ");
                if matches!(f.kind, ExprKind::If(..)) {
                    self.expr(f, level);
                } else {
                    self.block(f, level);
                }
            }
            ExprKind::Match {
                scrutinee,
                arms,
                complete,
            } => {
                self.out
                    .push_str(if *complete { "match " } else { "match? " });
                // A tuple brings its own parentheses: `match (%a, %b)`.
                if matches!(scrutinee.kind, ExprKind::Tuple(_)) {
                    self.expr(scrutinee, level);
                } else {
                    self.out.push('(');
                    self.expr(scrutinee, level);
                    self.out.push(')');
                }
                self.out.push_str(" {\n");
                for arm in arms {
                    self.arm(arm, level + 1);
                }
                self.indent(level);
                self.out.push('}');
            }
        }
    }

    fn arm(&mut self, arm: &MatchArm, level: usize) {
        self.indent(level);
        self.pattern(&arm.pattern);
        self.out.push_str(" => ");
        self.expr(&arm.body, level);
        self.out.push_str(",\n");
    }

    /// A callee or projected expression: atoms as they are, everything else parenthesized.
    fn operand(&mut self, e: &Expr, level: usize) {
        let atom = matches!(
            e.kind,
            ExprKind::Local(_)
                | ExprKind::Global(_)
                | ExprKind::Ctor(_)
                | ExprKind::Op(_)
                | ExprKind::Tuple(_)
                | ExprKind::Proj(..)
                | ExprKind::Call(_)
        );
        if atom {
            self.expr(e, level);
        } else {
            self.out.push('(');
            self.expr(e, level);
            self.out.push(')');
        }
    }

    /// Literals read back bit-exactly: `{:?}` gives the shortest round-tripping decimal form, and
    /// the suffix keeps the dtype (`1i64`, `2.5f`, `1e-5f64`). NaN and infinities have no literal.
    fn literal(&mut self, l: &Literal) {
        let _ = match l {
            Literal::Int(n, DType::Int64) => write!(self.out, "{n}i64"),
            Literal::Int(n, _) => write!(self.out, "{n}"),
            Literal::Float(x, DType::Float64) => write!(self.out, "{x:?}f64"),
            Literal::Float(x, _) if x.is_infinite() => {
                self.out.push_str(if *x > 0.0 { "inff" } else { "-inff" });
                Ok(())
            }
            Literal::Float(x, _) => write!(self.out, "{x:?}f"),
            Literal::Bool(b) => write!(self.out, "{}", if *b { "True" } else { "False" }),
        };
    }
}
