//! The main job until the trainer lands: a small real training run (see `harness::toy`) that
//! checkpoints through the store library every few steps, delta-encoded against the previous
//! checkpoint, and resumes from the latest committed step when started again.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, Result};
use bytes::Bytes;
use clap::Parser;
use lazarus_shared::store::{DeltaBases, OpenMode, ShardInput, Store, StoreOptions};
use lazarus_shared::{RunId, StepKey};
use lazarus_tests::toy::Toy;

#[derive(Debug, Parser)]
struct Args {
    /// Where checkpoints go.
    #[arg(long, default_value = "file:///tmp/lazarus-data")]
    store: String,
    #[arg(long, default_value = "toy")]
    run: RunId,
    /// Train until this step.
    #[arg(long, default_value_t = 200)]
    steps: u64,
    /// Checkpoint every this many steps.
    #[arg(long, default_value_t = 20)]
    every: u64,
    /// Training text; without it, the project's own docs and sources.
    #[arg(long)]
    text: Option<PathBuf>,
}

fn corpus(text: Option<&PathBuf>) -> Result<Vec<u8>> {
    if let Some(path) = text.filter(|p| p.exists()) {
        return std::fs::read(path).with_context(|| format!("reading {}", path.display()));
    }
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
    let mut bytes = Vec::new();
    for file in lazarus_tests::files_under(&root) {
        let wanted = file.extension().is_some_and(|e| e == "md" || e == "rs")
            && !file.components().any(|c| c.as_os_str() == "target");
        if wanted {
            bytes.extend(std::fs::read(&file)?);
        }
    }
    Ok(bytes)
}

#[tokio::main]
async fn main() -> Result<()> {
    let args = Args::parse();
    let text = corpus(args.text.as_ref())?;
    anyhow::ensure!(text.len() > 1000, "the training text is too short");
    let store = Store::open(
        &args.store,
        OpenMode::CreateIfMissing,
        StoreOptions::default(),
    )
    .await?;
    let run = store.run(&args.run);
    run.create(serde_json::json!({ "model": "toy byte bigram", "dim": 128 }))
        .await?;
    let mut model = Toy::new(text, 128, 7);
    let mut bases = None;
    if let Some(latest) = run.latest().await? {
        let checkpoint = run.open_checkpoint(latest).await?;
        let mut tensors = Vec::new();
        let mut next = DeltaBases::default();
        for entry in &checkpoint.manifest(0)?.tensors {
            let bytes = checkpoint.read_shard_tensor(0, &entry.name, &()).await?;
            next.insert(
                entry.name.clone(),
                Bytes::from(bytes.clone()),
                entry.chunks.clone(),
            );
            tensors.push((entry.name.clone(), bytes));
        }
        model
            .restore(&tensors, &checkpoint.read_blob(0, "loader").await?)
            .map_err(anyhow::Error::msg)?;
        bases = Some(next);
        println!(
            "resumed run {} from step {} (verified on read)",
            args.run, latest
        );
    }
    let timeline = run.current_timeline().await?;
    let started = Instant::now();
    let mut first_loss = None;
    let mut loss = 0.0;
    while model.step < args.steps {
        loss = model.train_step(64, 0.01);
        first_loss.get_or_insert(loss);
        if model.step % args.every == 0 {
            let key = StepKey::new(model.step, timeline);
            let tensors = model.tensors();
            let input = ShardInput {
                step: key,
                rank: 0,
                world_size: 1,
                tensors: tensors.clone(),
                blobs: vec![("loader".into(), model.loader_state())],
            };
            let saved = Instant::now();
            let manifest = run.write_shard(input, bases.as_ref(), &()).await?;
            run.commit(key, 1).await?;
            println!(
                "step {:>5}  loss {loss:.3}  checkpoint {:.1} KiB raw, {:.1} KiB new in storage, {:.0} ms",
                model.step,
                manifest.raw_bytes() as f64 / 1024.0,
                manifest.uploaded_bytes as f64 / 1024.0,
                saved.elapsed().as_secs_f64() * 1000.0
            );
            let mut next = DeltaBases::default();
            for (tensor, entry) in tensors.into_iter().zip(&manifest.tensors) {
                next.insert(tensor.name, tensor.data, entry.chunks.clone());
            }
            bases = Some(next);
        }
    }
    println!(
        "trained to step {} in {:.1}s: loss {} -> {loss:.3} nats/byte (uniform guessing is {:.3})",
        model.step,
        started.elapsed().as_secs_f64(),
        first_loss.map_or("-".into(), |l| format!("{l:.3}")),
        (256f32).ln()
    );
    println!(
        "inspect it:  target/release/ckptctl --store {} list {}",
        args.store, args.run
    );
    println!(
        "audit it:    target/release/ckptctl --store {} verify {} --all --read-data",
        args.store, args.run
    );
    Ok(())
}
