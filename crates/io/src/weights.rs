//! Weights files in and out: safetensors files and directories of `.npy` files.
//!
//! Everything read from disk is validated before it is trusted: lengths, offsets and element
//! counts use checked arithmetic, and a truncated or corrupt file is an [`IoError`] naming the
//! file and what is wrong with it, never a panic.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::Path;

use tumble_ir::DType;
use tumble_tensor::shape::format_shape;
use tumble_tensor::{Buffer, Tensor};

use crate::atomic::{stage, Staged};
use crate::IoError;

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

// ---------------------------------------------------------------------------------------------
// safetensors

const ST_MAX_HEADER: u64 = 100_000_000;

fn st_dtype(name: &str) -> Option<DType> {
    Some(match name {
        "F32" => DType::Float32,
        "F64" => DType::Float64,
        "I32" => DType::Int32,
        "I64" => DType::Int64,
        "BOOL" => DType::Bool,
        _ => return None,
    })
}

fn st_name(dtype: DType) -> safetensors::Dtype {
    match dtype {
        DType::Float32 => safetensors::Dtype::F32,
        DType::Float64 => safetensors::Dtype::F64,
        DType::Int32 => safetensors::Dtype::I32,
        DType::Int64 => safetensors::Dtype::I64,
        DType::Bool => safetensors::Dtype::BOOL,
    }
}

const UNSUPPORTED_HINT: &str = "tumble reads F32, F64, I32, I64 and BOOL; convert the tensor \
                                (e.g. `t.float()` in PyTorch) and save again";

/// One tensor of a safetensors file, as its header describes it (validated).
struct StEntry {
    name: String,
    dtype: DType,
    shape: Vec<usize>,
    /// Byte range in the data section.
    start: usize,
    end: usize,
}

/// The length of the JSON header from the first 8 bytes of a safetensors file of `len` bytes,
/// checked against the format's bound and the file's length.
fn st_header_len(path: &Path, first: &[u8], len: usize) -> Result<usize, IoError> {
    let err = |m: String| IoError::weights(path, m);
    let Some(len_bytes) = first.get(..8) else {
        return Err(err(format!(
            "the file is {len} bytes long, too short for a safetensors file (an 8-byte header \
             length, then a JSON header); it is truncated or not a safetensors file"
        )));
    };
    let mut a = [0u8; 8];
    a.copy_from_slice(len_bytes);
    let n = u64::from_le_bytes(a);
    if n > ST_MAX_HEADER {
        return Err(err(format!(
            "the header length field says {n} bytes, more than safetensors allows \
             ({ST_MAX_HEADER}); this is not a safetensors file, or it is corrupt"
        )));
    }
    // n <= 1e8, so this fits in usize on every platform tumble supports.
    let n = n as usize;
    let rest = len - 8;
    if n > rest {
        return Err(err(format!(
            "the header length field says {n} bytes, but only {rest} bytes follow it; \
             the file is truncated"
        )));
    }
    Ok(n)
}

/// Validates a safetensors header (the JSON after the length field) for a data section of
/// `data_len` bytes with precise messages — dtypes, shapes, offsets against the sizes they
/// imply, truncation, and that the tensors tile the data section as the format requires — and
/// returns its tensors in data order.
fn st_entries(path: &Path, header: &[u8], data_len: usize) -> Result<Vec<StEntry>, IoError> {
    let err = |m: String| IoError::weights(path, m);
    let mut entries = Vec::new();
    let text = std::str::from_utf8(header).map_err(|e| {
        err(format!(
            "the JSON header is not valid UTF-8 ({e}); the file is corrupt"
        ))
    })?;
    let json: serde_json::Value = serde_json::from_str(text).map_err(|e| {
        err(format!(
            "the JSON header does not parse ({e}); the file is corrupt"
        ))
    })?;
    let serde_json::Value::Object(map) = json else {
        return Err(err(
            "the JSON header is not an object; the file is corrupt".into()
        ));
    };
    // A JSON object keeps the last of repeated keys: a tensor listed twice would be bound by
    // whichever came last, silently.
    if let Some(name) = repeated_key(text) {
        return Err(err(format!(
            "the JSON header lists the tensor `{}` more than once; the file is corrupt",
            crate::echo(&name)
        )));
    }
    for (name, info) in &map {
        if name == "__metadata__" {
            // Free-form, but of the format's shape: a map of strings.
            let strings = info
                .as_object()
                .is_some_and(|m| m.values().all(serde_json::Value::is_string));
            if !strings {
                return Err(err(
                    "its `__metadata__` is not a map of strings; the file is corrupt".into(),
                ));
            }
            continue;
        }
        let bad = |what: &str| err(format!("tensor `{name}`: {what}; the file is corrupt"));
        let dtype_name = info
            .get("dtype")
            .and_then(|d| d.as_str())
            .ok_or_else(|| bad("the header gives no `dtype` string"))?;
        let Some(dtype) = st_dtype(dtype_name) else {
            return Err(err(format!(
                "tensor `{name}` has dtype {dtype_name}, which tumble does not support; \
                 {UNSUPPORTED_HINT}"
            )));
        };
        let dims = info
            .get("shape")
            .and_then(|s| s.as_array())
            .ok_or_else(|| bad("the header gives no `shape` list of sizes"))?;
        let mut shape: Vec<usize> = Vec::with_capacity(dims.len());
        for (i, d) in dims.iter().enumerate() {
            match d.as_u64().and_then(|d| usize::try_from(d).ok()) {
                Some(n) => shape.push(n),
                None => {
                    let shown: String = d.to_string().chars().take(40).collect();
                    return Err(bad(&format!(
                        "dimension {i} of its `shape` is {shown}, not a size (a non-negative integer)"
                    )));
                }
            }
        }
        let offsets: Vec<usize> = info
            .get("data_offsets")
            .and_then(|s| s.as_array())
            .and_then(|s| {
                s.iter()
                    .map(|d| d.as_u64().and_then(|d| usize::try_from(d).ok()))
                    .collect()
            })
            .filter(|o: &Vec<usize>| o.len() == 2)
            .ok_or_else(|| bad("the header gives no `data_offsets` pair"))?;
        let (start, end) = (offsets[0], offsets[1]);
        let need = byte_size(&shape, dtype.size())
            .ok_or_else(|| bad(&format!("shape {} is too large", format_shape(&shape))))?;
        if end < start || end - start != need {
            return Err(bad(&format!(
                "shape {} of {dtype_name} needs {need} bytes, but its data_offsets [{start}, {end}] \
                 describe {} bytes",
                format_shape(&shape),
                end.saturating_sub(start)
            )));
        }
        if end > data_len {
            return Err(err(format!(
                "tensor `{name}` ends at byte {end} of the data section, but the file has only \
                 {data_len} data bytes; the file is truncated"
            )));
        }
        entries.push(StEntry {
            name: name.clone(),
            dtype,
            shape,
            start,
            end,
        });
    }
    // The format's layout: the tensors, in offset order, cover the data section exactly.
    entries.sort_by_key(|e| (e.start, e.end));
    let mut at = 0;
    for e in &entries {
        if e.start != at {
            return Err(err(format!(
                "tensor `{}` starts at byte {} of the data section, where {} was expected (the \
                 tensors must follow each other without gaps or overlaps); the file is corrupt",
                e.name, e.start, at
            )));
        }
        at = e.end;
    }
    if at != data_len {
        return Err(err(format!(
            "the tensors end at byte {at} of the data section, but it has {data_len} bytes; \
             the file is corrupt"
        )));
    }
    Ok(entries)
}

/// Parses the bytes of a safetensors file (`path` is for messages).
pub fn parse_safetensors(path: &Path, bytes: &[u8]) -> Result<BTreeMap<String, Tensor>, IoError> {
    let n = st_header_len(path, bytes, bytes.len())?;
    let (header, data) = bytes.get(8..).unwrap_or_default().split_at(n);
    let mut out = BTreeMap::new();
    for e in st_entries(path, header, data.len())? {
        let raw = data.get(e.start..e.end).unwrap_or_default();
        let tensor = Tensor::new(e.shape, decode_le(e.dtype, raw))
            .map_err(|err| IoError::weights(path, format!("tensor `{}`: {err}", e.name)))?;
        out.insert(e.name, tensor);
    }
    Ok(out)
}

/// Reads a safetensors file tensor by tensor, each decoded straight from the file into its own
/// buffer through one small reused chunk — not the whole file into memory first and then a
/// decoded copy, which touched every byte of the weights twice in fresh pages (start-up is bound
/// by weight I/O; `bench/RESULTS.md`). Memory is reserved against the budget per tensor.
fn read_safetensors_file(
    path: &Path,
    threads: usize,
    ordinary: &mut std::collections::BTreeSet<String>,
) -> Result<BTreeMap<String, Tensor>, IoError> {
    let io = |e: std::io::Error| IoError::file(path, "read the weights file", e);
    let mut file = std::fs::File::open(path).map_err(io)?;
    let meta = file.metadata().map_err(io)?;
    if !meta.is_file() {
        // A pipe or device has no length to plan by: read it whole, within the memory budget.
        return parse_safetensors(path, &read_file(path)?);
    }
    let len = usize::try_from(meta.len()).unwrap_or(usize::MAX);
    #[cfg(unix)]
    if threads > 1 && len >= PARALLEL_READ_MIN_BYTES {
        return read_safetensors_parallel(path, &file, len, threads, ordinary);
    }
    #[cfg(not(unix))]
    let _ = threads;
    read_safetensors_from(path, &mut file, len, &mut |_| {}, Some(ordinary))
}

/// Weights files smaller than this are read on one thread whatever the thread count (a thread
/// costs more than reading them).
const PARALLEL_READ_MIN_BYTES: usize = 16 << 20;

/// The safetensors file of `len` bytes that `reader` reads next (`path` names it in messages),
/// decoded tensor by tensor; `seen` is shown every byte read, in order (a checksum).
pub(crate) fn read_safetensors_from(
    path: &Path,
    reader: &mut impl std::io::Read,
    len: usize,
    seen: &mut dyn FnMut(&[u8]),
    // Where given, the names of the tensors found to hold only ordinary numbers
    // ([`tumble_tensor::ordinary_elements`]), each chunk scanned as it is decoded.
    mut ordinary: Option<&mut std::collections::BTreeSet<String>>,
) -> Result<BTreeMap<String, Tensor>, IoError> {
    let mut read = |buf: &mut [u8], what: &str| -> Result<(), IoError> {
        reader
            .read_exact(buf)
            .map_err(|e| read_error(path, e, what))?;
        seen(buf);
        Ok(())
    };
    let (entries, _) = read_st_header(path, &mut read, len)?;
    let mut chunk = vec![0u8; ST_CHUNK];
    let mut out = BTreeMap::new();
    // The entries tile the data section in order: one sequential pass over the file.
    for e in entries {
        let (tensor, clean) = decode_entry(path, &e, &mut read, &mut chunk, ordinary.is_some())?;
        if let (true, Some(o)) = (clean, ordinary.as_deref_mut()) {
            o.insert(e.name.clone());
        }
        out.insert(e.name, tensor);
    }
    Ok(out)
}

/// A failed read of `what` as the error to show: the file's end reached early (truncated, or
/// changed while read), or the system's error.
fn read_error(path: &Path, e: std::io::Error, what: &str) -> IoError {
    if e.kind() == std::io::ErrorKind::UnexpectedEof {
        IoError::weights(
            path,
            format!("{what} ends past the end of the file; the file is truncated (or changed while it was read)"),
        )
    } else {
        IoError::file(path, "read the weights file", e)
    }
}

/// A stop of the memory budget, the time limit or an interrupt while reading.
fn limit_error(path: &Path, stop: tumble_limits::Stop) -> IoError {
    IoError::file(
        path,
        "read the weights file",
        std::io::Error::other(format!("{stop} (while reading the weights)")),
    )
}

/// Fills a buffer with the file's next bytes (the `&str` names them in an error).
type ReadInto<'r> = dyn FnMut(&mut [u8], &str) -> Result<(), IoError> + 'r;

/// A safetensors file's header, read by `read` from the file's start: its entries, and where
/// its data section starts.
fn read_st_header(
    path: &Path,
    read: &mut ReadInto<'_>,
    len: usize,
) -> Result<(Vec<StEntry>, usize), IoError> {
    let mut first = [0u8; 8];
    let got = first.len().min(len);
    read(
        first.get_mut(..got).unwrap_or_default(),
        "the header length",
    )?;
    let n = st_header_len(path, first.get(..got).unwrap_or_default(), len)?;
    tumble_limits::reserve(n).map_err(|s| limit_error(path, s))?;
    let mut header = vec![0u8; n];
    read(&mut header, "the header")?;
    let data_len = len - 8 - n;
    Ok((st_entries(path, &header, data_len)?, 8 + n))
}

/// Entry `e`'s tensor, its bytes read in order by `read` through `chunk`; with `scan`, whether
/// it holds only ordinary numbers (each chunk scanned as it is decoded, while in cache).
fn decode_entry(
    path: &Path,
    e: &StEntry,
    read: &mut ReadInto<'_>,
    chunk: &mut [u8],
    scan: bool,
) -> Result<(Tensor, bool), IoError> {
    let bytes = e.end - e.start;
    tumble_limits::reserve(bytes).map_err(|s| limit_error(path, s))?;
    let mut buffer = Buffer::with_capacity(e.dtype, bytes / e.dtype.size().max(1));
    let mut left = bytes;
    let mut clean = scan;
    while left > 0 {
        tumble_limits::poll().map_err(|s| limit_error(path, s))?;
        // Whole elements per chunk (ST_CHUNK is a multiple of every element size).
        let take = left.min(chunk.len());
        let part = chunk.get_mut(..take).unwrap_or_default();
        read(part, &format!("tensor `{}`", e.name))?;
        let from = buffer.len();
        buffer.prefault_spare(take / e.dtype.size().max(1));
        append_le(&mut buffer, part);
        clean = clean && tumble_tensor::ordinary_elements(&buffer, from);
        left -= take;
    }
    let tensor = Tensor::new(e.shape.clone(), buffer)
        .map_err(|err| IoError::weights(path, format!("tensor `{}`: {err}", e.name)))?;
    Ok((tensor, clean))
}

/// [`read_safetensors_from`] of a regular file on `threads` threads: the header on this one,
/// then the entries in `threads` runs of about equal bytes, in file order, each decoded by its
/// own thread reading at its offsets (a large file's read, its pages' faults and its scan
/// shared). The same tensors; of several failures, the one a sequential read meets first.
#[cfg(unix)]
fn read_safetensors_parallel(
    path: &Path,
    file: &std::fs::File,
    len: usize,
    threads: usize,
    ordinary: &mut std::collections::BTreeSet<String>,
) -> Result<BTreeMap<String, Tensor>, IoError> {
    use std::os::unix::fs::FileExt;
    let mut at = 0u64;
    let mut read = |buf: &mut [u8], what: &str| -> Result<(), IoError> {
        file.read_exact_at(buf, at)
            .map_err(|e| read_error(path, e, what))?;
        at += buf.len() as u64;
        Ok(())
    };
    let (entries, data_start) = read_st_header(path, &mut read, len)?;
    let total: usize = entries.iter().map(|e| e.end - e.start).sum();
    let share = total.div_ceil(threads.max(1)).max(1);
    let mut runs: Vec<Vec<StEntry>> = vec![Vec::new()];
    let mut run_bytes = 0;
    for e in entries {
        if run_bytes >= share {
            runs.push(Vec::new());
            run_bytes = 0;
        }
        run_bytes += e.end - e.start;
        if let Some(r) = runs.last_mut() {
            r.push(e);
        }
    }
    type Decoded = Vec<(String, Tensor, bool)>;
    let decode_run = |run: Vec<StEntry>| -> Result<Decoded, IoError> {
        let mut chunk = vec![0u8; ST_CHUNK];
        let mut out = Vec::with_capacity(run.len());
        for e in run {
            let mut at = (data_start + e.start) as u64;
            let mut read = |buf: &mut [u8], what: &str| -> Result<(), IoError> {
                file.read_exact_at(buf, at)
                    .map_err(|err| read_error(path, err, what))?;
                at += buf.len() as u64;
                Ok(())
            };
            let (tensor, clean) = decode_entry(path, &e, &mut read, &mut chunk, true)?;
            out.push((e.name, tensor, clean));
        }
        Ok(out)
    };
    let stop = tumble_limits::run_stop();
    let results: Vec<Result<Decoded, IoError>> = std::thread::scope(|s| {
        let mut runs = runs.into_iter();
        let first = runs.next();
        let helpers: Vec<_> = runs
            .map(|run| {
                let stop = stop.clone();
                std::thread::Builder::new()
                    .name("tumble-weights".into())
                    .spawn_scoped(s, move || {
                        tumble_limits::with_run_stop(stop, || decode_run(run))
                    })
            })
            .collect();
        let mut results = vec![first.map_or(Ok(Vec::new()), decode_run)];
        for h in helpers {
            results.push(match h {
                Ok(h) => h.join().unwrap_or_else(|_| {
                    Err(IoError::weights(
                        path,
                        "a thread reading the weights panicked",
                    ))
                }),
                Err(e) => Err(IoError::file(path, "start a thread to read the weights", e)),
            });
        }
        results
    });
    let mut out = BTreeMap::new();
    for r in results {
        for (name, tensor, clean) in r? {
            if clean {
                ordinary.insert(name.clone());
            }
            out.insert(name, tensor);
        }
    }
    Ok(out)
}

/// Bytes of a safetensors file decoded per read (a multiple of every element size).
const ST_CHUNK: usize = 1 << 20;

/// Reads until `buf` is full or the file ends; the bytes read.
pub(crate) fn read_up_to(file: &mut std::fs::File, buf: &mut [u8]) -> std::io::Result<usize> {
    use std::io::Read;
    let mut got = 0;
    while got < buf.len() {
        match file.read(buf.get_mut(got..).unwrap_or_default()) {
            Ok(0) => break,
            Ok(k) => got += k,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(got)
}

/// Serializes `tensors` in the safetensors format.
pub fn safetensors_bytes(tensors: &BTreeMap<String, Tensor>) -> Result<Vec<u8>, String> {
    let mut out = Vec::new();
    write_safetensors(Path::new("(in memory)"), tensors, &mut out).map_err(|e| e.to_string())?;
    Ok(out)
}

/// Writes `tensors` to `path` as a safetensors file, atomically: the bytes go to a temporary
/// file in the same directory, which is fsynced and then renamed over `path`, so an interrupted
/// save never leaves a half-written weights file. The tensors are encoded a chunk at a time
/// straight into the file (not the whole file built in memory first: a checkpoint of `tumble
/// train` held three copies of the weights).
pub fn save_params(path: &Path, tensors: &BTreeMap<String, Tensor>) -> Result<(), IoError> {
    stage_params(path, tensors)?.commit()
}

/// [`save_params`] up to moving the file into place ([`Staged::commit`]).
pub fn stage_params(path: &Path, tensors: &BTreeMap<String, Tensor>) -> Result<Staged, IoError> {
    stage(path, "the weights file", |w| {
        write_safetensors(path, tensors, w)
    })
}

/// Writes `tensors` as a safetensors file to `w` (`path` names it in messages), a chunk at a time,
/// laid out as the `safetensors` crate lays it out.
pub(crate) fn write_safetensors(
    path: &Path,
    tensors: &BTreeMap<String, Tensor>,
    w: &mut impl Write,
) -> Result<(), IoError> {
    let serialize = |m: String| IoError::weights(path, format!("cannot serialize: {m}"));
    // The header as the `safetensors` crate lays it out (its tensor order, its padding): the
    // crate serializes views that announce their data's length but hand it no data.
    let header = safetensors::serialize(
        tensors
            .iter()
            .map(|(name, t)| (name.as_str(), HeaderOnly(t))),
        None,
    )
    .map_err(|e| serialize(e.to_string()))?;
    let data_len: usize = tensors.values().map(|t| t.len() * t.dtype().size()).sum();
    let n = st_header_len(path, &header, header.len() + data_len)?;
    let json = header.get(8..8 + n).unwrap_or_default();
    let entries = st_entries(path, json, data_len)?;
    if header.len() != 8 + n {
        return Err(serialize("the header has data after it".into()));
    }
    let io = |e| IoError::file(path, "write the weights file", e);
    w.write_all(&header).map_err(io)?;
    let mut chunk = Vec::with_capacity(ST_CHUNK);
    for e in &entries {
        let t = tensors
            .get(&e.name)
            .ok_or_else(|| serialize(format!("tensor `{}` vanished", e.name)))?;
        write_le(w, t.buffer(), &mut chunk).map_err(io)?;
    }
    Ok(())
}

/// A tensor as the `safetensors` crate sees it when only the header is to be written.
struct HeaderOnly<'a>(&'a Tensor);

impl safetensors::View for HeaderOnly<'_> {
    fn dtype(&self) -> safetensors::Dtype {
        st_name(self.0.dtype())
    }
    fn shape(&self) -> &[usize] {
        self.0.shape()
    }
    fn data(&self) -> std::borrow::Cow<'_, [u8]> {
        std::borrow::Cow::Borrowed(&[])
    }
    fn data_len(&self) -> usize {
        self.0.len() * self.0.dtype().size()
    }
}

/// Writes `buffer`'s elements little-endian to `w`, through `chunk` (reused).
fn write_le(w: &mut impl Write, buffer: &Buffer, chunk: &mut Vec<u8>) -> std::io::Result<()> {
    fn each<T: Copy, const N: usize>(
        w: &mut impl Write,
        xs: &[T],
        chunk: &mut Vec<u8>,
        f: impl Fn(T) -> [u8; N],
    ) -> std::io::Result<()> {
        for part in xs.chunks((ST_CHUNK / N).max(1)) {
            chunk.clear();
            chunk.extend(part.iter().flat_map(|&x| f(x)));
            w.write_all(chunk)?;
        }
        Ok(())
    }
    match buffer {
        Buffer::F32(v) => each(w, v, chunk, f32::to_le_bytes),
        Buffer::F64(v) => each(w, v, chunk, f64::to_le_bytes),
        Buffer::I32(v) => each(w, v, chunk, i32::to_le_bytes),
        Buffer::I64(v) => each(w, v, chunk, i64::to_le_bytes),
        Buffer::Bool(v) => each(w, v, chunk, |b| [u8::from(b)]),
    }
}

// ---------------------------------------------------------------------------------------------
// .npy

/// Loads every `*.npy` file directly inside `dir`, each as the tensor named by its file stem.
pub fn load_npy_dir(dir: &Path) -> Result<BTreeMap<String, Tensor>, IoError> {
    let entries =
        std::fs::read_dir(dir).map_err(|e| IoError::file(dir, "list the weights directory", e))?;
    let mut files = Vec::new();
    for entry in entries {
        let entry = entry.map_err(|e| IoError::file(dir, "list the weights directory", e))?;
        let p = entry.path();
        if p.extension().is_some_and(|e| e == "npy") && p.is_file() {
            files.push(p);
        }
    }
    if files.is_empty() {
        return Err(IoError::weights(
            dir,
            "the directory contains no .npy files (tumble reads a directory of `NAME.npy` files, \
             one tensor each, or a .safetensors file)",
        ));
    }
    files.sort();
    let mut out = BTreeMap::new();
    for p in files {
        let bytes = read_file(&p)?;
        out.insert(file_stem(&p), parse_npy(&p, &bytes)?);
    }
    Ok(out)
}

/// Parses the bytes of one `.npy` file (format versions 1, 2 and 3; `path` is for messages).
pub fn parse_npy(path: &Path, bytes: &[u8]) -> Result<Tensor, IoError> {
    let err = |m: String| IoError::weights(path, m);
    if bytes.len() < 10 || &bytes[..6] != b"\x93NUMPY" {
        return Err(err(
            "not a .npy file (it does not start with the magic bytes `\\x93NUMPY`)".into(),
        ));
    }
    let (major, minor) = (bytes[6], bytes[7]);
    let (hlen, hstart): (usize, usize) = match (major, minor) {
        (1, 0) => (usize::from(u16::from_le_bytes([bytes[8], bytes[9]])), 10),
        (2 | 3, 0) => {
            let Some(b) = bytes.get(8..12) else {
                return Err(err("the file is truncated inside the .npy preamble".into()));
            };
            let n = u32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            (usize::try_from(n).unwrap_or(usize::MAX), 12)
        }
        // numpy writes and reads only 1.0, 2.0 and 3.0 (`numpy.lib.format`).
        (v, m) => {
            return Err(err(format!(
                ".npy format version {v}.{m} is not supported (versions 1.0, 2.0 and 3.0 are)"
            )))
        }
    };
    let hend = hstart
        .checked_add(hlen)
        .filter(|&e| e <= bytes.len())
        .ok_or_else(|| {
            err(format!(
            "the header length field says {hlen} bytes, but only {} follow; the file is truncated",
            bytes.len() - hstart
        ))
        })?;
    let header = std::str::from_utf8(&bytes[hstart..hend])
        .map_err(|_| err("the .npy header is not valid text; the file is corrupt".into()))?;
    let h = parse_npy_header(header).map_err(|m| {
        err(format!(
            "cannot read the .npy header `{}`: {m}",
            header.trim_end()
        ))
    })?;
    if h.fortran_order {
        return Err(err(
            "the array is stored in Fortran (column-major) order, which tumble does not read; \
             save it from numpy with `np.save(path, np.ascontiguousarray(a))`"
                .into(),
        ));
    }
    let dtype = match h.descr.as_str() {
        "<f4" => DType::Float32,
        "<f8" => DType::Float64,
        "<i4" => DType::Int32,
        "<i8" => DType::Int64,
        "|b1" => DType::Bool,
        other => {
            let why = if other.starts_with('>') {
                " (big-endian data; use `a.astype(a.dtype.newbyteorder('<'))`)"
            } else {
                ""
            };
            return Err(err(format!(
                "dtype `{other}` is not supported{why}; tumble reads `<f4` (float32), `<f8` \
                 (float64), `<i4` (int32), `<i8` (int64) and `|b1` (bool)"
            )));
        }
    };
    let data = &bytes[hend..];
    let need = byte_size(&h.shape, dtype.size())
        .ok_or_else(|| err(format!("shape {} is too large", format_shape(&h.shape))))?;
    if data.len() < need {
        return Err(err(format!(
            "shape {} of {dtype} needs {need} data bytes, but the file has only {}; \
             the file is truncated",
            format_shape(&h.shape),
            data.len()
        )));
    }
    if data.len() > need {
        return Err(err(format!(
            "shape {} of {dtype} needs {need} data bytes, but the file has {}; \
             the header does not match the data (is the file corrupt?)",
            format_shape(&h.shape),
            data.len()
        )));
    }
    Tensor::new(h.shape, decode_le(dtype, data)).map_err(|e| err(e.to_string()))
}

struct NpyHeader {
    descr: String,
    fortran_order: bool,
    shape: Vec<usize>,
}

/// Parses the Python dict literal of a `.npy` header:
/// `{'descr': '<f4', 'fortran_order': False, 'shape': (3, 4), }`.
fn parse_npy_header(text: &str) -> Result<NpyHeader, String> {
    let mut p = PyLit {
        s: text.as_bytes(),
        i: 0,
    };
    p.expect(b'{')?;
    let (mut descr, mut fortran, mut shape) = (None, None, None);
    loop {
        p.ws();
        if p.eat(b'}') {
            break;
        }
        let key = p.string()?;
        p.ws();
        p.expect(b':')?;
        p.ws();
        match key.as_str() {
            "descr" => descr = Some(p.string()?),
            "fortran_order" => fortran = Some(p.boolean()?),
            "shape" => shape = Some(p.tuple()?),
            other => return Err(format!("unexpected key '{other}'")),
        }
        p.ws();
        if !p.eat(b',') {
            p.ws();
            p.expect(b'}')?;
            break;
        }
    }
    Ok(NpyHeader {
        descr: descr.ok_or("no 'descr' entry")?,
        fortran_order: fortran.ok_or("no 'fortran_order' entry")?,
        shape: shape.ok_or("no 'shape' entry")?,
    })
}

struct PyLit<'a> {
    s: &'a [u8],
    i: usize,
}

impl PyLit<'_> {
    fn ws(&mut self) {
        while self.s.get(self.i).is_some_and(u8::is_ascii_whitespace) {
            self.i += 1;
        }
    }

    fn eat(&mut self, c: u8) -> bool {
        if self.s.get(self.i) == Some(&c) {
            self.i += 1;
            true
        } else {
            false
        }
    }

    fn expect(&mut self, c: u8) -> Result<(), String> {
        if self.eat(c) {
            Ok(())
        } else {
            Err(format!("expected `{}` at offset {}", c as char, self.i))
        }
    }

    fn string(&mut self) -> Result<String, String> {
        let q = match self.s.get(self.i) {
            Some(&q @ (b'\'' | b'"')) => q,
            _ => return Err(format!("expected a quoted string at offset {}", self.i)),
        };
        self.i += 1;
        let start = self.i;
        while let Some(&c) = self.s.get(self.i) {
            if c == q {
                let out = String::from_utf8_lossy(&self.s[start..self.i]).into_owned();
                self.i += 1;
                return Ok(out);
            }
            self.i += 1;
        }
        Err("unterminated string".into())
    }

    fn boolean(&mut self) -> Result<bool, String> {
        let rest = &self.s[self.i..];
        if rest.starts_with(b"True") {
            self.i += 4;
            Ok(true)
        } else if rest.starts_with(b"False") {
            self.i += 5;
            Ok(false)
        } else {
            Err(format!("expected True or False at offset {}", self.i))
        }
    }

    fn tuple(&mut self) -> Result<Vec<usize>, String> {
        self.expect(b'(')?;
        let mut dims = Vec::new();
        loop {
            self.ws();
            if self.eat(b')') {
                return Ok(dims);
            }
            let start = self.i;
            while self.s.get(self.i).is_some_and(u8::is_ascii_digit) {
                self.i += 1;
            }
            let digits = std::str::from_utf8(&self.s[start..self.i]).unwrap_or("");
            let d: usize = digits
                .parse()
                .map_err(|_| format!("expected a dimension size at offset {start}"))?;
            self.eat(b'L'); // Python 2 long literals
            dims.push(d);
            self.ws();
            if !self.eat(b',') {
                self.ws();
                self.expect(b')')?;
                return Ok(dims);
            }
        }
    }
}

/// The bytes of a version-1 `.npy` file holding `tensor` (used by tests and tools that want to
/// hand tensors to numpy).
pub fn npy_bytes(tensor: &Tensor) -> Vec<u8> {
    let descr = match tensor.dtype() {
        DType::Float32 => "<f4",
        DType::Float64 => "<f8",
        DType::Int32 => "<i4",
        DType::Int64 => "<i8",
        DType::Bool => "|b1",
    };
    let shape = format_shape(tensor.shape()); // Python tuple syntax: `(4,)`, `(2, 3)`, `()`
    let mut header = format!("{{'descr': '{descr}', 'fortran_order': False, 'shape': {shape}, }}");
    // Pad with spaces so that magic + version + length + header + '\n' is a multiple of 64.
    let unpadded = 10 + header.len() + 1;
    header.push_str(&" ".repeat((64 - unpadded % 64) % 64));
    header.push('\n');
    let mut out = Vec::with_capacity(10 + header.len() + tensor.len() * tensor.dtype().size());
    out.extend_from_slice(b"\x93NUMPY\x01\x00");
    // Our headers are far below 64 KiB.
    out.extend_from_slice(&(header.len() as u16).to_le_bytes());
    out.extend_from_slice(header.as_bytes());
    out.extend_from_slice(&encode_le(tensor.buffer()));
    out
}

/// The first key that appears twice in the JSON object `text` (already known to parse as one).
fn repeated_key(text: &str) -> Option<String> {
    use serde::de::{Deserializer, IgnoredAny, MapAccess, Visitor};
    struct Repeated;
    impl<'de> Visitor<'de> for Repeated {
        type Value = Option<String>;
        fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
            f.write_str("a JSON object")
        }
        fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Option<String>, A::Error> {
            let mut seen = std::collections::HashSet::new();
            let mut repeated = None;
            while let Some(key) = map.next_key::<String>()? {
                map.next_value::<IgnoredAny>()?;
                if repeated.is_none() && !seen.insert(key.clone()) {
                    repeated = Some(key);
                }
            }
            Ok(repeated)
        }
    }
    let mut de = serde_json::Deserializer::from_str(text);
    de.deserialize_map(Repeated).ok().flatten()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The reader of runs on several threads decodes what the sequential one does — every
    /// dtype, tensors of several chunks, the ordinary set (a subnormal and a NaN found) — for any
    /// thread count, and of a truncated file reports the error the sequential read meets first.
    #[cfg(unix)]
    #[test]
    fn reading_on_threads_is_reading_in_order() {
        let dir = std::env::temp_dir().join(format!("tumble-io-par-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("w.safetensors");
        let n = ST_CHUNK / 4 * 2 + 5;
        let mut sub: Vec<f32> = (0..n).map(|i| i as f32 * 0.25 - 9.0).collect();
        sub[n - 2] = f32::MIN_POSITIVE / 2.0;
        let mut m = BTreeMap::new();
        m.insert("a_f32".to_string(), Tensor::from_f32([n], sub).unwrap());
        m.insert(
            "b_f64".to_string(),
            Tensor::from_f64([3], vec![0.5, f64::INFINITY, 2.0]).unwrap(),
        );
        m.insert(
            "c_i32".to_string(),
            Tensor::from_i32([2], vec![7, -7]).unwrap(),
        );
        m.insert(
            "d_i64".to_string(),
            Tensor::from_i64([n / 3], vec![11; n / 3]).unwrap(),
        );
        m.insert(
            "e_bool".to_string(),
            Tensor::from_bool([3], vec![true, false, true]).unwrap(),
        );
        m.insert(
            "f_f32".to_string(),
            Tensor::from_f32([n], vec![1.5; n]).unwrap(),
        );
        save_params(&path, &m).unwrap();
        let len = std::fs::metadata(&path).unwrap().len() as usize;
        let mut want_ordinary = std::collections::BTreeSet::new();
        let mut f = std::fs::File::open(&path).unwrap();
        let want = read_safetensors_from(&path, &mut f, len, &mut |_| {}, Some(&mut want_ordinary))
            .unwrap();
        assert_eq!(want, m);
        for threads in [2, 3, 7] {
            let mut ordinary = std::collections::BTreeSet::new();
            let file = std::fs::File::open(&path).unwrap();
            let got = read_safetensors_parallel(&path, &file, len, threads, &mut ordinary).unwrap();
            assert_eq!(got, want, "{threads} threads");
            assert_eq!(ordinary, want_ordinary, "{threads} threads");
            assert!(!ordinary.contains("a_f32") && !ordinary.contains("b_f64"));
        }
        // Cut inside the last tensor: both name it.
        let bytes = std::fs::read(&path).unwrap();
        std::fs::write(&path, &bytes[..bytes.len() - 100]).unwrap();
        let len = len - 100;
        let mut f = std::fs::File::open(&path).unwrap();
        let seq = read_safetensors_from(&path, &mut f, len, &mut |_| {}, None)
            .err()
            .map(|e| e.to_string());
        let file = std::fs::File::open(&path).unwrap();
        let par = read_safetensors_parallel(&path, &file, len, 3, &mut Default::default())
            .err()
            .map(|e| e.to_string());
        assert!(
            seq.as_deref().is_some_and(|e| e.contains("truncated")),
            "{seq:?}"
        );
        assert_eq!(par, seq);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn npy_headers() {
        let h = parse_npy_header("{'descr': '<f4', 'fortran_order': False, 'shape': (3, 4), }  \n")
            .unwrap();
        assert_eq!(
            (h.descr.as_str(), h.fortran_order, h.shape),
            ("<f4", false, vec![3, 4])
        );
        let h = parse_npy_header("{\"shape\": (), \"fortran_order\": True, \"descr\": \"|b1\"}")
            .unwrap();
        assert_eq!(
            (h.descr.as_str(), h.fortran_order, h.shape),
            ("|b1", true, vec![])
        );
        let h =
            parse_npy_header("{'descr': '<i8', 'fortran_order': False, 'shape': (7L,), }").unwrap();
        assert_eq!(h.shape, vec![7]);
        assert!(parse_npy_header("{'descr': '<f4', 'shape': (3,), }").is_err());
        assert!(
            parse_npy_header("{'descr': '<f4', 'fortran_order': False, 'shape': (-1,)}").is_err()
        );
        assert!(parse_npy_header("{'descr': '<f4'").is_err());
        assert!(parse_npy_header("").is_err());
    }

    #[test]
    fn npy_round_trip_all_dtypes() {
        let ts = [
            Tensor::from_f32([2], vec![1.5, -2.0]).unwrap(),
            Tensor::from_f64([1, 2], vec![1e300, -0.0]).unwrap(),
            Tensor::from_i32([3], vec![1, -1, i32::MIN]).unwrap(),
            Tensor::scalar_i64(i64::MAX),
            Tensor::from_bool([2], vec![true, false]).unwrap(),
            Tensor::from_f32([0], vec![]).unwrap(),
        ];
        for t in ts {
            let bytes = npy_bytes(&t);
            assert_eq!(bytes.len() % 64, (t.len() * t.dtype().size()) % 64);
            assert_eq!(parse_npy(Path::new("t.npy"), &bytes).unwrap(), t);
        }
    }
}
