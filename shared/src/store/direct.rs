//! Chunk objects written to a `file://` store around the page cache (`O_DIRECT`), durable on
//! return, published create-only as `object_store`'s local store does it: a staging file
//! `<name>#<n>` beside the object (`n` random, where `object_store` takes the lowest free),
//! fsynced, hard-linked to the object's name (which fails if the name exists) and removed,
//! then the directory fsynced, and, the first time this process puts into that directory,
//! every directory above it up to the store's root (a directory another writer made may not
//! be durable yet: it can have been killed before it fsynced it). Listings skip staging
//! names and gc sweeps those a killed writer left (`gc.rs`).
//!
//! Why: a buffered write costs the kernel a copy into the page cache and its writeback, and
//! on 2 cores that was the largest part of a daemon's upload: `dd` of 336 MB took 0.5-0.8 s
//! of system CPU buffered with `conv=fsync` and 0.04 s with `oflag=direct`. A file system
//! that refuses `O_DIRECT` (an older tmpfs) or the aligned write gets the same bytes written
//! through the page cache instead; the result is the same file.

use std::collections::BTreeMap;
use std::fs::{File, OpenOptions};
use std::io::ErrorKind;
use std::os::unix::fs::FileExt;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use crate::page_buf::{PageBuf, PAGE};

/// Writes `bytes` as the new file `dest` in the store whose directory is `root`, durable
/// (file and directory entries up to `root`) on return. `Ok(false)` if `dest` already
/// exists: nothing is written over it, and its entries are made durable all the same (the
/// writer that linked it may have been killed before it fsynced them).
pub(crate) fn put_new(root: &Path, dest: &Path, bytes: &[u8]) -> std::io::Result<bool> {
    put_new_switching(root, dest, bytes, switch_to_direct)
}

/// [`put_new`], with the staging file switched to `O_DIRECT` by `to_direct` (the tests give
/// one that refuses, as a file system that does not take the flag).
fn put_new_switching(
    root: &Path,
    dest: &Path,
    bytes: &[u8],
    to_direct: SwitchToDirect,
) -> std::io::Result<bool> {
    let (file, staging, direct) = create_staging(dest, to_direct)?;
    let written = write_all(&file, &staging, bytes, direct)
        .and_then(|()| file.sync_all())
        .and_then(|()| match std::fs::hard_link(&staging, dest) {
            Ok(()) => Ok(true),
            Err(error) if error.kind() == ErrorKind::AlreadyExists => Ok(false),
            Err(error) => Err(error),
        });
    let _ = std::fs::remove_file(&staging);
    let written = written?;
    sync_entries(
        root,
        dest.parent().expect("an object's file has a directory"),
        true,
    )?;
    Ok(written)
}

/// The directories whose entries, up to the store's root, this process has made durable,
/// each with the directory it was then ([`identity`]).
static DURABLE_DIRS: Mutex<BTreeMap<PathBuf, DirIdentity>> = Mutex::new(BTreeMap::new());

/// A directory's device, inode and birth time (where the file system keeps one: a directory
/// removed and made again often gets the freed inode back).
type DirIdentity = (u64, u64, Option<std::time::SystemTime>);

/// The [`DirIdentity`] of the directory at `dir`, if there is one.
fn identity(dir: &Path) -> Option<DirIdentity> {
    std::fs::metadata(dir)
        .ok()
        .map(|m| (m.dev(), m.ino(), m.created().ok()))
}

/// Whether this process has made `dir`'s entry, and those above it up to the store's root,
/// durable. Only for the directory it made durable: one made again at the same path (the
/// store wiped and made again while this process runs) is another, whose entry is not.
pub(crate) fn known_durable(dir: &Path) -> bool {
    let known = DURABLE_DIRS
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .get(dir)
        .copied();
    known.is_some() && known == identity(dir)
}

/// Makes a put's entries in `dir` durable up to the store's `root`: fsyncs `dir` itself where
/// `dir_too` (the put's own entry), then the directories [`unsynced_above`] names.
pub(crate) fn sync_entries(root: &Path, dir: &Path, dir_too: bool) -> std::io::Result<()> {
    if dir_too {
        sync_dir(dir)?;
    }
    let mut made = Vec::new();
    for (entry, above) in unsynced_above(root, dir) {
        let made_durable = identity(&entry);
        sync_dir(&above)?;
        made.extend(made_durable.map(|identity| (entry, identity)));
    }
    DURABLE_DIRS
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .extend(made);
    Ok(())
}

/// The directories to fsync, in order, for `dir`'s entry and those above it to be durable,
/// each with the directory whose entry it holds: the one above `dir`, and so on up to the
/// first directory whose entry this process has made durable, or the store's `root`.
fn unsynced_above(root: &Path, dir: &Path) -> Vec<(PathBuf, PathBuf)> {
    let mut unsynced = Vec::new();
    let mut entry = dir;
    while entry != root && !known_durable(entry) {
        let Some(above) = entry.parent().filter(|above| above.starts_with(root)) else {
            break;
        };
        unsynced.push((entry.to_path_buf(), above.to_path_buf()));
        entry = above;
    }
    unsynced
}

/// Creates a staging file beside `dest`, `dest#N` with `N` a random 64-bit number (another
/// if taken), and the directories up to it ([`sync_entries`] makes them durable). The file
/// is published by its name, so the name must be this writer's alone: with the lowest free
/// number, a writer slower than gc's staging grace had its file swept and the name taken by
/// the next writer, and linked that one's half-written file as its object. It is created as
/// any file, then switched to `O_DIRECT` where the file system takes it: opened with the
/// flag, a file system that refuses it fails the open only after creating the file.
fn create_staging(
    dest: &Path,
    to_direct: SwitchToDirect,
) -> std::io::Result<(File, PathBuf, bool)> {
    loop {
        let mut staging = dest.as_os_str().to_owned();
        staging.push(format!("#{}", rand::random::<u64>()));
        let staging = PathBuf::from(staging);
        match OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&staging)
        {
            Ok(file) => {
                return match to_direct(&file) {
                    Ok(()) => Ok((file, staging, true)),
                    Err(rustix::io::Errno::INVAL) => Ok((file, staging, false)),
                    Err(error) => {
                        let _ = std::fs::remove_file(&staging);
                        Err(error.into())
                    }
                };
            }
            Err(error) if error.kind() == ErrorKind::AlreadyExists => {}
            Err(error) if error.kind() == ErrorKind::NotFound => {
                std::fs::create_dir_all(dest.parent().expect("an object's file has a directory"))?
            }
            Err(error) => return Err(error),
        }
    }
}

/// Switches an open file to `O_DIRECT`; `EINVAL` where the file system refuses it.
type SwitchToDirect = fn(&File) -> rustix::io::Result<()>;

fn switch_to_direct(file: &File) -> rustix::io::Result<()> {
    let flags = rustix::fs::fcntl_getfl(file)?;
    rustix::fs::fcntl_setfl(file, flags | rustix::fs::OFlags::DIRECT)
}

/// Writes `bytes` at the start of `file`: with `direct`, around the page cache
/// ([`write_direct`]); where the file system refuses that, buffered.
fn write_all(file: &File, staging: &Path, bytes: &[u8], direct: bool) -> std::io::Result<()> {
    if direct && !bytes.is_empty() {
        match write_direct(file, bytes) {
            Ok(()) => return Ok(()),
            Err(error) if error.raw_os_error() == Some(libc::EINVAL) => {}
            Err(error) => return Err(error),
        }
    }
    let buffered = OpenOptions::new().write(true).open(staging)?;
    buffered.set_len(0)?;
    buffered.write_all_at(bytes, 0)
}

/// Writes `bytes` with `O_DIRECT`: a page-aligned object's whole pages from where they lie
/// (every chunk is encoded into a [`PageBuf`]), anything else from an aligned copy; the last
/// partial page from a copy padded with zeros. The file is then cut to the object's length.
fn write_direct(file: &File, bytes: &[u8]) -> std::io::Result<()> {
    let whole = if bytes.as_ptr().align_offset(PAGE) == 0 {
        bytes.len() / PAGE * PAGE
    } else {
        0
    };
    if whole > 0 {
        file.write_all_at(&bytes[..whole], 0)?;
    }
    let rest = &bytes[whole..];
    if !rest.is_empty() {
        let padded = rest.len().div_ceil(PAGE) * PAGE;
        let mut copy = PageBuf::with_capacity(padded);
        copy.extend_from_slice(rest);
        copy.grow(padded - rest.len()).fill(0);
        file.write_all_at(&copy, whole as u64)?;
    }
    file.set_len(bytes.len() as u64)
}

/// Makes the entries of the directory `dir` durable (a file created, linked or renamed in it).
pub fn sync_dir(dir: &Path) -> std::io::Result<()> {
    File::open(dir)?.sync_all()?;
    #[cfg(test)]
    SYNCED_DIRS
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .push(dir.to_path_buf());
    Ok(())
}

/// Every directory [`sync_dir`] fsynced, for the tests (each looks at those in its own
/// temporary directory).
#[cfg(test)]
pub(crate) static SYNCED_DIRS: Mutex<Vec<PathBuf>> = Mutex::new(Vec::new());

#[cfg(test)]
mod tests {
    use super::*;

    /// Objects of every length around a page land whole, in new directories, create-only;
    /// no staging file is left.
    #[test]
    fn objects_are_written_whole_and_create_only() {
        let root = tempfile::tempdir().unwrap();
        let lengths = [0usize, 1, 4095, 4096, 4097, 3 * 4096 + 17, (4 << 20) + 88];
        // Each from a page-aligned buffer (its whole pages written from where they lie) and
        // from one a byte past a page boundary (copied).
        for (len, aligned) in lengths
            .into_iter()
            .flat_map(|len| [(len, true), (len, false)])
        {
            let dest = root.path().join(format!("a/b{len}{aligned}/c"));
            let bytes: Vec<u8> = (0..len).map(|i| (i * 7 % 251) as u8).collect();
            let mut buffer = PageBuf::with_capacity(len + 1);
            if !aligned {
                buffer.extend_from_slice(&[0]);
            }
            buffer.extend_from_slice(&bytes);
            let from = &buffer[usize::from(!aligned)..];
            assert_eq!(from.as_ptr().align_offset(PAGE) == 0, aligned);
            assert!(put_new(root.path(), &dest, from).unwrap());
            assert_eq!(std::fs::read(&dest).unwrap(), bytes);
            assert!(!put_new(root.path(), &dest, b"other").unwrap());
            assert_eq!(std::fs::read(&dest).unwrap(), bytes, "not written over");
            let names: Vec<_> = std::fs::read_dir(dest.parent().unwrap())
                .unwrap()
                .map(|e| e.unwrap().file_name())
                .collect();
            assert_eq!(names, ["c"]);
        }
    }

    /// The page-cache path (a file system that refuses `O_DIRECT` or the aligned write)
    /// leaves exactly the bytes, over whatever a failed direct write left in the file.
    #[test]
    fn the_buffered_path_writes_the_same_file() {
        let root = tempfile::tempdir().unwrap();
        let staging = root.path().join("s#1");
        std::fs::write(&staging, vec![9u8; 3 * PAGE]).unwrap();
        let file = OpenOptions::new().write(true).open(&staging).unwrap();
        let bytes: Vec<u8> = (0..5000u32).map(|i| (i % 13) as u8).collect();
        write_all(&file, &staging, &bytes, false).unwrap();
        assert_eq!(std::fs::read(&staging).unwrap(), bytes);
    }

    /// The staging file is switched to `O_DIRECT` where the file system takes it, and where
    /// one refuses it nothing but the staging file is left (an open with the flag would have
    /// created the file before failing).
    #[test]
    fn the_staging_file_goes_direct_where_the_file_system_takes_it() {
        let on_disk = tempfile::tempdir().unwrap();
        let on_tmpfs = Path::new("/dev/shm")
            .is_dir()
            .then(|| tempfile::tempdir_in("/dev/shm").unwrap());
        for root in std::iter::once(&on_disk).chain(&on_tmpfs) {
            let dest = root.path().join("d/o");
            let (file, staging, direct) = create_staging(&dest, switch_to_direct).unwrap();
            let flags = rustix::fs::fcntl_getfl(&file).unwrap();
            assert_eq!(flags.contains(rustix::fs::OFlags::DIRECT), direct);
            let names: Vec<_> = std::fs::read_dir(root.path().join("d"))
                .unwrap()
                .map(|e| e.unwrap().path())
                .collect();
            assert_eq!(names, [staging]);
        }
    }

    /// Where the file system refuses `O_DIRECT`, a put writes the object through the page
    /// cache, whole and create-only, and leaves no staging file. Any other error from the
    /// switch fails the put with nothing left behind.
    #[test]
    fn a_file_system_that_refuses_o_direct_gets_the_same_file() {
        let root = tempfile::tempdir().unwrap();
        let refuses: SwitchToDirect = |_| Err(rustix::io::Errno::INVAL);
        let (file, staging, direct) = create_staging(&root.path().join("s/o"), refuses).unwrap();
        assert!(!direct);
        let flags = rustix::fs::fcntl_getfl(&file).unwrap();
        assert!(!flags.contains(rustix::fs::OFlags::DIRECT));
        std::fs::remove_file(staging).unwrap();

        let dest = root.path().join("a/o");
        let bytes: Vec<u8> = (0..3 * PAGE + 17).map(|i| (i % 241) as u8).collect();
        let mut aligned = PageBuf::with_capacity(bytes.len());
        aligned.extend_from_slice(&bytes);
        assert!(put_new_switching(root.path(), &dest, &aligned, refuses).unwrap());
        assert_eq!(std::fs::read(&dest).unwrap(), bytes);
        assert!(!put_new_switching(root.path(), &dest, b"other", refuses).unwrap());
        assert_eq!(std::fs::read(&dest).unwrap(), bytes, "not written over");
        let names = |dir: &str| -> Vec<_> {
            std::fs::read_dir(root.path().join(dir))
                .unwrap()
                .map(|e| e.unwrap().file_name())
                .collect()
        };
        assert_eq!(names("a"), ["o"]);

        let fails: SwitchToDirect = |_| Err(rustix::io::Errno::IO);
        let error =
            put_new_switching(root.path(), &root.path().join("b/o"), &aligned, fails).unwrap_err();
        assert_eq!(error.raw_os_error(), Some(libc::EIO));
        assert!(names("b").is_empty(), "{:?}", names("b"));
    }

    /// A staging file swept by gc (its writer slower than the grace) leaves its name free; the
    /// next writer of the same object takes another, so the slow writer's link of its name
    /// fails instead of publishing the other's half-written file. The name stays one that gc
    /// and listings know for a staging file (`#` and digits).
    #[test]
    fn a_swept_staging_name_is_not_taken_by_the_next_writer() {
        let root = tempfile::tempdir().unwrap();
        let dest = root.path().join("c/o");
        let (_slow, slow, _) = create_staging(&dest, switch_to_direct).unwrap();
        std::fs::remove_file(&slow).unwrap();
        let (_next, next, _) = create_staging(&dest, switch_to_direct).unwrap();
        assert_ne!(slow, next);
        let error = std::fs::hard_link(&slow, &dest).unwrap_err();
        assert_eq!(error.kind(), ErrorKind::NotFound);
        let name = next.file_name().unwrap().to_str().unwrap();
        let (object, n) = name.rsplit_once('#').unwrap();
        assert_eq!(object, "o");
        assert!(
            !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()),
            "{name}"
        );
    }

    /// A put makes durable the entries of the directories it is in, up to the store's root,
    /// once per process: the directories below the root are then known, and a put beside
    /// them fsyncs only the directories that are new.
    #[test]
    fn the_directories_up_to_the_root_are_made_durable_once() {
        let root = tempfile::tempdir().unwrap();
        let at = |dir: &str| root.path().join(dir);
        let plan = |dir: &str| -> Vec<(PathBuf, PathBuf)> { unsynced_above(root.path(), &at(dir)) };
        assert_eq!(
            plan("a/b/c"),
            [("a/b/c", "a/b"), ("a/b", "a"), ("a", "")].map(|(e, d)| (at(e), at(d)))
        );
        assert!(put_new(root.path(), &at("a/b/c/o"), &[1u8; 100]).unwrap());
        let durable = DURABLE_DIRS.lock().unwrap().clone();
        let known: Vec<_> = ["a", "a/b", "a/b/c"]
            .map(|dir| durable.contains_key(&at(dir)))
            .to_vec();
        assert_eq!(known, [true; 3]);
        assert!(
            !durable.contains_key(root.path()),
            "the root's own entry is not the store's"
        );
        // Once: nothing above a known directory is fsynced again, and a new directory's
        // walk stops at the first known one.
        assert!(plan("a/b/c").is_empty());
        assert_eq!(
            plan("a/b/d/e"),
            [("a/b/d/e", "a/b/d"), ("a/b/d", "a/b")].map(|(e, d)| (at(e), at(d)))
        );
        assert!(put_new(root.path(), &at("a/b/d/o"), &[2u8; 100]).unwrap());
        assert!(plan("a/b/d").is_empty());
        // The store wiped and made again under this process: the directories at the same
        // paths are new, and their entries are made durable again. They are told apart by
        // their birth time (the inode is often the same), where the file system keeps one,
        // at the clock's tick.
        if std::fs::metadata(at("a")).unwrap().created().is_err() {
            return;
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
        std::fs::remove_dir_all(at("a")).unwrap();
        std::fs::create_dir_all(at("a/b/c")).unwrap();
        assert_eq!(
            plan("a/b/c"),
            [("a/b/c", "a/b"), ("a/b", "a"), ("a", "")].map(|(e, d)| (at(e), at(d)))
        );
        assert!(put_new(root.path(), &at("a/b/c/o"), &[3u8; 100]).unwrap());
        assert!(plan("a/b/c").is_empty());
    }

    /// A store on tmpfs (which may or may not take `O_DIRECT`) gets the same file.
    #[test]
    fn a_tmpfs_store_gets_the_same_file() {
        let shm = Path::new("/dev/shm");
        if !shm.is_dir() {
            return;
        }
        let root = tempfile::tempdir_in(shm).unwrap();
        let dest = root.path().join("x/y");
        let bytes = vec![5u8; 10_000];
        assert!(put_new(root.path(), &dest, &bytes).unwrap());
        assert_eq!(std::fs::read(&dest).unwrap(), bytes);
    }
}
