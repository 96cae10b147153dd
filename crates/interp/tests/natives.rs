//! The prelude's list functions run natively (`tumble_compile::Native`) give exactly what their
//! interpreted bodies give: every native function, directly and as a function value, on empty,
//! one-element and longer lists, lists of unequal lengths, nested lists; and `@hd`/`@tl` of an
//! empty list fail, located at the call.

use tumble_check::{load, LoadOptions};
use tumble_compile::LowerOptions;
use tumble_interp::{run, Program, Value};
use tumble_ir::SourceMap;
use tumble_tensor::{Rng, Tensor};

fn program(src: &str, natives: bool) -> Program {
    let mut sources = SourceMap::new();
    let typed = match load(&mut sources, "t.rly", src, LoadOptions::default()) {
        Ok(t) => t,
        Err(ds) => panic!("{}", tumble_ir::diag::render(&ds, &sources, false)),
    };
    let opts = LowerOptions {
        natives,
        ..LowerOptions::reference()
    };
    match Program::lower_with(&typed, opts) {
        Ok(p) => p,
        Err(e) => panic!("lowering failed: {}", e.message),
    }
}

fn int_list(p: &Program, xs: &[i32]) -> Value {
    let (cons, nil) = (p.ctor_index["Cons"], p.ctor_index["Nil"]);
    xs.iter()
        .rev()
        .fold(Value::adt(nil, Vec::new()), |rest, &x| {
            Value::adt(cons, vec![Value::Tensor(Tensor::scalar_i32(x)), rest])
        })
}

/// A value as text, lists and tuples spelled out.
fn show(p: &Program, v: &Value) -> String {
    match v {
        Value::Tensor(t) => format!("{:?}", t.to_f64_vec()),
        Value::Tuple(t) => format!(
            "({})",
            t.0.iter()
                .map(|x| show(p, x))
                .collect::<Vec<_>>()
                .join(", ")
        ),
        Value::Adt(a) => format!(
            "{}[{}]",
            p.ctors[a.ctor as usize].name,
            a.fields
                .iter()
                .map(|x| show(p, x))
                .collect::<Vec<_>>()
                .join(", ")
        ),
        other => format!("{other:?}"),
    }
}

/// Runs `src`'s `@main(xs, ys)` with and without natives; both results (or errors) as text.
fn both(src: &str, xs: &[i32], ys: &[i32]) -> (Result<String, String>, Result<String, String>) {
    let go = |natives: bool| {
        let p = program(src, natives);
        assert_eq!(
            p.natives.by_global.iter().flatten().count() > 0,
            natives,
            "natives registered"
        );
        let args = vec![int_list(&p, xs), int_list(&p, ys)];
        run(&p, "main", args, &mut Rng::new(0))
            .map(|v| show(&p, &v))
            .map_err(|e| e.into_info().message)
    };
    (go(true), go(false))
}

const LISTS: &[&[i32]] = &[&[], &[7], &[1, 2, 3], &[4, 5, 6, 7, 8]];

#[test]
fn list_functions_agree_with_the_prelude_bodies() {
    const INTS: &str = "List[Tensor[(), int32]]";
    let cases = [
        ("@rev(%xs)", INTS),
        ("@zip(%xs, %ys)", "List[(Tensor[(), int32], Tensor[(), int32])]"),
        ("@concat(%xs, %ys)", INTS),
        ("@map(@rev, Cons(%xs, Cons(%ys, Nil)))", "List[List[Tensor[(), int32]]]"),
        (
            "@map(fn (%p: (Tensor[(), int32], Tensor[(), int32])) -> Tensor[(), int32] { %p.1 }, @zip(%ys, %xs))",
            INTS,
        ),
        ("@foldl(@concat, Nil, Cons(%xs, Cons(@rev(%ys), Nil)))", INTS),
        // A concurrent pair destructured into a cell, as `@map`'s step is (one constructor);
        // the same let used otherwise (fields repeated, the tuple kept) is left alone.
        (
            "let %r = db.concurrent((@rev(%xs), @concat(%ys, %xs))); Cons(%r.0, Cons(%r.1, Nil))",
            "List[List[Tensor[(), int32]]]",
        ),
        (
            "let %r = db.concurrent((@rev(%xs), Cons(%ys, Nil))); Cons(%r.0, %r.1)",
            "List[List[Tensor[(), int32]]]",
        ),
        (
            "let %r = db.concurrent((@rev(%xs), Cons(%ys, Nil))); Cons(%r.0, Cons(%r.0, %r.1))",
            "List[List[Tensor[(), int32]]]",
        ),
    ];
    for (body, ty) in cases {
        let src = format!(
            "def @main(%xs: List[Tensor[(), int32]], %ys: List[Tensor[(), int32]]) -> {ty} {{ {body} }}"
        );
        for xs in LISTS {
            for ys in LISTS {
                let (native, interpreted) = both(&src, xs, ys);
                assert_eq!(native, interpreted, "{body} on {xs:?}, {ys:?}");
                assert!(native.is_ok(), "{body}: {native:?}");
            }
        }
    }
}

#[test]
fn head_and_tail_agree_and_fail_on_an_empty_list() {
    for (f, ty) in [
        ("@hd", "Tensor[(), int32]"),
        ("@tl", "List[Tensor[(), int32]]"),
    ] {
        let src = format!(
            "def @main(%xs: List[Tensor[(), int32]], %ys: List[Tensor[(), int32]]) -> {ty} {{ {f}(%xs) }}"
        );
        for xs in &LISTS[1..] {
            let (native, interpreted) = both(&src, xs, &[]);
            assert_eq!(native, interpreted, "{f} of {xs:?}");
        }
        let (native, interpreted) = both(&src, &[], &[]);
        let message = native.expect_err("hd/tl of Nil must fail");
        assert!(interpreted.is_err());
        assert!(
            message.contains(&format!("`{f}` of an empty list")),
            "{message}"
        );
    }
}

#[test]
fn a_module_without_the_prelude_keeps_its_own_definitions() {
    // Checked without the prelude, a user's `@rev` is not the prelude's: it is interpreted.
    let src = "type List[A] { Cons(A, List[A]), Nil, }\n\
               def @rev(%xs: List[Tensor[(), int32]]) -> List[Tensor[(), int32]] { %xs }\n\
               def @main(%xs: List[Tensor[(), int32]]) -> List[Tensor[(), int32]] { @rev(%xs) }";
    let mut sources = SourceMap::new();
    let typed = load(&mut sources, "t.rly", src, LoadOptions { prelude: false })
        .unwrap_or_else(|ds| panic!("{}", tumble_ir::diag::render(&ds, &sources, false)));
    let p = Program::lower_with(&typed, tumble_compile::LowerOptions::batched())
        .unwrap_or_else(|e| panic!("{}", e.message));
    assert_eq!(p.natives.by_global.iter().flatten().count(), 0);
    let v = run(&p, "main", vec![int_list(&p, &[1, 2])], &mut Rng::new(0)).unwrap();
    assert_eq!(show(&p, &v), show(&p, &int_list(&p, &[1, 2])));
}

/// `@nth`, `@update` and `@length` give what their prelude bodies give, at every index of
/// lists of every length, with the index an argument and computed (`@length(%ys) - 1`); past
/// the end both fail alike (the call is then left to the prelude's body).
#[test]
fn indexing_agrees_with_the_prelude_bodies_and_fails_past_the_end() {
    const INTS: &str = "List[Tensor[(), int32]]";
    let src = |body: &str, ty: &str| {
        format!(
            "def @main(%xs: List[Tensor[(), int32]], %ys: List[Tensor[(), int32]]) -> {ty} {{ {body} }}"
        )
    };
    for xs in LISTS {
        let (native, interpreted) = both(&src("@length(%xs)", "Tensor[(), int32]"), xs, &[]);
        assert_eq!(native, interpreted, "@length of {xs:?}");
        assert!(native.is_ok());
        // The elements as indices, through a function value: in range or not, the same.
        let body = "@map(fn (%i: Tensor[(), int32]) -> Tensor[(), int32] { @nth(%ys, %i) }, %xs)";
        let (native, interpreted) = both(&src(body, INTS), xs, &[3, 1, 4, 1, 5, 9, 2, 6]);
        assert_eq!(native.is_ok(), interpreted.is_ok(), "{body} on {xs:?}");
        if native.is_ok() {
            assert_eq!(native, interpreted, "{body} on {xs:?}");
        }
        for n in 0..xs.len() + 1 {
            let ys: Vec<i32> = vec![0; n + 1];
            for (body, ty) in [
                ("@nth(%xs, @length(%ys) - 1)", "Tensor[(), int32]"),
                ("@update(%xs, @length(%ys) - 1, 99)", INTS),
            ] {
                let (native, interpreted) = both(&src(body, ty), xs, &ys);
                match n < xs.len() {
                    true => assert_eq!(native, interpreted, "{body}: {xs:?} at {n}"),
                    false => {
                        assert!(interpreted.is_err(), "{body}: {xs:?} at {n}");
                        assert_eq!(native, interpreted, "{body}: {xs:?} at {n}");
                    }
                }
            }
        }
    }
}
