//! A rank's busy word: a 4-byte shm file beside the rank's slot files (`FILE_NAME`) in which
//! its `ckptd` keeps whether it is busy with the rank's last snapshot (1) or free to take the
//! next (0), written atomically in native byte order (both ends are on one node). The daemon
//! maps it for writing ([`BusyWord`]); the rank maps it read-only ([`BusyWordReader`]) and
//! reads it before a snapshot instead of asking: on a node whose cores are taken, an answer
//! is a wait for the daemon to be scheduled, in the training loop.

use std::path::Path;
use std::sync::atomic::{AtomicU32, Ordering};

/// The word's file name, beside the slot files.
pub const FILE_NAME: &str = "busy";

const LEN: u64 = 4;

/// The word inside a map of its file.
fn word(map: &memmap2::MmapRaw) -> &AtomicU32 {
    // SAFETY: the map is page-aligned, at least 4 bytes long and lives as long as the borrow;
    // every access to the word, by the daemon and by the rank, is atomic.
    #[allow(unsafe_code)]
    unsafe {
        AtomicU32::from_ptr(map.as_mut_ptr().cast::<u32>())
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
        file.set_len(LEN)?;
        Ok(Self {
            map: memmap2::MmapRaw::map_raw(&file)?,
        })
    }

    pub fn set(&self, busy: bool) {
        word(&self.map).store(u32::from(busy), Ordering::Release);
    }

    pub fn get(&self) -> bool {
        word(&self.map).load(Ordering::Acquire) != 0
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
        if file.metadata().ok()?.len() < LEN {
            return None;
        }
        let map = memmap2::MmapOptions::new().map_raw_read_only(&file).ok()?;
        Some(Self { map })
    }

    pub fn get(&self) -> bool {
        word(&self.map).load(Ordering::Acquire) != 0
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
}
