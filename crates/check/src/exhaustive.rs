//! Exhaustiveness of `match` (Maranget's usefulness algorithm, returning a witness): a complete
//! `match` that misses a case is rejected with an example of a value no arm covers.

use crate::env::Tables;
use std::fmt;
use tumble_ir::{Pattern, PatternKind};

#[derive(Clone, Debug, PartialEq)]
pub enum Pat {
    Wild,
    Ctor(String, Vec<Pat>),
    Tuple(Vec<Pat>),
}

impl Pat {
    pub fn from_pattern(p: &Pattern) -> Pat {
        match &p.kind {
            PatternKind::Wildcard | PatternKind::Var(_) => Pat::Wild,
            PatternKind::Ctor { name, args } => Pat::Ctor(
                name.name.clone(),
                args.iter().map(Pat::from_pattern).collect(),
            ),
            PatternKind::Tuple(ps) => Pat::Tuple(ps.iter().map(Pat::from_pattern).collect()),
        }
    }
}

impl fmt::Display for Pat {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let list = |f: &mut fmt::Formatter<'_>, ps: &[Pat]| -> fmt::Result {
            for (i, p) in ps.iter().enumerate() {
                if i > 0 {
                    f.write_str(", ")?;
                }
                write!(f, "{p}")?;
            }
            Ok(())
        };
        match self {
            Pat::Wild => f.write_str("_"),
            Pat::Ctor(c, args) if args.is_empty() => f.write_str(c),
            Pat::Ctor(c, args) => {
                write!(f, "{c}(")?;
                list(f, args)?;
                f.write_str(")")
            }
            Pat::Tuple(ps) => {
                f.write_str("(")?;
                list(f, ps)?;
                f.write_str(")")
            }
        }
    }
}

/// A value (as a pattern of constructors and `_`) that no arm matches, if there is one.
pub fn missing_case(arms: &[Pat], tables: &Tables) -> Option<Pat> {
    let rows: Vec<Vec<Pat>> = arms.iter().map(|p| vec![p.clone()]).collect();
    missing(&rows, 1, tables).and_then(|mut w| w.pop())
}

fn wilds(n: usize) -> Vec<Pat> {
    vec![Pat::Wild; n]
}

fn ctor_arity(c: &str, tables: &Tables) -> usize {
    tables.ctors.get(c).map_or(0, |i| i.fields.len())
}

/// Rows whose first column is compatible with `head`, with that column replaced by its sub-patterns.
fn specialize(rows: &[Vec<Pat>], head: &Pat, arity: usize) -> Vec<Vec<Pat>> {
    rows.iter()
        .filter_map(|row| {
            let (first, rest) = row.split_first()?;
            let mut out = match (first, head) {
                (Pat::Wild, _) => wilds(arity),
                (Pat::Ctor(c, args), Pat::Ctor(h, _)) if c == h => args.clone(),
                (Pat::Tuple(ps), Pat::Tuple(_)) => ps.clone(),
                _ => return None,
            };
            // A malformed row (wrong field count, already reported) must not derail the search.
            out.resize(arity, Pat::Wild);
            out.extend_from_slice(rest);
            Some(out)
        })
        .collect()
}

fn missing(rows: &[Vec<Pat>], width: usize, tables: &Tables) -> Option<Vec<Pat>> {
    if width == 0 {
        return rows.is_empty().then(Vec::new);
    }
    let heads: Vec<&Pat> = rows.iter().filter_map(|r| r.first()).collect();
    if let Some(n) = heads.iter().find_map(|p| match p {
        Pat::Tuple(ps) => Some(ps.len()),
        _ => None,
    }) {
        let sub = specialize(rows, &Pat::Tuple(Vec::new()), n);
        let mut w = missing(&sub, n + width - 1, tables)?;
        let rest = w.split_off(n.min(w.len()));
        let mut out = vec![Pat::Tuple(w)];
        out.extend(rest);
        return Some(out);
    }
    let seen: Vec<&str> = heads
        .iter()
        .filter_map(|p| match p {
            Pat::Ctor(c, _) => Some(c.as_str()),
            _ => None,
        })
        .collect();
    let all_ctors: Vec<String> = seen
        .first()
        .and_then(|c| tables.ctors.get(*c))
        .and_then(|info| tables.adts.get(&info.adt))
        .map(|adt| adt.ctors.clone())
        .unwrap_or_default();
    let complete = !all_ctors.is_empty() && all_ctors.iter().all(|c| seen.contains(&c.as_str()));
    if complete {
        for c in &all_ctors {
            let k = ctor_arity(c, tables);
            let sub = specialize(rows, &Pat::Ctor(c.clone(), Vec::new()), k);
            if let Some(mut w) = missing(&sub, k + width - 1, tables) {
                let rest = w.split_off(k.min(w.len()));
                let mut out = vec![Pat::Ctor(c.clone(), w)];
                out.extend(rest);
                return Some(out);
            }
        }
        return None;
    }
    let default: Vec<Vec<Pat>> = rows
        .iter()
        .filter(|r| matches!(r.first(), Some(Pat::Wild)))
        .map(|r| r[1..].to_vec())
        .collect();
    let w = missing(&default, width - 1, tables)?;
    let head = match all_ctors.iter().find(|c| !seen.contains(&c.as_str())) {
        Some(c) => Pat::Ctor(c.clone(), wilds(ctor_arity(c, tables))),
        None => Pat::Wild,
    };
    let mut out = vec![head];
    out.extend(w);
    Some(out)
}
