//! What the daemon's unit tests build on: a validated config, an empty store and a daemon.

use std::path::Path;
use std::sync::Arc;

use clap::Parser;
use lazarus_shared::store::{OpenMode, Store, StoreOptions};
use lazarus_shared::wire::{JobKey, Message};
use tokio::sync::mpsc;

use super::election::Leadership;
use super::metrics::Metrics;
use super::supervisor::Ending;
use super::{Cli, Config, Daemon};

/// A validated config of node `node` in run `r1`, listening on `listen` and led from
/// 127.0.0.1:7001, with its shm directory and socket under `dir` and `flags` added. Its store
/// and key file are never opened: tests pass a store of their own.
pub fn config(dir: &Path, node: &str, listen: &str, flags: &[&str]) -> Config {
    let shm = dir.join("shm");
    let socket = dir.join(format!("{node}.sock"));
    let base = [
        "ckptd",
        "--node",
        node,
        "--run",
        "r1",
        "--store",
        "file:///unused",
        "--shm-dir",
        shm.to_str().expect("a UTF-8 test path"),
        "--socket",
        socket.to_str().expect("a UTF-8 test path"),
        "--listen",
        listen,
        "--leader",
        "127.0.0.1:7001",
        "--key-file",
        "/unused",
    ];
    Config::resolve(&Cli::parse_from(base.iter().chain(flags))).expect("a valid test config")
}

/// An empty store in memory.
pub async fn memory_store() -> Store {
    Store::open(
        "memory://",
        OpenMode::CreateIfMissing,
        StoreOptions::default(),
    )
    .await
    .expect("a memory store opens")
}

/// Daemon `n2` under `dir`, with `flags`, following leadership epoch 3 with nothing running
/// and no buddy; what it sends the leader, and what it sends when it is done.
pub async fn follower(
    dir: &Path,
    flags: &[&str],
) -> (
    Arc<Daemon>,
    mpsc::UnboundedReceiver<Message>,
    mpsc::Receiver<Ending>,
) {
    let cfg = config(dir, "n2", "127.0.0.1:7002", flags);
    let store = memory_store().await;
    let (to_leader, from_daemon) = mpsc::unbounded_channel();
    let (done, ended) = mpsc::channel(1);
    let daemon = Arc::new(Daemon {
        key: JobKey::derive(b"test"),
        run: store.run(&cfg.run),
        ranks: Default::default(),
        replicas: Default::default(),
        replica_uploads: Default::default(),
        to_leader,
        leadership: tokio::sync::watch::Sender::new(Leadership {
            epoch: 3,
            node: "n1".into(),
            address: cfg.leader,
            succession: Vec::new(),
        }),
        last_from_leader: std::sync::Mutex::new(std::time::Instant::now()),
        done,
        run_ended: Default::default(),
        buddy: std::sync::Mutex::new(None),
        leader: std::sync::RwLock::new(None),
        metrics: Arc::new(Metrics::new()),
        exit_watched: Default::default(),
        heartbeat_now: tokio::sync::Notify::new(),
        rollback: Default::default(),
        identity: std::sync::Mutex::new(super::identity::Identity {
            instance: 1,
            forgotten: Default::default(),
        }),
        data: data_path().clone(),
        data_run: store.run(&cfg.run),
        forget_tail: Default::default(),
        cfg,
    });
    (daemon, from_daemon, ended)
}

/// A data-path runtime of its own for the tests' daemons, as `ckptd` has, so that the data
/// path's work crosses runtimes as it does there; kept for the process (a runtime may not be
/// dropped in the tests' async contexts). `Shared`: the tests' other threads must not starve it.
fn data_path() -> &'static super::data_path::DataPath {
    static DATA: std::sync::OnceLock<(tokio::runtime::Runtime, super::data_path::DataPath)> =
        std::sync::OnceLock::new();
    &DATA
        .get_or_init(|| {
            super::data_path::DataPath::start(super::DataCpu::Shared).expect("a runtime")
        })
        .1
}

/// The bytes of each slot file of [`registered_rank`]: 64 KiB, all 7s.
pub fn slot_contents() -> Vec<u8> {
    vec![7; 64 << 10]
}

/// Rank 0 of a world of `world_size`, registered by process 100, with its slot files (each
/// [`slot_contents`]) under `dir`.
pub fn registered_rank(dir: &Path, world_size: u32) -> super::rank::RankState {
    registered_rank_holding(dir, world_size, Vec::new())
}

/// [`registered_rank`] with `tensors` in its slots.
pub fn registered_rank_holding(
    dir: &Path,
    world_size: u32,
    tensors: Vec<lazarus_shared::wire::SlotTensor>,
) -> super::rank::RankState {
    let contents = slot_contents();
    let mut state = super::rank::RankState::new(
        0,
        world_size,
        contents.len() as u64,
        tensors,
        dir.to_path_buf(),
    );
    std::fs::create_dir_all(&state.dir).expect("a test directory");
    for slot in 0..super::SLOTS_PER_RANK {
        std::fs::write(state.slot_path(slot), &contents).expect("a test slot file");
    }
    state.registered(100).expect("state.json is written");
    state
}

/// A snapshot of `step` in `slot` with its chunks' `hashes`, and no blobs.
pub fn snap(step: u64, slot: u32, hashes: Vec<lazarus_shared::ChunkHash>) -> super::rank::Snap {
    super::rank::Snap {
        step,
        slot,
        hashes,
        chunking: lazarus_shared::wire::SlotChunking::Regions,
        blobs: Vec::new(),
        durable_requested: false,
    }
}
