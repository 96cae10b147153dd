//! Vectorizable f32 elementwise functions for fused row programs. Branch-free, so loops over slices
//! compile to SIMD; accurate to a few ulp (≤ 2e-7 relative on the tested ranges), which the
//! equivalence tests against the f64 reference kernels bound.

const LOG2E: f32 = std::f32::consts::LOG2_E;
const LN2_HI: f32 = 0.693_145_75;
const LN2_LO: f32 = 1.428_606_8e-6;

/// e^x for f32: inf past ln(f32::MAX), denormal down to about -103.3 and 0 below, as the
/// reference's `exp` (f64, rounded to f32). The denormals matter: `log(sigmoid(-95))` is -95,
/// where a flush to 0 made it -inf (an audit's find).
#[inline(always)]
pub fn exp(x: f32) -> f32 {
    // Up to ln(f32::MAX) (88.72284): an earlier clamp at 88.0 returned e^88 = 1.65e38 for every
    // larger x, where the reference overflows to inf (generated program 1803315 and its class).
    // Down to -104, below which e^x is under half the least denormal (2^-150) and rounds to 0.
    let xc = x.clamp(-104.0, 88.722_83);
    // Round to nearest by adding and subtracting 1.5·2^23 (plain float ops, so loops vectorize;
    // `f32::round` is a libm call).
    const SHIFT: f32 = 12_582_912.0;
    let t = xc * LOG2E + SHIFT;
    let k = t - SHIFT;
    // k as an integer, read from the mantissa of `t` (t stays in [2^23, 2^24), where consecutive
    // floats are 1 apart). Not `k as i32`: Rust's saturating cast does not vectorize (it became
    // per-lane scalar conversions with NaN checks, 4× slower loops); this is exact for the clamped k.
    let ki = t.to_bits() as i32 - SHIFT.to_bits() as i32;
    let r = xc - k * LN2_HI - k * LN2_LO;
    // Taylor polynomial of e^r on |r| <= ln2/2, degree 7 (error < 2e-8 relative before scaling).
    let p = 1.0
        + r * (1.0
            + r * (0.5
                + r * (1.0 / 6.0
                    + r * (1.0 / 24.0
                        + r * (1.0 / 120.0 + r * (1.0 / 720.0 + r * (1.0 / 5040.0)))))));
    // 2^k as 2^(k>>1)·2^(k-(k>>1)): k is in [-150, 128] after the clamp, which one exponent
    // field cannot hold (2^128 overflows it, 2^-127 and below are denormal), and each half in
    // [-75, 64] can. The last product rounds once, to a denormal where e^x is one.
    let half = ki >> 1;
    let s1 = f32::from_bits(((half + 127) as u32) << 23);
    let s2 = f32::from_bits(((ki - half + 127) as u32) << 23);
    let y = p * s1 * s2;
    // From ln(f32::MAX) rounded up (88.72283935546875) on, e^x rounds to inf.
    if x >= 88.722_84 {
        f32::INFINITY
    } else {
        y
    }
}

/// 1 / (1 + e^-x), as e^x / (1 + e^x) for negative x: there e^-x overflows from x < -88.7 on,
/// where the result is still a (denormal) number down to about -103.
#[inline(always)]
pub fn sigmoid(x: f32) -> f32 {
    let e = exp(-x.abs());
    let s = 1.0 / (1.0 + e);
    if x < 0.0 {
        e * s
    } else {
        s
    }
}

/// tanh as an odd rational function p(x)/q(x) of degrees 13/6 (the minimax fit Eigen, XLA and
/// ONNX Runtime's MLAS use), clamped at |x| = 7.905, where the fit reaches 1 - 2^-24: from there
/// to 9.01, where tanh rounds to ±1 in f32, the result is up to 4 ulp (2.7e-7) too close to ±1,
/// which `1 + tanh(x)` near x = -8 magnifies (5.96e-8 against 2.25e-7; a numerics audit's
/// note — an `exp` there would double the function's cost on every model). Odd in x, so small
/// arguments keep their relative accuracy; one division and 12 multiply-adds, against `exp`, a
/// division and a series for the small arguments before (0.58 → 0.29 ns an element in an
/// AVX-512 loop). Written without `mul_add`, so every ISA's loop rounds alike.
#[inline(always)]
pub fn tanh(x: f32) -> f32 {
    let given = x;
    let x = x.clamp(-7.905_311, 7.905_311);
    let x2 = x * x;
    let p = -2.760_768_5e-16 * x2 + 2.000_188e-13;
    let p = p * x2 + -8.604_672e-11;
    let p = p * x2 + 5.122_297e-8;
    let p = p * x2 + 1.485_722_4e-5;
    let p = p * x2 + 6.372_619e-4;
    let p = p * x2 + 4.893_524_6e-3;
    let q = 1.198_258_4e-6 * x2 + 1.185_347_1e-4;
    let q = q * x2 + 2.268_434_6e-3;
    let q = q * x2 + 4.893_525e-3;
    // The fit tops out at 1 - 2^-24; tanh rounds to ±1 in f32 from |x| ≈ 9.01 on. Below 2^-12
    // tanh(x) rounds to x itself (x³/3 is under half an ulp), where `x * p` went denormal for
    // |x| < 2.4e-36 (100 ulps off near 1e-38, 0 below 3e-43: an audit's find).
    if given.abs() >= 9.011 {
        1.0f32.copysign(given)
    } else if x2 < 5.960_464_5e-8 {
        x
    } else {
        x * p / q
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rel(a: f32, b: f64) -> f64 {
        ((a as f64) - b).abs() / b.abs().max(1e-30)
    }

    #[test]
    fn exp_sigmoid_tanh_are_accurate() {
        let mut worst = (0.0f64, 0.0f64, 0.0f64);
        let mut x = -30.0f64;
        while x <= 30.0 {
            let xf = x as f32;
            let xd = xf as f64;
            worst.0 = worst.0.max(rel(exp(xf), xd.exp()));
            worst.1 = worst.1.max(rel(sigmoid(xf), 1.0 / (1.0 + (-xd).exp())));
            let t = xd.tanh();
            if t != 0.0 {
                worst.2 = worst.2.max(rel(tanh(xf), t));
            }
            x += 0.001_7;
        }
        assert!(worst.0 < 4e-7, "exp {worst:?}");
        assert!(worst.1 < 4e-7, "sigmoid {worst:?}");
        assert!(worst.2 < 5e-7, "tanh {worst:?}");
        // The ends of the range, as the reference's `exp` (f64, rounded to f32) has them.
        for x in [-87.3f32, -80.0, 80.0, 88.0, 88.5, 88.72] {
            let want = (x as f64).exp();
            assert!(rel(exp(x), want) < 4e-7, "exp({x}) = {} vs {want}", exp(x));
        }
        // Denormal results, as the reference's (f64 rounded to f32), and 0 past them.
        for x in [-87.5f32, -90.0, -95.0, -100.0, -103.0, -103.9] {
            let want = (x as f64).exp() as f32;
            assert!(
                exp(x) == want || exp(x).to_bits().abs_diff(want.to_bits()) <= 1,
                "exp({x}) = {:e} vs {want:e}",
                exp(x)
            );
            let s = sigmoid(x);
            let want = (1.0 / (1.0 + (-(x as f64)).exp())) as f32;
            assert!(
                s.to_bits().abs_diff(want.to_bits()) <= 1,
                "sigmoid({x}) = {s:e} vs {want:e}"
            );
            // Denormals keep fewer bits the smaller they are: ~1% of -95's.
            if x >= -95.0 {
                assert!(
                    (s.ln() as f64 - x as f64).abs() < 0.01,
                    "log(sigmoid({x})) = {}",
                    s.ln()
                );
            }
        }
        assert_eq!(exp(-104.5), 0.0);
        assert_eq!(exp(88.722_84), f32::INFINITY);
        let below = f32::from_bits(88.722_84f32.to_bits() - 1);
        let want = ((below as f64).exp() as f32).to_bits();
        assert!(
            exp(below).to_bits().abs_diff(want) <= 1,
            "exp({below}) = {:e}",
            exp(below)
        );
        assert_eq!(exp(88.8), f32::INFINITY);
        assert_eq!(exp(1000.0), f32::INFINITY);
        assert_eq!(exp(f32::INFINITY), f32::INFINITY);
        assert_eq!(exp(-1000.0), 0.0);
        assert_eq!(exp(f32::NEG_INFINITY), 0.0);
        assert!(exp(f32::NAN).is_nan());
        assert_eq!(sigmoid(-1000.0), 0.0);
        assert_eq!(sigmoid(1000.0), 1.0);
        assert!(sigmoid(-1000.0) >= 0.0 && sigmoid(1000.0) <= 1.0);
        // Bounded by 1 in magnitude, odd, and exact at 0.
        for x in [7.9f32, 9.0, 100.0, f32::MAX, f32::INFINITY] {
            assert!(tanh(x) <= 1.0 && tanh(x) > 0.999_999, "{x}");
            assert_eq!(tanh(-x), -tanh(x));
        }
        // Where f32 tanh is ±1, so is this one.
        for x in [9.02f32, 10.0, 50.0, f32::INFINITY] {
            assert_eq!(((x as f64).tanh()) as f32, 1.0);
            assert_eq!(tanh(x), 1.0);
            assert_eq!(tanh(-x), -1.0);
        }
        assert_eq!(tanh(0.0), 0.0);
        // Tiny arguments are their own tanh (denormals included).
        for x in [1e-44f32, 1e-42, 1e-38, 1e-37, 1e-20, 1e-5, 2e-4] {
            let want = (x as f64).tanh() as f32;
            assert!(
                tanh(x).to_bits().abs_diff(want.to_bits()) <= 1,
                "tanh({x:e}) = {:e}",
                tanh(x)
            );
            assert_eq!(tanh(-x), -tanh(x));
        }
        assert!(tanh(f32::NAN).is_nan());
    }
}
