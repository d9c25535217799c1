//! The supervising leader: it launches the world itself (here with mpiexec; daemons on
//! 127.0.0.1 stand for nodes), detects a killed rank and a hung one, stops the world,
//! relaunches it, and the ranks restore from T0 and continue bit for bit.

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use lazarus_tests::cluster::{text_of, Cluster, Settings};
use lazarus_tests::train::{loss_texts as losses, prepared, small_model_args};
use lazarus_tests::{bin, Ctl};

const STEPS: u64 = 200;

fn trainer_args(dir: &Path, run: &str, store: &str) -> Vec<String> {
    small_model_args(
        dir,
        &[
            format!("run.id={run}"),
            format!("train.steps={STEPS}"),
            "train.warmup_steps=1000".into(),
            "train.lr=0.5".into(),
            "checkpoint.every=1".into(),
            format!("checkpoint.store={store}"),
        ],
    )
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64
}

fn events(ctl: &Ctl, run: &str) -> Vec<serde_json::Value> {
    let output = ctl.run(&["--json", "events", run]);
    if !output.status.success() {
        return Vec::new();
    }
    serde_json::from_slice::<serde_json::Value>(&output.stdout)
        .ok()
        .and_then(|v| v.as_array().cloned())
        .unwrap_or_default()
}

fn wait_for_event(ctl: &Ctl, run: &str, kind: &str, count: usize, cluster: &Cluster) {
    let deadline = Instant::now() + Duration::from_secs(180);
    while events(ctl, run)
        .iter()
        .filter(|e| e["kind"] == kind)
        .count()
        < count
    {
        assert!(
            Instant::now() < deadline,
            "no {kind} event #{count}: {:#?}\n{}",
            events(ctl, run),
            cluster.logs()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// The pid of a rank of the running world, from the leader.
fn rank_pid(cluster: &Cluster, ctl: &Ctl, rank: u64, past_step: u64) -> u32 {
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let status = ctl.json(&[
            "status",
            "--leader",
            &cluster.leader(),
            "--key-file",
            cluster.key_file.to_str().unwrap(),
        ]);
        let found = status["runs"][0]["ranks"]
            .as_array()
            .and_then(|ranks| ranks.iter().find(|r| r["rank"] == rank).cloned());
        if let Some(r) = found.filter(|r| r["step"].as_u64().unwrap_or(0) > past_step) {
            return r["pid"].as_u64().unwrap() as u32;
        }
        assert!(
            Instant::now() < deadline,
            "rank {rank} never passed step {past_step}: {status}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn the_leader_recovers_a_killed_rank_and_a_hung_one_from_t0_bit_for_bit() {
    let (_guard, dir) = prepared();
    let reference_store = format!("file://{}", dir.join("reference").display());
    let mut reference = trainer_args(&dir, "reference", &reference_store);
    reference.extend(["--set".into(), "checkpoint.every=100000".into()]);
    let output = Command::new("mpiexec")
        .args(["-n", "2"])
        .arg(bin("trainer"))
        .args(&reference)
        .output()
        .unwrap();
    assert!(output.status.success(), "{}", text_of(&output));
    let expected = losses(&dir, "reference");

    let store = format!("file://{}", dir.join("store").display());
    let mut leader_extra: Vec<String> = [
        "--supervise",
        "mpiexec",
        "--active-nodes",
        "2",
        "--hang-timeout-seconds",
        "3",
    ]
    .map(String::from)
    .to_vec();
    for arg in trainer_args(&dir, "supervised", &store) {
        leader_extra.push(format!("--trainer-arg={arg}"));
    }
    let settings = Settings {
        durable_every_steps: 50,
        leader_extra,
        ..Settings::default()
    };
    let cluster = Cluster::start(&dir, "supervised", &store, 2, &settings, Vec::new());
    let ctl = Ctl::new(store.clone(), &dir.join("index"));

    // 1. SIGKILL rank 1: detected within 2 s, restarted in place from T0.
    let pid = rank_pid(&cluster, &ctl, 1, 40);
    let killed_ms = now_ms();
    assert!(Command::new("kill")
        .args(["-KILL", &pid.to_string()])
        .status()
        .unwrap()
        .success());
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
        fault["detail"].as_str().unwrap().contains("rank 1"),
        "{fault}"
    );

    // 2. SIGSTOP rank 0: no progress for 3 s is a hang; the world is stopped and relaunched.
    let pid = rank_pid(&cluster, &ctl, 0, 120);
    let stopped_ms = now_ms();
    assert!(Command::new("kill")
        .args(["-STOP", &pid.to_string()])
        .status()
        .unwrap()
        .success());
    wait_for_event(&ctl, "supervised", "completed", 1, &cluster);
    let timeline = events(&ctl, "supervised");
    let hang = timeline
        .iter()
        .filter(|e| e["kind"] == "fault")
        .nth(1)
        .unwrap();
    let detected_ms = hang["unix_ms"].as_u64().unwrap() - stopped_ms;
    println!(
        "stopped rank 0 (pid {pid}); declared hung after {detected_ms} ms: {}",
        hang["detail"]
    );
    assert!(hang["detail"].as_str().unwrap().contains("hung"), "{hang}");
    assert!(detected_ms < 6000, "{hang}");
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
    let reference_store = format!("file://{}", dir.join("reference").display());
    let mut reference = trainer_args(&dir, "reference", &reference_store);
    reference.extend(["--set".into(), "checkpoint.every=100000".into()]);
    let output = Command::new("mpiexec")
        .args(["-n", "2"])
        .arg(bin("trainer"))
        .args(&reference)
        .output()
        .unwrap();
    assert!(output.status.success(), "{}", text_of(&output));
    let expected = losses(&dir, "reference");

    // Three nodes: n1 and n2 train, n3 is a hot spare.
    let store = format!("file://{}", dir.join("store").display());
    let mut leader_extra: Vec<String> = ["--supervise", "mpiexec", "--active-nodes", "2"]
        .map(String::from)
        .to_vec();
    for arg in trainer_args(&dir, "spared", &store) {
        leader_extra.push(format!("--trainer-arg={arg}"));
    }
    let settings = Settings {
        durable_every_steps: 50,
        leader_extra,
        ..Settings::default()
    };
    let mut cluster = Cluster::start(&dir, "spared", &store, 3, &settings, Vec::new());
    let ctl = Ctl::new(store.clone(), &dir.join("index"));

    // Node 2 dies: its daemon, then its rank.
    let pid = rank_pid(&cluster, &ctl, 1, 60);
    let lost_ms = now_ms();
    cluster.kill_node(1);
    let _ = Command::new("kill")
        .args(["-KILL", &pid.to_string()])
        .status();
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

#[test]
fn under_slurm_a_lost_node_is_drained_and_a_spare_takes_over() {
    let conf = match lazarus_tests::slurm_cluster() {
        Ok(conf) => conf,
        Err(why) => {
            println!("skipped: {why}");
            return;
        }
    };
    let (_guard, dir) = prepared();
    let store = format!("file://{}", dir.join("store").display());
    let mut leader_extra: Vec<String> = ["--supervise", "srun", "--active-nodes", "2"]
        .map(String::from)
        .to_vec();
    for arg in trainer_args(&dir, "slurm", &store) {
        leader_extra.push(format!("--trainer-arg={arg}"));
    }
    let settings = Settings {
        durable_every_steps: 50,
        leader_extra,
        ..Settings::default()
    };
    let envs = vec![("SLURM_CONF".to_string(), conf.display().to_string())];
    let mut cluster = Cluster::start(&dir, "slurm", &store, 3, &settings, envs);
    let ctl = Ctl::new(store.clone(), &dir.join("index"));
    let pid = rank_pid(&cluster, &ctl, 1, 60);
    // Node n2 dies whole: its slurmd, its daemon and its rank.
    let slurmd_pid = std::fs::read_to_string(conf.parent().unwrap().join("run/slurmd-n2.pid"))
        .unwrap()
        .trim()
        .to_string();
    let _ = Command::new("kill").args(["-KILL", &slurmd_pid]).status();
    cluster.kill_node(1);
    let _ = Command::new("kill")
        .args(["-KILL", &pid.to_string()])
        .status();
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
    assert!(state.contains("drain"), "n2 is drained: {state}");
    assert!(state.contains("lazarus"), "with the reason: {state}");
    assert!(kinds.contains(&"drained"), "{kinds:?}");
    assert_eq!(
        cluster.metric(2, "lazarus_ckptd_restores_total{tier=\"t1\"}"),
        1.0,
        "the spare restored rank 1 from its buddy's replica\n{}",
        cluster.logs()
    );
    let status = ctl.expect(
        0,
        &[
            "status",
            "--leader",
            &cluster.leader(),
            "--key-file",
            cluster.key_file.to_str().unwrap(),
        ],
    );
    assert!(
        status.contains("active n1,n3, spares -, drained n2"),
        "{status}"
    );
    assert_eq!(losses(&dir, "slurm").len(), STEPS as usize);
}

#[test]
fn two_failures_in_a_row_and_no_spare_left_wait_then_recover() {
    let (_guard, dir) = prepared();
    let store = format!("file://{}", dir.join("store").display());
    let mut leader_extra: Vec<String> = ["--supervise", "mpiexec", "--active-nodes", "2"]
        .map(String::from)
        .to_vec();
    for arg in trainer_args(&dir, "twice", &store) {
        leader_extra.push(format!("--trainer-arg={arg}"));
    }
    let settings = Settings {
        durable_every_steps: 50,
        leader_extra,
        ..Settings::default()
    };
    let mut cluster = Cluster::start(&dir, "twice", &store, 2, &settings, Vec::new());
    let ctl = Ctl::new(store.clone(), &dir.join("index"));

    // 1. Rank 1 dies; as soon as the relaunched world registers, rank 0 dies too, before
    //    its first step: the second failure hits the recovery from the first.
    let pid = rank_pid(&cluster, &ctl, 1, 30);
    assert!(Command::new("kill")
        .args(["-KILL", &pid.to_string()])
        .status()
        .unwrap()
        .success());
    wait_for_event(&ctl, "twice", "relaunch", 1, &cluster);
    let again = rank_pid(&cluster, &ctl, 0, 0);
    assert!(Command::new("kill")
        .args(["-KILL", &again.to_string()])
        .status()
        .unwrap()
        .success());
    wait_for_event(&ctl, "twice", "relaunch", 2, &cluster);

    // 2. Node 2 is lost with no spare: the leader waits (the default policy) until a node
    //    comes back, then relaunches.
    let pid = rank_pid(&cluster, &ctl, 1, 100);
    cluster.kill_node(1);
    let _ = Command::new("kill")
        .args(["-KILL", &pid.to_string()])
        .status();
    wait_for_event(&ctl, "twice", "waiting", 1, &cluster);
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(
        events(&ctl, "twice")
            .iter()
            .filter(|e| e["kind"] == "relaunch")
            .count(),
        2,
        "no relaunch without a node"
    );
    cluster.start_node(1);
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
