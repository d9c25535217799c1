//! What the daemon's unit tests build on: a validated config, an empty store and a daemon.

use std::path::Path;
use std::sync::Arc;

use clap::Parser;
use futures::stream::BoxStream;
use lazarus_shared::store::{OpenMode, Store, StoreOptions};
use lazarus_shared::wire::{JobKey, Message};
use object_store::path::Path as ObjectPath;
use object_store::{
    CopyOptions, GetOptions, GetResult, ListResult, MultipartUpload, ObjectMeta, ObjectStore,
    PutMultipartOptions, PutOptions, PutPayload, PutResult,
};
use tokio::sync::{mpsc, oneshot, watch};

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
    follower_on(dir, flags, memory_store().await).await
}

/// [`follower`] on `store`.
pub async fn follower_on(
    dir: &Path,
    flags: &[&str],
    store: Store,
) -> (
    Arc<Daemon>,
    mpsc::UnboundedReceiver<Message>,
    mpsc::Receiver<Ending>,
) {
    let cfg = config(dir, "n2", "127.0.0.1:7002", flags);
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

/// A region of the slot: tensor `name`, `elements` f32s whole, at byte `offset`.
pub fn slot_tensor(
    name: &str,
    offset: u64,
    elements: u64,
    kind: lazarus_shared::store::RegionKind,
) -> lazarus_shared::wire::SlotTensor {
    lazarus_shared::wire::SlotTensor {
        name: name.into(),
        dtype: lazarus_shared::format::DType::F32,
        global_shape: vec![elements],
        slice: vec![lazarus_shared::format::DimRange {
            start: 0,
            len: elements,
        }],
        offset,
        bytes: elements * 4,
        kind,
    }
}

/// Makes `state` rank 0's and uploads its T0 as a durable step (`state` must have asked for
/// it): the step stored, from the daemon's message to the leader, within 20 s.
pub async fn upload_as_rank_0(
    daemon: &Arc<Daemon>,
    to_leader: &mut mpsc::UnboundedReceiver<Message>,
    state: super::rank::RankState,
) -> lazarus_shared::StepKey {
    daemon.ranks.lock().await.insert(0, state);
    super::pipeline::start_upload(
        daemon,
        daemon
            .ranks
            .lock()
            .await
            .get_mut(&0)
            .expect("just inserted"),
    );
    let stored = async {
        loop {
            match to_leader.recv().await {
                Some(Message::Stored { step, .. }) => return step,
                Some(_) => {}
                None => panic!("the daemon's channel to the leader closed"),
            }
        }
    };
    tokio::time::timeout(std::time::Duration::from_secs(20), stored)
        .await
        .expect("the upload ends within 20 s")
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

/// An object store that passes every call to `inner`, except that the reads of objects whose
/// path holds a held text wait until the hold is let go ([`GatedObjects::hold`]): a test can
/// act between a daemon's claim of something and the reads that follow it.
#[derive(Debug)]
pub struct GatedObjects {
    inner: Arc<dyn ObjectStore>,
    gate: std::sync::Mutex<Option<Gate>>,
}

#[derive(Debug)]
struct Gate {
    matching: String,
    reached: Option<oneshot::Sender<()>>,
    open: watch::Receiver<bool>,
}

/// A hold on the reads of [`GatedObjects`]; dropped, it lets them go too.
pub struct Hold {
    reached: oneshot::Receiver<()>,
    open: watch::Sender<bool>,
}

impl Hold {
    /// Waits until a read has reached the hold (up to 10 s).
    pub async fn reached(&mut self) {
        tokio::time::timeout(std::time::Duration::from_secs(10), &mut self.reached)
            .await
            .expect("a held read within 10 s")
            .expect("the store is alive");
    }

    pub fn release(self) {
        let _ = self.open.send(true);
    }
}

impl GatedObjects {
    pub fn new(inner: Arc<dyn ObjectStore>) -> Self {
        Self {
            inner,
            gate: Default::default(),
        }
    }

    /// Holds every read (a get, a head or a ranged get) of an object whose path contains
    /// `matching` from now on, until the hold is released or dropped.
    pub fn hold(&self, matching: &str) -> Hold {
        let (reached_tx, reached) = oneshot::channel();
        let (open, open_rx) = watch::channel(false);
        *self.gate.lock().expect("not poisoned") = Some(Gate {
            matching: matching.into(),
            reached: Some(reached_tx),
            open: open_rx,
        });
        Hold { reached, open }
    }

    async fn wait(&self, location: &ObjectPath) {
        let open = {
            let mut gate = self.gate.lock().expect("not poisoned");
            match gate.as_mut() {
                Some(gate) if location.as_ref().contains(&gate.matching) => {
                    if let Some(reached) = gate.reached.take() {
                        let _ = reached.send(());
                    }
                    Some(gate.open.clone())
                }
                _ => None,
            }
        };
        if let Some(mut open) = open {
            // A dropped hold lets the read go as a released one does.
            let _ = open.wait_for(|open| *open).await;
        }
    }
}

impl std::fmt::Display for GatedObjects {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "gated {}", self.inner)
    }
}

#[async_trait::async_trait]
impl ObjectStore for GatedObjects {
    async fn put_opts(
        &self,
        location: &ObjectPath,
        payload: PutPayload,
        options: PutOptions,
    ) -> object_store::Result<PutResult> {
        self.inner.put_opts(location, payload, options).await
    }

    async fn put_multipart_opts(
        &self,
        location: &ObjectPath,
        options: PutMultipartOptions,
    ) -> object_store::Result<Box<dyn MultipartUpload>> {
        self.inner.put_multipart_opts(location, options).await
    }

    async fn get_opts(
        &self,
        location: &ObjectPath,
        options: GetOptions,
    ) -> object_store::Result<GetResult> {
        self.wait(location).await;
        self.inner.get_opts(location, options).await
    }

    async fn get_ranges(
        &self,
        location: &ObjectPath,
        ranges: &[std::ops::Range<u64>],
    ) -> object_store::Result<Vec<bytes::Bytes>> {
        self.wait(location).await;
        self.inner.get_ranges(location, ranges).await
    }

    fn delete_stream(
        &self,
        locations: BoxStream<'static, object_store::Result<ObjectPath>>,
    ) -> BoxStream<'static, object_store::Result<ObjectPath>> {
        self.inner.delete_stream(locations)
    }

    fn list(
        &self,
        prefix: Option<&ObjectPath>,
    ) -> BoxStream<'static, object_store::Result<ObjectMeta>> {
        self.inner.list(prefix)
    }

    async fn list_with_delimiter(
        &self,
        prefix: Option<&ObjectPath>,
    ) -> object_store::Result<ListResult> {
        self.inner.list_with_delimiter(prefix).await
    }

    async fn copy_opts(
        &self,
        from: &ObjectPath,
        to: &ObjectPath,
        options: CopyOptions,
    ) -> object_store::Result<()> {
        self.inner.copy_opts(from, to, options).await
    }
}
