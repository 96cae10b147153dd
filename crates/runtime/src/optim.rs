//! The optimizers' elementwise updates of a run of weights, on the vector loops of [`crate::simd`]:
//! `tumble train` calls them once per parameter row (an embedding's rows a mini-batch did not read
//! are skipped by the caller). Compiled for the baseline ISA they ran 4 lanes wide (a square root
//! and a division per weight: 2.2% of a TreeLSTM training step); the same IEEE operations in the
//! same order at any width (no FMA contraction), so the weights are bit-identical across ISAs.

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

dispatched! {
    /// SGD: `x -= lr * (g * scale + decay * x)`.
    pub fn sgd(x: &mut [f32], g: &[f32], s: Step) -> () {
        let Step { lr, decay, scale } = s;
        for (x, g) in x.iter_mut().zip(g) {
            *x -= lr * (g * scale + decay * *x);
        }
    }
}

dispatched! {
    /// Adagrad: `v += g'^2; x -= lr * g' / (sqrt(v) + 1e-10)` with `g' = g * scale + decay * x`.
    pub fn adagrad(x: &mut [f32], g: &[f32], v: &mut [f32], s: Step) -> () {
        let Step { lr, decay, scale } = s;
        for ((x, g), v) in x.iter_mut().zip(g).zip(v.iter_mut()) {
            let g = g * scale + decay * *x;
            *v += g * g;
            *x -= lr * g / (v.sqrt() + ADAGRAD_EPS as f32);
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
            *m = k.b1 * *m + (1.0 - k.b1) * g;
            *v = k.b2 * *v + (1.0 - k.b2) * g * g;
            *x -= lr * (*m / k.c1) / ((*v / k.c2).sqrt() + k.eps);
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
        match rule {
            Rule::Sgd => *x -= lr * g,
            Rule::Adagrad => {
                let v = &mut v[i];
                *v += g * g;
                *x -= lr * g / (v.sqrt() + ADAGRAD_EPS);
            }
            Rule::Adam => {
                let (m, v) = (&mut m[i], &mut v[i]);
                *m = ADAM_BETA1 * *m + (1.0 - ADAM_BETA1) * g;
                *v = ADAM_BETA2 * *v + (1.0 - ADAM_BETA2) * g * g;
                *x -= lr * (*m / c1) / ((*v / c2).sqrt() + ADAM_EPS);
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
