//! Elementwise f32 loops of the fused row programs, compiled once per vector ISA and chosen at run
//! time. The crate is built for baseline x86-64 (SSE2, 4 lanes); the same loop body compiled with
//! AVX-512 or AVX2 enabled runs 16 or 8 lanes. Only the vector width changes: every element gets
//! the same sequence of IEEE operations (no FMA contraction), so results are bit-identical across
//! ISAs. Measured on TreeLSTM-large (512 trees, 1 thread): the sigmoid/tanh loops were 15% of the
//! run at SSE2 width, 10% after. `TUMBLE_NO_SIMD_DISPATCH=1` forces the baseline loops (to compare).

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum Isa {
    #[cfg(target_arch = "x86_64")]
    Avx512,
    #[cfg(target_arch = "x86_64")]
    Avx2,
    Base,
}

pub(crate) fn isa() -> Isa {
    static ISA: std::sync::OnceLock<Isa> = std::sync::OnceLock::new();
    *ISA.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        {
            if tumble_limits::env_flag("TUMBLE_NO_SIMD_DISPATCH") {
                return Isa::Base;
            }
            if is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512dq") {
                return Isa::Avx512;
            }
            if is_x86_feature_detected!("avx2") {
                return Isa::Avx2;
            }
        }
        Isa::Base
    })
}

/// Per-ISA copies of a loop, and its dispatching entry point: `$name` runs `$body` compiled for
/// AVX-512, AVX2 or the baseline, whichever the CPU runs ([`isa`]).
macro_rules! dispatched {
    ($(#[$doc:meta])* pub fn $name:ident($($arg:ident: $ty:ty),*) -> $ret:ty $body:block) => {
        $(#[$doc])*
        #[inline]
        pub fn $name($($arg: $ty),*) -> $ret {
            #[inline(always)]
            fn body($($arg: $ty),*) -> $ret $body
            #[cfg(target_arch = "x86_64")]
            #[target_feature(enable = "avx512f,avx512dq,avx2")]
            fn avx512($($arg: $ty),*) -> $ret {
                body($($arg),*)
            }
            #[cfg(target_arch = "x86_64")]
            #[target_feature(enable = "avx2")]
            fn avx2($($arg: $ty),*) -> $ret {
                body($($arg),*)
            }
            match isa() {
                // SAFETY: `isa()` returns Avx512 only when the CPU reports avx512f and avx512dq
                // (which imply avx2), so the features `avx512` was compiled for are present.
                #[cfg(target_arch = "x86_64")]
                Isa::Avx512 => unsafe { avx512($($arg),*) },
                // SAFETY: `isa()` returns Avx2 only when the CPU reports avx2.
                #[cfg(target_arch = "x86_64")]
                Isa::Avx2 => unsafe { avx2($($arg),*) },
                Isa::Base => body($($arg),*),
            }
        }
    };
}
pub(crate) use dispatched;

/// Asks the CPU to bring `data` into its caches ahead of use: a hint, which reads nothing
/// architecturally and cannot fault. Row programs read their operands' rows where earlier
/// launches left them (scattered over megabytes); fetching the next rows while this one computes
/// hides that latency.
#[inline]
pub fn prefetch(data: &[f32]) {
    prefetch_value(data);
}

/// Asks the CPU to bring the cache lines of `*value` into its caches: a hint, as [`prefetch`].
/// The scheduler walks a level's nodes in an order unrelated to where they were recorded
/// (megabytes of graph for a mini-batch of 64), one cache miss per node and another per node's
/// argument list; fetching a few nodes ahead overlaps those misses.
#[inline]
pub fn prefetch_value<T: ?Sized>(value: &T) {
    #[cfg(target_arch = "x86_64")]
    {
        let p = (value as *const T).cast::<i8>();
        for off in (0..std::mem::size_of_val(value)).step_by(64) {
            // SAFETY: a hint, as in `prefetch`; `off` stays inside `*value`, a live reference.
            unsafe {
                std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(p.add(off))
            };
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = value;
}

dispatched! {
    /// `dst[i] = f(src[i])` over the common length.
    pub fn unary(dst: &mut [f32], src: &[f32], f: impl Fn(f32) -> f32) -> () {
        for (o, &x) in dst.iter_mut().zip(src) {
            *o = f(x);
        }
    }
}

dispatched! {
    /// `dst[i] = f(x[i], y[i])` over the common length.
    pub fn binary(dst: &mut [f32], x: &[f32], y: &[f32], f: impl Fn(f32, f32) -> f32) -> () {
        for (o, (&p, &q)) in dst.iter_mut().zip(x.iter().zip(y)) {
            *o = f(p, q);
        }
    }
}

/// Independent accumulators of the reductions below: enough lanes for two AVX-512 registers of
/// f64, so the loop carries no dependency from one element to the next.
const LANES: usize = 16;

dispatched! {
    /// The largest element, NaNs ignored (`fold(-inf, f32::max)`: the same value whatever the
    /// order, so the lanes change nothing); `-inf` for an empty slice.
    pub fn max(x: &[f32]) -> f32 {
        let mut acc = [f32::NEG_INFINITY; LANES];
        let chunks = x.chunks_exact(LANES);
        let tail = chunks.remainder();
        for c in chunks {
            for (a, &v) in acc.iter_mut().zip(c) {
                *a = a.max(v);
            }
        }
        tail.iter().chain(&acc).fold(f32::NEG_INFINITY, |m, &v| m.max(v))
    }
}

dispatched! {
    /// The sum of the elements in f64 (lanes added pairwise at the end: an order of additions
    /// other than left to right, exact here unless the partial sums need more than f64's 53 bits).
    pub fn sum_f64(x: &[f32]) -> f64 {
        let mut acc = [0f64; LANES];
        let chunks = x.chunks_exact(LANES);
        let tail = chunks.remainder();
        for c in chunks {
            for (a, &v) in acc.iter_mut().zip(c) {
                *a += f64::from(v);
            }
        }
        fold_lanes(acc) + tail.iter().map(|&v| f64::from(v)).sum::<f64>()
    }
}

dispatched! {
    /// `Σ (x_i - mean)²` in f64, as [`sum_f64`] adds.
    pub fn sum_sq_dev_f64(x: &[f32], mean: f64) -> f64 {
        let mut acc = [0f64; LANES];
        let chunks = x.chunks_exact(LANES);
        let tail = chunks.remainder();
        for c in chunks {
            for (a, &v) in acc.iter_mut().zip(c) {
                let d = f64::from(v) - mean;
                *a += d * d;
            }
        }
        let t: f64 = tail
            .iter()
            .map(|&v| {
                let d = f64::from(v) - mean;
                d * d
            })
            .sum();
        fold_lanes(acc) + t
    }
}

dispatched! {
    /// A layer-norm row's output: `(x_i - mean) * inv * g_i + b_i` in f64, rounded once (the
    /// reference's arithmetic, one element at a time in the same order of operations).
    pub fn norm_affine(dst: &mut [f32], x: &[f32], mean: f64, inv: f64, g: &[f32], b: &[f32]) -> () {
        for (((o, &v), &gi), &bi) in dst.iter_mut().zip(x).zip(g).zip(b) {
            *o = ((f64::from(v) - mean) * inv * f64::from(gi) + f64::from(bi)) as f32;
        }
    }
}

#[inline(always)]
fn fold_lanes(acc: [f64; LANES]) -> f64 {
    let mut a = acc;
    let mut w = LANES / 2;
    while w > 0 {
        for k in 0..w {
            a[k] += a[k + w];
        }
        w /= 2;
    }
    a[0]
}

dispatched! {
    /// `dst[i] *= k`.
    pub fn scale(dst: &mut [f32], k: f32) -> () {
        for o in dst.iter_mut() {
            *o *= k;
        }
    }
}

dispatched! {
    /// `dst[i] = f(dst[i], y[i])` over the common length.
    pub fn update(dst: &mut [f32], y: &[f32], f: impl Fn(f32, f32) -> f32) -> () {
        for (o, &q) in dst.iter_mut().zip(y) {
            *o = f(*o, q);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every ISA's loop agrees bit for bit with the scalar definition, at lengths around the
    /// vector widths (tails included).
    #[test]
    fn dispatched_loops_equal_the_scalar_ones_at_odd_lengths() {
        for n in [0usize, 1, 7, 15, 16, 17, 33, 64, 257] {
            let x: Vec<f32> = (0..n).map(|i| (i as f32 * 0.37).sin() * 9.0).collect();
            let y: Vec<f32> = (0..n).map(|i| (i as f32 * 0.11).cos() * 3.0).collect();
            let mut got = vec![0f32; n];
            unary(&mut got, &x, crate::fastmath::tanh);
            let want: Vec<f32> = x.iter().map(|&v| crate::fastmath::tanh(v)).collect();
            assert_eq!(
                got.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                want.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                "tanh n={n}"
            );
            binary(&mut got, &x, &y, |p, q| p * crate::fastmath::sigmoid(q));
            let want: Vec<f32> = x
                .iter()
                .zip(&y)
                .map(|(&p, &q)| p * crate::fastmath::sigmoid(q))
                .collect();
            assert_eq!(
                got.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                want.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                "binary n={n}"
            );
            norm_affine(&mut got, &x, 0.25, 1.5, &y, &x);
            let want: Vec<f32> = x
                .iter()
                .zip(&y)
                .map(|(&v, &g)| ((f64::from(v) - 0.25) * 1.5 * f64::from(g) + f64::from(v)) as f32)
                .collect();
            assert_eq!(
                got.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                want.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                "norm_affine n={n}"
            );
        }
    }

    /// The reductions agree with their sequential definitions at odd lengths (max exactly; the
    /// f64 sums to the last bit of their f32 rounding on these values), NaNs ignored by `max`.
    #[test]
    fn reductions_equal_the_sequential_ones_at_odd_lengths() {
        for n in [0usize, 1, 7, 15, 16, 17, 31, 33, 64, 129, 768, 1001] {
            let x: Vec<f32> = (0..n)
                .map(|i| (i as f32 * 0.37).sin() * 9.0 + 0.5)
                .collect();
            assert_eq!(
                max(&x).to_bits(),
                x.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v)).to_bits(),
                "max n={n}"
            );
            let want: f64 = x.iter().map(|&v| f64::from(v)).sum();
            assert_eq!(sum_f64(&x) as f32, want as f32, "sum n={n}");
            assert!(
                (sum_f64(&x) - want).abs() <= 1e-9 * want.abs().max(1.0),
                "sum n={n}"
            );
            let mean = want / n.max(1) as f64;
            let want_sq: f64 = x.iter().map(|&v| (f64::from(v) - mean).powi(2)).sum();
            let got_sq = sum_sq_dev_f64(&x, mean);
            assert!(
                (got_sq - want_sq).abs() <= 1e-9 * want_sq.max(1.0),
                "sq n={n}"
            );
            let mut y = x.clone();
            scale(&mut y, 0.25);
            assert!(y
                .iter()
                .zip(&x)
                .all(|(a, b)| a.to_bits() == (b * 0.25).to_bits()));
            update(&mut y, &x, |p, q| p - q);
            assert!(y
                .iter()
                .zip(&x)
                .all(|(a, b)| a.to_bits() == (b * 0.25 - b).to_bits()));
        }
        let mut x = vec![1f32; 40];
        x[3] = f32::NAN;
        x[37] = 7.0;
        assert_eq!(max(&x), 7.0);
        assert_eq!(max(&[]), f32::NEG_INFINITY);
    }
}
