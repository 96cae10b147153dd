//! Dense stages on the SIMD kernels of `tumble-kernels`. Weights are packed once per weight tensor
//! (or per list of weight tensors, for horizontally fused denses) and job, in the job's
//! [`WeightCache`].

use std::cell::RefCell;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use tumble_kernels::{NoEpilogue, PackedWeight, Rows};
use tumble_tensor::Tensor;

type Single = HashMap<(usize, usize, usize), (Tensor, Arc<PackedWeight>)>;
type Concat = HashMap<(Vec<(usize, usize)>, usize), (Vec<Tensor>, Arc<PackedWeight>)>;

/// Packed weights of one job ([`crate::Executable`]): keyed by weight buffer (the cache holds
/// the tensors, so their buffer identities cannot be reused by other tensors while the packed
/// copy exists) and released with the job.
#[derive(Default)]
pub struct WeightCache {
    single: Mutex<Single>,
    concat: Mutex<Concat>,
    /// `Wᵀ` packed (the backward's `dX = dY · W`), keyed like `single`.
    transposed: Mutex<Single>,
}

thread_local! {
    /// The cache of the job whose mini-batch this thread is running (see [`WeightCache::enter`]).
    static CURRENT: RefCell<Option<Arc<WeightCache>>> = const { RefCell::new(None) };
}

/// Restores the thread's previous cache when the mini-batch ends (or unwinds).
pub struct Entered(Option<Arc<WeightCache>>);

impl Drop for Entered {
    fn drop(&mut self) {
        let previous = self.0.take();
        CURRENT.with(|c| *c.borrow_mut() = previous);
    }
}

impl WeightCache {
    /// Makes `cache` the one GEMMs on this thread use until the guard drops. Launches run on the
    /// thread of their mini-batch (kernels may fan out, but pack before they do), so a
    /// thread-local reaches every GEMM without threading the cache through the batching rules.
    pub fn enter(cache: &Arc<WeightCache>) -> Entered {
        Entered(CURRENT.with(|c| c.borrow_mut().replace(cache.clone())))
    }

    /// Runs `f` with the thread's current cache (`None` outside a job: pack without caching).
    fn with<R>(f: impl FnOnce(Option<&WeightCache>) -> R) -> R {
        let current = CURRENT.with(|c| c.borrow().clone());
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
        if let Some(Ok(mut c)) = cache.map(|c| map(c).lock()) {
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
        if let Some(Ok(mut c)) = cache.map(|c| c.concat.lock()) {
            c.insert(key.clone(), (ws.to_vec(), p.clone()));
        }
        Ok(p)
    })
}

/// C (rows, ΣN_i) = A (rows, k) · [W_1; W_2; ...]ᵀ.
pub fn dense_concat(
    a: &Rows,
    k: usize,
    ws: &[Tensor],
    c: &mut [f32],
    threads: usize,
) -> Result<(), String> {
    let pw = packed_concat(ws, k)?;
    tumble_kernels::dense(a, &pw, c, &NoEpilogue, threads).map_err(|e| e.to_string())
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
    let pw = packed(w, n, k)?;
    tumble_kernels::dense(a, &pw, c, &NoEpilogue, threads).map_err(|e| e.to_string())
}
