//! Driving a supervising leader from tests and benchmarks: start one over a cluster of
//! daemons, read its timeline, find and signal its ranks.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use crate::cluster::{Cluster, Settings};
use crate::Ctl;

/// `nodes` daemons for `run` (store under `dir/store`, durable every 50 steps); node 1 leads
/// and supervises with `flags` (e.g. `--supervise mpiexec --active-nodes 2`), launching the
/// trainer with `trainer_args`.
pub fn supervised_with(
    dir: &Path,
    run: &str,
    nodes: usize,
    flags: &[&str],
    trainer_args: &[String],
    envs: Vec<(String, String)>,
) -> (Cluster, Ctl) {
    let store = format!("file://{}", dir.join("store").display());
    supervised_on(&store, dir, run, nodes, flags, trainer_args, envs)
}

/// [`supervised_with`] on the store at `store`; `envs` go to the daemons and to the `Ctl`.
pub fn supervised_on(
    store: &str,
    dir: &Path,
    run: &str,
    nodes: usize,
    flags: &[&str],
    trainer_args: &[String],
    envs: Vec<(String, String)>,
) -> (Cluster, Ctl) {
    supervised_by(
        store,
        dir,
        run,
        nodes,
        Daemons::default(),
        flags,
        trainer_args,
        envs,
    )
}

/// How a supervised cluster's daemons are set up beyond the leader's flags.
#[derive(Clone, Copy, Debug, Default)]
pub struct Daemons {
    /// Nodes after the first that may take over leadership.
    pub candidates: usize,
    /// The daemons talk through fault-injecting relays.
    pub relayed: bool,
}

/// [`supervised_on`] with `daemons`: candidates after the first node (with the same
/// supervision flags), relays between them.
#[allow(clippy::too_many_arguments)]
pub fn supervised_by(
    store: &str,
    dir: &Path,
    run: &str,
    nodes: usize,
    daemons: Daemons,
    flags: &[&str],
    trainer_args: &[String],
    envs: Vec<(String, String)>,
) -> (Cluster, Ctl) {
    let mut leader_extra: Vec<String> = flags.iter().map(|f| f.to_string()).collect();
    for arg in trainer_args {
        leader_extra.push(format!("--trainer-arg={arg}"));
    }
    let settings = Settings {
        durable_every_steps: 50,
        leader_extra,
        candidates: daemons.candidates,
        relayed: daemons.relayed,
        ..Settings::default()
    };
    let cluster = Cluster::start(dir, run, store, nodes, &settings, envs.clone());
    let mut ctl = Ctl::new(store, &dir.join("index"));
    ctl.envs = envs;
    (cluster, ctl)
}

/// Sends `signal` to `pid`; whether it was delivered (a process already gone is no news).
pub fn kill(signal: &str, pid: impl ToString) -> bool {
    Command::new("kill")
        .args([&format!("-{signal}"), &pid.to_string()])
        .stderr(std::process::Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

pub fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("the clock is after 1970")
        .as_millis() as u64
}

/// The run's timeline, oldest first (empty while there is none).
pub fn events(ctl: &Ctl, run: &str) -> Vec<serde_json::Value> {
    let output = ctl.run(&["--json", "events", run]);
    if !output.status.success() {
        return Vec::new();
    }
    serde_json::from_slice::<serde_json::Value>(&output.stdout)
        .ok()
        .and_then(|v| v.as_array().cloned())
        .unwrap_or_default()
}

/// Waits (up to 180 s) for the `count`th event of `kind`; on timeout, fails with `logs()`.
pub fn wait_for_event_or(
    ctl: &Ctl,
    run: &str,
    kind: &str,
    count: usize,
    logs: impl Fn() -> String,
) {
    wait_for_event_within(ctl, run, kind, count, Duration::from_secs(180), logs);
}

/// [`wait_for_event_or`] with its own time limit.
pub fn wait_for_event_within(
    ctl: &Ctl,
    run: &str,
    kind: &str,
    count: usize,
    limit: Duration,
    logs: impl Fn() -> String,
) {
    wait_until(
        limit,
        Duration::from_millis(100),
        || {
            format!(
                "no {kind} event #{count}: {:#?}\n{}",
                events(ctl, run),
                logs()
            )
        },
        || {
            events(ctl, run)
                .iter()
                .filter(|e| e["kind"] == kind)
                .count()
                >= count
        },
    );
}

/// Looks whether `done` every `every` until it is, and fails with `why` past `limit`.
pub fn wait_until(
    limit: Duration,
    every: Duration,
    why: impl Fn() -> String,
    mut done: impl FnMut() -> bool,
) {
    let deadline = Instant::now() + limit;
    while !done() {
        assert!(Instant::now() < deadline, "{}", why());
        std::thread::sleep(every);
    }
}

/// Reads `ckptctl status` from a leader; the one place that builds its command line.
#[derive(Debug)]
pub struct Status<'a> {
    ctl: &'a Ctl,
    leader: String,
    key_file: PathBuf,
    /// The run, so that `ckptctl` finds the leader in the store after a takeover.
    run: Option<String>,
}

impl<'a> Status<'a> {
    pub fn new(ctl: &'a Ctl, leader: &str, key_file: &Path) -> Self {
        Self {
            ctl,
            leader: leader.to_string(),
            key_file: key_file.to_path_buf(),
            run: None,
        }
    }

    /// Finds the leader of `run` in the store when `leader` does not answer (after a
    /// takeover).
    pub fn of_run(mut self, run: &str) -> Self {
        self.run = Some(run.to_string());
        self
    }

    /// The leader of `cluster`.
    pub fn of(cluster: &Cluster, ctl: &'a Ctl) -> Self {
        let mut status = Self::new(ctl, &cluster.leader(), &cluster.key_file);
        status.run = Some(cluster.run.clone());
        status
    }

    fn args(&self, json: bool) -> Vec<&str> {
        let mut args = if json { vec!["--json"] } else { Vec::new() };
        args.extend([
            "status",
            "--leader",
            &self.leader,
            "--key-file",
            self.key_file.to_str().expect("a UTF-8 path"),
        ]);
        if let Some(run) = &self.run {
            args.extend(["--run", run]);
        }
        args
    }

    /// What the operator reads; the command must succeed.
    pub fn text(&self) -> String {
        self.ctl.expect(0, &self.args(false))
    }

    /// The same as JSON (null while the leader does not answer).
    pub fn json(&self) -> serde_json::Value {
        let output = self.ctl.run(&self.args(true));
        serde_json::from_slice(&output.stdout).unwrap_or_default()
    }

    /// The pid of a rank of the running world, once it is past `past_step`.
    pub fn rank_pid(&self, rank: u64, past_step: u64) -> u32 {
        let deadline = Instant::now() + Duration::from_secs(120);
        loop {
            let status = self.json();
            let found = status["runs"][0]["ranks"]
                .as_array()
                .and_then(|ranks| ranks.iter().find(|r| r["rank"] == rank).cloned());
            if let Some(r) = found.filter(|r| r["step"].as_u64().unwrap_or(0) > past_step) {
                return r["pid"].as_u64().expect("a pid") as u32;
            }
            assert!(
                Instant::now() < deadline,
                "rank {rank} never passed step {past_step}: {status}"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

/// The kinds of a timeline's events, in order.
pub fn kinds(timeline: &[serde_json::Value]) -> Vec<String> {
    timeline
        .iter()
        .map(|e| e["kind"].as_str().unwrap_or_default().to_string())
        .collect()
}

/// The ranks a rank fault names as the first to die: one ("rank 1 (pid ...) died; ...") or
/// several that died too close together to tell apart ("ranks 0 (pid ...), 1 (pid ...) died
/// within 3 ms of each other; ..."). Empty for any other fault.
pub fn first_dead(fault: &serde_json::Value) -> Vec<u64> {
    let detail = fault["detail"].as_str().unwrap_or_default();
    let Some((named, _)) = detail.split_once(" died") else {
        return Vec::new();
    };
    let Some(named) = named
        .strip_prefix("ranks ")
        .or_else(|| named.strip_prefix("rank "))
    else {
        return Vec::new();
    };
    named
        .split(", ")
        .filter_map(|one| one.split_once(' ')?.0.parse().ok())
        .collect()
}

/// The epoch each commit record in `commits` (a run's `commits` folder, read as files:
/// `<step>.json`, whatever else a server keeps beside them) names, by step; `None` for a
/// record that names none.
pub fn commit_epochs(commits: &Path) -> std::collections::BTreeMap<u64, Option<u64>> {
    let mut epochs = std::collections::BTreeMap::new();
    for entry in std::fs::read_dir(commits).expect("the run has commits") {
        let path = entry.expect("a directory entry").path();
        let name = path
            .file_name()
            .and_then(|n| n.to_str())
            .unwrap_or_default();
        if name.starts_with('.') || !name.ends_with(".json") {
            continue;
        }
        let bytes = std::fs::read(&path).expect("readable");
        let record: serde_json::Value = serde_json::from_slice(&bytes).expect("JSON");
        let body = &record["body"];
        epochs.insert(
            body["step"]["step"].as_u64().expect("a step"),
            body["leader_epoch"].as_u64(),
        );
    }
    epochs
}

#[cfg(test)]
mod tests {
    use super::first_dead;

    #[test]
    fn first_dead_reads_one_rank_or_several_named_together() {
        let fault = |detail: &str| serde_json::json!({ "kind": "fault", "detail": detail });
        assert_eq!(
            first_dead(&fault(
                "rank 1 (pid 7 on n2) died; declared 9 ms after it exited; ranks 0 went down after it"
            )),
            vec![1]
        );
        assert_eq!(
            first_dead(&fault(
                "ranks 0 (pid 6 on n1), 1 (pid 7 on n2) died within 3 ms of each other; declared 9 ms after the first exited"
            )),
            vec![0, 1]
        );
        assert!(first_dead(&fault("node n2 lost: its daemon disconnected")).is_empty());
    }
}
