//! Expert parallelism with the all-to-all pipelined behind the experts' compute.
//!
//! Each rank of an expert-parallel group runs `local` experts. The MoE block sorts its routed
//! rows by the rank that holds their expert, then by that rank's local expert: this rank
//! sends `sent[d * local + e]` rows to local expert `e` of rank `d`. The exchange is split
//! into one chunk per local expert: chunk `e` carries every rank's rows for local expert `e`,
//! and they land as that expert's rows, by source rank, which is the grouped layout the
//! expert runs on. So an expert starts as soon as its own chunk has arrived, while the later
//! chunks travel:
//!
//! - [`DispatchSwiGlu`]: the dispatch and the experts' first half, `silu(x W_gate) * (x
//!   W_up)`. Every chunk is posted at once; expert `e` runs when chunk `e` is in.
//! - [`DownCombine`]: the experts' second half, `h W_down`, and the combine. Expert `e`'s
//!   output leaves for home as soon as it is made, while expert `e + 1`'s is computed.
//!
//! Backward, each does the reverse with the same overlap: the combine's gradient arrives
//! expert by expert and each expert's input gradient starts at once; the dispatch's gradient
//! leaves expert by expert, and each expert's weight gradients are computed while it travels.
//!
//! What the overlap can hide is transfer time. How much of it moves while the rank computes
//! depends on the transport: an adapter that moves data on its own (RDMA) does; MPI over
//! shared memory copies inside MPI calls on the ranks' own cores. A rank that waits for
//! another with more routed rows waits however the exchange is cut.
//!
//! Every expert's products are the grouped ops' (`experts.rs`), on the same rows in the same
//! order: the pipeline changes when values move, not what they are.

use std::sync::{Arc, Mutex};

use candle_core::{CpuStorage, CustomOp2, CustomOp3, Device, Layout, Result, Shape, Tensor};

use crate::custom_op::{contiguous, cpu};
use crate::dist::{ChunkPlan, ChunkWork, ExpertExchange, World};
use crate::experts::{
    expert_backward_input, expert_backward_weight, expert_forward, swiglu_backward, swiglu_into,
};

/// This module's name, in its errors.
const OP: &str = "expert parallel";

fn error(message: impl Into<String>) -> candle_core::Error {
    candle_core::Error::Msg(format!("{OP}: {}", message.into()))
}

/// Where one layer's routed rows go and come from in this rank's expert-parallel group.
#[derive(Debug)]
pub struct Route {
    world: Arc<World>,
    /// Floats per row (the model width).
    width: usize,
    /// Experts per rank.
    local: usize,
    /// Ranks in the group.
    ranks: usize,
    /// Rows this rank sends for local expert `e` of rank `d`, at `d * local + e`.
    sent: Vec<usize>,
    /// Rows rank `s` sends here for local expert `e`, at `s * local + e`.
    received: Vec<usize>,
    /// `local + 1` offsets of each local expert's rows among those that arrive here.
    expert_offsets: Vec<usize>,
}

impl Route {
    pub fn new(
        world: Arc<World>,
        width: usize,
        local: usize,
        sent: Vec<usize>,
        received: Vec<usize>,
    ) -> Self {
        let ranks = world.layout.ep;
        assert_eq!(
            sent.len(),
            ranks * local,
            "a count per rank and local expert"
        );
        assert_eq!(
            received.len(),
            ranks * local,
            "a count per rank and local expert"
        );
        let mut expert_offsets = vec![0];
        for expert in 0..local {
            let rows: usize = (0..ranks).map(|s| received[s * local + expert]).sum();
            expert_offsets.push(expert_offsets[expert] + rows);
        }
        Self {
            world,
            width,
            local,
            ranks,
            sent,
            received,
            expert_offsets,
        }
    }

    /// Rows this rank routes (its sorted rows).
    fn sorted_rows(&self) -> usize {
        self.sent.iter().sum()
    }

    /// Rows that arrive here for the local experts.
    fn arrived_rows(&self) -> usize {
        self.expert_offsets[self.local]
    }

    /// The first and end row of local expert `expert` among the arrived rows.
    fn expert_rows(&self, expert: usize) -> (usize, usize) {
        (self.expert_offsets[expert], self.expert_offsets[expert + 1])
    }

    /// The first of this rank's sorted rows for local expert `expert` of rank `rank`.
    fn sent_start(&self, rank: usize, expert: usize) -> usize {
        self.sent[..rank * self.local + expert].iter().sum()
    }

    /// Chunk `e` out: this rank's rows for local expert `e` of each rank, from its sorted
    /// rows; in, every rank's rows for this rank's expert `e`.
    fn outbound(&self) -> Vec<ChunkPlan> {
        let w = self.width;
        (0..self.local)
            .map(|expert| ChunkPlan {
                send_counts: (0..self.ranks)
                    .map(|d| self.sent[d * self.local + expert] * w)
                    .collect(),
                send_displs: (0..self.ranks)
                    .map(|d| self.sent_start(d, expert) * w)
                    .collect(),
                recv_counts: (0..self.ranks)
                    .map(|s| self.received[s * self.local + expert] * w)
                    .collect(),
            })
            .collect()
    }

    /// Chunk `e` back: local expert `e`'s rows (a buffer of their own, by source rank) to the
    /// ranks they came from; in, this rank's rows for expert `e` of each rank.
    fn inbound(&self) -> Vec<ChunkPlan> {
        let w = self.width;
        (0..self.local)
            .map(|expert| {
                let send_counts: Vec<usize> = (0..self.ranks)
                    .map(|s| self.received[s * self.local + expert] * w)
                    .collect();
                let send_displs = send_counts
                    .iter()
                    .scan(0, |next, count| {
                        let at = *next;
                        *next += count;
                        Some(at)
                    })
                    .collect();
                ChunkPlan {
                    send_counts,
                    send_displs,
                    recv_counts: (0..self.ranks)
                        .map(|d| self.sent[d * self.local + expert] * w)
                        .collect(),
                }
            })
            .collect()
    }

    /// The inbound chunks, laid out as this rank's sorted rows.
    fn sorted_from(&self, chunks: Vec<Vec<f32>>) -> Vec<f32> {
        let w = self.width;
        let mut out = vec![0f32; self.sorted_rows() * w];
        for (expert, chunk) in chunks.iter().enumerate() {
            let mut at = 0;
            for rank in 0..self.ranks {
                let len = self.sent[rank * self.local + expert] * w;
                let start = self.sent_start(rank, expert) * w;
                out[start..start + len].copy_from_slice(&chunk[at..at + len]);
                at += len;
            }
        }
        out
    }

    /// `buffer` (the arrived rows, `width` floats each) split at the local experts.
    fn per_expert<'b>(&self, mut buffer: &'b mut [f32], width: usize) -> Vec<&'b mut [f32]> {
        let mut parts = Vec::with_capacity(self.local);
        for expert in 0..self.local {
            let (first, end) = self.expert_rows(expert);
            let (part, rest) = std::mem::take(&mut buffer).split_at_mut((end - first) * width);
            parts.push(part);
            buffer = rest;
        }
        parts
    }

    /// `(inner, outer)` of stacked `[local, inner, outer]` weights, checked.
    fn weight_dims(&self, weight: &Layout) -> Result<(usize, usize)> {
        let (experts, inner, outer) = weight.shape().dims3()?;
        if experts != self.local {
            return Err(error(format!(
                "weight {:?} does not stack this rank's {} experts",
                weight.shape(),
                self.local
            )));
        }
        Ok((inner, outer))
    }

    /// Checks that `x` holds this rank's sorted rows, `width` wide.
    fn check_sorted(&self, x: &Layout) -> Result<()> {
        if x.shape().dims2()? != (self.sorted_rows(), self.width) {
            return Err(error(format!(
                "rows {:?}, expected {} of width {}",
                x.shape(),
                self.sorted_rows(),
                self.width
            )));
        }
        Ok(())
    }
}

fn f32_values<'a>(storage: &'a CpuStorage, layout: &Layout) -> Result<&'a [f32]> {
    match storage {
        CpuStorage::F32(values) => contiguous(OP, values, layout),
        _ => Err(error("runs in f32 only")),
    }
}

/// `sorted.apply_op3(&gate, &up, DispatchSwiGlu::new(route))`: this rank's sorted rows `[rows,
/// width]` out to their experts, and `silu(x W_gate[e]) * (x W_up[e])` on what arrives,
/// `[arrived rows, ffn]` by local expert. Use a fresh op per application: the forward pass
/// keeps the arrived rows and both projections for the backward pass.
#[derive(Debug)]
pub struct DispatchSwiGlu {
    route: Arc<Route>,
    saved: Mutex<Option<Saved>>,
}

/// What the forward pass keeps: the arrived rows, and the gate and up projections.
#[derive(Debug)]
struct Saved {
    arrived: Vec<f32>,
    gate: Vec<f32>,
    up: Vec<f32>,
}

impl DispatchSwiGlu {
    pub fn new(route: Arc<Route>) -> Self {
        Self {
            route,
            saved: Mutex::default(),
        }
    }
}

impl CustomOp3 for DispatchSwiGlu {
    fn name(&self) -> &'static str {
        "expert-dispatch-swiglu"
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
        let route = &self.route;
        route.check_sorted(l1)?;
        let (inner, ffn) = route.weight_dims(l2)?;
        if l2.shape() != l3.shape() || inner != route.width {
            return Err(error(format!(
                "gate {:?} and up {:?} must both be [experts, {}, ffn]",
                l2.shape(),
                l3.shape(),
                route.width
            )));
        }
        let (x, gate_w, up_w) = (
            f32_values(s1, l1)?,
            f32_values(s2, l2)?,
            f32_values(s3, l3)?,
        );
        let rows = route.arrived_rows();
        let mut arrived = vec![0f32; rows * inner];
        let mut gate = vec![0f32; rows * ffn];
        let mut up = vec![0f32; rows * ffn];
        let mut out = vec![0f32; rows * ffn];
        {
            let mut into = route.per_expert(&mut arrived, inner);
            route.world.exchange_then_compute(
                ExpertExchange::Dispatch,
                x,
                &route.outbound(),
                &mut into,
                &mut |expert, rows_in| {
                    let _span = tracing::info_span!("swiglu").entered();
                    let (first, end) = route.expert_rows(expert);
                    let dims = (end - first, inner, ffn);
                    let span = first * ffn..end * ffn;
                    expert_forward(&mut gate[span.clone()], rows_in, gate_w, expert, dims);
                    expert_forward(&mut up[span.clone()], rows_in, up_w, expert, dims);
                    swiglu_into(&mut out[span.clone()], &gate[span.clone()], &up[span]);
                    Ok(())
                },
            )?;
        }
        *self
            .saved
            .lock()
            .map_err(|_| error("a previous pass panicked"))? = Some(Saved { arrived, gate, up });
        Ok((CpuStorage::F32(out), Shape::from((rows, ffn))))
    }

    fn bwd(
        &self,
        x: &Tensor,
        gate_w: &Tensor,
        up_w: &Tensor,
        _result: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let saved = self
            .saved
            .lock()
            .map_err(|_| error("a previous pass panicked"))?
            .take()
            .ok_or_else(|| error("a backward pass without its forward pass"))?;
        let route = &self.route;
        let (inner, ffn) = route.weight_dims(gate_w.layout())?;
        let grad = grad.contiguous()?;
        let (gs, us, ds) = (
            gate_w.storage_and_layout().0,
            up_w.storage_and_layout().0,
            grad.storage_and_layout().0,
        );
        let mut work = DispatchBackward {
            route,
            saved: &saved,
            gate_w: f32_values(cpu(OP, &gs)?, gate_w.layout())?,
            up_w: f32_values(cpu(OP, &us)?, up_w.layout())?,
            grad: f32_values(cpu(OP, &ds)?, grad.layout())?,
            dims: (inner, ffn),
            projection_grads: None,
            grad_gate_w: vec![0f32; route.local * inner * ffn],
            grad_up_w: vec![0f32; route.local * inner * ffn],
        };
        let chunks = route.world.compute_then_exchange(
            ExpertExchange::DispatchBackward,
            &route.inbound(),
            &mut work,
        )?;
        let device = Device::Cpu;
        let grad_x = Tensor::from_vec(route.sorted_from(chunks), x.shape(), &device)?;
        let grad_gate_w = Tensor::from_vec(work.grad_gate_w, gate_w.shape(), &device)?;
        let grad_up_w = Tensor::from_vec(work.grad_up_w, up_w.shape(), &device)?;
        Ok((Some(grad_x), Some(grad_gate_w), Some(grad_up_w)))
    }
}

/// The dispatch's backward, expert by expert: the arrived rows' gradient leaves for home
/// while the expert's weight gradients are computed.
struct DispatchBackward<'a> {
    route: &'a Route,
    saved: &'a Saved,
    gate_w: &'a [f32],
    up_w: &'a [f32],
    grad: &'a [f32],
    dims: (usize, usize),
    /// The gate and up projections' gradients of the expert whose rows are in flight.
    projection_grads: Option<(Vec<f32>, Vec<f32>)>,
    grad_gate_w: Vec<f32>,
    grad_up_w: Vec<f32>,
}

impl ChunkWork for DispatchBackward<'_> {
    fn produce(&mut self, expert: usize) -> Result<Vec<f32>> {
        let _span = tracing::info_span!("swiglu_backward").entered();
        let (inner, ffn) = self.dims;
        let (first, end) = self.route.expert_rows(expert);
        let span = first * ffn..end * ffn;
        let (grad_gate, grad_up) = swiglu_backward(
            &self.saved.gate[span.clone()],
            &self.saved.up[span.clone()],
            &self.grad[span],
        );
        let dims = (end - first, inner, ffn);
        let mut grad_rows = vec![0f32; (end - first) * inner];
        expert_backward_input(&mut grad_rows, &grad_gate, self.gate_w, expert, dims, false);
        expert_backward_input(&mut grad_rows, &grad_up, self.up_w, expert, dims, true);
        self.projection_grads = Some((grad_gate, grad_up));
        Ok(grad_rows)
    }

    fn meanwhile(&mut self, expert: usize) -> Result<()> {
        let _span = tracing::info_span!("swiglu_backward").entered();
        let (inner, ffn) = self.dims;
        let (first, end) = self.route.expert_rows(expert);
        let (grad_gate, grad_up) = self
            .projection_grads
            .take()
            .ok_or_else(|| error("weight gradients before their expert's projections"))?;
        let rows = &self.saved.arrived[first * inner..end * inner];
        let dims = (end - first, inner, ffn);
        let weight = expert * inner * ffn..(expert + 1) * inner * ffn;
        expert_backward_weight(
            &mut self.grad_gate_w[weight.clone()],
            rows,
            &grad_gate,
            dims,
        );
        expert_backward_weight(&mut self.grad_up_w[weight], rows, &grad_up, dims);
        Ok(())
    }
}

/// `hidden.apply_op2(&down, DownCombine(route))`: `h W_down[e]` on the arrived rows `[rows,
/// ffn]`, back to the ranks they came from: `[sorted rows, width]` in this rank's order.
#[derive(Clone, Debug)]
pub struct DownCombine(pub Arc<Route>);

impl CustomOp2 for DownCombine {
    fn name(&self) -> &'static str {
        "expert-down-combine"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let route = &self.0;
        let (ffn, outer) = route.weight_dims(l2)?;
        if outer != route.width || l1.shape().dims2()? != (route.arrived_rows(), ffn) {
            return Err(error(format!(
                "hidden {:?} and down {:?} do not fit {} rows of width {}",
                l1.shape(),
                l2.shape(),
                route.arrived_rows(),
                route.width
            )));
        }
        let mut work = Down {
            route,
            hidden: f32_values(s1, l1)?,
            down_w: f32_values(s2, l2)?,
            ffn,
        };
        let chunks = route.world.compute_then_exchange(
            ExpertExchange::Combine,
            &route.inbound(),
            &mut work,
        )?;
        Ok((
            CpuStorage::F32(route.sorted_from(chunks)),
            Shape::from((route.sorted_rows(), route.width)),
        ))
    }

    fn bwd(
        &self,
        hidden: &Tensor,
        down_w: &Tensor,
        _result: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let route = &self.0;
        let (ffn, width) = route.weight_dims(down_w.layout())?;
        let grad = grad.contiguous()?;
        route.check_sorted(grad.layout())?;
        let (hs, ws, ds) = (
            hidden.storage_and_layout().0,
            down_w.storage_and_layout().0,
            grad.storage_and_layout().0,
        );
        let (hidden_values, down_values, grad_values) = (
            f32_values(cpu(OP, &hs)?, hidden.layout())?,
            f32_values(cpu(OP, &ws)?, down_w.layout())?,
            f32_values(cpu(OP, &ds)?, grad.layout())?,
        );
        let rows = route.arrived_rows();
        let mut grad_hidden = vec![0f32; rows * ffn];
        let mut grad_down = vec![0f32; route.local * ffn * width];
        let mut arrived = vec![0f32; rows * width];
        {
            let mut into = route.per_expert(&mut arrived, width);
            route.world.exchange_then_compute(
                ExpertExchange::CombineBackward,
                grad_values,
                &route.outbound(),
                &mut into,
                &mut |expert, grad_rows| {
                    let _span = tracing::info_span!("grouped_matmul_backward").entered();
                    let (first, end) = route.expert_rows(expert);
                    let dims = (end - first, ffn, width);
                    expert_backward_input(
                        &mut grad_hidden[first * ffn..end * ffn],
                        grad_rows,
                        down_values,
                        expert,
                        dims,
                        false,
                    );
                    expert_backward_weight(
                        &mut grad_down[expert * ffn * width..(expert + 1) * ffn * width],
                        &hidden_values[first * ffn..end * ffn],
                        grad_rows,
                        dims,
                    );
                    Ok(())
                },
            )?;
        }
        let device = Device::Cpu;
        Ok((
            Some(Tensor::from_vec(grad_hidden, hidden.shape(), &device)?),
            Some(Tensor::from_vec(grad_down, down_w.shape(), &device)?),
        ))
    }
}

/// The experts' down projection, expert by expert, each sent home as soon as it is made.
struct Down<'a> {
    route: &'a Route,
    hidden: &'a [f32],
    down_w: &'a [f32],
    ffn: usize,
}

impl ChunkWork for Down<'_> {
    fn produce(&mut self, expert: usize) -> Result<Vec<f32>> {
        let _span = tracing::info_span!("grouped_matmul").entered();
        let (first, end) = self.route.expert_rows(expert);
        let width = self.route.width;
        let mut out = vec![0f32; (end - first) * width];
        expert_forward(
            &mut out,
            &self.hidden[first * self.ffn..end * self.ffn],
            self.down_w,
            expert,
            (end - first, self.ffn, width),
        );
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use candle_core::Var;

    use super::*;
    use crate::experts::{GroupedMatmul, Groups, SwiGlu};

    fn values(len: usize, seed: u32) -> Vec<f32> {
        (0..len)
            .map(|i| {
                ((i as u32).wrapping_mul(2654435761).wrapping_add(seed) % 1000) as f32 / 500.0 - 1.0
            })
            .collect()
    }

    fn var(shape: &[usize], seed: u32) -> Var {
        let len = shape.iter().product();
        Var::from_tensor(&Tensor::from_vec(values(len, seed), shape, &Device::Cpu).unwrap())
            .unwrap()
    }

    fn bits(tensor: &Tensor) -> Vec<u32> {
        tensor
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap()
            .iter()
            .map(|v| v.to_bits())
            .collect()
    }

    /// A route over a group of `ranks` with this rank's counts, for checking its chunk plans.
    fn route(
        ranks: usize,
        local: usize,
        width: usize,
        sent: &[usize],
        received: &[usize],
    ) -> Route {
        let mut route = Route::new(
            Arc::new(World::single()),
            width,
            local,
            vec![0; local],
            vec![0; local],
        );
        route.ranks = ranks;
        route.sent = sent.to_vec();
        route.received = received.to_vec();
        route.expert_offsets = vec![0];
        for expert in 0..local {
            let rows: usize = (0..ranks).map(|s| received[s * local + expert]).sum();
            route
                .expert_offsets
                .push(route.expert_offsets[expert] + rows);
        }
        route
    }

    #[test]
    fn each_chunk_carries_one_local_expert_between_the_ranks_and_lands_in_sorted_order() {
        // Two ranks with two experts each. This rank sends 1 and 2 rows to rank 0's experts
        // and 3 and 0 to rank 1's; rank 0 sends it 4 and 0 rows, rank 1 sends 5 and 6.
        let route = route(2, 2, 1, &[1, 2, 3, 0], &[4, 0, 5, 6]);
        let out = route.outbound();
        assert_eq!(out[0].send_counts, [1, 3]);
        assert_eq!(out[0].send_displs, [0, 3]);
        assert_eq!(out[0].recv_counts, [4, 5]);
        assert_eq!(out[1].send_counts, [2, 0]);
        assert_eq!(out[1].send_displs, [1, 6]);
        assert_eq!(out[1].recv_counts, [0, 6]);
        assert_eq!(
            (route.expert_rows(0), route.expert_rows(1)),
            ((0, 9), (9, 15))
        );
        let back = route.inbound();
        assert_eq!(back[0].send_counts, [4, 5]);
        assert_eq!(back[0].send_displs, [0, 4]);
        assert_eq!(back[0].recv_counts, [1, 3]);
        assert_eq!(back[1].send_counts, [0, 6]);
        assert_eq!(back[1].send_displs, [0, 0]);
        assert_eq!(back[1].recv_counts, [2, 0]);
        // What comes back for expert 0 (1 row from rank 0, 3 from rank 1) and expert 1 (2 rows
        // from rank 0) goes where this rank's sorted rows were: rank 0's experts, then rank 1's.
        let sorted = route.sorted_from(vec![vec![10.0, 30.0, 31.0, 32.0], vec![20.0, 21.0]]);
        assert_eq!(sorted, [10.0, 20.0, 21.0, 30.0, 31.0, 32.0]);
        let mut arrived: Vec<f32> = (0..15).map(|v| v as f32).collect();
        let parts = route.per_expert(&mut arrived, 1);
        assert_eq!(parts.iter().map(|p| p.len()).collect::<Vec<_>>(), [9, 6]);
        assert_eq!(parts[1][0], 9.0);
    }

    #[test]
    fn the_pipelined_experts_compute_what_the_grouped_ops_do_bit_for_bit() {
        // One rank, four experts (one without rows): the exchange is the identity and every
        // value, forward and backward, must be the grouped ops' own.
        let (width, ffn) = (8, 6);
        let counts = [3, 0, 5, 2];
        let rows: usize = counts.iter().sum();
        let x = var(&[rows, width], 1);
        let gate = var(&[4, width, ffn], 2);
        let up = var(&[4, width, ffn], 3);
        let down = var(&[4, ffn, width], 4);
        let upstream =
            Tensor::from_vec(values(rows * width, 5), (rows, width), &Device::Cpu).unwrap();
        let run = |pipelined: bool| {
            let out = if pipelined {
                let route = Arc::new(Route::new(
                    Arc::new(World::single()),
                    width,
                    4,
                    counts.to_vec(),
                    counts.to_vec(),
                ));
                x.apply_op3(&gate, &up, DispatchSwiGlu::new(route.clone()))
                    .unwrap()
                    .apply_op2(&down, DownCombine(route))
                    .unwrap()
            } else {
                let groups = Groups::from_counts(&counts);
                x.apply_op3(&gate, &up, SwiGlu::new(groups.clone()))
                    .unwrap()
                    .apply_op2(&down, GroupedMatmul(groups))
                    .unwrap()
            };
            let grads = (&out * &upstream)
                .unwrap()
                .sum_all()
                .unwrap()
                .backward()
                .unwrap();
            let mut figures = vec![bits(&out)];
            for parameter in [&x, &gate, &up, &down] {
                figures.push(bits(grads.get(parameter).expect("a gradient")));
            }
            figures
        };
        let (pipelined, grouped) = (run(true), run(false));
        assert!(grouped[4].iter().any(|b| *b != 0), "down gets a gradient");
        for (what, (a, b)) in ["output", "x", "gate", "up", "down"]
            .iter()
            .zip(pipelined.iter().zip(&grouped))
        {
            assert_eq!(a, b, "{what}");
        }
    }
}
