//! Garbage collection: deletes steps the retention policy drops, then every chunk that no
//! retained manifest references (directly or as a delta base) and that is older than the
//! grace period.
//!
//! Safety, in order:
//! 1. Take the run's `gc` lock first; only then list manifests (see `writer` for why a
//!    concurrent writer is safe).
//! 2. Never drop the latest visible commit, a rolled-back step (hidden, never deleted), a
//!    damaged commit (an operator must look), or an uncommitted step newer than the latest
//!    commit or younger than the grace period (it may still be in progress).
//! 3. Delete a dropped step's commit record before its manifests, so a crash in between leaves
//!    an incomplete step, never a commit that points at nothing.
//! 4. Refuse to run if any retained manifest cannot be read: its references would be unknown.
//! 5. Stop deleting if the lock is about to expire.

use std::collections::{BTreeSet, HashSet};

use futures::stream::{self, StreamExt, TryStreamExt};
use serde::Serialize;

use super::{layout, now_unix_ms, Progress, RunStore, StepState};
use crate::error::StoreError;
use crate::format::ShardManifest;
use crate::hash::ChunkHash;
use crate::ids::{Rank, StepKey};

pub(crate) const GC_LOCK: &str = "gc";

/// Steps whose manifests are read, or which are deleted, at once.
const STEPS_AT_ONCE: usize = 8;
/// Chunks deleted in one request where the backend takes many (S3 takes up to 1,000).
const DELETE_BATCH: usize = super::DELETE_BATCH_OBJECTS as usize;
/// Batches of chunks being deleted at once.
const BATCHES_AT_ONCE: usize = 4;

#[derive(Clone, Debug)]
pub struct GcPolicy {
    /// Keep this many of the newest visible commits (at least 1).
    pub keep_last: usize,
    /// Also keep every visible commit whose step number is a multiple of this.
    pub keep_every: Option<u64>,
    /// Never delete a chunk or an uncommitted manifest younger than this.
    pub grace_ms: u64,
    /// Never delete a staging file (`file://` stores) younger than this. A live writer's
    /// staging files are in flight, and nothing else protects them: keep this well above the
    /// longest single upload unless no writer is running.
    pub staging_grace_ms: u64,
    pub dry_run: bool,
}

#[derive(Clone, Debug, Default, Serialize)]
pub struct GcReport {
    pub dry_run: bool,
    pub kept_steps: Vec<StepKey>,
    pub deleted_steps: Vec<StepKey>,
    pub deleted_incomplete: Vec<StepKey>,
    pub kept_chunks: u64,
    pub deleted_chunks: u64,
    pub deleted_bytes: u64,
    /// Unreferenced chunks left alone because they are younger than the grace period.
    pub young_chunks: u64,
    /// Half-written staging files (`name#N`) that a killed writer left in a `file://` store.
    pub deleted_staging_files: u64,
}

impl RunStore {
    pub async fn gc(
        &self,
        policy: &GcPolicy,
        progress: &dyn Progress,
    ) -> Result<GcReport, StoreError> {
        if policy.keep_last == 0 {
            return Err(StoreError::BadRequest {
                reason: "--keep-last must be at least 1: gc never deletes the latest step".into(),
            });
        }
        let lock = self.lock(GC_LOCK, "gc").await?;
        let result = self.gc_locked(policy, progress, &lock).await;
        let released = lock.release().await;
        let report = result?;
        released?;
        Ok(report)
    }

    async fn gc_locked(
        &self,
        policy: &GcPolicy,
        progress: &dyn Progress,
        lock: &super::LockGuard,
    ) -> Result<GcReport, StoreError> {
        let now = now_unix_ms();
        let young = |created: Option<u64>| created.is_none_or(|t| t + policy.grace_ms > now);
        let catalog = self.catalog().await?;
        let visible: Vec<StepKey> = catalog.visible_commits().map(|s| s.step).collect();
        let newest: BTreeSet<StepKey> = visible
            .iter()
            .rev()
            .take(policy.keep_last)
            .copied()
            .collect();
        let mut report = GcReport {
            dry_run: policy.dry_run,
            ..Default::default()
        };
        let mut retained_manifests: Vec<(StepKey, Option<u32>)> = Vec::new();
        for status in &catalog.steps {
            let step = status.step;
            let keep = match &status.state {
                StepState::Committed => {
                    newest.contains(&step)
                        || policy
                            .keep_every
                            .is_some_and(|k| k > 0 && step.step % k == 0)
                }
                StepState::RolledBack { .. } | StepState::Damaged { .. } => true,
                StepState::Incomplete { .. } => {
                    catalog.latest.is_none_or(|latest| {
                        (step.step, step.timeline) > (latest.step, latest.timeline)
                    }) || young(status.created_unix_ms)
                }
            };
            match (&status.state, keep) {
                (StepState::Incomplete { .. }, true) => retained_manifests.push((step, None)),
                (StepState::Incomplete { .. }, false) => report.deleted_incomplete.push(step),
                (_, true) => {
                    report.kept_steps.push(step);
                    retained_manifests.push((step, status.world_size));
                }
                (_, false) => report.deleted_steps.push(step),
            }
        }
        // Everything retained manifests reference, bases included.
        let mut referenced: HashSet<ChunkHash> = HashSet::new();
        let retained: Vec<StepKey> = retained_manifests.iter().map(|(step, _)| *step).collect();
        let mut manifests = stream::iter(retained)
            .map(|step| self.manifests_of(step))
            .buffered(STEPS_AT_ONCE);
        while let Some(manifests) = manifests.next().await {
            for manifest in manifests? {
                for chunk in manifest.chunk_refs() {
                    referenced.insert(chunk.hash);
                    referenced.extend(chunk.bases.iter().copied());
                }
            }
        }
        if !policy.dry_run {
            let dropped: Vec<StepKey> = report
                .deleted_steps
                .iter()
                .chain(&report.deleted_incomplete)
                .copied()
                .collect();
            stream::iter(dropped)
                .map(|step| self.delete_step(step))
                .buffer_unordered(STEPS_AT_ONCE)
                .try_collect::<()>()
                .await?;
        }
        let chunks = self.store.list(&layout::chunks_prefix(&self.run)).await?;
        let mut doomed = Vec::new();
        for meta in chunks {
            let Some(hash) = layout::parse_chunk(&meta.location) else {
                continue;
            };
            if referenced.contains(&hash) {
                report.kept_chunks += 1;
            } else if young(Some(meta.last_modified.timestamp_millis().max(0) as u64)) {
                report.young_chunks += 1;
            } else {
                report.deleted_bytes += meta.size;
                doomed.push((hash, meta.location));
            }
        }
        report.deleted_chunks = doomed.len() as u64;
        progress.set_total(doomed.len() as u64);
        if !policy.dry_run {
            let mut batches = Vec::new();
            let mut doomed = doomed.into_iter().peekable();
            while doomed.peek().is_some() {
                batches.push(doomed.by_ref().take(DELETE_BATCH).collect::<Vec<_>>());
            }
            stream::iter(batches)
                .map(|batch| self.delete_chunks(batch, lock, progress))
                .buffer_unordered(BATCHES_AT_ONCE)
                .try_collect::<()>()
                .await?;
        }
        report.deleted_staging_files = self.sweep_staging_files(policy, now)?;
        Ok(report)
    }

    /// `object_store` writes a local file as `name#N` and renames it into place; a writer
    /// killed in between leaves the staging file, which listings never show. Removes those
    /// older than the staging grace period under this run's directory.
    fn sweep_staging_files(&self, policy: &GcPolicy, now: u64) -> Result<u64, StoreError> {
        let Some(root) = &self.store.local_root else {
            return Ok(0);
        };
        let run_dir = root.join(layout::RUNS).join(self.run.as_str());
        let io = |path: &std::path::Path, cause| StoreError::Io {
            path: path.display().to_string(),
            cause,
        };
        let mut removed = 0;
        let mut pending = vec![run_dir];
        while let Some(dir) = pending.pop() {
            let entries = match std::fs::read_dir(&dir) {
                Ok(entries) => entries,
                Err(error) if error.kind() == std::io::ErrorKind::NotFound => continue,
                Err(error) => return Err(io(&dir, error)),
            };
            for entry in entries {
                let entry = entry.map_err(|e| io(&dir, e))?;
                let path = entry.path();
                // A live writer renames its staging file into place at any moment: a file
                // that vanished between the listing and here is not an error.
                let metadata = match entry.metadata() {
                    Ok(metadata) => metadata,
                    Err(error) if error.kind() == std::io::ErrorKind::NotFound => continue,
                    Err(error) => return Err(io(&path, error)),
                };
                if metadata.is_dir() {
                    pending.push(path);
                    continue;
                }
                let name = entry.file_name().to_string_lossy().to_string();
                let staging = name
                    .rsplit_once('#')
                    .is_some_and(|(_, n)| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()));
                let modified_ms = metadata
                    .modified()
                    .ok()
                    .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
                    .map(|d| d.as_millis() as u64);
                if staging && modified_ms.is_some_and(|t| t + policy.staging_grace_ms <= now) {
                    if !policy.dry_run {
                        match std::fs::remove_file(&path) {
                            Ok(()) => {}
                            Err(error) if error.kind() == std::io::ErrorKind::NotFound => continue,
                            Err(error) => return Err(io(&path, error)),
                        }
                    }
                    removed += 1;
                }
            }
        }
        Ok(removed)
    }

    /// Deletes unreferenced chunks (one request on S3), unless the gc lock is about to expire.
    async fn delete_chunks(
        &self,
        batch: Vec<(ChunkHash, object_store::path::Path)>,
        lock: &super::LockGuard,
        progress: &dyn Progress,
    ) -> Result<(), StoreError> {
        let lock_margin_ms = 30_000.min(self.store.options.lock_ttl_ms / 4);
        if !lock.is_valid(lock_margin_ms) {
            return Err(StoreError::BadRequest {
                reason: "gc lock is about to expire; stopping (run gc again to finish)".into(),
            });
        }
        let count = batch.len() as u64;
        let (hashes, paths): (Vec<_>, Vec<_>) = batch.into_iter().unzip();
        self.store
            .delete_all(paths, &layout::chunks_prefix(&self.run))
            .await?;
        if let Some(index) = self.store.index() {
            for hash in &hashes {
                index.remove_chunk(&self.run, hash)?;
            }
        }
        progress.advance(count);
        Ok(())
    }

    /// Deletes a dropped step: its commit record first, then its manifests, so that a crash in
    /// between leaves an incomplete step, never a commit that points at nothing.
    async fn delete_step(&self, step: StepKey) -> Result<(), StoreError> {
        self.store.delete(&layout::commit(&self.run, step)).await?;
        let folder = layout::shard_dir(&self.run, step);
        let manifests = self.store.list(&folder).await?;
        if let Some(index) = self.store.index() {
            for meta in &manifests {
                if let Some((step, rank)) = layout::parse_shard(&meta.location) {
                    index.remove_manifest(&self.run, step, rank)?;
                }
            }
        }
        let paths = manifests.into_iter().map(|meta| meta.location).collect();
        self.store.delete_all(paths, &folder).await
    }

    /// Every shard manifest stored for `step` (committed or not); a damaged one is an error.
    pub(crate) async fn manifests_of(
        &self,
        step: StepKey,
    ) -> Result<Vec<ShardManifest>, StoreError> {
        let listing = self.store.list(&layout::shard_dir(&self.run, step)).await?;
        let manifests: Vec<_> = listing
            .into_iter()
            .filter_map(|meta| Some((layout::parse_shard(&meta.location)?.1, meta.location)))
            .collect();
        stream::iter(manifests)
            .map(|(rank, location)| self.load_manifest(step, rank, location))
            .buffered(self.store.options.metadata_concurrency.max(1))
            .try_collect()
            .await
    }

    async fn load_manifest(
        &self,
        step: StepKey,
        rank: Rank,
        location: object_store::path::Path,
    ) -> Result<ShardManifest, StoreError> {
        let bytes = self.store.get(&location).await?;
        let (manifest, _): (ShardManifest, _) =
            self.open_object(&bytes, &location, &step.to_string(), &rank.to_string())?;
        Ok(manifest)
    }
}
