//! A node's uplink to the leader: one authenticated TCP connection per node (the leader's
//! own node too), over which the node says hello with what it holds, heartbeats its ranks,
//! reports replicated snapshots and stored shards, and receives memory commits and the
//! leader's orders. Also the one-shot requests a node or `ckptctl` sends (`which_step`,
//! `status`). This is the node's side; the leader's books are in [`super::leader`].

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Result};
use lazarus_shared::wire::{self, Message, RollbackMark, T0Entry};
use lazarus_shared::{Rank, StepKey};
use tokio::sync::mpsc;

use super::{pipeline, process, Daemon};

/// A node's link to the leader it follows (the newest leadership it knows of): reconnects
/// until it works, says hello with what the node holds, re-sends pending reports, forwards new
/// ones and applies the leader's pushes. Orders of an older epoch than this node knows are
/// refused; a new leadership moves the link.
pub async fn link(daemon: Arc<Daemon>, mut outbox: mpsc::UnboundedReceiver<Message>) {
    let mut heartbeat = tokio::time::interval(Duration::from_millis(500));
    let mut leadership = daemon.leadership.subscribe();
    loop {
        let target = leadership.borrow_and_update().address;
        let connect = tokio::time::timeout(Duration::from_secs(1), super::framing::dial(target));
        let stream = match connect.await {
            Ok(Ok(stream)) => stream,
            Ok(Err(error)) => {
                tracing::debug!(%error, leader = %target, "leader not reachable");
                tokio::time::sleep(Duration::from_millis(200)).await;
                continue;
            }
            Err(_) => {
                tracing::debug!(leader = %target, "leader did not answer the connection");
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
        tracing::info!(leader = %target, "linked to the leader");
        // Set once this node follows a newer leader: the link then only listens, for a
        // while, to refuse and count what the deposed leader still sends.
        let deposed = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let pushes = {
            let (daemon, deposed) = (daemon.clone(), deposed.clone());
            tokio::spawn(async move {
                loop {
                    match wire::read_frame(&mut reader, Some(&daemon.key)).await {
                        Ok(frame) if deposed.load(std::sync::atomic::Ordering::SeqCst) => {
                            refuse_late(&daemon, &frame.message);
                        }
                        Ok(frame) => {
                            if !pushed(&daemon, frame.message).await {
                                break;
                            }
                        }
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
                changed = leadership.changed() => {
                    if changed.is_err() {
                        break;
                    }
                    if leadership.borrow().address != target {
                        deposed.store(true, std::sync::atomic::Ordering::SeqCst);
                        let listening = pushes.abort_handle();
                        tokio::spawn(async move {
                            tokio::time::sleep(DEPOSED_LISTEN).await;
                            listening.abort();
                        });
                        break;
                    }
                    continue;
                }
            };
            // A leader behind a black-holed network stops reading: give up on the link
            // rather than wait, so this node can follow another leader.
            let sent = tokio::time::timeout(
                Duration::from_secs(5),
                wire::write_frame(&mut writer, &message, &[], Some(&key)),
            )
            .await;
            if !matches!(sent, Ok(Ok(()))) {
                break;
            }
        }
        if deposed.load(std::sync::atomic::Ordering::SeqCst) {
            tracing::info!(old = %target, "following a new leader; the old one's link only listens now");
        } else {
            pushes.abort();
            tracing::warn!(leader = %target, "lost the link to the leader; reconnecting");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// How long a node keeps listening on its link to a leader it no longer follows (the link
/// ends sooner when that leader closes it). Whatever arrives there meanwhile, say held by a
/// partition that healed, is refused and counted.
const DEPOSED_LISTEN: Duration = Duration::from_secs(30);

/// A message on the link to a leader this node no longer follows: never applied; an order
/// of an older epoch than this node knows is counted as refused.
fn refuse_late(daemon: &Daemon, message: &Message) {
    let known = daemon.leadership.borrow().epoch;
    if let Some(epoch) = message.leader_epoch().filter(|e| *e < known) {
        daemon.metrics.rejected("stale_epoch");
        tracing::warn!(epoch, known, "refused a late message of a deposed leader");
    }
}

/// Whether an order of leadership `epoch` may act here: not when this node knows a newer
/// one (the sender was deposed). A refusal is counted; a current order counts as hearing
/// from the leader.
fn current(daemon: &Daemon, epoch: u64) -> bool {
    let known = daemon.leadership.borrow().epoch;
    if epoch < known {
        daemon.metrics.rejected("stale_epoch");
        tracing::warn!(epoch, known, "refused an order of a deposed leader");
        return false;
    }
    daemon.heard_from_leader();
    true
}

/// Applies one push from the leader; false ends the link (a deposed leader's, or a protocol
/// break).
pub(super) async fn pushed(daemon: &Arc<Daemon>, message: Message) -> bool {
    let run = &daemon.cfg.run;
    if let Some(epoch) = message.leader_epoch() {
        if !current(daemon, epoch) {
            return false;
        }
    }
    match message {
        // The daemon at this address does not lead (any more): follow the one it names when
        // that is news, else keep looking (the silence counts on, and the store is asked).
        Message::NotLeader { epoch, leader } => {
            if let Some(address) = leader.and_then(|a| a.parse().ok()) {
                super::election::follow(
                    daemon,
                    super::election::Leadership {
                        epoch,
                        node: String::new(),
                        address,
                        succession: Vec::new(),
                    },
                );
            }
            return false;
        }
        Message::Leading {
            epoch,
            node,
            succession,
            rollback,
        } => {
            if let Some(leaders) = rollback {
                // Every node of a leader holds its mark, so a buddy can tell a replica handed
                // over before a rollback by the sender's (`peer`), whenever the sender started.
                let mut mark = daemon.rollback.lock().expect("not poisoned");
                *mark = (*mark).max(leaders);
            }
            daemon.metrics.leader_epoch.set(epoch as i64);
            daemon.leadership.send_if_modified(|known| {
                let changed =
                    known.epoch != epoch || known.node != node || known.succession != succession;
                known.epoch = epoch;
                known.node = node;
                known.succession = succession;
                changed
            });
        }
        Message::LeaderBeat { .. } => {}
        Message::MemoryCommitted {
            run: r,
            step,
            durable,
            ..
        } if r == *run => pipeline::memory_committed(daemon, step, durable).await,
        Message::CommitsGivenUp {
            run: r, through, ..
        } if r == *run => pipeline::given_up(daemon, through).await,
        Message::KillRanks { run: r, .. } if r == *run => {
            process::signal_ranks(daemon, "KILL").await
        }
        Message::StopRanks { run: r, .. } if r == *run => {
            process::signal_ranks(daemon, "TERM").await
        }
        Message::MakeDurable { run: r, step, .. } if r == *run => {
            pipeline::make_durable(daemon, step).await
        }
        Message::UploadReplica {
            run: r, rank, step, ..
        } if r == *run => {
            // It takes none of the daemon's locks (only, for a moment, the list of replicas
            // being uploaded): all of it runs on the data path.
            daemon
                .data
                .spawn(pipeline::upload_replica(daemon.clone(), rank, step));
        }
        Message::RolledBack {
            run: r,
            to,
            epoch,
            seq,
        } if r == *run => {
            tracing::warn!(
                ?to,
                "the supervisor rolled the run back; forgetting later snapshots"
            );
            let applied = RollbackMark { epoch, seq };
            let mut ranks = daemon.ranks.lock().await;
            let mut forgot = true;
            for state in ranks.values_mut() {
                if let Err(error) = state.forget_after(to) {
                    forgot = false;
                    tracing::error!(rank = state.rank, error = %format!("{error:#}"), "cannot forget a rolled-back snapshot");
                }
            }
            // Under `ranks`, as snapshots are handed over: one handed over before this, still
            // being replicated, is dropped when that ends (`pipeline::process`).
            {
                let mut mark = daemon.rollback.lock().expect("not poisoned");
                *mark = (*mark).max(applied);
            }
            drop(ranks);
            // Off the link: a replica being received (from a buddy that may stall) ends first.
            // The rollbacks' replicas are forgotten and recorded one after the other, in
            // order (each task waits for the one before and takes its verdict): a mark
            // recorded says every rollback up to it was forgotten.
            let mut tail = daemon.forget_tail.lock().expect("not poisoned");
            let before = tail.take();
            let daemon = daemon.clone();
            *tail = Some(tokio::spawn(async move {
                // One that panicked may not have forgotten all of its rollback.
                if let Some(before) = before {
                    forgot &= before.await.unwrap_or(false);
                }
                if let Err(error) = super::replica::forget_after(&daemon, to).await {
                    forgot = false;
                    tracing::error!(error = %format!("{error:#}"), "cannot forget rolled-back replicas");
                }
                // Only once all of it, and all of every rollback before it, is gone: a daemon
                // restarted before says the mark from before, and is told again.
                if forgot {
                    let mut identity = daemon.identity.lock().expect("not poisoned");
                    let recorded = super::identity::Identity {
                        forgotten: identity.forgotten.max(applied),
                        ..*identity
                    };
                    match super::identity::store(&super::identity::dir(&daemon.cfg), &recorded) {
                        Ok(()) => *identity = recorded,
                        Err(error) => {
                            tracing::error!(error = %format!("{error:#}"), "cannot record the rollback as forgotten")
                        }
                    }
                }
                forgot
            }));
        }
        Message::RunEnded {
            run: r,
            preempted,
            failed,
            ..
        } if r == *run => {
            tracing::info!(
                preempted,
                failed,
                "the leader says supervision of the run is over"
            );
            daemon
                .run_ended
                .store(true, std::sync::atomic::Ordering::SeqCst);
            if daemon
                .cfg
                .supervision
                .as_ref()
                .is_some_and(|plan| plan.exit_when_done)
            {
                let ending = if failed {
                    super::supervisor::Ending::Failed
                } else if preempted {
                    super::supervisor::Ending::Preempted
                } else {
                    super::supervisor::Ending::Completed
                };
                let _ = daemon.done.try_send(ending);
            }
        }
        Message::SetBuddy { address, .. } => {
            let buddy = address.and_then(|a| a.parse().ok());
            tracing::info!(?buddy, "the supervisor set this node's buddy");
            *daemon.buddy.lock().expect("not poisoned") = buddy;
        }
        other => {
            tracing::warn!(?other, "unexpected message from the leader");
            daemon.metrics.rejected("unexpected");
        }
    }
    true
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
        .values_mut()
        .filter(|s| s.pid != 0)
        .map(|s| wire::RankBeat {
            rank: s.rank,
            pid: s.pid,
            step: s.last_step,
            seen_ms_ago: s.last_seen.elapsed().as_millis() as u64,
            compute_us: s.compute_us,
            process_state: None,
            restored_from: s.restored_from,
            unhealthy: s.unhealthy.clone(),
            losses: std::mem::take(&mut s.losses),
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
async fn hello(daemon: &Arc<Daemon>) -> (Message, Vec<Message>) {
    let replicas = super::replica::all_held(daemon).await;
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
                upload: Some(state.upload_report()),
                // A pending snapshot of a step rolled back from was forgotten with it.
                rollback: *daemon.rollback.lock().expect("not poisoned"),
            });
        }
    }
    (
        Message::NodeHello {
            node: daemon.cfg.node.clone(),
            address: daemon.cfg.advertise.to_string(),
            buddy: daemon
                .buddy
                .lock()
                .expect("not poisoned")
                .map(|b| b.to_string()),
            socket: daemon.cfg.socket.display().to_string(),
            t0,
            epoch: daemon.leadership.borrow().epoch,
            candidate: daemon.cfg.candidate,
            replicas,
            instance: daemon.identity.lock().expect("not poisoned").instance,
            rollback: *daemon.rollback.lock().expect("not poisoned"),
        },
        resend,
    )
}

/// The leader's answer to which step a world restores.
#[derive(Debug, Default)]
pub struct Offer {
    pub memory: Option<u64>,
    pub durable: Option<StepKey>,
    /// Where the asking rank's newest replica is.
    pub replica: Option<String>,
    pub skip: Option<wire::DataSkip>,
    /// `(step, loss)` the run had after the offered steps (see `Message::StepChoice`).
    pub losses: Vec<(u64, f64)>,
}

/// Asks the leader which step a world of `world_size` restores, and where `rank`'s replica
/// is.
pub async fn which_step(daemon: &Daemon, world_size: u32, rank: Rank) -> Result<Offer> {
    let leader = daemon.leadership.borrow().address;
    let reply = request(
        daemon,
        leader,
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
            skip,
            losses,
        } => Ok(Offer {
            memory,
            durable,
            replica,
            skip,
            losses,
        }),
        other => bail!("the leader answered {other:?}"),
    }
}

/// One authenticated request and its answer.
pub async fn request(daemon: &Daemon, to: SocketAddr, message: &Message) -> Result<Message> {
    super::framing::request(&daemon.key, to, message).await
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use lazarus_shared::wire::Message;

    use super::pushed;
    use crate::daemon::metrics::Cause;
    use crate::daemon::supervisor::Ending;
    use crate::daemon::{identity, testing, Daemon};

    /// A daemon that follows leadership epoch 3, with nothing running, and what it sends when
    /// it is done (with `flags` that make it exit when the run is over).
    async fn follower(
        dir: &std::path::Path,
        flags: &[&str],
    ) -> (Arc<Daemon>, tokio::sync::mpsc::Receiver<Ending>) {
        let (daemon, _, ended) = testing::follower(dir, flags).await;
        (daemon, ended)
    }

    #[tokio::test]
    async fn orders_of_an_older_epoch_are_refused_counted_and_end_the_link() {
        let dir = tempfile::tempdir().unwrap();
        let (daemon, _) = follower(dir.path(), &[]).await;
        let refused = || {
            daemon
                .metrics
                .peer_rejected
                .get_or_create(&Cause {
                    cause: "stale_epoch".into(),
                })
                .get()
        };
        let set_buddy = |epoch| Message::SetBuddy {
            address: Some("127.0.0.1:7009".into()),
            epoch,
        };
        // A deposed leader's order: refused, counted, and its link ends.
        assert!(!pushed(&daemon, set_buddy(2)).await);
        assert!(!pushed(&daemon, Message::LeaderBeat { epoch: 2 }).await);
        let kill = Message::KillRanks {
            run: daemon.cfg.run.clone(),
            epoch: 1,
        };
        assert!(!pushed(&daemon, kill).await);
        assert_eq!(refused(), 3);
        assert_eq!(*daemon.buddy.lock().unwrap(), None, "nothing was done");
        // The current leader's orders act.
        assert!(pushed(&daemon, set_buddy(3)).await);
        assert_eq!(
            daemon.buddy.lock().unwrap().map(|b| b.to_string()),
            Some("127.0.0.1:7009".to_string())
        );
        // A newer leader's first frame moves this node to its epoch, and to its rollback
        // mark; the old one's are refused from then on.
        let mark = lazarus_shared::wire::RollbackMark { epoch: 4, seq: 2 };
        let leading = Message::Leading {
            epoch: 4,
            node: "n3".into(),
            succession: Vec::new(),
            rollback: Some(mark),
        };
        assert!(pushed(&daemon, leading).await);
        assert_eq!(daemon.leadership.borrow().epoch, 4);
        assert_eq!(*daemon.rollback.lock().unwrap(), mark);
        assert!(!pushed(&daemon, set_buddy(3)).await);
        assert_eq!(refused(), 4);
    }

    /// The rollbacks a daemon applied are recorded in its state's identity once their
    /// snapshots and replicas are forgotten, in order: a restarted daemon says the last one.
    #[tokio::test]
    async fn the_rollbacks_forgotten_are_recorded_for_a_restart() {
        let dir = tempfile::tempdir().unwrap();
        let (daemon, _) = follower(dir.path(), &[]).await;
        for seq in 1..=3 {
            let rolled_back = Message::RolledBack {
                run: daemon.cfg.run.clone(),
                to: Some(10 * seq),
                epoch: 3,
                seq,
            };
            assert!(pushed(&daemon, rolled_back).await);
        }
        let last = lazarus_shared::wire::RollbackMark { epoch: 3, seq: 3 };
        let kept = || crate::daemon::identity::load_or_create(&identity::dir(&daemon.cfg)).unwrap();
        for _ in 0..200 {
            if daemon.identity.lock().unwrap().forgotten == last {
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
        assert_eq!(kept().forgotten, last);
        assert_eq!(kept().instance, daemon.identity.lock().unwrap().instance);
        assert_eq!(*daemon.rollback.lock().unwrap(), last);
    }

    #[tokio::test]
    async fn the_end_of_the_run_ends_a_follower_that_exits_when_done_and_no_one_takes_over() {
        let dir = tempfile::tempdir().unwrap();
        let flags = [
            "--leader-candidate",
            "--supervise",
            "srun",
            "--trainer",
            "/unused/trainer",
            "--active-nodes",
            "1",
            "--exit-when-done",
            "--trainer-arg=train",
        ];
        let (daemon, mut ended) = follower(dir.path(), &flags).await;
        let run_ended = |epoch| Message::RunEnded {
            run: daemon.cfg.run.clone(),
            preempted: true,
            failed: false,
            epoch,
        };
        // A deposed leader cannot end the run.
        assert!(!pushed(&daemon, run_ended(2)).await);
        assert!(ended.try_recv().is_err());
        assert!(!daemon.run_ended.load(std::sync::atomic::Ordering::SeqCst));
        // The current one can: this daemon exits, and it will not take over.
        assert!(pushed(&daemon, run_ended(3)).await);
        assert_eq!(ended.try_recv().ok(), Some(Ending::Preempted));
        assert!(daemon.run_ended.load(std::sync::atomic::Ordering::SeqCst));
    }
}
