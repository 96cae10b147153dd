//! The reference backend: every operator and block is computed immediately with the plain-loop
//! kernels of `tumble-ops`, one instance at a time.

use crate::machine::{from_op_value, to_op_value, Backend, InstanceCtx, RunError};
use crate::value::Value;
use tumble_compile::{Block, OutputShape, Program};
use tumble_ir::{Attrs, Span};
use tumble_ops::{OpCtx, OpDef};
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
        args: &mut Vec<Value>,
        span: Span,
    ) -> Result<Value, RunError> {
        let b = self
            .program
            .blocks
            .get(block as usize)
            .ok_or_else(|| RunError::new(format!("internal: no block {block}")))?;
        let inputs = args
            .drain(..)
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
        let outs = b
            .eval(&inputs, &mut octx)
            .map_err(|m| RunError::at(span, m))?;
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
        _ => Value::tuple(
            outs.into_iter()
                .map(Value::Tensor)
                .collect::<crate::Fields>(),
        ),
    }
}
