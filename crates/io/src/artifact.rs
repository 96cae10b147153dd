//! Compiled models (`tumble compile MODEL -o model.tumble`): the lowered, optimized program, its
//! reuse analysis and kernel plans, what decoding instances and encoding results needs (ADT
//! tables, the entry's signature), the sources (for located run-time errors) and, optionally, the
//! weights — so `tumble run model.tumble` starts without parsing, type checking or compiling.
//!
//! Layout: the 8-byte magic `TUMBLE\0c`, the format version (u32 LE), the payload and weights
//! lengths (u64 LE each), a CRC-32 of everything after the header (u64 LE), then the
//! payload (postcard) and the weights (a safetensors file, possibly empty). A file of another
//! format version is *stale* (recompile it); a file whose checksum or payload does not read back
//! is *corrupt*. Either is a clear error, never a half-loaded program. A program read back is
//! checked by the IR verifier and its plans against their blocks before anything runs.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::Path;

use serde::{Deserialize, Serialize};
use tumble_check::Tables;
use tumble_compile::{BlockPlan, PlanOptions, Program, ReuseAnalysis, StaticOptions};
use tumble_ir::Ty;
use tumble_tensor::Tensor;

use crate::atomic::write_atomically;
use crate::weights::{parse_safetensors, write_safetensors};
use crate::IoError;

/// The first bytes of every compiled model.
pub const MAGIC: &[u8; 8] = b"TUMBLE\0c";

/// Bumped whenever anything written to the payload changes shape (`Code`, `Block`, plans, `Ty`,
/// the natives table, ...): a file of another version is refused as stale.
pub const FORMAT_VERSION: u32 = 15;

const HEADER: usize = 8 + 4 + 8 + 8 + 8;

/// How the program in a compiled model was compiled (shown by `tumble run --profile`, checked
/// against the run's switches).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct CompiledWith {
    pub coarsen: bool,
    pub fold: bool,
    pub inline: bool,
    pub statics: StaticOptions,
    /// The plans' switches (`None`: compiled without kernel plans).
    pub plans: Option<PlanOptions>,
}

/// Everything a compiled model holds but the weights.
#[derive(Debug, Serialize, Deserialize)]
pub struct Artifact {
    /// The tumble that wrote it (for messages).
    pub written_by: String,
    /// The sources, in `SourceMap` order (prelude first), so spans in the program still point
    /// at the right text.
    pub sources: Vec<(String, String)>,
    pub tables: Tables,
    pub entry: String,
    /// The entry's arguments and result type.
    pub params: Vec<(String, Ty)>,
    pub ret: Ty,
    /// Which of the entry's arguments the program was compiled with as weights.
    pub weights: Vec<bool>,
    pub compiled_with: CompiledWith,
    pub compiled: CompiledProgram,
    /// The program compiled without block merging, when merging changed it: `tumble run`
    /// merges only for mini-batches of at least `merge::MERGE_MIN_BATCH` instances, so a run of
    /// the file at smaller ones takes this one and gives the source's results bit for bit.
    pub unmerged: Option<Box<CompiledProgram>>,
}

/// A program with its reuse analysis and kernel plans.
#[derive(Debug, Serialize, Deserialize)]
pub struct CompiledProgram {
    pub program: Program,
    pub reuse: ReuseAnalysis,
    pub plans: Vec<BlockPlan>,
}

impl Artifact {
    /// Refuses to run the model (`shown`: its path, for the message) from another entry than the
    /// one it was compiled for.
    pub fn check_entry(&self, shown: &str, entry: &str) -> Result<(), String> {
        if self.entry == entry {
            return Ok(());
        }
        Err(format!(
            "{shown} was compiled for @{}, not @{entry}: compile it again with --entry {entry}",
            self.entry
        ))
    }

    /// Refuses a run whose weights are not the ones the model was compiled with as weights.
    pub fn check_binding(&self, weights: &[bool]) -> Result<(), String> {
        if self.weights.as_slice() == weights {
            return Ok(());
        }
        let names = |mask: &[bool]| -> String {
            let v: Vec<&str> = self
                .params
                .iter()
                .zip(mask)
                .filter(|(_, w)| **w)
                .map(|((n, _), _)| n.as_str())
                .collect();
            if v.is_empty() {
                "(none)".into()
            } else {
                v.join(", ")
            }
        };
        Err(format!(
            "the model was compiled with these @{} arguments as weights: {}; this run binds: {}. \
             Give the same weights (or compile again with this run's --params)",
            self.entry,
            names(&self.weights),
            names(weights)
        ))
    }
}

/// A compiled model read back: the artifact and its embedded weights (empty when it has none).
pub struct Loaded {
    pub artifact: Artifact,
    pub weights: BTreeMap<String, Tensor>,
}

/// CRC-32 (IEEE) of the parts, in the low half of a u64: detects corruption (a truncated copy,
/// flipped bits), not tampering. `crc32fast` runs at memory speed, so checking a file with large
/// embedded weights costs little next to reading it (a byte-at-a-time FNV took 40% of a start-up).
fn checksum(parts: &[&[u8]]) -> u64 {
    let mut h = crc32fast::Hasher::new();
    for part in parts {
        h.update(part);
    }
    u64::from(h.finalize())
}

/// Whether `bytes` start like a compiled model.
pub fn is_artifact(bytes: &[u8]) -> bool {
    bytes.starts_with(MAGIC)
}

/// The bytes of a compiled model.
pub fn artifact_bytes(
    artifact: &Artifact,
    weights: &BTreeMap<String, Tensor>,
) -> Result<Vec<u8>, String> {
    let payload = postcard::to_stdvec(artifact).map_err(|e| e.to_string())?;
    let mut out = Vec::new();
    write_artifact(Path::new("(in memory)"), &payload, weights, &mut out)
        .map_err(|e| e.to_string())?;
    Ok(out)
}

/// Writes a compiled model to `path`, atomically ([`write_artifact`]'s bytes, not the whole file
/// built in memory first).
pub fn save_artifact(
    path: &Path,
    artifact: &Artifact,
    weights: &BTreeMap<String, Tensor>,
) -> Result<(), IoError> {
    let payload = postcard::to_stdvec(artifact).map_err(|e| IoError::Param {
        message: format!("cannot serialize the compiled model: {e}"),
    })?;
    write_atomically(path, "the compiled model", |w| {
        write_artifact(path, &payload, weights, w)
    })
}

/// A compiled model to `w` (`path` names it in messages): the header, the serialized program
/// `payload`, the weights. The weights are encoded a chunk at a time, twice: once for the
/// checksum and length the header carries before them, then into `w`.
fn write_artifact(
    path: &Path,
    payload: &[u8],
    weights: &BTreeMap<String, Tensor>,
    w: &mut impl Write,
) -> Result<(), IoError> {
    let mut sum = Checksum {
        crc: crc32fast::Hasher::new(),
        len: 0,
    };
    sum.crc.update(payload);
    if !weights.is_empty() {
        write_safetensors(path, weights, &mut sum)?;
    }
    let io = |e| IoError::file(path, "write the compiled model", e);
    w.write_all(MAGIC).map_err(io)?;
    w.write_all(&FORMAT_VERSION.to_le_bytes()).map_err(io)?;
    w.write_all(&(payload.len() as u64).to_le_bytes())
        .map_err(io)?;
    w.write_all(&(sum.len as u64).to_le_bytes()).map_err(io)?;
    w.write_all(&u64::from(sum.crc.finalize()).to_le_bytes())
        .map_err(io)?;
    w.write_all(payload).map_err(io)?;
    if !weights.is_empty() {
        write_safetensors(path, weights, w)?;
    }
    Ok(())
}

/// A writer that only checksums and counts what it is given.
struct Checksum {
    crc: crc32fast::Hasher,
    len: usize,
}

impl Write for Checksum {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.crc.update(buf);
        self.len += buf.len();
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

fn u64_at(bytes: &[u8], at: usize) -> Option<u64> {
    let b: [u8; 8] = bytes.get(at..at + 8)?.try_into().ok()?;
    Some(u64::from_le_bytes(b))
}

/// A model file as far as it had to be read to tell what it is.
pub enum ModelFile {
    /// A compiled model in a regular file: read it with [`read_artifact_file`].
    Compiled,
    /// Anything else, read whole (a source file; or a compiled model that is not a regular file,
    /// such as a pipe, for [`read_artifact`]).
    Bytes(Vec<u8>),
}

/// Opens model file `path`: a compiled model in a regular file is recognized by its first bytes
/// and left unread, so its weights can be decoded straight from the file.
pub fn open_model(path: &Path) -> std::io::Result<ModelFile> {
    if std::fs::metadata(path)?.is_file() {
        let mut magic = [0u8; 8];
        let got = crate::weights::read_up_to(&mut std::fs::File::open(path)?, &mut magic)?;
        if got == magic.len() && &magic == MAGIC {
            return Ok(ModelFile::Compiled);
        }
    }
    tumble_limits::read_file(path).map(ModelFile::Bytes)
}

/// [`read_artifact`] of the file at `path`, without reading it into memory whole: the header and
/// the program are read, the weights decoded tensor by tensor straight from the file, the
/// checksum computed on the way. Any failure reads the file again whole and reports what
/// [`read_artifact`] says of it, so a damaged file gets the same message either way.
pub fn read_artifact_file(path: &Path) -> Result<Loaded, IoError> {
    match stream_artifact(path) {
        Some(loaded) => Ok(loaded),
        None => {
            let bytes = tumble_limits::read_file(path)
                .map_err(|e| IoError::file(path, "read the compiled model", e))?;
            read_artifact(path, &bytes)
        }
    }
}

/// The streaming read of [`read_artifact_file`]; `None` on any failure.
fn stream_artifact(path: &Path) -> Option<Loaded> {
    use std::io::Read;
    let mut file = std::fs::File::open(path).ok()?;
    let len = usize::try_from(file.metadata().ok()?.len()).ok()?;
    let mut head = [0u8; HEADER];
    file.read_exact(&mut head).ok()?;
    let version = head.get(8..12).and_then(|b| <[u8; 4]>::try_from(b).ok())?;
    if !head.starts_with(MAGIC) || u32::from_le_bytes(version) != FORMAT_VERSION {
        return None;
    }
    let payload_len = usize::try_from(u64_at(&head, 12)?).ok()?;
    let weights_len = usize::try_from(u64_at(&head, 20)?).ok()?;
    let sum = u64_at(&head, 28)?;
    if HEADER.checked_add(payload_len)?.checked_add(weights_len)? != len {
        return None;
    }
    tumble_limits::reserve(payload_len).ok()?;
    let mut payload = vec![0u8; payload_len];
    file.read_exact(&mut payload).ok()?;
    let mut crc = crc32fast::Hasher::new();
    crc.update(&payload);
    let weights = if weights_len == 0 {
        BTreeMap::new()
    } else {
        crate::weights::read_safetensors_from(
            path,
            &mut file,
            weights_len,
            &mut |b| crc.update(b),
            None,
        )
        .ok()?
    };
    if u64::from(crc.finalize()) != sum {
        return None;
    }
    finish_artifact(path, &payload, weights).ok()
}

/// Reads a compiled model from its bytes (`path` names it in messages).
pub fn read_artifact(path: &Path, bytes: &[u8]) -> Result<Loaded, IoError> {
    let shown = path.display();
    let bad = |what: String| IoError::Param {
        message: format!("{shown}: {what}"),
    };
    if !is_artifact(bytes) {
        return Err(bad(
            "not a compiled tumble model (no `TUMBLE` header)".into()
        ));
    }
    let version = bytes
        .get(8..12)
        .and_then(|b| <[u8; 4]>::try_from(b).ok())
        .map(u32::from_le_bytes)
        .ok_or_else(|| bad("the header is truncated: the file is corrupt".into()))?;
    if version != FORMAT_VERSION {
        return Err(bad(format!(
            "compiled model of format {version}, but this tumble reads format {FORMAT_VERSION}: \
             the file is stale; compile the model again with `tumble compile`"
        )));
    }
    let (Some(payload_len), Some(weights_len), Some(sum)) =
        (u64_at(bytes, 12), u64_at(bytes, 20), u64_at(bytes, 28))
    else {
        return Err(bad("the header is truncated: the file is corrupt".into()));
    };
    let body = bytes.get(HEADER..).unwrap_or(&[]);
    let expect = usize::try_from(payload_len.saturating_add(weights_len)).unwrap_or(usize::MAX);
    if body.len() != expect {
        return Err(bad(format!(
            "the header announces {expect} bytes after it, the file has {}: the file is \
             truncated or corrupt; compile the model again",
            body.len()
        )));
    }
    let (payload, weights) = body.split_at(payload_len as usize);
    if checksum(&[payload, weights]) != sum {
        return Err(bad(
            "checksum mismatch: the file is corrupt; compile the model again".into(),
        ));
    }
    let weights = if weights.is_empty() {
        BTreeMap::new()
    } else {
        parse_safetensors(path, weights)?
    };
    finish_artifact(path, payload, weights)
}

/// The program of a compiled model from its checksummed payload, checked, with its weights.
fn finish_artifact(
    path: &Path,
    payload: &[u8],
    weights: BTreeMap<String, Tensor>,
) -> Result<Loaded, IoError> {
    let shown = path.display();
    let bad = |what: String| IoError::Param {
        message: format!("{shown}: {what}"),
    };
    let mut artifact: Artifact = postcard::from_bytes(payload)
        .map_err(|e| bad(format!("the program does not read back ({e}): the file is corrupt or was written by another build of tumble; compile the model again")))?;
    check_program(&mut artifact.compiled).map_err(&bad)?;
    if let Some(u) = &mut artifact.unmerged {
        check_program(u).map_err(|e| bad(format!("(its unmerged program) {e}")))?;
    }
    if artifact.weights.len() != artifact.params.len() {
        return Err(bad(
            "the weights mask does not match the entry's arguments: the file is corrupt".into(),
        ));
    }
    check_tables(&artifact).map_err(|e| {
        bad(format!(
            "its type tables are malformed ({e}): the file is corrupt; compile the model again"
        ))
    })?;
    Ok(Loaded { artifact, weights })
}

/// The stored type tables agree with the program and the signature: every constructor the
/// program makes or matches is in the tables under its ADT with its field count, every
/// constructor's ADT lists it, and every ADT the entry's arguments and result name is defined.
/// (The tables decode instances and encode results: an ADT renamed in them made a run fail
/// only when it wrote its result.)
fn check_tables(a: &Artifact) -> Result<(), String> {
    let t = &a.tables;
    for c in &a.compiled.program.ctors {
        match t.ctors.get(&c.name) {
            Some(info) if info.adt == c.adt && info.fields.len() == c.arity => {}
            Some(info) => {
                return Err(format!(
                    "constructor `{}` is of `{}` with {} fields in the program, of `{}` with {} \
                     in the tables",
                    c.name,
                    c.adt,
                    c.arity,
                    info.adt,
                    info.fields.len()
                ))
            }
            None => return Err(format!("constructor `{}` is missing", c.name)),
        }
    }
    for (name, info) in &t.ctors {
        let listed = t
            .adts
            .get(&info.adt)
            .is_some_and(|adt| adt.ctors.get(info.tag) == Some(name));
        if !listed {
            return Err(format!(
                "constructor `{name}` is not constructor {} of `{}`",
                info.tag, info.adt
            ));
        }
    }
    let mut tys: Vec<&Ty> = a.params.iter().map(|(_, ty)| ty).collect();
    tys.push(&a.ret);
    while let Some(ty) = tys.pop() {
        match ty {
            Ty::Adt(name, args) => {
                if !t.adts.contains_key(name) {
                    return Err(format!("type `{name}` is not defined"));
                }
                tys.extend(args);
            }
            Ty::Tuple(ts) => tys.extend(ts),
            Ty::Func(ps, r) => {
                tys.extend(ps);
                tys.push(r);
            }
            _ => {}
        }
    }
    Ok(())
}

/// A program checked by the IR verifier and its plans (restored) against its blocks: an error
/// says what is malformed.
fn check_program(c: &mut CompiledProgram) -> Result<(), String> {
    let (program, plans) = (&c.program, &mut c.plans);
    let errors = tumble_compile::verify_finished(program);
    if let Some(first) = errors.first() {
        return Err(format!(
            "the program read back is malformed ({} problems, first: {first}): the file is \
             corrupt; compile the model again",
            errors.len()
        ));
    }
    if !plans.is_empty() && plans.len() != program.blocks.len() {
        return Err(format!(
            "{} kernel plans for {} blocks: the file is corrupt; compile the model again",
            plans.len(),
            program.blocks.len()
        ));
    }
    for (plan, block) in plans.iter_mut().zip(&program.blocks) {
        plan.restore(block);
        if let Some(e) = plan.verify(block).first() {
            return Err(format!(
                "the kernel plan of block `{}` is malformed ({e}): the file is corrupt; compile \
                 the model again",
                block.name
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Artifact {
        let src = "type T { Leaf(Tensor[(1, 3), float32]), Node(T, T) }
                   def @f(%t: T, %w: Tensor[(3, 3), float32]) -> Tensor[(1, 3), float32] {
                     match (%t) {
                       Leaf(%x) => tanh(nn.dense(%x, %w)),
                       Node(%a, %b) => add(@f(%a, %w), multiply(@f(%b, %w), 0.5f)),
                     }
                   }
                   def @main(%t: T, %w: Tensor[(3, 3), float32]) { @f(%t, %w) }";
        let mut sources = tumble_ir::SourceMap::new();
        let typed = tumble_check::load(&mut sources, "t.rly", src, Default::default())
            .unwrap_or_else(|e| panic!("{e:?}"));
        let (params, ret) = crate::main_signature(&typed, "main").unwrap_or_else(|e| panic!("{e}"));
        let weights = vec![false, true];
        let c = tumble_compile::compile(
            &typed,
            "main",
            &weights,
            tumble_compile::CompileOptions::batched(),
        )
        .unwrap_or_else(|e| panic!("{}", e.message));
        Artifact {
            written_by: "test".into(),
            sources: sources
                .files()
                .iter()
                .map(|f| (f.name.clone(), f.text.clone()))
                .collect(),
            tables: typed.tables.clone(),
            entry: "main".into(),
            params,
            ret,
            weights,
            compiled_with: CompiledWith {
                coarsen: true,
                fold: true,
                inline: true,
                statics: StaticOptions::all(),
                plans: Some(PlanOptions::default()),
            },
            compiled: CompiledProgram {
                program: c.program,
                reuse: c.reuse,
                plans: c.plans,
            },
            unmerged: None,
        }
    }

    #[test]
    fn a_program_reads_back_to_the_same_bytes() {
        let a = sample();
        let w: BTreeMap<String, Tensor> = [(
            "w".to_string(),
            Tensor::from_f32(vec![3, 3], (0..9).map(|i| i as f32).collect())
                .unwrap_or_else(|e| panic!("{e}")),
        )]
        .into();
        let bytes = artifact_bytes(&a, &w).unwrap_or_else(|e| panic!("{e}"));
        // Deterministic: maps are written in key order.
        assert_eq!(
            bytes,
            artifact_bytes(&a, &w).unwrap_or_else(|e| panic!("{e}"))
        );
        let back = read_artifact(Path::new("t.tumble"), &bytes).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(back.weights, w);
        assert_eq!(
            bytes,
            artifact_bytes(&back.artifact, &back.weights).unwrap_or_else(|e| panic!("{e}"))
        );
        assert_eq!(
            format!("{:?}", back.artifact.compiled.program.blocks),
            format!("{:?}", a.compiled.program.blocks)
        );
    }

    #[test]
    fn damage_is_reported_not_loaded() {
        let bytes = artifact_bytes(&sample(), &BTreeMap::new()).unwrap_or_else(|e| panic!("{e}"));
        let err = |b: &[u8]| match read_artifact(Path::new("t.tumble"), b) {
            Ok(_) => panic!("damaged file loaded"),
            Err(e) => e.to_string(),
        };
        assert!(err(b"not a model").contains("not a compiled tumble model"));
        assert!(err(&bytes[..20]).contains("corrupt"));
        assert!(err(&bytes[..bytes.len() - 1]).contains("truncated"));
        // Every single-bit flip past the header is caught by the checksum.
        for at in (HEADER..bytes.len()).step_by(97) {
            let mut b = bytes.clone();
            b[at] ^= 1;
            assert!(err(&b).contains("checksum"), "flip at {at}");
        }
        // A payload that passes the checksum but does not decode (written by another build).
        let mut garbled = bytes[..HEADER].to_vec();
        let junk = vec![0xffu8; bytes.len() - HEADER];
        garbled[28..36].copy_from_slice(&checksum(&[&junk, &[]]).to_le_bytes());
        garbled.extend_from_slice(&junk);
        assert!(err(&garbled).contains("does not read back"));
    }

    /// Read from its file (weights decoded straight from it) a compiled model is what its bytes
    /// give; a damaged file gets the message of the whole-bytes reader.
    #[test]
    fn reading_the_file_equals_reading_its_bytes() {
        let dir = std::env::temp_dir().join(format!("tumble-artifact-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap_or_else(|e| panic!("{e}"));
        let path = dir.join("m.tumble");
        let w: BTreeMap<String, Tensor> = [(
            "w".to_string(),
            Tensor::from_f32(vec![300, 5000], (0..1_500_000).map(|i| i as f32).collect())
                .unwrap_or_else(|e| panic!("{e}")),
        )]
        .into();
        let bytes = artifact_bytes(&sample(), &w).unwrap_or_else(|e| panic!("{e}"));
        // Written tensor by tensor, the file is these bytes (and without weights too).
        save_artifact(&path, &sample(), &w).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(std::fs::read(&path).unwrap_or_default(), bytes);
        save_artifact(&path, &sample(), &BTreeMap::new()).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(
            std::fs::read(&path).unwrap_or_default(),
            artifact_bytes(&sample(), &BTreeMap::new()).unwrap_or_else(|e| panic!("{e}"))
        );
        std::fs::write(&path, &bytes).unwrap_or_else(|e| panic!("{e}"));
        assert!(matches!(open_model(&path), Ok(ModelFile::Compiled)));
        let from_file = read_artifact_file(&path).unwrap_or_else(|e| panic!("{e}"));
        let from_bytes = read_artifact(&path, &bytes).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(from_file.weights, from_bytes.weights);
        assert_eq!(
            format!("{:?}", from_file.artifact.compiled.program.blocks),
            format!("{:?}", from_bytes.artifact.compiled.program.blocks)
        );
        let err = |b: &[u8]| {
            std::fs::write(&path, b).unwrap_or_else(|e| panic!("{e}"));
            match read_artifact_file(&path) {
                Ok(_) => panic!("damaged file loaded"),
                Err(e) => e.to_string(),
            }
        };
        // A flip in the weights' header and one in their data: the checksum says so.
        for at in [bytes.len() - 6_000_000 - 20, bytes.len() - 100] {
            let mut b = bytes.clone();
            b[at] ^= 1;
            assert!(err(&b).contains("checksum"), "flip at {at}");
        }
        assert!(err(&bytes[..bytes.len() - 1]).contains("truncated"));
        std::fs::remove_dir_all(&dir).unwrap_or_else(|e| panic!("{e}"));
    }
}
