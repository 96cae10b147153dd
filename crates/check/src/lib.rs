//! Type inference for tumble modules, and the embedded prelude.
//!
//! [`load`] is the front end's entry point: parse the prelude and a user source, merge them, infer
//! every type (writing it into the IR in place) and return the typed module or every diagnostic.

mod env;
mod eta;
mod exhaustive;
mod infer;
mod prelude_merge;
mod unify;

pub use env::{AdtInfo, CtorInfo, GlobalSig, Tables, MAX_SUGGESTED_LEN};

use infer::Checker;
use std::collections::HashMap;
use tumble_ir::{visit, Diagnostic, Item, Module, SourceId, SourceMap, Span, Ty};

/// The prelude (List, Option, Tree and their functions), written in the text format.
pub const PRELUDE: &str = include_str!("prelude.rly");

/// A module whose every expression, parameter and pattern carries its resolved type.
#[derive(Debug, Clone)]
pub struct TypedModule {
    pub module: Module,
    pub tables: Tables,
    /// Resolved signatures of every global, the prelude's included.
    pub globals: HashMap<String, GlobalSig>,
    /// Warnings (the module is still usable).
    pub warnings: Vec<Diagnostic>,
    /// Sources whose definitions came from the user (not the prelude), for listing.
    pub user_sources: Vec<SourceId>,
}

impl TypedModule {
    /// The globals defined in user sources, in definition order.
    pub fn user_globals(&self) -> impl Iterator<Item = (&str, &GlobalSig)> {
        self.module
            .defs()
            .filter(|d| self.user_sources.contains(&d.name.span.src))
            .filter_map(|d| {
                self.globals
                    .get(&d.name.name)
                    .map(|s| (d.name.name.as_str(), s))
            })
    }
}

#[derive(Debug, Clone, Copy)]
pub struct LoadOptions {
    /// Include the embedded prelude (on by default; off to check the prelude itself).
    pub prelude: bool,
}

impl Default for LoadOptions {
    fn default() -> Self {
        LoadOptions { prelude: true }
    }
}

/// Stack for checking: inference recurses once per nesting level of the program (bounded by
/// `tumble_syntax::MAX_NESTING`), and debug builds use kilobytes per level. Pages are only touched as
/// needed, so a large reservation costs nothing for ordinary programs.
const CHECK_STACK: usize = 256 << 20;

/// Runs `f` on a thread with [`CHECK_STACK`] bytes of stack (inline if no thread can be made).
fn with_big_stack<T: Send>(f: impl FnOnce() -> T + Send) -> T {
    let slot = std::sync::Mutex::new(Some(f));
    let take = || slot.lock().ok().and_then(|mut g| g.take());
    let on_thread = std::thread::scope(|s| {
        let spawned = std::thread::Builder::new()
            .name("tumble-check".into())
            .stack_size(CHECK_STACK)
            .spawn_scoped(s, || take().map(|f| f()));
        match spawned.map(|h| h.join()) {
            Ok(Ok(v)) => v,
            Ok(Err(panic)) => std::panic::resume_unwind(panic),
            Err(_) => None,
        }
    });
    match on_thread {
        Some(v) => v,
        // No thread could be started, so `f` was never taken: run it here.
        None => match take() {
            Some(f) => f(),
            None => std::process::abort(),
        },
    }
}

/// Parses `text` (registered in `sources` as `name`), adds the prelude, and type-checks.
pub fn load(
    sources: &mut SourceMap,
    name: &str,
    text: &str,
    opts: LoadOptions,
) -> Result<TypedModule, Vec<Diagnostic>> {
    with_big_stack(|| load_inline(sources, name, text, opts))
}

fn load_inline(
    sources: &mut SourceMap,
    name: &str,
    text: &str,
    opts: LoadOptions,
) -> Result<TypedModule, Vec<Diagnostic>> {
    let mut diags = Vec::new();
    let mut module = Module::default();
    let mut left_out = Vec::new();
    let prelude = match opts.prelude {
        true => {
            let pid = sources.add("<prelude>", PRELUDE);
            match tumble_syntax::parse_module(PRELUDE, pid) {
                Ok(m) => Some(m),
                Err(ds) => {
                    diags.extend(ds);
                    None
                }
            }
        }
        false => None,
    };
    let uid = sources.add(name, text);
    match tumble_syntax::parse_module(text, uid) {
        Ok(m) => {
            // The user's definitions replace the prelude's of their names (see `prelude_merge`).
            if let Some(p) = prelude {
                let (kept, out) = prelude_merge::kept_prelude(p, &m);
                module.items.extend(kept);
                left_out = out;
            }
            module.version = m.version;
            module.items.extend(m.items);
        }
        Err(ds) => diags.extend(ds),
    }
    if !diags.is_empty() {
        return Err(diags);
    }
    let mut typed = check_leaving_out(module, left_out)?;
    typed.user_sources = vec![uid];
    Ok(typed)
}

/// Type-checks a whole module, annotating it in place.
pub fn check(module: Module) -> Result<TypedModule, Vec<Diagnostic>> {
    check_leaving_out(module, Vec::new())
}

/// [`check`], knowing which prelude globals the module's definitions left out and why.
fn check_leaving_out(
    mut module: Module,
    left_out: Vec<(String, String)>,
) -> Result<TypedModule, Vec<Diagnostic>> {
    for def in module.defs_mut() {
        eta::expand_operator_values(&mut def.func.body);
    }
    let mut diags = Vec::new();
    // A constructor with an operator's name takes the name over in its file (the parser reads
    // `tanh(..)` as the constructor there): said, since nothing else would show it.
    for t in module.type_defs() {
        for c in &t.ctors {
            if tumble_ops::lookup(&c.name.name).is_some() {
                diags.push(Diagnostic::warning(
                    c.name.span,
                    format!(
                        "constructor `{}` has an operator's name: in this module `{}(..)` makes \
                         a `{}` value, not the operator's result",
                        c.name.name, c.name.name, t.name.name
                    ),
                ));
            }
        }
    }
    let type_defs: Vec<&tumble_ir::TypeDef> = module.type_defs().collect();
    let tables = Tables::build(&type_defs, &mut diags);
    let mut ck = Checker::new(&tables);
    ck.left_out = left_out.into_iter().collect();
    ck.diags = diags;

    let mut first_def: HashMap<String, Span> = HashMap::new();
    for def in module.defs() {
        if let Some(prev) = first_def.get(&def.name.name) {
            ck.diags.push(
                Diagnostic::error(
                    def.name.span,
                    format!("global `@{}` is defined twice", def.name.name),
                )
                .with_secondary(*prev, "first defined here"),
            );
            continue;
        }
        first_def.insert(def.name.name.clone(), def.name.span);
        let sig = ck.declare_global(def);
        ck.globals.insert(def.name.name.clone(), sig);
    }
    let mut seen = std::collections::HashSet::new();
    // Generic globals without a written return type first: their uses need it.
    for item in module.items.iter_mut() {
        if let Item::Def(def) = item {
            if ck.pending_returns.contains(&def.name.name) && seen.insert(def.name.name.clone()) {
                ck.infer_return(def);
            }
        }
    }
    for item in module.items.iter_mut() {
        if let Item::Def(def) = item {
            // Only the first of duplicate definitions is checked; the others were reported.
            if seen.insert(def.name.name.clone()) {
                ck.check_global(def);
            }
        }
    }
    ck.solve_deferred(true);

    let (errors, warnings): (Vec<Diagnostic>, Vec<Diagnostic>) =
        ck.diags.drain(..).partition(Diagnostic::is_error);
    if !errors.is_empty() {
        let mut all = errors;
        all.extend(warnings);
        return Err(all);
    }

    // Write resolved types into the IR; variables nothing constrains default to `()`.
    let subst = &ck.subst;
    let finish = |t: &Ty| default_vars(&subst.resolve(t));
    visit::walk_types_mut(&mut module, &mut |t: &mut Ty| *t = finish(t));
    let globals = ck
        .globals
        .iter()
        .map(|(n, s)| {
            (
                n.clone(),
                GlobalSig {
                    ty: finish(&s.ty),
                    ..s.clone()
                },
            )
        })
        .collect();
    Ok(TypedModule {
        module,
        tables: tables.clone(),
        globals,
        warnings,
        user_sources: Vec::new(),
    })
}

fn default_vars(t: &Ty) -> Ty {
    match t {
        Ty::Var(_) => Ty::unit(),
        Ty::Tuple(ts) => Ty::Tuple(ts.iter().map(default_vars).collect()),
        Ty::Adt(n, ts) => Ty::Adt(n.clone(), ts.iter().map(default_vars).collect()),
        Ty::Func(ps, r) => Ty::Func(
            ps.iter().map(default_vars).collect(),
            Box::new(default_vars(r)),
        ),
        Ty::Tensor { .. } | Ty::Param(_) => t.clone(),
    }
}

/// Writes a global's type the way Relay does: `fn [A, B](fn (A) -> B, List[A]) -> List[B]`.
pub fn display_sig(sig: &GlobalSig) -> String {
    let s = sig.ty.to_string();
    if sig.type_params.is_empty() {
        s
    } else {
        let rest = s.strip_prefix("fn ").unwrap_or(&s);
        format!("fn [{}]{rest}", sig.type_params.join(", "))
    }
}
