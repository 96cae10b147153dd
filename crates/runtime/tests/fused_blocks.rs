//! Kernel plans against the batching rules on the reference kernels, at odd sizes: every block of a
//! synthetic cell (dense, bias, split, activations, products, concatenation, softmax, layer norm)
//! for batch sizes and widths that are not multiples of any vector width.

use tumble_check::{load, LoadOptions};
use tumble_compile::{LowerOptions, Program};
use tumble_ir::SourceMap;
use tumble_ops::{OpCtx, OpValue};
use tumble_runtime::batched::{run_block, OpStats, RowRefs, BV};
use tumble_runtime::fused::{plan, run_planned, FusedStats, LaunchCtx};
use tumble_tensor::{Rng, Tensor};

fn cell(h: usize) -> String {
    format!(
        "def @cell(%x: Tensor[(1, {h}), float32], %c: Tensor[(1, {h}), float32],
                   %w: Tensor[({h3}, {h}), float32], %b: Tensor[({h3}), float32],
                   %g: Tensor[({h2}), float32], %be: Tensor[({h2}), float32], Primitive=1) {{
           let %g3 = split(nn.bias_add(nn.dense(%x, %w), %b), indices_or_sections=3, axis=1);
           let %c2 = add(multiply(sigmoid(%g3.0), tanh(%g3.2)), %c);
           let %h2 = multiply(sigmoid(%g3.1), tanh(%c2));
           let %cat = concatenate((%h2, nn.relu(%c2)), axis=1);
           (nn.softmax(%cat, axis=-1), nn.layer_norm(%cat, %g, %be, axis=-1, epsilon=1e-5), %c2)
         }}
         def @main(%x: Tensor[(1, {h}), float32]) {{ %x }}",
        h3 = 3 * h,
        h2 = 2 * h
    )
}

/// Random inputs of the test blocks (`cell`, `proj`, `qkv`, `other`) for `b` invocations, by
/// block and parameter name, in the block's input order.
fn named_inputs(
    block: &tumble_compile::Block,
    name: &str,
    b: usize,
    h: usize,
    rng: &mut Rng,
) -> Vec<BV> {
    block
        .inputs
        .iter()
        .map(|inp| {
            let (batched, shape) = match (name, inp.name.as_str()) {
                ("other", "%x") => (true, vec![b, 3, h]),
                (_, "%x" | "%c" | "%y") => (true, vec![b, 1, h]),
                ("cell", "%w") => (false, vec![3 * h, h]),
                (_, "%w" | "%wq" | "%wy") => (false, vec![h, h]),
                (_, "%wk") => (false, vec![2 * h + 1, h]),
                (_, "%wv") => (false, vec![3, h]),
                (_, "%b") => (false, vec![3 * h]),
                (_, "%g" | "%be") => (false, vec![2 * h]),
                (_, other) => panic!("unexpected block input {other}"),
            };
            let t = OpValue::Tensor(rand(&shape, rng));
            if batched {
                BV::Batched(t)
            } else {
                BV::Shared(t)
            }
        })
        .collect()
}

/// Random inputs of a `cell(h)` block for `b` invocations.
fn cell_inputs(block: &tumble_compile::Block, b: usize, h: usize, rng: &mut Rng) -> Vec<BV> {
    named_inputs(block, "cell", b, h, rng)
}

/// The same inputs with every batched one passed as a list of scattered rows (gather fusion).
fn as_row_lists(stacked: &[BV], rng: &mut Rng) -> Vec<BV> {
    stacked
        .iter()
        .map(|v| match v {
            BV::Batched(OpValue::Tensor(t)) => scattered(t, rng),
            other => other.clone(),
        })
        .collect()
}

fn rand(shape: &[usize], rng: &mut Rng) -> Tensor {
    let n: usize = shape.iter().product();
    let v = (0..n).map(|_| rng.normal_f64() as f32).collect();
    Tensor::from_f32(shape.to_vec(), v).unwrap_or_else(|e| panic!("{e}"))
}

fn close(a: &BV, b: &BV) -> bool {
    let t = |v: &BV| match v {
        BV::Batched(OpValue::Tensor(t)) | BV::Shared(OpValue::Tensor(t)) => Some(t.clone()),
        _ => None,
    };
    match (t(a), t(b)) {
        // The row programs sum in f32 (the batching rules in f64): a layer norm over K = 66 inputs
        // of unit scale carries up to ~K·2⁻²⁴ ≈ 4e-6 absolute error in its O(1) outputs, which
        // the 4099-row launch (270k outputs) does reach; 1e-5 bounds it.
        (Some(x), Some(y)) => x.allclose(&y, 1e-5, 1e-5),
        _ => false,
    }
}

#[test]
fn kernel_plans_match_the_batching_rules_at_odd_sizes() {
    for h in [1usize, 7, 33] {
        let mut sources = SourceMap::new();
        let typed = load(&mut sources, "cell.rly", &cell(h), LoadOptions::default())
            .unwrap_or_else(|ds| panic!("{}", tumble_ir::diag::render(&ds, &sources, false)));
        let program = Program::lower_with(&typed, LowerOptions::batched())
            .unwrap_or_else(|e| panic!("{}", e.message));
        let block = program
            .blocks
            .iter()
            .find(|b| b.name == "cell")
            .unwrap_or_else(|| panic!("no block for @cell"));
        let p = plan(block);
        // 4099 rows of the widest cell: a GEMM large enough to split across threads (its row
        // programs stay below the split threshold; `row_programs_split_across_threads_...` splits
        // one).
        let sizes: &[usize] = if h == 33 {
            &[1, 3, 7, 33, 257, 4099]
        } else {
            &[1, 3, 7, 33, 257]
        };
        for &b in sizes {
            for threads in [1usize, 2] {
                let mut rng = Rng::new((h * 100 + b) as u64);
                // Block inputs are in first-use order; build each by its parameter name.
                let inputs = cell_inputs(block, b, h, &mut rng);
                let mut r = Rng::new(0);
                let mut octx = OpCtx { rng: &mut r };
                let mut stats = OpStats::default();
                let want = run_block(block, &inputs, b, &mut octx, &mut stats)
                    .unwrap_or_else(|e| panic!("{e}"));
                let mut fstats = FusedStats::default();
                let got = run_planned(
                    block,
                    &p,
                    &inputs,
                    b,
                    &mut LaunchCtx::new(&mut octx, &mut stats, &mut fstats, threads),
                )
                .unwrap_or_else(|e| panic!("{e}"));
                assert_eq!(got.len(), want.len());
                for (k, (g, w)) in got.iter().zip(&want).enumerate() {
                    assert!(
                        close(g, w),
                        "h {h} b {b} threads {threads} output {k}: {g:?} vs {w:?}"
                    );
                }
                assert!(
                    fstats.dense_stages >= 1 && fstats.row_programs >= 1,
                    "plan not used: {fstats:?}"
                );
                assert_eq!(fstats.fallbacks, 0, "h {h} b {b}");
            }
        }
    }
}

fn block_of(src: &str, name: &str) -> tumble_compile::Block {
    let mut sources = SourceMap::new();
    let typed = load(&mut sources, "t.rly", src, LoadOptions::default())
        .unwrap_or_else(|ds| panic!("{}", tumble_ir::diag::render(&ds, &sources, false)));
    let program = Program::lower_with(&typed, LowerOptions::batched())
        .unwrap_or_else(|e| panic!("{}", e.message));
    program
        .blocks
        .into_iter()
        .find(|b| b.name == name)
        .unwrap_or_else(|| panic!("no block for @{name}"))
}

/// `block`'s outputs for `b` invocations by the batching rules on the reference kernels.
fn by_batching_rules(block: &tumble_compile::Block, inputs: &[BV], b: usize) -> Vec<BV> {
    let mut r = Rng::new(0);
    let mut octx = OpCtx { rng: &mut r };
    let mut stats = OpStats::default();
    run_block(block, inputs, b, &mut octx, &mut stats).unwrap_or_else(|e| panic!("{e}"))
}

/// The plan of `block` with the plan options `off` changes (the row-program cache on).
fn plan_without(
    block: &tumble_compile::Block,
    off: impl FnOnce(&mut tumble_compile::PlanOptions),
) -> tumble_runtime::fused::RunPlan {
    let mut opts = tumble_compile::PlanOptions::default();
    off(&mut opts);
    tumble_runtime::fused::plan_with(block, opts, true)
}

fn run_with(
    block: &tumble_compile::Block,
    p: &tumble_runtime::fused::RunPlan,
    inputs: &[BV],
    b: usize,
) -> (Vec<BV>, FusedStats) {
    run_threads(block, p, inputs, b, 1)
}

fn identical(a: &[BV], b: &[BV]) -> bool {
    let t = |v: &BV| match v {
        BV::Batched(OpValue::Tensor(t)) | BV::Shared(OpValue::Tensor(t)) => Some(t.clone()),
        _ => None,
    };
    a.len() == b.len()
        && a.iter().zip(b).all(|(x, y)| match (t(x), t(y)) {
            (Some(x), Some(y)) => x.shape() == y.shape() && x.as_f32() == y.as_f32(),
            _ => false,
        })
}

/// Cached row programs give the same bits as compiling at every launch, across launches of
/// different batch sizes and widths that reuse one plan, and rebind shared scalars per launch (a
/// scalar input is not baked into the cached program).
#[test]
fn cached_row_programs_match_uncached_ones() {
    use tumble_compile::PlanOptions;
    use tumble_runtime::fused::plan_with;
    for h in [1usize, 7, 33] {
        let block = block_of(&cell(h), "cell");
        let cached = plan_with(&block, PlanOptions::default(), true);
        let fresh = plan_with(&block, PlanOptions::default(), false);
        for round in 0..2 {
            for b in [1usize, 7, 33] {
                let mut rng = Rng::new((h * 1000 + b * 10 + round) as u64);
                let inputs = cell_inputs(&block, b, h, &mut rng);
                let (a, sa) = run_with(&block, &cached, &inputs, b);
                let (f, sf) = run_with(&block, &fresh, &inputs, b);
                assert!(identical(&a, &f), "h {h} b {b} round {round}");
                assert_eq!(sf.row_compiles, sf.row_programs);
                assert!(round == 0 || sa.row_compiles == 0, "round {round}: {sa:?}");
            }
        }
    }
    let src = "def @scale(%x: Tensor[(1, 7), float32], %s: Tensor[(), float32], Primitive=1) {
                 tanh(multiply(%x, %s))
               }
               def @main(%x: Tensor[(1, 7), float32]) { %x }";
    let block = block_of(src, "scale");
    let cached = plan_with(&block, PlanOptions::default(), true);
    let fresh = plan_with(&block, PlanOptions::default(), false);
    for (k, s) in [0.5f32, -2.0, 3.0].into_iter().enumerate() {
        let mut rng = Rng::new(k as u64);
        let scalar = Tensor::from_f32(vec![], vec![s]).unwrap_or_else(|e| panic!("{e}"));
        let inputs: Vec<BV> = block
            .inputs
            .iter()
            .map(|inp| match inp.name.as_str() {
                "%x" => BV::Batched(OpValue::Tensor(rand(&[33, 1, 7], &mut rng))),
                _ => BV::Shared(OpValue::Tensor(scalar.clone())),
            })
            .collect();
        let (a, sa) = run_with(&block, &cached, &inputs, 33);
        let (f, _) = run_with(&block, &fresh, &inputs, 33);
        assert_eq!(sa.row_programs, 1, "{sa:?}");
        assert!(identical(&a, &f), "scalar {s}");
    }
}

/// Q/K/V-like projections of one input with weights of odd widths, a dense of another input, and
/// a dense whose weight differs per invocation in some launches.
fn projections(h: usize) -> String {
    format!(
        "def @proj(%x: Tensor[(1, {h}), float32], %y: Tensor[(1, {h}), float32],
                   %wq: Tensor[({h}, {h}), float32], %wk: Tensor[({h2}, {h}), float32],
                   %wv: Tensor[(3, {h}), float32], %wy: Tensor[({h}, {h}), float32],
                   Primitive=1) {{
           let %q = nn.dense(%x, %wq);
           let %k = tanh(nn.dense(%x, %wk));
           let %o = nn.dense(%y, %wy);
           let %v = nn.dense(%x, %wv);
           (add(%q, %o), %k, sigmoid(%v), nn.dense(%y, %wq))
         }}
         def @main(%x: Tensor[(1, {h}), float32]) {{ %x }}",
        h2 = 2 * h + 1
    )
}

/// Horizontal fusion gives the same values as separate denses and as the batching rules, and
/// falls back to separate denses when a weight is not shared in a launch.
#[test]
fn horizontal_fusion_matches_separate_denses_at_odd_sizes() {
    use tumble_compile::PlanOptions;
    use tumble_runtime::fused::plan_with;
    for h in [1usize, 7, 33] {
        let block = block_of(&projections(h), "proj");
        let on = plan_with(&block, PlanOptions::default(), true);
        let off = plan_with(
            &block,
            PlanOptions {
                hfuse: false,
                ..PlanOptions::default()
            },
            true,
        );
        let shown = on.to_string();
        assert!(shown.contains("horizontally fused"), "{shown}");
        assert_eq!(shown.matches("horizontally fused").count(), 2, "{shown}");
        assert!(!off.to_string().contains("horizontally fused"));
        for b in [1usize, 7, 33] {
            for per_invocation_wk in [false, true] {
                let mut rng = Rng::new((h * 100 + b) as u64);
                let inputs: Vec<BV> = block
                    .inputs
                    .iter()
                    .map(|inp| match inp.name.as_str() {
                        "%x" | "%y" => BV::Batched(OpValue::Tensor(rand(&[b, 1, h], &mut rng))),
                        "%wq" | "%wy" => BV::Shared(OpValue::Tensor(rand(&[h, h], &mut rng))),
                        "%wk" if per_invocation_wk => {
                            BV::Batched(OpValue::Tensor(rand(&[b, 2 * h + 1, h], &mut rng)))
                        }
                        "%wk" => BV::Shared(OpValue::Tensor(rand(&[2 * h + 1, h], &mut rng))),
                        "%wv" => BV::Shared(OpValue::Tensor(rand(&[3, h], &mut rng))),
                        other => panic!("unexpected block input {other}"),
                    })
                    .collect();
                let want = by_batching_rules(&block, &inputs, b);
                let (got_on, s_on) = run_with(&block, &on, &inputs, b);
                let (got_off, s_off) = run_with(&block, &off, &inputs, b);
                for (k, ((x, y), w)) in got_on.iter().zip(&got_off).zip(&want).enumerate() {
                    assert!(close(x, w), "h {h} b {b} output {k}: {x:?} vs {w:?}");
                    assert!(close(y, w), "h {h} b {b} output {k} (off)");
                }
                assert_eq!(s_off.hfused_stages, 0);
                if per_invocation_wk {
                    // The Q/K/V group falls back; the pair over %y still fuses.
                    assert_eq!(s_on.hfused_stages, 1, "{s_on:?}");
                } else {
                    assert_eq!(s_on.hfused_stages, 2, "{s_on:?}");
                    assert_eq!(s_on.hfused_denses, 5, "{s_on:?}");
                }
            }
        }
    }
}

/// `t` (B, ...) as a row list: odd invocations read a row of a bigger, shuffled batch, even ones a
/// whole tensor of their own (the two ways a launch input lies in memory).
fn scattered(t: &Tensor, rng: &mut Rng) -> BV {
    let b = t.shape().first().copied().unwrap_or(0);
    let inner: Vec<usize> = t.shape().get(1..).unwrap_or(&[]).to_vec();
    // A bigger batch holding row i at position 2b - 1 - i, with noise rows elsewhere.
    let rows: Vec<Tensor> = (0..2 * b)
        .map(|p| {
            if p >= b {
                t.row(2 * b - 1 - p).unwrap_or_else(|e| panic!("{e}"))
            } else {
                rand(&inner, rng)
            }
        })
        .collect();
    let refs: Vec<&Tensor> = rows.iter().collect();
    let big = Tensor::stack(&refs).unwrap_or_else(|e| panic!("{e}"));
    let parts = (0..b)
        .map(|i| {
            if i % 2 == 0 {
                (t.row(i).unwrap_or_else(|e| panic!("{e}")), None)
            } else {
                (big.clone(), Some(2 * b - 1 - i))
            }
        })
        .collect();
    BV::Rows(RowRefs::new(parts).unwrap_or_else(|| panic!("row list")))
}

/// Inputs passed as row lists (gather fusion) give the same bits as the same inputs stacked, in
/// GEMM stages (single and horizontally fused), row programs and stages that need them stacked.
#[test]
fn row_list_inputs_match_stacked_inputs_at_odd_sizes() {
    let other = |h: usize| {
        format!(
            "def @other(%x: Tensor[(3, {h}), float32], %w: Tensor[({h}, {h}), float32],
                        Primitive=1) {{
               (nn.softmax(%x, axis=0), tanh(nn.dense(%x, %w)), sigmoid(%x))
             }}
             def @main(%x: Tensor[(1, {h}), float32]) {{ %x }}"
        )
    };
    for h in [1usize, 7, 33] {
        for (src, name) in [
            (cell(h), "cell"),
            (projections(h), "proj"),
            (other(h), "other"),
        ] {
            let block = block_of(&src, name);
            let p = plan(&block);
            for b in [1usize, 7, 33] {
                let mut rng = Rng::new((h * 100 + b) as u64);
                let stacked = named_inputs(&block, name, b, h, &mut rng);
                let lists = as_row_lists(&stacked, &mut rng);
                let (want, _) = run_with(&block, &p, &stacked, b);
                let (got, stats) = run_with(&block, &p, &lists, b);
                assert!(identical(&got, &want), "{name} h {h} b {b}");
                assert_eq!(stats.fallbacks, 0, "{name} h {h} b {b}: {stats:?}");
                // Only the block with a stage outside the plan's fast paths stacks its input.
                assert_eq!(
                    stats.row_lists_stacked,
                    u64::from(name == "other"),
                    "{name}: {stats:?}"
                );
                let mut r = Rng::new(0);
                let mut octx = OpCtx { rng: &mut r };
                let mut ostats = OpStats::default();
                let reference = run_block(&block, &lists, b, &mut octx, &mut ostats)
                    .unwrap_or_else(|e| panic!("{e}"));
                assert!(identical(&reference, &{
                    let mut octx = OpCtx { rng: &mut r };
                    run_block(&block, &stacked, b, &mut octx, &mut ostats)
                        .unwrap_or_else(|e| panic!("{e}"))
                }));
            }
        }
    }
}

/// Epilogue fusion (a GEMM's row program run on each block of its output rows, inside the GEMM)
/// gives the same bits as the separate passes — the product is computed the same way and the row
/// program is the same code — for a single dense (`cell`) and horizontally fused groups
/// (`qkv`), contiguous and row-list inputs, at odd batch sizes, on one and two threads (the
/// GEMM's row and column splits). A GEMM whose result is also read elsewhere (`proj`: by a later
/// stage, by a block output) keeps its separate row program.
#[test]
fn epilogue_fusion_matches_separate_passes_bit_for_bit() {
    use tumble_compile::PlanOptions;
    use tumble_runtime::fused::plan_with;
    let qkv = |h: usize| {
        format!(
            "def @qkv(%x: Tensor[(1, {h}), float32], %wq: Tensor[({h}, {h}), float32],
                      %wk: Tensor[({h2}, {h}), float32], %wv: Tensor[(3, {h}), float32],
                      Primitive=1) {{
               let %q = nn.dense(%x, %wq);
               let %k = nn.dense(%x, %wk);
               let %v = nn.dense(%x, %wv);
               (tanh(%q), sigmoid(%k), multiply(%v, %v))
             }}
             def @main(%x: Tensor[(1, {h}), float32]) {{ %x }}",
            h2 = 2 * h + 1
        )
    };
    for h in [1usize, 7, 33] {
        for (src, name, fusable) in [
            (cell(h), "cell", 1u64),
            (projections(h), "proj", 0),
            (qkv(h), "qkv", 1),
        ] {
            let block = block_of(&src, name);
            let fused = plan_with(&block, PlanOptions::default(), true);
            let apart = plan_without(&block, |o| o.epilogue = false);
            let shown = fused.to_string();
            assert_eq!(
                shown.matches("epilogue").count() as u64,
                fusable,
                "{name}:\n{shown}"
            );
            assert!(!apart.to_string().contains("epilogue"));
            for b in [1usize, 3, 7, 33, 257] {
                for threads in [1usize, 2] {
                    let mut rng = Rng::new((h * 1000 + b) as u64);
                    let stacked = named_inputs(&block, name, b, h, &mut rng);
                    let lists = as_row_lists(&stacked, &mut rng);
                    for inputs in [&stacked, &lists] {
                        let label = format!("{name} h {h} b {b} threads {threads}");
                        let (want, s_apart) = run_threads(&block, &apart, inputs, b, threads);
                        let (got, s_fused) = run_threads(&block, &fused, inputs, b, threads);
                        assert!(identical(&got, &want), "{label}");
                        assert_eq!(s_apart.epilogues, 0, "{label}");
                        assert_eq!(s_fused.epilogues, fusable, "{label}: {s_fused:?}");
                        assert_eq!(s_fused.row_programs, s_apart.row_programs, "{label}");
                        assert_eq!(s_fused.fallbacks, 0, "{label}");
                    }
                }
            }
        }
    }
}

fn run_threads(
    block: &tumble_compile::Block,
    p: &tumble_runtime::fused::RunPlan,
    inputs: &[BV],
    b: usize,
    threads: usize,
) -> (Vec<BV>, FusedStats) {
    let mut r = Rng::new(0);
    let mut octx = OpCtx { rng: &mut r };
    let mut stats = OpStats::default();
    let mut fstats = FusedStats::default();
    let got = run_planned(
        block,
        p,
        inputs,
        b,
        &mut LaunchCtx::new(&mut octx, &mut stats, &mut fstats, threads),
    )
    .unwrap_or_else(|e| panic!("{e}"));
    (got, fstats)
}

/// Threads do not change a launch's bits: GEMM splits keep each output's accumulation order (the
/// cell's row programs are too small to split; the next test splits one).
#[test]
fn threads_do_not_change_a_launch() {
    let h = 33;
    let block = block_of(&cell(h), "cell");
    let p = plan(&block);
    for b in [257usize, 4099] {
        let mut rng = Rng::new(b as u64);
        let inputs = cell_inputs(&block, b, h, &mut rng);
        let (one, _) = run_threads(&block, &p, &inputs, b, 1);
        let (two, _) = run_threads(&block, &p, &inputs, b, 2);
        assert!(identical(&one, &two), "b {b}");
    }
}

/// A row program large enough to split its rows across threads (GELU and a softmax over rows of
/// 1031, 7 rows per instance) gives the bits of one thread, at splits that are not even.
#[test]
fn row_programs_split_across_threads_match_one_thread() {
    let src = "def @f(%u: Tensor[(7, 1031), float32], Primitive=1) {
                 let %u3 = multiply(%u, multiply(%u, %u));
                 let %g = multiply(multiply(0.5f, %u),
                   add(1f, tanh(multiply(0.7978845608f, add(%u, multiply(0.044715f, %u3))))));
                 (%g, nn.softmax(%g, axis=-1))
               }
               def @main(%x: Tensor[(1), float32]) { %x }";
    let block = block_of(src, "f");
    let p = plan(&block);
    for (b, threads) in [(17usize, 2usize), (17, 3), (33, 2)] {
        let mut rng = Rng::new(b as u64);
        let inputs = vec![BV::Batched(OpValue::Tensor(rand(&[b, 7, 1031], &mut rng)))];
        let (one, _) = run_threads(&block, &p, &inputs, b, 1);
        let (many, stats) = run_threads(&block, &p, &inputs, b, threads);
        assert_eq!(stats.row_splits, 1, "b {b}: the row program should split");
        assert!(identical(&one, &many), "b {b}, {threads} threads");
    }
}

/// An RNN step written plainly: a product over a concatenation plus a bias plus another
/// product; `also_sum` returns the sum too (so it is not fused into the epilogue).
fn plain_step(h: usize, also_sum: bool) -> String {
    let s = h + 2;
    let ret = if also_sum {
        "(tanh(%sum), %sum)"
    } else {
        "tanh(%sum)"
    };
    format!(
        "def @step(%x: Tensor[(1, {h}), float32], %s: Tensor[(1, {s}), float32],
                   %y: Tensor[(1, {h}), float32], %w: Tensor[({h}, {hs}), float32],
                   %u: Tensor[({h}, {h}), float32], %b: Tensor[({h}), float32], Primitive=1) {{
           let %sum = add(add(nn.dense(concatenate((%x, %s), axis=1), %w), %b), nn.dense(%y, %u));
           {ret}
         }}
         def @main(%x: Tensor[(1, {h}), float32]) {{ %x }}",
        hs = h + s
    )
}

/// Sums of products as one GEMM (`Stage::DenseSum`) give the batching rules' values (to
/// rounding: the sum is reassociated) at odd sizes, with batched, row-list and shared parts,
/// with and without an epilogue; off, the plan has no such stage.
#[test]
fn sums_of_products_match_the_batching_rules_at_odd_sizes() {
    use tumble_compile::PlanOptions;
    use tumble_runtime::fused::plan_with;
    for also_sum in [false, true] {
        for h in [1usize, 7, 33] {
            let block = block_of(&plain_step(h, also_sum), "step");
            let on = plan_with(&block, PlanOptions::default(), true);
            let off = plan_without(&block, |o| o.dense_sums = false);
            let shown = on.to_string();
            assert!(
                shown.contains("summed by") && shown.contains("read in place"),
                "{shown}"
            );
            assert_eq!(shown.contains("epilogue"), !also_sum, "{shown}");
            assert!(!off.to_string().contains("summed by"));
            for b in [1usize, 7, 33] {
                for layout in ["stacked", "rows", "shared state"] {
                    let mut rng = Rng::new((h * 1000 + b * 10) as u64 + u64::from(also_sum));
                    let inputs: Vec<BV> = block
                        .inputs
                        .iter()
                        .map(|inp| {
                            let t =
                                |shape: &[usize], rng: &mut Rng| OpValue::Tensor(rand(shape, rng));
                            match inp.name.as_str() {
                                "%s" if layout == "shared state" => {
                                    BV::Shared(t(&[1, h + 2], &mut rng))
                                }
                                "%s" => BV::Batched(t(&[b, 1, h + 2], &mut rng)),
                                "%x" | "%y" => BV::Batched(t(&[b, 1, h], &mut rng)),
                                "%w" => BV::Shared(t(&[h, 2 * h + 2], &mut rng)),
                                "%u" => BV::Shared(t(&[h, h], &mut rng)),
                                "%b" => BV::Shared(t(&[h], &mut rng)),
                                other => panic!("unexpected block input {other}"),
                            }
                        })
                        .collect();
                    let inputs = if layout == "rows" {
                        as_row_lists(&inputs, &mut rng)
                    } else {
                        inputs
                    };
                    let want = by_batching_rules(&block, &inputs, b);
                    let (got_on, s_on) = run_with(&block, &on, &inputs, b);
                    let (got_off, s_off) = run_with(&block, &off, &inputs, b);
                    assert_eq!(got_on.len(), want.len());
                    for (k, ((x, y), w)) in got_on.iter().zip(&got_off).zip(&want).enumerate() {
                        let at = format!("h {h} b {b} {layout} sum out {also_sum} output {k}");
                        assert!(close(x, w), "{at}: {x:?} vs {w:?}");
                        assert!(close(y, w), "{at} (off)");
                    }
                    assert_eq!(s_on.dense_sums, 1, "h {h} b {b} {layout}: {s_on:?}");
                    assert_eq!(s_on.fallbacks, 0, "h {h} b {b} {layout}: {s_on:?}");
                    assert_eq!(s_off.dense_sums, 0);
                }
            }
        }
    }
}

/// A shared matrix with the rows of every instance (a transformer's positional embeddings added
/// to each sentence, a CRF's transitions beside per-instance scores, one whose own leading dims
/// are the last of the instances' `(2, L, d)`) runs in the row program, its rows repeated for each
/// instance, with the values of the batching rules; a shared matrix of other rows is no row
/// program.
#[test]
fn shared_matrices_with_the_instances_rows_run_in_row_programs() {
    for (l, d) in [(1usize, 7usize), (3, 5), (17, 33)] {
        let src = format!(
            "def @embed(%x: Tensor[({l}, {d}), float32], %pos: Tensor[({l}, {d}), float32],
                        %g: Tensor[({d}), float32], %be: Tensor[({d}), float32], Primitive=1) {{
               let %e = nn.layer_norm(add(%x, %pos), %g, %be, axis=-1, epsilon=1e-5);
               (tanh(multiply(%e, %pos)), nn.softmax(subtract(%x, %pos), axis=-1))
             }}
             def @outer(%y: Tensor[(2, {l}, {d}), float32], %t: Tensor[(1, {l}, {d}), float32],
                        %pos: Tensor[({l}, {d}), float32], Primitive=1) {{
               sigmoid(add(multiply(%y, %t), %pos))
             }}
             def @main(%x: Tensor[({l}, {d}), float32]) {{ %x }}"
        );
        for name in ["embed", "outer"] {
            let block = block_of(&src, name);
            let p = plan_without(&block, |_| {});
            for b in [1usize, 3, 7, 33] {
                let mut rng = Rng::new((l * 1000 + d * 10 + b) as u64);
                let inputs: Vec<BV> = block
                    .inputs
                    .iter()
                    .map(|inp| match inp.name.as_str() {
                        "%x" => BV::Batched(OpValue::Tensor(rand(&[b, l, d], &mut rng))),
                        "%y" => BV::Batched(OpValue::Tensor(rand(&[b, 2, l, d], &mut rng))),
                        "%pos" => BV::Shared(OpValue::Tensor(rand(&[l, d], &mut rng))),
                        "%t" => BV::Shared(OpValue::Tensor(rand(&[1, l, d], &mut rng))),
                        _ => BV::Shared(OpValue::Tensor(rand(&[d], &mut rng))),
                    })
                    .collect();
                let want = by_batching_rules(&block, &inputs, b);
                let (got, stats) = run_with(&block, &p, &inputs, b);
                assert_eq!(got.len(), want.len());
                for (k, (g, w)) in got.iter().zip(&want).enumerate() {
                    assert!(
                        close(g, w),
                        "@{name} l {l} d {d} b {b} output {k}: {g:?} vs {w:?}"
                    );
                }
                assert_eq!(stats.fallbacks, 0, "@{name} l {l} d {d} b {b}: {stats:?}");
                assert!(stats.row_programs >= 1, "{stats:?}");
            }
        }
    }
    // (L, d) beside instances of (L + 1, d) rows: broadcasting cannot line them up row by row.
    let src = "def @odd(%x: Tensor[(4, 3), float32], %m: Tensor[(2, 4, 3), float32], Primitive=1) {
                 add(%x, %m)
               }
               def @main(%x: Tensor[(4, 3), float32]) { %x }";
    let block = block_of(src, "odd");
    let p = plan_without(&block, |_| {});
    let mut rng = Rng::new(5);
    let inputs: Vec<BV> = block
        .inputs
        .iter()
        .map(|inp| match inp.name.as_str() {
            "%x" => BV::Batched(OpValue::Tensor(rand(&[5, 4, 3], &mut rng))),
            _ => BV::Shared(OpValue::Tensor(rand(&[2, 4, 3], &mut rng))),
        })
        .collect();
    let want = by_batching_rules(&block, &inputs, 5);
    let (got, _) = run_with(&block, &p, &inputs, 5);
    assert!(close(&got[0], &want[0]), "{:?} vs {:?}", got[0], want[0]);
}
