//! Leadership (DESIGN.md section 4): which daemon leads the job, for which epoch, and the
//! takeover when the leader is lost.
//!
//! - The epoch is decided by the store's create-only write
//!   (`RunStore::claim_leadership`): whoever creates `leaders/<e>.json` leads epoch `e`, and
//!   two daemons racing for one epoch cannot both win. Every daemon follows the newest epoch
//!   it knows of and refuses the orders of an older one (`peer_messages_rejected{cause=
//!   "stale_epoch"}`).
//! - The leader renews a lease in the store while it hears from most of its nodes. A
//!   candidate that lost the leader takes over only when the lease stands still: a node cut
//!   off alone does not depose a leader the others still reach, while a leader cut off from
//!   the others stops renewing and is replaced.
//! - The leader publishes the order of succession (`Message::Leading`); a candidate waits
//!   `STAGGER` per place before it tries, so the first live successor leads and the others
//!   find its record and follow it.
//! - A leader finds out it was deposed from the store (the record of the next epoch, looked
//!   for every lease interval), from a node's hello or from the new leader's `NewLeader`,
//!   and stops acting at once; the world it launched is left running for its successor.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Result;
use lazarus_shared::format::{LeaderRecord, LeaseRecord};
use lazarus_shared::store::{now_unix_ms, RunStore};
use lazarus_shared::wire::{Message, Successor};

use super::leader::Leader;
use super::{framing, Config, ConfigError, Daemon};

/// The leader this daemon follows (or is): the newest leadership it knows of.
#[derive(Clone, Debug, PartialEq)]
pub struct Leadership {
    /// 0 until the leader told its epoch (a follower that found no record at start).
    pub epoch: u64,
    pub node: String,
    pub address: SocketAddr,
    /// Who takes over, in order, as the leader last published it.
    pub succession: Vec<Successor>,
}

impl Leadership {
    fn of(record: &LeaderRecord) -> Result<Self> {
        Ok(Self {
            epoch: record.epoch,
            node: record.node.clone(),
            address: record.address.parse()?,
            succession: Vec::new(),
        })
    }
}

/// A candidate's wait per place in the order of succession.
pub const STAGGER: Duration = Duration::from_secs(1);

/// How often the leader renews its lease and looks for a newer epoch.
pub fn lease_interval(cfg: &Config) -> Duration {
    Duration::from_secs_f64((cfg.heartbeat_timeout_seconds / 4.0).clamp(0.1, 1.0))
}

/// How a daemon starts.
#[derive(Debug)]
pub enum Start {
    /// It leads this epoch; after the leadership named in the store before it, if any, whose
    /// leader renews no lease (this daemon before its restart, or a lost one).
    Lead(u64, Option<Takeover>),
    Follow(Leadership),
}

/// How a daemon came to lead.
#[derive(Debug)]
pub enum Began {
    /// At its start: the run's first leader (`None`), or one after a leader that renews no
    /// lease (a restart of its own, or a requeued job's daemon). Its timeline records the
    /// succession as a takeover's; a world still running is adopted as after a restart.
    AtStart(Option<Takeover>),
    /// A candidate that lost the leader while it ran: the lost leader's nodes are told at
    /// once, and its world, which may still run, is adopted as after a takeover.
    TookOver(Takeover),
}

/// At start, before the daemon's ports open: a `lead` daemon claims the next epoch, unless
/// another daemon leads with a live lease (then it follows, as a candidate); so does a
/// candidate that led last (it restarted: following its own record would leave the job
/// without a leader). The others follow the newest leadership in the store, or the
/// configured leader while there is none.
pub async fn start(cfg: &Config, run: &RunStore) -> Result<Start> {
    let newest = run.leadership().await.map_err(|e| {
        ConfigError(format!(
            "cannot read the run's leadership from {}: {e}",
            cfg.store
        ))
    })?;
    let led_last = cfg.candidate && newest.as_ref().is_some_and(|r| r.node == cfg.node);
    if !cfg.lead && !led_last {
        return Ok(Start::Follow(match &newest {
            Some(record) => Leadership::of(record)?,
            None => Leadership {
                epoch: 0,
                node: String::new(),
                address: cfg.leader,
                succession: Vec::new(),
            },
        }));
    }
    if let Some(record) = newest.as_ref().filter(|r| r.node != cfg.node) {
        if lease_renewed(cfg, run, record.epoch).await {
            tracing::warn!(leader = %record.node, epoch = record.epoch, "another daemon leads and renews its lease: following it");
            return Ok(Start::Follow(Leadership::of(record)?));
        }
    }
    let mut epoch = newest.as_ref().map_or(1, |r| r.epoch + 1);
    loop {
        if run
            .claim_leadership(epoch, &cfg.node, &cfg.advertise.to_string())
            .await?
        {
            let after = match &newest {
                Some(record) => lost_at_start(cfg, run, record).await,
                None => None,
            };
            return Ok(Start::Lead(epoch, after));
        }
        if let Some(record) = run.leadership_at(epoch).await? {
            tracing::warn!(leader = %record.node, epoch, "another daemon claimed the epoch first: following it");
            return Ok(Start::Follow(Leadership::of(&record)?));
        }
        epoch += 1;
    }
}

/// The leadership `record` names, lost by the time a daemon starts and leads after it: last
/// heard from at its lease's last renewal (when it renewed one), else when it was claimed.
/// `None` for a record whose address does not parse: it only goes into the timeline, and is
/// no reason to refuse to lead.
async fn lost_at_start(cfg: &Config, run: &RunStore, record: &LeaderRecord) -> Option<Takeover> {
    let lost = Leadership::of(record).ok()?;
    let lease = tokio::time::timeout(lease_interval(cfg) * 4, run.lease()).await;
    let renewed = match lease {
        Ok(Ok(Some(lease))) if lease.epoch == record.epoch => Some(lease.unix_ms),
        _ => None,
    };
    Some(Takeover {
        lost,
        last_heard_unix_ms: renewed.unwrap_or(record.created_unix_ms),
    })
}

/// Whether the lease of `epoch` (or a newer one) is renewed within three lease intervals.
/// A read that fails counts as renewed: a store that cannot say is no reason to take over.
async fn lease_renewed(cfg: &Config, run: &RunStore, epoch: u64) -> bool {
    let limit = lease_interval(cfg) * 4;
    let read = || async {
        match tokio::time::timeout(limit, run.lease()).await {
            Ok(Ok(lease)) => Ok(lease),
            _ => Err(()),
        }
    };
    let Ok(before) = read().await else {
        return true;
    };
    tokio::time::sleep(lease_interval(cfg) * 3).await;
    let Ok(after) = read().await else {
        return true;
    };
    match (before, after) {
        (Some(before), Some(after)) => after.epoch >= epoch && after != before,
        (None, Some(after)) => after.epoch >= epoch,
        (_, None) => false,
    }
}

/// What a successor knows of the leadership it took over.
#[derive(Debug)]
pub struct Takeover {
    pub lost: Leadership,
    /// When the lost leader was last heard from, Unix ms.
    pub last_heard_unix_ms: u64,
}

/// This daemon leads `epoch` from now: its books, its lease, its nodes told, and the
/// supervision of the world (adopted when a world runs).
pub async fn lead(daemon: &Arc<Daemon>, epoch: u64, began: Began) {
    let (after, took_over) = match began {
        Began::AtStart(after) => (after, false),
        Began::TookOver(takeover) => (Some(takeover), true),
    };
    let cfg = &daemon.cfg;
    // The store gets 2 s for each start-up read: a leader that waits on a hung store while
    // its lease stands still invites another takeover.
    let limit = Duration::from_secs(2);
    let durable = match tokio::time::timeout(limit, daemon.run.latest()).await {
        Ok(Ok(latest)) => latest,
        _ => None,
    };
    let newest = match durable {
        Some(step) => match tokio::time::timeout(limit, daemon.run.load_commit(step)).await {
            Ok(Ok(commit)) => Some(commit.created_unix_ms),
            _ => None,
        },
        None => None,
    };
    daemon
        .metrics
        .durable_commit_timestamp
        .set(newest.unwrap_or_else(now_unix_ms) as f64 / 1e3);
    let leader = Arc::new(Leader::new(
        cfg.clone(),
        daemon.run.clone(),
        daemon.metrics.clone(),
        durable,
        epoch,
    ));
    let succession = daemon.leadership.borrow().succession.clone();
    *daemon.leader.write().expect("not poisoned") = Some(leader.clone());
    daemon.metrics.leader.set(1);
    daemon.metrics.leader_epoch.set(epoch as i64);
    daemon
        .metrics
        .supervising
        .set(i64::from(cfg.supervision.is_some()));
    daemon.leadership.send_replace(Leadership {
        epoch,
        node: cfg.node.clone(),
        address: cfg.advertise,
        succession,
    });
    tracing::info!(epoch, node = %cfg.node, "leading");
    tokio::spawn(keep_lease(daemon.clone(), leader.clone()));
    if let Some(takeover) = after.as_ref().filter(|_| took_over) {
        daemon.metrics.takeovers.inc();
        // Every node the lost leader named links here now, without waiting for its own
        // timeout; the others find the record in the store.
        for successor in takeover
            .lost
            .succession
            .iter()
            .filter(|s| s.node != cfg.node)
        {
            let Ok(address) = successor.address.parse::<SocketAddr>() else {
                continue;
            };
            let (key, message) = (
                daemon.key.clone(),
                Message::NewLeader {
                    epoch,
                    node: cfg.node.clone(),
                    address: cfg.advertise.to_string(),
                },
            );
            tokio::spawn(async move {
                let _ = framing::request(&key, address, &message).await;
            });
        }
    }
    // The timeline names who leads after whom, and when the one before was last heard from
    // (`ckptctl events` times the succession from the two).
    if let Some(after) = &after {
        let events = tokio::time::timeout(limit, leader.stored_events())
            .await
            .unwrap_or_default();
        let generation = events.iter().map(|e| e.generation).max().unwrap_or(0);
        // A leader that ended the run's supervision itself (a preempted job requeued, say)
        // was not lost: its successor at start is a fresh start.
        let ended = events
            .last()
            .is_some_and(|e| ["completed", "preempted", "failed"].contains(&e.kind.as_str()));
        if took_over || !ended {
            record_succession(&leader, &cfg.node, generation, after, took_over).await;
        }
    }
    if let Some(plan) = cfg.supervision.clone() {
        tracing::info!(launcher = ?plan.launcher, active_nodes = plan.active_nodes, "supervising the training world");
        let (daemon, exit_when_done) = (daemon.clone(), plan.exit_when_done);
        tokio::spawn(async move {
            let ending =
                super::supervisor::supervise(daemon.clone(), leader.clone(), plan, took_over).await;
            if ending == super::supervisor::Ending::Deposed {
                return;
            }
            leader.announce_end(ending).await;
            if exit_when_done {
                let _ = daemon.done.send(ending).await;
            }
        });
    }
}

/// Records in the timeline who leads after whom (`elected`), and when the one before was last
/// heard from (`leader_lost`): `ckptctl events` times the succession from the two.
async fn record_succession(
    leader: &Leader,
    node: &str,
    generation: u32,
    after: &Takeover,
    took_over: bool,
) {
    let epoch = leader.epoch();
    leader
        .record_at(
            after.last_heard_unix_ms,
            generation,
            "leader_lost",
            format!(
                "{} (epoch {}) was last heard from at this time",
                if after.lost.node.is_empty() {
                    after.lost.address.to_string()
                } else {
                    after.lost.node.clone()
                },
                after.lost.epoch
            ),
        )
        .await;
    leader
        .record(
            generation,
            "elected",
            format!(
                "{} leads epoch {epoch}{}, {:.2} s after the lost leader was last heard from",
                node,
                if took_over { "" } else { " from its start" },
                now_unix_ms().saturating_sub(after.last_heard_unix_ms) as f64 / 1e3
            ),
        )
        .await;
}

/// The leader's lease: renewed every interval while most nodes are heard from; and the look
/// for a newer epoch, which ends this leadership.
async fn keep_lease(daemon: Arc<Daemon>, leader: Arc<Leader>) {
    let interval = lease_interval(&daemon.cfg);
    let limit = interval * 4;
    let epoch = leader.epoch();
    let mut renewal = 0;
    loop {
        tokio::time::sleep(interval).await;
        if leader.deposed() {
            step_down(&daemon, &leader, None).await;
            return;
        }
        match tokio::time::timeout(limit, daemon.run.leadership_at(epoch + 1)).await {
            Ok(Ok(Some(newer))) => {
                step_down(&daemon, &leader, Some(newer)).await;
                return;
            }
            Ok(Ok(None)) => {}
            // The store cannot say whether a newer epoch exists: renewing now could write
            // over a successor's lease.
            _ => continue,
        }
        if leader.has_quorum().await {
            renewal += 1;
            let lease = LeaseRecord {
                epoch,
                node: daemon.cfg.node.clone(),
                renewal,
                unix_ms: now_unix_ms(),
            };
            if let Ok(Err(error)) =
                tokio::time::timeout(limit, daemon.run.renew_lease(&lease)).await
            {
                tracing::warn!(%error, "cannot renew the leader's lease");
            }
        }
        leader.publish_succession().await;
    }
}

/// This daemon no longer leads: it stops acting, and follows the newer leader.
pub async fn step_down(daemon: &Arc<Daemon>, leader: &Arc<Leader>, newer: Option<LeaderRecord>) {
    leader.depose();
    {
        let mut slot = daemon.leader.write().expect("not poisoned");
        if slot.as_ref().is_some_and(|l| Arc::ptr_eq(l, leader)) {
            *slot = None;
        }
    }
    daemon.metrics.leader.set(0);
    daemon.metrics.supervising.set(0);
    let newer = match newer {
        Some(record) => Some(record),
        None => daemon.run.leadership().await.ok().flatten(),
    };
    let said = newer.as_ref().map_or("a newer epoch".to_string(), |r| {
        format!("epoch {} ({})", r.epoch, r.node)
    });
    tracing::warn!(epoch = leader.epoch(), newer = %said, "deposed: this daemon stops leading and follows");
    leader
        .record(
            0,
            "deposed",
            format!(
                "{} (epoch {}) learned of {said} and stopped acting; its world, if any, is left to the new leader",
                daemon.cfg.node,
                leader.epoch()
            ),
        )
        .await;
    if let Some(record) = newer.filter(|r| r.epoch > leader.epoch()) {
        follow_record(daemon, &record);
    }
}

/// Follows `leadership` when it is newer than what this daemon knows (keeping the order of
/// succession it last heard).
pub fn follow(daemon: &Daemon, leadership: Leadership) {
    daemon.leadership.send_if_modified(|current| {
        if leadership.epoch <= current.epoch {
            return false;
        }
        tracing::info!(leader = %leadership.node, epoch = leadership.epoch, address = %leadership.address, "following a new leader");
        daemon.metrics.leader_epoch.set(leadership.epoch as i64);
        let succession = std::mem::take(&mut current.succession);
        *current = Leadership {
            succession,
            ..leadership
        };
        true
    });
}

/// [`follow`] the leadership of a store record.
pub fn follow_record(daemon: &Daemon, record: &LeaderRecord) {
    if let Ok(leadership) = Leadership::of(record) {
        follow(daemon, leadership);
    }
}

/// Watches the link to the leader on a daemon that does not lead: when the leader has been
/// silent for the heartbeat timeout, looks for a newer leadership in the store (at most once
/// a second), and a candidate takes over (`take_over`).
pub async fn watch(daemon: Arc<Daemon>) {
    let timeout = Duration::from_secs_f64(daemon.cfg.heartbeat_timeout_seconds);
    let mut looked = Instant::now();
    loop {
        tokio::time::sleep(Duration::from_millis(100)).await;
        if daemon.leader().is_some() || daemon.silent_for() < timeout {
            continue;
        }
        if looked.elapsed() >= Duration::from_secs(1) {
            looked = Instant::now();
            let known = daemon.leadership.borrow().epoch;
            if let Ok(Some(record)) = daemon.run.leadership().await {
                if record.epoch > known {
                    follow_record(&daemon, &record);
                    continue;
                }
            }
        }
        if daemon.cfg.candidate && !daemon.run_ended.load(std::sync::atomic::Ordering::SeqCst) {
            take_over(&daemon, timeout).await;
        }
    }
}

/// A candidate's attempt: wait its place in the succession, then claim the next epoch unless
/// someone else did, the leader came back, or the leader's lease still moves.
async fn take_over(daemon: &Arc<Daemon>, timeout: Duration) {
    let lost = daemon.leadership.borrow().clone();
    let back = |daemon: &Daemon| {
        daemon.silent_for() < timeout || daemon.leadership.borrow().epoch > lost.epoch
    };
    let place = lost
        .succession
        .iter()
        .position(|s| s.node == daemon.cfg.node)
        .unwrap_or(lost.succession.len());
    let until = Instant::now() + STAGGER * place as u32;
    while Instant::now() < until {
        tokio::time::sleep(Duration::from_millis(100)).await;
        if back(daemon) {
            return;
        }
    }
    let newest = match daemon.run.leadership().await {
        Ok(newest) => newest,
        Err(error) => {
            tracing::warn!(%error, "the leader is silent, but the store cannot say who leads: not taking over");
            return;
        }
    };
    if let Some(record) = newest.as_ref().filter(|r| r.epoch > lost.epoch) {
        follow_record(daemon, record);
        return;
    }
    if lease_renewed(&daemon.cfg, &daemon.run, lost.epoch.max(1)).await {
        tracing::warn!(leader = %lost.node, epoch = lost.epoch, "cut off from the leader, which still renews its lease (its other nodes reach it): not taking over");
        daemon.heard_from_leader();
        return;
    }
    if back(daemon) {
        return;
    }
    let last_heard_unix_ms = now_unix_ms().saturating_sub(daemon.silent_for().as_millis() as u64);
    let epoch = newest.map_or(lost.epoch, |r| r.epoch.max(lost.epoch)) + 1;
    let node = &daemon.cfg.node;
    match daemon
        .run
        .claim_leadership(epoch, node, &daemon.cfg.advertise.to_string())
        .await
    {
        Ok(true) => {
            tracing::warn!(lost = %lost.node, epoch, "the leader is lost: this daemon takes over");
            lead(
                daemon,
                epoch,
                Began::TookOver(Takeover {
                    lost,
                    last_heard_unix_ms,
                }),
            )
            .await;
        }
        Ok(false) => {
            if let Ok(Some(record)) = daemon.run.leadership_at(epoch).await {
                follow_record(daemon, &record);
            }
        }
        Err(error) => tracing::warn!(%error, epoch, "cannot claim the leadership"),
    }
}
