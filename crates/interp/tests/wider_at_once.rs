//! Code the evaluator takes at once with its wider at-once evaluation on (`Machine::at_once`:
//! loops whose element code is taken at once — a `@map` of block invocations or projections, a
//! `@foldl` summing a list —, constructors and tuples of immediate operands, `if`s and `match`es
//! on values at hand, ghost operators) records the same invocations at the same inline depths,
//! ghosts included, and gives the same values as the same code run in evaluation steps — in
//! fewer steps.

use tumble_check::LoadOptions;
use tumble_compile::{optimize, verify, LowerOptions, Program, StaticOptions};
use tumble_interp::{Backend, InstanceCtx, Machine, Outcome, ReferenceBackend, RunError, Value};
use tumble_ir::{Attrs, SourceMap, Span};
use tumble_ops::OpDef;
use tumble_tensor::{Rng, Tensor};

/// A child-sum tree cell over a `Rose` tree of H = 4, the zoo's TreeLSTM in miniature: a map of
/// the recursion, a map of block invocations on the child states, a map of projections, two
/// folds over `@hd`/`@tl` of those lists; and a fold whose step is not a block (not taken at
/// once: it still runs in steps).
const SRC: &str = r#"
def @leaf(%tok: Tensor[(1), int32], %emb: Tensor[(10, 4), float32]) -> (Tensor[(1, 4), float32], Tensor[(1, 4), float32]) {
  let %x = take(%emb, %tok, axis=0);
  (tanh(%x), sigmoid(%x))
}
def @forget(%h: Tensor[(1, 4), float32], %c: Tensor[(1, 4), float32], %U: Tensor[(4, 4), float32]) -> Tensor[(1, 4), float32] {
  multiply(sigmoid(nn.dense(%h, %U)), %c)
}
def @inner(%h: Tensor[(1, 4), float32], %fc: Tensor[(1, 4), float32], %W: Tensor[(4, 4), float32]) -> (Tensor[(1, 4), float32], Tensor[(1, 4), float32]) {
  let %c = add(tanh(nn.dense(%h, %W)), %fc);
  (tanh(%c), %c)
}
def @tree(%t: Tree[Tensor[(1), int32]], %emb: Tensor[(10, 4), float32], %U: Tensor[(4, 4), float32], %W: Tensor[(4, 4), float32]) -> (Tensor[(1, 4), float32], Tensor[(1, 4), float32]) {
  match (%t) {
    Rose(%tok, Nil) => @leaf(%tok, %emb),
    Rose(_, %children) => {
      let %states = @map(fn (%ch: Tree[Tensor[(1), int32]]) -> (Tensor[(1, 4), float32], Tensor[(1, 4), float32]) {
        @tree(%ch, %emb, %U, %W)
      }, %children);
      let %forgets = @map(fn (%s: (Tensor[(1, 4), float32], Tensor[(1, 4), float32])) -> Tensor[(1, 4), float32] {
        @forget(%s.0, %s.1, %U)
      }, %states);
      let %hs = @map(fn (%s: (Tensor[(1, 4), float32], Tensor[(1, 4), float32])) -> Tensor[(1, 4), float32] {
        %s.0
      }, %states);
      let %add2 = fn (%a: Tensor[(1, 4), float32], %b: Tensor[(1, 4), float32]) -> Tensor[(1, 4), float32] {
        add(%a, %b)
      };
      let %h = @foldl(%add2, @hd(%hs), @tl(%hs));
      let %fc = @foldl(%add2, @hd(%forgets), @tl(%forgets));
      let %n = @foldl(fn (%k: Tensor[(), int32], %s: (Tensor[(1, 4), float32], Tensor[(1, 4), float32])) -> Tensor[(), int32] {
        if (greater(%k, 100)) { %k } else { add(%k, 1) }
      }, 0, %states);
      let %r = @inner(%h, %fc, %W);
      (add(%r.0, cast(reshape(%n, newshape=[1, 1]), dtype="float32")), %r.1)
    },
  }
}
def @main(%t: Tree[Tensor[(1), int32]], %emb: Tensor[(10, 4), float32], %U: Tensor[(4, 4), float32], %W: Tensor[(4, 4), float32]) -> (Tensor[(1, 4), float32], Tensor[(1, 4), float32]) {
  @tree(%t, %emb, %U, %W)
}
"#;

fn compile(src: &str) -> Program {
    let mut sources = SourceMap::new();
    let typed = tumble_check::load(&mut sources, "t.rly", src, LoadOptions::default())
        .unwrap_or_else(|d| panic!("{}", tumble_ir::diag::render(&d, &sources, false)));
    let mut p = Program::lower_with(&typed, LowerOptions::batched())
        .unwrap_or_else(|e| panic!("{}", e.message));
    let n = p.lambdas[p.globals[p.global_index["main"] as usize] as usize].n_params as usize;
    let weights: Vec<bool> = (0..n).map(|i| i > 0).collect();
    optimize(&mut p, "main", &weights, StaticOptions::all());
    assert_eq!(verify(&p), vec![]);
    p
}

/// The reference backend, logging every invocation (block, inline depth) and ghost.
struct Logging<'p> {
    inner: ReferenceBackend<'p>,
    log: Vec<(char, u32, u32)>,
}

impl Backend for Logging<'_> {
    fn call_op(
        &mut self,
        ctx: &mut InstanceCtx,
        op: &'static OpDef,
        args: Vec<Value>,
        attrs: &Attrs,
        span: Span,
    ) -> Result<Value, RunError> {
        self.log.push(('o', 0, ctx.depth));
        self.inner.call_op(ctx, op, args, attrs, span)
    }

    fn invoke_block(
        &mut self,
        ctx: &mut InstanceCtx,
        block: u32,
        site: u32,
        args: &mut Vec<Value>,
        span: Span,
    ) -> Result<Value, RunError> {
        self.log.push(('b', block, ctx.depth));
        // The batching runtime advances the depth per invocation; so does this log.
        ctx.depth += 1;
        self.inner.invoke_block(ctx, block, site, args, span)
    }

    fn ghost(&mut self, ctx: &mut InstanceCtx, n: u32) {
        self.log.push(('g', n, ctx.depth));
        ctx.depth += n;
    }

    fn condition(&mut self, v: &Value) -> Result<Option<bool>, RunError> {
        self.inner.condition(v)
    }
}

/// A tree of `n` leaves (tokens 1..), split unevenly so that depths differ between subtrees.
fn tree(p: &Program, first: i32, n: i32) -> Value {
    let rose = p.ctor_index["Rose"];
    let (cons, nil) = (p.ctor_index["Cons"], p.ctor_index["Nil"]);
    let list = |items: Vec<Value>| {
        items
            .into_iter()
            .rev()
            .fold(Value::adt(nil, vec![]), |rest, x| {
                Value::adt(cons, vec![x, rest])
            })
    };
    let tok = |t: i32| Value::Tensor(Tensor::from_vec(vec![1], vec![t % 10]).expect("token"));
    if n == 1 {
        return Value::adt(rose, vec![tok(first), list(vec![])]);
    }
    let left = (n / 3).max(1);
    let kids = if n >= 5 {
        // Three children here and there: folds over longer lists.
        let mid = (n - left) / 2;
        vec![
            tree(p, first, left),
            tree(p, first + left, mid),
            tree(p, first + left + mid, n - left - mid),
        ]
    } else {
        vec![tree(p, first, left), tree(p, first + left, n - left)]
    };
    Value::adt(rose, vec![tok(0), list(kids)])
}

fn weights() -> Vec<Value> {
    let m = |rows: usize, cols: usize, k: f32| {
        let v: Vec<f32> = (0..rows * cols)
            .map(|i| (i as f32 * k).sin() * 0.5)
            .collect();
        Value::Tensor(Tensor::from_vec(vec![rows, cols], v).expect("weight"))
    };
    vec![m(10, 4, 0.7), m(4, 4, 1.3), m(4, 4, 0.4)]
}

fn show(v: &Value) -> String {
    match v {
        Value::Tensor(t) => format!("{:?}", t.to_f64_vec()),
        Value::Tuple(t) => t.0.iter().map(show).collect::<Vec<_>>().join("; "),
        Value::Adt(a) => format!(
            "{}[{}]",
            a.ctor,
            a.fields.iter().map(show).collect::<Vec<_>>().join(", ")
        ),
        _ => "?".into(),
    }
}

fn run(
    p: &Program,
    first: Value,
    weights: Vec<Value>,
    at_once: bool,
) -> (String, Vec<(char, u32, u32)>, u64) {
    let ctx = InstanceCtx {
        rng: Rng::new(0),
        depth: 0,
        floor: 0,
        instance: 0,
        phase: 0,
        pending: 0,
    };
    let mut m = Machine::new(p, ctx);
    m.set_wider_at_once(at_once);
    let mut args = vec![first];
    args.extend(weights);
    m.start(p.global_index["main"], args).expect("start");
    let mut backend = Logging {
        inner: ReferenceBackend { program: p },
        log: Vec::new(),
    };
    loop {
        match m.run(&mut backend).expect("run") {
            Outcome::Done(v) => return (show(&v), backend.log, m.steps()),
            Outcome::Phase | Outcome::Yielded => continue,
            Outcome::Blocked => panic!("the reference backend never blocks"),
        }
    }
}

#[test]
fn loops_taken_at_once_record_the_same_invocations_in_fewer_steps() {
    let p = compile(SRC);
    assert!(
        p.natives.map_loops.iter().flatten().count() >= 2
            && p.natives.fold_loops.iter().flatten().count() >= 2,
        "the maps and folds are loops"
    );
    for n in [1, 2, 3, 5, 9, 17] {
        let (v_on, log_on, steps_on) = run(&p, tree(&p, 1, n), weights(), true);
        let (v_off, log_off, steps_off) = run(&p, tree(&p, 1, n), weights(), false);
        assert_eq!(v_on, v_off, "{n} leaves: values");
        assert_eq!(log_on, log_off, "{n} leaves: invocations and depths");
        if n > 1 {
            assert!(
                steps_on < steps_off,
                "{n} leaves: {steps_on} steps at once, {steps_off} in steps"
            );
        }
    }
}

/// A shift-reduce parser in miniature (the zoo's StackRNN): matches on the buffer and the stack
/// that choose values, constructors of immediate operands, nested `if`s on a tensor condition
/// with ghost operators in the shorter arms, and the choice that recurses.
const PARSER: &str = r#"
def @cell(%x: Tensor[(1, 4), float32], %h: Tensor[(1, 4), float32], %W: Tensor[(4, 4), float32]) -> Tensor[(1, 4), float32] {
  tanh(add(nn.dense(%h, %W), %x))
}
def @wants(%h: Tensor[(1, 4), float32]) -> Tensor[(), bool] {
  greater(sum(%h), 0f)
}
def @walk(%xs: List[Tensor[(1, 4), float32]], %stack: List[Tensor[(1, 4), float32]], %h: Tensor[(1, 4), float32], %W: Tensor[(4, 4), float32]) -> (Tensor[(1, 4), float32], List[Tensor[(), int32]]) {
  match (%xs, %stack) {
    (Nil, Cons(%top, Nil)) => (%top, Nil),
    _ => {
      let %zero = zeros(shape=[1, 4], dtype="float32");
      let %s0 = match (%stack) {
        Cons(%s, _) => %s,
        Nil => %zero,
      };
      let %x0 = match (%xs) {
        Cons(%x, _) => @cell(%x, %s0, %W),
        Nil => %zero,
      };
      let %h2 = @cell(%x0, %h, %W);
      let %can_shift = match (%xs) {
        Cons(_, _) => True,
        Nil => False,
      };
      let %can_reduce = match (%stack) {
        Cons(_, Cons(_, _)) => True,
        _ => False,
      };
      let %reduce = if (%can_shift) {
        if (%can_reduce) { @wants(%h2) } else { False }
      } else {
        True
      };
      if (%reduce) {
        match? (%stack) {
          Cons(%r, Cons(%l, %rest)) => {
            let %p = @cell(%l, %r, %W);
            let %res = @walk(%xs, Cons(%p, %rest), %h2, %W);
            (%res.0, Cons(1, %res.1))
          },
        }
      } else {
        match? (%xs) {
          Cons(_, %more) => {
            let %res = @walk(%more, Cons(%x0, %stack), %h2, %W);
            (%res.0, Cons(0, %res.1))
          },
        }
      }
    },
  }
}
def @main(%xs: List[Tensor[(1, 4), float32]], %W: Tensor[(4, 4), float32]) -> (Tensor[(1, 4), float32], List[Tensor[(), int32]]) {
  let %h0 = zeros(shape=[1, 4], dtype="float32");
  @walk(%xs, Nil, %h0, %W)
}
"#;

#[test]
fn conditionals_taken_at_once_record_the_same_invocations_in_fewer_steps() {
    let p = compile(PARSER);
    let (cons, nil) = (p.ctor_index["Cons"], p.ctor_index["Nil"]);
    let w = |k: f32| {
        let v: Vec<f32> = (0..16).map(|i| (i as f32 * k).sin() * 0.8).collect();
        Value::Tensor(Tensor::from_vec(vec![4, 4], v).expect("weight"))
    };
    let mut shifts_and_reduces = (false, false);
    for n in [1usize, 2, 3, 6, 11] {
        for k in [0.3f32, 1.7] {
            let xs = (0..n).rev().fold(Value::adt(nil, vec![]), |rest, i| {
                let v: Vec<f32> = (0..4).map(|c| ((i * 4 + c) as f32 * k).cos()).collect();
                let x = Value::Tensor(Tensor::from_vec(vec![1, 4], v).expect("x"));
                Value::adt(cons, vec![x, rest])
            });
            let (v_on, log_on, steps_on) = run(&p, xs.clone(), vec![w(k)], true);
            let (v_off, log_off, steps_off) = run(&p, xs, vec![w(k)], false);
            assert_eq!(v_on, v_off, "{n} tokens, k {k}: values");
            assert_eq!(log_on, log_off, "{n} tokens, k {k}: invocations and depths");
            assert!(
                log_on.iter().any(|e| e.0 == 'g'),
                "{n} tokens: ghosts lined up the arms"
            );
            assert!(
                steps_on < steps_off,
                "{n} tokens: {steps_on} steps at once, {steps_off} in steps"
            );
            shifts_and_reduces.0 |= v_on.contains("[[0.0]");
            shifts_and_reduces.1 |= v_on.contains("[[1.0]");
        }
    }
    assert!(
        shifts_and_reduces.0 && shifts_and_reduces.1,
        "both choices taken"
    );
}
