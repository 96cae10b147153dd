//! Which prelude items a user module keeps. A module may define a type, constructor or global
//! the prelude defines: TVM prints every definition of a module that imported its Prelude
//! (`List`, `@map`, ...), and its own examples define `List` themselves. The user's definition
//! then replaces the prelude's, and so does every prelude item that depends on a replaced one —
//! `@map` goes with the prelude's `List` — so nothing of the prelude is checked against a user
//! type it was not written for. (Both were "defined twice" errors.)

use std::collections::HashSet;

use tumble_ir::TypeExprKind;
use tumble_ir::{Expr, ExprKind, Function, Item, Module, Pattern, PatternKind, TypeExpr};

/// What an item defines and what it refers to.
struct Names {
    types: HashSet<String>,
    ctors: HashSet<String>,
    globals: HashSet<String>,
}

impl Names {
    fn new() -> Names {
        Names {
            types: HashSet::new(),
            ctors: HashSet::new(),
            globals: HashSet::new(),
        }
    }

    fn meets(&self, other: &Names) -> bool {
        !self.types.is_disjoint(&other.types)
            || !self.ctors.is_disjoint(&other.ctors)
            || !self.globals.is_disjoint(&other.globals)
    }
}

fn defined(item: &Item) -> Names {
    let mut n = Names::new();
    match item {
        Item::Type(t) => {
            n.types.insert(t.name.name.clone());
            n.ctors.extend(t.ctors.iter().map(|c| c.name.name.clone()));
        }
        Item::Def(d) => {
            n.globals.insert(d.name.name.clone());
        }
    }
    n
}

fn referenced(item: &Item) -> Names {
    let mut n = Names::new();
    match item {
        Item::Type(t) => t
            .ctors
            .iter()
            .flat_map(|c| &c.fields)
            .for_each(|f| ty(f, &mut n)),
        Item::Def(d) => func(&d.func, &mut n),
    }
    n
}

fn func(f: &Function, n: &mut Names) {
    for p in &f.params {
        if let Some(t) = &p.ann {
            ty(t, n);
        }
    }
    if let Some(t) = &f.ret {
        ty(t, n);
    }
    expr(&f.body, n);
}

fn ty(t: &TypeExpr, n: &mut Names) {
    match &t.kind {
        TypeExprKind::Tensor { .. } | TypeExprKind::Hole => {}
        TypeExprKind::Tuple(ts) => ts.iter().for_each(|t| ty(t, n)),
        TypeExprKind::Func { params, ret } => {
            params.iter().for_each(|t| ty(t, n));
            ty(ret, n);
        }
        TypeExprKind::Named { name, args } => {
            n.types.insert(name.clone());
            args.iter().for_each(|t| ty(t, n));
        }
    }
}

fn pattern(p: &Pattern, n: &mut Names) {
    match &p.kind {
        PatternKind::Wildcard => {}
        PatternKind::Var(v) => {
            if let Some(t) = &v.ann {
                ty(t, n);
            }
        }
        PatternKind::Ctor { name, args } => {
            n.ctors.insert(name.name.clone());
            args.iter().for_each(|a| pattern(a, n));
        }
        PatternKind::Tuple(ps) => ps.iter().for_each(|a| pattern(a, n)),
    }
}

/// The prelude's own code: its nesting is shallow, so plain recursion.
fn expr(e: &Expr, n: &mut Names) {
    match &e.kind {
        ExprKind::Global(g) => {
            n.globals.insert(g.clone());
        }
        ExprKind::Ctor(c) => {
            n.ctors.insert(c.clone());
        }
        ExprKind::Local(_) | ExprKind::Op(_) | ExprKind::Lit(_) => {}
        ExprKind::Tuple(es) => es.iter().for_each(|e| expr(e, n)),
        ExprKind::Proj(e, _) => expr(e, n),
        ExprKind::Call(c) => {
            expr(&c.callee, n);
            c.args.iter().for_each(|e| expr(e, n));
        }
        ExprKind::Let(bs, body) => {
            for b in bs {
                if let Some(t) = &b.var.ann {
                    ty(t, n);
                }
                expr(&b.value, n);
            }
            expr(body, n);
        }
        ExprKind::Fn(f) => func(f, n),
        ExprKind::If(c, t, e) => {
            expr(c, n);
            expr(t, n);
            expr(e, n);
        }
        ExprKind::Match {
            scrutinee, arms, ..
        } => {
            expr(scrutinee, n);
            for a in arms {
                pattern(&a.pattern, n);
                expr(&a.body, n);
            }
        }
    }
}

/// The prelude's items that `user` leaves in place: those it does not define again (a type counts
/// as defined again when the user defines its name or one of its constructors' names) and that
/// depend on none it replaced; and, for each global left out, what of the module's it depended on.
pub(crate) fn kept_prelude(prelude: Module, user: &Module) -> (Vec<Item>, Vec<(String, String)>) {
    let mut replaced = Names::new();
    for item in &user.items {
        let d = defined(item);
        replaced.types.extend(d.types);
        replaced.ctors.extend(d.ctors);
        replaced.globals.extend(d.globals);
    }
    let items: Vec<(Item, Names, Names)> = prelude
        .items
        .into_iter()
        .map(|i| {
            let (d, r) = (defined(&i), referenced(&i));
            (i, d, r)
        })
        .collect();
    let mut dropped = vec![false; items.len()];
    let mut gone = Names::new();
    // A replaced item's own names count as gone (`@map` then goes with `List`), and so do the
    // names of items dropped for depending on one, until nothing more goes.
    loop {
        let mut changed = false;
        for (k, (_, def, refs)) in items.iter().enumerate() {
            if dropped.get(k).copied().unwrap_or(true) {
                continue;
            }
            if def.meets(&replaced) || refs.meets(&gone) || refs.meets(&replaced) {
                if let Some(slot) = dropped.get_mut(k) {
                    *slot = true;
                }
                gone.types.extend(def.types.iter().cloned());
                gone.ctors.extend(def.ctors.iter().cloned());
                gone.globals.extend(def.globals.iter().cloned());
                changed = true;
            }
        }
        if !changed {
            break;
        }
    }
    let mut kept = Vec::new();
    let mut left_out = Vec::new();
    for ((item, def, refs), drop) in items.into_iter().zip(dropped) {
        if !drop {
            kept.push(item);
            continue;
        }
        // Why a global went: a name of the module's it refers to (or one that went before it).
        let why = first_shared(&refs, &replaced).or_else(|| first_shared(&refs, &gone));
        for g in def.globals {
            if !replaced.globals.contains(&g) {
                left_out.push((g, why.clone().unwrap_or_else(|| "a replaced item".into())));
            }
        }
    }
    (kept, left_out)
}

/// A name in both, as a reader would write it.
fn first_shared(a: &Names, b: &Names) -> Option<String> {
    let mut globals: Vec<&String> = a.globals.intersection(&b.globals).collect();
    let mut types: Vec<&String> = a.types.intersection(&b.types).collect();
    let mut ctors: Vec<&String> = a.ctors.intersection(&b.ctors).collect();
    globals.sort();
    types.sort();
    ctors.sort();
    globals
        .first()
        .map(|g| format!("`@{g}`"))
        .or_else(|| types.first().map(|t| format!("type `{t}`")))
        .or_else(|| ctors.first().map(|c| format!("constructor `{c}`")))
}
