//! Fused LM head + cross-entropy: `loss[i] = logsumexp(x[i] W) - (x[i] W)[target[i]]`.
//!
//! The full `[tokens, vocab]` logits are never materialised: the forward pass computes them
//! `CHUNK_ROWS` rows at a time and keeps only per-row losses, and the backward pass recomputes
//! each chunk, turns it into `softmax - one_hot` in place, and accumulates the gradients of
//! `x` and `W` from it. Peak extra memory is one chunk of logits, not several logits-sized
//! buffers (a 2048-token batch at vocabulary 50304 is 412 MB per buffer).

use candle_core::{CpuStorage, CustomOp3, DType, Device, Layout, Result, Shape, Tensor};
use rayon::prelude::*;

/// Rows of logits alive at once.
const CHUNK_ROWS: usize = 128;

/// The op; apply it as `x.apply_op3(&weight, &targets, LinearCrossEntropy)`, with `x: [N, H]`,
/// `weight: [H, V]` (f32 or f64) and `targets: [N]` (u32). Returns per-row losses `[N]`.
#[derive(Clone, Copy, Debug)]
pub struct LinearCrossEntropy;

fn to_tensor(storage: &CpuStorage, layout: &Layout) -> Result<Tensor> {
    let (start, end) = layout.contiguous_offsets().ok_or_else(|| {
        candle_core::Error::Msg("linear-cross-entropy needs contiguous inputs".into())
    })?;
    let shape = layout.shape();
    match storage {
        CpuStorage::F32(values) => Tensor::from_slice(&values[start..end], shape, &Device::Cpu),
        CpuStorage::F64(values) => Tensor::from_slice(&values[start..end], shape, &Device::Cpu),
        CpuStorage::U32(values) => Tensor::from_slice(&values[start..end], shape, &Device::Cpu),
        _ => Err(candle_core::Error::Msg(
            "linear-cross-entropy takes f32/f64 inputs and u32 targets".into(),
        )),
    }
}

/// Calls `visit(first_row, logits)` for each chunk of rows, logits as f64 rows.
fn for_each_chunk(
    x: &Tensor,
    weight: &Tensor,
    mut visit: impl FnMut(usize, Tensor, Vec<Vec<f64>>) -> Result<()>,
) -> Result<()> {
    let rows = x.dim(0)?;
    for first in (0..rows).step_by(CHUNK_ROWS) {
        let count = CHUNK_ROWS.min(rows - first);
        let chunk = x.narrow(0, first, count)?;
        let logits: Vec<Vec<f64>> = chunk.matmul(weight)?.to_dtype(DType::F64)?.to_vec2()?;
        visit(first, chunk, logits)?;
    }
    Ok(())
}

/// log-sum-exp of one row, in f64.
fn log_sum_exp(row: &[f64]) -> f64 {
    let max = row.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    max + row.iter().map(|v| (v - max).exp()).sum::<f64>().ln()
}

impl CustomOp3 for LinearCrossEntropy {
    fn name(&self) -> &'static str {
        "linear-cross-entropy"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (x, weight, targets) = (
            to_tensor(s1, l1)?,
            to_tensor(s2, l2)?,
            to_tensor(s3, l3)?.to_vec1::<u32>()?,
        );
        let mut losses = vec![0f64; x.dim(0)?];
        for_each_chunk(&x, &weight, |first, _, logits| {
            let chunk_losses: Vec<f64> = logits
                .par_iter()
                .enumerate()
                .map(|(offset, row)| log_sum_exp(row) - row[targets[first + offset] as usize])
                .collect();
            losses[first..first + chunk_losses.len()].copy_from_slice(&chunk_losses);
            Ok(())
        })?;
        let rows = losses.len();
        let storage = match s1 {
            CpuStorage::F64(_) => CpuStorage::F64(losses),
            _ => CpuStorage::F32(losses.into_iter().map(|v| v as f32).collect()),
        };
        Ok((storage, Shape::from(rows)))
    }

    fn bwd(
        &self,
        x: &Tensor,
        weight: &Tensor,
        targets: &Tensor,
        _result: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let (x, weight) = (x.detach(), weight.detach());
        let targets = targets.to_vec1::<u32>()?;
        let upstream: Vec<f64> = grad.to_dtype(DType::F64)?.to_vec1()?;
        let vocab = weight.dim(1)?;
        let weight_t = weight.t()?.contiguous()?;
        let mut grad_x = Vec::new();
        let mut grad_weight = weight.zeros_like()?;
        for_each_chunk(&x, &weight, |first, chunk, logits| {
            // Rows are independent: softmax - one_hot, scaled by the upstream gradient, in parallel.
            let mut dlogits = vec![0f64; logits.len() * vocab];
            dlogits
                .par_chunks_mut(vocab)
                .zip(logits.par_iter())
                .enumerate()
                .for_each(|(offset, (out, row))| {
                    let lse = log_sum_exp(row);
                    let scale = upstream[first + offset];
                    for (o, v) in out.iter_mut().zip(row) {
                        *o = scale * (v - lse).exp();
                    }
                    out[targets[first + offset] as usize] -= scale;
                });
            let dlogits = Tensor::from_vec(dlogits, (logits.len(), vocab), &Device::Cpu)?
                .to_dtype(x.dtype())?;
            grad_x.push(dlogits.matmul(&weight_t)?);
            grad_weight = (&grad_weight + chunk.t()?.matmul(&dlogits)?)?;
            Ok(())
        })?;
        Ok((Some(Tensor::cat(&grad_x, 0)?), Some(grad_weight), None))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Var;

    #[test]
    fn matches_the_unfused_loss_and_its_gradients() {
        // 300 rows cross two chunk boundaries.
        let (rows, hidden, vocab) = (300, 8, 50);
        let values = |count: usize, salt: usize| {
            (0..count)
                .map(|i| (((i * 7919 + salt) % 1000) as f64 / 500.0) - 1.0)
                .collect::<Vec<f64>>()
        };
        let x = Var::from_vec(values(rows * hidden, 1), (rows, hidden), &Device::Cpu).unwrap();
        let weight =
            Var::from_vec(values(hidden * vocab, 2), (hidden, vocab), &Device::Cpu).unwrap();
        let targets: Vec<u32> = (0..rows).map(|i| (i * 13 % vocab) as u32).collect();
        let target_tensor = Tensor::new(targets.as_slice(), &Device::Cpu).unwrap();

        let fused = x
            .apply_op3(&weight, &target_tensor, LinearCrossEntropy)
            .unwrap()
            .mean_all()
            .unwrap();
        let logits = x.matmul(&weight).unwrap();
        let lse = crate::model::log_sum_exp(&logits).unwrap();
        let picked = logits
            .gather(&target_tensor.unsqueeze(1).unwrap(), 1)
            .unwrap();
        let reference = (lse - picked).unwrap().mean_all().unwrap();
        let (a, b) = (
            fused.to_scalar::<f64>().unwrap(),
            reference.to_scalar::<f64>().unwrap(),
        );
        assert!((a - b).abs() < 1e-12, "{a} vs {b}");

        let (fused_grads, reference_grads) =
            (fused.backward().unwrap(), reference.backward().unwrap());
        for var in [&x, &weight] {
            let got: Vec<f64> = fused_grads
                .get(var)
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1()
                .unwrap();
            let want: Vec<f64> = reference_grads
                .get(var)
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1()
                .unwrap();
            let worst = got
                .iter()
                .zip(&want)
                .map(|(g, w)| (g - w).abs())
                .fold(0.0, f64::max);
            assert!(worst < 1e-12, "gradient differs by {worst}");
        }
    }
}
