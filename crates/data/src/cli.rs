//! `tumble data ...`: the command-line front end, as a clap [`DataArgs`] to embed in a binary and
//! [`run`] to execute it.
//!
//! ```text
//! tumble data sst    [--split test] [--format tree|tokens] [--offset N] [--limit N]
//!                    [--data-dir DIR] [--vocab FILE] [-o FILE]
//! tumble data nested [--count 100] [--seed 0] [--outer-min 1 --outer-max 8]
//!                    [--inner-min 20 --inner-max 40] [--vocab-size 21703] [-o FILE]
//! tumble data drnn   [--count 100] [--seed 0] [--hidden 256] [--depth-min 3 --depth-max 5]
//!                    [--width-min 2 --width-max 3] [-o FILE]
//! tumble data berxit [--count 100] [--seed 0] [--threshold 0.9] [-o FILE]
//! tumble data vocab  [--data-dir DIR] [-o FILE]
//! ```
//!
//! Instances are written as JSON Lines (one instance per line), the vocabulary as one word per
//! line; to `--output FILE` atomically (a temp file renamed into place), else to standard output.
//! Either way the output streams: each line is made and written before the next, and between
//! lines an interrupt (Ctrl-C) or an exceeded memory budget stops it; a file is then not written
//! at all (its temp file is removed) and the error says so ([`crate::output::write_lines`]).

use std::path::{Path, PathBuf};

use tumble_limits::Stop;
use tumble_tensor::Rng;

use crate::error::DataError;
use crate::gen::{self, BerxitConfig, DrnnConfig, NestedConfig};
use crate::output::write_lines;
use crate::sst::{self, Vocab, SST_SPLITS};

/// Generates example instances for the model zoo (JSON Lines) and the SST vocabulary.
#[derive(clap::Args, Debug, Clone)]
pub struct DataArgs {
    /// What to write.
    #[command(subcommand)]
    pub command: DataCommand,
}

/// The `tumble data` subcommands.
#[derive(clap::Subcommand, Debug, Clone)]
pub enum DataCommand {
    /// SST trees (TreeLSTM, MV-RNN) or sentences (BiRNN, StackRNN) with SST vocabulary ids.
    Sst(SstArgs),
    /// Random NestedRNN inputs: 1-8 inner sequences of 20-40 token ids in [2, 21703).
    Nested(NestedArgs),
    /// Random DRNN inputs: an N(0, 1) latent code, max_depth 3-5, max_width 2-3.
    Drnn(DrnnArgs),
    /// Random Berxit inputs: [CLS] (101) then 127 uniform ids in [0, 30522), a fixed threshold.
    Berxit(BerxitArgs),
    /// The SST vocabulary (`vocab.txt`): one word per line in id order, <none> and <unk> first.
    Vocab(VocabArgs),
}

/// Where the output goes.
#[derive(clap::Args, Debug, Clone, Default)]
pub struct OutputArgs {
    /// Write to FILE (atomically; through a symlink, its target) instead of standard output
    /// (`-`: standard output too).
    #[arg(short, long, value_name = "FILE")]
    pub output: Option<PathBuf>,
}

/// An SST split.
#[derive(clap::ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum Split {
    /// train.txt (8,544 trees)
    Train,
    /// dev.txt (1,101 trees)
    Dev,
    /// test.txt (2,210 trees)
    Test,
}

impl Split {
    /// The file stem: "train", "dev" or "test".
    pub fn name(self) -> &'static str {
        match self {
            Split::Train => "train",
            Split::Dev => "dev",
            Split::Test => "test",
        }
    }
}

/// How an SST tree becomes an instance.
#[derive(clap::ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    /// `{"tree": ...}` for TreeLSTM and MV-RNN
    Tree,
    /// `{"tokens": [[id], ...]}` for BiRNN and StackRNN
    Tokens,
}

/// `tumble data sst`.
#[derive(clap::Args, Debug, Clone)]
pub struct SstArgs {
    /// Which split to read.
    #[arg(long, value_enum, default_value_t = Split::Test)]
    pub split: Split,
    /// Instance format: trees for the tree models, token lists for the sequence models.
    #[arg(long, value_enum, default_value_t = Format::Tree)]
    pub format: Format,
    /// Skip the first N trees of the split.
    #[arg(long, default_value_t = 0, value_name = "N")]
    pub offset: usize,
    /// Write at most N instances (default: all).
    #[arg(long, visible_alias = "count", value_name = "N")]
    pub limit: Option<usize>,
    /// The SST directory (train.txt, dev.txt, test.txt). Default: ../shared/data/sst, else
    /// <repo>/../shared/data/sst, else shared/data/sst.
    #[arg(long, value_name = "DIR")]
    pub data_dir: Option<PathBuf>,
    /// Map words with this vocab.txt instead of building the vocabulary from the SST files.
    #[arg(long, value_name = "FILE")]
    pub vocab: Option<PathBuf>,
    /// Add the treebank's sentiment classes (0-4) to each instance: `root` adds `"label"` (the
    /// sentence's class, a `Tensor[(), int32]`), `all` adds `"labels"`: every node's class as a
    /// tree of the tree's shape (`Tree[Tensor[(), int32]]`), or with `--format tokens` each
    /// word's class (a list, one per token).
    #[arg(long, value_enum, default_value_t = Labels::None)]
    pub labels: Labels,
    /// With `--format tokens`: also write each token's position, `"positions": [[0], [1], ...]`
    /// (a `Tensor[(?, 1), int32]` like the tokens; `models/transformer_sst.rly` reads it).
    #[arg(long)]
    pub positions: bool,
    #[command(flatten)]
    pub out: OutputArgs,
}

#[derive(clap::ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum Labels {
    /// No labels.
    None,
    /// The root's class: `"label": 3`.
    Root,
    /// Every node's class: a tree of labels (`--format tree`) or one per word (`tokens`).
    All,
}

/// `instance` (a JSON object) with the labels `mode` asks for added: for `all`, a tree of
/// labels shaped like the instance's tree (`Tree[Tensor[(), int32]]`, a tree model walks both
/// together), or for the token format the leaves' labels, one per token.
fn with_labels(mut instance: String, tree: &sst::Tree, mode: Labels, format: Format) -> String {
    use std::fmt::Write as _;
    if mode == Labels::None || !instance.ends_with('}') {
        return instance;
    }
    instance.pop();
    match (mode, format) {
        (Labels::Root, _) => {
            let _ = write!(instance, ", \"label\": {}}}", tree.root().label);
        }
        (_, Format::Tree) => {
            let _ = write!(instance, ", \"labels\": {}}}", label_tree_json(tree));
        }
        (_, Format::Tokens) => {
            let labels: Vec<String> = tree
                .nodes()
                .iter()
                .filter(|n| n.is_leaf())
                .map(|n| n.label.to_string())
                .collect();
            let _ = write!(instance, ", \"labels\": [{}]}}", labels.join(", "));
        }
    }
    instance
}

/// Every node's label as a tree of the tree's shape: `{"Rose": [3, [{"Rose": [2, []]}, ...]]}`.
/// Iterative, like [`sst::tree_json`].
fn label_tree_json(tree: &sst::Tree) -> String {
    use std::fmt::Write as _;
    let nodes = tree.nodes();
    let mut out = String::new();
    let open = |out: &mut String, i: usize| -> bool {
        let node = &nodes[i];
        let _ = write!(out, "{{\"Rose\": [{}, [", node.label);
        if node.children.is_empty() {
            out.push_str("]]}");
            false
        } else {
            true
        }
    };
    let mut stack: Vec<(usize, usize)> = Vec::new();
    if !nodes.is_empty() && open(&mut out, 0) {
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

/// `tumble data nested`.
#[derive(clap::Args, Debug, Clone)]
pub struct NestedArgs {
    /// Number of instances.
    #[arg(long, default_value_t = 100, value_name = "N")]
    pub count: usize,
    /// Random seed.
    #[arg(long, default_value_t = 0, value_name = "S")]
    pub seed: u64,
    /// Fewest inner sequences per instance.
    #[arg(long, default_value_t = 1, value_name = "N")]
    pub outer_min: u32,
    /// Most inner sequences per instance.
    #[arg(long, default_value_t = 8, value_name = "N")]
    pub outer_max: u32,
    /// Shortest inner sequence.
    #[arg(long, default_value_t = 20, value_name = "N")]
    pub inner_min: u32,
    /// Longest inner sequence.
    #[arg(long, default_value_t = 40, value_name = "N")]
    pub inner_max: u32,
    /// Token ids are drawn from [2, V).
    #[arg(long, default_value_t = sst::SST_VOCAB_SIZE as u32, value_name = "V")]
    pub vocab_size: u32,
    #[command(flatten)]
    pub out: OutputArgs,
}

/// `tumble data drnn`.
#[derive(clap::Args, Debug, Clone)]
pub struct DrnnArgs {
    /// Number of instances.
    #[arg(long, default_value_t = 100, value_name = "N")]
    pub count: usize,
    /// Random seed.
    #[arg(long, default_value_t = 0, value_name = "S")]
    pub seed: u64,
    /// Latent width: the model's hidden size (drnn_small 256, drnn_large 512).
    #[arg(long, default_value_t = 256, value_name = "H")]
    pub hidden: u32,
    /// Smallest max_depth (levels; 1 = root only).
    #[arg(long, default_value_t = 3, value_name = "D")]
    pub depth_min: u32,
    /// Largest max_depth.
    #[arg(long, default_value_t = 5, value_name = "D")]
    pub depth_max: u32,
    /// Smallest max_width (children per node).
    #[arg(long, default_value_t = 2, value_name = "W")]
    pub width_min: u32,
    /// Largest max_width.
    #[arg(long, default_value_t = 3, value_name = "W")]
    pub width_max: u32,
    #[command(flatten)]
    pub out: OutputArgs,
}

/// `tumble data berxit`.
#[derive(clap::Args, Debug, Clone)]
pub struct BerxitArgs {
    /// Number of instances.
    #[arg(long, default_value_t = 100, value_name = "N")]
    pub count: usize,
    /// Random seed.
    #[arg(long, default_value_t = 0, value_name = "S")]
    pub seed: u64,
    /// Exit threshold on the largest softmax probability.
    #[arg(
        long,
        default_value_t = 0.9,
        value_name = "T",
        allow_negative_numbers = true
    )]
    pub threshold: f32,
    /// Sequence lengths, [CLS] included: `fixed` (128, the zoo's `berxit_*.rly`), `N` (all N),
    /// `uniform:MIN-MAX`, or `sst` (the lengths of SST's training sentences, in words, plus one
    /// for [CLS]: 3-53 tokens, mean 20.1). Any but `fixed` also writes `positions` (0, 1, ...),
    /// the input of `models/berxit_var_*.rly`.
    #[arg(long, default_value = "fixed", value_name = "SPEC")]
    pub lengths: String,
    /// The SST directory, for `--lengths sst` (see `tumble data sst --help`).
    #[arg(long, value_name = "DIR")]
    pub data_dir: Option<PathBuf>,
    #[command(flatten)]
    pub out: OutputArgs,
}

/// The lengths `--lengths` names.
fn berxit_lengths(a: &BerxitArgs) -> Result<gen::Lengths, DataError> {
    let bad = || {
        DataError::Invalid(format!(
            "--lengths: expected `fixed`, a length, `uniform:MIN-MAX` or `sst`, got `{}`",
            a.lengths
        ))
    };
    let spec = a.lengths.trim();
    if spec == "fixed" {
        return Ok(gen::Lengths::Fixed(gen::BERXIT_SEQ_LEN));
    }
    if spec == "sst" {
        let dir = find_sst_dir(a.data_dir.as_deref())?;
        let trees = crate::sst::read_trees(&crate::sst::split_path(&dir, "train"))?;
        let lens: Vec<usize> = trees
            .iter()
            .map(|t| (t.words().count() + 1).min(gen::BERXIT_SEQ_LEN))
            .collect();
        if lens.is_empty() {
            return Err(DataError::Invalid(
                "SST training split has no sentences".into(),
            ));
        }
        return Ok(gen::Lengths::Drawn(lens));
    }
    if let Some(range) = spec.strip_prefix("uniform:") {
        let (lo, hi) = range.split_once('-').ok_or_else(bad)?;
        let lo = lo.trim().parse().map_err(|_| bad())?;
        let hi = hi.trim().parse().map_err(|_| bad())?;
        return Ok(gen::Lengths::Uniform(lo, hi));
    }
    spec.parse().map(gen::Lengths::All).map_err(|_| bad())
}

/// `tumble data vocab`.
#[derive(clap::Args, Debug, Clone)]
pub struct VocabArgs {
    /// The SST directory (see `tumble data sst --help`).
    #[arg(long, value_name = "DIR")]
    pub data_dir: Option<PathBuf>,
    #[command(flatten)]
    pub out: OutputArgs,
}

/// Runs a `tumble data` command. Errors are complete messages (they name the file and, for
/// parse errors, the line and column).
pub fn run(args: &DataArgs) -> Result<(), String> {
    run_inner(args).map_err(|e| e.to_string())
}

fn run_inner(args: &DataArgs) -> Result<(), DataError> {
    match &args.command {
        DataCommand::Sst(a) => run_sst(a),
        DataCommand::Nested(a) => {
            let cfg = NestedConfig {
                outer_min: a.outer_min,
                outer_max: a.outer_max,
                inner_min: a.inner_min,
                inner_max: a.inner_max,
                vocab_size: a.vocab_size,
            };
            cfg.validate().map_err(DataError::Invalid)?;
            // One line at a time, made whole before it is written: the largest one's ids and
            // their text (a token id `[21702], ` is at most ~16 bytes) must fit the budget.
            let tokens = (a.outer_max as usize).saturating_mul(a.inner_max as usize);
            reserve_line(tokens.saturating_mul(16), &a.out)?;
            let mut rng = Rng::new(a.seed);
            let lines = (0..a.count).map(|_| {
                let seqs = gen::nested_polled(&mut rng, &cfg, || {
                    tumble_limits::poll().map_err(stopped(&a.out))
                })?;
                Ok(gen::nested_json(&seqs))
            });
            finish(&a.out, write_lines(a.out.path(), lines)?)
        }
        DataCommand::Drnn(a) => {
            let cfg = DrnnConfig {
                hidden: a.hidden,
                depth_min: a.depth_min,
                depth_max: a.depth_max,
                width_min: a.width_min,
                width_max: a.width_max,
            };
            cfg.validate().map_err(DataError::Invalid)?;
            // One line at a time: its latent floats and their text (at most ~16 bytes each)
            // must fit the memory budget, asked before the first is made.
            reserve_line((a.hidden as usize).saturating_mul(24), &a.out)?;
            let mut rng = Rng::new(a.seed);
            let lines = (0..a.count).map(|_| Ok(gen::drnn_json(&gen::drnn(&mut rng, &cfg))));
            finish(&a.out, write_lines(a.out.path(), lines)?)
        }
        DataCommand::Berxit(a) => {
            let cfg = BerxitConfig {
                threshold: a.threshold,
                lengths: berxit_lengths(a)?,
                ..BerxitConfig::default()
            };
            cfg.validate().map_err(DataError::Invalid)?;
            let mut rng = Rng::new(a.seed);
            let lines = (0..a.count)
                .map(|_| Ok(gen::berxit_line(&gen::berxit_tokens(&mut rng, &cfg), &cfg)));
            finish(&a.out, write_lines(a.out.path(), lines)?)
        }
        DataCommand::Vocab(a) => {
            let dir = find_sst_dir(a.data_dir.as_deref())?;
            let vocab = Vocab::from_sst_dir(&dir)?;
            let lines = vocab.words().iter().map(|w| Ok(w.clone()));
            finish(&a.out, write_lines(a.out.path(), lines)?)
        }
    }
}

/// Refuses, before any line is made, a command whose largest line (`bytes` while it is made)
/// would not fit the memory budget: a line is made whole, so the budget could only be looked at
/// once it was (one instance of 10⁸ × 1,000 tokens grew to 7 GB past a 100 MiB budget, and a
/// `--timeout` waited for it).
fn reserve_line(bytes: usize, out: &OutputArgs) -> Result<(), DataError> {
    tumble_limits::reserve(bytes).map_err(stopped(out))
}

/// The error of a command writing `out` that the run limits stopped.
fn stopped(out: &OutputArgs) -> impl Fn(Stop) -> DataError + '_ {
    |stop| DataError::Stopped {
        stop,
        path: out.path().map(Path::to_path_buf),
    }
}

fn run_sst(a: &SstArgs) -> Result<(), DataError> {
    let dir = find_sst_dir(a.data_dir.as_deref())?;
    let vocab = match &a.vocab {
        Some(path) => Vocab::read(path)?,
        None => Vocab::from_sst_dir(&dir)?,
    };
    let path = sst::split_path(&dir, a.split.name());
    let text = sst::read_text(&path)?;
    let limit = a.limit.unwrap_or(usize::MAX);
    let format = a.format;
    if a.positions && format != Format::Tokens {
        return Err(DataError::Invalid(
            "--positions goes with --format tokens (trees have no positions)".into(),
        ));
    }
    // Words a given --vocab does not have are written as <unk>: counted, to say so.
    let (mut words, mut unknown) = (0usize, 0usize);
    let lines = sst::Trees::new(&text)
        .skip(a.offset)
        .take(limit)
        .map(|tree| {
            let tree = tree.map_err(|e| DataError::parse(&path, e))?;
            if a.vocab.is_some() {
                for w in tree.words() {
                    words += 1;
                    unknown += usize::from(vocab.get(w).is_none());
                }
            }
            let instance = match format {
                Format::Tree => sst::tree_instance(&tree, &vocab),
                Format::Tokens if a.positions => sst::tokens_with_positions(&tree, &vocab),
                Format::Tokens => sst::tokens_instance(&tree, &vocab),
            };
            Ok(with_labels(instance, &tree, a.labels, format))
        });
    let written = write_lines(a.out.path(), lines)?;
    use std::io::Write as _;
    if written == 0 && a.offset > 0 {
        let _ = writeln!(
            std::io::stderr(),
            "warning: --offset {} is past the last tree of {}: no instances written",
            a.offset,
            path.display()
        );
    } else if written == 0 && a.limit != Some(0) {
        let _ = writeln!(
            std::io::stderr(),
            "warning: {} has no trees (the SST {} split has {}): no instances written",
            path.display(),
            a.split.name(),
            sst::split_sentences(a.split.name()).map_or("some".to_string(), |n| n.to_string())
        );
    }
    if unknown > 0 {
        let _ = writeln!(
            std::io::stderr(),
            "warning: {unknown} of {words} words are not in the --vocab file and were written as \
             <unk> (id {})",
            sst::UNK_ID
        );
    }
    finish(&a.out, written)
}

impl DataArgs {
    /// The file the command writes (`None`: standard output).
    pub fn output(&self) -> Option<&Path> {
        match &self.command {
            DataCommand::Sst(a) => a.out.path(),
            DataCommand::Nested(a) => a.out.path(),
            DataCommand::Drnn(a) => a.out.path(),
            DataCommand::Berxit(a) => a.out.path(),
            DataCommand::Vocab(a) => a.out.path(),
        }
    }

    /// The files the command reads, each with what it is (the SST splits of the folder it finds,
    /// a `--vocab` file), for a caller that refuses an output that would replace one: the
    /// output is written only after they are read, so it would succeed and lose the input.
    pub fn files_read(&self) -> Vec<(&'static str, PathBuf)> {
        let (data_dir, vocab) = match &self.command {
            DataCommand::Sst(a) => (Some(a.data_dir.as_deref()), a.vocab.as_deref()),
            DataCommand::Vocab(a) => (Some(a.data_dir.as_deref()), None),
            // Its lengths read from the training split.
            DataCommand::Berxit(a) if a.lengths.trim() == "sst" => {
                (Some(a.data_dir.as_deref()), None)
            }
            _ => (None, None),
        };
        let mut files: Vec<(&'static str, PathBuf)> = Vec::new();
        if let Some(dir) = data_dir.and_then(|d| find_sst_dir(d).ok()) {
            for s in SST_SPLITS {
                files.push(("an SST file read", sst::split_path(&dir, s)));
            }
        }
        if let Some(v) = vocab {
            files.push(("the --vocab file", v.to_path_buf()));
        }
        files
    }
}

impl OutputArgs {
    /// The file to write, or `None` for standard output (no `-o`, or `-o -`).
    fn path(&self) -> Option<&Path> {
        self.output.as_deref().filter(|p| p.as_os_str() != "-")
    }
}

fn finish(out: &OutputArgs, lines: usize) -> Result<(), DataError> {
    if let Some(path) = out.path() {
        // A closed stderr is no failure of the command (its output is written).
        use std::io::Write as _;
        let _ = writeln!(
            std::io::stderr(),
            "wrote {lines} line{} to {}",
            if lines == 1 { "" } else { "s" },
            path.display()
        );
    }
    Ok(())
}

fn is_sst_dir(dir: &Path) -> bool {
    SST_SPLITS.iter().all(|s| sst::split_path(dir, s).is_file())
}

/// Places where the SST directory is looked for when `--data-dir` is not given, in order:
/// `../shared/data/sst` (relative to the current directory), `<repo>/../shared/data/sst` (the
/// repository this crate was built from), `shared/data/sst` and `<repo>/shared/data/sst`.
pub fn default_sst_dirs() -> Vec<PathBuf> {
    let repo = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let repo = repo.canonicalize().unwrap_or(repo);
    vec![
        PathBuf::from("../shared/data/sst"),
        repo.join("../shared/data/sst"),
        PathBuf::from("shared/data/sst"),
        repo.join("shared/data/sst"),
    ]
}

/// The SST directory: `explicit` if given (it must hold train.txt, dev.txt and test.txt), else
/// the first of [`default_sst_dirs`] that does. The error names every path tried.
pub fn find_sst_dir(explicit: Option<&Path>) -> Result<PathBuf, DataError> {
    if let Some(dir) = explicit {
        if is_sst_dir(dir) {
            return Ok(dir.to_path_buf());
        }
        if !dir.is_dir() {
            return Err(DataError::Invalid(format!(
                "SST data directory {} not found (it needs train.txt, dev.txt and test.txt)",
                dir.display()
            )));
        }
        // Say which split file is missing, or is not a file.
        let problems: Vec<String> = SST_SPLITS
            .iter()
            .map(|s| sst::split_path(dir, s))
            .filter(|p| !p.is_file())
            .map(|p| {
                let what = if p.is_dir() {
                    "is a directory"
                } else if p.exists() {
                    "is not a regular file"
                } else {
                    "is missing"
                };
                format!("{} {what}", p.display())
            })
            .collect();
        return Err(DataError::Invalid(format!(
            "SST data directory {} is incomplete (it needs train.txt, dev.txt and test.txt): {}",
            dir.display(),
            problems.join("; ")
        )));
    }
    let tried = default_sst_dirs();
    if let Some(dir) = tried.iter().find(|d| is_sst_dir(d)) {
        return Ok(dir.clone());
    }
    let list: Vec<String> = tried.iter().map(|d| d.display().to_string()).collect();
    Err(DataError::Invalid(format!(
        "SST data directory not found (it needs train.txt, dev.txt and test.txt); tried {}; \
         pass --data-dir DIR",
        list.join(", ")
    )))
}
