//! Continuous-batching sessions ([`Model::session`]): instances that join a running batch at
//! different steps give what [`Model::run`] gives, and one failing instance fails no other.

use std::collections::BTreeMap;
use std::path::PathBuf;

use serde_json::json;
use tumble_api::{
    instances_from_json, with_big_stack, LoadOptions, Model, OutTree, Params, RawInstances,
    RunOptions, Session, Source, Ticket,
};
use tumble_tensor::Tensor;

fn repo() -> PathBuf {
    PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../.."))
}

/// Doubles `x` through a dense layer until its sum passes 100: an `if` on a computed tensor, so
/// instances block at every step and finish after as many steps as their start value needs
/// (x = [1, 1]: 6 steps; [60, 60]: 1). Width `?`: an instance of width 3 fails at run time.
const GROW: &str = r#"
def @grow(%x: Tensor[(1, ?), float32], %w: Tensor[(2, 2), float32]) -> Tensor[(1, 2), float32] {
  let %y = nn.dense(%x, %w);
  if (less(sum(%y), 100f)) { @grow(%y, %w) } else { %y }
}
def @main(%x: Tensor[(1, ?), float32], %w: Tensor[(2, 2), float32]) -> Tensor[(1, 2), float32] {
  @grow(%x, %w)
}
"#;

fn grow_model() -> Model {
    let w = Tensor::from_vec(vec![2, 2], vec![2.0f32, 0.0, 0.0, 2.0]).unwrap();
    let params = Params {
        tensors: [("w".to_string(), w)].into_iter().collect(),
        ..Params::default()
    };
    Model::load(
        Source::Text {
            name: "grow.rly",
            text: GROW,
        },
        &params,
        &LoadOptions::default(),
    )
    .unwrap()
}

/// A zoo model (`models/NAME.rly`) with seeded random weights.
fn zoo_model(name: &str) -> Model {
    zoo_model_with(name, &LoadOptions::default())
}

/// [`zoo_model`] loaded with `load`.
fn zoo_model_with(name: &str, load: &LoadOptions) -> Model {
    let params = Params {
        random_seed: Some(0),
        ..Params::default()
    };
    let path = repo().join(format!("models/{name}.rly"));
    Model::load(Source::File(&path), &params, load).unwrap()
}

fn opts() -> RunOptions {
    RunOptions {
        threads: Some(1),
        ..RunOptions::default()
    }
}

fn f32s(t: &OutTree) -> Vec<f32> {
    match t {
        OutTree::Tensor(t) => t.as_slice::<f32>().unwrap().to_vec(),
        other => panic!("not a tensor: {other:?}"),
    }
}

/// Parses a result line of the session into its numbers.
fn numbers(json: &str) -> Vec<f32> {
    fn walk(v: &serde_json::Value, out: &mut Vec<f32>) {
        match v {
            serde_json::Value::Array(a) => a.iter().for_each(|x| walk(x, out)),
            serde_json::Value::Number(n) => out.push(n.as_f64().unwrap() as f32),
            other => panic!("unexpected {other}"),
        }
    }
    let mut out = Vec::new();
    walk(&serde_json::from_str(json).unwrap(), &mut out);
    out
}

/// What [`run_staggered`] saw.
struct Staggered {
    /// Each admitted instance's result.
    results: Vec<Result<String, tumble_api::Error>>,
    /// The most instances left in flight after a step.
    most: usize,
    /// The step at which each instance was answered.
    answered_at: Vec<usize>,
}

/// Admits instance i of `instances` at step `arrive[i]` (the first `arrive.len()` instances)
/// and steps until all of them are answered.
fn run_staggered(
    session: &mut Session<'_>,
    instances: &RawInstances,
    arrive: &[usize],
) -> Staggered {
    let n = arrive.len();
    let mut tickets: BTreeMap<Ticket, usize> = BTreeMap::new();
    let mut results: Vec<Option<Result<String, tumble_api::Error>>> =
        (0..n).map(|_| None).collect();
    let mut answered_at = vec![0; n];
    let mut most = 0;
    // Enough steps for a long sequence flushed one level a step.
    for step in 0..100_000 {
        for (i, _) in arrive.iter().enumerate().filter(|(_, &a)| a == step) {
            match session.admit(instances, i) {
                Ok(t) => {
                    tickets.insert(t, i);
                }
                Err(e) => results[i] = Some(Err(e)),
            }
        }
        for (t, r) in session.step() {
            let i = tickets.remove(&t).expect("a ticket answered once");
            assert!(results[i].is_none());
            results[i] = Some(r);
            answered_at[i] = step;
        }
        most = most.max(session.in_flight());
        if results.iter().all(Option::is_some) {
            break;
        }
    }
    assert!(session.is_idle());
    Staggered {
        results: results.into_iter().map(|r| r.expect("answered")).collect(),
        most,
        answered_at,
    }
}

#[test]
fn instances_joining_a_running_batch_get_what_run_gives() {
    let m = grow_model();
    let xs = [1.0f32, 60.0, 3.0, 0.5, 25.0, 2.0, 7.0, 1.5];
    let items: Vec<_> = xs.iter().map(|&x| json!({ "x": [[x, x]] })).collect();
    let instances = instances_from_json("test", items.clone());
    let (want, _) = m.run(&instances, &opts()).unwrap();
    with_big_stack(|| {
        for (phases, levels) in [
            (false, None),
            (true, None),
            (false, Some(1)),
            (true, Some(2)),
        ] {
            let mut o = opts();
            o.runtime.phases = phases;
            let mut s = m.session(&o).unwrap();
            s.set_levels_per_step(levels);
            // Arrivals at steps 0, 0, 1, 2, 2, 3, 5, 9: later ones join machines blocked mid-way.
            let Staggered {
                results: got, most, ..
            } = run_staggered(&mut s, &instances, &[0, 0, 1, 2, 2, 3, 5, 9]);
            assert!(most >= 3, "instances overlapped in the batch ({most})");
            for (g, w) in got.iter().zip(&want) {
                assert_eq!(numbers(g.as_ref().unwrap()), f32s(w));
            }
            assert!(s.stats().steps > 6);
        }
    })
    .unwrap();
}

#[test]
fn a_failing_instance_fails_no_other() {
    let m = grow_model();
    // Instance 2 has width 3: `nn.dense` with a 2×2 weight fails on it at run time.
    let items = vec![
        json!({ "x": [[1.0, 1.0]] }),
        json!({ "x": [[5.0, 5.0]] }),
        json!({ "x": [[1.0, 1.0, 1.0]] }),
        json!({ "x": [[2.0, 2.0]] }),
    ];
    let instances = instances_from_json("test", items.clone());
    let good = instances_from_json(
        "test",
        items
            .iter()
            .enumerate()
            .filter(|(i, _)| *i != 2)
            .map(|(_, j)| j.clone())
            .collect(),
    );
    let (want, _) = m.run(&good, &opts()).unwrap();
    let whole = m.run(&instances, &opts()).unwrap_err();
    with_big_stack(|| {
        let mut s = m.session(&opts()).unwrap();
        let got = run_staggered(&mut s, &instances, &[0, 0, 1, 1]).results;
        let e = got[2].as_ref().unwrap_err();
        assert_eq!(e.instance(), Some(2));
        assert_eq!(e.message(), whole.message(), "located like Model::run's");
        let ok: Vec<_> = got.iter().enumerate().filter(|(i, _)| *i != 2).collect();
        for ((_, g), w) in ok.iter().zip(&want) {
            assert_eq!(numbers(g.as_ref().unwrap()), f32s(w));
        }
    })
    .unwrap();
}

/// Integer division in a block: an instance with a zero divisor fails inside a batched launch.
const DIV: &str = r#"
def @main(%x: Tensor[(1, 2), float32], %d: Tensor[(1, 2), int32], %w: Tensor[(2, 2), float32])
    -> Tensor[(1, 2), int32] {
  let %y = nn.dense(%x, %w);
  divide(cast(%y, dtype="int32"), %d)
}
"#;

#[test]
fn an_instance_failing_in_a_launch_fails_no_other() {
    let w = Tensor::from_vec(vec![2, 2], vec![2.0f32, 0.0, 0.0, 2.0]).unwrap();
    let params = Params {
        tensors: [("w".to_string(), w)].into_iter().collect(),
        ..Params::default()
    };
    let src = Source::Text {
        name: "div.rly",
        text: DIV,
    };
    let m = Model::load(src, &params, &LoadOptions::default()).unwrap();
    let item = |x: f32, d: i32| json!({ "x": [[x, x]], "d": [[d, d]] });
    let items = vec![item(1.0, 1), item(3.0, 2), item(5.0, 0), item(7.0, 3)];
    let instances = instances_from_json("test", items.clone());
    let whole = m.run(&instances, &opts()).unwrap_err();
    assert_eq!(whole.instance(), Some(2));
    with_big_stack(|| {
        let mut s = m.session(&opts()).unwrap();
        let got = run_staggered(&mut s, &instances, &[0, 0, 0, 0]).results;
        assert_eq!(
            s.stats().restarts,
            1,
            "the launch failed and the others restarted"
        );
        assert_eq!(got[2].as_ref().unwrap_err().message(), whole.message());
        let want = ["[[2,2]]", "[[3,3]]", "", "[[4,4]]"];
        for i in [0, 1, 3] {
            assert_eq!(got[i].as_ref().unwrap(), want[i]);
        }
    })
    .unwrap();
}

#[test]
fn undecodable_instances_are_refused_at_admission() {
    let m = grow_model();
    let instances = instances_from_json(
        "req",
        vec![json!({ "x": [[1.0, 1.0]] }), json!({ "x": "no" })],
    );
    with_big_stack(|| {
        let mut s = m.session(&opts()).unwrap();
        let e = s.admit(&instances, 1).unwrap_err();
        assert_eq!(e.instance(), Some(1));
        assert!(
            e.message().contains("instance at index 1: .x"),
            "{}",
            e.message()
        );
        assert!(s.is_idle());
    })
    .unwrap();
}

#[test]
fn cancelled_instances_are_never_answered() {
    let m = grow_model();
    let items = vec![json!({ "x": [[1.0, 1.0]] }), json!({ "x": [[0.5, 0.5]] })];
    let instances = instances_from_json("test", items);
    with_big_stack(|| {
        let mut s = m.session(&opts()).unwrap();
        let a = s.admit(&instances, 0).unwrap();
        let b = s.admit(&instances, 1).unwrap();
        s.step();
        assert!(s.cancel(b));
        assert!(!s.cancel(b));
        let mut answered = Vec::new();
        while !s.is_idle() {
            answered.extend(s.step().into_iter().map(|(t, _)| t));
        }
        assert_eq!(answered, vec![a]);
    })
    .unwrap();
}

#[test]
fn a_bounded_graph_drains_and_starts_afresh() {
    let m = grow_model();
    let xs = [1.0f32, 60.0, 3.0, 0.5];
    let items: Vec<_> = xs.iter().map(|&x| json!({ "x": [[x, x]] })).collect();
    let instances = instances_from_json("test", items);
    let (want, _) = m.run(&instances, &opts()).unwrap();
    with_big_stack(|| {
        let mut s = m.session(&opts()).unwrap();
        s.set_max_nodes(1);
        // Instance 0 needs 6 steps; 1 arrives at its second and waits for it to drain.
        let a = s.admit(&instances, 0).unwrap();
        assert!(s.step().is_empty());
        let b = s.admit(&instances, 1).unwrap();
        for _ in 0..3 {
            assert!(s.step().is_empty());
            assert_eq!((s.in_flight(), s.queued()), (1, 1));
        }
        let mut got = BTreeMap::new();
        while !s.is_idle() {
            got.extend(s.step());
        }
        for (t, w) in [a, b].iter().zip(&want) {
            assert_eq!(numbers(got[t].as_ref().unwrap()), f32s(w));
        }
        assert_eq!(s.stats().graphs, 2, "{:?}", s.stats());
    })
    .unwrap();
}

#[test]
fn treelstm_session_matches_run_on_the_bundled_trees() {
    let m = zoo_model("treelstm_small");
    let instances =
        tumble_io::read_instances_file(&repo().join("examples/treelstm.jsonl")).unwrap();
    let (want, _) = m.run(&instances, &opts()).unwrap();
    with_big_stack(|| {
        for levels in [None, Some(1), Some(3)] {
            let mut s = m.session(&opts()).unwrap();
            s.set_levels_per_step(levels);
            let arrive: Vec<usize> = (0..instances.len()).map(|i| i / 3).collect();
            let Staggered {
                results: got, most, ..
            } = run_staggered(&mut s, &instances, &arrive);
            for (g, w) in got.iter().zip(&want) {
                assert_eq!(numbers(g.as_ref().unwrap()), f32s(w));
            }
            if levels.is_some() {
                // Trees take several steps, so later arrivals join unfinished ones.
                assert!(most >= 2, "{levels:?}: {most}");
            }
        }
    })
    .unwrap();
}

/// Every number of an output, in order (tensors of any dtype, inside lists and tuples).
fn flat(t: &OutTree, out: &mut Vec<f32>) {
    match t {
        OutTree::Tensor(t) => out.extend(t.to_f64_vec().into_iter().map(|x| x as f32)),
        OutTree::Tuple(v) | OutTree::List(v) | OutTree::Ctor { fields: v, .. } => {
            v.iter().for_each(|x| flat(x, out))
        }
    }
}

/// A long sequence flushed a few levels per step, with short ones joining it: the nodes a step
/// does not reach stay sorted (and parked on their producers) for the next, and a finished
/// instance's uncomputed tensors are crossed off as they are computed — the same results as
/// `run`. (Before, every step sorted the whole backlog again and looked at the whole result:
/// one 20,000-token BiRNN request took 15 s at 8 levels a step and over 30 s at 1, against 0.5 s.)
#[test]
fn a_long_sequence_flushed_a_few_levels_a_step_gives_what_run_gives() {
    let m = zoo_model("birnn_small");
    let sentence = |n: usize, seed: usize| -> serde_json::Value {
        let tokens: Vec<serde_json::Value> = (0..n)
            .map(|i| json!([((i * 7919 + seed * 104_729) % 21_000) + 2]))
            .collect();
        json!({ "tokens": tokens })
    };
    let items = vec![
        sentence(2000, 1),
        sentence(5, 2),
        sentence(40, 3),
        sentence(1, 4),
    ];
    let instances = instances_from_json("test", items);
    let (want, _) = m.run(&instances, &opts()).unwrap();
    let want: Vec<Vec<f32>> = want
        .iter()
        .map(|w| {
            let mut v = Vec::new();
            flat(w, &mut v);
            v
        })
        .collect();
    with_big_stack(|| {
        for levels in [Some(1), Some(8), None] {
            let mut s = m.session(&opts()).unwrap();
            s.set_levels_per_step(levels);
            let got = run_staggered(&mut s, &instances, &[0, 1, 3, 200]).results;
            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                assert_eq!(&numbers(g.as_ref().unwrap()), w, "{levels:?}, instance {i}");
            }
        }
    })
    .unwrap();
}

/// An instance whose stop fires while the others run (its request timed out, its client left)
/// is answered and forgotten; the others keep what they computed and finish with `run`'s
/// results, without a restart (they all started again in a fresh graph, so under overload one
/// timeout made the others time out too).
#[test]
fn a_stopped_instance_leaves_the_others_running() {
    let m = grow_model();
    let xs = [1.0f32, 0.5, 3.0, 2.0];
    let items: Vec<_> = xs.iter().map(|&x| json!({ "x": [[x, x]] })).collect();
    let instances = instances_from_json("test", items);
    let (want, _) = m.run(&instances, &opts()).unwrap();
    for scheduler in ["inline", "agenda"] {
        let mut o = opts();
        o.runtime.scheduler = tumble_api::scheduler(scheduler).unwrap();
        stopped_instance_leaves_the_others(&m, &instances, &want, &o, scheduler);
    }
}

fn stopped_instance_leaves_the_others(
    m: &Model,
    instances: &RawInstances,
    want: &[OutTree],
    o: &RunOptions,
    scheduler: &str,
) {
    let n = instances.len();
    with_big_stack(|| {
        let mut s = m.session(o).unwrap();
        let flag = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let mut tickets = Vec::new();
        for i in 0..n {
            let stop = tumble_api::StopWhen {
                deadline: None,
                cancelled: (i == 1).then(|| flag.clone()),
            };
            tickets.push(s.admit_until(instances, i, stop).unwrap());
        }
        let mut got = BTreeMap::new();
        got.extend(s.step());
        flag.store(true, std::sync::atomic::Ordering::Relaxed);
        while !s.is_idle() {
            got.extend(s.step());
        }
        for (i, (t, w)) in tickets.iter().zip(want).enumerate() {
            match (i, &got[t]) {
                (1, Err(e)) => assert!(e.to_string().contains("stopped"), "{scheduler}: {e}"),
                (1, Ok(r)) => panic!("{scheduler}: the stopped instance was answered {r}"),
                (_, r) => assert_eq!(
                    numbers(r.as_ref().unwrap()),
                    f32s(w),
                    "{scheduler}: instance {i}"
                ),
            }
        }
        let st = s.stats();
        // Stopped between launches of a flush (not in its program): the flush went on.
        assert_eq!(
            (st.restarts, st.graphs, st.stops_survived),
            (0, 1, 1),
            "{scheduler}: {st:?}"
        );
    })
    .unwrap();
}

/// A tree of `depth` levels: each internal node has a leaf and the rest of the chain as children.
fn chain(depth: usize, seed: usize) -> serde_json::Value {
    let mut t = json!({ "Rose": [[(seed % 20_000) + 1], []] });
    for d in 0..depth {
        let leaf = json!({ "Rose": [[((seed + d * 31) % 20_000) + 2], []] });
        t = json!({ "Rose": [[0], [leaf, t]] });
    }
    json!({ "tree": t })
}

/// Flushed a level a step while new instances keep joining, a deep tree finishes within about
/// the steps it takes alone. It took 461 against 61: each newcomer's leaves (hoisted, nothing
/// they read is pending) got depth 0, below every level left, so each step launched only them;
/// and a small launch of a weight-bound block waits a level for more of its key, which with
/// instances joining at every step are always pending.
#[test]
fn a_deep_tree_is_not_starved_by_instances_joining_every_step() {
    // The leaves hoisted by the compiler's analysis, and (without it) by the runtime's rule
    // for invocations of which nothing is pending: each got depth 0 before.
    let statically = zoo_model("treelstm_large");
    let mut load = LoadOptions::default();
    load.statics.hoist = false;
    let dynamically = zoo_model_with("treelstm_large", &load);
    for m in [&statically, &dynamically] {
        deep_tree_is_not_starved(m);
    }
}

fn deep_tree_is_not_starved(m: &Model) {
    let mut items = vec![chain(30, 0)];
    items.extend((1..400).map(|i| chain(1 + i % 2, i)));
    let instances = instances_from_json("test", items);
    let (want, _) = m.run(&instances, &opts()).unwrap();
    with_big_stack(|| {
        let session = || {
            let mut s = m.session(&opts()).unwrap();
            s.set_levels_per_step(Some(1));
            s
        };
        // Steps the deep tree takes alone, then with a small one joining at every step.
        let alone = run_staggered(&mut session(), &instances, &[0]).answered_at[0];
        let arrive: Vec<usize> = (0..instances.len()).collect();
        let joined = run_staggered(&mut session(), &instances, &arrive);
        for (i, r) in joined.results.iter().enumerate() {
            // Batched with other trees than `run` batched it with, so equal within rounding
            // (`run` at batch 1 and 64 differs in the last bits too).
            let (got, want) = (numbers(r.as_ref().unwrap()), f32s(&want[i]));
            assert_eq!(got.len(), want.len());
            for (g, w) in got.iter().zip(&want) {
                assert!(
                    (g - w).abs() <= 1e-5 * (1.0 + w.abs()),
                    "instance {i}: {g} vs {w}"
                );
            }
        }
        let took = joined.answered_at[0];
        assert!(
            took <= 2 * alone + 4,
            "the deep tree took {took} steps with others joining, {alone} alone"
        );
    })
    .unwrap();
}
