//! How a run fails: [`RunError`], told apart as a user's error or a bug in tumble, and the
//! messages of a run stopped at its limits (shared with the batching runtime, which stops runs of
//! its own).

use tumble_ir::Span;

/// A run-time failure, located at the program point that failed where known. Boxed: every
/// evaluation step returns a `Result<_, RunError>`, and the failure is rare, so the success path
/// moves a value the size of a [`Value`](crate::value::Value) instead of one the size of the
/// error's fields.
#[derive(Debug, Clone)]
pub struct RunError(Box<RunErrorInfo>);

/// What a [`RunError`] says (its fields, reached through it).
#[derive(Debug, Clone)]
pub struct RunErrorInfo {
    pub message: String,
    pub span: Option<Span>,
    /// The calls that led to the failure, innermost first (a failure inside a prelude function
    /// names the user's call of it); calls in tail position leave no frame and are not listed.
    pub trace: Vec<Span>,
    /// A broken invariant of tumble itself (a bug), not a problem with the user's program or
    /// data: the faces report it as a bug to report, with their own exit status.
    pub internal: bool,
}

/// What the runtime's own invariant checks put in their messages (`internal: ...`): a message
/// that carries it, however it was wrapped, makes an internal error.
const INTERNAL: &str = "internal:";

impl RunError {
    pub fn at(span: Span, message: impl Into<String>) -> Self {
        let message = message.into();
        RunError(Box::new(RunErrorInfo {
            internal: message.contains(INTERNAL),
            message,
            span: Some(span),
            trace: Vec::new(),
        }))
    }

    pub fn new(message: impl Into<String>) -> Self {
        let message = message.into();
        RunError(Box::new(RunErrorInfo {
            internal: message.contains(INTERNAL),
            message,
            span: None,
            trace: Vec::new(),
        }))
    }

    /// A broken invariant of tumble itself.
    pub fn internal(message: impl Into<String>) -> Self {
        RunError(Box::new(RunErrorInfo {
            message: format!("{INTERNAL} {}", message.into()),
            span: None,
            trace: Vec::new(),
            internal: true,
        }))
    }

    /// The error's fields, to take apart.
    pub fn into_info(self) -> RunErrorInfo {
        *self.0
    }

    /// The note the faces print under an internal error.
    pub const BUG_NOTE: &'static str = "this is a bug in tumble, not in the model or its inputs: \
        please report it with the model, the instances and the command line";
}

impl std::ops::Deref for RunError {
    type Target = RunErrorInfo;
    fn deref(&self) -> &RunErrorInfo {
        &self.0
    }
}

impl std::ops::DerefMut for RunError {
    fn deref_mut(&mut self) -> &mut RunErrorInfo {
        &mut self.0
    }
}

/// The error for a run stopped by its limits: an interrupt says only that, a time limit that and
/// `hint`; a memory budget also says what the run holds (`held`, empty parts skipped) and `hint`.
pub fn limit_error(stop: tumble_limits::Stop, held: Vec<String>, hint: &str) -> RunError {
    match stop {
        tumble_limits::Stop::Interrupted => return RunError::new(stop.to_string()),
        tumble_limits::Stop::TimedOut { .. } => return RunError::new(format!("{stop}{hint}")),
        tumble_limits::Stop::Memory { .. } => {}
    }
    let held: Vec<String> = held.into_iter().filter(|h| !h.is_empty()).collect();
    if held.is_empty() {
        return RunError::new(format!("{stop}{hint}"));
    }
    RunError::new(format!(
        "{stop}; the run holds {}{hint}",
        held.join(" and ")
    ))
}

/// Calls listed in an error's trace, innermost first.
pub const MAX_TRACE: usize = 8;

/// What a run stopped at a limit adds to its message when one instance has this many
/// evaluations pending: deep pending work is what a recursion without a base case grows, whichever
/// allocation (the evaluator's stack, the graph's node table) crossed the budget first.
pub fn runaway_hint(pending: usize) -> &'static str {
    if pending >= 100_000 {
        " (a recursion without a base case?)"
    } else {
        ""
    }
}

#[cfg(test)]
mod error_tests {
    use super::RunError;

    #[test]
    fn broken_invariants_are_told_apart_from_user_errors() {
        assert!(RunError::internal("slot 3 is empty").internal);
        assert!(RunError::internal("x").message.starts_with("internal:"));
        // However the runtime wraps its own check's message, it stays a bug.
        assert!(RunError::new("in block cell: internal: node").internal);
        assert!(!RunError::new("nn.dense: input has 5 columns but weight expects 4").internal);
    }
}
