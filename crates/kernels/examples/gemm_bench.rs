//! Microbenchmark of batched `nn.dense` shapes from the model zoo.
//!
//! ```text
//! cargo run --release -p tumble-kernels --example gemm_bench -- [--threads T] [--kernel avx512|avx2|portable]
//!     [--shapes B,K,N;B,K,N...] [--no-peak] [--min-time SECONDS] [--stat median|min] [--cold N]
//!     [--ab KEY=VALUE,...]
//! ```
//! (`--help` describes each option.)
//!
//! For B ∈ {1, 8, 64, 512, 2048} × (K×N) ∈ {256×768, 512×1536, 256×256, 768×3072} it prints the
//! median time per call and GFLOP/s (2·B·K·N / time) of
//! (a) contiguous A, no epilogue, and
//! (b) gathered A — B rows in random order out of a buffer of 2B rows — with a sigmoid epilogue,
//! then the machine's measured sgemm peak (best of several 2048×1024×1024 contiguous runs).
//! `examples/torch_gemm.py` prints the same table for PyTorch.
//!
//! `--ab l2_chunk=262144` (keys: `l2_min`, `l2_chunk`, `l2_group`, `wide_columns`,
//! `whole_row_tasks`, see
//! [`Tuning`]) compares the default blocking (A) with the one given (B) instead: one call of A,
//! one of B, alternately (the order swapped every pair), for each shape and case, and prints the
//! median of the per-pair ratios B/A with its quartiles and how many pairs B won. Pairs of calls
//! microseconds apart see the same machine, so the drift of a shared VM (20–50% over minutes,
//! which hides a 10% difference between two runs) cancels out of each ratio.

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

/// Microbenchmark of batched `nn.dense` shapes (contiguous, and gathered + sigmoid) and the sgemm
/// peak.
#[derive(clap::Parser)]
struct Opts {
    /// Threads per product.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..))]
    threads: u64,
    /// Micro-kernel family (default: the best the CPU runs).
    #[arg(long, value_parser = kernel_kind)]
    kernel: Option<KernelKind>,
    /// Shapes to time, `B,K,N;B,K,N...` (default: the zoo's 20 shapes).
    #[arg(long, value_parser = shape_list)]
    shapes: Option<Shapes>,
    /// Skip the 2048×1024×1024 peak measurement.
    #[arg(long)]
    no_peak: bool,
    /// Seconds to repeat each shape for.
    #[arg(long, default_value_t = 0.3)]
    min_time: f64,
    /// Statistic over the repetitions (min is better for A/B tuning on a shared machine).
    #[arg(long, value_enum, default_value_t = Stat::Median)]
    stat: Stat,
    /// Cycle through N copies of each weight, so that (for N·size beyond the caches) each call
    /// streams its weight from memory as a launch in a real run does.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..))]
    cold: u64,
    /// Compare the default blocking with this one, call by call: `KEY=VALUE,...` with keys
    /// `l2_min` (bytes), `l2_chunk` (bytes), `l2_group` (row blocks), `wide_columns` (bytes, or
    /// `off`), `whole_row_tasks` (0 or 1), `prefetch_c` (0 or 1), `wide_tiles` (0 or 1),
    /// `unrolled_tiles` (0 or 1), `multi_panel_tiles` (0 or 1), `direct_group_rows` (rows),
    /// `row_block_tiles` (micro-panels per row block, 0: the kernel's own), `k_block` (largest K
    /// block, 0: the kernel's own).
    #[arg(long, value_parser = tuning_spec)]
    ab: Option<Tuning>,
}

/// A `--ab` blocking: the defaults with the given keys changed.
fn tuning_spec(v: &str) -> Result<Tuning, String> {
    let mut t = Tuning::default();
    for item in v.split(',').filter(|s| !s.trim().is_empty()) {
        let (key, value) = item
            .split_once('=')
            .ok_or_else(|| format!("`{item}` is not KEY=VALUE"))?;
        let value = value.trim();
        let number = || {
            value
                .parse::<usize>()
                .map_err(|_| format!("`{item}`: expected a non-negative integer"))
        };
        match key.trim() {
            "l2_min" => t.l2_block_min_weight_bytes = number()?,
            "l2_chunk" => t.l2_chunk_bytes = number()?.max(1),
            "l2_group" => t.l2_group_mc = number()?.max(1),
            "row_block_tiles" => t.row_block_tiles = number()?,
            "k_block" => t.k_block = number()?,
            "wide_columns" if value == "off" => t.wide_column_split_min_weight_bytes = usize::MAX,
            "wide_columns" => t.wide_column_split_min_weight_bytes = number()?,
            "whole_row_tasks" => t.whole_row_tasks_per_thread = number()? != 0,
            "prefetch_c" => t.prefetch_c = number()? != 0,
            "wide_tiles" => t.wide_tiles = number()? != 0,
            "unrolled_tiles" => t.unrolled_tiles = number()? != 0,
            "multi_panel_tiles" => t.multi_panel_tiles = number()? != 0,
            "direct_group_rows" => t.direct_group_rows = number()?,
            other => {
                return Err(format!(
                    "unknown key `{other}` (expected l2_min, l2_chunk, l2_group, wide_columns, whole_row_tasks, prefetch_c, wide_tiles, unrolled_tiles, multi_panel_tiles, direct_group_rows, row_block_tiles or k_block)"
                ))
            }
        }
    }
    Ok(t)
}

/// Per-pair ratios of B's time over A's, one call each, alternating (the order swapped every
/// pair), for `min_time` seconds (at least 9 pairs, after a warm-up call of each): the medians of
/// A and B, and the ratios sorted.
fn paired(
    min_time: f64,
    b_tuning: Tuning,
    mut f: impl FnMut() -> Result<(), KernelError>,
) -> Result<(f64, f64, Vec<f64>), KernelError> {
    let a_tuning = Tuning::default();
    let time = |t: Tuning, f: &mut dyn FnMut() -> Result<(), KernelError>| {
        set_tuning(t);
        let start = Instant::now();
        let r = f();
        (start.elapsed().as_secs_f64(), r)
    };
    for t in [a_tuning, b_tuning] {
        time(t, &mut f).1?;
    }
    let (mut ta, mut tb, mut ratios) = (Vec::new(), Vec::new(), Vec::new());
    let start = Instant::now();
    while ratios.len() < 9 || (start.elapsed().as_secs_f64() < min_time && ratios.len() < 5000) {
        let (a, b) = if ratios.len() % 2 == 0 {
            let a = time(a_tuning, &mut f);
            (a, time(b_tuning, &mut f))
        } else {
            let b = time(b_tuning, &mut f);
            (time(a_tuning, &mut f), b)
        };
        a.1?;
        b.1?;
        ta.push(a.0);
        tb.push(b.0);
        ratios.push(b.0 / a.0);
    }
    set_tuning(a_tuning);
    let med = |v: &mut Vec<f64>| {
        v.sort_by(|x, y| x.total_cmp(y));
        v[v.len() / 2]
    };
    let (ma, mb) = (med(&mut ta), med(&mut tb));
    ratios.sort_by(|x, y| x.total_cmp(y));
    Ok((ma, mb, ratios))
}

#[derive(Clone, Copy, PartialEq, clap::ValueEnum)]
enum Stat {
    Median,
    Min,
}

fn kernel_kind(v: &str) -> Result<KernelKind, String> {
    KernelKind::ALL
        .into_iter()
        .find(|k| k.name().starts_with(v))
        .ok_or_else(|| "expected avx512, avx2 or portable".to_string())
}

/// A `--shapes` list (one value to clap, not one per shape).
#[derive(Clone)]
struct Shapes(Vec<(usize, usize, usize)>);

fn shape_list(v: &str) -> Result<Shapes, String> {
    v.split(';')
        .map(|s| {
            let dims: Vec<usize> = s
                .split(',')
                .map(|x| x.trim().parse::<usize>().ok().filter(|&d| d > 0))
                .collect::<Option<_>>()
                .ok_or_else(|| format!("`{s}` is not B,K,N (positive integers)"))?;
            match dims[..] {
                [b, k, n] => Ok((b, k, n)),
                _ => Err(format!("`{s}` is not B,K,N (three numbers)")),
            }
        })
        .collect::<Result<_, _>>()
        .map(Shapes)
}

fn main() -> ExitCode {
    let o = <Opts as clap::Parser>::parse();
    if !(o.min_time.is_finite() && o.min_time >= 0.0) {
        eprintln!(
            "gemm_bench: --min-time {}: expected seconds (>= 0)",
            o.min_time
        );
        return ExitCode::from(2);
    }
    match run(o) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("gemm_bench: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run(o: Opts) -> Result<(), KernelError> {
    let threads = o.threads as usize;
    let kind = o.kernel.unwrap_or_else(KernelKind::selected);
    let (peak, min_time, use_min, cold) =
        (!o.no_peak, o.min_time, o.stat == Stat::Min, o.cold as usize);
    let mut shapes = o.shapes.map(|s| s.0).unwrap_or_default();
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
    if let Some(t) = o.ab {
        println!("# --ab: A = {:?}", Tuning::default());
        println!("#       B = {t:?}");
        println!(
            "{:>5} {:>4} {:>5} | {:>8} | {:>9} {:>9} | {:>6} [{:>5}, {:>5}] | B faster",
            "B", "K", "N", "case", "A us", "B us", "B/A", "q1", "q3"
        );
    } else {
        println!(
            "{:>5} {:>4} {:>5} | {:>11} {:>8} | {:>11} {:>8}",
            "B", "K", "N", "contig us", "GFLOP/s", "gath+sig us", "GFLOP/s"
        );
    }
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
        let gathered = Rows::Gathered(&rows);
        if let Some(b_tuning) = o.ab {
            let cases: [(&str, &Rows, &dyn Epilogue); 2] = [
                ("contig", &contiguous, &NoEpilogue),
                ("gath+sig", &gathered, &sigmoid),
            ];
            for (name, a, epi) in cases {
                let (ma, mb, r) = paired(min_time, b_tuning, || {
                    dense_with(kind, a, next_w(), &mut c, epi, threads)
                })?;
                let won = r.iter().filter(|&&x| x < 1.0).count();
                println!(
                    "{b:>5} {k:>4} {n:>5} | {name:>8} | {:>9.1} {:>9.1} | {:>6.3} [{:.3}, {:.3}] | {won}/{}",
                    ma * 1e6,
                    mb * 1e6,
                    r[r.len() / 2],
                    r[r.len() / 4],
                    r[3 * r.len() / 4],
                    r.len()
                );
            }
            continue;
        }
        let ta = median_time(min_time, use_min, || {
            dense_with(kind, &contiguous, next_w(), &mut c, &NoEpilogue, threads)
        })?;
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
    if peak && o.ab.is_none() {
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
