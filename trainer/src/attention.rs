//! Causal self-attention with RoPE, as one op with its own backward.
//!
//! Takes the projected `q`, `k` and `v` as they come out of the projections, `[batch * seq,
//! heads * head_dim]`, and returns the mixed values in the same layout, ready for the output
//! projection: no transposes or copies into a heads-major layout. Each (sequence, head) pair is
//! independent and runs on one thread: rotate q and k (rotate-half RoPE), scores = q k^T /
//! sqrt(head_dim), softmax over the causal prefix of each row, out = probs v. The forward pass
//! keeps the rotated q and k and the probabilities for the backward pass; composing the same
//! thing from candle ops costs about fifteen full passes over the scores and as many buffers.

use std::sync::{Arc, Mutex};

use candle_core::{CpuStorage, CustomOp3, Device, Layout, Result, Shape, Tensor};
use rayon::prelude::*;

use crate::custom_op::{contiguous, cpu};
use crate::kernels::{matmul_serial, matmul_serial_into, MatRef, SoftmaxRow};

/// The op: `q.apply_op3(&k, &v, CausalAttention::new(...))`. Use a fresh op per application:
/// the forward pass leaves state in it for the backward pass.
#[derive(Clone, Debug)]
pub struct CausalAttention {
    batch: usize,
    seq: usize,
    heads: usize,
    /// `[seq, head_dim]` tables for rotate-half RoPE.
    cos: Arc<Vec<f64>>,
    sin: Arc<Vec<f64>>,
    /// Rows per causal block: a block of rows multiplies only the keys up to its last row.
    block: usize,
    saved: Arc<Mutex<Option<Saved>>>,
}

/// [`CausalAttention`]'s rows per causal block. Of the `[seq, seq]` scores, the products then
/// skip the blocks above the diagonal: at 256 positions, 6 of 16 blocks of 64.
const BLOCK_ROWS: usize = 64;

/// What the backward pass needs of one (sequence, head) pair.
#[derive(Debug)]
struct PairState<T> {
    /// Rotated q and k, `[seq, head_dim]`.
    q: Vec<T>,
    k: Vec<T>,
    /// Softmax probabilities `[seq, seq]`, zero above the diagonal.
    probs: Vec<T>,
}

#[derive(Debug)]
enum Saved {
    F32(Vec<PairState<f32>>),
    F64(Vec<PairState<f64>>),
}

/// This op's name, in its errors.
const OP: &str = "causal-attention";

fn error(message: impl Into<String>) -> candle_core::Error {
    candle_core::Error::Msg(format!("{OP}: {}", message.into()))
}

/// cos and sin tables `[seq, head_dim]` for rotate-half RoPE (each half repeats the angles).
pub fn rope_tables(seq: usize, head_dim: usize, theta: f64) -> (Vec<f64>, Vec<f64>) {
    let half = head_dim / 2;
    let mut cos = Vec::with_capacity(seq * head_dim);
    let mut sin = Vec::with_capacity(seq * head_dim);
    for position in 0..seq {
        let angles: Vec<f64> = (0..half)
            .map(|i| position as f64 / theta.powf(2.0 * i as f64 / head_dim as f64))
            .collect();
        for _copy in 0..2 {
            cos.extend(angles.iter().map(|a| a.cos()));
            sin.extend(angles.iter().map(|a| a.sin()));
        }
    }
    (cos, sin)
}

impl CausalAttention {
    pub fn new(batch: usize, seq: usize, heads: usize, head_dim: usize, theta: f64) -> Self {
        let (cos, sin) = rope_tables(seq, head_dim, theta);
        Self {
            batch,
            seq,
            heads,
            cos: Arc::new(cos),
            sin: Arc::new(sin),
            block: BLOCK_ROWS,
            saved: Arc::default(),
        }
    }

    /// The first row of each causal block and the row after it.
    fn blocks(&self) -> impl Iterator<Item = (usize, usize)> + '_ {
        (0..self.seq)
            .step_by(self.block)
            .map(|start| (start, (start + self.block).min(self.seq)))
    }

    /// `a b^T` as a `[seq, seq]` matrix, computed only on and below the diagonal's blocks:
    /// each block of rows against the rows of `b` up to its last row. Above them it is zero;
    /// the callers mask the rest of each row.
    fn causal_products<T: SoftmaxRow>(&self, a: MatRef<'_, T>, b: MatRef<'_, T>) -> Vec<T> {
        let seq = self.seq;
        let mut out = vec![T::ZERO; seq * seq];
        for (start, end) in self.blocks() {
            matmul_serial_into(
                &mut out[start * seq..],
                seq,
                a.rows(start, end),
                b.rows(0, end).t(),
                false,
            );
        }
        out
    }

    /// `p b` for a lower-triangular `[seq, seq]` `p` (zero above the diagonal's blocks): each
    /// block of rows of `p` against the rows of `b` up to its last row.
    fn lower_times<T: SoftmaxRow>(&self, p: MatRef<'_, T>, b: MatRef<'_, T>) -> Vec<T> {
        let width = b.cols;
        let mut out = vec![T::ZERO; self.seq * width];
        for (start, end) in self.blocks() {
            matmul_serial(
                &mut out[start * width..end * width],
                p.rows(start, end).cols(0, end),
                b.rows(0, end),
                false,
            );
        }
        out
    }

    /// `p^T b` for a lower-triangular `[seq, seq]` `p`: the rows of `b` a block's columns of
    /// `p` meet are the block's own and every row below it.
    fn lower_transposed_times<T: SoftmaxRow>(&self, p: MatRef<'_, T>, b: MatRef<'_, T>) -> Vec<T> {
        let (seq, width) = (self.seq, b.cols);
        let mut out = vec![T::ZERO; seq * width];
        for (start, end) in self.blocks() {
            matmul_serial(
                &mut out[start * width..end * width],
                p.rows(start, seq).cols(start, end).t(),
                b.rows(start, seq),
                false,
            );
        }
        out
    }

    /// `(width, head_dim)` for inputs of `len` elements, or an error.
    fn widths(&self, len: usize) -> Result<(usize, usize)> {
        let rows = self.batch * self.seq;
        if rows == 0 || !len.is_multiple_of(rows) || !(len / rows).is_multiple_of(self.heads) {
            return Err(error(format!(
                "{len} elements do not split into {rows} rows of {} heads",
                self.heads
            )));
        }
        let width = len / rows;
        let head_dim = width / self.heads;
        if !head_dim.is_multiple_of(2) || self.cos.len() != self.seq * head_dim {
            return Err(error(format!(
                "head_dim {head_dim} must be even and match the RoPE tables"
            )));
        }
        Ok((width, head_dim))
    }

    /// The strided `[seq, head_dim]` view of one pair inside a `[batch * seq, width]` tensor.
    fn view<'a, T>(
        &self,
        data: &'a [T],
        pair: usize,
        width: usize,
        head_dim: usize,
    ) -> MatRef<'a, T> {
        let (sequence, head) = (pair / self.heads, pair % self.heads);
        MatRef {
            data: &data[sequence * self.seq * width + head * head_dim..],
            rows: self.seq,
            cols: head_dim,
            row_stride: width,
            col_stride: 1,
        }
    }

    /// Writes per-pair `[seq, head_dim]` blocks into a `[batch * seq, width]` tensor.
    fn scatter<'a, T: SoftmaxRow>(
        &self,
        blocks: impl Iterator<Item = &'a [T]>,
        width: usize,
        head_dim: usize,
    ) -> Vec<T> {
        let mut out = vec![T::ZERO; self.batch * self.seq * width];
        for (pair, block) in blocks.enumerate() {
            let (sequence, head) = (pair / self.heads, pair % self.heads);
            for (row, values) in block.chunks(head_dim).enumerate() {
                let start = (sequence * self.seq + row) * width + head * head_dim;
                out[start..start + head_dim].copy_from_slice(values);
            }
        }
        out
    }

    fn tables<T: SoftmaxRow>(&self) -> (Vec<T>, Vec<T>) {
        (
            self.cos.iter().map(|v| T::from_f64(*v)).collect(),
            self.sin.iter().map(|v| T::from_f64(*v)).collect(),
        )
    }

    fn forward<T: SoftmaxRow>(
        &self,
        q: &[T],
        k: &[T],
        v: &[T],
    ) -> Result<(Vec<T>, Vec<PairState<T>>)> {
        let (width, head_dim) = self.widths(q.len())?;
        if k.len() != q.len() || v.len() != q.len() {
            return Err(error("q, k and v must have the same shape"));
        }
        let (cos, sin) = self.tables::<T>();
        let scale = T::from_f64(1.0 / (head_dim as f64).sqrt());
        let seq = self.seq;
        let results: Vec<(Vec<T>, PairState<T>)> = (0..self.batch * self.heads)
            .into_par_iter()
            .map(|pair| {
                let q = rotate(self.view(q, pair, width, head_dim), &cos, &sin);
                let k = rotate(self.view(k, pair, width, head_dim), &cos, &sin);
                let mut probs = self.causal_products(
                    MatRef::row_major(&q, seq, head_dim),
                    MatRef::row_major(&k, seq, head_dim),
                );
                for (row, values) in probs.chunks_mut(seq).enumerate() {
                    let (live, masked) = values.split_at_mut(row + 1);
                    for value in live.iter_mut() {
                        *value = *value * scale;
                    }
                    let log_sum_exp = T::log_sum_exp(live);
                    T::scaled_exp(live, log_sum_exp, 1.0);
                    masked.fill(T::ZERO);
                }
                let out = self.lower_times(
                    MatRef::row_major(&probs, seq, seq),
                    self.view(v, pair, width, head_dim),
                );
                (out, PairState { q, k, probs })
            })
            .collect();
        let (blocks, states): (Vec<Vec<T>>, Vec<PairState<T>>) = results.into_iter().unzip();
        Ok((
            self.scatter(blocks.iter().map(Vec::as_slice), width, head_dim),
            states,
        ))
    }

    /// Gradients of q, k and v given the upstream gradient of the output.
    fn backward<T: SoftmaxRow>(
        &self,
        v: &[T],
        upstream: &[T],
        states: &[PairState<T>],
    ) -> Result<[Vec<T>; 3]> {
        let (width, head_dim) = self.widths(v.len())?;
        let (cos, sin) = self.tables::<T>();
        let scale = 1.0 / (head_dim as f64).sqrt();
        let seq = self.seq;
        let grads: Vec<[Vec<T>; 3]> = states
            .par_iter()
            .enumerate()
            .map(|(pair, state)| {
                let upstream = self.view(upstream, pair, width, head_dim);
                let values = self.view(v, pair, width, head_dim);
                let probs = MatRef::row_major(&state.probs, seq, seq);
                let grad_v = self.lower_transposed_times(probs, upstream);
                // d scores = probs * (d probs - rowsum(d probs * probs)), on the causal prefix.
                let mut grad_scores = self.causal_products(upstream, values);
                for (row, values) in grad_scores.chunks_mut(seq).enumerate() {
                    let p = &state.probs[row * seq..(row + 1) * seq];
                    let (live, masked) = values.split_at_mut(row + 1);
                    let dot: f64 = live
                        .iter()
                        .zip(p)
                        .map(|(g, p)| g.to_f64() * p.to_f64())
                        .sum();
                    for (g, p) in live.iter_mut().zip(p) {
                        *g = T::from_f64(p.to_f64() * (g.to_f64() - dot) * scale);
                    }
                    masked.fill(T::ZERO);
                }
                let grad_scores = MatRef::row_major(&grad_scores, seq, seq);
                let (q_rows, k_rows) = (
                    MatRef::row_major(&state.q, seq, head_dim),
                    MatRef::row_major(&state.k, seq, head_dim),
                );
                let grad_q = self.lower_times(grad_scores, k_rows);
                let grad_k = self.lower_transposed_times(grad_scores, q_rows);
                [
                    unrotate(&grad_q, head_dim, &cos, &sin),
                    unrotate(&grad_k, head_dim, &cos, &sin),
                    grad_v,
                ]
            })
            .collect();
        let pick =
            |index: usize| self.scatter(grads.iter().map(|g| g[index].as_slice()), width, head_dim);
        Ok([pick(0), pick(1), pick(2)])
    }
}

/// Rotate-half RoPE of a `[seq, head_dim]` view: `x * cos + rotate_half(x) * sin`, where
/// `rotate_half([a, b]) = [-b, a]`.
fn rotate<T: SoftmaxRow>(x: MatRef<'_, T>, cos: &[T], sin: &[T]) -> Vec<T> {
    let (rows, dim) = (x.rows, x.cols);
    let half = dim / 2;
    let mut out = vec![T::ZERO; rows * dim];
    for row in 0..rows {
        let src = &x.data[row * x.row_stride..row * x.row_stride + dim];
        let (c, s) = (
            &cos[row * dim..(row + 1) * dim],
            &sin[row * dim..(row + 1) * dim],
        );
        let dst = &mut out[row * dim..(row + 1) * dim];
        for i in 0..half {
            dst[i] = src[i] * c[i] - src[i + half] * s[i];
            dst[i + half] = src[i + half] * c[i + half] + src[i] * s[i + half];
        }
    }
    out
}

/// The transpose of [`rotate`] (the gradient through it), on a contiguous `[seq, head_dim]`.
fn unrotate<T: SoftmaxRow>(grad: &[T], dim: usize, cos: &[T], sin: &[T]) -> Vec<T> {
    let half = dim / 2;
    let mut out = vec![T::ZERO; grad.len()];
    for (row, (g, dst)) in grad.chunks(dim).zip(out.chunks_mut(dim)).enumerate() {
        let (c, s) = (
            &cos[row * dim..(row + 1) * dim],
            &sin[row * dim..(row + 1) * dim],
        );
        for i in 0..half {
            dst[i] = g[i] * c[i] + g[i + half] * s[i + half];
            dst[i + half] = g[i + half] * c[i + half] - g[i] * s[i];
        }
    }
    out
}

impl CustomOp3 for CausalAttention {
    fn name(&self) -> &'static str {
        "causal-attention"
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
        let _span = tracing::info_span!("attention").entered();
        if l1.shape() != l2.shape() || l1.shape() != l3.shape() {
            return Err(error("q, k and v must have the same shape"));
        }
        let shape = l1.shape().clone();
        let mut saved = self
            .saved
            .lock()
            .map_err(|_| error("a previous pass panicked"))?;
        let out = match (s1, s2, s3) {
            (CpuStorage::F32(q), CpuStorage::F32(k), CpuStorage::F32(v)) => {
                let (out, states) = self.forward(
                    contiguous(OP, q, l1)?,
                    contiguous(OP, k, l2)?,
                    contiguous(OP, v, l3)?,
                )?;
                *saved = Some(Saved::F32(states));
                CpuStorage::F32(out)
            }
            (CpuStorage::F64(q), CpuStorage::F64(k), CpuStorage::F64(v)) => {
                let (out, states) = self.forward(
                    contiguous(OP, q, l1)?,
                    contiguous(OP, k, l2)?,
                    contiguous(OP, v, l3)?,
                )?;
                *saved = Some(Saved::F64(states));
                CpuStorage::F64(out)
            }
            _ => return Err(error("q, k and v must all be f32 or all f64")),
        };
        Ok((out, shape))
    }

    fn bwd(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        _result: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let _span = tracing::info_span!("attention_backward").entered();
        let grad = grad.contiguous()?;
        let saved = self
            .saved
            .lock()
            .map_err(|_| error("a previous pass panicked"))?
            .take();
        let (qs, ks, vs, gs) = (
            q.storage_and_layout().0,
            k.storage_and_layout().0,
            v.storage_and_layout().0,
            grad.storage_and_layout().0,
        );
        let (qc, kc, vc, gc) = (cpu(OP, &qs)?, cpu(OP, &ks)?, cpu(OP, &vs)?, cpu(OP, &gs)?);
        let shape = q.shape();
        let device = Device::Cpu;
        let [dq, dk, dv] = match (qc, kc, vc, gc) {
            (
                CpuStorage::F32(qv),
                CpuStorage::F32(kv),
                CpuStorage::F32(vv),
                CpuStorage::F32(gv),
            ) => {
                let (v, g) = (
                    contiguous(OP, vv, v.layout())?,
                    contiguous(OP, gv, grad.layout())?,
                );
                let states = match saved {
                    Some(Saved::F32(states)) => states,
                    _ => {
                        self.forward(
                            contiguous(OP, qv, q.layout())?,
                            contiguous(OP, kv, k.layout())?,
                            v,
                        )?
                        .1
                    }
                };
                self.backward(v, g, &states)?
                    .map(|values| Tensor::from_vec(values, shape, &device))
            }
            (
                CpuStorage::F64(qv),
                CpuStorage::F64(kv),
                CpuStorage::F64(vv),
                CpuStorage::F64(gv),
            ) => {
                let (v, g) = (
                    contiguous(OP, vv, v.layout())?,
                    contiguous(OP, gv, grad.layout())?,
                );
                let states = match saved {
                    Some(Saved::F64(states)) => states,
                    _ => {
                        self.forward(
                            contiguous(OP, qv, q.layout())?,
                            contiguous(OP, kv, k.layout())?,
                            v,
                        )?
                        .1
                    }
                };
                self.backward(v, g, &states)?
                    .map(|values| Tensor::from_vec(values, shape, &device))
            }
            _ => return Err(error("q, k, v and the gradient must share a float type")),
        };
        Ok((Some(dq?), Some(dk?), Some(dv?)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{DType, Var};

    /// The op's output and the gradients of q, k and v for `sum(output * weights)`.
    fn run(op: CausalAttention, inputs: &[Tensor; 3], weights: &Tensor) -> Vec<Vec<f64>> {
        let vars = inputs
            .clone()
            .map(|input| Var::from_tensor(&input).unwrap());
        let out = vars[0].apply_op3(&vars[1], &vars[2], op).unwrap();
        let grads = (&out * weights)
            .unwrap()
            .sum_all()
            .unwrap()
            .backward()
            .unwrap();
        let flat = |t: &Tensor| -> Vec<f64> {
            t.to_dtype(DType::F64)
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1()
                .unwrap()
        };
        let mut all = vec![flat(&out)];
        all.extend(vars.iter().map(|var| flat(grads.get(var).unwrap())));
        all
    }

    #[test]
    fn causal_blocks_give_what_one_block_gives() {
        // 10 positions in blocks of 4 (the last one short), 2 sequences of 2 heads of 4.
        let (batch, seq, heads, head_dim) = (2, 10, 2, 4);
        let values = |salt: usize| {
            let data: Vec<f64> = (0..batch * seq * heads * head_dim)
                .map(|i| (((i * 7919 + salt) % 1000) as f64 / 500.0) - 1.0)
                .collect();
            Tensor::from_vec(data, (batch * seq, heads * head_dim), &Device::Cpu).unwrap()
        };
        let inputs = [values(1), values(2), values(3)];
        let weights = values(4);
        let op = || CausalAttention::new(batch, seq, heads, head_dim, 10_000.0);
        let blocked = run(CausalAttention { block: 4, ..op() }, &inputs, &weights);
        let whole = run(CausalAttention { block: seq, ..op() }, &inputs, &weights);
        for (what, (a, b)) in ["output", "grad q", "grad k", "grad v"]
            .iter()
            .zip(blocked.iter().zip(&whole))
        {
            assert!(a.iter().any(|x| *x != 0.0), "{what} is all zeros");
            for (x, y) in a.iter().zip(b) {
                assert!((x - y).abs() <= 1e-12, "{what}: {x} vs {y}");
            }
        }
        // f32 runs the same blocks.
        let inputs32 = inputs.clone().map(|t| t.to_dtype(DType::F32).unwrap());
        let f32_blocked = run(
            CausalAttention { block: 4, ..op() },
            &inputs32,
            &weights.to_dtype(DType::F32).unwrap(),
        );
        for (a, b) in f32_blocked.iter().zip(&whole) {
            for (x, y) in a.iter().zip(b) {
                assert!((x - y).abs() <= 1e-5, "{x} vs {y}");
            }
        }
    }
}
