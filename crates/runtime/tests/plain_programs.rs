//! Programs written plainly — no `Primitive=1`, tuples and projections where the math has them —
//! run batched and agree with the reference. Each test is a bug found once, kept small.

mod common;

use common::{check_all_ways, expected, load_text};

fn agrees(name: &str, src: &str, inputs: &str, instance_args: &[&str]) {
    let l = load_text(name, src);
    check_all_ways(&expected(name, l, inputs, instance_args));
}

/// Instances `{"x": [[...]]}` of `n` float rows of width `w`, all different.
fn rows(count: usize, w: usize) -> String {
    (0..count)
        .map(|i| {
            let row: Vec<String> = (0..w)
                .map(|j| format!("{:.3}", ((i * 7 + j * 3) % 11) as f64 / 5.0 - 1.0))
                .collect();
            format!("{{\"x\": [[{}]]}}", row.join(", "))
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// A coarsened run whose outputs include a tuple (`split`'s pieces) next to a tensor: the run's
/// flat outputs were read through the rebuilt nested tuple ("tuple has no field 2").
#[test]
fn split_pieces_and_a_tensor_leave_one_run() {
    let src = r#"
def @main(%x: Tensor[(1, 6), float32], %w: Tensor[(6, 6), float32])
    -> (Tensor[(1, 2), float32], Tensor[(1, 2), float32]) {
  let %y = nn.dense(%x, %w);
  let %s = split(%y, indices_or_sections=3, axis=1);
  let %c = add(sigmoid(%s.0), tanh(%s.2));
  (%c, multiply(sigmoid(%s.1), tanh(%c)))
}
"#;
    agrees("split_run", src, &rows(9, 6), &["x"]);
}

/// A let-bound tuple of operator results, projected later ("tuple has no field 1").
#[test]
fn let_bound_tuple_projected() {
    let src = r#"
def @main(%x: Tensor[(1, 4), float32]) -> Tensor[(1, 4), float32] {
  let %t = (negative(%x), tanh(%x));
  %t.0
}
"#;
    agrees("tuple_proj", src, &rows(9, 4), &["x"]);
}

/// The same tuple passed whole to `db.concurrent`.
#[test]
fn let_bound_tuple_made_concurrent() {
    let src = r#"
def @main(%x: Tensor[(1, 4), float32]) -> (Tensor[(1, 4), float32], Tensor[(1, 4), float32]) {
  let %t = (negative(%x), tanh(%x));
  db.concurrent(%t)
}
"#;
    agrees("tuple_concurrent", src, &rows(9, 4), &["x"]);
}

/// Nested tuples out of one run, with a constant and a shared weight mixed in.
#[test]
fn nested_tuples_constants_and_shared_operands() {
    let src = r#"
def @main(%x: Tensor[(1, 4), float32], %w: Tensor[(4, 4), float32])
    -> ((Tensor[(1, 4), float32], (Tensor[(1, 2), float32], Tensor[(1, 2), float32])), Tensor[(1, 4), float32]) {
  let %h = nn.dense(%x, %w);
  let %p = (add(%h, 1f), split(%h, indices_or_sections=2, axis=1));
  let %q = multiply(%p.0, 0.5f);
  (%p, add(%q, %w.0))
}
"#;
    // `%w.0` is not a tensor projection (w is a tensor): use a row of it through take.
    let src = src.replace("%w.0", "take(%w, 0, axis=0)");
    agrees("nested", &src, &rows(9, 4), &["x"]);
}

/// Instances `{"x": v}` of `count` different float scalars.
fn scalars(count: usize) -> String {
    (0..count)
        .map(|i| format!("{{\"x\": {:.2}}}", i as f64 / 3.0 - 1.0))
        .collect::<Vec<_>>()
        .join("\n")
}

/// A reduction over all axes of a per-instance scalar, batched: its axes shifted past the batch
/// axis were the empty list, which means every axis, the batch's included ("flat index 0 is out
/// of bounds for a tensor with 0 elements").
#[test]
fn reduction_of_a_scalar_per_instance() {
    let src = r#"
def @main(%x: Tensor[(), float32], %w: Tensor[(4, 1), float32]) -> Tensor[(4, 1), float32] {
  add(mean(%x), %w)
}
"#;
    agrees("scalar_reduction", src, &scalars(9), &["x"]);
}

/// An operator whose operand is a `let` chain binding a closure: the block could not hold the
/// operand, so the whole call fell back to an operator outside a block, which cannot take the
/// chain's lazy result ("nn.dense: input is not computed yet (operator outside a block)").
#[test]
fn operand_is_a_let_chain_binding_a_closure() {
    let src = r#"
def @main(%x: Tensor[(1, 4), float32], %w: Tensor[(3, 4), float32]) -> Tensor[(1, 3), float32] {
  nn.dense({
    let %f = fn (%p: Tensor[(1, 4), float32]) -> Tensor[(1, 4), float32] { tanh(%p) };
    sigmoid(%x)
  }, %w)
}
"#;
    agrees("closure_operand", src, &rows(9, 4), &["x"]);
}

/// `concatenate` of a tuple that is neither a literal nor a variable (an `if`'s value; without
/// coarsening, `split`'s): only tuple variables could be block inputs, so the operator ran
/// outside a block on lazy fields ("expected a tuple of tensors, found a tensor in it").
#[test]
fn concatenate_of_a_computed_tuple() {
    let src = r#"
def @main(%x: Tensor[(1, 4), float32]) -> (Tensor[(1, 8), float32], Tensor[(1, 4), float32]) {
  let %c = concatenate(if (greater(sum(%x), 0f)) { (tanh(%x), %x) } else { (%x, sigmoid(%x)) }, axis=1);
  (%c, concatenate(split(%x, indices_or_sections=2, axis=1), axis=1))
}
"#;
    agrees("computed_tuple_operand", src, &rows(9, 4), &["x"]);
}

/// `db.concurrent` of a tuple holding `Nil`, whose element type only the result's use fixes: as
/// a deferred relation the annotation waited for its argument's type and the checker gave up
/// ("cannot infer the types of the arguments of `db.concurrent` here").
#[test]
fn concurrent_tuple_holding_nil() {
    let src = r#"
def @main(%x: Tensor[(1, 4), float32]) -> (Tensor[(1, 4), float32], List[Tensor[(1, 4), float32]]) {
  if (greater(sum(%x), 0f)) {
    db.concurrent((tanh(%x), Nil))
  } else {
    db.concurrent((%x, Cons(sigmoid(%x), Nil)))
  }
}
"#;
    agrees("concurrent_nil", src, &rows(9, 4), &["x"]);
}

/// A run of operators nothing reads was dropped with its inputs: a random draw among them was
/// not made, so every later draw of the instance came out different (and a failing call among
/// them would not have failed).
#[test]
fn unused_run_still_draws() {
    let src = r#"
def @main(%x: Tensor[(1, 4), float32]) -> Tensor[(1, 4), float32] {
  let %unused = tanh(random.db_uniform(low=0.0, high=1.0, out_shape=[1, 4], out_dtype="float32"));
  let %r = random.db_uniform(low=0.0, high=1.0, out_shape=[1, 4], out_dtype="float32");
  add(%x, %r)
}
"#;
    agrees("unused_run", src, &rows(9, 4), &["x"]);
}
