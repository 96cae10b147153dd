//! Decoding an instance by `@main`'s declared argument types, from any document model.
//!
//! The decoder walks a [`Doc`]: parsed JSON (`&serde_json::Value`, the CLI's and the server's
//! instances), or a face's own objects (the Python package's lists, dicts and numpy arrays), so
//! that a face need not spell its values out as JSON first. Every error carries the path inside
//! the instance (`.tree.Rose[0]`) and says what was expected and what was found.
//!
//! Nesting is bounded by [`MAX_DEPTH`] path steps; the walk recurses natively (a few hundred
//! bytes per level), so call it from a thread with a large stack.

use std::borrow::Cow;
use std::rc::Rc;

use smallvec::SmallVec;

use serde_json::Value as Json;
use tumble_interp::{Fields, Value};
use tumble_ir::{DType, Dim, Ty};
use tumble_tensor::shape::format_shape;
use tumble_tensor::{Buffer, Tensor};

use crate::env::{CtorRef, TypeEnv};
use crate::instances::{ATTACHED_TENSOR_KEY, MAX_DEPTH};

/// What a document node is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Null,
    Bool,
    Number,
    String,
    /// A sequence: [`Doc::array_len`] elements, read by [`Doc::item`].
    Array,
    /// String keys to values: [`Doc::keys`], [`Doc::get`].
    Object,
    /// A tensor the document holds already (a numpy array): [`Doc::tensor`].
    Tensor,
}

/// A number as the document holds it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Num {
    Int(i64),
    /// An integer above `i64::MAX`.
    UInt(u64),
    Float(f64),
}

/// A node of a document the decoder can read. Handles are cheap to make (a reference, a
/// reference-counted object). A method asked of a node of another kind returns `None` (or 0).
pub trait Doc: Sized {
    /// The node's kind, or — as a whole message — why the node is not a value an instance can
    /// hold at all (e.g. a Python object of an unsupported type).
    fn kind(&self) -> Result<Kind, String>;
    fn as_bool(&self) -> Option<bool>;
    fn as_number(&self) -> Option<Num>;
    fn as_str(&self) -> Option<Cow<'_, str>>;
    /// Elements of an array.
    fn array_len(&self) -> usize;
    fn item(&self, i: usize) -> Option<Self>;
    /// Keys of an object, in order (for messages and the unknown-key check).
    fn keys(&self) -> Vec<String>;
    fn get(&self, key: &str) -> Option<Self>;
    /// The only entry of an object that has exactly one (a constructor: `{"Leaf": [...]}`).
    fn single_entry(&self) -> Option<(Cow<'_, str>, Self)>;
    /// The tensor of a [`Kind::Tensor`] node (its dtype as it is: the decoder checks it).
    fn tensor(&self) -> Option<Result<Tensor, String>>;
    /// A short description for "found …" messages: "the number 2.5", "an array of 3 elements".
    fn describe(&self) -> String;
}

/// Where a decoding failed and why.
#[derive(Debug)]
pub struct DecodeError {
    /// The path inside the instance, like `.tree.Rose[0]` (empty: the instance itself).
    pub path: String,
    pub message: String,
}

/// Decodes one instance `doc` against `args` (the arguments the instances provide, with their
/// declared types, in order); `attached` are the tensors its `{ATTACHED_TENSOR_KEY: i}` objects
/// refer to. The values come in `args` order.
pub fn decode_instance<D: Doc>(
    doc: &D,
    attached: &[Tensor],
    env: &TypeEnv,
    args: &[(String, Ty)],
) -> Result<Vec<Value>, DecodeError> {
    let mut d = Decoder {
        env,
        path: Vec::new(),
        attached,
        ctors: Vec::new(),
    };
    d.instance(doc, args)
}

// ---------------------------------------------------------------------------------------------
// JSON

impl Doc for &Json {
    fn kind(&self) -> Result<Kind, String> {
        Ok(match self {
            Json::Null => Kind::Null,
            Json::Bool(_) => Kind::Bool,
            Json::Number(_) => Kind::Number,
            Json::String(_) => Kind::String,
            Json::Array(_) => Kind::Array,
            Json::Object(_) => Kind::Object,
        })
    }

    fn as_bool(&self) -> Option<bool> {
        Json::as_bool(self)
    }

    fn as_number(&self) -> Option<Num> {
        let Json::Number(n) = self else { return None };
        Some(if let Some(i) = n.as_i64() {
            Num::Int(i)
        } else if let Some(u) = n.as_u64() {
            Num::UInt(u)
        } else {
            Num::Float(n.as_f64()?)
        })
    }

    fn as_str(&self) -> Option<Cow<'_, str>> {
        Json::as_str(self).map(Cow::Borrowed)
    }

    fn array_len(&self) -> usize {
        self.as_array().map_or(0, Vec::len)
    }

    fn item(&self, i: usize) -> Option<Self> {
        self.as_array()?.get(i)
    }

    fn keys(&self) -> Vec<String> {
        self.as_object()
            .map_or_else(Vec::new, |m| m.keys().cloned().collect())
    }

    fn get(&self, key: &str) -> Option<Self> {
        self.as_object()?.get(key)
    }

    fn single_entry(&self) -> Option<(Cow<'_, str>, Self)> {
        let m = self.as_object()?;
        if m.len() != 1 {
            return None;
        }
        m.iter().next().map(|(k, v)| (Cow::Borrowed(k.as_str()), v))
    }

    fn tensor(&self) -> Option<Result<Tensor, String>> {
        None
    }

    fn describe(&self) -> String {
        describe(self)
    }
}

/// A short description of a JSON value for "found ..." messages.
pub(crate) fn describe(v: &Json) -> String {
    match v {
        Json::Null => "null".into(),
        Json::Bool(b) => format!("the boolean {b}"),
        Json::Number(n) => format!("the number {n}"),
        Json::String(s) => format!("the string {:?}", shorten(s, 40)),
        Json::Array(a) => array_text(a.len()),
        Json::Object(m) => {
            if m.len() == 1 && m.contains_key(ATTACHED_TENSOR_KEY) {
                "an n-dimensional array".into()
            } else {
                object_text(m.keys().map(String::as_str))
            }
        }
    }
}

/// `s` cut to `n` characters, with `…` when cut.
pub fn shorten(s: &str, n: usize) -> String {
    let mut short: String = s.chars().take(n).collect();
    if short.len() < s.len() {
        short.push('…');
    }
    short
}

/// "an empty array", "an array of 3 elements".
pub fn array_text(n: usize) -> String {
    match n {
        0 => "an empty array".into(),
        1 => "an array of 1 element".into(),
        n => format!("an array of {n} elements"),
    }
}

/// "an empty object", "an object with keys a, b".
pub fn object_text<'k>(keys: impl Iterator<Item = &'k str>) -> String {
    let keys: Vec<&str> = keys.take(20).collect();
    if keys.is_empty() {
        "an empty object".into()
    } else {
        format!("an object with keys {}", keys.join(", "))
    }
}

fn elements(n: usize) -> String {
    if n == 1 {
        "1 element".into()
    } else {
        format!("{n} elements")
    }
}

// ---------------------------------------------------------------------------------------------
// The decoder

/// A step of the path inside an instance.
enum Seg<'a> {
    Field(Cow<'a, str>),
    /// Inside a constructor's fields (its name, from [`Decoder::ctors`]).
    Ctor(Rc<CtorRef>),
    Index(usize),
}

struct Decoder<'a, 'e> {
    env: &'a TypeEnv<'e>,
    path: Vec<Seg<'a>>,
    /// The instance's attached tensors ([`crate::RawInstance::with_tensors`]).
    attached: &'a [Tensor],
    /// Constructors instantiated so far, with the ADT and type arguments they were instantiated
    /// at: an instance names the same few thousands of times (every node of a tree), and
    /// instantiating one builds its name and its field types anew.
    ctors: Vec<(Rc<CtorRef>, String, Vec<Ty>)>,
}

/// A dimension's size when the type states it.
fn known_extent(d: &Dim) -> Option<usize> {
    d.known().and_then(|n| usize::try_from(n).ok())
}

/// Elements reserved up front for a tensor of fully known shape, at most: a larger one grows as it
/// is read (a wrong count is reported, not allocated for).
const MAX_PRESIZED: usize = 1 << 16;

impl<'a> Decoder<'a, '_> {
    fn err<T>(&self, message: String) -> Result<T, DecodeError> {
        let mut path = String::new();
        // A path thousands of steps deep (an instance nested past the depth limit) is shown by
        // its ends: the message was 60 KB of `.Rose[1][0]`.
        const ENDS: usize = 24;
        let steps = self.path.len();
        for (i, s) in self.path.iter().enumerate() {
            if steps > 3 * ENDS && (ENDS..steps - ENDS).contains(&i) {
                if i == ENDS {
                    path.push_str(&format!("…({} steps)…", steps - 2 * ENDS));
                }
                continue;
            }
            match s {
                Seg::Field(n) => {
                    path.push('.');
                    path.push_str(n);
                }
                Seg::Ctor(c) => {
                    path.push('.');
                    path.push_str(&c.name);
                }
                Seg::Index(i) => path.push_str(&format!("[{i}]")),
            }
        }
        Err(DecodeError { path, message })
    }

    /// Enters path step `seg` (refusing to nest deeper than [`MAX_DEPTH`]); leave with `pop`.
    fn enter(&mut self, seg: Seg<'a>) -> Result<(), DecodeError> {
        self.path.push(seg);
        if self.path.len() > MAX_DEPTH {
            return self.err(format!(
                "nests deeper than {MAX_DEPTH} levels; tumble does not read inputs that deep"
            ));
        }
        Ok(())
    }

    fn pop(&mut self) {
        self.path.pop();
    }

    fn kind<D: Doc>(&self, d: &D) -> Result<Kind, DecodeError> {
        d.kind().or_else(|m| self.err(m))
    }

    fn instance<D: Doc>(
        &mut self,
        doc: &D,
        args: &'a [(String, Ty)],
    ) -> Result<Vec<Value>, DecodeError> {
        if self.kind(doc)? == Kind::Object {
            let bare_object = match args {
                [(name, ty)] => doc.get(name).is_none() && self.object_is_value(doc, ty),
                _ => false,
            };
            if !bare_object {
                let keys = doc.keys();
                let expected: Vec<&str> = args.iter().map(|(n, _)| n.as_str()).collect();
                if let Some(k) = keys.iter().find(|k| !expected.contains(&k.as_str())) {
                    return self.err(if expected.is_empty() {
                        format!(
                            "unknown key `{}`: the entry takes no per-instance arguments (every \
                             argument is a weight), so an instance is `{{}}`",
                            crate::echo(k)
                        )
                    } else {
                        format!(
                            "unknown key `{}`; the instances must have the keys: {}",
                            crate::echo(k),
                            expected.join(", ")
                        )
                    });
                }
                let mut out = Vec::with_capacity(args.len());
                for (name, ty) in args {
                    let Some(v) = doc.get(name) else {
                        return self.err(format!(
                            "missing key `{name}` (for @main's argument %{name}: {ty}); the \
                             instance has: {}",
                            if keys.is_empty() {
                                "no keys".to_string()
                            } else {
                                keys.join(", ")
                            }
                        ));
                    };
                    self.enter(Seg::Field(Cow::Borrowed(name)))?;
                    out.push(self.value(&v, ty)?);
                    self.pop();
                }
                return Ok(out);
            }
        }
        match args {
            [(_, ty)] => Ok(vec![self.value(doc, ty)?]),
            _ => {
                let names: Vec<&str> = args.iter().map(|(n, _)| n.as_str()).collect();
                self.err(format!(
                    "expected an object with the keys {} (a bare value is accepted only when \
                     @main takes exactly one argument from the instances), found {}",
                    if names.is_empty() {
                        "(none: every argument is a parameter)".to_string()
                    } else {
                        names.join(", ")
                    },
                    doc.describe()
                ))
            }
        }
    }

    /// Whether an object (that lacks the argument's name as a key) is itself a value of `ty`:
    /// `{"shape": .., "data": ..}` for a tensor, `{"Ctor": [..]}` for an ADT.
    fn object_is_value<D: Doc>(&self, doc: &D, ty: &Ty) -> bool {
        match ty {
            Ty::Tensor { .. } => {
                (doc.get("shape").is_some() && doc.get("data").is_some())
                    || doc
                        .single_entry()
                        .is_some_and(|(k, _)| k == ATTACHED_TENSOR_KEY)
            }
            Ty::Adt(adt, _) => doc
                .single_entry()
                .is_some_and(|(k, _)| self.env.ctor_adt(&k).is_some_and(|a| a == adt)),
            _ => false,
        }
    }

    fn value<D: Doc>(&mut self, doc: &D, ty: &Ty) -> Result<Value, DecodeError> {
        match ty {
            Ty::Tensor { shape, dtype } => Ok(Value::Tensor(self.tensor(doc, shape, *dtype, ty)?)),
            Ty::Tuple(ts) => {
                if self.kind(doc)? != Kind::Array {
                    return self.err(format!(
                        "expected {ty} (a tuple, written as an array of {}), found {}",
                        elements(ts.len()),
                        doc.describe()
                    ));
                }
                if doc.array_len() != ts.len() {
                    return self.err(format!(
                        "expected {ty} (a tuple of {}), found {}",
                        elements(ts.len()),
                        doc.describe()
                    ));
                }
                let mut out = Fields::with_capacity(ts.len());
                for (i, t) in ts.iter().enumerate() {
                    let Some(item) = doc.item(i) else { break };
                    self.enter(Seg::Index(i))?;
                    out.push(self.value(&item, t)?);
                    self.pop();
                }
                Ok(Value::tuple(out))
            }
            Ty::Adt(name, args) => {
                if let Some(elem) = self.env.list_elem(ty) {
                    if self.kind(doc)? == Kind::Array {
                        return self.list(doc, elem);
                    }
                }
                self.adt(doc, ty, name, args)
            }
            Ty::Func(..) => self.err(format!(
                "@main takes a function ({ty}) here, which an instance cannot provide"
            )),
            Ty::Param(_) | Ty::Var(_) => self.err(format!(
                "@main's argument has the unresolved type {ty}; give @main concrete types"
            )),
        }
    }

    /// `List[T]` from an array, built from the end without recursion.
    fn list<D: Doc>(&mut self, doc: &D, elem: &Ty) -> Result<Value, DecodeError> {
        let Some((cons, nil)) = self.env.list_ctors() else {
            return self.err("the module has no List constructors".into());
        };
        let n = doc.array_len();
        let mut items = Vec::with_capacity(n);
        for i in 0..n {
            // A list element is a few hundred bytes of values: a list of millions grows by
            // gigabytes, so it checks the memory budget as it goes.
            if i % 4096 == 4095 {
                if let Err(stop) = tumble_limits::poll() {
                    return self.err(format!("while decoding element {i} of a list: {stop}"));
                }
            }
            let Some(item) = doc.item(i) else { break };
            self.enter(Seg::Index(i))?;
            items.push(self.value(&item, elem)?);
            self.pop();
        }
        let mut acc = Value::adt(nil, Fields::new());
        while let Some(v) = items.pop() {
            acc = Value::adt(cons, Fields::from_buf([v, acc]));
        }
        Ok(acc)
    }

    fn adt<D: Doc>(
        &mut self,
        doc: &D,
        ty: &Ty,
        name: &str,
        args: &[Ty],
    ) -> Result<Value, DecodeError> {
        // The type's constructors, for messages (looked up on failure only: this runs for every
        // node of every instance).
        let ctors = |d: &Self| match d.env.ctor_names(name) {
            Ok(c) => Ok(c),
            Err(_) => d.err(format!("the module declares no type `{name}`")),
        };
        let kind = self.kind(doc)?;
        let entry = match kind {
            Kind::String => doc.as_str().map(|s| (s, None)),
            Kind::Object => doc.single_entry().map(|(k, v)| (k, Some(v))),
            _ => None,
        };
        let Some((ctor_name, fields)) = entry else {
            // Described only on failure: this runs for every node of every instance.
            let list_hint = if self.env.list_elem(ty).is_some() {
                "a JSON array, or "
            } else {
                ""
            };
            let example = match ctors(self)?.first() {
                Some(c) => format!("{{\"{c}\": [fields...]}}"),
                None => "{\"Ctor\": [fields...]}".into(),
            };
            return self.err(format!(
                "expected {ty} ({list_hint}an object with one key, the constructor, like \
                 {example}), found {}",
                doc.describe()
            ));
        };
        let cached = self
            .ctors
            .iter()
            .find(|(c, adt, at)| c.name == *ctor_name && adt == name && at.as_slice() == args)
            .map(|(c, _, _)| c.clone());
        let Some(c) = cached.or_else(|| {
            let c = Rc::new(self.env.ctor_of(name, args, &ctor_name)?);
            self.ctors
                .push((c.clone(), name.to_string(), args.to_vec()));
            Some(c)
        }) else {
            let why = match self.env.ctor_adt(&ctor_name) {
                Some(other) => format!(
                    "constructor `{}` belongs to {other}, not {ty}",
                    crate::echo(&ctor_name)
                ),
                None => format!("unknown constructor `{}` for {ty}", crate::echo(&ctor_name)),
            };
            return self.err(format!(
                "{why}; expected one of: {}",
                ctors(self)?.join(", ")
            ));
        };
        let arity = c.fields.len();
        let Some(fields) = fields else {
            if arity == 0 {
                return Ok(Value::adt(c.index, Fields::new()));
            }
            return self.err(format!(
                "constructor {} takes {}; write {{\"{}\": [...]}}",
                c.name,
                fields_word(arity),
                c.name
            ));
        };
        self.enter(Seg::Ctor(c.clone()))?;
        if self.kind(&fields)? != Kind::Array {
            return self.err(format!(
                "expected the {} of {} as an array, found {}",
                fields_word(arity),
                c.name,
                fields.describe()
            ));
        }
        if fields.array_len() != arity {
            return self.err(format!(
                "constructor {} takes {}, found {}",
                c.name,
                fields_word(arity),
                fields.describe()
            ));
        }
        let mut out = Fields::with_capacity(arity);
        for (i, t) in c.fields.iter().enumerate() {
            let Some(item) = fields.item(i) else { break };
            self.enter(Seg::Index(i))?;
            out.push(self.value(&item, t)?);
            self.pop();
        }
        self.pop();
        Ok(Value::adt(c.index, out))
    }

    // -----------------------------------------------------------------------------------------
    // Tensors

    fn tensor<D: Doc>(
        &mut self,
        doc: &D,
        dims: &[Dim],
        dtype: DType,
        ty: &Ty,
    ) -> Result<Tensor, DecodeError> {
        match self.kind(doc)? {
            Kind::Tensor => {
                return match doc.tensor() {
                    Some(Ok(t)) => self.check_given(t, dims, dtype, ty),
                    Some(Err(m)) => self.err(m),
                    None => self.err(format!("expected {ty}, found {}", doc.describe())),
                }
            }
            Kind::Object => {
                if let Some(r) = doc.get(ATTACHED_TENSOR_KEY) {
                    return self.attached_tensor(&r, dims, dtype, ty);
                }
                return self.shape_data(doc, dims, dtype, ty);
            }
            _ => {}
        }
        let rank = dims.len();
        // Instances hold many small tensors (a tree's token per node): the extents on the stack,
        // the elements in one allocation of the size a fully known shape gives, and the shape
        // inline in the tensor.
        let mut extents: SmallVec<[Option<usize>; 4]> = smallvec::smallvec![None; rank];
        let known: Option<usize> = dims
            .iter()
            .map(known_extent)
            .try_fold(1usize, |acc, n| n.and_then(|n| acc.checked_mul(n)));
        let mut elems = Elems::with_capacity(dtype, known.unwrap_or(0).min(MAX_PRESIZED));
        self.nested(doc, 0, dims, dtype, ty, &mut extents, &mut elems)?;
        let shape: SmallVec<[usize; 4]> = extents
            .iter()
            .zip(dims)
            .map(|(e, d)| e.or_else(|| known_extent(d)).unwrap_or(0))
            .collect();
        if !crate::bind::shape_matches(dims, &shape) {
            return self.err(format!(
                "expected {ty}, found a tensor of shape {}",
                format_shape(&shape)
            ));
        }
        match Tensor::with_shape(&shape, elems.into_buffer()) {
            Ok(t) => Ok(t),
            Err(e) => self.err(format!("expected {ty}: {e}")),
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn nested<D: Doc>(
        &mut self,
        doc: &D,
        level: usize,
        dims: &[Dim],
        dtype: DType,
        ty: &Ty,
        extents: &mut [Option<usize>],
        elems: &mut Elems,
    ) -> Result<(), DecodeError> {
        let kind = self.kind(doc)?;
        if level == dims.len() {
            return match elems.push(doc, kind) {
                Ok(()) => Ok(()),
                Err(why) => {
                    // Described only on failure: this runs once per element of every instance.
                    let what = if level == 0 {
                        ty.to_string()
                    } else {
                        format!("{} {dtype} element of {ty}", article(dtype))
                    };
                    self.err(format!("expected {what}, found {}{why}", doc.describe()))
                }
            };
        }
        if kind != Kind::Array {
            return if level == 0 {
                self.err(format!("expected {ty}, found {}", doc.describe()))
            } else {
                self.err(format!(
                    "expected an array (level {level} of {ty}, which has rank {}), found {}",
                    dims.len(),
                    doc.describe()
                ))
            };
        }
        let n = doc.array_len();
        match extents[level] {
            None => extents[level] = Some(n),
            Some(e) if e != n => {
                return self.err(format!(
                    "ragged array: expected {} like the first array at this depth, found {} \
                     (every row of a tensor has the same length)",
                    elements(e),
                    n
                ))
            }
            Some(_) => {}
        }
        // Fail early on a known dim that the data contradicts (before reading all of it).
        if let Some(d) = dims[level].known() {
            if usize::try_from(d).ok() != Some(n) {
                return if level == 0 {
                    self.err(format!("expected {ty}, found {}", doc.describe()))
                } else {
                    self.err(format!(
                        "expected an array of {} (dimension {level} of {ty}), found {}",
                        elements(usize::try_from(d).unwrap_or(0)),
                        doc.describe()
                    ))
                };
            }
        }
        for i in 0..n {
            let Some(item) = doc.item(i) else { break };
            self.enter(Seg::Index(i))?;
            self.nested(&item, level + 1, dims, dtype, ty, extents, elems)?;
            self.pop();
        }
        Ok(())
    }

    /// An attached tensor (a caller's array): see [`Decoder::check_given`].
    fn attached_tensor<D: Doc>(
        &mut self,
        r: &D,
        dims: &[Dim],
        dtype: DType,
        ty: &Ty,
    ) -> Result<Tensor, DecodeError> {
        let found = match r.as_number() {
            Some(Num::Int(i)) => usize::try_from(i).ok().and_then(|i| self.attached.get(i)),
            _ => None,
        };
        let Some(t) = found else {
            return self.err(format!(
                "expected {ty}, found a reference to an attached tensor that this instance does \
                 not have ({})",
                r.describe()
            ));
        };
        self.check_given(t.clone(), dims, dtype, ty)
    }

    /// A tensor the caller built already, taken as it is: its dtype must be the declared one
    /// (no silent casts), its shape must fit the declared dims.
    fn check_given(
        &self,
        t: Tensor,
        dims: &[Dim],
        dtype: DType,
        ty: &Ty,
    ) -> Result<Tensor, DecodeError> {
        if t.dtype() != dtype {
            return self.err(format!(
                "expected {ty}, found a {} array of shape {}; convert it (numpy: \
                 `.astype({})`)",
                t.dtype(),
                format_shape(t.shape()),
                if dtype == DType::Bool {
                    "bool".to_string()
                } else {
                    format!("numpy.{dtype}")
                }
            ));
        }
        if !crate::bind::shape_matches(dims, t.shape()) {
            return self.err(format!(
                "expected {ty}, found an array of shape {}",
                format_shape(t.shape())
            ));
        }
        Ok(t)
    }

    fn shape_data<D: Doc>(
        &mut self,
        doc: &D,
        dims: &[Dim],
        dtype: DType,
        ty: &Ty,
    ) -> Result<Tensor, DecodeError> {
        let keys = doc.keys();
        let keys_ok = keys.len() == 2 && keys.iter().all(|k| k == "shape" || k == "data");
        let (Some(shape_j), Some(data), true) = (doc.get("shape"), doc.get("data"), keys_ok) else {
            return self.err(format!(
                "expected {ty} (nested arrays, or {{\"shape\": [...], \"data\": [...]}} with flat \
                 data), found {}",
                doc.describe()
            ));
        };
        let array = |d: &D| d.kind() == Ok(Kind::Array);
        if !array(&shape_j) || !array(&data) {
            return self.err(format!(
                "expected {ty} (nested arrays, or {{\"shape\": [...], \"data\": [...]}} with flat \
                 data), found {}",
                doc.describe()
            ));
        }
        let mut shape = Vec::with_capacity(shape_j.array_len());
        for i in 0..shape_j.array_len() {
            let Some(d) = shape_j.item(i) else { break };
            let size = match d.as_number() {
                Some(Num::Int(n)) => usize::try_from(n).ok(),
                Some(Num::UInt(n)) => usize::try_from(n).ok(),
                _ => None,
            };
            match size {
                Some(n) => shape.push(n),
                None => {
                    self.enter(Seg::Field(Cow::Borrowed("shape")))?;
                    return self.err(format!(
                        "expected a list of non-negative sizes, found {}",
                        d.describe()
                    ));
                }
            }
        }
        if !crate::bind::shape_matches(dims, &shape) {
            self.enter(Seg::Field(Cow::Borrowed("shape")))?;
            return self.err(format!(
                "expected {ty}, found the shape {}",
                format_shape(&shape)
            ));
        }
        let n = tumble_tensor::shape::num_elements(&shape).ok();
        let len = data.array_len();
        if n != Some(len) {
            self.enter(Seg::Field(Cow::Borrowed("data")))?;
            return self.err(format!(
                "shape {} needs {} values, found {}",
                format_shape(&shape),
                n.map_or("too many".into(), |n| n.to_string()),
                elements(len)
            ));
        }
        let mut elems = Elems::new(dtype);
        self.enter(Seg::Field(Cow::Borrowed("data")))?;
        for i in 0..len {
            let Some(j) = data.item(i) else { break };
            let kind = self.kind(&j)?;
            if let Err(why) = elems.push(&j, kind) {
                self.enter(Seg::Index(i))?;
                return self.err(format!(
                    "expected {} {dtype} element of {ty}, found {}{why}",
                    article(dtype),
                    j.describe()
                ));
            }
        }
        self.pop();
        match Tensor::new(shape, elems.into_buffer()) {
            Ok(t) => Ok(t),
            Err(e) => self.err(format!("expected {ty}: {e}")),
        }
    }
}

fn article(dtype: DType) -> &'static str {
    if dtype.is_int() {
        "an"
    } else {
        "a"
    }
}

fn fields_word(n: usize) -> String {
    match n {
        0 => "no fields".into(),
        1 => "1 field".into(),
        n => format!("{n} fields"),
    }
}

/// Tensor elements being collected, typed by dtype.
enum Elems {
    F32(Vec<f32>),
    F64(Vec<f64>),
    I32(Vec<i32>),
    I64(Vec<i64>),
    Bool(Vec<bool>),
}

impl Elems {
    fn new(dtype: DType) -> Elems {
        Elems::with_capacity(dtype, 0)
    }

    fn with_capacity(dtype: DType, n: usize) -> Elems {
        match dtype {
            DType::Float32 => Elems::F32(Vec::with_capacity(n)),
            DType::Float64 => Elems::F64(Vec::with_capacity(n)),
            DType::Int32 => Elems::I32(Vec::with_capacity(n)),
            DType::Int64 => Elems::I64(Vec::with_capacity(n)),
            DType::Bool => Elems::Bool(Vec::with_capacity(n)),
        }
    }

    /// Appends one element (a node of kind `kind`); on failure returns a suffix explaining why
    /// (may be empty).
    fn push<D: Doc>(&mut self, j: &D, kind: Kind) -> Result<(), String> {
        let num = || match (kind, j.as_number()) {
            (Kind::Number, Some(n)) => Ok(n),
            _ => Err(String::new()),
        };
        match self {
            Elems::F32(v) => {
                let x = as_f64(num()?);
                let y = x as f32;
                if y.is_infinite() && x.is_finite() {
                    return Err(", which is out of range for float32".into());
                }
                v.push(y);
            }
            Elems::F64(v) => v.push(as_f64(num()?)),
            Elems::I32(v) => {
                let x = integer(num()?, "int32")?;
                v.push(i32::try_from(x).map_err(|_| OUT_OF_RANGE_I32.to_string())?);
            }
            Elems::I64(v) => v.push(integer(num()?, "int64")?),
            Elems::Bool(v) => match (kind, j.as_bool()) {
                (Kind::Bool, Some(b)) => v.push(b),
                _ => return Err(" (write true or false)".into()),
            },
        }
        Ok(())
    }

    fn into_buffer(self) -> Buffer {
        match self {
            Elems::F32(v) => Buffer::F32(v),
            Elems::F64(v) => Buffer::F64(v),
            Elems::I32(v) => Buffer::I32(v),
            Elems::I64(v) => Buffer::I64(v),
            Elems::Bool(v) => Buffer::Bool(v),
        }
    }
}

const OUT_OF_RANGE_I32: &str = ", which is out of range for int32";

fn as_f64(n: Num) -> f64 {
    match n {
        Num::Int(i) => i as f64,
        Num::UInt(u) => u as f64,
        Num::Float(x) => x,
    }
}

/// A number as an exact integer: integral floats like `3.0` are accepted. `dtype` names the
/// target in the out-of-range message.
fn integer(n: Num, dtype: &str) -> Result<i64, String> {
    let x = match n {
        Num::Int(i) => return Ok(i),
        Num::UInt(_) => return Err(format!(", which is out of range for {dtype}")),
        Num::Float(x) => x,
    };
    if x.fract() != 0.0 || !x.is_finite() {
        return Err(", which is not an integer".into());
    }
    // Exactly representable range of i64 as f64 is [-2^63, 2^63).
    let two_63 = -(i64::MIN as f64);
    if !(-two_63..two_63).contains(&x) {
        return Err(format!(", which is out of range for {dtype}"));
    }
    Ok(x as i64)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn num(s: &str) -> Num {
        let j: Json = serde_json::from_str(s).unwrap();
        Doc::as_number(&&j).unwrap()
    }

    #[test]
    fn integers() {
        assert_eq!(integer(num("-5"), "int64"), Ok(-5));
        assert_eq!(integer(num("3.0"), "int64"), Ok(3));
        assert_eq!(integer(num("1e3"), "int64"), Ok(1000));
        assert!(integer(num("2.5"), "int64")
            .unwrap_err()
            .contains("not an integer"));
        assert!(integer(num("18446744073709551615"), "int32")
            .unwrap_err()
            .contains("out of range for int32"));
        assert!(integer(num("1e19"), "int64")
            .unwrap_err()
            .contains("out of range"));
        assert_eq!(integer(num("-9223372036854775808"), "int64"), Ok(i64::MIN));
    }

    #[test]
    fn descriptions() {
        let j: Json = serde_json::json!({"a": 1, "b": [1, 2]});
        assert_eq!((&j).describe(), "an object with keys a, b");
        assert_eq!(array_text(0), "an empty array");
        assert_eq!(shorten("abcdef", 3), "abc…");
    }
}
