//! One storage conformance suite, run against every backend: in-memory, the local filesystem
//! and a real S3 server. Whatever the backend, the store must deduplicate, commit once, read
//! back any region bit-exactly, follow delta chains, roll back and collect garbage the same way.

use std::sync::Arc;

use bytes::Bytes;
use lazarus_shared::format::{DType, DimRange};
use lazarus_shared::store::{
    DeltaBases, GcPolicy, OpenMode, S3Settings, ShardInput, StepState, Store, StoreOptions,
    TensorData, VerifyOptions,
};
use lazarus_shared::{RunId, StepKey, StoreError};
use lazarus_tests::{random_f32_bytes, S3Server};
use object_store::ObjectStoreExt;

fn options() -> StoreOptions {
    StoreOptions {
        chunk_bytes: 64 << 10,
        multipart_threshold_bytes: 1 << 20,
        multipart_part_bytes: 5 << 20,
        ..StoreOptions::default()
    }
}

fn run(name: &str) -> RunId {
    name.parse().unwrap()
}

/// A tensor of f32 rows `rows` of a global tensor of `shape`, holding `data`.
pub(crate) fn sliced(
    name: &str,
    shape: &[u64],
    rows: std::ops::Range<u64>,
    data: &[u8],
) -> TensorData {
    let mut slice: Vec<DimRange> = shape
        .iter()
        .map(|len| DimRange {
            start: 0,
            len: *len,
        })
        .collect();
    slice[0] = DimRange {
        start: rows.start,
        len: rows.end - rows.start,
    };
    TensorData {
        name: name.into(),
        dtype: DType::F32,
        global_shape: shape.to_vec(),
        slice,
        data: Bytes::copy_from_slice(data),
    }
}

/// The suite. `open` returns a fresh handle on the same empty backend with the given options.
async fn conformance(
    label: &str,
    open: impl Fn(StoreOptions) -> futures::future::BoxFuture<'static, Store>,
) {
    let store = open(options()).await;
    assert!(
        store.runs().await.unwrap().is_empty(),
        "{label}: a new store has no runs"
    );
    let moe = store.run(&run("moe"));
    assert!(
        matches!(moe.info().await, Err(StoreError::NoSuchRun { .. })),
        "{label}"
    );
    moe.create(serde_json::json!({"test": label}))
        .await
        .unwrap();
    assert_eq!(store.runs().await.unwrap(), vec![run("moe")], "{label}");

    // Two ranks: a replicated embedding and an expert tensor split by rows.
    let embedding = random_f32_bytes(64 * 100, 1);
    let expert = random_f32_bytes(8 * 300, 2);
    let row_bytes = 300 * 4;
    let step1 = StepKey::new(1, 0);
    let mut manifests = Vec::new();
    for rank in 0..2u32 {
        let rows = u64::from(rank) * 4..u64::from(rank) * 4 + 4;
        let input = ShardInput {
            step: step1,
            rank,
            world_size: 2,
            tensors: vec![
                TensorData::whole(
                    "embedding",
                    DType::F32,
                    vec![64, 100],
                    Bytes::from(embedding.clone()),
                ),
                sliced(
                    "expert",
                    &[8, 300],
                    rows.clone(),
                    &expert[rows.start as usize * row_bytes..rows.end as usize * row_bytes],
                ),
            ],
            blobs: vec![(
                "rng".into(),
                Bytes::from(format!("rng state of rank {rank}")),
            )],
        };
        manifests.push(moe.write_shard(input, None, &()).await.unwrap());
    }
    // The replicated embedding is stored once: rank 1 uploads only its own expert rows and blob.
    let own: u64 = manifests[1]
        .tensor("expert")
        .unwrap()
        .chunks
        .iter()
        .chain(&manifests[1].blob("rng").unwrap().chunks)
        .map(|c| c.stored_len)
        .sum();
    assert_eq!(
        manifests[1].uploaded_bytes, own,
        "{label}: replicated chunks were uploaded twice"
    );
    let record = moe.commit(step1, 2).await.unwrap();
    assert_eq!(
        moe.commit(step1, 2).await.unwrap(),
        record,
        "{label}: re-committing the same step is idempotent"
    );
    let again = ShardInput {
        step: step1,
        rank: 0,
        world_size: 2,
        tensors: vec![],
        blobs: vec![],
    };
    assert!(
        matches!(
            moe.write_shard(again, None, &()).await,
            Err(StoreError::StepAlreadyCommitted { .. })
        ),
        "{label}"
    );

    // Read back whole tensors, a region spanning both ranks, and blobs.
    let checkpoint = moe.open_checkpoint(step1).await.unwrap();
    assert_eq!(
        checkpoint.read_tensor("embedding", &()).await.unwrap(),
        embedding,
        "{label}"
    );
    assert_eq!(
        checkpoint.read_tensor("expert", &()).await.unwrap(),
        expert,
        "{label}"
    );
    let region = [
        DimRange { start: 2, len: 4 },
        DimRange { start: 10, len: 20 },
    ];
    let expected: Vec<u8> = (2..6)
        .flat_map(|row| expert[row * row_bytes + 40..row * row_bytes + 120].to_vec())
        .collect();
    assert_eq!(
        checkpoint
            .read_region("expert", &region, &())
            .await
            .unwrap(),
        expected,
        "{label}: region read across ranks"
    );
    assert_eq!(
        checkpoint.read_blob(1, "rng").await.unwrap(),
        b"rng state of rank 1",
        "{label}"
    );

    // A step with a rank missing cannot commit.
    let step2 = StepKey::new(2, 0);
    let partial = ShardInput {
        step: step2,
        rank: 0,
        world_size: 2,
        tensors: vec![],
        blobs: vec![("rng".into(), Bytes::from_static(b"x"))],
    };
    let first = moe.write_shard(partial.clone(), None, &()).await.unwrap();
    match moe.commit(step2, 2).await {
        Err(StoreError::IncompleteStep { missing, .. }) => assert_eq!(missing, vec![1], "{label}"),
        other => panic!("{label}: committing a partial step gave {other:?}"),
    }

    // Writing a shard again (a retried or caught-up upload that may race the commit) keeps
    // the stored manifest byte for byte: a commit may already pin its hash. Before this was
    // so, CI found a committed step whose manifests no longer matched the commit record.
    tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    let second = moe.write_shard(partial.clone(), None, &()).await.unwrap();
    assert_eq!(
        second, first,
        "{label}: a second write keeps and returns the stored manifest"
    );
    // One that describes other data, while the step has no commit, replaces it.
    let other = ShardInput {
        blobs: vec![("rng".into(), Bytes::from_static(b"y"))],
        ..partial.clone()
    };
    let replaced = moe.write_shard(other, None, &()).await.unwrap();
    assert_ne!(replaced.blobs, first.blobs, "{label}");
    let rank1 = ShardInput { rank: 1, ..partial };
    moe.write_shard(rank1, None, &()).await.unwrap();
    moe.commit(step2, 2).await.unwrap();
    let committed = moe.open_checkpoint(step2).await.unwrap();
    assert_eq!(
        committed.manifest(0).unwrap(),
        &replaced,
        "{label}: the replacing manifest is the one committed"
    );
    assert_eq!(
        committed.read_blob(0, "rng").await.unwrap(),
        b"y",
        "{label}"
    );

    // Delta chains: each step changes a few values of the previous one.
    let delta_run = store.run(&run("delta"));
    delta_run.create(serde_json::Value::Null).await.unwrap();
    let mut values = random_f32_bytes(40_000, 3);
    let mut bases: Option<DeltaBases> = None;
    let mut history = Vec::new();
    for step in 1..=7u64 {
        for position in (0..values.len()).step_by(4 * 997) {
            // Cumulative offsets 4, 11, 21, ... never bring back an earlier step's bytes.
            values[position] = values[position].wrapping_add(step as u8 * 3 + 1);
        }
        let key = StepKey::new(step, 0);
        let tensor =
            TensorData::whole("w", DType::F32, vec![200, 200], Bytes::from(values.clone()));
        let manifest = delta_run
            .write_shard(
                ShardInput {
                    step: key,
                    rank: 0,
                    world_size: 1,
                    tensors: vec![tensor],
                    blobs: vec![],
                },
                bases.as_ref(),
                &(),
            )
            .await
            .unwrap();
        delta_run.commit(key, 1).await.unwrap();
        let chunks = manifest.tensor("w").unwrap().chunks.clone();
        if step > 1 {
            assert!(
                chunks.iter().all(|c| c.codec.is_delta()),
                "{label}: step {step} was not delta-encoded"
            );
        }
        assert!(
            chunks
                .iter()
                .all(|c| c.bases.len() <= usize::from(options().delta_depth_max)),
            "{label}: chain too deep"
        );
        let mut next = DeltaBases::default();
        next.insert("w".into(), Bytes::from(values.clone()), chunks);
        bases = Some(next);
        history.push(values.clone());
    }
    for (index, expected) in history.iter().enumerate() {
        let checkpoint = delta_run
            .open_checkpoint(StepKey::new(index as u64 + 1, 0))
            .await
            .unwrap();
        assert_eq!(
            &checkpoint.read_tensor("w", &()).await.unwrap(),
            expected,
            "{label}: delta step {}",
            index + 1
        );
    }

    // Rollback hides later steps and lets the same step numbers be written again.
    delta_run
        .rollback(StepKey::new(5, 0), "loss spike", "test")
        .await
        .unwrap();
    assert_eq!(
        delta_run.latest().await.unwrap(),
        Some(StepKey::new(5, 0)),
        "{label}"
    );
    assert_eq!(delta_run.current_timeline().await.unwrap(), 1, "{label}");
    let rewritten = StepKey::new(6, 1);
    let tensor = TensorData::whole(
        "w",
        DType::F32,
        vec![200, 200],
        Bytes::from(history[4].clone()),
    );
    delta_run
        .write_shard(
            ShardInput {
                step: rewritten,
                rank: 0,
                world_size: 1,
                tensors: vec![tensor],
                blobs: vec![],
            },
            None,
            &(),
        )
        .await
        .unwrap();
    delta_run.commit(rewritten, 1).await.unwrap();
    let catalog = delta_run.catalog().await.unwrap();
    assert_eq!(catalog.latest, Some(rewritten), "{label}");
    let hidden: Vec<StepKey> = catalog
        .steps
        .iter()
        .filter(|s| matches!(s.state, StepState::RolledBack { .. }))
        .map(|s| s.step)
        .collect();
    assert_eq!(
        hidden,
        vec![StepKey::new(6, 0), StepKey::new(7, 0)],
        "{label}"
    );
    assert!(
        matches!(
            delta_run.commit(StepKey::new(8, 0), 1).await,
            Err(StoreError::RolledBack { .. })
        ),
        "{label}: an old timeline cannot commit after a rollback"
    );

    // gc keeps the latest and the hidden steps (and the whole delta chains below them).
    let report = delta_run
        .gc(
            &GcPolicy {
                keep_last: 1,
                keep_every: None,
                grace_ms: 0,
                staging_grace_ms: 600_000,
                dry_run: false,
            },
            &(),
        )
        .await
        .unwrap();
    assert_eq!(
        report.deleted_steps,
        (1..=5).map(|s| StepKey::new(s, 0)).collect::<Vec<_>>(),
        "{label}"
    );
    let all: Vec<StepKey> = delta_run
        .catalog()
        .await
        .unwrap()
        .steps
        .iter()
        .map(|s| s.step)
        .collect();
    let verified = delta_run
        .verify(
            &all,
            &VerifyOptions {
                read_data: true,
                sample_percent: None,
            },
            &(),
        )
        .await
        .unwrap();
    assert!(
        verified.problems.is_empty(),
        "{label}: after gc: {:?}",
        verified.problems
    );
    assert_eq!(verified.steps.len(), 3, "{label}");
    let checkpoint = delta_run.open_checkpoint(StepKey::new(7, 0)).await.unwrap();
    assert_eq!(
        checkpoint.read_tensor("w", &()).await.unwrap(),
        history[6],
        "{label}: a hidden step still reads after gc"
    );

    // Objects above the multipart threshold go up in parts and come back whole.
    let big = open(StoreOptions {
        chunk_bytes: 12 << 20,
        ..options()
    })
    .await;
    let big_run = big.run(&run("big"));
    big_run.create(serde_json::Value::Null).await.unwrap();
    let noise = random_f32_bytes(3 << 20, 4);
    let tensor = TensorData::whole(
        "noise",
        DType::U8,
        vec![noise.len() as u64],
        Bytes::from(noise.clone()),
    );
    let manifest = big_run
        .write_shard(
            ShardInput {
                step: step1,
                rank: 0,
                world_size: 1,
                tensors: vec![tensor],
                blobs: vec![],
            },
            None,
            &(),
        )
        .await
        .unwrap();
    assert!(
        manifest.uploaded_bytes > 10 << 20,
        "{label}: the test object must exceed the multipart threshold"
    );
    big_run.commit(step1, 1).await.unwrap();
    assert_eq!(
        big_run
            .open_checkpoint(step1)
            .await
            .unwrap()
            .read_tensor("noise", &())
            .await
            .unwrap(),
        noise,
        "{label}"
    );

    let report = moe
        .verify(
            &[step1],
            &VerifyOptions {
                read_data: true,
                sample_percent: None,
            },
            &(),
        )
        .await
        .unwrap();
    assert!(
        report.problems.is_empty() && report.chunks_checked > 0,
        "{label}: {report:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_backend() {
    let objects: Arc<dyn object_store::ObjectStore> =
        Arc::new(object_store::memory::InMemory::new());
    conformance("memory", move |options| {
        let objects = objects.clone();
        Box::pin(async move {
            Store::with_objects(objects, "memory://", options)
                .await
                .unwrap()
        })
    })
    .await;
}

/// `latest` reads commit records newest first: it must agree with the full catalog when the
/// newest commit is damaged or hidden by a rollback.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn latest_skips_damaged_and_hidden_commits_like_the_catalog() {
    let objects: Arc<dyn object_store::ObjectStore> =
        Arc::new(object_store::memory::InMemory::new());
    let store = Store::with_objects(objects.clone(), "memory://", options())
        .await
        .unwrap();
    let run_store = store.run(&run("latest"));
    run_store.create(serde_json::json!({})).await.unwrap();
    let agree = |expected: Option<StepKey>, why: &'static str| {
        let run_store = run_store.clone();
        async move {
            let catalog = run_store.catalog().await.unwrap();
            assert_eq!(catalog.latest, expected, "catalog: {why}");
            assert_eq!(run_store.latest().await.unwrap(), expected, "latest: {why}");
        }
    };
    agree(None, "nothing committed").await;
    for step in 1..=4 {
        let step = StepKey::new(step, 0);
        run_store
            .write_shard(
                ShardInput {
                    step,
                    rank: 0,
                    world_size: 1,
                    tensors: vec![TensorData::whole(
                        "w",
                        DType::F32,
                        vec![16],
                        Bytes::from(random_f32_bytes(16, step.step)),
                    )],
                    blobs: vec![],
                },
                None,
                &(),
            )
            .await
            .unwrap();
        run_store.commit(step, 1).await.unwrap();
    }
    agree(Some(StepKey::new(4, 0)), "four commits").await;
    let commit4 = object_store::path::Path::from("runs/latest/commits/000000000004.json");
    let mut bytes = objects
        .get(&commit4)
        .await
        .unwrap()
        .bytes()
        .await
        .unwrap()
        .to_vec();
    let middle = bytes.len() / 2;
    bytes[middle] ^= 0x04;
    objects.put(&commit4, bytes.into()).await.unwrap();
    agree(Some(StepKey::new(3, 0)), "the newest commit is damaged").await;
    run_store
        .rollback(StepKey::new(2, 0), "test", "test")
        .await
        .unwrap();
    agree(Some(StepKey::new(2, 0)), "steps after 2 are rolled back").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn local_filesystem_backend() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("file://{}", dir.path().join("store").display());
    conformance("file", move |options| {
        let url = url.clone();
        Box::pin(async move {
            Store::open(&url, OpenMode::CreateIfMissing, options)
                .await
                .unwrap()
        })
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s3_backend() {
    let server = S3Server::start();
    let url = server.url("conformance");
    let s3 = S3Settings {
        endpoint: Some(server.endpoint()),
        access_key_id: Some(lazarus_tests::S3_ACCESS_KEY.into()),
        secret_access_key: Some(lazarus_tests::S3_SECRET_KEY.into()),
        region: Some("us-east-1".into()),
        allow_http: Some(true),
    };
    conformance("s3", move |options| {
        let url = url.clone();
        let s3 = s3.clone();
        Box::pin(async move {
            Store::open(&url, OpenMode::Existing, StoreOptions { s3, ..options })
                .await
                .unwrap()
        })
    })
    .await;
    drop(server);
}
