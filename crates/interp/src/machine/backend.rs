//! The interface between the machine and tensor work: the machine runs an instance's control
//! flow, and a [`Backend`] decides what an operator call or a block invocation does (computes it
//! now, or records it for a batched run later).

use super::RunError;
use crate::value::Value;
use tumble_ir::{Attrs, Span};
use tumble_ops::OpDef;
use tumble_tensor::Rng;

/// Per-instance state the backend may read and update.
pub struct InstanceCtx {
    /// Draws of `random.db_uniform`, in this instance's program order.
    pub rng: Rng,
    /// Inline depth (ACROBAT §4.1): the depth the next block invocation gets.
    pub depth: u32,
    /// The least depth any of its invocations gets, hoisted ones too: the level a running
    /// session's graph had reached when the instance joined it (0 in a batch run). A hoisted
    /// invocation otherwise gets depth 0, below every level a session has left to launch, and
    /// one joining instance at every step kept the level of the others from being reached.
    pub floor: u32,
    /// Which instance of the mini-batch this is.
    pub instance: u32,
    /// Program phases passed so far (`db.phase_change`).
    pub phase: u32,
    /// The instance's pending evaluations when it last invoked a block, for the message of a
    /// backend that stops on the memory budget.
    pub pending: usize,
}

/// Where tensor work goes.
pub trait Backend {
    /// An operator called outside any static block.
    fn call_op(
        &mut self,
        ctx: &mut InstanceCtx,
        op: &'static OpDef,
        args: Vec<Value>,
        attrs: &Attrs,
        span: Span,
    ) -> Result<Value, RunError>;

    /// A static block invoked on evaluated arguments, from invocation site `site` (an index into
    /// `Program::sites`). The backend takes the arguments out of `args`; the caller reuses the
    /// vector for the next invocation (one allocation fewer per invocation).
    fn invoke_block(
        &mut self,
        ctx: &mut InstanceCtx,
        block: u32,
        site: u32,
        args: &mut Vec<Value>,
        span: Span,
    ) -> Result<Value, RunError>;

    /// `n` ghost operators (ACROBAT Fig. 3): scheduling-only, nothing is computed. Backends that
    /// schedule by inline depth advance it; others ignore them.
    fn ghost(&mut self, _ctx: &mut InstanceCtx, _n: u32) {}

    /// The truth value of an `if` condition, or `None` if it is not computed yet (the instance
    /// then suspends until the backend has computed it).
    fn condition(&mut self, v: &Value) -> Result<Option<bool>, RunError>;

    /// Whether the arguments of an operator called outside a block are computed. Such operators
    /// (random draws) run on the host in the instance's program order, so an argument still
    /// pending in a lazy backend (`random.db_uniform(0, %n)` with `%n` from a block) suspends the
    /// instance, like an unready `if` condition, until the backend has computed it.
    fn op_args_ready(&mut self, _args: &[Value]) -> Result<bool, RunError> {
        Ok(true)
    }

    /// What this backend holds that grows with the run (e.g. "1,200,000 dataflow nodes not yet
    /// run"), for the message when a run exceeds its memory budget; empty if nothing.
    fn growth(&self) -> String {
        String::new()
    }
}

/// How a call to [`Machine::run`](super::Machine::run) ended.
pub enum Outcome {
    Done(Value),
    /// Waiting for a tensor value; call `run` again once the backend has computed it.
    Blocked,
    /// At a `db.phase_change()` boundary; calling `run` again passes it.
    Phase,
    /// Ran past its time slice ([`Machine::set_time_slice`](super::Machine::set_time_slice))
    /// without finishing or suspending; calling `run` again goes on where it stopped.
    Yielded,
}
