//! The tiny preset learns real English: after a short run its validation loss is clearly
//! below what token frequencies alone would score. (Its own module so that, in name order,
//! it starts among the first tests rather than last and alone.)

use lazarus_tests::train::{prepared, TrainerArgs};

use crate::trainer::trainer;

/// The entropy (nats) of the token distribution of a prepared split: what a model that knows
/// only token frequencies would score.
fn unigram_entropy(tokens_file: &std::path::Path) -> f64 {
    let bytes = std::fs::read(tokens_file).unwrap();
    let mut counts = std::collections::HashMap::<u16, u64>::new();
    for pair in bytes.chunks_exact(2) {
        *counts
            .entry(u16::from_le_bytes([pair[0], pair[1]]))
            .or_default() += 1;
    }
    let total = (bytes.len() / 2) as f64;
    counts
        .values()
        .map(|c| {
            let p = *c as f64 / total;
            -p * p.ln()
        })
        .sum()
}

#[test]
fn the_tiny_preset_learns_below_the_unigram_entropy() {
    let (dir, _) = prepared();
    let data = dir.path().join("data");
    let entropy = unigram_entropy(&data.join("train.tokens"));
    let metrics = dir.path().join("metrics");
    let steps = 60;
    let args = TrainerArgs::new("tiny")
        .metrics(&metrics)
        .steps(steps)
        .set("train.val_every", 20)
        .set("checkpoint.every", 1000)
        .store(&format!("file://{}", dir.path().join("store").display()))
        .data(&data)
        .build();
    let (code, said) = trainer(&args);
    assert_eq!(code, 0, "{said}");
    let text = std::fs::read_to_string(metrics.join("tiny").join("metrics.jsonl")).unwrap();
    let validation: Vec<(u64, f64)> = text
        .lines()
        .filter_map(|line| {
            let value: serde_json::Value = serde_json::from_str(line).unwrap();
            Some((value["step"].as_u64()?, value["val_loss"].as_f64()?))
        })
        .collect();
    println!("unigram entropy of the training tokens: {entropy:.3} nats");
    for (step, loss) in &validation {
        println!("step {step:>3}: validation loss {loss:.3} nats");
    }
    let (last_step, last) = *validation.last().expect("validation losses");
    assert_eq!(last_step, steps);
    assert!(
        last < entropy - 0.25,
        "after {steps} steps the validation loss {last:.3} is not clearly below the unigram entropy {entropy:.3}"
    );
}
