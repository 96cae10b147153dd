//! Differential testing of ragged batching on generated programs: random chains of row-wise
//! operators (dense, biases, activations, layer norms, softmax over the row, reshapes and
//! transposes that keep the row axis, lookups from a table) over inputs of a `?` length,
//! interleaved with operators that mix an instance's rows (softmax and sums over the rows,
//! self-attention by batched products, single-head and two-head in a BERT layer's form) and work
//! on a constant slice of the rows (the first row),
//! checked against the reference under every scheduler and batch size, with ragged batching on,
//! off and in tiny chunks (`check_all_ways`), on instances of lengths 0 to 12.
//!
//! `TUMBLE_RAGGED_GEN_COUNT` (default 24) programs from `TUMBLE_RAGGED_GEN_SEED` (default 0); a
//! failure names the seed and prints the program.

mod common;

use std::fmt::Write;
use std::panic::{catch_unwind, AssertUnwindSafe};

use common::{check_all_ways, expected, load_text};

/// A small deterministic generator (xorshift64*), so programs do not depend on another crate's
/// random streams.
struct Gen(u64);

impl Gen {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
    fn chance(&mut self, p: f64) -> bool {
        (self.next() % 1000) as f64 / 1000.0 < p
    }
}

struct Program {
    text: String,
    /// Instances need at least one row (the program slices the first row).
    min_len: usize,
    /// The program reads token ids `%t` (else float rows `%x`).
    tokens: bool,
}

/// A generated program: `@main` over `%x: (?, W)` or token ids `%t: (?)`, returning the last rows
/// value and a per-instance summary.
fn generate(seed: u64) -> Program {
    let mut g = Gen(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1);
    let widths = [2usize, 3, 4, 6];
    let mut params: Vec<String> = Vec::new();
    let mut body = String::new();
    let mut n = 0usize;
    let mut fresh = |prefix: &str| {
        n += 1;
        format!("%{prefix}{n}")
    };
    let tokens = g.chance(0.3);
    let mut w = widths[g.below(widths.len())];
    // Rows values in scope: (name, width).
    let mut rows: Vec<(String, usize)> = Vec::new();
    let start = if tokens {
        params.push(format!("%emb: Tensor[(7, {w}), float32]"));
        let v = fresh("v");
        let _ = writeln!(body, "  let {v} = take(%emb, %t, axis=0);");
        v
    } else {
        "%x".to_string()
    };
    let in_w = w;
    rows.push((start.clone(), w));
    let mut cur = start;
    let mut min_len = 0;
    let mut summary: Option<String> = None;
    let steps = 3 + g.below(8);
    for _ in 0..steps {
        let v = fresh("v");
        let expr = match g.below(14) {
            0 | 1 => {
                let w2 = widths[g.below(widths.len())];
                let p = fresh("w");
                params.push(format!("{p}: Tensor[({w2}, {w}), float32]"));
                let e = format!("nn.dense({cur}, {p})");
                w = w2;
                e
            }
            2 => {
                let p = fresh("b");
                params.push(format!("{p}: Tensor[({w}), float32]"));
                format!("nn.bias_add({cur}, {p})")
            }
            3 => {
                let f = ["tanh", "sigmoid", "nn.relu", "negative"][g.below(4)];
                format!("{f}({cur})")
            }
            4 => match rows.iter().find(|(_, rw)| *rw == w) {
                Some((other, _)) => format!("add({cur}, multiply({other}, 0.5f))"),
                None => format!("multiply({cur}, 1.5f)"),
            },
            5 => {
                let (gp, bp) = (fresh("g"), fresh("b"));
                params.push(format!("{gp}: Tensor[({w}), float32]"));
                params.push(format!("{bp}: Tensor[({w}), float32]"));
                // A large epsilon: rows of nearly equal values (after a sigmoid) would amplify the
                // fused kernels' last-bit differences past the comparison's tolerance.
                format!("nn.layer_norm({cur}, {gp}, {bp}, epsilon=0.1)")
            }
            6 => format!("nn.softmax({cur}, axis=-1)"),
            7 if w % 2 == 0 => format!(
                "reshape(transpose(reshape({cur}, newshape=[-1, 2, {h}]), axes=[0, 2, 1]), \
                 newshape=[-1, {w}])",
                h = w / 2
            ),
            // Mixing: over the rows of one instance.
            8 => format!("nn.softmax({cur}, axis=0)"),
            9 => format!("add({cur}, sum({cur}, axis=[0], keepdims=True))"),
            10 => format!(
                "reshape(nn.batch_matmul(nn.softmax(nn.batch_matmul(expand_dims({cur}, axis=0), \
                 expand_dims({cur}, axis=0)), axis=-1), expand_dims({cur}, axis=0), \
                 transpose_b=False), newshape=[-1, {w}])"
            ),
            // Two-head attention as a BERT layer writes it (Q, K, V split into heads by a
            // reshape and a transpose, the context transposed back): the ragged attention kernel.
            12 if w % 2 == 0 => {
                let heads = |x: String| {
                    format!(
                        "transpose(reshape({x}, newshape=[-1, 2, {h}]), axes=[1, 0, 2])",
                        h = w / 2
                    )
                };
                let (q, k, v) = (
                    heads(cur.clone()),
                    heads(format!("tanh({cur})")),
                    heads(format!("sigmoid({cur})")),
                );
                format!(
                    "reshape(transpose(nn.batch_matmul(nn.softmax(multiply(nn.batch_matmul({q}, {k}), \
                     0.7f), axis=-1), {v}, transpose_b=False), axes=[1, 0, 2]), newshape=[-1, {w}])"
                )
            }
            // The first row, then static-shape work on it.
            11 if summary.is_none() => {
                min_len = 1;
                let p = fresh("w");
                params.push(format!("{p}: Tensor[(2, {w}), float32]"));
                summary = Some(format!(
                    "tanh(nn.dense(strided_slice({cur}, begin=[0, 0], end=[1, {w}], \
                     strides=[1, 1]), {p}))"
                ));
                format!("tanh({cur})")
            }
            _ => {
                let p = fresh("c");
                params.push(format!("{p}: Tensor[({w}), float32]"));
                format!("multiply({cur}, {p})")
            }
        };
        let _ = writeln!(body, "  let {v} = {expr};");
        rows.push((v.clone(), w));
        cur = v;
    }
    let (sum_expr, sum_ty) = match summary {
        Some(s) => (s, "Tensor[(1, 2), float32]".to_string()),
        None => (
            format!("sum({cur}, axis=[0])"),
            format!("Tensor[({w}), float32]"),
        ),
    };
    let input = if tokens {
        "%t: Tensor[(?), int32]".to_string()
    } else {
        format!("%x: Tensor[(?, {in_w}), float32]")
    };
    let mut all = vec![input];
    all.extend(params);
    let text = format!(
        "#[version = \"0.0.5\"]\ndef @main({}) -> (Tensor[(?, {w}), float32], {sum_ty}) {{\n{body}  ({cur}, {sum_expr})\n}}\n",
        all.join(", ")
    );
    Program {
        text,
        min_len,
        tokens,
    }
}

/// Instances of lengths `min_len..=12` (0 and 1 included where allowed), `count` of them.
fn instances(p: &Program, in_w: usize, count: usize, seed: u64) -> String {
    let mut g = Gen(seed.wrapping_add(77) | 1);
    (0..count)
        .map(|i| {
            let l = match i {
                0 => p.min_len,
                1 => 1,
                _ => p.min_len + g.below(13 - p.min_len),
            };
            if p.tokens {
                let t: Vec<String> = (0..l).map(|_| g.below(7).to_string()).collect();
                format!("{{\"t\": [{}]}}", t.join(", "))
            } else {
                let rows: Vec<String> = (0..l)
                    .map(|_| {
                        let r: Vec<String> = (0..in_w)
                            .map(|_| format!("{:.3}", g.below(2001) as f64 / 1000.0 - 1.0))
                            .collect();
                        format!("[{}]", r.join(", "))
                    })
                    .collect();
                format!("{{\"x\": [{}]}}", rows.join(", "))
            }
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// The input width of a generated program (from its text).
fn input_width(text: &str) -> usize {
    text.split("%x: Tensor[(?, ")
        .nth(1)
        .and_then(|r| r.split(')').next())
        .and_then(|d| d.parse().ok())
        .unwrap_or(0)
}

#[test]
fn generated_ragged_programs_agree_with_the_reference() {
    let from: u64 = std::env::var("TUMBLE_RAGGED_GEN_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    let count: u64 = std::env::var("TUMBLE_RAGGED_GEN_COUNT")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(24);
    for seed in from..from + count {
        let p = generate(seed);
        let inputs = instances(&p, input_width(&p.text), 40, seed);
        let args: &[&str] = if p.tokens { &["t"] } else { &["x"] };
        let name = format!("ragged_gen_{seed}");
        let run = catch_unwind(AssertUnwindSafe(|| {
            let l = load_text(&name, &p.text);
            let mut x = expected(&name, l, &inputs, args);
            // Sums over up to 12 rows of values up to ~10 (attention, sums over rows): float32
            // rounding in another order is a few 1e-6 there.
            x.atol = 1e-4;
            check_all_ways(&x);
        }));
        if let Err(e) = run {
            let msg = e
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| e.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_default();
            panic!("seed {seed}: {msg}\nprogram:\n{}", p.text);
        }
    }
}

#[test]
fn generated_programs_use_ragged_launches() {
    // The generator is only useful if its programs do run ragged: most of them must.
    let mut ragged = 0;
    for seed in 0..24 {
        let p = generate(seed);
        let inputs = instances(&p, input_width(&p.text), 40, seed);
        let args: &[&str] = if p.tokens { &["t"] } else { &["x"] };
        let name = format!("ragged_gen_{seed}");
        let x = expected(&name, load_text(&name, &p.text), &inputs, args);
        let profile = common::batch_profile(&x, tumble_runtime::Options::default());
        if profile.ragged_launches > 0 {
            ragged += 1;
        }
    }
    assert!(
        ragged >= 18,
        "only {ragged} of 24 generated programs ran ragged"
    );
}
