//! Programs written plainly — no `Primitive=1`, tuples and projections where the math has them —
//! run batched and agree with the reference. Each test is a bug found once, kept small.

mod common;

use common::{batch_profile, check_all_ways, expected, load_text};

// The plain TreeLSTM against the reference under every scheduler and batch size: equivalence.rs
// (`plain_treelstm`).

fn agrees(name: &str, src: &str, inputs: &str, instance_args: &[&str]) {
    let l = load_text(name, src);
    check_all_ways(&expected(name, l, inputs, instance_args));
}

/// Instances `{"x": [[...]]}` of `n` float rows of width `w`, all different.
fn rows(count: usize, w: usize) -> String {
    matrices(count, 1, w)
}

/// Instances `{"x": [...]}` of an `r × w` float matrix each, all different.
fn matrices(count: usize, r: usize, w: usize) -> String {
    (0..count)
        .map(|i| {
            let m: Vec<String> = (0..r)
                .map(|k| {
                    let row: Vec<String> = (0..w)
                        .map(|j| {
                            let v = ((i * 7 + j * 3 + k * 5) % 11) as f64 / 5.0 - 1.0;
                            format!("{v:.3}")
                        })
                        .collect();
                    format!("[{}]", row.join(", "))
                })
                .collect();
            format!("{{\"x\": [{}]}}", m.join(", "))
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// `src` on `inputs` (JSON lines; `instance_args` are per-instance, the rest weights) equals the
/// reference every way ([`check_all_ways`]), and no operator of its launches falls back to
/// per-invocation calls.
fn batches_without_loops(name: &str, src: &str, inputs: &[String], instance_args: &[&str]) {
    let x = expected(
        name,
        load_text(name, src),
        &inputs.join("\n"),
        instance_args,
    );
    check_all_ways(&x);
    let profile = batch_profile(&x, tumble_runtime::Options::default());
    assert!(
        profile.ops.looped == 0 && profile.ops.batched > 0,
        "{name}: {profile}"
    );
}

/// A coarsened run whose outputs include a tuple (`split`'s pieces) next to a tensor: the run's
/// flat outputs were read through the rebuilt nested tuple ("tuple has no field 2").
#[test]
fn split_pieces_and_a_tensor_leave_one_run() {
    let src = r#"
def @main(%x: Tensor[(1, 6), float32], %w: Tensor[(6, 6), float32])
    -> (Tensor[(1, 2), float32], Tensor[(1, 2), float32]) {
  let %y = nn.dense(%x, %w);
  let %s = split(%y, indices_or_sections=3, axis=1);
  let %c = add(sigmoid(%s.0), tanh(%s.2));
  (%c, multiply(sigmoid(%s.1), tanh(%c)))
}
"#;
    agrees("split_run", src, &rows(9, 6), &["x"]);
}

/// A product whose second operand is a per-instance product computed in the same block: on the
/// GPU executor (here the emulated device, through `check_all_ways`) it was looked up as a host
/// weight and failed the launch ("block value %0 is not available"; program generator, seed 9).
#[test]
fn a_product_by_a_computed_product_on_the_device() {
    let src = r#"
def @main(%x: Tensor[(1, 2), float32], %y: Tensor[(3, 4), float32], %u: Tensor[(4, 2), float32])
    -> Tensor[(1, 3), float32] {
  tanh(transpose(nn.dense(%y, nn.dense(%x, %u))))
}
"#;
    // `%y` per instance: the product stays `nn.dense(Y, P)` (no canonical swap to a weight).
    let inputs: Vec<String> = (0..9)
        .map(|i| {
            let y: Vec<String> = (0..3)
                .map(|r| {
                    let row: Vec<String> = (0..4)
                        .map(|j| format!("{:.2}", ((i + r * 5 + j * 3) % 7) as f64 / 4.0 - 0.7))
                        .collect();
                    format!("[{}]", row.join(", "))
                })
                .collect();
            format!(
                "{{\"x\": [[{:.2}, {:.2}]], \"y\": [{}]}}",
                i as f64 / 5.0 - 0.8,
                0.3 - i as f64 / 7.0,
                y.join(", ")
            )
        })
        .collect();
    agrees("product_by_product", src, &inputs.join("\n"), &["x", "y"]);
}

/// A let-bound tuple of operator results, projected later ("tuple has no field 1").
#[test]
fn let_bound_tuple_projected() {
    let src = r#"
def @main(%x: Tensor[(1, 4), float32]) -> Tensor[(1, 4), float32] {
  let %t = (negative(%x), tanh(%x));
  %t.0
}
"#;
    agrees("tuple_proj", src, &rows(9, 4), &["x"]);
}

/// A fold that grows its accumulator from `(1, 1)` by a closure returning `(1, ?)`: typed `(1, 1)`
/// by its start value, the transpose of the result was dropped as a no-op on a single row (a
/// wrong value and gradient, no error; an audit's). Lists of one to five rows.
#[test]
fn a_fold_growing_from_a_known_width() {
    let src = r#"
def @main(%xs: List[Tensor[(1, 1), float32]], %H: Tensor[(5, 5), float32]) -> Tensor[(5, 5), float32] {
  let %a = @foldl(fn (%acc: Tensor[(1, ?), float32], %s: Tensor[(1, 1), float32]) -> Tensor[(1, ?), float32] {
    concatenate((%acc, %s), axis=1)
  }, @hd(%xs), @tl(%xs));
  let %t = transpose(%a);
  let %pad = zeros(shape=[5, 1], dtype="float32");
  let %col = strided_slice(concatenate((%t, %pad), axis=0), begin=[0, 0], end=[5, 1]);
  multiply(%col, %H)
}
"#;
    let inputs: Vec<String> = (1..=9)
        .map(|i| {
            let n = i % 5 + 1;
            let xs: Vec<String> = (0..n).map(|j| format!("[[{}.5]]", i + j)).collect();
            format!("{{\"xs\": [{}]}}", xs.join(", "))
        })
        .collect();
    agrees("fold_grows", src, &inputs.join("\n"), &["xs"]);
}

/// Logs of results in f32's denormal range: the fused kernels' `exp` flushed e^x to 0 below -87
/// (and `sigmoid` below -88.7), so `log(sigmoid(-95))` was -inf where the reference gives -95
/// (an audit's find); `log(softmax)` over logits spread past 87 alike.
#[test]
fn logs_of_denormal_exps_and_sigmoids() {
    let src = r#"
def @main(%z: Tensor[(1, 4), float32]) -> (Tensor[(1, 4), float32], Tensor[(1, 4), float32], Tensor[(1, 4), float32]) {
  (log(sigmoid(%z)), log(exp(%z)), log(nn.softmax(%z)))
}
"#;
    let inputs: Vec<String> = (0..9)
        .map(|i| {
            let a = -86.0 - 2.0 * i as f64;
            format!("{{\"z\": [[{a}, {}, {}, 0.5]]}}", a - 5.0, -60.0 - i as f64)
        })
        .collect();
    agrees("denormal_logs", src, &inputs.join("\n"), &["z"]);
}

/// Layer norm of rows with a large mean and a small spread: the fused row program subtracted the
/// mean rounded to f32, shifting every output by 0.4% of the spread (an audit's find).
#[test]
fn layer_norm_of_rows_far_from_zero() {
    let src = r#"
def @main(%x: Tensor[(1, 8), float32], %g: Tensor[(8), float32], %b: Tensor[(8), float32]) -> Tensor[(1, 8), float32] {
  tanh(nn.layer_norm(%x, %g, %b, axis=-1, epsilon=1e-5))
}
"#;
    let inputs: Vec<String> = (0..9)
        .map(|i| {
            let row: Vec<String> = (0..8)
                .map(|j| {
                    format!(
                        "{:.4}",
                        1000.0 + i as f64 + ((i * 5 + j * 3) % 7) as f64 * 0.0021
                    )
                })
                .collect();
            format!("{{\"x\": [[{}]]}}", row.join(", "))
        })
        .collect();
    agrees("layer_norm_far", src, &inputs.join("\n"), &["x"]);
}

/// The operators added in the forty-fifth session, batched every way against the reference:
/// inverse and hyperbolic trigonometry, base-2/10 logs, NaN/inf tests, `logical_xor`, `prod`,
/// `all`/`any`, Relay's two-argument `variance` (the keepdims mean, as `relay.variance` passes
/// it, and `std` as its square root) and TVM's `fast_*` names.
#[test]
fn trigonometry_tests_products_and_variance() {
    let src = r#"
def @main(%x: Tensor[(1, 6), float32])
    -> (Tensor[(1, 6), float32], Tensor[(1, 6), float32], Tensor[(1, 6), bool], Tensor[(1), float32],
        Tensor[(1), bool], Tensor[(1, 1), float32], Tensor[(1), float32], Tensor[(1, 6), float32]) {
  let %t = multiply(tanh(%x), 0.9f);
  let %m = mean(%x, axis=[1], keepdims=True);
  (add(add(tan(%t), asin(%t)), add(acos(%t), atanh(%t))),
   add(add(sinh(%x), cosh(%x)), add(add(asinh(%x), atan(%x)), add(log2(add(abs(%x), 1f)), log10(add(abs(%x), 1f))))),
   logical_xor(isnan(log(%x)), isfinite(divide(1f, %x))),
   prod(add(%t, 1f), axis=[1]),
   logical_and(all(greater(%x, -2f), axis=[1]), any(less(%x, 0f), axis=[1])),
   variance(%x, %m, axis=[1], keepdims=True),
   sqrt(variance(%x, %m, axis=[1], unbiased=True)),
   add(fast_exp(%t), add(fast_tanh(%x), fast_erf(%x))))
}
"#;
    let inputs: Vec<String> = (0..9)
        .map(|i| {
            let row: Vec<String> = (0..6)
                .map(|j| format!("{:.3}", ((i * 5 + j * 3) % 13) as f64 / 4.0 - 1.5))
                .collect();
            format!("{{\"x\": [[{}]]}}", row.join(", "))
        })
        .collect();
    agrees("new_operators", src, &inputs.join("\n"), &["x"]);
}

/// A layer norm written by hand with Relay's `variance` (each instance's keepdims mean, and one
/// for the whole mini-batch) runs batched: `variance` ran once per invocation (an audit's find:
/// the batched engine slower than `--batch 1`).
#[test]
fn a_layer_norm_written_with_variance_batches() {
    let src = r#"
def @main(%x: Tensor[(1, 6), float32], %c: Tensor[(1, 1), float32]) -> (Tensor[(1, 6), float32], Tensor[(1), float32]) {
  let %m = mean(%x, axis=[1], keepdims=True);
  let %v = variance(%x, %m, axis=[1], keepdims=True);
  (divide(subtract(%x, %m), sqrt(add(%v, 1e-5f))), variance(%x, %c, axis=[-1], unbiased=True))
}
"#;
    let inputs: Vec<String> = (0..9)
        .map(|i| {
            let row: Vec<String> = (0..6)
                .map(|j| format!("{:.3}", ((i * 5 + j * 3) % 13) as f64 / 4.0 - 1.5))
                .collect();
            format!("{{\"x\": [[{}]]}}", row.join(", "))
        })
        .collect();
    batches_without_loops("hand_layer_norm", src, &inputs, &["x"]);
}

/// Where the true result is tiny next to the values computed on the way (a numerics audit's
/// finds), compared with no absolute tolerance: layer norm whose `y * g + b` nearly cancels
/// (the row program rounded `y`, then `y * g`, then the sum: 0 where the reference gives
/// ∓2.8e-8), an epsilon below f32's least (1e-50 became 0: a constant row gave NaN), and a
/// log-softmax whose top element is within e^-40 of 1 (`ln` of the sum lost it: 0 in both
/// engines instead of -2.5e-17 — the reference is pinned to the true value too).
#[test]
fn results_tiny_next_to_their_terms() {
    let src = r#"
def @main(%x: Tensor[(1, 8), float32], %g: Tensor[(8), float32], %b: Tensor[(8), float32],
          %z: Tensor[(1, 8), float32])
    -> (Tensor[(1, 8), float32], Tensor[(1, 8), float32], Tensor[(1, 8), float32]) {
  (nn.layer_norm(%x, %g, %b), nn.layer_norm(%x, %g, %b, epsilon=1e-50), nn.log_softmax(%z))
}
"#;
    let rows = [
        "[0, 1, 0, 1, 0, 1, 0, 1]",
        "[0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5]",
    ];
    let logits = [
        "[0, -40, -40, -40, -40, -40, -40, -40]",
        "[0, -30, -100, -100, -100, -100, -100, -100]",
        "[-26, -26, -26, 0, -26, -26, -26, -26]",
    ];
    let inputs: Vec<String> = (0..9)
        .map(|i| {
            format!(
                "{{\"x\": [{}], \"g\": [1, 1, 1, 1, 1, 1, 1, 1], \"b\": [0.99997997, \
                 -0.99997997, 0.99997997, -0.99997997, 0.99997997, -0.99997997, 0.99997997, \
                 -0.99997997], \"z\": [{}]}}",
                rows[i % 2],
                logits[i % 3]
            )
        })
        .collect();
    let mut x = expected(
        "tiny_results",
        load_text("tiny_results", src),
        &inputs.join("\n"),
        &["x", "g", "b", "z"],
    );
    let tops = [
        -7.0 * (-40f64).exp(),
        -((-30f64).exp() + 6.0 * (-100f64).exp()),
    ];
    for (i, out) in x.outputs.iter().enumerate().take(2) {
        let tumble_interp::Value::Tuple(t) = out else {
            panic!("{out:?}")
        };
        let tumble_interp::Value::Tensor(lsm) = &t.0[2] else {
            panic!("{out:?}")
        };
        let top = lsm.to_f64_vec()[0];
        assert!(
            ((top - tops[i]) / tops[i]).abs() < 1e-6,
            "reference log-softmax top {top} against {}",
            tops[i]
        );
    }
    x.atol = 0.0;
    check_all_ways(&x);
}

/// Extremes of the fused row programs against the reference (a numerics audit's finds): layer
/// norm of rows of ±3e38 (`x - mean` overflowed in f32) and of 1e-39 with a zero epsilon (`1/σ`
/// overflowed), tanh of tiny values (went denormal inside, 0 below 3e-43), exp at the first f32
/// whose e^x overflows, and maximum/minimum of ±0 (the first operand on a tie, as numpy).
#[test]
fn row_program_extremes() {
    let src = r#"
def @main(%x: Tensor[(1, 4), float32], %y: Tensor[(1, 4), float32])
    -> (Tensor[(1, 4), float32], Tensor[(1, 4), float32], Tensor[(1, 4), float32], Tensor[(1, 4), float32], Tensor[(1, 4), float32]) {
  let %one = ones(shape=[4], dtype="float32");
  let %zero = zeros(shape=[4], dtype="float32");
  (nn.layer_norm(%x, %one, %zero, axis=-1, epsilon=0f),
   tanh(multiply(%y, 1e-30f)),
   exp(add(%y, 88.72284f)),
   divide(1f, maximum(%x, %y)),
   divide(1f, minimum(%y, %x)))
}
"#;
    let rows = [
        ("[3e38, 3e38, -3e38, 0]", "[1e-14, -1e-12, 0, 1]"),
        ("[1e-39, -1e-39, 1e-39, -1e-39]", "[1e-8, 2e-8, -1e-13, 3]"),
        ("[0.0, -0.0, 1, 2]", "[-0.0, 0.0, 1, 2]"),
        (
            "[1000.001, 1000.002, 999.999, 1000]",
            "[0, -0.0, 0.5, -0.5]",
        ),
    ];
    let inputs: Vec<String> = (0..9)
        .map(|i| {
            let (x, y) = rows[i % rows.len()];
            format!("{{\"x\": [{x}], \"y\": [{y}]}}")
        })
        .collect();
    agrees("row_extremes", src, &inputs.join("\n"), &["x", "y"]);
}

/// Products of vectors and extents of 0 through the canonical-products rewrite: a bias added to
/// a vector's product stays a vector along its axis (it was retyped as a row: "bias must be
/// 1-D"), and a rewritten reshape to a 0-sized dimension says so (`allowzero`: a 0 in
/// `newshape` otherwise copies an input dimension, which a vector does not have).
#[test]
fn vector_products_and_empty_extents() {
    let vec_bias = r#"
def @main(%x: Tensor[(3), float32], %W: Tensor[(2, 3), float32], %b: Tensor[(2), float32]) -> Tensor[(2), float32] {
  nn.bias_add(nn.dense(%x, %W), %b, axis=-1)
}
"#;
    let inputs: Vec<String> = (0..9).map(|i| format!("{{\"x\": [{i}, 1, -2]}}")).collect();
    agrees("vector_bias", vec_bias, &inputs.join("\n"), &["x"]);
    let empty_dense = r#"
def @main(%x: Tensor[(0), float32], %W: Tensor[(2, 0), float32]) -> Tensor[(2), float32] {
  add(nn.dense(%x, %W), 1f)
}
"#;
    agrees(
        "empty_dense",
        empty_dense,
        &["{\"x\": []}"; 9].join("\n"),
        &["x"],
    );
    let empty_row = r#"
def @main(%h: Tensor[(1, 0), float32], %x: Tensor[(1, 3), float32]) -> (Tensor[(0, 1), float32], Tensor[(1, 3), float32]) {
  (transpose(%h), %x)
}
"#;
    agrees(
        "empty_row",
        empty_row,
        &["{\"h\": [[]], \"x\": [[1, 2, 3]]}"; 9].join("\n"),
        &["h", "x"],
    );
}

/// A batch of 0 against a broadcast batch of 1 is a batch of 0 (numpy's broadcasting): both
/// engines failed with "shape (0, 2, 2) needs 0 elements, got 4".
#[test]
fn batch_matmul_of_no_batches_against_one() {
    let src = r#"
def @main(%x: Tensor[(0, 2, 1), float32], %w: Tensor[(1, 2, 1), float32]) -> (Tensor[(0, 2, 2), float32], Tensor[(0, 2, 2), float32]) {
  (nn.batch_matmul(%x, %w), nn.batch_matmul(%w, %x))
}
"#;
    let line = "{\"x\": {\"shape\": [0, 2, 1], \"data\": []}, \"w\": [[[1], [2]]]}";
    agrees("bmm_no_batches", src, &[line; 9].join("\n"), &["x", "w"]);
}

/// The same tuple passed whole to `db.concurrent`.
#[test]
fn let_bound_tuple_made_concurrent() {
    let src = r#"
def @main(%x: Tensor[(1, 4), float32]) -> (Tensor[(1, 4), float32], Tensor[(1, 4), float32]) {
  let %t = (negative(%x), tanh(%x));
  db.concurrent(%t)
}
"#;
    agrees("tuple_concurrent", src, &rows(9, 4), &["x"]);
}

/// Nested tuples out of one run, with a constant and a shared weight mixed in.
#[test]
fn nested_tuples_constants_and_shared_operands() {
    let src = r#"
def @main(%x: Tensor[(1, 4), float32], %w: Tensor[(4, 4), float32])
    -> ((Tensor[(1, 4), float32], (Tensor[(1, 2), float32], Tensor[(1, 2), float32])), Tensor[(1, 4), float32]) {
  let %h = nn.dense(%x, %w);
  let %p = (add(%h, 1f), split(%h, indices_or_sections=2, axis=1));
  let %q = multiply(%p.0, 0.5f);
  (%p, add(%q, %w.0))
}
"#;
    // `%w.0` is not a tensor projection (w is a tensor): use a row of it through take.
    let src = src.replace("%w.0", "take(%w, 0, axis=0)");
    agrees("nested", &src, &rows(9, 4), &["x"]);
}

/// The zoo's TreeLSTM and its plain form (`models/plain/`), scaled down: hidden size 8.
fn treelstm(plain: bool) -> common::Expected {
    let dir = if plain { "models/plain" } else { "models" };
    let path = common::root().join(dir).join("treelstm_small.rly");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let text = text.replace("768", "24").replace("256", "8");
    let inputs = std::fs::read_to_string(common::root().join("examples/treelstm.jsonl"))
        .unwrap_or_else(|e| panic!("examples/treelstm.jsonl: {e}"));
    expected("treelstm", load_text("treelstm", &text), &inputs, &["tree"])
}

/// Launches of one mini-batch of the examples under the default options.
fn launches(x: &common::Expected) -> (u64, Vec<tumble_interp::Value>) {
    let (program, reuse) = common::compile(x, true, tumble_compile::StaticOptions::all());
    let (vals, profile) = common::run_once(x, &program, &reuse, tumble_runtime::Options::default());
    (profile.launches, vals)
}

/// The compiler finds in the plain TreeLSTM what the annotated one states: the same number of
/// launches (the body of a cell joins its let chain's block, `zeros(..)` is folded, and the child
/// sums are fused into the launches that read them), and the same outputs bit for bit.
#[test]
fn plain_treelstm_launches_like_the_annotated_one() {
    let (plain, plain_out) = launches(&treelstm(true));
    let (annotated, annotated_out) = launches(&treelstm(false));
    assert_eq!(plain, annotated);
    for (i, (p, a)) in plain_out.iter().zip(&annotated_out).enumerate() {
        let (Some(p), Some(a)) = (p.as_tensor(), a.as_tensor()) else {
            panic!("instance {i}: not a tensor");
        };
        assert!(p.allclose(a, 0.0, 0.0), "instance {i}: {p} vs {a}");
    }
}

/// Sum fusion leaves the outputs bit for bit as they were, and removes the `add` launches.
#[test]
fn sum_fusion_changes_launches_not_outputs() {
    let x = treelstm(false);
    let (program, reuse) = common::compile(&x, true, tumble_compile::StaticOptions::all());
    let run = |sum_fusion| {
        let rngs = (0..x.args.len()).map(common::rng).collect();
        let opts = tumble_runtime::Options {
            sum_fusion,
            ..Default::default()
        };
        tumble_runtime::run_batch(&program, &reuse, "main", x.args.clone(), rngs, opts)
            .unwrap_or_else(|e| panic!("{}", e.error.message))
    };
    let (on, p_on) = run(true);
    let (off, p_off) = run(false);
    assert!(
        p_on.launches < p_off.launches,
        "{} vs {}",
        p_on.launches,
        p_off.launches
    );
    assert!(p_on.sums > 0);
    for (i, (a, b)) in on.iter().zip(&off).enumerate() {
        let (Some(a), Some(b)) = (a.as_tensor(), b.as_tensor()) else {
            panic!("instance {i}: not a tensor");
        };
        assert!(a.allclose(b, 0.0, 0.0), "instance {i}: {a} vs {b}");
    }
}

/// Launches of one mini-batch of `inputs` with coarsening on and the given inlining switch.
fn launches_of(src: &str, inputs: &str, instance_args: &[&str], inline: bool) -> u64 {
    let statics = tumble_compile::StaticOptions::all();
    launches_with(src, inputs, instance_args, inline, statics)
}

/// [`launches_of`] under the given static optimizations (outputs checked against the reference).
fn launches_with(
    src: &str,
    inputs: &str,
    instance_args: &[&str],
    inline: bool,
    statics: tumble_compile::StaticOptions,
) -> u64 {
    let x = expected(
        "launches",
        load_text("launches", src),
        inputs,
        instance_args,
    );
    let mut program = tumble_compile::Program::lower_with(
        &x.l.typed,
        tumble_compile::LowerOptions {
            inline,
            ..tumble_compile::LowerOptions::batched()
        },
    )
    .unwrap_or_else(|e| panic!("{}", e.message));
    tumble_compile::optimize(&mut program, "main", &x.weights, statics);
    let reuse = tumble_compile::analyze_reuse(&program, "main", &x.weights);
    let rngs = (0..x.args.len()).map(common::rng).collect();
    let opts = tumble_runtime::Options::default();
    let (vals, profile) =
        tumble_runtime::run_batch(&program, &reuse, "main", x.args.clone(), rngs, opts)
            .unwrap_or_else(|e| panic!("{}", e.error.message));
    for (i, (v, want)) in vals.iter().zip(&x.outputs).enumerate() {
        if let Err(m) = common::same(v, want, "") {
            panic!("instance {i}: {m}");
        }
    }
    profile.launches
}

/// The result expression of a `let` chain joins the chain's block (it was a block of its own).
#[test]
fn a_let_chains_body_joins_its_block() {
    let src = r#"
def @main(%x: Tensor[(1, 4), float32], %w: Tensor[(4, 4), float32]) -> Tensor[(1, 4), float32] {
  let %h = nn.dense(%x, %w);
  tanh(%h)
}
"#;
    assert_eq!(launches_of(src, &rows(5, 4), &["x"], true), 1);
}

/// An ordinary helper called inside a larger expression is inlined into its block (the Q/K/V
/// projections of a plain Berxit inside `@split_heads(..)` calls); `--no-inline` keeps the call
/// a block boundary. A recursive function and one with control flow are never inlined.
#[test]
fn straight_line_helpers_are_inlined() {
    let src = r#"
def @gelu(%x: Tensor[(1, 4), float32]) -> Tensor[(1, 4), float32] {
  let %c = multiply(%x, 0.5f);
  multiply(%c, add(tanh(%x), 1f))
}
def @proj(%x: Tensor[(1, 4), float32], %w: Tensor[(4, 4), float32]) -> Tensor[(1, 4), float32] {
  @gelu(nn.dense(%x, %w))
}
def @main(%x: Tensor[(1, 4), float32], %w: Tensor[(4, 4), float32]) -> Tensor[(1, 4), float32] {
  add(@proj(%x, %w), @gelu(%x))
}
"#;
    assert_eq!(launches_of(src, &rows(6, 4), &["x"], true), 1);
    assert!(launches_of(src, &rows(6, 4), &["x"], false) > 1);
    let recursive = r#"
def @down(%x: Tensor[(1, 4), float32], %n: Tensor[(), int32]) -> Tensor[(1, 4), float32] {
  if (greater(%n, 0)) { @down(tanh(%x), subtract(%n, 1)) } else { %x }
}
def @main(%x: Tensor[(1, 4), float32]) -> Tensor[(1, 4), float32] {
  negative(@down(%x, 3))
}
"#;
    agrees("recursive", recursive, &rows(5, 4), &["x"]);
}

/// Instances `{"x": v}` of `count` different float scalars.
fn scalars(count: usize) -> String {
    (0..count)
        .map(|i| format!("{{\"x\": {:.2}}}", i as f64 / 3.0 - 1.0))
        .collect::<Vec<_>>()
        .join("\n")
}

/// A reduction over all axes of a per-instance scalar, batched: its axes shifted past the batch
/// axis were the empty list, which means every axis, the batch's included ("flat index 0 is out
/// of bounds for a tensor with 0 elements").
#[test]
fn reduction_of_a_scalar_per_instance() {
    let src = r#"
def @main(%x: Tensor[(), float32], %w: Tensor[(4, 1), float32]) -> Tensor[(4, 1), float32] {
  add(mean(%x), %w)
}
"#;
    agrees("scalar_reduction", src, &scalars(9), &["x"]);
}

/// An operator whose operand is a `let` chain binding a closure: the block could not hold the
/// operand, so the whole call fell back to an operator outside a block, which cannot take the
/// chain's lazy result ("nn.dense: input is not computed yet (operator outside a block)").
#[test]
fn operand_is_a_let_chain_binding_a_closure() {
    let src = r#"
def @main(%x: Tensor[(1, 4), float32], %w: Tensor[(3, 4), float32]) -> Tensor[(1, 3), float32] {
  nn.dense({
    let %f = fn (%p: Tensor[(1, 4), float32]) -> Tensor[(1, 4), float32] { tanh(%p) };
    sigmoid(%x)
  }, %w)
}
"#;
    agrees("closure_operand", src, &rows(9, 4), &["x"]);
}

/// `concatenate` of a tuple that is neither a literal nor a variable (an `if`'s value; without
/// coarsening, `split`'s): only tuple variables could be block inputs, so the operator ran
/// outside a block on lazy fields ("expected a tuple of tensors, found a tensor in it").
#[test]
fn concatenate_of_a_computed_tuple() {
    let src = r#"
def @main(%x: Tensor[(1, 4), float32]) -> (Tensor[(1, 8), float32], Tensor[(1, 4), float32]) {
  let %c = concatenate(if (greater(sum(%x), 0f)) { (tanh(%x), %x) } else { (%x, sigmoid(%x)) }, axis=1);
  (%c, concatenate(split(%x, indices_or_sections=2, axis=1), axis=1))
}
"#;
    agrees("computed_tuple_operand", src, &rows(9, 4), &["x"]);
}

/// `db.concurrent` of a tuple holding `Nil`, whose element type only the result's use fixes: as
/// a deferred relation the annotation waited for its argument's type and the checker gave up
/// ("cannot infer the types of the arguments of `db.concurrent` here").
#[test]
fn concurrent_tuple_holding_nil() {
    let src = r#"
def @main(%x: Tensor[(1, 4), float32]) -> (Tensor[(1, 4), float32], List[Tensor[(1, 4), float32]]) {
  if (greater(sum(%x), 0f)) {
    db.concurrent((tanh(%x), Nil))
  } else {
    db.concurrent((%x, Cons(sigmoid(%x), Nil)))
  }
}
"#;
    agrees("concurrent_nil", src, &rows(9, 4), &["x"]);
}

/// A run of operators nothing reads was dropped with its inputs: a random draw among them was
/// not made, so every later draw of the instance came out different (and a failing call among
/// them would not have failed).
#[test]
fn unused_run_still_draws() {
    let src = r#"
def @main(%x: Tensor[(1, 4), float32]) -> Tensor[(1, 4), float32] {
  let %unused = tanh(random.db_uniform(low=0.0, high=1.0, out_shape=[1, 4], out_dtype="float32"));
  let %r = random.db_uniform(low=0.0, high=1.0, out_shape=[1, 4], out_dtype="float32");
  add(%x, %r)
}
"#;
    agrees("unused_run", src, &rows(9, 4), &["x"]);
}

/// A row program held a node that reads only shared operands (`divide(%a, 2f)`) next to
/// per-instance work with other rows (`abs(%x)` over (4, 3)): computed once per row, it came out
/// as (4, 2) instead of (1, 2) (generator seed 17871).
#[test]
fn shared_only_result_next_to_rows_of_another_shape() {
    let src = r#"
def @main(%x: Tensor[(4, 3), float32], %a: Tensor[(1, 2), float32])
    -> (Tensor[(1, 2), float32], Tensor[(4, 3), float32]) {
  (divide(%a, 2f), abs(%x))
}
"#;
    let inputs: Vec<String> = (0..5)
        .map(|i| {
            let row = |r: usize| {
                let v: Vec<String> = (0..3)
                    .map(|c| format!("{:.2}", ((i + r * 3 + c) % 7) as f64 - 3.0))
                    .collect();
                format!("[{}]", v.join(", "))
            };
            format!(
                "{{\"x\": [{}, {}, {}, {}]}}",
                row(0),
                row(1),
                row(2),
                row(3)
            )
        })
        .collect();
    agrees("shared_only_rows", src, &inputs.join("\n"), &["x"]);
}

/// A binding whose translation into the running block stops halfway (its `@foldl` closure reads
/// a name bound inside the block) left the random draw it had already taken as an input; the
/// draw then ran twice, once for the abandoned attempt and once for the binding's own block,
/// shifting every later draw (generator seed 14873).
#[test]
fn abandoned_binding_does_not_draw_twice() {
    let src = r#"
def @main(%x: Tensor[(1, 3), float32]) -> Tensor[(2, 2), float32] {
  let %z = zeros_like(squeeze(subtract(%x, %x), axis=[0]));
  let %dead = add(sum(random.db_uniform(low=-1.0, high=1.0, out_shape=[1], out_dtype="float32")),
    nn.dense(reshape(@foldl(fn (%acc: Tensor[(3), float32], %e: Tensor[(3), float32]) -> Tensor[(3), float32] {
      add(%acc, %z)
    }, %z, Nil), newshape=[1, 3]), %x));
  random.db_uniform(low=-1.0, high=1.0, out_shape=[2, 2], out_dtype="float32")
}
"#;
    agrees("abandoned_binding", src, &rows(5, 3), &["x"]);
}

/// A field of a variable read twice by one block is passed once (a plain MV-RNN composition reads
/// each child's matrix twice; as two inputs, every 64×64 matrix was gathered twice per launch).
#[test]
fn a_field_read_twice_is_one_input() {
    let src = r#"
def @main(%s: (Tensor[(1, 4), float32], Tensor[(4, 4), float32])) -> Tensor[(1, 4), float32] {
  add(nn.dense(%s.0, %s.1), sum(%s.1, axis=[0], keepdims=True))
}
"#;
    let inputs: Vec<String> = (0..4)
        .map(|i| {
            let row = |r: usize| {
                let v: Vec<String> = (0..4)
                    .map(|c| format!("{:.1}", ((i + r + c) % 5) as f64 - 2.0))
                    .collect();
                format!("[{}]", v.join(", "))
            };
            format!(
                "{{\"s\": [[{}], [{}, {}, {}, {}]]}}",
                row(9),
                row(0),
                row(1),
                row(2),
                row(3)
            )
        })
        .collect();
    let l = load_text("field_twice", src);
    let program =
        tumble_compile::Program::lower_with(&l.typed, tumble_compile::LowerOptions::batched())
            .unwrap_or_else(|e| panic!("{}", e.message));
    let main = program
        .blocks
        .iter()
        .find(|b| b.name.starts_with("main:"))
        .unwrap_or_else(|| panic!("no block in @main"));
    assert_eq!(main.inputs.len(), 2, "{main}");
    agrees("field_twice", src, &inputs.join("\n"), &["s"]);
}

/// Per-invocation matrix weights (MV-RNN's word matrices) are launched in chunks that fit in
/// cache: 20 instances with 64×64 matrices run as chunks of 15 and 5 (locality chunks), equal to
/// the reference under every scheduler, batch size and switch set.
#[test]
fn per_invocation_weights_in_locality_chunks() {
    let src = r#"
def @main(%a: Tensor[(1, 64), float32], %m: Tensor[(64, 64), float32], %w: Tensor[(64, 128), float32])
    -> (Tensor[(1, 64), float32], Tensor[(64, 64), float32]) {
  let %p = tanh(nn.dense(%a, %m));
  (%p, nn.dense(%w, transpose(concatenate((%m, %m), axis=0), axes=[1, 0])))
}
"#;
    let num = |i: usize, j: usize| format!("{:.3}", (((i * 31 + j * 7) % 17) as f64 - 8.0) / 16.0);
    let inputs: Vec<String> = (0..20)
        .map(|i| {
            let a: Vec<String> = (0..64).map(|j| num(i, j)).collect();
            let m: Vec<String> = (0..64)
                .map(|r| {
                    let row: Vec<String> = (0..64).map(|c| num(i + r, c * 3)).collect();
                    format!("[{}]", row.join(","))
                })
                .collect();
            format!("{{\"a\": [[{}]], \"m\": [{}]}}", a.join(","), m.join(","))
        })
        .collect();
    agrees("chunks", src, &inputs.join("\n"), &["a", "m"]);
}

/// A Viterbi step (`(T, 1) + (T, T)` scores, their `max` and `argmax` over the previous state's
/// axis) makes a 64 KiB intermediate per invocation: 40 instances launch in chunks of 16 (1 MiB
/// of scores each), not all at once, and equal the reference every way; one launch with the
/// switch off.
#[test]
fn large_intermediates_launch_in_chunks() {
    let src = r#"
def @main(%d: Tensor[(1, 128), float32], %T: Tensor[(128, 128), float32]) -> (Tensor[(1, 128), float32], Tensor[(128), int32]) {
  let %s = add(reshape(%d, newshape=[128, 1]), %T);
  (reshape(max(%s, axis=[0]), newshape=[1, 128]), argmax(%s, axis=[0]))
}
"#;
    let inputs: Vec<String> = (0..40)
        .map(|i| {
            let d: Vec<String> = (0..128)
                .map(|j| format!("{:.2}", ((i * 7 + j * 5) % 23) as f64 / 4.0))
                .collect();
            format!("{{\"d\": [[{}]]}}", d.join(","))
        })
        .collect();
    let x = expected(
        "viterbi",
        load_text("viterbi", src),
        &inputs.join("\n"),
        &["d"],
    );
    check_all_ways(&x);
    let launches = |locality_chunks| {
        batch_profile(
            &x,
            tumble_runtime::Options {
                locality_chunks,
                ..Default::default()
            },
        )
        .launches
    };
    assert_eq!(launches(true), 3, "40 invocations in chunks of 16");
    assert_eq!(launches(false), 1);
}

/// A block with a product whose every invocation makes a 1 MiB intermediate (a transformer
/// layer's feed-forward activations, small): on one kernel thread 6 instances launch in chunks of
/// 4 (4 MiB of it each), equal to the reference every way; one launch with the switch off, or on
/// two threads.
#[test]
fn products_with_large_intermediates_launch_in_chunks() {
    let src = r#"
def @main(%x: Tensor[(128, 16), float32], %W: Tensor[(2048, 16), float32]) -> Tensor[(128), float32] {
  let %h = nn.relu(nn.dense(%x, %W));
  sum(%h, axis=[1])
}
"#;
    let x = expected("ffn", load_text("ffn", src), &matrices(6, 128, 16), &["x"]);
    check_all_ways(&x);
    let launches = |locality_chunks, threads| {
        batch_profile(
            &x,
            tumble_runtime::Options {
                locality_chunks,
                threads,
                ..Default::default()
            },
        )
        .launches
    };
    assert_eq!(launches(true, 1), 2, "6 invocations in chunks of 4");
    assert_eq!(launches(false, 1), 1);
    assert_eq!(launches(true, 2), 1);
    // Planned for a job of two threads whose two workers each launch on one (`tumble run
    // --threads 2` over two mini-batches): the launch's own thread count decides.
    let (program, reuse) = common::compile(&x, true, tumble_compile::StaticOptions::all());
    let two = tumble_runtime::Options {
        threads: 2,
        ..Default::default()
    };
    let exec = std::sync::Arc::new(tumble_runtime::Executable::new(&program, &reuse, &two));
    let rngs = (0..x.args.len()).map(common::rng).collect();
    let one = tumble_runtime::Options {
        threads: 1,
        ..Default::default()
    };
    let (got, profile) =
        tumble_runtime::run_batch_on(&program, &reuse, &exec, "main", x.args.clone(), rngs, one)
            .unwrap_or_else(|e| panic!("{}", e.error.message));
    assert_eq!(profile.launches, 2, "chunks on the worker's one thread");
    for (i, (g, e)) in got.iter().zip(&x.outputs).enumerate() {
        if let Err(m) = common::same_within(g, e, "", x.atol) {
            panic!("planned for two threads, launched on one, instance {i}: {m}");
        }
    }
}

/// A fold over a long list: each step's deferred sum copied every term of the previous one (O(n²)
/// terms kept for a list of n). Past 32 terms the `add` runs as an ordinary launch that sums the
/// deferred terms, so the fold costs O(n); the result is the reference's.
#[test]
fn a_long_fold_keeps_sums_bounded() {
    let src = r#"
def @main(%xs: List[Tensor[(1, 4), float32]]) -> Tensor[(1, 4), float32] {
  let %plus = fn (%a: Tensor[(1, 4), float32], %b: Tensor[(1, 4), float32]) -> Tensor[(1, 4), float32] {
    add(%a, %b)
  };
  @foldl(%plus, zeros(shape=[1, 4], dtype="float32"), @map(fn (%x: Tensor[(1, 4), float32]) -> Tensor[(1, 4), float32] {
    tanh(%x)
  }, %xs))
}
"#;
    let inputs: Vec<String> = (0..3)
        .map(|i| {
            let xs: Vec<String> = (0..100)
                .map(|j| {
                    let v: Vec<String> = (0..4)
                        .map(|c| format!("{:.2}", ((i + j * 3 + c) % 9) as f64 / 8.0 + 0.1))
                        .collect();
                    format!("[[{}]]", v.join(", "))
                })
                .collect();
            format!("{{\"xs\": [{}]}}", xs.join(", "))
        })
        .collect();
    let x = expected(
        "long_fold",
        load_text("long_fold", src),
        &inputs.join("\n"),
        &["xs"],
    );
    check_all_ways(&x);
    let profile = batch_profile(&x, tumble_runtime::Options::default());
    let add_launches: u64 = profile.blocks_where(|name| name.contains("plus")).launches;
    assert!(profile.sums > 0 && add_launches > 0, "{profile}");
}

/// Deferred small launches (NestedRNN's GRU cell): a block with 256 KiB of shared weights that
/// instances reach at different depths (after inner sequences of different lengths) waits for
/// more of its invocations while the inner steps launch. Equal to the reference every way, and
/// with deferral on it launches fewer times than with it off.
#[test]
fn weight_bound_launches_wait_for_more() {
    let src = r#"
def @inner(%xs: List[Tensor[(1, 8), float32]], %h: Tensor[(1, 256), float32], %u: Tensor[(256, 8), float32])
    -> Tensor[(1, 256), float32] {
  match (%xs) {
    Cons(%x, %rest) => @inner(%rest, tanh(add(%h, nn.dense(%x, %u))), %u),
    Nil => %h,
  }
}
def @outer(%seqs: List[List[Tensor[(1, 8), float32]]], %h: Tensor[(1, 256), float32],
           %u: Tensor[(256, 8), float32], %g: Tensor[(256, 256), float32]) -> Tensor[(1, 256), float32] {
  match (%seqs) {
    Cons(%s, %rest) => @outer(%rest, tanh(nn.dense(@inner(%s, %h, %u), %g)), %u, %g),
    Nil => %h,
  }
}
def @main(%seqs: List[List[Tensor[(1, 8), float32]]], %u: Tensor[(256, 8), float32],
          %g: Tensor[(256, 256), float32]) -> Tensor[(1, 256), float32] {
  @outer(%seqs, zeros(shape=[1, 256], dtype="float32"), %u, %g)
}
"#;
    let inputs: Vec<String> = (0..24)
        .map(|i| {
            let seqs: Vec<String> = (0..1 + i % 4)
                .map(|s| {
                    let xs: Vec<String> = (0..(i * 7 + s * 5) % 9)
                        .map(|t| {
                            let v: Vec<String> = (0..8)
                                .map(|c| {
                                    format!("{:.2}", ((i + s + t * 3 + c) % 11) as f64 / 10.0 - 0.5)
                                })
                                .collect();
                            format!("[[{}]]", v.join(", "))
                        })
                        .collect();
                    format!("[{}]", xs.join(", "))
                })
                .collect();
            format!("{{\"seqs\": [{}]}}", seqs.join(", "))
        })
        .collect();
    let x = expected(
        "deferred",
        load_text("deferred", src),
        &inputs.join("\n"),
        &["seqs"],
    );
    check_all_ways(&x);
    let heavy = |defer: bool| {
        let profile = batch_profile(
            &x,
            tumble_runtime::Options {
                defer,
                ..tumble_runtime::Options::default()
            },
        );
        let launches: u64 = profile
            .blocks_where(|name| name.starts_with("outer"))
            .launches;
        (launches, profile)
    };
    let (on, p_on) = heavy(true);
    let (off, p_off) = heavy(false);
    assert!(p_on.deferred > 0 && p_off.deferred == 0, "{p_on}\n{p_off}");
    assert!(on < off, "deferred {on} launches vs {off}\n{p_on}\n{p_off}");
}

/// A shared index into per-invocation data (DRNN's `take(%p, 0, axis=0)`) batches as one lookup
/// one axis further in instead of running per invocation; broadcasting arithmetic of a batched
/// scalar and a shared vector takes the f32 path. Equal to the reference every way, and no
/// operator of the launch falls back to per-invocation calls.
#[test]
fn shared_index_into_batched_data_is_one_lookup() {
    let src = r#"
def @main(%x: Tensor[(1, 3), float32], %v: Tensor[(4), float32]) -> (Tensor[(), float32], Tensor[(4), float32], Tensor[(1), float32]) {
  let %p = reshape(sigmoid(%x), newshape=[3]);
  let %a = take(%p, 0, axis=0);
  let %b = take(%p, -1, axis=0);
  let %m = multiply(cast(greater(%a, 0.5f), dtype="float32"), %v);
  (%a, add(%m, %b), take(%x, 2, axis=1))
}
"#;
    let inputs: Vec<String> = (0..9)
        .map(|i| {
            let v: Vec<String> = (0..3)
                .map(|c| format!("{:.2}", ((i * 5 + c * 3) % 7) as f64 / 3.0 - 1.0))
                .collect();
            format!("{{\"x\": [[{}]]}}", v.join(", "))
        })
        .collect();
    batches_without_loops("take_shared", src, &inputs, &["x"]);
}

/// Per-invocation indices into per-invocation data (a loss's `-log_softmax(..)[label]`, a row
/// picked by a computed index) batch as one lookup with the batch axis as take's batch dimension
/// instead of one call per invocation: scalar and vector indices, a negative one (clipped and
/// wrapped), a lookup along an inner axis. Equal to the reference every way; nothing loops.
#[test]
fn batched_indices_into_batched_data_are_one_lookup() {
    let src = r#"
def @main(%x: Tensor[(2, 5), float32], %label: Tensor[(), int32], %pick: Tensor[(3), int32])
    -> (Tensor[(), float32], Tensor[(2, 3), float32], Tensor[(3, 5), float32], Tensor[(3), float32]) {
  let %logp = nn.log_softmax(%x, axis=1);
  let %row = reshape(take(%logp, 1, axis=0), newshape=[5]);
  let %loss = negative(take(%row, %label, axis=0));
  let %cols = take(sigmoid(%x), %pick, axis=1, mode="wrap");
  let %rows = take(%x, %pick, axis=0);
  (%loss, %cols, %rows, take(%row, %pick, axis=0, mode="clip"))
}
"#;
    let inputs: Vec<String> = (0..13)
        .map(|i| {
            let row = |r: usize| -> String {
                let v: Vec<String> = (0..5)
                    .map(|c| format!("{:.2}", ((i * 5 + c * 3 + r * 2) % 7) as f64 / 3.0 - 1.0))
                    .collect();
                format!("[{}]", v.join(", "))
            };
            format!(
                "{{\"x\": [{}, {}], \"label\": {}, \"pick\": [{}, {}, {}]}}",
                row(0),
                row(1),
                i % 5,
                (i % 4) as i64 - 1,
                (i * 3) % 7,
                i % 2
            )
        })
        .collect();
    batches_without_loops("take_batched", src, &inputs, &["x", "label", "pick"]);
}

/// `nn.batch_matmul(.., out_dtype="float64")` of f32 operands computes in f64 in the batched
/// engine too: its f32 kernel computed and returned f32 (16777216 + 1 gave 16777216, and the
/// f32 result failed the next float64 operator or the result's declared dtype).
#[test]
fn batch_matmul_keeps_its_out_dtype_batched() {
    let src = r#"
def @main(%a: Tensor[(1, 1, 2), float32], %b: Tensor[(1, 2, 2), float32])
    -> (Tensor[(1, 1, 2), int64], Tensor[(1, 1, 2), float64]) {
  let %p = nn.batch_matmul(%a, %b, out_dtype="float64");
  (cast(%p, dtype="int64"), add(%p, 0.5f64))
}
"#;
    let inputs: Vec<String> = (0..5)
        .map(|i| format!("{{\"a\": [[[16777216, {i}]]], \"b\": [[[1, 1], [1, {i}]]]}}"))
        .collect();
    let x = expected(
        "bmm_f64",
        load_text("bmm_f64", src),
        &inputs.join("\n"),
        &["a", "b"],
    );
    let exact = match x.outputs.get(3) {
        Some(tumble_interp::Value::Tuple(t)) => match t.0.first() {
            Some(tumble_interp::Value::Tensor(p)) => p.to_f64_vec(),
            _ => Vec::new(),
        },
        _ => Vec::new(),
    };
    assert_eq!(
        exact,
        [16777219.0, 16777225.0],
        "the reference's exact sums"
    );
    check_all_ways(&x);
}

/// The operators added for Relay programs (GELU by `erf`, rounding, `sign`, trigonometry, the
/// floored and truncated remainders and quotients, `stack`, `broadcast_to`, `nn.leaky_relu`,
/// `one_hot`) batch: equal to the reference every way, nothing loops.
#[test]
fn erf_rounding_remainders_and_stack_batch() {
    let src = r#"
def @main(%x: Tensor[(2, 3), float32], %k: Tensor[(3), int32]) -> (Tensor[(2, 3), float32],
    Tensor[(2, 3), float32], Tensor[(3), int32], Tensor[(3), int32], Tensor[(3), int32],
    Tensor[(2, 3, 3), float32], Tensor[(3, 2), int32], Tensor[(4, 2, 3), float32],
    Tensor[(3, 2), int32], Tensor[(5, 3), float32]) {
  let %gelu = multiply(multiply(%x, 0.5f), add(erf(multiply(%x, 0.70710678f)), 1f));
  let %r = add(add(floor(%x), ceil(%x)), add(round(%x), trunc(%x)));
  let %t = add(multiply(sign(%x), sin(%x)), cos(%x));
  let %m = add(floor_mod(%x, 1.5f), mod(%x, -0.75f));
  (add(%gelu, %r), add(%t, floor_divide(%m, 0.5f)),
   floor_mod(%k, 3), mod(%k, -4), floor_divide(sign(%k), 2),
   stack((%gelu, %r, %t), axis=1), stack((%k, %k), axis=-1),
   nn.leaky_relu(broadcast_to(%x, shape=[4, 2, 3]), alpha=0.1),
   broadcast_to(reshape(%k, newshape=[3, 1]), shape=[3, 2]),
   one_hot(floor_mod(%k, 4), 2.5f, -1f, depth=5, axis=0))
}
"#;
    let inputs: Vec<String> = (0..9)
        .map(|i| {
            let v: Vec<String> = (0..6)
                .map(|c| format!("{:.2}", ((i * 5 + c * 3) % 11) as f64 / 2.0 - 2.5))
                .collect();
            let k: Vec<String> = (0..3)
                .map(|c| ((i * 7 + c * 5) % 13 - 6).to_string())
                .collect();
            format!(
                "{{\"x\": [[{}], [{}]], \"k\": [{}]}}",
                v[..3].join(", "),
                v[3..].join(", "),
                k.join(", ")
            )
        })
        .collect();
    batches_without_loops("new_elementwise", src, &inputs, &["x", "k"]);
}

/// Operators passed as values (`@map(sigmoid, ..)`, `@foldl(add, ..)`: closures made by the
/// checker) run batched like written-out closures: equal to the reference every way.
#[test]
fn operators_passed_as_values_batch() {
    let src = r#"
def @main(%x: Tensor[(1, 3), float32], %y: Tensor[(1, 3), float32]) -> (Tensor[(1, 3), float32],
    Tensor[(1, 3), float32]) {
  let %l = @map(sigmoid, Cons(%x, Cons(%y, Nil)));
  (@hd(@tl(%l)), @foldl(add, %x, Cons(%y, Cons(%y, Nil))))
}
"#;
    let inputs: Vec<String> = (0..7)
        .map(|i| {
            let row = |k: usize| -> String {
                let v: Vec<String> = (0..3)
                    .map(|c| format!("{:.2}", ((i * 5 + c * 3 + k) % 7) as f64 / 3.0 - 1.0))
                    .collect();
                format!("[[{}]]", v.join(", "))
            };
            format!("{{\"x\": {}, \"y\": {}}}", row(0), row(2))
        })
        .collect();
    let x = expected(
        "op_values",
        load_text("op_values", src),
        &inputs.join("\n"),
        &["x", "y"],
    );
    check_all_ways(&x);
}

/// Slices of per-invocation values (Berxit's `[CLS]` row) batch as one slice one axis further in
/// instead of copying every row out to slice it: implicit and listed axes (a negative one), a
/// `strides` shorter than the axes (Relay pads it with 1), negative strides and bounds,
/// `slice_mode="size"`. Equal to the reference every way; nothing loops.
#[test]
fn slices_of_batched_values_are_one_slice() {
    let src = r#"
def @main(%x: Tensor[(4, 6), float32]) -> (Tensor[(1, 6), float32], Tensor[(2, 6), float32],
    Tensor[(4, 2), float32], Tensor[(3, 6), float32], Tensor[(2, 4), float32]) {
  let %h = tanh(%x);
  (strided_slice(%h, begin=[0, 0], end=[1, 6], strides=[1, 1]),
   strided_slice(%h, begin=[0, 0], end=[4, 6], strides=[2]),
   strided_slice(%h, begin=[-1], end=[-5], strides=[-3], axes=[-1]),
   strided_slice(sigmoid(%x), begin=[-1], end=[0], strides=[-1]),
   strided_slice(%h, begin=[1, 2], end=[2, -1], slice_mode="size"))
}
"#;
    let inputs: Vec<String> = (0..11)
        .map(|i| {
            let row = |r: usize| -> String {
                let v: Vec<String> = (0..6)
                    .map(|c| format!("{:.2}", ((i * 5 + c * 3 + r * 2) % 7) as f64 / 3.0 - 1.0))
                    .collect();
                format!("[{}]", v.join(", "))
            };
            let rows: Vec<String> = (0..4).map(row).collect();
            format!("{{\"x\": [{}]}}", rows.join(", "))
        })
        .collect();
    batches_without_loops("slice_batched", src, &inputs, &["x"]);
}

/// Direct products (`Stage::MatMul`): `X · [A; B]` written as `nn.dense(X, transpose(
/// concatenate((A, B))))` packs A's and B's rows straight into the GEMM. Covers two parts, a
/// shared part (a weight), a transpose that feeds no product (left alone) and a
/// per-instance X (the node-by-node fallback), at odd sizes. Equal to the reference every way;
/// the direct path runs.
#[test]
fn products_by_transposed_concatenations_pack_rows_in_place() {
    let src = r#"
def @main(%a: Tensor[(5, 7), float32], %b: Tensor[(3, 7), float32], %x: Tensor[(9, 8), float32],
          %s: Tensor[(4, 7), float32], %w: Tensor[(6, 12), float32])
    -> (Tensor[(6, 7), float32], Tensor[(9, 7), float32], Tensor[(6, 7), float32], Tensor[(7, 5), float32]) {
  let %two = nn.dense(%w, transpose(concatenate((%a, %s, %b), axis=0), axes=[1, 0]));
  let %bare = nn.dense(%x, transpose(concatenate((%a, %b), axis=0)));
  let %t = transpose(%a, axes=[1, 0]);
  let %twice = add(nn.dense(%w, transpose(concatenate((%s, %a, %b), axis=0), axes=[1, 0])), 1f);
  (%two, %bare, %twice, multiply(%t, 2f))
}
"#;
    let num = |i: usize, j: usize| format!("{:.3}", (((i * 31 + j * 7) % 17) as f64 - 8.0) / 16.0);
    let mat = |i: usize, rows: usize, cols: usize| {
        let rs: Vec<String> = (0..rows)
            .map(|r| {
                let row: Vec<String> = (0..cols).map(|c| num(i + r, c * 3 + rows)).collect();
                format!("[{}]", row.join(","))
            })
            .collect();
        format!("[{}]", rs.join(","))
    };
    let inputs: Vec<String> = (0..11)
        .map(|i| {
            format!(
                "{{\"a\": {}, \"b\": {}, \"x\": {}}}",
                mat(i, 5, 7),
                mat(i + 3, 3, 7),
                mat(i * 2, 9, 8)
            )
        })
        .collect();
    let x = expected(
        "direct_matmul",
        load_text("direct_matmul", src),
        &inputs.join("\n"),
        &["a", "b", "x"],
    );
    check_all_ways(&x);
    let profile = batch_profile(&x, tumble_runtime::Options::default());
    // %two and %twice run directly; %bare's X is per-instance (its product falls back).
    assert!(profile.fused.direct_matmuls >= 2, "{profile}");
}

/// Gather views: an embedding lookup with one index per invocation refers to the table's rows
/// (reshaped, fed to a product, a row program, returned as an output, read by the next launch)
/// instead of copying them; indices past either end clip. Equal to the reference every way; the
/// views are used.
#[test]
fn embedding_lookups_refer_to_table_rows() {
    let src = r#"
def @main(%tok: Tensor[(1), int32], %mats: Tensor[(6, 3, 4), float32], %emb: Tensor[(6, 4), float32])
    -> (Tensor[(3, 4), float32], Tensor[(1, 3), float32], Tensor[(1, 4), float32], Tensor[(3, 4), float32]) {
  let %m = reshape(take(%mats, %tok, axis=0, mode="clip"), newshape=[3, 4]);
  let %e = take(%emb, %tok, axis=0, mode="clip");
  let %p = nn.dense(%e, %m);
  let %again = add(%m, 1f);
  (%m, tanh(%p), %e, %again)
}
"#;
    let inputs: Vec<String> = [0i32, 5, 2, -3, 9, 2, 1, 4, 3]
        .iter()
        .map(|t| format!("{{\"tok\": [{t}]}}"))
        .collect();
    let x = expected(
        "gather_views",
        load_text("gather_views", src),
        &inputs.join("\n"),
        &["tok"],
    );
    check_all_ways(&x);
    // (The matrix lookup is a weight take, which the weight-take split otherwise runs on the
    // host as a weight slice: its gather view is what this test is about.)
    let statics = tumble_compile::StaticOptions {
        weight_takes: false,
        ..tumble_compile::StaticOptions::all()
    };
    let (_, profile) = run_compiled_with(&x, statics);
    assert!(profile.fused.gather_views >= 2, "{profile}");
}

/// Weights reached through a value (an option holding one), a closure capturing one inside
/// another closure, and a parameter that holds different weights on different calls: the
/// entry-argument pass ([`tumble_compile::consts`]) must keep every one of them right.
#[test]
fn weights_through_values_closures_and_varying_parameters() {
    let src = r#"
def @walk(%xs: List[Tensor[(1, 4), float32]], %h: Tensor[(1, 4), float32], %W: Tensor[(4, 4), float32], %U: Tensor[(4, 4), float32]) -> Tensor[(1, 4), float32] {
  match (%xs) {
    Cons(%x, %rest) => {
      let %f = fn (%a: Tensor[(1, 4), float32]) -> Tensor[(1, 4), float32] {
        let %g = fn (%b: Tensor[(1, 4), float32]) -> Tensor[(1, 4), float32] { nn.dense(%b, %U) };
        %g(tanh(nn.dense(%a, %W)))
      };
      @walk(%rest, add(%f(%x), %h), %U, %U)
    },
    Nil => %h,
  }
}
def @main(%x: Tensor[(1, 4), float32], %W: Tensor[(4, 4), float32], %U: Tensor[(4, 4), float32]) -> Tensor[(1, 4), float32] {
  let %o = Some(%W);
  let %w = match (%o) {
    Some(%v) => %v,
    None => %U,
  };
  @walk(Cons(%x, Cons(nn.dense(%x, %w), Nil)), %x, %w, %U)
}
"#;
    agrees("weights.rly", src, &rows(9, 4), &["x"]);
}

/// Weights laid out for `x · W` (`nn.dense(%x, transpose(%W))`) and the rows of one matrix split
/// into two heads: weight-only operators inside the step's block become derived parameters,
/// computed once per run (the product on a transposed weight had run as a per-launch repack,
/// 3.7× slower on BiRNN). Equal to the reference every way, with and without the pass.
#[test]
fn weight_transforms_are_computed_once_per_run() {
    let src = r#"
def @rnn(%xs: List[Tensor[(1, 6), float32]], %h: Tensor[(1, 5), float32],
         %W: Tensor[(6, 5), float32], %U: Tensor[(5, 5), float32], %V: Tensor[(4, 5), float32])
    -> List[Tensor[(1, 2), float32]] {
  match (%xs) {
    Cons(%x, %rest) => {
      let %h2 = tanh(add(nn.dense(%x, transpose(%W)), nn.dense(%h, transpose(%U, axes=[1, 0]))));
      let %v = split(%V, indices_or_sections=2, axis=0);
      let %o = add(nn.dense(%h2, %v.0), multiply(nn.dense(%h2, %v.1), 2f));
      Cons(%o, @rnn(%rest, %h2, %W, %U, %V))
    },
    Nil => Nil,
  }
}

def @main(%xs: List[Tensor[(1, 6), float32]], %W: Tensor[(6, 5), float32],
          %U: Tensor[(5, 5), float32], %V: Tensor[(4, 5), float32])
    -> List[Tensor[(1, 2), float32]] {
  @rnn(%xs, zeros(shape=[1, 5], dtype="float32"), %W, %U, %V)
}
"#;
    let inputs: Vec<String> = (0..11)
        .map(|i| {
            let xs: Vec<String> = (0..(i % 4) + 1)
                .map(|t| {
                    let row: Vec<String> = (0..6)
                        .map(|j| format!("{:.3}", (((i * 5 + t * 3 + j) % 13) as f64 - 6.0) / 7.0))
                        .collect();
                    format!("[[{}]]", row.join(", "))
                })
                .collect();
            format!("{{\"xs\": [{}]}}", xs.join(", "))
        })
        .collect();
    let x = expected(
        "derived_params",
        load_text("derived_params", src),
        &inputs.join("\n"),
        &["xs"],
    );
    check_all_ways(&x);
    let (program, _) = common::compile(&x, true, tumble_compile::StaticOptions::all());
    let ops: Vec<&str> = program
        .derived
        .iter()
        .flat_map(|d| d.block.nodes.iter().map(|n| n.op.name))
        .collect();
    assert!(
        ops.contains(&"transpose") && ops.contains(&"split"),
        "{ops:?}"
    );
    // The step's block reads them as inputs: no transpose or split is left in any block the
    // code invokes (the pieces block merging put together are left behind, never invoked).
    let mut invoked = std::collections::BTreeSet::new();
    for l in &program.lambdas {
        l.body.visit(&mut |c| {
            if let tumble_compile::Code::InvokeBlock { block, .. } = c {
                invoked.insert(*block);
            }
        });
    }
    for b in invoked
        .iter()
        .filter_map(|&b| program.blocks.get(b as usize))
    {
        assert!(
            b.nodes
                .iter()
                .all(|n| n.op.name != "transpose" && n.op.name != "split"),
            "{}",
            b.name
        );
    }
    // Off: the same outputs, the transforms in the block.
    let statics = tumble_compile::StaticOptions {
        derive: false,
        ..tumble_compile::StaticOptions::all()
    };
    let (off, reuse_off) = common::compile(&x, true, statics);
    assert!(off.derived.is_empty());
    let (program, reuse) = common::compile(&x, true, tumble_compile::StaticOptions::all());
    let (on_vals, _) = common::run_once(&x, &program, &reuse, Default::default());
    let (off_vals, _) = common::run_once(&x, &off, &reuse_off, Default::default());
    assert_eq!(on_vals.len(), off_vals.len());
    for (i, (a, b)) in on_vals.iter().zip(&off_vals).enumerate() {
        common::same_within(a, b, &format!("instance {i}"), 0.0)
            .unwrap_or_else(|e| panic!("derived params on vs off: {e}"));
    }
}

/// `x`'s instances as one mini-batch of the program compiled with `statics` (the default run
/// options): the results and the profile.
fn run_compiled_with(
    x: &common::Expected,
    statics: tumble_compile::StaticOptions,
) -> (Vec<tumble_interp::Value>, tumble_runtime::Profile) {
    let (program, reuse) = common::compile(x, true, statics);
    common::run_once(x, &program, &reuse, Default::default())
}

/// Each instance's results in `a` within `tol` of `b`'s (`what` names the comparison).
fn assert_same_results(
    a: &[tumble_interp::Value],
    b: &[tumble_interp::Value],
    tol: f64,
    what: &str,
) {
    for (i, (a, b)) in a.iter().zip(b).enumerate() {
        common::same_within(a, b, &format!("instance {i}"), tol)
            .unwrap_or_else(|e| panic!("{what}: {e}"));
    }
}

/// `x` compiled with canonical products off gives the values `on` gives, within `tol`.
fn agrees_with_canonical_products_off(
    x: &common::Expected,
    on: &tumble_compile::Program,
    reuse_on: &tumble_compile::ReuseAnalysis,
    tol: f64,
) {
    let statics = tumble_compile::StaticOptions {
        canon: false,
        ..tumble_compile::StaticOptions::all()
    };
    let (off, reuse_off) = common::compile(x, true, statics);
    let (on_vals, _) = common::run_once(x, on, reuse_on, Default::default());
    let (off_vals, _) = common::run_once(x, &off, &reuse_off, Default::default());
    for (i, (a, b)) in on_vals.iter().zip(&off_vals).enumerate() {
        common::same_within(a, b, &format!("instance {i}"), tol)
            .unwrap_or_else(|e| panic!("canonical products on vs off: {e}"));
    }
}

/// An RNN written with column vectors (`W · x`, `(U · h)` through transposes, a reshaped bias):
/// canonical products run it on the instances' rows. Equal to the reference every way, and to
/// itself with the rewrite off.
#[test]
fn column_vector_products_agree_with_the_rewrite_on_and_off() {
    let src = r#"
def @rnn(%xs: List[Tensor[(5, 1), float32]], %h: Tensor[(5, 1), float32], %W: Tensor[(5, 5), float32],
         %U: Tensor[(5, 5), float32], %b: Tensor[(5), float32]) -> List[Tensor[(5, 1), float32]] {
  match (%xs) {
    Cons(%x, %rest) => {
      let %h2 = tanh(add(add(nn.dense(%W, transpose(%x)), reshape(%b, newshape=[5, 1])),
                         transpose(nn.dense(transpose(%h), %U))));
      Cons(multiply(%h2, sigmoid(%x)), @rnn(%rest, %h2, %W, %U, %b))
    },
    Nil => Nil,
  }
}
def @main(%xs: List[Tensor[(5, 1), float32]], %W: Tensor[(5, 5), float32], %U: Tensor[(5, 5), float32],
          %b: Tensor[(5), float32]) -> List[Tensor[(5, 1), float32]] {
  @rnn(%xs, zeros(shape=[5, 1], dtype="float32"), %W, %U, %b)
}
"#;
    let inputs: Vec<String> = (0..11)
        .map(|i| {
            let xs: Vec<String> = (0..(i % 5) + 1)
                .map(|t| {
                    let col: Vec<String> = (0..5)
                        .map(|j| {
                            format!("[{:.3}]", (((i * 3 + t * 5 + j) % 11) as f64 - 5.0) / 6.0)
                        })
                        .collect();
                    format!("[{}]", col.join(", "))
                })
                .collect();
            format!("{{\"xs\": [{}]}}", xs.join(", "))
        })
        .collect();
    let x = expected(
        "column_vectors",
        load_text("column_vectors", src),
        &inputs.join("\n"),
        &["xs"],
    );
    check_all_ways(&x);
    let (on, reuse_on) = common::compile(&x, true, tumble_compile::StaticOptions::all());
    assert!(
        on.blocks
            .iter()
            .all(|b| b.nodes.iter().all(|n| n.op.name != "transpose")),
        "a transpose is left"
    );
    agrees_with_canonical_products_off(&x, &on, &reuse_on, 0.0);
}

/// `nn.batch_matmul` with a batch of one on either side (a bilinear form's `x · V[g]` over a
/// shared `V`, with and without `transpose_b`, one row and three; each group's rows against an
/// instance's one matrix) becomes one product, and a shared `(G, N, K)` against every instance's
/// `(G, M, K)` (a capsule layer's transforms) runs group by group: equal to the reference every
/// way, no operator left to per-invocation calls, no `batch_matmul` left where one side has one
/// batch, and the same values with the rewrite off.
#[test]
fn batch_matmuls_broadcast_over_one_batch_are_products() {
    let src = r#"
def @main(%x: Tensor[(1, 4), float32], %u: Tensor[(3, 4), float32], %V: Tensor[(5, 6, 4), float32],
          %Vt: Tensor[(5, 4, 6), float32], %C: Tensor[(3, 6, 4), float32])
    -> (Tensor[(5, 1, 6), float32], Tensor[(5, 3, 6), float32], Tensor[(5, 1, 6), float32],
        Tensor[(5, 6, 1), float32], Tensor[(3, 1, 6), float32]) {
  let %x3 = reshape(%x, newshape=[1, 1, 4]);
  let %u3 = reshape(%u, newshape=[1, 3, 4]);
  let %xv = nn.batch_matmul(%x3, %V);
  (%xv,
   nn.batch_matmul(%u3, %V),
   nn.batch_matmul(%x3, %Vt, transpose_b=False),
   nn.batch_matmul(reshape(%xv, newshape=[5, 6, 1]), reshape(sum(sigmoid(%x)), newshape=[1, 1, 1]), transpose_b=False),
   nn.batch_matmul(reshape(%u, newshape=[3, 1, 4]), %C))
}
"#;
    let inputs: Vec<String> = (0..9)
        .map(|i| {
            let row = |r: usize| -> String {
                let v: Vec<String> = (0..4)
                    .map(|j| format!("{:.3}", ((i * 5 + r * 7 + j * 3) % 13) as f64 / 4.0 - 1.5))
                    .collect();
                format!("[{}]", v.join(", "))
            };
            format!(
                "{{\"x\": [{}], \"u\": [{}, {}, {}]}}",
                row(0),
                row(1),
                row(2),
                row(3)
            )
        })
        .collect();
    batches_without_loops("bmm_broadcast", src, &inputs, &["x", "u"]);
    let x = expected(
        "bmm_broadcast",
        load_text("bmm_broadcast", src),
        &inputs.join("\n"),
        &["x", "u"],
    );
    let (on, reuse_on) = common::compile(&x, true, tumble_compile::StaticOptions::all());
    let left: usize = on
        .blocks
        .iter()
        .map(|b| {
            b.nodes
                .iter()
                .filter(|n| n.op.name == "nn.batch_matmul")
                .count()
        })
        .sum();
    assert_eq!(
        left, 1,
        "only the capsule-like product is left a batch_matmul"
    );
    agrees_with_canonical_products_off(&x, &on, &reuse_on, 1e-5);
}

/// Matrix-vector products written as broadcast products summed over an axis, as ports of
/// `(W * h).sum(-1)` say — a shared weight times the instance's row over axis 1 (both operand
/// orders, `keepdims` both ways), the instance's own generated matrix (a hypernetwork's) times
/// its row, and a `(K, N)` matrix times a `(K, 1)` column over axis 0 — run as products: equal
/// to the reference every way, no `multiply` left in the blocks, and the same values (within
/// the products' rounding) with the rewrite off.
#[test]
fn broadcast_products_summed_over_an_axis_are_products() {
    let src = r#"
def @main(%h: Tensor[(1, 4), float32], %c: Tensor[(4, 1), float32], %W: Tensor[(3, 4), float32],
          %Z: Tensor[(4, 12), float32], %V: Tensor[(4, 5), float32])
    -> (Tensor[(3), float32], Tensor[(3, 1), float32], Tensor[(3), float32], Tensor[(5), float32],
        Tensor[(1, 5), float32]) {
  let %G = reshape(nn.dense(%h, transpose(%Z)), newshape=[3, 4]);
  (sum(multiply(%W, %h), axis=[1]),
   sum(multiply(%h, %W), axis=[-1], keepdims=True),
   sum(multiply(tanh(%G), %h), axis=[1]),
   sum(multiply(%V, %c), axis=[0]),
   sum(multiply(%c, %V), axis=[-2], keepdims=True))
}
"#;
    let inputs: Vec<String> = (0..9)
        .map(|i| {
            let v = |r: usize| -> Vec<String> {
                (0..4)
                    .map(|j| format!("{:.3}", ((i * 5 + r * 7 + j * 3) % 13) as f64 / 4.0 - 1.5))
                    .collect()
            };
            let col: Vec<String> = v(1).into_iter().map(|x| format!("[{x}]")).collect();
            format!(
                "{{\"h\": [[{}]], \"c\": [{}]}}",
                v(0).join(", "),
                col.join(", ")
            )
        })
        .collect();
    batches_without_loops("summed_products", src, &inputs, &["h", "c"]);
    let x = expected(
        "summed_products",
        load_text("summed_products", src),
        &inputs.join("\n"),
        &["h", "c"],
    );
    check_all_ways(&x);
    let (on, reuse_on) = common::compile(&x, true, tumble_compile::StaticOptions::all());
    let left: Vec<&str> = on
        .blocks
        .iter()
        .flat_map(|b| &b.nodes)
        .filter(|n| n.op.name == "multiply")
        .map(|n| n.op.name)
        .collect();
    assert!(left.is_empty(), "broadcast products left: {left:?}");
    agrees_with_canonical_products_off(&x, &on, &reuse_on, 1e-5);
}

/// `max`/`min` over every axis (a convergence test's `max(abs(h2 - h))` over an instance's
/// rows of its own length, a static matrix's extreme with `keepdims`, an integer tensor's) run
/// as a row reduction and one over what is left: equal to the reference every way, and no
/// extreme over several axes left in the blocks.
#[test]
fn extremes_over_every_axis_reduce_rows_first() {
    let src = r#"
def @main(%h: Tensor[(?, 4), float32], %g: Tensor[(?, 4), float32], %m: Tensor[(3, 4), float32],
          %k: Tensor[(?, 2), int32])
    -> (Tensor[(), float32], Tensor[(1, 1), float32], Tensor[(), int32], Tensor[(), float32]) {
  (max(abs(subtract(tanh(%h), %g))),
   min(multiply(%m, sum(%h)), keepdims=True),
   max(%k),
   min(%h))
}
"#;
    let inputs: Vec<String> = (0..9)
        .map(|i| {
            let rows = |n: usize, salt: usize| -> String {
                let r: Vec<String> = (0..n)
                    .map(|t| {
                        let v: Vec<String> = (0..4)
                            .map(|j| {
                                let x = ((i * 5 + t * 7 + j * 3 + salt) % 13) as f64 / 4.0 - 1.5;
                                format!("{x:.3}")
                            })
                            .collect();
                        format!("[{}]", v.join(", "))
                    })
                    .collect();
                format!("[{}]", r.join(", "))
            };
            let n = 1 + (i * 3) % 5;
            let k: Vec<String> = (0..n)
                .map(|t| format!("[{}, {}]", (i * 7 + t) % 11, -((t * 3) as i64)))
                .collect();
            format!(
                "{{\"h\": {}, \"g\": {}, \"k\": [{}]}}",
                rows(n, 0),
                rows(n, 5),
                k.join(", ")
            )
        })
        .collect();
    let x = expected(
        "extremes_by_rows",
        load_text("extremes_by_rows", src),
        &inputs.join("\n"),
        &["h", "g", "k"],
    );
    check_all_ways(&x);
    let (on, _) = common::compile(&x, true, tumble_compile::StaticOptions::all());
    let per_row = on
        .blocks
        .iter()
        .flat_map(|b| &b.nodes)
        .filter(|n| matches!(n.op.name, "max" | "min") && n.attrs.get("axis").is_some())
        .count();
    assert_eq!(per_row, 4, "one row reduction per extreme");
}

/// An LSTM-style cell that spells `split(nn.dense(%x, %W), 3)` once per gate and adds two random
/// draws written alike: the repeated products and splits are computed once (one product in the
/// block), the draws stay two draws. Equal to the reference every way, with and without the pass.
#[test]
fn repeated_operators_are_computed_once_but_draws_are_not_merged() {
    let src = r#"
def @main(%x: Tensor[(1, 6), float32], %W: Tensor[(12, 6), float32]) -> Tensor[(1, 4), float32] {
  let %i = sigmoid(split(nn.dense(%x, %W), indices_or_sections=3, axis=1).0);
  let %o = sigmoid(split(nn.dense(%x, %W), indices_or_sections=3, axis=1).1);
  let %u = tanh(split(nn.dense(%x, %W), indices_or_sections=3, axis=1).2);
  let %n = add(random.db_uniform(low=0.0, high=1.0, out_shape=[1, 4], out_dtype="float32"),
               random.db_uniform(low=0.0, high=1.0, out_shape=[1, 4], out_dtype="float32"));
  add(multiply(%o, tanh(multiply(%i, %u))), multiply(%n, 0.01f))
}
"#;
    let x = expected("cse", load_text("cse", src), &rows(9, 6), &["x"]);
    check_all_ways(&x);
    let (program, _) = common::compile(&x, true, tumble_compile::StaticOptions::all());
    let count = |p: &tumble_compile::Program, name: &str| -> usize {
        p.blocks
            .iter()
            .map(|b| b.nodes.iter().filter(|n| n.op.name == name).count())
            .sum()
    };
    assert_eq!(count(&program, "nn.dense"), 1);
    assert_eq!(count(&program, "split"), 1);
    // The draws are not block operators (they run where the program reaches them, each its
    // own); the comparison with the reference above sees two different draws added.
    let statics = tumble_compile::StaticOptions {
        cse: false,
        ..tumble_compile::StaticOptions::all()
    };
    let (off, _) = common::compile(&x, true, statics);
    assert_eq!(count(&off, "nn.dense"), 3);
}

const BINARY_TREE: &str = r#"
type BTree {
  Leaf(Tensor[(1, 4), float32]),
  Node(BTree, BTree),
}
def @enc(%t: BTree, %wl: Tensor[(4, 4), float32], %wr: Tensor[(4, 4), float32]) -> Tensor[(1, 4), float32] {
  match (%t) {
    Leaf(%x) => tanh(%x),
    Node(%l, %r) => {
      let %hl = @enc(%l, %wl, %wr);
      let %hr = @enc(%r, %wl, %wr);
      let %noise = random.db_uniform(low=0.0, high=0.01, out_shape=[1, 4], out_dtype="float32");
      tanh(add(add(nn.dense(%hl, %wl), nn.dense(%hr, %wr)), %noise))
    },
  }
}
def @refine(%h: Tensor[(1, 4), float32], %n: int32, %u: Tensor[(4, 4), float32]) -> Tensor[(1, 4), float32] {
  if (greater(sum(%h), 0f)) {
    if (greater(%n, 0)) { @refine(tanh(nn.dense(%h, %u)), subtract(%n, 1), %u) } else { %h }
  } else { %h }
}
def @main(%t: BTree, %wl: Tensor[(4, 4), float32], %wr: Tensor[(4, 4), float32], %u: Tensor[(4, 4), float32]) -> Tensor[(1, 4), float32] {
  let %h = @enc(%t, %wl, %wr);
  @refine(%h, 3, %u)
}
"#;

/// [`BINARY_TREE`]'s encoder with the calls as operands of the node's expression, a random draw
/// after them.
const BINARY_TREE_NESTED: &str = r#"
type BTree {
  Leaf(Tensor[(1, 4), float32]),
  Node(BTree, BTree),
}
def @enc(%t: BTree, %wl: Tensor[(4, 4), float32], %wr: Tensor[(4, 4), float32]) -> Tensor[(1, 4), float32] {
  match (%t) {
    Leaf(%x) => tanh(%x),
    Node(%l, %r) => tanh(add(add(nn.dense(@enc(%l, %wl, %wr), %wl), nn.dense(@enc(%r, %wl, %wr), %wr)),
      random.db_uniform(low=0.0, high=0.01, out_shape=[1, 4], out_dtype="float32"))),
  }
}
def @main(%t: BTree, %wl: Tensor[(4, 4), float32], %wr: Tensor[(4, 4), float32]) -> Tensor[(1, 4), float32] {
  @enc(%t, %wl, %wr)
}
"#;

/// Random binary trees of 1 to 2^depth leaves, `{"t": ...}` per instance.
fn binary_trees(count: usize) -> String {
    fn tree(seed: &mut u64, depth: u32) -> String {
        *seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        let r = (*seed >> 33) % 10;
        if depth == 0 || r < 3 {
            let v = ((*seed >> 40) % 17) as f64 / 8.0 - 1.0;
            format!("{{\"Leaf\": [[[{v:.3}, {:.3}, 0.5, -0.25]]]}}", -v)
        } else {
            let l = tree(seed, depth - 1);
            let r = tree(seed, depth - 1);
            format!("{{\"Node\": [{l}, {r}]}}")
        }
    }
    let mut seed = 7u64;
    (0..count)
        .map(|i| format!("{{\"t\": {}}}", tree(&mut seed, (i % 6) as u32)))
        .collect::<Vec<_>>()
        .join("\n")
}

/// Two recursive calls written one after the other (`let %hl = @enc(%l); let %hr = @enc(%r)`)
/// run side by side as `db.concurrent` would run them, and a second recursion after the first
/// (`@refine` after `@enc`) starts after a phase boundary: fewer launches, the same outputs (and
/// random draws) as the reference, under every scheduler and batch size.
#[test]
fn independent_calls_written_in_sequence_run_side_by_side() {
    let inputs = binary_trees(40);
    let all = tumble_compile::StaticOptions::all();
    let without = tumble_compile::StaticOptions {
        concurrency: false,
        ..all
    };
    for (name, src) in [
        ("binary_tree", BINARY_TREE),
        ("binary_tree_nested", BINARY_TREE_NESTED),
    ] {
        agrees(name, src, &inputs, &["t"]);
        let on = launches_with(src, &inputs, &["t"], true, all);
        let off = launches_with(src, &inputs, &["t"], true, without);
        assert!(
            on < off,
            "{name}: launches with concurrency {on}, without {off}"
        );
    }
}

/// Two loops over each instance's rows, a forward one and a backward one reading
/// `take(%X, %n - 1 - %i)`, each ending on `if (%i == %n)`: a counter against a length, known on
/// the host, so neither waits, and the second runs beside the first instead of after it (where
/// each instance's start depended on its own length: a launch per distinct length and step).
/// The loops are operands of one call, as a bidirectional layer joins its two directions, so no
/// phase boundary falls between them.
const TWO_COUNTED_LOOPS: &str = r#"
def @fwd(%i: int32, %n: int32, %X: Tensor[(?, 4), float32], %h: Tensor[(1, 4), float32], %w: Tensor[(4, 4), float32]) -> List[Tensor[(1, 4), float32]] {
  if (%i == %n) { Nil } else {
    let %h2 = tanh(add(expand_dims(take(%X, %i, axis=0), axis=0), nn.dense(%h, %w)));
    Cons(%h2, @fwd(%i + 1, %n, %X, %h2, %w))
  }
}
def @bwd(%i: int32, %n: int32, %X: Tensor[(?, 4), float32], %h: Tensor[(1, 4), float32], %w: Tensor[(4, 4), float32]) -> List[Tensor[(1, 4), float32]] {
  if (%i == %n) { Nil } else {
    let %h2 = tanh(add(expand_dims(take(%X, %n - 1 - %i, axis=0), axis=0), nn.dense(%h, %w)));
    Cons(%h2, @bwd(%i + 1, %n, %X, %h2, %w))
  }
}
def @main(%X: Tensor[(?, 4), float32], %n: int32, %wf: Tensor[(4, 4), float32], %wb: Tensor[(4, 4), float32]) -> Tensor[(1, 4), float32] {
  let %z = zeros(shape=[1, 4], dtype="float32");
  @join(@fwd(0, %n, %X, %z, %wf), @bwd(0, %n, %X, %z, %wb))
}
def @join(%f: List[Tensor[(1, 4), float32]], %b: List[Tensor[(1, 4), float32]]) -> Tensor[(1, 4), float32] {
  let %z = zeros(shape=[1, 4], dtype="float32");
  let %add = fn (%a: Tensor[(1, 4), float32], %y: Tensor[(1, 4), float32]) -> Tensor[(1, 4), float32] { add(%a, %y) };
  add(@foldl(%add, %z, %f), @foldl(%add, %z, %b))
}
"#;

#[test]
fn a_loop_ended_by_a_host_counter_runs_beside_its_sibling() {
    let inputs: String = (0..24)
        .map(|i| {
            let n = 1 + (i * 5) % 9;
            let rows: Vec<String> = (0..n)
                .map(|r| {
                    let row: Vec<String> = (0..4)
                        .map(|j| format!("{:.2}", ((i + r * 3 + j * 7) % 13) as f64 / 6.0 - 1.0))
                        .collect();
                    format!("[{}]", row.join(", "))
                })
                .collect();
            format!("{{\"X\": [{}], \"n\": {n}}}\n", rows.join(", "))
        })
        .collect();
    agrees("two_counted_loops", TWO_COUNTED_LOOPS, &inputs, &["X", "n"]);
    let all = tumble_compile::StaticOptions::all();
    let without = tumble_compile::StaticOptions {
        concurrency: false,
        ..all
    };
    let on = launches_with(TWO_COUNTED_LOOPS, &inputs, &["X", "n"], true, all);
    let off = launches_with(TWO_COUNTED_LOOPS, &inputs, &["X", "n"], true, without);
    // Nine lengths: in sequence, the backward loop's steps fall at up to nine depths each.
    assert!(
        on * 2 < off,
        "launches with concurrency {on}, without {off}"
    );
}

/// A concurrent element that waits on a computed tensor (here a conditional on the left
/// subtree's state) is followed as written: the right subtree starts where the left one ended,
/// after the flushes it waited for, not beside it at depths the other instances have left.
#[test]
fn an_element_that_waits_is_followed_as_written() {
    let src = BINARY_TREE
        .replace(
            "let %hl = @enc(%l, %wl, %wr);",
            "let %hl = @gate(@enc(%l, %wl, %wr), %u);",
        )
        .replace(
            "def @enc(%t: BTree, %wl: Tensor[(4, 4), float32], %wr: Tensor[(4, 4), float32])",
            "def @enc(%t: BTree, %wl: Tensor[(4, 4), float32], %wr: Tensor[(4, 4), float32], %u: Tensor[(4, 4), float32])",
        )
        .replace("@enc(%r, %wl, %wr)", "@enc(%r, %wl, %wr, %u)")
        .replace("@enc(%l, %wl, %wr)", "@enc(%l, %wl, %wr, %u)")
        .replace("@enc(%t, %wl, %wr)", "@enc(%t, %wl, %wr, %u)")
        + r#"
def @gate(%h: Tensor[(1, 4), float32], %u: Tensor[(4, 4), float32]) -> Tensor[(1, 4), float32] {
  if (greater(sum(%h), 0f)) { tanh(nn.dense(%h, %u)) } else { %h }
}
"#;
    let inputs = binary_trees(40);
    agrees("gated_tree", &src, &inputs, &["t"]);
    let all = tumble_compile::StaticOptions::all();
    let without = tumble_compile::StaticOptions {
        concurrency: false,
        ..all
    };
    let on = launches_with(&src, &inputs, &["t"], true, all);
    let off = launches_with(&src, &inputs, &["t"], true, without);
    assert_eq!(on, off, "launches with concurrency {on}, without {off}");
}

/// Invocations of a launch on the same token (a mini-batch's leaves repeat words) take the
/// results of one of them: counted by the profile, outputs equal to the reference under every
/// scheduler and batch size; a block with a random draw computes every invocation.
#[test]
fn identical_invocations_are_computed_once() {
    let src = |noise: &str| {
        format!(
            r#"
def @leaf(%tok: Tensor[(1), int32], %emb: Tensor[(7, 4), float32], %w: Tensor[(4, 4), float32]) -> Tensor[(1, 4), float32] {{
  tanh(add(nn.dense(take(%emb, %tok, axis=0), %w), {noise}))
}}
def @encode(%xs: List[Tensor[(1), int32]], %emb: Tensor[(7, 4), float32], %w: Tensor[(4, 4), float32]) -> List[Tensor[(1, 4), float32]] {{
  @map(fn (%t: Tensor[(1), int32]) -> Tensor[(1, 4), float32] {{ @leaf(%t, %emb, %w) }}, %xs)
}}
def @main(%xs: List[Tensor[(1), int32]], %emb: Tensor[(7, 4), float32], %w: Tensor[(4, 4), float32]) -> Tensor[(1, 4), float32] {{
  @foldl(fn (%a: Tensor[(1, 4), float32], %b: Tensor[(1, 4), float32]) -> Tensor[(1, 4), float32] {{ add(%a, %b) }},
    zeros(shape=[1, 4], dtype="float32"), @encode(%xs, %emb, %w))
}}
"#
        )
    };
    // Tokens 0..7 in every instance, in different orders and counts: most leaves repeat one.
    let inputs: String = (0..12)
        .map(|i| {
            let toks: Vec<String> = (0..(3 + i % 5))
                .map(|k| format!("[{}]", (i * 3 + k * 5) % 7))
                .collect();
            format!("{{\"xs\": [{}]}}\n", toks.join(", "))
        })
        .collect();
    let plain = src("0f");
    agrees("memo", &plain, &inputs, &["xs"]);
    let x = expected("memo", load_text("memo", &plain), &inputs, &["xs"]);
    let p = batch_profile(&x, tumble_runtime::Options::default());
    assert!(p.memoized > 0, "repeated tokens were computed again");
    let random =
        src("random.db_uniform(low=0.0, high=1.0, out_shape=[1, 4], out_dtype=\"float32\")");
    agrees("memo_random", &random, &inputs, &["xs"]);
    let x = expected(
        "memo_random",
        load_text("memo_random", &random),
        &inputs,
        &["xs"],
    );
    let p = batch_profile(&x, tumble_runtime::Options::default());
    assert_eq!(
        p.memoized, 0,
        "a block with a random draw computes every invocation"
    );
}

/// Mini-batches of one job take the results earlier ones computed for an invocation of the same
/// block on the same host values (`tumble_runtime::Options::job_memo`): a leaf on a word seen in
/// an earlier mini-batch is not computed again. The outputs are bit for bit those of the job
/// computing everything, and a block with a random draw keeps nothing.
#[test]
fn later_mini_batches_take_kept_results() {
    let src = |noise: &str| {
        format!(
            r#"
def @leaf(%tok: Tensor[(1), int32], %emb: Tensor[(7, 4), float32], %w: Tensor[(4, 4), float32], Primitive=1) -> Tensor[(1, 4), float32] {{
  tanh(add(nn.dense(take(%emb, %tok, axis=0), %w), {noise}))
}}
def @step(%h: Tensor[(1, 4), float32], %x: Tensor[(1, 4), float32], %u: Tensor[(4, 4), float32], Primitive=1) -> Tensor[(1, 4), float32] {{
  sigmoid(add(nn.dense(%h, %u), %x))
}}
def @main(%xs: List[Tensor[(1), int32]], %emb: Tensor[(7, 4), float32], %w: Tensor[(4, 4), float32], %u: Tensor[(4, 4), float32]) -> Tensor[(1, 4), float32] {{
  @foldl(fn (%h: Tensor[(1, 4), float32], %t: Tensor[(1), int32]) -> Tensor[(1, 4), float32] {{
    @step(%h, @leaf(%t, %emb, %w), %u)
  }}, zeros(shape=[1, 4], dtype="float32"), %xs)
}}
"#
        )
    };
    let inputs: String = (0..10)
        .map(|i| {
            let toks: Vec<String> = (0..(2 + i % 4))
                .map(|k| format!("[{}]", (i * 2 + k * 3) % 7))
                .collect();
            format!("{{\"xs\": [{}]}}\n", toks.join(", "))
        })
        .collect();
    // Mini-batches of 3 on one job, with the kept results and without.
    let run = |x: &common::Expected, job_memo: bool| {
        let (program, reuse) = common::compile(x, true, tumble_compile::StaticOptions::all());
        let opts = tumble_runtime::Options {
            job_memo,
            ..tumble_runtime::Options::default()
        };
        let (outs, p) = common::run_in_mini_batches(x, &program, &reuse, 3, opts, &x.name);
        (outs, p.job_memoized)
    };
    let plain = src("0f");
    agrees("job_memo", &plain, &inputs, &["xs"]);
    let x = expected("job_memo", load_text("job_memo", &plain), &inputs, &["xs"]);
    let (on, kept) = run(&x, true);
    let (off, none) = run(&x, false);
    assert!(kept > 0, "no leaf took a result an earlier mini-batch kept");
    assert_eq!(none, 0, "kept results taken with them off");
    for (i, ((a, b), e)) in on.iter().zip(&off).zip(&x.outputs).enumerate() {
        common::same_within(a, b, "", 0.0)
            .unwrap_or_else(|m| panic!("instance {i}: kept vs computed: {m}"));
        common::same(a, e, "").unwrap_or_else(|m| panic!("instance {i}: vs reference: {m}"));
    }
    let random =
        src("random.db_uniform(low=0.0, high=1.0, out_shape=[1, 4], out_dtype=\"float32\")");
    let x = expected(
        "job_memo_random",
        load_text("job_memo_random", &random),
        &inputs,
        &["xs"],
    );
    assert_eq!(
        run(&x, true).1,
        0,
        "a block with a random draw kept its results"
    );
}

/// An invocation whose computed inputs come from invocations that took an identical one's
/// results reads what that one's readers read: a launch of those readers computes each distinct
/// one once too (the forget gate of two leaves of one word). Twelve instances over three pairs
/// of four tokens: the leaves repeat 20 times whatever their launches, the pairs 9 times.
#[test]
fn readers_of_identical_invocations_are_computed_once() {
    let src = r#"
def @leaf(%tok: Tensor[(1), int32], %emb: Tensor[(7, 4), float32], %w: Tensor[(4, 4), float32], Primitive=1) -> Tensor[(1, 4), float32] {
  tanh(nn.dense(take(%emb, %tok, axis=0), %w))
}
def @pair(%a: Tensor[(1, 4), float32], %b: Tensor[(1, 4), float32], %u: Tensor[(4, 4), float32], Primitive=1) -> Tensor[(1, 4), float32] {
  sigmoid(add(nn.dense(%a, %u), nn.dense(%b, %u)))
}
def @main(%a: Tensor[(1), int32], %b: Tensor[(1), int32], %emb: Tensor[(7, 4), float32], %w: Tensor[(4, 4), float32], %u: Tensor[(4, 4), float32]) -> Tensor[(1, 4), float32] {
  let %r = db.concurrent((@leaf(%a, %emb, %w), @leaf(%b, %emb, %w)));
  @pair(%r.0, %r.1, %u)
}
"#;
    let inputs: String = (0..12)
        .map(|i| {
            let (a, b) = [(0, 1), (2, 3), (0, 3)][i % 3];
            format!("{{\"a\": [{a}], \"b\": [{b}]}}\n")
        })
        .collect();
    agrees("memo_readers", src, &inputs, &["a", "b"]);
    let x = expected(
        "memo_readers",
        load_text("memo_readers", src),
        &inputs,
        &["a", "b"],
    );
    let p = batch_profile(&x, tumble_runtime::Options::default());
    assert_eq!(p.memoized, 29, "leaves 20, pairs 9");
}

/// Folds run as loops (`@foldl`'s shape: a user's recursion and the prelude's, specialized or
/// calling a closure that captures an instance's value, so its step takes steps of its own)
/// record the same graph as the interpreted recursion — the same nodes at the same inline
/// depths, so the same launches — in fewer evaluation steps, and agree with the reference.
#[test]
fn folds_run_as_loops_record_the_same_graph() {
    let src = r#"
def @acc_rnn(%h: Tensor[(1, 4), float32], %xs: List[Tensor[(1, 4), float32]], %W: Tensor[(4, 4), float32]) -> Tensor[(1, 4), float32] {
  match (%xs) {
    Cons(%x, %rest) => @acc_rnn(tanh(add(nn.dense(%h, %W), %x)), %rest, %W),
    Nil => %h,
  }
}
def @main(%xs: List[Tensor[(1, 4), float32]], %W: Tensor[(4, 4), float32]) -> (Tensor[(1, 4), float32], Tensor[(1, 4), float32], Tensor[(1, 4), float32]) {
  let %z = zeros(shape=[1, 4], dtype="float32");
  let %h = @acc_rnn(%z, %xs, %W);
  let %scaled = fn (%a: Tensor[(1, 4), float32], %x: Tensor[(1, 4), float32]) -> Tensor[(1, 4), float32] {
    add(multiply(%a, %h), sigmoid(%x))
  };
  let %plus = fn (%a: Tensor[(1, 4), float32], %b: Tensor[(1, 4), float32]) -> Tensor[(1, 4), float32] {
    add(%a, %b)
  };
  (%h, @foldl(%scaled, %z, %xs), @foldl(%plus, @hd(%xs), @tl(%xs)))
}
"#;
    let inputs: Vec<String> = (0..7)
        .map(|i| list_and_weight_json(i, 1 + i % 4, 0.4))
        .collect();
    let x = expected(
        "folds",
        load_text("folds", src),
        &inputs.join("\n"),
        &["xs"],
    );
    check_all_ways(&x);
    same_graph_in_fewer_steps(&x);
    let loops_of = |natives: bool| {
        let (program, _) =
            common::compile_natives(&x, true, tumble_compile::StaticOptions::all(), natives);
        program.natives.fold_loops.iter().flatten().count()
    };
    let (loops_on, loops_off) = (loops_of(true), loops_of(false));
    // @acc_rnn and the two copies of @foldl (one per closure: the capturing one calls it).
    assert!(loops_on >= 2 && loops_off == 0, "{loops_on} fold loops");
}

/// Scans run as loops (an RNN over a list returning the list of its states: one binding, a
/// tuple state read by field, and a step with an `if` on a computed tensor, which suspends the
/// loop mid-element) record the same graph as the interpreted recursion in fewer evaluation
/// steps, and agree with the reference; a step that reads the list's tail is not a scan.
#[test]
fn scans_run_as_loops_record_the_same_graph() {
    let src = r#"
def @rnn(%xs: List[Tensor[(1, 4), float32]], %h: Tensor[(1, 4), float32], %W: Tensor[(4, 4), float32]) -> List[Tensor[(1, 4), float32]] {
  match (%xs) {
    Cons(%x, %rest) => {
      let %h2 = tanh(add(nn.dense(%h, %W), %x));
      Cons(%h2, @rnn(%rest, %h2, %W))
    },
    Nil => Nil,
  }
}
def @lstm(%xs: List[Tensor[(1, 4), float32]], %s: (Tensor[(1, 4), float32], Tensor[(1, 4), float32]), %W: Tensor[(4, 4), float32]) -> List[Tensor[(1, 4), float32]] {
  match (%xs) {
    Cons(%x, %rest) => {
      let %g = sigmoid(add(nn.dense(%s.0, %W), %x));
      let %c = add(multiply(%g, %s.1), %x);
      let %n = (multiply(%g, tanh(%c)), %c);
      Cons(%n.0, @lstm(%rest, %n, %W))
    },
    Nil => Nil,
  }
}
def @gated(%xs: List[Tensor[(1, 4), float32]], %h: Tensor[(1, 4), float32], %W: Tensor[(4, 4), float32]) -> List[Tensor[(1, 4), float32]] {
  match (%xs) {
    Cons(%x, %rest) => {
      let %h2 = if (greater(sum(%x), 0f)) { tanh(add(nn.dense(%h, %W), %x)) } else { multiply(%h, 0.5f) };
      Cons(%h2, @gated(%rest, %h2, %W))
    },
    Nil => Nil,
  }
}
def @peek(%xs: List[Tensor[(1, 4), float32]], %h: Tensor[(1, 4), float32]) -> List[Tensor[(1, 4), float32]] {
  match (%xs) {
    Cons(%x, %rest) => {
      let %h2 = add(%h, @hd(Cons(%x, %rest)));
      Cons(%h2, @peek(%rest, %h2))
    },
    Nil => Nil,
  }
}
def @main(%xs: List[Tensor[(1, 4), float32]], %W: Tensor[(4, 4), float32]) -> (List[Tensor[(1, 4), float32]], List[Tensor[(1, 4), float32]], List[Tensor[(1, 4), float32]], List[Tensor[(1, 4), float32]]) {
  let %z = zeros(shape=[1, 4], dtype="float32");
  (@rnn(%xs, %z, %W), @lstm(%xs, (%z, %z), %W), @gated(%xs, %z, %W), @peek(%xs, %z))
}
"#;
    let inputs: Vec<String> = (0..9)
        .map(|i| list_and_weight_json(i, i % 5, 0.45))
        .collect();
    let x = expected(
        "scans",
        load_text("scans", src),
        &inputs.join("\n"),
        &["xs"],
    );
    check_all_ways(&x);
    same_graph_in_fewer_steps(&x);
    let scans_of = |natives: bool| {
        let (program, _) =
            common::compile_natives(&x, true, tumble_compile::StaticOptions::all(), natives);
        let mut scans: Vec<String> = program
            .global_index
            .iter()
            .filter(|(_, g)| program.natives.scan_loop(**g).is_some())
            .map(|(name, _)| name.clone())
            .collect();
        scans.sort();
        scans
    };
    assert_eq!(scans_of(true), ["gated", "lstm", "rnn"], "scans found");
    assert!(scans_of(false).is_empty());
}

/// A tree recursion through `@map` over a closure (specialized into a forwarder
/// `fn (%c) { @enc(%c, ..) }`, which leaf inlining replaces by the call itself) whose leaf arm is
/// taken at once where the map reads it: the same outputs, nodes and launches as the interpreted
/// calls, in fewer steps; a leaf arm that cannot complete at once (an `if` on a computed tensor)
/// takes steps, and the reference agrees every way.
#[test]
fn calls_at_once_record_the_same_graph() {
    let src = r#"
def @enc(%t: Tree[Tensor[(1, 4), float32]], %W: Tensor[(4, 4), float32]) -> Tensor[(1, 4), float32] {
  match (%t) {
    Rose(%x, Nil) => tanh(nn.dense(%x, %W)),
    Rose(%x, %kids) => {
      let %hs = @map(fn (%c: Tree[Tensor[(1, 4), float32]]) -> Tensor[(1, 4), float32] { @enc(%c, %W) }, %kids);
      let %plus = fn (%a: Tensor[(1, 4), float32], %b: Tensor[(1, 4), float32]) -> Tensor[(1, 4), float32] { add(%a, %b) };
      tanh(add(nn.dense(@foldl(%plus, %x, %hs), %W), %x))
    },
  }
}
def @gate(%t: Tree[Tensor[(1, 4), float32]], %W: Tensor[(4, 4), float32]) -> Tensor[(1, 4), float32] {
  match (%t) {
    Rose(%x, Nil) => if (greater(sum(%x), 0f)) { sigmoid(nn.dense(%x, %W)) } else { %x },
    Rose(%x, %kids) => {
      let %hs = @map(fn (%c: Tree[Tensor[(1, 4), float32]]) -> Tensor[(1, 4), float32] { @gate(%c, %W) }, %kids);
      multiply(@hd(%hs), %x)
    },
  }
}
def @main(%t: Tree[Tensor[(1, 4), float32]], %W: Tensor[(4, 4), float32]) -> (Tensor[(1, 4), float32], Tensor[(1, 4), float32]) {
  (@enc(%t, %W), @gate(%t, %W))
}
"#;
    // Trees of 1 to 9 leaves, each node a (1, 4) tensor.
    fn tree(i: usize, depth: usize) -> String {
        let v: Vec<String> = (0..4)
            .map(|c| format!("{:.2}", ((i * 7 + depth * 3 + c) % 11) as f64 / 10.0 - 0.45))
            .collect();
        let kids: Vec<String> = if depth == 0 || (i + depth) % 4 == 0 {
            Vec::new()
        } else {
            (0..1 + (i + depth) % 3)
                .map(|k| tree(i + k, depth - 1))
                .collect()
        };
        format!(
            "{{\"Rose\": [[[{}]], [{}]]}}",
            v.join(", "),
            kids.join(", ")
        )
    }
    let inputs: Vec<String> = (0..9)
        .map(|i| format!("{{\"t\": {}, \"W\": {}}}", tree(i, i % 4), weight4_json()))
        .collect();
    let x = expected("calls", load_text("calls", src), &inputs.join("\n"), &["t"]);
    check_all_ways(&x);
    same_graph_in_fewer_steps(&x);
    // No call of a forwarder is left (the specialized `@map`s call @enc and @gate themselves).
    let (program, _) =
        common::compile_natives(&x, true, tumble_compile::StaticOptions::all(), true);
    let forwards = |g: u32| {
        program
            .globals
            .get(g as usize)
            .and_then(|&l| program.lambdas.get(l as usize))
            .is_some_and(|l| matches!(l.body, tumble_compile::Code::CallGlobal { .. }))
    };
    let mut calls_of_forwarders = 0;
    for l in &program.lambdas {
        l.body.visit(&mut |c| {
            if matches!(c, tumble_compile::Code::CallGlobal { global, .. } if forwards(*global)) {
                calls_of_forwarders += 1;
            }
        });
    }
    assert_eq!(calls_of_forwarders, 0);
}

/// A 4 × 4 weight as JSON, the same in every instance.
fn weight4_json() -> String {
    let w: Vec<String> = (0..4)
        .map(|r| {
            let v: Vec<String> = (0..4)
                .map(|c| format!("{:.2}", ((r * 5 + c * 3) % 7) as f64 / 7.0 - 0.5))
                .collect();
            format!("[{}]", v.join(", "))
        })
        .collect();
    format!("[{}]", w.join(", "))
}

/// Instance `i` of a list program: `{"xs": [n tensors of shape (1, 4)], "W": weight}`, the
/// values in [-shift, 1 - shift].
fn list_and_weight_json(i: usize, n: usize, shift: f64) -> String {
    let xs: Vec<String> = (0..n)
        .map(|j| {
            let v: Vec<String> = (0..4)
                .map(|c| format!("{:.2}", ((i + j * 3 + c) % 9) as f64 / 8.0 - shift))
                .collect();
            format!("[[{}]]", v.join(", "))
        })
        .collect();
    format!("{{\"xs\": [{}], \"W\": {}}}", xs.join(", "), weight4_json())
}

/// The evaluator's shortcuts (natives) on and off record the same graph — the same nodes, so
/// the same launches — and compute the same outputs, on fewer evaluation steps when on.
fn same_graph_in_fewer_steps(x: &common::Expected) {
    let go = |natives: bool| {
        let (program, reuse) =
            common::compile_natives(x, true, tumble_compile::StaticOptions::all(), natives);
        let (out, profile) = common::run_once(x, &program, &reuse, Default::default());
        (format!("{out:?}"), profile)
    };
    let ((out_on, on), (out_off, off)) = (go(true), go(false));
    assert_eq!(out_on, out_off);
    assert_eq!((on.nodes, on.launches), (off.nodes, off.launches));
    assert!(
        on.host_steps < off.host_steps,
        "{} steps with the shortcuts, {} without",
        on.host_steps,
        off.host_steps
    );
}

/// A matrix weight the program chooses per instance — by an `if` on a computed value (two
/// experts) or by a `match` on the node kind, inside a tuple (a weight per operator of an
/// expression tree) — is one of the model weights: a launch groups its invocations by the
/// weight they pass and runs each group as one product with that weight (its locality chunks
/// ran every invocation alone, and the `match`'s product fell back to the reference kernel:
/// 65× slower than the same math written with a `nn.dense` per arm). Equal to the reference
/// every way; far fewer launches than invocations with the groups, one per invocation without.
#[test]
fn weights_chosen_per_instance_launch_in_groups() {
    let src = r#"
type Expr {
  Lit(Tensor[(1, 256), float32]),
  Add(Expr, Expr),
  Neg(Expr),
}
def @enc(%e: Expr, %W_add: Tensor[(256, 512), float32], %W_neg: Tensor[(256, 512), float32])
    -> Tensor[(1, 256), float32] {
  match (%e) {
    Lit(%x) => %x,
    _ => {
      let %kids = match? (%e) {
        Add(%a, %c) => (@enc(%a, %W_add, %W_neg), @enc(%c, %W_add, %W_neg), %W_add),
        Neg(%a) => (@enc(%a, %W_add, %W_neg), zeros(shape=[1, 256], dtype="float32"), %W_neg),
      };
      tanh(nn.dense(concatenate((%kids.0, %kids.1), axis=1), %kids.2))
    },
  }
}
def @layers(%n: Tensor[(), int32], %h: Tensor[(1, 256), float32],
            %Wa: Tensor[(256, 256), float32], %Wb: Tensor[(256, 256), float32]) -> Tensor[(1, 256), float32] {
  if (%n == 0) {
    %h
  } else {
    let %W = if (less(sum(%h), 0f)) { %Wa } else { %Wb };
    @layers(%n - 1, tanh(nn.dense(%h, %W)), %Wa, %Wb)
  }
}
def @main(%e: Expr, %W_add: Tensor[(256, 512), float32], %W_neg: Tensor[(256, 512), float32],
          %Wa: Tensor[(256, 256), float32], %Wb: Tensor[(256, 256), float32]) -> Tensor[(1, 256), float32] {
  @layers(3, @enc(%e, %W_add, %W_neg), %Wa, %Wb)
}
"#;
    let leaf = |i: usize| {
        let v: Vec<String> = (0..256)
            .map(|j| format!("{:.3}", (((i * 13 + j * 5) % 19) as f64 - 9.0) / 12.0))
            .collect();
        format!("{{\"Lit\": [[[{}]]]}}", v.join(","))
    };
    let inputs: Vec<String> = (0..12)
        .map(|i| {
            let e = match i % 3 {
                0 => format!("{{\"Add\": [{}, {}]}}", leaf(i), leaf(i + 1)),
                1 => format!("{{\"Neg\": [{{\"Add\": [{}, {}]}}]}}", leaf(i), leaf(i + 2)),
                _ => format!("{{\"Neg\": [{}]}}", leaf(i)),
            };
            format!("{{\"e\": {e}}}")
        })
        .collect();
    let x = expected(
        "chosen_weights",
        load_text("chosen_weights", src),
        &inputs.join("\n"),
        &["e"],
    );
    check_all_ways(&x);
    let launches = |weight_groups: bool| {
        let profile = batch_profile(
            &x,
            tumble_runtime::Options {
                weight_groups,
                ..tumble_runtime::Options::default()
            },
        );
        let (launches, invocations) = {
            let s = profile.blocks_where(|name| name.contains("tanh"));
            (s.launches, s.invocations)
        };
        assert!(profile.fused.fallbacks == 0 || !weight_groups, "{profile}");
        (launches, invocations)
    };
    let (grouped, invocations) = launches(true);
    let (alone, _) = launches(false);
    // 12 instances: 12 + 4 expression nodes, 36 layer steps.
    assert_eq!(invocations, 52);
    assert!(
        grouped <= 12,
        "{grouped} launches of {invocations} invocations"
    );
    assert_eq!(alone, invocations);
}

/// A plain GRU step — the token's `W·x` and the state's `U·h` in one run of operators, so one
/// automatic block — is split: the part reading no recursive state (the embedding lookup, the
/// product and its bias) becomes a hoisted block of its own, launched once for every token of
/// every instance with repeated tokens computed once, as a `Primitive=1` input transform would
/// be. Equal to the reference every way; without the split, one block and no hoisted site.
#[test]
fn a_plain_gru_step_hoists_its_input_transform() {
    let src = r#"
def @gru(%toks: List[Tensor[(1), int32]], %h: Tensor[(1, 8), float32],
         %emb: Tensor[(6, 8), float32], %W: Tensor[(24, 8), float32], %U: Tensor[(24, 8), float32],
         %bw: Tensor[(24), float32]) -> Tensor[(1, 8), float32] {
  match (%toks) {
    Cons(%t, %rest) => {
      let %gx = split(add(nn.dense(take(%emb, %t, axis=0), %W), %bw), indices_or_sections=3, axis=1);
      let %gh = split(nn.dense(%h, %U), indices_or_sections=3, axis=1);
      let %r = sigmoid(add(%gx.0, %gh.0));
      let %z = sigmoid(add(%gx.1, %gh.1));
      let %n = tanh(add(%gx.2, multiply(%r, %gh.2)));
      @gru(%rest, add(multiply(subtract(1f, %z), %n), multiply(%z, %h)), %emb, %W, %U, %bw)
    },
    Nil => %h,
  }
}
def @main(%toks: List[Tensor[(1), int32]], %emb: Tensor[(6, 8), float32], %W: Tensor[(24, 8), float32],
          %U: Tensor[(24, 8), float32], %bw: Tensor[(24), float32]) -> Tensor[(1, 8), float32] {
  @gru(%toks, zeros(shape=[1, 8], dtype="float32"), %emb, %W, %U, %bw)
}
"#;
    let inputs = token_lists(10, |i| i % 5 + 1, |i, j| (i + j) % 6);
    let x = expected("plain_gru", load_text("plain_gru", src), &inputs, &["toks"]);
    check_all_ways(&x);
    assert_eq!(hoisted_with_split(&x, true), 1);
    assert_eq!(hoisted_with_split(&x, false), 0);
    let profile = batch_profile(&x, tumble_runtime::Options::default());
    assert!(profile.memoized + profile.job_memoized > 0, "{profile}");
}

/// An LSTM step written as one product over `concatenate((x, h))` split into four gates: the
/// product is distributed over the parts (`x · W_x + h · W_h`, the weight's column blocks as
/// slices that become derived parameters) and the token's part split off and hoisted, as with a
/// GRU written with two products. Equal to the reference every way.
#[test]
fn a_product_over_a_concatenation_hoists_its_clean_part() {
    let src = r#"
def @lstm(%toks: List[Tensor[(1), int32]], %h: Tensor[(1, 8), float32], %c: Tensor[(1, 8), float32],
          %emb: Tensor[(6, 4), float32], %W: Tensor[(32, 12), float32], %b: Tensor[(32), float32])
    -> Tensor[(1, 8), float32] {
  match (%toks) {
    Nil => %h,
    Cons(%t, %rest) => {
      let %z = split(add(nn.dense(concatenate((take(%emb, %t, axis=0), %h), axis=1), %W), %b),
                     indices_or_sections=4, axis=1);
      let %c2 = add(multiply(sigmoid(%z.1), %c), multiply(sigmoid(%z.0), tanh(%z.2)));
      @lstm(%rest, multiply(sigmoid(%z.3), tanh(%c2)), %c2, %emb, %W, %b)
    },
  }
}
def @main(%toks: List[Tensor[(1), int32]], %emb: Tensor[(6, 4), float32], %W: Tensor[(32, 12), float32],
          %b: Tensor[(32), float32]) -> Tensor[(1, 8), float32] {
  let %z = zeros(shape=[1, 8], dtype="float32");
  @lstm(%toks, %z, %z, %emb, %W, %b)
}
"#;
    let inputs = token_lists(10, |i| i % 4 + 2, |i, j| (i * 2 + j) % 6);
    let x = expected("lstm_cat", load_text("lstm_cat", src), &inputs, &["toks"]);
    check_all_ways(&x);
    let hoisted = |split: bool| {
        hoisted_products(
            &x,
            tumble_compile::StaticOptions {
                split,
                merge: false,
                ..tumble_compile::StaticOptions::all()
            },
        )
    };
    assert_eq!(hoisted(true), 1);
    assert_eq!(hoisted(false), 0);
}

/// Instances `{"toks": [[t], ..]}`: instance `i` has `len(i)` tokens, its `j`-th `tok(i, j)`.
fn token_lists(
    n: usize,
    len: impl Fn(usize) -> usize,
    tok: impl Fn(usize, usize) -> usize,
) -> String {
    (0..n)
        .map(|i| {
            let toks: Vec<String> = (0..len(i)).map(|j| format!("[{}]", tok(i, j))).collect();
            format!("{{\"toks\": [{}]}}", toks.join(", "))
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// [`hoisted_products`] with every static optimization, hoisting splits on or off.
fn hoisted_with_split(x: &common::Expected, split: bool) -> usize {
    hoisted_products(
        x,
        tumble_compile::StaticOptions {
            split,
            ..tumble_compile::StaticOptions::all()
        },
    )
}

/// Hoisted sites of `x`'s program compiled with `statics` whose block has a product.
fn hoisted_products(x: &common::Expected, statics: tumble_compile::StaticOptions) -> usize {
    let (program, _) = common::compile(x, true, statics);
    program
        .sites
        .iter()
        .filter(|s| s.hoisted)
        .filter_map(|s| program.blocks.get(s.block as usize))
        .filter(|b| b.nodes.iter().any(|n| n.op.name == "nn.dense"))
        .count()
}

/// A product over a concatenation whose weight the program chooses per instance is not
/// distributed by a hoisting split (its column blocks would be per-instance slices, neither
/// derived parameters nor grouped by weight: 20× slower, a review's find): its launches stay
/// grouped by the weight chosen. Equal to the reference every way.
#[test]
fn a_chosen_weight_over_a_concatenation_stays_grouped() {
    let src = r#"
def @rnn(%toks: List[Tensor[(1), int32]], %h: Tensor[(1, 128), float32],
         %emb: Tensor[(6, 128), float32], %Wa: Tensor[(128, 256), float32], %Wb: Tensor[(128, 256), float32])
    -> Tensor[(1, 128), float32] {
  match (%toks) {
    Cons(%t, %rest) => {
      let %W = if (less(sum(%t), 3)) { %Wa } else { %Wb };
      let %x = take(%emb, %t, axis=0);
      @rnn(%rest, tanh(nn.dense(concatenate((%x, %h), axis=1), %W)), %emb, %Wa, %Wb)
    },
    Nil => %h,
  }
}
def @main(%toks: List[Tensor[(1), int32]], %emb: Tensor[(6, 128), float32], %Wa: Tensor[(128, 256), float32],
          %Wb: Tensor[(128, 256), float32]) -> Tensor[(1, 128), float32] {
  @rnn(%toks, zeros(shape=[1, 128], dtype="float32"), %emb, %Wa, %Wb)
}
"#;
    let inputs = token_lists(12, |i| i % 4 + 3, |i, j| (i * 5 + j * 3) % 6);
    let x = expected(
        "chosen_cat",
        load_text("chosen_cat", src),
        &inputs,
        &["toks"],
    );
    check_all_ways(&x);
    let profile = batch_profile(&x, tumble_runtime::Options::default());
    let (launches, invocations) = {
        let s = profile.blocks_where(|name| name.contains("tanh"));
        (s.launches, s.invocations)
    };
    // 12 instances, 3-6 steps each: two groups per step at the most (one launch each without
    // the groups: locality chunks of one).
    assert!(
        launches <= 12 && invocations >= 30,
        "{launches} launches of {invocations}"
    );
}

/// A stacked RNN whose layers are a recursion over the layer index, each layer's weights taken
/// from stacked tensors by that index (`take(%Ws, %l)`): with weight slices the takes run once
/// per weight and layer on the host and every instance's step reads the same slice, so the
/// step's products share one weight per launch (no reuse misses, no weight copied per
/// invocation); equal to the reference every way.
#[test]
fn layer_weights_taken_by_index_are_shared_slices() {
    let src = r#"
def @rnn(%xs: List[Tensor[(1, 8), float32]], %h: Tensor[(1, 8), float32],
         %W: Tensor[(8, 8), float32], %U: Tensor[(8, 8), float32], %b: Tensor[(8), float32])
    -> List[Tensor[(1, 8), float32]] {
  match (%xs) {
    Cons(%x, %rest) => {
      let %h2 = tanh(add(add(nn.dense(%x, %W), nn.dense(%h, %U)), %b));
      Cons(%h2, @rnn(%rest, %h2, %W, %U, %b))
    },
    Nil => Nil,
  }
}
def @layers(%l: Tensor[(), int32], %xs: List[Tensor[(1, 8), float32]],
            %Ws: Tensor[(3, 8, 8), float32], %Us: Tensor[(3, 8, 8), float32], %bs: Tensor[(3, 8), float32])
    -> List[Tensor[(1, 8), float32]] {
  if (%l == 3) {
    %xs
  } else {
    let %ys = @rnn(%xs, zeros(shape=[1, 8], dtype="float32"), take(%Ws, %l, axis=0), take(%Us, %l, axis=0), take(%bs, %l, axis=0));
    @layers(%l + 1, %ys, %Ws, %Us, %bs)
  }
}
def @last(%xs: List[Tensor[(1, 8), float32]]) -> Tensor[(1, 8), float32] {
  match? (%xs) { Cons(%x, Nil) => %x, Cons(_, %r) => @last(%r), }
}
def @main(%toks: List[Tensor[(1), int32]], %emb: Tensor[(6, 8), float32],
          %Ws: Tensor[(3, 8, 8), float32], %Us: Tensor[(3, 8, 8), float32], %bs: Tensor[(3, 8), float32])
    -> Tensor[(1, 8), float32] {
  let %xs = @map(fn (%t: Tensor[(1), int32]) -> Tensor[(1, 8), float32] { take(%emb, %t, axis=0) }, %toks);
  @last(@layers(0, %xs, %Ws, %Us, %bs))
}
"#;
    let inputs = token_lists(10, |i| i % 4 + 1, |i, j| (i * 3 + j) % 6);
    let x = expected(
        "stacked_layers",
        load_text("stacked_layers", src),
        &inputs,
        &["toks"],
    );
    check_all_ways(&x);
    let profile = |weight_slices: bool| {
        batch_profile(
            &x,
            tumble_runtime::Options {
                weight_slices,
                ..tumble_runtime::Options::default()
            },
        )
    };
    let (sliced, copied) = (profile(true), profile(false));
    // Three slices per layer, each computed once on the host.
    let takes = |p: &tumble_runtime::Profile| {
        p.blocks_where(|name| name.starts_with("layers:take"))
            .invocations
    };
    assert_eq!(takes(&sliced), 0, "{sliced}");
    assert!(takes(&copied) > 0, "{copied}");
    assert_eq!(sliced.reuse_misses, 0, "{sliced}");
    // The eager scheduler takes them once too (a slice copied per invocation, packed per copy,
    // kept a mixture of depths' 1.4 GB of copies a run).
    let eager = batch_profile(
        &x,
        tumble_runtime::Options {
            scheduler: tumble_runtime::Scheduler::Eager,
            ..tumble_runtime::Options::default()
        },
    );
    assert_eq!(takes(&eager), 0, "{eager}");
}

/// A typed-edge graph network: a node sums its incoming edges' messages, each the neighbour's
/// row times the matrix its edge type picks out of a stacked weight, `take(%Ws, take(%types,
/// %k))`, inside a counted loop over the edges. The weight take is split off its block and runs
/// on the host as a weight slice (one per type for the job), so the products group their
/// invocations by type instead of launching a few at a time with a matrix copied per edge.
/// Equal to the reference every way (clipped types past either end included), and to itself
/// with the split off.
#[test]
fn weights_taken_by_a_computed_type_group_their_products() {
    let src = format!(
        "{}{}",
        common::TYPED_EDGE_ROUNDS,
        r#"def @main(%feat: Tensor[(?), int32], %nodes: List[(Tensor[(1), int32], Tensor[(?), int32], Tensor[(?), int32], Tensor[(), int32])],
          %emb: Tensor[(10, 8), float32], %Ws: Tensor[(3, 8, 8), float32], %U: Tensor[(8, 8), float32]) -> Tensor[(1, 8), float32] {
  let %S = @round(@round(take(%emb, %feat, axis=0), %nodes, %Ws, %U), %nodes, %Ws, %U);
  mean(%S, axis=[0], keepdims=True)
}
"#
    );
    let inputs = common::typed_edge_graphs();
    let x = expected(
        "typed_edges",
        load_text("typed_edges", &src),
        &inputs.join("\n"),
        &["feat", "nodes"],
    );
    check_all_ways(&x);
    let run = |weight_takes: bool| {
        run_compiled_with(
            &x,
            tumble_compile::StaticOptions {
                weight_takes,
                ..tumble_compile::StaticOptions::all()
            },
        )
    };
    let ((split, with), (whole, without)) = (run(true), run(false));
    assert_same_results(&split, &whole, 1e-5, "weight-take splits on vs off");
    let launched = |p: &tumble_runtime::Profile, part: &str| -> u64 {
        p.blocks_where(|name| name.contains(part)).invocations
    };
    // Every edge's slice is taken on the host (from the job's three), never launched, and every
    // launch of the products passes its weight once (shared) instead of a matrix per edge.
    let edges = launched(&with, "edges:add");
    let product_launches: u64 = with
        .blocks_where(|name| name.starts_with("edges:add"))
        .launches;
    assert_eq!(launched(&with, "/slice"), 0, "{with}");
    assert!(
        with.host_invocations >= without.host_invocations + edges,
        "{with}\n{without}"
    );
    assert!(
        with.shared_inputs >= without.shared_inputs + product_launches,
        "{with}\n{without}"
    );
}

/// An RNN written as a counted loop over an instance's token vector, `take(%toks, %k)` then the
/// embedding lookup: the index split computes each token on the host when the step is invoked,
/// so the lookup reads no ragged vector and is hoisted over every token of the mini-batch (as
/// the list-written RNN's is), where inside the block the token's `take` ran once per group of
/// equal lengths. Tokens past the table and empty sentences included; equal to the reference
/// every way, and to itself with the split off.
#[test]
fn a_counted_loop_s_tokens_are_computed_on_the_host() {
    let src = r#"
def @rnn(%toks: Tensor[(?), int32], %n: Tensor[(), int32], %k: Tensor[(), int32], %h: Tensor[(1, 8), float32],
         %emb: Tensor[(6, 8), float32], %W: Tensor[(8, 8), float32], %U: Tensor[(8, 8), float32]) -> Tensor[(1, 8), float32] {
  if (less(%k, %n)) {
    let %x = take(%emb, expand_dims(take(%toks, %k), axis=0), axis=0);
    @rnn(%toks, %n, add(%k, 1), tanh(add(nn.dense(%x, %W), nn.dense(%h, %U))), %emb, %W, %U)
  } else {
    %h
  }
}
def @main(%toks: Tensor[(?), int32], %n: Tensor[(), int32], %emb: Tensor[(6, 8), float32],
          %W: Tensor[(8, 8), float32], %U: Tensor[(8, 8), float32]) -> Tensor[(1, 8), float32] {
  @rnn(%toks, %n, 0, zeros(shape=[1, 8], dtype="float32"), %emb, %W, %U)
}
"#;
    // Sentence i has i % 7 tokens (none for i % 7 = 0); a token of 9 or -2 now and then.
    let inputs: Vec<String> = (0..30)
        .map(|i| {
            let toks: Vec<String> = (0..i % 7)
                .map(|j| match (i + j) % 13 {
                    0 => "9".to_string(),
                    1 => "-2".to_string(),
                    _ => ((i * 3 + j) % 6).to_string(),
                })
                .collect();
            format!("{{\"toks\": [{}], \"n\": {}}}", toks.join(", "), i % 7)
        })
        .collect();
    let x = expected(
        "counted_rnn",
        load_text("counted_rnn", src),
        &inputs.join("\n"),
        &["toks", "n"],
    );
    check_all_ways(&x);
    let run = |index_split: bool| {
        run_compiled_with(
            &x,
            tumble_compile::StaticOptions {
                index_split,
                ..tumble_compile::StaticOptions::all()
            },
        )
    };
    let ((split, with), (whole, without)) = (run(true), run(false));
    assert_same_results(&split, &whole, 0.0, "index splits on vs off");
    // Every token's lookup in one launch (each distinct token once), none of it ragged.
    let launches: u64 = with.blocks_where(|name| name.starts_with("rnn:x")).launches;
    assert_eq!(launches, 1, "{with}");
    assert_eq!(with.ragged_groups, 0, "{with}");
    assert!(without.ragged_groups > 0, "{without}");
}

/// Counted loops bounded by their data's own sizes, `take(shape_of(%xs), 0)` over an instance's
/// float rows and `ndarray_size(%toks)` over its tokens: the bound is computed on the host when
/// the condition is invoked (only the inputs' shapes are read), so a step waits for no launch.
/// Equal to the reference every way (empty instances included); `shape_of`'s dtype attribute and
/// `ndarray_size` of a matrix checked by value.
#[test]
fn loops_bounded_by_shape_of_their_rows() {
    let src = r#"
def @rows(%xs: Tensor[(?, 4), float32], %k: Tensor[(), int64], %h: Tensor[(1, 4), float32],
          %W: Tensor[(4, 4), float32]) -> Tensor[(1, 4), float32] {
  if (less(%k, take(shape_of(%xs, dtype="int64"), 0))) {
    let %x = take(%xs, expand_dims(%k, axis=0), axis=0);
    @rows(%xs, add(%k, 1i64), tanh(add(nn.dense(%h, %W), %x)), %W)
  } else {
    %h
  }
}
def @toks(%t: Tensor[(?), int32], %k: Tensor[(), int32], %acc: Tensor[(1, 4), float32],
          %emb: Tensor[(5, 4), float32]) -> Tensor[(1, 4), float32] {
  if (less(%k, ndarray_size(%t))) {
    @toks(%t, add(%k, 1), add(%acc, take(%emb, expand_dims(take(%t, %k), axis=0), axis=0)), %emb)
  } else {
    %acc
  }
}
def @main(%xs: Tensor[(?, 4), float32], %t: Tensor[(?), int32], %W: Tensor[(4, 4), float32],
          %emb: Tensor[(5, 4), float32]) -> (Tensor[(1, 4), float32], Tensor[(1, 4), float32], Tensor[(2), int32], Tensor[(), int32]) {
  let %z = zeros(shape=[1, 4], dtype="float32");
  (@rows(%xs, 0i64, %z, %W), @toks(%t, 0, %z, %emb), shape_of(%xs), ndarray_size(%xs))
}
"#;
    let inputs: Vec<String> = (0..16)
        .map(|i| {
            let toks: Vec<String> = (0..(i + 2) % 4)
                .map(|j| ((i + j) % 5).to_string())
                .collect();
            format!(
                "{{\"xs\": {}, \"t\": [{}]}}",
                common::matrix(i, i % 5, 4),
                toks.join(", ")
            )
        })
        .collect();
    let x = expected(
        "shape_bounds",
        load_text("shape_bounds", src),
        &inputs.join("\n"),
        &["xs", "t"],
    );
    check_all_ways(&x);
    // Instance 3 has 3 rows of 4: its shape and size by value.
    let (values, profile) = run_compiled_with(&x, tumble_compile::StaticOptions::all());
    let Some(tumble_interp::Value::Tuple(fields)) = values.get(3) else {
        panic!("instance 3: {:?}", values.get(3));
    };
    let ints = |k: usize| match fields.0.get(k) {
        Some(tumble_interp::Value::Tensor(t)) => t.to_i64_vec(),
        other => panic!("field {k}: {other:?}"),
    };
    assert_eq!((ints(2), ints(3)), (vec![3, 4], vec![12]));
    // Every loop condition ran on the host: no launch of a block of `less`.
    let conditions: u64 = profile.blocks_where(|name| name.contains("less")).launches;
    assert_eq!(conditions, 0, "{profile}");
}

/// A per-token transform written inside the recursion that concatenates its rows —
/// `concatenate((tanh(W·x), @enc(%rest)))`, one automatic block with the recursive call as an
/// operand — is split: the product, which reads only the token, runs hoisted over every token
/// at once, the recursive call evaluated once by the rest of the block; and the two are not
/// merged again (the rest has no product to join). Equal to the reference every way.
#[test]
fn a_transform_beside_a_recursive_call_is_hoisted() {
    let src = r#"
def @enc(%toks: List[Tensor[(1), int32]], %emb: Tensor[(6, 8), float32], %W: Tensor[(8, 8), float32])
    -> Tensor[(?, 8), float32] {
  match? (%toks) {
    Cons(%t, Nil) => tanh(nn.dense(take(%emb, %t, axis=0), %W)),
    Cons(%t, %rest) => concatenate((tanh(nn.dense(take(%emb, %t, axis=0), %W)), @enc(%rest, %emb, %W)), axis=0),
  }
}
def @main(%toks: List[Tensor[(1), int32]], %emb: Tensor[(6, 8), float32], %W: Tensor[(8, 8), float32])
    -> Tensor[(1, 8), float32] {
  sum(@enc(%toks, %emb, %W), axis=[0], keepdims=True)
}
"#;
    let inputs = token_lists(10, |i| i % 4 + 1, |i, j| (i * 5 + j) % 6);
    let x = expected(
        "concat_rows",
        load_text("concat_rows", src),
        &inputs,
        &["toks"],
    );
    check_all_ways(&x);
    // The one-token arm's block is hoisted either way; the split adds the other arm's product.
    assert_eq!(hoisted_with_split(&x, true), 2);
    assert_eq!(hoisted_with_split(&x, false), 1);
}

/// A scalar per instance (a length, a temperature) in a row program's elementwise work is each
/// row's own splat: no stage falls back to the batching rules (one did, at every launch), and
/// the results equal the reference every way.
#[test]
fn a_scalar_per_instance_joins_row_programs() {
    let src = r#"
def @main(%x: Tensor[(1, 6), float32], %n: float32, %w: Tensor[(6, 6), float32]) -> Tensor[(1, 6), float32] {
  let %h = nn.dense(%x, %w);
  maximum(tanh(%h), divide(%h, %n))
}
"#;
    let inputs: Vec<String> = (0..11)
        .map(|i| {
            let row: Vec<String> = (0..6)
                .map(|j| format!("{:.3}", ((i * 5 + j * 3) % 13) as f64 / 4.0 - 1.5))
                .collect();
            format!("{{\"x\": [[{}]], \"n\": {}.5}}", row.join(", "), 1 + i % 4)
        })
        .collect();
    let x = expected(
        "scalar_rows",
        load_text("scalar_rows", src),
        &inputs.join("\n"),
        &["x", "n"],
    );
    check_all_ways(&x);
    let p = batch_profile(&x, tumble_runtime::Options::default());
    assert_eq!(p.fused.fallbacks, 0, "{p}");
    assert!(p.fused.row_programs > 0, "{p}");
}

/// One function called with two weights (a siamese pair's shared encoder and a third one of its
/// own), compiled without code duplication: each launch groups its invocations by the weight
/// they pass (a few model weights), instead of stacking a weight per invocation (with `--no-dup`,
/// static and dynamic duplication off, a GRU pair model stacked 33 GiB of weight rows); the
/// outputs equal the duplicated program's and the reference's.
#[test]
fn weights_per_call_site_without_duplication_run_as_weight_groups() {
    let src = r#"
def @enc(%xs: List[Tensor[(1, 4), float32]], %h: Tensor[(1, 4), float32], %w: Tensor[(4, 4), float32]) -> Tensor[(1, 4), float32] {
  match (%xs) {
    Nil => %h,
    Cons(%x, %rest) => @enc(%rest, tanh(add(nn.dense(%h, %w), %x)), %w),
  }
}
def @main(%a: List[Tensor[(1, 4), float32]], %b: List[Tensor[(1, 4), float32]], %w: Tensor[(4, 4), float32], %u: Tensor[(4, 4), float32]) -> Tensor[(1, 4), float32] {
  let %z = zeros(shape=[1, 4], dtype="float32");
  add(multiply(@enc(%a, %z, %w), @enc(%b, %z, %w)), @enc(%b, %z, %u))
}
"#;
    let list = |i: usize, n: usize| common::row_list(i, n, 4);
    let inputs: Vec<String> = (0..20)
        .map(|i| {
            format!(
                "{{\"a\": {}, \"b\": {}}}",
                list(i, 1 + i % 4),
                list(i + 7, 1 + i % 3)
            )
        })
        .collect();
    let x = expected(
        "no_dup",
        load_text("no_dup", src),
        &inputs.join("\n"),
        &["a", "b"],
    );
    check_all_ways(&x);
    let off = tumble_compile::StaticOptions {
        dup: false,
        ..tumble_compile::StaticOptions::all()
    };
    let (program, reuse) = common::compile(&x, true, off);
    let no_dup = tumble_runtime::Options {
        dup: false,
        ..Default::default()
    };
    let (vals, p) = common::run_once(&x, &program, &reuse, no_dup);
    assert_eq!(p.gathered_inputs + p.fused.row_lists_stacked, 0, "{p}");
    let (on, reuse_on) = common::compile(&x, true, tumble_compile::StaticOptions::all());
    let (want, _) = common::run_once(&x, &on, &reuse_on, Default::default());
    for (i, (a, b)) in vals.iter().zip(&want).enumerate() {
        common::same_within(a, b, &format!("instance {i}"), 0.0)
            .unwrap_or_else(|e| panic!("without duplication: {e}"));
    }
}

/// The scans and layout operators added for ported programs run once for the whole launch
/// (`reverse`, `repeat`, `tile`, `cumsum` and `cumprod` along an axis or over every element,
/// `gather` of each instance's own indices):
/// batched every way, equal to the reference, no operator left per invocation.
#[test]
fn ported_layout_operators_are_batched() {
    let src = r#"
def @main(%x: Tensor[(2, 3), float32], %i: Tensor[(2, 2), int32]) -> (Tensor[(2, 3), float32], Tensor[(2, 6), float32], Tensor[(4, 3), float32],
    Tensor[(2, 3), float32], Tensor[(6), float32], Tensor[(2, 3), float32], Tensor[(2, 2), float32]) {
  let %t = tanh(%x);
  (reverse(%t, axis=1), repeat(%t, repeats=2, axis=-1), tile(%t, reps=[2, 1]),
   cumsum(%t, axis=0), cumsum(%t), cumprod(%t, axis=1, exclusive=True), gather(%t, %i, axis=1))
}
"#;
    let inputs: Vec<String> = (0..9)
        .map(|i| {
            format!(
                "{{\"x\": {}, \"i\": [[{}, 0], [2, {}]]}}",
                common::matrix(i, 2, 3),
                i % 3,
                (i + 1) % 3
            )
        })
        .collect();
    batches_without_loops("ported_layout", src, &inputs, &["x", "i"]);
}

/// An embedding written as a one-hot row times a weight (`F.one_hot` then a linear layer) is
/// the weight's column: it runs as a lookup, and an index outside `[0, depth)` — one_hot's row
/// of zeros — still gives zeros, at every position of a sentence and as a scalar index.
#[test]
fn one_hot_products_are_lookups() {
    let src = r#"
def @main(%toks: Tensor[(?), int32], %t: Tensor[(), int64], %W: Tensor[(6, 10), float32], %U: Tensor[(6, 6), float32])
    -> (Tensor[(?, 6), float32], Tensor[(6), float32]) {
  let %e = nn.dense(one_hot(%toks, 1f, 0f, depth=10, axis=-1, dtype="float32"), %W);
  let %s = nn.dense(one_hot(%t, 1f, 0f, depth=10), %W);
  (tanh(nn.dense(%e, %U)), %s)
}
"#;
    let inputs: Vec<String> = [
        ("[0, 3, 9, -1, 10, 7]", 2),
        ("[5]", -3),
        ("[]", 10),
        ("[12, 1, 1, 4]", 9),
        ("[-7, 8]", 0),
    ]
    .iter()
    .map(|(toks, t)| format!("{{\"toks\": {toks}, \"t\": {t}}}"))
    .collect();
    let x = expected(
        "one_hot_lookup",
        load_text("one_hot_lookup", src),
        &inputs.join("\n"),
        &["toks", "t"],
    );
    check_all_ways(&x);
    let (program, _) = common::compile(&x, true, tumble_compile::StaticOptions::all());
    let one_hots = program
        .blocks
        .iter()
        .flat_map(|b| &b.nodes)
        .filter(|n| n.op.name == "one_hot")
        .count();
    assert_eq!(one_hots, 0, "{program}");
}

/// Experts' weights chosen per token by a computed index (`take(%W1s, argmax(gate))`, a switch
/// mixture of experts): each invocation's weight is a view of the stack's slice, read where it
/// lies (it was stacked — every invocation's matrix copied — only to find it was not shared).
#[test]
fn experts_chosen_by_a_computed_index() {
    let src = r#"
def @main(%xs: List[Tensor[(1, 4), float32]], %Wg: Tensor[(3, 4), float32], %W1s: Tensor[(3, 6, 4), float32],
          %W2s: Tensor[(3, 4, 6), float32]) -> List[Tensor[(1, 4), float32]] {
  @map(fn (%x: Tensor[(1, 4), float32]) -> Tensor[(1, 4), float32] {
    let %g = nn.softmax(nn.dense(%x, %Wg), axis=1);
    let %e = squeeze(argmax(%g, axis=[1]));
    let %y = nn.dense(nn.relu(nn.dense(%x, take(%W1s, %e, axis=0))), take(%W2s, %e, axis=0));
    add(%x, multiply(%y, take(%g, %e, axis=1)))
  }, %xs)
}
"#;
    let inputs: Vec<String> = [5usize, 1, 0, 9, 3, 12, 2]
        .iter()
        .enumerate()
        .map(|(i, &n)| format!("{{\"xs\": {}}}", common::row_list(i, n, 4)))
        .collect();
    agrees("experts_by_index", src, &inputs.join("\n"), &["xs"]);
}

/// The operators added for TVM's graphs with batching rules (`nn.dropout`'s tuple and its
/// projections, `nn.matmul` of a shared matrix, `full_like`, `nn.prelu`, `nn.l2_normalize`,
/// `nn.pad` in TVM's operand form, `nn.batch_norm`'s 3-tuple): equal to the reference every way,
/// nothing loops.
#[test]
fn tvm_graph_operators_are_batched() {
    let src = r#"
def @main(%x: Tensor[(2, 3), float32], %w: Tensor[(3, 4), float32], %g: Tensor[(3), float32],
          %b: Tensor[(3), float32], %m: Tensor[(3), float32], %v: Tensor[(3), float32]) {
  %0 = nn.dropout(%x, rate=0.5f);
  %1 = tanh(%0.0);
  %2 = nn.matmul(%1, %w);
  %3 = nn.matmul(%1, %w, transpose_a=False, transpose_b=False, units=4, out_dtype="");
  %4 = full_like(%x, 2f);
  %5 = nn.prelu(%1, %g, axis=1);
  %6 = nn.l2_normalize(%1, eps=1e-12f, axis=[1]);
  %7 = nn.l2_normalize(%1, eps=1e-12f);
  %8 = nn.pad(%1, 0.5f, pad_width=[[0, 0], [1, 2]]);
  %9 = nn.pad(%1, 0f, pad_width=[[1, 0], [1, 1]], pad_mode="reflect");
  %10 = add(multiply(%v, %v), 0.5f);
  %11 = nn.batch_norm(%1, %g, %b, %m, %10, axis=1, epsilon=1e-05f);
  (add(%2, %3), %4, %5, %6, %7, %8, %9, %11.0, %11.1, %0.1)
}
"#;
    let inputs: Vec<String> = (0..9)
        .map(|i| format!("{{\"x\": {}}}", common::matrix(i, 2, 3)))
        .collect();
    batches_without_loops("tvm_graph_ops", src, &inputs, &["x"]);
    // nn.matmul is lowered to nn.dense (its rhs transposed by a node of its own, a derived
    // parameter here): the GEMM stages' product.
    let x = expected(
        "tvm_graph_ops",
        load_text("tvm_graph_ops", src),
        &inputs.join("\n"),
        &["x"],
    );
    let (program, _) = common::compile(&x, true, tumble_compile::StaticOptions::all());
    let count = |name: &str| -> usize {
        program
            .blocks
            .iter()
            .map(|b| b.nodes.iter().filter(|n| n.op.name == name).count())
            .sum()
    };
    assert_eq!(count("nn.matmul"), 0);
    assert_eq!(count("nn.dense"), 2);
}

/// The added operators without a batching rule (`sequence_mask` by each instance's lengths,
/// `reshape_like`, `broadcast_to_like`, `collapse_sum_like`) run per invocation and agree with
/// the reference every way.
#[test]
fn tvm_graph_operators_per_invocation() {
    let src = r#"
def @main(%x: Tensor[(2, 3), float32], %len: Tensor[(2), int32], %b: Tensor[(3), float32]) {
  %0 = sequence_mask(%x, %len, mask_value=-1f, axis=1);
  %1 = sequence_mask(transpose(%x), %len);
  %2 = reshape_like(%x, transpose(%x));
  %3 = broadcast_to_like(%b, %x);
  %4 = collapse_sum_like(multiply(%x, %3), %b);
  (%0, %1, %2, %4)
}
"#;
    let inputs: Vec<String> = (0..9)
        .map(|i| {
            format!(
                "{{\"x\": {}, \"len\": [{}, {}]}}",
                common::matrix(i, 2, 3),
                i % 4,
                (i * 2) % 3
            )
        })
        .collect();
    agrees("tvm_graph_fallback", src, &inputs.join("\n"), &["x", "len"]);
}
