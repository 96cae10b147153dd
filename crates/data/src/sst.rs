//! The Stanford Sentiment Treebank: PTB trees, the SST vocabulary, and tree → instance conversions.
//!
//! # Trees
//!
//! SST files hold one tree per line in PTB bracket form, every node labelled with a sentiment
//! class 0–4 and a word at each leaf: `(3 (2 (2 The) (2 Rock)) (4 (3 (2 is) (2 destined)) (2 .)))`.
//! [`parse_tree`] parses one tree (newlines inside it are whitespace), [`Trees`] a whole file,
//! one tree per line (blank lines are skipped). The grammar is
//!
//! ```text
//! tree  := "(" label ( word | tree+ ) ")"
//! label := an integer 0..=4
//! word  := one or more characters other than "(", ")" and ASCII whitespace
//! ```
//!
//! Only ASCII whitespace separates tokens, so SST's `8 1\/2` (written with a no-break space,
//! U+00A0) is one word. The parser is iterative (an explicit stack, no recursion), so any depth
//! parses; malformed input is a [`ParseError`] with the line and column of the offending
//! character, never a panic. A parsed [`Tree`] is an arena of [`Node`]s in preorder, so walking,
//! cloning and dropping it never recurse either.
//!
//! # Vocabulary
//!
//! [`Vocab`] maps words to the ids the zoo's embedding tables are indexed by: id 0 is `<none>`
//! (internal tree nodes, padding), id 1 `<unk>` (a word not in the vocabulary), ids 2.. the
//! distinct words, by frequency (descending) then by word (byte order). Built from SST train +
//! dev + test it has [`SST_VOCAB_SIZE`] = 21,703 entries (21,701 words). It is saved as
//! `vocab.txt`, one word per line in id order (`<none>` and `<unk>` first).
//!
//! # Instances
//!
//! - tree models (TreeLSTM, MV-RNN): [`tree_instance`] → `{"tree": T}`, where a leaf is
//!   `{"Rose": [[id], []]}` and an internal node `{"Rose": [[0], [left, right]]}`;
//! - sequence models (BiRNN, StackRNN): [`tokens_instance`] → `{"tokens": [[id], [id], ...]}`,
//!   the sentence's words left to right.

use std::collections::HashMap;
use std::fmt::Write as _;
use std::path::Path;

use crate::error::{DataError, ParseError};

/// Id of `<none>`: internal tree nodes (their id is ignored by the models) and padding.
pub const NONE_ID: u32 = 0;
/// Id of `<unk>`: a word the vocabulary does not have.
pub const UNK_ID: u32 = 1;
/// The word written for [`NONE_ID`] in `vocab.txt`.
pub const NONE_WORD: &str = "<none>";
/// The word written for [`UNK_ID`] in `vocab.txt`.
pub const UNK_WORD: &str = "<unk>";
/// Entries of the vocabulary of SST train + dev + test: `<none>`, `<unk>` and 21,701 words. The
/// zoo's embedding tables (`%emb`) have this many rows.
pub const SST_VOCAB_SIZE: usize = 21_703;
/// The three SST split files, in the order the vocabulary reads them.
pub const SST_SPLITS: [&str; 3] = ["train", "dev", "test"];
/// Largest sentiment label.
pub const MAX_LABEL: u8 = 4;

/// One node of a [`Tree`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Node {
    /// Sentiment class, 0 (very negative) to 4 (very positive).
    pub label: u8,
    /// The word of a leaf; `None` for an internal node.
    pub word: Option<String>,
    /// Indices (into [`Tree::nodes`]) of the children, left to right; empty for a leaf.
    pub children: Vec<usize>,
}

impl Node {
    /// Whether this node is a leaf (has a word and no children).
    pub fn is_leaf(&self) -> bool {
        self.word.is_some()
    }
}

/// A parsed tree: its nodes in preorder, the root first. Every node has either a word (a leaf)
/// or at least one child.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Tree {
    nodes: Vec<Node>,
}

impl Tree {
    /// The root node.
    pub fn root(&self) -> &Node {
        &self.nodes[0]
    }

    /// All nodes in preorder; index 0 is the root, [`Node::children`] index into this slice.
    pub fn nodes(&self) -> &[Node] {
        &self.nodes
    }

    /// Number of nodes (leaves included); at least 1.
    pub fn len(&self) -> usize {
        self.nodes.len()
    }

    /// Always false: a tree has a root.
    pub fn is_empty(&self) -> bool {
        self.nodes.is_empty()
    }

    /// The sentence: the leaves' words, left to right.
    pub fn words(&self) -> impl Iterator<Item = &str> + '_ {
        // Preorder visits the leaves left to right.
        self.nodes.iter().filter_map(|n| n.word.as_deref())
    }

    /// Depth: 1 for a single leaf.
    pub fn depth(&self) -> usize {
        let mut depth = vec![0usize; self.nodes.len()];
        let mut max = 0;
        depth[0] = 1;
        // Parents precede their children in preorder.
        for (i, node) in self.nodes.iter().enumerate() {
            max = max.max(depth[i]);
            for &c in &node.children {
                depth[c] = depth[i] + 1;
            }
        }
        max
    }

    /// Whether every internal node has exactly two children (SST trees are binary).
    pub fn is_binary(&self) -> bool {
        self.nodes
            .iter()
            .all(|n| n.is_leaf() || n.children.len() == 2)
    }
}

// ---------------------------------------------------------------------------------------------
// Parsing

#[derive(Clone, Debug, PartialEq, Eq)]
enum Tok {
    Open,
    Close,
    Atom(String),
    End,
}

impl Lexer<'_> {
    fn describe(&self, tok: &Tok) -> String {
        match tok {
            Tok::Open => "\"(\"".to_string(),
            Tok::Close => "\")\"".to_string(),
            Tok::Atom(a) => format!("{a:?}"),
            Tok::End => format!("the end of the {}", self.unit),
        }
    }
}

/// A tokenizer that tracks 1-based line and column (in characters).
struct Lexer<'a> {
    rest: std::iter::Peekable<std::str::Chars<'a>>,
    line: usize,
    column: usize,
    /// What the text is, for messages: "input" or "line".
    unit: &'static str,
}

impl<'a> Lexer<'a> {
    fn new(text: &'a str, first_line: usize, unit: &'static str) -> Lexer<'a> {
        Lexer {
            rest: text.chars().peekable(),
            line: first_line,
            column: 1,
            unit,
        }
    }

    fn bump(&mut self) -> Option<char> {
        let c = self.rest.next()?;
        if c == '\n' {
            self.line += 1;
            self.column = 1;
        } else {
            self.column += 1;
        }
        Some(c)
    }

    fn skip_space(&mut self) {
        while self.rest.peek().is_some_and(|c| c.is_ascii_whitespace()) {
            self.bump();
        }
    }

    /// The next token and the (line, column) where it starts.
    fn next(&mut self) -> (Tok, usize, usize) {
        self.skip_space();
        let (line, column) = (self.line, self.column);
        let tok = match self.rest.peek() {
            None => Tok::End,
            Some('(') => {
                self.bump();
                Tok::Open
            }
            Some(')') => {
                self.bump();
                Tok::Close
            }
            Some(_) => {
                let mut atom = String::new();
                while let Some(&c) = self.rest.peek() {
                    if c == '(' || c == ')' || c.is_ascii_whitespace() {
                        break;
                    }
                    atom.push(c);
                    self.bump();
                }
                Tok::Atom(atom)
            }
        };
        (tok, line, column)
    }

    fn at_end(&mut self) -> bool {
        self.skip_space();
        self.rest.peek().is_none()
    }
}

fn err(line: usize, column: usize, message: String) -> ParseError {
    ParseError {
        line,
        column,
        message,
    }
}

/// Parses one tree whose "(" has not been read yet. `Ok(None)` at the end of the input.
fn parse_next(lex: &mut Lexer<'_>) -> Result<Option<Tree>, ParseError> {
    let (tok, line, column) = lex.next();
    match tok {
        Tok::End => return Ok(None),
        Tok::Open => {}
        other => {
            return Err(err(
                line,
                column,
                format!(
                    "expected \"(\" to start a tree, found {}",
                    lex.describe(&other)
                ),
            ))
        }
    }
    let mut nodes: Vec<Node> = Vec::new();
    // Open internal nodes, innermost last, with the position of their "(" for messages.
    let mut open: Vec<(usize, usize, usize)> = Vec::new();
    let (mut open_line, mut open_column) = (line, column);
    loop {
        // A "(" has just been read: label, then a word or the first subtree.
        let (tok, line, column) = lex.next();
        let label = match tok {
            Tok::Atom(a) => match a.parse::<u8>() {
                Ok(l) if l <= MAX_LABEL && a.bytes().all(|b| b.is_ascii_digit()) => l,
                _ => {
                    return Err(err(
                        line,
                        column,
                        format!("expected a sentiment label 0-{MAX_LABEL}, found {a:?}"),
                    ))
                }
            },
            other => {
                return Err(err(
                    line,
                    column,
                    format!(
                        "expected a sentiment label 0-{MAX_LABEL} after \"(\", found {}",
                        lex.describe(&other)
                    ),
                ))
            }
        };
        let index = nodes.len();
        if let Some(&(parent, _, _)) = open.last() {
            nodes[parent].children.push(index);
        }
        nodes.push(Node {
            label,
            word: None,
            children: Vec::new(),
        });
        let (tok, line, column) = lex.next();
        match tok {
            Tok::Atom(word) => {
                let (tok, line, column) = lex.next();
                if tok != Tok::Close {
                    return Err(err(
                        line,
                        column,
                        format!(
                            "expected \")\" after the word {word:?}, found {} (a leaf holds one word)",
                            lex.describe(&tok)
                        ),
                    ));
                }
                nodes[index].word = Some(word);
            }
            Tok::Open => {
                open.push((index, open_line, open_column));
                (open_line, open_column) = (line, column);
                continue;
            }
            Tok::Close => {
                return Err(err(
                    line,
                    column,
                    "empty node: expected a word or a subtree after the label".to_string(),
                ))
            }
            Tok::End => {
                return Err(err(
                    line,
                    column,
                    format!(
                        "unexpected end of the {}: the tree opened at line {open_line}, column \
                         {open_column} is not closed",
                        lex.unit
                    ),
                ))
            }
        }
        // A node has been closed: continue with its parent (or finish).
        loop {
            let Some(&(_, parent_line, parent_column)) = open.last() else {
                return Ok(Some(Tree { nodes }));
            };
            let (tok, line, column) = lex.next();
            match tok {
                Tok::Close => {
                    open.pop();
                }
                Tok::Open => {
                    (open_line, open_column) = (line, column);
                    break;
                }
                Tok::Atom(a) => {
                    return Err(err(
                        line,
                        column,
                        format!(
                            "expected \"(\" or \")\", found the word {a:?} (a node has either \
                             one word or subtrees)"
                        ),
                    ))
                }
                Tok::End => {
                    return Err(err(
                        line,
                        column,
                        format!(
                            "unexpected end of the {}: the node opened at line {parent_line}, \
                             column {parent_column} is not closed",
                            lex.unit
                        ),
                    ))
                }
            }
        }
    }
}

/// Parses exactly one tree (surrounding whitespace allowed). Line numbers in errors start at 1.
///
/// ```
/// let t = tumble_data::sst::parse_tree("(3 (2 (2 The) (2 Rock)) (2 .))").unwrap();
/// assert_eq!(t.words().collect::<Vec<_>>(), ["The", "Rock", "."]);
/// assert_eq!(t.root().label, 3);
/// assert!(tumble_data::sst::parse_tree("(3 (2 The)").is_err());
/// ```
pub fn parse_tree(text: &str) -> Result<Tree, ParseError> {
    parse_one(text, 1, "input")
}

/// Parses exactly one tree from `text`, whose first line is line `first_line`.
fn parse_one(text: &str, first_line: usize, unit: &'static str) -> Result<Tree, ParseError> {
    let mut lex = Lexer::new(text, first_line, unit);
    match parse_next(&mut lex)? {
        None => Err(err(
            lex.line,
            lex.column,
            "expected a tree, found nothing".to_string(),
        )),
        Some(tree) => {
            if lex.at_end() {
                Ok(tree)
            } else {
                let (tok, line, column) = lex.next();
                Err(err(
                    line,
                    column,
                    format!("unexpected {} after the tree", lex.describe(&tok)),
                ))
            }
        }
    }
}

/// The trees of a file, one per line (blank lines skipped), parsed lazily in order; errors
/// carry the file's line numbers. After an error the iterator ends.
///
/// ```
/// let trees: Vec<_> = tumble_data::sst::Trees::new("(2 a)\n\n(4 (3 b) (2 c))\n").collect();
/// assert_eq!(trees.len(), 2);
/// ```
pub struct Trees<'a> {
    lines: std::iter::Enumerate<std::str::Lines<'a>>,
    done: bool,
}

impl<'a> Trees<'a> {
    /// Trees of `text`, one per line.
    pub fn new(text: &'a str) -> Trees<'a> {
        Trees {
            lines: text.lines().enumerate(),
            done: false,
        }
    }
}

impl Iterator for Trees<'_> {
    type Item = Result<Tree, ParseError>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.done {
            return None;
        }
        for (i, line) in self.lines.by_ref() {
            if line.bytes().all(|b| b.is_ascii_whitespace()) {
                continue;
            }
            let result = parse_one(line, i + 1, "line");
            self.done = result.is_err();
            return Some(result);
        }
        self.done = true;
        None
    }
}

/// Parses every tree of `text`.
pub fn parse_trees(text: &str) -> Result<Vec<Tree>, ParseError> {
    Trees::new(text).collect()
}

/// Reads a file as UTF-8 text.
pub fn read_text(path: &Path) -> Result<String, DataError> {
    std::fs::read_to_string(path).map_err(|e| DataError::io(path, "read", e))
}

/// Reads and parses every tree of an SST file; errors name the file.
pub fn read_trees(path: &Path) -> Result<Vec<Tree>, DataError> {
    let text = read_text(path)?;
    parse_trees(&text).map_err(|e| DataError::parse(path, e))
}

/// The sentences of the released SST split `split` (train, dev, test), for messages.
pub fn split_sentences(split: &str) -> Option<usize> {
    match split {
        "train" => Some(8_544),
        "dev" => Some(1_101),
        "test" => Some(2_210),
        _ => None,
    }
}

/// The file of split `split` ("train", "dev" or "test") in an SST directory.
pub fn split_path(dir: &Path, split: &str) -> std::path::PathBuf {
    dir.join(format!("{split}.txt"))
}

// ---------------------------------------------------------------------------------------------
// Vocabulary

/// A word ↔ id table: `<none>` = 0, `<unk>` = 1, then words by descending frequency, ties by
/// word in byte order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Vocab {
    words: Vec<String>,
    ids: HashMap<String, u32>,
}

impl Vocab {
    fn from_words(words: Vec<String>) -> Vocab {
        let ids = words
            .iter()
            .enumerate()
            .map(|(i, w)| (w.clone(), i as u32))
            .collect();
        Vocab { words, ids }
    }

    /// A vocabulary from word counts: most frequent first, ties broken by the word's bytes.
    /// Entries spelled `<none>` or `<unk>` are dropped (they would collide with the specials).
    pub fn from_counts(counts: &HashMap<String, u64>) -> Vocab {
        let mut entries: Vec<(&String, u64)> = counts
            .iter()
            .filter(|(w, _)| w.as_str() != NONE_WORD && w.as_str() != UNK_WORD)
            .map(|(w, &c)| (w, c))
            .collect();
        entries.sort_by(|a, b| {
            b.1.cmp(&a.1)
                .then_with(|| a.0.as_bytes().cmp(b.0.as_bytes()))
        });
        let mut words = Vec::with_capacity(entries.len() + 2);
        words.push(NONE_WORD.to_string());
        words.push(UNK_WORD.to_string());
        words.extend(entries.into_iter().map(|(w, _)| w.clone()));
        Vocab::from_words(words)
    }

    /// A vocabulary of every leaf word of `trees`.
    pub fn from_trees<'t>(trees: impl IntoIterator<Item = &'t Tree>) -> Vocab {
        let mut counts: HashMap<String, u64> = HashMap::new();
        for tree in trees {
            for w in tree.words() {
                *counts.entry(w.to_string()).or_insert(0) += 1;
            }
        }
        Vocab::from_counts(&counts)
    }

    /// The SST vocabulary: every word of `train.txt`, `dev.txt` and `test.txt` in `dir`
    /// ([`SST_VOCAB_SIZE`] entries for the standard SST files).
    pub fn from_sst_dir(dir: &Path) -> Result<Vocab, DataError> {
        let mut trees = Vec::new();
        for split in SST_SPLITS {
            trees.extend(read_trees(&split_path(dir, split))?);
        }
        Ok(Vocab::from_trees(&trees))
    }

    /// The id of `word`, [`UNK_ID`] when it is not in the vocabulary.
    pub fn id(&self, word: &str) -> u32 {
        self.get(word).unwrap_or(UNK_ID)
    }

    /// The id of `word`, if the vocabulary has it.
    pub fn get(&self, word: &str) -> Option<u32> {
        self.ids.get(word).copied()
    }

    /// The word of `id`, if in range.
    pub fn word(&self, id: u32) -> Option<&str> {
        self.words.get(id as usize).map(String::as_str)
    }

    /// Number of entries, `<none>` and `<unk>` included.
    pub fn len(&self) -> usize {
        self.words.len()
    }

    /// Always false: `<none>` and `<unk>` are always there.
    pub fn is_empty(&self) -> bool {
        self.words.is_empty()
    }

    /// All entries in id order.
    pub fn words(&self) -> &[String] {
        &self.words
    }

    /// The `vocab.txt` text: one word per line in id order, each line ending in `\n`.
    pub fn to_text(&self) -> String {
        let mut s = String::with_capacity(self.words.iter().map(|w| w.len() + 1).sum());
        for w in &self.words {
            s.push_str(w);
            s.push('\n');
        }
        s
    }

    /// Parses `vocab.txt` text: one word per line in id order, `<none>` and `<unk>` first (a
    /// `\r\n` line end is accepted). Empty lines, words with ASCII whitespace or parentheses,
    /// and repeated words are errors naming the line.
    pub fn from_text(text: &str) -> Result<Vocab, ParseError> {
        let mut words: Vec<String> = Vec::new();
        let mut seen: HashMap<&str, usize> = HashMap::new();
        for (i, word) in text.lines().enumerate() {
            let line = i + 1;
            let expected = match i {
                0 => Some(NONE_WORD),
                1 => Some(UNK_WORD),
                _ => None,
            };
            if let Some(exp) = expected {
                if word != exp {
                    return Err(err(
                        line,
                        1,
                        format!("expected {exp:?} on line {line} of a vocabulary, found {word:?}"),
                    ));
                }
            }
            if word.is_empty() {
                return Err(err(line, 1, "empty line in a vocabulary".to_string()));
            }
            if let Some((col, c)) = word
                .chars()
                .enumerate()
                .find(|(_, c)| c.is_ascii_whitespace() || *c == '(' || *c == ')')
            {
                return Err(err(
                    line,
                    col + 1,
                    format!("a vocabulary word cannot contain {c:?}"),
                ));
            }
            if let Some(first) = seen.insert(word, line) {
                return Err(err(
                    line,
                    1,
                    format!("the word {word:?} is repeated (first on line {first})"),
                ));
            }
            words.push(word.to_string());
        }
        if words.len() < 2 {
            return Err(err(
                words.len() + 1,
                1,
                format!("a vocabulary starts with {NONE_WORD:?} and {UNK_WORD:?}"),
            ));
        }
        Ok(Vocab::from_words(words))
    }

    /// Reads a `vocab.txt` file.
    pub fn read(path: &Path) -> Result<Vocab, DataError> {
        let text = read_text(path)?;
        Vocab::from_text(&text).map_err(|e| DataError::parse(path, e))
    }

    /// Writes a `vocab.txt` file atomically (temp file + rename).
    pub fn write(&self, path: &Path) -> Result<(), DataError> {
        crate::output::write_atomically(path, |w| {
            for word in &self.words {
                w.write_all(word.as_bytes())?;
                w.write_all(b"\n")?;
            }
            Ok(())
        })
    }
}

// ---------------------------------------------------------------------------------------------
// Instances

/// The token id of every leaf, left to right.
pub fn token_ids(tree: &Tree, vocab: &Vocab) -> Vec<u32> {
    tree.words().map(|w| vocab.id(w)).collect()
}

/// The zoo's JSON for a tree (`Tree[Tensor[(1), int32]]`): a leaf is `{"Rose": [[id], []]}`,
/// an internal node `{"Rose": [[0], [child, ...]]}`. Built iteratively (any depth).
///
/// ```
/// use tumble_data::sst::{parse_tree, tree_json, Vocab};
/// let t = parse_tree("(3 (2 good) (2 .))").unwrap();
/// let v = Vocab::from_trees([&t]);
/// assert_eq!(
///     tree_json(&t, &v),
///     r#"{"Rose": [[0], [{"Rose": [[3], []]}, {"Rose": [[2], []]}]]}"#
/// );
/// ```
pub fn tree_json(tree: &Tree, vocab: &Vocab) -> String {
    let nodes = tree.nodes();
    let mut out = String::new();
    // Opens node i; true when it has children still to write.
    let open = |out: &mut String, i: usize| -> bool {
        let node = &nodes[i];
        let id = node.word.as_deref().map_or(NONE_ID, |w| vocab.id(w));
        let _ = write!(out, "{{\"Rose\": [[{id}], [");
        if node.children.is_empty() {
            out.push_str("]]}");
            false
        } else {
            true
        }
    };
    // (node, index of the next child to write)
    let mut stack: Vec<(usize, usize)> = Vec::new();
    if open(&mut out, 0) {
        stack.push((0, 0));
    }
    while let Some(top) = stack.last_mut() {
        let (i, k) = *top;
        let children = &nodes[i].children;
        if k == children.len() {
            out.push_str("]]}");
            stack.pop();
            continue;
        }
        top.1 += 1;
        if k > 0 {
            out.push_str(", ");
        }
        let child = children[k];
        if open(&mut out, child) {
            stack.push((child, 0));
        }
    }
    out
}

/// A TreeLSTM / MV-RNN instance: `{"tree": ...}` (see [`tree_json`]).
pub fn tree_instance(tree: &Tree, vocab: &Vocab) -> String {
    format!("{{\"tree\": {}}}", tree_json(tree, vocab))
}

/// A BiRNN / StackRNN instance: `{"tokens": [[id], [id], ...]}`, the words left to right.
pub fn tokens_instance(tree: &Tree, vocab: &Vocab) -> String {
    tokens_json(&token_ids(tree, vocab))
}

/// `{"tokens": [[id], ...], "positions": [[0], [1], ...]}`: the sentence's tokens and their
/// positions (for models with position embeddings).
pub fn tokens_with_positions(tree: &Tree, vocab: &Vocab) -> String {
    let ids = token_ids(tree, vocab);
    let mut out = String::from("{\"tokens\": ");
    crate::gen::push_id_list(&mut out, &ids);
    out.push_str(", \"positions\": ");
    let positions: Vec<u32> = (0..ids.len() as u32).collect();
    crate::gen::push_id_list(&mut out, &positions);
    out.push('}');
    out
}

/// `{"tokens": [[id], ...]}` for a list of ids.
pub fn tokens_json(ids: &[u32]) -> String {
    let mut out = String::from("{\"tokens\": ");
    crate::gen::push_id_list(&mut out, ids);
    out.push('}');
    out
}
