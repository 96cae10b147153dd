//! The substitution: inference variables, their bindings, unification and resolution.
//!
//! Tensor dims unify gradually: `?` matches any dim and stays `?` (Nimble's `Any`); two known dims
//! must be equal. A variable in the receiving place of a unification (`expected`: a parameter, a
//! match's result, a type parameter's instance) bound to a type with a known dim that meets `?`
//! there is widened to `?`: values of both types flow into it (a `@foldl` accumulator that starts
//! `(1, 1)` and grows by a closure returning `(1, ?)`), and a known dim would let the compiler
//! trust a shape the run does not have. A variable on the giving side (`found`: an argument) keeps
//! its type: a `(1, 8)` value passed where `(?, 8)` is taken is still `(1, 8)`. Type parameters
//! (`Ty::Param`) are rigid.

use tumble_ir::{Dim, Ty, TyVar};

#[derive(Default)]
pub struct Subst {
    bindings: Vec<Option<Ty>>,
}

/// Why two types did not unify: the innermost pair that disagreed, for a precise message.
#[derive(Debug, Clone)]
pub struct Mismatch {
    pub expected: Ty,
    pub found: Ty,
    /// Set when the types would be infinite (`?t1 = List[?t1]`).
    pub occurs: bool,
}

impl Subst {
    pub fn fresh(&mut self) -> Ty {
        let v = TyVar(self.bindings.len() as u32);
        self.bindings.push(None);
        Ty::Var(v)
    }

    /// Whether `v` is bound (to anything, possibly another variable).
    pub fn is_bound(&self, v: TyVar) -> bool {
        self.binding(v).is_some()
    }

    /// The first variable still unbound in `ty` once bindings are followed (depth first, left to
    /// right, as in the resolved type), found without copying the type.
    pub fn first_unbound(&self, ty: &Ty) -> Option<TyVar> {
        let mut stack: Vec<&Ty> = vec![ty];
        while let Some(mut t) = stack.pop() {
            while let Ty::Var(v) = t {
                match self.binding(*v) {
                    Some(b) => t = b,
                    None => return Some(*v),
                }
            }
            match t {
                Ty::Tuple(ts) | Ty::Adt(_, ts) => stack.extend(ts.iter().rev()),
                Ty::Func(ps, r) => {
                    stack.push(r);
                    stack.extend(ps.iter().rev());
                }
                Ty::Tensor { .. } | Ty::Param(_) | Ty::Var(_) => {}
            }
        }
        None
    }

    fn binding(&self, v: TyVar) -> Option<&Ty> {
        self.bindings.get(v.0 as usize).and_then(Option::as_ref)
    }

    /// Follows variable bindings at the top of `ty` only.
    pub fn shallow(&self, ty: &Ty) -> Ty {
        let mut t = ty.clone();
        while let Ty::Var(v) = t {
            match self.binding(v) {
                Some(b) => t = b.clone(),
                None => break,
            }
        }
        t
    }

    /// How many parts `ty` has once its variables are followed (each tuple, function,
    /// constructor, tensor, type parameter or unbound variable is one), counting no further than
    /// `cap`: the cost is at most `cap` steps, whatever the type's size.
    pub fn size_at_most(&self, ty: &Ty, cap: usize) -> usize {
        let mut n = 0usize;
        let mut stack: Vec<&Ty> = vec![ty];
        while let Some(mut t) = stack.pop() {
            while let Ty::Var(v) = t {
                match self.binding(*v) {
                    Some(b) => t = b,
                    None => break,
                }
            }
            n += 1;
            if n >= cap {
                return cap;
            }
            match t {
                Ty::Tuple(ts) | Ty::Adt(_, ts) => stack.extend(ts.iter()),
                Ty::Func(ps, r) => {
                    stack.extend(ps.iter());
                    stack.push(r);
                }
                _ => {}
            }
        }
        n
    }

    /// Replaces every bound variable, deeply.
    pub fn resolve(&self, ty: &Ty) -> Ty {
        match self.shallow(ty) {
            Ty::Tuple(ts) => Ty::Tuple(ts.iter().map(|t| self.resolve(t)).collect()),
            Ty::Func(ps, r) => Ty::Func(
                ps.iter().map(|t| self.resolve(t)).collect(),
                Box::new(self.resolve(&r)),
            ),
            Ty::Adt(n, args) => Ty::Adt(n, args.iter().map(|t| self.resolve(t)).collect()),
            t => t,
        }
    }

    /// Whether `v` occurs in `ty`. Each bound variable's binding is looked into once: a type
    /// built by doubling through variables (`@dup(@dup(..(%x)))`, `dup: A -> (A, A)`) has 2^n
    /// paths over n bindings, which a walk of every path took exponential time over.
    fn occurs(&self, v: TyVar, ty: &Ty) -> bool {
        let mut seen: std::collections::HashSet<TyVar> = Default::default();
        let mut stack: Vec<&Ty> = vec![ty];
        while let Some(mut t) = stack.pop() {
            let mut looked = false;
            while let Ty::Var(w) = t {
                if *w == v {
                    return true;
                }
                if !seen.insert(*w) {
                    looked = true;
                    break;
                }
                match self.binding(*w) {
                    Some(b) => t = b,
                    None => break,
                }
            }
            if looked {
                continue;
            }
            match t {
                Ty::Tuple(ts) | Ty::Adt(_, ts) => stack.extend(ts.iter()),
                Ty::Func(ps, r) => {
                    stack.extend(ps.iter());
                    stack.push(r);
                }
                Ty::Var(_) | Ty::Tensor { .. } | Ty::Param(_) => {}
            }
        }
        false
    }

    fn bind(&mut self, v: TyVar, ty: Ty) {
        if let Some(slot) = self.bindings.get_mut(v.0 as usize) {
            *slot = Some(ty);
        }
    }

    /// Follows variable bindings at the top of `ty`: the type reached and the last variable
    /// followed to it (`None` when `ty` is not a bound variable).
    fn chase(&self, ty: &Ty) -> (Option<TyVar>, Ty) {
        let mut last = None;
        let mut t = ty.clone();
        while let Ty::Var(v) = t {
            match self.binding(v) {
                Some(b) => {
                    last = Some(v);
                    t = b.clone();
                }
                None => break,
            }
        }
        (last, t)
    }

    /// Makes `expected` and `found` equal, or says where they differ.
    pub fn unify(&mut self, expected: &Ty, found: &Ty) -> Result<(), Mismatch> {
        let (var_a, a) = self.chase(expected);
        let (_, b) = self.chase(found);
        self.unify_shallow(&a, &b)?;
        // The receiving variable now stands for values of either type: `?` wherever one has it.
        if let Some((v, w)) = var_a.zip(widened(&a, &b)) {
            self.bind(v, w);
        }
        Ok(())
    }

    /// [`Subst::unify`] of two types whose top is not a bound variable.
    fn unify_shallow(&mut self, a: &Ty, b: &Ty) -> Result<(), Mismatch> {
        let (a, b) = (a.clone(), b.clone());
        let fail = |s: &Self| Mismatch {
            expected: s.resolve(&a),
            found: s.resolve(&b),
            occurs: false,
        };
        match (&a, &b) {
            (Ty::Var(x), Ty::Var(y)) if x == y => Ok(()),
            (Ty::Var(x), other) | (other, Ty::Var(x)) => {
                if self.occurs(*x, other) {
                    return Err(Mismatch {
                        occurs: true,
                        ..fail(self)
                    });
                }
                self.bind(*x, other.clone());
                Ok(())
            }
            (
                Ty::Tensor {
                    shape: s1,
                    dtype: d1,
                },
                Ty::Tensor {
                    shape: s2,
                    dtype: d2,
                },
            ) => {
                let dims_ok = s1.len() == s2.len()
                    && s1.iter().zip(s2).all(|(x, y)| match (x, y) {
                        (Dim::Known(p), Dim::Known(q)) => p == q,
                        _ => true,
                    });
                if d1 == d2 && dims_ok {
                    Ok(())
                } else {
                    Err(fail(self))
                }
            }
            (Ty::Tuple(xs), Ty::Tuple(ys)) if xs.len() == ys.len() => {
                for (x, y) in xs.iter().zip(ys) {
                    self.unify(x, y).map_err(|_| fail(self))?;
                }
                Ok(())
            }
            (Ty::Func(p1, r1), Ty::Func(p2, r2)) if p1.len() == p2.len() => {
                for (x, y) in p1.iter().zip(p2) {
                    self.unify(x, y).map_err(|_| fail(self))?;
                }
                self.unify(r1, r2).map_err(|_| fail(self))
            }
            (Ty::Adt(n1, a1), Ty::Adt(n2, a2)) if n1 == n2 && a1.len() == a2.len() => {
                for (x, y) in a1.iter().zip(a2) {
                    self.unify(x, y).map_err(|_| fail(self))?;
                }
                Ok(())
            }
            (Ty::Param(p), Ty::Param(q)) if p == q => Ok(()),
            _ => Err(fail(self)),
        }
    }
}

/// `t` with `?` wherever `other` has `?` and `t` a known dim (tensors, and tuples, functions and
/// constructors of them, not through variables: those are widened by their own unification);
/// `None` when there is no such place.
fn widened(t: &Ty, other: &Ty) -> Option<Ty> {
    match (t, other) {
        (Ty::Tensor { shape, dtype }, Ty::Tensor { shape: o, .. }) if shape.len() == o.len() => {
            let wider = |(d, e): (&Dim, &Dim)| matches!((d, e), (Dim::Known(_), Dim::Any));
            if !shape.iter().zip(o).any(wider) {
                return None;
            }
            let shape = shape
                .iter()
                .zip(o)
                .map(|(d, e)| if wider((d, e)) { Dim::Any } else { *d })
                .collect();
            Some(Ty::Tensor {
                shape,
                dtype: *dtype,
            })
        }
        (Ty::Tuple(ts), Ty::Tuple(os)) if ts.len() == os.len() => {
            widened_all(ts, os).map(Ty::Tuple)
        }
        (Ty::Adt(n, ts), Ty::Adt(m, os)) if n == m && ts.len() == os.len() => {
            widened_all(ts, os).map(|ts| Ty::Adt(n.clone(), ts))
        }
        (Ty::Func(ps, r), Ty::Func(qs, s)) if ps.len() == qs.len() => {
            let params = widened_all(ps, qs);
            let ret = widened(r, s);
            if params.is_none() && ret.is_none() {
                return None;
            }
            Some(Ty::Func(
                params.unwrap_or_else(|| ps.clone()),
                Box::new(ret.unwrap_or_else(|| (**r).clone())),
            ))
        }
        _ => None,
    }
}

/// [`widened`] element by element; `None` when no element widens.
fn widened_all(ts: &[Ty], os: &[Ty]) -> Option<Vec<Ty>> {
    let each: Vec<Option<Ty>> = ts.iter().zip(os).map(|(t, o)| widened(t, o)).collect();
    if each.iter().all(Option::is_none) {
        return None;
    }
    Some(
        each.into_iter()
            .zip(ts)
            .map(|(w, t)| w.unwrap_or_else(|| t.clone()))
            .collect(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use tumble_ir::DType;

    #[test]
    fn any_dims_unify_with_known_and_known_must_agree() {
        let mut s = Subst::default();
        let a = Ty::tensor(vec![Dim::Any, Dim::Known(4)], DType::Float32);
        let b = Ty::tensor_of(&[3, 4], DType::Float32);
        assert!(s.unify(&a, &b).is_ok());
        let c = Ty::tensor_of(&[3, 5], DType::Float32);
        assert!(s.unify(&b, &c).is_err());
        assert!(s.unify(&b, &Ty::tensor_of(&[3, 4], DType::Int32)).is_err());
    }

    #[test]
    fn a_bound_variable_widens_to_an_unknown_dim_it_meets() {
        let mut s = Subst::default();
        let v = s.fresh();
        let known = Ty::tensor_of(&[1, 1], DType::Float32);
        let any = Ty::tensor(vec![Dim::Known(1), Dim::Any], DType::Float32);
        assert!(s.unify(&v, &known).is_ok());
        assert!(s.unify(&v, &any).is_ok());
        assert_eq!(s.resolve(&v), any);
        // Given where `?` is taken, a variable keeps its known dims.
        let u = s.fresh();
        assert!(s.unify(&u, &known).is_ok());
        assert!(s.unify(&any, &u).is_ok());
        assert_eq!(s.resolve(&u), known);
        // Inside a tuple too; and a known dim met later does not narrow it again.
        let w = s.fresh();
        assert!(s
            .unify(&w, &Ty::Tuple(vec![known.clone(), known.clone()]))
            .is_ok());
        assert!(s
            .unify(&w, &Ty::Tuple(vec![known.clone(), any.clone()]))
            .is_ok());
        assert!(s
            .unify(&w, &Ty::Tuple(vec![known.clone(), known.clone()]))
            .is_ok());
        assert_eq!(s.resolve(&w), Ty::Tuple(vec![known, any]));
    }

    #[test]
    fn occurs_check_rejects_infinite_types() {
        let mut s = Subst::default();
        let v = s.fresh();
        let list = Ty::Adt("List".into(), vec![v.clone()]);
        let err = s.unify(&v, &list).err();
        assert!(err.is_some_and(|m| m.occurs));
    }

    #[test]
    fn variables_resolve_through_chains() {
        let mut s = Subst::default();
        let (a, b) = (s.fresh(), s.fresh());
        s.unify(&a, &b).ok();
        s.unify(&b, &Ty::scalar(DType::Bool)).ok();
        assert_eq!(s.resolve(&a), Ty::scalar(DType::Bool));
    }
}
