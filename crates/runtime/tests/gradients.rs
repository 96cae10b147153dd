//! The batched backward computes the reference gradient: every zoo model whose output has a
//! float part (scaled down so debug builds stay fast) wrapped in a scalar loss, its gradient with
//! respect to every float parameter by the batching runtime at mini-batch sizes 1, 7 and 64
//! against the reference engine's tape, instance by instance, within 1e-4 relative.

mod common;

use common::{compile, expected, float_weights, load_text, rng, root, var_rows, Expected};
use tumble_runtime::backward::{grad_batch, grad_batch_in, grad_batch_traced, GradOptions};
use tumble_runtime::trace::TraceCache;
use tumble_runtime::{Options, Scheduler};
use tumble_tensor::Tensor;

const INSTANCE_ARGS: &[&str] = &["tree", "tokens", "seqs", "threshold", "label", "labels"];

/// Replaces whole numbers by their mapped values (as `equivalence.rs` scales the zoo).
fn scale(text: &str, map: &[(&str, &str)]) -> String {
    let mut out = String::with_capacity(text.len());
    let bytes = text.as_bytes();
    let mut i = 0;
    while i < bytes.len() {
        let c = bytes[i];
        let prev_word = i > 0 && (bytes[i - 1].is_ascii_alphanumeric() || bytes[i - 1] == b'_');
        if c.is_ascii_digit() && !prev_word {
            let start = i;
            while i < bytes.len() && bytes[i].is_ascii_digit() {
                i += 1;
            }
            let num = &text[start..i];
            let next_word = i < bytes.len()
                && (bytes[i].is_ascii_alphanumeric() || bytes[i] == b'_' || bytes[i] == b'.');
            match map.iter().find(|(from, _)| *from == num) {
                Some((_, to)) if !next_word => out.push_str(to),
                _ => out.push_str(num),
            }
        } else {
            let ch = text[i..].chars().next().unwrap_or(' ');
            out.push(ch);
            i += ch.len_utf8();
        }
    }
    out
}

/// `text` with `@main` renamed `@main_fwd` and a new `@main` of the same parameters returning
/// `loss` (an expression of `%o`, `@main_fwd`'s result) as a float scalar.
fn with_loss(text: &str, loss: &str) -> String {
    let start = text.find("def @main(").expect("a @main");
    let close = start + text[start..].find(") ->").expect("a return type");
    let params = &text[start + "def @main(".len()..close];
    let names: Vec<String> = params
        .lines()
        .filter_map(|l| {
            let l = l.trim();
            let rest = l.strip_prefix('%')?;
            Some(format!("%{}", rest.split(':').next()?.trim()))
        })
        .collect();
    let renamed = text.replacen("def @main(", "def @main_fwd(", 1);
    format!(
        "{renamed}\n\ndef @main({params}) -> Tensor[(), float32] {{\n  let %o = @main_fwd({});\n  {loss}\n}}\n",
        names.join(", ")
    )
}

/// The first `n` lines of `lines` repeated cyclically: enough instances for a batch of 64.
fn cycle(lines: &str, n: usize) -> String {
    let ls: Vec<&str> = lines.lines().filter(|l| !l.trim().is_empty()).collect();
    (0..n)
        .map(|i| ls[i % ls.len()].to_string())
        .collect::<Vec<_>>()
        .join("\n")
}

/// A bundled example with every token id taken modulo 1000 (the tests scale vocabularies to
/// 1000 rows: a table gradient is as large as the table, once per lookup in the reference).
fn example(name: &str) -> String {
    let text = std::fs::read_to_string(root().join("examples").join(name)).unwrap_or_default();
    let bytes = text.as_bytes();
    let mut out = String::with_capacity(text.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i].is_ascii_digit() && (i == 0 || bytes[i - 1] != b'.') {
            let start = i;
            while i < bytes.len() && bytes[i].is_ascii_digit() {
                i += 1;
            }
            let num = &text[start..i];
            if i < bytes.len() && bytes[i] == b'.' {
                out.push_str(num);
            } else {
                out.push_str(&(num.parse::<u64>().unwrap_or(0) % 1000).to_string());
            }
        } else {
            out.push(bytes[i] as char);
            i += 1;
        }
    }
    out
}

fn load(
    model: &str,
    map: &[(&str, &str)],
    edit: impl Fn(String) -> String,
    loss: &str,
    inputs: &str,
) -> Expected {
    let path = root().join("models").join(format!("{model}.rly"));
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let text = with_loss(&edit(scale(&text, map)), loss);
    let l = load_text(model, &text);
    expected(model, l, inputs, INSTANCE_ARGS)
}

const SQUARES: &str = "sum(multiply(%o, %o))";

/// The reference gradient: the tape, instance by instance, summed.
fn reference_grad(x: &Expected, wrt: &[usize]) -> Vec<Option<Tensor>> {
    common::reference_gradient(x, wrt)
        .unwrap_or_else(|m| panic!("{}: reference gradient: {m}", x.name))
}

fn batched_grad(
    x: &Expected,
    wrt: &[usize],
    batch: usize,
    opts: Options,
    gopts: GradOptions,
) -> Vec<Option<Tensor>> {
    batched_grad_counted(x, wrt, batch, opts, gopts).0
}

/// [`batched_grad`], how many invocations took an identical one's results, and how many
/// launches the backward differentiated.
fn batched_grad_counted(
    x: &Expected,
    wrt: &[usize],
    batch: usize,
    opts: Options,
    gopts: GradOptions,
) -> (Vec<Option<Tensor>>, u64, u64) {
    let (program, reuse) = compile(x, true, common::training_statics());
    // Buffers the backward claims to write whole (output gradients, products) start as NaN:
    // a row it leaves unwritten shows up as a mismatch.
    tumble_tensor::pool::set_poison_scratch(true);
    common::gradients_in_chunks(&program, &reuse, x, wrt, batch, opts, gopts)
        .unwrap_or_else(|m| panic!("{}: batched gradient: {m}", x.name))
}

/// The batched gradient of every instance of `x` as one mini-batch, with the default options:
/// its gradients and the backward's counters.
fn grad_all_at_once(x: &Expected) -> tumble_runtime::backward::BatchGrad {
    let wrt = float_weights(x);
    let (program, reuse) = compile(x, true, common::training_statics());
    let params = common::weight_tensors(x, &wrt);
    let rngs = (0..x.args.len()).map(rng).collect();
    grad_batch(
        &program,
        &reuse,
        "main",
        x.args.clone(),
        rngs,
        Options::default(),
        GradOptions::default(),
        &params,
    )
    .unwrap_or_else(|e| panic!("{}", e.error.message))
}

/// Each gradient within 1e-4 of the reference, relative to the reference's largest entry.
fn compare(
    x: &Expected,
    wrt: &[usize],
    got: &[Option<Tensor>],
    want: &[Option<Tensor>],
    label: &str,
) {
    let mut nonzero = 0;
    for (k, (g, w)) in got.iter().zip(want).enumerate() {
        let name = format!("{} {label}: parameter {}", x.name, wrt[k]);
        match (g, w) {
            (None, None) => {}
            (Some(g), Some(w)) => {
                assert_eq!(g.shape(), w.shape(), "{name}");
                let scale = common::max_abs(w);
                let diff = g.max_abs_diff(w).unwrap();
                assert!(
                    diff <= 1e-4 * scale + 1e-7,
                    "{name}: max difference {diff} against max |gradient| {scale}"
                );
                nonzero += usize::from(scale > 0.0);
            }
            (Some(g), None) => {
                let m = common::max_abs(g);
                assert!(
                    m == 0.0,
                    "{name}: batched gradient {m} where the reference has none"
                );
            }
            (None, Some(w)) => {
                let m = common::max_abs(w);
                assert!(
                    m == 0.0,
                    "{name}: no batched gradient where the reference has {m}"
                );
            }
        }
    }
    assert!(nonzero > 0, "{} {label}: every gradient is zero", x.name);
}

fn check(x: &Expected) {
    let wrt = float_weights(x);
    assert!(!wrt.is_empty());
    let want = reference_grad(x, &wrt);
    for batch in [1, 7, 64] {
        let got = batched_grad(x, &wrt, batch, Options::default(), GradOptions::default());
        compare(x, &wrt, &got, &want, &format!("batch {batch}"));
    }
    // The forward's fused plans, each launch recomputed by the backward.
    let recompute = GradOptions {
        keep: false,
        ..GradOptions::default()
    };
    let got = batched_grad(x, &wrt, 7, Options::default(), recompute);
    compare(x, &wrt, &got, &want, "batch 7, recomputed");
    // Each parameter's dense gradient added launch by launch.
    let per_launch = GradOptions {
        defer_dense: false,
        ..GradOptions::default()
    };
    let got = batched_grad(x, &wrt, 7, Options::default(), per_launch);
    compare(x, &wrt, &got, &want, "batch 7, dense gradients per launch");
    let opts = Options {
        scheduler: Scheduler::Agenda,
        fusion: false,
        ..Options::default()
    };
    let got = batched_grad(
        x,
        &wrt,
        64,
        opts,
        GradOptions {
            gemm: false,
            fast: false,
            keep: false,
            defer_dense: false,
            sums: false,
        },
    );
    compare(
        x,
        &wrt,
        &got,
        &want,
        "agenda, no fusion, no backward GEMM, batch 64",
    );
}

/// TreeLSTM-small shrunk (H = 8), over the bundled trees repeated to 70 instances: a launch's
/// leaves repeat tokens.
fn treelstm_small() -> Expected {
    load(
        "treelstm_small",
        &[("256", "8"), ("768", "24"), ("21703", "1000")],
        |t| t,
        SQUARES,
        &cycle(&example("treelstm.jsonl"), 70),
    )
}

#[test]
fn treelstm() {
    check(&treelstm_small());
}

/// Leaves of one launch that read the same token compute the same state: the forward computes
/// it once and the backward differentiates it once with their output gradients summed. The
/// gradients equal the reference's, from kept values and recomputed.
#[test]
fn identical_invocations_differentiated_once() {
    let x = treelstm_small();
    let wrt = float_weights(&x);
    let want = reference_grad(&x, &wrt);
    for keep in [true, false] {
        let gopts = GradOptions {
            keep,
            ..GradOptions::default()
        };
        let (got, memoized, _) = batched_grad_counted(&x, &wrt, 64, Options::default(), gopts);
        assert!(memoized > 0, "keep {keep}: no invocation computed once");
        compare(&x, &wrt, &got, &want, &format!("batch 64, keep {keep}"));
    }
}

#[test]
fn mvrnn() {
    let x = load(
        "mvrnn_small",
        &[("64", "4"), ("128", "8"), ("21703", "1000")],
        |t| t,
        SQUARES,
        &cycle(&example("mvrnn.jsonl"), 70),
    );
    check(&x);
}

#[test]
fn nestedrnn() {
    let x = load(
        "nestedrnn_small",
        &[("256", "8"), ("768", "24"), ("21703", "1000")],
        |t| t,
        SQUARES,
        &cycle(&example("nestedrnn.jsonl"), 66),
    );
    check(&x);
}

#[test]
fn stackrnn() {
    let x = load(
        "stackrnn_small",
        &[("256", "8"), ("512", "16"), ("21703", "1000")],
        |t| t,
        "sum(multiply(%o.0, %o.0))",
        &cycle(&example("stackrnn.jsonl"), 70),
    );
    check(&x);
}

/// BiRNN's output is the argmax per token: the loss reads the logits instead.
#[test]
fn birnn() {
    let edit = |t: String| {
        t.replace("argmax(%logits, axis=[1])", "%logits")
            .replace(
                ") -> Tensor[(1), int32] {",
                ") -> Tensor[(1, 5), float32] {",
            )
            .replace(
                ") -> List[Tensor[(1), int32]] {",
                ") -> List[Tensor[(1, 5), float32]] {",
            )
    };
    let loss = "@foldl(fn (%acc: Tensor[(), float32], %l: Tensor[(1, 5), float32]) -> Tensor[(), float32] { add(%acc, sum(multiply(%l, %l))) }, zeros(shape=[], dtype=\"float32\"), %o)";
    let x = load(
        "birnn_small",
        &[("256", "8"), ("512", "16"), ("21703", "1000")],
        edit,
        loss,
        &cycle(&example("birnn.jsonl"), 70),
    );
    check(&x);
}

/// Berxit-small scaled down (sequences of 16 tokens), `n` instances of the bundled example with
/// thresholds cycling through `thresholds`, its loss the sum of squares of the logits.
fn berxit_small(n: usize, thresholds: &[&str]) -> Expected {
    let lines: Vec<String> = example("berxit.jsonl")
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(str::to_string)
        .collect();
    let inputs = (0..n)
        .map(|i| {
            let l = &lines[i % lines.len()];
            // 16 of the 128 tokens (the model is scaled to sequences of 16).
            let open = l.find('[').unwrap();
            let close = l.find(']').unwrap();
            let toks: Vec<&str> = l[open + 1..close].split(',').take(16).collect();
            let t = thresholds[i % thresholds.len()];
            format!("{{\"tokens\": [{}], \"threshold\": {t}}}", toks.join(","))
        })
        .collect::<Vec<_>>()
        .join("\n");
    load(
        "berxit_small",
        &[
            ("768", "24"),
            ("64", "2"),
            ("3072", "48"),
            ("128", "16"),
            ("30522", "1000"),
        ],
        |t| t,
        "sum(multiply(%o.0, %o.0))",
        &inputs,
    )
}

/// Berxit exits early where a layer is confident: the gradient follows the traced exits.
#[test]
fn berxit() {
    check(&berxit_small(66, &["0.0", "2.0", "0.6"]));
}

/// `tree`'s JSON with every node's `[[id]` turned into `[id % 5`: a label tree of its shape.
fn label_tree(tree: &str) -> String {
    let mut out = String::with_capacity(tree.len());
    let mut rest = tree;
    while let Some(at) = rest.find("[[") {
        out.push_str(&rest[..at]);
        let after = &rest[at + 2..];
        let digits = after.find(']').unwrap_or(0);
        let id: u64 = after[..digits].parse().unwrap_or(0);
        out.push_str(&format!("[{}", id % 5));
        rest = &after[digits + 1..];
    }
    out.push_str(rest);
    out
}

/// The bundled example's trees, as JSON.
fn bundled_trees() -> Vec<String> {
    example("treelstm.jsonl")
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| {
            let t = l.trim().strip_prefix("{\"tree\": ").unwrap();
            t[..t.len() - 1].to_string()
        })
        .collect()
}

/// The SST training models: the root's cross-entropy, and the sum over every node's.
#[test]
fn treelstm_sst_train() {
    let trees = bundled_trees();
    let map = &[("256", "8"), ("768", "24"), ("21703", "1000")];
    let root = (0..66)
        .map(|i| {
            format!(
                "{{\"tree\": {}, \"label\": {}}}",
                trees[i % trees.len()],
                i % 5
            )
        })
        .collect::<Vec<_>>()
        .join("\n");
    let x = load_plain("treelstm_sst_train", map, &root);
    check(&x);
    check(&sst_train_all(66));
}

/// The SST training model with a loss per node, scaled down (H = 8), over `n` instances of the
/// bundled trees with labels of their shapes.
fn sst_train_all(n: usize) -> Expected {
    let trees = bundled_trees();
    let all = (0..n)
        .map(|i| {
            let t = &trees[i % trees.len()];
            format!("{{\"tree\": {t}, \"labels\": {}}}", label_tree(t))
        })
        .collect::<Vec<_>>()
        .join("\n");
    let map = &[("256", "8"), ("768", "24"), ("21703", "1000")];
    load_plain("treelstm_sst_train_all", map, &all)
}

/// `add`s of computed tensors recorded as deferred sums (no launch of their own, forward or
/// backward; a sum's adjoint handed to its terms) give the reference's gradients, as they do
/// launched one by one, in fewer launches: the SST model's child sums (terms that are nodes),
/// and a fold from a parameter (a term that is a value: its gradient goes to the parameter).
#[test]
fn deferred_sums_hand_their_gradient_to_their_terms() {
    let sst = sst_train_all(20);
    let src = r#"
def @main(%xs: List[Tensor[(1, 4), float32]], %w: Tensor[(4, 4), float32], %c: Tensor[(1, 4), float32])
    -> Tensor[(), float32] {
  let %hs = @map(fn (%x: Tensor[(1, 4), float32]) -> Tensor[(1, 4), float32] {
    tanh(nn.dense(%x, %w))
  }, %xs);
  let %s = @foldl(fn (%a: Tensor[(1, 4), float32], %b: Tensor[(1, 4), float32]) -> Tensor[(1, 4), float32] {
    add(%a, %b)
  }, %c, %hs);
  sum(multiply(%s, tanh(nn.dense(%s, %w))))
}
"#;
    let inputs = (0..13)
        .map(|i| {
            let rows: Vec<String> = (0..(i % 5 + 1))
                .map(|k| {
                    let v: Vec<String> = (0..4)
                        .map(|c| {
                            format!("{:.2}", ((i * 7 + k * 3 + c * 5) % 11) as f64 / 5.0 - 1.0)
                        })
                        .collect();
                    format!("[[{}]]", v.join(", "))
                })
                .collect();
            format!("{{\"xs\": [{}]}}", rows.join(", "))
        })
        .collect::<Vec<_>>()
        .join("\n");
    let fold = expected("grad_fold", load_text("grad_fold", src), &inputs, &["xs"]);
    for x in [&sst, &fold] {
        let wrt = float_weights(x);
        let want = reference_grad(x, &wrt);
        let mut launched = Vec::new();
        for sums in [true, false] {
            let gopts = GradOptions {
                sums,
                ..GradOptions::default()
            };
            let (got, _, launches) = batched_grad_counted(x, &wrt, 7, Options::default(), gopts);
            compare(x, &wrt, &got, &want, &format!("batch 7, sums {sums}"));
            launched.push(launches);
        }
        assert!(
            launched[0] < launched[1],
            "{}: launches {launched:?}",
            x.name
        );
    }
}

/// Instances of different leading `?` lengths (0 and 1 among them): the forward records without
/// ragged launches (each length launches apart), and the gradients still equal the reference's.
#[test]
fn rows_of_different_lengths() {
    let src = r#"
def @main(%x: Tensor[(?, 4), float32], %w: Tensor[(8, 4), float32], %b: Tensor[(8), float32])
    -> Tensor[(), float32] {
  let %h = tanh(nn.bias_add(nn.dense(%x, %w), %b));
  sum(multiply(nn.softmax(%h, axis=0), %h))
}
"#;
    let lens = [3usize, 1, 9, 5, 0, 2, 7, 4, 11, 6, 8, 1, 13];
    let l = load_text("grad_rows", src);
    check(&expected("grad_rows", l, &var_rows(40, 4, &lens), &["x"]));
}

/// A model that already returns a scalar loss, scaled down.
fn load_plain(model: &str, map: &[(&str, &str)], inputs: &str) -> Expected {
    let path = root().join("models").join(format!("{model}.rly"));
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let l = load_text(model, &scale(&text, map));
    expected(model, l, inputs, INSTANCE_ARGS)
}

/// Each mini-batch's gradients equal bit for bit.
fn same_bits(a: &[Vec<Option<Tensor>>], b: &[Vec<Option<Tensor>>], what: &str) {
    assert_eq!(a.len(), b.len(), "{what}");
    for (ga, gb) in a.iter().zip(b) {
        for (x, y) in ga.iter().zip(gb) {
            match (x, y) {
                (Some(x), Some(y)) => assert_eq!(x.to_f64_vec(), y.to_f64_vec(), "{what}"),
                (None, None) => {}
                _ => panic!("{what}: a gradient on one side only"),
            }
        }
    }
}

/// The gradients of `x`'s instances taken in mini-batches of `batch` in the order `order`, each
/// mini-batch's instances recorded into or replayed from `cache` (indices are `x`'s).
fn traced_grads(
    x: &Expected,
    wrt: &[usize],
    order: &[usize],
    batch: usize,
    cache: Option<&TraceCache>,
) -> Vec<Vec<Option<Tensor>>> {
    let (program, reuse) = compile(x, true, common::training_statics());
    let params = common::weight_tensors(x, wrt);
    order
        .chunks(batch)
        .map(|which| {
            let args = which.iter().map(|&i| x.args[i].clone()).collect();
            let rngs = which.iter().map(|&i| rng(i)).collect();
            let slots = cache.map(|c| c.slots(which));
            grad_batch_traced(
                &program,
                &reuse,
                "main",
                args,
                rngs,
                Options::default(),
                GradOptions::default(),
                &params,
                slots.as_deref(),
            )
            .unwrap_or_else(|e| panic!("{}: batched gradient: {}", x.name, e.error.message))
            .grads
            .into_iter()
            .map(|g| g.map(|g| g.into_dense().unwrap()))
            .collect()
        })
        .collect()
}

/// Training's second epoch replays what each instance's first run recorded (`tumble train`):
/// mini-batches of other instances in another order give the same gradients, bit for bit, as
/// interpreting the program — and an instance whose control flow reads computed values (Berxit's
/// exits) is not traced, and still differentiated right.
#[test]
fn replayed_traces_give_the_interpreted_gradients_bit_for_bit() {
    let sst = sst_train_all(23);
    let wrt = float_weights(&sst);
    let n = sst.args.len();
    let first: Vec<usize> = (0..n).collect();
    let second: Vec<usize> = (0..n).map(|i| (i * 7 + 3) % n).collect();
    let cache = TraceCache::new(n);
    let recorded = traced_grads(&sst, &wrt, &first, 5, Some(&cache));
    assert_eq!(cache.traced().0, n, "every tree instance is traced");
    let replayed = traced_grads(&sst, &wrt, &second, 6, Some(&cache));
    let plain_first = traced_grads(&sst, &wrt, &first, 5, None);
    let plain_second = traced_grads(&sst, &wrt, &second, 6, None);
    same_bits(&recorded, &plain_first, "recording changed the gradients");
    same_bits(&replayed, &plain_second, "replaying changed the gradients");

    // Berxit: whether a layer exits is a computed value's; nothing is traced.
    let x = berxit_small(6, &["0.6"]);
    let wrt = float_weights(&x);
    let order: Vec<usize> = (0..x.args.len()).collect();
    let cache = TraceCache::new(order.len());
    let once = traced_grads(&x, &wrt, &order, 3, Some(&cache));
    assert_eq!(
        cache.traced().0,
        0,
        "an exit by a computed value is not traced"
    );
    let again = traced_grads(&x, &wrt, &order, 3, Some(&cache));
    let plain = traced_grads(&x, &wrt, &order, 3, None);
    same_bits(&once, &plain, "berxit, first run");
    same_bits(&again, &plain, "berxit, second run");
}

/// A trainer keeps one executable for its whole job (`grad_batch_in`: the plans and per-block
/// facts of the first mini-batch serve every later one). Forgetting what it computed from the
/// weights' values before each in-place update (`Executable::forget_weight_values`) leaves the
/// weights held by no one else, so the update writes where they lie, and every step's gradient
/// is, bit for bit, the one an executable made for that step gives.
#[test]
fn a_job_s_executable_serves_every_step_of_a_trainer() {
    let sst = sst_train_all(23);
    let wrt = float_weights(&sst);
    let (program, reuse) = compile(&sst, true, common::training_statics());
    let opts = Options::default();
    // Four steps of SGD on mini-batches of 6, on weights of their own (copies), updated in place.
    let train = |kept: Option<&std::sync::Arc<tumble_runtime::Executable>>| {
        let mut weights: Vec<Tensor> = common::weight_tensors(&sst, &wrt)
            .iter()
            .map(|t| Tensor::from_vec(t.shape().to_vec(), t.to_f64_vec()).unwrap())
            .map(|t| t.cast(tumble_ir::DType::Float32))
            .collect();
        let mut steps = Vec::new();
        for (step, which) in (0..sst.args.len())
            .collect::<Vec<_>>()
            .chunks(6)
            .take(4)
            .enumerate()
        {
            let args: Vec<Vec<_>> = which
                .iter()
                .map(|&i| {
                    let mut a = sst.args[i].clone();
                    for (k, &at) in wrt.iter().enumerate() {
                        a[at] = tumble_interp::Value::Tensor(weights[k].clone());
                    }
                    a
                })
                .collect();
            let rngs = which.iter().map(|&i| rng(i)).collect();
            let params = weights.clone();
            // Without a kept one, an executable for the step (what `grad_batch_traced` makes).
            let fresh = kept.is_none().then(|| {
                std::sync::Arc::new(tumble_runtime::Executable::new(&program, &reuse, &opts))
            });
            let exec = kept.or(fresh.as_ref()).expect("an executable");
            let g = grad_batch_in(
                exec,
                &program,
                &reuse,
                "main",
                args,
                rngs,
                opts,
                GradOptions::default(),
                &params,
                None,
            )
            .unwrap_or_else(|e| panic!("step {step}: {}", e.error.message));
            drop((params, fresh));
            if let Some(exec) = kept {
                exec.forget_weight_values();
            }
            let grads: Vec<Tensor> = g
                .grads
                .into_iter()
                .map(|g| g.expect("a gradient").into_dense().unwrap())
                .collect();
            steps.push(grads.iter().map(Tensor::to_f64_vec).collect::<Vec<_>>());
            for (w, g) in weights.iter_mut().zip(&grads) {
                assert_eq!(
                    w.holders(),
                    1,
                    "step {step}: the weights are held elsewhere"
                );
                let g = g.as_f32().unwrap();
                for (x, d) in w.make_mut_slice::<f32>().unwrap().iter_mut().zip(g) {
                    *x -= 0.1 * d;
                }
            }
        }
        steps
    };
    let exec = std::sync::Arc::new(tumble_runtime::Executable::new(&program, &reuse, &opts));
    let kept = train(Some(&exec));
    let fresh = train(None);
    assert_eq!(kept.len(), 4);
    assert!(kept == fresh, "a kept executable changed the gradients");
}

/// Mini-batches mixing replayed instances with interpreted ones (whose branch reads a computed
/// value: never traced) make the graph interpreting them all makes, node for node: the same
/// gradients bit for bit.
#[test]
fn mixed_replayed_and_interpreted_instances_give_the_same_gradients() {
    let src = r#"
def @main(%x: Tensor[(1, 4), float32], %t: Option[Tensor[(), float32]], %w: Tensor[(4, 4), float32])
    -> Tensor[(), float32] {
  let %h = tanh(nn.dense(%x, %w));
  let %s = sum(multiply(%h, %h));
  match (%t) {
    Some(%c) => if (greater(%s, %c)) { multiply(%s, %s) } else { negative(%s) },
    None => sum(multiply(tanh(nn.dense(%h, %w)), 2f)),
  }
}
"#;
    let inputs = (0..17)
        .map(|i| {
            let t = if i % 3 == 0 {
                format!("{{\"Some\": [{:.2}]}}", 0.2 + i as f32 * 0.05)
            } else {
                "\"None\"".to_string()
            };
            format!(
                "{{\"x\": [[{:.2}, 0.5, -0.25, {:.2}]], \"t\": {t}}}",
                i as f32 * 0.1,
                1.0 - i as f32 * 0.15
            )
        })
        .collect::<Vec<_>>()
        .join("\n");
    let l = load_text("mixed", src);
    let x = expected("mixed", l, &inputs, &["x", "t"]);
    let wrt = float_weights(&x);
    let n = x.args.len();
    let first: Vec<usize> = (0..n).collect();
    let second: Vec<usize> = (0..n).map(|i| (i * 5 + 2) % n).collect();
    let cache = TraceCache::new(n);
    traced_grads(&x, &wrt, &first, 4, Some(&cache));
    let (traced, _) = cache.traced();
    assert_eq!(
        traced,
        n - n.div_ceil(3),
        "the instances without a computed branch"
    );
    let replayed = traced_grads(&x, &wrt, &second, 6, Some(&cache));
    let interpreted = traced_grads(&x, &wrt, &second, 6, None);
    same_bits(&replayed, &interpreted, "mixed mini-batches");
}

/// A stacked model's layer weights as slices of one stacked weight — `take(%Ws, %l)` by a layer
/// counter, or `take(%Ws, 0)` … written out in `@main` beside a `zeros` — and the same model
/// with a weight per layer: the gradients equal the reference's, and the stacked forms launch
/// about as often as the named one (each slice is recorded once per mini-batch and passed to its
/// layer's launches whole; a slice per invocation was a weight-sized copy and gradient each:
/// a 3-layer LSTM ran out of memory at 29 instances).
#[test]
fn stacked_weight_slices_differentiate_once() {
    let rnn = r#"
def @rnn(%X: Tensor[(?, 4), float32], %i: int32, %n: int32, %h: Tensor[(1, 4), float32], %W: Tensor[(4, 8), float32]) -> Tensor[(1, 4), float32] {
  if (%i == %n) { %h } else {
    let %x = expand_dims(take(%X, %i, axis=0), axis=0);
    @rnn(%X, %i + 1, %n, tanh(nn.dense(concatenate((%x, %h), axis=1), %W)), %W)
  }
}
"#;
    let by_counter = format!(
        r#"{rnn}
def @stack(%X: Tensor[(?, 4), float32], %n: int32, %l: int32, %h: Tensor[(1, 4), float32], %Ws: Tensor[(3, 4, 8), float32]) -> Tensor[(1, 4), float32] {{
  if (%l == 3) {{ %h }} else {{ @stack(%X, %n, %l + 1, @rnn(%X, 0, %n, %h, take(%Ws, %l, axis=0)), %Ws) }}
}}
def @main(%x: Tensor[(?, 4), float32], %n: int32, %Ws: Tensor[(3, 4, 8), float32]) -> Tensor[(), float32] {{
  let %o = @stack(%x, %n, 0, zeros(shape=[1, 4], dtype="float32"), %Ws);
  sum(multiply(%o, %o))
}}
"#
    );
    let in_main = format!(
        r#"{rnn}
def @main(%x: Tensor[(?, 4), float32], %n: int32, %Ws: Tensor[(3, 4, 8), float32]) -> Tensor[(), float32] {{
  let %W0 = take(%Ws, 0, axis=0); let %W1 = take(%Ws, 1, axis=0); let %W2 = take(%Ws, 2, axis=0);
  let %z = zeros(shape=[1, 4], dtype="float32");
  let %o = @rnn(%x, 0, %n, @rnn(%x, 0, %n, @rnn(%x, 0, %n, %z, %W0), %W1), %W2);
  sum(multiply(%o, %o))
}}
"#
    );
    let named = format!(
        r#"{rnn}
def @main(%x: Tensor[(?, 4), float32], %n: int32, %W0: Tensor[(4, 8), float32], %W1: Tensor[(4, 8), float32], %W2: Tensor[(4, 8), float32]) -> Tensor[(), float32] {{
  let %z = zeros(shape=[1, 4], dtype="float32");
  let %o = @rnn(%x, 0, %n, @rnn(%x, 0, %n, @rnn(%x, 0, %n, %z, %W0), %W1), %W2);
  sum(multiply(%o, %o))
}}
"#
    );
    let lens = [3usize, 1, 6, 5, 2, 4];
    let inputs: String = var_rows(40, 4, &lens)
        .lines()
        .enumerate()
        .map(|(i, l)| {
            let n = lens[i % lens.len()];
            format!("{}, \"n\": {n}}}\n", l.trim_end_matches('}'))
        })
        .collect();
    let launches = |name: &str, src: &str| {
        let x = expected(name, load_text(name, src), &inputs, &["x", "n"]);
        check(&x);
        let wrt = float_weights(&x);
        let gopts = GradOptions::default();
        batched_grad_counted(&x, &wrt, 64, Options::default(), gopts).2
    };
    let named = launches("named_layers", &named);
    for (name, src) in [("by_counter", by_counter), ("in_main", in_main)] {
        let stacked = launches(name, &src);
        assert!(
            stacked <= named + 4,
            "{name}: {stacked} backward launches, {named} with a weight per layer"
        );
    }
}

/// A typed-edge graph network's loss: each edge's message is its neighbour's row times the
/// matrix its type picks, `take(%Ws, take(%types, %k))`. The weight-take split is compiled for
/// gradients too, so the take launches apart from the products (its identical invocations
/// computed once) instead of copying a matrix per edge inside the product's block (a typed
/// GNN at H = 128: 1.8–1.9 s, 797 MiB → 0.94–1.08 s, 580 MiB); the gradients equal the
/// reference's, clipped types included.
#[test]
fn weights_taken_by_a_computed_type_differentiate_once_per_type() {
    let src = format!(
        "{}{}",
        common::TYPED_EDGE_ROUNDS,
        r#"def @main(%feat: Tensor[(?), int32], %nodes: List[(Tensor[(1), int32], Tensor[(?), int32], Tensor[(?), int32], Tensor[(), int32])],
          %emb: Tensor[(10, 8), float32], %Ws: Tensor[(3, 8, 8), float32], %U: Tensor[(8, 8), float32]) -> Tensor[(), float32] {
  let %S = @round(@round(take(%emb, %feat, axis=0), %nodes, %Ws, %U), %nodes, %Ws, %U);
  let %m = mean(%S, axis=[0], keepdims=True);
  sum(multiply(%m, %m))
}
"#
    );
    let inputs = common::typed_edge_graphs();
    let x = expected(
        "typed_edge_loss",
        load_text("typed_edge_loss", &src),
        &inputs.join("\n"),
        &["feat", "nodes"],
    );
    check(&x);
    let g = grad_all_at_once(&x);
    // The slices' producer is a block of its own (none without the split), launched once per
    // type and launch — a few invocations, not one per edge (374).
    let slices = g.stats.forward.blocks_where(|name| name.contains("/slice"));
    assert!(
        slices.invocations > 0 && slices.invocations <= 8,
        "{slices:?}"
    );
}

/// An LSTM cell written with one product over `concatenate((%x, %h))`: the hoisting split
/// reads the weight's `x` and `h` columns as `strided_slice`s of it. Their gradients are kept
/// per block of the parameter and summed by one product each when the pass ends (they were a
/// weight-sized gradient per launch: 5× the backward of the two-product form), and the slices
/// are computed once for the graph; the gradients equal the reference's every way.
#[test]
fn column_blocks_of_a_weight_defer_their_gradients() {
    let src = r#"
def @lstm(%xs: List[Tensor[(1, 4), float32]], %h: Tensor[(1, 4), float32], %c: Tensor[(1, 4), float32],
          %W: Tensor[(16, 8), float32], %b: Tensor[(16), float32]) -> Tensor[(1, 4), float32] {
  match (%xs) {
    Nil => %h,
    Cons(%x, %rest) => {
      let %g = split(nn.bias_add(nn.dense(concatenate((%x, %h), axis=1), %W), %b), indices_or_sections=4, axis=1);
      let %c2 = add(multiply(sigmoid(%g.1), %c), multiply(sigmoid(%g.0), tanh(%g.3)));
      @lstm(%rest, multiply(sigmoid(%g.2), tanh(%c2)), %c2, %W, %b)
    },
  }
}
def @main(%xs: List[Tensor[(1, 4), float32]], %W: Tensor[(16, 8), float32], %b: Tensor[(16), float32]) -> Tensor[(), float32] {
  let %z = zeros(shape=[1, 4], dtype="float32");
  let %o = @lstm(%xs, %z, %z, %W, %b);
  sum(multiply(%o, %o))
}
"#;
    let inputs: String = (0..40)
        .map(|i| format!("{{\"xs\": {}}}\n", common::row_list(i, 1 + i % 6, 4)))
        .collect();
    let x = expected(
        "lstm_concat",
        load_text("lstm_concat", src),
        &inputs,
        &["xs"],
    );
    check(&x);
    let g = grad_all_at_once(&x);
    // The `h` columns' product at every step's launch (six steps at most) and the `x` columns'
    // hoisted launch deferred (none was).
    assert!(
        g.stats.deferred_dense >= 7,
        "{} products' weight gradients deferred",
        g.stats.deferred_dense
    );
}

/// A language model's loss summed over its steps and ended with a literal (`add(%l,
/// @lm(%rest))`, `Nil => 0f`, the step's loss an output of its block): the last `add` returns
/// its computed term itself, a value an earlier call returned. The instances are traced (they were not: every language model interpreted at every
/// epoch), and replaying gives the interpreted gradients bit for bit.
#[test]
fn a_loss_summed_down_to_a_literal_is_traced() {
    let src = r#"
def @lm(%toks: List[Tensor[(1), int32]], %h: Tensor[(1, 4), float32], %emb: Tensor[(7, 4), float32], %Wx: Tensor[(12, 4), float32], %Wh: Tensor[(12, 4), float32], %bx: Tensor[(12), float32], %bh: Tensor[(12), float32], %Wv: Tensor[(7, 4), float32], %bv: Tensor[(7), float32]) -> Tensor[(), float32] {
  match (%toks) {
    Cons(%t, %rest) => {
      match (%rest) {
        Cons(%n, _) => {
          let %x = take(%emb, %t, axis=0);
          let %gx = split(nn.bias_add(nn.dense(%x, %Wx), %bx), indices_or_sections=3, axis=1);
          let %gh = split(nn.bias_add(nn.dense(%h, %Wh), %bh), indices_or_sections=3, axis=1);
          let %r = sigmoid(add(%gx.0, %gh.0));
          let %u = sigmoid(add(%gx.1, %gh.1));
          let %nn = tanh(add(%gx.2, multiply(%r, %gh.2)));
          let %h2 = add(multiply(subtract(1f, %u), %nn), multiply(%u, %h));
          let %logp = nn.log_softmax(nn.bias_add(nn.dense(%h2, %Wv), %bv), axis=1);
          let %l = negative(sum(take(reshape(%logp, newshape=[7]), %n, axis=0)));
          add(%l, @lm(%rest, %h2, %emb, %Wx, %Wh, %bx, %bh, %Wv, %bv))
        },
        Nil => 0f,
      }
    },
    Nil => 0f,
  }
}
def @main(%tokens: List[Tensor[(1), int32]], %emb: Tensor[(7, 4), float32], %Wx: Tensor[(12, 4), float32], %Wh: Tensor[(12, 4), float32], %bx: Tensor[(12), float32], %bh: Tensor[(12), float32], %Wv: Tensor[(7, 4), float32], %bv: Tensor[(7), float32]) -> Tensor[(), float32] {
  @lm(%tokens, zeros(shape=[1, 4], dtype="float32"), %emb, %Wx, %Wh, %bx, %bh, %Wv, %bv)
}
"#;
    let inputs: String = (0..12)
        .map(|i| {
            let toks: Vec<String> = (0..2 + i % 4)
                .map(|t| format!("[{}]", (i * 3 + t) % 7))
                .collect();
            format!("{{\"tokens\": [{}]}}\n", toks.join(", "))
        })
        .collect();
    let x = expected("lm_loss", load_text("lm_loss", src), &inputs, &["tokens"]);
    let wrt = float_weights(&x);
    let n = x.args.len();
    let first: Vec<usize> = (0..n).collect();
    let second: Vec<usize> = (0..n).map(|i| (i * 5 + 1) % n).collect();
    let cache = TraceCache::new(n);
    let recorded = traced_grads(&x, &wrt, &first, 4, Some(&cache));
    assert_eq!(cache.traced().0, n, "every instance is traced");
    let replayed = traced_grads(&x, &wrt, &second, 5, Some(&cache));
    same_bits(
        &recorded,
        &traced_grads(&x, &wrt, &first, 4, None),
        "recording",
    );
    same_bits(
        &replayed,
        &traced_grads(&x, &wrt, &second, 5, None),
        "replaying",
    );
}

/// `variance` against a mean that is a weight (one for every instance): its gradient reaches
/// that weight as the rows' sum (the batching rule once passed the mean with a batch axis of 1,
/// and the backward failed with an internal error); a weight derived in `@main` (`transpose`)
/// and passed to a recursion keeps its launches batched across instances.
#[test]
fn shared_means_and_derived_weights_in_gradients() {
    let src = r#"
def @rnn(%xs: List[Tensor[(1, 4), float32]], %h: Tensor[(1, 4), float32], %u: Tensor[(4, 4), float32]) -> Tensor[(1, 4), float32] {
  match (%xs) {
    Nil => %h,
    Cons(%x, %rest) => @rnn(%rest, tanh(add(nn.dense(%h, %u), %x)), %u),
  }
}
def @main(%xs: List[Tensor[(1, 4), float32]], %u: Tensor[(4, 4), float32], %e: Tensor[(1, 1), float32]) -> Tensor[(), float32] {
  let %o = @rnn(%xs, zeros(shape=[1, 4], dtype="float32"), transpose(%u));
  sum(variance(%o, %e, axis=[1], unbiased=True))
}
"#;
    let inputs: String = (0..40)
        .map(|i| format!("{{\"xs\": {}}}\n", common::row_list(i, 1 + i % 5, 4)))
        .collect();
    let x = expected(
        "shared_mean",
        load_text("shared_mean", src),
        &inputs,
        &["xs"],
    );
    check(&x);
    let wrt = float_weights(&x);
    let (_, _, launches) =
        batched_grad_counted(&x, &wrt, 64, Options::default(), GradOptions::default());
    // Five steps at most: a few launches each, not one per invocation (about 120).
    assert!(launches < 40, "{launches} backward launches");
}

/// A weight derived once per instance in `@main` (`reshape(%V)`: the same value for every
/// instance, computed once as identical invocations) and read by a recursion's product is one
/// value of its launches, not a weight per row: its gradient one product over the rows, no
/// per-row vjp (which made a weight-sized outer product per row: 31× the forward).
#[test]
fn weights_derived_in_main_are_one_value_of_their_launches() {
    let src = r#"
def @rnn(%xs: List[Tensor[(1, 4), float32]], %h: Tensor[(1, 4), float32], %u: Tensor[(4, 4), float32]) -> Tensor[(1, 4), float32] {
  match (%xs) {
    Nil => %h,
    Cons(%x, %rest) => @rnn(%rest, tanh(add(nn.dense(%h, %u), %x)), %u),
  }
}
def @main(%xs: List[Tensor[(1, 4), float32]], %v: Tensor[(16), float32]) -> Tensor[(), float32] {
  let %u = multiply(reshape(%v, newshape=[4, 4]), 0.5f);
  sum(@rnn(%xs, zeros(shape=[1, 4], dtype="float32"), %u))
}
"#;
    let inputs: String = (0..40)
        .map(|i| format!("{{\"xs\": {}}}\n", common::row_list(i, 1 + i % 6, 4)))
        .collect();
    let x = expected(
        "derived_in_main",
        load_text("derived_in_main", src),
        &inputs,
        &["xs"],
    );
    check(&x);
    let g = grad_all_at_once(&x);
    assert_eq!(g.stats.looped_vjps, 0, "{:?}", g.stats);
}

/// The operators added for TVM's graphs (`nn.dropout` and `nn.batch_norm`'s tuples, their
/// batching rules with shared parameters, `nn.matmul`, `nn.prelu`, `nn.l2_normalize`, `nn.pad`,
/// and the per-invocation `sequence_mask`, `*_like` operators) differentiate as the reference
/// does.
#[test]
fn tvm_graph_operators() {
    let src = r#"
def @main(%x: Tensor[(2, 3), float32], %len: Tensor[(2), int32], %w: Tensor[(3, 4), float32],
          %g: Tensor[(3), float32], %b: Tensor[(3), float32], %m: Tensor[(3), float32],
          %v: Tensor[(3), float32], %a: Tensor[(3), float32]) -> float32 {
  %0 = nn.dropout(%x, rate=0.5f);
  %1 = nn.matmul(%0.0, %w);
  %2 = nn.batch_norm(%x, %g, %b, %m, add(multiply(%v, %v), 0.5f), axis=1, epsilon=1e-05f);
  %3 = nn.prelu(%2.0, %a, axis=1);
  %4 = nn.l2_normalize(%3, eps=1e-12f, axis=[1]);
  %5 = nn.pad(%4, 0.5f, pad_width=[[0, 0], [1, 1]]);
  %6 = sequence_mask(%5, %len, mask_value=-1f, axis=1);
  %7 = collapse_sum_like(broadcast_to_like(%b, %x), %a);
  %8 = full_like(%x, 2f);
  %9 = reshape_like(%1, transpose(%1));
  add(add(add(sum(%6), sum(tanh(%9))), add(sum(%7), sum(%2.1))),
      add(sum(%8), sum(multiply(%2.2, %m))))
}
"#;
    let inputs = (0..13)
        .map(|i| {
            format!(
                "{{\"x\": {}, \"len\": [{}, {}]}}",
                common::matrix(i, 2, 3),
                i % 6,
                (i * 2) % 5
            )
        })
        .collect::<Vec<_>>()
        .join("\n");
    let l = load_text("grad_tvm_ops", src);
    check(&expected("grad_tvm_ops", l, &inputs, &["x", "len"]));
}
