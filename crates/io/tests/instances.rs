//! Instances in: formats, decoding by type, every error path, and deep/large inputs.

mod common;

use std::collections::BTreeMap;

use common::{list_items, module, tensor, with_big_stack, Module};
use tumble_interp::Value;
use tumble_io::{bind_params, read_instances, read_instances_capped, IoError, RawInstances};
use tumble_ir::Ty;
use tumble_tensor::Tensor;

const SRC: &str = r#"
type Pair {
  MkPair(Tensor[(2), float32], Tensor[(), int32]),
}

def @main(%x: Tensor[(2, 3), float32],
          %tree: Tree[Tensor[(1), int32]],
          %xs: List[Tensor[(?), float32]],
          %p: (Tensor[(), bool], Tensor[(), int64]),
          %o: Option[Pair],
          %W: Tensor[(3), float32]) -> Tensor[(2, 3), float32] {
  %x
}
"#;

const GOOD: &str = r#"{"x": [[1, 2, 3], [4, 5, 6.5]], "tree": {"Rose": [[5], [{"Rose": [[6], []]}]]}, "xs": [[1], [2, 3], []], "p": [true, 9007199254740993], "o": {"Some": [{"MkPair": [[0.5, 1], -3]}]}}"#;

fn read(text: &str) -> RawInstances {
    match read_instances(text.as_bytes(), "t.jsonl") {
        Ok(r) => r,
        Err(e) => panic!("{e}"),
    }
}

fn read_err(text: &str) -> String {
    match read_instances(text.as_bytes(), "t.jsonl") {
        Ok(_) => panic!("expected a read error"),
        Err(e) => e.to_string(),
    }
}

/// Instance arguments of SRC's @main (all but W, which comes from the file).
fn inst_args(m: &Module) -> Vec<(String, Ty)> {
    let (params, _) = m.main();
    let mut file = BTreeMap::new();
    file.insert(
        "W".to_string(),
        Tensor::zeros([3], tumble_ir::DType::Float32).unwrap(),
    );
    let raw = read(GOOD);
    let provided = raw.provided_args(&params, &file);
    bind_params(&params, &provided, &file, None)
        .unwrap()
        .instance_args()
}

fn decode(m: &Module, text: &str) -> Result<Vec<Vec<Value>>, IoError> {
    read(text).decode(&m.env(), &inst_args(m))
}

fn decode_err(m: &Module, text: &str) -> String {
    match decode(m, text) {
        Ok(_) => panic!("expected a decode error for {text}"),
        Err(e) => e.to_string(),
    }
}

fn check_good(m: &Module, vals: &[Value]) {
    assert_eq!(vals.len(), 5);
    assert_eq!(
        tensor(&vals[0]),
        &Tensor::from_f32([2, 3], vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.5]).unwrap()
    );
    let Value::Adt(rose) = &vals[1] else { panic!() };
    assert_eq!(rose.ctor, m.ctor("Rose"));
    assert_eq!(
        tensor(&rose.fields[0]),
        &Tensor::from_i32([1], vec![5]).unwrap()
    );
    let kids = list_items(&rose.fields[1]);
    assert_eq!(kids.len(), 1);
    let xs = list_items(&vals[2]);
    assert_eq!(xs.len(), 3);
    assert_eq!(
        tensor(&xs[1]),
        &Tensor::from_f32([2], vec![2.0, 3.0]).unwrap()
    );
    assert_eq!(tensor(&xs[2]).shape(), &[0]);
    let Value::Tuple(p) = &vals[3] else { panic!() };
    assert_eq!(tensor(&p.0[0]), &Tensor::scalar_bool(true));
    assert_eq!(tensor(&p.0[1]), &Tensor::scalar_i64(9007199254740993));
    let Value::Adt(some) = &vals[4] else { panic!() };
    assert_eq!(some.ctor, m.ctor("Some"));
    let Value::Adt(pair) = &some.fields[0] else {
        panic!()
    };
    assert_eq!(tensor(&pair.fields[1]), &Tensor::scalar_i32(-3));
}

#[test]
fn json_lines_and_array() {
    let m = module(SRC);
    let text = format!("\n{GOOD}\n\n   \n{GOOD}\r\n");
    let raw = read(&text);
    assert_eq!(raw.len(), 2);
    assert_eq!(raw.items[1].location, tumble_io::Location::Line(5));
    for vals in raw.decode(&m.env(), &inst_args(&m)).unwrap() {
        check_good(&m, &vals);
    }
    // A JSON array spread over lines.
    let text = format!("[\n  {GOOD},\n  {GOOD}\n]\n");
    let raw = read(&text);
    assert_eq!(raw.len(), 2);
    assert_eq!(raw.items[1].location, tumble_io::Location::Index(1));
    for vals in raw.decode(&m.env(), &inst_args(&m)).unwrap() {
        check_good(&m, &vals);
    }
    // On one line too.
    assert_eq!(read(&format!("[{GOOD}, {GOOD}, {GOOD}]")).len(), 3);
    // Empty input: no instances.
    assert!(read("\n \n").is_empty());
}

#[test]
fn jsonl_lines_that_are_arrays() {
    // Each line a bare array value: JSON Lines, since the whole input is not one array.
    let m = module("def @main(%xs: List[Tensor[(), int32]]) -> Tensor[(), int32] { 0 }");
    let (params, _) = m.main();
    let raw = read("[1, 2, 3]\n[]\n[4]\n");
    assert_eq!(raw.len(), 3);
    let provided = raw.provided_args(&params, &BTreeMap::new());
    assert_eq!(provided.iter().collect::<Vec<_>>(), ["xs"]);
    let args = bind_params(&params, &provided, &BTreeMap::new(), None)
        .unwrap()
        .instance_args();
    let vals = raw.decode(&m.env(), &args).unwrap();
    assert_eq!(list_items(&vals[0][0]).len(), 3);
    assert_eq!(list_items(&vals[1][0]).len(), 0);
    // A multi-line array whose elements are arrays: an array of 2 bare instances.
    let raw = read("[\n[1, 2],\n[3]\n]");
    assert_eq!(raw.len(), 2);
    let vals = raw.decode(&m.env(), &args).unwrap();
    assert_eq!(list_items(&vals[1][0]).len(), 1);
}

#[test]
fn bare_values() {
    let m = module(
        "def @main(%t: Tree[Tensor[(1), int32]], %W: Tensor[(2), float32]) -> Tree[Tensor[(1), int32]] { %t }",
    );
    let (params, _) = m.main();
    let mut file = BTreeMap::new();
    file.insert(
        "W".to_string(),
        Tensor::zeros([2], tumble_ir::DType::Float32).unwrap(),
    );
    // `{"Rose": ...}` has no key naming an argument: it is the tree itself. "Leaf" strings and
    // keyed objects mix freely.
    let raw = read("{\"Rose\": [[1], []]}\n{\"t\": {\"Rose\": [[2], []]}}\n");
    let provided = raw.provided_args(&params, &file);
    assert_eq!(provided.iter().collect::<Vec<_>>(), ["Rose", "t"]);
    let args = bind_params(&params, &provided, &file, None)
        .unwrap()
        .instance_args();
    let vals = raw.decode(&m.env(), &args).unwrap();
    for (v, want) in vals.iter().zip([1, 2]) {
        let Value::Adt(r) = &v[0] else { panic!() };
        assert_eq!(
            tensor(&r.fields[0]),
            &Tensor::from_i32([1], vec![want]).unwrap()
        );
    }
    // A bare number for a scalar argument.
    let m = module("def @main(%n: Tensor[(), float32]) -> Tensor[(), float32] { %n }");
    let (params, _) = m.main();
    let raw = read("1.5\n-2\n");
    let provided = raw.provided_args(&params, &BTreeMap::new());
    let args = bind_params(&params, &provided, &BTreeMap::new(), None)
        .unwrap()
        .instance_args();
    let vals = raw.decode(&m.env(), &args).unwrap();
    assert_eq!(tensor(&vals[1][0]), &Tensor::scalar_f32(-2.0));
    // {"shape", "data"} as a bare tensor.
    let raw = read(r#"{"shape": [], "data": [3]}"#);
    assert_eq!(
        tensor(&raw.decode(&m.env(), &args).unwrap()[0][0]),
        &Tensor::scalar_f32(3.0)
    );
}

#[test]
fn bare_value_with_several_arguments_is_an_error() {
    let m = module(
        "def @main(%a: Tensor[(), float32], %b: Tensor[(), float32]) -> Tensor[(), float32] { %a }",
    );
    let (params, _) = m.main();
    let raw = read("1.5\n");
    let keys = ["a", "b"].iter().map(|s| s.to_string()).collect();
    let args = bind_params(&params, &keys, &BTreeMap::new(), None)
        .unwrap()
        .instance_args();
    assert_eq!(
        raw.decode(&m.env(), &args).unwrap_err().to_string(),
        "t.jsonl: instance at line 1: expected an object with the keys a, b (a bare value is \
         accepted only when @main takes exactly one argument from the instances), found the \
         number 1.5"
    );
}

#[test]
fn shape_data_form() {
    let m = module(SRC);
    let line = GOOD.replace(
        r#""x": [[1, 2, 3], [4, 5, 6.5]]"#,
        r#""x": {"shape": [2, 3], "data": [1, 2, 3, 4, 5, 6.5]}"#,
    );
    check_good(&m, &decode(&m, &line).unwrap()[0]);
    let bad = GOOD.replace(
        r#""x": [[1, 2, 3], [4, 5, 6.5]]"#,
        r#""x": {"shape": [3, 2], "data": [1, 2, 3, 4, 5, 6]}"#,
    );
    assert_eq!(
        decode_err(&m, &bad),
        "t.jsonl: instance at line 1: .x.shape: expected Tensor[(2, 3), float32], found the shape (3, 2)"
    );
    let bad = GOOD.replace(
        r#""x": [[1, 2, 3], [4, 5, 6.5]]"#,
        r#""x": {"shape": [2, 3], "data": [1, 2, 3, 4, 5]}"#,
    );
    assert_eq!(
        decode_err(&m, &bad),
        "t.jsonl: instance at line 1: .x.data: shape (2, 3) needs 6 values, found 5 elements"
    );
    let bad = GOOD.replace(
        r#""x": [[1, 2, 3], [4, 5, 6.5]]"#,
        r#""x": {"shape": [2, 3], "data": [1, 2, 3, 4, 5, "6"]}"#,
    );
    assert_eq!(
        decode_err(&m, &bad),
        "t.jsonl: instance at line 1: .x.data[5]: expected a float32 element of Tensor[(2, 3), float32], found the string \"6\""
    );
}

/// float64 elements are the doubles nearest their decimal text: serde_json's default fast path
/// read 4503599627370495.5 as ...495.0 and 1125899906842623.75 as ...623.625 (an audit's find).
#[test]
fn float64_elements_are_the_nearest_doubles() {
    let m = module("def @main(%v: Tensor[(5), float64]) { %v }");
    let line = r#"{"v": [4503599627370495.5, 1125899906842623.75, 0.30000000000000004, 1e-320, 123456789.123456789]}"#;
    let vals = decode(&m, line).unwrap();
    let Some(Value::Tensor(t)) = vals.first().and_then(|v| v.first()) else {
        panic!("not a tensor");
    };
    let want = [
        4503599627370495.5f64,
        // (Written so that clippy sees no excess digits: the same doubles.)
        1125899906842624.0 - 0.25,
        0.30000000000000004,
        1e-320,
        123456789.12345679,
    ];
    assert_eq!(t.as_slice::<f64>().unwrap(), &want);
}

/// GOOD with `from` replaced by `to` must fail with exactly `want` (after the instance prefix).
fn assert_decode_error(m: &Module, from: &str, to: &str, want: &str) {
    assert!(GOOD.contains(from), "{from}");
    let e = decode_err(m, &GOOD.replace(from, to));
    assert_eq!(e, format!("t.jsonl: instance at line 1: {want}"));
}

#[test]
fn decode_errors() {
    let m = module(SRC);
    let x = r#""x": [[1, 2, 3], [4, 5, 6.5]]"#;
    // Wrong shape.
    assert_decode_error(
        &m,
        x,
        r#""x": [[1, 2, 3, 4], [4, 5, 6, 7]]"#,
        ".x[0]: expected an array of 3 elements (dimension 1 of Tensor[(2, 3), float32]), found an array of 4 elements",
    );
    assert_decode_error(
        &m,
        x,
        r#""x": [[1, 2, 3]]"#,
        ".x: expected Tensor[(2, 3), float32], found an array of 1 element",
    );
    // Ragged.
    assert_decode_error(
        &m,
        x,
        r#""x": [[1, 2, 3], [4, 5]]"#,
        ".x[1]: ragged array: expected 3 elements like the first array at this depth, found 2 \
         (every row of a tensor has the same length)",
    );
    // Too shallow / too deep.
    assert_decode_error(
        &m,
        x,
        r#""x": [1, 2]"#,
        ".x[0]: expected an array (level 1 of Tensor[(2, 3), float32], which has rank 2), found the number 1",
    );
    assert_decode_error(
        &m,
        x,
        r#""x": [[1, 2, [3]], [4, 5, 6]]"#,
        ".x[0][2]: expected a float32 element of Tensor[(2, 3), float32], found an array of 1 element",
    );
    // Non-integral and out-of-range integers.
    let tree = r#""tree": {"Rose": [[5], [{"Rose": [[6], []]}]]}"#;
    assert_decode_error(
        &m,
        tree,
        r#""tree": {"Rose": [2.5, []]}"#,
        ".tree.Rose[0]: expected Tensor[(1), int32], found the number 2.5",
    );
    assert_decode_error(
        &m,
        tree,
        r#""tree": {"Rose": [[5], [{"Rose": [[2.5], []]}]]}"#,
        ".tree.Rose[1][0].Rose[0][0]: expected an int32 element of Tensor[(1), int32], found the number 2.5, which is not an integer",
    );
    assert_decode_error(
        &m,
        tree,
        r#""tree": {"Rose": [[3000000000], []]}"#,
        ".tree.Rose[0][0]: expected an int32 element of Tensor[(1), int32], found the number 3000000000, which is out of range for int32",
    );
    // Integral floats are fine for ints.
    assert!(decode(&m, &GOOD.replace(tree, r#""tree": {"Rose": [[5.0], []]}"#)).is_ok());
    let p = r#""p": [true, 9007199254740993]"#;
    assert_decode_error(
        &m,
        p,
        r#""p": [true, 1e300]"#,
        ".p[1]: expected Tensor[(), int64], found the number 1e+300, which is out of range for int64",
    );
    assert_decode_error(
        &m,
        p,
        r#""p": [1, 2]"#,
        ".p[0]: expected Tensor[(), bool], found the number 1 (write true or false)",
    );
    assert_decode_error(
        &m,
        p,
        r#""p": [true]"#,
        ".p: expected (Tensor[(), bool], Tensor[(), int64]) (a tuple of 2 elements), found an array of 1 element",
    );
    // Unknown constructor, constructor of another type, wrong field count, bad forms.
    assert_decode_error(
        &m,
        tree,
        r#""tree": {"Rse": [[5], []]}"#,
        ".tree: unknown constructor `Rse` for Tree[Tensor[(1), int32]]; expected one of: Rose",
    );
    assert_decode_error(
        &m,
        tree,
        r#""tree": {"Rose": [[5], [{"Some": [[6], []]}]]}"#,
        ".tree.Rose[1][0]: constructor `Some` belongs to Option, not Tree[Tensor[(1), int32]]; expected one of: Rose",
    );
    assert_decode_error(
        &m,
        tree,
        r#""tree": {"Rose": [[5], [], []]}"#,
        ".tree.Rose: constructor Rose takes 2 fields, found an array of 3 elements",
    );
    assert_decode_error(
        &m,
        tree,
        r#""tree": {"Rose": 5}"#,
        ".tree.Rose: expected the 2 fields of Rose as an array, found the number 5",
    );
    assert_decode_error(
        &m,
        tree,
        r#""tree": "Rose""#,
        ".tree: constructor Rose takes 2 fields; write {\"Rose\": [...]}",
    );
    assert_decode_error(
        &m,
        tree,
        r#""tree": [5, []]"#,
        ".tree: expected Tree[Tensor[(1), int32]] (an object with one key, the constructor, like {\"Rose\": [fields...]}), found an array of 2 elements",
    );
    let o = r#""o": {"Some": [{"MkPair": [[0.5, 1], -3]}]}"#;
    assert!(decode(&m, &GOOD.replace(o, r#""o": "None""#)).is_ok());
    assert!(decode(&m, &GOOD.replace(o, r#""o": {"None": []}"#)).is_ok());
    assert_decode_error(
        &m,
        o,
        r#""o": {"Some": [{"MkPair": [[0.5, 1, 2], -3]}]}"#,
        ".o.Some[0].MkPair[0]: expected Tensor[(2), float32], found an array of 3 elements",
    );
    // Lists: element errors carry the index; a non-array is explained.
    let xs = r#""xs": [[1], [2, 3], []]"#;
    assert_decode_error(
        &m,
        xs,
        r#""xs": [[1], [2, "a"], []]"#,
        ".xs[1][1]: expected a float32 element of Tensor[(?), float32], found the string \"a\"",
    );
    assert_decode_error(
        &m,
        xs,
        r#""xs": 5"#,
        ".xs: expected List[Tensor[(?), float32]] (a JSON array, or an object with one key, the constructor, like {\"Cons\": [fields...]}), found the number 5",
    );
    // Extra and missing keys.
    assert_eq!(
        decode_err(&m, &GOOD.replace(r#""x": "#, r#""y": 1, "x": "#)),
        "t.jsonl: instance at line 1: unknown key `y`; the instances must have the keys: x, tree, xs, p, o"
    );
    assert_eq!(
        decode_err(&m, &GOOD.replace(&format!("{x}, "), "")),
        "t.jsonl: instance at line 1: missing key `x` (for @main's argument %x: Tensor[(2, 3), float32]); the instance has: o, p, tree, xs"
    );
    // Array input: the index names the instance.
    let e = read(&format!(
        "[{GOOD}, {}]",
        GOOD.replace(x, r#""x": [[1, 2, 3]]"#)
    ))
    .decode(&m.env(), &inst_args(&m))
    .unwrap_err()
    .to_string();
    assert_eq!(
        e,
        "t.jsonl: instance at index 1: .x: expected Tensor[(2, 3), float32], found an array of 1 element"
    );
}

#[test]
fn syntax_errors() {
    assert_eq!(
        read_err("{\"x\": 1}\n\n{\"x\": }\n"),
        "t.jsonl: line 3, column 7: not valid JSON: expected value"
    );
    assert_eq!(
        read_err("[\n{\"x\": 1},\n{\"x\": 2\n]"),
        "t.jsonl: line 4, column 1: not valid JSON: expected `,` or `}` (the input starts with `[`, \
         so it was read as one JSON array of instances; for JSON Lines put each instance on one line)"
    );
    assert_eq!(
        read_err("{\"x\": 1} {\"x\": 2}"),
        "t.jsonl: line 1, column 10: not valid JSON: trailing characters"
    );
}

#[test]
fn long_list() {
    let m = module("def @main(%xs: List[Tensor[(), int32]]) -> Tensor[(), int32] { 0 }");
    let n = 100_000;
    let body: Vec<String> = (0..n).map(|i| i.to_string()).collect();
    let line = format!("{{\"xs\": [{}]}}", body.join(","));
    let raw = read(&line);
    let args = vec![("xs".to_string(), m.main().0[0].1.clone())];
    let vals = raw.decode(&m.env(), &args).unwrap();
    let items = list_items(&vals[0][0]);
    assert_eq!(items.len(), n);
    assert_eq!(tensor(&items[n - 1]), &Tensor::scalar_i32(n as i32 - 1));
    drop(items);
    drop(vals); // iterative drop in the interpreter's Value
}

fn deep_tree_json(depth: usize) -> String {
    let mut s = String::new();
    for i in 0..depth {
        s.push_str(&format!("{{\"Rose\": [[{i}], ["));
    }
    s.push_str("{\"Rose\": [[-1], []]}");
    for _ in 0..depth {
        s.push_str("]]}");
    }
    s
}

#[test]
fn deep_tree_on_a_big_stack() {
    let depth = with_big_stack(|| {
        let m = module("def @main(%t: Tree[Tensor[(1), int32]]) -> Tensor[(), int32] { 0 }");
        let line = format!("{{\"t\": {}}}", deep_tree_json(5_000));
        let raw = read(&line);
        let args = vec![("t".to_string(), m.main().0[0].1.clone())];
        let vals = raw.decode(&m.env(), &args).unwrap();
        // Walk down the first children.
        let mut depth = 0;
        let mut node = vals[0][0].clone();
        loop {
            let Value::Adt(r) = &node else { panic!() };
            let kids = list_items(&r.fields[1]);
            match kids.first() {
                Some(k) => {
                    node = k.clone();
                    depth += 1;
                }
                None => break,
            }
        }
        drop(node);
        drop(vals);
        drop(raw);
        depth
    });
    assert_eq!(depth, 5_000);
}

#[test]
fn too_deep_is_rejected_without_recursing() {
    // No big stack needed: the depth check runs before any parsing.
    let line = format!("{{\"x\": {}1{}}}", "[".repeat(20_000), "]".repeat(20_000));
    assert_eq!(
        read_err(&line),
        "t.jsonl: the instance at line 1 nests deeper than 16384 levels of JSON arrays/objects; \
         tumble does not read inputs that deep"
    );
    // Brackets inside strings do not count.
    let line = format!("{{\"x\": \"{}\"}}", "[".repeat(20_000));
    assert_eq!(read(&line).len(), 1);
    let e = read_err(&format!("[{}]", "[".repeat(20_000)));
    assert!(e.contains("nests deeper than 16384 levels"), "{e}");
}

#[test]
fn long_lines_are_capped() {
    // An endless line: the reader stops at the cap instead of allocating without bound.
    let endless = std::io::BufReader::new(std::io::repeat(b'1'));
    let e = read_instances_capped(endless, "<stdin>", 4096)
        .err()
        .unwrap()
        .to_string();
    assert_eq!(
        e,
        "<stdin>: line 1 is longer than 4096 bytes; split the input into smaller instances"
    );
    let text = format!("1\n{}\n", "2".repeat(5000));
    let e = read_instances_capped(text.as_bytes(), "in.jsonl", 4096)
        .err()
        .unwrap()
        .to_string();
    assert_eq!(
        e,
        "in.jsonl: line 2 is longer than 4096 bytes; split the input into smaller instances"
    );
    let e = read_instances_capped(
        format!("[\n{}\n]", "1,\n".repeat(3000)).as_bytes(),
        "a.json",
        4096,
    )
    .err()
    .unwrap()
    .to_string();
    assert!(e.contains("larger than 4096 bytes"), "{e}");
}

#[test]
fn instance_file_errors_name_the_file() {
    let e = tumble_io::read_instances_file(std::path::Path::new("/nonexistent/in.jsonl"))
        .err()
        .unwrap()
        .to_string();
    assert!(
        e.starts_with("cannot read the instances file `/nonexistent/in.jsonl`: "),
        "{e}"
    );
}

/// One constructor at two type arguments in one instance, given as objects (`{"Some": [..]}`):
/// each is decoded with its own field types (the decoder keeps constructors it instantiated,
/// keyed by their type arguments), and an error inside either names its path.
#[test]
fn one_constructor_at_two_type_arguments() {
    let m = module(
        r#"
type Pair {
  MkPair(Tensor[(2), float32], Tensor[(), int32]),
}

def @main(%o: Option[Pair], %q: Option[Tensor[(), int32]], %r: Option[Pair]) -> Option[Pair] {
  %o
}
"#,
    );
    let (params, _) = m.main();
    let good =
        r#"{"o": {"Some": [{"MkPair": [[0.5, 1], -3]}]}, "q": {"Some": [7]}, "r": {"None": []}}"#;
    let vals = match read(good).decode(&m.env(), &params) {
        Ok(v) => v,
        Err(e) => panic!("{e}"),
    };
    let [o, q, r] = vals[0].as_slice() else {
        panic!("three values expected")
    };
    let (Value::Adt(o), Value::Adt(q), Value::Adt(r)) = (o, q, r) else {
        panic!("three constructors expected")
    };
    assert!(matches!(&o.fields[0], Value::Adt(p) if p.fields.len() == 2));
    assert!(matches!(&q.fields[0], Value::Tensor(t) if t.as_slice::<i32>() == Some(&[7][..])));
    assert!(r.fields.is_empty());
    // The second `Some` wants a scalar, not a pair: the error is at its own path.
    let bad = r#"{"o": {"Some": [{"MkPair": [[0.5, 1], -3]}]}, "q": {"Some": [{"MkPair": [[0.5, 1], -3]}]}, "r": {"None": []}}"#;
    let e = match read(bad).decode(&m.env(), &params) {
        Ok(_) => panic!("expected a decode error"),
        Err(e) => e.to_string(),
    };
    assert!(e.contains("q.Some[0]"), "{e}");
}

/// A UTF-8 byte order mark before the first line (some editors write one) is not part of the
/// JSON: the file reads as without it.
#[test]
fn a_byte_order_mark_is_skipped() {
    let text = "{\"x\": 1}\n{\"x\": 2}\n";
    let with_bom = format!("\u{feff}{text}");
    let plain = read_instances(text.as_bytes(), "plain.jsonl").unwrap_or_else(|e| panic!("{e}"));
    let bom = read_instances(with_bom.as_bytes(), "bom.jsonl").unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(bom.items.len(), plain.items.len());
    for (a, b) in bom.items.iter().zip(&plain.items) {
        assert_eq!(
            a.json().map(|j| j.to_string()).unwrap_or_default(),
            b.json().map(|j| j.to_string()).unwrap_or_default()
        );
    }
}

/// A top-level key given twice is an error naming it (serde_json's maps kept the last value, so
/// the instance ran with a value the author may not have meant).
#[test]
fn a_key_given_twice_is_an_error() {
    match read_instances("{\"x\": 1, \"y\": 2, \"x\": 3}\n".as_bytes(), "dup.jsonl") {
        Ok(_) => panic!("a duplicate key was accepted"),
        Err(e) => {
            let msg = e.to_string();
            assert!(
                msg.contains("`x` is given twice") && msg.contains("line 1"),
                "{msg}"
            );
        }
    }
}

/// A request body is read as an instance file is: a key given twice (in the body, or at the top
/// of an instance) is an error — serde_json kept the last value silently, where `tumble run`
/// refuses the same instance — and a byte order mark before it is skipped.
#[test]
fn request_bodies_refuse_repeated_keys_and_skip_a_byte_order_mark() {
    let read = |body: &str| tumble_io::read_request_instances(body.as_bytes(), "instances", "req");
    let e = read(r#"{"instances": [{"x": 1, "x": 2}]}"#).map(|r| r.len());
    assert!(
        matches!(&e, Err(err) if err.to_string().contains("the key `x` is given twice in an instance")),
        "{e:?}"
    );
    let e = read(r#"{"instances": [], "instances": [{"x": 1}]}"#).map(|r| r.len());
    assert!(
        matches!(&e, Err(err) if err.to_string().contains("the key `instances` is given twice")),
        "{e:?}"
    );
    // Keys repeated deeper inside an instance are the decoder's business, not the body's.
    let ok = read(
        "\u{feff}{\"instances\": [{\"x\": 1}, [1, 2], 3, {\"y\": {\"a\": 1}}], \"other\": {}}",
    )
    .map(|r| r.len());
    assert_eq!(ok.ok(), Some(4));
}

/// A body of more instances than the reader takes is refused as too large by the walk that checks
/// its keys, before any instance is built; at the limit it is read.
#[test]
fn request_bodies_past_the_instance_limit_are_refused_before_parsing() {
    let body = r#"{"instances": [{"x": 1}, {"x": 2}, {"x": 3}, {"x": 4}]}"#;
    let read = |max: usize| {
        tumble_io::read_request_instances_at_most(body.as_bytes(), "instances", "req", max, " (N)")
    };
    match read(3) {
        Err(e @ tumble_io::IoError::TooLarge { .. }) => {
            assert!(e.to_string().contains("more than 3 instances"), "{e}");
            assert!(e.to_string().contains("(N)"), "{e}");
        }
        other => panic!("{:?}", other.map(|r| r.len())),
    }
    assert_eq!(read(4).map(|r| r.len()).ok(), Some(4));
    // A syntax error before the limit is still located as one.
    let bad = r#"{"instances": [{"x": 1}, {"x": ]}"#;
    let e = tumble_io::read_request_instances_at_most(bad.as_bytes(), "instances", "req", 1, "");
    assert!(
        matches!(&e, Err(err) if err.to_string().contains("not valid JSON")),
        "{:?}",
        e.map(|r| r.len())
    );
}
