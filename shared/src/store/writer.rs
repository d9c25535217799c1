//! The write path: shard manifests and commit records.
//!
//! Ordering points (each put is durable when it returns, see `backend`):
//! 1. chunk objects, in any order, concurrently (bounded by `upload_concurrency`);
//! 2. the shard manifest, after all its chunks;
//! 3. the re-check: once no gc holds the run's lock, every chunk the manifest names (and every
//!    delta base below it) must exist; any that a concurrent gc removed is uploaded again;
//! 4. the commit record, create-only, after every rank's manifest.
//!
//! Why 3 is enough: gc lists manifests only after taking its lock. A gc that took the lock
//! after our manifest was stored sees the manifest and keeps its chunks; a gc that took it
//! earlier has finished deleting by the time the re-check runs.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use futures::stream::{self, StreamExt, TryStreamExt};

use super::{layout, now_unix_ms, ChunkInfo, Progress, RunStore};
use crate::codec::{self, ChunkHeader, CodecPolicy, DeltaBase, HEADER_BYTES};
use crate::error::StoreError;
use crate::format::{
    self, BlobEntry, ChunkRef, CommitRecord, DType, DimRange, ShardManifest, ShardRef, TensorEntry,
};
use crate::hash::ChunkHash;
use crate::ids::{Rank, StepKey};

/// One tensor, or the slice of it that this rank holds, with its bytes (row-major).
#[derive(Clone, Debug)]
pub struct TensorData {
    pub name: String,
    pub dtype: DType,
    pub global_shape: Vec<u64>,
    pub slice: Vec<DimRange>,
    pub data: Bytes,
}

impl TensorData {
    /// A tensor this rank holds whole.
    pub fn whole(name: impl Into<String>, dtype: DType, shape: Vec<u64>, data: Bytes) -> Self {
        let slice = shape
            .iter()
            .map(|len| DimRange {
                start: 0,
                len: *len,
            })
            .collect();
        Self {
            name: name.into(),
            dtype,
            global_shape: shape,
            slice,
            data,
        }
    }
}

/// Where a writer reads raw bytes from: memory, or a file it reads piece by piece (`ckptd`'s
/// shm slots), so that writing a shard holds only the chunks in flight in memory.
pub trait ByteSource: Send + Sync + 'static {
    fn read_at(&self, offset: u64, len: usize) -> std::io::Result<Bytes>;
    /// Names the source in errors.
    fn describe(&self) -> String;
}

impl ByteSource for Bytes {
    fn read_at(&self, offset: u64, len: usize) -> std::io::Result<Bytes> {
        let start = offset as usize;
        if start + len > self.len() {
            return Err(std::io::Error::new(
                std::io::ErrorKind::UnexpectedEof,
                "read past the end of a buffer",
            ));
        }
        Ok(self.slice(start..start + len))
    }

    fn describe(&self) -> String {
        "memory".into()
    }
}

/// A byte range of a [`ByteSource`].
#[derive(Clone)]
pub struct SourceRange {
    pub source: Arc<dyn ByteSource>,
    pub offset: u64,
    pub len: u64,
}

impl std::fmt::Debug for SourceRange {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{}[{}..{}]",
            self.source.describe(),
            self.offset,
            self.offset + self.len
        )
    }
}

impl From<Bytes> for SourceRange {
    fn from(bytes: Bytes) -> Self {
        let len = bytes.len() as u64;
        Self {
            source: Arc::new(bytes),
            offset: 0,
            len,
        }
    }
}

impl SourceRange {
    /// `len` bytes from `offset` within this range.
    pub fn sub(&self, offset: u64, len: u64) -> Self {
        debug_assert!(offset + len <= self.len);
        Self {
            source: self.source.clone(),
            offset: self.offset + offset,
            len,
        }
    }

    pub fn read(&self) -> Result<Bytes, StoreError> {
        self.source
            .read_at(self.offset, self.len as usize)
            .map_err(|cause| StoreError::Io {
                path: format!("{self:?}"),
                cause,
            })
    }

    /// Reads on a blocking thread.
    async fn load(&self) -> Result<Bytes, StoreError> {
        let range = self.clone();
        tokio::task::spawn_blocking(move || range.read())
            .await
            .expect("reading does not panic")
    }
}

/// A tensor whose bytes are read from a source while it is written.
#[derive(Clone, Debug)]
pub struct SourcedTensor {
    pub name: String,
    pub dtype: DType,
    pub global_shape: Vec<u64>,
    pub slice: Vec<DimRange>,
    pub data: SourceRange,
}

impl From<TensorData> for SourcedTensor {
    fn from(t: TensorData) -> Self {
        Self {
            name: t.name,
            dtype: t.dtype,
            global_shape: t.global_shape,
            slice: t.slice,
            data: t.data.into(),
        }
    }
}

/// What one rank stores for one step, read from sources.
#[derive(Clone, Debug)]
pub struct SourcedShard {
    pub step: StepKey,
    pub rank: Rank,
    pub world_size: u32,
    pub tensors: Vec<SourcedTensor>,
    pub blobs: Vec<(String, Bytes)>,
}

/// What one rank stores for one step.
#[derive(Clone, Debug)]
pub struct ShardInput {
    pub step: StepKey,
    pub rank: Rank,
    pub world_size: u32,
    pub tensors: Vec<TensorData>,
    pub blobs: Vec<(String, Bytes)>,
}

/// The previous step's raw tensors with their chunk lists, offered to the encoder as delta
/// bases. Chunks are only delta-encoded against the chunk at the same position of the same
/// tensor.
#[derive(Clone, Debug, Default)]
pub struct DeltaBases {
    tensors: HashMap<String, (SourceRange, Vec<ChunkRef>)>,
}

impl DeltaBases {
    pub fn insert(&mut self, name: String, raw: impl Into<SourceRange>, chunks: Vec<ChunkRef>) {
        self.tensors.insert(name, (raw.into(), chunks));
    }

    fn base_for(
        &self,
        name: &str,
        chunk_index: usize,
        offset: usize,
        len: usize,
    ) -> Option<(SourceRange, ChunkRef)> {
        let (raw, chunks) = self.tensors.get(name)?;
        let chunk = chunks.get(chunk_index)?;
        (chunk.raw_len as usize == len && (offset + len) as u64 <= raw.len)
            .then(|| (raw.sub(offset as u64, len as u64), chunk.clone()))
    }
}

#[derive(Clone)]
struct ChunkJob {
    item: usize,
    raw: SourceRange,
    element_bytes: usize,
    base: Option<(SourceRange, ChunkRef)>,
}

struct ChunkDone {
    item: usize,
    reference: ChunkRef,
    uploaded_bytes: u64,
}

impl RunStore {
    /// Stores one rank's shard of `input.step`: its chunks, then its manifest. The step is not
    /// committed until [`RunStore::commit`] runs after every rank's shard is written.
    pub async fn write_shard(
        &self,
        input: ShardInput,
        bases: Option<&DeltaBases>,
        progress: &dyn Progress,
    ) -> Result<ShardManifest, StoreError> {
        let input = SourcedShard {
            step: input.step,
            rank: input.rank,
            world_size: input.world_size,
            tensors: input.tensors.into_iter().map(Into::into).collect(),
            blobs: input.blobs,
        };
        self.write_shard_sourced(input, bases, progress).await
    }

    /// [`RunStore::write_shard`] for tensors read from sources: at most `upload_concurrency`
    /// chunks are in memory at once (and their delta bases).
    pub async fn write_shard_sourced(
        &self,
        input: SourcedShard,
        bases: Option<&DeltaBases>,
        progress: &dyn Progress,
    ) -> Result<ShardManifest, StoreError> {
        let info = self.info().await?;
        self.refuse_committed(input.step).await?;
        if input.world_size == 0 || input.rank >= input.world_size {
            return Err(StoreError::BadRequest {
                reason: format!(
                    "rank {} is outside world size {}",
                    input.rank, input.world_size
                ),
            });
        }
        let chunk_bytes = info.chunk_bytes as usize;
        let mut tensors = Vec::with_capacity(input.tensors.len());
        let mut blobs = Vec::with_capacity(input.blobs.len());
        let mut jobs = Vec::new();
        let mut total_bytes = 0u64;
        for tensor in &input.tensors {
            let entry = TensorEntry {
                name: tensor.name.clone(),
                dtype: tensor.dtype,
                global_shape: tensor.global_shape.clone(),
                slice: tensor.slice.clone(),
                raw_bytes: tensor.data.len,
                chunks: Vec::new(),
            };
            entry
                .validate_layout()
                .map_err(|error| StoreError::BadRequest {
                    reason: error.to_string(),
                })?;
            let item = tensors.len();
            let tensor_len = tensor.data.len as usize;
            for (index, offset) in (0..tensor_len).step_by(chunk_bytes).enumerate() {
                let len = chunk_bytes.min(tensor_len - offset);
                let base = bases.and_then(|b| b.base_for(&tensor.name, index, offset, len));
                jobs.push(ChunkJob {
                    item,
                    raw: tensor.data.sub(offset as u64, len as u64),
                    element_bytes: tensor.dtype.element_bytes(),
                    base,
                });
            }
            total_bytes += tensor_len as u64;
            tensors.push(entry);
        }
        for (name, data) in &input.blobs {
            let item = tensors.len() + blobs.len();
            for offset in (0..data.len()).step_by(chunk_bytes) {
                let len = chunk_bytes.min(data.len() - offset);
                jobs.push(ChunkJob {
                    item,
                    raw: SourceRange::from(data.clone()).sub(offset as u64, len as u64),
                    element_bytes: 1,
                    base: None,
                });
            }
            total_bytes += data.len() as u64;
            blobs.push(BlobEntry {
                name: name.clone(),
                raw_bytes: data.len() as u64,
                chunks: Vec::new(),
            });
        }
        progress.set_total(total_bytes);

        let concurrency = self.store.options.upload_concurrency.max(1);
        let done: Vec<ChunkDone> = stream::iter(
            jobs.iter()
                .cloned()
                .map(|job| self.store_chunk(job, progress)),
        )
        .buffered(concurrency)
        .try_collect()
        .await?;
        let mut uploaded_bytes = 0;
        let mut raw_by_hash: HashMap<ChunkHash, SourceRange> = HashMap::new();
        for (job, chunk) in jobs.iter().zip(done) {
            uploaded_bytes += chunk.uploaded_bytes;
            raw_by_hash
                .entry(chunk.reference.hash)
                .or_insert_with(|| job.raw.clone());
            match tensors.get_mut(chunk.item) {
                Some(tensor) => tensor.chunks.push(chunk.reference),
                None => blobs[chunk.item - tensors.len()]
                    .chunks
                    .push(chunk.reference),
            }
        }
        let written = ShardManifest {
            run: self.run.clone(),
            step: input.step,
            rank: input.rank,
            world_size: input.world_size,
            created_unix_ms: now_unix_ms(),
            tensors,
            blobs,
            uploaded_bytes,
        };
        let mut manifest = self.store_manifest(written).await?;
        let repaired = self.recheck_chunks(&mut manifest, &raw_by_hash).await?;
        if repaired > 0 {
            tracing::warn!(run = %self.run, step = %input.step, rank = input.rank, repaired, "re-uploaded chunks removed by a concurrent gc");
            self.put_manifest(&manifest, false).await?;
        }
        if let Some(index) = self.store.index() {
            let hashes: Vec<ChunkHash> = manifest.chunk_refs().map(|c| c.hash).collect();
            index.add_manifest(&self.run, manifest.step, manifest.rank, &hashes)?;
        }
        Ok(manifest)
    }

    /// Step 2 of the write path. The manifest is created, never blindly replaced: a commit may
    /// already pin the bytes of one written by a concurrent or earlier write of this shard
    /// (a retried or caught-up upload). One that describes the same tensors, blobs and chunks
    /// is kept and returned as it is stored; one that differs (a write that died, of another
    /// layout) is replaced only while the step has no commit.
    async fn store_manifest(&self, manifest: ShardManifest) -> Result<ShardManifest, StoreError> {
        if self.put_manifest(&manifest, true).await? {
            return Ok(manifest);
        }
        let path = layout::shard(&self.run, manifest.step, manifest.rank);
        let step = manifest.step.to_string();
        let rank = manifest.rank.to_string();
        let stored = match self.store.get(&path).await {
            Ok(bytes) => self
                .open_object::<ShardManifest>(&bytes, &path, &step, &rank)
                .ok()
                .map(|(stored, _)| stored),
            // Deleted since (a gc of an uncommitted write): create it again below.
            Err(StoreError::NotFound { .. }) => None,
            Err(e) => return Err(e),
        };
        if let Some(stored) = stored.filter(|stored| stored.same_shard(&manifest)) {
            tracing::info!(run = %self.run, step, rank, "this shard's manifest is already stored; keeping it");
            return Ok(stored);
        }
        self.refuse_committed(manifest.step).await?;
        tracing::warn!(run = %self.run, step, rank, "replacing an uncommitted manifest that describes other data");
        self.put_manifest(&manifest, false).await?;
        Ok(manifest)
    }

    /// `StepAlreadyCommitted` if `step` has a commit record: its shards are fixed.
    async fn refuse_committed(&self, step: StepKey) -> Result<(), StoreError> {
        match self.store.head(&layout::commit(&self.run, step)).await? {
            Some(_) => Err(StoreError::StepAlreadyCommitted {
                run: self.run.clone(),
                step,
            }),
            None => Ok(()),
        }
    }

    /// Puts `manifest` at its shard's path; with `create_only`, `false` if one is there.
    async fn put_manifest(
        &self,
        manifest: &ShardManifest,
        create_only: bool,
    ) -> Result<bool, StoreError> {
        let (bytes, _) = format::seal(manifest);
        self.store
            .put(
                &layout::shard(&self.run, manifest.step, manifest.rank),
                bytes.into(),
                create_only,
            )
            .await
    }

    /// Hashes one chunk, and uploads it unless storage already has it.
    async fn store_chunk(
        &self,
        job: ChunkJob,
        progress: &dyn Progress,
    ) -> Result<ChunkDone, StoreError> {
        let raw = job.raw.load().await?;
        let hashed = raw.clone();
        let hash = tokio::task::spawn_blocking(move || ChunkHash::of(&hashed))
            .await
            .expect("hashing does not panic");
        let raw_len = raw.len() as u64;
        if let Some(existing) = self.known_chunk(hash).await? {
            progress.advance(raw_len);
            let reference = ChunkRef {
                hash,
                raw_len,
                stored_len: existing.stored_len,
                codec: existing.codec,
                bases: existing.bases,
            };
            return Ok(ChunkDone {
                item: job.item,
                reference,
                uploaded_bytes: 0,
            });
        }
        let base = match &job.base {
            Some((range, chunk)) => Some((range.load().await?, chunk.clone())),
            None => None,
        };
        let policy = CodecPolicy {
            element_bytes: job.element_bytes,
            zstd_level: self.store.options.zstd_level,
            delta_depth_max: self.store.options.delta_depth_max,
        };
        let (encoded, base_ref) = tokio::task::spawn_blocking(move || {
            let delta = base.as_ref().map(|(raw, chunk)| DeltaBase {
                hash: chunk.hash,
                depth: chunk.bases.len() as u8,
                raw,
            });
            let encoded = codec::encode_best(&raw, hash, delta, policy);
            (encoded, base.map(|(_, chunk)| chunk))
        })
        .await
        .expect("encoding does not panic");
        let bases = match (encoded.header.base, base_ref) {
            (Some(_), Some(base)) => std::iter::once(base.hash).chain(base.bases).collect(),
            _ => Vec::new(),
        };
        let info = self.put_chunk(hash, encoded, bases).await?;
        let stored_len = info.stored_len;
        let codec = info.codec;
        progress.advance(raw_len);
        Ok(ChunkDone {
            item: job.item,
            reference: ChunkRef {
                hash,
                raw_len,
                stored_len,
                codec,
                bases: info.bases,
            },
            uploaded_bytes: stored_len,
        })
    }

    /// Puts an encoded chunk (durable on return) and notes it in the local index.
    async fn put_chunk(
        &self,
        hash: ChunkHash,
        encoded: codec::EncodedChunk,
        bases: Vec<ChunkHash>,
    ) -> Result<ChunkInfo, StoreError> {
        let info = ChunkInfo {
            stored_len: encoded.bytes.len() as u64,
            codec: encoded.header.codec,
            bases,
        };
        self.store
            .put(
                &layout::chunk(&self.run, &hash),
                encoded.bytes.into(),
                false,
            )
            .await?;
        if let Some(index) = self.store.index() {
            index.put_chunk(&self.run, &hash, &info)?;
        }
        Ok(info)
    }

    /// What storage holds under `hash`, from the local index or the chunk's header (and its
    /// bases' headers, for a delta chain). `None` if the chunk is not stored.
    pub(crate) async fn known_chunk(
        &self,
        hash: ChunkHash,
    ) -> Result<Option<ChunkInfo>, StoreError> {
        if let Some(info) = self
            .store
            .index()
            .and_then(|index| index.chunk(&self.run, &hash))
        {
            return Ok(Some(info));
        }
        let Some(header) = self.chunk_header(hash).await? else {
            return Ok(None);
        };
        let (header, stored_len) = header;
        let mut bases = Vec::new();
        let mut next = header.base;
        while let Some(base) = next {
            if bases.len() >= usize::from(codec::DELTA_DEPTH_MAX) {
                return Ok(None);
            }
            match self.chunk_header(base).await? {
                Some((base_header, _)) => {
                    bases.push(base);
                    next = base_header.base;
                }
                // A broken chain is as good as absent: store the chunk again, whole.
                None => return Ok(None),
            }
        }
        let info = ChunkInfo {
            stored_len,
            codec: header.codec,
            bases,
        };
        if let Some(index) = self.store.index() {
            index.put_chunk(&self.run, &hash, &info)?;
        }
        Ok(Some(info))
    }

    /// The parsed header and stored size of a chunk; `None` if absent or unreadable.
    async fn chunk_header(
        &self,
        hash: ChunkHash,
    ) -> Result<Option<(ChunkHeader, u64)>, StoreError> {
        let path = layout::chunk(&self.run, &hash);
        match self.store.get_prefix(&path, HEADER_BYTES as u64).await {
            Ok((bytes, size)) => Ok(ChunkHeader::parse(&bytes)
                .ok()
                .filter(|h| h.raw_hash == hash)
                .map(|h| (h, size))),
            Err(StoreError::NotFound { .. }) => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// Step 3 of the write path. Returns how many chunks had to be stored again.
    async fn recheck_chunks(
        &self,
        manifest: &mut ShardManifest,
        raw_by_hash: &HashMap<ChunkHash, SourceRange>,
    ) -> Result<usize, StoreError> {
        self.wait_for_gc().await?;
        let mut needed: HashSet<ChunkHash> = HashSet::new();
        for chunk in manifest.chunk_refs() {
            needed.insert(chunk.hash);
            needed.extend(chunk.bases.iter().copied());
        }
        let concurrency = self.store.options.upload_concurrency.max(1) * 4;
        let missing: HashSet<ChunkHash> = stream::iter(needed)
            .map(|hash| async move {
                Ok::<_, StoreError>((
                    hash,
                    self.store
                        .head(&layout::chunk(&self.run, &hash))
                        .await?
                        .is_none(),
                ))
            })
            .buffer_unordered(concurrency)
            .try_filter_map(|(hash, missing)| async move { Ok(missing.then_some(hash)) })
            .try_collect()
            .await?;
        if missing.is_empty() {
            return Ok(0);
        }
        let mut repaired = HashMap::new();
        let refs = manifest
            .tensors
            .iter_mut()
            .flat_map(|t| t.chunks.iter_mut())
            .chain(manifest.blobs.iter_mut().flat_map(|b| b.chunks.iter_mut()));
        for chunk in refs {
            if !missing.contains(&chunk.hash) && !chunk.bases.iter().any(|b| missing.contains(b)) {
                continue;
            }
            if !repaired.contains_key(&chunk.hash) {
                // Store it whole (no delta), so it depends on nothing that may be gone.
                let raw = raw_by_hash
                    .get(&chunk.hash)
                    .expect("every referenced chunk came from this write")
                    .load()
                    .await?;
                if ChunkHash::of(&raw) != chunk.hash {
                    return Err(StoreError::BadRequest {
                        reason: format!(
                            "the source of chunk {} changed while the shard was written",
                            chunk.hash.short()
                        ),
                    });
                }
                let hash = chunk.hash;
                let level = self.store.options.zstd_level;
                let encoded = tokio::task::spawn_blocking(move || {
                    codec::encode_with(&raw, hash, codec::Codec::Zstd, None, level)
                })
                .await
                .expect("encoding does not panic");
                let info = self.put_chunk(hash, encoded, Vec::new()).await?;
                repaired.insert(hash, info);
            }
            let info = &repaired[&chunk.hash];
            chunk.stored_len = info.stored_len;
            chunk.codec = info.codec;
            chunk.bases.clear();
        }
        manifest.uploaded_bytes += repaired.values().map(|i| i.stored_len).sum::<u64>();
        Ok(repaired.len())
    }

    /// Waits while a gc holds the run's lock (bounded by the lock's own expiry).
    async fn wait_for_gc(&self) -> Result<(), StoreError> {
        let path = layout::lock(&self.run, super::gc::GC_LOCK);
        let deadline = std::time::Instant::now()
            + Duration::from_millis(self.store.options.lock_ttl_ms + 5_000);
        while let Some(lock) = self.read_lock(&path).await? {
            if lock.expires_unix_ms <= now_unix_ms() || std::time::Instant::now() > deadline {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        Ok(())
    }

    /// Writes the commit record of `step` once every rank's manifest is stored. Idempotent:
    /// committing an already committed step with the same manifests returns the stored record.
    pub async fn commit(&self, step: StepKey, world_size: u32) -> Result<CommitRecord, StoreError> {
        let current = self.current_timeline().await?;
        if step.timeline < current && self.rollbacks().await?.iter().any(|r| r.hides(step)) {
            return Err(StoreError::RolledBack {
                run: self.run.clone(),
                step,
                step_timeline: step.timeline,
                current,
            });
        }
        let mut shards = Vec::with_capacity(world_size as usize);
        let mut missing = Vec::new();
        for rank in 0..world_size {
            let path = layout::shard(&self.run, step, rank);
            let bytes = match self.store.get(&path).await {
                Ok(bytes) => bytes,
                Err(StoreError::NotFound { .. }) => {
                    missing.push(rank);
                    continue;
                }
                Err(e) => return Err(e),
            };
            let (manifest, hash): (ShardManifest, _) =
                self.open_object(&bytes, &path, &step.to_string(), &rank.to_string())?;
            if manifest.run != self.run
                || manifest.step != step
                || manifest.rank != rank
                || manifest.world_size != world_size
            {
                return Err(StoreError::BadRequest {
                    reason: format!(
                        "{path} belongs to run {} step {} rank {} of {}, not to this commit",
                        manifest.run, manifest.step, manifest.rank, manifest.world_size
                    ),
                });
            }
            shards.push(ShardRef {
                rank,
                manifest_blake3: hash,
                raw_bytes: manifest.raw_bytes(),
                stored_bytes: manifest.stored_bytes(),
                uploaded_bytes: manifest.uploaded_bytes,
            });
        }
        if !missing.is_empty() {
            return Err(StoreError::IncompleteStep {
                run: self.run.clone(),
                step,
                missing,
            });
        }
        let record = CommitRecord {
            run: self.run.clone(),
            step,
            world_size,
            created_unix_ms: now_unix_ms(),
            shards,
        };
        let (bytes, _) = format::seal(&record);
        let path = layout::commit(&self.run, step);
        if self.store.put(&path, bytes.into(), true).await? {
            tracing::info!(run = %self.run, %step, world_size, "committed");
            return Ok(record);
        }
        let existing = self.load_commit(step).await?;
        if existing.shards == record.shards {
            Ok(existing)
        } else {
            Err(StoreError::StepAlreadyCommitted {
                run: self.run.clone(),
                step,
            })
        }
    }
}
