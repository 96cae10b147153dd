//! The Relay text format (v0.0.5): text → [`tumble_ir::Module`] (parser) and back (printer).
//!
//! - [`lexer`]: characters → tokens, with lexical errors;
//! - [`parser`]: tokens → syntax tree, with located errors and item-level recovery;
//! - [`printer`]: syntax tree → canonical text that parses back to the same tree.
//!
//! Infix operators are sugar: `a + b` is read as the call `add(a, b)` and printed that way.

mod lexer;
mod parser;
mod printer;

pub use lexer::comment_count;

use tumble_ir::{Diagnostic, Expr, Module, SourceId, TypeExpr};

/// How deep expressions, types, patterns and attribute lists may nest. Deeper input is a located
/// error rather than a stack overflow, here and in every pass that recurses over the tree.
pub const MAX_NESTING: usize = 256;

/// Parses one source file. On failure returns every error found (the parser recovers at the next
/// top-level `def` or `type`), sorted by position.
pub fn parse_module(text: &str, src: SourceId) -> Result<Module, Vec<Diagnostic>> {
    on_parser_stack(|| parser::parse_module(text, src))
}

/// Parses a single expression (the whole text must be one expression).
pub fn parse_expr(text: &str, src: SourceId) -> Result<Expr, Vec<Diagnostic>> {
    on_parser_stack(|| parser::parse_expr(text, src))
}

/// Stack for the parser's own thread. Unoptimized builds spend about 12 KiB of stack per level of
/// expression nesting (each `?` and temporary `Expr` gets its own slot), so [`MAX_NESTING`] levels
/// of expressions holding patterns holding types need several MiB: more than the 2 MiB a test
/// thread has. Only the touched pages are ever committed.
const PARSER_STACK: usize = 64 << 20;

/// Runs `f` on a thread with [`PARSER_STACK`] bytes of stack, or on this thread if none can be
/// spawned (optimized builds fit comfortably in an ordinary stack).
fn on_parser_stack<T: Send>(f: impl Fn() -> T + Sync) -> T {
    std::thread::scope(|scope| {
        let spawned = std::thread::Builder::new()
            .name("tumble-parse".into())
            .stack_size(PARSER_STACK)
            .spawn_scoped(scope, &f);
        match spawned {
            Ok(handle) => handle
                .join()
                .unwrap_or_else(|payload| std::panic::resume_unwind(payload)),
            Err(_) => f(),
        }
    })
}

/// Pretty-prints a module in canonical form; `parse_module(print_module(m))` is `m` up to spans.
pub fn print_module(m: &Module) -> String {
    printer::print_module(m)
}

/// Pretty-prints an expression as it would appear as a function body (indentation level 0).
pub fn print_expr(e: &Expr) -> String {
    printer::print_expr(e)
}

/// Prints a written type in the source syntax, e.g. for messages.
pub fn print_type(t: &TypeExpr) -> String {
    printer::print_type(t)
}
