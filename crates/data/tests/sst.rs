//! PTB parsing, the vocabulary and the tree → instance encodings.

use std::collections::HashMap;
use std::path::PathBuf;

use serde_json::{json, Value};
use tumble_data::cli::find_sst_dir;
use tumble_data::sst::{
    parse_tree, parse_trees, token_ids, tokens_instance, tree_instance, tree_json, Tree, Trees,
    Vocab, NONE_ID, SST_VOCAB_SIZE, UNK_ID,
};
use tumble_data::ParseError;

fn parse_err(text: &str) -> ParseError {
    match parse_tree(text) {
        Ok(t) => panic!("{text:?} parsed: {t:?}"),
        Err(e) => e,
    }
}

fn at(e: &ParseError) -> (usize, usize) {
    (e.line, e.column)
}

#[test]
fn parses_a_tree() {
    let t = parse_tree("(3 (2 (2 The) (2 Rock)) (4 (3 (2 is) (2 destined)) (2 .)))").unwrap();
    assert_eq!(
        t.words().collect::<Vec<_>>(),
        ["The", "Rock", "is", "destined", "."]
    );
    assert_eq!(t.root().label, 3);
    assert_eq!(t.len(), 9);
    assert_eq!(t.depth(), 4);
    assert!(t.is_binary());
    assert!(!t.is_empty());
    // Preorder: root, (2 The Rock), The, Rock, ...
    let labels: Vec<u8> = t.nodes().iter().map(|n| n.label).collect();
    assert_eq!(labels, [3, 2, 2, 2, 4, 3, 2, 2, 2]);
    assert_eq!(t.root().children, [1, 4]);
    assert!(t.nodes()[2].is_leaf());
    // A single leaf is a tree too; whitespace (newlines included) is free.
    let leaf = parse_tree("  \n(2 word)\n").unwrap();
    assert_eq!(leaf.len(), 1);
    assert_eq!(leaf.root().word.as_deref(), Some("word"));
    let spread = parse_tree("(1\n  (2 a)\n  (0 b))").unwrap();
    assert_eq!(spread.words().collect::<Vec<_>>(), ["a", "b"]);
    // Any number of children.
    let wide = parse_tree("(2 (2 a) (2 b) (2 c))").unwrap();
    assert!(!wide.is_binary());
    assert_eq!(wide.root().children.len(), 3);
}

#[test]
fn words_are_whole_tokens() {
    // SST's "8 1/2" is written with a no-break space; only ASCII whitespace separates tokens.
    let t = parse_tree("(3 (2 8\u{a0}1\\/2) (2 rocks))").unwrap();
    assert_eq!(t.words().collect::<Vec<_>>(), ["8\u{a0}1\\/2", "rocks"]);
    // Words may look like labels or contain anything but parentheses and whitespace.
    let t = parse_tree("(2 (2 2002) (2 -LRB-) (2 n't) (2 \"quoted\"))").unwrap();
    assert_eq!(
        t.words().collect::<Vec<_>>(),
        ["2002", "-LRB-", "n't", "\"quoted\""]
    );
}

#[test]
fn parses_many_trees() {
    let text = "(2 a)\n\n(4 (3 b) (2 c))\r\n   (1 (0 d) (1 e))";
    let trees = parse_trees(text).unwrap();
    assert_eq!(trees.len(), 3);
    assert_eq!(trees[2].root().label, 1);
    assert!(parse_trees("").unwrap().is_empty());
    assert!(parse_trees(" \n\t").unwrap().is_empty());
    // The iterator stops after an error, which names the line.
    let items: Vec<_> = Trees::new("(2 a)\n(2 b\n(2 c)").collect();
    assert_eq!(items.len(), 2);
    assert!(items[0].is_ok());
    let e = items[1].as_ref().unwrap_err();
    assert_eq!(at(e), (2, 5), "{e}");
    assert!(e.message.contains("found the end of the line"), "{e}");
    // A tree per line: the next line does not continue it.
    let e = parse_trees("(2 a)\n(2\n(2 b))").unwrap_err();
    assert_eq!(at(&e), (2, 3), "{e}");
    assert!(
        e.message
            .contains("end of the line: the tree opened at line 2, column 1"),
        "{e}"
    );
    let e = parse_trees("(2 a) (2 b)").unwrap_err();
    assert_eq!(at(&e), (1, 7), "{e}");
}

#[test]
fn malformed_trees_are_located_errors() {
    let cases: &[(&str, (usize, usize), &str)] = &[
        ("", (1, 1), "expected a tree"),
        ("   ", (1, 4), "expected a tree"),
        (
            "2 a)",
            (1, 1),
            "expected \"(\" to start a tree, found \"2\"",
        ),
        (")", (1, 1), "found \")\""),
        (
            "(x a)",
            (1, 2),
            "expected a sentiment label 0-4, found \"x\"",
        ),
        ("(5 a)", (1, 2), "found \"5\""),
        ("(+2 a)", (1, 2), "found \"+2\""),
        ("(256 a)", (1, 2), "found \"256\""),
        (
            "((2 a))",
            (1, 2),
            "expected a sentiment label 0-4 after \"(\", found \"(\"",
        ),
        ("(", (1, 2), "found the end of the input"),
        ("(2)", (1, 3), "empty node"),
        (
            "(2 a b)",
            (1, 6),
            "expected \")\" after the word \"a\", found \"b\"",
        ),
        (
            "(2 a (1 b))",
            (1, 6),
            "expected \")\" after the word \"a\", found \"(\"",
        ),
        ("(2 (1 a) b)", (1, 10), "found the word \"b\""),
        (
            "(2 (1 a)",
            (1, 9),
            "the node opened at line 1, column 1 is not closed",
        ),
        ("(2 a", (1, 5), "found the end of the input"),
        (
            "(2 (1 (0 a)) (3",
            (1, 16),
            "opened at line 1, column 14 is not closed",
        ),
        (
            "(2",
            (1, 3),
            "the tree opened at line 1, column 1 is not closed",
        ),
        ("(2 a))", (1, 6), "unexpected \")\" after the tree"),
        ("(2 a) (2 b)", (1, 7), "unexpected \"(\" after the tree"),
        ("(2 a) junk", (1, 7), "unexpected \"junk\" after the tree"),
        // Columns count characters, not bytes.
        ("(2 (2 é) (2 ü ü))", (1, 15), "after the word \"ü\""),
        ("(2\n  (2 a)\n  (2 b c))", (3, 8), "after the word \"b\""),
        (
            "(2\n  (2 a)\n  (2 b)",
            (3, 8),
            "line 1, column 1 is not closed",
        ),
    ];
    for (text, pos, fragment) in cases {
        let e = parse_err(text);
        assert_eq!(at(&e), *pos, "{text:?}: {e}");
        assert!(e.message.contains(fragment), "{text:?}: {e}");
        let shown = e.to_string();
        assert!(
            shown.starts_with(&format!("line {}, column {}: ", pos.0, pos.1)),
            "{shown}"
        );
    }
}

#[test]
fn deep_trees_neither_overflow_nor_panic() {
    let n = 200_000;
    let text = format!("{}(2 leaf){}", "(2 ".repeat(n), ")".repeat(n));
    let t = parse_tree(&text).unwrap();
    assert_eq!(t.depth(), n + 1);
    assert_eq!(t.words().count(), 1);
    let v = Vocab::from_trees([&t]);
    let j = tree_json(&t, &v);
    assert!(j.starts_with("{\"Rose\": [[0], [{\"Rose\": [[0], ["));
    assert!(j.ends_with("]]}]]}"));
    assert_eq!(j.matches("Rose").count(), n + 1);
    drop(t);
    // Unclosed at depth: an error, not a crash.
    let e = parse_err(&"(2 ".repeat(n));
    assert_eq!(at(&e), (1, 3 * n + 1), "{e}");
    // Arbitrary bytes never panic.
    let junk = [
        "(((",
        ")))",
        "(2 (2",
        "(\u{0} a)",
        "(4 \u{feff})",
        "\u{a0}(2 a)",
    ];
    for text in junk {
        let _ = parse_tree(text);
        let _ = parse_trees(text);
    }
}

/// A vocabulary whose word "w<k>" has id k, for k in 2..n.
fn numbered_vocab(n: usize) -> Vocab {
    let mut text = String::from("<none>\n<unk>\n");
    for k in 2..n {
        text.push_str(&format!("w{k}\n"));
    }
    Vocab::from_text(&text).unwrap()
}

#[test]
fn tree_json_is_the_readme_encoding() {
    let vocab = numbered_vocab(100);
    assert_eq!(vocab.id("w12"), 12);
    let t = parse_tree("(3 (2 w12) (4 (2 w7) (3 w93)))").unwrap();
    // Exactly models/README.md's TreeLSTM example.
    let expected = r#"{"tree": {"Rose": [[0], [{"Rose": [[12], []]}, {"Rose": [[0], [{"Rose": [[7], []]}, {"Rose": [[93], []]}]]}]]}}"#;
    assert_eq!(tree_instance(&t, &vocab), expected);
    let value: Value = serde_json::from_str(&tree_instance(&t, &vocab)).unwrap();
    let leaf = |id: u32| json!({"Rose": [[id], []]});
    assert_eq!(
        value,
        json!({"tree": {"Rose": [[0], [leaf(12), {"Rose": [[0], [leaf(7), leaf(93)]]}]]}})
    );
    // A single leaf; an unknown word is <unk>.
    let t = parse_tree("(2 nope)").unwrap();
    assert_eq!(tree_json(&t, &vocab), r#"{"Rose": [[1], []]}"#);
    // Sequence models: the leaves left to right.
    let t = parse_tree("(3 (2 w12) (4 (2 w7) (3 w93)) (1 zzz))").unwrap();
    assert_eq!(token_ids(&t, &vocab), [12, 7, 93, UNK_ID]);
    assert_eq!(
        tokens_instance(&t, &vocab),
        r#"{"tokens": [[12], [7], [93], [1]]}"#
    );
}

#[test]
fn vocab_orders_by_frequency_then_bytes() {
    let trees = parse_trees(
        "(2 (2 b) (2 a))\n(2 (2 c) (2 (2 a) (2 B)))\n(2 (2 c) (2 (2 é) (2 e)))\n(2 <unk>)",
    )
    .unwrap();
    let v = Vocab::from_trees(&trees);
    // a, c twice; then B < b < e < é by bytes; the literal "<unk>" is the special.
    assert_eq!(v.words(), ["<none>", "<unk>", "a", "c", "B", "b", "e", "é"]);
    assert_eq!(v.len(), 8);
    assert!(!v.is_empty());
    assert_eq!(v.id("<none>"), NONE_ID);
    assert_eq!(v.id("a"), 2);
    assert_eq!(v.id("é"), 7);
    assert_eq!(v.id("missing"), UNK_ID);
    assert_eq!(v.get("missing"), None);
    assert_eq!(v.word(3), Some("c"));
    assert_eq!(v.word(8), None);
    // vocab.txt round trip.
    let text = v.to_text();
    assert_eq!(text, "<none>\n<unk>\na\nc\nB\nb\ne\né\n");
    assert_eq!(Vocab::from_text(&text).unwrap(), v);
    assert_eq!(Vocab::from_text(&text.replace('\n', "\r\n")).unwrap(), v);
    assert_eq!(Vocab::from_text(text.trim_end_matches('\n')).unwrap(), v);
    let mut counts = HashMap::new();
    counts.insert("x".to_string(), 1);
    counts.insert("y".to_string(), 3);
    counts.insert("<none>".to_string(), 9);
    assert_eq!(
        Vocab::from_counts(&counts).words(),
        ["<none>", "<unk>", "y", "x"]
    );
}

#[test]
fn bad_vocab_files_are_located_errors() {
    let cases: &[(&str, (usize, usize), &str)] = &[
        ("", (1, 1), "starts with"),
        ("<none>\n", (2, 1), "starts with"),
        ("<unk>\n<none>\n", (1, 1), "expected \"<none>\""),
        ("<none>\nfoo\n", (2, 1), "expected \"<unk>\""),
        ("<none>\n<unk>\na\n\nb\n", (4, 1), "empty line"),
        (
            "<none>\n<unk>\na\nb\na\n",
            (5, 1),
            "repeated (first on line 3)",
        ),
        ("<none>\n<unk>\nab c\n", (3, 3), "cannot contain ' '"),
        ("<none>\n<unk>\nx(\n", (3, 2), "cannot contain '('"),
    ];
    for (text, pos, fragment) in cases {
        let e = Vocab::from_text(text).unwrap_err();
        assert_eq!(at(&e), *pos, "{text:?}: {e}");
        assert!(e.message.contains(fragment), "{text:?}: {e}");
    }
}

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The real SST files, if this checkout has them beside it (CI does).
fn sst_dir() -> Option<PathBuf> {
    match find_sst_dir(None) {
        Ok(d) => Some(d),
        Err(e) => {
            eprintln!("note: skipping the real-data checks: {e}");
            None
        }
    }
}

#[test]
fn real_sst_vocab_and_trees() {
    let Some(dir) = sst_dir() else { return };
    let vocab = Vocab::from_sst_dir(&dir).unwrap();
    assert_eq!(vocab.len(), SST_VOCAB_SIZE);
    assert_eq!(
        &vocab.words()[..8],
        ["<none>", "<unk>", ".", ",", "the", "and", "a", "of"]
    );
    assert!(vocab.get("8\u{a0}1\\/2").is_some());
    // The bundled copy is up to date.
    let bundled = std::fs::read_to_string(repo().join("examples/sst_vocab.txt")).unwrap();
    assert!(
        bundled == vocab.to_text(),
        "examples/sst_vocab.txt is stale"
    );
    for (split, n) in [("train", 8544), ("dev", 1101), ("test", 2210)] {
        let trees: Vec<Tree> =
            tumble_data::sst::read_trees(&dir.join(format!("{split}.txt"))).unwrap();
        assert_eq!(trees.len(), n, "{split}");
        assert!(trees.iter().all(Tree::is_binary), "{split}");
        for t in &trees {
            assert!(token_ids(t, &vocab).iter().all(|&id| id >= 2));
        }
    }
}

#[test]
fn bundled_sst_samples_match_the_data() {
    let Some(dir) = sst_dir() else { return };
    let vocab = Vocab::from_sst_dir(&dir).unwrap();
    let test = tumble_data::sst::read_trees(&dir.join("test.txt")).unwrap();
    let trees: String = test[..8]
        .iter()
        .map(|t| tree_instance(t, &vocab) + "\n")
        .collect();
    let tokens: String = test[..8]
        .iter()
        .map(|t| tokens_instance(t, &vocab) + "\n")
        .collect();
    for (file, expected) in [
        ("treelstm.jsonl", &trees),
        ("mvrnn.jsonl", &trees),
        ("birnn.jsonl", &tokens),
        ("stackrnn.jsonl", &tokens),
    ] {
        let got = std::fs::read_to_string(repo().join("examples").join(file)).unwrap();
        assert!(&got == expected, "examples/{file} is stale");
    }
}

#[test]
fn bundled_samples_are_valid_json_with_valid_ids() {
    // Runs without the SST files: the samples ship with the repository.
    let vocab = Vocab::read(&repo().join("examples/sst_vocab.txt")).unwrap();
    assert_eq!(vocab.len(), SST_VOCAB_SIZE);
    let mut seen = 0;
    for file in [
        "treelstm.jsonl",
        "mvrnn.jsonl",
        "birnn.jsonl",
        "stackrnn.jsonl",
    ] {
        let text = std::fs::read_to_string(repo().join("examples").join(file)).unwrap();
        assert_eq!(text.lines().count(), 8, "{file}");
        for line in text.lines() {
            let v: Value = serde_json::from_str(line).unwrap();
            let mut ids = Vec::new();
            collect_ids(&v, &mut ids);
            assert!(!ids.is_empty());
            assert!(ids.iter().all(|&id| id < SST_VOCAB_SIZE as u64), "{file}");
            seen += 1;
        }
    }
    assert_eq!(seen, 32);
}

fn collect_ids(v: &Value, out: &mut Vec<u64>) {
    match v {
        Value::Number(n) => out.push(n.as_u64().unwrap()),
        Value::Array(items) => items.iter().for_each(|i| collect_ids(i, out)),
        Value::Object(map) => map.values().for_each(|i| collect_ids(i, out)),
        other => panic!("unexpected {other}"),
    }
}
