//! One local rank's state on its node: which of its four shm slots holds what.
//!
//! A rank owns nothing in shm: its four slot files belong to the daemon. A slot the daemon
//! *holds* (the committed T0, the snapshot in flight or waiting for its memory commit, a
//! restore being filled, the durable upload in flight) is read-only for the rank; the rank's
//! optimizer writes its next state into a slot that is not held, so handing a snapshot over
//! is telling the daemon which slot holds which step.
//!
//! This module is the state machine alone: every change is a method here, the daemon's tasks
//! (`local`, `pipeline`, `restore`) call them under the ranks lock and do their I/O outside
//! it. Its only I/O is `state.json`, written whenever T0 or the delta base changes and before
//! the answer that lets the rank see a smaller held set, so a daemon restarted at any moment
//! never hands out a slot the rank may still be writing, nor forgets its T0.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{anyhow, Context, Result};
use lazarus_shared::busy_word::BusyWord;
use lazarus_shared::format::ChunkRef;
use lazarus_shared::wire::{Message, SlotChunking, SlotTensor, UploadReport};
use lazarus_shared::{ChunkHash, Rank, StepKey};
use serde::{Deserialize, Serialize};

use super::SLOTS_PER_RANK;

/// Wakes the tasks waiting for a rank's snapshot in flight or restore to end: every change of
/// what a rank holds is published ([`RankState::publish`]), and wakes them all. A waiter
/// looks again under the ranks lock, so a change of another rank (or another daemon's, in a
/// test process) only costs it that look.
static CHANGES: tokio::sync::Notify = tokio::sync::Notify::const_new();

/// Ends when the next change is published, or at `deadline`. Take it *before* looking at the
/// state: a change published between the look and the wait is not missed, since a future
/// from [`tokio::sync::Notify::notified`] counts the changes published once it exists.
pub fn next_change(deadline: Instant) -> impl std::future::Future<Output = ()> {
    let changed = CHANGES.notified();
    async move {
        let _ = tokio::time::timeout_at(deadline.into(), changed).await;
    }
}

/// A snapshot the daemon holds: which slot, which step, the chunk hashes of the slot.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Snap {
    pub step: u64,
    pub slot: u32,
    /// The hashes of the slot's chunks, as `chunking` cut it.
    pub hashes: Vec<ChunkHash>,
    /// How the slot was cut into the chunks `hashes` names (a `state.json` saved without it:
    /// `Fixed`).
    #[serde(default)]
    pub chunking: SlotChunking,
    pub blobs: Vec<(String, Vec<u8>)>,
    /// The trainer (its last snapshot) or the leader (a durable commit) wants this step
    /// durable.
    pub durable_requested: bool,
}

/// The previous durable step's data, kept in `base` for delta encoding.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Base {
    pub step: u64,
    /// Per tensor, in slot order, the chunks the store wrote.
    pub chunks: Vec<Vec<ChunkRef>>,
    /// This life of the daemon wrote the base file, during the upload that stored `chunks`,
    /// from the very bytes their names were hashed from: uploads need not hash it again. A
    /// restarted daemon checks it chunk by chunk.
    #[serde(skip)]
    pub checked: bool,
}

/// What survives a daemon restart (`state.json` in the rank's directory).
#[derive(Clone, Debug, Serialize, Deserialize)]
struct Persisted {
    rank: Rank,
    world_size: u32,
    slot_bytes: u64,
    tensors: Vec<SlotTensor>,
    t0: Option<Snap>,
    base: Option<Base>,
}

/// Step changes a newly registered rank reports to the leader at once (`early_beats`).
const EARLY_BEATS: u8 = 2;

/// One local rank.
#[derive(Debug)]
pub struct RankState {
    pub rank: Rank,
    /// This state's own number, new with every layout: a registration with another layout
    /// replaces the state, and a replication or upload still running for the one it replaced
    /// must not end in this one (its slots and base file are other files).
    pub generation: u64,
    /// Counts the processes registered as this rank: a restore asked for by a process that a
    /// later one has replaced must not install its slot as T0, nor an upload that process
    /// started tell the new one it stored its step.
    pub registration: u64,
    pub world_size: u32,
    /// The registered process; 0 when none is.
    pub pid: u32,
    pub slot_bytes: u64,
    pub tensors: Vec<SlotTensor>,
    pub dir: PathBuf,
    /// The committed snapshot: memory-committed, or restored.
    pub t0: Option<Snap>,
    /// Where the leader says this rank's newest replica is (from the last `Choose`).
    pub replica_at: Option<std::net::SocketAddr>,
    /// Replicated and reported, waiting for the leader's memory commit.
    pub pending: Option<Snap>,
    pub pending_at: Instant,
    /// The slot being hashed and replicated.
    pub working: Option<u32>,
    /// The slot a restore is filling (from the buddy or storage), while it runs.
    pub restoring: Option<u32>,
    /// The slot being uploaded as a durable step. It is held apart from T0, so memory
    /// snapshots and commits go on while an upload is slow or storage is down.
    pub uploading: Option<u32>,
    /// A durable step waiting for the running upload to end (it is uploaded next, unless a
    /// newer durable step replaces it first: that one counts as skipped).
    pub durable_waiting: Option<u64>,
    /// The newest step this rank's process had stored as a durable shard. Asked again for it
    /// (the leader's `MakeDurable` at the end of a world), the daemon reports it stored
    /// instead of writing it a second time. Cleared when the rank registers again.
    pub stored: Option<StepKey>,
    pub base: Option<Base>,
    pub last_step: u64,
    pub last_seen: Instant,
    /// The rank's own compute per step (microseconds), smoothed over its recent reports.
    pub compute_us: u64,
    /// Step changes still to tell the leader at once rather than with the next heartbeat:
    /// a (re)registered rank's restored step and its first step, which time a recovery.
    pub early_beats: u8,
    /// Where this process's restore came from (`None`: fresh, or not restored yet).
    pub restored_from: Option<lazarus_shared::wire::Tier>,
    /// The step this process's health check failed at, and why.
    pub unhealthy: Option<lazarus_shared::wire::BadStep>,
    /// `(step, loss)` reported since the last node heartbeat.
    pub losses: Vec<(u64, f64)>,
    /// The step of the newest snapshot handed over: the loss of the step after it is what a
    /// restore of it is checked against, so the leader hears that one at once.
    pub snapshot_step: Option<u64>,
    /// [`RankState::busy`] where the rank reads it without asking; every change of the
    /// snapshot in flight writes it.
    busy_word: Option<BusyWord>,
}

/// Which state of a rank ([`RankState::generation`]) and which of its processes
/// ([`RankState::registration`]) a task works for, as it started.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Life {
    pub generation: u64,
    pub registration: u64,
}

/// The answer to a snapshot hand-over.
#[derive(Debug, PartialEq, Eq)]
pub enum HandOver {
    /// The slot is held (or does not exist): the rank broke the protocol.
    NotTheRanks,
    /// A snapshot is still being replicated or waits for its commit: this one is skipped.
    Busy,
    /// The slot is now `working`: replicate it.
    Accepted,
}

/// What asking for T0 to be uploaded leads to.
#[derive(Debug, PartialEq)]
pub enum Upload {
    /// No T0, or no durable step waiting once an upload ended.
    Nothing,
    /// This process already stored T0's step: tell the leader again.
    Stored(StepKey),
    /// An upload is running; T0's step goes next. `replaced` is an older waiting step it
    /// displaces, which is skipped.
    Queued { replaced: Option<u64> },
    /// Upload this snapshot now: its slot is held as `uploading` until `upload_ended`.
    Start(Snap),
    /// An upload ended and the step that waited for it is gone (T0 moved on to a step that
    /// is not durable): it is skipped.
    Skipped(u64),
}

impl RankState {
    /// A rank registering for the first time (or with a new layout), its files under `dir`.
    pub fn new(
        rank: Rank,
        world_size: u32,
        slot_bytes: u64,
        tensors: Vec<SlotTensor>,
        dir: PathBuf,
    ) -> Self {
        static GENERATIONS: AtomicU64 = AtomicU64::new(1);
        Self {
            rank,
            generation: GENERATIONS.fetch_add(1, Ordering::Relaxed),
            registration: 0,
            world_size,
            pid: 0,
            slot_bytes,
            tensors,
            dir,
            t0: None,
            pending: None,
            pending_at: Instant::now(),
            replica_at: None,
            working: None,
            uploading: None,
            restoring: None,
            durable_waiting: None,
            stored: None,
            base: None,
            last_step: 0,
            last_seen: Instant::now(),
            compute_us: 0,
            early_beats: 0,
            restored_from: None,
            unhealthy: None,
            losses: Vec::new(),
            snapshot_step: None,
            busy_word: None,
        }
    }

    /// Reloads the rank in `dir` as an earlier life of the daemon left it: T0 and the delta
    /// base; nothing in flight survives.
    pub fn load(dir: &Path) -> Result<Option<Self>> {
        let path = dir.join("state.json");
        let bytes = match std::fs::read(&path) {
            Ok(bytes) => bytes,
            Err(error) if error.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(error) => return Err(error).with_context(|| format!("reading {}", path.display())),
        };
        let state: Persisted = serde_json::from_slice(&bytes)
            .with_context(|| format!("parsing {}", path.display()))?;
        let mut loaded = Self::new(
            state.rank,
            state.world_size,
            state.slot_bytes,
            state.tensors,
            dir.to_path_buf(),
        );
        loaded.t0 = state.t0;
        loaded.base = state.base;
        Ok(Some(loaded))
    }

    /// Every rank found under `root` (one directory each); unreadable ones are skipped.
    pub fn load_all(root: &Path) -> HashMap<Rank, Self> {
        let mut ranks = HashMap::new();
        let Ok(entries) = std::fs::read_dir(root) else {
            return ranks;
        };
        for entry in entries.flatten() {
            match Self::load(&entry.path()) {
                Ok(Some(state)) => {
                    tracing::info!(rank = state.rank, t0 = ?state.t0.as_ref().map(|s| s.step), "found T0 from an earlier life");
                    ranks.insert(state.rank, state);
                }
                Ok(None) => {}
                Err(error) => {
                    tracing::warn!(error = %format!("{error:#}"), "ignoring unreadable rank state")
                }
            }
        }
        ranks
    }

    /// This state and the process registered in it now.
    pub fn life(&self) -> Life {
        Life {
            generation: self.generation,
            registration: self.registration,
        }
    }

    /// Whether a registration with this layout can keep this state's slots (and T0).
    pub fn fits(&self, world_size: u32, slot_bytes: u64, tensors: &[SlotTensor]) -> bool {
        self.world_size == world_size && self.slot_bytes == slot_bytes && self.tensors == tensors
    }

    /// A (new) process registered as this rank. It has made no step yet: the leader hears
    /// its restored step when it trains, not the step its predecessor died at.
    pub fn registered(&mut self, pid: u32) -> Result<()> {
        self.pid = pid;
        self.registration += 1;
        self.last_seen = Instant::now();
        self.stored = None;
        self.last_step = 0;
        self.early_beats = EARLY_BEATS;
        self.restored_from = None;
        self.unhealthy = None;
        self.persist()
    }

    pub fn slot_path(&self, slot: u32) -> PathBuf {
        self.dir.join(format!("slot-{slot}"))
    }

    /// Slots the rank must not write.
    pub fn held(&self) -> Vec<u32> {
        let mut held: Vec<u32> = [
            self.t0.as_ref().map(|s| s.slot),
            self.pending.as_ref().map(|s| s.slot),
            self.working,
            self.uploading,
            self.restoring,
        ]
        .into_iter()
        .flatten()
        .collect();
        held.sort_unstable();
        held.dedup();
        held
    }

    pub fn busy(&self) -> bool {
        self.pending.is_some() || self.working.is_some()
    }

    /// What this rank's `Replicated` report tells the leader of its uploads.
    pub fn upload_report(&self) -> UploadReport {
        UploadReport {
            running: self.uploading.is_some(),
            t0: self.t0.as_ref().map(|t0| t0.step),
        }
    }

    /// From now on `word` says whether this rank's daemon is busy, and which slots it holds.
    pub fn attach_busy_word(&mut self, word: BusyWord) {
        self.busy_word = Some(word);
        self.publish();
    }

    /// Writes [`RankState::busy`] and [`RankState::held`] to the busy word; every method that
    /// changes them ends here. A held set that shrinks as T0 moves is written only after
    /// `state.json` names the new T0, as the answers to the rank are: a daemon restarted in
    /// between must not find its T0 in a slot the rank was told it may write.
    fn publish(&self) {
        if let Some(word) = &self.busy_word {
            word.set_held(&self.held());
            word.set(self.busy());
        }
        CHANGES.notify_waiters();
    }

    /// The `Held` answer to the rank: the slots it must not write, its T0 step, and `busy`
    /// and `accepted` as given.
    pub fn held_reply(&self, busy: bool, accepted: bool) -> Message {
        Message::Held {
            held: self.held(),
            committed: self.t0.as_ref().map(|t| t.step),
            busy,
            accepted,
        }
    }

    /// The `Held` answer to a request that hands nothing over.
    pub fn reply(&self) -> Message {
        self.held_reply(self.busy(), false)
    }

    fn free_slot(&self) -> Option<u32> {
        let held = self.held();
        (0..SLOTS_PER_RANK).find(|s| !held.contains(s))
    }

    /// The rank reported `step` (a poll or a hand-over). True when the leader should hear
    /// at once: one of the first step changes after registering (see `early_beats`).
    pub fn saw_step(&mut self, step: u64) -> bool {
        self.last_seen = Instant::now();
        let early = step != self.last_step && self.early_beats > 0;
        if early {
            self.early_beats -= 1;
        }
        self.last_step = step;
        early
    }

    /// The rank reported the loss of `step`. True when the leader should hear it at once:
    /// the step after the newest snapshot, whose loss a restore of that snapshot must repeat
    /// (heard only with the next heartbeat, a restore could come first and go unchecked).
    pub fn heard_loss(&mut self, step: u64, loss: f64) -> bool {
        // Bounded: a node cut off from its leader keeps the newest.
        if self.losses.len() >= 1024 {
            self.losses.remove(0);
        }
        self.losses.push((step, loss));
        self.snapshot_step.is_some_and(|s| s + 1 == step)
    }

    /// The rank's compute per step, smoothed: one slow step is not a straggler.
    pub fn saw_compute(&mut self, compute_us: u64) {
        if compute_us > 0 {
            self.compute_us = if self.compute_us == 0 {
                compute_us
            } else {
                (4 * self.compute_us + compute_us) / 5
            };
        }
    }

    /// The rank hands over `slot`, holding its snapshot.
    pub fn hand_over(&mut self, slot: u32) -> HandOver {
        if slot >= SLOTS_PER_RANK || self.held().contains(&slot) {
            return HandOver::NotTheRanks;
        }
        if self.busy() {
            return HandOver::Busy;
        }
        self.working = Some(slot);
        self.publish();
        HandOver::Accepted
    }

    /// The snapshot being worked on was replicated (`Some`: it waits for its memory commit)
    /// or failed (`None`: the rank keeps its previous T0).
    pub fn replicated(&mut self, snap: Option<Snap>) {
        self.working = None;
        if snap.is_some() {
            self.pending_at = Instant::now();
        }
        self.pending = snap;
        self.publish();
    }

    /// Drops a snapshot whose memory commit did not come within `timeout` (a rank elsewhere
    /// failed to snapshot that step), so that the rank can hand over the next one.
    pub fn expire(&mut self, timeout: Duration) -> Option<u64> {
        let due = self.pending_at.elapsed() >= timeout;
        self.drop_pending(|_| due)
    }

    /// Drops a snapshot waiting for the memory commit of a step the leader gave up (through
    /// `through`): the rank can hand over the next one at once.
    pub fn give_up(&mut self, through: u64) -> Option<u64> {
        self.drop_pending(|step| step <= through)
    }

    /// Drops the snapshot waiting for its memory commit if `drop(its step)`; its step.
    fn drop_pending(&mut self, drop: impl FnOnce(u64) -> bool) -> Option<u64> {
        let step = self.pending.as_ref().map(|p| p.step).filter(|s| drop(*s))?;
        self.pending = None;
        self.publish();
        Some(step)
    }

    /// The leader memory-committed `step`: the waiting snapshot of that step becomes T0
    /// (marked for upload if `durable`). False when no snapshot of `step` waits. An error
    /// means T0 changed but `state.json` could not record it.
    pub fn commit(&mut self, step: u64, durable: bool) -> Result<bool> {
        if self.pending.as_ref().is_none_or(|p| p.step != step) {
            return Ok(false);
        }
        self.t0 = self.pending.take();
        if let Some(t0) = self.t0.as_mut().filter(|_| durable) {
            // Marked, so that an upload running now uploads this step when it ends.
            t0.durable_requested = true;
        }
        self.persist_and_publish()?;
        Ok(true)
    }

    /// The run was rolled back to `to` (`None`: a fresh start): T0, a pending commit and a
    /// waiting upload of a later step belong to the abandoned trajectory, and go.
    pub fn forget_after(&mut self, to: Option<u64>) -> Result<()> {
        let later = |step: u64| to.is_none_or(|to| step > to);
        if self.pending.as_ref().is_some_and(|p| later(p.step)) {
            self.pending = None;
            self.publish();
        }
        self.durable_waiting = self.durable_waiting.filter(|&step| !later(step));
        if self.stored.is_some_and(|k| later(k.step)) {
            self.stored = None;
        }
        if self.t0.as_ref().is_some_and(|t0| later(t0.step)) {
            self.t0 = None;
            self.persist_and_publish()?;
        }
        Ok(())
    }

    /// The leader wants `step` durable: true when it is T0 (now marked for upload).
    pub fn request_durable(&mut self, step: u64) -> bool {
        match self.t0.as_mut().filter(|t0| t0.step == step) {
            Some(t0) => {
                t0.durable_requested = true;
                true
            }
            None => false,
        }
    }

    /// Uploads T0 unless an upload is already running; that one catches up with the newest
    /// durable-requested T0 when it ends.
    pub fn upload(&mut self) -> Upload {
        let Some(snap) = self.t0.clone() else {
            return Upload::Nothing;
        };
        if let Some(step) = self.stored.filter(|stored| stored.step == snap.step) {
            return Upload::Stored(step);
        }
        if self.uploading.is_some() {
            let replaced = self
                .durable_waiting
                .replace(snap.step)
                .filter(|&waiting| waiting < snap.step);
            return Upload::Queued { replaced };
        }
        self.durable_waiting = None;
        self.uploading = Some(snap.slot);
        self.publish();
        Upload::Start(snap)
    }

    /// The delta-base file is about to be replaced by the slot just stored: from now until
    /// [`RankState::stored`] records the new base, no upload may pair that file with the old
    /// base's chunks (a daemon killed in between would otherwise come back doing so).
    pub fn forget_base(&mut self) -> Result<()> {
        self.base = None;
        self.persist()
    }

    /// The upload of `step`, started under `registration`, stored it (with the new delta
    /// base, when one is kept). The step counts as this process's only if no other process
    /// registered meanwhile: one relaunched after a rollback may make the same step number
    /// again, on another trajectory, and must upload it.
    pub fn stored(&mut self, step: StepKey, base: Option<Base>, registration: u64) -> Result<()> {
        if let Some(base) = base {
            self.base = Some(base);
        }
        if registration == self.registration {
            self.stored = Some(step);
        }
        self.persist()
    }

    /// The upload of `uploaded` ended (stored or failed): its slot is free again, and the
    /// newest durable-requested T0 goes next.
    pub fn upload_ended(&mut self, uploaded: u64) -> Upload {
        self.uploading = None;
        self.publish();
        if self
            .t0
            .as_ref()
            .is_some_and(|t0| t0.durable_requested && t0.step > uploaded)
        {
            return self.upload();
        }
        match self.durable_waiting.take() {
            Some(skipped) => Upload::Skipped(skipped),
            None => Upload::Nothing,
        }
    }

    /// A T0 snapshot of `memory` that a restore can serve: the committed slot, or a
    /// replicated snapshot whose commit arrived late. With the slot's path.
    pub fn memory_candidate(&self, memory: Option<u64>) -> Option<(PathBuf, Snap)> {
        [self.t0.as_ref(), self.pending.as_ref()]
            .into_iter()
            .flatten()
            .find(|s| Some(s.step) == memory)
            .map(|snap| (self.slot_path(snap.slot), snap.clone()))
    }

    /// Claims a free slot for a restore to fill. The snapshots the rank had are given up, but
    /// T0 only when it is not the step wanted (`keep`): it may still serve a later attempt.
    /// A T0 given up is forgotten in `state.json` too before its slot can be filled, so a
    /// daemon restarted mid-fill never names a half-overwritten slot as T0.
    pub fn begin_fill(&mut self, keep: Option<u64>) -> Result<u32> {
        self.pending = None;
        self.publish();
        if self.t0.as_ref().is_some_and(|t| Some(t.step) != keep) {
            self.t0 = None;
            self.persist_and_publish()?;
        }
        let slot = self.free_slot().ok_or_else(|| {
            anyhow!(
                "no free slot for rank {}'s restore (held: {:?})",
                self.rank,
                self.held()
            )
        })?;
        self.restoring = Some(slot);
        self.publish();
        Ok(slot)
    }

    /// A fill that failed lets its slot go.
    pub fn end_fill(&mut self) {
        self.restoring = None;
        self.publish();
    }

    /// A restore ended: `snap` (filled, or T0 verified) is the rank's T0, or it has none.
    pub fn install(&mut self, snap: Option<Snap>) -> Result<()> {
        self.restoring = None;
        self.pending = None;
        self.t0 = snap;
        self.persist_and_publish()
    }

    /// Records T0 in `state.json`, then tells the rank the held slots: a held set that
    /// shrank as T0 moved must not reach the busy word before the file names the new T0. The
    /// word is written even when the file could not be, as the answers are.
    fn persist_and_publish(&self) -> Result<()> {
        let persisted = self.persist();
        self.publish();
        persisted
    }

    fn persist(&self) -> Result<()> {
        let state = Persisted {
            rank: self.rank,
            world_size: self.world_size,
            slot_bytes: self.slot_bytes,
            tensors: self.tensors.clone(),
            t0: self.t0.clone(),
            base: self.base.clone(),
        };
        super::slots::replace_file(&self.dir.join("state.json"), &serde_json::to_vec(&state)?)
    }
}

#[cfg(test)]
mod tests {
    //! The state machine against a model of the slot files, sled-style: random sequences of
    //! what the rank, the replication, the leader, the uploads and restores do, with daemon
    //! restarts anywhere (a restart keeps only `state.json`). After every operation the
    //! model checks that the rank never writes a slot the daemon relies on, that every
    //! snapshot the daemon holds is still what its slot file contains, that T0 survives
    //! restarts, and that the rank always has a slot to write.

    use super::*;
    use proptest::prelude::*;

    #[derive(Clone, Debug)]
    enum Op {
        /// The rank writes its next step into a slot its last answer left free and hands it
        /// over (the trainer's `HeldSlots` is that answer).
        HandOver { pick: u8, durable: bool },
        /// The rank polls: its view becomes the daemon's held set.
        Poll,
        /// The replication of the handed-over slot ends.
        Replicated { ok: bool },
        /// The leader memory-commits the waiting step (`same`) or another step.
        Commit { same: bool, durable: bool },
        /// The commit timeout passes.
        Expire,
        /// The leader gives up the steps through the waiting one (`reached`) or through the
        /// one before it.
        GiveUp { reached: bool },
        /// The leader wants T0's step durable (the end of a world).
        MakeDurable,
        /// The running upload ends.
        UploadEnds { ok: bool },
        /// A new process registers and restores: T0 when it is the step and verifies
        /// (`keep`, `t0_ok`), else a fill from the buddy or storage that may fail.
        Restore {
            keep: bool,
            t0_ok: bool,
            found: bool,
            fail: bool,
        },
        /// The daemon is killed and started again.
        Restart,
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            4 => (any::<u8>(), any::<bool>()).prop_map(|(pick, durable)| Op::HandOver { pick, durable }),
            2 => Just(Op::Poll),
            3 => proptest::bool::weighted(0.8).prop_map(|ok| Op::Replicated { ok }),
            3 => (any::<bool>(), any::<bool>()).prop_map(|(same, durable)| Op::Commit { same, durable }),
            1 => Just(Op::Expire),
            1 => any::<bool>().prop_map(|reached| Op::GiveUp { reached }),
            1 => Just(Op::MakeDurable),
            2 => any::<bool>().prop_map(|ok| Op::UploadEnds { ok }),
            1 => (any::<bool>(), any::<bool>(), any::<bool>(), any::<bool>())
                .prop_map(|(keep, t0_ok, found, fail)| Op::Restore { keep, t0_ok, found, fail }),
            1 => Just(Op::Restart),
        ]
    }

    struct World {
        _dir: tempfile::TempDir,
        rank_dir: PathBuf,
        daemon: RankState,
        /// The step each slot file holds (0: none yet).
        content: [u64; SLOTS_PER_RANK as usize],
        /// The rank's last answer from the daemon.
        view: Vec<u32>,
        next_step: u64,
        pid: u32,
        /// The snapshot the daemon is replicating: (step, slot, durable).
        job: Option<(u64, u32, bool)>,
        /// The upload the daemon runs, and the registration it started under.
        upload: Option<(Snap, u64)>,
        /// The step this process stored (an upload it started, or one its predecessor started,
        /// never counts for it).
        stored: Option<u64>,
        /// The model's T0: (step, slot).
        t0: Option<(u64, u32)>,
        /// The busy word as the rank maps it.
        busy_word: lazarus_shared::busy_word::BusyWordReader,
    }

    fn snap(step: u64, slot: u32, durable: bool) -> Snap {
        Snap {
            step,
            slot,
            hashes: Vec::new(),
            chunking: SlotChunking::Regions,
            blobs: Vec::new(),
            durable_requested: durable,
        }
    }

    impl World {
        fn new() -> Self {
            let dir = tempfile::tempdir().unwrap();
            let rank_dir = dir.path().join("rank-0");
            std::fs::create_dir_all(&rank_dir).unwrap();
            let mut daemon = RankState::new(0, 2, 1 << 20, Vec::new(), rank_dir.clone());
            daemon.registered(100).unwrap();
            let word = rank_dir.join(lazarus_shared::busy_word::FILE_NAME);
            daemon.attach_busy_word(BusyWord::create(&word, 0o600).unwrap());
            let busy_word = lazarus_shared::busy_word::BusyWordReader::open(&word).unwrap();
            let view = daemon.held();
            Self {
                _dir: dir,
                rank_dir,
                daemon,
                content: [0; SLOTS_PER_RANK as usize],
                view,
                next_step: 0,
                pid: 100,
                job: None,
                upload: None,
                stored: None,
                t0: None,
                busy_word,
            }
        }

        fn t0(&self) -> Option<(u64, u32)> {
            self.daemon.t0.as_ref().map(|s| (s.step, s.slot))
        }

        /// Follows an upload decision as the daemon's pipeline does.
        fn follow(&mut self, decision: Upload) {
            match decision {
                Upload::Start(snap) => {
                    assert!(self.upload.is_none(), "two uploads at once");
                    assert_eq!(self.daemon.uploading, Some(snap.slot));
                    self.upload = Some((snap, self.daemon.registration));
                }
                Upload::Queued { .. } => assert!(self.upload.is_some(), "queued behind nothing"),
                Upload::Stored(_) | Upload::Nothing | Upload::Skipped(_) => {}
            }
        }

        fn apply(&mut self, op: &Op) {
            match *op {
                Op::HandOver { pick, durable } => {
                    let free: Vec<u32> = (0..SLOTS_PER_RANK)
                        .filter(|s| !self.view.contains(s))
                        .collect();
                    assert!(
                        !free.is_empty(),
                        "the rank has no slot to write: {:?}",
                        self.view
                    );
                    let slot = free[pick as usize % free.len()];
                    assert!(
                        !self.daemon.held().contains(&slot),
                        "the rank overwrites slot {slot}, which the daemon holds: {:?}",
                        self.daemon
                    );
                    self.next_step += 1;
                    self.content[slot as usize] = self.next_step;
                    let answer = self.daemon.hand_over(slot);
                    assert_ne!(answer, HandOver::NotTheRanks);
                    if answer == HandOver::Accepted {
                        self.job = Some((self.next_step, slot, durable));
                    }
                    self.view = self.daemon.held();
                }
                Op::Poll => self.view = self.daemon.held(),
                Op::Replicated { ok } => {
                    if let Some((step, slot, durable)) = self.job.take() {
                        self.daemon
                            .replicated(ok.then(|| snap(step, slot, durable)));
                    }
                }
                Op::Commit { same, durable } => {
                    let waiting = self.daemon.pending.as_ref().map(|p| (p.step, p.slot));
                    let step = match waiting {
                        Some((step, _)) if same => step,
                        _ => self.next_step + 1000,
                    };
                    let applied = self.daemon.commit(step, durable).unwrap();
                    assert_eq!(applied, same && waiting.is_some());
                    if applied {
                        self.t0 = waiting;
                        if durable {
                            let decision = self.daemon.upload();
                            self.follow(decision);
                        }
                    }
                }
                Op::Expire => {
                    let waiting = self.daemon.pending.as_ref().map(|p| p.step);
                    assert_eq!(self.daemon.expire(Duration::ZERO), waiting);
                    assert!(self.daemon.pending.is_none());
                }
                Op::GiveUp { reached } => {
                    let waiting = self.daemon.pending.as_ref().map(|p| p.step);
                    let through = waiting.unwrap_or(self.next_step);
                    let through = if reached {
                        through
                    } else {
                        through.saturating_sub(1)
                    };
                    let dropped = self.daemon.give_up(through);
                    assert_eq!(dropped, waiting.filter(|step| *step <= through));
                    assert_eq!(
                        self.daemon.pending.as_ref().map(|p| p.step),
                        waiting.filter(|step| *step > through)
                    );
                }
                Op::MakeDurable => {
                    if let Some((step, _)) = self.t0 {
                        assert!(self.daemon.request_durable(step));
                        let decision = self.daemon.upload();
                        self.follow(decision);
                    }
                }
                Op::UploadEnds { ok } => {
                    if let Some((upload, registration)) = self.upload.take() {
                        if ok {
                            self.daemon
                                .stored(StepKey::new(upload.step, 0), None, registration)
                                .unwrap();
                            if registration == self.daemon.registration {
                                self.stored = Some(upload.step);
                            }
                        }
                        let decision = self.daemon.upload_ended(upload.step);
                        self.follow(decision);
                    }
                }
                Op::Restore {
                    keep,
                    t0_ok,
                    found,
                    fail,
                } => {
                    // The daemon's `choose` waits for the previous life's snapshot first.
                    if self.job.is_some() {
                        return;
                    }
                    self.pid += 1;
                    self.daemon.registered(self.pid).unwrap();
                    self.stored = None;
                    let memory = self.t0.filter(|_| keep).map(|(step, _)| step);
                    match self.daemon.memory_candidate(memory) {
                        Some((path, candidate)) if t0_ok => {
                            assert_eq!(path, self.daemon.slot_path(candidate.slot));
                            assert_eq!(self.content[candidate.slot as usize], candidate.step);
                            self.t0 = Some((candidate.step, candidate.slot));
                            self.daemon.install(Some(candidate)).unwrap();
                        }
                        _ => {
                            let slot = self
                                .daemon
                                .begin_fill(memory)
                                .expect("a restore finds a free slot");
                            if memory.is_none() {
                                self.t0 = None;
                            }
                            if fail {
                                // A fill that fails may have written part of the slot.
                                self.content[slot as usize] = u64::MAX;
                                self.daemon.end_fill();
                            } else if found {
                                self.next_step += 1;
                                self.content[slot as usize] = self.next_step;
                                self.daemon
                                    .install(Some(snap(self.next_step, slot, false)))
                                    .unwrap();
                                self.t0 = Some((self.next_step, slot));
                            } else {
                                self.daemon.install(None).unwrap();
                                self.t0 = None;
                            }
                        }
                    }
                    self.view = self.daemon.held();
                }
                Op::Restart => {
                    self.daemon = RankState::load(&self.rank_dir)
                        .unwrap()
                        .expect("state.json is there");
                    let word = self.rank_dir.join(lazarus_shared::busy_word::FILE_NAME);
                    self.daemon
                        .attach_busy_word(BusyWord::create(&word, 0o600).unwrap());
                    self.job = None;
                    self.upload = None;
                    self.stored = None;
                }
            }
        }

        fn check(&self) {
            assert_eq!(
                self.t0(),
                self.t0,
                "T0 differs from the model: {:?}",
                self.daemon
            );
            let held = self.daemon.held();
            assert!(
                held.len() < SLOTS_PER_RANK as usize,
                "every slot is held: {:?}",
                self.daemon
            );
            for snap in [self.daemon.t0.as_ref(), self.daemon.pending.as_ref()]
                .into_iter()
                .flatten()
            {
                assert_eq!(
                    self.content[snap.slot as usize], snap.step,
                    "{:?}",
                    self.daemon
                );
            }
            if let Some((step, slot, _)) = self.job {
                assert_eq!(self.daemon.working, Some(slot));
                assert_eq!(self.content[slot as usize], step);
            }
            assert_eq!(self.daemon.stored.map(|key| key.step), self.stored);
            if let Some((upload, _)) = &self.upload {
                assert_eq!(self.daemon.uploading, Some(upload.slot));
                assert_eq!(self.content[upload.slot as usize], upload.step);
            }
            assert_eq!(
                self.busy_word.get(),
                self.daemon.busy(),
                "the rank reads another busy than the daemon's: {:?}",
                self.daemon
            );
            assert_eq!(
                self.busy_word.held(),
                Some(self.daemon.held()),
                "the rank reads other held slots than the daemon's: {:?}",
                self.daemon
            );
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(300))]
        #[test]
        fn the_daemon_never_lets_the_rank_overwrite_a_held_snapshot_and_keeps_t0_across_restarts(
            ops in proptest::collection::vec(op(), 1..120)
        ) {
            let mut world = World::new();
            for op in &ops {
                world.apply(op);
                world.check();
            }
        }
    }

    /// The loss of the step after the newest snapshot goes to the leader at once (a restore
    /// of that snapshot is checked against it); other losses wait for the heartbeat. Losses
    /// kept for the leader stay bounded while it is unreachable.
    #[test]
    fn the_loss_after_a_snapshot_is_told_at_once_and_losses_stay_bounded() {
        let dir = tempfile::tempdir().unwrap();
        let mut rank = RankState::new(0, 1, 64, Vec::new(), dir.path().to_path_buf());
        assert!(!rank.heard_loss(71, 3.0), "no snapshot yet");
        rank.snapshot_step = Some(70);
        assert!(!rank.heard_loss(70, 3.1));
        assert!(rank.heard_loss(71, 3.2));
        assert!(!rank.heard_loss(72, 3.3));
        for step in 0..2000 {
            rank.heard_loss(step, 1.0);
        }
        assert_eq!(rank.losses.len(), 1024);
        assert_eq!(rank.losses.last(), Some(&(1999, 1.0)));
    }

    #[test]
    fn a_hand_over_while_a_snapshot_waits_for_its_commit_is_skipped() {
        let mut world = World::new();
        world.apply(&Op::HandOver {
            pick: 0,
            durable: false,
        });
        world.apply(&Op::Replicated { ok: true });
        world.apply(&Op::HandOver {
            pick: 0,
            durable: false,
        });
        assert_eq!(world.daemon.held().len(), 1, "the skipped slot is not held");
        world.apply(&Op::Commit {
            same: true,
            durable: true,
        });
        assert_eq!(
            world.daemon.held().len(),
            1,
            "T0 and its upload share a slot"
        );
        world.apply(&Op::Restart);
        world.check();
        assert_eq!(world.t0(), Some((1, 0)));
    }
}
