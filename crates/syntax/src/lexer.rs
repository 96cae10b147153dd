//! Text → tokens.
//!
//! Lexing is a separate pass so that the parser can look ahead freely and so that every lexical
//! problem (unknown characters, unterminated strings and comments, bad number suffixes) is found even
//! in parts of the file the parser skips while recovering. A lexical error leaves a [`Tok::Error`] in
//! the stream: the parser stops at it without adding a second message for the same problem.

use tumble_ir::{DType, Diagnostic, SourceId, Span};

#[derive(Clone, Debug, PartialEq)]
pub(crate) enum Tok {
    /// `%x`, stored without `%`.
    Local(String),
    /// `@f`, stored without `@`.
    Global(String),
    /// A bare identifier; dotted operator names such as `nn.dense` are one token.
    Ident(String),
    /// An integer literal. The magnitude is `None` when it does not even fit in `u64`; the parser
    /// checks the range once it knows the sign and the dtype. `suffixed`: the dtype was written
    /// (`2i64`); an unsuffixed literal past int32's range is an int64, as TVM reads it.
    Int {
        mag: Option<u64>,
        dtype: DType,
        suffixed: bool,
    },
    Float {
        val: f64,
        dtype: DType,
    },
    Str(String),
    LParen,
    RParen,
    LBracket,
    RBracket,
    LBrace,
    RBrace,
    Comma,
    Semi,
    Colon,
    Dot,
    Eq,
    EqEq,
    NotEq,
    Lt,
    Gt,
    Le,
    Ge,
    Plus,
    Minus,
    Star,
    Slash,
    Arrow,
    FatArrow,
    Question,
    Underscore,
    Hash,
    /// A lexical error, already reported.
    Error,
    Eof,
}

#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Token {
    pub kind: Tok,
    pub lo: u32,
    pub hi: u32,
}

/// Offsets are stored as `u32` (as in [`Span`]); text past 4 GiB is clamped rather than wrapped.
pub(crate) fn offset(i: usize) -> u32 {
    u32::try_from(i).unwrap_or(u32::MAX)
}

/// Splits `text` into tokens ending with [`Tok::Eof`], plus the lexical errors found.
pub(crate) fn lex(text: &str, src: SourceId) -> (Vec<Token>, Vec<Diagnostic>) {
    let lx = lexed(text, src);
    (lx.toks, lx.diags)
}

/// How many comments (`// …` and `/* … */`) `text` has: what `tumble fmt`, which prints the
/// parsed module, would leave out.
pub fn comment_count(text: &str) -> usize {
    lexed(text, SourceId(0)).comments
}

fn lexed(text: &str, src: SourceId) -> Lexer<'_> {
    let mut lx = Lexer {
        text,
        bytes: text.as_bytes(),
        // A byte-order mark opening the file (editors on Windows write one) is not program text.
        pos: if text.starts_with('\u{feff}') { 3 } else { 0 },
        src,
        toks: Vec::new(),
        diags: Vec::new(),
        comments: 0,
    };
    lx.run();
    lx
}

struct Lexer<'a> {
    text: &'a str,
    bytes: &'a [u8],
    pos: usize,
    src: SourceId,
    toks: Vec<Token>,
    diags: Vec<Diagnostic>,
    comments: usize,
}

fn is_ident_start(b: u8) -> bool {
    b.is_ascii_alphabetic() || b == b'_'
}

fn is_ident_continue(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b == b'_'
}

/// Bytes that can begin some token (or whitespace, or a comment); anything else is an unknown
/// character, and a run of those is reported once.
fn starts_token(b: u8) -> bool {
    is_ident_continue(b) || b.is_ascii_whitespace() || b"%@\"()[]{},;:.=!<>+-*/?#".contains(&b)
}

impl Lexer<'_> {
    fn peek(&self, k: usize) -> u8 {
        self.bytes.get(self.pos + k).copied().unwrap_or(0)
    }

    fn span(&self, lo: usize, hi: usize) -> Span {
        Span::new(self.src, offset(lo), offset(hi))
    }

    fn push(&mut self, kind: Tok, lo: usize) {
        self.toks.push(Token {
            kind,
            lo: offset(lo),
            hi: offset(self.pos),
        });
    }

    fn error(&mut self, lo: usize, hi: usize, message: String) {
        self.diags
            .push(Diagnostic::error(self.span(lo, hi), message));
    }

    fn slice(&self, lo: usize, hi: usize) -> &str {
        self.text.get(lo..hi).unwrap_or("")
    }

    fn run(&mut self) {
        while self.pos < self.bytes.len() {
            let lo = self.pos;
            let b = self.peek(0);
            let single = |t: Tok| Some((t, 1));
            let punct = match b {
                b'(' => single(Tok::LParen),
                b')' => single(Tok::RParen),
                b'[' => single(Tok::LBracket),
                b']' => single(Tok::RBracket),
                b'{' => single(Tok::LBrace),
                b'}' => single(Tok::RBrace),
                b',' => single(Tok::Comma),
                b';' => single(Tok::Semi),
                b':' => single(Tok::Colon),
                b'.' => single(Tok::Dot),
                b'+' => single(Tok::Plus),
                b'*' => single(Tok::Star),
                b'?' => single(Tok::Question),
                b'#' => single(Tok::Hash),
                b'=' => match self.peek(1) {
                    b'=' => Some((Tok::EqEq, 2)),
                    b'>' => Some((Tok::FatArrow, 2)),
                    _ => single(Tok::Eq),
                },
                b'!' if self.peek(1) == b'=' => Some((Tok::NotEq, 2)),
                b'<' if self.peek(1) == b'=' => Some((Tok::Le, 2)),
                b'<' => single(Tok::Lt),
                b'>' if self.peek(1) == b'=' => Some((Tok::Ge, 2)),
                b'>' => single(Tok::Gt),
                b'-' if self.peek(1) == b'>' => Some((Tok::Arrow, 2)),
                b'-' => single(Tok::Minus),
                b'/' if self.peek(1) != b'/' && self.peek(1) != b'*' => single(Tok::Slash),
                _ => None,
            };
            if let Some((tok, len)) = punct {
                self.pos += len;
                self.push(tok, lo);
                continue;
            }
            match b {
                b' ' | b'\t' | b'\n' | b'\r' => self.pos += 1,
                b'/' if self.peek(1) == b'/' => {
                    self.comments += 1;
                    while self.pos < self.bytes.len() && self.peek(0) != b'\n' {
                        self.pos += 1;
                    }
                }
                b'/' => self.block_comment(),
                b'%' => self.name(Tok::Local, "%"),
                b'@' => self.name(Tok::Global, "@"),
                b'"' => self.string(),
                b'0'..=b'9' => self.number(),
                _ if is_ident_start(b) => self.ident(),
                _ => self.unknown(),
            }
        }
        self.push(Tok::Eof, self.pos);
    }

    fn unknown(&mut self) {
        let lo = self.pos;
        let c = self.text.get(lo..).and_then(|s| s.chars().next());
        let len = c.map_or(1, char::len_utf8);
        self.pos += len;
        // A run of unknown characters is one mistake, not many.
        while self.pos < self.bytes.len() && !starts_token(self.peek(0)) {
            self.pos += 1;
        }
        let message = if c == Some('\u{feff}') {
            "expected a token, found a byte-order mark (U+FEFF, invisible in most editors) inside \
             the file; delete it"
                .to_string()
        } else {
            let shown = show(&c.unwrap_or('\u{fffd}').to_string());
            format!("expected a token, found unknown character `{shown}`")
        };
        self.error(lo, lo + len, message);
        self.push(Tok::Error, lo);
    }

    fn block_comment(&mut self) {
        self.comments += 1;
        let lo = self.pos;
        self.pos += 2;
        let mut depth = 1usize;
        while depth > 0 {
            match (self.peek(0), self.peek(1)) {
                (b'*', b'/') => {
                    depth -= 1;
                    self.pos += 2;
                }
                (b'/', b'*') => {
                    depth += 1;
                    self.pos += 2;
                }
                _ if self.pos >= self.bytes.len() => {
                    self.error(
                        lo,
                        lo + 2,
                        "expected `*/` to close this block comment, found end of file".into(),
                    );
                    self.push(Tok::Error, lo);
                    return;
                }
                _ => self.pos += 1,
            }
        }
    }

    fn name(&mut self, make: fn(String) -> Tok, sigil: &str) {
        let lo = self.pos;
        self.pos += 1;
        loop {
            while is_ident_continue(self.peek(0)) {
                self.pos += 1;
            }
            // TVM's names may hold `/` (`%MobilenetV2/input`, as its frontends name variables);
            // one followed by a digit or a sigil stays a division (`%x/2f`, `%a/%b`).
            if self.peek(0) == b'/' && self.pos > lo + 1 && is_ident_start(self.peek(1)) {
                self.pos += 1;
                continue;
            }
            break;
        }
        if self.pos == lo + 1 {
            let found = describe_char(self.text, self.pos);
            self.error(
                lo,
                lo + 1,
                format!("expected a name after `{sigil}`, found {found}"),
            );
            self.push(Tok::Error, lo);
            return;
        }
        let name = self.slice(lo + 1, self.pos).to_string();
        self.push(make(name), lo);
    }

    fn ident(&mut self) {
        let lo = self.pos;
        loop {
            while is_ident_continue(self.peek(0)) {
                self.pos += 1;
            }
            // `nn.dense` is one operator name; `x.0` is a projection.
            if self.peek(0) == b'.' && is_ident_start(self.peek(1)) {
                self.pos += 1;
                continue;
            }
            break;
        }
        let s = self.slice(lo, self.pos);
        let tok = if s == "_" {
            Tok::Underscore
        } else if s == "inff" {
            // TVM's spelling of a float32 infinity (its printer writes `clip(%x, a_min=-inff,
            // a_max=inff)`).
            Tok::Float {
                val: f64::INFINITY,
                dtype: DType::Float32,
            }
        } else {
            Tok::Ident(s.to_string())
        };
        self.push(tok, lo);
    }

    fn digits(&mut self) {
        while self.peek(0).is_ascii_digit() {
            self.pos += 1;
        }
    }

    fn number(&mut self) {
        let lo = self.pos;
        self.digits();
        // Right after `.` a number is a tuple index: `%x.0.1` is two projections, not `%x` `.` `0.1`.
        let after_dot = matches!(self.toks.last(), Some(t) if t.kind == Tok::Dot);
        if after_dot {
            let mag = parse_u64(self.slice(lo, self.pos));
            self.push(
                Tok::Int {
                    mag,
                    dtype: DType::Int32,
                    suffixed: false,
                },
                lo,
            );
            return;
        }
        let mut is_float = false;
        if self.peek(0) == b'.' && self.peek(1).is_ascii_digit() {
            self.pos += 1;
            self.digits();
            is_float = true;
        }
        let sign = matches!(self.peek(1), b'+' | b'-');
        let exp_digit = if sign { self.peek(2) } else { self.peek(1) };
        if matches!(self.peek(0), b'e' | b'E') && exp_digit.is_ascii_digit() {
            self.pos += if sign { 2 } else { 1 };
            self.digits();
            is_float = true;
        }
        let num_end = self.pos;
        while is_ident_continue(self.peek(0)) {
            self.pos += 1;
        }
        let numeral = self.slice(lo, num_end).to_string();
        let suffix = self.slice(num_end, self.pos).to_string();
        let dtype = match suffix.as_str() {
            "" if is_float => DType::Float32,
            // (`i` alone: TVM's parser reads `42i` as an int32.)
            "" | "i" | "i32" => DType::Int32,
            "i64" => DType::Int64,
            "f" | "f32" => DType::Float32,
            "f64" => DType::Float64,
            _ => {
                self.error(
                    num_end,
                    self.pos,
                    format!(
                        "expected a literal suffix (`i32`, `i64`, `f`, `f32` or `f64`), found `{suffix}`"
                    ),
                );
                self.push(Tok::Error, lo);
                return;
            }
        };
        if is_float && dtype.is_int() {
            self.error(
                num_end,
                self.pos,
                format!("expected a float suffix (`f`, `f32` or `f64`), found `{suffix}`"),
            );
            self.push(Tok::Error, lo);
            return;
        }
        if dtype.is_float() {
            let val = numeral.parse::<f64>().unwrap_or(f64::INFINITY);
            // (A float32 literal past f32's range is refused by the parser: an attribute's
            // unsuffixed float is a float64.)
            if !val.is_finite() {
                self.error(
                    lo,
                    self.pos,
                    format!("expected a finite float literal, found `{numeral}`"),
                );
                self.push(Tok::Error, lo);
                return;
            }
            self.push(Tok::Float { val, dtype }, lo);
        } else {
            let mag = parse_u64(&numeral);
            let suffixed = !suffix.is_empty();
            self.push(
                Tok::Int {
                    mag,
                    dtype,
                    suffixed,
                },
                lo,
            );
        }
    }

    fn string(&mut self) {
        let lo = self.pos;
        self.pos += 1;
        let mut s = String::new();
        loop {
            let Some(c) = self.text.get(self.pos..).and_then(|r| r.chars().next()) else {
                return self.unterminated(lo, "end of file");
            };
            match c {
                '"' => {
                    self.pos += 1;
                    self.push(Tok::Str(s), lo);
                    return;
                }
                '\n' => return self.unterminated(lo, "end of line"),
                '\\' => {
                    let esc_lo = self.pos;
                    self.pos += 1;
                    match self.escape() {
                        Some(e) => s.push(e),
                        None => {
                            let shown = show(self.slice(esc_lo, self.pos.max(esc_lo + 1)));
                            self.error(
                                esc_lo,
                                self.pos.max(esc_lo + 1),
                                format!(
                                    "expected an escape (`\\n`, `\\t`, `\\r`, `\\0`, `\\\\`, `\\\"` or `\\u{{...}}`), found `{shown}`"
                                ),
                            );
                            self.skip_string_rest();
                            self.push(Tok::Error, lo);
                            return;
                        }
                    }
                }
                _ => {
                    self.pos += c.len_utf8();
                    s.push(c);
                }
            }
        }
    }

    /// After a bad escape, skips to the closing quote (or the end of the line) so that the rest of
    /// the string is not lexed as code.
    fn skip_string_rest(&mut self) {
        while self.pos < self.bytes.len() {
            match self.peek(0) {
                b'"' => {
                    self.pos += 1;
                    return;
                }
                b'\n' => return,
                b'\\' => self.pos += 2,
                _ => self.pos += 1,
            }
        }
        self.pos = self.pos.min(self.bytes.len());
    }

    /// Reads the escape after a backslash; `None` (having consumed what it looked at) if invalid.
    fn escape(&mut self) -> Option<char> {
        let c = self.text.get(self.pos..)?.chars().next()?;
        self.pos += c.len_utf8();
        match c {
            'n' => Some('\n'),
            't' => Some('\t'),
            'r' => Some('\r'),
            '0' => Some('\0'),
            '\\' => Some('\\'),
            '"' => Some('"'),
            '\'' => Some('\''),
            'u' => {
                if self.peek(0) != b'{' {
                    return None;
                }
                self.pos += 1;
                let start = self.pos;
                while self.peek(0).is_ascii_hexdigit() && self.pos - start < 6 {
                    self.pos += 1;
                }
                let hex = self.slice(start, self.pos).to_string();
                if self.peek(0) != b'}' {
                    return None;
                }
                self.pos += 1;
                u32::from_str_radix(&hex, 16).ok().and_then(char::from_u32)
            }
            _ => None,
        }
    }

    fn unterminated(&mut self, lo: usize, found: &str) {
        self.error(
            lo,
            lo + 1,
            format!("expected `\"` to close this string, found {found}"),
        );
        self.push(Tok::Error, lo);
    }
}

fn parse_u64(digits: &str) -> Option<u64> {
    digits.bytes().try_fold(0u64, |acc, b| {
        acc.checked_mul(10)?
            .checked_add(u64::from(b.wrapping_sub(b'0')))
    })
}

/// Source text for a message: as written, except that control characters are escaped.
fn show(s: &str) -> String {
    s.chars()
        .map(|c| {
            if c.is_control() {
                c.escape_debug().to_string()
            } else {
                c.to_string()
            }
        })
        .collect()
}

fn describe_char(text: &str, pos: usize) -> String {
    match text.get(pos..).and_then(|s| s.chars().next()) {
        None => "end of file".into(),
        Some(c) if c.is_whitespace() => "whitespace".into(),
        Some(c) => format!("`{}`", show(&c.to_string())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kinds(text: &str) -> Vec<Tok> {
        let (toks, diags) = lex(text, SourceId(0));
        assert!(diags.is_empty(), "{diags:?}");
        toks.into_iter().map(|t| t.kind).collect()
    }

    fn int(n: u64) -> Tok {
        Tok::Int {
            mag: Some(n),
            dtype: DType::Int32,
            suffixed: false,
        }
    }

    #[test]
    fn projection_chain_is_not_a_float() {
        assert_eq!(
            kinds("%x.0.1"),
            vec![
                Tok::Local("x".into()),
                Tok::Dot,
                int(0),
                Tok::Dot,
                int(1),
                Tok::Eof
            ]
        );
    }

    #[test]
    fn dotted_operator_names_are_one_token() {
        assert_eq!(
            kinds("nn.dense random.db_uniform"),
            vec![
                Tok::Ident("nn.dense".into()),
                Tok::Ident("random.db_uniform".into()),
                Tok::Eof
            ]
        );
    }

    #[test]
    fn number_suffixes_pick_the_dtype() {
        let f = |val, dtype| Tok::Float { val, dtype };
        assert_eq!(
            kinds("1 1i64 2.5 1e-5 1.5e3 1f 1f32 0f 2.5f64 42i"),
            vec![
                int(1),
                Tok::Int {
                    mag: Some(1),
                    dtype: DType::Int64,
                    suffixed: true
                },
                f(2.5, DType::Float32),
                f(1e-5, DType::Float32),
                f(1.5e3, DType::Float32),
                f(1.0, DType::Float32),
                f(1.0, DType::Float32),
                f(0.0, DType::Float32),
                f(2.5, DType::Float64),
                // TVM's `42i`: an int32.
                Tok::Int {
                    mag: Some(42),
                    dtype: DType::Int32,
                    suffixed: true
                },
                Tok::Eof
            ]
        );
    }

    #[test]
    fn huge_integers_keep_no_magnitude() {
        assert_eq!(
            kinds("99999999999999999999"),
            vec![
                Tok::Int {
                    mag: None,
                    dtype: DType::Int32,
                    suffixed: false
                },
                Tok::Eof
            ]
        );
    }

    #[test]
    fn comments_nest_and_vanish() {
        assert_eq!(
            kinds("a // x\n/* b /* c */ d */ e"),
            vec![Tok::Ident("a".into()), Tok::Ident("e".into()), Tok::Eof]
        );
    }

    /// What `tumble fmt` warns it leaves out: line and block comments, a nested one counted
    /// with its outer one; `/` and strings holding `//` are not comments.
    #[test]
    fn comments_are_counted() {
        assert_eq!(comment_count("a // x\n/* b /* c */ d */ e // y"), 3);
        assert_eq!(comment_count("f(a / b, mode=\"//x\")"), 0);
    }

    #[test]
    fn operators_take_the_longest_match() {
        assert_eq!(
            kinds("== != <= >= -> => = < > - /"),
            vec![
                Tok::EqEq,
                Tok::NotEq,
                Tok::Le,
                Tok::Ge,
                Tok::Arrow,
                Tok::FatArrow,
                Tok::Eq,
                Tok::Lt,
                Tok::Gt,
                Tok::Minus,
                Tok::Slash,
                Tok::Eof
            ]
        );
    }

    #[test]
    fn string_escapes_decode() {
        assert_eq!(
            kinds(r#""a\"b\\c\n\u{41}""#),
            vec![Tok::Str("a\"b\\c\nA".into()), Tok::Eof]
        );
    }

    #[test]
    fn a_run_of_unknown_characters_is_one_error() {
        let (toks, diags) = lex("$$$ x", SourceId(0));
        assert_eq!(diags.len(), 1);
        assert_eq!(toks.first().map(|t| &t.kind), Some(&Tok::Error));
    }

    #[test]
    fn spans_are_byte_offsets() {
        let (toks, _) = lex("  %ab ", SourceId(0));
        assert_eq!(toks.first().map(|t| (t.lo, t.hi)), Some((2, 5)));
    }
}
