//! Block merging: a hoisted block whose one result only another block's invocation reads (an
//! RNN's input transform `W·x + b`, read only by its step `tanh(xw + U·h)`) runs inside that
//! invocation's block instead of as a launch of its own.
//!
//! Hoisting (ACROBAT §4.1) runs the input transform of every token of every instance as one
//! launch before the recurrence; the step then reads its row of that launch's output. Merged,
//! the step's block computes `W·x + U·h + b` itself, which its kernel plan runs as one GEMM over
//! `[x; h]` (a sum stage, [`crate::plan::Stage::DenseSum`]) with the embedding rows read where
//! they lie: no intermediate of every token's transform written and read back (page faults on a
//! first run), one graph node per token fewer. It pays once a step's launches have enough rows
//! to amortize the larger weight each step then streams; with a few rows per launch, hoisting's
//! one big launch is better. Callers enable it from the mini-batch size
//! ([`MERGE_MIN_BATCH`]); a merge whose block would read more product weight than fits beside
//! the rest in L2 is not made ([`MERGE_MAX_WEIGHT_BYTES`]); `tumble explain` lists what merged.
//!
//! A merge needs: the producer's site hoisted, its block pure with one single-tensor output,
//! bound by a `let` to a slot read exactly once in its lambda (closures' captures counted), as a
//! whole operand of a block invocation whose site is not hoisted and whose block is pure and has a
//! product of its own (else the merge only runs the producer once per step); the
//! producer's operands immediate (slots, entry arguments, literals), so evaluating them at the
//! consumer instead computes the same values. The merged block takes the producer's inputs, then
//! the consumer's others; one merged block per (producer, consumer, operand) however many sites.

use std::collections::{BTreeMap, HashMap};

use crate::blocks::{is_pure_op, BArg, BVal, Block, BlockInput, BlockNode, OutputShape};
use crate::program::{CaptureFrom, Code, Program};
use crate::split::PRODUCTS;

/// Mini-batches of at least this many instances merge (a step's launches then have about this
/// many rows: the row count from which a launch is no longer bound by streaming its weights, as
/// the runtime's deferred launches assume). Measured on BiRNN and NestedRNN: merged 2–9% faster
/// at 64 per mini-batch, 0–5% slower at 8.
pub const MERGE_MIN_BATCH: usize = 32;

/// The most bytes of product weights a merged block may read. Merging moves the producer's
/// weight into every step's launch: a step that reads more than about half of a core's L2
/// (2 MiB on the Xeon measured) evicts it between steps — and BiRNN's two directions alternate —
/// so each step streams its weights from memory, where unmerged the step's own weight stays in
/// L2 and the producer's runs as one large launch. Measured (`pair_ab.sh 10`, Xeon, 1 thread):
/// BiRNN-large b64 (2 MiB merged per direction) unmerged 0.81–0.90× the time; NestedRNN-large
/// (2 MiB, one direction) no difference either way; the small models (512 KiB) keep merging.
pub const MERGE_MAX_WEIGHT_BYTES: usize = 1 << 20;

/// Bytes of the weights of `b`'s products (`nn.dense`'s second operand where it is an input, or
/// a node computed from inputs alone — a slice of a weight, which derived parameters make an
/// input later: a hoisting split's LSTM column block).
fn dense_weight_bytes(b: &Block) -> usize {
    let from_inputs = |v: &BVal| match v.node().and_then(|k| b.nodes.get(k)) {
        Some(n) => n
            .args
            .iter()
            .flat_map(BArg::values)
            .all(|a| matches!(a, BVal::Input(_) | BVal::Const(_))),
        None => false,
    };
    b.nodes
        .iter()
        .filter(|n| n.op.name == "nn.dense")
        .filter_map(|n| match n.args.get(1) {
            Some(BArg::One(BVal::Input(i))) => b.inputs.get(*i as usize).map(|x| x.ty.clone()),
            Some(BArg::One(v)) if from_inputs(v) => Some(b.val_ty(v)),
            _ => None,
        })
        .filter_map(|ty| {
            let (dims, dtype) = ty.as_tensor()?;
            dims.iter()
                .try_fold(dtype.size(), |n, d| n.checked_mul(d.known()? as usize))
        })
        .fold(0usize, usize::saturating_add)
}

/// One merged pair — or, in [`MergeReport::too_heavy`], a pair left apart — for `explain`.
#[derive(Debug, Clone)]
pub struct Merged {
    pub producer: String,
    pub consumer: String,
    /// Call sites rewritten (or left).
    pub sites: usize,
    /// Bytes of product weights the merged block reads (would read).
    pub weight_bytes: usize,
}

/// What [`merge_hoisted`] did.
#[derive(Debug, Clone, Default)]
pub struct MergeReport {
    pub merged: Vec<Merged>,
    /// Pairs not merged because the merged block would read more than
    /// [`MERGE_MAX_WEIGHT_BYTES`] of product weights.
    pub too_heavy: Vec<Merged>,
}

/// Counts one more site of pair (`producer`, `consumer`) in `list`.
fn note_site(
    list: &mut Vec<Merged>,
    program: &Program,
    producer: u32,
    consumer: u32,
    bytes: usize,
) {
    let name = |b: u32| program.blocks.get(b as usize).map(|x| x.name.clone());
    let (Some(producer), Some(consumer)) = (name(producer), name(consumer)) else {
        return;
    };
    match list
        .iter_mut()
        .find(|m| m.producer == producer && m.consumer == consumer)
    {
        Some(m) => m.sites += 1,
        None => list.push(Merged {
            producer,
            consumer,
            sites: 1,
            weight_bytes: bytes,
        }),
    }
}

/// A producer bound by a `let`: its block and operands.
struct Producer {
    block: u32,
    args: Vec<Code>,
}

/// Merges hoisted producers into their consumers in every lambda of `program`.
pub fn merge_hoisted(program: &mut Program) -> MergeReport {
    let mut merged_blocks: HashMap<(u32, u32, usize), u32> = HashMap::new();
    let mut report = MergeReport::default();
    for li in 0..program.lambdas.len() {
        let uses = slot_uses(program, li);
        let Some(lambda) = program.lambdas.get(li) else {
            continue;
        };
        // Producers: `let $s = invoke A[hoisted](immediates)` with `$s` read once.
        let mut producers: BTreeMap<u32, Producer> = BTreeMap::new();
        lambda.body.visit(&mut |c| {
            let Code::Let { binds, .. } = c else { return };
            for (slot, value) in binds {
                let Code::InvokeBlock {
                    block, site, args, ..
                } = value
                else {
                    continue;
                };
                let hoisted = program.sites.get(*site as usize).is_some_and(|s| s.hoisted);
                if hoisted
                    && uses.get(*slot as usize) == Some(&1)
                    && args.iter().all(immediate)
                    && program.blocks.get(*block as usize).is_some_and(single_pure)
                {
                    producers.insert(
                        *slot,
                        Producer {
                            block: *block,
                            args: args.clone(),
                        },
                    );
                }
            }
        });
        // Consumers: a non-hoisted pure block invocation with `$s` as a whole operand (one
        // producer per consumer site).
        let mut consumers: BTreeMap<u32, (u32, usize)> = BTreeMap::new();
        lambda.body.visit(&mut |c| {
            let Code::InvokeBlock {
                block, site, args, ..
            } = c
            else {
                return;
            };
            let hoisted = program.sites.get(*site as usize).is_some_and(|s| s.hoisted);
            // A consumer with no product of its own gains nothing from the producer's work
            // beside it (no sum of products to run as one GEMM) and would run that work once
            // per step instead of once for every step: the rest of a split that only
            // concatenates the hoisted rows to the recursion's result.
            let fit = program
                .blocks
                .get(*block as usize)
                .is_some_and(|b| pure_block(b) && has_product(b));
            if hoisted || !fit {
                return;
            }
            let operand = args.iter().enumerate().find_map(|(j, a)| match a {
                Code::Slot(s) if producers.contains_key(s) => Some((*s, j)),
                _ => None,
            });
            if let Some((s, j)) = operand {
                consumers.insert(s, (*site, j));
            }
        });
        producers.retain(|s, _| consumers.contains_key(s));
        if producers.is_empty() {
            continue;
        }
        // The merged blocks, then the rewrite: consumers take the producer's work and operands,
        // producers' bindings go. Per consumer site: (merged block, producer operands, j).
        // Producers in slot order, so merged blocks get the same indices in every compile.
        let mut plan: HashMap<u32, (u32, Vec<Code>, usize)> = HashMap::new();
        let pairs = producers
            .iter()
            .filter_map(|(slot, p)| consumers.get(slot).map(|&(site, j)| (site, j, p)));
        for (site, j, p) in pairs {
            let Some(b) = program.sites.get(site as usize).map(|s| s.block) else {
                continue;
            };
            let key = (p.block, b, j);
            let ab = match merged_blocks.get(&key) {
                Some(&ab) => ab,
                None => {
                    let (Some(a), Some(bb)) = (
                        program.blocks.get(p.block as usize),
                        program.blocks.get(b as usize),
                    ) else {
                        continue;
                    };
                    let bytes = dense_weight_bytes(a).saturating_add(dense_weight_bytes(bb));
                    if bytes > MERGE_MAX_WEIGHT_BYTES {
                        note_site(&mut report.too_heavy, program, p.block, b, bytes);
                        continue;
                    }
                    let Some(block) = merge_blocks(a, bb, j) else {
                        continue;
                    };
                    let ab = program.blocks.len() as u32;
                    program.blocks.push(block);
                    merged_blocks.insert(key, ab);
                    ab
                }
            };
            plan.insert(site, (ab, p.args.clone(), j));
            let bytes = program
                .blocks
                .get(ab as usize)
                .map_or(0, dense_weight_bytes);
            note_site(&mut report.merged, program, p.block, b, bytes);
        }
        let merged_slots: Vec<u32> = producers
            .keys()
            .copied()
            .filter(|s| {
                consumers
                    .get(s)
                    .is_some_and(|(site, _)| plan.contains_key(site))
            })
            .collect();
        let Some(lambda) = program.lambdas.get_mut(li) else {
            continue;
        };
        lambda.body.visit_mut(&mut |c| {
            // A `let` left without bindings is its body, which may be a `let` or the consumer
            // itself: look again at what replaced it.
            while let Code::Let { binds, body, .. } = c {
                binds.retain(|(s, _)| !merged_slots.contains(s));
                if !binds.is_empty() {
                    break;
                }
                let body = std::mem::replace(&mut **body, Code::Phase);
                *c = body;
            }
            if let Code::InvokeBlock {
                block, site, args, ..
            } = c
            {
                if let Some((ab, pargs, j)) = plan.get(site) {
                    let mut all = pargs.clone();
                    all.extend(
                        std::mem::take(args)
                            .into_iter()
                            .enumerate()
                            .filter(|(k, _)| k != j)
                            .map(|(_, a)| a),
                    );
                    *args = all;
                    *block = *ab;
                }
            }
        });
        for (site, (ab, _, _)) in &plan {
            if let Some(s) = program.sites.get_mut(*site as usize) {
                s.block = *ab;
            }
        }
    }
    report
}

/// How often each frame slot of lambda `li` is read: `Slot` code and closures' captures.
pub(crate) fn slot_uses(program: &Program, li: usize) -> Vec<u32> {
    let Some(lambda) = program.lambdas.get(li) else {
        return Vec::new();
    };
    let mut uses = vec![0u32; lambda.n_slots as usize];
    let mut note = |s: u32| {
        if let Some(u) = uses.get_mut(s as usize) {
            *u += 1;
        }
    };
    lambda.body.visit(&mut |c| match c {
        Code::Slot(s) => note(*s),
        Code::MakeClosure(k) => {
            for (from, _) in program
                .lambdas
                .get(*k as usize)
                .map_or(&[][..], |l| l.captures.as_slice())
            {
                if let CaptureFrom::Slot(s) = from {
                    note(*s);
                }
            }
        }
        _ => {}
    });
    uses
}

/// Code whose value is at hand without evaluating anything.
fn immediate(c: &Code) -> bool {
    matches!(c, Code::Slot(_) | Code::Param(_) | Code::Lit(_))
}

fn has_product(b: &Block) -> bool {
    b.nodes.iter().any(|n| PRODUCTS.contains(&n.op.name))
}

fn pure_block(b: &Block) -> bool {
    b.nodes.iter().all(|n| is_pure_op(n.op))
}

/// Pure, with one single-tensor output.
fn single_pure(b: &Block) -> bool {
    pure_block(b)
        && b.output_shape == OutputShape::Single
        && b.outputs.len() == 1
        && b.outputs
            .first()
            .is_some_and(|v| b.val_ty(v).as_tensor().is_some())
}

/// Block `a` then block `b`, `b`'s input `j` being `a`'s output: `a`'s inputs, then `b`'s others.
fn merge_blocks(a: &Block, b: &Block, j: usize) -> Option<Block> {
    let a_out = a.outputs.first()?.clone();
    let off_nodes = a.nodes.len() as u32;
    let off_inputs = a.inputs.len() as u32;
    let remap = |v: &BVal| -> BVal {
        match v {
            BVal::Input(i) if *i as usize == j => a_out.clone(),
            BVal::Input(i) if (*i as usize) < j => BVal::Input(off_inputs + i),
            BVal::Input(i) => BVal::Input(off_inputs + i - 1),
            BVal::Node(n) => BVal::Node(off_nodes + n),
            BVal::Field(n, f) => BVal::Field(off_nodes + n, *f),
            BVal::Const(t) => BVal::Const(t.clone()),
        }
    };
    let mut inputs: Vec<BlockInput> = a.inputs.clone();
    inputs.extend(
        b.inputs
            .iter()
            .enumerate()
            .filter(|(k, _)| *k != j)
            .map(|(_, x)| x.clone()),
    );
    let mut nodes = a.nodes.clone();
    nodes.extend(b.nodes.iter().map(|n| BlockNode {
        args: n.args.iter().map(|arg| arg.map(remap)).collect(),
        ..n.clone()
    }));
    // A block a hoisting split made two ([`crate::split`]) is one again: its own name.
    let name = crate::split::rejoined(&a.name, &b.name)
        .unwrap_or_else(|| format!("{}+{}", a.name, b.name));
    Some(Block {
        name,
        inputs,
        nodes,
        outputs: b.outputs.iter().map(remap).collect(),
        output_shape: b.output_shape,
        primitive: a.primitive && b.primitive,
        span: b.span,
    })
}
