//! Run-time values of the reference interpreter.
//!
//! Lists and trees are chains of reference-counted nodes; dropping a 100,000-element list the naive way
//! recurses once per node and overflows the stack, so [`AdtValue`], tuples and closures are torn down
//! iteratively (see the `Drop` impls).

use std::fmt;
use std::rc::Rc;
use tumble_tensor::Tensor;

/// The fields of a constructor value or the elements of a tuple. Two inline: a list cell, a tree
/// node and a `(h, c)` state are then one allocation each (the reference count with the fields),
/// where a `Vec` made two — the evaluator builds and frees one or more per recorded invocation.
pub type Fields = smallvec::SmallVec<[Value; 2]>;

/// A tensor the batching runtime has recorded but maybe not computed yet: output `output` of
/// dataflow node `node`. The reference backend never makes one.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct LazyRef {
    pub node: u32,
    pub output: u32,
}

#[derive(Clone)]
pub enum Value {
    Tensor(Tensor),
    Lazy(LazyRef),
    Tuple(Rc<TupleValue>),
    Adt(Rc<AdtValue>),
    Closure(Rc<Closure>),
}

pub struct TupleValue(pub Fields);

pub struct AdtValue {
    /// Index into [`crate::Program::ctors`].
    pub ctor: u32,
    pub fields: Fields,
}

pub enum Closure {
    Lambda {
        /// Index into [`crate::Program::lambdas`].
        lambda: u32,
        captured: Vec<Value>,
    },
    /// A global function used as a value.
    Global(u32),
    /// A constructor with fields used as a value (`@map(Some, %xs)`).
    Ctor(u32),
}

impl Value {
    pub fn unit() -> Value {
        Value::Tuple(Rc::new(TupleValue(Fields::new())))
    }

    pub fn tuple(vs: impl Into<Fields>) -> Value {
        Value::Tuple(Rc::new(TupleValue(vs.into())))
    }

    pub fn adt(ctor: u32, fields: impl Into<Fields>) -> Value {
        Value::Adt(Rc::new(AdtValue {
            ctor,
            fields: fields.into(),
        }))
    }

    pub fn as_tensor(&self) -> Option<&Tensor> {
        match self {
            Value::Tensor(t) => Some(t),
            _ => None,
        }
    }

    pub fn kind(&self) -> &'static str {
        match self {
            Value::Tensor(_) | Value::Lazy(_) => "a tensor",
            Value::Tuple(_) => "a tuple",
            Value::Adt(_) => "a constructor value",
            Value::Closure(_) => "a function",
        }
    }
}

/// Moves the children of a value being dropped onto `stack` when this is the last reference, so their
/// own drops find nothing left to recurse into.
fn take_children(v: Value, stack: &mut DropStack) {
    match v {
        Value::Tensor(_) | Value::Lazy(_) => {}
        // Moved one by one (the order of drops is unobservable): the lists are short (a cell's
        // two fields), where `append`'s bulk copy is a library call per node.
        Value::Tuple(rc) => {
            if let Ok(mut t) = Rc::try_unwrap(rc) {
                while let Some(v) = t.0.pop() {
                    stack.push(v);
                }
            }
        }
        Value::Adt(rc) => {
            if let Ok(mut a) = Rc::try_unwrap(rc) {
                while let Some(v) = a.fields.pop() {
                    stack.push(v);
                }
            }
        }
        Value::Closure(rc) => {
            if let Ok(mut c) = Rc::try_unwrap(rc) {
                c.move_captured_to(stack);
            }
        }
    }
}

/// The values waiting to be dropped: a tree or list being freed keeps a few (a cell's fields, a
/// node's children) at a time, so they stay on the machine stack; a wide node spills to the heap.
type DropStack = smallvec::SmallVec<[Value; 8]>;

fn drop_iteratively(children: &mut Vec<Value>) {
    if children.is_empty() {
        return;
    }
    let mut stack: DropStack = children.drain(..).collect();
    while let Some(v) = stack.pop() {
        take_children(v, &mut stack);
    }
}

/// Whether dropping `n` references to `v` may free a value with fields of its own (a tuple,
/// constructor value or closure), which is what can recurse.
fn may_free_children(v: &Value, n: usize) -> bool {
    match v {
        Value::Tensor(_) | Value::Lazy(_) => false,
        Value::Tuple(rc) => Rc::strong_count(rc) <= n,
        Value::Adt(rc) => Rc::strong_count(rc) <= n,
        Value::Closure(rc) => Rc::strong_count(rc) <= n,
    }
}

/// [`drop_iteratively`] for inline fields.
fn drop_fields(fields: &mut Fields) {
    // Fields that surely free no value with fields of its own — tensors, and cells held more
    // often than this value holds anything (most of a tree the program still reads) — drop
    // where they are, one level deep, even if several of them are one cell.
    let n = fields.len();
    if !fields.iter().any(|v| may_free_children(v, n)) {
        return;
    }
    let mut stack = DropStack::new();
    for v in fields.drain(..) {
        take_children(v, &mut stack);
    }
    while let Some(v) = stack.pop() {
        take_children(v, &mut stack);
    }
}

impl Drop for AdtValue {
    fn drop(&mut self) {
        drop_fields(&mut self.fields);
    }
}

impl Drop for TupleValue {
    fn drop(&mut self) {
        drop_fields(&mut self.0);
    }
}

impl Closure {
    fn move_captured_to(&mut self, stack: &mut DropStack) {
        if let Closure::Lambda { captured, .. } = self {
            stack.extend(captured.drain(..));
        }
    }
}

impl Drop for Closure {
    fn drop(&mut self) {
        if let Closure::Lambda { captured, .. } = self {
            drop_iteratively(captured);
        }
    }
}

impl fmt::Debug for Value {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Value::Tensor(t) => write!(f, "{t}"),
            Value::Lazy(r) => write!(f, "lazy %{}.{}", r.node, r.output),
            Value::Tuple(t) => write!(f, "tuple of {}", t.0.len()),
            Value::Adt(a) => write!(f, "ctor #{} with {} fields", a.ctor, a.fields.len()),
            Value::Closure(_) => f.write_str("closure"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn long_chains_drop_without_recursion_even_through_shared_cells() {
        // Each cell holds the one before it twice, so that cell's count is 2, both references
        // this cell's: dropping the cell frees it. A million deep: recursion would overflow the
        // test thread's stack.
        let mut v = Value::unit();
        for _ in 0..1_000_000 {
            v = Value::adt(0, [v.clone(), v]);
        }
        drop(v);
        // A list sharing its cells with another holder frees none of them.
        let mut list = Value::adt(1, Fields::new());
        for _ in 0..1_000_000 {
            list = Value::adt(0, [Value::unit(), list]);
        }
        let other = list.clone();
        drop(list);
        drop(other);
    }
}
