//! The store at cluster scale: what committing a step of many shard manifests, finding the
//! latest step and listing a long run, and collecting garbage among many chunks cost, in time
//! and in requests to the backend.
//!
//! Each figure is measured on a store opened as the programs open it: `file://` (every put
//! fsynced) or a real S3 server. The objects it needs are first written through the same
//! store API, on the same files through the local filesystem without fsync, which is only
//! setup (the S3 server, `s3s-fs`, serves plain files).

use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use futures::stream::{self, StreamExt, TryStreamExt};
use lazarus_shared::format::DType;
use lazarus_shared::store::{
    GcPolicy, OpenMode, RequestCounts, RunStore, S3Settings, ShardInput, Store, StoreOptions,
    TensorData,
};
use lazarus_shared::{RunId, StepKey};
use object_store::local::LocalFileSystem;

use crate::{S3Server, S3_ACCESS_KEY, S3_BUCKET, S3_SECRET_KEY};

/// Tensors in each shard manifest of the commit and gc figures (a rank of a real model has
/// hundreds).
const TENSORS_PER_SHARD: usize = 16;
/// Shards being written at once while setting up.
const SETUP_CONCURRENCY: usize = 64;

/// One measured operation.
#[derive(Clone, Debug)]
pub struct Measured {
    pub what: String,
    pub seconds: f64,
    pub requests: RequestCounts,
}

impl Measured {
    pub fn header() -> String {
        format!(
            "{:<50} {:>9} {:>9} {:>8} {:>6} {:>6} {:>6} {:>9} {:>7} {:>9}",
            "operation",
            "seconds",
            "requests",
            "get",
            "head",
            "put",
            "list",
            "listed",
            "delete",
            "deleted"
        )
    }

    pub fn row(&self) -> String {
        let r = &self.requests;
        format!(
            "{:<50} {:>9.3} {:>9} {:>8} {:>6} {:>6} {:>6} {:>9} {:>7} {:>9}",
            self.what,
            self.seconds,
            r.total(),
            r.get,
            r.head,
            r.put,
            r.list,
            r.listed,
            r.delete,
            r.deleted
        )
    }
}

/// Times `operation` on `store` and counts its requests.
pub async fn measure<T>(
    store: &Store,
    what: impl Into<String>,
    operation: impl std::future::Future<Output = anyhow::Result<T>>,
) -> anyhow::Result<(T, Measured)> {
    let before = store.requests();
    let started = Instant::now();
    let value = operation.await?;
    let measured = Measured {
        what: what.into(),
        seconds: started.elapsed().as_secs_f64(),
        requests: store.requests() - before,
    };
    Ok((value, measured))
}

fn run_id(name: &str) -> RunId {
    name.parse().expect("a valid run id")
}

/// Where the measured store lives.
#[derive(Clone, Copy, Debug)]
pub enum Backend<'a> {
    /// A `file://` store in this directory.
    File(&'a Path),
    /// The bucket of this `s3s-fs` server: every request is a real HTTP request.
    S3(&'a S3Server),
}

/// Handles on one store.
#[derive(Debug)]
pub struct Stores {
    /// As the programs open it (fsync on, for `file://`).
    pub store: Store,
    /// The same, reading and deleting one object at a time: the baseline.
    pub serial: Store,
    /// The same objects through the local filesystem without fsync, for setup.
    pub setup: Store,
}

/// Store `name` on `backend`, with chunks of `chunk_bytes`.
pub async fn open(backend: Backend<'_>, name: &str, chunk_bytes: u64) -> anyhow::Result<Stores> {
    let options = || StoreOptions {
        chunk_bytes,
        upload_concurrency: 16,
        ..StoreOptions::default()
    };
    let (url, files, s3) = match backend {
        Backend::File(dir) => {
            let files = dir.join(name);
            (
                format!("file://{}", files.display()),
                files,
                S3Settings::default(),
            )
        }
        Backend::S3(server) => {
            let settings = S3Settings {
                endpoint: Some(server.endpoint()),
                access_key_id: Some(S3_ACCESS_KEY.into()),
                secret_access_key: Some(S3_SECRET_KEY.into()),
                region: Some("us-east-1".into()),
                allow_http: Some(true),
            };
            let files = server.root.path().join(S3_BUCKET).join(name);
            (server.url(name), files, settings)
        }
    };
    std::fs::create_dir_all(&files)?;
    let store = Store::open(
        &url,
        OpenMode::CreateIfMissing,
        StoreOptions {
            s3: s3.clone(),
            ..options()
        },
    )
    .await?;
    let serial = Store::open(
        &url,
        OpenMode::CreateIfMissing,
        StoreOptions {
            s3,
            metadata_concurrency: 1,
            ..options()
        },
    )
    .await?;
    let fast = Arc::new(LocalFileSystem::new_with_prefix(&files)?.with_automatic_cleanup(false));
    let setup = Store::with_objects(fast, &url, options()).await?;
    Ok(Stores {
        store,
        serial,
        setup,
    })
}

/// What each rank writes: `tensors` tensors of `floats` f32 each, the same on every rank
/// and step unless `unique`, in which case no two shards share a chunk.
#[derive(Clone, Copy, Debug)]
struct Shape {
    tensors: usize,
    floats: usize,
    unique: bool,
}

/// Rank `rank`'s shard of `step`.
fn shard(step: u64, rank: u32, world_size: u32, shape: Shape) -> ShardInput {
    let tensors = (0..shape.tensors)
        .map(|t| {
            let mut bytes = vec![0u8; shape.floats * 4];
            let mut seed = blake3::Hasher::new();
            seed.update(&(t as u64).to_le_bytes());
            if shape.unique {
                seed.update(&step.to_le_bytes());
                seed.update(&rank.to_le_bytes());
            }
            seed.finalize_xof().fill(&mut bytes);
            TensorData::whole(
                format!("layers.{t}.weight"),
                DType::F32,
                vec![shape.floats as u64],
                Bytes::from(bytes),
            )
        })
        .collect();
    ShardInput {
        step: StepKey::new(step, 0),
        rank,
        world_size,
        tensors,
        blobs: vec![],
    }
}

async fn write_step(
    run: &RunStore,
    step: u64,
    world_size: u32,
    shape: Shape,
) -> anyhow::Result<()> {
    stream::iter(0..world_size)
        .map(|rank| run.write_shard(shard(step, rank, world_size, shape), None, &()))
        .buffer_unordered(SETUP_CONCURRENCY)
        .try_collect::<Vec<_>>()
        .await?;
    Ok(())
}

/// Writes and commits steps `1..=steps` of `world_size` ranks, `at_once` steps at a time.
async fn write_committed(
    writer: &RunStore,
    steps: u64,
    world_size: u32,
    shape: Shape,
    at_once: usize,
) -> anyhow::Result<()> {
    stream::iter(1..=steps)
        .map(|step| async move {
            write_step(writer, step, world_size, shape).await?;
            writer.commit(StepKey::new(step, 0), world_size).await?;
            anyhow::Ok(())
        })
        .buffer_unordered(at_once)
        .try_collect::<Vec<_>>()
        .await?;
    Ok(())
}

/// Committing a step of `manifests` shard manifests (one per rank), then opening it as a
/// restore does; each one manifest at a time, then as the store does it.
pub async fn commit(backend: Backend<'_>, manifests: u32) -> anyhow::Result<Vec<Measured>> {
    let stores = open(backend, "commit", 1 << 20).await?;
    let run = run_id("commit");
    let writer = stores.setup.run(&run);
    writer.create(serde_json::Value::Null).await?;
    let shape = Shape {
        tensors: TENSORS_PER_SHARD,
        floats: 16,
        unique: false,
    };
    let mut figures = Vec::new();
    for (step, store, how) in [
        (1, &stores.serial, "one at a time"),
        (2, &stores.store, "concurrently"),
    ] {
        write_step(&writer, step, manifests, shape).await?;
        let run = store.run(&run);
        let step = StepKey::new(step, 0);
        let what = format!("commit a step of {manifests} manifests, {how}");
        figures.push(
            measure(store, what, async {
                Ok(run.commit(step, manifests).await?)
            })
            .await?
            .1,
        );
        let what = format!("open that step, {how}");
        figures.push(
            measure(store, what, async { Ok(run.open_checkpoint(step).await?) })
                .await?
                .1,
        );
    }
    Ok(figures)
}

/// `latest` and the catalog (`ckptctl list`) of a run of `steps` committed steps of
/// `world_size` ranks.
pub async fn history(
    backend: Backend<'_>,
    steps: u64,
    world_size: u32,
) -> anyhow::Result<Vec<Measured>> {
    let Stores {
        store,
        serial,
        setup,
    } = open(backend, "history", 1 << 20).await?;
    let run = run_id("history");
    let writer = setup.run(&run);
    writer.create(serde_json::Value::Null).await?;
    let shape = Shape {
        tensors: 1,
        floats: 16,
        unique: false,
    };
    let at_once = SETUP_CONCURRENCY / world_size.max(1) as usize + 1;
    write_committed(&writer, steps, world_size, shape, at_once).await?;
    let mut figures = Vec::new();
    for (store, how) in [(&serial, "one at a time"), (&store, "concurrently")] {
        let run = store.run(&run);
        let what = format!("list {steps} steps of {world_size} ranks, {how}");
        let (catalog, listed) = measure(store, what, async { Ok(run.catalog().await?) }).await?;
        anyhow::ensure!(
            catalog.steps.len() as u64 == steps,
            "the catalog lists {} steps, not {steps}",
            catalog.steps.len()
        );
        figures.push(listed);
    }
    let run = store.run(&run);
    let (latest, found) = measure(&store, format!("latest of {steps} steps"), async {
        Ok(run.latest().await?)
    })
    .await?;
    anyhow::ensure!(
        latest == Some(StepKey::new(steps, 0)),
        "latest is {latest:?}, not step {steps}"
    );
    figures.push(found);
    Ok(figures)
}

/// Garbage collection of a run holding about `chunks` chunks over `steps` committed steps of
/// one rank, keeping the newest tenth of the steps.
pub async fn gc(backend: Backend<'_>, chunks: u64, steps: u64) -> anyhow::Result<Vec<Measured>> {
    // 64-byte chunks: 16 floats each; every step's chunks are its own.
    let shape = Shape {
        tensors: TENSORS_PER_SHARD,
        floats: (chunks.div_ceil(steps) as usize).div_ceil(TENSORS_PER_SHARD) * 16,
        unique: true,
    };
    let Stores { store, setup, .. } = open(backend, "gc", 64).await?;
    let run = run_id("gc");
    let writer = setup.run(&run);
    writer.create(serde_json::Value::Null).await?;
    write_committed(&writer, steps, 1, shape, 4).await?;
    let keep_last = (steps / 10).max(1) as usize;
    let policy = GcPolicy {
        keep_last,
        keep_every: None,
        grace_ms: 0,
        staging_grace_ms: 0,
        dry_run: false,
    };
    let run = store.run(&run);
    let stored = (shape.floats / 16 * shape.tensors) as u64 * steps;
    let (report, collected) = measure(
        &store,
        format!("gc of {stored} chunks, keeping {keep_last} of {steps} steps"),
        async { Ok(run.gc(&policy, &()).await?) },
    )
    .await?;
    anyhow::ensure!(
        report.deleted_chunks + report.kept_chunks == stored,
        "gc saw {} chunks, not {stored}",
        report.deleted_chunks + report.kept_chunks
    );
    anyhow::ensure!(
        report.deleted_steps.len() == steps as usize - keep_last,
        "gc deleted {} steps, not {}",
        report.deleted_steps.len(),
        steps as usize - keep_last
    );
    Ok(vec![collected])
}
