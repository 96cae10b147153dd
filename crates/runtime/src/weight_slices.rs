//! Weight slices: a block that only takes slices of model weights at indices every instance
//! passes alike — a stacked model's layer weights `take(%Ws, %l)`, `%l` a layer counter — or
//! takes one matrix of a model weight by an index it computes from an instance's integers (a
//! typed edge's `take(%Ws, take(%types, %k))`, split off by the compiler's weight-take split)
//! runs on the host once per weight and index for the whole job, and its results are model weights
//! of their own from then on: the products that read them get one shared weight per launch (no
//! reuse miss, no slice copied per invocation: a 3-layer LSTM at H=512 copied 4 MiB per layer
//! per instance and ran 13× slower than the same model with three weights), grouped and keyed
//! by identity like any other weight. `Options::weight_slices`, `--no-weight-slices`.

use std::collections::HashMap;
use std::sync::Mutex;

use tumble_compile::{BArg, BVal, Block, ReuseAnalysis};
use tumble_tensor::Tensor;

/// The most bytes of slices a job keeps; past it, slices are taken per invocation as without
/// weight slices (a "layer" counter over thousands of rows of a table is a lookup, not this).
const MAX_BYTES: usize = 64 << 20;

/// How a weight-slice block's invocations find their slices.
#[derive(Debug, Clone)]
pub(crate) enum SliceBlock {
    /// Every input the same for all instances (a layer counter): keyed by the inputs.
    Shared,
    /// One take of a matrix out of a shared weight by an index its other nodes compute from
    /// per-instance integers (a typed-edge GNN's `take(%Ws, take(%types, %k))`, split off by
    /// `tumble_compile::slice_split`): keyed by the weight and the index the host computes.
    Indexed {
        /// The input sliced.
        weight: u32,
        /// The value the slice is taken by.
        index: BVal,
    },
}

/// How block `b` (number `i`) is a weight-slice block, if it is one.
pub(crate) fn slice_block(b: &Block, reuse: &ReuseAnalysis, i: usize) -> Option<SliceBlock> {
    if is_shared_slice_block(b, reuse, i) {
        Some(SliceBlock::Shared)
    } else {
        indexed_take(b, reuse, i).map(|(weight, index)| SliceBlock::Indexed { weight, index })
    }
}

/// Whether block `b` (number `i`) only takes slices of its inputs by its other inputs or by
/// literals — every node a `take` of block inputs and constants, every output a node — and
/// every input is the same for all instances (`InputReuse::Shared`: a weight, and a layer index
/// counted from a literal; `take(%Ws, 0)`, `take(%Ws, 1)` written out in `@main`, maybe beside
/// a `zeros`).
fn is_shared_slice_block(b: &Block, reuse: &ReuseAnalysis, i: usize) -> bool {
    !b.nodes.is_empty()
        && b.nodes.iter().all(|n| {
            let takes = n.op.name == "take"
                && n.args
                    .iter()
                    .all(|a| matches!(a, BArg::One(BVal::Input(_) | BVal::Const(_))));
            // A constant made beside them (`zeros` for an initial state).
            takes || (n.args.is_empty() && !n.op.name.starts_with("random."))
        })
        && b.outputs.iter().all(|v| matches!(v, BVal::Node(_)))
        && (0..b.inputs.len()).all(|k| reuse.is_shared(i as u32, k))
}

/// For a [`SliceBlock::Indexed`] block ([`tumble_compile::slice_split::weight_take_block`] whose
/// table is shared by every instance): its weight input and the value its take indexes by.
fn indexed_take(b: &Block, reuse: &ReuseAnalysis, i: usize) -> Option<(u32, BVal)> {
    tumble_compile::slice_split::weight_take_block(b)
        .filter(|(w, _)| reuse.is_shared(i as u32, *w as usize))
}

/// What a slice block's input is in a cache key.
pub(crate) enum SliceInput<'a> {
    /// A model weight, by identity.
    Weight(&'a Tensor),
    /// An integer index of one element, by value.
    Index(i64),
}

struct Entry {
    /// The weights sliced, held so that no other tensor takes their addresses while the key
    /// names them.
    sources: Vec<Tensor>,
    slices: Vec<Tensor>,
}

/// The job's slices, by block, weight buffers and index values.
#[derive(Default)]
pub(crate) struct SliceCache {
    inner: Mutex<(HashMap<Vec<u64>, Entry>, usize)>,
}

impl SliceCache {
    /// Drops every slice (and the weights held for their keys).
    pub(crate) fn clear(&self) {
        if let Ok(mut c) = self.inner.lock() {
            *c = Default::default();
        }
    }

    /// The slices block `block_id` computes from `inputs`, from the cache or by `compute`
    /// (kept when the job's budget allows); `Ok(None)` when they are new and the budget is
    /// spent. A slice found costs its key on the stack and one lookup: the weights are compared
    /// where they lie and copied (reference counts) only by the invocation that computes the
    /// slice — every invocation of a typed-edge GNN's edges comes here, nearly all of them to
    /// find their slice.
    pub(crate) fn get_or_compute(
        &self,
        block_id: u32,
        inputs: &[SliceInput],
        compute: impl FnOnce() -> Result<Vec<Tensor>, String>,
    ) -> Result<Option<Vec<Tensor>>, String> {
        let mut key: smallvec::SmallVec<[u64; 8]> = smallvec::SmallVec::new();
        key.push(u64::from(block_id));
        key.extend(inputs.iter().map(|x| match x {
            SliceInput::Weight(t) => t.buffer_id() as u64,
            SliceInput::Index(i) => *i as u64,
        }));
        let weights = || {
            inputs.iter().filter_map(|x| match x {
                SliceInput::Weight(t) => Some(*t),
                SliceInput::Index(_) => None,
            })
        };
        {
            let guard = self.inner.lock().map_err(|_| "internal: slice cache")?;
            if let Some(e) = guard.0.get(key.as_slice()) {
                if e.sources.len() == weights().count()
                    && e.sources
                        .iter()
                        .zip(weights())
                        .all(|(a, b)| a.same_tensor(b))
                {
                    return Ok(Some(e.slices.clone()));
                }
            }
            if guard.1 >= MAX_BYTES {
                return Ok(None);
            }
        }
        let slices = compute()?;
        let bytes: usize = slices.iter().map(|t| t.len() * t.dtype().size()).sum();
        let mut guard = self.inner.lock().map_err(|_| "internal: slice cache")?;
        guard.1 = guard.1.saturating_add(bytes);
        guard.0.insert(
            key.to_vec(),
            Entry {
                sources: weights().cloned().collect(),
                slices: slices.clone(),
            },
        );
        Ok(Some(slices))
    }
}

/// Whether `block` is one `take` of input 0's rows by input 1 in clip mode (the reference's
/// default).
fn row_take(block: &Block) -> bool {
    let [node] = block.nodes.as_slice() else {
        return false;
    };
    tumble_ops::takes_rows(&node.attrs)
        && matches!(
            node.args.as_slice(),
            [BArg::One(BVal::Input(0)), BArg::One(BVal::Input(1))]
        )
}

/// The row a [`row_take`] block takes for index `i` of a table of `rows` rows — clipped, so
/// that indices past either end key the row they take, not a slice of their own.
pub(crate) fn row_taken(block: &Block, i: i64, rows: usize) -> i64 {
    match row_take(block) {
        true => clipped_row(i, rows),
        false => i,
    }
}

/// Row `i` of a table of `rows` rows as a `take` in clip mode reads it (`i` itself for an empty
/// table, whose take fails).
pub(crate) fn clipped_row(i: i64, rows: usize) -> i64 {
    match rows {
        0 => i,
        _ => i.clamp(0, rows as i64 - 1),
    }
}

/// Slices of an f32 weight's rows by one index in clip mode copied directly; anything else is
/// `None` and runs through the reference kernels.
pub(crate) fn fast_slice(block: &Block, inputs: &[Tensor]) -> Option<Vec<Tensor>> {
    let [table, index] = inputs else {
        return None;
    };
    if !row_take(block) {
        return None;
    }
    crate::fastops::take_rows_f32(table, index).map(|t| vec![t])
}
