//! Latencies of a GPU's basic operations and of the GEMM kernels at given shapes, for choosing
//! what the device executor does (run on a machine with an NVIDIA GPU):
//!
//!     cargo run --release -p tumble-cuda --example cuda_bench -- [--shapes 'M,K,N;...'] [--reps R]
//!
//! Each figure is a median over `R` repetitions in µs: `round trip` is the call and a wait for
//! the stream; `queued` the call alone, `R` of them back to back, divided by `R` after one wait.

use std::time::{Duration, Instant};

use tumble_cuda::{Fetch, GemmKernel, Gpu, Mat, Staging};

fn median(mut xs: Vec<Duration>) -> f64 {
    xs.sort();
    xs.get(xs.len() / 2).map_or(0.0, |d| d.as_secs_f64() * 1e6)
}

/// `f` `reps` times, waiting after each: the median µs of a call and its wait.
fn round_trip(gpu: &Gpu, reps: usize, mut f: impl FnMut()) -> f64 {
    f();
    let _ = gpu.synchronize();
    median(
        (0..reps)
            .map(|_| {
                let t = Instant::now();
                f();
                let _ = gpu.synchronize();
                t.elapsed()
            })
            .collect(),
    )
}

/// `f` `reps` times back to back, then one wait: µs per call.
fn queued(gpu: &Gpu, reps: usize, mut f: impl FnMut()) -> f64 {
    f();
    let _ = gpu.synchronize();
    let t = Instant::now();
    for _ in 0..reps {
        f();
    }
    let _ = gpu.synchronize();
    t.elapsed().as_secs_f64() * 1e6 / reps as f64
}

fn mat(buf: &tumble_cuda::DevBuf, rows: usize, cols: usize) -> Mat<'_> {
    Mat {
        buf,
        off: 0,
        ld: cols,
        rows,
        cols,
    }
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let arg = |name: &str| {
        args.iter()
            .position(|a| a == name)
            .and_then(|i| args.get(i + 1))
            .cloned()
    };
    let reps: usize = arg("--reps").and_then(|r| r.parse().ok()).unwrap_or(50);
    let shapes = arg("--shapes").unwrap_or_else(|| {
        "1,512,2560;8,256,1280;64,256,1280;8,512,2560;64,512,2560;256,512,2560;\
         16,512,512;8,1024,3072;128,768,2304;1024,768,2304;1024,3072,768"
            .into()
    });
    let gpu = Gpu::open(0)?;
    println!("device: {}", gpu.describe());
    println!(
        "wait on an idle stream: {:.1} µs",
        round_trip(&gpu, reps, || ())
    );
    let one = gpu.zeros(16)?;
    let dst = gpu.zeros(16)?;
    let copy = || {
        let _ = gpu.copy_rows(&mat(&one, 1, 16), &mat(&dst, 1, 16), false);
    };
    println!(
        "small kernel: round trip {:.1} µs, queued {:.1} µs",
        round_trip(&gpu, reps, copy),
        queued(&gpu, reps * 10, copy)
    );
    println!(
        "alloc and free of 64 KiB: queued {:.1} µs",
        queued(&gpu, reps * 10, || drop(gpu.uninit(16384)))
    );
    for pinned in [false, true] {
        gpu.set_staging(match pinned {
            true => Staging::Pinned,
            false => Staging::Pageable,
        });
        for n in [256usize, 16384, 262144] {
            let data = vec![1.0f32; n];
            let up_q = queued(&gpu, reps, || drop(gpu.upload(&data)));
            let up_rt = round_trip(&gpu, reps, || drop(gpu.upload(&data)));
            let buf = gpu.upload(&data)?;
            let down = round_trip(&gpu, reps, || drop(gpu.download(&buf, 0, n)));
            let two = round_trip(&gpu, reps, || {
                let _ = gpu.download_many(&[
                    Fetch {
                        buf: &buf,
                        off: 0,
                        len: n / 2,
                    },
                    Fetch {
                        buf: &buf,
                        off: n / 2,
                        len: n / 2,
                    },
                ]);
            });
            println!(
                "{} {n} floats: upload queued {up_q:.1} µs, round trip {up_rt:.1} µs; \
                 download {down:.1} µs, as two ranges {two:.1} µs",
                if pinned { "pinned  " } else { "pageable" }
            );
        }
    }
    gpu.set_staging(Staging::Mixed);
    println!("products (µs; GFLOP/s of the queued figure):");
    for s in shapes.split(';').filter(|s| !s.trim().is_empty()) {
        let d: Vec<usize> = s
            .split(',')
            .map(|x| x.trim().parse())
            .collect::<Result<_, _>>()?;
        let [m, k, n] = d[..] else {
            return Err(format!("shape {s}: want M,K,N").into());
        };
        let a = gpu.upload(&vec![0.5f32; m * k])?;
        let w = gpu.upload(&vec![0.25f32; n * k])?;
        let c = gpu.zeros(m * n)?;
        let mut line = format!("{m:>5} x {k:>5} x {n:>5}:");
        let mut kernels = vec![GemmKernel::Plain, GemmKernel::Pipelined, GemmKernel::Split];
        if gpu.has_blas() {
            kernels.push(GemmKernel::Blas);
        }
        for kernel in kernels {
            gpu.set_gemm_kernel(kernel);
            let f = || {
                let _ = gpu.gemm_nt(&mat(&a, m, k), &mat(&w, n, k), &mat(&c, m, n), false);
            };
            let rt = round_trip(&gpu, reps, f);
            let q = queued(&gpu, reps, f);
            let gflops = 2.0 * (m * k * n) as f64 / q / 1e3;
            line += &format!("  {kernel:?} {rt:.1} / {q:.1} ({gflops:.0})");
        }
        println!("{line}");
    }
    Ok(())
}
