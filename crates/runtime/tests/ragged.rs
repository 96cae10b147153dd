//! Ragged batching: instances whose inputs have different leading `?` lengths launch together
//! and agree with the reference, under every scheduler, at batch sizes 1, 7 and 64, with lengths
//! 1 and 0 among them.

mod common;

use common::{
    batch_profile, check_all_ways, check_batched, expected, load_text, var_rows, Expected,
};

/// `count` instances of token ids `t: (len_i)` below `vocab`, and positions `p: 0..len_i`.
fn var_tokens(count: usize, vocab: usize, lens: &[usize]) -> String {
    (0..count)
        .map(|i| {
            let n = lens[i % lens.len()];
            let t: Vec<String> = (0..n)
                .map(|r| ((i * 3 + r * 7) % vocab).to_string())
                .collect();
            let p: Vec<String> = (0..n).map(|r| r.to_string()).collect();
            format!(
                "{{\"t\": [{}], \"p\": [{}], \"threshold\": {:.2}}}",
                t.join(", "),
                p.join(", "),
                0.5 + (i % 5) as f64 * 0.1
            )
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// The lengths the tests draw from: 1 and 0 included, most different from each other.
const LENS: &[usize] = &[3, 1, 9, 5, 0, 2, 7, 4, 11, 6, 8, 1, 13];

/// The issue's program: dense and tanh per row, then softmax over the rows and their sum; also
/// the rows themselves, so row-wise results leave the launch too.
const PER_ROW_THEN_OVER_ROWS: &str = r#"
def @main(%x: Tensor[(?, 4), float32], %w: Tensor[(8, 4), float32], %b: Tensor[(8), float32])
    -> (Tensor[(8), float32], Tensor[(?, 8), float32]) {
  let %h = tanh(nn.bias_add(nn.dense(%x, %w), %b));
  let %p = nn.softmax(%h, axis=0);
  (sum(multiply(%p, %h), axis=[0]), %h)
}
"#;

#[test]
fn rows_then_a_reduction_over_them() {
    let src = PER_ROW_THEN_OVER_ROWS;
    let l = load_text("ragged_rows", src);
    check_all_ways(&expected("ragged_rows", l, &var_rows(70, 4, LENS), &["x"]));
}

/// A transformer encoder layer over variable-length token sequences with an early exit between
/// layers (Berxit's shape, small): embedding lookups per token, attention mixing each sentence's
/// rows, per-row projections, layer norms and a GELU, a loop over layers that stops per instance.
const TINY_ENCODER: &str = r#"
def @layer(%x: Tensor[(?, 8), float32], %wq: Tensor[(8, 8), float32],
           %wk: Tensor[(8, 8), float32], %wv: Tensor[(8, 8), float32],
           %wo: Tensor[(8, 8), float32], %w1: Tensor[(16, 8), float32],
           %w2: Tensor[(8, 16), float32], %g: Tensor[(8), float32], %bias: Tensor[(8), float32])
    -> Tensor[(?, 8), float32] {
  let %q = transpose(reshape(nn.dense(%x, %wq), newshape=[-1, 2, 4]), axes=[1, 0, 2]);
  let %k = transpose(reshape(nn.dense(%x, %wk), newshape=[-1, 2, 4]), axes=[1, 0, 2]);
  let %v = transpose(reshape(nn.dense(%x, %wv), newshape=[-1, 2, 4]), axes=[1, 0, 2]);
  let %p = nn.softmax(multiply(nn.batch_matmul(%q, %k), 0.5f), axis=-1);
  let %c = nn.batch_matmul(%p, %v, transpose_b=False);
  let %m = reshape(transpose(%c, axes=[1, 0, 2]), newshape=[-1, 8]);
  let %a = nn.layer_norm(add(nn.dense(%m, %wo), %x), %g, %bias);
  let %u = nn.dense(%a, %w1);
  let %gelu = multiply(multiply(%u, 0.5f), add(tanh(multiply(%u, 0.79788456f)), 1f));
  nn.layer_norm(add(nn.dense(%gelu, %w2), %a), %g, %bias)
}

def @exit(%x: Tensor[(?, 8), float32], %we: Tensor[(2, 8), float32]) -> Tensor[(1, 2), float32] {
  nn.softmax(nn.dense(strided_slice(%x, begin=[0, 0], end=[1, 8], strides=[1, 1]), %we))
}

def @encode(%x: Tensor[(?, 8), float32], %n: Tensor[(), int32], %threshold: Tensor[(), float32],
            %wq: Tensor[(8, 8), float32], %wk: Tensor[(8, 8), float32],
            %wv: Tensor[(8, 8), float32], %wo: Tensor[(8, 8), float32],
            %w1: Tensor[(16, 8), float32], %w2: Tensor[(8, 16), float32],
            %g: Tensor[(8), float32], %bias: Tensor[(8), float32], %we: Tensor[(2, 8), float32])
    -> (Tensor[(1, 2), float32], Tensor[(), int32]) {
  let %y = @layer(%x, %wq, %wk, %wv, %wo, %w1, %w2, %g, %bias);
  let %probs = @exit(%y, %we);
  if (logical_or(greater_equal(%n, 4), greater(max(%probs), %threshold))) {
    (%probs, %n)
  } else {
    @encode(%y, add(%n, 1), %threshold, %wq, %wk, %wv, %wo, %w1, %w2, %g, %bias, %we)
  }
}

def @main(%t: Tensor[(?), int32], %p: Tensor[(?), int32], %threshold: Tensor[(), float32],
          %emb: Tensor[(10, 8), float32], %pos: Tensor[(16, 8), float32],
          %wq: Tensor[(8, 8), float32], %wk: Tensor[(8, 8), float32],
          %wv: Tensor[(8, 8), float32], %wo: Tensor[(8, 8), float32],
          %w1: Tensor[(16, 8), float32], %w2: Tensor[(8, 16), float32],
          %g: Tensor[(8), float32], %bias: Tensor[(8), float32], %we: Tensor[(2, 8), float32])
    -> (Tensor[(1, 2), float32], Tensor[(), int32]) {
  let %x = add(take(%emb, %t, axis=0), take(%pos, %p, axis=0));
  @encode(%x, 1, %threshold, %wq, %wk, %wv, %wo, %w1, %w2, %g, %bias, %we)
}
"#;

#[test]
fn an_encoder_with_early_exit_over_sentences_of_different_lengths() {
    // No length 0 here: the exit reads row 0.
    let lens: Vec<usize> = LENS.iter().copied().filter(|&n| n > 0).collect();
    let l = load_text("ragged_encoder", TINY_ENCODER);
    check_all_ways(&expected(
        "ragged_encoder",
        l,
        &var_tokens(70, 10, &lens),
        &["t", "p", "threshold"],
    ));
}

/// `x`'s batched profile with the ragged executor's mixing kernels on or off.
fn mixing_profile(x: &Expected, mixing_kernels: bool) -> tumble_runtime::Profile {
    batch_profile(
        x,
        tumble_runtime::Options {
            mixing_kernels,
            ..Default::default()
        },
    )
}

/// The batched run's profile with ragged batching, and without.
fn with_and_without_ragged(x: &Expected) -> (tumble_runtime::Profile, tumble_runtime::Profile) {
    let off = tumble_runtime::Options {
        ragged: false,
        ..Default::default()
    };
    (
        batch_profile(x, tumble_runtime::Options::default()),
        batch_profile(x, off),
    )
}

#[test]
fn sentences_of_different_lengths_share_launches() {
    let l = load_text("ragged_count", PER_ROW_THEN_OVER_ROWS);
    let lens: Vec<usize> = (1..=64).collect();
    let x = expected("ragged_count", l, &var_rows(64, 4, &lens), &["x"]);
    let (on, off) = with_and_without_ragged(&x);
    // 64 lengths: one launch with ragged batching, one per length without.
    assert_eq!(on.launches, 1, "{on}");
    assert_eq!(on.ragged_rows, (1..=64).sum::<u64>());
    assert_eq!(off.launches, 64, "{off}");
    assert_eq!(off.ragged_launches, 0);
}

#[test]
fn the_padding_baseline_computes_padded_rows_and_the_same_results() {
    let l = load_text("ragged_padding", PER_ROW_THEN_OVER_ROWS);
    // One launch of lengths 1..=9 twice: padded to 9 rows each.
    let lens: Vec<usize> = (1..=9).collect();
    let x = expected("ragged_padding", l, &var_rows(18, 4, &lens), &["x"]);
    let padded = tumble_runtime::Options {
        ragged_padding: true,
        ..Default::default()
    };
    let on = batch_profile(&x, padded);
    let real: u64 = 2 * (1..=9).sum::<u64>();
    assert_eq!(on.launches, 1, "{on}");
    assert_eq!(on.ragged_rows, real);
    assert_eq!(on.ragged_padding_rows, 18 * 9 - real, "{on}");
    assert_eq!(batch_profile(&x, Default::default()).ragged_padding_rows, 0);
    let (program, reuse) = common::compile(&x, true, tumble_compile::StaticOptions::all());
    check_batched(&x, &program, &reuse, 18, padded, "padded");
}

#[test]
fn the_encoder_batches_across_lengths() {
    let lens: Vec<usize> = (1..=16).collect();
    let l = load_text("ragged_encoder_count", TINY_ENCODER);
    let x = expected(
        "ragged_encoder_count",
        l,
        &var_tokens(64, 10, &lens),
        &["t", "p", "threshold"],
    );
    let (on, off) = with_and_without_ragged(&x);
    assert!(on.ragged_launches > 0, "{on}");
    // Four layers and their exit tests: a handful of launches. (The per-instance layer counter,
    // computed on the host, once entered the code-duplication key and launched every instance's
    // exit test alone: 159 launches.)
    assert!(on.launches <= 16, "{on}");
    assert!(
        on.launches * 4 < off.launches,
        "ragged {} launches vs {} without",
        on.launches,
        off.launches
    );
}

/// The mixing segments with a form that needs no grouping by length — the encoder's attention
/// (one kernel over every sentence's rows) and its exit's first-token slice (ranges of rows
/// where they lie) — replace the groups of equal length, and agree with them and with the
/// reference (which `check_all_ways` checks with them on and, at batch 7, off).
#[test]
fn attention_and_row_slices_run_over_every_length_at_once() {
    let lens: Vec<usize> = LENS.iter().copied().filter(|&n| n > 0).collect();
    let l = load_text("ragged_mixing", TINY_ENCODER);
    let x = expected(
        "ragged_mixing",
        l,
        &var_tokens(70, 10, &lens),
        &["t", "p", "threshold"],
    );
    let on = batch_profile(&x, tumble_runtime::Options::default());
    let off = batch_profile(
        &x,
        tumble_runtime::Options {
            mixing_kernels: false,
            ..Default::default()
        },
    );
    assert!(on.ragged_attention > 0 && on.ragged_row_slices > 0, "{on}");
    assert_eq!(
        (off.ragged_attention, off.ragged_row_slices),
        (0, 0),
        "{off}"
    );
    // Every layer's attention and every exit's slice was a group per length without them.
    assert!(
        off.ragged_groups >= on.ragged_groups + 2 * on.ragged_attention,
        "{on}\n{off}"
    );
    assert_eq!(on.launches, off.launches);
}

/// Message passing over each graph's own node states: a node sums the rows of its neighbours
/// (`sum(take(%S, %nb, axis=0), axis=[0])`) and takes its own (`take(%S, %i, axis=0)`), `%S`
/// the graph's `(?, 8)` states and `%nb` the node's neighbour list, of another length. The
/// takes are a gather read where each graph's states lie, so the node invocations of graphs and
/// neighbour lists of every length launch together (without the mixing kernels, one launch per
/// pair of lengths, each stacking its graphs' states). Zero-neighbour nodes, clipped indices
/// and one-node graphs included; equal to the reference every way.
#[test]
fn neighbours_gathered_from_each_graph_s_own_states() {
    let src = r#"
def @node(%S: Tensor[(?, 8), float32], %i: Tensor[(1), int32], %nb: Tensor[(?), int32],
          %W: Tensor[(8, 8), float32], %U: Tensor[(8, 8), float32]) -> Tensor[(1, 8), float32] {
  let %m = sum(take(%S, %nb, axis=0), axis=[0], keepdims=True);
  tanh(add(nn.dense(take(%S, %i, axis=0), %W), nn.dense(%m, %U)))
}
def @round(%S: Tensor[(?, 8), float32], %nodes: List[(Tensor[(1), int32], Tensor[(?), int32])],
           %W: Tensor[(8, 8), float32], %U: Tensor[(8, 8), float32]) -> Tensor[(?, 8), float32] {
  match? (%nodes) {
    Cons(%nd, Nil) => @node(%S, %nd.0, %nd.1, %W, %U),
    Cons(%nd, %rest) => concatenate((@node(%S, %nd.0, %nd.1, %W, %U), @round(%S, %rest, %W, %U)), axis=0),
  }
}
def @main(%feat: Tensor[(?), int32], %nodes: List[(Tensor[(1), int32], Tensor[(?), int32])],
          %emb: Tensor[(10, 8), float32], %W: Tensor[(8, 8), float32], %U: Tensor[(8, 8), float32])
    -> Tensor[(1, 8), float32] {
  let %S = @round(@round(take(%emb, %feat, axis=0), %nodes, %W, %U), %nodes, %W, %U);
  mean(%S, axis=[0], keepdims=True)
}
"#;
    // Graph g has 1 + g % 6 nodes; node v's neighbours: (v + 1 + j * 2) % n for j below v % 4
    // (none for v = 0), one of them past the end at times (clipped, as the reference does).
    let inputs: Vec<String> = (0..40)
        .map(|g| {
            let n = 1 + g % 6;
            let feat: Vec<String> = (0..n).map(|v| ((g + v * 3) % 10).to_string()).collect();
            let nodes: Vec<String> = (0..n)
                .map(|v| {
                    let nb: Vec<String> = (0..v % 4)
                        .map(|j| match (g + j) % 9 {
                            0 => (n + 2).to_string(),
                            _ => ((v + 1 + j * 2) % n).to_string(),
                        })
                        .collect();
                    format!("[[{v}], [{}]]", nb.join(", "))
                })
                .collect();
            format!(
                "{{\"feat\": [{}], \"nodes\": [{}]}}",
                feat.join(", "),
                nodes.join(", ")
            )
        })
        .collect();
    let x = expected(
        "ragged_gather",
        load_text("ragged_gather", src),
        &inputs.join("\n"),
        &["feat", "nodes"],
    );
    check_all_ways(&x);
    let launches = |mixing_kernels: bool| {
        let p = mixing_profile(&x, mixing_kernels);
        let node_launches: u64 = p.blocks_where(|name| name.contains("node")).launches;
        (p.ragged_gathers, node_launches)
    };
    let (gathers, with) = launches(true);
    let (none, without) = launches(false);
    assert!(gathers > 0 && none == 0);
    assert!(
        with < without,
        "{with} launches of the node block, {without} without"
    );
}

/// A set model's reductions over every row of an instance (mean pooling, a running sum, and the
/// maximum and minimum a fixed-point loop's convergence test compares, NaN and signed zeros
/// among them) beside row-wise work: read where each instance's rows lie, as the gather kernel
/// reads a neighbour list — not once per group of equal lengths — with the reference's bits.
#[test]
fn reductions_over_every_row_of_an_instance_read_its_rows_where_they_lie() {
    let src = r#"
def @main(%x: Tensor[(?, 4), float32], %W: Tensor[(4, 4), float32])
    -> (Tensor[(1, 4), float32], Tensor[(4), float32], Tensor[(), float32], Tensor[(4), float32]) {
  let %h = tanh(nn.dense(%x, %W));
  let %l = log(add(%x, 2f));
  (nn.dense(mean(%h, axis=[0], keepdims=True), %W),
   sum(%x, axis=[0]),
   max(abs(subtract(%h, %l))),
   min(%l, axis=[0]))
}
"#;
    let inputs: Vec<String> = (0..30)
        .map(|i| {
            let n = 1 + (i * 7) % 9;
            let rows: Vec<String> = (0..n)
                .map(|r| {
                    let v: Vec<String> = (0..4)
                        .map(|c| match (i + r + c) % 23 {
                            // A NaN once through `log`.
                            0 => "-3.0".to_string(),
                            5 => "-0.0".to_string(),
                            7 => "0.0".to_string(),
                            k => format!("{:.3}", k as f64 / 7.0 - 1.5),
                        })
                        .collect();
                    format!("[{}]", v.join(", "))
                })
                .collect();
            format!("{{\"x\": [{}]}}", rows.join(", "))
        })
        .collect();
    let x = expected(
        "row_reductions",
        load_text("row_reductions", src),
        &inputs.join("\n"),
        &["x"],
    );
    check_all_ways(&x);
    let gathers = |mixing_kernels: bool| mixing_profile(&x, mixing_kernels).ragged_gathers;
    assert!(gathers(true) > 0, "reductions read where the rows lie");
    assert_eq!(gathers(false), 0);
}

/// Row `v` of each instance's own `(?, 8)` matrix read by a counter the host computes
/// (`%v + 1` from a literal: shared by the reuse analysis, a fresh scalar in every instance):
/// invocations of equal counters launch together, keyed by the counter's value — keyed by its
/// buffer, every invocation launched alone. Equal to the reference every way.
#[test]
fn a_counter_computed_on_the_host_does_not_split_ragged_launches() {
    let src = r#"
def @rows(%m: Tensor[(?, 8), float32], %ids: List[Tensor[(?), int32]], %v: Tensor[(), int32],
          %W: Tensor[(8, 8), float32]) -> List[Tensor[(1, 8), float32]] {
  match (%ids) {
    Nil => Nil,
    Cons(_, %rest) => Cons(tanh(nn.dense(take(%m, reshape(%v, newshape=[1]), axis=0), %W)), @rows(%m, %rest, %v + 1, %W)),
  }
}
def @main(%ids: Tensor[(?), int32], %nbrs: List[Tensor[(?), int32]], %emb: Tensor[(10, 8), float32],
          %W: Tensor[(8, 8), float32]) -> Tensor[(1, 8), float32] {
  @foldl(fn (%a: Tensor[(1, 8), float32], %r: Tensor[(1, 8), float32]) -> Tensor[(1, 8), float32] { add(%a, %r) },
         zeros(shape=[1, 8], dtype="float32"), @rows(take(%emb, %ids, axis=0), %nbrs, 0, %W))
}
"#;
    let inputs: Vec<String> = (0..30)
        .map(|i| {
            let n = 1 + i % 5;
            let ids: Vec<String> = (0..n).map(|v| ((i + v * 7) % 10).to_string()).collect();
            let nbrs: Vec<String> = (0..n).map(|v| format!("[{v}]")).collect();
            format!(
                "{{\"ids\": [{}], \"nbrs\": [{}]}}",
                ids.join(", "),
                nbrs.join(", ")
            )
        })
        .collect();
    let x = expected(
        "host_counter",
        load_text("host_counter", src),
        &inputs.join("\n"),
        &["ids", "nbrs"],
    );
    check_all_ways(&x);
    let p = batch_profile(&x, tumble_runtime::Options::default());
    let (launches, invocations) = {
        let s = p.blocks_where(|name| name.starts_with("rows:"));
        (s.launches, s.invocations)
    };
    // 30 instances of 1-5 rows: 90 invocations, at most 5 counter values.
    assert_eq!(invocations, 90);
    assert!(launches <= 10, "{launches} launches\n{p}");
}

/// A decoder over each instance's own rows `%x: (?, 8)`: every step attends over them
/// (`nn.dense(%h, %x)`, softmax, `nn.dense(%p, transpose(%x))`, scaled or not) and picks one
/// (`argmax(nn.dense(%h, %x), axis=[1])`, a pointer network's choice, whose row it reads next).
/// Both are queries run over every instance's rows where they lie, whatever their lengths;
/// without the mixing kernels, one group per length. Equal to the reference every way.
#[test]
fn queries_against_each_instance_s_rows_run_over_every_length_at_once() {
    let src = r#"
def @dec(%n: Tensor[(), int32], %h: Tensor[(1, 8), float32], %x: Tensor[(?, 8), float32],
         %W: Tensor[(8, 8), float32], %U: Tensor[(8, 8), float32]) -> List[Tensor[(), int32]] {
  if (%n == 0) {
    Nil
  } else {
    let %ctx = nn.dense(nn.softmax(multiply(nn.dense(%h, %x), 0.5f), axis=1), transpose(%x));
    let %h2 = tanh(add(nn.dense(%ctx, %W), nn.dense(%h, %U)));
    let %i = squeeze(argmax(nn.dense(%h2, %x), axis=[1]));
    let %h3 = add(%h2, take(%x, expand_dims(%i, axis=0), axis=0));
    Cons(%i, @dec(%n - 1, %h3, %x, %W, %U))
  }
}
def @main(%x: Tensor[(?, 8), float32], %W: Tensor[(8, 8), float32], %U: Tensor[(8, 8), float32])
    -> List[Tensor[(), int32]] {
  @dec(4, mean(%x, axis=[0], keepdims=True), %x, %W, %U)
}
"#;
    // Rows without the symmetries of `var_rows` (whose rows' means are equal across columns, so
    // that scores tie exactly and rounding picks the argmax).
    let inputs: Vec<String> = (0..60)
        .map(|i| {
            let n = 1 + (i * 7) % 12;
            let rows: Vec<String> = (0..n)
                .map(|r| {
                    let row: Vec<String> = (0..8)
                        .map(|j| {
                            let v = ((i * 37 + r * 101 + j * 59 + r * j * 13) % 97) as f64;
                            format!("{:.4}", v / 48.0 - 1.0)
                        })
                        .collect();
                    format!("[{}]", row.join(", "))
                })
                .collect();
            format!("{{\"x\": [{}]}}", rows.join(", "))
        })
        .collect();
    let x = expected(
        "ragged_query",
        load_text("ragged_query", src),
        &inputs.join("\n"),
        &["x"],
    );
    check_all_ways(&x);
    let profile = |mixing_kernels: bool| mixing_profile(&x, mixing_kernels);
    let (on, off) = (profile(true), profile(false));
    // Four steps, each an attention and a choice.
    assert!(on.ragged_queries >= 8, "{on}");
    assert_eq!(off.ragged_queries, 0, "{off}");
    assert!(off.ragged_groups > on.ragged_groups, "{on}\n{off}");
}

/// A feed-forward layer over each instance's rows with its GELU as PyTorch exports it
/// (`erf`) or written out (`power(x, 3f)`): row-wise, so the whole launch runs as rows of every
/// length at once (each ran once per group of equal lengths, on the reference kernels) and
/// equals the reference every way.
#[test]
fn gelu_by_erf_or_power_runs_row_wise() {
    let ops = |name: &str, act: &str| {
        let src = format!(
            r#"
def @main(%x: Tensor[(?, 4), float32], %w1: Tensor[(8, 4), float32], %w2: Tensor[(4, 8), float32]) -> Tensor[(4), float32] {{
  let %u = nn.dense(%x, %w1);
  let %a = {act};
  sum(nn.dense(%a, %w2), axis=[0])
}}
"#
        );
        let x = expected(name, load_text(name, &src), &var_rows(40, 4, LENS), &["x"]);
        check_all_ways(&x);
        let p = batch_profile(&x, Default::default());
        assert!(p.ragged_launches > 0, "{name}: {p}");
        p.ops.batched
    };
    // Only the sum over each instance's rows runs as an operator of its own (grouped by
    // length): the rest is the rows' products and row programs.
    let relu = ops("relu", "nn.relu(%u)");
    for (name, act) in [
        ("gelu_erf", "multiply(multiply(%u, 0.5f), add(erf(multiply(%u, 0.70710677f)), 1f))"),
        (
            "gelu_pow",
            "multiply(multiply(%u, 0.5f), add(tanh(multiply(add(%u, multiply(power(%u, 3f), 0.044715f)), 0.7978846f)), 1f))",
        ),
        ("pow_any", "power(sigmoid(%u), multiply(sigmoid(%u), 2.5f))"),
    ] {
        assert_eq!(ops(name, act), relu, "{name}: more operators than relu's");
    }
}

/// A layer norm written by hand over each row (`mean` and `variance` over the last axis,
/// keepdims) keeps rows rows: the launch runs over every length at once, with no group of equal
/// lengths, and equals the reference every way.
#[test]
fn a_hand_written_layer_norm_over_rows_is_row_wise() {
    let src = r#"
def @main(%x: Tensor[(?, 4), float32], %w: Tensor[(8, 4), float32]) -> Tensor[(?, 8), float32] {
  let %h = nn.dense(%x, %w);
  let %mu = mean(%h, axis=[-1], keepdims=True);
  let %var = variance(%h, %mu, axis=[-1], keepdims=True);
  multiply(subtract(%h, %mu), rsqrt(add(%var, 1e-5f)))
}
"#;
    let x = expected(
        "hand_ln",
        load_text("hand_ln", src),
        &var_rows(40, 4, LENS),
        &["x"],
    );
    check_all_ways(&x);
    let p = batch_profile(&x, Default::default());
    assert!(p.ragged_launches > 0, "{p}");
    assert_eq!(p.ragged_groups, 0, "grouped by length\n{p}");
}

/// Attention scaled by a division (`scores / sqrt(d)`, as PyTorch ports write it) is the
/// attention form too, with a scale of 1 / c: one kernel over every sentence's rows, equal to
/// the reference every way.
#[test]
fn attention_scaled_by_a_division_is_attention() {
    let src = TINY_ENCODER.replace(
        "multiply(nn.batch_matmul(%q, %k), 0.5f)",
        "divide(nn.batch_matmul(%q, %k), 2f)",
    );
    assert_ne!(src, TINY_ENCODER);
    let lens: Vec<usize> = LENS.iter().copied().filter(|&n| n > 0).collect();
    let x = expected(
        "ragged_divide",
        load_text("ragged_divide", &src),
        &var_tokens(40, 10, &lens),
        &["t", "p", "threshold"],
    );
    check_all_ways(&x);
    let p = batch_profile(&x, tumble_runtime::Options::default());
    assert!(p.ragged_attention > 0, "{p}");
}

/// Pairwise forms over a sentence's rows: `(L, 1, D)` against `(1, L, D)` broadcast to
/// `L × L` rows. Both operands' leading dims strip to `(L)`, and a row program took them for the
/// same `L` rows: the batched engine returned the diagonal, `(L, 1, D)`, silently (a relation
/// network, pairwise distances). Also a pair from two inputs whose lengths are sometimes equal.
#[test]
fn pairwise_broadcasts_over_the_rows_of_an_instance() {
    for (name, ret, body) in [
        (
            "pair_add",
            "Tensor[(?, ?, 4), float32]",
            "tanh(add(expand_dims(%x, axis=1), expand_dims(%x, axis=0)))",
        ),
        (
            "pair_dist",
            "Tensor[(?, ?), float32]",
            "sum(power(subtract(expand_dims(%x, axis=1), expand_dims(%x, axis=0)), 2f), axis=[2])",
        ),
        (
            "pair_dense",
            "Tensor[(?, ?, 4), float32]",
            "multiply(expand_dims(nn.dense(%x, %w), axis=1), reshape(%x, newshape=[1, -1, 4]))",
        ),
        (
            "pair_lead",
            "Tensor[(?, 4), float32]",
            "add(reshape(%x, newshape=[1, -1, 4]), %x)",
        ),
    ] {
        let src = format!(
            "def @main(%x: Tensor[(?, 4), float32], %w: Tensor[(4, 4), float32]) -> {ret} {{\n  {body}\n}}\n"
        );
        let src = src.replace(
            "-> Tensor[(?, 4), float32] {\n  add(reshape",
            "-> Tensor[(1, ?, 4), float32] {\n  add(reshape",
        );
        let x = expected(name, load_text(name, &src), &var_rows(23, 4, LENS), &["x"]);
        check_all_ways(&x);
    }
    let src = r#"
def @main(%x: Tensor[(?, 4), float32], %y: Tensor[(?, 4), float32]) -> Tensor[(?, ?, 4), float32] {
  maximum(expand_dims(%x, axis=1), expand_dims(%y, axis=0))
}
"#;
    let xs: Vec<String> = var_rows(12, 4, LENS).lines().map(str::to_string).collect();
    let ys: Vec<String> = var_rows(12, 4, &[3, 2, 9, 1, 0, 2, 7, 4])
        .lines()
        .map(str::to_string)
        .collect();
    let inputs: Vec<String> = xs
        .iter()
        .zip(&ys)
        .map(|(x, y)| {
            format!(
                "{}, \"y\": {}",
                x.trim_end_matches('}'),
                &y["{\"x\": ".len()..]
            )
        })
        .collect();
    let x = expected(
        "pair_xy",
        load_text("pair_xy", src),
        &inputs.join("\n"),
        &["x", "y"],
    );
    check_all_ways(&x);
}
