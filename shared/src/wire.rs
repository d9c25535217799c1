//! The wire protocol between a trainer rank and its node's `ckptd` (Unix socket), and between
//! `ckptd`s (TCP: buddy replication, reports to the leader, `ckptctl status`).
//!
//! A frame is
//!
//! ```text
//! "LZW1" | header length (u32 LE) | payload length (u32 LE) | header (JSON) | payload | MAC
//! ```
//!
//! where the MAC is 32 bytes of blake3 keyed with the job key over everything before it. Frames
//! between `ckptd`s must carry a valid MAC; frames on the Unix socket, which only the job's
//! user can open, carry 32 zero bytes. Both lengths are bounded before anything is allocated,
//! and a frame is parsed only after its MAC checks out, so a forged or garbled frame changes
//! nothing: the reader returns an error and the caller drops the connection.
//!
//! A frame whose sender already holds its payload's blake3 (a replica chunk, named by it)
//! says `"LZW2"` instead, and its MAC covers the prefix, the header and that 32-byte hash in
//! place of the payload. The reader hashes the payload once, checks the MAC with that hash,
//! and hands the hash on (`Frame::payload_hash`): the chunk is then authenticated and
//! checked against its name in one pass over its bytes on each side, not two.

use std::io::{Read, Write};
use std::path::Path;

use bytes::{Bytes, BytesMut};
use serde::{Deserialize, Serialize};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use crate::hash::ChunkHash;
use crate::ids::{Rank, RunId, StepKey};

pub const MAGIC: [u8; 4] = *b"LZW1";
/// A frame whose MAC covers its payload's blake3 rather than the payload.
pub const MAGIC_HASHED: [u8; 4] = *b"LZW2";
/// Payloads from this size on are hashed (and a replica chunk written) on a blocking thread,
/// off the runtime's workers.
pub const PAYLOAD_BLOCKING: usize = 256 << 10;
/// Largest header accepted (JSON).
pub const HEADER_MAX: usize = 1 << 20;
/// Largest payload accepted: one chunk of replica data, or a snapshot's blobs.
pub const PAYLOAD_MAX: usize = 16 << 20;
const PREFIX: usize = 12;
const MAC: usize = 32;

/// Why a frame was refused. Every variant ends the connection it came from.
#[derive(Debug, thiserror::Error)]
pub enum WireError {
    #[error("connection closed")]
    Closed,
    #[error("i/o: {0}")]
    Io(#[from] std::io::Error),
    #[error("not a Lazarus frame (bad magic)")]
    BadMagic,
    #[error("{what} of {len} bytes is over the limit of {max}")]
    TooLarge {
        what: &'static str,
        len: usize,
        max: usize,
    },
    #[error("authentication failed (wrong job key, or a forged or garbled frame)")]
    BadMac,
    #[error("malformed message: {0}")]
    Malformed(String),
    #[error("bad job key file {path}: {reason}")]
    BadKey { path: String, reason: String },
}

impl WireError {
    /// A short label for metrics.
    pub fn cause(&self) -> &'static str {
        match self {
            Self::Closed => "closed",
            Self::Io(_) => "io",
            Self::BadMagic => "bad_magic",
            Self::TooLarge { .. } => "too_large",
            Self::BadMac => "bad_mac",
            Self::Malformed(_) => "malformed",
            Self::BadKey { .. } => "bad_key",
        }
    }
}

/// The per-job secret that authenticates `ckptd`-to-`ckptd` frames.
#[derive(Clone)]
pub struct JobKey([u8; 32]);

impl std::fmt::Debug for JobKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("JobKey(..)")
    }
}

impl JobKey {
    /// Derives the key from a key file's contents (at least 16 bytes, e.g. 32 random bytes or
    /// 64 hex characters; surrounding whitespace is ignored).
    pub fn from_file(path: &Path) -> Result<Self, WireError> {
        let bad = |reason: String| WireError::BadKey {
            path: path.display().to_string(),
            reason,
        };
        let bytes = std::fs::read(path).map_err(|e| bad(e.to_string()))?;
        let trimmed = bytes.trim_ascii();
        if trimmed.len() < 16 {
            return Err(bad(format!(
                "{} bytes of key material; use at least 16 (e.g. `head -c 32 /dev/urandom | xxd -p -c 64`)",
                trimmed.len()
            )));
        }
        Ok(Self::derive(trimmed))
    }

    pub fn derive(material: &[u8]) -> Self {
        Self(blake3::derive_key("lazarus ckptd job key v1", material))
    }

    fn mac(&self, body: &[u8]) -> [u8; 32] {
        *blake3::keyed_hash(&self.0, body).as_bytes()
    }

    /// The MAC of a hashed frame: over its prefix and header, then its payload's hash.
    fn mac_hashed(&self, head: &[u8], payload_hash: &ChunkHash) -> [u8; 32] {
        let mut hasher = blake3::Hasher::new_keyed(&self.0);
        hasher.update(head);
        hasher.update(&payload_hash.0);
        *hasher.finalize().as_bytes()
    }
}

/// One tensor (or its slice) in a rank's snapshot slot, at a byte offset of the slot: a
/// region of the rank's layout.
pub type SlotTensor = crate::store::Region;

/// How a snapshot slot is cut into the chunks that `ckptd` hashes when it is handed over,
/// replicates chunk by chunk, and checks again before a restore.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SlotChunking {
    /// In steps of the chunk size from the slot's start. Replicas and saved states of daemons
    /// that did not send or save a chunking are cut so.
    #[default]
    Fixed,
    /// Each stored region in steps of the chunk size from its own start, as a store whose
    /// chunks have that size cuts the region into its chunks; the bytes outside the stored
    /// regions in such steps from where they begin. A hash taken at hand-over is then the
    /// name of the store's chunk of the same bytes, and an upload need not hash them again.
    Regions,
}

impl SlotChunking {
    /// The byte ranges, in order and covering it exactly, of a `slot_bytes`-byte slot holding
    /// `tensors`, in chunks of at most `chunk_bytes`. An error where the stored regions
    /// overlap or run past the slot's end (a peer's bad layout).
    pub fn ranges(
        self,
        slot_bytes: u64,
        chunk_bytes: u64,
        tensors: &[SlotTensor],
    ) -> Result<Vec<std::ops::Range<u64>>, String> {
        if chunk_bytes == 0 {
            return Err("a chunk size of 0 bytes".into());
        }
        let mut ranges = Vec::new();
        let mut cut = |from: u64, to: u64| {
            ranges.extend(
                (from..to)
                    .step_by(chunk_bytes as usize)
                    .map(|start| start..to.min(start + chunk_bytes)),
            )
        };
        let mut stored: Vec<&SlotTensor> = match self {
            SlotChunking::Fixed => Vec::new(),
            SlotChunking::Regions => tensors
                .iter()
                .filter(|t| t.kind == crate::store::RegionKind::Stored && t.bytes > 0)
                .collect(),
        };
        stored.sort_by_key(|t| t.offset);
        let mut next = 0;
        for region in stored {
            let end = region.offset.checked_add(region.bytes);
            if region.offset < next || end.is_none_or(|end| end > slot_bytes) {
                return Err(format!(
                    "region {} ({} bytes at {}) overlaps another or runs past the {slot_bytes}-byte slot",
                    region.name, region.bytes, region.offset
                ));
            }
            cut(next, region.offset);
            next = region.offset + region.bytes;
            cut(region.offset, next);
        }
        cut(next, slot_bytes);
        Ok(ranges)
    }
}

/// A small named blob carried in a frame's payload (`trainer.json`, `model.json`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct BlobSpec {
    pub name: String,
    pub len: u32,
}

/// Where a restore was served from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Tier {
    /// The node's own shm slot.
    T0,
    /// The buddy node's replica.
    T1,
    /// The object store.
    T2,
}

impl Tier {
    pub fn name(self) -> &'static str {
        match self {
            Self::T0 => "t0",
            Self::T1 => "t1",
            Self::T2 => "t2",
        }
    }
}

/// What the leader knows about one rank.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RankStatus {
    pub rank: Rank,
    pub node: String,
    pub pid: u32,
    /// Newest step the rank reported (heartbeat or snapshot).
    pub step: u64,
    pub last_seen_ms_ago: u64,
    /// The rank's own compute per step (wall time less time in collectives), in ms.
    #[serde(default)]
    pub compute_ms: Option<f64>,
    /// Slower than the median by more than the margin, for longer than the set time.
    #[serde(default)]
    pub straggler: bool,
}

/// What the leader knows about one node.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct NodeStatus {
    pub node: String,
    pub address: String,
    pub last_seen_ms_ago: u64,
    pub ranks: Vec<Rank>,
    /// The newest step this node holds in T0, per run.
    pub t0_steps: Vec<(RunId, u64)>,
}

/// The leader's view of the job (`ckptctl status`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ClusterStatus {
    pub leader: String,
    /// The leader's epoch.
    #[serde(default)]
    pub epoch: u64,
    /// Who takes over when the leader is lost, in order.
    #[serde(default)]
    pub succession: Vec<Successor>,
    pub nodes: Vec<NodeStatus>,
    pub runs: Vec<RunStatus>,
    /// When the leader supervises the world.
    pub supervision: Option<SupervisionStatus>,
}

/// The supervisor's view: which nodes train, which wait as spares, which were drained.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SupervisionStatus {
    pub generation: u32,
    pub active: Vec<String>,
    pub spares: Vec<String>,
    pub drained: Vec<String>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RunStatus {
    pub run: RunId,
    pub world_size: u32,
    pub ranks: Vec<RankStatus>,
    pub memory_step: Option<u64>,
    pub durable_step: Option<StepKey>,
}

/// Every message, on either socket. The header of a frame is one of these as JSON.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", deny_unknown_fields)]
pub enum Message {
    // ---- rank -> node ckptd (Unix socket) ----
    /// A rank starts (or restarts). The daemon answers `Registered` with its slot files.
    Register {
        run: RunId,
        rank: Rank,
        world_size: u32,
        pid: u32,
        slot_bytes: u64,
        tensors: Vec<SlotTensor>,
    },
    /// Which steps could this world start from? The daemon asks the leader and answers
    /// `StepChoice`. The ranks then agree on one (the newest any of them was told of: a
    /// memory commit told to one rank has every rank's snapshot in T0 or T1).
    Choose,
    /// Serve memory-committed step `memory` (from T0 or T1, or T2 if `durable` is the same
    /// step), or else durable step `durable` from T2. Neither: start fresh. The daemon
    /// answers `Restored`.
    Restore {
        memory: Option<u64>,
        durable: Option<u64>,
    },
    /// Slot `slot` holds step `step`; payload = the blobs. Answer: `Held`, with `accepted`.
    Snapshot {
        step: u64,
        slot: u32,
        durable: bool,
        blobs: Vec<BlobSpec>,
        /// How long the previous snapshot stalled the training loop.
        stall_us: u64,
    },
    /// The rank's heartbeat, every step, and its question: which slots may it not write?
    /// Answer: `Held`.
    Poll {
        step: u64,
        /// The rank's own compute per step since its last poll, in microseconds: the step's
        /// wall time less its time inside collectives (for straggler detection).
        #[serde(default)]
        compute_us: u64,
        /// The loss of `step` (global, the same on every rank), once it is known.
        #[serde(default)]
        loss: Option<f64>,
    },
    /// The ranks skipped the snapshot of `step` because a daemon was busy. Answer: `Held`.
    Skipped {
        step: u64,
    },
    /// The rank's health check failed at `step` (a non-finite loss or gradient norm, or a
    /// loss spike): it snapshots nothing more and waits for the supervisor to stop the world
    /// and roll it back. Answer: `Held`.
    Unhealthy {
        step: u64,
        reason: String,
        /// Set when the step failed the silent-data-corruption check.
        sdc: Option<SdcFinding>,
        /// Set (to the restored step) when the step is the first after a restore and its loss
        /// differs from the one the same step had before the restore.
        #[serde(default)]
        restored: Option<u64>,
    },
    /// The rank finished its run and is exiting normally. Answer: `Held`.
    Bye,

    // ---- node ckptd -> rank ----
    Registered {
        slots: Vec<String>,
        held: Vec<u32>,
    },
    /// `slot` holds `step` (from `tier`); payload = the blobs. No step: start fresh.
    Restored {
        step: Option<u64>,
        slot: Option<u32>,
        tier: Option<Tier>,
        blobs: Vec<BlobSpec>,
        held: Vec<u32>,
    },
    /// `busy`: the daemon is still working on an earlier snapshot.
    Held {
        held: Vec<u32>,
        busy: bool,
        accepted: bool,
        /// The step of the rank's T0 on this node (its newest memory-committed snapshot).
        #[serde(default)]
        committed: Option<u64>,
    },
    Refused {
        reason: String,
    },

    // ---- ckptd <-> ckptd (TCP, authenticated) ----
    /// A rank's snapshot follows as `ReplicaData` frames, one per chunk, then `ReplicaEnd`.
    /// Payload = the blobs.
    ReplicaBegin {
        from_node: String,
        run: RunId,
        rank: Rank,
        world_size: u32,
        step: u64,
        slot_bytes: u64,
        chunk_bytes: u64,
        tensors: Vec<SlotTensor>,
        blobs: Vec<BlobSpec>,
        /// The supervisor's last rollback the sender had applied when its rank handed the
        /// snapshot over: a buddy that applied a later one of the same leader refuses it.
        #[serde(default)]
        rollback: RollbackMark,
        /// How the slot is cut into the chunks that follow, of `chunk_bytes` at most.
        #[serde(default)]
        chunking: SlotChunking,
    },
    /// Payload = chunk `index` of the slot (as `ReplicaBegin::chunking` cuts it), which
    /// hashes to `hash`.
    ReplicaData {
        index: u32,
        hash: ChunkHash,
    },
    /// Every chunk was sent; `chunks` lists their hashes in order.
    ReplicaEnd {
        chunks: Vec<ChunkHash>,
    },
    /// Send the replica of (run, rank) at `step` back, as `ReplicaBegin`.. `ReplicaEnd`.
    FetchReplica {
        run: RunId,
        rank: Rank,
        step: u64,
    },
    Ack {
        ok: bool,
        reason: String,
    },

    // ---- node ckptd -> leader ----
    /// A node (re)connects; it lists what it holds so a restarted leader can rebuild its state.
    NodeHello {
        node: String,
        address: String,
        /// Where this node replicates to.
        buddy: Option<String>,
        /// The Unix socket this node's ranks use.
        socket: String,
        t0: Vec<T0Entry>,
        /// The newest leadership epoch this node knows of: a leader with an older one is
        /// deposed.
        #[serde(default)]
        epoch: u64,
        /// This daemon may take over leadership (it has the supervision plan).
        #[serde(default)]
        candidate: bool,
        /// The complete replicas (T1) this node holds for other nodes' ranks.
        #[serde(default)]
        replicas: Vec<ReplicaEntry>,
        /// The daemon's state in shm (its T0 and replicas, which outlive a restart), drawn at
        /// random when the state begins (0: not said): a leader tells a state that lived
        /// through its rollbacks from one that began after them.
        #[serde(default)]
        instance: u64,
        /// The daemon's rollback mark: the last rollback it applied or its leader's mark
        /// (`Leading`); at start, the last rollback its state forgot.
        #[serde(default)]
        rollback: RollbackMark,
    },
    /// A registered rank's connection ended: the process exited or died.
    RankDown {
        node: String,
        run: RunId,
        rank: Rank,
        pid: u32,
        /// When the rank exited (or its connection ended), by the node's clock.
        #[serde(default)]
        unix_ms: u64,
        /// The same in microseconds: the leader orders deaths by it (0 from older nodes).
        #[serde(default)]
        unix_us: u64,
        /// The rank's last step, as it last told its daemon: where its world failed.
        #[serde(default)]
        step: u64,
    },
    /// A rank said `Bye`: it finished (or stopped on a signal after its last checkpoint).
    RankDone {
        node: String,
        run: RunId,
        rank: Rank,
        pid: u32,
    },
    /// A rank registered at its node.
    RankUp {
        node: String,
        run: RunId,
        rank: Rank,
        world_size: u32,
        pid: u32,
    },
    /// A rank's snapshot of `step` is in T0 and T1.
    Replicated {
        node: String,
        run: RunId,
        rank: Rank,
        world_size: u32,
        step: u64,
        durable_requested: bool,
        /// The rank's uploads when its daemon reported (`None`: not said, as in the evidence
        /// a node's hello brings to a new leader).
        #[serde(default)]
        upload: Option<UploadReport>,
        /// The supervisor's last rollback the daemon had applied when the rank handed the
        /// snapshot over: a leader that rolled the run back since ignores the report, unless
        /// the daemon started after that rollback (it never held the abandoned snapshots).
        #[serde(default)]
        rollback: RollbackMark,
    },
    /// A rank's shard manifest of `step` is stored.
    Stored {
        node: String,
        run: RunId,
        rank: Rank,
        world_size: u32,
        step: StepKey,
    },
    NodeHeartbeat {
        node: String,
        ranks: Vec<RankBeat>,
    },
    /// Which step should a relaunched world of `world_size` restore, and where is `rank`'s
    /// replica (T1)?
    WhichStep {
        run: RunId,
        world_size: u32,
        rank: Rank,
    },
    StatusRequest,
    /// The supervisor's failure timeline.
    EventsRequest,

    // ---- leader -> node ckptd ----
    /// The first frame on a node's link, again when the order of succession changes, and
    /// every heartbeat: this leader leads `epoch`; `succession` is who takes over, in order.
    Leading {
        epoch: u64,
        node: String,
        succession: Vec<Successor>,
        /// This leader's rollbacks (its epoch and their count), which the node takes as its
        /// mark. None on the first frame to a node that missed one: `RolledBack` follows.
        #[serde(default)]
        rollback: Option<RollbackMark>,
    },
    /// The leader's heartbeat on a node's link (every 500 ms).
    LeaderBeat {
        epoch: u64,
    },
    /// A newly elected leader tells every node it knows (one-shot): link to `address`.
    NewLeader {
        epoch: u64,
        node: String,
        address: String,
    },
    /// Asked of a daemon that does not lead: who does, as far as it knows.
    NotLeader {
        epoch: u64,
        leader: Option<String>,
    },
    /// Every rank of `run` has `step` in T0 and T1; upload it if `durable`.
    MemoryCommitted {
        run: RunId,
        step: u64,
        durable: bool,
        #[serde(default)]
        epoch: u64,
    },
    /// The leader gave up the steps through `through` that waited for the ranks' reports:
    /// drop the snapshots waiting for their memory commit, so that the ranks hand over the
    /// next step at once rather than after `commit_timeout_seconds`.
    CommitsGivenUp {
        run: RunId,
        through: u64,
        epoch: u64,
    },
    StepChoice {
        memory: Option<u64>,
        durable: Option<StepKey>,
        /// The daemon that holds the rank's latest replica (T1), if the leader knows.
        replica: Option<String>,
        /// Data to skip after restoring a step the supervisor rolled back to.
        #[serde(default)]
        skip: Option<DataSkip>,
        /// The losses the run had at the step after `memory` and the step after `durable`,
        /// where the leader knows them: a restore's first step must repeat its loss.
        #[serde(default)]
        losses: Vec<(u64, f64)>,
    },
    /// From now on, replicate to this daemon (the supervisor pairs the active nodes).
    SetBuddy {
        address: Option<String>,
        #[serde(default)]
        epoch: u64,
    },
    /// The supervisor stops the world: kill this node's ranks of `run` now.
    KillRanks {
        run: RunId,
        #[serde(default)]
        epoch: u64,
    },
    /// The job is preempted: ask this node's ranks of `run` to checkpoint and exit (SIGTERM).
    StopRanks {
        run: RunId,
        #[serde(default)]
        epoch: u64,
    },
    /// Upload the T0 of `step` (the memory-committed step) if it is not durable yet.
    MakeDurable {
        run: RunId,
        step: u64,
        #[serde(default)]
        epoch: u64,
    },
    /// Upload the replica (T1) held here of `rank`'s `step` as that rank's shard: its node
    /// is lost and the world shrinks.
    UploadReplica {
        run: RunId,
        rank: Rank,
        step: u64,
        #[serde(default)]
        epoch: u64,
    },
    /// The supervisor rolled `run` back to step `to` (`None`: to a fresh start): forget every
    /// snapshot, pending commit and replica of a later step, so that none is restored, made
    /// durable or offered to a later leader.
    RolledBack {
        run: RunId,
        to: Option<u64>,
        epoch: u64,
        /// The leader's count of its rollbacks, this one included.
        #[serde(default)]
        seq: u64,
    },
    /// Supervision of `run` is over (completed, or `preempted` and made durable): a daemon
    /// that exits when the run is done exits; no other takes over.
    RunEnded {
        run: RunId,
        preempted: bool,
        /// Supervision stopped relaunching the world (event `failed`).
        #[serde(default)]
        failed: bool,
        epoch: u64,
    },
    /// The answer to `StatusRequest`: a [`ClusterStatus`] as zstd-compressed JSON of
    /// `json_bytes` in the payload ([`pack_status`]), since a large cluster's status does not
    /// fit a header.
    Status {
        json_bytes: u64,
    },
    Events(Vec<Event>),
}

impl Message {
    /// The leadership epoch a leader's push to a node carries (`None`: not such a push).
    pub fn leader_epoch(&self) -> Option<u64> {
        match self {
            Message::Leading { epoch, .. }
            | Message::LeaderBeat { epoch }
            | Message::MemoryCommitted { epoch, .. }
            | Message::CommitsGivenUp { epoch, .. }
            | Message::SetBuddy { epoch, .. }
            | Message::KillRanks { epoch, .. }
            | Message::StopRanks { epoch, .. }
            | Message::MakeDurable { epoch, .. }
            | Message::UploadReplica { epoch, .. }
            | Message::RolledBack { epoch, .. }
            | Message::RunEnded { epoch, .. } => Some(*epoch),
            _ => None,
        }
    }
}

/// A leader's status as a `Status` message and its payload.
pub fn pack_status(status: &ClusterStatus) -> (Message, Vec<u8>) {
    let json = serde_json::to_vec(status).expect("a status serialises");
    let packed = zstd::bulk::compress(&json, 3).expect("compressing in memory");
    (
        Message::Status {
            json_bytes: json.len() as u64,
        },
        packed,
    )
}

/// The status a `Status` message's payload holds.
pub fn unpack_status(json_bytes: u64, payload: &[u8]) -> Result<ClusterStatus, WireError> {
    let limit = usize::try_from(json_bytes)
        .ok()
        .filter(|n| *n <= 64 * PAYLOAD_MAX)
        .ok_or_else(|| WireError::Malformed(format!("a status of {json_bytes} bytes")))?;
    let json = zstd::bulk::decompress(payload, limit)
        .map_err(|e| WireError::Malformed(format!("status payload: {e}")))?;
    serde_json::from_slice(&json).map_err(|e| WireError::Malformed(format!("status JSON: {e}")))
}

/// One rank in a node's heartbeat.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RankBeat {
    pub rank: Rank,
    pub pid: u32,
    /// The newest step the rank reported.
    pub step: u64,
    /// Milliseconds since the rank last talked to its daemon (0: connected and polling).
    pub seen_ms_ago: u64,
    /// The rank's own compute per step, in microseconds (0: not reported yet).
    #[serde(default)]
    pub compute_us: u64,
    /// The rank's process state when it is neither running nor sleeping, as `/proc` gives
    /// it: `T` stopped, `t` stopped by a tracer, `D` waiting on IO, `Z` a zombie.
    #[serde(default)]
    pub process_state: Option<char>,
    /// Where this process's restore came from, once it restored a step.
    #[serde(default)]
    pub restored_from: Option<Tier>,
    /// The rank's health check failed.
    #[serde(default)]
    pub unhealthy: Option<BadStep>,
    /// `(step, loss)` of the steps since the last beat.
    #[serde(default)]
    pub losses: Vec<(u64, f64)>,
}

/// A step a rank's health check failed, and why.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct BadStep {
    pub step: u64,
    pub reason: String,
    pub sdc: Option<SdcFinding>,
    /// The step restored before this one, whose loss differs from the one it had before.
    #[serde(default)]
    pub restored: Option<u64>,
}

/// What a rank's daemon says of its uploads with each `Replicated` report. The leader makes a
/// step durable only when no rank's daemon is uploading and every one has taken the last
/// durable commit: each daemon runs one upload per rank and skips, on its own, a durable step
/// that comes while one runs, so a step made durable while some were busy is uploaded by some
/// ranks only and never committed (two daemons out of step after a restart then skipped
/// different steps for the rest of a run).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct UploadReport {
    /// An upload of the rank's runs.
    pub running: bool,
    /// The newest step the node memory-committed for the rank (its T0).
    pub t0: Option<u64>,
}

impl UploadReport {
    /// Whether a durable commit now would find this rank's daemon unable to start its upload:
    /// one runs, or the daemon has not yet taken `last_durable`, whose upload will.
    pub fn busy(&self, last_durable: Option<u64>) -> bool {
        self.running || last_durable.is_some_and(|durable| self.t0.is_none_or(|t0| t0 < durable))
    }
}

/// Replicated copies of a tensor differed (silent data corruption).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SdcFinding {
    /// The rank whose copy differs from the majority; `None` when no majority names one
    /// (two copies that differ).
    pub suspect: Option<Rank>,
    /// The newest step whose state every rank's copies agreed on: the newest step a
    /// roll-back may keep.
    pub agreed_step: u64,
}

/// After restoring `after_step`, the ranks skip the next `batches` global batches of their
/// data order: the window that made the run go bad.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DataSkip {
    pub after_step: u64,
    pub batches: u64,
}

/// One entry of the supervisor's timeline.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Event {
    pub unix_ms: u64,
    /// `launch`, `fault`, `stopped`, `swap`, `relaunch`, `restored`, `first_step`, `completed`,
    /// `waiting`, ...
    pub kind: String,
    pub detail: String,
    /// Launch generation the event belongs to.
    pub generation: u32,
    /// The world's nodes in rank order, on the events that start or adopt one.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub nodes: Vec<String>,
    /// The leadership epoch of the leader that recorded it (0: before epochs).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub epoch: u64,
}

fn is_zero(value: &u64) -> bool {
    *value == 0
}

/// A daemon in the order of succession.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Successor {
    pub node: String,
    pub address: String,
}

/// A complete replica a node holds: `rank`'s snapshot of `step`, sent by `from_node`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ReplicaEntry {
    pub run: RunId,
    pub rank: Rank,
    pub world_size: u32,
    pub step: u64,
    pub from_node: String,
}

/// A rank's T0 content, as a node reports it to the leader.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct T0Entry {
    pub run: RunId,
    pub rank: Rank,
    pub world_size: u32,
    pub step: u64,
}

/// Which of the supervisor's rollbacks a daemon had applied: the leader's epoch and that
/// leader's count of its rollbacks ([`Message::RolledBack`]), ordered by epoch, then count.
/// A daemon drops a snapshot whose mark changed while it replicated it, and a report sent
/// before its daemon heard of a rollback carries the mark from before it: the leader that
/// rolled back tells it from its new world's snapshots by this, together with what it knew
/// of the daemon (`NodeHello::instance`) at the rollback.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub struct RollbackMark {
    pub epoch: u64,
    pub seq: u64,
}

/// A decoded frame.
#[derive(Clone, Debug)]
pub struct Frame {
    pub message: Message,
    pub payload: Bytes,
    /// The payload's blake3, for a hashed frame (`"LZW2"`): computed by the reader from the
    /// bytes received, and (with a key) covered by the MAC that checked out.
    pub payload_hash: Option<ChunkHash>,
}

/// Encodes one frame; `key` None writes a zero MAC (Unix socket only).
pub fn encode(message: &Message, payload: &[u8], key: Option<&JobKey>) -> Vec<u8> {
    let mut out = head(MAGIC, message, payload.len());
    out.reserve(payload.len() + MAC);
    out.extend_from_slice(payload);
    let mac = key.map(|k| k.mac(&out)).unwrap_or([0; 32]);
    out.extend_from_slice(&mac);
    out
}

/// The prefix and header of a frame with a `payload_len`-byte payload.
fn head(magic: [u8; 4], message: &Message, payload_len: usize) -> Vec<u8> {
    let header = serde_json::to_vec(message).expect("messages serialise");
    let mut out = Vec::with_capacity(PREFIX + header.len());
    out.extend_from_slice(&magic);
    out.extend_from_slice(&(header.len() as u32).to_le_bytes());
    out.extend_from_slice(&(payload_len as u32).to_le_bytes());
    out.extend_from_slice(&header);
    out
}

/// Checks the prefix and returns (header length, payload length). Whether the frame is
/// hashed is `prefix[..4] == MAGIC_HASHED`.
fn parse_prefix(prefix: &[u8; PREFIX]) -> Result<(usize, usize), WireError> {
    if prefix[..4] != MAGIC && prefix[..4] != MAGIC_HASHED {
        return Err(WireError::BadMagic);
    }
    let header = u32::from_le_bytes([prefix[4], prefix[5], prefix[6], prefix[7]]) as usize;
    let payload = u32::from_le_bytes([prefix[8], prefix[9], prefix[10], prefix[11]]) as usize;
    if header > HEADER_MAX {
        return Err(WireError::TooLarge {
            what: "header",
            len: header,
            max: HEADER_MAX,
        });
    }
    if payload > PAYLOAD_MAX {
        return Err(WireError::TooLarge {
            what: "payload",
            len: payload,
            max: PAYLOAD_MAX,
        });
    }
    Ok((header, payload))
}

/// Verifies the MAC over `body` (prefix, header, payload) and parses the header.
fn parse_body(
    mut body: Vec<u8>,
    header_len: usize,
    key: Option<&JobKey>,
) -> Result<Frame, WireError> {
    let mac_start = body.len() - MAC;
    let mac: [u8; 32] = body[mac_start..].try_into().expect("32 bytes");
    let payload_at = PREFIX + header_len;
    let payload_hash =
        (body[..4] == MAGIC_HASHED).then(|| ChunkHash::of(&body[payload_at..mac_start]));
    if let Some(key) = key {
        let expected = match &payload_hash {
            Some(hash) => key.mac_hashed(&body[..payload_at], hash),
            None => key.mac(&body[..mac_start]),
        };
        // Constant time is not needed against a local attacker who could read the key file,
        // but blake3's Hash comparison gives it anyway.
        if blake3::Hash::from(expected) != blake3::Hash::from(mac) {
            return Err(WireError::BadMac);
        }
    }
    body.truncate(mac_start);
    let message: Message = serde_json::from_slice(&body[PREFIX..PREFIX + header_len])
        .map_err(|e| WireError::Malformed(e.to_string()))?;
    let payload = Bytes::from(body).slice(payload_at..);
    Ok(Frame {
        message,
        payload,
        payload_hash,
    })
}

/// Reads one frame (blocking).
pub fn read_frame_sync(reader: &mut impl Read, key: Option<&JobKey>) -> Result<Frame, WireError> {
    let mut prefix = [0u8; PREFIX];
    match reader.read_exact(&mut prefix) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Err(WireError::Closed),
        Err(e) => return Err(e.into()),
    }
    let (header, payload) = parse_prefix(&prefix)?;
    let mut body = vec![0u8; PREFIX + header + payload + MAC];
    body[..PREFIX].copy_from_slice(&prefix);
    reader.read_exact(&mut body[PREFIX..])?;
    parse_body(body, header, key)
}

/// Writes one frame (blocking).
pub fn write_frame_sync(
    writer: &mut impl Write,
    message: &Message,
    payload: &[u8],
    key: Option<&JobKey>,
) -> Result<(), WireError> {
    writer.write_all(&encode(message, payload, key))?;
    writer.flush()?;
    Ok(())
}

/// Reads one frame.
pub async fn read_frame(
    reader: &mut (impl AsyncRead + Unpin),
    key: Option<&JobKey>,
) -> Result<Frame, WireError> {
    let mut prefix = [0u8; PREFIX];
    match reader.read_exact(&mut prefix).await {
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Err(WireError::Closed),
        Err(e) => return Err(e.into()),
    }
    let (header, payload) = parse_prefix(&prefix)?;
    let total = PREFIX + header + payload + MAC;
    // Read into capacity that is not zeroed first: zeroing a replica chunk's 4 MiB cost
    // about what its copy out of the socket does. The reads stop at the frame's end.
    let mut body = BytesMut::with_capacity(total);
    body.extend_from_slice(&prefix);
    while body.len() < total {
        let left = (total - body.len()) as u64;
        if (&mut *reader).take(left).read_buf(&mut body).await? == 0 {
            return Err(std::io::Error::from(std::io::ErrorKind::UnexpectedEof).into());
        }
    }
    let body = Vec::from(body);
    if payload < PAYLOAD_BLOCKING {
        return parse_body(body, header, key);
    }
    // Hashing megabytes would hold a runtime worker (and every task queued behind it).
    let key = key.cloned();
    tokio::task::spawn_blocking(move || parse_body(body, header, key.as_ref()))
        .await
        .map_err(|e| WireError::Malformed(format!("checking a frame: {e}")))?
}

/// Writes one hashed frame (`"LZW2"`): `payload_hash` must be the payload's blake3, which
/// the sender already has (a reader that finds otherwise refuses the frame as forged). The
/// payload is written from where it is, not copied into the frame.
pub async fn write_frame_hashed(
    writer: &mut (impl AsyncWrite + Unpin),
    message: &Message,
    payload: &[u8],
    payload_hash: &ChunkHash,
    key: Option<&JobKey>,
) -> Result<(), WireError> {
    if payload.len() > PAYLOAD_MAX {
        return Err(WireError::TooLarge {
            what: "payload",
            len: payload.len(),
            max: PAYLOAD_MAX,
        });
    }
    let head = head(MAGIC_HASHED, message, payload.len());
    let mac = key.map_or([0; 32], |k| k.mac_hashed(&head, payload_hash));
    if payload.len() < PAYLOAD_BLOCKING {
        // A small frame (a small region's chunk) goes in one write, not three: a send, and
        // the peer's wake-up, each.
        writer
            .write_all(&[&head[..], payload, &mac].concat())
            .await?;
    } else {
        writer.write_all(&head).await?;
        writer.write_all(payload).await?;
        writer.write_all(&mac).await?;
    }
    writer.flush().await?;
    Ok(())
}

/// Writes one frame.
pub async fn write_frame(
    writer: &mut (impl AsyncWrite + Unpin),
    message: &Message,
    payload: &[u8],
    key: Option<&JobKey>,
) -> Result<(), WireError> {
    writer.write_all(&encode(message, payload, key)).await?;
    writer.flush().await?;
    Ok(())
}

/// Concatenates named blobs into one payload, with their specs.
pub fn pack_blobs<B: AsRef<[u8]>>(blobs: &[(String, B)]) -> (Vec<BlobSpec>, Vec<u8>) {
    let specs = blobs
        .iter()
        .map(|(name, data)| BlobSpec {
            name: name.clone(),
            len: data.as_ref().len() as u32,
        })
        .collect();
    let payload = blobs
        .iter()
        .flat_map(|(_, d)| d.as_ref().iter().copied())
        .collect();
    (specs, payload)
}

/// Splits a payload back into named blobs; an error if the lengths do not add up.
pub fn unpack_blobs(
    specs: &[BlobSpec],
    payload: &Bytes,
) -> Result<Vec<(String, Bytes)>, WireError> {
    let total: usize = specs.iter().map(|s| s.len as usize).sum();
    if total != payload.len() {
        return Err(WireError::Malformed(format!(
            "blobs declare {total} bytes, payload has {}",
            payload.len()
        )));
    }
    let mut offset = 0;
    Ok(specs
        .iter()
        .map(|spec| {
            let data = payload.slice(offset..offset + spec.len as usize);
            offset += spec.len as usize;
            (spec.name.clone(), data)
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn region(name: &str, offset: u64, bytes: u64, kind: crate::store::RegionKind) -> SlotTensor {
        SlotTensor {
            name: name.into(),
            dtype: crate::format::DType::U8,
            global_shape: vec![bytes],
            slice: vec![crate::format::DimRange {
                start: 0,
                len: bytes,
            }],
            offset,
            bytes,
            kind,
        }
    }

    #[test]
    fn a_slot_is_cut_at_its_stored_regions_as_the_store_cuts_them() {
        use crate::store::RegionKind::{Read, Stored};
        let tensors = [
            region("b", 30, 25, Stored),
            region("a", 3, 10, Stored),
            region("read", 13, 17, Read),
            region("empty", 40, 0, Stored),
        ];
        let regions = SlotChunking::Regions.ranges(64, 8, &tensors).unwrap();
        assert_eq!(
            regions,
            [
                0..3,
                3..11,
                11..13,
                13..21,
                21..29,
                29..30,
                30..38,
                38..46,
                46..54,
                54..55,
                55..63,
                63..64
            ]
        );
        let fixed = SlotChunking::Fixed.ranges(20, 8, &tensors).unwrap();
        assert_eq!(fixed, [0..8, 8..16, 16..20]);
        assert_eq!(SlotChunking::Regions.ranges(0, 8, &[]).unwrap(), []);
    }

    #[test]
    fn a_slot_whose_stored_regions_overlap_or_overrun_it_is_not_cut() {
        use crate::store::RegionKind::Stored;
        let overlap = [region("a", 0, 10, Stored), region("b", 9, 4, Stored)];
        assert!(SlotChunking::Regions.ranges(64, 8, &overlap).is_err());
        let past = [region("a", 60, 10, Stored)];
        assert!(SlotChunking::Regions.ranges(64, 8, &past).is_err());
        assert!(SlotChunking::Regions.ranges(64, 0, &[]).is_err());
        // The fixed cut looks at no region.
        assert_eq!(
            SlotChunking::Fixed.ranges(9, 8, &overlap).unwrap(),
            [0..8, 8..9]
        );
    }

    #[test]
    fn a_begin_without_a_chunking_is_cut_fixed() {
        let json = r#"{"type":"ReplicaBegin","from_node":"n1","run":"run-a","rank":0,"world_size":1,"step":1,"slot_bytes":8,"chunk_bytes":4,"tensors":[],"blobs":[]}"#;
        let Message::ReplicaBegin { chunking, .. } = serde_json::from_str(json).unwrap() else {
            panic!("not a ReplicaBegin");
        };
        assert_eq!(chunking, SlotChunking::Fixed);
    }

    fn sample() -> Message {
        Message::Replicated {
            node: "n1".into(),
            run: "run-a".parse().unwrap(),
            rank: 3,
            world_size: 4,
            step: 17,
            durable_requested: false,
            upload: Some(UploadReport {
                running: true,
                t0: Some(16),
            }),
            rollback: RollbackMark { epoch: 2, seq: 1 },
        }
    }

    #[test]
    fn frames_round_trip_with_and_without_a_key() {
        let key = JobKey::derive(b"0123456789abcdef0123");
        for key in [None, Some(&key)] {
            let bytes = encode(&sample(), b"payload", key);
            let frame = read_frame_sync(&mut bytes.as_slice(), key).unwrap();
            assert_eq!(frame.message, sample());
            assert_eq!(&frame.payload[..], b"payload");
        }
    }

    #[test]
    fn a_wrong_key_or_any_flipped_byte_is_refused() {
        let key = JobKey::derive(b"the right key material");
        let other = JobKey::derive(b"the wrong key material");
        let bytes = encode(&sample(), b"payload", Some(&key));
        assert!(matches!(
            read_frame_sync(&mut bytes.as_slice(), Some(&other)),
            Err(WireError::BadMac)
        ));
        // An unauthenticated frame is refused by a reader that needs a key.
        let plain = encode(&sample(), b"payload", None);
        assert!(matches!(
            read_frame_sync(&mut plain.as_slice(), Some(&key)),
            Err(WireError::BadMac)
        ));
        for i in 12..bytes.len() {
            let mut garbled = bytes.clone();
            garbled[i] ^= 0x01;
            assert!(
                read_frame_sync(&mut garbled.as_slice(), Some(&key)).is_err(),
                "byte {i} flipped was accepted"
            );
        }
    }

    /// A hashed frame (`LZW2`) as `write_frame_hashed` sends it, over `payload_hash`.
    fn hashed(key: &JobKey, payload: &[u8], payload_hash: &ChunkHash) -> Vec<u8> {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        let mut out = Vec::new();
        runtime
            .block_on(write_frame_hashed(
                &mut out,
                &sample(),
                payload,
                payload_hash,
                Some(key),
            ))
            .unwrap();
        out
    }

    /// The MAC of a hashed frame covers the payload through its hash: the reader hands on
    /// the hash it computed, and refuses a payload changed on the way, a hash the sender got
    /// wrong (bytes that are not what it named), another key, and any flipped byte. Read
    /// through the async reader too, which hashes a large payload on a blocking thread.
    #[test]
    fn hashed_frames_authenticate_the_payload_through_its_hash() {
        let key = JobKey::derive(b"the right key material");
        let other = JobKey::derive(b"the wrong key material");
        let payload: Vec<u8> = (0..(300u32 << 10)).map(|i| (i % 251) as u8).collect();
        let hash = ChunkHash::of(&payload);
        let bytes = hashed(&key, &payload, &hash);
        assert_eq!(bytes[..4], MAGIC_HASHED);
        let frame = read_frame_sync(&mut bytes.as_slice(), Some(&key)).unwrap();
        assert_eq!(frame.message, sample());
        assert_eq!(&frame.payload[..], &payload[..]);
        assert_eq!(frame.payload_hash, Some(hash));
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .build()
            .unwrap();
        let frame = runtime
            .block_on(read_frame(&mut bytes.as_slice(), Some(&key)))
            .unwrap();
        assert_eq!(frame.payload_hash, Some(hash));
        // Plain frames carry no hash.
        let plain = encode(&sample(), &payload, Some(&key));
        let frame = read_frame_sync(&mut plain.as_slice(), Some(&key)).unwrap();
        assert_eq!(frame.payload_hash, None);

        let wrong_name = hashed(&key, &payload, &ChunkHash::of(b"other bytes"));
        assert!(matches!(
            read_frame_sync(&mut wrong_name.as_slice(), Some(&key)),
            Err(WireError::BadMac)
        ));
        assert!(matches!(
            read_frame_sync(&mut bytes.as_slice(), Some(&other)),
            Err(WireError::BadMac)
        ));
        for i in (12..bytes.len()).step_by(4099).chain([bytes.len() - 1]) {
            let mut garbled = bytes.clone();
            garbled[i] ^= 0x01;
            assert!(
                runtime
                    .block_on(read_frame(&mut garbled.as_slice(), Some(&key)))
                    .is_err(),
                "byte {i} flipped was accepted"
            );
        }
    }

    /// The async reader fills a frame from reads of any size without reading past its end
    /// (the next frame is intact), and a frame cut short is an error, not a frame.
    #[test]
    fn the_async_reader_takes_a_frame_in_pieces_and_stops_at_its_end() {
        let key = JobKey::derive(b"the right key material");
        let payload: Vec<u8> = (0..(300u32 << 10)).map(|i| (i % 253) as u8).collect();
        let mut bytes = encode(&sample(), &payload, Some(&key));
        bytes.extend(encode(&sample(), b"second", Some(&key)));
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .build()
            .unwrap();
        runtime.block_on(async {
            // A pipe that holds 4099 bytes: the reader gets the frames in pieces.
            let (mut writer, mut reader) = tokio::io::duplex(4099);
            let sending = tokio::spawn(async move { writer.write_all(&bytes).await.unwrap() });
            let first = read_frame(&mut reader, Some(&key)).await.unwrap();
            assert_eq!(first.message, sample());
            assert_eq!(&first.payload[..], &payload[..]);
            let second = read_frame(&mut reader, Some(&key)).await.unwrap();
            assert_eq!(&second.payload[..], b"second");
            sending.await.unwrap();
            assert!(matches!(
                read_frame(&mut reader, Some(&key)).await,
                Err(WireError::Closed)
            ));
        });
        let whole = encode(&sample(), &payload, Some(&key));
        let cut = &whole[..whole.len() - 100];
        let read = runtime.block_on(read_frame(&mut &cut[..], Some(&key)));
        assert!(
            matches!(&read, Err(WireError::Io(e)) if e.kind() == std::io::ErrorKind::UnexpectedEof),
            "{read:?}"
        );
    }

    #[test]
    fn oversized_frames_are_refused_before_allocating() {
        let mut bytes = encode(&sample(), b"", None);
        bytes[8..12].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(matches!(
            read_frame_sync(&mut bytes.as_slice(), None),
            Err(WireError::TooLarge {
                what: "payload",
                ..
            })
        ));
        let mut bytes = encode(&sample(), b"", None);
        bytes[4..8].copy_from_slice(&(HEADER_MAX as u32 + 1).to_le_bytes());
        assert!(matches!(
            read_frame_sync(&mut bytes.as_slice(), None),
            Err(WireError::TooLarge { what: "header", .. })
        ));
        assert!(matches!(
            read_frame_sync(&mut &b"GET / HTTP/1.1\r\n\r\n"[..], None),
            Err(WireError::BadMagic)
        ));
    }

    #[test]
    fn blobs_pack_and_unpack() {
        let blobs = vec![
            ("a".to_string(), Bytes::from_static(b"xyz")),
            ("b".to_string(), Bytes::new()),
        ];
        let (specs, payload) = pack_blobs(&blobs);
        assert_eq!(unpack_blobs(&specs, &Bytes::from(payload)).unwrap(), blobs);
        assert!(unpack_blobs(&specs, &Bytes::from_static(b"xy")).is_err());
    }
}
