//! Nanoseconds per element of this crate's vectorized activations (`sigmoid_in_place`,
//! `tanh_in_place`, what `BiasActivation` epilogues apply) on a block of 64 rows of 768.
//!
//!     cargo run --release -p tumble-kernels --example act_bench [-- N]

use std::time::Instant;

fn main() {
    let n: usize = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(64 * 768);
    let src: Vec<f32> = (0..n).map(|i| ((i % 97) as f32 - 48.0) * 0.11).collect();
    let mut x = src.clone();
    type Act = fn(&mut [f32]);
    let acts: [(&str, Act); 2] = [
        ("sigmoid", tumble_kernels::sigmoid_in_place),
        ("tanh", tumble_kernels::tanh_in_place),
    ];
    for (name, f) in acts {
        let mut best = f64::INFINITY;
        for _ in 0..200 {
            x.copy_from_slice(&src);
            let t = Instant::now();
            f(&mut x);
            best = best.min(t.elapsed().as_secs_f64());
        }
        println!(
            "{name:8} {n} elements: {:.3} ns/element (best of 200)",
            best * 1e9 / n as f64
        );
    }
}
