//! Reference checks of the GEMM against a naive f64-accumulating product.
//!
//! Tolerance: the kernels accumulate in f32 over K (in K blocks, each a sequential FMA chain), so
//! the rounding error of one output is at most about `γ_K · Σ_k |a_ik| |w_jk|` with
//! `γ_K ≈ K · 2^-24` (≈ 1.5e-5 for K = 257). We allow `1e-4 · (1 + Σ|a||w|)`, above that bound for
//! every K used here (and far below any real indexing/packing bug, which is O(1) relative).

use std::collections::HashSet;
use std::ops::Range;
use std::sync::Mutex;
use tumble_kernels::*;

const SIZES: [usize; 8] = [1, 3, 7, 8, 33, 64, 255, 257];

mod common;
use common::Rng;

/// The `m` rows of a row-major `a` with `k` columns (possibly 0), as a gathered operand's
/// pointer list.
fn row_slices(a: &[f32], m: usize, k: usize) -> Vec<&[f32]> {
    (0..m).map(|i| &a[i * k..(i + 1) * k]).collect()
}

/// One operand pair of the reference: rows of A, W (N×K row-major), K.
type RefPart = (Vec<Vec<f32>>, Vec<f32>, usize);

/// Reference `C = Σ_parts A·Wᵀ` with f64 accumulation, and the error scale `Σ|a||w|`.
fn reference(parts: &[RefPart], m: usize, n: usize) -> (Vec<f64>, Vec<f64>) {
    let mut c = vec![0.0f64; m * n];
    let mut s = vec![0.0f64; m * n];
    for (rows, w, k) in parts {
        for i in 0..m {
            for j in 0..n {
                let (mut acc, mut mag) = (0.0f64, 0.0f64);
                for p in 0..*k {
                    let x = rows[i][p] as f64 * w[j * k + p] as f64;
                    acc += x;
                    mag += x.abs();
                }
                c[i * n + j] += acc;
                s[i * n + j] += mag;
            }
        }
    }
    (c, s)
}

fn check(got: &[f32], want: &[f64], scale: &[f64], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (idx, ((&g, &w), &s)) in got.iter().zip(want).zip(scale).enumerate() {
        let tol = 1e-4 * (1.0 + s);
        assert!(
            (g as f64 - w).abs() <= tol,
            "{what}: element {idx}: got {g}, want {w} (tol {tol})"
        );
    }
}

fn kinds() -> Vec<KernelKind> {
    KernelKind::ALL
        .into_iter()
        .filter(|k| k.is_available())
        .collect()
}

/// Run one dense with the given kind, contiguous or gathered A, and compare with the reference.
fn case(
    kind: KernelKind,
    m: usize,
    n: usize,
    k: usize,
    gathered: bool,
    threads: usize,
    rng: &mut Rng,
) {
    let w = rng.vec(n * k);
    let pw = PackedWeight::pack(&w, n, k).unwrap();
    let stride = k + if gathered { 0 } else { 3 };
    let mut c = vec![f32::NAN; m * n];
    let rows: Vec<Vec<f32>> = if gathered {
        // Rows scattered in a bigger buffer, in shuffled order; every 5th row aliases (reuses the
        // very same slice as) an earlier row.
        let pool: Vec<Vec<f32>> = (0..m + 2).map(|_| rng.vec(k)).collect();
        let mut idx: Vec<usize> = Vec::with_capacity(m);
        for i in 0..m {
            let pick = if i % 5 == 4 {
                idx[rng.below(i)]
            } else {
                rng.below(m + 2)
            };
            idx.push(pick);
        }
        let slices: Vec<&[f32]> = idx.iter().map(|&i| &pool[i][..]).collect();
        let a = Rows::Gathered(&slices);
        dense_with(kind, &a, &pw, &mut c, &NoEpilogue, threads).unwrap();
        idx.iter().map(|&i| pool[i].clone()).collect()
    } else {
        let data = rng.vec(m * stride);
        let a = Rows::Contiguous {
            data: &data,
            stride,
        };
        dense_with(kind, &a, &pw, &mut c, &NoEpilogue, threads).unwrap();
        (0..m)
            .map(|i| data[i * stride..i * stride + k].to_vec())
            .collect()
    };
    let (want, scale) = reference(&[(rows, w, k)], m, n);
    let what = format!(
        "{} m={m} n={n} k={k} gathered={gathered} threads={threads}",
        kind.name()
    );
    check(&c, &want, &scale, &what);
}

#[test]
fn all_m_and_n_with_small_k() {
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
    let kind = KernelKind::selected();
    for &m in &SIZES {
        for &n in &SIZES {
            for k in [1, 7] {
                case(kind, m, n, k, k == 7, 1, &mut rng);
            }
        }
    }
}

#[test]
fn all_k_with_small_m_and_n() {
    let mut rng = Rng(17);
    let kind = KernelKind::selected();
    for &k in &SIZES {
        for (m, n) in [(1, 1), (3, 7), (8, 33), (33, 64), (5, 40)] {
            case(kind, m, n, k, false, 1, &mut rng);
            case(kind, m, n, k, true, 1, &mut rng);
        }
    }
}

#[test]
fn every_micro_kernel_at_odd_sizes() {
    let mut rng = Rng(99);
    for kind in kinds() {
        for m in [1, 2, 3, 5, 7, 17, 33] {
            for n in [1, 7, 15, 16, 17, 33] {
                for k in [1, 7, 33] {
                    case(kind, m, n, k, (m + n + k) % 2 == 0, 1, &mut rng);
                }
            }
        }
        // Several M blocks, several K blocks (K > 256), a partial last panel.
        case(kind, 130, 40, 300, false, 1, &mut rng);
        case(kind, 130, 40, 300, true, 2, &mut rng);
        case(kind, 3, 70, 520, true, 1, &mut rng);
    }
}

#[test]
fn threads_do_not_change_results() {
    let mut rng = Rng(5);
    for kind in kinds() {
        // Large enough to run in parallel (≥ 8 MFLOP or a ≥ 1 MiB weight): row split (m large),
        // column split (m small, many panels), row split of a narrow weight, small-M path; and
        // two single-thread ones.
        for (m, n, k) in [
            (300, 96, 160),
            (40, 512, 256),
            (64, 128, 600),
            (2, 1024, 512),
            (20, 512, 256),
            (64, 65, 129),
            // Weights of >= 7 MiB take the L2-blocked path (Berxit's feed-forward shapes).
            (130, 3072, 768),
            (57, 768, 3072),
        ] {
            let (w, a, pw) = rng.problem(m, n, k);
            let rows = Rows::Contiguous {
                data: &a,
                stride: k,
            };
            let mut c1 = vec![0.0; m * n];
            let mut c2 = vec![1.0; m * n];
            dense_with(kind, &rows, &pw, &mut c1, &NoEpilogue, 1).unwrap();
            dense_with(kind, &rows, &pw, &mut c2, &NoEpilogue, 2).unwrap();
            assert_eq!(c1, c2, "{} m={m} n={n} k={k}", kind.name());
            let rows_ref: Vec<Vec<f32>> = a.chunks(k).map(|r| r.to_vec()).collect();
            let (want, scale) = reference(&[(rows_ref, w, k)], m, n);
            check(&c2, &want, &scale, "threads 2");
        }
    }
}

#[test]
fn a_row_does_not_depend_on_the_other_rows() {
    // Batch invariance: row i of a launch of m rows equals the same row launched alone, bit for
    // bit, whatever m and however many threads (so continuous batching and `tumble run` agree
    // exactly, and a result the job memo kept from one launch is the one any other launch would
    // have computed). Past one K block (256 on every kernel) the tiles of a later block carry on
    // from C instead of adding their own sum to it, so an element is one multiply-add chain
    // whether K was blocked (launches of more than 4 rows) or not (1-4 rows).
    let mut rng = Rng(11);
    for kind in kinds() {
        for k in [1, 7, 64, 255, 256, 257, 300, 513, 1030] {
            for n in [5, 16, 33, 768] {
                let m = 31;
                let (_, a, pw) = rng.problem(m, n, k);
                let mut all = vec![0.0; m * n];
                let rows = Rows::Contiguous {
                    data: &a,
                    stride: k,
                };
                dense_with(kind, &rows, &pw, &mut all, &NoEpilogue, 1).unwrap();
                let mut two = vec![0.0; m * n];
                dense_with(kind, &rows, &pw, &mut two, &NoEpilogue, 2).unwrap();
                assert_eq!(two, all, "{} k={k} n={n}: two threads", kind.name());
                for count in [1, 2, 3, 4, 5, 15] {
                    for start in [0, m - count] {
                        let part = &a[start * k..(start + count) * k];
                        let mut c = vec![0.0; count * n];
                        let rows = Rows::Contiguous {
                            data: part,
                            stride: k,
                        };
                        dense_with(kind, &rows, &pw, &mut c, &NoEpilogue, 1).unwrap();
                        assert_eq!(
                            c,
                            all[start * n..(start + count) * n],
                            "{} k={k} n={n}: rows {start}..{} alone",
                            kind.name(),
                            start + count
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn stride_larger_than_k() {
    let mut rng = Rng(3);
    for kind in kinds() {
        for (m, n, k, stride) in [(7, 9, 5, 13), (33, 40, 33, 64), (1, 3, 3, 100)] {
            let w = rng.vec(n * k);
            let data = rng.vec((m - 1) * stride + k); // exactly the minimum length
            let pw = PackedWeight::pack(&w, n, k).unwrap();
            let mut c = vec![0.0; m * n];
            dense_with(
                kind,
                &Rows::Contiguous {
                    data: &data,
                    stride,
                },
                &pw,
                &mut c,
                &NoEpilogue,
                1,
            )
            .unwrap();
            let rows: Vec<Vec<f32>> = (0..m)
                .map(|i| data[i * stride..i * stride + k].to_vec())
                .collect();
            let (want, scale) = reference(&[(rows, w, k)], m, n);
            check(
                &c,
                &want,
                &scale,
                &format!("{} stride {stride}", kind.name()),
            );
        }
    }
}

#[test]
fn accumulate_over_parts() {
    let mut rng = Rng(11);
    for kind in kinds() {
        for (m, n, ks) in [
            (7usize, 33usize, vec![5usize, 9]),
            (40, 70, vec![33, 0, 257]),
            (3, 64, vec![300, 1, 7]),
            (130, 17, vec![64, 64]),
            // Narrow products (N <= 8: dot products per output), a part with K = 0 among them.
            (9, 5, vec![17, 0, 300]),
            (65, 1, vec![16, 33]),
        ] {
            let ws: Vec<Vec<f32>> = ks.iter().map(|&k| rng.vec(n * k)).collect();
            let pws: Vec<PackedWeight> = ks
                .iter()
                .zip(&ws)
                .map(|(&k, w)| PackedWeight::pack(w, n, k).unwrap())
                .collect();
            // Alternate contiguous and gathered parts.
            let datas: Vec<Vec<f32>> = ks.iter().map(|&k| rng.vec(m * k.max(1))).collect();
            let slices: Vec<Vec<&[f32]>> = ks
                .iter()
                .zip(&datas)
                .map(|(&k, d)| {
                    (0..m)
                        .rev()
                        .map(|i| &d[i * k.max(1)..i * k.max(1) + k])
                        .collect()
                })
                .collect();
            let rows: Vec<Rows> = ks
                .iter()
                .enumerate()
                .map(|(p, &k)| {
                    if p % 2 == 0 {
                        Rows::Contiguous {
                            data: &datas[p],
                            stride: k.max(1),
                        }
                    } else {
                        Rows::Gathered(&slices[p])
                    }
                })
                .collect();
            let parts: Vec<(&Rows, &PackedWeight)> = rows.iter().zip(&pws).collect();
            let mut c = vec![f32::NAN; m * n];
            dense_accumulate_with(kind, &parts, &mut c, &NoEpilogue, 2).unwrap();
            let refparts: Vec<RefPart> = ks
                .iter()
                .enumerate()
                .map(|(p, &k)| {
                    let r: Vec<Vec<f32>> = if p % 2 == 0 {
                        (0..m)
                            .map(|i| datas[p][i * k.max(1)..i * k.max(1) + k].to_vec())
                            .collect()
                    } else {
                        slices[p].iter().map(|s| s.to_vec()).collect()
                    };
                    (r, ws[p].clone(), k)
                })
                .collect();
            let (want, scale) = reference(&refparts, m, n);
            check(
                &c,
                &want,
                &scale,
                &format!("{} accumulate {ks:?}", kind.name()),
            );
        }
    }
}

#[test]
fn bias_tanh_epilogue() {
    let mut rng = Rng(23);
    for threads in [1, 2] {
        for (m, n, k) in [(1, 33, 17), (7, 64, 8), (257, 64, 33), (20, 600, 256)] {
            let (w, a, pw) = rng.problem(m, n, k);
            let bias = rng.vec(n);
            let mut c = vec![0.0; m * n];
            let epi = BiasActivation {
                bias: Some(&bias),
                act: Activation::Tanh,
            };
            dense(
                &Rows::Contiguous {
                    data: &a,
                    stride: k,
                },
                &pw,
                &mut c,
                &epi,
                threads,
            )
            .unwrap();
            let rows: Vec<Vec<f32>> = a.chunks(k).map(|r| r.to_vec()).collect();
            let (want, scale) = reference(&[(rows, w, k)], m, n);
            for i in 0..m {
                for j in 0..n {
                    let e = (want[i * n + j] + bias[j] as f64).tanh();
                    let tol = 1e-4 * (1.0 + scale[i * n + j]) + 1e-6;
                    let g = c[i * n + j] as f64;
                    assert!(
                        (g - e).abs() <= tol,
                        "m={m} n={n} k={k} ({i},{j}): {g} vs {e}"
                    );
                }
            }
        }
    }
}

/// An epilogue that records the row ranges it is given.
struct Recorder {
    seen: Mutex<Vec<Range<usize>>>,
    n: usize,
}

impl Epilogue for Recorder {
    fn rows(&self, rows: Range<usize>, out: &mut [f32]) {
        assert_eq!(out.len(), rows.len() * self.n);
        self.seen.lock().unwrap().push(rows);
    }
}

#[test]
fn epilogue_sees_every_row_exactly_once() {
    let mut rng = Rng(31);
    for kind in kinds() {
        for threads in [1, 2, 3] {
            for (m, n, k) in [
                (1, 5, 3),
                (3, 40, 7),
                (255, 33, 64),
                (300, 96, 160),
                (40, 512, 256),
                (64, 128, 600),
                (20, 512, 256),
                (2, 1024, 512),
                (5, 0, 4),
                (4, 3, 0),
            ] {
                let (_, a, pw) = rng.problem(m, n, k);
                let slices = row_slices(&a, m, k);
                let mut c = vec![f32::NAN; m * n];
                let rec = Recorder {
                    seen: Mutex::new(Vec::new()),
                    n,
                };
                dense_with(kind, &Rows::Gathered(&slices), &pw, &mut c, &rec, threads).unwrap();
                let mut seen = rec.seen.into_inner().unwrap();
                seen.sort_by_key(|r| r.start);
                let mut next = 0;
                let mut all = HashSet::new();
                for r in &seen {
                    assert_eq!(
                        r.start,
                        next,
                        "{} m={m} n={n} k={k} t={threads}: {seen:?}",
                        kind.name()
                    );
                    assert!(!r.is_empty());
                    next = r.end;
                    all.extend(r.clone());
                }
                assert_eq!(next, m, "{seen:?}");
                assert_eq!(all.len(), m);
                if k == 0 {
                    assert!(c.iter().all(|&x| x == 0.0));
                }
            }
        }
    }
}

#[test]
fn sizes_are_validated_not_panicked_on() {
    let w = vec![0.0; 6];
    assert!(PackedWeight::pack(&w, 2, 2).is_err());
    assert!(PackedWeight::pack(&w, usize::MAX, 3).is_err());
    let pw = PackedWeight::pack(&w, 3, 2).unwrap();
    assert_eq!((pw.n(), pw.k()), (3, 2));
    let a = [1.0f32; 8];
    let contiguous = Rows::Contiguous {
        data: &a,
        stride: 2,
    };
    let mut c = vec![0.0; 7];
    assert!(matches!(
        dense(&contiguous, &pw, &mut c, &NoEpilogue, 1),
        Err(KernelError::Length { .. })
    ));
    let mut c = vec![0.0; 15]; // 5 rows need 10 floats of data at stride 2
    assert!(dense(&contiguous, &pw, &mut c, &NoEpilogue, 1).is_err());
    let short = Rows::Contiguous {
        data: &a,
        stride: 1,
    };
    let mut c = vec![0.0; 3];
    assert!(matches!(
        dense(&short, &pw, &mut c, &NoEpilogue, 1),
        Err(KernelError::Shape(_))
    ));
    let r: [&[f32]; 2] = [&a[..2], &a[..3]];
    let mut c = vec![0.0; 6];
    let e = dense(&Rows::Gathered(&r), &pw, &mut c, &NoEpilogue, 1).unwrap_err();
    assert!(e.to_string().contains("row 1"), "{e}");
    let mut c = vec![0.0; 9];
    assert!(dense(&Rows::Gathered(&r[..1]), &pw, &mut c, &NoEpilogue, 1).is_err());
    let other = PackedWeight::pack(&[0.0; 8], 4, 2).unwrap();
    let mut c = vec![0.0; 12];
    assert!(dense_accumulate(
        &[(&contiguous, &pw), (&contiguous, &other)],
        &mut c,
        &NoEpilogue,
        1
    )
    .is_err());
    assert!(dense_accumulate(&[], &mut c, &NoEpilogue, 1).is_err());
    // Empty launches are fine.
    let mut c: Vec<f32> = Vec::new();
    dense(&Rows::Gathered(&[]), &pw, &mut c, &NoEpilogue, 1).unwrap();
    dense(&contiguous, &pw, &mut c, &NoEpilogue, 0).unwrap();
}

#[test]
fn reports_a_known_kernel() {
    assert!(["avx512", "avx2+fma", "portable"].contains(&cpu_features()));
    assert!(KernelKind::selected().is_available());
}

#[test]
fn activations_are_accurate() {
    let mut xs: Vec<f32> = (-2000..=2000).map(|i| i as f32 * 0.01).collect();
    xs.extend([
        -1e30, -100.0, -88.0, 88.0, 100.0, 1e30, 1e-6, -1e-6, 0.0, -0.0, 3e-3,
    ]);
    let mut s = xs.clone();
    sigmoid_in_place(&mut s);
    let mut t = xs.clone();
    tanh_in_place(&mut t);
    for ((&x, &sv), &tv) in xs.iter().zip(&s).zip(&t) {
        let x64 = x as f64;
        let se = 1.0 / (1.0 + (-x64).exp());
        assert!(
            (sv as f64 - se).abs() <= 3e-7,
            "sigmoid({x}) = {sv}, want {se}"
        );
        assert!(
            (tv as f64 - x64.tanh()).abs() <= 3e-7,
            "tanh({x}) = {tv}, want {}",
            x64.tanh()
        );
    }
    let mut nan = [f32::NAN];
    sigmoid_in_place(&mut nan);
    assert!(nan[0].is_nan());
}

#[test]
#[ignore = "large; run in release: cargo test --release -p tumble-kernels -- --ignored"]
fn large_cubes() {
    let mut rng = Rng(77);
    for kind in kinds() {
        for threads in [1, 2] {
            case(kind, 257, 257, 257, false, threads, &mut rng);
            case(kind, 257, 257, 257, true, threads, &mut rng);
            case(kind, 513, 300, 700, true, threads, &mut rng);
        }
    }
}

/// `dense_into`: an epilogue that reads each block of C and writes two outputs of other widths
/// (the row's sum of tanh, width 1, and C + 1 restricted to its first half, width ⌈N/2⌉) at the
/// block's rows — compared with the reference product, at odd sizes, on 1–3 threads, with both
/// the row split and the column split of the driver (wide N with few rows).
#[test]
fn dense_into_writes_every_output_row_from_its_block_of_c() {
    let mut rng = Rng(77);
    for kind in kinds() {
        for threads in [1, 2, 3] {
            for (m, n, k) in [
                (1, 5, 3),
                (7, 33, 8),
                (33, 64, 255),
                (257, 40, 33),
                (20, 1024, 300),
                (300, 96, 64),
            ] {
                let (w, a, pw) = rng.problem(m, n, k);
                let slices = row_slices(&a, m, k);
                let half = n.div_ceil(2);
                let mut c = vec![f32::NAN; m * n];
                let (mut sums, mut shifted) = (vec![f32::NAN; m], vec![f32::NAN; m * half]);
                let epi = |rows: Range<usize>, c: &mut [f32], outs: &mut [&mut [f32]]| {
                    assert_eq!(c.len(), rows.len() * n);
                    let [s, h] = outs else { panic!("two outputs") };
                    assert_eq!(s.len(), rows.len());
                    assert_eq!(h.len(), rows.len() * half);
                    for (i, row) in c.chunks_exact(n).enumerate() {
                        s[i] = row.iter().map(|x| x.tanh()).sum();
                        for j in 0..half {
                            h[i * half + j] = row[j] + 1.0;
                        }
                    }
                };
                let mut outputs = [
                    Output {
                        data: &mut sums,
                        width: 1,
                    },
                    Output {
                        data: &mut shifted,
                        width: half,
                    },
                ];
                dense_into_with(
                    kind,
                    &[(&Rows::Gathered(&slices), &pw)],
                    &mut c,
                    &mut outputs,
                    &epi,
                    threads,
                )
                .unwrap();
                let rows: Vec<Vec<f32>> = slices.iter().map(|r| r.to_vec()).collect();
                let (want, scale) = reference(&[(rows, w, k)], m, n);
                let what = format!("{} m={m} n={n} k={k} t={threads}", kind.name());
                check(&c, &want, &scale, &what);
                for i in 0..m {
                    let ws: f64 = (0..n).map(|j| want[i * n + j].tanh()).sum();
                    let tol = 1e-4 * (1.0 + (0..n).map(|j| scale[i * n + j]).sum::<f64>());
                    assert!((sums[i] as f64 - ws).abs() <= tol, "{what}: sum {i}");
                    for j in 0..half {
                        let d = shifted[i * half + j] as f64 - (want[i * n + j] + 1.0);
                        assert!(
                            d.abs() <= 1e-4 * (1.0 + scale[i * n + j]),
                            "{what}: ({i},{j})"
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn dense_into_rejects_outputs_of_the_wrong_length() {
    let w = vec![0.5; 6];
    let pw = PackedWeight::pack(&w, 3, 2).unwrap();
    let a = [1.0f32, 2.0, 3.0, 4.0];
    let rows = Rows::Contiguous {
        data: &a,
        stride: 2,
    };
    let mut c = vec![0.0; 2 * 3];
    let mut short = vec![0.0; 3];
    let mut outputs = [Output {
        data: &mut short,
        width: 2,
    }];
    let epi = |_: Range<usize>, _: &mut [f32], _: &mut [&mut [f32]]| {};
    let e = dense_into(&[(&rows, &pw)], &mut c, &mut outputs, &epi, 1).unwrap_err();
    assert!(e.to_string().contains("output 0"), "{e}");
}

/// The L2-blocked path (a weight of at least 7 MiB in all, tasks of more than one 56-row block):
/// N = 2000 (63 panels, two column chunks, a partial last panel), two parts with K = 300 and 620
/// (K blocks of 150 and 207, neither a multiple of kc) making a 7.02 MiB weight, M = 100 (one
/// group; with 2 threads the column split), 257 and 513 (several groups, row tasks), one part
/// gathered (shuffled, aliased rows) and one contiguous with a stride, 1 and 2 threads. Through
/// `dense_into`, whose epilogue copies each block of C to an output and records its rows: every
/// row exactly once, and only once C is final (the copy equals the reference). The same rows as a
/// single gathered part with the concatenated weight go through `dense` as well.
#[test]
fn l2_blocked_weight_at_odd_sizes() {
    let mut rng = Rng(41);
    let n = 2000usize;
    let ks = [300usize, 620];
    let kt: usize = ks.iter().sum();
    let ws: Vec<Vec<f32>> = ks.iter().map(|&k| rng.vec(n * k)).collect();
    let pws: Vec<PackedWeight> = ks
        .iter()
        .zip(&ws)
        .map(|(&k, w)| PackedWeight::pack(w, n, k).unwrap())
        .collect();
    let wcat: Vec<f32> = (0..n)
        .flat_map(|j| {
            ws.iter()
                .zip(ks)
                .flat_map(move |(w, k)| w[j * k..(j + 1) * k].iter().copied())
        })
        .collect();
    let pw_cat = PackedWeight::pack(&wcat, n, kt).unwrap();
    for m in [100usize, 257, 513] {
        let stride = ks[0] + 3;
        let data0 = rng.vec(m * stride);
        let pool: Vec<Vec<f32>> = (0..m + 2).map(|_| rng.vec(ks[1])).collect();
        let mut idx: Vec<usize> = Vec::with_capacity(m);
        for i in 0..m {
            let pick = if i % 5 == 4 {
                idx[rng.below(i)]
            } else {
                rng.below(m + 2)
            };
            idx.push(pick);
        }
        let slices1: Vec<&[f32]> = idx.iter().map(|&i| &pool[i][..]).collect();
        let rows0: Vec<Vec<f32>> = (0..m)
            .map(|i| data0[i * stride..i * stride + ks[0]].to_vec())
            .collect();
        let rows1: Vec<Vec<f32>> = slices1.iter().map(|r| r.to_vec()).collect();
        let cat: Vec<Vec<f32>> = rows0
            .iter()
            .zip(&rows1)
            .map(|(a, b)| [&a[..], &b[..]].concat())
            .collect();
        let (want, scale) = reference(
            &[(rows0, ws[0].clone(), ks[0]), (rows1, ws[1].clone(), ks[1])],
            m,
            n,
        );
        let a0 = Rows::Contiguous {
            data: &data0,
            stride,
        };
        let a1 = Rows::Gathered(&slices1);
        let parts = [(&a0, &pws[0]), (&a1, &pws[1])];
        for kind in kinds() {
            for threads in [1, 2] {
                let what = format!("{} m={m} t={threads}", kind.name());
                let mut c = vec![f32::NAN; m * n];
                let mut copy = vec![f32::NAN; m * n];
                let seen = Mutex::new(Vec::new());
                let epi = |rows: Range<usize>, c: &mut [f32], outs: &mut [&mut [f32]]| {
                    assert_eq!(c.len(), rows.len() * n);
                    outs[0].copy_from_slice(c);
                    seen.lock().unwrap().push(rows);
                };
                let mut outputs = [Output {
                    data: &mut copy,
                    width: n,
                }];
                dense_into_with(kind, &parts, &mut c, &mut outputs, &epi, threads).unwrap();
                check(&c, &want, &scale, &what);
                check(&copy, &want, &scale, &format!("{what}: epilogue's copy"));
                let mut seen = seen.into_inner().unwrap();
                seen.sort_by_key(|r| r.start);
                let mut next = 0;
                for r in &seen {
                    assert_eq!(r.start, next, "{what}: {seen:?}");
                    assert!(!r.is_empty(), "{what}: {seen:?}");
                    next = r.end;
                }
                assert_eq!(next, m, "{what}: {seen:?}");
            }
        }
        let cat_slices: Vec<&[f32]> = cat.iter().map(|r| &r[..]).collect();
        for threads in [1, 2] {
            let mut c = vec![f32::NAN; m * n];
            dense(
                &Rows::Gathered(&cat_slices),
                &pw_cat,
                &mut c,
                &NoEpilogue,
                threads,
            )
            .unwrap();
            check(&c, &want, &scale, &format!("dense m={m} t={threads}"));
        }
    }
}

/// Narrow products (N ≤ 8 take the dot-product path): every N, K around the vector widths, rows
/// contiguous and gathered, on every micro-kernel family; the same within tolerance with the
/// path turned off (the blocked GEMM); and a row's bits do not depend on the other rows.
#[test]
fn narrow_products_at_odd_sizes_and_off() {
    let mut rng = Rng(0x5EED);
    for kind in kinds() {
        for n in 1..=9 {
            for k in [1, 7, 8, 15, 16, 17, 31, 33, 300] {
                for m in [1, 2, 65] {
                    case(kind, m, n, k, (m + k) % 2 == 0, 1, &mut rng);
                }
            }
        }
        let (m, n, k) = (70, 5, 37);
        let (_, a, pw) = rng.problem(m, n, k);
        let contiguous = Rows::Contiguous {
            data: &a,
            stride: k,
        };
        let mut on = vec![f32::NAN; m * n];
        dense_with(kind, &contiguous, &pw, &mut on, &NoEpilogue, 1).unwrap();
        // Row 3 alone: the same bits as within the launch of 70.
        let one = Rows::Contiguous {
            data: &a[3 * k..4 * k],
            stride: k,
        };
        let mut row = vec![f32::NAN; n];
        dense_with(kind, &one, &pw, &mut row, &NoEpilogue, 1).unwrap();
        assert_eq!(row, on[3 * n..4 * n], "{}: row 3 alone", kind.name());
        set_narrow_products(false);
        let mut off = vec![f32::NAN; m * n];
        let r = dense_with(kind, &contiguous, &pw, &mut off, &NoEpilogue, 1);
        set_narrow_products(true);
        r.unwrap();
        for (x, y) in on.iter().zip(&off) {
            assert!(
                (x - y).abs() <= 1e-4 * (1.0 + y.abs()),
                "{}: {x} vs {y}",
                kind.name()
            );
        }
    }
}

/// A given by its columns (`Rows::Columns`: the transpose of row-major data, not transposed)
/// gives the bits of the same A given by rows on the blocked GEMM, on every micro-kernel, at
/// odd sizes, one and two threads, K blocks included; columns of the wrong count or length are
/// errors.
#[test]
fn a_given_by_columns_equals_a_given_by_rows() {
    let mut rng = Rng(31);
    for kind in kinds() {
        for (m, n, k) in [
            (1, 1, 1),
            (3, 7, 5),
            (17, 33, 7),
            (33, 16, 33),
            (130, 40, 300),
            (8, 5, 64),
            (64, 512, 256),
        ] {
            let (w, a, pw) = rng.problem(m, n, k);
            // Column p of A (m floats): A's transpose stored row-major, one row per column.
            let at: Vec<f32> = (0..k)
                .flat_map(|p| (0..m).map(move |i| (i, p)))
                .map(|(i, p)| a[i * k + p])
                .collect();
            let cols: Vec<&[f32]> = at.chunks(m).collect();
            for threads in [1, 2] {
                let mut by_rows = vec![0.0; m * n];
                let mut by_cols = vec![f32::NAN; m * n];
                let rows = Rows::Contiguous {
                    data: &a,
                    stride: k,
                };
                dense_with(kind, &rows, &pw, &mut by_rows, &NoEpilogue, threads).unwrap();
                dense_with(
                    kind,
                    &Rows::Columns(&cols),
                    &pw,
                    &mut by_cols,
                    &NoEpilogue,
                    threads,
                )
                .unwrap();
                let same = by_rows
                    .iter()
                    .zip(&by_cols)
                    .all(|(x, y)| x.to_bits() == y.to_bits());
                // (A few outputs are dot products by rows, the narrow path, which takes no
                // columns: those agree within the reference's tolerance below.)
                assert!(
                    same || n <= 8,
                    "{} m={m} n={n} k={k} threads={threads}",
                    kind.name()
                );
            }
            let rows_ref: Vec<Vec<f32>> = a.chunks(k).map(|r| r.to_vec()).collect();
            let (want, scale) = reference(&[(rows_ref, w, k)], m, n);
            let mut c = vec![0.0; m * n];
            dense_with(kind, &Rows::Columns(&cols), &pw, &mut c, &NoEpilogue, 1).unwrap();
            check(&c, &want, &scale, "columns");
        }
    }
    let (_, a, pw) = Rng(3).problem(4, 3, 5);
    let cols: Vec<&[f32]> = a.chunks(4).collect();
    let mut c = vec![0.0; 4 * 3];
    assert!(dense(&Rows::Columns(&cols[..4]), &pw, &mut c, &NoEpilogue, 1).is_err());
    let short: Vec<&[f32]> = cols.iter().map(|c| &c[..3]).collect();
    assert!(dense(&Rows::Columns(&short), &pw, &mut c, &NoEpilogue, 1).is_err());
}

#[test]
fn row_chunks_at_the_row_unit_compute_the_same_bits() {
    // The runtime runs a large launch in row chunks that are multiples of `row_unit` (to keep its
    // scratch C small); each chunk must give the bits of the whole launch, K above one K block and
    // an L2-blocked weight included.
    let mut rng = Rng(43);
    for (n, k) in [(96usize, 300usize), (2000, 920)] {
        let unit = row_unit(n * k * 4);
        assert!(unit >= 8, "{unit}");
        let m = 2 * unit + 37;
        let (_, a, pw) = rng.problem(m, n, k);
        let mut whole = vec![0.0; m * n];
        let rows = Rows::Contiguous {
            data: &a,
            stride: k,
        };
        dense(&rows, &pw, &mut whole, &NoEpilogue, 1).unwrap();
        for (start, end) in [(0, unit), (unit, 2 * unit), (2 * unit, m), (unit, m)] {
            let mut c = vec![0.0; (end - start) * n];
            let rows = Rows::Contiguous {
                data: &a[start * k..end * k],
                stride: k,
            };
            dense(&rows, &pw, &mut c, &NoEpilogue, 1).unwrap();
            assert!(
                c == whole[start * n..end * n],
                "n={n} k={k}: rows {start}..{end} as a chunk differ"
            );
        }
    }
}
