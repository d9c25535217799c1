//! TCP between daemons: buddy replicas (T1) in and out, and the leader's side of the link.
//!
//! Every frame must carry the job key's MAC. A frame that does not, or that is malformed,
//! oversized or out of place, is counted in `peer_messages_rejected` and its connection is
//! dropped; nothing it said is acted on. A replica is written beside the current one and
//! only replaces it once every chunk has arrived and verified.

use std::net::SocketAddr;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{anyhow, bail, Context, Result};
use bytes::Bytes;
use lazarus_shared::wire::{self, Message, SlotTensor, WireError};
use lazarus_shared::{ChunkHash, Rank, RunId};
use serde::{Deserialize, Serialize};
use tokio::net::{TcpListener, TcpStream};

use super::slots::{chunk_count, read_chunk, reserve, SlotFile};
use super::{Daemon, SLOT_CHUNK_BYTES};

/// How long a peer may take to send the next frame of a conversation.
const FRAME_TIMEOUT: Duration = Duration::from_secs(30);

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
    pub chunks: Vec<ChunkHash>,
    pub blobs: Vec<(String, Vec<u8>)>,
}

fn replica_dir(daemon: &Daemon, rank: Rank) -> PathBuf {
    daemon
        .cfg
        .shm_dir
        .join(daemon.cfg.run.as_str())
        .join("replicas")
        .join(format!("rank-{rank}"))
}

pub async fn serve(daemon: Arc<Daemon>, listener: TcpListener) {
    loop {
        match listener.accept().await {
            Ok((stream, from)) => {
                let daemon = daemon.clone();
                tokio::spawn(async move {
                    let _ = stream.set_nodelay(true);
                    if let Err(error) = connection(&daemon, stream, from).await {
                        match error.downcast_ref::<WireError>() {
                            Some(WireError::Closed) => {}
                            Some(wire) => {
                                daemon.metrics.rejected(wire.cause());
                                tracing::warn!(%from, error = %wire, "dropped a peer message");
                            }
                            None => {
                                daemon.metrics.rejected("refused");
                                tracing::warn!(%from, error = %format!("{error:#}"), "refused a peer request");
                            }
                        }
                    }
                });
            }
            Err(error) => {
                tracing::warn!(%error, "accept on the peer port");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
}

async fn read(daemon: &Daemon, stream: &mut TcpStream) -> Result<wire::Frame> {
    Ok(
        tokio::time::timeout(FRAME_TIMEOUT, wire::read_frame(stream, Some(&daemon.key)))
            .await
            .map_err(|_| anyhow!("peer sent nothing for {FRAME_TIMEOUT:?}"))??,
    )
}

async fn write(
    daemon: &Daemon,
    stream: &mut TcpStream,
    message: &Message,
    payload: &[u8],
) -> Result<()> {
    Ok(wire::write_frame(stream, message, payload, Some(&daemon.key)).await?)
}

async fn connection(daemon: &Arc<Daemon>, mut stream: TcpStream, from: SocketAddr) -> Result<()> {
    let first = read(daemon, &mut stream).await?;
    match first.message {
        Message::ReplicaBegin {
            from_node,
            run,
            rank,
            world_size,
            step,
            slot_bytes,
            chunk_bytes,
            tensors,
            blobs,
        } => {
            let blobs = wire::unpack_blobs(&blobs, &first.payload)?;
            let meta = ReplicaMeta {
                from_node,
                run,
                rank,
                world_size,
                step,
                slot_bytes,
                tensors,
                chunks: Vec::new(),
                blobs: blobs.into_iter().map(|(n, b)| (n, b.to_vec())).collect(),
            };
            let result = receive_replica(daemon, &mut stream, meta, chunk_bytes).await;
            let ack = match &result {
                Ok(()) => Message::Ack {
                    ok: true,
                    reason: String::new(),
                },
                Err(error) => Message::Ack {
                    ok: false,
                    reason: format!("{error:#}"),
                },
            };
            // A peer that broke the protocol gets no answer; one we could not serve does.
            if result
                .as_ref()
                .err()
                .and_then(|e| e.downcast_ref::<WireError>())
                .is_none()
            {
                write(daemon, &mut stream, &ack, &[]).await?;
            }
            result
        }
        Message::FetchReplica { run, rank, step } => {
            if run != daemon.cfg.run {
                bail!("fetch for run {run}, this daemon serves {}", daemon.cfg.run);
            }
            send_replica(daemon, &mut stream, rank, step).await
        }
        Message::NodeHello { .. } => match &daemon.leader {
            Some(leader) => {
                leader
                    .clone()
                    .node_session(daemon, stream, first.message, from)
                    .await
            }
            None => bail!("a node said hello, but this daemon is not the leader"),
        },
        Message::WhichStep {
            run,
            world_size,
            rank,
        } => {
            let reply = leader_of(daemon, "which step")?
                .which_step(&run, world_size, rank)
                .await?;
            write(daemon, &mut stream, &reply, &[]).await
        }
        Message::EventsRequest => {
            let reply = Message::Events(leader_of(daemon, "events")?.events().await);
            write(daemon, &mut stream, &reply, &[]).await
        }
        Message::StatusRequest => {
            let reply = Message::Status(leader_of(daemon, "status")?.status().await);
            write(daemon, &mut stream, &reply, &[]).await
        }
        other => bail!("unexpected first message {other:?}"),
    }
}

/// This daemon's leader role, for a request only the leader answers.
fn leader_of<'a>(daemon: &'a Daemon, asked: &str) -> Result<&'a Arc<super::leader::Leader>> {
    daemon
        .leader
        .as_ref()
        .ok_or_else(|| anyhow!("asked for {asked}, but this daemon is not the leader"))
}

async fn receive_replica(
    daemon: &Arc<Daemon>,
    stream: &mut TcpStream,
    mut meta: ReplicaMeta,
    chunk_bytes: u64,
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
    let dir = replica_dir(daemon, meta.rank);
    let incoming = dir.join("incoming");
    let _ = std::fs::remove_dir_all(&incoming);
    std::fs::create_dir_all(&incoming)?;
    let data_path = incoming.join("data");
    let file = std::fs::File::create(&data_path)?;
    file.set_len(meta.slot_bytes)
        .with_context(|| format!("sizing {}", data_path.display()))?;
    reserve(&file, meta.slot_bytes, &data_path)?;
    let file = Arc::new(file);
    let expected = chunk_count(meta.slot_bytes);
    let mut received = vec![None; expected as usize];
    loop {
        let frame = read(daemon, stream).await?;
        match frame.message {
            Message::ReplicaData { index, hash } => {
                let slot = received.get_mut(index as usize).ok_or_else(|| {
                    WireError::Malformed(format!("chunk index {index} out of range"))
                })?;
                let offset = u64::from(index) * SLOT_CHUNK_BYTES;
                let len = SLOT_CHUNK_BYTES.min(meta.slot_bytes - offset);
                if frame.payload.len() as u64 != len {
                    bail!(WireError::Malformed(format!(
                        "chunk {index} has {} bytes, expected {len}",
                        frame.payload.len()
                    )));
                }
                if !write_chunk(&file, offset, hash, frame.payload).await? {
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
    std::fs::write(incoming.join("meta.json"), serde_json::to_vec(&meta)?)?;
    // Swap in: the new replica becomes `step-<k>`; older ones go.
    let target = dir.join(format!("step-{}", meta.step));
    let _ = std::fs::remove_dir_all(&target);
    std::fs::rename(&incoming, &target)?;
    // Keep the two newest: the newest may be a step the leader never memory-commits (its
    // sender died before every rank reported), and then the one before it is the committed
    // one. A sender only starts a replica after its previous one was committed or dropped,
    // so two are always enough.
    let mut steps: Vec<(u64, PathBuf)> = std::fs::read_dir(&dir)?
        .flatten()
        .filter_map(|entry| {
            let name = entry.file_name().to_str()?.to_string();
            let step = name.strip_prefix("step-")?.parse().ok()?;
            Some((step, entry.path()))
        })
        .collect();
    steps.sort_by_key(|(step, _)| std::cmp::Reverse(*step));
    for (_, path) in steps.iter().skip(2) {
        let _ = std::fs::remove_dir_all(path);
    }
    let mut held = 0;
    for rank_dir in std::fs::read_dir(dir.parent().expect("has a parent"))?.flatten() {
        for step_dir in std::fs::read_dir(rank_dir.path())?.flatten() {
            held += std::fs::metadata(step_dir.path().join("data"))
                .map(|m| m.len())
                .unwrap_or(0);
        }
    }
    daemon.metrics.replicas_held_bytes.set(held as i64);
    tracing::debug!(rank = meta.rank, step = meta.step, from = %meta.from_node, "replica stored");
    Ok(())
}

/// Writes one replica chunk at `offset` of `file` if it hashes to `hash`; false if not.
async fn write_chunk(
    file: &Arc<std::fs::File>,
    offset: u64,
    hash: ChunkHash,
    payload: Bytes,
) -> Result<bool> {
    let hashed = payload.clone();
    let found = tokio::task::spawn_blocking(move || ChunkHash::of(&hashed)).await?;
    if found != hash {
        return Ok(false);
    }
    let file = file.clone();
    tokio::task::spawn_blocking(move || file.write_all_at(&payload, offset)).await??;
    Ok(true)
}

/// Streams this daemon's replica of (rank, step) back to the asker.
/// The complete replica of `rank`'s `step` held here: its data file and description.
pub fn held_replica(
    daemon: &Daemon,
    rank: Rank,
    step: u64,
) -> Result<Option<(PathBuf, ReplicaMeta)>> {
    let dir = replica_dir(daemon, rank).join(format!("step-{step}"));
    match std::fs::read(dir.join("meta.json")) {
        Ok(bytes) => Ok(Some((dir.join("data"), serde_json::from_slice(&bytes)?))),
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(error) => Err(error.into()),
    }
}

async fn send_replica(
    daemon: &Arc<Daemon>,
    stream: &mut TcpStream,
    rank: Rank,
    step: u64,
) -> Result<()> {
    let dir = replica_dir(daemon, rank).join(format!("step-{step}"));
    let meta = match held_replica(daemon, rank, step)? {
        Some((_, meta)) => meta,
        None => {
            let reply = Message::Ack {
                ok: false,
                reason: format!("no replica of rank {rank} step {step} here"),
            };
            return write(daemon, stream, &reply, &[]).await;
        }
    };
    let (specs, payload) = wire::pack_blobs(&meta.blobs);
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
    };
    write(daemon, stream, &begin, &payload).await?;
    let file = Arc::new(SlotFile::open(&dir.join("data"))?);
    for (index, hash) in meta.chunks.iter().enumerate() {
        let data = read_chunk(&file, meta.slot_bytes, index as u64).await?;
        let message = Message::ReplicaData {
            index: index as u32,
            hash: *hash,
        };
        write(daemon, stream, &message, &data).await?;
    }
    write(
        daemon,
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
    key: lazarus_shared::wire::JobKey,
}

impl ReplicaSender {
    /// Connects to the buddy and sends `begin` (a `ReplicaBegin`) with its blobs' bytes.
    pub async fn begin(
        daemon: &Daemon,
        buddy: SocketAddr,
        begin: Message,
        blob_bytes: &[u8],
    ) -> Result<Self> {
        let stream = tokio::time::timeout(Duration::from_secs(5), TcpStream::connect(buddy))
            .await
            .map_err(|_| anyhow!("buddy {buddy} did not accept within 5 s"))?
            .with_context(|| format!("connecting to buddy {buddy}"))?;
        stream.set_nodelay(true)?;
        let mut sender = Self {
            stream,
            key: daemon.key.clone(),
        };
        wire::write_frame(&mut sender.stream, &begin, blob_bytes, Some(&sender.key)).await?;
        Ok(sender)
    }

    pub async fn data(&mut self, index: u32, hash: ChunkHash, data: &[u8]) -> Result<()> {
        let message = Message::ReplicaData { index, hash };
        Ok(wire::write_frame(&mut self.stream, &message, data, Some(&self.key)).await?)
    }

    pub async fn end(mut self, chunks: Vec<ChunkHash>) -> Result<()> {
        wire::write_frame(
            &mut self.stream,
            &Message::ReplicaEnd { chunks },
            &[],
            Some(&self.key),
        )
        .await?;
        let reply = tokio::time::timeout(
            FRAME_TIMEOUT,
            wire::read_frame(&mut self.stream, Some(&self.key)),
        )
        .await
        .map_err(|_| anyhow!("the buddy did not acknowledge the replica"))??;
        match reply.message {
            Message::Ack { ok: true, .. } => Ok(()),
            Message::Ack { reason, .. } => bail!("the buddy refused the replica: {reason}"),
            other => bail!("the buddy answered {other:?}"),
        }
    }
}

/// Fetches this node's rank's replica of `step` from the buddy into the slot at `path`,
/// verifying every chunk. Returns the chunk hashes and the blobs.
#[allow(clippy::too_many_arguments)]
pub async fn fetch_replica(
    daemon: &Arc<Daemon>,
    holder: Option<SocketAddr>,
    rank: Rank,
    step: u64,
    world_size: u32,
    slot_bytes: u64,
    tensors: &[SlotTensor],
    path: &Path,
) -> Result<(Vec<ChunkHash>, Vec<(String, Vec<u8>)>)> {
    let buddy = holder
        .or(*daemon.buddy.lock().expect("not poisoned"))
        .ok_or_else(|| anyhow!("no buddy configured, and the leader knows no replica"))?;
    let mut stream = tokio::time::timeout(Duration::from_secs(5), TcpStream::connect(buddy))
        .await
        .map_err(|_| anyhow!("buddy {buddy} did not accept within 5 s"))?
        .with_context(|| format!("connecting to buddy {buddy}"))?;
    let request = Message::FetchReplica {
        run: daemon.cfg.run.clone(),
        rank,
        step,
    };
    write(daemon, &mut stream, &request, &[]).await?;
    let first = read(daemon, &mut stream).await?;
    let blobs = match first.message {
        Message::ReplicaBegin {
            rank: r,
            world_size: w,
            step: s,
            slot_bytes: b,
            tensors: t,
            blobs,
            ..
        } => {
            if r != rank || w != world_size || s != step || b != slot_bytes || t != tensors {
                bail!(
                    "the buddy's replica has another layout (rank {r} of {w}, step {s}, {b} bytes)"
                );
            }
            wire::unpack_blobs(&blobs, &first.payload)?
        }
        Message::Ack { reason, .. } => bail!("{reason}"),
        other => bail!("the buddy answered {other:?}"),
    };
    let file = Arc::new(std::fs::OpenOptions::new().write(true).open(path)?);
    let mut hashes = Vec::new();
    loop {
        let frame = read(daemon, &mut stream).await?;
        match frame.message {
            Message::ReplicaData { index, hash } => {
                if index as usize != hashes.len() {
                    bail!("chunk {index} arrived out of order");
                }
                let offset = u64::from(index) * SLOT_CHUNK_BYTES;
                if !write_chunk(&file, offset, hash, frame.payload).await? {
                    bail!("replica chunk {index} of rank {rank} step {step} does not verify");
                }
                hashes.push(hash);
            }
            Message::ReplicaEnd { chunks } => {
                if chunks != hashes || hashes.len() as u64 != chunk_count(slot_bytes) {
                    bail!("the replica ended incomplete");
                }
                break;
            }
            other => bail!("unexpected {other:?} in a replica"),
        }
    }
    Ok((
        hashes,
        blobs.into_iter().map(|(n, b)| (n, b.to_vec())).collect(),
    ))
}
