//! Slot files: the shm files that hold a rank's optimizer state (T0 and the snapshots in
//! flight) and the buddy's replicas of other ranks' (T1). Reading a held one a run of chunks
//! (4 MiB at most) at a time through a map of the run's range ([`MappedFile`]) on a blocking
//! thread, re-hashing
//! against the hashes taken at hand-over, reserving every page when a file is made, and a
//! rank's delta base, which an upload encodes its chunks against and writes them over,
//! through such maps too. The rank state, the snapshot pipeline, restores and replicas use
//! these; this module knows nothing of them.

use std::collections::HashMap;
use std::ops::Range;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use anyhow::{anyhow, bail, Context, Result};
use bytes::Bytes;
use lazarus_shared::store::{ByteSource, RawCopy};
use lazarus_shared::wire::{SlotChunking, SlotTensor};
use lazarus_shared::ChunkHash;

use super::SLOT_CHUNK_BYTES;

/// The byte ranges of a `slot_bytes`-byte slot holding `tensors`, as `chunking` cuts it into
/// the chunks (of `SLOT_CHUNK_BYTES` at most) that are hashed, replicated and verified.
pub fn chunks_of(
    chunking: SlotChunking,
    slot_bytes: u64,
    tensors: &[SlotTensor],
) -> Result<Vec<Range<u64>>> {
    chunking
        .ranges(slot_bytes, SLOT_CHUNK_BYTES, tensors)
        .map_err(|reason| anyhow!("cannot cut the slot into chunks: {reason}"))
}

/// The bytes of `range` of a slot, read on a blocking thread.
async fn read_range(file: &Arc<impl ByteSource>, range: &Range<u64>) -> Result<Bytes> {
    let (offset, len) = (range.start, (range.end - range.start) as usize);
    let file = file.clone();
    Ok(tokio::task::spawn_blocking(move || file.read_at(offset, len)).await??)
}

/// `ranges` (consecutive, as [`chunks_of`] cuts a slot) in runs of neighbours that together
/// span at most `SLOT_CHUNK_BYTES`, or of one longer range: a slot of many small regions is
/// read and hashed a run at a time, not a read and a blocking task per small chunk.
pub fn runs(ranges: &[Range<u64>]) -> Vec<Range<usize>> {
    let mut runs: Vec<Range<usize>> = Vec::new();
    for (index, range) in ranges.iter().enumerate() {
        match runs.last_mut() {
            Some(run) if range.end - ranges[run.start].start <= SLOT_CHUNK_BYTES => {
                run.end = index + 1
            }
            _ => runs.push(index..index + 1),
        }
    }
    runs
}

/// The bytes of each of `ranges` of a slot (one run of [`runs`]), in order, from one read.
pub async fn read_run(file: &Arc<impl ByteSource>, ranges: &[Range<u64>]) -> Result<Vec<Bytes>> {
    let (Some(first), Some(last)) = (ranges.first(), ranges.last()) else {
        return Ok(Vec::new());
    };
    let span = read_range(file, &(first.start..last.end)).await?;
    Ok(ranges
        .iter()
        .map(|range| {
            span.slice((range.start - first.start) as usize..(range.end - first.start) as usize)
        })
        .collect())
}

/// [`read_run`], with each piece's hash, all taken on one blocking task.
pub async fn read_hashed(
    file: &Arc<impl ByteSource>,
    ranges: &[Range<u64>],
) -> Result<Vec<(Bytes, ChunkHash)>> {
    let pieces = read_run(file, ranges).await?;
    Ok(tokio::task::spawn_blocking(move || {
        pieces
            .into_iter()
            .map(|piece| {
                let hash = ChunkHash::of(&piece);
                (piece, hash)
            })
            .collect()
    })
    .await?)
}

/// Hashes each of `ranges` of a slot, in order.
pub async fn hash_ranges(
    file: &Arc<impl ByteSource>,
    ranges: &[Range<u64>],
) -> Result<Vec<ChunkHash>> {
    let mut hashes = Vec::with_capacity(ranges.len());
    for run in runs(ranges) {
        let hashed = read_hashed(file, &ranges[run]).await?;
        hashes.extend(hashed.into_iter().map(|(_, hash)| hash));
    }
    Ok(hashes)
}

/// Replaces the small file at `path` with `bytes` whole: written beside it as `<name>.tmp`,
/// then renamed over it, so a reader (or a daemon restarted midway) finds the old or the
/// new, never part of one.
pub fn replace_file(path: &Path, bytes: &[u8]) -> Result<()> {
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(".tmp");
    let tmp = PathBuf::from(tmp);
    std::fs::write(&tmp, bytes).with_context(|| format!("writing {}", tmp.display()))?;
    std::fs::rename(&tmp, path).with_context(|| format!("renaming {}", tmp.display()))
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

/// How the tmpfs that holds `dir` gives out pages, by its `huge=` option in `mountinfo` (the
/// kernel's mount table, `/proc/self/mountinfo`): "never" where the mount has none. `None`
/// where `dir` is not on a tmpfs. The daemon maps a slot's chunks one at a time, and on 4 KiB
/// pages those maps' page tables were a fifth of its CPU in an upload on 2 cores; with 2 MiB
/// pages (`huge=within_size`) they cost a fraction of that (docs/benchmarks.md).
pub fn tmpfs_huge(mountinfo: &str, dir: &Path) -> Option<String> {
    // Fields: id, parent, device, root, mount point, options, optional fields, "-", file
    // system type, source, the file system's own options. Later mounts cover earlier ones.
    let (fs_type, options) = mountinfo
        .lines()
        .filter_map(|line| {
            let (mount, rest) = line.split_once(" - ")?;
            let point = mount.split(' ').nth(4)?.replace("\\040", " ");
            let mut rest = rest.split(' ');
            let fs_type = rest.next()?;
            let options = rest.nth(1).unwrap_or("");
            Some((PathBuf::from(point), fs_type, options))
        })
        .filter(|(point, _, _)| dir.starts_with(point))
        // The deepest; of equals, the last (`max_by_key`'s tie rule).
        .max_by_key(|(point, _, _)| point.components().count())
        .map(|(_, fs_type, options)| (fs_type, options))?;
    if fs_type != "tmpfs" {
        return None;
    }
    let huge = options
        .split(',')
        .find_map(|option| option.strip_prefix("huge="));
    Some(huge.unwrap_or("never").to_string())
}

/// The name of a rank's delta-base file in its directory.
pub const BASE_FILE: &str = "base";

/// A rank's delta-base file as an upload reads its delta bases from it
/// ([`BaseCopy::source`]) and writes the new base over it ([`RawCopy`]): every tensor chunk
/// the store writer hashed lands at its slot offset, in place over the base chunk it was just
/// encoded against (pages reused, where a fresh file would allocate and zero each and the file
/// it replaced free them; a node never holds two bases). Complete when every copy was
/// written: the file then holds, in every tensor region, the very bytes the stored chunks were
/// hashed from.
///
/// Both go through a map of the one chunk's range: a writable one ([`RawCopy::view`]) that
/// the writer encodes the chunk against and writes it over in the same pass, or, where the
/// writer read the base apart, a read-only one and a copy of one `memcpy`. Read and written
/// through the file instead, each cost the kernel a copy, and the two were a fifth of a
/// daemon's CPU in an upload on 2 cores. A map of one
/// chunk at a time keeps the daemon's resident memory bounded by the chunks in flight, as it
/// was; one of the whole file would count all of it. Every page of the file is reserved when
/// it is opened, so no write through a map needs a page the file system may not have.
#[derive(Debug)]
pub struct BaseCopy {
    file: Arc<MappedFile>,
    failed: AtomicBool,
}

/// A slot or base file read (and the base written) through a map of each range: the bytes
/// where they lie in shm, not a copy of them. A range is read as it is while the map lives,
/// so what is hashed, encoded or sent from it is read this way only from a file no one writes
/// meanwhile: a slot the rank state holds (`rank.rs`: the rank never writes a held slot, and
/// the daemon fills only free ones) or the base (see [`BaseCopy`]). A replica, whose data file
/// a later replica may be written into, is only checked this way ([`verify_slot`]); its
/// upload and a restore's fetch of it read copies (`store::FileSource`). Each read of a slot
/// was a copy before: a fifth of a daemon's CPU in an upload on 2 cores. A map of one range
/// at a time keeps the daemon's resident memory bounded by the chunks in flight. No such file
/// is shrunk while open: one of another size is replaced by a new file ([`BaseCopy::make`]; a
/// layout change removes the rank's slots), as a map past a shrunk file's end faults.
#[derive(Debug)]
pub struct MappedFile {
    file: std::fs::File,
    /// The file's size, which it keeps while open.
    len: u64,
    path: PathBuf,
}

impl BaseCopy {
    /// Opens the base file at `path` (made if missing), sized to `len`, every page reserved.
    /// Also says whether it had that size already: only then does its old content line up
    /// with the slot's regions.
    pub fn open(path: &Path, len: u64) -> Result<(Self, bool)> {
        Self::of(Self::open_file(path)?, path, len)
    }

    /// The base file at `path`, opened (made if missing) and nothing more: an upload opens it
    /// under the ranks lock, where it is sure to be its rank state's own file.
    pub fn open_file(path: &Path) -> Result<std::fs::File> {
        std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(path)
            .with_context(|| format!("opening {}", path.display()))
    }

    /// [`BaseCopy::open`] of the base file opened as `file`.
    pub fn of(file: std::fs::File, path: &Path, len: u64) -> Result<(Self, bool)> {
        let sized = file
            .metadata()
            .with_context(|| format!("reading {}", path.display()))?
            .len()
            == len;
        if !sized {
            file.set_len(len)
                .with_context(|| format!("sizing {}", path.display()))?;
        }
        reserve(&file, len, path)?;
        let copy = Self {
            file: Arc::new(MappedFile {
                file,
                len,
                path: path.to_path_buf(),
            }),
            failed: AtomicBool::new(false),
        };
        Ok((copy, sized))
    }

    /// Makes a rank's base file at `path` when its rank registers: sized to `len`, every page
    /// reserved (as the slots are: a full tmpfs is a clear refusal at start, not a run that
    /// silently loses its deltas), and, if it was not of that size, written with zeros. A
    /// tmpfs page reserved but never written is cleared at its first write: over a fresh
    /// 326 MB base that made the first durable upload's copies take 6.7 s (the sum over its
    /// concurrent chunks, with the ranks training on the same 2 cores) against 0.6 s over
    /// written pages. A base of that size is kept as it is: `state.json` may name it.
    ///
    /// A file of another size is replaced by a new one rather than resized: an upload of the
    /// old layout still running maps it, and a map past a shrunk file's end faults.
    pub fn make(path: &Path, len: u64) -> Result<()> {
        if std::fs::metadata(path).is_ok_and(|m| m.len() != len) {
            std::fs::remove_file(path).with_context(|| format!("replacing {}", path.display()))?;
        }
        let (base, sized) = Self::open(path, len)?;
        if !sized {
            let zeros = vec![0u8; SLOT_CHUNK_BYTES as usize];
            let mut offset = 0;
            while offset < len {
                let n = SLOT_CHUNK_BYTES.min(len - offset);
                base.file
                    .file
                    .write_all_at(&zeros[..n as usize], offset)
                    .with_context(|| format!("writing {}", path.display()))?;
                offset += n;
            }
        }
        Ok(())
    }

    /// The base's bytes as the store writer reads its delta bases: each read is a map of its
    /// range, no copy. A range must not be read while it is copied over, which the writer
    /// keeps to ([`RawCopy`]: a chunk is copied once its base is released).
    pub fn source(&self) -> Arc<dyn ByteSource> {
        self.file.clone()
    }

    /// Every chunk handed over so far was written.
    pub fn complete(&self) -> bool {
        !self.failed.load(Ordering::SeqCst)
    }
}

impl RawCopy for BaseCopy {
    fn copy(&self, offset: u64, bytes: &[u8]) {
        super::crash::point("base");
        if let Err(error) = self.file.write_at(offset, bytes) {
            self.fail(&error);
        }
    }

    /// The base's chunk at `offset` as a writable map, which the upload encodes against and
    /// writes the new chunk over (the offered bases lie in this file at their chunks' own
    /// offsets: `DeltaBases::in_copy_target`).
    fn view(&self, offset: u64, len: usize) -> Option<memmap2::MmapMut> {
        super::crash::point("base");
        if len == 0 {
            return None;
        }
        self.file
            .map_mut(offset, len)
            .inspect_err(|error| self.fail(error))
            .ok()
    }
}

impl BaseCopy {
    /// Notes that a chunk was not written over the base (warned once).
    fn fail(&self, error: &std::io::Error) {
        if !self.failed.swap(true, Ordering::SeqCst) {
            tracing::warn!(path = %self.file.path.display(), %error, "cannot write the delta base; the next upload stores whole chunks");
        }
    }
}

impl MappedFile {
    /// Opens a held slot or replica file at `path` to be read.
    pub fn open(path: &Path) -> Result<Arc<Self>> {
        let file =
            std::fs::File::open(path).with_context(|| format!("opening {}", path.display()))?;
        Self::of(file, path)
    }

    /// The slot or replica file at `path`, opened as `file`.
    pub fn of(file: std::fs::File, path: &Path) -> Result<Arc<Self>> {
        let len = file
            .metadata()
            .with_context(|| format!("reading {}", path.display()))?
            .len();
        Ok(Arc::new(Self {
            file,
            len,
            path: path.to_path_buf(),
        }))
    }

    /// A map of `len` bytes at `offset`, which must lie inside the file (their pages are all
    /// reserved) and not be empty.
    fn map_options(&self, offset: u64, len: usize) -> std::io::Result<memmap2::MmapOptions> {
        if offset
            .checked_add(len as u64)
            .is_none_or(|end| end > self.len)
        {
            return Err(std::io::Error::new(
                std::io::ErrorKind::UnexpectedEof,
                format!(
                    "{len} bytes at {offset} run past the end of {}",
                    self.path.display()
                ),
            ));
        }
        let mut options = memmap2::MmapOptions::new();
        options.offset(offset).len(len).populate();
        Ok(options)
    }

    /// Writes `bytes` at `offset` through a map of their range.
    fn write_at(&self, offset: u64, bytes: &[u8]) -> std::io::Result<()> {
        if bytes.is_empty() {
            return Ok(());
        }
        self.map_mut(offset, bytes.len())?.copy_from_slice(bytes);
        Ok(())
    }

    /// A writable map of `len` bytes at `offset` (not empty).
    fn map_mut(&self, offset: u64, len: usize) -> std::io::Result<memmap2::MmapMut> {
        let options = self.map_options(offset, len)?;
        // SAFETY: nothing else maps or writes the range while this map lives: the writer
        // copies a chunk (or takes a view of its base) only while it holds no other bytes of
        // that chunk's base (`RawCopy`), no upload reads the base but the one that writes it
        // (uploads of a rank run one at a time), and the chunks' ranges are disjoint
        // (`local::check_layout`).
        #[allow(unsafe_code)]
        unsafe {
            options.map_mut(&self.file)
        }
    }
}

/// A held file read through a map of each range ([`BaseCopy::source`] for the base).
impl ByteSource for MappedFile {
    fn read_at(&self, offset: u64, len: usize) -> std::io::Result<Bytes> {
        if len == 0 {
            return Ok(Bytes::new());
        }
        let options = self.map_options(offset, len)?;
        // SAFETY: nothing writes the range while the map lives (see `MappedFile`): a slot is
        // read while held, a replica after it arrived, and the base by the writer, which
        // copies over a chunk's range only once it released that chunk's base (this map).
        #[allow(unsafe_code)]
        let map = unsafe { options.map(&self.file)? };
        Ok(Bytes::from_owner(map))
    }

    fn describe(&self) -> String {
        self.path.display().to_string()
    }
}

/// Re-hashes a slot (or replica) file, opened by the caller where it knew the file to be the
/// one meant, against the hashes taken when it was handed over, of its chunks as `chunking`
/// cut it.
pub async fn verify_slot(
    file: &Arc<MappedFile>,
    slot_bytes: u64,
    tensors: &[SlotTensor],
    chunking: SlotChunking,
    hashes: &[ChunkHash],
) -> Result<()> {
    let ranges = chunks_of(chunking, slot_bytes, tensors)?;
    if ranges.len() != hashes.len() {
        bail!(
            "{} chunks recorded for a {slot_bytes}-byte slot of {} chunks",
            hashes.len(),
            ranges.len()
        );
    }
    let found = hash_ranges(file, &ranges).await?;
    for (index, (found, expected)) in found.iter().zip(hashes).enumerate() {
        if found != expected {
            bail!(
                "{} chunk {index}: hashes to {}, recorded {}",
                file.describe(),
                found.short(),
                expected.short()
            );
        }
    }
    Ok(())
}

/// A held slot read with the hashes its chunks had when it was handed over: the store writer
/// takes each as the name of a store chunk of exactly the same bytes
/// ([`ByteSource::hashed`]), and does not hash them again. They are the slot's bytes still:
/// the daemon holds the slot from hand-over until the upload ends, and the rank never writes
/// a held slot (`rank.rs`). With `SlotChunking::Regions` every chunk of a stored region is
/// such a store chunk, where the store's chunk size is `SLOT_CHUNK_BYTES`.
#[derive(Debug)]
pub struct HashedSlot {
    file: Arc<MappedFile>,
    hashes: HashMap<Range<u64>, ChunkHash>,
}

impl HashedSlot {
    /// The slot `file`, whose chunks `ranges` hashed to `hashes` (none are vouched for where
    /// the two do not pair up).
    pub fn new(file: Arc<MappedFile>, ranges: &[Range<u64>], hashes: &[ChunkHash]) -> Self {
        let hashes = if ranges.len() == hashes.len() {
            ranges
                .iter()
                .zip(hashes)
                .map(|(range, hash)| (range.clone(), *hash))
                .collect()
        } else {
            HashMap::new()
        };
        Self { file, hashes }
    }
}

impl ByteSource for HashedSlot {
    fn read_at(&self, offset: u64, len: usize) -> std::io::Result<Bytes> {
        self.file.read_at(offset, len)
    }

    fn describe(&self) -> String {
        self.file.describe()
    }

    fn hashed(&self, offset: u64, len: usize) -> Option<ChunkHash> {
        self.hashes.get(&(offset..offset + len as u64)).copied()
    }
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::MetadataExt;

    use super::*;

    /// The deepest mount holding the directory answers, the later of two at one point, and
    /// only a tmpfs has pages to give out huge.
    #[test]
    fn the_tmpfs_holding_a_directory_says_how_it_gives_out_pages() {
        let mountinfo = "\
22 27 0:21 / /proc rw,relatime - proc proc rw
21 1 8:1 / / rw,relatime - ext4 rootfs rw
25 24 0:23 / /dev/shm rw,relatime - tmpfs tmpfs rw,size=64g
30 25 0:27 / /dev/shm rw,relatime - tmpfs tmpfs rw,size=32g,huge=advise
31 21 0:28 / /run/lazarus\\040slots rw,relatime shared:5 - tmpfs tmpfs rw,size=8g,huge=within_size
";
        let huge = |dir: &str| tmpfs_huge(mountinfo, Path::new(dir));
        assert_eq!(huge("/dev/shm/lazarus").as_deref(), Some("advise"));
        assert_eq!(
            huge("/run/lazarus slots/run").as_deref(),
            Some("within_size")
        );
        assert_eq!(huge("/run/lazarus"), None, "on the root's ext4");
        assert_eq!(huge("/proc/self"), None);
        let plain = mountinfo.replace(",huge=advise", "");
        assert_eq!(
            tmpfs_huge(&plain, Path::new("/dev/shm/x")).as_deref(),
            Some("never")
        );
    }

    /// Copies land in place at their offsets: over an older, longer file, which is sized to
    /// the slot (and said not to line up), or over one of the slot's size (said to).
    #[test]
    fn a_base_copy_writes_in_place_and_sizes_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("base");
        let len = SLOT_CHUNK_BYTES + 4099;
        let bytes: Vec<u8> = (0..len).map(|i| (i % 251) as u8).collect();
        std::fs::write(&path, vec![7u8; (len + 100) as usize]).unwrap();
        let inode = std::fs::metadata(&path).unwrap().ino();
        for sized_before in [false, true] {
            let (copy, sized) = BaseCopy::open(&path, len).unwrap();
            assert_eq!(sized, sized_before);
            // Out of order, as the writer's concurrent chunks arrive.
            let split = SLOT_CHUNK_BYTES as usize;
            copy.copy(split as u64, &bytes[split..]);
            copy.copy(0, &bytes[..split]);
            assert!(copy.complete());
            assert_eq!(std::fs::read(&path).unwrap(), bytes);
            assert_eq!(std::fs::metadata(&path).unwrap().ino(), inode);
        }
    }

    /// A rank's registration makes its base: a missing or other-sized file becomes zeros of
    /// the slot's size (its pages written), a file of that size keeps its bytes (a base
    /// `state.json` names).
    #[test]
    fn registration_makes_the_base_and_keeps_one_of_the_slots_size() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(BASE_FILE);
        let len = SLOT_CHUNK_BYTES + 4099;
        BaseCopy::make(&path, len).unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), vec![0u8; len as usize]);
        std::fs::write(&path, vec![5u8; len as usize]).unwrap();
        BaseCopy::make(&path, len).unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), vec![5u8; len as usize]);
        let (old, _) = BaseCopy::open(&path, len).unwrap();
        let old_source = old.source();
        BaseCopy::make(&path, len - 7).unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), vec![0u8; len as usize - 7]);
        // An upload of the old layout still reads its whole file: replaced, not shrunk (a
        // map past a shrunk file's end would kill this test with SIGBUS).
        assert_eq!(old_source.read_at(len - 8, 8).unwrap()[..], [5u8; 8]);
    }

    /// Neighbouring chunks are read in runs that span a slot chunk at most; a chunk that
    /// does not fit after the others starts the next run.
    #[test]
    fn small_chunks_are_read_in_runs_of_a_slot_chunk() {
        let c = SLOT_CHUNK_BYTES;
        let ranges = [
            0..10,
            10..c,
            c..c + 1,
            c + 1..c + 9,
            c + 9..2 * c + 1,
            2 * c + 1..2 * c + 3,
        ];
        assert_eq!(runs(&ranges), [0..2, 2..4, 4..6]);
        assert!(runs(&[]).is_empty());
    }

    /// A slot verifies against the hashes of its chunks as they were cut, not as the other
    /// cut makes them, nor once a byte of it changed.
    #[tokio::test]
    async fn a_slot_verifies_against_the_hashes_of_its_own_cut() {
        use lazarus_shared::format::{DType, DimRange};
        use lazarus_shared::store::{Region, RegionKind};
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("slot");
        let bytes: Vec<u8> = (0..8192u32).map(|i| (i % 251) as u8).collect();
        std::fs::write(&path, &bytes).unwrap();
        let tensors = [Region {
            name: "w".into(),
            dtype: DType::F32,
            global_shape: vec![1000],
            slice: vec![DimRange {
                start: 0,
                len: 1000,
            }],
            offset: 100,
            bytes: 4000,
            kind: RegionKind::Stored,
        }];
        let hashes_of = |chunking: SlotChunking| -> Vec<ChunkHash> {
            chunks_of(chunking, 8192, &tensors)
                .unwrap()
                .into_iter()
                .map(|r| ChunkHash::of(&bytes[r.start as usize..r.end as usize]))
                .collect()
        };
        let (fixed, regions) = (
            hashes_of(SlotChunking::Fixed),
            hashes_of(SlotChunking::Regions),
        );
        assert_eq!((fixed.len(), regions.len()), (1, 3));
        let verify = |chunking, hashes: Vec<ChunkHash>| {
            let (path, tensors) = (path.clone(), tensors.clone());
            async move {
                let file = MappedFile::open(&path).unwrap();
                verify_slot(&file, 8192, &tensors, chunking, &hashes).await
            }
        };
        verify(SlotChunking::Fixed, fixed.clone()).await.unwrap();
        verify(SlotChunking::Regions, regions.clone())
            .await
            .unwrap();
        assert!(verify(SlotChunking::Regions, fixed.clone()).await.is_err());
        assert!(verify(SlotChunking::Fixed, regions.clone()).await.is_err());
        let mut changed = bytes.clone();
        changed[4099] ^= 1;
        std::fs::write(&path, &changed).unwrap();
        assert!(verify(SlotChunking::Regions, regions).await.is_err());
    }

    /// The hand-over's chunks are the store's only while the two sizes agree.
    #[test]
    fn a_slot_chunk_is_as_long_as_a_store_chunk() {
        let store = lazarus_shared::store::StoreOptions::default();
        assert_eq!(SLOT_CHUNK_BYTES, store.chunk_bytes);
    }

    /// A hashed slot vouches for exactly the ranges hashed at hand-over, and for none where
    /// the hashes do not pair up with the ranges.
    #[test]
    fn a_hashed_slot_vouches_for_exactly_the_ranges_hashed() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("slot");
        std::fs::write(&path, [3u8; 100]).unwrap();
        let file = MappedFile::open(&path).unwrap();
        let (a, b) = (ChunkHash::of(b"a"), ChunkHash::of(b"b"));
        let slot = HashedSlot::new(file.clone(), &[0..40, 40..100], &[a, b]);
        assert_eq!(slot.hashed(0, 40), Some(a));
        assert_eq!(slot.hashed(40, 60), Some(b));
        assert_eq!(slot.hashed(0, 39), None);
        assert_eq!(slot.hashed(40, 59), None);
        assert_eq!(slot.hashed(10, 30), None);
        assert_eq!(slot.read_at(38, 4).unwrap()[..], [3u8; 4]);
        let unpaired = HashedSlot::new(file, &[0..40, 40..100], &[a]);
        assert_eq!(unpaired.hashed(0, 40), None);
    }

    /// A copy that cannot be written (past the file's end) leaves the base incomplete (it
    /// must not be used) and writes nothing.
    #[test]
    fn a_failed_copy_leaves_the_base_incomplete() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("base");
        let (copy, _) = BaseCopy::open(&path, 16).unwrap();
        copy.copy(8, &[1u8; 9]);
        assert!(!copy.complete());
        copy.copy(u64::MAX, &[1u8; 1]);
        assert_eq!(std::fs::read(&path).unwrap(), [0u8; 16]);
    }

    /// The source reads the file's bytes where they lie, a copy's once it is written; a read
    /// past the end is an error.
    #[test]
    fn the_base_source_reads_the_file_and_the_copies() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("base");
        let bytes: Vec<u8> = (0..10_000u32).map(|i| (i % 253) as u8).collect();
        std::fs::write(&path, &bytes).unwrap();
        let (copy, sized) = BaseCopy::open(&path, bytes.len() as u64).unwrap();
        assert!(sized);
        let source = copy.source();
        assert_eq!(source.read_at(100, 5000).unwrap(), bytes[100..5100]);
        // Across a page boundary, at offsets no page starts at, as tensors' chunks lie.
        copy.copy(4090, &[9u8; 10]);
        assert_eq!(source.read_at(4085, 20).unwrap()[5..15], [9u8; 10]);
        let mut expected = bytes.clone();
        expected[4090..4100].fill(9);
        assert_eq!(std::fs::read(&path).unwrap(), expected);
        assert!(source.read_at(9_999, 2).is_err());
        assert!(source.read_at(u64::MAX, 1).is_err());
        assert!(source.read_at(0, 0).unwrap().is_empty());
    }
}
