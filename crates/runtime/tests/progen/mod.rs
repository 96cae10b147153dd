//! A generator of random well-typed tumble programs and instances for differential testing
//! (`tests/generated.rs`): seed → (program text, instances as JSON Lines, per-instance argument
//! names).
//!
//! Programs are built from a typed grammar: every variable in scope has a known type and every
//! expression is generated for a requested type, so a generated program always type-checks — one
//! that does not is a generator bug or a checker bug. They are written the way a user would
//! write them (operators on tensors inside ordinary functions, closures, prelude combinators,
//! recursion over lists and trees, `if` on tensor values); a small share of helpers are
//! `Primitive=1`. Shapes are tiny (dims 1..4) so a debug build runs hundreds of programs fast.
#![allow(dead_code)] // each test file uses a part

use std::fmt::Write;

use tumble_tensor::Rng;

/// A value type of the generated language.
#[derive(Clone, Debug, PartialEq)]
pub enum Ty {
    /// `Tensor[shape, float32]`.
    F(Vec<usize>),
    /// `Tensor[shape, int32]`: token ids (shape `[1]`, in `0..VOCAB`) and loop counts (shape `[]`).
    I(Vec<usize>),
    Tup(Vec<Ty>),
    List(Box<Ty>),
    Opt(Box<Ty>),
    Tree(Box<Ty>),
    Fn(Vec<Ty>, Box<Ty>),
}

/// Token ids of instances lie in `0..VOCAB`; embedding tables have `VOCAB` rows.
const VOCAB: usize = 6;

fn shape_text(s: &[usize]) -> String {
    let d: Vec<String> = s.iter().map(|d| d.to_string()).collect();
    format!("({})", d.join(", "))
}

fn list_text(s: &[usize]) -> String {
    let d: Vec<String> = s.iter().map(|d| d.to_string()).collect();
    format!("[{}]", d.join(", "))
}

impl Ty {
    pub fn text(&self) -> String {
        match self {
            Ty::F(s) => format!("Tensor[{}, float32]", shape_text(s)),
            Ty::I(s) => format!("Tensor[{}, int32]", shape_text(s)),
            Ty::Tup(ts) => {
                let parts: Vec<String> = ts.iter().map(Ty::text).collect();
                if parts.len() == 1 {
                    format!("({},)", parts[0])
                } else {
                    format!("({})", parts.join(", "))
                }
            }
            Ty::List(t) => format!("List[{}]", t.text()),
            Ty::Opt(t) => format!("Option[{}]", t.text()),
            Ty::Tree(t) => format!("Tree[{}]", t.text()),
            Ty::Fn(a, r) => {
                let parts: Vec<String> = a.iter().map(Ty::text).collect();
                format!("fn ({}) -> {}", parts.join(", "), r.text())
            }
        }
    }

    fn is_adt(&self) -> bool {
        matches!(self, Ty::List(_) | Ty::Opt(_) | Ty::Tree(_))
    }

    /// Contains a function type (such values cannot be instance inputs or outputs).
    fn has_fn(&self) -> bool {
        match self {
            Ty::Fn(..) => true,
            Ty::F(_) | Ty::I(_) => false,
            Ty::Tup(ts) => ts.iter().any(Ty::has_fn),
            Ty::List(t) | Ty::Opt(t) | Ty::Tree(t) => t.has_fn(),
        }
    }
}

/// A generated program and its instances.
pub struct Generated {
    pub seed: u64,
    pub text: String,
    /// JSON Lines, one object per instance, keyed by the per-instance `@main` arguments.
    pub inputs: String,
    /// The per-instance `@main` arguments; every other one is a shared weight.
    pub instance_args: Vec<String>,
}

/// A helper global's signature: its own parameters, then its weights (tensors the callers pass).
#[derive(Clone)]
struct Sig {
    name: String,
    params: Vec<Ty>,
    weights: Vec<Vec<usize>>,
    ret: Ty,
}

type Scope = Vec<(String, Ty)>;

/// The variables in scope that `pick` accepts, each with what `pick` makes of its type.
fn in_scope<T>(sc: &Scope, pick: impl Fn(&Ty) -> Option<T>) -> Vec<(String, T)> {
    sc.iter()
        .filter_map(|(n, t)| pick(t).map(|x| (n.clone(), x)))
        .collect()
}

/// Stand-in for a recursive call's weight arguments, replaced once the helper's weights are known.
const WEIGHTS_MARK: &str = "\u{1}W\u{1}";

struct Gen {
    r: Rng,
    fresh: usize,
    defs: Vec<String>,
    sigs: Vec<Sig>,
    /// The weights of the global being generated: `@main` parameters, or a helper's trailing ones.
    weights: Vec<(String, Vec<usize>)>,
    /// Generating a `Primitive=1` body: operators, lets and tuples only.
    primitive: bool,
    /// Expression nodes left for the current global; at 0 only leaves are generated.
    budget: i32,
    /// Element types of the instances' lists, trees and options (what helpers recurse over).
    elems: Vec<Ty>,
}

/// Generates program number `seed`.
pub fn generate(seed: u64) -> Generated {
    let mut g = Gen {
        r: Rng::new(seed.wrapping_mul(0x9E37_79B9).wrapping_add(17)),
        fresh: 0,
        defs: Vec::new(),
        sigs: Vec::new(),
        weights: Vec::new(),
        primitive: false,
        budget: 0,
        elems: Vec::new(),
    };
    g.program(seed)
}

impl Gen {
    /// A parameter list: the given parameters, then every weight made so far.
    fn param_list(&self, params: &[(String, Ty)]) -> Vec<String> {
        params
            .iter()
            .map(|(n, t)| format!("{n}: {}", t.text()))
            .chain(
                self.weights
                    .iter()
                    .map(|(n, s)| format!("{n}: {}", Ty::F(s.clone()).text())),
            )
            .collect()
    }

    fn below(&mut self, n: usize) -> usize {
        self.r.int_range(0, n as i64) as usize
    }

    fn chance(&mut self, p: f64) -> bool {
        self.r.uniform_f64() < p
    }

    fn dim(&mut self) -> usize {
        1 + self.below(4)
    }

    fn name(&mut self, prefix: &str) -> String {
        self.fresh += 1;
        format!("%{prefix}{}", self.fresh)
    }

    /// A small float shape: mostly row vectors `(1, d)` like the models' states.
    fn shape(&mut self) -> Vec<usize> {
        match self.below(20) {
            0 => vec![],
            1..=3 => vec![self.dim()],
            4..=12 => vec![1, self.dim()],
            13..=17 => vec![self.dim(), self.dim()],
            _ => vec![self.dim(), self.dim(), self.dim()],
        }
    }

    fn float_lit(&mut self) -> String {
        let v = [0.5, 1.0, 2.0, -1.0, 0.25, -0.5, 1.5, 3.0][self.below(8)];
        format!("{v:?}f")
    }

    /// A weight tensor of `shape`: one of the current global's, or a new one.
    fn weight(&mut self, shape: &[usize]) -> String {
        let same: Vec<String> = self
            .weights
            .iter()
            .filter(|(_, s)| s == shape)
            .map(|(n, _)| n.clone())
            .collect();
        if !same.is_empty() && self.chance(0.75) {
            let i = self.below(same.len());
            return same[i].clone();
        }
        let n = self.name("w");
        self.weights.push((n.clone(), shape.to_vec()));
        n
    }

    /// An `(n, k)` product weight: a shared weight, or now and then a matrix taken out of a
    /// stacked one by an integer in scope (a loop count, a token: a typed edge's weight,
    /// `take(%Ws, %type)`), past either end clipped.
    fn chosen_weight(&mut self, sc: &Scope, n: usize, k: usize) -> String {
        let counts = self.vars_of(sc, &Ty::I(vec![]));
        let toks = self.vars_of(sc, &Ty::I(vec![1]));
        if (counts.is_empty() && toks.is_empty()) || !self.chance(0.25) {
            return self.weight(&[n, k]);
        }
        let w = self.weight(&[3, n, k]);
        if !toks.is_empty() && (counts.is_empty() || self.chance(0.5)) {
            let t = toks[self.below(toks.len())].to_string();
            return format!("reshape(take({w}, {t}, axis=0), newshape=[{n}, {k}])");
        }
        let c = counts[self.below(counts.len())].to_string();
        format!("take({w}, {c}, axis=0)")
    }

    fn vars_of<'a>(&self, sc: &'a Scope, ty: &Ty) -> Vec<&'a str> {
        sc.iter()
            .filter(|(_, t)| t == ty)
            .map(|(n, _)| n.as_str())
            .collect()
    }

    fn pick_var(&mut self, sc: &Scope, ty: &Ty) -> Option<String> {
        let vs = self.vars_of(sc, ty);
        if vs.is_empty() {
            None
        } else {
            let i = self.below(vs.len());
            Some(vs[i].to_string())
        }
    }

    /// Paths to `ty` inside tuple-typed variables: `(%v.0).1`.
    fn projections(&self, sc: &Scope, ty: &Ty) -> Vec<String> {
        fn walk(e: String, t: &Ty, want: &Ty, out: &mut Vec<String>, depth: u32) {
            if let Ty::Tup(ts) = t {
                for (i, c) in ts.iter().enumerate() {
                    let p = format!("{e}.{i}");
                    if c == want {
                        out.push(p.clone());
                    }
                    if depth < 2 {
                        walk(format!("({p})"), c, want, out, depth + 1);
                    }
                }
            }
        }
        let mut out = Vec::new();
        for (n, t) in sc {
            walk(n.clone(), t, ty, &mut out, 0);
        }
        out
    }

    // ---------------------------------------------------------------------------------------
    // Programs and globals

    fn program(&mut self, seed: u64) -> Generated {
        // The per-instance `@main` arguments come first: helpers recurse over their types.
        let nargs = 1 + self.below(3);
        let mut sc: Scope = Vec::new();
        let mut arg_tys = Vec::new();
        for _ in 0..nargs {
            let t = self.input_ty();
            let n = self.name("x");
            arg_tys.push((n.clone(), t.clone()));
            sc.push((n, t));
        }
        self.elems = arg_tys
            .iter()
            .filter_map(|(_, t)| match t {
                Ty::List(e) | Ty::Tree(e) | Ty::Opt(e) => Some((**e).clone()),
                _ => None,
            })
            .collect();
        let helpers = self.below(4);
        for _ in 0..helpers {
            self.helper();
        }
        // @main: weights are appended to its parameters as the body asks for them.
        self.weights.clear();
        self.primitive = false;
        self.budget = 30 + self.below(30) as i32;
        let ret = self.output_ty();
        // Most helpers are called on the instance's values first, so that what the program
        // returns depends on the recursions.
        let mut calls = Vec::new();
        for s in self.sigs.clone() {
            if self.chance(0.8) && !s.ret.has_fn() {
                let e = self.call_helper(&sc, &s, 2);
                let v = self.name("v");
                calls.push(format!("let {v}: {} = {e};", s.ret.text()));
                sc.push((v, s.ret.clone()));
            }
        }
        // Partial prelude functions on the instance's lists and options fail at run time for
        // some instances (an empty list, `None`): the batched engine must fail the same way.
        for (n, t) in arg_tys.clone() {
            let (e, call) = match &t {
                Ty::List(e) if self.chance(0.15) => {
                    let f = if self.chance(0.5) {
                        "@hd({n})"
                    } else {
                        "@nth({n}, 1)"
                    };
                    ((**e).clone(), f.replace("{n}", &n))
                }
                Ty::Opt(e) if self.chance(0.15) => ((**e).clone(), format!("@optional_get({n})")),
                // Tokens go up to VOCAB - 1: a table one row short fails in "fast" mode for some
                // instances. The `if` reads the row, so it is computed: the batched engine prunes
                // operators whose values nothing reads, and their errors with them.
                Ty::I(s) if s == &[1] && self.chance(0.2) => {
                    let d = self.dim();
                    let w = self.weight(&[VOCAB - 1, d]);
                    let c = format!("greater(sum(take({w}, {n}, axis=0, mode=\"fast\")), 0f)");
                    (Ty::F(vec![]), format!("if ({c}) {{ 1f }} else {{ -1f }}"))
                }
                _ => continue,
            };
            let v = self.name("v");
            calls.push(format!("let {v} = {call};"));
            sc.push((v, e));
        }
        let mut body = self.block(&sc, &ret, 4, true);
        if !calls.is_empty() {
            body = format!("{}\n{body}", calls.join("\n"));
        }
        let params = self.param_list(&arg_tys);
        let mut text = String::new();
        for d in &self.defs {
            text.push_str(d);
            text.push('\n');
        }
        let _ = write!(
            text,
            "def @main({}) -> {} {{\n{}\n}}\n",
            params.join(", "),
            ret.text(),
            indent(&body)
        );
        let count = 4 + self.below(6);
        let mut inputs = String::new();
        for _ in 0..count {
            let fields: Vec<String> = arg_tys
                .iter()
                .map(|(n, t)| format!("\"{}\": {}", &n[1..], self.value(t)))
                .collect();
            let _ = writeln!(inputs, "{{{}}}", fields.join(", "));
        }
        Generated {
            seed,
            text,
            inputs,
            instance_args: arg_tys.iter().map(|(n, _)| n[1..].to_string()).collect(),
        }
    }

    /// A type for list, option and tree elements.
    fn elem_ty(&mut self) -> Ty {
        if !self.elems.is_empty() && self.chance(0.7) {
            let i = self.below(self.elems.len());
            return self.elems[i].clone();
        }
        match self.below(10) {
            0 => Ty::Tup(vec![Ty::F(vec![1, self.dim()]), Ty::F(vec![1, self.dim()])]),
            1 => Ty::F(vec![self.dim()]),
            _ => Ty::F(vec![1, self.dim()]),
        }
    }

    /// The type of a per-instance `@main` argument.
    fn input_ty(&mut self) -> Ty {
        match self.below(20) {
            0..=7 => Ty::F(self.shape()),
            8..=10 => Ty::List(Box::new(self.elem_ty())),
            11..=12 => Ty::Tree(Box::new(self.elem_ty())),
            13 => Ty::Tree(Box::new(Ty::I(vec![1]))),
            14 => Ty::Opt(Box::new(self.elem_ty())),
            15 => Ty::Tup(vec![Ty::F(self.shape()), Ty::F(self.shape())]),
            16 => Ty::List(Box::new(Ty::I(vec![1]))),
            17 => Ty::I(vec![1]),
            _ => Ty::I(vec![]),
        }
    }

    /// `@main`'s result type.
    fn output_ty(&mut self) -> Ty {
        match self.below(20) {
            0..=9 => Ty::F(self.shape()),
            10..=13 => Ty::Tup(vec![Ty::F(self.shape()), Ty::F(self.shape())]),
            14 => Ty::Tup(vec![
                Ty::Tup(vec![Ty::F(self.shape()), Ty::F(self.shape())]),
                Ty::F(self.shape()),
            ]),
            15..=16 => Ty::List(Box::new(self.elem_ty())),
            17 => Ty::Opt(Box::new(Ty::F(self.shape()))),
            18 => Ty::Tree(Box::new(Ty::F(vec![1, self.dim()]))),
            _ => Ty::Tup(vec![
                Ty::F(self.shape()),
                Ty::List(Box::new(Ty::F(vec![1, self.dim()]))),
            ]),
        }
    }

    /// The type of a helper's parameter or result, or of a let binding.
    fn value_ty(&mut self) -> Ty {
        match self.below(20) {
            0..=13 => Ty::F(self.shape()),
            14..=16 => Ty::Tup(vec![Ty::F(self.shape()), Ty::F(self.shape())]),
            17 => Ty::List(Box::new(self.elem_ty())),
            18 => Ty::Opt(Box::new(self.elem_ty())),
            _ => Ty::Tup(vec![
                Ty::F(self.shape()),
                Ty::Tup(vec![Ty::F(self.shape()), Ty::F(self.shape())]),
            ]),
        }
    }

    /// Adds one helper global (plain, list recursion, tree recursion, counted loop, or
    /// `Primitive=1`) to `defs` and `sigs`.
    fn helper(&mut self) {
        self.weights.clear();
        self.primitive = false;
        self.budget = 15 + self.below(15) as i32;
        let name = format!("@h{}", self.sigs.len());
        let kind = self.below(10);
        let (params, ret, body, attrs): (Vec<(String, Ty)>, Ty, String, &str) = match kind {
            // Recursion over a list, threading a state (an RNN).
            0..=2 => {
                let e = self.elem_ty();
                let st = if self.chance(0.7) {
                    Ty::F(vec![1, self.dim()])
                } else {
                    self.value_ty()
                };
                let ret = if self.chance(0.5) {
                    st.clone()
                } else {
                    self.value_ty()
                };
                let xs = self.name("xs");
                let s = self.name("s");
                let (y, ys, r) = (self.name("y"), self.name("ys"), self.name("r"));
                let sc_s = vec![(s.clone(), st.clone())];
                let mut sc_c = sc_s.clone();
                sc_c.push((y.clone(), e.clone()));
                sc_c.push((ys.clone(), Ty::List(Box::new(e.clone()))));
                let next = squash(self.expr(&sc_c, &st, 3), &st);
                sc_c.push((r.clone(), ret.clone()));
                let cons = self.block(&sc_c, &ret, 3, false);
                let nil = self.block(&sc_s, &ret, 2, false);
                let body = format!(
                    "match ({xs}) {{\n  Cons({y}, {ys}) => {{\n    let {r} = {name}({ys}, {next}{WEIGHTS_MARK});\n{}\n  }},\n  Nil => {{\n{}\n  }},\n}}",
                    indent(&indent(&cons)),
                    indent(&indent(&nil))
                );
                (vec![(xs, Ty::List(Box::new(e))), (s, st)], ret, body, "")
            }
            // Recursion over a tree: children through @map, combined with @foldl.
            3..=4 => {
                let e = if self.chance(0.3) {
                    Ty::I(vec![1])
                } else {
                    self.elem_ty()
                };
                let ret = if self.chance(0.7) {
                    Ty::F(vec![1, self.dim()])
                } else {
                    self.value_ty()
                };
                let t = self.name("t");
                let (v, kids, k, rs, a, b, acc) = (
                    self.name("v"),
                    self.name("kids"),
                    self.name("k"),
                    self.name("rs"),
                    self.name("a"),
                    self.name("b"),
                    self.name("acc"),
                );
                let tt = Ty::Tree(Box::new(e.clone()));
                let sc_v = vec![(v.clone(), e.clone())];
                let leaf = if self.chance(0.5) {
                    let l = self.block(&sc_v, &ret, 2, false);
                    format!("  Rose({v}, Nil) => {{\n{}\n  }},\n", indent(&indent(&l)))
                } else {
                    String::new()
                };
                let sc_ab = vec![(a.clone(), ret.clone()), (b.clone(), ret.clone())];
                let comb = squash(self.expr(&sc_ab, &ret, 2), &ret);
                let init = self.expr(&sc_v, &ret, 2);
                let mut sc_n = sc_v.clone();
                sc_n.push((acc.clone(), ret.clone()));
                let node = squash(self.block(&sc_n, &ret, 2, false), &ret);
                let (rt, tt_text) = (ret.text(), tt.text());
                let body = format!(
                    "match ({t}) {{\n{leaf}  Rose({v}, {kids}) => {{\n    let {rs} = @map(fn ({k}: {tt_text}) -> {rt} {{ {name}({k}{WEIGHTS_MARK}) }}, {kids});\n    let {acc} = @foldl(fn ({a}: {rt}, {b}: {rt}) -> {rt} {{\n{}\n    }}, {init}, {rs});\n{}\n  }},\n}}",
                    indent(&indent(&indent(&comb))),
                    indent(&indent(&node))
                );
                (vec![(t, tt)], ret, body, "")
            }
            // A loop counted by an int32 scalar, optionally exiting early on a tensor value.
            5..=6 => {
                let st = Ty::F(self.shape());
                let (x, n) = (self.name("x"), self.name("n"));
                let sc = vec![(x.clone(), st.clone())];
                let next = squash(self.expr(&sc, &st, 3), &st);
                let recur = format!("{name}({next}, {n} - 1{WEIGHTS_MARK})");
                let body = if self.chance(0.5) {
                    let c = self.cond(&sc);
                    format!(
                        "if ({n} > 0) {{\n  if ({c}) {{\n    {recur}\n  }} else {{\n    {x}\n  }}\n}} else {{\n  {x}\n}}"
                    )
                } else {
                    format!("if ({n} > 0) {{\n  {recur}\n}} else {{\n  {x}\n}}")
                };
                (vec![(x, st.clone()), (n, Ty::I(vec![]))], st, body, "")
            }
            // Operators only, marked `Primitive=1`.
            7 => {
                self.primitive = true;
                let np = 1 + self.below(3);
                let params: Vec<(String, Ty)> = (0..np)
                    .map(|_| (self.name("p"), Ty::F(self.shape())))
                    .collect();
                let ret = if self.chance(0.7) {
                    Ty::F(self.shape())
                } else {
                    Ty::Tup(vec![Ty::F(self.shape()), Ty::F(self.shape())])
                };
                let body = self.block(&params, &ret, 3, false);
                self.primitive = false;
                (params, ret, body, ",\n  Primitive=1")
            }
            // A plain function.
            _ => {
                let np = 1 + self.below(3);
                let params: Vec<(String, Ty)> = (0..np)
                    .map(|_| {
                        let t = self.value_ty();
                        (self.name("p"), t)
                    })
                    .collect();
                let ret = self.value_ty();
                let body = self.block(&params, &ret, 3, false);
                (params, ret, body, "")
            }
        };
        let wargs: String = self.weights.iter().map(|(n, _)| format!(", {n}")).collect();
        let body = body.replace(WEIGHTS_MARK, &wargs);
        let ps = self.param_list(&params);
        self.defs.push(format!(
            "def {name}({}{attrs}) -> {} {{\n{}\n}}\n",
            ps.join(", "),
            ret.text(),
            indent(&body)
        ));
        self.sigs.push(Sig {
            name,
            params: params.into_iter().map(|(_, t)| t).collect(),
            weights: self.weights.iter().map(|(_, s)| s.clone()).collect(),
            ret,
        });
    }

    // ---------------------------------------------------------------------------------------
    // Expressions

    /// A let chain ending in an expression of type `ty`, as lines without braces.
    fn block(&mut self, sc: &Scope, ty: &Ty, depth: u32, is_main: bool) -> String {
        let mut sc = sc.clone();
        let mut lines = Vec::new();
        let n = if self.budget > 0 { self.below(4) } else { 0 };
        for _ in 0..n {
            if is_main && !self.primitive && self.chance(0.08) {
                // An explicit phase boundary in @main.
                let p = self.name("ph");
                lines.push(format!("let {p} = db.phase_change();"));
                continue;
            }
            let t = if !self.primitive && self.chance(0.12) {
                // A closure over what is in scope.
                let a = Ty::F(self.shape());
                let r = if self.chance(0.8) {
                    Ty::F(self.shape())
                } else {
                    self.value_ty()
                };
                Ty::Fn(vec![a], Box::new(r))
            } else if self.primitive {
                if self.chance(0.8) {
                    Ty::F(self.shape())
                } else {
                    Ty::Tup(vec![Ty::F(self.shape()), Ty::F(self.shape())])
                }
            } else {
                self.value_ty()
            };
            let e = self.expr(&sc, &t, depth);
            let v = self.name("v");
            // ADT-typed bindings are annotated: `Nil`/`None` alone do not fix the element type.
            if t.is_adt() || self.chance(0.2) {
                lines.push(format!("let {v}: {} = {e};", t.text()));
            } else {
                lines.push(format!("let {v} = {e};"));
            }
            sc.push((v, t));
        }
        lines.push(self.expr(&sc, ty, depth));
        lines.join("\n")
    }

    /// An expression of type `ty`; `depth` bounds nesting.
    fn expr(&mut self, sc: &Scope, ty: &Ty, depth: u32) -> String {
        self.budget -= 1;
        let leaf = depth == 0 || self.budget <= 0;
        if !leaf && !self.primitive && self.chance(0.3) {
            if let Some(e) = self.eliminator(sc, ty, depth) {
                return e;
            }
        }
        // What is in scope: mostly at the leaves, sometimes higher up.
        if self.chance(if leaf { 0.8 } else { 0.15 }) {
            if let Some(v) = self.pick_var(sc, ty) {
                return v;
            }
        }
        if self.chance(if leaf { 0.5 } else { 0.1 }) {
            let ps = self.projections(sc, ty);
            if !ps.is_empty() {
                let i = self.below(ps.len());
                return ps[i].clone();
            }
        }
        match ty {
            Ty::F(s) => self.tensor(sc, s, if leaf { 0 } else { depth }),
            Ty::I(s) => {
                if let Some(v) = self.pick_var(sc, ty) {
                    v
                } else if s.is_empty() {
                    format!("{}", self.below(3))
                } else {
                    format!("zeros(shape={}, dtype=\"int32\")", list_text(s))
                }
            }
            Ty::Tup(ts) => {
                let d = depth.saturating_sub(1);
                let parts: Vec<String> = ts.iter().map(|t| self.expr(sc, t, d)).collect();
                let lit = if parts.len() == 1 {
                    format!("({},)", parts[0])
                } else {
                    format!("({})", parts.join(", "))
                };
                if !leaf && !self.primitive && parts.len() > 1 && self.chance(0.25) {
                    format!("db.concurrent({lit})")
                } else {
                    lit
                }
            }
            Ty::List(e) => self.list(sc, e, ty, depth, leaf),
            Ty::Opt(e) => {
                if leaf || self.chance(0.2) {
                    "None".to_string()
                } else {
                    format!("Some({})", self.expr(sc, e, depth - 1))
                }
            }
            Ty::Tree(e) => {
                let d = depth.saturating_sub(1);
                if !leaf && self.chance(0.6) {
                    // @tmap over a tree in scope.
                    let trees = in_scope(sc, |t| match t {
                        Ty::Tree(x) => Some((**x).clone()),
                        _ => None,
                    });
                    if !trees.is_empty() {
                        let (tn, te) = trees[self.below(trees.len())].clone();
                        let f = self.lambda(sc, &[te], e, d);
                        return format!("@tmap({f}, {tn})");
                    }
                }
                let v = self.expr(sc, e, d);
                if !leaf && self.chance(0.3) {
                    let c = self.expr(sc, e, d);
                    format!("Rose({v}, Cons(Rose({c}, Nil), Nil))")
                } else {
                    format!("Rose({v}, Nil)")
                }
            }
            Ty::Fn(a, r) => self.lambda(sc, a, r, depth.saturating_sub(1)),
        }
    }

    /// `fn (%p: A, ..) -> R { .. }` capturing `sc`.
    fn lambda(&mut self, sc: &Scope, args: &[Ty], ret: &Ty, depth: u32) -> String {
        let mut inner = sc.clone();
        let mut ps = Vec::new();
        for a in args {
            let p = self.name("p");
            ps.push(format!("{p}: {}", a.text()));
            inner.push((p, a.clone()));
        }
        let body = self.block(&inner, ret, depth, false);
        format!(
            "fn ({}) -> {} {{\n{}\n}}",
            ps.join(", "),
            ret.text(),
            indent(&body)
        )
    }

    fn list(&mut self, sc: &Scope, e: &Ty, ty: &Ty, depth: u32, leaf: bool) -> String {
        if leaf {
            return "Nil".to_string();
        }
        let d = depth - 1;
        let lists = in_scope(sc, |t| match t {
            Ty::List(x) => Some((**x).clone()),
            _ => None,
        });
        match self.below(6) {
            0 | 1 if !lists.is_empty() => {
                let (ln, le) = lists[self.below(lists.len())].clone();
                let f = self.lambda(sc, &[le], e, d);
                format!("@map({f}, {ln})")
            }
            2 if self.pick_var(sc, ty).is_some() => {
                let v = self.pick_var(sc, ty).unwrap_or_default();
                if self.chance(0.5) {
                    format!("@rev({v})")
                } else {
                    let w = self.expr(sc, ty, d);
                    format!("@concat({v}, {w})")
                }
            }
            3 => "Nil".to_string(),
            _ => {
                let h = self.expr(sc, e, d);
                let t = self.expr(sc, ty, d);
                format!("Cons({h}, {t})")
            }
        }
    }

    /// A boolean scalar condition on tensor values (or on an int32 counter).
    fn cond(&mut self, sc: &Scope) -> String {
        if let Some(n) = self.pick_var(sc, &Ty::I(vec![])) {
            if self.chance(0.3) {
                return format!("{n} > {}", self.below(3));
            }
        }
        let s = self.shape();
        let e = self.tensor(sc, &s, 2);
        let red = ["sum", "mean", "max", "min"][self.below(4)];
        let cmp = ["greater", "less", "greater_equal"][self.below(3)];
        let lit = self.float_lit();
        let c = format!("{cmp}({red}({e}), {lit})");
        if self.chance(0.15) {
            format!("logical_not({c})")
        } else {
            c
        }
    }

    /// Generic ways to get a value of any type out of what is in scope: `if`, `match`, `@foldl`,
    /// calls of closures and helpers, let blocks, `@hd`. `None` when none applies.
    fn eliminator(&mut self, sc: &Scope, ty: &Ty, depth: u32) -> Option<String> {
        let d = depth - 1;
        let helpers: Vec<Sig> = self.sigs.iter().filter(|s| &s.ret == ty).cloned().collect();
        let closures = in_scope(sc, |t| match t {
            Ty::Fn(a, r) if **r == *ty => Some(a.clone()),
            _ => None,
        });
        let adts: Vec<(String, Ty)> = sc.iter().filter(|(_, t)| t.is_adt()).cloned().collect();
        let lists = in_scope(sc, |t| match t {
            Ty::List(x) => Some((**x).clone()),
            _ => None,
        });
        for _ in 0..4 {
            match self.below(9) {
                0 | 1 => {
                    let c = self.cond(sc);
                    let a = self.block(sc, ty, d, false);
                    let b = self.block(sc, ty, d, false);
                    return Some(format!(
                        "if ({c}) {{\n{}\n}} else {{\n{}\n}}",
                        indent(&a),
                        indent(&b)
                    ));
                }
                2 if !helpers.is_empty() => {
                    let s = helpers[self.below(helpers.len())].clone();
                    return Some(self.call_helper(sc, &s, d));
                }
                3 if !closures.is_empty() => {
                    let (f, a) = closures[self.below(closures.len())].clone();
                    let args: Vec<String> = a.iter().map(|t| self.expr(sc, t, d)).collect();
                    return Some(format!("{f}({})", args.join(", ")));
                }
                4 if !adts.is_empty() => {
                    let (v, t) = adts[self.below(adts.len())].clone();
                    return Some(self.matcher(sc, &v, &t, ty, d));
                }
                5 if !lists.is_empty() => {
                    let (l, e) = lists[self.below(lists.len())].clone();
                    let (a, x) = (self.name("acc"), self.name("e"));
                    let mut inner = sc.clone();
                    inner.push((a.clone(), ty.clone()));
                    inner.push((x.clone(), e.clone()));
                    let body = self.block(&inner, ty, d, false);
                    let init = self.expr(sc, ty, d);
                    return Some(format!(
                        "@foldl(fn ({a}: {}, {x}: {}) -> {} {{\n{}\n}}, {init}, {l})",
                        ty.text(),
                        e.text(),
                        ty.text(),
                        indent(&body)
                    ));
                }
                6 => {
                    let b = self.block(sc, ty, d, false);
                    return Some(format!("{{\n{}\n}}", indent(&b)));
                }
                7 => {
                    // Partial prelude functions: fail at run time on short lists, and the
                    // batched engine must fail the same way.
                    let l = lists.iter().find(|(_, e)| e == ty).cloned();
                    if let Some((l, _)) = l {
                        if self.chance(0.3) {
                            return Some(format!("@nth({l}, 1)"));
                        }
                        return Some(format!("@hd({l})"));
                    }
                }
                _ => {}
            }
        }
        None
    }

    fn call_helper(&mut self, sc: &Scope, s: &Sig, d: u32) -> String {
        let mut args: Vec<String> = s.params.iter().map(|t| self.expr(sc, t, d)).collect();
        for w in &s.weights {
            args.push(self.weight(w));
        }
        format!("{}({})", s.name, args.join(", "))
    }

    /// `match` on an ADT-typed variable, producing `ty` in every arm.
    fn matcher(&mut self, sc: &Scope, v: &str, t: &Ty, ty: &Ty, d: u32) -> String {
        let arm = |g: &mut Gen, binds: Vec<(String, Ty)>| {
            let mut inner = sc.clone();
            inner.extend(binds);
            let b = g.block(&inner, ty, d, false);
            format!("{{\n{}\n  }}", indent(&indent(&b)))
        };
        match t {
            Ty::List(e) if self.chance(0.25) => {
                // A tuple scrutinee, as hand-written transition systems match their state
                // (`match (%buffer, %stack)`); the last arm binds the whole tuple or ignores it.
                let w = self.pick_var(sc, t).unwrap_or_else(|| v.to_string());
                let (h, r) = (self.name("h"), self.name("tl"));
                let a = arm(
                    self,
                    vec![(h.clone(), (**e).clone()), (r.clone(), t.clone())],
                );
                let b = arm(self, vec![]);
                let c = arm(self, vec![]);
                let last = if self.chance(0.5) {
                    self.name("pair")
                } else {
                    "_".to_string()
                };
                format!(
                    "match ({v}, {w}) {{\n  (Cons({h}, {r}), Nil) => {a},\n  (Nil, Cons(_, _)) => {b},\n  {last} => {c},\n}}"
                )
            }
            Ty::List(e) => {
                let (h, r) = (self.name("h"), self.name("tl"));
                let a = arm(
                    self,
                    vec![(h.clone(), (**e).clone()), (r.clone(), t.clone())],
                );
                let b = arm(self, vec![]);
                format!("match ({v}) {{\n  Cons({h}, {r}) => {a},\n  Nil => {b},\n}}")
            }
            Ty::Opt(e) => {
                let y = self.name("y");
                let a = arm(self, vec![(y.clone(), (**e).clone())]);
                let b = arm(self, vec![]);
                format!("match ({v}) {{\n  Some({y}) => {a},\n  None => {b},\n}}")
            }
            Ty::Tree(e) => {
                let (x, k) = (self.name("nv"), self.name("sub"));
                let a = arm(self, vec![(x.clone(), (**e).clone())]);
                let b = arm(
                    self,
                    vec![
                        (x.clone(), (**e).clone()),
                        (k.clone(), Ty::List(Box::new(t.clone()))),
                    ],
                );
                format!("match ({v}) {{\n  Rose({x}, Nil) => {a},\n  Rose({x}, {k}) => {b},\n}}")
            }
            _ => unreachable!("not an ADT: {t:?}"),
        }
    }

    // ---------------------------------------------------------------------------------------
    // Tensors

    /// A leaf float tensor of shape `s`: a variable, a weight, a constant, or a reduction of
    /// something in scope broadcast onto a weight.
    fn tensor_leaf(&mut self, sc: &Scope, s: &[usize]) -> String {
        let ty = Ty::F(s.to_vec());
        if let Some(v) = self.pick_var(sc, &ty) {
            if self.chance(0.7) {
                return v;
            }
        }
        let floats = in_scope(sc, |t| match t {
            Ty::F(s) => Some(s.clone()),
            _ => None,
        });
        // A value in scope brought to shape `s` the way a model would: a dense layer from a
        // state of the same rank and leading dims (`(1, k)` to `(1, n)`), or a reshape.
        let adaptable: Vec<(String, Vec<usize>)> = floats
            .iter()
            .filter(|(_, t)| {
                (!s.is_empty() && t.len() == s.len() && t[..t.len() - 1] == s[..s.len() - 1])
                    || t.iter().product::<usize>() == s.iter().product::<usize>()
            })
            .cloned()
            .collect();
        if !adaptable.is_empty() && self.chance(0.6) {
            let (v, t) = adaptable[self.below(adaptable.len())].clone();
            if !s.is_empty() && t.len() == s.len() && t[..t.len() - 1] == s[..s.len() - 1] {
                let w = self.weight(&[s[s.len() - 1], t[t.len() - 1]]);
                return if s.len() >= 2 && self.chance(0.5) {
                    let b = self.weight(&[s[1]]);
                    format!("nn.bias_add(nn.dense({v}, {w}), {b})")
                } else {
                    format!("nn.dense({v}, {w})")
                };
            }
            return format!("reshape({v}, newshape={})", list_text(s));
        }
        let floats: Vec<String> = floats.into_iter().map(|(n, _)| n).collect();
        match self.below(6) {
            0 | 1 if !floats.is_empty() => {
                let v = &floats[self.below(floats.len())];
                let w = self.weight(s);
                let red = ["sum", "mean", "max"][self.below(3)];
                format!("add({red}({v}), {w})")
            }
            2 if s.is_empty() => self.float_lit(),
            3 => match self.below(4) {
                // Seeded per instance: the engines must draw the same numbers.
                3 if !self.primitive => format!(
                    "random.db_uniform(low=-1.0, high=1.0, out_shape={}, out_dtype=\"float32\")",
                    list_text(s)
                ),
                0 => format!("ones(shape={}, dtype=\"float32\")", list_text(s)),
                1 => format!("zeros(shape={}, dtype=\"float32\")", list_text(s)),
                _ => format!(
                    "full({}, shape={}, dtype=\"float32\")",
                    self.float_lit(),
                    list_text(s)
                ),
            },
            _ => self.weight(s),
        }
    }

    /// A shape that broadcasts with another to give `s`.
    fn broadcast_partner(&mut self, s: &[usize]) -> Vec<usize> {
        match self.below(6) {
            0..=2 => s.to_vec(),
            3 => vec![],
            4 => {
                let k = self.below(s.len() + 1);
                s[k..].to_vec()
            }
            _ => s
                .iter()
                .map(|&d| if self.chance(0.5) { 1 } else { d })
                .collect(),
        }
    }

    fn tensor(&mut self, sc: &Scope, s: &[usize], depth: u32) -> String {
        if depth == 0 {
            return self.tensor_leaf(sc, s);
        }
        let d = depth - 1;
        let r = s.len();
        // Embedding lookups by the instance's tokens, where there are tokens in scope.
        let tokens = !self.vars_of(sc, &Ty::I(vec![1])).is_empty();
        let first = if tokens && r >= 1 && s[0] == 1 && self.chance(0.15) {
            Some(16)
        } else {
            None
        };
        for attempt in 0..8 {
            let pick = match first {
                Some(k) if attempt == 0 => k,
                _ => self.below(30),
            };
            match pick {
                0..=3 => {
                    let e = self.tensor(sc, s, d);
                    return match self.below(14) {
                        0 => format!("sigmoid({e})"),
                        1 => format!("tanh({e})"),
                        2 => format!("negative({e})"),
                        3 => format!("abs({e})"),
                        4 => format!("nn.relu({e})"),
                        5 => format!("exp({e})"),
                        6 => format!("copy({e})"),
                        7 => format!("log(add(abs({e}), 1f))"),
                        8 => format!("sqrt(abs({e}))"),
                        9 => format!("rsqrt(add(abs({e}), 1f))"),
                        10 => format!("clip({e}, a_min=-1.0, a_max=1.0)"),
                        11 => format!("-({e})"),
                        12 => format!("zeros_like({e})"),
                        _ => format!("ones_like({e})"),
                    };
                }
                4..=9 => {
                    let mut sa = s.to_vec();
                    let mut sb = self.broadcast_partner(s);
                    if self.chance(0.5) {
                        std::mem::swap(&mut sa, &mut sb);
                    }
                    let a = self.tensor(sc, &sa, d);
                    let b = self.tensor(sc, &sb, d);
                    // Sometimes the same expression twice, as plain code repeats itself (the
                    // compiler's common subexpressions merge it; draws in it stay two).
                    let b = if sa == sb && self.chance(0.1) {
                        a.clone()
                    } else {
                        b
                    };
                    return match self.below(11) {
                        0 => format!("add({a}, {b})"),
                        1 => format!("subtract({a}, {b})"),
                        2 => format!("multiply({a}, {b})"),
                        3 => format!("maximum({a}, {b})"),
                        4 => format!("minimum({a}, {b})"),
                        5 => format!("divide({a}, add(abs({b}), 1f))"),
                        6 => {
                            let x = self.tensor(sc, s, d);
                            let e = ["2f", "0.5f", "3f"][self.below(3)];
                            format!("add(power(abs({x}), {e}), multiply({a}, {b}))")
                        }
                        7 => format!("({a} + {b})"),
                        8 => format!("({a} * {b})"),
                        9 => format!("({a} - {b})"),
                        _ => {
                            let c = ["greater", "less", "greater_equal"][self.below(3)];
                            let x = self.tensor(sc, s, d);
                            format!("where({c}({a}, {b}), {x}, {b})")
                        }
                    };
                }
                10..=13 if r == 2 && self.chance(0.25) => {
                    // Weight on the left, as column-vector code writes it: `W · Xᵀ`, or its
                    // transpose `(W · Xᵀ)ᵀ` (the compiler's canonical products rewrite both).
                    let k = self.dim();
                    if self.chance(0.5) {
                        let w = self.weight(&[s[0], k]);
                        let x = if self.chance(0.5) {
                            self.tensor(sc, &[s[1], k], d)
                        } else {
                            format!("transpose({})", self.tensor(sc, &[k, s[1]], d))
                        };
                        return format!("nn.dense({w}, {x})");
                    }
                    let w = self.weight(&[s[1], k]);
                    let x = self.tensor(sc, &[s[0], k], d);
                    return format!("transpose(nn.dense({w}, {x}))");
                }
                10..=13 if r >= 1 => {
                    // nn.dense: mostly a shared weight, sometimes a per-instance right operand.
                    let n = s[r - 1];
                    let k = self.dim();
                    let mut sx = s.to_vec();
                    sx[r - 1] = k;
                    let x = self.tensor(sc, &sx, d);
                    let w = if self.chance(0.8) {
                        self.chosen_weight(sc, n, k)
                    } else {
                        self.tensor(sc, &[n, k], d)
                    };
                    return format!("nn.dense({x}, {w})");
                }
                14 | 15 if r >= 2 => {
                    let (axis, bl) = if self.chance(0.5) {
                        ("".to_string(), s[1])
                    } else {
                        (", axis=-1".to_string(), s[r - 1])
                    };
                    let x = self.tensor(sc, s, d);
                    let b = if self.chance(0.8) {
                        self.weight(&[bl])
                    } else {
                        self.tensor(sc, &[bl], d)
                    };
                    return format!("nn.bias_add({x}, {b}{axis})");
                }
                16 if r >= 1 && s[0] == 1 => {
                    // Embedding lookup by a token in scope, or a constant row.
                    let toks = self.vars_of(sc, &Ty::I(vec![1]));
                    let mut table = vec![VOCAB];
                    table.extend_from_slice(&s[1..]);
                    if !toks.is_empty() {
                        let t = toks[self.below(toks.len())].to_string();
                        if self.chance(0.3) {
                            // A per-instance index into per-instance data (a loss's
                            // `log_probs[label]`): tokens past the axis clip or wrap.
                            let mut sx = s.to_vec();
                            sx[0] = self.dim();
                            let x = self.tensor(sc, &sx, d);
                            let mode = ["clip", "wrap"][self.below(2)];
                            return format!("take({x}, {t}, axis=0, mode=\"{mode}\")");
                        }
                        let w = self.weight(&table);
                        return format!("take({w}, {t}, axis=0)");
                    }
                    let a = self.below(r + 1);
                    let v = self.dim();
                    let mut sx = s.to_vec();
                    sx.insert(a, v);
                    let x = self.tensor(sc, &sx, d);
                    return format!("take({x}, {}, axis={a})", self.below(v));
                }
                17 | 18 => {
                    let op = ["sum", "mean", "max", "min"][self.below(4)];
                    if r == 0 {
                        let sx = self.shape();
                        let x = self.tensor(sc, &sx, d);
                        return format!("{op}({x})");
                    }
                    let ones: Vec<usize> = (0..r).filter(|&a| s[a] == 1).collect();
                    if !ones.is_empty() && self.chance(0.5) {
                        let a = ones[self.below(ones.len())];
                        let mut sx = s.to_vec();
                        sx[a] = self.dim();
                        let x = self.tensor(sc, &sx, d);
                        return format!("{op}({x}, axis=[{a}], keepdims=True)");
                    }
                    let a = self.below(r + 1);
                    let mut sx = s.to_vec();
                    sx.insert(a, self.dim());
                    let x = self.tensor(sc, &sx, d);
                    return format!("{op}({x}, axis={a})");
                }
                19 if r >= 1 => {
                    let a = self.below(r);
                    let k = 2 + self.below(2);
                    let mut sx = s.to_vec();
                    sx[a] *= k;
                    let x = self.tensor(sc, &sx, d);
                    return format!(
                        "split({x}, indices_or_sections={k}, axis={a}).{}",
                        self.below(k)
                    );
                }
                20 if r >= 1 => {
                    let cands: Vec<usize> = (0..r).filter(|&a| s[a] >= 2).collect();
                    if cands.is_empty() {
                        continue;
                    }
                    let a = cands[self.below(cands.len())];
                    let d1 = 1 + self.below(s[a] - 1);
                    let (mut s1, mut s2) = (s.to_vec(), s.to_vec());
                    s1[a] = d1;
                    s2[a] = s[a] - d1;
                    let x = self.tensor(sc, &s1, d);
                    let y = self.tensor(sc, &s2, d);
                    return format!("concatenate(({x}, {y}), axis={a})");
                }
                21 => {
                    let n: usize = s.iter().product();
                    let sx = match self.below(3) {
                        0 => vec![n],
                        1 => {
                            let mut t = s.to_vec();
                            t.reverse();
                            t
                        }
                        _ => vec![1, n],
                    };
                    let x = self.tensor(sc, &sx, d);
                    let newshape = if r >= 1 && self.chance(0.3) {
                        let mut t: Vec<String> = s.iter().map(|d| d.to_string()).collect();
                        t[self.below(r)] = "-1".to_string();
                        format!("[{}]", t.join(", "))
                    } else {
                        list_text(s)
                    };
                    return format!("reshape({x}, newshape={newshape})");
                }
                22 if r >= 2 => {
                    if self.chance(0.3) {
                        let mut sx = s.to_vec();
                        sx.reverse();
                        let x = self.tensor(sc, &sx, d);
                        return format!("transpose({x})");
                    }
                    // axes p: out[i] = in[p[i]], so in[p[i]] = s[i].
                    let mut p: Vec<usize> = (0..r).collect();
                    for i in (1..r).rev() {
                        let j = self.below(i + 1);
                        p.swap(i, j);
                    }
                    let mut sx = vec![0; r];
                    for i in 0..r {
                        sx[p[i]] = s[i];
                    }
                    let x = self.tensor(sc, &sx, d);
                    return format!("transpose({x}, axes={})", list_text(&p));
                }
                23 if r >= 1 => {
                    let x = self.tensor(sc, s, d);
                    return match self.below(3) {
                        0 => format!("nn.softmax({x}, axis=-1)"),
                        1 => format!("nn.log_softmax({x}, axis=-1)"),
                        _ => {
                            let g = self.weight(&[s[r - 1]]);
                            let b = self.weight(&[s[r - 1]]);
                            format!("nn.layer_norm({x}, {g}, {b}, axis=-1)")
                        }
                    };
                }
                24 => {
                    let ones: Vec<usize> = (0..r).filter(|&a| s[a] == 1).collect();
                    if !ones.is_empty() && self.chance(0.5) {
                        let a = ones[self.below(ones.len())];
                        let mut sx = s.to_vec();
                        sx.remove(a);
                        let x = self.tensor(sc, &sx, d);
                        return format!("expand_dims({x}, axis={a})");
                    }
                    let a = self.below(r + 1);
                    let mut sx = s.to_vec();
                    sx.insert(a, 1);
                    let x = self.tensor(sc, &sx, d);
                    return format!("squeeze({x}, axis=[{a}])");
                }
                25 if r >= 1 && self.chance(0.5) => {
                    let a = self.below(r);
                    let extra = 1 + self.below(3);
                    let begin = self.below(extra + 1);
                    let mut sx = s.to_vec();
                    sx[a] += extra;
                    let x = self.tensor(sc, &sx, d);
                    return format!(
                        "strided_slice({x}, begin=[{begin}], end=[{}], axes=[{a}])",
                        begin + s[a]
                    );
                }
                25 if r == 3 => {
                    let k = self.dim();
                    let x = self.tensor(sc, &[s[0], s[1], k], d);
                    let y = self.tensor(sc, &[s[0], s[2], k], d);
                    return format!("nn.batch_matmul({x}, {y})");
                }
                26 => {
                    // argmax back to float: ties (after relu) must break the same way.
                    let a = self.below(r + 1);
                    let mut sx = s.to_vec();
                    sx.insert(a, self.dim());
                    // Over a random draw, not a computed value: values equal in exact arithmetic
                    // (rows of a constant) differ in the last bit between the engines' kernels,
                    // and then the index of the maximum does too.
                    if self.primitive {
                        continue;
                    }
                    let x = format!(
                        "random.db_uniform(low=-1.0, high=1.0, out_shape={}, out_dtype=\"float32\")",
                        list_text(&sx)
                    );
                    let op = ["argmax", "argmin"][self.below(2)];
                    return format!("cast({op}({x}, axis=[{a}]), dtype=\"float32\")");
                }
                27..=29 => {
                    if !self.primitive && self.chance(0.6) {
                        if let Some(e) = self.eliminator(sc, &Ty::F(s.to_vec()), depth) {
                            return e;
                        }
                    }
                    // A projection of a tuple-producing expression.
                    let t = Ty::Tup(vec![Ty::F(s.to_vec()), Ty::F(self.shape())]);
                    let e = self.expr(sc, &t, d);
                    return format!("({e}).0");
                }
                _ => {}
            }
        }
        self.tensor_leaf(sc, s)
    }

    // ---------------------------------------------------------------------------------------
    // Instances

    /// A random JSON value of type `t`.
    fn value(&mut self, t: &Ty) -> String {
        match t {
            Ty::F(s) => self.tensor_value(s),
            Ty::I(s) if s.is_empty() => format!("{}", self.below(4)),
            Ty::I(s) => self.int_value(s),
            Ty::Tup(ts) => {
                let parts: Vec<String> = ts.iter().map(|t| self.value(t)).collect();
                format!("[{}]", parts.join(", "))
            }
            Ty::List(e) => {
                let n = [0, 1, 1, 2, 2, 3, 3, 4, 4, 5][self.below(10)];
                let parts: Vec<String> = (0..n).map(|_| self.value(e)).collect();
                format!("[{}]", parts.join(", "))
            }
            Ty::Opt(e) => {
                if self.chance(0.75) {
                    format!("{{\"Some\": [{}]}}", self.value(e))
                } else {
                    "{\"None\": []}".to_string()
                }
            }
            Ty::Tree(e) => {
                let mut nodes = 1 + self.below(7);
                self.tree_value(e, &mut nodes)
            }
            Ty::Fn(..) => unreachable!("functions are not instance inputs"),
        }
    }

    /// A tree of at most `*left` nodes (consumed).
    fn tree_value(&mut self, e: &Ty, left: &mut usize) -> String {
        *left -= 1;
        let v = self.value(e);
        let mut kids = Vec::new();
        while *left > 0 && kids.len() < 3 && self.chance(0.7) {
            kids.push(self.tree_value(e, left));
        }
        format!("{{\"Rose\": [{v}, [{}]]}}", kids.join(", "))
    }

    fn tensor_value(&mut self, s: &[usize]) -> String {
        if s.is_empty() {
            return format!("{:.3}", self.r.normal_f64());
        }
        let parts: Vec<String> = (0..s[0]).map(|_| self.tensor_value(&s[1..])).collect();
        format!("[{}]", parts.join(", "))
    }

    fn int_value(&mut self, s: &[usize]) -> String {
        if s.is_empty() {
            return format!("{}", self.below(VOCAB));
        }
        let parts: Vec<String> = (0..s[0]).map(|_| self.int_value(&s[1..])).collect();
        format!("[{}]", parts.join(", "))
    }
}

/// A recursion's float state squashed by `tanh`, as an RNN's is: unbounded states (products of
/// states, powers) grow step by step, and so do the f32 rounding differences between the
/// engines' kernels, past any fixed tolerance. Other types pass unchanged.
fn squash(e: String, ty: &Ty) -> String {
    match ty {
        Ty::F(_) => format!("tanh({{\n{}\n}})", indent(&e)),
        _ => e,
    }
}

fn indent(s: &str) -> String {
    s.lines()
        .map(|l| format!("  {l}"))
        .collect::<Vec<_>>()
        .join("\n")
}
