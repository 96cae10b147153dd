//! Dense stages on the SIMD kernels of `tumble-kernels`. Weights are packed once per weight tensor
//! (or per list of weight tensors, for horizontally fused denses) and job, in the job's
//! [`WeightCache`].

use crate::intern::WordMap;
use std::cell::RefCell;
use std::sync::{Arc, Mutex};

use tumble_kernels::{NoEpilogue, PackedRows, PackedWeight, Rows};
use tumble_tensor::Tensor;

type Single = WordMap<(usize, usize, usize), (Tensor, Arc<PackedWeight>)>;
type Concat = WordMap<(Vec<(usize, usize)>, usize), (Vec<Tensor>, Arc<PackedWeight>)>;

/// Packed weights of one job ([`crate::Executable`]): keyed by weight buffer (the cache holds
/// the tensors, so their buffer identities cannot be reused by other tensors while the packed
/// copy exists) and released with the job. The job's model weights ([`WeightCache::note_weight`]:
/// its parameters, derived parameters and cached weight slices) are kept however large; packed
/// copies of other tensors — a computed value a product reads as its weight — only up to
/// [`OTHER_MAX_BYTES`] in all, then packed per launch: each such tensor is new, and a stacked
/// model's layer slices copied per invocation under the eager scheduler kept 1.4 GB a run, more
/// at every `--repeat`.
#[derive(Default)]
pub struct WeightCache {
    /// Buffers of the job's model weights.
    weights: Mutex<std::collections::HashSet<usize>>,
    /// Bytes of packed copies kept of tensors that are not model weights.
    other_bytes: std::sync::atomic::AtomicUsize,
    single: Mutex<Single>,
    concat: Mutex<Concat>,
    /// `Wᵀ` packed (the backward's `dX = dY · W`), keyed like `single`.
    transposed: Mutex<Single>,
    /// Column blocks `W[:, k0..k0 + k]` packed (a product over a concatenation, one block per
    /// part), keyed by (buffer, N, K, k0, k).
    columns: Mutex<Columns>,
    /// Shared left operands packed as the GEMM's A (`X` of `X · [Y_1; ..]`), keyed by
    /// (buffer, M, K).
    rows: Mutex<LeftRows>,
}

type LeftRows = WordMap<(usize, usize, usize), (Tensor, Arc<PackedRows>)>;

/// `x` (M × K), a left operand shared by many products, packed as their A once per job
/// ([`tumble_kernels::Rows::Packed`]: MV-RNN's `W_M` in `W_M · [A; B]`, a product per node).
pub fn packed_rows(x: &Tensor, m: usize, k: usize) -> Result<Arc<PackedRows>, String> {
    let key = (x.buffer_id(), m, k);
    WeightCache::with(|cache| {
        if let Some(Ok(c)) = cache.map(|c| c.rows.lock()) {
            if let Some((_, p)) = c.get(&key) {
                return Ok(p.clone());
            }
        }
        let data = x
            .as_f32()
            .ok_or("product: the left operand is not float32")?;
        let p = Arc::new(PackedRows::pack(data, m, k).map_err(|e| e.to_string())?);
        if let Some(mut c) = WeightCache::keeping(cache, [key.0], 4 * m * k, |c| &c.rows) {
            c.insert(key, (x.clone(), p.clone()));
        }
        Ok(p)
    })
}

/// Whether a shared left operand of per-invocation products is packed once per job
/// ([`packed_rows`]) instead of read in place or packed at every product;
/// `TUMBLE_NO_PREPACKED_A=1` turns it off (the A/B baseline; the same bits either way).
pub fn prepacked_a_enabled() -> bool {
    !tumble_limits::switch_on!("TUMBLE_NO_PREPACKED_A")
}

type Columns = WordMap<(usize, usize, usize, usize, usize), (Tensor, Arc<PackedWeight>)>;

/// Columns `k0..k0 + k` of weight `w` (N, K) packed as a weight of their own (the weight of one
/// part of a product over a concatenation), packing on first use in this job.
pub fn packed_columns(
    w: &Tensor,
    n: usize,
    kk: usize,
    k0: usize,
    k: usize,
) -> Result<Arc<PackedWeight>, String> {
    if k0 == 0 && k == kk {
        return packed(w, n, kk);
    }
    let key = (w.buffer_id(), n, kk, k0, k);
    WeightCache::with(|cache| {
        if let Some(Ok(c)) = cache.map(|c| c.columns.lock()) {
            if let Some((_, p)) = c.get(&key) {
                return Ok(p.clone());
            }
        }
        let data = w.as_f32().ok_or("dense stage: the weight is not float32")?;
        if data.len() != n * kk || k0 + k > kk {
            return Err(format!(
                "dense stage: columns {k0}..{} of a weight of {} elements, not {n} × {kk}",
                k0 + k,
                data.len()
            ));
        }
        let block: Vec<f32> = data
            .chunks_exact(kk.max(1))
            .flat_map(|row| row.get(k0..k0 + k).unwrap_or(&[]))
            .copied()
            .collect();
        let p = Arc::new(PackedWeight::pack(&block, n, k).map_err(|e| e.to_string())?);
        if let Some(mut c) = WeightCache::keeping(cache, [key.0], 4 * n * k, |c| &c.columns) {
            c.insert(key, (w.clone(), p.clone()));
        }
        Ok(p)
    })
}

thread_local! {
    /// The cache of the job whose mini-batch this thread is running (see [`WeightCache::enter`]).
    static CURRENT: RefCell<Option<Arc<WeightCache>>> = const { RefCell::new(None) };
    /// Weights this thread looked up outside any job's cache ([`uncached_packs`]).
    static UNCACHED: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

/// How many weights this thread has packed (or looked up) outside a job's cache: a launch that
/// runs without [`WeightCache::enter`] packs its weights again every time, which tests check
/// does not happen on the paths that run jobs (runs, sessions, training).
pub fn uncached_packs() -> u64 {
    UNCACHED.with(|n| n.get())
}

/// Restores the thread's previous cache when the mini-batch ends (or unwinds).
pub struct Entered(Option<Arc<WeightCache>>);

impl Drop for Entered {
    fn drop(&mut self) {
        let previous = self.0.take();
        CURRENT.with(|c| *c.borrow_mut() = previous);
    }
}

/// Packed copies of tensors other than model weights a job keeps at most ([`WeightCache`]).
pub const OTHER_MAX_BYTES: usize = 64 << 20;

impl WeightCache {
    /// Marks `t` a model weight of the job: its packed copies are kept whatever their size.
    pub(crate) fn note_weight(&self, t: &Tensor) {
        if let Ok(mut w) = self.weights.lock() {
            w.insert(t.buffer_id());
        }
    }

    /// `map` of `cache`, locked, when a packed copy of `bytes` for the tensors `ids` is to be
    /// kept there ([`WeightCache::keeps`]); `None` outside a job or past the bound.
    fn keeping<'c, M>(
        cache: Option<&'c WeightCache>,
        ids: impl IntoIterator<Item = usize>,
        bytes: usize,
        map: impl FnOnce(&'c WeightCache) -> &'c Mutex<M>,
    ) -> Option<std::sync::MutexGuard<'c, M>> {
        let c = cache.filter(|c| c.keeps(ids.into_iter(), bytes))?;
        map(c).lock().ok()
    }

    /// Whether a packed copy of `bytes` for the tensors `ids` is kept: always for model
    /// weights, for others while their copies stay within [`OTHER_MAX_BYTES`].
    fn keeps(&self, mut ids: impl Iterator<Item = usize>, bytes: usize) -> bool {
        use std::sync::atomic::Ordering;
        let weights = self
            .weights
            .lock()
            .is_ok_and(|w| ids.all(|id| w.contains(&id)));
        weights
            || self
                .other_bytes
                .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |b| {
                    b.checked_add(bytes).filter(|&t| t <= OTHER_MAX_BYTES)
                })
                .is_ok()
    }

    /// Drops every packed copy (and the weights held for their keys): the weights are about to
    /// change in place, so a copy keyed by a weight's buffer would no longer be that weight.
    pub(crate) fn clear(&self) {
        if let Ok(mut w) = self.weights.lock() {
            w.clear();
        }
        self.other_bytes
            .store(0, std::sync::atomic::Ordering::Relaxed);
        if let Ok(mut c) = self.single.lock() {
            c.clear();
        }
        if let Ok(mut c) = self.concat.lock() {
            c.clear();
        }
        if let Ok(mut c) = self.transposed.lock() {
            c.clear();
        }
        if let Ok(mut c) = self.columns.lock() {
            c.clear();
        }
        if let Ok(mut c) = self.rows.lock() {
            c.clear();
        }
    }

    /// Makes `cache` the one GEMMs on this thread use until the guard drops. Launches run on the
    /// thread of their mini-batch (kernels may fan out, but pack before they do), so a
    /// thread-local reaches every GEMM without threading the cache through the batching rules.
    pub fn enter(cache: &Arc<WeightCache>) -> Entered {
        Entered(CURRENT.with(|c| c.borrow_mut().replace(cache.clone())))
    }

    /// Runs `f` with the thread's current cache (`None` outside a job: pack without caching,
    /// counted by [`uncached_packs`]).
    fn with<R>(f: impl FnOnce(Option<&WeightCache>) -> R) -> R {
        let current = CURRENT.with(|c| c.borrow().clone());
        if current.is_none() {
            UNCACHED.with(|n| n.set(n.get() + 1));
        }
        f(current.as_deref())
    }
}

/// The packed form of weight `w` (N, K), packing it on first use in this job.
pub fn packed(w: &Tensor, n: usize, k: usize) -> Result<Arc<PackedWeight>, String> {
    cached(
        w,
        n,
        k,
        |c| &c.single,
        |data| PackedWeight::pack(data, n, k),
    )
}

/// `W` (N, K) packed as the weight of `A · W` (that is, `Wᵀ` packed: the backward's
/// `dX = dY · W`), packing on first use in this job.
pub fn packed_transposed(w: &Tensor, n: usize, k: usize) -> Result<Arc<PackedWeight>, String> {
    cached(
        w,
        n,
        k,
        |c| &c.transposed,
        |data| {
            let rows: Vec<&[f32]> = data.chunks_exact(k.max(1)).collect();
            PackedWeight::from_rows_kn(&rows, k)
        },
    )
}

/// `w` packed by `pack` (from its f32 elements), kept in the job's map `map` under
/// `(buffer, n, k)`; packed now when it is not there yet (or outside a job).
fn cached(
    w: &Tensor,
    n: usize,
    k: usize,
    map: impl Fn(&WeightCache) -> &Mutex<Single>,
    pack: impl FnOnce(&[f32]) -> Result<PackedWeight, tumble_kernels::KernelError>,
) -> Result<Arc<PackedWeight>, String> {
    let key = (w.buffer_id(), n, k);
    WeightCache::with(|cache| {
        if let Some(Ok(c)) = cache.map(|c| map(c).lock()) {
            if let Some((_, p)) = c.get(&key) {
                return Ok(p.clone());
            }
        }
        let data = w.as_f32().ok_or("dense stage: the weight is not float32")?;
        if data.len() != n * k {
            return Err(format!(
                "dense stage: a weight of {} elements is not {n} × {k}",
                data.len()
            ));
        }
        let p = Arc::new(pack(data).map_err(|e| e.to_string())?);
        if let Some(mut c) = WeightCache::keeping(cache, [key.0], 4 * n * k, map) {
            c.insert(key, (w.clone(), p.clone()));
        }
        Ok(p)
    })
}

/// The packed form of the weights `ws` (each (N_i, k)) stacked along N, packing on first use.
pub fn packed_concat(ws: &[Tensor], k: usize) -> Result<Arc<PackedWeight>, String> {
    let key = (
        ws.iter()
            .map(|w| (w.buffer_id(), w.shape().first().copied().unwrap_or(0)))
            .collect::<Vec<_>>(),
        k,
    );
    WeightCache::with(|cache| {
        if let Some(Ok(c)) = cache.map(|c| c.concat.lock()) {
            if let Some((_, p)) = c.get(&key) {
                return Ok(p.clone());
            }
        }
        let n: usize = key.0.iter().map(|(_, n)| n).sum();
        let mut data = Vec::with_capacity(n * k);
        for w in ws {
            data.extend_from_slice(w.as_f32().ok_or("dense stage: a weight is not float32")?);
        }
        let p = Arc::new(PackedWeight::pack(&data, n, k).map_err(|e| e.to_string())?);
        if let Some(mut c) =
            WeightCache::keeping(cache, key.0.iter().map(|&(id, _)| id), 4 * n * k, |c| {
                &c.concat
            })
        {
            c.insert(key.clone(), (ws.to_vec(), p.clone()));
        }
        Ok(p)
    })
}

/// C (rows, n) = A (rows, k) · Wᵀ, the rows contiguous or gathered.
pub fn dense(
    a: &Rows,
    k: usize,
    w: &Tensor,
    n: usize,
    c: &mut [f32],
    threads: usize,
) -> Result<(), String> {
    dense_with(a, k, w, n, c, &NoEpilogue, threads)
}

/// [`dense`] with `epilogue` run on each block of finished rows while they are in cache (the
/// training forward's bias and gates, [`crate::fastops::dense_f32`]).
pub fn dense_with(
    a: &Rows,
    k: usize,
    w: &Tensor,
    n: usize,
    c: &mut [f32],
    epilogue: &dyn tumble_kernels::Epilogue,
    threads: usize,
) -> Result<(), String> {
    let pw = packed(w, n, k)?;
    tumble_kernels::dense(a, &pw, c, epilogue, threads).map_err(|e| e.to_string())
}

/// Products with fewer rows than this whose weight is used once run as dot products (packing
/// the weight would cost more than it saves: MV-RNN's one-row compositions); with at least this
/// many, on the packed GEMM kernel (attention's per-sentence products, a row per token).
pub const SMALL_PRODUCT_MIN_ROWS: usize = 8;

static SMALL_PRODUCTS_OFF: std::sync::atomic::AtomicBool =
    std::sync::atomic::AtomicBool::new(false);

/// Turns the GEMM kernel for per-invocation and batched-matmul products on or off for the whole
/// process (on by default; off also with `TUMBLE_NO_SMALL_PRODUCT_GEMM` set): off, every such
/// product runs as dot products.
pub fn set_small_product_gemm(on: bool) {
    SMALL_PRODUCTS_OFF.store(!on, std::sync::atomic::Ordering::Relaxed);
}

/// Whether a product of `m` rows with a weight used once takes the GEMM kernel.
fn small_product_gemm(m: usize) -> bool {
    m >= SMALL_PRODUCT_MIN_ROWS
        && !SMALL_PRODUCTS_OFF.load(std::sync::atomic::Ordering::Relaxed)
        && !tumble_limits::switch_on!("TUMBLE_NO_SMALL_PRODUCT_GEMM")
}

/// Whether the dot products of a product with a weight used once run on the kernels' vector
/// loops (`tumble_kernels::dot_rows`: AVX-512 or AVX2 + FMA, eight weight rows per pass over
/// the row); `TUMBLE_NO_SIMD_DOTS=1` runs them as plain eight-accumulator loops, the A/B
/// baseline (MV-RNN-large's per-word products: 14% of its time there).
fn simd_dots() -> bool {
    !tumble_limits::switch_on!("TUMBLE_NO_SIMD_DOTS")
}

/// Work below which products are not split across threads: starting a thread costs tens of
/// microseconds, a 2^20-multiply-add product about 20.
const SPLIT_MIN_MACS: usize = 1 << 20;

/// Runs `count` products, product `i` writing its `c_len` floats of `out` (which holds
/// `count × c_len`) by `job(i, slice)`, on up to `threads` threads when the products together
/// (`macs_each` multiply-adds each) are worth splitting.
pub fn small_products(
    count: usize,
    c_len: usize,
    macs_each: usize,
    threads: usize,
    out: &mut [f32],
    job: impl Fn(usize, &mut [f32]) -> Result<(), String> + Sync,
) -> Result<(), String> {
    if out.len() != count * c_len {
        return Err("internal: products' output of the wrong size".into());
    }
    let threads = threads.min(count).max(1);
    if threads == 1 || count * macs_each < SPLIT_MIN_MACS || c_len == 0 {
        for (i, c) in out.chunks_exact_mut(c_len.max(1)).enumerate() {
            job(i, c)?;
        }
        return Ok(());
    }
    let per = count.div_ceil(threads);
    std::thread::scope(|s| {
        let mut parts = out.chunks_mut(per * c_len).enumerate();
        let first = parts.next();
        let handles: Vec<_> = parts
            .map(|(p, part)| {
                let job = &job;
                s.spawn(move || {
                    for (j, c) in part.chunks_exact_mut(c_len).enumerate() {
                        job(p * per + j, c)?;
                    }
                    Ok::<(), String>(())
                })
            })
            .collect();
        if let Some((_, part)) = first {
            for (j, c) in part.chunks_exact_mut(c_len).enumerate() {
                job(j, c)?;
            }
        }
        for h in handles {
            h.join()
                .map_err(|_| "internal: a product thread panicked".to_string())??;
        }
        Ok(())
    })
}

/// C (m × n) = X (m × k) · Wᵀ for `w` given row-major as (n × k) when `transposed`, else
/// C = X · W for `w` (k × n): one product whose weight is used once, on this thread. With at
/// least [`SMALL_PRODUCT_MIN_ROWS`] rows the weight is packed here (not cached) and the rows go
/// through the GEMM kernel; with fewer (or the switch off), dot products. `c` is overwritten.
pub fn small_product(
    x: &[f32],
    m: usize,
    k: usize,
    w: &[f32],
    n: usize,
    transposed: bool,
    c: &mut [f32],
) -> Result<(), String> {
    let err = |e: tumble_kernels::KernelError| e.to_string();
    if x.len() != m * k || w.len() != n * k || c.len() != m * n {
        return Err(format!(
            "internal: product of {} × {k} by {n} × {k} into {} floats",
            x.len() / k.max(1),
            c.len()
        ));
    }
    if k == 0 || n == 0 {
        c.fill(0.0);
        return Ok(());
    }
    if !small_product_gemm(m) {
        for (xr, cr) in x.chunks_exact(k.max(1)).zip(c.chunks_exact_mut(n.max(1))) {
            if transposed && simd_dots() {
                tumble_kernels::dot_rows(xr, w, k, cr);
            } else if transposed {
                for (j, cj) in cr.iter_mut().enumerate() {
                    *cj = crate::fused::dot(xr, &w[j * k..(j + 1) * k]);
                }
            } else {
                // c[i, :] = Σ_l x[i, l] · w[l, :], vectorized along the row of w.
                cr.fill(0.0);
                for (&xv, wr) in xr.iter().zip(w.chunks_exact(n.max(1))) {
                    cr.iter_mut().zip(wr).for_each(|(cj, &wv)| *cj += xv * wv);
                }
            }
        }
        return Ok(());
    }
    let pw = if transposed {
        PackedWeight::pack(w, n, k).map_err(err)?
    } else {
        let rows: Vec<&[f32]> = w.chunks_exact(n.max(1)).collect();
        PackedWeight::from_rows_kn(&rows, n).map_err(err)?
    };
    let a = Rows::Contiguous { data: x, stride: k };
    tumble_kernels::dense(&a, &pw, c, &NoEpilogue, 1).map_err(err)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entries(cache: &WeightCache) -> usize {
        cache.single.lock().map_or(0, |c| c.len())
    }

    /// A job keeps the packed copies of its model weights, and of other tensors only up to
    /// `OTHER_MAX_BYTES`: weights computed anew for every launch are packed per launch instead
    /// of piling up for the job.
    #[test]
    fn packed_copies_of_computed_weights_are_bounded() {
        let cache = Arc::new(WeightCache::default());
        let _job = WeightCache::enter(&cache);
        let (n, k) = (256, 256);
        let weight = Tensor::from_vec(vec![n, k], vec![0.5f32; n * k]).unwrap();
        cache.note_weight(&weight);
        let first = packed(&weight, n, k).unwrap();
        assert!(Arc::ptr_eq(&first, &packed(&weight, n, k).unwrap()));
        // 256 KiB each: past the bound after 256 of them.
        let per = 4 * n * k;
        let fresh: Vec<Tensor> = (0..OTHER_MAX_BYTES / per + 40)
            .map(|i| Tensor::from_vec(vec![n, k], vec![i as f32; n * k]).unwrap())
            .collect();
        for t in &fresh {
            packed(t, n, k).unwrap();
        }
        assert_eq!(entries(&cache), 1 + OTHER_MAX_BYTES / per);
        // A weight noted later is kept past the bound, and its copy is its own.
        let late = Tensor::from_vec(vec![n, k], vec![2.0f32; n * k]).unwrap();
        cache.note_weight(&late);
        let p = packed(&late, n, k).unwrap();
        assert!(Arc::ptr_eq(&p, &packed(&late, n, k).unwrap()));
        assert_eq!(entries(&cache), 2 + OTHER_MAX_BYTES / per);
        // Forgetting the weights' values starts the bound afresh.
        cache.clear();
        packed(&fresh[0], n, k).unwrap();
        assert_eq!(entries(&cache), 1);
    }

    /// `small_product` against plain loops at odd sizes, both weight layouts.
    #[test]
    fn small_products_at_odd_sizes() {
        let mut seed = 1u32;
        let mut next = move || {
            seed = seed.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
            (seed >> 8) as f32 / (1u32 << 24) as f32 - 0.5
        };
        // Below 8 rows dot products, from 8 the GEMM kernel.
        for (m, k, n) in [
            (1, 5, 3),
            (7, 9, 2),
            (1, 128, 128),
            (3, 37, 19),
            (2, 33, 9),
            (5, 16, 8),
            (8, 1, 1),
            (9, 3, 17),
            (14, 64, 128),
            (33, 65, 7),
            (128, 128, 64),
        ] {
            let x: Vec<f32> = (0..m * k).map(|_| next()).collect();
            let w: Vec<f32> = (0..n * k).map(|_| next()).collect();
            for transposed in [true, false] {
                let mut c = vec![f32::NAN; m * n];
                small_product(&x, m, k, &w, n, transposed, &mut c).unwrap();
                for i in 0..m {
                    for j in 0..n {
                        let want: f64 = (0..k)
                            .map(|l| {
                                let wv = if transposed {
                                    w[j * k + l]
                                } else {
                                    w[l * n + j]
                                };
                                f64::from(x[i * k + l]) * f64::from(wv)
                            })
                            .sum();
                        let got = f64::from(c[i * n + j]);
                        assert!(
                            (got - want).abs() <= 1e-5 * (1.0 + want.abs()),
                            "{m}×{k}×{n} {transposed}: [{i}, {j}] {got} against {want}"
                        );
                    }
                }
            }
        }
        // Split across threads: every product where it belongs, the same bits as on one.
        let (count, m, k, n) = (7, 64, 48, 40);
        let x: Vec<f32> = (0..count * m * k).map(|_| next()).collect();
        let w: Vec<f32> = (0..count * n * k).map(|_| next()).collect();
        let run = |threads: usize| {
            let mut out = vec![f32::NAN; count * m * n];
            small_products(count, m * n, (1 << 20) / 2, threads, &mut out, |i, c| {
                small_product(
                    &x[i * m * k..(i + 1) * m * k],
                    m,
                    k,
                    &w[i * n * k..(i + 1) * n * k],
                    n,
                    true,
                    c,
                )
            })
            .unwrap();
            out
        };
        let one = run(1);
        assert!(one.iter().all(|v| v.is_finite()));
        assert_eq!(one, run(2));
        assert_eq!(one, run(5));
        // Sizes that do not fit are an error, not a panic.
        assert!(small_product(&[0.0; 3], 1, 2, &[0.0; 2], 1, true, &mut [0.0]).is_err());
    }
}
