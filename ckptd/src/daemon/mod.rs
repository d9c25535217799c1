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
pub mod framing;
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
pub mod uplink;

use std::collections::HashMap;
use std::process::ExitCode;
use std::sync::Arc;

use anyhow::{Context, Result};
use lazarus_shared::store::{OpenMode, RunStore, Store, StoreOptions};
use lazarus_shared::wire::{JobKey, Message};
use lazarus_shared::Rank;
use tokio::sync::{mpsc, Mutex};

pub use config::{Cli, Config, ConfigError, LogFormat};
use metrics::Metrics;
use rank::RankState;

/// Raw bytes per chunk of a slot, for T0 verification and T1 replication.
pub const SLOT_CHUNK_BYTES: u64 = 4 << 20;
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
    /// Serialises writes of buddy replicas.
    pub replicas: Mutex<()>,
    pub to_leader: mpsc::UnboundedSender<Message>,
    /// Where snapshots are replicated: the configured buddy, until the supervisor pairs
    /// the nodes otherwise.
    pub buddy: std::sync::Mutex<Option<std::net::SocketAddr>>,
    pub leader: Option<Arc<leader::Leader>>,
    pub metrics: Arc<Metrics>,
    /// Pids of local ranks whose exit a thread of their own is waiting for (`local::watch_exit`).
    pub exit_watched: std::sync::Mutex<std::collections::HashSet<u32>>,
    /// Sends a heartbeat to the leader now (a rank's restored and first steps).
    pub heartbeat_now: tokio::sync::Notify,
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
    init_logging(cfg.log_format);
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        // Hashing, encoding and file IO run here; a few threads keep 2 cores busy, and
        // fewer threads keep fewer malloc arenas holding freed chunk buffers.
        .max_blocking_threads(8)
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(error) => {
            eprintln!("ckptd: cannot start: {error}");
            return ExitCode::from(1);
        }
    };
    match runtime.block_on(run(cfg)) {
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

fn init_logging(format: LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_from_env("LAZARUS_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    match format {
        LogFormat::Human => builder.init(),
        LogFormat::Json => builder.json().init(),
    }
}

/// Runs the daemon until SIGTERM or SIGINT.
pub async fn run(cfg: Config) -> Result<()> {
    let key = JobKey::from_file(&cfg.key_file)?;
    std::fs::create_dir_all(&cfg.shm_dir).map_err(|e| {
        ConfigError(format!(
            "cannot create shm_dir {}: {e}",
            cfg.shm_dir.display()
        ))
    })?;
    let store = Store::open(
        &cfg.store,
        OpenMode::CreateIfMissing,
        StoreOptions {
            upload_concurrency: cfg.upload_concurrency,
            ..StoreOptions::default()
        },
    )
    .await
    .map_err(|e| ConfigError(format!("cannot use store {}: {e}", cfg.store)))?;
    let run = store.run(&cfg.run);
    let metrics = Arc::new(Metrics::new());
    if let Some(address) = cfg.metrics {
        let bound = metrics::serve(address, metrics.clone())
            .map_err(|e| ConfigError(format!("cannot serve metrics on {address}: {e}")))?;
        tracing::info!(%bound, "metrics at /metrics");
    }
    let (to_leader, from_node) = mpsc::unbounded_channel();
    let mut durable = None;
    if cfg.lead {
        metrics.leader.set(1);
        metrics
            .supervising
            .set(i64::from(cfg.supervision.is_some()));
        // The age of the newest durable step counts from its commit record, or from now.
        durable = run.latest().await.ok().flatten();
        let newest = match durable {
            Some(step) => run.load_commit(step).await.ok().map(|c| c.created_unix_ms),
            None => None,
        };
        let since = newest.unwrap_or_else(lazarus_shared::store::now_unix_ms);
        metrics.durable_commit_timestamp.set(since as f64 / 1e3);
    }
    // The sockets are bound last: once they accept, the daemon is ready (a leader has read
    // the store above), which is what nodes, ranks and operators take a connection to mean.
    let listener = tokio::net::TcpListener::bind(cfg.listen)
        .await
        .map_err(|e| ConfigError(format!("cannot listen on {}: {e}", cfg.listen)))?;
    let unix = local::bind_socket(&cfg)?;
    let leader = cfg.lead.then(|| {
        Arc::new(leader::Leader::new(
            cfg.clone(),
            run.clone(),
            metrics.clone(),
            durable,
        ))
    });
    let daemon = Arc::new(Daemon {
        ranks: Mutex::new(local::load_ranks(&cfg)),
        replicas: Mutex::new(()),
        buddy: std::sync::Mutex::new(cfg.buddy),
        cfg,
        key,
        run,
        to_leader,
        leader,
        metrics,
        exit_watched: Default::default(),
        heartbeat_now: tokio::sync::Notify::new(),
    });
    if daemon.cfg.buddy.is_none() {
        tracing::warn!("no buddy configured: snapshots live in this node's memory only (T0), and a lost node falls back to storage (T2)");
    }
    tracing::info!(
        node = %daemon.cfg.node,
        run = %daemon.cfg.run,
        listen = %daemon.cfg.listen,
        leader = %daemon.cfg.leader,
        lead = daemon.cfg.lead,
        socket = %daemon.cfg.socket.display(),
        "ckptd ready"
    );
    tokio::spawn(peer::serve(daemon.clone(), listener));
    tokio::spawn(local::serve(daemon.clone(), unix));
    tokio::spawn(uplink::link(daemon.clone(), from_node));
    tokio::spawn(pipeline::expire_pending(daemon.clone()));
    let (done_tx, mut done) = tokio::sync::mpsc::channel::<supervisor::Ending>(1);
    if let (Some(plan), Some(leader)) = (daemon.cfg.supervision.clone(), daemon.leader.clone()) {
        tracing::info!(launcher = ?plan.launcher, active_nodes = plan.active_nodes, "supervising the training world");
        let exit_when_done = plan.exit_when_done;
        let supervisor = tokio::spawn(supervisor::supervise(daemon.clone(), leader.clone(), plan));
        tokio::spawn(async move {
            if let Ok(ending) = supervisor.await {
                if exit_when_done {
                    let _ = done_tx.send(ending).await;
                }
            }
        });
        // SIGUSR1 (Slurm's warning before the time limit, or an operator): checkpoint and stop.
        let mut usr1 =
            tokio::signal::unix::signal(tokio::signal::unix::SignalKind::user_defined1())
                .context("installing the SIGUSR1 handler")?;
        tokio::spawn(async move {
            while usr1.recv().await.is_some() {
                tracing::warn!(
                    "SIGUSR1: preempting the run (last snapshot made durable, then stop)"
                );
                leader.request_preemption();
            }
        });
    }
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .context("installing the SIGTERM handler")?;
    tokio::select! {
        _ = term.recv() => {}
        _ = tokio::signal::ctrl_c() => {}
        Some(ending) = done.recv() => {
            tracing::info!(?ending, "supervision ended; exiting");
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
            && daemon
                .leader
                .as_ref()
                .is_none_or(|l| l.events_unstored() == 0)
        {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    Ok(())
}
