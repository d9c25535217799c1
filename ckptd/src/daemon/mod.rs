//! `ckptd`: the per-node checkpoint daemon (DESIGN.md sections 1, 2 and 5).
//!
//! One daemon runs per node. Local ranks register over a Unix socket and hand snapshots over
//! in shm slot files the daemon owns (T0). The daemon hashes each snapshot, replicates it to
//! its buddy node's daemon over authenticated TCP (T1), and reports to the leader daemon. The
//! leader memory-commits a step once every rank has it in T0 and T1, and decides which steps
//! become durable; the nodes then upload those through the store library (T2), and the leader
//! writes the commit record once every rank's shard manifest is stored.
//!
//! Tasks: the Unix-socket server for local ranks ([`local`]), the snapshot pipeline
//! ([`pipeline`]) and restores ([`restore`]) over each rank's state machine ([`rank`]), the
//! TCP port for buddies' replicas ([`replica`]), the leader and `ckptctl status` ([`peer`],
//! frames in [`framing`]), the link to the leader ([`uplink::link`]), and the metrics
//! endpoint ([`metrics`]).

pub mod config;
pub mod crash;
pub mod data_path;
pub mod election;
pub mod framing;
pub mod identity;
pub mod leader;
pub mod local;
pub mod metrics;
pub mod peer;
pub mod pipeline;
pub mod process;
pub mod rank;
pub mod replica;
pub mod restore;
pub mod slots;
pub mod supervisor;
#[cfg(test)]
mod testing;
pub mod uplink;

use std::collections::HashMap;
use std::process::ExitCode;
use std::sync::Arc;

use anyhow::{Context, Result};
use lazarus_shared::store::{OpenMode, RunStore, Store, StoreOptions};
use lazarus_shared::wire::{JobKey, Message};
use lazarus_shared::Rank;
use tokio::sync::{mpsc, Mutex};

pub use config::{Cli, Config, ConfigError, DataCpu, LogFormat};
use metrics::Metrics;
use rank::RankState;

/// Raw bytes per chunk of a slot, for T0 verification and T1 replication: the store's
/// default chunk size, so that the hashes taken at hand-over name the store's chunks
/// (`slots::HashedSlot`).
pub const SLOT_CHUNK_BYTES: u64 = 4 << 20;
/// How this daemon cuts a slot into the chunks it hashes at hand-over, replicates and checks
/// (and hashes a slot a restore filled): at its stored regions, as the store does.
pub const SLOT_CHUNKING: lazarus_shared::wire::SlotChunking =
    lazarus_shared::wire::SlotChunking::Regions;
/// Slot files per rank: the committed T0, the snapshot in flight, the durable upload in
/// flight, and the rank's working copy.
pub const SLOTS_PER_RANK: u32 = 4;

/// Everything the daemon's tasks share.
#[derive(Debug)]
pub struct Daemon {
    pub cfg: Config,
    pub key: JobKey,
    pub run: RunStore,
    pub ranks: Mutex<HashMap<Rank, RankState>>,
    /// Serialises writes of buddy replicas, and their removal after a rollback.
    pub replicas: Mutex<()>,
    /// The replicas (rank, step) being uploaded as their rank's shard, once per upload
    /// (`pipeline::upload_replica`): a newer replica never lets one of those go to be the
    /// spare, whose file the next replica is written into while the upload still reads it.
    /// Taken only for a moment, and never while waiting for anything else.
    pub replica_uploads: Arc<std::sync::Mutex<Vec<(Rank, u64)>>>,
    pub to_leader: mpsc::UnboundedSender<Message>,
    /// The leadership this daemon follows (or holds): the newest epoch it knows of.
    pub leadership: tokio::sync::watch::Sender<election::Leadership>,
    /// When a frame last came from the leader over this node's link.
    pub last_from_leader: std::sync::Mutex<std::time::Instant>,
    /// How supervision ended, for a daemon that exits when it is done.
    pub done: mpsc::Sender<supervisor::Ending>,
    /// The leader said supervision is over (`RunEnded`): no candidate takes over any more.
    pub run_ended: std::sync::atomic::AtomicBool,
    /// Where snapshots are replicated: the configured buddy, until the supervisor pairs
    /// the nodes otherwise.
    pub buddy: std::sync::Mutex<Option<std::net::SocketAddr>>,
    /// The leader's books, while this daemon leads.
    pub leader: std::sync::RwLock<Option<Arc<leader::Leader>>>,
    pub metrics: Arc<Metrics>,
    /// Pids of local ranks whose exit a thread of their own is waiting for (`local::watch_exit`).
    pub exit_watched: std::sync::Mutex<std::collections::HashSet<u32>>,
    /// Sends a heartbeat to the leader now (a rank's restored and first steps).
    pub heartbeat_now: tokio::sync::Notify,
    /// The supervisor's last rollback applied here, or the newer mark of the leader it
    /// follows (`Leading`); read under `ranks` as snapshots are handed over, and a snapshot
    /// whose mark changed while it was replicated is dropped.
    pub rollback: std::sync::Mutex<lazarus_shared::wire::RollbackMark>,
    /// This daemon's state in shm (`NodeHello::instance`), and the last rollback it forgot,
    /// kept there as it changes.
    pub identity: std::sync::Mutex<identity::Identity>,
    /// The last rollback's task that forgets its replicas and records it, off the leader's
    /// link (its snapshots were forgotten on the link, in order): the next one waits for it,
    /// so they run in order without the link waiting. It says whether every rollback so far
    /// was forgotten; once one could not be, none is recorded (a restarted daemon is told them
    /// all again).
    pub forget_tail: std::sync::Mutex<Option<tokio::task::JoinHandle<bool>>>,
    /// The data path (hashing and replicating snapshots, receiving replicas, uploads): a
    /// runtime of its own, its threads under `SCHED_IDLE` if `data_cpu = "idle"` (raised
    /// while its work waits too long), so that the control path's threads (the ranks'
    /// requests, heartbeats, the leader's books) keep their share of the cores whatever the
    /// data path's policy.
    pub data: data_path::DataPath,
    /// The run's store as the data path uses it: a handle of its own, with its own pool of
    /// connections (S3), which the data path alone uses, so they are opened and driven on
    /// [`Daemon::data`]; the control path's requests (a leader's lease, commits) go through
    /// [`Daemon::run`], whose connections never wait for idle time.
    pub data_run: RunStore,
}

impl Daemon {
    /// The leader's books, while this daemon leads.
    pub fn leader(&self) -> Option<Arc<leader::Leader>> {
        self.leader.read().expect("not poisoned").clone()
    }

    pub fn heard_from_leader(&self) {
        *self.last_from_leader.lock().expect("not poisoned") = std::time::Instant::now();
    }

    /// How long the leader has been silent on this node's link.
    pub fn silent_for(&self) -> std::time::Duration {
        self.last_from_leader
            .lock()
            .expect("not poisoned")
            .elapsed()
    }
}

/// The daemon's TCP listener, with room for a whole cluster's nodes connecting at once
/// (a leader of thousands of nodes; the kernel caps it at `somaxconn`).
fn listen(address: std::net::SocketAddr) -> std::io::Result<tokio::net::TcpListener> {
    let socket = if address.is_ipv4() {
        tokio::net::TcpSocket::new_v4()?
    } else {
        tokio::net::TcpSocket::new_v6()?
    };
    socket.set_reuseaddr(true)?;
    socket.bind(address)?;
    socket.listen(8192)
}

/// Exit codes: 0 stopped by a signal, 1 a runtime failure, 2 bad configuration.
pub fn main(cli: Cli) -> ExitCode {
    let cfg = match Config::resolve(&cli) {
        Ok(cfg) => cfg,
        Err(error) => {
            eprintln!("ckptd: {error}");
            return ExitCode::from(2);
        }
    };
    crate::logging::init(cfg.log_format, "info");
    yield_to_the_ranks();
    let data_cpu = cfg.data_cpu;
    let runtimes = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        // File IO runs here; the data path's hashing and encoding on the other runtime.
        .max_blocking_threads(8)
        .enable_all()
        .build()
        .and_then(|control| Ok((control, data_path::DataPath::start(data_cpu)?)));
    let (runtime, (data_runtime, data)) = match runtimes {
        Ok(runtimes) => runtimes,
        Err(error) => {
            eprintln!("ckptd: cannot start: {error}");
            return ExitCode::from(1);
        }
    };
    let result = runtime.block_on(run(cfg, data));
    // Uploads in flight were given their time in `run`; what is left is dropped.
    data_runtime.shutdown_background();
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("ckptd: {error:#}");
            let usage = error.downcast_ref::<ConfigError>().is_some()
                || error
                    .downcast_ref::<lazarus_shared::wire::WireError>()
                    .is_some();
            ExitCode::from(if usage { 2 } else { 1 })
        }
    }
}

/// Puts this process under `SCHED_BATCH` before it starts any thread (threads inherit it).
/// The kernel lets only `SCHED_NORMAL` tasks preempt on wake-up, so a rank that hands a
/// snapshot over (waking the daemon) is not preempted by that rule; it can still lose its
/// core then when its slice is used up. The daemon's share of the CPU is the same, and it
/// waits at most a slice (milliseconds) for a busy core, which its supervision timers
/// (seconds) do not notice. On 2 cores shared by two ranks and two daemons, the stall's
/// maximum over a run was 26-55 ms without it and 0.3-36 ms with it (4 runs each).
/// Unprivileged; a kernel that refuses leaves the policy as it was.
fn yield_to_the_ranks() {
    // This thread; the threads started after it inherit the policy.
    if let Err(error) = data_path::set_scheduler(0, libc::SCHED_BATCH) {
        tracing::warn!(
            %error,
            "could not run under SCHED_BATCH: the daemon's wake-ups may preempt training ranks"
        );
    }
}

/// Runs the daemon until SIGTERM or SIGINT.
pub async fn run(cfg: Config, data: data_path::DataPath) -> Result<()> {
    let key = JobKey::from_file(&cfg.key_file)?;
    framing::set_source_ip(cfg.listen.ip());
    std::fs::create_dir_all(&cfg.shm_dir).map_err(|e| {
        ConfigError(format!(
            "cannot create shm_dir {}: {e}",
            cfg.shm_dir.display()
        ))
    })?;
    // Before a leader claims its epoch: a daemon that cannot start must not hold one.
    let identity = identity::load_or_create(&identity::dir(&cfg))?;
    let open = |check_reachable| {
        let options = StoreOptions {
            upload_concurrency: cfg.upload_concurrency,
            check_reachable,
            ..StoreOptions::default()
        };
        let url = cfg.store.clone();
        async move {
            Store::open(&url, OpenMode::CreateIfMissing, options)
                .await
                .map_err(|e| ConfigError(format!("cannot use store {url}: {e}")))
        }
    };
    let run = open(true).await?.run(&cfg.run);
    // Checked just above; its connections are made where the data path uses it.
    let data_run = open(false).await?.run(&cfg.run);
    let metrics = Arc::new(Metrics::new());
    if let Some(address) = cfg.metrics {
        let bound = metrics::serve(address, metrics.clone())
            .map_err(|e| ConfigError(format!("cannot serve metrics on {address}: {e}")))?;
        tracing::info!(%bound, "metrics at /metrics");
    }
    let (to_leader, from_node) = mpsc::unbounded_channel();
    // A leader claims its epoch before it opens its ports.
    let start = election::start(&cfg, &run).await?;
    // The sockets are bound last: once they accept, the daemon is ready (a leader has read
    // the store above), which is what nodes, ranks and operators take a connection to mean.
    let listener = listen(cfg.listen)
        .map_err(|e| ConfigError(format!("cannot listen on {}: {e}", cfg.listen)))?;
    let unix = local::bind_socket(&cfg)?;
    let following = match &start {
        election::Start::Follow(leadership) => leadership.clone(),
        election::Start::Lead(epoch, _) => election::Leadership {
            epoch: *epoch,
            node: cfg.node.clone(),
            address: cfg.advertise,
            succession: Vec::new(),
        },
    };
    metrics.leader_epoch.set(following.epoch as i64);
    let (done_tx, mut done) = tokio::sync::mpsc::channel::<supervisor::Ending>(1);
    let daemon = Arc::new(Daemon {
        ranks: Mutex::new(local::load_ranks(&cfg)),
        replicas: Mutex::new(()),
        replica_uploads: Default::default(),
        buddy: std::sync::Mutex::new(cfg.buddy),
        cfg,
        key,
        run,
        to_leader,
        leadership: tokio::sync::watch::Sender::new(following),
        last_from_leader: std::sync::Mutex::new(std::time::Instant::now()),
        done: done_tx,
        run_ended: std::sync::atomic::AtomicBool::new(false),
        leader: std::sync::RwLock::new(None),
        metrics,
        exit_watched: Default::default(),
        heartbeat_now: tokio::sync::Notify::new(),
        rollback: std::sync::Mutex::new(identity.forgotten),
        identity: std::sync::Mutex::new(identity),
        data,
        data_run,
        forget_tail: Default::default(),
    });
    if daemon.cfg.buddy.is_none() {
        tracing::warn!("no buddy configured: snapshots live in this node's memory only (T0), and a lost node falls back to storage (T2)");
    }
    // How the slots' tmpfs gives out pages (see `slots::tmpfs_huge`): "none" off tmpfs.
    let shm_huge = std::fs::read_to_string("/proc/self/mountinfo")
        .ok()
        .zip(std::fs::canonicalize(&daemon.cfg.shm_dir).ok())
        .and_then(|(mountinfo, dir)| slots::tmpfs_huge(&mountinfo, &dir))
        .unwrap_or_else(|| "none".into());
    tracing::info!(
        node = %daemon.cfg.node,
        run = %daemon.cfg.run,
        shm_huge,
        listen = %daemon.cfg.listen,
        leader = %daemon.leadership.borrow().address,
        epoch = daemon.leadership.borrow().epoch,
        leads = daemon.leader().is_some(),
        socket = %daemon.cfg.socket.display(),
        "ckptd ready"
    );
    daemon
        .data
        .open_valve(daemon.metrics.data_path_raised.clone())
        .context("starting the data path's valve")?;
    tokio::spawn(peer::serve(daemon.clone(), listener));
    tokio::spawn(local::serve(daemon.clone(), unix));
    // A leader's books exist before its own node links to it.
    if let election::Start::Lead(epoch, after) = start {
        election::lead(&daemon, epoch, election::Began::AtStart(after)).await;
    }
    tokio::spawn(uplink::link(daemon.clone(), from_node));
    tokio::spawn(pipeline::expire_pending(daemon.clone()));
    tokio::spawn(election::watch(daemon.clone()));
    if daemon.cfg.supervision.is_some() {
        // SIGUSR1 (Slurm's warning before the time limit, or an operator): checkpoint and
        // stop, when this daemon leads.
        let mut usr1 =
            tokio::signal::unix::signal(tokio::signal::unix::SignalKind::user_defined1())
                .context("installing the SIGUSR1 handler")?;
        let daemon = daemon.clone();
        tokio::spawn(async move {
            while usr1.recv().await.is_some() {
                match daemon.leader() {
                    Some(leader) => {
                        tracing::warn!(
                            "SIGUSR1: preempting the run (last snapshot made durable, then stop)"
                        );
                        leader.request_preemption();
                    }
                    None => tracing::warn!("SIGUSR1 ignored: this daemon does not lead"),
                }
            }
        });
    }
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .context("installing the SIGTERM handler")?;
    let mut ended = None;
    tokio::select! {
        _ = term.recv() => {}
        _ = tokio::signal::ctrl_c() => {}
        Some(ending) = done.recv() => {
            tracing::info!(?ending, "supervision ended; exiting");
            ended = Some(ending);
        }
    }
    tracing::info!("stopping: letting uploads and event records in flight finish (up to 60 s)");
    let _ = std::fs::remove_file(&daemon.cfg.socket);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    while std::time::Instant::now() < deadline {
        if !daemon
            .ranks
            .lock()
            .await
            .values()
            .any(|s| s.uploading.is_some() || s.working.is_some())
            && daemon.leader().is_none_or(|l| l.events_unstored() == 0)
        {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    if ended == Some(supervisor::Ending::Failed) {
        anyhow::bail!(
            "the run failed and was not relaunched: `ckptctl events {}` says why",
            daemon.cfg.run
        );
    }
    Ok(())
}
