//! The local variables in scope while a function body is checked: a stack of (name, type) that
//! blocks truncate back to where they began, with an index by name so that a lookup costs the
//! same however many variables are in scope (a scan from the innermost made a body of n `let`s
//! that each read its first argument take n² steps: 200,000 lines ran for minutes).

use std::collections::HashMap;
use tumble_ir::Ty;

#[derive(Default)]
pub(crate) struct Scope {
    entries: Vec<(String, Ty)>,
    /// Name → its positions in `entries`, innermost last.
    by_name: HashMap<String, Vec<usize>>,
}

impl Scope {
    pub(crate) fn len(&self) -> usize {
        self.entries.len()
    }

    pub(crate) fn push(&mut self, entry: (String, Ty)) {
        self.by_name
            .entry(entry.0.clone())
            .or_default()
            .push(self.entries.len());
        self.entries.push(entry);
    }

    /// Drops the variables bound after the first `mark`.
    pub(crate) fn truncate(&mut self, mark: usize) {
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

    /// The innermost variable named `name`.
    pub(crate) fn lookup(&self, name: &str) -> Option<&Ty> {
        let &i = self.by_name.get(name)?.last()?;
        self.entries.get(i).map(|(_, t)| t)
    }

    /// The names in scope, innermost first (for suggestions).
    pub(crate) fn names(&self) -> impl Iterator<Item = &str> {
        self.entries.iter().rev().map(|(n, _)| n.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shadowing_and_truncation() {
        let t = |n: u32| Ty::Param(format!("T{n}"));
        let mut s = Scope::default();
        s.push(("x".into(), t(1)));
        let mark = s.len();
        s.push(("x".into(), t(2)));
        s.push(("y".into(), t(3)));
        assert_eq!(s.lookup("x"), Some(&t(2)));
        s.truncate(mark);
        assert_eq!(s.lookup("x"), Some(&t(1)));
        assert_eq!(s.lookup("y"), None);
        assert_eq!(s.names().collect::<Vec<_>>(), ["x"]);
    }
}
