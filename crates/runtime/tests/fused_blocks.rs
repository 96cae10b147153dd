//! Kernel plans against the batching rules on the reference kernels, at odd sizes: every block of a
//! synthetic cell (dense, bias, split, activations, products, concatenation, softmax, layer norm)
//! for batch sizes and widths that are not multiples of any vector width.

use tumble_check::{load, LoadOptions};
use tumble_compile::{LowerOptions, Program};
use tumble_ir::SourceMap;
use tumble_ops::{OpCtx, OpValue};
use tumble_runtime::batched::{run_block, OpStats, BV};
use tumble_runtime::fused::{plan, run_planned, FusedStats};
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
        (Some(x), Some(y)) => x.allclose(&y, 1e-5, 1e-6),
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
        // 257 rows of the widest cell is large enough for the row program to split across threads.
        for b in [1usize, 3, 7, 33, 257] {
            for threads in [1usize, 2] {
                let mut rng = Rng::new((h * 100 + b) as u64);
                // Block inputs are in first-use order; build each by its parameter name.
                let inputs: Vec<BV> = block
                    .inputs
                    .iter()
                    .map(|inp| match inp.name.as_str() {
                        "%x" | "%c" => BV::Batched(OpValue::Tensor(rand(&[b, 1, h], &mut rng))),
                        "%w" => BV::Shared(OpValue::Tensor(rand(&[3 * h, h], &mut rng))),
                        "%b" => BV::Shared(OpValue::Tensor(rand(&[3 * h], &mut rng))),
                        "%g" | "%be" => BV::Shared(OpValue::Tensor(rand(&[2 * h], &mut rng))),
                        other => panic!("unexpected block input {other}"),
                    })
                    .collect();
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
                    &mut octx,
                    &mut stats,
                    &mut fstats,
                    threads,
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
