//! Randomized checks of two properties every relation must have:
//! - gradual soundness: if a call type-checks with concrete shapes, it also type-checks after any
//!   dims are replaced by `?`, and the result is the concrete result with some dims turned into `?`;
//! - exactness where it is cheap to recompute: `strided_slice` lengths against a brute-force count.
//!
//! A small deterministic xorshift generator stands in for a property-testing library.

use tumble_ir::attrs::Attr;
use tumble_ir::{AttrValue, Attrs, DType, Dim, Span, Ty};
use tumble_ops::lookup;

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
    fn range(&mut self, lo: i64, hi: i64) -> i64 {
        lo + self.below((hi - lo + 1) as u64) as i64
    }
    fn coin(&mut self) -> bool {
        self.below(2) == 0
    }
}

fn shape(r: &mut Rng, rank: usize) -> Vec<i64> {
    (0..rank)
        .map(|_| if r.below(4) == 0 { 1 } else { r.range(0, 4) })
        .collect()
}

fn tensor(s: &[i64], dtype: DType) -> Ty {
    Ty::tensor_of(s, dtype)
}

/// Replaces random dims (anywhere in the type) by `?`.
fn abstract_ty(r: &mut Rng, t: &Ty) -> Ty {
    match t {
        Ty::Tensor { shape, dtype } => Ty::tensor(
            shape
                .iter()
                .map(|&d| if r.below(3) == 0 { Dim::Any } else { d })
                .collect::<Vec<_>>(),
            *dtype,
        ),
        Ty::Tuple(ts) => Ty::Tuple(ts.iter().map(|t| abstract_ty(r, t)).collect()),
        other => other.clone(),
    }
}

/// Whether `general` is `concrete` with some dims replaced by `?`.
fn generalizes(general: &Ty, concrete: &Ty) -> bool {
    match (general, concrete) {
        (
            Ty::Tensor {
                shape: a,
                dtype: da,
            },
            Ty::Tensor {
                shape: b,
                dtype: db,
            },
        ) => {
            da == db && a.len() == b.len() && a.iter().zip(b).all(|(x, y)| *x == Dim::Any || x == y)
        }
        (Ty::Tuple(a), Ty::Tuple(b)) => {
            a.len() == b.len() && a.iter().zip(b).all(|(x, y)| generalizes(x, y))
        }
        (a, b) => a == b,
    }
}

fn attrs(kv: Vec<(&str, AttrValue)>) -> Attrs {
    Attrs(
        kv.into_iter()
            .map(|(k, v)| Attr {
                name: k.to_string(),
                value: v,
                span: Span::default(),
            })
            .collect(),
    )
}

fn ints(v: &[i64]) -> AttrValue {
    AttrValue::List(v.iter().map(|&n| AttrValue::Int(n)).collect())
}

/// A random call: operator name, concrete argument types, attributes.
fn random_call(r: &mut Rng) -> (&'static str, Vec<Ty>, Attrs) {
    use AttrValue::{Bool as B, Int as I};
    let f = DType::Float32;
    let rank = r.below(4) as usize;
    let s = shape(r, rank);
    let ax = || rank.max(1) as i64;
    match r.below(14) {
        0 => {
            let ops = ["add", "multiply", "maximum", "less", "equal"];
            let op = ops[r.below(ops.len() as u64) as usize];
            let rank2 = r.below(4) as usize;
            // Mostly compatible shapes: take s's suffix with some dims set to 1.
            let mut s2: Vec<i64> = s.iter().rev().take(rank2).rev().copied().collect();
            for d in s2.iter_mut() {
                if r.below(3) == 0 {
                    *d = 1;
                }
            }
            if r.below(5) == 0 {
                s2 = shape(r, rank2);
            }
            (op, vec![tensor(&s, f), tensor(&s2, f)], Attrs::default())
        }
        1 => {
            let k = r.range(0, 3);
            let n = r.range(0, 3);
            let mut data = s.clone();
            data.push(k);
            let wk = if r.below(6) == 0 { k + 1 } else { k };
            let units = if r.coin() {
                vec![("units", I(n))]
            } else {
                vec![]
            };
            (
                "nn.dense",
                vec![tensor(&data, f), tensor(&[n, wk], f)],
                attrs(units),
            )
        }
        2 => {
            let (b1, b2) = match r.below(3) {
                0 => (1, 3),
                1 => (2, 2),
                _ => (r.range(0, 3), r.range(0, 3)),
            };
            let (m, k, n) = (r.range(1, 3), r.range(0, 3), r.range(1, 3));
            (
                "nn.batch_matmul",
                vec![tensor(&[b1, m, k], f), tensor(&[b2, n, k], f)],
                Attrs::default(),
            )
        }
        3 => {
            let axis = r.range(-ax(), ax() - 1);
            let n = r.range(1, 3);
            let parts: Vec<Ty> = (0..n)
                .map(|_| {
                    let mut p = s.clone();
                    if let Some(i) =
                        usize::try_from(if axis < 0 { axis + rank as i64 } else { axis })
                            .ok()
                            .filter(|&i| i < p.len())
                    {
                        p[i] = r.range(0, 3);
                    }
                    tensor(&p, f)
                })
                .collect();
            (
                "concatenate",
                vec![Ty::Tuple(parts)],
                attrs(vec![("axis", I(axis))]),
            )
        }
        4 => {
            let len = r.below(4) as usize;
            let ns: Vec<i64> = (0..len).map(|_| r.range(-4, 4)).collect();
            let kv = vec![("newshape", ints(&ns)), ("allowzero", B(r.below(5) == 0))];
            ("reshape", vec![tensor(&s, f)], attrs(kv))
        }
        5 => {
            let mut perm: Vec<i64> = (0..rank as i64).collect();
            for i in (1..perm.len()).rev() {
                perm.swap(i, r.below(i as u64 + 1) as usize);
            }
            let kv = if r.coin() {
                vec![("axes", ints(&perm))]
            } else {
                vec![]
            };
            ("transpose", vec![tensor(&s, f)], attrs(kv))
        }
        6 => {
            let axes: Vec<i64> = (0..r.below(3)).map(|_| r.range(-ax(), ax() - 1)).collect();
            (
                "squeeze",
                vec![tensor(&s, f)],
                attrs(vec![("axis", ints(&axes))]),
            )
        }
        7 => {
            let irank = r.below(3) as usize;
            let idx = shape(r, irank);
            let kv = if r.coin() {
                vec![("axis", I(r.range(-ax(), ax() - 1)))]
            } else {
                vec![]
            };
            (
                "take",
                vec![tensor(&s, f), tensor(&idx, DType::Int32)],
                attrs(kv),
            )
        }
        8 => {
            let n = r.below(rank as u64 + 1) as usize;
            let b: Vec<i64> = (0..n).map(|_| r.range(-6, 6)).collect();
            let e: Vec<i64> = (0..n).map(|_| r.range(-6, 6)).collect();
            let st: Vec<i64> = (0..n)
                .map(|_| [1, 2, -1, -2][r.below(4) as usize])
                .collect();
            let mode = if r.below(4) == 0 { "size" } else { "end" };
            let kv = vec![
                ("begin", ints(&b)),
                ("end", ints(&e)),
                ("strides", ints(&st)),
                ("slice_mode", AttrValue::Str(mode.into())),
            ];
            ("strided_slice", vec![tensor(&s, f)], attrs(kv))
        }
        9 => {
            let ios = if r.coin() {
                I(r.range(1, 3))
            } else {
                let mut v: Vec<i64> = (0..r.below(3)).map(|_| r.range(1, 4)).collect();
                v.sort();
                v.dedup();
                ints(&v)
            };
            let kv = vec![
                ("indices_or_sections", ios),
                ("axis", I(r.range(-ax(), ax() - 1))),
            ];
            ("split", vec![tensor(&s, f)], attrs(kv))
        }
        10 => {
            let ops = ["sum", "mean", "argmax"];
            let op = ops[r.below(3) as usize];
            let axes: Vec<i64> = (0..r.below(3)).map(|_| r.range(-ax(), ax() - 1)).collect();
            let kv = vec![
                ("axis", ints(&axes)),
                ("keepdims", B(r.coin())),
                ("exclude", B(r.coin())),
            ];
            (op, vec![tensor(&s, f)], attrs(kv))
        }
        11 => {
            let b = s.get(1).copied().unwrap_or(1);
            let bias = if r.below(5) == 0 { b + 1 } else { b };
            (
                "nn.bias_add",
                vec![tensor(&s, f), tensor(&[bias], f)],
                Attrs::default(),
            )
        }
        12 => {
            let mut c = s.clone();
            if let Some(d) = c.first_mut() {
                *d = 1;
            }
            (
                "where",
                vec![tensor(&c, DType::Bool), tensor(&s, f), tensor(&[], f)],
                Attrs::default(),
            )
        }
        _ => {
            let axis = r.range(-ax() - 1, ax());
            let mut g = s.get(axis.rem_euclid(ax()) as usize).copied().unwrap_or(1);
            if r.below(5) == 0 {
                g += 1;
            }
            (
                "nn.layer_norm",
                vec![tensor(&s, f), tensor(&[g], f), tensor(&[g], f)],
                attrs(vec![("axis", I(axis))]),
            )
        }
    }
}

#[test]
fn gradual_soundness() {
    for seed in [0x9e37_79b9_7f4a_7c15, 0x2545_f491_4f6c_dd1d, 7] {
        gradual_soundness_from(seed);
    }
}

fn gradual_soundness_from(seed: u64) {
    let mut r = Rng(seed);
    let mut accepted = 0;
    for _ in 0..20_000 {
        let (op, args, at) = random_call(&mut r);
        let def = lookup(op).expect(op);
        let Ok(concrete) = (def.relation)(&args, &at) else {
            continue;
        };
        accepted += 1;
        for _ in 0..4 {
            let abs: Vec<Ty> = args.iter().map(|t| abstract_ty(&mut r, t)).collect();
            match (def.relation)(&abs, &at) {
                Ok(general) => assert!(
                    generalizes(&general, &concrete),
                    "{op}{:?} with {abs:?}: {general} does not generalize {concrete} (from {args:?})",
                    at.0.iter().map(|a| format!("{}={}", a.name, a.value)).collect::<Vec<_>>()
                ),
                Err(e) => panic!(
                    "{op}{:?}: concrete {args:?} accepted ({concrete}) but abstract {abs:?} rejected: {}",
                    at.0.iter().map(|a| format!("{}={}", a.name, a.value)).collect::<Vec<_>>(),
                    e.message
                ),
            }
        }
    }
    assert!(accepted > 5_000, "only {accepted} calls accepted");
}

/// Python's `len(range(d)[b:e:s])`, counted element by element.
fn python_slice_len(d: i64, b: Option<i64>, e: Option<i64>, s: i64) -> i64 {
    let clamp = |v: i64, lo: i64, hi: i64| v.max(lo).min(hi);
    let (lo, hi) = if s > 0 { (0, d) } else { (-1, d - 1) };
    let fix = |v: i64| clamp(if v < 0 { v + d } else { v }, lo, hi);
    let b = b.map_or(if s > 0 { 0 } else { d - 1 }, fix);
    let e = e.map_or(if s > 0 { d } else { -1 }, fix);
    (0..d)
        .filter(|&j| {
            if s > 0 {
                j >= b && j < e && (j - b) % s == 0
            } else {
                j <= b && j > e && (b - j) % (-s) == 0
            }
        })
        .count() as i64
}

#[test]
fn strided_slice_matches_python() {
    let slice = lookup("strided_slice").unwrap();
    for d in 0..7i64 {
        for b in -9..9i64 {
            for e in -9..9i64 {
                for s in [-3i64, -2, -1, 1, 2, 3] {
                    let at = attrs(vec![
                        ("begin", ints(&[b])),
                        ("end", ints(&[e])),
                        ("strides", ints(&[s])),
                    ]);
                    let got =
                        (slice.relation)(&[Ty::tensor_of(&[d], DType::Float32)], &at).unwrap();
                    let want = python_slice_len(d, Some(b), Some(e), s);
                    assert_eq!(
                        got,
                        Ty::tensor_of(&[want], DType::Float32),
                        "range({d})[{b}:{e}:{s}]"
                    );
                }
                // Omitted end/begin (shorter lists) on a second axis.
                let at = attrs(vec![
                    ("begin", ints(&[0, b])),
                    ("end", ints(&[d])),
                    ("strides", ints(&[1, -1])),
                ]);
                let got = (slice.relation)(&[Ty::tensor_of(&[d, d], DType::Float32)], &at).unwrap();
                let want = python_slice_len(d, Some(b), None, -1);
                assert_eq!(
                    got,
                    Ty::tensor_of(&[d, want], DType::Float32),
                    "range({d})[{b}::-1]"
                );
                // A `strides` shorter than `begin`: Relay pads it with 1 (a one-entry list is
                // not every axis's stride).
                let at = attrs(vec![
                    ("begin", ints(&[b, b])),
                    ("end", ints(&[e, e])),
                    ("strides", ints(&[2])),
                ]);
                let got = (slice.relation)(&[Ty::tensor_of(&[d, d], DType::Float32)], &at).unwrap();
                let want = [
                    python_slice_len(d, Some(b), Some(e), 2),
                    python_slice_len(d, Some(b), Some(e), 1),
                ];
                assert_eq!(
                    got,
                    Ty::tensor_of(&want, DType::Float32),
                    "x[{b}:{e}:2, {b}:{e}]"
                );
            }
        }
    }
}
