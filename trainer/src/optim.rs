//! AdamW over flat fp32 buffers, sharded ZeRO-1 style and expert-parallel aware; the
//! learning-rate schedule and global-norm clipping.
//!
//! Every local parameter is a slice of one flat buffer: the dense parameters first, then this
//! rank's experts. The dense range is split over all ranks and the expert range over the ranks
//! that hold the same experts; each rank keeps the fp32 master weights and both moments of its
//! shard only. An update reduce-scatters the gradients (summed in rank order; with
//! `overlap_grad_reduce`, the last micro-batch's backward pass has done so layer by layer),
//! clips by the global norm, updates the shard, and all-gathers the weights back into the
//! model. With one
//! rank the shard is everything. The update matches `torch.optim.AdamW`, and every reduction
//! has a fixed order, so a step is bit-reproducible for a given layout.

use std::ops::Range;
use std::sync::Arc;

use candle_core::backprop::GradStore;
use candle_core::{DType, Result, Tensor};
use rayon::prelude::*;

use crate::config::TrainConfig;
use crate::custom_op::{set_f32_values, with_f32_values};
use crate::dist::{even_bounds, Group, World};
use crate::kernels::{adamw, adamw_into, AdamWSlices, AdamWSlicesMut, AdamWStep};
use crate::model::Model;
use crate::snapshot::{HeldSlots, StateMemory};

/// Elements per parallel work item of the update (and per partial sum of the norm).
const BLOCK: usize = 1 << 16;

/// Where one parameter lives in the local flat buffer, and in its global tensor.
#[derive(Clone, Debug, PartialEq)]
pub struct Placement {
    pub name: String,
    /// Position in [`Model::parameters`].
    pub index: usize,
    pub offset: usize,
    pub len: usize,
    pub shape: Vec<usize>,
    pub weight_decay: f64,
    /// The whole tensor's shape over all ranks (larger than `shape` where it is split).
    pub global_shape: Vec<usize>,
    /// Where this rank's block starts in the whole tensor, per dimension.
    pub global_start: Vec<usize>,
    /// Every rank of the tensor-parallel group holds the same values: only the group's
    /// first rank stores them and counts them in the gradient norm.
    pub replicated_over_tp: bool,
}

impl Placement {
    /// Elements of one row: one index of the first dimension, all of the others.
    fn row_len(&self) -> usize {
        self.shape[1..].iter().product()
    }

    /// Whether this rank counts the parameter in the global gradient norm (each element of
    /// the model is counted once over the world).
    fn counted(&self, tp_rank: usize) -> bool {
        !self.replicated_over_tp || tp_rank == 0
    }
}

/// One sharded range of the flat buffer: its group, the split, and where this rank's state
/// lives in the state memory.
#[derive(Clone, Debug)]
pub struct Shard {
    pub group: Group,
    /// Absolute flat offsets splitting the range, one per rank of the group and the end.
    pub bounds: Vec<usize>,
    /// This rank's part.
    pub mine: Range<usize>,
    /// Element offset of this part's master weights in the state memory; the first moments
    /// follow, then the second moments, `mine.len()` elements each.
    pub base: usize,
}

/// Which of a shard's three state arrays.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Part {
    Params,
    ExpAvg,
    ExpAvgSq,
}

impl Part {
    pub const ALL: [Part; 3] = [Part::Params, Part::ExpAvg, Part::ExpAvgSq];

    /// The suffix of the stored tensor's name.
    pub fn suffix(self) -> &'static str {
        match self {
            Part::Params => "",
            Part::ExpAvg => ".exp_avg",
            Part::ExpAvgSq => ".exp_avg_sq",
        }
    }

    fn index(self) -> usize {
        self as usize
    }
}

impl Shard {
    /// Element range of `part`'s `local` elements (relative to `mine.start`) in the state.
    pub fn range(&self, part: Part, local: Range<usize>) -> Range<usize> {
        let start = self.base + part.index() * self.mine.len();
        start + local.start..start + local.end
    }
}

/// Optimizer state: this rank's shards of the master weights and moments.
#[derive(Debug)]
pub struct AdamW {
    pub placements: Vec<Placement>,
    pub shards: Vec<Shard>,
    /// The shards' state, in one or more copies (see [`StateMemory`]).
    pub memory: StateMemory,
    /// Elements of the local flat buffer.
    pub len: usize,
    /// Updates applied so far (the bias-correction step).
    pub step: u64,
    world: Arc<World>,
    /// The flat gradient of the coming update (the sum of `accumulated` micro-batches'), or
    /// of the last one, kept to reuse its memory.
    grads: Vec<f32>,
    accumulated: usize,
    /// Each shard's part of the coming update's gradient, summed over its group already
    /// (by [`AdamW::accumulate_overlapped`]); `None` when the update reduces it.
    reduced: Option<Vec<Vec<f32>>>,
    /// Whether the step reduces the gradient around its last backward pass (the
    /// configuration's `parallel.overlap_grad_reduce`, and a shard group of more than one).
    pub overlap_grad_reduce: bool,
    beta1: f64,
    beta2: f64,
    eps: f64,
    grad_clip: f64,
}

/// What one update did.
#[derive(Clone, Copy, Debug)]
pub struct UpdateStats {
    pub grad_norm: f64,
    pub clipped: bool,
}

/// Linear warmup to `lr`, then cosine decay to `min_lr` at `steps`. `step` counts from 1.
pub fn learning_rate(config: &TrainConfig, step: u64) -> f64 {
    if step <= config.warmup_steps {
        return config.lr * step as f64 / config.warmup_steps.max(1) as f64;
    }
    let decay_steps = config.steps.saturating_sub(config.warmup_steps).max(1);
    let progress = ((step - config.warmup_steps) as f64 / decay_steps as f64).min(1.0);
    config.min_lr
        + 0.5 * (config.lr - config.min_lr) * (1.0 + (std::f64::consts::PI * progress).cos())
}

pub(crate) fn is_expert(name: &str) -> bool {
    name.contains(".expert_")
}

impl AdamW {
    /// State for `model`'s current weights (this rank's part of each parameter, as
    /// [`Model::place`] says). Norm weights get `norm_weight_decay`, everything else
    /// `weight_decay`.
    pub fn new(model: &Model, config: &TrainConfig, world: Arc<World>) -> Result<Self> {
        let parameters = model.parameters();
        let place = model.place;
        let mut placements = Vec::new();
        let mut len = 0;
        // Dense parameters first, then this rank's experts: two contiguous ranges.
        for experts in [false, true] {
            for (index, (name, var)) in parameters.iter().enumerate() {
                if is_expert(name) != experts {
                    continue;
                }
                let weight_decay = if name.ends_with("norm") {
                    config.norm_weight_decay
                } else {
                    config.weight_decay
                };
                let count = var.elem_count();
                let shape = var.dims().to_vec();
                let mut global_shape = shape.clone();
                let mut global_start = vec![0; shape.len()];
                if let Some(split) = place.split(name) {
                    global_shape[split.dim] *= split.parts;
                    global_start[split.dim] = split.index * shape[split.dim];
                }
                placements.push(Placement {
                    name: name.clone(),
                    index,
                    offset: len,
                    len: count,
                    shape,
                    weight_decay,
                    global_shape,
                    global_start,
                    replicated_over_tp: place.replicated_over_tp(name),
                });
                len += count;
            }
        }
        let dense_len = placements
            .iter()
            .filter(|s| !is_expert(&s.name))
            .map(|s| s.len)
            .sum::<usize>();
        let mut shards = Vec::new();
        let mut base = 0;
        for (group, range) in [
            (Group::Data, 0..dense_len),
            (Group::ExpertData, dense_len..len),
        ] {
            let (me, size) = world.position(group);
            let bounds: Vec<usize> = even_bounds(range.len(), size)
                .into_iter()
                .map(|b| at_a_row(&placements, range.start + b))
                .collect();
            let mine = bounds[me]..bounds[me + 1];
            let next = base + 3 * mine.len();
            shards.push(Shard {
                group,
                bounds,
                mine,
                base,
            });
            base = next;
        }
        // The shards' master weights come straight from the model's parameters and the
        // moments start at zero: no flat copy of the whole model is made (at start-up, that
        // copy and its growth faulted in fresh pages for twice the model's bytes).
        let mut state = vec![0f32; base];
        for shard in &shards {
            for (placement, range) in pieces(&placements, shard) {
                let into = shard.range(
                    Part::Params,
                    range.start - shard.mine.start..range.end - shard.mine.start,
                );
                let from = range.start - placement.offset..range.end - placement.offset;
                with_f32_values(parameters[placement.index].1.as_tensor(), |values| {
                    state[into].copy_from_slice(&values[from]);
                })?;
            }
        }
        Ok(Self {
            placements,
            shards,
            memory: StateMemory::heap(state),
            len,
            step: 0,
            world,
            grads: Vec::new(),
            accumulated: 0,
            reduced: None,
            overlap_grad_reduce: false,
            beta1: config.beta1,
            beta2: config.beta2,
            eps: config.eps,
            grad_clip: config.grad_clip,
        })
    }

    /// Bytes of optimizer state this rank holds (its shards of the master weights and both
    /// moments).
    pub fn state_bytes(&self) -> u64 {
        self.shards.iter().map(|s| 12 * s.mine.len() as u64).sum()
    }

    /// What ZeRO-1 predicts per rank: 12 bytes per dense parameter over all ranks, plus 12 per
    /// local expert parameter over the ranks that hold the same experts.
    pub fn predicted_state_bytes(&self) -> f64 {
        self.shards
            .iter()
            .map(|s| {
                let (_, size) = self.world.position(s.group);
                12.0 * (s.bounds[s.bounds.len() - 1] - s.bounds[0]) as f64 / size as f64
            })
            .sum()
    }

    /// For each placement overlapping `shard`'s part: the placement and the overlap (absolute offsets).
    pub fn pieces<'a>(
        &'a self,
        shard: &'a Shard,
    ) -> impl Iterator<Item = (&'a Placement, Range<usize>)> + 'a {
        pieces(&self.placements, shard)
    }

    /// `part` of `shard`, for its `local` elements, in the current state.
    pub fn part(&self, shard: &Shard, part: Part, local: Range<usize>) -> &[f32] {
        &self.memory.current()[shard.range(part, local)]
    }

    /// The elements of state memory (three per local shard element).
    pub fn state_len(&self) -> usize {
        self.memory.current().len()
    }

    /// One update from `grads`: [`AdamW::accumulate`], then [`AdamW::apply`].
    pub fn update(
        &mut self,
        model: &Model,
        grads: &GradStore,
        lr: f64,
        held: &HeldSlots,
    ) -> Result<UpdateStats> {
        self.accumulate(model, grads)?;
        self.apply(model, lr, held)
    }

    /// Adds one micro-batch's `grads` to the gradient of the coming update. Micro-batches
    /// are added in the order of the calls, so the sum is the same bits for a given layout.
    pub fn accumulate(&mut self, model: &Model, grads: &GradStore) -> Result<()> {
        let parameters = model.parameters();
        let first = self.accumulated == 0;
        if self.grads.len() != self.len {
            self.grads.clear();
            self.grads.resize(self.len, 0.0);
        }
        for placement in &self.placements {
            let sum = &mut self.grads[placement.offset..placement.offset + placement.len];
            add_gradient(sum, grads.get(parameters[placement.index].1), first)?;
        }
        self.accumulated += 1;
        Ok(())
    }

    /// Whether reducing the gradient around the backward pass can overlap anything: some
    /// shard is split over more than one rank.
    pub fn can_overlap_grad_reduce(&self) -> bool {
        self.shards
            .iter()
            .any(|shard| self.world.position(shard.group).1 > 1)
    }

    /// The last micro-batch's backward pass, cut into `segments` (bottom to top, their
    /// layers), run from the top: `backward(k)` differentiates segment `k`. Its parameters'
    /// gradients are added to the coming update's at once, and their reduce-scatter is posted
    /// before the segments below run and completed after: the transfer overlaps the rest of
    /// the backward pass, as Megatron's and MegaScale's overlapped gradient reduction do. The
    /// sums are the bits [`AdamW::apply`]'s own reduce-scatter gives.
    pub fn accumulate_overlapped(
        &mut self,
        model: &Model,
        segments: &[usize],
        backward: &mut dyn FnMut(usize) -> Result<GradStore>,
    ) -> Result<()> {
        let owner = self.segment_owners(segments)?;
        let first = self.accumulated == 0;
        if self.grads.len() != self.len {
            self.grads.clear();
            self.grads.resize(self.len, 0.0);
        }
        // Each segment's dense and expert gradients: two runs of the flat buffer, since the
        // placements of each kind are in layer order.
        let mut lengths = vec![[0usize; 2]; segments.len()];
        let mut last = [0usize; 2];
        for (placement, segment) in self.placements.iter().zip(&owner) {
            let kind = usize::from(is_expert(&placement.name));
            if *segment < last[kind] {
                return Err(candle_core::Error::msg(format!(
                    "{} comes after a later layer's parameters",
                    placement.name
                )));
            }
            last[kind] = *segment;
            lengths[*segment][kind] += placement.len;
        }
        let dense_len = self.shards[0].bounds[self.shards[0].bounds.len() - 1];
        let mut slices: Vec<[(usize, &mut [f32]); 2]> = Vec::with_capacity(segments.len());
        let (mut dense, mut experts) = self.grads.split_at_mut(dense_len);
        let (mut dense_at, mut expert_at) = (0, dense_len);
        for [dense_len, expert_len] in lengths {
            let (d, dense_rest) = std::mem::take(&mut dense).split_at_mut(dense_len);
            let (e, expert_rest) = std::mem::take(&mut experts).split_at_mut(expert_len);
            slices.push([(dense_at, d), (expert_at, e)]);
            (dense, experts) = (dense_rest, expert_rest);
            dense_at += dense_len;
            expert_at += expert_len;
        }
        debug_assert!(dense.is_empty() && experts.is_empty());
        let mut run = Overlapped {
            world: &self.world,
            model,
            placements: &self.placements,
            owner: &owner,
            shards: &self.shards,
            first,
            backward,
            slices,
            reduced: Vec::new(),
        };
        run.next()?;
        let pieces = std::mem::take(&mut run.reduced);
        let mut reduced: Vec<Vec<f32>> = self
            .shards
            .iter()
            .map(|shard| vec![0f32; shard.mine.len()])
            .collect();
        let mut covered = vec![0usize; self.shards.len()];
        for (shard, start, values) in pieces {
            let at = start - self.shards[shard].mine.start;
            reduced[shard][at..at + values.len()].copy_from_slice(&values);
            covered[shard] += values.len();
        }
        for (shard, covered) in self.shards.iter().zip(covered) {
            assert_eq!(
                covered,
                shard.mine.len(),
                "the pieces cover this rank's share"
            );
        }
        self.reduced = Some(reduced);
        self.accumulated += 1;
        Ok(())
    }

    /// The segment (index into `segments`, the layers bottom to top) whose backward pass
    /// computes each placement's gradient: its layer's; the embedding's is the bottom one's,
    /// the final norm's and the LM head's the top one's.
    fn segment_owners(&self, segments: &[usize]) -> Result<Vec<usize>> {
        self.placements
            .iter()
            .map(|placement| {
                let name = placement.name.as_str();
                let layer = name
                    .strip_prefix("layers.")
                    .and_then(|rest| rest.split('.').next())
                    .and_then(|index| index.parse::<usize>().ok());
                match layer {
                    Some(layer) => segments.iter().position(|l| *l == layer),
                    None if name == "embed" => Some(0),
                    None => segments.len().checked_sub(1),
                }
                .ok_or_else(|| {
                    candle_core::Error::msg(format!("{name} is in no segment of {segments:?}"))
                })
            })
            .collect()
    }

    /// Puts a NaN into the gradient of the coming update (`test_faults.nan_at_step`).
    pub fn poison_gradient(&mut self) {
        if let Some(first) = self.grads.first_mut() {
            *first = f32::NAN;
        }
        // Reduced already: into an element of this rank's share that the global norm counts.
        let tp_rank = self.world.coords().tp;
        let counted = self.shards.iter().enumerate().find_map(|(index, shard)| {
            self.pieces(shard)
                .find(|(placement, _)| placement.counted(tp_rank))
                .map(|(_, range)| (index, range.start - shard.mine.start))
        });
        if let (Some(reduced), Some((shard, at))) = (self.reduced.as_mut(), counted) {
            reduced[shard][at] = f32::NAN;
        }
    }

    /// The gradient accumulated for the coming update, flat, in placement order.
    pub fn gradient(&self) -> &[f32] {
        &self.grads
    }

    /// Clips the accumulated gradient to `grad_clip` by global norm, applies one AdamW update
    /// at `lr`, and writes the new weights into the model.
    pub fn apply(&mut self, model: &Model, lr: f64, held: &HeldSlots) -> Result<UpdateStats> {
        assert!(self.accumulated > 0, "an update without a gradient");
        self.accumulated = 0;
        let flat = std::mem::take(&mut self.grads);
        // Reduced already around the backward pass; else here, where a group of one borrows
        // its part of the accumulated gradient.
        let shard_grads: Vec<std::borrow::Cow<'_, [f32]>> = match self.reduced.take() {
            Some(reduced) => reduced.into_iter().map(std::borrow::Cow::Owned).collect(),
            None => self
                .shards
                .iter()
                .map(|s| {
                    let range = s.bounds[0]..s.bounds[s.bounds.len() - 1];
                    let relative: Vec<usize> = s.bounds.iter().map(|b| b - range.start).collect();
                    self.world.reduce_scatter(s.group, &flat[range], &relative)
                })
                .collect(),
        };
        // Fixed-size blocks summed in order, then pieces and ranks in order: the same norm
        // whatever the thread count. Each element of the model counts once over the world:
        // a tensor-parallel group's replicated parameters on its first rank only.
        let tp_rank = self.world.coords().tp;
        let local_sq: f64 = self
            .shards
            .iter()
            .zip(&shard_grads)
            .map(|(shard, grads)| {
                self.pieces(shard)
                    .filter(|(placement, _)| placement.counted(tp_rank))
                    .map(|(_, range)| {
                        sum_of_squares(
                            &grads[range.start - shard.mine.start..range.end - shard.mine.start],
                        )
                    })
                    .sum::<f64>()
            })
            .sum();
        let grad_norm = {
            let _span = tracing::info_span!("grad_norm").entered();
            self.world.sum_f64(Group::World, &[local_sq])[0].sqrt()
        };
        let scale = if grad_norm > self.grad_clip {
            self.grad_clip / (grad_norm + 1e-6)
        } else {
            1.0
        };
        self.step += 1;
        let correction1 = 1.0 - self.beta1.powi(self.step as i32);
        let correction2_sqrt = (1.0 - self.beta2.powi(self.step as i32)).sqrt();
        let step_size = lr / correction1;
        let (beta1, beta2, eps) = (self.beta1, self.beta2, self.eps);
        let shards = std::mem::take(&mut self.shards);
        let mut memory = std::mem::replace(&mut self.memory, StateMemory::heap(Vec::new()));
        let mut target = match memory.begin_update(held) {
            Ok(target) => target,
            Err(error) => {
                self.shards = shards;
                self.memory = memory;
                return Err(candle_core::Error::msg(format!("{error:#}")));
            }
        };
        let adam = tracing::info_span!("adamw").entered();
        for (shard, grads) in shards.iter().zip(&shard_grads) {
            let pieces: Vec<(f64, Range<usize>)> = self
                .pieces(shard)
                .map(|(placement, range)| (placement.weight_decay, range))
                .collect();
            for (weight_decay, range) in pieces {
                let local = range.start - shard.mine.start..range.end - shard.mine.start;
                let constants = AdamWStep {
                    beta1: beta1 as f32,
                    beta2: beta2 as f32,
                    eps: eps as f32,
                    grad_scale: scale as f32,
                    decay: (1.0 - lr * weight_decay) as f32,
                    step_size: step_size as f32,
                    correction2_sqrt: correction2_sqrt as f32,
                };
                let [p, m, v] = Part::ALL.map(|part| shard.range(part, local.clone()));
                let grads = &grads[local];
                match &mut target {
                    crate::snapshot::UpdateTarget::InPlace(state) => {
                        let (params, m, v) = three_mut(state, p, m, v);
                        params
                            .par_chunks_mut(BLOCK)
                            .zip(m.par_chunks_mut(BLOCK))
                            .zip(v.par_chunks_mut(BLOCK))
                            .zip(grads.par_chunks(BLOCK))
                            .for_each(|(((params, m), v), grads)| {
                                adamw(constants, params, m, v, grads)
                            });
                    }
                    crate::snapshot::UpdateTarget::Copy { from, to } => {
                        let old = (&from[p.clone()], &from[m.clone()], &from[v.clone()]);
                        let (params, m_out, v_out) = three_mut(to, p, m, v);
                        params
                            .par_chunks_mut(BLOCK)
                            .zip(m_out.par_chunks_mut(BLOCK))
                            .zip(v_out.par_chunks_mut(BLOCK))
                            .zip(old.0.par_chunks(BLOCK))
                            .zip(old.1.par_chunks(BLOCK))
                            .zip(old.2.par_chunks(BLOCK))
                            .zip(grads.par_chunks(BLOCK))
                            .for_each(|((((((params, m_out), v_out), p0), m0), v0), grads)| {
                                adamw_into(
                                    constants,
                                    &AdamWSlices {
                                        params: p0,
                                        m: m0,
                                        v: v0,
                                    },
                                    grads,
                                    &mut AdamWSlicesMut {
                                        params,
                                        m: m_out,
                                        v: v_out,
                                    },
                                )
                            });
                    }
                }
            }
        }
        memory.finish_update();
        drop(adam);
        drop(shard_grads);
        self.memory = memory;
        self.shards = shards;
        self.grads = flat;
        self.write_to(model)?;
        Ok(UpdateStats {
            grad_norm,
            clipped: scale < 1.0,
        })
    }

    /// Gathers the master weights from every shard and copies them into the model, each
    /// shard's parameters from its gathered whole (a one-rank group's own part).
    pub fn write_to(&self, model: &Model) -> Result<()> {
        let parameters = model.parameters();
        for shard in &self.shards {
            let range = shard.bounds[0]..shard.bounds[shard.bounds.len() - 1];
            let relative: Vec<usize> = shard.bounds.iter().map(|b| b - range.start).collect();
            let params = self.part(shard, Part::Params, 0..shard.mine.len());
            let whole = self.world.all_gather(shard.group, params, &relative);
            let _span = tracing::info_span!("weights_into_model").entered();
            // Every placement lies in one shard's range: dense first, then experts.
            for placement in self.placements.iter().filter(|p| range.contains(&p.offset)) {
                let start = placement.offset - range.start;
                let values = &whole[start..start + placement.len];
                let parameter = parameters[placement.index].1;
                if model.dtype == DType::F32 && parameter.is_contiguous() {
                    set_f32_values(parameter, values)?;
                } else {
                    parameter.set(
                        &Tensor::from_slice(values, placement.shape.as_slice(), &model.device)?
                            .to_dtype(model.dtype)?,
                    )?;
                }
            }
        }
        Ok(())
    }
}

/// [`AdamW::accumulate_overlapped`]'s walk down the segments.
struct Overlapped<'a, 'b> {
    world: &'a World,
    model: &'a Model,
    placements: &'a [Placement],
    /// Each placement's segment.
    owner: &'a [usize],
    /// The dense shard, then the experts'.
    shards: &'a [Shard],
    /// The step's first micro-batch: its gradients are copied, not added.
    first: bool,
    backward: &'b mut dyn FnMut(usize) -> Result<GradStore>,
    /// The segments not yet run, bottom to top: their dense and expert gradients with the
    /// flat offset each starts at.
    slices: Vec<[(usize, &'a mut [f32]); 2]>,
    /// The reduced pieces so far: (shard, absolute offset, sums).
    reduced: Vec<(usize, usize, Vec<f32>)>,
}

impl Overlapped<'_, '_> {
    /// Runs the top segment left, adds its gradients, and posts their reduce-scatter around
    /// the segments below it.
    fn next(&mut self) -> Result<()> {
        let Some([(dense_at, dense), (expert_at, experts)]) = self.slices.pop() else {
            return Ok(());
        };
        let segment = self.slices.len();
        {
            let grads = (self.backward)(segment)?;
            let _span = tracing::info_span!("accumulate_gradients").entered();
            let parameters = self.model.parameters();
            for (placement, _) in self
                .placements
                .iter()
                .zip(self.owner)
                .filter(|(_, owner)| **owner == segment)
            {
                let (at, slice) = if is_expert(&placement.name) {
                    (expert_at, &mut *experts)
                } else {
                    (dense_at, &mut *dense)
                };
                let sum = &mut slice[placement.offset - at..placement.offset - at + placement.len];
                add_gradient(sum, grads.get(parameters[placement.index].1), self.first)?;
            }
        }
        let (world, shards) = (self.world, self.shards);
        let (dense, experts): (&[f32], &[f32]) = (dense, experts);
        let ((below, expert_sums), dense_sums) = world.reduce_scatter_around(
            shards[0].group,
            dense,
            dense_at,
            &shards[0].bounds,
            || {
                world.reduce_scatter_around(
                    shards[1].group,
                    experts,
                    expert_at,
                    &shards[1].bounds,
                    || self.next(),
                )
            },
        );
        below?;
        for (shard, at, sums) in [(0, dense_at, dense_sums), (1, expert_at, expert_sums)] {
            let mine = &shards[shard].mine;
            self.reduced
                .push((shard, at.clamp(mine.start, mine.end), sums));
        }
        Ok(())
    }
}

/// For each of `placements` overlapping `shard`'s part: the placement and the overlap
/// (absolute offsets).
fn pieces<'a>(
    placements: &'a [Placement],
    shard: &'a Shard,
) -> impl Iterator<Item = (&'a Placement, Range<usize>)> + 'a {
    placements.iter().filter_map(move |placement| {
        let start = placement.offset.max(shard.mine.start);
        let end = (placement.offset + placement.len).min(shard.mine.end);
        (start < end).then_some((placement, start..end))
    })
}

/// `bound` (a flat offset splitting the state between two ranks) moved to the nearest row of
/// the parameter it falls in, so that each rank's part of a parameter is whole rows: one
/// rectangle of the global tensor, which is what a shard manifest stores of each tensor. A
/// rank's share moves by less than one row from the even split.
fn at_a_row(placements: &[Placement], bound: usize) -> usize {
    let Some(placement) = placements
        .iter()
        .find(|p| p.offset < bound && bound < p.offset + p.len)
    else {
        return bound;
    };
    let row = placement.row_len().max(1);
    let within = bound - placement.offset;
    placement.offset + (within + row / 2) / row * row
}

/// A micro-batch's gradient of one parameter into the step's sum, on the math pool's threads:
/// copied for the step's first micro-batch, else added (each element once, so in micro-batch
/// order); a parameter without a gradient counts as zeros.
fn add_gradient(sum: &mut [f32], grad: Option<&Tensor>, first: bool) -> Result<()> {
    match grad {
        None if first => sum.fill(0.0),
        None => {}
        // Straight from the gradient's storage: no copy of it on the way.
        Some(grad) => with_f32_values(grad, |grad| add_values(sum, grad, first))?,
    }
    Ok(())
}

fn add_values(sum: &mut [f32], grad: &[f32], first: bool) {
    sum.par_chunks_mut(BLOCK)
        .zip(grad.par_chunks(BLOCK))
        .for_each(|(sum, grad)| {
            if first {
                sum.copy_from_slice(grad);
            } else {
                for (total, g) in sum.iter_mut().zip(grad) {
                    *total += g;
                }
            }
        });
}

/// The sum of squares of `values`, over fixed-size blocks summed in order.
fn sum_of_squares(values: &[f32]) -> f64 {
    values
        .par_chunks(BLOCK)
        .map(crate::kernels::sum_of_squares)
        .collect::<Vec<f64>>()
        .iter()
        .sum::<f64>()
}

/// Three disjoint ranges of one buffer, in increasing order, borrowed mutably together.
fn three_mut(
    buffer: &mut [f32],
    a: Range<usize>,
    b: Range<usize>,
    c: Range<usize>,
) -> (&mut [f32], &mut [f32], &mut [f32]) {
    assert!(a.end <= b.start && b.end <= c.start, "parts overlap");
    let (head, rest) = buffer.split_at_mut(b.start);
    let (middle, tail) = rest.split_at_mut(c.start - b.start);
    (
        &mut head[a],
        &mut middle[..b.end - b.start],
        &mut tail[..c.end - c.start],
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;

    #[test]
    fn schedule_warms_up_then_decays_to_the_floor() {
        let mut config = Config::load("tiny", &[]).unwrap().train;
        (config.lr, config.min_lr, config.warmup_steps, config.steps) = (1.0, 0.1, 10, 110);
        assert!((learning_rate(&config, 5) - 0.5).abs() < 1e-12);
        assert!((learning_rate(&config, 10) - 1.0).abs() < 1e-12);
        assert!(
            (learning_rate(&config, 60) - 0.55).abs() < 1e-12,
            "halfway down the cosine"
        );
        assert!((learning_rate(&config, 110) - 0.1).abs() < 1e-12);
        assert!(
            (learning_rate(&config, 500) - 0.1).abs() < 1e-12,
            "stays at the floor"
        );
    }

    #[test]
    fn one_update_matches_the_adamw_formula() {
        // A hand-computed torch.optim.AdamW step for one weight: lr 0.1, wd 0.01, g = 0.5.
        let mut config = Config::load("tiny", &[]).unwrap();
        config.model = crate::model::tests::small_config(1, 1);
        config.train.grad_clip = 1e9;
        let model = Model::new(&config.model, 1, candle_core::DType::F32).unwrap();
        let mut optim = AdamW::new(&model, &config.train, Arc::new(World::single())).unwrap();
        let tokens: Vec<u32> = (0..14).map(|i| i % 40).collect();
        let grads = model
            .backward(&model.forward(&tokens, 2).unwrap().loss)
            .unwrap();
        let placement = optim
            .placements
            .iter()
            .find(|s| s.name == "lm_head")
            .unwrap()
            .clone();
        let before =
            optim.part(&optim.shards[0], Part::Params, 0..placement.offset + 1)[placement.offset];
        let g = f64::from(
            grads
                .get(model.lm_head.as_ref().unwrap())
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1::<f32>()
                .unwrap()[0],
        );
        optim
            .update(&model, &grads, 0.1, &HeldSlots::default())
            .unwrap();
        // Step 1: m = (1-b1) g, v = (1-b2) g^2; corrected m/sqrt(v) = g/|g|.
        let expected = f64::from(before) * (1.0 - 0.1 * config.train.weight_decay)
            - 0.1 * g / (g.abs() + config.train.eps);
        let after =
            optim.part(&optim.shards[0], Part::Params, 0..placement.offset + 1)[placement.offset];
        assert!(
            (f64::from(after) - expected).abs() < 1e-6,
            "{after} vs {expected}"
        );
        let in_model: Vec<f32> = model
            .lm_head
            .as_ref()
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        assert_eq!(in_model[0], after, "the model holds the master weight");
    }
}
