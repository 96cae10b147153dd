//! tumble's model I/O: how weights and instances get in and results get out.
//!
//! - **Weights** ([`load_params`], [`save_params`]): safetensors files and directories of `.npy`
//!   files, dtypes float32/float64/int32/int64/bool. Corrupt or truncated files are errors that
//!   name the file and the problem, never panics; NaN/Inf weights are warnings.
//! - **Parameter binding** ([`bind_params`]): an `@main` argument named like a tensor of the
//!   weights file is a parameter shared by every instance (its type is checked); the others come
//!   from the instances, or — when missing — are generated from a seed ([`random_param`]).
//! - **Instances in** ([`read_instances`], [`RawInstances::decode`]): JSON Lines or a JSON array
//!   of objects keyed by argument name, decoded by the declared types into interpreter
//!   [`tumble_interp::Value`]s, with errors that point into the instance
//!   (`instance at line 3: .tree.Rose[0]: expected Tensor[(1), int32], found the number 2.5`).
//! - **Results out** ([`encode_json`], [`summarize`], [`write_jsonl_atomically`]).
//!
//! Deeply nested instances are parsed with native recursion bounded by [`MAX_DEPTH`]; run the
//! reading and decoding on a thread with a large stack (see [`instances`]).
//!
//! This crate sits just above the interpreter: it depends on `tumble-ir`, `tumble-tensor`,
//! `tumble-check` (ADT tables) and `tumble-interp` (run-time values), never on the CLI.

pub mod artifact;
mod atomic;
mod bind;
pub mod decode;
mod env;
mod error;
pub mod instances;
pub mod output;
pub mod tape;
mod tree;
pub mod weights;

pub use atomic::Staged;
pub use bind::{bind_params, random_param, Binding, BoundArg, BoundParams, MAX_RANDOM_ELEMENTS};
pub use decode::{decode_instance, DecodeError, Doc, Kind, Num};
pub use env::{function_inside, main_signature, returns_data, TypeEnv};
pub use error::IoError;
pub use instances::{
    body_never_fits, read_instances, read_instances_capped, read_instances_file,
    read_request_instances, read_request_instances_at_most, InstanceDoc, JsonView, Location,
    RawInstance, RawInstances, ATTACHED_TENSOR_KEY, MAX_DEPTH, MAX_LINE_BYTES,
};
pub use output::{encode_json, stage_jsonl, summarize, write_jsonl_atomically, Encoded};
pub use tape::{AnyDoc, Tape, TapeNode};
pub use tree::{to_tree, OutTree};
pub use weights::{
    load_params, load_params_on, non_finite_warnings, save_params, stage_params, LoadedParams,
};

pub use tumble_limits::echo;

/// The file to write for `path`: a symlink's target, also one not created yet (relative to the
/// link's folder). Writing atomically renames a new file over the path, which would otherwise
/// replace the link itself.
pub fn through_symlink(path: &std::path::Path) -> std::path::PathBuf {
    match std::fs::symlink_metadata(path) {
        Ok(m) if m.file_type().is_symlink() => std::fs::canonicalize(path)
            .or_else(|_| {
                std::fs::read_link(path).map(|t| match path.parent() {
                    Some(dir) if t.is_relative() => dir.join(t),
                    _ => t,
                })
            })
            .unwrap_or_else(|_| path.to_path_buf()),
        _ => path.to_path_buf(),
    }
}
