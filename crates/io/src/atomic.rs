//! Writing a file so that readers see either the old contents or the complete new ones.

use std::fs::{self, File, OpenOptions};
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use crate::IoError;

static COUNTER: AtomicU64 = AtomicU64::new(0);

/// A temp file in the target's directory, removed on drop unless it was renamed into place.
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

/// Writes `path` atomically: `write` fills a temp file in the same directory (so the final
/// rename cannot cross file systems), which is then flushed, fsynced and renamed over `path`.
/// On any error — from `write` or from the file system — the temp file is removed and `path`
/// is left as it was (absent, or with its old contents). `what` names the file in messages
/// ("the output file").
pub(crate) fn write_atomically(
    path: &Path,
    what: &str,
    write: impl FnOnce(&mut BufWriter<&File>) -> Result<(), IoError>,
) -> Result<(), IoError> {
    stage(path, what, write)?.commit()
}

/// A file written in full next to its destination and not yet moved there: [`Staged::commit`]
/// renames it into place; dropped uncommitted, it is removed and the destination left as it was.
/// A command with two outputs stages both before committing either, so a failure writing the
/// second leaves neither (a stream destination, written in place, is already written).
pub struct Staged {
    temp: Option<TempFile>,
    target: PathBuf,
    what: String,
}

impl Staged {
    /// Moves the staged file into place (a no-op for a stream written in place).
    pub fn commit(mut self) -> Result<(), IoError> {
        let Some(mut temp) = self.temp.take() else {
            return Ok(());
        };
        let path = self.target.as_path();
        fs::rename(&temp.path, path)
            .map_err(|e| IoError::file(path, format!("move {} into place at", self.what), e))?;
        temp.armed = false;
        // Make the rename itself durable where the platform allows (best effort).
        let dir = match path.parent() {
            Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
            _ => PathBuf::from("."),
        };
        if let Ok(d) = File::open(&dir) {
            let _ = d.sync_all();
        }
        Ok(())
    }
}

/// [`write_atomically`] up to the rename: the temp file written, flushed and fsynced.
pub(crate) fn stage(
    path: &Path,
    what: &str,
    write: impl FnOnce(&mut BufWriter<&File>) -> Result<(), IoError>,
) -> Result<Staged, IoError> {
    if is_stream(path) {
        write_in_place(path, what, write)?;
        return Ok(Staged {
            temp: None,
            target: path.to_path_buf(),
            what: what.to_string(),
        });
    }
    // Through a symlink: its target (the rename would replace the link).
    let target = crate::through_symlink(path);
    let path = target.as_path();
    let dir = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    let name = path
        .file_name()
        .ok_or_else(|| {
            IoError::file(
                path,
                format!("write {what}"),
                std::io::Error::new(std::io::ErrorKind::InvalidInput, "the path names no file"),
            )
        })?
        .to_string_lossy()
        .into_owned();
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    let mut temp = TempFile {
        path: dir.join(format!(".{name}.tmp.{}.{n}", std::process::id())),
        armed: false,
    };
    let file = OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(&temp.path)
        .map_err(|e| {
            IoError::file(
                path,
                format!("create a temporary file for {what} next to"),
                e,
            )
        })?;
    temp.armed = true;
    {
        let mut w = BufWriter::new(&file);
        write(&mut w)?;
        w.flush()
            .map_err(|e| IoError::file(path, format!("write {what}"), e))?;
    }
    file.sync_all()
        .map_err(|e| IoError::file(path, format!("write {what}"), e))?;
    drop(file);
    Ok(Staged {
        temp: Some(temp),
        target: path.to_path_buf(),
        what: what.to_string(),
    })
}

/// Whether `path` (through symlinks) is an existing device, FIFO or socket — `/dev/null`,
/// `/dev/stdout` on a pipe, a named pipe. Such a target is written where it is: renaming a temp
/// file over it would replace the special file with a regular one (run as root, `-o /dev/null`
/// replaced `/dev/null` itself), and a stream has no old contents to keep.
pub(crate) fn is_stream(path: &Path) -> bool {
    fs::metadata(path).is_ok_and(|m| !m.is_file() && !m.is_dir())
}

/// [`write_atomically`] for a [`is_stream`] target: opened for writing (not created, not
/// renamed), filled and flushed; an error is reported as for a file (`/dev/full`: no space).
fn write_in_place(
    path: &Path,
    what: &str,
    write: impl FnOnce(&mut BufWriter<&File>) -> Result<(), IoError>,
) -> Result<(), IoError> {
    let file = OpenOptions::new()
        .write(true)
        .open(path)
        .map_err(|e| IoError::file(path, format!("open {what}"), e))?;
    let mut w = BufWriter::new(&file);
    write(&mut w)?;
    w.flush()
        .map_err(|e| IoError::file(path, format!("write {what}"), e))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read;

    /// A named pipe given as the output stays a pipe and its reader gets the bytes (a rename
    /// over it made it a regular file the reader never saw; for `/dev/null` as root, the
    /// device itself was replaced). Skipped where `mkfifo` is missing.
    #[test]
    fn a_fifo_is_written_in_place_not_replaced() {
        let dir = std::env::temp_dir().join(format!("tumble-atomic-fifo-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(&dir).unwrap_or_else(|e| panic!("{e}"));
        let fifo = dir.join("out.pipe");
        let made = std::process::Command::new("mkfifo").arg(&fifo).status();
        if !made.is_ok_and(|s| s.success()) {
            let _ = fs::remove_dir_all(&dir);
            return;
        }
        assert!(is_stream(&fifo));
        let reader = {
            let fifo = fifo.clone();
            std::thread::spawn(move || {
                let mut got = String::new();
                File::open(&fifo)
                    .and_then(|mut f| f.read_to_string(&mut got))
                    .unwrap_or_else(|e| panic!("{e}"));
                got
            })
        };
        write_atomically(&fifo, "the output file", |w| {
            w.write_all(b"hello\n")
                .map_err(|e| IoError::file(&fifo, "write", e))
        })
        .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(
            reader.join().unwrap_or_else(|_| panic!("reader")),
            "hello\n"
        );
        let still = fs::symlink_metadata(&fifo).unwrap_or_else(|e| panic!("{e}"));
        assert!(!still.is_file(), "the pipe was replaced by a regular file");
        let leftovers: Vec<_> = fs::read_dir(&dir)
            .unwrap_or_else(|e| panic!("{e}"))
            .filter_map(Result::ok)
            .filter(|e| e.file_name() != "out.pipe")
            .collect();
        assert!(leftovers.is_empty(), "temp files left: {leftovers:?}");
        let _ = fs::remove_dir_all(&dir);
    }

    /// A regular file is still replaced whole (a longer old file leaves no tail).
    #[test]
    fn a_regular_file_is_replaced_whole() {
        let dir = std::env::temp_dir().join(format!("tumble-atomic-file-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(&dir).unwrap_or_else(|e| panic!("{e}"));
        let path = dir.join("out.txt");
        fs::write(&path, "a much longer old content\n").unwrap_or_else(|e| panic!("{e}"));
        assert!(!is_stream(&path));
        write_atomically(&path, "the output file", |w| {
            w.write_all(b"new\n")
                .map_err(|e| IoError::file(&path, "write", e))
        })
        .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(fs::read_to_string(&path).unwrap_or_default(), "new\n");
        let _ = fs::remove_dir_all(&dir);
    }
}
