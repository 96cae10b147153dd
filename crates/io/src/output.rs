//! Results out: a [`Value`] encoded by its type as JSON, a short human summary, and atomic
//! JSON Lines files.
//!
//! # Encoding
//!
//! - tensors: plain nested arrays (a rank-0 tensor is a bare number); floats are printed in the
//!   shortest form that reads back to the same value (`0.1`, `1.0`, `1e-7`); **NaN and
//!   infinities are written as `null`** (JSON has no such numbers) and counted in
//!   [`Encoded::non_finite`], so the caller can warn; bools as `true`/`false`;
//! - tuples: arrays; `List[T]`: arrays; other ADTs: `{"Ctor": [fields...]}` (zero-field
//!   constructors as `{"Nil": []}`) — the same forms the instance reader accepts;
//! - functions cannot be encoded (an error).
//!
//! Encoding uses an explicit work stack, never native recursion per value level, so results
//! of any depth (long lists, deep generated trees) are safe on any thread.

use std::fmt::Write as _;
use std::io::Write as _;
use std::path::Path;

use tumble_interp::Value;
use tumble_ir::Ty;
use tumble_tensor::shape::format_shape;
use tumble_tensor::{Buffer, Tensor};

use crate::atomic::{stage, Staged};
use crate::env::TypeEnv;
use crate::IoError;

/// A result encoded as one line of JSON.
#[derive(Clone, Debug, PartialEq)]
pub struct Encoded {
    pub json: String,
    /// How many NaN/infinite elements were written as `null`.
    pub non_finite: usize,
}

impl Encoded {
    /// A warning to show when the result had NaN/infinite values (`None` otherwise).
    pub fn warning(&self) -> Option<String> {
        (self.non_finite > 0).then(|| {
            format!(
                "the result has {} NaN or infinite value{}, written as null",
                self.non_finite,
                if self.non_finite == 1 { "" } else { "s" }
            )
        })
    }
}

enum Task<'v> {
    Value(&'v Value, Ty),
    Lit(&'static str),
    /// The rest of a list being written; `first` when no element was written yet.
    List {
        node: &'v Value,
        elem: Ty,
        first: bool,
    },
}

fn mismatch(v: &Value, ty: &Ty) -> IoError {
    IoError::output(format!(
        "internal: the result holds {} where its type says {ty}",
        v.kind()
    ))
}

/// Why tensor `t` cannot be a result of type `ty` (a tensor type): another dtype or rank. The
/// runtime never makes such a result from a well-formed program; a compiled file altered to read
/// another value could, and it is an error instead of numbers of another type written as if
/// they were the declared ones. (Sizes are not compared: under gradual shapes a `?`-sized value
/// may reach a declared size, and `tumble run` writes what was computed.)
pub(crate) fn tensor_mismatch(t: &tumble_tensor::Tensor, ty: &Ty) -> Option<String> {
    let Ty::Tensor { shape, dtype } = ty else {
        return None;
    };
    let fits = t.dtype() == *dtype && t.shape().len() == shape.len();
    (!fits).then(|| {
        format!(
            "internal: the result holds a tensor of dtype {} and shape {:?} where its type says {ty}",
            t.dtype(),
            t.shape()
        )
    })
}

/// Encodes `value`, of type `ty` (`@main`'s return type), as one line of JSON (see the module
/// docs for the format).
pub fn encode_json(value: &Value, ty: &Ty, env: &TypeEnv) -> Result<Encoded, IoError> {
    let mut out = Encoded {
        json: String::new(),
        non_finite: 0,
    };
    let mut stack = vec![Task::Value(value, ty.clone())];
    while let Some(task) = stack.pop() {
        // A result whose parts are shared (a tree holding one subtree twice, n levels deep) is
        // small in memory but 2^n in JSON: before the text doubles, the doubling is checked
        // against the memory budget (it grew until the allocator aborted the process, and a
        // server with it).
        if out.json.capacity() - out.json.len() < 64 {
            let more = out.json.capacity().max(64);
            tumble_limits::reserve(more).map_err(|stop| {
                IoError::output(format!(
                    "its JSON text would pass {}: {stop}",
                    tumble_limits::bytes_text(out.json.len())
                ))
            })?;
            out.json.reserve(more);
        }
        match task {
            Task::Lit(s) => out.json.push_str(s),
            Task::List { node, elem, first } => {
                let Value::Adt(a) = node else {
                    return Err(mismatch(node, &elem));
                };
                match a.fields.as_slice() {
                    [] => out.json.push(']'),
                    [head, rest] => {
                        if !first {
                            out.json.push(',');
                        }
                        stack.push(Task::List {
                            node: rest,
                            elem: elem.clone(),
                            first: false,
                        });
                        stack.push(Task::Value(head, elem));
                    }
                    _ => return Err(mismatch(node, &elem)),
                }
            }
            Task::Value(v, ty) => match (&ty, v) {
                (Ty::Tensor { .. }, Value::Tensor(t)) => {
                    if let Some(m) = tensor_mismatch(t, &ty) {
                        return Err(IoError::output(m));
                    }
                    write_tensor(&mut out, t)
                }
                (Ty::Tuple(ts), Value::Tuple(tv)) if ts.len() == tv.0.len() => {
                    out.json.push('[');
                    stack.push(Task::Lit("]"));
                    push_fields(&mut stack, &tv.0, ts);
                }
                (Ty::Adt(name, args), Value::Adt(a)) => {
                    if let Some(elem) = env.list_elem(&ty) {
                        out.json.push('[');
                        stack.push(Task::List {
                            node: v,
                            elem: elem.clone(),
                            first: true,
                        });
                        continue;
                    }
                    let c = env
                        .ctor_by_index(name, args, a.ctor)
                        .filter(|c| c.fields.len() == a.fields.len())
                        .ok_or_else(|| mismatch(v, &ty))?;
                    out.json.push_str("{\"");
                    out.json.push_str(&c.name);
                    out.json.push_str("\":[");
                    stack.push(Task::Lit("]}"));
                    push_fields(&mut stack, &a.fields, &c.fields);
                }
                (_, Value::Closure(_)) | (Ty::Func(..), _) => {
                    return Err(IoError::output(format!(
                        "it contains a function ({ty}), which has no JSON form; return data \
                         (tensors, tuples, lists, constructors) from @main"
                    )))
                }
                _ => return Err(mismatch(v, &ty)),
            },
        }
    }
    Ok(out)
}

/// Pushes `values` (typed `tys`) so they are written in order, comma-separated.
fn push_fields<'v>(stack: &mut Vec<Task<'v>>, values: &'v [Value], tys: &[Ty]) {
    for (i, (v, t)) in values.iter().zip(tys).enumerate().rev() {
        stack.push(Task::Value(v, t.clone()));
        if i > 0 {
            stack.push(Task::Lit(","));
        }
    }
}

fn write_tensor(out: &mut Encoded, t: &Tensor) {
    let elem = |json: &mut String, i: usize| match t.buffer() {
        Buffer::F32(v) => out_non_finite(json, f64::from(v[i]), |s| {
            let _ = write!(s, "{:?}", v[i]);
        }),
        Buffer::F64(v) => out_non_finite(json, v[i], |s| {
            let _ = write!(s, "{:?}", v[i]);
        }),
        Buffer::I32(v) => {
            let _ = write!(json, "{}", v[i]);
            0
        }
        Buffer::I64(v) => {
            let _ = write!(json, "{}", v[i]);
            0
        }
        Buffer::Bool(v) => {
            json.push_str(if v[i] { "true" } else { "false" });
            0
        }
    };
    let shape = t.shape();
    if shape.is_empty() {
        out.non_finite += elem(&mut out.json, 0);
        return;
    }
    // Walk the elements in row-major order, opening and closing one bracket per dim that
    // starts or ends at each element (an odometer; no recursion).
    if t.is_empty() {
        write_empty(&mut out.json, shape);
        return;
    }
    let rank = shape.len();
    let mut idx = vec![0usize; rank];
    for _ in 0..rank {
        out.json.push('[');
    }
    let n = t.len();
    for flat in 0..n {
        out.non_finite += elem(&mut out.json, flat);
        // Advance the odometer; count how many trailing dims wrapped.
        let mut wrapped = 0;
        for axis in (0..rank).rev() {
            idx[axis] += 1;
            if idx[axis] < shape[axis] {
                break;
            }
            idx[axis] = 0;
            wrapped += 1;
        }
        for _ in 0..wrapped {
            out.json.push(']');
        }
        if flat + 1 < n {
            out.json.push(',');
            for _ in 0..wrapped {
                out.json.push('[');
            }
        }
    }
}

/// A tensor with no elements: `[]` for a 0 leading dim, `[[], []]` for shape (2, 0), ...
fn write_empty(json: &mut String, shape: &[usize]) {
    match shape.split_first() {
        None => json.push_str("null"),
        Some((&d, rest)) => {
            json.push('[');
            if !rest.is_empty() {
                for i in 0..d {
                    if i > 0 {
                        json.push(',');
                    }
                    write_empty(json, rest);
                }
            }
            json.push(']');
        }
    }
}

/// Writes a float via `finite`, or `null` for NaN/inf; returns 1 for the latter.
fn out_non_finite(json: &mut String, x: f64, finite: impl FnOnce(&mut String)) -> usize {
    if x.is_finite() {
        finite(json);
        0
    } else {
        json.push_str("null");
        1
    }
}

// ---------------------------------------------------------------------------------------------
// Summary

/// How many values of each tensor a summary shows.
const SUMMARY_VALUES: usize = 6;
/// How many elements of a list a summary shows.
const SUMMARY_ITEMS: usize = 3;
/// How deep a summary descends into nested values before writing `…`.
const SUMMARY_DEPTH: usize = 6;

/// A short human-readable description of a result (`--format summary`): shapes, dtypes and the
/// first few values of each tensor, list lengths, constructor names. Bounded in size and depth,
/// whatever the value.
pub fn summarize(value: &Value, ty: &Ty, env: &TypeEnv) -> String {
    let mut s = String::new();
    summary(&mut s, value, ty, env, 0);
    s
}

fn summary(s: &mut String, v: &Value, ty: &Ty, env: &TypeEnv, depth: usize) {
    if depth > SUMMARY_DEPTH {
        s.push('…');
        return;
    }
    match (ty, v) {
        (_, Value::Tensor(t)) => summarize_tensor(s, t),
        (Ty::Tuple(ts), Value::Tuple(tv)) => {
            s.push('(');
            for (i, (x, t)) in tv.0.iter().zip(ts).enumerate() {
                if i > 0 {
                    s.push_str(", ");
                }
                summary(s, x, t, env, depth + 1);
            }
            s.push(')');
        }
        (Ty::Adt(name, args), Value::Adt(a)) => {
            if let Some(elem) = env.list_elem(ty) {
                // Count iteratively; show the first few.
                let mut items = Vec::new();
                let mut node = v;
                let mut len = 0usize;
                while let Value::Adt(n) = node {
                    match n.fields.as_slice() {
                        [head, rest] => {
                            if items.len() < SUMMARY_ITEMS {
                                items.push(head);
                            }
                            len += 1;
                            node = rest;
                        }
                        _ => break,
                    }
                }
                let _ = write!(s, "list of {len} [");
                for (i, x) in items.iter().enumerate() {
                    if i > 0 {
                        s.push_str(", ");
                    }
                    summary(s, x, elem, env, depth + 1);
                }
                if len > items.len() {
                    s.push_str(", …");
                }
                s.push(']');
                return;
            }
            match env.ctor_by_index(name, args, a.ctor) {
                Some(c) => {
                    s.push_str(&c.name);
                    if !a.fields.is_empty() {
                        s.push('(');
                        for (i, (x, t)) in a.fields.iter().zip(&c.fields).enumerate() {
                            if i > 0 {
                                s.push_str(", ");
                            }
                            summary(s, x, t, env, depth + 1);
                        }
                        s.push(')');
                    }
                }
                None => {
                    let _ = write!(s, "<constructor #{}>", a.ctor);
                }
            }
        }
        (_, Value::Closure(_)) => s.push_str("<function>"),
        (_, other) => {
            let _ = write!(s, "<{} of type {ty}>", other.kind());
        }
    }
}

fn summarize_tensor(s: &mut String, t: &Tensor) {
    let _ = write!(s, "{} {}", t.dtype(), format_shape(t.shape()));
    let n = t.len();
    if t.rank() == 0 {
        s.push(' ');
        push_elem(s, t, 0);
        return;
    }
    s.push_str(" [");
    for i in 0..n.min(SUMMARY_VALUES) {
        if i > 0 {
            s.push_str(", ");
        }
        push_elem(s, t, i);
    }
    if n > SUMMARY_VALUES {
        let _ = write!(s, ", … ({n} values)");
    }
    s.push(']');
}

fn push_elem(s: &mut String, t: &Tensor, i: usize) {
    let _ = match t.buffer() {
        Buffer::F32(v) => write!(s, "{:.4}", v[i]),
        Buffer::F64(v) => write!(s, "{:.4}", v[i]),
        Buffer::I32(v) => write!(s, "{}", v[i]),
        Buffer::I64(v) => write!(s, "{}", v[i]),
        Buffer::Bool(v) => write!(s, "{}", v[i]),
    };
}

// ---------------------------------------------------------------------------------------------
// Files

/// Writes `lines` to `path` as JSON Lines, atomically: into a temporary file in the same
/// directory, fsynced, then renamed over `path`. If any line is an `Err` (e.g. an instance whose
/// result cannot be encoded) or the file system fails, that error is returned, the temporary
/// file is removed and `path` is untouched — never half-written. Returns the number of lines.
pub fn write_jsonl_atomically<I, S>(path: &Path, lines: I) -> Result<usize, IoError>
where
    I: IntoIterator<Item = Result<S, IoError>>,
    S: AsRef<str>,
{
    let (staged, count) = stage_jsonl(path, lines)?;
    staged.commit()?;
    Ok(count)
}

/// [`write_jsonl_atomically`] up to moving the file into place ([`Staged::commit`]), with the
/// number of lines.
pub fn stage_jsonl<I, S>(path: &Path, lines: I) -> Result<(Staged, usize), IoError>
where
    I: IntoIterator<Item = Result<S, IoError>>,
    S: AsRef<str>,
{
    let mut count = 0;
    let staged = stage(path, "the output file", |w| {
        for line in lines {
            let line = line?;
            let line = line.as_ref();
            if line.contains('\n') {
                return Err(IoError::output(format!(
                    "internal: output line {} contains a newline, which would break JSON Lines",
                    count + 1
                )));
            }
            w.write_all(line.as_bytes())
                .and_then(|()| w.write_all(b"\n"))
                .map_err(|e| IoError::file(path, "write the output file", e))?;
            count += 1;
        }
        Ok(())
    })?;
    Ok((staged, count))
}
