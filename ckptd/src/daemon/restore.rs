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

use super::rank::{next_change, Life, RankState, Snap};
use super::slots::{chunks_of, hash_ranges, verify_slot, MappedFile};
use super::{replica, Daemon, SLOT_CHUNKING};

/// The steps a world of this rank's size could restore: the leader's newest memory-committed
/// step, and the newest durable one. Waits first (up to 10 s) for the previous life's
/// snapshot to be replicated and reported, so its memory commit can still count; a
/// replication that takes longer is going to a buddy that is gone or cut off, and its step
/// would not be committed anyway. A durable upload in flight is not waited for: it holds
/// its own slot, and the memory step is newer.
pub async fn choose(daemon: &Arc<Daemon>, rank: Rank) -> Result<super::uplink::Offer> {
    let deadline = Instant::now() + Duration::from_secs(10);
    let world_size = loop {
        let changed = next_change(deadline);
        {
            let ranks = daemon.ranks.lock().await;
            let state = ranks
                .get(&rank)
                .ok_or_else(|| anyhow!("rank {rank} vanished"))?;
            if state.working.is_none() || Instant::now() > deadline {
                break state.world_size;
            }
        }
        changed.await;
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
    // A restore that an earlier process of the rank asked for may still be filling its slot
    // (it runs on after its process died): this one waits for it to end, since whatever
    // this one installs lets the rank write every slot not held, that one's included.
    let deadline = Instant::now() + SUPERSEDED_RESTORE_WAIT;
    let (slot_bytes, tensors, world_size, candidate, holder, asker) = loop {
        let changed = next_change(deadline);
        {
            let ranks = daemon.ranks.lock().await;
            let state = ranks
                .get(&rank)
                .ok_or_else(|| anyhow!("rank {rank} vanished"))?;
            match state.restoring {
                None => {
                    // A T0 candidate's slot is opened here, under the lock, where the file at
                    // its path is this state's (see `begin_fill`).
                    let candidate = state
                        .memory_candidate(memory)
                        .map(|(path, snap)| (MappedFile::open(&path), snap));
                    break (
                        state.slot_bytes,
                        state.tensors.clone(),
                        state.world_size,
                        candidate,
                        state.replica_at,
                        state.life(),
                    );
                }
                Some(slot) if Instant::now() > deadline => bail!(
                    "an earlier process's restore of rank {rank} still fills slot {slot} after {SUPERSEDED_RESTORE_WAIT:?}"
                ),
                Some(_) => {}
            }
        }
        changed.await;
    };
    if let Some(m) = memory {
        if let Some((file, snap)) = candidate {
            let verified = match file {
                Ok(file) => {
                    verify_slot(&file, slot_bytes, &tensors, snap.chunking, &snap.hashes).await
                }
                Err(error) => Err(error),
            };
            match verified {
                Ok(()) => return install(daemon, rank, asker, Some(snap), Tier::T0).await,
                Err(error) => {
                    daemon.metrics.error("t0_corrupt");
                    tracing::warn!(rank, step = m, error = %format!("{error:#}"), "T0 does not verify; trying the buddy");
                }
            }
        }
        let (slot, file, _) = begin_fill(daemon, rank, asker, Some(m)).await?;
        let fetched = replica::fetch(
            daemon, holder, rank, m, world_size, slot_bytes, &tensors, file,
        )
        .await;
        match fetched {
            Ok((hashes, chunking, blobs)) => {
                let snap = Snap {
                    step: m,
                    slot,
                    hashes,
                    chunking,
                    blobs,
                    durable_requested: false,
                };
                return install(daemon, rank, asker, Some(snap), Tier::T1).await;
            }
            Err(error) => {
                end_fill(daemon, rank, asker, slot).await;
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
        return install(daemon, rank, asker, None, Tier::T2).await;
    };
    let (slot, file, path) = begin_fill(daemon, rank, asker, None).await?;
    let read = read_from_store(daemon, durable, slot_bytes, &tensors, file, &path).await;
    let (hashes, blobs) = match read {
        Ok(read) => read,
        Err(error) => {
            end_fill(daemon, rank, asker, slot).await;
            return Err(error);
        }
    };
    let snap = Snap {
        step: durable.step,
        slot,
        hashes,
        chunking: SLOT_CHUNKING,
        blobs,
        durable_requested: false,
    };
    install(daemon, rank, asker, Some(snap), Tier::T2).await
}

/// How long a restore waits for one that an earlier process of the rank asked for, and that
/// still fills its slot after that process died (under the trainer's 300 s wait for the
/// answer).
const SUPERSEDED_RESTORE_WAIT: Duration = Duration::from_secs(240);

/// Claims a free slot for a restore to fill, and opens its file (read and write) under the
/// ranks lock, where the file at the slot's path is the state's: a registration with another
/// layout makes the rank's files anew once it has removed the state. The snapshots the rank
/// had are given up, but T0 only when it is not the step wanted (`keep`): it may still serve
/// a later attempt. A restore whose process was replaced meanwhile claims nothing.
async fn begin_fill(
    daemon: &Arc<Daemon>,
    rank: Rank,
    asker: Life,
    keep: Option<u64>,
) -> Result<(u32, std::fs::File, PathBuf)> {
    let mut ranks = daemon.ranks.lock().await;
    let state = ranks
        .get_mut(&rank)
        .ok_or_else(|| anyhow!("rank {rank} vanished"))?;
    if state.life() != asker {
        bail!("rank {rank} was registered again (or with another layout) during its restore");
    }
    let slot = state.begin_fill(keep)?;
    let path = state.slot_path(slot);
    let opened = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&path)
        .with_context(|| format!("opening {}", path.display()));
    match opened {
        Ok(file) => Ok((slot, file, path)),
        Err(error) => {
            state.end_fill();
            Err(error)
        }
    }
}

/// A fill of `slot` that failed lets it go.
async fn end_fill(daemon: &Arc<Daemon>, rank: Rank, asker: Life, slot: u32) {
    if let Some(state) = daemon.ranks.lock().await.get_mut(&rank) {
        let_fill_go(state, asker, slot);
    }
}

/// Lets the fill of `slot` go, if `state` is the one it was filling for: a state of another
/// layout may fill a slot of the same number for a restore of its own.
fn let_fill_go(state: &mut RankState, asker: Life, slot: u32) {
    if state.generation == asker.generation && state.restoring == Some(slot) {
        state.end_fill();
    }
}

/// Makes a restored snapshot the rank's T0 (or records that there is none) and answers. A
/// restore whose process another has replaced (the world died while it ran, and was
/// relaunched) installs nothing: its step may be one a rollback since abandoned. It lets its
/// slot go, which the restore of the process now registered waits for.
async fn install(
    daemon: &Arc<Daemon>,
    rank: Rank,
    asker: Life,
    snap: Option<Snap>,
    tier: Tier,
) -> Result<(Message, Vec<u8>)> {
    let mut ranks = daemon.ranks.lock().await;
    let state = ranks
        .get_mut(&rank)
        .ok_or_else(|| anyhow!("rank {rank} vanished"))?;
    if state.life() != asker {
        if let Some(filled) = snap.as_ref().filter(|_| tier != Tier::T0) {
            let_fill_go(state, asker, filled.slot);
        }
        bail!("rank {rank} was registered again (or with another layout) during its restore; nothing installed");
    }
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
    file: std::fs::File,
    path: &Path,
) -> Result<(Vec<ChunkHash>, Vec<(String, Vec<u8>)>)> {
    let checkpoint = daemon.run.open_checkpoint(step).await?;
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
    let source = MappedFile::of(file, path)?;
    let ranges = chunks_of(SLOT_CHUNKING, slot_bytes, tensors)?;
    Ok((hash_ranges(&source, &ranges).await?, blobs))
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use lazarus_shared::ChunkHash;

    use super::restore;
    use crate::daemon::rank::RankState;
    use crate::daemon::testing;

    /// Rank 0 of 2 ([`testing::registered_rank`]) under `dir`, with T0 at step 5 in slot 0.
    fn rank_with_t0(dir: &std::path::Path) -> RankState {
        let mut state = testing::registered_rank(dir, 2);
        let hashes = vec![ChunkHash::of(&testing::slot_contents())];
        state.t0 = Some(testing::snap(5, 0, hashes));
        state
    }

    /// A restore whose process another replaced while it ran (the world died and was
    /// relaunched) installs nothing, and the new process's state is as its registration left
    /// it. The same restore without the new registration is served.
    #[tokio::test]
    async fn a_restore_for_a_replaced_process_installs_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let (daemon, _to_leader, _) = testing::follower(dir.path(), &[]).await;
        daemon
            .ranks
            .lock()
            .await
            .insert(0, rank_with_t0(dir.path()));
        for replaced in [false, true] {
            // The restore queues for the lock the test holds, and the test behind it: once
            // the test has the lock back, the restore has read the state and is re-hashing T0.
            let mut ranks = daemon.ranks.lock().await;
            let restoring = tokio::spawn({
                let daemon = daemon.clone();
                async move { restore(&daemon, 0, Some(5), None).await }
            });
            tokio::task::yield_now().await;
            drop(ranks);
            ranks = daemon.ranks.lock().await;
            if replaced {
                ranks.get_mut(&0).unwrap().registered(200).unwrap();
            }
            drop(ranks);
            let result = restoring.await.unwrap();
            let ranks = daemon.ranks.lock().await;
            let state = &ranks[&0];
            if replaced {
                let error = result.unwrap_err().to_string();
                assert!(error.contains("registered again"), "{error}");
                assert_eq!(state.restored_from, None);
            } else {
                result.unwrap();
                assert_eq!(state.restored_from, Some(lazarus_shared::wire::Tier::T0));
            }
            assert_eq!(state.t0.as_ref().map(|t0| t0.step), Some(5));
        }
    }

    /// A restore waits for one that an earlier process asked for and that still fills its
    /// slot, whatever it serves from: even one that fills nothing (T0 here) lets the rank
    /// write every slot not held, so it must not end that fill's hold. Once that fill ended,
    /// it is served.
    #[tokio::test]
    async fn a_restore_waits_for_an_earlier_process_fill() {
        let dir = tempfile::tempdir().unwrap();
        let (daemon, _to_leader, _) = testing::follower(dir.path(), &[]).await;
        let mut state = rank_with_t0(dir.path());
        state.restoring = Some(1);
        daemon.ranks.lock().await.insert(0, state);
        let restoring = tokio::spawn({
            let daemon = daemon.clone();
            async move { restore(&daemon, 0, Some(5), None).await }
        });
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert!(!restoring.is_finished(), "served while slot 1 is filled");
        assert_eq!(daemon.ranks.lock().await[&0].restoring, Some(1));
        daemon.ranks.lock().await.get_mut(&0).unwrap().end_fill();
        tokio::time::timeout(Duration::from_secs(5), restoring)
            .await
            .expect("the restore went on once the fill ended")
            .unwrap()
            .unwrap();
        let ranks = daemon.ranks.lock().await;
        assert_eq!(
            ranks[&0].restored_from,
            Some(lazarus_shared::wire::Tier::T0)
        );
    }

    /// A restore from storage writes the slot file it claimed, not whatever file is at the
    /// slot's path when its reads come back: a registration with another layout meanwhile
    /// makes the rank's files anew, and the new state's files are left as they were.
    #[tokio::test]
    async fn a_restore_from_storage_fills_the_file_it_claimed() {
        use lazarus_shared::store::{RegionKind, Store, StoreOptions};
        use lazarus_shared::wire::SlotChunking;
        use std::os::unix::fs::FileExt;
        use std::sync::Arc;

        let dir = tempfile::tempdir().unwrap();
        let objects = Arc::new(testing::GatedObjects::new(Arc::new(
            object_store::memory::InMemory::new(),
        )));
        let store = Store::with_objects(objects.clone(), "memory://", StoreOptions::default())
            .await
            .unwrap();
        let (daemon, mut to_leader, _) = testing::follower_on(dir.path(), &[], store).await;
        daemon.run.create(serde_json::json!({})).await.unwrap();
        // Step 10 of rank 0 of 1, stored and committed: its tensor is the slot's first 4000
        // bytes, all 7s (`testing::slot_contents`).
        let tensors = vec![testing::slot_tensor("a", 0, 1000, RegionKind::Stored)];
        let rank_dir = dir.path().join("rank-0");
        let mut state = testing::registered_rank_holding(&rank_dir, 1, tensors.clone());
        let slot = testing::slot_contents();
        let hashes = SlotChunking::Regions
            .ranges(slot.len() as u64, crate::daemon::SLOT_CHUNK_BYTES, &tensors)
            .unwrap()
            .iter()
            .map(|r| ChunkHash::of(&slot[r.start as usize..r.end as usize]))
            .collect();
        state.t0 = Some(testing::snap(10, 0, hashes));
        assert!(state.request_durable(10));
        let stored = testing::upload_as_rank_0(&daemon, &mut to_leader, state).await;
        daemon.run.commit(stored, 1).await.unwrap();
        // The rank's slots now hold zeros: what the restore writes shows where it went.
        let zeros = vec![0u8; slot.len()];
        for s in 0..crate::daemon::SLOTS_PER_RANK {
            std::fs::write(rank_dir.join(format!("slot-{s}")), &zeros).unwrap();
        }

        // The restore's chunk reads wait: by then it has claimed a slot and opened its file.
        let mut hold = objects.hold("/chunks/");
        let restoring = tokio::spawn({
            let daemon = daemon.clone();
            async move { restore(&daemon, 0, None, Some(10)).await }
        });
        hold.reached().await;
        let claimed = daemon.ranks.lock().await[&0]
            .restoring
            .expect("a slot claimed before the chunks are read");
        let claimed_path = rank_dir.join(format!("slot-{claimed}"));
        let claimed_file = std::fs::File::open(&claimed_path).unwrap();
        // Another layout registers: the rank's files are made anew, and hold 9s here.
        {
            let mut ranks = daemon.ranks.lock().await;
            std::fs::remove_dir_all(&rank_dir).unwrap();
            let replaced = testing::registered_rank_holding(&rank_dir, 2, Vec::new());
            for s in 0..crate::daemon::SLOTS_PER_RANK {
                std::fs::write(replaced.slot_path(s), vec![9u8; slot.len()]).unwrap();
            }
            ranks.insert(0, replaced);
        }
        hold.release();
        let error = tokio::time::timeout(Duration::from_secs(20), restoring)
            .await
            .expect("the restore ends within 20 s")
            .unwrap()
            .unwrap_err()
            .to_string();
        assert!(error.contains("registered again"), "{error}");
        let mut filled = vec![0u8; slot.len()];
        claimed_file.read_exact_at(&mut filled, 0).unwrap();
        assert!(
            filled[..4000].iter().all(|b| *b == 7),
            "the claimed file was filled"
        );
        assert!(filled[4000..].iter().all(|b| *b == 0));
        assert_eq!(std::fs::read(&claimed_path).unwrap(), vec![9u8; slot.len()]);
    }
}
