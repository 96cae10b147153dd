//! The optimizers' state and step: SGD, Adagrad and Adam applied to one parameter in place, a
//! sparse gradient's rows one by one (the update loops themselves are `tumble_runtime::optim`'s).

use tumble_runtime::backward::ParamGrad;
use tumble_runtime::optim::{self, Step};
use tumble_tensor::Tensor;

use super::Optimizer;

/// Optimizer state per parameter, in f32 (the parameters' usual dtype; others convert).
#[derive(Default)]
pub(super) struct Slot {
    m: Vec<f32>,
    v: Vec<f32>,
    /// An f64 parameter's moments ([`step_f64`]).
    m64: Vec<f64>,
    v64: Vec<f64>,
}

/// What one optimizer step applies: the rule, the learning rate, the weight decay, the step
/// number `t` (1-based) and the gradient's scale (the mini-batch mean's `1 / b`).
#[derive(Clone, Copy, Debug)]
pub(super) struct StepSettings {
    pub(super) opt: Optimizer,
    pub(super) lr: f64,
    pub(super) decay: f64,
    pub(super) t: u64,
    pub(super) scale: f64,
}

/// One optimizer step on `w`, in place, with gradient `g * scale` (the mini-batch's mean) plus
/// `decay * w`. Moments are kept in f32, like PyTorch's optimizers (f64 for an f64 parameter).
/// The rules run with subnormals flushed (`optim::flushing_subnormals`: weight decay drives
/// unread embedding rows there, where every operation takes a microcode assist).
pub(super) fn step(
    h: StepSettings,
    w: &mut Tensor,
    g: &ParamGrad,
    s: &mut Slot,
) -> Result<(), String> {
    optim::flushing_subnormals(|| step_unflushed(h, w, g, s))
}

fn step_unflushed(
    h: StepSettings,
    w: &mut Tensor,
    g: &ParamGrad,
    s: &mut Slot,
) -> Result<(), String> {
    if w.dtype() == tumble_ir::DType::Float64 {
        return step_f64(h, w, g, s);
    }
    let (opt, decay) = (h.opt, h.decay);
    let n = w.len();
    moments(opt, n, &mut s.m, &mut s.v);
    let rule = Rule::new(h);
    // Rows whose gradient is all zero (an embedding's rows no instance of the mini-batch read)
    // keep their weights and state exactly under SGD and Adagrad without weight decay (each
    // element becomes `x - lr·0/…` = x), so they are skipped; Adam's moments move even at a
    // zero gradient, so it updates every row.
    let sparse = opt != Optimizer::Adam && decay == 0.0;
    // The last axis is a row (an embedding's row: skipped whole when its gradient is zero).
    let row = w
        .shape()
        .last()
        .copied()
        .filter(|&d| d > 0 && w.rank() >= 2)
        .unwrap_or(n.max(1));
    // Updated where it lies (a clone would make `make_mut_slice` copy the whole table); put
    // back whatever happens.
    let dtype = w.dtype();
    let mut w32 = std::mem::replace(w, Tensor::scalar_f32(0.0)).cast(tumble_ir::DType::Float32);
    let result = match w32.make_mut_slice::<f32>() {
        Some(wv) => update(wv, g, &rule, sparse, row, s),
        None => Err("internal: optimizer operands are not float".into()),
    };
    *w = w32.cast(dtype);
    result
}

/// [`step`]'s update of the f32 weights `wv` (rows of `row` elements).
fn update(
    wv: &mut [f32],
    g: &ParamGrad,
    rule: &Rule,
    sparse: bool,
    row: usize,
    s: &mut Slot,
) -> Result<(), String> {
    let n = wv.len();
    match g {
        ParamGrad::Rows(rows) if sparse => {
            let [_, d] = rows.shape();
            if rows.shape().iter().product::<usize>() != n {
                return Err("internal: gradient and parameter sizes differ".into());
            }
            for (r, gr) in rows.iter() {
                if gr.iter().all(|&v| v == 0.0) {
                    continue;
                }
                let at = r * d;
                if let Some(o) = wv.get_mut(at..at + d) {
                    rule.apply(o, gr, s, at);
                }
            }
        }
        ParamGrad::Rows(rows) if rows.shape()[1] == row && rows.shape()[0] * row == n => {
            // Every row moves (weight decay, or Adam's moments): a row without a gradient takes
            // a zero one, row by row, as from a dense gradient — which for SST's embedding
            // would be a 22 MB table zeroed, scattered into and read back at every step.
            let mut present: Vec<(usize, &[f32])> = rows.iter().collect();
            present.sort_unstable_by_key(|&(r, _)| r);
            let zeros = vec![0f32; row];
            let mut present = present.into_iter().peekable();
            for (r, o) in wv.chunks_mut(row).enumerate() {
                let g = match present.next_if(|&(p, _)| p == r) {
                    Some((_, g)) => g,
                    None => &zeros,
                };
                rule.apply(o, g, s, r * row);
            }
        }
        _ => {
            let dense;
            let gt = match g {
                ParamGrad::Dense(t) => t,
                ParamGrad::Rows(r) => {
                    dense = r.to_dense()?;
                    &dense
                }
            };
            let g32 = gt.cast(tumble_ir::DType::Float32);
            let gv = g32
                .as_slice::<f32>()
                .ok_or("internal: optimizer operands are not float")?;
            if gv.len() != n {
                return Err("internal: gradient and parameter sizes differ".into());
            }
            for (r, (o, g)) in wv.chunks_mut(row).zip(gv.chunks(row)).enumerate() {
                if sparse && g.iter().all(|&v| v == 0.0) {
                    continue;
                }
                rule.apply(o, g, s, r * row);
            }
        }
    }
    Ok(())
}

/// The optimizer's moments for `n` weights, zero, made at the first step: the second moments
/// always, the first only for Adam (Adagrad's would be a second table the size of the
/// embedding's, never read).
fn moments<T: Clone + Default>(opt: Optimizer, n: usize, m: &mut Vec<T>, v: &mut Vec<T>) {
    // SGD keeps no state; Adagrad its sums of squares; Adam both moments.
    let (m_len, v_len) = match opt {
        Optimizer::Sgd => (0, 0),
        Optimizer::Adagrad => (0, n),
        Optimizer::Adam => (n, n),
    };
    if v.len() != v_len || m.len() != m_len {
        *m = written(m_len);
        *v = written(v_len);
    }
}

/// `n` default values, written now: `vec![0.0; n]` maps zero pages lazily, and a sparse update
/// would fault them in one by one during training.
fn written<T: Clone + Default>(n: usize) -> Vec<T> {
    let mut v = Vec::with_capacity(n);
    v.resize(n, T::default());
    v
}

impl Slot {
    /// The state `opt` keeps for parameter `w`, made now (see `train`), once the memory budget
    /// has room for it (Adam's two moments of a large table were allocated past `--max-memory`,
    /// and the next check blamed an instance for the overrun).
    pub(super) fn prepare(
        &mut self,
        opt: Optimizer,
        w: &Tensor,
    ) -> Result<(), tumble_limits::Stop> {
        let tables = match opt {
            Optimizer::Sgd => 0,
            Optimizer::Adagrad => 1,
            Optimizer::Adam => 2,
        };
        // Moments in the weight's own float width (f32 for f32 weights, f64 for f64 ones).
        let bytes = w.len().saturating_mul(w.dtype().size());
        tumble_limits::reserve(bytes.saturating_mul(tables))?;
        if w.dtype() == tumble_ir::DType::Float64 {
            moments(opt, w.len(), &mut self.m64, &mut self.v64);
        } else {
            moments(opt, w.len(), &mut self.m, &mut self.v);
        }
        Ok(())
    }
}

/// [`step`] for an f64 parameter: the same rules in f64 (`optim::update_f64`), with f64 moments
/// (through the f32 path every update rounded the weights to f32: an f64 model trained at f32
/// precision).
fn step_f64(h: StepSettings, w: &mut Tensor, g: &ParamGrad, s: &mut Slot) -> Result<(), String> {
    let n = w.len();
    moments(h.opt, n, &mut s.m64, &mut s.v64);
    let dense;
    let gt = match g {
        ParamGrad::Dense(t) => t,
        ParamGrad::Rows(r) => {
            dense = r.to_dense()?;
            &dense
        }
    };
    let gv = gt.to_f64_vec();
    let Some(wv) = w.make_mut_slice::<f64>() else {
        return Err("internal: an f64 parameter's values are not f64".into());
    };
    if gv.len() != n || wv.len() != n {
        return Err("internal: gradient and parameter sizes differ".into());
    }
    let rule = match h.opt {
        Optimizer::Sgd => optim::Rule::Sgd,
        Optimizer::Adagrad => optim::Rule::Adagrad,
        Optimizer::Adam => optim::Rule::Adam,
    };
    optim::update_f64(
        rule,
        wv,
        &gv,
        &mut s.m64,
        &mut s.v64,
        (h.lr, h.decay, h.scale),
        h.t,
    );
    Ok(())
}

/// One optimizer's update of a run of weights.
struct Rule {
    opt: Optimizer,
    step: Step,
    adam: optim::Adam,
}

impl Rule {
    fn new(h: StepSettings) -> Self {
        Rule {
            opt: h.opt,
            step: Step {
                lr: h.lr as f32,
                decay: h.decay as f32,
                scale: h.scale as f32,
            },
            adam: optim::Adam::at_step(h.t),
        }
    }

    /// Updates the weights `o` (elements `at..` of the parameter) by their gradient `g`.
    fn apply(&self, o: &mut [f32], g: &[f32], s: &mut Slot, at: usize) {
        let end = at + g.len();
        match self.opt {
            Optimizer::Sgd => optim::sgd(o, g, self.step),
            Optimizer::Adagrad => optim::adagrad(o, g, &mut s.v[at..end], self.step),
            Optimizer::Adam => optim::adam(
                o,
                g,
                &mut s.m[at..end],
                &mut s.v[at..end],
                self.step,
                self.adam,
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tumble_runtime::backward::RowGrad;

    /// A row gradient updates only its rows, with exactly the dense update's bits, under every
    /// optimizer and with weight decay (where it updates every row through the dense path).
    #[test]
    fn a_row_gradient_steps_like_its_dense_form() {
        let (n, d) = (7, 5);
        let w0 = Tensor::from_vec(
            vec![n, d],
            (0..n * d).map(|i| (i as f32 * 0.37).sin()).collect(),
        )
        .unwrap();
        let mut rows = RowGrad::new(n, d).unwrap();
        rows.add_row(5, &[0.5, -1.0, 0.25, 2.0, -0.125]);
        rows.add_row(2, &[0.0; 5]); // listed, but zero: skipped like a zero dense row
        rows.add_row(0, &[1.5, 1.0, -0.5, 0.75, 0.1]);
        let dense = ParamGrad::Dense(rows.to_dense().unwrap());
        let sparse = ParamGrad::Rows(rows);
        for opt in [Optimizer::Sgd, Optimizer::Adagrad, Optimizer::Adam] {
            for decay in [0.0, 0.01] {
                let (mut a, mut b) = (w0.clone(), w0.clone());
                let new_slot = Slot::default;
                let (mut sa, mut sb) = (new_slot(), new_slot());
                for t in 1..=3 {
                    let h = StepSettings {
                        opt,
                        lr: 0.1,
                        decay,
                        t,
                        scale: 0.5,
                    };
                    step(h, &mut a, &dense, &mut sa).unwrap();
                    step(h, &mut b, &sparse, &mut sb).unwrap();
                }
                assert_eq!(a.as_f32(), b.as_f32(), "{opt:?} decay {decay}");
                assert_eq!(sa.v, sb.v, "{opt:?} decay {decay}");
                let moved: Vec<usize> = (0..n)
                    .filter(|&r| a.row(r).unwrap().as_f32() != w0.row(r).unwrap().as_f32())
                    .collect();
                // (Adam's moments of a never-nonzero row stay 0: it does not move either.)
                if decay == 0.0 {
                    assert_eq!(moved, vec![0, 5], "{opt:?}: only the nonzero rows move");
                } else {
                    assert_eq!(moved.len(), n, "{opt:?} decay {decay}: every row moves");
                }
            }
        }
        // The step does not write through to another holder of the weights.
        let mut held = w0.clone();
        let mut s = Slot::default();
        let h = StepSettings {
            opt: Optimizer::Sgd,
            lr: 0.1,
            decay: 0.0,
            t: 1,
            scale: 1.0,
        };
        step(h, &mut held, &sparse, &mut s).unwrap();
        assert_ne!(held.as_f32(), w0.as_f32());
        assert_eq!(w0.as_f32().unwrap()[0], 0.0);
    }
}
