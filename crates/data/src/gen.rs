//! Seeded generators for the zoo models that have no natural data set here: NestedRNN, DRNN
//! and Berxit.
//!
//! Every generator draws from one [`Rng`] (xoshiro256\*\*, `tumble_tensor::Rng`); the `*_many`
//! functions seed it with `seed` and draw the instances in order, so instance `i` depends only
//! on `seed` and `i`, and a larger `count` extends a smaller one. Integer draws are exact on
//! every platform; DRNN's normal draws use the platform's `ln`/`cos`, whose last bit may differ,
//! and are then rounded to `f32`.
//!
//! Distributions (defaults in brackets):
//!
//! - **NestedRNN** ([`NestedConfig`]): outer length uniform in `[outer_min, outer_max]` [1, 8];
//!   each inner length uniform in `[inner_min, inner_max]` [20, 40] (mean 30, as in ACROBAT);
//!   every token id uniform in `[2, vocab_size)` [21,703 — the SST table; ids 0 and 1 are
//!   `<none>`/`<unk>`]. `{"seqs": [[[id], ...], ...]}`.
//! - **DRNN** ([`DrnnConfig`]): `latent` is `hidden` [256] independent N(0, 1) draws, rounded to
//!   `f32`, as a `(1, hidden)` tensor; `max_depth` uniform in `[depth_min, depth_max]` [3, 5];
//!   `max_width` uniform in `[width_min, width_max]` [2, 3].
//!   `{"latent": [[...]], "max_depth": d, "max_width": w}`.
//! - **Berxit** ([`BerxitConfig`]): 128 token ids, the first 101 (`[CLS]`), the other 127
//!   uniform in `[0, vocab_size)` [30,522, BERT's WordPiece vocabulary]; `threshold` [0.9] is
//!   fixed. `{"tokens": [101, ...], "threshold": t}`.

use std::fmt::Write as _;

use tumble_tensor::Rng;

use crate::sst::SST_VOCAB_SIZE;

/// Sequence length of the Berxit models (`Tensor[(128), int32]`).
pub const BERXIT_SEQ_LEN: usize = 128;
/// BERT's WordPiece vocabulary size (`word_emb (30522, D)`).
pub const BERT_VOCAB_SIZE: u32 = 30_522;
/// BERT's `[CLS]` id, the first token of every Berxit instance.
pub const CLS_ID: u32 = 101;
/// Smallest generated NestedRNN id: 0 and 1 are `<none>` and `<unk>`.
pub const FIRST_WORD_ID: u32 = 2;

/// Appends `[[a], [b], ...]`.
pub(crate) fn push_id_list(out: &mut String, ids: &[u32]) {
    out.push('[');
    for (i, id) in ids.iter().enumerate() {
        if i > 0 {
            out.push_str(", ");
        }
        let _ = write!(out, "[{id}]");
    }
    out.push(']');
}

/// A uniform draw from the inclusive range `[lo, hi]` (`lo` when `hi < lo`).
fn uniform_incl(rng: &mut Rng, lo: u32, hi: u32) -> u32 {
    rng.int_range(i64::from(lo), i64::from(hi) + 1) as u32
}

/// A uniform draw from `[lo, hi)` (`lo` when the range is empty).
fn uniform_below(rng: &mut Rng, lo: u32, hi: u32) -> u32 {
    rng.int_range(i64::from(lo), i64::from(hi)) as u32
}

fn check_range(what: &str, lo: u32, hi: u32, least: u32) -> Result<(), String> {
    if lo < least {
        return Err(format!(
            "{what}: the minimum must be at least {least}, got {lo}"
        ));
    }
    if lo > hi {
        return Err(format!(
            "{what}: the minimum {lo} is larger than the maximum {hi}"
        ));
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// NestedRNN

/// Shape of generated NestedRNN instances (see the module docs).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NestedConfig {
    /// Fewest inner sequences (0 allowed: the model returns zeros).
    pub outer_min: u32,
    /// Most inner sequences.
    pub outer_max: u32,
    /// Shortest inner sequence (0 allowed: passes the outer state through).
    pub inner_min: u32,
    /// Longest inner sequence.
    pub inner_max: u32,
    /// Ids are drawn from `[2, vocab_size)`.
    pub vocab_size: u32,
}

impl Default for NestedConfig {
    fn default() -> Self {
        NestedConfig {
            outer_min: 1,
            outer_max: 8,
            inner_min: 20,
            inner_max: 40,
            vocab_size: SST_VOCAB_SIZE as u32,
        }
    }
}

impl NestedConfig {
    /// Checks the ranges.
    pub fn validate(&self) -> Result<(), String> {
        check_range("outer length", self.outer_min, self.outer_max, 0)?;
        check_range("inner length", self.inner_min, self.inner_max, 0)?;
        if self.vocab_size <= FIRST_WORD_ID {
            return Err(format!(
                "vocabulary size must be larger than {FIRST_WORD_ID}, got {}",
                self.vocab_size
            ));
        }
        if self.vocab_size > i32::MAX as u32 {
            return Err(format!(
                "vocabulary size {} does not fit int32 ids",
                self.vocab_size
            ));
        }
        Ok(())
    }
}

/// One NestedRNN input: the inner sequences of token ids.
pub fn nested(rng: &mut Rng, cfg: &NestedConfig) -> Vec<Vec<u32>> {
    let Ok(seqs) = nested_polled(rng, cfg, || Ok::<(), std::convert::Infallible>(()));
    seqs
}

/// [`nested`], calling `poll` before each inner sequence: one instance can hold billions of
/// ids (`--outer-max 100000000`), so a time limit or an interrupt must not wait for all of it.
pub fn nested_polled<E>(
    rng: &mut Rng,
    cfg: &NestedConfig,
    mut poll: impl FnMut() -> Result<(), E>,
) -> Result<Vec<Vec<u32>>, E> {
    let outer = uniform_incl(rng, cfg.outer_min, cfg.outer_max);
    (0..outer)
        .map(|_| {
            poll()?;
            let inner = uniform_incl(rng, cfg.inner_min, cfg.inner_max);
            Ok((0..inner)
                .map(|_| uniform_below(rng, FIRST_WORD_ID, cfg.vocab_size))
                .collect())
        })
        .collect()
}

/// `{"seqs": [[[id], ...], ...]}`.
pub fn nested_json(seqs: &[Vec<u32>]) -> String {
    let mut out = String::from("{\"seqs\": [");
    for (i, seq) in seqs.iter().enumerate() {
        if i > 0 {
            out.push_str(", ");
        }
        push_id_list(&mut out, seq);
    }
    out.push_str("]}");
    out
}

/// `count` NestedRNN instances from `seed`, as JSON lines.
pub fn nested_many(seed: u64, count: usize, cfg: &NestedConfig) -> Result<Vec<String>, String> {
    cfg.validate()?;
    let mut rng = Rng::new(seed);
    Ok((0..count)
        .map(|_| nested_json(&nested(&mut rng, cfg)))
        .collect())
}

// ---------------------------------------------------------------------------------------------
// DRNN

/// Shape of generated DRNN instances (see the module docs).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DrnnConfig {
    /// Width of the latent vector: the model's hidden size (256 small, 512 large).
    pub hidden: u32,
    /// Smallest `max_depth` (levels, 1 = root only).
    pub depth_min: u32,
    /// Largest `max_depth`.
    pub depth_max: u32,
    /// Smallest `max_width` (children per node).
    pub width_min: u32,
    /// Largest `max_width`.
    pub width_max: u32,
}

impl Default for DrnnConfig {
    fn default() -> Self {
        DrnnConfig {
            hidden: 256,
            depth_min: 3,
            depth_max: 5,
            width_min: 2,
            width_max: 3,
        }
    }
}

impl DrnnConfig {
    /// Checks the ranges.
    pub fn validate(&self) -> Result<(), String> {
        if self.hidden == 0 {
            return Err("the hidden size must be at least 1".to_string());
        }
        check_range("max_depth", self.depth_min, self.depth_max, 1)?;
        check_range("max_width", self.width_min, self.width_max, 1)?;
        if self.depth_max > i32::MAX as u32 || self.width_max > i32::MAX as u32 {
            return Err("max_depth and max_width must fit int32".to_string());
        }
        Ok(())
    }
}

/// One DRNN input.
#[derive(Clone, Debug, PartialEq)]
pub struct DrnnInstance {
    /// The `(1, hidden)` latent code, row-major.
    pub latent: Vec<f32>,
    /// Levels of the generated tree at most (1 = root only).
    pub max_depth: u32,
    /// Children per node at most.
    pub max_width: u32,
}

/// One DRNN input: latent ~ N(0, 1), then depth and width caps.
pub fn drnn(rng: &mut Rng, cfg: &DrnnConfig) -> DrnnInstance {
    let latent = (0..cfg.hidden).map(|_| rng.normal_f64() as f32).collect();
    let max_depth = uniform_incl(rng, cfg.depth_min, cfg.depth_max);
    let max_width = uniform_incl(rng, cfg.width_min, cfg.width_max);
    DrnnInstance {
        latent,
        max_depth,
        max_width,
    }
}

/// Appends a finite float in JSON (shortest representation that reads back as the same `f32`).
fn push_f32(out: &mut String, x: f32) {
    // serde_json writes non-finite floats as null; the generators only make finite ones.
    match serde_json::to_string(&x) {
        Ok(s) => out.push_str(&s),
        Err(_) => out.push_str("null"),
    }
}

/// `{"latent": [[...]], "max_depth": d, "max_width": w}`.
pub fn drnn_json(inst: &DrnnInstance) -> String {
    let mut out = String::from("{\"latent\": [[");
    for (i, &x) in inst.latent.iter().enumerate() {
        if i > 0 {
            out.push_str(", ");
        }
        push_f32(&mut out, x);
    }
    let _ = write!(
        out,
        "]], \"max_depth\": {}, \"max_width\": {}}}",
        inst.max_depth, inst.max_width
    );
    out
}

/// `count` DRNN instances from `seed`, as JSON lines.
pub fn drnn_many(seed: u64, count: usize, cfg: &DrnnConfig) -> Result<Vec<String>, String> {
    cfg.validate()?;
    let mut rng = Rng::new(seed);
    Ok((0..count)
        .map(|_| drnn_json(&drnn(&mut rng, cfg)))
        .collect())
}

// ---------------------------------------------------------------------------------------------
// Berxit

/// Shape of generated Berxit instances (see the module docs).
#[derive(Clone, Debug, PartialEq)]
pub struct BerxitConfig {
    /// Exit when the largest softmax probability exceeds this.
    pub threshold: f32,
    /// Token ids after `[CLS]` are drawn from `[0, vocab_size)`.
    pub vocab_size: u32,
    /// Sequence lengths (`[CLS]` included).
    pub lengths: Lengths,
}

/// How long generated sequences are.
#[derive(Clone, Debug, PartialEq)]
pub enum Lengths {
    /// Every sequence this long (the zoo's Berxit: 128, `Tensor[(128), int32]`), without
    /// positions.
    Fixed(usize),
    /// Every sequence this long, with positions (`--lengths N`, for the variable-length models).
    All(usize),
    /// Uniform in `[min, max]`.
    Uniform(usize, usize),
    /// Drawn uniformly from these (e.g. the lengths of SST's training sentences).
    Drawn(Vec<usize>),
}

impl Lengths {
    fn draw(&self, rng: &mut Rng) -> usize {
        match self {
            Lengths::Fixed(n) | Lengths::All(n) => *n,
            Lengths::Uniform(lo, hi) => {
                let span = (hi - lo + 1) as u32;
                lo + uniform_below(rng, 0, span) as usize
            }
            Lengths::Drawn(v) => {
                let i = uniform_below(rng, 0, v.len() as u32) as usize;
                v.get(i).copied().unwrap_or(1)
            }
        }
    }
}

impl Default for BerxitConfig {
    fn default() -> Self {
        BerxitConfig {
            threshold: 0.9,
            vocab_size: BERT_VOCAB_SIZE,
            lengths: Lengths::Fixed(BERXIT_SEQ_LEN),
        }
    }
}

impl BerxitConfig {
    /// Checks the threshold and the vocabulary size.
    pub fn validate(&self) -> Result<(), String> {
        if !self.threshold.is_finite() {
            return Err(format!(
                "the threshold must be a finite number, got {}",
                self.threshold
            ));
        }
        let (lo, hi) = match &self.lengths {
            Lengths::Fixed(n) | Lengths::All(n) => (*n, *n),
            Lengths::Uniform(lo, hi) => (*lo, *hi),
            Lengths::Drawn(v) => (
                v.iter().copied().min().unwrap_or(0),
                v.iter().copied().max().unwrap_or(0),
            ),
        };
        if lo > hi {
            return Err(format!(
                "the minimum sequence length {lo} is larger than the maximum {hi}"
            ));
        }
        if lo < 1 || hi > 512 {
            return Err(format!(
                "sequence lengths must be in [1, 512] ([CLS] and BERT's 512 positions), got \
                 {lo}..{hi}"
            ));
        }
        if self.vocab_size <= CLS_ID || self.vocab_size > i32::MAX as u32 {
            return Err(format!(
                "vocabulary size must be in ({CLS_ID}, 2^31), got {}",
                self.vocab_size
            ));
        }
        Ok(())
    }
}

/// One Berxit token sequence: `[CLS]` then uniform ids, as long as `cfg.lengths` draws.
pub fn berxit_tokens(rng: &mut Rng, cfg: &BerxitConfig) -> Vec<u32> {
    let n = cfg.lengths.draw(rng);
    std::iter::once(CLS_ID)
        .chain((1..n).map(|_| uniform_below(rng, 0, cfg.vocab_size)))
        .collect()
}

/// `{"tokens": [101, ...], "threshold": t}`.
pub fn berxit_json(tokens: &[u32], threshold: f32) -> String {
    let mut out = String::from("{\"tokens\": [");
    for (i, id) in tokens.iter().enumerate() {
        if i > 0 {
            out.push_str(", ");
        }
        let _ = write!(out, "{id}");
    }
    out.push_str("], \"threshold\": ");
    push_f32(&mut out, threshold);
    out.push('}');
    out
}

/// `{"tokens": [101, ...], "positions": [0, 1, ...], "threshold": t}`: the variable-length
/// models' input (`models/berxit_var_*.rly` read position embeddings by these ids).
pub fn berxit_var_json(tokens: &[u32], threshold: f32) -> String {
    let mut out = berxit_json(tokens, threshold);
    let at = out.find("], \"threshold\"").unwrap_or(out.len());
    let mut positions = String::from("], \"positions\": [");
    for i in 0..tokens.len() {
        if i > 0 {
            positions.push_str(", ");
        }
        let _ = write!(positions, "{i}");
    }
    out.insert_str(at, &positions);
    out
}

/// One instance line for `cfg`: with positions unless every sequence has the fixed length.
pub fn berxit_line(tokens: &[u32], cfg: &BerxitConfig) -> String {
    match cfg.lengths {
        Lengths::Fixed(_) => berxit_json(tokens, cfg.threshold),
        _ => berxit_var_json(tokens, cfg.threshold),
    }
}

/// `count` Berxit instances from `seed`, as JSON lines.
pub fn berxit_many(seed: u64, count: usize, cfg: &BerxitConfig) -> Result<Vec<String>, String> {
    cfg.validate()?;
    let mut rng = Rng::new(seed);
    Ok((0..count)
        .map(|_| berxit_line(&berxit_tokens(&mut rng, cfg), cfg))
        .collect())
}
