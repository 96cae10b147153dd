//! Writing output files atomically, and JSON Lines to a file or to standard output.

use std::fs::{self, File, OpenOptions};
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use crate::error::DataError;

static COUNTER: AtomicU64 = AtomicU64::new(0);

/// A temp file removed on drop unless it was renamed into place.
struct TempFile {
    path: PathBuf,
    armed: bool,
}

impl Drop for TempFile {
    fn drop(&mut self) {
        if self.armed {
            let _ = fs::remove_file(&self.path);
        }
    }
}

/// Writes `path` atomically: `write` fills a temp file in the same directory, which is then
/// flushed, synced and renamed over `path`. On any error the temp file is removed and `path` is
/// left as it was.
pub fn write_atomically(
    path: &Path,
    write: impl FnOnce(&mut BufWriter<&File>) -> std::io::Result<()>,
) -> Result<(), DataError> {
    // Through a symlink: its target, also one not created yet (the rename below would replace
    // the link). This crate may not use tumble-io, whose writer does the same.
    let target = match fs::symlink_metadata(path) {
        Ok(m) if m.file_type().is_symlink() => fs::canonicalize(path)
            .or_else(|_| {
                fs::read_link(path).map(|t| match path.parent() {
                    Some(dir) if t.is_relative() => dir.join(t),
                    _ => t,
                })
            })
            .unwrap_or_else(|_| path.to_path_buf()),
        _ => path.to_path_buf(),
    };
    let path = target.as_path();
    let dir = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    let Some(name) = path.file_name() else {
        return Err(DataError::Invalid(format!(
            "cannot write {}: the path names no file",
            path.display()
        )));
    };
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    let mut temp = TempFile {
        path: dir.join(format!(
            ".{}.tmp.{}.{n}",
            name.to_string_lossy(),
            std::process::id()
        )),
        armed: false,
    };
    let file = OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(&temp.path)
        .map_err(|e| DataError::io(&temp.path, "create", e))?;
    temp.armed = true;
    {
        let mut w = BufWriter::new(&file);
        write(&mut w).map_err(|e| DataError::io(path, "write", e))?;
        w.flush().map_err(|e| DataError::io(path, "write", e))?;
    }
    file.sync_all()
        .map_err(|e| DataError::io(path, "write", e))?;
    drop(file);
    fs::rename(&temp.path, path).map_err(|e| DataError::io(path, "write", e))?;
    temp.armed = false;
    Ok(())
}

/// Writes `lines` (each without its `\n`) as JSON Lines to `path` atomically, or to standard
/// output when `path` is `None` (a closed pipe, as in `| head`, ends the output quietly).
/// Returns the number of lines written.
pub fn write_lines<I>(path: Option<&Path>, lines: I) -> Result<usize, DataError>
where
    I: IntoIterator<Item = Result<String, DataError>>,
{
    // The generator's own errors are kept apart from I/O errors.
    let mut inner_error: Option<DataError> = None;
    let mut count = 0usize;
    let write_all = |w: &mut dyn Write| -> std::io::Result<()> {
        for line in lines {
            match line {
                Ok(line) => {
                    w.write_all(line.as_bytes())?;
                    w.write_all(b"\n")?;
                    count += 1;
                }
                Err(e) => {
                    inner_error = Some(e);
                    return Err(std::io::Error::other("stopped"));
                }
            }
        }
        Ok(())
    };
    let result = match path {
        Some(path) => write_atomically(path, |w| write_all(w)),
        None => {
            let stdout = std::io::stdout();
            let mut w = BufWriter::new(stdout.lock());
            match write_all(&mut w).and_then(|()| w.flush()) {
                Ok(()) => Ok(()),
                Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Ok(()),
                Err(e) => Err(DataError::io(Path::new("<stdout>"), "write", e)),
            }
        }
    };
    if let Some(e) = inner_error {
        return Err(e);
    }
    result.map(|()| count)
}
