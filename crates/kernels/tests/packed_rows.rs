//! `Rows::Packed`: a left operand packed once gives the bits of the same rows passed contiguous,
//! at odd sizes (tails of the micro-panels, of K blocks, of the weight's panels), on one thread
//! and several, and a packed operand of the wrong shape is an error.

mod common;

use common::Rng;
use tumble_kernels::{dense, NoEpilogue, PackedRows, Rows};

#[test]
fn packed_rows_give_the_contiguous_bits() {
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    for &(m, k, n) in &[
        (1, 1, 1),
        (3, 17, 5),
        (13, 33, 40),
        (14, 64, 32),
        (15, 256, 128),
        (29, 300, 65),
        (128, 256, 128),
        (200, 700, 96),
        (300, 1100, 33),
    ] {
        let (_, a, pw) = rng.problem(m, n, k);
        let packed = PackedRows::pack(&a, m, k).unwrap();
        for threads in [1, 2, 3] {
            let mut want = vec![f32::NAN; m * n];
            dense(
                &Rows::Contiguous {
                    data: &a,
                    stride: k,
                },
                &pw,
                &mut want,
                &NoEpilogue,
                threads,
            )
            .unwrap();
            let mut got = vec![f32::NAN; m * n];
            dense(&Rows::Packed(&packed), &pw, &mut got, &NoEpilogue, threads).unwrap();
            assert!(want.iter().all(|v| v.is_finite()), "{m}×{k}×{n}");
            let same = want
                .iter()
                .zip(&got)
                .all(|(x, y)| x.to_bits() == y.to_bits());
            assert!(same, "{m}×{k}×{n} on {threads} threads: packed rows differ");
        }
    }
}

#[test]
fn packed_rows_of_another_shape_are_an_error() {
    let mut rng = Rng(7);
    let (_, a, pw) = rng.problem(6, 8, 10);
    let packed = PackedRows::pack(&a, 6, 10).unwrap();
    // Seven rows of C for a packed A of six.
    let mut c = vec![0.0; 7 * 8];
    assert!(dense(&Rows::Packed(&packed), &pw, &mut c, &NoEpilogue, 1).is_err());
    // K = 10 packed, a weight of K = 12.
    let (_, _, pw12) = rng.problem(6, 8, 12);
    let mut c = vec![0.0; 6 * 8];
    assert!(dense(&Rows::Packed(&packed), &pw12, &mut c, &NoEpilogue, 1).is_err());
    // Data that is not M × K.
    assert!(PackedRows::pack(&a, 5, 10).is_err());
}
