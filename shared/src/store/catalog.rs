//! What a run holds: its steps and their states, its rollbacks, and which step is `latest`.
//!
//! `latest` is never stored: it is the highest step with a valid commit record that no
//! rollback hides.

use std::collections::BTreeMap;

use futures::stream::{self, StreamExt};
use serde::Serialize;

use super::{layout, now_unix_ms, RunStore};
use crate::error::StoreError;
use crate::format::{self, CommitRecord, RollbackRecord};
use crate::ids::{Rank, StepKey};

#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(tag = "state", rename_all = "kebab-case")]
pub enum StepState {
    /// A valid commit record exists and no rollback hides it.
    Committed,
    /// Committed, but hidden by the rollback with this sequence number.
    RolledBack { by: u32 },
    /// Shard manifests exist but no commit record: a write in progress or one that died.
    Incomplete { ranks_present: Vec<Rank> },
    /// The commit record exists but cannot be read or fails its checksum.
    Damaged { reason: String },
}

#[derive(Clone, Debug, Serialize)]
pub struct StepStatus {
    pub step: StepKey,
    #[serde(flatten)]
    pub state: StepState,
    pub world_size: Option<u32>,
    pub raw_bytes: u64,
    /// Bytes this step added to storage (chunks it did not share with earlier writes).
    pub uploaded_bytes: u64,
    pub created_unix_ms: Option<u64>,
}

#[derive(Clone, Debug, Serialize)]
pub struct Catalog {
    pub steps: Vec<StepStatus>,
    pub rollbacks: Vec<RollbackRecord>,
    pub latest: Option<StepKey>,
    pub timeline: u32,
}

impl Catalog {
    pub fn visible_commits(&self) -> impl Iterator<Item = &StepStatus> {
        self.steps
            .iter()
            .filter(|s| s.state == StepState::Committed)
    }
}

impl RunStore {
    pub async fn load_commit(&self, step: StepKey) -> Result<CommitRecord, StoreError> {
        let path = layout::commit(&self.run, step);
        let bytes = match self.store.get(&path).await {
            Ok(bytes) => bytes,
            Err(StoreError::NotFound { .. }) => {
                return Err(StoreError::NotCommitted {
                    run: self.run.clone(),
                    step: step.to_string(),
                })
            }
            Err(e) => return Err(e),
        };
        let (record, _): (CommitRecord, _) =
            self.open_object(&bytes, &path, &step.to_string(), "-")?;
        if record.run != self.run || record.step != step {
            return Err(StoreError::Format {
                run: self.run.clone(),
                step: step.to_string(),
                rank: "-".into(),
                path: path.to_string(),
                cause: format::FormatError::Invalid {
                    what: "commit record".into(),
                    reason: format!("it names run {} step {}", record.run, record.step),
                },
            });
        }
        Ok(record)
    }

    /// All rollback records, by sequence number. A damaged one is an error: without it we
    /// cannot know what is hidden.
    pub async fn rollbacks(&self) -> Result<Vec<RollbackRecord>, StoreError> {
        let mut records = Vec::new();
        for meta in self
            .store
            .list(&layout::rollbacks_prefix(&self.run))
            .await?
        {
            let bytes = self.store.get(&meta.location).await?;
            let (record, _): (RollbackRecord, _) =
                self.open_object(&bytes, &meta.location, "-", "-")?;
            records.push(record);
        }
        records.sort_by_key(|r| r.seq);
        Ok(records)
    }

    /// The timeline new steps are written on: the number of rollbacks so far.
    pub async fn current_timeline(&self) -> Result<u32, StoreError> {
        Ok(self.rollbacks().await?.last().map_or(0, |r| r.seq))
    }

    async fn load_commit_of(&self, step: StepKey) -> (StepKey, Result<CommitRecord, StoreError>) {
        (step, self.load_commit(step).await)
    }

    async fn list_step(
        &self,
        step: StepKey,
    ) -> (StepKey, Result<Vec<object_store::ObjectMeta>, StoreError>) {
        let listing = self.store.list(&layout::shard_dir(&self.run, step)).await;
        (step, listing)
    }

    pub async fn catalog(&self) -> Result<Catalog, StoreError> {
        self.info().await?;
        let rollbacks = self.rollbacks().await?;
        let committed: Vec<StepKey> = self
            .store
            .list(&layout::commits_prefix(&self.run))
            .await?
            .iter()
            .filter_map(|meta| {
                layout::file_stem(&meta.location, ".json").and_then(StepKey::parse_object_name)
            })
            .collect();
        // Commit records read concurrently: a long run has tens of thousands.
        let loaded = stream::iter(committed)
            .map(|step| self.load_commit_of(step))
            .buffered(self.store.options.metadata_concurrency.max(1))
            .collect::<Vec<_>>()
            .await;
        let mut steps: BTreeMap<StepKey, StepStatus> = BTreeMap::new();
        for (step, loaded) in loaded {
            let status = match loaded {
                Ok(record) => StepStatus {
                    step,
                    state: match rollbacks.iter().find(|r| r.hides(step)) {
                        Some(rollback) => StepState::RolledBack { by: rollback.seq },
                        None => StepState::Committed,
                    },
                    world_size: Some(record.world_size),
                    raw_bytes: record.raw_bytes(),
                    uploaded_bytes: record.uploaded_bytes(),
                    created_unix_ms: Some(record.created_unix_ms),
                },
                Err(error) if error.is_integrity() => StepStatus {
                    step,
                    state: StepState::Damaged {
                        reason: format!("{error}"),
                    },
                    world_size: None,
                    raw_bytes: 0,
                    uploaded_bytes: 0,
                    created_unix_ms: None,
                },
                Err(error) => return Err(error),
            };
            steps.insert(step, status);
        }
        // Steps with manifests but no commit record are incomplete. Their folders come from
        // one delimited listing (a page per 1,000 steps); only theirs are listed for the ranks
        // present, not the manifests of every committed step.
        let uncommitted: Vec<StepKey> = self
            .store
            .list_folders(&layout::shards_prefix(&self.run))
            .await?
            .iter()
            .filter_map(|folder| StepKey::parse_object_name(folder.filename()?))
            .filter(|step| !steps.contains_key(step))
            .collect();
        let listed = stream::iter(uncommitted)
            .map(|step| self.list_step(step))
            .buffered(self.store.options.metadata_concurrency.max(1))
            .collect::<Vec<_>>()
            .await;
        for (step, listing) in listed {
            let mut ranks_present = Vec::new();
            let mut created_unix_ms = None;
            for meta in listing? {
                let Some((_, rank)) = layout::parse_shard(&meta.location) else {
                    continue;
                };
                ranks_present.push(rank);
                created_unix_ms.get_or_insert(meta.last_modified.timestamp_millis().max(0) as u64);
            }
            // A folder emptied by gc is not a step.
            if ranks_present.is_empty() {
                continue;
            }
            ranks_present.sort_unstable();
            steps.insert(
                step,
                StepStatus {
                    step,
                    state: StepState::Incomplete { ranks_present },
                    world_size: None,
                    raw_bytes: 0,
                    uploaded_bytes: 0,
                    created_unix_ms,
                },
            );
        }
        let latest = steps
            .values()
            .filter(|s| s.state == StepState::Committed)
            .map(|s| s.step)
            .max_by_key(|step| (step.step, step.timeline));
        let timeline = rollbacks.last().map_or(0, |r| r.seq);
        let mut steps: Vec<StepStatus> = steps.into_values().collect();
        steps.sort_by_key(|s| (s.step.step, s.step.timeline));
        Ok(Catalog {
            steps,
            rollbacks,
            latest,
            timeline,
        })
    }

    /// The newest visible committed step, if any: the same answer as the catalog's, but it
    /// reads commit records newest first and stops at the first valid one, so it costs one
    /// listing and a read or two however long the run is (restores and the leader ask it).
    pub async fn latest(&self) -> Result<Option<StepKey>, StoreError> {
        self.info().await?;
        let rollbacks = self.rollbacks().await?;
        let mut steps: Vec<StepKey> = self
            .store
            .list(&layout::commits_prefix(&self.run))
            .await?
            .iter()
            .filter_map(|meta| {
                layout::file_stem(&meta.location, ".json").and_then(StepKey::parse_object_name)
            })
            .filter(|step| !rollbacks.iter().any(|r| r.hides(*step)))
            .collect();
        steps.sort_unstable();
        for step in steps.into_iter().rev() {
            match self.load_commit(step).await {
                Ok(_) => return Ok(Some(step)),
                Err(error) if error.is_integrity() => continue,
                Err(error) => return Err(error),
            }
        }
        Ok(None)
    }

    /// Resolves an operator's step argument: `latest`, a step number (the visible commit with
    /// that number, else the newest hidden one), or `<step>-t<timeline>`.
    pub async fn resolve_step(&self, text: &str) -> Result<StepKey, StoreError> {
        let catalog = self.catalog().await?;
        let not_committed = || StoreError::NotCommitted {
            run: self.run.clone(),
            step: text.to_string(),
        };
        if text == "latest" {
            return catalog.latest.ok_or_else(not_committed);
        }
        let (number, timeline) = match text.split_once("-t") {
            Some((step, timeline)) => (
                step,
                Some(timeline.parse::<u32>().map_err(|_| not_committed())?),
            ),
            None => (text, None),
        };
        let number: u64 = number.parse().map_err(|_| StoreError::BadRequest {
            reason: format!("{text:?} is not a step: use a number, N-tT or 'latest'"),
        })?;
        let candidates = catalog
            .steps
            .iter()
            .filter(|s| s.step.step == number && timeline.is_none_or(|t| s.step.timeline == t));
        let committed: Vec<&super::StepStatus> = candidates
            .filter(|s| {
                matches!(
                    s.state,
                    StepState::Committed | StepState::RolledBack { .. } | StepState::Damaged { .. }
                )
            })
            .collect();
        committed
            .iter()
            .find(|s| s.state == StepState::Committed)
            .or_else(|| committed.iter().max_by_key(|s| s.step.timeline))
            .map(|s| s.step)
            .ok_or_else(not_committed)
    }

    /// Hides every step after `to` and starts a new timeline. Deletes nothing.
    pub async fn rollback(
        &self,
        to: StepKey,
        reason: &str,
        operator: &str,
    ) -> Result<RollbackRecord, StoreError> {
        for _attempt in 0..8 {
            let catalog = self.catalog().await?;
            let target = catalog.steps.iter().find(|s| s.step == to);
            if target.map(|t| &t.state) != Some(&StepState::Committed) {
                return Err(StoreError::BadRequest {
                    reason: format!(
                        "step {to} is not a visible committed step of run {}; see `ckptctl list`",
                        self.run
                    ),
                });
            }
            let record = RollbackRecord {
                run: self.run.clone(),
                seq: catalog.timeline + 1,
                to,
                reason: reason.to_string(),
                operator: operator.to_string(),
                created_unix_ms: now_unix_ms(),
            };
            let (bytes, _) = format::seal(&record);
            if self
                .store
                .put(&layout::rollback(&self.run, record.seq), bytes.into(), true)
                .await?
            {
                tracing::warn!(run = %self.run, to = %to, seq = record.seq, reason, "rolled back");
                return Ok(record);
            }
            // Another rollback took this sequence number first: look again.
        }
        Err(StoreError::BadRequest {
            reason: "concurrent rollbacks kept colliding; try again".into(),
        })
    }
}
