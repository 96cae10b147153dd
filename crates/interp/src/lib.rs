//! The reference interpreter: evaluates a typed module directly, one instance at a time, calling the
//! reference kernels of `tumble-ops` eagerly. It is the oracle every optimization is tested against,
//! so it favors obviousness over speed — but it never recurses natively per program call (see
//! [`machine`]), so deep lists and trees are fine.

pub mod machine;
pub mod reference;
pub mod tape;
pub mod value;

pub use machine::{
    draws_on_host, Backend, InstanceCtx, Machine, Outcome, RunError, RunErrorInfo, StopWhen,
};
pub use reference::ReferenceBackend;
pub use tumble_compile::{LowerError, Program};
pub use value::{AdtValue, Closure, Fields, LazyRef, TupleValue, Value};

use tumble_tensor::Rng;

/// Runs global `entry` of `program` on `args`. `rng` drives `random.db_uniform`.
pub fn run(
    program: &Program,
    entry: &str,
    args: Vec<Value>,
    rng: &mut Rng,
) -> Result<Value, RunError> {
    let index = *program
        .global_index
        .get(entry)
        .ok_or_else(|| RunError::new(format!("the module has no global `@{entry}`")))?;
    let ctx = InstanceCtx {
        rng: rng.clone(),
        depth: 0,
        floor: 0,
        instance: 0,
        phase: 0,
        pending: 0,
    };
    let mut machine = Machine::new(program, ctx);
    machine.start(index, args)?;
    let mut backend = ReferenceBackend { program };
    loop {
        match machine.run(&mut backend)? {
            Outcome::Done(v) => {
                *rng = machine.ctx.rng.clone();
                return Ok(v);
            }
            // One instance alone: a phase boundary has nothing to wait for (and a time slice,
            // were one set, nothing to give way to).
            Outcome::Phase | Outcome::Yielded => continue,
            Outcome::Blocked => {
                return Err(RunError::new(
                    "internal: the reference backend never blocks",
                ))
            }
        }
    }
}
