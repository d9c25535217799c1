//! The process's heap, counted: every allocation goes through a counting wrapper of the
//! system allocator, so the trainer can measure what its activations take.

#[global_allocator]
static HEAP: peak_alloc::PeakAlloc = peak_alloc::PeakAlloc;

/// Bytes currently allocated on the heap by this process.
pub fn heap_bytes() -> usize {
    HEAP.current_usage()
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_heap_count_follows_allocations() {
        let before = super::heap_bytes();
        let block = vec![1u8; 256 << 20];
        let during = super::heap_bytes();
        drop(block);
        // Other test threads allocate and free too: compare with a wide margin.
        assert!(during >= before + (200 << 20), "{before} -> {during}");
    }
}
