//! The syntax tree of a module in the Relay text format.
//!
//! Every node carries a byte-offset [`Span`]. Expression, parameter and pattern nodes also carry a
//! `ty` slot the checker fills in place (`None` until then): one IR, annotated by passes.
//!
//! Sequential `let`s are one [`ExprKind::Let`] node holding all bindings, so a chain of ten thousand
//! lets (common in machine-printed Relay) is a flat vector, not ten thousand nested frames.

use crate::attrs::Attrs;
use crate::span::Span;
use crate::types::{DType, Dim, Ty};

/// A name with the span where it was written. Locals are stored without `%`, globals without `@`.
#[derive(Clone, Debug, PartialEq)]
pub struct Ident {
    pub name: String,
    pub span: Span,
}

impl Ident {
    pub fn new(name: impl Into<String>, span: Span) -> Self {
        Ident {
            name: name.into(),
            span,
        }
    }
}

#[derive(Clone, Debug, Default, PartialEq)]
pub struct Module {
    /// The `#[version = "..."]` header, if written.
    pub version: Option<String>,
    pub items: Vec<Item>,
}

#[derive(Clone, Debug, PartialEq)]
pub enum Item {
    Type(TypeDef),
    Def(GlobalDef),
}

impl Module {
    pub fn defs(&self) -> impl Iterator<Item = &GlobalDef> {
        self.items.iter().filter_map(|i| match i {
            Item::Def(d) => Some(d),
            Item::Type(_) => None,
        })
    }

    pub fn defs_mut(&mut self) -> impl Iterator<Item = &mut GlobalDef> {
        self.items.iter_mut().filter_map(|i| match i {
            Item::Def(d) => Some(d),
            Item::Type(_) => None,
        })
    }

    pub fn type_defs(&self) -> impl Iterator<Item = &TypeDef> {
        self.items.iter().filter_map(|i| match i {
            Item::Type(t) => Some(t),
            Item::Def(_) => None,
        })
    }

    pub fn def(&self, name: &str) -> Option<&GlobalDef> {
        self.defs().find(|d| d.name.name == name)
    }

    pub fn type_def(&self, name: &str) -> Option<&TypeDef> {
        self.type_defs().find(|t| t.name.name == name)
    }
}

/// `type List[A] { Cons(A, List[A]), Nil, }`
#[derive(Clone, Debug, PartialEq)]
pub struct TypeDef {
    pub name: Ident,
    pub params: Vec<Ident>,
    pub ctors: Vec<CtorDef>,
    pub span: Span,
}

#[derive(Clone, Debug, PartialEq)]
pub struct CtorDef {
    pub name: Ident,
    pub fields: Vec<TypeExpr>,
    pub span: Span,
}

/// `def @f[A, B](%x: A, %y) -> A { body }`
#[derive(Clone, Debug, PartialEq)]
pub struct GlobalDef {
    pub name: Ident,
    pub type_params: Vec<Ident>,
    pub func: Function,
    pub span: Span,
}

/// The common part of `def` and `fn`: parameters, attributes, optional return type, body.
#[derive(Clone, Debug, PartialEq)]
pub struct Function {
    /// A closure's type parameters, `fn [A](%x: A) -> A { %x }` (a `def`'s are its
    /// [`GlobalDef::type_params`]; empty here).
    pub type_params: Vec<Ident>,
    pub params: Vec<Param>,
    /// Attributes written inside the parameter list, e.g. `fn (%x, Primitive=1) { ... }`.
    pub attrs: Attrs,
    pub ret: Option<TypeExpr>,
    pub body: Box<Expr>,
    pub span: Span,
}

#[derive(Clone, Debug, PartialEq)]
pub struct Param {
    pub name: Ident,
    pub ann: Option<TypeExpr>,
    /// Filled by the checker.
    pub ty: Option<Ty>,
}

/// A type as written in the source.
#[derive(Clone, Debug, PartialEq)]
pub struct TypeExpr {
    pub kind: TypeExprKind,
    pub span: Span,
}

#[derive(Clone, Debug, PartialEq)]
pub enum TypeExprKind {
    /// `Tensor[(d0, d1), dtype]`; a bare dtype such as `float32` is the scalar `Tensor[(), float32]`.
    Tensor { shape: Vec<Dim>, dtype: DType },
    /// `(A, B)`; `()` is the unit type.
    Tuple(Vec<TypeExpr>),
    /// `fn (A, B) -> C`
    Func {
        params: Vec<TypeExpr>,
        ret: Box<TypeExpr>,
    },
    /// An ADT applied to arguments (`List[A]`) or, with no arguments, an ADT or a type parameter;
    /// the checker decides which.
    Named { name: String, args: Vec<TypeExpr> },
    /// `_`: to be inferred.
    Hole,
}

#[derive(Clone, Debug, PartialEq)]
pub struct Expr {
    pub kind: ExprKind,
    pub span: Span,
    /// Filled by the checker.
    pub ty: Option<Ty>,
}

impl Expr {
    pub fn new(kind: ExprKind, span: Span) -> Self {
        Expr {
            kind,
            span,
            ty: None,
        }
    }
}

/// Numeric and boolean literals; each is a scalar tensor of its dtype.
#[derive(Clone, Debug, PartialEq)]
pub enum Literal {
    /// `1` is int32, `1i64` int64.
    Int(i64, DType),
    /// `2.5`, `1e-5` and `1f` are float32, `2.5f64` float64.
    Float(f64, DType),
    /// `True`, `False`
    Bool(bool),
}

impl Literal {
    pub fn dtype(&self) -> DType {
        match self {
            Literal::Int(_, d) | Literal::Float(_, d) => *d,
            Literal::Bool(_) => DType::Bool,
        }
    }
}

#[derive(Clone, Debug, PartialEq)]
pub enum ExprKind {
    /// `%x` (stored without `%`)
    Local(String),
    /// `@f` (stored without `@`)
    Global(String),
    /// A constructor used as a value or callee: `Nil`, `Cons`.
    Ctor(String),
    /// An operator used as a callee (or value): `add`, `nn.dense`.
    Op(String),
    Lit(Literal),
    /// `(a, b)`, `(a,)`, `()`
    Tuple(Vec<Expr>),
    /// `e.0`
    Proj(Box<Expr>, u32),
    /// `f(a, b, key=value)`
    Call(Call),
    /// `let %x = e1; let %y: T = e2; body` — bindings in order, each in scope of the next.
    Let(Vec<LetBinding>, Box<Expr>),
    /// `fn (%x, %y) { e }`
    Fn(Box<Function>),
    /// `if (c) { a } else { b }`
    If(Box<Expr>, Box<Expr>, Box<Expr>),
    /// `match (e) { arms }`; `complete` is false for `match?` (no exhaustiveness check).
    Match {
        scrutinee: Box<Expr>,
        arms: Vec<MatchArm>,
        complete: bool,
    },
}

#[derive(Clone, Debug, PartialEq)]
pub struct Call {
    pub callee: Box<Expr>,
    pub args: Vec<Expr>,
    pub attrs: Attrs,
}

#[derive(Clone, Debug, PartialEq)]
pub struct LetBinding {
    pub var: Param,
    pub value: Expr,
    pub span: Span,
}

#[derive(Clone, Debug, PartialEq)]
pub struct MatchArm {
    pub pattern: Pattern,
    pub body: Expr,
    pub span: Span,
}

#[derive(Clone, Debug, PartialEq)]
pub struct Pattern {
    pub kind: PatternKind,
    pub span: Span,
    /// Filled by the checker.
    pub ty: Option<Ty>,
}

#[derive(Clone, Debug, PartialEq)]
pub enum PatternKind {
    /// `_`
    Wildcard,
    /// `%x` or `%x: T`
    Var(Param),
    /// `Cons(%h, %t)`, `Nil`
    Ctor { name: Ident, args: Vec<Pattern> },
    /// `(%a, _)`
    Tuple(Vec<Pattern>),
}
