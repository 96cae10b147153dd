//! Writing output files atomically, and JSON Lines to a file or to standard output, streamed:
//! each line is made, written and dropped before the next is made, so the output is never held
//! in memory whole.
//!
//! A file is written through an [`AtomicFile`]: a temp file in the target's directory (named
//! `.NAME.tmp.PID.N`), flushed, synced and renamed over the target once complete. Until then
//! nothing is at the target, and every way out short of [`AtomicFile::commit`] — an error, an
//! interrupt, a panic — removes the temp file.

use std::fs::{self, File, OpenOptions};
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use tumble_limits::Stop;

use crate::error::DataError;

static COUNTER: AtomicU64 = AtomicU64::new(0);

/// A file being written atomically: writes go, buffered, to a temp file next to the target;
/// [`commit`](AtomicFile::commit) syncs it and renames it over the target. Dropped without a
/// commit, it removes the temp file and leaves the target as it was.
#[derive(Debug)]
pub struct AtomicFile {
    /// The file to replace (a symlink's target, not the link).
    target: PathBuf,
    /// The temp file in `target`'s directory; `None` when the target is a stream written in
    /// place ([`is_stream`]).
    temp: Option<PathBuf>,
    /// `None` only once committed.
    writer: Option<BufWriter<File>>,
    committed: bool,
}

/// `path`, or through a symlink its target, also one not created yet (a rename over the link
/// would replace the link). This crate may not use tumble-io, whose writer does the same.
fn resolve_target(path: &Path) -> PathBuf {
    match fs::symlink_metadata(path) {
        Ok(m) if m.file_type().is_symlink() => fs::canonicalize(path)
            .or_else(|_| {
                fs::read_link(path).map(|t| match path.parent() {
                    Some(dir) if t.is_relative() => dir.join(t),
                    _ => t,
                })
            })
            .unwrap_or_else(|_| path.to_path_buf()),
        _ => path.to_path_buf(),
    }
}

impl AtomicFile {
    /// Creates the temp file for writing `path` (through a symlink: its target).
    pub fn create(path: &Path) -> Result<AtomicFile, DataError> {
        if is_stream(path) {
            let file = OpenOptions::new()
                .write(true)
                .open(path)
                .map_err(|e| DataError::io(path, "open", e))?;
            return Ok(AtomicFile {
                target: path.to_path_buf(),
                temp: None,
                writer: Some(BufWriter::new(file)),
                committed: false,
            });
        }
        let target = resolve_target(path);
        let dir = match target.parent() {
            Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
            _ => PathBuf::from("."),
        };
        let Some(name) = target.file_name() else {
            return Err(DataError::Invalid(format!(
                "cannot write {}: the path names no file",
                target.display()
            )));
        };
        let n = COUNTER.fetch_add(1, Ordering::Relaxed);
        let temp = dir.join(format!(
            ".{}.tmp.{}.{n}",
            name.to_string_lossy(),
            std::process::id()
        ));
        let file = OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&temp)
            .map_err(|e| DataError::io(&target, "create a temporary file next to", e))?;
        Ok(AtomicFile {
            target,
            temp: Some(temp),
            writer: Some(BufWriter::new(file)),
            committed: false,
        })
    }

    /// The file that [`commit`](AtomicFile::commit) replaces (a symlink's target).
    pub fn target(&self) -> &Path {
        &self.target
    }

    /// The temp file being written (`None`: the target is a stream, written in place).
    pub fn temp_path(&self) -> Option<&Path> {
        self.temp.as_deref()
    }

    /// Flushes and syncs the temp file and renames it over the target. On an error the temp file
    /// is removed and the target is left as it was.
    pub fn commit(mut self) -> Result<(), DataError> {
        let Some(mut writer) = self.writer.take() else {
            return Ok(());
        };
        let flushed = writer.flush();
        // Whatever the flush left in the buffer is dropped, not written again.
        let (file, _) = writer.into_parts();
        flushed.map_err(|e| DataError::io(&self.target, "write", e))?;
        let Some(temp) = &self.temp else {
            self.committed = true;
            return Ok(());
        };
        file.sync_all()
            .map_err(|e| DataError::io(&self.target, "write", e))?;
        drop(file);
        fs::rename(temp, &self.target).map_err(|e| DataError::io(&self.target, "write", e))?;
        self.committed = true;
        Ok(())
    }

    fn writer(&mut self) -> std::io::Result<&mut BufWriter<File>> {
        self.writer
            .as_mut()
            .ok_or_else(|| std::io::Error::other("the file is already committed"))
    }
}

impl Write for AtomicFile {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.writer()?.write(buf)
    }

    fn write_all(&mut self, buf: &[u8]) -> std::io::Result<()> {
        self.writer()?.write_all(buf)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.writer()?.flush()
    }
}

impl Drop for AtomicFile {
    fn drop(&mut self) {
        if self.committed {
            return;
        }
        if let Some(writer) = self.writer.take() {
            // Closed without flushing: the buffered rest is discarded with the file.
            drop(writer.into_parts());
        }
        if let Some(temp) = &self.temp {
            let _ = fs::remove_file(temp);
        }
    }
}

/// Whether `path` (through symlinks) is an existing device, FIFO or socket (`/dev/null`,
/// `/dev/stdout` on a pipe, a named pipe): written in place, since a rename over it would
/// replace the special file with a regular one (as root, `/dev/null` itself) and a stream has
/// no old contents to keep. (tumble-io's writer makes the same test.)
fn is_stream(path: &Path) -> bool {
    fs::metadata(path).is_ok_and(|m| !m.is_file() && !m.is_dir())
}

/// Writes `path` atomically: `write` fills a temp file in the same directory, which is then
/// flushed, synced and renamed over `path`. On any error the temp file is removed and `path` is
/// left as it was.
pub fn write_atomically(
    path: &Path,
    write: impl FnOnce(&mut dyn Write) -> std::io::Result<()>,
) -> Result<(), DataError> {
    let mut file = AtomicFile::create(path)?;
    write(&mut file).map_err(|e| DataError::io(file.target(), "write", e))?;
    file.commit()
}

/// Why [`copy_lines`] stopped early.
enum Halt {
    /// The writer failed.
    Io(std::io::Error),
    /// Interrupted, past the time limit, or over the memory budget.
    Stop(Stop),
    /// The line source failed.
    Data(DataError),
}

/// Writes each line with its `\n`, asking [`tumble_limits::poll`] before making each line (and
/// once after the last). Adds to `count` per line written.
fn copy_lines<I>(w: &mut dyn Write, lines: I, count: &mut usize) -> Result<(), Halt>
where
    I: IntoIterator<Item = Result<String, DataError>>,
{
    let mut lines = lines.into_iter();
    loop {
        tumble_limits::poll().map_err(Halt::Stop)?;
        let Some(line) = lines.next() else {
            return Ok(());
        };
        let line = line.map_err(Halt::Data)?;
        w.write_all(line.as_bytes()).map_err(Halt::Io)?;
        w.write_all(b"\n").map_err(Halt::Io)?;
        *count += 1;
    }
}

/// Writes `lines` (each without its `\n`) as JSON Lines to `path` atomically, or to standard
/// output when `path` is `None` (a closed pipe, as in `| head`, ends the output quietly). Lines
/// are made and written one at a time. Between lines [`tumble_limits::poll`] is asked whether to
/// go on: on an interrupt, a passed time limit or an exceeded memory budget the output stops with
/// [`DataError::Stopped`] and, for a file, the temp file is removed, so nothing is written at
/// `path`; so it is on any other error. Returns the number of lines written.
pub fn write_lines<I>(path: Option<&Path>, lines: I) -> Result<usize, DataError>
where
    I: IntoIterator<Item = Result<String, DataError>>,
{
    let mut count = 0usize;
    match path {
        Some(path) => {
            let mut file = AtomicFile::create(path)?;
            match copy_lines(&mut file, lines, &mut count) {
                Ok(()) => {}
                Err(Halt::Io(e)) => return Err(DataError::io(file.target(), "write", e)),
                Err(Halt::Stop(stop)) => {
                    return Err(DataError::Stopped {
                        stop,
                        path: Some(path.to_path_buf()),
                    })
                }
                Err(Halt::Data(e)) => return Err(e),
            }
            file.commit()?;
            Ok(count)
        }
        None => {
            let stdout = std::io::stdout();
            let mut w = BufWriter::new(stdout.lock());
            let copied =
                copy_lines(&mut w, lines, &mut count).and_then(|()| w.flush().map_err(Halt::Io));
            match copied {
                Ok(()) => Ok(count),
                Err(Halt::Io(e)) if e.kind() == std::io::ErrorKind::BrokenPipe => Ok(count),
                Err(Halt::Io(e)) => Err(DataError::io(Path::new("<stdout>"), "write", e)),
                Err(Halt::Stop(stop)) => Err(DataError::Stopped { stop, path: None }),
                Err(Halt::Data(e)) => Err(e),
            }
        }
    }
}
