//! Slot files: the shm files that hold a rank's optimizer state (T0 and the snapshots in
//! flight) and the buddy's replicas of other ranks' (T1). Reading one chunk at a time
//! (through `store::FileSource`) on a blocking thread, re-hashing against the hashes taken at
//! hand-over, reserving every page when a file is made, and copying in bounded pieces. The rank state, the snapshot
//! pipeline, restores and replicas use these; this module knows nothing of them.

use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::Arc;

use anyhow::{anyhow, bail, Result};
use bytes::Bytes;
use lazarus_shared::store::{ByteSource, FileSource};
use lazarus_shared::ChunkHash;

use super::SLOT_CHUNK_BYTES;

/// Chunk `index` of a slot, read on a blocking thread.
pub async fn read_chunk(file: &Arc<FileSource>, slot_bytes: u64, index: u64) -> Result<Bytes> {
    let offset = index * SLOT_CHUNK_BYTES;
    let len = SLOT_CHUNK_BYTES.min(slot_bytes - offset) as usize;
    let file = file.clone();
    Ok(tokio::task::spawn_blocking(move || file.read_at(offset, len)).await??)
}

pub fn chunk_count(slot_bytes: u64) -> u64 {
    slot_bytes.div_ceil(SLOT_CHUNK_BYTES)
}

/// Allocates `len` bytes of `file` (shm pages or disk blocks), so later writes cannot fail
/// for lack of space.
pub fn reserve(file: &std::fs::File, len: u64, path: &Path) -> Result<()> {
    rustix::fs::fallocate(file, rustix::fs::FallocateFlags::empty(), 0, len).map_err(|error| {
        let free = rustix::fs::fstatvfs(file)
            .map(|s| s.f_bavail * s.f_frsize)
            .unwrap_or(0);
        anyhow!(
            "cannot reserve {len} bytes for {}: {error} ({free} bytes free there; is shm full? see runbooks/disk-or-shm-full.md)",
            path.display()
        )
    })
}

/// Copies `len` bytes in slot-chunk pieces (bounded memory) over what `to` holds (it is
/// made if missing, and sized to `len`): its pages are written in place, where a fresh file
/// would allocate and zero each and the file it replaced free them.
pub fn copy_file(from: &Path, to: &Path, len: u64) -> std::io::Result<()> {
    let source = std::fs::File::open(from)?;
    let target = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(false)
        .open(to)?;
    target.set_len(len)?;
    let mut buffer = vec![0u8; SLOT_CHUNK_BYTES as usize];
    let mut offset = 0;
    while offset < len {
        let n = SLOT_CHUNK_BYTES.min(len - offset) as usize;
        source.read_exact_at(&mut buffer[..n], offset)?;
        target.write_all_at(&buffer[..n], offset)?;
        offset += n as u64;
    }
    Ok(())
}

/// Re-hashes a slot against the hashes taken when it was handed over.
pub async fn verify_slot(path: &Path, slot_bytes: u64, hashes: &[ChunkHash]) -> Result<()> {
    if chunk_count(slot_bytes) != hashes.len() as u64 {
        bail!(
            "{} chunks recorded for a {slot_bytes}-byte slot",
            hashes.len()
        );
    }
    let file = Arc::new(FileSource::open(path)?);
    for (index, expected) in hashes.iter().enumerate() {
        let data = read_chunk(&file, slot_bytes, index as u64).await?;
        let found = tokio::task::spawn_blocking(move || ChunkHash::of(&data)).await?;
        if found != *expected {
            bail!(
                "{} chunk {index}: hashes to {}, recorded {}",
                path.display(),
                found.short(),
                expected.short()
            );
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::MetadataExt;

    use super::*;

    /// A copy over an older, longer file leaves exactly the source's bytes in the same file
    /// (its pages written in place), across a chunk boundary; a missing target is made.
    #[test]
    fn a_copy_writes_over_the_old_file_in_place_and_sizes_it() {
        let dir = tempfile::tempdir().unwrap();
        let (from, to) = (dir.path().join("slot"), dir.path().join("base"));
        let len = SLOT_CHUNK_BYTES + 4099;
        let bytes: Vec<u8> = (0..len).map(|i| (i % 251) as u8).collect();
        std::fs::write(&from, &bytes).unwrap();
        copy_file(&from, &to, len).unwrap();
        assert_eq!(std::fs::read(&to).unwrap(), bytes);
        std::fs::write(&to, vec![7u8; (len + 100) as usize]).unwrap();
        let inode = std::fs::metadata(&to).unwrap().ino();
        copy_file(&from, &to, len).unwrap();
        assert_eq!(std::fs::metadata(&to).unwrap().ino(), inode);
        assert_eq!(std::fs::read(&to).unwrap(), bytes);
    }
}
