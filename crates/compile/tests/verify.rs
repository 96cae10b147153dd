//! The IR verifier: every zoo model verifies after lowering and after the static passes (in
//! debug builds the passes check themselves too), and each kind of broken invariant is reported
//! with its place.

use tumble_check::LoadOptions;
use tumble_compile::{
    optimize, verify, BArg, BVal, Code, LowerOptions, Pat, Program, StaticOptions,
};
use tumble_ir::SourceMap;

fn lower(src: &str) -> Program {
    let mut sources = SourceMap::new();
    let typed = tumble_check::load(&mut sources, "t.rly", src, LoadOptions::default())
        .unwrap_or_else(|d| panic!("{d:?}"));
    Program::lower_with(&typed, LowerOptions::batched()).unwrap_or_else(|e| panic!("{}", e.message))
}

fn root() -> std::path::PathBuf {
    std::path::PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../.."))
}

#[test]
fn every_zoo_model_verifies_after_each_step() {
    let mut n = 0;
    for dir in ["models", "models/plain", "models/acrobat"] {
        let Ok(entries) = std::fs::read_dir(root().join(dir)) else {
            continue;
        };
        for e in entries.flatten() {
            let path = e.path();
            if path.extension().and_then(|x| x.to_str()) != Some("rly") {
                continue;
            }
            let src = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{e}"));
            let mut p = lower(&src);
            assert_eq!(verify(&p), vec![], "{path:?} after lowering");
            let n_main = p
                .global_index
                .get("main")
                .and_then(|&g| p.globals.get(g as usize))
                .and_then(|&l| p.lambdas.get(l as usize))
                .map_or(0, |l| l.n_params as usize);
            // Every @main argument after the first as a weight, as the zoo's signatures are.
            let weights: Vec<bool> = (0..n_main).map(|i| i > 0).collect();
            optimize(&mut p, "main", &weights, StaticOptions::all());
            assert_eq!(verify(&p), vec![], "{path:?} after the static passes");
            n += 1;
        }
    }
    assert!(n >= 20, "only {n} models found");
}

const TREE: &str = r#"
def @leaf(%x: Tensor[(1, 4), float32], %W: Tensor[(4, 4), float32], Primitive=1) -> Tensor[(1, 4), float32] {
  tanh(nn.dense(%x, %W))
}
def @main(%t: Tree[Tensor[(1, 4), float32]], %W: Tensor[(4, 4), float32]) -> Tensor[(1, 4), float32] {
  match (%t) {
    Rose(%x, Nil) => @leaf(%x, %W),
    Rose(%x, %cs) => add(@leaf(%x, %W), @main(@hd(%cs), %W)),
  }
}
"#;

/// The first code node in `@main` satisfying `pred`, mutably.
fn find_in_main<'p>(p: &'p mut Program, pred: &dyn Fn(&Code) -> bool) -> Option<&'p mut Code> {
    let g = *p.global_index.get("main")?;
    let l = *p.globals.get(g as usize)?;
    let mut stack: Vec<&'p mut Code> = vec![&mut p.lambdas.get_mut(l as usize)?.body];
    while let Some(c) = stack.pop() {
        if pred(c) {
            return Some(c);
        }
        c.for_each_child_mut(|x| stack.push(x));
    }
    None
}

/// The verifier's findings as text, one a line.
fn lines(errors: Vec<tumble_compile::VerifyError>) -> String {
    errors
        .iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join("\n")
}

fn messages(p: &Program) -> String {
    lines(verify(p))
}

#[test]
fn broken_invariants_are_each_reported_with_their_place() {
    let clean = lower(TREE);
    assert_eq!(verify(&clean), vec![]);

    let mut p = lower(TREE);
    if let Some(c) = find_in_main(&mut p, &|c| matches!(c, Code::Slot(_))) {
        *c = Code::Slot(999);
    }
    let m = messages(&p);
    assert!(
        m.contains("function `main`") && m.contains("slot 999 is read"),
        "{m}"
    );

    let mut p = lower(TREE);
    if let Some(Code::CallGlobal { global, .. }) =
        find_in_main(&mut p, &|c| matches!(c, Code::CallGlobal { .. }))
    {
        *global = 77;
    }
    assert!(
        messages(&p).contains("global 77 is used"),
        "{}",
        messages(&p)
    );

    // A call with an argument more than the function takes (native or not).
    let mut p = lower(TREE);
    if let Some(Code::CallGlobal { args, .. }) =
        find_in_main(&mut p, &|c| matches!(c, Code::CallGlobal { .. }))
    {
        let extra = args.first().cloned();
        args.extend(extra);
    }
    assert!(
        messages(&p).contains("`main` takes 2 arguments, called with 3"),
        "{}",
        messages(&p)
    );

    let mut p = lower(TREE);
    if let Some(Code::InvokeBlock { args, .. }) =
        find_in_main(&mut p, &|c| matches!(c, Code::InvokeBlock { .. }))
    {
        args.pop();
    }
    assert!(
        messages(&p).contains("takes 2 inputs, invoked with 1"),
        "{}",
        messages(&p)
    );

    let mut p = lower(TREE);
    if let Some(Code::InvokeBlock { site, .. }) =
        find_in_main(&mut p, &|c| matches!(c, Code::InvokeBlock { .. }))
    {
        *site = 500;
    }
    assert!(
        messages(&p).contains("site 500 is used"),
        "{}",
        messages(&p)
    );

    let mut p = lower(TREE);
    if let Some(Code::Match { arms, .. }) =
        find_in_main(&mut p, &|c| matches!(c, Code::Match { .. }))
    {
        if let Some((Pat::Ctor(_, ps), _)) = arms.first_mut() {
            ps.push(Pat::Wild);
        }
    }
    assert!(
        messages(&p).contains("a pattern gives constructor"),
        "{}",
        messages(&p)
    );

    let mut p = lower(TREE);
    if let Some(b) = p.blocks.iter_mut().find(|b| b.name == "leaf") {
        if let Some(node) = b.nodes.first_mut() {
            node.args[0] = BArg::One(BVal::Node(5));
        }
    }
    let m = messages(&p);
    assert!(
        m.contains("block `leaf`") && m.contains("node 0 reads node 5"),
        "{m}"
    );

    let mut p = lower(TREE);
    if let Some(b) = p.blocks.iter_mut().find(|b| b.name == "leaf") {
        b.outputs = vec![BVal::Field(0, 3)];
    }
    assert!(
        messages(&p).contains("reads field 3 of node 0"),
        "{}",
        messages(&p)
    );

    let mut p = lower(TREE);
    if let Some(l) = p.lambdas.first_mut() {
        l.n_params = l.n_slots + 1;
    }
    assert!(
        messages(&p).contains("parameters in a frame of"),
        "{}",
        messages(&p)
    );
}

/// A slot read where nothing has set it — a pattern that no longer binds it, or a variable of
/// another `match` arm — is reported (a damaged compiled file could hold such code; the machine
/// would stop on it with an internal error).
#[test]
fn slots_read_before_anything_sets_them_are_reported() {
    let arm_slots = |p: &mut Program| -> Vec<Vec<u32>> {
        let Some(Code::Match { arms, .. }) = find_in_main(p, &|c| matches!(c, Code::Match { .. }))
        else {
            panic!("no match in @main");
        };
        arms.iter()
            .map(|(pat, _)| {
                let mut v = Vec::new();
                pat.for_each_slot(&mut |s| v.push(s));
                v
            })
            .collect()
    };
    // The first arm binds nothing any more: its reads of %x have no value.
    let mut p = lower(TREE);
    let bound = arm_slots(&mut p);
    assert_eq!(bound.len(), 2, "{bound:?}");
    if let Some(Code::Match { arms, .. }) =
        find_in_main(&mut p, &|c| matches!(c, Code::Match { .. }))
    {
        arms[0].0 = Pat::Wild;
    }
    let m = messages(&p);
    assert!(
        m.contains("function `main`")
            && m.contains(&format!(
                "slot {} is read where nothing has set it",
                bound[0][0]
            )),
        "{m}"
    );
    // The first arm reads the second arm's %cs.
    let mut p = lower(TREE);
    let cs = *bound[1].last().expect("the second arm binds %cs");
    assert!(!bound[0].contains(&cs), "{bound:?}");
    if let Some(Code::Match { arms, .. }) =
        find_in_main(&mut p, &|c| matches!(c, Code::Match { .. }))
    {
        let mut stack = vec![&mut arms[0].1];
        while let Some(c) = stack.pop() {
            if let Code::Slot(s) = c {
                if bound[0].contains(s) {
                    *s = cs;
                    break;
                }
            }
            c.for_each_child_mut(|x| stack.push(x));
        }
    }
    let m = messages(&p);
    assert!(
        m.contains(&format!("slot {cs} is read where nothing has set it")),
        "{m}"
    );
}

/// A finished program (one read back from a compiled file) whose native prelude function and
/// its lambda disagree on the arguments is malformed; `verify` alone allows it, since the static
/// passes change a global's parameters before they drop its native form.
#[test]
fn a_native_form_taking_other_arguments_is_refused_in_a_finished_program() {
    let mut p = lower(TREE);
    assert_eq!(tumble_compile::verify_finished(&p), vec![]);
    let g = p
        .natives
        .by_global
        .iter()
        .position(Option::is_some)
        .unwrap_or_else(|| panic!("no native prelude function in the lowered program"));
    let l = p.globals[g] as usize;
    p.lambdas[l].n_params += 1;
    p.lambdas[l].n_slots += 1;
    let m: Vec<String> = tumble_compile::verify_finished(&p)
        .iter()
        .map(ToString::to_string)
        .collect();
    assert!(m.iter().any(|e| e.contains("runs natively as")), "{m:?}");
}

fn finished_messages(p: &Program) -> String {
    lines(tumble_compile::verify_finished(p))
}

/// What a compiled file could be altered to say, each refused when it is read back: a native
/// prelude function running as another of its arity (`@hd` as `@tl`), the list constructors the
/// natives take not the prelude's, a loop table of another length than the globals, and a
/// global function referring to itself as a closure.
#[test]
fn altered_natives_loop_tables_and_self_references_are_refused() {
    let clean = lower(TREE);
    assert_eq!(finished_messages(&clean), "");
    let hd = clean
        .natives
        .by_global
        .iter()
        .position(|n| n.is_some_and(|n| n.name() == "hd"))
        .unwrap_or_else(|| panic!("`@hd` does not run natively"));

    let mut p = lower(TREE);
    p.natives.by_global[hd] = tumble_compile::program::Native::of_prelude("tl");
    let m = finished_messages(&p);
    assert!(
        m.contains("runs natively as `@tl`, but is not the prelude's `@tl`"),
        "{m}"
    );

    let mut p = lower(TREE);
    std::mem::swap(&mut p.natives.cons, &mut p.natives.nil);
    let m = finished_messages(&p);
    assert!(m.contains("not the prelude's `Cons`"), "{m}");

    let mut p = lower(TREE);
    p.natives.map_loops = vec![None; p.globals.len() - 1];
    let m = finished_messages(&p);
    assert!(m.contains("map loops has"), "{m}");

    let mut p = lower(TREE);
    if let Some(c) = find_in_main(&mut p, &|c| matches!(c, Code::Slot(_))) {
        *c = Code::SelfRef;
    }
    let m = messages(&p);
    assert!(
        m.contains("function `main`") && m.contains("refers to itself as a closure"),
        "{m}"
    );
}

/// A node whose recorded type is not what its operator gives for its arguments' types — a type
/// altered in a compiled file, or an argument rewired to another value — is reported (it would
/// otherwise compute with other shapes than the program says, silently).
#[test]
fn node_types_disagreeing_with_their_operators_are_reported() {
    let clean = lower(TREE);
    assert_eq!(verify(&clean), vec![]);
    let leaf = |p: &mut Program| -> usize {
        p.blocks
            .iter()
            .position(|b| b.name == "leaf")
            .unwrap_or_else(|| panic!("no block `leaf`"))
    };
    let mut p = lower(TREE);
    let b = leaf(&mut p);
    let last = p.blocks[b].nodes.len() - 1;
    p.blocks[b].nodes[last].ty = tumble_ir::Ty::tensor_of(&[1, 5], tumble_ir::DType::Float32);
    let m = messages(&p);
    assert!(
        m.contains("block `leaf`") && m.contains("is recorded as Tensor[(1, 5), float32]"),
        "{m}"
    );
    // The product reads its weight where it read its row: (4, 4) · (4, 4) is not (1, 4).
    let mut p = lower(TREE);
    let b = leaf(&mut p);
    let dense = p.blocks[b]
        .nodes
        .iter()
        .position(|n| n.op.name == "nn.dense")
        .unwrap_or_else(|| panic!("no product in `leaf`"));
    let weight = p.blocks[b].nodes[dense].args[1].clone();
    p.blocks[b].nodes[dense].args[0] = weight;
    let m = messages(&p);
    assert!(m.contains("(`nn.dense`) is recorded as"), "{m}");
}
