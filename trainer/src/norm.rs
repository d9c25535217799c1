//! RMSNorm over the last dimension as one op with its own backward (candle-nn's fused
//! RMSNorm has none). `y = x / sqrt(mean(x^2) + eps) * weight`, rows in parallel, each row's
//! arithmetic in f64; a row may be split over a tensor-parallel group. The weight gradient is summed over fixed blocks of rows in a fixed
//! order, so it does not depend on the thread count.

use std::sync::Arc;

use candle_core::{CpuStorage, CustomOp2, Device, Layout, Result, Shape, Tensor};
use rayon::prelude::*;

use crate::custom_op::{contiguous, cpu};
use crate::dist::{Group, World};
use crate::kernels::SoftmaxRow;

/// Rows per partial sum of the weight gradient.
const BLOCK_ROWS: usize = 64;

/// The op: `x.apply_op2(&weight, RmsNorm::new(eps))` with `x: [..., H]` and `weight: [H]`.
///
/// [`RmsNorm::split`] normalises rows split over a tensor-parallel group (QK-norm over heads
/// split by tensor parallel): each rank holds `H` of the row's `H * tp` values, and the sums
/// over a row (of squares forward, of `upstream * weight * x` backward) are summed over the
/// group in rank order, so every rank normalises by the whole row, as one process does.
#[derive(Clone, Debug)]
pub struct RmsNorm {
    pub eps: f64,
    /// The group a row is split over, if it is.
    split: Option<Arc<World>>,
}

/// This op's name, in its errors.
const OP: &str = "rms-norm";

fn error(message: impl Into<String>) -> candle_core::Error {
    candle_core::Error::Msg(format!("{OP}: {}", message.into()))
}

/// `1 / sqrt(sum_sq / width + eps)`.
fn inverse_rms(sum_sq: f64, width: usize, eps: f64) -> f64 {
    let mean = sum_sq / width as f64;
    1.0 / (mean + eps).sqrt()
}

impl RmsNorm {
    /// Normalises each row over its own values.
    pub fn new(eps: f64) -> Self {
        Self { eps, split: None }
    }

    /// Normalises rows split over `world`'s tensor-parallel group.
    pub fn split(eps: f64, world: Arc<World>) -> Self {
        Self {
            eps,
            split: Some(world),
        }
    }

    /// The whole row's width, for a local width of `hidden`.
    fn width(&self, hidden: usize) -> usize {
        hidden * self.split.as_ref().map_or(1, |world| world.layout.tp)
    }

    /// Per-row values summed over the group (each rank's in rank order); as they are when the
    /// row is not split.
    fn over_rows(&self, values: Vec<f64>) -> Vec<f64> {
        match &self.split {
            None => values,
            Some(world) => world.sum_f64(Group::Tensor, &values),
        }
    }

    fn forward<T: SoftmaxRow>(&self, x: &[T], weight: &[T]) -> Vec<T> {
        let hidden = weight.len();
        let sums = self.over_rows(x.par_chunks(hidden).map(T::sum_of_squares).collect());
        let width = self.width(hidden);
        let mut out = vec![T::ZERO; x.len()];
        out.par_chunks_mut(hidden)
            .zip(x.par_chunks(hidden))
            .zip(sums.par_iter())
            .for_each(|((out, row), sum)| {
                let r = inverse_rms(*sum, width, self.eps);
                for ((o, v), w) in out.iter_mut().zip(row).zip(weight) {
                    *o = T::from_f64(v.to_f64() * r * w.to_f64());
                }
            });
        out
    }

    /// Gradients of `x` and `weight` given the upstream gradient.
    fn backward<T: SoftmaxRow>(&self, x: &[T], weight: &[T], upstream: &[T]) -> (Vec<T>, Vec<T>) {
        let hidden = weight.len();
        let width = self.width(hidden);
        // Per row: its sum of squares and the dot of upstream * weight with x.
        let mut per_row: Vec<f64> = x
            .par_chunks(hidden)
            .zip(upstream.par_chunks(hidden))
            .flat_map_iter(|(row, up)| [T::sum_of_squares(row), T::triple_dot(up, weight, row)])
            .collect();
        per_row = self.over_rows(per_row);
        let mut grad_x = vec![T::ZERO; x.len()];
        let partials: Vec<Vec<f64>> = grad_x
            .par_chunks_mut(hidden * BLOCK_ROWS)
            .zip(x.par_chunks(hidden * BLOCK_ROWS))
            .zip(upstream.par_chunks(hidden * BLOCK_ROWS))
            .zip(per_row.par_chunks(2 * BLOCK_ROWS))
            .map(|(((grad_block, x_block), up_block), sums)| {
                let mut grad_weight = vec![0f64; hidden];
                for (((grad_row, row), up), sums) in grad_block
                    .chunks_mut(hidden)
                    .zip(x_block.chunks(hidden))
                    .zip(up_block.chunks(hidden))
                    .zip(sums.chunks(2))
                {
                    let r = inverse_rms(sums[0], width, self.eps);
                    for ((g, v), u) in grad_weight.iter_mut().zip(row).zip(up) {
                        *g += u.to_f64() * v.to_f64() * r;
                    }
                    let correction = r * r * r * sums[1] / width as f64;
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
        let _span = tracing::info_span!("rms_norm").entered();
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
        let _span = tracing::info_span!("rms_norm_backward").entered();
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
