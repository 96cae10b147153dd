//! Vectorized activations for epilogues, and [`BiasActivation`], the common `+ bias, activation`
//! epilogue.
//!
//! `exp` is the Cephes `expf` scheme: `x = n·ln2 + r` with `|r| <= ln2/2`, a degree-6 polynomial
//! for `e^r`, and `2^n` assembled in the exponent bits — branch-free plain Rust that LLVM
//! vectorizes. It is compiled for AVX2+FMA and the baseline, hand-written with AVX-512 intrinsics, and
//! dispatched at run time.
//! Accuracy: relative error of `exp` ≤ ~2 ulp on `[-87, 88]`; `sigmoid` and `tanh` have absolute
//! error ≤ ~3e-7 (they saturate correctly to 0/1 and ±1; NaN propagates).

use crate::Epilogue;
use std::ops::Range;

/// An activation applied elementwise by [`BiasActivation`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Activation {
    /// `x`
    Identity,
    /// `max(x, 0)`
    Relu,
    /// `1 / (1 + e^-x)`
    Sigmoid,
    /// `tanh(x)`
    Tanh,
}

impl Activation {
    /// Apply in place to every element of `x`.
    pub fn apply(self, x: &mut [f32]) {
        match self {
            Activation::Identity => {}
            // NaN stays NaN (`f32::max` would make it 0), as in the reference.
            Activation::Relu => x
                .iter_mut()
                .for_each(|v| *v = if *v < 0.0 { 0.0 } else { *v }),
            Activation::Sigmoid => sigmoid_in_place(x),
            Activation::Tanh => tanh_in_place(x),
        }
    }
}

/// Epilogue `out[r][j] = act(out[r][j] + bias[j])` (no bias when `bias` is `None`). `bias`, when
/// given, must have `N` entries; a row of another length is left unchanged rather than panicking.
#[derive(Debug, Clone, Copy)]
pub struct BiasActivation<'a> {
    /// Per-column bias (`N` floats), or none.
    pub bias: Option<&'a [f32]>,
    /// The activation after the bias.
    pub act: Activation,
}

impl Epilogue for BiasActivation<'_> {
    fn rows(&self, rows: Range<usize>, out: &mut [f32]) {
        let m = rows.len();
        if m == 0 || out.is_empty() {
            return;
        }
        let n = out.len() / m;
        if let Some(b) = self.bias {
            if b.len() != n || n * m != out.len() {
                return;
            }
            for row in out.chunks_exact_mut(n) {
                for (o, &bj) in row.iter_mut().zip(b) {
                    *o += bj;
                }
            }
        }
        self.act.apply(out);
    }
}

#[inline(always)]
fn exp_approx(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const MAGIC: f32 = 12_582_912.0; // 1.5 · 2^23: adding it rounds to an integer in the mantissa
    const C1: f32 = 0.693_359_4;
    const C2: f32 = -2.121_944_4e-4;
    let x = x.clamp(-87.3, 88.3);
    let t = x * LOG2E + MAGIC;
    let n = t - MAGIC;
    let r = x - n * C1 - n * C2;
    let mut p = 1.987_569_1e-4f32;
    p = p * r + 1.398_2e-3;
    p = p * r + 8.333_452e-3;
    p = p * r + 4.166_579_6e-2;
    p = p * r + 1.666_666_5e-1;
    p = p * r + 5.0e-1;
    let er = p * r * r + r + 1.0;
    // The low mantissa bits of `t` hold n (two's complement); build 2^n's exponent from them.
    let bits = (t.to_bits().wrapping_sub(0x4B40_0000).wrapping_add(127)) << 23;
    er * f32::from_bits(bits)
}

#[inline(always)]
fn sigmoid_body(x: &mut [f32]) {
    for v in x.iter_mut() {
        // NaN in, NaN out: `f32::clamp` in `exp_approx` keeps a NaN. Stored unconditionally:
        // a store only where the input was a number became a masked store (`vmaskmovps`),
        // which AMD's Zen runs in microcode: 2.1 ns an element against 0.8 on a Zen 3
        // (`examples/act_bench.rs`; bench/RESULTS.md, fifty-fifth session).
        *v = 1.0 / (1.0 + exp_approx(-*v));
    }
}

#[inline(always)]
fn tanh_body(x: &mut [f32]) {
    for v in x.iter_mut() {
        let a = v.abs();
        let e = exp_approx(-2.0 * a);
        let t = (1.0 - e) / (1.0 + e);
        // Near 0, `1 - e` cancels; tanh(x) = x - x³/3 + ... is exact enough there.
        let t = if a < 0.004 {
            a - a * a * a * (1.0 / 3.0)
        } else {
            t
        };
        // NaN in, NaN out through the clamp, as in `sigmoid_body` (and stored unconditionally
        // for the same reason).
        *v = t.copysign(*v);
    }
}

/// Explicit AVX-512 versions: FMA-contracted polynomial, `vscalefps` for `2^n`, and `vrcp14ps`
/// plus one Newton step instead of `vdivps` (relative error ~2^-27): about 3× faster than the
/// auto-vectorized loop, which matters because the epilogue runs inside the GEMM's time.
#[cfg(target_arch = "x86_64")]
mod avx512 {
    use std::arch::x86_64::*;

    /// `e^x` for 16 lanes (`x` already clamped to `[-87.3, 88.3]`).
    #[target_feature(enable = "avx512f")]
    #[inline]
    fn exp16(x: __m512) -> __m512 {
        let n = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
            _mm512_mul_ps(x, _mm512_set1_ps(std::f32::consts::LOG2_E)),
        );
        let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693_359_4), x);
        let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.121_944_4e-4), r);
        let mut p = _mm512_set1_ps(1.987_569_1e-4);
        p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.398_2e-3));
        p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.333_452e-3));
        p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.166_579_6e-2));
        p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.666_666_5e-1));
        p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0e-1));
        let r2 = _mm512_mul_ps(r, r);
        let er = _mm512_fmadd_ps(p, r2, _mm512_add_ps(r, _mm512_set1_ps(1.0)));
        _mm512_scalef_ps(er, n)
    }

    /// `1 / d` to ~2^-27 relative (d in `[1, 2e38]`).
    #[target_feature(enable = "avx512f")]
    #[inline]
    fn recip16(d: __m512) -> __m512 {
        let r = _mm512_rcp14_ps(d);
        _mm512_mul_ps(r, _mm512_fnmadd_ps(d, r, _mm512_set1_ps(2.0)))
    }

    #[target_feature(enable = "avx512f")]
    #[inline]
    fn sigmoid16(x: __m512) -> __m512 {
        let nx = _mm512_max_ps(
            _mm512_min_ps(_mm512_sub_ps(_mm512_setzero_ps(), x), _mm512_set1_ps(88.3)),
            _mm512_set1_ps(-87.3),
        );
        let y = recip16(_mm512_add_ps(_mm512_set1_ps(1.0), exp16(nx)));
        // NaN lanes pass through unchanged (min/max would have replaced them).
        let nan = _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(x, x);
        _mm512_mask_blend_ps(nan, y, x)
    }

    #[target_feature(enable = "avx512f")]
    #[inline]
    fn tanh16(x: __m512) -> __m512 {
        let sign = _mm512_set1_epi32(i32::MIN);
        let xi = _mm512_castps_si512(x);
        let a = _mm512_castsi512_ps(_mm512_andnot_si512(sign, xi));
        let na = _mm512_max_ps(
            _mm512_mul_ps(a, _mm512_set1_ps(-2.0)),
            _mm512_set1_ps(-87.3),
        );
        let e = exp16(na);
        let one = _mm512_set1_ps(1.0);
        let t = _mm512_mul_ps(_mm512_sub_ps(one, e), recip16(_mm512_add_ps(one, e)));
        // Near 0, `1 - e` cancels: use a - a³/3 there.
        let a3 = _mm512_mul_ps(_mm512_mul_ps(a, a), a);
        let small = _mm512_fnmadd_ps(a3, _mm512_set1_ps(1.0 / 3.0), a);
        let is_small = _mm512_cmp_ps_mask::<_CMP_LT_OQ>(a, _mm512_set1_ps(0.004));
        let t = _mm512_mask_blend_ps(is_small, t, small);
        let y = _mm512_castsi512_ps(_mm512_or_si512(
            _mm512_castps_si512(t),
            _mm512_and_si512(sign, xi),
        ));
        let nan = _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(x, x);
        _mm512_mask_blend_ps(nan, y, x)
    }

    macro_rules! apply16 {
        ($name:ident, $f:ident) => {
            /// Apply over a slice, 16 lanes at a time, the tail with masked loads/stores.
            #[target_feature(enable = "avx512f")]
            pub(super) fn $name(x: &mut [f32]) {
                let mut chunks = x.chunks_exact_mut(16);
                for c in &mut chunks {
                    // SAFETY: `c` is exactly 16 floats, valid for reads and writes.
                    unsafe {
                        let v = _mm512_loadu_ps(c.as_ptr());
                        _mm512_storeu_ps(c.as_mut_ptr(), $f(v));
                    }
                }
                let rest = chunks.into_remainder();
                if !rest.is_empty() {
                    let mask: __mmask16 = ((1u32 << rest.len()) - 1) as u16;
                    // SAFETY: the mask limits both accesses to the `rest.len() < 16` floats of
                    // `rest`.
                    unsafe {
                        let v = _mm512_maskz_loadu_ps(mask, rest.as_ptr());
                        _mm512_mask_storeu_ps(rest.as_mut_ptr(), mask, $f(v));
                    }
                }
            }
        };
    }
    apply16!(sigmoid, sigmoid16);
    apply16!(tanh, tanh16);
}

macro_rules! multiversion {
    ($(#[$doc:meta])* $name:ident, $body:ident, $v512:path) => {
        $(#[$doc])*
        pub fn $name(x: &mut [f32]) {
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx2,fma")]
                fn v256(x: &mut [f32]) {
                    $body(x)
                }
                if std::arch::is_x86_feature_detected!("avx512f") {
                    // SAFETY: the CPU supports AVX-512F (checked just above).
                    unsafe { $v512(x) };
                    return;
                }
                if std::arch::is_x86_feature_detected!("avx2")
                    && std::arch::is_x86_feature_detected!("fma")
                {
                    // SAFETY: the CPU supports AVX2 and FMA (checked just above).
                    unsafe { v256(x) };
                    return;
                }
            }
            $body(x)
        }
    };
}

multiversion!(
    /// `x ← 1 / (1 + e^-x)` elementwise, vectorized (absolute error ≤ ~3e-7).
    sigmoid_in_place,
    sigmoid_body,
    avx512::sigmoid
);
multiversion!(
    /// `x ← tanh(x)` elementwise, vectorized (absolute error ≤ ~3e-7).
    tanh_in_place,
    tanh_body,
    avx512::tanh
);

#[cfg(test)]
mod tests {
    use super::*;

    /// Inputs across the range, the clamps, 0, the tanh series' threshold, NaN and infinities,
    /// repeated to `len` so every tail length is seen.
    fn inputs(len: usize) -> Vec<f32> {
        let pool = [
            0.0f32,
            -0.0,
            0.003,
            -0.0041,
            0.5,
            -1.25,
            3.0,
            -7.5,
            20.0,
            -40.0,
            88.0,
            -87.0,
            100.0,
            -100.0,
            f32::NAN,
            f32::INFINITY,
            f32::NEG_INFINITY,
            1e-30,
        ];
        (0..len).map(|i| pool[(i * 7 + len) % pool.len()]).collect()
    }

    fn check(name: &str, f: &dyn Fn(&mut [f32]), exact: fn(f64) -> f64) {
        for len in (0..=40).chain([63, 64, 65, 127]) {
            let x = inputs(len);
            let mut y = x.clone();
            f(&mut y);
            for (i, (&a, &b)) in x.iter().zip(&y).enumerate() {
                if a.is_nan() {
                    assert!(b.is_nan(), "{name} len {len} [{i}]: NaN in, {b} out");
                    continue;
                }
                let want = exact(f64::from(a));
                assert!(
                    (f64::from(b) - want).abs() <= 1e-6,
                    "{name} len {len} [{i}]: {name}({a}) = {b}, want {want}"
                );
            }
        }
    }

    fn sigmoid_exact(x: f64) -> f64 {
        1.0 / (1.0 + (-x).exp())
    }

    /// Every variant this CPU can run — the dispatching entry, the portable loop, and on x86 the
    /// loop compiled for AVX2 + FMA (as `multiversion!` compiles it) and the AVX-512 kernels —
    /// at every tail length from 0 to 40 and a few longer: the same values within 1e-6, NaN kept.
    #[test]
    fn every_activation_variant_at_every_tail_length() {
        check("sigmoid", &|x| sigmoid_in_place(x), sigmoid_exact);
        check("tanh", &|x| tanh_in_place(x), f64::tanh);
        check("sigmoid_body", &|x| sigmoid_body(x), sigmoid_exact);
        check("tanh_body", &|x| tanh_body(x), f64::tanh);
        #[cfg(target_arch = "x86_64")]
        {
            #[target_feature(enable = "avx2,fma")]
            fn sigmoid256(x: &mut [f32]) {
                sigmoid_body(x)
            }
            #[target_feature(enable = "avx2,fma")]
            fn tanh256(x: &mut [f32]) {
                tanh_body(x)
            }
            if std::arch::is_x86_feature_detected!("avx2")
                && std::arch::is_x86_feature_detected!("fma")
            {
                // SAFETY: the CPU supports AVX2 and FMA (checked just above).
                check("sigmoid avx2", &|x| unsafe { sigmoid256(x) }, sigmoid_exact);
                // SAFETY: as above.
                check("tanh avx2", &|x| unsafe { tanh256(x) }, f64::tanh);
            }
            if std::arch::is_x86_feature_detected!("avx512f") {
                // SAFETY: the CPU supports AVX-512F (checked just above).
                check(
                    "sigmoid avx512",
                    &|x| unsafe { avx512::sigmoid(x) },
                    sigmoid_exact,
                );
                // SAFETY: as above.
                check("tanh avx512", &|x| unsafe { avx512::tanh(x) }, f64::tanh);
            }
        }
    }
}
