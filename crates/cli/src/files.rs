//! Files of a command: `-` for standard output, no output that would replace one of the
//! command's own inputs (links followed), source text with located UTF-8 errors. (Writing through a
//! symlink is the atomic writers' own: `tumble_io::through_symlink`.)

use std::path::{Path, PathBuf};

/// `-o -` is standard output (`None`), as the Unix convention has it.
pub fn output_path(flag: Option<&Path>) -> Option<&Path> {
    flag.filter(|p| p.as_os_str() != "-")
}

/// The file a path names, for comparing: its canonical form, or for a file not created yet its
/// folder's canonical form and its name (links followed either way).
fn identity(path: &Path) -> Option<PathBuf> {
    let path = tumble_io::through_symlink(path);
    if let Ok(p) = std::fs::canonicalize(&path) {
        return Some(p);
    }
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
        _ => PathBuf::from("."),
    };
    Some(std::fs::canonicalize(dir).ok()?.join(path.file_name()?))
}

/// An error naming the two flags when a file to be written is one of the files read, or another
/// file to be written (the same file after following links), checked before anything runs; also
/// when a file to be written is a folder, `-`, or in a folder that does not exist.
pub fn refuse_overwrites(reads: &[(&str, &Path)], writes: &[(&str, &Path)]) -> Result<(), String> {
    let key = identity;
    for (what, w) in writes {
        // Commands whose output can go to standard output take `-` out first (`output_path`).
        if w.as_os_str() == "-" {
            return Err(format!(
                "{what} cannot be standard output (`-`): it is a binary file; give a file name"
            ));
        }
        // Found now, not when the finished output is renamed over it (after a whole run or epoch).
        if std::fs::metadata(w).is_ok_and(|m| m.is_dir()) {
            return Err(format!(
                "{what} {} is a folder; give a file name",
                w.display()
            ));
        }
        // Likewise a file in a folder that does not exist: the atomic writer's temporary file
        // beside it could not be made, after all the work.
        let target = tumble_io::through_symlink(w);
        let folder = match target.parent() {
            Some(d) if !d.as_os_str().is_empty() => d,
            _ => Path::new("."),
        };
        match std::fs::metadata(folder) {
            Ok(m) if m.is_dir() => {}
            Ok(_) => {
                return Err(format!(
                    "{what} {}: {} is not a folder",
                    w.display(),
                    folder.display()
                ))
            }
            Err(e) => {
                return Err(format!(
                    "{what} {}: its folder {} cannot be used ({e}); create it first",
                    w.display(),
                    folder.display()
                ))
            }
        }
    }
    for (k, (what, w)) in writes.iter().enumerate() {
        let Some(wk) = key(w) else { continue };
        let others = reads.iter().chain(writes.get(k + 1..).unwrap_or(&[]));
        for (other, r) in others {
            let Some(rk) = key(r) else { continue };
            // A folder read (a `.npy` weights folder): nothing inside it may be written either.
            if rk != wk && rk.is_dir() && wk.starts_with(&rk) {
                return Err(format!(
                    "{what} {} is inside {other} {}: writing it would change what is read; \
                     choose another path",
                    w.display(),
                    r.display()
                ));
            }
            if rk == wk {
                return Err(format!(
                    "{what} {} is the same file as {other} {}: writing it would replace that file; \
                     choose another path",
                    w.display(),
                    r.display()
                ));
            }
        }
    }
    Ok(())
}

/// A source file's text; a file that is not UTF-8 is an error naming the line, the column and the
/// byte offset of the first invalid byte.
pub fn read_source(path: &Path) -> Result<String, String> {
    source_text(path, read_bytes(path)?)
}

/// The bytes of the model file `path` (within the memory budget).
pub fn read_bytes(path: &Path) -> Result<Vec<u8>, String> {
    tumble_limits::read_file(path).map_err(|e| format!("cannot read {}: {e}", path.display()))
}

/// `bytes` (read from `path`) as source text, or where they stop being UTF-8.
pub fn source_text(path: &Path, bytes: Vec<u8>) -> Result<String, String> {
    if tumble_io::artifact::is_artifact(&bytes) {
        return Err(format!(
            "{} is a compiled model (`tumble compile`); this command reads the model's source \
             (the .rly file)",
            path.display()
        ));
    }
    // A compiled model cut short or with a damaged header: no source starts like one.
    let magic = tumble_io::artifact::MAGIC;
    let head = bytes.get(..bytes.len().min(16)).unwrap_or(&[]);
    let cut_short = bytes.len() >= 4 && magic.starts_with(&bytes);
    if cut_short || (head.starts_with(&magic[..4]) && head.contains(&0)) {
        return Err(format!(
            "{} begins like a compiled model (`tumble compile`), but its header is damaged or \
             cut short: compile the model again",
            path.display()
        ));
    }
    String::from_utf8(bytes).map_err(|e| {
        let at = e.utf8_error().valid_up_to();
        let before = e.as_bytes().get(..at).unwrap_or(&[]);
        let line = before.iter().filter(|&&b| b == b'\n').count() + 1;
        let line_start = before
            .iter()
            .rposition(|&b| b == b'\n')
            .map_or(0, |p| p + 1);
        let column = String::from_utf8_lossy(before.get(line_start..).unwrap_or(&[]))
            .chars()
            .count()
            + 1;
        format!(
            "{}:{line}:{column}: the file is not UTF-8 text: invalid byte 0x{:02x} at byte \
             offset {at}; save it as UTF-8",
            path.display(),
            e.as_bytes().get(at).copied().unwrap_or(0)
        )
    })
}
