//! Results out for library callers: a [`Value`] turned by its type into an owned tree of
//! tensors that can cross threads (interpreter values are `Rc`, per thread) and be converted into
//! the caller's own values (Python objects) later.
//!
//! Built with an explicit work stack like [`crate::encode_json`]: a `List` of 100,000 elements
//! is a chain of `Cons` cells that native recursion would follow once per element.

use tumble_interp::Value;
use tumble_ir::Ty;
use tumble_tensor::Tensor;

use crate::env::TypeEnv;
use crate::IoError;

/// A result in the shapes of the JSON encoding: tensors, tuples, lists (`List[T]`), and other
/// ADT values by constructor name.
#[derive(Debug, Clone, PartialEq)]
pub enum OutTree {
    Tensor(Tensor),
    Tuple(Vec<OutTree>),
    List(Vec<OutTree>),
    Ctor { name: String, fields: Vec<OutTree> },
}

impl Drop for OutTree {
    fn drop(&mut self) {
        // A deep tree dropped the default way recurses once per level.
        let mut stack: Vec<OutTree> = match self {
            OutTree::Tensor(_) => return,
            OutTree::Tuple(v) | OutTree::List(v) | OutTree::Ctor { fields: v, .. } => {
                if v.iter().all(|c| matches!(c, OutTree::Tensor(_))) {
                    return;
                }
                std::mem::take(v)
            }
        };
        while let Some(mut t) = stack.pop() {
            match &mut t {
                OutTree::Tensor(_) => {}
                OutTree::Tuple(v) | OutTree::List(v) | OutTree::Ctor { fields: v, .. } => {
                    stack.append(v);
                }
            }
        }
    }
}

enum Job<'v> {
    Visit(&'v Value, Ty),
    /// Collect the last `n` finished trees into a tuple / list / constructor.
    Tuple(usize),
    List(usize),
    Ctor(String, usize),
}

fn mismatch(v: &Value, ty: &Ty) -> IoError {
    IoError::Output {
        message: format!(
            "internal: the result holds {} where its type says {ty}",
            v.kind()
        ),
    }
}

/// `value`, of type `ty` (`@main`'s return type), as an [`OutTree`]. Lazy tensors must have been
/// materialized (the runtime's results are).
pub fn to_tree(value: &Value, ty: &Ty, env: &TypeEnv) -> Result<OutTree, IoError> {
    let mut jobs = vec![Job::Visit(value, ty.clone())];
    let mut done: Vec<OutTree> = Vec::new();
    let take = |done: &mut Vec<OutTree>, n: usize| done.split_off(done.len().saturating_sub(n));
    while let Some(job) = jobs.pop() {
        match job {
            Job::Tuple(n) => {
                let fields = take(&mut done, n);
                done.push(OutTree::Tuple(fields));
            }
            Job::List(n) => {
                let items = take(&mut done, n);
                done.push(OutTree::List(items));
            }
            Job::Ctor(name, n) => {
                let fields = take(&mut done, n);
                done.push(OutTree::Ctor { name, fields });
            }
            Job::Visit(v, ty) => match (&ty, v) {
                (Ty::Tensor { .. }, Value::Tensor(t)) => {
                    if let Some(message) = crate::output::tensor_mismatch(t, &ty) {
                        return Err(IoError::Output { message });
                    }
                    done.push(OutTree::Tensor(t.clone()))
                }
                (Ty::Tuple(ts), Value::Tuple(tv)) if ts.len() == tv.0.len() => {
                    jobs.push(Job::Tuple(ts.len()));
                    for (f, t) in tv.0.iter().zip(ts).rev() {
                        jobs.push(Job::Visit(f, t.clone()));
                    }
                }
                (Ty::Adt(name, args), Value::Adt(a)) => {
                    if let Some(elem) = env.list_elem(&ty) {
                        let mut items = Vec::new();
                        let mut node = v;
                        loop {
                            let Value::Adt(cell) = node else {
                                return Err(mismatch(node, &ty));
                            };
                            match cell.fields.as_slice() {
                                [] => break,
                                [head, rest] => {
                                    items.push(head);
                                    node = rest;
                                }
                                _ => return Err(mismatch(node, &ty)),
                            }
                        }
                        jobs.push(Job::List(items.len()));
                        for item in items.into_iter().rev() {
                            jobs.push(Job::Visit(item, elem.clone()));
                        }
                        continue;
                    }
                    let c = env
                        .ctor_by_index(name, args, a.ctor)
                        .filter(|c| c.fields.len() == a.fields.len())
                        .ok_or_else(|| mismatch(v, &ty))?;
                    jobs.push(Job::Ctor(c.name, a.fields.len()));
                    for (f, t) in a.fields.iter().zip(c.fields).rev() {
                        jobs.push(Job::Visit(f, t));
                    }
                }
                (_, Value::Closure(_)) | (Ty::Func(..), _) => {
                    return Err(IoError::Output {
                        message: format!(
                            "it contains a function ({ty}), which has no data form; return data \
                             (tensors, tuples, lists, constructors) from @main"
                        ),
                    })
                }
                _ => return Err(mismatch(v, &ty)),
            },
        }
    }
    match (done.pop(), done.is_empty()) {
        (Some(t), true) => Ok(t),
        _ => Err(IoError::Output {
            message: "internal: the result tree did not come out whole".into(),
        }),
    }
}
