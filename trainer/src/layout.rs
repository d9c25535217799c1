//! The parallel layout: how `N` ranks split the model and the batch, and where each rank sits.
//!
//! Four sizes: tensor parallel `tp` (a layer's heads and vocabulary split inside a node),
//! pipeline parallel `pp` (the layers cut into stages), data parallel `dp = N / (tp * pp)`
//! (each data-parallel rank takes its own `train.micro_batch` samples), and expert parallel
//! `ep`, which divides `dp`: expert-parallel groups of `ep` data-parallel ranks split each
//! layer's experts, and the ranks at the same place of every group (the expert-data-parallel
//! group) hold the same experts.
//!
//! Ranks are numbered the Megatron way: `tp` fastest, then `dp` (with `ep` inside it), then
//! `pp`. So `rank = tp + tp_size * (dp + dp_size * pp)`: a tensor-parallel group is `tp`
//! consecutive ranks, which a launcher that fills nodes in order keeps on one node.

use std::ops::Range;

use crate::config::{ConfigError, ModelConfig, ParallelConfig};

/// The pipeline schedule.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Schedule {
    /// One forward, one backward: at most `pp` micro-batches in flight per stage.
    OneFOneB,
    /// 1F1B over `virtual_stages` model chunks per rank (Megatron's interleaved schedule).
    Interleaved,
}

/// The sizes of the four kinds of parallelism, checked against the model and the world.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Layout {
    pub tp: usize,
    pub pp: usize,
    pub dp: usize,
    pub ep: usize,
    /// Micro-batches per pipeline step: `train.micro_batch` is cut into this many pieces.
    pub micro_batches: usize,
    pub schedule: Schedule,
    /// Model chunks per pipeline rank (1 unless the schedule is interleaved).
    pub virtual_stages: usize,
    /// Layers per pipeline stage where they are not an equal share (`parallel.pipeline_layers`);
    /// empty for an equal share.
    pub pipeline_layers: Vec<usize>,
}

/// One rank's place in each dimension.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Coords {
    pub tp: usize,
    pub dp: usize,
    pub pp: usize,
    /// Place in the expert-parallel group (which share of the experts it holds).
    pub ep: usize,
    /// Which expert-parallel group (its index in the expert-data-parallel group).
    pub edp: usize,
}

/// A set of ranks that take part in one kind of collective together.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Dim {
    /// The ranks that split one layer's tensors (same dp and pp).
    Tensor,
    /// The ranks that hold the same weights and take different samples (same tp and pp).
    Data,
    /// The stages of one pipeline (same tp and dp).
    Pipeline,
    /// The ranks that split the experts (consecutive data-parallel ranks; same tp and pp).
    Expert,
    /// The ranks that hold the same experts (same tp, pp and expert-parallel place).
    ExpertData,
}

impl Layout {
    /// The layout of `ranks` processes, or the reasons it cannot train `model` with
    /// `micro_batch` samples per data-parallel rank.
    pub fn new(
        parallel: &ParallelConfig,
        model: &ModelConfig,
        micro_batch: usize,
        ranks: usize,
    ) -> Result<Self, ConfigError> {
        let ParallelConfig {
            tp,
            pp,
            ep,
            micro_batches,
            ..
        } = *parallel;
        let schedule = parallel.schedule()?;
        let virtual_stages = parallel.virtual_stages;
        let uneven = &parallel.pipeline_layers;
        if tp == 0 || pp == 0 || ep == 0 || micro_batches == 0 || virtual_stages == 0 {
            return Err(ConfigError::Invalid(
                "parallel.tp, pp, ep, micro_batches and virtual_stages must be at least 1".into(),
            ));
        }
        let mut problems = Vec::new();
        let mut require = |ok: bool, problem: String| {
            if !ok {
                problems.push(problem);
            }
        };
        let dp = ranks / (tp * pp);
        require(
            ranks.is_multiple_of(tp * pp),
            format!(
                "parallel.tp x parallel.pp = {tp} x {pp} must divide the number of ranks {ranks}"
            ),
        );
        require(
            dp.is_multiple_of(ep),
            format!("parallel.ep {ep} must divide the data-parallel size {dp} (ranks {ranks} / (tp {tp} x pp {pp}))"),
        );
        require(
            model.heads.is_multiple_of(tp),
            format!("parallel.tp {tp} must divide model.heads {}", model.heads),
        );
        require(
            model.vocab_size.is_multiple_of(tp),
            format!(
                "parallel.tp {tp} must divide model.vocab_size {} (the embedding and LM head are split by vocabulary)",
                model.vocab_size
            ),
        );
        require(
            model.experts.is_multiple_of(ep * tp),
            format!(
                "parallel.ep x parallel.tp = {ep} x {tp} must divide model.experts {} (each tensor-parallel rank holds whole experts)",
                model.experts
            ),
        );
        if uneven.is_empty() {
            require(
                model.layers.is_multiple_of(pp * virtual_stages),
                format!(
                    "parallel.pp x parallel.virtual_stages = {pp} x {virtual_stages} must divide model.layers {} (or parallel.pipeline_layers give each stage's layers)",
                    model.layers
                ),
            );
        } else {
            require(
                uneven.len() == pp,
                format!(
                    "parallel.pipeline_layers {uneven:?} gives {} stages their layers, but parallel.pp is {pp}",
                    uneven.len()
                ),
            );
            require(
                uneven.iter().all(|layers| *layers > 0),
                format!(
                    "parallel.pipeline_layers {uneven:?} must give every stage at least one layer"
                ),
            );
            let sum: usize = uneven.iter().sum();
            require(
                sum == model.layers,
                format!(
                    "parallel.pipeline_layers {uneven:?} sums to {sum} layers, but model.layers is {}",
                    model.layers
                ),
            );
            require(
                virtual_stages == 1,
                format!("parallel.pipeline_layers cannot be given with parallel.virtual_stages {virtual_stages}"),
            );
        }
        require(
            micro_batch.is_multiple_of(micro_batches),
            format!("parallel.micro_batches {micro_batches} must divide train.micro_batch {micro_batch}"),
        );
        require(
            schedule == Schedule::Interleaved || virtual_stages == 1,
            format!("parallel.virtual_stages {virtual_stages} needs parallel.schedule = \"interleaved\""),
        );
        require(
            schedule != Schedule::Interleaved || micro_batches % pp == 0,
            format!("the interleaved schedule needs parallel.micro_batches {micro_batches} to be a multiple of parallel.pp {pp}"),
        );
        if !problems.is_empty() {
            return Err(ConfigError::Invalid(problems.join("; ")));
        }
        Ok(Self {
            tp,
            pp,
            dp,
            ep,
            micro_batches,
            schedule,
            virtual_stages,
            // A split that is the equal one is recorded as such.
            pipeline_layers: if uneven.iter().all(|layers| *layers == model.layers / pp) {
                Vec::new()
            } else {
                uneven.clone()
            },
        })
    }

    /// `ranks` data-parallel ranks and nothing else split.
    pub fn data_parallel(ranks: usize) -> Self {
        Self {
            tp: 1,
            pp: 1,
            dp: ranks,
            ep: 1,
            micro_batches: 1,
            schedule: Schedule::OneFOneB,
            virtual_stages: 1,
            pipeline_layers: Vec::new(),
        }
    }

    /// This layout if this trainer can run it: every layout but the interleaved schedule,
    /// which is refused with the reason.
    pub fn built(self) -> Result<Self, ConfigError> {
        if self.schedule == Schedule::Interleaved {
            return Err(ConfigError::Invalid(format!(
                "{}: the interleaved pipeline schedule is not built yet; use parallel.schedule = \"1f1b\"",
                self.describe()
            )));
        }
        Ok(self)
    }

    pub fn ranks(&self) -> usize {
        self.tp * self.dp * self.pp
    }

    pub fn coords(&self, rank: usize) -> Coords {
        assert!(rank < self.ranks(), "rank {rank} of {}", self.ranks());
        let dp = (rank / self.tp) % self.dp;
        Coords {
            tp: rank % self.tp,
            dp,
            pp: rank / (self.tp * self.dp),
            ep: dp % self.ep,
            edp: dp / self.ep,
        }
    }

    /// The rank at `tp`, `dp`, `pp`.
    pub fn rank(&self, tp: usize, dp: usize, pp: usize) -> usize {
        tp + self.tp * (dp + self.dp * pp)
    }

    /// The ranks of `rank`'s group in `dim`, in order of their place in it (a collective's
    /// fixed order).
    pub fn group(&self, rank: usize, dim: Dim) -> Vec<usize> {
        let at = self.coords(rank);
        match dim {
            Dim::Tensor => (0..self.tp).map(|t| self.rank(t, at.dp, at.pp)).collect(),
            Dim::Data => (0..self.dp).map(|d| self.rank(at.tp, d, at.pp)).collect(),
            Dim::Pipeline => (0..self.pp).map(|p| self.rank(at.tp, at.dp, p)).collect(),
            Dim::Expert => (0..self.ep)
                .map(|e| self.rank(at.tp, at.edp * self.ep + e, at.pp))
                .collect(),
            Dim::ExpertData => (0..self.dp / self.ep)
                .map(|g| self.rank(at.tp, g * self.ep + at.ep, at.pp))
                .collect(),
        }
    }

    /// Which place of `dim` the rank holds, and how many places there are.
    pub fn place(&self, rank: usize, dim: Dim) -> (usize, usize) {
        let at = self.coords(rank);
        match dim {
            Dim::Tensor => (at.tp, self.tp),
            Dim::Data => (at.dp, self.dp),
            Dim::Pipeline => (at.pp, self.pp),
            Dim::Expert => (at.ep, self.ep),
            Dim::ExpertData => (at.edp, self.dp / self.ep),
        }
    }

    /// The layers pipeline stage `stage` runs, for a model of `layers` layers (one model
    /// chunk per stage; the interleaved schedule's chunks are `virtual_chunk_layers`): an
    /// equal share, or the stage's `parallel.pipeline_layers`.
    pub fn stage_layers(&self, layers: usize, stage: usize) -> Range<usize> {
        if self.pipeline_layers.is_empty() {
            let per_stage = layers / self.pp;
            return stage * per_stage..(stage + 1) * per_stage;
        }
        debug_assert_eq!(self.pipeline_layers.iter().sum::<usize>(), layers);
        let start = self.pipeline_layers[..stage].iter().sum();
        start..start + self.pipeline_layers[stage]
    }

    /// The layers of model chunk `chunk` (`0..virtual_stages`) of pipeline stage `stage`:
    /// chunk `c` of stage `s` is the `(c * pp + s)`-th slice of `layers / (pp * virtual)`.
    pub fn virtual_chunk_layers(&self, layers: usize, stage: usize, chunk: usize) -> Range<usize> {
        let per_chunk = layers / (self.pp * self.virtual_stages);
        let index = chunk * self.pp + stage;
        index * per_chunk..(index + 1) * per_chunk
    }

    /// The idle share of a pipeline step that the schedule cannot avoid:
    /// `(pp - 1) / (micro_batches * virtual_stages + pp - 1)` (1F1B when `virtual_stages` is 1).
    pub fn bubble_fraction(&self) -> f64 {
        let idle = (self.pp - 1) as f64;
        idle / ((self.micro_batches * self.virtual_stages) as f64 + idle)
    }

    /// The layout as a checkpoint records it (`trainer.json`).
    pub fn written(&self) -> lazarus_shared::progress::WrittenLayout {
        lazarus_shared::progress::WrittenLayout {
            describe: self.describe(),
            tp: self.tp,
            pp: self.pp,
            dp: self.dp,
            ep: self.ep,
            micro_batches: self.micro_batches,
            pipeline_layers: self.pipeline_layers.clone(),
            ranks: (0..self.ranks())
                .map(|rank| {
                    let at = self.coords(rank);
                    [at.tp, at.pp, at.dp, at.ep]
                })
                .collect(),
        }
    }

    /// One line: `tp 2 x pp 2 x dp 2 (ep 2), 4 micro-batches, 1f1b`, and `, layers per stage
    /// [3, 1]` where the stages' layers are not an equal share.
    pub fn describe(&self) -> String {
        let schedule = match self.schedule {
            Schedule::OneFOneB => "1f1b".to_string(),
            Schedule::Interleaved => format!("interleaved x{}", self.virtual_stages),
        };
        let micro = if self.micro_batches == 1 {
            "1 micro-batch".to_string()
        } else {
            format!("{} micro-batches", self.micro_batches)
        };
        let layers = if self.pipeline_layers.is_empty() {
            String::new()
        } else {
            format!(", layers per stage {:?}", self.pipeline_layers)
        };
        format!(
            "tp {} x pp {} x dp {} (ep {}), {micro}, {schedule}{layers}",
            self.tp, self.pp, self.dp, self.ep
        )
    }
}

/// Bytes one rank holds, by kind.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct RankBytes {
    pub weights: f64,
    pub gradients: f64,
    /// The sharded optimizer's state (fp32 master weight and two moments, 12 bytes per
    /// element it owns).
    pub optimizer: f64,
}

impl RankBytes {
    /// What the layout predicts for the rank at `at` (fp32 throughout), from the model's
    /// shapes alone: the embedding on the first stage and the LM head and final norm on the
    /// last, each split by vocabulary over tp; a stage's layers with their projections split
    /// over tp, the norms and router whole; `experts / (ep * tp)` whole experts per rank; and
    /// ZeRO-1 sharding of dense state over the data-parallel group and of expert state over
    /// the expert-data-parallel group.
    pub fn predict(model: &ModelConfig, layout: &Layout, at: Coords) -> Self {
        let (v, d, f) = (
            model.vocab_size as f64,
            model.d_model as f64,
            model.expert_ffn as f64,
        );
        let tp = layout.tp as f64;
        let layers = layout.stage_layers(model.layers, at.pp).len() as f64;
        let mut dense =
            layers * (4.0 * d * d / tp + 2.0 * d / tp + 2.0 * d + d * model.experts as f64);
        if at.pp == 0 {
            dense += v * d / tp;
        }
        if at.pp + 1 == layout.pp {
            dense += v * d / tp + d;
        }
        let local_experts = (model.experts / (layout.ep * layout.tp)) as f64;
        let experts = layers * local_experts * 3.0 * d * f;
        let weights = 4.0 * (dense + experts);
        let edp = (layout.dp / layout.ep) as f64;
        Self {
            weights,
            gradients: weights,
            optimizer: 12.0 * (dense / layout.dp as f64 + experts / edp),
        }
    }
}

/// The activations the rank at `at` holds at most for its backward passes, in bytes (fp32),
/// with `micro_batch` samples per data-parallel rank and step: what the forward pass keeps
/// per token of each of its layers, times its tokens, its layers and the micro-batches in
/// flight at once (`min(pp - stage, micro_batches)` under 1F1B), plus the first stage's
/// embedding, the last stage's head and every stage's received input. Expert rows assume
/// balanced routing. Counted from what the ops keep (floats per token and layer, `t` = tp):
///
/// - attention: the input norm (d), Q, K, V and QK-norm outputs (5 d/t), the attention
///   output (d/t) and its saved state (rotated q and k, 2 d/t, and the softmax rows, heads/t
///   x seq), the output projection (d) and the residual sum (d);
/// - MoE: the norm (d), router logits, softmax and z-loss pieces (6 E), the routed rows
///   (k d/t), SwiGLU's output and its saved gate and up projections (3 k f/t), the down
///   projection (k d/t), gate weights (k/t), weighted rows
///   (k d/t), the scatter's zeros and result (2 d) and the residual sum (d); with expert
///   parallel, the rows that arrived from other ranks, which the dispatch keeps for its
///   backward pass (k d/t);
/// - with tp > 1, the copies entering and leaving each split part (4 d + E);
/// - the last stage's fused head keeps its gradients from the forward pass: the hidden rows'
///   (d per token) and the LM head's (vocab/t x d per micro-batch).
///
/// Left out: a step's last micro-batch cut at its layers for the overlapped gradient
/// reduction holds one more copy of the residual stream per layer but the first (d per token
/// and layer, about 1% of the `tiny` total).
pub fn predicted_activation_bytes(
    model: &ModelConfig,
    layout: &Layout,
    at: Coords,
    micro_batch: usize,
) -> f64 {
    let (d, e, f, k) = (
        model.d_model as f64,
        model.experts as f64,
        model.expert_ffn as f64,
        model.top_k as f64,
    );
    let t = layout.tp as f64;
    let split = if layout.tp > 1 { 1.0 } else { 0.0 };
    let expert_parallel = if layout.ep > 1 { 1.0 } else { 0.0 };
    let heads = model.heads as f64;
    let seq = model.seq_len as f64;
    let attention = 3.0 * d + 8.0 * d / t + heads / t * seq;
    let moe = 4.0 * d + 6.0 * e + k * d / t * (3.0 + expert_parallel) + 3.0 * k * f / t + k / t;
    let per_token_layer = attention + moe + split * (4.0 * d + e);
    let layers = layout.stage_layers(model.layers, at.pp).len() as f64;
    let tokens = (micro_batch / layout.micro_batches * model.seq_len) as f64;
    let mut per_micro_batch = tokens * layers * per_token_layer;
    // Every stage's input: the embedding's rows, or the activations received.
    per_micro_batch += tokens * d * (1.0 + 2.0 * split);
    if at.pp + 1 == layout.pp {
        per_micro_batch += tokens * (2.0 * d + split * d + 3.0) + model.vocab_size as f64 / t * d;
    }
    let in_flight = (layout.pp - at.pp).min(layout.micro_batches) as f64;
    4.0 * in_flight * per_micro_batch
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;
    use crate::config::Config;

    fn layout(sets: &[&str], ranks: usize) -> Result<Layout, ConfigError> {
        let sets: Vec<String> = sets.iter().map(|s| s.to_string()).collect();
        let config = Config::load("tiny", &sets)?;
        Layout::new(
            &config.parallel,
            &config.model,
            config.train.micro_batch,
            ranks,
        )
    }

    #[test]
    fn ranks_are_ordered_tp_then_dp_then_pp() {
        let l = layout(&["parallel.tp=2", "parallel.pp=2", "parallel.ep=2"], 8).unwrap();
        assert_eq!((l.tp, l.pp, l.dp, l.ep), (2, 2, 2, 2));
        let all: Vec<(usize, usize, usize)> = (0..8)
            .map(|r| {
                let c = l.coords(r);
                (c.tp, c.dp, c.pp)
            })
            .collect();
        assert_eq!(
            all,
            [
                (0, 0, 0),
                (1, 0, 0),
                (0, 1, 0),
                (1, 1, 0),
                (0, 0, 1),
                (1, 0, 1),
                (0, 1, 1),
                (1, 1, 1)
            ]
        );
        for r in 0..8 {
            let c = l.coords(r);
            assert_eq!(l.rank(c.tp, c.dp, c.pp), r);
        }
        assert_eq!(l.group(5, Dim::Tensor), [4, 5]);
        assert_eq!(l.group(5, Dim::Data), [5, 7]);
        assert_eq!(l.group(5, Dim::Pipeline), [1, 5]);
        assert_eq!(l.group(5, Dim::Expert), [5, 7]);
        assert_eq!(l.group(5, Dim::ExpertData), [5]);
    }

    #[test]
    fn every_group_partitions_the_world_and_places_match_positions() {
        for (sets, ranks) in [
            (vec!["parallel.tp=2"], 2),
            (vec!["parallel.pp=2", "parallel.micro_batches=4"], 2),
            (vec!["parallel.tp=2", "parallel.pp=2"], 4),
            (vec!["parallel.pp=2", "parallel.ep=2"], 8),
            (vec!["parallel.tp=2", "parallel.ep=2"], 8),
            (vec!["parallel.ep=2"], 8),
        ] {
            let l = layout(&sets, ranks).unwrap();
            for dim in [
                Dim::Tensor,
                Dim::Data,
                Dim::Pipeline,
                Dim::Expert,
                Dim::ExpertData,
            ] {
                let mut seen = vec![0; ranks];
                for rank in 0..ranks {
                    let group = l.group(rank, dim);
                    let (place, size) = l.place(rank, dim);
                    assert_eq!(group.len(), size, "{sets:?} {dim:?}");
                    assert_eq!(group[place], rank, "{sets:?} {dim:?}");
                    for member in &group {
                        assert_eq!(l.group(*member, dim), group, "{sets:?} {dim:?}");
                    }
                    seen[group[0]] += usize::from(group[0] == rank);
                }
                let groups = seen.iter().filter(|&&n| n == 1).count();
                assert_eq!(groups * l.group(0, dim).len(), ranks, "{sets:?} {dim:?}");
            }
        }
    }

    #[test]
    fn a_layout_that_does_not_fit_says_why() {
        for (sets, ranks, says) in [
            (
                vec!["parallel.tp=2"],
                3,
                "must divide the number of ranks 3",
            ),
            (vec!["parallel.tp=3"], 3, "must divide model.heads 4"),
            (vec!["parallel.pp=3"], 3, "must divide model.layers 4"),
            (
                vec!["parallel.ep=2"],
                3,
                "must divide the data-parallel size 3",
            ),
            (
                vec!["parallel.micro_batches=3"],
                1,
                "must divide train.micro_batch 8",
            ),
            (
                vec!["parallel.tp=8", "parallel.ep=2"],
                16,
                "must divide model.experts 8",
            ),
            (
                vec!["parallel.virtual_stages=2"],
                1,
                "needs parallel.schedule",
            ),
            (vec!["parallel.tp=0"], 1, "at least 1"),
            (vec!["parallel.schedule=\"gpipe\""], 1, "parallel.schedule"),
            (
                vec!["parallel.pp=2", "parallel.pipeline_layers=[4]"],
                2,
                "parallel.pipeline_layers [4] gives 1 stages their layers, but parallel.pp is 2",
            ),
            (
                vec!["parallel.pp=2", "parallel.pipeline_layers=[4, 0]"],
                2,
                "parallel.pipeline_layers [4, 0] must give every stage at least one layer",
            ),
            (
                vec!["parallel.pp=2", "parallel.pipeline_layers=[2, 3]"],
                2,
                "parallel.pipeline_layers [2, 3] sums to 5 layers, but model.layers is 4",
            ),
            (
                vec![
                    "parallel.pp=2",
                    "parallel.pipeline_layers=[3, 1]",
                    "parallel.schedule=\"interleaved\"",
                    "parallel.virtual_stages=2",
                    "parallel.micro_batches=2",
                ],
                2,
                "cannot be given with parallel.virtual_stages 2",
            ),
        ] {
            let error = layout(&sets, ranks).unwrap_err().to_string();
            assert!(error.contains(says), "{sets:?} on {ranks}: {error}");
        }
    }

    #[test]
    fn one_process_holds_every_parameter_and_data_parallel_shards_only_the_optimizer() {
        let config = Config::load("tiny", &[]).unwrap();
        let m = &config.model;
        let parameters = (2 * m.vocab_size * m.d_model
            + m.layers
                * (4 * m.d_model * m.d_model
                    + 4 * m.d_model
                    + m.d_model * m.experts
                    + 3 * m.experts * m.d_model * m.expert_ffn)
            + m.d_model) as f64;
        let one = Layout::data_parallel(1);
        let alone = RankBytes::predict(m, &one, one.coords(0));
        assert_eq!(alone.weights, 4.0 * parameters);
        assert_eq!(alone.optimizer, 12.0 * parameters);
        let four = layout(&["parallel.ep=2"], 4).unwrap();
        let shared = RankBytes::predict(m, &four, four.coords(3));
        assert_eq!(shared.optimizer, alone.optimizer / 4.0);
        assert!(shared.weights < alone.weights);
    }

    #[test]
    fn stages_split_the_layers_and_the_bubble_follows_the_formula() {
        let l = layout(&["parallel.pp=2", "parallel.micro_batches=4"], 2).unwrap();
        assert_eq!(l.stage_layers(4, 0), 0..2);
        assert_eq!(l.stage_layers(4, 1), 2..4);
        assert!((l.bubble_fraction() - 1.0 / 5.0).abs() < 1e-12);
        let l = layout(
            &[
                "parallel.pp=2",
                "parallel.micro_batches=4",
                "parallel.schedule=\"interleaved\"",
                "parallel.virtual_stages=2",
            ],
            2,
        )
        .unwrap();
        assert_eq!(l.virtual_chunk_layers(4, 0, 0), 0..1);
        assert_eq!(l.virtual_chunk_layers(4, 1, 0), 1..2);
        assert_eq!(l.virtual_chunk_layers(4, 0, 1), 2..3);
        assert_eq!(l.virtual_chunk_layers(4, 1, 1), 3..4);
        assert!((l.bubble_fraction() - 1.0 / 9.0).abs() < 1e-12);
    }

    /// `parallel.pipeline_layers` gives each stage its run of layers, in order, and the
    /// layout names it; a split that is the equal one is the layout without it.
    #[test]
    fn stages_take_the_layers_they_are_given() {
        let sets = ["parallel.pp=2", "parallel.pipeline_layers=[3, 1]"];
        let l = layout(&sets, 4).unwrap();
        assert_eq!(l.stage_layers(4, 0), 0..3);
        assert_eq!(l.stage_layers(4, 1), 3..4);
        assert_eq!(
            l.describe(),
            "tp 1 x pp 2 x dp 2 (ep 1), 1 micro-batch, 1f1b, layers per stage [3, 1]"
        );
        assert_eq!(l.written().pipeline_layers, vec![3, 1]);
        let l = layout(&["parallel.pp=3", "parallel.pipeline_layers=[1, 2, 1]"], 3).unwrap();
        let runs: Vec<Range<usize>> = (0..3).map(|stage| l.stage_layers(4, stage)).collect();
        assert_eq!(runs, [0..1, 1..3, 3..4]);

        let equal = layout(&["parallel.pp=2", "parallel.pipeline_layers=[2, 2]"], 2).unwrap();
        assert_eq!(equal, layout(&["parallel.pp=2"], 2).unwrap());
        assert!(equal.written().pipeline_layers.is_empty());
    }

    /// What a stage is predicted to hold follows its layers: the stage with three of `tiny`'s
    /// four layers holds three layers' weights and activations where an equal split's holds two.
    #[test]
    fn predictions_count_the_layers_a_stage_holds() {
        let config = Config::load("tiny", &[]).unwrap();
        let m = &config.model;
        let equal = layout(&["parallel.pp=2"], 2).unwrap();
        let uneven = layout(&["parallel.pp=2", "parallel.pipeline_layers=[3, 1]"], 2).unwrap();
        let first = |l: &Layout| RankBytes::predict(m, l, l.coords(0)).weights;
        let last = |l: &Layout| RankBytes::predict(m, l, l.coords(1)).weights;
        // One layer's weights, from the equal split's two.
        let layer = (first(&uneven) - first(&equal)).abs();
        assert!(layer > 0.0);
        assert!((first(&equal) - first(&uneven) + layer).abs() < 1.0);
        assert!((last(&equal) - last(&uneven) - layer).abs() < 1.0);
        let activations = |l: &Layout, rank| {
            predicted_activation_bytes(m, l, l.coords(rank), config.train.micro_batch)
        };
        assert!(activations(&uneven, 0) > activations(&equal, 0));
        assert!(activations(&uneven, 1) < activations(&equal, 1));
    }
}
