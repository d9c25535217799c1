//! The OLMoE-style decoder: token embedding, pre-norm blocks of causal attention (RoPE, QK-norm
//! over the full projected q and k) and a dropless MoE feed-forward (softmax router over all
//! experts, top-k without renormalising the kept weights, SwiGLU experts stacked per layer),
//! a final norm and an untied LM head. One expert with top-1 is the dense variant.
//! The model may be split over a tensor-parallel group (see [`Place::split`]) and into
//! pipeline stages (see [`crate::layout::Layout::stage_layers`], [`Model::stage_forward`]).
//!
//! Only ops that have a backward are used: candle-nn's fused RMSNorm, softmax and rope have
//! none and would silently cut the gradient. RMSNorm ([`crate::norm`]), attention with RoPE
//! ([`crate::attention`]) and the LM head with its loss ([`crate::loss`]) are custom ops with
//! their own backward; the router's softmax is composed of candle primitives.
//! Matrices are stored `[in, out]` so a projection is `x.matmul(w)`; the embedding and the LM
//! head are `[vocab, d_model]`, a row per token.

use std::ops::Range;
use std::sync::Arc;

use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Result, Tensor, Var, D};
use rand::SeedableRng;
use rand_distr::{Distribution, Normal};

use crate::attention::CausalAttention;
use crate::config::ModelConfig;
use crate::dist::{Group, World};
use crate::embedding::Lookup;
use crate::expert_parallel::{DispatchSwiGlu, DownCombine, Route};
use crate::experts::{GroupedMatmul, Groups, SwiGlu, WeightedRows};
use crate::handed::HandedGradients;
use crate::loss::LinearCrossEntropy;
use crate::norm::RmsNorm;
use crate::tensor_parallel::{Enter, Leave};

/// Standard deviation of the initial weights (OLMoE's `initializer_range`).
const INIT_STD: f64 = 0.02;

#[derive(Debug)]
pub struct Layer {
    pub attn_norm: Var,
    pub wq: Var,
    pub wk: Var,
    pub wv: Var,
    pub wo: Var,
    pub q_norm: Var,
    pub k_norm: Var,
    pub ffn_norm: Var,
    /// `[d_model, experts]`
    pub router: Var,
    /// `[experts, d_model, expert_ffn]`
    pub expert_gate: Var,
    /// `[experts, d_model, expert_ffn]`
    pub expert_up: Var,
    /// `[experts, expert_ffn, d_model]`
    pub expert_down: Var,
}

#[derive(Debug)]
pub struct Model {
    pub config: ModelConfig,
    pub device: Device,
    pub dtype: DType,
    /// The ranks training this model together, when there are several: the router's
    /// load-balancing shares are then summed over them.
    pub world: Option<Arc<World>>,
    /// Which part of each parameter this rank holds.
    pub place: Place,
    /// The first stage's token embedding.
    pub embed: Option<Var>,
    /// This stage's layers, from layer `first_layer` of the model.
    pub layers: Vec<Layer>,
    pub first_layer: usize,
    /// The last stage's final norm and LM head.
    pub final_norm: Option<Var>,
    pub lm_head: Option<Var>,
    /// Where the ops behind the LM head, the embedding and the experts leave their weights'
    /// gradients ([`Model::backward`]).
    pub handed: HandedGradients,
    /// Every layer's routing bias by expert, whole-model layer indices (empty: none). Set
    /// with [`Model::set_router_bias`]; see [`update_router_bias`].
    router_bias: std::sync::RwLock<Vec<Vec<f32>>>,
}

/// Which part of the model a rank holds: its place in the tensor-parallel group (`tp_rank`
/// of `tp`), in the expert-parallel group (`ep_rank` of `ep`) and in the pipeline (stage
/// `stage` of `pp`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Place {
    pub tp: usize,
    pub tp_rank: usize,
    pub ep: usize,
    pub ep_rank: usize,
    pub pp: usize,
    pub stage: usize,
}

/// How a parameter is cut over the ranks: along dimension `dim` into `parts` equal blocks, of
/// which a rank holds block `index`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Split {
    pub dim: usize,
    pub parts: usize,
    pub index: usize,
}

impl Place {
    /// The whole model: one process.
    pub const WHOLE: Place = Place {
        tp: 1,
        tp_rank: 0,
        ep: 1,
        ep_rank: 0,
        pp: 1,
        stage: 0,
    };

    /// The first pipeline stage embeds the tokens.
    pub fn first_stage(&self) -> bool {
        self.stage == 0
    }

    /// The last pipeline stage holds the final norm and the LM head and computes the loss.
    pub fn last_stage(&self) -> bool {
        self.stage + 1 == self.pp
    }

    /// How the parameter `name` is cut, or `None` for a parameter every rank of a
    /// tensor-parallel group holds whole (norms before a split part, the router).
    ///
    /// Tensor parallel (Megatron): the embedding and the LM head by vocabulary, Q, K and V by
    /// output columns (heads) with their QK-norm weights, the output projection by input rows.
    /// Experts stay whole: the `ep * tp` ranks of an expert-parallel group's tensor-parallel
    /// groups each hold `experts / (ep * tp)` of them, block `ep_rank * tp + tp_rank`.
    pub fn split(&self, name: &str) -> Option<Split> {
        let by_tp = |dim| Split {
            dim,
            parts: self.tp,
            index: self.tp_rank,
        };
        match name.rsplit('.').next().unwrap_or(name) {
            "embed" | "lm_head" | "wo" | "q_norm" | "k_norm" => Some(by_tp(0)),
            "wq" | "wk" | "wv" => Some(by_tp(1)),
            "expert_gate" | "expert_up" | "expert_down" => Some(Split {
                dim: 0,
                parts: self.ep * self.tp,
                index: self.ep_rank * self.tp + self.tp_rank,
            }),
            _ => None,
        }
    }

    /// Whether every rank of the tensor-parallel group holds `name` whole (the same values):
    /// only the group's first rank stores it and counts it in the gradient norm.
    pub fn replicated_over_tp(&self, name: &str) -> bool {
        self.tp > 1 && self.split(name).is_none()
    }
}

/// What one forward pass (of a stage, or of the whole model) reports besides the loss to
/// differentiate.
#[derive(Debug)]
pub struct Forward {
    /// cross-entropy + aux_coef * load-balancing + z_coef * router z-loss (of this stage's
    /// layers; the cross-entropy on the last stage only).
    pub loss: Tensor,
    pub cross_entropy: f64,
    pub load_balancing: f64,
    pub router_z: f64,
    /// Tokens routed to each expert, per layer of this stage (top-k assignments).
    pub expert_load: Vec<Vec<u64>>,
    /// A stage before the last: its output, for the next stage.
    pub hidden: Option<Tensor>,
    /// With [`Model::stage_forward_cut`], the stage's layers one by one, bottom to top, each
    /// differentiable on its own: the backward pass can hand each layer's gradients on (to a
    /// reduce-scatter) before the layers below it have run. Empty otherwise.
    pub segments: Vec<Segment>,
}

/// One layer of a forward pass cut apart ([`Model::stage_forward_cut`]): the backward pass of
/// the whole is `objective`'s, plus `<output, gradient of the next segment's input>` where a
/// segment above was cut from this one, segment by segment from the top.
#[derive(Debug)]
pub struct Segment {
    /// The layer (absolute index). The bottom segment of the first stage holds the embedding
    /// as well, the top segment of the last stage the final norm and the LM head.
    pub layer: usize,
    /// This segment's part of the loss: its layer's share of the router losses, and on the
    /// top segment of the last stage the cross-entropy.
    pub objective: Tensor,
    /// The input, cut from the segment below: the variable whose gradient flows down.
    pub input: Option<Var>,
    /// The output, where the segment above was cut from it.
    pub output: Option<Tensor>,
}

/// What a stage's blocks return: their output and each layer's router figures.
struct Body {
    hidden: Tensor,
    load_balancing: Vec<Tensor>,
    router_z: Vec<Tensor>,
    expert_load: Vec<Vec<u64>>,
    /// Where the layers were cut apart (see [`Segment`]): before each layer but the first,
    /// the output of the layers below and the next layer's input, a copy of it as a variable.
    cuts: Vec<(Tensor, Var)>,
}

/// What one MoE block returns.
struct MoeOutput {
    output: Tensor,
    load_balancing: Tensor,
    router_z: Tensor,
    /// Tokens routed to each expert (top-k assignments).
    load: Vec<u64>,
}

/// A deterministic parameter: normal(0, std) from its own seed, or all ones for norms.
fn parameter(
    shape: &[usize],
    init: Option<f64>,
    seed: u64,
    dtype: DType,
    device: &Device,
) -> Result<Var> {
    let count: usize = shape.iter().product();
    let mut samples = init.map(|std| {
        let normal = Normal::new(0.0, std).expect("a positive standard deviation");
        let rng = rand::rngs::StdRng::seed_from_u64(seed);
        normal.sample_iter(rng)
    });
    let mut sample = move || samples.as_mut().map_or(1.0, |s| s.next().expect("endless"));
    // Drawn in f64 and rounded to the parameter's type one value at a time: the same values
    // as an f64 tensor converted whole, without a transient f64 copy of the model.
    let values = match dtype {
        DType::F32 => {
            Tensor::from_vec((0..count).map(|_| sample() as f32).collect(), shape, device)?
        }
        _ => Tensor::from_vec((0..count).map(|_| sample()).collect(), shape, device)?
            .to_dtype(dtype)?,
    };
    Var::from_tensor(&values)
}

/// RMSNorm over the last dimension (an op with its own backward).
fn rms_norm(x: &Tensor, weight: &Tensor, eps: f64) -> Result<Tensor> {
    x.contiguous()?.apply_op2(weight, RmsNorm::new(eps))
}

/// Softmax over the last dimension, composed of differentiable ops. The max is detached:
/// softmax does not change under a shift, and this keeps ties from splitting the gradient.
fn softmax_last(x: &Tensor) -> Result<Tensor> {
    let max = x.max_keepdim(D::Minus1)?.detach();
    let exp = x.broadcast_sub(&max)?.exp()?;
    exp.broadcast_div(&exp.sum_keepdim(D::Minus1)?)
}

/// log-sum-exp over the last dimension, keeping it.
pub(crate) fn log_sum_exp(x: &Tensor) -> Result<Tensor> {
    let max = x.max_keepdim(D::Minus1)?.detach();
    x.broadcast_sub(&max)?
        .exp()?
        .sum_keepdim(D::Minus1)?
        .log()?
        .broadcast_add(&max)
}

/// Training FLOPs per token (forward + backward = 3x forward): 6 per active weight (attention
/// projections, router, the top-k experts' SwiGLU, LM head) plus the attention scores and mix
/// (`12 * layers * seq * d_model`). The embedding lookup does no arithmetic.
pub fn training_flops_per_token(config: &ModelConfig) -> f64 {
    let (h, f) = (config.d_model as f64, config.expert_ffn as f64);
    let per_layer = 4.0 * h * h + h * config.experts as f64 + config.top_k as f64 * 3.0 * h * f;
    let weights = config.layers as f64 * per_layer + h * config.vocab_size as f64;
    6.0 * weights + 12.0 * config.layers as f64 * config.seq_len as f64 * h
}

impl Model {
    /// A freshly initialised model. Every parameter has its own seed derived from `seed`, so
    /// initialisation does not depend on construction order.
    pub fn new(config: &ModelConfig, seed: u64, dtype: DType) -> Result<Self> {
        Self::part(config, seed, dtype, Place::WHOLE, 0..config.layers)
    }

    /// The part of the model that `world`'s rank holds, trained together with the other ranks
    /// of `world`. Its values are those of the whole model's at the same places.
    pub fn part_of(
        config: &ModelConfig,
        seed: u64,
        dtype: DType,
        world: Arc<World>,
    ) -> Result<Self> {
        let at = world.coords();
        let place = Place {
            tp: world.layout.tp,
            tp_rank: at.tp,
            ep: world.layout.ep,
            ep_rank: at.ep,
            pp: world.layout.pp,
            stage: at.pp,
        };
        let stage = world.layout.stage_layers(config.layers, at.pp);
        let mut model = Self::part(config, seed, dtype, place, stage)?;
        model.world = Some(world);
        Ok(model)
    }

    /// The part `place` of a freshly initialised model, whose stage runs the layers `stage`:
    /// each parameter is made whole from its own seed, then cut, so that every layout starts
    /// from the same weights. Parameters of other stages are not made (their seeds are
    /// skipped).
    fn part(
        config: &ModelConfig,
        seed: u64,
        dtype: DType,
        place: Place,
        stage: Range<usize>,
    ) -> Result<Self> {
        let device = Device::Cpu;
        let (h, f, e, v) = (
            config.d_model,
            config.expert_ffn,
            config.experts,
            config.vocab_size,
        );
        let mut next_seed = seed.wrapping_mul(1_000_003);
        // `held`: whether this stage holds the parameter; an empty stand-in where not.
        let mut make = |name: &str, shape: &[usize], init: Option<f64>, held: bool| {
            next_seed = next_seed.wrapping_add(1);
            if !held {
                return Var::zeros(0, dtype, &device);
            }
            let whole = parameter(shape, init, next_seed, dtype, &device)?;
            match place.split(name) {
                Some(split) if split.parts > 1 => {
                    let len = shape[split.dim] / split.parts;
                    let part = whole.narrow(split.dim, split.index * len, len)?;
                    Var::from_tensor(&part.contiguous()?)
                }
                _ => Ok(whole),
            }
        };
        let (first, last) = (place.first_stage(), place.last_stage());
        let embed = make("embed", &[v, h], Some(INIT_STD), first)?;
        let mut layers = Vec::with_capacity(stage.len());
        for index in 0..config.layers {
            let held = stage.contains(&index);
            let mut make = |name: &str, shape: &[usize], init| make(name, shape, init, held);
            let layer = Layer {
                attn_norm: make("attn_norm", &[h], None)?,
                wq: make("wq", &[h, h], Some(INIT_STD))?,
                wk: make("wk", &[h, h], Some(INIT_STD))?,
                wv: make("wv", &[h, h], Some(INIT_STD))?,
                wo: make("wo", &[h, h], Some(INIT_STD))?,
                q_norm: make("q_norm", &[h], None)?,
                k_norm: make("k_norm", &[h], None)?,
                ffn_norm: make("ffn_norm", &[h], None)?,
                router: make("router", &[h, e], Some(INIT_STD))?,
                expert_gate: make("expert_gate", &[e, h, f], Some(INIT_STD))?,
                expert_up: make("expert_up", &[e, h, f], Some(INIT_STD))?,
                expert_down: make("expert_down", &[e, f, h], Some(INIT_STD))?,
            };
            if held {
                layers.push(layer);
            }
        }
        let final_norm = make("final_norm", &[h], None, last)?;
        let lm_head = make("lm_head", &[v, h], Some(INIT_STD), last)?;
        Ok(Self {
            config: config.clone(),
            device,
            dtype,
            world: None,
            place,
            embed: first.then_some(embed),
            layers,
            first_layer: stage.start,
            final_norm: last.then_some(final_norm),
            lm_head: last.then_some(lm_head),
            handed: HandedGradients::default(),
            router_bias: Default::default(),
        })
    }

    /// Routes with `bias` from now on: `bias[layer][expert]` over the whole model's layers
    /// (empty: no bias).
    pub fn set_router_bias(&self, bias: &[Vec<f32>]) {
        *self.router_bias.write().expect("not poisoned") = bias.to_vec();
    }

    /// Every parameter this rank holds with its name (layers by their index in the whole
    /// model), in a fixed order (optimizer and checkpoint layout).
    pub fn parameters(&self) -> Vec<(String, &Var)> {
        let mut named: Vec<(String, &Var)> = self
            .embed
            .iter()
            .map(|embed| ("embed".to_string(), embed))
            .collect();
        for (index, layer) in (self.first_layer..).zip(&self.layers) {
            let parts = [
                ("attn_norm", &layer.attn_norm),
                ("wq", &layer.wq),
                ("wk", &layer.wk),
                ("wv", &layer.wv),
                ("wo", &layer.wo),
                ("q_norm", &layer.q_norm),
                ("k_norm", &layer.k_norm),
                ("ffn_norm", &layer.ffn_norm),
                ("router", &layer.router),
                ("expert_gate", &layer.expert_gate),
                ("expert_up", &layer.expert_up),
                ("expert_down", &layer.expert_down),
            ];
            named.extend(
                parts
                    .into_iter()
                    .map(|(name, var)| (format!("layers.{index}.{name}"), var)),
            );
        }
        named.extend(
            (self.final_norm.iter().map(|v| ("final_norm", v)))
                .chain(self.lm_head.iter().map(|v| ("lm_head", v)))
                .map(|(name, var)| (name.to_string(), var)),
        );
        named
    }

    /// The training forward pass of a whole model over `batch` sequences of `seq_len + 1`
    /// tokens (inputs and shifted targets). The LM head's gradients are computed here already
    /// (see [`LinearCrossEntropy::training`]), so call `backward` on the returned loss.
    pub fn forward(&self, tokens: &[u32], batch: usize) -> Result<Forward> {
        self.stage_forward(tokens, batch, None, true)
    }

    /// The gradients of `objective`, a loss of this model's forward pass (or a part of one),
    /// the custom ops' weights' included: call this, not `objective.backward()`.
    pub fn backward(&self, objective: &Tensor) -> Result<GradStore> {
        self.handed.backward(objective)
    }

    /// The loss alone, for validation: no gradient work.
    pub fn evaluate(&self, tokens: &[u32], batch: usize) -> Result<Forward> {
        self.stage_forward(tokens, batch, None, false)
    }

    /// This rank's pipeline stage over `batch` sequences of `seq_len + 1` tokens: the first
    /// stage embeds the inputs, the others take `hidden` (`[batch * seq, d_model]`) from the
    /// stage before; the stage's layers run; the last stage applies the final norm, the LM
    /// head and the loss, the others return their output in [`Forward::hidden`]. The loss is
    /// this stage's part: the cross-entropy on the last stage, and on every stage its layers'
    /// share of the router losses. Over one stage, the whole model's loss.
    pub fn stage_forward(
        &self,
        tokens: &[u32],
        batch: usize,
        hidden: Option<&Tensor>,
        training: bool,
    ) -> Result<Forward> {
        self.stage_forward_cut(tokens, batch, hidden, training, false)
    }

    /// [`Model::stage_forward`], cut apart at every layer when `cut` (see [`Segment`]): the
    /// same values; each cut holds one more copy of the residual stream.
    pub fn stage_forward_cut(
        &self,
        tokens: &[u32],
        batch: usize,
        hidden: Option<&Tensor>,
        training: bool,
        cut: bool,
    ) -> Result<Forward> {
        let c = &self.config;
        let seq = tokens.len() / batch - 1;
        assert_eq!(
            tokens.len(),
            batch * (seq + 1),
            "tokens must hold batch x (seq + 1)"
        );
        let x = match (&self.embed, hidden) {
            (Some(_), None) => {
                let inputs: Vec<u32> = tokens
                    .chunks(seq + 1)
                    .flat_map(|row| row[..seq].to_vec())
                    .collect();
                let _embed = tracing::info_span!("embed").entered();
                self.embed_tokens(&inputs)?
            }
            (None, Some(hidden)) => hidden.clone(),
            _ => candle_core::bail!(
                "stage {} of {}: the first stage embeds tokens, the others take the previous stage's output",
                self.place.stage,
                self.place.pp
            ),
        };
        let Body {
            hidden: x,
            load_balancing: layer_balancing,
            router_z: layer_z,
            expert_load,
            cuts,
        } = self.body(x, batch, seq, cut)?;
        let layers = c.layers as f64;
        // Each layer's share of the router losses, for the layers in `range`.
        let router_share = |range: Range<usize>| -> Result<Tensor> {
            let balancing =
                (Tensor::stack(&layer_balancing[range.clone()], 0)?.sum_all()? / layers)?;
            let z = (Tensor::stack(&layer_z[range], 0)?.sum_all()? / layers)?;
            (balancing * c.router_aux_coef)? + (z * c.router_z_coef)?
        };
        let mut segments = Vec::with_capacity(cuts.len() + 1);
        if cut {
            let mut inputs = std::iter::once(None).chain(cuts.iter().map(|(_, v)| Some(v.clone())));
            let mut outputs = cuts
                .iter()
                .map(|(o, _)| Some(o.clone()))
                .chain(std::iter::once(None));
            for (index, layer) in (self.first_layer..).take(layer_balancing.len()).enumerate() {
                segments.push(Segment {
                    layer,
                    objective: router_share(index..index + 1)?,
                    input: inputs.next().flatten(),
                    output: outputs.next().flatten(),
                });
            }
        }
        let load_balancing = (Tensor::stack(&layer_balancing, 0)?.sum_all()? / layers)?;
        let router_z = (Tensor::stack(&layer_z, 0)?.sum_all()? / layers)?;
        let router_losses = |loss: Tensor| -> Result<Tensor> {
            (loss + (&load_balancing * c.router_aux_coef)?)? + (&router_z * c.router_z_coef)?
        };
        let scalar = |t: &Tensor| -> Result<f64> { t.to_dtype(DType::F64)?.to_scalar::<f64>() };
        let (Some(final_norm), Some(lm_head)) = (&self.final_norm, &self.lm_head) else {
            return Ok(Forward {
                loss: router_losses(load_balancing.zeros_like()?)?,
                cross_entropy: 0.0,
                load_balancing: scalar(&load_balancing)?,
                router_z: scalar(&router_z)?,
                expert_load,
                hidden: Some(x),
                segments,
            });
        };
        let x = rms_norm(&x, final_norm, c.norm_eps)?;
        let targets: Vec<u32> = tokens
            .chunks(seq + 1)
            .flat_map(|row| row[1..].to_vec())
            .collect();
        let targets = Tensor::from_vec(targets, batch * seq, &self.device)?;
        // Fused head + loss: the [tokens, vocab] logits never exist whole.
        let mut head = if training {
            LinearCrossEntropy::training()
        } else {
            LinearCrossEntropy::default()
        };
        if let Some(world) = self.tensor_group() {
            let share = self.config.vocab_size / self.place.tp;
            head = head.split(world.clone(), self.place.tp_rank * share);
        }
        let cross_entropy = self
            .enter(&x)?
            .apply_op3(lm_head, &targets, self.handed.wrap(head))?
            .mean_all()?;
        if let Some(top) = segments.last_mut() {
            top.objective = (&cross_entropy + &top.objective)?;
        }
        Ok(Forward {
            cross_entropy: scalar(&cross_entropy)?,
            load_balancing: scalar(&load_balancing)?,
            router_z: scalar(&router_z)?,
            loss: router_losses(cross_entropy)?,
            expert_load,
            hidden: None,
            segments,
        })
    }

    /// The logits `[batch * seq, vocab]` for `batch` sequences of `tokens.len() / batch`
    /// tokens: inference and interop checks (training never materialises them).
    pub fn logits(&self, tokens: &[u32], batch: usize) -> Result<Tensor> {
        let seq = tokens.len() / batch;
        assert_eq!(tokens.len(), batch * seq, "tokens must hold batch x seq");
        let (Some(_), Some(final_norm), Some(lm_head)) =
            (&self.embed, &self.final_norm, &self.lm_head)
        else {
            candle_core::bail!("logits: this rank holds one pipeline stage only");
        };
        if self.place.tp > 1 {
            candle_core::bail!("logits: this rank holds a share of the vocabulary only");
        }
        let x = self
            .body(self.embed_tokens(tokens)?, batch, seq, false)?
            .hidden;
        rms_norm(&x, final_norm, self.config.norm_eps)?.matmul(&lm_head.t()?)
    }

    /// This stage's blocks over the hidden states of `batch * seq` tokens.
    fn body(&self, mut x: Tensor, batch: usize, seq: usize, cut: bool) -> Result<Body> {
        let c = &self.config;
        let (h, heads) = (c.d_model, c.heads);
        let head_dim = h / heads;
        // This rank's heads: all of them, or its tensor-parallel share.
        let local_heads = heads / self.place.tp;
        let mut load_balancing = Vec::new();
        let mut router_z = Vec::new();
        let mut expert_load = Vec::new();
        // QK-norm normalises over the whole projection, whose heads may be split.
        let qk_norm = |x: &Tensor, weight: &Tensor| -> Result<Tensor> {
            let op = match self.tensor_group() {
                Some(world) => RmsNorm::split(c.norm_eps, world.clone()),
                None => RmsNorm::new(c.norm_eps),
            };
            x.contiguous()?.apply_op2(weight, op)
        };
        let mut cuts = Vec::new();
        for (index, layer) in self.layers.iter().enumerate() {
            if cut && index > 0 {
                let input = Var::from_tensor(&x.detach())?;
                let below = std::mem::replace(&mut x, input.as_tensor().clone());
                cuts.push((below, input));
            }
            // Attention: column-parallel Q, K, V (this rank's heads), row-parallel output.
            let _layer = tracing::info_span!("layer").entered();
            let normed = self.enter(&rms_norm(&x, &layer.attn_norm, c.norm_eps)?)?;
            let projecting = tracing::info_span!("qkv_projection").entered();
            let q = qk_norm(&normed.matmul(&layer.wq)?, &layer.q_norm)?;
            let k = qk_norm(&normed.matmul(&layer.wk)?, &layer.k_norm)?;
            let v = normed.matmul(&layer.wv)?;
            drop(projecting);
            let mixed = q.apply_op3(
                &k,
                &v,
                CausalAttention::new(batch, seq, local_heads, head_dim, c.rope_theta),
            )?;
            let projecting = tracing::info_span!("out_projection").entered();
            x = (x + self.leave(&mixed.matmul(&layer.wo)?)?)?;
            drop(projecting);
            // Mixture of experts.
            let normed = rms_norm(&x, &layer.ffn_norm, c.norm_eps)?;
            let moe = {
                let _moe = tracing::info_span!("moe").entered();
                self.moe(self.first_layer + index, layer, &normed)?
            };
            x = (x + moe.output)?;
            load_balancing.push(moe.load_balancing);
            router_z.push(moe.router_z);
            expert_load.push(moe.load);
        }
        Ok(Body {
            hidden: x,
            load_balancing,
            router_z,
            expert_load,
            cuts,
        })
    }

    /// The tensor-parallel group's world, when the model is split over one.
    fn tensor_group(&self) -> Option<&Arc<World>> {
        self.world.as_ref().filter(|world| world.layout.tp > 1)
    }

    /// Enters a tensor-parallel split part: identity forward, gradients summed over the group.
    fn enter(&self, x: &Tensor) -> Result<Tensor> {
        match self.tensor_group() {
            Some(world) => x.contiguous()?.apply_op1(Enter(world.clone())),
            None => Ok(x.clone()),
        }
    }

    /// Leaves a tensor-parallel split part: the group's partial results summed.
    fn leave(&self, x: &Tensor) -> Result<Tensor> {
        match self.tensor_group() {
            Some(world) => x.contiguous()?.apply_op1(Leave(world.clone())),
            None => Ok(x.clone()),
        }
    }

    /// The input tokens' embeddings. Vocabulary-parallel: each rank looks up the tokens of
    /// its share (zeros for the others) and the group sums them, which is exact.
    fn embed_tokens(&self, inputs: &[u32]) -> Result<Tensor> {
        let Some(embed) = &self.embed else {
            candle_core::bail!("only the first pipeline stage holds the embedding");
        };
        if self.tensor_group().is_none() {
            return embed.apply_op1(self.handed.wrap(Lookup::new(inputs)));
        }
        let share = embed.dim(0)?;
        let start = (self.place.tp_rank * share) as u32;
        let mine = |token: &u32| token.checked_sub(start).filter(|t| (*t as usize) < share);
        let rows: Vec<u32> = inputs.iter().map(|t| mine(t).unwrap_or(0)).collect();
        let keep: Vec<f32> = inputs
            .iter()
            .map(|t| f32::from(u8::from(mine(t).is_some())))
            .collect();
        let keep = Tensor::from_vec(keep, (inputs.len(), 1), &self.device)?.to_dtype(self.dtype)?;
        let looked_up = embed
            .index_select(&Tensor::new(rows.as_slice(), &self.device)?, 0)?
            .broadcast_mul(&keep)?;
        self.leave(&looked_up)
    }

    /// Expert parallelism: `sorted` holds this rank's routed rows in global expert order,
    /// which is destination-rank order; `sent[i]` rows for the `i`-th expert this rank's
    /// tensor-parallel place runs (`local` experts on each rank of the expert-parallel group).
    /// They travel to the ranks that hold their experts, run through the local experts, and
    /// come back in the same order, each exchange pipelined with the experts' compute
    /// (`expert_parallel.rs`). Gradients travel both exchanges in reverse.
    fn remote_experts(
        &self,
        layer: &Layer,
        world: &Arc<World>,
        sorted: &Tensor,
        sent: &[usize],
        local: usize,
    ) -> Result<Tensor> {
        // received[src * local + e]: rows rank src sends for local expert e.
        let received = world.all_to_all_usize(Group::Expert, sent, local);
        let route = Arc::new(Route::new(
            world.clone(),
            self.config.d_model,
            local,
            sent.to_vec(),
            received,
        ));
        sorted
            .contiguous()?
            .apply_op3(
                &layer.expert_gate,
                &layer.expert_up,
                self.handed.wrap(DispatchSwiGlu::new(route.clone())),
            )?
            .apply_op2(&layer.expert_down, self.handed.wrap(DownCombine(route)))
    }

    /// The dropless MoE block of layer `index` (of the whole model) on `x: [tokens, d_model]`.
    fn moe(&self, index: usize, layer: &Layer, x: &Tensor) -> Result<MoeOutput> {
        let (experts, top_k) = (self.config.experts, self.config.top_k);
        let tokens = x.dim(0)?;
        let routing = tracing::info_span!("router").entered();
        let logits = x.matmul(&layer.router)?;
        let probs = softmax_last(&logits)?;
        // Routing decisions need no gradient: pick the top-k on the host (ties to the lower
        // index), by probability plus the layer's bias, if any.
        let host: Vec<Vec<f64>> = probs.to_dtype(DType::F64)?.to_vec2()?;
        let bias = self.router_bias.read().expect("not poisoned");
        let routed = route_top_k(&host, bias.get(index).map(Vec::as_slice), top_k);
        drop(bias);
        // The experts this rank's tensor-parallel place runs, in global order: expert `e` is
        // in block `e / per_rank`, held by the block's tensor-parallel place `block % tp` at
        // place `block / tp` of the expert-parallel group.
        let place = self.place;
        let per_rank = experts / (place.ep * place.tp);
        let runs: Vec<usize> = (0..experts)
            .filter(|e| (e / per_rank) % place.tp == place.tp_rank)
            .collect();
        // Rows sorted by expert: each expert's SwiGLU runs on its own rows of one tensor.
        let order: Vec<u32> = runs
            .iter()
            .flat_map(|e| routed[*e].iter().copied())
            .collect();
        let positions: Vec<u32> = runs
            .iter()
            .flat_map(|expert| {
                routed[*expert]
                    .iter()
                    .map(move |t| t * experts as u32 + *expert as u32)
            })
            .collect();
        let counts: Vec<usize> = runs.iter().map(|e| routed[*e].len()).collect();
        let order = Tensor::new(order.as_slice(), &self.device)?;
        let sorted = self.enter(x)?.index_select(&order, 0)?;
        drop(routing);
        let computing = tracing::info_span!("experts").entered();
        let expert_out = match &self.world {
            Some(world) if world.layout.ep > 1 => {
                self.remote_experts(layer, world, &sorted, &counts, per_rank)?
            }
            _ => {
                let groups = Groups::from_counts(&counts);
                sorted
                    .apply_op3(
                        &layer.expert_gate,
                        &layer.expert_up,
                        self.handed.wrap(SwiGlu::new(groups.clone())),
                    )?
                    .apply_op2(&layer.expert_down, self.handed.wrap(GroupedMatmul(groups)))?
            }
        };
        drop(computing);
        let _weighting = tracing::info_span!("expert_weighting").entered();
        // The kept probabilities enter the split part too: each rank's gradient for them
        // covers its own experts' rows, and the group sums them.
        let weights = self
            .enter(&probs)?
            .flatten_all()?
            .index_select(&Tensor::new(positions.as_slice(), &self.device)?, 0)?;
        let result = expert_out.apply_op2(&weights, WeightedRows)?;
        let out = self.leave(&x.zeros_like()?.index_add(&order, &result, 0)?)?;
        // Load balancing (Switch/Mixtral): experts x sum_e (share of assignments) x (mean prob).
        // The shares are global: every rank routes its own tokens over all experts, and the
        // load-balancing loss of the whole batch needs every rank's counts.
        let local: Vec<u64> = routed.iter().map(|r| r.len() as u64).collect();
        let (load, ranks) = match &self.world {
            Some(world) if world.layout.dp > 1 => {
                (world.sum_u64(Group::Data, &local), world.layout.dp)
            }
            _ => (local, 1),
        };
        let share: Vec<f64> = load
            .iter()
            .map(|n| *n as f64 / (tokens * ranks * top_k) as f64)
            .collect();
        let share = Tensor::from_vec(share, experts, &self.device)?.to_dtype(self.dtype)?;
        let mean_prob = probs.mean(0)?;
        let balance = ((share * mean_prob)?.sum_all()? * experts as f64)?;
        let z = log_sum_exp(&logits)?.sqr()?.mean_all()?;
        Ok(MoeOutput {
            output: out,
            load_balancing: balance,
            router_z: z,
            load,
        })
    }
}

/// Each expert's tokens: every token (a row of `probs`) goes to the `top_k` experts of the
/// highest probability plus `bias` (ties to the lower index).
fn route_top_k(probs: &[Vec<f64>], bias: Option<&[f32]>, top_k: usize) -> Vec<Vec<u32>> {
    let experts = probs.first().map_or(0, Vec::len);
    let mut routed: Vec<Vec<u32>> = vec![Vec::new(); experts];
    let mut scores = vec![0.0; experts];
    for (token, row) in probs.iter().enumerate() {
        scores.copy_from_slice(row);
        if let Some(bias) = bias {
            for (score, b) in scores.iter_mut().zip(bias) {
                *score += f64::from(*b);
            }
        }
        let mut order: Vec<usize> = (0..experts).collect();
        order.sort_by(|a, b| scores[*b].total_cmp(&scores[*a]).then(a.cmp(b)));
        for expert in &order[..top_k] {
            routed[*expert].push(token as u32);
        }
    }
    routed
}

/// One step of load balancing without a loss (DeepSeek-V3's expert bias): `load[layer][e]`,
/// the tokens each layer's experts took this step over the whole world, moves each expert's
/// bias by `rate` toward its mean share (down where it took more, up where it took less).
/// `bias` starts at zero where it is empty. Every rank sees the same loads, so every rank
/// holds the same bias.
pub fn update_router_bias(bias: &mut Vec<Vec<f32>>, load: &[Vec<u64>], rate: f64) {
    if bias.is_empty() {
        *bias = load.iter().map(|layer| vec![0.0; layer.len()]).collect();
    }
    let rate = rate as f32;
    for (layer, load) in bias.iter_mut().zip(load) {
        let total: u64 = load.iter().sum();
        let experts = load.len() as u64;
        for (b, n) in layer.iter_mut().zip(load) {
            // Compared in integers: n against total / experts, exactly.
            match (n * experts).cmp(&total) {
                std::cmp::Ordering::Greater => *b -= rate,
                std::cmp::Ordering::Less => *b += rate,
                std::cmp::Ordering::Equal => {}
            }
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    pub(crate) fn small_config(experts: usize, top_k: usize) -> ModelConfig {
        ModelConfig {
            vocab_size: 40,
            d_model: 16,
            layers: 2,
            heads: 2,
            experts,
            top_k,
            expert_ffn: 12,
            seq_len: 6,
            rope_theta: 10000.0,
            norm_eps: 1e-5,
            router_aux_coef: 0.01,
            router_z_coef: 0.001,
        }
    }

    fn tokens(batch: usize, seq: usize, vocab: u32) -> Vec<u32> {
        (0..batch * (seq + 1))
            .map(|i| (i as u32 * 7 + 3) % vocab)
            .collect()
    }

    #[test]
    fn every_parameter_gets_a_finite_nonzero_gradient() {
        for (experts, top_k) in [(4, 2), (1, 1)] {
            let config = small_config(experts, top_k);
            let model = Model::new(&config, 3, DType::F32).unwrap();
            let out = model.forward(&tokens(3, config.seq_len, 40), 3).unwrap();
            assert!(
                out.cross_entropy.is_finite() && (out.cross_entropy - (40f64).ln()).abs() < 0.5,
                "{}",
                out.cross_entropy
            );
            let grads = model.backward(&out.loss).unwrap();
            for (name, var) in model.parameters() {
                let grad = grads
                    .get(var)
                    .unwrap_or_else(|| panic!("{name} got no gradient ({experts} experts)"));
                let values: Vec<f32> = grad.flatten_all().unwrap().to_vec1().unwrap();
                assert!(
                    values.iter().all(|v| v.is_finite()),
                    "{name}: non-finite gradient"
                );
                assert!(
                    values.iter().any(|v| *v != 0.0),
                    "{name}: all-zero gradient ({experts} experts)"
                );
            }
        }
    }

    #[test]
    fn gradients_match_finite_differences_for_every_parameter_kind() {
        // f64 so that central differences are accurate; top-2 of 4 experts.
        let config = small_config(4, 2);
        let model = Model::new(&config, 5, DType::F64).unwrap();
        let batch_tokens = tokens(2, config.seq_len, 40);
        let grads = model
            .backward(&model.forward(&batch_tokens, 2).unwrap().loss)
            .unwrap();
        let loss_at = |model: &Model| {
            model
                .forward(&batch_tokens, 2)
                .unwrap()
                .loss
                .to_scalar::<f64>()
                .unwrap()
        };
        let step = 1e-6;
        for (name, var) in model.parameters() {
            if name.starts_with("layers.1") {
                continue; // layer 0 covers every kind; keep the test fast
            }
            let analytic: Vec<f64> = grads
                .get(var)
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1()
                .unwrap();
            let original: Vec<f64> = var.flatten_all().unwrap().to_vec1().unwrap();
            // The element with the largest gradient, and one more.
            let mut picks = vec![
                analytic
                    .iter()
                    .enumerate()
                    .max_by(|a, b| a.1.abs().total_cmp(&b.1.abs()))
                    .unwrap()
                    .0,
            ];
            picks.push((picks[0] + original.len() / 2) % original.len());
            for index in picks {
                let mut shifted = original.clone();
                shifted[index] += step;
                var.set(&Tensor::from_vec(shifted.clone(), var.shape(), &Device::Cpu).unwrap())
                    .unwrap();
                let plus = loss_at(&model);
                shifted[index] -= 2.0 * step;
                var.set(&Tensor::from_vec(shifted, var.shape(), &Device::Cpu).unwrap())
                    .unwrap();
                let minus = loss_at(&model);
                var.set(&Tensor::from_vec(original.clone(), var.shape(), &Device::Cpu).unwrap())
                    .unwrap();
                let numeric = (plus - minus) / (2.0 * step);
                // Central differences of a loss near 4 in f64 carry about 1e-9 of rounding:
                // gradients below 1e-5 are compared at that scale.
                let error = (numeric - analytic[index]).abs()
                    / numeric.abs().max(analytic[index].abs()).max(1e-5);
                assert!(error < 1e-4, "{name}[{index}]: analytic {} vs numeric {numeric} (relative error {error:.2e})", analytic[index]);
            }
        }
    }

    #[test]
    fn the_same_seed_gives_the_same_model_and_loss() {
        let config = small_config(4, 2);
        let batch_tokens = tokens(2, config.seq_len, 40);
        let a = Model::new(&config, 9, DType::F32)
            .unwrap()
            .forward(&batch_tokens, 2)
            .unwrap();
        let b = Model::new(&config, 9, DType::F32)
            .unwrap()
            .forward(&batch_tokens, 2)
            .unwrap();
        assert_eq!(a.cross_entropy.to_bits(), b.cross_entropy.to_bits());
        assert_eq!(a.expert_load, b.expert_load);
        let c = Model::new(&config, 10, DType::F32)
            .unwrap()
            .forward(&batch_tokens, 2)
            .unwrap();
        assert_ne!(a.cross_entropy.to_bits(), c.cross_entropy.to_bits());
    }

    #[test]
    fn a_bias_moves_tokens_to_other_experts() {
        let probs = vec![vec![0.5, 0.3, 0.2], vec![0.1, 0.2, 0.7]];
        assert_eq!(route_top_k(&probs, None, 1), [vec![0], vec![], vec![1]]);
        let bias = [-0.25f32, 0.0, 0.0];
        assert_eq!(
            route_top_k(&probs, Some(&bias), 1),
            [vec![], vec![0], vec![1]]
        );
        // Through the model: a bias no probability can outweigh keeps every layer's tokens
        // away from expert 0, and the loss still comes out finite.
        let config = small_config(4, 2);
        let model = Model::new(&config, 3, DType::F32).unwrap();
        let batch_tokens = tokens(2, config.seq_len, config.vocab_size as u32);
        let plain = model.forward(&batch_tokens, 2).unwrap();
        assert!(plain.expert_load.iter().all(|layer| layer[0] > 0));
        model.set_router_bias(&[vec![-2.0, 0.0, 0.0, 0.0], vec![-2.0, 0.0, 0.0, 0.0]]);
        let biased = model.forward(&batch_tokens, 2).unwrap();
        for (layer, load) in biased.expert_load.iter().enumerate() {
            assert_eq!(load[0], 0, "layer {layer}: {load:?}");
            assert_eq!(
                load.iter().sum::<u64>(),
                plain.expert_load[layer].iter().sum::<u64>()
            );
        }
        assert!(biased.cross_entropy.is_finite());
    }

    #[test]
    fn the_bias_moves_each_expert_toward_its_mean_share() {
        let mut bias = Vec::new();
        // 12 tokens over 3 experts: a mean of 4.
        update_router_bias(&mut bias, &[vec![6, 4, 2], vec![4, 4, 4]], 0.5);
        assert_eq!(bias, [vec![-0.5, 0.0, 0.5], vec![0.0, 0.0, 0.0]]);
        update_router_bias(&mut bias, &[vec![1, 5, 6], vec![0, 12, 0]], 0.25);
        assert_eq!(bias, [vec![-0.25, -0.25, 0.25], vec![0.25, -0.25, 0.25]]);
    }

    /// Routing with fixed, skewed probabilities (a router that prefers some experts), the
    /// bias's updates even out the experts' loads within a hundred steps.
    #[test]
    fn the_bias_evens_out_a_skewed_router() {
        use rand::{Rng, SeedableRng};
        let (experts, top_k, tokens) = (8, 2, 512);
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        let batch = |rng: &mut rand::rngs::StdRng| -> Vec<Vec<f64>> {
            (0..tokens)
                .map(|_| {
                    let logits: Vec<f64> = (0..experts)
                        .map(|e| 0.3 * e as f64 + rng.random_range(-1.0..1.0))
                        .collect();
                    let total: f64 = logits.iter().map(|l| l.exp()).sum();
                    logits.iter().map(|l| l.exp() / total).collect()
                })
                .collect()
        };
        let imbalance = |routed: &[Vec<u32>]| -> f64 {
            let most = routed.iter().map(Vec::len).max().unwrap() as f64;
            most / (tokens * top_k / experts) as f64
        };
        let mut bias = Vec::new();
        let mut last = Vec::new();
        for _ in 0..120 {
            let probs = batch(&mut rng);
            let routed = route_top_k(&probs, bias.first().map(Vec::as_slice), top_k);
            last.push((
                imbalance(&route_top_k(&probs, None, top_k)),
                imbalance(&routed),
            ));
            let load: Vec<u64> = routed.iter().map(|r| r.len() as u64).collect();
            update_router_bias(&mut bias, &[load], 0.003);
        }
        // Over the last 20 steps, the mean of each step's busiest expert against the mean load.
        let (plain, biased) = last[100..]
            .iter()
            .fold((0.0, 0.0), |(p, b), (x, y)| (p + x / 20.0, b + y / 20.0));
        assert!(plain > 2.5, "the router is skewed: {plain}");
        assert!(
            biased < 1.3,
            "busiest expert at {biased}x the mean (unbiased {plain}x)"
        );
    }
}
