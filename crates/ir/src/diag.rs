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
        let sev = match self.severity {
            Severity::Error => "error",
            Severity::Warning => "warning",
        };
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
        Ok(match f.line_starts().binary_search(&byte_index) {
            Ok(i) => i,
            Err(i) => i.saturating_sub(1),
        })
    }

    fn line_range(&'a self, id: SourceId, line_index: usize) -> Result<Range<usize>, FilesError> {
        let f = self.0.get(id).ok_or(FilesError::FileMissing)?;
        let starts = f.line_starts();
        let start = *starts.get(line_index).ok_or(FilesError::LineTooLarge {
            given: line_index,
            max: starts.len().saturating_sub(1),
        })?;
        let end = starts.get(line_index + 1).copied().unwrap_or(f.text.len());
        Ok(start..end)
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
}
