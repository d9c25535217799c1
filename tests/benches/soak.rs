//! Soak: a nemesis over long supervised runs, Jepsen-style (`ops/soak.sh`; not in CI).
//!
//! Four daemons stand for four nodes on 127.0.0.1: n1 leads and every other one may take over;
//! two nodes train and two wait as hot spares. The daemons talk through fault-injecting relays
//! and keep their checkpoints on the S3 test server; two ranks train under a real mpiexec that
//! the leader launches. One fault at a time, at a random moment of the run, healed before the
//! next one:
//!
//! - a rank SIGKILLed, SIGSTOPped past the hang timeout, or paused below it;
//! - a daemon SIGKILLed (repaired a few seconds later, it comes back as a spare), or paused
//!   below the heartbeat timeout;
//! - the leader's daemon SIGKILLed, or SIGSTOPped past the heartbeat timeout and continued
//!   (a deposed leader coming back);
//! - the storage stalled (the S3 server SIGSTOPped for seconds);
//! - a node, or the leader, cut off from the others past the heartbeat timeout, or any node
//!   for less, then healed;
//! - `ckptctl gc --grace 0s` racing the writers;
//! - under Slurm (`LAZARUS_SOAK_LAUNCHER=srun`: the leader launches the ranks with srun on the
//!   local Slurm cluster), a node lost whole: its slurmd, its daemon (the leader's too) and its
//!   ranks SIGKILLed, the node brought back a few seconds later. The soak resumes in Slurm
//!   every node the leader drained once its daemon runs again, as the operator would.
//!
//! A round is one run of `LAZARUS_SOAK_STEPS` steps (default 2000); rounds follow each other
//! until `LAZARUS_SOAK_FAULTS` faults (default 1000) were injected. Every round must end with
//! the run completed, every committed step verified with its data, every loss the run logged
//! (the steps recomputed after each restore included) equal to the uninterrupted run's bit for
//! bit, and no commit of an older leader epoch after one of a newer epoch. A round that fails
//! leaves its logs in a folder the soak names, and the soak exits 1 at the end.
//!
//! Prints a line per fault and per round, then a table per kind of fault: how many were
//! injected, the world relaunches and leader takeovers they caused, the ranks restored from
//! each tier, the recoveries that were expected but did not happen and those that happened
//! unasked, and the time lost (the wall time of the fault's window less the time its net
//! progress takes at the round's clean step time).
//!
//! `LAZARUS_SOAK_SEED` replays a schedule (the timing of faults still varies with the machine);
//! `LAZARUS_SOAK_ONLY` (e.g. `KillNode,CutLeader`) draws from those kinds only.
//!
//! Run: cargo build --release --workspace --bins && cargo bench -p lazarus-tests --bench soak

// A benchmark program: a panic with its message is the failure report.
#![allow(clippy::unwrap_used)]

use std::collections::BTreeMap;
use std::io::{Read, Seek, SeekFrom};
use std::panic::AssertUnwindSafe;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use lazarus_tests::cluster::{text_of, Cluster};
use lazarus_tests::deadline::{kill_processes_naming, logs_under, test_dir_within};
use lazarus_tests::slurm;
use lazarus_tests::supervision::{commit_epochs, kill, now_ms, supervised_by, Daemons};
use lazarus_tests::train::{reference_run, TrainerArgs};
use lazarus_tests::{Ctl, S3Server};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// Daemons: one leader, three that may take over; two train, two are spares.
const NODES: usize = 4;
const ACTIVE: usize = 2;
/// The supervisor's timeouts.
const HEARTBEAT_TIMEOUT_S: f64 = 2.0;
const HANG_TIMEOUT_S: f64 = 3.0;
/// How long a leader must be silent before its successor claims: the heartbeat timeout, then
/// three lease intervals (a quarter of the timeout each) in which its lease must not move,
/// and half a second for the store's reads and the 100 ms looks. A leader silent for less may
/// be back before the claim; either is right.
const TAKEOVER_AFTER_S: f64 = HEARTBEAT_TIMEOUT_S * 1.75 + 0.5;
/// No fault in the last steps of a round: the run ends, and the checks run.
const QUIET_END_STEPS: u64 = 40;
/// How long a recovery that a fault must cause may take to show before it counts as missing.
const RECOVERY_SHOWS_WITHIN: Duration = Duration::from_secs(30);
/// A round that trained more than this many steps again keeps its logs.
const RECOMPUTED_TO_KEEP_LOGS: u64 = 100;
/// A window that has not settled by then fails its round.
const SETTLE_WITHIN: Duration = Duration::from_secs(240);

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Kind {
    KillRank,
    HangRank,
    PauseRank,
    KillDaemon,
    PauseDaemon,
    KillLeader,
    StopLeader,
    StallStore,
    CutNode,
    CutLeader,
    BriefCut,
    Gc,
    KillNode,
}

/// Every kind with its weight in the random schedule.
/// `KillNode` only under Slurm (last, so a seed's schedule under mpiexec stays as it was).
const KINDS: [(Kind, u32); 13] = [
    (Kind::KillRank, 14),
    (Kind::HangRank, 5),
    (Kind::PauseRank, 8),
    (Kind::KillDaemon, 8),
    (Kind::PauseDaemon, 8),
    (Kind::KillLeader, 6),
    (Kind::StopLeader, 4),
    (Kind::StallStore, 10),
    (Kind::CutNode, 5),
    (Kind::CutLeader, 4),
    (Kind::BriefCut, 8),
    (Kind::Gc, 10),
    (Kind::KillNode, 6),
];

impl Kind {
    fn name(self) -> &'static str {
        match self {
            Kind::KillRank => "rank SIGKILL",
            Kind::HangRank => "rank hung (SIGSTOP)",
            Kind::PauseRank => "rank paused < hang",
            Kind::KillDaemon => "daemon SIGKILL",
            Kind::PauseDaemon => "daemon paused < hb",
            Kind::KillLeader => "leader SIGKILL",
            Kind::StopLeader => "leader SIGSTOP > hb",
            Kind::StallStore => "storage stall",
            Kind::CutNode => "node cut off > hb",
            Kind::CutLeader => "leader cut off > hb",
            Kind::BriefCut => "node cut off < hb",
            Kind::Gc => "gc racing writers",
            Kind::KillNode => "node lost whole",
        }
    }

    /// A kind at random among `only` (all when empty); `slurm`: whether nodes can be lost
    /// whole (their slurmd with them).
    fn pick(rng: &mut StdRng, slurm: bool, only: &[Kind]) -> Self {
        let kinds = KINDS.iter().copied().filter(|(kind, _)| {
            (slurm || *kind != Kind::KillNode) && (only.is_empty() || only.contains(kind))
        });
        let total: u32 = kinds.clone().map(|(_, w)| w).sum();
        let mut at = rng.random_range(0..total);
        for (kind, weight) in kinds {
            if at < weight {
                return kind;
            }
            at -= weight;
        }
        unreachable!("the weights sum to total")
    }
}

fn env_or<T: std::str::FromStr>(name: &str, default: T) -> T {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// The training every round runs (and the reference, uninterrupted), with the trainer
/// settings of `LAZARUS_SOAK_SETS` (`key=value`, separated by spaces).
fn trainer_args(dir: &Path, run: &str, steps: u64, store: &str) -> TrainerArgs {
    let sets = std::env::var("LAZARUS_SOAK_SETS").unwrap_or_default();
    TrainerArgs::small(dir)
        .run(run)
        .steps(steps)
        .set("checkpoint.every", 1)
        .sets(sets.split_whitespace())
        .store(store)
}

/// The newest step rank 0 logged, read incrementally from its metrics file.
struct Progress {
    path: PathBuf,
    offset: u64,
    newest: u64,
}

impl Progress {
    fn new(dir: &Path, run: &str) -> Self {
        Self {
            path: dir.join("metrics").join(run).join("metrics.jsonl"),
            offset: 0,
            newest: 0,
        }
    }

    /// The step of the last complete line: after a restore, the steps recomputed count again.
    fn newest(&mut self) -> u64 {
        let Ok(mut file) = std::fs::File::open(&self.path) else {
            return self.newest;
        };
        if file.seek(SeekFrom::Start(self.offset)).is_err() {
            return self.newest;
        }
        let mut text = String::new();
        if file.read_to_string(&mut text).is_err() {
            return self.newest;
        }
        let Some(end) = text.rfind('\n') else {
            return self.newest;
        };
        for line in text[..end].lines() {
            if let Some(step) = serde_json::from_str::<serde_json::Value>(line)
                .ok()
                .and_then(|v| v["step"].as_u64())
            {
                self.newest = step;
            }
        }
        self.offset += end as u64 + 1;
        self.newest
    }
}

/// What the leader said before a fault.
#[derive(Clone, Debug, Default)]
struct Seen {
    leader: usize,
    epoch: u64,
    generation: u64,
    /// (rank, pid, node index) of the running world.
    ranks: Vec<(u64, u32, usize)>,
    active: Vec<usize>,
}

fn node_index(name: &str) -> Option<usize> {
    name.strip_prefix('n')?
        .parse::<usize>()
        .ok()?
        .checked_sub(1)
}

/// What a fault must cause: a relaunch of the world, a new leader (`None`: it may or may not).
#[derive(Clone, Copy, Debug, Default)]
struct Expect {
    relaunch: Option<bool>,
    takeover: Option<bool>,
}

impl Expect {
    const NOTHING: Expect = Expect {
        relaunch: Some(false),
        takeover: Some(false),
    };
    const RELAUNCH: Expect = Expect {
        relaunch: Some(true),
        takeover: Some(false),
    };

    /// A relaunch when `active`, else nothing.
    fn relaunch_if(active: bool) -> Self {
        Expect {
            relaunch: Some(active),
            takeover: Some(false),
        }
    }

    /// A new leader, and a relaunch when its node trained (its ranks lost their daemon).
    fn takeover(relaunch: Option<bool>) -> Self {
        Expect {
            relaunch,
            takeover: Some(true),
        }
    }

    /// After a leader silent for `seconds`: a new leader if that is past [`TAKEOVER_AFTER_S`],
    /// else either.
    fn takeover_after(seconds: f64, relaunch: Option<bool>) -> Self {
        Expect {
            relaunch,
            takeover: (seconds >= TAKEOVER_AFTER_S).then_some(true),
        }
    }
}

/// One injected fault and its window.
#[derive(Clone, Debug)]
struct Fault {
    kind: Kind,
    detail: String,
    expect: Expect,
    start_ms: u64,
    end_ms: u64,
    step: u64,
    lost_s: f64,
    relaunches: u64,
    takeovers: u64,
    /// The epochs whose leaders began in the window.
    epochs: Vec<u64>,
    restores: [u64; 3],
}

impl Fault {
    /// A relaunch or a takeover the fault should have caused and did not, within its window.
    fn missed(&self) -> bool {
        (self.expect.relaunch == Some(true) && self.relaunches == 0)
            || (self.expect.takeover == Some(true) && self.takeovers == 0)
    }

    /// A relaunch or a takeover in the fault's window that it should not have caused.
    fn unasked(&self) -> bool {
        (self.expect.relaunch == Some(false) && self.relaunches > 0)
            || (self.expect.takeover == Some(false) && self.takeovers > 0)
    }
}

/// One round's cluster and what the round keeps track of.
struct Round<'a> {
    number: usize,
    dir: PathBuf,
    run: String,
    steps: u64,
    cluster: Cluster,
    ctl: Ctl,
    s3: &'a S3Server,
    progress: Progress,
    step_seconds: f64,
    /// Daemons to start again (their node's slurmd first, when true), and when.
    repairs: Vec<(usize, Instant, bool)>,
    /// The local Slurm cluster's configuration when the leader launches with srun.
    slurm: Option<PathBuf>,
    /// Ranks stopped by a hang fault, continued once the window settles.
    stopped: Vec<u32>,
}

impl Round<'_> {
    fn status(&self) -> serde_json::Value {
        let key = self.cluster.key_file.display().to_string();
        let args = [
            "--json",
            "status",
            "--leader",
            &self.cluster.leader(),
            "--key-file",
            &key,
            "--run",
            &self.run,
        ];
        self.ctl
            .run_within(&args, Duration::from_secs(5))
            .filter(|o| o.status.success())
            .and_then(|o| serde_json::from_slice(&o.stdout).ok())
            .unwrap_or_default()
    }

    /// The leader's view once it answers with a whole world and every daemon runs; None
    /// once the run is in its last steps.
    fn seen(&mut self) -> Option<Seen> {
        let deadline = Instant::now() + SETTLE_WITHIN;
        loop {
            self.repair(true);
            if self.progress.newest() + QUIET_END_STEPS >= self.steps {
                return None;
            }
            let status = self.status();
            let ranks: Vec<(u64, u32, usize)> = status["runs"][0]["ranks"]
                .as_array()
                .map(|ranks| {
                    ranks
                        .iter()
                        .filter_map(|r| {
                            Some((
                                r["rank"].as_u64()?,
                                r["pid"].as_u64()? as u32,
                                node_index(r["node"].as_str()?)?,
                            ))
                        })
                        .collect()
                })
                .unwrap_or_default();
            let leader = status["leader"].as_str().and_then(node_index);
            let all_up = (0..NODES).all(|i| self.cluster.pid(i).is_some()) && self.in_service();
            if let (Some(leader), true, true) = (leader, ranks.len() == ACTIVE, all_up) {
                let active = status["supervision"]["active"]
                    .as_array()
                    .map(|a| {
                        a.iter()
                            .filter_map(|n| n.as_str().and_then(node_index))
                            .collect()
                    })
                    .unwrap_or_default();
                return Some(Seen {
                    leader,
                    epoch: status["epoch"].as_u64().unwrap_or(0),
                    generation: status["supervision"]["generation"].as_u64().unwrap_or(0),
                    ranks,
                    active,
                });
            }
            assert!(
                Instant::now() < deadline,
                "the leader never showed a whole world: {status}"
            );
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    /// Starts the daemons whose repair is due (all of them when `now`), and their slurmd
    /// first where the node was lost whole.
    fn repair(&mut self, now: bool) {
        let due: Vec<(usize, bool)> = self
            .repairs
            .iter()
            .filter(|(_, at, _)| now || Instant::now() >= *at)
            .map(|(i, _, slurmd)| (*i, *slurmd))
            .collect();
        self.repairs
            .retain(|(i, _, _)| !due.iter().any(|(d, _)| d == i));
        for (i, slurmd) in due {
            if let (Some(conf), true) = (&self.slurm, slurmd) {
                assert!(slurm::start_slurmd(conf, &format!("n{}", i + 1)));
            }
            self.cluster.start_node(i);
        }
    }

    /// Under Slurm, whether every node takes jobs. The operator's part: a node the leader
    /// drained, or whose slurmd came back, is resumed once its daemon runs.
    fn in_service(&self) -> bool {
        let Some(conf) = &self.slurm else {
            return true;
        };
        let mut all = true;
        for i in 0..NODES {
            let node = format!("n{}", i + 1);
            if !slurm::in_service(conf, &node) {
                all = false;
                if self.cluster.pid(i).is_some() {
                    slurm::resume(conf, &node);
                }
            }
        }
        all
    }

    /// Sleeps `seconds` while repairs come due.
    fn pause(&mut self, seconds: f64) {
        let end = Instant::now() + Duration::from_secs_f64(seconds);
        while Instant::now() < end {
            self.repair(false);
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn relays(&self) -> &lazarus_tests::relay::Relays {
        self.cluster.relays.as_ref().expect("relayed")
    }

    fn others(i: usize) -> Vec<usize> {
        (0..NODES).filter(|j| *j != i).collect()
    }

    /// Injects `kind` and heals it; what was done and what it must cause.
    fn inject(&mut self, kind: Kind, seen: &Seen, rng: &mut StdRng) -> (String, Expect) {
        let rank = seen.ranks[rng.random_range(0..seen.ranks.len())];
        let follower = {
            let followers: Vec<usize> = (0..NODES).filter(|i| *i != seen.leader).collect();
            followers[rng.random_range(0..followers.len())]
        };
        let name = |i: usize| format!("n{}", i + 1);
        match kind {
            Kind::KillRank => {
                kill("KILL", rank.1);
                (
                    format!("rank {} on {}", rank.0, name(rank.2)),
                    Expect::RELAUNCH,
                )
            }
            Kind::HangRank => {
                kill("STOP", rank.1);
                self.stopped.push(rank.1);
                (
                    format!("rank {} on {}", rank.0, name(rank.2)),
                    Expect::RELAUNCH,
                )
            }
            Kind::PauseRank => {
                let seconds = rng.random_range(0.2..1.0);
                kill("STOP", rank.1);
                self.pause(seconds);
                kill("CONT", rank.1);
                (
                    format!("rank {} for {seconds:.1} s", rank.0),
                    Expect::NOTHING,
                )
            }
            Kind::KillDaemon => {
                // Repaired after the heartbeat timeout: the node is lost first.
                let back = HEARTBEAT_TIMEOUT_S + rng.random_range(1.5..4.0);
                self.cluster.kill_node(follower);
                self.repairs.push((
                    follower,
                    Instant::now() + Duration::from_secs_f64(back),
                    false,
                ));
                let active = seen.active.contains(&follower);
                let role = if active { "training" } else { "spare" };
                (
                    format!("{} ({role}), back after {back:.1} s", name(follower)),
                    Expect::relaunch_if(active),
                )
            }
            Kind::PauseDaemon => {
                let node = rng.random_range(0..NODES);
                let seconds = rng.random_range(0.3..1.0);
                let pid = self.cluster.pid(node).unwrap();
                kill("STOP", pid);
                self.pause(seconds);
                kill("CONT", pid);
                (
                    format!("{} for {seconds:.1} s", name(node)),
                    Expect::NOTHING,
                )
            }
            Kind::KillLeader => {
                // Back after a successor took over, which it then follows.
                let back = HEARTBEAT_TIMEOUT_S + rng.random_range(3.0..5.0);
                self.cluster.kill_node(seen.leader);
                self.repairs.push((
                    seen.leader,
                    Instant::now() + Duration::from_secs_f64(back),
                    false,
                ));
                (
                    format!(
                        "{} (epoch {}), back after {back:.1} s",
                        name(seen.leader),
                        seen.epoch
                    ),
                    // Its node's ranks, without their daemon, are restarted elsewhere, or
                    // found again when it is back in time: either may happen.
                    Expect::takeover(None),
                )
            }
            Kind::StopLeader => {
                let seconds = HEARTBEAT_TIMEOUT_S + rng.random_range(1.5..3.0);
                let pid = self.cluster.pid(seen.leader).unwrap();
                kill("STOP", pid);
                self.pause(seconds);
                kill("CONT", pid);
                (
                    format!(
                        "{} (epoch {}) for {seconds:.1} s",
                        name(seen.leader),
                        seen.epoch
                    ),
                    // Its node's ranks, without their daemon, are restarted elsewhere, or
                    // found again when it is back in time: either may happen.
                    Expect::takeover_after(seconds, None),
                )
            }
            Kind::StallStore => {
                let seconds = rng.random_range(0.5..4.0);
                kill("STOP", self.s3.pid());
                self.pause(seconds);
                kill("CONT", self.s3.pid());
                (format!("{seconds:.1} s"), Expect::NOTHING)
            }
            Kind::CutNode => {
                let seconds = HEARTBEAT_TIMEOUT_S + rng.random_range(1.0..2.5);
                self.relays().cut(follower, &Self::others(follower));
                self.pause(seconds);
                self.relays().heal();
                let active = seen.active.contains(&follower);
                let role = if active { "training" } else { "spare" };
                (
                    format!("{} ({role}) for {seconds:.1} s", name(follower)),
                    Expect::relaunch_if(active),
                )
            }
            Kind::CutLeader => {
                let seconds = HEARTBEAT_TIMEOUT_S + rng.random_range(1.5..3.0);
                self.relays().cut(seen.leader, &Self::others(seen.leader));
                self.pause(seconds);
                self.relays().heal();
                // Its ranks still train (their own traffic is not cut): the new leader adopts
                // the world or, with the old leader's node out of its reach, relaunches it.
                let relaunch = (!seen.active.contains(&seen.leader)).then_some(false);
                (
                    format!(
                        "{} (epoch {}) for {seconds:.1} s",
                        name(seen.leader),
                        seen.epoch
                    ),
                    Expect::takeover_after(seconds, relaunch),
                )
            }
            Kind::BriefCut => {
                let node = rng.random_range(0..NODES);
                let seconds = rng.random_range(0.3..1.0);
                self.relays().cut(node, &Self::others(node));
                self.pause(seconds);
                self.relays().heal();
                (
                    format!("{} for {seconds:.1} s", name(node)),
                    Expect::NOTHING,
                )
            }
            Kind::KillNode => {
                let conf = self
                    .slurm
                    .clone()
                    .expect("nodes are lost whole under Slurm only");
                let node = rng.random_range(0..NODES);
                let back = HEARTBEAT_TIMEOUT_S + rng.random_range(3.0..5.0);
                assert!(slurm::kill_slurmd(&conf, &name(node)));
                self.cluster.kill_node(node);
                for (_, pid, _) in seen.ranks.iter().filter(|(_, _, on)| *on == node) {
                    kill("KILL", pid);
                }
                self.repairs
                    .push((node, Instant::now() + Duration::from_secs_f64(back), true));
                let active = seen.active.contains(&node);
                let role = match (node == seen.leader, active) {
                    (true, true) => "leading, training",
                    (true, false) => "leading, spare",
                    (false, true) => "training",
                    (false, false) => "spare",
                };
                let expect = if node == seen.leader {
                    // Its ranks died with it: the successor relaunches the world.
                    Expect::takeover(Some(active))
                } else {
                    Expect::relaunch_if(active)
                };
                (
                    format!("{} ({role}), back after {back:.1} s", name(node)),
                    expect,
                )
            }
            Kind::Gc => {
                let started = Instant::now();
                let output = self.ctl.run_within(
                    &[
                        "gc",
                        &self.run,
                        "--keep-last",
                        "2",
                        "--grace",
                        "0s",
                        "--staging-grace",
                        "1h",
                    ],
                    Duration::from_secs(180),
                );
                let output = output.expect("gc ends within 180 s");
                assert!(output.status.success(), "gc: {}", text_of(&output));
                (
                    format!("took {:.1} s", started.elapsed().as_secs_f64()),
                    Expect::NOTHING,
                )
            }
        }
    }

    /// Waits until the world steps again past where it was, with what the fault must cause
    /// shown (a new generation, a new epoch); a cut also waits out the heartbeat timeout after
    /// its heal, in case it causes more. Then the window ends.
    /// True when the run reached its last step first: what the fault causes may come later.
    fn settle(&mut self, kind: Kind, fault_step: u64, expect: Expect, seen: &Seen) -> bool {
        let healed = Instant::now();
        let mut ended = self.settle_once(fault_step, expect, seen);
        // A cut off leader's successor adopts the world or relaunches it; a cut off node is
        // replaced once its silence passes the timeout.
        if matches!(kind, Kind::CutLeader | Kind::CutNode) && !ended {
            let linger = Duration::from_secs_f64(HEARTBEAT_TIMEOUT_S + 1.0);
            self.pause(linger.saturating_sub(healed.elapsed()).as_secs_f64());
            let step = self.progress.newest();
            ended = self.settle_once(step, Expect::default(), seen);
        }
        for pid in self.stopped.drain(..) {
            kill("CONT", pid);
        }
        ended
    }

    fn settle_once(&mut self, fault_step: u64, expect: Expect, seen: &Seen) -> bool {
        let healed_step = self.progress.newest();
        let target = (fault_step.max(healed_step) + 3).min(self.steps);
        let since = Instant::now();
        let deadline = since + SETTLE_WITHIN;
        loop {
            assert!(
                Instant::now() < deadline,
                "round {}: the run did not step past {target} within {} s",
                self.number,
                SETTLE_WITHIN.as_secs()
            );
            self.pause(0.1);
            let newest = self.progress.newest();
            if newest >= self.steps {
                return true;
            }
            if newest < target {
                continue;
            }
            let status = self.status();
            let generation = status["supervision"]["generation"].as_u64();
            let epoch = status["epoch"].as_u64();
            let (Some(generation), Some(epoch)) = (generation, epoch) else {
                continue;
            };
            let shown = (expect.relaunch != Some(true) || generation != seen.generation)
                && (expect.takeover != Some(true) || epoch != seen.epoch);
            if !shown && since.elapsed() < RECOVERY_SHOWS_WITHIN {
                continue;
            }
            let stepping = status["runs"][0]["ranks"].as_array().is_some_and(|ranks| {
                ranks.len() == ACTIVE
                    && ranks
                        .iter()
                        .all(|r| r["step"].as_u64().unwrap_or(0) + 1 >= target)
            });
            if stepping {
                return false;
            }
        }
    }

    /// The clean step time: seconds per step over `seconds` once the run is past step 10.
    fn measure_step_time(&mut self, seconds: f64) -> f64 {
        let deadline = Instant::now() + Duration::from_secs(300);
        while self.progress.newest() < 10 {
            assert!(Instant::now() < deadline, "the run never reached step 10");
            std::thread::sleep(Duration::from_millis(100));
        }
        let (start, at) = (self.progress.newest(), Instant::now());
        std::thread::sleep(Duration::from_secs_f64(seconds));
        let advanced = self.progress.newest().saturating_sub(start).max(1);
        at.elapsed().as_secs_f64() / advanced as f64
    }

    /// What a kept round's log holds: its faults with when each began and what it cost, the
    /// leader's timeline as `ckptctl events` prints it, then the last lines of every log under
    /// the round's directory.
    fn kept_logs(&self, faults: &[Fault]) -> String {
        let faults: Vec<String> = faults
            .iter()
            .map(|f| {
                let at = std::time::UNIX_EPOCH + Duration::from_millis(f.start_ms);
                format!(
                    "{} step {} {} {}: {:.2} s lost",
                    humantime::format_rfc3339_millis(at),
                    f.step,
                    f.kind.name(),
                    f.detail,
                    f.lost_s
                )
            })
            .collect();
        let events = self
            .ctl
            .run_within(&["events", &self.run], Duration::from_secs(30))
            .map_or_else(|| "(no answer within 30 s)".to_string(), |o| text_of(&o));
        format!(
            "--- faults ---\n{}\n--- ckptctl events {} ---\n{events}\n{}",
            faults.join("\n"),
            self.run,
            logs_under(&self.dir)
        )
    }

    fn events(&self) -> Vec<serde_json::Value> {
        let output = self
            .ctl
            .run_within(&["--json", "events", &self.run], Duration::from_secs(30));
        output
            .filter(|o| o.status.success())
            .and_then(|o| serde_json::from_slice::<serde_json::Value>(&o.stdout).ok())
            .and_then(|v| v.as_array().cloned())
            .unwrap_or_default()
    }
}

/// The ranks a `restored` event names per tier ("... from T0: ranks 0,1" or "... from T0:
/// ranks 1, T1: ranks 0").
fn restored_tiers(detail: &str) -> [u64; 3] {
    let mut tiers = [0u64; 3];
    let Some((_, named)) = detail.rsplit_once(" from ") else {
        return tiers;
    };
    for part in named.split(", T") {
        let Some((tier, ranks)) = part.trim_start_matches('T').split_once(": ranks ") else {
            continue;
        };
        if let Ok(tier @ 0..=2) = tier.parse::<usize>() {
            tiers[tier] += ranks
                .split(',')
                .filter(|r| r.trim().parse::<u64>().is_ok())
                .count() as u64;
        }
    }
    tiers
}

/// What a round found.
#[derive(Debug, Default)]
struct RoundReport {
    faults: Vec<Fault>,
    unattributed: Vec<String>,
    /// When each leader began (`elected` or `adopted` in the timeline), and its epoch: the
    /// round's summary places those near a fault that missed its takeover.
    leaders: Vec<(u64, u64)>,
    loss_lines: usize,
    committed: usize,
    stale_refused: f64,
    step_seconds: f64,
    failure: Option<String>,
}

/// One round: a supervised run with faults until it ends, then its checks.
#[allow(clippy::too_many_arguments)]
fn round(
    number: usize,
    root: &Path,
    s3: &S3Server,
    steps: u64,
    reference: &BTreeMap<u64, String>,
    rng: &mut StdRng,
    budget: usize,
    injected_before: usize,
    total: usize,
    slurm: Option<&Path>,
    only: &[Kind],
    report: &mut RoundReport,
) {
    let test_dir = test_dir_within(Duration::from_secs(3 * 3600));
    let dir = test_dir.path().to_path_buf();
    std::os::unix::fs::symlink(root.join("data"), dir.join("data")).unwrap();
    let run = format!("soak-{number}");
    let store = s3.url(&format!("round-{number}"));
    let args = trainer_args(&dir, &run, steps, &store).build();
    let (hang, heartbeat) = (HANG_TIMEOUT_S.to_string(), HEARTBEAT_TIMEOUT_S.to_string());
    let flags = [
        "--supervise",
        if slurm.is_some() { "srun" } else { "mpiexec" },
        "--active-nodes",
        "2",
        "--hang-timeout-seconds",
        &hang,
        "--heartbeat-timeout-seconds",
        &heartbeat,
    ];
    let daemons = Daemons {
        candidates: NODES - 1,
        relayed: true,
    };
    let mut envs = s3.envs();
    if let Some(conf) = slurm {
        envs.push(("SLURM_CONF".to_string(), conf.display().to_string()));
    }
    let (cluster, ctl) = supervised_by(&store, &dir, &run, NODES, daemons, &flags, &args, envs);
    let mut round = Round {
        number,
        progress: Progress::new(&dir, &run),
        dir: dir.clone(),
        run: run.clone(),
        steps,
        cluster,
        ctl,
        s3,
        step_seconds: 0.0,
        repairs: Vec::new(),
        slurm: slurm.map(Path::to_path_buf),
        stopped: Vec::new(),
    };
    let outcome = std::panic::catch_unwind(AssertUnwindSafe(|| {
        round.step_seconds = round.measure_step_time(5.0);
        report.step_seconds = round.step_seconds;
        while report.faults.len() < budget {
            round.pause(rng.random_range(0.1..0.8));
            let Some(seen) = round.seen() else {
                break;
            };
            let kind = Kind::pick(rng, round.slurm.is_some(), only);
            let (start_ms, start, step) = (now_ms(), Instant::now(), round.progress.newest());
            let (detail, expect) = round.inject(kind, &seen, rng);
            let ended = round.settle(kind, step, expect, &seen);
            let after = round.progress.newest();
            let elapsed = start.elapsed().as_secs_f64();
            let lost_s =
                (elapsed - after.saturating_sub(step) as f64 * round.step_seconds).max(0.0);
            let fault = Fault {
                kind,
                detail,
                expect,
                start_ms,
                // The run's end came first: the window stays open to the round's end.
                end_ms: if ended { u64::MAX } else { now_ms() },
                step,
                lost_s,
                relaunches: 0,
                takeovers: 0,
                epochs: Vec::new(),
                restores: [0; 3],
            };
            println!(
                "[{:>4}/{total}] round {number} step {:>5}  {:<20} {:<44} {:>6.2} s",
                injected_before + report.faults.len() + 1,
                fault.step,
                kind.name(),
                fault.detail,
                fault.lost_s
            );
            // A fault whose settling saw the run's last step left its window open; the run
            // went on (a relaunch from an earlier step), so that window ends here.
            if let Some(before) = report.faults.last_mut() {
                before.end_ms = before.end_ms.min(fault.start_ms);
            }
            report.faults.push(fault);
        }
        round.repair(true);
        // The run ends: the leader records it.
        let deadline = Instant::now() + Duration::from_secs(600);
        loop {
            let events = round.events();
            if events.iter().any(|e| e["kind"] == "completed") {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "round {number}: the run did not complete (rank 0 logged step {})",
                round.progress.newest()
            );
            std::thread::sleep(Duration::from_secs(1));
        }
        check(&mut round, reference, report);
    }));
    if let Err(panic) = outcome {
        let why = panic
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
            .unwrap_or_else(|| "a panic".into());
        report.failure = Some(why);
    }
    let logs = std::env::temp_dir().join(format!("lazarus-soak-round-{number}.log"));
    if report.failure.is_some() {
        let _ = std::fs::write(&logs, round.kept_logs(&report.faults));
        println!(
            "round {number} FAILED: {}\n  its logs: {}",
            report.failure.as_deref().unwrap_or_default(),
            logs.display()
        );
    } else if report.loss_lines as u64 > steps + RECOMPUTED_TO_KEEP_LOGS {
        // Many steps trained twice: a recovery went back further than a fault should take
        // it. The round passed, but its logs say why.
        let _ = std::fs::write(&logs, round.kept_logs(&report.faults));
        println!(
            "round {number}: {} steps trained again; its logs: {}",
            report.loss_lines as u64 - steps,
            logs.display()
        );
    }
    for pid in round.stopped.drain(..) {
        kill("CONT", pid);
    }
    kill("CONT", s3.pid());
    drop(round);
    kill_processes_naming(&dir);
    let _ = std::fs::remove_dir_all(s3.root.path().join("ckpt").join(format!("round-{number}")));
}

/// The round's end: what every fault caused (from the leader's timeline), and the checks.
fn check(round: &mut Round, reference: &BTreeMap<u64, String>, report: &mut RoundReport) {
    let timeline = round.events();
    let first_fault_ms = report.faults.first().map_or(u64::MAX, |f| f.start_ms);
    for event in &timeline {
        let at = event["unix_ms"].as_u64().unwrap_or(0);
        let kind = event["kind"].as_str().unwrap_or_default();
        if !["relaunch", "elected", "restored", "fault", "adopted"].contains(&kind) {
            continue;
        }
        let epoch = event["epoch"].as_u64().unwrap_or(0);
        if kind == "elected" || kind == "adopted" {
            report.leaders.push((at, epoch));
        }
        let window = report
            .faults
            .iter_mut()
            .find(|f| f.start_ms <= at && at <= f.end_ms);
        match window {
            Some(fault) => match kind {
                "relaunch" => fault.relaunches += 1,
                // A new leader: elected after a takeover, or a restarted one adopting the
                // world; one per epoch.
                "elected" | "adopted" if !fault.epochs.contains(&epoch) => {
                    fault.epochs.push(epoch);
                    fault.takeovers += 1;
                }
                "restored" => {
                    let tiers = restored_tiers(event["detail"].as_str().unwrap_or_default());
                    for (t, n) in tiers.iter().enumerate() {
                        fault.restores[t] += n;
                    }
                }
                _ => {}
            },
            // The run's first launch and restore come before any fault.
            None if at < first_fault_ms => {}
            None if kind == "fault" || kind == "relaunch" || kind == "elected" => report
                .unattributed
                .push(format!("{kind}: {}", event["detail"])),
            None => {}
        }
    }
    // Every committed step reads back whole and matches its hashes.
    let verified = round
        .ctl
        .run_within(
            &["verify", &round.run, "--all", "--read-data"],
            Duration::from_secs(600),
        )
        .expect("verify ends within 600 s");
    assert!(verified.status.success(), "verify: {}", text_of(&verified));
    let committed = round.ctl.committed(&round.run);
    assert!(
        committed.contains(&round.steps),
        "the last step is not committed: {committed:?}"
    );
    report.committed = committed.len();
    // Every loss logged, the recomputed steps after each restore included, is the reference's.
    let metrics = std::fs::read_to_string(
        round
            .dir
            .join("metrics")
            .join(&round.run)
            .join("metrics.jsonl"),
    )
    .unwrap();
    for line in metrics.lines() {
        let value: serde_json::Value = serde_json::from_str(line).unwrap();
        let step = value["step"].as_u64().unwrap();
        assert_eq!(
            Some(&value["loss"].to_string()),
            reference.get(&step),
            "step {step}'s loss differs from the uninterrupted run's"
        );
        report.loss_lines += 1;
    }
    assert!(report.loss_lines as u64 >= round.steps);
    // No commit of an older epoch after one of a newer epoch.
    let commits = round
        .s3
        .root
        .path()
        .join("ckpt")
        .join(format!("round-{}", round.number))
        .join("runs")
        .join(&round.run)
        .join("commits");
    let epochs = commit_epochs(&commits);
    let order: Vec<Option<u64>> = epochs.values().copied().collect();
    assert!(
        order.windows(2).all(|w| w[0] <= w[1]),
        "a commit of an older epoch after a newer one: {epochs:?}"
    );
    report.stale_refused = (0..NODES)
        .filter_map(|i| {
            round.cluster.try_metric(
                i,
                "lazarus_ckptd_peer_messages_rejected_total{cause=\"stale_epoch\"}",
            )
        })
        .sum();
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

fn main() {
    let total: usize = env_or("LAZARUS_SOAK_FAULTS", 1000);
    let steps: u64 = env_or("LAZARUS_SOAK_STEPS", 2000);
    let seed: u64 = env_or("LAZARUS_SOAK_SEED", rand::random::<u64>() % 1_000_000);
    let launcher: String = env_or("LAZARUS_SOAK_LAUNCHER", "mpiexec".to_string());
    let slurm = match launcher.as_str() {
        "mpiexec" => None,
        "srun" => Some(lazarus_tests::slurm_cluster().unwrap_or_else(|why| {
            panic!("the soak under srun needs the local Slurm cluster: {why}")
        })),
        other => panic!("LAZARUS_SOAK_LAUNCHER is mpiexec or srun, not {other}"),
    };
    // LAZARUS_SOAK_ONLY=KillNode,CutLeader: only these kinds (as the enum names them).
    let only: Vec<Kind> = env_or("LAZARUS_SOAK_ONLY", String::new())
        .split(',')
        .filter(|name| !name.is_empty())
        .map(|name| {
            KINDS
                .iter()
                .map(|(kind, _)| *kind)
                .find(|kind| format!("{kind:?}") == name.trim())
                .unwrap_or_else(|| panic!("LAZARUS_SOAK_ONLY: no fault kind {name}"))
        })
        .collect();
    assert!(
        slurm.is_some() || only.is_empty() || only.iter().any(|k| *k != Kind::KillNode),
        "LAZARUS_SOAK_ONLY=KillNode needs LAZARUS_SOAK_LAUNCHER=srun"
    );
    println!(
        "soak: {total} faults over rounds of {steps} steps under {launcher}; seed {seed} (LAZARUS_SOAK_SEED replays the schedule)"
    );
    let began = Instant::now();
    let mut rng = StdRng::seed_from_u64(seed);
    let root = tempfile::tempdir().unwrap();
    let root = root.path();
    lazarus_tests::train::prepare_data(root);
    let reference_store = format!("file://{}", root.join("reference-store").display());
    let reference = reference_run(
        root,
        ACTIVE,
        &trainer_args(root, "reference", steps, &reference_store)
            .set("checkpoint.every", 1_000_000)
            .build(),
    );
    assert_eq!(reference.len() as u64, steps);
    println!(
        "reference: {steps} steps uninterrupted in {:.0} s",
        began.elapsed().as_secs_f64()
    );
    let s3 = S3Server::start();
    let mut rounds: Vec<RoundReport> = Vec::new();
    let mut injected = 0;
    while injected < total {
        let number = rounds.len() + 1;
        let mut report = RoundReport::default();
        let started = Instant::now();
        round(
            number,
            root,
            &s3,
            steps,
            &reference,
            &mut rng,
            total - injected,
            injected,
            total,
            slurm.as_deref(),
            &only,
            &mut report,
        );
        injected += report.faults.len();
        println!(
            "round {number}: {} faults in {:.0} s (clean step {:.0} ms); {}",
            report.faults.len(),
            started.elapsed().as_secs_f64(),
            report.step_seconds * 1e3,
            match &report.failure {
                None => format!(
                    "completed; {} committed steps verified with their data; {} logged losses equal the uninterrupted run's; commit epochs in order; {} stale-epoch orders refused; {} recoveries outside any fault's window",
                    report.committed,
                    report.loss_lines,
                    report.stale_refused,
                    report.unattributed.len()
                ),
                Some(why) => format!("FAILED: {why}"),
            }
        );
        for line in &report.unattributed {
            println!("  outside a window: {line}");
        }
        for fault in report.faults.iter().filter(|f| f.missed() || f.unasked()) {
            // The first leader to begin after the fault started, if any, and when.
            let next_leader = report
                .leaders
                .iter()
                .find(|(at, _)| *at >= fault.start_ms)
                .map_or("no leader began after it".to_string(), |(at, epoch)| {
                    format!(
                        "the next leader (epoch {epoch}) began {:.2} s after it started, its window {}",
                        (at - fault.start_ms) as f64 / 1e3,
                        if fault.end_ms == u64::MAX {
                            "open to the round's end".to_string()
                        } else {
                            format!("{:.2} s long", (fault.end_ms - fault.start_ms) as f64 / 1e3)
                        }
                    )
                });
            println!(
                "  {} at step {}: {} {}: expected {:?}, saw {} relaunches and {} takeovers; {next_leader}",
                if fault.missed() { "missed" } else { "unasked" },
                fault.step,
                fault.kind.name(),
                fault.detail,
                fault.expect,
                fault.relaunches,
                fault.takeovers,
            );
        }
        let failed = report.failure.is_some();
        rounds.push(report);
        if failed && rounds.iter().filter(|r| r.failure.is_some()).count() >= 3 {
            println!("three rounds failed: the soak stops");
            break;
        }
    }
    summary(&rounds, began.elapsed());
    drop(s3);
    if rounds.iter().any(|r| r.failure.is_some()) {
        std::process::exit(1);
    }
}

fn summary(rounds: &[RoundReport], wall: Duration) {
    let faults: Vec<&Fault> = rounds.iter().flat_map(|r| &r.faults).collect();
    println!();
    println!(
        "{:<20} {:>8} {:>10} {:>9} {:>16} {:>8} {:>10} {:>9} {:>9} {:>9} {:>9}",
        "fault",
        "injected",
        "relaunches",
        "takeovers",
        "restores T0/T1/T2",
        "missing",
        "unexpected",
        "lost mean",
        "lost p50",
        "lost max",
        "lost sum"
    );
    let mut rows: BTreeMap<Kind, Vec<&Fault>> = BTreeMap::new();
    for fault in &faults {
        rows.entry(fault.kind).or_default().push(fault);
    }
    let mut all: Vec<(&str, Vec<&Fault>)> = rows.into_iter().map(|(k, f)| (k.name(), f)).collect();
    all.push(("all", faults.clone()));
    for (name, group) in all {
        let relaunches: u64 = group.iter().map(|f| f.relaunches).sum();
        let takeovers: u64 = group.iter().map(|f| f.takeovers).sum();
        let tiers: Vec<u64> = (0..3)
            .map(|t| group.iter().map(|f| f.restores[t]).sum())
            .collect();
        let missing = group.iter().filter(|f| f.missed()).count();
        let unexpected = group.iter().filter(|f| f.unasked()).count();
        let mut lost: Vec<f64> = group.iter().map(|f| f.lost_s).collect();
        lost.sort_by(f64::total_cmp);
        let sum: f64 = lost.iter().sum();
        println!(
            "{:<20} {:>8} {:>10} {:>9} {:>16} {:>8} {:>10} {:>9.2} {:>9.2} {:>9.2} {:>9.0}",
            name,
            group.len(),
            relaunches,
            takeovers,
            format!("{}/{}/{}", tiers[0], tiers[1], tiers[2]),
            missing,
            unexpected,
            sum / lost.len().max(1) as f64,
            percentile(&lost, 0.5),
            percentile(&lost, 1.0),
            sum
        );
    }
    let failed = rounds.iter().filter(|r| r.failure.is_some()).count();
    println!();
    println!(
        "{} rounds ({failed} failed), {} faults in {:.0} min; {} committed steps verified with their data, {} logged losses bit-identical to the uninterrupted run; {} stale-epoch orders refused",
        rounds.len(),
        faults.len(),
        wall.as_secs_f64() / 60.0,
        rounds.iter().map(|r| r.committed).sum::<usize>(),
        rounds.iter().map(|r| r.loss_lines).sum::<usize>(),
        rounds.iter().map(|r| r.stale_refused).sum::<f64>()
    );
}
