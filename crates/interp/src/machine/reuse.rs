//! Allocations the machine reuses: values that are the same every time the program makes them,
//! made once per machine, and the argument and slot vectors of finished calls, kept for the next.

use super::{Frame, Machine};
use crate::value::{Closure, Fields, Value};
use std::rc::Rc;

/// Emptied argument vectors the evaluator keeps for reuse, at most.
const VALS_POOL_MAX: usize = 256;

/// Field-less constructor values (`Nil`, `True`), `()` and globals used as values, each made on
/// first use and then shared: values are immutable, so handing out one `Rc` for all uses is
/// unobservable, where making each afresh was an allocation and a free (a list's `Nil`, every
/// `if`'s `True`/`False`, every empty tuple). `TUMBLE_NO_SHARED_VALUES=1` makes each afresh.
pub(super) struct SharedValues {
    pub(super) on: bool,
    unit: Option<Value>,
    /// By constructor index; `None` until first made.
    nullary: Vec<Option<Value>>,
    /// By global index.
    globals: Vec<Option<Value>>,
}

impl SharedValues {
    pub(super) fn new() -> Self {
        let off = tumble_limits::switch_on!("TUMBLE_NO_SHARED_VALUES");
        SharedValues {
            on: !off,
            unit: None,
            nullary: Vec::new(),
            globals: Vec::new(),
        }
    }

    pub(super) fn unit(&mut self) -> Value {
        if !self.on {
            return Value::unit();
        }
        self.unit.get_or_insert_with(Value::unit).clone()
    }

    /// Field-less constructor `c`.
    pub(super) fn nullary(&mut self, c: u32) -> Value {
        if !self.on {
            return Value::adt(c, Fields::new());
        }
        Self::cached(&mut self.nullary, c, || Value::adt(c, Fields::new()))
    }

    /// Global `g` as a function value.
    pub(super) fn global(&mut self, g: u32) -> Value {
        if !self.on {
            return Value::Closure(Rc::new(Closure::Global(g)));
        }
        Self::cached(&mut self.globals, g, || {
            Value::Closure(Rc::new(Closure::Global(g)))
        })
    }

    fn cached(table: &mut Vec<Option<Value>>, i: u32, make: impl FnOnce() -> Value) -> Value {
        let i = i as usize;
        if table.len() <= i {
            table.resize(i + 1, None);
        }
        match table.get_mut(i) {
            Some(v) => v.get_or_insert_with(make).clone(),
            None => make(),
        }
    }
}

impl<'p> Machine<'p> {
    /// An emptied vector from the pool (a new one when the pool is empty).
    #[inline]
    pub(super) fn pooled(&mut self) -> Vec<Value> {
        self.vals_pool.pop().unwrap_or_default()
    }

    /// A vector back to the pool, emptied (up to the pool's bound).
    #[inline]
    pub(super) fn give_back(&mut self, mut vals: Vec<Value>) {
        vals.clear();
        if self.vals_pool.len() < VALS_POOL_MAX {
            self.vals_pool.push(vals);
        }
    }

    /// A constructor's or tuple's fields from operand vector `vals`, which goes back to the pool.
    pub(super) fn fields_of(&mut self, mut vals: Vec<Value>) -> Fields {
        let fields = vals.drain(..).collect();
        self.give_back(vals);
        fields
    }

    /// Keeps a finished frame's slot vector for the next call (calls are the machine's most frequent
    /// allocation).
    pub(super) fn recycle(&mut self, frame: Frame) {
        let mut slots = frame.slots;
        slots.clear();
        if self.slot_pool.len() < 256 {
            self.slot_pool.push(slots);
        }
    }
}
