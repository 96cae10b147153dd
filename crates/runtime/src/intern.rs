//! Exact small ids for word sequences: the launch-grouping and shape-cache keys of graph nodes.
//!
//! A node's key is its block and its inputs' shapes (and, with code duplication, which shared
//! weights it reads). Invocations with equal keys are launched together, so two different keys
//! must never compare equal: a 64-bit hash of the words would make that merely improbable, and it
//! cost a SipHash pass per recorded node. Here equal sequences get equal ids and different ones
//! different ids, looked up with a cheap multiplicative hash (the keys come from shapes, not from
//! an adversary).

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

/// Slots of the recent-lookup cache (a power of two).
const RECENT: usize = 64;

/// Interns `u64` sequences as consecutive ids (0, 1, 2, ...).
#[derive(Default)]
pub(crate) struct Interner {
    ids: HashMap<Box<[u64]>, u32, BuildHasherDefault<WordHasher>>,
    /// The last sequence seen per value of its first word (a block, or a shape key): a block's
    /// invocations mostly repeat the same key, and comparing a dozen words is cheaper than
    /// hashing them and probing the map (the run's most frequent lookup, once per recorded node).
    recent: Vec<(Vec<u64>, u32)>,
}

impl Interner {
    /// The id of `words`, a new one the first time they are seen.
    pub(crate) fn id(&mut self, words: &[u64]) -> u32 {
        let slot = words.first().map_or(0, |&w| w as usize & (RECENT - 1));
        if let Some((seen, id)) = self.recent.get(slot) {
            // `u32::MAX`: a slot not filled yet.
            if *id != u32::MAX && same_words(seen, words) {
                return *id;
            }
        }
        let id = match self.ids.get(words) {
            Some(&id) => id,
            None => {
                let id = self.ids.len() as u32;
                self.ids.insert(words.into(), id);
                id
            }
        };
        if self.recent.is_empty() {
            self.recent.resize_with(RECENT, || (Vec::new(), u32::MAX));
        }
        if let Some(entry) = self.recent.get_mut(slot) {
            entry.0.clear();
            entry.0.extend_from_slice(words);
            entry.1 = id;
        }
        id
    }

    /// How many distinct sequences have been interned.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.ids.len()
    }
}

/// `a == b` for the short word sequences of keys (a dozen words): the differences OR-ed together
/// in one pass, inline, where slice equality calls `bcmp` for every lookup.
#[inline]
fn same_words(a: &[u64], b: &[u64]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// FxHash's word step (rotate, xor, multiply by an odd constant): a few cycles per word, and the
/// map compares whole keys, so a weak hash costs only probe length, never a wrong id.
#[derive(Default)]
pub(crate) struct WordHasher(u64);

impl WordHasher {
    fn add(&mut self, w: u64) {
        self.0 = (self.0.rotate_left(5) ^ w).wrapping_mul(0x51_7c_c1_b7_27_22_0a_95);
    }
}

impl Hasher for WordHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        let mut chunks = bytes.chunks_exact(8);
        for c in &mut chunks {
            let mut w = [0u8; 8];
            w.copy_from_slice(c);
            self.add(u64::from_le_bytes(w));
        }
        let rest = chunks.remainder();
        if !rest.is_empty() {
            let mut w = [0u8; 8];
            w[..rest.len()].copy_from_slice(rest);
            self.add(u64::from_le_bytes(w) ^ (rest.len() as u64) << 56);
        }
    }

    fn write_u64(&mut self, n: u64) {
        self.add(n);
    }

    fn write_usize(&mut self, n: usize) {
        self.add(n as u64);
    }

    fn write_u32(&mut self, n: u32) {
        self.add(u64::from(n));
    }
}

/// A hash map keyed by node ids and launch keys, hashed by [`WordHasher`] (the scheduler's
/// maps: SipHash was ~1% of NestedRNN's run).
pub(crate) type WordMap<K, V> = HashMap<K, V, BuildHasherDefault<WordHasher>>;

/// A hash set hashed by [`WordHasher`], for the same kind of keys.
pub(crate) type WordSet<K> = std::collections::HashSet<K, BuildHasherDefault<WordHasher>>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn equal_sequences_share_an_id_and_different_ones_do_not() {
        let mut i = Interner::default();
        let a = i.id(&[3, 2, 1, 512]);
        let b = i.id(&[3, 2, 1, 256]);
        let c = i.id(&[3, 2, 512, 1]);
        let d = i.id(&[3, 2, 1]);
        let e = i.id(&[]);
        assert_eq!(i.id(&[3, 2, 1, 512]), a);
        assert_eq!(i.id(&[]), e);
        let mut all = vec![a, b, c, d, e];
        all.sort_unstable();
        all.dedup();
        assert_eq!(all.len(), 5, "distinct sequences got the same id");
        assert_eq!(i.len(), 5);
    }

    #[test]
    fn ids_stay_exact_when_hashes_collide() {
        // Many keys that differ in one word: whatever their hashes do, the ids are distinct and
        // stable (the map compares whole keys).
        let mut i = Interner::default();
        let ids: Vec<u32> = (0..10_000u64).map(|k| i.id(&[7, k, 1 << 40])).collect();
        for (k, &id) in ids.iter().enumerate() {
            assert_eq!(id as usize, k);
            assert_eq!(i.id(&[7, k as u64, 1 << 40]), id);
        }
    }

    #[test]
    fn the_recent_cache_never_answers_for_another_sequence() {
        // First words 1 and 65 share a cache slot; empty and one-word sequences too.
        let mut i = Interner::default();
        let seqs: [&[u64]; 6] = [&[1, 4], &[65, 4], &[1, 4, 0], &[], &[0], &[1, 5]];
        let first: Vec<u32> = seqs.iter().map(|s| i.id(s)).collect();
        for _ in 0..3 {
            for (s, &id) in seqs.iter().zip(&first).rev() {
                assert_eq!(i.id(s), id, "{s:?}");
            }
        }
        let mut all = first.clone();
        all.sort_unstable();
        all.dedup();
        assert_eq!(all.len(), seqs.len());
    }
}
