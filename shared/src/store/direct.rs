//! Chunk objects written to a `file://` store around the page cache (`O_DIRECT`), durable on
//! return, published create-only exactly as `object_store`'s local store does it: a staging
//! file `<name>#<n>` beside the object, fsynced, hard-linked to the object's name (which fails
//! if the name exists) and removed, then the directory fsynced. Listings skip staging names
//! and gc sweeps those a killed writer left (`gc.rs`).
//!
//! Why: a buffered write costs the kernel a copy into the page cache and its writeback, and
//! on 2 cores that was the largest part of a daemon's upload: `dd` of 336 MB took 0.5-0.8 s
//! of system CPU buffered with `conv=fsync` and 0.04 s with `oflag=direct`. A file system
//! that refuses `O_DIRECT` (an older tmpfs) or the aligned write gets the same bytes written
//! through the page cache instead; the result is the same file.

use std::fs::{File, OpenOptions};
use std::io::ErrorKind;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::Path;

use crate::page_buf::{PageBuf, PAGE};

/// Writes `bytes` as the new file `dest`, durable (file and directory entry) on return.
/// `Ok(false)` if `dest` already exists: nothing is written over it.
pub(crate) fn put_new(dest: &Path, bytes: &[u8]) -> std::io::Result<bool> {
    let (file, staging, direct) = create_staging(dest)?;
    let written = write_all(&file, &staging, bytes, direct)
        .and_then(|()| file.sync_all())
        .and_then(|()| match std::fs::hard_link(&staging, dest) {
            Ok(()) => Ok(true),
            Err(error) if error.kind() == ErrorKind::AlreadyExists => Ok(false),
            Err(error) => Err(error),
        });
    let _ = std::fs::remove_file(&staging);
    if written? {
        let parent = dest.parent().expect("an object's file has a directory");
        sync_dir(parent)?;
        return Ok(true);
    }
    Ok(false)
}

/// Creates a staging file beside `dest` (`dest#1`, `dest#2`, ... whichever is free), and the
/// directories up to it, each new one fsynced with the directory it was made in. Opened
/// with `O_DIRECT` where the file system takes it.
fn create_staging(dest: &Path) -> std::io::Result<(File, std::path::PathBuf, bool)> {
    let mut direct = true;
    let mut n = 1u32;
    loop {
        let mut staging = dest.as_os_str().to_owned();
        staging.push(format!("#{n}"));
        let staging = std::path::PathBuf::from(staging);
        let mut options = OpenOptions::new();
        options.write(true).create_new(true);
        if direct {
            options.custom_flags(libc::O_DIRECT);
        }
        match options.open(&staging) {
            Ok(file) => return Ok((file, staging, direct)),
            Err(error) if error.kind() == ErrorKind::AlreadyExists => n += 1,
            Err(error) if error.kind() == ErrorKind::NotFound => create_dirs(dest)?,
            Err(error) if direct && error.raw_os_error() == Some(libc::EINVAL) => direct = false,
            Err(error) => return Err(error),
        }
    }
}

/// Makes the missing directories above `dest`, fsyncing each new one's parent (where its
/// entry lies) and the new ones themselves, deepest last.
fn create_dirs(dest: &Path) -> std::io::Result<()> {
    let parent = dest.parent().expect("an object's file has a directory");
    let mut existing = parent;
    while !existing.exists() {
        existing = existing
            .parent()
            .expect("the store's root exists above every object");
    }
    std::fs::create_dir_all(parent)?;
    let mut dir = parent;
    loop {
        sync_dir(dir)?;
        if dir == existing {
            return Ok(());
        }
        dir = dir
            .parent()
            .expect("the store's root exists above every object");
    }
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
    File::open(dir)?.sync_all()
}

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
            assert!(put_new(&dest, from).unwrap());
            assert_eq!(std::fs::read(&dest).unwrap(), bytes);
            assert!(!put_new(&dest, b"other").unwrap());
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
        assert!(put_new(&dest, &bytes).unwrap());
        assert_eq!(std::fs::read(&dest).unwrap(), bytes);
    }
}
