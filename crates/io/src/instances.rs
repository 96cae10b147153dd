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
use tumble_ir::Ty;
use tumble_tensor::Tensor;

use crate::env::TypeEnv;
use crate::tape::{AnyDoc, Tape};
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

/// An instance's JSON: a line of JSON Lines kept as its text (checked to be valid JSON when
/// read, parsed again when it is decoded: parsed JSON is ~45 times its text, a tree node an object
/// with a map of its own, and a whole file of it held at once was most of a run's memory), with
/// its top-level keys when it is an object (read in the same scan, for
/// [`RawInstances::provided_args`]); or a value parsed with others (an array input, a request's
/// body, a library caller's).
enum Body {
    Text {
        text: Box<str>,
        keys: Option<Box<[String]>>,
    },
    Parsed(DeepJson),
}

/// An instance's parsed JSON (`Deref` to the value), borrowed or parsed from its text for the
/// caller and dropped iteratively with it.
pub struct JsonView<'a>(View<'a>);

enum View<'a> {
    Borrowed(&'a Json),
    Parsed(DeepJson),
}

impl JsonView<'_> {
    /// JSON's `null`, for a caller with no instance at hand.
    pub fn null() -> JsonView<'static> {
        JsonView(View::Parsed(DeepJson(Json::Null)))
    }
}

impl std::ops::Deref for JsonView<'_> {
    type Target = Json;
    fn deref(&self) -> &Json {
        match &self.0 {
            View::Borrowed(j) => j,
            View::Parsed(d) => &d.0,
        }
    }
}

/// An instance's document, borrowed or parsed for the caller ([`RawInstance::doc`]).
pub struct InstanceDoc<'a>(DocBody<'a>);

enum DocBody<'a> {
    Borrowed(&'a Json),
    Parsed(DeepJson),
    Tape(Tape),
}

impl InstanceDoc<'_> {
    /// JSON's `null`, for a caller with no instance at hand.
    pub fn null() -> InstanceDoc<'static> {
        InstanceDoc(DocBody::Parsed(DeepJson(Json::Null)))
    }

    /// The document's top value.
    pub fn root(&self) -> AnyDoc<'_> {
        match &self.0 {
            DocBody::Borrowed(j) => AnyDoc::Json(j),
            DocBody::Parsed(d) => AnyDoc::Json(&d.0),
            DocBody::Tape(t) => AnyDoc::Tape(t.root()),
        }
    }
}

/// `TUMBLE_NO_JSON_TAPE=1`: instances kept as text are parsed into `serde_json::Value`s for
/// decoding, as before tapes.
fn tape_enabled() -> bool {
    !tumble_limits::switch_on!("TUMBLE_NO_JSON_TAPE")
}

/// One instance's JSON, not yet checked against any type.
pub struct RawInstance {
    pub location: Location,
    body: Body,
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
            body: Body::Parsed(DeepJson(json)),
            attached,
        }
    }

    /// The instance's JSON (parsed now when it was kept as text). Its syntax was checked when it
    /// was read; what fails here is a value the syntax allows but a JSON value cannot hold (a
    /// number out of range, `1e400`).
    pub fn json(&self) -> Result<JsonView<'_>, String> {
        match &self.body {
            Body::Parsed(d) => Ok(JsonView(View::Borrowed(&d.0))),
            Body::Text { text, .. } => {
                reserve_for_json(text.len())?;
                parse_json(text)
                    .map(|j| JsonView(View::Parsed(DeepJson(j))))
                    .map_err(|e| format!("the instance's JSON cannot be read: {e}"))
            }
        }
    }

    /// The instance's document for decoding: the value it was parsed into, or its text parsed
    /// now into a [`Tape`] — flat tables instead of a `Value` per node, which cost SST trees more
    /// to build and drop than decoding them (`TUMBLE_NO_JSON_TAPE=1` parses a `Value` instead;
    /// the values and messages are the same). Errors as [`RawInstance::json`]'s.
    pub fn doc(&self) -> Result<InstanceDoc<'_>, String> {
        match &self.body {
            Body::Parsed(d) => Ok(InstanceDoc(DocBody::Borrowed(&d.0))),
            Body::Text { text, .. } => {
                reserve_for_json(text.len())?;
                let cannot =
                    |e: serde_json::Error| format!("the instance's JSON cannot be read: {e}");
                if tape_enabled() {
                    Tape::parse(text)
                        .map(|t| InstanceDoc(DocBody::Tape(t)))
                        .map_err(cannot)
                } else {
                    parse_json(text)
                        .map(|j| InstanceDoc(DocBody::Parsed(DeepJson(j))))
                        .map_err(cannot)
                }
            }
        }
    }

    /// Whether the instance is JSON's `null` (not an instance).
    pub fn is_null(&self) -> bool {
        match &self.body {
            Body::Parsed(d) => d.0.is_null(),
            Body::Text { text, .. } => text.trim() == "null",
        }
    }

    /// The keys of the instance's top-level object (`None` for a bare value).
    fn top_keys(&self) -> Option<Vec<&str>> {
        match &self.body {
            Body::Parsed(d) => {
                d.0.as_object()
                    .map(|m| m.keys().map(String::as_str).collect())
            }
            Body::Text { keys, .. } => keys
                .as_ref()
                .map(|ks| ks.iter().map(String::as_str).collect()),
        }
    }

    /// The tensors the JSON refers to by [`ATTACHED_TENSOR_KEY`] objects.
    pub fn attached(&self) -> &[Tensor] {
        &self.attached
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
            // A line of hundreds of megabytes stops at the memory budget while it is read, not
            // after it has been read and parsed (which takes many times its size).
            if buf.capacity() - buf.len() < take {
                let more = take.max(buf.capacity());
                if let Err(stop) = tumble_limits::reserve(more) {
                    return Err(self.err(format!(
                        "line {}: {stop} while reading it ({} read so far)",
                        self.line_no + 1,
                        tumble_limits::bytes_text(buf.len())
                    )));
                }
            }
            buf.extend_from_slice(&chunk[..take]);
            self.reader.consume(take);
            if done {
                break;
            }
        }
        self.line_no += 1;
        // A byte order mark some editors put first (`.rly` files accept it too).
        if self.line_no == 1 && buf.starts_with(b"\xEF\xBB\xBF") {
            buf.drain(..3);
        }
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

/// Bytes a parsed JSON document may take per byte of its text: a number of two characters is a
/// 32-byte value, in an array grown by doubling (a 120 MB line of numbers took 4.1 GB). Parsing
/// builds the whole document at once, so the memory budget is asked for this much first
/// ([`reserve_for_json`]).
pub const PARSED_BYTES_PER_TEXT_BYTE: usize = 32;

/// Checks that parsing `len` bytes of JSON fits the memory budget.
pub fn reserve_for_json(len: usize) -> Result<(), String> {
    tumble_limits::reserve(len.saturating_mul(PARSED_BYTES_PER_TEXT_BYTE)).map_err(|stop| {
        format!(
            "{} of JSON would not fit once parsed: {stop}",
            tumble_limits::bytes_text(len)
        )
    })
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

/// Checks that `text` is one JSON document, as [`parse_json`] would, without building it; an
/// object's top-level keys come out of the same scan.
fn check_json(text: &str) -> Result<Option<Box<[String]>>, serde_json::Error> {
    let mut de = serde_json::Deserializer::from_str(text);
    de.disable_recursion_limit();
    let keys = if text.trim_start().starts_with('{') {
        let DistinctKeys(mut keys) = DistinctKeys::deserialize(&mut de)?;
        keys.sort_unstable();
        Some(keys.into_boxed_slice())
    } else {
        serde::de::IgnoredAny::deserialize(&mut de)?;
        None
    };
    de.end()?;
    Ok(keys)
}

/// A JSON object's keys, each once: a key given twice is an error (serde_json's own maps keep
/// the last value silently, so `{"x": 1, "x": 2}` ran with x = 2).
struct DistinctKeys(Vec<String>);

impl<'de> Deserialize<'de> for DistinctKeys {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Keys;
        impl<'de> serde::de::Visitor<'de> for Keys {
            type Value = DistinctKeys;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(
                self,
                m: A,
            ) -> Result<DistinctKeys, A::Error> {
                distinct_entries(m, "", |_, m| {
                    m.next_value::<serde::de::IgnoredAny>().map(drop)
                })
                .map(DistinctKeys)
            }
        }
        d.deserialize_map(Keys)
    }
}

/// A map's keys in order, each value read by `value` (given the key), refusing a key given twice
/// ("the key `x` is given twice{place}").
fn distinct_entries<'de, A: serde::de::MapAccess<'de>>(
    mut m: A,
    place: &str,
    mut value: impl FnMut(&str, &mut A) -> Result<(), A::Error>,
) -> Result<Vec<String>, A::Error> {
    let mut keys = Vec::new();
    let mut seen = std::collections::HashSet::new();
    while let Some(k) = m.next_key::<String>()? {
        value(&k, &mut m)?;
        if !seen.insert(k.clone()) {
            return Err(serde::de::Error::custom(format!(
                "the key `{}` is given twice{place}",
                crate::echo(&k)
            )));
        }
        keys.push(k);
    }
    Ok(keys)
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
    let keys = check_json(text).map_err(|e| {
        lines.err(format!(
            "line {no}, column {}: not valid JSON: {}",
            e.column(),
            json_message(&e)
        ))
    })?;
    Ok(RawInstance {
        location: Location::Line(no),
        body: Body::Text {
            text: text.into(),
            keys,
        },
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
                    body: Body::Parsed(DeepJson(j)),
                    attached: Vec::new(),
                })
                .collect(),
        }
    };
    // The first line on its own is a complete JSON value: the input is an array only if nothing
    // else follows.
    reserve_for_json(first.len()).map_err(|m| lines.err(format!("line {first_no}: {m}")))?;
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
                body: Body::Parsed(json),
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
    reserve_for_json(text.len()).map_err(|m| lines.err(format!("the JSON array: {m}")))?;
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
            match item.top_keys() {
                Some(ks) => {
                    let mut any = false;
                    for &k in &ks {
                        any |= names.contains(k);
                        keys.insert(k.to_string());
                    }
                    bare |= !any && !ks.is_empty();
                }
                None => bare = true,
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
        let instance_error = |path: String, message: String| IoError::Instance {
            source_name: self.source_name.clone(),
            location: item.location.to_string(),
            path,
            message,
        };
        let doc = item.doc().map_err(|m| instance_error(String::new(), m))?;
        crate::decode::decode_instance(&doc.root(), &item.attached, env, args)
            .map_err(|e| instance_error(e.path, e.message))
    }
}

// ---------------------------------------------------------------------------------------------
// Request bodies

/// Whether a body of `len` bytes of JSON could never be parsed within the whole memory budget
/// (what [`read_request_instances`] would refuse as too large once it had it): a server can
/// refuse it from its declared length, before reading it.
pub fn body_never_fits(len: u64) -> bool {
    let parsed = len.saturating_mul(PARSED_BYTES_PER_TEXT_BYTE as u64);
    tumble_limits::limit().is_some_and(|limit| parsed > limit as u64)
}

/// Instances from a request body `{"<key>": [instance, ...]}` (the TF-Serving / KServe v1
/// `{"instances": [...]}`), located by their index in the array. Same limits and stack use as
/// [`read_instances`]: at most [`MAX_DEPTH`] levels of nesting, parsed with native recursion, so
/// call it from a thread with a large stack.
pub fn read_request_instances(
    body: &[u8],
    key: &str,
    source_name: &str,
) -> Result<RawInstances, IoError> {
    read_request_instances_at_most(body, key, source_name, usize::MAX, "")
}

/// [`read_request_instances`] refusing a body of more than `max` instances
/// ([`IoError::TooLarge`], `limit` naming the limit in its message) before anything is built:
/// found by the walk that checks the body's keys, which allocates nothing, where parsing a body
/// of 845,070 small trees took 10.7 s and 3 GB only to be refused.
pub fn read_request_instances_at_most(
    body: &[u8],
    key: &str,
    source_name: &str,
    max: usize,
    limit: &str,
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
    // A byte order mark, as instance files may start with one.
    let text = text.strip_prefix('\u{feff}').unwrap_or(text);
    if nesting_depth(text, MAX_DEPTH + 2) > MAX_DEPTH + 2 {
        return Err(err(depth_error("the body")));
    }
    reserve_for_json(text.len()).map_err(|m| {
        let (source_name, message) = (source_name.to_string(), format!("the body: {m}"));
        // Past the whole budget it can never be taken; within it, once memory is free again.
        let parsed = text.len().saturating_mul(PARSED_BYTES_PER_TEXT_BYTE);
        match tumble_limits::limit().is_some_and(|limit| parsed > limit) {
            true => IoError::TooLarge {
                source_name,
                message,
            },
            false => IoError::NoRoomNow {
                source_name,
                message,
            },
        }
    })?;
    let located = |e: serde_json::Error| {
        err(format!(
            "line {}, column {}: not valid JSON: {}",
            e.line(),
            e.column(),
            json_message(&e)
        ))
    };
    // A key given twice — in the body, or at the top of an instance — is an error, as it is in
    // an instance file (serde_json's maps keep the last value silently).
    let too_many = std::cell::Cell::new(false);
    if let Err(e) = check_request_keys(text, key, max, &too_many) {
        return Err(match too_many.get() {
            true => IoError::TooLarge {
                source_name: source_name.to_string(),
                message: format!(
                    "the request has more than {max} instances, the most taken at once{limit}"
                ),
            },
            false => located(e),
        });
    }
    let json = parse_json(text).map_err(located)?;
    let mut json = DeepJson(json);
    let found = match &mut json.0 {
        Json::Object(m) => {
            // TF-Serving's other request forms, refused by name rather than ignored: the
            // columnar `inputs` (alone it read as "no `instances`"; beside `instances` it was
            // dropped silently), and a signature other than the one a model has.
            if m.contains_key("inputs") {
                return Err(err(format!(
                    "the columnar `inputs` form is not taken; send `{key}`: an array with one \
                     object per instance, keyed by the model's argument names"
                )));
            }
            match m.get("signature_name") {
                None => {}
                Some(Json::String(s)) if s == "serving_default" => {}
                Some(other) => {
                    return Err(err(format!(
                        "signature_name {}: a model served here has one signature, \
                         \"serving_default\"",
                        tumble_limits::echo(&other.to_string())
                    )))
                }
            }
            m.remove(key)
        }
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
                body: Body::Parsed(DeepJson(j)),
                attached: Vec::new(),
            })
            .collect(),
    })
}

/// Checks that no object key is given twice at the top of a request body or at the top of one
/// of the instances under `key`, without building anything.
/// More than `max` instances stop the walk with an error, `too_many` set.
fn check_request_keys(
    text: &str,
    key: &str,
    max: usize,
    too_many: &std::cell::Cell<bool>,
) -> Result<(), serde_json::Error> {
    use serde::de::{DeserializeSeed, IgnoredAny, MapAccess, SeqAccess, Visitor};

    /// A visitor's scalars: nothing to check.
    macro_rules! scalars_pass {
        () => {
            fn visit_bool<E>(self, _: bool) -> Result<(), E> {
                Ok(())
            }
            fn visit_i64<E>(self, _: i64) -> Result<(), E> {
                Ok(())
            }
            fn visit_u64<E>(self, _: u64) -> Result<(), E> {
                Ok(())
            }
            fn visit_f64<E>(self, _: f64) -> Result<(), E> {
                Ok(())
            }
            fn visit_str<E>(self, _: &str) -> Result<(), E> {
                Ok(())
            }
            fn visit_unit<E>(self) -> Result<(), E> {
                Ok(())
            }
        };
    }

    /// A visitor of any value, as the seed of an element or entry.
    struct Seed<V>(V);
    impl<'de, V: Visitor<'de, Value = ()>> DeserializeSeed<'de> for Seed<V> {
        type Value = ();
        fn deserialize<D: serde::Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
            d.deserialize_any(self.0)
        }
    }

    /// An instance: an object's keys distinct, anything else skipped.
    struct Instance;
    impl<'de> Visitor<'de> for Instance {
        type Value = ();
        fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
            f.write_str("an instance")
        }
        fn visit_map<A: MapAccess<'de>>(self, m: A) -> Result<(), A::Error> {
            distinct_entries(m, " in an instance", |_, m| {
                m.next_value::<IgnoredAny>().map(drop)
            })
            .map(drop)
        }
        fn visit_seq<A: SeqAccess<'de>>(self, mut s: A) -> Result<(), A::Error> {
            while s.next_element::<IgnoredAny>()?.is_some() {}
            Ok(())
        }
        scalars_pass!();
    }

    /// The instances' array: each element an [`Instance`], at most `.0` of them (`.1` set past).
    struct Instances<'c>(usize, &'c std::cell::Cell<bool>);
    impl<'de> Visitor<'de> for Instances<'_> {
        type Value = ();
        fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
            f.write_str("an array of instances")
        }
        fn visit_seq<A: SeqAccess<'de>>(self, mut s: A) -> Result<(), A::Error> {
            let mut n = 0usize;
            while s.next_element_seed(Seed(Instance))?.is_some() {
                n += 1;
                if n > self.0 {
                    self.1.set(true);
                    return Err(serde::de::Error::custom("too many instances"));
                }
            }
            Ok(())
        }
        // Anything else is reported (with its kind) once the body is parsed.
        fn visit_map<A: MapAccess<'de>>(self, mut m: A) -> Result<(), A::Error> {
            while m.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
            Ok(())
        }
        scalars_pass!();
    }

    /// The body: its keys distinct, the value under `key` read as [`Instances`].
    struct Body<'k>(&'k str, usize, &'k std::cell::Cell<bool>);
    impl<'de> Visitor<'de> for Body<'_> {
        type Value = ();
        fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
            f.write_str("a request body")
        }
        fn visit_map<A: MapAccess<'de>>(self, m: A) -> Result<(), A::Error> {
            distinct_entries(m, "", |k, m| match k == self.0 {
                true => m.next_value_seed(Seed(Instances(self.1, self.2))),
                false => m.next_value::<IgnoredAny>().map(drop),
            })
            .map(drop)
        }
        fn visit_seq<A: SeqAccess<'de>>(self, mut s: A) -> Result<(), A::Error> {
            while s.next_element::<IgnoredAny>()?.is_some() {}
            Ok(())
        }
        scalars_pass!();
    }

    let mut de = serde_json::Deserializer::from_str(text);
    de.disable_recursion_limit();
    serde::Deserializer::deserialize_any(&mut de, Body(key, max, too_many))?;
    de.end()
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
    fn deep_json_drops_iteratively() {
        // 1,000,000 levels built by hand (serde would need a huge stack to parse it); dropping
        // it through DeepJson must not recurse.
        let mut v = Json::Null;
        for _ in 0..1_000_000 {
            v = Json::Array(vec![v]);
        }
        drop(DeepJson(v));
    }

    // JSON Lines instances are kept as text: what is read from them (their keys, whether one is
    // `null`, their parsed JSON, their places) is what the parsed form gives.
    #[test]
    fn instances_kept_as_text_read_as_parsed_ones() {
        let lines = "{\"x\": [1, 2], \"t\": {\"Rose\": [3, []]}}\n\n[4, 5]\nnull\n{}\n";
        let text = read_instances(lines.as_bytes(), "<test>").unwrap();
        let docs: Vec<Json> = lines
            .lines()
            .filter(|l| !l.trim().is_empty())
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        assert_eq!(text.items.len(), docs.len());
        for (item, doc) in text.items.iter().zip(&docs) {
            assert!(matches!(item.body, Body::Text { .. }));
            assert_eq!(&*item.json().unwrap(), doc);
            assert_eq!(item.is_null(), doc.is_null());
            let parsed = RawInstance::with_tensors(item.location, doc.clone(), Vec::new());
            assert_eq!(item.top_keys(), parsed.top_keys());
        }
        assert_eq!(
            text.items.iter().map(|i| i.location).collect::<Vec<_>>(),
            [1, 3, 4, 5].map(Location::Line)
        );
    }

    #[test]
    fn sizes() {
        assert_eq!(size_text(256 << 20), "256 MiB");
        assert_eq!(size_text(4096), "4096 bytes");
    }
}
