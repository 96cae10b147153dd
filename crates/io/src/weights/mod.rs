//! Weights files in and out: safetensors files and directories of `.npy` files.
//!
//! Everything read from disk is validated before it is trusted: lengths, offsets and element
//! counts use checked arithmetic, and a truncated or corrupt file is an [`IoError`] naming the
//! file and what is wrong with it, never a panic.

use std::collections::BTreeMap;
use std::path::Path;

use tumble_ir::DType;
use tumble_tensor::{Buffer, Tensor};

use crate::IoError;

mod npy;
mod safetensors;

pub use npy::{load_npy_dir, npy_bytes, parse_npy};
use safetensors::read_safetensors_file;
pub use safetensors::{parse_safetensors, safetensors_bytes, save_params, stage_params};
pub(crate) use safetensors::{read_safetensors_from, read_up_to, write_safetensors};

/// The tensors of a weights file, by name, plus warnings about their values (NaN or infinite
/// elements) that do not stop a run but that the user should see.
#[derive(Clone, Default)]
pub struct LoadedParams {
    pub tensors: BTreeMap<String, Tensor>,
    pub warnings: Vec<String>,
}

/// Loads named tensors from `path`:
///
/// - a directory: every `*.npy` file in it (not recursively) is one tensor named by the file
///   stem (`W_iou.npy` → `W_iou`); other files are ignored;
/// - a file ending in `.npy`: that one tensor, named by its stem;
/// - any other file: a safetensors file.
///
/// Supported element types: float32, float64, int32, int64, bool (safetensors `F32 F64 I32 I64
/// BOOL`, numpy `<f4 <f8 <i4 <i8 |b1`); anything else is an error naming the type.
pub fn load_params(path: &Path) -> Result<LoadedParams, IoError> {
    load_params_on(path, 1)
}

/// [`load_params`] with a large safetensors file's tensors decoded on up to `threads` threads
/// (the same tensors and warnings; `--threads` of the command that reads them).
pub fn load_params_on(path: &Path, threads: usize) -> Result<LoadedParams, IoError> {
    let meta =
        std::fs::metadata(path).map_err(|e| IoError::file(path, "read the weights file", e))?;
    // Tensors the reader found ordinary (no NaN, infinity or subnormal) as it read them, a chunk
    // at a time while in cache: the two scans below, each a pass over memory (0.19 s of
    // Berxit-small's 464 MB), skip them.
    let mut ordinary = std::collections::BTreeSet::new();
    let tensors = if meta.is_dir() {
        load_npy_dir(path)?
    } else if path.extension().is_some_and(|e| e == "npy") {
        let bytes = read_file(path)?;
        let mut m = BTreeMap::new();
        m.insert(file_stem(path), parse_npy(path, &bytes)?);
        m
    } else {
        read_safetensors_file(path, threads, &mut ordinary)?
    };
    let mut tensors = tensors;
    let mut warnings = non_finite_warnings_but(path, &tensors, &ordinary);
    if !tumble_limits::env_flag("TUMBLE_KEEP_SUBNORMAL_WEIGHTS") {
        warnings.extend(flush_subnormals_but(path, &mut tensors, &ordinary));
    }
    Ok(LoadedParams { tensors, warnings })
}

/// Sets the subnormal elements of every float tensor to zero, with one warning per tensor that
/// had any. An operation reading or making a subnormal takes a microcode assist on x86 CPUs, so
/// a product reading such weights runs several times slower — weights trained with weight decay
/// end up with many: SST's TreeLSTM with an embedding two-thirds subnormal ran its test set 4×
/// slower (3.25 s against 0.79 s, kernels 8.7×). Zero differs from them by less than 1.2e-38
/// (2.3e-308 for f64), below anything a product of them can show. `TUMBLE_KEEP_SUBNORMAL_WEIGHTS=1`
/// keeps them.
pub fn flush_subnormals(path: &Path, tensors: &mut BTreeMap<String, Tensor>) -> Vec<String> {
    flush_subnormals_but(path, tensors, &Default::default())
}

/// [`flush_subnormals`] of the tensors not named in `ordinary` (known to hold none).
fn flush_subnormals_but(
    path: &Path,
    tensors: &mut BTreeMap<String, Tensor>,
    ordinary: &std::collections::BTreeSet<String>,
) -> Vec<String> {
    let mut out = Vec::new();
    for (name, t) in tensors.iter_mut() {
        if ordinary.contains(name) {
            continue;
        }
        let found = t.flush_subnormals();
        if found == 0 {
            continue;
        }
        out.push(format!(
            "weights file `{}`: tensor `{name}` has {found} subnormal value{} (of {}), read as \
             zero: products reading subnormals run several times slower \
             (TUMBLE_KEEP_SUBNORMAL_WEIGHTS=1 keeps them)",
            path.display(),
            if found == 1 { "" } else { "s" },
            t.len()
        ));
    }
    out
}

fn read_file(path: &Path) -> Result<Vec<u8>, IoError> {
    tumble_limits::read_file(path).map_err(|e| IoError::file(path, "read the weights file", e))
}

fn file_stem(path: &Path) -> String {
    path.file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_default()
}

/// One warning per tensor of `tensors` that holds NaN or infinite values.
pub fn non_finite_warnings(path: &Path, tensors: &BTreeMap<String, Tensor>) -> Vec<String> {
    non_finite_warnings_but(path, tensors, &Default::default())
}

/// [`non_finite_warnings`] of the tensors not named in `ordinary` (known to be finite).
fn non_finite_warnings_but(
    path: &Path,
    tensors: &BTreeMap<String, Tensor>,
    ordinary: &std::collections::BTreeSet<String>,
) -> Vec<String> {
    let mut out = Vec::new();
    for (name, t) in tensors {
        if ordinary.contains(name) {
            continue;
        }
        let (nan, inf) = match t.buffer() {
            // Almost every weight file is all finite: a vectorized pass says so before the
            // counting pass runs (~0.1 s for 13 M floats otherwise).
            _ if t.all_finite() => (0, 0),
            Buffer::F32(v) => count_non_finite(v.iter().map(|&x| f64::from(x))),
            Buffer::F64(v) => count_non_finite(v.iter().copied()),
            _ => (0, 0),
        };
        if nan + inf > 0 {
            out.push(format!(
                "weights file `{}`: tensor `{name}` has {nan} NaN and {inf} infinite value{} \
                 (of {}); results computed from it will likely be NaN",
                path.display(),
                if inf == 1 { "" } else { "s" },
                t.len()
            ));
        }
    }
    out
}

fn count_non_finite(xs: impl Iterator<Item = f64>) -> (usize, usize) {
    xs.fold((0, 0), |(nan, inf), x| {
        if x.is_nan() {
            (nan + 1, inf)
        } else if x.is_infinite() {
            (nan, inf + 1)
        } else {
            (nan, inf)
        }
    })
}

// ---------------------------------------------------------------------------------------------
// Raw little-endian element bytes

/// Decodes the little-endian elements of `dtype` in `bytes` (a whole number of them).
fn decode_le(dtype: DType, bytes: &[u8]) -> Buffer {
    let mut out = Buffer::with_capacity(dtype, bytes.len() / dtype.size().max(1));
    append_le(&mut out, bytes);
    out
}

/// Appends the little-endian elements in `bytes` to `out` (of their dtype).
fn append_le(out: &mut Buffer, bytes: &[u8]) {
    fn extend<const N: usize, T>(out: &mut Vec<T>, bytes: &[u8], f: impl Fn([u8; N]) -> T) {
        out.extend(bytes.chunks_exact(N).map(|c| {
            let mut a = [0u8; N];
            a.copy_from_slice(c);
            f(a)
        }));
    }
    match out {
        Buffer::F32(v) => extend(v, bytes, f32::from_le_bytes),
        Buffer::F64(v) => extend(v, bytes, f64::from_le_bytes),
        Buffer::I32(v) => extend(v, bytes, i32::from_le_bytes),
        Buffer::I64(v) => extend(v, bytes, i64::from_le_bytes),
        // Any nonzero byte is true, as numpy does when it views the bytes as bool.
        Buffer::Bool(v) => v.extend(bytes.iter().map(|&b| b != 0)),
    }
}

fn encode_le(buffer: &Buffer) -> Vec<u8> {
    match buffer {
        Buffer::F32(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        Buffer::F64(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        Buffer::I32(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        Buffer::I64(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        Buffer::Bool(v) => v.iter().map(|&b| u8::from(b)).collect(),
    }
}

/// Byte size of a tensor of `shape` and element size `elem`, `None` on overflow.
fn byte_size(shape: &[usize], elem: usize) -> Option<usize> {
    shape
        .iter()
        .try_fold(1usize, |acc, &d| acc.checked_mul(d))
        .and_then(|n| n.checked_mul(elem))
}
