//! The crate's error types.

use std::fmt;
use std::path::{Path, PathBuf};

use tumble_limits::Stop;

/// A syntax error in PTB tree text or in a vocabulary file, located by 1-based line and column
/// (the column counts characters, not bytes).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ParseError {
    /// 1-based line of the offending character (or of the end of the input).
    pub line: usize,
    /// 1-based column, in characters.
    pub column: usize,
    /// What was wrong, e.g. ``expected ')' after the word "movie", found "(" ``.
    pub message: String,
}

impl fmt::Display for ParseError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "line {}, column {}: {}",
            self.line, self.column, self.message
        )
    }
}

impl std::error::Error for ParseError {}

/// Anything that can go wrong reading data or writing instances.
#[derive(Debug)]
pub enum DataError {
    /// A file could not be read or written.
    Io {
        /// The file.
        path: PathBuf,
        /// What was being done ("read", "write", ...).
        action: &'static str,
        /// The underlying error.
        source: std::io::Error,
    },
    /// A file's contents did not parse.
    Parse {
        /// The file (None: text given directly).
        path: Option<PathBuf>,
        /// Where and what.
        error: ParseError,
    },
    /// A bad setting or a missing input (the message says which).
    Invalid(String),
    /// The output stopped early: interrupted (Ctrl-C) or over the memory budget. Nothing was
    /// written to the output file, if there was one.
    Stopped {
        /// Why.
        stop: Stop,
        /// The output file as given (None: standard output).
        path: Option<PathBuf>,
    },
}

impl DataError {
    pub(crate) fn io(path: &Path, action: &'static str, source: std::io::Error) -> DataError {
        DataError::Io {
            path: path.to_path_buf(),
            action,
            source,
        }
    }

    pub(crate) fn parse(path: &Path, error: ParseError) -> DataError {
        DataError::Parse {
            path: Some(path.to_path_buf()),
            error,
        }
    }
}

impl fmt::Display for DataError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DataError::Io {
                path,
                action,
                source,
            } => write!(f, "cannot {action} {}: {source}", path.display()),
            DataError::Parse {
                path: Some(path),
                error,
            } => write!(f, "{}: {error}", path.display()),
            DataError::Parse { path: None, error } => write!(f, "{error}"),
            DataError::Invalid(msg) => f.write_str(msg),
            DataError::Stopped {
                stop: stop @ (Stop::Interrupted | Stop::TimedOut { .. }),
                path: Some(path),
            } => write!(f, "{stop}; nothing was written to {}", path.display()),
            DataError::Stopped { stop, .. } => write!(f, "{stop}"),
        }
    }
}

impl std::error::Error for DataError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            DataError::Io { source, .. } => Some(source),
            DataError::Parse { error, .. } => Some(error),
            DataError::Invalid(_) | DataError::Stopped { .. } => None,
        }
    }
}

impl From<ParseError> for DataError {
    fn from(error: ParseError) -> DataError {
        DataError::Parse { path: None, error }
    }
}
