//! The compile step: from a typed module to the program the executors run.
//!
//! - [`program`]: control flow lowered to compact code (names resolved to frame slots, closures
//!   converted, constructors and globals to indices); tensor work appears as operator calls or, after
//!   grain coarsening, as `InvokeBlock` of a static block.
//!
//! Nothing here executes tensors; the reference interpreter and the batching runtime do.

mod absint;
pub mod attention;
pub mod blocks;
mod callgraph;
pub mod canon;
pub mod concurrency;
pub mod consts;
pub mod cse;
pub mod derived;
pub mod drops;
pub mod dup;
pub mod ghosts;
pub mod hoist;
pub mod index_split;
pub mod inline;
pub mod inline_leaves;
pub mod lower;
pub mod map_loop;
pub mod merge;
pub mod passes;
pub mod phases;
pub mod pipeline;
pub mod plan;
mod print;
pub mod program;
pub mod query;
pub mod ragged;
pub mod reuse;
pub mod slice_split;
mod slot_set;
pub mod specialize;
pub mod split;
pub mod verify;

pub use blocks::{BArg, BVal, Block, BlockInput, BlockNode, OutputShape};
pub use hoist::{analyze as analyze_hoisting, HoistAnalysis};
pub use lower::{LowerError, LowerOptions};
pub use passes::{optimize, StaticOptions, StaticReport};
pub use pipeline::{compile, CompileOptions, Compiled};
pub use plan::{plan_program, BlockPlan, PlanOptions, Stage};
pub use program::{
    dropped_after, CaptureFrom, Code, CtorEntry, FoldLoop, Lambda, MapLoop, Native, Natives, Pat,
    Program, ScanLoop, Site,
};
pub use reuse::{analyze as analyze_reuse, InputReuse, ReuseAnalysis};
pub use verify::{verify, verify_finished, VerifyError};
