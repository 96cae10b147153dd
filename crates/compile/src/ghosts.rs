//! Ghost operators (ACROBAT §4.1 and appendix A.3, Fig. 3). Under inline-depth scheduling every block invocation
//! advances the instance's depth by one. When the arms of a conditional run different numbers of
//! blocks (StackRNN: REDUCE composes a phrase, SHIFT does not), instances that took different arms
//! continue at different depths, and the next step's blocks — identical work — no longer launch
//! together. Padding the shorter arms with ghost operators (`Code::Ghost`: advance the depth, compute
//! nothing) makes every arm advance the depth equally, so what follows lines up again.
//!
//! The count is static: the number of non-hoisted, non-host block invocations an arm runs before
//! its first call of a function whose cost is unknown (a recursive one) or its end; calls of
//! functions without such calls (`Primitive=1` wrappers) count their body. Arms are padded at their
//! start, which for the work that follows the conditional is the same as padding at their end.
//! Only arms that all continue into calls, or that all end, are aligned (see [`pad`]).

use crate::program::{Code, Program};

/// Depth increments a piece of code makes before its first call (`open`: it reaches one).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Cost {
    n: u32,
    open: bool,
}

impl Cost {
    const ZERO: Cost = Cost { n: 0, open: false };

    fn then(self, next: Cost) -> Cost {
        if self.open {
            self
        } else {
            Cost {
                n: self.n + next.n,
                open: next.open,
            }
        }
    }
}

/// One conditional that received ghosts.
#[derive(Clone, Debug)]
pub struct GhostSite {
    /// The function containing it.
    pub function: String,
    /// Ghost operators added to each arm, in arm order.
    pub per_arm: Vec<u32>,
}

/// What the cost of code depends on: which sites are hoisted or run on the host (no depth), and
/// the cost of calling each lambda (known when its body reaches no unknown call).
struct Cx {
    free: Vec<bool>,
    globals: Vec<u32>,
    summary: Vec<Option<u32>>,
}

/// Inserts ghost operators in every function of `program`; returns where.
pub fn insert(program: &mut Program) -> Vec<GhostSite> {
    let free: Vec<bool> = program
        .sites
        .iter()
        .map(|s| {
            s.hoisted
                || program
                    .blocks
                    .get(s.block as usize)
                    .is_none_or(runs_on_host)
        })
        .collect();
    let mut cx = Cx {
        free,
        globals: program.globals.clone(),
        summary: vec![None; program.lambdas.len()],
    };
    // Callee costs, callees first: a lambda's cost is known once its callees' are; recursive ones
    // stay unknown. (A fixpoint over all lambdas took one round per link of a call chain: O(N²)
    // for N helpers calling each other in turn, 6 s of a 20,000-global program.)
    fill_summaries(program, &mut cx);
    let mut found = Vec::new();
    for lambda in &mut program.lambdas {
        let mut sites = Vec::new();
        align(&mut lambda.body, &cx, &mut sites);
        found.extend(sites.into_iter().map(|per_arm| GhostSite {
            function: lambda.name.clone(),
            per_arm,
        }));
    }
    found
}

/// Each lambda's cost when called (`None`: it reaches a call of unknown cost, or is recursive),
/// callees first in one pass over the call graph.
fn fill_summaries(program: &Program, cx: &mut Cx) {
    let callees: Vec<Vec<usize>> = program
        .lambdas
        .iter()
        .map(|l| {
            let mut out = Vec::new();
            l.body.visit(&mut |c| {
                if let Code::CallGlobal { global, .. } = c {
                    if let Some(&k) = program.globals.get(*global as usize) {
                        out.push(k as usize);
                    }
                }
            });
            out
        })
        .collect();
    let (order, on_cycle) = crate::callgraph::callees_first(&callees);
    for l in order {
        if on_cycle[l] {
            continue;
        }
        if let Some(lambda) = program.lambdas.get(l) {
            let c = cost(&lambda.body, cx);
            cx.summary[l] = (!c.open).then_some(c.n);
        }
    }
}

/// Blocks on scalars run on the host at once (see the runtime's host-scalar rule), as do blocks
/// of integer work returning scalars from integer vectors (an index split's producer) and
/// weight takes (a weight-take split's producer, an indexed weight slice): no depth.
fn runs_on_host(b: &crate::blocks::Block) -> bool {
    use crate::blocks::integral;
    let shape_only = b.shape_only_inputs();
    if crate::slice_split::weight_take_block(b).is_some()
        || (b.returns_only_scalars()
            && b.inputs
                .iter()
                .zip(&shape_only)
                .all(|(i, &s)| s || integral(&i.ty))
            && b.nodes.iter().all(|n| integral(&n.ty)))
    {
        return true;
    }
    let scalar = |t: &tumble_ir::Ty| {
        t.as_tensor().is_some_and(|(dims, _)| {
            dims.iter()
                .map(|d| d.known())
                .try_fold(1i64, |acc, d| d.map(|x| acc * x))
                .is_some_and(|n| n <= 1)
        })
    };
    b.inputs.iter().all(|i| scalar(&i.ty)) && b.returns_only_scalars()
}

fn seq<'a>(codes: impl IntoIterator<Item = &'a Code>, cx: &Cx) -> Cost {
    let mut c = Cost::ZERO;
    for code in codes {
        if c.open {
            break;
        }
        c = c.then(cost(code, cx));
    }
    c
}

fn call_cost(lambda: Option<u32>, cx: &Cx) -> Cost {
    match lambda.and_then(|l| cx.summary.get(l as usize).copied().flatten()) {
        Some(n) => Cost { n, open: false },
        None => Cost { n: 0, open: true },
    }
}

/// Depth increments `code` makes before its first call of unknown cost.
fn cost(code: &Code, cx: &Cx) -> Cost {
    match code {
        Code::Slot(_)
        | Code::SelfRef
        | Code::Param(_)
        | Code::Global(_)
        | Code::Ctor(_)
        | Code::Lit(_)
        | Code::MakeClosure(_) => Cost::ZERO,
        // A phase boundary reorders everything: nothing after it is counted.
        Code::Phase => Cost { n: 0, open: true },
        Code::Ghost(n, body) => Cost { n: *n, open: false }.then(cost(body, cx)),
        Code::Tuple(es) | Code::CallCtor { args: es, .. } | Code::CallOp { args: es, .. } => {
            seq(es, cx)
        }
        Code::Proj(e, _, _) => cost(e, cx),
        Code::InvokeBlock { site, args, .. } => {
            let own = u32::from(!cx.free.get(*site as usize).copied().unwrap_or(false));
            seq(args, cx).then(Cost {
                n: own,
                open: false,
            })
        }
        Code::CallGlobal { global, args, .. } => {
            seq(args, cx).then(call_cost(cx.globals.get(*global as usize).copied(), cx))
        }
        Code::Call { operands, .. } => seq(operands, cx).then(Cost { n: 0, open: true }),
        Code::Let { binds, body, .. } => seq(binds.iter().map(|(_, v)| v), cx).then(cost(body, cx)),
        // Elements start at the same depth; the join continues from the deepest.
        Code::Concurrent(es) => es.iter().fold(Cost::ZERO, |c, e| {
            let k = cost(e, cx);
            Cost {
                n: c.n.max(k.n),
                open: c.open || k.open,
            }
        }),
        Code::If(cond, t, f) => cost(cond, cx).then(arms_cost([t.as_ref(), f.as_ref()], cx)),
        Code::Match {
            scrutinee, arms, ..
        } => cost(scrutinee, cx).then(arms_cost(arms.iter().map(|(_, b)| b), cx)),
    }
}

fn arms_cost<'a>(arms: impl IntoIterator<Item = &'a Code>, cx: &Cx) -> Cost {
    arms.into_iter().fold(Cost::ZERO, |c, a| {
        let k = cost(a, cx);
        Cost {
            n: c.n.max(k.n),
            open: c.open || k.open,
        }
    })
}

/// Pads the arms of every conditional inside `code`.
fn align(code: &mut Code, cx: &Cx, out: &mut Vec<Vec<u32>>) {
    match code {
        Code::If(cond, t, f) => {
            align(cond, cx, out);
            pad(&mut [t.as_mut(), f.as_mut()], cx, out);
        }
        Code::Match {
            scrutinee, arms, ..
        } => {
            align(scrutinee, cx, out);
            let mut bodies: Vec<&mut Code> = arms.iter_mut().map(|(_, b)| b).collect();
            pad(&mut bodies, cx, out);
        }
        other => other.for_each_child_mut(|c| align(c, cx, out)),
    }
}

fn pad(arms: &mut [&mut Code], cx: &Cx, out: &mut Vec<Vec<u32>>) {
    for a in arms.iter_mut() {
        align(a, cx, out);
    }
    let costs: Vec<Cost> = arms.iter().map(|a| cost(a, cx)).collect();
    // A base case next to a recursive case (one arm ends, another calls on): what follows each is
    // unrelated work, and padding would only delay the recursion. Align arms that all continue
    // into calls (StackRNN's SHIFT and REDUCE) or that are all plain block sequences.
    if costs.iter().any(|c| c.open) != costs.iter().all(|c| c.open) {
        return;
    }
    let target = costs.iter().map(|c| c.n).max().unwrap_or(0);
    let per_arm: Vec<u32> = costs.iter().map(|c| target - c.n).collect();
    if arms.len() > 1 && per_arm.iter().any(|&g| g > 0) {
        for (arm, &g) in arms.iter_mut().zip(&per_arm) {
            if g > 0 {
                let body = std::mem::replace(&mut **arm, Code::Phase);
                **arm = Code::Ghost(g, Box::new(body));
            }
        }
        out.push(per_arm);
    }
}
