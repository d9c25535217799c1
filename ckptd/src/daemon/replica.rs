//! Buddy replicas (T1), both directions: sending a snapshot to the buddy while it is
//! hashed, receiving the buddy's snapshots, serving one back to a node that restores, and
//! fetching this node's own back from the buddy.
//!
//! A replica is written beside the current one and only replaces it once every chunk has
//! arrived and verified against its hash; `meta.json` is written last, so its presence
//! means complete. The data file of a replica let go is written into by the next one. File
//! work runs on blocking threads, not on the runtime's workers.

use std::net::SocketAddr;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{anyhow, bail, Context, Result};
use lazarus_shared::wire::{self, Frame, JobKey, Message, SlotChunking, SlotTensor, WireError};
use lazarus_shared::{ChunkHash, Rank, RunId};
use serde::{Deserialize, Serialize};
use tokio::net::TcpStream;

use super::slots::{chunks_of, read_run, reserve, runs};
use super::{framing, Daemon, SLOT_CHUNK_BYTES};
use lazarus_shared::store::FileSource;

/// A replica's description (`meta.json`, written last: its presence means complete).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ReplicaMeta {
    pub from_node: String,
    pub run: RunId,
    pub rank: Rank,
    pub world_size: u32,
    pub step: u64,
    pub slot_bytes: u64,
    pub tensors: Vec<SlotTensor>,
    /// The hashes of the slot's chunks, as `chunking` cut it.
    pub chunks: Vec<ChunkHash>,
    /// How the sender cut the slot into chunks (a replica saved without it: `Fixed`).
    #[serde(default)]
    pub chunking: SlotChunking,
    pub blobs: Vec<(String, Vec<u8>)>,
}

/// Where this daemon keeps the replicas it holds: `rank-R/step-S` under it.
fn replicas_root(daemon: &Daemon) -> PathBuf {
    daemon
        .cfg
        .shm_dir
        .join(daemon.cfg.run.as_str())
        .join("replicas")
}

fn replica_dir(daemon: &Daemon, rank: Rank) -> PathBuf {
    replicas_root(daemon).join(format!("rank-{rank}"))
}

/// Receives a replica from its sender's daemon and swaps it in. `handed_over`: the sender's
/// mark when its rank handed the snapshot over (`ReplicaBegin::rollback`).
pub async fn receive(
    daemon: &Arc<Daemon>,
    stream: &mut TcpStream,
    mut meta: ReplicaMeta,
    chunk_bytes: u64,
    handed_over: wire::RollbackMark,
) -> Result<()> {
    if meta.run != daemon.cfg.run {
        bail!(
            "replica of run {}, this daemon serves {}",
            meta.run,
            daemon.cfg.run
        );
    }
    if chunk_bytes != SLOT_CHUNK_BYTES {
        bail!("replica chunks of {chunk_bytes} bytes, expected {SLOT_CHUNK_BYTES}");
    }
    if meta.slot_bytes > daemon.cfg.memory_budget_bytes {
        bail!(
            "a replica of {} bytes is over memory_budget_bytes {}",
            meta.slot_bytes,
            daemon.cfg.memory_budget_bytes
        );
    }
    let _guard = daemon.replicas.lock().await;
    // Under the lock: a rollback applied before this point is seen here, and one applied
    // after removes this replica once it is swapped in (`forget_after` waits for the lock).
    let applied = *daemon.rollback.lock().expect("not poisoned");
    if handed_over.epoch == applied.epoch && handed_over.seq < applied.seq {
        // The sender's rank handed it over before a rollback this node applied (the sender
        // had not heard of it yet): the abandoned trajectory's.
        bail!(
            "rank {}'s snapshot of step {} was handed over before the run was rolled back",
            meta.rank,
            meta.step
        );
    }
    let dir = replica_dir(daemon, meta.rank);
    let incoming = dir.join("incoming");
    let file = {
        let (dir, incoming, slot_bytes) = (dir.clone(), incoming.clone(), meta.slot_bytes);
        Arc::new(tokio::task::spawn_blocking(move || prepare(&dir, &incoming, slot_bytes)).await??)
    };
    let ranges = chunks_of(meta.chunking, meta.slot_bytes, &meta.tensors)?;
    let mut received = vec![None; ranges.len()];
    loop {
        let frame = framing::read(&daemon.key, stream).await?;
        match frame.message {
            Message::ReplicaData { index, hash } => {
                let slot = received.get_mut(index as usize).ok_or_else(|| {
                    WireError::Malformed(format!("chunk index {index} out of range"))
                })?;
                let range = &ranges[index as usize];
                let (offset, len) = (range.start, range.end - range.start);
                if frame.payload.len() as u64 != len {
                    bail!(WireError::Malformed(format!(
                        "chunk {index} has {} bytes, expected {len}",
                        frame.payload.len()
                    )));
                }
                if !write_chunk(&file, offset, hash, frame).await? {
                    bail!(WireError::Malformed(format!(
                        "chunk {index} does not hash to its name"
                    )));
                }
                *slot = Some(hash);
                if index == 0 {
                    super::crash::point("replica-in");
                }
            }
            Message::ReplicaEnd { chunks } => {
                let complete: Option<Vec<ChunkHash>> = received.iter().copied().collect();
                if complete.as_ref() != Some(&chunks) {
                    bail!(WireError::Malformed(
                        "replica ended incomplete or with other hashes".into()
                    ));
                }
                meta.chunks = chunks;
                break;
            }
            other => bail!(WireError::Malformed(format!("{other:?} inside a replica"))),
        }
    }
    let (rank, step, from) = (meta.rank, meta.step, meta.from_node.clone());
    let uploads = daemon.replica_uploads.clone();
    let held =
        tokio::task::spawn_blocking(move || swap_in(&dir, &incoming, &meta, &uploads)).await??;
    daemon.metrics.replicas_held_bytes.set(held as i64);
    tracing::debug!(rank, step, %from, "replica stored");
    Ok(())
}

/// An empty `incoming` replica directory with its data file sized and reserved: the spare
/// (see [`swap_in`]) when it has the size, since its pages are allocated already and writing
/// into it is a copy, where reserving a fresh file's pages zeroes each of them first (a third
/// of the receiving daemon's work per replica was that, and putting the pages in the page
/// cache and freeing them again).
fn prepare(dir: &Path, incoming: &Path, slot_bytes: u64) -> Result<std::fs::File> {
    let _ = std::fs::remove_dir_all(incoming);
    let spare = dir.join(SPARE);
    let data_path = incoming.join("data");
    let sized = std::fs::metadata(spare.join("data")).is_ok_and(|m| m.len() == slot_bytes);
    if sized && std::fs::rename(&spare, incoming).is_ok() {
        // Every byte of it was reserved and written when it was a replica.
        return Ok(std::fs::OpenOptions::new().write(true).open(&data_path)?);
    }
    let _ = std::fs::remove_dir_all(&spare);
    std::fs::create_dir_all(incoming)?;
    let file = std::fs::File::create(&data_path)?;
    file.set_len(slot_bytes)
        .with_context(|| format!("sizing {}", data_path.display()))?;
    reserve(&file, slot_bytes, &data_path)?;
    Ok(file)
}

/// The directory, beside a rank's `step-<k>` replicas, that keeps the data file of the last
/// replica let go for the next one to be written into. It has no `meta.json`, so it is never
/// taken for a replica.
const SPARE: &str = "spare";

/// Completes a received replica (`meta.json` last) and swaps it in as `step-<k>`, keeping the
/// two newest of the rank and those in `uploads` (being uploaded: looked up under its lock,
/// so an upload that starts after the look finds a replica let go already gone); the data
/// file of an older one becomes the spare when there is none. Returns the bytes of replica
/// data held for all ranks, spares included.
fn swap_in(
    dir: &Path,
    incoming: &Path,
    meta: &ReplicaMeta,
    uploads: &std::sync::Mutex<Vec<(Rank, u64)>>,
) -> Result<u64> {
    std::fs::write(incoming.join("meta.json"), serde_json::to_vec(meta)?)?;
    let target = dir.join(format!("step-{}", meta.step));
    let _ = std::fs::remove_dir_all(&target);
    std::fs::rename(incoming, &target)?;
    // Keep the two newest: the newest may be a step the leader never memory-commits (its
    // sender died before every rank reported), and then the one before it is the committed
    // one. A sender only starts a replica after its previous one was committed or dropped,
    // so two are always enough.
    let mut steps: Vec<(u64, PathBuf)> = std::fs::read_dir(dir)?
        .flatten()
        .filter_map(|entry| {
            let name = entry.file_name().to_str()?.to_string();
            let step = name.strip_prefix("step-")?.parse().ok()?;
            Some((step, entry.path()))
        })
        .collect();
    steps.sort_by_key(|(step, _)| std::cmp::Reverse(*step));
    let spare = dir.join(SPARE);
    let uploads = uploads.lock().unwrap_or_else(|p| p.into_inner());
    for (_, path) in steps
        .iter()
        .skip(2)
        .filter(|(step, _)| !uploads.contains(&(meta.rank, *step)))
    {
        // Its description goes first: from then on it is no replica, whatever happens next.
        let _ = std::fs::remove_file(path.join("meta.json"));
        if spare.exists() || std::fs::rename(path, &spare).is_err() {
            let _ = std::fs::remove_dir_all(path);
        }
    }
    drop(uploads);
    let mut held = 0;
    for rank_dir in std::fs::read_dir(dir.parent().expect("has a parent"))?.flatten() {
        for step_dir in std::fs::read_dir(rank_dir.path())?.flatten() {
            held += std::fs::metadata(step_dir.path().join("data"))
                .map(|m| m.len())
                .unwrap_or(0);
        }
    }
    Ok(held)
}

/// Writes one replica chunk at `offset` of `file` if it hashes to `hash`; false if not.
async fn write_chunk(
    file: &Arc<std::fs::File>,
    offset: u64,
    hash: ChunkHash,
    frame: Frame,
) -> Result<bool> {
    let file = file.clone();
    let small = frame.payload.len() < wire::PAYLOAD_BLOCKING;
    let write = move || {
        // A hashed frame's reader already hashed the payload (one pass for the MAC and the
        // name); a plain frame's payload is hashed here.
        let found = frame
            .payload_hash
            .unwrap_or_else(|| ChunkHash::of(&frame.payload));
        if found != hash {
            return Ok(false);
        }
        file.write_all_at(&frame.payload, offset)?;
        Ok(true)
    };
    // A chunk under `PAYLOAD_BLOCKING` (a small region's) is written at once: a blocking task
    // each costs more than that.
    if small {
        return write();
    }
    tokio::task::spawn_blocking(write).await?
}

/// Removes the replicas held here of steps after `to` (`None`: all of them): the run was
/// rolled back, and they belong to the abandoned trajectory. Called after the rollback's mark
/// is applied: a replica being received when this takes the lock was swapped in first and is
/// removed with the others, and one that comes after sees the mark (`receive`).
pub async fn forget_after(daemon: &Daemon, to: Option<u64>) -> Result<()> {
    let root = replicas_root(daemon);
    let _guard = daemon.replicas.lock().await;
    tokio::task::spawn_blocking(move || {
        for rank_dir in std::fs::read_dir(&root).into_iter().flatten().flatten() {
            for step_dir in std::fs::read_dir(rank_dir.path())?.flatten() {
                let name = step_dir.file_name();
                let step = name
                    .to_str()
                    .and_then(|n| n.strip_prefix("step-"))
                    .and_then(|n| n.parse::<u64>().ok());
                if step.is_some_and(|step| to.is_none_or(|to| step > to)) {
                    // Gone already (an operator's cleanup) is as good as removed: that
                    // error must not leave the later ones here.
                    match std::fs::remove_dir_all(step_dir.path()) {
                        Err(error) if error.kind() != std::io::ErrorKind::NotFound => {
                            return Err(error).with_context(|| {
                                format!("removing {}", step_dir.path().display())
                            });
                        }
                        _ => {}
                    }
                }
            }
        }
        Ok(())
    })
    .await?
}

/// The complete replica of `rank`'s `step` held here: its data file and description.
pub fn held(daemon: &Daemon, rank: Rank, step: u64) -> Result<Option<(PathBuf, ReplicaMeta)>> {
    let dir = replica_dir(daemon, rank).join(format!("step-{step}"));
    match std::fs::read(dir.join("meta.json")) {
        Ok(bytes) => Ok(Some((dir.join("data"), serde_json::from_slice(&bytes)?))),
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(error) => Err(error.into()),
    }
}

/// Streams this daemon's replica of (rank, step) back to the asker.
pub async fn send(
    daemon: &Arc<Daemon>,
    stream: &mut TcpStream,
    rank: Rank,
    step: u64,
) -> Result<()> {
    let dir = replica_dir(daemon, rank).join(format!("step-{step}"));
    let meta = match held(daemon, rank, step)? {
        Some((_, meta)) => meta,
        None => {
            let reply = Message::Ack {
                ok: false,
                reason: format!("no replica of rank {rank} step {step} here"),
            };
            return framing::write(&daemon.key, stream, &reply, &[]).await;
        }
    };
    let (specs, payload) = wire::pack_blobs(&meta.blobs);
    let ranges = chunks_of(meta.chunking, meta.slot_bytes, &meta.tensors)?;
    if ranges.len() != meta.chunks.len() {
        bail!(
            "the replica of rank {rank} step {step} lists {} chunks of {}",
            meta.chunks.len(),
            ranges.len()
        );
    }
    let begin = Message::ReplicaBegin {
        from_node: daemon.cfg.node.clone(),
        run: meta.run.clone(),
        rank,
        world_size: meta.world_size,
        step,
        slot_bytes: meta.slot_bytes,
        chunk_bytes: SLOT_CHUNK_BYTES,
        tensors: meta.tensors.clone(),
        blobs: specs,
        // A replica fetched back restores what the leader chose: no mark is checked.
        rollback: Default::default(),
        chunking: meta.chunking,
    };
    framing::write(&daemon.key, stream, &begin, &payload).await?;
    let file = Arc::new(FileSource::open(&dir.join("data"))?);
    for run in runs(&ranges) {
        for (index, data) in run.clone().zip(read_run(&file, &ranges[run]).await?) {
            let hash = &meta.chunks[index];
            let message = Message::ReplicaData {
                index: index as u32,
                hash: *hash,
            };
            // Named by the hash taken when the replica arrived: bytes changed since then do
            // not hash to it, and the asker refuses the frame.
            framing::write_hashed(&daemon.key, stream, &message, &data, hash).await?;
        }
    }
    framing::write(
        &daemon.key,
        stream,
        &Message::ReplicaEnd {
            chunks: meta.chunks.clone(),
        },
        &[],
    )
    .await
}

/// Sends one replica to the buddy.
#[derive(Debug)]
pub struct ReplicaSender {
    stream: TcpStream,
    key: JobKey,
}

impl ReplicaSender {
    /// Connects to the buddy and sends `begin` (a `ReplicaBegin`) with its blobs' bytes.
    pub async fn begin(
        daemon: &Daemon,
        buddy: SocketAddr,
        begin: Message,
        blob_bytes: &[u8],
    ) -> Result<Self> {
        let mut sender = Self {
            stream: framing::connect(buddy, "buddy").await?,
            key: daemon.key.clone(),
        };
        framing::write(&sender.key, &mut sender.stream, &begin, blob_bytes).await?;
        Ok(sender)
    }

    pub async fn data(&mut self, index: u32, hash: ChunkHash, data: &[u8]) -> Result<()> {
        let message = Message::ReplicaData { index, hash };
        framing::write_hashed(&self.key, &mut self.stream, &message, data, &hash).await
    }

    pub async fn end(mut self, chunks: Vec<ChunkHash>) -> Result<()> {
        let end = Message::ReplicaEnd { chunks };
        framing::write(&self.key, &mut self.stream, &end, &[]).await?;
        let reply = framing::read(&self.key, &mut self.stream)
            .await
            .context("the buddy did not acknowledge the replica")?;
        match reply.message {
            Message::Ack { ok: true, .. } => Ok(()),
            Message::Ack { reason, .. } => bail!("the buddy refused the replica: {reason}"),
            other => bail!("the buddy answered {other:?}"),
        }
    }
}

/// Fetches this node's rank's replica of `step` from the buddy into the slot opened as `file`,
/// verifying every chunk. Returns the chunk hashes, how the buddy cut the slot into those
/// chunks, and the blobs.
#[allow(clippy::too_many_arguments)]
pub async fn fetch(
    daemon: &Arc<Daemon>,
    holder: Option<SocketAddr>,
    rank: Rank,
    step: u64,
    world_size: u32,
    slot_bytes: u64,
    tensors: &[SlotTensor],
    file: std::fs::File,
) -> Result<(Vec<ChunkHash>, SlotChunking, Vec<(String, Vec<u8>)>)> {
    let buddy = holder
        .or(*daemon.buddy.lock().expect("not poisoned"))
        .ok_or_else(|| anyhow!("no buddy configured, and the leader knows no replica"))?;
    let mut stream = framing::connect(buddy, "buddy").await?;
    let request = Message::FetchReplica {
        run: daemon.cfg.run.clone(),
        rank,
        step,
    };
    framing::write(&daemon.key, &mut stream, &request, &[]).await?;
    let first = framing::read(&daemon.key, &mut stream).await?;
    let (blobs, chunking) = match first.message {
        Message::ReplicaBegin {
            rank: r,
            world_size: w,
            step: s,
            slot_bytes: b,
            tensors: t,
            blobs,
            chunking,
            ..
        } => {
            if r != rank || w != world_size || s != step || b != slot_bytes || t != tensors {
                bail!(
                    "the buddy's replica has another layout (rank {r} of {w}, step {s}, {b} bytes)"
                );
            }
            (wire::unpack_blobs(&blobs, &first.payload)?, chunking)
        }
        Message::Ack { reason, .. } => bail!("{reason}"),
        other => bail!("the buddy answered {other:?}"),
    };
    let ranges = chunks_of(chunking, slot_bytes, tensors)?;
    let file = Arc::new(file);
    let mut hashes = Vec::new();
    loop {
        let frame = framing::read(&daemon.key, &mut stream).await?;
        match frame.message {
            Message::ReplicaData { index, hash } => {
                if index as usize != hashes.len() {
                    bail!("chunk {index} arrived out of order");
                }
                let range = ranges.get(hashes.len()).ok_or_else(|| {
                    anyhow!("chunk {index} is past the slot's {} chunks", ranges.len())
                })?;
                if frame.payload.len() as u64 != range.end - range.start {
                    bail!(
                        "replica chunk {index} has {} bytes, expected {}",
                        frame.payload.len(),
                        range.end - range.start
                    );
                }
                if !write_chunk(&file, range.start, hash, frame).await? {
                    bail!("replica chunk {index} of rank {rank} step {step} does not verify");
                }
                hashes.push(hash);
            }
            Message::ReplicaEnd { chunks } => {
                if chunks != hashes || hashes.len() != ranges.len() {
                    bail!("the replica ended incomplete");
                }
                break;
            }
            other => bail!("unexpected {other:?} in a replica"),
        }
    }
    Ok((
        hashes,
        chunking,
        blobs.into_iter().map(|(n, b)| (n, b.to_vec())).collect(),
    ))
}

/// Every complete replica held here, for the node's hello: a new leader learns from them
/// which steps the lost nodes' ranks reached, and where their replicas are.
pub async fn all_held(daemon: &Daemon) -> Vec<wire::ReplicaEntry> {
    let root = replicas_root(daemon);
    tokio::task::spawn_blocking(move || {
        let mut entries = Vec::new();
        for rank_dir in std::fs::read_dir(&root).into_iter().flatten().flatten() {
            for step_dir in std::fs::read_dir(rank_dir.path())
                .into_iter()
                .flatten()
                .flatten()
            {
                let Ok(bytes) = std::fs::read(step_dir.path().join("meta.json")) else {
                    continue;
                };
                if let Ok(meta) = serde_json::from_slice::<ReplicaMeta>(&bytes) {
                    entries.push(wire::ReplicaEntry {
                        run: meta.run,
                        rank: meta.rank,
                        world_size: meta.world_size,
                        step: meta.step,
                        from_node: meta.from_node,
                    });
                }
            }
        }
        entries
    })
    .await
    .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn meta(step: u64, slot_bytes: u64) -> ReplicaMeta {
        ReplicaMeta {
            from_node: "n2".into(),
            run: "run".parse().unwrap(),
            rank: 1,
            world_size: 2,
            step,
            slot_bytes,
            tensors: Vec::new(),
            chunks: Vec::new(),
            chunking: SlotChunking::Regions,
            blobs: Vec::new(),
        }
    }

    /// A `meta.json` and a `state.json` T0 saved before the slot's cut was saved with its
    /// hashes read as cut in fixed steps, which is how they were hashed.
    #[test]
    fn hashes_saved_without_their_cut_are_of_the_fixed_cut() {
        let mut saved = serde_json::to_value(meta(4, 64)).unwrap();
        saved.as_object_mut().unwrap().remove("chunking").unwrap();
        let read: ReplicaMeta = serde_json::from_value(saved).unwrap();
        assert_eq!(read.chunking, SlotChunking::Fixed);
        let t0 = r#"{"step":4,"slot":1,"hashes":[],"blobs":[],"durable_requested":true}"#;
        let read: super::super::rank::Snap = serde_json::from_str(t0).unwrap();
        assert_eq!(read.chunking, SlotChunking::Fixed);
    }

    /// Receives a replica of `step` (every byte `step`) as `receive` does: prepared, written,
    /// swapped in. Returns the bytes the prepared file held (zeros when fresh, a replica let
    /// go when it is the spare) and the bytes held after.
    fn replicate(dir: &Path, step: u8, slot_bytes: u64) -> (Vec<u8>, u64) {
        replicate_keeping(dir, step, slot_bytes, &[])
    }

    /// [`replicate`], with the replicas of the steps in `kept` being uploaded.
    fn replicate_keeping(dir: &Path, step: u8, slot_bytes: u64, kept: &[u64]) -> (Vec<u8>, u64) {
        let incoming = dir.join("incoming");
        let file = prepare(dir, &incoming, slot_bytes).unwrap();
        let found = std::fs::read(incoming.join("data")).unwrap();
        file.write_all_at(&vec![step; slot_bytes as usize], 0)
            .unwrap();
        let meta = meta(step.into(), slot_bytes);
        let uploads = std::sync::Mutex::new(kept.iter().map(|&k| (meta.rank, k)).collect());
        let held = swap_in(dir, &incoming, &meta, &uploads).unwrap();
        (found, held)
    }

    /// A replica being uploaded as its rank's shard is kept whole however many newer ones
    /// come: it is never the spare that the next one is written into while the upload reads
    /// it. Once its upload ended, the next replica lets it go.
    #[test]
    fn a_replica_being_uploaded_is_never_the_spare() {
        let root = tempfile::tempdir().unwrap();
        let dir = root.path().join("rank-1");
        std::fs::create_dir_all(&dir).unwrap();
        replicate(&dir, 1, 4096);
        replicate(&dir, 2, 4096);
        for step in 3..=5 {
            let (found, _) = replicate_keeping(&dir, step, 4096, &[1]);
            assert_ne!(found, vec![1u8; 4096], "step 1's file was written into");
            assert_eq!(
                std::fs::read(dir.join("step-1").join("data")).unwrap(),
                vec![1u8; 4096]
            );
            assert!(dir.join("step-1").join("meta.json").exists());
        }
        replicate(&dir, 6, 4096);
        assert!(!dir.join("step-1").exists());
    }

    #[test]
    fn a_let_go_replica_becomes_the_spare_that_the_next_one_is_written_into() {
        let root = tempfile::tempdir().unwrap();
        let dir = root.path().join("rank-1");
        std::fs::create_dir_all(&dir).unwrap();
        let fresh = |len| vec![0u8; len];
        assert_eq!(replicate(&dir, 1, 4096).0, fresh(4096));
        assert_eq!(replicate(&dir, 2, 4096).0, fresh(4096));
        assert!(!dir.join(SPARE).exists(), "two replicas are kept whole");
        // The third lets step 1 go: its file is the spare, and no replica any more.
        let (found, held) = replicate(&dir, 3, 4096);
        assert_eq!(found, fresh(4096));
        assert!(!dir.join("step-1").exists());
        assert!(!dir.join(SPARE).join("meta.json").exists());
        assert_eq!(held, 3 * 4096, "the spare's pages count as held");
        // The fourth is written into it, and holds its own bytes.
        assert_eq!(replicate(&dir, 4, 4096).0, vec![1u8; 4096]);
        assert_eq!(
            std::fs::read(dir.join("step-4").join("data")).unwrap(),
            vec![4u8; 4096]
        );
        let steps: Vec<u8> = [2, 3, 4]
            .into_iter()
            .filter(|step| dir.join(format!("step-{step}")).exists())
            .collect();
        assert_eq!(steps, [3, 4]);
        assert!(dir.join("step-3").join("meta.json").exists());
        // Step 2's file is the spare now; a replica of another size gets a fresh file.
        assert_eq!(replicate(&dir, 5, 8192).0, fresh(8192));
        // Steps 3's and 4's files (4096 bytes) are the spare in turn, and not taken: steps 6
        // and 7 are fresh. Step 5's (8192 bytes) is the next spare, and step 8 takes it.
        assert_eq!(replicate(&dir, 6, 8192).0, fresh(8192));
        assert_eq!(replicate(&dir, 7, 8192).0, fresh(8192));
        assert_eq!(replicate(&dir, 8, 8192).0, vec![5u8; 8192]);
        assert_eq!(
            std::fs::read(dir.join("step-8").join("data")).unwrap(),
            vec![8u8; 8192]
        );
    }
}
