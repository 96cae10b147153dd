//! The adjoints (output gradients) of the recorded nodes while the backward walks the launches
//! in reverse. A node's output is a row of its launch's batched output, so its adjoint is kept
//! the same way: one f32 buffer per launch and output, with a row per node. A consumer adds a
//! row's gradient in place (no tensor per row, no map entry), and the launch's own backward
//! reads all its rows' output gradients as one tensor, rows without a gradient already zero.
//! Outputs that are not rows of an f32 launch output keep per-node tensors in a map.

use crate::intern::WordMap;

use tumble_interp::tape::accumulate;
use tumble_interp::{LazyRef, RunError};
use tumble_tensor::Tensor;

use super::internal;
use crate::dfg::{Arg, Dfg, Twins};

const NOT_LAUNCHED: u32 = u32::MAX;

pub(super) struct Adjoints {
    /// Per node id: the launch (index into the launch log) that computed it and its row there.
    at: Vec<(u32, u32)>,
    /// Per launch: its number of rows.
    rows: Vec<usize>,
    /// Per launch, per output: the gradient of every row, made zero on the first gradient added
    /// to any of them.
    bufs: Vec<Vec<Option<OutGrad>>>,
    /// Gradients that do not fit a launch buffer (another dtype, a node outside the log).
    other: WordMap<LazyRef, Tensor>,
    /// Nodes that took an identical invocation's results: a gradient of one is added to that
    /// invocation's, so the launch differentiates their sum once.
    twins: Twins,
    /// Gradients of deferred sums' terms that are values, not nodes (a parameter, a literal):
    /// the backward hands them to the parameters ([`Adjoints::take_value_grads`]).
    value_grads: Vec<(Tensor, Tensor)>,
}

/// The gradient of one launch output: `rows × row length` floats, and the shape of a row, read
/// from the forward value once when the buffer is made (every row of a launch output has it).
/// A row's first gradient is copied in and later ones added, so the buffer is not zero-filled
/// first (a memset of every launch output's gradient, 1.4% of a training step's instructions);
/// the rows no consumer reached are zeroed when the gradient is taken.
struct OutGrad {
    data: Vec<f32>,
    row_shape: Vec<usize>,
    written: Vec<bool>,
}

impl OutGrad {
    /// The buffer with every row written (rows never reached are zeros), and a row's shape.
    fn into_parts(self) -> (Vec<f32>, Vec<usize>) {
        let OutGrad {
            mut data,
            written,
            row_shape,
        } = self;
        let len = data.len() / written.len().max(1);
        for (row, done) in written.iter().enumerate() {
            if !done {
                if let Some(r) = data.get_mut(row * len..(row + 1) * len) {
                    r.fill(0.0);
                }
            }
        }
        (data, row_shape)
    }
}

impl Adjoints {
    /// `twins`: a node that took another's results has its gradients added to that one's row.
    pub(super) fn new(nodes: usize, log: &[Vec<u32>], twins: Twins) -> Self {
        let mut at = vec![(NOT_LAUNCHED, 0); nodes];
        for (l, ids) in log.iter().enumerate() {
            for (row, &id) in ids.iter().enumerate() {
                if let Some(slot) = at.get_mut(id as usize) {
                    *slot = (l as u32, row as u32);
                }
            }
        }
        for (dup, rep) in twins.aliases() {
            if let (Some(&place), Some(_)) = (at.get(rep as usize), at.get(dup as usize)) {
                at[dup as usize] = place;
            }
        }
        Adjoints {
            at,
            rows: log.iter().map(Vec::len).collect(),
            bufs: log.iter().map(|_| Vec::new()).collect(),
            other: WordMap::default(),
            twins,
            value_grads: Vec::new(),
        }
    }

    /// The gradients of value terms of deferred sums added since the last call, with the value
    /// each is the gradient of.
    pub(super) fn take_value_grads(&mut self) -> Vec<(Tensor, Tensor)> {
        std::mem::take(&mut self.value_grads)
    }

    /// Adds gradient `g` to output `r`.
    pub(super) fn add(&mut self, dfg: &Dfg, r: LazyRef, g: Tensor) -> Result<(), RunError> {
        let r = LazyRef {
            node: self.twins.canonical(r.node),
            ..r
        };
        // A deferred sum is linear in its terms: its adjoint is each term's.
        if let Some(terms) = dfg.sum_terms(r.node) {
            for t in terms {
                match t {
                    Arg::Lazy(tr) => self.add(dfg, *tr, g.clone())?,
                    Arg::Val(v) => self.value_grads.push((v.clone(), g.clone())),
                }
            }
            return Ok(());
        }
        if let Some(v) = g.as_f32() {
            if self.add_f32(dfg, r, v, g.shape()) {
                return Ok(());
            }
        }
        let mut slot = self.other.remove(&r);
        accumulate(&mut slot, g).map_err(internal)?;
        if let Some(v) = slot {
            self.other.insert(r, v);
        }
        Ok(())
    }

    /// Adds the f32 gradient `v` of shape `shape` to output `r` in its launch's buffer; false
    /// (nothing changed) where `r` is not a row of an f32 launch output of that shape.
    pub(super) fn add_f32(&mut self, dfg: &Dfg, r: LazyRef, v: &[f32], shape: &[usize]) -> bool {
        if dfg.sum_terms(r.node).is_some() {
            // Through `add`, which hands it to the sum's terms.
            return false;
        }
        let Some(&(l, row)) = self.at.get(r.node as usize) else {
            return false;
        };
        if l == NOT_LAUNCHED {
            return false;
        }
        let (l, o, len) = (l as usize, r.output as usize, v.len());
        let (Some(&b), Some(outs)) = (self.rows.get(l), self.bufs.get_mut(l)) else {
            return false;
        };
        if outs.len() <= o {
            outs.resize_with(o + 1, || None);
        }
        let Some(slot) = outs.get_mut(o) else {
            return false;
        };
        // The forward value is looked at once per launch output, not per row added.
        let grad = match slot {
            Some(g) if g.row_shape == shape => g,
            Some(_) => return false,
            None => match dfg.f32_view(r) {
                Some((_, out_shape)) if out_shape == shape => slot.insert(OutGrad {
                    data: tumble_tensor::pool::scratch_f32(b * len),
                    row_shape: shape.to_vec(),
                    written: vec![false; b],
                }),
                _ => return false,
            },
        };
        let at = row as usize * len;
        let (Some(dst), Some(done)) = (
            grad.data.get_mut(at..at + len),
            grad.written.get_mut(row as usize),
        ) else {
            return false;
        };
        if !*done {
            *done = true;
            dst.copy_from_slice(v);
            return true;
        }
        // On the vector loops: a row per consumer, 2.3% of a TreeLSTM training step at SSE2 width.
        crate::simd::update(dst, v, |a, x| a + x);
        true
    }

    /// The gradient of output `o` of launch `l` (nodes `ids`), all rows stacked, zeros for rows
    /// without one; `None` when no row has one. Taken: the launch is differentiated once.
    pub(super) fn take_output(
        &mut self,
        dfg: &Dfg,
        l: usize,
        ids: &[u32],
        o: usize,
    ) -> Result<Option<Tensor>, RunError> {
        let buf = self
            .bufs
            .get_mut(l)
            .and_then(|outs| outs.get_mut(o))
            .and_then(Option::take);
        let mut extra: Vec<(usize, Tensor)> = Vec::new();
        if !self.other.is_empty() {
            for (row, &id) in ids.iter().enumerate() {
                let r = LazyRef {
                    node: id,
                    output: o as u32,
                };
                if let Some(g) = self.other.remove(&r) {
                    extra.push((row, g));
                }
            }
        }
        let b = ids.len();
        let value_of = |id: u32| -> Result<Tensor, RunError> {
            dfg.concrete(LazyRef {
                node: id,
                output: o as u32,
            })?
            .ok_or_else(|| internal("output not computed"))
        };
        if extra.is_empty() {
            let Some((data, row_shape)) = buf.map(OutGrad::into_parts) else {
                return Ok(None);
            };
            let mut shape = vec![b];
            shape.extend_from_slice(&row_shape);
            return Tensor::from_vec(shape, data).map(Some).map_err(internal);
        }
        // Rows with gradients of other forms: per row, summed, then stacked.
        let mut rows: Vec<Option<Tensor>> = vec![None; b];
        if let Some((data, row_shape)) = buf.map(OutGrad::into_parts) {
            let len = data.len() / b.max(1);
            for (row, slot) in rows.iter_mut().enumerate() {
                let part = data.get(row * len..(row + 1) * len).unwrap_or_default();
                *slot = Some(Tensor::from_vec(row_shape.clone(), part.to_vec()).map_err(internal)?);
            }
        }
        for (row, g) in extra {
            if let Some(slot) = rows.get_mut(row) {
                accumulate(slot, g).map_err(internal)?;
            }
        }
        let mut full = Vec::with_capacity(b);
        for (row, g) in rows.into_iter().enumerate() {
            full.push(match g {
                Some(g) => g,
                None => {
                    let t = value_of(ids[row])?;
                    Tensor::zeros(t.shape().to_vec(), t.dtype()).map_err(internal)?
                }
            });
        }
        let refs: Vec<&Tensor> = full.iter().collect();
        Tensor::stack(&refs).map(Some).map_err(internal)
    }
}
