//! Buffers kept for reuse between reads or writes of chunks: on a virtual machine whose host
//! takes freed memory back, a page touched for the first time costs far more than one written
//! again, and a fresh chunk-sized buffer is a thousand such pages.

use std::sync::Mutex;

/// At most `most` buffers, handed out and given back in any order.
pub(crate) struct Kept<T> {
    buffers: Mutex<Vec<T>>,
    most: usize,
}

impl<T> Kept<T> {
    pub(crate) const fn new(most: usize) -> Self {
        Self {
            buffers: Mutex::new(Vec::new()),
            most,
        }
    }

    /// A buffer given back before, if one is kept.
    pub(crate) fn take(&self) -> Option<T> {
        self.buffers
            .lock()
            .expect("the kept buffers are never poisoned")
            .pop()
    }

    /// A buffer given back before that `fits`, if one is kept.
    pub(crate) fn take_where(&self, fits: impl Fn(&T) -> bool) -> Option<T> {
        let mut buffers = self
            .buffers
            .lock()
            .expect("the kept buffers are never poisoned");
        let at = buffers.iter().position(fits)?;
        Some(buffers.swap_remove(at))
    }

    /// Keeps `buffer` for a later [`Kept::take`], unless `most` are kept already.
    pub(crate) fn give(&self, buffer: T) {
        let mut buffers = self
            .buffers
            .lock()
            .expect("the kept buffers are never poisoned");
        if buffers.len() < self.most {
            buffers.push(buffer);
        }
    }
}
