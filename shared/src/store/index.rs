//! The local chunk index (sled): which chunks a run has in storage, how they are encoded, and
//! how many shard manifests reference each. It only saves requests: every answer can be
//! rebuilt from storage (`ckptctl index rebuild`), and a missing or stale index never makes a
//! write or read wrong, because the writer re-checks storage before it relies on a chunk.

use std::path::{Path as FsPath, PathBuf};

use futures::stream::{self, StreamExt, TryStreamExt};
use serde::{Deserialize, Serialize};

use super::{layout, Progress, RunStore};
use crate::codec::{ChunkHeader, Codec, HEADER_BYTES};
use crate::error::StoreError;
use crate::hash::ChunkHash;
use crate::ids::{Rank, RunId, StepKey};

/// How a chunk is stored.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChunkInfo {
    pub stored_len: u64,
    pub codec: Codec,
    /// Delta chain, nearest base first.
    pub bases: Vec<ChunkHash>,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct IndexStats {
    pub chunks: u64,
    pub manifests: u64,
    /// Sum over chunks of the number of manifests referencing them.
    pub references: u64,
}

#[derive(Debug)]
pub struct ChunkIndex {
    path: PathBuf,
    chunks: sled::Tree,
    refs: sled::Tree,
    manifests: sled::Tree,
    db: sled::Db,
}

fn chunk_key(run: &RunId, hash: &ChunkHash) -> Vec<u8> {
    let mut key = run.as_str().as_bytes().to_vec();
    key.push(b'/');
    key.extend_from_slice(&hash.0);
    key
}

fn manifest_key(run: &RunId, step: StepKey, rank: Rank) -> Vec<u8> {
    format!("{run}/{}/{rank}", step.object_name()).into_bytes()
}

/// How long opening waits for another handle's file lock to go.
const LOCK_WAIT: std::time::Duration = std::time::Duration::from_secs(5);

impl ChunkIndex {
    pub fn open(path: &FsPath) -> Result<Self, StoreError> {
        let error = |cause| StoreError::Index {
            path: path.display().to_string(),
            cause,
        };
        // sled releases its file lock when its last handle goes, and its flusher thread can
        // hold one a moment after the index was dropped: an index reopened at once (by this
        // process, or by the next command) waits for it, briefly.
        let deadline = std::time::Instant::now() + LOCK_WAIT;
        let db = loop {
            match sled::open(path) {
                Err(sled::Error::Io(e))
                    if e.to_string().contains("could not acquire lock")
                        && std::time::Instant::now() < deadline =>
                {
                    std::thread::sleep(std::time::Duration::from_millis(10));
                }
                opened => break opened.map_err(error)?,
            }
        };
        Ok(Self {
            chunks: db.open_tree("chunks").map_err(error)?,
            refs: db.open_tree("refs").map_err(error)?,
            manifests: db.open_tree("manifests").map_err(error)?,
            path: path.to_path_buf(),
            db,
        })
    }

    fn error(&self, source: sled::Error) -> StoreError {
        StoreError::Index {
            path: self.path.display().to_string(),
            cause: source,
        }
    }

    pub fn chunk(&self, run: &RunId, hash: &ChunkHash) -> Option<ChunkInfo> {
        let value = self.chunks.get(chunk_key(run, hash)).ok()??;
        serde_json::from_slice(&value).ok()
    }

    pub fn put_chunk(
        &self,
        run: &RunId,
        hash: &ChunkHash,
        info: &ChunkInfo,
    ) -> Result<(), StoreError> {
        let value = serde_json::to_vec(info).expect("ChunkInfo serialises");
        self.chunks
            .insert(chunk_key(run, hash), value)
            .map_err(|e| self.error(e))?;
        Ok(())
    }

    pub fn remove_chunk(&self, run: &RunId, hash: &ChunkHash) -> Result<(), StoreError> {
        self.chunks
            .remove(chunk_key(run, hash))
            .map_err(|e| self.error(e))?;
        self.refs
            .remove(chunk_key(run, hash))
            .map_err(|e| self.error(e))?;
        Ok(())
    }

    /// Counts one manifest's references (once per distinct chunk), unless already counted.
    pub fn add_manifest(
        &self,
        run: &RunId,
        step: StepKey,
        rank: Rank,
        hashes: &[ChunkHash],
    ) -> Result<(), StoreError> {
        let mut distinct: Vec<ChunkHash> = hashes.to_vec();
        distinct.sort();
        distinct.dedup();
        let value = serde_json::to_vec(&distinct).expect("hashes serialise");
        let previous = self
            .manifests
            .insert(manifest_key(run, step, rank), value)
            .map_err(|e| self.error(e))?;
        if previous.is_some() {
            // Recounting a rewritten manifest: drop the old references first.
            let old: Vec<ChunkHash> = previous
                .and_then(|v| serde_json::from_slice(&v).ok())
                .unwrap_or_default();
            self.adjust(run, &old, -1)?;
        }
        self.adjust(run, &distinct, 1)
    }

    pub fn remove_manifest(
        &self,
        run: &RunId,
        step: StepKey,
        rank: Rank,
    ) -> Result<(), StoreError> {
        if let Some(value) = self
            .manifests
            .remove(manifest_key(run, step, rank))
            .map_err(|e| self.error(e))?
        {
            let old: Vec<ChunkHash> = serde_json::from_slice(&value).unwrap_or_default();
            self.adjust(run, &old, -1)?;
        }
        Ok(())
    }

    fn adjust(&self, run: &RunId, hashes: &[ChunkHash], delta: i64) -> Result<(), StoreError> {
        for hash in hashes {
            self.refs
                .update_and_fetch(chunk_key(run, hash), |old| {
                    let count = old
                        .map_or(0, |v| i64::from_le_bytes(v.try_into().unwrap_or([0; 8])))
                        + delta;
                    (count > 0).then(|| count.to_le_bytes().to_vec())
                })
                .map_err(|e| self.error(e))?;
        }
        Ok(())
    }

    pub fn stats(&self) -> Result<IndexStats, StoreError> {
        let mut references = 0u64;
        for entry in self.refs.iter() {
            let (_, value) = entry.map_err(|e| self.error(e))?;
            references +=
                i64::from_le_bytes(value.as_ref().try_into().unwrap_or([0; 8])).max(0) as u64;
        }
        Ok(IndexStats {
            chunks: self.chunks.len() as u64,
            manifests: self.manifests.len() as u64,
            references,
        })
    }

    pub fn clear(&self) -> Result<(), StoreError> {
        for tree in [&self.chunks, &self.refs, &self.manifests] {
            tree.clear().map_err(|e| self.error(e))?;
        }
        Ok(())
    }

    pub fn flush(&self) -> Result<(), StoreError> {
        self.db.flush().map_err(|e| self.error(e))?;
        Ok(())
    }
}

impl RunStore {
    /// Adds this run's chunks (from their headers) and manifests to `index`.
    pub(crate) async fn index_into(
        &self,
        index: &ChunkIndex,
        progress: &dyn Progress,
    ) -> Result<(), StoreError> {
        let chunks = self.store.list(&layout::chunks_prefix(&self.run)).await?;
        progress.set_total(chunks.len() as u64);
        let headers: Vec<Option<(ChunkHash, ChunkHeader, u64)>> = stream::iter(chunks)
            .map(|meta| async move {
                let Some(hash) = layout::parse_chunk(&meta.location) else {
                    return Ok(None);
                };
                let (bytes, size) = self
                    .store
                    .get_prefix(&meta.location, HEADER_BYTES as u64)
                    .await?;
                progress.advance(1);
                // A damaged chunk is left out; `verify` is the tool that reports it.
                Ok::<_, StoreError>(
                    ChunkHeader::parse(&bytes)
                        .ok()
                        .filter(|h| h.raw_hash == hash)
                        .map(|h| (hash, h, size)),
                )
            })
            .buffer_unordered(self.store.options.download_concurrency.max(1))
            .try_collect()
            .await?;
        let headers: std::collections::HashMap<ChunkHash, (ChunkHeader, u64)> = headers
            .into_iter()
            .flatten()
            .map(|(hash, header, size)| (hash, (header, size)))
            .collect();
        for (hash, (header, size)) in &headers {
            let mut bases = Vec::new();
            let mut next = header.base;
            while let Some(base) =
                next.filter(|_| bases.len() < usize::from(crate::codec::DELTA_DEPTH_MAX))
            {
                bases.push(base);
                next = headers.get(&base).and_then(|(h, _)| h.base);
            }
            index.put_chunk(
                &self.run,
                hash,
                &ChunkInfo {
                    stored_len: *size,
                    codec: header.codec,
                    bases,
                },
            )?;
        }
        for meta in self.store.list(&layout::shards_prefix(&self.run)).await? {
            let Some((step, rank)) = layout::parse_shard(&meta.location) else {
                continue;
            };
            let bytes = self.store.get(&meta.location).await?;
            if let Ok((manifest, _)) = crate::format::open::<crate::format::ShardManifest>(&bytes) {
                let hashes: Vec<ChunkHash> = manifest.chunk_refs().map(|c| c.hash).collect();
                index.add_manifest(&self.run, step, rank, &hashes)?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    //! The index against a model (sled's own way of testing its tree): random sequences of
    //! operations, with the index closed and opened again in between, must leave it answering
    //! exactly as a plain map does.

    use std::collections::{BTreeMap, BTreeSet};

    use proptest::prelude::*;

    use super::*;

    #[derive(Clone, Debug)]
    enum Op {
        PutChunk {
            run: u8,
            hash: u8,
            stored_len: u64,
        },
        RemoveChunk {
            run: u8,
            hash: u8,
        },
        AddManifest {
            run: u8,
            step: u8,
            rank: u8,
            hashes: Vec<u8>,
        },
        RemoveManifest {
            run: u8,
            step: u8,
            rank: u8,
        },
        Reopen,
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            (0..2u8, 0..8u8, 1..1000u64).prop_map(|(run, hash, stored_len)| Op::PutChunk {
                run,
                hash,
                stored_len
            }),
            (0..2u8, 0..8u8).prop_map(|(run, hash)| Op::RemoveChunk { run, hash }),
            (0..2u8, 0..3u8, 0..2u8, prop::collection::vec(0..8u8, 0..6)).prop_map(
                |(run, step, rank, hashes)| Op::AddManifest {
                    run,
                    step,
                    rank,
                    hashes
                }
            ),
            (0..2u8, 0..3u8, 0..2u8).prop_map(|(run, step, rank)| Op::RemoveManifest {
                run,
                step,
                rank
            }),
            Just(Op::Reopen),
        ]
    }

    /// What the index must answer: chunks, manifests (their distinct chunks) and reference
    /// counts, which removing a chunk forgets and which never go below zero.
    #[derive(Default)]
    struct Model {
        chunks: BTreeMap<(u8, u8), u64>,
        manifests: BTreeMap<(u8, u8, u8), BTreeSet<u8>>,
        refs: BTreeMap<(u8, u8), i64>,
    }

    impl Model {
        fn adjust(&mut self, run: u8, hashes: &BTreeSet<u8>, delta: i64) {
            for hash in hashes {
                let count = self.refs.get(&(run, *hash)).copied().unwrap_or(0) + delta;
                if count > 0 {
                    self.refs.insert((run, *hash), count);
                } else {
                    self.refs.remove(&(run, *hash));
                }
            }
        }

        fn apply(&mut self, op: &Op) {
            match op {
                Op::PutChunk {
                    run,
                    hash,
                    stored_len,
                } => {
                    self.chunks.insert((*run, *hash), *stored_len);
                }
                Op::RemoveChunk { run, hash } => {
                    self.chunks.remove(&(*run, *hash));
                    self.refs.remove(&(*run, *hash));
                }
                Op::AddManifest {
                    run,
                    step,
                    rank,
                    hashes,
                } => {
                    let distinct: BTreeSet<u8> = hashes.iter().copied().collect();
                    if let Some(old) = self
                        .manifests
                        .insert((*run, *step, *rank), distinct.clone())
                    {
                        self.adjust(*run, &old, -1);
                    }
                    self.adjust(*run, &distinct, 1);
                }
                Op::RemoveManifest { run, step, rank } => {
                    if let Some(old) = self.manifests.remove(&(*run, *step, *rank)) {
                        self.adjust(*run, &old, -1);
                    }
                }
                Op::Reopen => {}
            }
        }
    }

    fn run_id(run: u8) -> RunId {
        format!("run{run}").parse().expect("a valid run id")
    }

    fn hash(hash: u8) -> ChunkHash {
        ChunkHash::of(&[hash])
    }

    fn info(stored_len: u64) -> ChunkInfo {
        ChunkInfo {
            stored_len,
            codec: Codec::Zstd,
            bases: Vec::new(),
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(48))]
        #[test]
        fn the_index_answers_as_its_model_across_reopens(ops in prop::collection::vec(op(), 1..60)) {
            let dir = tempfile::tempdir().expect("temp dir");
            let path = dir.path().join("index");
            let mut index = ChunkIndex::open(&path).expect("opens");
            let mut model = Model::default();
            for op in &ops {
                match op {
                    Op::PutChunk { run, hash: h, stored_len } => {
                        index.put_chunk(&run_id(*run), &hash(*h), &info(*stored_len)).expect("put");
                    }
                    Op::RemoveChunk { run, hash: h } => {
                        index.remove_chunk(&run_id(*run), &hash(*h)).expect("remove");
                    }
                    Op::AddManifest { run, step, rank, hashes } => {
                        let hashes: Vec<ChunkHash> = hashes.iter().map(|h| hash(*h)).collect();
                        index
                            .add_manifest(&run_id(*run), StepKey::new(u64::from(*step), 0), u32::from(*rank), &hashes)
                            .expect("add");
                    }
                    Op::RemoveManifest { run, step, rank } => {
                        index
                            .remove_manifest(&run_id(*run), StepKey::new(u64::from(*step), 0), u32::from(*rank))
                            .expect("remove");
                    }
                    Op::Reopen => {
                        index.flush().expect("flush");
                        drop(index);
                        index = ChunkIndex::open(&path).expect("opens again");
                    }
                }
                model.apply(op);
                for run in 0..2u8 {
                    for h in 0..8u8 {
                        let found = index.chunk(&run_id(run), &hash(h)).map(|i| i.stored_len);
                        prop_assert_eq!(found, model.chunks.get(&(run, h)).copied(), "chunk {} of run {} after {:?}", h, run, op);
                    }
                }
                let stats = index.stats().expect("stats");
                prop_assert_eq!(stats.chunks, model.chunks.len() as u64);
                prop_assert_eq!(stats.manifests, model.manifests.len() as u64);
                prop_assert_eq!(stats.references, model.refs.values().sum::<i64>() as u64, "after {:?}", op);
            }
        }
    }
}
