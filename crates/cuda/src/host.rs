//! The emulated device ([`crate::Gpu::emulated`]): buffers in host memory, the fixed kernels as
//! plain loops with the CUDA kernels' semantics (the same views, strides and bounds checks), so
//! the runtime's device executor can be tested on any machine.

use std::sync::RwLock;

use crate::{Batch, Block, DevBuf, Fetch, GpuError, Mat, Mem};

pub(crate) fn buffer(v: Vec<f32>) -> DevBuf {
    DevBuf {
        mem: Mem::Host(RwLock::new(v)),
    }
}

fn poisoned() -> GpuError {
    GpuError::Driver("an emulated buffer's lock is poisoned".into())
}

pub(crate) fn download_many(fetches: &[Fetch]) -> Result<Vec<Vec<f32>>, GpuError> {
    fetches
        .iter()
        .map(|f| {
            let v = f.buf.host()?.read().map_err(|_| poisoned())?;
            v.get(f.off..f.off + f.len)
                .map(<[f32]>::to_vec)
                .ok_or_else(|| GpuError::Bounds("download".into()))
        })
        .collect()
}

/// The floats a view reads: `rows` rows of `cols`, `ld` apart.
fn rows_of<'v>(m: &Mat, data: &'v [f32]) -> Result<Vec<&'v [f32]>, GpuError> {
    m.extent()?;
    (0..m.rows)
        .map(|r| {
            let at = m.off + r * m.ld;
            data.get(at..at + m.cols)
                .ok_or_else(|| GpuError::Bounds("view row".into()))
        })
        .collect()
}

/// A kernel's output may not be one of its inputs (the CUDA kernels read and write without
/// ordering between blocks).
fn distinct(out: &Mat, ins: &[&Mat]) -> Result<(), GpuError> {
    if ins.iter().any(|m| std::ptr::eq(m.buf, out.buf)) {
        return Err(GpuError::Bounds(
            "a kernel's output aliases its input".into(),
        ));
    }
    Ok(())
}

/// One product of [`gemm_batched`]'s (the same multiply-adds in the same order).
pub(crate) fn gemm_nt(a: &Mat, w: &Mat, c: &Mat, accumulate: bool) -> Result<(), GpuError> {
    for m in [a, w, c] {
        m.extent()?;
    }
    let [a, w, c] = [a, w, c].map(|&mat| Batch { mat, stride: 0 });
    gemm_batched(&a, &w, true, &c, 1, accumulate)
}

pub(crate) fn copy_rows(src: &Mat, dst: &Mat, add: bool, broadcast: bool) -> Result<(), GpuError> {
    distinct(dst, &[src])?;
    let sv = src.buf.host()?.read().map_err(|_| poisoned())?;
    let sr = rows_of(src, &sv)?;
    dst.extent()?;
    let mut dv = dst.buf.host()?.write().map_err(|_| poisoned())?;
    for r in 0..dst.rows {
        let from = sr
            .get(if broadcast { 0 } else { r })
            .ok_or_else(|| GpuError::Bounds("copy source row".into()))?;
        let at = dst.off + r * dst.ld;
        let to = dv
            .get_mut(at..at + dst.cols)
            .ok_or_else(|| GpuError::Bounds("copy destination row".into()))?;
        for (t, f) in to.iter_mut().zip(from.iter()) {
            *t = if add { *t + f } else { *f };
        }
    }
    Ok(())
}

pub(crate) fn gather(
    srcs: &[Block],
    len: usize,
    dst: &DevBuf,
    dst_off: usize,
    stride: usize,
) -> Result<(), GpuError> {
    if srcs.iter().any(|b| std::ptr::eq(b.buf, dst)) {
        return Err(GpuError::Bounds(
            "a gather's output aliases its input".into(),
        ));
    }
    let mut dv = dst.host()?.write().map_err(|_| poisoned())?;
    for (i, b) in srcs.iter().enumerate() {
        let sv = b.buf.host()?.read().map_err(|_| poisoned())?;
        let from = sv
            .get(b.off..b.off + len)
            .ok_or_else(|| GpuError::Bounds("gather source".into()))?;
        let at = dst_off + i * stride;
        dv.get_mut(at..at + len)
            .ok_or_else(|| GpuError::Bounds("gather destination".into()))?
            .copy_from_slice(from);
    }
    Ok(())
}

pub(crate) fn gemm_batched(
    a: &Batch,
    b: &Batch,
    b_transposed: bool,
    c: &Batch,
    count: usize,
    accumulate: bool,
) -> Result<(), GpuError> {
    distinct(&c.mat, &[&a.mat, &b.mat])?;
    let (av, bv) = (
        a.mat.buf.host()?.read().map_err(|_| poisoned())?,
        b.mat.buf.host()?.read().map_err(|_| poisoned())?,
    );
    let mut cv = c.mat.buf.host()?.write().map_err(|_| poisoned())?;
    let (m, k, n) = (a.mat.rows, a.mat.cols, c.mat.cols);
    let at = |v: &[f32], x: &Batch, i: usize, r: usize, col: usize| -> Result<f32, GpuError> {
        v.get(x.mat.off + i * x.stride + r * x.mat.ld + col)
            .copied()
            .ok_or_else(|| GpuError::Bounds("batched gemm operand".into()))
    };
    for i in 0..count {
        for r in 0..m {
            for j in 0..n {
                let mut dot = 0.0f32;
                for x in 0..k {
                    let y = match b_transposed {
                        true => at(&bv, b, i, j, x)?,
                        false => at(&bv, b, i, x, j)?,
                    };
                    dot = at(&av, a, i, r, x)?.mul_add(y, dot);
                }
                let slot = cv
                    .get_mut(c.mat.off + i * c.stride + r * c.mat.ld + j)
                    .ok_or_else(|| GpuError::Bounds("batched gemm output".into()))?;
                *slot = if accumulate { *slot + dot } else { dot };
            }
        }
    }
    Ok(())
}
