//! The chunk object format: a fixed 88-byte header followed by the encoded payload.
//!
//! ```text
//! offset size field
//!      0    8 magic "LZCHUNK\0"
//!      8    2 format version (little endian: 1, or 2 for codecs 4 and 5)
//!     10    1 codec (0 raw, 1 zstd, 2 shuffle4+zstd, 3 xor(base)+shuffle4+zstd,
//!                    4 planes4, 5 xor(base)+planes4; codecs 4 and 5 only in version 2)
//!     11    1 delta depth (0 unless a delta codec, 3 or 5; the base chunk has depth - 1)
//!     12    4 reserved, zero
//!     16    8 raw length in bytes
//!     24   32 blake3 of the raw bytes (= the chunk's name)
//!     56   32 blake3 of the base chunk's raw bytes (zero unless a delta codec)
//! ```
//!
//! `planes4` is the byte transpose of `shuffle4` with each of the four byte planes stored on
//! its own: zstd-compressed, or raw when its bytes are close to uniformly distributed (the low
//! mantissa bytes of trained floats are), since zstd spends most of its time on such bytes and
//! saves nothing. Its payload starts with the four planes' stored lengths (u32 LE each; a
//! plane stored at its raw length is raw, a shorter one is a zstd frame), then the planes, then
//! the 0 to 3 bytes of an incomplete last element.
//!
//! A chunk is always named by the hash of its raw bytes, whatever codec stored it, so equal
//! data deduplicates across ranks, steps and codecs. [`decode`] never returns bytes whose
//! hash differs from the name the caller asked for.

use crate::hash::ChunkHash;
use crate::page_buf::PageBuf;

pub const CHUNK_MAGIC: [u8; 8] = *b"LZCHUNK\0";
/// The newest chunk format version: 2 added the `planes4` codecs. A chunk of an older codec is
/// still written as version 1, so a reader of version 1 reads everything it could before.
pub const CHUNK_FORMAT_VERSION: u16 = 2;
pub const HEADER_BYTES: usize = 88;
/// No chunk may claim more raw bytes than this; it bounds what a hostile header can allocate.
pub const CHUNK_RAW_BYTES_MAX: u64 = 256 << 20;
/// The deepest delta chain any writer may produce or any reader will follow.
pub const DELTA_DEPTH_MAX: u8 = 32;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Codec {
    Raw,
    Zstd,
    #[serde(rename = "shuffle4+zstd")]
    Shuffle4Zstd,
    #[serde(rename = "xor+shuffle4+zstd")]
    XorShuffle4Zstd,
    Planes4,
    #[serde(rename = "xor+planes4")]
    XorPlanes4,
}

impl Codec {
    pub const ALL: [Codec; 6] = [
        Codec::Raw,
        Codec::Zstd,
        Codec::Shuffle4Zstd,
        Codec::XorShuffle4Zstd,
        Codec::Planes4,
        Codec::XorPlanes4,
    ];

    /// Whether the codec stores an XOR delta against a base chunk.
    pub fn is_delta(self) -> bool {
        matches!(self, Codec::XorShuffle4Zstd | Codec::XorPlanes4)
    }

    /// The chunk format version a chunk of this codec is written with.
    fn version(self) -> u16 {
        match self {
            Codec::Planes4 | Codec::XorPlanes4 => 2,
            _ => 1,
        }
    }

    fn to_byte(self) -> u8 {
        match self {
            Codec::Raw => 0,
            Codec::Zstd => 1,
            Codec::Shuffle4Zstd => 2,
            Codec::XorShuffle4Zstd => 3,
            Codec::Planes4 => 4,
            Codec::XorPlanes4 => 5,
        }
    }

    fn from_byte(byte: u8) -> Option<Self> {
        Self::ALL.into_iter().find(|codec| codec.to_byte() == byte)
    }

    pub fn name(self) -> &'static str {
        match self {
            Codec::Raw => "raw",
            Codec::Zstd => "zstd",
            Codec::Shuffle4Zstd => "shuffle4+zstd",
            Codec::XorShuffle4Zstd => "xor+shuffle4+zstd",
            Codec::Planes4 => "planes4",
            Codec::XorPlanes4 => "xor+planes4",
        }
    }
}

/// What is wrong with a stored chunk. Every variant is an integrity failure.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CodecError {
    #[error("chunk is {len} bytes, shorter than its {HEADER_BYTES}-byte header")]
    Truncated { len: usize },
    #[error("chunk does not start with the chunk magic")]
    BadMagic,
    #[error("chunk format version {found} is not supported (this build reads versions 1 to {CHUNK_FORMAT_VERSION}); upgrade Lazarus")]
    UnknownVersion { found: u16 },
    #[error("unknown codec byte {0}")]
    UnknownCodec(u8),
    #[error("codec {codec:?} needs chunk format version {needs}, the chunk says {version}")]
    CodecNewerThanVersion {
        codec: Codec,
        version: u16,
        needs: u16,
    },
    #[error("bad plane table: {0}")]
    BadPlanes(&'static str),
    #[error("reserved header bytes are not zero")]
    ReservedNotZero,
    #[error("chunk claims {raw_len} raw bytes, more than the {CHUNK_RAW_BYTES_MAX} allowed")]
    TooLarge { raw_len: u64 },
    #[error("chunk header names {found}, but it was read as {expected}")]
    NameMismatch {
        expected: ChunkHash,
        found: ChunkHash,
    },
    #[error("delta chunk needs base {base} ({depth} deep), which was not supplied or has the wrong length")]
    BaseMissing { base: ChunkHash, depth: u8 },
    #[error("bad delta header: depth {depth}, codec {codec:?}")]
    BadDelta { depth: u8, codec: Codec },
    #[error("payload does not decompress: {0}")]
    Decompress(std::io::Error),
    #[error("payload decodes to {found} bytes, header says {expected}")]
    LengthMismatch { expected: u64, found: u64 },
    #[error("checksum mismatch: decoded bytes hash to {found}, chunk is named {expected}")]
    ChecksumMismatch {
        expected: ChunkHash,
        found: ChunkHash,
    },
}

/// The parsed fixed header of a chunk object.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ChunkHeader {
    pub codec: Codec,
    pub delta_depth: u8,
    pub raw_len: u64,
    pub raw_hash: ChunkHash,
    pub base: Option<ChunkHash>,
}

impl ChunkHeader {
    pub fn to_bytes(&self) -> [u8; HEADER_BYTES] {
        let mut out = [0u8; HEADER_BYTES];
        out[0..8].copy_from_slice(&CHUNK_MAGIC);
        out[8..10].copy_from_slice(&self.codec.version().to_le_bytes());
        out[10] = self.codec.to_byte();
        out[11] = self.delta_depth;
        out[16..24].copy_from_slice(&self.raw_len.to_le_bytes());
        out[24..56].copy_from_slice(&self.raw_hash.0);
        if let Some(base) = self.base {
            out[56..88].copy_from_slice(&base.0);
        }
        out
    }

    pub fn parse(bytes: &[u8]) -> Result<Self, CodecError> {
        if bytes.len() < HEADER_BYTES {
            return Err(CodecError::Truncated { len: bytes.len() });
        }
        if bytes[0..8] != CHUNK_MAGIC {
            return Err(CodecError::BadMagic);
        }
        let version = u16::from_le_bytes([bytes[8], bytes[9]]);
        if !(1..=CHUNK_FORMAT_VERSION).contains(&version) {
            return Err(CodecError::UnknownVersion { found: version });
        }
        let codec = Codec::from_byte(bytes[10]).ok_or(CodecError::UnknownCodec(bytes[10]))?;
        if codec.version() > version {
            return Err(CodecError::CodecNewerThanVersion {
                codec,
                version,
                needs: codec.version(),
            });
        }
        let delta_depth = bytes[11];
        if bytes[12..16] != [0; 4] {
            return Err(CodecError::ReservedNotZero);
        }
        let raw_len = u64::from_le_bytes(bytes[16..24].try_into().expect("8 bytes"));
        if raw_len > CHUNK_RAW_BYTES_MAX {
            return Err(CodecError::TooLarge { raw_len });
        }
        let raw_hash = ChunkHash(bytes[24..56].try_into().expect("32 bytes"));
        let base_bytes: [u8; 32] = bytes[56..88].try_into().expect("32 bytes");
        let is_delta = codec.is_delta();
        let has_base = base_bytes != [0u8; 32];
        if is_delta != has_base || is_delta != (delta_depth > 0) || delta_depth > DELTA_DEPTH_MAX {
            return Err(CodecError::BadDelta {
                depth: delta_depth,
                codec,
            });
        }
        Ok(Self {
            codec,
            delta_depth,
            raw_len,
            raw_hash,
            base: has_base.then_some(ChunkHash(base_bytes)),
        })
    }
}

/// The raw bytes of the chunk a delta is taken against, with its place in its own chain.
#[derive(Clone, Copy, Debug)]
pub struct DeltaBase<'a> {
    pub hash: ChunkHash,
    /// Depth of the base itself: 0 if it is stored whole.
    pub depth: u8,
    pub raw: &'a [u8],
}

/// An encoded chunk object, ready to upload: page-aligned, so that a write around the page
/// cache sends it from where it lies.
#[derive(Clone, Debug)]
pub struct EncodedChunk {
    pub header: ChunkHeader,
    pub bytes: PageBuf,
}

/// Encodes `raw` with exactly `codec`. `base` is required for the delta codecs and ignored
/// otherwise. `raw_hash` must be the blake3 of `raw` (callers hash once, to deduplicate).
pub fn encode_with(
    raw: &[u8],
    raw_hash: ChunkHash,
    codec: Codec,
    base: Option<DeltaBase<'_>>,
    zstd_level: i32,
) -> EncodedChunk {
    let base = codec
        .is_delta()
        .then(|| base.expect("a delta codec needs a base"));
    encode(
        raw,
        raw_hash,
        codec,
        base.map(|b| (b.hash, b.depth)),
        base.map(|b| Companion::Xor(b.raw)),
        zstd_level,
    )
}

/// [`encode_with`] of a delta whose base is named by `delta` (its chunk and that chunk's
/// depth) and whose bytes are the `companion`'s, which a copy of `raw` may also go to.
fn encode(
    raw: &[u8],
    raw_hash: ChunkHash,
    codec: Codec,
    delta: Option<(ChunkHash, u8)>,
    companion: Option<Companion<'_>>,
    zstd_level: i32,
) -> EncodedChunk {
    assert!(
        raw.len() as u64 <= CHUNK_RAW_BYTES_MAX,
        "chunk larger than CHUNK_RAW_BYTES_MAX"
    );
    assert_eq!(
        codec.is_delta(),
        delta.is_some() && companion.as_ref().and_then(Companion::base).is_some(),
        "a delta codec, and only one, is encoded against a base"
    );
    assert!(
        companion.is_none() || !matches!(codec, Codec::Raw | Codec::Zstd),
        "only a transposing codec reads or writes a companion"
    );
    if let Some(companion) = &companion {
        assert_eq!(
            companion.len(),
            raw.len(),
            "a delta base must have the chunk's length"
        );
    }
    if let Some((_, depth)) = delta {
        assert!(depth < DELTA_DEPTH_MAX, "delta chain too deep");
    }
    let header = ChunkHeader {
        codec,
        delta_depth: delta.map_or(0, |(_, depth)| depth + 1),
        raw_len: raw.len() as u64,
        raw_hash,
        base: delta.map(|(hash, _)| hash),
    };
    let payload_max = match codec {
        Codec::Raw => raw.len(),
        Codec::Zstd | Codec::Shuffle4Zstd | Codec::XorShuffle4Zstd => {
            zstd::zstd_safe::compress_bound(raw.len())
        }
        Codec::Planes4 | Codec::XorPlanes4 => {
            PLANE_TABLE_BYTES + raw.len() + frame_slack(raw.len())
        }
    };
    let mut bytes = PageBuf::with_capacity(HEADER_BYTES + payload_max);
    bytes.extend_from_slice(&header.to_bytes());
    match codec {
        Codec::Raw => bytes.extend_from_slice(raw),
        Codec::Zstd => put_compressed(&mut bytes, raw, zstd_level),
        _ => put_transposed(&mut bytes, codec, raw, companion, zstd_level),
    }
    EncodedChunk { header, bytes }
}

/// A second buffer of a chunk's length, which the transpose reads or writes in the pass that
/// reads the chunk.
enum Companion<'a> {
    /// The delta's base: the transpose stores the XOR of the chunk with it.
    Xor(&'a [u8]),
    /// The delta's base, which the chunk then replaces: each element of the base is read,
    /// then written over with the chunk's.
    XorThenCopy(&'a mut [u8]),
    /// Where a copy of the chunk goes.
    Copy(&'a mut [u8]),
}

impl Companion<'_> {
    fn len(&self) -> usize {
        match self {
            Companion::Xor(bytes) => bytes.len(),
            Companion::XorThenCopy(bytes) | Companion::Copy(bytes) => bytes.len(),
        }
    }

    /// The bytes of the base the chunk is encoded against, if it is one.
    fn base(&self) -> Option<&[u8]> {
        match self {
            Companion::Xor(base) => Some(base),
            Companion::XorThenCopy(base) => Some(base),
            Companion::Copy(_) => None,
        }
    }
}

/// Appends the payload of a transposing codec (2 to 5) of `raw`, or of its XOR delta against
/// the `companion` for a delta codec (taken in the same pass as the transpose).
fn put_transposed(
    out: &mut PageBuf,
    codec: Codec,
    raw: &[u8],
    companion: Option<Companion<'_>>,
    zstd_level: i32,
) {
    match codec {
        Codec::Planes4 | Codec::XorPlanes4 => put_planes(out, raw, companion, zstd_level),
        Codec::Shuffle4Zstd | Codec::XorShuffle4Zstd => {
            with_scratch(&SHUFFLED, raw.len(), |shuffled| {
                shuffle4_xor_into(raw, companion, shuffled);
                put_compressed(out, shuffled, zstd_level)
            })
        }
        Codec::Raw | Codec::Zstd => unreachable!("{codec:?} does not transpose"),
    }
}

/// How the writer picks a codec for one chunk.
#[derive(Clone, Copy, Debug)]
pub struct CodecPolicy {
    /// Bytes per element of the tensor the chunk belongs to; 4 enables the byte planes.
    pub element_bytes: usize,
    pub zstd_level: i32,
    /// Deltas are only taken while the base's depth is below this.
    pub delta_depth_max: u8,
}

/// Encodes `raw` with whichever allowed codec stores it smallest: a delta against `base` when
/// one is given and the chain is not too deep, planes4 for 4-byte elements, plain zstd
/// otherwise, and raw when compression does not pay. For 4-byte elements the delta and the
/// plain encoding are compared by their planes' entropy, and only the smaller is compressed.
pub fn encode_best(
    raw: &[u8],
    raw_hash: ChunkHash,
    base: Option<DeltaBase<'_>>,
    policy: CodecPolicy,
) -> EncodedChunk {
    let base = base.filter(|base| base_allowed(raw, base, policy));
    let level = policy.zstd_level;
    let mut best = if policy.element_bytes == 4 {
        match base.filter(|base| delta_pays(raw, base.raw)) {
            Some(base) => encode_with(raw, raw_hash, Codec::XorPlanes4, Some(base), level),
            None => encode_with(raw, raw_hash, Codec::Planes4, None, level),
        }
    } else {
        let plain = encode_with(raw, raw_hash, Codec::Zstd, None, level);
        let delta =
            base.map(|base| encode_with(raw, raw_hash, Codec::XorShuffle4Zstd, Some(base), level));
        match delta {
            Some(delta) if delta.bytes.len() < plain.bytes.len() => delta,
            _ => plain,
        }
    };
    if best.bytes.len() >= HEADER_BYTES + raw.len() {
        best = encode_with(raw, raw_hash, Codec::Raw, None, level);
    }
    best
}

/// [`encode_best`] against the bytes in `base`, which it leaves holding a copy of `raw`.
/// `delta` names those bytes (their chunk and its depth); `None` where they are not to be
/// encoded against. For 4-byte elements the copy is written in the transpose's pass, which
/// reads each element of the base just before it writes over it: `ckptd` keeps its next delta
/// base so, each chunk landing over the one it was encoded against, with no pass of its own.
pub fn encode_best_over(
    raw: &[u8],
    raw_hash: ChunkHash,
    base: &mut [u8],
    delta: Option<(ChunkHash, u8)>,
    policy: CodecPolicy,
) -> EncodedChunk {
    assert_eq!(
        base.len(),
        raw.len(),
        "a delta base must have the chunk's length"
    );
    if policy.element_bytes != 4 {
        let delta = delta.map(|(hash, depth)| DeltaBase {
            hash,
            depth,
            raw: base,
        });
        let best = encode_best(raw, raw_hash, delta, policy);
        base.copy_from_slice(raw);
        return best;
    }
    let delta = delta.filter(|&(_, depth)| depth_allowed(depth, policy) && delta_pays(raw, base));
    let (codec, companion) = match delta {
        Some(_) => (Codec::XorPlanes4, Companion::XorThenCopy(base)),
        None => (Codec::Planes4, Companion::Copy(base)),
    };
    let level = policy.zstd_level;
    let best = encode(raw, raw_hash, codec, delta, Some(companion), level);
    if best.bytes.len() >= HEADER_BYTES + raw.len() {
        return encode(raw, raw_hash, Codec::Raw, None, None, level);
    }
    best
}

/// Whether `policy` lets `raw` be encoded against `base`: of its length, and the chain not
/// too deep.
fn base_allowed(raw: &[u8], base: &DeltaBase<'_>, policy: CodecPolicy) -> bool {
    base.raw.len() == raw.len() && depth_allowed(base.depth, policy)
}

/// Whether `policy` lets a chunk be a delta against a base of `depth`.
fn depth_allowed(depth: u8, policy: CodecPolicy) -> bool {
    depth < policy.delta_depth_max.min(DELTA_DEPTH_MAX)
}

/// Whether a delta of 4-byte elements against `base` stores smaller than `raw` alone, by the
/// planes' estimated sizes. Judged on the chunk's first elements: a chunk is a piece of one
/// tensor, alike throughout, and the whole would cost a third of the encoding's time.
fn delta_pays(raw: &[u8], base: &[u8]) -> bool {
    let sample = raw.len().min(ESTIMATE_SAMPLE_BYTES);
    let raw = &raw[..sample];
    estimated_planes_bytes(raw, Some(&base[..sample])) < estimated_planes_bytes(raw, None)
}

/// Decodes a chunk object that was fetched under the name `expected`.
///
/// For a delta chunk, `base_raw` must hold the verified raw bytes of `header.base`. The
/// returned bytes always hash to `expected`.
pub fn decode(
    bytes: &[u8],
    expected: ChunkHash,
    base_raw: Option<&[u8]>,
) -> Result<Vec<u8>, CodecError> {
    let header = ChunkHeader::parse(bytes)?;
    if header.raw_hash != expected {
        return Err(CodecError::NameMismatch {
            expected,
            found: header.raw_hash,
        });
    }
    let payload = &bytes[HEADER_BYTES..];
    let base = match header.base {
        Some(base_hash) => Some(
            base_raw
                .filter(|b| b.len() as u64 == header.raw_len)
                .ok_or(CodecError::BaseMissing {
                    base: base_hash,
                    depth: header.delta_depth,
                })?,
        ),
        None => None,
    };
    let mut raw = match header.codec {
        Codec::Raw => payload.to_vec(),
        Codec::Zstd => decompress(payload, header.raw_len)?,
        Codec::Shuffle4Zstd | Codec::XorShuffle4Zstd => {
            unshuffle4(&decompress(payload, header.raw_len)?)
        }
        Codec::Planes4 | Codec::XorPlanes4 => read_planes(payload, header.raw_len as usize)?,
    };
    if raw.len() as u64 != header.raw_len {
        return Err(CodecError::LengthMismatch {
            expected: header.raw_len,
            found: raw.len() as u64,
        });
    }
    if let Some(base) = base {
        xor_in_place(&mut raw, base);
    }
    let found = ChunkHash::of(&raw);
    if found != expected {
        return Err(CodecError::ChecksumMismatch { expected, found });
    }
    Ok(raw)
}

/// `bytes` compressed at `level` into `frame`, which holds at least zstd's bound for them;
/// returns the frame's length.
fn compress_to(bytes: &[u8], level: i32, frame: &mut [u8]) -> usize {
    zstd::bulk::Compressor::new(level)
        .expect("a zstd compression context")
        .compress_to_buffer(bytes, frame)
        .expect(FRAME_FITS)
}

const FRAME_FITS: &str = "zstd compression into a buffer of the bound's size cannot fail";

/// Appends `bytes` compressed at `level` to `out`.
fn put_compressed(out: &mut PageBuf, bytes: &[u8], level: i32) {
    put_frame(out, bytes.len(), |frame| compress_to(bytes, level, frame));
}

/// Appends the frame `compress` writes of `len` bytes to `out`, straight into its memory
/// (room for zstd's bound of them), and returns the frame's length.
fn put_frame(out: &mut PageBuf, len: usize, compress: impl FnOnce(&mut [u8]) -> usize) -> usize {
    let start = out.len();
    let frame_len = compress(out.grow(zstd::zstd_safe::compress_bound(len)));
    out.truncate(start + frame_len);
    frame_len
}

/// Decompresses with this thread's context, made once: a fresh one per call (`zstd::bulk::
/// decompress`) allocated and set up its tables for every plane of every chunk read.
fn decompress(payload: &[u8], raw_len: u64) -> Result<Vec<u8>, CodecError> {
    thread_local! {
        static DECOMPRESSOR: std::cell::RefCell<Option<zstd::bulk::Decompressor<'static>>> =
            const { std::cell::RefCell::new(None) };
    }
    DECOMPRESSOR.with(|cell| {
        let mut cell = cell.borrow_mut();
        let decompressor = match &mut *cell {
            Some(decompressor) => decompressor,
            empty => empty.insert(zstd::bulk::Decompressor::new().map_err(CodecError::Decompress)?),
        };
        // The capacity bound stops a hostile payload from inflating past the header's length.
        decompressor
            .decompress(payload, raw_len as usize)
            .map_err(CodecError::Decompress)
    })
}

/// Compresses one byte plane. A plane's bytes are alike in their distribution (the exponent
/// bytes of floats of similar size) more than they repeat in runs, so zstd's entropy coder does
/// most of the work. At the store's default level (1 or below) the plane gets level 1 with a
/// 4 KiB hash table (`HashLog` 10, which stays in the L1 cache) and a match search that, where it
/// finds nothing, steps ahead about 257 bytes at a time (`TargetLength` 256, in zstd's fast
/// strategy): on such planes matches are few, and looking for one every few bytes cost more
/// than the entropy coding. The literals are always entropy-coded (zstd would leave them raw
/// once `TargetLength` is set). Measured on the planes that compress of a trained `tiny` state
/// (472.8 MB after 10 steps, step 5 its delta base), per plane byte, against `TargetLength` 4:
/// the plain planes compress in 0.68 ns instead of 1.00 (plain level 1: 1.56) and decompress in
/// 0.32 instead of 0.36, 11% larger; the XOR-delta planes in 0.81 instead of 1.27 and 0.45
/// instead of 0.60, 0.9% larger. The whole state stores 1.1% (plain) and 0.3% (delta) more
/// bytes, and encodes in 0.45 and 0.71 ns per byte instead of 0.62 and 0.98. Higher levels are
/// used as they are. The frames are standard zstd: any decoder reads them.
fn compress_plane_to(plane: &[u8], level: i32, frame: &mut [u8]) -> usize {
    use zstd::zstd_safe::{CParameter, ParamSwitch};
    if level > 1 {
        return compress_to(plane, level, frame);
    }
    thread_local! {
        static COMPRESSOR: std::cell::RefCell<Option<zstd::bulk::Compressor<'static>>> =
            const { std::cell::RefCell::new(None) };
    }
    COMPRESSOR.with(|cell| {
        let mut cell = cell.borrow_mut();
        let compressor = cell.get_or_insert_with(|| {
            let mut compressor =
                zstd::bulk::Compressor::new(1).expect("a zstd compression context");
            for parameter in [
                CParameter::HashLog(10),
                CParameter::TargetLength(256),
                CParameter::LiteralCompressionMode(ParamSwitch::Enable),
            ] {
                compressor
                    .set_parameter(parameter)
                    .expect("zstd takes the plane parameters");
            }
            compressor
        });
        compressor
            .compress_to_buffer(plane, frame)
            .expect(FRAME_FITS)
    })
}

/// Appends `plane` compressed as [`compress_plane_to`] does to `out`, straight into its
/// memory, if the frame is shorter than the plane. Returns the frame's length; `None` (and
/// `out` as it was) where it is not shorter.
fn put_plane_frame(out: &mut PageBuf, plane: &[u8], level: i32) -> Option<usize> {
    let start = out.len();
    let frame_len = put_frame(out, plane.len(), |frame| {
        compress_plane_to(plane, level, frame)
    });
    if frame_len < plane.len() {
        return Some(frame_len);
    }
    out.truncate(start);
    None
}

/// The bytes a chunk of `raw_len` bytes may need past its raw length while a plane's frame is
/// compressed into it: room for zstd's bound of a plane, where the plane itself would take
/// its length.
fn frame_slack(raw_len: usize) -> usize {
    zstd::zstd_safe::compress_bound(raw_len / 4) - raw_len / 4
}

/// The planes4 payload's table: the stored length of each of the four planes, u32 LE.
const PLANE_TABLE_BYTES: usize = 16;

/// A plane whose bytes carry at least this many bits of order-0 entropy each is stored raw:
/// zstd would save under 2.5% of it (its entropy coder gets no closer than that), and it
/// spends the most time on exactly such bytes (the low mantissa bytes of trained floats).
const PLANE_ENTROPY_BITS_MAX: f64 = 7.8;

/// Appends the planes4 payload of `raw`, or of its XOR delta against the `companion`. Which
/// planes zstd is tried on is judged first, on the bytes each plane will hold
/// ([`plane_entropy_bits`]). The transpose writes the planes stored raw before the first one
/// tried (the low bytes of trained floats come first) where they are stored, and the others
/// into a buffer of the thread's, from which each is compressed straight into the chunk (or,
/// where its frame is not shorter, copied). Every stored byte is written into the chunk once:
/// when frames were compressed into a buffer of their own and then copied into the chunk,
/// memory copies, the frames' most of them, were 4% of a daemon's CPU in an upload of XOR
/// deltas, whose planes all compress.
fn put_planes(out: &mut PageBuf, raw: &[u8], companion: Option<Companion<'_>>, zstd_level: i32) {
    let plane_len = raw.len() / 4;
    let base = companion.as_ref().and_then(Companion::base);
    let tried: [bool; 4] =
        std::array::from_fn(|lane| plane_entropy_bits(raw, base, lane) < PLANE_ENTROPY_BITS_MAX);
    let in_place = tried.iter().take_while(|&&tried| !tried).count();
    let table_at = out.len();
    out.extend_from_slice(&[0; PLANE_TABLE_BYTES]);
    let mut stored_lens = [plane_len; 4];
    with_scratch(&SHUFFLED, raw.len(), |shuffled| {
        let (later, tail) = shuffled.split_at_mut(4 * plane_len);
        {
            // A plane's place in `later` is its lane's, whether or not it goes there.
            let mut placed = out.grow(in_place * plane_len).chunks_mut(plane_len.max(1));
            let mut apart = later.chunks_mut(plane_len.max(1));
            let planes: [&mut [u8]; 4] = std::array::from_fn(|lane| {
                let apart = apart.next().unwrap_or_default();
                if lane < in_place {
                    placed.next().unwrap_or_default()
                } else {
                    apart
                }
            });
            transpose_into(raw, companion, planes, tail);
        }
        for lane in in_place..4 {
            let plane = &later[lane * plane_len..(lane + 1) * plane_len];
            let frame_len = if tried[lane] {
                put_plane_frame(out, plane, zstd_level)
            } else {
                None
            };
            match frame_len {
                Some(frame_len) => stored_lens[lane] = frame_len,
                None => out.extend_from_slice(plane),
            }
        }
        out.extend_from_slice(tail);
    });
    for (lane, stored_len) in stored_lens.into_iter().enumerate() {
        let stored_len = u32::try_from(stored_len).expect("a plane of a chunk fits u32");
        out[table_at + 4 * lane..table_at + 4 * (lane + 1)]
            .copy_from_slice(&stored_len.to_le_bytes());
    }
}

/// The four planes of a planes4 payload of `raw_len` bytes (a raw plane borrowed, a
/// compressed one decompressed) and the bytes of its incomplete last element.
type Planes<'a> = ([std::borrow::Cow<'a, [u8]>; 4], &'a [u8]);

fn planes_of(payload: &[u8], raw_len: usize) -> Result<Planes<'_>, CodecError> {
    let plane_len = raw_len / 4;
    let table = payload
        .get(..PLANE_TABLE_BYTES)
        .ok_or(CodecError::BadPlanes(
            "payload shorter than its plane table",
        ))?;
    let mut at = PLANE_TABLE_BYTES;
    let mut planes: [std::borrow::Cow<'_, [u8]>; 4] = Default::default();
    for (lane, plane) in planes.iter_mut().enumerate() {
        let stored_len =
            u32::from_le_bytes(table[4 * lane..4 * (lane + 1)].try_into().expect("4 bytes"))
                as usize;
        if stored_len > plane_len {
            return Err(CodecError::BadPlanes("a plane is stored longer than it is"));
        }
        let stored = payload
            .get(at..at + stored_len)
            .ok_or(CodecError::BadPlanes("the payload ends inside a plane"))?;
        at += stored_len;
        *plane = if stored_len == plane_len {
            stored.into()
        } else {
            let decoded = decompress(stored, plane_len as u64)?;
            if decoded.len() != plane_len {
                return Err(CodecError::LengthMismatch {
                    expected: plane_len as u64,
                    found: decoded.len() as u64,
                });
            }
            decoded.into()
        };
    }
    let tail = &payload[at..];
    if tail.len() != raw_len - 4 * plane_len {
        return Err(CodecError::BadPlanes(
            "the payload's length does not match its table",
        ));
    }
    Ok((planes, tail))
}

/// The raw bytes of a planes4 payload of `raw_len` bytes (before any delta is undone).
fn read_planes(payload: &[u8], raw_len: usize) -> Result<Vec<u8>, CodecError> {
    let ([p0, p1, p2, p3], tail) = planes_of(payload, raw_len)?;
    Ok(interleaved([&p0, &p1, &p2, &p3], tail))
}

/// The whole elements of four planes interleaved, then `tail` (the bytes of an incomplete
/// last element). Filled block by block rather than zeroed first and then overwritten: the
/// zeroing was 4% of an export's samples (the allocator clears reused memory).
fn interleaved(planes: [&[u8]; 4], tail: &[u8]) -> Vec<u8> {
    let mut raw = Vec::with_capacity(4 * planes[0].len() + tail.len());
    unshuffle4_blocks(planes, |block| raw.extend_from_slice(block));
    raw.extend_from_slice(tail);
    raw
}

/// Elements interleaved per block: 256 KiB of raw bytes, which stay in the processor's cache.
const BLOCK_ELEMENTS: usize = 64 << 10;

/// Interleaves four planes of equal length a block at a time and hands each block of whole
/// elements, in order, to `take`: the bytes pass through a buffer that stays in the cache.
fn unshuffle4_blocks(planes: [&[u8]; 4], mut take: impl FnMut(&[u8])) {
    let [p0, p1, p2, p3] = planes;
    let len = 4 * BLOCK_ELEMENTS.min(p0.len());
    with_scratch(&BLOCK, len, |block| {
        for start in (0..p0.len()).step_by(BLOCK_ELEMENTS) {
            let end = (start + BLOCK_ELEMENTS).min(p0.len());
            let block = &mut block[..4 * (end - start)];
            unshuffle4_from(
                [
                    &p0[start..end],
                    &p1[start..end],
                    &p2[start..end],
                    &p3[start..end],
                ],
                block,
            );
            take(block);
        }
    })
}

/// Checks a chunk object fetched under the name `expected` as [`decode`] does, without
/// keeping its raw bytes (an audit needs only the verdict): a planes4 chunk is interleaved
/// and hashed a block at a time, in a buffer that stays in the processor's cache. Returns
/// the raw length.
pub fn check(
    bytes: &[u8],
    expected: ChunkHash,
    base_raw: Option<&[u8]>,
) -> Result<u64, CodecError> {
    let header = ChunkHeader::parse(bytes)?;
    if header.codec != Codec::Planes4 || header.raw_hash != expected {
        return decode(bytes, expected, base_raw).map(|raw| raw.len() as u64);
    }
    let ([p0, p1, p2, p3], tail) = planes_of(&bytes[HEADER_BYTES..], header.raw_len as usize)?;
    let mut hasher = blake3::Hasher::new();
    unshuffle4_blocks([&p0, &p1, &p2, &p3], |block| {
        hasher.update(block);
    });
    hasher.update(tail);
    let found = ChunkHash(*hasher.finalize().as_bytes());
    if found != expected {
        return Err(CodecError::ChecksumMismatch { expected, found });
    }
    Ok(header.raw_len)
}

/// The bytes of a chunk that [`encode_best`] compares the delta and the plain encoding on.
const ESTIMATE_SAMPLE_BYTES: usize = 512 << 10;

/// What planes4 would store of `raw`, or of its XOR delta against `base`, from each plane's
/// entropy (zstd's entropy coder gets close to it on such planes; a plane of noise is stored as
/// it is). The planes' bytes are counted where they lie in `raw`, with no transpose.
fn estimated_planes_bytes(raw: &[u8], base: Option<&[u8]>) -> f64 {
    let plane_len = raw.len() / 4;
    (0..4)
        .map(|lane| plane_len as f64 * (plane_entropy_bits(raw, base, lane) / 8.0).min(1.0))
        .sum()
}

/// The order-0 entropy ([`entropy_bits_of`]) of plane `lane` of `raw`'s transpose, or of its
/// XOR with `base`: read where its bytes lie in `raw`, with no transpose.
fn plane_entropy_bits(raw: &[u8], base: Option<&[u8]>, lane: usize) -> f64 {
    let plane_len = raw.len() / 4;
    match base {
        Some(base) => entropy_bits_of(plane_len, |i| raw[4 * i + lane] ^ base[4 * i + lane]),
        None => entropy_bits_of(plane_len, |i| raw[4 * i + lane]),
    }
}

/// The bytes [`entropy_bits_of`] counts at most, and in how many runs.
const ENTROPY_SAMPLE_BYTES: usize = 16 << 10;
const ENTROPY_SAMPLE_BLOCKS: usize = 16;

/// Order-0 entropy of `bytes` in bits per byte ([`entropy_bits_of`]).
#[cfg(test)]
fn entropy_bits(bytes: &[u8]) -> f64 {
    entropy_bits_of(bytes.len(), |i| bytes[i])
}

/// Order-0 entropy in bits per byte of the `len` bytes `byte(0)`, `byte(1)`, ..., from at most
/// [`ENTROPY_SAMPLE_BYTES`] of them: all of a short input, else [`ENTROPY_SAMPLE_BLOCKS`] runs
/// of consecutive bytes spread evenly over it (a sample is deterministic). Runs rather than
/// every nth byte: a tensor's rows are a power of two long, and a stride would count the same
/// columns over and over. The estimate's bias on uniform bytes is about 0.01 bits, far from
/// what it is compared against ([`PLANE_ENTROPY_BITS_MAX`]); counting every 8th byte of a
/// 1 MiB plane instead took 9% of a daemon's CPU in an upload.
///
/// The bytes are counted into four tables in turn, summed at the end: a plane of mostly one
/// value (the high bytes of a delta) would otherwise add to the same count at every byte, each
/// addition waiting for the one before (half the time of the encoding's own loops).
fn entropy_bits_of(len: usize, byte: impl Fn(usize) -> u8) -> f64 {
    let (blocks, block_len) = if len <= ENTROPY_SAMPLE_BYTES {
        (1, len)
    } else {
        (
            ENTROPY_SAMPLE_BLOCKS,
            ENTROPY_SAMPLE_BYTES / ENTROPY_SAMPLE_BLOCKS,
        )
    };
    let spacing = len / blocks;
    let mut tables = [[0u32; 256]; 4];
    for block in 0..blocks {
        let start = block * spacing;
        let end = start + block_len;
        let mut at = start;
        while at + 3 < end {
            for (lane, table) in tables.iter_mut().enumerate() {
                table[usize::from(byte(at + lane))] += 1;
            }
            at += 4;
        }
        while at < end {
            tables[0][usize::from(byte(at))] += 1;
            at += 1;
        }
    }
    let counts: [u64; 256] =
        std::array::from_fn(|value| tables.iter().map(|table| u64::from(table[value])).sum());
    let samples: u64 = counts.iter().sum();
    counts
        .iter()
        .filter(|&&count| count > 0)
        .map(|&count| {
            let share = count as f64 / samples as f64;
            -share * share.log2()
        })
        .sum()
}

std::thread_local! {
    /// Each thread's buffer for a chunk's shuffled bytes (or its delta's; of a planes4 chunk,
    /// the planes compressed from there): a fresh one per chunk costs a page fault and a
    /// zeroed page every 4 KiB of it.
    static SHUFFLED: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
    /// Each thread's block of interleaved bytes ([`unshuffle4_blocks`]).
    static BLOCK: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Runs `work` on this thread's `buffer`, `len` bytes long (contents unspecified).
fn with_scratch<T>(
    buffer: &'static std::thread::LocalKey<std::cell::RefCell<Vec<u8>>>,
    len: usize,
    work: impl FnOnce(&mut [u8]) -> T,
) -> T {
    buffer.with(|scratch| {
        let mut scratch = scratch.borrow_mut();
        if scratch.len() < len {
            scratch.resize(len, 0);
        }
        work(&mut scratch[..len])
    })
}

/// Byte transpose for 4-byte elements: all first bytes, then all second bytes, ... A tail that
/// is not a whole element is kept as is, at the end.
pub fn shuffle4(bytes: &[u8]) -> Vec<u8> {
    let mut out = vec![0u8; bytes.len()];
    shuffle4_into(bytes, &mut out);
    out
}

/// [`shuffle4`] into `out`, which has the length of `bytes`.
pub fn shuffle4_into(bytes: &[u8], out: &mut [u8]) {
    shuffle4_xor_into(bytes, None, out)
}

/// [`shuffle4_into`] of `bytes`, or of their XOR with the `companion`'s (of the same length),
/// which it may also copy `bytes` to: the delta and the copy are taken as the transpose reads,
/// with no pass of their own.
fn shuffle4_xor_into(bytes: &[u8], companion: Option<Companion<'_>>, out: &mut [u8]) {
    assert_eq!(bytes.len(), out.len(), "shuffle4 keeps the length");
    let elements = bytes.len() / 4;
    let (p0, rest) = out.split_at_mut(elements);
    let (p1, rest) = rest.split_at_mut(elements);
    let (p2, rest) = rest.split_at_mut(elements);
    let (p3, tail) = rest.split_at_mut(elements);
    transpose_into(bytes, companion, [p0, p1, p2, p3], tail)
}

/// [`shuffle4_xor_into`] with each plane, and the bytes of an incomplete last element
/// (`tail`), wherever they go.
fn transpose_into(
    bytes: &[u8],
    companion: Option<Companion<'_>>,
    planes: [&mut [u8]; 4],
    tail: &mut [u8],
) {
    let elements = bytes.len() / 4;
    assert!(
        planes.iter().all(|plane| plane.len() == elements) && tail.len() == bytes.len() % 4,
        "the planes and the tail hold the bytes' length"
    );
    let (bytes, raw_tail) = bytes.split_at(4 * elements);
    let whole = bytes.len();
    tail.copy_from_slice(raw_tail);
    let companion = companion.map(|companion| {
        assert_eq!(
            companion.len(),
            whole + tail.len(),
            "a delta base has the chunk's length"
        );
        match companion {
            Companion::Xor(base) => {
                xor_in_place(tail, &base[whole..]);
                Companion::Xor(&base[..whole])
            }
            Companion::XorThenCopy(base) => {
                let (base, base_tail) = base.split_at_mut(whole);
                xor_in_place(tail, base_tail);
                base_tail.copy_from_slice(raw_tail);
                Companion::XorThenCopy(base)
            }
            Companion::Copy(copy) => {
                let (copy, copy_tail) = copy.split_at_mut(whole);
                copy_tail.copy_from_slice(raw_tail);
                Companion::Copy(copy)
            }
        }
    });
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the processor has AVX2, which is all that `transpose_avx2` requires.
        #[allow(unsafe_code)]
        unsafe {
            return transpose_avx2(bytes, companion, planes);
        }
    }
    transpose(bytes, companion, planes)
}

/// The transpose over whole elements, compiled once for the build's target and once with AVX2
/// ([`transpose_avx2`]: about 5x as fast where the processor has it; the portable build has
/// only SSE2). A companion that is written to is written a block at a time, right after the
/// block's transpose read it, while both are in the cache: a store to it in the transpose's
/// own loop kept the compiler from vectorising that loop, which then cost more than the
/// transpose and a copy of its own together.
#[inline(always)]
fn transpose(bytes: &[u8], companion: Option<Companion<'_>>, planes: [&mut [u8]; 4]) {
    match companion {
        None => transpose_words(bytes, None, planes),
        Some(Companion::Xor(base)) => transpose_words(bytes, Some(base), planes),
        Some(Companion::XorThenCopy(base)) => {
            in_blocks(bytes, base, planes, |words, base, planes| {
                transpose_words(words, Some(base), planes);
                base.copy_from_slice(words);
            })
        }
        Some(Companion::Copy(copy)) => in_blocks(bytes, copy, planes, |words, copy, planes| {
            transpose_words(words, None, planes);
            copy.copy_from_slice(words);
        }),
    }
}

/// Elements per block of [`in_blocks`]: 8 KiB of the chunk, as much of the companion and of
/// the planes, all in a core's first-level cache.
const TRANSPOSE_BLOCK: usize = 2048;

/// Runs `work` over each block of whole elements of `bytes`, with the same block of `other`
/// and of each plane.
#[inline(always)]
fn in_blocks(
    bytes: &[u8],
    other: &mut [u8],
    [p0, p1, p2, p3]: [&mut [u8]; 4],
    mut work: impl FnMut(&[u8], &mut [u8], [&mut [u8]; 4]),
) {
    let block = 4 * TRANSPOSE_BLOCK;
    let planes = p0
        .chunks_mut(TRANSPOSE_BLOCK)
        .zip(p1.chunks_mut(TRANSPOSE_BLOCK))
        .zip(p2.chunks_mut(TRANSPOSE_BLOCK))
        .zip(p3.chunks_mut(TRANSPOSE_BLOCK));
    for ((words, other), (((a, b), c), d)) in
        bytes.chunks(block).zip(other.chunks_mut(block)).zip(planes)
    {
        work(words, other, [a, b, c, d]);
    }
}

/// The transpose loops, of `bytes` or of their XOR with `base`. Zipped slices let the
/// compiler drop the bounds checks and vectorise.
#[inline(always)]
fn transpose_words(bytes: &[u8], base: Option<&[u8]>, [p0, p1, p2, p3]: [&mut [u8]; 4]) {
    let planes = p0.iter_mut().zip(p1).zip(p2).zip(p3);
    let words = bytes.chunks_exact(4);
    match base {
        None => {
            for (word, (((a, b), c), d)) in words.zip(planes) {
                (*a, *b, *c, *d) = (word[0], word[1], word[2], word[3]);
            }
        }
        Some(base) => {
            for ((word, other), (((a, b), c), d)) in words.zip(base.chunks_exact(4)).zip(planes) {
                (*a, *b, *c, *d) = (
                    word[0] ^ other[0],
                    word[1] ^ other[1],
                    word[2] ^ other[2],
                    word[3] ^ other[3],
                );
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn transpose_avx2(bytes: &[u8], companion: Option<Companion<'_>>, planes: [&mut [u8]; 4]) {
    transpose(bytes, companion, planes)
}

/// Inverse of [`shuffle4`].
pub fn unshuffle4(bytes: &[u8]) -> Vec<u8> {
    let elements = bytes.len() / 4;
    let plane = |lane: usize| &bytes[lane * elements..(lane + 1) * elements];
    interleaved(
        [plane(0), plane(1), plane(2), plane(3)],
        &bytes[elements * 4..],
    )
}

/// Interleaves four planes of equal length into the whole elements at the start of `out`.
fn unshuffle4_from(planes: [&[u8]; 4], out: &mut [u8]) {
    let [p0, p1, p2, p3] = planes;
    assert!(out.len() / 4 == p0.len() && [p1, p2, p3].iter().all(|p| p.len() == p0.len()));
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the processor has AVX2, which is all that `unshuffle4_avx2` requires.
        #[allow(unsafe_code)]
        unsafe {
            return unshuffle4_avx2(planes, out);
        }
    }
    unshuffle4_loop(planes, out)
}

/// The inverse transpose loop, compiled like [`transpose`].
#[inline(always)]
fn unshuffle4_loop([p0, p1, p2, p3]: [&[u8]; 4], out: &mut [u8]) {
    for ((((word, a), b), c), d) in out.chunks_exact_mut(4).zip(p0).zip(p1).zip(p2).zip(p3) {
        word.copy_from_slice(&[*a, *b, *c, *d]);
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn unshuffle4_avx2(planes: [&[u8]; 4], out: &mut [u8]) {
    unshuffle4_loop(planes, out)
}

fn xor_in_place(target: &mut [u8], other: &[u8]) {
    for (a, b) in target.iter_mut().zip(other) {
        *a ^= b;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn floats(values: &[f32]) -> Vec<u8> {
        values.iter().flat_map(|v| v.to_le_bytes()).collect()
    }

    /// `count` floats uniform in [0, 1) from a xorshift generator seeded with `seed`.
    fn uniform(seed: u64, count: usize) -> impl Iterator<Item = f32> {
        let mut state = seed;
        (0..count).map(move |_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state >> 40) as f32 / (1u64 << 24) as f32
        })
    }

    proptest! {
        #[test]
        fn every_codec_round_trips(raw in proptest::collection::vec(any::<u8>(), 0..5000), codec_index in 0usize..4) {
            let codec = [Codec::Raw, Codec::Zstd, Codec::Shuffle4Zstd, Codec::Planes4][codec_index];
            let hash = ChunkHash::of(&raw);
            let encoded = encode_with(&raw, hash, codec, None, 3);
            prop_assert_eq!(ChunkHeader::parse(&encoded.bytes).unwrap(), encoded.header);
            prop_assert_eq!(decode(&encoded.bytes, hash, None).unwrap(), raw);
        }

        #[test]
        fn delta_chains_round_trip(
            first in proptest::collection::vec(any::<f32>(), 1..600),
            steps in proptest::collection::vec(proptest::collection::vec((0usize..600, any::<f32>()), 0..20), 1..6),
            planes in any::<bool>(),
        ) {
            let (whole, delta) = if planes {
                (Codec::Planes4, Codec::XorPlanes4)
            } else {
                (Codec::Shuffle4Zstd, Codec::XorShuffle4Zstd)
            };
            // A chain of steps, each a few elements different from the one before, encoded as
            // deltas on deltas and decoded back through the whole chain.
            let policy = CodecPolicy { element_bytes: 4, zstd_level: 3, delta_depth_max: 4 };
            let mut values = first.clone();
            let mut chain: Vec<(Vec<u8>, EncodedChunk)> = Vec::new();
            let raw = floats(&values);
            let hash = ChunkHash::of(&raw);
            chain.push((raw.clone(), encode_with(&raw, hash, whole, None, 3)));
            for edits in steps {
                for (index, value) in edits {
                    let len = values.len();
                    values[index % len] = value;
                }
                let raw = floats(&values);
                let hash = ChunkHash::of(&raw);
                let (base_raw, base_chunk) = chain.last().unwrap();
                let base = DeltaBase { hash: base_chunk.header.raw_hash, depth: base_chunk.header.delta_depth, raw: base_raw };
                let encoded = encode_with(&raw, hash, delta, Some(base), 3);
                prop_assert!(encoded.header.delta_depth <= 5);
                let best = encode_best(&raw, hash, Some(base), policy);
                prop_assert!(best.header.delta_depth <= policy.delta_depth_max);
                chain.push((raw, encoded));
            }
            // Decode every link from its base's decoded bytes.
            let mut previous: Option<Vec<u8>> = None;
            for (raw, chunk) in &chain {
                let decoded = decode(&chunk.bytes, chunk.header.raw_hash, previous.as_deref()).unwrap();
                prop_assert_eq!(&decoded, raw);
                previous = Some(decoded);
            }
        }

        #[test]
        fn a_delta_of_any_length_round_trips(
            pairs in proptest::collection::vec(any::<(u8, u8)>(), 0..3000),
            planes in any::<bool>(),
        ) {
            // Lengths that are not whole elements too: the tail is XORed beside the planes.
            let (raw, base): (Vec<u8>, Vec<u8>) = pairs.into_iter().unzip();
            let codec = if planes { Codec::XorPlanes4 } else { Codec::XorShuffle4Zstd };
            let hash = ChunkHash::of(&raw);
            let delta = DeltaBase { hash: ChunkHash::of(&base), depth: 0, raw: &base };
            let encoded = encode_with(&raw, hash, codec, Some(delta), 1);
            prop_assert_eq!(decode(&encoded.bytes, hash, Some(&base)).unwrap(), raw);
        }

        #[test]
        fn decode_never_panics_or_lies(bytes in proptest::collection::vec(any::<u8>(), 0..400), name in any::<[u8; 32]>()) {
            let expected = ChunkHash(name);
            if let Ok(raw) = decode(&bytes, expected, None) {
                prop_assert_eq!(ChunkHash::of(&raw), expected);
            }
        }

        #[test]
        fn shuffle_is_a_permutation(raw in proptest::collection::vec(any::<u8>(), 0..300)) {
            prop_assert_eq!(unshuffle4(&shuffle4(&raw)), raw);
        }

        #[test]
        fn the_portable_transpose_agrees_with_the_one_this_processor_runs(raw in proptest::collection::vec(any::<u8>(), 0..300)) {
            let elements = raw.len() / 4;
            let mut portable = vec![0u8; elements * 4];
            let (p0, rest) = portable.split_at_mut(elements);
            let (p1, rest) = rest.split_at_mut(elements);
            let (p2, p3) = rest.split_at_mut(elements);
            transpose(&raw, None, [p0, p1, p2, p3]);
            let shuffled = shuffle4(&raw);
            prop_assert_eq!(&shuffled[..elements * 4], &portable[..]);
            let plane = |lane: usize| &portable[lane * elements..(lane + 1) * elements];
            let mut back = vec![0u8; elements * 4];
            unshuffle4_loop([plane(0), plane(1), plane(2), plane(3)], &mut back);
            prop_assert_eq!(&back[..], &raw[..elements * 4]);
        }

        /// With each companion, the transpose is the plain one of the XOR (or of the bytes),
        /// the portable loop's the same, and a companion to copy to ends holding the bytes.
        #[test]
        fn the_transpose_with_a_companion_is_the_transpose_of_the_xor_and_leaves_the_copy(pairs in proptest::collection::vec(any::<(u8, u8)>(), 0..300)) {
            let (raw, base): (Vec<u8>, Vec<u8>) = pairs.into_iter().unzip();
            let mut delta = raw.clone();
            xor_in_place(&mut delta, &base);
            let elements = raw.len() / 4;
            for kind in 0..3 {
                let mut other = base.clone();
                let (companion, expected) = match kind {
                    0 => (Companion::Xor(&base), shuffle4(&delta)),
                    1 => (Companion::XorThenCopy(&mut other), shuffle4(&delta)),
                    _ => (Companion::Copy(&mut other), shuffle4(&raw)),
                };
                let mut fused = vec![0u8; raw.len()];
                shuffle4_xor_into(&raw, Some(companion), &mut fused);
                prop_assert_eq!(&fused, &expected);
                prop_assert_eq!(&other, if kind == 0 { &base } else { &raw });
                let mut other = base.clone();
                let companion = match kind {
                    0 => Companion::Xor(&base),
                    1 => Companion::XorThenCopy(&mut other),
                    _ => Companion::Copy(&mut other),
                };
                let mut portable = vec![0u8; elements * 4];
                let (p0, rest) = portable.split_at_mut(elements);
                let (p1, rest) = rest.split_at_mut(elements);
                let (p2, p3) = rest.split_at_mut(elements);
                transpose(&raw, Some(companion), [p0, p1, p2, p3]);
                prop_assert_eq!(&fused[..elements * 4], &portable[..]);
                prop_assert_eq!(&other[..elements * 4], if kind == 0 { &base[..elements * 4] } else { &raw[..elements * 4] });
            }
        }
    }

    /// A sampled estimate is close to the whole input's entropy, on bytes of noise (stored raw)
    /// and on rows whose first byte is always the same, which a sample of every nth byte would
    /// count far too often.
    #[test]
    fn a_sampled_entropy_is_close_to_the_whole() {
        use rand::{Rng, SeedableRng};
        let mut rng = rand::rngs::StdRng::seed_from_u64(5);
        let noise: Vec<u8> = (0..1 << 20).map(|_| rng.random()).collect();
        let rows: Vec<u8> = noise
            .iter()
            .enumerate()
            .map(|(i, &b)| if i % 64 == 0 { 0 } else { b % 16 })
            .collect();
        let whole = |bytes: &[u8]| {
            let mut counts = [0f64; 256];
            for &b in bytes {
                counts[usize::from(b)] += 1.0;
            }
            counts
                .iter()
                .filter(|&&c| c > 0.0)
                .map(|&c| -(c / bytes.len() as f64) * (c / bytes.len() as f64).log2())
                .sum::<f64>()
        };
        assert!(entropy_bits(&noise) > PLANE_ENTROPY_BITS_MAX + 0.15);
        for bytes in [&noise, &rows] {
            let (sampled, exact) = (entropy_bits(bytes), whole(bytes));
            assert!((sampled - exact).abs() < 0.03, "{sampled} against {exact}");
        }
    }

    /// The estimate, and the choice of the planes zstd is tried on, count each plane's bytes
    /// where they lie in the chunk: they must count what the transpose would put in the plane,
    /// whole and sampled (planes under and over 16 KiB).
    #[test]
    fn the_estimate_counts_the_planes_the_transpose_makes() {
        for len in [0usize, 3, 4101, 300_001] {
            let raw: Vec<u8> = (0..len)
                .map(|i| (i * 7 % 251) as u8 ^ (i >> 9) as u8)
                .collect();
            let other: Vec<u8> = (0..len).map(|i| (i * 13 % 241) as u8).collect();
            for base in [None, Some(&other[..])] {
                let mut shuffled = vec![0u8; len];
                shuffle4_xor_into(&raw, base.map(Companion::Xor), &mut shuffled);
                let plane_len = len / 4;
                let expected: f64 = (0..4)
                    .map(|lane| {
                        let plane = &shuffled[lane * plane_len..(lane + 1) * plane_len];
                        assert_eq!(plane_entropy_bits(&raw, base, lane), entropy_bits(plane));
                        plane_len as f64 * (entropy_bits(plane) / 8.0).min(1.0)
                    })
                    .sum();
                assert_eq!(estimated_planes_bytes(&raw, base), expected, "{len} bytes");
            }
        }
    }

    #[test]
    fn a_flipped_bit_is_caught() {
        let raw = floats(&(0..1000).map(|i| i as f32 * 0.001).collect::<Vec<_>>());
        let hash = ChunkHash::of(&raw);
        for codec in [Codec::Raw, Codec::Zstd, Codec::Shuffle4Zstd, Codec::Planes4] {
            let encoded = encode_with(&raw, hash, codec, None, 3);
            for position in [0, 9, 12, 20, 30, 60, HEADER_BYTES, encoded.bytes.len() - 1] {
                let mut damaged = encoded.bytes.clone();
                damaged[position] ^= 0x10;
                assert!(
                    decode(&damaged, hash, None).is_err(),
                    "{codec:?}: flip at {position} not caught"
                );
            }
            assert!(decode(&encoded.bytes[..encoded.bytes.len() - 1], hash, None).is_err());
        }
    }

    /// A step's 4096 floats and the next step's, every 64th of them changed, as bytes.
    fn a_step_and_the_next() -> (Vec<u8>, Vec<u8>) {
        let before: Vec<f32> = (0..4096)
            .map(|i| ((i * 7919) % 1000) as f32 / 997.0)
            .collect();
        let mut after = before.clone();
        for value in after.iter_mut().step_by(64) {
            *value += 1e-3;
        }
        (floats(&before), floats(&after))
    }

    #[test]
    fn delta_against_a_similar_step_is_smaller() {
        let (before, after) = a_step_and_the_next();
        let base = DeltaBase {
            hash: ChunkHash::of(&before),
            depth: 0,
            raw: &before,
        };
        let policy = CodecPolicy {
            element_bytes: 4,
            zstd_level: 3,
            delta_depth_max: 8,
        };
        let best = encode_best(&after, ChunkHash::of(&after), Some(base), policy);
        let plain = encode_with(&after, ChunkHash::of(&after), Codec::Planes4, None, 3);
        assert_eq!(best.header.codec, Codec::XorPlanes4);
        assert!(
            best.bytes.len() * 2 < plain.bytes.len(),
            "{} vs {}",
            best.bytes.len(),
            plain.bytes.len()
        );
        // The chain bound is honoured: a base already at the limit is not used.
        let deep = DeltaBase { depth: 8, ..base };
        assert_eq!(
            encode_best(&after, ChunkHash::of(&after), Some(deep), policy)
                .header
                .delta_depth,
            0
        );
    }

    /// Encoding over a base stores exactly what [`encode_best`] stores against it, whichever
    /// codec wins (a delta, planes, zstd, raw) and whatever the chain's depth, and leaves the
    /// chunk's bytes in the base.
    #[test]
    fn encoding_over_a_base_stores_what_encode_best_stores_and_leaves_the_chunk_there() {
        let (mut before, mut after) = a_step_and_the_next();
        before.extend_from_slice(&[1, 2, 3]);
        after.extend_from_slice(&[1, 2, 4]);
        let noise: Vec<u8> = uniform(7, after.len()).map(|u| (u * 256.0) as u8).collect();
        let mut codecs = Vec::new();
        for (raw, element_bytes, depth) in [
            (&after, 4, 0),
            (&after, 4, 8),
            (&after, 1, 0),
            (&noise, 4, 0),
        ] {
            let policy = CodecPolicy {
                element_bytes,
                zstd_level: 3,
                delta_depth_max: 8,
            };
            let hash = ChunkHash::of(raw);
            let base_hash = ChunkHash::of(&before);
            for delta in [Some((base_hash, depth)), None] {
                let offered = delta.map(|(hash, depth)| DeltaBase {
                    hash,
                    depth,
                    raw: &before,
                });
                let best = encode_best(raw, hash, offered, policy);
                let mut base = before.clone();
                let over = encode_best_over(raw, hash, &mut base, delta, policy);
                assert_eq!(over.header, best.header);
                assert_eq!(&over.bytes[..], &best.bytes[..]);
                assert_eq!(&base, raw, "the base holds the chunk");
                assert_eq!(decode(&over.bytes, hash, Some(&before)).unwrap(), *raw);
                codecs.push(over.header.codec);
            }
        }
        for codec in [Codec::XorPlanes4, Codec::Planes4, Codec::Zstd, Codec::Raw] {
            assert!(codecs.contains(&codec), "{codec:?} not among {codecs:?}");
        }
    }

    #[test]
    fn an_unknown_version_is_refused_with_its_number() {
        let raw = b"hello".to_vec();
        let mut encoded = encode_with(&raw, ChunkHash::of(&raw), Codec::Raw, None, 3).bytes;
        encoded[8] = 9;
        let error = decode(&encoded, ChunkHash::of(&raw), None).unwrap_err();
        assert!(
            matches!(error, CodecError::UnknownVersion { found: 9 }),
            "{error}"
        );
    }

    /// `raw`'s hash, its planes4 encoding at `level`, and the stored length of each plane.
    fn planes4_of(raw: &[u8], level: i32) -> (ChunkHash, EncodedChunk, Vec<usize>) {
        let hash = ChunkHash::of(raw);
        let encoded = encode_with(raw, hash, Codec::Planes4, None, level);
        let stored = plane_lengths(&encoded);
        (hash, encoded, stored)
    }

    /// The stored length of each plane of a planes4 chunk, from its table.
    fn plane_lengths(chunk: &EncodedChunk) -> Vec<usize> {
        chunk.bytes[HEADER_BYTES..HEADER_BYTES + PLANE_TABLE_BYTES]
            .chunks_exact(4)
            .map(|b| u32::from_le_bytes(b.try_into().unwrap()) as usize)
            .collect()
    }

    /// A raw plane after a compressed one follows its frame whole, and the tail the last
    /// plane.
    #[test]
    fn raw_planes_after_compressed_ones_follow_their_frames_whole() {
        let noise: Vec<u8> = uniform(0x2545_f491_4f6c_dd1d, 1 << 16)
            .map(|u| (u * 256.0) as u8)
            .collect();
        let mut raw: Vec<u8> = noise
            .chunks_exact(2)
            .flat_map(|pair| [7, pair[0], 7, pair[1]])
            .collect();
        raw.extend_from_slice(&[4, 5, 6]);
        let (hash, encoded, stored) = planes4_of(&raw, 1);
        let plane_len = raw.len() / 4;
        assert!(
            stored[0] < plane_len / 100 && stored[2] < plane_len / 100,
            "{stored:?}"
        );
        assert_eq!([stored[1], stored[3]], [plane_len, plane_len], "{stored:?}");
        assert_eq!(
            encoded.bytes.len(),
            HEADER_BYTES + PLANE_TABLE_BYTES + stored.iter().sum::<usize>() + 3
        );
        assert_eq!(&encoded.bytes[encoded.bytes.len() - 3..], &[4, 5, 6]);
        assert_eq!(decode(&encoded.bytes, hash, None).unwrap(), raw);
    }

    #[test]
    fn planes_of_noise_are_stored_raw_and_the_others_compressed() {
        // Floats of one sign and a narrow range, with random mantissas: the exponent plane
        // compresses, the two low mantissa planes are noise.
        let values: Vec<f32> = uniform(0x9e37_79b9_7f4a_7c15, 1 << 18)
            .map(|u| 0.01 + u * 0.01)
            .collect();
        let mut raw = floats(&values);
        raw.extend_from_slice(&[1, 2, 3]);
        let (hash, encoded, stored) = planes4_of(&raw, 3);
        let plane_len = raw.len() / 4;
        assert_eq!(
            &stored[..2],
            &[plane_len, plane_len],
            "noise planes: {stored:?}"
        );
        assert!(stored[3] < plane_len / 4, "exponent plane: {stored:?}");
        assert_eq!(
            ChunkHeader::parse(&encoded.bytes).unwrap().codec,
            Codec::Planes4
        );
        assert_eq!(u16::from_le_bytes([encoded.bytes[8], encoded.bytes[9]]), 2);
        assert_eq!(decode(&encoded.bytes, hash, None).unwrap(), raw);
        // The older codec stores these bytes no smaller (the planes' own frames and table
        // cost a few dozen bytes).
        let older = encode_with(&raw, hash, Codec::Shuffle4Zstd, None, 3);
        assert_eq!(u16::from_le_bytes([older.bytes[8], older.bytes[9]]), 1);
        assert!(
            encoded.bytes.len() <= older.bytes.len() + 64,
            "{stored:?}: {} vs {}",
            encoded.bytes.len(),
            older.bytes.len()
        );
    }

    #[test]
    fn at_the_default_level_a_skewed_plane_is_stored_no_larger_than_plain_level_1() {
        // The exponent plane of uniform floats in (-0.5, 0.5): sign and exponent bytes, a few
        // values of skewed frequency, without long runs.
        let values: Vec<f32> = uniform(0x2545_f491_4f6c_dd1d, 1 << 18)
            .map(|u| u - 0.5)
            .collect();
        let raw = floats(&values);
        let exponents = &shuffle4(&raw)[3 * values.len()..];
        let framed = |compress: &dyn Fn(&mut [u8]) -> usize| {
            let mut frame = vec![0; zstd::zstd_safe::compress_bound(exponents.len())];
            let len = compress(&mut frame);
            frame.truncate(len);
            frame
        };
        let tuned = framed(&|frame| compress_plane_to(exponents, 1, frame));
        let plain = framed(&|frame| compress_to(exponents, 1, frame));
        assert!(
            tuned.len() <= plain.len(),
            "{} bytes against plain level 1's {}",
            tuned.len(),
            plain.len()
        );
        assert_eq!(
            decompress(&tuned, exponents.len() as u64).unwrap(),
            exponents
        );
        let hash = ChunkHash::of(&raw);
        let encoded = encode_with(&raw, hash, Codec::Planes4, None, 1);
        assert_eq!(plane_lengths(&encoded)[3], tuned.len());
        assert_eq!(decode(&encoded.bytes, hash, None).unwrap(), raw);
    }

    #[test]
    fn a_damaged_plane_table_or_version_is_refused() {
        let raw = floats(&(0..5000).map(|i| i as f32 * 0.25).collect::<Vec<_>>());
        let hash = ChunkHash::of(&raw);
        let encoded = encode_with(&raw, hash, Codec::Planes4, None, 3);
        // A plane said to be longer, or shorter, than it is stored.
        for lane in 0..4 {
            for delta in [1i64, -1] {
                let mut damaged = encoded.bytes.clone();
                let at = HEADER_BYTES + 4 * lane;
                let len = u32::from_le_bytes(damaged[at..at + 4].try_into().unwrap()) as i64;
                damaged[at..at + 4].copy_from_slice(&((len + delta) as u32).to_le_bytes());
                assert!(decode(&damaged, hash, None).is_err(), "lane {lane} {delta}");
            }
        }
        // A version-1 header cannot name a planes codec.
        let mut old = encoded.bytes.clone();
        old[8..10].copy_from_slice(&1u16.to_le_bytes());
        assert!(matches!(
            decode(&old, hash, None),
            Err(CodecError::CodecNewerThanVersion {
                version: 1,
                needs: 2,
                ..
            })
        ));
    }
}
