//! The checkpoint store: writes and reads checkpoints of runs through `object_store`.
//!
//! Write path of one step (see ARCHITECTURE.md for why each ordering point matters):
//!
//! 1. [`RunStore::write_shard`], per rank: cut tensors into chunks, blake3 each, skip chunks
//!    already stored, encode and put the rest (each put is durable when it returns), then put
//!    the shard manifest, then re-check, once no garbage collection holds the run's lock,
//!    that every referenced chunk is stored on a delta chain the manifest lists.
//! 2. [`RunStore::commit`]: after every rank's manifest is stored, put `commits/<step>.json`
//!    create-only. The step counts as committed from that moment, and never before.
//!
//! Readers only trust a step through its commit record, which pins each manifest's hash;
//! every chunk is re-hashed after download.

mod backend;
mod catalog;
mod counted;
mod direct;
mod events;
mod gc;
mod index;
pub(crate) mod kept;
pub(crate) mod layout;
mod leadership;
mod lock;
mod reader;
mod regions;
#[cfg(test)]
mod testing;
mod transfer;
mod verify;
mod writer;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use futures::stream::{self, StreamExt, TryStreamExt};
use object_store::path::Path;
use object_store::{
    ObjectMeta, ObjectStore, ObjectStoreExt, PutMode, PutOptions, PutPayload, WriteMultipart,
};

pub use backend::{OpenMode, S3Settings};
pub use catalog::{Catalog, StepState, StepStatus};
pub use counted::{RequestCounts, DELETE_BATCH_OBJECTS, LIST_PAGE_OBJECTS};
pub use direct::sync_dir;
pub use gc::{GcPolicy, GcReport};
pub use index::{ChunkIndex, ChunkInfo, IndexStats};
pub use lock::LockGuard;
pub use reader::{write_out_at, Checkpoint, TensorInfo};
pub use regions::{row_major_runs, Region, RegionKind, RestoreChoice};
pub use verify::{Problem, VerifyOptions, VerifyReport};
pub use writer::{
    ByteSource, DeltaBases, FileSource, RawCopy, ShardInput, SourceRange, SourcedShard,
    SourcedTensor, TensorData,
};

use crate::error::StoreError;
use crate::format::{self, Object, RunInfo};
use crate::ids::RunId;

/// Bounds and tunables of the store. Every number has a unit in its name.
#[derive(Clone, Debug)]
pub struct StoreOptions {
    /// Raw bytes per chunk for new runs.
    pub chunk_bytes: u64,
    /// Chunks being hashed, encoded or uploaded at once; also bounds the writer's memory to
    /// about this many encoded chunks.
    pub upload_concurrency: usize,
    /// Chunks being downloaded and verified at once.
    pub download_concurrency: usize,
    /// Small objects (manifests, commit records) read or deleted at once: a step of
    /// thousands of ranks is that many manifests, and each costs a round trip.
    pub metadata_concurrency: usize,
    /// Objects larger than this are uploaded with multipart.
    pub multipart_threshold_bytes: usize,
    pub multipart_part_bytes: usize,
    /// Retries of a failed request (S3; the local filesystem does not retry).
    pub retries: usize,
    /// 1 by default: on the exponent plane of float tensors, which is where planes4 spends
    /// its compression time, level 1 runs 1.4 to 1.9x as fast as level 3 and stores 3 to
    /// 11% less (measured on uniform and normal floats).
    pub zstd_level: i32,
    pub delta_depth_max: u8,
    /// Lifetime of an exclusive lock (gc) before others may break it.
    pub lock_ttl_ms: u64,
    /// Where the local chunk index lives; `None` runs without one.
    pub index_path: Option<PathBuf>,
    pub s3: S3Settings,
    /// Whether opening the store first checks that it answers (a listing). Off for a
    /// program that must start while the store is down.
    pub check_reachable: bool,
}

impl Default for StoreOptions {
    fn default() -> Self {
        Self {
            chunk_bytes: 4 << 20,
            upload_concurrency: 8,
            download_concurrency: 8,
            metadata_concurrency: 64,
            multipart_threshold_bytes: 16 << 20,
            multipart_part_bytes: 8 << 20,
            retries: 4,
            zstd_level: 1,
            delta_depth_max: 8,
            lock_ttl_ms: 15 * 60 * 1000,
            index_path: None,
            s3: S3Settings::default(),
            check_reachable: true,
        }
    }
}

/// How many blocking threads a tokio runtime that runs store work should have at most: twice
/// as many as cores, so the cores stay busy while some threads wait on the disk. File IO,
/// hashing, encoding and decoding run on them. tokio's default bound is 512, and a write or
/// read of many chunks starts a thread for each chunk in flight, each keeping its own
/// thread-local buffers and zstd contexts and its own part of the heap, so the chunk buffers
/// one thread frees are not the ones the next allocates: fresh pages, faulted in and cleared
/// (`verify --read-data` of 524 MB: 830-990 page faults of 2 MiB huge pages, 410-420 with 4
/// threads). A trainer that saved a 157 MB state at every step grew to 517 threads, and its
/// live heap from 0.7 to 2.1 GB over 60 saves.
pub fn blocking_threads() -> usize {
    let cores = std::thread::available_parallelism().map_or(2, |n| n.get());
    (2 * cores).max(4)
}

/// Receives progress of long operations in bytes (a progress bar, a metric).
pub trait Progress: Send + Sync {
    fn set_total(&self, _bytes: u64) {}
    fn advance(&self, _bytes: u64) {}
}

/// Reports nowhere.
impl Progress for () {}

/// A store opened from a URL.
#[derive(Clone)]
pub struct Store {
    objects: Arc<dyn ObjectStore>,
    url: String,
    options: Arc<StoreOptions>,
    index: Option<Arc<ChunkIndex>>,
    /// The directory of a `file://` store, for cleanup that `object_store` cannot see.
    local_root: Option<PathBuf>,
    requests: Arc<counted::Counters>,
}

impl std::fmt::Debug for Store {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Store")
            .field("url", &self.url)
            .finish_non_exhaustive()
    }
}

/// A create-only put to a `file://` store of at least this many bytes (a chunk) is written
/// around the page cache ([`direct`]); smaller ones go through `object_store`.
const DIRECT_PUT_MIN_BYTES: usize = 64 << 10;

/// The bytes a get returned. A local file's are read into memory that is not cleared first:
/// `object_store` fills its buffer with zeros before reading over them, and that was 8% of a
/// `verify --read-data`'s samples.
async fn bytes_of(result: object_store::GetResult, path: &Path) -> Result<Bytes, StoreError> {
    use std::io::{Read, Seek, SeekFrom};
    let object_store::GetResultPayload::File(mut file, local) = result.payload else {
        return result
            .bytes()
            .await
            .map_err(|e| StoreError::backend("get", path, e));
    };
    let range = result.range;
    tokio::task::spawn_blocking(move || {
        let len = range.end - range.start;
        file.seek(SeekFrom::Start(range.start))?;
        let mut bytes = Vec::with_capacity(len as usize);
        file.take(len).read_to_end(&mut bytes)?;
        if bytes.len() as u64 != len {
            return Err(std::io::Error::new(
                std::io::ErrorKind::UnexpectedEof,
                format!("{} of {len} bytes could be read", bytes.len()),
            ));
        }
        Ok(Bytes::from(bytes))
    })
    .await
    .expect("reading does not panic")
    .map_err(|cause| StoreError::Io {
        path: local.display().to_string(),
        cause,
    })
}

impl Store {
    /// Opens the store at `url` and checks that it answers.
    pub async fn open(
        url: &str,
        mode: OpenMode,
        options: StoreOptions,
    ) -> Result<Self, StoreError> {
        let backend = backend::open(url, mode, &options.s3, options.retries)?;
        let mut store = Self::with_objects(backend.objects, url, options).await?;
        store.local_root = backend.local_root;
        Ok(store)
    }

    /// Wraps an already built `object_store` (tests, embedders).
    pub async fn with_objects(
        objects: Arc<dyn ObjectStore>,
        url: &str,
        options: StoreOptions,
    ) -> Result<Self, StoreError> {
        let requests = Arc::new(counted::Counters::default());
        let objects: Arc<dyn ObjectStore> = Arc::new(counted::Counted {
            inner: objects,
            counters: Arc::clone(&requests),
        });
        let probe = Path::from(layout::RUNS);
        if options.check_reachable {
            objects
                .list_with_delimiter(Some(&probe))
                .await
                .map_err(|source| {
                    match source {
                // S3 servers answer a missing bucket with a 404 `NoSuchBucket`, which object_store
                // passes on as a generic error.
                object_store::Error::NotFound { .. } => StoreError::InvalidUrl {
                    url: url.to_string(),
                    reason: "the bucket or directory does not exist".into(),
                },
                source if source.to_string().contains("NoSuchBucket") => StoreError::InvalidUrl {
                    url: url.to_string(),
                    reason: "the bucket does not exist; create it, or check the URL and endpoint"
                        .into(),
                },
                source => StoreError::Backend {
                    operation: "list",
                    path: format!("{url} (reachability check)"),
                    cause: source,
                },
            }
                })?;
        }
        let index = match &options.index_path {
            None => None,
            // The index is only an accelerator: if another process holds it, work without it.
            Some(path) => match ChunkIndex::open(path) {
                Ok(index) => Some(Arc::new(index)),
                Err(error) => {
                    tracing::warn!(%error, "local chunk index unavailable; continuing without it");
                    None
                }
            },
        };
        Ok(Self {
            objects,
            url: url.to_string(),
            options: Arc::new(options),
            index,
            local_root: None,
            requests,
        })
    }

    /// Requests made of the backend since the store was opened, by every clone of it.
    pub fn requests(&self) -> RequestCounts {
        self.requests.snapshot()
    }

    pub fn url(&self) -> &str {
        &self.url
    }

    pub fn options(&self) -> &StoreOptions {
        &self.options
    }

    pub fn index(&self) -> Option<&ChunkIndex> {
        self.index.as_deref()
    }

    pub fn run(&self, run: &RunId) -> RunStore {
        RunStore {
            store: self.clone(),
            run: run.clone(),
        }
    }

    /// Every run that has a `run.json`, sorted.
    pub async fn runs(&self) -> Result<Vec<RunId>, StoreError> {
        let prefix = Path::from(layout::RUNS);
        let listing = self
            .objects
            .list_with_delimiter(Some(&prefix))
            .await
            .map_err(|e| StoreError::backend("list", &prefix, e))?;
        let mut runs: Vec<RunId> = listing
            .common_prefixes
            .iter()
            .filter_map(|p| p.filename()?.parse().ok())
            .collect();
        runs.sort();
        Ok(runs)
    }

    /// Recreates the local index from storage alone.
    pub async fn rebuild_index(&self, progress: &dyn Progress) -> Result<IndexStats, StoreError> {
        let index = self.index.as_ref().ok_or_else(|| StoreError::BadRequest {
            reason: "no local index is configured".into(),
        })?;
        index.clear()?;
        for run in self.runs().await? {
            self.run(&run).index_into(index, progress).await?;
        }
        index.flush()?;
        index.stats()
    }

    pub(crate) async fn get(&self, path: &Path) -> Result<Bytes, StoreError> {
        let result = self
            .objects
            .get(path)
            .await
            .map_err(|e| StoreError::backend("get", path, e))?;
        bytes_of(result, path).await
    }

    pub(crate) async fn get_prefix(
        &self,
        path: &Path,
        len: u64,
    ) -> Result<(Bytes, u64), StoreError> {
        let options = object_store::GetOptions {
            range: Some((0..len).into()),
            ..Default::default()
        };
        let result = self
            .objects
            .get_opts(path, options)
            .await
            .map_err(|e| StoreError::backend("get", path, e))?;
        let size = result.meta.size;
        Ok((bytes_of(result, path).await?, size))
    }

    pub(crate) async fn head(&self, path: &Path) -> Result<Option<ObjectMeta>, StoreError> {
        match self.objects.head(path).await {
            Ok(meta) => Ok(Some(meta)),
            Err(object_store::Error::NotFound { .. }) => Ok(None),
            Err(e) => Err(StoreError::backend("head", path, e)),
        }
    }

    /// The store's directory and the file in it that holds `path`, in a `file://` store where
    /// the name is plain (letters, digits, `._-=/`: the store's own names), so that it is the
    /// one `object_store` names.
    fn local_file(&self, path: &Path) -> Option<(PathBuf, PathBuf)> {
        let plain = path
            .as_ref()
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"._-=/".contains(&b));
        let root = self.local_root.as_ref().filter(|_| plain)?;
        Some((root.clone(), root.join(path.as_ref())))
    }

    /// Puts `bytes` at `path`. With `create_only`, fails with `AlreadyExists` mapped to `Ok(false)`
    /// if something is there. Returns once the backend reports the object durable.
    pub(crate) async fn put(
        &self,
        path: &Path,
        bytes: Bytes,
        create_only: bool,
    ) -> Result<bool, StoreError> {
        if let Some((root, file)) = self
            .local_file(path)
            .filter(|_| create_only && bytes.len() >= DIRECT_PUT_MIN_BYTES)
        {
            self.requests.count_put();
            let written = file.clone();
            return tokio::task::spawn_blocking(move || direct::put_new(&root, &written, &bytes))
                .await
                .expect("writing does not panic")
                .map_err(|cause| StoreError::Io {
                    path: file.display().to_string(),
                    cause,
                });
        }
        if !create_only && bytes.len() > self.options.multipart_threshold_bytes {
            let upload = self
                .objects
                .put_multipart(path)
                .await
                .map_err(|e| StoreError::backend("put", path, e))?;
            let mut writer =
                WriteMultipart::new_with_chunk_size(upload, self.options.multipart_part_bytes);
            writer.put(bytes);
            writer
                .finish()
                .await
                .map_err(|e| StoreError::backend("multipart put", path, e))?;
            return self.sync_entries(path, true).await.map(|()| true);
        }
        let mode = if create_only {
            PutMode::Create
        } else {
            PutMode::Overwrite
        };
        let options = PutOptions {
            mode,
            ..Default::default()
        };
        let written = match self
            .objects
            .put_opts(path, PutPayload::from_bytes(bytes), options)
            .await
        {
            Ok(_) => true,
            Err(object_store::Error::AlreadyExists { .. }) if create_only => false,
            Err(e) => return Err(StoreError::backend("put", path, e)),
        };
        self.sync_entries(path, written).await.map(|()| written)
    }

    /// After a put of `path` through `object_store` to a `file://` store, which fsyncs the
    /// file and the directories it made: the directories above it another writer made (which
    /// may have been killed before its fsyncs), and, where the put found the name taken (not
    /// `written`), the directory that holds it.
    async fn sync_entries(&self, path: &Path, written: bool) -> Result<(), StoreError> {
        let Some((root, file)) = self.local_file(path) else {
            return Ok(());
        };
        let dir = file.parent().expect("an object's file has a directory");
        if written && direct::known_durable(dir) {
            return Ok(());
        }
        let dir = dir.to_path_buf();
        tokio::task::spawn_blocking(move || {
            direct::sync_entries(&root, &dir, !written).map_err(|cause| StoreError::Io {
                path: dir.display().to_string(),
                cause,
            })
        })
        .await
        .expect("fsyncing does not panic")
    }

    pub(crate) async fn delete(&self, path: &Path) -> Result<(), StoreError> {
        match self.objects.delete(path).await {
            Ok(()) | Err(object_store::Error::NotFound { .. }) => Ok(()),
            Err(e) => Err(StoreError::backend("delete", path, e)),
        }
    }

    /// Deletes `paths` (those already gone count as deleted). S3 takes up to 1,000 in one
    /// request; `what` names them in an error.
    pub(crate) async fn delete_all(&self, paths: Vec<Path>, what: &Path) -> Result<(), StoreError> {
        let mut deleted = self
            .objects
            .delete_stream(stream::iter(paths.into_iter().map(Ok)).boxed());
        while let Some(result) = deleted.next().await {
            match result {
                Ok(_) | Err(object_store::Error::NotFound { .. }) => {}
                Err(e) => return Err(StoreError::backend("delete", what, e)),
            }
        }
        Ok(())
    }

    /// The folders directly under `prefix` (common prefixes of a delimited listing).
    pub(crate) async fn list_folders(&self, prefix: &Path) -> Result<Vec<Path>, StoreError> {
        Ok(self
            .objects
            .list_with_delimiter(Some(prefix))
            .await
            .map_err(|e| StoreError::backend("list", prefix, e))?
            .common_prefixes)
    }

    pub(crate) async fn list(&self, prefix: &Path) -> Result<Vec<ObjectMeta>, StoreError> {
        self.objects
            .list(Some(prefix))
            .try_collect()
            .await
            .map_err(|e| StoreError::backend("list", prefix, e))
    }
}

/// One run inside a store.
#[derive(Clone, Debug)]
pub struct RunStore {
    store: Store,
    run: RunId,
}

pub fn now_unix_ms() -> u64 {
    now_unix_us() / 1000
}

pub fn now_unix_us() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_micros() as u64)
        .unwrap_or(0)
}

impl RunStore {
    pub fn id(&self) -> &RunId {
        &self.run
    }

    pub fn store(&self) -> &Store {
        &self.store
    }

    /// Creates the run's `run.json` unless it exists. Returns the stored identity, which wins
    /// over `description` when the run already existed.
    pub async fn create(&self, description: serde_json::Value) -> Result<RunInfo, StoreError> {
        let info = RunInfo {
            run: self.run.clone(),
            created_unix_ms: now_unix_ms(),
            chunk_bytes: self.store.options.chunk_bytes,
            description,
        };
        let (bytes, _) = format::seal(&info);
        let path = layout::run_json(&self.run);
        if self.store.put(&path, bytes.into(), true).await? {
            return Ok(info);
        }
        self.info().await
    }

    /// Reads `run.json`; `NoSuchRun` if the run was never created.
    pub async fn info(&self) -> Result<RunInfo, StoreError> {
        let path = layout::run_json(&self.run);
        match self.store.get(&path).await {
            Ok(bytes) => Ok(self.open_object::<RunInfo>(&bytes, &path, "-", "-")?.0),
            Err(StoreError::NotFound { .. }) => Err(StoreError::NoSuchRun {
                run: self.run.clone(),
            }),
            Err(e) => Err(e),
        }
    }

    pub(crate) fn open_object<T: Object>(
        &self,
        bytes: &[u8],
        path: &Path,
        step: &str,
        rank: &str,
    ) -> Result<(T, crate::ChunkHash), StoreError> {
        format::open(bytes).map_err(|cause| StoreError::Format {
            run: self.run.clone(),
            step: step.to_string(),
            rank: rank.to_string(),
            path: path.to_string(),
            cause,
        })
    }
}
