//! Elementwise f32 loops of the fused row programs, compiled once per vector ISA and chosen at run
//! time. The crate is built for baseline x86-64 (SSE2, 4 lanes); the same loop body compiled with
//! AVX-512 or AVX2 enabled runs 16 or 8 lanes. Only the vector width changes: every element gets
//! the same sequence of IEEE operations (no FMA contraction), so results are bit-identical across
//! ISAs. Measured on TreeLSTM-large (512 trees, 1 thread): the sigmoid/tanh loops were 15% of the
//! run at SSE2 width, 10% after. `TUMBLE_NO_SIMD_DISPATCH=1` forces the baseline loops (to compare).

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Isa {
    #[cfg(target_arch = "x86_64")]
    Avx512,
    #[cfg(target_arch = "x86_64")]
    Avx2,
    Base,
}

fn isa() -> Isa {
    static ISA: std::sync::OnceLock<Isa> = std::sync::OnceLock::new();
    *ISA.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        {
            if std::env::var_os("TUMBLE_NO_SIMD_DISPATCH").is_some() {
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

#[inline(always)]
fn unary_loop(dst: &mut [f32], src: &[f32], f: impl Fn(f32) -> f32) {
    for (o, &x) in dst.iter_mut().zip(src) {
        *o = f(x);
    }
}

#[inline(always)]
fn binary_loop(dst: &mut [f32], x: &[f32], y: &[f32], f: impl Fn(f32, f32) -> f32) {
    for (o, (&p, &q)) in dst.iter_mut().zip(x.iter().zip(y)) {
        *o = f(p, q);
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512dq,avx2")]
fn unary_avx512(dst: &mut [f32], src: &[f32], f: impl Fn(f32) -> f32) {
    unary_loop(dst, src, f)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn unary_avx2(dst: &mut [f32], src: &[f32], f: impl Fn(f32) -> f32) {
    unary_loop(dst, src, f)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512dq,avx2")]
fn binary_avx512(dst: &mut [f32], x: &[f32], y: &[f32], f: impl Fn(f32, f32) -> f32) {
    binary_loop(dst, x, y, f)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn binary_avx2(dst: &mut [f32], x: &[f32], y: &[f32], f: impl Fn(f32, f32) -> f32) {
    binary_loop(dst, x, y, f)
}

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

/// `dst[i] = f(src[i])` over the common length.
#[inline]
pub fn unary(dst: &mut [f32], src: &[f32], f: impl Fn(f32) -> f32) {
    match isa() {
        // SAFETY: `isa()` returns Avx512 only when the CPU reports avx512f and avx512dq (which
        // imply avx2), so the features these functions were compiled for are present.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => unsafe { unary_avx512(dst, src, f) },
        // SAFETY: `isa()` returns Avx2 only when the CPU reports avx2.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => unsafe { unary_avx2(dst, src, f) },
        Isa::Base => unary_loop(dst, src, f),
    }
}

/// `dst[i] = f(x[i], y[i])` over the common length.
#[inline]
pub fn binary(dst: &mut [f32], x: &[f32], y: &[f32], f: impl Fn(f32, f32) -> f32) {
    match isa() {
        // SAFETY: as in `unary`.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => unsafe { binary_avx512(dst, x, y, f) },
        // SAFETY: as in `unary`.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => unsafe { binary_avx2(dst, x, y, f) },
        Isa::Base => binary_loop(dst, x, y, f),
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
        }
    }
}
