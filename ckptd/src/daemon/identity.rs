//! What the daemon's shm directory for its run says of the daemon itself, beside the
//! snapshots it keeps there across a restart: which daemon's state it is (`instance`, drawn at
//! random when the directory has none) and the last of the supervisor's rollbacks whose
//! abandoned snapshots and replicas were forgotten here (a mark of that run's leaders). A leader tells a daemon that held snapshots through a
//! rollback, and has not forgotten them, from one whose state began after it by these two.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use lazarus_shared::wire::RollbackMark;
use serde::{Deserialize, Serialize};

use super::Config;

const FILE_NAME: &str = "daemon.json";

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Identity {
    /// Never 0 (0 is "not said" on the wire).
    pub instance: u64,
    /// The last rollback whose abandoned snapshots and replicas this state forgot.
    pub forgotten: RollbackMark,
}

/// Where the run's identity is kept: beside its ranks' and replicas' directories.
pub fn dir(cfg: &Config) -> PathBuf {
    cfg.shm_dir.join(cfg.run.as_str())
}

fn path(dir: &Path) -> PathBuf {
    dir.join(FILE_NAME)
}

/// The identity in `dir`, or a new one written there when it has none. One that does not
/// read is replaced (with a warning): the state it named is taken as new. A new one that
/// cannot be written (a full shm) is used all the same, with an error logged: a restart will
/// take the state as new again.
pub fn load_or_create(dir: &Path) -> Result<Identity> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let path = path(dir);
    match std::fs::read(&path) {
        Ok(bytes) => match serde_json::from_slice::<Identity>(&bytes) {
            Ok(identity) if identity.instance != 0 => return Ok(identity),
            Ok(_) => {
                tracing::warn!(path = %path.display(), "an identity with instance 0; drawing a new one")
            }
            Err(error) => {
                tracing::warn!(path = %path.display(), %error, "an unreadable identity; drawing a new one")
            }
        },
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => {}
        Err(error) => return Err(error).with_context(|| format!("reading {}", path.display())),
    }
    let identity = Identity {
        instance: rand::random::<u64>().max(1),
        forgotten: RollbackMark::default(),
    };
    if let Err(error) = store(dir, &identity) {
        tracing::error!(error = %format!("{error:#}"), "cannot keep the daemon's identity in shm; a restart will take its state as new");
    }
    Ok(identity)
}

/// Writes `identity` to `dir` (a new file renamed over the old), making `dir` if it is gone.
pub fn store(dir: &Path, identity: &Identity) -> Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    super::slots::replace_file(&path(dir), &serde_json::to_vec(identity)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A restarted daemon finds the identity and the forgotten rollback its state had; a
    /// damaged file gives a new instance.
    #[test]
    fn the_identity_outlives_a_restart_and_a_damaged_one_is_replaced() {
        let dir = tempfile::tempdir().unwrap();
        let first = load_or_create(dir.path()).unwrap();
        assert_ne!(first.instance, 0);
        assert_eq!(load_or_create(dir.path()).unwrap(), first);
        let forgot = Identity {
            forgotten: RollbackMark { epoch: 3, seq: 2 },
            ..first
        };
        store(dir.path(), &forgot).unwrap();
        assert_eq!(load_or_create(dir.path()).unwrap(), forgot);
        std::fs::write(path(dir.path()), b"{ not json").unwrap();
        let replaced = load_or_create(dir.path()).unwrap();
        assert_ne!(replaced.instance, first.instance);
        assert_eq!(replaced.forgotten, RollbackMark::default());
        assert_eq!(load_or_create(dir.path()).unwrap(), replaced);
    }
}
