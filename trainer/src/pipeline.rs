//! One training step of this rank's pipeline stage: its `micro_batches` micro-batches forward
//! and back in the 1F1B order (Megatron's non-interleaved schedule), activations sent to the
//! next stage and their gradients back to the one before by MPI point to point, and every
//! micro-batch's gradients added to the optimizer's in micro-batch order.
//!
//! Stage `s` of `pp` first runs `min(pp - s - 1, m)` forward passes (warm-up), then
//! alternates one forward and one backward pass, then runs the backward passes left
//! (cool-down). Where a stage sends and receives from the same neighbour at once, both go
//! in one `MPI_Sendrecv`, so two stages that send to each other never wait on each other.
//! With one stage it is gradient accumulation over the micro-batches; with one micro-batch
//! and one stage, the plain step.
//!
//! A stage before the last has no loss of its own beyond its layers' router losses: its
//! backward pass differentiates `router losses + <output, gradient received>`, which gives
//! its parameters and its input the gradients of the whole model's loss.

use std::collections::VecDeque;
use std::time::Instant;

use candle_core::{Tensor, Var};

use crate::dist::{Flow, Group, Peer, World};
use crate::model::{Forward, Model};
use crate::optim::AdamW;

/// What a step did on this rank, summed over its micro-batches and divided by the number of
/// samples' shares (`dp * micro_batches`): summed over the ranks that speak for their stage
/// (tensor-parallel rank 0), each is the global batch's figure.
#[derive(Debug, Default)]
pub struct StepFigures {
    /// This stage's part of the loss.
    pub loss: f64,
    /// The last stage's; 0 elsewhere.
    pub cross_entropy: f64,
    /// This stage's layers' share.
    pub load_balancing: f64,
    pub router_z: f64,
    /// Tokens routed to each expert, per layer of this stage, over the micro-batches.
    pub expert_load: Vec<Vec<u64>>,
    pub forward_seconds: f64,
    pub backward_seconds: f64,
    /// Seconds waiting on (and talking to) the neighbouring stages, and the step's seconds.
    pub pipeline_wait_seconds: f64,
    pub seconds: f64,
    /// The most heap the micro-batches in flight held (their activations, kept for the
    /// backward pass), measured after each forward pass above the heap at the step's start.
    pub activation_bytes: usize,
}

/// A micro-batch between its forward and its backward pass.
struct InFlight {
    /// The received activations, as a variable for their gradient (stages after the first).
    input: Option<Var>,
    forward: Forward,
}

/// One step's state on this rank.
struct Step<'a> {
    model: &'a Model,
    world: &'a World,
    /// The stage before this one, which the gradient of this stage's input goes to.
    gradients_out: Option<Peer>,
    optim: &'a mut AdamW,
    tokens: &'a [u32],
    /// Samples per micro-batch, and tokens per sample (`seq + 1`).
    micro: usize,
    sample: usize,
    /// Rows of a micro-batch's activations (`micro * seq`).
    rows: usize,
    /// The loss of each micro-batch is multiplied by this: `1 / (dp * micro_batches)`.
    scale: f64,
    micro_batches: usize,
    figures: StepFigures,
    /// The heap when the step started.
    heap_at_start: usize,
}

impl Step<'_> {
    fn forward(&mut self, index: usize, received: Option<Vec<f32>>) -> anyhow::Result<InFlight> {
        let _span = tracing::info_span!("forward", micro_batch = index).entered();
        let started = Instant::now();
        let span = self.micro * self.sample;
        let tokens = &self.tokens[index * span..(index + 1) * span];
        let input = match received {
            Some(values) => {
                let width = self.model.config.d_model;
                let tensor = Tensor::from_vec(values, (self.rows, width), &self.model.device)?
                    .to_dtype(self.model.dtype)?;
                Some(Var::from_tensor(&tensor)?)
            }
            None => None,
        };
        // The step's last micro-batch (backward passes run in forward order) is cut at every
        // layer when its backward pass reduces the gradient as it goes.
        let cut = self.optim.overlap_grad_reduce && index + 1 == self.micro_batches;
        let mut forward = self.model.stage_forward_cut(
            tokens,
            self.micro,
            input.as_ref().map(|v| v.as_tensor()),
            true,
            cut,
        )?;
        let f = &mut self.figures;
        f.loss += forward
            .loss
            .to_dtype(candle_core::DType::F64)?
            .to_scalar::<f64>()?;
        f.cross_entropy += forward.cross_entropy;
        f.load_balancing += forward.load_balancing;
        f.router_z += forward.router_z;
        if f.expert_load.is_empty() {
            f.expert_load = forward.expert_load.clone();
        } else {
            for (total, layer) in f.expert_load.iter_mut().zip(&forward.expert_load) {
                for (t, n) in total.iter_mut().zip(layer) {
                    *t += n;
                }
            }
        }
        if self.scale != 1.0 {
            forward.loss = (forward.loss * self.scale)?;
            for segment in &mut forward.segments {
                segment.objective = (&segment.objective * self.scale)?;
            }
        }
        f.forward_seconds += started.elapsed().as_secs_f64();
        f.activation_bytes = f
            .activation_bytes
            .max(crate::memory::heap_bytes().saturating_sub(self.heap_at_start));
        Ok(InFlight { input, forward })
    }

    /// The backward pass of `flight`, with the gradient of its output from the next stage
    /// (none on the last); returns the gradient of its input to send to the stage before
    /// (empty on the first stage), or `None` where it has been sent already.
    fn backward(
        &mut self,
        flight: InFlight,
        gradient: Option<Vec<f32>>,
    ) -> anyhow::Result<Option<Vec<f32>>> {
        let _span = tracing::info_span!("backward").entered();
        let started = Instant::now();
        let InFlight { input, forward } = flight;
        if !forward.segments.is_empty() {
            self.backward_segments(input, forward, gradient)?;
            self.figures.backward_seconds += started.elapsed().as_secs_f64();
            return Ok(None);
        }
        let objective = match (forward.hidden, gradient) {
            (Some(output), Some(gradient)) => {
                let gradient = Tensor::from_vec(gradient, output.shape(), &self.model.device)?
                    .to_dtype(self.model.dtype)?;
                (forward.loss + (output * gradient)?.sum_all()?)?
            }
            (None, None) => forward.loss,
            _ => anyhow::bail!("a stage's output and the gradient it receives go together"),
        };
        let grads = self.model.backward(&objective)?;
        let accumulating = tracing::info_span!("accumulate_gradients").entered();
        self.optim.accumulate(self.model, &grads)?;
        drop(accumulating);
        let back = match input {
            Some(var) => match grads.get(&var) {
                Some(grad) => grad
                    .to_dtype(candle_core::DType::F32)?
                    .flatten_all()?
                    .to_vec1::<f32>()?,
                None => vec![0.0; var.elem_count()],
            },
            None => Vec::new(),
        };
        self.figures.backward_seconds += started.elapsed().as_secs_f64();
        Ok(Some(back))
    }

    /// The backward pass of a micro-batch cut at its layers, layer by layer from the top,
    /// each layer's gradients reduced while the layers below run
    /// ([`AdamW::accumulate_overlapped`]). The gradient of the stage's input goes to the stage
    /// before as soon as the bottom layer has it, before this stage waits for its reductions.
    fn backward_segments(
        &mut self,
        input: Option<Var>,
        forward: Forward,
        gradient: Option<Vec<f32>>,
    ) -> anyhow::Result<()> {
        let (model, world, segments) = (self.model, self.world, &forward.segments);
        let gradients_out = self.gradients_out;
        let top = segments.len() - 1;
        // The gradient of the stage's output (from the next stage), then of each segment's.
        let mut flowing = match (&forward.hidden, gradient) {
            (Some(output), Some(gradient)) => Some((
                output.clone(),
                Tensor::from_vec(gradient, output.shape(), &model.device)?.to_dtype(model.dtype)?,
            )),
            (None, None) => None,
            _ => anyhow::bail!("a stage's output and the gradient it receives go together"),
        };
        let layers: Vec<usize> = segments.iter().map(|s| s.layer).collect();
        self.optim
            .accumulate_overlapped(model, &layers, &mut |index| {
                let segment = &segments[index];
                let objective = match flowing.take() {
                    Some((output, gradient)) => {
                        (&segment.objective + (output * gradient)?.sum_all()?)?
                    }
                    None if index == top => segment.objective.clone(),
                    None => candle_core::bail!("no gradient reached layer {}", segment.layer),
                };
                let grads = model.backward(&objective)?;
                // What flows into the segment below, or out of the stage.
                let bottom = match &segment.input {
                    Some(var) => Some(var),
                    None => input.as_ref(),
                };
                if let Some(var) = bottom {
                    let gradient = match grads.get(var) {
                        Some(gradient) => gradient.clone(),
                        None => var.zeros_like()?,
                    };
                    if index > 0 {
                        let below = segments[index - 1].output.clone().ok_or_else(|| {
                            candle_core::Error::msg("a cut segment has an output below it")
                        })?;
                        flowing = Some((below, gradient));
                    } else if let Some(to) = gradients_out {
                        let back = gradient
                            .to_dtype(candle_core::DType::F32)?
                            .flatten_all()?
                            .to_vec1::<f32>()?;
                        world.pipe(Some((to, &back)), None);
                    }
                }
                Ok(grads)
            })?;
        Ok(())
    }
}

/// The activations of `forward`'s output, to send.
fn output_values(forward: &Forward) -> anyhow::Result<Vec<f32>> {
    let output = forward
        .hidden
        .as_ref()
        .ok_or_else(|| anyhow::anyhow!("a stage before the last has an output"))?;
    Ok(output
        .to_dtype(candle_core::DType::F32)?
        .flatten_all()?
        .to_vec1::<f32>()?)
}

/// Runs one step of this rank's stage over its data-parallel share `tokens` (`batch`
/// samples of `seq_len + 1` tokens) and adds the gradients to `optim`'s coming update.
pub fn train_step(
    model: &Model,
    world: &World,
    optim: &mut AdamW,
    tokens: &[u32],
    batch: usize,
) -> anyhow::Result<StepFigures> {
    let started = Instant::now();
    let waited = crate::dist::pipeline_wait_seconds();
    let layout = &world.layout;
    let m = layout.micro_batches;
    let place = model.place;
    let (stage, pp) = (place.stage, place.pp);
    let (first, last) = (place.first_stage(), place.last_stage());
    let micro = batch / m;
    let sample = tokens.len() / batch;
    let shares = (layout.dp * m) as f64;
    let rows = micro * (sample - 1);
    let width = rows * model.config.d_model;
    let gradients_out = Peer {
        stage: stage.wrapping_sub(1),
        flow: Flow::Gradients,
    };
    let mut step = Step {
        model,
        world,
        gradients_out: (!first).then_some(gradients_out),
        optim,
        tokens,
        micro,
        sample,
        rows,
        scale: 1.0 / shares,
        micro_batches: m,
        figures: StepFigures::default(),
        heap_at_start: crate::memory::heap_bytes(),
    };
    let activations_in = (!first).then_some((
        Peer {
            stage: stage.wrapping_sub(1),
            flow: Flow::Activations,
        },
        width,
    ));
    let gradients_in = (!last).then_some((
        Peer {
            stage: stage + 1,
            flow: Flow::Gradients,
        },
        width,
    ));
    let activations_out = Peer {
        stage: stage + 1,
        flow: Flow::Activations,
    };
    // Receives the next micro-batch's activations (nothing on the first stage).
    let receive_forward =
        |world: &World| activations_in.map(|receive| world.pipe(None, Some(receive)));

    let warmup = (pp - stage - 1).min(m);
    let steady = m - warmup;
    let mut in_flight = VecDeque::with_capacity(warmup + 1);
    let mut next = 0;
    for _ in 0..warmup {
        let received = receive_forward(world);
        let flight = step.forward(next, received)?;
        next += 1;
        world.pipe(
            Some((activations_out, &output_values(&flight.forward)?)),
            None,
        );
        in_flight.push_back(flight);
    }
    let mut received = if steady > 0 {
        receive_forward(world)
    } else {
        None
    };
    for i in 0..steady {
        let flight = step.forward(next, received.take())?;
        next += 1;
        // Send this output on; receive the gradient of the oldest in flight.
        let gradient = match gradients_in {
            Some(receive) => Some(world.pipe(
                Some((activations_out, &output_values(&flight.forward)?)),
                Some(receive),
            )),
            None => None,
        };
        in_flight.push_back(flight);
        let oldest = in_flight.pop_front().expect("a micro-batch in flight");
        let back = step.backward(oldest, gradient)?;
        if first {
            continue;
        }
        // Send the input's gradient back (unless sent already); receive the next
        // micro-batch's activations.
        let back = back.as_ref().map(|back| (gradients_out, back.as_slice()));
        if i + 1 < steady {
            received = Some(world.pipe(back, activations_in));
        } else if back.is_some() {
            world.pipe(back, None);
        }
    }
    for _ in 0..warmup {
        let gradient = gradients_in.map(|receive| world.pipe(None, Some(receive)));
        let oldest = in_flight.pop_front().expect("a micro-batch in flight");
        if let (Some(back), false) = (step.backward(oldest, gradient)?, first) {
            world.pipe(Some((gradients_out, &back)), None);
        }
    }
    let mut figures = step.figures;
    figures.cross_entropy /= shares;
    figures.load_balancing /= shares;
    figures.router_z /= shares;
    figures.loss /= shares;
    figures.pipeline_wait_seconds = crate::dist::pipeline_wait_seconds() - waited;
    figures.seconds = started.elapsed().as_secs_f64();
    Ok(figures)
}

/// The cross-entropy of `batch` samples (`tokens`) through the whole pipeline, forward only;
/// every rank of the pipeline gets it.
pub fn evaluate(model: &Model, world: &World, tokens: &[u32], batch: usize) -> anyhow::Result<f64> {
    let place = model.place;
    if place.pp == 1 {
        return Ok(model.evaluate(tokens, batch)?.cross_entropy);
    }
    let stage = place.stage;
    let rows = tokens.len() - batch;
    let width = rows * model.config.d_model;
    let input = if place.first_stage() {
        None
    } else {
        let from = Peer {
            stage: stage - 1,
            flow: Flow::Activations,
        };
        let values = world.pipe(None, Some((from, width)));
        Some(
            Tensor::from_vec(values, (rows, model.config.d_model), &model.device)?
                .to_dtype(model.dtype)?,
        )
    };
    let forward = model.stage_forward(tokens, batch, input.as_ref(), false)?;
    let cross_entropy = if place.last_stage() {
        forward.cross_entropy
    } else {
        let to = Peer {
            stage: stage + 1,
            flow: Flow::Activations,
        };
        world.pipe(Some((to, &output_values(&forward)?)), None);
        0.0
    };
    Ok(world.sum_f64(Group::Pipeline, &[cross_entropy])[0])
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::config::{Config, ConfigError};
    use crate::layout::Layout;

    /// One rank's step over `micro_batches`: its figures and the accumulated gradient.
    fn step(model: &Model, micro_batches: usize, tokens: &[u32]) -> (StepFigures, Vec<f32>) {
        let (figures, optim) = step_with(model, micro_batches, tokens, false);
        (figures, optim.gradient().to_vec())
    }

    /// [`step`], with the backward pass cut at the layers and reduced as it goes when
    /// `overlap`; returns the optimizer, ready for its update.
    fn step_with(
        model: &Model,
        micro_batches: usize,
        tokens: &[u32],
        overlap: bool,
    ) -> (StepFigures, AdamW) {
        let layout = Layout {
            micro_batches,
            ..Layout::data_parallel(1)
        };
        let world = Arc::new(World::init(|_| Ok::<_, ConfigError>(layout)).unwrap());
        let train = Config::load("tiny", &[]).unwrap().train;
        let mut optim = AdamW::new(model, &train, world.clone()).unwrap();
        optim.overlap_grad_reduce = overlap;
        let figures = train_step(model, &world, &mut optim, tokens, 4).unwrap();
        (figures, optim)
    }

    /// A step whose last micro-batch runs backward layer by layer (each layer's gradients
    /// handed to the reduce-scatter before the layers below run) computes the gradient and
    /// the update the whole backward pass does, router losses included.
    #[test]
    fn a_backward_pass_cut_at_the_layers_computes_the_whole_gradient() {
        let config = crate::model::tests::small_config(4, 2);
        let tokens: Vec<u32> = (0..4 * (config.seq_len + 1))
            .map(|i| (i as u32 * 7 + 3) % 40)
            .collect();
        for micro_batches in [1, 2] {
            let whole_model = Model::new(&config, 7, candle_core::DType::F32).unwrap();
            let cut_model = Model::new(&config, 7, candle_core::DType::F32).unwrap();
            let (whole, mut whole_optim) = step_with(&whole_model, micro_batches, &tokens, false);
            let (cut, mut cut_optim) = step_with(&cut_model, micro_batches, &tokens, true);
            assert_eq!(
                whole.loss.to_bits(),
                cut.loss.to_bits(),
                "the same forward pass"
            );
            let (a, b) = (whole_optim.gradient(), cut_optim.gradient());
            let largest = a.iter().fold(0f32, |m, g| m.max(g.abs()));
            assert!(largest > 0.0);
            for (index, (x, y)) in a.iter().zip(b).enumerate() {
                assert!(
                    (x - y).abs() <= 1e-5 * largest,
                    "{micro_batches} micro-batches, element {index}: {x} vs {y}"
                );
            }
            // Every parameter's gradient reached the update through the reduced pieces.
            let held = crate::snapshot::HeldSlots::default();
            let whole_update = whole_optim.apply(&whole_model, 0.01, &held).unwrap();
            let cut_update = cut_optim.apply(&cut_model, 0.01, &held).unwrap();
            let relative =
                (whole_update.grad_norm - cut_update.grad_norm).abs() / whole_update.grad_norm;
            assert!(relative < 1e-5, "{whole_update:?} vs {cut_update:?}");
            for ((name, a), (_, b)) in whole_model.parameters().iter().zip(cut_model.parameters()) {
                let a: Vec<f32> = a.flatten_all().unwrap().to_vec1().unwrap();
                let b: Vec<f32> = b.flatten_all().unwrap().to_vec1().unwrap();
                for (x, y) in a.iter().zip(&b) {
                    assert!((x - y).abs() <= 1e-5, "{name}: {x} vs {y}");
                }
            }
        }
    }

    /// Micro-batches' gradients add up to the whole batch's. The router losses are left out:
    /// each micro-batch has its own routing statistics (as in Megatron), so only the
    /// cross-entropy is the same function of the batch however it is cut.
    #[test]
    fn micro_batches_add_up_to_the_whole_batch() {
        let mut config = crate::model::tests::small_config(4, 2);
        (config.router_aux_coef, config.router_z_coef) = (0.0, 0.0);
        let model = Model::new(&config, 7, candle_core::DType::F32).unwrap();
        let tokens: Vec<u32> = (0..4 * (config.seq_len + 1))
            .map(|i| (i as u32 * 11 + 5) % 40)
            .collect();
        let (whole, whole_gradient) = step(&model, 1, &tokens);
        let (cut, cut_gradient) = step(&model, 4, &tokens);
        assert!(
            (whole.loss - cut.loss).abs() < 1e-6 * whole.loss,
            "{} vs {}",
            whole.loss,
            cut.loss
        );
        assert!((whole.cross_entropy - cut.cross_entropy).abs() < 1e-6 * whole.loss);
        assert_eq!(whole_gradient.len(), cut_gradient.len());
        let largest = whole_gradient.iter().fold(0f32, |m, g| m.max(g.abs()));
        assert!(largest > 0.0);
        for (index, (a, b)) in whole_gradient.iter().zip(&cut_gradient).enumerate() {
            assert!(
                (a - b).abs() <= 1e-5 * largest,
                "element {index}: {a} vs {b} (largest {largest})"
            );
        }
        let experts: u64 = cut.expert_load.iter().flatten().sum();
        assert_eq!(
            experts,
            (2 * 2 * 4 * config.seq_len) as u64,
            "top-2 of every token, per layer"
        );
    }
}
