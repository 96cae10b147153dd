//! [`IoError`]: the one error type of this crate.

use std::fmt;
use std::path::{Path, PathBuf};

/// Everything that can go wrong getting weights and instances in and results out.
///
/// Every message says which file (or instance) is at fault, what was expected and what was found,
/// so the user can fix the input without reading tumble's source. `Display` renders the whole
/// message; the variants let callers tell the kinds apart.
#[derive(Debug)]
pub enum IoError {
    /// The operating system refused an operation on a file (open, read, write, rename).
    File {
        path: PathBuf,
        /// What tumble was doing, e.g. "read the weights file".
        action: String,
        source: std::io::Error,
    },
    /// A weights file (safetensors or `.npy`) is malformed or holds something tumble cannot use.
    Weights { path: PathBuf, message: String },
    /// Binding `@main`'s arguments to the weights file failed (missing, mistyped parameter, ...).
    Param { message: String },
    /// An instance file is not JSON Lines / a JSON array, or a line is too long or too deep.
    Instances {
        source_name: String,
        message: String,
    },
    /// One instance does not match `@main`'s declared argument types.
    Instance {
        source_name: String,
        /// `line 3` (JSON Lines) or `index 2` (JSON array).
        location: String,
        /// Where inside the instance, e.g. `.tree.Rose[1][3]`; empty for the instance itself.
        path: String,
        message: String,
    },
    /// A result cannot be written as JSON (e.g. it contains a function).
    Output { message: String },
    /// A document of instances that would not fit in the memory budget once parsed (a server
    /// answers 413, not 400: the request is well formed).
    TooLarge {
        source_name: String,
        message: String,
    },
    /// A document of instances that would fit in the memory budget, but not beside what is in
    /// use now (a server answers 503: the same request can succeed later; 413 would say it never
    /// can).
    NoRoomNow {
        source_name: String,
        message: String,
    },
}

impl IoError {
    pub(crate) fn file(path: &Path, action: impl Into<String>, source: std::io::Error) -> IoError {
        IoError::File {
            path: path.to_path_buf(),
            action: action.into(),
            source,
        }
    }

    pub(crate) fn weights(path: &Path, message: impl Into<String>) -> IoError {
        IoError::Weights {
            path: path.to_path_buf(),
            message: message.into(),
        }
    }

    pub(crate) fn param(message: impl Into<String>) -> IoError {
        IoError::Param {
            message: message.into(),
        }
    }

    pub(crate) fn output(message: impl Into<String>) -> IoError {
        IoError::Output {
            message: message.into(),
        }
    }
}

impl fmt::Display for IoError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            IoError::File {
                path,
                action,
                source,
            } => write!(f, "cannot {action} `{}`: {source}", path.display()),
            IoError::Weights { path, message } => {
                write!(f, "weights file `{}`: {message}", path.display())
            }
            IoError::Param { message } => f.write_str(message),
            IoError::Instances {
                source_name,
                message,
            }
            | IoError::TooLarge {
                source_name,
                message,
            }
            | IoError::NoRoomNow {
                source_name,
                message,
            } => write!(f, "{source_name}: {message}"),
            IoError::Instance {
                source_name,
                location,
                path,
                message,
            } => {
                write!(f, "{source_name}: instance at {location}: ")?;
                if !path.is_empty() {
                    write!(f, "{path}: ")?;
                }
                f.write_str(message)
            }
            IoError::Output { message } => write!(f, "cannot write the result: {message}"),
        }
    }
}

impl std::error::Error for IoError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            IoError::File { source, .. } => Some(source),
            _ => None,
        }
    }
}
