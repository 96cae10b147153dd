//! The passes that cut the host interpreter's work: entry arguments as per-run constants
//! ([`tumble_compile::consts`]), specialization on closures ([`tumble_compile::specialize`]) and
//! leaf inlining ([`tumble_compile::inline_leaves`]): what they rewrite, what they must leave
//! alone, and that the result verifies. (That outputs do not change is checked in the runtime's
//! tests: `plain_programs`, `equivalence` and the generated programs switch them.)

use tumble_check::LoadOptions;
use tumble_compile::{
    optimize, verify, CaptureFrom, Code, LowerOptions, Program, StaticOptions, StaticReport,
};
use tumble_ir::SourceMap;

fn compile(src: &str, opts: StaticOptions) -> (Program, StaticReport) {
    let mut sources = SourceMap::new();
    let typed = tumble_check::load(&mut sources, "t.rly", src, LoadOptions::default())
        .unwrap_or_else(|d| panic!("{d:?}"));
    let mut p = Program::lower_with(&typed, LowerOptions::batched())
        .unwrap_or_else(|e| panic!("{}", e.message));
    let n = p.lambdas[p.globals[p.global_index["main"] as usize] as usize].n_params as usize;
    let weights: Vec<bool> = (0..n).map(|i| i > 0).collect();
    let report = optimize(&mut p, "main", &weights, opts);
    assert_eq!(verify(&p), vec![]);
    (p, report)
}

fn params_only() -> StaticOptions {
    StaticOptions {
        params: true,
        ..StaticOptions::none()
    }
}

fn lambda<'p>(p: &'p Program, name: &str) -> &'p tumble_compile::Lambda {
    p.lambdas
        .iter()
        .find(|l| l.name == name)
        .unwrap_or_else(|| panic!("no lambda {name}"))
}

fn reads_param(code: &Code) -> Vec<u32> {
    let mut out = Vec::new();
    code.visit(&mut |c| {
        if let Code::Param(k) = c {
            out.push(*k);
        }
    });
    out
}

const RNN: &str = r#"
def @cell(%x: Tensor[(1, 4), float32], %W: Tensor[(4, 4), float32]) -> Tensor[(1, 4), float32] {
  tanh(nn.dense(%x, %W))
}
def @walk(%xs: List[Tensor[(1, 4), float32]], %h: Tensor[(1, 4), float32], %W: Tensor[(4, 4), float32]) -> Tensor[(1, 4), float32] {
  match (%xs) {
    Cons(%x, %rest) => @walk(%rest, add(@cell(%x, %W), %h), %W),
    Nil => %h,
  }
}
def @main(%xs: List[Tensor[(1, 4), float32]], %W: Tensor[(4, 4), float32]) -> Tensor[(1, 4), float32] {
  @walk(%xs, zeros(shape=[1, 4], dtype="float32"), %W)
}
"#;

#[test]
fn a_weight_passed_down_a_recursion_is_read_where_used_and_its_parameters_go() {
    let (p, report) = compile(RNN, params_only());
    // @walk's %W always holds @main's %W (argument 1).
    assert!(
        report.params.params.contains(&("walk".to_string(), 2)),
        "{report:?}"
    );
    assert_eq!(lambda(&p, "walk").n_params, 2);
    assert!(reads_param(&lambda(&p, "walk").body).contains(&1));
    // The call sites lost the argument too.
    lambda(&p, "walk").body.visit(&mut |c| {
        if let Code::CallGlobal { args, .. } = c {
            assert!(args.len() < 3, "{c:?}");
        }
    });
}

#[test]
fn the_pass_is_switchable() {
    let (p, report) = compile(RNN, StaticOptions::none());
    assert_eq!(report.params, Default::default());
    assert_eq!(lambda(&p, "walk").n_params, 3);
    assert_eq!(p.params_of, None);
}

#[test]
fn a_parameter_given_different_values_stays() {
    // @walk gets %W from @main and %U from the recursion: not one entry argument.
    let src = r#"
def @walk(%xs: List[Tensor[(1, 4), float32]], %h: Tensor[(1, 4), float32], %W: Tensor[(4, 4), float32], %U: Tensor[(4, 4), float32]) -> Tensor[(1, 4), float32] {
  match (%xs) {
    Cons(%x, %rest) => @walk(%rest, tanh(add(nn.dense(%x, %W), %h)), %U, %U),
    Nil => %h,
  }
}
def @main(%xs: List[Tensor[(1, 4), float32]], %W: Tensor[(4, 4), float32], %U: Tensor[(4, 4), float32]) -> Tensor[(1, 4), float32] {
  @walk(%xs, zeros(shape=[1, 4], dtype="float32"), %W, %U)
}
"#;
    let (p, report) = compile(src, params_only());
    // %W varies, %U (argument 3) is always @main's %U.
    assert_eq!(report.params.params, vec![("walk".to_string(), 3)]);
    assert_eq!(lambda(&p, "walk").n_params, 3, "{report:?}");
}

#[test]
fn a_weight_inside_a_value_is_not_the_value() {
    // The option holds %W; the option itself is not %W, what the match binds is.
    let src = r#"
def @main(%x: Tensor[(1, 4), float32], %W: Tensor[(4, 4), float32]) -> Tensor[(1, 4), float32] {
  let %o = Some(%W);
  match (%o) {
    Some(%w) => nn.dense(%x, %w),
    None => %x,
  }
}
"#;
    let (p, _) = compile(src, params_only());
    let main = lambda(&p, "main");
    let mut scrutinee_is_slot = false;
    main.body.visit(&mut |c| {
        if let Code::Match { scrutinee, .. } = c {
            scrutinee_is_slot = matches!(**scrutinee, Code::Slot(_));
        }
    });
    assert!(scrutinee_is_slot, "{:?}", main.body);
    assert!(
        reads_param(&main.body).iter().filter(|&&k| k == 1).count() >= 2,
        "{:?}",
        main.body
    );
}

#[test]
fn captures_of_weights_read_the_weight() {
    let src = r#"
def @main(%xs: List[Tensor[(1, 4), float32]], %W: Tensor[(4, 4), float32]) -> List[Tensor[(1, 4), float32]] {
  @map(fn (%x: Tensor[(1, 4), float32]) -> Tensor[(1, 4), float32] { nn.dense(%x, %W) }, %xs)
}
"#;
    let (p, report) = compile(src, params_only());
    assert!(report.params.captures >= 1, "{report:?}");
    // The closure made in @main no longer captures the slot holding %W.
    let mut made = Vec::new();
    lambda(&p, "main").body.visit(&mut |c| {
        if let Code::MakeClosure(m) = c {
            made.push(*m as usize);
        }
    });
    assert_eq!(made.len(), 1);
    for l in made.iter().map(|&m| &p.lambdas[m]) {
        assert!(
            l.captures
                .iter()
                .all(|(from, _)| !matches!(from, CaptureFrom::Slot(1))),
            "{}: {:?}",
            l.name,
            l.captures
        );
    }
}

#[test]
fn leaf_functions_are_copied_into_their_callers() {
    let src = r#"
def @first(%xs: List[Tensor[(1, 4), float32]]) -> Tensor[(1, 4), float32] {
  match (%xs) {
    Cons(%x, _) => %x,
    Nil => zeros(shape=[1, 4], dtype="float32"),
  }
}
def @main(%xs: List[Tensor[(1, 4), float32]], %W: Tensor[(4, 4), float32]) -> Tensor[(1, 4), float32] {
  nn.dense(@first(%xs), %W)
}
"#;
    let opts = StaticOptions {
        leaf_inline: true,
        ..StaticOptions::none()
    };
    let (p, report) = compile(src, opts);
    assert_eq!(report.leaf_calls_inlined, 1);
    let mut calls = 0;
    lambda(&p, "main").body.visit(&mut |c| {
        calls += usize::from(matches!(c, Code::CallGlobal { .. }));
    });
    assert_eq!(calls, 0, "{:?}", lambda(&p, "main").body);
    // Off: the call stays.
    let (p, report) = compile(src, StaticOptions::none());
    assert_eq!(report.leaf_calls_inlined, 0);
    let mut calls = 0;
    lambda(&p, "main").body.visit(&mut |c| {
        calls += usize::from(matches!(c, Code::CallGlobal { .. }));
    });
    assert_eq!(calls, 1);
}

#[test]
fn every_zoo_model_verifies_with_both_passes() {
    for name in [
        "treelstm_small",
        "birnn_small",
        "mvrnn_small",
        "stackrnn_small",
        "nestedrnn_small",
        "drnn_small",
        "berxit_small",
    ] {
        let path = std::path::PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../../models"))
            .join(format!("{name}.rly"));
        let src = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{e}"));
        let (_, report) = compile(&src, StaticOptions::all());
        assert!(report.params.reads > 0, "{name}: {report:?}");
    }
}

#[test]
fn map_over_a_closure_becomes_a_direct_loop() {
    let src = r#"
def @main(%xs: List[Tensor[(1, 4), float32]], %W: Tensor[(4, 4), float32]) -> List[Tensor[(1, 4), float32]] {
  @map(fn (%x: Tensor[(1, 4), float32]) -> Tensor[(1, 4), float32] { tanh(nn.dense(%x, %W)) }, %xs)
}
"#;
    let (p, report) = compile(src, StaticOptions::all());
    assert_eq!(report.specialized.len(), 1, "{report:?}");
    assert_eq!(report.specialized[0].function, "map");
    let spec = lambda(&p, &report.specialized[0].name);
    assert_eq!(spec.n_params, 1);
    // No call through a closure value is left in the loop, and no closure is made.
    spec.body.visit(&mut |c| {
        assert!(
            !matches!(c, Code::Call { .. } | Code::MakeClosure(_)),
            "{c:?}"
        );
    });
    // @main calls the clone without the closure.
    let mut made = 0;
    lambda(&p, "main")
        .body
        .visit(&mut |c| made += usize::from(matches!(c, Code::MakeClosure(_))));
    assert_eq!(made, 0, "{:?}", lambda(&p, "main").body);
    // Off: nothing specialized.
    let opts = StaticOptions {
        specialize: false,
        ..StaticOptions::all()
    };
    let (_, report) = compile(src, opts);
    assert!(report.specialized.is_empty());
}

/// A `let`-bound closure that every call it was passed to no longer takes is not made at all;
/// one still read elsewhere stays.
#[test]
fn a_let_bound_closure_left_unread_by_specialization_goes() {
    let src = r#"
def @main(%xs: List[Tensor[(1, 4), float32]], %W: Tensor[(4, 4), float32]) -> (Tensor[(1, 4), float32], Tensor[(1, 4), float32]) {
  let %plus = fn (%a: Tensor[(1, 4), float32], %b: Tensor[(1, 4), float32]) -> Tensor[(1, 4), float32] { add(%a, %b) };
  let %times = fn (%a: Tensor[(1, 4), float32], %b: Tensor[(1, 4), float32]) -> Tensor[(1, 4), float32] { multiply(%a, %b) };
  let %z = zeros(shape=[1, 4], dtype="float32");
  (@foldl(%plus, %z, %xs), %times(@foldl(%plus, %z, %xs), %z))
}
"#;
    let (p, report) = compile(src, StaticOptions::all());
    assert!(!report.specialized.is_empty(), "{report:?}");
    let mut made = Vec::new();
    lambda(&p, "main").body.visit(&mut |c| {
        if let Code::MakeClosure(k) = c {
            made.push(p.lambdas[*k as usize].name.clone());
        }
    });
    // `%plus` went with its specialized calls; `%times`, called through its value, stays.
    assert_eq!(made.len(), 1, "{made:?}: {:?}", lambda(&p, "main").body);
    assert!(made[0].contains("times"), "{made:?}");
}

#[test]
fn a_closure_capturing_an_instance_input_is_specialized_too() {
    let src = r#"
def @main(%xs: List[Tensor[(1, 4), float32]], %y: Tensor[(1, 4), float32], %W: Tensor[(4, 4), float32]) -> List[Tensor[(1, 4), float32]] {
  @map(fn (%x: Tensor[(1, 4), float32]) -> Tensor[(1, 4), float32] { add(nn.dense(%x, %W), %y) }, %xs)
}
"#;
    let mut sources = SourceMap::new();
    let typed = tumble_check::load(&mut sources, "t.rly", src, LoadOptions::default())
        .unwrap_or_else(|d| panic!("{d:?}"));
    let mut p = Program::lower_with(&typed, LowerOptions::batched())
        .unwrap_or_else(|e| panic!("{}", e.message));
    // %y (argument 1) is an instance input here, but it is still one value per run of @main:
    // the capture becomes a read of the argument, and the closure then captures nothing.
    let report = optimize(&mut p, "main", &[false, false, true], StaticOptions::all());
    assert_eq!(verify(&p), vec![]);
    assert_eq!(report.specialized.len(), 1, "{report:?}");
}

/// The index of the global whose function is named `name` (specialized copies have no entry in
/// `global_index`).
fn global(p: &Program, name: &str) -> u32 {
    (0..p.globals.len() as u32)
        .find(|&g| p.lambdas[p.globals[g as usize] as usize].name == name)
        .unwrap_or_else(|| panic!("no global {name}"))
}

#[test]
fn functions_shaped_like_map_run_as_loops() {
    let src = r#"
def @f(%x: Tensor[(1, 4), float32], %W: Tensor[(4, 4), float32]) -> Tensor[(1, 4), float32] {
  tanh(nn.dense(%x, %W))
}
def @first_or(%x: Tensor[(1, 4), float32], %xs: List[Tensor[(1, 4), float32]]) -> Tensor[(1, 4), float32] {
  match (%xs) {
    Cons(%y, _) => add(%x, %y),
    Nil => %x,
  }
}
def @mine(%xs: List[Tensor[(1, 4), float32]], %W: Tensor[(4, 4), float32]) -> List[Tensor[(1, 4), float32]] {
  match (%xs) {
    Cons(%x, %rest) => {
      let %r = db.concurrent((@f(%x, %W), @mine(%rest, %W)));
      Cons(%r.0, %r.1)
    },
    Nil => Nil,
  }
}
def @peek(%xs: List[Tensor[(1, 4), float32]], %W: Tensor[(4, 4), float32]) -> List[Tensor[(1, 4), float32]] {
  match (%xs) {
    Cons(%x, %rest) => {
      let %r = db.concurrent((@first_or(%x, %rest), @peek(%rest, %W)));
      Cons(%r.0, %r.1)
    },
    Nil => Nil,
  }
}
def @main(%xs: List[Tensor[(1, 4), float32]], %W: Tensor[(4, 4), float32]) -> (List[Tensor[(1, 4), float32]], List[Tensor[(1, 4), float32]], List[Tensor[(1, 4), float32]]) {
  (@mine(%xs, %W), @peek(%xs, %W), @map(fn (%x: Tensor[(1, 4), float32]) -> Tensor[(1, 4), float32] { @f(%x, %W) }, %xs))
}
"#;
    let (p, report) = compile(src, StaticOptions::all());
    assert!(p.natives.is_map_loop(global(&p, "mine")));
    let ml = p
        .natives
        .map_loop(global(&p, "mine"))
        .unwrap_or_else(|| panic!("@mine is not a loop"));
    assert_eq!(ml.list, 0);
    // The element reads the rest of the list: not a loop.
    assert!(!p.natives.is_map_loop(global(&p, "peek")));
    // The prelude's @map specialized on the closure is one.
    assert_eq!(report.specialized.len(), 1, "{report:?}");
    let copy = global(&p, &report.specialized[0].name);
    assert!(p.natives.is_map_loop(copy));
    // Only with the evaluator's fast steps (the reference lowering has none).
    let mut sources = SourceMap::new();
    let typed = tumble_check::load(&mut sources, "t.rly", src, LoadOptions::default())
        .unwrap_or_else(|d| panic!("{d:?}"));
    let opts = LowerOptions {
        natives: false,
        ..LowerOptions::batched()
    };
    let mut q = Program::lower_with(&typed, opts).unwrap_or_else(|e| panic!("{}", e.message));
    optimize(&mut q, "main", &[false, true], StaticOptions::all());
    assert!(!q.natives.is_map_loop(global(&q, "mine")));
}

#[test]
fn functions_shaped_like_foldl_run_as_loops() {
    let src = r#"
def @fsum(%acc: Tensor[(1, 4), float32], %xs: List[Tensor[(1, 4), float32]], %W: Tensor[(4, 4), float32]) -> Tensor[(1, 4), float32] {
  match (%xs) {
    Cons(%x, %rest) => @fsum(tanh(add(nn.dense(%acc, %W), %x)), %rest, %W),
    Nil => %acc,
  }
}
def @peek(%acc: Tensor[(1, 4), float32], %xs: List[Tensor[(1, 4), float32]]) -> Tensor[(1, 4), float32] {
  match (%xs) {
    Cons(%x, %rest) => @peek(add(%acc, @hd(%xs)), %rest),
    Nil => %acc,
  }
}
def @main(%xs: List[Tensor[(1, 4), float32]], %W: Tensor[(4, 4), float32]) -> (Tensor[(1, 4), float32], Tensor[(1, 4), float32], Tensor[(1, 4), float32]) {
  let %z = zeros(shape=[1, 4], dtype="float32");
  (@fsum(%z, %xs, %W), @peek(%z, %xs), @foldl(fn (%a: Tensor[(1, 4), float32], %x: Tensor[(1, 4), float32]) -> Tensor[(1, 4), float32] { multiply(%a, %x) }, %z, %xs))
}
"#;
    let (p, report) = compile(src, StaticOptions::all());
    let fl = p
        .natives
        .fold_loop(global(&p, "fsum"))
        .unwrap_or_else(|| panic!("@fsum is not a loop"));
    assert_eq!((fl.acc, fl.list), (0, 1));
    // The step reads the list itself (the current tail in the recursion): not a loop.
    assert!(p.natives.fold_loop(global(&p, "peek")).is_none());
    // The prelude's @foldl specialized on the closure is one.
    let copy = report
        .specialized
        .iter()
        .find(|s| s.name.starts_with("foldl"))
        .unwrap_or_else(|| panic!("@foldl not specialized: {report:?}"));
    assert!(p.natives.fold_loop(global(&p, &copy.name)).is_some());
    // Not a map loop, and a map loop is not a fold.
    assert!(!p.natives.is_map_loop(global(&p, "fsum")));
}
