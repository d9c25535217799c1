//! The write path: shard manifests and commit records.
//!
//! Ordering points (each put is durable when it returns, see `backend`):
//! 1. chunk objects, in any order, concurrently (bounded by `upload_concurrency`);
//! 2. the shard manifest, after all its chunks;
//! 3. the re-check: once no gc holds the run's lock, every chunk the manifest names must be
//!    stored with a delta chain made of bases the manifest lists; any that a concurrent gc
//!    removed, or that is stored on other bases, is stored again whole;
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

use super::kept::Kept;
use super::{layout, now_unix_ms, ChunkInfo, Progress, RunStore};
use crate::codec::{self, ChunkHeader, CodecPolicy, DeltaBase, HEADER_BYTES};
use crate::error::StoreError;
use crate::format::{
    self, BlobEntry, ChunkRef, CommitRecord, DType, DimRange, ShardManifest, ShardRef, TensorEntry,
};
use crate::hash::ChunkHash;
use crate::ids::{Rank, RunId, StepKey, STEP_MAX};

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
        Self {
            name: name.into(),
            dtype,
            slice: whole_slice(&shape),
            global_shape: shape,
            data,
        }
    }
}

/// The slice of a tensor that is all of it.
fn whole_slice(shape: &[u64]) -> Vec<DimRange> {
    shape
        .iter()
        .map(|len| DimRange {
            start: 0,
            len: *len,
        })
        .collect()
}

/// Where a writer reads raw bytes from: memory, or a file it reads piece by piece (`ckptd`'s
/// shm slots), so that writing a shard holds only the chunks in flight in memory.
pub trait ByteSource: Send + Sync + 'static {
    fn read_at(&self, offset: u64, len: usize) -> std::io::Result<Bytes>;
    /// Names the source in errors.
    fn describe(&self) -> String;
    /// The name (blake3) of exactly the `len` bytes at `offset`, where the source hashed them
    /// already and vouches that they have not changed since (`ckptd`'s slot, hashed when its
    /// rank handed it over and held since): a writer stores the chunk of those bytes under
    /// it without hashing them again. None by default. A source must vouch only for bytes
    /// nothing can have written since: the chunk is stored under the name as given, and a
    /// wrong name is a stored chunk that fails its check when read, which later writes of
    /// the right bytes would find stored and take.
    fn hashed(&self, _offset: u64, _len: usize) -> Option<ChunkHash> {
        None
    }
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

/// A file read piece by piece (`ckptd`'s slot files, an imported file): every read copies
/// into a buffer of its own, so a chunk is hashed and encoded from bytes no one else changes.
#[derive(Debug)]
pub struct FileSource {
    file: std::fs::File,
    path: std::path::PathBuf,
}

impl FileSource {
    pub fn open(path: &std::path::Path) -> std::io::Result<Self> {
        Ok(Self::from_file(std::fs::File::open(path)?, path))
    }

    /// A file already open (`path` names it in errors).
    pub fn from_file(file: std::fs::File, path: &std::path::Path) -> Self {
        Self {
            file,
            path: path.to_path_buf(),
        }
    }
}

impl ByteSource for FileSource {
    fn read_at(&self, offset: u64, len: usize) -> std::io::Result<Bytes> {
        use std::os::unix::fs::FileExt;
        let mut buffer = ReadBuffer::take(len);
        self.file.read_exact_at(&mut buffer.bytes, offset)?;
        Ok(Bytes::from_owner(buffer))
    }

    fn describe(&self) -> String {
        self.path.display().to_string()
    }
}

/// A buffer that [`FileSource`] reads into, handed back for the next read when the last
/// `Bytes` of it is dropped: a fresh chunk-sized buffer costs the kernel a zeroed page every
/// 4 KiB, and that was the largest single cost of a daemon's upload (two reads a chunk, the
/// chunk and its delta base).
#[derive(Debug)]
struct ReadBuffer {
    bytes: Vec<u8>,
}

/// Buffers kept for reuse (32 MiB of 4 MiB chunks).
static READ_BUFFERS: Kept<Vec<u8>> = Kept::new(8);

impl ReadBuffer {
    /// A buffer of `len` bytes (contents unspecified: the read overwrites them all).
    fn take(len: usize) -> Self {
        let mut bytes = READ_BUFFERS.take().unwrap_or_default();
        bytes.resize(len, 0);
        Self { bytes }
    }
}

impl AsRef<[u8]> for ReadBuffer {
    fn as_ref(&self) -> &[u8] {
        &self.bytes
    }
}

impl Drop for ReadBuffer {
    fn drop(&mut self) {
        READ_BUFFERS.give(std::mem::take(&mut self.bytes));
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

    /// The name its source vouches for these bytes ([`ByteSource::hashed`]).
    fn hashed(&self) -> Option<ChunkHash> {
        self.source.hashed(self.offset, self.len as usize)
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

impl SourcedTensor {
    /// A tensor this rank holds whole.
    pub fn whole(
        name: impl Into<String>,
        dtype: DType,
        shape: Vec<u64>,
        data: SourceRange,
    ) -> Self {
        Self {
            name: name.into(),
            dtype,
            slice: whole_slice(&shape),
            global_shape: shape,
            data,
        }
    }
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
    /// Where the writer copies each tensor chunk's bytes as it hashed them (`None`: nowhere).
    pub copy: Option<Arc<dyn RawCopy>>,
}

/// Takes a copy of the raw bytes of every tensor chunk a shard write stores (found stored
/// already or not), the very bytes the chunk's name was hashed from: a copy made this way
/// hashes to the manifest's chunks with no second read or hash of the source. `ckptd` keeps
/// its delta base so.
///
/// A chunk is copied only while its own delta base is not held (read and released, with no
/// `Bytes` the writer read of it left, or never read), and a chunk's base is the chunk at its
/// position in the step before: so where the bases are read from a file laid out as the
/// source (a copy of the source's previous contents), the copy may be written over that very
/// file, or over a map of it that the bases' `Bytes` point into. Chunks are copied
/// concurrently, in no order, from blocking threads. A copy that fails does not fail the
/// write: the implementation notes it.
pub trait RawCopy: Send + Sync + std::fmt::Debug {
    /// `bytes` were read at `offset` of their source.
    fn copy(&self, offset: u64, bytes: &[u8]);

    /// The target's `len` bytes at `offset`, to be read and then written over in place with
    /// the chunk read at that offset of the source: where the write's delta bases lie in the
    /// target ([`DeltaBases::in_copy_target`]), the writer encodes the chunk against this view
    /// of its base and copies it over the base in the same pass. Taken only where the writer
    /// holds no other bytes of that range. `None` where the target has no such view: the
    /// writer then reads the base apart and hands the chunk to [`RawCopy::copy`].
    fn view(&self, offset: u64, len: usize) -> Option<memmap2::MmapMut> {
        let _ = (offset, len);
        None
    }
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
///
/// The writer hashes each base chunk before it encodes against it, and stores the chunk whole
/// when the bytes are not the named chunk's: a delta against other bytes would decode to
/// something else. Bases whose bytes are known to hash to their chunks (decoded from storage,
/// or the [`RawCopy`] of the write that stored those chunks) skip that hash.
#[derive(Clone, Debug, Default)]
pub struct DeltaBases {
    tensors: HashMap<String, (SourceRange, Vec<ChunkRef>)>,
    checked: bool,
    in_copy_target: bool,
}

impl DeltaBases {
    pub fn insert(&mut self, name: String, raw: impl Into<SourceRange>, chunks: Vec<ChunkRef>) {
        self.tensors.insert(name, (raw.into(), chunks));
        self.checked = false;
    }

    /// Says that every base's bytes are known to hash to their chunk (the caller decoded them
    /// from storage, which checks that, or they are the [`RawCopy`] of the write that stored
    /// those chunks): the writer trusts them.
    pub fn already_checked(mut self) -> Self {
        self.checked = true;
        self
    }

    /// Whether the writer will trust these bases without hashing them.
    pub fn is_checked(&self) -> bool {
        self.checked
    }

    /// Says that each base lies in the write's [`RawCopy`] target, at the very offset its
    /// chunk is copied to (as `ckptd`'s delta-base file, laid out as the slot it copies): the
    /// writer encodes a chunk against the target's view of its base and writes the chunk over
    /// it in the same pass ([`RawCopy::view`]).
    pub fn in_copy_target(mut self) -> Self {
        self.in_copy_target = true;
        self
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

/// Whether `bytes`, offered as the delta base `chunk`, are its bytes (`checked`: known to be).
/// A delta against other bytes would decode to something else under the base's name: a base
/// offered with other bytes than its reference names (a caller's stale delta-base file) is
/// not used.
fn base_matches(run: &RunId, checked: bool, bytes: &[u8], chunk: &ChunkRef) -> bool {
    let matches = checked || ChunkHash::of(bytes) == chunk.hash;
    if !matches {
        tracing::warn!(%run, base = %chunk.hash.short(), "a delta base's bytes do not match its chunk; storing without it");
    }
    matches
}

#[derive(Clone)]
struct ChunkJob {
    item: usize,
    raw: SourceRange,
    element_bytes: usize,
    base: Option<(SourceRange, ChunkRef)>,
    /// The base's bytes are known to hash to its reference ([`DeltaBases::already_checked`]).
    base_checked: bool,
    /// The base lies in the copy's target at the chunk's own range
    /// ([`DeltaBases::in_copy_target`]).
    base_in_copy: bool,
    /// Where the raw bytes are copied once hashed (and the base, if read, released).
    copy: Option<Arc<dyn RawCopy>>,
}

impl ChunkJob {
    /// Hands the chunk's hashed bytes to its copy, if it has one (a blocking call).
    fn copy_raw(&self, raw: &[u8]) {
        if let Some(copy) = &self.copy {
            copy.copy(self.raw.offset, raw);
        }
    }
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
            copy: None,
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
        refuse_unnamable(input.step, input.world_size)?;
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
                let raw = tensor.data.sub(offset as u64, len as u64);
                let base_in_copy = bases.is_some_and(|bases| bases.in_copy_target)
                    && input.copy.is_some()
                    && base.as_ref().is_some_and(|(range, _)| {
                        (range.offset, range.len) == (raw.offset, raw.len)
                    });
                jobs.push(ChunkJob {
                    item,
                    raw,
                    element_bytes: tensor.dtype.element_bytes(),
                    base,
                    base_checked: bases.is_some_and(DeltaBases::is_checked),
                    base_in_copy,
                    copy: input.copy.clone(),
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
                    base_checked: false,
                    base_in_copy: false,
                    copy: None,
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
        let mut done: Vec<(usize, ChunkDone)> = stream::iter(
            jobs.iter()
                .cloned()
                .enumerate()
                .map(|(at, job)| async move {
                    Ok::<_, StoreError>((at, self.store_chunk(job, progress).await?))
                }),
        )
        .buffer_unordered(concurrency)
        .try_collect()
        .await?;
        done.sort_unstable_by_key(|(at, _)| *at);
        let done = done.into_iter().map(|(_, chunk)| chunk);
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
        let stored = manifest.clone();
        let repaired = self.recheck_chunks(&mut manifest, &raw_by_hash).await?;
        if repaired > 0 {
            tracing::warn!(run = %self.run, step = %input.step, rank = input.rank, repaired, "stored again, whole, chunks that a concurrent gc removed or that another writer stored on other bases");
            if self.is_committed(input.step).await? {
                // A commit that came while this write ran (a concurrent write of the same
                // shard, committed first) pins the stored manifest's bytes. The chunks stored
                // again are whole and need none of the bases it lists, so it stays as it is.
                manifest = stored;
            } else {
                self.put_manifest(&manifest, false).await?;
            }
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
        if self.is_committed(step).await? {
            return Err(StoreError::StepAlreadyCommitted {
                run: self.run.clone(),
                step,
            });
        }
        Ok(())
    }

    async fn is_committed(&self, step: StepKey) -> Result<bool, StoreError> {
        Ok(self
            .store
            .head(&layout::commit(&self.run, step))
            .await?
            .is_some())
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

    /// Hashes one chunk (unless its source vouches for its name), and uploads it unless
    /// storage already has it.
    async fn store_chunk(
        &self,
        job: ChunkJob,
        progress: &dyn Progress,
    ) -> Result<ChunkDone, StoreError> {
        let raw = job.raw.load().await?;
        let hash = match job.raw.hashed() {
            Some(hash) => hash,
            None => {
                let hashed = raw.clone();
                tokio::task::spawn_blocking(move || ChunkHash::of(&hashed))
                    .await
                    .expect("hashing does not panic")
            }
        };
        let raw_len = raw.len() as u64;
        if let Some(existing) = self.known_chunk(hash).await? {
            // A chunk that its copy's target holds already (its base there, trusted, is this
            // very chunk: unchanged since the write before) is not copied again.
            let in_place = job.base_in_copy
                && job.base_checked
                && job.base.as_ref().is_some_and(|(_, base)| base.hash == hash);
            if job.copy.is_some() && !in_place {
                let job = job.clone();
                tokio::task::spawn_blocking(move || job.copy_raw(&raw))
                    .await
                    .expect("copying does not panic");
            }
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
        let policy = self.codec_policy(job.element_bytes);
        // `raw` is dropped once encoded: the writer holds at most `upload_concurrency` encoded
        // chunks, and the rare fallback of `put_chunk` reads its source again.
        let (encoded, base_ref) = match self.encode_over_base(&job, &raw, hash, policy).await {
            Some(encoded) => {
                drop(raw);
                encoded
            }
            None => self.encode_apart(&job, raw, hash, policy).await?,
        };
        let bases = match (encoded.header.base, base_ref) {
            (Some(_), Some(base)) => std::iter::once(base.hash).chain(base.bases).collect(),
            _ => Vec::new(),
        };
        let (info, uploaded_bytes) = self
            .put_chunk(hash, &job.raw, encoded, bases, job.element_bytes)
            .await?;
        progress.advance(raw_len);
        Ok(ChunkDone {
            item: job.item,
            reference: ChunkRef {
                hash,
                raw_len,
                stored_len: info.stored_len,
                codec: info.codec,
                bases: info.bases,
            },
            uploaded_bytes,
        })
    }

    /// Encodes a chunk over its delta base where the base lies in the chunk's copy target
    /// ([`DeltaBases::in_copy_target`]): the base is read through the target's view of it and
    /// written over with the chunk in the same pass ([`codec::encode_best_over`]). Returns the
    /// encoding and the base it was encoded against, if any. `None` where the base is not
    /// there or the target has no view: nothing was encoded or copied.
    async fn encode_over_base(
        &self,
        job: &ChunkJob,
        raw: &Bytes,
        hash: ChunkHash,
        policy: CodecPolicy,
    ) -> Option<(codec::EncodedChunk, Option<ChunkRef>)> {
        if !job.base_in_copy {
            return None;
        }
        let (_, chunk) = job.base.clone()?;
        let copy = job.copy.clone()?;
        let (raw, run, checked, offset) = (
            raw.clone(),
            self.run.clone(),
            job.base_checked,
            job.raw.offset,
        );
        tokio::task::spawn_blocking(move || {
            let mut view = copy.view(offset, raw.len())?;
            let matches = base_matches(&run, checked, &view, &chunk);
            let delta = matches.then_some((chunk.hash, chunk.bases.len() as u8));
            let encoded = codec::encode_best_over(&raw, hash, &mut view, delta, policy);
            Some((encoded, matches.then_some(chunk)))
        })
        .await
        .expect("encoding does not panic")
    }

    /// Encodes a chunk against its delta base (if any) read apart, then hands it to its copy
    /// (if any). Returns the encoding and the base it was encoded against.
    async fn encode_apart(
        &self,
        job: &ChunkJob,
        raw: Bytes,
        hash: ChunkHash,
        policy: CodecPolicy,
    ) -> Result<(codec::EncodedChunk, Option<ChunkRef>), StoreError> {
        let base = match &job.base {
            Some((range, chunk)) => Some((range.load().await?, chunk.clone())),
            None => None,
        };
        let (run, checked, copied) = (self.run.clone(), job.base_checked, job.clone());
        Ok(tokio::task::spawn_blocking(move || {
            let base =
                base.filter(|(base_raw, chunk)| base_matches(&run, checked, base_raw, chunk));
            let delta = base.as_ref().map(|(raw, chunk)| DeltaBase {
                hash: chunk.hash,
                depth: chunk.bases.len() as u8,
                raw,
            });
            let encoded = codec::encode_best(&raw, hash, delta, policy);
            // The base's bytes are released before the copy, which may go over them.
            let base = base.map(|(_, chunk)| chunk);
            copied.copy_raw(&raw);
            (encoded, base)
        })
        .await
        .expect("encoding does not panic"))
    }

    /// Puts an encoded chunk create-only (durable on return) and notes it in the local index.
    /// Returns what is stored and the bytes this call uploaded.
    ///
    /// A stored chunk never changes its encoding under the manifests that list its delta
    /// chain (gc keeps exactly the listed bases alive): if another writer stored `hash` first,
    /// its encoding is taken as it is. Only a stored chunk whose chain is broken, or whose
    /// header does not read, is replaced, and then whole, which needs no base at all.
    async fn put_chunk(
        &self,
        hash: ChunkHash,
        source: &SourceRange,
        encoded: codec::EncodedChunk,
        bases: Vec<ChunkHash>,
        element_bytes: usize,
    ) -> Result<(ChunkInfo, u64), StoreError> {
        let bytes = Bytes::from(encoded.bytes);
        let info = ChunkInfo {
            stored_len: bytes.len() as u64,
            codec: encoded.header.codec,
            bases,
        };
        let path = layout::chunk(&self.run, &hash);
        if self.store.put(&path, bytes.clone(), true).await? {
            self.index_chunk(hash, &info)?;
            let uploaded = info.stored_len;
            return Ok((info, uploaded));
        }
        if let Some(stored) = self.stored_chunk(hash).await? {
            self.index_chunk(hash, &stored)?;
            return Ok((stored, 0));
        }
        if info.bases.is_empty() {
            self.store.put(&path, bytes, false).await?;
            self.index_chunk(hash, &info)?;
            let uploaded = info.stored_len;
            return Ok((info, uploaded));
        }
        let info = self
            .put_whole(hash, load_verified(source, hash).await?, element_bytes)
            .await?;
        let uploaded = info.stored_len;
        Ok((info, uploaded))
    }

    /// How this store encodes a chunk of elements of `element_bytes`.
    fn codec_policy(&self, element_bytes: usize) -> CodecPolicy {
        CodecPolicy {
            element_bytes,
            zstd_level: self.store.options.zstd_level,
            delta_depth_max: self.store.options.delta_depth_max,
        }
    }

    /// Encodes `raw` whole (as a write without delta bases would, for elements of
    /// `element_bytes`) and puts it over whatever is stored under `hash`. Replacing any
    /// encoding with a whole one breaks no manifest's chain.
    async fn put_whole(
        &self,
        hash: ChunkHash,
        raw: Bytes,
        element_bytes: usize,
    ) -> Result<ChunkInfo, StoreError> {
        let policy = self.codec_policy(element_bytes);
        let encoded =
            tokio::task::spawn_blocking(move || codec::encode_best(&raw, hash, None, policy))
                .await
                .expect("encoding does not panic");
        let info = ChunkInfo {
            stored_len: encoded.bytes.len() as u64,
            codec: encoded.header.codec,
            bases: Vec::new(),
        };
        self.store
            .put(
                &layout::chunk(&self.run, &hash),
                encoded.bytes.into(),
                false,
            )
            .await?;
        self.index_chunk(hash, &info)?;
        Ok(info)
    }

    fn index_chunk(&self, hash: ChunkHash, info: &ChunkInfo) -> Result<(), StoreError> {
        match self.store.index() {
            Some(index) => index.put_chunk(&self.run, &hash, info),
            None => Ok(()),
        }
    }

    /// What storage holds under `hash`, from the local index or else from storage (see
    /// [`RunStore::stored_chunk`]). `None` if the chunk is not stored.
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
        let info = self.stored_chunk(hash).await?;
        if let Some(info) = &info {
            self.index_chunk(hash, info)?;
        }
        Ok(info)
    }

    /// What storage holds under `hash`, read from the chunk's header and its bases' headers.
    /// `None` if the chunk is absent, its header does not read, or its delta chain is broken.
    ///
    /// A chunk found, not put, may be another writer's that was killed after it linked the
    /// chunk and before it fsynced the chunk's directory (or whose fsync failed). On a
    /// `file://` store the entries of the chunk and of its bases are made durable here, before
    /// a manifest of this write can name them: a commit whose chunk a power loss then took
    /// back would be a committed step that cannot be read.
    async fn stored_chunk(&self, hash: ChunkHash) -> Result<Option<ChunkInfo>, StoreError> {
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
        for found in std::iter::once(hash).chain(bases.iter().copied()) {
            self.store
                .sync_entries(&layout::chunk(&self.run, &found), false)
                .await?;
        }
        Ok(Some(ChunkInfo {
            stored_len,
            codec: header.codec,
            bases,
        }))
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

    /// Step 3 of the write path: every chunk the manifest names must be stored, with a delta
    /// chain made only of bases the manifest lists (gc keeps exactly those alive). A chunk
    /// that a concurrent gc removed, whose chain lost a base, or that is stored on bases other
    /// than the listed ones (another writer's encoding, when this writer's index was stale) is
    /// stored again whole and its reference updated. Returns how many chunks were.
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
        // For each needed hash that is stored with a readable header: its delta base, if any.
        let stored: HashMap<ChunkHash, Option<ChunkHash>> = stream::iter(needed)
            .map(|hash| async move {
                let header = self.chunk_header(hash).await?;
                Ok::<_, StoreError>(header.map(|(header, _)| (hash, header.base)))
            })
            .buffer_unordered(concurrency)
            .try_filter_map(|found| async move { Ok(found) })
            .try_collect()
            .await?;
        let sound = |chunk: &ChunkRef| {
            let mut next = Some(chunk.hash);
            // The chunk, up to DELTA_DEPTH_MAX bases, and the end of the chain.
            for _ in 0..usize::from(codec::DELTA_DEPTH_MAX) + 2 {
                let Some(hash) = next else {
                    return true;
                };
                match stored.get(&hash) {
                    Some(base) if base.is_none_or(|b| chunk.bases.contains(&b)) => next = *base,
                    _ => return false,
                }
            }
            false
        };
        // The unsound chunks, each once, with the element width of the first item naming it
        // (a stale index or a wiped store can make it every chunk of the write: they are
        // stored again as the write stores them, concurrently, not as plain zstd in turn).
        let mut unsound: HashMap<ChunkHash, usize> = HashMap::new();
        let tensors = manifest
            .tensors
            .iter()
            .flat_map(|t| t.chunks.iter().map(|c| (c, t.dtype.element_bytes())));
        for (chunk, element_bytes) in tensors.chain(
            manifest
                .blobs
                .iter()
                .flat_map(|b| b.chunks.iter().map(|c| (c, 1))),
        ) {
            if !unsound.contains_key(&chunk.hash) && !sound(chunk) {
                unsound.insert(chunk.hash, element_bytes);
            }
        }
        let repaired: HashMap<ChunkHash, ChunkInfo> = stream::iter(unsound)
            .map(|(hash, element_bytes)| async move {
                let source = raw_by_hash
                    .get(&hash)
                    .expect("every referenced chunk came from this write");
                let raw = load_verified(source, hash).await?;
                let info = self.put_whole(hash, raw, element_bytes).await?;
                Ok::<_, StoreError>((hash, info))
            })
            .buffer_unordered(self.store.options.upload_concurrency.max(1))
            .try_collect()
            .await?;
        let refs = manifest
            .tensors
            .iter_mut()
            .flat_map(|t| t.chunks.iter_mut())
            .chain(manifest.blobs.iter_mut().flat_map(|b| b.chunks.iter_mut()));
        for chunk in refs {
            if let Some(info) = repaired.get(&chunk.hash) {
                chunk.stored_len = info.stored_len;
                chunk.codec = info.codec;
                chunk.bases.clear();
            }
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
        self.commit_with(step, world_size, None).await
    }

    /// [`RunStore::commit`] by the leader of `epoch`: refused once a newer leadership exists,
    /// and the record names the epoch.
    pub async fn commit_as_leader(
        &self,
        step: StepKey,
        world_size: u32,
        epoch: u64,
    ) -> Result<CommitRecord, StoreError> {
        self.refuse_deposed(epoch).await?;
        self.commit_with(step, world_size, Some(epoch)).await
    }

    /// What the commit record of `step` pins of `rank`'s manifest; `Ok(Err(rank))` if it is
    /// not stored.
    async fn shard_ref(
        &self,
        step: StepKey,
        rank: Rank,
        world_size: u32,
    ) -> Result<Result<ShardRef, Rank>, StoreError> {
        let path = layout::shard(&self.run, step, rank);
        let bytes = match self.store.get(&path).await {
            Ok(bytes) => bytes,
            Err(StoreError::NotFound { .. }) => return Ok(Err(rank)),
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
        Ok(Ok(ShardRef {
            rank,
            manifest_blake3: hash,
            raw_bytes: manifest.raw_bytes(),
            stored_bytes: manifest.stored_bytes(),
            uploaded_bytes: manifest.uploaded_bytes,
        }))
    }

    async fn commit_with(
        &self,
        step: StepKey,
        world_size: u32,
        leader_epoch: Option<u64>,
    ) -> Result<CommitRecord, StoreError> {
        refuse_unnamable(step, world_size)?;
        let current = self.current_timeline().await?;
        if step.timeline < current && self.rollbacks().await?.iter().any(|r| r.hides(step)) {
            return Err(StoreError::RolledBack {
                run: self.run.clone(),
                step,
                step_timeline: step.timeline,
                current,
            });
        }
        // Every rank's manifest, read concurrently (a step of 32,768 ranks is 32,768 reads).
        let read = stream::iter(0..world_size)
            .map(|rank| self.shard_ref(step, rank, world_size))
            .buffered(self.store.options.metadata_concurrency.max(1))
            .try_collect::<Vec<_>>()
            .await?;
        let mut shards = Vec::with_capacity(world_size as usize);
        let mut missing = Vec::new();
        for shard in read {
            match shard {
                Ok(shard) => shards.push(shard),
                Err(rank) => missing.push(rank),
            }
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
            leader_epoch,
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

/// The bytes of `source`, which must still hash to `hash` (the slot or buffer a shard is
/// written from must not change while it is written).
async fn load_verified(source: &SourceRange, hash: ChunkHash) -> Result<Bytes, StoreError> {
    let raw = source.load().await?;
    let check = raw.clone();
    let found = tokio::task::spawn_blocking(move || ChunkHash::of(&check))
        .await
        .expect("hashing does not panic");
    if found != hash {
        return Err(StoreError::BadRequest {
            reason: format!(
                "the source of chunk {} changed while the shard was written",
                hash.short()
            ),
        });
    }
    Ok(raw)
}

/// Steps and ranks beyond what object names can hold (12 and 6 digits) are refused before
/// anything is written: listings and gc would not see them.
fn refuse_unnamable(step: StepKey, world_size: u32) -> Result<(), StoreError> {
    if step.step > STEP_MAX || world_size > format::WORLD_SIZE_MAX {
        return Err(StoreError::BadRequest {
            reason: format!(
                "step {step} of world size {world_size} is beyond the store's names (steps up \
                 to {STEP_MAX}, world sizes up to {})",
                format::WORLD_SIZE_MAX
            ),
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use std::sync::Arc;

    use object_store::memory::InMemory;
    use object_store::{ObjectStore, ObjectStoreExt, PutPayload};

    use super::{layout, DeltaBases};
    use crate::codec::{self, Codec, DeltaBase};
    use crate::hash::ChunkHash;
    use crate::ids::StepKey;
    use crate::store::testing::{bases_of, floats, open_run, shard, write, FLOATS};
    use crate::store::{direct, OpenMode, RunStore, Store, StoreOptions};
    use crate::StoreError;

    async fn open(objects: Arc<dyn ObjectStore>, index: Option<&std::path::Path>) -> RunStore {
        let run_store = open_run(objects, "rebase", index).await;
        if run_store.info().await.is_err() {
            run_store.create(serde_json::json!({})).await.unwrap();
        }
        run_store
    }

    /// A writer whose index says a chunk is stored on one base, while storage holds it on
    /// another (another writer's encoding after a gc): the re-check stores it again whole, so
    /// the manifest never lists fewer bases than the chunk needs, and gc of the other base
    /// breaks nothing.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_chunk_stored_on_other_bases_than_listed_is_stored_again_whole() {
        let dir = tempfile::tempdir().unwrap();
        let objects: Arc<dyn ObjectStore> = Arc::new(InMemory::new());
        let run_store = open(objects.clone(), Some(&dir.path().join("index"))).await;
        let (a, b, c) = (floats(1, 0), floats(1, 64), floats(2, 0));
        let first = write(&run_store, 1, &a, None).await;
        let bases = bases_of(&a, &first);
        let second = write(&run_store, 2, &b, Some(&bases)).await;
        let b_ref = second.tensors[0].chunks[0].clone();
        let a_hash = first.tensors[0].chunks[0].hash;
        assert_eq!(b_ref.bases, vec![a_hash], "step 2 is a delta on step 1");
        let third = write(&run_store, 3, &c, None).await;
        let c_hash = third.tensors[0].chunks[0].hash;

        // Storage now holds b as a delta on c, which this writer's index does not know.
        let rebased = codec::encode_with(
            &b,
            b_ref.hash,
            Codec::XorShuffle4Zstd,
            Some(DeltaBase {
                hash: c_hash,
                depth: 0,
                raw: &c,
            }),
            3,
        );
        assert_eq!(rebased.header.base, Some(c_hash));
        let b_path = layout::chunk(run_store.id(), &b_ref.hash);
        objects
            .put(&b_path, PutPayload::from(bytes::Bytes::from(rebased.bytes)))
            .await
            .unwrap();

        let fourth = write(&run_store, 4, &b, Some(&bases)).await;
        let b_now = &fourth.tensors[0].chunks[0];
        assert_eq!(b_now.hash, b_ref.hash);
        assert!(b_now.bases.is_empty(), "{b_now:?}");
        // Whole as a write without bases stores f32 data: in byte planes.
        assert_eq!(b_now.codec, Codec::Planes4);
        run_store.commit(StepKey::new(4, 0), 1).await.unwrap();

        // gc of c (no retained manifest lists it) leaves step 4 whole.
        objects
            .delete(&layout::chunk(run_store.id(), &c_hash))
            .await
            .unwrap();
        let checkpoint = run_store.open_checkpoint(StepKey::new(4, 0)).await.unwrap();
        assert_eq!(checkpoint.read_tensor("w", &()).await.unwrap(), b.to_vec());
        assert_eq!(ChunkHash::of(&b), b_ref.hash);
    }

    /// A source that vouches for the name of a chunk's exact bytes (`ckptd`'s slot, hashed at
    /// hand-over) has its chunk stored under that name, not hashed again; a name vouched for
    /// other bytes (another length) is not taken.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_chunk_whose_source_vouches_for_its_name_is_not_hashed_again() {
        #[derive(Debug)]
        struct Vouched {
            data: bytes::Bytes,
            names: Vec<(u64, usize, ChunkHash)>,
        }
        impl super::ByteSource for Vouched {
            fn read_at(&self, offset: u64, len: usize) -> std::io::Result<bytes::Bytes> {
                self.data.read_at(offset, len)
            }
            fn describe(&self) -> String {
                "vouched".into()
            }
            fn hashed(&self, offset: u64, len: usize) -> Option<ChunkHash> {
                let vouched = self
                    .names
                    .iter()
                    .find(|(o, l, _)| (*o, *l) == (offset, len));
                vouched.map(|(_, _, hash)| *hash)
            }
        }
        let chunk = FLOATS * 4;
        let data = bytes::Bytes::from([floats(1, 0), floats(2, 0)].concat());
        // A name no hash of the first chunk's bytes gives: taken, it shows they were not hashed.
        let marker = ChunkHash::of(b"vouched");
        let source: Arc<dyn super::ByteSource> = Arc::new(Vouched {
            data: data.clone(),
            names: vec![(0, chunk, marker), (chunk as u64, chunk - 1, marker)],
        });
        let shard = super::SourcedShard {
            step: StepKey::new(1, 0),
            rank: 0,
            world_size: 1,
            tensors: vec![super::SourcedTensor {
                name: "w".into(),
                dtype: crate::format::DType::F32,
                global_shape: vec![2 * FLOATS as u64],
                slice: vec![crate::format::DimRange {
                    start: 0,
                    len: 2 * FLOATS as u64,
                }],
                data: super::SourceRange {
                    source,
                    offset: 0,
                    len: data.len() as u64,
                },
            }],
            blobs: vec![],
            copy: None,
        };
        let run_store = open(Arc::new(InMemory::new()), None).await;
        let manifest = run_store
            .write_shard_sourced(shard, None, &())
            .await
            .unwrap();
        let names: Vec<ChunkHash> = manifest.tensors[0].chunks.iter().map(|c| c.hash).collect();
        assert_eq!(names, [marker, ChunkHash::of(&data[chunk..])]);
    }

    /// A write that finds its chunk stored (by a writer that may have been killed between
    /// linking it and fsyncing its directory) makes the chunk's entry durable before its
    /// manifest names it.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_chunk_found_stored_is_made_durable_before_a_manifest_names_it() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("store");
        let options = StoreOptions {
            chunk_bytes: (FLOATS * 4) as u64,
            ..StoreOptions::default()
        };
        let url = format!("file://{}", root.display());
        let store = Store::open(&url, OpenMode::CreateIfMissing, options)
            .await
            .unwrap();
        let run_store = store.run(&"found".parse().unwrap());
        run_store.create(serde_json::json!({})).await.unwrap();
        let data = floats(4, 0);
        let first = write(&run_store, 1, &data, None).await;
        let chunk =
            root.join(layout::chunk(run_store.id(), &first.tensors[0].chunks[0].hash).as_ref());
        let chunk_dir = chunk.parent().unwrap().to_path_buf();
        let synced = || {
            direct::SYNCED_DIRS
                .lock()
                .unwrap()
                .iter()
                .filter(|synced| **synced == chunk_dir)
                .count()
        };
        let before = synced();
        // No local index: the second write finds the chunk by its header, and puts nothing.
        let second = write(&run_store, 2, &data, None).await;
        assert_eq!(second.uploaded_bytes, 0);
        assert_eq!(synced(), before + 1);
    }

    /// A store wiped behind the local index (recreated at the same address): the index says
    /// every chunk is there, the re-check finds none, and the write stores them all again,
    /// each as a fresh write would (the same codec and bytes), and the step reads back.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_write_behind_a_stale_index_stores_its_chunks_as_a_fresh_write_would() {
        let dir = tempfile::tempdir().unwrap();
        let index = dir.path().join("index");
        let data = floats(3, 0);
        let fresh = {
            let objects: Arc<dyn ObjectStore> = Arc::new(InMemory::new());
            write(&open(objects, None).await, 1, &data, None).await
        };
        let objects: Arc<dyn ObjectStore> = Arc::new(InMemory::new());
        let run_store = open(objects.clone(), Some(&index)).await;
        write(&run_store, 1, &data, None).await;
        drop(run_store);
        // Wiped: a new, empty store at the same place, and the same index.
        let objects: Arc<dyn ObjectStore> = Arc::new(InMemory::new());
        let run_store = open(objects.clone(), Some(&index)).await;
        let again = write(&run_store, 2, &data, None).await;
        assert_eq!(again.tensors[0].chunks, fresh.tensors[0].chunks);
        assert_eq!(again.tensors[0].chunks[0].codec, Codec::Planes4);
        assert_eq!(again.uploaded_bytes, fresh.uploaded_bytes);
        run_store.commit(StepKey::new(2, 0), 1).await.unwrap();
        let checkpoint = run_store.open_checkpoint(StepKey::new(2, 0)).await.unwrap();
        assert_eq!(
            checkpoint.read_tensor("w", &()).await.unwrap(),
            data.to_vec()
        );
    }

    /// A writer that finds a chunk already stored by someone else takes that encoding as it is
    /// (its chain complete), and one whose chain is broken replaces it whole.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_stored_chunk_keeps_its_encoding_unless_its_chain_is_broken() {
        let objects: Arc<dyn ObjectStore> = Arc::new(InMemory::new());
        let run_store = open(objects.clone(), None).await;
        let (a, b) = (floats(1, 0), floats(1, 64));
        let first = write(&run_store, 1, &a, None).await;
        let bases = bases_of(&a, &first);
        let second = write(&run_store, 2, &b, Some(&bases)).await;
        let b_ref = second.tensors[0].chunks[0].clone();
        assert!(!b_ref.bases.is_empty());
        // Without delta bases, a writer of b still lists the stored chain.
        let again = write(&run_store, 3, &b, None).await;
        assert_eq!(again.tensors[0].chunks[0], b_ref);
        assert_eq!(again.uploaded_bytes, 0);
        // a is gone: b's chain is broken, and the next write of b stores it whole.
        objects
            .delete(&layout::chunk(
                run_store.id(),
                &first.tensors[0].chunks[0].hash,
            ))
            .await
            .unwrap();
        let fourth = write(&run_store, 4, &b, Some(&bases)).await;
        assert!(fourth.tensors[0].chunks[0].bases.is_empty());
        run_store.commit(StepKey::new(4, 0), 1).await.unwrap();
        let checkpoint = run_store.open_checkpoint(StepKey::new(4, 0)).await.unwrap();
        assert_eq!(checkpoint.read_tensor("w", &()).await.unwrap(), b.to_vec());
    }

    /// A caller whose delta-base bytes are not what the base's chunk holds (a daemon's base
    /// file replaced before its state recorded the new base) gets chunks that still decode to
    /// its data: the base is not used.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_delta_base_with_other_bytes_than_its_chunk_is_not_used() {
        let objects: Arc<dyn ObjectStore> = Arc::new(InMemory::new());
        let run_store = open(objects, None).await;
        let (a, b, stale) = (floats(1, 0), floats(1, 64), floats(1, 32));
        let first = write(&run_store, 1, &a, None).await;
        let bases = bases_of(&stale, &first);
        let second = write(&run_store, 2, &b, Some(&bases)).await;
        assert!(second.tensors[0].chunks[0].bases.is_empty());
        run_store.commit(StepKey::new(2, 0), 1).await.unwrap();
        let checkpoint = run_store.open_checkpoint(StepKey::new(2, 0)).await.unwrap();
        assert_eq!(checkpoint.read_tensor("w", &()).await.unwrap(), b.to_vec());
    }

    /// A rank's flat state in a file, read as a source and written as a copy: a delta-base
    /// file in miniature. It keeps the ranges of the reads still held, and a copy or a view
    /// over one of them fails the test: `ckptd` reads its base file through maps, which a
    /// write into a held range would change under the reader. With `views`, it offers the
    /// writer writable maps of its ranges ([`super::RawCopy::view`]), as that file does.
    #[derive(Debug)]
    struct Flat {
        file: std::fs::File,
        held: Arc<std::sync::Mutex<Vec<std::ops::Range<usize>>>>,
        views: bool,
        viewed: std::sync::atomic::AtomicUsize,
        copied: std::sync::atomic::AtomicUsize,
    }

    /// A read of [`Flat`], which holds its range until dropped.
    struct Held {
        bytes: Vec<u8>,
        range: std::ops::Range<usize>,
        held: Arc<std::sync::Mutex<Vec<std::ops::Range<usize>>>>,
    }

    impl AsRef<[u8]> for Held {
        fn as_ref(&self) -> &[u8] {
            &self.bytes
        }
    }

    impl Drop for Held {
        fn drop(&mut self) {
            let mut held = self.held.lock().unwrap();
            let at = held.iter().position(|r| *r == self.range).unwrap();
            held.swap_remove(at);
        }
    }

    impl Flat {
        fn new(bytes: &[u8], views: bool) -> Arc<Self> {
            use std::os::unix::fs::FileExt;
            let file = tempfile::tempfile().unwrap();
            file.write_all_at(bytes, 0).unwrap();
            Arc::new(Self {
                file,
                held: Arc::default(),
                views,
                viewed: Default::default(),
                copied: Default::default(),
            })
        }

        fn bytes(&self) -> Vec<u8> {
            std::fs::read(format!("/proc/self/fd/{}", self.file.as_raw_fd())).unwrap()
        }

        /// Fails the test if a read of a range that `len` bytes at `offset` overlap is held.
        fn refuse_held(&self, offset: u64, len: usize) {
            let at = offset as usize;
            let held = self.held.lock().unwrap();
            assert!(
                !held.iter().any(|r| r.start < at + len && at < r.end),
                "a write over {at}..{} while a read of {held:?} is held",
                at + len
            );
        }
    }

    use std::os::fd::AsRawFd;

    impl super::ByteSource for Flat {
        fn read_at(&self, offset: u64, len: usize) -> std::io::Result<bytes::Bytes> {
            use std::os::unix::fs::FileExt;
            let range = offset as usize..offset as usize + len;
            let mut bytes = vec![0; len];
            self.file.read_exact_at(&mut bytes, offset)?;
            self.held.lock().unwrap().push(range.clone());
            Ok(bytes::Bytes::from_owner(Held {
                bytes,
                range,
                held: self.held.clone(),
            }))
        }

        fn describe(&self) -> String {
            "flat".into()
        }
    }

    impl super::RawCopy for Flat {
        fn copy(&self, offset: u64, bytes: &[u8]) {
            use std::os::unix::fs::FileExt;
            self.refuse_held(offset, bytes.len());
            self.copied
                .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            self.file.write_all_at(bytes, offset).unwrap();
        }

        fn view(&self, offset: u64, len: usize) -> Option<memmap2::MmapMut> {
            if !self.views {
                return None;
            }
            self.refuse_held(offset, len);
            self.viewed
                .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            let mut options = memmap2::MmapOptions::new();
            options.offset(offset).len(len);
            // SAFETY: the test's file, which only the writer's copies and views write, each
            // to its own chunk's range.
            #[allow(unsafe_code)]
            let map = unsafe { options.map_mut(&self.file) }.unwrap();
            Some(map)
        }
    }

    /// A shard write copies every tensor chunk as it hashed it, at its source offset, and
    /// only once that chunk's base was read and released (`Flat` fails a copy over a read
    /// still held): so the copy can go over the very memory the bases are read from (a
    /// daemon's base file, mapped), and the next write trusts it as checked bases. Where the
    /// bases lie in the copy's target and it offers views, each delta chunk is encoded against
    /// its view and written over it instead, with no read of the base apart. Chunks found
    /// stored are copied too; blobs are not.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_raw_copy_written_over_the_bases_is_the_next_writes_base() {
        for views in [false, true] {
            a_raw_copy_written_over_the_bases_is_the_next_writes_base_with(views).await;
        }
    }

    async fn a_raw_copy_written_over_the_bases_is_the_next_writes_base_with(views: bool) {
        let objects: Arc<dyn ObjectStore> = Arc::new(InMemory::new());
        let run_store = open(objects, None).await;
        // Tensor `w` of two chunks, then `v` of one, in one flat state.
        let state = |seed| [floats(seed, 0), floats(seed + 1, 0), floats(seed + 2, 0)].concat();
        let chunk = (FLOATS * 4) as u64;
        let shard = |step: u64, source: &Arc<Flat>, copy: &Arc<Flat>| {
            let source: Arc<dyn super::ByteSource> = source.clone();
            let tensor = |name: &str, offset: u64, len: u64| super::SourcedTensor {
                name: name.into(),
                dtype: crate::format::DType::F32,
                global_shape: vec![len / 4],
                slice: vec![crate::format::DimRange {
                    start: 0,
                    len: len / 4,
                }],
                data: super::SourceRange {
                    source: source.clone(),
                    offset,
                    len,
                },
            };
            super::SourcedShard {
                step: StepKey::new(step, 0),
                rank: 0,
                world_size: 1,
                tensors: vec![tensor("w", 0, 2 * chunk), tensor("v", 2 * chunk, chunk)],
                blobs: vec![("extra".into(), floats(9, 0))],
                copy: Some(copy.clone() as Arc<dyn super::RawCopy>),
            }
        };
        let first = state(1);
        // A few values changed in every chunk: each chunk is new, and a good delta.
        let second: Vec<u8> = first
            .chunks(chunk as usize)
            .flat_map(|piece| {
                let mut piece = piece.to_vec();
                piece[..64].fill(0x3f);
                piece
            })
            .collect();
        let base = Flat::new(&vec![0; first.len()], views);
        let written = run_store
            .write_shard_sourced(shard(1, &Flat::new(&first, false), &base), None, &())
            .await
            .unwrap();
        assert_eq!(base.bytes(), first);

        // The bases a write offers: the chunks `stored` lists, read from the copy's target.
        let base_source: Arc<dyn super::ByteSource> = base.clone();
        let bases_of = |stored: &crate::format::ShardManifest| {
            let mut bases = DeltaBases::default();
            for (tensor, offset, len) in [(0, 0, 2 * chunk), (1, 2 * chunk, chunk)] {
                let range = super::SourceRange {
                    source: base_source.clone(),
                    offset,
                    len,
                };
                let entry = &stored.tensors[tensor];
                bases.insert(entry.name.clone(), range, entry.chunks.clone());
            }
            bases.already_checked().in_copy_target()
        };
        let bases = bases_of(&written);
        let second_source = Flat::new(&second, false);
        let delta = run_store
            .write_shard_sourced(shard(2, &second_source, &base), Some(&bases), &())
            .await
            .unwrap();
        for (stored, before) in delta.tensors.iter().zip(&written.tensors) {
            for (chunk, base) in stored.chunks.iter().zip(&before.chunks) {
                assert_eq!(chunk.bases, vec![base.hash], "{} not a delta", stored.name);
            }
        }
        let viewed = base.viewed.load(std::sync::atomic::Ordering::SeqCst);
        assert_eq!(
            viewed,
            if views { 3 } else { 0 },
            "chunks encoded over their base"
        );
        assert_eq!(base.bytes(), second);
        run_store.commit(StepKey::new(2, 0), 1).await.unwrap();
        let checkpoint = run_store.open_checkpoint(StepKey::new(2, 0)).await.unwrap();
        let read = [
            checkpoint.read_tensor("w", &()).await.unwrap(),
            checkpoint.read_tensor("v", &()).await.unwrap(),
        ]
        .concat();
        assert_eq!(read, second);

        // Every chunk stored already: nothing uploaded, and still all copied.
        let again = Flat::new(&vec![0; second.len()], views);
        let same = run_store
            .write_shard_sourced(shard(3, &second_source, &again), None, &())
            .await
            .unwrap();
        assert_eq!(same.uploaded_bytes, 0);
        assert_eq!(again.bytes(), second);

        // Stored already and unchanged since the write whose copy holds them: not copied.
        let bases = bases_of(&delta);
        let count = |counter: &std::sync::atomic::AtomicUsize| {
            counter.load(std::sync::atomic::Ordering::SeqCst)
        };
        let before = (count(&base.copied), count(&base.viewed));
        let unchanged = run_store
            .write_shard_sourced(shard(4, &second_source, &base), Some(&bases), &())
            .await
            .unwrap();
        assert_eq!(unchanged.uploaded_bytes, 0);
        assert_eq!((count(&base.copied), count(&base.viewed)), before);
        assert_eq!(base.bytes(), second);
    }

    /// `put_chunk` itself, losing the create-only race: it takes the stored encoding (nothing
    /// uploaded, the object untouched) while its chain is complete, and stores the chunk whole
    /// once the chain is broken.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_put_that_finds_the_chunk_stored_adopts_it_or_replaces_it_whole() {
        let objects: Arc<dyn ObjectStore> = Arc::new(InMemory::new());
        let run_store = open(objects.clone(), None).await;
        let (a, b) = (floats(1, 0), floats(1, 64));
        let first = write(&run_store, 1, &a, None).await;
        let bases = bases_of(&a, &first);
        let second = write(&run_store, 2, &b, Some(&bases)).await;
        let b_ref = second.tensors[0].chunks[0].clone();
        let a_hash = first.tensors[0].chunks[0].hash;
        let b_path = layout::chunk(run_store.id(), &b_ref.hash);
        let stored = || async { objects.get(&b_path).await.unwrap().bytes().await.unwrap() };
        let before = stored().await;

        let whole = codec::encode_with(&b, b_ref.hash, Codec::Zstd, None, 3);
        let source = super::SourceRange::from(b.clone());
        let (info, uploaded) = run_store
            .put_chunk(b_ref.hash, &source, whole, Vec::new(), 4)
            .await
            .unwrap();
        assert_eq!((info.bases, uploaded), (vec![a_hash], 0));
        assert_eq!(stored().await, before, "the stored chunk is untouched");

        objects
            .delete(&layout::chunk(run_store.id(), &a_hash))
            .await
            .unwrap();
        let rebased = codec::encode_with(
            &b,
            b_ref.hash,
            Codec::XorShuffle4Zstd,
            Some(DeltaBase {
                hash: a_hash,
                depth: 0,
                raw: &a,
            }),
            3,
        );
        let (info, uploaded) = run_store
            .put_chunk(b_ref.hash, &source, rebased, vec![a_hash], 4)
            .await
            .unwrap();
        assert!(info.bases.is_empty() && uploaded > 0, "{info:?}");
        let header = codec::ChunkHeader::parse(&stored().await).unwrap();
        assert_eq!((header.codec, header.base), (Codec::Planes4, None));
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn steps_and_world_sizes_beyond_the_object_names_are_refused() {
        let objects: Arc<dyn ObjectStore> = Arc::new(InMemory::new());
        let run_store = open(objects, None).await;
        let data = floats(1, 0);
        let mut too_late = shard(0, &data);
        too_late.step = StepKey::new(crate::ids::STEP_MAX + 1, 0);
        let mut too_wide = shard(1, &data);
        too_wide.world_size = crate::format::WORLD_SIZE_MAX + 1;
        for input in [too_late, too_wide] {
            let error = run_store.write_shard(input, None, &()).await.unwrap_err();
            assert!(matches!(error, StoreError::BadRequest { .. }), "{error}");
        }
        let error = run_store
            .commit(StepKey::new(crate::ids::STEP_MAX + 1, 0), 1)
            .await
            .unwrap_err();
        assert!(matches!(error, StoreError::BadRequest { .. }), "{error}");
        write(&run_store, crate::ids::STEP_MAX, &data, None).await;
        run_store
            .commit(StepKey::new(crate::ids::STEP_MAX, 0), 1)
            .await
            .unwrap();
    }
}
