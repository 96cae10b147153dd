//! The one compile pipeline: from a checked module and the mask of `@main` arguments bound to
//! weights, to a program ready to run — lower → static optimizations → reuse analysis → kernel
//! plans. Every face (`tumble run`, `tumble explain`, the library `tumble-api` and through it the
//! Python package) and the differential tests go through [`compile`], so they cannot drift apart
//! in which passes run or in what order.

use tumble_check::TypedModule;

use crate::lower::{LowerError, LowerOptions};
use crate::passes::{optimize, StaticOptions, StaticReport};
use crate::plan::{plan_program, BlockPlan, PlanOptions};
use crate::program::Program;
use crate::reuse::{analyze, ReuseAnalysis};

/// What [`compile`] does besides lowering.
#[derive(Debug, Clone, Copy)]
pub struct CompileOptions {
    pub lower: LowerOptions,
    /// The static optimizations, in [`optimize`]'s order (`None`: none, as for the reference
    /// engine; they need blocks, so they are skipped when `lower.blocks` is off).
    pub statics: Option<StaticOptions>,
    /// Kernel plans for the batching runtime (`None`: no plans, every operator through the
    /// batching rules; skipped without blocks).
    pub plans: Option<PlanOptions>,
}

impl CompileOptions {
    /// Everything on: what `tumble run` does by default.
    pub fn batched() -> Self {
        CompileOptions {
            lower: LowerOptions::batched(),
            statics: Some(StaticOptions::all()),
            plans: Some(PlanOptions::default()),
        }
    }

    /// The reference interpreter's view: no blocks, no passes, no plans.
    pub fn reference() -> Self {
        CompileOptions {
            lower: LowerOptions::reference(),
            statics: None,
            plans: None,
        }
    }
}

/// A program ready to run, with what the compile steps found.
#[derive(Debug)]
pub struct Compiled {
    pub program: Program,
    /// Which block inputs are one value per mini-batch.
    pub reuse: ReuseAnalysis,
    /// What each static optimization found (`None` when they did not run).
    pub report: Option<StaticReport>,
    /// The kernel plan of every block, in block order (empty without plans).
    pub plans: Vec<BlockPlan>,
}

/// Lowers `typed`, runs the static optimizations for entry `entry` whose arguments `weights`
/// marks as weights (bound once, the same for every instance), analyzes parameter reuse and
/// plans every block. Errors are the lowering's (a located message about the user's program);
/// the later steps cannot fail on a program that lowered.
pub fn compile(
    typed: &TypedModule,
    entry: &str,
    weights: &[bool],
    opts: CompileOptions,
) -> Result<Compiled, LowerError> {
    let mut program = Program::lower_with(typed, opts.lower)?;
    let report = match (opts.lower.blocks, opts.statics) {
        (true, Some(statics)) => Some(optimize(&mut program, entry, weights, statics)),
        _ => None,
    };
    let reuse = analyze(&program, entry, weights);
    let plans = match (opts.lower.blocks, opts.plans) {
        (true, Some(p)) => plan_program(&program, p),
        _ => Vec::new(),
    };
    Ok(Compiled {
        program,
        reuse,
        report,
        plans,
    })
}
