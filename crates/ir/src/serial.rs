//! Serde helpers for the compiled-model format (`tumble compile`): maps written in key order, so
//! the same program always gives the same bytes (a `HashMap` iterates in a per-process order).

use std::collections::{BTreeMap, HashMap};
use std::hash::Hash;

use serde::{Serialize, Serializer};

/// `#[serde(serialize_with = "tumble_ir::serial::sorted")]` on a `HashMap` field.
pub fn sorted<K, V, S>(map: &HashMap<K, V>, s: S) -> Result<S::Ok, S::Error>
where
    K: Ord + Hash + Serialize,
    V: Serialize,
    S: Serializer,
{
    map.iter().collect::<BTreeMap<&K, &V>>().serialize(s)
}
