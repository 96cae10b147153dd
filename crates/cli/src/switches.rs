//! The compiler's switches that `run` and `explain` share: each turns one pass of the compiler
//! off, so `explain` shows what `run` with the same flags compiles.

use tumble_compile::{LowerOptions, StaticOptions};

/// Flags that each turn one compiler pass off (flattened into `run` and `explain`).
#[derive(clap::Args, Debug, Clone, Default)]
pub struct CompileSwitches {
    /// No grain coarsening: one block per operator call (an operator-level graph, like DyNet).
    #[arg(long)]
    pub no_coarsen: bool,
    /// No constant folding: input-less blocks (`zeros(..)`, arithmetic on literals) run per
    /// invocation instead of becoming literals at compile time.
    #[arg(long)]
    pub no_const_fold: bool,
    /// No inlining: a call of an ordinary function ends its caller's block (the function's body
    /// makes blocks of its own) instead of joining it.
    #[arg(long)]
    pub no_inline: bool,
    /// No program phases: ignore `db.phase_change()` and add no automatic phase boundaries.
    #[arg(long)]
    pub no_phases: bool,
    /// No automatic concurrency: consecutive `let`s calling independent recursions run one
    /// after the other in depth (as written) instead of side by side, as `db.concurrent`
    /// would run them.
    #[arg(long)]
    pub no_auto_concurrency: bool,
    /// No hoisting: every block invocation takes its inline depth from program order (neither the
    /// static taint analysis nor the dynamic rule moves work out of recursion).
    #[arg(long)]
    pub no_hoist: bool,
    /// No hoisting splits: a block found automatically that mixes work on recursive state with
    /// work that reads none (a plain GRU step's `W·x` beside its `U·h`) stays one block, run at
    /// the instance's depth, instead of the latter being split off and hoisted.
    #[arg(long)]
    pub no_hoist_split: bool,
    /// No weight-take splits: a matrix a block takes out of a model weight by an index it
    /// computes (a typed-edge GNN's `take(%Ws, %type)`) is copied per invocation and read as a
    /// weight that differs per invocation, instead of being split off as a weight slice that
    /// the products group their invocations by.
    #[arg(long)]
    pub no_weight_take_split: bool,
    /// No index splits: an integer a block computes from an instance's integer vector (a counted
    /// loop's token `take(%toks, %k)`) stays in the block, run per group of equal lengths,
    /// instead of being split off for the host to compute when the block is invoked.
    #[arg(long)]
    pub no_index_split: bool,
    /// No block merging: a hoisted block read only by another block's invocation (an RNN's
    /// input transform) keeps its own launch. Merging is on only for mini-batches of at least 32
    /// instances, where it pays; `tumble explain` lists what merges.
    #[arg(long)]
    pub no_block_merge: bool,
    /// No derived parameters: operators inside a block that read only weights
    /// (`transpose(%W)`, `split(%W)`, ...) run at every launch instead of once per run, and the
    /// products reading them are planned on computed weights.
    #[arg(long)]
    pub no_derived_params: bool,
    /// No canonical products: a product written with column vectors (`nn.dense(%W,
    /// transpose(%h))`) and the transposes around it run as written, one matrix-vector product
    /// per instance, instead of as one GEMM over the instances' rows.
    #[arg(long)]
    pub no_canonical_products: bool,
    /// No common subexpression elimination: an operator written twice on the same operands
    /// inside a block (a gate's `split(nn.dense(%x, %W), 3)` spelled per gate) runs twice.
    #[arg(long)]
    pub no_cse: bool,
    /// No ghost operators: arms of a conditional that run different numbers of blocks leave
    /// instances at different inline depths.
    #[arg(long)]
    pub no_ghosts: bool,
    /// No code duplication: functions called with different weights are not cloned per call site,
    /// and invocations of a block with different weights may share a launch (the weights are then
    /// gathered per invocation).
    #[arg(long)]
    pub no_dup: bool,
    /// Pass model weights down the program as arguments and captures, as written, instead of
    /// reading them where they are used (fewer values the interpreter copies per call).
    #[arg(long)]
    pub no_param_consts: bool,
    /// Call small leaf functions (`@hd`, wrappers of `Primitive=1` functions) instead of copying
    /// their bodies into the callers.
    #[arg(long)]
    pub no_leaf_inline: bool,
    /// Do not clone higher-order functions (`@map`, `@foldl`) per closure that captures nothing:
    /// call the closure through its value instead.
    #[arg(long)]
    pub no_specialize: bool,
}

impl CompileSwitches {
    /// The lowering's options (`natives`: the prelude's functions run natively).
    pub fn lower(&self, natives: bool) -> LowerOptions {
        LowerOptions {
            blocks: true,
            coarsen: !self.no_coarsen,
            fold: !self.no_const_fold,
            inline: !self.no_inline,
            natives,
        }
    }

    /// The static optimizations left on, for mini-batches of `batch` instances (block merging
    /// pays only from [`tumble_compile::merge::MERGE_MIN_BATCH`] on).
    pub fn statics(&self, batch: usize) -> StaticOptions {
        StaticOptions {
            dup: !self.no_dup,
            hoist: !self.no_hoist,
            ghosts: !self.no_ghosts,
            phases: !self.no_phases,
            params: !self.no_param_consts,
            leaf_inline: !self.no_leaf_inline,
            specialize: !self.no_specialize,
            merge: !self.no_block_merge && batch >= tumble_compile::merge::MERGE_MIN_BATCH,
            derive: !self.no_derived_params,
            canon: !self.no_canonical_products,
            cse: !self.no_cse,
            split: !self.no_hoist_split,
            concurrency: !self.no_auto_concurrency,
            weight_takes: !self.no_weight_take_split,
            index_split: !self.no_index_split,
            for_gradients: false,
        }
    }

    /// The flags set that change how a model is compiled (`--no-block-merge` is not one: see
    /// `compiled::compile_time_flags`).
    pub fn compile_time_flags(&self) -> Vec<&'static str> {
        [
            (self.no_coarsen, "--no-coarsen"),
            (self.no_const_fold, "--no-const-fold"),
            (self.no_inline, "--no-inline"),
            (self.no_dup, "--no-dup"),
            (self.no_param_consts, "--no-param-consts"),
            (self.no_specialize, "--no-specialize"),
            (self.no_leaf_inline, "--no-leaf-inline"),
            (self.no_hoist, "--no-hoist"),
            (self.no_hoist_split, "--no-hoist-split"),
            (self.no_weight_take_split, "--no-weight-take-split"),
            (self.no_index_split, "--no-index-split"),
            (self.no_ghosts, "--no-ghosts"),
            (self.no_phases, "--no-phases"),
            (self.no_auto_concurrency, "--no-auto-concurrency"),
            (self.no_derived_params, "--no-derived-params"),
            (self.no_canonical_products, "--no-canonical-products"),
            (self.no_cse, "--no-cse"),
        ]
        .into_iter()
        .filter_map(|(on, flag)| on.then_some(flag))
        .collect()
    }
}
