//! Fused LM head + cross-entropy: `loss[i] = logsumexp(x[i] W^T) - (x[i] W^T)[target[i]]`,
//! with `W` stored `[vocab, hidden]`, a row per token as the embedding (and Hugging Face's
//! `lm_head.weight`), so that a vocabulary split is a split of rows.
//!
//! The full `[tokens, vocab]` logits are never materialised: the forward pass computes them
//! `CHUNK_ROWS` rows at a time and keeps only per-row losses, and the backward pass recomputes
//! each chunk, turns it into `softmax - one_hot` in place, and accumulates the gradients of
//! `x` and `W` from it. Peak extra memory is one chunk of logits, not several logits-sized
//! buffers (a 2048-token batch at vocabulary 50304 is 412 MB per buffer), and `W`'s gradient
//! twice: accumulated transposed, then in `W`'s layout (51.5 MB each at hidden 256).
//!
//! Under tensor parallelism the op is vocabulary-parallel ([`LinearCrossEntropy::split`]):
//! each rank holds `W`'s columns for its share of the vocabulary and computes only those
//! logits. Per chunk of rows, the ranks exchange each row's log-sum-exp over their share and
//! the target's logit (from the rank that holds it), and combine them in rank order: the
//! whole logits never exist on one rank. The gradient of `x` is each rank's part, summed by
//! the tensor-parallel `Enter` before the op.

use std::sync::{Arc, Mutex};

use crate::dist::{Group, World};

use candle_core::{CpuStorage, CustomOp3, DType, Device, Layout, Result, Shape, Tensor};
use rayon::prelude::*;

use crate::custom_op::{contiguous, cpu, scale_in_place};
use crate::kernels::{matmul, transposed, with_scratches, MatRef, SoftmaxRow};

/// Rows of logits alive at once: at most one logits-sized buffer (2048 rows of a 50304
/// vocabulary is 412 MB in f32). More, smaller chunks measured slower: the weight gradient
/// is re-read and re-written once per chunk. The unit tests use small chunks, so that their
/// few hundred rows cross chunk boundaries.
#[cfg(not(test))]
const CHUNK_ROWS: usize = 2048;
#[cfg(test)]
const CHUNK_ROWS: usize = 128;

/// The op; apply it as `x.apply_op3(&weight, &targets, op)`, with `x: [N, H]`,
/// `weight: [V, H]` (one row per token, as the embedding; both f32 or both f64, contiguous) and `targets: [N]` (u32). Returns
/// per-row losses `[N]`. Use a fresh op per application: the forward pass leaves state in it
/// for the backward pass.
///
/// [`LinearCrossEntropy::training`] also computes the gradients during the forward pass, for
/// a uniform upstream gradient (a mean or a sum of the losses, which is how training uses it):
/// the logits are then computed once instead of twice. With any other upstream gradient, the
/// backward pass recomputes them. [`LinearCrossEntropy::default`] only computes the loss.
#[derive(Clone, Debug, Default)]
pub struct LinearCrossEntropy {
    gradients_in_forward: bool,
    log_sum_exp: Arc<Mutex<Vec<f64>>>,
    /// Gradients of `sum(loss)` with respect to `x` and `weight`, from a training forward pass.
    unit_gradients: Arc<Mutex<Option<(Tensor, Tensor)>>>,
    /// The vocabulary share of this rank, when the vocabulary is split.
    split: Option<VocabSplit>,
}

/// This rank's share of a vocabulary split over a tensor-parallel group.
#[derive(Clone, Debug)]
struct VocabSplit {
    world: Arc<World>,
    /// The first token of this rank's share.
    start: usize,
}

impl LinearCrossEntropy {
    /// An op that computes the gradients in the forward pass.
    pub fn training() -> Self {
        Self {
            gradients_in_forward: true,
            ..Self::default()
        }
    }

    /// This op over a vocabulary split over `world`'s tensor-parallel group, of which this
    /// rank's weight holds the columns from token `start` on.
    pub fn split(self, world: Arc<World>, start: usize) -> Self {
        Self {
            split: Some(VocabSplit { world, start }),
            ..self
        }
    }
}

impl VocabSplit {
    /// The whole vocabulary's size, for a share of `vocab`.
    fn whole(&self, vocab: usize) -> usize {
        vocab * self.world.layout.tp
    }

    /// `target`'s column in this rank's share, if the rank holds it.
    fn local(&self, target: u32, vocab: usize) -> Option<usize> {
        (target as usize)
            .checked_sub(self.start)
            .filter(|column| *column < vocab)
    }

    /// Each row's log-sum-exp over the whole vocabulary and its target's logit, from every
    /// rank's over its share (`-inf` and 0 where a rank has nothing), combined in rank order.
    fn combine(&self, log_sum_exp: &[f64], target: &[f64]) -> (Vec<f64>, Vec<f64>) {
        let rows = log_sum_exp.len();
        let mine: Vec<f64> = log_sum_exp.iter().chain(target).copied().collect();
        let gathered = self.world.all_gather_f64(Group::Tensor, &mine);
        let ranks: Vec<&[f64]> = gathered.chunks(2 * rows.max(1)).collect();
        let mut whole = vec![0f64; rows];
        let mut picked = vec![0f64; rows];
        for row in 0..rows {
            let max = ranks
                .iter()
                .map(|r| r[row])
                .fold(f64::NEG_INFINITY, f64::max);
            let sum: f64 = ranks.iter().map(|r| (r[row] - max).exp()).sum();
            whole[row] = max + sum.ln();
            picked[row] = ranks.iter().map(|r| r[rows + row]).sum();
        }
        (whole, picked)
    }
}

/// This op's name, in its errors.
const OP: &str = "linear-cross-entropy";

fn error(message: impl Into<String>) -> candle_core::Error {
    candle_core::Error::Msg(format!("{OP}: {}", message.into()))
}

/// `[N, H]`, `[V, H]`, `[N]` or an error naming what is wrong.
fn dimensions(x: &Layout, weight: &Layout, targets: &Layout) -> Result<(usize, usize, usize)> {
    let (rows, hidden) = x.shape().dims2()?;
    let (vocab, weight_hidden) = weight.shape().dims2()?;
    let target_rows = targets.shape().dims1()?;
    if weight_hidden != hidden || target_rows != rows {
        return Err(error(format!(
            "shapes {:?}, {:?}, {:?} do not fit [N, H], [V, H], [N]",
            x.shape(),
            weight.shape(),
            targets.shape()
        )));
    }
    Ok((rows, hidden, vocab))
}

fn check_targets(targets: &[u32], vocab: usize) -> Result<()> {
    match targets.iter().find(|t| **t as usize >= vocab) {
        Some(bad) => Err(error(format!(
            "target {bad} is outside the vocabulary of {vocab}"
        ))),
        None => Ok(()),
    }
}

/// Gradients with respect to `x` and `weight`.
type Gradients<T> = (Vec<T>, Vec<T>);

/// Turns a row of logits into `scale * (softmax - one_hot(target))`, in place; `target` is
/// the target's column, if this row holds it.
fn logits_to_gradient<T: SoftmaxRow>(
    row: &mut [T],
    log_sum_exp: f64,
    target: Option<usize>,
    scale: f64,
) {
    T::scaled_exp(row, log_sum_exp, scale);
    if let Some(target) = target {
        row[target] = T::from_f64(row[target].to_f64() - scale);
    }
}

/// Per-row losses; fills `log_sum_exp` with each row's log-sum-exp. With `gradients`, also
/// returns the gradients of `sum(loss)` with respect to `x` and `weight`.
///
/// The gradient of a row is `softmax - one_hot = c * exp(logits - max) - one_hot`, with
/// `c = exp(max - log_sum_exp)`. The row keeps `exp(logits - max)`, which the log-sum-exp
/// computes anyway, and `c` and the one-hot go into the small operands of the two products
/// ([`gradients_from_exps`]): no second pass of exponentials over the logits.
fn forward<T: SoftmaxRow>(
    x: &[T],
    weight: &[T],
    targets: &[u32],
    (rows, hidden, vocab): (usize, usize, usize),
    split: Option<&VocabSplit>,
    log_sum_exp: &mut Vec<f64>,
    gradients: bool,
) -> (Vec<f64>, Option<Gradients<T>>) {
    let mut losses = vec![0f64; rows];
    log_sum_exp.clear();
    log_sum_exp.resize(rows, 0.0);
    let mut grad_x = gradients.then(|| vec![T::ZERO; rows * hidden]);
    // `[H, V]`, the transpose of the stored rows.
    let weight_t = MatRef::row_major(weight, vocab, hidden).t();
    let grad_weight_len = if gradients { hidden * vocab } else { 0 };
    let lens = (CHUNK_ROWS.min(rows) * vocab, grad_weight_len);
    let grad_weight = with_scratches(lens, |logits: &mut [T], grad_weight_t: &mut [T]| {
        for first in (0..rows).step_by(CHUNK_ROWS) {
            let count = CHUNK_ROWS.min(rows - first);
            let x_chunk = &x[first * hidden..(first + count) * hidden];
            let chunk = &mut logits[..count * vocab];
            let multiplying = tracing::info_span!("logits_matmul").entered();
            matmul(
                chunk,
                MatRef::row_major(x_chunk, count, hidden),
                weight_t,
                false,
            );
            drop(multiplying);
            let softmax = tracing::info_span!("softmax").entered();
            let rows = first..first + count;
            let targets = &targets[rows.clone()];
            // Each row's shift, when it holds its exponentials.
            let shifts = match split {
                None => {
                    let (shifts, lse): (Vec<f64>, Vec<f64>) = chunk
                        .par_chunks_mut(vocab)
                        .zip(losses[rows.clone()].par_iter_mut())
                        .zip(targets.par_iter())
                        .map(|((row, loss), target)| {
                            let picked = row[*target as usize].to_f64();
                            let (shift, lse) = if gradients {
                                T::exp_in_place(row)
                            } else {
                                (0.0, T::log_sum_exp(row))
                            };
                            *loss = lse - picked;
                            (shift, lse)
                        })
                        .unzip();
                    log_sum_exp[rows.clone()].copy_from_slice(&lse);
                    shifts
                }
                Some(split) => split_rows(
                    chunk,
                    vocab,
                    split,
                    targets,
                    &mut log_sum_exp[rows.clone()],
                    &mut losses[rows.clone()],
                    gradients,
                ),
            };
            drop(softmax);
            if let Some(grad_x) = &mut grad_x {
                let scales: Vec<f64> = shifts
                    .iter()
                    .zip(&log_sum_exp[rows.clone()])
                    .map(|(shift, lse)| (shift - lse).exp())
                    .collect();
                let local: Vec<Option<usize>> = targets
                    .iter()
                    .map(|target| match split {
                        None => Some(*target as usize),
                        Some(split) => split.local(*target, vocab),
                    })
                    .collect();
                gradients_from_exps(
                    Exps {
                        exps: MatRef::row_major(&*chunk, count, vocab),
                        scales: &scales,
                        targets: &local,
                    },
                    x_chunk,
                    weight,
                    &mut grad_x[first * hidden..(first + count) * hidden],
                    (&mut *grad_weight_t, first > 0),
                );
            }
        }
        gradients.then(|| untransposed(grad_weight_t, hidden, rows))
    });
    (losses, grad_x.zip(grad_weight))
}

/// The weight's gradient `[V, H]` from its transpose `[H, V]`, in which the loss accumulates
/// it: gemm computes `x^T E` (`E` the chunk's `[rows, V]` softmax) faster than `E^T x`, with
/// every element the same sum in the same order (measured 185-190 ms against 240-250 at 2048
/// rows, vocabulary 50304 and hidden 256 on 2 threads; the transpose costs about 10 ms).
/// The buffer is reused and the first of `rows`' chunks stores into it: with no rows at all
/// it holds nothing of this pass, and the gradient is zeros.
fn untransposed<T: SoftmaxRow>(grad_weight_t: &[T], hidden: usize, rows: usize) -> Vec<T> {
    if rows == 0 {
        return vec![T::ZERO; grad_weight_t.len()];
    }
    let _span = tracing::info_span!("weight_gradient_transpose").entered();
    transposed(grad_weight_t, hidden)
}

/// A chunk of rows as [`forward`] leaves them for their gradient: row `i`'s gradient is
/// `scales[i] * exps[i] - one_hot(targets[i])`, the target's column where this rank holds it.
struct Exps<'a, T> {
    exps: MatRef<'a, T>,
    scales: &'a [f64],
    targets: &'a [Option<usize>],
}

/// The chunk's gradients, from `G = diag(c) E - Y` with `E` the exponentials, `c` the rows'
/// scales and `Y` the one-hot targets: `grad_x = diag(c) (E W) - W[targets]` into
/// `grad_x`, and the weight's gradient transposed, `grad_weight_t (+)= (diag(c) x)^T E -
/// scatter(targets, x)^T`, added to what it holds when `accumulate`. The targets' rows are
/// subtracted in row order, deterministically.
fn gradients_from_exps<T: SoftmaxRow>(
    chunk: Exps<'_, T>,
    x: &[T],
    weight: &[T],
    grad_x: &mut [T],
    (grad_weight_t, accumulate): (&mut [T], bool),
) {
    let Exps {
        exps,
        scales,
        targets,
    } = chunk;
    let (hidden, vocab) = (x.len() / scales.len(), exps.cols);
    let input_grad = tracing::info_span!("input_gradient_matmul").entered();
    matmul(
        grad_x,
        exps,
        MatRef::row_major(weight, vocab, hidden),
        false,
    );
    grad_x
        .par_chunks_mut(hidden)
        .zip(scales.par_iter())
        .zip(targets.par_iter())
        .for_each(|((row, scale), target)| {
            let scale = T::from_f64(*scale);
            let target = target.map(|t| &weight[t * hidden..(t + 1) * hidden]);
            for (h, value) in row.iter_mut().enumerate() {
                *value = *value * scale;
                if let Some(target) = target {
                    *value = *value - target[h];
                }
            }
        });
    drop(input_grad);
    let _weight_grad = tracing::info_span!("weight_gradient_matmul").entered();
    let mut scaled_x = x.to_vec();
    scaled_x
        .par_chunks_mut(hidden)
        .zip(scales.par_iter())
        .for_each(|(row, scale)| {
            let scale = T::from_f64(*scale);
            row.iter_mut().for_each(|value| *value = *value * scale);
        });
    matmul(
        grad_weight_t,
        MatRef::row_major(&scaled_x, scales.len(), hidden).t(),
        exps,
        accumulate,
    );
    for (row, target) in x.chunks(hidden).zip(targets) {
        if let Some(t) = target {
            for (h, value) in row.iter().enumerate() {
                let total = &mut grad_weight_t[h * vocab + t];
                *total = *total - *value;
            }
        }
    }
}

/// One chunk's rows of a vocabulary split: the whole rows' log-sum-exp and losses from every
/// rank's share. With `gradients`, each row is left holding `exp(row - shift)` and the rows'
/// shifts are returned (see [`forward`]).
fn split_rows<T: SoftmaxRow>(
    chunk: &mut [T],
    vocab: usize,
    split: &VocabSplit,
    targets: &[u32],
    log_sum_exp: &mut [f64],
    losses: &mut [f64],
    gradients: bool,
) -> Vec<f64> {
    let (local, target): (Vec<(f64, f64)>, Vec<f64>) = chunk
        .par_chunks_mut(vocab)
        .zip(targets.par_iter())
        .map(|(row, target)| {
            let picked = split
                .local(*target, vocab)
                .map_or(0.0, |column| row[column].to_f64());
            let shifted = if gradients {
                T::exp_in_place(row)
            } else {
                (0.0, T::log_sum_exp(row))
            };
            (shifted, picked)
        })
        .unzip();
    let (shifts, local): (Vec<f64>, Vec<f64>) = local.into_iter().unzip();
    let (whole, picked) = split.combine(&local, &target);
    for (((lse, loss), w), p) in log_sum_exp
        .iter_mut()
        .zip(losses.iter_mut())
        .zip(&whole)
        .zip(&picked)
    {
        *lse = *w;
        *loss = w - p;
    }
    shifts
}

/// Gradients of `sum(upstream[i] * loss[i])` with respect to `x` and `weight`.
fn backward<T: SoftmaxRow>(
    x: &[T],
    weight: &[T],
    targets: &[u32],
    (rows, hidden, vocab): (usize, usize, usize),
    split: Option<&VocabSplit>,
    saved_log_sum_exp: &[f64],
    upstream: &[f64],
) -> Gradients<T> {
    let mut grad_x = vec![T::ZERO; rows * hidden];
    // `[H, V]`, the transpose of the stored rows.
    let weight = MatRef::row_major(weight, vocab, hidden).t();
    // Accumulated transposed, as in the forward pass (see `untransposed`).
    let lens = (CHUNK_ROWS.min(rows) * vocab, hidden * vocab);
    let grad_weight = with_scratches(lens, |logits: &mut [T], grad_weight_t: &mut [T]| {
        for first in (0..rows).step_by(CHUNK_ROWS) {
            let count = CHUNK_ROWS.min(rows - first);
            let x_chunk =
                MatRef::row_major(&x[first * hidden..(first + count) * hidden], count, hidden);
            let chunk = &mut logits[..count * vocab];
            matmul(chunk, x_chunk, weight, false);
            // Rows are independent: upstream * (softmax - one_hot), in place.
            chunk
                .par_chunks_mut(vocab)
                .enumerate()
                .for_each(|(offset, row)| {
                    let index = first + offset;
                    // A split row's log-sum-exp is the whole row's: always saved by the
                    // forward pass (the op checks).
                    let lse = saved_log_sum_exp
                        .get(index)
                        .copied()
                        .unwrap_or_else(|| T::log_sum_exp(row));
                    let target = match split {
                        None => Some(targets[index] as usize),
                        Some(split) => split.local(targets[index], vocab),
                    };
                    logits_to_gradient(row, lse, target, upstream[index]);
                });
            let dlogits = MatRef::row_major(&*chunk, count, vocab);
            matmul(
                &mut grad_x[first * hidden..(first + count) * hidden],
                dlogits,
                weight.t(),
                false,
            );
            matmul(grad_weight_t, x_chunk.t(), dlogits, first > 0);
        }
        untransposed(grad_weight_t, hidden, rows)
    });
    (grad_x, grad_weight)
}

/// The f32 or f64 slices of `x` and `weight`.
enum Inputs<'a> {
    F32(&'a [f32], &'a [f32]),
    F64(&'a [f64], &'a [f64]),
}

/// The slices of `x` and `weight`, and the targets, each checked to be contiguous.
fn inputs<'a>(
    (s1, l1): (&'a CpuStorage, &Layout),
    (s2, l2): (&'a CpuStorage, &Layout),
    (s3, l3): (&'a CpuStorage, &Layout),
) -> Result<(Inputs<'a>, &'a [u32])> {
    let targets = match s3 {
        CpuStorage::U32(values) => contiguous(OP, values, l3)?,
        _ => return Err(error("targets must be u32")),
    };
    let values = match (s1, s2) {
        (CpuStorage::F32(x), CpuStorage::F32(w)) => {
            Inputs::F32(contiguous(OP, x, l1)?, contiguous(OP, w, l2)?)
        }
        (CpuStorage::F64(x), CpuStorage::F64(w)) => {
            Inputs::F64(contiguous(OP, x, l1)?, contiguous(OP, w, l2)?)
        }
        _ => return Err(error("x and weight must both be f32 or both f64")),
    };
    Ok((values, targets))
}

fn gradient_tensors<T: candle_core::WithDType>(
    grad_x: Vec<T>,
    grad_weight: Vec<T>,
    (rows, hidden, vocab): (usize, usize, usize),
    device: &Device,
) -> Result<(Tensor, Tensor)> {
    Ok((
        Tensor::from_vec(grad_x, (rows, hidden), device)?,
        Tensor::from_vec(grad_weight, (vocab, hidden), device)?,
    ))
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
        let _span = tracing::info_span!("lm_head_loss").entered();
        let dims = dimensions(l1, l2, l3)?;
        let mut saved = self
            .log_sum_exp
            .lock()
            .map_err(|_| error("a previous pass panicked"))?;
        let (values, targets) = inputs((s1, l1), (s2, l2), (s3, l3))?;
        let split = self.split.as_ref();
        check_targets(targets, split.map_or(dims.2, |split| split.whole(dims.2)))?;
        let training = self.gradients_in_forward;
        let device = Device::Cpu;
        let (losses, grads) = match values {
            Inputs::F32(x, w) => {
                let (losses, grads) = forward(x, w, targets, dims, split, &mut saved, training);
                (
                    losses,
                    grads.map(|(gx, gw)| gradient_tensors(gx, gw, dims, &device)),
                )
            }
            Inputs::F64(x, w) => {
                let (losses, grads) = forward(x, w, targets, dims, split, &mut saved, training);
                (
                    losses,
                    grads.map(|(gx, gw)| gradient_tensors(gx, gw, dims, &device)),
                )
            }
        };
        *self
            .unit_gradients
            .lock()
            .map_err(|_| error("a previous pass panicked"))? = grads.transpose()?;
        let storage = match s1 {
            CpuStorage::F64(_) => CpuStorage::F64(losses),
            _ => CpuStorage::F32(losses.into_iter().map(|v| v as f32).collect()),
        };
        Ok((storage, Shape::from(dims.0)))
    }

    fn bwd(
        &self,
        x: &Tensor,
        weight: &Tensor,
        targets: &Tensor,
        _result: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let _span = tracing::info_span!("lm_head_loss_backward").entered();
        let upstream: Vec<f64> = grad.to_dtype(DType::F64)?.to_vec1()?;
        let unit = self
            .unit_gradients
            .lock()
            .map_err(|_| error("a previous pass panicked"))?
            .take();
        if let (Some((grad_x, grad_weight)), Some(first)) = (unit, upstream.first()) {
            if upstream.iter().all(|u| u == first) {
                // The unit gradients are this pass's own: scaled where they lie.
                scale_in_place(&grad_x, *first)?;
                scale_in_place(&grad_weight, *first)?;
                return Ok((Some(grad_x), Some(grad_weight), None));
            }
        }
        let saved = self
            .log_sum_exp
            .lock()
            .map_err(|_| error("a previous pass panicked"))?;
        let dims = dimensions(x.layout(), weight.layout(), targets.layout())?;
        let (xs, ws, ts) = (
            x.storage_and_layout().0,
            weight.storage_and_layout().0,
            targets.storage_and_layout().0,
        );
        let (values, target_values) = inputs(
            (cpu(OP, &xs)?, x.layout()),
            (cpu(OP, &ws)?, weight.layout()),
            (cpu(OP, &ts)?, targets.layout()),
        )?;
        let split = self.split.as_ref();
        if split.is_some() && saved.len() != dims.0 {
            return Err(error(
                "a vocabulary-parallel backward pass needs its forward pass's log-sum-exp",
            ));
        }
        let (grad_x, grad_weight) = match values {
            Inputs::F32(x, w) => {
                let (gx, gw) = backward(x, w, target_values, dims, split, &saved, &upstream);
                gradient_tensors(gx, gw, dims, &Device::Cpu)?
            }
            Inputs::F64(x, w) => {
                let (gx, gw) = backward(x, w, target_values, dims, split, &saved, &upstream);
                gradient_tensors(gx, gw, dims, &Device::Cpu)?
            }
        };
        Ok((Some(grad_x), Some(grad_weight), None))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Var;

    #[test]
    fn matches_the_unfused_loss_and_its_gradients() {
        // 300 rows cross two chunk boundaries (the tests' chunks are 128 rows).
        let (rows, hidden, vocab) = (300, 8, 50);
        let values = |count: usize, salt: usize| {
            (0..count)
                .map(|i| (((i * 7919 + salt) % 1000) as f64 / 500.0) - 1.0)
                .collect::<Vec<f64>>()
        };
        let x = Var::from_vec(values(rows * hidden, 1), (rows, hidden), &Device::Cpu).unwrap();
        let weight =
            Var::from_vec(values(hidden * vocab, 2), (vocab, hidden), &Device::Cpu).unwrap();
        let targets: Vec<u32> = (0..rows).map(|i| (i * 13 % vocab) as u32).collect();
        let target_tensor = Tensor::new(targets.as_slice(), &Device::Cpu).unwrap();

        let logits = x.matmul(&weight.t().unwrap()).unwrap();
        let lse = crate::model::log_sum_exp(&logits).unwrap();
        let picked = logits
            .gather(&target_tensor.unsqueeze(1).unwrap(), 1)
            .unwrap();
        let per_row = (lse - picked).unwrap();
        let reference = per_row.mean_all().unwrap();
        let reference_grads = reference.backward().unwrap();
        let reference = reference.to_scalar::<f64>().unwrap();
        // Gradients in the forward pass (uniform upstream), recomputed in the backward pass
        // (a non-uniform upstream forces that path), and a loss-only op.
        let weights = Tensor::from_vec(
            (0..rows)
                .map(|i| 1.0 + (i % 3) as f64)
                .collect::<Vec<f64>>(),
            rows,
            &Device::Cpu,
        )
        .unwrap();
        let weighted_grads = per_row
            .squeeze(1)
            .unwrap()
            .mul(&weights)
            .unwrap()
            .mean_all()
            .unwrap()
            .backward()
            .unwrap();
        for (op, weighted) in [
            (LinearCrossEntropy::training(), false),
            (LinearCrossEntropy::default(), false),
            (LinearCrossEntropy::training(), true),
        ] {
            let losses = x.apply_op3(&weight, &target_tensor, op).unwrap();
            let fused = losses.mean_all().unwrap().to_scalar::<f64>().unwrap();
            assert!((fused - reference).abs() < 1e-12, "{fused} vs {reference}");
            let (objective, scale) = if weighted {
                (
                    (&losses * &weights).unwrap().mean_all().unwrap(),
                    Some(&weights),
                )
            } else {
                (losses.mean_all().unwrap(), None)
            };
            let fused_grads = objective.backward().unwrap();
            let want_x = match scale {
                Some(w) => reference_grads
                    .get(&x)
                    .unwrap()
                    .broadcast_mul(&w.unsqueeze(1).unwrap())
                    .unwrap(),
                None => reference_grads.get(&x).unwrap().clone(),
            };
            let max_diff = |a: &Tensor, b: &Tensor| -> f64 {
                (a - b)
                    .unwrap()
                    .abs()
                    .unwrap()
                    .flatten_all()
                    .unwrap()
                    .max(0)
                    .unwrap()
                    .to_scalar::<f64>()
                    .unwrap()
            };
            let worst = max_diff(fused_grads.get(&x).unwrap(), &want_x);
            assert!(
                worst < 1e-12,
                "x gradient differs by {worst} (weighted {weighted})"
            );
            let want_weight = if weighted {
                &weighted_grads
            } else {
                &reference_grads
            };
            let worst = max_diff(
                fused_grads.get(&weight).unwrap(),
                want_weight.get(&weight).unwrap(),
            );
            assert!(
                worst < 1e-12,
                "weight gradient differs by {worst} (weighted {weighted})"
            );
        }
    }

    #[test]
    fn no_rows_give_a_zero_weight_gradient() {
        // The scratch buffers are reused and not cleared: fill them with something else first.
        let (hidden, vocab) = (8, 50);
        let weight: Vec<f64> = (0..hidden * vocab).map(|i| i as f64 * 0.01).collect();
        let leave_ones = || {
            crate::kernels::with_scratches((hidden * vocab, hidden * vocab), |a, b| {
                a.fill(1.0);
                b.fill(1.0);
            })
        };
        leave_ones();
        let (_, grads) = forward(
            &[],
            &weight,
            &[],
            (0, hidden, vocab),
            None,
            &mut Vec::new(),
            true,
        );
        let (_, grad_weight) = grads.expect("gradients asked for");
        assert!(
            grad_weight.iter().all(|g| *g == 0.0),
            "forward: {grad_weight:?}"
        );
        leave_ones();
        let (_, grad_weight) = backward(&[], &weight, &[], (0, hidden, vocab), None, &[], &[]);
        assert!(
            grad_weight.iter().all(|g| *g == 0.0),
            "backward: {grad_weight:?}"
        );
    }

    #[test]
    fn f32_matches_f64_closely() {
        let (rows, hidden, vocab) = (70, 16, 1000);
        let values = |count: usize, salt: usize| {
            (0..count)
                .map(|i| (((i * 7919 + salt) % 1000) as f64 / 100.0) - 5.0)
                .collect::<Vec<f64>>()
        };
        let x64 = Tensor::from_vec(values(rows * hidden, 1), (rows, hidden), &Device::Cpu).unwrap();
        let w64 =
            Tensor::from_vec(values(hidden * vocab, 2), (vocab, hidden), &Device::Cpu).unwrap();
        let targets: Vec<u32> = (0..rows).map(|i| (i * 13 % vocab) as u32).collect();
        let targets = Tensor::new(targets.as_slice(), &Device::Cpu).unwrap();
        let (x32, w32) = (
            x64.to_dtype(DType::F32).unwrap(),
            w64.to_dtype(DType::F32).unwrap(),
        );
        let loss64: Vec<f64> = x64
            .apply_op3(&w64, &targets, LinearCrossEntropy::default())
            .unwrap()
            .to_vec1()
            .unwrap();
        let loss32: Vec<f32> = x32
            .apply_op3(&w32, &targets, LinearCrossEntropy::default())
            .unwrap()
            .to_vec1()
            .unwrap();
        for (a, b) in loss64.iter().zip(&loss32) {
            assert!(
                (a - *b as f64).abs() <= 1e-4 * a.abs().max(1.0),
                "{a} vs {b}"
            );
        }
        // The training op's gradients, kept as exponentials and scales in f32.
        let gradients = |x: &Tensor, w: &Tensor| -> Vec<Vec<f64>> {
            let (x, w) = (Var::from_tensor(x).unwrap(), Var::from_tensor(w).unwrap());
            let loss = x
                .apply_op3(&w, &targets, LinearCrossEntropy::training())
                .unwrap()
                .mean_all()
                .unwrap();
            let grads = loss.backward().unwrap();
            [grads.get(&x).unwrap(), grads.get(&w).unwrap()]
                .map(|g| {
                    g.to_dtype(DType::F64)
                        .unwrap()
                        .flatten_all()
                        .unwrap()
                        .to_vec1()
                        .unwrap()
                })
                .to_vec()
        };
        for (g64, g32) in gradients(&x64, &w64).iter().zip(gradients(&x32, &w32)) {
            let largest = g64.iter().fold(0f64, |m, g| m.max(g.abs()));
            assert!(largest > 0.0);
            for (a, b) in g64.iter().zip(&g32) {
                assert!((a - b).abs() <= 1e-5 * largest, "{a} vs {b}");
            }
        }
    }

    #[test]
    fn a_target_outside_the_vocabulary_is_an_error() {
        let x = Tensor::zeros((2, 4), DType::F32, &Device::Cpu).unwrap();
        let w = Tensor::zeros((10, 4), DType::F32, &Device::Cpu).unwrap();
        let targets = Tensor::new(&[1u32, 10], &Device::Cpu).unwrap();
        let error = x
            .apply_op3(&w, &targets, LinearCrossEntropy::default())
            .unwrap_err()
            .to_string();
        assert!(
            error.contains("target 10 is outside the vocabulary of 10"),
            "{error}"
        );
    }
}
