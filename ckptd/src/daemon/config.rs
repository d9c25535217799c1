//! `ckptd`'s configuration: a TOML file, with command-line flags overriding it.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use clap::{Parser, ValueEnum};
use lazarus_shared::RunId;
use serde::Deserialize;

pub use crate::logging::LogFormat;

/// Chunks a daemon uploads at once unless configured. Each chunk in flight holds its
/// encoding (up to a chunk's bytes) and maps of its slot's and delta base's ranges. A chunk
/// spends part of its time waiting on its write and fsyncs, and with 4 in flight two daemons
/// on 2 cores used 54-70% of the cores over an upload; with 8, 71-78%, and they uploaded
/// 670-712 MB/s each instead of 491-594 (16: 636-678), in four interleaved rounds. Once the
/// codec compressed planes straight into the chunk, 671-750 instead of 651-710
/// (docs/benchmarks.md).
pub const UPLOAD_CONCURRENCY: usize = 8;

/// How the daemon's data path (hashing and replicating snapshots, receiving replicas,
/// uploads) shares the node's cores with the ranks. Its threads are its own (the control
/// path, which answers the ranks, heartbeats and leads, always runs under `SCHED_BATCH`).
#[derive(Clone, Copy, Debug, Default, ValueEnum, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum DataCpu {
    /// `SCHED_IDLE`: below the ranks. A rank that wakes takes its core back at once, though
    /// the kernel shares the CPU between scheduling groups (sessions, cgroups) first. Once
    /// the data path's threads have waited about 100 ms for a CPU while it has work in hand
    /// (ranks that keep every core busy, by busy-polling MPI or with more ranks than cores),
    /// they are raised to `SCHED_BATCH` for up to a second, or until it has nothing in hand.
    /// Raising needs `CAP_SYS_NICE` (or an `RLIMIT_NICE` that allows nice 0); without it the
    /// daemon says so and runs as `Shared`.
    Idle,
    /// `SCHED_BATCH`, an equal share beside the ranks (which then wait for a core the data
    /// path holds: tens of milliseconds on an oversubscribed node), so the data path keeps
    /// its share however busy the cores are.
    #[default]
    Shared,
}

/// Flags; each overrides the same key of the config file.
#[derive(Debug, Parser)]
#[command(
    name = "ckptd",
    version,
    about = "Per-node checkpoint daemon: takes snapshots from local ranks, replicates them to a buddy node, streams them to storage and commits steps"
)]
pub struct Cli {
    /// TOML file with the keys below (flags override it).
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// This node's id (letters, digits, '.', '_', '-').
    #[arg(long)]
    pub node: Option<String>,
    /// The run this daemon serves.
    #[arg(long)]
    pub run: Option<String>,
    /// Checkpoint store URL: file:///path or s3://bucket/prefix.
    #[arg(long)]
    pub store: Option<String>,
    /// Directory in shared memory (e.g. under /dev/shm) for snapshot slots and replicas.
    #[arg(long)]
    pub shm_dir: Option<PathBuf>,
    /// Unix socket the local ranks connect to.
    #[arg(long)]
    pub socket: Option<PathBuf>,
    /// Socket mode: 600 (the job's user only) or 660 (and its group).
    #[arg(long)]
    pub socket_mode: Option<String>,
    /// TCP address for buddies, the leader and `ckptctl status`.
    #[arg(long)]
    pub listen: Option<SocketAddr>,
    /// The address other daemons and `ckptctl` reach this one at (default: `listen`), when
    /// they reach it through a relay or a NAT.
    #[arg(long)]
    pub advertise: Option<SocketAddr>,
    /// The leader's TCP address.
    #[arg(long)]
    pub leader: Option<SocketAddr>,
    /// This daemon leads first.
    #[arg(long)]
    pub lead: bool,
    /// This daemon takes over when the leader is lost (in the order of succession the
    /// leader publishes). It needs the same supervision settings as the leader.
    #[arg(long)]
    pub leader_candidate: bool,
    /// The buddy node's TCP address: where this node's snapshots are replicated (T1).
    #[arg(long)]
    pub buddy: Option<SocketAddr>,
    /// File holding the per-job key that authenticates TCP messages.
    #[arg(long)]
    pub key_file: Option<PathBuf>,
    /// Address of the Prometheus /metrics endpoint.
    #[arg(long)]
    pub metrics: Option<SocketAddr>,
    /// Most bytes of snapshot slots and replicas this daemon keeps in shared memory.
    #[arg(long)]
    pub memory_budget_bytes: Option<u64>,
    /// Chunks uploaded at once (default 8).
    #[arg(long)]
    pub upload_concurrency: Option<usize>,
    /// Make a memory-committed step durable every this many steps (the first one at or past
    /// each multiple).
    #[arg(long)]
    pub durable_every_steps: Option<u64>,
    /// ... or when this many seconds passed since the last durable commit.
    #[arg(long)]
    pub durable_every_seconds: Option<f64>,
    /// Delta-encode chunks against the previous durable step (keeps a copy of it in shm).
    #[arg(long)]
    pub delta: Option<bool>,
    /// Drop a replicated snapshot whose memory commit has not come after this many seconds
    /// (another rank's snapshot failed), so the next one can go.
    #[arg(long)]
    pub commit_timeout_seconds: Option<f64>,
    #[arg(long, value_enum)]
    pub log_format: Option<LogFormat>,
    /// How the data path (hashing and replicating snapshots, receiving replicas, uploads)
    /// shares the node's cores with the ranks.
    #[arg(long, value_enum)]
    pub data_cpu: Option<DataCpu>,
    /// Leader only: launch and supervise the training world with this launcher.
    #[arg(long, value_enum)]
    pub supervise: Option<Launcher>,
    /// The trainer binary the supervisor launches (default: `trainer` beside `ckptd`).
    #[arg(long)]
    pub trainer: Option<PathBuf>,
    /// One argument for the trainer (repeat; appended to `trainer_args` from the file).
    #[arg(long = "trainer-arg", allow_hyphen_values = true)]
    pub trainer_args: Vec<String>,
    /// Nodes that train; the other connected nodes are hot spares.
    #[arg(long)]
    pub active_nodes: Option<usize>,
    /// Ranks the supervisor launches on every active node (default 1). Ranks are numbered
    /// node by node, so a tensor-parallel group of up to this many ranks stays in one node.
    #[arg(long)]
    pub ranks_per_node: Option<usize>,
    /// A node whose daemon has not been heard from for this long is lost.
    #[arg(long)]
    pub heartbeat_timeout_seconds: Option<f64>,
    /// A world whose ranks made no step progress for this long is hung.
    #[arg(long)]
    pub hang_timeout_seconds: Option<f64>,
    /// A world that has not finished its first step this long after its launch is hung
    /// (start, MPI init, restore: a restore from storage can take minutes). Never less than
    /// the hang timeout.
    #[arg(long)]
    pub startup_timeout_seconds: Option<f64>,
    /// With a node lost and no spare left: wait for a node, or shrink the world to the
    /// healthy nodes (fewer data-parallel ranks, a resharding restore from T2).
    #[arg(long, value_enum)]
    pub when_no_spare: Option<NoSpare>,
    /// The shrink policy never goes below this many nodes (it waits instead).
    #[arg(long)]
    pub min_active_nodes: Option<usize>,
    /// A world that fails this many times in a row at the same step (its ranks dead or hung,
    /// no node lost) is not relaunched again: the run stops with a `failed` event (default 2).
    #[arg(long)]
    pub same_step_failures: Option<u32>,
    /// A rank whose health check fails (a non-finite loss or gradient norm, a loss spike)
    /// has the world rolled back to the newest durable step at least this many steps before
    /// the bad one (default 0: any older durable step).
    #[arg(long)]
    pub rollback_steps: Option<u64>,
    /// ... and the ranks skip this many global batches after it, at least up to the bad
    /// step's (default 0: just those).
    #[arg(long)]
    pub skip_batches: Option<u64>,
    /// Exit once the run completed or was preempted (the batch script's leader does).
    #[arg(long)]
    pub exit_when_done: bool,
    /// A rank whose compute time per step exceeds the median by this fraction is slow.
    #[arg(long)]
    pub straggler_margin: Option<f64>,
    /// ... and it is reported as a straggler once it has been slow for this long.
    #[arg(long)]
    pub straggler_seconds: Option<f64>,
}

/// What the supervisor does when a node is lost and no spare is left.
#[derive(Clone, Copy, Debug, Default, ValueEnum, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum NoSpare {
    /// Wait until a node (a new one, or the lost one back) joins.
    #[default]
    Wait,
    /// Continue on the healthy nodes: fewer data-parallel ranks.
    Shrink,
}

/// How the supervising leader starts the world.
#[derive(Clone, Copy, Debug, ValueEnum, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum Launcher {
    /// MPICH's mpiexec, one MPMD block per node (each with its daemon's socket).
    Mpiexec,
    /// `srun --mpi=pmi2` on the active nodes of the Slurm allocation.
    Srun,
}

/// What the supervising leader runs, and when it declares a failure.
#[derive(Clone, Debug)]
pub struct Supervision {
    pub launcher: Launcher,
    pub trainer: PathBuf,
    pub trainer_args: Vec<String>,
    pub active_nodes: usize,
    pub ranks_per_node: usize,
    pub heartbeat_timeout_seconds: f64,
    pub hang_timeout_seconds: f64,
    pub startup_timeout_seconds: f64,
    pub when_no_spare: NoSpare,
    pub min_active_nodes: usize,
    pub same_step_failures: u32,
    pub rollback_steps: u64,
    pub skip_batches: u64,
    pub exit_when_done: bool,
}

/// The config file. Every key is optional here; [`Config::resolve`] says which are required.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct File {
    node: Option<String>,
    run: Option<String>,
    store: Option<String>,
    shm_dir: Option<PathBuf>,
    socket: Option<PathBuf>,
    socket_mode: Option<String>,
    listen: Option<SocketAddr>,
    advertise: Option<SocketAddr>,
    leader: Option<SocketAddr>,
    lead: Option<bool>,
    leader_candidate: Option<bool>,
    buddy: Option<SocketAddr>,
    key_file: Option<PathBuf>,
    metrics: Option<SocketAddr>,
    memory_budget_bytes: Option<u64>,
    upload_concurrency: Option<usize>,
    durable_every_steps: Option<u64>,
    durable_every_seconds: Option<f64>,
    delta: Option<bool>,
    commit_timeout_seconds: Option<f64>,
    log_format: Option<LogFormat>,
    data_cpu: Option<DataCpu>,
    supervise: Option<Launcher>,
    trainer: Option<PathBuf>,
    #[serde(default)]
    trainer_args: Vec<String>,
    active_nodes: Option<usize>,
    ranks_per_node: Option<usize>,
    heartbeat_timeout_seconds: Option<f64>,
    hang_timeout_seconds: Option<f64>,
    startup_timeout_seconds: Option<f64>,
    when_no_spare: Option<NoSpare>,
    min_active_nodes: Option<usize>,
    same_step_failures: Option<u32>,
    rollback_steps: Option<u64>,
    skip_batches: Option<u64>,
    exit_when_done: Option<bool>,
    straggler_margin: Option<f64>,
    straggler_seconds: Option<f64>,
}

/// A validated configuration.
#[derive(Clone, Debug)]
pub struct Config {
    pub node: String,
    pub run: RunId,
    pub store: String,
    pub shm_dir: PathBuf,
    pub socket: PathBuf,
    pub socket_mode: u32,
    pub listen: SocketAddr,
    /// Where the other daemons reach this one.
    pub advertise: SocketAddr,
    pub leader: SocketAddr,
    pub lead: bool,
    /// May take over leadership (`lead` daemons may too).
    pub candidate: bool,
    /// A daemon (node or leader) not heard from for this long is lost.
    pub heartbeat_timeout_seconds: f64,
    pub buddy: Option<SocketAddr>,
    pub key_file: PathBuf,
    pub metrics: Option<SocketAddr>,
    pub memory_budget_bytes: u64,
    pub upload_concurrency: usize,
    pub durable_every_steps: u64,
    pub durable_every_seconds: f64,
    pub delta: bool,
    pub commit_timeout_seconds: f64,
    pub log_format: LogFormat,
    pub data_cpu: DataCpu,
    pub supervision: Option<Supervision>,
    pub straggler_margin: f64,
    pub straggler_seconds: f64,
}

/// A config that cannot be used (exit 2).
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct ConfigError(pub String);

impl Config {
    pub fn resolve(cli: &Cli) -> Result<Self, ConfigError> {
        let file = match &cli.config {
            Some(path) => read_file(path)?,
            None => File::default(),
        };
        let missing = |key: &str| {
            ConfigError(format!(
                "ckptd needs `{key}`: set it in the config file or pass --{}",
                key.replace('_', "-")
            ))
        };
        let node = cli
            .node
            .clone()
            .or(file.node)
            .ok_or_else(|| missing("node"))?;
        let node_ok = !node.is_empty()
            && node.len() <= 64
            && node
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b));
        if !node_ok {
            return Err(ConfigError(format!(
                "node {node:?}: use 1 to 64 letters, digits, '.', '_' or '-'"
            )));
        }
        let run_text = cli.run.clone().or(file.run).ok_or_else(|| missing("run"))?;
        let run: RunId = run_text
            .parse()
            .map_err(|e: lazarus_shared::ids::BadRunId| ConfigError(e.to_string()))?;
        let store = cli
            .store
            .clone()
            .or(file.store)
            .ok_or_else(|| missing("store"))?;
        if !(store.starts_with("file://") || store.starts_with("s3://")) {
            return Err(ConfigError(format!(
                "store {store:?}: ckptd needs a store every node shares (file:///shared/path or s3://bucket/prefix)"
            )));
        }
        let shm_dir = cli
            .shm_dir
            .clone()
            .or(file.shm_dir)
            .ok_or_else(|| missing("shm_dir"))?;
        let socket = cli
            .socket
            .clone()
            .or(file.socket)
            .ok_or_else(|| missing("socket"))?;
        let socket_mode = match cli
            .socket_mode
            .clone()
            .or(file.socket_mode)
            .as_deref()
            .unwrap_or("600")
        {
            "600" | "0600" => 0o600,
            "660" | "0660" => 0o660,
            other => {
                return Err(ConfigError(format!(
                    "socket_mode {other:?}: use 600 or 660"
                )))
            }
        };
        let listen = cli
            .listen
            .or(file.listen)
            .ok_or_else(|| missing("listen"))?;
        let leader = cli
            .leader
            .or(file.leader)
            .ok_or_else(|| missing("leader"))?;
        let lead = cli.lead || file.lead.unwrap_or(false);
        let candidate = lead || cli.leader_candidate || file.leader_candidate.unwrap_or(false);
        let key_file = cli
            .key_file
            .clone()
            .or(file.key_file)
            .ok_or_else(|| missing("key_file"))?;
        let durable_every_steps = cli
            .durable_every_steps
            .or(file.durable_every_steps)
            .unwrap_or(100);
        if durable_every_steps == 0 {
            return Err(ConfigError("durable_every_steps must be at least 1".into()));
        }
        let durable_every_seconds = cli
            .durable_every_seconds
            .or(file.durable_every_seconds)
            .unwrap_or(1800.0);
        if durable_every_seconds.is_nan() || durable_every_seconds <= 0.0 {
            return Err(ConfigError("durable_every_seconds must be above 0".into()));
        }
        let commit_timeout_seconds = cli
            .commit_timeout_seconds
            .or(file.commit_timeout_seconds)
            .unwrap_or(10.0);
        if commit_timeout_seconds.is_nan() || commit_timeout_seconds <= 0.0 {
            return Err(ConfigError("commit_timeout_seconds must be above 0".into()));
        }
        let upload_concurrency = cli
            .upload_concurrency
            .or(file.upload_concurrency)
            .unwrap_or(UPLOAD_CONCURRENCY);
        if upload_concurrency == 0 || upload_concurrency > 256 {
            return Err(ConfigError("upload_concurrency must be 1 to 256".into()));
        }
        let positive = |value: Option<f64>, default: f64, key: &str| {
            let value = value.unwrap_or(default);
            if value.is_nan() || value <= 0.0 {
                Err(ConfigError(format!("{key} must be above 0")))
            } else {
                Ok(value)
            }
        };
        let straggler_margin = positive(
            cli.straggler_margin.or(file.straggler_margin),
            0.25,
            "straggler_margin",
        )?;
        let straggler_seconds = positive(
            cli.straggler_seconds.or(file.straggler_seconds),
            30.0,
            "straggler_seconds",
        )?;
        let heartbeat_timeout_seconds = positive(
            cli.heartbeat_timeout_seconds
                .or(file.heartbeat_timeout_seconds),
            2.0,
            "heartbeat_timeout_seconds",
        )?;
        let supervision = match cli.supervise.or(file.supervise) {
            None => None,
            Some(launcher) => {
                if !candidate {
                    return Err(ConfigError(
                        "supervise is for a daemon that may lead: set lead = true or leader_candidate = true".into(),
                    ));
                }
                let trainer = match cli.trainer.clone().or(file.trainer) {
                    Some(path) => path,
                    None => std::env::current_exe()
                        .ok()
                        .and_then(|exe| exe.parent().map(|dir| dir.join("trainer")))
                        .filter(|path| path.exists())
                        .unwrap_or_else(|| PathBuf::from("trainer")),
                };
                let mut trainer_args = file.trainer_args;
                trainer_args.extend(cli.trainer_args.iter().cloned());
                if trainer_args.is_empty() {
                    return Err(ConfigError(
                        "supervise needs trainer_args (e.g. [\"train\", \"--config\", \"tiny\"])"
                            .into(),
                    ));
                }
                let active_nodes = cli
                    .active_nodes
                    .or(file.active_nodes)
                    .ok_or_else(|| missing("active_nodes"))?;
                if active_nodes == 0 {
                    return Err(ConfigError("active_nodes must be at least 1".into()));
                }
                let ranks_per_node = cli.ranks_per_node.or(file.ranks_per_node).unwrap_or(1);
                if ranks_per_node == 0 {
                    return Err(ConfigError("ranks_per_node must be at least 1".into()));
                }
                let min_active_nodes = cli.min_active_nodes.or(file.min_active_nodes).unwrap_or(1);
                if min_active_nodes == 0 || min_active_nodes > active_nodes {
                    return Err(ConfigError(
                        "min_active_nodes must be 1 to active_nodes".into(),
                    ));
                }
                let same_step_failures = cli
                    .same_step_failures
                    .or(file.same_step_failures)
                    .unwrap_or(2);
                if same_step_failures == 0 {
                    return Err(ConfigError("same_step_failures must be at least 1".into()));
                }
                Some(Supervision {
                    when_no_spare: cli.when_no_spare.or(file.when_no_spare).unwrap_or_default(),
                    min_active_nodes,
                    same_step_failures,
                    rollback_steps: cli.rollback_steps.or(file.rollback_steps).unwrap_or(0),
                    skip_batches: cli.skip_batches.or(file.skip_batches).unwrap_or(0),
                    exit_when_done: cli.exit_when_done || file.exit_when_done.unwrap_or(false),
                    launcher,
                    trainer,
                    trainer_args,
                    active_nodes,
                    ranks_per_node,
                    heartbeat_timeout_seconds,
                    hang_timeout_seconds: positive(
                        cli.hang_timeout_seconds.or(file.hang_timeout_seconds),
                        120.0,
                        "hang_timeout_seconds",
                    )?,
                    startup_timeout_seconds: positive(
                        cli.startup_timeout_seconds.or(file.startup_timeout_seconds),
                        300.0,
                        "startup_timeout_seconds",
                    )?,
                })
            }
        };
        Ok(Self {
            supervision,
            node,
            run,
            store,
            shm_dir,
            socket,
            socket_mode,
            listen,
            advertise: cli.advertise.or(file.advertise).unwrap_or(listen),
            leader,
            lead,
            candidate,
            heartbeat_timeout_seconds,
            buddy: cli.buddy.or(file.buddy),
            key_file,
            metrics: cli.metrics.or(file.metrics),
            memory_budget_bytes: cli
                .memory_budget_bytes
                .or(file.memory_budget_bytes)
                .unwrap_or(64 << 30),
            upload_concurrency,
            durable_every_steps,
            durable_every_seconds,
            delta: cli.delta.or(file.delta).unwrap_or(true),
            commit_timeout_seconds,
            log_format: cli.log_format.or(file.log_format).unwrap_or_default(),
            data_cpu: cli.data_cpu.or(file.data_cpu).unwrap_or_default(),
            straggler_margin,
            straggler_seconds,
        })
    }
}

fn read_file(path: &Path) -> Result<File, ConfigError> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| ConfigError(format!("cannot read config {}: {e}", path.display())))?;
    toml::from_str(&text).map_err(|e| ConfigError(format!("config {}: {e}", path.display())))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cli(args: &[&str]) -> Cli {
        Cli::parse_from(std::iter::once("ckptd").chain(args.iter().copied()))
    }

    const REQUIRED: &[&str] = &[
        "--node",
        "n1",
        "--run",
        "r1",
        "--store",
        "file:///tmp/s",
        "--shm-dir",
        "/dev/shm/x",
        "--socket",
        "/tmp/x.sock",
        "--listen",
        "127.0.0.1:7000",
        "--leader",
        "127.0.0.1:7000",
        "--key-file",
        "/tmp/key",
    ];

    #[test]
    fn flags_override_the_file_and_defaults_fill_the_rest() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("ckptd.toml");
        std::fs::write(
            &path,
            "node = \"from-file\"\ndurable_every_steps = 7\nsocket_mode = \"660\"\n",
        )
        .unwrap();
        let mut args = vec!["--config", path.to_str().unwrap()];
        args.extend_from_slice(REQUIRED);
        let config = Config::resolve(&cli(&args)).unwrap();
        assert_eq!(config.node, "n1", "the flag wins");
        assert_eq!(
            config.durable_every_steps, 7,
            "the file fills what flags leave"
        );
        assert_eq!(config.socket_mode, 0o660);
        assert_eq!(config.upload_concurrency, UPLOAD_CONCURRENCY);
        assert_eq!(config.data_cpu, DataCpu::Shared);
        assert!(config.delta && !config.lead && config.buddy.is_none());
    }

    #[test]
    fn the_shipped_example_config_is_valid() {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../ops/ckptd.example.toml");
        let config = Config::resolve(&cli(&["--config", path.to_str().unwrap()])).unwrap();
        assert!(config.lead && config.buddy.is_some() && config.metrics.is_some());
        assert_eq!(config.log_format, LogFormat::Json);
    }

    #[test]
    fn only_a_daemon_that_may_lead_supervises() {
        let supervise = [
            "--supervise",
            "mpiexec",
            "--active-nodes",
            "2",
            "--trainer-arg=train",
        ];
        let mut args: Vec<&str> = REQUIRED.to_vec();
        args.extend_from_slice(&supervise);
        let error = Config::resolve(&cli(&args)).unwrap_err().to_string();
        assert!(error.contains("leader_candidate"), "{error}");
        args.push("--leader-candidate");
        let config = Config::resolve(&cli(&args)).unwrap();
        assert!(config.candidate && !config.lead && config.supervision.is_some());
        assert_eq!(
            config.advertise, config.listen,
            "advertised where it listens by default"
        );
    }

    #[test]
    fn the_data_path_shares_the_cores_as_the_file_or_flag_says() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("ckptd.toml");
        let with = |text: &str, flags: &[&str]| {
            std::fs::write(&path, text).unwrap();
            let mut args = vec!["--config", path.to_str().unwrap()];
            args.extend_from_slice(REQUIRED);
            args.extend_from_slice(flags);
            Config::resolve(&cli(&args)).map(|config| config.data_cpu)
        };
        assert_eq!(with("data_cpu = \"idle\"\n", &[]).unwrap(), DataCpu::Idle);
        assert_eq!(
            with("data_cpu = \"idle\"\n", &["--data-cpu", "shared"]).unwrap(),
            DataCpu::Shared
        );
        let error = with("data_cpu = \"low\"\n", &[]).unwrap_err().to_string();
        assert!(
            error.contains("data_cpu") || error.contains("unknown variant"),
            "{error}"
        );
    }

    #[test]
    fn bad_values_are_refused_with_the_key_named() {
        for (extra, key) in [
            (&["--node", "a/b"][..], "node"),
            (&["--run", "../etc"][..], "run id"),
            (&["--store", "memory://"][..], "store"),
            (&["--socket-mode", "777"][..], "socket_mode"),
            (&["--durable-every-steps", "0"][..], "durable_every_steps"),
            (&["--upload-concurrency", "0"][..], "upload_concurrency"),
        ] {
            let mut args: Vec<&str> = REQUIRED
                .chunks(2)
                .filter(|pair| pair[0] != extra[0])
                .flatten()
                .copied()
                .collect();
            args.extend_from_slice(extra);
            let error = Config::resolve(&cli(&args)).unwrap_err().to_string();
            assert!(error.contains(key), "{extra:?}: {error}");
        }
    }
}
