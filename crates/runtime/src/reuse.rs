//! Parameter reuse (ACROBAT §5.1) as the runtime uses it: the compile-time analysis
//! ([`tumble_compile::reuse`]) says which block inputs are one value for the whole mini-batch; the
//! runtime passes those once per launch and verifies the claim (a launch whose invocations disagree
//! is gathered instead and counted as a reuse miss in the profile).

pub use tumble_compile::{InputReuse, ReuseAnalysis as Reuse};
