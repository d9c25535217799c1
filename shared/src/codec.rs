//! The chunk object format: a fixed 88-byte header followed by the encoded payload.
//!
//! ```text
//! offset size field
//!      0    8 magic "LZCHUNK\0"
//!      8    2 format version (little endian, currently 1)
//!     10    1 codec (0 raw, 1 zstd, 2 shuffle4+zstd, 3 xor(base)+shuffle4+zstd)
//!     11    1 delta depth (0 unless codec 3; the base chunk has depth - 1)
//!     12    4 reserved, zero
//!     16    8 raw length in bytes
//!     24   32 blake3 of the raw bytes (= the chunk's name)
//!     56   32 blake3 of the base chunk's raw bytes (zero unless codec 3)
//! ```
//!
//! A chunk is always named by the hash of its raw bytes, whatever codec stored it, so equal
//! data deduplicates across ranks, steps and codecs. [`decode`] never returns bytes whose
//! hash differs from the name the caller asked for.

use crate::hash::ChunkHash;

pub const CHUNK_MAGIC: [u8; 8] = *b"LZCHUNK\0";
pub const CHUNK_FORMAT_VERSION: u16 = 1;
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
}

impl Codec {
    pub const ALL: [Codec; 4] = [
        Codec::Raw,
        Codec::Zstd,
        Codec::Shuffle4Zstd,
        Codec::XorShuffle4Zstd,
    ];

    fn to_byte(self) -> u8 {
        match self {
            Codec::Raw => 0,
            Codec::Zstd => 1,
            Codec::Shuffle4Zstd => 2,
            Codec::XorShuffle4Zstd => 3,
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
    #[error("chunk format version {found} is not supported (this build reads version {CHUNK_FORMAT_VERSION}); upgrade Lazarus")]
    UnknownVersion { found: u16 },
    #[error("unknown codec byte {0}")]
    UnknownCodec(u8),
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
        out[8..10].copy_from_slice(&CHUNK_FORMAT_VERSION.to_le_bytes());
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
        if version != CHUNK_FORMAT_VERSION {
            return Err(CodecError::UnknownVersion { found: version });
        }
        let codec = Codec::from_byte(bytes[10]).ok_or(CodecError::UnknownCodec(bytes[10]))?;
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
        let is_delta = codec == Codec::XorShuffle4Zstd;
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

/// An encoded chunk object, ready to upload.
#[derive(Clone, Debug)]
pub struct EncodedChunk {
    pub header: ChunkHeader,
    pub bytes: Vec<u8>,
}

/// Encodes `raw` with exactly `codec`. `base` is required for the delta codec and ignored
/// otherwise. `raw_hash` must be the blake3 of `raw` (callers hash once, to deduplicate).
pub fn encode_with(
    raw: &[u8],
    raw_hash: ChunkHash,
    codec: Codec,
    base: Option<DeltaBase<'_>>,
    zstd_level: i32,
) -> EncodedChunk {
    assert!(
        raw.len() as u64 <= CHUNK_RAW_BYTES_MAX,
        "chunk larger than CHUNK_RAW_BYTES_MAX"
    );
    let (payload, delta_depth, base_hash) = match codec {
        Codec::Raw => (raw.to_vec(), 0, None),
        Codec::Zstd => (compress(raw, zstd_level), 0, None),
        Codec::Shuffle4Zstd => (compress(&shuffle4(raw), zstd_level), 0, None),
        Codec::XorShuffle4Zstd => {
            let base = base.expect("the delta codec needs a base");
            assert_eq!(
                base.raw.len(),
                raw.len(),
                "a delta base must have the chunk's length"
            );
            assert!(base.depth < DELTA_DEPTH_MAX, "delta chain too deep");
            let mut delta = raw.to_vec();
            xor_in_place(&mut delta, base.raw);
            (
                compress(&shuffle4(&delta), zstd_level),
                base.depth + 1,
                Some(base.hash),
            )
        }
    };
    let header = ChunkHeader {
        codec,
        delta_depth,
        raw_len: raw.len() as u64,
        raw_hash,
        base: base_hash,
    };
    let mut bytes = Vec::with_capacity(HEADER_BYTES + payload.len());
    bytes.extend_from_slice(&header.to_bytes());
    bytes.extend_from_slice(&payload);
    EncodedChunk { header, bytes }
}

/// How the writer picks a codec for one chunk.
#[derive(Clone, Copy, Debug)]
pub struct CodecPolicy {
    /// Bytes per element of the tensor the chunk belongs to; 4 enables the byte shuffle.
    pub element_bytes: usize,
    pub zstd_level: i32,
    /// Deltas are only taken while the base's depth is below this.
    pub delta_depth_max: u8,
}

/// Encodes `raw` with whichever allowed codec stores it smallest: a delta against `base` when
/// one is given and the chain is not too deep, shuffle4+zstd for 4-byte elements, plain zstd
/// otherwise, and raw when compression does not pay.
pub fn encode_best(
    raw: &[u8],
    raw_hash: ChunkHash,
    base: Option<DeltaBase<'_>>,
    policy: CodecPolicy,
) -> EncodedChunk {
    let plain_codec = if policy.element_bytes == 4 {
        Codec::Shuffle4Zstd
    } else {
        Codec::Zstd
    };
    let mut best = encode_with(raw, raw_hash, plain_codec, None, policy.zstd_level);
    if let Some(base) = base.filter(|b| {
        b.raw.len() == raw.len() && b.depth < policy.delta_depth_max.min(DELTA_DEPTH_MAX)
    }) {
        let delta = encode_with(
            raw,
            raw_hash,
            Codec::XorShuffle4Zstd,
            Some(base),
            policy.zstd_level,
        );
        if delta.bytes.len() < best.bytes.len() {
            best = delta;
        }
    }
    if best.bytes.len() >= HEADER_BYTES + raw.len() {
        best = encode_with(raw, raw_hash, Codec::Raw, None, policy.zstd_level);
    }
    best
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
    let raw = match header.codec {
        Codec::Raw => payload.to_vec(),
        Codec::Zstd => decompress(payload, header.raw_len)?,
        Codec::Shuffle4Zstd => unshuffle4(&decompress(payload, header.raw_len)?),
        Codec::XorShuffle4Zstd => {
            let base_hash = header
                .base
                .expect("parse checked that delta chunks have a base");
            let base = base_raw
                .filter(|b| b.len() as u64 == header.raw_len)
                .ok_or(CodecError::BaseMissing {
                    base: base_hash,
                    depth: header.delta_depth,
                })?;
            let mut raw = unshuffle4(&decompress(payload, header.raw_len)?);
            if raw.len() == base.len() {
                xor_in_place(&mut raw, base);
            }
            raw
        }
    };
    if raw.len() as u64 != header.raw_len {
        return Err(CodecError::LengthMismatch {
            expected: header.raw_len,
            found: raw.len() as u64,
        });
    }
    let found = ChunkHash::of(&raw);
    if found != expected {
        return Err(CodecError::ChecksumMismatch { expected, found });
    }
    Ok(raw)
}

fn compress(bytes: &[u8], level: i32) -> Vec<u8> {
    zstd::bulk::compress(bytes, level).expect("zstd compression of an in-memory buffer cannot fail")
}

fn decompress(payload: &[u8], raw_len: u64) -> Result<Vec<u8>, CodecError> {
    // The capacity bound stops a hostile payload from inflating past the header's length.
    zstd::bulk::decompress(payload, raw_len as usize).map_err(CodecError::Decompress)
}

/// Byte transpose for 4-byte elements: all first bytes, then all second bytes, ... A tail that
/// is not a whole element is kept as is, at the end.
pub fn shuffle4(bytes: &[u8]) -> Vec<u8> {
    let elements = bytes.len() / 4;
    let mut out = vec![0u8; bytes.len()];
    for (index, element) in bytes.chunks_exact(4).enumerate() {
        for (lane, byte) in element.iter().enumerate() {
            out[lane * elements + index] = *byte;
        }
    }
    out[elements * 4..].copy_from_slice(&bytes[elements * 4..]);
    out
}

/// Inverse of [`shuffle4`].
pub fn unshuffle4(bytes: &[u8]) -> Vec<u8> {
    let elements = bytes.len() / 4;
    let mut out = vec![0u8; bytes.len()];
    for (index, element) in out.chunks_exact_mut(4).enumerate() {
        for (lane, byte) in element.iter_mut().enumerate() {
            *byte = bytes[lane * elements + index];
        }
    }
    out[elements * 4..].copy_from_slice(&bytes[elements * 4..]);
    out
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

    proptest! {
        #[test]
        fn every_codec_round_trips(raw in proptest::collection::vec(any::<u8>(), 0..5000), codec_index in 0usize..3) {
            let codec = Codec::ALL[codec_index];
            let hash = ChunkHash::of(&raw);
            let encoded = encode_with(&raw, hash, codec, None, 3);
            prop_assert_eq!(ChunkHeader::parse(&encoded.bytes).unwrap(), encoded.header);
            prop_assert_eq!(decode(&encoded.bytes, hash, None).unwrap(), raw);
        }

        #[test]
        fn delta_chains_round_trip(
            first in proptest::collection::vec(any::<f32>(), 1..600),
            steps in proptest::collection::vec(proptest::collection::vec((0usize..600, any::<f32>()), 0..20), 1..6),
        ) {
            // A chain of steps, each a few elements different from the one before, encoded as
            // deltas on deltas and decoded back through the whole chain.
            let policy = CodecPolicy { element_bytes: 4, zstd_level: 3, delta_depth_max: 4 };
            let mut values = first.clone();
            let mut chain: Vec<(Vec<u8>, EncodedChunk)> = Vec::new();
            let raw = floats(&values);
            let hash = ChunkHash::of(&raw);
            chain.push((raw.clone(), encode_with(&raw, hash, Codec::Shuffle4Zstd, None, 3)));
            for edits in steps {
                for (index, value) in edits {
                    let len = values.len();
                    values[index % len] = value;
                }
                let raw = floats(&values);
                let hash = ChunkHash::of(&raw);
                let (base_raw, base_chunk) = chain.last().unwrap();
                let base = DeltaBase { hash: base_chunk.header.raw_hash, depth: base_chunk.header.delta_depth, raw: base_raw };
                let encoded = encode_with(&raw, hash, Codec::XorShuffle4Zstd, Some(base), 3);
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
    }

    #[test]
    fn a_flipped_bit_is_caught() {
        let raw = floats(&(0..1000).map(|i| i as f32 * 0.001).collect::<Vec<_>>());
        let hash = ChunkHash::of(&raw);
        for codec in [Codec::Raw, Codec::Zstd, Codec::Shuffle4Zstd] {
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

    #[test]
    fn delta_against_a_similar_step_is_smaller() {
        let before: Vec<f32> = (0..4096)
            .map(|i| ((i * 7919) % 1000) as f32 / 997.0)
            .collect();
        let mut after = before.clone();
        for value in after.iter_mut().step_by(64) {
            *value += 1e-3;
        }
        let (before, after) = (floats(&before), floats(&after));
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
        let plain = encode_with(&after, ChunkHash::of(&after), Codec::Shuffle4Zstd, None, 3);
        assert_eq!(best.header.codec, Codec::XorShuffle4Zstd);
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
}
