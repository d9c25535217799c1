//! The JSON objects of a run: `run.json`, shard manifests, commit records, rollback records
//! and locks.
//!
//! Every object is an envelope `{"format_version", "kind", "blake3", "body"}`. `blake3` is the
//! hash of the body's exact bytes, so a damaged or edited object is caught before its body is
//! trusted, and a commit can pin each shard manifest by that hash. A reader refuses a
//! `format_version` it does not know before it looks at anything else.
//!
//! This module only (de)serialises and validates; it knows nothing of object keys or IO.

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;

use crate::codec::{Codec, CHUNK_RAW_BYTES_MAX, DELTA_DEPTH_MAX};
use crate::hash::ChunkHash;
use crate::ids::{Rank, RunId, StepKey, STEP_MAX};

pub const FORMAT_VERSION: u32 = 1;
/// Bounds that keep a hostile manifest from asking for absurd work.
pub const TENSORS_PER_SHARD_MAX: usize = 1 << 20;
pub const NAME_BYTES_MAX: usize = 1024;
pub const DIMS_MAX: usize = 16;
/// Ranks are named with 6 digits in object keys (`000123.json`), and the parsers read no other
/// width: ranks stay below 1,000,000.
pub const WORLD_SIZE_MAX: u32 = 1_000_000;
pub const OBJECT_BYTES_MAX: usize = 1 << 30;

/// What is wrong with a stored JSON object.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum FormatError {
    #[error("format version {found} is not supported (this build reads version {FORMAT_VERSION}); upgrade Lazarus to read it")]
    UnknownVersion { found: u64 },
    #[error("expected a {expected} object, found {found:?}")]
    WrongKind {
        expected: &'static str,
        found: String,
    },
    #[error("object body hashes to {found}, its envelope says {expected}")]
    ChecksumMismatch { expected: String, found: ChunkHash },
    #[error("malformed JSON: {0}")]
    Json(#[from] serde_json::Error),
    #[error("object is {len} bytes, more than the {OBJECT_BYTES_MAX} allowed")]
    TooLarge { len: usize },
    #[error("invalid {what}: {reason}")]
    Invalid { what: String, reason: String },
}

fn invalid(what: impl Into<String>, reason: impl Into<String>) -> FormatError {
    FormatError::Invalid {
        what: what.into(),
        reason: reason.into(),
    }
}

#[derive(Serialize)]
struct EnvelopeOut<'a> {
    format_version: u32,
    kind: &'a str,
    blake3: String,
    body: &'a RawValue,
}

#[derive(Deserialize)]
struct VersionOnly {
    format_version: u64,
}

#[derive(Deserialize)]
struct EnvelopeIn<'a> {
    kind: String,
    blake3: String,
    #[serde(borrow)]
    body: &'a RawValue,
}

/// A stored object body: something that knows its kind and can check itself.
pub trait Object: Serialize + DeserializeOwned {
    const KIND: &'static str;
    fn validate(&self) -> Result<(), FormatError>;
}

/// Serialises `object` into its envelope. Returns the bytes and the body hash.
pub fn seal<T: Object>(object: &T) -> (Vec<u8>, ChunkHash) {
    let body = serde_json::to_string(object).expect("format types always serialise");
    let hash = ChunkHash::of(body.as_bytes());
    let raw = RawValue::from_string(body).expect("serde_json output is valid JSON");
    let envelope = EnvelopeOut {
        format_version: FORMAT_VERSION,
        kind: T::KIND,
        blake3: hash.to_hex(),
        body: &raw,
    };
    (
        serde_json::to_vec(&envelope).expect("envelope serialises"),
        hash,
    )
}

/// Checks the envelope (version first, then kind and hash), parses and validates the body.
/// Returns the object and its body hash.
pub fn open<T: Object>(bytes: &[u8]) -> Result<(T, ChunkHash), FormatError> {
    if bytes.len() > OBJECT_BYTES_MAX {
        return Err(FormatError::TooLarge { len: bytes.len() });
    }
    let version: VersionOnly = serde_json::from_slice(bytes)?;
    if version.format_version != u64::from(FORMAT_VERSION) {
        return Err(FormatError::UnknownVersion {
            found: version.format_version,
        });
    }
    let envelope: EnvelopeIn<'_> = serde_json::from_slice(bytes)?;
    if envelope.kind != T::KIND {
        return Err(FormatError::WrongKind {
            expected: T::KIND,
            found: envelope.kind.chars().take(64).collect(),
        });
    }
    let found = ChunkHash::of(envelope.body.get().as_bytes());
    if found.to_hex() != envelope.blake3 {
        return Err(FormatError::ChecksumMismatch {
            expected: envelope.blake3.chars().take(64).collect(),
            found,
        });
    }
    let object: T = serde_json::from_str(envelope.body.get())?;
    object.validate()?;
    Ok((object, found))
}

/// Element types, named as safetensors names them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[allow(clippy::upper_case_acronyms, non_camel_case_types)]
pub enum DType {
    BOOL,
    U8,
    I8,
    F8_E4M3,
    F8_E5M2,
    F8_E8M0,
    I16,
    U16,
    F16,
    BF16,
    I32,
    U32,
    F32,
    I64,
    U64,
    F64,
    C64,
}

impl DType {
    pub fn element_bytes(self) -> usize {
        match self {
            DType::BOOL
            | DType::U8
            | DType::I8
            | DType::F8_E4M3
            | DType::F8_E5M2
            | DType::F8_E8M0 => 1,
            DType::I16 | DType::U16 | DType::F16 | DType::BF16 => 2,
            DType::I32 | DType::U32 | DType::F32 => 4,
            DType::I64 | DType::U64 | DType::F64 | DType::C64 => 8,
        }
    }

    pub fn name(self) -> String {
        format!("{self:?}")
    }
}

/// One dimension of the hyper-rectangle of a tensor that a rank holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct DimRange {
    pub start: u64,
    pub len: u64,
}

/// A stored chunk as a manifest refers to it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChunkRef {
    pub hash: ChunkHash,
    pub raw_len: u64,
    /// Size of the chunk object in storage (header included).
    pub stored_len: u64,
    pub codec: Codec,
    /// The delta chain below this chunk, nearest base first; empty unless `codec` is a delta.
    /// Garbage collection keeps every chunk listed here alive with the referring chunk.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub bases: Vec<ChunkHash>,
}

/// One tensor (or the slice of it that this rank holds).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TensorEntry {
    pub name: String,
    pub dtype: DType,
    pub global_shape: Vec<u64>,
    /// Which part of the global tensor this rank holds; the bytes are that part, row-major.
    pub slice: Vec<DimRange>,
    pub raw_bytes: u64,
    pub chunks: Vec<ChunkRef>,
}

impl TensorEntry {
    /// True when this entry holds the whole global tensor.
    pub fn is_whole(&self) -> bool {
        self.slice
            .iter()
            .zip(&self.global_shape)
            .all(|(range, dim)| range.start == 0 && range.len == *dim)
    }
}

/// An opaque byte string stored with a shard: data-loader position, RNG state, file headers.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct BlobEntry {
    pub name: String,
    pub raw_bytes: u64,
    pub chunks: Vec<ChunkRef>,
}

/// Everything one rank stored for one step. Stored at `shards/<step>/<rank>.json`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShardManifest {
    pub run: RunId,
    pub step: StepKey,
    pub rank: Rank,
    pub world_size: u32,
    pub created_unix_ms: u64,
    pub tensors: Vec<TensorEntry>,
    pub blobs: Vec<BlobEntry>,
    /// Bytes of chunk objects this shard's writer actually uploaded (the rest deduplicated).
    pub uploaded_bytes: u64,
}

impl ShardManifest {
    pub fn raw_bytes(&self) -> u64 {
        self.tensors.iter().map(|t| t.raw_bytes).sum::<u64>()
            + self.blobs.iter().map(|b| b.raw_bytes).sum::<u64>()
    }

    /// Stored size of every chunk this shard refers to, counting each distinct chunk once.
    pub fn stored_bytes(&self) -> u64 {
        let mut seen = std::collections::HashSet::new();
        self.chunk_refs()
            .filter(|c| seen.insert(c.hash))
            .map(|c| c.stored_len)
            .sum()
    }

    pub fn chunk_refs(&self) -> impl Iterator<Item = &ChunkRef> {
        self.tensors
            .iter()
            .flat_map(|t| &t.chunks)
            .chain(self.blobs.iter().flat_map(|b| &b.chunks))
    }

    /// Every tensor and blob as (`"tensor"` or `"blob"`, name, chunks).
    pub fn items(&self) -> impl Iterator<Item = (&'static str, &String, &Vec<ChunkRef>)> {
        let tensors = self.tensors.iter().map(|t| ("tensor", &t.name, &t.chunks));
        tensors.chain(self.blobs.iter().map(|b| ("blob", &b.name, &b.chunks)))
    }

    /// Whether `other` stores the same shard the same way: everything but when it was
    /// written and how many bytes its writer had to upload.
    pub fn same_shard(&self, other: &ShardManifest) -> bool {
        self.run == other.run
            && self.step == other.step
            && self.rank == other.rank
            && self.world_size == other.world_size
            && self.tensors == other.tensors
            && self.blobs == other.blobs
    }

    pub fn tensor(&self, name: &str) -> Option<&TensorEntry> {
        self.tensors.iter().find(|t| t.name == name)
    }

    pub fn blob(&self, name: &str) -> Option<&BlobEntry> {
        self.blobs.iter().find(|b| b.name == name)
    }
}

fn validate_name(what: &str, name: &str) -> Result<(), FormatError> {
    if name.is_empty() || name.len() > NAME_BYTES_MAX || name.chars().any(char::is_control) {
        return Err(invalid(
            what,
            format!(
                "name {:?} is empty, too long or has control characters",
                name.chars().take(80).collect::<String>()
            ),
        ));
    }
    Ok(())
}

fn validate_chunks(what: &str, chunks: &[ChunkRef], raw_bytes: u64) -> Result<(), FormatError> {
    let mut total: u64 = 0;
    for chunk in chunks {
        if chunk.raw_len > CHUNK_RAW_BYTES_MAX || chunk.bases.len() > usize::from(DELTA_DEPTH_MAX) {
            return Err(invalid(
                what,
                format!(
                    "chunk {} is too large or its delta chain too deep",
                    chunk.hash
                ),
            ));
        }
        if chunk.codec.is_delta() == chunk.bases.is_empty() {
            return Err(invalid(
                what,
                format!(
                    "chunk {} has codec {} but {} delta bases",
                    chunk.hash,
                    chunk.codec.name(),
                    chunk.bases.len()
                ),
            ));
        }
        total = total
            .checked_add(chunk.raw_len)
            .ok_or_else(|| invalid(what, "chunk lengths overflow"))?;
    }
    if total != raw_bytes {
        return Err(invalid(
            what,
            format!("chunks hold {total} raw bytes, entry says {raw_bytes}"),
        ));
    }
    Ok(())
}

impl TensorEntry {
    pub fn validate(&self) -> Result<(), FormatError> {
        self.validate_layout()?;
        validate_chunks(
            &format!("tensor {:?}", self.name),
            &self.chunks,
            self.raw_bytes,
        )
    }

    /// Name, dtype, shape, slice and size agree with each other (chunks are not looked at).
    pub fn validate_layout(&self) -> Result<(), FormatError> {
        validate_name("tensor", &self.name)?;
        let what = format!("tensor {:?}", self.name);
        if self.global_shape.len() > DIMS_MAX || self.slice.len() != self.global_shape.len() {
            return Err(invalid(
                &what,
                "slice and shape have different ranks, or too many dimensions",
            ));
        }
        let mut elements: u64 = 1;
        let mut global_elements: u64 = 1;
        for (range, dim) in self.slice.iter().zip(&self.global_shape) {
            let end = range
                .start
                .checked_add(range.len)
                .ok_or_else(|| invalid(&what, "slice overflows"))?;
            if end > *dim {
                return Err(invalid(
                    &what,
                    format!(
                        "slice {}..{} lies outside dimension {dim}",
                        range.start, end
                    ),
                ));
            }
            elements = elements
                .checked_mul(range.len)
                .ok_or_else(|| invalid(&what, "slice size overflows"))?;
            global_elements = global_elements
                .checked_mul(*dim)
                .ok_or_else(|| invalid(&what, "shape overflows"))?;
        }
        global_elements
            .checked_mul(self.dtype.element_bytes() as u64)
            .ok_or_else(|| invalid(&what, "global size overflows"))?;
        let bytes = elements
            .checked_mul(self.dtype.element_bytes() as u64)
            .ok_or_else(|| invalid(&what, "size overflows"))?;
        if bytes != self.raw_bytes {
            return Err(invalid(
                &what,
                format!("slice holds {bytes} bytes, entry says {}", self.raw_bytes),
            ));
        }
        Ok(())
    }
}

impl Object for ShardManifest {
    const KIND: &'static str = "shard";

    fn validate(&self) -> Result<(), FormatError> {
        if self.world_size == 0 || self.world_size > WORLD_SIZE_MAX || self.rank >= self.world_size
        {
            return Err(invalid(
                "shard manifest",
                format!("rank {} of world size {}", self.rank, self.world_size),
            ));
        }
        if self.step.step > STEP_MAX {
            return Err(invalid("shard manifest", format!("step {}", self.step)));
        }
        if self.tensors.len() + self.blobs.len() > TENSORS_PER_SHARD_MAX {
            return Err(invalid("shard manifest", "too many tensors"));
        }
        let mut names = std::collections::HashSet::new();
        for tensor in &self.tensors {
            tensor.validate()?;
            if !names.insert(("tensor", tensor.name.as_str())) {
                return Err(invalid(
                    "shard manifest",
                    format!("tensor {:?} appears twice", tensor.name),
                ));
            }
        }
        for blob in &self.blobs {
            validate_name("blob", &blob.name)?;
            validate_chunks(
                &format!("blob {:?}", blob.name),
                &blob.chunks,
                blob.raw_bytes,
            )?;
            if !names.insert(("blob", blob.name.as_str())) {
                return Err(invalid(
                    "shard manifest",
                    format!("blob {:?} appears twice", blob.name),
                ));
            }
        }
        Ok(())
    }
}

/// A rank's manifest as a commit pins it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShardRef {
    pub rank: Rank,
    pub manifest_blake3: ChunkHash,
    pub raw_bytes: u64,
    pub stored_bytes: u64,
    pub uploaded_bytes: u64,
}

/// The record that makes a step committed. Stored create-only at `commits/<step>.json`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct CommitRecord {
    pub run: RunId,
    pub step: StepKey,
    pub world_size: u32,
    pub created_unix_ms: u64,
    pub shards: Vec<ShardRef>,
    /// The leadership epoch of the daemon that wrote it (absent: written by the trainer or
    /// `ckptctl`, or before epochs existed).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub leader_epoch: Option<u64>,
}

impl CommitRecord {
    pub fn raw_bytes(&self) -> u64 {
        self.shards.iter().map(|s| s.raw_bytes).sum()
    }

    pub fn uploaded_bytes(&self) -> u64 {
        self.shards.iter().map(|s| s.uploaded_bytes).sum()
    }
}

impl Object for CommitRecord {
    const KIND: &'static str = "commit";

    fn validate(&self) -> Result<(), FormatError> {
        let ranks_in_order = self
            .shards
            .iter()
            .enumerate()
            .all(|(index, shard)| shard.rank as usize == index);
        if self.world_size == 0
            || self.world_size > WORLD_SIZE_MAX
            || self.shards.len() != self.world_size as usize
            || !ranks_in_order
        {
            return Err(invalid(
                "commit record",
                format!(
                    "{} shards listed for world size {}",
                    self.shards.len(),
                    self.world_size
                ),
            ));
        }
        if self.step.step > STEP_MAX {
            return Err(invalid("commit record", format!("step {}", self.step)));
        }
        Ok(())
    }
}

/// An operator's rollback: every step of an earlier timeline after `to` is hidden. Stored
/// create-only at `rollbacks/<seq>.json`; `seq` is also the timeline that starts with it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RollbackRecord {
    pub run: RunId,
    pub seq: u32,
    pub to: StepKey,
    pub reason: String,
    pub operator: String,
    pub created_unix_ms: u64,
}

impl RollbackRecord {
    /// Whether this rollback hides `step`.
    pub fn hides(&self, step: StepKey) -> bool {
        step.timeline < self.seq && step.step > self.to.step
    }
}

impl Object for RollbackRecord {
    const KIND: &'static str = "rollback";

    fn validate(&self) -> Result<(), FormatError> {
        if self.seq == 0 || self.to.timeline >= self.seq {
            return Err(invalid(
                "rollback record",
                format!(
                    "seq {} cannot roll back to timeline {}",
                    self.seq, self.to.timeline
                ),
            ));
        }
        Ok(())
    }
}

/// Identity of a run. Stored create-only at `run.json`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RunInfo {
    pub run: RunId,
    pub created_unix_ms: u64,
    /// Raw bytes per chunk that writers cut tensors into.
    pub chunk_bytes: u64,
    /// Free-form description of the model and parallel layout, set by whoever created the run.
    #[serde(default)]
    pub description: serde_json::Value,
}

impl Object for RunInfo {
    const KIND: &'static str = "run";

    fn validate(&self) -> Result<(), FormatError> {
        if self.chunk_bytes == 0 || self.chunk_bytes > CHUNK_RAW_BYTES_MAX {
            return Err(invalid(
                "run.json",
                format!("chunk size {} is out of range", self.chunk_bytes),
            ));
        }
        Ok(())
    }
}

/// A leadership of a job's daemons. Stored create-only at `leaders/<epoch>.json`: whoever
/// creates the record leads for that epoch, and an epoch is never reused.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LeaderRecord {
    pub run: RunId,
    pub epoch: u64,
    pub node: String,
    /// The leader's TCP address, where nodes link and `ckptctl status` asks.
    pub address: String,
    pub created_unix_ms: u64,
}

impl Object for LeaderRecord {
    const KIND: &'static str = "leader";

    fn validate(&self) -> Result<(), FormatError> {
        if self.epoch == 0
            || self.node.is_empty()
            || self.address.parse::<std::net::SocketAddr>().is_err()
        {
            return Err(invalid(
                "leader record",
                format!(
                    "epoch {} of node {:?} at {:?}",
                    self.epoch, self.node, self.address
                ),
            ));
        }
        Ok(())
    }
}

/// The leader's lease (`leaders/lease.json`, overwritten): `renewal` grows while the leader
/// of `epoch` hears from most of its nodes. A candidate that sees it grow does not take over.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LeaseRecord {
    pub epoch: u64,
    pub node: String,
    pub renewal: u64,
    pub unix_ms: u64,
}

impl Object for LeaseRecord {
    const KIND: &'static str = "lease";

    fn validate(&self) -> Result<(), FormatError> {
        Ok(())
    }
}

/// An exclusive-operation lock. Stored create-only at `locks/<name>.json`; it may be broken
/// once `expires_unix_ms` has passed.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LockRecord {
    pub owner: String,
    pub purpose: String,
    pub host: String,
    pub pid: u32,
    pub created_unix_ms: u64,
    pub expires_unix_ms: u64,
}

impl Object for LockRecord {
    const KIND: &'static str = "lock";

    fn validate(&self) -> Result<(), FormatError> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn manifest() -> ShardManifest {
        let hash = ChunkHash::of(b"x");
        ShardManifest {
            run: "r".parse().unwrap(),
            step: StepKey::new(5, 0),
            rank: 1,
            world_size: 2,
            created_unix_ms: 1,
            tensors: vec![TensorEntry {
                name: "w".into(),
                dtype: DType::F32,
                global_shape: vec![4, 2],
                slice: vec![DimRange { start: 2, len: 2 }, DimRange { start: 0, len: 2 }],
                raw_bytes: 16,
                chunks: vec![ChunkRef {
                    hash,
                    raw_len: 16,
                    stored_len: 20,
                    codec: Codec::Zstd,
                    bases: vec![],
                }],
            }],
            blobs: vec![],
            uploaded_bytes: 20,
        }
    }

    #[test]
    fn sealed_objects_open_and_edits_are_caught() {
        let (bytes, hash) = seal(&manifest());
        let (opened, opened_hash): (ShardManifest, _) = open(&bytes).unwrap();
        assert_eq!((opened, opened_hash), (manifest(), hash));
        let text = String::from_utf8(bytes).unwrap();
        let edited = text.replace("\"rank\":1", "\"rank\":0");
        assert!(matches!(
            open::<ShardManifest>(edited.as_bytes()),
            Err(FormatError::ChecksumMismatch { .. })
        ));
        let future = text.replace("\"format_version\":1", "\"format_version\":7");
        let error = open::<ShardManifest>(future.as_bytes()).unwrap_err();
        assert!(
            error
                .to_string()
                .contains("format version 7 is not supported"),
            "{error}"
        );
        assert!(matches!(
            open::<CommitRecord>(text.as_bytes()),
            Err(FormatError::WrongKind { .. })
        ));
    }

    #[test]
    fn inconsistent_manifests_are_refused() {
        let mut outside = manifest();
        outside.tensors[0].slice[0].start = 3;
        let mut short = manifest();
        short.tensors[0].chunks[0].raw_len = 8;
        let mut rank = manifest();
        rank.rank = 2;
        for bad in [outside, short, rank] {
            let (bytes, _) = seal(&bad);
            assert!(matches!(
                open::<ShardManifest>(&bytes),
                Err(FormatError::Invalid { .. })
            ));
        }
    }

    proptest! {
        #[test]
        fn hostile_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..600)) {
            let _ = open::<ShardManifest>(&bytes);
            let _ = open::<CommitRecord>(&bytes);
            let _ = open::<RollbackRecord>(&bytes);
        }

        #[test]
        fn mutated_manifests_never_panic(position in 0usize..2000, byte in any::<u8>()) {
            let (mut bytes, _) = seal(&manifest());
            let position = position % bytes.len();
            bytes[position] = byte;
            let _ = open::<ShardManifest>(&bytes);
        }

        #[test]
        fn hostile_bodies_with_valid_hashes_never_panic(
            shape in proptest::collection::vec(any::<u64>(), 0..4),
            starts in proptest::collection::vec(any::<u64>(), 0..4),
            raw in any::<u64>(),
        ) {
            let mut hostile = manifest();
            hostile.tensors[0].global_shape = shape.clone();
            hostile.tensors[0].slice = starts.iter().zip(&shape).map(|(s, d)| DimRange { start: *s, len: *d }).collect();
            hostile.tensors[0].raw_bytes = raw;
            let (bytes, _) = seal(&hostile);
            let _ = open::<ShardManifest>(&bytes);
        }
    }
}
