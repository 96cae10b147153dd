//! Fibers within an instance: a concurrent element that waits for a computed value is split off
//! and the elements after it go on. Every program here agrees with the reference every way (fibers
//! on and off among them), and with fibers on it needs far fewer flushes than one per element.

mod common;

use common::{batch_profile, check_all_ways, expected, load_text, Expected};

fn checked(name: &str, src: &str, inputs: &str, instance_args: &[&str]) -> Expected {
    let x = expected(name, load_text(name, src), inputs, instance_args);
    check_all_ways(&x);
    x
}

/// Flushes of one mini-batch of every instance with fibers on and off.
fn flushes(x: &Expected) -> (u64, u64) {
    let on = batch_profile(x, tumble_runtime::Options::default());
    let off = batch_profile(
        x,
        tumble_runtime::Options {
            fibers: false,
            ..Default::default()
        },
    );
    (on.flushes, off.flushes)
}

/// Instances `{"xs": [...]}` of lists of `lens[i]` rows of width `w` ([`common::row_list`]).
fn lists(lens: &[usize], w: usize) -> String {
    lens.iter()
        .enumerate()
        .map(|(i, &n)| format!("{{\"xs\": {}}}", common::row_list(i, n, w)))
        .collect::<Vec<_>>()
        .join("\n")
}

/// A mixture of experts routing each element of a list by its own computed gate, in `@map`:
/// without fibers the map advanced one element per flush.
#[test]
fn a_map_whose_elements_branch_on_computed_values() {
    let src = r#"
def @expert(%x: Tensor[(1, 4), float32], %wg: Tensor[(1, 4), float32], %w1: Tensor[(4, 4), float32],
            %w2: Tensor[(4, 4), float32]) -> Tensor[(1, 4), float32] {
  if (greater(sum(nn.dense(%x, %wg)), 0f)) {
    tanh(nn.dense(%x, %w1))
  } else {
    sigmoid(nn.dense(%x, %w2))
  }
}

def @main(%xs: List[Tensor[(1, 4), float32]], %wg: Tensor[(1, 4), float32], %w1: Tensor[(4, 4), float32],
          %w2: Tensor[(4, 4), float32]) -> List[Tensor[(1, 4), float32]] {
  @map(fn (%x: Tensor[(1, 4), float32]) -> Tensor[(1, 4), float32] { @expert(%x, %wg, %w1, %w2) }, %xs)
}
"#;
    let lens = [9, 1, 0, 12, 5, 7, 3, 11, 2];
    let x = checked("moe_map", src, &lists(&lens, 4), &["xs"]);
    let (on, off) = flushes(&x);
    assert!(
        on <= 3 && off >= 12,
        "flushes with fibers {on}, without {off}"
    );
}

/// The same routing written as the prelude's recursion without the map's loop form, and a
/// second test after the branch: an element waits twice.
#[test]
fn a_recursive_map_whose_elements_wait_twice() {
    let src = r#"
def @route(%xs: List[Tensor[(1, 4), float32]], %w: Tensor[(4, 4), float32]) -> List[Tensor[(1, 4), float32]] {
  match (%xs) {
    Cons(%x, %rest) => {
      let %r = db.concurrent((
        {
          let %h = nn.dense(%x, %w);
          let %a = if (greater(sum(%h), 0f)) { tanh(%h) } else { negative(%h) };
          if (greater(max(%a), 0.5f)) { multiply(%a, 2f) } else { %a }
        },
        @route(%rest, %w)));
      Cons(%r.0, %r.1)
    },
    Nil => Nil,
  }
}

def @main(%xs: List[Tensor[(1, 4), float32]], %w: Tensor[(4, 4), float32]) -> List[Tensor[(1, 4), float32]] {
  @route(%xs, %w)
}
"#;
    let lens = [6, 0, 10, 3, 8];
    let x = checked("route_twice", src, &lists(&lens, 4), &["xs"]);
    let (on, off) = flushes(&x);
    assert!(
        on <= 4 && off >= 10,
        "flushes with fibers {on}, without {off}"
    );
}

/// A tree whose leaves each test a computed value before the tree combines them: independent
/// calls (found by the compiler) split off, and a join waits for its fibers before the parent's
/// product, which itself waits inside a concurrent element further up.
#[test]
fn a_tree_whose_leaves_wait() {
    let src = r#"
type Tree { Leaf(Tensor[(1, 4), float32]), Node(Tree, Tree) }

def @enc(%t: Tree, %wg: Tensor[(1, 4), float32], %w: Tensor[(4, 8), float32]) -> Tensor[(1, 4), float32] {
  match (%t) {
    Leaf(%x) => if (greater(sum(nn.dense(%x, %wg)), 0f)) { tanh(%x) } else { %x },
    Node(%l, %r) => {
      let %hl = @enc(%l, %wg, %w);
      let %hr = @enc(%r, %wg, %w);
      tanh(nn.dense(concatenate((%hl, %hr), axis=1), %w))
    },
  }
}

def @main(%tree: Tree, %wg: Tensor[(1, 4), float32], %w: Tensor[(4, 8), float32]) -> Tensor[(1, 4), float32] {
  @enc(%tree, %wg, %w)
}
"#;
    // Left-deep, right-deep and balanced trees of 1 to 12 leaves.
    fn tree(i: usize, n: usize, shape: usize, k: &mut usize) -> String {
        if n == 1 {
            *k += 1;
            let row: Vec<String> = (0..4)
                .map(|j| format!("{:.3}", ((i * 11 + *k * 5 + j * 3) % 13) as f64 / 6.0 - 1.0))
                .collect();
            return format!("{{\"Leaf\": [[[{}]]]}}", row.join(", "));
        }
        let left = match shape % 3 {
            0 => n - 1,
            1 => 1,
            _ => n / 2,
        };
        format!(
            "{{\"Node\": [{}, {}]}}",
            tree(i, left, shape, k),
            tree(i, n - left, shape, k)
        )
    }
    let inputs: Vec<String> = (0..12)
        .map(|i| format!("{{\"tree\": {}}}", tree(i, i + 1, i, &mut 0)))
        .collect();
    let x = checked("tree_leaves_wait", src, &inputs.join("\n"), &["tree"]);
    let (on, off) = flushes(&x);
    assert!(on < off, "flushes with fibers {on}, without {off}");
}

/// Maps nested in a map's elements, each element waiting: fibers split off inside fibers.
#[test]
fn nested_maps_whose_elements_wait() {
    let src = r#"
def @gate(%x: Tensor[(1, 4), float32], %w: Tensor[(4, 4), float32]) -> Tensor[(1, 4), float32] {
  let %h = nn.dense(%x, %w);
  if (greater(sum(%h), 0f)) { %h } else { multiply(%h, 0.5f) }
}

def @main(%xss: List[List[Tensor[(1, 4), float32]]], %w: Tensor[(4, 4), float32]) -> List[Tensor[(1, 4), float32]] {
  @map(fn (%xs: List[Tensor[(1, 4), float32]]) -> Tensor[(1, 4), float32] {
    let %ys = @map(fn (%x: Tensor[(1, 4), float32]) -> Tensor[(1, 4), float32] { @gate(%x, %w) }, %xs);
    let %s = @foldl(fn (%a: Tensor[(1, 4), float32], %y: Tensor[(1, 4), float32]) -> Tensor[(1, 4), float32] { add(%a, %y) },
                    zeros(shape=[1, 4], dtype="float32"), %ys);
    @gate(%s, %w)
  }, %xss)
}
"#;
    let inputs: Vec<String> = [vec![3, 1, 4], vec![], vec![2, 0, 5, 1], vec![6], vec![1, 1]]
        .iter()
        .enumerate()
        .map(|(i, lens)| {
            let lists: Vec<String> = lens
                .iter()
                .enumerate()
                .map(|(k, &n)| common::row_list(i * 7 + k, n, 4))
                .collect();
            format!("{{\"xss\": [{}]}}", lists.join(", "))
        })
        .collect();
    checked("nested_maps_wait", src, &inputs.join("\n"), &["xss"]);
}

/// An element that fails while an earlier one waits: the instance fails with the reference's
/// error (the program has one failing element per instance, so the order the elements run in
/// does not choose which error is reported), and the other instances are unaffected.
#[test]
fn an_element_that_fails_while_an_earlier_one_waits() {
    let src = r#"
def @main(%xss: List[List[Tensor[(1, 4), float32]]], %w: Tensor[(4, 4), float32]) -> List[Tensor[(1, 4), float32]] {
  @map(fn (%xs: List[Tensor[(1, 4), float32]]) -> Tensor[(1, 4), float32] {
    let %h = nn.dense(@hd(%xs), %w);
    if (greater(sum(%h), 0f)) { %h } else { negative(%h) }
  }, %xss)
}
"#;
    // Instance 1 and 3 have an empty inner list after non-empty ones.
    let inputs = [
        "{\"xss\": [[[[1, 2, 3, 4]]], [[[-1, 0, 1, 0]]]]}",
        "{\"xss\": [[[[1, 2, 3, 4]]], [[[-1, 0, 1, 0]]], [], [[[0, 1, 0, 1]]]]}",
        "{\"xss\": [[[[0.5, -2, 3, 1]]]]}",
        "{\"xss\": [[[[2, 2, -3, 4]]], []]}",
    ]
    .join("\n");
    let (x, results) = common::reference_outcomes(
        "fail_while_waiting",
        load_text("fail_while_waiting", src),
        &inputs,
        &["xss"],
    );
    assert!(results[1].is_err() && results[3].is_err() && results[0].is_ok());
    let (program, reuse) = common::compile(&x, true, tumble_compile::StaticOptions::all());
    for fibers in [true, false] {
        for batch in [1, 2, 4] {
            let opts = tumble_runtime::Options {
                fibers,
                ..Default::default()
            };
            common::check_outcomes(&x, &results, &program, &reuse, batch, opts)
                .unwrap_or_else(|m| panic!("fibers {fibers} batch {batch}: {m}"));
        }
    }
}

/// An error inside a split-off element has the whole call trace: the fiber's own calls and those
/// below its concurrent when it was split off (`@outer` called from `@mid` from `@main`).
#[test]
fn an_error_in_a_fiber_keeps_the_calls_below_it() {
    let src = r#"
def @pick(%x: Tensor[(1, 4), float32], %w: Tensor[(4, 4), float32], %l: List[Tensor[(1, 4), float32]]) -> Tensor[(1, 4), float32] {
  let %h = nn.dense(%x, %w);
  if (greater(sum(%h), 0f)) { %h } else { add(@hd(%l), %h) }
}
def @outer(%xs: List[Tensor[(1, 4), float32]], %w: Tensor[(4, 4), float32]) -> Tensor[(1, 4), float32] {
  let %r = db.concurrent((@pick(@hd(%xs), %w, Nil), @pick(@hd(@tl(%xs)), %w, %xs)));
  add(%r.0, %r.1)
}
def @mid(%xs: List[Tensor[(1, 4), float32]], %w: Tensor[(4, 4), float32]) -> Tensor[(1, 4), float32] {
  let %a = @outer(%xs, %w);
  multiply(%a, 2f)
}
def @main(%xs: List[Tensor[(1, 4), float32]], %w: Tensor[(4, 4), float32]) -> Tensor[(1, 4), float32] {
  let %b = @mid(%xs, %w);
  tanh(%b)
}
"#;
    let inputs = "{\"xs\": [[[-1, -2, -3, -4]], [[1, 1, 1, 1]]]}";
    let (x, results) = common::reference_outcomes(
        "fiber_trace",
        load_text("fiber_trace", src),
        inputs,
        &["xs"],
    );
    assert!(
        matches!(results.first(), Some(Err(_))),
        "the reference does not fail"
    );
    let (program, reuse) = common::compile(&x, true, tumble_compile::StaticOptions::all());
    let failure = |fibers: bool| {
        let opts = tumble_runtime::Options {
            fibers,
            ..Default::default()
        };
        let got = tumble_runtime::run_batch(
            &program,
            &reuse,
            "main",
            x.args.clone(),
            vec![common::rng(0)],
            opts,
        )
        .err()
        .unwrap_or_else(|| panic!("fibers {fibers}: no error"));
        (got.error.message.clone(), got.error.trace.clone())
    };
    let (with, without) = (failure(true), failure(false));
    assert_eq!(without.1.len(), 3, "{without:?}");
    assert_eq!(with, without);
}
