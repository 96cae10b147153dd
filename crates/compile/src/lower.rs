//! Lowering: the typed module to the executable [`Program`].
//!
//! With grain coarsening on ([`LowerOptions::coarsen`]), tensor work is grouped into static blocks
//! ([`crate::blocks`]): a `Primitive=1` function becomes one block, and in other code every maximal
//! run of pure operator expressions (across consecutive `let`s) becomes one, so the executors see
//! `InvokeBlock` instead of single operator calls.

use std::collections::{HashMap, HashSet};
use tumble_check::TypedModule;
use tumble_ir::{Dim, Expr, ExprKind, Function, Literal, Pattern, PatternKind, Span, Ty};
use tumble_tensor::Tensor;

use crate::blocks::{joins_blocks, BArg, BVal, Block, BlockInput, BlockNode, OutputShape};
use crate::program::{CaptureFrom, Code, CtorEntry, Lambda, Native, Natives, Pat, Program, Site};

/// Switches of the lowering.
#[derive(Debug, Clone, Copy, Default)]
pub struct LowerOptions {
    /// Put every pure operator call in a static block (what the batching runtime executes).
    pub blocks: bool,
    /// Grain coarsening: one block per `Primitive=1` function and per maximal run of pure operator
    /// expressions. Off (with `blocks` on): one block per operator call, DyNet's operator-level graph.
    pub coarsen: bool,
    /// Constant folding: an automatic block with no inputs (`zeros(..)`, arithmetic on literals)
    /// is computed once here and becomes a literal, instead of a launch per invocation.
    pub fold: bool,
    /// Inlining: calls of ordinary functions whose bodies are straight-line tensor work
    /// ([`crate::inline`]) join their caller's block instead of ending it.
    pub inline: bool,
    /// The prelude's list functions `@hd`, `@tl`, `@zip`, `@rev` and `@concat` run natively
    /// ([`crate::program::Native`]) instead of interpreted, with the evaluator's shortcuts
    /// ([`crate::program::Natives::fast_steps`]: `@map`'s step as one constructor, block
    /// invocations of immediate operands without a step of their own; and, after the static
    /// passes, functions shaped like `@map` run as loops: [`crate::map_loop`]).
    pub natives: bool,
}

/// The largest constant (in elements, per operator result) that folding computes at compile time;
/// a bigger one stays a block, so that a hostile `zeros(shape=[100000, 100000])` costs nothing
/// until it runs (and then meets the run's limits).
const FOLD_MAX_ELEMENTS: i64 = 1 << 16;

impl LowerOptions {
    /// No blocks: the reference interpreter's view, one `CallOp` per operator call.
    pub fn reference() -> Self {
        LowerOptions {
            blocks: false,
            coarsen: false,
            fold: false,
            inline: false,
            natives: false,
        }
    }

    /// What the batching runtime runs by default: coarse static blocks.
    pub fn batched() -> Self {
        LowerOptions {
            blocks: true,
            coarsen: true,
            fold: true,
            inline: true,
            natives: true,
        }
    }
}

#[derive(Debug, Clone)]
pub struct LowerError {
    pub message: String,
    pub span: Span,
}

impl Program {
    /// Lowers without blocks: one operator call is one `CallOp` (the reference interpreter's view).
    pub fn lower(typed: &TypedModule) -> Result<Program, LowerError> {
        Program::lower_with(typed, LowerOptions::reference())
    }

    pub fn lower_with(typed: &TypedModule, opts: LowerOptions) -> Result<Program, LowerError> {
        let mut ctors = Vec::new();
        let mut ctor_index = HashMap::new();
        for td in typed.module.type_defs() {
            for c in &td.ctors {
                ctor_index.insert(c.name.name.clone(), ctors.len() as u32);
                ctors.push(CtorEntry {
                    name: c.name.name.clone(),
                    adt: td.name.name.clone(),
                    arity: c.fields.len(),
                });
            }
        }
        let mut global_index = HashMap::new();
        for (i, d) in typed.module.defs().enumerate() {
            global_index.insert(d.name.name.clone(), i as u32);
        }
        let inline = if opts.blocks && opts.coarsen && opts.inline {
            crate::inline::inlinable(&typed.module)
        } else {
            HashMap::new()
        };
        let mut lw = Lowerer {
            inline: &inline,
            global_index: &global_index,
            ctor_index: &ctor_index,
            fns: Vec::new(),
            lambdas: Vec::new(),
            blocks: Vec::new(),
            sites: Vec::new(),
            notes: Vec::new(),
            folded: Vec::new(),
            opts,
        };
        let mut globals = Vec::new();
        for d in typed.module.defs() {
            globals.push(lw.function(&d.name.name, &d.func, None)?);
        }
        let (lambdas, blocks, sites, notes, folded) =
            (lw.lambdas, lw.blocks, lw.sites, lw.notes, lw.folded);
        let mut inlined: Vec<String> = inline.into_keys().collect();
        inlined.sort();
        let natives = if opts.natives {
            natives(typed, &global_index, &ctor_index)
        } else {
            Natives::default()
        };
        let program = Program {
            lambdas,
            globals,
            global_index,
            ctors,
            ctor_index,
            blocks,
            sites,
            notes,
            folded,
            inlined,
            params_of: None,
            natives,
            derived: Vec::new(),
        };
        crate::verify::debug_check(&program, "lowering");
        Ok(program)
    }
}

/// The prelude's list functions that run natively: only the prelude's own definitions (a module
/// checked without the prelude may define its own `@rev`), with the prelude's arity and the
/// prelude's `List`.
fn natives(
    typed: &TypedModule,
    global_index: &HashMap<String, u32>,
    ctor_index: &HashMap<String, u32>,
) -> Natives {
    let (Some(&cons), Some(&nil)) = (ctor_index.get("Cons"), ctor_index.get("Nil")) else {
        return Natives::default();
    };
    let mut by_global = vec![None; global_index.len()];
    for d in typed.module.defs() {
        if typed.user_sources.contains(&d.name.span.src) {
            continue;
        }
        let Some(native) = Native::of_prelude(&d.name.name) else {
            continue;
        };
        if d.func.params.len() != native.arity() {
            continue;
        }
        if let Some(slot) = global_index
            .get(&d.name.name)
            .and_then(|&g| by_global.get_mut(g as usize))
        {
            *slot = Some(native);
        }
    }
    Natives {
        by_global,
        cons,
        nil,
        fast_steps: true,
        map_loops: Vec::new(),
        fold_loops: Vec::new(),
        scan_loops: Vec::new(),
    }
}

struct FnScope {
    /// The function's name, for naming the blocks found in it.
    name: String,
    /// Names bound in the function (parameters, lets, patterns), innermost last.
    locals: Vec<(String, u32)>,
    /// The slots of each name in `locals`, innermost last: a name is found without scanning the
    /// scope (a body of 200,000 `let`s each reading a parameter took 27 s to lower).
    local_slots: HashMap<String, Vec<u32>>,
    /// Names captured from enclosing functions, below every local (a later binding shadows them).
    captured: HashMap<String, u32>,
    n_slots: u32,
    captures: Vec<(CaptureFrom, u32)>,
    /// The let-bound name of this function, if it may call itself.
    self_name: Option<String>,
}

impl FnScope {
    fn bind(&mut self, name: &str, slot: u32) {
        self.locals.push((name.to_string(), slot));
        self.local_slots
            .entry(name.to_string())
            .or_default()
            .push(slot);
    }

    fn unbind_last(&mut self) {
        if let Some((name, _)) = self.locals.pop() {
            if let Some(slots) = self.local_slots.get_mut(&name) {
                slots.pop();
                if slots.is_empty() {
                    self.local_slots.remove(&name);
                }
            }
        }
    }
}

struct Lowerer<'a> {
    /// Functions whose calls join the caller's block (see [`crate::inline`]).
    inline: &'a HashMap<String, &'a Function>,
    global_index: &'a HashMap<String, u32>,
    ctor_index: &'a HashMap<String, u32>,
    fns: Vec<FnScope>,
    lambdas: Vec<Lambda>,
    blocks: Vec<Block>,
    sites: Vec<Site>,
    notes: Vec<(Span, String)>,
    folded: Vec<Span>,
    opts: LowerOptions,
}

/// A value under construction inside a block: a tensor, or a tuple of them.
#[derive(Clone, Debug)]
enum BRef {
    One(BVal),
    Tuple(Vec<BRef>),
}

impl BRef {
    fn flatten(&self, out: &mut Vec<BVal>) {
        match self {
            BRef::One(v) => out.push(v.clone()),
            BRef::Tuple(rs) => rs.iter().for_each(|r| r.flatten(out)),
        }
    }
}

#[derive(Default)]
struct BlockBuilder {
    inputs: Vec<BlockInput>,
    input_codes: Vec<Code>,
    /// Inputs that are variables or fields of variables (see [`input_key`]), so each is passed once.
    input_by_local: HashMap<String, u32>,
    nodes: Vec<BlockNode>,
    /// Names bound inside the block, innermost last.
    env: tumble_ir::scope::Scope<BRef>,
    /// Inside an inlined function body: only `env[floor..]` is in scope, and nothing may become an
    /// input (the body's free names are its parameters, bound in `env`).
    floor: usize,
    closed: bool,
    /// The calls of the inlined functions being lowered, outermost first: each node made inside
    /// them records them ([`BlockNode::calls`]).
    calls: Vec<Span>,
}

/// How far a [`BlockBuilder`] had got: what [`BlockBuilder::rollback`] returns to.
#[derive(Clone, Copy)]
struct Checkpoint {
    inputs: usize,
    nodes: usize,
}

impl BlockBuilder {
    fn checkpoint(&self) -> Checkpoint {
        Checkpoint {
            inputs: self.inputs.len(),
            nodes: self.nodes.len(),
        }
    }

    /// Drops what a failed translation added. Its inputs must go too, not only its nodes: an
    /// input's code runs before the block, and it may draw random numbers or fail (a binding
    /// whose translation stopped halfway drew again when it was lowered on its own: generator
    /// seed 14873).
    fn rollback(&mut self, cp: Checkpoint) {
        self.inputs.truncate(cp.inputs);
        self.input_codes.truncate(cp.inputs);
        self.input_by_local.retain(|_, i| (*i as usize) < cp.inputs);
        self.nodes.truncate(cp.nodes);
    }

    /// What `name` is bound to inside the block, in the current scope.
    fn lookup(&self, name: &str) -> Option<&BRef> {
        self.env.lookup_from(name, self.floor)
    }
}

/// True for expressions that grain coarsening starts a block at: a pure operator call or a call
/// of an inlinable function, possibly under tuples and projections.
/// `nn.matmul(a, b)` without `transpose_a` as the product the GEMM stages run: `nn.dense(a, b)`
/// with `transpose_b` (b is `(N, K)` already), else `nn.dense(a, transpose(b))` — the transpose
/// a node of its own, which derived parameters move out of the block when `b` is a weight. The
/// operator and attributes to record, after pushing the transpose onto `args`; `None` leaves the
/// call as written.
fn matmul_as_dense(
    b: &mut BlockBuilder,
    c: &tumble_ir::Call,
    args: &mut [BArg],
    span: Span,
) -> Option<(&'static tumble_ops::OpDef, tumble_ir::Attrs)> {
    let ExprKind::Op(name) = &c.callee.kind else {
        return None;
    };
    if name != "nn.matmul" || c.attrs.bool("transpose_a").ok()?.unwrap_or(false) {
        return None;
    }
    let dense = tumble_ops::lookup("nn.dense")?;
    let transpose_b = c.attrs.bool("transpose_b").ok()?.unwrap_or(false);
    if !transpose_b {
        let transpose = tumble_ops::lookup("transpose")?;
        let rhs = c.args.get(1)?.ty.as_ref()?;
        let ty =
            (transpose.relation)(std::slice::from_ref(rhs), &tumble_ir::Attrs::default()).ok()?;
        let slot = args.get_mut(1)?;
        let BArg::One(v) = slot.clone() else {
            return None;
        };
        let n = u32::try_from(b.nodes.len()).ok()?;
        b.nodes.push(BlockNode {
            op: transpose,
            args: vec![BArg::One(v)],
            attrs: tumble_ir::Attrs::default(),
            ty,
            span,
            calls: b.calls.iter().rev().copied().collect(),
        });
        *slot = BArg::One(BVal::Node(n));
    }
    let kept = c
        .attrs
        .0
        .iter()
        .filter(|a| matches!(a.name.as_str(), "units" | "out_dtype"))
        .cloned()
        .collect();
    Some((dense, tumble_ir::Attrs(kept)))
}

fn is_block_root(e: &Expr, inline: &HashMap<String, &Function>) -> bool {
    match &e.kind {
        ExprKind::Call(c) => match &c.callee.kind {
            ExprKind::Op(n) => tumble_ops::lookup(n).is_some_and(joins_blocks),
            ExprKind::Global(g) => inline.contains_key(g),
            _ => false,
        },
        ExprKind::Tuple(es) => {
            es.iter().any(|e| is_block_root(e, inline))
                && es.iter().all(|e| is_block_root(e, inline) || is_simple(e))
        }
        ExprKind::Proj(inner, _) => is_block_root(inner, inline),
        _ => false,
    }
}

/// Variables and literals: free to pass into a block.
fn is_simple(e: &Expr) -> bool {
    matches!(e.kind, ExprKind::Local(_) | ExprKind::Lit(_))
}

fn is_tensor(t: &Option<Ty>) -> bool {
    matches!(t, Some(Ty::Tensor { .. }))
}

/// Local variables an expression reads (over-approximated: shadowing inside is ignored, which only
/// makes block formation more conservative).
fn free_locals(e: &Expr, out: &mut HashSet<String>) {
    match &e.kind {
        ExprKind::Local(n) => {
            out.insert(n.clone());
        }
        ExprKind::Global(_) | ExprKind::Ctor(_) | ExprKind::Op(_) | ExprKind::Lit(_) => {}
        ExprKind::Tuple(es) => es.iter().for_each(|e| free_locals(e, out)),
        ExprKind::Proj(e, _) => free_locals(e, out),
        ExprKind::Call(c) => {
            free_locals(&c.callee, out);
            c.args.iter().for_each(|e| free_locals(e, out));
        }
        ExprKind::Let(bs, body) => {
            bs.iter().for_each(|b| free_locals(&b.value, out));
            free_locals(body, out);
        }
        ExprKind::Fn(f) => free_locals(&f.body, out),
        ExprKind::If(c, t, f) => {
            free_locals(c, out);
            free_locals(t, out);
            free_locals(f, out);
        }
        ExprKind::Match {
            scrutinee, arms, ..
        } => {
            free_locals(scrutinee, out);
            arms.iter().for_each(|a| free_locals(&a.body, out));
        }
    }
}

enum Resolved {
    Slot(u32),
    SelfRef,
}

fn err(span: Span, message: impl Into<String>) -> LowerError {
    LowerError {
        message: message.into(),
        span,
    }
}

impl Lowerer<'_> {
    fn function(
        &mut self,
        name: &str,
        func: &Function,
        self_name: Option<String>,
    ) -> Result<u32, LowerError> {
        let mut scope = FnScope {
            name: name.to_string(),
            locals: Vec::new(),
            local_slots: HashMap::new(),
            captured: HashMap::new(),
            n_slots: 0,
            captures: Vec::new(),
            self_name,
        };
        for p in &func.params {
            let s = scope.n_slots;
            scope.bind(&p.name.name, s);
            scope.n_slots += 1;
        }
        self.fns.push(scope);
        let body = if self.opts.blocks && self.opts.coarsen && func.attrs.is_primitive() {
            match self.block_for(name, &func.body, true) {
                Ok(Some(code)) => Ok(code),
                Ok(None) => {
                    self.notes.push((
                        func.span,
                        format!(
                            "`{name}` is marked Primitive=1 but is not a static block (it has control flow, \
                             calls, or non-tensor values); it runs as ordinary code"
                        ),
                    ));
                    self.expr(&func.body)
                }
                Err(e) => Err(e),
            }
        } else {
            self.expr(&func.body)
        };
        let scope = self.fns.pop();
        let body = body?;
        let scope = scope.ok_or_else(|| err(func.span, "internal: scope stack underflow"))?;
        self.lambdas.push(Lambda {
            name: name.to_string(),
            n_params: func.params.len() as u32,
            n_slots: scope.n_slots,
            captures: scope.captures,
            body,
        });
        Ok(self.lambdas.len() as u32 - 1)
    }

    /// The current function's number of local names, to pop a block's names afterwards.
    fn mark(&self) -> usize {
        self.fns.last().map_or(0, |f| f.locals.len())
    }

    /// Drops the names bound since `mark`; captures made meanwhile stay.
    fn restore(&mut self, mark: usize) {
        if let Some(f) = self.fns.last_mut() {
            while f.locals.len() > mark {
                f.unbind_last();
            }
        }
    }

    /// Builds a block computing `e` and returns the code that invokes it (`None`: not a block).
    fn block_for(
        &mut self,
        name: &str,
        e: &Expr,
        primitive: bool,
    ) -> Result<Option<Code>, LowerError> {
        let mut b = BlockBuilder::default();
        let Some(r) = self.block_expr(&mut b, e)? else {
            return Ok(None);
        };
        Ok(Some(self.finish_block(b, &r, name, primitive, e.span)))
    }

    /// Registers the block and returns code that invokes it and rebuilds `r`'s structure.
    fn finish_block(
        &mut self,
        b: BlockBuilder,
        r: &BRef,
        name: &str,
        primitive: bool,
        span: Span,
    ) -> Code {
        let invoke = self.register_block(b, r, name, primitive, span);
        // A flat result is the block's own value; nested tuples are rebuilt from its flat outputs.
        let flat = match r {
            BRef::One(_) => true,
            BRef::Tuple(rs) => rs.iter().all(|x| matches!(x, BRef::One(_))),
        };
        if flat {
            return invoke;
        }
        let tmp = self.new_slot("$block");
        let mut k = 0;
        let body = rebuild(r, tmp, &mut k, span);
        Code::Let {
            binds: vec![(tmp, invoke)],
            body: Box::new(body),
            drops: Vec::new(),
        }
    }

    /// Registers the block computing `r` and returns code that invokes it. The invocation's value
    /// is `r` flattened: one tensor for `BRef::One`, else the flat tuple of every tensor in `r`.
    fn register_block(
        &mut self,
        b: BlockBuilder,
        r: &BRef,
        name: &str,
        primitive: bool,
        span: Span,
    ) -> Code {
        let mut outputs = Vec::new();
        r.flatten(&mut outputs);
        let output_shape = match r {
            BRef::One(_) => OutputShape::Single,
            BRef::Tuple(_) => OutputShape::Tuple,
        };
        let block = prune(Block {
            name: name.to_string(),
            inputs: b.inputs,
            nodes: b.nodes,
            outputs,
            output_shape,
            primitive,
            span,
        });
        if self.opts.fold && !primitive && block.inputs.is_empty() {
            if let Some(code) = fold_constant(&block) {
                self.folded.push(span);
                return code;
            }
        }
        let id = self.blocks.len() as u32;
        self.blocks.push(block);
        let site = self.sites.len() as u32;
        self.sites.push(Site {
            block: id,
            span,
            hoisted: false,
            inlined_from: None,
        });
        Code::InvokeBlock {
            block: id,
            site,
            args: b.input_codes,
            span,
        }
    }

    /// Adds `e` as a block input, evaluated by ordinary code before the block runs. Fails (None) for
    /// non-tensor values and for expressions that read names bound inside the block.
    fn block_input(&mut self, b: &mut BlockBuilder, e: &Expr) -> Result<Option<BRef>, LowerError> {
        if b.closed {
            return Ok(None);
        }
        let key = input_key(e);
        if let Some(i) = key.as_ref().and_then(|k| b.input_by_local.get(k)) {
            return Ok(Some(BRef::One(BVal::Input(*i))));
        }
        let reads_block_names = |b: &BlockBuilder| {
            let mut fv = HashSet::new();
            if !b.env.is_empty() {
                free_locals(e, &mut fv);
            }
            b.env.iter().any(|(n, _)| fv.contains(n))
        };
        match &e.ty {
            Some(Ty::Tensor { .. }) => {}
            Some(Ty::Tuple(ts)) => {
                // A tuple of tensors: pass its fields as separate inputs.
                if !ts.iter().all(|t| matches!(t, Ty::Tensor { .. })) || reads_block_names(b) {
                    return Ok(None);
                }
                // A variable is read once per field. Any other expression (a call, an `if`, a
                // projection of a nested tuple) is evaluated once, by the first field's input
                // code, into a slot the other fields read: inputs are evaluated in order, so this
                // keeps the reference's order of evaluation.
                let (first, rest) = if let ExprKind::Local(_) = e.kind {
                    (self.expr(e)?, None)
                } else {
                    let value = self.expr(e)?;
                    let tmp = self.new_slot("$operand");
                    let first = Code::Let {
                        binds: vec![(tmp, value)],
                        body: Box::new(Code::Slot(tmp)),
                        drops: Vec::new(),
                    };
                    (first, Some(tmp))
                };
                let mut fields = Vec::with_capacity(ts.len());
                for (k, t) in ts.iter().enumerate() {
                    let base = match (k, rest) {
                        (0, _) => first.clone(),
                        (_, Some(tmp)) => Code::Slot(tmp),
                        (_, None) => self.expr(e)?,
                    };
                    let i = b.inputs.len() as u32;
                    b.inputs.push(BlockInput {
                        name: format!("{}.{k}", describe(e)),
                        ty: t.clone(),
                    });
                    b.input_codes
                        .push(Code::Proj(Box::new(base), k as u32, e.span));
                    if let Some(key) = &key {
                        b.input_by_local.insert(format!("{key}.{k}"), i);
                    }
                    fields.push(BRef::One(BVal::Input(i)));
                }
                return Ok(Some(BRef::Tuple(fields)));
            }
            _ => return Ok(None),
        }
        if reads_block_names(b) {
            return Ok(None);
        }
        let code = self.expr(e)?;
        let i = b.inputs.len() as u32;
        b.inputs.push(BlockInput {
            name: describe(e),
            ty: e.ty.clone().unwrap_or_else(Ty::unit),
        });
        b.input_codes.push(code);
        if let Some(key) = key {
            b.input_by_local.insert(key, i);
        }
        Ok(Some(BRef::One(BVal::Input(i))))
    }

    /// [`Lowerer::block_expr`], or nothing added to `b` when the translation fails.
    fn try_block_expr(
        &mut self,
        b: &mut BlockBuilder,
        e: &Expr,
    ) -> Result<Option<BRef>, LowerError> {
        let cp = b.checkpoint();
        let r = self.block_expr(b, e)?;
        if r.is_none() {
            b.rollback(cp);
        }
        Ok(r)
    }

    /// An operand of an operator in a block: translated into block nodes where it can be, else
    /// computed by ordinary code and passed in (a `let` chain binding a closure, say).
    fn block_operand(
        &mut self,
        b: &mut BlockBuilder,
        e: &Expr,
    ) -> Result<Option<BRef>, LowerError> {
        match self.try_block_expr(b, e)? {
            Some(r) => Ok(Some(r)),
            None => self.block_input(b, e),
        }
    }

    /// Translates a pure expression into block nodes; other subexpressions become inputs.
    fn block_expr(&mut self, b: &mut BlockBuilder, e: &Expr) -> Result<Option<BRef>, LowerError> {
        match &e.kind {
            ExprKind::Local(n) => {
                if let Some(r) = b.lookup(n) {
                    return Ok(Some(r.clone()));
                }
                self.block_input(b, e)
            }
            ExprKind::Lit(l) => Ok(Some(BRef::One(BVal::Const(literal(l))))),
            ExprKind::Tuple(es) => {
                let mut rs = Vec::with_capacity(es.len());
                for x in es {
                    match self.block_operand(b, x)? {
                        Some(r) => rs.push(r),
                        None => return Ok(None),
                    }
                }
                Ok(Some(BRef::Tuple(rs)))
            }
            ExprKind::Proj(inner, i) => {
                let inner_in_block = match &inner.kind {
                    ExprKind::Local(n) => b.lookup(n).is_some(),
                    ExprKind::Tuple(_) => true,
                    _ => is_block_root(inner, self.inline),
                };
                if !inner_in_block {
                    // A field of an outside value (e.g. `%state.0`): the field is the input.
                    return self.block_input(b, e);
                }
                match self.block_expr(b, inner)? {
                    Some(BRef::Tuple(rs)) => Ok(rs.get(*i as usize).cloned()),
                    _ => Ok(None),
                }
            }
            ExprKind::Call(c) => {
                if let ExprKind::Global(g) = &c.callee.kind {
                    if let Some(&f) = self.inline.get(g) {
                        return self.inline_call(b, f, &c.args, e.span);
                    }
                }
                let op = match &c.callee.kind {
                    ExprKind::Op(n) => tumble_ops::lookup(n).filter(|op| joins_blocks(op)),
                    _ => None,
                };
                let Some(op) = op else {
                    return self.block_input(b, e);
                };
                let mut args = Vec::with_capacity(c.args.len());
                for a in &c.args {
                    // Without coarsening a block holds this one operator: its operands are inputs.
                    let r = if self.opts.coarsen || matches!(a.kind, ExprKind::Lit(_)) {
                        // An operand the block cannot hold must not fail the whole call: the
                        // fallback, an operator outside a block, cannot take lazy inputs.
                        self.block_operand(b, a)?
                    } else if let ExprKind::Tuple(es) = &a.kind {
                        let mut rs = Vec::with_capacity(es.len());
                        for x in es {
                            match self.block_input(b, x)? {
                                Some(r) => rs.push(r),
                                None => return Ok(None),
                            }
                        }
                        Some(BRef::Tuple(rs))
                    } else {
                        self.block_input(b, a)?
                    };
                    match r {
                        Some(BRef::One(v)) => args.push(BArg::One(v)),
                        Some(BRef::Tuple(rs)) if rs.iter().all(|r| matches!(r, BRef::One(_))) => {
                            let mut vs = Vec::with_capacity(rs.len());
                            for r in rs {
                                r.flatten(&mut vs);
                            }
                            args.push(BArg::Tuple(vs));
                        }
                        _ => return Ok(None),
                    }
                }
                let Some(ty) = e.ty.clone() else {
                    return Ok(None);
                };
                let (op, attrs) = match matmul_as_dense(b, c, &mut args, e.span) {
                    Some(dense) => dense,
                    None => (op, c.attrs.clone()),
                };
                let n = b.nodes.len() as u32;
                let r = match &ty {
                    Ty::Tensor { .. } => BRef::One(BVal::Node(n)),
                    Ty::Tuple(ts) if ts.iter().all(|t| matches!(t, Ty::Tensor { .. })) => {
                        BRef::Tuple(
                            (0..ts.len() as u32)
                                .map(|k| BRef::One(BVal::Field(n, k)))
                                .collect(),
                        )
                    }
                    _ => return Ok(None),
                };
                b.nodes.push(BlockNode {
                    op,
                    args,
                    attrs,
                    ty,
                    span: e.span,
                    calls: b.calls.iter().rev().copied().collect(),
                });
                Ok(Some(r))
            }
            ExprKind::Let(bindings, body) => {
                let mark = b.env.len();
                for bind in bindings {
                    match self.block_expr(b, &bind.value)? {
                        Some(r) => b.env.push((bind.var.name.name.clone(), r)),
                        None => {
                            b.env.truncate(mark);
                            return Ok(None);
                        }
                    }
                }
                let r = self.block_expr(b, body)?;
                b.env.truncate(mark);
                Ok(r)
            }
            _ if is_tensor(&e.ty) => self.block_input(b, e),
            _ => Ok(None),
        }
    }

    /// A call of an inlinable function, as block nodes: the arguments' values bound to the
    /// parameters in a closed scope, then the body.
    fn inline_call(
        &mut self,
        b: &mut BlockBuilder,
        f: &Function,
        args: &[Expr],
        call: Span,
    ) -> Result<Option<BRef>, LowerError> {
        if b.nodes.len() >= crate::inline::MAX_INLINED_NODES || args.len() != f.params.len() {
            return Ok(None);
        }
        // An argument whose `?` sizes the parameter declares known: inlined, the body's types
        // (and what they resolve, a `reshape`'s `0` and `-1`) would be the declaration's, never
        // checked. Called, the callee's block checks its inputs' sizes at each launch.
        let narrows = f
            .params
            .iter()
            .zip(args)
            .any(|(p, a)| match (&p.ty, &a.ty) {
                (Some(declared), Some(given)) => narrows(declared, given),
                _ => false,
            });
        if narrows {
            return Ok(None);
        }
        let mut vals = Vec::with_capacity(args.len());
        for a in args {
            match self.block_expr(b, a)? {
                Some(r) => vals.push(r),
                None => return Ok(None),
            }
        }
        let mark = b.env.len();
        let saved = (b.floor, b.closed);
        for (p, r) in f.params.iter().zip(vals) {
            b.env.push((p.name.name.clone(), r));
        }
        (b.floor, b.closed) = (mark, true);
        b.calls.push(call);
        let r = self.block_expr(b, &f.body);
        b.calls.pop();
        (b.floor, b.closed) = saved;
        b.env.truncate(mark);
        r
    }

    /// Lowers a `let` chain, turning each maximal run of pure operator bindings into one block.
    fn coarsened_let(
        &mut self,
        bindings: &[tumble_ir::LetBinding],
        body: &Expr,
    ) -> Result<Code, LowerError> {
        // live[k]: names read by bindings k.. or the body (the candidates for a run's outputs).
        let n = bindings.len();
        let mut live: Vec<HashSet<String>> = vec![HashSet::new(); n + 1];
        free_locals(body, &mut live[n]);
        for k in (0..n).rev() {
            let mut set = live[k + 1].clone();
            set.remove(&bindings[k].var.name.name);
            free_locals(&bindings[k].value, &mut set);
            live[k] = set;
        }
        let mark = self.mark();
        let mut binds = Vec::with_capacity(n);
        let mut k = 0;
        while k < n {
            if !is_block_root(&bindings[k].value, self.inline) {
                let value = match &bindings[k].value.kind {
                    ExprKind::Fn(func) => Code::MakeClosure(self.function(
                        &format!("%{}", bindings[k].var.name.name),
                        func,
                        Some(bindings[k].var.name.name.clone()),
                    )?),
                    _ => self.expr(&bindings[k].value)?,
                };
                let slot = self.new_slot(&bindings[k].var.name.name);
                binds.push((slot, value));
                k += 1;
                continue;
            }
            let mut b = BlockBuilder::default();
            let start = k;
            while k < n && is_block_root(&bindings[k].value, self.inline) {
                match self.try_block_expr(&mut b, &bindings[k].value)? {
                    Some(r) => b.env.push((bindings[k].var.name.name.clone(), r)),
                    None => break,
                }
                k += 1;
            }
            if k == start {
                // Not expressible as a block after all: lower this binding as ordinary code.
                let value = self.expr(&bindings[k].value)?;
                let slot = self.new_slot(&bindings[k].var.name.name);
                binds.push((slot, value));
                k += 1;
                continue;
            }
            // A run that reaches the end of the chain takes the body in too when it is pure
            // operator work (a cell's `(h, c)` result): one block instead of two.
            if k == n && is_block_root(body, self.inline) {
                if let Some(r) = self.try_block_expr(&mut b, body)? {
                    b.env.clear();
                    let name = format!("{}:{}", self.fn_name(), bindings[start].var.name.name);
                    let span = bindings[start].span.to(body.span);
                    let value = self.finish_block(b, &r, &name, false, span);
                    self.restore(mark);
                    return Ok(Code::Let {
                        binds,
                        body: Box::new(value),
                        drops: Vec::new(),
                    });
                }
            }
            // The run's outputs: its last binding of each name that is read after the run.
            let mut outs: Vec<(String, BRef)> = Vec::new();
            for (name, r) in b.env.iter().rev() {
                if live[k].contains(name) && !outs.iter().any(|(m, _)| m == name) {
                    outs.push((name.clone(), r.clone()));
                }
            }
            outs.reverse();
            if outs.is_empty() {
                // Nothing after the run reads it, but it still runs: its inputs are ordinary code
                // (random draws, calls that may fail) and its operators may fail at run time, as
                // they do in the reference. Its last binding stands in as the output.
                if let Some((name, r)) = b.env.last() {
                    outs.push((name.clone(), r.clone()));
                }
            }
            b.env.clear();
            let result = BRef::Tuple(outs.iter().map(|(_, r)| r.clone()).collect());
            let name = format!("{}:{}", self.fn_name(), bindings[start].var.name.name);
            let span = bindings[start].span.to(bindings[k - 1].span);
            // The flat invocation: each output below is rebuilt from its flat field indices.
            let invoke = self.register_block(b, &result, &name, false, span);
            let tmp = self.new_slot("$run");
            binds.push((tmp, invoke));
            let mut field = 0;
            for (name, r) in &outs {
                let value = rebuild(r, tmp, &mut field, span);
                let slot = self.new_slot(name);
                binds.push((slot, value));
            }
        }
        let body = self.expr(body)?;
        self.restore(mark);
        Ok(Code::Let {
            binds,
            body: Box::new(body),
            drops: Vec::new(),
        })
    }

    fn fn_name(&self) -> String {
        self.fns.last().map_or_else(String::new, |f| f.name.clone())
    }

    fn new_slot(&mut self, name: &str) -> u32 {
        match self.fns.last_mut() {
            Some(f) => {
                let s = f.n_slots;
                f.n_slots += 1;
                f.bind(name, s);
                s
            }
            None => 0,
        }
    }

    /// Finds `name` in function scope `depth`, capturing it from enclosing functions as needed.
    fn resolve(&mut self, name: &str, depth: usize) -> Option<Resolved> {
        let f = self.fns.get(depth)?;
        if let Some(&s) = f.local_slots.get(name).and_then(|v| v.last()) {
            return Some(Resolved::Slot(s));
        }
        if let Some(&s) = f.captured.get(name) {
            return Some(Resolved::Slot(s));
        }
        if f.self_name.as_deref() == Some(name) {
            return Some(Resolved::SelfRef);
        }
        let outer = self.resolve(name, depth.checked_sub(1)?)?;
        let f = self.fns.get_mut(depth)?;
        let slot = f.n_slots;
        f.n_slots += 1;
        // Captured names sit below every local, so later bindings still shadow them.
        f.captured.insert(name.to_string(), slot);
        let from = match outer {
            Resolved::Slot(s) => CaptureFrom::Slot(s),
            Resolved::SelfRef => CaptureFrom::SelfRef,
        };
        f.captures.push((from, slot));
        Some(Resolved::Slot(slot))
    }

    fn exprs(&mut self, es: &[Expr]) -> Result<Vec<Code>, LowerError> {
        es.iter().map(|e| self.expr(e)).collect()
    }

    fn expr(&mut self, e: &Expr) -> Result<Code, LowerError> {
        if self.opts.blocks {
            if let ExprKind::Let(bindings, body) = &e.kind {
                if self.opts.coarsen {
                    return self.coarsened_let(bindings, body);
                }
            }
            if is_block_root(e, self.inline) {
                let name = format!("{}:{}", self.fn_name(), describe(e));
                if let Some(code) = self.block_for(&name, e, false)? {
                    return Ok(code);
                }
            }
        }
        Ok(match &e.kind {
            ExprKind::Local(n) => {
                let depth = self.fns.len().saturating_sub(1);
                match self.resolve(n, depth) {
                    Some(Resolved::Slot(s)) => Code::Slot(s),
                    Some(Resolved::SelfRef) => Code::SelfRef,
                    None => return Err(err(e.span, format!("unbound variable `%{n}`"))),
                }
            }
            ExprKind::Global(n) => Code::Global(self.global(n, e.span)?),
            ExprKind::Ctor(n) => Code::Ctor(self.ctor(n, e.span)?),
            ExprKind::Op(n) => {
                return Err(err(e.span, format!("operator `{n}` used as a value")));
            }
            ExprKind::Lit(l) => Code::Lit(literal(l)),
            ExprKind::Tuple(es) => Code::Tuple(self.exprs(es)?),
            ExprKind::Proj(inner, i) => Code::Proj(Box::new(self.expr(inner)?), *i, e.span),
            ExprKind::Call(call) => match &call.callee.kind {
                ExprKind::Op(n) if n == "db.phase_change" && call.args.is_empty() => Code::Phase,
                ExprKind::Op(n) if n == "db.concurrent" => match call.args.first().map(|a| &a.kind)
                {
                    Some(ExprKind::Tuple(es)) if call.args.len() == 1 => {
                        Code::Concurrent(self.exprs(es)?)
                    }
                    // Not a literal tuple: nothing to fork; the value passes through.
                    _ => match call.args.first() {
                        Some(a) => self.expr(a)?,
                        None => Code::Tuple(Vec::new()),
                    },
                },
                ExprKind::Op(n) => Code::CallOp {
                    op: tumble_ops::lookup(n)
                        .ok_or_else(|| err(call.callee.span, format!("unknown operator `{n}`")))?,
                    args: self.exprs(&call.args)?,
                    attrs: call.attrs.clone(),
                    span: e.span,
                },
                ExprKind::Ctor(n) => Code::CallCtor {
                    ctor: self.ctor(n, call.callee.span)?,
                    args: self.exprs(&call.args)?,
                },
                ExprKind::Global(n) => Code::CallGlobal {
                    global: self.global(n, call.callee.span)?,
                    args: self.exprs(&call.args)?,
                    span: e.span,
                },
                _ => {
                    let mut operands = vec![self.expr(&call.callee)?];
                    operands.extend(self.exprs(&call.args)?);
                    Code::Call {
                        operands,
                        span: e.span,
                    }
                }
            },
            ExprKind::Let(bindings, body) => {
                let mark = self.mark();
                let mut binds = Vec::with_capacity(bindings.len());
                for b in bindings {
                    let value = match &b.value.kind {
                        ExprKind::Fn(func) => Code::MakeClosure(self.function(
                            &format!("%{}", b.var.name.name),
                            func,
                            Some(b.var.name.name.clone()),
                        )?),
                        _ => self.expr(&b.value)?,
                    };
                    let slot = self.new_slot(&b.var.name.name);
                    binds.push((slot, value));
                }
                let body = self.expr(body)?;
                self.restore(mark);
                Code::Let {
                    binds,
                    body: Box::new(body),
                    drops: Vec::new(),
                }
            }
            ExprKind::Fn(func) => Code::MakeClosure(self.function("fn", func, None)?),
            ExprKind::If(c, t, f) => Code::If(
                Box::new(self.expr(c)?),
                Box::new(self.expr(t)?),
                Box::new(self.expr(f)?),
            ),
            ExprKind::Match {
                scrutinee, arms, ..
            } => {
                let scrutinee = Box::new(self.expr(scrutinee)?);
                let mut out = Vec::with_capacity(arms.len());
                for arm in arms {
                    let mark = self.mark();
                    let pat = self.pattern(&arm.pattern)?;
                    let body = self.expr(&arm.body)?;
                    self.restore(mark);
                    out.push((pat, body));
                }
                Code::Match {
                    scrutinee,
                    arms: out,
                    span: e.span,
                }
            }
        })
    }

    fn pattern(&mut self, p: &Pattern) -> Result<Pat, LowerError> {
        Ok(match &p.kind {
            PatternKind::Wildcard => Pat::Wild,
            PatternKind::Var(v) => Pat::Bind(self.new_slot(&v.name.name)),
            PatternKind::Ctor { name, args } => Pat::Ctor(
                self.ctor(&name.name, name.span)?,
                args.iter()
                    .map(|a| self.pattern(a))
                    .collect::<Result<_, _>>()?,
            ),
            PatternKind::Tuple(ps) => Pat::Tuple(
                ps.iter()
                    .map(|a| self.pattern(a))
                    .collect::<Result<_, _>>()?,
            ),
        })
    }

    fn global(&self, n: &str, span: Span) -> Result<u32, LowerError> {
        self.global_index
            .get(n)
            .copied()
            .ok_or_else(|| err(span, format!("unknown global `@{n}`")))
    }

    fn ctor(&self, n: &str, span: Span) -> Result<u32, LowerError> {
        self.ctor_index
            .get(n)
            .copied()
            .ok_or_else(|| err(span, format!("unknown constructor `{n}`")))
    }
}

/// Code that rebuilds a nested result from the flat outputs of a block held in slot `tmp`.
fn rebuild(r: &BRef, tmp: u32, k: &mut u32, span: Span) -> Code {
    match r {
        BRef::One(_) => {
            let c = Code::Proj(Box::new(Code::Slot(tmp)), *k, span);
            *k += 1;
            c
        }
        BRef::Tuple(rs) => Code::Tuple(rs.iter().map(|x| rebuild(x, tmp, k, span)).collect()),
    }
}

/// The key under which a block input that is a variable, or a field of one (`%l.1`), is passed
/// once however often the block reads it (an MV-RNN composition reading each child's matrix twice
/// gathered every matrix twice). Names do not change meaning inside a run: a name the run binds
/// is found in the block's environment before any input.
fn input_key(e: &Expr) -> Option<String> {
    match &e.kind {
        ExprKind::Local(n) => Some(n.clone()),
        ExprKind::Proj(inner, i) => input_key(inner).map(|k| format!("{k}.{i}")),
        _ => None,
    }
}

/// A short description of a block input for `explain`.
fn describe(e: &Expr) -> String {
    match &e.kind {
        ExprKind::Local(n) => format!("%{n}"),
        ExprKind::Proj(inner, i) => format!("{}.{i}", describe(inner)),
        ExprKind::Call(c) => format!("{}(..)", describe(&c.callee)),
        ExprKind::Global(g) => format!("@{g}"),
        ExprKind::Op(o) => o.clone(),
        ExprKind::Ctor(c) => c.clone(),
        _ => "expression".to_string(),
    }
}

/// Removes nodes no output depends on (left behind when a candidate region was abandoned).
fn prune(mut block: Block) -> Block {
    block.drop_dead_nodes(|_| true);
    block
}

/// The value of an input-less block, computed now (`None`: too large, or it fails at run time,
/// where the error is reported with the instance).
fn fold_constant(block: &Block) -> Option<Code> {
    fn small(t: &Ty) -> bool {
        match t {
            Ty::Tuple(ts) => ts.iter().all(small),
            _ => t
                .as_tensor()
                .and_then(|(dims, _)| dims.iter().try_fold(1i64, |n, d| n.checked_mul(d.known()?)))
                .is_some_and(|n| n <= FOLD_MAX_ELEMENTS),
        }
    }
    if !block.nodes.iter().all(|n| small(&n.ty)) {
        return None;
    }
    let mut rng = tumble_tensor::Rng::new(0);
    let mut octx = tumble_ops::OpCtx { rng: &mut rng };
    let mut outs = block.eval(&[], &mut octx).ok()?;
    Some(match (block.output_shape, outs.len()) {
        (OutputShape::Single, 1) => Code::Lit(outs.remove(0)),
        _ => Code::Tuple(outs.into_iter().map(Code::Lit).collect()),
    })
}

fn literal(l: &Literal) -> Tensor {
    use tumble_ir::DType;
    match *l {
        Literal::Bool(b) => Tensor::scalar_bool(b),
        Literal::Int(v, DType::Int64) => Tensor::scalar_i64(v),
        Literal::Int(v, DType::Float32) => Tensor::scalar_f32(v as f32),
        Literal::Int(v, DType::Float64) => Tensor::scalar_f64(v as f64),
        Literal::Int(v, _) => Tensor::scalar_i32(v as i32),
        Literal::Float(v, DType::Float64) => Tensor::scalar_f64(v),
        Literal::Float(v, _) => Tensor::scalar_f32(v as f32),
    }
}

/// The parameter types of a global, for decoding its arguments.
pub fn param_types(typed: &TypedModule, global: &str) -> Option<(Vec<Ty>, Ty)> {
    match &typed.globals.get(global)?.ty {
        Ty::Func(ps, r) => Some((ps.clone(), (**r).clone())),
        _ => None,
    }
}

/// Whether a value of type `given` can have another size where `declared` (a parameter's type)
/// has a known one.
pub(crate) fn narrows(declared: &Ty, given: &Ty) -> bool {
    match (declared, given) {
        (Ty::Tensor { shape: d, .. }, Ty::Tensor { shape: g, .. }) => d
            .iter()
            .zip(g)
            .any(|(d, g)| matches!((d, g), (Dim::Known(_), Dim::Any))),
        (Ty::Tuple(ds), Ty::Tuple(gs)) => ds.iter().zip(gs).any(|(d, g)| narrows(d, g)),
        (Ty::Adt(dn, ds), Ty::Adt(gn, gs)) if dn == gn => {
            ds.iter().zip(gs).any(|(d, g)| narrows(d, g))
        }
        _ => false,
    }
}
