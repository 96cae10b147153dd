//! The one IR of tumble: the syntax tree of a Relay-text module, the types the checker assigns to it,
//! operator attributes, source spans and diagnostics.
//!
//! This crate owns data only. Turning text into this IR lives in `tumble-syntax`; giving it types in
//! `tumble-check`; operator knowledge in `tumble-ops`. It depends on nothing else of tumble.

pub mod ast;
pub mod attrs;
pub mod diag;
pub mod scope;
pub mod serial;
pub mod source;
pub mod span;
pub mod types;
pub mod visit;

pub use ast::*;
pub use attrs::{AttrValue, Attrs};
pub use diag::{Diagnostic, Label, Severity};
pub use source::{SourceId, SourceMap};
pub use span::Span;
pub use types::{DType, Dim, Ty, TyVar};
