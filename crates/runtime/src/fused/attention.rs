//! Scaled dot-product attention as one kernel over instances of different lengths
//! ([`tumble_compile::attention`]): each instance's Q, K and V rows read where the launch's
//! row-wise segment left them, `(L, heads, width)` each, and its output written as
//! `(L, heads, width)` rows, so the transposes of the written form never happen and instances of
//! every length share one call instead of one batched call per group of equal length.
//!
//! Per instance and head `h`, row `a` of the output is `Σ_b p_b · v[b, h]` with
//! `p = softmax_b(scale · (q[a, h] · k[b, h]))`, four query rows at a time: their scores against
//! the head's keys transposed once (vectors over `b`, no horizontal sums), each row's softmax by
//! the row programs' own ([`super::rowexec::softmax_row`]: the same bits), then their outputs;
//! nothing of size `L × L` per head is ever stored.

use super::rowexec::softmax_row;
use crate::simd::{self, isa, Isa};

/// Where one head of one instance lies: `len` rows of `row` floats, the head's `width` floats
/// from `off` in each; the scores' `scale`.
#[derive(Clone, Copy)]
pub(crate) struct Head {
    len: usize,
    row: usize,
    off: usize,
    width: usize,
    scale: f32,
}

/// Lanes of the score and output accumulators: one AVX-512 register of f32, kept in a register
/// across the whole sum (a sum through memory would wait on its own stores).
const LANES: usize = 16;

/// `n` rounded up to whole [`LANES`].
fn padded(n: usize) -> usize {
    n.div_ceil(LANES) * LANES
}

/// Query rows computed together: each key (and value) vector loaded is used by this many rows,
/// their accumulators held in registers.
const ROWS: usize = 4;

simd::dispatched! {
    /// One head of one instance: `scratch.kt` (`width × padded(len)`) takes the head's keys
    /// transposed, zero-padded, so that a query row's scores are sums of `width` vectors of
    /// keys (no horizontal sums); `scratch.s` and `scratch.p` (`ROWS × padded(len)` each)
    /// [`ROWS`] query rows' scaled scores and their probabilities.
    pub fn attend_head(q: &[f32], k: &[f32], v: &[f32], out: &mut [f32], h: Head, scratch: &mut Scratch) -> () {
        let Head { len, row, off, width, scale } = h;
        let lp = padded(len);
        let Scratch { kt, s, p } = scratch;
        let (kt, s, p) = (&mut kt[..width * lp], &mut s[..ROWS * lp], &mut p[..ROWS * lp]);
        kt.fill(0.0);
        for b in 0..len {
            let kb = &k[b * row + off..b * row + off + width];
            for (j, &x) in kb.iter().enumerate() {
                kt[j * lp + b] = x;
            }
        }
        let full = width / LANES * LANES;
        let mut a = 0;
        while a < len {
            let rows = ROWS.min(len - a);
            // Rows past the last repeat it: the same work, their results never stored.
            let qrow = |i: usize| {
                let r = a + i.min(rows - 1);
                &q[r * row + off..r * row + off + width]
            };
            let qs = [qrow(0), qrow(1), qrow(2), qrow(3)];
            for c in 0..lp / LANES {
                let mut acc = [[0f32; LANES]; ROWS];
                let qj = qs[0].iter().zip(qs[1]).zip(qs[2].iter().zip(qs[3]));
                for (kr, ((&x0, &x1), (&x2, &x3))) in kt.chunks_exact(lp).zip(qj) {
                    let kr = &kr[c * LANES..c * LANES + LANES];
                    for (acc, x) in acc.iter_mut().zip([x0, x1, x2, x3]) {
                        for (t, &kk) in acc.iter_mut().zip(kr) {
                            *t += x * kk;
                        }
                    }
                }
                // The written form's `multiply` by the scale, on the finished products.
                for (i, acc) in acc.iter().enumerate() {
                    let si = &mut s[i * lp + c * LANES..i * lp + c * LANES + LANES];
                    for (x, &y) in si.iter_mut().zip(acc) {
                        *x = y * scale;
                    }
                }
            }
            for i in 0..rows {
                softmax_row(&mut p[i * lp..i * lp + len], &s[i * lp..i * lp + len], false);
            }
            // The output rows, LANES columns at a time, each summed over the keys in registers.
            let (p0, rest) = p.split_at(lp);
            let (p1, rest) = rest.split_at(lp);
            let (p2, p3) = rest.split_at(lp);
            for c in (0..full).step_by(LANES) {
                let mut acc = [[0f32; LANES]; ROWS];
                let pb = p0.iter().zip(p1).zip(p2.iter().zip(p3));
                for (vrow, ((&p0, &p1), (&p2, &p3))) in v.chunks_exact(row).take(len).zip(pb) {
                    let vb = &vrow[off + c..off + c + LANES];
                    for (acc, p) in acc.iter_mut().zip([p0, p1, p2, p3]) {
                        for (t, &y) in acc.iter_mut().zip(vb) {
                            *t += p * y;
                        }
                    }
                }
                for (i, acc) in acc.iter().enumerate().take(rows) {
                    let at = (a + i) * row + off + c;
                    out[at..at + LANES].copy_from_slice(acc);
                }
            }
            for i in 0..rows {
                let at = (a + i) * row + off;
                for j in full..width {
                    out[at + j] = (0..len).map(|b| p[i * lp + b] * v[b * row + off + j]).sum();
                }
            }
            a += rows;
        }
    }
}

/// Per-thread scratch of [`attend`]: the transposed keys, scores and probabilities.
#[derive(Default)]
pub(crate) struct Scratch {
    kt: Vec<f32>,
    s: Vec<f32>,
    p: Vec<f32>,
}

/// One instance: `q`, `k`, `v` and `out` hold its `len` rows of `heads · width` floats each.
/// `scratch` holds the transposed keys and [`ROWS`] rows' scores and probabilities (resized
/// here).
#[allow(clippy::too_many_arguments)]
pub(crate) fn attend(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    out: &mut [f32],
    len: usize,
    heads: usize,
    width: usize,
    scale: f32,
    scratch: &mut Scratch,
) -> Result<(), String> {
    let row = heads * width;
    let n = len * row;
    if q.len() != n || k.len() != n || v.len() != n || out.len() != n {
        return Err(format!(
            "internal: attention operands of {}, {}, {} and {} floats for {len} rows of {row}",
            q.len(),
            k.len(),
            v.len(),
            out.len()
        ));
    }
    scratch.kt.resize(width * padded(len), 0.0);
    scratch.s.resize(ROWS * padded(len), 0.0);
    scratch.p.resize(ROWS * padded(len), 0.0);
    for h in 0..heads {
        let head = Head {
            len,
            row,
            off: h * width,
            width,
            scale,
        };
        attend_head(q, k, v, out, head, scratch);
    }
    Ok(())
}

/// Work below which the instances are not split across threads (as `gemm::small_products`).
const SPLIT_MIN_MACS: usize = 1 << 20;

/// One instance's Q, K and V rows.
pub(crate) type Qkv<'a> = (&'a [f32], &'a [f32], &'a [f32]);

/// Every instance of a launch: instance `i` has `lens[i]` rows, its Q, K and V rows are
/// `qkv[i]`, and its output rows follow the previous instance's in `out`. On up to `threads`
/// threads (contiguous runs of instances of about equal work) when worth it.
pub(crate) fn attend_all(
    lens: &[usize],
    qkv: &[Qkv],
    out: &mut [f32],
    (heads, width, scale): (usize, usize, f32),
    threads: usize,
) -> Result<(), String> {
    attend_split(
        lens,
        qkv,
        out,
        (heads, width, scale),
        threads,
        SPLIT_MIN_MACS,
    )
}

/// [`attend_all`], splitting across threads from `split_min` multiply-adds on.
fn attend_split(
    lens: &[usize],
    qkv: &[Qkv],
    out: &mut [f32],
    (heads, width, scale): (usize, usize, f32),
    threads: usize,
    split_min: usize,
) -> Result<(), String> {
    let row = heads * width;
    let work: Vec<usize> = lens.iter().map(|&l| 2 * l * l * row).collect();
    let total: usize = work.iter().sum();
    if qkv.len() != lens.len() {
        return Err("internal: attention operands of another count than the lengths".into());
    }
    let run = |from: usize, to: usize, out: &mut [f32]| -> Result<(), String> {
        let mut scratch = Scratch::default();
        let mut at = 0;
        for (&l, &(q, k, v)) in lens[from..to].iter().zip(&qkv[from..to]) {
            let o = out
                .get_mut(at..at + l * row)
                .ok_or("internal: attention output too short")?;
            attend(q, k, v, o, l, heads, width, scale, &mut scratch)?;
            at += l * row;
        }
        Ok(())
    };
    let threads = threads.min(lens.len()).max(1);
    if threads == 1 || total < split_min {
        return run(0, lens.len(), out);
    }
    // Contiguous runs of instances, each about `total / threads` of the work.
    let mut cuts = vec![0usize];
    let mut acc = 0;
    for (i, w) in work.iter().enumerate() {
        acc += w;
        if acc * threads >= total * cuts.len() && cuts.len() < threads && i + 1 < lens.len() {
            cuts.push(i + 1);
        }
    }
    cuts.push(lens.len());
    let mut rest = &mut *out;
    let mut tasks = Vec::with_capacity(cuts.len());
    for pair in cuts.windows(2) {
        let (from, to) = (pair[0], pair[1]);
        let rows: usize = lens[from..to].iter().sum();
        let (mine, later) = std::mem::take(&mut rest).split_at_mut(rows * row);
        rest = later;
        tasks.push((from, to, mine));
    }
    super::split_parts(threads, tasks, "attention", |(from, to, mine)| {
        run(from, to, mine)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The written form, element by element in f64: transposes, scores, softmax, products.
    fn reference(
        q: &[f32],
        k: &[f32],
        v: &[f32],
        len: usize,
        heads: usize,
        width: usize,
        scale: f32,
    ) -> Vec<f64> {
        let row = heads * width;
        let mut out = vec![0f64; len * row];
        for h in 0..heads {
            for a in 0..len {
                let s: Vec<f64> = (0..len)
                    .map(|b| {
                        (0..width)
                            .map(|j| {
                                q[a * row + h * width + j] as f64
                                    * k[b * row + h * width + j] as f64
                            })
                            .sum::<f64>()
                            * scale as f64
                    })
                    .collect();
                let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let e: Vec<f64> = s.iter().map(|x| (x - m).exp()).collect();
                let z: f64 = e.iter().sum();
                for j in 0..width {
                    out[a * row + h * width + j] = (0..len)
                        .map(|b| e[b] / z * v[b * row + h * width + j] as f64)
                        .sum();
                }
            }
        }
        out
    }

    fn data(n: usize, seed: usize) -> Vec<f32> {
        (0..n)
            .map(|i| (((i * 37 + seed * 11) % 101) as f32 / 50.0 - 1.0) * 1.3)
            .collect()
    }

    /// Odd lengths, heads and widths (widths not a multiple of the vector, a length of 1 and
    /// of 0), each instance against the element-by-element f64 form, on 1 and 3 threads.
    #[test]
    fn attention_of_instances_of_every_length_agrees_with_the_written_form() {
        for (heads, width) in [(1usize, 1usize), (2, 3), (3, 17), (12, 64), (4, 33)] {
            let lens = [1usize, 0, 5, 2, 9, 16, 17, 3];
            let row = heads * width;
            let total: usize = lens.iter().sum();
            let (q, k, v) = (
                data(total * row, 1),
                data(total * row, 2),
                data(total * row, 3),
            );
            let starts: Vec<usize> = lens
                .iter()
                .scan(0, |s, &l| {
                    let at = *s;
                    *s += l;
                    Some(at)
                })
                .collect();
            let qkv: Vec<Qkv> = (0..lens.len())
                .map(|i| {
                    let r = starts[i] * row..(starts[i] + lens[i]) * row;
                    (&q[r.clone()], &k[r.clone()], &v[r])
                })
                .collect();
            for threads in [1, 3] {
                let mut out = vec![f32::NAN; total * row];
                // Split from the first multiply-add on: the path `threads > 1` takes on real work.
                attend_split(&lens, &qkv, &mut out, (heads, width, 0.37), threads, 0).unwrap();
                for (i, &l) in lens.iter().enumerate() {
                    let r = starts[i] * row..(starts[i] + l) * row;
                    let want = reference(
                        &q[r.clone()],
                        &k[r.clone()],
                        &v[r.clone()],
                        l,
                        heads,
                        width,
                        0.37,
                    );
                    for (j, (&got, &w)) in out[r].iter().zip(&want).enumerate() {
                        assert!(
                            (got as f64 - w).abs() <= 1e-5 + 1e-5 * w.abs(),
                            "heads {heads} width {width} instance {i} element {j}: {got} vs {w}"
                        );
                    }
                }
            }
        }
    }

    /// Operands of the wrong size are an error, not a panic or a partial write.
    #[test]
    fn operands_of_the_wrong_size_are_refused() {
        let mut scratch = Scratch::default();
        let mut out = vec![0f32; 6];
        let e = attend(
            &[0.0; 6],
            &[0.0; 5],
            &[0.0; 6],
            &mut out,
            2,
            1,
            3,
            1.0,
            &mut scratch,
        );
        assert!(e.is_err());
    }
}
