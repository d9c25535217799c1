//! Errors of the store library. Each message carries its cause's text (so a bare `{}` is
//! complete); causes are kept as fields, not chained, so `{:#}` does not repeat them.
//! Integrity failures have their own variants, so callers can
//! tell "storage is down" from "storage returned bad bytes" (`ckptctl` exits 3 for those).

use crate::codec::CodecError;
use crate::format::FormatError;
use crate::hash::ChunkHash;
use crate::ids::{Rank, RunId, StepKey};

#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StoreError {
    #[error("bad store URL {url:?}: {reason}")]
    InvalidUrl { url: String, reason: String },
    #[error("storage {operation} failed for {path}: {cause}")]
    Backend {
        operation: &'static str,
        path: String,
        cause: object_store::Error,
    },
    #[error("{path} does not exist")]
    NotFound { path: String },
    #[error("run {run} does not exist in this store")]
    NoSuchRun { run: RunId },
    #[error("run {run} has no committed step {step}")]
    NotCommitted { run: RunId, step: String },
    #[error("run {run} step {step} is already committed; a committed step is never rewritten")]
    StepAlreadyCommitted { run: RunId, step: StepKey },
    #[error("run {run}: the leader of epoch {epoch} was deposed by epoch {newer} ({node}); it no longer acts")]
    Deposed {
        run: RunId,
        epoch: u64,
        newer: u64,
        node: String,
    },
    #[error(
        "run {run} step {step} cannot be committed: shard manifests missing for ranks {missing:?}"
    )]
    IncompleteStep {
        run: RunId,
        step: StepKey,
        missing: Vec<Rank>,
    },
    #[error("run {run} step {step} belongs to timeline {step_timeline}, but the run was rolled back (timeline {current}); restart from the latest step")]
    RolledBack {
        run: RunId,
        step: StepKey,
        step_timeline: u32,
        current: u32,
    },
    #[error("run {run} step {step}: no tensor or blob named {name:?}{}", rank.map(|r| format!(" on rank {r}")).unwrap_or_default())]
    NoSuchTensor {
        run: RunId,
        step: StepKey,
        rank: Option<Rank>,
        name: String,
    },
    #[error("{path} is held by {holder} until {expires}; wait for it, or remove it if that process is gone")]
    Locked {
        path: String,
        holder: String,
        expires: String,
    },
    #[error("{reason}")]
    BadRequest { reason: String },
    #[error("run {run} step {step} rank {rank}: {path}: {cause}")]
    Format {
        run: RunId,
        step: String,
        rank: String,
        path: String,
        cause: FormatError,
    },
    #[error("run {run} step {step} rank {rank}: manifest {path} hashes to {found}, but the commit pinned {expected}")]
    ManifestMismatch {
        run: RunId,
        step: StepKey,
        rank: Rank,
        path: String,
        expected: ChunkHash,
        found: ChunkHash,
    },
    #[error(
        "run {run} step {step} rank {rank} {item} {name:?}: chunk {chunk} is missing from storage"
    )]
    ChunkMissing {
        run: RunId,
        step: StepKey,
        rank: Rank,
        item: &'static str,
        name: String,
        chunk: ChunkHash,
    },
    #[error(
        "run {run} step {step} rank {rank} {item} {name:?}: chunk {chunk} is corrupt: {cause}"
    )]
    ChunkCorrupt {
        run: RunId,
        step: StepKey,
        rank: Rank,
        item: &'static str,
        name: String,
        chunk: ChunkHash,
        cause: CodecError,
    },
    #[error("local index at {path}: {cause}")]
    Index { path: String, cause: sled::Error },
    #[error("{path}: {cause}")]
    Io { path: String, cause: std::io::Error },
}

impl StoreError {
    /// True when storage returned bytes that fail verification, or data a commit promised is
    /// gone: the problems `ckptctl` reports with exit code 3.
    pub fn is_integrity(&self) -> bool {
        matches!(
            self,
            StoreError::Format { .. }
                | StoreError::ManifestMismatch { .. }
                | StoreError::ChunkMissing { .. }
                | StoreError::ChunkCorrupt { .. }
        )
    }

    /// True when the caller asked for something that cannot be: bad URL, unknown run or step,
    /// a request that does not fit the checkpoint (`ckptctl` exits 2).
    pub fn is_bad_input(&self) -> bool {
        matches!(
            self,
            StoreError::InvalidUrl { .. }
                | StoreError::NoSuchRun { .. }
                | StoreError::NotCommitted { .. }
                | StoreError::NoSuchTensor { .. }
                | StoreError::BadRequest { .. }
                | StoreError::StepAlreadyCommitted { .. }
        )
    }

    pub(crate) fn backend(
        operation: &'static str,
        path: &object_store::path::Path,
        source: object_store::Error,
    ) -> Self {
        match source {
            object_store::Error::NotFound { .. } => StoreError::NotFound {
                path: path.to_string(),
            },
            cause => StoreError::Backend {
                operation,
                path: path.to_string(),
                cause,
            },
        }
    }
}
