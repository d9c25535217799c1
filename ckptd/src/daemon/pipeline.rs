//! The snapshot pipeline: a handed-over slot is hashed chunk by chunk and streamed to the
//! buddy (T1), reported to the leader, made T0 by the leader's memory commit, and uploaded
//! through the store library when the leader wants the step durable (T2). Also the upload of
//! a buddy's replica when the leader shrinks the world after losing a node.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{anyhow, Result};
use bytes::Bytes;
use lazarus_shared::store::{ByteSource, DeltaBases, Progress, RawCopy, SourcedShard};
use lazarus_shared::wire::{self, Message, RollbackMark, SlotTensor};
use lazarus_shared::{ChunkHash, Rank, StepKey};

use super::rank::{Base, HandOver, Life, RankState, Snap, Upload};
use super::slots::{
    chunks_of, read_hashed, runs, verify_slot, BaseCopy, HashedSlot, MappedFile, BASE_FILE,
};
use super::{replica, Daemon, SLOT_CHUNKING, SLOT_CHUNK_BYTES};
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
        generation: state.generation,
        world_size: state.world_size,
        step,
        slot,
        // Opened under the lock, where the file at the slot's path is this state's: a
        // registration with another layout makes the rank's files anew once it has removed
        // the state.
        source: MappedFile::open(&state.slot_path(slot)),
        slot_bytes: state.slot_bytes,
        tensors: state.tensors.clone(),
        blobs: blobs.into_iter().map(|(n, b)| (n, b.to_vec())).collect(),
        durable,
        rollback: *daemon.rollback.lock().expect("not poisoned"),
    };
    drop(ranks);
    super::crash::point("snapshot");
    tokio::spawn(process(daemon.clone(), job));
    Ok(reply)
}

struct Job {
    rank: Rank,
    /// The rank's state the slot is one of ([`RankState::generation`]).
    generation: u64,
    world_size: u32,
    step: u64,
    slot: u32,
    /// The slot's file, opened as it was handed over.
    source: Result<Arc<MappedFile>>,
    slot_bytes: u64,
    tensors: Vec<SlotTensor>,
    blobs: Vec<(String, Vec<u8>)>,
    durable: bool,
    /// The last rollback applied when the snapshot was handed over.
    rollback: RollbackMark,
}

/// Hashes and replicates one snapshot on the data path, then reports it to the leader.
async fn process(daemon: Arc<Daemon>, job: Job) {
    let started = Instant::now();
    let (job, result) = daemon
        .data
        .run({
            let daemon = daemon.clone();
            async move {
                let result = replicate(&daemon, &job).await;
                (job, result)
            }
        })
        .await;
    let mut ranks = daemon.ranks.lock().await;
    let Some(state) = ranks.get_mut(&job.rank) else {
        return;
    };
    if state.generation != job.generation {
        // The rank registered with another layout meanwhile: its state, slots and busy word
        // are new, and this snapshot's slot file is gone.
        tracing::info!(
            rank = job.rank,
            step = job.step,
            "dropped a snapshot of the rank's previous layout"
        );
        return;
    }
    if job.rollback != *daemon.rollback.lock().expect("not poisoned") {
        // The run was rolled back while this was replicated: it is the abandoned trajectory's
        // (the rank that handed it over was stopped before the rollback), and must be neither
        // committed nor restored.
        state.replicated(None);
        tracing::info!(
            rank = job.rank,
            step = job.step,
            "dropped a snapshot handed over before the run was rolled back"
        );
        return;
    }
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
                chunking: SLOT_CHUNKING,
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
                rollback: job.rollback,
            });
        }
        Err(error) => {
            state.replicated(None);
            daemon.metrics.error("replicate");
            tracing::warn!(rank = job.rank, step = job.step, error = %format!("{error:#}"), "snapshot not replicated; the rank keeps its previous T0");
        }
    }
}

/// Reads the slot in runs of chunks ([`runs`]), cut at its stored regions as the store cuts
/// them ([`SLOT_CHUNKING`]), hashing each chunk and streaming it to the buddy (T1).
async fn replicate(daemon: &Arc<Daemon>, job: &Job) -> Result<Vec<ChunkHash>> {
    let file = job
        .source
        .as_ref()
        .map_err(|error| anyhow!("{error:#}"))?
        .clone();
    let ranges = chunks_of(SLOT_CHUNKING, job.slot_bytes, &job.tensors)?;
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
                rollback: job.rollback,
                chunking: SLOT_CHUNKING,
            };
            Some(replica::ReplicaSender::begin(daemon, buddy, begin, &payload).await?)
        }
        None => None,
    };
    let mut hashes = Vec::new();
    for run in runs(&ranges) {
        for (data, hash) in read_hashed(&file, &ranges[run]).await? {
            if let Some(sender) = sender.as_mut() {
                sender.data(hashes.len() as u32, hash, &data).await?;
                daemon.metrics.bytes_replicated.inc_by(data.len() as u64);
                if hashes.is_empty() {
                    super::crash::point("replicate");
                }
            }
            hashes.push(hash);
        }
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
pub(crate) fn start_upload(daemon: &Arc<Daemon>, state: &mut RankState) {
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
            let owner = Owner {
                rank: state.rank,
                world_size: state.world_size,
                life: state.life(),
            };
            tokio::spawn(upload(daemon.clone(), owner, snap));
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
    stored_shard(daemon, state.rank, state.world_size, step)
}

/// Tells the leader that `rank`'s shard of `step`, in a world of `world_size`, is stored.
fn stored_shard(daemon: &Daemon, rank: Rank, world_size: u32, step: StepKey) -> Message {
    Message::Stored {
        node: daemon.cfg.node.clone(),
        run: daemon.cfg.run.clone(),
        rank,
        world_size,
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

/// Whose T0 an upload stores: the rank and its world's size, and its state and process as
/// the upload started.
#[derive(Clone, Copy, Debug)]
struct Owner {
    rank: Rank,
    world_size: u32,
    life: Life,
}

/// Uploads a rank's T0 through the store library, writing the next upload's delta base as it
/// goes, records the step and its base, and tells the leader its manifest is stored. A
/// durable step committed to memory meanwhile is uploaded next. An upload that outlived its
/// rank's state (the rank registered with another layout) records nothing in the new one:
/// its base is the old state's file, and its slot was never the new one's.
async fn upload(daemon: Arc<Daemon>, owner: Owner, snap: Snap) {
    let (rank, uploaded) = (owner.rank, snap.step);
    let result = upload_inner(&daemon, owner, snap).await;
    let mut ranks = daemon.ranks.lock().await;
    // The rank's state is gone or new (a registration with another layout is between the
    // two): the shard is the old world's.
    let Some(state) = ranks
        .get_mut(&rank)
        .filter(|state| state.generation == owner.life.generation)
    else {
        if let Ok((step, _)) = &result {
            let stored = stored_shard(&daemon, rank, owner.world_size, *step);
            let _ = daemon.to_leader.send(stored);
        }
        tracing::info!(
            rank,
            step = uploaded,
            "an upload of the rank's previous layout ended"
        );
        return;
    };
    match result {
        Ok((step, base)) => {
            if let Err(error) = state.stored(step, base, owner.life.registration) {
                tracing::error!(error = %format!("{error:#}"), "cannot record the stored step");
            }
            let _ = daemon.to_leader.send(stored_message(&daemon, state, step));
        }
        Err(error) => {
            daemon.metrics.error("upload");
            tracing::warn!(rank, error = %format!("{error:#}"), "durable upload failed; the next durable step tries again");
        }
    }
    let next = state.upload_ended(uploaded);
    follow(&daemon, state, next);
}

/// Writes `snap`'s shard (its T0 slot) through the store library. Returns the step as stored
/// and, with delta encoding, the new delta base: the slot's chunks as the writer hashed them,
/// copied over the old base file (which they were encoded against) as it went.
async fn upload_inner(
    daemon: &Arc<Daemon>,
    owner: Owner,
    snap: Snap,
) -> Result<(StepKey, Option<Base>)> {
    let rank = owner.rank;
    let shard = {
        let mut ranks = daemon.ranks.lock().await;
        let state = ranks
            .get_mut(&rank)
            .filter(|state| state.generation == owner.life.generation)
            .ok_or_else(|| anyhow!("rank {rank} registered with another layout"))?;
        // The slot's and base's files are opened here, under the lock, where the files at
        // their paths are this state's (see `snapshot`).
        let source = MappedFile::open(&state.slot_path(snap.slot))?;
        let old_base = state.base.clone();
        // The base file is about to change: from now until the new base is recorded, no
        // upload (nor a daemon restarted meanwhile) pairs it with the old chunks. Where
        // `state.json` cannot say so, the file is left alone and this upload stores whole
        // chunks.
        let replace_base = daemon.cfg.delta
            && match state.forget_base() {
                Ok(()) => true,
                Err(error) => {
                    tracing::error!(rank, error = %format!("{error:#}"), "cannot forget the delta base; this upload neither uses nor replaces it");
                    false
                }
            };
        let base_file = replace_base.then(|| {
            let path = state.dir.join(BASE_FILE);
            (BaseCopy::open_file(&path), path)
        });
        SlotShard {
            rank,
            source,
            base_file,
            tensors: state.tensors.clone(),
            world_size: state.world_size,
            slot_bytes: state.slot_bytes,
            old_base,
        }
    };
    // The rest takes no lock of the daemon's: all of it runs on the data path.
    daemon
        .data
        .run(store_slot(daemon.clone(), shard, snap))
        .await
}

/// What an upload read from its rank's state, under the lock, to store the slot by.
struct SlotShard {
    rank: Rank,
    /// The slot's file.
    source: Arc<MappedFile>,
    /// The delta-base file as it opened, and its path, when the upload encodes against the
    /// old base and writes the new one over it.
    base_file: Option<(Result<std::fs::File>, PathBuf)>,
    tensors: Vec<SlotTensor>,
    world_size: u32,
    slot_bytes: u64,
    old_base: Option<Base>,
}

/// The part of [`upload_inner`] that runs on the data path.
async fn store_slot(
    daemon: Arc<Daemon>,
    shard: SlotShard,
    snap: Snap,
) -> Result<(StepKey, Option<Base>)> {
    let SlotShard {
        rank,
        source,
        base_file,
        tensors,
        world_size,
        slot_bytes,
        old_base,
    } = shard;
    let started = Instant::now();
    let timeline = daemon.data_run.current_timeline().await?;
    let key = StepKey::new(snap.step, timeline);
    // The chunks hashed at hand-over that are store chunks are not hashed again.
    let source: Arc<dyn ByteSource> = match chunks_of(snap.chunking, slot_bytes, &tensors) {
        Ok(ranges) => Arc::new(HashedSlot::new(source, &ranges, &snap.hashes)),
        Err(_) => source,
    };
    let (copy, bases) = match base_file {
        Some((file, path)) => open_base(rank, file, &path, slot_bytes, &tensors, old_base)?,
        None => (None, None),
    };
    let mut shard = SourcedShard::from_regions(
        key,
        rank,
        world_size,
        &tensors,
        &source,
        blobs_of(&snap.blobs),
    );
    shard.copy = copy.clone().map(|copy| copy as Arc<dyn RawCopy>);
    let manifest = daemon
        .data_run
        .write_shard_sourced(shard, bases.as_ref(), &Counting(&daemon.metrics))
        .await?;
    daemon.metrics.bytes_stored.inc_by(manifest.uploaded_bytes);
    daemon
        .metrics
        .upload_bytes_per_second
        .set(manifest.raw_bytes() as f64 / started.elapsed().as_secs_f64().max(1e-9));
    tracing::info!(rank, step = %key, raw = manifest.raw_bytes(), uploaded = manifest.uploaded_bytes, seconds = started.elapsed().as_secs_f64(), "shard stored");
    // Every tensor chunk was copied from the bytes its name was hashed from, so the next
    // upload trusts the base without hashing it (`checked`).
    let base = copy.filter(|copy| copy.complete()).map(|_| Base {
        step: snap.step,
        chunks: manifest.tensors.into_iter().map(|t| t.chunks).collect(),
        checked: true,
    });
    Ok((key, base))
}

/// Readies `rank`'s delta-base file (as it opened, under the lock) for an upload to copy the
/// new base over, and offers the old base's chunks as delta bases where the file still holds
/// them (it has the slot's size). Without the file, the upload stores whole chunks and keeps
/// no base.
fn open_base(
    rank: Rank,
    file: Result<std::fs::File>,
    path: &std::path::Path,
    slot_bytes: u64,
    tensors: &[SlotTensor],
    old: Option<Base>,
) -> Result<(Option<Arc<BaseCopy>>, Option<DeltaBases>)> {
    let (copy, sized) = match file.and_then(|file| BaseCopy::of(file, path, slot_bytes)) {
        Ok(opened) => opened,
        Err(error) => {
            tracing::warn!(rank, error = %format!("{error:#}"), "cannot open the delta-base file; this upload stores whole chunks");
            return Ok((None, None));
        }
    };
    let bases = match old {
        Some(old) if sized && old.chunks.len() == tensors.len() => {
            // The bases are read from the file the chunks are copied over, laid out as the slot.
            DeltaBases::of_regions(tensors, &copy.source(), old.chunks).map(|bases| {
                let bases = bases.in_copy_target();
                if old.checked {
                    bases.already_checked()
                } else {
                    bases
                }
            })
        }
        _ => None,
    };
    Ok((Some(Arc::new(copy)), bases))
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
    // Kept whole while it is read: no newer replica of the rank lets it go
    // (`replica_uploads`).
    let uploads = || {
        daemon
            .replica_uploads
            .lock()
            .unwrap_or_else(|p| p.into_inner())
    };
    uploads().push((rank, step));
    let uploaded = upload_replica_inner(&daemon, rank, step).await;
    {
        let mut uploads = uploads();
        if let Some(at) = uploads.iter().position(|&upload| upload == (rank, step)) {
            uploads.swap_remove(at);
        }
    }
    match uploaded {
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
    verify_slot(
        &MappedFile::open(&data)?,
        meta.slot_bytes,
        &meta.tensors,
        meta.chunking,
        &meta.chunks,
    )
    .await?;
    let started = Instant::now();
    let key = StepKey::new(step, daemon.data_run.current_timeline().await?);
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
        .data_run
        .write_shard_sourced(shard, None, &Counting(&daemon.metrics))
        .await?;
    daemon.metrics.bytes_stored.inc_by(manifest.uploaded_bytes);
    tracing::info!(rank, step = %key, raw = manifest.raw_bytes(), seconds = started.elapsed().as_secs_f64(), "replica stored as the rank's shard");
    Ok((key, meta.world_size))
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use lazarus_shared::wire::Message;

    use super::{snapshot, start_upload};
    use crate::daemon::rank::{Base, RankState};
    use crate::daemon::{testing, uplink, SLOTS_PER_RANK};

    /// A delta base of an earlier durable step.
    fn earlier_base() -> Base {
        Base {
            step: 5,
            chunks: Vec::new(),
            checked: true,
        }
    }

    /// `state` with T0 at step 10 in slot 0, and [`earlier_base`].
    fn with_t0_and_base(mut state: RankState) -> RankState {
        state.base = Some(earlier_base());
        state.t0 = Some(testing::snap(10, 0, Vec::new()));
        state
    }

    /// An upload stores each chunk that the hand-over hashed as a store chunk (cut at the
    /// stored regions, `SlotChunking::Regions`) under that hash, without hashing it again. A
    /// T0 cut otherwise (from a `state.json` saved before replication cut at the regions) has
    /// its chunks hashed: no hash taken of other bytes names one.
    #[tokio::test]
    async fn an_upload_names_its_chunks_by_the_hashes_taken_at_hand_over() {
        use lazarus_shared::store::RegionKind::Stored;
        use lazarus_shared::wire::SlotChunking;
        use lazarus_shared::ChunkHash;

        let tensors = vec![
            testing::slot_tensor("a", 0, 1000, Stored),
            testing::slot_tensor("b", 8192, 2048, Stored),
        ];
        // Each slot file is all 7s: chunk a's bytes hash to this.
        let a_bytes = ChunkHash::of(&[7u8; 4000]);
        let marker = ChunkHash::of(b"taken at hand-over");
        for chunking in [SlotChunking::Regions, SlotChunking::Fixed] {
            let dir = tempfile::tempdir().unwrap();
            let (daemon, mut to_leader, _) = testing::follower(dir.path(), &[]).await;
            daemon.run.create(serde_json::json!({})).await.unwrap();
            let mut state =
                testing::registered_rank_holding(&dir.path().join("rank-0"), 1, tensors.clone());
            let slot = testing::slot_contents();
            let ranges = chunking
                .ranges(slot.len() as u64, crate::daemon::SLOT_CHUNK_BYTES, &tensors)
                .unwrap();
            // The hash of the chunk that starts at a's offset (the whole slot when cut fixed)
            // is not its bytes' hash: taken, it shows the upload did not hash them.
            let hashes = ranges
                .iter()
                .map(|r| match r.start {
                    0 => marker,
                    _ => ChunkHash::of(&slot[r.start as usize..r.end as usize]),
                })
                .collect();
            let mut t0 = testing::snap(10, 0, hashes);
            t0.chunking = chunking;
            state.t0 = Some(t0);
            assert!(state.request_durable(10));
            let stored = testing::upload_as_rank_0(&daemon, &mut to_leader, state).await;
            assert_eq!(stored.step, 10);
            let base = daemon.ranks.lock().await[&0]
                .base
                .clone()
                .expect("a new base");
            let a_name = base.chunks[0][0].hash;
            match chunking {
                SlotChunking::Regions => assert_eq!(a_name, marker),
                SlotChunking::Fixed => assert_eq!(a_name, a_bytes),
            }
            assert_eq!(base.chunks[1][0].hash, ChunkHash::of(&[7u8; 8192]));
        }
    }

    /// An upload decided for a state that is replaced (the rank registered with another
    /// layout) before the upload read it reads nothing of the new one: it neither forgets
    /// the new state's base nor uploads its slots.
    #[tokio::test]
    async fn an_upload_of_a_layout_replaced_before_it_ran_reads_nothing_of_the_new_one() {
        let dir = tempfile::tempdir().unwrap();
        let (daemon, _to_leader, _) = testing::follower(dir.path(), &[]).await;
        daemon.run.create(serde_json::json!({})).await.unwrap();
        let old = with_t0_and_base(testing::registered_rank(&dir.path().join("old"), 2));
        daemon.ranks.lock().await.insert(0, old);
        let mut ranks = daemon.ranks.lock().await;
        let state = ranks.get_mut(&0).unwrap();
        assert!(state.request_durable(10));
        start_upload(&daemon, state);
        let new = with_t0_and_base(testing::registered_rank(&dir.path().join("new"), 4));
        ranks.insert(0, new);
        // The upload queues for the lock the test holds, and the test behind it: once the
        // test has the lock back, the upload has looked at the state.
        tokio::task::yield_now().await;
        drop(ranks);
        let ranks = daemon.ranks.lock().await;
        assert_eq!(ranks[&0].base, Some(earlier_base()));
        drop(ranks);
        tokio::time::sleep(Duration::from_millis(200)).await;
        let ranks = daemon.ranks.lock().await;
        assert_eq!(
            (ranks[&0].base.clone(), ranks[&0].stored),
            (Some(earlier_base()), None)
        );
    }

    /// Each upload of a replica keeps its own entry in the list of replicas being uploaded,
    /// and takes only that one away when it ends: another upload of the same replica still
    /// running keeps it from being let go.
    #[tokio::test]
    async fn an_ended_replica_upload_leaves_the_entry_of_another_of_the_same_replica() {
        let dir = tempfile::tempdir().unwrap();
        let (daemon, _to_leader, _) = testing::follower(dir.path(), &[]).await;
        // Another upload of rank 1's replica of step 7, still running.
        daemon.replica_uploads.lock().unwrap().push((1, 7));
        // This one finds no replica held and ends at once.
        super::upload_replica(daemon.clone(), 1, 7).await;
        assert_eq!(*daemon.replica_uploads.lock().unwrap(), [(1, 7)]);
    }

    /// A snapshot is hashed from the file that was its slot when it was handed over: a file
    /// made anew at the slot's path afterwards (as a registration with another layout makes
    /// them) is not what the snapshot's hashes describe.
    #[tokio::test]
    async fn a_snapshot_hashes_the_slot_file_it_was_handed_over_in() {
        use lazarus_shared::ChunkHash;
        let dir = tempfile::tempdir().unwrap();
        let (daemon, _to_leader, _) = testing::follower(dir.path(), &[]).await;
        let state = testing::registered_rank(&dir.path().join("rank-0"), 2);
        let path = state.slot_path(0);
        daemon.ranks.lock().await.insert(0, state);
        // On this single-threaded runtime, the replication starts once the test waits.
        snapshot(&daemon, 0, 9, 0, false, Vec::new()).await.unwrap();
        std::fs::remove_file(&path).unwrap();
        std::fs::write(&path, vec![0x55u8; testing::slot_contents().len()]).unwrap();
        let pending = tokio::time::timeout(Duration::from_secs(10), async {
            loop {
                if let Some(pending) = daemon.ranks.lock().await[&0].pending.clone() {
                    return pending;
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        })
        .await
        .expect("the snapshot is replicated within 10 s");
        assert_eq!(pending.hashes, [ChunkHash::of(&testing::slot_contents())]);
    }

    /// A snapshot still being replicated when its rank registers with another layout ends in
    /// nothing: the new state, whose slots are other files, keeps its own snapshot in flight,
    /// and nothing is reported. Regression: its end cleared the new state's `working`, so
    /// the rank could write a slot the daemon was still hashing and sending.
    #[tokio::test]
    async fn a_snapshot_of_a_replaced_layout_ends_in_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let (daemon, mut to_leader, _) = testing::follower(dir.path(), &[]).await;
        let old = testing::registered_rank(&dir.path().join("old"), 2);
        daemon.ranks.lock().await.insert(0, old);
        // On this single-threaded runtime, the replication starts once the test waits.
        snapshot(&daemon, 0, 9, 0, false, Vec::new()).await.unwrap();
        let mut new = testing::registered_rank(&dir.path().join("new"), 4);
        new.working = Some(2);
        let generation = new.generation;
        daemon.ranks.lock().await.insert(0, new);
        tokio::time::sleep(Duration::from_millis(500)).await;
        let ranks = daemon.ranks.lock().await;
        let state = &ranks[&0];
        assert_eq!(state.generation, generation);
        assert_eq!(state.working, Some(2));
        assert!(state.pending.is_none());
        assert!(to_leader.try_recv().is_err(), "nothing reported");
    }

    /// An upload that outlives its rank's state (the rank registered with another layout)
    /// records neither its step nor its delta base in the new state, nor frees a slot there,
    /// and tells the leader its shard is stored as its own world's. Regression: the new state
    /// took the old upload's base chunks as its base file's (a fresh, zeroed file), checked,
    /// and its next upload stored deltas against zeros under the old chunks' names.
    #[tokio::test]
    async fn an_upload_of_a_replaced_layout_records_nothing_in_the_new_one() {
        let dir = tempfile::tempdir().unwrap();
        let (daemon, mut to_leader, _) = testing::follower(dir.path(), &[]).await;
        daemon.run.create(serde_json::json!({})).await.unwrap();
        let earlier = earlier_base();
        let rank_dir = dir.path().join("rank-0");
        let old = with_t0_and_base(testing::registered_rank(&rank_dir, 2));
        daemon.ranks.lock().await.insert(0, old);
        // The test holds the ranks lock while the upload starts, so that the upload, on this
        // single-threaded runtime, queues for the lock (tokio's is first come, first served)
        // and the test queues behind it: the test gets the lock back once the upload has read
        // the old state (and forgot its base) and before the upload can record its result.
        let mut ranks = daemon.ranks.lock().await;
        let state = ranks.get_mut(&0).unwrap();
        assert!(state.request_durable(10));
        start_upload(&daemon, state);
        loop {
            tokio::task::yield_now().await;
            drop(ranks);
            ranks = daemon.ranks.lock().await;
            let state = &ranks[&0];
            assert_eq!(state.uploading, Some(0), "the upload ended");
            if state.base.is_none() {
                break;
            }
        }
        // The new layout's files at the same paths, as `register` makes them anew; its base
        // file of another size.
        std::fs::remove_dir_all(&rank_dir).unwrap();
        let mut new = testing::registered_rank(&rank_dir, 4);
        let new_files: Vec<_> = (0..SLOTS_PER_RANK)
            .map(|slot| new.slot_path(slot))
            .chain([rank_dir.join(crate::daemon::slots::BASE_FILE)])
            .collect();
        for file in &new_files {
            std::fs::write(file, vec![0x55u8; 32 << 10]).unwrap();
        }
        new.base = Some(earlier.clone());
        new.uploading = Some(3);
        ranks.insert(0, new);
        drop(ranks);
        let stored = tokio::time::timeout(Duration::from_secs(30), to_leader.recv())
            .await
            .expect("the old upload ended")
            .unwrap();
        match stored {
            Message::Stored {
                rank,
                world_size,
                step,
                ..
            } => assert_eq!((rank, world_size, step.step), (0, 2, 10)),
            other => panic!("expected the old world's shard stored, got {other:?}"),
        }
        let ranks = daemon.ranks.lock().await;
        let state = &ranks[&0];
        assert_eq!(state.base, Some(earlier));
        assert_eq!(state.stored, None);
        assert_eq!(state.uploading, Some(3));
        for file in &new_files {
            let bytes = std::fs::read(file).unwrap();
            assert!(
                bytes == vec![0x55u8; 32 << 10],
                "{} was changed",
                file.display()
            );
        }
    }

    /// A snapshot handed over before a rollback and still being replicated when its daemon
    /// applies the rollback is the abandoned trajectory's: when the replication ends it is
    /// neither reported nor kept, and the rank may hand over the next. The next one, handed
    /// over after the rollback, is reported. Regression: both ranks' last snapshots before a
    /// loss spike were reported after the rollback, committed, and restored.
    #[tokio::test]
    async fn a_snapshot_replicated_across_a_rollback_is_dropped() {
        let dir = tempfile::tempdir().unwrap();
        let (daemon, mut to_leader, _) = testing::follower(dir.path(), &[]).await;
        let slot_bytes = 64 << 10;
        let mut state = RankState::new(0, 2, slot_bytes, Vec::new(), dir.path().join("rank-0"));
        std::fs::create_dir_all(&state.dir).unwrap();
        for slot in 0..SLOTS_PER_RANK {
            std::fs::write(state.slot_path(slot), vec![7; slot_bytes as usize]).unwrap();
        }
        state.registered(100).unwrap();
        daemon.ranks.lock().await.insert(0, state);
        let replication_ended = || async {
            for _ in 0..500 {
                let state = &daemon.ranks.lock().await[&0];
                if !state.busy() || state.pending.is_some() {
                    return;
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            let state = &daemon.ranks.lock().await[&0];
            panic!(
                "the replication did not end: pending {:?}",
                state.pending.as_ref().map(|p| p.step)
            );
        };

        // On this single-threaded runtime, the replication starts after the rollback.
        snapshot(&daemon, 0, 79, 0, false, Vec::new())
            .await
            .unwrap();
        let rolled_back = Message::RolledBack {
            run: daemon.cfg.run.clone(),
            to: Some(50),
            epoch: 3,
            seq: 1,
        };
        assert!(uplink::pushed(&daemon, rolled_back).await);
        replication_ended().await;
        assert!(daemon.ranks.lock().await[&0].pending.is_none());
        assert!(to_leader.try_recv().is_err(), "nothing reported");

        snapshot(&daemon, 0, 51, 1, false, Vec::new())
            .await
            .unwrap();
        replication_ended().await;
        let pending = daemon.ranks.lock().await[&0]
            .pending
            .as_ref()
            .map(|p| p.step);
        assert_eq!(pending, Some(51));
        match to_leader.try_recv() {
            Ok(Message::Replicated { step, rollback, .. }) => {
                assert_eq!(step, 51);
                assert_eq!((rollback.epoch, rollback.seq), (3, 1));
            }
            other => panic!("expected the report of step 51, got {other:?}"),
        }
    }
}
