//! An instance's JSON parsed into flat tables instead of a tree of `serde_json::Value`s.
//!
//! A `Value` tree allocates per node (an object's `BTreeMap`, its key `String`s, an array's
//! `Vec`) and frees them all again after decoding: for SST trees — an object per tree node —
//! parsing and dropping it cost more than decoding the values out of it. A [`Tape`] holds every
//! node in one vector, arrays' children and objects' entries in two more, and every string's text
//! in one `String`: a handful of allocations per instance, and no recursion to drop it.
//!
//! It is built by serde_json's own deserializer, so the syntax it accepts, its numbers (the
//! nearest double: `float_roundtrip`) and its error messages (line and column) are those of the
//! `Value` path; [`TapeNode`] is a [`Doc`] that answers every question exactly as `&Value` does —
//! an object's keys in byte order, a key given twice keeping its last value (a `Value`'s map), a
//! float that is not finite read as `null` — so decoding gives the same values and the same
//! messages either way (`tape::tests`, and `TUMBLE_NO_JSON_TAPE=1` to decode through `Value`s).

use std::borrow::Cow;
use std::fmt;

use serde::de::{self, DeserializeSeed, MapAccess, SeqAccess, Visitor};

use crate::decode::{array_text, object_text, shorten, Doc, Kind, Num};
use crate::instances::ATTACHED_TENSOR_KEY;

/// One JSON value. Containers point into [`Tape::kids`] / [`Tape::entries`], strings into
/// [`Tape::text`].
#[derive(Clone, Copy, Debug)]
enum Node {
    Null,
    Bool(bool),
    /// A negative integer (serde_json's `visit_i64`).
    Int(i64),
    /// A non-negative integer.
    UInt(u64),
    /// A finite float.
    Float(f64),
    Str(Span),
    /// `kids[at .. at + len]`.
    Array(Span),
    /// `entries[at .. at + len]`: sorted by key, each key once.
    Object(Span),
}

/// A range `at .. at + len` of one of the tape's tables.
#[derive(Clone, Copy, Debug)]
struct Span {
    at: u32,
    len: u32,
}

impl Span {
    fn range(self) -> std::ops::Range<usize> {
        self.at as usize..self.at as usize + self.len as usize
    }
}

/// An object's entry: its key's text and its value's node.
#[derive(Clone, Copy, Debug)]
struct Entry {
    key: Span,
    node: u32,
}

/// A parsed JSON document (see the module's documentation).
#[derive(Debug, Default)]
pub struct Tape {
    nodes: Vec<Node>,
    kids: Vec<u32>,
    entries: Vec<Entry>,
    text: String,
    root: u32,
}

impl Tape {
    /// Parses one JSON document, as `serde_json::from_str::<Value>` would (its recursion limit
    /// off: the caller bounds the nesting).
    pub fn parse(text: &str) -> Result<Tape, serde_json::Error> {
        let mut de = serde_json::Deserializer::from_str(text);
        de.disable_recursion_limit();
        // Sized for an SST tree's text (a node and a child per ~8 bytes, an object's entry and
        // a key's 4 bytes per ~20): the tables grow by doubling otherwise, a reallocation and copy
        // each time — half of building a small tape.
        let mut b = Builder {
            tape: Tape {
                nodes: Vec::with_capacity(text.len() / 8 + 1),
                kids: Vec::with_capacity(text.len() / 8 + 1),
                entries: Vec::with_capacity(text.len() / 20 + 1),
                text: String::with_capacity(text.len() / 5 + 1),
                root: 0,
            },
            kids: Vec::with_capacity(64),
            entries: Vec::with_capacity(16),
        };
        let root = Seed(&mut b).deserialize(&mut de)?;
        de.end()?;
        b.tape.root = root;
        Ok(b.tape)
    }

    /// The document's top value.
    pub fn root(&self) -> TapeNode<'_> {
        TapeNode {
            tape: self,
            id: self.root,
        }
    }

    fn node(&self, id: u32) -> Node {
        self.nodes.get(id as usize).copied().unwrap_or(Node::Null)
    }

    fn str_at(&self, s: Span) -> &str {
        self.text.get(s.range()).unwrap_or("")
    }

    fn entries_of(&self, s: Span) -> &[Entry] {
        self.entries.get(s.range()).unwrap_or(&[])
    }
}

/// Builds a [`Tape`]: the children of the containers being read wait on two stacks until their
/// container ends (its entries then sorted and deduplicated), so each container's children lie
/// together in the tape's tables.
struct Builder {
    tape: Tape,
    kids: Vec<u32>,
    entries: Vec<Entry>,
}

fn index<E: de::Error>(n: usize) -> Result<u32, E> {
    u32::try_from(n)
        .map_err(|_| E::custom("the document is too large to decode (over 2^32 values)"))
}

impl Builder {
    fn push<E: de::Error>(&mut self, n: Node) -> Result<u32, E> {
        let id = index::<E>(self.tape.nodes.len())?;
        self.tape.nodes.push(n);
        Ok(id)
    }

    fn text<E: de::Error>(&mut self, s: &str) -> Result<Span, E> {
        let at = index::<E>(self.tape.text.len())?;
        self.tape.text.push_str(s);
        Ok(Span {
            at,
            len: index::<E>(s.len())?,
        })
    }
}

/// Reads one value into the builder; its node's index is the result.
struct Seed<'b>(&'b mut Builder);

impl<'de> DeserializeSeed<'de> for Seed<'_> {
    type Value = u32;
    fn deserialize<D: de::Deserializer<'de>>(self, d: D) -> Result<u32, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for Seed<'_> {
    type Value = u32;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("any valid JSON value")
    }

    fn visit_bool<E: de::Error>(self, v: bool) -> Result<u32, E> {
        self.0.push(Node::Bool(v))
    }

    fn visit_i64<E: de::Error>(self, v: i64) -> Result<u32, E> {
        // `Value` keeps a non-negative one as a positive integer: so does the tape.
        self.0.push(match u64::try_from(v) {
            Ok(u) => Node::UInt(u),
            Err(_) => Node::Int(v),
        })
    }

    fn visit_u64<E: de::Error>(self, v: u64) -> Result<u32, E> {
        self.0.push(Node::UInt(v))
    }

    fn visit_f64<E: de::Error>(self, v: f64) -> Result<u32, E> {
        // `Value`'s own rule: a float a `Number` cannot hold is `null`.
        self.0.push(if v.is_finite() {
            Node::Float(v)
        } else {
            Node::Null
        })
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<u32, E> {
        let s = self.0.text(v)?;
        self.0.push(Node::Str(s))
    }

    fn visit_unit<E: de::Error>(self) -> Result<u32, E> {
        self.0.push(Node::Null)
    }

    fn visit_none<E: de::Error>(self) -> Result<u32, E> {
        self.0.push(Node::Null)
    }

    fn visit_some<D: de::Deserializer<'de>>(self, d: D) -> Result<u32, D::Error> {
        d.deserialize_any(self)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<u32, A::Error> {
        let b = self.0;
        let start = b.kids.len();
        while let Some(id) = seq.next_element_seed(Seed(&mut *b))? {
            b.kids.push(id);
        }
        let at = index::<A::Error>(b.tape.kids.len())?;
        let len = index::<A::Error>(b.kids.len() - start)?;
        b.tape.kids.extend(b.kids.drain(start..));
        b.push(Node::Array(Span { at, len }))
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<u32, A::Error> {
        let b = self.0;
        let start = b.entries.len();
        while let Some(key) = map.next_key_seed(KeySeed(&mut *b))? {
            let node = map.next_value_seed(Seed(&mut *b))?;
            b.entries.push(Entry { key, node });
        }
        // A `Value`'s map: keys in byte order, a repeated key's last value (a stable sort keeps
        // equal keys in the order they came; the last of each run stays).
        let Builder { tape, entries, .. } = &mut *b;
        let text = &tape.text;
        let key = |e: &Entry| text.get(e.key.range()).unwrap_or("");
        let own = &mut entries[start..];
        own.sort_by(|x, y| key(x).cmp(key(y)));
        let at = index::<A::Error>(tape.entries.len())?;
        for (i, e) in own.iter().enumerate() {
            if own.get(i + 1).is_some_and(|next| key(next) == key(e)) {
                continue;
            }
            tape.entries.push(*e);
        }
        let len = index::<A::Error>(tape.entries.len() - at as usize)?;
        entries.truncate(start);
        b.push(Node::Object(Span { at, len }))
    }
}

/// Reads an object's key into the builder's text.
struct KeySeed<'b>(&'b mut Builder);

impl<'de> DeserializeSeed<'de> for KeySeed<'_> {
    type Value = Span;
    fn deserialize<D: de::Deserializer<'de>>(self, d: D) -> Result<Span, D::Error> {
        d.deserialize_str(self)
    }
}

impl<'de> Visitor<'de> for KeySeed<'_> {
    type Value = Span;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a string key")
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<Span, E> {
        self.0.text(v)
    }
}

/// A value of a [`Tape`]: the [`Doc`] the decoder reads.
#[derive(Clone, Copy)]
pub struct TapeNode<'t> {
    tape: &'t Tape,
    id: u32,
}

impl<'t> TapeNode<'t> {
    fn node(&self) -> Node {
        self.tape.node(self.id)
    }

    fn at(&self, id: u32) -> TapeNode<'t> {
        TapeNode {
            tape: self.tape,
            id,
        }
    }

    fn entries(&self) -> &'t [Entry] {
        match self.node() {
            Node::Object(s) => self.tape.entries_of(s),
            _ => &[],
        }
    }

    fn key(&self, e: &Entry) -> &'t str {
        self.tape.str_at(e.key)
    }

    /// The number as `serde_json` holds it, for its text in messages.
    fn number(&self) -> Option<serde_json::Number> {
        match self.node() {
            Node::Int(i) => Some(i.into()),
            Node::UInt(u) => Some(u.into()),
            Node::Float(f) => serde_json::Number::from_f64(f),
            _ => None,
        }
    }
}

impl Doc for TapeNode<'_> {
    fn kind(&self) -> Result<Kind, String> {
        Ok(match self.node() {
            Node::Null => Kind::Null,
            Node::Bool(_) => Kind::Bool,
            Node::Int(_) | Node::UInt(_) | Node::Float(_) => Kind::Number,
            Node::Str(_) => Kind::String,
            Node::Array(_) => Kind::Array,
            Node::Object(_) => Kind::Object,
        })
    }

    fn as_bool(&self) -> Option<bool> {
        match self.node() {
            Node::Bool(b) => Some(b),
            _ => None,
        }
    }

    fn as_number(&self) -> Option<Num> {
        match self.node() {
            Node::Int(i) => Some(Num::Int(i)),
            Node::UInt(u) => Some(i64::try_from(u).map_or(Num::UInt(u), Num::Int)),
            Node::Float(f) => Some(Num::Float(f)),
            _ => None,
        }
    }

    fn as_str(&self) -> Option<Cow<'_, str>> {
        match self.node() {
            Node::Str(s) => Some(Cow::Borrowed(self.tape.str_at(s))),
            _ => None,
        }
    }

    fn array_len(&self) -> usize {
        match self.node() {
            Node::Array(s) => s.len as usize,
            _ => 0,
        }
    }

    fn item(&self, i: usize) -> Option<Self> {
        match self.node() {
            Node::Array(s) if i < s.len as usize => {
                let id = *self.tape.kids.get(s.at as usize + i)?;
                Some(self.at(id))
            }
            _ => None,
        }
    }

    fn keys(&self) -> Vec<String> {
        self.entries()
            .iter()
            .map(|e| self.key(e).to_string())
            .collect()
    }

    fn get(&self, key: &str) -> Option<Self> {
        let entries = self.entries();
        let i = entries.binary_search_by(|e| self.key(e).cmp(key)).ok()?;
        entries.get(i).map(|e| self.at(e.node))
    }

    fn single_entry(&self) -> Option<(Cow<'_, str>, Self)> {
        match self.entries() {
            [e] => Some((Cow::Borrowed(self.key(e)), self.at(e.node))),
            _ => None,
        }
    }

    fn tensor(&self) -> Option<Result<tumble_tensor::Tensor, String>> {
        None
    }

    fn describe(&self) -> String {
        // The words of `decode::describe` for the `Value` this node would be.
        match self.node() {
            Node::Null => "null".into(),
            Node::Bool(b) => format!("the boolean {b}"),
            Node::Int(_) | Node::UInt(_) | Node::Float(_) => match self.number() {
                Some(n) => format!("the number {n}"),
                None => "null".into(),
            },
            Node::Str(s) => format!("the string {:?}", shorten(self.tape.str_at(s), 40)),
            Node::Array(s) => array_text(s.len as usize),
            Node::Object(_) => {
                let entries = self.entries();
                match entries {
                    [e] if self.key(e) == ATTACHED_TENSOR_KEY => "an n-dimensional array".into(),
                    _ => object_text(entries.iter().map(|e| self.key(e))),
                }
            }
        }
    }
}

/// An instance's document: a `Value` parsed with others (an array input, a request's body, a
/// library caller's), or a line's [`Tape`].
#[derive(Clone, Copy)]
pub enum AnyDoc<'a> {
    Json(&'a serde_json::Value),
    Tape(TapeNode<'a>),
}

impl Doc for AnyDoc<'_> {
    fn kind(&self) -> Result<Kind, String> {
        match self {
            AnyDoc::Json(j) => Doc::kind(j),
            AnyDoc::Tape(t) => t.kind(),
        }
    }

    fn as_bool(&self) -> Option<bool> {
        match self {
            AnyDoc::Json(j) => Doc::as_bool(j),
            AnyDoc::Tape(t) => t.as_bool(),
        }
    }

    fn as_number(&self) -> Option<Num> {
        match self {
            AnyDoc::Json(j) => Doc::as_number(j),
            AnyDoc::Tape(t) => t.as_number(),
        }
    }

    fn as_str(&self) -> Option<Cow<'_, str>> {
        match self {
            AnyDoc::Json(j) => Doc::as_str(j),
            AnyDoc::Tape(t) => t.as_str(),
        }
    }

    fn array_len(&self) -> usize {
        match self {
            AnyDoc::Json(j) => Doc::array_len(j),
            AnyDoc::Tape(t) => t.array_len(),
        }
    }

    fn item(&self, i: usize) -> Option<Self> {
        match self {
            AnyDoc::Json(j) => Doc::item(j, i).map(AnyDoc::Json),
            AnyDoc::Tape(t) => t.item(i).map(AnyDoc::Tape),
        }
    }

    fn keys(&self) -> Vec<String> {
        match self {
            AnyDoc::Json(j) => Doc::keys(j),
            AnyDoc::Tape(t) => t.keys(),
        }
    }

    fn get(&self, key: &str) -> Option<Self> {
        match self {
            AnyDoc::Json(j) => Doc::get(j, key).map(AnyDoc::Json),
            AnyDoc::Tape(t) => t.get(key).map(AnyDoc::Tape),
        }
    }

    fn single_entry(&self) -> Option<(Cow<'_, str>, Self)> {
        match self {
            AnyDoc::Json(j) => Doc::single_entry(j).map(|(k, v)| (k, AnyDoc::Json(v))),
            AnyDoc::Tape(t) => t.single_entry().map(|(k, v)| (k, AnyDoc::Tape(v))),
        }
    }

    fn tensor(&self) -> Option<Result<tumble_tensor::Tensor, String>> {
        None
    }

    fn describe(&self) -> String {
        match self {
            AnyDoc::Json(j) => Doc::describe(j),
            AnyDoc::Tape(t) => t.describe(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::Value as Json;

    /// Everything a decoder can ask of `d` and of every value inside it, as text.
    fn walk<D: Doc>(d: &D, out: &mut String) {
        use std::fmt::Write;
        let _ = write!(
            out,
            "[{:?} {:?} {:?} {:?} {} {:?} {:?} {:?}",
            d.kind(),
            d.as_bool(),
            d.as_number().map(|n| format!("{n:?}")),
            d.as_str(),
            d.array_len(),
            d.keys(),
            d.single_entry().map(|(k, _)| k.into_owned()),
            d.describe(),
        );
        for i in 0..d.array_len() + 1 {
            if let Some(item) = d.item(i) {
                walk(&item, out);
            } else {
                out.push_str(" none");
            }
        }
        for k in d.keys().iter().map(String::as_str).chain(["", "missing"]) {
            let _ = write!(out, " {k:?}:");
            match d.get(k) {
                Some(v) => walk(&v, out),
                None => out.push_str("none"),
            }
        }
        if let Some((_, v)) = d.single_entry() {
            walk(&v, out);
        }
        out.push(']');
    }

    fn both(text: &str) -> (Result<String, String>, Result<String, String>) {
        let via_value = serde_json::from_str::<Json>(text)
            .map(|j| {
                let mut s = String::new();
                walk(&&j, &mut s);
                s
            })
            .map_err(|e| e.to_string());
        let via_tape = Tape::parse(text)
            .map(|t| {
                let mut s = String::new();
                walk(&t.root(), &mut s);
                s
            })
            .map_err(|e| e.to_string());
        (via_value, via_tape)
    }

    #[test]
    fn a_tape_answers_as_a_value_does() {
        for text in [
            r#"{"tree": {"Rose": [[0], [{"Rose": [[7707], []]}, {"Rose": [[17], []]}]]}}"#,
            r#"{"b": 1, "a": 2, "b": 3, "\u0001tensor": 0}"#,
            r#"{"a": {"x": 1, "x": [1, 2], "x": {"y": null}}}"#,
            r#"{"\u0001tensor": 3}"#,
            r#"[1, -1, 0, -0, -0.0, 1.5, 2e10, 1e-320, 18446744073709551615, -9223372036854775808, 9223372036854775808, 1E400]"#,
            r#"[1e400]"#,
            r#"["a\"b\\c\u00e9\ud83d\ude00", "", "0123456789012345678901234567890123456789xyz", true, false, null]"#,
            r#"{"": [], "é": {}, "Z": 1, "a": 2, "aa": 3}"#,
            r#"[[[[]]], {}, [{}], {"k": [[], [[]]]}]"#,
            r#"  7  "#,
            r#""just a string""#,
            r#"[1, 2,]"#,
            r#"{"a" 1}"#,
            r#"[1] [2]"#,
            r#"{"a": 1"#,
            "",
            r#"[0.1, 0.30000000000000004, 123456789.123456789, 3.4028235e38, 3.5e38, 1.17549435e-38]"#,
        ] {
            let (value, tape) = both(text);
            assert_eq!(value, tape, "{text}");
        }
    }

    #[test]
    fn a_tape_of_many_keys_reads_each() {
        let text = format!(
            "{{{}}}",
            (0..300)
                .rev()
                .map(|i| format!("\"k{i}\": {i}"))
                .collect::<Vec<_>>()
                .join(", ")
        );
        let (value, tape) = both(&text);
        assert_eq!(value, tape);
        let t = Tape::parse(&text).unwrap();
        assert_eq!(
            t.root().get("k123").and_then(|v| v.as_number()),
            Some(Num::Int(123))
        );
    }

    mod generated {
        use super::*;
        use proptest::prelude::*;

        /// JSON text: numbers of every kind, strings with escapes, nested arrays and objects
        /// whose keys repeat.
        fn json_text() -> impl Strategy<Value = String> {
            let leaf = prop_oneof![
                Just("null".to_string()),
                any::<bool>().prop_map(|b| b.to_string()),
                any::<i64>().prop_map(|i| i.to_string()),
                any::<u64>().prop_map(|u| u.to_string()),
                any::<f64>().prop_map(|f| format!("{f:e}")),
                any::<f32>().prop_map(|f| f.to_string()),
                "[a-c\\\\\"é]{0,3}".prop_map(|s| serde_json::to_string(&s).unwrap_or_default()),
            ];
            leaf.prop_recursive(4, 48, 6, |inner| {
                prop_oneof![
                    prop::collection::vec(inner.clone(), 0..6)
                        .prop_map(|v| format!("[{}]", v.join(","))),
                    prop::collection::vec(("[a-c]{0,2}", inner), 0..6).prop_map(|v| {
                        let body: Vec<String> =
                            v.into_iter().map(|(k, x)| format!("\"{k}\":{x}")).collect();
                        format!("{{{}}}", body.join(","))
                    }),
                ]
            })
        }

        proptest! {
            #![proptest_config(ProptestConfig::with_cases(400))]
            #[test]
            fn tapes_and_values_agree(text in json_text()) {
                let (value, tape) = both(&text);
                prop_assert_eq!(value, tape);
            }
        }
    }
}
