//! A rank's busy word: a small shm file beside the rank's slot files (`FILE_NAME`) in which
//! its `ckptd` keeps whether it is busy with the rank's last snapshot (first 4 bytes: 1) or
//! free to take the next (0), and which slots it holds (next 4 bytes: [`HELD_KNOWN`] and a
//! bit per slot; 0 from a daemon that does not say), each written atomically in native byte
//! order (both ends are on one node). The daemon maps it for writing ([`BusyWord`]); the
//! rank maps it read-only ([`BusyWordReader`]) and reads it before a snapshot instead of
//! asking: on a node whose cores are taken, an answer is a wait for the daemon to be
//! scheduled, in the training loop. A word of 4 bytes (an older daemon's) has no held slots.

use std::path::Path;
use std::sync::atomic::{AtomicU32, Ordering};

/// The word's file name, beside the slot files.
pub const FILE_NAME: &str = "busy";

/// The busy word alone.
const LEN: u64 = 4;
/// The busy word and the held slots.
const LEN_WITH_HELD: u64 = 8;

/// Set in the held-slots word by a daemon that keeps it (a fresh file reads 0: not known).
pub const HELD_KNOWN: u32 = 1 << 31;

/// The `index`th 4-byte word inside a map of its file.
fn word(map: &memmap2::MmapRaw, index: usize) -> &AtomicU32 {
    assert!(map.len() >= 4 * (index + 1), "the map holds the word");
    // SAFETY: the map is page-aligned, long enough (checked above) and lives as long as the
    // borrow; every access to the words, by the daemon and by the rank, is atomic.
    #[allow(unsafe_code)]
    unsafe {
        AtomicU32::from_ptr(map.as_mut_ptr().cast::<u32>().add(index))
    }
}

/// The daemon's side: the word, mapped for writing.
pub struct BusyWord {
    map: memmap2::MmapRaw,
}

impl std::fmt::Debug for BusyWord {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "BusyWord({})", u8::from(self.get()))
    }
}

impl BusyWord {
    /// Maps `path` for writing, made (4 bytes, permissions `mode`) if it is not there. An
    /// existing file is kept, not replaced: a rank that mapped it before a daemon restart
    /// reads the same word.
    pub fn create(path: &Path, mode: u32) -> std::io::Result<Self> {
        use std::os::unix::fs::PermissionsExt;
        let file = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .read(true)
            .write(true)
            .open(path)?;
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))?;
        file.set_len(LEN_WITH_HELD)?;
        Ok(Self {
            map: memmap2::MmapRaw::map_raw(&file)?,
        })
    }

    pub fn set(&self, busy: bool) {
        word(&self.map, 0).store(u32::from(busy), Ordering::Release);
    }

    pub fn get(&self) -> bool {
        word(&self.map, 0).load(Ordering::Acquire) != 0
    }

    /// Says which slots the daemon holds (each below 31).
    pub fn set_held(&self, held: &[u32]) {
        let bits = held
            .iter()
            .fold(HELD_KNOWN, |bits, slot| bits | (1 << slot));
        word(&self.map, 1).store(bits, Ordering::Release);
    }
}

/// The rank's side: the word, mapped read-only.
pub struct BusyWordReader {
    map: memmap2::MmapRaw,
}

impl std::fmt::Debug for BusyWordReader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "BusyWordReader({})", u8::from(self.get()))
    }
}

impl BusyWordReader {
    /// Maps the word at `path` read-only; `None` when there is none (a daemon that keeps no
    /// word).
    pub fn open(path: &Path) -> Option<Self> {
        let file = std::fs::File::open(path).ok()?;
        let len = file.metadata().ok()?.len();
        if len < LEN {
            return None;
        }
        let map = memmap2::MmapOptions::new()
            .len(len.min(LEN_WITH_HELD) as usize)
            .map_raw_read_only(&file)
            .ok()?;
        Some(Self { map })
    }

    pub fn get(&self) -> bool {
        word(&self.map, 0).load(Ordering::Acquire) != 0
    }

    /// The slots the daemon holds now, if it says.
    pub fn held(&self) -> Option<Vec<u32>> {
        if (self.map.len() as u64) < LEN_WITH_HELD {
            return None;
        }
        let bits = word(&self.map, 1).load(Ordering::Acquire);
        (bits & HELD_KNOWN != 0).then(|| (0..31).filter(|slot| bits & (1 << slot) != 0).collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_reader_sees_what_the_daemon_sets_and_a_new_life_keeps_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(FILE_NAME);
        assert!(BusyWordReader::open(&path).is_none(), "no word yet");
        let daemon = BusyWord::create(&path, 0o600).unwrap();
        let reader = BusyWordReader::open(&path).unwrap();
        daemon.set(true);
        assert!(reader.get());
        daemon.set(false);
        assert!(!reader.get());
        daemon.set(true);
        drop(daemon);
        // A restarted daemon maps the same file: the rank's map still reads it.
        let again = BusyWord::create(&path, 0o600).unwrap();
        assert!(again.get(), "kept, not replaced");
        again.set(false);
        assert!(!reader.get());
    }

    #[test]
    fn the_reader_sees_the_held_slots_once_the_daemon_says_and_not_from_a_short_word() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(FILE_NAME);
        let daemon = BusyWord::create(&path, 0o600).unwrap();
        let reader = BusyWordReader::open(&path).unwrap();
        assert_eq!(reader.held(), None, "not said yet");
        daemon.set_held(&[0, 3]);
        assert_eq!(reader.held(), Some(vec![0, 3]));
        daemon.set_held(&[]);
        assert_eq!(reader.held(), Some(vec![]), "none held is said too");
        daemon.set(true);
        assert!(reader.get());
        assert_eq!(reader.held(), Some(vec![]), "the busy word is its own");
        // An older daemon's word: the busy flag alone.
        let short = dir.path().join("short");
        std::fs::write(&short, 1u32.to_ne_bytes()).unwrap();
        let reader = BusyWordReader::open(&short).unwrap();
        assert!(reader.get());
        assert_eq!(reader.held(), None);
    }
}
