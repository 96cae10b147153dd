//! The static optimizations of ACROBAT §4.1/§5.1 run over a lowered program, in order: code
//! duplication (so that the other analyses see one weight per block), entry arguments as per-run
//! constants (after duplication, which gives each function one set of weights), specialization
//! of higher-order functions on the closures they get (after that, which leaves most closures
//! capturing nothing), inlining of leaf functions (after both, so weight-passing wrappers and the
//! specialized closures' bodies are leaves), independent calls made concurrent (after inlining,
//! so a call of an inlined leaf is no longer a call; before hoisting and ghosts, which count
//! depths through the concurrent joins), hoisting (marks sites) and its splits, weight-take splits and index splits (`slice_split`, `index_split`: integer work and weight slices the host computes, cut out of their blocks), ghost operators (which count only non-hoisted sites), automatic phases. Each is
//! switchable; what each found is reported for `tumble explain`.

use crate::dup::Duplicate;
use crate::ghosts::GhostSite;
use crate::program::Program;

/// Which static optimizations run.
#[derive(Debug, Clone, Copy, serde::Serialize, serde::Deserialize)]
pub struct StaticOptions {
    pub dup: bool,
    pub hoist: bool,
    pub ghosts: bool,
    pub phases: bool,
    /// Entry arguments read where they are used instead of passed down ([`crate::consts`]).
    pub params: bool,
    /// Small leaf functions copied into their callers ([`crate::inline_leaves`]).
    pub leaf_inline: bool,
    /// Higher-order functions cloned per closure argument ([`crate::specialize`]).
    pub specialize: bool,
    /// Hoisted blocks read only by another block's invocation run inside it ([`crate::merge`];
    /// callers that know the mini-batch size enable it from [`crate::merge::MERGE_MIN_BATCH`]).
    pub merge: bool,
    /// Weight transforms inside blocks computed once per run ([`crate::derived`]; off for
    /// gradients, which do not flow through them).
    pub derive: bool,
    /// Products in the layout the kernels batch: column-vector products and the transposes
    /// around them rewritten on the instance's rows ([`crate::canon`]).
    pub canon: bool,
    /// Repeated pure operators inside a block computed once ([`crate::cse`]).
    pub cse: bool,
    /// Hoisting splits ([`crate::split`]): an automatic block mixing work on recursive state
    /// with work that reads none is split so that the latter is hoisted. Needs `hoist`.
    pub split: bool,
    /// Consecutive independent calls run side by side ([`crate::concurrency`]). Absent from
    /// artifacts compiled before it existed, which were compiled without it.
    #[serde(default)]
    pub concurrency: bool,
    /// Weight-take splits ([`crate::slice_split`]): a matrix an automatic block takes out of a
    /// model weight by a computed index runs as a block of its own (a weight slice, grouped by
    /// at launch; compiled for gradients too). Absent from artifacts compiled before it
    /// existed, which were compiled without it.
    #[serde(default)]
    pub weight_takes: bool,
    /// Index splits ([`crate::index_split`]): an integer scalar an automatic block computes from
    /// an instance's integer vector (`take(%toks, %k)`) is split off, for the host to compute.
    /// Absent from artifacts compiled before it existed, which were compiled without it.
    #[serde(default)]
    pub index_split: bool,
    /// Compiled for `grad`/`train`: the rewrites whose gradient could differ from the program's
    /// as written stay off — `max`/`min` over every axis by rows first shares the gradient
    /// among tied rows, then tied elements, where the reference shares it among tied elements
    /// ([`crate::canon`]).
    #[serde(default)]
    pub for_gradients: bool,
}

impl StaticOptions {
    pub fn all() -> Self {
        StaticOptions {
            dup: true,
            hoist: true,
            ghosts: true,
            phases: true,
            params: true,
            leaf_inline: true,
            specialize: true,
            merge: true,
            derive: true,
            canon: true,
            cse: true,
            split: true,
            concurrency: true,
            weight_takes: true,
            index_split: true,
            for_gradients: false,
        }
    }

    pub fn none() -> Self {
        StaticOptions {
            dup: false,
            hoist: false,
            ghosts: false,
            phases: false,
            params: false,
            leaf_inline: false,
            specialize: false,
            merge: false,
            derive: false,
            canon: false,
            cse: false,
            split: false,
            concurrency: false,
            weight_takes: false,
            index_split: false,
            for_gradients: false,
        }
    }
}

/// What the static optimizations found and did.
#[derive(Debug, Clone, Default)]
pub struct StaticReport {
    /// Functions cloned per call site.
    pub duplicated: Vec<Duplicate>,
    /// Sites marked hoisted (indices into `Program::sites`).
    pub hoisted: Vec<u32>,
    /// Conditionals padded with ghost operators.
    pub ghosts: Vec<GhostSite>,
    /// Automatic phase boundaries: before which element of the entry's top-level `let` chain.
    pub phases: Vec<usize>,
    /// What binding entry arguments as per-run constants did.
    pub params: crate::consts::ConstReport,
    /// Calls of leaf functions inlined.
    pub leaf_calls_inlined: usize,
    /// Functions specialized on a closure argument.
    pub specialized: Vec<crate::specialize::Specialized>,
    /// Blocks split so that their part reading no recursive state is hoisted.
    pub split: Vec<crate::split::Split>,
    /// Weight takes split off their blocks.
    pub weight_takes: Vec<crate::split::Split>,
    /// Integer index work split off its blocks.
    pub index_splits: Vec<crate::split::Split>,
    /// Hoisted blocks merged into the block that reads them.
    pub merged: Vec<crate::merge::Merged>,
    /// Pairs that would merge but for the weights the merged block would read
    /// ([`crate::merge::MERGE_MAX_WEIGHT_BYTES`]).
    pub not_merged: Vec<crate::merge::Merged>,
    /// Weight transforms moved out of blocks, computed once per run.
    pub derived: Vec<crate::derived::DerivedReport>,
    /// Products and transposes rewritten into the batched layout.
    pub canonical: usize,
    /// Repeated operators inside blocks merged.
    pub cse: usize,
    /// Runs of independent calls made concurrent.
    pub concurrent: Vec<crate::concurrency::Concurrent>,
    /// Slots `let`s clear after their last read ([`crate::drops`]).
    pub slot_drops: usize,
}

/// Runs the switched-on optimizations; `weights` flags the entry's parameters that are model
/// weights (the reuse analysis behind duplication needs them).
pub fn optimize(
    program: &mut Program,
    entry: &str,
    weights: &[bool],
    opts: StaticOptions,
) -> StaticReport {
    let mut report = StaticReport::default();
    if opts.dup {
        report.duplicated = crate::dup::duplicate(program, entry, weights);
        crate::verify::debug_check(program, "code duplication");
    }
    if opts.params {
        report.params = crate::consts::bind_entry_params(program, entry, weights);
        crate::verify::debug_check(program, "entry arguments as constants");
    }
    if opts.specialize {
        report.specialized = crate::specialize::specialize(program, entry);
        crate::verify::debug_check(program, "specialization on closures");
    }
    if opts.leaf_inline {
        report.leaf_calls_inlined = crate::inline_leaves::inline_leaves(program, entry);
        crate::verify::debug_check(program, "leaf inlining");
    }
    if opts.concurrency {
        report.concurrent = crate::concurrency::find(program);
        crate::verify::debug_check(program, "independent calls made concurrent");
    }
    // Repeated operators merged before the hoisting split looks at a block (a gate's product
    // spelled once per gate is one product to split off), and again after merging.
    if opts.cse {
        report.cse = crate::cse::eliminate(program);
        crate::verify::debug_check(program, "common subexpressions");
    }
    if opts.hoist {
        let h = crate::hoist::analyze(program, entry);
        for (i, site) in program.sites.iter_mut().enumerate() {
            site.hoisted = h.hoisted.get(i).copied().unwrap_or(false);
        }
        if opts.split {
            report.split = crate::split::split_hoistable(program, &h.tainted_operands, weights);
            crate::verify::debug_check(program, "hoisting splits");
        }
    }
    // (For gradients too: recording for a backward, a producer whose index every instance passes
    // alike — a layer counter — is one node per weight and index for the mini-batch, read whole
    // by its layer's launches, and one whose index is computed per invocation launches apart
    // from the products, its identical invocations computed once; inside the product's block
    // both copied the matrix per invocation and differentiated it row by row.)
    if opts.weight_takes {
        report.weight_takes = crate::slice_split::split_weight_takes(program, weights);
        crate::verify::debug_check(program, "weight-take splits");
    }
    if opts.index_split {
        report.index_splits = crate::index_split::split_indices(program, weights);
        crate::verify::debug_check(program, "index splits");
    }
    // (After the splits, whose producers keep their sites' hoisting.)
    for (i, site) in program.sites.iter().enumerate() {
        if site.hoisted {
            report.hoisted.push(i as u32);
        }
    }
    if opts.hoist && opts.merge {
        let merges = crate::merge::merge_hoisted(program);
        report.merged = merges.merged;
        report.not_merged = merges.too_heavy;
        crate::verify::debug_check(program, "block merging");
    }
    if opts.cse {
        report.cse += crate::cse::eliminate(program);
        crate::verify::debug_check(program, "common subexpressions");
    }
    if opts.canon {
        // On which block inputs are one value per launch: a product keeps its weight as the
        // packed operand.
        let reuse = crate::reuse::analyze(program, entry, weights);
        report.canonical = crate::canon::canonicalize(program, &reuse, opts.for_gradients);
        crate::verify::debug_check(program, "canonical products");
    }
    if opts.params && opts.derive {
        report.derived = crate::derived::derive_params(program, weights);
        crate::verify::debug_check(program, "derived parameters");
    }
    if opts.ghosts {
        report.ghosts = crate::ghosts::insert(program);
        crate::verify::debug_check(program, "ghost operators");
    }
    if opts.phases {
        report.phases = crate::phases::insert(program, entry);
        crate::verify::debug_check(program, "automatic phases");
    }
    // A pass that changed a prelude function's signature (the entry-argument pass drops a
    // parameter every call fills with the same entry argument) made it no longer the function
    // its native form computes.
    program.prune_natives();
    if program.natives.fast_steps {
        program.natives.map_loops = crate::map_loop::find(program);
        program.natives.fold_loops = crate::map_loop::find_folds(program);
        program.natives.scan_loops = crate::map_loop::find_scans(program);
    }
    // Last: it reads the final code and which functions run as loops.
    report.slot_drops = crate::drops::insert(program);
    crate::verify::debug_check(program, "slot drops");
    report
}
