//! The leader at scale: a real `ckptd --lead` process against N simulated nodes of R ranks
//! each, all tasks of this one process, speaking the real wire protocol (authenticated
//! frames): a hello and a `RankUp` per rank, a `Replicated` report per rank and step, a
//! heartbeat every 500 ms. A second daemon may stand by as a leader candidate, to take over
//! when the leader is killed. Used by the scale benchmark and by a small run in the tests.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use lazarus_shared::wire::{self, JobKey, Message, RankBeat};
use lazarus_shared::RunId;
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;

use crate::{bin, free_port};

/// One run of the generator.
#[derive(Clone, Debug)]
pub struct Load {
    pub nodes: usize,
    pub ranks_per_node: usize,
    /// Training steps to simulate, one every `step_interval`.
    pub steps: u64,
    pub step_interval: Duration,
    /// How often each node sends its heartbeat (the daemons' interval).
    pub heartbeat: Duration,
    /// The leader's `heartbeat_timeout_seconds`: a node silent this long is lost.
    pub heartbeat_timeout: Duration,
    /// Whether a second daemon stands by as a leader candidate, and the leader is killed
    /// after the steps: the candidate takes over and adopts the world.
    pub takeover: bool,
}

impl Load {
    pub fn new(nodes: usize, ranks_per_node: usize) -> Self {
        Self {
            nodes,
            ranks_per_node,
            steps: 20,
            step_interval: Duration::from_secs(1),
            heartbeat: Duration::from_millis(500),
            heartbeat_timeout: Duration::from_millis(1500),
            takeover: false,
        }
    }

    pub fn with_takeover(mut self) -> Self {
        self.takeover = true;
        self
    }

    pub fn steps(mut self, steps: u64, interval: Duration) -> Self {
        self.steps = steps;
        self.step_interval = interval;
        self
    }

    fn world_size(&self) -> u32 {
        (self.nodes * self.ranks_per_node) as u32
    }
}

/// What one run measured.
#[derive(Clone, Debug)]
pub struct Figures {
    pub load: Load,
    /// From the last `Replicated` report of a step sent to a node's receipt of its memory
    /// commit, over every node and step, in milliseconds.
    pub commit_ms: Percentiles,
    /// Memory commits each node received per step: exactly one is right.
    pub commits: BTreeMap<u64, CommitCount>,
    /// Leader CPU seconds (user + system) per simulated step, over the stepping phase.
    pub leader_cpu_per_step: f64,
    /// Leader resident memory at the end, and its peak, in MiB.
    pub leader_rss_mib: f64,
    pub leader_peak_rss_mib: f64,
    /// Bytes the simulated nodes sent the leader per second of the stepping phase.
    pub bytes_in_per_s: f64,
    /// Bytes the leader sent back per second of the stepping phase.
    pub bytes_out_per_s: f64,
    /// `ckptctl status` against the leader: wall time and output size (text and JSON).
    pub status_ms: f64,
    pub status_bytes: usize,
    pub status_json_bytes: usize,
    /// How long connecting every node and registering every rank took, until the leader
    /// adopted the world.
    pub connect_s: f64,
    /// From a node's last frame to the leader's `fault` event naming it lost, in ms
    /// (`heartbeat_timeout` of it is the timeout itself).
    pub lost_after_ms: f64,
    /// With a takeover: from the leader's SIGKILL to its successor's `elected` event, and to
    /// its `adopted` event (every rank registered with it again), in seconds.
    pub elected_s: Option<f64>,
    pub takeover_s: Option<f64>,
}

/// Memory commits of one step, over the nodes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CommitCount {
    /// Nodes that received it exactly once.
    pub once: usize,
    /// Nodes that received it more than once.
    pub repeated: usize,
    /// Nodes that never received it.
    pub missing: usize,
}

#[derive(Clone, Copy, Debug, Default)]
pub struct Percentiles {
    pub p50: f64,
    pub p99: f64,
    pub max: f64,
    pub samples: usize,
}

impl Percentiles {
    pub fn of(mut values: Vec<f64>) -> Self {
        if values.is_empty() {
            return Self::default();
        }
        values.sort_by(f64::total_cmp);
        let at = |q: f64| values[((values.len() - 1) as f64 * q).round() as usize];
        Self {
            p50: at(0.5),
            p99: at(0.99),
            max: values[values.len() - 1],
            samples: values.len(),
        }
    }
}

impl Figures {
    /// The columns of [`Figures::row`].
    pub fn header() -> String {
        format!(
            "{:>6} {:>6} {:>9} {:>9} {:>9} {:>9} {:>10} {:>8} {:>10} {:>10} {:>9} {:>10} {:>9} {:>9} {:>9}",
            "nodes",
            "ranks",
            "commit50",
            "commit99",
            "lost",
            "cpu/step",
            "rss",
            "peak",
            "in",
            "out",
            "status",
            "status",
            "connect",
            "elected",
            "takeover"
        ) + &format!(
            "\n{:>6} {:>6} {:>9} {:>9} {:>9} {:>9} {:>10} {:>8} {:>10} {:>10} {:>9} {:>10} {:>9} {:>9} {:>9}",
            "", "", "ms", "ms", "ms", "cpu s", "MiB", "MiB", "MB/s", "MB/s", "ms", "KiB", "s", "s", "s"
        )
    }

    /// One line of figures.
    pub fn row(&self) -> String {
        format!(
            "{:>6} {:>6} {:>9.1} {:>9.1} {:>9.0} {:>9.4} {:>10.1} {:>8.1} {:>10.2} {:>10.2} {:>9.0} {:>10.0} {:>9.2} {:>9} {:>9}",
            self.load.nodes,
            self.load.nodes * self.load.ranks_per_node,
            self.commit_ms.p50,
            self.commit_ms.p99,
            self.lost_after_ms,
            self.leader_cpu_per_step,
            self.leader_rss_mib,
            self.leader_peak_rss_mib,
            self.bytes_in_per_s / 1e6,
            self.bytes_out_per_s / 1e6,
            self.status_ms,
            self.status_bytes as f64 / 1024.0,
            self.connect_s,
            self.elected_s.map_or("-".into(), |s| format!("{s:.2}")),
            self.takeover_s.map_or("-".into(), |s| format!("{s:.2}")),
        )
    }

    /// Steps some node did not receive exactly once.
    pub fn commit_faults(&self) -> Vec<(u64, CommitCount)> {
        self.commits
            .iter()
            .filter(|(_, c)| c.once != self.load.nodes)
            .map(|(s, c)| (*s, *c))
            .collect()
    }
}

/// Whether a daemon of the generator leads from the start or stands by.
#[derive(Clone, Copy, Debug)]
enum Role<'a> {
    Lead,
    /// A leader candidate following the leader at this address.
    Candidate {
        leader: &'a str,
    },
}

/// A `ckptd` of the generator that leads or may lead, killed when dropped.
struct LeaderProcess {
    child: Child,
    address: String,
    key_file: PathBuf,
    log: PathBuf,
}

impl LeaderProcess {
    /// A leader that supervises the simulated world: the run's timeline names its nodes, so
    /// the leader adopts it once every rank registered. It can launch nothing (no launcher
    /// on its PATH): after the measured fault, its relaunches fail harmlessly.
    fn start(dir: &Path, run: &str, load: &Load, role: Role) -> Result<Self> {
        let port = free_port();
        let address = format!("127.0.0.1:{port}");
        let key_file = dir.join("job.key");
        if !key_file.exists() {
            std::fs::write(&key_file, format!("{:064x}", rand::random::<u128>()))?;
        }
        let (name, leader, lead) = match role {
            Role::Lead => ("leader", address.as_str(), true),
            Role::Candidate { leader } => ("candidate", leader, false),
        };
        let config = dir.join("ckptd.toml");
        // Memory commits only: the simulated nodes hold no data to upload.
        std::fs::write(
            &config,
            "durable_every_steps = 1000000000\ndurable_every_seconds = 1000000000.0\n",
        )?;
        let log = dir.join(format!("{name}.log"));
        let no_launcher = dir.join("no-launcher");
        std::fs::create_dir_all(&no_launcher)?;
        let mut command = Command::new("/bin/bash");
        // As many connections as the cluster has nodes, and then some.
        command
            .arg("-c")
            .arg("ulimit -n \"$(ulimit -Hn)\" 2>/dev/null; exec \"$0\" \"$@\"")
            .arg(bin("ckptd"))
            .args(["--node", name, "--run", run])
            .arg("--store")
            .arg(format!("file://{}", dir.join("store").display()))
            .arg("--shm-dir")
            .arg(dir.join(format!("shm-{name}")))
            .arg("--socket")
            .arg(dir.join(format!("{name}.sock")))
            .args(["--listen", &address, "--leader", leader])
            .arg("--key-file")
            .arg(&key_file)
            .arg("--config")
            .arg(&config)
            .arg(if lead { "--lead" } else { "--leader-candidate" })
            .args([
                "--supervise",
                "mpiexec",
                "--trainer",
                "/nonexistent/trainer",
            ])
            .arg("--trainer-arg=train")
            .arg(format!("--active-nodes={}", load.nodes))
            .arg(format!("--ranks-per-node={}", load.ranks_per_node))
            .arg(format!(
                "--heartbeat-timeout-seconds={}",
                load.heartbeat_timeout.as_secs_f64()
            ))
            .env("PATH", &no_launcher)
            .env("RUST_LOG", "warn")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log)?);
        let child = command.spawn().context("starting the leader's ckptd")?;
        Ok(Self {
            child,
            address,
            key_file,
            log,
        })
    }

    fn pid(&self) -> u32 {
        self.child.id()
    }

    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for LeaderProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// CPU seconds (user + system) a process has used, from `/proc`.
fn cpu_seconds(pid: u32) -> Result<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    // Fields after the command name (which may hold spaces) start at ") ".
    let rest = stat.rsplit_once(") ").context("a stat line")?.1;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let ticks: f64 = fields[11].parse::<f64>()? + fields[12].parse::<f64>()?;
    Ok(ticks / 100.0)
}

/// A `/proc/PID/status` value in KiB, as MiB.
fn status_mib(pid: u32, field: &str) -> Result<f64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    let line = status
        .lines()
        .find(|l| l.starts_with(field))
        .with_context(|| format!("no {field}"))?;
    let kib: f64 = line.split_whitespace().nth(1).context("a value")?.parse()?;
    Ok(kib / 1024.0)
}

/// What every simulated node shares with the coordinator.
struct Shared {
    key: JobKey,
    run: RunId,
    load: Load,
    /// The step the nodes report now (0: not yet).
    step: tokio::sync::watch::Sender<u64>,
    /// When each node sent the last report of each step: `sent[step][node]`.
    sent: Mutex<BTreeMap<u64, Vec<Option<Instant>>>>,
    /// Memory commits each node received: (step, when).
    received: Vec<Mutex<Vec<(u64, Instant)>>>,
    bytes_in: AtomicU64,
    bytes_out: AtomicU64,
    /// Nodes whose ranks are all registered.
    registered: AtomicU64,
    /// A silenced node sends nothing more (its link stays open).
    silent: Vec<std::sync::atomic::AtomicBool>,
    /// When each node last sent a frame, in Unix milliseconds.
    last_frame_ms: Vec<AtomicU64>,
    /// The leadership the nodes follow, (epoch, address): what a daemon finds in the
    /// store when its leader is lost.
    leadership: tokio::sync::watch::Sender<(u64, String)>,
}

impl Shared {
    /// Sends `frames` from node `index` unless it was silenced.
    async fn send(
        &self,
        index: usize,
        writer: &mut tokio::net::tcp::OwnedWriteHalf,
        frames: &[u8],
    ) -> Result<bool> {
        if self.silent[index].load(Ordering::SeqCst) {
            return Ok(false);
        }
        writer.write_all(frames).await?;
        self.bytes_in
            .fetch_add(frames.len() as u64, Ordering::Relaxed);
        self.last_frame_ms[index].store(lazarus_shared::store::now_unix_ms(), Ordering::SeqCst);
        Ok(true)
    }
}

/// One simulated node: hello, its ranks, then a report per rank and step and a heartbeat.
/// When its link to the leader breaks, it links to the next leader the store names and
/// says hello again, as a daemon does.
async fn node(shared: Arc<Shared>, index: usize) -> Result<()> {
    let name = node_name(index);
    let load = &shared.load;
    let first_rank = (index * load.ranks_per_node) as u32;
    let ranks: Vec<u32> = (first_rank..first_rank + load.ranks_per_node as u32).collect();
    let send = |message: Message| wire::encode(&message, &[], Some(&shared.key));
    let hello = |epoch: u64| {
        let mut hello = send(Message::NodeHello {
            node: name.clone(),
            address: format!("127.0.0.1:{}", 20_000 + index),
            buddy: None,
            socket: String::new(),
            t0: Vec::new(),
            epoch,
            candidate: false,
            replicas: Vec::new(),
            instance: index as u64 + 1,
            rollback: Default::default(),
        });
        for rank in &ranks {
            hello.extend(send(Message::RankUp {
                node: name.clone(),
                run: shared.run.clone(),
                rank: *rank,
                world_size: load.world_size(),
                pid: fake_pid(*rank),
            }));
        }
        hello
    };
    let mut leadership = shared.leadership.subscribe();
    let mut steps = shared.step.subscribe();
    let mut heartbeat = tokio::time::interval(load.heartbeat);
    let mut reported = 0;
    let mut registered = false;
    loop {
        let (epoch, address) = leadership.borrow_and_update().clone();
        // Linked once the leader's first frame came back; a node retries as the daemon's
        // uplink does (thousands of nodes connecting at once can overflow the accept queue).
        let mut attempt = 0;
        let (mut reader, mut writer) = loop {
            attempt += 1;
            let linked = async {
                let stream = TcpStream::connect(&address).await?;
                stream.set_nodelay(true)?;
                let (mut reader, mut writer) = stream.into_split();
                shared.send(index, &mut writer, &hello(epoch)).await?;
                wire::read_frame(&mut reader, Some(&shared.key)).await?;
                anyhow::Ok((reader, writer))
            };
            match linked.await {
                Ok(halves) => break halves,
                Err(error) if attempt >= 20 => {
                    return Err(error.context(format!("node {name} linking to {address}")))
                }
                Err(_) => tokio::time::sleep(Duration::from_millis(100 * attempt)).await,
            }
        };
        if !registered {
            registered = true;
            shared.registered.fetch_add(1, Ordering::SeqCst);
        }
        let mut receiver = {
            let shared = shared.clone();
            tokio::spawn(async move {
                loop {
                    let frame = match wire::read_frame(&mut reader, Some(&shared.key)).await {
                        Ok(frame) => frame,
                        Err(_) => return,
                    };
                    let size =
                        wire::encode(&frame.message, &frame.payload, Some(&shared.key)).len();
                    shared.bytes_out.fetch_add(size as u64, Ordering::Relaxed);
                    if let Message::MemoryCommitted { step, .. } = frame.message {
                        shared.received[index]
                            .lock()
                            .expect("not poisoned")
                            .push((step, Instant::now()));
                    }
                }
            })
        };
        // Ok(true): the run is over; Ok(false): the link broke.
        let linked: Result<bool> = async {
            loop {
                tokio::select! {
                    changed = steps.changed() => {
                        if changed.is_err() {
                            return Ok(true);
                        }
                        let latest = *steps.borrow_and_update();
                        if latest == u64::MAX {
                            return Ok(true);
                        }
                        // Every step since the last one reported, in order, as a daemon reports
                        // its ranks' snapshots. A watch keeps only the newest step: a node that
                        // fell behind the generator (a loaded machine) would otherwise skip a
                        // step, which the leader must then give up, and the test counts it
                        // missing at every node.
                        for step in reported + 1..=latest {
                            let mut frames = Vec::new();
                            for rank in &ranks {
                                frames.extend(send(Message::Replicated {
                                    node: name.clone(),
                                    run: shared.run.clone(),
                                    rank: *rank,
                                    world_size: load.world_size(),
                                    step,
                                    durable_requested: false,
                                    // These nodes upload nothing: they say nothing of uploads.
                                    upload: None,
                                    rollback: Default::default(),
                                }));
                            }
                            match shared.send(index, &mut writer, &frames).await {
                                Err(_) => return Ok(false),
                                Ok(false) => break,
                                Ok(true) => {}
                            }
                            let now = Instant::now();
                            if let Some(sent) = shared.sent.lock().expect("not poisoned").get_mut(&step) {
                                sent[index] = Some(now);
                            }
                            reported = step;
                        }
                    }
                    _ = heartbeat.tick() => {
                        let beat = send(Message::NodeHeartbeat {
                            node: name.clone(),
                            ranks: ranks
                                .iter()
                                .map(|rank| RankBeat {
                                    rank: *rank,
                                    pid: fake_pid(*rank),
                                    step: reported,
                                    seen_ms_ago: 0,
                                    compute_us: 900_000,
                                    process_state: None,
                                    unhealthy: None,
                                    restored_from: None,
                                    losses: Vec::new(),
                                })
                                .collect(),
                        });
                        if shared.send(index, &mut writer, &beat).await.is_err() {
                            return Ok(false);
                        }
                    }
                    _ = &mut receiver => return Ok(false),
                }
            }
        }
        .await;
        receiver.abort();
        if linked? {
            return Ok(());
        }
        // The leader is gone: wait for the store to name the next one.
        loop {
            tokio::select! {
                changed = leadership.changed() => {
                    if changed.is_err() {
                        return Ok(());
                    }
                    if leadership.borrow().1 != address {
                        break;
                    }
                }
                changed = steps.changed() => {
                    if changed.is_err() || *steps.borrow_and_update() == u64::MAX {
                        return Ok(());
                    }
                }
            }
        }
    }
}

/// Steps simulated after a takeover, committed by the successor.
const STEPS_AFTER_TAKEOVER: u64 = 3;

/// The process id a simulated rank reports (no such process runs).
fn fake_pid(rank: u32) -> u32 {
    1_000_000 + rank
}

fn node_name(index: usize) -> String {
    format!("s{index:05}")
}

/// The first event of `kind` in the run's timeline that `also` accepts, once it is there.
async fn event(
    timeline: &lazarus_shared::store::RunStore,
    kind: &str,
    also: impl Fn(&wire::Event) -> bool,
    within: Duration,
) -> Option<wire::Event> {
    let deadline = Instant::now() + within;
    while Instant::now() < deadline {
        if let Ok(events) = timeline.events().await {
            if let Some(found) = events.into_iter().find(|e| e.kind == kind && also(e)) {
                return Some(found);
            }
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    None
}

/// Runs `load` against a fresh leader in `dir`.
pub fn run(dir: &Path, load: &Load) -> Result<Figures> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    runtime.block_on(run_async(dir, load))
}

async fn run_async(dir: &Path, load: &Load) -> Result<Figures> {
    let run = "scale";
    let run_id = RunId::try_from(run.to_string()).map_err(|e| anyhow::anyhow!("{e:?}"))?;
    let names: Vec<String> = (0..load.nodes).map(node_name).collect();
    // The timeline of a world launched on the simulated nodes, which the leader adopts.
    let store = lazarus_shared::store::Store::open(
        &format!("file://{}", dir.join("store").display()),
        lazarus_shared::store::OpenMode::CreateIfMissing,
        lazarus_shared::store::StoreOptions::default(),
    )
    .await?;
    let timeline = store.run(&run_id);
    let launch = wire::Event {
        unix_ms: lazarus_shared::store::now_unix_ms(),
        kind: "launch".into(),
        detail: format!("simulated on {} nodes", load.nodes),
        generation: 0,
        nodes: names,
        epoch: 0,
    };
    timeline.put_event(&launch, 0).await?;
    let mut leader = LeaderProcess::start(dir, run, load, Role::Lead)?;
    let key = JobKey::from_file(&leader.key_file)?;
    // The leader listens once it is ready.
    let deadline = Instant::now() + Duration::from_secs(30);
    while TcpStream::connect(&leader.address).await.is_err() {
        if Instant::now() > deadline {
            bail!("the leader never listened:\n{}", leader.log());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // The successor-to-be: it links to the leader as a node and stands by.
    let successor = if load.takeover {
        let address = leader.address.clone();
        Some(LeaderProcess::start(
            dir,
            run,
            load,
            Role::Candidate { leader: &address },
        )?)
    } else {
        None
    };
    let (step, _) = tokio::sync::watch::channel(0u64);
    let (leadership, _) = tokio::sync::watch::channel((0, leader.address.clone()));
    let after_takeover = if load.takeover {
        STEPS_AFTER_TAKEOVER
    } else {
        0
    };
    let shared = Arc::new(Shared {
        key,
        run: run_id,
        load: load.clone(),
        step,
        sent: Mutex::new(
            (1..=load.steps + after_takeover)
                .map(|s| (s, vec![None; load.nodes]))
                .collect(),
        ),
        received: (0..load.nodes).map(|_| Mutex::new(Vec::new())).collect(),
        bytes_in: AtomicU64::new(0),
        bytes_out: AtomicU64::new(0),
        registered: AtomicU64::new(0),
        silent: (0..load.nodes).map(|_| Default::default()).collect(),
        last_frame_ms: (0..load.nodes).map(|_| AtomicU64::new(0)).collect(),
        leadership,
    });
    // What a daemon does when its leader is lost: find the newest leader in the store.
    let watcher = {
        let (shared, timeline) = (shared.clone(), timeline.clone());
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(Duration::from_millis(100)).await;
                if let Ok(Some(record)) = timeline.leadership().await {
                    shared.leadership.send_if_modified(|known| {
                        let newer = record.epoch > known.0;
                        if newer {
                            *known = (record.epoch, record.address.clone());
                        }
                        newer
                    });
                }
            }
        })
    };
    let connecting = Instant::now();
    let mut tasks = Vec::new();
    for index in 0..load.nodes {
        tasks.push(tokio::spawn(node(shared.clone(), index)));
    }
    // Every node registered, and the leader knows every rank.
    // `ckptctl status` against the leader, as text or JSON.
    let status = |json: bool| {
        let mut command = Command::new(bin("ckptctl"));
        if json {
            command.arg("--json");
        }
        command
            .args(["status", "--leader", &leader.address, "--key-file"])
            .arg(&leader.key_file);
        tokio::task::block_in_place(|| command.output())
    };
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        if shared.registered.load(Ordering::SeqCst) == load.nodes as u64 {
            let output = status(true)?;
            let json: serde_json::Value =
                serde_json::from_slice(&output.stdout).unwrap_or_default();
            let known = json["runs"][0]["ranks"].as_array().map_or(0, |r| r.len());
            if known == load.world_size() as usize {
                break;
            }
        }
        if let Some(failed) = tasks.iter().position(|t| t.is_finished()) {
            let why = match tasks.swap_remove(failed).await {
                Ok(Err(error)) => format!("{error:#}"),
                other => format!("{other:?}"),
            };
            let log = leader.log();
            let said: Vec<&str> = log
                .lines()
                .filter(|l| l.contains(&node_name(failed)) || l.contains("ERROR"))
                .take(20)
                .collect();
            bail!(
                "simulated node {failed} ended early: {why}\nthe leader said:\n{}",
                said.join("\n")
            );
        }
        if Instant::now() > deadline {
            bail!(
                "{} of {} nodes registered in 120 s:\n{}",
                shared.registered.load(Ordering::SeqCst),
                load.nodes,
                leader.log()
            );
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    if event(&timeline, "adopted", |_| true, Duration::from_secs(60))
        .await
        .is_none()
    {
        bail!("the leader did not adopt the world:\n{}", leader.log());
    }
    let connect_s = connecting.elapsed().as_secs_f64();
    if load.takeover {
        // The leader names the candidate as its successor.
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let json: serde_json::Value =
                serde_json::from_slice(&status(true)?.stdout).unwrap_or_default();
            let named = json["succession"]
                .as_array()
                .is_some_and(|s| s.iter().any(|s| s["node"] == "candidate"));
            if named {
                break;
            }
            if Instant::now() > deadline {
                bail!("the candidate never joined the succession: {json}");
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    // Training: a step every interval.
    let cpu_before = cpu_seconds(leader.pid())?;
    let (in_before, out_before) = (
        shared.bytes_in.load(Ordering::Relaxed),
        shared.bytes_out.load(Ordering::Relaxed),
    );
    let started = Instant::now();
    let mut tick = tokio::time::interval(load.step_interval);
    for step in 1..=load.steps {
        tick.tick().await;
        shared.step.send_replace(step);
    }
    tick.tick().await;
    let elapsed = started.elapsed().as_secs_f64();
    let cpu = cpu_seconds(leader.pid())? - cpu_before;
    let bytes_in = shared.bytes_in.load(Ordering::Relaxed) - in_before;
    let bytes_out = shared.bytes_out.load(Ordering::Relaxed) - out_before;
    // The last commits still on their way.
    let deadline = Instant::now() + Duration::from_secs(10);
    while Instant::now() < deadline
        && shared
            .received
            .iter()
            .any(|r| r.lock().expect("not poisoned").len() < load.steps as usize)
    {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    let timed = Instant::now();
    let output = status(false)?;
    let status_ms = timed.elapsed().as_secs_f64() * 1e3;
    if !output.status.success() {
        bail!(
            "ckptctl status failed: {}",
            String::from_utf8_lossy(&output.stderr)
        );
    }
    let status_bytes = output.stdout.len();
    let status_json_bytes = status(true)?.stdout.len();
    let leader_rss_mib = status_mib(leader.pid(), "VmRSS:")?;
    let leader_peak_rss_mib = status_mib(leader.pid(), "VmHWM:")?;

    // The leader is killed: its successor takes over, adopts the world and commits on.
    let (mut elected_s, mut takeover_s) = (None, None);
    if let Some(successor) = successor {
        let killed_ms = lazarus_shared::store::now_unix_ms();
        leader.child.kill()?;
        leader.child.wait()?;
        let since_kill = |at: u64| at.saturating_sub(killed_ms) as f64 / 1e3;
        let successor_epoch = |e: &wire::Event| e.epoch >= 2;
        let Some(adopted) = event(
            &timeline,
            "adopted",
            successor_epoch,
            Duration::from_secs(120),
        )
        .await
        else {
            bail!(
                "the successor did not adopt the world:\n{}",
                successor.log()
            );
        };
        takeover_s = Some(since_kill(adopted.unix_ms));
        elected_s = event(
            &timeline,
            "elected",
            successor_epoch,
            Duration::from_secs(5),
        )
        .await
        .map(|e| since_kill(e.unix_ms));
        leader = successor;
        // One step per interval again (not the burst of ticks missed meanwhile).
        tick.reset();
        for step in load.steps + 1..=load.steps + after_takeover {
            tick.tick().await;
            shared.step.send_replace(step);
        }
        let deadline = Instant::now() + Duration::from_secs(30);
        while Instant::now() < deadline
            && shared.received.iter().any(|r| {
                r.lock().expect("not poisoned").len() < (load.steps + after_takeover) as usize
            })
        {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    // A node falls silent: the leader declares it lost.
    shared.silent[0].store(true, Ordering::SeqCst);
    let named = |e: &wire::Event| e.detail.contains(&node_name(0));
    let Some(fault) = event(&timeline, "fault", named, Duration::from_secs(60)).await else {
        bail!("no node was declared lost:\n{}", leader.log());
    };
    let lost_after_ms = fault
        .unix_ms
        .saturating_sub(shared.last_frame_ms[0].load(Ordering::SeqCst))
        as f64;
    if !fault.detail.contains(&node_name(0)) {
        bail!("the wrong node was declared lost: {}", fault.detail);
    }

    shared.step.send_replace(u64::MAX);
    for task in tasks {
        task.await??;
    }

    watcher.abort();
    let sent = shared.sent.lock().expect("not poisoned").clone();
    let mut latencies = Vec::new();
    let mut commits: BTreeMap<u64, CommitCount> = BTreeMap::new();
    for step in 1..=load.steps + after_takeover {
        let last = sent[&step].iter().flatten().max().copied();
        let count = commits.entry(step).or_default();
        for received in &shared.received {
            let received = received.lock().expect("not poisoned");
            let times: Vec<Instant> = received
                .iter()
                .filter(|(s, _)| *s == step)
                .map(|(_, at)| *at)
                .collect();
            match times.len() {
                0 => count.missing += 1,
                1 => count.once += 1,
                _ => count.repeated += 1,
            }
            // Latency over the measured steps only, with the leader the figures are about.
            if let (true, Some(last), Some(first)) = (step <= load.steps, last, times.first()) {
                latencies.push(first.saturating_duration_since(last).as_secs_f64() * 1e3);
            }
        }
    }
    Ok(Figures {
        load: load.clone(),
        commit_ms: Percentiles::of(latencies),
        commits,
        leader_cpu_per_step: cpu / load.steps as f64,
        leader_rss_mib,
        leader_peak_rss_mib,
        bytes_in_per_s: bytes_in as f64 / elapsed,
        bytes_out_per_s: bytes_out as f64 / elapsed,
        status_ms,
        status_bytes,
        status_json_bytes,
        connect_s,
        lost_after_ms,
        elected_s,
        takeover_s,
    })
}
