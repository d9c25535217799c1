//! Who leads a job's daemons (DESIGN.md section 4): `runs/<run>/leaders/<epoch>.json`, one
//! create-only record per leadership, and the leader's lease `leaders/lease.json`.
//!
//! The store's create-only write is the one linearizable operation every daemon of the job
//! already shares, so it decides the epoch: whoever creates `leaders/<e>.json` leads epoch
//! `e`, and two daemons that race for the same epoch cannot both win. A leader learns it was
//! deposed by finding the record of the next epoch.

use super::{layout, now_unix_ms, RunStore};
use crate::error::StoreError;
use crate::format::{self, LeaderRecord, LeaseRecord};

impl RunStore {
    /// Tries to lead `epoch` as `node` at `address`: true when this call created the record,
    /// false when another daemon holds that epoch already.
    pub async fn claim_leadership(
        &self,
        epoch: u64,
        node: &str,
        address: &str,
    ) -> Result<bool, StoreError> {
        let record = LeaderRecord {
            run: self.run.clone(),
            epoch,
            node: node.to_string(),
            address: address.to_string(),
            created_unix_ms: now_unix_ms(),
        };
        let (bytes, _) = format::seal(&record);
        self.store
            .put(&layout::leader(&self.run, epoch), bytes.into(), true)
            .await
    }

    /// The record of leadership `epoch`, if it exists.
    pub async fn leadership_at(&self, epoch: u64) -> Result<Option<LeaderRecord>, StoreError> {
        let path = layout::leader(&self.run, epoch);
        match self.store.get(&path).await {
            Ok(bytes) => {
                let (record, _): (LeaderRecord, _) =
                    self.open_object(&bytes, &path, &format!("epoch {epoch}"), "-")?;
                if record.epoch != epoch || record.run != self.run {
                    return Err(StoreError::BadRequest {
                        reason: format!("{path} names run {} epoch {}", record.run, record.epoch),
                    });
                }
                Ok(Some(record))
            }
            Err(StoreError::NotFound { .. }) => Ok(None),
            Err(error) => Err(error),
        }
    }

    /// The newest leadership of the run (one listing and one read), if any.
    pub async fn leadership(&self) -> Result<Option<LeaderRecord>, StoreError> {
        let metas = self.store.list(&layout::leaders_prefix(&self.run)).await?;
        let newest = metas
            .iter()
            .filter_map(|m| layout::file_stem(&m.location, ".json")?.parse::<u64>().ok())
            .max();
        match newest {
            Some(epoch) => self.leadership_at(epoch).await,
            None => Ok(None),
        }
    }

    /// Fails with `Deposed` when a leadership newer than `epoch` exists.
    pub async fn refuse_deposed(&self, epoch: u64) -> Result<(), StoreError> {
        match self.leadership_at(epoch + 1).await? {
            Some(newer) => Err(StoreError::Deposed {
                run: self.run.clone(),
                epoch,
                newer: newer.epoch,
                node: newer.node,
            }),
            None => Ok(()),
        }
    }

    /// Writes the leader's lease (durable on return).
    pub async fn renew_lease(&self, lease: &LeaseRecord) -> Result<(), StoreError> {
        let (bytes, _) = format::seal(lease);
        self.store
            .put(&layout::lease(&self.run), bytes.into(), false)
            .await?;
        Ok(())
    }

    /// The current lease, if a leader ever wrote one (an unreadable one counts as none).
    pub async fn lease(&self) -> Result<Option<LeaseRecord>, StoreError> {
        match self.store.get(&layout::lease(&self.run)).await {
            Ok(bytes) => Ok(format::open::<LeaseRecord>(&bytes).ok().map(|(l, _)| l)),
            Err(StoreError::NotFound { .. }) => Ok(None),
            Err(error) => Err(error),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use object_store::memory::InMemory;

    use crate::format::LeaseRecord;
    use crate::store::testing::open_run;
    use crate::store::RunStore;

    async fn memory_run() -> RunStore {
        open_run(Arc::new(InMemory::new()), "lead", None).await
    }

    #[tokio::test]
    async fn one_claim_wins_each_epoch_and_a_newer_epoch_deposes_the_older() {
        let run = memory_run().await;
        assert_eq!(run.leadership().await.unwrap(), None);
        assert!(run
            .claim_leadership(1, "n1", "127.0.0.1:7001")
            .await
            .unwrap());
        assert!(!run
            .claim_leadership(1, "n2", "127.0.0.1:7002")
            .await
            .unwrap());
        assert_eq!(run.leadership().await.unwrap().unwrap().node, "n1");
        run.refuse_deposed(1).await.unwrap();
        for epoch in 2..=11 {
            assert!(run
                .claim_leadership(epoch, "n2", "127.0.0.1:7002")
                .await
                .unwrap());
        }
        // Epochs sort as numbers, not as text.
        let newest = run.leadership().await.unwrap().unwrap();
        assert_eq!((newest.epoch, newest.node.as_str()), (11, "n2"));
        let error = run.refuse_deposed(1).await.unwrap_err().to_string();
        assert!(error.contains("deposed by epoch 2 (n2)"), "{error}");
        // A commit by a deposed leader is refused before anything is written.
        let error = run
            .commit_as_leader(crate::StepKey::new(3, 0), 1, 10)
            .await
            .unwrap_err()
            .to_string();
        assert!(
            error.contains("epoch 10 was deposed by epoch 11"),
            "{error}"
        );
    }

    #[tokio::test]
    async fn the_lease_is_overwritten_in_place() {
        let run = memory_run().await;
        assert_eq!(run.lease().await.unwrap(), None);
        for renewal in 1..=3 {
            let lease = LeaseRecord {
                epoch: 4,
                node: "n1".into(),
                renewal,
                unix_ms: 1,
            };
            run.renew_lease(&lease).await.unwrap();
            assert_eq!(run.lease().await.unwrap(), Some(lease));
        }
    }
}
