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
    // Through a symlink: its target (the rename below would replace the link).
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
    fs::rename(&temp.path, path)
        .map_err(|e| IoError::file(path, format!("move the finished {what} into place at"), e))?;
    temp.armed = false;
    // Make the rename itself durable where the platform allows (best effort).
    if let Ok(d) = File::open(&dir) {
        let _ = d.sync_all();
    }
    Ok(())
}
