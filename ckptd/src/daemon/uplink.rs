//! A node's uplink to the leader: one authenticated TCP connection per node (the leader's
//! own node too), over which the node says hello with what it holds, heartbeats its ranks,
//! reports replicated snapshots and stored shards, and receives memory commits and the
//! leader's orders. Also the one-shot requests a node or `ckptctl` sends (`which_step`,
//! `status`). This is the node's side; the leader's books are in [`super::leader`].

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Result};
use lazarus_shared::wire::{self, Message, T0Entry};
use lazarus_shared::{Rank, StepKey};
use tokio::net::TcpStream;
use tokio::sync::mpsc;

use super::{pipeline, process, Daemon};

/// A node's link to the leader: reconnects until it works, says hello with what the node
/// holds, re-sends pending reports, forwards new ones and applies pushed memory commits.
pub async fn link(daemon: Arc<Daemon>, mut outbox: mpsc::UnboundedReceiver<Message>) {
    let mut heartbeat = tokio::time::interval(Duration::from_millis(500));
    loop {
        let stream = match TcpStream::connect(daemon.cfg.leader).await {
            Ok(stream) => stream,
            Err(error) => {
                tracing::debug!(%error, leader = %daemon.cfg.leader, "leader not reachable yet");
                tokio::time::sleep(Duration::from_millis(200)).await;
                continue;
            }
        };
        let _ = stream.set_nodelay(true);
        let (mut reader, mut writer) = stream.into_split();
        let (hello, resend) = hello(&daemon).await;
        let key = daemon.key.clone();
        let mut ok = wire::write_frame(&mut writer, &hello, &[], Some(&key))
            .await
            .is_ok();
        for message in resend {
            ok = ok
                && wire::write_frame(&mut writer, &message, &[], Some(&key))
                    .await
                    .is_ok();
        }
        if !ok {
            tokio::time::sleep(Duration::from_millis(200)).await;
            continue;
        }
        tracing::info!(leader = %daemon.cfg.leader, "linked to the leader");
        let pushes = {
            let daemon = daemon.clone();
            tokio::spawn(async move {
                loop {
                    match wire::read_frame(&mut reader, Some(&daemon.key)).await {
                        Ok(frame) => match frame.message {
                            Message::MemoryCommitted { run, step, durable }
                                if run == daemon.cfg.run =>
                            {
                                pipeline::memory_committed(&daemon, step, durable).await;
                            }
                            Message::KillRanks { run } if run == daemon.cfg.run => {
                                process::signal_ranks(&daemon, "KILL").await;
                            }
                            Message::StopRanks { run } if run == daemon.cfg.run => {
                                process::signal_ranks(&daemon, "TERM").await;
                            }
                            Message::MakeDurable { run, step } if run == daemon.cfg.run => {
                                pipeline::make_durable(&daemon, step).await;
                            }
                            Message::UploadReplica { run, rank, step } if run == daemon.cfg.run => {
                                tokio::spawn(pipeline::upload_replica(daemon.clone(), rank, step));
                            }
                            Message::SetBuddy { address } => {
                                let buddy = address.and_then(|a| a.parse().ok());
                                tracing::info!(?buddy, "the supervisor set this node's buddy");
                                *daemon.buddy.lock().expect("not poisoned") = buddy;
                            }
                            other => {
                                tracing::warn!(?other, "unexpected message from the leader");
                                daemon.metrics.rejected("unexpected");
                            }
                        },
                        Err(error) => {
                            if !matches!(error, wire::WireError::Closed) {
                                daemon.metrics.rejected(error.cause());
                            }
                            break;
                        }
                    }
                }
            })
        };
        loop {
            let message = tokio::select! {
                message = outbox.recv() => match message {
                    Some(message) => message,
                    None => return,
                },
                _ = heartbeat.tick() => heartbeat_message(&daemon).await,
                _ = daemon.heartbeat_now.notified() => heartbeat_message(&daemon).await,
                _ = wait_finished(&pushes) => break,
            };
            if wire::write_frame(&mut writer, &message, &[], Some(&key))
                .await
                .is_err()
            {
                break;
            }
        }
        pushes.abort();
        tracing::warn!(leader = %daemon.cfg.leader, "lost the leader; reconnecting");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

async fn wait_finished(task: &tokio::task::JoinHandle<()>) {
    while !task.is_finished() {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

async fn heartbeat_message(daemon: &Daemon) -> Message {
    let mut beats: Vec<wire::RankBeat> = daemon
        .ranks
        .lock()
        .await
        .values()
        .filter(|s| s.pid != 0)
        .map(|s| wire::RankBeat {
            rank: s.rank,
            pid: s.pid,
            step: s.last_step,
            seen_ms_ago: s.last_seen.elapsed().as_millis() as u64,
            compute_us: s.compute_us,
            process_state: None,
        })
        .collect();
    // Read from /proc without the ranks lock, which every training step's poll takes.
    for beat in &mut beats {
        beat.process_state = process::process_state(beat.pid);
    }
    Message::NodeHeartbeat {
        node: daemon.cfg.node.clone(),
        ranks: beats,
    }
}

/// The hello, and the reports to send again (the old link may have lost them).
async fn hello(daemon: &Daemon) -> (Message, Vec<Message>) {
    let ranks = daemon.ranks.lock().await;
    let mut t0 = Vec::new();
    let mut resend = Vec::new();
    for state in ranks.values() {
        if let Some(snap) = &state.t0 {
            t0.push(T0Entry {
                run: daemon.cfg.run.clone(),
                rank: state.rank,
                world_size: state.world_size,
                step: snap.step,
            });
        }
        if state.pid != 0 {
            resend.push(Message::RankUp {
                node: daemon.cfg.node.clone(),
                run: daemon.cfg.run.clone(),
                rank: state.rank,
                world_size: state.world_size,
                pid: state.pid,
            });
        }
        if let Some(pending) = &state.pending {
            resend.push(Message::Replicated {
                node: daemon.cfg.node.clone(),
                run: daemon.cfg.run.clone(),
                rank: state.rank,
                world_size: state.world_size,
                step: pending.step,
                durable_requested: pending.durable_requested,
            });
        }
    }
    (
        Message::NodeHello {
            node: daemon.cfg.node.clone(),
            address: daemon.cfg.listen.to_string(),
            buddy: daemon
                .buddy
                .lock()
                .expect("not poisoned")
                .map(|b| b.to_string()),
            socket: daemon.cfg.socket.display().to_string(),
            t0,
        },
        resend,
    )
}

/// Asks the leader which step a world of `world_size` restores: (memory step, durable step,
/// where `rank`'s replica is).
pub async fn which_step(
    daemon: &Daemon,
    world_size: u32,
    rank: Rank,
) -> Result<(Option<u64>, Option<StepKey>, Option<String>)> {
    let reply = request(
        daemon,
        daemon.cfg.leader,
        &Message::WhichStep {
            run: daemon.cfg.run.clone(),
            world_size,
            rank,
        },
    )
    .await?;
    match reply {
        Message::StepChoice {
            memory,
            durable,
            replica,
        } => Ok((memory, durable, replica)),
        other => bail!("the leader answered {other:?}"),
    }
}

/// One authenticated request and its answer.
pub async fn request(daemon: &Daemon, to: SocketAddr, message: &Message) -> Result<Message> {
    super::framing::request(&daemon.key, to, message).await
}
