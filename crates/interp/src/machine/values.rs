//! What the machine does to values alone, without its state: list cells, tuple fields, pattern
//! tests, descriptions for error messages, and the conversion to and from operator values.

use super::RunError;
use crate::value::{Fields, Value};
use smallvec::smallvec;
use tumble_compile::{Pat, Program};
use tumble_ir::Span;
use tumble_ops::OpValue;
use tumble_tensor::Tensor;

/// The elements of list `v` (cells of constructor `cons`, ended by `nil`), first first; the kind
/// of the first value that is neither.
pub(super) fn list_items(v: &Value, cons: u32, nil: u32) -> Result<Vec<Value>, &'static str> {
    list_items_into(v, cons, nil, Vec::new())
}

/// [`list_items`] appended to `out` (an emptied vector from the pool), the cells walked by
/// reference.
pub(super) fn list_items_into(
    v: &Value,
    cons: u32,
    nil: u32,
    mut out: Vec<Value>,
) -> Result<Vec<Value>, &'static str> {
    let mut at = v;
    loop {
        match at {
            Value::Adt(a) if a.ctor == cons && a.fields.len() == 2 => {
                out.push(a.fields[0].clone());
                at = &a.fields[1];
            }
            Value::Adt(a) if a.ctor == nil => return Ok(out),
            other => return Err(other.kind()),
        }
    }
}

/// The list of `items` in order, ending in `tail`.
pub(super) fn list_of(items: Vec<Value>, tail: Value, cons: u32) -> Value {
    let mut items = items;
    list_of_drained(&mut items, tail, cons)
}

/// [`list_of`] taking the items out of `items`, which is left empty (for the pool).
pub(super) fn list_of_drained(items: &mut Vec<Value>, tail: Value, cons: u32) -> Value {
    items
        .drain(..)
        .rev()
        .fold(tail, |rest, x| Value::adt(cons, smallvec![x, rest]))
}

/// Field `i` of a tuple value.
pub(super) fn project(v: &Value, i: u32, span: Span) -> Result<Value, RunError> {
    match v {
        Value::Tuple(t) => {
            t.0.get(i as usize)
                .cloned()
                .ok_or_else(|| RunError::at(span, format!("tuple has no field {i}")))
        }
        other => Err(RunError::at(
            span,
            format!("cannot project field {i} of {}", other.kind()),
        )),
    }
}

/// Tests `v` against `pat`, collecting the slots to bind. Pattern depth is bounded by the parser.
pub(super) fn matches(pat: &Pat, v: &Value, binds: &mut Vec<(u32, Value)>) -> bool {
    match (pat, v) {
        (Pat::Wild, _) => true,
        (Pat::Bind(s), _) => {
            binds.push((*s, v.clone()));
            true
        }
        (Pat::Ctor(c, ps), Value::Adt(a)) => {
            a.ctor == *c
                && ps.len() == a.fields.len()
                && ps.iter().zip(&a.fields).all(|(p, f)| matches(p, f, binds))
        }
        (Pat::Tuple(ps), Value::Tuple(t)) => {
            ps.len() == t.0.len() && ps.iter().zip(&t.0).all(|(p, f)| matches(p, f, binds))
        }
        _ => false,
    }
}

/// A short description of a value for error messages: the constructor name, or the tensor's type.
pub(super) fn describe(program: &Program, v: &Value) -> String {
    match v {
        Value::Adt(a) => program.ctors.get(a.ctor as usize).map_or_else(
            || "a constructor value".into(),
            |c| format!("`{}(..)`", c.name),
        ),
        Value::Tensor(t) => format!("{t}"),
        other => other.kind().to_string(),
    }
}

pub fn to_op_value(v: Value) -> Result<OpValue, String> {
    match v {
        Value::Tensor(t) => Ok(OpValue::Tensor(t)),
        Value::Tuple(t) => {
            t.0.iter()
                .map(|f| match f {
                    Value::Tensor(t) => Ok(t.clone()),
                    other => Err(format!(
                        "expected a tuple of tensors, found {} in it",
                        other.kind()
                    )),
                })
                .collect::<Result<Vec<Tensor>, String>>()
                .map(OpValue::Tuple)
        }
        other => Err(format!("expected a tensor, found {}", other.kind())),
    }
}

pub fn from_op_value(v: OpValue) -> Value {
    match v {
        OpValue::Tensor(t) => Value::Tensor(t),
        OpValue::Tuple(ts) => Value::tuple(ts.into_iter().map(Value::Tensor).collect::<Fields>()),
    }
}
