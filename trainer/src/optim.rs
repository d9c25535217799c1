//! AdamW over flat fp32 buffers, the learning-rate schedule and global-norm clipping.
//!
//! Master weights, both moments and gradients live in contiguous `Vec<f32>`s laid out in
//! [`Model::parameters`] order, each parameter a slice. A later sharded (ZeRO-1) optimizer owns
//! sub-ranges of the same buffers. The update matches `torch.optim.AdamW`; reductions run in a
//! fixed order, so a step is bit-reproducible.

use candle_core::backprop::GradStore;
use candle_core::{Result, Tensor};
use rayon::prelude::*;

use crate::config::TrainConfig;
use crate::kernels::{adamw, AdamWStep};
use crate::model::Model;

/// Where one parameter lives in the flat buffers.
/// Elements per parallel work item of the update (and per partial sum of the norm).
const BLOCK: usize = 1 << 16;

#[derive(Clone, Debug, PartialEq)]
pub struct Slot {
    pub name: String,
    pub offset: usize,
    pub len: usize,
    pub shape: Vec<usize>,
    pub weight_decay: f64,
}

/// Optimizer state: master weights and moments, flat.
#[derive(Clone, Debug)]
pub struct AdamW {
    pub slots: Vec<Slot>,
    pub params: Vec<f32>,
    pub exp_avg: Vec<f32>,
    pub exp_avg_sq: Vec<f32>,
    /// Updates applied so far (the bias-correction step).
    pub step: u64,
    /// The flat gradient of the last update, kept to reuse its memory.
    grads: Vec<f32>,
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

impl AdamW {
    /// State for `model`'s current weights. Norm weights get `norm_weight_decay`, everything
    /// else `weight_decay`.
    pub fn new(model: &Model, config: &TrainConfig) -> Result<Self> {
        let mut slots = Vec::new();
        let mut params = Vec::new();
        for (name, var) in model.parameters() {
            let values: Vec<f32> = var.flatten_all()?.to_vec1()?;
            let weight_decay = if name.ends_with("norm") {
                config.norm_weight_decay
            } else {
                config.weight_decay
            };
            slots.push(Slot {
                name,
                offset: params.len(),
                len: values.len(),
                shape: var.dims().to_vec(),
                weight_decay,
            });
            params.extend(values);
        }
        let zeros = vec![0.0; params.len()];
        Ok(Self {
            slots,
            exp_avg: zeros.clone(),
            exp_avg_sq: zeros,
            params,
            step: 0,
            grads: Vec::new(),
            beta1: config.beta1,
            beta2: config.beta2,
            eps: config.eps,
            grad_clip: config.grad_clip,
        })
    }

    /// Bytes of optimizer state (master weights and both moments).
    pub fn state_bytes(&self) -> u64 {
        3 * 4 * self.params.len() as u64
    }

    /// Clips the gradients to `grad_clip` by global norm, applies one AdamW update at `lr`, and
    /// writes the new weights into the model.
    pub fn update(&mut self, model: &Model, grads: &GradStore, lr: f64) -> Result<UpdateStats> {
        let mut flat = std::mem::take(&mut self.grads);
        flat.clear();
        for (slot, (name, var)) in self.slots.iter().zip(model.parameters()) {
            debug_assert_eq!(slot.name, name);
            match grads.get(var) {
                Some(grad) => flat.extend(grad.flatten_all()?.to_vec1::<f32>()?),
                None => flat.extend(std::iter::repeat_n(0.0, slot.len)),
            }
        }
        // Fixed-size blocks summed in order: the same norm whatever the thread count.
        let grad_norm = flat
            .par_chunks(BLOCK)
            .map(|block| {
                block
                    .iter()
                    .map(|g| f64::from(*g) * f64::from(*g))
                    .sum::<f64>()
            })
            .collect::<Vec<f64>>()
            .iter()
            .sum::<f64>()
            .sqrt();
        let scale = if grad_norm > self.grad_clip {
            self.grad_clip / (grad_norm + 1e-6)
        } else {
            1.0
        };
        self.step += 1;
        let correction1 = 1.0 - self.beta1.powi(self.step as i32);
        let correction2_sqrt = (1.0 - self.beta2.powi(self.step as i32)).sqrt();
        let step_size = lr / correction1;
        for slot in &self.slots {
            let decay = 1.0 - lr * slot.weight_decay;
            let range = slot.offset..slot.offset + slot.len;
            let constants = AdamWStep {
                beta1: self.beta1 as f32,
                beta2: self.beta2 as f32,
                eps: self.eps as f32,
                grad_scale: scale as f32,
                decay: decay as f32,
                step_size: step_size as f32,
                correction2_sqrt: correction2_sqrt as f32,
            };
            self.params[range.clone()]
                .par_chunks_mut(BLOCK)
                .zip(self.exp_avg[range.clone()].par_chunks_mut(BLOCK))
                .zip(self.exp_avg_sq[range.clone()].par_chunks_mut(BLOCK))
                .zip(flat[range].par_chunks(BLOCK))
                .for_each(|(((params, m), v), grads)| adamw(constants, params, m, v, grads));
        }
        self.grads = flat;
        self.write_to(model)?;
        Ok(UpdateStats {
            grad_norm,
            clipped: scale < 1.0,
        })
    }

    /// Copies the master weights into the model's variables.
    pub fn write_to(&self, model: &Model) -> Result<()> {
        for (slot, (_, var)) in self.slots.iter().zip(model.parameters()) {
            let values = &self.params[slot.offset..slot.offset + slot.len];
            var.set(
                &Tensor::from_slice(values, slot.shape.as_slice(), &model.device)?
                    .to_dtype(model.dtype)?,
            )?;
        }
        Ok(())
    }
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
        let mut optim = AdamW::new(&model, &config.train).unwrap();
        let tokens: Vec<u32> = (0..14).map(|i| i % 40).collect();
        let grads = model.forward(&tokens, 2).unwrap().loss.backward().unwrap();
        let slot = optim
            .slots
            .iter()
            .find(|s| s.name == "lm_head")
            .unwrap()
            .clone();
        let before = optim.params[slot.offset];
        let g = f64::from(
            grads
                .get(&model.lm_head)
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1::<f32>()
                .unwrap()[0],
        );
        optim.update(&model, &grads, 0.1).unwrap();
        // Step 1: m = (1-b1) g, v = (1-b2) g^2; corrected m/sqrt(v) = g/|g|.
        let expected = f64::from(before) * (1.0 - 0.1 * config.train.weight_decay)
            - 0.1 * g / (g.abs() + config.train.eps);
        assert!(
            (f64::from(optim.params[slot.offset]) - expected).abs() < 1e-6,
            "{} vs {expected}",
            optim.params[slot.offset]
        );
        let in_model: Vec<f32> = model.lm_head.flatten_all().unwrap().to_vec1().unwrap();
        assert_eq!(
            in_model[0], optim.params[slot.offset],
            "the model holds the master weight"
        );
    }
}
