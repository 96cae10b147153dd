//! Module-level tables: algebraic data types, constructors and global signatures, and the conversion
//! of written types ([`TypeExpr`]) to semantic ones ([`Ty`]).

use std::collections::HashMap;
use tumble_ir::{Diagnostic, Span, Ty, TypeDef, TypeExpr, TypeExprKind};

/// An ADT: its type parameters and constructors in declaration order.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub struct AdtInfo {
    pub name: String,
    pub params: Vec<String>,
    pub ctors: Vec<String>,
    pub span: Span,
}

/// A constructor: the ADT it builds, its tag (index among the ADT's constructors) and field types,
/// written over the ADT's parameters as `Ty::Param`.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub struct CtorInfo {
    pub adt: String,
    pub tag: usize,
    pub fields: Vec<Ty>,
    pub span: Span,
}

/// The type of a global: quantified over `type_params` (which appear in `ty` as `Ty::Param`).
#[derive(Clone, Debug)]
pub struct GlobalSig {
    pub type_params: Vec<String>,
    pub ty: Ty,
    pub span: Span,
}

#[derive(Default, Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct Tables {
    #[serde(serialize_with = "tumble_ir::serial::sorted")]
    pub adts: HashMap<String, AdtInfo>,
    #[serde(serialize_with = "tumble_ir::serial::sorted")]
    pub ctors: HashMap<String, CtorInfo>,
}

impl Tables {
    /// Registers every type definition, then converts constructor fields (which may mention any ADT,
    /// including ones defined later). Problems are pushed to `diags`.
    pub fn build(type_defs: &[&TypeDef], diags: &mut Vec<Diagnostic>) -> Tables {
        let mut t = Tables::default();
        for td in type_defs {
            if let Some(prev) = t.adts.get(&td.name.name) {
                diags.push(
                    Diagnostic::error(
                        td.name.span,
                        format!("type `{}` is defined twice", td.name.name),
                    )
                    .with_secondary(prev.span, "first defined here"),
                );
                continue;
            }
            check_distinct_params(&td.params, "", diags);
            t.adts.insert(
                td.name.name.clone(),
                AdtInfo {
                    name: td.name.name.clone(),
                    params: td.params.iter().map(|p| p.name.clone()).collect(),
                    ctors: td.ctors.iter().map(|c| c.name.name.clone()).collect(),
                    span: td.name.span,
                },
            );
        }
        for td in type_defs {
            let params: Vec<String> = td.params.iter().map(|p| p.name.clone()).collect();
            for (tag, c) in td.ctors.iter().enumerate() {
                if let Some(prev) = t.ctors.get(&c.name.name) {
                    diags.push(
                        Diagnostic::error(
                            c.name.span,
                            format!(
                                "constructor `{}` is defined twice (also in type `{}`)",
                                c.name.name, prev.adt
                            ),
                        )
                        .with_secondary(prev.span, "first defined here"),
                    );
                    continue;
                }
                let fields = c
                    .fields
                    .iter()
                    .map(|f| t.lower_type(f, &params, &mut || None, diags))
                    .collect();
                t.ctors.insert(
                    c.name.name.clone(),
                    CtorInfo {
                        adt: td.name.name.clone(),
                        tag,
                        fields,
                        span: c.name.span,
                    },
                );
            }
        }
        t
    }

    /// Converts a written type. Names in `type_params` become rigid `Ty::Param`s; `_` asks `hole`
    /// for a fresh variable (or is an error where holes are not allowed).
    pub fn lower_type(
        &self,
        te: &TypeExpr,
        type_params: &[String],
        hole: &mut dyn FnMut() -> Option<Ty>,
        diags: &mut Vec<Diagnostic>,
    ) -> Ty {
        match &te.kind {
            TypeExprKind::Tensor { shape, dtype } => {
                for d in shape {
                    if let tumble_ir::Dim::Known(n) = d {
                        if *n < 0 {
                            diags.push(Diagnostic::error(
                                te.span,
                                format!("tensor dimension must be non-negative or `?`, found {n}"),
                            ));
                        }
                    }
                }
                Ty::tensor(shape.clone(), *dtype)
            }
            TypeExprKind::Tuple(ts) => Ty::Tuple(
                ts.iter()
                    .map(|t| self.lower_type(t, type_params, hole, diags))
                    .collect(),
            ),
            TypeExprKind::Func { params, ret } => Ty::Func(
                params
                    .iter()
                    .map(|t| self.lower_type(t, type_params, hole, diags))
                    .collect(),
                Box::new(self.lower_type(ret, type_params, hole, diags)),
            ),
            TypeExprKind::Hole => match hole() {
                Some(t) => t,
                None => {
                    diags.push(Diagnostic::error(
                        te.span,
                        "`_` is not allowed in a type definition; write the type",
                    ));
                    Ty::unit()
                }
            },
            TypeExprKind::Named { name, args } => {
                if type_params.iter().any(|p| p == name) {
                    if !args.is_empty() {
                        diags.push(Diagnostic::error(
                            te.span,
                            format!("type parameter `{name}` takes no type arguments"),
                        ));
                    }
                    return Ty::Param(name.clone());
                }
                let Some(adt) = self.adts.get(name) else {
                    let mut known: Vec<&str> = self.adts.keys().map(String::as_str).collect();
                    known.extend(type_params.iter().map(String::as_str));
                    let mut d = Diagnostic::error(te.span, format!("unknown type `{name}`"));
                    if let Some(s) = suggest(name, known) {
                        d = d.with_note(format!("did you mean `{s}`?"));
                    } else if type_params.is_empty() {
                        d = d.with_note(
                            "declare type parameters after the name, e.g. `def @f[A](%x: A)`",
                        );
                    }
                    diags.push(d);
                    return Ty::unit();
                };
                if adt.params.len() != args.len() {
                    diags.push(Diagnostic::error(
                        te.span,
                        format!(
                            "type `{name}` takes {} type argument{}, found {}",
                            adt.params.len(),
                            plural(adt.params.len()),
                            args.len()
                        ),
                    ));
                }
                let mut lowered: Vec<Ty> = args
                    .iter()
                    .map(|t| self.lower_type(t, type_params, hole, diags))
                    .collect();
                lowered.resize(adt.params.len(), Ty::unit());
                Ty::Adt(name.clone(), lowered)
            }
        }
    }
}

/// Reports names declared twice in one list; `sigil` is how the name is written (`%` for variables).
pub fn check_distinct_params(
    params: &[tumble_ir::Ident],
    sigil: &str,
    diags: &mut Vec<Diagnostic>,
) {
    for (i, p) in params.iter().enumerate() {
        if let Some(prev) = params[..i].iter().find(|q| q.name == p.name) {
            diags.push(
                Diagnostic::error(p.span, format!("`{sigil}{}` is declared twice", p.name))
                    .with_secondary(prev.span, "first declared here"),
            );
        }
    }
}

/// Replaces type parameters by the given types (instantiation of a scheme or of a constructor).
pub fn substitute_params(ty: &Ty, map: &[(String, Ty)]) -> Ty {
    match ty {
        Ty::Param(p) => map
            .iter()
            .find(|(n, _)| n == p)
            .map_or_else(|| ty.clone(), |(_, t)| t.clone()),
        Ty::Tuple(ts) => Ty::Tuple(ts.iter().map(|t| substitute_params(t, map)).collect()),
        Ty::Adt(n, ts) => Ty::Adt(
            n.clone(),
            ts.iter().map(|t| substitute_params(t, map)).collect(),
        ),
        Ty::Func(ps, r) => Ty::Func(
            ps.iter().map(|t| substitute_params(t, map)).collect(),
            Box::new(substitute_params(r, map)),
        ),
        Ty::Tensor { .. } | Ty::Var(_) => ty.clone(),
    }
}

pub fn plural(n: usize) -> &'static str {
    if n == 1 {
        ""
    } else {
        "s"
    }
}

/// The closest known name within a small edit distance, for "did you mean" hints.
pub fn suggest<'a>(name: &str, known: impl IntoIterator<Item = &'a str>) -> Option<&'a str> {
    let len = name.chars().count();
    if len > MAX_SUGGESTED_LEN {
        return None;
    }
    let limit = (len / 3).max(1);
    known
        .into_iter()
        // The distance is at least the difference of the lengths: a name far longer or shorter
        // is not looked at (and no candidate costs more than MAX_SUGGESTED_LEN² steps).
        .filter(|k| k.len().abs_diff(name.len()) <= 4 * limit)
        .filter(|k| k.chars().count().abs_diff(len) <= limit)
        .map(|k| (edit_distance(name, k), k))
        .filter(|(d, _)| *d <= limit)
        .min()
        .map(|(_, k)| k)
}

/// Names longer than this get no "did you mean" (their distance is quadratic in the length: a
/// 100,000-character name against another asked for 80 GB).
pub const MAX_SUGGESTED_LEN: usize = 64;

/// Optimal-string-alignment distance: edits plus adjacent transpositions (`Lsit` is one from `List`).
fn edit_distance(a: &str, b: &str) -> usize {
    let a: Vec<char> = a.chars().collect();
    let b: Vec<char> = b.chars().collect();
    let w = b.len() + 1;
    let mut d = vec![0usize; (a.len() + 1) * w];
    for i in 0..=a.len() {
        d[i * w] = i;
    }
    for (j, cell) in d.iter_mut().take(w).enumerate() {
        *cell = j;
    }
    for i in 1..=a.len() {
        for j in 1..=b.len() {
            let cost = usize::from(a[i - 1] != b[j - 1]);
            let mut v = (d[(i - 1) * w + j] + 1)
                .min(d[i * w + j - 1] + 1)
                .min(d[(i - 1) * w + j - 1] + cost);
            if i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1] {
                v = v.min(d[(i - 2) * w + j - 2] + 1);
            }
            d[i * w + j] = v;
        }
    }
    d[a.len() * w + b.len()]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn long_names_get_no_suggestion_and_cost_nothing() {
        let long = "x".repeat(100_000);
        let t = std::time::Instant::now();
        assert_eq!(suggest(&long, [long.as_str(), "xx"]), None);
        assert_eq!(suggest("xxx", [long.as_str()]), None);
        assert_eq!(suggest("Lsit", [long.as_str(), "List"]), Some("List"));
        assert!(t.elapsed().as_secs_f64() < 1.0, "{:?}", t.elapsed());
    }

    #[test]
    fn suggestions_pick_close_names_only() {
        assert_eq!(suggest("Lsit", ["List", "Tree"]), Some("List"));
        assert_eq!(suggest("Foo", ["List", "Tree"]), None);
    }
}
