//! `nn.dense` whose weight differs per invocation (MV-RNN's word matrices), in the kernel plan
//! against the batching rules: a shared left operand with enough rows takes the operand-swapped
//! GEMM path, fewer rows or a batched left operand the per-invocation products.

use tumble_check::{load, LoadOptions};
use tumble_compile::{LowerOptions, Program};
use tumble_ir::SourceMap;
use tumble_ops::{OpCtx, OpValue};
use tumble_runtime::batched::{run_block, OpStats, BV};
use tumble_runtime::fused::{plan, run_planned, FusedStats, LaunchCtx};
use tumble_tensor::{Rng, Tensor};

fn rand(shape: &[usize], rng: &mut Rng) -> Tensor {
    let n: usize = shape.iter().product();
    let v = (0..n).map(|_| rng.normal_f64() as f32).collect();
    Tensor::from_f32(shape.to_vec(), v).unwrap_or_else(|e| panic!("{e}"))
}

#[test]
fn per_invocation_weights_match_the_batching_rules_at_odd_sizes() {
    for (m, n, k) in [
        (8usize, 7usize, 33usize),
        (33, 1, 7),
        (9, 33, 1),
        (1, 7, 7),
        (3, 33, 33),
    ] {
        let src = format!(
            "def @mv(%x: Tensor[({m}, {k}), float32], %w: Tensor[({n}, {k}), float32], Primitive=1) {{
               nn.dense(%x, %w)
             }}
             def @main(%x: Tensor[({m}, {k}), float32]) {{ %x }}"
        );
        let mut sources = SourceMap::new();
        let typed = load(&mut sources, "mv.rly", &src, LoadOptions::default())
            .unwrap_or_else(|ds| panic!("{}", tumble_ir::diag::render(&ds, &sources, false)));
        let program = Program::lower_with(&typed, LowerOptions::batched())
            .unwrap_or_else(|e| panic!("{}", e.message));
        let block = program
            .blocks
            .iter()
            .find(|b| b.name == "mv")
            .unwrap_or_else(|| panic!("no block for @mv"));
        let p = plan(block);
        for b in [1usize, 7, 33] {
            for x_shared in [true, false] {
                let mut rng = Rng::new((m * 1000 + n * 10 + b) as u64);
                let x = if x_shared {
                    BV::Shared(OpValue::Tensor(rand(&[m, k], &mut rng)))
                } else {
                    BV::Batched(OpValue::Tensor(rand(&[b, m, k], &mut rng)))
                };
                let w = BV::Batched(OpValue::Tensor(rand(&[b, n, k], &mut rng)));
                let inputs = vec![x, w];
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
                    &mut LaunchCtx::new(&mut octx, &mut stats, &mut fstats, 1),
                )
                .unwrap_or_else(|e| panic!("{e}"));
                let t = |v: &BV| match v {
                    BV::Batched(OpValue::Tensor(t)) => t.clone(),
                    other => panic!("not a batched tensor: {other:?}"),
                };
                let (g, w) = (t(&got[0]), t(&want[0]));
                assert!(
                    g.allclose(&w, 1e-5, 1e-5),
                    "m {m} n {n} k {k} b {b} shared {x_shared}: {g} vs {w}"
                );
                assert_eq!(fstats.dense_stages, 1, "plan not used: {fstats:?}");
            }
        }
    }
}
