//! Shared helpers: tiny checked modules and value inspection.
#![allow(dead_code)]

use tumble_check::{load, LoadOptions, TypedModule};
use tumble_interp::{Program, Value};
use tumble_io::TypeEnv;
use tumble_ir::{SourceMap, Ty};
use tumble_tensor::Tensor;

pub struct Module {
    pub typed: TypedModule,
    pub program: Program,
}

impl Module {
    pub fn env(&self) -> TypeEnv<'_> {
        TypeEnv::new(&self.typed, &self.program)
    }

    pub fn main(&self) -> (Vec<(String, Ty)>, Ty) {
        tumble_io::main_signature(&self.typed, "main").expect("main signature")
    }

    pub fn ctor(&self, name: &str) -> u32 {
        self.program.ctor_index[name]
    }
}

pub fn module(src: &str) -> Module {
    let mut sources = SourceMap::new();
    let typed = match load(&mut sources, "t.rly", src, LoadOptions::default()) {
        Ok(t) => t,
        Err(ds) => panic!("{}", tumble_ir::diag::render(&ds, &sources, false)),
    };
    let program = match Program::lower(&typed) {
        Ok(p) => p,
        Err(e) => panic!("lowering failed: {}", e.message),
    };
    Module { typed, program }
}

pub fn tensor(v: &Value) -> &Tensor {
    match v {
        Value::Tensor(t) => t,
        other => panic!("expected a tensor, got {other:?}"),
    }
}

/// The elements of a `List` value, walked iteratively.
pub fn list_items(v: &Value) -> Vec<Value> {
    let mut out = Vec::new();
    let mut node = v.clone();
    loop {
        let next = match &node {
            Value::Adt(a) if a.fields.len() == 2 => {
                out.push(a.fields[0].clone());
                a.fields[1].clone()
            }
            Value::Adt(_) => return out,
            other => panic!("not a list: {other:?}"),
        };
        node = next;
    }
}

/// Runs `f` on a thread with a 64 MiB stack (for deeply nested inputs).
pub fn with_big_stack<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
    std::thread::Builder::new()
        .stack_size(64 << 20)
        .spawn(f)
        .expect("spawn")
        .join()
        .expect("thread panicked")
}
