//! The supervising leader (DESIGN.md section 4): launches the training world, watches it,
//! and on a failure stops it, replaces what failed, and relaunches it. The ranks then restore
//! through their daemons (T0, T1 or T2) as on any restart.
//!
//! Failures and how they are seen:
//! - a crashed rank: its Unix connection to its daemon ends without a `Bye` (reported at
//!   once), or the launcher exits non-zero;
//! - a lost node: its daemon's link to the leader is gone or silent for
//!   `heartbeat_timeout_seconds`; it is replaced by a hot spare (a connected, idle node);
//! - a hung world: no rank's step moved for `hang_timeout_seconds`.
//!
//! Every phase is an event with a timestamp (`ckptctl events RUN`).

use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::process::{Child, Command};

use super::config::{Launcher, Supervision};
use super::leader::{Leader, NodeView};
use super::Daemon;

const TICK: Duration = Duration::from_millis(50);

/// Why the world stopped.
#[derive(Debug)]
enum Outcome {
    Completed,
    Fault {
        kind: &'static str,
        detail: String,
        lost_node: Option<String>,
    },
}

pub async fn supervise(daemon: Arc<Daemon>, leader: Arc<Leader>, plan: Supervision) {
    let mut generation = 0u32;
    let mut active: Vec<String> = Vec::new();
    let mut drained: Vec<String> = Vec::new();
    loop {
        active = wait_for_nodes(&leader, &plan, active, &drained, generation).await;
        leader.pair(&active).await;
        leader.set_supervision(generation, &active, &drained).await;
        let (_, nodes) = leader.view().await;
        let mut child = match launch(&daemon, &plan, &active, &nodes) {
            Ok(child) => child,
            Err(error) => {
                leader
                    .record(generation, "launch_failed", format!("{error:#}"))
                    .await;
                tokio::time::sleep(Duration::from_secs(5)).await;
                continue;
            }
        };
        leader
            .record(
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
                    child.id().unwrap_or(0)
                ),
            )
            .await;
        let outcome = watch(&leader, &mut child, &plan, &active, generation).await;
        match outcome {
            Outcome::Completed => {
                leader
                    .record(generation, "completed", "the trainer finished".into())
                    .await;
                return;
            }
            Outcome::Fault {
                kind,
                detail,
                lost_node,
            } => {
                leader.record(generation, kind, detail).await;
                stop(&leader, &mut child, &plan, daemon.cfg.run.as_str()).await;
                leader
                    .record(
                        generation,
                        "stopped",
                        "every rank of the world is gone".into(),
                    )
                    .await;
                if let Some(lost) = lost_node {
                    active.retain(|n| *n != lost);
                    // Under Slurm the node stays out until an operator resumes it; without
                    // Slurm, it may serve again once its daemon is back.
                    if drain(&plan, &lost).await {
                        drained.push(lost.clone());
                        leader
                            .record(generation, "drained", format!("{lost} drained in Slurm"))
                            .await;
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

/// Keeps the healthy active nodes and fills up with spares (connected nodes not active and
/// not drained), waiting until there are enough.
async fn wait_for_nodes(
    leader: &Leader,
    plan: &Supervision,
    mut active: Vec<String>,
    drained: &[String],
    generation: u32,
) -> Vec<String> {
    let mut said_waiting = false;
    let mut drained = drained.to_vec();
    let mut checked = Instant::now();
    loop {
        // A drained node an operator resumed in Slurm may serve again.
        if !drained.is_empty() && checked.elapsed() > Duration::from_secs(2) {
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
        active.retain(|n| healthy(n));
        for node in &nodes {
            if active.len() >= plan.active_nodes {
                break;
            }
            if alive(node, plan) && !active.contains(&node.node) && !drained.contains(&node.node) {
                if generation > 0 {
                    leader
                        .record(
                            generation,
                            "swap",
                            format!("hot spare {} joins the world", node.node),
                        )
                        .await;
                }
                active.push(node.node.clone());
            }
        }
        if active.len() >= plan.active_nodes {
            active.sort();
            return active;
        }
        if !said_waiting && generation > 0 {
            leader
                .record(
                    generation,
                    "waiting",
                    format!(
                        "{} of {} nodes healthy and no spare left; waiting for a node",
                        active.len(),
                        plan.active_nodes
                    ),
                )
                .await;
            said_waiting = true;
        }
        tokio::time::sleep(TICK).await;
    }
}

fn alive(node: &NodeView, plan: &Supervision) -> bool {
    node.connected && node.seen_ago.as_secs_f64() < plan.heartbeat_timeout_seconds
}

/// Starts the world on `active`: one rank per node, pointed at its node's daemon.
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
                    .args(["-n", "1", "-env", "LAZARUS_CKPTD_SOCKET"])
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
            let mut command = Command::new("srun");
            command
                .arg(format!("--nodelist={}", active.join(",")))
                .arg(format!("--nodes={}", active.len()))
                .arg(format!("--ntasks={}", active.len()))
                .args(["--ntasks-per-node=1", "--mpi=pmi2", "--kill-on-bad-exit=1"])
                .arg(format!("--job-name=lazarus-{}", daemon.cfg.run))
                .env("LAZARUS_CKPTD_SOCKET", template)
                .arg(&plan.trainer)
                .args(&plan.trainer_args);
            command
        }
    };
    command.process_group(0).kill_on_drop(true);
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

/// Watches the world until it completes or fails.
async fn watch(
    leader: &Leader,
    child: &mut Child,
    plan: &Supervision,
    active: &[String],
    generation: u32,
) -> Outcome {
    let launched = Instant::now();
    let (mut restored, mut first_step) = (false, false);
    loop {
        tokio::time::sleep(TICK).await;
        // A lost node first, then a dead rank, then the launcher's own exit: the most
        // specific cause names the fault.
        let (ranks, nodes) = leader.view().await;
        for name in active {
            let node = nodes.iter().find(|n| n.node == *name);
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
        if let Some(down) = leader.take_downs().await.into_iter().next() {
            return rank_died(down);
        }
        if let Ok(Some(status)) = child.try_wait() {
            if status.success() {
                return Outcome::Completed;
            }
            // The launcher often notices a dead rank first; give the daemon's report a
            // moment to name it.
            let deadline = Instant::now() + Duration::from_millis(300);
            while Instant::now() < deadline {
                if let Some(down) = leader.take_downs().await.into_iter().next() {
                    return rank_died(down);
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            return Outcome::Fault {
                kind: "fault",
                detail: format!("the launcher exited: {status}"),
                lost_node: None,
            };
        }
        let everyone = ranks.len() >= active.len() && ranks.iter().all(|r| r.alive);
        if everyone {
            let chosen = leader.chosen_step().await.unwrap_or(0);
            if !restored
                && ranks
                    .iter()
                    .all(|r| r.step >= chosen && r.step > 0 || chosen == 0)
            {
                restored = true;
                leader
                    .record(
                        generation,
                        "restored",
                        format!(
                            "every rank is at step {chosen} ({:.2} s after launch)",
                            launched.elapsed().as_secs_f64()
                        ),
                    )
                    .await;
            }
            if restored && !first_step && ranks.iter().all(|r| r.step > chosen) {
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
            let stalled = ranks
                .iter()
                .filter(|r| r.progressed_ago.as_secs_f64() > plan.hang_timeout_seconds)
                .map(|r| format!("{} on {}", r.rank, r.node))
                .collect::<Vec<_>>();
            if !stalled.is_empty() && stalled.len() == ranks.len() {
                return Outcome::Fault {
                    kind: "fault",
                    detail: format!(
                        "hung: no step progress for {:.0} s (ranks {})",
                        plan.hang_timeout_seconds,
                        stalled.join(", ")
                    ),
                    lost_node: None,
                };
            }
        }
    }
}

fn rank_died(down: super::leader::RankDown) -> Outcome {
    Outcome::Fault {
        kind: "fault",
        detail: format!(
            "rank {} (pid {} on {}) died; detected {} ms after its connection closed",
            down.rank,
            down.pid,
            down.node,
            down.at.elapsed().as_millis()
        ),
        lost_node: None,
    }
}

/// Stops the whole world: every daemon kills its ranks, the launcher's process group is
/// killed, and this waits (bounded) until the launcher is gone and no rank is connected.
async fn stop(leader: &Leader, child: &mut Child, plan: &Supervision, run: &str) {
    leader.kill_all_ranks().await;
    if plan.launcher == Launcher::Srun {
        // The step's job: cancelled, so its nodes are free for the relaunch.
        let _ = Command::new("scancel")
            .arg(format!("--name=lazarus-{run}"))
            .status()
            .await;
    }
    if let Some(pid) = child.id() {
        let _ = Command::new("kill")
            .args(["-KILL", "--", &format!("-{pid}")])
            .status()
            .await;
    }
    let deadline = Instant::now() + Duration::from_secs(15);
    let _ = tokio::time::timeout(Duration::from_secs(15), child.wait()).await;
    while Instant::now() < deadline {
        let (ranks, nodes) = leader.view().await;
        // A rank on a node whose daemon is gone went with its node.
        let gone = |node: &str| !nodes.iter().any(|n| n.node == node && n.connected);
        if ranks.iter().all(|r| !r.alive || gone(&r.node)) {
            break;
        }
        tokio::time::sleep(TICK).await;
    }
}

/// Whether Slurm still has `node` drained (or cannot say).
async fn slurm_drained(node: &str) -> bool {
    match Command::new("sinfo")
        .args(["-h", "-N", "-n", node, "-o", "%t"])
        .output()
        .await
    {
        Ok(output) if output.status.success() => {
            String::from_utf8_lossy(&output.stdout).contains("drain")
        }
        _ => true,
    }
}

/// Drains a lost node in Slurm (when the launcher is srun), with the reason. Says whether
/// it did.
async fn drain(plan: &Supervision, node: &str) -> bool {
    if plan.launcher != Launcher::Srun {
        return false;
    }
    let status = Command::new("scontrol")
        .args([
            "update",
            &format!("nodename={node}"),
            "state=drain",
            "reason=lazarus: node lost (ckptd silent)",
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
    use super::socket_template;

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
