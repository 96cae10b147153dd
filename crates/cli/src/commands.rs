//! The subcommands. Each returns the process exit status: 0 success, 1 a problem with the input.

use std::path::Path;
use std::process::ExitCode;
use tumble_check::{display_sig, LoadOptions};
use tumble_ir::{diag, SourceMap};

fn read(path: &Path) -> Result<String, String> {
    crate::files::read_source(path).map_err(|e| format!("error: {e}"))
}

pub fn check(files: &[std::path::PathBuf], quiet: bool, prelude: bool, color: bool) -> ExitCode {
    let mut ok = true;
    for path in files {
        let text = match read(path) {
            Ok(t) => t,
            Err(e) => {
                eprintln!("{e}");
                ok = false;
                continue;
            }
        };
        let mut sources = SourceMap::new();
        let name = path.display().to_string();
        match tumble_check::load(&mut sources, &name, &text, LoadOptions { prelude }) {
            Ok(typed) => {
                eprint!("{}", diag::render(&typed.warnings, &sources, color));
                if !quiet {
                    if files.len() > 1 {
                        println!("# {name}");
                    }
                    for (g, sig) in typed.user_globals() {
                        println!("@{g}: {}", display_sig(sig));
                    }
                }
            }
            Err(diags) => {
                ok = false;
                eprint!("{}", diag::render(&diags, &sources, color));
                let n = diags.iter().filter(|d| d.is_error()).count();
                eprintln!("{name}: {n} error{}", if n == 1 { "" } else { "s" });
            }
        }
    }
    if ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

pub fn fmt(path: &Path, check: bool, color: bool) -> ExitCode {
    let text = match read(path) {
        Ok(t) => t,
        Err(e) => {
            eprintln!("{e}");
            return ExitCode::FAILURE;
        }
    };
    let mut sources = SourceMap::new();
    let id = sources.add(path.display().to_string(), text.clone());
    match tumble_syntax::parse_module(&text, id) {
        Ok(m) => {
            let out = tumble_syntax::print_module(&m);
            // The canonical form is printed from the parsed module, which has no comments: say
            // so rather than drop them unannounced from a file formatted in place.
            let comments = tumble_syntax::comment_count(&text);
            if comments > 0 && !check {
                eprintln!(
                    "warning: {}: the canonical form leaves out the file's {comments} comment{}",
                    path.display(),
                    if comments == 1 { "" } else { "s" }
                );
            }
            if check {
                if out == text {
                    ExitCode::SUCCESS
                } else {
                    eprintln!("{} is not in canonical form", path.display());
                    ExitCode::FAILURE
                }
            } else {
                print!("{out}");
                ExitCode::SUCCESS
            }
        }
        Err(diags) => {
            eprint!("{}", diag::render(&diags, &sources, color));
            ExitCode::FAILURE
        }
    }
}

pub fn ops() -> ExitCode {
    for op in tumble_ops::all() {
        let attrs: Vec<String> = op
            .attrs
            .iter()
            .map(|a| {
                if a.required {
                    a.name.to_string()
                } else {
                    format!("{}?", a.name)
                }
            })
            .collect();
        let attrs = if attrs.is_empty() {
            String::new()
        } else {
            format!(" [{}]", attrs.join(", "))
        };
        println!(
            "{:<20} {} arg{}{attrs:<40}  {}",
            op.name,
            op.arity_text(),
            if op.arity == 1 && op.alt_arity.is_none() {
                " "
            } else {
                "s"
            },
            op.doc
        );
    }
    for (alias, name) in tumble_ops::ALIASES {
        println!("{alias:<20} the same as {name}");
    }
    ExitCode::SUCCESS
}
