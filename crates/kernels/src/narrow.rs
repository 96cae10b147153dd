//! Narrow products: `C = A · Wᵀ` with few output columns (a classifier's 5 classes, a gate's 1),
//! as one dot product per output, reading A's rows where they lie.
//!
//! The blocked GEMM computes whole 32-column panels: with `N = 5` it does the work of `N = 32`
//! and packs every row of A first (1253 × 512 × 5 took 486 µs, the time of 1253 × 512 × 32).
//! Here each row of A is read once, straight from its slice, against the `N` weight rows (a few
//! KiB, in L1), with 16 lanes of partial sums per output: ~10× less time at `N = 5`.
//!
//! AVX-512 (16 lanes, masked tail) and AVX2 + FMA (8 lanes) kernels, and a portable one. Each
//! row's partial sums are reduced in a fixed order, so a row's result does not depend on the other
//! rows of the launch, nor on the thread count.

use crate::driver::{finish, split_front, Outs, Part};
use crate::kernel::KernelKind;
use crate::pack::RowSource;
use crate::EpilogueInto;

/// Products with at most this many output columns take this path (when it is on).
pub(crate) const MAX_N: usize = 8;

/// Rows per epilogue call: their block of C stays in L1.
const BLOCK_ROWS: usize = 64;

const LANES: usize = 16;

static OFF: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Turns the narrow path on or off for the whole process (on by default; off also with
/// `TUMBLE_NO_NARROW_GEMM` set): products of few columns then run on the blocked GEMM.
pub fn set_narrow_products(on: bool) {
    OFF.store(!on, std::sync::atomic::Ordering::Relaxed);
}

fn enabled() -> bool {
    !OFF.load(std::sync::atomic::Ordering::Relaxed)
        && !tumble_limits::switch_on!("TUMBLE_NO_NARROW_GEMM")
}

/// Whether `C (m × n) = Σ parts` runs here: `n ≤ MAX_N`, every weight keeps its rows, and the
/// path is on.
pub(crate) fn applies(parts: &[Part<'_>], n: usize) -> bool {
    n <= MAX_N
        && enabled()
        && parts
            .iter()
            .all(|p| p.w.rows().is_some() && !matches!(p.a, RowSource::Columns(_)))
}

/// `C (m × n) = Σ_i A_i · W_iᵀ`, then the epilogue on blocks of rows, `kind` choosing the
/// instruction set (as the blocked GEMM's micro-kernel family).
pub(crate) fn run(
    kind: KernelKind,
    parts: &[Part<'_>],
    m: usize,
    n: usize,
    c: &mut [f32],
    outs: &mut [(&mut [f32], usize)],
    epilogue: &dyn EpilogueInto,
) {
    let mut outs: Outs = outs.iter_mut().map(|(d, w)| (&mut **d, *w)).collect();
    let mut r0 = 0;
    while r0 < m {
        let r1 = (r0 + BLOCK_ROWS).min(m);
        let block = &mut c[r0 * n..r1 * n];
        for (pi, part) in parts.iter().enumerate() {
            let Some(w) = part.w.rows() else { continue };
            let k = part.w.k();
            for (i, out) in (r0..r1).zip(block.chunks_exact_mut(n.max(1))) {
                let a = part.a.row(i, 0, k);
                rows_dot(kind, a, w, k, n, out, pi > 0, std::ptr::null());
            }
        }
        let front = split_front(&mut outs, r1 - r0);
        finish(epilogue, r0..r1, block, front);
        r0 = r1;
    }
}

/// `out[j] = a · w_j` for every row `w_j` of `w` (row-major, `out.len()` rows of `k` floats):
/// a vector-matrix product against a weight used once (MV-RNN's per-word matrices), eight
/// weight rows at a time on the selected kernel family's vector loops, `a` loaded once per eight.
/// Each output's lanes are reduced in a fixed order, so it does not depend on `out.len()`.
/// Lengths that do not fit (`a` shorter than `k`, `w` shorter than `out.len() × k`) leave the
/// outputs they cannot compute untouched; callers check them.
pub fn dot_rows(a: &[f32], w: &[f32], k: usize, out: &mut [f32]) {
    if a.len() < k {
        return;
    }
    let kind = KernelKind::selected();
    let prefetch = dot_prefetch_enabled();
    for (j0, o) in (0..).step_by(MAX_N).zip(out.chunks_mut(MAX_N)) {
        let Some(rows) = w.get(j0 * k..(j0 + o.len()) * k) else {
            return;
        };
        let n = o.len();
        // The next eight rows (often the next 4 KiB page, where the hardware's streams stop)
        // are prefetched while these are multiplied: a weight used once comes from memory.
        let next = match w.get((j0 + n) * k..) {
            Some(rest) if prefetch && rest.len() >= n * k => rest.as_ptr(),
            _ => std::ptr::null(),
        };
        rows_dot(kind, a, rows, k, n, o, false, next);
    }
}

/// `TUMBLE_NO_DOT_PREFETCH=1`: [`dot_rows`] does not prefetch the next rows (a hint: the
/// results never depend on it).
fn dot_prefetch_enabled() -> bool {
    !tumble_limits::switch_on!("TUMBLE_NO_DOT_PREFETCH")
}

/// `out[j] (+)= a · w_j` for the `n` rows `w_j` of `w` (each `k` floats); `next`, when not null,
/// is `n` more rows of `k` floats the vector kernels prefetch meanwhile, a line for each line
/// they read.
#[allow(clippy::too_many_arguments)]
fn rows_dot(
    kind: KernelKind,
    a: &[f32],
    w: &[f32],
    k: usize,
    n: usize,
    out: &mut [f32],
    add: bool,
    next: *const f32,
) {
    macro_rules! by_n {
        ($f:ident $(, $next:ident)?) => {
            match n {
                1 => $f::<1>(a, w, k, out, add $(, $next)?),
                2 => $f::<2>(a, w, k, out, add $(, $next)?),
                3 => $f::<3>(a, w, k, out, add $(, $next)?),
                4 => $f::<4>(a, w, k, out, add $(, $next)?),
                5 => $f::<5>(a, w, k, out, add $(, $next)?),
                6 => $f::<6>(a, w, k, out, add $(, $next)?),
                7 => $f::<7>(a, w, k, out, add $(, $next)?),
                _ => $f::<8>(a, w, k, out, add $(, $next)?),
            }
        };
    }
    match kind {
        #[cfg(target_arch = "x86_64")]
        KernelKind::Avx512 => by_n!(dot_avx512, next),
        #[cfg(target_arch = "x86_64")]
        KernelKind::Avx2Fma => by_n!(dot_avx2),
        _ => {
            let _ = next;
            by_n!(dot_portable)
        }
    }
}

/// The portable body (a multiply then an add: `mul_add` is a library call without FMA).
fn dot_portable<const N: usize>(a: &[f32], w: &[f32], k: usize, out: &mut [f32], add: bool) {
    let mut acc = [[0f32; LANES]; N];
    let full = k / LANES * LANES;
    let mut c0 = 0;
    while c0 < full {
        let av: &[f32; LANES] = match a.get(c0..c0 + LANES).and_then(|s| s.try_into().ok()) {
            Some(v) => v,
            None => return,
        };
        for (j, accj) in acc.iter_mut().enumerate() {
            let base = j * k + c0;
            let wv: &[f32; LANES] = match w.get(base..base + LANES).and_then(|s| s.try_into().ok())
            {
                Some(v) => v,
                None => return,
            };
            for l in 0..LANES {
                accj[l] += av[l] * wv[l];
            }
        }
        c0 += LANES;
    }
    for (j, accj) in acc.iter().enumerate() {
        // Lanes summed pairwise in a fixed order, then the tail of K.
        let mut lanes = *accj;
        let mut width = LANES / 2;
        while width > 0 {
            for l in 0..width {
                lanes[l] += lanes[l + width];
            }
            width /= 2;
        }
        let mut s = lanes[0];
        let row = &w[j * k..(j + 1) * k];
        for t in full..k {
            s += a[t] * row[t];
        }
        if let Some(o) = out.get_mut(j) {
            *o = if add { *o + s } else { s };
        }
    }
}

#[cfg(target_arch = "x86_64")]
fn dot_avx2<const N: usize>(a: &[f32], w: &[f32], k: usize, out: &mut [f32], add: bool) {
    if a.len() < k || w.len() < N * k || out.len() < N {
        return dot_portable::<N>(a, w, k, out, add);
    }
    // SAFETY: `KernelKind::Avx2Fma` is only selected (and only accepted by `kind.kernel()`) where
    // the CPU reports AVX2 and FMA; the lengths were checked just above.
    unsafe { x86::dot_avx2::<N>(a, w, k, out, add) }
}

#[cfg(target_arch = "x86_64")]
fn dot_avx512<const N: usize>(
    a: &[f32],
    w: &[f32],
    k: usize,
    out: &mut [f32],
    add: bool,
    next: *const f32,
) {
    if a.len() < k || w.len() < N * k || out.len() < N {
        return dot_portable::<N>(a, w, k, out, add);
    }
    // SAFETY: `KernelKind::Avx512` is only selected (and only accepted by `kind.kernel()`) where
    // the CPU reports AVX-512F; the lengths were checked just above; `next` is only prefetched.
    unsafe { x86::dot_avx512::<N>(a, w, k, out, add, next) }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    /// # Safety
    /// Callers guarantee `a.len() >= k`, `w.len() >= N * k`, `out.len() >= N` and AVX-512F;
    /// `next` (null: none) is only prefetched, `N` rows of `k` floats like `w`'s.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn dot_avx512<const N: usize>(
        a: &[f32],
        w: &[f32],
        k: usize,
        out: &mut [f32],
        add: bool,
        next: *const f32,
    ) {
        let (ap, wp) = (a.as_ptr(), w.as_ptr());
        let mut acc = [_mm512_setzero_ps(); N];
        let full = k / 16 * 16;
        let mut c = 0;
        while c < full {
            if !next.is_null() {
                for j in 0..N {
                    // A hint only: the address is computed without dereferencing it.
                    _mm_prefetch::<_MM_HINT_T0>(next.wrapping_add(j * k + c) as *const i8);
                }
            }
            // SAFETY: c + 16 <= full <= k: in bounds of a and of every weight row.
            let av = unsafe { _mm512_loadu_ps(ap.add(c)) };
            for (j, acc) in acc.iter_mut().enumerate() {
                // SAFETY: row j of `w` is `w[j * k..(j + 1) * k]` (`w.len() >= N * k`) and
                // c + 16 <= k.
                *acc = _mm512_fmadd_ps(av, unsafe { _mm512_loadu_ps(wp.add(j * k + c)) }, *acc);
            }
            c += 16;
        }
        let rem = k - full;
        if rem > 0 {
            let mask: __mmask16 = (1u16 << rem) - 1;
            // SAFETY: masked loads read only the `rem` floats left in each row.
            let av = unsafe { _mm512_maskz_loadu_ps(mask, ap.add(full)) };
            for (j, acc) in acc.iter_mut().enumerate() {
                // SAFETY: the mask reads floats full..k of row j, inside `w` (`N * k` floats).
                let wv = unsafe { _mm512_maskz_loadu_ps(mask, wp.add(j * k + full)) };
                *acc = _mm512_fmadd_ps(av, wv, *acc);
            }
        }
        for (j, acc) in acc.iter().enumerate() {
            let s = _mm512_reduce_add_ps(*acc);
            out[j] = if add { out[j] + s } else { s };
        }
    }

    /// # Safety
    /// Callers guarantee `a.len() >= k`, `w.len() >= N * k`, `out.len() >= N` and AVX2 + FMA.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn dot_avx2<const N: usize>(
        a: &[f32],
        w: &[f32],
        k: usize,
        out: &mut [f32],
        add: bool,
    ) {
        let (ap, wp) = (a.as_ptr(), w.as_ptr());
        let mut acc = [_mm256_setzero_ps(); N];
        let full = k / 8 * 8;
        let mut c = 0;
        while c < full {
            // SAFETY: c + 8 <= full <= k: in bounds of a and of every weight row.
            let av = unsafe { _mm256_loadu_ps(ap.add(c)) };
            for (j, acc) in acc.iter_mut().enumerate() {
                // SAFETY: row j of `w` is `w[j * k..(j + 1) * k]` (`w.len() >= N * k`) and
                // c + 8 <= k.
                *acc = _mm256_fmadd_ps(av, unsafe { _mm256_loadu_ps(wp.add(j * k + c)) }, *acc);
            }
            c += 8;
        }
        for (j, acc) in acc.iter().enumerate() {
            // Lanes summed in a fixed order, then the tail of K.
            let mut lanes = [0f32; 8];
            // SAFETY: `lanes` holds 8 floats.
            unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), *acc) };
            let mut s = ((lanes[0] + lanes[4]) + (lanes[1] + lanes[5]))
                + ((lanes[2] + lanes[6]) + (lanes[3] + lanes[7]));
            for t in full..k {
                s = a[t].mul_add(w[j * k + t], s);
            }
            out[j] = if add { out[j] + s } else { s };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `dot_rows` against f64 sums at odd sizes (tails of K, of the eight-row groups, K = 0).
    #[test]
    fn dot_rows_at_odd_sizes() {
        let mut seed = 7u32;
        let mut next = move || {
            seed = seed.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
            (seed >> 8) as f32 / (1u32 << 24) as f32 - 0.5
        };
        for (k, n) in [
            (0, 3),
            (1, 1),
            (5, 9),
            (16, 8),
            (17, 17),
            (33, 7),
            (128, 128),
            (129, 65),
        ] {
            let a: Vec<f32> = (0..k).map(|_| next()).collect();
            let w: Vec<f32> = (0..n * k).map(|_| next()).collect();
            let mut out = vec![f32::NAN; n];
            dot_rows(&a, &w, k, &mut out);
            for (j, got) in out.iter().enumerate() {
                let want: f64 = (0..k)
                    .map(|l| f64::from(a[l]) * f64::from(w[j * k + l]))
                    .sum();
                assert!(
                    (f64::from(*got) - want).abs() <= 1e-5 * (1.0 + want.abs()),
                    "k {k} n {n}: [{j}] {got} against {want}"
                );
            }
            // A row's result does not depend on how many rows are computed with it.
            if n > 1 {
                let mut first = vec![f32::NAN; 1];
                dot_rows(&a, &w, k, &mut first);
                assert_eq!(first[0].to_bits(), out[0].to_bits());
            }
        }
        // Too short an operand computes nothing rather than panicking.
        let mut out = [f32::NAN; 2];
        dot_rows(&[1.0], &[1.0; 4], 2, &mut out);
        assert!(out.iter().all(|v| v.is_nan()));
    }
}
