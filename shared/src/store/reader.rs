//! The read path: a committed step, its manifests (each checked against the hash its commit
//! pinned), and tensors or any region of them assembled from whichever ranks hold the pieces.
//! Chunks are fetched in parallel and re-hashed; nothing that fails verification is returned.

use std::collections::HashMap;
use std::os::unix::fs::FileExt;
use std::sync::Arc;

use futures::stream::{self, StreamExt, TryStreamExt};
use serde::Serialize;

use super::{layout, Progress, RunStore};
use crate::codec::{self, CodecError};
use crate::error::StoreError;
use crate::format::{ChunkRef, CommitRecord, DType, DimRange, ShardManifest, TensorEntry};
use crate::hash::ChunkHash;
use crate::ids::{Rank, StepKey};

/// A committed step, opened for reading.
#[derive(Clone, Debug)]
pub struct Checkpoint {
    run: RunStore,
    pub commit: CommitRecord,
    pub manifests: Vec<ShardManifest>,
}

/// A tensor as a whole, whatever ranks its pieces live on.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct TensorInfo {
    pub name: String,
    pub dtype: DType,
    pub global_shape: Vec<u64>,
}

/// Where a chunk sits, for error messages.
#[derive(Clone, Debug)]
pub(crate) struct ChunkContext {
    pub step: StepKey,
    pub rank: Rank,
    pub item: &'static str,
    pub name: String,
}

impl RunStore {
    /// Opens committed step `step`, checking each manifest against its pinned hash.
    pub async fn open_checkpoint(&self, step: StepKey) -> Result<Checkpoint, StoreError> {
        let commit = self.load_commit(step).await?;
        let pinned: Vec<(Rank, ChunkHash)> = commit
            .shards
            .iter()
            .map(|shard| (shard.rank, shard.manifest_blake3))
            .collect();
        let manifests = stream::iter(pinned)
            .map(|(rank, hash)| self.load_pinned_manifest(step, rank, hash))
            .buffered(self.store.options.metadata_concurrency.max(1))
            .try_collect()
            .await?;
        Ok(Checkpoint {
            run: self.clone(),
            commit,
            manifests,
        })
    }

    pub(crate) async fn load_pinned_manifest(
        &self,
        step: StepKey,
        rank: Rank,
        pinned: ChunkHash,
    ) -> Result<ShardManifest, StoreError> {
        let path = layout::shard(&self.run, step, rank);
        let bytes = match self.store.get(&path).await {
            Ok(bytes) => bytes,
            Err(StoreError::NotFound { path }) => {
                return Err(StoreError::Format {
                    run: self.run.clone(),
                    step: step.to_string(),
                    rank: rank.to_string(),
                    path: path.clone(),
                    cause: crate::format::FormatError::Invalid {
                        what: "shard manifest".into(),
                        reason: "committed, but missing from storage".into(),
                    },
                })
            }
            Err(e) => return Err(e),
        };
        let (manifest, hash): (ShardManifest, _) =
            self.open_object(&bytes, &path, &step.to_string(), &rank.to_string())?;
        // A manifest that is not the pinned one, or that names another step, rank or run.
        if hash != pinned
            || manifest.step != step
            || manifest.rank != rank
            || manifest.run != self.run
        {
            return Err(StoreError::ManifestMismatch {
                run: self.run.clone(),
                step,
                rank,
                path: path.to_string(),
                expected: pinned,
                found: hash,
            });
        }
        Ok(manifest)
    }

    /// Downloads and verifies one chunk, following its delta chain. Returns the raw bytes.
    pub(crate) async fn fetch_chunk(
        &self,
        hash: ChunkHash,
        context: &ChunkContext,
    ) -> Result<Vec<u8>, StoreError> {
        Ok(self.fetch_chain(hash, context).await?.0)
    }

    /// Downloads one chunk and checks it as [`RunStore::fetch_chunk`] does, keeping none of
    /// its raw bytes (an audit). Returns its raw length.
    pub(crate) async fn check_chunk(
        &self,
        hash: ChunkHash,
        context: &ChunkContext,
    ) -> Result<u64, StoreError> {
        let bytes = match self.store.get(&layout::chunk(&self.run, &hash)).await {
            Ok(bytes) => bytes,
            Err(StoreError::NotFound { .. }) => return Err(self.missing(hash, context)),
            Err(e) => return Err(e),
        };
        let header =
            codec::ChunkHeader::parse(&bytes).map_err(|e| self.corrupt(hash, context, e))?;
        if header.base.is_some() {
            // A delta needs its chain decoded below it.
            return Ok(self.fetch_chunk(hash, context).await?.len() as u64);
        }
        tokio::task::spawn_blocking(move || codec::check(&bytes, hash, None))
            .await
            .expect("checking does not panic")
            .map_err(|e| self.corrupt(hash, context, e))
    }

    /// Downloads and verifies one chunk and its delta chain. Returns the raw bytes and every
    /// stored object of the chain (the chunk first), each verified by decoding.
    pub(crate) async fn fetch_chain(
        &self,
        hash: ChunkHash,
        context: &ChunkContext,
    ) -> Result<(Vec<u8>, Vec<(ChunkHash, bytes::Bytes)>), StoreError> {
        let mut chain = Vec::new();
        let mut next = Some(hash);
        // Fetch down the chain to a chunk stored whole, then decode back up.
        while let Some(current) = next {
            if chain.len() > usize::from(codec::DELTA_DEPTH_MAX) {
                return Err(self.corrupt(
                    current,
                    context,
                    CodecError::BadDelta {
                        depth: chain.len() as u8,
                        codec: codec::Codec::XorShuffle4Zstd,
                    },
                ));
            }
            let path = layout::chunk(&self.run, &current);
            let bytes = match self.store.get(&path).await {
                Ok(bytes) => bytes,
                Err(StoreError::NotFound { .. }) => return Err(self.missing(current, context)),
                Err(e) => return Err(e),
            };
            let header =
                codec::ChunkHeader::parse(&bytes).map_err(|e| self.corrupt(current, context, e))?;
            next = header.base;
            chain.push((current, bytes));
        }
        let mut raw: Option<Vec<u8>> = None;
        for (current, bytes) in chain.iter().rev().cloned() {
            let decoded =
                tokio::task::spawn_blocking(move || codec::decode(&bytes, current, raw.as_deref()))
                    .await
                    .expect("decoding does not panic");
            raw = Some(decoded.map_err(|e| self.corrupt(current, context, e))?);
        }
        Ok((
            raw.expect("the chain holds at least the requested chunk"),
            chain,
        ))
    }

    pub(crate) fn missing(&self, chunk: ChunkHash, context: &ChunkContext) -> StoreError {
        StoreError::ChunkMissing {
            run: self.run.clone(),
            step: context.step,
            rank: context.rank,
            item: context.item,
            name: context.name.clone(),
            chunk,
        }
    }

    fn corrupt(&self, chunk: ChunkHash, context: &ChunkContext, cause: CodecError) -> StoreError {
        StoreError::ChunkCorrupt {
            run: self.run.clone(),
            step: context.step,
            rank: context.rank,
            item: context.item,
            name: context.name.clone(),
            chunk,
            cause,
        }
    }

    /// Downloads and verifies one referenced chunk, checking its length too.
    async fn fetch_ref(
        &self,
        chunk: ChunkRef,
        context: &ChunkContext,
        progress: &dyn Progress,
    ) -> Result<Vec<u8>, StoreError> {
        let raw = self.fetch_chunk(chunk.hash, context).await?;
        if raw.len() as u64 != chunk.raw_len {
            let found = raw.len() as u64;
            return Err(self.corrupt(
                chunk.hash,
                context,
                CodecError::LengthMismatch {
                    expected: chunk.raw_len,
                    found,
                },
            ));
        }
        progress.advance(chunk.raw_len);
        Ok(raw)
    }

    /// Downloads and verifies `chunks` in parallel, returning their raw bytes in order.
    pub(crate) async fn fetch_chunks(
        &self,
        chunks: &[ChunkRef],
        context: &ChunkContext,
        progress: &dyn Progress,
    ) -> Result<Vec<Vec<u8>>, StoreError> {
        stream::iter(
            chunks
                .iter()
                .cloned()
                .map(|chunk| self.fetch_ref(chunk, context, progress)),
        )
        .buffered(self.store.options.download_concurrency.max(1))
        .try_collect()
        .await
    }
}

impl Checkpoint {
    pub fn step(&self) -> StepKey {
        self.commit.step
    }

    pub fn run(&self) -> &RunStore {
        &self.run
    }

    /// Every tensor of the checkpoint, by name.
    pub fn tensors(&self) -> Vec<TensorInfo> {
        let mut seen: HashMap<&str, TensorInfo> = HashMap::new();
        for entry in self.manifests.iter().flat_map(|m| &m.tensors) {
            seen.entry(&entry.name).or_insert_with(|| TensorInfo {
                name: entry.name.clone(),
                dtype: entry.dtype,
                global_shape: entry.global_shape.clone(),
            });
        }
        let mut tensors: Vec<TensorInfo> = seen.into_values().collect();
        tensors.sort_by(|a, b| a.name.cmp(&b.name));
        tensors
    }

    pub fn tensor_info(&self, name: &str) -> Option<TensorInfo> {
        self.tensors().into_iter().find(|t| t.name == name)
    }

    /// The distinct pieces of tensor `name`: for each distinct slice, the first rank holding it.
    fn pieces(&self, name: &str) -> Vec<(Rank, &TensorEntry)> {
        let mut pieces: Vec<(Rank, &TensorEntry)> = Vec::new();
        for manifest in &self.manifests {
            if let Some(entry) = manifest.tensor(name) {
                if !pieces.iter().any(|(_, p)| p.slice == entry.slice) {
                    pieces.push((manifest.rank, entry));
                }
            }
        }
        pieces
    }

    /// The whole global tensor, row-major.
    pub async fn read_tensor(
        &self,
        name: &str,
        progress: &dyn Progress,
    ) -> Result<Vec<u8>, StoreError> {
        let info = self
            .tensor_info(name)
            .ok_or_else(|| self.no_such(None, name))?;
        let region: Vec<DimRange> = info
            .global_shape
            .iter()
            .map(|len| DimRange {
                start: 0,
                len: *len,
            })
            .collect();
        self.read_region(name, &region, progress).await
    }

    /// Any hyper-rectangle of tensor `name`, row-major: what a rank of a different layout
    /// needs. Only the chunks that overlap the region are fetched.
    pub async fn read_region(
        &self,
        name: &str,
        region: &[DimRange],
        progress: &dyn Progress,
    ) -> Result<Vec<u8>, StoreError> {
        let info = self
            .tensor_info(name)
            .ok_or_else(|| self.no_such(None, name))?;
        let bad = |reason: String| StoreError::BadRequest {
            reason: format!("tensor {name:?} {:?}: {reason}", info.global_shape),
        };
        if region.len() != info.global_shape.len() {
            return Err(bad(format!("region has {} dimensions", region.len())));
        }
        if region
            .iter()
            .zip(&info.global_shape)
            .any(|(r, dim)| r.start.checked_add(r.len).is_none_or(|end| end > *dim))
        {
            return Err(bad("region lies outside the tensor".into()));
        }
        let element = info.dtype.element_bytes() as u64;
        let volume: u64 = region.iter().map(|r| r.len).product();
        let mut out = Vec::new();
        let mut covered = 0u64;
        for (rank, piece) in self.pieces(name) {
            let Some(overlap) = intersect(region, &piece.slice) else {
                continue;
            };
            covered += overlap.iter().map(|r| r.len).product::<u64>();
            // Byte range of the overlap inside the piece's own row-major layout.
            let piece_strides = strides(
                &piece.slice.iter().map(|r| r.len).collect::<Vec<_>>(),
                element,
            );
            let first: u64 = overlap
                .iter()
                .zip(&piece.slice)
                .zip(&piece_strides)
                .map(|((o, p), s)| (o.start - p.start) * s)
                .sum();
            let last: u64 = overlap
                .iter()
                .zip(&piece.slice)
                .zip(&piece_strides)
                .map(|((o, p), s)| (o.start + o.len - 1 - p.start) * s)
                .sum::<u64>()
                + element;
            // The chunks covering [first, last).
            let mut chunk_start = 0u64;
            let mut needed = Vec::new();
            let mut needed_from = None;
            for chunk in &piece.chunks {
                let chunk_end = chunk_start + chunk.raw_len;
                if chunk_end > first && chunk_start < last {
                    needed_from.get_or_insert(chunk_start);
                    needed.push(chunk.clone());
                }
                chunk_start = chunk_end;
            }
            let base = needed_from.unwrap_or(0);
            let context = ChunkContext {
                step: self.step(),
                rank,
                item: "tensor",
                name: name.to_string(),
            };
            let bytes: Vec<u8> = self
                .run
                .fetch_chunks(&needed, &context, progress)
                .await?
                .concat();
            if overlap.as_slice() == region && overlap == piece.slice {
                // One piece holds exactly what was asked for: its bytes are the answer.
                return Ok(bytes);
            }
            if out.is_empty() {
                out = vec![0u8; (volume * element) as usize];
            }
            let out_strides = strides(&region.iter().map(|r| r.len).collect::<Vec<_>>(), element);
            let row_bytes = (overlap.last().map_or(1, |r| r.len) * element) as usize;
            for_each_row(&overlap, |index| {
                let source: u64 = index
                    .iter()
                    .zip(&piece.slice)
                    .zip(&piece_strides)
                    .map(|((i, p), s)| (i - p.start) * s)
                    .sum::<u64>()
                    - base;
                let target: u64 = index
                    .iter()
                    .zip(region)
                    .zip(&out_strides)
                    .map(|((i, r), s)| (i - r.start) * s)
                    .sum();
                out[target as usize..target as usize + row_bytes]
                    .copy_from_slice(&bytes[source as usize..source as usize + row_bytes]);
            });
        }
        if covered != volume {
            return Err(bad(format!(
                "the checkpoint's ranks hold {covered} of the {volume} elements asked for"
            )));
        }
        Ok(out)
    }

    /// Writes tensors `names`, whole and back to back in this order, into `file` from
    /// `offset` with positional writes. Chunks are fetched, verified and written
    /// `download_concurrency` at a time, each at its own place in the file, so decoding runs
    /// on every core (an exported file is written this way). Each written piece is already on
    /// its way to the disk when this returns, not yet durable: the caller fsyncs the file.
    /// Returns the offset after the last tensor.
    pub async fn write_tensors_at(
        &self,
        names: &[String],
        file: &Arc<std::fs::File>,
        offset: u64,
        progress: &dyn Progress,
    ) -> Result<u64, StoreError> {
        /// One write: a chunk of a tensor one rank holds whole, or a tensor assembled first.
        enum Piece {
            Chunk(ChunkRef, ChunkContext),
            Assembled(String),
        }
        let mut pieces = Vec::new();
        let mut at = offset;
        let infos: HashMap<String, TensorInfo> = self
            .tensors()
            .into_iter()
            .map(|info| (info.name.clone(), info))
            .collect();
        for name in names {
            let info = infos.get(name).ok_or_else(|| self.no_such(None, name))?;
            match self.pieces(name).into_iter().find(|(_, p)| p.is_whole()) {
                Some((rank, entry)) => {
                    for chunk in &entry.chunks {
                        let context = ChunkContext {
                            step: self.step(),
                            rank,
                            item: "tensor",
                            name: name.clone(),
                        };
                        pieces.push((at, Piece::Chunk(chunk.clone(), context)));
                        at += chunk.raw_len;
                    }
                }
                None => {
                    pieces.push((at, Piece::Assembled(name.clone())));
                    at += info.global_shape.iter().product::<u64>()
                        * info.dtype.element_bytes() as u64;
                }
            }
        }
        // Pieces are fetched and decoded concurrently but written one at a time: writers of one
        // file queue for its inode's lock, where the kernel spins (4% of an export's samples).
        // Each piece's write-out starts as soon as it is written, so that the caller's fsync
        // of the whole file waits for little (`write_out_at`).
        let writing = Arc::new(std::sync::Mutex::new(()));
        stream::iter(pieces)
            .map(|(at, piece)| {
                let writing = writing.clone();
                async move {
                    let bytes = match piece {
                        Piece::Chunk(chunk, context) => {
                            self.run.fetch_ref(chunk, &context, progress).await?
                        }
                        Piece::Assembled(name) => self.read_tensor(&name, progress).await?,
                    };
                    let file = file.clone();
                    tokio::task::spawn_blocking(move || {
                        let _one_writer = writing.lock().expect("never poisoned");
                        write_out_at(&file, &bytes, at)
                    })
                    .await
                    .expect("writing does not panic")
                    .map_err(|cause| StoreError::Io {
                        path: format!("output at offset {at}"),
                        cause,
                    })
                }
            })
            .buffer_unordered(self.run.store.options.download_concurrency.max(1))
            .try_collect::<()>()
            .await?;
        Ok(at)
    }

    /// The bytes of tensor `name` exactly as `rank` stored them (its own slice).
    pub async fn read_shard_tensor(
        &self,
        rank: Rank,
        name: &str,
        progress: &dyn Progress,
    ) -> Result<Vec<u8>, StoreError> {
        let entry = self
            .manifest(rank)?
            .tensor(name)
            .ok_or_else(|| self.no_such(Some(rank), name))?;
        self.read_item(rank, "tensor", name, &entry.chunks, progress)
            .await
    }

    /// A state blob of `rank`.
    pub async fn read_blob(&self, rank: Rank, name: &str) -> Result<Vec<u8>, StoreError> {
        let entry = self
            .manifest(rank)?
            .blob(name)
            .ok_or_else(|| self.no_such(Some(rank), name))?;
        self.read_item(rank, "blob", name, &entry.chunks, &()).await
    }

    async fn read_item(
        &self,
        rank: Rank,
        item: &'static str,
        name: &str,
        chunks: &[ChunkRef],
        progress: &dyn Progress,
    ) -> Result<Vec<u8>, StoreError> {
        let context = ChunkContext {
            step: self.step(),
            rank,
            item,
            name: name.to_string(),
        };
        Ok(self
            .run
            .fetch_chunks(chunks, &context, progress)
            .await?
            .concat())
    }

    pub fn manifest(&self, rank: Rank) -> Result<&ShardManifest, StoreError> {
        self.manifests
            .get(rank as usize)
            .ok_or_else(|| StoreError::BadRequest {
                reason: format!("step {} has no rank {rank}", self.step()),
            })
    }

    fn no_such(&self, rank: Option<Rank>, name: &str) -> StoreError {
        StoreError::NoSuchTensor {
            run: self.run.run.clone(),
            step: self.step(),
            rank,
            name: name.to_string(),
        }
    }
}

fn intersect(a: &[DimRange], b: &[DimRange]) -> Option<Vec<DimRange>> {
    a.iter()
        .zip(b)
        .map(|(x, y)| {
            let start = x.start.max(y.start);
            let end = (x.start + x.len).min(y.start + y.len);
            (end > start).then_some(DimRange {
                start,
                len: end - start,
            })
        })
        .collect()
}

fn strides(lens: &[u64], element: u64) -> Vec<u64> {
    let mut strides = vec![element; lens.len()];
    for dim in (0..lens.len().saturating_sub(1)).rev() {
        strides[dim] = strides[dim + 1] * lens[dim + 1];
    }
    strides
}

/// Calls `visit` with the global index of the first element of every row (last dimension) of
/// `region`. A zero-dimensional region has one row.
fn for_each_row(region: &[DimRange], mut visit: impl FnMut(&[u64])) {
    let mut index: Vec<u64> = region.iter().map(|r| r.start).collect();
    if region.is_empty() {
        visit(&index);
        return;
    }
    let outer = region.len() - 1;
    loop {
        visit(&index);
        let mut dim = outer;
        loop {
            if dim == 0 {
                return;
            }
            dim -= 1;
            index[dim] += 1;
            if index[dim] < region[dim].start + region[dim].len {
                break;
            }
            index[dim] = region[dim].start;
        }
    }
}

/// Writes `bytes` at `offset` of `file` (a positional write) and starts writing them out to
/// its disk, without waiting for them (Linux's `sync_file_range` with
/// `SYNC_FILE_RANGE_WRITE`): a file that is fsynced once it is whole then has only its last
/// pieces left to write, where it would otherwise write all of it after the last piece. The
/// fsync alone makes the file durable, and reports any error; the write-out only moves the
/// disk's work earlier, so its failure is ignored.
pub fn write_out_at(file: &std::fs::File, bytes: &[u8], offset: u64) -> std::io::Result<()> {
    file.write_all_at(bytes, offset)?;
    start_writeback(file, offset, bytes.len() as u64);
    Ok(())
}

/// [`write_out_at`]'s start of the write-out.
fn start_writeback(file: &std::fs::File, offset: u64, len: u64) {
    #[cfg(target_os = "linux")]
    {
        use std::os::fd::AsRawFd;
        let (Ok(offset), Ok(len)) = (i64::try_from(offset), i64::try_from(len)) else {
            return;
        };
        // SAFETY: a system call on an open descriptor that `file` keeps open for the call; it
        // reads and writes no memory of this process.
        #[allow(unsafe_code)]
        let _ = unsafe {
            libc::sync_file_range(file.as_raw_fd(), offset, len, libc::SYNC_FILE_RANGE_WRITE)
        };
    }
    #[cfg(not(target_os = "linux"))]
    let _ = (file, offset, len);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_of_a_region_are_visited_in_order() {
        let region = [
            DimRange { start: 1, len: 2 },
            DimRange { start: 0, len: 3 },
            DimRange { start: 5, len: 4 },
        ];
        let mut rows = Vec::new();
        for_each_row(&region, |index| rows.push(index.to_vec()));
        assert_eq!(
            rows,
            vec![
                vec![1, 0, 5],
                vec![1, 1, 5],
                vec![1, 2, 5],
                vec![2, 0, 5],
                vec![2, 1, 5],
                vec![2, 2, 5]
            ]
        );
        let mut scalar = 0;
        for_each_row(&[], |_| scalar += 1);
        assert_eq!(scalar, 1);
    }
}
