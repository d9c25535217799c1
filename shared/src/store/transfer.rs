//! Copying a committed step between stores (e.g. from S3 to a node's local disk).
//!
//! Every chunk is downloaded and verified (its whole delta chain decoded) before it is written
//! to the target, objects are copied byte for byte, and the commit record goes last: a copy
//! that fails half-way leaves the target without a commit for that step.
//!
//! Chunk objects are put create-only. Where the target already holds an object of the chain
//! with other bytes (another encoding of the same raw data, from its own steps), the chunk is
//! stored whole instead: a target's manifests list the chains of their own encodings, gc keeps
//! exactly those, and a whole chunk needs none.

use std::collections::HashSet;

use futures::stream::{self, StreamExt, TryStreamExt};

use super::reader::ChunkContext;
use super::{layout, Progress, RunStore};
use crate::codec;
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
        let commit = layout::commit(&self.run, step);
        let commit_bytes = self.store.get(&commit).await?;
        // A step the target committed with other manifests is refused before anything is
        // written (its manifests are pinned); with the same commit, the copy goes on and puts
        // back what the target lacks.
        match target.store.get(&commit).await {
            Ok(stored) if stored == commit_bytes => {}
            Ok(_) => {
                return Err(StoreError::StepAlreadyCommitted {
                    run: self.run.clone(),
                    step,
                })
            }
            Err(StoreError::NotFound { .. }) => {}
            Err(e) => return Err(e),
        }
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
                let (raw, chain) = self.fetch_chain(hash, &context).await?;
                let mut differs = false;
                for (object_hash, bytes) in chain {
                    let path = layout::chunk(&self.run, &object_hash);
                    if !target.store.put(&path, bytes.clone(), true).await? {
                        differs |= target.store.get(&path).await? != bytes;
                    }
                }
                if differs {
                    let level = self.store.options.zstd_level;
                    let whole = tokio::task::spawn_blocking(move || {
                        codec::encode_with(&raw, hash, codec::Codec::Zstd, None, level)
                    })
                    .await
                    .expect("encoding does not panic");
                    target
                        .store
                        .put(&layout::chunk(&self.run, &hash), whole.bytes.into(), false)
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
        if !target
            .store
            .put(&commit, commit_bytes.clone(), true)
            .await?
            && target.store.get(&commit).await? != commit_bytes
        {
            return Err(StoreError::StepAlreadyCommitted {
                run: self.run.clone(),
                step,
            });
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use std::sync::Arc;

    use bytes::Bytes;
    use object_store::memory::InMemory;
    use object_store::{ObjectStore, ObjectStoreExt};

    use super::layout;
    use crate::ids::StepKey;
    use crate::store::testing::{bases_of, floats, open_run, write};
    use crate::store::RunStore;

    async fn open(objects: Arc<dyn ObjectStore>) -> RunStore {
        open_run(objects, "copy", None).await
    }

    /// Writes and commits `data` as step `step` of tensor `w`, as a delta on `base` if given.
    async fn commit(
        run: &RunStore,
        step: u64,
        data: &Bytes,
        base: Option<(&Bytes, &crate::format::ShardManifest)>,
    ) -> crate::format::ShardManifest {
        let bases = base.map(|(raw, manifest)| bases_of(raw, manifest));
        let manifest = write(run, step, data, bases.as_ref()).await;
        run.commit(StepKey::new(step, 0), 1).await.unwrap();
        manifest
    }

    /// The target holds chunk `b` as a delta on its own `c`; the copied step holds `b` as a
    /// delta on `a`. The copy stores `b` whole, so the target's own step still reads once `a`
    /// (listed only by the copied steps) is gone.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_copy_never_rebases_a_chunk_the_target_holds() {
        let source_objects: Arc<dyn ObjectStore> = Arc::new(InMemory::new());
        let target_objects: Arc<dyn ObjectStore> = Arc::new(InMemory::new());
        let source = open(source_objects).await;
        let target = open(target_objects.clone()).await;
        source.create(serde_json::json!({})).await.unwrap();
        let (a, b, c) = (floats(1, 0), floats(1, 64), floats(1, 128));
        let first = commit(&source, 1, &a, None).await;
        let second = commit(&source, 2, &b, Some((&a, &first))).await;
        let a_hash = first.tensors[0].chunks[0].hash;
        assert_eq!(second.tensors[0].chunks[0].bases, vec![a_hash]);

        source
            .copy_step_to(&target, StepKey::new(1, 0), &())
            .await
            .unwrap();
        let third = commit(&target, 3, &c, None).await;
        let fourth = commit(&target, 4, &b, Some((&c, &third))).await;
        let c_hash = third.tensors[0].chunks[0].hash;
        assert_eq!(fourth.tensors[0].chunks[0].bases, vec![c_hash]);

        source
            .copy_step_to(&target, StepKey::new(2, 0), &())
            .await
            .unwrap();
        target_objects
            .delete(&layout::chunk(target.id(), &a_hash))
            .await
            .unwrap();
        for (step, data) in [(4, &b), (3, &c)] {
            let checkpoint = target.open_checkpoint(StepKey::new(step, 0)).await.unwrap();
            assert_eq!(
                checkpoint.read_tensor("w", &()).await.unwrap(),
                data.to_vec(),
                "step {step}"
            );
        }
        let copied = target.open_checkpoint(StepKey::new(2, 0)).await.unwrap();
        assert_eq!(copied.read_tensor("w", &()).await.unwrap(), b.to_vec());
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_step_the_target_committed_otherwise_is_refused_untouched() {
        let source_objects: Arc<dyn ObjectStore> = Arc::new(InMemory::new());
        let target_objects: Arc<dyn ObjectStore> = Arc::new(InMemory::new());
        let source = open(source_objects).await;
        let target = open(target_objects.clone()).await;
        source.create(serde_json::json!({})).await.unwrap();
        commit(&source, 1, &floats(1, 0), None).await;
        source
            .copy_step_to(&target, StepKey::new(1, 0), &())
            .await
            .unwrap();
        commit(&source, 2, &floats(2, 0), None).await;
        commit(&target, 2, &floats(3, 0), None).await;
        let manifest = layout::shard(target.id(), StepKey::new(2, 0), 0);
        let before = target_objects
            .get(&manifest)
            .await
            .unwrap()
            .bytes()
            .await
            .unwrap();
        let error = source
            .copy_step_to(&target, StepKey::new(2, 0), &())
            .await
            .unwrap_err();
        assert!(
            matches!(error, crate::StoreError::StepAlreadyCommitted { .. }),
            "{error}"
        );
        let after = target_objects
            .get(&manifest)
            .await
            .unwrap()
            .bytes()
            .await
            .unwrap();
        assert_eq!(
            before, after,
            "the target's committed manifest is untouched"
        );
        // The same step again is fine (and repairs nothing that is not missing).
        source
            .copy_step_to(&target, StepKey::new(1, 0), &())
            .await
            .unwrap();
    }
}
