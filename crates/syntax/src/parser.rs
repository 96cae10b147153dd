//! Tokens → syntax tree, by recursive descent with an explicit nesting budget.
//!
//! Two limits keep the parser and every later pass (checker, printer, visitors) from overflowing:
//! - each expression is returned with its *height* in the tree, and a tree deeper than
//!   [`MAX_NESTING`] is a located error. Heights catch chains that are parsed in a loop yet still
//!   build deep trees (`f(a)(b)(c)…`, `%x.0.0.0…`, `1 + 1 + 1 …`, `- - - x`);
//! - the parser's own recursion is counted per kind (expression, type, pattern, attribute list), so
//!   `((((…` stops with the same error instead of overflowing the stack. Types, patterns and
//!   attribute lists stop at [`MAX_NESTING`]. Expressions get twice that, because grouping brackets
//!   nest the text but not the tree, and the printer adds up to one pair per level (`{ let … }` as a
//!   value, `(fn …)(x)` as a callee): every tree within the height limit must read back.
//!
//! Sequential bindings (`let %x = e;` and TVM's graph form `%0 = e;`) are read in a loop into one
//! [`ExprKind::Let`] and add one level, however many there are.
//!
//! Errors are recorded in `diags` and unwind as [`Stop`]; the module parser recovers at the next
//! top-level `def` or `type`, so one run reports every broken item.

use crate::lexer::{lex, Tok, Token};
use crate::MAX_NESTING;
use tumble_ir::attrs::Attr;
use tumble_ir::{
    AttrValue, Attrs, Call, CtorDef, DType, Diagnostic, Dim, Expr, ExprKind, Function, GlobalDef,
    Ident, Item, LetBinding, Literal, MatchArm, Module, Param, Pattern, PatternKind, SourceId,
    Span, TypeDef, TypeExpr, TypeExprKind,
};

/// An error has been recorded; unwind to the nearest recovery point.
pub(crate) struct Stop;

type PResult<T> = Result<T, Stop>;

/// An expression and its height (a leaf is 1).
type Node = (Expr, u32);

static EOF: Token = Token {
    kind: Tok::Eof,
    lo: 0,
    hi: 0,
};

const HEIGHT_LIMIT: u32 = MAX_NESTING as u32;

/// What made an expression too deep, for the advice in the message.
#[derive(Clone, Copy)]
enum Deep {
    /// A chain of an infix operator (its symbol).
    Operator(&'static str),
    /// Calls nested in arguments (a long `Cons(.., Cons(..))` literal).
    Call,
    Other,
}

/// What is being nested, for the budget and the message.
#[derive(Clone, Copy)]
enum Nest {
    Expr = 0,
    Type = 1,
    Pattern = 2,
    Attr = 3,
}

impl Nest {
    fn noun(self) -> &'static str {
        match self {
            Nest::Expr => "expression",
            Nest::Type => "type",
            Nest::Pattern => "pattern",
            Nest::Attr => "attribute list",
        }
    }
}

/// Words that cannot be names. `None` is not among them: it is an attribute value, but also the
/// usual constructor of `Option`.
const RESERVED: [&str; 4] = ["let", "else", "def", "type"];

pub(crate) fn parse_module(text: &str, src: SourceId) -> Result<Module, Vec<Diagnostic>> {
    let mut p = Parser::new(text, src);
    let m = p.module();
    p.finish(m)
}

pub(crate) fn parse_expr(text: &str, src: SourceId) -> Result<Expr, Vec<Diagnostic>> {
    let mut p = Parser::new(text, src);
    let parsed = p
        .expr()
        .and_then(|(e, _)| p.expect(&Tok::Eof, "end of input").map(|_| e));
    match parsed {
        Ok(e) => p.finish(e),
        Err(Stop) => Err(p.into_diags()),
    }
}

struct Parser<'a> {
    toks: Vec<Token>,
    pos: usize,
    src: SourceId,
    text: &'a str,
    depth: [usize; 4],
    diags: Vec<Diagnostic>,
    lex_diags: Vec<Diagnostic>,
    /// Constructors the text declares with a lowercase name (`type Box[T] { box(T) }`, as TVM's
    /// tensor-array types have): read as constructors, not operators, wherever they appear.
    lower_ctors: std::collections::HashSet<String>,
    /// The text has a `meta[...]` reference (without one, a `#[metadata]` section is skipped).
    meta_refs: bool,
}

fn is_upper(s: &str) -> bool {
    s.starts_with(|c: char| c.is_ascii_uppercase())
}

/// The lowercase names declared as constructors in `type` definitions: each name that opens an
/// entry (after `{` or a `,`) at the top level of a `type`'s braces. A scan of the tokens, so the
/// parser knows them before it meets a use.
fn lowercase_ctors(toks: &[Token]) -> std::collections::HashSet<String> {
    let mut out = std::collections::HashSet::new();
    let mut i = 0;
    while i < toks.len() {
        let is_type = matches!(&toks[i].kind, Tok::Ident(k) if k == "type");
        i += 1;
        if !is_type {
            continue;
        }
        // To the definition's `{`, then its entries until the matching `}`.
        while i < toks.len() && !matches!(toks[i].kind, Tok::LBrace | Tok::Eof) {
            i += 1;
        }
        let mut depth = 0usize;
        let mut entry_start = true;
        while i < toks.len() {
            match &toks[i].kind {
                Tok::LBrace | Tok::LParen | Tok::LBracket => {
                    depth += 1;
                    entry_start = depth == 1;
                }
                Tok::RBrace | Tok::RParen | Tok::RBracket => {
                    depth = depth.saturating_sub(1);
                    if depth == 0 {
                        break;
                    }
                }
                Tok::Comma if depth == 1 => entry_start = true,
                Tok::Ident(n) if depth == 1 && entry_start => {
                    if !is_upper(n) {
                        out.insert(n.clone());
                    }
                    entry_start = false;
                }
                Tok::Eof => break,
                _ => entry_start = false,
            }
            i += 1;
        }
    }
    out
}

/// Names like `float16` or `uint8`: meant as a dtype, so reported as an unknown one rather than
/// taken for a type parameter.
/// A dtype in a type annotation. ACROBAT's programs mark scalars kept on the host with an `SS`
/// suffix (`Tensor[(), int32SS]`); tumble decides where scalars live by itself, so `int32SS` reads
/// as `int32` and ACROBAT's files check unchanged.
fn annotation_dtype(s: &str) -> Option<DType> {
    DType::from_name(s).or_else(|| s.strip_suffix("SS").and_then(DType::from_name))
}

fn looks_like_dtype(s: &str) -> bool {
    ["bfloat", "float", "uint", "int"].iter().any(|p| {
        s.strip_prefix(p)
            .is_some_and(|rest| !rest.is_empty() && rest.bytes().all(|b| b.is_ascii_digit()))
    })
}

/// The name prefix of the binding that `e1; e2` makes for `e1` (see `Parser::sequence`): a `.`
/// cannot appear in a source `%name`.
pub(crate) const SEQUENCED: &str = "seq.";

/// An infix operator token: its operator name, its source symbol (for messages) and precedence.
fn binop(t: &Tok) -> Option<(&'static str, &'static str, u8)> {
    Some(match t {
        // TVM's table (`op_table.h`): equalities bind looser than orderings, so
        // `%b == %x < %y` is `equal(%b, less(%x, %y))`.
        Tok::EqEq => ("equal", "==", 1),
        Tok::NotEq => ("not_equal", "!=", 1),
        Tok::Lt => ("less", "<", 2),
        Tok::Gt => ("greater", ">", 2),
        Tok::Le => ("less_equal", "<=", 2),
        Tok::Ge => ("greater_equal", ">=", 2),
        Tok::Plus => ("add", "+", 3),
        Tok::Minus => ("subtract", "-", 3),
        Tok::Star => ("multiply", "*", 4),
        Tok::Slash => ("divide", "/", 4),
        _ => return None,
    })
}

fn call_node(callee: Expr, args: Vec<Expr>, attrs: Attrs, span: Span) -> Expr {
    Expr::new(
        ExprKind::Call(Call {
            callee: Box::new(callee),
            args,
            attrs,
        }),
        span,
    )
}

/// What a token starting a primary expression leads to; computed first so that the dispatch does
/// not hold a borrow of the token.
enum PrimaryKind {
    Local,
    Global,
    Number,
    Paren,
    Block,
    Fn,
    If,
    Match,
    Bool(bool),
    Name,
    Other,
}

impl<'a> Parser<'a> {
    fn new(text: &'a str, src: SourceId) -> Self {
        let (toks, lex_diags) = lex(text, src);
        let lower_ctors = lowercase_ctors(&toks);
        let meta_refs = toks.windows(2).any(|w| {
            matches!(&w[0].kind, Tok::Ident(k) if k == "meta") && w[1].kind == Tok::LBracket
        });
        Parser {
            lower_ctors,
            meta_refs,
            toks,
            pos: 0,
            src,
            text,
            depth: [0; 4],
            diags: Vec::new(),
            lex_diags,
        }
    }

    fn into_diags(self) -> Vec<Diagnostic> {
        let mut all = self.lex_diags;
        all.extend(self.diags);
        all.sort_by_key(|d| d.primary_span().map_or(0, |s| s.lo));
        all
    }

    fn finish<T>(self, value: T) -> Result<T, Vec<Diagnostic>> {
        if self.diags.is_empty() && self.lex_diags.is_empty() {
            Ok(value)
        } else {
            Err(self.into_diags())
        }
    }

    // ---- token access -------------------------------------------------------------------------

    fn tok(&self) -> &Token {
        self.toks
            .get(self.pos)
            .or_else(|| self.toks.last())
            .unwrap_or(&EOF)
    }

    fn peek(&self) -> &Tok {
        &self.tok().kind
    }

    fn peek_at(&self, k: usize) -> &Tok {
        self.toks.get(self.pos + k).map_or(&Tok::Eof, |t| &t.kind)
    }

    fn at(&self, t: &Tok) -> bool {
        self.peek() == t
    }

    fn at_kw(&self, kw: &str) -> bool {
        matches!(self.peek(), Tok::Ident(s) if s == kw)
    }

    fn cur_span(&self) -> Span {
        let t = self.tok();
        Span::new(self.src, t.lo, t.hi)
    }

    /// End of the last consumed token.
    fn prev_hi(&self) -> u32 {
        self.pos
            .checked_sub(1)
            .and_then(|i| self.toks.get(i))
            .map_or(0, |t| t.hi)
    }

    fn prev_is(&self, t: &Tok) -> bool {
        self.pos
            .checked_sub(1)
            .and_then(|i| self.toks.get(i))
            .is_some_and(|p| &p.kind == t)
    }

    fn span_from(&self, start: Span) -> Span {
        Span::new(self.src, start.lo, self.prev_hi().max(start.lo))
    }

    /// Consumes the current token (never moves past end of file) and returns its span.
    fn bump(&mut self) -> Span {
        let sp = self.cur_span();
        if !self.at(&Tok::Eof) {
            self.pos += 1;
        }
        sp
    }

    fn eat(&mut self, t: &Tok) -> Option<Span> {
        self.at(t).then(|| self.bump())
    }

    // ---- errors -------------------------------------------------------------------------------

    fn describe(&self) -> String {
        let t = self.tok();
        if t.kind == Tok::Eof {
            return "end of file".into();
        }
        let text = self.text.get(t.lo as usize..t.hi as usize).unwrap_or("");
        let mut shown: String = text.chars().take(32).collect();
        if shown.len() < text.len() {
            shown.push('…');
        }
        format!("`{shown}`")
    }

    fn error_at<T>(&mut self, span: Span, message: String) -> PResult<T> {
        self.diags.push(Diagnostic::error(span, message));
        Err(Stop)
    }

    /// Reports `expected {what}, found {current token}` at the current token. A lexical error token
    /// was reported by the lexer already, so it only stops.
    fn fail_expected<T>(&mut self, what: &str) -> PResult<T> {
        if self.at(&Tok::Error) {
            return Err(Stop);
        }
        let message = format!("expected {what}, found {}", self.describe());
        self.error_at(self.cur_span(), message)
    }

    fn expect(&mut self, t: &Tok, what: &str) -> PResult<Span> {
        match self.eat(t) {
            Some(sp) => Ok(sp),
            None => self.fail_expected(what),
        }
    }

    /// Expects a closing delimiter, pointing back at the opening one when it is missing.
    fn expect_close(&mut self, t: &Tok, what: &str, open: Span) -> PResult<Span> {
        if let Some(sp) = self.eat(t) {
            return Ok(sp);
        }
        let before = self.diags.len();
        let r = self.fail_expected(what);
        if self.diags.len() > before {
            if let Some(d) = self.diags.pop() {
                self.diags.push(d.with_secondary(open, "opened here"));
            }
        }
        r
    }

    fn enter(&mut self, nest: Nest) -> PResult<()> {
        let slot = nest as usize;
        let depth = self.depth.get(slot).copied().unwrap_or(0) + 1;
        let limit = match nest {
            Nest::Expr => 2 * MAX_NESTING + 2,
            Nest::Type | Nest::Pattern | Nest::Attr => MAX_NESTING,
        };
        if depth > limit {
            let message = format!("{} nested deeper than {MAX_NESTING} levels", nest.noun());
            return self.error_at(self.cur_span(), message);
        }
        if let Some(d) = self.depth.get_mut(slot) {
            *d = depth;
        }
        Ok(())
    }

    fn leave(&mut self, nest: Nest) {
        if let Some(d) = self.depth.get_mut(nest as usize) {
            *d = d.saturating_sub(1);
        }
    }

    fn check_height(&mut self, h: u32, at: Span) -> PResult<()> {
        self.check_height_of(h, at, Deep::Other)
    }

    /// The height limit, with a message that says how to rewrite what grew too deep: the later
    /// passes walk expressions recursively, while a `let` chain of any length is flat.
    fn check_height_of(&mut self, h: u32, at: Span, what: Deep) -> PResult<()> {
        if h <= HEIGHT_LIMIT {
            return Ok(());
        }
        let how = match what {
            Deep::Operator(op) => format!(
                "each `{op}` of a chain adds a level; split the chain with `let`, e.g. \
                 `let %part1 = x1 {op} x2 {op} ... {op} x200;` and so on, then combine the parts"
            ),
            Deep::Call => "each call written inside another call's arguments adds a level; bind \
                 inner results with `let` (e.g. `let %rest = Cons(%x, ...); Cons(%y, %rest)`), or \
                 pass a long list as input, where it can have any length"
                .to_string(),
            Deep::Other => {
                "bind inner parts with `let`: a `let` chain of any length adds no levels"
                    .to_string()
            }
        };
        let message = format!("expression nested deeper than {MAX_NESTING} levels: {how}");
        self.error_at(at, message)
    }

    /// The value of an integer literal `[-]mag` of `dtype`, or a located range error.
    fn int_value(&mut self, mag: Option<u64>, neg: bool, dtype: DType, at: Span) -> PResult<i64> {
        let max: i128 = if dtype == DType::Int64 {
            i128::from(i64::MAX)
        } else {
            i128::from(i32::MAX)
        };
        let v = mag.map(|m| if neg { -i128::from(m) } else { i128::from(m) });
        match v {
            Some(v) if v <= max && v >= -max - 1 => Ok(i64::try_from(v).unwrap_or_default()),
            _ => {
                let text = self.text.get(at.range()).unwrap_or("").to_string();
                self.error_at(
                    at,
                    format!("expected an integer that fits in {dtype}, found `{text}`"),
                )
            }
        }
    }

    // ---- module -------------------------------------------------------------------------------

    fn module(&mut self) -> Module {
        let mut m = Module::default();
        if self.at(&Tok::Hash) {
            let start = self.pos;
            match self.header() {
                Ok(v) => m.version = Some(v),
                Err(Stop) => self.recover(start),
            }
        }
        loop {
            let start = self.pos;
            let item = if self.at(&Tok::Eof) {
                break;
            } else if self.at_kw("def") {
                self.def_item().map(Item::Def)
            } else if self.at_kw("type") {
                self.type_item().map(Item::Type)
            } else if self.at_kw("free_var") {
                // TVM prints a bare expression (not a module) with its free variables declared
                // this way; tumble runs modules, whose inputs are `@main`'s parameters.
                self.error_at(
                    self.cur_span(),
                    "`free_var` declares an input of a bare TVM expression; tumble reads modules: \
                     make it a parameter of `def @main(...)` and put the expression in its body"
                        .to_string(),
                )
            } else if self.at_kw("extern") {
                // Past the declaration's head (`extern type T[A]`), so that recovery does not
                // read its `type` as a definition without constructors.
                let at = self.cur_span();
                self.bump();
                if self.at_kw("type") {
                    self.bump();
                }
                if matches!(self.peek(), Tok::Ident(_)) {
                    self.bump();
                }
                if self.at(&Tok::LBracket) {
                    while !matches!(self.peek(), Tok::RBracket | Tok::Eof) {
                        self.bump();
                    }
                    self.eat(&Tok::RBracket);
                }
                self.error_at(
                    at,
                    "`extern type` declares a type without constructors, which tumble does not \
                     support: every type a model uses needs its constructors"
                        .to_string(),
                )
            } else if self.at(&Tok::Hash)
                && matches!(self.peek_at(1), Tok::LBracket)
                && matches!(self.peek_at(2), Tok::Ident(s) if s == "metadata")
                && !self.meta_refs
            {
                // TVM's `#[metadata]` section, the constants `meta[...]` refers to, as JSON: with
                // no such reference in the module (TVM prints one whenever it has attributes to
                // keep), nothing in it is needed. It runs to the end of the file.
                break;
            } else if self.at(&Tok::Hash) {
                // TVM's `#[metadata]` section: the constants `meta[...]` refers to, as JSON.
                self.error_at(
                    self.cur_span(),
                    "a `#[metadata]` section holds the constants of TVM's `meta[...]` references, \
                     which tumble does not support: pass large constants as weights (parameters \
                     of `@main` bound by `--params`)"
                        .to_string(),
                )
            } else {
                self.fail_expected("`def` or `type` at top level")
            };
            match item {
                Ok(item) => m.items.push(item),
                // A metadata section runs to the end of the file: nothing after it is code.
                Err(Stop) if self.at(&Tok::Hash) => break,
                Err(Stop) => self.recover(start),
            }
        }
        m
    }

    /// Skips to the next `def` or `type` (always making progress).
    fn recover(&mut self, start: usize) {
        self.depth = [0; 4];
        if self.pos == start {
            self.bump();
        }
        while !(self.at(&Tok::Eof) || self.at_kw("def") || self.at_kw("type")) {
            self.bump();
        }
    }

    fn header(&mut self) -> PResult<String> {
        self.bump();
        self.expect(&Tok::LBracket, "`[` after `#`")?;
        if !self.at_kw("version") {
            return self.fail_expected("`version`");
        }
        self.bump();
        self.expect(&Tok::Eq, "`=`")?;
        let v = match self.peek() {
            Tok::Str(s) => s.clone(),
            _ => return self.fail_expected("a version string such as `\"0.0.5\"`"),
        };
        self.bump();
        self.expect(&Tok::RBracket, "`]` to close the header")?;
        Ok(v)
    }

    fn def_item(&mut self) -> PResult<GlobalDef> {
        let start = self.bump();
        let name = match self.peek() {
            Tok::Global(n) => Ident::new(n.clone(), self.cur_span()),
            _ => return self.fail_expected("a global name `@name` after `def`"),
        };
        self.bump();
        let type_params = if self.at(&Tok::LBracket) {
            self.type_params()?
        } else {
            Vec::new()
        };
        let (func, _) = self.function(self.cur_span())?;
        Ok(GlobalDef {
            name,
            type_params,
            func,
            span: self.span_from(start),
        })
    }

    fn type_params(&mut self) -> PResult<Vec<Ident>> {
        let open = self.bump();
        let mut params = Vec::new();
        while !self.at(&Tok::RBracket) {
            match self.peek() {
                Tok::Ident(n) => params.push(Ident::new(n.clone(), self.cur_span())),
                _ => return self.fail_expected("a type parameter name"),
            }
            self.bump();
            if self.eat(&Tok::Comma).is_none() {
                break;
            }
        }
        self.expect_close(&Tok::RBracket, "`]` to close the type parameters", open)?;
        Ok(params)
    }

    fn type_item(&mut self) -> PResult<TypeDef> {
        let start = self.bump();
        let name = match self.peek() {
            Tok::Ident(n) if !RESERVED.contains(&n.as_str()) => {
                Ident::new(n.clone(), self.cur_span())
            }
            _ => return self.fail_expected("a type name after `type`"),
        };
        self.bump();
        let params = if self.at(&Tok::LBracket) {
            self.type_params()?
        } else {
            Vec::new()
        };
        let open = self.expect(&Tok::LBrace, "`{` to start the constructors")?;
        let mut ctors = Vec::new();
        while !self.at(&Tok::RBrace) {
            let cstart = self.cur_span();
            let cname = match self.peek() {
                Tok::Ident(n) if !RESERVED.contains(&n.as_str()) && !n.contains('.') => {
                    Ident::new(n.clone(), cstart)
                }
                _ => return self.fail_expected("a constructor name"),
            };
            self.bump();
            let mut fields = Vec::new();
            if let Some(fopen) = self.eat(&Tok::LParen) {
                while !self.at(&Tok::RParen) {
                    fields.push(self.ty()?);
                    if self.eat(&Tok::Comma).is_none() {
                        break;
                    }
                }
                self.expect_close(&Tok::RParen, "`)` to close the constructor fields", fopen)?;
            }
            ctors.push(CtorDef {
                name: cname,
                fields,
                span: self.span_from(cstart),
            });
            if self.eat(&Tok::Comma).is_none() {
                break;
            }
        }
        self.expect_close(&Tok::RBrace, "`}` to close this type definition", open)?;
        Ok(TypeDef {
            name,
            params,
            ctors,
            span: self.span_from(start),
        })
    }

    /// `(params, attrs) [-> T] { body }`, shared by `def` and `fn`; also returns the body's height.
    fn function(&mut self, start: Span) -> PResult<(Function, u32)> {
        let (params, attrs) = self.param_list()?;
        let ret = if self.eat(&Tok::Arrow).is_some() {
            Some(self.ty()?)
        } else {
            None
        };
        let open = self.expect(&Tok::LBrace, "`{` to start the function body")?;
        let (body, h) = self.expr()?;
        self.expect_close(&Tok::RBrace, "`}` to close the function body", open)?;
        let func = Function {
            type_params: Vec::new(),
            params,
            attrs: Attrs(attrs),
            ret,
            body: Box::new(body),
            span: self.span_from(start),
        };
        Ok((func, h))
    }

    fn param_list(&mut self) -> PResult<(Vec<Param>, Vec<Attr>)> {
        let open = self.expect(&Tok::LParen, "`(` to start the parameter list")?;
        let mut params = Vec::new();
        let mut attrs = Vec::new();
        while !self.at(&Tok::RParen) {
            if self.at_attr() {
                let a = self.attr_after(&attrs)?;
                attrs.push(a);
            } else if matches!(self.peek(), Tok::Local(_)) {
                params.push(self.param()?);
            } else {
                return self.fail_expected("a parameter `%name` or an attribute `name=value`");
            }
            if self.eat(&Tok::Comma).is_none() {
                break;
            }
        }
        self.expect_close(&Tok::RParen, "`)` to close the parameter list", open)?;
        Ok((params, attrs))
    }

    /// `%x` or `%x: T`.
    fn param(&mut self) -> PResult<Param> {
        let name = match self.peek() {
            Tok::Local(n) => Ident::new(n.clone(), self.cur_span()),
            _ => return self.fail_expected("a variable `%name`"),
        };
        self.bump();
        let ann = if self.eat(&Tok::Colon).is_some() {
            Some(self.ty()?)
        } else {
            None
        };
        Ok(Param {
            name,
            ann,
            ty: None,
        })
    }

    // ---- attributes ---------------------------------------------------------------------------

    fn at_attr(&self) -> bool {
        matches!(self.peek(), Tok::Ident(_)) && self.peek_at(1) == &Tok::Eq
    }

    /// An attribute of a call or a function, after those before it (`attrs`): a name given twice
    /// is an error (which of two values would count is nothing a reader can see).
    fn attr_after(&mut self, attrs: &[Attr]) -> PResult<Attr> {
        let a = self.attr()?;
        if attrs.iter().any(|b| b.name == a.name) {
            return self.error_at(a.span, format!("attribute `{}` is given twice", a.name));
        }
        Ok(a)
    }

    fn attr(&mut self) -> PResult<Attr> {
        let start = self.cur_span();
        let name = match self.peek() {
            Tok::Ident(n) => n.clone(),
            _ => return self.fail_expected("an attribute name"),
        };
        self.bump();
        self.bump();
        let value = self.attr_value()?;
        Ok(Attr {
            name,
            value,
            span: self.span_from(start),
        })
    }

    fn attr_value(&mut self) -> PResult<AttrValue> {
        let start = self.cur_span();
        let neg = self.eat(&Tok::Minus).is_some();
        let num = match self.peek() {
            Tok::Int { mag, .. } => Some((Some(*mag), 0.0)),
            Tok::Float { val, .. } => Some((None, *val)),
            _ => None,
        };
        if let Some((mag, val)) = num {
            self.bump();
            return match mag {
                Some(mag) => {
                    let at = self.span_from(start);
                    Ok(AttrValue::Int(self.int_value(
                        mag,
                        neg,
                        DType::Int64,
                        at,
                    )?))
                }
                None => Ok(AttrValue::Float(if neg { -val } else { val })),
            };
        }
        if neg {
            return self.fail_expected("a number after `-`");
        }
        let value =
            match self.peek() {
                Tok::Str(s) => AttrValue::Str(s.clone()),
                Tok::Ident(s) if s == "True" => AttrValue::Bool(true),
                Tok::Ident(s) if s == "False" => AttrValue::Bool(false),
                Tok::Ident(s) if s == "None" => AttrValue::None,
                Tok::LBracket => {
                    self.enter(Nest::Attr)?;
                    let r = self.attr_list();
                    self.leave(Nest::Attr);
                    return r;
                }
                _ => return self.fail_expected(
                    "an attribute value (a number, `True`, `False`, a string, a list or `None`)",
                ),
            };
        self.bump();
        Ok(value)
    }

    fn attr_list(&mut self) -> PResult<AttrValue> {
        let open = self.bump();
        let mut items = Vec::new();
        while !self.at(&Tok::RBracket) {
            items.push(self.attr_value()?);
            if self.eat(&Tok::Comma).is_none() {
                break;
            }
        }
        self.expect_close(&Tok::RBracket, "`]` to close this list", open)?;
        Ok(AttrValue::List(items))
    }

    // ---- expressions --------------------------------------------------------------------------

    /// Every nested expression goes through here, so this is where the recursion budget is kept.
    fn expr(&mut self) -> PResult<Node> {
        self.enter(Nest::Expr)?;
        let r = self.sequence(true);
        self.leave(Nest::Expr);
        r
    }

    /// A binding's value: an expression whose `;` ends the binding, not a sequence (`let %x = e1;
    /// e2` binds `e1`).
    fn binding_value(&mut self) -> PResult<Node> {
        self.enter(Nest::Expr)?;
        let r = self.sequence(false);
        self.leave(Nest::Expr);
        r
    }

    /// Bindings (`let %x = e;`, `%x = e;`) in a loop, then the body.
    fn sequence(&mut self, sequenced: bool) -> PResult<Node> {
        let mut bindings = Vec::new();
        let mut h = 0;
        let (body, bh) = loop {
            let start = self.cur_span();
            if self.at_kw("free_var") {
                return self.error_at(
                    start,
                    "`free_var` declares an input of a bare TVM expression, which tumble does not \
                     read: make the variable a parameter of the function"
                        .to_string(),
                );
            }
            let is_let = self.at_kw("let");
            let graph = matches!(self.peek(), Tok::Local(_))
                && matches!(self.peek_at(1), Tok::Eq | Tok::Colon);
            if is_let || graph {
                if is_let {
                    self.bump();
                    if !matches!(self.peek(), Tok::Local(_)) {
                        return self.fail_expected("a variable `%name` after `let`");
                    }
                }
                let var = self.param()?;
                self.expect(&Tok::Eq, "`=` in this binding")?;
                let (value, vh) = self.binding_value()?;
                let span = start.to(value.span);
                self.expect(&Tok::Semi, "`;` after this binding")?;
                h = h.max(vh);
                bindings.push(LetBinding { var, value, span });
                continue;
            }
            let (e, eh) = self.binary()?;
            // `e1; e2`: Relay's sequencing, a binding whose value nobody reads. Its name cannot be
            // written in source (a `.` ends a local's name), so it shadows nothing; the printer
            // writes it back as `e1;`. (A loop, like the bindings: a long sequence costs no stack.)
            if sequenced
                && self.at(&Tok::Semi)
                && !matches!(self.peek_at(1), Tok::RBrace | Tok::Eof)
            {
                self.bump();
                let var = Param {
                    name: Ident::new(format!("{SEQUENCED}{}", bindings.len()), e.span),
                    ann: None,
                    ty: None,
                };
                h = h.max(eh);
                let span = e.span;
                bindings.push(LetBinding {
                    var,
                    value: e,
                    span,
                });
                continue;
            }
            break (e, eh);
        };
        let Some(first) = bindings.first() else {
            return Ok((body, bh));
        };
        let span = first.span.to(body.span);
        let h = h.max(bh) + 1;
        self.check_height(h, span)?;
        Ok((Expr::new(ExprKind::Let(bindings, Box::new(body)), span), h))
    }

    /// Infix operators by operator precedence (shunting-yard), so that a long chain costs no stack.
    fn binary(&mut self) -> PResult<Node> {
        let mut operands = vec![self.unary()?];
        let mut ops: Vec<(&'static str, &'static str, u8, Span)> = Vec::new();
        while let Some((name, symbol, prec)) = binop(self.peek()) {
            while ops.last().is_some_and(|&(_, _, top, _)| top >= prec) {
                self.reduce(&mut operands, &mut ops)?;
            }
            let sp = self.bump();
            ops.push((name, symbol, prec, sp));
            operands.push(self.unary()?);
        }
        while !ops.is_empty() {
            self.reduce(&mut operands, &mut ops)?;
        }
        match operands.pop() {
            Some(n) => Ok(n),
            None => self.fail_expected("an expression"),
        }
    }

    fn reduce(
        &mut self,
        operands: &mut Vec<Node>,
        ops: &mut Vec<(&'static str, &'static str, u8, Span)>,
    ) -> PResult<()> {
        let (Some((name, symbol, _, op_span)), Some((rhs, rh)), Some((lhs, lh))) =
            (ops.pop(), operands.pop(), operands.pop())
        else {
            return self.fail_expected("an expression");
        };
        let h = lh.max(rh) + 1;
        self.check_height_of(h, op_span, Deep::Operator(symbol))?;
        let span = lhs.span.to(rhs.span);
        let callee = Expr::new(ExprKind::Op(name.into()), op_span);
        operands.push((call_node(callee, vec![lhs, rhs], Attrs::default(), span), h));
        Ok(())
    }

    /// Prefix minus, a primary, then postfix calls and projections.
    fn unary(&mut self) -> PResult<Node> {
        let mut minus = Vec::new();
        while let Some(sp) = self.eat(&Tok::Minus) {
            minus.push(sp);
        }
        let number = matches!(self.peek(), Tok::Int { .. } | Tok::Float { .. });
        let folded = if number { minus.pop() } else { None };
        let (mut e, mut h) = match folded {
            Some(sp) => self.literal(Some(sp))?,
            None => self.primary()?,
        };
        loop {
            if self.at(&Tok::LParen) {
                (e, h) = self.call(e, h)?;
            } else if self.at(&Tok::Dot) {
                (e, h) = self.projection(e, h)?;
            } else {
                break;
            }
        }
        while let Some(sp) = minus.pop() {
            h += 1;
            self.check_height(h, sp)?;
            let span = sp.to(e.span);
            let callee = Expr::new(ExprKind::Op("negative".into()), sp);
            e = call_node(callee, vec![e], Attrs::default(), span);
        }
        Ok((e, h))
    }

    fn call(&mut self, callee: Expr, callee_h: u32) -> PResult<Node> {
        let open = self.bump();
        let mut h = callee_h;
        let mut args = Vec::new();
        let mut attrs = Vec::new();
        while !self.at(&Tok::RParen) {
            if self.at_attr() {
                let a = self.attr_after(&attrs)?;
                attrs.push(a);
            } else if !attrs.is_empty() {
                return self.fail_expected(
                    "a keyword attribute `name=value` (positional arguments come first)",
                );
            } else {
                let (a, ah) = self.expr()?;
                h = h.max(ah);
                args.push(a);
            }
            if self.eat(&Tok::Comma).is_none() {
                break;
            }
        }
        self.expect_close(&Tok::RParen, "`)` to close this call", open)?;
        h += 1;
        self.check_height_of(h, open, Deep::Call)?;
        let span = self.span_from(callee.span);
        Ok((call_node(callee, args, Attrs(attrs), span), h))
    }

    fn projection(&mut self, e: Expr, eh: u32) -> PResult<Node> {
        let dot = self.bump();
        let index = match self.peek() {
            Tok::Int { mag: Some(n), .. } => u32::try_from(*n).ok(),
            _ => None,
        };
        let Some(index) = index else {
            return self.fail_expected("a tuple index after `.`");
        };
        self.bump();
        let h = eh + 1;
        self.check_height(h, dot)?;
        let span = self.span_from(e.span);
        Ok((Expr::new(ExprKind::Proj(Box::new(e), index), span), h))
    }

    fn primary_kind(&self) -> PrimaryKind {
        match self.peek() {
            Tok::Local(_) => PrimaryKind::Local,
            Tok::Global(_) => PrimaryKind::Global,
            Tok::Int { .. } | Tok::Float { .. } => PrimaryKind::Number,
            Tok::LParen => PrimaryKind::Paren,
            Tok::LBrace => PrimaryKind::Block,
            Tok::Ident(s) => match s.as_str() {
                "fn" => PrimaryKind::Fn,
                "if" => PrimaryKind::If,
                "match" => PrimaryKind::Match,
                "True" => PrimaryKind::Bool(true),
                "False" => PrimaryKind::Bool(false),
                s if RESERVED.contains(&s) => PrimaryKind::Other,
                _ => PrimaryKind::Name,
            },
            _ => PrimaryKind::Other,
        }
    }

    /// Dispatch only: each form has its own function, so this frame stays small on deep inputs.
    fn primary(&mut self) -> PResult<Node> {
        match self.primary_kind() {
            PrimaryKind::Local | PrimaryKind::Global | PrimaryKind::Name => self.name_expr(),
            PrimaryKind::Number => self.literal(None),
            PrimaryKind::Paren => self.paren(),
            PrimaryKind::Block => self.block(),
            PrimaryKind::Fn => self.fn_expr(),
            PrimaryKind::If => self.if_expr(),
            PrimaryKind::Match => self.match_expr(),
            PrimaryKind::Bool(b) => {
                let sp = self.bump();
                Ok((Expr::new(ExprKind::Lit(Literal::Bool(b)), sp), 1))
            }
            PrimaryKind::Other => {
                // A string is only ever an attribute's value: `cast(%x, "float32")` means
                // `dtype="float32"`, which a message should say.
                if let Tok::Str(s) = self.peek() {
                    let message = format!(
                        "expected an expression, found `{s:?}`: a string is an attribute's value, \
                         written with its name (`dtype={s:?}`)"
                    );
                    return self.error_at(self.cur_span(), message);
                }
                self.fail_expected("an expression")
            }
        }
    }

    fn name_expr(&mut self) -> PResult<Node> {
        if self.at_kw("meta") && self.peek_at(1) == &Tok::LBracket {
            // TVM prints large constants as references into a `#[metadata]` JSON section.
            return self.error_at(
                self.cur_span(),
                "`meta[...]` refers to a constant in TVM's `#[metadata]` section, which tumble does \
                 not read; pass the constant as a parameter of `@main` (a weight, bound by name \
                 from --params) or write it as a literal"
                    .to_string(),
            );
        }
        let kind = match self.peek() {
            Tok::Local(n) => ExprKind::Local(n.clone()),
            Tok::Global(n) => ExprKind::Global(n.clone()),
            Tok::Ident(n) if is_upper(n) || self.lower_ctors.contains(n) => {
                ExprKind::Ctor(n.clone())
            }
            Tok::Ident(n) => ExprKind::Op(n.clone()),
            _ => return self.fail_expected("an expression"),
        };
        let sp = self.bump();
        Ok((Expr::new(kind, sp), 1))
    }

    /// A numeric literal, negated when `minus` (the span of a `-` directly before it) is given.
    fn literal(&mut self, minus: Option<Span>) -> PResult<Node> {
        let tok_span = self.cur_span();
        let span = minus.map_or(tok_span, |m| m.to(tok_span));
        let neg = minus.is_some();
        let lit = match *self.peek() {
            Tok::Int {
                mag,
                dtype,
                suffixed,
            } => {
                // An unsuffixed integer past int32's range is an int64, as TVM's parser reads it
                // (`2147483648`); a suffixed one keeps its dtype and must fit it.
                let fits32 = mag.is_some_and(|m| {
                    let v = if neg { -i128::from(m) } else { i128::from(m) };
                    v >= i128::from(i32::MIN) && v <= i128::from(i32::MAX)
                });
                let dtype = match dtype == DType::Int32 && !suffixed && !fits32 {
                    true => DType::Int64,
                    false => dtype,
                };
                Literal::Int(self.int_value(mag, neg, dtype, span)?, dtype)
            }
            Tok::Float { val, dtype } => {
                // Rounded to float32 it would be infinity, silently (`1e40f`); `inff` is one on
                // purpose.
                if dtype == DType::Float32 && !(val as f32).is_finite() && val.is_finite() {
                    return self.error_at(
                        span,
                        format!(
                            "expected a float literal within float32's range (±3.4028235e38), \
                             found `{val:e}` (write it with `f64` for a float64)"
                        ),
                    );
                }
                Literal::Float(if neg { -val } else { val }, dtype)
            }
            _ => return self.fail_expected("a number"),
        };
        self.bump();
        Ok((Expr::new(ExprKind::Lit(lit), span), 1))
    }

    /// `()`, `(e)` (grouping), `(e,)`, `(a, b, ...)`.
    fn paren(&mut self) -> PResult<Node> {
        let open = self.bump();
        if let Some(close) = self.eat(&Tok::RParen) {
            return Ok((Expr::new(ExprKind::Tuple(Vec::new()), open.to(close)), 1));
        }
        let (first, fh) = self.expr()?;
        if self.eat(&Tok::RParen).is_some() {
            return Ok((first, fh));
        }
        if !self.at(&Tok::Comma) {
            self.expect_close(&Tok::RParen, "`)` to close this parenthesis", open)?;
        }
        let mut h = fh;
        let mut elems = vec![first];
        while self.eat(&Tok::Comma).is_some() {
            if self.at(&Tok::RParen) {
                break;
            }
            let (e, eh) = self.expr()?;
            h = h.max(eh);
            elems.push(e);
        }
        let close = self.expect_close(&Tok::RParen, "`)` to close this tuple", open)?;
        h += 1;
        self.check_height(h, open)?;
        Ok((Expr::new(ExprKind::Tuple(elems), open.to(close)), h))
    }

    /// `{ e }` is grouping.
    fn block(&mut self) -> PResult<Node> {
        let open = self.bump();
        let n = self.expr()?;
        self.expect_close(&Tok::RBrace, "`}` to close this block", open)?;
        Ok(n)
    }

    fn fn_expr(&mut self) -> PResult<Node> {
        let start = self.bump();
        // TVM's generic closure, `fn [A](%x: A) -> A { %x }`.
        let type_params = if self.at(&Tok::LBracket) {
            self.type_params()?
        } else {
            Vec::new()
        };
        let (mut func, bh) = self.function(start)?;
        func.type_params = type_params;
        let h = bh + 1;
        self.check_height(h, start)?;
        let span = func.span;
        Ok((Expr::new(ExprKind::Fn(Box::new(func)), span), h))
    }

    fn if_expr(&mut self) -> PResult<Node> {
        let start = self.bump();
        let (cond, ch) = self.head("`(` after `if`")?;
        let (then, th) = self.branch()?;
        if !self.at_kw("else") {
            return self.fail_expected("`else` after the `if` branch");
        }
        self.bump();
        let (els, eh) = if self.at_kw("if") {
            // `else if` recurses without going through `expr`, so it spends the budget here.
            self.enter(Nest::Expr)?;
            let r = self.if_expr();
            self.leave(Nest::Expr);
            r?
        } else {
            self.branch()?
        };
        let h = ch.max(th).max(eh) + 1;
        self.check_height(h, start)?;
        Ok((
            Expr::new(
                ExprKind::If(Box::new(cond), Box::new(then), Box::new(els)),
                self.span_from(start),
            ),
            h,
        ))
    }

    /// The parenthesized head of `if` and `match`. It is read like any parenthesized expression,
    /// so `match (%a, %b) { ... }` matches on a tuple.
    fn head(&mut self, what: &str) -> PResult<Node> {
        if !self.at(&Tok::LParen) {
            return self.fail_expected(what);
        }
        self.paren()
    }

    fn branch(&mut self) -> PResult<Node> {
        let open = self.expect(&Tok::LBrace, "`{` to start this branch")?;
        let n = self.expr()?;
        self.expect_close(&Tok::RBrace, "`}` to close this branch", open)?;
        Ok(n)
    }

    fn match_expr(&mut self) -> PResult<Node> {
        let start = self.bump();
        let complete = self.eat(&Tok::Question).is_none();
        let (scrutinee, mut h) = self.head("`(` after `match`")?;
        let lb = self.expect(&Tok::LBrace, "`{` to start the match arms")?;
        let mut arms = Vec::new();
        while !self.at(&Tok::RBrace) {
            let pattern = self.pattern()?;
            self.expect(&Tok::FatArrow, "`=>` after the pattern")?;
            let (body, bh) = self.expr()?;
            h = h.max(bh);
            arms.push(MatchArm {
                span: pattern.span.to(body.span),
                pattern,
                body,
            });
            // A comma separates arms; after an arm ending in `}` it may be left out.
            if self.eat(&Tok::Comma).is_none() && !self.prev_is(&Tok::RBrace) {
                break;
            }
        }
        if arms.is_empty() {
            return self.fail_expected("at least one match arm");
        }
        self.expect_close(&Tok::RBrace, "`}` to close this match", lb)?;
        h += 1;
        self.check_height(h, start)?;
        Ok((
            Expr::new(
                ExprKind::Match {
                    scrutinee: Box::new(scrutinee),
                    arms,
                    complete,
                },
                self.span_from(start),
            ),
            h,
        ))
    }

    // ---- patterns -----------------------------------------------------------------------------

    fn pattern(&mut self) -> PResult<Pattern> {
        self.enter(Nest::Pattern)?;
        let r = self.pattern_inner();
        self.leave(Nest::Pattern);
        r
    }

    fn pattern_inner(&mut self) -> PResult<Pattern> {
        let start = self.cur_span();
        let kind = match self.peek() {
            Tok::Underscore => {
                self.bump();
                PatternKind::Wildcard
            }
            Tok::Local(_) => PatternKind::Var(self.param()?),
            Tok::Ident(n)
                if (is_upper(n) || self.lower_ctors.contains(n)) && n != "True" && n != "False" =>
            {
                let name = Ident::new(n.clone(), start);
                self.bump();
                let mut args = Vec::new();
                if let Some(open) = self.eat(&Tok::LParen) {
                    while !self.at(&Tok::RParen) {
                        args.push(self.pattern()?);
                        if self.eat(&Tok::Comma).is_none() {
                            break;
                        }
                    }
                    self.expect_close(&Tok::RParen, "`)` to close this pattern", open)?;
                }
                PatternKind::Ctor { name, args }
            }
            Tok::LParen => {
                let open = self.bump();
                if self.eat(&Tok::RParen).is_some() {
                    PatternKind::Tuple(Vec::new())
                } else {
                    let first = self.pattern()?;
                    if self.eat(&Tok::RParen).is_some() {
                        return Ok(first);
                    }
                    if !self.at(&Tok::Comma) {
                        self.expect_close(&Tok::RParen, "`)` to close this pattern", open)?;
                    }
                    let mut items = vec![first];
                    while self.eat(&Tok::Comma).is_some() {
                        if self.at(&Tok::RParen) {
                            break;
                        }
                        items.push(self.pattern()?);
                    }
                    self.expect_close(&Tok::RParen, "`)` to close this tuple pattern", open)?;
                    PatternKind::Tuple(items)
                }
            }
            _ => {
                return self
                    .fail_expected("a pattern (`_`, `%name`, a constructor or a tuple pattern)")
            }
        };
        Ok(Pattern {
            kind,
            span: self.span_from(start),
            ty: None,
        })
    }

    // ---- types --------------------------------------------------------------------------------

    fn ty(&mut self) -> PResult<TypeExpr> {
        self.enter(Nest::Type)?;
        let r = self.ty_inner();
        self.leave(Nest::Type);
        r
    }

    fn ty_inner(&mut self) -> PResult<TypeExpr> {
        let start = self.cur_span();
        let kind = match self.peek() {
            Tok::Underscore => {
                self.bump();
                TypeExprKind::Hole
            }
            Tok::LParen => {
                let open = self.bump();
                if self.eat(&Tok::RParen).is_some() {
                    TypeExprKind::Tuple(Vec::new())
                } else {
                    let first = self.ty()?;
                    if self.eat(&Tok::RParen).is_some() {
                        return Ok(first);
                    }
                    if !self.at(&Tok::Comma) {
                        self.expect_close(&Tok::RParen, "`)` to close this type", open)?;
                    }
                    let mut items = vec![first];
                    while self.eat(&Tok::Comma).is_some() {
                        if self.at(&Tok::RParen) {
                            break;
                        }
                        items.push(self.ty()?);
                    }
                    self.expect_close(&Tok::RParen, "`)` to close this tuple type", open)?;
                    TypeExprKind::Tuple(items)
                }
            }
            Tok::Ident(n) if n == "Tensor" => self.tensor_ty()?,
            Tok::Ident(n) if n == "fn" => self.fn_ty()?,
            Tok::Ident(n) => {
                if let Some(dtype) = annotation_dtype(n) {
                    self.bump();
                    TypeExprKind::Tensor {
                        shape: Vec::new(),
                        dtype,
                    }
                } else if looks_like_dtype(n) {
                    return self.fail_expected(DTYPES);
                } else if RESERVED.contains(&n.as_str()) {
                    return self.fail_expected("a type");
                } else {
                    let name = n.clone();
                    self.bump();
                    let mut args = Vec::new();
                    if let Some(open) = self.eat(&Tok::LBracket) {
                        while !self.at(&Tok::RBracket) {
                            args.push(self.ty()?);
                            if self.eat(&Tok::Comma).is_none() {
                                break;
                            }
                        }
                        self.expect_close(&Tok::RBracket, "`]` to close the type arguments", open)?;
                    }
                    TypeExprKind::Named { name, args }
                }
            }
            _ => return self.fail_expected("a type"),
        };
        Ok(TypeExpr {
            kind,
            span: self.span_from(start),
        })
    }

    fn tensor_ty(&mut self) -> PResult<TypeExprKind> {
        self.bump();
        let open = self.expect(&Tok::LBracket, "`[` after `Tensor`")?;
        let shape = self.shape()?;
        self.expect(&Tok::Comma, "`,` between the shape and the dtype")?;
        let dtype = match self.peek() {
            Tok::Ident(n) => annotation_dtype(n),
            Tok::Str(n) => DType::from_name(n),
            _ => None,
        };
        let Some(dtype) = dtype else {
            return self.fail_expected(DTYPES);
        };
        self.bump();
        self.expect_close(&Tok::RBracket, "`]` to close this tensor type", open)?;
        Ok(TypeExprKind::Tensor { shape, dtype })
    }

    fn shape(&mut self) -> PResult<Vec<Dim>> {
        let open = self.expect(&Tok::LParen, "a tensor shape `(d0, d1, ...)`")?;
        let mut dims = Vec::new();
        while !self.at(&Tok::RParen) {
            match *self.peek() {
                Tok::Question => dims.push(Dim::Any),
                Tok::Int { mag, .. } => {
                    let at = self.cur_span();
                    dims.push(Dim::Known(self.int_value(mag, false, DType::Int64, at)?));
                }
                _ => return self.fail_expected("a dimension (an integer or `?`)"),
            }
            self.bump();
            if self.eat(&Tok::Comma).is_none() {
                break;
            }
        }
        self.expect_close(&Tok::RParen, "`)` to close the tensor shape", open)?;
        Ok(dims)
    }

    fn fn_ty(&mut self) -> PResult<TypeExprKind> {
        self.bump();
        let open = self.expect(&Tok::LParen, "`(` after `fn`")?;
        let mut params = Vec::new();
        while !self.at(&Tok::RParen) {
            params.push(self.ty()?);
            if self.eat(&Tok::Comma).is_none() {
                break;
            }
        }
        self.expect_close(&Tok::RParen, "`)` to close the parameter types", open)?;
        self.expect(&Tok::Arrow, "`->` and the return type")?;
        let ret = self.ty()?;
        Ok(TypeExprKind::Func {
            params,
            ret: Box::new(ret),
        })
    }
}

const DTYPES: &str = "a dtype (float32, float64, int32, int64 or bool)";
