//! Whole-program snapshots of the static passes (`Program`'s text form, `tumble_compile::print`):
//! what each pass does to a small tree model, read as a whole. A change to a pass shows up here as
//! a diff to review; `UPDATE_EXPECT=1 cargo test -p tumble-compile --test snapshots` accepts it.

use expect_test::{expect, Expect};
use tumble_check::LoadOptions;
use tumble_compile::{optimize, verify, LowerOptions, Program, StaticOptions};
use tumble_ir::SourceMap;

/// Only user functions: the prelude's are printed too, but the snapshots keep to the model's.
const MODEL: &str = "
type Bin { Leaf(Tensor[(1, 4), float32]), Node(Bin, Bin) }

def @cell(%x: Tensor[(1, 4), float32], %w: Tensor[(4, 4), float32], Primitive=1) {
  tanh(nn.dense(%x, %w))
}

def @half(%x: Tensor[(1, 4), float32]) { multiply(%x, 0.5f) }

def @walk(%t: Bin, %w: Tensor[(4, 4), float32]) -> Tensor[(1, 4), float32] {
  match (%t) {
    Leaf(%x) => @cell(%x, %w),
    Node(%l, %r) => @half(add(@walk(%l, %w), @walk(%r, %w))),
  }
}

def @main(%t: Bin, %w: Tensor[(4, 4), float32]) { @walk(%t, %w) }
";

fn program_after(opts: StaticOptions) -> String {
    let mut sources = SourceMap::new();
    let typed = tumble_check::load(&mut sources, "t.rly", MODEL, LoadOptions::default())
        .unwrap_or_else(|d| panic!("{d:?}"));
    let mut p = Program::lower_with(&typed, LowerOptions::batched())
        .unwrap_or_else(|e| panic!("{}", e.message));
    optimize(&mut p, "main", &[false, true], opts);
    assert_eq!(verify(&p), vec![]);
    // The model's functions (and their clones), not the prelude's.
    let text = p.to_string();
    let mut keep = Vec::new();
    let mut on = false;
    for line in text.lines() {
        if line.starts_with("fn @") {
            let name = line.trim_start_matches("fn @");
            on = ["cell", "half", "walk", "main"]
                .iter()
                .any(|m| name.starts_with(m));
        }
        if on {
            keep.push(line);
        }
    }
    keep.join("\n") + "\n"
}

fn check(opts: StaticOptions, expected: Expect) {
    expected.assert_eq(&program_after(opts));
}

#[test]
fn lowered() {
    check(
        StaticOptions::none(),
        expect![[r#"
            fn @cell (lambda 32): params 2, slots 2
              invoke cell#9[site 9]($0, $1)
            fn @half (lambda 33): params 1, slots 1
              invoke half:multiply(..)#10[site 10]($0)
            fn @walk (lambda 34): params 2, slots 5
              match $0
              | Leaf($2) =>
                @cell($2, $1)
              | Node($3, $4) =>
                invoke walk:@half(..)#11[site 11](@walk($3, $1), @walk($4, $1))
            fn @main (lambda 35): params 2, slots 2
              @walk($0, $1)
        "#]],
    );
}

#[test]
fn weights_read_where_used() {
    check(
        StaticOptions {
            params: true,
            ..StaticOptions::none()
        },
        expect![[r#"
            fn @cell (lambda 32): params 1, slots 1
              invoke cell#9[site 9]($0, param1)
            fn @half (lambda 33): params 1, slots 1
              invoke half:multiply(..)#10[site 10]($0)
            fn @walk (lambda 34): params 1, slots 4
              match $0
              | Leaf($1) =>
                @cell($1)
              | Node($2, $3) =>
                invoke walk:@half(..)#11[site 11](@walk($2), @walk($3))
            fn @main (lambda 35, entry): params 2, slots 2
              @walk(param0)
        "#]],
    );
}

#[test]
fn leaf_functions_copied_into_callers() {
    check(
        StaticOptions {
            params: true,
            leaf_inline: true,
            ..StaticOptions::none()
        },
        expect![[r#"
            fn @cell (lambda 32): params 1, slots 1
              invoke cell#9[site 9]($0, param1)
            fn @half (lambda 33): params 1, slots 1
              invoke half:multiply(..)#10[site 10]($0)
            fn @walk (lambda 34): params 1, slots 4
              match $0
              | Leaf($1) =>
                invoke cell#9[site 12]($1, param1)
              | Node($2, $3) =>
                invoke walk:@half(..)#11[site 11](@walk($2), @walk($3))
            fn @main (lambda 35, entry): params 2, slots 2
              @walk(param0)
        "#]],
    );
}

#[test]
fn every_pass() {
    check(
        StaticOptions::all(),
        expect![[r#"
            fn @cell (lambda 32): params 1, slots 1
              invoke cell#9[site 9]($0, param1)
            fn @half (lambda 33): params 1, slots 1
              invoke half:multiply(..)#10[site 10]($0)
            fn @walk (lambda 34): params 1, slots 5
              match $0
              | Leaf($1) =>
                invoke cell#9[site 12, hoisted]($1, param1)
              | Node($2, $3) =>
                let $4 = concurrent(@walk($2), @walk($3))
                drop $2, $3
                invoke walk:@half(..)#11[site 11]($4.0, $4.1)
            fn @main (lambda 35, entry): params 2, slots 2
              @walk(param0)
        "#]],
    );
}

/// The kernel plans of an LSTM-like cell: gates horizontally fused, the tail a row program run
/// as the GEMM's epilogue.
#[test]
fn kernel_plans() {
    let src = "def @gates(%x: Tensor[(1, 4), float32], %wi: Tensor[(4, 4), float32],
                         %wf: Tensor[(4, 4), float32], %b: Tensor[(4), float32], Primitive=1) {
                 let %i = sigmoid(nn.bias_add(nn.dense(%x, %wi), %b));
                 let %f = sigmoid(nn.dense(%x, %wf));
                 nn.softmax(add(multiply(%i, %f), %x))
               }
               def @main(%x: Tensor[(1, 4), float32]) { %x }";
    let mut sources = SourceMap::new();
    let typed = tumble_check::load(&mut sources, "t.rly", src, LoadOptions::default())
        .unwrap_or_else(|d| panic!("{d:?}"));
    let c = tumble_compile::compile(
        &typed,
        "main",
        &[false],
        tumble_compile::CompileOptions::batched(),
    )
    .unwrap_or_else(|e| panic!("{}", e.message));
    let (b, block) = c
        .program
        .blocks
        .iter()
        .enumerate()
        .find(|(_, b)| b.name == "gates")
        .unwrap_or_else(|| panic!("no block"));
    let shown = format!("{block}{}", c.plans[b]);
    expect![[r#"
        block gates (primitive, 8 ops)
          in0: Tensor[(1, 4), float32]  (%x)
          in1: Tensor[(4, 4), float32]  (%wi)
          in2: Tensor[(4), float32]  (%b)
          in3: Tensor[(4, 4), float32]  (%wf)
          %0 = nn.dense(in0, in1)  : Tensor[(1, 4), float32]
          %1 = nn.bias_add(%0, in2)  : Tensor[(1, 4), float32]
          %2 = sigmoid(%1)  : Tensor[(1, 4), float32]
          %3 = nn.dense(in0, in3)  : Tensor[(1, 4), float32]
          %4 = sigmoid(%3)  : Tensor[(1, 4), float32]
          %5 = multiply(%2, %4)  : Tensor[(1, 4), float32]
          %6 = add(%5, in0)  : Tensor[(1, 4), float32]
          %7 = nn.softmax(%6)  : Tensor[(1, 4), float32]
          return %7
            gemm      %0 %3  (horizontally fused)
            epilogue  %1 %2 %4 %5 %6 %7
    "#]]
    .assert_eq(&shown);
}
