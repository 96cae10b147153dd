//! The static optimizations on small programs: which sites the taint analysis hoists, where ghost
//! operators go, where automatic phase boundaries go.

use tumble_check::LoadOptions;
use tumble_compile::{optimize, Code, LowerOptions, Program, StaticOptions, StaticReport};
use tumble_ir::SourceMap;

fn compile(src: &str) -> (Program, StaticReport) {
    compile_with(src, StaticOptions::all())
}

/// Compiles `src` with the static optimizations `opts`. Float tensors of @main named `W…` or
/// `U…` are weights, the rest per instance (like `tumble explain`).
fn compile_with(src: &str, opts: StaticOptions) -> (Program, StaticReport) {
    let mut sources = SourceMap::new();
    let typed = tumble_check::load(&mut sources, "t.rly", src, LoadOptions::default())
        .unwrap_or_else(|d| panic!("{d:?}"));
    let mut p = Program::lower_with(&typed, LowerOptions::batched())
        .unwrap_or_else(|e| panic!("{}", e.message));
    let weights: Vec<bool> = typed
        .module
        .defs()
        .find(|d| d.name.name == "main")
        .map(|d| {
            d.func
                .params
                .iter()
                .map(|p| p.name.name.starts_with('W') || p.name.name.starts_with('U'))
                .collect()
        })
        .unwrap_or_default();
    let r = optimize(&mut p, "main", &weights, opts);
    (p, r)
}

fn hoisted_blocks(p: &Program, r: &StaticReport) -> Vec<String> {
    let mut v: Vec<String> = r
        .hoisted
        .iter()
        .map(|&s| p.blocks[p.sites[s as usize].block as usize].name.clone())
        .collect();
    v.sort();
    v
}

const RNN: &str = r#"
def @input(%x: Tensor[(1, 4), float32], %W: Tensor[(4, 4), float32], Primitive=1) -> Tensor[(1, 4), float32] {
  nn.dense(%x, %W)
}
def @step(%xw: Tensor[(1, 4), float32], %h: Tensor[(1, 4), float32], %U: Tensor[(4, 4), float32], Primitive=1)
    -> Tensor[(1, 4), float32] {
  tanh(add(%xw, nn.dense(%h, %U)))
}
def @rnn(%xs: List[Tensor[(1, 4), float32]], %h: Tensor[(1, 4), float32], %W: Tensor[(4, 4), float32],
         %U: Tensor[(4, 4), float32]) -> List[Tensor[(1, 4), float32]] {
  match (%xs) {
    Cons(%x, %rest) => {
      let %h2 = @step(@input(%x, %W), %h, %U);
      Cons(%h2, @rnn(%rest, %h2, %W, %U))
    },
    Nil => Nil,
  }
}
"#;

#[test]
fn rnn_input_transform_is_hoisted_and_the_step_is_not() {
    let src = format!(
        "{RNN}
def @main(%xs: List[Tensor[(1, 4), float32]], %W: Tensor[(4, 4), float32], %U: Tensor[(4, 4), float32]) -> List[Tensor[(1, 4), float32]] {{
  @rnn(%xs, zeros(shape=[1, 4], dtype=\"float32\"), %W, %U)
}}"
    );
    let (p, r) = compile(&src);
    let h = hoisted_blocks(&p, &r);
    assert!(h.contains(&"input".to_string()), "{h:?}");
    assert!(!h.contains(&"step".to_string()), "{h:?}");
}

#[test]
fn values_computed_before_a_recursion_stay_clean_inside_it() {
    // The embeddings are computed by @map (itself recursive) in @main; inside @rnn they are
    // received, not carried, so the input transform is still hoisted.
    let src = format!(
        "{RNN}
def @main(%xs: List[Tensor[(1, 4), float32]], %W: Tensor[(4, 4), float32], %U: Tensor[(4, 4), float32]) -> List[Tensor[(1, 4), float32]] {{
  let %e = @map(fn (%x: Tensor[(1, 4), float32]) -> Tensor[(1, 4), float32] {{ sigmoid(%x) }}, %xs);
  @rnn(%e, zeros(shape=[1, 4], dtype=\"float32\"), %W, %U)
}}"
    );
    let (p, r) = compile(&src);
    let h = hoisted_blocks(&p, &r);
    assert!(h.contains(&"input".to_string()), "{h:?}");
    assert!(h.iter().any(|n| n.contains("sigmoid")), "{h:?}");
    assert!(!h.contains(&"step".to_string()), "{h:?}");
}

#[test]
fn state_returned_up_a_tree_recursion_is_recursive_state() {
    let src = r#"
def @leaf(%x: Tensor[(1, 4), float32], %W: Tensor[(4, 4), float32], Primitive=1) -> Tensor[(1, 4), float32] {
  tanh(nn.dense(%x, %W))
}
def @node(%l: Tensor[(1, 4), float32], %r: Tensor[(1, 4), float32], Primitive=1) -> Tensor[(1, 4), float32] {
  tanh(add(%l, %r))
}
def @tree(%t: Tree[Tensor[(1, 4), float32]], %W: Tensor[(4, 4), float32]) -> Tensor[(1, 4), float32] {
  match (%t) {
    Rose(%x, Nil) => @leaf(%x, %W),
    Rose(_, Cons(%a, Cons(%b, Nil))) => @node(@tree(%a, %W), @tree(%b, %W)),
    Rose(%x, _) => %x,
  }
}
def @main(%t: Tree[Tensor[(1, 4), float32]], %W: Tensor[(4, 4), float32]) -> Tensor[(1, 4), float32] {
  @tree(%t, %W)
}
"#;
    let (p, r) = compile(src);
    let h = hoisted_blocks(&p, &r);
    assert_eq!(h, vec!["leaf".to_string()]);
}

#[test]
fn ghosts_align_arms_that_both_continue_into_the_recursion() {
    // REDUCE-like arm: one block, then recurse; SHIFT-like arm: recurse at once.
    let src = r#"
def @f(%h: Tensor[(1, 4), float32], Primitive=1) -> Tensor[(1, 4), float32] { tanh(%h) }
def @cond(%h: Tensor[(1, 4), float32], Primitive=1) -> Tensor[(), bool] {
  greater(sum(%h), 0f)
}
def @loop(%n: int32, %h: Tensor[(1, 4), float32]) -> Tensor[(1, 4), float32] {
  if (equal(%n, 0)) {
    %h
  } else {
    let %g = @f(%h);
    if (@cond(%g)) {
      let %k = @f(%g);
      @loop(subtract(%n, 1), %k)
    } else {
      @loop(subtract(%n, 1), %g)
    }
  }
}
def @main(%n: int32, %h: Tensor[(1, 4), float32]) -> Tensor[(1, 4), float32] { @loop(%n, %h) }
"#;
    let (_, r) = compile(src);
    let in_loop = ghosts_in(&r, "loop");
    // The inner conditional is padded; the base case next to the recursive case is not.
    assert_eq!(in_loop, vec![&vec![0, 1]], "{:?}", r.ghosts);
}

/// The ghost operators added per arm in function `name`'s conditionals.
fn ghosts_in<'r>(r: &'r StaticReport, name: &str) -> Vec<&'r Vec<u32>> {
    r.ghosts
        .iter()
        .filter(|g| g.function == name)
        .map(|g| &g.per_arm)
        .collect()
}

fn count(code: &Code, pred: &dyn Fn(&Code) -> bool) -> usize {
    let mut n = 0;
    code.visit(&mut |c| n += usize::from(pred(c)));
    n
}

#[test]
fn an_output_layer_after_a_recursion_gets_a_phase_boundary() {
    let main = |explicit: &str| {
        format!(
            "{RNN}
def @main(%xs: List[Tensor[(1, 4), float32]], %W: Tensor[(4, 4), float32], %U: Tensor[(4, 4), float32]) -> Tensor[(1, 4), float32] {{
  let %h0 = zeros(shape=[1, 4], dtype=\"float32\");
  let %hs = @rnn(%xs, %h0, %W, %U);
  {explicit}
  let %last = @hd(@rev(%hs));
  nn.dense(%last, %W)
}}"
        )
    };
    let (p, r) = compile(&main(""));
    assert_eq!(r.phases.len(), 1, "{:?}", r.phases);
    let entry = p.globals[p.global_index["main"] as usize] as usize;
    assert_eq!(
        count(&p.lambdas[entry].body, &|c| matches!(c, Code::Phase)),
        1
    );
    // The zeros before the recursion get no boundary; an explicit one suppresses the automatic one.
    let (p, r) = compile(&main("let %ph = db.phase_change();"));
    assert!(r.phases.is_empty(), "{:?}", r.phases);
    let entry = p.globals[p.global_index["main"] as usize] as usize;
    assert_eq!(
        count(&p.lambdas[entry].body, &|c| matches!(c, Code::Phase)),
        1
    );
}

#[test]
fn a_function_called_with_different_weights_is_cloned_per_call_site() {
    let main = |second_w: &str| {
        format!(
            "{RNN}
def @main(%xs: List[Tensor[(1, 4), float32]], %W: Tensor[(4, 4), float32], %U: Tensor[(4, 4), float32],
          %W2: Tensor[(4, 4), float32]) -> (List[Tensor[(1, 4), float32]], List[Tensor[(1, 4), float32]]) {{
  let %h0 = zeros(shape=[1, 4], dtype=\"float32\");
  (@rnn(%xs, %h0, %W, %U), @rnn(%xs, %h0, {second_w}, %U))
}}"
        )
    };
    let (p, r) = compile(&main("%W2"));
    assert_eq!(r.duplicated.len(), 1, "{:?}", r.duplicated);
    assert_eq!(r.duplicated[0].function, "rnn");
    // Only the block whose weight differs is cloned; `step` gets `%U` at both sites and stays one.
    assert_eq!(r.duplicated[0].blocks, vec!["input#2".to_string()]);
    // After cloning, every weight input is one value per launch.
    let weights = [false, true, true, true];
    let reuse = tumble_compile::analyze_reuse(&p, "main", &weights);
    assert!(
        !reuse
            .inputs
            .iter()
            .flatten()
            .any(|d| *d == tumble_compile::InputReuse::SharedPerCallSite),
        "{:?}",
        reuse.inputs
    );
    // The same weights at both call sites: nothing to separate.
    let (_, r) = compile(&main("%W"));
    assert!(r.duplicated.is_empty(), "{:?}", r.duplicated);
}

/// `n` helpers, each calling the next on its argument passed through `step`, the last returning
/// its argument; `@main` calls the first.
fn chain(n: usize, step: &str, extra: &str, main_body: &str) -> String {
    let mut s = String::from(extra);
    for i in 0..n {
        let body = if i + 1 == n {
            "%x".to_string()
        } else {
            format!("@f{}({step})", i + 1)
        };
        s.push_str(&format!(
            "def @f{i}(%x: Tensor[(1, 4), float32]) -> Tensor[(1, 4), float32] {{ {body} }}\n"
        ));
    }
    s.push_str(main_body);
    s
}

/// Scaling (hostile input): a chain of helpers each calling the next inlines only the chain's
/// tail — a function is inlined while its expanded body has at most `MAX_INLINED_OPS` operators —
/// instead of copying the whole rest of the chain into every helper (O(N²) nodes).
#[test]
fn a_chain_of_helpers_inlines_only_a_bounded_tail() {
    let n = 600;
    let src = chain(
        n,
        "negative(%x)",
        "",
        "def @main(%x: Tensor[(1, 4), float32]) -> Tensor[(1, 4), float32] { @f0(%x) }\n",
    );
    let (p, _) = compile(&src);
    let max = tumble_compile::inline::MAX_INLINED_OPS;
    // f_i has n - 1 - i operators once expanded: the last max + 1 helpers are inlinable.
    assert_eq!(p.inlined.len(), max + 1, "{:?}", p.inlined.len());
    assert!(p.inlined.contains(&format!("f{}", n - 1 - max)));
    assert!(!p.inlined.contains(&format!("f{}", n - 2 - max)));
    let nodes: usize = p.blocks.iter().map(|b| b.nodes.len()).sum();
    assert!(nodes <= n * (max + 1), "{nodes} block nodes");
}

/// Scaling (hostile input): helpers that only forward to the next have no operators, so the
/// operators' bound never stopped them: each was inlined with the whole rest of the chain (10,000
/// of them took 14 s to compile). Calls are bounded too (`MAX_INLINED_CALLS`): only the tail is.
#[test]
fn a_chain_of_forwarding_helpers_inlines_only_a_bounded_tail() {
    let n = 600;
    let src = chain(
        n,
        "%x",
        "",
        "def @main(%x: Tensor[(1, 4), float32]) -> Tensor[(1, 4), float32] { @f0(%x) }\n",
    );
    let (p, _) = compile(&src);
    let max = tumble_compile::inline::MAX_INLINED_CALLS;
    // f_i makes n - 1 - i calls once expanded: the last max + 1 helpers are inlinable.
    assert_eq!(p.inlined.len(), max + 1, "{:?}", p.inlined.len());
    assert!(p.inlined.contains(&format!("f{}", n - 1 - max)));
    assert!(!p.inlined.contains(&format!("f{}", n - 2 - max)));
}

/// Ghost operators cost a call by its callee's whole chain of blocks, computed callees first in one
/// pass (was one fixpoint round per link): in a recursion whose one arm runs a chain of 300
/// helpers, each invoking a `Primitive=1` cell, the other arm is padded to match (the same counts
/// as the fixpoint gave).
#[test]
fn ghosts_cost_a_long_call_chain() {
    let n = 300;
    let cell = "def @cell(%h: Tensor[(1, 4), float32], Primitive=1) -> Tensor[(1, 4), float32] { tanh(%h) }\n";
    let main = "def @loop(%n: int32, %h: Tensor[(1, 4), float32]) -> Tensor[(1, 4), float32] {
  if (equal(%n, 0)) {
    %h
  } else {
    let %g = @cell(%h);
    if (greater(sum(%g), 0f)) {
      @loop(subtract(%n, 1), @f0(%g))
    } else {
      @loop(subtract(%n, 1), %g)
    }
  }
}
def @main(%n: int32, %x: Tensor[(1, 4), float32]) -> Tensor[(1, 4), float32] { @loop(%n, %x) }
";
    let (_, r) = compile(&chain(n, "@cell(%x)", cell, main));
    let in_loop = ghosts_in(&r, "loop");
    assert_eq!(in_loop, vec![&vec![0, n as u32]], "{:?}", r.ghosts);
}

/// The names of the blocks the code of `@rnn` invokes.
fn invoked_blocks(p: &Program) -> Vec<String> {
    let mut names = Vec::new();
    for l in p.lambdas.iter().filter(|l| l.name == "rnn") {
        l.body.visit(&mut |c| {
            if let Code::InvokeBlock { block, .. } = c {
                names.push(p.blocks[*block as usize].name.clone());
            }
        });
    }
    names.sort();
    names.dedup();
    names
}

const RNN_MAIN: &str = "
def @main(%xs: List[Tensor[(1, 4), float32]], %W: Tensor[(4, 4), float32], %U: Tensor[(4, 4), float32]) -> List[Tensor[(1, 4), float32]] {
  @rnn(%xs, zeros(shape=[1, 4], dtype=\"float32\"), %W, %U)
}";

#[test]
fn a_hoisted_input_transform_merges_into_the_step_that_reads_it() {
    // Written as the step's operand (leaf inlining binds it with a `let`), and let-bound.
    let let_bound = RNN.replace(
        "let %h2 = @step(@input(%x, %W), %h, %U);",
        "let %xw = @input(%x, %W);\n      let %h2 = @step(%xw, %h, %U);",
    );
    assert_ne!(let_bound, RNN);
    for rnn in [RNN.to_string(), let_bound] {
        let src = format!("{rnn}{RNN_MAIN}");
        let (p, r) = compile_with(&src, StaticOptions::all());
        assert_eq!(r.merged.len(), 1, "{:?}", r.merged);
        assert_eq!(
            (r.merged[0].producer.as_str(), r.merged[0].consumer.as_str()),
            ("input", "step")
        );
        assert_eq!(invoked_blocks(&p), ["input+step"], "{p}");
        let merged = p.blocks.iter().find(|b| b.name == "input+step").unwrap();
        // The producer's inputs, then the step's others (`%xw` is the producer's output).
        let inputs: Vec<&str> = merged.inputs.iter().map(|i| i.name.as_str()).collect();
        assert_eq!(inputs.len(), 4, "{inputs:?}");
        assert!(tumble_compile::verify(&p).is_empty());
        // Off: the two blocks as written.
        let (p, r) = compile_with(
            &src,
            StaticOptions {
                merge: false,
                ..StaticOptions::all()
            },
        );
        assert!(r.merged.is_empty());
        assert_eq!(invoked_blocks(&p), ["input", "step"]);
    }
}

/// A merged step reading more product weight than `MERGE_MAX_WEIGHT_BYTES` (BiRNN-large's
/// 512 × 512 pair: 2 MiB) stays two blocks; 362 × 362 (1 MiB in all, just under) merges.
#[test]
fn a_merge_whose_step_would_read_weights_past_the_limit_is_not_made() {
    for (h, merges) in [(512usize, false), (362, true)] {
        let bytes = 2 * h * h * 4;
        assert_eq!(
            bytes <= tumble_compile::merge::MERGE_MAX_WEIGHT_BYTES,
            merges,
            "{h}: {bytes} bytes"
        );
        let src = format!("{RNN}{RNN_MAIN}")
            .replace("(1, 4)", &format!("(1, {h})"))
            .replace("(4, 4)", &format!("({h}, {h})"))
            .replace("shape=[1, 4]", &format!("shape=[1, {h}]"));
        let (p, r) = compile_with(&src, StaticOptions::all());
        assert_eq!(r.merged.len(), usize::from(merges), "{h}: {:?}", r.merged);
        // `explain` lists the pair kept apart, with the bytes it would have read.
        assert_eq!(
            r.not_merged.len(),
            usize::from(!merges),
            "{h}: {:?}",
            r.not_merged
        );
        if let Some(m) = r.merged.first().or(r.not_merged.first()) {
            assert_eq!(
                (m.producer.as_str(), m.consumer.as_str()),
                ("input", "step")
            );
            assert_eq!(m.weight_bytes, bytes, "{h}");
        }
        let want: &[&str] = if merges {
            &["input+step"]
        } else {
            &["input", "step"]
        };
        assert_eq!(invoked_blocks(&p), want, "{h}");
    }
}

#[test]
fn a_transform_read_twice_or_not_hoisted_is_not_merged() {
    // `%xw` read by the step and kept in the output list: no merge.
    let twice = RNN.replace(
        "let %h2 = @step(@input(%x, %W), %h, %U);\n      Cons(%h2,",
        "let %xw = @input(%x, %W);\n      let %h2 = @step(%xw, %h, %U);\n      Cons(add(%h2, %xw),",
    );
    assert_ne!(twice, RNN);
    let (p, r) = compile_with(&format!("{twice}{RNN_MAIN}"), StaticOptions::all());
    assert!(r.merged.is_empty(), "{:?}", r.merged);
    assert!(invoked_blocks(&p).contains(&"input".to_string()));
    // The input transform reading the state: not hoisted, so nothing merges.
    let stateful = RNN.replace(
        "@step(@input(%x, %W), %h, %U)",
        "@step(@input(%h, %W), %h, %U)",
    );
    assert_ne!(stateful, RNN);
    let (_, r) = compile_with(&format!("{stateful}{RNN_MAIN}"), StaticOptions::all());
    assert!(r.merged.is_empty(), "{:?}", r.merged);
}

/// A column-vector RNN step (`h: (4, 1)`, `W · h`): with canonical products the step's block
/// multiplies the instance's row by the weight (`nn.dense(row, W)`) and keeps its elementwise
/// tail on rows, one reshape at the end; the transposes and the weight-left products are gone.
/// Off: the block as written.
const COLUMN_RNN: &str = r#"
def @rnn(%xs: List[Tensor[(4, 1), float32]], %h: Tensor[(4, 1), float32], %W: Tensor[(4, 4), float32],
         %U: Tensor[(4, 4), float32], %Wb: Tensor[(4), float32]) -> List[Tensor[(4, 1), float32]] {
  match (%xs) {
    Cons(%x, %rest) => {
      let %h2 = tanh(add(add(nn.dense(%W, transpose(%x)), reshape(%Wb, newshape=[4, 1])),
                         transpose(nn.dense(transpose(%h), %U))));
      Cons(%h2, @rnn(%rest, %h2, %W, %U, %Wb))
    },
    Nil => Nil,
  }
}
def @main(%xs: List[Tensor[(4, 1), float32]], %W: Tensor[(4, 4), float32], %U: Tensor[(4, 4), float32],
          %Wb: Tensor[(4), float32]) -> List[Tensor[(4, 1), float32]] {
  @rnn(%xs, zeros(shape=[4, 1], dtype="float32"), %W, %U, %Wb)
}
"#;

fn step_block(p: &Program) -> &tumble_compile::Block {
    p.blocks
        .iter()
        .filter(|b| b.nodes.iter().any(|n| n.op.name == "tanh"))
        .max_by_key(|b| b.nodes.len())
        .expect("the step's block")
}

fn ops(b: &tumble_compile::Block) -> Vec<&'static str> {
    b.nodes.iter().map(|n| n.op.name).collect()
}

#[test]
fn column_vector_products_run_on_the_instances_rows() {
    let (p, r) = compile(COLUMN_RNN);
    assert!(r.canonical >= 4, "{}", r.canonical);
    let step = step_block(&p);
    let names = ops(step);
    assert!(!names.contains(&"transpose"), "{names:?}");
    // Every product has the instance's row on the left, a weight-derived operand on the right.
    for n in step.nodes.iter().filter(|n| n.op.name == "nn.dense") {
        let rows = match &n.args[0] {
            tumble_compile::BArg::One(v) => step.val_ty(v),
            _ => panic!("dense of a tuple"),
        };
        assert_eq!(rows.to_string(), "Tensor[(1, 4), float32]", "{names:?}");
    }
    // The tail (adds, tanh) is on rows; one reshape back to the column at the end.
    let tanh = step.nodes.iter().find(|n| n.op.name == "tanh").unwrap();
    assert_eq!(tanh.ty.to_string(), "Tensor[(1, 4), float32]");
    assert_eq!(names.last(), Some(&"reshape"), "{names:?}");
    assert!(tumble_compile::verify(&p).is_empty());

    let (p, r) = compile_with(
        COLUMN_RNN,
        StaticOptions {
            canon: false,
            ..StaticOptions::all()
        },
    );
    assert_eq!(r.canonical, 0);
    let names = ops(step_block(&p));
    assert!(names.contains(&"transpose"), "{names:?}");
}

/// A product whose left operand is the instance's (`X · Wᵀ` with `X` of one row, MV-RNN's
/// per-node matrices the other way round) is left alone: only a weight on the left is moved.
#[test]
fn products_with_the_instance_on_the_left_stay() {
    let src = r#"
def @main(%x: Tensor[(3, 4), float32], %v: Tensor[(1, 4), float32], %W: Tensor[(1, 4), float32])
    -> (Tensor[(3, 1), float32], Tensor[(1, 1), float32]) {
  (nn.dense(%x, %W), nn.dense(%x, %v).0)
}
"#;
    let src = src.replace(
        "nn.dense(%x, %v).0",
        "sum(nn.dense(%v, %W), axis=[1], keepdims=True)",
    );
    let (p, r) = compile(&src);
    assert_eq!(r.canonical, 0, "{p}");
}

/// The start of a binary-tree encoder `@enc`, up to its `Node` arm (format strings continue it).
const BTREE_ENC: &str = "type BTree {
  Leaf(Tensor[(1, 4), float32]),
  Node(BTree, BTree),
}
def @enc(%t: BTree, %W: Tensor[(4, 4), float32]) -> Tensor[(1, 4), float32] {
  match (%t) {
    Leaf(%x) => tanh(%x),
";

/// A binary-tree recursion whose second call is `second` (reading `%hl` or not), after `pre`.
fn two_calls(pre: &str, second: &str) -> String {
    format!(
        r#"
{BTREE_ENC}    Node(%l, %r) => {{
      {pre}
      let %hl = @enc(%l, %W);
      let %hr = {second};
      tanh(add(nn.dense(%hl, %W), %hr))
    }},
  }}
}}
def @gate(%h: Tensor[(1, 4), float32], %W: Tensor[(4, 4), float32]) -> Tensor[(1, 4), float32] {{
  if (greater(sum(%h), 0f)) {{ nn.dense(%h, %W) }} else {{ %h }}
}}
def @main(%t: BTree, %W: Tensor[(4, 4), float32]) -> Tensor[(1, 4), float32] {{ @enc(%t, %W) }}
"#
    )
}

fn concurrent_in(r: &StaticReport, function: &str) -> Vec<usize> {
    r.concurrent
        .iter()
        .filter(|c| c.function == function)
        .flat_map(|c| c.calls.clone())
        .collect()
}

#[test]
fn independent_calls_in_sequence_are_made_concurrent() {
    // Independent: one concurrent evaluation of the two calls, the bindings read from its tuple.
    let (p, r) = compile(&two_calls("", "@enc(%r, %W)"));
    assert_eq!(concurrent_in(&r, "enc"), vec![2], "{:?}", r.concurrent);
    let enc = p.globals[p.global_index["enc"] as usize] as usize;
    assert_eq!(
        count(
            &p.lambdas[enc].body,
            &|c| matches!(c, Code::Concurrent(es) if es.len() == 2)
        ),
        1
    );
    // The switch leaves the program as written.
    let off = StaticOptions {
        concurrency: false,
        ..StaticOptions::all()
    };
    let (p, r) = compile_with(&two_calls("", "@enc(%r, %W)"), off);
    assert!(r.concurrent.is_empty());
    let enc = p.globals[p.global_index["enc"] as usize] as usize;
    assert_eq!(
        count(&p.lambdas[enc].body, &|c| matches!(c, Code::Concurrent(_))),
        0
    );
    // The second reads the first's result, directly or through a closure: as written.
    for second in [
        "add(@enc(%r, %W), %hl)",
        "{ let %f = fn (%y: Tensor[(1, 4), float32]) -> Tensor[(1, 4), float32] { add(%y, %hl) }; %f(@enc(%r, %W)) }",
    ] {
        let (_, r) = compile(&two_calls("", second));
        assert!(r.concurrent.is_empty(), "{second}: {:?}", r.concurrent);
    }
    // A call that may wait on a computed tensor (a conditional on one), or that applies a closure
    // value, is made concurrent too: whether it waits is known at run time, where an element that
    // waited is followed as written.
    for second in [
        "@gate(@enc(%r, %W), %W)",
        "{ let %f = fn (%y: Tensor[(1, 4), float32]) -> Tensor[(1, 4), float32] { tanh(%y) }; %f(@enc(%r, %W)) }",
    ] {
        let (_, r) = compile(&two_calls("", second));
        assert_eq!(concurrent_in(&r, "enc"), vec![2], "{second}: {:?}", r.concurrent);
    }
    // A bare closure is not a call; an operator between the calls ends the run.
    let (_, r) = compile(&two_calls(
        "let %id = fn (%y: Tensor[(1, 4), float32]) -> Tensor[(1, 4), float32] { %y };",
        "@enc(%r, %W)",
    ));
    assert_eq!(concurrent_in(&r, "enc"), vec![2], "{:?}", r.concurrent);
}

/// The node's value a field of a tuple holding the two calls, `first` and `last` around them.
fn nested_calls(first: &str, last: &str) -> String {
    let at = usize::from(!first.is_empty());
    format!(
        r#"
{BTREE_ENC}    Node(%l, %r) => ({first}@enc(%l, %W), @enc(%r, %W){last}).{at},
  }}
}}
def @main(%t: BTree, %W: Tensor[(4, 4), float32]) -> Tensor[(1, 4), float32] {{ @enc(%t, %W) }}
"#
    )
}

#[test]
fn independent_calls_among_operands_are_made_concurrent() {
    // Calls as operands: independent by construction.
    for (first, last) in [
        ("", ""),
        ("%W, ", ""),
        (
            "",
            ", random.db_uniform(low=0.0, high=1.0, out_shape=[1, 4], out_dtype=\"float32\")",
        ),
    ] {
        let (_, r) = compile(&nested_calls(first, last));
        assert_eq!(
            concurrent_in(&r, "enc"),
            vec![2],
            "{first}|{last}: {:?}",
            r.concurrent
        );
    }
    // An operand with an effect (a random draw) before the calls: moving the calls ahead of it
    // would change the order of draws, so they stay.
    let draw = "random.db_uniform(low=0.0, high=1.0, out_shape=[1, 4], out_dtype=\"float32\"), ";
    let (_, r) = compile(&nested_calls(draw, ""));
    assert!(r.concurrent.is_empty(), "{:?}", r.concurrent);
}

#[test]
fn a_second_recursion_after_the_first_gets_a_phase_boundary() {
    let src = r#"
type BTree {
  Leaf(Tensor[(1, 4), float32]),
  Node(BTree, BTree),
}
def @enc(%t: BTree, %W: Tensor[(4, 4), float32]) -> Tensor[(1, 4), float32] {
  match (%t) {
    Leaf(%x) => tanh(%x),
    Node(%l, %r) => tanh(add(nn.dense(@enc(%l, %W), %W), @enc(%r, %W))),
  }
}
def @refine(%h: Tensor[(1, 4), float32], %n: int32, %W: Tensor[(4, 4), float32]) -> Tensor[(1, 4), float32] {
  if (greater(%n, 0)) { @refine(tanh(nn.dense(%h, %W)), subtract(%n, 1), %W) } else { %h }
}
def @main(%t: BTree, %W: Tensor[(4, 4), float32]) -> Tensor[(1, 4), float32] {
  let %h = @enc(%t, %W);
  let %g = @refine(%h, 3, %W);
  %g
}
"#;
    let (_, r) = compile(src);
    assert_eq!(r.phases, vec![1], "{:?}", r.phases);
}

/// An LSTM cell whose gate pre-activation is spelled out again inside each gate's slice: the
/// repeated products are merged before the hoisting split looks at the block, so the input's
/// product is still split off and hoisted (with the copies it was not: the whole step stayed
/// one block).
#[test]
fn products_spelled_once_per_gate_are_still_split_off() {
    let pre = "add(nn.bias_add(nn.dense(%x, %Wi), %bi), nn.dense(%h, %Wh))";
    let src = format!(
        r#"
def @lstm(%xs: List[Tensor[(1, 4), float32]], %h: Tensor[(1, 4), float32], %c: Tensor[(1, 4), float32],
          %Wi: Tensor[(16, 4), float32], %Wh: Tensor[(16, 4), float32], %bi: Tensor[(16), float32]) -> Tensor[(1, 4), float32] {{
  match (%xs) {{
    Cons(%x, %rest) => {{
      let %i = sigmoid(strided_slice({pre}, begin=[0, 0], end=[1, 4]));
      let %f = sigmoid(strided_slice({pre}, begin=[0, 4], end=[1, 8]));
      let %g = tanh(strided_slice({pre}, begin=[0, 8], end=[1, 12]));
      let %o = sigmoid(strided_slice({pre}, begin=[0, 12], end=[1, 16]));
      let %c2 = add(multiply(%f, %c), multiply(%i, %g));
      @lstm(%rest, multiply(%o, tanh(%c2)), %c2, %Wi, %Wh, %bi)
    }},
    Nil => %h,
  }}
}}
def @main(%xs: List[Tensor[(1, 4), float32]], %Wi: Tensor[(16, 4), float32], %Wh: Tensor[(16, 4), float32],
          %bi: Tensor[(16), float32]) -> Tensor[(1, 4), float32] {{
  let %z = zeros(shape=[1, 4], dtype="float32");
  @lstm(%xs, %z, %z, %Wi, %Wh, %bi)
}}
"#
    );
    let (_, r) = compile(&src);
    assert_eq!(r.split.len(), 1, "{:?}", r.split);
    assert!(r.cse >= 9, "{} repeated operators merged", r.cse);
}

/// A native prelude function called at several sites with its own literal index each
/// (`@nth(%xs, 0)`, `@nth(%xs, 1)`): its body's index blocks look shared per call site, but the
/// body never runs where the native form does, so it is not cloned — a clone (`@nth#2`) has no
/// native form, and every call of it was interpreted step by step (a GGNN's typed neighbour
/// lists: 108,072 host-run invocations against 11,844).
#[test]
fn a_native_prelude_function_is_not_cloned_per_call_site() {
    let src = r#"
def @main(%xs: List[Tensor[(1, 4), float32]], %W: Tensor[(4, 4), float32]) -> Tensor[(1, 4), float32] {
  let %a = @nth(%xs, 0);
  let %b = @nth(%xs, 1);
  let %c = @nth(%xs, 2);
  nn.dense(add(add(%a, %b), %c), %W)
}"#;
    let (p, r) = compile(src);
    assert!(r.duplicated.is_empty(), "{:?}", r.duplicated);
    let nth = p
        .global_index
        .get("nth")
        .copied()
        .expect("the prelude's @nth");
    assert!(p.natives.of(nth).is_some(), "@nth keeps its native form");
    assert!(
        !p.global_index.keys().any(|k| k.starts_with("nth#")),
        "{:?}",
        p.global_index.keys().collect::<Vec<_>>()
    );
}

/// `max` over every axis runs row first for `run`, and as written when compiled for gradients
/// (with ties, the row-first form would share the gradient among tied rows first).
#[test]
fn extremes_over_every_axis_stay_whole_for_gradients() {
    let src = r#"
def @main(%x: Tensor[(3, 4), float32], %W: Tensor[(4, 4), float32]) -> Tensor[(), float32] {
  max(nn.dense(%x, %W))
}"#;
    let extremes = |p: &Program| -> Vec<bool> {
        p.blocks
            .iter()
            .flat_map(|b| &b.nodes)
            .filter(|n| n.op.name == "max")
            .map(|n| n.attrs.get("axis").is_some())
            .collect()
    };
    let (run, _) = compile(src);
    assert_eq!(
        extremes(&run),
        vec![true, false],
        "rows first, then the rest"
    );
    let (grad, _) = compile_with(
        src,
        StaticOptions {
            for_gradients: true,
            ..StaticOptions::all()
        },
    );
    assert_eq!(extremes(&grad), vec![false], "as written");
}
