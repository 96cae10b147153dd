//! When the machine looks at the run limits (memory budget, Ctrl-C, a served request's deadline):
//! every few thousand steps, so the check costs nothing measurable and a runaway is still stopped
//! at once.

use super::{limit_error, runaway_hint, Backend, Machine, RunError};

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
        }
        Ok(())
    }

    /// Sets (or clears) the time after which the run stops with an error (see `deadline`).
    pub fn set_deadline(&mut self, deadline: Option<std::time::Instant>) {
        self.deadline = deadline;
    }

    /// Sets (or clears) a flag that, once set, stops the run with an error at its next look at
    /// the limits (see `cancelled`).
    pub fn set_cancel(&mut self, flag: Option<std::sync::Arc<std::sync::atomic::AtomicBool>>) {
        self.cancelled = flag;
    }

    /// Stops the run when it was interrupted, is over its memory budget (saying what grew) or
    /// ran past its deadline.
    fn check_limits(&self, backend: &dyn Backend) -> Result<(), RunError> {
        if self
            .cancelled
            .as_ref()
            .is_some_and(|f| f.load(std::sync::atomic::Ordering::Relaxed))
        {
            return Err(RunError::new(format!(
                "stopped after {} evaluation steps: the run is no longer wanted (its client went \
                 away)",
                self.steps()
            )));
        }
        if self
            .deadline
            .is_some_and(|d| std::time::Instant::now() >= d)
        {
            return Err(RunError::new(format!(
                "stopped after {} evaluation steps: the instance ran past its deadline (a \
                 recursion without a base case?)",
                self.steps()
            )));
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
