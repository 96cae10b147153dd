use super::*;
use crate::lower::LowerOptions;
use crate::program::Program;

fn block_of(src: &str, name: &str) -> Block {
    let mut sources = tumble_ir::SourceMap::new();
    let typed = tumble_check::load(&mut sources, "t.rly", src, Default::default())
        .unwrap_or_else(|e| panic!("{e:?}"));
    let program =
        Program::lower_with(&typed, LowerOptions::batched()).unwrap_or_else(|e| panic!("{e:?}"));
    program
        .blocks
        .into_iter()
        .find(|b| b.name == name)
        .unwrap_or_else(|| panic!("no block {name}"))
}

/// The ragged form with the block's `?`-led inputs per instance and the others weights.
fn ragged(b: &Block) -> Option<RaggedBlock> {
    let per_instance: Vec<bool> = b
        .inputs
        .iter()
        .map(|i| matches!(i.ty.as_tensor(), Some((d, _)) if d.first() == Some(&Dim::Any)))
        .collect();
    analyze(b, &per_instance)
}

/// Per segment: row-wise or not, and its operators' names.
fn shape_of(r: &RaggedBlock) -> Vec<(bool, Vec<&'static str>)> {
    r.segments
        .iter()
        .map(|s| {
            (
                s.row_wise,
                s.block.nodes.iter().map(|n| n.op.name).collect(),
            )
        })
        .collect()
}

#[test]
fn a_row_wise_block_is_one_row_wise_segment() {
    let src = "def @f(%x: Tensor[(?, 4), float32], %w: Tensor[(8, 4), float32], \
               %b: Tensor[(8), float32], %g: Tensor[(8), float32], Primitive=1) {
                 nn.layer_norm(tanh(nn.bias_add(nn.dense(%x, %w), %b)), %g, %b)
               }
               def @main(%x: Tensor[(?, 4), float32]) { %x }";
    let r = ragged(&block_of(src, "f")).expect("ragged");
    assert_eq!(
        r.inputs,
        vec![
            RaggedInput::Rows,
            RaggedInput::Shared,
            RaggedInput::Shared,
            RaggedInput::Shared
        ]
    );
    assert_eq!(
        shape_of(&r),
        vec![(
            true,
            vec!["nn.dense", "nn.bias_add", "tanh", "nn.layer_norm"]
        )]
    );
    assert_eq!(r.segments[0].reads.len(), 4);
    assert_eq!(r.segments[0].defines.len(), 1);
}

#[test]
fn reductions_over_the_sequence_axis_are_mixing() {
    // The example: dense and tanh per row, softmax and sum over the rows.
    let src = "def @f(%x: Tensor[(?, 4), float32], %w: Tensor[(8, 4), float32], Primitive=1) {
                 let %h = tanh(nn.dense(%x, %w));
                 sum(nn.softmax(%h, axis=0), axis=[0])
               }
               def @main(%x: Tensor[(?, 4), float32]) { %x }";
    let r = ragged(&block_of(src, "f")).expect("ragged");
    assert_eq!(
        shape_of(&r),
        vec![
            (true, vec!["nn.dense", "tanh"]),
            (false, vec!["nn.softmax", "sum"])
        ]
    );
    // tanh's result crosses into the mixing segment.
    assert_eq!(r.segments[1].reads.len(), 1);
    assert!(matches!(r.segments[0].defines[..], [BVal::Node(1)]));
}

#[test]
fn attention_rows_come_back_as_rows() {
    // Projections per row, attention mixing, then the output projection per row again: three
    // segments, not one per operator.
    let src = "def @f(%x: Tensor[(?, 8), float32], %wq: Tensor[(8, 8), float32], \
               %wk: Tensor[(8, 8), float32], %wo: Tensor[(8, 8), float32], Primitive=1) {
                 let %q = transpose(reshape(nn.dense(%x, %wq), newshape=[-1, 2, 4]), axes=[1, 0, 2]);
                 let %k = transpose(reshape(nn.dense(%x, %wk), newshape=[-1, 2, 4]), axes=[1, 0, 2]);
                 let %p = nn.softmax(nn.batch_matmul(%q, %k), axis=-1);
                 let %c = nn.batch_matmul(%p, %q, transpose_b=False);
                 let %m = reshape(transpose(%c, axes=[1, 0, 2]), newshape=[-1, 8]);
                 add(nn.dense(%m, %wo), %x)
               }
               def @main(%x: Tensor[(?, 8), float32]) { %x }";
    let r = ragged(&block_of(src, "f")).expect("ragged");
    let segs = shape_of(&r);
    assert_eq!(segs.len(), 3, "{segs:?}");
    assert_eq!(
        segs[0],
        (true, vec!["nn.dense", "reshape", "nn.dense", "reshape"])
    );
    assert!(!segs[1].0);
    assert_eq!(segs[2], (true, vec!["reshape", "nn.dense", "add"]));
    // The last segment reads the input rows and the attention's rows.
    assert_eq!(r.segments[2].reads.len(), 3, "{:?}", r.segments[2].reads);
}

#[test]
fn attention_written_with_dense_products_comes_back_as_rows() {
    // `nn.dense(%p, transpose(%v))` is the instance's rows again: the output projection and
    // what follows it run row-wise, not once per group of equal lengths (an audit's find).
    let src = "def @f(%x: Tensor[(?, 8), float32], %wq: Tensor[(8, 8), float32], \
               %wo: Tensor[(8, 8), float32], Primitive=1) {
                 let %q = nn.dense(%x, %wq);
                 let %p = nn.softmax(nn.dense(%q, %x), axis=-1);
                 let %c = nn.dense(%p, transpose(%x));
                 tanh(add(nn.dense(%c, %wo), %x))
               }
               def @main(%x: Tensor[(?, 8), float32]) { %x }";
    let r = ragged(&block_of(src, "f")).expect("ragged");
    let segs = shape_of(&r);
    assert_eq!(segs.len(), 3, "{segs:?}");
    assert!(segs[0].0 && !segs[1].0, "{segs:?}");
    assert_eq!(segs[2], (true, vec!["nn.dense", "add", "tanh"]), "{segs:?}");
}

#[test]
fn blocks_without_a_leading_unknown_dim_or_row_work_are_not_ragged() {
    let fixed = "def @f(%x: Tensor[(3, 4), float32], %w: Tensor[(8, 4), float32], Primitive=1) {
                   tanh(nn.dense(%x, %w))
                 }
                 def @main(%x: Tensor[(3, 4), float32]) { %x }";
    assert!(ragged(&block_of(fixed, "f")).is_none());
    let only_mixing = "def @f(%x: Tensor[(?, 4), float32], Primitive=1) {
                         sum(%x, axis=[0])
                       }
                       def @main(%x: Tensor[(?, 4), float32]) { %x }";
    assert!(ragged(&block_of(only_mixing, "f")).is_none());
    let inner_unknown = "def @f(%x: Tensor[(4, ?), float32], Primitive=1) { tanh(%x) }
                         def @main(%x: Tensor[(4, ?), float32]) { %x }";
    assert!(ragged(&block_of(inner_unknown, "f")).is_none());
}

#[test]
fn a_per_instance_vector_added_to_rows_is_mixing() {
    // sum over the rows is one vector per instance: adding it back to the rows needs each
    // instance's own vector, which a launch over concatenated rows does not have.
    let src = "def @f(%x: Tensor[(?, 4), float32], Primitive=1) {
                 let %t = tanh(%x);
                 add(%t, sum(%t, axis=[0]))
               }
               def @main(%x: Tensor[(?, 4), float32]) { %x }";
    let r = ragged(&block_of(src, "f")).expect("ragged");
    assert_eq!(
        shape_of(&r),
        vec![(true, vec!["tanh"]), (false, vec!["sum", "add"])]
    );
}

#[test]
fn embedding_lookups_of_token_rows_are_row_wise() {
    let src = "def @f(%t: Tensor[(?), int32], %e: Tensor[(10, 4), float32], Primitive=1) {
                 tanh(take(%e, %t, axis=0))
               }
               def @main(%t: Tensor[(?), int32]) { %t }";
    let r = ragged(&block_of(src, "f")).expect("ragged");
    assert_eq!(shape_of(&r), vec![(true, vec!["take", "tanh"])]);
}

#[test]
fn work_after_the_first_row_is_taken_runs_for_all_instances_at_once() {
    // Berxit's exit: the [CLS] row of each sentence (mixing: where it lies depends on the
    // length), then a classifier on it and a per-instance threshold, all of static shape.
    let src = "def @f(%x: Tensor[(?, 4), float32], %w: Tensor[(2, 4), float32], \
               %th: Tensor[(), float32], Primitive=1) {
                 let %cls = strided_slice(%x, begin=[0, 0], end=[1, 4], strides=[1, 1]);
                 greater(max(nn.softmax(nn.dense(%cls, %w))), %th)
               }
               def @main(%x: Tensor[(?, 4), float32]) { %x }";
    let b = block_of(src, "f");
    let r = analyze(&b, &[true, false, true]).expect("ragged");
    assert_eq!(
        r.inputs,
        vec![
            RaggedInput::Rows,
            RaggedInput::Shared,
            RaggedInput::PerInstance
        ]
    );
    assert_eq!(
        shape_of(&r),
        vec![
            (false, vec!["strided_slice"]),
            (false, vec!["nn.dense", "nn.softmax", "max", "greater"])
        ]
    );
}

/// An attention block written as the encoder writes it, its mixing segments' kernels.
fn mixing_kernels_of(attention: &str, exit: &str) -> Vec<Option<MixingKernel>> {
    let src = format!(
        "def @f(%x: Tensor[(?, 8), float32], %wq: Tensor[(8, 8), float32], \
           %wk: Tensor[(8, 8), float32], %wv: Tensor[(8, 8), float32], Primitive=1) {{
             let %q = transpose(reshape(nn.dense(%x, %wq), newshape=[-1, 2, 4]), axes=[1, 0, 2]);
             let %k = transpose(reshape(nn.dense(%x, %wk), newshape=[-1, 2, 4]), axes=[1, 0, 2]);
             let %v = transpose(reshape(nn.dense(%x, %wv), newshape=[-1, 2, 4]), axes=[1, 0, 2]);
             let %c = {attention};
             let %y = reshape(transpose(%c, axes=[1, 0, 2]), newshape=[-1, 8]);
             {exit}
           }}
           def @main(%x: Tensor[(?, 8), float32]) {{ %x }}"
    );
    let r = ragged(&block_of(&src, "f")).expect("ragged");
    r.segments
        .iter()
        .filter(|s| !s.row_wise)
        .map(|s| s.kernel.clone())
        .collect()
}

#[test]
fn attention_and_whole_row_slices_are_found_and_near_misses_are_not() {
    let attention = "nn.batch_matmul(nn.softmax(multiply(nn.batch_matmul(%q, %k), 0.5f), \
                     axis=-1), %v, transpose_b=False)";
    let first_row = "strided_slice(%y, begin=[0, 0], end=[1, 8], strides=[1, 1])";
    let ks = mixing_kernels_of(attention, first_row);
    assert_eq!(
        ks,
        vec![
            Some(MixingKernel::Attention(crate::attention::Attention {
                q: 0,
                k: 1,
                v: 2,
                heads: 2,
                width: 4,
                scale: 0.5
            })),
            Some(MixingKernel::RowSlice { input: 0 })
        ],
        "{ks:?}"
    );
    // Softmax over the queries, not the keys: not attention.
    let wrong_axis = attention.replace("axis=-1", "axis=1");
    assert_eq!(
        mixing_kernels_of(&wrong_axis, first_row).first(),
        Some(&None)
    );
    // Keys not transposed in the product: not attention.
    let no_t = attention.replace(
        "nn.batch_matmul(%q, %k)",
        "nn.batch_matmul(%q, %k, transpose_b=False)",
    );
    assert!(mixing_kernels_of(&no_t, "%y").iter().all(Option::is_none));
    // Every other row, or part of a row: not whole rows.
    for exit in [
        "strided_slice(%y, begin=[0, 0], end=[4, 8], strides=[2, 1])",
        "strided_slice(%y, begin=[0, 1], end=[1, 8], strides=[1, 1])",
    ] {
        assert_eq!(
            mixing_kernels_of(attention, exit).get(1),
            Some(&None),
            "{exit}"
        );
    }
}

/// A decoder step attending with the state it just computed (Luong's `h2`, not the step's
/// input `h`): the keys' transpose, which reads only the memory, sits beside the attention in
/// one mixing segment, so the segment is a query over every instance's rows — not a transpose
/// in a segment of its own and an attention run once per group of equal lengths.
#[test]
fn a_query_computed_in_the_block_keeps_its_keys_beside_it() {
    let src = "def @f(%h: Tensor[(1, 8), float32], %m: Tensor[(?, 8), float32], \
               %u: Tensor[(8, 8), float32], Primitive=1) {
                 let %h2 = tanh(nn.dense(%h, %u));
                 let %a = nn.softmax(nn.dense(%h2, %m), axis=1);
                 nn.dense(%a, transpose(%m))
               }
               def @main(%x: Tensor[(?, 8), float32]) { %x }";
    let b = block_of(src, "f");
    let r = analyze(&b, &[true, true, false]).expect("ragged");
    let mixing: Vec<(Vec<&str>, bool)> = r
        .segments
        .iter()
        .filter(|s| !s.row_wise)
        .map(|s| {
            (
                s.block.nodes.iter().map(|n| n.op.name).collect(),
                matches!(s.kernel, Some(MixingKernel::Query(_))),
            )
        })
        .collect();
    assert_eq!(
        mixing,
        vec![
            (vec!["nn.dense", "tanh"], false),
            (
                vec!["nn.dense", "nn.softmax", "transpose", "nn.dense"],
                true
            )
        ],
        "{r}"
    );
}
