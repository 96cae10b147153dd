//! Programs written plainly — no `Primitive=1`, tuples and projections where the math has them —
//! run batched and agree with the reference. Each test is a bug found once, kept small.

mod common;

use common::{check_all_ways, expected, load_text};

fn agrees(name: &str, src: &str, inputs: &str, instance_args: &[&str]) {
    let l = load_text(name, src);
    check_all_ways(&expected(name, l, inputs, instance_args));
}

/// Instances `{"x": [[...]]}` of `n` float rows of width `w`, all different.
fn rows(count: usize, w: usize) -> String {
    (0..count)
        .map(|i| {
            let row: Vec<String> = (0..w)
                .map(|j| format!("{:.3}", ((i * 7 + j * 3) % 11) as f64 / 5.0 - 1.0))
                .collect();
            format!("{{\"x\": [[{}]]}}", row.join(", "))
        })
        .collect::<Vec<_>>()
        .join("\n")
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

/// A child-sum TreeLSTM as its equations read (child sums as `@foldl(add, zeros, @map(..))`, the
/// gates as one dense and a split, no `Primitive=1`) runs batched, equal to the reference.
#[test]
fn plain_child_sum_treelstm() {
    check_all_ways(&treelstm(true));
}

/// Launches of one mini-batch of the examples under the default options.
fn launches(x: &common::Expected) -> (u64, Vec<tumble_interp::Value>) {
    let (program, reuse) = common::compile(x, true, tumble_compile::StaticOptions::all());
    let rngs = (0..x.args.len()).map(common::rng).collect();
    let (vals, profile) = tumble_runtime::run_batch(
        &program,
        &reuse,
        "main",
        x.args.clone(),
        rngs,
        tumble_runtime::Options::default(),
    )
    .unwrap_or_else(|e| panic!("{}", e.error.message));
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
