//! The reference backend: every operator and block is computed immediately with the plain-loop
//! kernels of `tumble-ops`, one instance at a time.

use crate::machine::{from_op_value, to_op_value, Backend, InstanceCtx, RunError};
use crate::value::Value;
use tumble_compile::{BArg, BVal, Block, OutputShape, Program};
use tumble_ir::{Attrs, Span};
use tumble_ops::{OpCtx, OpDef, OpValue};
use tumble_tensor::Tensor;

pub struct ReferenceBackend<'p> {
    pub program: &'p Program,
}

impl Backend for ReferenceBackend<'_> {
    fn call_op(
        &mut self,
        ctx: &mut InstanceCtx,
        op: &'static OpDef,
        args: Vec<Value>,
        attrs: &Attrs,
        span: Span,
    ) -> Result<Value, RunError> {
        let args = args
            .into_iter()
            .map(to_op_value)
            .collect::<Result<Vec<_>, String>>()
            .map_err(|m| RunError::at(span, format!("{}: {m}", op.name)))?;
        let mut octx = OpCtx { rng: &mut ctx.rng };
        let out = tumble_ops::eval(op, &args, attrs, &mut octx)
            .map_err(|e| RunError::at(span, e.message))?;
        Ok(from_op_value(out))
    }

    fn invoke_block(
        &mut self,
        ctx: &mut InstanceCtx,
        block: u32,
        _site: u32,
        args: Vec<Value>,
        span: Span,
    ) -> Result<Value, RunError> {
        let b = self
            .program
            .blocks
            .get(block as usize)
            .ok_or_else(|| RunError::new(format!("internal: no block {block}")))?;
        let inputs = args
            .into_iter()
            .map(|v| match v {
                Value::Tensor(t) => Ok(t),
                other => Err(RunError::at(
                    span,
                    format!(
                        "block {}: expected a tensor input, found {}",
                        b.name,
                        other.kind()
                    ),
                )),
            })
            .collect::<Result<Vec<_>, _>>()?;
        let mut octx = OpCtx { rng: &mut ctx.rng };
        let outs = eval_block(b, &inputs, &mut octx).map_err(|m| RunError::at(span, m))?;
        Ok(block_value(b, outs))
    }

    fn condition(&mut self, v: &Value) -> Result<Option<bool>, RunError> {
        v.as_tensor()
            .and_then(|t| t.scalar_as_bool().ok())
            .map(Some)
            .ok_or_else(|| RunError::new("`if` condition is not a bool scalar"))
    }
}

/// The value a block invocation returns: its single output, or the tuple of its outputs.
pub fn block_value(b: &Block, mut outs: Vec<Tensor>) -> Value {
    match (b.output_shape, outs.len()) {
        (OutputShape::Single, 1) => Value::Tensor(outs.remove(0)),
        _ => Value::tuple(outs.into_iter().map(Value::Tensor).collect()),
    }
}

/// Runs a block's nodes in order on one invocation's inputs; returns its flat outputs.
pub fn eval_block(b: &Block, inputs: &[Tensor], octx: &mut OpCtx) -> Result<Vec<Tensor>, String> {
    let mut results: Vec<OpValue> = Vec::with_capacity(b.nodes.len());
    for node in &b.nodes {
        let args = node
            .args
            .iter()
            .map(|a| match a {
                BArg::One(v) => value(v, inputs, &results).map(OpValue::Tensor),
                BArg::Tuple(vs) => vs
                    .iter()
                    .map(|v| value(v, inputs, &results))
                    .collect::<Result<Vec<_>, _>>()
                    .map(OpValue::Tuple),
            })
            .collect::<Result<Vec<_>, _>>()?;
        let out = tumble_ops::eval(node.op, &args, &node.attrs, octx).map_err(|e| e.message)?;
        results.push(out);
    }
    b.outputs
        .iter()
        .map(|v| value(v, inputs, &results))
        .collect()
}

fn value(v: &BVal, inputs: &[Tensor], results: &[OpValue]) -> Result<Tensor, String> {
    let missing = || format!("internal: block value {v} is not available");
    match v {
        BVal::Input(i) => inputs.get(*i as usize).cloned().ok_or_else(missing),
        BVal::Node(n) => results
            .get(*n as usize)
            .and_then(OpValue::as_tensor)
            .cloned()
            .ok_or_else(missing),
        BVal::Field(n, f) => results
            .get(*n as usize)
            .and_then(OpValue::as_tuple)
            .and_then(|ts| ts.get(*f as usize))
            .cloned()
            .ok_or_else(missing),
        BVal::Const(t) => Ok(t.clone()),
    }
}
