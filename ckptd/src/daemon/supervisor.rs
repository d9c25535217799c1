//! The supervising leader (DESIGN.md section 4): launches the training world, watches it,
//! and on a failure stops it, replaces what failed, and relaunches it. The ranks then restore
//! through their daemons (T0, T1 or T2) as on any restart.
//!
//! Failures and how they are seen:
//! - a crashed rank: its Unix connection to its daemon ends without a `Bye` (reported at
//!   once), or the launcher exits non-zero;
//! - a lost node: its daemon's link to the leader is gone or silent for
//!   `heartbeat_timeout_seconds`; it is replaced by a hot spare (a connected, idle node);
//! - a hung world: no rank's step moved for `hang_timeout_seconds` (before the world's first
//!   step, `startup_timeout_seconds`).
//!
//! Every phase is an event with a timestamp (`ckptctl events RUN`).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::process::{Child, Command};

use lazarus_shared::{wire, Rank};

use super::config::{Launcher, NoSpare, Supervision};
use super::leader::{Leader, NodeView};
use super::Daemon;

const TICK: Duration = Duration::from_millis(50);

/// Why the world stopped.
#[derive(Debug)]
enum Outcome {
    Completed,
    /// A newer leader took over: this one leaves the world alone.
    Deposed,
    /// SIGUSR1: the ranks checkpointed and exited.
    Preempted,
    Fault {
        kind: &'static str,
        detail: String,
        lost_node: Option<String>,
    },
    /// The trainer refused its configuration or data (exit 2): a relaunch would too.
    RefusedInput(String),
    /// A rank's health check failed: the world is rolled back past the data that did it.
    Unhealthy {
        rank: Rank,
        bad: wire::BadStep,
    },
}

/// How supervision ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Ending {
    Completed,
    Preempted,
    /// Another daemon leads now.
    Deposed,
    /// The world is not relaunched: the trainer refused its input, or the world failed at the
    /// same step again and again (event `failed`).
    Failed,
}

/// The trainer's exit code for a configuration or data error (`trainer/src/cli.rs`); the
/// launchers pass it on.
const BAD_INPUT_EXIT: i32 = 2;

/// What a leader that starts with the run's timeline already written finds.
#[derive(Debug)]
enum Found {
    /// Every rank of the world is registered and alive: it keeps running.
    World(Vec<String>),
    /// Some ranks came back, not all: that world is stopped.
    Partial(String),
    Nothing,
}

/// Supervises the world while this daemon leads (`took_over`: after another leader was
/// lost, whose world may still run).
pub async fn supervise(
    daemon: Arc<Daemon>,
    leader: Arc<Leader>,
    plan: Supervision,
    took_over: bool,
) -> Ending {
    let run = daemon.cfg.run.as_str();
    let history = leader.stored_events().await;
    // The last world's nodes in rank order: a successor keeps each rank on its node, and a
    // spare takes a lost node's place.
    let previous: Vec<String> = history
        .iter()
        .rev()
        .find(|e| !e.nodes.is_empty())
        .map(|e| e.nodes.clone())
        .unwrap_or_default();
    let mut generation = history.iter().map(|e| e.generation).max().unwrap_or(0);
    // Nodes drained by an earlier leader stay out until Slurm says they are back.
    let mut drained: Vec<String> = history
        .iter()
        .filter(|e| e.kind == "drained")
        .filter_map(|e| e.detail.split_whitespace().next().map(String::from))
        .collect();
    drained.dedup();
    // The lost leader saw the run complete (it died before its nodes heard): nothing is left
    // to supervise.
    if took_over && history.last().is_some_and(|e| e.kind == "completed") {
        return Ending::Completed;
    }
    let mut target = plan.active_nodes;
    let mut active: Vec<String> = Vec::new();
    let mut adopted = None;
    // The step the world had reached at its last faults, and how many in a row there.
    let mut repeated: (Option<u64>, u32) = (None, 0);
    // The step the world had reached when this leader last rolled it back.
    let mut rolled_back_at: Option<u64> = None;
    if !history.is_empty() {
        // A restarted leader (or a requeued job): a world may still be running.
        match adopt(&leader, &plan, took_over).await {
            Found::World(mut nodes) => {
                let mut sorted = (nodes.clone(), previous.clone());
                sorted.0.sort();
                sorted.1.sort();
                if sorted.0 == sorted.1 {
                    nodes = previous.clone();
                }
                adopted = Some(nodes)
            }
            Found::Partial(detail) => {
                leader.record(generation, "fault", detail).await;
                stop_world(&leader, None, &plan, run, generation).await;
                leader.forget_ranks().await;
                generation += 1;
                active = previous.clone();
            }
            Found::Nothing => {
                // Ranks it heard of and that went (done, or reported late) are not the next
                // world's: a death left in the books would stop that world once it runs.
                leader.forget_ranks().await;
                generation += 1;
                active = previous.clone();
            }
        }
    }
    loop {
        if leader.deposed() {
            return Ending::Deposed;
        }
        let mut child = None;
        if let Some(nodes) = adopted.take() {
            active = nodes;
            // The nodes replicate in the world's ring again: a node whose daemon restarted
            // while no leader was there came back with its configured buddy, which may be
            // outside the world (found by the soak: its buddy, a spare, was lost, and no step
            // was committed again until the world hung and was relaunched).
            leader.pair(&active).await;
            leader.set_supervision(generation, &active, &drained).await;
            leader
                .record_world(
                    generation,
                    "adopted",
                    format!(
                        "the world on {} kept running; this leader (epoch {}{}) supervises it",
                        active.join(","),
                        leader.epoch(),
                        if took_over { ", after a takeover" } else { "" }
                    ),
                    &active,
                )
                .await;
        } else {
            let Some(nodes) =
                wait_for_nodes(&leader, &plan, &mut target, active, &drained, generation).await
            else {
                if leader.deposed() {
                    return Ending::Deposed;
                }
                let detail = finish(&leader).await;
                leader.record(generation, "preempted", detail).await;
                return Ending::Preempted;
            };
            active = nodes;
            leader.pair(&active).await;
            leader.set_supervision(generation, &active, &drained).await;
            let (_, nodes) = leader.view().await;
            match launch(&daemon, &plan, &active, &nodes) {
                Ok(launched) => child = Some(launched),
                Err(error) => {
                    leader
                        .record(generation, "launch_failed", format!("{error:#}"))
                        .await;
                    tokio::time::sleep(Duration::from_secs(5)).await;
                    continue;
                }
            }
            leader
                .record_world(
                    generation,
                    if generation == 0 {
                        "launch"
                    } else {
                        "relaunch"
                    },
                    format!(
                        "{} on {} (launcher pid {})",
                        match plan.launcher {
                            Launcher::Mpiexec => "mpiexec",
                            Launcher::Srun => "srun",
                        },
                        active.join(","),
                        child.as_ref().and_then(Child::id).unwrap_or(0)
                    ),
                    &active,
                )
                .await;
        }
        let outcome = watch(&leader, child.as_mut(), &plan, &active, generation).await;
        match outcome {
            Outcome::RefusedInput(detail) => {
                leader.count_fault();
                stop(&leader, child.as_mut(), &plan, run).await;
                return give_up(&daemon, &leader, generation, detail).await;
            }
            Outcome::Deposed => {
                // The world (and its launcher, not killed on drop) is the new leader's now.
                return Ending::Deposed;
            }
            Outcome::Unhealthy { rank, bad } => {
                daemon.metrics.unhealthy.inc();
                // The suspect's node, while the world's ranks are still known.
                let (ranks, _) = leader.view().await;
                let suspect = bad.sdc.as_ref().and_then(|sdc| sdc.suspect).and_then(|s| {
                    ranks
                        .iter()
                        .find(|r| r.rank == s)
                        .map(|r| (s, r.node.clone()))
                });
                let kind = if bad.sdc.is_some() {
                    daemon.metrics.sdc_mismatches.inc();
                    "sdc_mismatch"
                } else if bad.restored.is_some() {
                    "restore_mismatch"
                } else {
                    "unhealthy"
                };
                leader
                    .record(
                        generation,
                        kind,
                        format!("rank {rank} at step {}: {}", bad.step, bad.reason),
                    )
                    .await;
                stop_world(&leader, child.as_mut(), &plan, run, generation).await;
                repeated = repeat_count(repeated, false, bad.step);
                if let Some((suspect, node)) = &suspect {
                    // Its memory or its processor changed a weight: it trains no more in this
                    // run, and a spare takes its place.
                    let slurm =
                        drain(&plan, node, "lazarus: silent data corruption suspected").await;
                    drained.push(node.clone());
                    leader
                        .record(
                            generation,
                            "drained",
                            format!(
                                "{node} suspected of silent data corruption (rank {suspect}'s copy differed at step {}): it stays out of the world{}",
                                bad.step,
                                if slurm { ", drained in Slurm" } else { " for the rest of the job" }
                            ),
                        )
                        .await;
                }
                let verdict = if repeated.1 >= plan.same_step_failures {
                    Err(format!(
                        "the world went bad at step {} {} times in a row (same_step_failures = {}), rolled back each time, so it is not relaunched; find the cause in the ranks' output, then roll back further or fix and resubmit",
                        bad.step, repeated.1, plan.same_step_failures
                    ))
                } else {
                    // Silent data corruption: back to the newest state every copy agreed on.
                    // A restored state that does not repeat its first step: an older one.
                    // A bad step otherwise: rollback_steps before it, past its data.
                    let before = match (&bad.sdc, bad.restored) {
                        (Some(sdc), _) => sdc.agreed_step + 1,
                        (None, Some(restored)) => restored,
                        (None, None) => bad.step.saturating_sub(plan.rollback_steps),
                    };
                    leader
                        .roll_back(
                            before,
                            &format!("rank {rank} went bad at step {}: {}", bad.step, bad.reason),
                        )
                        .await
                        .map_err(|error| format!("it cannot be rolled back ({error:#}), so it is not relaunched; find the cause in the ranks' output, then roll back or fix and resubmit"))
                };
                let to = match verdict {
                    Ok(to) => to,
                    Err(why) => return give_up(&daemon, &leader, generation, why).await,
                };
                let after_step = to.map_or(0, |key| key.step);
                let target = match to {
                    Some(key) => format!("durable step {key}, the newest"),
                    None => "a fresh start, the run having no durable step".into(),
                };
                if let Some(sdc) = &bad.sdc {
                    leader
                        .record(
                            generation,
                            "rolled_back",
                            format!(
                                "to {target} at or before step {}, the newest whose replicated weights agreed",
                                sdc.agreed_step
                            ),
                        )
                        .await;
                } else if let Some(restored) = bad.restored {
                    leader
                        .record(
                            generation,
                            "rolled_back",
                            format!(
                                "to {target} older than step {restored}, the restored step whose first step did not repeat its loss"
                            ),
                        )
                        .await;
                } else {
                    leader.forget_losses_after(after_step).await;
                    let batches = plan.skip_batches.max(bad.step - after_step);
                    leader
                        .set_skip(wire::DataSkip {
                            after_step,
                            batches,
                        })
                        .await;
                    leader
                        .record(
                            generation,
                            "rolled_back",
                            format!(
                                "to {target}, at least rollback_steps = {} before the bad step {}",
                                plan.rollback_steps, bad.step
                            ),
                        )
                        .await;
                    leader
                        .record(
                            generation,
                            "skipped_data",
                            format!(
                                "after step {after_step} the ranks skip {batches} global batches: the data of steps {}-{} as first trained (skip_batches = {})",
                                after_step + 1,
                                after_step + batches,
                                plan.skip_batches
                            ),
                        )
                        .await;
                }
                leader
                    .set_supervision(generation + 1, &active, &drained)
                    .await;
                leader.forget_ranks().await;
                generation += 1;
            }
            Outcome::Completed | Outcome::Preempted => {
                let (kind, ending) = match outcome {
                    Outcome::Completed => ("completed", Ending::Completed),
                    _ => ("preempted", Ending::Preempted),
                };
                let detail = finish(&leader).await;
                leader.record(generation, kind, detail).await;
                return ending;
            }
            Outcome::Fault {
                kind,
                detail,
                lost_node,
            } => {
                leader.count_fault();
                // A lost node says nothing about the training; a world that dies or hangs at
                // the step where it did before will do so again from the same restore.
                // Where the world got to: a world that died before its first step after a
                // restore got to the restored step.
                let restored = leader.chosen_step().await;
                let reached = (leader.ranks_summary().await.max_step).max(restored.unwrap_or(0));
                repeated = repeat_count(repeated, lost_node.is_some(), reached);
                leader.record(generation, kind, detail).await;
                stop_world(&leader, child.as_mut(), &plan, run, generation).await;
                if repeated.1 >= plan.same_step_failures {
                    let failed = format!(
                        "the world failed {} times in a row at step {reached} (same_step_failures = {})",
                        repeated.1, plan.same_step_failures
                    );
                    // Once, the next older step: what fails after a restore may be the
                    // restored state. Then a clear stop.
                    let from = restored.unwrap_or(reached);
                    let verdict = if rolled_back_at == Some(reached) {
                        Err("it failed there again after the supervisor rolled it back, so it is not relaunched; find the cause in the ranks' output, then roll back further or fix and resubmit".to_string())
                    } else if from == 0 {
                        Err("it started fresh, so there is no older step to try; find the cause in the ranks' output, then fix and resubmit".to_string())
                    } else {
                        leader
                            .roll_back(from, &format!("{failed}, restored from step {from}"))
                            .await
                            .map_err(|error| format!("it cannot be rolled back ({error:#}), so it is not relaunched; find the cause in the ranks' output, then roll back or fix and resubmit"))
                    };
                    match verdict {
                        Ok(to) => {
                            rolled_back_at = Some(reached);
                            leader
                                .record(
                                    generation,
                                    "rolled_back",
                                    format!(
                                        "{failed} after restoring step {from}: relaunched from {}",
                                        match to {
                                            Some(key) => format!("durable step {key}, the newest older one; later steps are hidden, not deleted"),
                                            None => "a fresh start, the run having no older durable step".to_string(),
                                        }
                                    ),
                                )
                                .await;
                        }
                        Err(why) => {
                            let detail = format!("{failed}: {why}");
                            return give_up(&daemon, &leader, generation, detail).await;
                        }
                    }
                }
                if let Some(lost) = lost_node {
                    let (ranks, nodes) = leader.view().await;
                    // Under Slurm the node stays out until an operator resumes it; without
                    // Slurm, it may serve again once its daemon is back.
                    if drain(&plan, &lost, "lazarus: node lost (ckptd silent)").await {
                        drained.push(lost.clone());
                        leader
                            .record(generation, "drained", format!("{lost} drained in Slurm"))
                            .await;
                    }
                    let spare = nodes.iter().any(|n| {
                        alive(n, &plan) && !active.contains(&n.node) && !drained.contains(&n.node)
                    });
                    if plan.when_no_spare == NoSpare::Shrink && !spare {
                        let lost_ranks: Vec<Rank> = ranks
                            .iter()
                            .filter(|r| r.node == lost)
                            .map(|r| r.rank)
                            .collect();
                        secure(&leader, generation, &lost_ranks).await;
                    }
                }
                leader
                    .set_supervision(generation + 1, &active, &drained)
                    .await;
                leader.forget_ranks().await;
                generation += 1;
            }
        }
    }
}

/// How many graces adoption waits at most for the daemons of a world that keeps stepping.
const ADOPTION_MOST: u32 = 3;

/// Waits (a few heartbeats) for the ranks of a world that kept running while no leader was
/// there: the nodes' hellos list them, and each rank re-registers with its restarted daemon.
/// A rank its daemon saw die ends the wait at once: a world with a dead rank is stopped
/// whatever else comes back. A rank that finished (`Bye`) came back too: a world that
/// completed while no leader was there is adopted, and its supervision completes.
///
/// A world steps only with all of its ranks (each step's loss is summed over the world), so
/// while the ranks that are back keep stepping, the others are alive and only their daemons
/// are not back yet (a leader's, killed and restarting): the grace also runs from the last
/// step they took, up to [`ADOPTION_MOST`] graces in all. Until a daemon is back its ranks
/// skip their snapshots, which is the world's exposure while it waits.
async fn adopt(leader: &Leader, plan: &Supervision, took_over: bool) -> Found {
    let grace = Duration::from_secs_f64((2.0 * plan.heartbeat_timeout_seconds).max(3.0));
    // The grace runs from the last rank that registered: thousands of nodes reconnecting
    // take longer than a few, and a world still arriving is not a partial one.
    let began = Instant::now();
    let mut started = began;
    let mut seen = 0;
    let after = if took_over {
        "was replaced"
    } else {
        "restarted"
    };
    loop {
        let (ranks, _) = leader.view().await;
        let world = leader.world_size().await as usize;
        let back: Vec<_> = ranks.iter().filter(|r| r.alive || r.done).collect();
        if ranks.iter().any(|r| !r.alive && !r.done) {
            let downs = leader.take_downs().await;
            if !downs.is_empty() {
                return Found::Partial(format!(
                    "after the leader {after}, {}",
                    death_detail(downs, lazarus_shared::store::now_unix_us())
                ));
            }
        }
        if back.len() > seen {
            seen = back.len();
            started = Instant::now();
        }
        if world > 0 && back.len() == world {
            let mut nodes: Vec<String> = Vec::new();
            for rank in &back {
                if !nodes.contains(&rank.node) {
                    nodes.push(rank.node.clone());
                }
            }
            return Found::World(nodes);
        }
        let stepped_ago = back
            .iter()
            .filter(|r| !r.done)
            .map(|r| r.progressed_ago)
            .min()
            .unwrap_or(Duration::MAX);
        let quiet = started.elapsed().min(stepped_ago);
        if quiet > grace || began.elapsed() > grace * ADOPTION_MOST {
            if back.is_empty() {
                return Found::Nothing;
            }
            let names: Vec<String> = back.iter().map(|r| r.rank.to_string()).collect();
            let stepping = if quiet > grace {
                String::new()
            } else {
                format!(
                    ", though the world stepped on for {:.1} s",
                    began.elapsed().as_secs_f64()
                )
            };
            return Found::Partial(format!(
                "after the leader {after}, only ranks {} of {world} came back{stepping}",
                names.join(",")
            ));
        }
        tokio::time::sleep(TICK).await;
    }
}

/// Before a smaller world restores (through T2, resharded), makes the newest memory-committed
/// step durable: the survivors upload their T0 and the lost ranks' buddies their T1, so the
/// shrink loses no step.
async fn secure(leader: &Leader, generation: u32, lost: &[Rank]) {
    let (memory, durable) = leader.steps().await;
    let Some(step) = memory.filter(|m| durable < Some(*m)) else {
        return;
    };
    let started = Instant::now();
    let missing = leader.make_durable_without(step, lost).await;
    if !missing.is_empty() {
        leader
            .record(
                generation,
                "secure_failed",
                format!("no replica holder known for ranks {missing:?}: the smaller world restores the newest durable step"),
            )
            .await;
        return;
    }
    if wait_durable(leader, step, Duration::from_secs(120), false).await {
        leader
            .record(
                generation,
                "secured",
                format!(
                    "step {step} made durable from the survivors' T0 and the lost ranks' T1 ({:.2} s)",
                    started.elapsed().as_secs_f64()
                ),
            )
            .await;
        return;
    }
    leader
        .record(
            generation,
            "secure_failed",
            format!("step {step} did not become durable within 120 s: the smaller world restores the newest durable step"),
        )
        .await;
}

/// Waits up to `limit` for `step` to be durable; with `nudge`, asks the nodes every 500 ms
/// to upload their T0 of it. Says whether it became durable.
async fn wait_durable(leader: &Leader, step: u64, limit: Duration, nudge: bool) -> bool {
    let deadline = Instant::now() + limit;
    let mut asked = Instant::now();
    while Instant::now() < deadline {
        if leader.steps().await.1 >= Some(step) {
            return true;
        }
        if nudge && asked.elapsed() > Duration::from_millis(500) {
            leader.make_durable(step).await;
            asked = Instant::now();
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    false
}

/// The world has ended (completed or preempted): makes sure its newest memory-committed step
/// is durable, asking the nodes to upload it when the trainer's last snapshot did not.
async fn finish(leader: &Leader) -> String {
    let (memory, durable) = leader.steps().await;
    if let Some(step) = memory.filter(|m| durable < Some(*m)) {
        if !wait_durable(leader, step, Duration::from_secs(120), true).await {
            return format!(
                "step {step} is in memory only: no durable commit within 120 s (newest durable: {})",
                leader.steps().await.1.map_or("none".into(), |d| d.to_string())
            );
        }
    }
    match leader.steps().await.1 {
        Some(step) => format!("step {step} is durable"),
        None => "no step is durable".into(),
    }
}

/// Keeps the healthy active nodes in their places and fills the places of lost ones, then up
/// to `target`, with spares (connected nodes neither active nor drained), so every rank of a
/// healthy node stays on it and a spare takes a lost node's ranks. With no spare left it
/// waits, or under the shrink policy lowers `target` to the healthy nodes it has. `None`:
/// preempted (or deposed) while waiting.
async fn wait_for_nodes(
    leader: &Leader,
    plan: &Supervision,
    target: &mut usize,
    active: Vec<String>,
    drained: &[String],
    generation: u32,
) -> Option<Vec<String>> {
    // Each place's own node, which takes it back if it is healthy again before a spare did.
    let home = active.clone();
    let mut places: Vec<Option<String>> = active.iter().cloned().map(Some).collect();
    let mut said_waiting = false;
    let mut drained = drained.to_vec();
    // Nodes that join a world that lost some are swaps; a first world just starts.
    let replacing = !active.is_empty();
    let mut checked = Instant::now();
    let started = Instant::now();
    loop {
        if leader.preempting() || leader.deposed() {
            return None;
        }
        // A drained node an operator resumed in Slurm may serve again. Without Slurm, only a
        // node suspected of silent data corruption is drained, and it stays out.
        if plan.launcher == Launcher::Srun
            && !drained.is_empty()
            && checked.elapsed() > Duration::from_secs(2)
        {
            checked = Instant::now();
            let mut still = Vec::new();
            for node in drained {
                if slurm_drained(&node).await {
                    still.push(node);
                }
            }
            drained = still;
        }
        let (_, nodes) = leader.view().await;
        let healthy = |name: &str| nodes.iter().any(|n| n.node == name && alive(n, plan));
        for place in places.iter_mut() {
            if place
                .as_ref()
                .is_some_and(|n| !healthy(n) || drained.contains(n))
            {
                *place = None;
            }
        }
        // Places beyond the target (it was lowered) go, empty ones first.
        while places.len() > *target {
            match places.iter().rposition(Option::is_none) {
                Some(empty) => places.remove(empty),
                None => places.pop().flatten(),
            };
        }
        places.resize(*target, None);
        for i in 0..places.len() {
            let Some(own) = home.get(i) else { break };
            let placed = places.iter().flatten().any(|n| n == own);
            if places[i].is_none() && !placed && healthy(own) && !drained.contains(own) {
                places[i] = Some(own.clone());
            }
        }
        // A first world waits for the leader's own node, up to a heartbeat timeout. The nodes'
        // hellos race (the leader's own uplink may retry while the others get through), and a
        // first world started on whichever came first would leave the allocation's first node,
        // the leader's, a spare by chance. Places fill in node-name order.
        let own = leader.node();
        if !replacing
            && !nodes.iter().any(|n| n.node == own && alive(n, plan))
            && !drained.iter().any(|n| n == own)
            && started.elapsed().as_secs_f64() < plan.heartbeat_timeout_seconds
        {
            tokio::time::sleep(TICK).await;
            continue;
        }
        for node in &nodes {
            let Some(empty) = places.iter().position(Option::is_none) else {
                break;
            };
            let placed = places.iter().flatten().any(|n| *n == node.node);
            if alive(node, plan) && !placed && !drained.contains(&node.node) {
                if replacing {
                    leader
                        .record(
                            generation,
                            "swap",
                            format!("hot spare {} joins the world", node.node),
                        )
                        .await;
                }
                places[empty] = Some(node.node.clone());
            }
        }
        let mut active: Vec<String> = places.iter().flatten().cloned().collect();
        if active.len() >= *target {
            if !replacing {
                active.sort();
            }
            return Some(active);
        }
        let shrink = plan.when_no_spare == NoSpare::Shrink
            && generation > 0
            && active.len() >= plan.min_active_nodes;
        if shrink {
            leader
                .record(
                    generation,
                    "shrink",
                    format!(
                        "no spare left: continuing on {} node(s) instead of {}; the ranks restore from T2, resharded",
                        active.len(),
                        *target
                    ),
                )
                .await;
            *target = active.len();
            return Some(active);
        }
        if !said_waiting && generation > 0 {
            leader
                .record(
                    generation,
                    "waiting",
                    format!(
                        "{} of {} nodes healthy and no spare left; waiting for a node",
                        active.len(),
                        *target
                    ),
                )
                .await;
            said_waiting = true;
        }
        tokio::time::sleep(TICK).await;
    }
}

/// How long a leader that lost most of its nodes waits for a successor before it acts: the
/// successors' own timeout, their places in the succession (three at most), their look at
/// the lease, and a margin.
fn takeover_grace(plan: &Supervision) -> Duration {
    Duration::from_secs_f64(plan.heartbeat_timeout_seconds * 2.0 + 2.0)
        + super::election::STAGGER * 3
}

fn alive(node: &NodeView, plan: &Supervision) -> bool {
    node.connected && node.seen_ago.as_secs_f64() < plan.heartbeat_timeout_seconds
}

/// Starts the world on `active`: `ranks_per_node` ranks on each node, numbered node by node,
/// pointed at their node's daemon.
fn launch(
    daemon: &Daemon,
    plan: &Supervision,
    active: &[String],
    nodes: &[NodeView],
) -> anyhow::Result<Child> {
    let socket = |name: &str| {
        nodes
            .iter()
            .find(|n| n.node == name)
            .map(|n| n.socket.clone())
            .unwrap_or_default()
    };
    let mut command = match plan.launcher {
        Launcher::Mpiexec => {
            let mut command = Command::new("mpiexec");
            for (i, name) in active.iter().enumerate() {
                if i > 0 {
                    command.arg(":");
                }
                command
                    .arg("-n")
                    .arg(plan.ranks_per_node.to_string())
                    .args(["-env", "LAZARUS_CKPTD_SOCKET"])
                    .arg(socket(name))
                    .arg(&plan.trainer)
                    .args(&plan.trainer_args);
            }
            command
        }
        Launcher::Srun => {
            // One socket path for all nodes, with the node's name in it where it differs.
            let template = active
                .first()
                .map(|first| socket_template(&socket(first), first))
                .unwrap_or_default();
            // Each rank on the node of its place, in rank order: Slurm lays out a plain
            // node list in its own order, an arbitrary distribution in the list's.
            let places: Vec<&str> = active
                .iter()
                .flat_map(|node| std::iter::repeat_n(node.as_str(), plan.ranks_per_node))
                .collect();
            let mut command = Command::new("srun");
            command
                .arg(format!("--nodelist={}", places.join(",")))
                .arg(format!("--nodes={}", active.len()))
                .arg(format!("--ntasks={}", places.len()))
                .arg(format!("--ntasks-per-node={}", plan.ranks_per_node))
                .args([
                    "--distribution=arbitrary",
                    "--mpi=pmi2",
                    "--kill-on-bad-exit=1",
                ])
                .arg(format!("--job-name=lazarus-{}", daemon.cfg.run))
                .env("LAZARUS_CKPTD_SOCKET", template)
                .arg(&plan.trainer)
                .args(&plan.trainer_args);
            command
        }
    };
    // The world outlives its leader: a successor adopts it. `stop` kills the launcher's
    // process group when a world has to go.
    command.process_group(0);
    Ok(command.spawn()?)
}

/// `socket` with the node's name in its file name replaced by `{node}` (the trainer puts
/// `SLURMD_NODENAME` back), so one path serves every node.
fn socket_template(socket: &str, node: &str) -> String {
    let path = std::path::Path::new(socket);
    match (path.parent(), path.file_name().and_then(|f| f.to_str())) {
        (Some(parent), Some(file)) if file.contains(node) => parent
            .join(file.replace(node, "{node}"))
            .display()
            .to_string(),
        _ => socket.to_string(),
    }
}

/// Watches the world until it completes, is preempted, or fails. `child` is the launcher;
/// an adopted world has none, and is complete when every rank said `Bye`.
async fn watch(
    leader: &Leader,
    mut child: Option<&mut Child>,
    plan: &Supervision,
    active: &[String],
    generation: u32,
) -> Outcome {
    let launched = Instant::now();
    let (mut restored, mut first_step) = (child.is_none(), child.is_none());
    let mut stopping = false;
    let mut cut_off_since: Option<Instant> = None;
    loop {
        tokio::time::sleep(TICK).await;
        if leader.deposed() {
            return Outcome::Deposed;
        }
        leader.count_spares().await;
        if !stopping && leader.preempting() {
            stopping = true;
            leader.stop_all_ranks().await;
            leader
                .record(
                    generation,
                    "preempting",
                    "SIGUSR1: the ranks make a last snapshot and exit".into(),
                )
                .await;
        }
        let ended = if stopping {
            Outcome::Preempted
        } else {
            Outcome::Completed
        };
        // A lost node first, then a dead rank, then the launcher's own exit: the most
        // specific cause names the fault.
        let ranks = leader.ranks_summary().await;
        let nodes: HashMap<String, NodeView> = leader
            .nodes()
            .await
            .into_iter()
            .map(|n| (n.node.clone(), n))
            .collect();
        let lost = active
            .iter()
            .any(|name| !nodes.get(name.as_str()).is_some_and(|n| alive(n, plan)));
        // A leader that hears from too few of its nodes may be the one cut off: while a
        // successor could take over, it gives one the time to, rather than stop a world
        // the others still run. A successor deposes it meanwhile; if none does, the nodes
        // really are lost and it acts.
        let wary = lost && leader.has_successors().await;
        if wary && !leader.has_quorum().await {
            let since = *cut_off_since.get_or_insert_with(Instant::now);
            // Past the grace, it acts only once the store confirms no successor leads.
            if since.elapsed() < takeover_grace(plan) || !leader.still_leads().await {
                continue;
            }
        } else {
            cut_off_since = None;
            // The nodes of a leader that a successor deposed disconnect as they move to it,
            // before this leader's lease loop (once an interval) finds the newer epoch: a
            // leader healed from a cut saw its nodes go, declared one lost and killed the
            // world's ranks 9 ms before it learned (found by the soak). It asks the store,
            // whether or not it still counts successors: candidates that disconnected have
            // left its order of succession.
            if lost && leader.superseded().await {
                continue;
            }
        }
        for name in active {
            let node = nodes.get(name.as_str());
            if !node.is_some_and(|n| alive(n, plan)) {
                return Outcome::Fault {
                    kind: "fault",
                    detail: format!(
                        "node {name} lost: its daemon {}",
                        node.map_or("never connected".to_string(), |n| if n.connected {
                            format!("was silent for {:.1} s", n.seen_ago.as_secs_f64())
                        } else {
                            "disconnected".to_string()
                        })
                    ),
                    lost_node: Some(name.clone()),
                };
            }
        }
        // A rank that went bad waits for the world to be stopped; it does not train on.
        if let Some(rank) = ranks.unhealthy {
            if let Some(bad) = leader.unhealthy(rank).await {
                return Outcome::Unhealthy { rank, bad };
            }
        }
        let downs = leader.take_downs().await;
        if !downs.is_empty() {
            let outcome = rank_died(leader, downs).await;
            if let Some(detail) = refused_input(leader, child.as_deref_mut()).await {
                return Outcome::RefusedInput(detail);
            }
            return outcome;
        }
        if child.is_none()
            && ranks.count > 0
            && ranks.count >= active.len()
            && ranks.done == ranks.count
        {
            return ended;
        }
        let exited = child.as_mut().and_then(|c| c.try_wait().ok().flatten());
        if let Some(status) = exited {
            if status.success() {
                return ended;
            }
            if status.code() == Some(BAD_INPUT_EXIT) {
                return Outcome::RefusedInput(refused_detail(status));
            }
            // The launcher often notices a dead rank first; give the daemon's report a
            // moment to name it.
            let deadline = Instant::now() + Duration::from_millis(300);
            while Instant::now() < deadline {
                let downs = leader.take_downs().await;
                if !downs.is_empty() {
                    return rank_died(leader, downs).await;
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            return Outcome::Fault {
                kind: "fault",
                detail: format!("the launcher exited: {status}"),
                lost_node: None,
            };
        }
        // Until its first step a world is starting (MPI init, the restore, the first
        // forward and backward): that has a limit of its own. A restart under load once
        // took more than a 3 s hang timeout between registering and its first step.
        let limit_seconds = if first_step {
            plan.hang_timeout_seconds
        } else {
            plan.startup_timeout_seconds.max(plan.hang_timeout_seconds)
        };
        let everyone = ranks.count >= active.len() && ranks.alive == ranks.count;
        if !everyone && !first_step && !stopping && launched.elapsed().as_secs_f64() > limit_seconds
        {
            let (ranks, _) = leader.view().await;
            let registered: Vec<String> = ranks
                .iter()
                .filter(|r| r.alive)
                .map(|r| format!("{} on {}", r.rank, r.node))
                .collect();
            return Outcome::Fault {
                kind: "fault",
                detail: format!(
                    "hung while starting: not every rank registered {:.0} s after the launch (registered: {})",
                    limit_seconds,
                    if registered.is_empty() {
                        "none".to_string()
                    } else {
                        registered.join(", ")
                    }
                ),
                lost_node: None,
            };
        }
        if everyone {
            let asked = leader.chosen_step().await;
            let chosen = asked.unwrap_or(0);
            if !restored && asked.is_some() && (chosen == 0 || ranks.min_step >= chosen) {
                restored = true;
                leader
                    .record(
                        generation,
                        "restored",
                        format!(
                            "every rank is at step {chosen} ({:.2} s after launch){}",
                            launched.elapsed().as_secs_f64(),
                            tiers(&leader.view().await.0)
                        ),
                    )
                    .await;
            }
            if restored && !first_step && ranks.min_step > chosen {
                first_step = true;
                leader
                    .record(
                        generation,
                        "first_step",
                        format!(
                            "every rank finished step {} ({:.2} s after launch)",
                            chosen + 1,
                            launched.elapsed().as_secs_f64()
                        ),
                    )
                    .await;
            }
            if ranks.count > 0 && ranks.progressed_ago_min.as_secs_f64() > limit_seconds {
                let (ranks, _) = leader.view().await;
                let stalled = ranks
                    .iter()
                    .map(|r| format!("{} on {}", r.rank, r.node))
                    .collect::<Vec<_>>();
                // In lockstep training every rank stalls behind one that stopped; the
                // process states point at the one that did.
                let culprits: Vec<String> = ranks
                    .iter()
                    .filter_map(|r| {
                        r.process_state.map(|state| {
                            format!(
                                "rank {} (pid {} on {}) is {}",
                                r.rank,
                                r.pid,
                                r.node,
                                describe_process_state(state)
                            )
                        })
                    })
                    .collect();
                return Outcome::Fault {
                    kind: "fault",
                    detail: format!(
                        "hung: no step progress for {:.0} s{} (ranks {}){}",
                        limit_seconds,
                        if first_step { "" } else { " while starting" },
                        stalled.join(", "),
                        if culprits.is_empty() {
                            String::new()
                        } else {
                            format!("; {}", culprits.join(", "))
                        }
                    ),
                    lost_node: None,
                };
            }
        }
    }
}

/// Which tier each rank restored from, by tier: `; from T0: ranks 1, T1: ranks 0` (empty
/// when no rank's node has said yet, as after a fresh start).
fn tiers(ranks: &[super::leader::RankView]) -> String {
    let mut by_tier: std::collections::BTreeMap<&str, Vec<String>> = Default::default();
    for rank in ranks {
        if let Some(tier) = rank.restored_from {
            by_tier
                .entry(match tier {
                    lazarus_shared::wire::Tier::T0 => "T0",
                    lazarus_shared::wire::Tier::T1 => "T1",
                    lazarus_shared::wire::Tier::T2 => "T2",
                })
                .or_default()
                .push(rank.rank.to_string());
        }
    }
    if by_tier.is_empty() {
        return String::new();
    }
    let parts: Vec<String> = by_tier
        .iter()
        .map(|(tier, ranks)| format!("{tier}: ranks {}", ranks.join(",")))
        .collect();
    format!("; from {}", parts.join(", "))
}

fn describe_process_state(state: char) -> String {
    match state {
        'T' => "stopped (process state T)".to_string(),
        't' => "stopped by a tracer (process state t)".to_string(),
        'D' => "waiting on IO (process state D)".to_string(),
        'Z' => "a zombie (process state Z)".to_string(),
        other => format!("in process state {other}"),
    }
}

/// A rank died. The launcher kills the others within moments, and their reports may come
/// first (another node's report travels further, or its daemon was slower to run): reports
/// are gathered for at least 100 ms, and until every rank is down or 300 ms have passed. The
/// first death by its node's clock (taken when the process exited, see `local::watch_exit`)
/// is the fault. Each node reports a death the moment its process exits, so a report of an
/// earlier death does not come much later; survivors that live on (srun leaves a rank stuck
/// in a collective until its kill timeout) are not waited for past that.
/// The step of the world's last faults and how many in a row there, after one more fault
/// that found the world at step `reached`. A lost node starts the count over.
fn repeat_count(last: (Option<u64>, u32), lost_node: bool, reached: u64) -> (Option<u64>, u32) {
    match (lost_node, last) {
        (true, _) => (None, 0),
        (false, (Some(step), times)) if step == reached => (Some(step), times + 1),
        (false, _) => (Some(reached), 1),
    }
}

/// After ranks died, whether the trainer refused its input: once every rank is down, the
/// launcher's exit code says so (it is given half a second to exit). A world whose other
/// ranks still run had a crash, not a refusal.
async fn refused_input(leader: &Leader, child: Option<&mut Child>) -> Option<String> {
    let child = child?;
    let deadline = Instant::now() + Duration::from_millis(500);
    loop {
        if let Ok(Some(status)) = child.try_wait() {
            return (status.code() == Some(BAD_INPUT_EXIT)).then(|| refused_detail(status));
        }
        if Instant::now() >= deadline || leader.ranks_summary().await.alive > 0 {
            return None;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The `failed` event's words for a launcher that passed on the trainer's exit 2.
fn refused_detail(status: std::process::ExitStatus) -> String {
    format!(
        "the trainer refused its configuration or data (the launcher {status}): a relaunch would refuse it too, so there is none; the ranks' error is in the leader's log"
    )
}

async fn rank_died(leader: &Leader, mut downs: Vec<super::leader::RankDown>) -> Outcome {
    let started = Instant::now();
    loop {
        tokio::time::sleep(Duration::from_millis(20)).await;
        downs.extend(leader.take_downs().await);
        let waited = started.elapsed();
        if waited >= Duration::from_millis(300) {
            break;
        }
        if waited >= Duration::from_millis(100) && leader.view().await.0.iter().all(|r| !r.alive) {
            break;
        }
    }
    Outcome::Fault {
        kind: "fault",
        detail: death_detail(downs, lazarus_shared::store::now_unix_us()),
        lost_node: None,
    }
}

/// Deaths this close together are one moment as far as the kernel shows them. A rank's peers
/// can see it die (a failed read of its memory, a closed connection) before its last thread
/// has exited and its exit becomes visible, and a peer that aborts at once can be gone first
/// by a few milliseconds. Naming one of them the cause would be a guess.
const TOGETHER_US: u64 = 20_000;

/// The fault's words for a set of deaths (`now_us` is when it is declared): the first death
/// by its node's clock, or every death within `TOGETHER_US` of it, then the later ones.
fn death_detail(mut downs: Vec<super::leader::RankDown>, now_us: u64) -> String {
    downs.sort_by_key(|d| d.unix_us);
    let first_us = downs[0].unix_us;
    let together = downs
        .iter()
        .take_while(|d| d.unix_us - first_us <= TOGETHER_US)
        .count();
    let (first, later) = downs.split_at(together);
    let declared_ms = now_us.saturating_sub(first_us) / 1000;
    let named = |d: &super::leader::RankDown| format!("{} (pid {} on {})", d.rank, d.pid, d.node);
    let mut detail = if let [only] = first {
        format!(
            "rank {} died; declared {declared_ms} ms after it exited",
            named(only)
        )
    } else {
        let names: Vec<String> = first.iter().map(named).collect();
        format!(
            "ranks {} died within {} ms of each other; declared {declared_ms} ms after the first exited",
            names.join(", "),
            (first[first.len() - 1].unix_us - first_us) / 1000
        )
    };
    if !later.is_empty() {
        let ranks: Vec<String> = later.iter().map(|d| d.rank.to_string()).collect();
        detail.push_str(&format!(
            "; ranks {} went down after {}",
            ranks.join(","),
            if first.len() == 1 { "it" } else { "them" }
        ));
    }
    detail
}

/// Stops the whole world: every daemon kills its ranks, the launcher's process group is
/// killed, and this waits (bounded) until the launcher is gone and no rank is connected.
/// Stops the world ([`stop`]) and records that it is gone.
async fn stop_world(
    leader: &Leader,
    child: Option<&mut Child>,
    plan: &Supervision,
    run: &str,
    generation: u32,
) {
    stop(leader, child, plan, run).await;
    leader
        .record(
            generation,
            "stopped",
            "every rank of the world is gone".into(),
        )
        .await;
}

/// Supervision stops relaunching: the event `failed` with why, and the alert's gauge.
async fn give_up(daemon: &Daemon, leader: &Leader, generation: u32, detail: String) -> Ending {
    leader.record(generation, "failed", detail).await;
    daemon.metrics.run_failed.set(1);
    Ending::Failed
}

async fn stop(leader: &Leader, child: Option<&mut Child>, plan: &Supervision, run: &str) {
    leader.kill_all_ranks().await;
    if plan.launcher == Launcher::Srun {
        cancel_slurm_world(run).await;
    }
    if let Some(child) = child {
        if let Some(pid) = child.id() {
            let _ = Command::new("kill")
                .args(["-KILL", "--", &format!("-{pid}")])
                .status()
                .await;
        }
        let _ = tokio::time::timeout(Duration::from_secs(15), child.wait()).await;
    }
    let deadline = Instant::now() + Duration::from_secs(15);
    while Instant::now() < deadline {
        let (ranks, nodes) = leader.view().await;
        // A rank on a node whose daemon is gone (or silent: cut off) went with its node.
        let gone = |node: &str| !nodes.iter().any(|n| n.node == node && alive(n, plan));
        if ranks.iter().all(|r| !r.alive || gone(&r.node)) {
            break;
        }
        tokio::time::sleep(TICK).await;
    }
}

/// Cancels the world's Slurm work, so its nodes are free for the relaunch: inside an
/// allocation (the batch script) the world is a step named `lazarus-RUN`; outside one, srun
/// made a job of that name.
async fn cancel_slurm_world(run: &str) {
    let name = format!("lazarus-{run}");
    let Ok(job) = std::env::var("SLURM_JOB_ID") else {
        let _ = Command::new("scancel")
            .arg(format!("--name={name}"))
            .status()
            .await;
        return;
    };
    let Ok(output) = Command::new("squeue")
        .args(["-h", "-s", "-j", &job, "-o", "%i %j"])
        .output()
        .await
    else {
        return;
    };
    for line in String::from_utf8_lossy(&output.stdout).lines() {
        if let Some((step, step_name)) = line.trim().split_once(' ') {
            if step_name.trim() == name {
                let _ = Command::new("scancel").arg(step).status().await;
            }
        }
    }
}

/// Whether Slurm still keeps `node` out of new jobs (or cannot say).
async fn slurm_drained(node: &str) -> bool {
    match Command::new("sinfo")
        .args(["-h", "-N", "-n", node, "-o", "%T"])
        .output()
        .await
    {
        Ok(output) if output.status.success() => {
            out_of_service(&String::from_utf8_lossy(&output.stdout))
        }
        _ => true,
    }
}

/// Whether a node in Slurm state `state` (`sinfo -o %T`) takes no new job: drained, or still
/// draining (the drain flag set while a job, such as the world just stopped, completes on it;
/// `%t` abbreviates that `drng`, which the leader once took for resumed), down or failed. A
/// job launched on such a node waits in the queue, whatever its daemon says.
fn out_of_service(state: &str) -> bool {
    let state = state.to_ascii_lowercase();
    ["drain", "drng", "down", "fail"]
        .iter()
        .any(|s| state.contains(s))
}

/// Drains a node in Slurm (when the launcher is srun), with `reason`. Says whether it did.
async fn drain(plan: &Supervision, node: &str, reason: &str) -> bool {
    if plan.launcher != Launcher::Srun {
        return false;
    }
    let status = Command::new("scontrol")
        .args([
            "update",
            &format!("nodename={node}"),
            "state=drain",
            &format!("reason={reason}"),
        ])
        .status()
        .await;
    let drained = status.is_ok_and(|s| s.success());
    if !drained {
        tracing::warn!(node, "could not drain the node in Slurm");
    }
    drained
}

#[cfg(test)]
mod tests {
    use std::path::Path;
    use std::sync::Arc;
    use std::time::Duration;

    use lazarus_shared::wire::Message;
    use tokio::sync::mpsc;
    use tokio::task::JoinHandle;

    use super::{
        adopt, death_detail, out_of_service, repeat_count, socket_template, wait_for_nodes, Found,
        Supervision,
    };
    use crate::daemon::leader::tests::{add_node, rank_at, rank_done, rank_down, rank_up};
    use crate::daemon::leader::{Leader, RankDown};
    use crate::daemon::testing;

    /// Node `node`'s daemon leading `epoch` with a world of 2 nodes under mpiexec to supervise,
    /// and its plan.
    async fn supervising(node: &str, epoch: u64) -> (Arc<Leader>, Supervision) {
        supervising_with(node, epoch, &[]).await
    }

    /// [`supervising`], with `extra` flags.
    async fn supervising_with(
        node: &str,
        epoch: u64,
        extra: &[&str],
    ) -> (Arc<Leader>, Supervision) {
        let mut flags = vec![
            "--leader-candidate",
            "--supervise",
            "mpiexec",
            "--active-nodes",
            "2",
            "--trainer-arg=train",
        ];
        flags.extend_from_slice(extra);
        let cfg = testing::config(Path::new("/unused"), node, "127.0.0.1:7001", &flags);
        let plan = cfg.supervision.clone().expect("a supervising config");
        let store = testing::memory_store().await;
        let leader = Leader::new(
            cfg.clone(),
            store.run(&cfg.run),
            Arc::default(),
            None,
            epoch,
        );
        (Arc::new(leader), plan)
    }

    /// Found by the full suite: the batch job's first world started on n2 and n3, whose
    /// hellos reached the leader (n1) before its own uplink's, and left n1 a spare.
    #[tokio::test]
    async fn a_first_world_waits_for_the_leaders_own_node_and_fills_in_name_order() {
        let (leader, plan) = supervising("n1", 1).await;
        let _n3 = add_node(&leader, "n3").await;
        let _n2 = add_node(&leader, "n2").await;
        let late = Arc::clone(&leader);
        let own = tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(300)).await;
            add_node(&late, "n1").await
        });
        let mut target = 2;
        let world = wait_for_nodes(&leader, &plan, &mut target, Vec::new(), &[], 0).await;
        assert_eq!(world, Some(vec!["n1".to_string(), "n2".to_string()]));
        drop(own.await);
    }

    /// Found by the soak under srun: a successor adopting a world whose other rank died just
    /// after the takeover (n2 was lost whole with the old leader, and srun ended rank 0 on n4
    /// only when n2's slurmd came back) waited out the grace, found nothing, and left that
    /// death in its books; the relaunched world was stopped for it at once, 5 s more.
    #[tokio::test]
    async fn a_successor_stops_waiting_for_a_world_once_one_of_its_ranks_died() {
        let (leader, plan) = supervising("n3", 2).await;
        let _n4 = add_node(&leader, "n4").await;
        let _n1 = add_node(&leader, "n1").await;
        rank_up(&leader, "n4", 0, 100).await;
        let dies = Arc::clone(&leader);
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(300)).await;
            rank_down(&dies, "n4", 0, 100, lazarus_shared::store::now_unix_us()).await;
        });
        let started = std::time::Instant::now();
        let found = adopt(&leader, &plan, true).await;
        let waited = started.elapsed();
        let Found::Partial(detail) = found else {
            panic!("a world with a dead rank is not adopted");
        };
        assert!(
            detail.starts_with("after the leader was replaced, rank 0 (pid 100 on n4) died;"),
            "{detail}"
        );
        // The grace is at least 3 s; the death was known after 0.3 s.
        assert!(waited < Duration::from_secs(2), "waited {waited:?}");
        assert!(leader.take_downs().await.is_empty(), "the death is taken");
    }

    /// Seen in the soak: a node drained as it was lost came back while the stopped world's
    /// job still completed on it. Slurm said `drng` (draining), which the leader took for
    /// resumed, and the relaunch on it waited in Slurm's queue for good.
    #[test]
    fn a_draining_node_is_still_out_of_service() {
        for state in [
            "drained",
            "draining",
            "drained*",
            "DRAINING",
            "mixed+drain",
            "down*",
            "fail",
        ] {
            assert!(out_of_service(state), "{state}");
        }
        for state in ["idle", "allocated", "mixed", "completing", "idle*"] {
            assert!(!out_of_service(state), "{state}");
        }
    }

    /// Seen in the soak: a world whose ranks finished while no leader was there was
    /// relaunched at its last step (adoption counted the ranks alive, and a finished one is
    /// not), where it is adopted and its supervision completes.
    #[tokio::test]
    async fn a_world_that_finished_while_no_leader_was_there_is_adopted() {
        let (leader, plan) = supervising("n3", 2).await;
        let _n4 = add_node(&leader, "n4").await;
        let _n1 = add_node(&leader, "n1").await;
        rank_up(&leader, "n4", 0, 100).await;
        rank_up(&leader, "n1", 1, 101).await;
        rank_done(&leader, "n4", 0, 100).await;
        let last = Arc::clone(&leader);
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(300)).await;
            rank_done(&last, "n1", 1, 101).await;
        });
        let started = std::time::Instant::now();
        let Found::World(nodes) = adopt(&leader, &plan, true).await else {
            panic!("a finished world is adopted");
        };
        assert_eq!(nodes, ["n4", "n1"]);
        assert!(started.elapsed() < Duration::from_secs(2));
    }

    /// A successor (n3, with a 3 s grace) adopting a world of 2 ranks: n4 is connected, and
    /// its rank 1 (process 101) reports a step one higher every 200 ms until the returned
    /// task is aborted; rank 0 is not back. The leader, its plan, what n4 receives, and the
    /// stepping task.
    async fn a_world_stepping_without_rank_0() -> (
        Arc<Leader>,
        Supervision,
        mpsc::UnboundedReceiver<Message>,
        JoinHandle<()>,
    ) {
        let (leader, plan) = supervising_with("n3", 2, &["--heartbeat-timeout-seconds", "1"]).await;
        let n4 = add_node(&leader, "n4").await;
        rank_up(&leader, "n4", 1, 101).await;
        let stepping = Arc::clone(&leader);
        let steps = tokio::spawn(async move {
            for step in 1.. {
                rank_at(&stepping, "n4", 1, 101, step).await;
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        });
        (leader, plan, n4, steps)
    }

    /// Seen in the soak: a leader killed on a training node and restarted just after its
    /// successor took over cost 8.5-9.2 s. The successor's grace (twice the heartbeat
    /// timeout) ran out about a second before the restarted daemon's rank registered, and
    /// the world, which had been stepping all along, was stopped and relaunched. A world
    /// that steps has all its ranks alive: the wait goes on while it does.
    #[tokio::test]
    async fn a_world_that_steps_on_is_waited_for_past_the_grace_until_its_ranks_are_back() {
        let (leader, plan, _n4, steps) = a_world_stepping_without_rank_0().await;
        let late = Arc::clone(&leader);
        tokio::spawn(async move {
            // Past the grace (3 s at least) from the start.
            tokio::time::sleep(Duration::from_millis(3_600)).await;
            let _n1 = add_node(&late, "n1").await;
            rank_up(&late, "n1", 0, 100).await;
        });
        let found = adopt(&leader, &plan, true).await;
        steps.abort();
        let Found::World(nodes) = found else {
            panic!("a world that stepped on was not adopted: {found:?}");
        };
        assert_eq!(nodes, ["n1", "n4"]);
    }

    /// ... but not forever: a daemon that is not back within three graces leaves its world
    /// partial, and the world is stopped and relaunched.
    #[tokio::test]
    async fn a_world_that_steps_on_without_its_other_daemons_is_partial_after_three_graces() {
        let (leader, plan, _n4, steps) = a_world_stepping_without_rank_0().await;
        let started = std::time::Instant::now();
        let found = adopt(&leader, &plan, true).await;
        let waited = started.elapsed();
        steps.abort();
        let Found::Partial(detail) = found else {
            panic!("a world without a daemon was adopted: {found:?}");
        };
        assert!(
            detail.starts_with("after the leader was replaced, only ranks 1 of 2 came back, though the world stepped on for"),
            "{detail}"
        );
        // The grace is 3 s here.
        assert!(
            (Duration::from_secs(9)..Duration::from_secs(11)).contains(&waited),
            "waited {waited:?}"
        );
    }

    #[test]
    fn faults_count_in_a_row_at_one_step_and_a_lost_node_starts_over() {
        let first = repeat_count((None, 0), false, 120);
        assert_eq!(first, (Some(120), 1));
        let again = repeat_count(first, false, 120);
        assert_eq!(again, (Some(120), 2));
        assert_eq!(repeat_count(again, false, 121), (Some(121), 1));
        assert_eq!(repeat_count(again, true, 120), (None, 0));
        assert_eq!(repeat_count((None, 0), false, 0), (Some(0), 1));
    }

    fn down(rank: u32, node: &str, unix_us: u64) -> RankDown {
        RankDown {
            rank,
            node: node.to_string(),
            pid: 100 + rank,
            unix_us,
        }
    }

    #[test]
    fn the_first_death_is_named_and_deaths_close_to_it_are_named_with_it() {
        let alone = vec![down(0, "n1", 1_050_000), down(1, "n2", 1_000_000)];
        assert_eq!(
            death_detail(alone, 1_200_000),
            "rank 1 (pid 101 on n2) died; declared 200 ms after it exited; ranks 0 went down after it"
        );
        // A peer that saw rank 1 go and aborted at once exited 3 ms before rank 1's exit
        // became visible: neither is named the cause.
        let together = vec![
            down(1, "n2", 1_003_000),
            down(0, "n1", 1_000_000),
            down(2, "n3", 1_100_000),
        ];
        assert_eq!(
            death_detail(together, 1_150_000),
            "ranks 0 (pid 100 on n1), 1 (pid 101 on n2) died within 3 ms of each other; \
             declared 150 ms after the first exited; ranks 2 went down after them"
        );
        assert_eq!(
            death_detail(vec![down(3, "n1", 5_000)], 4_000),
            "rank 3 (pid 103 on n1) died; declared 0 ms after it exited"
        );
    }

    #[test]
    fn the_socket_template_replaces_the_node_in_the_file_name_only() {
        assert_eq!(
            socket_template("/tmp/xn1y/n1.sock", "n1"),
            "/tmp/xn1y/{node}.sock"
        );
        assert_eq!(
            socket_template("/run/lazarus/ckptd.sock", "n1"),
            "/run/lazarus/ckptd.sock"
        );
    }
}
