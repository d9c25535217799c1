//! Restores: which step a (re)started rank's world resumes from (asked of the leader), and
//! serving it from T0 (this node's slot, re-hashed), T1 (the buddy's replica) or T2
//! (storage, in whatever layout the step was written).
//!
//! The ranks lock is taken only to read what a restore needs and to install its result: the
//! re-hash of a T0 slot, the fetch from the buddy and the read from storage run without it,
//! so heartbeats, other ranks' polls and snapshots never wait for a restore (a T2 restore
//! can take minutes). The slot a restore fills is held as `restoring` meanwhile.

use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};
use lazarus_shared::store::RestoreChoice;
use lazarus_shared::wire::{self, Message, SlotTensor, Tier};
use lazarus_shared::{ChunkHash, Rank, StepKey};

use super::rank::{RankState, Snap};
use super::slots::{chunk_count, read_chunk, verify_slot, MappedFile};
use super::{replica, Daemon};

/// The steps a world of this rank's size could restore: the leader's newest memory-committed
/// step, and the newest durable one. Waits first (up to 10 s) for the previous life's
/// snapshot to be replicated and reported, so its memory commit can still count; a
/// replication that takes longer is going to a buddy that is gone or cut off, and its step
/// would not be committed anyway. A durable upload in flight is not waited for: it holds
/// its own slot, and the memory step is newer.
pub async fn choose(daemon: &Arc<Daemon>, rank: Rank) -> Result<super::uplink::Offer> {
    let deadline = Instant::now() + Duration::from_secs(10);
    let world_size = loop {
        {
            let ranks = daemon.ranks.lock().await;
            let state = ranks
                .get(&rank)
                .ok_or_else(|| anyhow!("rank {rank} vanished"))?;
            if state.working.is_none() || Instant::now() > deadline {
                break state.world_size;
            }
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    match super::uplink::which_step(daemon, world_size, rank).await {
        Ok(offer) => {
            if let Some(state) = daemon.ranks.lock().await.get_mut(&rank) {
                state.replica_at = offer.replica.as_ref().and_then(|a| a.parse().ok());
            }
            Ok(offer)
        }
        Err(error) => {
            tracing::warn!(error = %format!("{error:#}"), "the leader did not answer; offering the latest durable step");
            Ok(super::uplink::Offer {
                durable: daemon.run.latest().await?,
                ..Default::default()
            })
        }
    }
}

/// Serves the step the ranks agreed on from T0, T1 or T2 (see `Message::Restore`), without
/// the ranks lock across any of its I/O (see the module's comment).
pub async fn restore(
    daemon: &Arc<Daemon>,
    rank: Rank,
    memory: Option<u64>,
    durable: Option<u64>,
) -> Result<(Message, Vec<u8>)> {
    let (slot_bytes, tensors, world_size, candidate, holder) = {
        let ranks = daemon.ranks.lock().await;
        let state = ranks
            .get(&rank)
            .ok_or_else(|| anyhow!("rank {rank} vanished"))?;
        (
            state.slot_bytes,
            state.tensors.clone(),
            state.world_size,
            state.memory_candidate(memory),
            state.replica_at,
        )
    };
    if let Some(m) = memory {
        if let Some((path, snap)) = candidate {
            match verify_slot(&path, slot_bytes, &snap.hashes).await {
                Ok(()) => return install(daemon, rank, Some(snap), Tier::T0).await,
                Err(error) => {
                    daemon.metrics.error("t0_corrupt");
                    tracing::warn!(rank, step = m, error = %format!("{error:#}"), "T0 does not verify; trying the buddy");
                }
            }
        }
        let (slot, path) = begin_fill(daemon, rank, Some(m)).await?;
        let fetched = replica::fetch(
            daemon, holder, rank, m, world_size, slot_bytes, &tensors, &path,
        )
        .await;
        match fetched {
            Ok((hashes, blobs)) => {
                let snap = Snap {
                    step: m,
                    slot,
                    hashes,
                    blobs,
                    durable_requested: false,
                };
                return install(daemon, rank, Some(snap), Tier::T1).await;
            }
            Err(error) => {
                end_fill(daemon, rank).await;
                daemon.metrics.error("t1_unavailable");
                tracing::warn!(rank, step = m, error = %format!("{error:#}"), "no replica at the buddy; trying storage");
            }
        }
    }
    // Storage only now: a restore from memory never waits for the store.
    let durable = match RestoreChoice::new(memory, durable).from_storage(durable) {
        Some(d) => Some(daemon.run.resolve_step(&d.to_string()).await?),
        None => None,
    };
    let Some(durable) = durable else {
        if let Some(m) = memory {
            bail!("step {m} is memory-committed but neither this node (T0), the buddy (T1) nor storage has it for rank {rank}");
        }
        return install(daemon, rank, None, Tier::T2).await;
    };
    let (slot, path) = begin_fill(daemon, rank, None).await?;
    let read = read_from_store(daemon, durable, slot_bytes, &tensors, &path).await;
    let (hashes, blobs) = match read {
        Ok(read) => read,
        Err(error) => {
            end_fill(daemon, rank).await;
            return Err(error);
        }
    };
    let snap = Snap {
        step: durable.step,
        slot,
        hashes,
        blobs,
        durable_requested: false,
    };
    install(daemon, rank, Some(snap), Tier::T2).await
}

/// Claims a free slot for a restore to fill. The snapshots the rank had are given up, but
/// T0 only when it is not the step wanted (`keep`): it may still serve a later attempt.
async fn begin_fill(daemon: &Arc<Daemon>, rank: Rank, keep: Option<u64>) -> Result<(u32, PathBuf)> {
    let mut ranks = daemon.ranks.lock().await;
    let state = ranks
        .get_mut(&rank)
        .ok_or_else(|| anyhow!("rank {rank} vanished"))?;
    let slot = state.begin_fill(keep)?;
    Ok((slot, state.slot_path(slot)))
}

/// A fill that failed lets its slot go.
async fn end_fill(daemon: &Arc<Daemon>, rank: Rank) {
    if let Some(state) = daemon.ranks.lock().await.get_mut(&rank) {
        state.end_fill();
    }
}

/// Makes a restored snapshot the rank's T0 (or records that there is none) and answers.
async fn install(
    daemon: &Arc<Daemon>,
    rank: Rank,
    snap: Option<Snap>,
    tier: Tier,
) -> Result<(Message, Vec<u8>)> {
    let mut ranks = daemon.ranks.lock().await;
    let state = ranks
        .get_mut(&rank)
        .ok_or_else(|| anyhow!("rank {rank} vanished"))?;
    let found = snap.is_some();
    state.install(snap)?;
    state.restored_from = found.then_some(tier);
    if found {
        return Ok(served(daemon, state, tier));
    }
    Ok((
        Message::Restored {
            step: None,
            slot: None,
            tier: None,
            blobs: Vec::new(),
            held: state.held(),
        },
        Vec::new(),
    ))
}

fn served(daemon: &Daemon, state: &RankState, tier: Tier) -> (Message, Vec<u8>) {
    let snap = state.t0.as_ref().expect("just set");
    daemon.metrics.restored(tier.name());
    tracing::info!(
        rank = state.rank,
        step = snap.step,
        tier = tier.name(),
        "restore served"
    );
    let (specs, payload) = wire::pack_blobs(&snap.blobs);
    (
        Message::Restored {
            step: Some(snap.step),
            slot: Some(snap.slot),
            tier: Some(tier),
            blobs: specs,
            held: state.held(),
        },
        payload,
    )
}

/// Reads this rank's regions of a durable step into `path` (any layout the step was written
/// in), then hashes the slot.
async fn read_from_store(
    daemon: &Arc<Daemon>,
    step: StepKey,
    slot_bytes: u64,
    tensors: &[SlotTensor],
    path: &Path,
) -> Result<(Vec<ChunkHash>, Vec<(String, Vec<u8>)>)> {
    let checkpoint = daemon.run.open_checkpoint(step).await?;
    let file = std::fs::OpenOptions::new().write(true).open(path)?;
    checkpoint
        .read_regions(tensors, &(), |region, data| {
            file.write_all_at(&data, region.offset)
                .with_context(|| format!("writing {}", path.display()))
        })
        .await?;
    let mut blobs = Vec::new();
    for name in [
        lazarus_shared::progress::TRAINER_BLOB,
        lazarus_shared::hf_olmoe::MODEL_BLOB,
    ] {
        if checkpoint.manifest(0)?.blob(name).is_some() {
            blobs.push((name.to_string(), checkpoint.read_blob(0, name).await?));
        }
    }
    let source = MappedFile::open(path)?;
    let mut hashes = Vec::new();
    for index in 0..chunk_count(slot_bytes) {
        let data = read_chunk(&source, slot_bytes, index).await?;
        hashes.push(tokio::task::spawn_blocking(move || ChunkHash::of(&data)).await?);
    }
    Ok((hashes, blobs))
}
