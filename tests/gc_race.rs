//! gc running while a writer commits never deletes a chunk that the new commit references.
//!
//! The writer's steps bring back data that an earlier step held and gc has just orphaned, so
//! the writer keeps finding chunks that gc is about to delete. Every committed step must read
//! back whole.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use bytes::Bytes;
use lazarus_shared::format::DType;
use lazarus_shared::store::{
    GcPolicy, OpenMode, ShardInput, Store, StoreOptions, TensorData, VerifyOptions,
};
use lazarus_shared::{RunId, StepKey, StoreError};
use lazarus_tests::random_f32_bytes;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gc_racing_a_writer_never_deletes_what_a_new_commit_references() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("file://{}", dir.path().join("store").display());
    let options = || StoreOptions {
        chunk_bytes: 16 << 10,
        ..StoreOptions::default()
    };
    let writer = Store::open(&url, OpenMode::CreateIfMissing, options())
        .await
        .unwrap();
    let collector = Store::open(&url, OpenMode::Existing, options())
        .await
        .unwrap();
    let run: RunId = "race".parse().unwrap();
    writer
        .run(&run)
        .create(serde_json::Value::Null)
        .await
        .unwrap();

    let stop = Arc::new(AtomicBool::new(false));
    let collections = Arc::new(AtomicU64::new(0));
    let deleted = Arc::new(AtomicU64::new(0));
    let gc = {
        let (stop, collections, deleted, run) = (
            stop.clone(),
            collections.clone(),
            deleted.clone(),
            collector.run(&run),
        );
        tokio::spawn(async move {
            let policy = GcPolicy {
                keep_last: 1,
                keep_every: None,
                grace_ms: 0,
                staging_grace_ms: 600_000,
                dry_run: false,
            };
            while !stop.load(Ordering::Relaxed) {
                match run.gc(&policy, &()).await {
                    Ok(report) => {
                        collections.fetch_add(1, Ordering::Relaxed);
                        deleted.fetch_add(report.deleted_chunks, Ordering::Relaxed);
                    }
                    Err(StoreError::Locked { .. }) => {}
                    Err(error) => panic!("gc failed: {error}"),
                }
                tokio::task::yield_now().await;
            }
        })
    };

    let data = |seed: u64| Bytes::from(random_f32_bytes(64 << 10, seed));
    let handle = writer.run(&run);
    for step in 1..=40u64 {
        let key = StepKey::new(step, 0);
        let tensors = vec![
            TensorData::whole("constant", DType::F32, vec![64 << 10], data(0)),
            TensorData::whole("fresh", DType::F32, vec![64 << 10], data(step)),
            // What step - 2 held as "fresh": orphaned once gc dropped that step.
            TensorData::whole(
                "revived",
                DType::F32,
                vec![64 << 10],
                data(step.saturating_sub(2).max(1)),
            ),
        ];
        handle
            .write_shard(
                ShardInput {
                    step: key,
                    rank: 0,
                    world_size: 1,
                    tensors,
                    blobs: vec![],
                },
                None,
                &(),
            )
            .await
            .unwrap();
        handle.commit(key, 1).await.unwrap();
        let report = handle
            .verify(
                &[key],
                &VerifyOptions {
                    read_data: true,
                    sample_percent: None,
                },
                &(),
            )
            .await
            .unwrap();
        assert!(
            report.problems.is_empty(),
            "step {step} lost data to a concurrent gc: {:?}",
            report.problems
        );
    }
    stop.store(true, Ordering::Relaxed);
    gc.await.unwrap();
    let (collections, deleted) = (
        collections.load(Ordering::Relaxed),
        deleted.load(Ordering::Relaxed),
    );
    println!("{collections} gc passes deleted {deleted} chunks while 40 steps were written");
    assert!(
        collections >= 10 && deleted > 0,
        "gc did not really run alongside the writer"
    );
}
