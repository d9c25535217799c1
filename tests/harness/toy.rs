//! A tiny real training run for demos and benchmarks, until the trainer exists: a byte-level
//! bigram model (embedding, then a linear map back to the 256 byte values) trained with Adam on
//! real text. Its weights and Adam moments are genuine training state, with the statistics
//! that matter for compression (smooth weights, sparse-then-dense moments, step-to-step drift).

use bytes::Bytes;
use lazarus_shared::format::DType;
use lazarus_shared::store::TensorData;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

const VOCAB: usize = 256;

/// Parameters and AdamW state, all f32.
#[derive(Debug)]
pub struct Toy {
    dim: usize,
    text: Vec<u8>,
    cursor: usize,
    pub step: u64,
    embedding: Vec<f32>,
    output: Vec<f32>,
    moments: [Vec<f32>; 4],
}

fn init(count: usize, seed: u64, scale: f32) -> Vec<f32> {
    let mut rng = StdRng::seed_from_u64(seed);
    (0..count)
        .map(|_| rng.random_range(-scale..scale))
        .collect()
}

fn as_bytes(values: &[f32]) -> Bytes {
    Bytes::from(
        values
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect::<Vec<u8>>(),
    )
}

impl Toy {
    pub fn new(text: Vec<u8>, dim: usize, seed: u64) -> Self {
        let scale = (1.0 / dim as f32).sqrt();
        let zeros = || vec![0.0; VOCAB * dim];
        Self {
            dim,
            text,
            cursor: 0,
            step: 0,
            embedding: init(VOCAB * dim, seed, scale),
            output: init(dim * VOCAB, seed + 1, scale),
            moments: [zeros(), zeros(), zeros(), zeros()],
        }
    }

    /// Bytes of model and optimizer state.
    pub fn state_bytes(&self) -> u64 {
        (6 * VOCAB * self.dim * 4) as u64
    }

    /// One AdamW step on `batch` next-byte predictions. Returns the mean loss (nats).
    pub fn train_step(&mut self, batch: usize, learning_rate: f32) -> f32 {
        let dim = self.dim;
        let mut grad_embedding = vec![0.0f32; VOCAB * dim];
        let mut grad_output = vec![0.0f32; dim * VOCAB];
        let mut loss = 0.0f32;
        let mut logits = vec![0.0f32; VOCAB];
        for _ in 0..batch {
            let (input, target) = (
                self.text[self.cursor] as usize,
                self.text[self.cursor + 1] as usize,
            );
            self.cursor = (self.cursor + 1) % (self.text.len() - 1);
            let hidden = &self.embedding[input * dim..(input + 1) * dim];
            logits.iter_mut().for_each(|l| *l = 0.0);
            for (d, h) in hidden.iter().enumerate() {
                for (l, w) in logits
                    .iter_mut()
                    .zip(&self.output[d * VOCAB..(d + 1) * VOCAB])
                {
                    *l += h * w;
                }
            }
            let max = logits.iter().cloned().fold(f32::MIN, f32::max);
            let sum: f32 = logits.iter().map(|l| (l - max).exp()).sum();
            loss += sum.ln() + max - logits[target];
            // d loss / d logits = softmax - one_hot(target)
            for (index, l) in logits.iter_mut().enumerate() {
                *l = (*l - max).exp() / sum - if index == target { 1.0 } else { 0.0 };
            }
            for d in 0..dim {
                let h = hidden[d];
                let row = &self.output[d * VOCAB..(d + 1) * VOCAB];
                let mut grad_hidden = 0.0;
                for ((g, w), dl) in grad_output[d * VOCAB..(d + 1) * VOCAB]
                    .iter_mut()
                    .zip(row)
                    .zip(&logits)
                {
                    *g += h * dl;
                    grad_hidden += w * dl;
                }
                grad_embedding[input * dim + d] += grad_hidden;
            }
        }
        self.step += 1;
        let scale = 1.0 / batch as f32;
        let (beta1, beta2, epsilon, decay) = (0.9f32, 0.95f32, 1e-8f32, 0.01f32);
        let correction1 = 1.0 - beta1.powi(self.step as i32);
        let correction2 = 1.0 - beta2.powi(self.step as i32);
        let [m_embedding, v_embedding, m_output, v_output] = &mut self.moments;
        for (params, grads, m, v) in [
            (
                &mut self.embedding,
                &grad_embedding,
                m_embedding,
                v_embedding,
            ),
            (&mut self.output, &grad_output, m_output, v_output),
        ] {
            for (((p, g), m), v) in params
                .iter_mut()
                .zip(grads)
                .zip(m.iter_mut())
                .zip(v.iter_mut())
            {
                let g = g * scale;
                *m = beta1 * *m + (1.0 - beta1) * g;
                *v = beta2 * *v + (1.0 - beta2) * g * g;
                *p -= learning_rate
                    * ((*m / correction1) / ((*v / correction2).sqrt() + epsilon) + decay * *p);
            }
        }
        loss * scale
    }

    /// The training state as tensors: weights, then their Adam moments.
    pub fn tensors(&self) -> Vec<TensorData> {
        let shape = |rows: usize, cols: usize| vec![rows as u64, cols as u64];
        let names = [
            "embedding.exp_avg",
            "embedding.exp_avg_sq",
            "lm_head.exp_avg",
            "lm_head.exp_avg_sq",
        ];
        let mut tensors = vec![
            TensorData::whole(
                "embedding.weight",
                DType::F32,
                shape(VOCAB, self.dim),
                as_bytes(&self.embedding),
            ),
            TensorData::whole(
                "lm_head.weight",
                DType::F32,
                shape(self.dim, VOCAB),
                as_bytes(&self.output),
            ),
        ];
        for (name, moment) in names.iter().zip(&self.moments) {
            let rows = if name.starts_with("embedding") {
                (VOCAB, self.dim)
            } else {
                (self.dim, VOCAB)
            };
            tensors.push(TensorData::whole(
                *name,
                DType::F32,
                shape(rows.0, rows.1),
                as_bytes(moment),
            ));
        }
        tensors
    }

    /// Replaces the training state with tensors and a loader blob read from a checkpoint.
    pub fn restore(&mut self, tensors: &[(String, Vec<u8>)], loader: &[u8]) -> Result<(), String> {
        let floats = |bytes: &[u8]| -> Vec<f32> {
            bytes
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect()
        };
        for (name, bytes) in tensors {
            let values = floats(bytes);
            let target = match name.as_str() {
                "embedding.weight" => &mut self.embedding,
                "lm_head.weight" => &mut self.output,
                "embedding.exp_avg" => &mut self.moments[0],
                "embedding.exp_avg_sq" => &mut self.moments[1],
                "lm_head.exp_avg" => &mut self.moments[2],
                "lm_head.exp_avg_sq" => &mut self.moments[3],
                other => return Err(format!("unexpected tensor {other:?}")),
            };
            if values.len() != target.len() {
                return Err(format!(
                    "tensor {name:?} has {} values, the model needs {}",
                    values.len(),
                    target.len()
                ));
            }
            *target = values;
        }
        let state: serde_json::Value =
            serde_json::from_slice(loader).map_err(|e| format!("loader state: {e}"))?;
        self.cursor = state["cursor"]
            .as_u64()
            .ok_or("loader state has no cursor")? as usize;
        self.step = state["step"].as_u64().ok_or("loader state has no step")?;
        Ok(())
    }

    /// Data-loader position, stored as a state blob.
    pub fn loader_state(&self) -> Bytes {
        Bytes::from(format!(
            "{{\"cursor\":{},\"step\":{}}}",
            self.cursor, self.step
        ))
    }
}
