//! A text form of the executable [`Program`]: every function's code with slots, globals, blocks
//! and sites by name. Tests of the passes compare whole programs through it (snapshots) instead
//! of poking at single nodes, and it is what to read when a pass does something unexpected.
//!
//! ```text
//! fn @walk (lambda 34): params 1, slots 4
//!   match $0
//!   | Leaf($1) =>
//!     invoke cell#9[site 12, hoisted]($1, param1)
//!   | Node($2, $3) =>
//!     invoke walk:@half(..)#11[site 11](@walk($2), @walk($3))
//! ```
//! `$k` is frame slot k, `paramK` the entry's argument K ([`Code::Param`]), `self` the running
//! closure; `[hoisted]` marks a site the hoisting analysis moved out of recursion.

use std::fmt::{self, Write};

use crate::program::{CaptureFrom, Code, Lambda, Pat, Program};

impl fmt::Display for Program {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, l) in self.lambdas.iter().enumerate() {
            let entry =
                self.params_of.and_then(|g| self.globals.get(g as usize)) == Some(&(i as u32));
            write!(
                f,
                "fn @{} (lambda {i}{}): params {}, slots {}",
                l.name,
                if entry { ", entry" } else { "" },
                l.n_params,
                l.n_slots
            )?;
            if !l.captures.is_empty() {
                let caps: Vec<String> = l
                    .captures
                    .iter()
                    .map(|(from, to)| {
                        let from = match from {
                            CaptureFrom::Slot(s) => format!("${s}"),
                            CaptureFrom::SelfRef => "self".into(),
                            CaptureFrom::Param(k) => format!("param{k}"),
                        };
                        format!("${to} <- {from}")
                    })
                    .collect();
                write!(f, ", captures {}", caps.join(", "))?;
            }
            writeln!(f)?;
            let mut out = String::new();
            Printer { program: self }.code(&l.body, 1, &mut out)?;
            writeln!(f, "{out}")?;
        }
        Ok(())
    }
}

struct Printer<'p> {
    program: &'p Program,
}

fn indent(out: &mut String, depth: usize) {
    for _ in 0..depth {
        out.push_str("  ");
    }
}

impl Printer<'_> {
    fn lambda_name(&self, l: u32) -> String {
        self.program
            .lambdas
            .get(l as usize)
            .map_or_else(|| format!("lambda{l}"), |l: &Lambda| l.name.clone())
    }

    fn global_name(&self, g: u32) -> String {
        match self.program.globals.get(g as usize) {
            Some(&l) => format!("@{}", self.lambda_name(l)),
            None => format!("@global{g}"),
        }
    }

    fn ctor_name(&self, c: u32) -> String {
        self.program
            .ctors
            .get(c as usize)
            .map_or_else(|| format!("ctor{c}"), |c| c.name.clone())
    }

    fn pat(&self, p: &Pat) -> String {
        match p {
            Pat::Wild => "_".into(),
            Pat::Bind(s) => format!("${s}"),
            Pat::Ctor(c, ps) if ps.is_empty() => self.ctor_name(*c),
            Pat::Ctor(c, ps) => format!("{}({})", self.ctor_name(*c), self.pats(ps)),
            Pat::Tuple(ps) => format!("({})", self.pats(ps)),
        }
    }

    fn pats(&self, ps: &[Pat]) -> String {
        ps.iter()
            .map(|p| self.pat(p))
            .collect::<Vec<_>>()
            .join(", ")
    }

    /// Code that fits on one line (no `let`, `if` or `match` inside), else `None`.
    fn inline(&self, c: &Code) -> Option<String> {
        let list = |cs: &[Code]| -> Option<String> {
            Some(
                cs.iter()
                    .map(|c| self.inline(c))
                    .collect::<Option<Vec<_>>>()?
                    .join(", "),
            )
        };
        Some(match c {
            Code::Slot(s) => format!("${s}"),
            Code::SelfRef => "self".into(),
            Code::Global(g) => self.global_name(*g),
            Code::Ctor(c) => self.ctor_name(*c),
            Code::Lit(t) if t.len() == 1 => format!("{}", t.get_f64(0).unwrap_or(f64::NAN)),
            Code::Lit(t) => format!("lit{:?}", t.shape()),
            Code::Param(k) => format!("param{k}"),
            Code::Tuple(es) => format!("({})", list(es)?),
            Code::Proj(e, i, _) => format!("{}.{i}", self.inline(e)?),
            Code::CallOp {
                op, args, attrs, ..
            } => {
                let mut a = list(args)?;
                for at in attrs.iter() {
                    a.push_str(&format!(", {}={}", at.name, at.value));
                }
                format!("{}({a})", op.name)
            }
            Code::CallCtor { ctor, args } => format!("{}({})", self.ctor_name(*ctor), list(args)?),
            Code::CallGlobal { global, args, .. } => {
                format!("{}({})", self.global_name(*global), list(args)?)
            }
            Code::Call { operands, .. } => {
                let (callee, args) = operands.split_first()?;
                format!("call {}({})", self.inline(callee)?, list(args)?)
            }
            Code::MakeClosure(l) => format!("closure @{}", self.lambda_name(*l)),
            Code::InvokeBlock {
                block, site, args, ..
            } => {
                let name = self
                    .program
                    .blocks
                    .get(*block as usize)
                    .map_or_else(|| format!("block{block}"), |b| b.name.clone());
                let hoisted = self
                    .program
                    .sites
                    .get(*site as usize)
                    .is_some_and(|s| s.hoisted);
                format!(
                    "invoke {name}#{block}[site {site}{}]({})",
                    if hoisted { ", hoisted" } else { "" },
                    list(args)?
                )
            }
            Code::Phase => "phase".into(),
            Code::Concurrent(es) => format!("concurrent({})", list(es)?),
            Code::Ghost(..) | Code::Let { .. } | Code::If(..) | Code::Match { .. } => return None,
        })
    }

    /// `c` at `depth`, starting on the current line (the caller indented it).
    fn code(&self, c: &Code, depth: usize, out: &mut String) -> fmt::Result {
        if let Some(line) = self.inline(c) {
            indent(out, depth);
            out.push_str(&line);
            return Ok(());
        }
        match c {
            Code::Let { binds, body, drops } => {
                for (i, (s, v)) in binds.iter().enumerate() {
                    match self.inline(v) {
                        Some(line) => {
                            indent(out, depth);
                            writeln!(out, "let ${s} = {line}")?;
                        }
                        None => {
                            indent(out, depth);
                            writeln!(out, "let ${s} =")?;
                            self.code(v, depth + 1, out)?;
                            out.push('\n');
                        }
                    }
                    let dropped: Vec<String> = crate::program::dropped_after(drops, i)
                        .map(|d| format!("${d}"))
                        .collect();
                    if !dropped.is_empty() {
                        indent(out, depth);
                        writeln!(out, "drop {}", dropped.join(", "))?;
                    }
                }
                self.code(body, depth, out)
            }
            Code::If(cond, a, b) => {
                indent(out, depth);
                writeln!(out, "if")?;
                self.code(cond, depth + 1, out)?;
                out.push('\n');
                indent(out, depth);
                writeln!(out, "then")?;
                self.code(a, depth + 1, out)?;
                out.push('\n');
                indent(out, depth);
                writeln!(out, "else")?;
                self.code(b, depth + 1, out)
            }
            Code::Match {
                scrutinee, arms, ..
            } => {
                indent(out, depth);
                match self.inline(scrutinee) {
                    Some(line) => write!(out, "match {line}")?,
                    None => {
                        writeln!(out, "match")?;
                        self.code(scrutinee, depth + 2, out)?;
                    }
                }
                for (p, body) in arms {
                    out.push('\n');
                    indent(out, depth);
                    writeln!(out, "| {} =>", self.pat(p))?;
                    self.code(body, depth + 1, out)?;
                }
                Ok(())
            }
            Code::Ghost(n, body) => {
                indent(out, depth);
                writeln!(out, "ghost {n}")?;
                self.code(body, depth + 1, out)
            }
            // Compound code with a multi-line part inside: one child per line.
            other => {
                indent(out, depth);
                writeln!(out, "{}", shape_of(other))?;
                let mut first = true;
                let mut err = Ok(());
                other.for_each_child(|k| {
                    if !first {
                        out.push('\n');
                    }
                    first = false;
                    if err.is_ok() {
                        err = self.code(k, depth + 1, out);
                    }
                });
                err
            }
        }
    }
}

/// The head of compound code printed one child per line.
fn shape_of(c: &Code) -> String {
    match c {
        Code::Tuple(_) => "tuple".into(),
        Code::Proj(_, i, _) => format!("field {i} of"),
        Code::CallOp { op, .. } => format!("{} of", op.name),
        Code::CallCtor { ctor, .. } => format!("ctor {ctor} of"),
        Code::CallGlobal { global, .. } => format!("call global {global} with"),
        Code::Call { .. } => "call (callee first)".into(),
        Code::InvokeBlock { block, site, .. } => format!("invoke block {block} site {site} with"),
        Code::Concurrent(_) => "concurrent".into(),
        _ => "code".into(),
    }
}
