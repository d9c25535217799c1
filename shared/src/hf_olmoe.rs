//! The trainer's checkpoint layout, mapped onto Hugging Face transformers' OLMoE layout.
//!
//! The trainer stores, per step, its model configuration as the blob [`MODEL_BLOB`] and each
//! parameter under its own name, with its model shape: projections `[in, out]`, the embedding
//! and the LM head `[vocab, d_model]`, experts stacked per layer. The HF
//! layout (`OlmoeForCausalLM`, as `save_pretrained` writes it) wants matrices `[out, in]` and
//! one tensor per expert and projection. This module is the single place that knows both.

use serde::{Deserialize, Serialize};

/// The blob each trainer checkpoint carries: its model configuration, as JSON.
pub const MODEL_BLOB: &str = "model.json";

/// The model configuration: the trainer's `[model]` section, and what it writes into
/// [`MODEL_BLOB`].
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelSpec {
    pub vocab_size: usize,
    pub d_model: usize,
    pub layers: usize,
    pub heads: usize,
    /// 1 gives the dense variant (one expert, top-1).
    pub experts: usize,
    pub top_k: usize,
    pub expert_ffn: usize,
    pub seq_len: usize,
    pub rope_theta: f64,
    pub norm_eps: f64,
    pub router_aux_coef: f64,
    pub router_z_coef: f64,
}

/// Why a checkpoint cannot be exported in the HF layout.
#[derive(Debug, thiserror::Error)]
pub enum HfError {
    #[error("tensor {name}: expected shape {expected:?}, found {found:?}")]
    Shape {
        name: String,
        expected: Vec<u64>,
        found: Vec<u64>,
    },
    #[error("tensor {name}: {bytes} bytes do not hold {elements} f32 values")]
    Size {
        name: String,
        bytes: usize,
        elements: u64,
    },
}

/// One tensor of the HF layout: name, shape, little-endian f32 bytes.
pub type HfTensor = (String, Vec<u64>, Vec<u8>);

/// GPT-2's end-of-text token, the trainer's default tokenizer.
const END_OF_TEXT: u32 = 50256;

impl ModelSpec {
    /// `config.json` for `OlmoeForCausalLM`. Both the `rope_theta` key of transformers 4 and
    /// the `rope_parameters` of transformers 5 are written.
    pub fn hf_config(&self) -> serde_json::Value {
        serde_json::json!({
            "architectures": ["OlmoeForCausalLM"],
            "model_type": "olmoe",
            "vocab_size": self.vocab_size,
            "hidden_size": self.d_model,
            "intermediate_size": self.expert_ffn,
            "num_hidden_layers": self.layers,
            "num_attention_heads": self.heads,
            "num_key_value_heads": self.heads,
            "hidden_act": "silu",
            "max_position_embeddings": self.seq_len,
            "initializer_range": 0.02,
            "rms_norm_eps": self.norm_eps,
            "use_cache": true,
            "pad_token_id": null,
            "bos_token_id": null,
            "eos_token_id": if (END_OF_TEXT as usize) < self.vocab_size { serde_json::json!(END_OF_TEXT) } else { serde_json::Value::Null },
            "tie_word_embeddings": false,
            "rope_theta": self.rope_theta,
            "rope_parameters": { "rope_type": "default", "rope_theta": self.rope_theta },
            "rope_scaling": null,
            "attention_bias": false,
            "attention_dropout": 0.0,
            "clip_qkv": null,
            "num_experts": self.experts,
            "num_experts_per_tok": self.top_k,
            "norm_topk_prob": false,
            "output_router_logits": false,
            "router_aux_loss_coef": self.router_aux_coef,
            "torch_dtype": "float32",
        })
    }

    /// The trainer's parameter names with their shapes, in its order (the weights only).
    pub fn trainer_parameters(&self) -> Vec<(String, Vec<u64>)> {
        let (h, f, e, v) = (
            self.d_model as u64,
            self.expert_ffn as u64,
            self.experts as u64,
            self.vocab_size as u64,
        );
        let mut out = vec![("embed".to_string(), vec![v, h])];
        for layer in 0..self.layers {
            let parts: [(&str, Vec<u64>); 12] = [
                ("attn_norm", vec![h]),
                ("wq", vec![h, h]),
                ("wk", vec![h, h]),
                ("wv", vec![h, h]),
                ("wo", vec![h, h]),
                ("q_norm", vec![h]),
                ("k_norm", vec![h]),
                ("ffn_norm", vec![h]),
                ("router", vec![h, e]),
                ("expert_gate", vec![e, h, f]),
                ("expert_up", vec![e, h, f]),
                ("expert_down", vec![e, f, h]),
            ];
            out.extend(
                parts
                    .into_iter()
                    .map(|(name, shape)| (format!("layers.{layer}.{name}"), shape)),
            );
        }
        out.push(("final_norm".to_string(), vec![h]));
        out.push(("lm_head".to_string(), vec![v, h]));
        out
    }

    /// A parameter's bytes as this trainer stores them, from a step stored with
    /// `stored_shape`: trainers before tensor parallelism stored every parameter flattened,
    /// and the LM head as `[d_model, vocab]`; it is transposed to `[vocab, d_model]`.
    pub fn current_layout(&self, name: &str, stored_shape: &[u64], data: Vec<u8>) -> Vec<u8> {
        if name == "lm_head" && stored_shape.len() == 1 {
            transpose(&data, self.d_model, self.vocab_size)
        } else {
            data
        }
    }

    /// The HF tensors for one trainer parameter (little-endian f32 bytes of `shape`):
    /// transposed to `[out, in]`, experts split one tensor per expert.
    pub fn to_hf(&self, name: &str, shape: &[u64], data: &[u8]) -> Result<Vec<HfTensor>, HfError> {
        let parts = self.hf_parts(name, shape)?;
        let elements: u64 = shape.iter().product();
        if data.len() as u64 != elements * 4 {
            return Err(HfError::Size {
                name: name.to_string(),
                bytes: data.len(),
                elements,
            });
        }
        Ok(parts
            .into_iter()
            .map(|(hf, hf_shape, part)| {
                let bytes = match part {
                    Part::AsIs => data.to_vec(),
                    Part::Transposed => transpose(data, shape[0] as usize, shape[1] as usize),
                    Part::Expert(expert) => {
                        let (rows, cols) = (shape[1] as usize, shape[2] as usize);
                        let each = rows * cols * 4;
                        transpose(&data[expert * each..(expert + 1) * each], rows, cols)
                    }
                };
                (hf, hf_shape, bytes)
            })
            .collect())
    }

    /// The names and shapes of the HF tensors [`ModelSpec::to_hf`] makes of a parameter of
    /// `shape`, in the same order, without its bytes (a file's header is written first).
    pub fn hf_tensors(
        &self,
        name: &str,
        shape: &[u64],
    ) -> Result<Vec<(String, Vec<u64>)>, HfError> {
        Ok(self
            .hf_parts(name, shape)?
            .into_iter()
            .map(|(hf, hf_shape, _)| (hf, hf_shape))
            .collect())
    }

    /// Each HF tensor of one trainer parameter of `shape`: its name, its shape and how its
    /// bytes are made from the parameter's.
    fn hf_parts(
        &self,
        name: &str,
        shape: &[u64],
    ) -> Result<Vec<(String, Vec<u64>, Part)>, HfError> {
        let expected = self
            .trainer_parameters()
            .into_iter()
            .find(|(n, _)| n == name)
            .map(|(_, s)| s);
        if let Some(expected) = &expected {
            if expected.as_slice() != shape {
                return Err(HfError::Shape {
                    name: name.to_string(),
                    expected: expected.clone(),
                    found: shape.to_vec(),
                });
            }
        }
        let as_is = |hf: String| vec![(hf, shape.to_vec(), Part::AsIs)];
        let transposed = |hf: String| vec![(hf, vec![shape[1], shape[0]], Part::Transposed)];
        let out = match name {
            "embed" => as_is("model.embed_tokens.weight".into()),
            "final_norm" => as_is("model.norm.weight".into()),
            "lm_head" => as_is("lm_head.weight".into()),
            _ => {
                let Some((layer, part)) = name
                    .strip_prefix("layers.")
                    .and_then(|rest| rest.split_once('.'))
                else {
                    return Ok(Vec::new());
                };
                let prefix = format!("model.layers.{layer}");
                match part {
                    "attn_norm" => as_is(format!("{prefix}.input_layernorm.weight")),
                    "ffn_norm" => as_is(format!("{prefix}.post_attention_layernorm.weight")),
                    "q_norm" | "k_norm" => as_is(format!("{prefix}.self_attn.{part}.weight")),
                    "wq" => transposed(format!("{prefix}.self_attn.q_proj.weight")),
                    "wk" => transposed(format!("{prefix}.self_attn.k_proj.weight")),
                    "wv" => transposed(format!("{prefix}.self_attn.v_proj.weight")),
                    "wo" => transposed(format!("{prefix}.self_attn.o_proj.weight")),
                    "router" => transposed(format!("{prefix}.mlp.gate.weight")),
                    "expert_gate" | "expert_up" | "expert_down" => {
                        let projection = &part["expert_".len()..];
                        (0..shape[0] as usize)
                            .map(|expert| {
                                (
                                    format!(
                                        "{prefix}.mlp.experts.{expert}.{projection}_proj.weight"
                                    ),
                                    vec![shape[2], shape[1]],
                                    Part::Expert(expert),
                                )
                            })
                            .collect()
                    }
                    _ => Vec::new(),
                }
            }
        };
        Ok(out)
    }
}

/// How an HF tensor's bytes are made from its trainer parameter's.
enum Part {
    AsIs,
    /// The `[rows, cols]` parameter transposed.
    Transposed,
    /// Expert `n` of an `[experts, rows, cols]` parameter, transposed.
    Expert(usize),
}

/// Transposes a row-major `rows x cols` matrix of 4-byte elements.
fn transpose(data: &[u8], rows: usize, cols: usize) -> Vec<u8> {
    let mut out = vec![0u8; data.len()];
    for r in 0..rows {
        for c in 0..cols {
            let (from, to) = ((r * cols + c) * 4, (c * rows + r) * 4);
            out[to..to + 4].copy_from_slice(&data[from..from + 4]);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec() -> ModelSpec {
        ModelSpec {
            vocab_size: 10,
            d_model: 4,
            layers: 1,
            heads: 2,
            experts: 2,
            top_k: 1,
            expert_ffn: 3,
            seq_len: 8,
            rope_theta: 10000.0,
            norm_eps: 1e-5,
            router_aux_coef: 0.01,
            router_z_coef: 0.001,
        }
    }

    fn floats(values: &[f32]) -> Vec<u8> {
        values.iter().flat_map(|v| v.to_le_bytes()).collect()
    }

    #[test]
    fn an_older_flattened_lm_head_is_read_as_vocab_rows() {
        let spec = spec();
        let (h, v) = (spec.d_model, spec.vocab_size);
        // [d_model, vocab], flattened: element (i, j) is i * vocab + j.
        let old: Vec<f32> = (0..h * v).map(|i| i as f32).collect();
        let now = spec.current_layout("lm_head", &[(h * v) as u64], floats(&old));
        // [vocab, d_model]: row 1 is column 1 of the old layout.
        let column: Vec<f32> = (0..h).map(|i| (i * v + 1) as f32).collect();
        assert_eq!(&now[4 * h..8 * h], &floats(&column)[..]);
        let kept = spec.current_layout("lm_head", &[v as u64, h as u64], floats(&old));
        assert_eq!(kept, floats(&old), "this version's layout is kept");
    }

    #[test]
    fn matrices_are_transposed_and_experts_split() {
        let spec = spec();
        // router [4, 2] -> gate [2, 4]
        let router: Vec<f32> = (0..8).map(|i| i as f32).collect();
        let out = spec
            .to_hf("layers.0.router", &[4, 2], &floats(&router))
            .unwrap();
        assert_eq!(out.len(), 1);
        assert_eq!(out[0].0, "model.layers.0.mlp.gate.weight");
        assert_eq!(out[0].1, vec![2, 4]);
        assert_eq!(out[0].2, floats(&[0.0, 2.0, 4.0, 6.0, 1.0, 3.0, 5.0, 7.0]));
        // expert_down [2, 3, 4] -> two [4, 3]
        let down: Vec<f32> = (0..24).map(|i| i as f32).collect();
        let out = spec
            .to_hf("layers.0.expert_down", &[2, 3, 4], &floats(&down))
            .unwrap();
        assert_eq!(out.len(), 2);
        assert_eq!(out[1].0, "model.layers.0.mlp.experts.1.down_proj.weight");
        assert_eq!(out[1].1, vec![4, 3]);
        // expert 1's [3, 4] block starts at 12; its transpose's first row is column 0.
        assert_eq!(&out[1].2[..12], &floats(&[12.0, 16.0, 20.0])[..]);
    }

    #[test]
    fn every_parameter_maps_and_moments_do_not() {
        let spec = spec();
        let mut names = Vec::new();
        for (name, shape) in spec.trainer_parameters() {
            let bytes = vec![0u8; shape.iter().product::<u64>() as usize * 4];
            let out = spec.to_hf(&name, &shape, &bytes).unwrap();
            assert!(!out.is_empty(), "{name} has no HF tensor");
            // What a header is written from, before the bytes: the same tensors, in order.
            let described: Vec<(String, Vec<u64>)> = out
                .iter()
                .map(|(n, s, b)| {
                    assert_eq!(b.len() as u64, s.iter().product::<u64>() * 4, "{n}");
                    (n.clone(), s.clone())
                })
                .collect();
            assert_eq!(spec.hf_tensors(&name, &shape).unwrap(), described);
            names.extend(out.into_iter().map(|(n, _, _)| n));
        }
        // 1 embed + per layer (2 norms, 4 projections, 2 qk norms, gate, 3 x 2 experts) + 2.
        assert_eq!(names.len(), 1 + 15 + 2);
        let unique: std::collections::BTreeSet<_> = names.iter().collect();
        assert_eq!(unique.len(), names.len());
        assert!(spec
            .to_hf("lm_head.exp_avg", &[4, 10], &[0u8; 160])
            .unwrap()
            .is_empty());
        assert!(matches!(
            spec.to_hf("lm_head", &[4, 10], &[0u8; 160]),
            Err(HfError::Shape { .. })
        ));
    }
}
