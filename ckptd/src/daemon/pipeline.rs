//! The snapshot pipeline: a handed-over slot is hashed chunk by chunk and streamed to the
//! buddy (T1), reported to the leader, made T0 by the leader's memory commit, and uploaded
//! through the store library when the leader wants the step durable (T2). Also the upload of
//! a buddy's replica when the leader shrinks the world after losing a node.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{anyhow, Result};
use bytes::Bytes;
use lazarus_shared::store::{ByteSource, DeltaBases, Progress, SourcedShard};
use lazarus_shared::wire::{self, Message, SlotTensor};
use lazarus_shared::{ChunkHash, Rank, StepKey};

use super::rank::{Base, HandOver, RankState, Snap, Upload};
use super::slots::{chunk_count, copy_file, read_chunk, verify_slot};
use super::{replica, Daemon, SLOT_CHUNK_BYTES};
use lazarus_shared::store::FileSource;

pub async fn snapshot(
    daemon: &Arc<Daemon>,
    rank: Rank,
    step: u64,
    slot: u32,
    durable: bool,
    blobs: Vec<(String, Bytes)>,
) -> Result<Message> {
    let mut ranks = daemon.ranks.lock().await;
    let state = ranks
        .get_mut(&rank)
        .ok_or_else(|| anyhow!("rank {rank} vanished"))?;
    if state.saw_step(step) {
        daemon.heartbeat_now.notify_one();
    }
    match state.hand_over(slot) {
        HandOver::NotTheRanks => {
            return Ok(Message::Refused {
                reason: format!("slot {slot} is not the rank's to hand over"),
            })
        }
        HandOver::Busy => {
            daemon.metrics.snapshots_skipped.inc();
            return Ok(state.held_reply(true, false));
        }
        HandOver::Accepted => state.snapshot_step = Some(step),
    }
    daemon.metrics.snapshots.inc();
    let reply = state.held_reply(true, true);
    let job = Job {
        rank,
        world_size: state.world_size,
        step,
        slot,
        path: state.slot_path(slot),
        slot_bytes: state.slot_bytes,
        tensors: state.tensors.clone(),
        blobs: blobs.into_iter().map(|(n, b)| (n, b.to_vec())).collect(),
        durable,
    };
    drop(ranks);
    super::crash::point("snapshot");
    tokio::spawn(process(daemon.clone(), job));
    Ok(reply)
}

struct Job {
    rank: Rank,
    world_size: u32,
    step: u64,
    slot: u32,
    path: PathBuf,
    slot_bytes: u64,
    tensors: Vec<SlotTensor>,
    blobs: Vec<(String, Vec<u8>)>,
    durable: bool,
}

/// Hashes and replicates one snapshot, then reports it to the leader.
async fn process(daemon: Arc<Daemon>, job: Job) {
    let started = Instant::now();
    let result = replicate(&daemon, &job).await;
    let mut ranks = daemon.ranks.lock().await;
    let Some(state) = ranks.get_mut(&job.rank) else {
        return;
    };
    match result {
        Ok(hashes) => {
            daemon
                .metrics
                .replicate_seconds
                .observe(started.elapsed().as_secs_f64());
            state.replicated(Some(Snap {
                step: job.step,
                slot: job.slot,
                hashes,
                blobs: job.blobs,
                durable_requested: job.durable,
            }));
            let _ = daemon.to_leader.send(Message::Replicated {
                node: daemon.cfg.node.clone(),
                run: daemon.cfg.run.clone(),
                rank: job.rank,
                world_size: job.world_size,
                step: job.step,
                durable_requested: job.durable,
                upload: Some(state.upload_report()),
            });
        }
        Err(error) => {
            state.replicated(None);
            daemon.metrics.error("replicate");
            tracing::warn!(rank = job.rank, step = job.step, error = %format!("{error:#}"), "snapshot not replicated; the rank keeps its previous T0");
        }
    }
}

/// Reads the slot chunk by chunk, hashing each and streaming it to the buddy (T1).
async fn replicate(daemon: &Arc<Daemon>, job: &Job) -> Result<Vec<ChunkHash>> {
    let file = Arc::new(FileSource::open(&job.path)?);
    let buddy = *daemon.buddy.lock().expect("not poisoned");
    let mut sender = match buddy {
        Some(buddy) => {
            let (specs, payload) = wire::pack_blobs(&job.blobs);
            let begin = Message::ReplicaBegin {
                from_node: daemon.cfg.node.clone(),
                run: daemon.cfg.run.clone(),
                rank: job.rank,
                world_size: job.world_size,
                step: job.step,
                slot_bytes: job.slot_bytes,
                chunk_bytes: SLOT_CHUNK_BYTES,
                tensors: job.tensors.clone(),
                blobs: specs,
            };
            Some(replica::ReplicaSender::begin(daemon, buddy, begin, &payload).await?)
        }
        None => None,
    };
    let mut hashes = Vec::new();
    for index in 0..chunk_count(job.slot_bytes) {
        let data = read_chunk(&file, job.slot_bytes, index).await?;
        let hashed = data.clone();
        let hash = tokio::task::spawn_blocking(move || ChunkHash::of(&hashed)).await?;
        if let Some(sender) = sender.as_mut() {
            sender.data(index as u32, hash, &data).await?;
            daemon.metrics.bytes_replicated.inc_by(data.len() as u64);
            if index == 0 {
                super::crash::point("replicate");
            }
        }
        hashes.push(hash);
    }
    if let Some(sender) = sender {
        sender.end(hashes.clone()).await?;
    }
    Ok(hashes)
}

/// Drops replicated snapshots whose memory commit did not come in time (a rank elsewhere
/// failed to snapshot that step), so that the ranks can hand over the next one.
pub async fn expire_pending(daemon: Arc<Daemon>) {
    let timeout = Duration::from_secs_f64(daemon.cfg.commit_timeout_seconds);
    loop {
        tokio::time::sleep(Duration::from_millis(250)).await;
        let mut ranks = daemon.ranks.lock().await;
        for state in ranks.values_mut() {
            if let Some(step) = state.expire(timeout) {
                daemon.metrics.error("memory_commit_timeout");
                tracing::warn!(
                    rank = state.rank,
                    step,
                    ?timeout,
                    "no memory commit came; dropping the snapshot"
                );
            }
        }
    }
}

/// The leader gave up the steps through `through` (a rank reported a later step than one of
/// them lacked): the local ranks' snapshots waiting for their commit go now, not at the
/// timeout, so that the ranks can hand over the next one.
pub async fn given_up(daemon: &Arc<Daemon>, through: u64) {
    let mut ranks = daemon.ranks.lock().await;
    for state in ranks.values_mut() {
        if let Some(step) = state.give_up(through) {
            tracing::info!(
                rank = state.rank,
                step,
                "the leader gave the step up (a rank reported a later one); dropping the snapshot"
            );
        }
    }
}

/// The leader memory-committed `step`: it becomes every local rank's T0, and is uploaded if
/// `durable`.
pub async fn memory_committed(daemon: &Arc<Daemon>, step: u64, durable: bool) {
    let mut ranks = daemon.ranks.lock().await;
    for state in ranks.values_mut() {
        match state.commit(step, durable) {
            Ok(true) => {}
            Ok(false) => continue,
            Err(error) => {
                daemon.metrics.error("state");
                tracing::error!(error = %format!("{error:#}"), "cannot record T0");
            }
        }
        super::crash::point("commit");
        if durable {
            start_upload(daemon, state);
        }
    }
}

/// Uploads the rank's T0 unless an upload is already running; that one catches up with the
/// newest durable-requested T0 when it ends.
fn start_upload(daemon: &Arc<Daemon>, state: &mut RankState) {
    let decision = state.upload();
    follow(daemon, state, decision);
}

/// Carries out what the rank's state decided about uploads.
fn follow(daemon: &Arc<Daemon>, state: &RankState, decision: Upload) {
    match decision {
        Upload::Nothing => {}
        Upload::Stored(step) => {
            let _ = daemon.to_leader.send(stored_message(daemon, state, step));
        }
        Upload::Queued { replaced } => {
            if let Some(skipped) = replaced {
                daemon.metrics.durable_skipped.inc();
                tracing::info!(
                    rank = state.rank,
                    skipped,
                    "an upload is still running: durable step {skipped} is skipped for a newer one"
                );
            }
        }
        Upload::Start(snap) => {
            tokio::spawn(upload(daemon.clone(), state.rank, snap));
        }
        Upload::Skipped(skipped) => {
            // T0 moved on to a step that is not durable: the waiting one's slot is gone.
            daemon.metrics.durable_skipped.inc();
            tracing::info!(
                rank = state.rank,
                skipped,
                "durable step {skipped} is skipped: newer steps replaced it while an upload ran"
            );
        }
    }
}

/// The leader wants `step` durable (the job is ending): upload each rank's T0 of that step
/// unless an upload is running (the leader asks again).
pub async fn make_durable(daemon: &Arc<Daemon>, step: u64) {
    let mut ranks = daemon.ranks.lock().await;
    for state in ranks.values_mut() {
        if state.request_durable(step) {
            start_upload(daemon, state);
        }
    }
}

/// Tells the leader that `state`'s shard of `step` is stored.
fn stored_message(daemon: &Daemon, state: &RankState, step: StepKey) -> Message {
    Message::Stored {
        node: daemon.cfg.node.clone(),
        run: daemon.cfg.run.clone(),
        rank: state.rank,
        world_size: state.world_size,
        step,
    }
}

struct Counting<'a>(&'a super::metrics::Metrics);

impl Progress for Counting<'_> {
    fn advance(&self, bytes: u64) {
        self.0.bytes_raw.inc_by(bytes);
        super::crash::point("upload");
    }
}

/// Uploads a rank's T0 through the store library and tells the leader its manifest is stored;
/// then, while the slot is still held, makes it the delta base of the next upload. A durable
/// step committed to memory meanwhile is uploaded next.
async fn upload(daemon: Arc<Daemon>, rank: Rank, snap: Snap) {
    let (uploaded, slot) = (snap.step, snap.slot);
    let result = upload_inner(&daemon, rank, snap).await;
    let stored = {
        let mut ranks = daemon.ranks.lock().await;
        let Some(state) = ranks.get_mut(&rank) else {
            return;
        };
        match result {
            Ok((step, chunks)) => {
                // The base file is about to change: from now until the new base is recorded,
                // no upload (nor a daemon restarted meanwhile) pairs it with the old chunks.
                let recorded = if daemon.cfg.delta {
                    state.forget_base()
                } else {
                    Ok(())
                }
                .and_then(|()| state.stored(step, None));
                if let Err(error) = recorded {
                    tracing::error!(error = %format!("{error:#}"), "cannot record the stored step");
                }
                let _ = daemon.to_leader.send(stored_message(&daemon, state, step));
                Some((step, chunks))
            }
            Err(error) => {
                daemon.metrics.error("upload");
                tracing::warn!(rank, error = %format!("{error:#}"), "durable upload failed; the next durable step tries again");
                None
            }
        }
    };
    let base = match stored {
        Some((step, chunks)) if daemon.cfg.delta => {
            match new_base(&daemon, rank, slot, uploaded, chunks).await {
                Ok(base) => Some((step, base)),
                Err(error) => {
                    tracing::warn!(rank, error = %format!("{error:#}"), "no delta base for the next upload; it stores whole chunks");
                    None
                }
            }
        }
        _ => None,
    };
    let mut ranks = daemon.ranks.lock().await;
    if let Some(state) = ranks.get_mut(&rank) {
        if let Some((step, base)) = base {
            if let Err(error) = state.stored(step, Some(base)) {
                tracing::error!(error = %format!("{error:#}"), "cannot record the delta base");
            }
        }
        let next = state.upload_ended(uploaded);
        follow(&daemon, state, next);
    }
}

/// Writes `snap`'s shard (its T0 slot) through the store library. Returns the step as stored
/// and, per tensor, the chunks the store recorded.
async fn upload_inner(
    daemon: &Arc<Daemon>,
    rank: Rank,
    snap: Snap,
) -> Result<(StepKey, Vec<Vec<lazarus_shared::format::ChunkRef>>)> {
    let (path, dir, tensors, world_size, base) = {
        let ranks = daemon.ranks.lock().await;
        let state = ranks
            .get(&rank)
            .ok_or_else(|| anyhow!("rank {rank} vanished"))?;
        (
            state.slot_path(snap.slot),
            state.dir.clone(),
            state.tensors.clone(),
            state.world_size,
            state.base.clone(),
        )
    };
    let started = Instant::now();
    let timeline = daemon.run.current_timeline().await?;
    let key = StepKey::new(snap.step, timeline);
    let source: Arc<dyn ByteSource> = Arc::new(FileSource::open(&path)?);
    let bases = match (base, daemon.cfg.delta) {
        (Some(base), true) if base.chunks.len() == tensors.len() => {
            let base_source: Arc<dyn ByteSource> = Arc::new(FileSource::open(&dir.join("base"))?);
            DeltaBases::of_regions(&tensors, &base_source, base.chunks).map(|bases| {
                if base.checked {
                    bases.already_checked()
                } else {
                    bases
                }
            })
        }
        _ => None,
    };
    let shard = SourcedShard::from_regions(
        key,
        rank,
        world_size,
        &tensors,
        &source,
        blobs_of(&snap.blobs),
    );
    let manifest = daemon
        .run
        .write_shard_sourced(shard, bases.as_ref(), &Counting(&daemon.metrics))
        .await?;
    daemon.metrics.bytes_stored.inc_by(manifest.uploaded_bytes);
    daemon
        .metrics
        .upload_bytes_per_second
        .set(manifest.raw_bytes() as f64 / started.elapsed().as_secs_f64().max(1e-9));
    tracing::info!(rank, step = %key, raw = manifest.raw_bytes(), uploaded = manifest.uploaded_bytes, seconds = started.elapsed().as_secs_f64(), "shard stored");
    Ok((
        key,
        manifest.tensors.into_iter().map(|t| t.chunks).collect(),
    ))
}

/// Copies the uploaded slot to the rank's delta-base file and hashes the copy against the
/// chunks just stored, so the next upload encodes against it without hashing it again.
async fn new_base(
    daemon: &Arc<Daemon>,
    rank: Rank,
    slot: u32,
    step: u64,
    chunks: Vec<Vec<lazarus_shared::format::ChunkRef>>,
) -> Result<Base> {
    let (from, dir, tensors, slot_bytes) = {
        let ranks = daemon.ranks.lock().await;
        let state = ranks
            .get(&rank)
            .ok_or_else(|| anyhow!("rank {rank} vanished"))?;
        (
            state.slot_path(slot),
            state.dir.clone(),
            state.tensors.clone(),
            state.slot_bytes,
        )
    };
    // Written over the old base in place: the rank's state forgot it before this began (see
    // `upload`), so no upload, nor a daemon restarted meanwhile, reads the file half copied;
    // and the node never holds two bases.
    let base_path = dir.join("base");
    let to = base_path.clone();
    tokio::task::spawn_blocking(move || copy_file(&from, &to, slot_bytes)).await??;
    super::crash::point("base");
    let source: Arc<dyn ByteSource> = Arc::new(FileSource::open(&base_path)?);
    let checked = match DeltaBases::of_regions(&tensors, &source, chunks.clone()) {
        Some(mut bases) => bases.check(daemon.cfg.upload_concurrency).await?,
        None => false,
    };
    if !checked {
        tracing::warn!(rank, step, "the delta-base copy does not hash to the chunks just stored; the next upload hashes each base chunk before using it");
    }
    Ok(Base {
        step,
        chunks,
        checked,
    })
}

/// The blobs a snapshot carries, as the store takes them.
fn blobs_of(blobs: &[(String, Vec<u8>)]) -> Vec<(String, Bytes)> {
    blobs
        .iter()
        .map(|(name, bytes)| (name.clone(), Bytes::from(bytes.clone())))
        .collect()
}

/// The leader shrinks the world after losing a node: this daemon uploads the replica it
/// holds of `rank`'s `step` (T1) as that rank's durable shard, after checking every chunk
/// against the hashes taken when it arrived.
pub async fn upload_replica(daemon: Arc<Daemon>, rank: Rank, step: u64) {
    match upload_replica_inner(&daemon, rank, step).await {
        Ok((key, world_size)) => {
            let _ = daemon.to_leader.send(Message::Stored {
                node: daemon.cfg.node.clone(),
                run: daemon.cfg.run.clone(),
                rank,
                world_size,
                step: key,
            });
        }
        Err(error) => {
            daemon.metrics.error("upload");
            tracing::error!(rank, step, error = %format!("{error:#}"), "cannot upload the replica");
        }
    }
}

async fn upload_replica_inner(
    daemon: &Arc<Daemon>,
    rank: Rank,
    step: u64,
) -> Result<(StepKey, u32)> {
    let (data, meta) = replica::held(daemon, rank, step)?
        .ok_or_else(|| anyhow!("no replica of rank {rank} step {step} here"))?;
    verify_slot(&data, meta.slot_bytes, &meta.chunks).await?;
    let started = Instant::now();
    let key = StepKey::new(step, daemon.run.current_timeline().await?);
    let source: Arc<dyn ByteSource> = Arc::new(FileSource::open(&data)?);
    let shard = SourcedShard::from_regions(
        key,
        rank,
        meta.world_size,
        &meta.tensors,
        &source,
        blobs_of(&meta.blobs),
    );
    let manifest = daemon
        .run
        .write_shard_sourced(shard, None, &Counting(&daemon.metrics))
        .await?;
    daemon.metrics.bytes_stored.inc_by(manifest.uploaded_bytes);
    tracing::info!(rank, step = %key, raw = manifest.raw_bytes(), seconds = started.elapsed().as_secs_f64(), "replica stored as the rank's shard");
    Ok((key, meta.world_size))
}
