//! Deciding which `@main` arguments are model parameters (from the weights file, shared by every
//! instance) and which come from each instance.

use std::collections::{BTreeMap, BTreeSet};

use tumble_interp::Value;
use tumble_ir::{DType, Dim, Ty};
use tumble_tensor::{Buffer, Rng, Tensor};

use crate::IoError;

/// Where one `@main` argument's value comes from.
#[derive(Clone)]
pub enum Binding {
    /// A parameter: this tensor (from the weights file or generated) is passed to every instance.
    Param(Tensor),
    /// Each instance provides it.
    Instance,
}

/// One `@main` argument with its declared type and binding.
#[derive(Clone)]
pub struct BoundArg {
    /// The name without `%`.
    pub name: String,
    pub ty: Ty,
    pub binding: Binding,
}

/// The result of [`bind_params`].
#[derive(Clone)]
pub struct BoundParams {
    /// Every `@main` argument, in declaration order.
    pub args: Vec<BoundArg>,
    /// The parameters filled with seeded random values (so a caller can save them).
    pub generated: BTreeMap<String, Tensor>,
    /// Things worth telling the user that do not stop the run (e.g. unused tensors in the file).
    pub warnings: Vec<String>,
}

impl BoundParams {
    /// Per `@main` argument, whether it is bound to a weight (the same for every instance): the
    /// mask the static passes and the reuse analysis take.
    pub fn weights_mask(&self) -> Vec<bool> {
        self.args
            .iter()
            .map(|a| matches!(a.binding, Binding::Param(_)))
            .collect()
    }

    /// The weights bound, by argument name (what `--save-params` and `tumble compile` write).
    pub fn weight_tensors(&self) -> BTreeMap<String, Tensor> {
        self.args
            .iter()
            .filter_map(|a| match &a.binding {
                Binding::Param(t) => Some((a.name.clone(), t.clone())),
                Binding::Instance => None,
            })
            .collect()
    }

    /// The arguments each instance must provide (name, declared type), in declaration order: the
    /// `args` of [`crate::RawInstances::decode`].
    /// Per `@main` argument, in order: its weight when it is a parameter (`None`: an instance
    /// input) — what `Executable::prepack_weights` reads `Code::Param` from.
    pub fn entry_params(&self) -> Vec<Option<Tensor>> {
        self.args
            .iter()
            .map(|a| match &a.binding {
                Binding::Param(t) => Some(t.clone()),
                Binding::Instance => None,
            })
            .collect()
    }

    pub fn instance_args(&self) -> Vec<(String, Ty)> {
        self.args
            .iter()
            .filter(|a| matches!(a.binding, Binding::Instance))
            .map(|a| (a.name.clone(), a.ty.clone()))
            .collect()
    }

    /// The full argument list of `@main` for one instance: parameters in their places, the
    /// instance's values (in [`BoundParams::instance_args`] order) in the others.
    pub fn assemble(&self, instance: Vec<Value>) -> Result<Vec<Value>, IoError> {
        let want = self.instance_args().len();
        if instance.len() != want {
            return Err(IoError::param(format!(
                "internal: an instance supplies {} values, but @main takes {want} from the instances",
                instance.len()
            )));
        }
        let mut values = instance.into_iter();
        let mut out = Vec::with_capacity(self.args.len());
        for a in &self.args {
            match &a.binding {
                Binding::Param(t) => out.push(Value::Tensor(t.clone())),
                Binding::Instance => {
                    if let Some(v) = values.next() {
                        out.push(v);
                    }
                }
            }
        }
        Ok(out)
    }
}

/// Binds `@main`'s arguments (`main_params`: names without `%`, declared types):
///
/// - an argument named like a tensor of `file` is a **parameter**; the tensor's dtype and shape
///   must match the declared type (`?` dims match any extent);
/// - else an argument among `instance_args` (the keys the instances provide) comes from each
///   instance;
/// - else it is a missing parameter: with `random_seed` it is filled with seeded values
///   (see [`random_param`]), without it is an error listing the tensors the file has.
///
/// Parameters must be tensors. An argument both in the file and among the instance keys is an
/// error (ambiguous). Tensors of the file that `@main` does not take produce a warning.
pub fn bind_params(
    main_params: &[(String, Ty)],
    instance_args: &BTreeSet<String>,
    file: &BTreeMap<String, Tensor>,
    random_seed: Option<u64>,
) -> Result<BoundParams, IoError> {
    let mut args = Vec::with_capacity(main_params.len());
    let mut missing: Vec<usize> = Vec::new();
    for (i, (raw_name, ty)) in main_params.iter().enumerate() {
        let name = raw_name.trim_start_matches('%');
        let binding = if let Some(t) = file.get(name) {
            if instance_args.contains(name) {
                return Err(IoError::param(format!(
                    "argument %{name} is given twice: the weights file has a tensor `{name}` and \
                     the instances have a key `{name}`; remove one of them"
                )));
            }
            let Some((dims, dtype)) = ty.as_tensor() else {
                return Err(IoError::param(format!(
                    "argument %{name}: the weights file has a tensor `{name}`, but @main declares \
                     %{name}: {ty}; only tensor-typed arguments can be parameters"
                )));
            };
            check_param(name, dims, dtype, t)?;
            Binding::Param(t.clone())
        } else if instance_args.contains(name) {
            Binding::Instance
        } else {
            if ty.as_tensor().is_none() {
                return Err(IoError::param(format!(
                    "argument %{name}: {ty} is not provided by the instances{}; only tensors can \
                     come from a weights file, so every instance must have a key `{name}`",
                    provided_list(instance_args)
                )));
            }
            missing.push(i);
            Binding::Instance // replaced below
        };
        args.push(BoundArg {
            name: name.to_string(),
            ty: ty.clone(),
            binding,
        });
    }

    let mut generated = BTreeMap::new();
    let mut warnings = Vec::new();
    if !missing.is_empty() {
        let Some(seed) = random_seed else {
            return Err(missing_error(&args, &missing, file));
        };
        // A key of the instances that no argument has, close to a missing one's name, is a
        // typo of a per-instance input, not a weight to make up.
        let stray: Vec<&str> = instance_args
            .iter()
            .map(String::as_str)
            .filter(|k| {
                !main_params
                    .iter()
                    .any(|(n, _)| n.trim_start_matches('%') == *k)
            })
            .collect();
        for &i in &missing {
            let name = &args[i].name;
            if let Some(key) = suggest(name, &stray) {
                return Err(IoError::param(format!(
                    "argument %{name} is not in the instances, which have a key `{key}` that \
                     @main does not take: did you mean `{name}`? (--random-params makes up only \
                     the weights)"
                )));
            }
        }
        for &i in &missing {
            let arg = &mut args[i];
            let t = random_param(&arg.name, &arg.ty, seed)?;
            if !t.dtype().is_float() {
                warnings.push(format!(
                    "%{}: {} is not in the instances, so --random-params bound it as a weight of \
                     zeros; if it is a per-instance input (a label, a token), add a key `{}` to \
                     every instance (`tumble serve`: name it with --inputs)",
                    arg.name, arg.ty, arg.name
                ));
            } else if t.rank() == 0 && !instance_args.is_empty() {
                // A float scalar is more often a per-instance target (a regression's `%y`) than
                // a weight: made up and then trained, it fitted the model to noise silently.
                warnings.push(format!(
                    "%{}: {} is not in the instances, so --random-params bound it as a random \
                     weight (a scalar); if it is a per-instance input (a target), add a key `{}` \
                     to every instance (`tumble serve`: name it with --inputs)",
                    arg.name, arg.ty, arg.name
                ));
            }
            generated.insert(arg.name.clone(), t.clone());
            arg.binding = Binding::Param(t);
        }
    }

    let taken: BTreeSet<&str> = args.iter().map(|a| a.name.as_str()).collect();
    let unused: Vec<&str> = file
        .keys()
        .map(String::as_str)
        .filter(|k| !taken.contains(k))
        .collect();
    if !unused.is_empty() {
        warnings.push(format!(
            "the weights file has tensors that @main does not take: {}",
            list_names(&unused)
        ));
    }
    Ok(BoundParams {
        args,
        generated,
        warnings,
    })
}

fn provided_list(instance_args: &BTreeSet<String>) -> String {
    if instance_args.is_empty() {
        String::new()
    } else {
        let names: Vec<&str> = instance_args.iter().map(String::as_str).collect();
        format!(" (they provide: {})", list_names(&names))
    }
}

/// `a, b, c`, at most 30 names, then `and N more`.
fn list_names(names: &[&str]) -> String {
    const MAX: usize = 30;
    let mut s = names
        .iter()
        .take(MAX)
        .copied()
        .collect::<Vec<_>>()
        .join(", ");
    if names.len() > MAX {
        s.push_str(&format!(", and {} more", names.len() - MAX));
    }
    s
}

fn missing_error(args: &[BoundArg], missing: &[usize], file: &BTreeMap<String, Tensor>) -> IoError {
    let names: Vec<String> = missing
        .iter()
        .map(|&i| format!("%{}", args[i].name))
        .collect();
    let head = if names.len() == 1 {
        format!("missing parameter {}", names[0])
    } else {
        format!("missing parameters {}", names.join(", "))
    };
    // No instance has these keys either (an argument some instances give is an instance
    // argument): either a weight is missing or every instance lacks an input.
    let keys: Vec<String> = missing
        .iter()
        .map(|&i| format!("`{}`", args[i].name))
        .collect();
    let as_input = match keys.as_slice() {
        [one] => format!("for a per-instance input, add the key {one} to every instance"),
        _ => format!(
            "for per-instance inputs, add the keys {} to every instance",
            keys.join(", ")
        ),
    };
    if file.is_empty() {
        return IoError::param(format!(
            "{head} (no weights: no weights file was given, or it holds no tensors; pass \
             --params FILE with these tensors, or --random-params SEED; or, {as_input})"
        ));
    }
    let have: Vec<&str> = file.keys().map(String::as_str).collect();
    let mut msg = format!("{head}: the weights file has: {}", list_names(&have));
    // A tensor that is already an argument's own (`O` for %O) is no typo for another one.
    let unused: Vec<&str> = have
        .iter()
        .copied()
        .filter(|h| !args.iter().any(|a| a.name == *h))
        .collect();
    for &i in missing {
        let name = &args[i].name;
        if let Some(s) = suggest(name, &unused) {
            msg.push_str(&format!("; did you mean `{s}` for %{name}?"));
        }
    }
    // (After a suggestion, which ends its sentence with `?`, a new one.)
    let or = if msg.ends_with('?') { " Or" } else { "; or" };
    msg.push_str(&format!("{or}, {as_input}"));
    IoError::param(msg)
}

/// The closest name by edit distance (case-insensitive), if close enough to be a likely typo.
fn suggest<'a>(name: &str, known: &[&'a str]) -> Option<&'a str> {
    // Quadratic in the lengths: long names get no suggestion (see the checker's).
    if name.len() > tumble_check::MAX_SUGGESTED_LEN {
        return None;
    }
    let lower = name.to_lowercase();
    known
        .iter()
        .filter(|k| {
            k.len() <= 2 * tumble_check::MAX_SUGGESTED_LEN
                && k.len().abs_diff(name.len()) <= (name.len().max(k.len()) / 3).max(1)
        })
        .map(|k| (edit_distance(&lower, &k.to_lowercase()), *k))
        .filter(|(d, k)| *d <= (name.len().max(k.len()) / 3).max(1))
        .min_by_key(|(d, _)| *d)
        .map(|(_, k)| k)
}

/// Optimal-string-alignment distance: insertions, deletions, substitutions and swaps of two
/// adjacent characters each cost 1.
fn edit_distance(a: &str, b: &str) -> usize {
    let a: Vec<char> = a.chars().collect();
    let b: Vec<char> = b.chars().collect();
    let mut d = vec![vec![0usize; b.len() + 1]; a.len() + 1];
    for (i, row) in d.iter_mut().enumerate() {
        row[0] = i;
    }
    for (j, cell) in d[0].iter_mut().enumerate() {
        *cell = j;
    }
    for i in 1..=a.len() {
        for j in 1..=b.len() {
            let cost = usize::from(a[i - 1] != b[j - 1]);
            let mut v = (d[i - 1][j] + 1)
                .min(d[i][j - 1] + 1)
                .min(d[i - 1][j - 1] + cost);
            if i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1] {
                v = v.min(d[i - 2][j - 2] + 1);
            }
            d[i][j] = v;
        }
    }
    d[a.len()][b.len()]
}

/// The type a tensor has, written like the source (`Tensor[(768, 128), float32]`).
pub(crate) fn tensor_ty(t: &Tensor) -> Ty {
    Ty::tensor(
        t.shape()
            .iter()
            .map(|&d| Dim::Known(i64::try_from(d).unwrap_or(i64::MAX)))
            .collect::<Vec<_>>(),
        t.dtype(),
    )
}

/// Whether a tensor of `shape` fits the declared `dims` (`?` matches anything).
pub(crate) fn shape_matches(dims: &[Dim], shape: &[usize]) -> bool {
    dims.len() == shape.len()
        && dims.iter().zip(shape).all(|(d, &s)| match d {
            Dim::Any => true,
            Dim::Known(n) => usize::try_from(*n).is_ok_and(|n| n == s),
        })
}

fn check_param(name: &str, dims: &[Dim], dtype: DType, t: &Tensor) -> Result<(), IoError> {
    if t.dtype() != dtype || !shape_matches(dims, t.shape()) {
        return Err(IoError::param(format!(
            "parameter %{name}: expected {}, the file has {}",
            Ty::tensor(dims.to_vec(), dtype),
            tensor_ty(t)
        )));
    }
    Ok(())
}

/// The most elements [`random_param`] fills (4 GiB of float32).
pub const MAX_RANDOM_ELEMENTS: usize = 1 << 30;

/// FNV-1a, to give every parameter name its own random stream.
fn name_hash(name: &str) -> u64 {
    name.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}

/// Seeded random values for parameter `name` of type `ty` (a tensor type with known dims):
/// float elements are `normal(0, 1) / sqrt(fan_in)` with `fan_in` the last dim (1 for scalars or
/// a 0 last dim); int and bool parameters are zeros. The values depend only on `seed`, `name`
/// and the type (not on which other parameters are generated), so runs are reproducible.
pub fn random_param(name: &str, ty: &Ty, seed: u64) -> Result<Tensor, IoError> {
    let Some((dims, dtype)) = ty.as_tensor() else {
        return Err(IoError::param(format!(
            "parameter %{name}: cannot generate random values for {ty}; only tensors can be parameters"
        )));
    };
    let mut shape = Vec::with_capacity(dims.len());
    for (axis, d) in dims.iter().enumerate() {
        match d.known().and_then(|n| usize::try_from(n).ok()) {
            Some(n) => shape.push(n),
            None => {
                return Err(IoError::param(format!(
                    "parameter %{name}: cannot generate random values for {ty}: dimension {axis} \
                     is `{d}`; give its size in @main's type of %{name}, or provide the tensor in \
                     the weights file"
                )))
            }
        }
    }
    let too_big = |e: tumble_tensor::TensorError| {
        IoError::param(format!("parameter %{name}: cannot generate {ty}: {e}"))
    };
    let n = tumble_tensor::shape::num_elements(&shape).map_err(too_big)?;
    if n > MAX_RANDOM_ELEMENTS {
        return Err(IoError::param(format!(
            "parameter %{name}: {ty} has {n} elements; tumble generates at most \
             {MAX_RANDOM_ELEMENTS} random values per parameter (is a dimension too large?)"
        )));
    }
    // Refused before a byte is made: past the memory budget it would stop the process (or
    // fill memory), not say which parameter.
    tumble_limits::reserve(n.saturating_mul(dtype.size())).map_err(|stop| {
        IoError::param(format!(
            "parameter %{name}: generating {ty} at random: {stop}"
        ))
    })?;
    if !dtype.is_float() {
        return Tensor::zeros(shape, dtype).map_err(too_big);
    }
    let fan_in = match shape.last() {
        Some(&d) if d > 0 => d as f64,
        _ => 1.0,
    };
    let scale = 1.0 / fan_in.sqrt();
    let mut rng = Rng::new(seed ^ name_hash(name));
    let buffer = if dtype == DType::Float32 {
        Buffer::F32((0..n).map(|_| (rng.normal_f64() * scale) as f32).collect())
    } else {
        Buffer::F64((0..n).map(|_| rng.normal_f64() * scale).collect())
    };
    Tensor::new(shape, buffer).map_err(too_big)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn suggestions() {
        assert_eq!(edit_distance("kitten", "sitting"), 3);
        assert_eq!(suggest("emb", &["Emb", "W"]), Some("Emb"));
        assert_eq!(suggest("W_iuo", &["W_iou", "b"]), Some("W_iou"));
        assert_eq!(suggest("x", &["weights"]), None);
    }

    #[test]
    fn shapes_match_with_any() {
        assert!(shape_matches(&[Dim::Any, Dim::Known(3)], &[7, 3]));
        assert!(!shape_matches(&[Dim::Any, Dim::Known(3)], &[7, 4]));
        assert!(!shape_matches(&[Dim::Any], &[7, 4]));
        assert!(shape_matches(&[], &[]));
        assert!(!shape_matches(&[Dim::Known(-1)], &[1]));
    }
}
