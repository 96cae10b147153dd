//! Dense stages on the SIMD kernels of `tumble-kernels`. Weights are packed once per weight tensor
//! and cached for the life of the process (the cache holds the tensor, so its buffer identity cannot
//! be reused by another tensor while the packed copy exists).

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

/// C (rows, n) = A (rows, k) · Wᵀ for contiguous rows of A.
pub fn dense(
    a: &[f32],
    k: usize,
    w: &Tensor,
    n: usize,
    c: &mut [f32],
    threads: usize,
) -> Result<(), String> {
    let pw = packed(w, n, k)?;
    let rows = Rows::Contiguous { data: a, stride: k };
    tumble_kernels::dense(&rows, &pw, c, &NoEpilogue, threads).map_err(|e| e.to_string())
}
