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
    let shape = t.shape();
    let Some((&inner, outer)) = shape.split_last() else {
        write_elements(out, t.buffer(), 0..1);
        return;
    };
    if t.is_empty() {
        write_empty(&mut out.json, shape);
        return;
    }
    // Row by row (the last dim's elements written in one loop per element type), opening and
    // closing one bracket per outer dim that starts or ends between two rows (an odometer over
    // the outer dims; no recursion).
    let rows = t.len() / inner;
    let mut idx = vec![0usize; outer.len()];
    for _ in 0..shape.len() {
        out.json.push('[');
    }
    for row in 0..rows {
        write_elements(out, t.buffer(), row * inner..(row + 1) * inner);
        out.json.push(']');
        let mut wrapped = 0;
        for (i, &d) in idx.iter_mut().zip(outer).rev() {
            *i += 1;
            if *i < d {
                break;
            }
            *i = 0;
            wrapped += 1;
        }
        for _ in 0..wrapped {
            out.json.push(']');
        }
        if row + 1 < rows {
            out.json.push(',');
            for _ in 0..=wrapped {
                out.json.push('[');
            }
        }
    }
}

/// The elements `range` of `buffer`, comma-separated; a NaN or infinity as `null`, counted.
fn write_elements(out: &mut Encoded, buffer: &Buffer, range: std::ops::Range<usize>) {
    fn each<T: Copy>(
        json: &mut String,
        values: &[T],
        range: std::ops::Range<usize>,
        mut write: impl FnMut(&mut String, T),
    ) {
        for (k, &x) in values.get(range).unwrap_or_default().iter().enumerate() {
            if k > 0 {
                json.push(',');
            }
            write(json, x);
        }
    }
    let json = &mut out.json;
    let non_finite = &mut out.non_finite;
    match buffer {
        Buffer::F32(v) => each(json, v, range, |s, x| {
            *non_finite += out_non_finite(s, f64::from(x), |s| write_f32(s, x));
        }),
        Buffer::F64(v) => each(json, v, range, |s, x| {
            *non_finite += out_non_finite(s, x, |s| {
                let _ = write!(s, "{x:?}");
            });
        }),
        Buffer::I32(v) => each(json, v, range, |s, x| {
            let _ = write!(s, "{x}");
        }),
        Buffer::I64(v) => each(json, v, range, |s, x| {
            let _ = write!(s, "{x}");
        }),
        Buffer::Bool(v) => each(json, v, range, |s, x| {
            s.push_str(if x { "true" } else { "false" });
        }),
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

/// `x` as `{:?}` writes it (the shortest text that reads back as `x`), by `zmij` (a third the
/// time: 32,768 floats of NestedRNN-small's outputs took 2.3 ms) where its text is the same
/// bytes: both write the shortest digits closest to `x`, in plain decimal for 1e-4 ≤ |x| < 1e13,
/// and differ only where two shortest texts are equally close (`1.06640625`: std writes
/// `1.0664063`, `zmij` `1.0664062`). A tie needs `x`'s exact decimal expansion to be one digit
/// longer than the shortest text, so at most 10 significant digits; the others
/// ([`zmij_writes_as_std`]) go to std.
fn write_f32(json: &mut String, x: f32) {
    if zmij_writes_as_std(x) {
        json.push_str(zmij::Buffer::new().format_finite(x));
    } else {
        let _ = write!(json, "{x:?}");
    }
}

/// Whether `zmij`'s text of finite `x` is std's `{:?}` (see [`write_f32`]): in the range where
/// both write plain decimal, and with an exact decimal expansion of 11 or more significant
/// digits. (Every positive f32 in [1e-4, 1e13) was compared once: no difference where this
/// holds; it holds for about three in five below 1,000.)
fn zmij_writes_as_std(x: f32) -> bool {
    let a = x.abs();
    if !(1e-4..1e13).contains(&a) || !fast_float_text() {
        return false;
    }
    // `a` is normal here: `(1 << 23 | fraction) · 2^(exponent - 150)`. With the significand's
    // trailing zeros shifted out, the binary digits after the point are the power's negation,
    // and the exact decimal expansion has as many digits after the point (the last one a 5).
    let bits = a.to_bits();
    let exponent = ((bits >> 23) & 0xff) as i32;
    let significand = (bits & 0x7f_ffff) | 0x80_0000;
    let after_point = 150 - exponent - significand.trailing_zeros() as i32;
    if after_point <= 0 {
        return false;
    }
    // Its significant digits: the integer part's and those after the point, or those after the
    // point less the leading zeros (compared in f64, where 0.01 is above the decimal 0.01).
    let significant = if a >= 1.0 {
        let integer_digits = (a as u64).checked_ilog10().map_or(0, |d| d as i32 + 1);
        after_point + integer_digits
    } else {
        let a = f64::from(a);
        let zeros = [0.1, 0.01, 0.001].iter().filter(|&&p| a < p).count() as i32;
        after_point - zeros
    };
    significant >= 11
}

/// `TUMBLE_NO_FAST_FLOAT_TEXT=1`: every float written by std's formatting (the A/B switch; the
/// text is the same).
fn fast_float_text() -> bool {
    !tumble_limits::switch_on!("TUMBLE_NO_FAST_FLOAT_TEXT")
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

#[cfg(test)]
mod tests {
    use super::write_f32;

    fn std_text(x: f32) -> String {
        format!("{x:?}")
    }

    /// Every positive f32 in [1e-4, 1e13) that takes the fast path, against std (and every
    /// negative one is its mirror): about 2.6e8 values, 33 s in a release build —
    /// `cargo test --release -p tumble-io --lib -- --ignored float_text_of_every_fast_f32`.
    #[test]
    #[ignore]
    fn float_text_of_every_fast_f32() {
        let (lo, hi) = (1e-4f32.to_bits(), 1e13f32.to_bits());
        let (mut checked, mut text) = (0u64, String::new());
        for bits in lo..hi {
            let x = f32::from_bits(bits);
            if super::zmij_writes_as_std(x) {
                text.clear();
                write_f32(&mut text, x);
                assert_eq!(text, std_text(x), "bits {bits:#x}");
                checked += 1;
            }
        }
        assert!(checked > 200_000_000, "{checked}");
    }

    /// The fast float text is std's, byte for byte: on the ties std and `zmij` break
    /// differently, on the edges of the range, and on a spread of bit patterns over every
    /// decade (the whole range, every positive f32 in [1e-4, 1e13), was compared once outside
    /// the tests: no difference).
    #[test]
    fn float_text_is_std_text() {
        let mut special = vec![
            0.0f32,
            -0.0,
            1.0,
            -1.0,
            0.5,
            100.0,
            1e-4,
            9.999999e-5,
            1e-5,
            1e-6,
            1e-7,
            1e7,
            1e12,
            9.999999e12,
            1e13,
            1e16,
            16777216.0,
            0.1,
            0.2,
            0.3,
            1.0664062,
            f32::MIN_POSITIVE,
            f32::MAX,
            f32::EPSILON,
            3.4028235e38,
            1.4e-45,
        ];
        // Ties of the last digit (exact in f64, so written there).
        special.extend(
            [
                1.066_406_25f64,
                17.476_562_5,
                128.578_125,
                1_048_591.25,
                131_126.625,
            ]
            .map(|x| x as f32),
        );
        // A linear congruential walk over the bit patterns of [1e-4, 1e13), both signs.
        let (lo, hi) = (1e-4f32.to_bits() as u64, 1e13f32.to_bits() as u64);
        let mut state = 0x2545_f491_4f6c_dd1du64;
        for _ in 0..200_000 {
            state = state
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            let bits = lo + (state >> 11) % (hi - lo);
            let x = f32::from_bits(bits as u32);
            special.push(if state & 1 == 0 { x } else { -x });
        }
        for x in special {
            let mut got = String::new();
            write_f32(&mut got, x);
            assert_eq!(got, std_text(x), "bits {:#x}", x.to_bits());
        }
    }
}
