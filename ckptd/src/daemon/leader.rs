//! The leader's bookkeeping: memory commits, durable decisions, commit records, the job's
//! status.
//!
//! Each node keeps one authenticated TCP connection to the leader (the leader too, to
//! itself; the node's side is [`super::uplink`]). Over it the node reports ranks, replicated
//! snapshots and stored shards; the leader pushes memory commits back. A leader that
//! restarts rebuilds what it needs from the nodes' hellos: each node lists the T0 step of
//! each of its ranks, and re-sends what is pending.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use lazarus_shared::store::{RestoreChoice, RunStore};
use lazarus_shared::wire::{
    self, ClusterStatus, Message, NodeStatus, RankStatus, ReplicaEntry, RunStatus, Successor,
    T0Entry, UploadReport,
};
use lazarus_shared::{Rank, RunId, StepKey};
use tokio::net::TcpStream;
use tokio::sync::{mpsc, Mutex};

use super::metrics::Metrics;
use super::{Config, Daemon};

#[derive(Debug)]
struct RankInfo {
    node: String,
    pid: u32,
    step: u64,
    /// When the rank last talked to its daemon.
    seen: Instant,
    /// When `step` last changed (or the rank registered).
    progressed: Instant,
    alive: bool,
    /// It said `Bye`: finished, not failed.
    done: bool,
    /// Its own compute per step, as last reported (0: not yet).
    compute_us: u64,
    /// Its process state when neither running nor sleeping (`wire::RankBeat`).
    process_state: Option<char>,
    /// Where its restore came from, once its node said.
    restored_from: Option<wire::Tier>,
    /// Since when it has been slower than the median by more than the margin.
    slow_since: Option<Instant>,
    straggler: bool,
    /// Its health check failed.
    unhealthy: Option<wire::BadStep>,
}

#[derive(Debug)]
struct NodeInfo {
    address: String,
    buddy: Option<String>,
    socket: String,
    seen: Instant,
    connected: bool,
    /// It may take over leadership.
    candidate: bool,
    /// Which of the node's connections this is: an older one that ends later must not mark
    /// the node disconnected.
    session: u64,
    /// The node's daemon state (`NodeHello::instance`).
    instance: u64,
    /// This leader's count of its rollbacks when it first heard from that state: one that
    /// began after a rollback never held the snapshots it abandoned.
    rollbacks_before: u64,
    t0: Vec<T0Entry>,
    sender: mpsc::UnboundedSender<Message>,
}

/// What the supervisor sees of a rank.
#[derive(Clone, Debug)]
pub struct RankView {
    pub rank: Rank,
    pub node: String,
    pub pid: u32,
    pub step: u64,
    pub alive: bool,
    pub done: bool,
    pub seen_ago: Duration,
    pub progressed_ago: Duration,
    /// Its process state when neither running nor sleeping (`wire::RankBeat`).
    pub process_state: Option<char>,
    /// Where its restore came from, once its node said.
    pub restored_from: Option<wire::Tier>,
}

/// What the supervisor checks of the ranks on every tick, counted without copying them (a
/// world of 32,768 ranks, 20 times a second).
#[derive(Clone, Copy, Debug, Default)]
pub struct RanksSummary {
    pub count: usize,
    pub alive: usize,
    pub done: usize,
    /// The lowest step of any rank (0 when there are none).
    pub min_step: u64,
    /// The highest: where a world that failed had got to (its ranks move in lockstep, and a
    /// dead rank's last step comes with its death, so the highest is the freshest).
    pub max_step: u64,
    /// How long ago the rank that progressed last did (zero when there are none).
    pub progressed_ago_min: Duration,
    /// A rank whose health check failed (the lowest, when several did).
    pub unhealthy: Option<Rank>,
}

/// What the supervisor sees of a node.
#[derive(Clone, Debug)]
pub struct NodeView {
    pub node: String,
    pub socket: String,
    pub connected: bool,
    pub seen_ago: Duration,
}

/// A rank whose connection to its daemon ended.
#[derive(Clone, Debug)]
pub struct RankDown {
    pub rank: Rank,
    pub node: String,
    pub pid: u32,
    /// When it exited (or its connection ended), by its node's clock, in microseconds.
    pub unix_us: u64,
}

/// The ranks' reports of one step, until every rank's is in.
#[derive(Debug, Default)]
struct Reports {
    ranks: BTreeSet<Rank>,
    /// A rank asked for the step to be durable (the run's last step, or a supervisor's
    /// order).
    durable_requested: bool,
    /// A rank's daemon could not have started an upload of the step at once.
    upload_busy: bool,
    /// When the last report from a rank's daemon came; `None` while only a hello's evidence
    /// counted it.
    reported_at: Option<Instant>,
}

impl Reports {
    /// Whether a rank's daemon reported the step (a hello's evidence is not a report).
    fn live(&self) -> bool {
        self.reported_at.is_some()
    }

    /// Whether a node may still hold a snapshot of the step waiting for its commit: a daemon
    /// drops one after `timeout` (the daemons' `commit_timeout_seconds`), counted from before
    /// its report came here.
    fn held(&self, timeout: Duration) -> bool {
        self.reported_at.is_some_and(|at| at.elapsed() < timeout)
    }
}

#[derive(Debug)]
struct State {
    world_size: u32,
    ranks: HashMap<Rank, RankInfo>,
    replicated: BTreeMap<u64, Reports>,
    memory_step: Option<u64>,
    memory_at: HashMap<u64, Instant>,
    stored: BTreeMap<StepKey, BTreeSet<Rank>>,
    last_durable: Instant,
    /// The newest memory-committed step that was made durable (asked to be uploaded).
    last_durable_step: Option<u64>,
    nodes: BTreeMap<String, NodeInfo>,
    downs: Vec<RankDown>,
    /// The step the last `WhichStep` answer pointed at (the supervisor's restore step):
    /// `None` until a rank of this world asked, `Some(None)` for a fresh start.
    chosen: Option<Option<u64>>,
    /// Per rank, the daemon that received its newest replica (its node's buddy then).
    replica_holder: HashMap<Rank, String>,
    /// Per rank, the newest replica step a node's hello listed, and that node's address.
    replica_steps: HashMap<Rank, (u64, String)>,
    /// (generation, active, drained) while supervising.
    supervision: Option<(u32, Vec<String>, Vec<String>)>,
    /// Who takes over, in order, and whether the nodes were told since it changed.
    succession: Vec<Successor>,
    succession_told: bool,
    /// Node connections so far (each node's newest one is the one that counts).
    sessions: u64,
    /// When the ranks were last compared for stragglers (a pass over all of them, so not
    /// on every one of thousands of heartbeats a second).
    stragglers_checked: Option<Instant>,
    /// The step each of this leader's rollbacks went back to (`None`: a fresh start), in
    /// order: their count is its `RolledBack::seq` ([`wire::RollbackMark`]), and a daemon
    /// that missed some is told to forget everything after the earliest.
    rolled_back_tos: Vec<Option<u64>>,
    /// The data a world that restores the step rolled back to skips after it.
    skip: Option<wire::DataSkip>,
    /// The run's loss at each recent step, from the ranks' heartbeats: the step after a
    /// restore must repeat it.
    losses: BTreeMap<u64, f64>,
}

/// Steps whose loss the leader keeps.
const LOSSES_KEPT: usize = 4096;

fn nodes_of(state: &State) -> Vec<NodeView> {
    state
        .nodes
        .iter()
        .map(|(name, info)| NodeView {
            node: name.clone(),
            socket: info.socket.clone(),
            connected: info.connected,
            seen_ago: info.seen.elapsed(),
        })
        .collect()
}

impl State {
    /// How many times this leader rolled the run back.
    fn rollbacks(&self) -> u64 {
        self.rolled_back_tos.len() as u64
    }

    /// The step the supervisor last rolled the run back to (0: a fresh start). An upload of
    /// a later step that ends before the new world memory-commits that step again is the
    /// abandoned trajectory's, and is not committed.
    fn rolled_back_to(&self) -> Option<u64> {
        self.rolled_back_tos.last().map(|to| to.unwrap_or(0))
    }

    /// Connected nodes neither active nor drained while supervising.
    fn spares(&self) -> Vec<&String> {
        let Some((_, active, drained)) = &self.supervision else {
            return Vec::new();
        };
        let taken: HashSet<&String> = active.iter().chain(drained).collect();
        self.nodes
            .iter()
            .filter(|(name, info)| info.connected && !taken.contains(name))
            .map(|(name, _)| name)
            .collect()
    }
}

/// How often the leader compares the ranks' compute times for stragglers.
const STRAGGLER_CHECK: Duration = Duration::from_millis(500);

/// Most successors a leader names: enough for several losses in a row, and a `Leading`
/// frame stays small however many nodes the job has.
const SUCCESSORS_MAX: usize = 16;

#[derive(Debug)]
pub struct Leader {
    cfg: Config,
    run: RunStore,
    metrics: Arc<Metrics>,
    state: Mutex<State>,
    events: Mutex<(Vec<wire::Event>, u64)>,
    /// Events recorded but not yet in the store.
    events_unstored: Arc<std::sync::atomic::AtomicUsize>,
    /// The newest durable step this leader knows of: the store's last answer, or a commit
    /// this leader made since.
    durable: Arc<std::sync::Mutex<Option<StepKey>>>,
    /// Raised by SIGUSR1 (Slurm's warning before the time limit, or an operator).
    preempt: std::sync::atomic::AtomicBool,
    /// The leadership epoch this leader holds.
    epoch: u64,
    /// Set once a newer epoch is known: from then on this leader does nothing.
    deposed: std::sync::atomic::AtomicBool,
}

/// The buddy of `active[i]` in the world's ring: the next node's address (none in a world
/// of one node, or while the next node is unknown).
fn ring_buddy(state: &State, active: &[String], i: usize) -> Option<String> {
    if active.len() < 2 {
        return None;
    }
    let next = &active[(i + 1) % active.len()];
    state.nodes.get(next).map(|n| n.address.clone())
}

impl Leader {
    /// `durable`: the store's newest durable step when the daemon started.
    pub fn new(
        cfg: Config,
        run: RunStore,
        metrics: Arc<Metrics>,
        durable: Option<StepKey>,
        epoch: u64,
    ) -> Self {
        Self {
            cfg,
            run,
            metrics,
            state: Mutex::new(State {
                world_size: 0,
                ranks: HashMap::new(),
                replicated: BTreeMap::new(),
                memory_step: None,
                memory_at: HashMap::new(),
                stored: BTreeMap::new(),
                last_durable: Instant::now(),
                last_durable_step: None,
                nodes: BTreeMap::new(),
                downs: Vec::new(),
                chosen: None,
                replica_holder: HashMap::new(),
                replica_steps: HashMap::new(),
                supervision: None,
                succession: Vec::new(),
                succession_told: true,
                sessions: 0,
                stragglers_checked: None,
                rolled_back_tos: Vec::new(),
                skip: None,
                losses: BTreeMap::new(),
            }),
            events: Mutex::new((Vec::new(), 0)),
            events_unstored: Arc::default(),
            durable: Arc::new(std::sync::Mutex::new(durable)),
            preempt: std::sync::atomic::AtomicBool::new(false),
            epoch,
            deposed: std::sync::atomic::AtomicBool::new(false),
        }
    }

    /// This leader's own node.
    pub fn node(&self) -> &str {
        &self.cfg.node
    }

    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// From now on this leader does nothing: a newer epoch leads.
    pub fn depose(&self) {
        self.deposed
            .store(true, std::sync::atomic::Ordering::SeqCst);
    }

    pub fn deposed(&self) -> bool {
        self.deposed.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Whether most of the nodes this leader counts (connected or in the world, drained ones
    /// aside) were heard from within half the heartbeat timeout. With none known yet (a leader that just started),
    /// yes. Half: nodes cut off together fall silent a heartbeat period apart, and the
    /// first of them declared lost must not find the others still counted.
    pub async fn has_quorum(&self) -> bool {
        let timeout = Duration::from_secs_f64(self.cfg.heartbeat_timeout_seconds / 2.0);
        let state = self.state.lock().await;
        let (active, drained): (&[String], &[String]) = state
            .supervision
            .as_ref()
            .map_or((&[], &[]), |(_, active, drained)| {
                (active.as_slice(), drained.as_slice())
            });
        // The members: every connected node, and every node of the world that is not
        // drained. A lost node that a spare replaced no longer counts against the quorum; a
        // drained node whose daemon is connected counts like any other: hearing it says which
        // side of a cut the leader is on, whether or not the node may train.
        let nodes: Vec<&NodeInfo> = state
            .nodes
            .iter()
            .filter(|(name, info)| {
                info.connected || (active.contains(name) && !drained.contains(name))
            })
            .map(|(_, info)| info)
            .collect();
        let heard = nodes
            .iter()
            .filter(|n| n.connected && n.seen.elapsed() < timeout)
            .count();
        nodes.is_empty() || heard * 2 > nodes.len()
    }

    /// Recomputes the order of succession: the connected candidates other than this leader,
    /// by node name, starting after this leader's name and wrapping around.
    fn order_succession(&self, state: &mut State) {
        let me = &self.cfg.node;
        let mut candidates: Vec<Successor> = state
            .nodes
            .iter()
            .filter(|(name, info)| info.connected && info.candidate && *name != me)
            .map(|(name, info)| Successor {
                node: name.clone(),
                address: info.address.clone(),
            })
            .collect();
        // BTreeMap order is by name; rotate to start after this leader.
        let split = candidates.partition_point(|s| s.node < *me);
        candidates.rotate_left(split);
        candidates.truncate(SUCCESSORS_MAX);
        if candidates != state.succession {
            state.succession = candidates;
            state.succession_told = false;
        }
    }

    /// The node the supervised world put `rank` on (ranks are numbered node by node), while
    /// supervising.
    fn placed_on<'a>(&self, state: &'a State, rank: Rank) -> Option<&'a str> {
        let per_node = self.cfg.supervision.as_ref()?.ranks_per_node.max(1);
        let (_, active, _) = state.supervision.as_ref()?;
        active.get(rank as usize / per_node).map(String::as_str)
    }

    /// Whether the store says, within 1 s, that a newer epoch exists, which deposes this
    /// leader. `false` when it says none does, or cannot say: a leader that hears from most
    /// of its nodes acts on a lost one as it would without the store.
    pub async fn superseded(&self) -> bool {
        self.newer_epoch(Duration::from_secs(1)).await == Some(true)
    }

    /// Whether the store says, within 2 s, that no newer epoch exists (a leader about to act
    /// without hearing from most of its nodes asks first; a newer one deposes it). `false`
    /// when the store cannot say.
    pub async fn still_leads(&self) -> bool {
        self.newer_epoch(Duration::from_secs(2)).await == Some(false)
    }

    /// What the store says within `limit` of an epoch newer than this leader's: `Some(true)`
    /// one exists (and deposes this leader), `Some(false)` none does, `None` it cannot say.
    async fn newer_epoch(&self, limit: Duration) -> Option<bool> {
        match tokio::time::timeout(limit, self.run.leadership_at(self.epoch + 1)).await {
            Ok(Ok(None)) => Some(false),
            Ok(Ok(Some(_))) => {
                self.depose();
                Some(true)
            }
            _ => None,
        }
    }

    /// Whether another daemon could take over (the order of succession names one).
    pub async fn has_successors(&self) -> bool {
        !self.state.lock().await.succession.is_empty()
    }

    /// How many of this leader's rollbacks a daemon has dealt with: those its mark names,
    /// and all those before this leader first heard from its process (`rollbacks_before`),
    /// since a daemon started after a rollback holds nothing it abandoned and has no mark.
    fn applied_rollbacks(&self, rollbacks_before: u64, mark: wire::RollbackMark) -> u64 {
        let applied = if mark.epoch == self.epoch {
            mark.seq
        } else {
            0
        };
        applied.max(rollbacks_before)
    }

    /// What a node's hello tells of the rollbacks its daemon dealt with (its
    /// `rollbacks_before`), the first frame to send it (`Leading`), and, when it missed some
    /// of this leader's rollbacks (cut off, or restarted before it forgot), a `RolledBack` to
    /// send after that: back to the earliest step any of them went to, with this leader's
    /// count. It forgets the abandoned snapshots then, and takes this leader's mark from it,
    /// not from the first frame; its reports sent before carry the mark from before, and are
    /// ignored.
    fn greeting(
        &self,
        state: &State,
        node: &str,
        instance: u64,
        mark: wire::RollbackMark,
    ) -> (u64, Message, Option<Message>) {
        let rollbacks_before = match state.nodes.get(node) {
            Some(known) if instance != 0 && known.instance == instance => known.rollbacks_before,
            _ => state.rollbacks(),
        };
        let applied = self.applied_rollbacks(rollbacks_before, mark);
        let missed = (applied < state.rollbacks()).then(|| Message::RolledBack {
            run: self.cfg.run.clone(),
            // The earliest of the missed rollbacks' steps (a fresh start is the earliest).
            to: state.rolled_back_tos[applied as usize..]
                .iter()
                .copied()
                .min()
                .flatten(),
            epoch: self.epoch,
            seq: state.rollbacks(),
        });
        let mut first = self.leading(state);
        if let (Some(_), Message::Leading { rollback, .. }) = (&missed, &mut first) {
            *rollback = None;
        }
        (rollbacks_before, first, missed)
    }

    fn leading(&self, state: &State) -> Message {
        Message::Leading {
            epoch: self.epoch,
            node: self.cfg.node.clone(),
            succession: state.succession.clone(),
            rollback: Some(wire::RollbackMark {
                epoch: self.epoch,
                seq: state.rollbacks(),
            }),
        }
    }

    /// Tells every node the order of succession when it changed (at most once per lease
    /// interval, so that thousands of hellos cost one push each, not one per hello).
    pub async fn publish_succession(&self) {
        let mut state = self.state.lock().await;
        if state.succession_told || self.deposed() {
            return;
        }
        state.succession_told = true;
        let leading = self.leading(&state);
        for node in state.nodes.values().filter(|n| n.connected) {
            let _ = node.sender.send(leading.clone());
        }
    }

    /// Records one event of the timeline: in memory and in the log now, and in the store in
    /// the background, so that a slow or hung store never holds up supervision.
    pub async fn record(&self, generation: u32, kind: &str, detail: String) -> wire::Event {
        self.record_event(
            lazarus_shared::store::now_unix_ms(),
            generation,
            kind,
            detail,
            Vec::new(),
        )
        .await
    }

    /// [`Leader::record`] of an event that happened at `unix_ms`, before it was recorded.
    pub async fn record_at(
        &self,
        unix_ms: u64,
        generation: u32,
        kind: &str,
        detail: String,
    ) -> wire::Event {
        self.record_event(unix_ms, generation, kind, detail, Vec::new())
            .await
    }

    /// [`Leader::record`] of an event that starts or adopts a world on `nodes` (in rank
    /// order), which a successor reads back to keep every rank on its node.
    pub async fn record_world(
        &self,
        generation: u32,
        kind: &str,
        detail: String,
        nodes: &[String],
    ) -> wire::Event {
        self.record_event(
            lazarus_shared::store::now_unix_ms(),
            generation,
            kind,
            detail,
            nodes.to_vec(),
        )
        .await
    }

    async fn record_event(
        &self,
        unix_ms: u64,
        generation: u32,
        kind: &str,
        detail: String,
        nodes: Vec<String>,
    ) -> wire::Event {
        let event = wire::Event {
            unix_ms,
            kind: kind.to_string(),
            detail,
            generation,
            nodes,
            epoch: self.epoch,
        };
        tracing::info!(generation, kind, detail = %event.detail, "event");
        let sequence = {
            let mut events = self.events.lock().await;
            events.0.push(event.clone());
            events.1 += 1;
            events.1
        };
        let (run, metrics, unstored) = (
            self.run.clone(),
            self.metrics.clone(),
            self.events_unstored.clone(),
        );
        let stored = event.clone();
        unstored.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        tokio::spawn(async move {
            if let Err(error) = run.put_event(&stored, sequence).await {
                metrics.error("event");
                tracing::warn!(%error, "cannot store the event");
            }
            unstored.fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
        });
        event
    }

    /// Events recorded but not yet written to the store (the daemon waits for them before
    /// it exits).
    pub fn events_unstored(&self) -> usize {
        self.events_unstored
            .load(std::sync::atomic::Ordering::SeqCst)
    }

    /// The newest durable step: the store's answer when it comes within 2 s, else the newest
    /// this leader knows of, so that a hung store does not hold up a restore from memory.
    pub async fn durable_step(&self) -> Option<StepKey> {
        let known = || *self.durable.lock().unwrap_or_else(|e| e.into_inner());
        match tokio::time::timeout(Duration::from_secs(2), self.run.latest()).await {
            Ok(Ok(latest)) => {
                *self.durable.lock().unwrap_or_else(|e| e.into_inner()) = latest;
                latest
            }
            Ok(Err(error)) => {
                tracing::warn!(%error, known = ?known(), "cannot read the newest durable step; using the newest this leader knows");
                known()
            }
            Err(_) => {
                tracing::warn!(known = ?known(), "the store did not answer within 2 s; using the newest durable step this leader knows");
                known()
            }
        }
    }

    pub async fn events(&self) -> Vec<wire::Event> {
        self.events.lock().await.0.clone()
    }

    /// The run's timeline as stored, for a leader that starts after an earlier one.
    pub async fn stored_events(&self) -> Vec<wire::Event> {
        self.run.events().await.unwrap_or_else(|error| {
            tracing::warn!(%error, "cannot read the run's earlier events");
            Vec::new()
        })
    }

    pub fn request_preemption(&self) {
        self.preempt
            .store(true, std::sync::atomic::Ordering::SeqCst);
    }

    pub fn preempting(&self) -> bool {
        self.preempt.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// The newest memory-committed step, and the newest durable one in the store.
    pub async fn steps(&self) -> (Option<u64>, Option<u64>) {
        let memory = self.state.lock().await.memory_step;
        let durable = self.durable_step().await.map(|k| k.step);
        (memory, durable)
    }

    /// Asks every node to upload its T0 of `step` (when it is not durable yet).
    pub async fn make_durable(&self, step: u64) {
        self.push_all(Message::MakeDurable {
            run: self.cfg.run.clone(),
            step,
            epoch: self.epoch,
        })
        .await;
    }

    /// Makes `step` durable for a world that lost `lost` ranks with their node: the
    /// surviving nodes upload their T0, and each lost rank's replica holder its T1. Says
    /// which ranks had no known replica holder.
    pub async fn make_durable_without(&self, step: u64, lost: &[Rank]) -> Vec<Rank> {
        self.make_durable(step).await;
        let state = self.state.lock().await;
        let mut missing = Vec::new();
        for rank in lost {
            let holder = state.replica_holder.get(rank).and_then(|address| {
                state
                    .nodes
                    .values()
                    .find(|n| n.connected && n.address == *address)
            });
            match holder {
                Some(node) => {
                    if !self.deposed() {
                        let _ = node.sender.send(Message::UploadReplica {
                            run: self.cfg.run.clone(),
                            rank: *rank,
                            step,
                            epoch: self.epoch,
                        });
                    }
                }
                None => missing.push(*rank),
            }
        }
        missing
    }

    /// The world size the ranks registered with (0 before any did).
    pub async fn world_size(&self) -> u32 {
        self.state.lock().await.world_size
    }

    /// The ranks and nodes as the leader sees them now.
    pub async fn view(&self) -> (Vec<RankView>, Vec<NodeView>) {
        let state = self.state.lock().await;
        let mut ranks: Vec<RankView> = state
            .ranks
            .iter()
            .map(|(rank, info)| RankView {
                rank: *rank,
                node: info.node.clone(),
                pid: info.pid,
                step: info.step,
                alive: info.alive,
                done: info.done,
                seen_ago: info.seen.elapsed(),
                progressed_ago: info.progressed.elapsed(),
                process_state: info.process_state,
                restored_from: info.restored_from,
            })
            .collect();
        ranks.sort_by_key(|r| r.rank);
        (ranks, nodes_of(&state))
    }

    pub async fn nodes(&self) -> Vec<NodeView> {
        nodes_of(&*self.state.lock().await)
    }

    pub async fn ranks_summary(&self) -> RanksSummary {
        let state = self.state.lock().await;
        let mut summary = RanksSummary {
            count: state.ranks.len(),
            ..RanksSummary::default()
        };
        let mut min_step = None;
        let mut progressed = None;
        for (rank, info) in &state.ranks {
            if info.unhealthy.is_some() && summary.unhealthy.is_none_or(|r| *rank < r) {
                summary.unhealthy = Some(*rank);
            }
            summary.alive += usize::from(info.alive);
            summary.done += usize::from(info.done);
            min_step = Some(min_step.map_or(info.step, |m: u64| m.min(info.step)));
            summary.max_step = summary.max_step.max(info.step);
            progressed = progressed.max(Some(info.progressed));
        }
        summary.min_step = min_step.unwrap_or(0);
        summary.progressed_ago_min = progressed.map_or(Duration::ZERO, |at| at.elapsed());
        summary
    }

    pub async fn set_supervision(&self, generation: u32, active: &[String], drained: &[String]) {
        self.state.lock().await.supervision = Some((generation, active.to_vec(), drained.to_vec()));
        self.metrics.nodes_drained.set(drained.len() as i64);
        self.count_spares().await;
    }

    /// Sets the spare-node gauge: connected nodes neither active nor drained.
    pub async fn count_spares(&self) {
        let state = self.state.lock().await;
        if state.supervision.is_some() {
            self.metrics.spare_nodes.set(state.spares().len() as i64);
        }
    }

    pub fn count_fault(&self) {
        self.metrics.faults.inc();
    }

    /// Pairs the active nodes in a ring: each replicates to the next.
    pub async fn pair(&self, active: &[String]) {
        let mut state = self.state.lock().await;
        for (i, name) in active.iter().enumerate() {
            let buddy = ring_buddy(&state, active, i);
            if let Some(info) = state.nodes.get_mut(name) {
                info.buddy = buddy.clone();
                if !self.deposed() {
                    let _ = info.sender.send(Message::SetBuddy {
                        address: buddy,
                        epoch: self.epoch,
                    });
                }
            }
        }
    }

    /// A node of the supervised world that says hello again (its daemon restarted) names the
    /// buddy of its own configuration, or none: it is told the one the world's ring gives it,
    /// or it would replicate to a node outside the world, and stop replicating when that one
    /// is lost, which keeps every later step from being committed.
    fn pair_again(&self, state: &mut State, node: &str) {
        let Some((_, active, _)) = &state.supervision else {
            return;
        };
        let Some(i) = active.iter().position(|n| n == node) else {
            return;
        };
        let buddy = ring_buddy(state, active, i);
        let Some(info) = state.nodes.get_mut(node) else {
            return;
        };
        if info.buddy == buddy || self.deposed() {
            return;
        }
        tracing::info!(%node, said = ?info.buddy, ?buddy, "pairing a node that came back with another buddy");
        info.buddy = buddy.clone();
        let _ = info.sender.send(Message::SetBuddy {
            address: buddy,
            epoch: self.epoch,
        });
    }

    /// Asks every connected node to SIGKILL its ranks.
    pub async fn kill_all_ranks(&self) {
        self.push_all(Message::KillRanks {
            run: self.cfg.run.clone(),
            epoch: self.epoch,
        })
        .await;
    }

    /// Asks every connected node to SIGTERM its ranks: they checkpoint and exit.
    pub async fn stop_all_ranks(&self) {
        self.push_all(Message::StopRanks {
            run: self.cfg.run.clone(),
            epoch: self.epoch,
        })
        .await;
    }

    /// Tells every connected node that supervision is over, and gives the links a moment to
    /// carry it before this daemon exits.
    pub async fn announce_end(&self, ending: super::supervisor::Ending) {
        self.push_all(Message::RunEnded {
            run: self.cfg.run.clone(),
            preempted: ending == super::supervisor::Ending::Preempted,
            failed: ending == super::supervisor::Ending::Failed,
            epoch: self.epoch,
        })
        .await;
        tokio::time::sleep(Duration::from_millis(300)).await;
    }

    async fn push_all(&self, message: Message) {
        let state = self.state.lock().await;
        self.push_all_locked(&state, message);
    }

    /// [`Leader::push_all`] under the state the caller holds.
    fn push_all_locked(&self, state: &State, message: Message) {
        if self.deposed() {
            return;
        }
        for node in state.nodes.values().filter(|n| n.connected) {
            let _ = node.sender.send(message.clone());
        }
    }

    /// Rolls the run back to its newest durable step older than `before`, or to a fresh
    /// start when it has no durable step at all, for a world that keeps failing from a newer
    /// one. The store hides the later steps (a new timeline) when there are any, this leader
    /// forgets its memory commits, and every node forgets its snapshots and replicas of later
    /// steps. Answers the step rolled back to (`None`: a fresh start); an error when every
    /// durable step is `before` or newer, or the store cannot say.
    pub async fn roll_back(&self, before: u64, reason: &str) -> Result<Option<StepKey>> {
        let visible: Vec<StepKey> = match self.run.catalog().await {
            Ok(catalog) => catalog.visible_commits().map(|s| s.step).collect(),
            Err(lazarus_shared::StoreError::NoSuchRun { .. }) => Vec::new(),
            Err(error) => return Err(error).context("reading the run's committed steps"),
        };
        let to = visible.iter().filter(|s| s.step < before).max().copied();
        if to.is_none() && !visible.is_empty() {
            bail!(
                "the run has no durable step older than step {before} to roll back to (its oldest is {})",
                visible.iter().min().expect("not empty")
            );
        }
        if let Some(to) = to.filter(|_| visible.iter().any(|s| s.step >= before)) {
            self.run
                .rollback(
                    to,
                    reason,
                    &format!("the supervisor (leader epoch {})", self.epoch),
                )
                .await
                .with_context(|| format!("rolling the run back to step {to}"))?;
        }
        {
            let mut state = self.state.lock().await;
            state.memory_step = None;
            state.replicated.clear();
            state.stored.clear();
            state.memory_at.clear();
            state.replica_holder.clear();
            state.replica_steps.clear();
            state.last_durable_step = to.map(|k| k.step);
            state.rolled_back_tos.push(to.map(|k| k.step));
            let rolled_back = Message::RolledBack {
                run: self.cfg.run.clone(),
                to: to.map(|k| k.step),
                epoch: self.epoch,
                seq: state.rollbacks(),
            };
            // Under the state, as every `Leading` is queued: no node is told this leader's
            // new mark before it is told to forget what the rollback abandoned.
            self.push_all_locked(&state, rolled_back);
        }
        *self.durable.lock().unwrap_or_else(|e| e.into_inner()) = to;
        self.metrics.memory_step.set(0);
        self.metrics.rollbacks.inc();
        Ok(to)
    }

    /// The health verdict of `rank`, when it failed.
    pub async fn unhealthy(&self, rank: Rank) -> Option<wire::BadStep> {
        let state = self.state.lock().await;
        state
            .ranks
            .get(&rank)
            .and_then(|info| info.unhealthy.clone())
    }

    /// A world that restores `skip.after_step` skips `skip.batches` after it.
    pub async fn set_skip(&self, skip: wire::DataSkip) {
        self.state.lock().await.skip = Some(skip);
    }

    /// Forgets the losses of the steps after `step`: the run will train other data there.
    pub async fn forget_losses_after(&self, step: u64) {
        self.state.lock().await.losses.split_off(&(step + 1));
    }

    /// Rank deaths reported since the last call.
    pub async fn take_downs(&self) -> Vec<RankDown> {
        std::mem::take(&mut self.state.lock().await.downs)
    }

    /// Forgets the ranks of a stopped world (a relaunch registers them again).
    pub async fn forget_ranks(&self) {
        let mut state = self.state.lock().await;
        state.ranks.clear();
        state.downs.clear();
        state.chosen = None;
    }

    /// The step this world restores (0: fresh), once one of its ranks asked.
    pub async fn chosen_step(&self) -> Option<u64> {
        self.state.lock().await.chosen.map(|c| c.unwrap_or(0))
    }

    /// A node's connection: its hello, then reports, with memory commits pushed back.
    pub async fn node_session(
        self: Arc<Self>,
        daemon: &Arc<Daemon>,
        stream: TcpStream,
        hello: Message,
        from: SocketAddr,
    ) -> Result<()> {
        let Message::NodeHello {
            node,
            address,
            buddy,
            socket,
            t0,
            epoch,
            candidate,
            replicas,
            instance,
            rollback,
        } = hello
        else {
            bail!("expected a hello");
        };
        if epoch > self.epoch {
            // The node follows a newer leader: this one was deposed (the lease task steps
            // it down).
            self.depose();
            bail!(
                "node {node} knows epoch {epoch}, newer than this leader's {}",
                self.epoch
            );
        }
        if self.deposed() {
            bail!("this leader was deposed");
        }
        let (mut reader, mut writer) = stream.into_split();
        let (sender, mut outbox) = mpsc::unbounded_channel::<Message>();
        let first = {
            let mut state = self.state.lock().await;
            // A restarted or new leader learns the world from what the nodes hold.
            for entry in &t0 {
                if entry.run == self.cfg.run && state.world_size == 0 {
                    state.world_size = entry.world_size;
                }
            }
            state.sessions += 1;
            let session = state.sessions;
            let (rollbacks_before, mut first, missed) =
                self.greeting(&state, &node, instance, rollback);
            if let Some(rolled_back) = missed {
                tracing::warn!(%node, "telling a node of the rollback it missed");
                let _ = sender.send(rolled_back);
            }
            state.nodes.insert(
                node.clone(),
                NodeInfo {
                    session,
                    instance,
                    rollbacks_before,
                    address: address.clone(),
                    buddy,
                    socket,
                    seen: Instant::now(),
                    connected: true,
                    candidate,
                    t0: t0.clone(),
                    sender,
                },
            );
            self.learn_from_hello(&mut state, &address, &t0, &replicas);
            self.pair_again(&mut state, &node);
            self.order_succession(&mut state);
            if let Message::Leading { succession, .. } = &mut first {
                // As it stands with this node in it.
                succession.clone_from(&state.succession);
            }
            (first, session, rollbacks_before)
        };
        let (first, session, rollbacks_before) = first;
        tracing::info!(%node, %from, "node connected");
        let key = daemon.key.clone();
        let epoch = self.epoch;
        let writer_task = tokio::spawn(async move {
            if wire::write_frame(&mut writer, &first, &[], Some(&key))
                .await
                .is_err()
            {
                return;
            }
            let mut beat = tokio::time::interval(Duration::from_millis(500));
            loop {
                let message = tokio::select! {
                    message = outbox.recv() => match message {
                        Some(message) => message,
                        None => return,
                    },
                    _ = beat.tick() => Message::LeaderBeat { epoch },
                };
                if wire::write_frame(&mut writer, &message, &[], Some(&key))
                    .await
                    .is_err()
                {
                    break;
                }
            }
        });
        let result = loop {
            let frame = match wire::read_frame(&mut reader, Some(&daemon.key)).await {
                Ok(frame) => frame,
                Err(error) => break Err(error.into()),
            };
            if self.deposed() {
                break Ok(());
            }
            if let Err(error) = self.handle(&node, rollbacks_before, frame.message).await {
                break Err(error);
            }
        };
        writer_task.abort();
        {
            let mut state = self.state.lock().await;
            if let Some(info) = state.nodes.get_mut(&node).filter(|i| i.session == session) {
                info.connected = false;
            }
            self.order_succession(&mut state);
        }
        tracing::info!(%node, "node disconnected");
        result
    }

    /// What a node's hello tells a leader that starts after another: each T0 step was
    /// memory-committed, and each complete replica is a rank's snapshot that reached its
    /// buddy. Both count as that rank's `Replicated` report, so a step every rank reached
    /// is memory-committed again, and a lost node's ranks are found at their buddy.
    fn learn_from_hello(
        &self,
        state: &mut State,
        address: &str,
        t0: &[T0Entry],
        replicas: &[ReplicaEntry],
    ) {
        if state.supervision.is_some() {
            // A world runs under this leader already: what a node held before (it was cut
            // off, or restarted) belongs to an earlier world.
            return;
        }
        for entry in replicas.iter().filter(|e| e.run == self.cfg.run) {
            let newer = state
                .replica_steps
                .get(&entry.rank)
                .is_none_or(|(step, _)| *step <= entry.step);
            if newer {
                state
                    .replica_steps
                    .insert(entry.rank, (entry.step, address.to_string()));
                state.replica_holder.insert(entry.rank, address.to_string());
            }
        }
        let evidence: Vec<(Rank, u32, u64)> = t0
            .iter()
            .filter(|e| e.run == self.cfg.run)
            .map(|e| (e.rank, e.world_size, e.step))
            .chain(
                replicas
                    .iter()
                    .filter(|e| e.run == self.cfg.run)
                    .map(|e| (e.rank, e.world_size, e.step)),
            )
            .collect();
        for (rank, world_size, step) in evidence {
            if state.memory_step.is_none_or(|m| m < step) {
                self.replicated(state, rank, world_size, step, false, None);
            }
        }
    }

    /// Counts `rank`'s snapshot of `step` as in T0 and T1; once every rank's is, the step is
    /// memory-committed and the nodes are told (with whether to make it durable).
    /// `upload`: what the rank's daemon said of its uploads (see [`UploadReport`]).
    fn replicated(
        &self,
        state: &mut State,
        rank: Rank,
        world_size: u32,
        step: u64,
        durable_requested: bool,
        upload: Option<UploadReport>,
    ) {
        if world_size != state.world_size {
            return;
        }
        let last_durable = state.last_durable_step;
        let entry = state.replicated.entry(step).or_default();
        entry.ranks.insert(rank);
        entry.durable_requested |= durable_requested;
        entry.upload_busy |= upload.is_some_and(|u| u.busy(last_durable));
        if entry.ranks.len() != world_size as usize {
            return;
        }
        let (requested, upload_busy) = (entry.durable_requested, entry.upload_busy);
        state.replicated = state.replicated.split_off(&(step + 1));
        if state.memory_step.is_none_or(|m| m < step) {
            state.memory_step = Some(step);
        }
        self.metrics.memory_step.set(step as i64);
        // Due when the step crosses a multiple of durable_every_steps since the last durable
        // one, so a skipped snapshot at the multiple itself does not skip a durable step; made
        // durable once no rank's upload still runs (the next step every daemon can upload at
        // once), unless a rank asked for it.
        let every = self.cfg.durable_every_steps.max(1);
        let due = step / every > state.last_durable_step.unwrap_or(0) / every
            || state.last_durable.elapsed().as_secs_f64() >= self.cfg.durable_every_seconds;
        let durable = requested || (due && !upload_busy);
        if due && !durable {
            self.metrics.durable_deferred.inc();
            tracing::debug!(step, "durable step deferred: a rank's upload still runs");
        }
        if durable {
            state.last_durable = Instant::now();
            state.last_durable_step = Some(step);
            state.memory_at.insert(step, Instant::now());
        }
        tracing::debug!(step, durable, "memory-committed");
        let push = Message::MemoryCommitted {
            run: self.cfg.run.clone(),
            step,
            durable,
            epoch: self.epoch,
        };
        self.push(state, push);
    }

    /// Sends `message` to every node this leader knows, unless it was deposed.
    fn push(&self, state: &State, message: Message) {
        if self.deposed() {
            return;
        }
        for node in state.nodes.values() {
            let _ = node.sender.send(message.clone());
        }
    }

    /// Whether `rank`'s report of `step` shows that a step waiting for reports will never
    /// have all of them. A rank's daemon reports its snapshots in step order, one at a time,
    /// and the next only once the last was committed or dropped: so a waiting step below
    /// `step` that `rank` did not report will never be, and nor will `step` by a rank that
    /// reported a later one. It happens when a daemon restarts and loses the snapshot it
    /// was replicating, or when ranks handed over different steps; without this, the others'
    /// snapshots wait `commit_timeout_seconds` and the ranks take none meanwhile. A step
    /// below whose snapshots the nodes dropped already is no reason: `rank` may be handing
    /// over the same step as the others once more.
    fn never_complete(&self, state: &State, rank: Rank, step: u64) -> bool {
        let timeout = Duration::from_secs_f64(self.cfg.commit_timeout_seconds);
        let passed_by_rank = state
            .replicated
            .range(..step)
            .any(|(_, r)| r.held(timeout) && !r.ranks.contains(&rank));
        let this = state.replicated.get(&step);
        let passed_by_other = state.replicated.range(step + 1..).any(|(_, r)| {
            r.live()
                && r.ranks
                    .iter()
                    .any(|q| *q != rank && this.is_none_or(|t| !t.ranks.contains(q)))
        });
        passed_by_rank || passed_by_other
    }

    /// Gives up every step still waiting for reports, through `step` and the newest one
    /// reported: the nodes drop their snapshots of them at once, as a commit frees them, so
    /// that the ranks hand over the same next step. A hello's evidence is kept.
    fn give_up(&self, state: &mut State, step: u64) {
        let waiting: Vec<u64> = state
            .replicated
            .iter()
            .filter(|(_, r)| r.live())
            .map(|(s, _)| *s)
            .collect();
        let through = waiting.iter().copied().fold(step, u64::max);
        state.replicated.retain(|_, r| !r.live());
        self.metrics.commits_given_up.inc();
        tracing::info!(
            through,
            ?waiting,
            "steps that can no longer be memory-committed given up: a rank reported a later one"
        );
        let message = Message::CommitsGivenUp {
            run: self.cfg.run.clone(),
            through,
            epoch: self.epoch,
        };
        self.push(state, message);
    }

    /// Tells `node` again that `step` is memory-committed (durable when it was made durable
    /// or the node asks for it).
    fn recommit(&self, state: &State, node: &str, step: u64, durable_requested: bool) {
        if self.deposed() {
            return;
        }
        let durable = durable_requested || state.last_durable_step == Some(step);
        tracing::info!(step, %node, durable, "repeated a memory commit to a node that handed its snapshot over again");
        self.metrics.recommits.inc();
        if let Some(info) = state.nodes.get(node) {
            let _ = info.sender.send(Message::MemoryCommitted {
                run: self.cfg.run.clone(),
                step,
                durable,
                epoch: self.epoch,
            });
        }
    }

    /// Acts on one frame of `node`'s link, whose hello gave it `rollbacks_before` (what this
    /// link's daemon state is taken to have dealt with: a report left over from an older
    /// link is judged by that link's, not by its successor's).
    async fn handle(&self, node: &str, rollbacks_before: u64, message: Message) -> Result<()> {
        let mut state = self.state.lock().await;
        if let Some(info) = state.nodes.get_mut(node) {
            info.seen = Instant::now();
        }
        match message {
            Message::RankUp {
                run,
                rank,
                world_size,
                pid,
                ..
            } => {
                self.check_run(&run)?;
                if let Some(placed) = self.placed_on(&state, rank) {
                    if placed != node {
                        // A rank of an earlier world, reported late (a node that was cut off
                        // sends what it held when the cut heals): not this world's rank.
                        self.metrics.rejected("stale_rank");
                        tracing::warn!(rank, pid, %node, %placed, "ignored a rank of an earlier world");
                        return Ok(());
                    }
                }
                if state.world_size != world_size {
                    tracing::info!(old = state.world_size, new = world_size, "new world size");
                    state.world_size = world_size;
                    state.ranks.clear();
                    state.replicated.clear();
                    state.stored.clear();
                    state.memory_step = None;
                }
                state.ranks.insert(
                    rank,
                    RankInfo {
                        node: node.to_string(),
                        pid,
                        step: 0,
                        seen: Instant::now(),
                        progressed: Instant::now(),
                        alive: true,
                        done: false,
                        compute_us: 0,
                        process_state: None,
                        restored_from: None,
                        slow_since: None,
                        straggler: false,
                        unhealthy: None,
                    },
                );
            }
            Message::RankDone { run, rank, pid, .. } => {
                self.check_run(&run)?;
                if let Some(info) = state.ranks.get_mut(&rank).filter(|i| i.pid == pid) {
                    info.alive = false;
                    info.done = true;
                }
            }
            Message::RankDown {
                run,
                rank,
                pid,
                unix_ms,
                unix_us,
                step,
                ..
            } => {
                self.check_run(&run)?;
                if let Some(info) = state.ranks.get_mut(&rank).filter(|i| i.pid == pid) {
                    info.alive = false;
                    info.step = info.step.max(step);
                    state.downs.push(RankDown {
                        rank,
                        node: node.to_string(),
                        pid,
                        unix_us: if unix_us > 0 { unix_us } else { unix_ms * 1000 },
                    });
                }
            }
            Message::Replicated {
                run,
                rank,
                world_size,
                step,
                durable_requested,
                upload,
                rollback,
                ..
            } => {
                self.check_run(&run)?;
                if world_size != state.world_size {
                    return Ok(());
                }
                if self.applied_rollbacks(rollbacks_before, rollback) < state.rollbacks() {
                    // Handed over before this leader's last rollback, by a rank of the world
                    // stopped for it, and reported after (sent before its daemon heard of
                    // the rollback): the abandoned trajectory's.
                    self.metrics.rejected("rolled_back_step");
                    tracing::warn!(rank, step, %node, "ignored a snapshot handed over before the run was rolled back");
                    return Ok(());
                }
                if self
                    .placed_on(&state, rank)
                    .is_some_and(|placed| placed != node)
                {
                    // A snapshot of an earlier world, reported late by a node that was cut
                    // off: it must not count towards this world's commits.
                    self.metrics.rejected("stale_rank");
                    tracing::warn!(rank, step, %node, "ignored a snapshot of an earlier world");
                    return Ok(());
                }
                if let Some(buddy) = state.nodes.get(node).and_then(|n| n.buddy.clone()) {
                    state.replica_holder.insert(rank, buddy);
                }
                if state.memory_step == Some(step) && !state.replicated.contains_key(&step) {
                    // The step is committed already: this node's snapshot of it expired
                    // before the commit came and was handed over again. The other ranks
                    // hold it as T0 and will not hand it over again, so the commit is
                    // repeated to this node alone.
                    self.recommit(&state, node, step, durable_requested);
                    return Ok(());
                }
                if state.memory_step.is_none_or(|m| step > m) {
                    state.replicated.entry(step).or_default().reported_at = Some(Instant::now());
                    if self.never_complete(&state, rank, step) {
                        self.give_up(&mut state, step);
                        return Ok(());
                    }
                }
                self.replicated(
                    &mut state,
                    rank,
                    world_size,
                    step,
                    durable_requested,
                    upload,
                );
            }
            Message::Stored {
                run,
                rank,
                world_size,
                step,
                ..
            } => {
                self.check_run(&run)?;
                if world_size != state.world_size {
                    return Ok(());
                }
                let abandoned = state.rolled_back_to().is_some_and(|to| step.step > to)
                    && state.memory_step.is_none_or(|m| m < step.step);
                if abandoned {
                    self.metrics.rejected("rolled_back_step");
                    tracing::warn!(%step, "ignored an upload of a step the run was rolled back from");
                    return Ok(());
                }
                let ranks = state.stored.entry(step).or_default();
                ranks.insert(rank);
                if ranks.len() == world_size as usize {
                    state.stored.remove(&step);
                    let started = state.memory_at.remove(&step.step);
                    let run = self.run.clone();
                    let metrics = self.metrics.clone();
                    let durable = self.durable.clone();
                    let epoch = self.epoch;
                    // The commit record goes out without holding the state.
                    tokio::spawn(async move {
                        match run.commit_as_leader(step, world_size, epoch).await {
                            Ok(_) => {
                                let mut known = durable.lock().unwrap_or_else(|e| e.into_inner());
                                if *known < Some(step) {
                                    *known = Some(step);
                                }
                                drop(known);
                                metrics.durable_step.set(step.step as i64);
                                metrics
                                    .durable_commit_timestamp
                                    .set(lazarus_shared::store::now_unix_ms() as f64 / 1e3);
                                if let Some(started) = started {
                                    metrics
                                        .commit_latency_seconds
                                        .observe(started.elapsed().as_secs_f64());
                                }
                                tracing::info!(%step, "durable commit");
                            }
                            Err(error) => {
                                metrics.error("commit");
                                tracing::error!(%step, %error, "commit failed");
                            }
                        }
                    });
                }
            }
            Message::NodeHeartbeat { ranks, .. } => {
                for (step, loss) in ranks.iter().flat_map(|beat| &beat.losses) {
                    state.losses.insert(*step, *loss);
                }
                while state.losses.len() > LOSSES_KEPT {
                    state.losses.pop_first();
                }
                for beat in ranks {
                    if let Some(info) = state
                        .ranks
                        .get_mut(&beat.rank)
                        .filter(|i| i.pid == beat.pid)
                    {
                        if beat.step != info.step {
                            info.step = beat.step;
                            info.progressed = Instant::now();
                        }
                        let ago = Duration::from_millis(beat.seen_ms_ago);
                        info.seen = Instant::now().checked_sub(ago).unwrap_or_else(Instant::now);
                        if beat.compute_us > 0 {
                            info.compute_us = beat.compute_us;
                        }
                        info.process_state = beat.process_state;
                        if beat.restored_from.is_some() {
                            info.restored_from = beat.restored_from;
                        }
                        if beat.unhealthy.is_some() {
                            info.unhealthy = beat.unhealthy;
                        }
                    }
                }
                if state
                    .stragglers_checked
                    .is_none_or(|at| at.elapsed() >= STRAGGLER_CHECK)
                {
                    state.stragglers_checked = Some(Instant::now());
                    self.find_stragglers(&mut state);
                }
            }
            other => bail!("unexpected {other:?} from node {node}"),
        }
        Ok(())
    }

    /// Marks the ranks whose compute per step has exceeded the median by more than
    /// `straggler_margin` for `straggler_seconds`. With an even number of ranks the median
    /// is the lower middle one, so with two ranks the slower is compared to the faster.
    fn find_stragglers(&self, state: &mut State) {
        let mut times: Vec<u64> = state
            .ranks
            .values()
            .filter(|r| r.alive && r.compute_us > 0)
            .map(|r| r.compute_us)
            .collect();
        if times.len() < 2 {
            return;
        }
        times.sort_unstable();
        let median = times[(times.len() - 1) / 2] as f64;
        let limit = median * (1.0 + self.cfg.straggler_margin);
        let mut count = 0;
        for (rank, info) in state.ranks.iter_mut() {
            let slow = info.alive && info.compute_us as f64 > limit;
            if !slow {
                if info.straggler {
                    tracing::info!(rank, node = %info.node, "rank is no longer a straggler");
                }
                info.slow_since = None;
                info.straggler = false;
                continue;
            }
            let since = *info.slow_since.get_or_insert_with(Instant::now);
            if !info.straggler && since.elapsed().as_secs_f64() >= self.cfg.straggler_seconds {
                info.straggler = true;
                tracing::warn!(
                    rank,
                    node = %info.node,
                    compute_ms = info.compute_us as f64 / 1e3,
                    median_ms = median / 1e3,
                    "straggler: rank {rank} on {} computes {:.1} ms per step, {:.2}x the median {:.1} ms, for {:.0} s",
                    info.node,
                    info.compute_us as f64 / 1e3,
                    info.compute_us as f64 / median,
                    median / 1e3,
                    since.elapsed().as_secs_f64()
                );
            }
            count += i64::from(info.straggler);
        }
        self.metrics.stragglers.set(count);
    }

    fn check_run(&self, run: &RunId) -> Result<()> {
        if *run != self.cfg.run {
            bail!("report for run {run}; this job's run is {}", self.cfg.run);
        }
        Ok(())
    }

    pub async fn which_step(&self, run: &RunId, world_size: u32, rank: Rank) -> Result<Message> {
        self.check_run(run)?;
        let memory = {
            let state = self.state.lock().await;
            (state.world_size == world_size)
                .then_some(state.memory_step)
                .flatten()
        };
        // A memory-committed step is never older than a durable one (durable steps are
        // uploaded from T0), so with memory at hand the store is not asked: a slow or hung
        // store cannot delay a restore that does not need it.
        let durable = match memory {
            Some(_) => *self.durable.lock().unwrap_or_else(|e| e.into_inner()),
            None => self.durable_step().await,
        };
        let (replica, skip, losses) = {
            let mut state = self.state.lock().await;
            let chosen = RestoreChoice::new(memory, durable.map(|d| d.step)).step();
            state.chosen = Some(chosen);
            let skip = state
                .skip
                .filter(|skip| skip.after_step == chosen.unwrap_or(0));
            let losses = [memory, durable.map(|d| d.step)]
                .into_iter()
                .flatten()
                .filter_map(|step| state.losses.get(&(step + 1)).map(|l| (step + 1, *l)))
                .collect();
            (state.replica_holder.get(&rank).cloned(), skip, losses)
        };
        Ok(Message::StepChoice {
            memory,
            durable,
            replica,
            skip,
            losses,
        })
    }

    pub async fn status(&self) -> ClusterStatus {
        let durable = self.durable_step().await;
        let state = self.state.lock().await;
        let mut ranks: Vec<RankStatus> = state
            .ranks
            .iter()
            .map(|(rank, info)| RankStatus {
                rank: *rank,
                node: info.node.clone(),
                pid: info.pid,
                step: info.step,
                last_seen_ms_ago: info.seen.elapsed().as_millis() as u64,
                compute_ms: (info.compute_us > 0).then(|| info.compute_us as f64 / 1e3),
                straggler: info.straggler,
            })
            .collect();
        ranks.sort_by_key(|r| r.rank);
        let mut ranks_of: HashMap<String, Vec<Rank>> = HashMap::new();
        for rank in &ranks {
            ranks_of
                .entry(rank.node.clone())
                .or_default()
                .push(rank.rank);
        }
        ClusterStatus {
            leader: self.cfg.node.clone(),
            epoch: self.epoch,
            succession: state.succession.clone(),
            nodes: state
                .nodes
                .iter()
                .map(|(name, info)| NodeStatus {
                    node: name.clone(),
                    address: info.address.clone(),
                    last_seen_ms_ago: info.seen.elapsed().as_millis() as u64,
                    ranks: ranks_of.remove(name.as_str()).unwrap_or_default(),
                    t0_steps: info.t0.iter().map(|e| (e.run.clone(), e.step)).collect(),
                })
                .collect(),
            supervision: state
                .supervision
                .as_ref()
                .map(|(generation, active, drained)| wire::SupervisionStatus {
                    generation: *generation,
                    active: active.clone(),
                    spares: state.spares().into_iter().cloned().collect(),
                    drained: drained.clone(),
                }),
            runs: vec![RunStatus {
                run: self.cfg.run.clone(),
                world_size: state.world_size,
                ranks,
                memory_step: state.memory_step,
                durable_step: durable,
            }],
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use std::path::Path;

    use super::*;
    use crate::daemon::testing;

    /// A leader of a 2-rank world with durable steps every 3 steps, and what its one node
    /// receives.
    async fn leader() -> (Leader, mpsc::UnboundedReceiver<Message>) {
        let flags = [
            "--durable-every-steps",
            "3",
            "--durable-every-seconds",
            "86400",
            "--commit-timeout-seconds",
            "0.2",
        ];
        let cfg = testing::config(Path::new("/unused"), "n1", "127.0.0.1:7001", &flags);
        let store = testing::memory_store().await;
        let leader = Leader::new(cfg.clone(), store.run(&cfg.run), Arc::default(), None, 1);
        leader.state.lock().await.world_size = 2;
        let receiver = add_node(&leader, "n1").await;
        (leader, receiver)
    }

    /// Adds node `name` to the leader's nodes; what it receives.
    pub(crate) async fn add_node(leader: &Leader, name: &str) -> mpsc::UnboundedReceiver<Message> {
        connect(leader, name, 0, wire::RollbackMark::default())
            .await
            .0
    }

    /// `node`'s daemon says its rank `rank` (process `pid`, of a world of 2) registered.
    pub(crate) async fn rank_up(leader: &Leader, node: &str, rank: Rank, pid: u32) {
        let message = Message::RankUp {
            node: node.into(),
            run: leader.cfg.run.clone(),
            rank,
            world_size: 2,
            pid,
        };
        leader.handle(node, 0, message).await.expect("handled");
    }

    /// `node`'s daemon heartbeats with its rank `rank` (process `pid`) at `step`.
    pub(crate) async fn rank_at(leader: &Leader, node: &str, rank: Rank, pid: u32, step: u64) {
        let beat = wire::RankBeat {
            rank,
            pid,
            step,
            seen_ms_ago: 0,
            compute_us: 0,
            process_state: None,
            restored_from: None,
            unhealthy: None,
            losses: Vec::new(),
        };
        let message = Message::NodeHeartbeat {
            node: node.into(),
            ranks: vec![beat],
        };
        leader.handle(node, 0, message).await.expect("handled");
    }

    /// `node`'s daemon says its rank `rank` (process `pid`) finished its run (`Bye`).
    pub(crate) async fn rank_done(leader: &Leader, node: &str, rank: Rank, pid: u32) {
        let message = Message::RankDone {
            node: node.into(),
            run: leader.cfg.run.clone(),
            rank,
            pid,
        };
        leader.handle(node, 0, message).await.expect("handled");
    }

    /// `node`'s daemon says its rank `rank` (process `pid`) exited at `unix_us`.
    pub(crate) async fn rank_down(leader: &Leader, node: &str, rank: Rank, pid: u32, unix_us: u64) {
        let message = Message::RankDown {
            node: node.into(),
            run: leader.cfg.run.clone(),
            rank,
            pid,
            unix_ms: unix_us / 1000,
            unix_us,
            step: 0,
        };
        leader.handle(node, 0, message).await.expect("handled");
    }

    /// Node `name`'s daemon process `instance`, having applied the rollback `mark`,
    /// (re)connects to the leader, as its hello does; what it receives after the first frame,
    /// and the first frame's rollback mark.
    async fn connect(
        leader: &Leader,
        name: &str,
        instance: u64,
        mark: wire::RollbackMark,
    ) -> (mpsc::UnboundedReceiver<Message>, Option<wire::RollbackMark>) {
        let (sender, receiver) = mpsc::unbounded_channel();
        let mut state = leader.state.lock().await;
        let (rollbacks_before, first, missed) = leader.greeting(&state, name, instance, mark);
        let Message::Leading { rollback, .. } = first else {
            panic!("the first frame is {first:?}");
        };
        if let Some(missed) = missed {
            sender.send(missed).expect("receiver alive");
        }
        let info = NodeInfo {
            address: format!("{name}:7001"),
            buddy: None,
            socket: String::new(),
            seen: Instant::now(),
            connected: true,
            candidate: true,
            session: 1,
            instance,
            rollbacks_before,
            t0: Vec::new(),
            sender,
        };
        state.nodes.insert(name.into(), info);
        (receiver, rollback)
    }

    /// Both ranks report `step` with these uploads (`requested`: rank 0 asks for a durable
    /// step); returns whether the commit the node received made it durable.
    async fn commit(
        leader: &Leader,
        receiver: &mut mpsc::UnboundedReceiver<Message>,
        step: u64,
        uploads: [UploadReport; 2],
        requested: bool,
    ) -> bool {
        let mut state = leader.state.lock().await;
        for (rank, upload) in uploads.into_iter().enumerate() {
            let asked = requested && rank == 0;
            leader.replicated(&mut state, rank as Rank, 2, step, asked, Some(upload));
        }
        match receiver.try_recv() {
            Ok(Message::MemoryCommitted {
                step: s, durable, ..
            }) if s == step => durable,
            other => panic!("step {step}: the node received {other:?}"),
        }
    }

    /// `rank`'s daemon on `node` reports its snapshot of `step`, as a node session does.
    async fn report(leader: &Leader, node: &str, rank: Rank, step: u64) {
        report_marked(leader, node, rank, step, wire::RollbackMark::default()).await
    }

    /// [`report`] of a snapshot handed over after the rollback `rollback`.
    async fn report_marked(
        leader: &Leader,
        node: &str,
        rank: Rank,
        step: u64,
        rollback: wire::RollbackMark,
    ) {
        let before = leader.state.lock().await.nodes[node].rollbacks_before;
        report_on_link(leader, (node, before), rank, step, rollback).await
    }

    /// [`report_marked`] read from a link of `node` whose hello gave it `rollbacks_before`.
    async fn report_on_link(
        leader: &Leader,
        (node, rollbacks_before): (&str, u64),
        rank: Rank,
        step: u64,
        rollback: wire::RollbackMark,
    ) {
        let message = Message::Replicated {
            node: node.into(),
            run: leader.cfg.run.clone(),
            rank,
            world_size: 2,
            step,
            durable_requested: false,
            upload: Some(UploadReport {
                running: false,
                t0: None,
            }),
            rollback,
        };
        leader
            .handle(node, rollbacks_before, message)
            .await
            .expect("handled");
    }

    /// What a node received since last asked: `given up through` or `committed` steps.
    fn received(receiver: &mut mpsc::UnboundedReceiver<Message>) -> Vec<String> {
        std::iter::from_fn(|| receiver.try_recv().ok())
            .map(|message| match message {
                Message::CommitsGivenUp { through, .. } => format!("given up through {through}"),
                Message::MemoryCommitted { step, .. } => format!("committed {step}"),
                other => format!("{other:?}"),
            })
            .collect()
    }

    /// Found by the soak: n4's daemon restarted while its rank trained on, and came back
    /// with the buddy of its configuration (n1, a spare) instead of the world's (n3). When n1
    /// was lost, n4's snapshots were no longer replicated, no step was committed again, and
    /// the world, done with its last step, hung and was relaunched from 216 steps before.
    #[tokio::test]
    async fn a_node_of_the_world_that_comes_back_with_another_buddy_is_paired_again() {
        let (leader, mut n1) = leader().await;
        let mut n2 = add_node(&leader, "n2").await;
        let mut n3 = add_node(&leader, "n3").await;
        let active = ["n1", "n2"].map(String::from);
        leader.set_supervision(0, &active, &[]).await;
        leader.pair(&active).await;
        let told = |receiver: &mut mpsc::UnboundedReceiver<Message>| match receiver.try_recv() {
            Ok(Message::SetBuddy { address, .. }) => Some(address),
            Ok(other) => panic!("not a buddy: {other:?}"),
            Err(_) => None,
        };
        assert_eq!(told(&mut n1), Some(Some("n2:7001".to_string())));
        assert_eq!(told(&mut n2), Some(Some("n1:7001".to_string())));
        // n1's daemon says hello again, naming the spare n3 as its buddy.
        let mut state = leader.state.lock().await;
        state.nodes.get_mut("n1").unwrap().buddy = Some("n3:7001".into());
        leader.pair_again(&mut state, "n1");
        assert_eq!(told(&mut n1), Some(Some("n2:7001".to_string())));
        assert_eq!(state.nodes["n1"].buddy.as_deref(), Some("n2:7001"));
        // Again with the buddy the ring gives it, or from a node outside the world: nothing.
        leader.pair_again(&mut state, "n1");
        assert_eq!(told(&mut n1), None);
        state.nodes.get_mut("n3").unwrap().buddy = Some("n1:7001".into());
        leader.pair_again(&mut state, "n3");
        assert_eq!(told(&mut n3), None);
    }

    /// Found by the soak under srun: n2 and n3 were lost, drained in Slurm and replaced, and
    /// their daemons came back and stayed connected. The leader, n4, training with n1, counted
    /// only n1 and itself; when n1 was lost too it heard 1 of 2, stopped renewing its lease
    /// and waited, until n1's daemon came back, found the lease standing still and took over:
    /// 15 s lost where a spare would have taken n1's place at once.
    #[tokio::test]
    async fn drained_nodes_whose_daemons_are_connected_count_toward_the_quorum() {
        let (leader, _n1) = leader().await;
        let _others: Vec<_> =
            futures::future::join_all(["n2", "n3", "n4"].map(|name| add_node(&leader, name))).await;
        let (active, drained) = (
            ["n1", "n4"].map(String::from),
            ["n2", "n3"].map(String::from),
        );
        leader.set_supervision(3, &active, &drained).await;
        assert!(leader.has_quorum().await, "every node is heard");
        let disconnect = |name: &'static str| async {
            leader
                .state
                .lock()
                .await
                .nodes
                .get_mut(name)
                .unwrap()
                .connected = false;
        };
        disconnect("n1").await;
        // n2, n3 and n4 are heard; n1 of the world is not.
        assert!(leader.has_quorum().await, "3 of 4 nodes are heard");
        // A drained node whose daemon is gone counts neither way.
        disconnect("n2").await;
        assert!(leader.has_quorum().await, "2 of 3 nodes are heard");
        disconnect("n3").await;
        assert!(!leader.has_quorum().await, "1 of 2 nodes is heard");
    }

    /// A daemon killed while it replicated rank 1's snapshot of step 16 left rank 0's
    /// waiting for a commit that could not come: the other node held it, and its rank took
    /// no snapshot, for `commit_timeout_seconds`. The leader now gives the step up as soon
    /// as a report shows it cannot complete.
    #[tokio::test]
    async fn a_step_that_can_no_longer_complete_is_given_up_at_once() {
        let (leader, mut n1) = leader().await;
        let mut n2 = add_node(&leader, "n2").await;
        // Rank 1's restarted daemon reports 20: 16 lacks rank 1, which is past it.
        report(&leader, "n1", 0, 16).await;
        report(&leader, "n2", 1, 20).await;
        assert_eq!(received(&mut n1), ["given up through 20"]);
        assert_eq!(received(&mut n2), ["given up through 20"]);
        assert_eq!(leader.metrics.commits_given_up.get(), 1);
        // Both ranks freed at once hand over the same step, which commits.
        report(&leader, "n1", 0, 21).await;
        report(&leader, "n2", 1, 21).await;
        assert_eq!(received(&mut n1), ["committed 21"]);
        assert_eq!(received(&mut n2), ["committed 21"]);
        // The other order: the rank ahead reports first.
        report(&leader, "n2", 1, 25).await;
        report(&leader, "n1", 0, 23).await;
        assert_eq!(received(&mut n1), ["given up through 25"]);
        assert_eq!(received(&mut n2), ["given up through 25"]);
        // A snapshot that was still being replicated when its step was given up is reported
        // late, and given up with the next reports: one more round.
        report(&leader, "n1", 0, 24).await;
        assert!(received(&mut n1).is_empty());
        report(&leader, "n2", 1, 26).await;
        assert_eq!(received(&mut n1), ["given up through 26"]);
        assert_eq!(received(&mut n2), ["given up through 26"]);
        // The run's last step is handed over again and again until it commits: a step given
        // up is not barred.
        report(&leader, "n1", 0, 26).await;
        report(&leader, "n2", 1, 26).await;
        assert_eq!(received(&mut n1), ["committed 26"]);
        assert_eq!(received(&mut n2), ["committed 26"]);
        assert_eq!(leader.metrics.commits_given_up.get(), 3);
        // Rank 0's own snapshot of 30 expired before rank 1's report came, and it reported
        // 31: 30 can still complete, and does.
        report(&leader, "n1", 0, 30).await;
        report(&leader, "n1", 0, 31).await;
        report(&leader, "n2", 1, 30).await;
        assert_eq!(received(&mut n1), ["committed 30"]);
        assert_eq!(received(&mut n2), ["committed 30"]);
        // 31 cannot: rank 1 reports 32.
        report(&leader, "n2", 1, 32).await;
        assert_eq!(received(&mut n1), ["given up through 32"]);
        assert_eq!(received(&mut n2), ["given up through 32"]);
        assert_eq!(leader.metrics.commits_given_up.get(), 4);
        // A hello's evidence of a step is not a report: it is kept, not given up.
        let mut state = leader.state.lock().await;
        leader.replicated(&mut state, 0, 2, 40, false, None);
        drop(state);
        report(&leader, "n2", 1, 42).await;
        report(&leader, "n1", 0, 42).await;
        assert_eq!(received(&mut n1), ["committed 42"]);
        assert_eq!(received(&mut n2), ["committed 42"]);
        assert_eq!(leader.metrics.commits_given_up.get(), 4);
        // Rank 0's snapshot of 50 waited past the commit timeout, so its node dropped it, and
        // both ranks hand over 52: 50 is no reason to give 52 up.
        report(&leader, "n1", 0, 50).await;
        tokio::time::sleep(Duration::from_millis(250)).await;
        report(&leader, "n2", 1, 52).await;
        report(&leader, "n1", 0, 52).await;
        assert_eq!(received(&mut n1), ["committed 52"]);
        assert_eq!(received(&mut n2), ["committed 52"]);
        assert_eq!(leader.metrics.commits_given_up.get(), 4);
    }

    /// A rank's snapshot handed over before a rollback and reported after it (its daemon
    /// sent the report before it heard of the rollback) is the abandoned trajectory's: the
    /// leader ignores it, and commits the new world's, handed over after the rollback.
    /// Regression: both ranks' last snapshots before a loss spike, reported after the
    /// rollback, were memory-committed, and the relaunched world restored them.
    #[tokio::test]
    async fn a_snapshot_handed_over_before_a_rollback_is_not_committed_after_it() {
        let (leader, mut n1) = leader().await;
        let mut n2 = add_node(&leader, "n2").await;
        report(&leader, "n1", 0, 78).await;
        report(&leader, "n2", 1, 78).await;
        assert_eq!(received(&mut n1), ["committed 78"]);
        assert_eq!(received(&mut n2), ["committed 78"]);
        assert_eq!(leader.roll_back(80, "a loss spike").await.unwrap(), None);
        let rolled_back = received(&mut n1);
        assert!(
            matches!(&rolled_back[..], [m] if m.starts_with("RolledBack") && m.contains("seq: 1")),
            "{rolled_back:?}"
        );
        received(&mut n2);
        report(&leader, "n1", 0, 79).await;
        report(&leader, "n2", 1, 79).await;
        assert!(received(&mut n1).is_empty());
        assert_eq!(leader.state.lock().await.memory_step, None);
        let after = wire::RollbackMark {
            epoch: leader.epoch,
            seq: 1,
        };
        report_marked(&leader, "n1", 0, 1, after).await;
        report_marked(&leader, "n2", 1, 1, after).await;
        assert_eq!(received(&mut n1), ["committed 1"]);
        assert_eq!(received(&mut n2), ["committed 1"]);
    }

    /// A daemon whose state began after a rollback (a new instance, no mark) never held what
    /// it abandoned: its reports count. Regression: the leader refused them all, and the
    /// world after the rollback and a lost node's return never committed its last step.
    #[tokio::test]
    async fn a_daemon_started_after_a_rollback_is_heard() {
        let (leader, mut n1) = leader().await;
        let _n2 = connect(&leader, "n2", 7, wire::RollbackMark::default()).await;
        leader.roll_back(80, "a loss spike").await.unwrap();
        received(&mut n1);
        let after = wire::RollbackMark {
            epoch: leader.epoch,
            seq: 1,
        };
        let (mut n2, first) = connect(&leader, "n2", 8, wire::RollbackMark::default()).await;
        assert!(received(&mut n2).is_empty(), "nothing missed");
        assert_eq!(first, Some(after), "the node takes the leader's mark");
        // A report the old daemon sent before the rollback, read from its link after the new
        // daemon's hello, is judged by its own link's hello, not by the new one's.
        let before = wire::RollbackMark::default();
        report_on_link(&leader, ("n2", 0), 1, 3, before).await;
        report_marked(&leader, "n1", 0, 3, after).await;
        assert!(
            received(&mut n1).is_empty(),
            "the old link's report was ignored"
        );
        report(&leader, "n2", 1, 3).await;
        assert_eq!(received(&mut n1), ["committed 3"]);
        assert_eq!(received(&mut n2), ["committed 3"]);
    }

    /// A daemon cut off from the leader while it rolled back lives on with the abandoned
    /// snapshots: when it connects again it is told of the rollback, and what it reports
    /// before it applies it (its hello's pending snapshot) is ignored.
    #[tokio::test]
    async fn a_daemon_that_missed_a_rollback_is_told_of_it_and_its_old_snapshots_are_ignored() {
        let (leader, mut n1) = leader().await;
        let before = wire::RollbackMark {
            epoch: leader.epoch,
            seq: 0,
        };
        let (n2, first) = connect(&leader, "n2", 7, before).await;
        assert_eq!(first, Some(before));
        drop(n2);
        leader.roll_back(80, "a loss spike").await.unwrap();
        received(&mut n1);
        let (mut n2, first) = connect(&leader, "n2", 7, before).await;
        assert_eq!(first, None, "the mark comes with the rollback");
        let told = received(&mut n2);
        assert!(
            matches!(&told[..], [m] if m.starts_with("RolledBack") && m.contains("seq: 1")),
            "{told:?}"
        );
        let after = wire::RollbackMark {
            epoch: leader.epoch,
            seq: 1,
        };
        report_marked(&leader, "n1", 0, 79, after).await;
        report_marked(&leader, "n2", 1, 79, before).await;
        assert!(received(&mut n1).is_empty());
        report_marked(&leader, "n2", 1, 79, after).await;
        assert_eq!(received(&mut n1), ["committed 79"]);
        // Once it applied it, it is not told again.
        let (mut n2, first) = connect(&leader, "n2", 7, after).await;
        assert!(received(&mut n2).is_empty());
        assert_eq!(first, Some(after));
    }

    /// A daemon that missed several rollbacks forgets everything after the earliest step any
    /// of them went back to: a later rollback may go back to a later step, and what the
    /// earlier one abandoned would stay.
    #[tokio::test]
    async fn a_daemon_that_missed_rollbacks_forgets_after_the_earliest_step_they_went_back_to() {
        let (leader, _n1) = leader().await;
        let mark = |seq| wire::RollbackMark {
            epoch: leader.epoch,
            seq,
        };
        drop(connect(&leader, "n2", 7, mark(0)).await);
        let told = |tos: Vec<Option<u64>>, applied: u64| {
            let leader = &leader;
            async move {
                {
                    let mut state = leader.state.lock().await;
                    state.rolled_back_tos = tos;
                }
                let (mut n2, _) = connect(leader, "n2", 7, mark(applied)).await;
                received(&mut n2)
            }
        };
        let rolled_back = |to: &str| format!("to: {to}, epoch: {}, seq: 2 }}", leader.epoch);
        let got = told(vec![Some(50), Some(60)], 0).await;
        assert!(
            matches!(&got[..], [m] if m.ends_with(&rolled_back("Some(50)"))),
            "{got:?}"
        );
        let got = told(vec![Some(50), Some(60)], 1).await;
        assert!(
            matches!(&got[..], [m] if m.ends_with(&rolled_back("Some(60)"))),
            "{got:?}"
        );
        let got = told(vec![None, Some(60)], 0).await;
        assert!(
            matches!(&got[..], [m] if m.ends_with(&rolled_back("None"))),
            "{got:?}"
        );
        assert!(told(vec![None, Some(60)], 2).await.is_empty());
    }

    /// Regression: daemons each skip, on their own, a durable step that comes while their
    /// upload runs; a daemon restarted mid-run was out of step with the other, each skipped
    /// the steps the other uploaded, and nothing became durable until the run's last step.
    /// A due step is now made durable only when every rank's daemon can upload it at once.
    #[tokio::test]
    async fn a_step_is_made_durable_only_when_every_rank_can_upload_it_at_once() {
        let (leader, mut node) = leader().await;
        let free = |t0| UploadReport { running: false, t0 };
        let uploading = |t0| UploadReport { running: true, t0 };
        // Step 3 is due, but rank 0 still uploads: deferred, counted.
        assert!(
            !commit(
                &leader,
                &mut node,
                3,
                [uploading(Some(2)), free(Some(2))],
                false
            )
            .await
        );
        assert_eq!(leader.metrics.durable_deferred.get(), 1);
        // Step 4: both free, so the deferred durable step is this one.
        assert!(commit(&leader, &mut node, 4, [free(Some(3)), free(Some(3))], false).await);
        // Step 5 is not due (4 and 5 lie between the same multiples).
        assert!(!commit(&leader, &mut node, 5, [free(Some(4)), free(Some(4))], false).await);
        assert_eq!(leader.metrics.durable_deferred.get(), 1);
        // Step 6 is due; rank 1's daemon reported before it had taken step 4's durable commit
        // (its T0 was 3), so its upload of 4 is still to start: deferred.
        assert!(!commit(&leader, &mut node, 6, [free(Some(5)), free(Some(3))], false).await);
        // ... and so is a report from a daemon with no T0 at all.
        assert!(!commit(&leader, &mut node, 7, [free(Some(6)), free(None)], false).await);
        assert_eq!(leader.metrics.durable_deferred.get(), 3);
        assert!(commit(&leader, &mut node, 8, [free(Some(7)), free(Some(7))], false).await);
        // A step a rank asks to be durable is, busy or not (the daemons queue it).
        assert!(
            commit(
                &leader,
                &mut node,
                9,
                [uploading(Some(8)), free(Some(8))],
                true
            )
            .await
        );
        // A report that says nothing of its uploads (a hello's evidence) does not defer.
        let mut state = leader.state.lock().await;
        leader.replicated(&mut state, 0, 2, 12, false, None);
        leader.replicated(&mut state, 1, 2, 12, false, Some(free(Some(9))));
        drop(state);
        assert!(matches!(
            node.try_recv(),
            Ok(Message::MemoryCommitted {
                step: 12,
                durable: true,
                ..
            })
        ));
    }
}
