//! `ckptd` end to end: daemons on 127.0.0.1 stand for nodes, trainer ranks run under a real
//! `mpiexec`, one per node. Snapshots are handed over every step, replicated to the buddy,
//! memory-committed by the leader, and made durable every few steps; restores come from the
//! node (T0), the buddy (T1) or storage (T2), and must continue bit for bit.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use lazarus_tests::cluster::{text_of, Cluster, Settings};
use lazarus_tests::deadline::test_dir;
use lazarus_tests::runbook::Runbook;
use lazarus_tests::supervision::{kill, Status};
use lazarus_tests::train::{
    loss_texts as losses, pid_in_rank_table, prepared, reference_run, TrainerArgs,
};
use lazarus_tests::{bin, Ctl, S3Server};

/// A small model, one snapshot per step. The learning rate stays in its warm-up, where it
/// depends on the step alone, so runs with different `train.steps` see the same rates.
fn trainer_args(dir: &Path, run: &str, store: &str, steps: u64, busy: &str) -> Vec<String> {
    small_args(dir, run, store, steps, busy).build()
}

fn small_args(dir: &Path, run: &str, store: &str, steps: u64, busy: &str) -> TrainerArgs {
    TrainerArgs::small(dir)
        .run(run)
        .steps(steps)
        .sets([
            "train.warmup_steps=1000",
            "train.lr=0.5",
            "checkpoint.every=1",
        ])
        .set("checkpoint.busy", busy)
        .store(store)
}

/// Starts the ranks on a long run, waits for `step`, and SIGKILLs rank 1. Returns once the
/// launcher has ended the job.
fn kill_rank_at(cluster: &Cluster, args: &[String], step: u64) {
    let mut child = cluster
        .mpiexec(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let mut ranks = String::new();
    let wanted = format!("step {step:>6}");
    for line in lines.by_ref() {
        let line = line.unwrap();
        if line.starts_with("ranks: ") {
            ranks = line.clone();
        }
        if line.starts_with(&wanted) {
            break;
        }
    }
    let pid = pid_in_rank_table(&ranks, 1);
    assert!(Command::new("kill")
        .args(["-KILL", &pid.to_string()])
        .status()
        .unwrap()
        .success());
    let _rest: Vec<String> = lines.map_while(|l| l.ok()).collect();
    let status = child.wait().unwrap();
    assert!(!status.success(), "the job survived a killed rank");
}

fn resumed_step(said: &str, tier: &str) -> u64 {
    let marker = "resumed from step ";
    let at = said
        .find(marker)
        .unwrap_or_else(|| panic!("no resume in: {said}"));
    let rest = &said[at + marker.len()..];
    let step: u64 = rest.split_whitespace().next().unwrap().parse().unwrap();
    assert!(
        rest.starts_with(&format!("{step} ({tier} via ckptd)")),
        "expected a restore from {tier}: {said}"
    );
    step
}

/// The leader is lost as the run ends: no memory commit comes for the last snapshot, and
/// the daemons drop it. The ranks hand the last step over again until a leader commits it
/// (here the leader's daemon restarted), and only then say goodbye: a run never ends with
/// its last step uncommitted. The soak found a run that did.
#[test]
fn a_last_snapshot_no_commit_came_for_is_handed_over_again() {
    let (_guard, dir) = prepared();
    let store = format!("file://{}", dir.join("store").display());
    // n1 leads and holds no rank; n2 and n3 train.
    let mut cluster = Cluster::start(&dir, "last", &store, 3, &Settings::default(), Vec::new());
    // Skipping busy steps, the ranks reach the last step at once and hand it over.
    let args = trainer_args(&dir, "last", &store, 40, "skip");
    let mut child = cluster
        .mpiexec_on(&[1, 2], &args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let mut said = String::new();
    for line in lines.by_ref() {
        let line = line.unwrap();
        said.push_str(&line);
        said.push('\n');
        if line.starts_with(&format!("step {:>6}", 36)) {
            break;
        }
    }
    cluster.kill_node(0);
    // Past two commit timeouts (3 s): the snapshot pending when the leader died expires, the
    // last one is handed over and expires too, and is handed over again.
    std::thread::sleep(Duration::from_secs(9));
    cluster.start_node(0);
    said.extend(lines.map_while(|l| l.ok()).map(|l| l + "\n"));
    let output = child.wait_with_output().unwrap();
    let why = format!(
        "{said}{}\n{}",
        String::from_utf8_lossy(&output.stderr),
        cluster.logs()
    );
    assert!(output.status.success(), "{why}");
    assert!(
        said.contains("ckptd: the last step 40 was not committed; handing it over again"),
        "{why}"
    );
    let ctl = Ctl::new(store.clone(), &dir.join("index"));
    ctl.wait_for_latest("last", 40);
    ctl.expect(0, &["verify", "last", "--read-data"]);
}

/// A fake node of two ranks that speaks the peer protocol to the cluster's leader.
struct FakeNode {
    writer: std::net::TcpStream,
    reader: std::net::TcpStream,
    key: lazarus_shared::wire::JobKey,
    run: lazarus_shared::RunId,
}

impl FakeNode {
    /// Connects to node 0 (the leader) and says hello, with ranks 0 and 1 of a 2-rank world.
    /// The daemon is ready before it has claimed its leadership, and refuses a hello until
    /// then (a real node says it again): the fake waits for the claim.
    fn join(cluster: &Cluster, dir: &Path, run: &str) -> Self {
        use lazarus_shared::wire::{JobKey, Message};
        let deadline = Instant::now() + Duration::from_secs(30);
        while cluster.metric(0, "lazarus_ckptd_leader") != 1.0 {
            assert!(
                Instant::now() < deadline,
                "node 0 did not lead within 30 s: {}",
                cluster.logs()
            );
            std::thread::sleep(Duration::from_millis(10));
        }
        let key = JobKey::from_file(&cluster.key_file).unwrap();
        let stream = std::net::TcpStream::connect(("127.0.0.1", cluster.nodes[0].listen)).unwrap();
        stream
            .set_read_timeout(Some(Duration::from_secs(10)))
            .unwrap();
        let mut node = Self {
            writer: stream.try_clone().unwrap(),
            reader: stream,
            key,
            run: run.parse().unwrap(),
        };
        node.send(Message::NodeHello {
            node: "fake".into(),
            address: "127.0.0.1:9".into(),
            buddy: None,
            socket: dir.join("fake.sock").display().to_string(),
            t0: Vec::new(),
            epoch: 0,
            candidate: false,
            replicas: Vec::new(),
            instance: 1,
            rollback: Default::default(),
        });
        for rank in 0..2 {
            node.send(Message::RankUp {
                node: "fake".into(),
                run: node.run.clone(),
                rank,
                world_size: 2,
                pid: std::process::id(),
            });
        }
        node
    }

    fn send(&mut self, message: lazarus_shared::wire::Message) {
        lazarus_shared::wire::write_frame_sync(&mut self.writer, &message, &[], Some(&self.key))
            .unwrap();
    }

    /// `rank` reports its snapshot of `step` replicated.
    fn replicated(&mut self, rank: u32, step: u64) {
        self.send(lazarus_shared::wire::Message::Replicated {
            node: "fake".into(),
            run: self.run.clone(),
            rank,
            world_size: 2,
            step,
            durable_requested: false,
            upload: None,
            rollback: Default::default(),
        });
    }

    /// The first message the leader pushes that `pick` picks, skipping the others (its
    /// beats); `None` after 10 s.
    fn next<T>(&mut self, pick: impl Fn(lazarus_shared::wire::Message) -> Option<T>) -> Option<T> {
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            match lazarus_shared::wire::read_frame_sync(&mut self.reader, Some(&self.key)) {
                Ok(frame) => {
                    if let Some(picked) = pick(frame.message) {
                        return Some(picked);
                    }
                }
                Err(_) => return None,
            }
        }
        None
    }

    /// The next memory commit the leader pushes.
    fn next_commit(&mut self) -> Option<u64> {
        self.next(|message| match message {
            lazarus_shared::wire::Message::MemoryCommitted { step, .. } => Some(step),
            _ => None,
        })
    }
}

/// A node's snapshot can expire just before the leader commits its step from the reports
/// already in; the node then hands it over again, while the other ranks hold the step as T0
/// and never report it again. The leader repeats the commit to that node alone. A fake node
/// speaks the peer protocol to a real leader: two ranks report step 40, the commit comes,
/// and a third report of step 40 gets the commit again. (Under load in CI, the run's last
/// step was handed over for 120 s and the ranks gave up.)
#[test]
fn a_report_of_a_committed_step_gets_its_commit_again() {
    let (_guard, dir) = prepared();
    let store = format!("file://{}", dir.join("store").display());
    let cluster = Cluster::start(&dir, "again", &store, 1, &Settings::default(), Vec::new());
    let mut node = FakeNode::join(&cluster, &dir, "again");
    node.replicated(0, 40);
    node.replicated(1, 40);
    assert_eq!(node.next_commit(), Some(40));
    node.replicated(0, 40);
    assert_eq!(
        node.next_commit(),
        Some(40),
        "a report of the committed step got no commit\n{}",
        cluster.logs()
    );
    assert_eq!(
        cluster.metric(0, "lazarus_ckptd_memory_recommits_total"),
        1.0
    );
}

/// A daemon killed while it replicated rank 1's snapshot of step 16 left rank 0's waiting
/// for a commit that could not come, and every rank skipped its snapshots for the commit
/// timeout (3 s). Over the wire to a real leader: rank 1 reports 20, so 16 can never
/// complete, and the node is told at once to drop what waits; the next step both ranks
/// report commits.
#[test]
fn a_step_a_rank_passed_is_given_up_at_once() {
    let (_guard, dir) = prepared();
    let store = format!("file://{}", dir.join("store").display());
    let cluster = Cluster::start(&dir, "passed", &store, 1, &Settings::default(), Vec::new());
    let mut node = FakeNode::join(&cluster, &dir, "passed");
    node.replicated(0, 16);
    node.replicated(1, 20);
    let given_up = node.next(|message| match message {
        lazarus_shared::wire::Message::CommitsGivenUp { through, .. } => Some(through),
        _ => None,
    });
    assert_eq!(given_up, Some(20), "{}", cluster.logs());
    node.replicated(0, 21);
    node.replicated(1, 21);
    assert_eq!(node.next_commit(), Some(21), "{}", cluster.logs());
    assert_eq!(
        cluster.metric(0, "lazarus_ckptd_memory_commits_given_up_total"),
        1.0
    );
}

#[test]
fn two_nodes_snapshot_every_step_commit_every_fifth_and_ignore_forged_messages() {
    let (_guard, dir) = prepared();
    let store = format!("file://{}", dir.join("store").display());
    let cluster = Cluster::start(&dir, "e2e", &store, 2, &Settings::default(), Vec::new());
    let said = cluster.train(&trainer_args(&dir, "e2e", &store, 30, "wait"));
    assert!(said.contains("0 snapshots skipped"), "{said}");
    let ctl = Ctl::new(store.clone(), &dir.join("index"));
    ctl.wait_for_latest("e2e", 30);
    let durable = ctl.committed("e2e");
    let deferrals = cluster.metric(0, "lazarus_ckptd_durable_deferrals_total");
    assert_durable_every_fifth(&durable, 30, deferrals);
    ctl.expect(0, &["verify", "e2e", "--all", "--read-data"]);
    // Each daemon stored the last durable step's chunks, or some of them, as deltas against
    // its base file (the step before), which `verify --read-data` decoded.
    let shown = ctl.json(&["show", "e2e", "30"]);
    let manifests = shown["manifests"].as_array().unwrap();
    assert_eq!(manifests.len(), 2);
    for manifest in manifests {
        let deltas = manifest["tensors"]
            .as_array()
            .unwrap()
            .iter()
            .flat_map(|tensor| tensor["chunks"].as_array().unwrap())
            .filter(|chunk| {
                chunk["bases"]
                    .as_array()
                    .is_some_and(|bases| !bases.is_empty())
            })
            .count();
        assert!(
            deltas > 0,
            "rank {}: no delta chunk at step 30",
            manifest["rank"]
        );
    }
    assert_eq!(
        cluster.metric(0, "lazarus_ckptd_memory_committed_step"),
        30.0
    );
    assert_eq!(
        cluster.metric(0, "lazarus_ckptd_durable_committed_step"),
        30.0
    );
    for node in 0..2 {
        assert_eq!(cluster.metric(node, "lazarus_ckptd_snapshots_total"), 30.0);
        assert!(cluster.metric(node, "lazarus_ckptd_bytes_replicated_total") > 0.0);
        assert!(cluster.metric(node, "lazarus_ckptd_bytes_stored_total") > 0.0);
    }
    // Every snapshot but the first went through a stall measurement.
    assert!(cluster.metric(0, "lazarus_ckptd_snapshot_stall_seconds_count") >= 29.0);

    // The operator's view, from the leader.
    let status = Status::of(&cluster, &ctl).text();
    assert!(status.contains("n1") && status.contains("n2"), "{status}");
    assert!(status.contains("memory-committed step 30"), "{status}");

    // Forged, garbled, oversized and foreign bytes at node 2, which holds node 1's replica.
    use lazarus_shared::wire::{encode, JobKey, Message};
    use std::io::Write;
    let replica = |step: u64| {
        cluster.nodes[1]
            .shm
            .join("e2e/replicas/rank-0")
            .join(format!("step-{step}"))
    };
    assert!(replica(30).join("meta.json").exists());
    let forged = Message::ReplicaBegin {
        from_node: "n1".into(),
        run: "e2e".parse().unwrap(),
        rank: 0,
        world_size: 2,
        step: 999,
        slot_bytes: 8,
        chunk_bytes: 4 << 20,
        tensors: Vec::new(),
        blobs: Vec::new(),
        rollback: Default::default(),
        chunking: Default::default(),
    };
    let right_key = JobKey::from_file(&cluster.key_file).unwrap();
    let wrong_key = JobKey::derive(b"not the job's key material");
    let mut garbled = encode(&forged, &[], Some(&right_key));
    let last = garbled.len() - 40;
    garbled[last] ^= 0x20;
    let mut oversized = encode(&forged, &[], Some(&right_key));
    oversized[8..12].copy_from_slice(&u32::MAX.to_le_bytes());
    let out_of_place = encode(
        &Message::MemoryCommitted {
            run: "e2e".parse().unwrap(),
            step: 999,
            durable: true,
            epoch: 1,
        },
        &[],
        Some(&right_key),
    );
    for bytes in [
        encode(&forged, &[], Some(&wrong_key)),
        encode(&forged, &[], None),
        garbled,
        oversized,
        b"GET /metrics HTTP/1.1\r\n\r\n".to_vec(),
        out_of_place,
    ] {
        let mut stream =
            std::net::TcpStream::connect(("127.0.0.1", cluster.nodes[1].listen)).unwrap();
        stream.write_all(&bytes).unwrap();
        let _ = stream.shutdown(std::net::Shutdown::Write);
        let mut answer = Vec::new();
        let _ = std::io::Read::read_to_end(&mut stream, &mut answer);
    }
    std::thread::sleep(Duration::from_millis(300));
    let metrics = cluster.metrics(1);
    let rejected = |cause: &str| {
        cluster.metric(
            1,
            &format!("lazarus_ckptd_peer_messages_rejected_total{{cause=\"{cause}\"}}"),
        )
    };
    assert_eq!(rejected("bad_mac"), 3.0, "{metrics}");
    assert_eq!(rejected("too_large"), 1.0, "{metrics}");
    assert_eq!(rejected("bad_magic"), 1.0, "{metrics}");
    assert_eq!(rejected("refused"), 1.0, "{metrics}");
    assert!(
        replica(30).join("meta.json").exists(),
        "the replica is untouched"
    );
    assert!(!replica(999).exists());
    let status = Status::of(&cluster, &ctl).text();
    assert!(status.contains("memory-committed step 30"), "{status}");
    assert_eq!(ctl.committed("e2e"), durable);
}

/// The durable steps of a run that memory-committed every step up to `last`: every fifth
/// step is due, and the leader makes durable the first step at or after it at which no rank's
/// upload still runs (the very step, on an idle machine), counting each step it passes over
/// in `deferrals`; the last step is always durable (the run asks for it, so it is not
/// deferred, while the steps from its due point up to it were).
fn assert_durable_every_fifth(durable: &[u64], last: u64, deferrals: f64) {
    let why = format!("durable steps {durable:?}, {deferrals} deferred");
    assert_eq!(
        durable.first(),
        Some(&5),
        "no upload runs before step 5: {why}"
    );
    assert_eq!(durable.last(), Some(&last), "{why}");
    let mut passed_over = 0;
    for pair in durable.windows(2) {
        let due = (pair[0] / 5 + 1) * 5;
        assert!(
            pair[1] >= due,
            "{} is not due after {}: {why}",
            pair[1],
            pair[0]
        );
        passed_over += pair[1] - due;
    }
    assert_eq!(deferrals, passed_over as f64, "{why}");
}

#[test]
fn lost_ranks_and_a_lost_node_restore_from_t0_and_t1_bit_for_bit() {
    let (_guard, dir) = prepared();
    // The uninterrupted reference: the plain trainer over MPI, no daemon.
    let reference_store = format!("file://{}", dir.join("reference").display());
    let reference = small_args(&dir, "reference", &reference_store, 40, "wait")
        .set("checkpoint.every", 1000)
        .build();
    let expected = reference_run(&dir, 2, &reference);

    let store = format!("file://{}", dir.join("store").display());
    let settings = Settings {
        durable_every_steps: 4,
        ..Settings::default()
    };
    let mut cluster = Cluster::start(&dir, "lossy", &store, 2, &settings, Vec::new());
    let long = trainer_args(&dir, "lossy", &store, 100_000, "skip");

    // 1. A rank dies mid-run; both ranks come back from their own node's memory (T0).
    kill_rank_at(&cluster, &long, 9);
    let said = cluster.train(&trainer_args(&dir, "lossy", &store, 20, "skip"));
    let first = resumed_step(&said, "t0");
    println!("killed at step 9; resumed from step {first} (T0)");
    assert!(first >= 4, "{said}");
    let got = losses(&dir, "lossy");
    for step in first + 1..=20 {
        assert_eq!(
            got[&step], expected[&step],
            "step {step} after the T0 restore"
        );
    }

    // 2. A rank dies again, then node 2 loses its memory (daemon killed, shm wiped): rank 1
    // comes back from the replica node 1 holds (T1), rank 0 from its T0.
    kill_rank_at(&cluster, &long, 27);
    cluster.wipe_node(1);
    cluster.start_node(1);
    let said = cluster.train(&trainer_args(&dir, "lossy", &store, 40, "skip"));
    let second = resumed_step(&said, "t0");
    println!("killed at step 27, node 2 wiped; resumed from step {second} (T0 + T1)");
    assert!(second > 20, "{said}");
    assert_eq!(
        cluster.metric(1, "lazarus_ckptd_restores_total{tier=\"t1\"}"),
        1.0,
        "{}",
        cluster.logs()
    );
    let got = losses(&dir, "lossy");
    for step in second + 1..=40 {
        assert_eq!(
            got[&step], expected[&step],
            "step {step} after the T1 restore"
        );
    }
    println!(
        "losses {}..=40 match the uninterrupted run bit for bit, e.g. step 40: {}",
        second + 1,
        got[&40]
    );
    let ctl = Ctl::new(store, &dir.join("index"));
    ctl.wait_for_latest("lossy", 40);
    ctl.expect(0, &["verify", "lossy", "--all", "--read-data"]);
}

/// Threads that keep every core busy until dropped, as ranks that busy-poll MPI (or more
/// ranks than cores) do.
struct BusyCores {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    threads: Vec<std::thread::JoinHandle<()>>,
}

impl BusyCores {
    fn start() -> Self {
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let cores = std::thread::available_parallelism().map_or(2, |n| n.get());
        let threads = (0..cores)
            .map(|_| {
                let stop = stop.clone();
                std::thread::spawn(move || {
                    while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                        std::hint::spin_loop();
                    }
                })
            })
            .collect();
        Self { stop, threads }
    }
}

impl Drop for BusyCores {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        for thread in self.threads.drain(..) {
            let _ = thread.join();
        }
    }
}

/// The step [`with_every_core_busy_a_lost_rank_restores_a_recent_step`] kills a rank at.
const KILLED_AT: u64 = 20;

/// On a node whose cores are all kept busy, the daemons still hash and replicate snapshots
/// in time: a rank lost at step 20 (about a second in) restores one of the last ten steps from
/// memory. With the data path under `SCHED_IDLE` and nothing to raise it (the default once),
/// the daemons got almost no CPU and the ranks came back from step 1.
/// Returns how many times the daemons raised their data path, and their logs.
fn with_every_core_busy_a_lost_rank_restores_a_recent_step(
    run: &str,
    flags: &[&str],
) -> (f64, String) {
    let (_guard, dir) = prepared();
    let store = format!("file://{}", dir.join("store").display());
    let settings = Settings {
        extra: flags.iter().map(|flag| flag.to_string()).collect(),
        ..Settings::default()
    };
    let cluster = Cluster::start(&dir, run, &store, 2, &settings, Vec::new());
    let busy = BusyCores::start();
    kill_rank_at(
        &cluster,
        &trainer_args(&dir, run, &store, 100_000, "skip"),
        KILLED_AT,
    );
    let said = cluster.train(&trainer_args(&dir, run, &store, KILLED_AT + 2, "skip"));
    drop(busy);
    let resumed = resumed_step(&said, "t0");
    let raised: f64 = (0..2)
        .map(|node| cluster.metric(node, "lazarus_ckptd_data_path_raised_total"))
        .sum();
    println!(
        "every core busy, {flags:?}: killed at step {KILLED_AT}, resumed from step {resumed} (T0); the data path raised {raised} times"
    );
    let logs = cluster.logs();
    assert!(resumed > KILLED_AT - 10, "{said}\n{logs}");
    (raised, logs)
}

#[test]
fn with_every_core_busy_a_lost_rank_still_restores_a_recent_step() {
    let (raised, _) = with_every_core_busy_a_lost_rank_restores_a_recent_step("busy", &[]);
    assert_eq!(
        raised, 0.0,
        "the default's data path has no valve to raise it"
    );
}

/// The same under `data_cpu = "idle"`: the valve raises the data path once its threads have
/// waited past the grace for a CPU (where the daemons may raise it; else they run it as
/// shared).
#[test]
fn with_every_core_busy_an_idle_data_path_is_raised_in_time() {
    let (raised, logs) = with_every_core_busy_a_lost_rank_restores_a_recent_step(
        "busy-idle",
        &["--data-cpu", "idle"],
    );
    if logs.contains("running it as \"shared\"") {
        // Without CAP_SYS_NICE the daemons never lower what they could not raise again.
        println!("the daemons may not leave SCHED_IDLE here: they ran the data path as shared");
        assert_eq!(raised, 0.0);
    } else {
        assert!(
            raised > 0.0,
            "the data path waited for idle time that never came"
        );
    }
}

/// Pipeline parallel under the daemons, one stage per node: a killed rank's world restores
/// from the nodes' memory (T0) and continues bit for bit; relaunched in another layout (data
/// parallel over the same micro-batches), the daemons' memory no longer fits the ranks and
/// they restore from storage (T2), continuing within float rounding.
#[test]
fn a_pipeline_world_restores_from_t0_and_in_another_layout_from_storage() {
    let (_guard, dir) = prepared();
    let pp2 = [
        "parallel.pp=2",
        "parallel.micro_batches=2",
        "train.micro_batch=4",
    ];
    let dp2 = ["parallel.micro_batches=2", "train.micro_batch=2"];
    let reference_store = format!("file://{}", dir.join("reference").display());
    let reference = small_args(&dir, "reference", &reference_store, 30, "wait")
        .sets(pp2)
        .set("checkpoint.every", 1000)
        .build();
    let expected = reference_run(&dir, 2, &reference);

    let store = format!("file://{}", dir.join("store").display());
    let settings = Settings {
        durable_every_steps: 4,
        ..Settings::default()
    };
    let cluster = Cluster::start(&dir, "staged", &store, 2, &settings, Vec::new());
    let args = |steps: u64, layout: &[&str]| {
        small_args(&dir, "staged", &store, steps, "skip")
            .sets(layout.iter().copied())
            .build()
    };
    kill_rank_at(&cluster, &args(100_000, &pp2), 9);
    let said = cluster.train(&args(20, &pp2));
    let first = resumed_step(&said, "t0");
    println!("PP2: killed at step 9; resumed from step {first} (T0)");
    let got = losses(&dir, "staged");
    for step in first + 1..=20 {
        assert_eq!(
            got[&step], expected[&step],
            "step {step} after the T0 restore"
        );
    }

    // Step 20 is in the nodes' memory, but the new layout's ranks hold other regions: the
    // world restores the newest durable step, 20 once its upload is done (the run's last
    // snapshot asks for it; which earlier steps are durable depends on what a busy daemon
    // skipped: under load one test run restored an older step than 16).
    let ctl = Ctl::new(store.clone(), &dir.join("index"));
    ctl.wait_for_latest("staged", 20);
    let said = cluster.train(&args(30, &dp2));
    let second = resumed_step(&said, "t2");
    println!("DP2: resumed from step {second} (T2)");
    assert_eq!(second, 20, "{said}");
    let got = losses(&dir, "staged");
    for step in second + 1..=30 {
        let (a, b): (f64, f64) = (
            got[&step].parse().unwrap(),
            expected[&step].parse().unwrap(),
        );
        assert!(
            (a - b).abs() <= 1e-5 * b.abs(),
            "step {step} in DP2 after PP2: {a} vs {b}"
        );
    }
    // The last step is made durable (the run's final snapshot asks for it) once its upload
    // is done; the ones every fourth step before it too, unless a busy daemon skipped one.
    let deadline = Instant::now() + Duration::from_secs(60);
    while !ctl.committed("staged").contains(&30) {
        assert!(Instant::now() < deadline, "{:?}", ctl.committed("staged"));
        std::thread::sleep(Duration::from_millis(100));
    }
    ctl.expect(0, &["verify", "staged", "--all", "--read-data"]);
}

#[test]
fn a_killed_daemon_loses_no_durable_step_and_training_goes_on() {
    let (_guard, dir) = prepared();
    let store = format!("file://{}", dir.join("store").display());
    let settings = Settings {
        durable_every_steps: 3,
        ..Settings::default()
    };
    let mut cluster = Cluster::start(&dir, "restart", &store, 2, &settings, Vec::new());
    let mut child = cluster
        .mpiexec(&trainer_args(&dir, "restart", &store, 120, "skip"))
        .stdout(Stdio::piped())
        .stderr(std::fs::File::create(dir.join("restart.err")).unwrap())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    for line in lines.by_ref() {
        if line.unwrap().starts_with("step     12") {
            break;
        }
    }
    let ctl = Ctl::new(store, &dir.join("index"));
    // What is durable when the daemon dies must all still be there after.
    let durable_before = ctl.committed("restart");
    cluster.kill_node(1);
    std::thread::sleep(Duration::from_millis(500));
    cluster.start_node(1);
    let rest: Vec<String> = lines.map_while(|l| l.ok()).collect();
    let status = child.wait().unwrap();
    assert!(
        status.success(),
        "{}\n{}\n{}",
        rest.join("\n"),
        std::fs::read_to_string(dir.join("restart.err")).unwrap_or_default(),
        cluster.logs()
    );
    assert!(
        cluster.log(1).contains("found T0 from an earlier life"),
        "{}",
        cluster.log(1)
    );
    ctl.wait_for_latest("restart", 120);
    let steps = ctl.committed("restart");
    println!("durable at the kill {durable_before:?}, after the run {steps:?}");
    // None lost, and durable steps went on after the restart: one between the kill (after
    // step 12) and the last. How many depends on how busy the cores keep the daemons. The run
    // is long enough for the worst case seen: the killed daemon took a snapshot with it, whose
    // other half waited 3 s for its commit (`commit_timeout_seconds`), and every rank skipped
    // its snapshots meanwhile; 60 steps had ended inside that under load. The leader now gives
    // such a step up once the restarted daemon's rank reports a later one, but a restart
    // slower than the timeout under load still lets it expire first.
    assert!(
        durable_before.iter().all(|step| steps.contains(step)),
        "durable at the kill {durable_before:?}, after {steps:?}"
    );
    assert!(
        steps.iter().any(|step| (13..120).contains(step)),
        "{steps:?}\n{}\n{}",
        rest.join("\n"),
        cluster.logs()
    );
    ctl.expect(0, &["verify", "restart", "--all", "--read-data"]);
    // What the killed upload left behind is garbage only gc collects; committed steps stay.
    let gc = ctl.expect(
        0,
        &[
            "gc",
            "restart",
            "--keep-last",
            "1000",
            "--grace",
            "0s",
            "--staging-grace",
            "0s",
        ],
    );
    println!("{gc}");
    assert_eq!(ctl.committed("restart"), steps);
    ctl.expect(0, &["verify", "restart", "--all", "--read-data"]);
}

/// A daemon that stops reading its socket (SIGSTOPped, as a debugger or a starved node
/// would) does not stop its ranks: they go on training without its answers, its node's
/// snapshots are skipped meanwhile, and the run completes. Regression: past four unanswered
/// heartbeats a rank waited for the oldest answer, so the world stood still for as long as
/// any of its daemons was paused (in the soak, 0.63 s of a 0.8 s pause; about 4.8 s of a
/// 4.8 s one).
#[test]
fn a_paused_daemon_does_not_stop_its_ranks() {
    const PAUSE: Duration = Duration::from_secs(3);
    let (_guard, dir) = prepared();
    let store = format!("file://{}", dir.join("store").display());
    let cluster = Cluster::start(&dir, "paused", &store, 2, &Settings::default(), Vec::new());
    let mut child = cluster
        .mpiexec(&trainer_args(&dir, "paused", &store, 200, "skip"))
        .stdout(Stdio::piped())
        .stderr(std::fs::File::create(dir.join("paused.err")).unwrap())
        .spawn()
        .unwrap();
    let step_of = |line: &str| {
        line.strip_prefix("step ")
            .and_then(|rest| rest.split_whitespace().next())
            .and_then(|step| step.parse::<u64>().ok())
    };
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    for line in lines.by_ref() {
        if step_of(&line.unwrap()) == Some(12) {
            break;
        }
    }
    // Rank 1's daemon, not the leader's.
    let pid = cluster.pid(1).unwrap();
    assert!(kill("STOP", pid));
    let paused = Instant::now();
    let resume = std::thread::spawn(move || {
        std::thread::sleep(PAUSE);
        kill("CONT", pid)
    });
    let (mut during, mut rest) = (0, Vec::new());
    for line in lines.map_while(|l| l.ok()) {
        if step_of(&line).is_some() && paused.elapsed() < PAUSE {
            during += 1;
        }
        rest.push(line);
    }
    assert!(resume.join().unwrap(), "the daemon was continued");
    let status = child.wait().unwrap();
    let said = format!(
        "{}\n{}\n{}",
        rest.join("\n"),
        std::fs::read_to_string(dir.join("paused.err")).unwrap_or_default(),
        cluster.logs()
    );
    assert!(status.success(), "{said}");
    println!("{during} steps trained while rank 1's daemon was stopped for {PAUSE:?}");
    // Before, the world stood still after at most four heartbeats went unanswered; each
    // step of this model takes well under a tenth of the pause, even on a loaded machine.
    assert!(
        during >= 10,
        "only {during} steps in the {PAUSE:?} rank 1's daemon was stopped\n{said}"
    );
}

/// The moments of its work a daemon is killed at (`ckptd`'s crash points), each with the
/// time it is reached at (with a snapshot every step, by step 9): node 2 (rank 1's daemon, and the buddy of node 1) dies there and
/// is started again 300 ms later.
const CRASH_MOMENTS: [&str; 8] = [
    "poll:9",
    "snapshot:4",
    "snapshot:9",
    "replicate:4",
    "replica-in:4",
    "commit:4",
    "upload:3",
    "base:2",
];

/// Regression: a rank whose daemon died right after it handed a snapshot over panicked in
/// its next update (it counted all four slots held), and the other rank waited for it in a
/// collective forever. Now a daemon killed at any moment of its work and started again
/// changes nothing in the run: it completes, every loss is bit for bit the uninterrupted
/// run's, and its last step is durable and verifies.
#[test]
fn a_daemon_killed_at_any_moment_and_restarted_leaves_the_run_bit_for_bit_the_same() {
    let (_guard, dir) = prepared();
    let store = format!("file://{}", dir.join("store").display());
    let settings = Settings {
        durable_every_steps: 3,
        ..Settings::default()
    };
    // Every crash point is reached by about step 10; the steps after it include two durable
    // ones (every third step), made by the restarted daemon.
    let steps = 15;
    let reference = {
        let cluster = Cluster::start(&dir, "reference", &store, 2, &settings, Vec::new());
        cluster.train(&trainer_args(&dir, "reference", &store, steps, "skip"));
        losses(&dir, "reference")
    };
    assert_eq!(reference.len(), steps as usize);
    let ctl = Ctl::new(store.clone(), &dir.join("index"));
    for moment in CRASH_MOMENTS {
        let run = format!("crash-{}", moment.replace(':', "-"));
        // Its own directory: sockets and daemon logs of one moment only.
        let nodes = dir.join(&run);
        std::fs::create_dir_all(&nodes).unwrap();
        let mut cluster = Cluster::start(&nodes, &run, &store, 2, &settings, Vec::new());
        cluster.kill_node(1);
        cluster.start_node_with(1, &[("LAZARUS_CKPTD_CRASH_AT", moment.to_string())]);
        let output = nodes.join("ranks.out");
        // Every step's snapshot is taken (a busy daemon is waited for), so the n-th snapshot
        // is step n's, however fast the ranks are next to the daemons.
        let mut child = cluster
            .mpiexec(&trainer_args(&dir, &run, &store, steps, "wait"))
            .stdout(std::fs::File::create(&output).unwrap())
            .stderr(Stdio::from(
                std::fs::File::create(nodes.join("ranks.err")).unwrap(),
            ))
            .spawn()
            .unwrap();
        let said = || {
            std::fs::read_to_string(&output).unwrap_or_default()
                + &std::fs::read_to_string(nodes.join("ranks.err")).unwrap_or_default()
        };
        let started = Instant::now();
        let mut restarted = false;
        let status = loop {
            if let Some(status) = child.try_wait().unwrap() {
                break status;
            }
            if !restarted && cluster.node_exited(1) {
                std::thread::sleep(Duration::from_millis(300));
                cluster.start_node(1);
                restarted = true;
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        assert!(
            status.success(),
            "{moment}: the run failed\n{}\n{}",
            said(),
            cluster.logs()
        );
        assert!(
            restarted && cluster.log(1).contains("crash point reached"),
            "{moment}: the daemon was never killed there\n{}",
            cluster.logs()
        );
        assert_eq!(
            losses(&dir, &run),
            reference,
            "{moment}: the losses differ from the uninterrupted run\n{}",
            said()
        );
        ctl.wait_for_latest(&run, steps);
        ctl.expect(0, &["verify", &run, "--all", "--read-data"]);
        println!(
            "{moment}: completed bit for bit in {:.1} s; committed {:?}",
            started.elapsed().as_secs_f64(),
            ctl.committed(&run)
        );
    }
}

/// A rank's restore from storage that takes seconds (the S3 server is stopped under it) holds
/// nothing else up: the other rank on the same node gets its polls answered and its snapshot
/// taken at once, and the leader keeps hearing the node (it would be declared lost after
/// `heartbeat_timeout_seconds`, 2 s). The restore completes once the store answers again.
#[test]
fn a_slow_restore_holds_up_neither_the_node_nor_its_other_ranks() {
    use lazarus_shared::format::{DType, DimRange};
    use lazarus_shared::store::RegionKind;
    use lazarus_shared::wire::{SlotTensor, Tier};
    use lazarus_trainer::snapshot::Ckptd;
    let dir = test_dir();
    let dir = dir.path();
    let s3 = S3Server::start();
    let store = s3.url("slow");
    let elements = 2_000_000u64;
    let input = dir.join("state.safetensors");
    lazarus_tests::write_safetensors(
        &input,
        &[(
            "w",
            vec![elements],
            lazarus_tests::random_f32_bytes(elements as usize, 7),
        )],
    );
    let mut ctl = Ctl::new(store.clone(), &dir.join("index"));
    ctl.envs = s3.envs();
    ctl.expect(
        0,
        &["import", "slow", "--step", "5", input.to_str().unwrap()],
    );
    let cluster = Cluster::start(dir, "slow", &store, 2, &Settings::default(), s3.envs());
    let layout = vec![SlotTensor {
        name: "w".into(),
        dtype: DType::F32,
        global_shape: vec![elements],
        slice: vec![DimRange {
            start: 0,
            len: elements,
        }],
        offset: 0,
        bytes: 4 * elements,
        kind: RegionKind::Stored,
    }];
    let socket = cluster.nodes[1].socket.clone();
    let connect = |rank: u32| {
        Ckptd::connect(
            &socket,
            "slow".parse().unwrap(),
            rank,
            2,
            layout.clone(),
            4 * elements,
        )
        .unwrap()
    };
    let (mut restoring, mut other) = (connect(0), connect(1));
    kill("STOP", s3.pid());
    let restore = std::thread::spawn(move || {
        let started = Instant::now();
        let restored = restoring.restore(None, Some(5));
        (restored, started.elapsed())
    });
    // The leader's view of the node, read beside (a status request itself gives the stopped
    // store 2 s before it answers).
    let watching = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(true));
    let watcher = {
        let (leader, key_file, watching) =
            (cluster.leader(), cluster.key_file.clone(), watching.clone());
        let ctl = Ctl {
            store: ctl.store.clone(),
            index: ctl.index.clone(),
            envs: ctl.envs.clone(),
        };
        std::thread::spawn(move || {
            let mut silence_ms = Vec::new();
            while watching.load(std::sync::atomic::Ordering::SeqCst) {
                let status = Status::new(&ctl, &leader, &key_file).json();
                if let Some(node) = status["nodes"]
                    .as_array()
                    .and_then(|nodes| nodes.iter().find(|n| n["node"] == "n2").cloned())
                {
                    silence_ms.push(node["last_seen_ms_ago"].as_u64().unwrap());
                }
                std::thread::sleep(Duration::from_millis(100));
            }
            silence_ms
        })
    };
    let stalled = Instant::now();
    let mut slowest = Duration::ZERO;
    std::thread::sleep(Duration::from_millis(300));
    let free = (0..4).find(|s| !other.held().contains(*s)).unwrap();
    let asked = Instant::now();
    let snapshot_taken = other.snapshot(1, free, false, &[], Duration::ZERO).unwrap();
    slowest = slowest.max(asked.elapsed());
    while stalled.elapsed() < Duration::from_secs(4) {
        let asked = Instant::now();
        other.poll(1, Duration::ZERO, None).unwrap();
        slowest = slowest.max(asked.elapsed());
        std::thread::sleep(Duration::from_millis(50));
    }
    watching.store(false, std::sync::atomic::Ordering::SeqCst);
    let silence_ms = watcher.join().unwrap();
    let leader_silence_ms = silence_ms.iter().copied().max().unwrap_or(u64::MAX);
    assert!(
        !restore.is_finished(),
        "the restore did not wait for the stopped store"
    );
    kill("CONT", s3.pid());
    let (restored, took) = restore.join().unwrap();
    let restored = restored.unwrap().expect("step 5 restored");
    println!(
        "restore took {took:?}; meanwhile the slowest answer to the other rank took {slowest:?}, and the leader last heard the node at most {leader_silence_ms} ms before"
    );
    assert_eq!((restored.step, restored.tier), (5, Tier::T2));
    assert!(
        slowest < Duration::from_millis(500),
        "the other rank waited {slowest:?} for an answer while a restore ran\n{}",
        cluster.logs()
    );
    assert!(
        snapshot_taken,
        "the other rank never got to hand a snapshot over"
    );
    assert!(
        leader_silence_ms < 1500,
        "the leader did not hear the node for {leader_silence_ms} ms while a restore ran (status reads: {silence_ms:?})\n{}",
        cluster.logs()
    );
}

#[test]
fn two_nodes_stream_to_a_real_s3_server() {
    let (_guard, dir) = prepared();
    let s3 = S3Server::start();
    let store = s3.url("ckptd");
    let cluster = Cluster::start(&dir, "s3run", &store, 2, &Settings::default(), s3.envs());
    cluster.train(&trainer_args(&dir, "s3run", &store, 12, "wait"));
    let mut ctl = Ctl::new(store, &dir.join("index"));
    ctl.envs = s3.envs();
    ctl.wait_for_latest("s3run", 12);
    // Step 5 is durable first (no upload runs before it) and the last step at the end of the
    // run. Step 10 is due next, but while a rank's upload of 5 still runs (on a loaded
    // machine) the leader defers it to the next step every rank can upload at once, 11, or
    // to the last; nothing else may appear.
    let committed = ctl.committed("s3run");
    assert!(
        [&[5, 10, 12][..], &[5, 11, 12], &[5, 12]].contains(&committed.as_slice()),
        "durable steps on S3: {committed:?}"
    );
    ctl.expect(0, &["verify", "s3run", "--all", "--read-data"]);
}

#[test]
fn bad_daemon_configuration_exits_2_with_the_reason() {
    let dir = test_dir();
    let run = |args: &[&str]| {
        let output = Command::new(bin("ckptd")).args(args).output().unwrap();
        (output.status.code(), text_of(&output))
    };
    let (code, said) = run(&["--node", "n1"]);
    assert_eq!(code, Some(2), "{said}");
    assert!(said.contains("ckptd needs `run`"), "{said}");
    let config = dir.path().join("ckptd.toml");
    std::fs::write(
        &config,
        "node = \"n1\"\nrun = \"r\"\nstore = \"file:///tmp/x\"\nbogus = 1\n",
    )
    .unwrap();
    let (code, said) = run(&["--config", config.to_str().unwrap()]);
    assert_eq!(code, Some(2), "{said}");
    assert!(said.contains("bogus"), "{said}");
    let short_key = dir.path().join("key");
    std::fs::write(&short_key, "short").unwrap();
    let (code, said) = run(&[
        "--node",
        "n1",
        "--run",
        "r",
        "--store",
        &format!("file://{}", dir.path().join("store").display()),
        "--shm-dir",
        dir.path().join("shm").to_str().unwrap(),
        "--socket",
        dir.path().join("s.sock").to_str().unwrap(),
        "--listen",
        "127.0.0.1:0",
        "--leader",
        "127.0.0.1:1",
        "--key-file",
        short_key.to_str().unwrap(),
    ]);
    assert_eq!(code, Some(2), "{said}");
    assert!(said.contains("key material"), "{said}");
}

/// A tmpfs of `megabytes` mounted at `path` (root only), unmounted when dropped.
struct Tmpfs(PathBuf);

impl Tmpfs {
    fn mount(path: &Path, megabytes: u64) -> Option<Self> {
        std::fs::create_dir_all(path).unwrap();
        let mounted = Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={megabytes}m"), "tmpfs"])
            .arg(path)
            .output()
            .ok()?;
        mounted.status.success().then(|| Self(path.to_path_buf()))
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(&self.0).status();
    }
}

#[test]
fn a_full_shm_is_a_clear_refusal_and_the_runbook_frees_it() {
    let (_guard, dir) = prepared();
    let store = format!("file://{}", dir.join("store").display());
    let mut cluster = Cluster::start(&dir, "shmfull", &store, 2, &Settings::default(), Vec::new());
    // Node 2's shm is a 192 MB tmpfs, 150 MB of it left over from an old run.
    let shm = cluster.nodes[1].shm.clone();
    cluster.kill_node(1);
    let Some(_tmpfs) = Tmpfs::mount(&shm, 192) else {
        lazarus_tests::skip("cannot mount a tmpfs here (needs root)");
        return;
    };
    let old = shm.join("old-run/ranks/rank-0");
    std::fs::create_dir_all(&old).unwrap();
    std::fs::write(old.join("slot-0"), vec![1u8; 150 << 20]).unwrap();
    cluster.start_node(1);

    // Rank 1 needs four 19.5 MB slots: refused at registration, with the reason. Once the
    // runbook has freed the old run, its slots, delta base and two replicas of rank 0 fit.
    let args = trainer_args(&dir, "shmfull", &store, 10, "skip");
    let output = cluster.mpiexec(&args).output().unwrap();
    let text = text_of(&output);
    assert!(!output.status.success(), "{text}");
    assert!(
        text.contains("cannot reserve") && text.contains("is shm full?"),
        "{text}"
    );

    let runbook = Runbook::load("disk-or-shm-full.md");
    let env = vec![
        ("SHM_DIR", shm.display().to_string()),
        ("RUN", "shmfull".to_string()),
    ];
    let confirmed = runbook.run("Confirm", &env);
    assert!(confirmed.contains("old-run"), "{confirmed}");
    let fixed = runbook.run("Fix", &env);
    assert!(fixed.contains("old-run"), "{fixed}");
    assert!(!shm.join("old-run").exists());
    assert!(
        shm.join("shmfull").exists(),
        "the running run's directory stays"
    );
    runbook.run("Verify it worked", &env);

    // With room again the same job trains and commits.
    cluster.train(&args);
    let ctl = Ctl::new(store.clone(), &dir.join("index"));
    // The leader commits the last step after the ranks have left (CI once verified first).
    ctl.wait_for_latest("shmfull", 10);
    ctl.expect(0, &["verify", "shmfull", "latest", "--read-data"]);
    cluster.kill_node(1);
}

#[test]
fn a_storage_outage_pauses_durable_commits_and_they_resume_after_it() {
    let (_guard, dir) = prepared();
    let mut s3 = S3Server::start();
    let store = s3.url("outage");
    let cluster = Cluster::start(&dir, "outage", &store, 2, &Settings::default(), s3.envs());
    let mut ctl = Ctl::new(store.clone(), &dir.join("index"));
    ctl.envs = s3.envs();
    let mut training = cluster
        .mpiexec(&trainer_args(&dir, "outage", &store, 150, "skip"))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(120);
    let durable = |ctl: &Ctl| {
        let listed = ctl.run(&["--json", "list", "outage"]);
        serde_json::from_slice::<serde_json::Value>(&listed.stdout).unwrap_or_default()["latest"]
            ["step"]
            .as_u64()
            .unwrap_or(0)
    };
    while durable(&ctl) < 10 {
        assert!(Instant::now() < deadline, "{}", cluster.logs());
        std::thread::sleep(Duration::from_millis(100));
    }

    // The store hangs (it stops answering): the uploads in flight hang with it, but memory
    // commits (T0 + T1) go on, because an upload holds a slot of its own.
    // (Before, the hung upload kept its daemon busy and the ranks skipped every snapshot
    // until the request timed out.)
    // The durable steps due meanwhile are deferred by the leader (node 0) until every rank's
    // upload has ended, and counted.
    let memory_before = cluster.metric(0, "lazarus_ckptd_memory_committed_step");
    let deferred = |cluster: &Cluster| cluster.metric(0, "lazarus_ckptd_durable_deferrals_total");
    let deferred_before = deferred(&cluster);
    assert!(kill("STOP", s3.pid()));
    let hung = Instant::now();
    loop {
        let memory = cluster.metric(0, "lazarus_ckptd_memory_committed_step");
        if memory >= memory_before + 10.0 && deferred(&cluster) >= deferred_before + 1.0 {
            break;
        }
        if hung.elapsed() > Duration::from_secs(30) {
            kill("CONT", s3.pid());
            panic!(
                "memory commits stalled while the store hung (step {memory_before} -> {memory}), or no durable step was counted as deferred ({deferred_before} -> {})\n{}",
                deferred(&cluster),
                cluster.logs()
            );
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(kill("CONT", s3.pid()));

    // The store goes away for a while; training goes on.
    s3.stop();
    let before = cluster.metric(0, "lazarus_ckptd_durable_committed_step");
    std::thread::sleep(Duration::from_secs(4));
    let mut env: Vec<(&str, String)> = vec![
        ("LAZARUS_STORE", store.clone()),
        ("LAZARUS_INDEX", dir.join("index").display().to_string()),
        ("RUN", "outage".into()),
        ("LEADER", cluster.leader()),
        ("KEY_FILE", cluster.key_file.display().to_string()),
        ("METRICS", format!("127.0.0.1:{}", cluster.nodes[0].metrics)),
    ];
    let aws = s3.envs();
    env.extend(aws.iter().map(|(k, v)| (k.as_str(), v.clone())));
    let runbook = Runbook::load("storage-outage.md");
    let confirmed = runbook.run("Confirm", &env);
    assert!(confirmed.contains("durable step"), "{confirmed}");
    assert!(
        confirmed.contains("lazarus_ckptd_durable_committed_step"),
        "{confirmed}"
    );
    // At most the upload that was in flight landed: nothing became durable while it was down.
    let during = cluster.metric(0, "lazarus_ckptd_durable_committed_step");
    assert!(
        during <= before + 5.0,
        "durable step {before} -> {during} with no store"
    );

    // The store is back: uploads retry, and the run ends durable and verified.
    s3.restart();
    assert!(training.wait().unwrap().success(), "{}", cluster.logs());
    ctl.wait_for_latest("outage", 150);
    let verified = runbook.run("Verify it worked", &env);
    assert!(
        verified.contains("lazarus_ckptd_durable_committed_step 150"),
        "{verified}"
    );
    ctl.expect(0, &["verify", "outage", "--all", "--read-data"]);
}
