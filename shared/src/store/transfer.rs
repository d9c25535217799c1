//! Copying a committed step between stores (e.g. from S3 to a node's local disk).
//!
//! Every chunk is downloaded and verified (its whole delta chain decoded) before it is written
//! to the target, objects are copied byte for byte, and the commit record goes last: a copy
//! that fails half-way leaves the target without a commit for that step.

use std::collections::HashSet;

use futures::stream::{self, StreamExt, TryStreamExt};

use super::reader::ChunkContext;
use super::{layout, Progress, RunStore};
use crate::error::StoreError;
use crate::hash::ChunkHash;
use crate::ids::StepKey;

impl RunStore {
    /// Copies committed `step` into `target` (same run id), verifying everything on the way.
    pub async fn copy_step_to(
        &self,
        target: &RunStore,
        step: StepKey,
        progress: &dyn Progress,
    ) -> Result<(), StoreError> {
        if target.run != self.run {
            return Err(StoreError::BadRequest {
                reason: "copy_step_to keeps the run id".into(),
            });
        }
        let checkpoint = self.open_checkpoint(step).await?;
        let run_json = layout::run_json(&self.run);
        let run_bytes = self.store.get(&run_json).await?;
        if !target.store.put(&run_json, run_bytes.clone(), true).await?
            && target.store.get(&run_json).await? != run_bytes
        {
            return Err(StoreError::BadRequest {
                reason: format!("the target already holds a different run {}", self.run),
            });
        }
        let mut uses: Vec<(ChunkHash, ChunkContext, u64)> = Vec::new();
        let mut seen = HashSet::new();
        for manifest in &checkpoint.manifests {
            for (item, name, chunks) in manifest.items() {
                for chunk in chunks.iter().filter(|c| seen.insert(c.hash)) {
                    uses.push((
                        chunk.hash,
                        ChunkContext {
                            step,
                            rank: manifest.rank,
                            item,
                            name: name.clone(),
                        },
                        chunk.raw_len,
                    ));
                }
            }
        }
        progress.set_total(uses.iter().map(|(_, _, len)| len).sum());
        stream::iter(uses)
            .map(|(hash, context, raw_len)| async move {
                let (_, chain) = self.fetch_chain(hash, &context).await?;
                for (object_hash, bytes) in chain {
                    target
                        .store
                        .put(&layout::chunk(&self.run, &object_hash), bytes, false)
                        .await?;
                }
                progress.advance(raw_len);
                Ok::<_, StoreError>(())
            })
            .buffer_unordered(self.store.options.download_concurrency.max(1))
            .try_collect::<()>()
            .await?;
        for shard in &checkpoint.commit.shards {
            let path = layout::shard(&self.run, step, shard.rank);
            target
                .store
                .put(&path, self.store.get(&path).await?, false)
                .await?;
        }
        let commit = layout::commit(&self.run, step);
        let bytes = self.store.get(&commit).await?;
        if !target.store.put(&commit, bytes.clone(), true).await?
            && target.store.get(&commit).await? != bytes
        {
            return Err(StoreError::StepAlreadyCommitted {
                run: self.run.clone(),
                step,
            });
        }
        Ok(())
    }
}
