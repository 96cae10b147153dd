//! Weight transforms computed once per run ("derived parameters"). A plainly written model
//! often reshapes its weights where it uses them: `nn.dense(%h, transpose(%W))` for a weight kept
//! as `(in, out)`, `split(%W_topo)` to score two decisions with the rows of one matrix,
//! `strided_slice(%pos_emb)` for the positions a sentence needs. Inside a block such a node
//! reads only weights, so every launch recomputed it — a 256×256 transpose copied per launch —
//! and, worse, the planner saw a computed weight where it plans a GEMM on a packed input weight:
//! the product ran as a per-launch repack (BiRNN with `transpose(%W_h)` was 3.7× slower than with
//! `%W_h` laid out for `nn.dense`), and denses of one row set with split weights could not be
//! fused horizontally.
//!
//! This pass finds, in every block whose call sites all pass the same weight entry arguments
//! (`Code::Param(k)` with `k` a weight) for some inputs, the nodes computed only from those inputs
//! and literals, and moves them into a [`Derived`] block evaluated once per run on the weights
//! (the executors append its outputs to the entry's arguments, so [`Code::Param`] reads them).
//! The block takes each moved value that the rest of it reads as a new input, passed as that
//! derived parameter at every call site: to the planner, the reuse analysis and the runtime it is
//! a weight like any other (shared per launch, packed once, horizontally fusable).
//!
//! Gradients do not flow through derived parameters: the training and gradient pipelines run
//! without this pass ([`crate::StaticOptions::derive`]), and the batched backward refuses a
//! program that has any.

use std::collections::BTreeMap;

use crate::blocks::{
    frontier, inputs_read, is_pure_op, part_of, BArg, BVal, Block, BlockInput, OutputShape, Part,
};
use crate::program::{Code, Program};
use tumble_tensor::Tensor;

/// A block of weight transforms: its inputs are entry arguments `params[i]`, its outputs become
/// entry arguments `first`, `first + 1`, ….
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct Derived {
    pub block: Block,
    pub params: Vec<u32>,
    pub first: u32,
}

/// Why derived parameters could not be computed: where, and the message.
#[derive(Debug, Clone)]
pub struct DeriveError {
    pub span: tumble_ir::Span,
    pub message: String,
}

impl Program {
    /// The derived parameters ([`Program::derived`]) of a run whose entry argument `k` is
    /// `param(k)` (only weights are read), in order: each derived block evaluated once with the
    /// reference kernels.
    pub fn derived_values(
        &self,
        param: impl Fn(u32) -> Option<Tensor>,
    ) -> Result<Vec<Tensor>, DeriveError> {
        let mut out = Vec::with_capacity(self.derived_count() as usize);
        let mut rng = tumble_tensor::Rng::new(0);
        for d in &self.derived {
            let fail = |message: String| DeriveError {
                span: d.block.span,
                message,
            };
            let inputs = d
                .params
                .iter()
                .map(|&k| {
                    param(k).ok_or_else(|| {
                        fail(format!(
                            "internal: the weight transforms of `{}` read entry argument {k}, \
                             which is not a tensor",
                            d.block.name
                        ))
                    })
                })
                .collect::<Result<Vec<_>, _>>()?;
            let values = d
                .block
                .eval(&inputs, &mut tumble_ops::OpCtx { rng: &mut rng })
                .map_err(|e| {
                    fail(format!(
                        "in the weight transforms of `{}`: {e}",
                        d.block.name
                    ))
                })?;
            out.extend(values);
        }
        Ok(out)
    }
}

/// What the pass moved, for `explain`.
#[derive(Debug, Clone)]
pub struct DerivedReport {
    /// The block the transforms came from.
    pub from: String,
    /// The operators moved, in order (`transpose`, `split`, …).
    pub ops: Vec<&'static str>,
    /// Derived parameters it reads instead.
    pub values: usize,
}

/// Moves weight-only nodes of every block into derived blocks; `weights` flags the entry's
/// arguments that are model weights.
pub fn derive_params(program: &mut Program, weights: &[bool]) -> Vec<DerivedReport> {
    let Some(n_entry) = program.entry_lambda().map(|l| l.n_params) else {
        return Vec::new();
    };
    // Per block, per input: the weight argument every call site passes there, if they agree.
    let mut known: Vec<Option<Vec<Option<u32>>>> = vec![None; program.blocks.len()];
    for lambda in &program.lambdas {
        lambda.body.visit(&mut |c| {
            let Code::InvokeBlock { block, args, .. } = c else {
                return;
            };
            let Some(k) = known.get_mut(*block as usize) else {
                return;
            };
            let here: Vec<Option<u32>> = args
                .iter()
                .map(|a| match a {
                    Code::Param(p) if weights.get(*p as usize).copied().unwrap_or(false) => {
                        Some(*p)
                    }
                    _ => None,
                })
                .collect();
            *k = Some(match k.take() {
                None => here,
                Some(before) => before
                    .into_iter()
                    .zip(here)
                    .map(|(a, b)| if a == b { a } else { None })
                    .collect(),
            });
        });
    }
    let mut report = Vec::new();
    let mut next = n_entry + program.derived_count();
    let mut new_args: BTreeMap<u32, Vec<u32>> = BTreeMap::new();
    for (bi, k) in known.into_iter().enumerate() {
        let Some(k) = k else { continue };
        let Some(block) = program.blocks.get(bi) else {
            continue;
        };
        let Some(split) = split_block(block, &k, next) else {
            continue;
        };
        report.push(DerivedReport {
            from: block.name.clone(),
            ops: split
                .derived
                .block
                .nodes
                .iter()
                .map(|n| n.op.name)
                .collect(),
            values: split.derived.block.outputs.len(),
        });
        let added: Vec<u32> = (0..split.derived.block.outputs.len() as u32)
            .map(|j| next + j)
            .collect();
        next += added.len() as u32;
        new_args.insert(bi as u32, added);
        program.derived.push(split.derived);
        if let Some(b) = program.blocks.get_mut(bi) {
            *b = split.rest;
        }
    }
    if new_args.is_empty() {
        return report;
    }
    for lambda in &mut program.lambdas {
        lambda.body.visit_mut(&mut |c| {
            if let Code::InvokeBlock { block, args, .. } = c {
                if let Some(added) = new_args.get(block) {
                    args.extend(added.iter().map(|&p| Code::Param(p)));
                }
            }
        });
    }
    report
}

struct Split {
    derived: Derived,
    rest: Block,
}

/// The block cut into its weight transforms (nodes reading only inputs that are weight
/// arguments `known[i]`, literals, and one another) and the rest, which reads the transforms'
/// results it needs as new inputs numbered from its current inputs on; `None` when nothing
/// worth moving is there.
fn split_block(block: &Block, known: &[Option<u32>], first: u32) -> Option<Split> {
    let n = block.nodes.len();
    let mut derivable = vec![false; n];
    let is_derivable = |v: &BVal, derivable: &[bool]| match v {
        BVal::Input(i) => known.get(*i as usize).copied().flatten().is_some(),
        BVal::Node(m) | BVal::Field(m, _) => derivable.get(*m as usize).copied().unwrap_or(false),
        BVal::Const(_) => true,
    };
    for (i, node) in block.nodes.iter().enumerate() {
        let mut operands = node.args.iter().flat_map(BArg::values);
        let all = operands.clone().all(|v| is_derivable(v, &derivable));
        let reads_non_const = operands.any(|v| !matches!(v, BVal::Const(_)));
        derivable[i] = all && is_pure_op(node.op) && reads_non_const;
    }
    // A block of weight transforms only is left alone: its invocation would become the
    // derived parameters themselves, a rewrite of the host code this pass does not make.
    if !derivable.iter().any(|&d| d) || derivable.iter().all(|&d| d) {
        return None;
    }
    // The derived values the rest reads (nodes left in the block, and the block's outputs).
    let frontier = frontier(block, &derivable);
    // Only tensors become parameters (a tuple-valued node is read through its fields).
    if frontier.is_empty()
        || frontier
            .iter()
            .any(|v| block.val_ty(v).as_tensor().is_none())
    {
        return None;
    }
    // The derived block: the known inputs it reads, the derivable nodes, the frontier as outputs.
    let d_nodes: Vec<usize> = (0..n).filter(|&k| derivable[k]).collect();
    let d_inputs = inputs_read(block, &d_nodes, &[]);
    let derived = Derived {
        block: part_of(
            block,
            Part {
                nodes: &d_nodes,
                inputs: &d_inputs,
                cut: Vec::new(),
                outputs: &frontier,
                output_shape: OutputShape::Tuple,
                primitive: false,
                name: format!("{}:weights", block.name),
            },
        )?,
        params: d_inputs
            .iter()
            .map(|&i| known.get(i).copied().flatten().unwrap_or(0))
            .collect(),
        first,
    };
    // The rest: the other nodes, every input, and the frontier read as the new inputs.
    let r_nodes: Vec<usize> = (0..n).filter(|&k| !derivable[k]).collect();
    let all: Vec<usize> = (0..block.inputs.len()).collect();
    let cut = frontier
        .iter()
        .enumerate()
        .map(|(j, v)| {
            let input = BlockInput {
                name: format!("derived param {}", first + j as u32),
                ty: block.val_ty(v),
            };
            (v.clone(), input)
        })
        .collect();
    let rest = part_of(
        block,
        Part {
            nodes: &r_nodes,
            inputs: &all,
            cut,
            outputs: &block.outputs,
            output_shape: block.output_shape,
            primitive: block.primitive,
            name: block.name.clone(),
        },
    )?;
    Some(Split { derived, rest })
}
