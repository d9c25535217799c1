//! Object keys of a run (DESIGN.md section 2). Keys are built only from validated ids.

use object_store::path::Path;

use crate::hash::ChunkHash;
use crate::ids::{Rank, RunId, StepKey};

pub const RUNS: &str = "runs";

pub fn run_json(run: &RunId) -> Path {
    Path::from(format!("{RUNS}/{run}/run.json"))
}

pub fn chunks_prefix(run: &RunId) -> Path {
    Path::from(format!("{RUNS}/{run}/chunks"))
}

pub fn chunk(run: &RunId, hash: &ChunkHash) -> Path {
    let hex = hash.to_hex();
    Path::from(format!("{RUNS}/{run}/chunks/{}/{hex}", &hex[..2]))
}

pub fn shards_prefix(run: &RunId) -> Path {
    Path::from(format!("{RUNS}/{run}/shards"))
}

pub fn shard_dir(run: &RunId, step: StepKey) -> Path {
    Path::from(format!("{RUNS}/{run}/shards/{}", step.object_name()))
}

pub fn shard(run: &RunId, step: StepKey, rank: Rank) -> Path {
    Path::from(format!(
        "{RUNS}/{run}/shards/{}/{rank:06}.json",
        step.object_name()
    ))
}

pub fn commits_prefix(run: &RunId) -> Path {
    Path::from(format!("{RUNS}/{run}/commits"))
}

pub fn commit(run: &RunId, step: StepKey) -> Path {
    Path::from(format!("{RUNS}/{run}/commits/{}.json", step.object_name()))
}

pub fn rollbacks_prefix(run: &RunId) -> Path {
    Path::from(format!("{RUNS}/{run}/rollbacks"))
}

pub fn rollback(run: &RunId, seq: u32) -> Path {
    Path::from(format!("{RUNS}/{run}/rollbacks/{seq:06}.json"))
}

pub fn events_prefix(run: &RunId) -> Path {
    Path::from(format!("{RUNS}/{run}/events"))
}

/// One supervisor event; the name sorts by time.
pub fn event(run: &RunId, unix_ms: u64, sequence: u64) -> Path {
    Path::from(format!(
        "{RUNS}/{run}/events/{unix_ms:014}-{sequence:08}.json"
    ))
}

pub fn leaders_prefix(run: &RunId) -> Path {
    Path::from(format!("{RUNS}/{run}/leaders"))
}

/// The record of leadership `epoch` (create-only; the name sorts by epoch).
pub fn leader(run: &RunId, epoch: u64) -> Path {
    Path::from(format!("{RUNS}/{run}/leaders/{epoch:012}.json"))
}

/// The current leader's lease, overwritten while it leads.
pub fn lease(run: &RunId) -> Path {
    Path::from(format!("{RUNS}/{run}/leaders/lease.json"))
}

pub fn lock(run: &RunId, name: &str) -> Path {
    Path::from(format!("{RUNS}/{run}/locks/{name}.json"))
}

/// The last path segment with `suffix` removed, e.g. the step in `commits/<step>.json`.
pub fn file_stem<'a>(path: &'a Path, suffix: &str) -> Option<&'a str> {
    path.filename()?.strip_suffix(suffix)
}

/// Parses `.../shards/<step>/<rank>.json`.
pub fn parse_shard(path: &Path) -> Option<(StepKey, Rank)> {
    let mut parts: Vec<_> = path.parts().collect();
    let rank_part = parts.pop()?;
    let step_part = parts.pop()?;
    let rank_text = rank_part.as_ref().strip_suffix(".json")?;
    if rank_text.len() != 6 || !rank_text.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    Some((
        StepKey::parse_object_name(step_part.as_ref())?,
        rank_text.parse().ok()?,
    ))
}

/// Parses `.../chunks/<hh>/<hex>`.
pub fn parse_chunk(path: &Path) -> Option<ChunkHash> {
    path.filename()?.parse().ok()
}
