//! The node side: local ranks over the Unix socket, their shm slots (T0), the snapshot
//! pipeline (hash, replicate to the buddy, report to the leader, upload durable steps), and
//! restores from T0, T1 or T2.
//!
//! A rank owns nothing in shm: its four slot files belong to the daemon. A slot the daemon
//! *holds* (the committed T0, the snapshot in flight, a restore, the durable upload in
//! flight) is read-only for the rank;
//! the rank's optimizer writes its next state into a slot that is not held, so handing a
//! snapshot over is telling the daemon which slot holds which step. The held set is only ever
//! shrunk after `state.json` says which slot is T0, so a daemon restarted at any moment
//! never hands out a slot the rank may still be writing, nor forgets its T0.

use std::collections::HashMap;
use std::os::unix::fs::{FileExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};
use bytes::Bytes;
use lazarus_shared::format::ChunkRef;
use lazarus_shared::store::{
    ByteSource, DeltaBases, Progress, RestoreChoice, SourceRange, SourcedShard, SourcedTensor,
};
use lazarus_shared::wire::{self, Message, SlotTensor, Tier, WireError};
use lazarus_shared::{ChunkHash, Rank, StepKey};
use serde::{Deserialize, Serialize};
use tokio::net::{UnixListener, UnixStream};

use super::slots::{chunk_count, copy_file, read_chunk, reserve, verify_slot, SlotFile};
use super::{peer, Config, ConfigError, Daemon, SLOTS_PER_RANK, SLOT_CHUNK_BYTES};

/// A snapshot the daemon holds: which slot, which step, the chunk hashes of the slot.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Snap {
    pub step: u64,
    pub slot: u32,
    pub hashes: Vec<ChunkHash>,
    pub blobs: Vec<(String, Vec<u8>)>,
    /// The trainer (its last snapshot) or the leader (a durable commit) wants this step
    /// durable.
    pub durable_requested: bool,
}

/// The previous durable step's data, kept in `base` for delta encoding.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Base {
    pub step: u64,
    /// Per tensor, in slot order, the chunks the store wrote.
    pub chunks: Vec<Vec<ChunkRef>>,
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

/// One local rank.
#[derive(Debug)]
pub struct RankState {
    pub rank: Rank,
    pub world_size: u32,
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
}

impl RankState {
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

    /// The rank reported `step`. Its first step changes after registering go to the leader
    /// at once (see `early_beats`).
    fn saw_step(&mut self, daemon: &Daemon, step: u64) {
        if step != self.last_step && self.early_beats > 0 {
            self.early_beats -= 1;
            daemon.heartbeat_now.notify_one();
        }
        self.last_step = step;
    }

    pub fn busy(&self) -> bool {
        self.pending.is_some() || self.working.is_some()
    }

    fn free_slot(&self) -> Option<u32> {
        let held = self.held();
        (0..SLOTS_PER_RANK).find(|s| !held.contains(s))
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
        let path = self.dir.join("state.json");
        let tmp = self.dir.join("state.json.tmp");
        std::fs::write(&tmp, serde_json::to_vec(&state)?)
            .with_context(|| format!("writing {}", tmp.display()))?;
        std::fs::rename(&tmp, &path).with_context(|| format!("renaming {}", tmp.display()))?;
        Ok(())
    }
}

fn ranks_dir(cfg: &Config) -> PathBuf {
    cfg.shm_dir.join(cfg.run.as_str()).join("ranks")
}

/// Reloads what an earlier life of this daemon held in shm.
pub fn load_ranks(cfg: &Config) -> Result<HashMap<Rank, RankState>> {
    let mut ranks = HashMap::new();
    let dir = ranks_dir(cfg);
    let Ok(entries) = std::fs::read_dir(&dir) else {
        return Ok(ranks);
    };
    for entry in entries.flatten() {
        let path = entry.path().join("state.json");
        let Ok(bytes) = std::fs::read(&path) else {
            continue;
        };
        match serde_json::from_slice::<Persisted>(&bytes) {
            Ok(state) => {
                tracing::info!(rank = state.rank, t0 = ?state.t0.as_ref().map(|s| s.step), "found T0 from an earlier life");
                ranks.insert(
                    state.rank,
                    RankState {
                        rank: state.rank,
                        world_size: state.world_size,
                        pid: 0,
                        slot_bytes: state.slot_bytes,
                        tensors: state.tensors,
                        dir: entry.path(),
                        t0: state.t0,
                        pending: None,
                        pending_at: Instant::now(),
                        replica_at: None,
                        working: None,
                        uploading: None,
                        restoring: None,
                        durable_waiting: None,
                        stored: None,
                        base: state.base,
                        last_step: 0,
                        last_seen: Instant::now(),
                        compute_us: 0,
                        early_beats: 0,
                    },
                );
            }
            Err(error) => {
                tracing::warn!(path = %path.display(), %error, "ignoring unreadable rank state")
            }
        }
    }
    Ok(ranks)
}

pub fn bind_socket(cfg: &Config) -> Result<std::os::unix::net::UnixListener> {
    if let Some(parent) = cfg.socket.parent() {
        std::fs::create_dir_all(parent)
            .map_err(|e| ConfigError(format!("cannot create {}: {e}", parent.display())))?;
    }
    // A socket file left by a dead daemon is replaced; a live one answers and is kept.
    if std::os::unix::net::UnixStream::connect(&cfg.socket).is_ok() {
        bail!(ConfigError(format!(
            "another ckptd is listening on {}",
            cfg.socket.display()
        )));
    }
    let _ = std::fs::remove_file(&cfg.socket);
    let listener = std::os::unix::net::UnixListener::bind(&cfg.socket)
        .map_err(|e| ConfigError(format!("cannot bind {}: {e}", cfg.socket.display())))?;
    std::fs::set_permissions(
        &cfg.socket,
        std::fs::Permissions::from_mode(cfg.socket_mode),
    )?;
    listener.set_nonblocking(true)?;
    Ok(listener)
}

pub async fn serve(daemon: Arc<Daemon>, listener: std::os::unix::net::UnixListener) {
    let listener = match UnixListener::from_std(listener) {
        Ok(listener) => listener,
        Err(error) => {
            tracing::error!(%error, "cannot serve the local socket");
            return;
        }
    };
    loop {
        match listener.accept().await {
            Ok((stream, _)) => {
                let daemon = daemon.clone();
                tokio::spawn(async move {
                    let mut registered = None;
                    if let Err(error) = session(&daemon, stream, &mut registered).await {
                        if !matches!(error.downcast_ref::<WireError>(), Some(WireError::Closed)) {
                            tracing::warn!(error = %format!("{error:#}"), "local session ended");
                        }
                    }
                    if let Some((rank, pid)) = registered {
                        let closed_us = lazarus_shared::store::now_unix_us();
                        if daemon.exit_watched.lock().is_ok_and(|w| w.contains(&pid)) {
                            // The rank's exit thread reports a death with its exact time; the
                            // connection alone ending, with the process alive, counts as
                            // down only after this grace.
                            tokio::time::sleep(EXIT_GRACE).await;
                        }
                        rank_gone(&daemon, rank, pid, closed_us).await;
                    }
                });
            }
            Err(error) => {
                tracing::warn!(%error, "accept on the local socket");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
}

/// The supervisor stops the world (`KILL`) or asks it to checkpoint and exit (`TERM`): the
/// signal goes to every registered local rank.
pub async fn signal_ranks(daemon: &Arc<Daemon>, signal: &str) {
    let pids: Vec<(Rank, u32)> = daemon
        .ranks
        .lock()
        .await
        .values()
        .filter(|s| s.pid != 0)
        .map(|s| (s.rank, s.pid))
        .collect();
    for (rank, pid) in pids {
        tracing::info!(rank, pid, signal, "signalling the rank for the supervisor");
        let _ = tokio::process::Command::new("kill")
            .args([&format!("-{signal}"), &pid.to_string()])
            .status()
            .await;
    }
}

/// Step changes a newly registered rank reports to the leader at once (`early_beats`).
const EARLY_BEATS: u8 = 2;

/// How long a rank whose exit is watched may keep running after its connection ended before
/// it counts as down anyway.
const EXIT_GRACE: Duration = Duration::from_millis(300);

/// Waits on a thread of its own for the rank's process to exit (a pidfd), and reports the
/// death with the time the kernel made it visible. When one rank dies the launcher kills the
/// others within milliseconds; the supervisor names the first death by these times, so they
/// must not depend on how busy this daemon's runtime is when the socket's end is noticed.
/// Without pidfds (an old kernel, another pid namespace) the socket's end alone reports.
fn watch_exit(daemon: &Arc<Daemon>, rank: Rank, pid: u32) {
    let Some(process) = i32::try_from(pid)
        .ok()
        .and_then(rustix::process::Pid::from_raw)
    else {
        return;
    };
    let pidfd = match rustix::process::pidfd_open(process, rustix::process::PidfdFlags::empty()) {
        Ok(fd) => fd,
        Err(error) => {
            tracing::debug!(rank, pid, %error, "cannot watch the rank's exit; its socket will tell");
            return;
        }
    };
    let Ok(mut watched) = daemon.exit_watched.lock() else {
        return;
    };
    if !watched.insert(pid) {
        return;
    }
    drop(watched);
    let watcher = daemon.clone();
    let runtime = tokio::runtime::Handle::current();
    let spawned = std::thread::Builder::new()
        .name(format!("exit-rank-{rank}"))
        .spawn(move || {
            let mut fds = [rustix::event::PollFd::new(
                &pidfd,
                rustix::event::PollFlags::IN,
            )];
            let exited = loop {
                match rustix::event::poll(&mut fds, None) {
                    Ok(_) => break true,
                    Err(rustix::io::Errno::INTR) => continue,
                    Err(error) => {
                        tracing::warn!(rank, pid, %error, "lost the watch on the rank's exit; its socket will tell");
                        break false;
                    }
                }
            };
            let exited_us = lazarus_shared::store::now_unix_us();
            if let Ok(mut watched) = watcher.exit_watched.lock() {
                watched.remove(&pid);
            }
            if exited {
                runtime.spawn(async move { rank_gone(&watcher, rank, pid, exited_us).await });
            }
        });
    if let Err(error) = spawned {
        tracing::warn!(rank, pid, %error, "cannot start the rank's exit watch; its socket will tell");
        if let Ok(mut watched) = daemon.exit_watched.lock() {
            watched.remove(&pid);
        }
    }
}

/// The process state of `pid` when it is neither running (`R`) nor sleeping (`S`, `I`):
/// `T` stopped, `t` stopped by a tracer, `D` waiting on IO, `Z` a zombie. `None` also when
/// `/proc` cannot tell (the process is gone, or in another pid namespace).
pub fn process_state(pid: u32) -> Option<char> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // "PID (COMM) STATE ...": COMM may hold spaces and parentheses, so read past the last ')'.
    let state = stat
        .get(stat.rfind(')')? + 1..)?
        .trim_start()
        .chars()
        .next()?;
    (!matches!(state, 'R' | 'S' | 'I')).then_some(state)
}

/// A registered rank exited, or its connection ended: the leader hears at once, with the time
/// it happened by this node's clock (`unix_us`).
async fn rank_gone(daemon: &Arc<Daemon>, rank: Rank, pid: u32, unix_us: u64) {
    let mut ranks = daemon.ranks.lock().await;
    if let Some(state) = ranks.get_mut(&rank).filter(|s| s.pid == pid) {
        state.pid = 0;
        tracing::info!(rank, pid, "rank disconnected");
        let _ = daemon.to_leader.send(Message::RankDown {
            node: daemon.cfg.node.clone(),
            run: daemon.cfg.run.clone(),
            rank,
            pid,
            unix_ms: unix_us / 1000,
            unix_us,
        });
    }
}

/// One rank's connection: `Register` first, then requests, one answer each. `registered`
/// says which rank (and pid) it was, for when it ends.
async fn session(
    daemon: &Arc<Daemon>,
    mut stream: UnixStream,
    registered: &mut Option<(Rank, u32)>,
) -> Result<()> {
    let mut rank: Option<Rank> = None;
    loop {
        let frame = wire::read_frame(&mut stream, None).await?;
        let (reply, payload) = match (frame.message, rank) {
            (
                Message::Register {
                    run,
                    rank: r,
                    world_size,
                    pid,
                    slot_bytes,
                    tensors,
                },
                _,
            ) => match register(daemon, run, r, world_size, pid, slot_bytes, tensors).await {
                Ok(reply) => {
                    rank = Some(r);
                    *registered = Some((r, pid));
                    (reply, Vec::new())
                }
                Err(error) => (refused(&error), Vec::new()),
            },
            (Message::Choose, Some(r)) => match choose(daemon, r).await {
                Ok((memory, durable)) => (
                    Message::StepChoice {
                        memory,
                        durable,
                        replica: None,
                    },
                    Vec::new(),
                ),
                Err(error) => (refused(&error), Vec::new()),
            },
            (Message::Restore { memory, durable }, Some(r)) => {
                match restore(daemon, r, memory, durable).await {
                    Ok(reply) => reply,
                    Err(error) => {
                        daemon.metrics.error("restore");
                        (refused(&error), Vec::new())
                    }
                }
            }
            (
                Message::Snapshot {
                    step,
                    slot,
                    durable,
                    blobs,
                    stall_us,
                },
                Some(r),
            ) => {
                daemon.metrics.stall_seconds.observe(stall_us as f64 / 1e6);
                let blobs = wire::unpack_blobs(&blobs, &frame.payload)?;
                (
                    snapshot(daemon, r, step, slot, durable, blobs).await?,
                    Vec::new(),
                )
            }
            (Message::Bye, Some(r)) => {
                // A clean exit is not a failure: forget the pid before the socket closes.
                *registered = None;
                let mut ranks = daemon.ranks.lock().await;
                let state = ranks
                    .get_mut(&r)
                    .ok_or_else(|| anyhow!("rank {r} vanished"))?;
                tracing::info!(rank = r, pid = state.pid, "rank finished");
                let _ = daemon.to_leader.send(Message::RankDone {
                    node: daemon.cfg.node.clone(),
                    run: daemon.cfg.run.clone(),
                    rank: r,
                    pid: state.pid,
                });
                state.pid = 0;
                (
                    Message::Held {
                        held: state.held(),
                        busy: state.busy(),
                        accepted: false,
                    },
                    Vec::new(),
                )
            }
            (Message::Skipped { step }, Some(r)) => {
                daemon.metrics.snapshots_skipped.inc();
                tracing::debug!(rank = r, step, "snapshot skipped");
                let ranks = daemon.ranks.lock().await;
                let state = ranks.get(&r).ok_or_else(|| anyhow!("rank {r} vanished"))?;
                (
                    Message::Held {
                        held: state.held(),
                        busy: state.busy(),
                        accepted: false,
                    },
                    Vec::new(),
                )
            }
            (Message::Poll { step, compute_us }, Some(r)) => {
                super::crash::point("poll");
                let mut ranks = daemon.ranks.lock().await;
                let state = ranks
                    .get_mut(&r)
                    .ok_or_else(|| anyhow!("rank {r} vanished"))?;
                state.saw_step(daemon, step);
                // Smoothed: one slow step is not a straggler.
                if compute_us > 0 {
                    state.compute_us = if state.compute_us == 0 {
                        compute_us
                    } else {
                        (4 * state.compute_us + compute_us) / 5
                    };
                }
                state.last_seen = Instant::now();
                (
                    Message::Held {
                        held: state.held(),
                        busy: state.busy(),
                        accepted: false,
                    },
                    Vec::new(),
                )
            }
            (other, None) => {
                bail!("a rank sent {} before registering", kind(&other))
            }
            (other, Some(_)) => bail!("unexpected {} on the local socket", kind(&other)),
        };
        wire::write_frame(&mut stream, &reply, &payload, None).await?;
    }
}

fn kind(message: &Message) -> String {
    serde_json::to_value(message)
        .ok()
        .and_then(|v| v["type"].as_str().map(String::from))
        .unwrap_or_else(|| "a message".into())
}

fn refused(error: &anyhow::Error) -> Message {
    tracing::warn!(error = %format!("{error:#}"), "refused a rank's request");
    Message::Refused {
        reason: format!("{error:#}"),
    }
}

fn check_layout(slot_bytes: u64, tensors: &[SlotTensor]) -> Result<()> {
    for t in tensors {
        let expected: u64 =
            t.slice.iter().map(|d| d.len).product::<u64>() * t.dtype.element_bytes() as u64;
        if t.bytes != expected
            || t.offset
                .checked_add(t.bytes)
                .is_none_or(|end| end > slot_bytes)
        {
            bail!(
                "tensor {} ({} bytes at {}) does not fit its slice or the {slot_bytes}-byte slot",
                t.name,
                t.bytes,
                t.offset
            );
        }
    }
    Ok(())
}

async fn register(
    daemon: &Arc<Daemon>,
    run: lazarus_shared::RunId,
    rank: Rank,
    world_size: u32,
    pid: u32,
    slot_bytes: u64,
    tensors: Vec<SlotTensor>,
) -> Result<Message> {
    if run != daemon.cfg.run {
        bail!(
            "this ckptd serves run {}, not {run}; start the trainer with run.id = {} or use that run's ckptd",
            daemon.cfg.run,
            daemon.cfg.run
        );
    }
    if world_size == 0 || rank >= world_size {
        bail!("rank {rank} is outside world size {world_size}");
    }
    check_layout(slot_bytes, &tensors)?;
    let mut ranks = daemon.ranks.lock().await;
    let others: u64 = ranks
        .values()
        .filter(|s| s.rank != rank)
        .map(|s| s.slot_bytes * u64::from(SLOTS_PER_RANK))
        .sum();
    // The slots, and with delta encoding the base copy of the last durable step.
    let needed = slot_bytes * (u64::from(SLOTS_PER_RANK) + u64::from(daemon.cfg.delta));
    if others + needed > daemon.cfg.memory_budget_bytes {
        bail!(
            "rank {rank} needs {needed} bytes of shm slots; with the other ranks that is over memory_budget_bytes {}",
            daemon.cfg.memory_budget_bytes
        );
    }
    let reuse = ranks.get(&rank).is_some_and(|s| {
        s.world_size == world_size && s.slot_bytes == slot_bytes && s.tensors == tensors
    });
    if let Some(old) = ranks.get(&rank).filter(|_| !reuse) {
        tracing::info!(rank, "layout changed: dropping the rank's old slots");
        let _ = std::fs::remove_dir_all(&old.dir);
        ranks.remove(&rank);
    }
    let dir = ranks_dir(&daemon.cfg).join(format!("rank-{rank}"));
    let mut state = match ranks.remove(&rank) {
        Some(mut state) => {
            state.pid = pid;
            state.last_seen = Instant::now();
            state.stored = None;
            // A new process has made no step yet: the leader hears its restored step when
            // it trains, not the step its predecessor died at.
            state.last_step = 0;
            state
        }
        None => {
            std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
            RankState {
                rank,
                world_size,
                pid,
                slot_bytes,
                tensors,
                dir: dir.clone(),
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
            }
        }
    };
    for slot in 0..SLOTS_PER_RANK {
        let path = state.slot_path(slot);
        let file = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .read(true)
            .write(true)
            .open(&path)
            .with_context(|| format!("creating {}", path.display()))?;
        std::fs::set_permissions(
            &path,
            std::fs::Permissions::from_mode(daemon.cfg.socket_mode),
        )?;
        if file.metadata()?.len() != slot_bytes {
            file.set_len(slot_bytes)
                .with_context(|| format!("sizing {}", path.display()))?;
        }
        // Reserve every page now: a rank writing a slot through its mapping into a full
        // tmpfs would die of SIGBUS; here it is a clear refusal instead.
        reserve(&file, slot_bytes, &path)?;
    }
    state.persist()?;
    let reply = Message::Registered {
        slots: (0..SLOTS_PER_RANK)
            .map(|s| state.slot_path(s).display().to_string())
            .collect(),
        held: state.held(),
    };
    tracing::info!(
        rank,
        world_size,
        pid,
        slot_bytes,
        reused = reuse,
        "rank registered"
    );
    state.early_beats = EARLY_BEATS;
    ranks.insert(rank, state);
    watch_exit(daemon, rank, pid);
    let _ = daemon.to_leader.send(Message::RankUp {
        node: daemon.cfg.node.clone(),
        run: daemon.cfg.run.clone(),
        rank,
        world_size,
        pid,
    });
    Ok(reply)
}

async fn snapshot(
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
    state.saw_step(daemon, step);
    state.last_seen = Instant::now();
    if slot >= SLOTS_PER_RANK || state.held().contains(&slot) {
        return Ok(Message::Refused {
            reason: format!("slot {slot} is not the rank's to hand over"),
        });
    }
    if state.busy() {
        daemon.metrics.snapshots_skipped.inc();
        return Ok(Message::Held {
            held: state.held(),
            busy: true,
            accepted: false,
        });
    }
    state.working = Some(slot);
    daemon.metrics.snapshots.inc();
    let reply = Message::Held {
        held: state.held(),
        busy: true,
        accepted: true,
    };
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
    state.working = None;
    match result {
        Ok(hashes) => {
            daemon
                .metrics
                .replicate_seconds
                .observe(started.elapsed().as_secs_f64());
            state.pending_at = Instant::now();
            state.pending = Some(Snap {
                step: job.step,
                slot: job.slot,
                hashes,
                blobs: job.blobs,
                durable_requested: job.durable,
            });
            let _ = daemon.to_leader.send(Message::Replicated {
                node: daemon.cfg.node.clone(),
                run: daemon.cfg.run.clone(),
                rank: job.rank,
                world_size: job.world_size,
                step: job.step,
                durable_requested: job.durable,
            });
        }
        Err(error) => {
            daemon.metrics.error("replicate");
            tracing::warn!(rank = job.rank, step = job.step, error = %format!("{error:#}"), "snapshot not replicated; the rank keeps its previous T0");
        }
    }
}

/// Reads the slot chunk by chunk, hashing each and streaming it to the buddy (T1).
async fn replicate(daemon: &Arc<Daemon>, job: &Job) -> Result<Vec<ChunkHash>> {
    let file = Arc::new(SlotFile::open(&job.path)?);
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
            Some(peer::ReplicaSender::begin(daemon, buddy, begin, &payload).await?)
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
            if state.pending.is_some() && state.pending_at.elapsed() > timeout {
                let step = state.pending.take().map(|p| p.step);
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

/// The leader memory-committed `step`: it becomes every local rank's T0, and is uploaded if
/// `durable`.
pub async fn memory_committed(daemon: &Arc<Daemon>, step: u64, durable: bool) {
    let mut ranks = daemon.ranks.lock().await;
    for state in ranks.values_mut() {
        if state.pending.as_ref().is_none_or(|p| p.step != step) {
            continue;
        }
        state.t0 = state.pending.take();
        if let Some(t0) = state.t0.as_mut().filter(|_| durable) {
            // Marked, so that an upload running now uploads this step when it ends.
            t0.durable_requested = true;
        }
        if let Err(error) = state.persist() {
            daemon.metrics.error("state");
            tracing::error!(error = %format!("{error:#}"), "cannot record T0");
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
    let Some(snap) = state.t0.clone() else {
        return;
    };
    if let Some(step) = state.stored.filter(|stored| stored.step == snap.step) {
        let _ = daemon.to_leader.send(stored_message(daemon, state, step));
        return;
    }
    if state.uploading.is_some() {
        if let Some(skipped) = state
            .durable_waiting
            .replace(snap.step)
            .filter(|&waiting| waiting < snap.step)
        {
            daemon.metrics.durable_skipped.inc();
            tracing::info!(
                rank = state.rank,
                skipped,
                next = snap.step,
                "an upload is still running: durable step {skipped} is skipped for a newer one"
            );
        }
        return;
    }
    state.durable_waiting = None;
    state.uploading = Some(snap.slot);
    tokio::spawn(upload(daemon.clone(), state.rank, snap));
}

/// The leader wants `step` durable (the job is ending): upload each rank's T0 of that step
/// unless an upload is running (the leader asks again).
pub async fn make_durable(daemon: &Arc<Daemon>, step: u64) {
    let mut ranks = daemon.ranks.lock().await;
    for state in ranks.values_mut() {
        if let Some(t0) = state.t0.as_mut().filter(|t0| t0.step == step) {
            t0.durable_requested = true;
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

/// Uploads a rank's T0 through the store library and tells the leader its manifest is stored.
/// A durable step committed to memory meanwhile is uploaded next.
async fn upload(daemon: Arc<Daemon>, rank: Rank, snap: Snap) {
    let uploaded = snap.step;
    let result = upload_inner(&daemon, rank, snap).await;
    let mut ranks = daemon.ranks.lock().await;
    if let Some(state) = ranks.get_mut(&rank) {
        state.uploading = None;
        match result {
            Ok((step, base)) => {
                if let Some(base) = base {
                    state.base = Some(base);
                }
                if let Err(error) = state.persist() {
                    tracing::error!(error = %format!("{error:#}"), "cannot record the delta base");
                }
                state.stored = Some(step);
                let _ = daemon.to_leader.send(stored_message(&daemon, state, step));
            }
            Err(error) => {
                daemon.metrics.error("upload");
                tracing::warn!(rank, error = %format!("{error:#}"), "durable upload failed; the next durable step tries again");
            }
        }
        if state
            .t0
            .as_ref()
            .is_some_and(|t0| t0.durable_requested && t0.step > uploaded)
        {
            start_upload(&daemon, state);
        } else if let Some(skipped) = state.durable_waiting.take() {
            // T0 moved on to a step that is not durable: the waiting one's slot is gone.
            daemon.metrics.durable_skipped.inc();
            tracing::info!(
                rank,
                skipped,
                "durable step {skipped} is skipped: newer steps replaced it while an upload ran"
            );
        }
    }
}

async fn upload_inner(
    daemon: &Arc<Daemon>,
    rank: Rank,
    snap: Snap,
) -> Result<(StepKey, Option<Base>)> {
    let (path, dir, tensors, world_size, base, slot_bytes) = {
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
            state.slot_bytes,
        )
    };
    let started = Instant::now();
    let timeline = daemon.run.current_timeline().await?;
    let key = StepKey::new(snap.step, timeline);
    let source: Arc<dyn ByteSource> = Arc::new(SlotFile::open(&path)?);
    let range = |t: &SlotTensor, source: &Arc<dyn ByteSource>| SourceRange {
        source: source.clone(),
        offset: t.offset,
        len: t.bytes,
    };
    let base_path = dir.join("base");
    let bases = match (&base, daemon.cfg.delta) {
        (Some(base), true) if base.chunks.len() == tensors.len() => {
            let base_source: Arc<dyn ByteSource> = Arc::new(SlotFile::open(&base_path)?);
            let mut bases = DeltaBases::default();
            for (tensor, chunks) in tensors.iter().zip(&base.chunks) {
                bases.insert(
                    tensor.name.clone(),
                    range(tensor, &base_source),
                    chunks.clone(),
                );
            }
            Some(bases)
        }
        _ => None,
    };
    let shard = sourced_shard(key, rank, world_size, &tensors, &source, &snap.blobs);
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
    let new_base = if daemon.cfg.delta {
        let tmp = dir.join("base.tmp");
        let from = path.clone();
        let to = tmp.clone();
        tokio::task::spawn_blocking(move || copy_file(&from, &to, slot_bytes)).await??;
        std::fs::rename(&tmp, &base_path)?;
        Some(Base {
            step: snap.step,
            chunks: manifest.tensors.iter().map(|t| t.chunks.clone()).collect(),
        })
    } else {
        None
    };
    Ok((key, new_base))
}

/// A rank's shard whose tensors are read from a slot (or replica) file.
fn sourced_shard(
    step: StepKey,
    rank: Rank,
    world_size: u32,
    tensors: &[SlotTensor],
    source: &Arc<dyn ByteSource>,
    blobs: &[(String, Vec<u8>)],
) -> SourcedShard {
    SourcedShard {
        step,
        rank,
        world_size,
        tensors: tensors
            .iter()
            .map(|t| SourcedTensor {
                name: t.name.clone(),
                dtype: t.dtype,
                global_shape: t.global_shape.clone(),
                slice: t.slice.clone(),
                data: SourceRange {
                    source: source.clone(),
                    offset: t.offset,
                    len: t.bytes,
                },
            })
            .collect(),
        blobs: blobs
            .iter()
            .map(|(n, b)| (n.clone(), Bytes::from(b.clone())))
            .collect(),
    }
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
    let (data, meta) = peer::held_replica(daemon, rank, step)?
        .ok_or_else(|| anyhow!("no replica of rank {rank} step {step} here"))?;
    verify_slot(&data, meta.slot_bytes, &meta.chunks).await?;
    let started = Instant::now();
    let key = StepKey::new(step, daemon.run.current_timeline().await?);
    let source: Arc<dyn ByteSource> = Arc::new(SlotFile::open(&data)?);
    let shard = sourced_shard(
        key,
        rank,
        meta.world_size,
        &meta.tensors,
        &source,
        &meta.blobs,
    );
    let manifest = daemon
        .run
        .write_shard_sourced(shard, None, &Counting(&daemon.metrics))
        .await?;
    daemon.metrics.bytes_stored.inc_by(manifest.uploaded_bytes);
    tracing::info!(rank, step = %key, raw = manifest.raw_bytes(), seconds = started.elapsed().as_secs_f64(), "replica stored as the rank's shard");
    Ok((key, meta.world_size))
}

/// The steps a world of this rank's size could restore: the leader's newest memory-committed
/// step, and the newest durable one. Waits first for the previous life's snapshot to be
/// replicated and reported, so its memory commit can still count. A durable upload in
/// flight is not waited for: it holds its own slot, and the memory step is newer.
async fn choose(daemon: &Arc<Daemon>, rank: Rank) -> Result<(Option<u64>, Option<StepKey>)> {
    let deadline = Instant::now() + Duration::from_secs(120);
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
        Ok((memory, durable, replica)) => {
            if let Some(state) = daemon.ranks.lock().await.get_mut(&rank) {
                state.replica_at = replica.and_then(|a| a.parse().ok());
            }
            Ok((memory, durable))
        }
        Err(error) => {
            tracing::warn!(error = %format!("{error:#}"), "the leader did not answer; offering the latest durable step");
            Ok((None, daemon.run.latest().await?))
        }
    }
}

/// Serves the step the ranks agreed on from T0, T1 or T2 (see `Message::Restore`).
///
/// The ranks lock is taken only to read what the restore needs and to install its result:
/// the re-hash of a T0 slot, the fetch from the buddy and the read from storage run without
/// it, so heartbeats, other ranks' polls and snapshots never wait for a restore (a T2
/// restore can take minutes). The slot a restore fills is held as `restoring` meanwhile.
async fn restore(
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
        // T0: the committed slot, or a replicated snapshot whose commit arrived late.
        let candidate = [state.t0.clone(), state.pending.clone()]
            .into_iter()
            .flatten()
            .find(|s| Some(s.step) == memory)
            .map(|snap| (state.slot_path(snap.slot), snap));
        (
            state.slot_bytes,
            state.tensors.clone(),
            state.world_size,
            candidate,
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
        let fetched = peer::fetch_replica(
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
    state.pending = None;
    if state.t0.as_ref().is_some_and(|t| Some(t.step) != keep) {
        state.t0 = None;
    }
    let slot = state.free_slot().ok_or_else(|| anyhow!("no free slot"))?;
    state.restoring = Some(slot);
    Ok((slot, state.slot_path(slot)))
}

/// A fill that failed lets its slot go.
async fn end_fill(daemon: &Arc<Daemon>, rank: Rank) {
    if let Some(state) = daemon.ranks.lock().await.get_mut(&rank) {
        state.restoring = None;
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
    state.restoring = None;
    state.pending = None;
    let found = snap.is_some();
    state.t0 = snap;
    state.persist()?;
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
    for name in ["trainer.json", lazarus_shared::hf_olmoe::MODEL_BLOB] {
        if checkpoint.manifest(0)?.blob(name).is_some() {
            blobs.push((name.to_string(), checkpoint.read_blob(0, name).await?));
        }
    }
    let source = Arc::new(SlotFile::open(path)?);
    let mut hashes = Vec::new();
    for index in 0..chunk_count(slot_bytes) {
        let data = read_chunk(&source, slot_bytes, index).await?;
        hashes.push(tokio::task::spawn_blocking(move || ChunkHash::of(&data)).await?);
    }
    Ok((hashes, blobs))
}

#[cfg(test)]
mod tests {
    use super::process_state;

    #[test]
    fn a_stopped_process_reads_as_state_t_and_a_running_one_as_none() {
        let mut child = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .expect("sleep runs");
        let pid = child.id();
        let signal = |name: &str| {
            std::process::Command::new("kill")
                .args([&format!("-{name}"), &pid.to_string()])
                .status()
                .expect("kill runs")
                .success()
        };
        let settle = |want: Option<char>| {
            for _ in 0..100 {
                if process_state(pid) == want {
                    return true;
                }
                std::thread::sleep(std::time::Duration::from_millis(10));
            }
            false
        };
        assert!(settle(None), "a sleeping process: {:?}", process_state(pid));
        assert!(signal("STOP"));
        assert!(settle(Some('T')), "stopped: {:?}", process_state(pid));
        assert!(signal("CONT"));
        assert!(settle(None), "continued: {:?}", process_state(pid));
        child.kill().expect("kill");
        child.wait().expect("wait");
        assert_eq!(process_state(pid), None, "a reaped process is gone");
    }
}
