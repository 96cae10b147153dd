//! Microbenchmark of batched `nn.dense` shapes from the model zoo.
//!
//! ```text
//! cargo run --release -p tumble-kernels --example gemm_bench -- [--threads T] [--kernel avx512|avx2|portable]
//!     [--shapes B,K,N;B,K,N...] [--no-peak] [--min-time SECONDS] [--stat median|min] [--cold N]
//! ```
//!
//! For B ∈ {1, 8, 64, 512, 2048} × (K×N) ∈ {256×768, 512×1536, 256×256, 768×3072} it prints the
//! median time per call and GFLOP/s (2·B·K·N / time) of
//! (a) contiguous A, no epilogue, and
//! (b) gathered A — B rows in random order out of a buffer of 2B rows — with a sigmoid epilogue,
//! then the machine's measured sgemm peak (best of several 2048×1024×1024 contiguous runs).
//! `examples/torch_gemm.py` prints the same table for PyTorch.

use std::time::{Duration, Instant};
use tumble_kernels::*;

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn vec(&mut self, len: usize) -> Vec<f32> {
        (0..len)
            .map(|_| ((self.next() >> 40) as f32 / (1u64 << 24) as f32) - 0.5)
            .collect()
    }
}

/// Median (or with `--stat min`, minimum) seconds per call of `f`, repeating until `min_time` has
/// passed (at least 5 runs, after a warm-up call). The minimum is the better statistic for A/B
/// tuning on a machine shared with other jobs; the tables report the median.
fn median_time(min_time: f64, use_min: bool, mut f: impl FnMut()) -> f64 {
    f();
    let mut samples = Vec::new();
    let start = Instant::now();
    while samples.len() < 5 || (start.elapsed().as_secs_f64() < min_time && samples.len() < 2000) {
        let t = Instant::now();
        f();
        samples.push(t.elapsed().as_secs_f64());
    }
    samples.sort_by(|a, b| a.total_cmp(b));
    if use_min {
        samples[0]
    } else {
        samples[samples.len() / 2]
    }
}

fn main() {
    let mut threads = 1usize;
    let mut kind = KernelKind::selected();
    let mut peak = true;
    let mut min_time = 0.3f64;
    let mut shapes: Vec<(usize, usize, usize)> = Vec::new();
    let mut use_min = false;
    let mut cold = 1usize;
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mut i = 0;
    while i < args.len() {
        let val = args.get(i + 1).cloned().unwrap_or_default();
        match args[i].as_str() {
            "--threads" => {
                threads = val.parse().expect("--threads N");
                i += 1;
            }
            "--kernel" => {
                kind = KernelKind::ALL
                    .into_iter()
                    .find(|k| k.name().starts_with(val.as_str()))
                    .expect("--kernel avx512|avx2|portable");
                i += 1;
            }
            "--min-time" => {
                min_time = val.parse().expect("--min-time SECONDS");
                i += 1;
            }
            "--shapes" => {
                for s in val.split(';') {
                    let v: Vec<usize> = s.split(',').map(|x| x.parse().expect("B,K,N")).collect();
                    shapes.push((v[0], v[1], v[2]));
                }
                i += 1;
            }
            "--cold" => {
                cold = val.parse::<usize>().expect("--cold N").max(1);
                i += 1;
            }
            "--no-peak" => peak = false,
            "--stat" => {
                use_min = val == "min";
                i += 1;
            }
            other => panic!("unknown argument {other}"),
        }
        i += 1;
    }
    if shapes.is_empty() {
        for (k, n) in [(256, 768), (512, 1536), (256, 256), (768, 3072)] {
            for b in [1, 8, 64, 512, 2048] {
                shapes.push((b, k, n));
            }
        }
    }
    println!(
        "# tumble-kernels gemm_bench: kernel {}, threads {threads}",
        kind.name()
    );
    println!(
        "{:>5} {:>4} {:>5} | {:>11} {:>8} | {:>11} {:>8}",
        "B", "K", "N", "contig us", "GFLOP/s", "gath+sig us", "GFLOP/s"
    );
    let mut rng = Rng(0x1234_5678_9ABC_DEF1);
    let sigmoid = BiasActivation {
        bias: None,
        act: Activation::Sigmoid,
    };
    for &(b, k, n) in &shapes {
        // `--cold N`: N copies of the weight used in turn, so that (for N·size beyond the caches)
        // each call streams its weight from memory as a launch in a real run does.
        let pws: Vec<PackedWeight> = (0..cold)
            .map(|_| PackedWeight::pack(&rng.vec(n * k), n, k).unwrap())
            .collect();
        let mut turn = 0usize;
        let mut next_w = || {
            turn += 1;
            &pws[turn % cold]
        };
        let x = rng.vec(b * k);
        let pool = rng.vec(2 * b * k);
        // B distinct rows of the pool in random order (a partial Fisher–Yates shuffle).
        let mut idx: Vec<usize> = (0..2 * b).collect();
        for j in 0..b {
            let r = j + (rng.next() as usize) % (2 * b - j);
            idx.swap(j, r);
        }
        let rows: Vec<&[f32]> = idx[..b]
            .iter()
            .map(|&r| &pool[r * k..(r + 1) * k])
            .collect();
        let mut c = vec![0.0f32; b * n];
        let flops = 2.0 * (b * k * n) as f64;
        let contiguous = Rows::Contiguous {
            data: &x,
            stride: k,
        };
        let ta = median_time(min_time, use_min, || {
            dense_with(kind, &contiguous, next_w(), &mut c, &NoEpilogue, threads).unwrap()
        });
        let gathered = Rows::Gathered(&rows);
        let tb = median_time(min_time, use_min, || {
            dense_with(kind, &gathered, next_w(), &mut c, &sigmoid, threads).unwrap()
        });
        println!(
            "{b:>5} {k:>4} {n:>5} | {:>11.1} {:>8.1} | {:>11.1} {:>8.1}",
            ta * 1e6,
            flops / ta * 1e-9,
            tb * 1e6,
            flops / tb * 1e-9
        );
    }
    if peak {
        let (m, n, k) = (2048, 1024, 1024);
        let w = rng.vec(n * k);
        let pw = PackedWeight::pack(&w, n, k).unwrap();
        let x = rng.vec(m * k);
        let mut c = vec![0.0f32; m * n];
        let a = Rows::Contiguous {
            data: &x,
            stride: k,
        };
        let mut best = f64::MAX;
        let start = Instant::now();
        while start.elapsed() < Duration::from_secs_f64(min_time.max(1.0)) {
            let t = Instant::now();
            dense_with(kind, &a, &pw, &mut c, &NoEpilogue, threads).unwrap();
            best = best.min(t.elapsed().as_secs_f64());
        }
        println!(
            "peak sgemm {m}x{n}x{k} contiguous: {:.1} GFLOP/s (best of runs, {:.2} ms)",
            2.0 * (m * n * k) as f64 / best * 1e-9,
            best * 1e3
        );
    }
}
