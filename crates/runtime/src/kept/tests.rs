use super::*;
use crate::batched::OpStats;
use tumble_compile::blocks::{BlockInput, OutputShape};
use tumble_ir::attrs::Attr;
use tumble_ir::{AttrValue, Attrs, DType, Dim, Span};
use tumble_ops::OpCtx;

fn f32_ty() -> Ty {
    Ty::Tensor {
        shape: vec![Dim::Any],
        dtype: DType::Float32,
    }
}

fn node(op: &str, args: Vec<BVal>, attrs: Attrs, ty: Ty) -> BlockNode {
    BlockNode {
        op: tumble_ops::lookup(op).unwrap_or_else(|| panic!("no operator {op}")),
        args: args.into_iter().map(BArg::One).collect(),
        attrs,
        ty,
        span: Span::default(),
        calls: Vec::new(),
    }
}

fn plain(op: &str, args: Vec<BVal>) -> BlockNode {
    node(op, args, Attrs::default(), f32_ty())
}

fn block(nodes: Vec<BlockNode>, outputs: Vec<BVal>) -> Block {
    let input = |name: &str| BlockInput {
        name: name.into(),
        ty: f32_ty(),
    };
    Block {
        name: "cell".into(),
        inputs: vec![input("x"), input("W"), input("b")],
        output_shape: match outputs.len() {
            1 => OutputShape::Single,
            _ => OutputShape::Tuple,
        },
        nodes,
        outputs,
        primitive: true,
        span: Span::default(),
    }
}

/// `tanh(bias_add(dense(x, W), b))`; with `read_twice`, the product is also read by a
/// `multiply`, the block's second output.
fn dense_bias_tanh(read_twice: bool) -> Block {
    let mut nodes = vec![
        plain("nn.dense", vec![BVal::Input(0), BVal::Input(1)]),
        plain("nn.bias_add", vec![BVal::Node(0), BVal::Input(2)]),
        plain("tanh", vec![BVal::Node(1)]),
    ];
    let mut outputs = vec![BVal::Node(2)];
    if read_twice {
        nodes.push(plain("multiply", vec![BVal::Node(0), BVal::Node(2)]));
        outputs.push(BVal::Node(3));
    }
    block(nodes, outputs)
}

/// An LSTM-like cell: `s = split(bias_add(dense(x, W), b), 3, axis=1)`, then
/// `sigmoid(s.0) * tanh(s.2) + exp(s.1)`, or, with `third` given, that operator on `s.2` (which
/// may make the split not fusable).
fn gates(third: &str) -> Block {
    let attr = |name: &str, value| Attr {
        name: name.into(),
        value,
        span: Span::default(),
    };
    let split_attrs = Attrs(vec![
        attr("indices_or_sections", AttrValue::Int(3)),
        attr("axis", AttrValue::Int(1)),
    ]);
    let split_ty = Ty::Tuple(vec![f32_ty(), f32_ty(), f32_ty()]);
    let nodes = vec![
        plain("nn.dense", vec![BVal::Input(0), BVal::Input(1)]),
        plain("nn.bias_add", vec![BVal::Node(0), BVal::Input(2)]),
        node("split", vec![BVal::Node(1)], split_attrs, split_ty),
        plain("sigmoid", vec![BVal::Field(2, 0)]),
        plain(third, vec![BVal::Field(2, 2)]),
        plain("multiply", vec![BVal::Node(3), BVal::Node(4)]),
        plain("exp", vec![BVal::Field(2, 1)]),
        plain("add", vec![BVal::Node(5), BVal::Node(6)]),
    ];
    block(nodes, vec![BVal::Node(7)])
}

fn values(len: usize, seed: u64) -> Vec<f32> {
    let mut rng = tumble_tensor::Rng::new(seed);
    (0..len)
        .map(|_| (rng.uniform_f64() * 4.0 - 2.0) as f32)
        .collect()
}

fn bits(v: &BV) -> Vec<u32> {
    let ts: Vec<&Tensor> = match v {
        BV::Batched(OpValue::Tensor(t)) | BV::Shared(OpValue::Tensor(t)) => vec![t],
        BV::Batched(OpValue::Tuple(ts)) | BV::Shared(OpValue::Tuple(ts)) => ts.iter().collect(),
        other => panic!("not a tensor: {other:?}"),
    };
    let mut out = Vec::new();
    for t in ts {
        out.extend(t.shape().iter().map(|&d| d as u32));
        out.extend(t.as_f32().unwrap_or_default().iter().map(|x| x.to_bits()));
    }
    out
}

/// A launch of `b` rows of `k` through `block` against `n` outputs with `fusions`, on the
/// training forward's fast paths: every kept result (`.0`) and operand (`.1`), as bits.
fn kept_bits(
    block: &Block,
    (b, k, n): (usize, usize, usize),
    fusions: &Fusions,
) -> (Vec<Vec<u32>>, Vec<Vec<Vec<u32>>>) {
    let tensor = |shape: Vec<usize>, seed| {
        let len = shape.iter().product();
        Tensor::from_vec(shape, values(len, seed)).unwrap_or_else(|e| panic!("{e}"))
    };
    let inputs = vec![
        BV::Batched(OpValue::Tensor(tensor(vec![b, 1, k], 1))),
        BV::Shared(OpValue::Tensor(tensor(vec![n, k], 2))),
        BV::Shared(OpValue::Tensor(tensor(vec![n], 3))),
    ];
    let mut rng = tumble_tensor::Rng::new(0);
    let mut octx = OpCtx { rng: &mut rng };
    let mut stats = OpStats::default();
    let mut ops = LaunchOps {
        octx: &mut octx,
        stats: &mut stats,
        fast: crate::backward::fast::eval,
        threads: 1,
    };
    let kept =
        run_kept(block, inputs, b, &mut ops, None, fusions).unwrap_or_else(|e| panic!("{e}"));
    (
        kept.results.iter().map(bits).collect(),
        kept.args
            .iter()
            .map(|a| a.iter().map(bits).collect())
            .collect(),
    )
}

// Odd sizes: the kernel's row tiles and panels, and the vector loops, end mid-way.
const SIZES: [(usize, usize, usize); 4] = [(1, 1, 3), (5, 13, 21), (17, 33, 69), (3, 256, 768)];

#[test]
fn a_product_read_only_by_its_bias_add_takes_the_bias_in_its_epilogue() {
    let only_bias = Biased {
        product: 0,
        bias: 1,
        activation: None,
    };
    assert_eq!(
        bias_epilogues(&dense_bias_tanh(false), false),
        vec![only_bias]
    );
    // With the f32 vjps, the `tanh` reading the sum goes into the epilogue too.
    let with_tanh = Biased {
        product: 0,
        bias: 1,
        activation: Some(2),
    };
    assert_eq!(
        bias_epilogues(&dense_bias_tanh(false), true),
        vec![with_tanh]
    );
    // Read by another operator: its own value is needed.
    assert!(bias_epilogues(&dense_bias_tanh(true), true).is_empty());
    // The sum read by another operator besides the activation: the bias only.
    let mut sum_read_twice = dense_bias_tanh(false);
    sum_read_twice
        .nodes
        .push(plain("multiply", vec![BVal::Node(1), BVal::Node(2)]));
    sum_read_twice.outputs = vec![BVal::Node(3)];
    let expected = Biased {
        product: 0,
        bias: 1,
        activation: None,
    };
    assert_eq!(bias_epilogues(&sum_read_twice, true), vec![expected]);
}

#[test]
fn the_bias_epilogue_keeps_every_value_s_bits() {
    let block = dense_bias_tanh(false);
    let fused = Fusions {
        biased: vec![Biased {
            product: 0,
            bias: 1,
            activation: None,
        }],
        ..Fusions::default()
    };
    for size in SIZES {
        let (fr, fa) = kept_bits(&block, size, &fused);
        let (ar, aa) = kept_bits(&block, size, &Fusions::default());
        // The product (and bias_add's operand, which is it) is kept as the sum, which no vjp
        // tells from the product: every other value is the same.
        assert_eq!(fr[1..], ar[1..], "results at {size:?}");
        assert_eq!(fr[0], ar[1], "the product kept as the sum at {size:?}");
        assert_eq!(fa[0], aa[0], "dense's operands at {size:?}");
        assert_eq!(
            fa[1][0], ar[1],
            "bias_add's operand kept as the sum at {size:?}"
        );
        assert_eq!(fa[1][1..], aa[1][1..], "the bias at {size:?}");
        assert_eq!(fa[2..], aa[2..], "the other operands at {size:?}");
    }
}

#[test]
fn a_split_read_only_by_unary_operators_is_found() {
    let found = split_unaries(&gates("tanh"));
    assert_eq!(
        found,
        vec![SplitUnaries {
            split: 2,
            readers: vec![3, 6, 4]
        }]
    );
    // `nn.relu`'s vjp reads its operand: not fused.
    assert!(split_unaries(&gates("nn.relu")).is_empty());
    // Only with the f32 vjps, which read these operators' results.
    assert!(Fusions::of(&gates("tanh"), false).split_unaries.is_empty());
    assert_eq!(Fusions::of(&gates("tanh"), true).split_unaries, found);
}

#[test]
fn a_split_part_read_twice_or_returned_is_not_fused() {
    let mut twice = gates("tanh");
    twice.nodes.push(plain("negative", vec![BVal::Field(2, 0)]));
    assert!(split_unaries(&twice).is_empty());
    let mut returned = gates("tanh");
    returned.outputs.push(BVal::Field(2, 1));
    assert!(split_unaries(&returned).is_empty());
}

#[test]
fn split_unaries_keep_the_results_bits() {
    let block = gates("tanh");
    let fused = Fusions::of(&block, true);
    let expected = Biased {
        product: 0,
        bias: 1,
        activation: None,
    };
    assert_eq!(fused.biased, vec![expected]);
    let apart = Fusions::default();
    for size in SIZES {
        let (fr, fa) = kept_bits(&block, size, &fused);
        let (ar, aa) = kept_bits(&block, size, &apart);
        // The unary operators' results, and everything after them.
        for j in 3..8 {
            assert_eq!(fr[j], ar[j], "node {j}'s result at {size:?}");
        }
        // The split keeps its readers' results in place of its parts (the same shapes), and the
        // readers them as their operands: what the f32 vjps read of them is their results.
        assert_eq!(
            fr[2],
            [ar[3].clone(), ar[6].clone(), ar[4].clone()].concat()
        );
        assert_eq!(fa[3][0], ar[3], "sigmoid's operand at {size:?}");
        assert_eq!(fa[4][0], ar[4], "tanh's operand at {size:?}");
        assert_eq!(fa[6][0], ar[6], "exp's operand at {size:?}");
        assert_eq!(fa[5], aa[5], "multiply's operands at {size:?}");
        assert_eq!(fa[7], aa[7], "add's operands at {size:?}");
    }
}

#[test]
fn the_activation_epilogue_keeps_the_results_bits() {
    for op in RESULT_ONLY_VJP_UNARIES {
        let mut block = dense_bias_tanh(false);
        block.nodes[2] = plain(op, vec![BVal::Node(1)]);
        let fused = Fusions::of(&block, true);
        let expected = Biased {
            product: 0,
            bias: 1,
            activation: Some(2),
        };
        assert_eq!(fused.biased, vec![expected], "{op}");
        for size in SIZES {
            let (fr, fa) = kept_bits(&block, size, &fused);
            let (ar, aa) = kept_bits(&block, size, &Fusions::default());
            // The activation's result, kept for all three nodes (what the f32 vjps read of the
            // product and the sum is their shapes; the activation's, its result).
            for (j, r) in fr.iter().enumerate() {
                assert_eq!(*r, ar[2], "{op}: node {j}'s result at {size:?}");
            }
            assert_eq!(fa[0], aa[0], "{op}: dense's operands at {size:?}");
            assert_eq!(fa[1][1..], aa[1][1..], "{op}: the bias at {size:?}");
            assert_eq!(
                fa[2][0], ar[2],
                "{op}: the activation's operand at {size:?}"
            );
        }
    }
}

#[test]
fn the_fusions_for_the_reference_vjps_are_those_found_for_them() {
    let mut sum_and_gate = dense_bias_tanh(false);
    sum_and_gate.nodes[2] = plain("sigmoid", vec![BVal::Node(1)]);
    for block in [
        gates("tanh"),
        gates("nn.relu"),
        dense_bias_tanh(false),
        sum_and_gate,
    ] {
        assert_eq!(
            Fusions::of(&block, true).for_reference_vjps(),
            Fusions::of(&block, false)
        );
    }
}

/// `dense(x, W) + b` written with `add`, the product on either side: the same fusion as
/// `nn.bias_add`, the same bits, with and without the gate.
#[test]
fn a_plainly_written_bias_is_fused_too() {
    for (swap, op) in [(false, "tanh"), (true, "sigmoid"), (false, "multiply")] {
        let mut block = dense_bias_tanh(false);
        let sum = match swap {
            false => vec![BVal::Node(0), BVal::Input(2)],
            true => vec![BVal::Input(2), BVal::Node(0)],
        };
        block.nodes[1] = plain("add", sum);
        // `multiply(sum, sum)`: no gate to fuse (its vjp reads its operands).
        let gate = match op {
            "multiply" => vec![BVal::Node(1), BVal::Node(1)],
            _ => vec![BVal::Node(1)],
        };
        block.nodes[2] = plain(op, gate);
        let fused = Fusions::of(&block, true);
        let expected = Biased {
            product: 0,
            bias: 1,
            activation: (op != "multiply").then_some(2),
        };
        assert_eq!(fused.biased, vec![expected], "{op}, swapped {swap}");
        for size in SIZES {
            let (fr, _) = kept_bits(&block, size, &fused);
            let (ar, _) = kept_bits(&block, size, &Fusions::default());
            assert_eq!(fr[2], ar[2], "{op}, swapped {swap}: the result at {size:?}");
            if op == "multiply" {
                assert_eq!(fr[0], ar[1], "the product kept as the sum at {size:?}");
                assert_eq!(fr[1], ar[1], "the sum at {size:?}");
            }
        }
    }
}
