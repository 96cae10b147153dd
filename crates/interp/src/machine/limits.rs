//! When the machine looks at the run limits (memory budget, Ctrl-C, a served request's deadline):
//! every few thousand steps, so the check costs nothing measurable and a runaway is still stopped
//! at once.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

use super::{limit_error, runaway_hint, Backend, Machine, RunError};

/// When a run is no longer wanted: past `deadline` (a served request's `--timeout-ms`), or once
/// `cancelled` is set from another thread (its client went away). The machine looks at it with
/// its other limits; the batching runtime between launches.
#[derive(Clone, Debug, Default)]
pub struct StopWhen {
    pub deadline: Option<Instant>,
    pub cancelled: Option<Arc<AtomicBool>>,
}

/// Why a [`StopWhen`] fired.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Unwanted {
    Cancelled,
    PastDeadline,
}

impl StopWhen {
    /// Whether it can ever fire.
    pub fn is_set(&self) -> bool {
        self.deadline.is_some() || self.cancelled.is_some()
    }

    /// Whether it has fired by `now`, and why.
    pub fn fired(&self, now: Instant) -> Option<Unwanted> {
        if self
            .cancelled
            .as_ref()
            .is_some_and(|f| f.load(Ordering::Relaxed))
        {
            Some(Unwanted::Cancelled)
        } else if self.deadline.is_some_and(|d| now >= d) {
            Some(Unwanted::PastDeadline)
        } else {
            None
        }
    }
}

/// Pending calls beyond this are reported as runaway recursion instead of exhausting memory.
pub const MAX_PENDING: usize = 50_000_000;

/// Steps between two looks at the run limits (memory budget, Ctrl-C): a step costs tens of
/// nanoseconds, so a runaway is noticed within a fraction of a millisecond of crossing a limit.
pub(super) const POLL_EVERY: u32 = 4096;

impl<'p> Machine<'p> {
    /// Evaluation steps taken so far (for the profile: the host program's cost per step).
    pub fn steps(&self) -> u64 {
        self.steps_before + u64::from(POLL_EVERY - self.poll_in)
    }

    /// Counts one evaluation step, looking at the run limits every [`POLL_EVERY`] steps.
    pub(super) fn tick(&mut self, backend: &dyn Backend) -> Result<(), RunError> {
        self.poll_in -= 1;
        if self.poll_in == 0 {
            self.poll_in = POLL_EVERY;
            self.steps_before += u64::from(POLL_EVERY);
            self.check_limits(backend)?;
            if let (Some(slice), Some(began)) = (self.slice, self.slice_began) {
                self.yield_due = began.elapsed() >= slice;
            }
        }
        Ok(())
    }

    /// Sets (or clears) when the run stops with an error at its next look at the limits.
    pub fn set_stop(&mut self, stop: StopWhen) {
        self.stop = stop;
    }

    /// Sets (or clears) how long one [`Machine::run`] may go before it returns
    /// [`Outcome::Yielded`](super::Outcome::Yielded); looked at with the run limits, so a run
    /// overshoots it by at most [`POLL_EVERY`] steps (and a loop taken at once, which yields
    /// when it is done).
    pub fn set_time_slice(&mut self, slice: Option<std::time::Duration>) {
        self.slice = slice;
    }

    /// Stops the run when it was interrupted, is over its memory budget (saying what grew) or
    /// ran past its deadline.
    fn check_limits(&self, backend: &dyn Backend) -> Result<(), RunError> {
        if self.stop.is_set() {
            match self.stop.fired(Instant::now()) {
                Some(Unwanted::Cancelled) => {
                    return Err(RunError::new(format!(
                        "stopped after {} evaluation steps: the run is no longer wanted (its \
                         client went away)",
                        self.steps()
                    )))
                }
                Some(Unwanted::PastDeadline) => {
                    return Err(RunError::new(format!(
                        "stopped after {} evaluation steps: the instance ran past its deadline \
                         (a recursion without a base case?)",
                        self.steps()
                    )))
                }
                None => {}
            }
        }
        let Err(stop) = tumble_limits::poll() else {
            return Ok(());
        };
        let held = vec![
            format!(
                "{} pending evaluations in this instance",
                tumble_limits::count_text(self.stack.len())
            ),
            backend.growth(),
        ];
        Err(limit_error(stop, held, runaway_hint(self.stack.len())))
    }
}
