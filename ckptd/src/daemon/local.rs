//! The node's side facing its local ranks: the Unix socket they register and talk over,
//! one session per rank process (register, poll, snapshot hand-over, restore, bye), and the
//! watch on each rank's process exit that tells the leader of a death at once.
//!
//! What a rank's slots hold is `rank::RankState`'s business; this module takes the ranks
//! lock only to ask it, never across file or network I/O.

use std::collections::HashMap;
use std::os::unix::fs::PermissionsExt;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{anyhow, bail, Context, Result};
use lazarus_shared::busy_word::{self, BusyWord};
use lazarus_shared::store::RegionKind;
use lazarus_shared::wire::{self, Message, SlotTensor, WireError};
use lazarus_shared::Rank;
use tokio::net::{UnixListener, UnixStream};

use super::rank::RankState;
use super::slots::{reserve, BaseCopy, BASE_FILE};
use super::{pipeline, restore, Config, ConfigError, Daemon, SLOTS_PER_RANK};

fn ranks_dir(cfg: &Config) -> PathBuf {
    cfg.shm_dir.join(cfg.run.as_str()).join("ranks")
}

/// Reloads what an earlier life of this daemon held in shm.
pub fn load_ranks(cfg: &Config) -> HashMap<Rank, RankState> {
    RankState::load_all(&ranks_dir(cfg))
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
            step: state.last_step,
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
            (Message::Choose, Some(r)) => match restore::choose(daemon, r).await {
                Ok(offer) => (
                    Message::StepChoice {
                        memory: offer.memory,
                        durable: offer.durable,
                        replica: None,
                        skip: offer.skip,
                        losses: offer.losses,
                    },
                    Vec::new(),
                ),
                Err(error) => (refused(&error), Vec::new()),
            },
            (Message::Restore { memory, durable }, Some(r)) => {
                match restore::restore(daemon, r, memory, durable).await {
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
                    pipeline::snapshot(daemon, r, step, slot, durable, blobs).await?,
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
                (state.reply(), Vec::new())
            }
            (
                Message::Unhealthy {
                    step,
                    reason,
                    sdc,
                    restored,
                },
                Some(r),
            ) => {
                tracing::warn!(rank = r, step, %reason, "the rank's health check failed");
                let mut ranks = daemon.ranks.lock().await;
                let state = ranks
                    .get_mut(&r)
                    .ok_or_else(|| anyhow!("rank {r} vanished"))?;
                state.unhealthy = Some(wire::BadStep {
                    step,
                    reason,
                    sdc,
                    restored,
                });
                daemon.heartbeat_now.notify_one();
                (state.reply(), Vec::new())
            }
            (Message::Skipped { step }, Some(r)) => {
                daemon.metrics.snapshots_skipped.inc();
                tracing::debug!(rank = r, step, "snapshot skipped");
                let mut ranks = daemon.ranks.lock().await;
                let state = ranks
                    .get_mut(&r)
                    .ok_or_else(|| anyhow!("rank {r} vanished"))?;
                if state.saw_step(step) {
                    daemon.heartbeat_now.notify_one();
                }
                (state.reply(), Vec::new())
            }
            (
                Message::Poll {
                    step,
                    compute_us,
                    loss,
                },
                Some(r),
            ) => {
                super::crash::point("poll");
                let mut ranks = daemon.ranks.lock().await;
                let state = ranks
                    .get_mut(&r)
                    .ok_or_else(|| anyhow!("rank {r} vanished"))?;
                if state.saw_step(step) {
                    daemon.heartbeat_now.notify_one();
                }
                state.saw_compute(compute_us);
                if loss.is_some_and(|loss| state.heard_loss(step, loss)) {
                    daemon.heartbeat_now.notify_one();
                }
                (state.reply(), Vec::new())
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
    // An upload copies each stored region's chunks over the delta base through a map of their
    // range while other chunks are encoded against theirs: the ranges must not overlap.
    let mut stored: Vec<&SlotTensor> = tensors
        .iter()
        .filter(|t| t.kind == RegionKind::Stored && t.bytes > 0)
        .collect();
    stored.sort_by_key(|t| t.offset);
    for pair in stored.windows(2) {
        if pair[0].offset + pair[0].bytes > pair[1].offset {
            bail!(
                "tensors {} and {} overlap in the slot ({} bytes at {}, {} bytes at {})",
                pair[0].name,
                pair[1].name,
                pair[0].bytes,
                pair[0].offset,
                pair[1].bytes,
                pair[1].offset
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
    let dir = ranks_dir(&daemon.cfg).join(format!("rank-{rank}"));
    let reuse = {
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
        let reuse = ranks
            .get(&rank)
            .is_some_and(|s| s.fits(world_size, slot_bytes, &tensors));
        if !reuse && ranks.remove(&rank).is_some() {
            tracing::info!(rank, "layout changed: dropping the rank's old slots");
        }
        reuse
    };
    // The slot files are made (and their pages reserved) without the ranks lock: other
    // ranks' polls and the heartbeat go on meanwhile. A rank registers from one process at
    // a time, so nothing else touches its directory.
    let busy_word = {
        let (dir, mode, delta) = (dir.clone(), daemon.cfg.socket_mode, daemon.cfg.delta);
        tokio::task::spawn_blocking(move || make_slots(&dir, slot_bytes, mode, !reuse, delta))
            .await??
    };
    let mut ranks = daemon.ranks.lock().await;
    let mut state = ranks
        .remove(&rank)
        .filter(|s| s.fits(world_size, slot_bytes, &tensors))
        .unwrap_or_else(|| RankState::new(rank, world_size, slot_bytes, tensors, dir));
    state.registered(pid)?;
    state.attach_busy_word(busy_word);
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
    ranks.insert(rank, state);
    drop(ranks);
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

/// The rank's slot files in `dir`, sized and with every page reserved: a rank writing a
/// slot through its mapping into a full tmpfs would die of SIGBUS; here it is a clear
/// refusal instead. With `delta`, the delta-base file too ([`BaseCopy::make`]). `fresh`
/// first removes what an earlier layout left there. With them, the rank's busy word.
fn make_slots(
    dir: &std::path::Path,
    slot_bytes: u64,
    mode: u32,
    fresh: bool,
    delta: bool,
) -> Result<BusyWord> {
    if fresh {
        let _ = std::fs::remove_dir_all(dir);
    }
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    for slot in 0..SLOTS_PER_RANK {
        let path = dir.join(format!("slot-{slot}"));
        let file = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .read(true)
            .write(true)
            .open(&path)
            .with_context(|| format!("creating {}", path.display()))?;
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode))?;
        if file.metadata()?.len() != slot_bytes {
            file.set_len(slot_bytes)
                .with_context(|| format!("sizing {}", path.display()))?;
        }
        reserve(&file, slot_bytes, &path)?;
    }
    if delta {
        BaseCopy::make(&dir.join(BASE_FILE), slot_bytes)?;
    }
    let path = dir.join(busy_word::FILE_NAME);
    BusyWord::create(&path, mode).with_context(|| format!("creating {}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::daemon::testing::slot_tensor;

    /// A layout whose stored tensors overlap in the slot is refused: an upload maps each
    /// chunk's range of the delta base to copy over it while others are encoded from theirs.
    /// Tensors end to end, or a region only read, are fine.
    #[test]
    fn stored_tensors_that_overlap_are_refused() {
        let a = slot_tensor("a", 0, 100, RegionKind::Stored);
        let b = slot_tensor("b", 400, 100, RegionKind::Stored);
        check_layout(800, &[b.clone(), a.clone()]).unwrap();
        let read = slot_tensor("r", 200, 100, RegionKind::Read);
        check_layout(800, &[a.clone(), read, b]).unwrap();
        let overlapping = slot_tensor("c", 396, 10, RegionKind::Stored);
        let error = check_layout(800, &[a, overlapping]).unwrap_err();
        assert!(error.to_string().contains("overlap"), "{error}");
    }
}
