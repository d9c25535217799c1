//! `trainer.json`: the progress a trainer checkpoint continues from, and the parallel layout
//! that wrote it (which `ckptctl show` prints).

use serde::{Deserialize, Serialize};

/// The blob's name in a checkpoint.
pub const TRAINER_BLOB: &str = "trainer.json";

/// What a trainer checkpoint stores besides its tensors.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TrainerProgress {
    /// The last step trained.
    pub step: u64,
    /// Training samples consumed (the data position).
    pub samples_seen: u64,
    /// Optimizer updates applied (AdamW's bias-correction step).
    pub optimizer_step: u64,
    /// The layout of the ranks that wrote the step; absent in checkpoints written before it
    /// was recorded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub layout: Option<WrittenLayout>,
    /// Data windows skipped so far, oldest first: a resume keeps the data position they
    /// moved, and this says why it differs from the step count.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub skipped: Vec<SkippedData>,
    /// The losses of the last steps, oldest first, for the health check's spike rule.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub recent_losses: Vec<f64>,
    /// Each layer's routing bias, by expert (`train.router_bias_rate`): added to the router's
    /// probabilities where each token's experts are chosen, not to their weights. Empty where
    /// no bias was ever applied.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub router_bias: Vec<Vec<f32>>,
}

/// `batches` global batches skipped right after `after_step` (a rollback past bad data, or
/// an operator's `--skip-batches`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SkippedData {
    pub after_step: u64,
    pub batches: u64,
}

/// A parallel layout as a checkpoint records it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct WrittenLayout {
    /// One line, e.g. `tp 2 x pp 2 x dp 1 (ep 1), 2 micro-batches, 1f1b`.
    pub describe: String,
    pub tp: usize,
    pub pp: usize,
    pub dp: usize,
    pub ep: usize,
    pub micro_batches: usize,
    /// Layers per pipeline stage where they are not an equal share; empty where they are.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub pipeline_layers: Vec<usize>,
    /// Each rank's place, by rank: `[tp, pp, dp, ep]`.
    pub ranks: Vec<[usize; 4]>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_checkpoint_from_before_the_layout_was_recorded_still_reads() {
        let old: TrainerProgress =
            serde_json::from_str(r#"{"step":200,"samples_seen":1600,"optimizer_step":200}"#)
                .unwrap();
        assert_eq!(old.layout, None);
        assert_eq!(
            serde_json::to_string(&old).unwrap(),
            r#"{"step":200,"samples_seen":1600,"optimizer_step":200}"#
        );
        let new = TrainerProgress {
            layout: Some(WrittenLayout {
                describe: "tp 2 x pp 1 x dp 1 (ep 1), 1 micro-batch, 1f1b".into(),
                tp: 2,
                pp: 1,
                dp: 1,
                ep: 1,
                micro_batches: 1,
                pipeline_layers: Vec::new(),
                ranks: vec![[0, 0, 0, 0], [1, 0, 0, 0]],
            }),
            skipped: vec![SkippedData {
                after_step: 150,
                batches: 20,
            }],
            recent_losses: vec![4.25, 4.125],
            // Values JSON must carry exactly: a resume routes with the same bias.
            router_bias: vec![
                vec![1e-3, -2.5e-3, f32::MIN_POSITIVE, 0.1 + 0.2],
                vec![0.0; 4],
            ],
            ..old
        };
        let text = serde_json::to_string(&new).unwrap();
        assert_eq!(serde_json::from_str::<TrainerProgress>(&text).unwrap(), new);
    }
}
