//! A parameter's gradient as the backward produces it: dense, or — for an embedding table read
//! by `take` — only the rows the mini-batch looked up. A TreeLSTM's 21,703 × 256 table gets a
//! few hundred rows' gradient per mini-batch; a dense one would be a 22 MB zeroed allocation
//! per step, scanned again by the optimizer. The optimizer updates the listed rows only where
//! that is exact (see `tumble train`), and [`ParamGrad::add_into`] densifies for `tumble grad`.

use crate::intern::WordMap;

use tumble_interp::tape::accumulate;
use tumble_tensor::Tensor;

/// A gradient that is zero outside some rows of a 2-D f32 parameter (rows, width).
#[derive(Clone, Debug)]
pub struct RowGrad {
    rows_total: usize,
    width: usize,
    /// The rows with a gradient, in the order they were first added.
    rows: Vec<u32>,
    /// `rows.len() × width` values, row `k` for `rows[k]`.
    values: Vec<f32>,
    /// Row id → its position in `rows`.
    at: WordMap<u32, u32>,
}

impl RowGrad {
    /// An all-zero gradient of a `(rows_total, width)` parameter; `None` if a row id would not
    /// fit 32 bits.
    pub fn new(rows_total: usize, width: usize) -> Option<Self> {
        u32::try_from(rows_total).ok()?;
        Some(RowGrad {
            rows_total,
            width,
            rows: Vec::new(),
            values: Vec::new(),
            at: WordMap::default(),
        })
    }

    /// The parameter's shape.
    pub fn shape(&self) -> [usize; 2] {
        [self.rows_total, self.width]
    }

    /// Adds `g` (`width` values) to row `row`; false (nothing changed) when out of range.
    pub fn add_row(&mut self, row: usize, g: &[f32]) -> bool {
        if row >= self.rows_total || g.len() != self.width {
            return false;
        }
        let id = row as u32;
        let k = match self.at.get(&id) {
            Some(&k) => k as usize,
            None => {
                let k = self.rows.len();
                self.at.insert(id, k as u32);
                self.rows.push(id);
                self.values.resize(self.values.len() + self.width, 0.0);
                k
            }
        };
        if let Some(dst) = self.values.get_mut(k * self.width..(k + 1) * self.width) {
            add_slice(dst, g);
        }
        true
    }

    /// The rows with a gradient and their values, in first-added order.
    pub fn iter(&self) -> impl Iterator<Item = (usize, &[f32])> {
        self.rows
            .iter()
            .zip(self.values.chunks_exact(self.width.max(1)))
            .map(|(&r, v)| (r as usize, v))
    }

    /// How many rows have a gradient.
    pub fn len(&self) -> usize {
        self.rows.len()
    }

    pub fn is_empty(&self) -> bool {
        self.rows.is_empty()
    }

    /// Adds this gradient into the dense f32 tensor `dst` of the same shape.
    fn scatter_into(&self, dst: &mut Tensor) -> Result<(), String> {
        if dst.shape() != self.shape() {
            return Err(format!(
                "internal: row gradient of shape {:?} added to one of shape {:?}",
                self.shape(),
                dst.shape()
            ));
        }
        let d = self.width;
        let out = dst
            .make_mut_slice::<f32>()
            .ok_or("internal: row gradient added to a tensor that is not float32")?;
        for (r, v) in self.iter() {
            if let Some(dst) = out.get_mut(r * d..(r + 1) * d) {
                add_slice(dst, v);
            }
        }
        Ok(())
    }

    /// The dense gradient (zeros outside the rows).
    pub fn to_dense(&self) -> Result<Tensor, String> {
        let mut t = Tensor::from_vec(
            self.shape().to_vec(),
            vec![0f32; self.rows_total * self.width],
        )
        .map_err(|e| e.to_string())?;
        self.scatter_into(&mut t)?;
        Ok(t)
    }
}

/// One parameter's gradient from [`super::grad_batch`].
#[derive(Clone, Debug)]
pub enum ParamGrad {
    Dense(Tensor),
    /// Zero outside the listed rows (an embedding table's gradient).
    Rows(RowGrad),
}

/// `g` added into `dst`, element by element.
fn add_slice(dst: &mut [f32], g: &[f32]) {
    for (a, v) in dst.iter_mut().zip(g) {
        *a += v;
    }
}

impl ParamGrad {
    /// Adds `g` (a row of the parameter's width per id) to rows `ids` of the gradient in `slot`
    /// of a `shape` parameter: into a [`RowGrad`] made on first use, or into the dense gradient
    /// already there. False (nothing changed) where the slot holds a gradient of another shape
    /// or dtype; ids must be in range.
    pub(super) fn add_rows(
        slot: &mut Option<ParamGrad>,
        shape: [usize; 2],
        ids: &[usize],
        g: &[f32],
    ) -> bool {
        let [n, d] = shape;
        if d == 0 || g.len() != ids.len() * d {
            return false;
        }
        if slot.is_none() {
            *slot = RowGrad::new(n, d).map(ParamGrad::Rows);
        }
        match slot {
            Some(ParamGrad::Rows(rows)) if rows.shape() == shape => {
                for (&i, gr) in ids.iter().zip(g.chunks_exact(d)) {
                    rows.add_row(i, gr);
                }
                true
            }
            Some(ParamGrad::Dense(t)) if t.shape() == shape => {
                let Some(out) = t.make_mut_slice::<f32>() else {
                    return false;
                };
                for (&i, gr) in ids.iter().zip(g.chunks_exact(d)) {
                    if let Some(dst) = out.get_mut(i * d..(i + 1) * d) {
                        add_slice(dst, gr);
                    }
                }
                true
            }
            _ => false,
        }
    }

    /// Whether every element is finite (a float gradient; other dtypes have no gradient).
    pub fn is_finite(&self) -> bool {
        match self {
            // (Chunked scans without a branch per element: a short-circuiting scan of every
            // weight's gradient after every mini-batch was 1.3% of a TreeLSTM's training.)
            ParamGrad::Dense(t) => t.all_finite(),
            ParamGrad::Rows(r) => r.iter().all(|(_, v)| tumble_tensor::all_finite_f32(v)),
        }
    }

    /// The gradient as one tensor.
    pub fn into_dense(self) -> Result<Tensor, String> {
        match self {
            ParamGrad::Dense(t) => Ok(t),
            ParamGrad::Rows(r) => r.to_dense(),
        }
    }

    /// The sum of two gradients of one parameter (computed on different instances): row
    /// gradients stay rows, anything else is summed dense.
    pub fn merge(self, other: ParamGrad) -> Result<ParamGrad, String> {
        match (self, other) {
            (ParamGrad::Rows(mut a), ParamGrad::Rows(b)) if a.shape() == b.shape() => {
                for (r, g) in b.iter() {
                    if !a.add_row(r, g) {
                        return Err("internal: row gradients of different widths merged".into());
                    }
                }
                Ok(ParamGrad::Rows(a))
            }
            (ParamGrad::Rows(a), b) | (b, ParamGrad::Rows(a)) => {
                let mut sum = Some(b.into_dense()?);
                ParamGrad::Rows(a).add_into(&mut sum)?;
                sum.map(ParamGrad::Dense)
                    .ok_or_else(|| "internal: empty gradient sum".to_string())
            }
            (ParamGrad::Dense(a), ParamGrad::Dense(b)) => {
                let mut sum = Some(a);
                accumulate(&mut sum, b)?;
                sum.map(ParamGrad::Dense)
                    .ok_or_else(|| "internal: empty gradient sum".to_string())
            }
        }
    }

    /// Adds this gradient into a dense sum (`None`: nothing summed yet).
    pub fn add_into(self, sum: &mut Option<Tensor>) -> Result<(), String> {
        match (self, sum.as_mut()) {
            (ParamGrad::Rows(r), Some(t)) if t.as_f32().is_some() => r.scatter_into(t),
            (g, _) => accumulate(sum, g.into_dense()?),
        }
    }
}

/// Adds a dense gradient `g` into a parameter's gradient slot (a row gradient there is made
/// dense first: the sum is no longer confined to rows).
pub(super) fn add_dense(slot: &mut Option<ParamGrad>, g: Tensor) -> Result<(), String> {
    let mut dense = match slot.take() {
        None => None,
        Some(ParamGrad::Dense(t)) => Some(t),
        Some(ParamGrad::Rows(r)) => Some(r.to_dense()?),
    };
    accumulate(&mut dense, g)?;
    *slot = dense.map(ParamGrad::Dense);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_sum_like_the_dense_scatter() {
        let mut r = RowGrad::new(5, 3).unwrap();
        assert!(r.add_row(4, &[1.0, 2.0, 3.0]));
        assert!(r.add_row(1, &[0.5, 0.5, 0.5]));
        assert!(r.add_row(4, &[1.0, 1.0, 1.0]));
        assert!(!r.add_row(5, &[1.0, 1.0, 1.0]), "row past the end");
        assert!(!r.add_row(0, &[1.0]), "wrong width");
        assert_eq!(r.len(), 2);
        let d = r.to_dense().unwrap();
        assert_eq!(d.shape(), &[5, 3]);
        assert_eq!(
            d.as_f32().unwrap(),
            &[0., 0., 0., 0.5, 0.5, 0.5, 0., 0., 0., 0., 0., 0., 2., 3., 4.]
        );
        // Into a dense sum: scattered where one exists, the dense tensor where none does.
        let mut sum = None;
        ParamGrad::Rows(r.clone()).add_into(&mut sum).unwrap();
        ParamGrad::Rows(r.clone()).add_into(&mut sum).unwrap();
        assert_eq!(sum.unwrap().as_f32().unwrap()[12..], [4., 6., 8.]);
        // A dense gradient added to a row gradient makes it dense.
        let mut slot = Some(ParamGrad::Rows(r));
        add_dense(
            &mut slot,
            Tensor::from_vec(vec![5, 3], vec![1f32; 15]).unwrap(),
        )
        .unwrap();
        match slot {
            Some(ParamGrad::Dense(t)) => assert_eq!(t.as_f32().unwrap()[0..3], [1., 1., 1.]),
            other => panic!("expected a dense gradient, got {other:?}"),
        }
    }

    fn rows(entries: &[(usize, [f32; 2])]) -> RowGrad {
        let mut r = RowGrad::new(4, 2).unwrap();
        for (i, g) in entries {
            r.add_row(*i, g);
        }
        r
    }

    /// Two parts' gradients of one parameter sum to the whole one's, rows staying rows.
    #[test]
    fn merged_gradients_are_the_sum() {
        let a = rows(&[(1, [1.0, 2.0]), (3, [0.5, 0.5])]);
        let b = rows(&[(3, [1.5, -0.5]), (0, [4.0, 4.0])]);
        let want = [4.0, 4.0, 1.0, 2.0, 0.0, 0.0, 2.0, 0.0];
        let merged = ParamGrad::Rows(a.clone())
            .merge(ParamGrad::Rows(b.clone()))
            .unwrap();
        assert!(matches!(&merged, ParamGrad::Rows(r) if r.len() == 3));
        assert_eq!(merged.into_dense().unwrap().as_f32().unwrap(), want);
        // Rows with a dense gradient, either way round, and two dense ones.
        let dense_b = ParamGrad::Dense(b.to_dense().unwrap());
        let m = ParamGrad::Rows(a.clone()).merge(dense_b.clone()).unwrap();
        assert_eq!(m.into_dense().unwrap().as_f32().unwrap(), want);
        let m = dense_b.merge(ParamGrad::Rows(a.clone())).unwrap();
        assert_eq!(m.into_dense().unwrap().as_f32().unwrap(), want);
        let m = ParamGrad::Dense(a.to_dense().unwrap())
            .merge(ParamGrad::Dense(b.to_dense().unwrap()))
            .unwrap();
        assert_eq!(m.into_dense().unwrap().as_f32().unwrap(), want);
        // Different shapes are an internal error, not a wrong sum.
        let other = RowGrad::new(4, 3).unwrap();
        assert!(ParamGrad::Rows(a).merge(ParamGrad::Rows(other)).is_err());
    }
}
