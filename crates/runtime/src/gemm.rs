//! Dense stages on the SIMD kernels of `tumble-kernels`. Weights are packed once per weight tensor
//! (or per list of weight tensors, for horizontally fused denses) and cached for the life of the
//! process (the cache holds the tensors, so their buffer identities cannot be reused by other
//! tensors while the packed copy exists).

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

use tumble_kernels::{NoEpilogue, PackedWeight, Rows};
use tumble_tensor::Tensor;

type Cache = Mutex<HashMap<(usize, usize, usize), (Tensor, Arc<PackedWeight>)>>;

fn cache() -> &'static Cache {
    static CACHE: OnceLock<Cache> = OnceLock::new();
    CACHE.get_or_init(|| Mutex::new(HashMap::new()))
}

/// The packed form of weight `w` (N, K), packing it on first use.
pub fn packed(w: &Tensor, n: usize, k: usize) -> Result<Arc<PackedWeight>, String> {
    let key = (w.buffer_id(), n, k);
    if let Ok(c) = cache().lock() {
        if let Some((_, p)) = c.get(&key) {
            return Ok(p.clone());
        }
    }
    let data = w.as_f32().ok_or("dense stage: the weight is not float32")?;
    let p = Arc::new(PackedWeight::pack(data, n, k).map_err(|e| e.to_string())?);
    if let Ok(mut c) = cache().lock() {
        c.insert(key, (w.clone(), p.clone()));
    }
    Ok(p)
}

type ConcatCache = Mutex<HashMap<(Vec<(usize, usize)>, usize), (Vec<Tensor>, Arc<PackedWeight>)>>;

fn concat_cache() -> &'static ConcatCache {
    static CACHE: OnceLock<ConcatCache> = OnceLock::new();
    CACHE.get_or_init(|| Mutex::new(HashMap::new()))
}

/// The packed form of the weights `ws` (each (N_i, k)) stacked along N, packing on first use.
pub fn packed_concat(ws: &[Tensor], k: usize) -> Result<Arc<PackedWeight>, String> {
    let key = (
        ws.iter()
            .map(|w| (w.buffer_id(), w.shape().first().copied().unwrap_or(0)))
            .collect::<Vec<_>>(),
        k,
    );
    if let Ok(c) = concat_cache().lock() {
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
    if let Ok(mut c) = concat_cache().lock() {
        c.insert(key, (ws.to_vec(), p.clone()));
    }
    Ok(p)
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

/// Drops every cached packed weight (and the weight tensors the caches hold). Training replaces
/// its weights at every step: without this the caches would keep every step's weights alive.
pub fn forget_packed() {
    if let Ok(mut c) = cache().lock() {
        c.clear();
    }
    if let Ok(mut c) = concat_cache().lock() {
        c.clear();
    }
}
