//! Exclusive-operation locks: create-only objects under `locks/` with an expiry.
//!
//! Taking a lock is one create-only put. A lock past its expiry may be broken by deleting it;
//! after creating its own record a taker reads it back and gives up if someone else's record is
//! there (two breakers racing), so at most one holder proceeds.

use std::time::Duration;

use object_store::path::Path;

use super::{layout, now_unix_ms, RunStore};
use crate::error::StoreError;
use crate::format::{self, LockRecord};

/// A held lock. Release it with [`LockGuard::release`]; a guard that is dropped instead (a
/// crash) leaves the record to expire.
#[derive(Debug)]
pub struct LockGuard {
    run: RunStore,
    path: Path,
    pub record: LockRecord,
}

impl LockGuard {
    /// True while the lock has not expired, with `margin_ms` to spare.
    pub fn is_valid(&self, margin_ms: u64) -> bool {
        now_unix_ms() + margin_ms < self.record.expires_unix_ms
    }

    pub async fn release(self) -> Result<(), StoreError> {
        if let Some(current) = self.run.read_lock(&self.path).await? {
            if current.owner == self.record.owner {
                self.run.store.delete(&self.path).await?;
            }
        }
        Ok(())
    }
}

/// RFC 3339 time, UTC, seconds precision.
pub(crate) fn render_time(unix_ms: u64) -> String {
    let time = std::time::UNIX_EPOCH + Duration::from_millis(unix_ms);
    humantime::format_rfc3339_seconds(time).to_string()
}

impl RunStore {
    pub(crate) async fn read_lock(&self, path: &Path) -> Result<Option<LockRecord>, StoreError> {
        match self.store.get(path).await {
            Ok(bytes) => Ok(format::open::<LockRecord>(&bytes)
                .ok()
                .map(|(record, _)| record)),
            Err(StoreError::NotFound { .. }) => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// Takes the lock `name` for `purpose`, or fails with `Locked` naming the holder.
    pub async fn lock(&self, name: &str, purpose: &str) -> Result<LockGuard, StoreError> {
        let path = layout::lock(&self.run, name);
        let now = now_unix_ms();
        let record = LockRecord {
            owner: format!("{:016x}", rand::random::<u64>()),
            purpose: purpose.to_string(),
            host: std::env::var("HOSTNAME").unwrap_or_else(|_| "unknown".into()),
            pid: std::process::id(),
            created_unix_ms: now,
            expires_unix_ms: now + self.store.options.lock_ttl_ms,
        };
        let (bytes, _) = format::seal(&record);
        for _attempt in 0..3 {
            if self.store.put(&path, bytes.clone().into(), true).await? {
                tokio::time::sleep(Duration::from_millis(20)).await;
                return match self.read_lock(&path).await? {
                    Some(current) if current.owner == record.owner => Ok(LockGuard {
                        run: self.clone(),
                        path,
                        record,
                    }),
                    other => Err(self.locked(&path, other)),
                };
            }
            match self.read_lock(&path).await? {
                Some(current) if current.expires_unix_ms > now_unix_ms() => {
                    return Err(self.locked(&path, Some(current)))
                }
                // Expired or unreadable: break it and try again.
                _ => {
                    tracing::warn!(path = %path, "breaking an expired lock");
                    self.store.delete(&path).await?;
                }
            }
        }
        Err(self.locked(&path, None))
    }

    fn locked(&self, path: &Path, holder: Option<LockRecord>) -> StoreError {
        match holder {
            Some(h) => StoreError::Locked {
                path: path.to_string(),
                holder: format!(
                    "{} (pid {} on {}, owner {})",
                    h.purpose, h.pid, h.host, h.owner
                ),
                expires: render_time(h.expires_unix_ms),
            },
            None => StoreError::Locked {
                path: path.to_string(),
                holder: "another process".into(),
                expires: "soon".into(),
            },
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn rfc3339_rendering() {
        assert_eq!(super::render_time(0), "1970-01-01T00:00:00Z");
        assert_eq!(
            super::render_time(1_000_000_000_000),
            "2001-09-09T01:46:40Z"
        );
    }
}
