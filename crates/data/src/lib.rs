//! tumble's example data for the model zoo (`models/*.rly`), written as the JSON instances
//! `tumble run` reads (JSON Lines, one instance per line, keyed by `@main`'s input names).
//!
//! | model | source | instance |
//! |---|---|---|
//! | TreeLSTM, MV-RNN | SST trees ([`sst::tree_instance`]) | `{"tree": {"Rose": [[0], [{"Rose": [[12], []]}, ...]]}}` |
//! | BiRNN, StackRNN | SST sentences ([`sst::tokens_instance`]) | `{"tokens": [[12], [7], ...]}` |
//! | NestedRNN | generated ([`gen::nested`]) | `{"seqs": [[[3], [9], ...], ...]}` |
//! | DRNN | generated ([`gen::drnn`]) | `{"latent": [[H floats]], "max_depth": 4, "max_width": 2}` |
//! | Berxit | generated ([`gen::berxit_tokens`]) | `{"tokens": [101, ...128 ids], "threshold": 0.9}` |
//!
//! - [`sst`]: an iterative PTB tree parser with located errors, the SST [`sst::Vocab`] (id 0
//!   `<none>`, 1 `<unk>`, then the 21,701 SST words by descending frequency, ties in byte
//!   order: [`sst::SST_VOCAB_SIZE`] = 21,703 entries, the row count of the zoo's `%emb`), and
//!   tree → instance conversions.
//! - [`gen`]: seeded generators for NestedRNN, DRNN and Berxit; the distributions are
//!   documented there (defaults: NestedRNN 1-8 inner sequences of 20-40 ids in [2, 21703);
//!   DRNN latent N(0, 1), max_depth 3-5, max_width 2-3; Berxit `[CLS]` + 127 ids uniform in
//!   [0, 30522), threshold 0.9).
//! - [`cli`]: `tumble data ...` as a clap [`cli::DataArgs`] plus [`cli::run`].
//!
//! Nothing here panics on bad input: malformed trees and vocabulary files, missing
//! directories and bad settings are [`DataError`]s with messages that name the file, line and
//! column.

pub mod cli;
mod error;
pub mod gen;
pub mod output;
pub mod sst;

pub use error::{DataError, ParseError};
