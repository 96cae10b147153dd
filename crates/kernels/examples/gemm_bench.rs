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

use std::process::ExitCode;
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
fn median_time(
    min_time: f64,
    use_min: bool,
    mut f: impl FnMut() -> Result<(), KernelError>,
) -> Result<f64, KernelError> {
    f()?;
    let mut samples = Vec::new();
    let start = Instant::now();
    while samples.len() < 5 || (start.elapsed().as_secs_f64() < min_time && samples.len() < 2000) {
        let t = Instant::now();
        f()?;
        samples.push(t.elapsed().as_secs_f64());
    }
    samples.sort_by(|a, b| a.total_cmp(b));
    let at = if use_min { 0 } else { samples.len() / 2 };
    Ok(samples.get(at).copied().unwrap_or(f64::NAN))
}

const USAGE: &str = "usage: gemm_bench [--threads T] [--kernel avx512|avx2|portable] \
[--shapes B,K,N;B,K,N...] [--no-peak] [--min-time SECONDS] [--stat median|min] [--cold N]";

struct Opts {
    threads: usize,
    kind: KernelKind,
    peak: bool,
    min_time: f64,
    shapes: Vec<(usize, usize, usize)>,
    use_min: bool,
    cold: usize,
}

/// The command line, or a message saying which argument is wrong (`Ok(None)`: `--help`).
fn parse_args(args: &[String]) -> Result<Option<Opts>, String> {
    let mut o = Opts {
        threads: 1,
        kind: KernelKind::selected(),
        peak: true,
        min_time: 0.3,
        shapes: Vec::new(),
        use_min: false,
        cold: 1,
    };
    let mut it = args.iter();
    while let Some(flag) = it.next() {
        let mut value = |what: &str| {
            it.next()
                .cloned()
                .ok_or_else(|| format!("{flag} needs a value: {what}"))
        };
        let number = |v: String, what: &str| {
            v.parse::<usize>()
                .map_err(|_| format!("{flag} {v}: expected {what}"))
        };
        match flag.as_str() {
            "--help" | "-h" => return Ok(None),
            "--threads" => o.threads = number(value("a thread count")?, "a thread count")?.max(1),
            "--kernel" => {
                let v = value("avx512, avx2 or portable")?;
                o.kind = KernelKind::ALL
                    .into_iter()
                    .find(|k| k.name().starts_with(v.as_str()))
                    .ok_or_else(|| format!("--kernel {v}: expected avx512, avx2 or portable"))?;
            }
            "--min-time" => {
                let v = value("seconds")?;
                o.min_time = v
                    .parse()
                    .ok()
                    .filter(|t: &f64| t.is_finite() && *t >= 0.0)
                    .ok_or_else(|| format!("--min-time {v}: expected seconds (>= 0)"))?;
            }
            "--shapes" => {
                for s in value("B,K,N;B,K,N...")?.split(';') {
                    let dims: Vec<usize> = s
                        .split(',')
                        .map(|x| x.trim().parse::<usize>().ok().filter(|&d| d > 0))
                        .collect::<Option<_>>()
                        .ok_or_else(|| {
                            format!("--shapes: `{s}` is not B,K,N (positive integers)")
                        })?;
                    let [b, k, n] = dims[..] else {
                        return Err(format!("--shapes: `{s}` is not B,K,N (three numbers)"));
                    };
                    o.shapes.push((b, k, n));
                }
            }
            "--cold" => o.cold = number(value("a copy count")?, "a copy count")?.max(1),
            "--no-peak" => o.peak = false,
            "--stat" => {
                o.use_min = match value("median or min")?.as_str() {
                    "min" => true,
                    "median" => false,
                    v => return Err(format!("--stat {v}: expected median or min")),
                }
            }
            other => return Err(format!("unknown argument {other}")),
        }
    }
    Ok(Some(o))
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let o = match parse_args(&args) {
        Ok(Some(o)) => o,
        Ok(None) => {
            println!("{USAGE}");
            return ExitCode::SUCCESS;
        }
        Err(e) => {
            eprintln!("gemm_bench: {e}\n{USAGE}");
            return ExitCode::from(2);
        }
    };
    match run(o) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("gemm_bench: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run(o: Opts) -> Result<(), KernelError> {
    let Opts {
        threads,
        kind,
        peak,
        min_time,
        mut shapes,
        use_min,
        cold,
    } = o;
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
            .map(|_| PackedWeight::pack(&rng.vec(n * k), n, k))
            .collect::<Result<_, _>>()?;
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
            dense_with(kind, &contiguous, next_w(), &mut c, &NoEpilogue, threads)
        })?;
        let gathered = Rows::Gathered(&rows);
        let tb = median_time(min_time, use_min, || {
            dense_with(kind, &gathered, next_w(), &mut c, &sigmoid, threads)
        })?;
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
        let pw = PackedWeight::pack(&w, n, k)?;
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
            dense_with(kind, &a, &pw, &mut c, &NoEpilogue, threads)?;
            best = best.min(t.elapsed().as_secs_f64());
        }
        println!(
            "peak sgemm {m}x{n}x{k} contiguous: {:.1} GFLOP/s (best of runs, {:.2} ms)",
            2.0 * (m * n * k) as f64 / best * 1e-9,
            best * 1e3
        );
    }
    Ok(())
}
