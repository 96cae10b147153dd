//! Code duplication for parameter reuse (ACROBAT §5.1 and appendix B.1). When one function is called with different
//! weights at different call sites (BiRNN's forward and backward `@rnn`), its blocks see a
//! different weight per call site, and one launch of a block would have to gather weights per
//! invocation. Cloning the function — with everything it reaches that invokes such blocks, and the
//! blocks themselves — per call site makes every block's weights static again: the reuse analysis
//! then finds them shared, and the clones' blocks launch separately, each with its weights passed
//! once.
//!
//! Driven by the reuse analysis: while some block input is `SharedPerCallSite`, the functions that
//! reach such blocks and are referenced from more than one place outside themselves are cloned for
//! every place but the first. Bounded in rounds and in the number of lambdas added.

use std::collections::{BTreeSet, HashMap};

use crate::program::{lambdas_reaching_past, Code, Program, Site};
use crate::reuse::{analyze, InputReuse};

/// Lambdas a program may grow by through duplication.
const MAX_NEW_LAMBDAS: usize = 256;
const MAX_ROUNDS: usize = 4;

/// One duplication: `function` was cloned as `clone` for one of its call sites.
#[derive(Clone, Debug)]
pub struct Duplicate {
    pub function: String,
    pub clone: String,
    /// Blocks cloned along with it.
    pub blocks: Vec<String>,
}

/// Duplicates functions until no block input is shared per call site; returns what was cloned.
pub fn duplicate(program: &mut Program, entry: &str, weights: &[bool]) -> Vec<Duplicate> {
    let mut done = Vec::new();
    let start = program.lambdas.len();
    for _ in 0..MAX_ROUNDS {
        let reuse = analyze(program, entry, weights);
        let split_blocks: BTreeSet<u32> = reuse
            .inputs
            .iter()
            .enumerate()
            .filter(|(_, ins)| ins.contains(&InputReuse::SharedPerCallSite))
            .map(|(b, _)| b as u32)
            .collect();
        if split_blocks.is_empty() || program.lambdas.len() - start > MAX_NEW_LAMBDAS {
            break;
        }
        let reaches = reaching_lambdas(program, &split_blocks);
        let before = done.len();
        // Globals in program order; the entry is never cloned.
        let entry_global = program.global_index.get(entry).copied();
        for g in 0..program.globals.len() as u32 {
            let Some(&l) = program.globals.get(g as usize) else {
                continue;
            };
            if Some(g) == entry_global || !reaches.get(l as usize).copied().unwrap_or(false) {
                continue;
            }
            // A native prelude function (`@nth`) called, never used as a value: its body's
            // blocks (an index's `equal`/`subtract`, "shared per call site" when each site
            // passes its own literal) never run, and a clone would lose the native form.
            if program.natives.of(g).is_some() && !used_as_value(program, g) {
                continue;
            }
            let family = family_of(program, l);
            let refs = references_outside(program, g, &family);
            // Last first: retargeting a reference does not renumber the ones before it.
            for &(holder, nth) in refs.iter().skip(1).rev() {
                if program.lambdas.len() - start > MAX_NEW_LAMBDAS {
                    break;
                }
                let d = clone_for(program, g, &reaches, done.len() + 2);
                retarget(program, holder, g, nth, d.0);
                done.push(d.1);
            }
        }
        if done.len() == before {
            break;
        }
    }
    done
}

/// Per lambda: does it invoke one of `blocks`, or reference a global or make a closure that does?
/// (A call of a native prelude function reaches nothing: its body does not run.)
fn reaching_lambdas(program: &Program, blocks: &BTreeSet<u32>) -> Vec<bool> {
    lambdas_reaching_past(
        program,
        |c| matches!(c, Code::InvokeBlock { block, .. } if blocks.contains(block)),
        |g| program.natives.of(g).is_some(),
    )
}

/// Whether global `g` is used as a value anywhere (a closure of it), not only called.
fn used_as_value(program: &Program, g: u32) -> bool {
    let mut used = false;
    for l in &program.lambdas {
        l.body
            .visit(&mut |c| used |= matches!(c, Code::Global(x) if *x == g));
    }
    used
}

/// A lambda and the closures created inside it, transitively.
fn family_of(program: &Program, l: u32) -> BTreeSet<u32> {
    let mut fam = BTreeSet::new();
    let mut todo = vec![l];
    while let Some(x) = todo.pop() {
        if !fam.insert(x) {
            continue;
        }
        if let Some(lam) = program.lambdas.get(x as usize) {
            lam.body.visit(&mut |c| {
                if let Code::MakeClosure(t) = c {
                    todo.push(*t);
                }
            });
        }
    }
    fam
}

/// References to global `g` (calls or uses as a value) in lambdas outside `family`, as (lambda,
/// n-th reference to `g` in that lambda's body in visiting order).
fn references_outside(program: &Program, g: u32, family: &BTreeSet<u32>) -> Vec<(u32, usize)> {
    let mut out = Vec::new();
    for (i, l) in program.lambdas.iter().enumerate() {
        if family.contains(&(i as u32)) {
            continue;
        }
        let mut k = 0;
        l.body.visit(&mut |c| {
            if matches!(c, Code::CallGlobal { global, .. } | Code::Global(global) if *global == g) {
                out.push((i as u32, k));
                k += 1;
            }
        });
    }
    out
}

/// Clones global `g` with every global it reaches that invokes a split block (per `reaches`), the
/// closures they create and the blocks they invoke. Returns the clone's global index.
fn clone_for(program: &mut Program, g: u32, reaches: &[bool], copy: usize) -> (u32, Duplicate) {
    // The globals to clone: `g` and what it reaches through global references, where they reach a
    // split block.
    let mut globals_to_clone = BTreeSet::new();
    let mut todo = vec![g];
    while let Some(x) = todo.pop() {
        let Some(&l) = program.globals.get(x as usize) else {
            continue;
        };
        if !reaches.get(l as usize).copied().unwrap_or(false) || !globals_to_clone.insert(x) {
            continue;
        }
        for m in family_of(program, l) {
            if let Some(lam) = program.lambdas.get(m as usize) {
                lam.body.visit(&mut |c| {
                    if let Code::CallGlobal { global, .. } | Code::Global(global) = c {
                        todo.push(*global);
                    }
                });
            }
        }
    }
    let mut lambdas: BTreeSet<u32> = BTreeSet::new();
    for &x in &globals_to_clone {
        if let Some(&l) = program.globals.get(x as usize) {
            lambdas.extend(family_of(program, l));
        }
    }
    // New indices: lambdas appended in order, globals appended in order.
    let mut lambda_map: HashMap<u32, u32> = HashMap::new();
    for (k, &l) in lambdas.iter().enumerate() {
        lambda_map.insert(l, (program.lambdas.len() + k) as u32);
    }
    let mut global_map: HashMap<u32, u32> = HashMap::new();
    for (k, &x) in globals_to_clone.iter().enumerate() {
        global_map.insert(x, (program.globals.len() + k) as u32);
    }
    let mut block_map: HashMap<u32, u32> = HashMap::new();
    let mut cloned_blocks = Vec::new();
    let mut new_lambdas = Vec::new();
    for &l in &lambdas {
        let Some(orig) = program.lambdas.get(l as usize) else {
            continue;
        };
        let mut lam = orig.clone();
        lam.name = format!("{}#{copy}", orig.name);
        lam.body.visit_mut(&mut |c| match c {
            Code::CallGlobal { global, .. } | Code::Global(global) => {
                if let Some(&n) = global_map.get(global) {
                    *global = n;
                }
            }
            Code::MakeClosure(t) => {
                if let Some(&n) = lambda_map.get(t) {
                    *t = n;
                }
            }
            Code::InvokeBlock { block, site, .. } => {
                let nb = match block_map.get(block) {
                    Some(&nb) => nb,
                    None => {
                        let nb = program.blocks.len() as u32;
                        if let Some(b) = program.blocks.get(*block as usize) {
                            let mut b = b.clone();
                            b.name = format!("{}#{copy}", b.name);
                            cloned_blocks.push(b.name.clone());
                            program.blocks.push(b);
                        }
                        block_map.insert(*block, nb);
                        nb
                    }
                };
                let old = program.sites.get(*site as usize).cloned();
                *site = program.sites.len() as u32;
                program.sites.push(Site {
                    block: nb,
                    span: old.as_ref().map(|s| s.span).unwrap_or_default(),
                    hoisted: old.as_ref().is_some_and(|s| s.hoisted),
                    inlined_from: old.and_then(|s| s.inlined_from),
                });
                *block = nb;
            }
            _ => {}
        });
        new_lambdas.push(lam);
    }
    program.lambdas.extend(new_lambdas);
    let name_of = |p: &Program, x: u32| {
        p.global_index
            .iter()
            .find(|(_, &i)| i == x)
            .map(|(n, _)| n.clone())
            .unwrap_or_default()
    };
    let function = name_of(program, g);
    let names: Vec<(u32, String)> = globals_to_clone
        .iter()
        .map(|&x| (x, name_of(program, x)))
        .collect();
    for (x, name) in names {
        if let (Some(&l), Some(&ng)) = (program.globals.get(x as usize), global_map.get(&x)) {
            let nl = lambda_map.get(&l).copied().unwrap_or(l);
            // `global_map` numbered the clones in this same order from `globals.len()`, and every
            // global in `globals_to_clone` has a lambda, so this push lands at index `ng`.
            program.globals.push(nl);
            program.global_index.insert(format!("{name}#{copy}"), ng);
        }
    }
    let clone = global_map.get(&g).copied().unwrap_or(g);
    (
        clone,
        Duplicate {
            clone: format!("{function}#{copy}"),
            function,
            blocks: cloned_blocks,
        },
    )
}

/// Points the `nth` reference to global `from` in lambda `holder` at global `to`.
fn retarget(program: &mut Program, holder: u32, from: u32, nth: usize, to: u32) {
    let Some(lam) = program.lambdas.get_mut(holder as usize) else {
        return;
    };
    let mut k = 0;
    lam.body.visit_mut(&mut |c| {
        if let Code::CallGlobal { global, .. } | Code::Global(global) = c {
            if *global == from {
                if k == nth {
                    *global = to;
                }
                k += 1;
            }
        }
    });
}
