//! Page-aligned byte buffers, kept for reuse: what a chunk is encoded into. A write around the
//! page cache (`store::direct`) sends a page-aligned object's whole pages from where they lie;
//! any other object it first copies into an aligned buffer, which was a sixth of the memory
//! copying in a daemon's upload on 2 cores.

use crate::store::kept::Kept;

/// The alignment of every buffer: a page, which is a multiple of every block device's logical
/// block size (what `O_DIRECT` transfers are aligned to).
pub const PAGE: usize = 4096;

/// Maps given back by dropped buffers: as many as the chunks a writer or two have in flight.
static KEPT: Kept<memmap2::MmapMut> = Kept::new(16);

/// A growable byte buffer whose bytes start on a page boundary. Its memory is an anonymous
/// map taken from (and, when dropped, given back to) a bounded pool, so a new chunk's
/// encoding writes pages written before instead of faulting in fresh ones.
pub struct PageBuf {
    /// Always a map; `None` only while it is given back, in `drop`.
    map: Option<memmap2::MmapMut>,
    len: usize,
}

impl PageBuf {
    /// An empty buffer with room for at least `capacity` bytes.
    pub fn with_capacity(capacity: usize) -> Self {
        let map = KEPT
            .take_where(|map| map.len() >= capacity)
            .unwrap_or_else(|| {
                memmap2::MmapMut::map_anon(capacity.div_ceil(PAGE).max(1) * PAGE)
                    .expect("mapping a buffer's memory")
            });
        Self {
            map: Some(map),
            len: 0,
        }
    }

    fn map(&self) -> &memmap2::MmapMut {
        self.map.as_ref().expect("a live buffer has its map")
    }

    fn map_mut(&mut self) -> &mut memmap2::MmapMut {
        self.map.as_mut().expect("a live buffer has its map")
    }

    /// A buffer holding a copy of `bytes`.
    pub fn copy_of(bytes: &[u8]) -> Self {
        let mut buffer = Self::with_capacity(bytes.len());
        buffer.extend_from_slice(bytes);
        buffer
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn extend_from_slice(&mut self, bytes: &[u8]) {
        self.grow(bytes.len()).copy_from_slice(bytes);
    }

    /// Lengthens the buffer by `additional` bytes and returns them, to be written: they hold
    /// whatever the memory held (zeros, or a former buffer's bytes), never uninitialised.
    pub fn grow(&mut self, additional: usize) -> &mut [u8] {
        let len = self.len + additional;
        if len > self.map().len() {
            let mut larger = Self::with_capacity(len.max(2 * self.map().len()));
            larger.map_mut()[..self.len].copy_from_slice(&self.map()[..self.len]);
            std::mem::swap(&mut self.map, &mut larger.map);
        }
        let start = self.len;
        self.len = len;
        &mut self.map_mut()[start..len]
    }

    /// Shortens the buffer to `len` bytes (no change if it is not longer).
    pub fn truncate(&mut self, len: usize) {
        self.len = self.len.min(len);
    }
}

/// The buffer as `Bytes`, with no copy: its memory goes back to the pool when the last `Bytes`
/// of it is dropped.
impl From<PageBuf> for bytes::Bytes {
    fn from(buffer: PageBuf) -> Self {
        bytes::Bytes::from_owner(buffer)
    }
}

impl Drop for PageBuf {
    fn drop(&mut self) {
        if let Some(map) = self.map.take() {
            KEPT.give(map);
        }
    }
}

impl std::ops::Deref for PageBuf {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        &self.map()[..self.len]
    }
}

impl std::ops::DerefMut for PageBuf {
    fn deref_mut(&mut self) -> &mut [u8] {
        let len = self.len;
        &mut self.map_mut()[..len]
    }
}

impl AsRef<[u8]> for PageBuf {
    fn as_ref(&self) -> &[u8] {
        self
    }
}

impl Clone for PageBuf {
    fn clone(&self) -> Self {
        Self::copy_of(self)
    }
}

impl std::fmt::Debug for PageBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "PageBuf({} bytes)", self.len)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffers_are_page_aligned_grow_and_keep_their_bytes() {
        let mut buffer = PageBuf::with_capacity(10);
        assert_eq!(buffer.as_ptr() as usize % PAGE, 0);
        buffer.extend_from_slice(b"abc");
        buffer.grow(2).copy_from_slice(b"de");
        assert_eq!(&buffer[..], b"abcde");
        let long: Vec<u8> = (0..3 * PAGE + 5).map(|i| (i % 251) as u8).collect();
        buffer.extend_from_slice(&long);
        assert_eq!(buffer.as_ptr() as usize % PAGE, 0);
        assert_eq!(&buffer[..5], b"abcde");
        assert_eq!(&buffer[5..], &long[..]);
        buffer.truncate(4);
        assert_eq!(&buffer[..], b"abcd");
        assert_eq!(bytes::Bytes::from(buffer.clone()), &b"abcd"[..]);
        let empty = PageBuf::with_capacity(0);
        assert!(empty.is_empty());
        assert_eq!(empty.as_ptr() as usize % PAGE, 0);
    }
}
