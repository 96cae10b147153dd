//! safetensors files: the header validated, tensors decoded straight from the file a chunk at a
//! time (on several threads for a large file), and written atomically.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::Path;

use tumble_ir::DType;
use tumble_tensor::shape::format_shape;
use tumble_tensor::{Buffer, Tensor};

use super::{append_le, byte_size, decode_le, read_file};
use crate::atomic::{stage, Staged};
use crate::IoError;

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

fn st_name(dtype: DType) -> ::safetensors::Dtype {
    match dtype {
        DType::Float32 => ::safetensors::Dtype::F32,
        DType::Float64 => ::safetensors::Dtype::F64,
        DType::Int32 => ::safetensors::Dtype::I32,
        DType::Int64 => ::safetensors::Dtype::I64,
        DType::Bool => ::safetensors::Dtype::BOOL,
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
pub(super) fn read_safetensors_file(
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
    // The file's bytes from offset `at` on, read in order without moving the file's own cursor
    // (so each thread keeps its own).
    let reader_at = |mut at: u64| {
        move |buf: &mut [u8], what: &str| -> Result<(), IoError> {
            file.read_exact_at(buf, at)
                .map_err(|e| read_error(path, e, what))?;
            at += buf.len() as u64;
            Ok(())
        }
    };
    let (entries, data_start) = read_st_header(path, &mut reader_at(0), len)?;
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
        // A run's entries are contiguous in the data section (the entries tile it in order).
        let start = run.first().map_or(0, |e| e.start);
        let mut read = reader_at((data_start + start) as u64);
        for e in run {
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
    let header = ::safetensors::serialize(
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

impl ::safetensors::View for HeaderOnly<'_> {
    fn dtype(&self) -> ::safetensors::Dtype {
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
    use crate::weights::save_params;

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
}
