//! Grouped expert matmuls for the dropless MoE, as ops with their own backward.
//!
//! The MoE block sorts its routed (token, expert) rows by expert, so expert `e` owns the rows
//! `offsets[e]..offsets[e + 1]` of a `[rows, in]` input. Each op multiplies every expert's rows
//! by that expert's slice of a stacked `[experts, in, out]` weight, one matrix product per
//! expert, straight on the stacked storage: no per-expert slicing of the weight in the graph,
//! whose backward would build a zero-padded copy of the whole stack for every expert.
//!
//! - [`SwiGlu`]: `silu(x W_gate[e]) * (x W_up[e])`, the experts' first half.
//! - [`GroupedMatmul`]: `h W_down[e]`, the second half.
//! - [`WeightedRows`]: each routed row times its router probability.

use std::sync::{Arc, Mutex};

use candle_core::{CpuStorage, CustomOp2, CustomOp3, Device, Layout, Result, Shape, Tensor};
use rayon::prelude::*;

use crate::custom_op::{contiguous, cpu};
use crate::kernels::{matmul, matmul_blocks, matmul_blocks_new, MatRef, SoftmaxRow};

/// This op's name, in its errors.
const OP: &str = "experts";

fn error(message: impl Into<String>) -> candle_core::Error {
    candle_core::Error::Msg(format!("{OP}: {}", message.into()))
}

/// Which rows belong to which expert.
#[derive(Clone, Debug)]
pub struct Groups {
    /// `experts + 1` row offsets, ascending, starting at 0.
    offsets: Arc<Vec<usize>>,
}

impl Groups {
    /// Groups from the number of rows each expert owns, in expert order.
    pub fn from_counts(counts: &[usize]) -> Self {
        let mut offsets = vec![0];
        for count in counts {
            offsets.push(offsets[offsets.len() - 1] + count);
        }
        Self {
            offsets: Arc::new(offsets),
        }
    }

    fn experts(&self) -> usize {
        self.offsets.len() - 1
    }

    fn rows(&self) -> usize {
        self.offsets[self.experts()]
    }

    /// `(expert, first row, end row)` of every expert that owns rows.
    fn owned(&self) -> impl Iterator<Item = (usize, usize, usize)> + '_ {
        self.offsets
            .windows(2)
            .enumerate()
            .filter(|(_, range)| range[0] < range[1])
            .map(|(expert, range)| (expert, range[0], range[1]))
    }

    /// `(rows, in, out)` for `x: [rows, in]` and `w: [experts, in, out]`, checked.
    fn dimensions(&self, x: &Layout, w: &Layout) -> Result<(usize, usize, usize)> {
        let (rows, inner) = x.shape().dims2()?;
        let (experts, w_inner, outer) = w.shape().dims3()?;
        if rows != self.rows() || experts != self.experts() || w_inner != inner {
            return Err(error(format!(
                "input {:?} and weight {:?} do not fit {} rows over {} experts",
                x.shape(),
                w.shape(),
                self.rows(),
                self.experts()
            )));
        }
        Ok((rows, inner, outer))
    }

    /// `(expert, first row, end row)`: every owning expert's rows in near-equal parts of at
    /// most [`BLOCK_ROWS`].
    fn blocks(&self) -> Vec<(usize, usize, usize)> {
        let mut blocks = Vec::new();
        for (expert, first, end) in self.owned() {
            let parts = (end - first).div_ceil(BLOCK_ROWS);
            blocks.extend((0..parts).map(|part| {
                let row = |part: usize| first + (end - first) * part / parts;
                (expert, row(part), row(part + 1))
            }));
        }
        blocks
    }

    /// `out[rows of e] = x[rows of e] * w[e]` for every expert.
    fn forward<T: SoftmaxRow>(
        &self,
        x: &[T],
        w: &[T],
        (rows, inner, outer): (usize, usize, usize),
    ) -> Vec<T> {
        let blocks = self.blocks();
        matmul_blocks_new(rows, outer, &row_ranges(&blocks), |index| {
            forward_operands(blocks[index], x, w, (inner, outer))
        })
    }

    /// `grad_x[rows of e] = grad[rows of e] * w[e]^T`.
    fn backward_input<T: SoftmaxRow>(
        &self,
        grad: &[T],
        w: &[T],
        (rows, inner, outer): (usize, usize, usize),
    ) -> Vec<T> {
        let blocks = self.blocks();
        matmul_blocks_new(rows, inner, &row_ranges(&blocks), |index| {
            input_gradient_operands(blocks[index], grad, w, (inner, outer))
        })
    }

    /// [`Groups::backward_input`] added into `grad_x`.
    fn add_backward_input<T: SoftmaxRow>(
        &self,
        grad_x: &mut [T],
        grad: &[T],
        w: &[T],
        (_, inner, outer): (usize, usize, usize),
    ) {
        let blocks = self.blocks();
        matmul_blocks(
            grad_x,
            inner,
            &row_ranges(&blocks),
            |index| input_gradient_operands(blocks[index], grad, w, (inner, outer)),
            true,
        );
    }

    /// `grad_w[e] = x[rows of e]^T * grad[rows of e]` (zero for an expert without rows). An
    /// expert with more than [`BLOCK_ROWS`] rows has its gradient's rows split in as many
    /// parts, so that its products can run side by side too.
    fn backward_weight<T: SoftmaxRow>(
        &self,
        x: &[T],
        grad: &[T],
        (_, inner, outer): (usize, usize, usize),
    ) -> Vec<T> {
        // `(expert, first, end)`: rows `first..end` of the expert's `[in, out]` gradient.
        let mut blocks = Vec::new();
        for expert in 0..self.experts() {
            let rows = self.offsets[expert + 1] - self.offsets[expert];
            let parts = rows.div_ceil(BLOCK_ROWS).clamp(1, inner.max(1));
            blocks.extend((0..parts).map(|part| {
                let row = |part: usize| inner * part / parts;
                (expert, row(part), row(part + 1))
            }));
        }
        let ranges: Vec<(usize, usize)> = blocks
            .iter()
            .map(|&(expert, first, end)| (expert * inner + first, expert * inner + end))
            .collect();
        matmul_blocks_new(self.experts() * inner, outer, &ranges, |index| {
            let (expert, first_in, end_in) = blocks[index];
            let (first, end) = (self.offsets[expert], self.offsets[expert + 1]);
            (
                MatRef::row_major(&x[first * inner..end * inner], end - first, inner)
                    .cols(first_in, end_in)
                    .t(),
                MatRef::row_major(&grad[first * outer..end * outer], end - first, outer),
            )
        })
    }
}

/// Rows per product of the experts' products, which run side by side, each on one thread: a
/// popular expert's rows are split, so that it does not leave the other threads idle. Larger
/// blocks measured faster for the input gradient (its weight operand is a transposed view,
/// packed once per product); 1024 rows lose little to the imbalance of a routed batch.
const BLOCK_ROWS: usize = 1024;

/// The row ranges of `(expert, first, end)` blocks.
fn row_ranges(blocks: &[(usize, usize, usize)]) -> Vec<(usize, usize)> {
    blocks.iter().map(|&(_, first, end)| (first, end)).collect()
}

/// `(x rows of the block, w[expert])`: a block of `out = x w[expert]`.
fn forward_operands<'a, T>(
    (expert, first, end): (usize, usize, usize),
    x: &'a [T],
    w: &'a [T],
    (inner, outer): (usize, usize),
) -> (MatRef<'a, T>, MatRef<'a, T>) {
    (
        MatRef::row_major(&x[first * inner..end * inner], end - first, inner),
        expert_weight(w, expert, inner, outer),
    )
}

/// `(grad rows of the block, w[expert]^T)`: a block of `grad_x = grad w[expert]^T`.
fn input_gradient_operands<'a, T>(
    (expert, first, end): (usize, usize, usize),
    grad: &'a [T],
    w: &'a [T],
    (inner, outer): (usize, usize),
) -> (MatRef<'a, T>, MatRef<'a, T>) {
    (
        MatRef::row_major(&grad[first * outer..end * outer], end - first, outer),
        expert_weight(w, expert, inner, outer).t(),
    )
}

/// `out = x w[expert]` for one expert's rows: `x: [rows, in]`, `w: [experts, in, out]`.
pub(crate) fn expert_forward<T: SoftmaxRow>(
    out: &mut [T],
    x: &[T],
    w: &[T],
    expert: usize,
    (rows, inner, outer): (usize, usize, usize),
) {
    let (a, b) = forward_operands((expert, 0, rows), x, w, (inner, outer));
    matmul(out, a, b, false);
}

/// `grad_x (+)= grad w[expert]^T` for one expert's rows.
pub(crate) fn expert_backward_input<T: SoftmaxRow>(
    grad_x: &mut [T],
    grad: &[T],
    w: &[T],
    expert: usize,
    (rows, inner, outer): (usize, usize, usize),
    accumulate: bool,
) {
    let (a, b) = input_gradient_operands((expert, 0, rows), grad, w, (inner, outer));
    matmul(grad_x, a, b, accumulate);
}

/// `grad_w = x^T grad`: one expert's `[in, out]` weight gradient from its rows.
pub(crate) fn expert_backward_weight<T: SoftmaxRow>(
    grad_w: &mut [T],
    x: &[T],
    grad: &[T],
    (rows, inner, outer): (usize, usize, usize),
) {
    matmul(
        grad_w,
        MatRef::row_major(x, rows, inner).t(),
        MatRef::row_major(grad, rows, outer),
        false,
    );
}

/// Expert `expert`'s `[in, out]` matrix inside a stacked `[experts, in, out]` weight.
fn expert_weight<T>(w: &[T], expert: usize, inner: usize, outer: usize) -> MatRef<'_, T> {
    MatRef::row_major(
        &w[expert * inner * outer..(expert + 1) * inner * outer],
        inner,
        outer,
    )
}

/// `x.apply_op2(&w, GroupedMatmul(groups))`: `[rows, in]` x `[experts, in, out]` -> `[rows, out]`.
#[derive(Clone, Debug)]
pub struct GroupedMatmul(pub Groups);

impl CustomOp2 for GroupedMatmul {
    fn name(&self) -> &'static str {
        "grouped-matmul"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let _span = tracing::info_span!("grouped_matmul").entered();
        let dims = self.0.dimensions(l1, l2)?;
        let out = match (s1, s2) {
            (CpuStorage::F32(x), CpuStorage::F32(w)) => CpuStorage::F32(self.0.forward(
                contiguous(OP, x, l1)?,
                contiguous(OP, w, l2)?,
                dims,
            )),
            (CpuStorage::F64(x), CpuStorage::F64(w)) => CpuStorage::F64(self.0.forward(
                contiguous(OP, x, l1)?,
                contiguous(OP, w, l2)?,
                dims,
            )),
            _ => return Err(error("x and w must both be f32 or both f64")),
        };
        Ok((out, Shape::from((dims.0, dims.2))))
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _result: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let _span = tracing::info_span!("grouped_matmul_backward").entered();
        let grad = grad.contiguous()?;
        let dims = self.0.dimensions(x.layout(), w.layout())?;
        let (xs, ws, gs) = (
            x.storage_and_layout().0,
            w.storage_and_layout().0,
            grad.storage_and_layout().0,
        );
        let device = Device::Cpu;
        macro_rules! run {
            ($xv:expr, $wv:expr, $gv:expr) => {{
                let (xv, wv, gv) = (
                    contiguous(OP, $xv, x.layout())?,
                    contiguous(OP, $wv, w.layout())?,
                    contiguous(OP, $gv, grad.layout())?,
                );
                let grad_x = self.0.backward_input(gv, wv, dims);
                let grad_w = self.0.backward_weight(xv, gv, dims);
                (
                    Tensor::from_vec(grad_x, x.shape(), &device)?,
                    Tensor::from_vec(grad_w, w.shape(), &device)?,
                )
            }};
        }
        let (grad_x, grad_w) = match (cpu(OP, &xs)?, cpu(OP, &ws)?, cpu(OP, &gs)?) {
            (CpuStorage::F32(xv), CpuStorage::F32(wv), CpuStorage::F32(gv)) => run!(xv, wv, gv),
            (CpuStorage::F64(xv), CpuStorage::F64(wv), CpuStorage::F64(gv)) => run!(xv, wv, gv),
            _ => return Err(error("x, w and the gradient must share a float type")),
        };
        Ok((Some(grad_x), Some(grad_w)))
    }
}

/// `x.apply_op3(&gate, &up, SwiGlu::new(groups))`: `silu(x W_gate[e]) * (x W_up[e])` per
/// expert, `[rows, in]` x `[experts, in, ffn]` (twice) -> `[rows, ffn]`. Use a fresh op per
/// application: the forward pass keeps both projections for the backward pass.
#[derive(Clone, Debug)]
pub struct SwiGlu {
    groups: Groups,
    saved: Arc<Mutex<Option<SavedProjections>>>,
}

#[derive(Debug)]
enum SavedProjections {
    F32(Vec<f32>, Vec<f32>),
    F64(Vec<f64>, Vec<f64>),
}

impl SwiGlu {
    pub fn new(groups: Groups) -> Self {
        Self {
            groups,
            saved: Arc::default(),
        }
    }
}

/// `silu(gate) * up`, elementwise, in parallel.
fn swiglu<T: SoftmaxRow>(gate: &[T], up: &[T]) -> Vec<T> {
    let mut out = vec![T::ZERO; gate.len()];
    swiglu_into(&mut out, gate, up);
    out
}

/// Elements per parallel task of the SwiGLU's element-wise work.
const PIECE: usize = 4096;

/// [`swiglu`] into `out`.
pub(crate) fn swiglu_into<T: SoftmaxRow>(out: &mut [T], gate: &[T], up: &[T]) {
    out.par_chunks_mut(PIECE)
        .zip(gate.par_chunks(PIECE).zip(up.par_chunks(PIECE)))
        .for_each(|(out, (gate, up))| T::swiglu(out, gate, up));
}

/// Gradients of the gate and up projections given the upstream gradient of `silu(a) * b`.
pub(crate) fn swiglu_backward<T: SoftmaxRow>(gate: &[T], up: &[T], grad: &[T]) -> (Vec<T>, Vec<T>) {
    let mut grad_gate = vec![T::ZERO; gate.len()];
    let mut grad_up = vec![T::ZERO; gate.len()];
    grad_gate
        .par_chunks_mut(PIECE)
        .zip(grad_up.par_chunks_mut(PIECE))
        .zip(
            gate.par_chunks(PIECE)
                .zip(up.par_chunks(PIECE))
                .zip(grad.par_chunks(PIECE)),
        )
        .for_each(|((grad_gate, grad_up), ((gate, up), grad))| {
            T::swiglu_backward((gate, up, grad), grad_gate, grad_up)
        });
    (grad_gate, grad_up)
}

impl CustomOp3 for SwiGlu {
    fn name(&self) -> &'static str {
        "swiglu-experts"
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
        let _span = tracing::info_span!("swiglu").entered();
        let dims = self.groups.dimensions(l1, l2)?;
        if l2.shape() != l3.shape() {
            return Err(error("gate and up weights must have the same shape"));
        }
        let mut saved = self
            .saved
            .lock()
            .map_err(|_| error("a previous pass panicked"))?;
        let out = match (s1, s2, s3) {
            (CpuStorage::F32(x), CpuStorage::F32(g), CpuStorage::F32(u)) => {
                let x = contiguous(OP, x, l1)?;
                let gate = self.groups.forward(x, contiguous(OP, g, l2)?, dims);
                let up = self.groups.forward(x, contiguous(OP, u, l3)?, dims);
                let out = swiglu(&gate, &up);
                *saved = Some(SavedProjections::F32(gate, up));
                CpuStorage::F32(out)
            }
            (CpuStorage::F64(x), CpuStorage::F64(g), CpuStorage::F64(u)) => {
                let x = contiguous(OP, x, l1)?;
                let gate = self.groups.forward(x, contiguous(OP, g, l2)?, dims);
                let up = self.groups.forward(x, contiguous(OP, u, l3)?, dims);
                let out = swiglu(&gate, &up);
                *saved = Some(SavedProjections::F64(gate, up));
                CpuStorage::F64(out)
            }
            _ => return Err(error("x and the weights must all be f32 or all f64")),
        };
        Ok((out, Shape::from((dims.0, dims.2))))
    }

    fn bwd(
        &self,
        x: &Tensor,
        gate_w: &Tensor,
        up_w: &Tensor,
        _result: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let _span = tracing::info_span!("swiglu_backward").entered();
        let grad = grad.contiguous()?;
        let dims = self.groups.dimensions(x.layout(), gate_w.layout())?;
        let saved = self
            .saved
            .lock()
            .map_err(|_| error("a previous pass panicked"))?
            .take();
        let (xs, gs, us, ds) = (
            x.storage_and_layout().0,
            gate_w.storage_and_layout().0,
            up_w.storage_and_layout().0,
            grad.storage_and_layout().0,
        );
        let device = Device::Cpu;
        macro_rules! run {
            ($xv:expr, $gv:expr, $uv:expr, $dv:expr, $saved:expr) => {{
                let (xv, gv, uv, dv) = (
                    contiguous(OP, $xv, x.layout())?,
                    contiguous(OP, $gv, gate_w.layout())?,
                    contiguous(OP, $uv, up_w.layout())?,
                    contiguous(OP, $dv, grad.layout())?,
                );
                let (gate, up) = match $saved {
                    Some(projections) => projections,
                    None => (
                        self.groups.forward(xv, gv, dims),
                        self.groups.forward(xv, uv, dims),
                    ),
                };
                let (grad_gate, grad_up) = swiglu_backward(&gate, &up, dv);
                let mut grad_x = self.groups.backward_input(&grad_gate, gv, dims);
                self.groups
                    .add_backward_input(&mut grad_x, &grad_up, uv, dims);
                (
                    Tensor::from_vec(grad_x, x.shape(), &device)?,
                    Tensor::from_vec(
                        self.groups.backward_weight(xv, &grad_gate, dims),
                        gate_w.shape(),
                        &device,
                    )?,
                    Tensor::from_vec(
                        self.groups.backward_weight(xv, &grad_up, dims),
                        up_w.shape(),
                        &device,
                    )?,
                )
            }};
        }
        let (grad_x, grad_gate, grad_up) =
            match (cpu(OP, &xs)?, cpu(OP, &gs)?, cpu(OP, &us)?, cpu(OP, &ds)?) {
                (
                    CpuStorage::F32(xv),
                    CpuStorage::F32(gv),
                    CpuStorage::F32(uv),
                    CpuStorage::F32(dv),
                ) => {
                    let saved = match saved {
                        Some(SavedProjections::F32(gate, up)) => Some((gate, up)),
                        _ => None,
                    };
                    run!(xv, gv, uv, dv, saved)
                }
                (
                    CpuStorage::F64(xv),
                    CpuStorage::F64(gv),
                    CpuStorage::F64(uv),
                    CpuStorage::F64(dv),
                ) => {
                    let saved = match saved {
                        Some(SavedProjections::F64(gate, up)) => Some((gate, up)),
                        _ => None,
                    };
                    run!(xv, gv, uv, dv, saved)
                }
                _ => {
                    return Err(error(
                        "x, the weights and the gradient must share a float type",
                    ))
                }
            };
        Ok((Some(grad_x), Some(grad_gate), Some(grad_up)))
    }
}

/// `rows.apply_op2(&weights, WeightedRows)`: `[rows, width]` x `[rows]` -> each row times its
/// weight (the experts' outputs times their router probabilities).
///
/// An op of its own because candle's element-wise ops return their left operand unchanged
/// when it has no elements, which drops the right one from the graph: a rank whose experts
/// got no rows would then skip the backward pass of the weights' tensor-parallel entry, and
/// its group would wait in that collective forever. This op keeps both inputs in the graph
/// at any size.
#[derive(Clone, Copy, Debug)]
pub struct WeightedRows;

impl WeightedRows {
    fn forward<T: SoftmaxRow>(rows: &[T], weights: &[T]) -> Vec<T> {
        let mut out = rows.to_vec();
        if let Some(width) = rows.len().checked_div(weights.len()).filter(|w| *w > 0) {
            out.par_chunks_mut(width)
                .zip(weights.par_iter())
                .for_each(|(row, w)| row.iter_mut().for_each(|v| *v = *v * *w));
        }
        out
    }
}

impl CustomOp2 for WeightedRows {
    fn name(&self) -> &'static str {
        "weighted-rows"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (count, _) = l1.shape().dims2()?;
        if l2.shape().dims1()? != count {
            return Err(error(format!(
                "{:?} rows and {:?} weights differ in count",
                l1.shape(),
                l2.shape()
            )));
        }
        let out = match (s1, s2) {
            (CpuStorage::F32(r), CpuStorage::F32(w)) => CpuStorage::F32(Self::forward(
                contiguous(OP, r, l1)?,
                contiguous(OP, w, l2)?,
            )),
            (CpuStorage::F64(r), CpuStorage::F64(w)) => CpuStorage::F64(Self::forward(
                contiguous(OP, r, l1)?,
                contiguous(OP, w, l2)?,
            )),
            _ => return Err(error("rows and weights must both be f32 or both f64")),
        };
        Ok((out, l1.shape().clone()))
    }

    fn bwd(
        &self,
        rows: &Tensor,
        weights: &Tensor,
        _result: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        // candle's own ops are right here at any size: their results are the gradients, not
        // part of a graph that is differentiated again.
        let grad_rows = grad.broadcast_mul(&weights.unsqueeze(1)?)?;
        let grad_weights = (grad * rows)?.sum(1)?;
        Ok((Some(grad_rows), Some(grad_weights)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{DType, Var};

    /// `x[rows] * m` for a row-major `[rows, cols]` m, by the definition.
    fn reference(x: &[f64], m: &[f64], (rows, inner, cols): (usize, usize, usize)) -> Vec<f64> {
        let mut out = vec![0.0; rows * cols];
        for r in 0..rows {
            for c in 0..cols {
                out[r * cols + c] = (0..inner).map(|i| x[r * inner + i] * m[i * cols + c]).sum();
            }
        }
        out
    }

    fn transpose(m: &[f64], rows: usize, cols: usize) -> Vec<f64> {
        (0..cols * rows)
            .map(|i| m[(i % rows) * cols + i / rows])
            .collect()
    }

    #[test]
    fn grouped_products_split_a_popular_expert_and_match_the_definition() {
        // Expert 0 owns more rows than a block (split in two), expert 1 none, expert 2 a few.
        let counts = [BLOCK_ROWS + 300, 0, 7];
        let groups = Groups::from_counts(&counts);
        assert_eq!(
            groups.blocks(),
            [(0, 0, 662), (0, 662, 1324), (2, 1324, 1331)]
        );
        let (inner, outer) = (5, 3);
        let rows: usize = counts.iter().sum();
        let dims = (rows, inner, outer);
        let value = |i: usize, salt: usize| ((i * 7919 + salt) % 23) as f64 * 0.125 - 1.0;
        let x: Vec<f64> = (0..rows * inner).map(|i| value(i, 1)).collect();
        let w: Vec<f64> = (0..3 * inner * outer).map(|i| value(i, 2)).collect();
        let grad: Vec<f64> = (0..rows * outer).map(|i| value(i, 3)).collect();
        let weight = |e: usize| &w[e * inner * outer..(e + 1) * inner * outer];
        let (mut out, mut grad_x, mut grad_w) = (Vec::new(), Vec::new(), Vec::new());
        let mut first = 0;
        for (expert, count) in counts.iter().enumerate() {
            let (x_e, g_e) = (
                &x[first * inner..(first + count) * inner],
                &grad[first * outer..(first + count) * outer],
            );
            out.extend(reference(x_e, weight(expert), (*count, inner, outer)));
            let w_t = transpose(weight(expert), inner, outer);
            grad_x.extend(reference(g_e, &w_t, (*count, outer, inner)));
            let x_t = transpose(x_e, *count, inner);
            grad_w.extend(reference(&x_t, g_e, (inner, *count, outer)));
            first += count;
        }
        let close = |a: &[f64], b: &[f64], what: &str| {
            assert_eq!(a.len(), b.len(), "{what}");
            for (i, (a, b)) in a.iter().zip(b).enumerate() {
                assert!((a - b).abs() < 1e-9, "{what}[{i}]: {a} vs {b}");
            }
        };
        close(&groups.forward(&x, &w, dims), &out, "output");
        let mut input = groups.backward_input(&grad, &w, dims);
        close(&input, &grad_x, "input gradient");
        groups.add_backward_input(&mut input, &grad, &w, dims);
        let doubled: Vec<f64> = grad_x.iter().map(|v| v * 2.0).collect();
        close(&input, &doubled, "added input gradient");
        close(
            &groups.backward_weight(&x, &grad, dims),
            &grad_w,
            "weight gradient",
        );
    }

    #[test]
    fn weighted_rows_match_a_broadcast_multiply_and_keep_empty_weights_in_the_graph() {
        let device = Device::Cpu;
        let rows = Var::from_vec(
            (0..12).map(|i| i as f64 * 0.25 - 1.0).collect::<Vec<_>>(),
            (3, 4),
            &device,
        )
        .unwrap();
        let weights = Var::from_vec(vec![0.5f64, -2.0, 3.0], 3, &device).unwrap();
        let upstream = Tensor::from_vec(
            (0..12).map(|i| 1.0 + i as f64 * 0.1).collect::<Vec<_>>(),
            (3, 4),
            &device,
        )
        .unwrap();
        let ours = rows.apply_op2(&weights, WeightedRows).unwrap();
        let reference = rows.broadcast_mul(&weights.unsqueeze(1).unwrap()).unwrap();
        let values = |t: &Tensor| -> Vec<f64> { t.flatten_all().unwrap().to_vec1().unwrap() };
        assert_eq!(values(&ours), values(&reference));
        let grads = |out: &Tensor| {
            let g = (out * &upstream)
                .unwrap()
                .sum_all()
                .unwrap()
                .backward()
                .unwrap();
            (
                values(g.get(&rows).unwrap()),
                values(g.get(&weights).unwrap()),
            )
        };
        assert_eq!(grads(&ours), grads(&reference));
        // No rows (a rank whose experts got no tokens): the weights still get a gradient,
        // zero, through the op, where the broadcast multiply drops them from the graph.
        let none = Tensor::zeros(0, DType::U32, &device).unwrap();
        let picked = weights.index_select(&none, 0).unwrap();
        let empty = rows.index_select(&none, 0).unwrap();
        let through = |out: Tensor| {
            let total = (out.sum_all().unwrap() + rows.sum_all().unwrap()).unwrap();
            total.backward().unwrap().get(&weights).map(values)
        };
        assert_eq!(
            through(empty.apply_op2(&picked, WeightedRows).unwrap()),
            Some(vec![0.0; 3])
        );
        assert_eq!(
            through(empty.broadcast_mul(&picked.unsqueeze(1).unwrap()).unwrap()),
            None,
            "candle's broadcast multiply kept an empty right operand: the op may be unneeded"
        );
    }
}
