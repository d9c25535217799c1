//! RMSNorm over the last dimension as one op with its own backward (candle-nn's fused
//! RMSNorm has none). `y = x / sqrt(mean(x^2) + eps) * weight`, rows in parallel, each row's
//! arithmetic in f64. The weight gradient is summed over fixed blocks of rows in a fixed
//! order, so it does not depend on the thread count.

use candle_core::{CpuStorage, CustomOp2, Device, Layout, Result, Shape, Tensor};
use rayon::prelude::*;

use crate::custom_op::{contiguous, cpu};
use crate::kernels::SoftmaxRow;

/// Rows per partial sum of the weight gradient.
const BLOCK_ROWS: usize = 64;

/// The op: `x.apply_op2(&weight, RmsNorm { eps })` with `x: [..., H]` and `weight: [H]`.
#[derive(Clone, Copy, Debug)]
pub struct RmsNorm {
    pub eps: f64,
}

/// This op's name, in its errors.
const OP: &str = "rms-norm";

fn error(message: impl Into<String>) -> candle_core::Error {
    candle_core::Error::Msg(format!("{OP}: {}", message.into()))
}

/// `1 / sqrt(mean(row^2) + eps)`.
fn inverse_rms<T: SoftmaxRow>(row: &[T], eps: f64) -> f64 {
    let mean = row.iter().map(|v| v.to_f64() * v.to_f64()).sum::<f64>() / row.len() as f64;
    1.0 / (mean + eps).sqrt()
}

impl RmsNorm {
    fn forward<T: SoftmaxRow>(&self, x: &[T], weight: &[T]) -> Vec<T> {
        let mut out = vec![T::ZERO; x.len()];
        out.par_chunks_mut(weight.len())
            .zip(x.par_chunks(weight.len()))
            .for_each(|(out, row)| {
                let r = inverse_rms(row, self.eps);
                for ((o, v), w) in out.iter_mut().zip(row).zip(weight) {
                    *o = T::from_f64(v.to_f64() * r * w.to_f64());
                }
            });
        out
    }

    /// Gradients of `x` and `weight` given the upstream gradient.
    fn backward<T: SoftmaxRow>(&self, x: &[T], weight: &[T], upstream: &[T]) -> (Vec<T>, Vec<T>) {
        let hidden = weight.len();
        let mut grad_x = vec![T::ZERO; x.len()];
        let partials: Vec<Vec<f64>> = grad_x
            .par_chunks_mut(hidden * BLOCK_ROWS)
            .zip(x.par_chunks(hidden * BLOCK_ROWS))
            .zip(upstream.par_chunks(hidden * BLOCK_ROWS))
            .map(|((grad_block, x_block), up_block)| {
                let mut grad_weight = vec![0f64; hidden];
                for ((grad_row, row), up) in grad_block
                    .chunks_mut(hidden)
                    .zip(x_block.chunks(hidden))
                    .zip(up_block.chunks(hidden))
                {
                    let r = inverse_rms(row, self.eps);
                    let mut dot = 0f64;
                    for (((g, v), u), w) in grad_weight.iter_mut().zip(row).zip(up).zip(weight) {
                        let (v, u) = (v.to_f64(), u.to_f64());
                        *g += u * v * r;
                        dot += u * w.to_f64() * v;
                    }
                    let correction = r * r * r * dot / hidden as f64;
                    for (((g, v), u), w) in grad_row.iter_mut().zip(row).zip(up).zip(weight) {
                        *g = T::from_f64(r * u.to_f64() * w.to_f64() - v.to_f64() * correction);
                    }
                }
                grad_weight
            })
            .collect();
        let mut grad_weight = vec![0f64; hidden];
        for partial in &partials {
            for (total, value) in grad_weight.iter_mut().zip(partial) {
                *total += value;
            }
        }
        (grad_x, grad_weight.into_iter().map(T::from_f64).collect())
    }
}

impl CustomOp2 for RmsNorm {
    fn name(&self) -> &'static str {
        "rms-norm"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let hidden = l2.shape().dims1()?;
        if l1.shape().dims().last() != Some(&hidden) {
            return Err(error(format!(
                "weight {:?} does not match the last dimension of {:?}",
                l2.shape(),
                l1.shape()
            )));
        }
        let out = match (s1, s2) {
            (CpuStorage::F32(x), CpuStorage::F32(w)) => {
                CpuStorage::F32(self.forward(contiguous(OP, x, l1)?, contiguous(OP, w, l2)?))
            }
            (CpuStorage::F64(x), CpuStorage::F64(w)) => {
                CpuStorage::F64(self.forward(contiguous(OP, x, l1)?, contiguous(OP, w, l2)?))
            }
            _ => return Err(error("x and weight must both be f32 or both f64")),
        };
        Ok((out, l1.shape().clone()))
    }

    fn bwd(
        &self,
        x: &Tensor,
        weight: &Tensor,
        _result: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let grad = grad.contiguous()?;
        let (xs, ws, gs) = (
            x.storage_and_layout().0,
            weight.storage_and_layout().0,
            grad.storage_and_layout().0,
        );
        let device = Device::Cpu;
        let (grad_x, grad_weight) = match (cpu(OP, &xs)?, cpu(OP, &ws)?, cpu(OP, &gs)?) {
            (CpuStorage::F32(xv), CpuStorage::F32(wv), CpuStorage::F32(gv)) => {
                let (gx, gw) = self.backward(
                    contiguous(OP, xv, x.layout())?,
                    contiguous(OP, wv, weight.layout())?,
                    contiguous(OP, gv, grad.layout())?,
                );
                (
                    Tensor::from_vec(gx, x.shape(), &device)?,
                    Tensor::from_vec(gw, weight.shape(), &device)?,
                )
            }
            (CpuStorage::F64(xv), CpuStorage::F64(wv), CpuStorage::F64(gv)) => {
                let (gx, gw) = self.backward(
                    contiguous(OP, xv, x.layout())?,
                    contiguous(OP, wv, weight.layout())?,
                    contiguous(OP, gv, grad.layout())?,
                );
                (
                    Tensor::from_vec(gx, x.shape(), &device)?,
                    Tensor::from_vec(gw, weight.shape(), &device)?,
                )
            }
            _ => return Err(error("x, weight and the gradient must share a float type")),
        };
        Ok((Some(grad_x), Some(grad_weight)))
    }
}
