//! Audits committed steps: structure (commit, pinned manifests, every chunk and delta base
//! present) and, with `read_data`, a full download and re-hash of every chunk or a sample.
//! Every problem is named by run, step, rank, tensor and chunk; storage being unreachable is
//! an error, not a problem.

use std::collections::HashMap;

use futures::stream::{self, StreamExt};
use serde::Serialize;

use super::reader::ChunkContext;
use super::{layout, Progress, RunStore};
use crate::error::StoreError;
use crate::hash::ChunkHash;
use crate::ids::{Rank, RunId, StepKey};

#[derive(Clone, Debug, Default)]
pub struct VerifyOptions {
    /// Download and re-hash chunk data, not only check that it exists.
    pub read_data: bool,
    /// With `read_data`, check only this percentage of the distinct chunks (chosen by hash,
    /// so the same sample is drawn every time).
    pub sample_percent: Option<f64>,
}

/// One thing wrong with a checkpoint.
#[derive(Clone, Debug, Serialize)]
pub struct Problem {
    pub run: RunId,
    pub step: StepKey,
    pub rank: Option<Rank>,
    pub item: Option<String>,
    pub name: Option<String>,
    pub chunk: Option<ChunkHash>,
    pub error: String,
}

#[derive(Clone, Debug, Default, Serialize)]
pub struct VerifyReport {
    pub steps: Vec<StepKey>,
    pub manifests_checked: u64,
    pub chunks_checked: u64,
    pub bytes_read: u64,
    pub problems: Vec<Problem>,
}

struct ChunkUse {
    context: ChunkContext,
    raw_len: u64,
    bases: Vec<ChunkHash>,
}

fn in_sample(hash: &ChunkHash, percent: f64) -> bool {
    let position =
        u64::from_le_bytes(hash.0[..8].try_into().expect("8 bytes")) as f64 / u64::MAX as f64;
    position * 100.0 < percent
}

impl RunStore {
    pub async fn verify(
        &self,
        steps: &[StepKey],
        options: &VerifyOptions,
        progress: &dyn Progress,
    ) -> Result<VerifyReport, StoreError> {
        let mut report = VerifyReport {
            steps: steps.to_vec(),
            ..Default::default()
        };
        // Chunk -> (first step that uses it, how).
        let mut uses: HashMap<ChunkHash, (StepKey, ChunkUse)> = HashMap::new();
        for &step in steps {
            let problem = |rank: Option<Rank>, error: &StoreError| Problem {
                run: self.run.clone(),
                step,
                rank,
                item: None,
                name: None,
                chunk: None,
                error: format!("{error}"),
            };
            let commit = match self.load_commit(step).await {
                Ok(commit) => commit,
                Err(error) if error.is_integrity() => {
                    report.problems.push(problem(None, &error));
                    continue;
                }
                Err(error) => return Err(error),
            };
            for shard in &commit.shards {
                let manifest = match self
                    .load_pinned_manifest(step, shard.rank, shard.manifest_blake3)
                    .await
                {
                    Ok(manifest) => manifest,
                    Err(error) if error.is_integrity() => {
                        report.problems.push(problem(Some(shard.rank), &error));
                        continue;
                    }
                    Err(error) => return Err(error),
                };
                report.manifests_checked += 1;
                for (item, name, chunks) in manifest.items() {
                    for chunk in chunks {
                        uses.entry(chunk.hash).or_insert_with(|| {
                            let context = ChunkContext {
                                step,
                                rank: shard.rank,
                                item,
                                name: name.clone(),
                            };
                            (
                                step,
                                ChunkUse {
                                    context,
                                    raw_len: chunk.raw_len,
                                    bases: chunk.bases.clone(),
                                },
                            )
                        });
                    }
                }
            }
        }
        let selected: Vec<(ChunkHash, &ChunkUse)> = uses
            .iter()
            .filter(|(hash, _)| {
                !options.read_data || options.sample_percent.is_none_or(|p| in_sample(hash, p))
            })
            .map(|(hash, (_, chunk_use))| (*hash, chunk_use))
            .collect();
        progress.set_total(if options.read_data {
            selected.iter().map(|(_, u)| u.raw_len).sum()
        } else {
            selected.len() as u64
        });
        let concurrency = self.store.options.download_concurrency.max(1);
        let results: Vec<(ChunkHash, &ChunkUse, Result<u64, StoreError>)> = stream::iter(selected)
            .map(|(hash, chunk_use)| async move {
                let outcome = if options.read_data {
                    self.check_chunk(hash, &chunk_use.context).await
                } else {
                    self.check_present(hash, chunk_use).await.map(|()| 0)
                };
                progress.advance(if options.read_data {
                    chunk_use.raw_len
                } else {
                    1
                });
                (hash, chunk_use, outcome)
            })
            .buffer_unordered(concurrency)
            .collect()
            .await;
        for (hash, chunk_use, outcome) in results {
            report.chunks_checked += 1;
            match outcome {
                Ok(bytes) => report.bytes_read += bytes,
                Err(error) if error.is_integrity() => report.problems.push(Problem {
                    run: self.run.clone(),
                    step: chunk_use.context.step,
                    rank: Some(chunk_use.context.rank),
                    item: Some(chunk_use.context.item.to_string()),
                    name: Some(chunk_use.context.name.clone()),
                    chunk: Some(hash),
                    error: format!("{error}"),
                }),
                Err(error) => return Err(error),
            }
        }
        report
            .problems
            .sort_by(|a, b| (a.step, a.rank, &a.name).cmp(&(b.step, b.rank, &b.name)));
        Ok(report)
    }

    async fn check_present(&self, hash: ChunkHash, chunk_use: &ChunkUse) -> Result<(), StoreError> {
        for current in std::iter::once(hash).chain(chunk_use.bases.iter().copied()) {
            if self
                .store
                .head(&layout::chunk(&self.run, &current))
                .await?
                .is_none()
            {
                return Err(self.missing(current, &chunk_use.context));
            }
        }
        Ok(())
    }
}
