//! The supervisor's timeline of a run (`runs/<run>/events/`): one small JSON object per event,
//! named by time, never rewritten. Operators read it with `ckptctl events`.

use super::{layout, RunStore};
use crate::error::StoreError;
use crate::wire::Event;

impl RunStore {
    /// Stores one event (durable on return).
    pub async fn put_event(&self, event: &Event, sequence: u64) -> Result<(), StoreError> {
        let bytes = serde_json::to_vec(event).expect("events serialise");
        self.store
            .put(
                &layout::event(&self.run, event.unix_ms, sequence),
                bytes.into(),
                false,
            )
            .await?;
        Ok(())
    }

    /// Every event of the run, oldest first. Unreadable entries are skipped with a warning.
    pub async fn events(&self) -> Result<Vec<Event>, StoreError> {
        let mut metas = self.store.list(&layout::events_prefix(&self.run)).await?;
        metas.sort_by(|a, b| a.location.as_ref().cmp(b.location.as_ref()));
        let mut events = Vec::with_capacity(metas.len());
        for meta in metas {
            let bytes = self.store.get(&meta.location).await?;
            match serde_json::from_slice::<Event>(&bytes) {
                Ok(event) => events.push(event),
                Err(error) => {
                    tracing::warn!(path = %meta.location, %error, "skipping an unreadable event")
                }
            }
        }
        Ok(events)
    }
}
