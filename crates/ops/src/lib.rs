//! The operator table: one entry per operator with its attributes, its shape relation (the type
//! rule the checker applies, and the run time re-applies with concrete shapes), its reference
//! kernel and its fusion class.
//!
//! Running an operator on concrete values goes through [`eval`]: it re-applies the relation to the
//! actual shapes (the checks a `?` dim postponed happen here), then runs the kernel. The kernels
//! (in `kernel/`, mirroring `rel/`) are the reference implementation: plain loops over flat data,
//! written for clarity; every later optimization is tested against them. Their semantic choices
//! (integer division, `power` on ints, `take` modes, `random.db_uniform`, ...) are documented in
//! the `kernel` module and in the README.
//!
//! Later issues add, next to each relation, the operator's batching rule.

use tumble_ir::{Attrs, Ty};
use tumble_tensor::Tensor;

mod kernel;
/// What `variance` divides its sum of squares by, for executors computing it their own way.
pub use kernel::broadcast::{int_div, int_floor_div, int_floor_mod, int_mod};
pub use kernel::reduce::variance_divisor;
mod rel;
mod table;
pub mod vjp;

pub use rel::layout::{leading_rows, slice_plan, takes_rows};
pub use table::all;

/// A runtime value an operator takes or returns: a tensor, or a tuple of tensors (the input of
/// `concatenate`, the output of `split`; unit `()` is the empty tuple, returned by
/// `db.phase_change`).
#[derive(Clone, Debug, PartialEq)]
pub enum OpValue {
    Tensor(Tensor),
    Tuple(Vec<Tensor>),
}

impl OpValue {
    /// The unit value `()`.
    pub fn unit() -> OpValue {
        OpValue::Tuple(Vec::new())
    }

    /// The tensor, if this is one.
    pub fn as_tensor(&self) -> Option<&Tensor> {
        match self {
            OpValue::Tensor(t) => Some(t),
            OpValue::Tuple(_) => None,
        }
    }

    /// The tuple's fields, if this is a tuple.
    pub fn as_tuple(&self) -> Option<&[Tensor]> {
        match self {
            OpValue::Tensor(_) => None,
            OpValue::Tuple(ts) => Some(ts),
        }
    }
}

impl From<Tensor> for OpValue {
    fn from(t: Tensor) -> OpValue {
        OpValue::Tensor(t)
    }
}

/// What a kernel may use besides its arguments: the random generator of the run (read by
/// `random.db_uniform`, advanced once per element drawn).
pub struct OpCtx<'a> {
    pub rng: &'a mut tumble_tensor::Rng,
}

/// Why an operator could not run on its values. Messages start with the operator name, like
/// relation messages (`nn.dense: input has 512 columns but weight expects 256`, `divide: integer
/// division by zero`).
#[derive(Debug, Clone, PartialEq)]
pub struct KernelError {
    pub message: String,
}

impl KernelError {
    pub fn new(message: impl Into<String>) -> Self {
        KernelError {
            message: message.into(),
        }
    }
}

impl std::fmt::Display for KernelError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for KernelError {}

impl From<RelError> for KernelError {
    fn from(e: RelError) -> KernelError {
        KernelError { message: e.message }
    }
}

/// A reference kernel: from concrete arguments and the call's attributes to the result. Kernels
/// never panic on user data: bad shapes, out-of-range indices, integer division by zero and the
/// like are [`KernelError`]s.
pub type Kernel = fn(&[OpValue], &Attrs, &mut OpCtx) -> Result<OpValue, KernelError>;

/// The (fully known) type of a runtime value: a tensor's shape and dtype, or a tuple of those.
pub fn ty_of(v: &OpValue) -> Ty {
    fn tensor_ty(t: &Tensor) -> Ty {
        let shape: Vec<i64> = t
            .shape()
            .iter()
            .map(|&d| i64::try_from(d).unwrap_or(i64::MAX))
            .collect();
        Ty::tensor_of(&shape, t.dtype())
    }
    match v {
        OpValue::Tensor(t) => tensor_ty(t),
        OpValue::Tuple(ts) => Ty::Tuple(ts.iter().map(tensor_ty).collect()),
    }
}

/// Runs `op` on concrete values. First checks the attributes ([`check_attrs`]) and re-applies the
/// shape relation to the actual types of `args`: this is where checks postponed by `?` dims
/// happen (`nn.dense: input has 512 columns but weight expects 256`), with the relation's message.
/// Then runs the kernel, and finally checks that the kernel's result has exactly the type the
/// relation computed (a mismatch is a bug in the kernel, reported as an error, not a panic); a
/// `?` the relation leaves on concrete arguments (`arange`'s length, which depends on its
/// operands' values) matches any size.
pub fn eval(
    op: &OpDef,
    args: &[OpValue],
    attrs: &Attrs,
    ctx: &mut OpCtx,
) -> Result<OpValue, KernelError> {
    check_attrs(op, attrs).map_err(|(_, message)| KernelError { message })?;
    let tys: Vec<Ty> = args.iter().map(ty_of).collect();
    let want = (op.relation)(&tys, attrs)?;
    // The output's size is known before the kernel allocates it: a large tensor that would not
    // fit in the memory budget is refused here, not after the machine has started swapping.
    // Small ones are left to the executors' polls, which can say what filled the budget.
    let out_bytes = value_bytes(&want);
    if out_bytes >= RESERVE_ABOVE {
        tumble_limits::reserve(out_bytes).map_err(|stop| KernelError {
            message: format!("{}: {stop}", op.name),
        })?;
    }
    let out = (op.kernel)(args, attrs, ctx)?;
    let got = ty_of(&out);
    if !fits(&got, &want) {
        return Err(KernelError::new(format!(
            "{}: internal error: the kernel returned {got} but the shape relation says {want}",
            op.name
        )));
    }
    Ok(out)
}

/// Whether the concrete type `got` is an instance of `want` (a `?` in `want` matches any size).
fn fits(got: &Ty, want: &Ty) -> bool {
    match (got, want) {
        (
            Ty::Tensor {
                shape: gs,
                dtype: gd,
            },
            Ty::Tensor {
                shape: ws,
                dtype: wd,
            },
        ) => {
            gd == wd
                && gs.len() == ws.len()
                && gs
                    .iter()
                    .zip(ws)
                    .all(|(g, w)| w.known().is_none() || g == w)
        }
        (Ty::Tuple(gs), Ty::Tuple(ws)) => {
            gs.len() == ws.len() && gs.iter().zip(ws).all(|(g, w)| fits(g, w))
        }
        _ => got == want,
    }
}

/// Operators whose result depends only on their operand's shape, not its elements
/// (`shape_of`, `ndarray_size`): an operand read only by them need not be computed or moved to
/// know the result.
pub const SHAPE_READERS: &[&str] = &["shape_of", "ndarray_size"];

/// Outputs at least this large are checked against the memory budget before they are allocated.
pub const RESERVE_ABOVE: usize = 1 << 20;

/// The bytes of the tensors of a value of type `ty` (unknown dims count as 0), saturating.
pub fn value_bytes(ty: &Ty) -> usize {
    value_bytes_with(ty, 0)
}

/// [`value_bytes`] with unknown dims counted as `unknown` (1: bytes per unit of a `?` length).
pub fn value_bytes_with(ty: &Ty, unknown: usize) -> usize {
    match ty {
        Ty::Tensor { shape, dtype } => shape
            .iter()
            .map(|d| {
                d.known()
                    .map_or(unknown, |n| usize::try_from(n).unwrap_or(0))
            })
            .fold(dtype.size(), usize::saturating_mul),
        Ty::Tuple(ts) => ts
            .iter()
            .map(|t| value_bytes_with(t, unknown))
            .fold(0, usize::saturating_add),
        _ => 0,
    }
}

/// How an operator behaves under fusion (BladeDISC/ACROBAT): decides which kernel stage it joins.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FusionClass {
    /// Matrix products (`nn.dense`, `nn.batch_matmul`): become GEMM stages.
    Gemm,
    /// One output element from the same-index input elements (`sigmoid`, `add` without broadcast).
    Elementwise,
    /// Elementwise with numpy broadcasting.
    Broadcast,
    /// Reduces along axes (`sum`, `nn.softmax`, `nn.layer_norm`).
    Reduction,
    /// Moves data without arithmetic (`reshape`, `concatenate`, `split`, `take`, `transpose`).
    Layout,
    /// Not fusible: scheduling intrinsics, random draws, tensor creation from attributes.
    Opaque,
}

/// Which stage of a block's kernel plan an operator can join (read by the planner,
/// `tumble_compile::plan`, instead of lists of operator names).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StageRule {
    /// Rows times a 2-D weight (`nn.dense`): a GEMM stage over every invocation's rows.
    Gemm,
    /// Rows of a table selected by indices (`take` along axis 0): a gather stage.
    Gather,
    /// Each output row from the same rows of its operands, at any rank ≥ 1 (f32): joins a fused
    /// row program.
    RowWise,
    /// Row-wise when its `axis` attribute (default `default_axis`) names the last axis:
    /// `nn.softmax`, `nn.layer_norm`, `nn.bias_add`, `split`, `concatenate`.
    RowWiseOnLastAxis { default_axis: i64 },
    /// None of those: runs through the batching rules on whole batched tensors.
    Batched,
}

/// The kind of value an attribute takes; used to check calls and to document operators.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AttrKind {
    Int,
    Float,
    Bool,
    Str,
    /// A dtype name string such as `"float32"`.
    DType,
    Ints,
    /// An integer or a list of integers (e.g. `split`'s `indices_or_sections`).
    IntOrInts,
    Any,
}

#[derive(Clone, Copy, Debug)]
pub struct AttrSpec {
    pub name: &'static str,
    pub kind: AttrKind,
    pub required: bool,
    /// The default as Relay writes it (`None`, `-1`, `False`, `"clip"`); empty when required.
    /// Documentation only: relations apply the same defaults in code.
    pub default: &'static str,
}

impl AttrSpec {
    /// An optional attribute with its default written in Relay syntax.
    pub const fn opt(name: &'static str, kind: AttrKind, default: &'static str) -> Self {
        AttrSpec {
            name,
            kind,
            required: false,
            default,
        }
    }

    /// A required attribute.
    pub const fn req(name: &'static str, kind: AttrKind) -> Self {
        AttrSpec {
            name,
            kind,
            required: true,
            default: "",
        }
    }
}

/// Why a relation rejected its inputs. `arg` names the offending argument (0-based) when one is to
/// blame, so the checker can point at it.
#[derive(Clone, Debug, PartialEq)]
pub struct RelError {
    pub message: String,
    pub arg: Option<usize>,
}

impl RelError {
    pub fn new(message: impl Into<String>) -> Self {
        RelError {
            message: message.into(),
            arg: None,
        }
    }

    pub fn at(arg: usize, message: impl Into<String>) -> Self {
        RelError {
            message: message.into(),
            arg: Some(arg),
        }
    }
}

/// A shape relation: from the (fully resolved) argument types and the call's attributes to the result
/// type. Messages start with the operator name and say what was expected and what was found, e.g.
/// `nn.dense: input has 512 columns but weight expects 256`.
pub type Relation = fn(&[Ty], &Attrs) -> Result<Ty, RelError>;

#[derive(Clone, Copy)]
pub struct OpDef {
    pub name: &'static str,
    /// Number of positional arguments.
    pub arity: usize,
    /// Another accepted number of positional arguments, for operators with two call forms:
    /// `random.db_uniform` takes its bounds as 2 tensor arguments (ACROBAT's form, bounds known
    /// at run time) or, with 0 arguments, as `low`/`high` attributes. The relation tells them apart.
    pub alt_arity: Option<usize>,
    pub attrs: &'static [AttrSpec],
    pub relation: Relation,
    /// The reference implementation; call it through [`eval`], which checks the arguments first.
    pub kernel: Kernel,
    pub class: FusionClass,
    /// The kernel-plan stage it can join.
    pub stage: StageRule,
    /// One line for `--help`-style listings.
    pub doc: &'static str,
    /// The result's shape depends on the operands' values, not only on their types (`arange`'s
    /// length): the relation leaves it `?` even for concrete arguments, so an executor that sizes
    /// results before computing them (the batched runtime's blocks) must run it on its own.
    pub sized_by_values: bool,
}

impl OpDef {
    /// The same operator, also callable with `n` positional arguments (see `alt_arity`).
    pub const fn or_arity(mut self, n: usize) -> OpDef {
        self.alt_arity = Some(n);
        self
    }

    /// The same operator, joining kernel-plan stages of kind `rule`.
    pub const fn in_stage(mut self, rule: StageRule) -> OpDef {
        self.stage = rule;
        self
    }

    /// The same operator, its result sized by its operands' values (see `sized_by_values`).
    pub const fn sized_at_run_time(mut self) -> OpDef {
        self.sized_by_values = true;
        self
    }

    /// Whether the operator can be called with `n` positional arguments.
    pub fn takes(&self, n: usize) -> bool {
        n == self.arity || self.alt_arity == Some(n)
    }

    /// The accepted argument counts for messages: `2`, or `2 or 0`.
    pub fn arity_text(&self) -> String {
        match self.alt_arity {
            Some(alt) => format!("{} or {alt}", self.arity),
            None => self.arity.to_string(),
        }
    }
}

impl std::fmt::Debug for OpDef {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OpDef")
            .field("name", &self.name)
            .field("arity", &self.arity)
            .finish_non_exhaustive()
    }
}

/// Other names of operators in the table: TVM's FastMath pass rewrites `exp`, `tanh`, `erf` and
/// `nn.softmax` into these approximations, and tumble's batched kernels are fast f32 functions
/// already, so a program TVM wrote with them runs as with the originals (and prints them).
pub const ALIASES: &[(&str, &str)] = &[
    ("fast_exp", "exp"),
    ("fast_tanh", "tanh"),
    ("fast_erf", "erf"),
    ("nn.fast_softmax", "nn.softmax"),
];

/// `name` as the alias it is ([`ALIASES`]; `None` for an operator's own name), so a diagnostic can
/// say what the program wrote.
pub fn alias_name(name: &str) -> Option<&'static str> {
    ALIASES.iter().find(|(a, _)| *a == name).map(|(a, _)| *a)
}

/// The operator named `name` (or an alias of it, [`ALIASES`]), if the table has it. Hashes into
/// an index built on first use.
pub fn lookup(name: &str) -> Option<&'static OpDef> {
    static INDEX: std::sync::OnceLock<std::collections::HashMap<&'static str, &'static OpDef>> =
        std::sync::OnceLock::new();
    let index = INDEX.get_or_init(|| {
        let mut index: std::collections::HashMap<_, _> =
            all().iter().map(|op| (op.name, op)).collect();
        for (alias, name) in ALIASES {
            if let Some(op) = index.get(name).copied() {
                index.insert(alias, op);
            }
        }
        index
    });
    index.get(name).copied()
}

/// Checks a call's attributes against the operator's spec: unknown names, missing required ones, and
/// wrong kinds. Returns the offending attribute's name (if any) with the message.
pub fn check_attrs(op: &OpDef, attrs: &Attrs) -> Result<(), (Option<String>, String)> {
    for a in attrs.iter() {
        let Some(spec) = op.attrs.iter().find(|s| s.name == a.name) else {
            let known: Vec<&str> = op.attrs.iter().map(|s| s.name).collect();
            let hint = if known.is_empty() {
                "it takes no attributes".to_string()
            } else {
                format!("it takes: {}", known.join(", "))
            };
            return Err((
                Some(a.name.clone()),
                format!("{}: unknown attribute `{}` ({hint})", op.name, a.name),
            ));
        };
        let ok = match spec.kind {
            AttrKind::Int => attrs.int(spec.name).is_ok(),
            AttrKind::Float => attrs.float(spec.name).is_ok(),
            AttrKind::Bool => attrs.bool(spec.name).is_ok(),
            AttrKind::Str => attrs.str(spec.name).is_ok(),
            AttrKind::DType => match attrs.str(spec.name) {
                Ok(Some(s)) => tumble_ir::DType::from_name(s).is_some(),
                Ok(None) => true,
                Err(_) => false,
            },
            AttrKind::Ints | AttrKind::IntOrInts => attrs.ints(spec.name).is_ok(),
            AttrKind::Any => true,
        };
        if !ok {
            let want = match spec.kind {
                AttrKind::Int => "an integer",
                AttrKind::Float => "a number",
                AttrKind::Bool => "True or False",
                AttrKind::Str => "a string",
                AttrKind::DType => "a dtype name (float32, float64, int32, int64, bool)",
                AttrKind::Ints => "a list of integers",
                AttrKind::IntOrInts => "an integer or a list of integers",
                AttrKind::Any => "any value",
            };
            return Err((
                Some(a.name.clone()),
                format!(
                    "{}: attribute `{}` must be {want}, found `{}`",
                    op.name, a.name, a.value
                ),
            ));
        }
    }
    for spec in op.attrs.iter().filter(|s| s.required) {
        if attrs.get(spec.name).is_none() {
            return Err((
                None,
                format!("{}: missing required attribute `{}`", op.name, spec.name),
            ));
        }
    }
    Ok(())
}

/// Operators in serialized programs, by name (`#[serde(with = "tumble_ops::by_name")]` on a
/// `&'static OpDef` field): reading one back looks the name up in this build's table, so a file
/// that names an operator this build lacks is an error.
pub mod by_name {
    use serde::{Deserialize, Deserializer, Serializer};

    use crate::OpDef;

    pub fn serialize<S: Serializer>(op: &&'static OpDef, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(op.name)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<&'static OpDef, D::Error> {
        let name = String::deserialize(d)?;
        crate::lookup(&name)
            .ok_or_else(|| serde::de::Error::custom(format!("unknown operator `{name}`")))
    }
}
