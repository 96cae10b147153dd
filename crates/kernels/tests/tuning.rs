//! The driver's run-time [`Tuning`] only reorders tiles: every setting gives the same bits as the
//! defaults. A test binary of its own, since `set_tuning` is process-wide and would change the
//! paths the other tests mean to cover while they run.

use tumble_kernels::*;

mod common;
use common::Rng;

/// `(m, n, k)` products, gathered rows with a sigmoid epilogue, on 1 and 2 threads, under each
/// tuning: bit-identical to the defaults. The tunings' thresholds are scaled down to these
/// shapes (weights of 40–820 KiB, so that the test stays quick in a debug build): L2 blocking
/// with column chunks of a few panels and groups of 1, 3 and 7 row blocks, two K blocks
/// (K = 300), the column split of a wide weight, row task counts that are not a multiple of the
/// threads (580 rows: 3 tasks when L2-blocked), the driver's C prefetch on and off (N = 700:
/// an AVX2 row block of C over its 256 KiB threshold), K loops unrolled and not (K of 40–300,
/// not all multiples of 4), whole-panel and multi-panel tiles on and off (launches of 1–13 rows read in place
/// or packed, last micro-panels of 1–3 rows, partial last panels of more and of fewer than 16
/// columns, 1–13 panels: groups of 4 and a last group of 1–3), odd sizes everywhere.
#[test]
fn every_tuning_gives_the_defaults_bits() {
    let defaults = Tuning::default();
    assert_eq!(tuning(), defaults);
    let tunings = [
        Tuning {
            l2_block_min_weight_bytes: 32 << 10,
            l2_chunk_bytes: 40 << 10,
            l2_group_mc: 1,
            ..defaults
        },
        Tuning {
            l2_block_min_weight_bytes: 32 << 10,
            l2_chunk_bytes: 100 << 10,
            l2_group_mc: 3,
            whole_row_tasks_per_thread: true,
            ..defaults
        },
        Tuning {
            l2_block_min_weight_bytes: 0,
            l2_group_mc: 7,
            ..defaults
        },
        Tuning {
            wide_column_split_min_weight_bytes: 128 << 10,
            ..defaults
        },
        Tuning {
            wide_column_split_min_weight_bytes: 0,
            whole_row_tasks_per_thread: !defaults.whole_row_tasks_per_thread,
            ..defaults
        },
        Tuning {
            l2_block_min_weight_bytes: 32 << 10,
            whole_row_tasks_per_thread: !defaults.whole_row_tasks_per_thread,
            ..defaults
        },
        Tuning {
            prefetch_c: !defaults.prefetch_c,
            ..defaults
        },
        Tuning {
            wide_tiles: !defaults.wide_tiles,
            ..defaults
        },
        Tuning {
            unrolled_tiles: !defaults.unrolled_tiles,
            ..defaults
        },
        Tuning {
            multi_panel_tiles: !defaults.multi_panel_tiles,
            ..defaults
        },
        Tuning {
            direct_group_rows: 0,
            ..defaults
        },
        Tuning {
            direct_group_rows: 400,
            ..defaults
        },
        Tuning {
            row_block_tiles: 1,
            ..defaults
        },
        Tuning {
            k_block: 64,
            ..defaults
        },
        Tuning {
            k_block: 100,
            row_block_tiles: 2,
            ..defaults
        },
        Tuning {
            row_block_tiles: 7,
            l2_block_min_weight_bytes: 32 << 10,
            ..defaults
        },
    ];
    let mut rng = Rng(2026);
    let sigmoid = BiasActivation {
        bias: None,
        act: Activation::Sigmoid,
    };
    for (m, n, k) in [
        (580, 520, 130),
        (257, 700, 300),
        (97, 401, 77),
        (5, 600, 100),
        (1, 77, 300),
        (2, 50, 40),
        (3, 33, 257),
        (7, 130, 99),
        (8, 20, 300),
        (13, 48, 300),
        (45, 70, 260),
        // Groups of more rows than a packed tile, read where they lie by default.
        (15, 300, 256),
        (29, 200, 300),
        (48, 160, 33),
    ] {
        let w = rng.vec(n * k);
        let pw = PackedWeight::pack(&w, n, k).unwrap();
        let pool = rng.vec((m + 3) * k);
        let rows: Vec<&[f32]> = (0..m)
            .map(|i| {
                let r = (i * 7 + 2) % (m + 3);
                &pool[r * k..(r + 1) * k]
            })
            .collect();
        let gathered = Rows::Gathered(&rows);
        for threads in [1, 2] {
            set_tuning(defaults);
            let mut want = vec![f32::NAN; m * n];
            dense(&gathered, &pw, &mut want, &sigmoid, threads).unwrap();
            assert!(want.iter().all(|x| x.is_finite()));
            for t in tunings {
                set_tuning(t);
                assert_eq!(tuning(), t);
                let mut got = vec![f32::NAN; m * n];
                dense(&gathered, &pw, &mut got, &sigmoid, threads).unwrap();
                set_tuning(defaults);
                assert!(
                    got == want,
                    "m={m} n={n} k={k} threads={threads}: {t:?} changed the output"
                );
            }
        }
    }
}
