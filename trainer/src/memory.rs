//! The process's heap: mimalloc, counted (every allocation goes through a counting wrapper,
//! so the trainer can measure what its activations take), and keeping the memory it frees.
//!
//! A training step allocates and frees the same large buffers every step (gradients of the
//! embedding and the LM head, activations, logits chunks: tens to hundreds of megabytes
//! each). An allocator that hands freed memory back to the kernel gets it back as fresh
//! pages, each one a page fault and a page cleared: glibc's `malloc` maps every buffer over
//! 32 MiB on its own and unmaps it on free (190,000 faults per `tiny` step), and mimalloc
//! purges freed memory after a delay. [`keep_freed_memory`] turns the purge off: the heap
//! stays at its peak and a step reuses the pages the step before used.

use libmimalloc_sys::{mi_option_set, mi_option_t};

#[global_allocator]
static HEAP: cap::Cap<mimalloc::MiMalloc> = cap::Cap::new(mimalloc::MiMalloc, usize::MAX);

/// `mi_option_purge_delay` in `mimalloc.h`'s option enum (stable across its versions; the
/// Rust bindings do not name it). Milliseconds before freed memory is purged; -1 never.
const PURGE_DELAY: mi_option_t = 15;

/// Bytes currently allocated on the heap by this process.
pub fn heap_bytes() -> usize {
    HEAP.allocated()
}

/// Never hand freed heap memory back to the kernel. Call it first thing: it holds from then on.
pub fn keep_freed_memory() {
    // SAFETY: sets one integer option of the allocator, which it reads when it next purges.
    #[allow(unsafe_code)]
    unsafe {
        mi_option_set(PURGE_DELAY, -1);
    }
}

#[cfg(test)]
mod tests {
    /// The allocator's purge delay in milliseconds (-1: never).
    fn purge_delay() -> std::ffi::c_long {
        // SAFETY: reads one integer option of the allocator.
        #[allow(unsafe_code)]
        unsafe {
            libmimalloc_sys::mi_option_get(super::PURGE_DELAY)
        }
    }

    #[test]
    fn the_heap_count_follows_allocations() {
        let before = super::heap_bytes();
        let block = vec![1u8; 256 << 20];
        let during = super::heap_bytes();
        drop(block);
        // Other test threads allocate and free too: compare with a wide margin.
        assert!(during >= before + (200 << 20), "{before} -> {during}");
    }

    #[test]
    fn the_purge_delay_option_is_the_one_turned_off() {
        // mimalloc's documented default purge delay is a positive number of milliseconds
        // (10 in version 2, 1000 in version 3); no other option near it defaults to either.
        let default = purge_delay();
        assert!(
            default == 10 || default == 1000 || default == -1,
            "option {} reads {default}: not mimalloc's purge delay",
            super::PURGE_DELAY
        );
        super::keep_freed_memory();
        assert_eq!(purge_delay(), -1);
    }
}
