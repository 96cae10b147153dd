//! Semantic types assigned by the checker (as opposed to [`crate::ast::TypeExpr`], the written form).

use std::fmt;

/// Element types of tensors.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub enum DType {
    Float32,
    Float64,
    Int32,
    Int64,
    Bool,
}

impl DType {
    pub const ALL: [DType; 5] = [
        DType::Float32,
        DType::Float64,
        DType::Int32,
        DType::Int64,
        DType::Bool,
    ];

    pub fn name(self) -> &'static str {
        match self {
            DType::Float32 => "float32",
            DType::Float64 => "float64",
            DType::Int32 => "int32",
            DType::Int64 => "int64",
            DType::Bool => "bool",
        }
    }

    pub fn from_name(s: &str) -> Option<DType> {
        DType::ALL.into_iter().find(|d| d.name() == s)
    }

    pub fn is_float(self) -> bool {
        matches!(self, DType::Float32 | DType::Float64)
    }

    pub fn is_int(self) -> bool {
        matches!(self, DType::Int32 | DType::Int64)
    }

    /// Size of one element in bytes.
    pub fn size(self) -> usize {
        match self {
            DType::Float32 | DType::Int32 => 4,
            DType::Float64 | DType::Int64 => 8,
            DType::Bool => 1,
        }
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// One dimension of a tensor shape: a known extent or `?` (known only at run time).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub enum Dim {
    Known(i64),
    Any,
}

impl Dim {
    pub fn known(self) -> Option<i64> {
        match self {
            Dim::Known(n) => Some(n),
            Dim::Any => None,
        }
    }
}

impl fmt::Display for Dim {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Dim::Known(n) => write!(f, "{n}"),
            Dim::Any => f.write_str("?"),
        }
    }
}

/// An inference variable, resolved by the checker's substitution.
#[derive(
    Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize,
)]
pub struct TyVar(pub u32);

#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub enum Ty {
    Tensor {
        shape: Vec<Dim>,
        dtype: DType,
    },
    Tuple(Vec<Ty>),
    Func(Vec<Ty>, Box<Ty>),
    /// An algebraic data type applied to its type arguments, e.g. `List[Tensor[(2), float32]]`.
    Adt(String, Vec<Ty>),
    /// A rigid type parameter of a generic definition (`A` in `def @id[A](%x: A) -> A`).
    Param(String),
    /// An inference variable; never present in a fully checked module.
    Var(TyVar),
}

impl Ty {
    pub fn tensor(shape: impl Into<Vec<Dim>>, dtype: DType) -> Ty {
        Ty::Tensor {
            shape: shape.into(),
            dtype,
        }
    }

    /// A tensor type with all dimensions known.
    pub fn tensor_of(shape: &[i64], dtype: DType) -> Ty {
        Ty::tensor(
            shape.iter().map(|&d| Dim::Known(d)).collect::<Vec<_>>(),
            dtype,
        )
    }

    pub fn scalar(dtype: DType) -> Ty {
        Ty::tensor(Vec::new(), dtype)
    }

    pub fn unit() -> Ty {
        Ty::Tuple(Vec::new())
    }

    pub fn as_tensor(&self) -> Option<(&[Dim], DType)> {
        match self {
            Ty::Tensor { shape, dtype } => Some((shape, *dtype)),
            _ => None,
        }
    }

    /// True when no inference variable occurs in the type.
    pub fn is_resolved(&self) -> bool {
        match self {
            Ty::Tensor { .. } | Ty::Param(_) => true,
            Ty::Var(_) => false,
            Ty::Tuple(ts) | Ty::Adt(_, ts) => ts.iter().all(Ty::is_resolved),
            Ty::Func(ps, r) => ps.iter().all(Ty::is_resolved) && r.is_resolved(),
        }
    }
}

/// Writes the type in the Relay text syntax, so messages read like the source.
impl fmt::Display for Ty {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Ty::Tensor { shape, dtype } => {
                f.write_str("Tensor[(")?;
                for (i, d) in shape.iter().enumerate() {
                    if i > 0 {
                        f.write_str(", ")?;
                    }
                    write!(f, "{d}")?;
                }
                write!(f, "), {dtype}]")
            }
            Ty::Tuple(ts) => {
                f.write_str("(")?;
                for (i, t) in ts.iter().enumerate() {
                    if i > 0 {
                        f.write_str(", ")?;
                    }
                    write!(f, "{t}")?;
                }
                if ts.len() == 1 {
                    f.write_str(",")?;
                }
                f.write_str(")")
            }
            Ty::Func(ps, r) => {
                f.write_str("fn (")?;
                for (i, t) in ps.iter().enumerate() {
                    if i > 0 {
                        f.write_str(", ")?;
                    }
                    write!(f, "{t}")?;
                }
                write!(f, ") -> {r}")
            }
            Ty::Adt(name, args) => {
                f.write_str(name)?;
                if !args.is_empty() {
                    f.write_str("[")?;
                    for (i, t) in args.iter().enumerate() {
                        if i > 0 {
                            f.write_str(", ")?;
                        }
                        write!(f, "{t}")?;
                    }
                    f.write_str("]")?;
                }
                Ok(())
            }
            Ty::Param(name) => f.write_str(name),
            Ty::Var(v) => write!(f, "?t{}", v.0),
        }
    }
}
