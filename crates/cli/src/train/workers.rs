//! Data-parallel gradients for `tumble train` and `tumble grad` (`--workers N`): each mini-batch's
//! instances are split into N parts, the calling thread differentiates the first and N − 1 helper
//! threads the others, and the parts' gradients are summed (before the optimizer step) — the
//! gradient of the mini-batch's summed loss, as one worker computes it, but for the order of
//! float additions.
//!
//! Why: a training step is mostly host work and small launches (a TreeLSTM mini-batch of 20 SST
//! trees: the GEMMs are under a third of it), which one thread's kernels cannot speed up, while
//! two of them overlap on the two hardware threads of a core: two single-threaded `tumble train`
//! processes on halves of the trees ran 1.7× the trees per second of one.
//!
//! Values are reference counted per thread (`Rc`), so each helper keeps its own copy of the
//! compiled entry and decodes the instances its parts bring itself, each once. Per step it
//! receives the indices of its part and the current weights (shared buffers, not copies), binds
//! them, computes, and lets every reference to the weights go before it answers: the optimizer
//! then updates the weights in place (a second holder would make it copy each one, the 22 MB
//! embedding table included, at every step).

use std::collections::BTreeMap;
use std::sync::mpsc::{channel, Receiver, Sender};
use std::thread::{Scope, ScopedJoinHandle};

use tumble_check::TypedModule;
use tumble_interp::Value;
use tumble_io::instances::RawInstances;
use tumble_runtime::backward::{BackwardStats, GradOptions, ParamGrad};
use tumble_runtime::trace::TraceCache;
use tumble_runtime::Options;
use tumble_tensor::Tensor;

use super::Compiled;
use crate::run::Failure;

/// One helper's part of a step.
struct Part {
    which: Vec<usize>,
    /// The random streams' seed ([`Setup::seed`] of the step: `train` changes it per epoch).
    seed: u64,
    /// The trainable parameters' current values, by name.
    weights: BTreeMap<String, Tensor>,
}

/// A part's losses (per instance, in its order), gradients (per trainable parameter) and
/// counters.
type PartResult = Result<(Vec<f64>, Vec<Option<ParamGrad>>, BackwardStats), Failure>;

struct Helper<'scope> {
    parts: Sender<Part>,
    results: Receiver<PartResult>,
    _thread: ScopedJoinHandle<'scope, ()>,
}

/// The helper threads of a training run (none for one worker).
pub(super) struct Workers<'scope> {
    helpers: Vec<Helper<'scope>>,
    trainable: &'scope [String],
    /// Per training instance, the size of its arguments (values in them): the parts of a
    /// mini-batch are balanced by it, a tree of 80 nodes being about 20 of 4.
    sizes: Vec<usize>,
}

/// What every part is computed with.
#[derive(Clone, Copy)]
pub(super) struct Setup<'env> {
    pub typed: &'env TypedModule,
    pub raw: &'env RawInstances,
    pub trainable: &'env [String],
    /// Kernel threads of each worker.
    pub opts: Options,
    pub gopts: GradOptions,
    pub seed: u64,
    /// The training instances' traces (`train`; none with `--no-trace-replay`, or in `grad`,
    /// which runs each instance once).
    pub traces: Option<&'env TraceCache>,
    /// The weights change between mini-batches (`train`, not `grad`): each worker forgets what
    /// it computed from their values after its part ([`Compiled::grad`]).
    pub weights_change: bool,
}

impl<'env> Setup<'env> {
    /// The setup of `workers` workers sharing the `opts.threads` kernel threads.
    pub(super) fn new(
        typed: &'env TypedModule,
        raw: &'env RawInstances,
        trainable: &'env [String],
        opts: Options,
        workers: usize,
        gopts: GradOptions,
        seed: u64,
    ) -> Self {
        Setup {
            typed,
            raw,
            trainable,
            opts: Options {
                threads: (opts.threads / workers.max(1)).max(1),
                ..opts
            },
            gopts,
            seed,
            traces: None,
            weights_change: false,
        }
    }
}

impl<'scope> Workers<'scope> {
    /// Starts `workers − 1` helpers, each with its own copy of `main`.
    pub(super) fn start<'env: 'scope>(
        scope: &'scope Scope<'scope, 'env>,
        workers: usize,
        main: &Compiled,
        decoded: &[Vec<Value>],
        setup: Setup<'env>,
    ) -> Result<Self, Failure> {
        let mut helpers = Vec::new();
        for k in 1..workers {
            let (part_tx, part_rx) = channel::<Part>();
            let (result_tx, result_rx) = channel::<PartResult>();
            let compiled = main.clone();
            let thread = std::thread::Builder::new()
                .name(format!("tumble-train-{k}"))
                .stack_size(crate::WORK_STACK_BYTES)
                .spawn_scoped(scope, move || helper(compiled, setup, part_rx, result_tx))
                .map_err(|e| Failure::Message(format!("cannot start a training worker: {e}")))?;
            helpers.push(Helper {
                parts: part_tx,
                results: result_rx,
                _thread: thread,
            });
        }
        let sizes = if helpers.is_empty() {
            Vec::new()
        } else {
            decoded.iter().map(|args| size_of_values(args)).collect()
        };
        Ok(Workers {
            helpers,
            trainable: setup.trainable,
            sizes,
        })
    }

    /// The losses (one per instance of `which`, in its order) and gradients of mini-batch `which` at the
    /// trainable parameters' values in `weights`: the first part on this thread with `main`, the
    /// others on the helpers.
    #[allow(clippy::too_many_arguments)]
    /// A mini-batch's gradient with respect to parameter `k` was not finite though its losses
    /// were (an operator's derivative infinite at an instance: a `sqrt` or `log` at 0, or
    /// diverging weights): the first instance of `which` whose own gradient is not, found by
    /// differentiating them one by one (only on this failure's path).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn instance_with_non_finite_gradient(
        &self,
        main: &Compiled,
        decoded: &[Vec<Value>],
        which: &[usize],
        weights: &BTreeMap<String, Tensor>,
        setup: Setup<'_>,
        stats: &mut BackwardStats,
        k: usize,
    ) -> Result<Option<usize>, Failure> {
        for &i in which {
            let (_, one) = self.grad(main, decoded, &[i], weights, setup, stats)?;
            if one
                .get(k)
                .and_then(Option::as_ref)
                .is_some_and(|g| !g.is_finite())
            {
                return Ok(Some(i));
            }
        }
        Ok(None)
    }

    pub(super) fn grad(
        &self,
        main: &Compiled,
        decoded: &[Vec<Value>],
        which: &[usize],
        weights: &BTreeMap<String, Tensor>,
        setup: Setup<'_>,
        stats: &mut BackwardStats,
    ) -> Result<(Vec<f64>, Vec<Option<ParamGrad>>), Failure> {
        let parts = balanced_parts(which, &self.sizes, self.helpers.len() + 1);
        let mut parts = parts.iter().map(Vec::as_slice);
        let own = parts.next().unwrap_or(&[]);
        let mut sent = Vec::new();
        let mut send_failure = None;
        for (k, (h, part)) in self.helpers.iter().zip(parts).enumerate() {
            if part.is_empty() {
                continue;
            }
            let weights = self
                .trainable
                .iter()
                .filter_map(|n| weights.get(n).map(|t| (n.clone(), t.clone())))
                .collect();
            let slice = part;
            let part = Part {
                which: part.to_vec(),
                seed: setup.seed,
                weights,
            };
            if h.parts.send(part).is_err() {
                send_failure = Some(Failure::Message(
                    "internal: a training worker stopped".into(),
                ));
                break;
            }
            sent.push((k, slice));
        }
        // The trainable parameters' current tensors, in their order, held only for this part
        // (the optimizer updates them in place once every holder has let go).
        let params: Vec<Tensor> = self
            .trainable
            .iter()
            .filter_map(|n| weights.get(n).cloned())
            .collect();
        let mine = match send_failure {
            Some(f) => Err(f),
            None => main.grad(
                setup.raw,
                decoded,
                own,
                &params,
                setup.opts,
                setup.gopts,
                setup.seed,
                setup.traces,
                setup.weights_change,
                stats,
            ),
        };
        drop(params);
        // Every part sent is waited for, failed or not: no helper holds the weights afterwards.
        let theirs: Vec<PartResult> = sent
            .iter()
            .filter_map(|&(k, _)| self.helpers.get(k))
            .map(|h| {
                h.results.recv().unwrap_or_else(|_| {
                    Err(Failure::Message(
                        "internal: a training worker stopped".into(),
                    ))
                })
            })
            .collect();
        let (mut losses, mut grads) = mine?;
        for r in theirs {
            let (l, g, s) = r?;
            losses.extend(l);
            stats.add(&s);
            grads = merge(grads, g)?;
        }
        // Back in `which`'s order (the parts are balanced by size, not cut in order), so that
        // a loss can name its instance.
        let order = own.iter().chain(sent.iter().flat_map(|(_, p)| p.iter()));
        let at: std::collections::HashMap<usize, f64> = order.copied().zip(losses).collect();
        let losses = which
            .iter()
            .map(|i| at.get(i).copied().unwrap_or(f64::NAN))
            .collect();
        Ok((losses, grads))
    }
}

/// `which` split into `n` parts of about equal total size (largest instances first, each to the
/// part with the least so far), each part in `which`'s order. One part: `which` as it is.
fn balanced_parts(which: &[usize], sizes: &[usize], n: usize) -> Vec<Vec<usize>> {
    if n <= 1 {
        return vec![which.to_vec()];
    }
    let size = |i: usize| sizes.get(i).copied().unwrap_or(1);
    let mut by_size: Vec<usize> = (0..which.len()).collect();
    by_size.sort_by_key(|&k| (std::cmp::Reverse(size(which[k])), k));
    let mut totals = vec![0usize; n];
    let mut members: Vec<Vec<usize>> = vec![Vec::new(); n];
    for k in by_size {
        let lightest = (0..n).min_by_key(|&p| (totals[p], p)).unwrap_or(0);
        totals[lightest] += size(which[k]);
        members[lightest].push(k);
    }
    members
        .into_iter()
        .map(|mut ks| {
            ks.sort_unstable();
            ks.into_iter().map(|k| which[k]).collect()
        })
        .collect()
}

/// How many values (tensors, constructor cells, tuples) `args` hold, each counted once per
/// place it appears.
fn size_of_values(args: &[Value]) -> usize {
    let mut stack: Vec<&Value> = args.iter().collect();
    let mut n = 0;
    while let Some(v) = stack.pop() {
        n += 1;
        match v {
            Value::Adt(a) => stack.extend(a.fields.iter()),
            Value::Tuple(t) => stack.extend(t.0.iter()),
            Value::Tensor(_) | Value::Lazy(_) | Value::Closure(_) => {}
        }
    }
    n
}

/// Per parameter, the sum of two parts' gradients.
fn merge(
    a: Vec<Option<ParamGrad>>,
    b: Vec<Option<ParamGrad>>,
) -> Result<Vec<Option<ParamGrad>>, Failure> {
    if a.len() != b.len() {
        return Err(Failure::Message(
            "internal: training workers returned gradients of different parameters".into(),
        ));
    }
    a.into_iter()
        .zip(b)
        .map(|(x, y)| match (x, y) {
            (Some(x), Some(y)) => x.merge(y).map(Some).map_err(Failure::Message),
            (x, None) => Ok(x),
            (None, y) => Ok(y),
        })
        .collect()
}

/// A helper's loop: computes each part it is sent, decoding an instance the first time a part
/// brings it (decoding them all before the first part would hold the first step up by as long:
/// over a second for SST's 8,544 training trees).
fn helper(mut c: Compiled, setup: Setup<'_>, parts: Receiver<Part>, results: Sender<PartResult>) {
    // The copy came with the starting weights bound: until a part brings the current ones, it
    // holds none (else the first step would copy every weight it updates).
    c.release(setup.trainable);
    let n = setup.raw.items.len();
    let mut decoded: Vec<Vec<Value>> = vec![Vec::new(); n];
    let mut done = vec![false; n];
    while let Ok(part) = parts.recv() {
        let ready = c.decode_some(setup.typed, setup.raw, &part.which, &mut decoded, &mut done);
        let result = match ready {
            Ok(()) => {
                c.rebind(&part.weights);
                let params: Vec<Tensor> = setup
                    .trainable
                    .iter()
                    .filter_map(|n| part.weights.get(n).cloned())
                    .collect();
                let mut stats = BackwardStats::default();
                let r = c.grad(
                    setup.raw,
                    &decoded,
                    &part.which,
                    &params,
                    setup.opts,
                    setup.gopts,
                    part.seed,
                    setup.traces,
                    setup.weights_change,
                    &mut stats,
                );
                drop(params);
                drop(part);
                c.release(setup.trainable);
                r.map(|(l, g)| (l, g, stats))
            }
            Err(e) => Err(e),
        };
        if results.send(result).is_err() {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::balanced_parts;

    #[test]
    fn parts_balance_sizes_and_keep_the_order() {
        // Instances 0..6 of sizes 9, 1, 1, 4, 4, 1.
        let sizes = [9, 1, 1, 4, 4, 1];
        let which = [5, 0, 3, 1, 4, 2];
        let parts = balanced_parts(&which, &sizes, 2);
        assert_eq!(parts, vec![vec![0, 1], vec![5, 3, 4, 2]]);
        let total = |p: &Vec<usize>| p.iter().map(|&i| sizes[i]).sum::<usize>();
        assert_eq!((total(&parts[0]), total(&parts[1])), (10, 10));
        assert_eq!(balanced_parts(&which, &sizes, 1), vec![which.to_vec()]);
        // More parts than instances: some stay empty; every instance is in exactly one.
        let parts = balanced_parts(&[2, 1], &sizes, 4);
        let mut all: Vec<usize> = parts.concat();
        all.sort_unstable();
        assert_eq!(all, vec![1, 2]);
        assert_eq!(parts.iter().filter(|p| p.is_empty()).count(), 2);
    }
}
