//! Names in scope while a function body is walked (the checker's variables, the lowering's block
//! bindings): a stack of (name, value) that blocks truncate back to where they began, with an
//! index by name so that a lookup costs the same however many names are in scope. A scan from the
//! innermost made a body of n `let`s that each read its first argument cost n² in both passes
//! (200,000 lines ran for minutes).

use std::collections::HashMap;

#[derive(Clone, Debug)]
pub struct Scope<V> {
    entries: Vec<(String, V)>,
    /// Name → its positions in `entries`, innermost last.
    by_name: HashMap<String, Vec<usize>>,
}

impl<V> Default for Scope<V> {
    fn default() -> Self {
        Scope {
            entries: Vec::new(),
            by_name: HashMap::new(),
        }
    }
}

impl<V> Scope<V> {
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The bindings, outermost first.
    pub fn iter(&self) -> std::slice::Iter<'_, (String, V)> {
        self.entries.iter()
    }

    pub fn last(&self) -> Option<&(String, V)> {
        self.entries.last()
    }

    pub fn push(&mut self, entry: (String, V)) {
        self.by_name
            .entry(entry.0.clone())
            .or_default()
            .push(self.entries.len());
        self.entries.push(entry);
    }

    /// Drops the bindings made after the first `mark`.
    pub fn truncate(&mut self, mark: usize) {
        while self.entries.len() > mark {
            let Some((name, _)) = self.entries.pop() else {
                break;
            };
            if let Some(at) = self.by_name.get_mut(&name) {
                at.pop();
                if at.is_empty() {
                    self.by_name.remove(&name);
                }
            }
        }
    }

    pub fn clear(&mut self) {
        self.entries.clear();
        self.by_name.clear();
    }

    /// The innermost binding of `name`.
    pub fn lookup(&self, name: &str) -> Option<&V> {
        self.lookup_from(name, 0)
    }

    /// The innermost binding of `name` at position `floor` or later (an inlined body sees only
    /// its own bindings).
    pub fn lookup_from(&self, name: &str, floor: usize) -> Option<&V> {
        let &i = self.by_name.get(name)?.last()?;
        self.entries.get(i).filter(|_| i >= floor).map(|(_, v)| v)
    }

    /// The names in scope, innermost first (for suggestions).
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.entries.iter().rev().map(|(n, _)| n.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shadowing_truncation_and_floors() {
        let mut s = Scope::default();
        s.push(("x".into(), 1));
        let mark = s.len();
        s.push(("x".into(), 2));
        s.push(("y".into(), 3));
        assert_eq!(s.lookup("x"), Some(&2));
        assert_eq!(s.lookup_from("x", 2), None);
        assert_eq!(s.lookup_from("y", 2), Some(&3));
        s.truncate(mark);
        assert_eq!(s.lookup("x"), Some(&1));
        assert_eq!(s.lookup("y"), None);
        assert_eq!(s.names().collect::<Vec<_>>(), ["x"]);
        s.clear();
        assert!(s.is_empty() && s.lookup("x").is_none());
    }
}
