//! Hoisting splits: a block found automatically that mixes work on recursive state with work
//! that reads none (a plain GRU's step: `W·x` of the token beside `U·h` of the state, one run of
//! operators in the source) is split in two, so that the part reading no recursive state is an
//! invocation of its own that static hoisting ([`crate::hoist`]) schedules by its dataflow
//! depth — every token of every instance in one launch, identical tokens computed once — as it
//! would be had the program put it in a `Primitive=1` function of its own.
//!
//! A site is split when it is not hoisted, its block is automatic (a `Primitive=1` block is the
//! user's unit) and the operands its producer reads are immediate (slots, entry arguments,
//! literals and their fields: evaluated again for the consumer they compute the same values).
//! Any other operand — the recursive call whose result the rest concatenates to — is read by
//! the consumer alone and evaluated once there, after the producer: moving a pure invocation
//! earlier changes no result. Its *clean* nodes are the
//! pure ones that read only operands the taint analysis found free of recursive state in every
//! context, literals and other clean nodes. The producer takes the clean nodes that reach one
//! value the rest of the block reads; views at that frontier (`split` of the input transform
//! into gates, reshapes) go to the consumer so that the producer has one tensor result. Only a
//! producer with a matrix product is worth its launch. The site becomes `let $p = invoke
//! producer(..); invoke consumer(.., $p)`, the producer's site hoisted; block merging
//! ([`crate::merge`]) may then put the two together again where that pays, as it does for a
//! hand-split program.

use std::collections::HashMap;

use crate::blocks::{
    attr, frontier, inputs_read, is_pure_op, live_without, needed_by, nodes_reading_only, part_of,
    renumbered, BArg, BVal, Block, BlockInput, BlockNode, OutputShape, Part,
};
use crate::canon::{dense_attrs_plain, dims2};
use crate::program::{Code, Program, Site};
use tumble_ir::{AttrValue, Attrs, Ty};

/// A block split at one or more sites.
#[derive(Debug, Clone)]
pub struct Split {
    /// The block as it was, and the producer's and consumer's names.
    pub block: String,
    pub producer: String,
    pub consumer: String,
    /// Operators of the producer (the hoisted part, the weight take and its index, the index):
    /// moved there, or copied where the consumer computes them too.
    pub ops: usize,
    pub sites: usize,
}

/// Operators that only rearrange a value: at the producer's frontier they go to the consumer,
/// so that one tensor (the product's result) crosses instead of its pieces.
pub(crate) const VIEWS: &[&str] = &[
    "split",
    "reshape",
    "squeeze",
    "expand_dims",
    "transpose",
    "strided_slice",
];

/// Products worth a launch of their own.
pub(crate) const PRODUCTS: &[&str] = &["nn.dense", "nn.matmul", "nn.batch_matmul"];

/// The names a split gives its two blocks.
const PRODUCER: &str = "/hoisted";
const CONSUMER: &str = "/rest";

/// The name of the block a split made two of, when block merging puts `producer` and
/// `consumer` together again.
pub(crate) fn rejoined(producer: &str, consumer: &str) -> Option<String> {
    let x = producer.strip_suffix(PRODUCER)?;
    (consumer.strip_suffix(CONSUMER)? == x).then(|| x.to_string())
}

/// A split made: the producer's and consumer's block indices, the original operands each takes
/// (the consumer's last input is the producer's result) and its entry in the report.
#[derive(Clone)]
struct Made {
    producer: u32,
    consumer: u32,
    p_in: Vec<usize>,
    c_in: Vec<usize>,
    report: usize,
}

/// A split planned for a block: its producer and consumer until a site takes them, the operands
/// each reads, and where they went.
struct Planned {
    block: String,
    blocks: Option<(Block, Block)>,
    p_in: Vec<usize>,
    c_in: Vec<usize>,
    made: Option<Made>,
}

/// Splits the blocks of non-hoisted sites whose operands are partly free of recursive state
/// (`tainted_operands`, per site and operand, from [`crate::hoist::analyze`]); new producer
/// sites are hoisted. Returns what it split.
///
/// `weights` flags the entry parameters bound to model weights: a product over a concatenation is
/// distributed only where its weight operand is one of them read where used (`Code::Param`), so
/// that its column blocks become derived parameters — a weight chosen per instance, sliced,
/// would be neither derived nor grouped by the runtime's weight groups.
pub fn split_hoistable(
    program: &mut Program,
    tainted_operands: &[Vec<bool>],
    weights: &[bool],
) -> Vec<Split> {
    let candidate = |program: &Program, block: u32, site: u32| -> Option<Vec<bool>> {
        let hoisted = program.sites.get(site as usize).is_none_or(|s| s.hoisted);
        let tainted = tainted_operands.get(site as usize)?;
        let b = program.blocks.get(block as usize)?;
        if hoisted || b.primitive || tainted.len() != b.inputs.len() || tainted.iter().all(|&t| !t)
        {
            return None;
        }
        Some(tainted.iter().map(|&t| !t).collect())
    };
    let plan = |b: &Block, clean: &[bool], weight_operands: &[bool]| {
        // A product over clean and tainted parts first becomes the sum of the parts'
        // products (an LSTM's `dense(concatenate((x, h)), W)`).
        let distributed = distribute_products(b, clean, weight_operands);
        plan_split(distributed.as_ref().unwrap_or(b), clean)
    };
    split_sites(program, weights, &candidate, &plan, Some(true))
}

/// A block cut in two: the producer, the consumer (whose last input is the producer's result),
/// and the original operands each takes.
pub(crate) type Cut = (Block, Block, Vec<usize>, Vec<usize>);

/// Which sites of a block [`split_sites`] considers: a site's mask, by program, block and site.
pub(crate) type SiteMask<'a> = &'a dyn Fn(&Program, u32, u32) -> Option<Vec<bool>>;

/// How [`split_sites`] cuts a block, by mask and weight operands.
pub(crate) type PlanCut<'a> = &'a dyn Fn(&Block, &[bool], &[bool]) -> Option<Cut>;

/// Splits blocks at their invocation sites: `candidate` gives a site's mask (what the plan is
/// keyed by besides the block and its weight operands) or `None` to leave it; `plan` cuts the
/// block by that mask and the site's weight operands (flags of the operands that are the entry
/// parameters `weights` flags, read where used). Each site becomes `let $p = invoke
/// producer(..); invoke consumer(.., $p)`, the producer's site hoisted as `producer_hoisted`
/// says (`None`: as the site was). A producer's operands are evaluated for both invocations, so
/// a site splits only where those are immediate and every other operand is the consumer's.
pub(crate) fn split_sites(
    program: &mut Program,
    weights: &[bool],
    candidate: SiteMask,
    plan: PlanCut,
    producer_hoisted: Option<bool>,
) -> Vec<Split> {
    // Per (block, mask, weight operands): the split planned for it, put in the program by the
    // first site whose operands allow it.
    let mut made: HashMap<(u32, Vec<bool>, Vec<bool>), Option<Planned>> = HashMap::new();
    let mut report: Vec<Split> = Vec::new();
    for li in 0..program.lambdas.len() {
        // The sites of this lambda to split, with their plan.
        let mut plans: HashMap<u32, Made> = HashMap::new();
        let Some(lambda) = program.lambdas.get(li) else {
            continue;
        };
        let mut candidates = Vec::new();
        lambda.body.visit(&mut |c| {
            if let Code::InvokeBlock {
                block, site, args, ..
            } = c
            {
                let weight_operands: Vec<bool> = args
                    .iter()
                    .map(|a| matches!(a, Code::Param(k) if weights.get(*k as usize) == Some(&true)))
                    .collect();
                let immediate_args: Vec<bool> = args.iter().map(immediate).collect();
                candidates.push((*block, *site, immediate_args, weight_operands));
            }
        });
        for (block, site, immediate_args, weight_operands) in candidates {
            let Some(mask) = candidate(program, block, site) else {
                continue;
            };
            let Some(b) = program.blocks.get(block as usize) else {
                continue;
            };
            let key = (block, mask.clone(), weight_operands.clone());
            let planned = made.entry(key).or_insert_with(|| {
                plan(b, &mask, &weight_operands).map(|(producer, consumer, p_in, c_in)| Planned {
                    block: b.name.clone(),
                    blocks: Some((producer, consumer)),
                    p_in,
                    c_in,
                    made: None,
                })
            });
            let Some(planned) = planned else {
                continue;
            };
            // The producer's operands are evaluated twice, so they must be immediate; any other
            // operand is evaluated once, by the consumer's invocation, so it must be read there.
            let evaluable = planned
                .p_in
                .iter()
                .all(|&k| immediate_args.get(k) == Some(&true))
                && immediate_args
                    .iter()
                    .enumerate()
                    .all(|(k, &imm)| imm || planned.c_in.contains(&k));
            if !evaluable {
                continue;
            }
            // The blocks go into the program with the first site that takes them.
            let e = match (&planned.made, planned.blocks.take()) {
                (Some(e), _) => e.clone(),
                (None, Some((producer, consumer))) => {
                    let p = program.blocks.len() as u32;
                    report.push(Split {
                        block: planned.block.clone(),
                        producer: producer.name.clone(),
                        consumer: consumer.name.clone(),
                        ops: producer.nodes.len(),
                        sites: 0,
                    });
                    program.blocks.push(producer);
                    program.blocks.push(consumer);
                    let e = Made {
                        producer: p,
                        consumer: p + 1,
                        p_in: planned.p_in.clone(),
                        c_in: planned.c_in.clone(),
                        report: report.len() - 1,
                    };
                    planned.made = Some(e.clone());
                    e
                }
                (None, None) => continue,
            };
            if let Some(r) = report.get_mut(e.report) {
                r.sites += 1;
            }
            plans.insert(site, e);
        }
        if plans.is_empty() {
            continue;
        }
        // New slots and sites, then the rewrite.
        let mut new_sites: HashMap<u32, (u32, u32)> = HashMap::new();
        let Some(lambda) = program.lambdas.get_mut(li) else {
            continue;
        };
        let mut sites_order: Vec<u32> = plans.keys().copied().collect();
        sites_order.sort_unstable();
        for site in sites_order {
            let Some(p) = plans.get(&site).map(|m| m.producer) else {
                continue;
            };
            let slot = lambda.n_slots;
            lambda.n_slots += 1;
            let (span, inlined_from, was_hoisted) = program
                .sites
                .get(site as usize)
                .map_or((Default::default(), None, false), |s| {
                    (s.span, s.inlined_from, s.hoisted)
                });
            let new_site = program.sites.len() as u32;
            program.sites.push(Site {
                block: p,
                span,
                hoisted: producer_hoisted.unwrap_or(was_hoisted),
                inlined_from,
            });
            new_sites.insert(site, (new_site, slot));
        }
        lambda.body.visit_mut(&mut |c| {
            let Code::InvokeBlock {
                block,
                site,
                args,
                span,
            } = c
            else {
                return;
            };
            let (Some(m), Some(&(new_site, slot))) = (plans.get(site), new_sites.get(site)) else {
                return;
            };
            // (The rewrite's own consumer, visited after it replaced the site.)
            if *block == m.consumer {
                return;
            }
            let pick = |ks: &[usize]| -> Vec<Code> {
                ks.iter().filter_map(|&k| args.get(k).cloned()).collect()
            };
            let producer = Code::InvokeBlock {
                block: m.producer,
                site: new_site,
                args: pick(&m.p_in),
                span: *span,
            };
            let mut c_args = pick(&m.c_in);
            c_args.push(Code::Slot(slot));
            let consumer = Code::InvokeBlock {
                block: m.consumer,
                site: *site,
                args: c_args,
                span: *span,
            };
            *c = Code::Let {
                binds: vec![(slot, producer)],
                body: Box::new(consumer),
                drops: Vec::new(),
            };
        });
        for (site, m) in &plans {
            if let Some(s) = program.sites.get_mut(*site as usize) {
                s.block = m.consumer;
            }
        }
    }
    let split_blocks: Vec<u32> = made
        .iter()
        .filter(|(_, e)| e.as_ref().is_some_and(|p| p.made.is_some()))
        .map(|((b, _, _), _)| *b)
        .collect();
    drop_orphans(program, &split_blocks);
    report
}

/// At most this many nodes are split off one block by [`split_nodes_in_rounds`] (one per
/// round).
const NODE_SPLIT_ROUNDS: usize = 4;

/// Splits a node — with what it depends on — off the non-primitive blocks of automatic sites,
/// where `qualifies` finds one, as `plan` cuts it (by the block and its weight operands at the
/// site); then again on what that made (a block's second weight take, its second index) until
/// a round splits nothing, at most [`NODE_SPLIT_ROUNDS`] times. The producers keep their sites'
/// scheduling. What every round split. (The weight-take and index splits.)
pub(crate) fn split_nodes_in_rounds(
    program: &mut Program,
    weights: &[bool],
    qualifies: &dyn Fn(&Block) -> bool,
    plan: &dyn Fn(&Block, &[bool]) -> Option<Cut>,
) -> Vec<Split> {
    let candidate = |program: &Program, block: u32, _site: u32| -> Option<Vec<bool>> {
        let b = program.blocks.get(block as usize)?;
        (!b.primitive && qualifies(b)).then(Vec::new)
    };
    let plan = |b: &Block, _: &[bool], weight_operands: &[bool]| plan(b, weight_operands);
    let mut report = Vec::new();
    for _ in 0..NODE_SPLIT_ROUNDS {
        let made = split_sites(program, weights, &candidate, &plan, None);
        if made.is_empty() {
            break;
        }
        report.extend(made);
    }
    report
}

/// The name of the consumer of a node split off its block (the rest of the block).
pub(crate) const REST: &str = "/rest";

/// `b` cut at node `k`: the producer `b.name + producer_suffix` computes `k` and what it
/// depends on, the consumer `b.name + consumer_suffix` the rest of the block, reading `k`'s
/// value as its last input (and computing again any of the producer's nodes it reads besides);
/// `None` when nothing is left for the consumer.
pub(crate) fn cut_at(
    b: &Block,
    k: usize,
    producer_suffix: &str,
    consumer_suffix: &str,
) -> Option<Cut> {
    cut_with(b, k, &needed_by(b, k), producer_suffix, consumer_suffix)
}

/// [`cut_at`] for a caller that already knows `needed`, [`needed_by`]`(b, k)`.
pub(crate) fn cut_with(
    b: &Block,
    k: usize,
    needed: &[bool],
    producer_suffix: &str,
    consumer_suffix: &str,
) -> Option<Cut> {
    let live = live_without(b, k);
    if !live.iter().any(|&l| l) {
        return None;
    }
    let producer_nodes: Vec<usize> = (0..b.nodes.len())
        .filter(|&j| needed.get(j) == Some(&true))
        .collect();
    let consumer_nodes: Vec<usize> = (0..b.nodes.len()).filter(|&j| live[j]).collect();
    let names = [producer_suffix, consumer_suffix, "cut"];
    cut_parts(
        b,
        &producer_nodes,
        &consumer_nodes,
        BVal::Node(k as u32),
        names,
    )
}

/// The producer (the nodes `producer_nodes`, returning `out`) and the consumer (the nodes
/// `consumer_nodes`, reading `out` as its last input) of `b`, named `b.name` + `names[0]` and
/// `names[1]`, the cut input labelled `names[2]`, with the original inputs each reads.
fn cut_parts(
    b: &Block,
    producer_nodes: &[usize],
    consumer_nodes: &[usize],
    out: BVal,
    [producer_suffix, consumer_suffix, label]: [&str; 3],
) -> Option<Cut> {
    let p_in = inputs_read(b, producer_nodes, &[]);
    let c_in = inputs_read(b, consumer_nodes, &b.outputs);
    let producer = part_of(
        b,
        Part {
            nodes: producer_nodes,
            inputs: &p_in,
            cut: Vec::new(),
            outputs: std::slice::from_ref(&out),
            output_shape: OutputShape::Single,
            primitive: false,
            name: format!("{}{producer_suffix}", b.name),
        },
    )?;
    let cut_input = BlockInput {
        name: format!("{} ({label})", producer.name),
        ty: b.val_ty(&out),
    };
    let consumer = part_of(
        b,
        Part {
            nodes: consumer_nodes,
            inputs: &c_in,
            cut: vec![(out, cut_input)],
            outputs: &b.outputs,
            output_shape: b.output_shape,
            primitive: false,
            name: format!("{}{consumer_suffix}", b.name),
        },
    )?;
    Some((producer, consumer, p_in, c_in))
}

/// Removes the blocks of `candidates` that no site invokes any more (every site of theirs was
/// split), renumbering the blocks after them in the sites and the code.
fn drop_orphans(program: &mut Program, candidates: &[u32]) {
    let used = |b: u32, program: &Program| program.sites.iter().any(|s| s.block == b);
    let mut gone: Vec<u32> = candidates
        .iter()
        .copied()
        .filter(|&b| !used(b, program))
        .collect();
    gone.sort_unstable();
    gone.dedup();
    if gone.is_empty() {
        return;
    }
    let new_index = |b: u32| b - gone.partition_point(|&g| g < b) as u32;
    for &g in gone.iter().rev() {
        if (g as usize) < program.blocks.len() {
            program.blocks.remove(g as usize);
        }
    }
    for site in &mut program.sites {
        site.block = new_index(site.block);
    }
    for lambda in &mut program.lambdas {
        lambda.body.visit_mut(&mut |c| {
            if let Code::InvokeBlock { block, .. } = c {
                *block = new_index(*block);
            }
        });
    }
}

/// Whether operand `c` may be evaluated once more for the second invocation: a slot, an entry
/// argument, a literal, or a field of one (`%nd.0` of a list element bound by a `match`).
fn immediate(c: &Code) -> bool {
    match c {
        Code::Slot(_) | Code::Param(_) | Code::Lit(_) => true,
        Code::Proj(inner, _, _) => immediate(inner),
        _ => false,
    }
}

/// The producer and consumer of `b` split by its clean inputs `clean`, with the operands each
/// takes (indices into the original operands; the consumer's last input is the producer's
/// result); `None` when no split pays.
fn plan_split(b: &Block, clean: &[bool]) -> Option<Cut> {
    let n = b.nodes.len();
    let mut in_producer = clean_nodes(b, clean);
    // The values of producer nodes that the rest reads; views there move to the rest until one
    // value crosses.
    let mut cut = frontier(b, &in_producer);
    while cut.len() > 1 {
        let view = cut
            .iter()
            .filter_map(BVal::node)
            .filter(|&m| b.nodes.get(m).is_some_and(|x| VIEWS.contains(&x.op.name)))
            .max()?;
        if let Some(x) = in_producer.get_mut(view) {
            *x = false;
        }
        cut = frontier(b, &in_producer);
    }
    let out = cut.first()?.clone();
    // Worth it: a product, and not the whole block; the result one tensor.
    let product = (0..n).any(|k| {
        in_producer[k]
            && b.nodes
                .get(k)
                .is_some_and(|x| PRODUCTS.contains(&x.op.name))
    });
    if !product || in_producer.iter().all(|&x| x) || b.val_ty(&out).as_tensor().is_none() {
        return None;
    }
    // What the producer keeps: the nodes its result depends on.
    let needed = out
        .node()
        .map_or_else(|| vec![false; n], |m| needed_by(b, m));
    // Nodes the producer does not need stay with the consumer (a clean node the rest reads
    // directly is in the frontier, so none is lost).
    let producer_nodes: Vec<usize> = (0..n).filter(|&k| needed[k]).collect();
    let consumer_nodes: Vec<usize> = (0..n).filter(|&k| !needed[k]).collect();
    cut_parts(
        b,
        &producer_nodes,
        &consumer_nodes,
        out,
        [PRODUCER, CONSUMER, "hoisted"],
    )
}

/// Whether each node of `b` is clean: pure and reading only the clean inputs `clean`, literals
/// and clean nodes.
fn clean_nodes(b: &Block, clean: &[bool]) -> Vec<bool> {
    nodes_reading_only(b, |i| clean.get(i as usize).copied().unwrap_or(false))
}

/// A concatenation's parts with their widths.
type Parts = Vec<(BVal, usize)>;

/// `b` with each product over a concatenation of clean and tainted parts along the last axis —
/// `nn.dense(concatenate((x, h), axis=1), W)`, `W` an input every site passes a model weight
/// (`weight`) — written as the sum of the
/// parts' products with `W`'s column blocks (`strided_slice`s of the weight, which derived
/// parameters then compute once per run): the clean part's product can then be split off and
/// hoisted. `None` when there is no such product.
fn distribute_products(b: &Block, clean: &[bool], weight: &[bool]) -> Option<Block> {
    let (dense, add, slice) = (
        tumble_ops::lookup("nn.dense")?,
        tumble_ops::lookup("add")?,
        tumble_ops::lookup("strided_slice")?,
    );
    let is_clean = clean_nodes(b, clean);
    let value_clean = |v: &BVal| match v {
        BVal::Input(i) => clean.get(*i as usize).copied().unwrap_or(false),
        BVal::Node(m) | BVal::Field(m, _) => is_clean.get(*m as usize).copied().unwrap_or(false),
        BVal::Const(_) => true,
    };
    let width = |v: &BVal| dims2(&b.val_ty(v)).map(|(_, w)| w as usize);
    // The parts of node `k`'s concatenated rows and their widths, and its weight's (N, K).
    let distributable = |node: &BlockNode| -> Option<(Parts, BVal, usize)> {
        if node.op.name != "nn.dense" || !dense_attrs_plain(&node.attrs) {
            return None;
        }
        let (Some(BArg::One(BVal::Node(c))), Some(BArg::One(w @ BVal::Input(wi)))) =
            (node.args.first(), node.args.get(1))
        else {
            return None;
        };
        if !clean.get(*wi as usize).copied().unwrap_or(false)
            || !weight.get(*wi as usize).copied().unwrap_or(false)
        {
            return None;
        }
        let cat = b.nodes.get(*c as usize)?;
        let Some(BArg::Tuple(parts)) = cat.args.first() else {
            return None;
        };
        let axis = cat.attrs.int("axis").ok().flatten().unwrap_or(0);
        if cat.op.name != "concatenate" || !(axis == 1 || axis == -1) {
            return None;
        }
        let (n, k) = dims2(&b.val_ty(w)).map(|(n, k)| (n as usize, k as usize))?;
        let parts: Vec<(BVal, usize)> = parts
            .iter()
            .map(|p| Some((p.clone(), width(p)?)))
            .collect::<Option<_>>()?;
        let mixed =
            parts.iter().any(|(p, _)| value_clean(p)) && parts.iter().any(|(p, _)| !value_clean(p));
        let total: usize = parts.iter().map(|(_, w)| w).sum();
        (mixed && total == k).then_some((parts, w.clone(), n))
    };
    let mut nodes: Vec<BlockNode> = Vec::with_capacity(b.nodes.len() + 4);
    let mut map: Vec<BVal> = Vec::with_capacity(b.nodes.len());
    let mut changed = false;
    for node in &b.nodes {
        if let Some((parts, w, n)) = distributable(node) {
            let dtype = b.val_ty(&w).as_tensor().map(|(_, d)| d)?;
            let mut sum: Option<BVal> = None;
            let mut offset = 0usize;
            for (part, width) in parts {
                let ints = |xs: [usize; 2]| {
                    AttrValue::List(xs.iter().map(|&x| AttrValue::Int(x as i64)).collect())
                };
                nodes.push(BlockNode {
                    op: slice,
                    args: vec![BArg::One(w.clone())],
                    attrs: Attrs(vec![
                        attr("begin", ints([0, offset])),
                        attr("end", ints([n, offset + width])),
                    ]),
                    ty: Ty::tensor(
                        vec![
                            tumble_ir::Dim::Known(n as i64),
                            tumble_ir::Dim::Known(width as i64),
                        ],
                        dtype,
                    ),
                    span: node.span,
                    calls: node.calls.clone(),
                });
                let block_w = BVal::Node(nodes.len() as u32 - 1);
                nodes.push(BlockNode {
                    op: dense,
                    args: vec![BArg::One(renumbered(&part, &map)), BArg::One(block_w)],
                    attrs: node.attrs.clone(),
                    ty: node.ty.clone(),
                    span: node.span,
                    calls: node.calls.clone(),
                });
                let product = BVal::Node(nodes.len() as u32 - 1);
                sum = Some(match sum {
                    None => product,
                    Some(acc) => {
                        nodes.push(BlockNode {
                            op: add,
                            args: vec![BArg::One(acc), BArg::One(product)],
                            attrs: Attrs::default(),
                            ty: node.ty.clone(),
                            span: node.span,
                            calls: node.calls.clone(),
                        });
                        BVal::Node(nodes.len() as u32 - 1)
                    }
                });
                offset += width;
            }
            map.push(sum?);
            changed = true;
            continue;
        }
        nodes.push(node.clone().renumbered(&map));
        map.push(BVal::Node(nodes.len() as u32 - 1));
    }
    if !changed {
        return None;
    }
    let mut out = Block {
        nodes,
        outputs: b.outputs.iter().map(|v| renumbered(v, &map)).collect(),
        ..b.clone()
    };
    // The concatenation no product reads any more.
    out.drop_dead_nodes(|x| is_pure_op(x.op));
    Some(out)
}
