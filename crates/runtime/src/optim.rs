//! The optimizers' elementwise updates of a run of weights, on the vector loops of [`crate::simd`]:
//! `tumble train` calls them once per parameter row (an embedding's rows a mini-batch did not read
//! are skipped by the caller). Compiled for the baseline ISA they ran 4 lanes wide (a square root
//! and a division per weight: 2.2% of a TreeLSTM training step); the same IEEE operations in the
//! same order at any width (no FMA contraction), so the weights are bit-identical across ISAs.
//!
//! Subnormals: no rule stores a subnormal weight or moment ([`normal_or_zero`]), and `tumble
//! train` runs the rules with subnormal results and operands flushed to zero
//! ([`flushing_subnormals`]). Weight decay shrinks the weights no gradient reaches
//! geometrically (Adagrad divides the decay's own gradient by its running norm: an unread
//! embedding row loses a fixed fraction per step), and every operation on or producing a
//! subnormal takes a microcode assist on x86: SST's TreeLSTM trained with Adagrad and weight
//! decay 1e-4 ran at 270 trees/s against 1,300 without decay (after three epochs 3.8 of the
//! embedding's 5.6 million weights were subnormal, and the GEMMs reading them were slow too);
//! with both, at 950. What changes is below the normal range: the weights trained differ from
//! gradual underflow's by at most 2.4e-33 there, all others bit-identical.

use crate::simd::{dispatched, isa, Isa};

/// Adagrad's ε, and Adam's β1, β2 and ε (PyTorch's defaults): one definition for the f32 rules
/// and the f64 ones ([`update_f64`]).
pub const ADAGRAD_EPS: f64 = 1e-10;
pub const ADAM_BETA1: f64 = 0.9;
pub const ADAM_BETA2: f64 = 0.999;
pub const ADAM_EPS: f64 = 1e-8;

/// What every rule reads: the learning rate, the weight decay and the gradient's scale (the
/// mini-batch mean's `1 / b`).
#[derive(Clone, Copy, Debug)]
pub struct Step {
    pub lr: f32,
    pub decay: f32,
    pub scale: f32,
}

/// Runs `f` with the CPU flushing subnormal results to zero and reading subnormal operands as
/// zero (x86-64's MXCSR FTZ and DAZ bits), restored after — also when `f` unwinds. A rule's
/// operations on values next to the subnormal range (weight decay's `decay * x` of a tiny
/// weight, its square) produce subnormals that the stores' [`normal_or_zero`] would zero anyway,
/// but each takes a microcode assist first: the Adagrad loop over an embedding decayed that far
/// ran 4× slower. The results differ from gradual underflow only where an intermediate is
/// subnormal, i.e. in values below ~1e-30. Elsewhere than x86-64, `f` runs as it is.
pub fn flushing_subnormals<R>(f: impl FnOnce() -> R) -> R {
    let _flush = Flush::on();
    f()
}

/// The MXCSR value to restore ([`flushing_subnormals`]).
struct Flush(#[cfg(target_arch = "x86_64")] u32);

impl Flush {
    #[cfg(target_arch = "x86_64")]
    fn on() -> Flush {
        /// MXCSR's flush-to-zero (bit 15) and denormals-are-zero (bit 6) bits.
        const FTZ_DAZ: u32 = (1 << 15) | (1 << 6);
        let mut old: u32 = 0;
        // SAFETY: `stmxcsr` stores the 4-byte MXCSR into `old`, a live local; `ldmxcsr` loads the
        // same value with FTZ and DAZ set, bits every x86-64 CPU has (SSE2 is the baseline, DAZ
        // came with it), so it cannot fault. Only how subnormals are treated changes, and
        // `Drop` puts the old value back.
        unsafe {
            std::arch::asm!("stmxcsr [{}]", in(reg) &mut old, options(nostack, preserves_flags));
            let new = old | FTZ_DAZ;
            std::arch::asm!("ldmxcsr [{}]", in(reg) &new, options(nostack, preserves_flags));
        }
        Flush(old)
    }

    #[cfg(not(target_arch = "x86_64"))]
    fn on() -> Flush {
        Flush()
    }
}

impl Drop for Flush {
    fn drop(&mut self) {
        // SAFETY: loads the MXCSR value `on` stored, a valid one.
        #[cfg(target_arch = "x86_64")]
        unsafe {
            std::arch::asm!("ldmxcsr [{}]", in(reg) &self.0, options(nostack, preserves_flags));
        }
    }
}

/// `v`, or zero where `v` is subnormal (see the module's docs).
#[inline(always)]
pub fn normal_or_zero(v: f32) -> f32 {
    if v.abs() < f32::MIN_POSITIVE {
        0.0
    } else {
        v
    }
}

/// [`normal_or_zero`] for f64.
#[inline(always)]
fn normal_or_zero_f64(v: f64) -> f64 {
    if v.abs() < f64::MIN_POSITIVE {
        0.0
    } else {
        v
    }
}

dispatched! {
    /// SGD: `x -= lr * (g * scale + decay * x)`.
    pub fn sgd(x: &mut [f32], g: &[f32], s: Step) -> () {
        let Step { lr, decay, scale } = s;
        for (x, g) in x.iter_mut().zip(g) {
            *x = normal_or_zero(*x - lr * (g * scale + decay * *x));
        }
    }
}

dispatched! {
    /// Adagrad: `v += g'^2; x -= lr * g' / (sqrt(v) + 1e-10)` with `g' = g * scale + decay * x`.
    pub fn adagrad(x: &mut [f32], g: &[f32], v: &mut [f32], s: Step) -> () {
        let Step { lr, decay, scale } = s;
        for ((x, g), v) in x.iter_mut().zip(g).zip(v.iter_mut()) {
            let g = g * scale + decay * *x;
            *v = normal_or_zero(*v + g * g);
            *x = normal_or_zero(*x - lr * g / (v.sqrt() + ADAGRAD_EPS as f32));
        }
    }
}

/// Adam's constants and the step's bias corrections `c1 = 1 - b1^t`, `c2 = 1 - b2^t`.
#[derive(Clone, Copy, Debug)]
pub struct Adam {
    pub b1: f32,
    pub b2: f32,
    pub eps: f32,
    pub c1: f32,
    pub c2: f32,
}

impl Adam {
    /// The usual constants (β1 0.9, β2 0.999, ε 1e-8, as PyTorch's) at step `t` (1-based).
    pub fn at_step(t: u64) -> Adam {
        let (b1, b2) = (ADAM_BETA1 as f32, ADAM_BETA2 as f32);
        let t = t.min(i32::MAX as u64) as i32;
        Adam {
            b1,
            b2,
            eps: ADAM_EPS as f32,
            c1: 1.0 - b1.powi(t),
            c2: 1.0 - b2.powi(t),
        }
    }
}

dispatched! {
    /// Adam: first and second moments `m`, `v` of `g' = g * scale + decay * x`, then
    /// `x -= lr * (m / c1) / (sqrt(v / c2) + eps)`.
    pub fn adam(x: &mut [f32], g: &[f32], m: &mut [f32], v: &mut [f32], s: Step, k: Adam) -> () {
        let Step { lr, decay, scale } = s;
        for ((x, g), (m, v)) in x.iter_mut().zip(g).zip(m.iter_mut().zip(v.iter_mut())) {
            let g = g * scale + decay * *x;
            *m = normal_or_zero(k.b1 * *m + (1.0 - k.b1) * g);
            *v = normal_or_zero(k.b2 * *v + (1.0 - k.b2) * g * g);
            *x = normal_or_zero(*x - lr * (*m / k.c1) / ((*v / k.c2).sqrt() + k.eps));
        }
    }
}

/// Which rule [`update_f64`] applies.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Rule {
    Sgd,
    Adagrad,
    Adam,
}

/// The three rules on f64 weights with f64 moments `m` (Adam's only) and `v` (an f64 parameter
/// trained in f64), step `t` (1-based), one weight at a time: the same formulas as the f32 ones.
pub fn update_f64(
    rule: Rule,
    x: &mut [f64],
    g: &[f64],
    m: &mut [f64],
    v: &mut [f64],
    (lr, decay, scale): (f64, f64, f64),
    t: u64,
) {
    let k = i32::try_from(t).unwrap_or(i32::MAX);
    let (c1, c2) = (1.0 - ADAM_BETA1.powi(k), 1.0 - ADAM_BETA2.powi(k));
    for (i, (x, &g)) in x.iter_mut().zip(g).enumerate() {
        let g = g * scale + decay * *x;
        let z = normal_or_zero_f64;
        match rule {
            Rule::Sgd => *x = z(*x - lr * g),
            Rule::Adagrad => {
                let v = &mut v[i];
                *v = z(*v + g * g);
                *x = z(*x - lr * g / (v.sqrt() + ADAGRAD_EPS));
            }
            Rule::Adam => {
                let (m, v) = (&mut m[i], &mut v[i]);
                *m = z(ADAM_BETA1 * *m + (1.0 - ADAM_BETA1) * g);
                *v = z(ADAM_BETA2 * *v + (1.0 - ADAM_BETA2) * g * g);
                *x = z(*x - lr * (*m / c1) / ((*v / c2).sqrt() + ADAM_EPS));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // Odd lengths: every vector width's remainder loop runs.
    /// The shared constants read as the f32 rules' literals did (the weights stay bit-identical).
    #[test]
    fn the_shared_constants_are_the_f32_literals() {
        assert_eq!((ADAGRAD_EPS as f32).to_bits(), 1e-10f32.to_bits());
        assert_eq!((ADAM_BETA1 as f32).to_bits(), 0.9f32.to_bits());
        assert_eq!((ADAM_BETA2 as f32).to_bits(), 0.999f32.to_bits());
        assert_eq!((ADAM_EPS as f32).to_bits(), 1e-8f32.to_bits());
    }

    /// No rule stores a subnormal weight or moment — with the subnormals flushed or not: a
    /// weight decayed towards them, a moment decaying; a zero stays zero; the flush is undone
    /// afterwards.
    #[test]
    fn subnormal_weights_and_moments_are_stored_as_zero() {
        let st = Step {
            lr: 0.05,
            decay: 1e-4,
            scale: 1.0,
        };
        let tiny = f32::MIN_POSITIVE * 4.0;
        for flush in [false, true] {
            let run = |f: &mut dyn FnMut()| match flush {
                true => flushing_subnormals(f),
                false => f(),
            };
            // SGD: `x - lr * decay * x` of the smallest normals is subnormal.
            let mut x = vec![tiny, -tiny, 1.0, f32::MIN_POSITIVE];
            run(&mut || {
                for _ in 0..200 {
                    sgd(&mut x, &[0.0; 4], Step { decay: 2.0, ..st })
                }
            });
            let normal_or_zero = |w: &f32| *w == 0.0 || w.abs() >= f32::MIN_POSITIVE;
            assert!(x.iter().all(normal_or_zero), "{x:?}");
            assert!(x[2] > f32::MIN_POSITIVE);
            if !flush {
                // Gradual underflow shrinks them until the store zeroes them (flushed, the
                // step itself underflows to zero first and they stay where they were).
                assert_eq!(&x[..2], &[0.0, 0.0]);
            }
            // Adagrad from zero state: a zero stays zero; Adam's moments decay to zero.
            let (mut x, mut v) = (vec![0.0f32, tiny], vec![0.0f32; 2]);
            run(&mut || adagrad(&mut x, &[0.0; 2], &mut v, st));
            assert_eq!(x[0].to_bits(), 0);
            assert!(x.iter().chain(&v).all(normal_or_zero), "{x:?} {v:?}");
            let k = Adam::at_step(1);
            let (mut x, mut m, mut v) = (vec![0.5f32], vec![tiny], vec![f32::MIN_POSITIVE]);
            run(&mut || {
                for _ in 0..50 {
                    adam(&mut x, &[0.0], &mut m, &mut v, Step { decay: 0.0, ..st }, k)
                }
            });
            assert_eq!((m[0], v[0]), (0.0, 0.0));
        }
        // Outside the closure subnormals are computed as usual again.
        let half = std::hint::black_box(f32::MIN_POSITIVE) / std::hint::black_box(2.0f32);
        assert!(half > 0.0 && half < f32::MIN_POSITIVE);
        let inside = flushing_subnormals(|| {
            std::hint::black_box(f32::MIN_POSITIVE) / std::hint::black_box(2.0f32)
        });
        #[cfg(target_arch = "x86_64")]
        assert_eq!(inside, 0.0);
        #[cfg(not(target_arch = "x86_64"))]
        assert_eq!(inside, half);
    }

    #[test]
    fn updates_equal_the_scalar_rules_bit_for_bit() {
        for n in [0usize, 1, 7, 15, 16, 17, 33, 257] {
            let x0: Vec<f32> = (0..n).map(|i| (i as f32 * 0.37).sin()).collect();
            let g: Vec<f32> = (0..n).map(|i| (i as f32 * 0.11).cos() - 0.2).collect();
            let v0: Vec<f32> = (0..n).map(|i| 0.01 * i as f32).collect();
            let (lr, decay, scale) = (0.05f32, 1e-4f32, 0.05f32);
            let st = Step { lr, decay, scale };

            let mut x = x0.clone();
            sgd(&mut x, &g, st);
            for i in 0..n {
                let want = x0[i] - lr * (g[i] * scale + decay * x0[i]);
                assert_eq!(x[i].to_bits(), want.to_bits());
            }

            let (mut x, mut v) = (x0.clone(), v0.clone());
            adagrad(&mut x, &g, &mut v, st);
            for i in 0..n {
                let gi = g[i] * scale + decay * x0[i];
                let vi = v0[i] + gi * gi;
                assert_eq!(v[i].to_bits(), vi.to_bits());
                assert_eq!(
                    x[i].to_bits(),
                    (x0[i] - lr * gi / (vi.sqrt() + 1e-10)).to_bits()
                );
            }

            let k = Adam {
                b1: 0.9,
                b2: 0.999,
                eps: 1e-8,
                c1: 0.1,
                c2: 0.001,
            };
            let (mut x, mut m, mut v) = (x0.clone(), v0.clone(), v0.clone());
            adam(&mut x, &g, &mut m, &mut v, st, k);
            for i in 0..n {
                let gi = g[i] * scale + decay * x0[i];
                let mi = k.b1 * v0[i] + (1.0 - k.b1) * gi;
                let vi = k.b2 * v0[i] + (1.0 - k.b2) * gi * gi;
                let xi = x0[i] - lr * (mi / k.c1) / ((vi / k.c2).sqrt() + k.eps);
                assert_eq!(
                    (m[i].to_bits(), v[i].to_bits()),
                    (mi.to_bits(), vi.to_bits())
                );
                assert_eq!(x[i].to_bits(), xi.to_bits());
            }
        }
    }
}
