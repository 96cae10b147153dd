//! Located diagnostics and their rendering (via `codespan-reporting`).

use crate::source::{SourceId, SourceMap};
use crate::span::Span;
use codespan_reporting::diagnostic as cs;
use codespan_reporting::files::{Error as FilesError, Files};
use codespan_reporting::term;
use std::ops::Range;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Severity {
    Error,
    Warning,
}

impl Severity {
    /// `error` or `warning`, as messages begin.
    pub fn word(self) -> &'static str {
        match self {
            Severity::Error => "error",
            Severity::Warning => "warning",
        }
    }
}

#[derive(Clone, Debug, PartialEq)]
pub struct Label {
    pub span: Span,
    pub message: String,
    pub primary: bool,
}

/// One problem found in a source: a message that says what was expected and what was found, a primary
/// location, optional secondary locations and notes (hints).
#[derive(Clone, Debug, PartialEq)]
pub struct Diagnostic {
    pub severity: Severity,
    pub message: String,
    pub labels: Vec<Label>,
    pub notes: Vec<String>,
}

impl Diagnostic {
    pub fn error(span: Span, message: impl Into<String>) -> Self {
        Diagnostic {
            severity: Severity::Error,
            message: message.into(),
            labels: vec![Label {
                span,
                message: String::new(),
                primary: true,
            }],
            notes: Vec::new(),
        }
    }

    pub fn warning(span: Span, message: impl Into<String>) -> Self {
        Diagnostic {
            severity: Severity::Warning,
            ..Diagnostic::error(span, message)
        }
    }

    /// Sets the text under the primary caret.
    pub fn with_label(mut self, message: impl Into<String>) -> Self {
        if let Some(l) = self.labels.iter_mut().find(|l| l.primary) {
            l.message = message.into();
        }
        self
    }

    pub fn with_secondary(mut self, span: Span, message: impl Into<String>) -> Self {
        self.labels.push(Label {
            span,
            message: message.into(),
            primary: false,
        });
        self
    }

    pub fn with_note(mut self, note: impl Into<String>) -> Self {
        self.notes.push(note.into());
        self
    }

    pub fn primary_span(&self) -> Option<Span> {
        self.labels.iter().find(|l| l.primary).map(|l| l.span)
    }

    pub fn is_error(&self) -> bool {
        self.severity == Severity::Error
    }

    /// `file:line:col: error: message` — one line, for tests and machine consumption.
    pub fn short(&self, sources: &SourceMap) -> String {
        let sev = self.severity.word();
        match self
            .primary_span()
            .and_then(|s| sources.get(s.src).map(|f| (f, s)))
        {
            Some((file, span)) => {
                let (line, col) = file.line_col(span.lo as usize);
                format!("{}:{line}:{col}: {sev}: {}", file.name, self.message)
            }
            None => format!("{sev}: {}", self.message),
        }
    }
}

/// Renders diagnostics with source excerpts and carets; `color` adds ANSI colors.
pub fn render(diags: &[Diagnostic], sources: &SourceMap, color: bool) -> String {
    let files = FilesAdapter(sources);
    let config = term::Config::default();
    let mut out = String::new();
    for d in diags {
        if let Some(text) = render_long_line(d, sources) {
            out.push_str(&text);
            continue;
        }
        let cd = to_codespan(d);
        let res = if color {
            let mut buf = Vec::new();
            let mut w = term::termcolor::Ansi::new(&mut buf);
            let r = term::emit_to_write_style(&mut w, &config, &files, &cd);
            out.push_str(&String::from_utf8_lossy(&buf));
            r
        } else {
            term::emit_to_string(&mut out, &config, &files, &cd)
        };
        if res.is_err() {
            // A span outside its file is a bug in tumble, not in the user's program: still say something.
            out.push_str(&d.short(sources));
            out.push('\n');
        }
    }
    out
}

/// Source lines longer than this are shown as a window around the location, not whole: a
/// generated or minified source can have a line of megabytes, and a message must stay readable.
pub const MAX_EXCERPT_LINE: usize = 300;

/// Characters of a long line shown on each side of the location.
const WINDOW: usize = 60;

/// The rendering of a diagnostic one of whose labels sits on a line longer than
/// [`MAX_EXCERPT_LINE`] bytes: the primary location's line cut to a window around it, with a
/// caret, then the other labels and notes as text; `None` when every labelled line is short.
fn render_long_line(d: &Diagnostic, sources: &SourceMap) -> Option<String> {
    let line_of = |span: Span| {
        let file = sources.get(span.src)?;
        let lo = (span.lo as usize).min(file.text.len());
        let line = file.line_index(lo);
        let range = file.line_range(line)?;
        Some((file, line, range.start, range.end, lo))
    };
    let long = d.labels.iter().any(|l| {
        line_of(l.span).is_some_and(|(_, _, start, end, _)| end - start > MAX_EXCERPT_LINE)
    });
    if !long {
        return None;
    }
    let mut out = format!("{}: {}\n", d.severity.word(), d.message);
    let primary = d.labels.iter().find(|l| l.primary).or(d.labels.first());
    if let Some(label) = primary {
        if let Some((file, line, start, end, lo)) = line_of(label.span) {
            let text = file
                .text
                .get(start..end)
                .unwrap_or("")
                .trim_end_matches(['\n', '\r']);
            // Counted and cut by characters, without copying the line.
            let before = text.get(..lo - start).unwrap_or("");
            let after = text.get(lo - start..).unwrap_or("");
            let n_before = before.chars().count();
            let col = n_before + 1;
            let shown_before = n_before.min(WINDOW);
            let cut_before = shown_before < n_before;
            let n_after = after.chars().take(WINDOW + 1).count();
            let cut_after = n_after > WINDOW;
            let mut excerpt = String::new();
            if cut_before {
                excerpt.push('…');
            }
            excerpt.extend(before.chars().skip(n_before - shown_before));
            excerpt.extend(after.chars().take(WINDOW));
            if cut_after {
                excerpt.push('…');
            }
            let lineno = (line + 1).to_string();
            let pad = " ".repeat(lineno.len());
            let span_chars = file
                .text
                .get(lo..(label.span.hi as usize).min(end).max(lo))
                .map_or(1, |s| s.chars().count())
                .clamp(1, WINDOW);
            let caret_at = shown_before + usize::from(cut_before);
            out.push_str(&format!("{pad} ┌─ {}:{}:{col}\n", file.name, line + 1));
            out.push_str(&format!("{pad} │\n"));
            out.push_str(&format!("{lineno} │ {excerpt}\n"));
            out.push_str(&format!(
                "{pad} │ {}{} {}\n",
                " ".repeat(caret_at),
                "^".repeat(span_chars),
                label.message
            ));
            out.push_str(&format!(
                "{pad} = line {} is {} bytes long; shown from column {} to {}\n",
                line + 1,
                end - start,
                col - shown_before,
                col + n_after.min(WINDOW) - 1
            ));
        }
    }
    for l in &d.labels {
        if primary.is_some_and(|p| std::ptr::eq(p, l)) {
            continue;
        }
        if let Some(file) = sources.get(l.span.src) {
            let (line, col) = file.line_col(l.span.lo as usize);
            out.push_str(&format!(" = {}:{line}:{col}: {}\n", file.name, l.message));
        }
    }
    for n in &d.notes {
        out.push_str(&format!(" = {n}\n"));
    }
    out.push('\n');
    Some(out)
}

fn to_codespan(d: &Diagnostic) -> cs::Diagnostic<SourceId> {
    let sev = match d.severity {
        Severity::Error => cs::Severity::Error,
        Severity::Warning => cs::Severity::Warning,
    };
    cs::Diagnostic::new(sev)
        .with_message(d.message.clone())
        .with_labels(
            d.labels
                .iter()
                .map(|l| {
                    let style = if l.primary {
                        cs::LabelStyle::Primary
                    } else {
                        cs::LabelStyle::Secondary
                    };
                    cs::Label::new(style, l.span.src, l.span.range())
                        .with_message(l.message.clone())
                })
                .collect(),
        )
        .with_notes(d.notes.clone())
}

struct FilesAdapter<'a>(&'a SourceMap);

impl<'a> Files<'a> for FilesAdapter<'a> {
    type FileId = SourceId;
    type Name = &'a str;
    type Source = &'a str;

    fn name(&'a self, id: SourceId) -> Result<&'a str, FilesError> {
        self.0
            .get(id)
            .map(|f| f.name.as_str())
            .ok_or(FilesError::FileMissing)
    }

    fn source(&'a self, id: SourceId) -> Result<&'a str, FilesError> {
        self.0
            .get(id)
            .map(|f| f.text.as_str())
            .ok_or(FilesError::FileMissing)
    }

    fn line_index(&'a self, id: SourceId, byte_index: usize) -> Result<usize, FilesError> {
        let f = self.0.get(id).ok_or(FilesError::FileMissing)?;
        Ok(f.line_index(byte_index))
    }

    fn line_range(&'a self, id: SourceId, line_index: usize) -> Result<Range<usize>, FilesError> {
        let f = self.0.get(id).ok_or(FilesError::FileMissing)?;
        f.line_range(line_index).ok_or(FilesError::LineTooLarge {
            given: line_index,
            max: f.line_starts().len().saturating_sub(1),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn short_and_rendered_forms_name_file_line_and_column() {
        let mut sm = SourceMap::new();
        let id = sm.add("m.rly", "def @f() {\n  foo(1)\n}\n");
        let d = Diagnostic::error(Span::new(id, 13, 16), "unknown operator `foo`")
            .with_label("not in the operator table");
        assert_eq!(d.short(&sm), "m.rly:2:3: error: unknown operator `foo`");
        let r = render(&[d], &sm, false);
        assert!(r.contains("m.rly:2:3"), "{r}");
        assert!(r.contains("^^^ not in the operator table"), "{r}");
    }

    #[test]
    fn a_long_line_is_shown_as_a_window_around_the_location() {
        let mut sm = SourceMap::new();
        let text = format!(
            "def @f() {{\n  {}foo(1){}\n}}\n",
            " é".repeat(100_000),
            "x".repeat(500)
        );
        let lo = text.find("foo").unwrap_or(0) as u32;
        let id = sm.add("m.rly", text);
        let d = Diagnostic::error(Span::new(id, lo, lo + 3), "unknown operator `foo`")
            .with_label("not in the operator table")
            .with_note("a note");
        let r = render(std::slice::from_ref(&d), &sm, false);
        assert!(r.len() < 1000, "{} bytes: {}", r.len(), &r[..200]);
        assert!(r.contains("m.rly:2:200003"), "{r}");
        assert!(r.contains("… é é"), "{r}");
        assert!(r.contains("foo(1)xxx"), "{r}");
        assert!(r.contains("^^^ not in the operator table"), "{r}");
        assert!(r.contains("line 2 is 300509 bytes long"), "{r}");
        assert!(r.contains("= a note"), "{r}");
        // The caret sits under the location.
        let lines: Vec<&str> = r.lines().collect();
        let (src, caret) = (lines[3], lines[4]);
        let at = caret.chars().position(|c| c == '^').unwrap_or(0);
        let under: String = src.chars().skip(at).take(3).collect();
        assert_eq!(under, "foo", "{r}");
        assert_eq!(
            d.short(&sm),
            "m.rly:2:200003: error: unknown operator `foo`"
        );
    }
}
