//! [`TypeEnv`]: what decoding and encoding need to know about a module's data types.

use tumble_check::{Tables, TypedModule};
use tumble_interp::Program;
use tumble_ir::Ty;

use crate::IoError;

/// The ADT tables of a checked module plus the constructor numbering of its lowered program:
/// enough to turn JSON into interpreter [`tumble_interp::Value`]s by type and back.
#[derive(Clone, Copy)]
pub struct TypeEnv<'a> {
    tables: &'a Tables,
    program: &'a Program,
    /// `Cons` and `Nil`'s constructor numbers when the module's `List` has the prelude's shape
    /// (one type parameter, the two constructors `Cons(A, List[A])` and `Nil`): looked up once,
    /// since every list value of every instance asks.
    list: Option<(u32, u32)>,
}

/// One constructor, resolved against the type arguments of its ADT.
pub(crate) struct CtorRef {
    pub name: String,
    /// Index into `Program::ctors` (what `AdtValue::ctor` holds).
    pub index: u32,
    /// Field types with the ADT's type parameters substituted.
    pub fields: Vec<Ty>,
}

impl<'a> TypeEnv<'a> {
    /// The environment of `typed`, whose lowering is `program`.
    pub fn new(typed: &'a TypedModule, program: &'a Program) -> TypeEnv<'a> {
        TypeEnv::from_parts(&typed.tables, program)
    }

    pub fn from_parts(tables: &'a Tables, program: &'a Program) -> TypeEnv<'a> {
        let mut env = TypeEnv {
            tables,
            program,
            list: None,
        };
        env.list = env.prelude_list();
        env
    }

    /// `Cons` and `Nil`'s numbers if the module's `List` has the prelude's shape.
    fn prelude_list(&self) -> Option<(u32, u32)> {
        let info = self.tables.adts.get("List")?;
        let is_prelude_list = info.params.len() == 1
            && info.ctors.len() == 2
            && self
                .tables
                .ctors
                .get("Cons")
                .is_some_and(|c| c.fields.len() == 2)
            && self
                .tables
                .ctors
                .get("Nil")
                .is_some_and(|c| c.fields.is_empty());
        if !is_prelude_list {
            return None;
        }
        Some((self.ctor_index("Cons")?, self.ctor_index("Nil")?))
    }

    /// The prelude's `List` constructors' numbers, `(Cons, Nil)` (see [`TypeEnv::list_elem`]).
    pub(crate) fn list_ctors(&self) -> Option<(u32, u32)> {
        self.list
    }

    /// The element type if `ty` is the prelude's `List[T]` (constructors `Cons(A, List[A])` and
    /// `Nil`), which is written as a plain JSON array.
    pub(crate) fn list_elem<'t>(&self, ty: &'t Ty) -> Option<&'t Ty> {
        match ty {
            Ty::Adt(name, args) if name == "List" && args.len() == 1 => self.list.map(|_| &args[0]),
            _ => None,
        }
    }

    pub(crate) fn ctor_index(&self, name: &str) -> Option<u32> {
        self.program.ctor_index.get(name).copied()
    }

    /// The constructor names of ADT `adt`, in declaration order.
    pub(crate) fn ctor_names(&self, adt: &str) -> Result<&'a [String], IoError> {
        self.tables
            .adts
            .get(adt)
            .map(|a| a.ctors.as_slice())
            .ok_or_else(|| IoError::output(format!("the module declares no type `{adt}`")))
    }

    /// Constructor `name` of `Ty::Adt(adt, args)`, its fields instantiated at `args`. `None` when
    /// `name` is not a constructor of `adt`.
    pub(crate) fn ctor_of(&self, adt: &str, args: &[Ty], name: &str) -> Option<CtorRef> {
        let info = self.tables.ctors.get(name)?;
        if info.adt != adt {
            return None;
        }
        let params = &self.tables.adts.get(adt)?.params;
        let index = self.ctor_index(name)?;
        let map: Vec<(&str, &Ty)> = params.iter().map(String::as_str).zip(args).collect();
        Some(CtorRef {
            name: name.to_string(),
            index,
            fields: info.fields.iter().map(|f| substitute(f, &map)).collect(),
        })
    }

    /// The ADT a constructor belongs to (for "`Some` belongs to Option" messages).
    pub(crate) fn ctor_adt(&self, name: &str) -> Option<&'a str> {
        self.tables.ctors.get(name).map(|c| c.adt.as_str())
    }

    /// Constructor number `index` (an `AdtValue::ctor`) as a [`CtorRef`] of `Ty::Adt(adt, args)`.
    pub(crate) fn ctor_by_index(&self, adt: &str, args: &[Ty], index: u32) -> Option<CtorRef> {
        let entry = self.program.ctors.get(index as usize)?;
        self.ctor_of(adt, args, &entry.name)
    }
}

/// Replaces the type parameters named in `map` (`Ty::Param`) inside `ty`.
pub(crate) fn substitute(ty: &Ty, map: &[(&str, &Ty)]) -> Ty {
    match ty {
        Ty::Param(p) => map
            .iter()
            .find(|(name, _)| name == p)
            .map_or_else(|| ty.clone(), |(_, t)| (*t).clone()),
        Ty::Tensor { .. } | Ty::Var(_) => ty.clone(),
        Ty::Tuple(ts) => Ty::Tuple(ts.iter().map(|t| substitute(t, map)).collect()),
        Ty::Adt(n, ts) => Ty::Adt(n.clone(), ts.iter().map(|t| substitute(t, map)).collect()),
        Ty::Func(ps, r) => Ty::Func(
            ps.iter().map(|t| substitute(t, map)).collect(),
            Box::new(substitute(r, map)),
        ),
    }
}

/// The first function type a value of type `ty` can hold (in a tuple, an ADT's type arguments,
/// or a constructor's fields), if any: such a value has no JSON form, so an entry returning one
/// is refused when the model is loaded rather than after every instance has run.
pub fn function_inside(ty: &Ty, tables: &Tables) -> Option<Ty> {
    let mut seen: Vec<Ty> = Vec::new();
    let mut todo = vec![ty.clone()];
    while let Some(t) = todo.pop() {
        match &t {
            Ty::Func(..) => return Some(t),
            Ty::Tuple(ts) => todo.extend(ts.iter().cloned()),
            Ty::Adt(name, args) => {
                // An ADT is looked into once per instantiation: recursive ones (`List`) end.
                if seen.contains(&t) {
                    continue;
                }
                seen.push(t.clone());
                let Some(info) = tables.adts.get(name) else {
                    continue;
                };
                let map: Vec<(&str, &Ty)> =
                    info.params.iter().map(String::as_str).zip(args).collect();
                for c in &info.ctors {
                    if let Some(ci) = tables.ctors.get(c) {
                        todo.extend(ci.fields.iter().map(|f| substitute(f, &map)));
                    }
                }
            }
            Ty::Tensor { .. } | Ty::Param(_) | Ty::Var(_) => {}
        }
    }
    None
}

/// Refuses an entry whose results could hold a function (see [`function_inside`]).
pub fn returns_data(typed: &TypedModule, entry: &str, ret: &Ty) -> Result<(), IoError> {
    let what = match function_inside(ret, &typed.tables) {
        None => return Ok(()),
        Some(_) if matches!(ret, Ty::Func(..)) => format!("a function ({ret})"),
        Some(f) => format!("{ret}, which can hold a function ({f})"),
    };
    Err(IoError::param(format!(
        "`@{entry}` returns {what}; a function has no JSON form, so its results could not be \
         written: return data (tensors, tuples, lists, constructors) from @{entry}"
    )))
}

/// `@entry`'s parameters (names without `%`, declared types) and return type, as the checker
/// resolved them. Errors when the module has no such function or it is generic.
pub fn main_signature(
    typed: &TypedModule,
    entry: &str,
) -> Result<(Vec<(String, Ty)>, Ty), IoError> {
    let def = typed
        .module
        .defs()
        .find(|d| d.name.name == entry)
        .ok_or_else(|| {
            let user: Vec<String> = typed
                .user_globals()
                .map(|(name, _)| format!("@{name}"))
                .collect();
            let has = match user.len() {
                0 => "it defines no functions".to_string(),
                n if n <= 8 => format!("it defines {}", user.join(", ")),
                _ => format!("it defines {}, …", user[..8].join(", ")),
            };
            IoError::param(format!("the module has no function `@{entry}` ({has})"))
        })?;
    let sig = typed.globals.get(entry);
    if let Some(sig) = sig {
        if !sig.type_params.is_empty() {
            return Err(IoError::param(format!(
                "`@{entry}` is generic (type parameters {}); the entry point must have concrete types",
                sig.type_params.join(", ")
            )));
        }
    }
    let sig_params = match sig.map(|s| &s.ty) {
        Some(Ty::Func(ps, r)) => Some((ps, r)),
        _ => None,
    };
    let mut params = Vec::with_capacity(def.func.params.len());
    for (i, p) in def.func.params.iter().enumerate() {
        let ty =
            p.ty.clone()
                .or_else(|| sig_params.and_then(|(ps, _)| ps.get(i).cloned()))
                .ok_or_else(|| {
                    IoError::param(format!(
                    "the type of `@{entry}`'s argument %{} is unknown (was the module checked?)",
                    p.name.name
                ))
                })?;
        params.push((p.name.name.trim_start_matches('%').to_string(), ty));
    }
    let ret = sig_params
        .map(|(_, r)| (**r).clone())
        .ok_or_else(|| IoError::param(format!("`@{entry}` has no resolved function type")))?;
    Ok((params, ret))
}
