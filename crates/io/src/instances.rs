//! Instances in: JSON Lines or a JSON array, decoded by `@main`'s declared argument types.
//!
//! Reading happens in two steps, because which `@main` arguments the instances provide decides
//! which are parameters ([`crate::bind_params`]):
//!
//! 1. [`read_instances`] / [`read_instances_file`] parse the input into raw JSON
//!    ([`RawInstances`]), whose [`RawInstances::provided_args`] says which arguments they give;
//! 2. [`RawInstances::decode`] turns each instance into interpreter [`Value`]s by type.
//!
//! # Stack use
//!
//! Parse trees nest deeply (about 3 JSON levels per tree level), so serde_json's recursion limit
//! (128) is disabled. Instead every line is pre-scanned iteratively and rejected if it nests
//! deeper than [`MAX_DEPTH`] levels. Parsing, decoding and dropping JSON of that depth still
//! recurse natively (a few hundred bytes per level), so **call this module from a thread with a
//! large stack** (the CLI's worker thread has 256 MiB; 64 MiB is plenty for [`MAX_DEPTH`]).
//! Raw JSON is dropped iteratively, and lists (JSON arrays) are built without recursion, so a
//! 100,000-element list needs no special stack.

use std::collections::BTreeSet;
use std::fmt;
use std::io::BufRead;
use std::path::Path;

use serde::Deserialize;
use serde_json::Value as Json;
use tumble_interp::Value;
use tumble_ir::{DType, Dim, Ty};
use tumble_tensor::shape::format_shape;
use tumble_tensor::{Buffer, Tensor};

use crate::env::TypeEnv;
use crate::IoError;

/// The longest line (and the largest JSON-array document) read: 256 MiB.
pub const MAX_LINE_BYTES: usize = 256 << 20;
/// The deepest JSON nesting accepted in one instance: 16,384 levels, enough for a 5,000-deep
/// tree written as `{"Rose": [value, [children...]]}` (3 JSON levels per tree level).
pub const MAX_DEPTH: usize = 16_384;

/// Where an instance is in its input.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Location {
    /// 1-based line of a JSON Lines input.
    Line(usize),
    /// 0-based index in a JSON array input.
    Index(usize),
}

impl fmt::Display for Location {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Location::Line(n) => write!(f, "line {n}"),
            Location::Index(i) => write!(f, "index {i}"),
        }
    }
}

/// Parsed JSON that is torn down iteratively (a deep tree dropped the default way recurses once
/// per level).
struct DeepJson(Json);

impl Drop for DeepJson {
    fn drop(&mut self) {
        drop_json(std::mem::take(&mut self.0));
    }
}

/// Drops `v` without recursion.
fn drop_json(v: Json) {
    let mut stack = vec![v];
    while let Some(v) = stack.pop() {
        match v {
            Json::Array(a) => stack.extend(a),
            Json::Object(m) => stack.extend(m.into_iter().map(|(_, v)| v)),
            _ => {}
        }
    }
}

/// One instance as parsed JSON, not yet checked against any type.
pub struct RawInstance {
    pub location: Location,
    json: DeepJson,
    /// Tensors a library caller built already (numpy arrays), which the JSON refers to as
    /// `{ATTACHED_TENSOR_KEY: index}`, so they are checked by type but never spelled out as JSON.
    attached: Vec<Tensor>,
}

/// The key of a JSON object that stands for an attached tensor (see
/// [`RawInstance::with_tensors`]): `{"\u0001tensor": 3}` is the instance's attached tensor 3. A
/// control character no JSON author types, so it cannot be mistaken for an argument or a
/// constructor name.
pub const ATTACHED_TENSOR_KEY: &str = "\u{1}tensor";

impl RawInstance {
    /// An instance made by a library caller rather than read from text; `attached` are the
    /// tensors its JSON refers to by [`ATTACHED_TENSOR_KEY`] objects.
    pub fn with_tensors(location: Location, json: Json, attached: Vec<Tensor>) -> RawInstance {
        RawInstance {
            location,
            json: DeepJson(json),
            attached,
        }
    }

    pub fn json(&self) -> &Json {
        &self.json.0
    }
}

/// The instances of one input, parsed but not yet decoded.
pub struct RawInstances {
    /// The file path or a name like `<stdin>`, for messages.
    pub source_name: String,
    pub items: Vec<RawInstance>,
}

// ---------------------------------------------------------------------------------------------
// Reading

/// Reads instances from `path` (see [`read_instances`]).
pub fn read_instances_file(path: &Path) -> Result<RawInstances, IoError> {
    let file =
        std::fs::File::open(path).map_err(|e| IoError::file(path, "read the instances file", e))?;
    read_instances(std::io::BufReader::new(file), &path.display().to_string())
}

enum Line {
    Eof,
    Text(String),
}

struct LineReader<R> {
    reader: R,
    source_name: String,
    max_line: usize,
    /// 1-based number of the last line returned.
    line_no: usize,
}

impl<R: BufRead> LineReader<R> {
    fn err(&self, message: String) -> IoError {
        IoError::Instances {
            source_name: self.source_name.clone(),
            message,
        }
    }

    fn too_long(&self, line: usize) -> IoError {
        self.err(format!(
            "line {line} is longer than {}; split the input into smaller instances",
            size_text(self.max_line)
        ))
    }

    /// The next line without its `\n` / `\r\n`, reading at most [`MAX_LINE_BYTES`] of it.
    fn next(&mut self) -> Result<Line, IoError> {
        let mut buf = Vec::new();
        let mut saw_any = false;
        loop {
            let chunk = match self.reader.fill_buf() {
                Ok(c) => c,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    return Err(self.err(format!("cannot read line {}: {e}", self.line_no + 1)))
                }
            };
            if chunk.is_empty() {
                if !saw_any {
                    return Ok(Line::Eof);
                }
                break;
            }
            saw_any = true;
            let (take, done) = match chunk.iter().position(|&b| b == b'\n') {
                Some(i) => (i + 1, true),
                None => (chunk.len(), false),
            };
            if buf.len() + take > self.max_line.saturating_add(2) {
                return Err(self.too_long(self.line_no + 1));
            }
            buf.extend_from_slice(&chunk[..take]);
            self.reader.consume(take);
            if done {
                break;
            }
        }
        self.line_no += 1;
        if buf.last() == Some(&b'\n') {
            buf.pop();
            if buf.last() == Some(&b'\r') {
                buf.pop();
            }
        }
        if buf.len() > self.max_line {
            return Err(self.too_long(self.line_no));
        }
        String::from_utf8(buf)
            .map(Line::Text)
            .map_err(|e| self.err(format!("line {} is not valid UTF-8 ({e})", self.line_no)))
    }
}

/// `256 MiB`, or a byte count below 1 MiB.
fn size_text(n: usize) -> String {
    if n >= 1 << 20 && n % (1 << 20) == 0 {
        format!("{} MiB", n >> 20)
    } else {
        format!("{n} bytes")
    }
}

fn is_blank(s: &str) -> bool {
    s.trim().is_empty()
}

/// The deepest nesting of `[`/`{` in `text` (outside strings), scanning iteratively; stops and
/// returns `limit + 1` as soon as the limit is passed.
fn nesting_depth(text: &str, limit: usize) -> usize {
    let (mut depth, mut max) = (0usize, 0usize);
    let (mut in_string, mut escaped) = (false, false);
    for &b in text.as_bytes() {
        if in_string {
            if escaped {
                escaped = false;
            } else if b == b'\\' {
                escaped = true;
            } else if b == b'"' {
                in_string = false;
            }
            continue;
        }
        match b {
            b'"' => in_string = true,
            b'[' | b'{' => {
                depth += 1;
                if depth > max {
                    max = depth;
                    if max > limit {
                        return max;
                    }
                }
            }
            b']' | b'}' => depth = depth.saturating_sub(1),
            _ => {}
        }
    }
    max
}

/// Parses one JSON document with serde_json's recursion limit off (the caller checked depth).
fn parse_json(text: &str) -> Result<Json, serde_json::Error> {
    let mut de = serde_json::Deserializer::from_str(text);
    de.disable_recursion_limit();
    let v = Json::deserialize(&mut de)?;
    if let Err(e) = de.end() {
        drop_json(v);
        return Err(e);
    }
    Ok(v)
}

/// serde_json's message without its trailing ` at line L column C`.
fn json_message(e: &serde_json::Error) -> String {
    let s = e.to_string();
    match s.rfind(" at line ") {
        Some(i) => s[..i].to_string(),
        None => s,
    }
}

/// Reads instances from `reader` (`source_name` names it in messages):
///
/// - **JSON Lines**: one instance per line; blank lines are skipped;
/// - **a JSON array** of instances: when the first non-blank character is `[` and the whole
///   input parses as one JSON array (so a one-line input `[...]` is an array of instances; to
///   pass one array-valued instance on one line, write it as an object `{"xs": [...]}`).
///
/// Each instance is an object keyed by `@main` argument names (without `%`), or a bare value
/// when exactly one argument is left for the instances to fill. Lines longer than
/// [`MAX_LINE_BYTES`] and nesting deeper than [`MAX_DEPTH`] are errors. See the module docs
/// about stack use.
pub fn read_instances(reader: impl BufRead, source_name: &str) -> Result<RawInstances, IoError> {
    read_instances_capped(reader, source_name, MAX_LINE_BYTES)
}

/// [`read_instances`] with another cap on the length of a line (and of an array document).
pub fn read_instances_capped(
    reader: impl BufRead,
    source_name: &str,
    max_line_bytes: usize,
) -> Result<RawInstances, IoError> {
    let mut lines = LineReader {
        reader,
        source_name: source_name.to_string(),
        max_line: max_line_bytes,
        line_no: 0,
    };
    let mut items = Vec::new();
    // The first non-blank line decides the format.
    let first = loop {
        match lines.next()? {
            Line::Eof => {
                return Ok(RawInstances {
                    source_name: source_name.to_string(),
                    items,
                })
            }
            Line::Text(t) if is_blank(&t) => continue,
            Line::Text(t) => break t,
        }
    };
    let first_no = lines.line_no;
    if first.trim_start().starts_with('[') {
        if let Some(array) = try_array(&mut lines, first, first_no, &mut items)? {
            return Ok(array);
        }
    } else {
        items.push(parse_line(&lines, &first, first_no)?);
    }
    loop {
        match lines.next()? {
            Line::Eof => break,
            Line::Text(t) if is_blank(&t) => {}
            Line::Text(t) => {
                let no = lines.line_no;
                items.push(parse_line(&lines, &t, no)?);
            }
        }
    }
    Ok(RawInstances {
        source_name: source_name.to_string(),
        items,
    })
}

fn depth_error(what: &str) -> String {
    format!(
        "{what} nests deeper than {MAX_DEPTH} levels of JSON arrays/objects; tumble does not \
         read inputs that deep"
    )
}

fn parse_line<R: BufRead>(
    lines: &LineReader<R>,
    text: &str,
    no: usize,
) -> Result<RawInstance, IoError> {
    if nesting_depth(text, MAX_DEPTH) > MAX_DEPTH {
        return Err(lines.err(depth_error(&format!("the instance at line {no}"))));
    }
    let json = parse_json(text).map_err(|e| {
        lines.err(format!(
            "line {no}, column {}: not valid JSON: {}",
            e.column(),
            json_message(&e)
        ))
    })?;
    Ok(RawInstance {
        location: Location::Line(no),
        json: DeepJson(json),
        attached: Vec::new(),
    })
}

/// The input's first non-blank line starts with `[`: decide between a JSON array and JSON Lines.
/// Returns the instances for an array; for JSON Lines, pushes the first line's instance onto
/// `items` and returns `None` (the caller reads on).
fn try_array<R: BufRead>(
    lines: &mut LineReader<R>,
    first: String,
    first_no: usize,
    items: &mut Vec<RawInstance>,
) -> Result<Option<RawInstances>, IoError> {
    let whole_array = |json: Json, lines: &LineReader<R>| -> RawInstances {
        let elems = match json {
            Json::Array(a) => a,
            other => vec![other],
        };
        RawInstances {
            source_name: lines.source_name.clone(),
            items: elems
                .into_iter()
                .enumerate()
                .map(|(i, j)| RawInstance {
                    location: Location::Index(i),
                    json: DeepJson(j),
                    attached: Vec::new(),
                })
                .collect(),
        }
    };
    // The first line on its own is a complete JSON value: the input is an array only if nothing
    // else follows.
    if nesting_depth(&first, MAX_DEPTH + 1) <= MAX_DEPTH + 1 {
        if let Ok(json) = parse_json(&first) {
            let json = DeepJson(json);
            let mut rest_blank = true;
            let mut next = None;
            loop {
                match lines.next()? {
                    Line::Eof => break,
                    Line::Text(t) if is_blank(&t) => {}
                    Line::Text(t) => {
                        rest_blank = false;
                        next = Some(t);
                        break;
                    }
                }
            }
            if rest_blank {
                let mut json = json;
                let inner = std::mem::take(&mut json.0);
                return Ok(Some(whole_array(inner, lines)));
            }
            // JSON Lines whose first line is an array value.
            if nesting_depth(&first, MAX_DEPTH) > MAX_DEPTH {
                return Err(lines.err(depth_error(&format!("the instance at line {first_no}"))));
            }
            items.push(RawInstance {
                location: Location::Line(first_no),
                json,
                attached: Vec::new(),
            });
            if let Some(t) = next {
                let no = lines.line_no;
                items.push(parse_line(lines, &t, no)?);
            }
            return Ok(None);
        }
    }
    // The first line is incomplete (or invalid) on its own: try the whole input as one array.
    let mut text = first;
    loop {
        match lines.next()? {
            Line::Eof => break,
            Line::Text(t) => {
                if text.len() + t.len() + 1 > lines.max_line {
                    return Err(lines.err(format!(
                        "the input starts with `[` but is larger than {}, too large for a \
                         JSON array of instances; use JSON Lines (one instance per line)",
                        size_text(lines.max_line)
                    )));
                }
                text.push('\n');
                text.push_str(&t);
            }
        }
    }
    if nesting_depth(&text, MAX_DEPTH + 1) > MAX_DEPTH + 1 {
        return Err(lines.err(depth_error("an instance of the JSON array")));
    }
    match parse_json(&text) {
        Ok(json) => Ok(Some(whole_array(json, lines))),
        Err(e) => Err(lines.err(format!(
            "line {}, column {}: not valid JSON: {} (the input starts with `[`, so it was read as \
             one JSON array of instances; for JSON Lines put each instance on one line)",
            e.line() + first_no - 1,
            e.column(),
            json_message(&e)
        ))),
    }
}

// ---------------------------------------------------------------------------------------------
// Which arguments the instances provide

impl RawInstances {
    pub fn len(&self) -> usize {
        self.items.len()
    }

    pub fn is_empty(&self) -> bool {
        self.items.is_empty()
    }

    /// The `@main` arguments these instances provide, for [`crate::bind_params`]: every object
    /// key, plus — when some instance is a bare value (or an object none of whose keys is an
    /// argument name, like `{"Rose": [...]}`) — the one argument that is neither a key nor a
    /// tensor of the weights file, if there is exactly one.
    pub fn provided_args(
        &self,
        main_params: &[(String, Ty)],
        file: &std::collections::BTreeMap<String, Tensor>,
    ) -> BTreeSet<String> {
        let names: BTreeSet<&str> = main_params
            .iter()
            .map(|(n, _)| n.trim_start_matches('%'))
            .collect();
        let mut keys = BTreeSet::new();
        let mut bare = false;
        for item in &self.items {
            match item.json() {
                Json::Object(m) => {
                    let mut any = false;
                    for k in m.keys() {
                        any |= names.contains(k.as_str());
                        keys.insert(k.clone());
                    }
                    bare |= !any && !m.is_empty();
                }
                _ => bare = true,
            }
        }
        if bare {
            let left: Vec<&&str> = names
                .iter()
                .filter(|n| !keys.contains(**n) && !file.contains_key(**n))
                .collect();
            if let [one] = left.as_slice() {
                keys.insert((**one).to_string());
            }
        }
        keys
    }

    /// Decodes every instance against `args` (the arguments the instances provide, with their
    /// declared types, in order: [`crate::BoundParams::instance_args`]). Each result lists the
    /// values in `args` order.
    pub fn decode(&self, env: &TypeEnv, args: &[(String, Ty)]) -> Result<Vec<Vec<Value>>, IoError> {
        (0..self.items.len())
            .map(|i| self.decode_one(i, env, args))
            .collect()
    }

    /// Decodes instance `index` (see [`RawInstances::decode`]).
    pub fn decode_one(
        &self,
        index: usize,
        env: &TypeEnv,
        args: &[(String, Ty)],
    ) -> Result<Vec<Value>, IoError> {
        let Some(item) = self.items.get(index) else {
            return Ok(Vec::new());
        };
        let mut d = Decoder {
            env,
            path: Vec::new(),
            attached: &item.attached,
        };
        d.instance(item.json(), args)
            .map_err(|e| IoError::Instance {
                source_name: self.source_name.clone(),
                location: item.location.to_string(),
                path: e.path,
                message: e.message,
            })
    }
}

// ---------------------------------------------------------------------------------------------
// Decoding by type

/// A step of the path inside an instance.
enum Seg {
    Field(String),
    Ctor(String),
    Index(usize),
}

struct DecodeError {
    path: String,
    message: String,
}

struct Decoder<'a, 'e> {
    env: &'a TypeEnv<'e>,
    path: Vec<Seg>,
    /// The instance's attached tensors ([`RawInstance::with_tensors`]).
    attached: &'a [Tensor],
}

/// A short description of a JSON value for "found ..." messages.
pub(crate) fn describe(v: &Json) -> String {
    match v {
        Json::Null => "null".into(),
        Json::Bool(b) => format!("the boolean {b}"),
        Json::Number(n) => format!("the number {n}"),
        Json::String(s) => {
            let mut short: String = s.chars().take(40).collect();
            if short.len() < s.len() {
                short.push('…');
            }
            format!("the string {short:?}")
        }
        Json::Array(a) => match a.len() {
            0 => "an empty array".into(),
            1 => "an array of 1 element".into(),
            n => format!("an array of {n} elements"),
        },
        Json::Object(m) => describe_map(m),
    }
}

fn describe_map(m: &serde_json::Map<String, Json>) -> String {
    if m.len() == 1 && m.contains_key(ATTACHED_TENSOR_KEY) {
        "an n-dimensional array".into()
    } else if m.is_empty() {
        "an empty object".into()
    } else {
        format!("an object with keys {}", key_list(m.keys()))
    }
}

fn key_list<'k>(keys: impl Iterator<Item = &'k String>) -> String {
    let v: Vec<&str> = keys.take(20).map(String::as_str).collect();
    v.join(", ")
}

fn elements(n: usize) -> String {
    if n == 1 {
        "1 element".into()
    } else {
        format!("{n} elements")
    }
}

impl Decoder<'_, '_> {
    fn err<T>(&self, message: String) -> Result<T, DecodeError> {
        let mut path = String::new();
        for s in &self.path {
            match s {
                Seg::Field(n) | Seg::Ctor(n) => {
                    path.push('.');
                    path.push_str(n);
                }
                Seg::Index(i) => path.push_str(&format!("[{i}]")),
            }
        }
        Err(DecodeError { path, message })
    }

    fn instance(&mut self, json: &Json, args: &[(String, Ty)]) -> Result<Vec<Value>, DecodeError> {
        if let Json::Object(m) = json {
            let bare_object = match args {
                [(name, ty)] => !m.contains_key(name) && self.object_is_value(m, ty),
                _ => false,
            };
            if !bare_object {
                let expected: Vec<&str> = args.iter().map(|(n, _)| n.as_str()).collect();
                if let Some(k) = m.keys().find(|k| !expected.contains(&k.as_str())) {
                    return self.err(format!(
                        "unknown key `{}`; the instances must have the keys: {}",
                        crate::echo(k),
                        expected.join(", ")
                    ));
                }
                let mut out = Vec::with_capacity(args.len());
                for (name, ty) in args {
                    let Some(v) = m.get(name) else {
                        return self.err(format!(
                            "missing key `{name}` (for @main's argument %{name}: {ty}); the \
                             instance has: {}",
                            if m.is_empty() {
                                "no keys".to_string()
                            } else {
                                key_list(m.keys())
                            }
                        ));
                    };
                    self.path.push(Seg::Field(name.clone()));
                    out.push(self.value(v, ty)?);
                    self.path.pop();
                }
                return Ok(out);
            }
        }
        match args {
            [(_, ty)] => Ok(vec![self.value(json, ty)?]),
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
                    describe(json)
                ))
            }
        }
    }

    /// Whether an object (that lacks the argument's name as a key) is itself a value of `ty`:
    /// `{"shape": .., "data": ..}` for a tensor, `{"Ctor": [..]}` for an ADT.
    fn object_is_value(&self, m: &serde_json::Map<String, Json>, ty: &Ty) -> bool {
        match ty {
            Ty::Tensor { .. } => {
                (m.contains_key("shape") && m.contains_key("data"))
                    || (m.len() == 1 && m.contains_key(ATTACHED_TENSOR_KEY))
            }
            Ty::Adt(adt, _) => {
                m.len() == 1
                    && m.keys()
                        .all(|k| self.env.ctor_adt(k).is_some_and(|a| a == adt))
            }
            _ => false,
        }
    }

    fn value(&mut self, json: &Json, ty: &Ty) -> Result<Value, DecodeError> {
        match ty {
            Ty::Tensor { shape, dtype } => Ok(Value::Tensor(self.tensor(json, shape, *dtype, ty)?)),
            Ty::Tuple(ts) => {
                let Json::Array(a) = json else {
                    return self.err(format!(
                        "expected {ty} (a tuple, written as an array of {}), found {}",
                        elements(ts.len()),
                        describe(json)
                    ));
                };
                if a.len() != ts.len() {
                    return self.err(format!(
                        "expected {ty} (a tuple of {}), found {}",
                        elements(ts.len()),
                        describe(json)
                    ));
                }
                let mut out = Vec::with_capacity(ts.len());
                for (i, (j, t)) in a.iter().zip(ts).enumerate() {
                    self.path.push(Seg::Index(i));
                    out.push(self.value(j, t)?);
                    self.path.pop();
                }
                Ok(Value::tuple(out))
            }
            Ty::Adt(name, args) => {
                if let (Some(elem), Json::Array(a)) = (self.env.list_elem(ty), json) {
                    return self.list(a, elem);
                }
                self.adt(json, ty, name, args)
            }
            Ty::Func(..) => self.err(format!(
                "@main takes a function ({ty}) here, which an instance cannot provide"
            )),
            Ty::Param(_) | Ty::Var(_) => self.err(format!(
                "@main's argument has the unresolved type {ty}; give @main concrete types"
            )),
        }
    }

    /// `List[T]` from a JSON array, built from the end without recursion.
    fn list(&mut self, a: &[Json], elem: &Ty) -> Result<Value, DecodeError> {
        let (Some(cons), Some(nil)) = (self.env.ctor_index("Cons"), self.env.ctor_index("Nil"))
        else {
            return self.err("the module has no List constructors".into());
        };
        let mut items = Vec::with_capacity(a.len());
        for (i, j) in a.iter().enumerate() {
            // A list element is a few hundred bytes of values: a list of millions grows by
            // gigabytes, so it checks the memory budget as it goes.
            if i % 4096 == 4095 {
                if let Err(stop) = tumble_limits::poll() {
                    return self.err(format!("while decoding element {i} of a list: {stop}"));
                }
            }
            self.path.push(Seg::Index(i));
            items.push(self.value(j, elem)?);
            self.path.pop();
        }
        let mut acc = Value::adt(nil, Vec::new());
        while let Some(v) = items.pop() {
            acc = Value::adt(cons, vec![v, acc]);
        }
        Ok(acc)
    }

    fn adt(&mut self, json: &Json, ty: &Ty, name: &str, args: &[Ty]) -> Result<Value, DecodeError> {
        let ctors = match self.env.ctor_names(name) {
            Ok(c) => c,
            Err(_) => return self.err(format!("the module declares no type `{name}`")),
        };
        let (ctor_name, fields) = match json {
            Json::String(s) => (s.as_str(), None),
            Json::Object(m) if m.len() == 1 => match m.iter().next() {
                Some((k, v)) => (k.as_str(), Some(v)),
                None => ("", None),
            },
            _ => {
                // Described only on failure: this runs for every node of every instance.
                let list_hint = if self.env.list_elem(ty).is_some() {
                    "a JSON array, or "
                } else {
                    ""
                };
                let example = match ctors.first() {
                    Some(c) => format!("{{\"{c}\": [fields...]}}"),
                    None => "{\"Ctor\": [fields...]}".into(),
                };
                return self.err(format!(
                    "expected {ty} ({list_hint}an object with one key, the constructor, like \
                     {example}), found {}",
                    describe(json)
                ));
            }
        };
        let Some(c) = self.env.ctor_of(name, args, ctor_name) else {
            let why = match self.env.ctor_adt(ctor_name) {
                Some(other) => format!(
                    "constructor `{}` belongs to {other}, not {ty}",
                    crate::echo(ctor_name)
                ),
                None => format!("unknown constructor `{}` for {ty}", crate::echo(ctor_name)),
            };
            return self.err(format!("{why}; expected one of: {}", ctors.join(", ")));
        };
        let arity = c.fields.len();
        let Some(fields) = fields else {
            if arity == 0 {
                return Ok(Value::adt(c.index, Vec::new()));
            }
            return self.err(format!(
                "constructor {} takes {}; write {{\"{}\": [...]}}",
                c.name,
                fields_word(arity),
                c.name
            ));
        };
        self.path.push(Seg::Ctor(c.name.clone()));
        let Json::Array(a) = fields else {
            return self.err(format!(
                "expected the {} of {} as an array, found {}",
                fields_word(arity),
                c.name,
                describe(fields)
            ));
        };
        if a.len() != arity {
            return self.err(format!(
                "constructor {} takes {}, found {}",
                c.name,
                fields_word(arity),
                describe(fields)
            ));
        }
        let mut out = Vec::with_capacity(arity);
        for (i, (j, t)) in a.iter().zip(&c.fields).enumerate() {
            self.path.push(Seg::Index(i));
            out.push(self.value(j, t)?);
            self.path.pop();
        }
        self.path.pop();
        Ok(Value::adt(c.index, out))
    }

    // -----------------------------------------------------------------------------------------
    // Tensors

    fn tensor(
        &mut self,
        json: &Json,
        dims: &[Dim],
        dtype: DType,
        ty: &Ty,
    ) -> Result<Tensor, DecodeError> {
        if let Json::Object(m) = json {
            if let Some(r) = m.get(ATTACHED_TENSOR_KEY) {
                return self.attached_tensor(r, dims, dtype, ty);
            }
            return self.shape_data(m, dims, dtype, ty);
        }
        let rank = dims.len();
        let mut extents: Vec<Option<usize>> = vec![None; rank];
        let mut elems = Elems::new(dtype);
        self.nested(json, 0, dims, dtype, ty, &mut extents, &mut elems)?;
        let shape: Vec<usize> = extents
            .iter()
            .zip(dims)
            .map(|(e, d)| {
                e.unwrap_or_else(|| d.known().and_then(|n| usize::try_from(n).ok()).unwrap_or(0))
            })
            .collect();
        if !crate::bind::shape_matches(dims, &shape) {
            return self.err(format!(
                "expected {ty}, found a tensor of shape {}",
                format_shape(&shape)
            ));
        }
        match Tensor::new(shape, elems.into_buffer()) {
            Ok(t) => Ok(t),
            Err(e) => self.err(format!("expected {ty}: {e}")),
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn nested(
        &mut self,
        json: &Json,
        level: usize,
        dims: &[Dim],
        dtype: DType,
        ty: &Ty,
        extents: &mut [Option<usize>],
        elems: &mut Elems,
    ) -> Result<(), DecodeError> {
        if level == dims.len() {
            return match elems.push(json) {
                Ok(()) => Ok(()),
                Err(why) => {
                    // Described only on failure: this runs once per element of every instance.
                    let what = if level == 0 {
                        ty.to_string()
                    } else {
                        format!("{} {dtype} element of {ty}", article(dtype))
                    };
                    self.err(format!("expected {what}, found {}{why}", describe(json)))
                }
            };
        }
        let Json::Array(a) = json else {
            return if level == 0 {
                self.err(format!("expected {ty}, found {}", describe(json)))
            } else {
                self.err(format!(
                    "expected an array (level {level} of {ty}, which has rank {}), found {}",
                    dims.len(),
                    describe(json)
                ))
            };
        };
        match extents[level] {
            None => extents[level] = Some(a.len()),
            Some(e) if e != a.len() => {
                return self.err(format!(
                    "ragged array: expected {} like the first array at this depth, found {} \
                     (every row of a tensor has the same length)",
                    elements(e),
                    a.len()
                ))
            }
            Some(_) => {}
        }
        // Fail early on a known dim that the data contradicts (before reading all of it).
        if let Some(n) = dims[level].known() {
            if usize::try_from(n).ok() != Some(a.len()) {
                return if level == 0 {
                    self.err(format!("expected {ty}, found {}", describe(json)))
                } else {
                    self.err(format!(
                        "expected an array of {} (dimension {level} of {ty}), found {}",
                        elements(usize::try_from(n).unwrap_or(0)),
                        describe(json)
                    ))
                };
            }
        }
        for (i, j) in a.iter().enumerate() {
            self.path.push(Seg::Index(i));
            self.nested(j, level + 1, dims, dtype, ty, extents, elems)?;
            self.path.pop();
        }
        Ok(())
    }

    /// An attached tensor (a caller's array), taken as it is: its dtype must be the declared
    /// one (no silent casts), its shape must fit the declared dims.
    fn attached_tensor(
        &mut self,
        r: &Json,
        dims: &[Dim],
        dtype: DType,
        ty: &Ty,
    ) -> Result<Tensor, DecodeError> {
        let Some(t) = r
            .as_u64()
            .and_then(|i| usize::try_from(i).ok())
            .and_then(|i| self.attached.get(i))
        else {
            return self.err(format!(
                "expected {ty}, found a reference to an attached tensor that this instance does \
                 not have ({})",
                describe(r)
            ));
        };
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
        Ok(t.clone())
    }

    fn shape_data(
        &mut self,
        m: &serde_json::Map<String, Json>,
        dims: &[Dim],
        dtype: DType,
        ty: &Ty,
    ) -> Result<Tensor, DecodeError> {
        let keys_ok = m.len() == 2 && m.contains_key("shape") && m.contains_key("data");
        let (Some(Json::Array(shape_j)), Some(Json::Array(data)), true) =
            (m.get("shape"), m.get("data"), keys_ok)
        else {
            return self.err(format!(
                "expected {ty} (nested arrays, or {{\"shape\": [...], \"data\": [...]}} with flat \
                 data), found {}",
                describe_map(m)
            ));
        };
        let mut shape = Vec::with_capacity(shape_j.len());
        for d in shape_j {
            match d.as_u64().and_then(|d| usize::try_from(d).ok()) {
                Some(d) => shape.push(d),
                None => {
                    self.path.push(Seg::Field("shape".into()));
                    return self.err(format!(
                        "expected a list of non-negative sizes, found {}",
                        describe(d)
                    ));
                }
            }
        }
        if !crate::bind::shape_matches(dims, &shape) {
            self.path.push(Seg::Field("shape".into()));
            return self.err(format!(
                "expected {ty}, found the shape {}",
                format_shape(&shape)
            ));
        }
        let n = tumble_tensor::shape::num_elements(&shape).ok();
        if n != Some(data.len()) {
            self.path.push(Seg::Field("data".into()));
            return self.err(format!(
                "shape {} needs {} values, found {}",
                format_shape(&shape),
                n.map_or("too many".into(), |n| n.to_string()),
                elements(data.len())
            ));
        }
        let mut elems = Elems::new(dtype);
        self.path.push(Seg::Field("data".into()));
        for (i, j) in data.iter().enumerate() {
            if let Err(why) = elems.push(j) {
                self.path.push(Seg::Index(i));
                return self.err(format!(
                    "expected {} {dtype} element of {ty}, found {}{why}",
                    article(dtype),
                    describe(j)
                ));
            }
        }
        self.path.pop();
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
        match dtype {
            DType::Float32 => Elems::F32(Vec::new()),
            DType::Float64 => Elems::F64(Vec::new()),
            DType::Int32 => Elems::I32(Vec::new()),
            DType::Int64 => Elems::I64(Vec::new()),
            DType::Bool => Elems::Bool(Vec::new()),
        }
    }

    /// Appends one element; on failure returns a suffix explaining why (may be empty).
    fn push(&mut self, j: &Json) -> Result<(), String> {
        let num = || match j {
            Json::Number(n) => Ok(n),
            _ => Err(String::new()),
        };
        match self {
            Elems::F32(v) => {
                let x = num()?.as_f64().ok_or_else(String::new)?;
                let y = x as f32;
                if y.is_infinite() && x.is_finite() {
                    return Err(", which is out of range for float32".into());
                }
                v.push(y);
            }
            Elems::F64(v) => v.push(num()?.as_f64().ok_or_else(String::new)?),
            Elems::I32(v) => {
                let x = integer(num()?, "int32")?;
                v.push(i32::try_from(x).map_err(|_| OUT_OF_RANGE_I32.to_string())?);
            }
            Elems::I64(v) => v.push(integer(num()?, "int64")?),
            Elems::Bool(v) => match j {
                Json::Bool(b) => v.push(*b),
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

/// A JSON number as an exact integer: integral floats like `3.0` are accepted. `dtype` names
/// the target in the out-of-range message.
fn integer(n: &serde_json::Number, dtype: &str) -> Result<i64, String> {
    if let Some(i) = n.as_i64() {
        return Ok(i);
    }
    let out_of_range = format!(", which is out of range for {dtype}");
    if n.as_u64().is_some() {
        return Err(out_of_range);
    }
    let x = n.as_f64().ok_or_else(String::new)?;
    if x.fract() != 0.0 || !x.is_finite() {
        return Err(", which is not an integer".into());
    }
    // Exactly representable range of i64 as f64 is [-2^63, 2^63).
    let two_63 = -(i64::MIN as f64);
    if !(-two_63..two_63).contains(&x) {
        return Err(out_of_range);
    }
    Ok(x as i64)
}

// ---------------------------------------------------------------------------------------------
// Request bodies

/// Instances from a request body `{"<key>": [instance, ...]}` (the TF-Serving / KServe v1
/// `{"instances": [...]}`), located by their index in the array. Same limits and stack use as
/// [`read_instances`]: at most [`MAX_DEPTH`] levels of nesting, parsed with native recursion, so
/// call it from a thread with a large stack.
pub fn read_request_instances(
    body: &[u8],
    key: &str,
    source_name: &str,
) -> Result<RawInstances, IoError> {
    let err = |message: String| IoError::Instances {
        source_name: source_name.to_string(),
        message,
    };
    let text = std::str::from_utf8(body).map_err(|e| {
        err(format!(
            "the body is not valid UTF-8 (invalid byte at offset {})",
            e.valid_up_to()
        ))
    })?;
    if nesting_depth(text, MAX_DEPTH + 2) > MAX_DEPTH + 2 {
        return Err(err(depth_error("the body")));
    }
    let json = parse_json(text).map_err(|e| {
        err(format!(
            "line {}, column {}: not valid JSON: {}",
            e.line(),
            e.column(),
            json_message(&e)
        ))
    })?;
    let mut json = DeepJson(json);
    let found = match &mut json.0 {
        Json::Object(m) => m.remove(key),
        _ => {
            return Err(err(format!(
                "expected a JSON object with the key `{key}` (an array of instances)"
            )))
        }
    };
    let items = match found {
        Some(Json::Array(items)) => items,
        Some(other) => {
            let kind = json_kind(&other);
            drop_json(other);
            return Err(err(format!(
                "`{key}` must be an array of instances, found {kind}"
            )));
        }
        None => return Err(err(format!("the object has no `{key}` array"))),
    };
    Ok(RawInstances {
        source_name: source_name.to_string(),
        items: items
            .into_iter()
            .enumerate()
            .map(|(i, j)| RawInstance {
                location: Location::Index(i),
                json: DeepJson(j),
                attached: Vec::new(),
            })
            .collect(),
    })
}

fn json_kind(v: &Json) -> &'static str {
    match v {
        Json::Null => "null",
        Json::Bool(_) => "a boolean",
        Json::Number(_) => "a number",
        Json::String(_) => "a string",
        Json::Array(_) => "an array",
        Json::Object(_) => "an object",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn depth_scan_ignores_strings_and_escapes() {
        assert_eq!(nesting_depth("1", 10), 0);
        assert_eq!(nesting_depth("[[{}]]", 10), 3);
        assert_eq!(nesting_depth(r#"["[[[", {"a": "\"[["}]"#, 10), 2);
        assert_eq!(nesting_depth(&"[".repeat(100), 10), 11);
        // Unbalanced closers do not underflow.
        assert_eq!(nesting_depth("]]][", 10), 1);
    }

    #[test]
    fn integers() {
        let n = |s: &str| serde_json::from_str::<serde_json::Number>(s).unwrap();
        assert_eq!(integer(&n("-5"), "int64"), Ok(-5));
        assert_eq!(integer(&n("3.0"), "int64"), Ok(3));
        assert_eq!(integer(&n("1e3"), "int64"), Ok(1000));
        assert!(integer(&n("2.5"), "int64")
            .unwrap_err()
            .contains("not an integer"));
        assert!(integer(&n("18446744073709551615"), "int32")
            .unwrap_err()
            .contains("out of range for int32"));
        assert!(integer(&n("1e19"), "int64")
            .unwrap_err()
            .contains("out of range"));
        assert_eq!(integer(&n("-9223372036854775808"), "int64"), Ok(i64::MIN));
    }

    #[test]
    fn deep_json_drops_iteratively() {
        // 1,000,000 levels built by hand (serde would need a huge stack to parse it); dropping
        // it through DeepJson must not recurse.
        let mut v = Json::Null;
        for _ in 0..1_000_000 {
            v = Json::Array(vec![v]);
        }
        drop(DeepJson(v));
    }

    #[test]
    fn sizes() {
        assert_eq!(size_text(256 << 20), "256 MiB");
        assert_eq!(size_text(4096), "4096 bytes");
    }
}
