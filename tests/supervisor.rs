//! The supervising leader: it launches the world itself (with mpiexec, daemons on 127.0.0.1
//! standing for nodes, or with srun on the local Slurm cluster), detects a killed rank, a
//! hung one and a lost node, stops the world, relaunches it, and the ranks restore and
//! continue bit for bit. Also: a restarted leader, preemption and requeue, the shrink policy,
//! stragglers, and a world stuck before its first step. The killed-and-hung rank test, the
//! drain and the preemption run on the local Slurm cluster (as root); the others under
//! mpiexec.

use std::collections::BTreeMap;
use std::path::Path;
use std::process::Command;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use lazarus_tests::cluster::{text_of, Cluster};
use lazarus_tests::runbook::Runbook;
use lazarus_tests::slurm;
use lazarus_tests::supervision::{
    events, first_dead, kill, kinds, now_ms, supervised_by, supervised_on, supervised_with,
    wait_for_event_or, wait_for_event_within, wait_until, Daemons, Status,
};
use lazarus_tests::train::{loss_texts as losses, prepared, reference_run, TrainerArgs};
use lazarus_tests::{bin, Ctl, S3Server};

const STEPS: u64 = 200;

fn trainer_args(dir: &Path, run: &str, store: &str) -> Vec<String> {
    small_args(dir, run, store).build()
}

fn small_args(dir: &Path, run: &str, store: &str) -> TrainerArgs {
    TrainerArgs::small(dir)
        .run(run)
        .steps(STEPS)
        .sets([
            "train.warmup_steps=1000",
            "train.lr=0.5",
            "checkpoint.every=1",
        ])
        .store(store)
}

/// The losses of the same training, uninterrupted, under plain mpiexec with 2 ranks. Every
/// test trains the same data with the same settings, so one run serves the whole process.
fn reference_losses(dir: &Path) -> BTreeMap<u64, String> {
    static REFERENCE: OnceLock<BTreeMap<u64, String>> = OnceLock::new();
    REFERENCE.get_or_init(|| run_reference(dir)).clone()
}

fn run_reference(dir: &Path) -> BTreeMap<u64, String> {
    let reference_store = format!("file://{}", dir.join("reference").display());
    let reference = small_args(dir, "reference", &reference_store)
        .set("checkpoint.every", 100000)
        .build();
    reference_run(dir, 2, &reference)
}

/// `nodes` daemons for `run` (store under `dir/store`, durable every 50 steps); node 1 leads
/// and supervises with `flags` (e.g. `--supervise mpiexec --active-nodes 2`) and the trainer.
fn supervised(
    dir: &Path,
    run: &str,
    nodes: usize,
    flags: &[&str],
    envs: Vec<(String, String)>,
) -> (Cluster, Ctl) {
    let store = format!("file://{}", dir.join("store").display());
    supervised_with(
        dir,
        run,
        nodes,
        flags,
        &trainer_args(dir, run, &store),
        envs,
    )
}

/// What the supervision runbooks read from the environment.
fn runbook_env(cluster: &Cluster, run: &str) -> Vec<(&'static str, String)> {
    vec![
        ("LAZARUS_STORE", cluster.store.clone()),
        (
            "LAZARUS_INDEX",
            cluster.dir.join("index").display().to_string(),
        ),
        ("RUN", run.to_string()),
        ("LEADER", cluster.leader()),
        ("KEY_FILE", cluster.key_file.display().to_string()),
    ]
}

fn wait_for_event(ctl: &Ctl, run: &str, kind: &str, count: usize, cluster: &Cluster) {
    wait_for_event_or(ctl, run, kind, count, || cluster.logs());
}

/// The pid of a rank of the running world, from the leader, once it is past `past_step`.
fn rank_pid(cluster: &Cluster, ctl: &Ctl, rank: u64, past_step: u64) -> u32 {
    Status::of(cluster, ctl).rank_pid(rank, past_step)
}

/// Under srun on the local Slurm cluster where this process may start one (as root), else
/// under mpiexec.
#[test]
fn the_leader_recovers_a_killed_rank_and_a_hung_one_from_t0_bit_for_bit() {
    let slurm = lazarus_tests::exclusive_slurm_cluster();
    let (launcher, envs) = match &slurm {
        Some((conf, _exclusive)) => (
            "srun",
            vec![("SLURM_CONF".to_string(), conf.display().to_string())],
        ),
        None => ("mpiexec", Vec::new()),
    };
    println!("launcher: {launcher}");
    let (_guard, dir) = prepared();
    let expected = reference_losses(&dir);
    let flags = [
        "--supervise",
        launcher,
        "--active-nodes",
        "2",
        "--hang-timeout-seconds",
        "3",
    ];
    let (cluster, ctl) = supervised(&dir, "supervised", 2, &flags, envs);

    // 1. SIGKILL rank 1: detected within 2 s, restarted in place from T0.
    let pid = rank_pid(&cluster, &ctl, 1, 40);
    let killed_ms = now_ms();
    assert!(kill("KILL", pid));
    wait_for_event(&ctl, "supervised", "first_step", 2, &cluster);
    let timeline = events(&ctl, "supervised");
    let fault = timeline.iter().find(|e| e["kind"] == "fault").unwrap();
    let detected_ms = fault["unix_ms"].as_u64().unwrap() - killed_ms;
    println!(
        "killed rank 1 (pid {pid}); the leader declared it after {detected_ms} ms: {}",
        fault["detail"]
    );
    assert!(detected_ms < 2000, "{fault}");
    assert!(
        first_dead(fault).contains(&1),
        "{fault}\n{timeline:#?}\n{}",
        cluster.logs()
    );

    // 2. SIGSTOP rank 0: no progress for 3 s is a hang; the world is stopped and relaunched.
    let pid = rank_pid(&cluster, &ctl, 0, 120);
    let stopped_ms = now_ms();
    assert!(kill("STOP", pid));
    wait_for_event(&ctl, "supervised", "completed", 1, &cluster);
    let timeline = events(&ctl, "supervised");
    let hang = timeline
        .iter()
        .filter(|e| e["kind"] == "fault")
        .nth(1)
        .unwrap();
    let detected_ms = hang["unix_ms"].as_u64().unwrap().saturating_sub(stopped_ms);
    println!(
        "stopped rank 0 (pid {pid}); declared hung after {detected_ms} ms: {}",
        hang["detail"]
    );
    let detail = hang["detail"].as_str().unwrap();
    let why = format!("{hang}\n{timeline:#?}\n{}", cluster.logs());
    assert!(hang["unix_ms"].as_u64().unwrap() > stopped_ms, "{why}");
    assert!(detail.contains("hung"), "{why}");
    // Both ranks stall; the fault points at the one that was stopped.
    assert!(
        detail.contains(&format!("rank 0 (pid {pid} on n1) is stopped")),
        "{why}"
    );
    assert!(detected_ms < 6000, "{why}");
    let kinds: Vec<&str> = timeline
        .iter()
        .map(|e| e["kind"].as_str().unwrap())
        .collect();
    println!("timeline: {kinds:?}");
    for kind in [
        "launch",
        "fault",
        "stopped",
        "relaunch",
        "restored",
        "first_step",
        "completed",
    ] {
        assert!(kinds.contains(&kind), "{kind} missing from {kinds:?}");
    }
    for node in 0..2 {
        assert_eq!(
            cluster.metric(node, "lazarus_ckptd_restores_total{tier=\"t0\"}"),
            2.0,
            "node {node} restored both times from its own memory"
        );
    }
    // Every step's loss, across both restarts, equals the uninterrupted run's.
    let got = losses(&dir, "supervised");
    assert_eq!(got.len(), STEPS as usize);
    assert_eq!(got, expected, "the supervised run continues bit for bit");
    let printed = ctl.expect(0, &["events", "supervised"]);
    println!("{printed}");
}

#[test]
fn a_lost_node_is_replaced_by_a_hot_spare_that_restores_from_the_buddy() {
    let (_guard, dir) = prepared();
    let expected = reference_losses(&dir);
    // Three nodes: n1 and n2 train, n3 is a hot spare.
    let flags = ["--supervise", "mpiexec", "--active-nodes", "2"];
    let (mut cluster, ctl) = supervised(&dir, "spared", 3, &flags, Vec::new());

    // Node 2 dies: its daemon, then its rank.
    let pid = rank_pid(&cluster, &ctl, 1, 60);
    let lost_ms = now_ms();
    cluster.kill_node(1);
    kill("KILL", pid);
    wait_for_event(&ctl, "spared", "completed", 1, &cluster);
    let timeline = events(&ctl, "spared");
    let fault = timeline.iter().find(|e| e["kind"] == "fault").unwrap();
    let detected_ms = fault["unix_ms"].as_u64().unwrap() - lost_ms;
    println!(
        "node n2 killed; declared lost after {detected_ms} ms: {}",
        fault["detail"]
    );
    assert!(
        fault["detail"].as_str().unwrap().contains("node n2 lost"),
        "{fault}"
    );
    assert!(detected_ms < 2000, "{fault}");
    let swap = timeline.iter().find(|e| e["kind"] == "swap").unwrap();
    assert!(swap["detail"].as_str().unwrap().contains("n3"), "{swap}");
    let relaunch = timeline.iter().find(|e| e["kind"] == "relaunch").unwrap();
    assert!(
        relaunch["detail"].as_str().unwrap().contains("n1,n3"),
        "{relaunch}"
    );
    // Rank 1 now runs on the spare, which had nothing: it came from the buddy's replica.
    assert_eq!(
        cluster.metric(2, "lazarus_ckptd_restores_total{tier=\"t1\"}"),
        1.0,
        "{}",
        cluster.logs()
    );
    assert_eq!(
        cluster.metric(0, "lazarus_ckptd_restores_total{tier=\"t0\"}"),
        1.0
    );
    let got = losses(&dir, "spared");
    assert_eq!(got.len(), STEPS as usize);
    assert_eq!(got, expected, "the run continues bit for bit on the spare");
    println!("{}", ctl.expect(0, &["events", "spared"]));
}

/// Several ranks per node under mpiexec (one MPMD block of two per node).
#[test]
fn two_ranks_per_node_restart_in_place_and_move_together_to_a_spare() {
    two_ranks_per_node("mpiexec", Vec::new());
}

/// Several ranks per node under srun (`--ntasks-per-node=2`) on the local Slurm cluster.
#[test]
fn two_ranks_per_node_under_srun_restart_in_place_and_move_together_to_a_spare() {
    let Some((conf, _exclusive)) = lazarus_tests::exclusive_slurm_cluster() else {
        return;
    };
    // The leader drains the lost node in Slurm (the world's second, whichever that is): it
    // serves the other tests again after. Resuming a node that is not drained is refused
    // and harmless.
    struct Resume(std::path::PathBuf);
    impl Drop for Resume {
        fn drop(&mut self) {
            for node in ["n1", "n2", "n3"] {
                let _ = Command::new("scontrol")
                    .env("SLURM_CONF", &self.0)
                    .args(["update", &format!("nodename={node}"), "state=resume"])
                    .stdout(std::process::Stdio::null())
                    .stderr(std::process::Stdio::null())
                    .status();
            }
        }
    }
    let _resume = Resume(conf.clone());
    two_ranks_per_node(
        "srun",
        vec![("SLURM_CONF".to_string(), conf.display().to_string())],
    );
}

/// Several ranks per node: 2 active nodes of 2 ranks, tensor parallel over each node's pair
/// (ranks are numbered node by node, so a TP2 group is one node), and a spare, launched by
/// `launcher`. A killed rank's world restarts in place from the nodes' memory (T0); a lost
/// node's two ranks both move to the spare and restore from the buddy's replicas (T1); the
/// run equals an uninterrupted one bit for bit.
fn two_ranks_per_node(launcher: &str, envs: Vec<(String, String)>) {
    let (_guard, dir) = prepared();
    const STEPS: u64 = 120;
    let layout = ["parallel.tp=2"];
    let reference_store = format!("file://{}", dir.join("reference").display());
    let reference = small_args(&dir, "reference", &reference_store)
        .steps(STEPS)
        .sets(layout)
        .set("checkpoint.every", 100000)
        .build();
    let expected = reference_run(&dir, 4, &reference);

    let store = format!("file://{}", dir.join("store").display());
    let args = small_args(&dir, "pairs", &store)
        .steps(STEPS)
        .sets(layout)
        .build();
    let flags = [
        "--supervise",
        launcher,
        "--active-nodes",
        "2",
        "--ranks-per-node",
        "2",
    ];
    let (mut cluster, ctl) = supervised_with(&dir, "pairs", 3, &flags, &args, envs);

    // 1. Rank 1 (n1's second rank) is killed: the world restarts in place from T0.
    let pid = rank_pid(&cluster, &ctl, 1, 30);
    assert!(kill("KILL", pid));
    wait_for_event(&ctl, "pairs", "first_step", 2, &cluster);
    let timeline = events(&ctl, "pairs");
    let fault = timeline.iter().find(|e| e["kind"] == "fault").unwrap();
    // Rank 1 is named; first, unless its daemon saw it go more than 20 ms after another
    // node's daemon saw the peers the launcher aborted go (a loaded two-core machine).
    let detail = fault["detail"].as_str().unwrap_or_default();
    let later_names_1 = detail
        .split_once("; ranks ")
        .is_some_and(|(_, later)| later.split([',', ' ']).any(|r| r == "1"));
    assert!(
        first_dead(fault).contains(&1) || later_names_1,
        "{fault}\n{timeline:#?}\n{}",
        cluster.logs()
    );

    // 2. The world's second node dies with both its ranks (2 and 3): the spare takes them.
    // Which two of n1, n2 and n3 the leader launched on depends on the order their daemons
    // linked to it: the launch event says ("mpiexec on n1,n2 (launcher pid P)").
    let launched = detail_of(&timeline, "launch");
    let active: Vec<String> = launched
        .split_once(" on ")
        .and_then(|(_, nodes)| nodes.split_whitespace().next())
        .unwrap_or_default()
        .split(',')
        .map(str::to_string)
        .collect();
    assert_eq!(active.len(), 2, "{launched}");
    let index = |node: &str| -> usize { node[1..].parse::<usize>().unwrap() - 1 };
    let spare = ["n1", "n2", "n3"]
        .into_iter()
        .find(|n| !active.iter().any(|a| a == n))
        .unwrap();
    let pids = [2, 3].map(|rank| rank_pid(&cluster, &ctl, rank, 70));
    cluster.kill_node(index(&active[1]));
    for pid in pids {
        kill("KILL", pid);
    }
    wait_for_event(&ctl, "pairs", "completed", 1, &cluster);
    let timeline = events(&ctl, "pairs");
    println!("{}", ctl.expect(0, &["events", "pairs"]));
    let lost = timeline
        .iter()
        .filter(|e| e["kind"] == "fault")
        .nth(1)
        .unwrap();
    assert!(
        lost["detail"]
            .as_str()
            .unwrap()
            .contains(&format!("node {} lost", active[1])),
        "{lost}"
    );
    let relaunch = timeline
        .iter()
        .filter(|e| e["kind"] == "relaunch")
        .nth(1)
        .unwrap();
    let relaunched = relaunch["detail"].as_str().unwrap();
    assert!(
        relaunched.contains(active[0].as_str())
            && relaunched.contains(spare)
            && !relaunched.contains(active[1].as_str()),
        "{relaunch}"
    );
    // Both of the lost node's ranks came to the spare from the buddy's replicas; the first
    // node's two ranks restored from their own memory both times.
    assert_eq!(
        cluster.metric(index(spare), "lazarus_ckptd_restores_total{tier=\"t1\"}"),
        2.0,
        "{}",
        cluster.logs()
    );
    assert_eq!(
        cluster.metric(
            index(&active[0]),
            "lazarus_ckptd_restores_total{tier=\"t0\"}"
        ),
        4.0,
        "{}",
        cluster.logs()
    );
    let got = losses(&dir, "pairs");
    assert_eq!(got.len(), STEPS as usize);
    assert_eq!(got, expected, "the run continues bit for bit");
}

/// A world that never gets going (here a rank stops itself before it reaches its daemon, as
/// a rank stuck in MPI init would) is hung once `startup_timeout_seconds` has passed, not
/// only once it has made steps; the relaunched world trains to the end. The hang timeout is
/// 5 s, not less: on a loaded two-core runner a healthy world once went 2 s without a step
/// and was relaunched a second time.
#[test]
fn a_world_stuck_before_its_first_step_is_hung_after_the_startup_timeout() {
    let (_guard, dir) = prepared();
    let wrapper = dir.join("stops-once.sh");
    let marker = dir.join("stopped-once");
    std::fs::write(
        &wrapper,
        format!(
            "#!/bin/sh\nif mkdir {marker} 2>/dev/null; then kill -STOP $$; fi\nexec {trainer} \"$@\"\n",
            marker = marker.display(),
            trainer = bin("trainer").display()
        ),
    )
    .unwrap();
    std::fs::set_permissions(
        &wrapper,
        std::os::unix::fs::PermissionsExt::from_mode(0o755),
    )
    .unwrap();
    let wrapper_path = wrapper.display().to_string();
    let flags = [
        "--supervise",
        "mpiexec",
        "--active-nodes",
        "2",
        "--hang-timeout-seconds",
        "5",
        "--startup-timeout-seconds",
        "10",
        "--trainer",
        &wrapper_path,
    ];
    let (cluster, ctl) = supervised(&dir, "stuck", 2, &flags, Vec::new());
    wait_for_event(&ctl, "stuck", "completed", 1, &cluster);
    let timeline = events(&ctl, "stuck");
    println!("{}", ctl.expect(0, &["events", "stuck"]));
    let why = format!("{timeline:#?}\n{}", cluster.logs());
    let at = |kind: &str| {
        timeline
            .iter()
            .find(|e| e["kind"] == kind)
            .and_then(|e| e["unix_ms"].as_u64())
            .unwrap_or_else(|| panic!("no {kind} event: {why}"))
    };
    let fault = timeline.iter().find(|e| e["kind"] == "fault").unwrap();
    let detail = fault["detail"].as_str().unwrap();
    assert!(detail.starts_with("hung while starting"), "{why}");
    let waited_ms = at("fault") - at("launch");
    assert!(
        (10_000..14_000).contains(&waited_ms),
        "the startup limit (10 s), not the hang timeout (5 s), applies: {waited_ms} ms\n{why}"
    );
    assert_eq!(
        kinds(&timeline).iter().filter(|k| *k == "relaunch").count(),
        1,
        "{why}"
    );
    assert!(ctl.committed("stuck").contains(&STEPS), "{why}");
}

/// The trainer's arguments with a learning rate below the minimum one: `trainer train`
/// refuses the config (exit 2).
fn refused_config_args(dir: &Path, run: &str) -> Vec<String> {
    let store = format!("file://{}", dir.join("store").display());
    small_args(dir, run, &store)
        .set("train.lr", "0.00001")
        .set("train.min_lr", "0.001")
        .build()
}

/// A configuration error is the trainer's exit 2 on every rank: a relaunch would refuse it
/// too, so the leader records `failed` once, relaunches nothing, raises its alert gauge and
/// ends supervision (its daemon exits non-zero).
#[test]
fn a_trainer_that_refuses_its_configuration_is_reported_once_and_never_relaunched() {
    let (_guard, dir) = prepared();
    let args = refused_config_args(&dir, "refused");
    let flags = [
        "--supervise",
        "mpiexec",
        "--active-nodes",
        "2",
        "--exit-when-done",
    ];
    let (mut cluster, ctl) = supervised_with(&dir, "refused", 2, &flags, &args, Vec::new());
    wait_for_event(&ctl, "refused", "failed", 1, &cluster);
    let failed_at = Instant::now();
    let timeline = events(&ctl, "refused");
    let why = format!("{timeline:#?}\n{}", cluster.logs());
    let failed = timeline.iter().find(|e| e["kind"] == "failed").unwrap();
    assert!(
        failed["detail"]
            .as_str()
            .unwrap()
            .starts_with("the trainer refused its configuration or data"),
        "{why}"
    );
    // The leader's log holds the ranks' own words.
    assert!(cluster.log(0).contains("invalid config"), "{why}");
    // Once, and nothing after it: no relaunch, however long one waits.
    wait_leader_exit(&mut cluster, failed_at + Duration::from_secs(5));
    std::thread::sleep(Duration::from_secs(1));
    let kinds = kinds(&events(&ctl, "refused"));
    assert_eq!(kinds, ["launch", "failed"], "{why}");
    assert!(
        cluster
            .log(0)
            .contains("the run failed and was not relaunched"),
        "{why}"
    );
    // The runbook's confirmation shows the cause.
    let runbook = Runbook::load("run-failed.md");
    let env = runbook_env(&cluster, "refused");
    let confirmed = runbook.run("Confirm", &env);
    assert!(confirmed.contains("failed"), "{confirmed}");
}

/// The health tests' runs: long enough to go bad at step 70 or 80 and train on after it.
const HEALTH_STEPS: u64 = 120;

/// The step a `rolled_back` event's detail names ("to durable step N, ...").
fn rolled_back_to(detail: &str) -> Option<u64> {
    detail
        .strip_prefix("to durable step ")?
        .split(',')
        .next()?
        .parse()
        .ok()
}

/// Waits until the leader of `cluster` exits (it runs with `--exit-when-done`), at the
/// latest by `deadline`.
fn wait_leader_exit(cluster: &mut Cluster, deadline: Instant) {
    while !cluster.node_exited(0) {
        assert!(
            Instant::now() < deadline,
            "the leader kept running\n{}",
            cluster.logs()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// A run of `args` supervised on two nodes, test faults allowed, by a leader (with `extra`
/// flags) that exits when supervision ends.
fn supervised_with_faults(
    dir: &Path,
    run: &str,
    args: &[String],
    extra: &[&str],
) -> (Cluster, Ctl) {
    let mut flags = vec![
        "--supervise",
        "mpiexec",
        "--active-nodes",
        "2",
        "--exit-when-done",
    ];
    flags.extend(extra);
    let envs = vec![("LAZARUS_ALLOW_TEST_FAULTS".to_string(), "1".to_string())];
    supervised_with(dir, run, 2, &flags, args, envs)
}

/// The detail of the first `kind` event of `timeline` ("" when there is none).
fn detail_of(timeline: &[serde_json::Value], kind: &str) -> String {
    timeline
        .iter()
        .find(|e| e["kind"] == kind)
        .and_then(|e| e["detail"].as_str())
        .unwrap_or_default()
        .to_string()
}

/// A trainer that crashes every time it reaches step 80: the world fails there, is
/// relaunched from its memory-committed step and fails there again; the leader then rolls it
/// back once to the newest older durable step (about 50, from storage), and when it fails at the
/// same step a third time, stops with `failed`, raises its alert and exits non-zero. Three
/// launches in all, however long one waits.
#[test]
fn a_trainer_that_crashes_at_the_same_step_is_rolled_back_once_then_stopped() {
    let (_guard, dir) = prepared();
    let store = format!("file://{}", dir.join("store").display());
    let args = small_args(&dir, "crashing", &store)
        .set("test_faults.crash_at_step", 80)
        .set("test_faults.crash_rank", 1)
        .build();
    let (mut cluster, ctl) = supervised_with_faults(&dir, "crashing", &args, &[]);
    wait_for_event(&ctl, "crashing", "failed", 1, &cluster);
    wait_leader_exit(&mut cluster, Instant::now() + Duration::from_secs(5));
    std::thread::sleep(Duration::from_secs(1));
    let timeline = events(&ctl, "crashing");
    let why = format!("{timeline:#?}\n{}", cluster.logs());
    let kinds = kinds(&timeline);
    let count = |kind: &str| kinds.iter().filter(|k| *k == kind).count();
    assert_eq!(count("launch") + count("relaunch"), 3, "{why}");
    assert_eq!(count("fault"), 3, "{why}");
    assert_eq!(count("rolled_back"), 1, "{why}");
    assert_eq!(kinds.last().map(String::as_str), Some("failed"), "{why}");
    assert!(cluster.log(0).contains("crash_at_step = 80"), "{why}");
    let detail = |kind: &str| detail_of(&timeline, kind);
    assert!(
        detail("failed").contains("failed there again after the supervisor rolled it back"),
        "{why}"
    );
    // Each world got to step 79; the third restored step 50 from storage (the second died
    // before every rank had said it restored).
    let restored = timeline
        .iter()
        .filter(|e| e["kind"] == "restored")
        .filter_map(|e| e["detail"].as_str())
        .next_back()
        .unwrap_or_default();
    // The durable step is the first at or past 50 (a snapshot skipped while a daemon was busy
    // moves it on by one).
    let back_to: u64 = restored
        .strip_prefix("every rank is at step ")
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|step| step.parse().ok())
        .unwrap_or_else(|| panic!("{why}"));
    assert!((50..60).contains(&back_to), "{why}");
    assert!(restored.contains("from T2"), "{why}");
    assert!(
        detail("rolled_back").contains(&format!("relaunched from durable step {back_to},")),
        "{why}"
    );
    // The run stopped where it was: nothing past the crash was logged or committed.
    assert_eq!(losses(&dir, "crashing").len(), 79, "{why}");
    ctl.expect(0, &["verify", "crashing", "--all", "--read-data"]);
}

/// A NaN in one rank's gradient at step 70 fails the health check: the leader stops the
/// world, rolls it back to the newest durable step (about 50) and has it skip the data up to
/// step 70, and the run completes. Its continuation equals, bit for bit, a run started from
/// the same step with as many batches skipped by `--skip-batches`.
#[test]
fn a_nan_gradient_is_rolled_back_and_its_data_skipped_bit_for_bit() {
    let (_guard, dir) = prepared();
    let store = format!("file://{}", dir.join("store").display());
    let args = small_args(&dir, "nan", &store)
        .steps(HEALTH_STEPS)
        .set("test_faults.nan_at_step", 70)
        .set("test_faults.nan_rank", 1)
        .build();
    let (mut cluster, ctl) = supervised_with_faults(&dir, "nan", &args, &[]);
    wait_for_event(&ctl, "nan", "completed", 1, &cluster);
    wait_leader_exit(&mut cluster, Instant::now() + Duration::from_secs(30));
    let timeline = events(&ctl, "nan");
    let why = format!("{timeline:#?}\n{}", cluster.logs());
    let detail = |kind: &str| detail_of(&timeline, kind);
    // Every rank sees the NaN in the reduced gradient norm; the leader names the rank whose
    // report reached it first, which is a race between the two nodes.
    let unhealthy = detail("unhealthy");
    assert!(
        ["rank 0", "rank 1"]
            .map(|rank| format!("{rank} at step 70: the gradient norm is NaN"))
            .contains(&unhealthy),
        "{why}"
    );
    // The newest durable step: 50, or 51 when the step-50 snapshot was skipped while a
    // daemon was busy. The skip covers the data up to the bad step.
    let back_to = rolled_back_to(&detail("rolled_back")).unwrap_or_else(|| panic!("{why}"));
    assert!((50..60).contains(&back_to), "{why}");
    let skip = 70 - back_to;
    assert!(
        detail("skipped_data").starts_with(&format!(
            "after step {back_to} the ranks skip {skip} global batches"
        )),
        "{why}"
    );
    assert_eq!(
        kinds(&timeline).iter().filter(|k| *k == "fault").count(),
        0,
        "{why}"
    );
    ctl.expect(0, &["verify", "nan", "--all", "--read-data"]);

    // The same start by hand, without daemons: the steps up to that one, then a resume that
    // skips as many batches.
    let by_hand = format!("file://{}", dir.join("by-hand").display());
    let phase = |steps: u64, extra: &[&str]| {
        let mut args = small_args(&dir, "skipped", &by_hand).steps(steps).build();
        args.extend(extra.iter().map(|a| a.to_string()));
        let output = Command::new("mpiexec")
            .args(["-n", "2"])
            .arg(bin("trainer"))
            .args(&args)
            .output()
            .expect("mpiexec runs");
        let text = text_of(&output);
        assert!(output.status.success(), "{text}");
        text
    };
    phase(back_to, &[]);
    let said = phase(HEALTH_STEPS, &["--skip-batches", &skip.to_string()]);
    assert!(
        said.contains(&format!(
            "skipping {skip} global batches of data after step {back_to}"
        )),
        "{said}"
    );
    let expected = losses(&dir, "skipped");
    let got = losses(&dir, "nan");
    assert_eq!(got.len(), HEALTH_STEPS as usize, "{why}");
    assert_eq!(got, expected, "{why}");
}

/// A window of garbage data makes the loss spike at step 80 (spike rule on from step 40, at 9
/// standard deviations, where this small model's noisiest clean step reached 6): detected
/// (by any rank: they all see the summed loss), rolled back to step 50 or so, and the next 40
/// batches skipped, past the window; the run completes with no spike in what it logged.
#[test]
fn a_loss_spike_from_garbage_data_is_rolled_back_and_skipped() {
    let (_guard, dir) = prepared();
    let store = format!("file://{}", dir.join("store").display());
    let args = small_args(&dir, "spike", &store)
        .steps(HEALTH_STEPS)
        .sets([
            "health.spike_sigma=9",
            "health.spike_window=20",
            "health.spike_after_step=40",
            "test_faults.garbage_at_step=80",
            "test_faults.garbage_steps=3",
        ])
        .build();
    let flags = ["--skip-batches", "40"];
    let (mut cluster, ctl) = supervised_with_faults(&dir, "spike", &args, &flags);
    wait_for_event(&ctl, "spike", "completed", 1, &cluster);
    wait_leader_exit(&mut cluster, Instant::now() + Duration::from_secs(30));
    let timeline = events(&ctl, "spike");
    let why = format!("{timeline:#?}\n{}", cluster.logs());
    let detail = |kind: &str| detail_of(&timeline, kind);
    // Every rank sees the same (summed) loss; whichever rank's report reaches the leader
    // first is the one named.
    let unhealthy = detail("unhealthy");
    assert!(
        unhealthy.starts_with("rank ") && unhealthy.contains(" at step 80: a loss spike"),
        "{why}"
    );
    let back_to = rolled_back_to(&detail("rolled_back")).unwrap_or_else(|| panic!("{why}"));
    assert!((50..60).contains(&back_to), "{why}");
    assert!(
        detail("skipped_data").starts_with(&format!(
            "after step {back_to} the ranks skip 40 global batches"
        )),
        "{why}"
    );
    let kinds = kinds(&timeline);
    assert_eq!(
        kinds.iter().filter(|k| *k == "unhealthy").count(),
        1,
        "{why}"
    );
    let logged: Vec<f64> = losses(&dir, "spike")
        .values()
        .map(|l| l.parse().unwrap())
        .collect();
    assert_eq!(logged.len(), HEALTH_STEPS as usize, "{why}");
    // The garbage's loss was about 13.5; the clean data's stays below 9 in these runs.
    let worst = logged.iter().cloned().fold(f64::MIN, f64::max);
    assert!(worst < 11.0, "a spike was logged: {logged:?}\n{why}");
    ctl.expect(0, &["verify", "spike", "--all", "--read-data"]);
}

/// A bad memory cell on node n2 flips one bit of its rank's copy of a replicated weight
/// after step 70. Three data-parallel ranks hold that weight, so the check after step 70
/// (in step 71, before its update) names rank 1 and the tensor; the leader drains n2, rolls
/// back to the newest durable step at or before step 60 (the last state every copy agreed
/// on), and relaunches with the spare in n2's place. The run completes bit for bit as an
/// uninterrupted one.
#[test]
fn a_flipped_bit_in_one_copy_of_a_weight_is_found_its_node_replaced_and_the_run_continues() {
    let (_guard, dir) = prepared();
    let steps = 100;
    let reference_store = format!("file://{}", dir.join("reference").display());
    let reference = small_args(&dir, "reference", &reference_store)
        .steps(steps)
        .set("checkpoint.every", 100000)
        .build();
    let expected = reference_run(&dir, 3, &reference);
    let store = format!("file://{}", dir.join("store").display());
    let args = small_args(&dir, "flipped", &store)
        .steps(steps)
        .sets([
            "checkpoint.busy=wait",
            "health.sdc_check_every=10",
            "test_faults.flip_after_step=70",
            "test_faults.flip_socket=/n2.sock",
        ])
        .build();
    // n1, n2 and n3 train; n4 is the spare.
    let flags = ["--supervise", "mpiexec", "--active-nodes", "3"];
    let envs = vec![("LAZARUS_ALLOW_TEST_FAULTS".to_string(), "1".to_string())];
    let (cluster, ctl) = supervised_with(&dir, "flipped", 4, &flags, &args, envs);
    wait_for_event(&ctl, "flipped", "completed", 1, &cluster);
    let timeline = events(&ctl, "flipped");
    let why = format!("{timeline:#?}\n{}", cluster.logs());
    let detail = |kind: &str| detail_of(&timeline, kind);
    assert!(cluster.log(0).contains("flipped a bit of embed"), "{why}");
    assert!(
        detail("sdc_mismatch").contains(
            "at step 71: silent data corruption: rank 1's copy of embed differs from the other 2 copies"
        ),
        "{why}"
    );
    assert!(
        detail("drained").starts_with("n2 suspected of silent data corruption"),
        "{why}"
    );
    let back_to = rolled_back_to(&detail("rolled_back")).unwrap_or_else(|| panic!("{why}"));
    assert!((50..=60).contains(&back_to), "{why}");
    // The first world took three of the four nodes (those that connected first); the one
    // left out is the spare, and takes n2's place.
    let launched: Vec<String> = timeline
        .iter()
        .find(|e| e["kind"] == "launch")
        .and_then(|e| serde_json::from_value(e["nodes"].clone()).ok())
        .unwrap_or_else(|| panic!("{why}"));
    let spare = ["n1", "n2", "n3", "n4"]
        .into_iter()
        .find(|n| !launched.iter().any(|l| l == n))
        .unwrap_or_else(|| panic!("{why}"));
    assert!(detail("swap").contains(spare), "{why}");
    let relaunched: Vec<&str> = launched
        .iter()
        .map(|n| if n == "n2" { spare } else { n.as_str() })
        .collect();
    let relaunch = timeline
        .iter()
        .filter(|e| e["kind"] == "relaunch")
        .filter_map(|e| e["detail"].as_str())
        .next_back()
        .unwrap_or_default();
    assert!(relaunch.contains(&relaunched.join(",")), "{why}");
    assert_eq!(
        cluster.metric(0, "lazarus_ckptd_supervisor_sdc_mismatches_total"),
        1.0,
        "{why}"
    );
    assert_eq!(
        cluster.metric(0, "lazarus_ckptd_nodes_drained"),
        1.0,
        "{why}"
    );
    let got = losses(&dir, "flipped");
    assert_eq!(got.len(), steps as usize, "{why}");
    assert_eq!(got, expected, "the run continues bit for bit\n{why}");
    ctl.expect(0, &["verify", "flipped", "--all", "--read-data"]);
    let runbook = Runbook::load("silent-data-corruption.md");
    let confirmed = runbook.run("Confirm", &runbook_env(&cluster, "flipped"));
    assert!(confirmed.contains("sdc_mismatch"), "{confirmed}");
    assert!(confirmed.contains("drained n2"), "{confirmed}");
}

/// A restored state that is not what the run had: every rank shifts the weights it restored
/// from a step after 50 (a test fault). The world loses a rank once rank 0 logged step 73, and
/// restores its memory-committed step 70; the first step after it does not repeat the loss
/// the leader heard for that step before the fault, so the leader falls back to the durable
/// step 50, and the run completes bit for bit as an uninterrupted one.
///
/// The kill waits for step 73 because the check needs the loss of step 71 at the leader: a
/// daemon sends it at once as the step after a snapshot, during step 72. Killed right after a
/// snapshot's commit, a world can die before anyone heard the next step's loss, and then there
/// is nothing to check the restore against. And a fault at step 71 itself would count with
/// the mismatch there as the same step failing twice (`same_step_failures`).
#[test]
fn a_restored_state_whose_first_step_does_not_repeat_its_loss_falls_back_to_an_older_step() {
    let (_guard, dir) = prepared();
    let expected = reference_losses(&dir);
    let store = format!("file://{}", dir.join("store").display());
    let args = small_args(&dir, "shifted", &store)
        .sets([
            "checkpoint.every=10",
            "checkpoint.busy=wait",
            "test_faults.perturb_restore_after_step=50",
        ])
        .build();
    let flags = ["--supervise", "mpiexec", "--active-nodes", "2"];
    let envs = vec![("LAZARUS_ALLOW_TEST_FAULTS".to_string(), "1".to_string())];
    let (cluster, ctl) = supervised_with(&dir, "shifted", 2, &flags, &args, envs);
    let pid = rank_pid(&cluster, &ctl, 1, 60);
    wait_until(
        Duration::from_secs(120),
        Duration::from_millis(5),
        || format!("step 73 was never logged\n{}", cluster.logs()),
        || {
            losses(&dir, "shifted")
                .keys()
                .next_back()
                .is_some_and(|step| *step >= 73)
        },
    );
    assert!(kill("KILL", pid));
    wait_for_event(&ctl, "shifted", "completed", 1, &cluster);
    let timeline = events(&ctl, "shifted");
    let why = format!("{timeline:#?}\n{}", cluster.logs());
    let detail = |kind: &str| detail_of(&timeline, kind);
    assert!(
        cluster.log(0).contains("perturb_restore_after_step = 50"),
        "{why}"
    );
    let mismatch = detail("restore_mismatch");
    assert!(
        mismatch.contains("the first step after restoring step ")
            && mismatch.contains("the restored state is not what the run had"),
        "{why}"
    );
    assert_eq!(rolled_back_to(&detail("rolled_back")), Some(50), "{why}");
    assert_eq!(
        kinds(&timeline)
            .iter()
            .filter(|k| *k == "restore_mismatch")
            .count(),
        1,
        "{why}"
    );
    let got = losses(&dir, "shifted");
    assert_eq!(got.len(), STEPS as usize, "{why}");
    assert_eq!(got, expected, "the run continues bit for bit\n{why}");
}

/// The leader's alert gauge for a failed run: 1 after it gave up (read from a leader that
/// stays up, without `--exit-when-done`).
#[test]
fn a_failed_run_raises_the_leaders_alert_gauge() {
    let (_guard, dir) = prepared();
    let args = refused_config_args(&dir, "gauge");
    let flags = ["--supervise", "mpiexec", "--active-nodes", "2"];
    let (cluster, ctl) = supervised_with(&dir, "gauge", 2, &flags, &args, Vec::new());
    assert_eq!(cluster.metric(0, "lazarus_ckptd_run_failed"), 0.0);
    wait_for_event(&ctl, "gauge", "failed", 1, &cluster);
    assert_eq!(cluster.metric(0, "lazarus_ckptd_run_failed"), 1.0);
}

#[test]
fn a_rank_killed_while_the_store_hangs_restores_from_memory_in_seconds() {
    let (_guard, dir) = prepared();
    let expected = reference_losses(&dir);
    let s3 = S3Server::start();
    let store = s3.url("hung");
    let flags = ["--supervise", "mpiexec", "--active-nodes", "2"];
    let args = trainer_args(&dir, "hung", &store);
    let (cluster, ctl) = supervised_on(&store, &dir, "hung", 2, &flags, &args, s3.envs());
    rank_pid(&cluster, &ctl, 1, 55);
    wait_until(
        Duration::from_secs(120),
        Duration::from_millis(100),
        || cluster.logs(),
        || ctl.committed("hung").iter().any(|s| *s >= 50),
    );
    let ranks = |status: &serde_json::Value| -> Vec<(u64, u64)> {
        status["runs"][0]["ranks"]
            .as_array()
            .map(|ranks| {
                ranks
                    .iter()
                    .map(|r| (r["pid"].as_u64().unwrap(), r["step"].as_u64().unwrap()))
                    .collect()
            })
            .unwrap_or_default()
    };
    let before = ranks(&Status::of(&cluster, &ctl).json());
    assert_eq!(before.len(), 2, "{before:?}");

    // The store stops answering (a hung S3 endpoint), then rank 1 is killed. Detection,
    // relaunch and the restore from T0 must not wait for the store.
    assert!(kill("STOP", s3.pid()));
    let killed = Instant::now();
    assert!(kill("KILL", before[1].0));
    loop {
        let status = Status::of(&cluster, &ctl).json();
        let now = ranks(&status);
        let recovered = now.len() == 2
            && now
                .iter()
                .zip(&before)
                .all(|((pid, step), (old_pid, old_step))| pid != old_pid && step > old_step);
        if recovered {
            break;
        }
        if killed.elapsed() > Duration::from_secs(20) {
            kill("CONT", s3.pid());
            panic!(
                "not recovered from memory 20 s after the kill, with the store hung: {status}\n{}",
                cluster.logs()
            );
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    println!(
        "with the store hung, the world was training again {} ms after the kill",
        killed.elapsed().as_millis()
    );
    assert!(kill("CONT", s3.pid()));

    // The store is back: the run completes durable, bit for bit.
    wait_for_event(&ctl, "hung", "completed", 1, &cluster);
    for node in 0..2 {
        assert_eq!(
            cluster.metric(node, "lazarus_ckptd_restores_total{tier=\"t0\"}"),
            1.0,
            "node {node} restored from its own memory\n{}",
            cluster.logs()
        );
    }
    assert_eq!(losses(&dir, "hung"), expected, "bit for bit");
    assert!(ctl.committed("hung").contains(&STEPS));
    ctl.expect(0, &["verify", "hung", "--all", "--read-data"]);
}

#[test]
fn under_slurm_a_lost_node_is_drained_and_a_spare_takes_over() {
    let Some((conf, _exclusive)) = lazarus_tests::exclusive_slurm_cluster() else {
        return;
    };
    let (_guard, dir) = prepared();
    let envs = vec![("SLURM_CONF".to_string(), conf.display().to_string())];
    let flags = ["--supervise", "srun", "--active-nodes", "2"];
    let (mut cluster, ctl) = supervised(&dir, "slurm", 3, &flags, envs);
    let pid = rank_pid(&cluster, &ctl, 1, 60);
    // Node n2 dies whole: its slurmd, its daemon and its rank.
    assert!(slurm::kill_slurmd(&conf, "n2"));
    cluster.kill_node(1);
    kill("KILL", pid);
    wait_for_event(&ctl, "slurm", "completed", 1, &cluster);
    let timeline = events(&ctl, "slurm");
    let kinds: Vec<&str> = timeline
        .iter()
        .map(|e| e["kind"].as_str().unwrap())
        .collect();
    println!("{}", ctl.expect(0, &["events", "slurm"]));
    assert!(kinds.contains(&"swap"), "{kinds:?}");
    let relaunch = timeline.iter().find(|e| e["kind"] == "relaunch").unwrap();
    assert!(
        relaunch["detail"]
            .as_str()
            .unwrap()
            .contains("srun on n1,n3"),
        "{relaunch}"
    );
    let sinfo = Command::new("sinfo")
        .env("SLURM_CONF", &conf)
        .args(["-h", "-N", "-n", "n2", "-o", "%t %E"])
        .output()
        .unwrap();
    let state = text_of(&sinfo);
    println!("n2 in Slurm: {state}");
    // "drng" (draining) while Slurm still tears down a step on it: no new job goes there
    // either way.
    assert!(
        state.contains("drain") || state.contains("drng"),
        "n2 is drained: {state}"
    );
    assert!(state.contains("lazarus"), "with the reason: {state}");
    assert!(kinds.contains(&"drained"), "{kinds:?}");
    assert_eq!(
        cluster.metric(2, "lazarus_ckptd_restores_total{tier=\"t1\"}"),
        1.0,
        "the spare restored rank 1 from its buddy's replica\n{}",
        cluster.logs()
    );
    let status = Status::of(&cluster, &ctl).text();
    assert!(
        status.contains("active n1,n3, spares -, drained n2"),
        "{status}"
    );
    assert_eq!(losses(&dir, "slurm").len(), STEPS as usize);

    // The runbook: confirm, repair the node (its slurmd and ckptd back), return it to Slurm.
    let runbook = Runbook::load("node-failure.md");
    let mut env = runbook_env(&cluster, "slurm");
    env.push(("NODE", "n2".into()));
    env.push(("SLURM_CONF", conf.display().to_string()));
    let confirmed = runbook.run("Confirm", &env);
    assert!(confirmed.contains("node n2 lost"), "{confirmed}");
    assert!(confirmed.contains("lazarus: node lost"), "{confirmed}");
    assert!(slurm::start_slurmd(&conf, "n2"));
    cluster.start_node(1);
    runbook.run("Return the node", &env);
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let verified = runbook.run("Verify it worked", &env);
        let state = verified
            .lines()
            .find(|l| l.starts_with("n2 "))
            .unwrap_or_default()
            .to_string();
        if ["idle", "mix", "alloc"].iter().any(|s| state.contains(s)) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "n2 did not come back: {verified}"
        );
        std::thread::sleep(Duration::from_millis(500));
    }
}

#[test]
fn two_failures_in_a_row_and_no_spare_left_wait_then_recover() {
    let (_guard, dir) = prepared();
    let flags = ["--supervise", "mpiexec", "--active-nodes", "2"];
    let (mut cluster, ctl) = supervised(&dir, "twice", 2, &flags, Vec::new());

    // 1. Rank 1 dies; as soon as the relaunched world registers, rank 0 dies too, before
    //    its first step: the second failure hits the recovery from the first.
    let pid = rank_pid(&cluster, &ctl, 1, 30);
    assert!(kill("KILL", pid));
    wait_for_event(&ctl, "twice", "relaunch", 1, &cluster);
    let again = rank_pid(&cluster, &ctl, 0, 0);
    assert!(kill("KILL", again));
    wait_for_event(&ctl, "twice", "relaunch", 2, &cluster);

    // 2. Node 2 is lost with no spare: the leader waits (the default policy) until a node
    //    comes back, then relaunches.
    let pid = rank_pid(&cluster, &ctl, 1, 100);
    cluster.kill_node(1);
    kill("KILL", pid);
    wait_for_event(&ctl, "twice", "waiting", 1, &cluster);
    let runbook = Runbook::load("spares-exhausted.md");
    let env = runbook_env(&cluster, "twice");
    let confirmed = runbook.run("Confirm", &env);
    assert!(confirmed.contains("waiting"), "{confirmed}");
    assert!(confirmed.contains("spares -"), "{confirmed}");
    let first_steps = kinds(&events(&ctl, "twice"))
        .iter()
        .filter(|k| *k == "first_step")
        .count();
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(
        events(&ctl, "twice")
            .iter()
            .filter(|e| e["kind"] == "relaunch")
            .count(),
        2,
        "no relaunch without a node"
    );
    // The fix: the node's ckptd is back.
    cluster.start_node(1);
    wait_for_event(&ctl, "twice", "first_step", first_steps + 1, &cluster);
    let verified = runbook.run("Verify it worked", &env);
    assert!(verified.contains("relaunch"), "{verified}");
    wait_for_event(&ctl, "twice", "completed", 1, &cluster);
    let timeline = events(&ctl, "twice");
    let kinds: Vec<&str> = timeline
        .iter()
        .map(|e| e["kind"].as_str().unwrap())
        .collect();
    println!("{}", ctl.expect(0, &["events", "twice"]));
    assert_eq!(
        kinds.iter().filter(|k| **k == "fault").count(),
        3,
        "{kinds:?}"
    );
    assert_eq!(
        kinds.iter().filter(|k| **k == "relaunch").count(),
        3,
        "{kinds:?}"
    );
    assert_eq!(losses(&dir, "twice").len(), STEPS as usize);
    ctl.expect(0, &["verify", "twice", "--all", "--read-data"]);
}

#[test]
fn a_restarted_leader_adopts_the_running_world_and_supervision_resumes() {
    let (_guard, dir) = prepared();
    let expected = reference_losses(&dir);
    let flags = ["--supervise", "mpiexec", "--active-nodes", "2"];
    let (mut cluster, ctl) = supervised(&dir, "adopted", 2, &flags, Vec::new());

    // Past the first durable step, the leader's daemon dies; the world keeps training.
    let before = past_first_durable(&cluster, &ctl, "adopted");
    cluster.kill_node(0);
    std::thread::sleep(Duration::from_millis(500));
    cluster.start_node(0);
    wait_for_event(&ctl, "adopted", "adopted", 1, &cluster);

    // Supervision resumes: a rank killed now is detected and the world recovered.
    let pid = rank_pid(&cluster, &ctl, 1, 110);
    assert!(kill("KILL", pid));
    wait_for_event(&ctl, "adopted", "completed", 1, &cluster);
    let timeline = events(&ctl, "adopted");
    let shown = ctl.expect(0, &["events", "adopted"]);
    println!("{shown}");
    let kinds = kinds(&timeline);
    let count = |kind: &str| kinds.iter().filter(|k| *k == kind).count();
    assert_eq!(count("launch"), 1, "no second world: {kinds:?}");
    assert_eq!(count("adopted"), 1, "{kinds:?}");
    // The timeline names the restarted leader's new epoch, after the one it lost, and times
    // the succession as a takeover's.
    let find = |kind: &str| timeline.iter().find(|e| e["kind"] == kind).unwrap();
    let (lost, elected) = (find("leader_lost"), find("elected"));
    assert_eq!(
        (lost["epoch"].as_u64(), elected["epoch"].as_u64()),
        (Some(2), Some(2))
    );
    assert!(
        lost["detail"]
            .as_str()
            .unwrap()
            .starts_with("n1 (epoch 1) was last heard from"),
        "{lost}"
    );
    assert!(
        elected["detail"]
            .as_str()
            .unwrap()
            .starts_with("n1 leads epoch 2 from its start, "),
        "{elected}"
    );
    assert_eq!(
        (count("leader_lost"), count("elected")),
        (1, 1),
        "{kinds:?}"
    );
    assert!(
        shown.contains("takeover to epoch 2: elected ")
            && shown.contains("supervising again (adopted) after "),
        "{shown}"
    );
    assert_eq!(count("fault"), 1, "{kinds:?}");
    assert_eq!(count("relaunch"), 1, "{kinds:?}");
    let fault = timeline.iter().find(|e| e["kind"] == "fault").unwrap();
    assert!(
        first_dead(fault).contains(&1),
        "{fault}\n{timeline:#?}\n{}",
        cluster.logs()
    );
    nothing_lost(&dir, &ctl, "adopted", &before, &expected);
}

/// The cut heals the moment the successor has claimed the next epoch, before the old leader
/// looks for it (once a lease interval): it sees its nodes disconnect as they move to the
/// successor. It must not take them for lost and stop the world; the successor adopts it.
/// (The soak found a leader that did: it killed the world's ranks 9 ms before it learned.)
#[test]
fn a_leader_healed_just_after_its_successor_claimed_does_not_act() {
    let (_guard, dir) = prepared();
    let expected = reference_losses(&dir);
    let (cluster, ctl) = three_candidates(&dir, "healed", true);
    let relays = cluster.relays.as_ref().expect("relayed");
    let before = past_first_durable(&cluster, &ctl, "healed");

    let claimed = dir.join("store/runs/healed/leaders/000000000002.json");
    relays.cut(0, &[1, 2]);
    wait_until(
        Duration::from_secs(60),
        Duration::from_millis(2),
        || format!("no successor claimed epoch 2\n{}", cluster.logs()),
        || claimed.exists(),
    );
    relays.heal();
    let healed_ms = now_ms();
    wait_for_event(&ctl, "healed", "completed", 1, &cluster);
    println!("{}", ctl.expect(0, &["events", "healed"]));
    let timeline = events(&ctl, "healed");
    let late: Vec<_> = timeline
        .iter()
        .filter(|e| e["epoch"] == 1 && e["unix_ms"].as_u64().unwrap() >= healed_ms)
        .filter(|e| e["kind"] != "deposed")
        .collect();
    assert!(
        late.is_empty(),
        "the deposed leader acted: {late:#?}\n{}",
        cluster.logs()
    );
    assert!(
        timeline
            .iter()
            .any(|e| e["kind"] == "completed" && e["epoch"] == 2),
        "{timeline:#?}"
    );
    nothing_lost(&dir, &ctl, "healed", &before, &expected);
}

/// Three daemons that may all lead (the two after the first are candidates with the same
/// flags), through fault-injecting relays when `relayed`: n1 leads, n1 and n2 train, n3 is a
/// hot spare.
fn three_candidates(dir: &Path, run: &str, relayed: bool) -> (Cluster, Ctl) {
    let store = format!("file://{}", dir.join("store").display());
    let flags = ["--supervise", "mpiexec", "--active-nodes", "2"];
    let args = trainer_args(dir, run, &store);
    let daemons = Daemons {
        candidates: 2,
        relayed,
    };
    supervised_by(&store, dir, run, 3, daemons, &flags, &args, Vec::new())
}

/// Waits until rank 0 is past step 55 and a step at or past 50 is durable; the committed
/// steps then, which no failure may lose.
fn past_first_durable(cluster: &Cluster, ctl: &Ctl, run: &str) -> Vec<u64> {
    rank_pid(cluster, ctl, 0, 55);
    first_durable(ctl, run)
}

/// Waits until a step at or past 50 is durable; the committed steps then.
fn first_durable(ctl: &Ctl, run: &str) -> Vec<u64> {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let committed = ctl.committed(run);
        if committed.iter().any(|s| *s >= 50) {
            return committed;
        }
        assert!(
            Instant::now() < deadline,
            "no step at or past 50 became durable: {committed:?}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// The end of a recovery: every step committed before the failure still is, the last step
/// is committed, every committed step verifies, and the losses are the uninterrupted run's.
fn nothing_lost(
    dir: &Path,
    ctl: &Ctl,
    run: &str,
    before: &[u64],
    expected: &BTreeMap<u64, String>,
) {
    let after = ctl.committed(run);
    for step in before {
        assert!(after.contains(step), "step {step} lost: {after:?}");
    }
    assert!(after.contains(&STEPS), "{after:?}");
    ctl.expect(0, &["verify", run, "--all", "--read-data"]);
    assert_eq!(&losses(dir, run), expected, "bit for bit throughout");
}

/// The epoch each commit record names, by step (read from the store's files).
fn commit_epochs(dir: &Path, run: &str) -> BTreeMap<u64, Option<u64>> {
    lazarus_tests::supervision::commit_epochs(&dir.join("store/runs").join(run).join("commits"))
}

#[test]
fn a_lost_leader_is_replaced_by_its_successor_which_relaunches_the_world_on_a_spare() {
    let (_guard, dir) = prepared();
    let expected = reference_losses(&dir);
    // Three daemons that may all lead: n1 leads, n1 and n2 train, n3 is a hot spare.
    let (mut cluster, ctl) = three_candidates(&dir, "failover", false);
    let status = Status::of(&cluster, &ctl);
    // The succession is published and visible: n2, then n3.
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let json = status.json();
        let order: Vec<&str> = json["succession"]
            .as_array()
            .map(|a| a.iter().filter_map(|s| s["node"].as_str()).collect())
            .unwrap_or_default();
        if order == ["n2", "n3"] {
            assert_eq!(json["epoch"], 1, "{json}");
            break;
        }
        assert!(Instant::now() < deadline, "no succession: {json}");
        std::thread::sleep(Duration::from_millis(100));
    }
    println!("{}", status.text());

    // Past the first durable step, the leader's daemon dies; its rank lives on without it.
    let before = past_first_durable(&cluster, &ctl, "failover");
    let lost_ms = now_ms();
    cluster.kill_node(0);
    wait_for_event(&ctl, "failover", "completed", 1, &cluster);
    let timeline = events(&ctl, "failover");
    println!("{}", ctl.expect(0, &["events", "failover"]));
    let find = |kind: &str| {
        timeline
            .iter()
            .find(|e| e["kind"] == kind)
            .unwrap_or_else(|| panic!("no {kind}: {timeline:#?}\n{}", cluster.logs()))
    };
    let elected = find("elected");
    assert_eq!(elected["epoch"], 2, "{elected}");
    assert!(elected["detail"]
        .as_str()
        .unwrap()
        .starts_with("n2 leads epoch 2"));
    let elected_ms = elected["unix_ms"].as_u64().unwrap() - lost_ms;
    println!("n1's daemon killed; n2 elected after {elected_ms} ms");
    // The heartbeat timeout (2 s), the lease check (1.5 s), a claim.
    assert!(elected_ms < 10_000, "{elected}");
    assert_eq!(find("leader_lost")["epoch"], 2);
    // n1's rank had no daemon: the successor stopped the world and put the spare in n1's
    // place, so rank 1 stays on n2 (its T0) and rank 0 comes from n2's replica (T1).
    let relaunch = find("relaunch");
    assert_eq!(relaunch["epoch"], 2);
    assert_eq!(
        relaunch["nodes"],
        serde_json::json!(["n3", "n2"]),
        "{relaunch}"
    );
    let restored = timeline
        .iter()
        .find(|e| e["kind"] == "restored" && e["epoch"] == 2)
        .unwrap();
    assert!(
        restored["detail"]
            .as_str()
            .unwrap()
            .ends_with("from T0: ranks 1, T1: ranks 0"),
        "{restored}"
    );
    assert_eq!(
        cluster.metric(2, "lazarus_ckptd_restores_total{tier=\"t1\"}"),
        1.0,
        "{}",
        cluster.logs()
    );
    assert_eq!(
        cluster.metric(1, "lazarus_ckptd_restores_total{tier=\"t0\"}"),
        1.0
    );
    assert_eq!(
        cluster.metric(1, "lazarus_ckptd_leader_takeovers_total"),
        1.0
    );
    assert_eq!(cluster.metric(1, "lazarus_ckptd_leader"), 1.0);
    assert_eq!(cluster.metric(2, "lazarus_ckptd_leader_epoch"), 2.0);
    // ckptctl finds the new leader through the store.
    let json = status.json();
    assert_eq!(
        (json["leader"].as_str(), json["epoch"].as_u64()),
        (Some("n2"), Some(2)),
        "{json}"
    );
    // The runbook: confirm the takeover; n1's daemon returns and follows the new epoch.
    let runbook = Runbook::load("leader-failover.md");
    let env = runbook_env(&cluster, "failover");
    let confirmed = runbook.run("Confirm", &env);
    assert!(confirmed.contains("takeover to epoch 2"), "{confirmed}");
    assert!(confirmed.contains("leader: n2 (epoch 2)"), "{confirmed}");
    cluster.start_node(0);
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let verified = runbook.run("Verify it worked", &env);
        if verified.contains("n1 ") {
            break;
        }
        assert!(Instant::now() < deadline, "n1 did not return: {verified}");
        std::thread::sleep(Duration::from_millis(200));
    }
    assert_eq!(cluster.metric(0, "lazarus_ckptd_leader"), 0.0);
    assert_eq!(cluster.metric(0, "lazarus_ckptd_leader_epoch"), 2.0);

    // The commits after the takeover name the new epoch.
    let epochs = commit_epochs(&dir, "failover");
    // The first durable step, 50 or a little later when the step-50 snapshot was skipped
    // while a daemon was busy, was committed by the first leader.
    let first = before
        .iter()
        .find(|s| **s >= 50)
        .expect("a durable step past 50");
    assert_eq!(epochs[first], Some(1), "{epochs:?}");
    assert_eq!(epochs[&STEPS], Some(2), "{epochs:?}");
    nothing_lost(&dir, &ctl, "failover", &before, &expected);
}

#[test]
fn a_leader_cut_off_from_its_nodes_is_replaced_and_stays_harmless_when_the_cut_heals() {
    let (_guard, dir) = prepared();
    let expected = reference_losses(&dir);
    // Three daemons that may all lead, talking through relays: n1 leads, n1 and n2 train,
    // n3 is a hot spare.
    let (cluster, ctl) = three_candidates(&dir, "partition", true);
    let relays = cluster.relays.as_ref().expect("relayed");
    let before = past_first_durable(&cluster, &ctl, "partition");

    // The leader's daemon is cut off from the other two (the ranks' own traffic is not).
    let cut_ms = now_ms();
    relays.cut(0, &[1, 2]);
    wait_for_event(&ctl, "partition", "elected", 1, &cluster);
    wait_for_event(&ctl, "partition", "deposed", 1, &cluster);
    // The new leader acts (it adopts the world or, with n1's rank out of reach, relaunches
    // it on the spare); then the cut heals and n1's held bytes arrive, late.
    wait_until(
        Duration::from_secs(60),
        Duration::from_millis(100),
        || format!("the new leader never acted\n{}", cluster.logs()),
        || {
            events(&ctl, "partition").iter().any(|e| {
                e["epoch"] == 2
                    && ["adopted", "fault", "relaunch"].contains(&e["kind"].as_str().unwrap())
            })
        },
    );
    relays.heal();
    wait_for_event(&ctl, "partition", "completed", 1, &cluster);
    println!("{}", ctl.expect(0, &["events", "partition"]));
    let timeline = events(&ctl, "partition");
    let elected: Vec<_> = timeline.iter().filter(|e| e["kind"] == "elected").collect();
    assert_eq!(elected.len(), 1, "{timeline:#?}");
    let elected_ms = elected[0]["unix_ms"].as_u64().unwrap();
    assert_eq!(elected[0]["epoch"], 2);
    println!(
        "n1 cut off; a successor elected after {} ms",
        elected_ms - cut_ms
    );
    // One leader acts afterwards: after the election, the old epoch records only that it
    // was deposed.
    let late: Vec<_> = timeline
        .iter()
        .filter(|e| e["epoch"] == 1 && e["unix_ms"].as_u64().unwrap() > elected_ms)
        .filter(|e| e["kind"] != "deposed")
        .collect();
    assert!(late.is_empty(), "the deposed leader acted: {late:#?}");
    // The new leader stopped the world at most once (n1's rank was out of its reach); n1's
    // late reports of that world's rank, arriving when the cut healed, did not fault the next.
    let faults: Vec<_> = timeline.iter().filter(|e| e["kind"] == "fault").collect();
    assert!(faults.len() <= 1, "{faults:#?}");
    let deposed = timeline.iter().find(|e| e["kind"] == "deposed").unwrap();
    assert_eq!(deposed["epoch"], 1, "{deposed}");
    assert!(
        timeline
            .iter()
            .any(|e| e["kind"] == "completed" && e["epoch"] == 2),
        "{timeline:#?}"
    );
    let refused: f64 = (0..3)
        .map(|i| {
            cluster.metric(
                i,
                "lazarus_ckptd_peer_messages_rejected_total{cause=\"stale_epoch\"}",
            )
        })
        .sum();
    let stale_ranks: f64 = (0..3)
        .map(|i| {
            cluster.metric(
                i,
                "lazarus_ckptd_peer_messages_rejected_total{cause=\"stale_rank\"}",
            )
        })
        .sum();
    println!(
        "orders of the old epoch refused: {refused}; late reports of an earlier world's ranks ignored: {stale_ranks}"
    );
    // n1's beats and orders held by the cut reach the nodes that follow n2 by then: they
    // listen on their old link, refuse and count them.
    assert!(
        refused >= 1.0,
        "no late order was refused\n{}",
        cluster.logs()
    );

    // No commit of the old epoch after the new one began.
    let epochs = commit_epochs(&dir, "partition");
    assert_eq!(epochs[&STEPS], Some(2), "{epochs:?}");
    let newest_old = epochs
        .iter()
        .filter(|(_, e)| **e == Some(1))
        .map(|(s, _)| *s)
        .max();
    let oldest_new = epochs
        .iter()
        .filter(|(_, e)| **e == Some(2))
        .map(|(s, _)| *s)
        .min();
    assert!(newest_old < oldest_new, "{epochs:?}");
    nothing_lost(&dir, &ctl, "partition", &before, &expected);
}

#[test]
fn a_node_cut_off_alone_is_replaced_by_a_spare_and_neither_leads_nor_counts_after_the_heal() {
    let (_guard, dir) = prepared();
    let expected = reference_losses(&dir);
    // Three daemons that may all lead, talking through relays: n1 leads, n1 and n2 train,
    // n3 is a hot spare.
    let (cluster, ctl) = three_candidates(&dir, "island", true);
    let relays = cluster.relays.as_ref().expect("relayed");
    let before = past_first_durable(&cluster, &ctl, "island");

    // n2 (a candidate, and the first successor) is cut off from the leader and the spare.
    relays.cut(1, &[0, 2]);
    wait_for_event(&ctl, "island", "relaunch", 1, &cluster);
    // n2 lost the leader too, but the leader renews its lease (it hears from n3): n2 must
    // not take over. Its attempt takes the heartbeat timeout and a lease check; give it
    // that, then heal.
    std::thread::sleep(Duration::from_secs(5));
    relays.heal();
    wait_for_event(&ctl, "island", "completed", 1, &cluster);
    println!("{}", ctl.expect(0, &["events", "island"]));
    let timeline = events(&ctl, "island");
    let kinds = kinds(&timeline);
    assert!(!kinds.iter().any(|k| k == "elected"), "{kinds:?}");
    assert!(timeline.iter().all(|e| e["epoch"] == 1), "{timeline:#?}");
    let fault = timeline.iter().find(|e| e["kind"] == "fault").unwrap();
    assert!(
        fault["detail"].as_str().unwrap().contains("node n2 lost"),
        "{fault}"
    );
    let relaunch = timeline.iter().find(|e| e["kind"] == "relaunch").unwrap();
    assert_eq!(
        relaunch["nodes"],
        serde_json::json!(["n1", "n3"]),
        "{relaunch}"
    );
    assert_eq!(
        cluster.metric(1, "lazarus_ckptd_leader_takeovers_total"),
        0.0
    );
    assert_eq!(cluster.metric(1, "lazarus_ckptd_leader_epoch"), 1.0);
    let stale: f64 = cluster.metric(
        0,
        "lazarus_ckptd_peer_messages_rejected_total{cause=\"stale_rank\"}",
    );
    println!("late reports of n2's ranks of the earlier world ignored by the leader: {stale}");
    let epochs = commit_epochs(&dir, "island");
    assert!(epochs.values().all(|e| *e == Some(1)), "{epochs:?}");
    assert!(epochs.contains_key(&STEPS), "{epochs:?}");
    nothing_lost(&dir, &ctl, "island", &before, &expected);
}

#[test]
fn with_no_spare_the_shrink_policy_continues_on_the_healthy_nodes() {
    let (_guard, dir) = prepared();
    let flags = [
        "--supervise",
        "mpiexec",
        "--active-nodes",
        "2",
        "--when-no-spare",
        "shrink",
    ];
    let (mut cluster, ctl) = supervised(&dir, "shrunk", 2, &flags, Vec::new());
    let pid = rank_pid(&cluster, &ctl, 1, 60);
    // Node 2 goes once a step past the durable step 50 is memory-committed.
    let deadline = Instant::now() + Duration::from_secs(60);
    let memory = loop {
        let memory = cluster.metric(0, "lazarus_ckptd_memory_committed_step");
        if memory > 55.0 {
            break memory as u64;
        }
        assert!(Instant::now() < deadline, "{}", cluster.logs());
        std::thread::sleep(Duration::from_millis(50));
    };
    cluster.kill_node(1);
    kill("KILL", pid);
    wait_for_event(&ctl, "shrunk", "completed", 1, &cluster);
    let timeline = events(&ctl, "shrunk");
    println!("{}", ctl.expect(0, &["events", "shrunk"]));
    let kinds = kinds(&timeline);
    assert!(kinds.contains(&"shrink".to_string()), "{kinds:?}");
    assert!(!kinds.contains(&"waiting".to_string()), "{kinds:?}");
    // Before shrinking, the newest memory-committed step became durable from n1's T0 and
    // n1's replica of rank 1 (T1), and the smaller world restored exactly that step.
    let secured = timeline.iter().find(|e| e["kind"] == "secured").unwrap();
    let step: u64 = secured["detail"].as_str().unwrap()["step ".len()..]
        .split(' ')
        .next()
        .unwrap()
        .parse()
        .unwrap();
    assert!(
        step >= memory,
        "memory-committed {memory} before the loss: {secured}"
    );
    let restored = timeline
        .iter()
        .filter(|e| e["kind"] == "restored")
        .nth(1)
        .unwrap();
    assert!(
        restored["detail"]
            .as_str()
            .unwrap()
            .starts_with(&format!("every rank is at step {step} ")),
        "{restored}"
    );
    let relaunch = timeline.iter().find(|e| e["kind"] == "relaunch").unwrap();
    assert!(
        relaunch["detail"]
            .as_str()
            .unwrap()
            .contains("mpiexec on n1 "),
        "{relaunch}"
    );
    // One rank now holds what two did: it came from the durable step, resharded.
    assert_eq!(
        cluster.metric(0, "lazarus_ckptd_restores_total{tier=\"t2\"}"),
        1.0,
        "{}",
        cluster.logs()
    );
    let steps = ctl.json(&["list", "shrunk"]);
    let last = steps["steps"].as_array().unwrap().last().unwrap().clone();
    assert_eq!(last["step"]["step"], STEPS, "{last}");
    assert_eq!(last["world_size"], 1, "{last}");
    assert_eq!(losses(&dir, "shrunk").len(), STEPS as usize);
    ctl.expect(0, &["verify", "shrunk", "--all", "--read-data"]);
}

/// Throttles a process as an overloaded or thermally limited node would: stopped 75 ms of
/// every 100 ms, until dropped.
struct Throttle {
    done: std::sync::Arc<std::sync::atomic::AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Throttle {
    fn start(pid: u32) -> Self {
        let done = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let flag = done.clone();
        let thread = std::thread::spawn(move || {
            while !flag.load(std::sync::atomic::Ordering::Relaxed) {
                kill("STOP", pid);
                std::thread::sleep(Duration::from_millis(75));
                kill("CONT", pid);
                std::thread::sleep(Duration::from_millis(25));
            }
        });
        Self {
            done,
            thread: Some(thread),
        }
    }
}

impl Drop for Throttle {
    fn drop(&mut self) {
        self.done.store(true, std::sync::atomic::Ordering::Relaxed);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

#[test]
fn a_throttled_rank_is_reported_as_a_straggler() {
    let (_guard, dir) = prepared();
    let flags = [
        "--supervise",
        "mpiexec",
        "--active-nodes",
        "2",
        "--straggler-seconds",
        "1",
    ];
    let (cluster, ctl) = supervised(&dir, "slow", 2, &flags, Vec::new());
    let slow = rank_pid(&cluster, &ctl, 1, 10);
    let throttle = Throttle::start(slow);
    let deadline = Instant::now() + Duration::from_secs(60);
    let status = loop {
        let status = Status::of(&cluster, &ctl).json();
        let ranks = status["runs"][0]["ranks"]
            .as_array()
            .cloned()
            .unwrap_or_default();
        if ranks
            .iter()
            .any(|r| r["rank"] == 1 && r["straggler"] == true)
        {
            break status;
        }
        assert!(
            Instant::now() < deadline,
            "rank 1 never reported as a straggler: {status}\n{}",
            cluster.logs()
        );
        std::thread::sleep(Duration::from_millis(200));
    };
    let ranks = status["runs"][0]["ranks"].as_array().unwrap();
    println!("ranks: {ranks:?}");
    assert!(ranks
        .iter()
        .all(|r| r["rank"] == 1 || r["straggler"] == false));
    assert_eq!(cluster.metric(0, "lazarus_ckptd_stragglers"), 1.0);
    let text = Status::of(&cluster, &ctl).text();
    assert!(text.contains("stragglers: rank 1 on n2"), "{text}");
    assert!(
        cluster.log(0).contains("straggler: rank 1 on n2"),
        "the log line"
    );
    let runbook = Runbook::load("straggler.md");
    let env = runbook_env(&cluster, "slow");
    let confirmed = runbook.run("Confirm", &env);
    assert!(
        confirmed.contains("stragglers: rank 1 on n2"),
        "{confirmed}"
    );
    // The slow node recovers: the straggler clears.
    drop(throttle);
    wait_until(
        Duration::from_secs(60),
        Duration::from_millis(200),
        || "the straggler never cleared".into(),
        || cluster.metric(0, "lazarus_ckptd_stragglers") == 0.0,
    );
    runbook.run("Verify it worked", &env);
    // Dropping the cluster ends the daemons and the world.
}

/// A job of `ops/slurm/train.sbatch` on the local Slurm cluster (`conf`): 3 nodes on this
/// machine, one a spare, training `trainer_args` with the extra environment `envs`. The job is
/// cancelled (and its shared memory removed) when the returned guard drops.
struct BatchJob {
    id: String,
    ports: u16,
    key_file: std::path::PathBuf,
    conf: std::path::PathBuf,
    shm: std::path::PathBuf,
}

impl BatchJob {
    fn submit(
        conf: &Path,
        dir: &Path,
        run: &str,
        store: &str,
        envs: &[(&str, &str)],
        sbatch_flags: &[&str],
        trainer_args: &[String],
    ) -> Self {
        let key_file = dir.join("job.key");
        std::fs::write(&key_file, format!("{:064x}", rand::random::<u128>())).unwrap();
        std::fs::write(
            dir.join("ckptd.toml"),
            "durable_every_steps = 50\ncommit_timeout_seconds = 3.0\nheartbeat_timeout_seconds = 3.0\n",
        )
        .unwrap();
        // Three nodes on this machine share 127.0.0.1: node i listens on port + i.
        let ports = lazarus_tests::free_port_run(6);
        let shm =
            Path::new("/dev/shm").join(format!("lazarus-sbatch-{}-{ports}", std::process::id()));
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../ops/slurm/train.sbatch");
        let bin_dir = bin("ckptd").parent().unwrap().to_path_buf();
        let mut sbatch = Command::new("sbatch");
        sbatch
            .env("SLURM_CONF", conf)
            .env("LAZARUS_RUN", run)
            .env("LAZARUS_STORE", store)
            .env("LAZARUS_KEY_FILE", &key_file)
            .env("LAZARUS_HOST", "127.0.0.1")
            .env("LAZARUS_PORT", ports.to_string())
            .env("LAZARUS_METRICS_PORT", (ports + 3).to_string())
            .env("LAZARUS_SHM_DIR", &shm)
            .env("LAZARUS_SOCKET_DIR", dir.join("sockets"))
            .env("LAZARUS_BIN", &bin_dir)
            .env("LAZARUS_CKPTD_CONFIG", dir.join("ckptd.toml"));
        for (name, value) in envs {
            sbatch.env(name, value);
        }
        let submitted = sbatch
            .args(["--parsable", "--nodes=3", "--time=10"])
            .args(sbatch_flags)
            .arg(format!("--output={}", dir.join("job.out").display()))
            .arg(&script)
            .args(trainer_args)
            .output()
            .unwrap();
        assert!(submitted.status.success(), "{}", text_of(&submitted));
        let id = String::from_utf8_lossy(&submitted.stdout)
            .trim()
            .split(';')
            .next()
            .unwrap()
            .to_string();
        Self {
            id,
            ports,
            key_file,
            conf: conf.to_path_buf(),
            shm,
        }
    }

    /// The leading daemon's address.
    fn leader(&self) -> String {
        format!("127.0.0.1:{}", self.ports)
    }

    /// What `scontrol show job` says of the job.
    fn shown(&self) -> String {
        let output = Command::new("scontrol")
            .env("SLURM_CONF", &self.conf)
            .args(["show", "job", &self.id])
            .output()
            .unwrap();
        text_of(&output)
    }

    /// Waits (up to 60 s) until `scontrol show job` satisfies `reached`; what it said then.
    /// Fails saying the job is `not_yet`, with the job's log.
    fn wait_until(
        &self,
        reached: impl Fn(&str) -> bool,
        not_yet: &str,
        job_log: impl Fn() -> String,
    ) -> String {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let shown = self.shown();
            if reached(&shown) {
                return shown;
            }
            assert!(
                Instant::now() < deadline,
                "{not_yet}: {shown}\n{}",
                job_log()
            );
            std::thread::sleep(Duration::from_millis(200));
        }
    }
}

impl Drop for BatchJob {
    /// Cancels the job and waits (up to 60 s) until Slurm has let it go, so the next test on
    /// the cluster finds its nodes free (a job being torn down keeps a drained node
    /// "draining" and delays the next srun).
    fn drop(&mut self) {
        let _ = Command::new("scancel")
            .env("SLURM_CONF", &self.conf)
            .arg(&self.id)
            .status();
        let deadline = Instant::now() + Duration::from_secs(60);
        while Instant::now() < deadline {
            let listed = Command::new("squeue")
                .env("SLURM_CONF", &self.conf)
                .args(["-h", "-j", &self.id, "-o", "%T"])
                .output();
            match listed {
                Ok(out) if !String::from_utf8_lossy(&out.stdout).trim().is_empty() => {
                    std::thread::sleep(Duration::from_millis(200));
                }
                _ => break,
            }
        }
        let _ = std::fs::remove_dir_all(&self.shm);
    }
}

/// `ops/slurm/train.sbatch` loses its first node whole while training: its slurmd, the
/// leading daemon and its rank. The next candidate leads, relaunches the world with the spare
/// in the lost node's place, and the job completes bit for bit with exit 0.
#[test]
fn the_batch_job_survives_losing_its_first_node_with_the_leader() {
    let Some((conf, _exclusive)) = lazarus_tests::exclusive_slurm_cluster() else {
        return;
    };
    let (_guard, dir) = prepared();
    let expected = reference_losses(&dir);
    let store = format!("file://{}", dir.join("store").display());
    let run = "first-lost";
    let batch = BatchJob::submit(
        &conf,
        &dir,
        run,
        &store,
        &[],
        &[],
        &trainer_args(&dir, run, &store),
    );
    let ctl = Ctl::new(store.clone(), &dir.join("index"));
    let job_log = || std::fs::read_to_string(dir.join("job.out")).unwrap_or_default();
    let status = Status::new(&ctl, &batch.leader(), &batch.key_file).of_run(run);
    status.rank_pid(0, 55);
    // The world's nodes in rank order; the one left out is the spare.
    let launched: Vec<String> = events(&ctl, run)
        .iter()
        .find(|e| e["kind"] == "launch")
        .and_then(|e| serde_json::from_value(e["nodes"].clone()).ok())
        .expect("a launch event with its nodes");
    let spare = ["n1", "n2", "n3"]
        .into_iter()
        .find(|n| !launched.iter().any(|l| l == n))
        .expect("a spare");
    let on_n1 = launched.iter().position(|n| n == "n1").expect("n1 trains") as u64;
    let rank = status.rank_pid(on_n1, 0);
    let before = first_durable(&ctl, run);

    // n1 dies whole: its slurmd, its daemon (the leader) and its rank.
    let daemon = Command::new("pgrep")
        .args(["-f", &format!("ckptd --node n1 --run {run} ")])
        .output()
        .unwrap();
    let daemon = text_of(&daemon);
    let daemon = daemon.split_whitespace().next().expect("n1's daemon runs");
    let _n1 = slurm::SlurmdDown::kill(&conf, "n1");
    assert!(kill("KILL", daemon));
    assert!(kill("KILL", rank));
    wait_for_event_or(&ctl, run, "completed", 1, job_log);
    println!("{}", ctl.expect(0, &["events", run]));
    let timeline = events(&ctl, run);
    let find = |kind: &str| {
        timeline
            .iter()
            .find(|e| e["kind"] == kind)
            .unwrap_or_else(|| panic!("no {kind}: {timeline:#?}\n{}", job_log()))
    };
    let elected = find("elected");
    assert!(
        elected["detail"]
            .as_str()
            .unwrap()
            .starts_with("n2 leads epoch 2"),
        "{elected}"
    );
    // The spare takes n1's place; the other rank stays on its node.
    let relaunched: Vec<String> = launched
        .iter()
        .map(|n| if n == "n1" { spare } else { n.as_str() }.to_string())
        .collect();
    let relaunch = find("relaunch");
    assert_eq!(relaunch["epoch"], 2, "{relaunch}");
    assert_eq!(
        relaunch["nodes"],
        serde_json::json!(relaunched),
        "{relaunch}"
    );
    assert!(
        relaunch["detail"]
            .as_str()
            .unwrap()
            .starts_with(&format!("srun on {}", relaunched.join(","))),
        "{relaunch}"
    );
    let epochs = commit_epochs(&dir, run);
    // The first durable step, 50 or a little later when the step-50 snapshot was skipped
    // while a daemon was busy, was committed by the first leader.
    let first = before
        .iter()
        .find(|s| **s >= 50)
        .expect("a durable step past 50");
    assert_eq!(epochs[first], Some(1), "{epochs:?}");
    assert_eq!(epochs[&STEPS], Some(2), "{epochs:?}");
    nothing_lost(&dir, &ctl, run, &before, &expected);

    // Every daemon left when the leader said the run was over, and the job ends as the run
    // did: completed, exit 0, though n1's daemon was killed.
    let shown = batch.wait_until(
        |shown| shown.contains("JobState=COMPLETED"),
        "the job did not end",
        job_log,
    );
    assert!(shown.contains("ExitCode=0:0"), "{shown}\n{}", job_log());
    assert!(
        job_log().contains("the run's last outcome: completed"),
        "{}",
        job_log()
    );
}

/// `ops/slurm/train.sbatch` with two ranks per node and the layout from the environment
/// (TP2 inside each node, 2 active nodes and a spare): the job trains to the end, the last
/// checkpoint names the layout, and the losses equal an uninterrupted `mpiexec -n 4` run's bit
/// for bit.
#[test]
fn the_batch_script_runs_two_ranks_per_node_in_the_layout_from_the_environment() {
    let Some((conf, _exclusive)) = lazarus_tests::exclusive_slurm_cluster() else {
        return;
    };
    let (_guard, dir) = prepared();
    const STEPS: u64 = 60;
    let reference_store = format!("file://{}", dir.join("reference").display());
    let reference = small_args(&dir, "reference", &reference_store)
        .steps(STEPS)
        .sets(["parallel.tp=2", "checkpoint.every=100000"])
        .build();
    let expected = reference_run(&dir, 4, &reference);

    let store = format!("file://{}", dir.join("store").display());
    let args = small_args(&dir, "batch-pairs", &store).steps(STEPS).build();
    let _batch = BatchJob::submit(
        &conf,
        &dir,
        "batch-pairs",
        &store,
        &[("LAZARUS_RANKS_PER_NODE", "2"), ("LAZARUS_TP", "2")],
        &["--ntasks-per-node=2"],
        &args,
    );
    let ctl = Ctl::new(store.clone(), &dir.join("index"));
    let job_log = || std::fs::read_to_string(dir.join("job.out")).unwrap_or_default();
    wait_for_event_or(&ctl, "batch-pairs", "completed", 1, job_log);
    println!("{}", ctl.expect(0, &["events", "batch-pairs"]));
    assert_eq!(
        losses(&dir, "batch-pairs"),
        expected,
        "the job trains as TP2 x DP2, bit for bit\n{}",
        job_log()
    );
    let shown = ctl.json(&["show", "batch-pairs", "latest"]);
    assert_eq!(shown["layout"]["tp"], 2, "{shown}");
    assert_eq!(shown["layout"]["dp"], 2, "{shown}");
}

#[test]
fn preemption_makes_the_newest_step_durable_and_the_requeued_job_resumes() {
    let Some((conf, _exclusive)) = lazarus_tests::exclusive_slurm_cluster() else {
        return;
    };
    let (_guard, dir) = prepared();
    let expected = reference_losses(&dir);
    let store = format!("file://{}", dir.join("store").display());
    // The layout from the environment (the reference's: one rank per node, data parallel,
    // one micro-batch), through the script's flags.
    let batch = BatchJob::submit(
        &conf,
        &dir,
        "preempted",
        &store,
        &[
            ("LAZARUS_RANKS_PER_NODE", "1"),
            ("LAZARUS_TP", "1"),
            ("LAZARUS_MICRO_BATCHES", "1"),
        ],
        &[],
        &trainer_args(&dir, "preempted", &store),
    );
    let (job, key_file) = (batch.id.clone(), batch.key_file.clone());
    let ctl = Ctl::new(store.clone(), &dir.join("index"));
    let job_log = || std::fs::read_to_string(dir.join("job.out")).unwrap_or_default();
    let leader = batch.leader();

    // One daemon per node; two train, one is a spare.
    Status::new(&ctl, &leader, &key_file).rank_pid(0, 60);
    let status = Status::new(&ctl, &leader, &key_file).json();
    assert_eq!(status["nodes"].as_array().unwrap().len(), 3, "{status}");
    assert_eq!(
        status["supervision"]["spares"].as_array().unwrap().len(),
        1,
        "{status}"
    );

    // Slurm's warning before the time limit, delivered now (the runbook's command): the
    // batch shell gets SIGUSR1.
    let runbook = Runbook::load("preemption.md");
    let env = vec![
        ("LAZARUS_STORE", store.clone()),
        ("LAZARUS_INDEX", dir.join("index").display().to_string()),
        ("RUN", "preempted".to_string()),
        ("JOB", job.clone()),
        ("SLURM_CONF", conf.display().to_string()),
    ];
    runbook.run("Preempt by hand", &env);
    wait_for_event_or(&ctl, "preempted", "preempted", 1, job_log);
    let timeline = events(&ctl, "preempted");
    let preempted = timeline.iter().find(|e| e["kind"] == "preempted").unwrap();
    let detail = preempted["detail"].as_str().unwrap();
    let step: u64 = detail
        .strip_prefix("step ")
        .and_then(|rest| rest.strip_suffix(" is durable"))
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("{preempted}"));
    assert!(step > 60 && step < STEPS, "{preempted}");
    assert!(ctl.committed("preempted").contains(&step));

    // The job requeues itself.
    batch.wait_until(
        |shown| shown.contains("Restarts=1") && shown.contains("JobState=PENDING"),
        "not requeued",
        job_log,
    );
    let confirmed = runbook.run("Confirm", &env);
    assert!(
        confirmed.contains(&format!("step {step} is durable")),
        "{confirmed}"
    );
    assert!(confirmed.contains("Restarts=1"), "{confirmed}");
    // Slurm holds the requeued job for the credential lifetime (10 s on the local cluster),
    // then starts it again.
    wait_for_event_within(
        &ctl,
        "preempted",
        "first_step",
        2,
        Duration::from_secs(400),
        || {
            format!(
                "the requeued job did not resume: {}\n{}",
                batch.shown(),
                job_log()
            )
        },
    );
    let verified = runbook.run("Verify it worked", &env);
    assert!(
        verified.contains(&format!("every rank is at step {step} ")),
        "{verified}"
    );
    assert!(verified.contains("RUNNING"), "{verified}");
    wait_for_event_or(&ctl, "preempted", "completed", 1, job_log);
    println!("{}", ctl.expect(0, &["events", "preempted"]));
    let kinds = kinds(&events(&ctl, "preempted"));
    for kind in [
        "launch",
        "preempting",
        "preempted",
        "relaunch",
        "restored",
        "completed",
    ] {
        assert!(
            kinds.contains(&kind.to_string()),
            "{kind} missing: {kinds:?}"
        );
    }
    assert!(!kinds.contains(&"fault".to_string()), "{kinds:?}");
    assert!(ctl.committed("preempted").contains(&STEPS));
    ctl.expect(0, &["verify", "preempted", "--all", "--read-data"]);
    assert_eq!(
        losses(&dir, "preempted"),
        expected,
        "the requeued job continues bit for bit"
    );
}
