//! Keyword attributes of calls (`nn.dense(%x, %w, units=256)`) and of functions (`Primitive=1`).

use crate::span::Span;
use std::fmt;

#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub enum AttrValue {
    Int(i64),
    Float(f64),
    Bool(bool),
    Str(String),
    List(Vec<AttrValue>),
    None,
}

impl AttrValue {
    pub fn kind_name(&self) -> &'static str {
        match self {
            AttrValue::Int(_) => "an integer",
            AttrValue::Float(_) => "a float",
            AttrValue::Bool(_) => "a bool",
            AttrValue::Str(_) => "a string",
            AttrValue::List(_) => "a list",
            AttrValue::None => "None",
        }
    }
}

impl fmt::Display for AttrValue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            AttrValue::Int(n) => write!(f, "{n}"),
            AttrValue::Float(x) => write!(f, "{x:?}"),
            AttrValue::Bool(true) => f.write_str("True"),
            AttrValue::Bool(false) => f.write_str("False"),
            AttrValue::Str(s) => write!(f, "{s:?}"),
            AttrValue::List(vs) => {
                f.write_str("[")?;
                for (i, v) in vs.iter().enumerate() {
                    if i > 0 {
                        f.write_str(", ")?;
                    }
                    write!(f, "{v}")?;
                }
                f.write_str("]")
            }
            AttrValue::None => f.write_str("None"),
        }
    }
}

#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Attr {
    pub name: String,
    pub value: AttrValue,
    pub span: Span,
}

/// Attributes in source order. Lookups are linear: calls carry a handful at most.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Attrs(pub Vec<Attr>);

impl Attrs {
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    pub fn get(&self, name: &str) -> Option<&AttrValue> {
        self.0.iter().find(|a| a.name == name).map(|a| &a.value)
    }

    pub fn get_attr(&self, name: &str) -> Option<&Attr> {
        self.0.iter().find(|a| a.name == name)
    }

    pub fn iter(&self) -> impl Iterator<Item = &Attr> {
        self.0.iter()
    }

    /// An integer attribute; `None` if absent or `None`. Bools count as 0/1 (Relay writes `Primitive=1`).
    pub fn int(&self, name: &str) -> Result<Option<i64>, String> {
        match self.get(name) {
            None | Some(AttrValue::None) => Ok(None),
            Some(AttrValue::Int(n)) => Ok(Some(*n)),
            Some(AttrValue::Bool(b)) => Ok(Some(*b as i64)),
            Some(v) => Err(format!(
                "attribute `{name}` must be an integer, found {}",
                v.kind_name()
            )),
        }
    }

    pub fn float(&self, name: &str) -> Result<Option<f64>, String> {
        match self.get(name) {
            None | Some(AttrValue::None) => Ok(None),
            Some(AttrValue::Int(n)) => Ok(Some(*n as f64)),
            Some(AttrValue::Float(x)) => Ok(Some(*x)),
            Some(v) => Err(format!(
                "attribute `{name}` must be a number, found {}",
                v.kind_name()
            )),
        }
    }

    pub fn bool(&self, name: &str) -> Result<Option<bool>, String> {
        match self.get(name) {
            None | Some(AttrValue::None) => Ok(None),
            Some(AttrValue::Bool(b)) => Ok(Some(*b)),
            Some(AttrValue::Int(n)) if *n == 0 || *n == 1 => Ok(Some(*n == 1)),
            Some(v) => Err(format!(
                "attribute `{name}` must be True or False, found {}",
                v.kind_name()
            )),
        }
    }

    pub fn str(&self, name: &str) -> Result<Option<&str>, String> {
        match self.get(name) {
            None | Some(AttrValue::None) => Ok(None),
            Some(AttrValue::Str(s)) => Ok(Some(s)),
            Some(v) => Err(format!(
                "attribute `{name}` must be a string, found {}",
                v.kind_name()
            )),
        }
    }

    /// A list of integers; a single integer is accepted as a one-element list (Relay allows `axis=1`
    /// where a list of axes is meant).
    pub fn ints(&self, name: &str) -> Result<Option<Vec<i64>>, String> {
        match self.get(name) {
            None | Some(AttrValue::None) => Ok(None),
            Some(AttrValue::Int(n)) => Ok(Some(vec![*n])),
            Some(AttrValue::List(vs)) => vs
                .iter()
                .map(|v| match v {
                    AttrValue::Int(n) => Ok(*n),
                    other => Err(format!(
                        "attribute `{name}` must be a list of integers, found {} in it",
                        other.kind_name()
                    )),
                })
                .collect::<Result<Vec<_>, _>>()
                .map(Some),
            Some(v) => Err(format!(
                "attribute `{name}` must be a list of integers, found {}",
                v.kind_name()
            )),
        }
    }

    /// True for a function marked `Primitive=1`: a static block the batcher treats as one unit.
    pub fn is_primitive(&self) -> bool {
        matches!(self.int("Primitive"), Ok(Some(n)) if n != 0)
    }
}
