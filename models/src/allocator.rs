//! The allocator of tern's model processes (the worker, the model benchmark): mimalloc, set to
//! keep the memory that inference frees.
//!
//! A forward pass allocates and frees tensors of tens of MB per layer. glibc returns each to
//! the kernel and faults it back in (a quarter of the encoder's CPU time once went to page
//! faults); mimalloc keeps them, but by default still returns ("purges") freed pages 10 ms
//! later, so every batch faults its working memory in again: about a fifth of a 16-window
//! Whisper batch on the CPU. [`keep_freed_memory`] turns purging off, so a process stays at its
//! high-water mark: the size of its largest batch, which the worker's memory budget bounds.

pub use mimalloc::MiMalloc;

/// `mi_option_purge_delay`: its place in mimalloc 3's `mi_option_e` (`mimalloc.h`). The sys
/// crate's named constants follow mimalloc 2's numbering, so they cannot be used here.
const PURGE_DELAY_V3: libmimalloc_sys::mi_option_t = 15;

/// Tells mimalloc never to purge freed memory (`MIMALLOC_PURGE_DELAY=-1`, set in-process). Call
/// it first thing in `main`; a `MIMALLOC_PURGE_DELAY` in the environment is left to win. Does
/// nothing on a mimalloc other than version 3.
pub fn keep_freed_memory() {
    if std::env::var_os("MIMALLOC_PURGE_DELAY").is_some() {
        return;
    }
    // SAFETY: plain calls into mimalloc's C API; setting an option is allowed at any time.
    unsafe {
        if (30_000..40_000).contains(&libmimalloc_sys::mi_version()) {
            libmimalloc_sys::mi_option_set(PURGE_DELAY_V3, -1);
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_purge_delay_option_is_mimalloc_3s() {
        super::keep_freed_memory();
        // SAFETY: reading an option.
        let delay = unsafe { libmimalloc_sys::mi_option_get(super::PURGE_DELAY_V3) };
        assert_eq!(delay, -1, "mimalloc {}", unsafe { libmimalloc_sys::mi_version() });
    }
}
