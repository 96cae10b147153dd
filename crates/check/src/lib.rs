//! Type inference.
