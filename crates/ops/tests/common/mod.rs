//! Shared by the kernel tests: value and attribute builders, the comparison used everywhere, the
//! golden-file loader and the table of hand-computed cases (shared so that the coverage test in
//! `golden.rs` can see which operators the hand cases exercise).

#![allow(dead_code)]

pub mod hand;

use serde_json::Value;
use tumble_ir::attrs::Attr;
use tumble_ir::{AttrValue, Attrs, DType, Span};
use tumble_ops::{eval, lookup, KernelError, OpCtx, OpValue};
use tumble_tensor::{Rng, Tensor};

/// Tolerances for float results: (rtol, atol). Kernels accumulate in f64 and round once, so
/// float32 results agree with the float64 reference rounded to float32 to within a few ulps;
/// float64 results to within summation-order differences. Ints and bools compare exactly.
pub const F32_TOL: (f64, f64) = (1e-5, 1e-6);
pub const F64_TOL: (f64, f64) = (1e-9, 1e-12);

pub fn attrs(kv: &[(&str, AttrValue)]) -> Attrs {
    Attrs(
        kv.iter()
            .map(|(k, v)| Attr {
                name: k.to_string(),
                value: v.clone(),
                span: Span::default(),
            })
            .collect(),
    )
}

pub fn ints(v: &[i64]) -> AttrValue {
    AttrValue::List(v.iter().map(|&n| AttrValue::Int(n)).collect())
}

pub fn f32s(shape: &[usize], v: &[f32]) -> OpValue {
    OpValue::Tensor(Tensor::from_f32(shape, v.to_vec()).expect("f32s"))
}

pub fn f64s(shape: &[usize], v: &[f64]) -> OpValue {
    OpValue::Tensor(Tensor::from_f64(shape, v.to_vec()).expect("f64s"))
}

pub fn i32s(shape: &[usize], v: &[i32]) -> OpValue {
    OpValue::Tensor(Tensor::from_i32(shape, v.to_vec()).expect("i32s"))
}

pub fn i64s(shape: &[usize], v: &[i64]) -> OpValue {
    OpValue::Tensor(Tensor::from_i64(shape, v.to_vec()).expect("i64s"))
}

pub fn bools(shape: &[usize], v: &[bool]) -> OpValue {
    OpValue::Tensor(Tensor::from_bool(shape, v.to_vec()).expect("bools"))
}

pub fn tup(vs: Vec<OpValue>) -> OpValue {
    OpValue::Tuple(
        vs.into_iter()
            .map(|v| match v {
                OpValue::Tensor(t) => t,
                OpValue::Tuple(_) => panic!("nested tuple"),
            })
            .collect(),
    )
}

/// Runs `op` through `eval` with a fresh generator seeded with 0.
pub fn run(op: &str, args: &[OpValue], attrs: &Attrs) -> Result<OpValue, KernelError> {
    let def = lookup(op).unwrap_or_else(|| panic!("no operator {op}"));
    let mut rng = Rng::new(0);
    let mut ctx = OpCtx { rng: &mut rng };
    eval(def, args, attrs, &mut ctx)
}

fn compare_tensor(got: &Tensor, want: &Tensor) -> Result<(), String> {
    if got.shape() != want.shape() || got.dtype() != want.dtype() {
        return Err(format!("got {got}, want {want} (shape or dtype differ)"));
    }
    let ok = match want.dtype() {
        DType::Float32 => got.allclose(want, F32_TOL.0, F32_TOL.1),
        DType::Float64 => got.allclose(want, F64_TOL.0, F64_TOL.1),
        _ => got == want,
    };
    if ok {
        Ok(())
    } else {
        let diff = got.max_abs_diff(want).unwrap_or(f64::NAN);
        Err(format!(
            "got {got}\n want {want}\n max |diff| {diff:e}\n got all  {:?}\n want all {:?}",
            got.to_f64_vec(),
            want.to_f64_vec()
        ))
    }
}

/// Exact for ints and bools, [`F32_TOL`]/[`F64_TOL`] for floats (NaN equals NaN).
pub fn compare(got: &OpValue, want: &OpValue) -> Result<(), String> {
    match (got, want) {
        (OpValue::Tensor(g), OpValue::Tensor(w)) => compare_tensor(g, w),
        (OpValue::Tuple(g), OpValue::Tuple(w)) => {
            if g.len() != w.len() {
                return Err(format!("tuple of {} fields, want {}", g.len(), w.len()));
            }
            for (i, (g, w)) in g.iter().zip(w).enumerate() {
                compare_tensor(g, w).map_err(|m| format!("field {i}: {m}"))?;
            }
            Ok(())
        }
        _ => Err(format!("got {got:?}, want {want:?}")),
    }
}

// ---- golden files ----------------------------------------------------------------------------

pub struct GoldenCase {
    pub op: String,
    pub note: String,
    pub attrs: Attrs,
    pub inputs: Vec<OpValue>,
    pub expected: OpValue,
}

fn json_attr(v: &Value) -> AttrValue {
    match v {
        Value::Null => AttrValue::None,
        Value::Bool(b) => AttrValue::Bool(*b),
        Value::Number(n) => match n.as_i64() {
            Some(i) => AttrValue::Int(i),
            None => AttrValue::Float(n.as_f64().expect("number")),
        },
        Value::String(s) => AttrValue::Str(s.clone()),
        Value::Array(vs) => AttrValue::List(vs.iter().map(json_attr).collect()),
        Value::Object(_) => panic!("object attribute"),
    }
}

fn json_f64(v: &Value) -> f64 {
    match v {
        Value::Number(n) => n.as_f64().expect("number"),
        Value::String(s) if s == "nan" => f64::NAN,
        Value::String(s) if s == "inf" => f64::INFINITY,
        Value::String(s) if s == "-inf" => f64::NEG_INFINITY,
        other => panic!("not a float: {other}"),
    }
}

fn json_tensor(v: &Value) -> Tensor {
    let shape: Vec<usize> = v["shape"]
        .as_array()
        .expect("shape")
        .iter()
        .map(|d| d.as_u64().expect("dim") as usize)
        .collect();
    let data = v["data"].as_array().expect("data");
    let dtype = DType::from_name(v["dtype"].as_str().expect("dtype")).expect("known dtype");
    let t = match dtype {
        DType::Float32 => {
            Tensor::from_f32(shape, data.iter().map(|x| json_f64(x) as f32).collect())
        }
        DType::Float64 => Tensor::from_f64(shape, data.iter().map(json_f64).collect()),
        DType::Int32 => Tensor::from_i32(
            shape,
            data.iter()
                .map(|x| x.as_i64().expect("int") as i32)
                .collect(),
        ),
        DType::Int64 => Tensor::from_i64(
            shape,
            data.iter().map(|x| x.as_i64().expect("int")).collect(),
        ),
        DType::Bool => Tensor::from_bool(
            shape,
            data.iter().map(|x| x.as_bool().expect("bool")).collect(),
        ),
    };
    t.expect("golden tensor")
}

fn json_value(v: &Value) -> OpValue {
    match v.get("tuple") {
        Some(fields) => OpValue::Tuple(
            fields
                .as_array()
                .expect("tuple")
                .iter()
                .map(json_tensor)
                .collect(),
        ),
        None => OpValue::Tensor(json_tensor(v)),
    }
}

/// The cases in `tests/golden/cases.json` (written by `gen_golden.py`).
pub fn golden_cases() -> Vec<GoldenCase> {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/golden/cases.json");
    let text = std::fs::read_to_string(path).expect("read cases.json");
    let json: Value = serde_json::from_str(&text).expect("parse cases.json");
    json.as_array()
        .expect("a list of cases")
        .iter()
        .map(|c| {
            let attrs = Attrs(
                c["attrs"]
                    .as_object()
                    .expect("attrs")
                    .iter()
                    .map(|(k, v)| Attr {
                        name: k.clone(),
                        value: json_attr(v),
                        span: Span::default(),
                    })
                    .collect(),
            );
            GoldenCase {
                op: c["op"].as_str().expect("op").to_string(),
                note: c["note"].as_str().unwrap_or("").to_string(),
                attrs,
                inputs: c["inputs"]
                    .as_array()
                    .expect("inputs")
                    .iter()
                    .map(json_value)
                    .collect(),
                expected: json_value(&c["expected"]),
            }
        })
        .collect()
}
