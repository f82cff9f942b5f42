//! How the process keeps tensor memory.
//!
//! glibc's malloc serves blocks of 128 KiB and more with fresh `mmap`s and gives them back on
//! free (and trims the heap top above 128 KiB), so every training step would pay first-touch
//! page faults again for each activation it allocates (~0.37 s per fresh GB measured here).
//! [`keep_freed_memory`] raises the mmap threshold to its maximum (32 MiB on 64-bit) and the
//! trim threshold far above a step's working set, so freed blocks stay in the process for reuse
//! (the CLI and the benchmarks call it at start-up).
//!
//! Blocks above 32 MiB are still mapped and unmapped on every call (glibc's cap). The
//! process's allocator ([`HugePages`]) is the system's, with transparent huge pages asked for
//! on large blocks while a backward pass runs ([`huge_pages`]; Linux, where THP is in `madvise`
//! mode, the usual default).
//!
//! A backward pass writes gigabytes of fresh memory: blocks above glibc's mmap threshold
//! (32 MiB at most) come straight from the kernel on every call — a vocabulary-sized weight
//! gradient, its sum with the embedding's, the LM head's packed weight. In 4 KiB pages each
//! first write is a page fault; on the 2-core VMs this project measures on, faulting in the
//! 1 GiB gradient of a 248k-token embedding took ~3 s of a 24 s forward+backward.
//! `MADV_HUGEPAGE` lets the kernel back such blocks with 2 MiB pages: 512 times fewer faults.
//! Only inside [`huge_pages`]: elsewhere (loading a model while its file fills the page cache)
//! the kernel's compaction to find huge pages cost more than the faults it saved (loading a
//! 3 GB model took 7.7-8.7 s instead of 5.2 s).

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};

/// Applies the malloc settings above (once per process; later calls do nothing). No-op off
/// glibc.
pub fn keep_freed_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        use std::sync::Once;
        static ONCE: Once = Once::new();
        ONCE.call_once(|| {
            // SAFETY: mallopt only changes allocator parameters; it is called before the
            // threads that allocate tensors are started and is safe to call at any time.
            unsafe {
                libc::mallopt(libc::M_MMAP_THRESHOLD, 32 << 20);
                libc::mallopt(libc::M_TRIM_THRESHOLD, i32::MAX);
            }
        });
    }
}

/// Blocks at least this large are advised (smaller ones come from malloc's arenas, reused).
pub const HUGE: usize = 64 << 20;

/// Open [`huge_pages`] scopes, over all threads (rayon's workers allocate for the caller).
static SCOPES: AtomicUsize = AtomicUsize::new(0);

/// Runs `f` with large blocks allocated by any thread advised to use huge pages.
pub fn huge_pages<R>(f: impl FnOnce() -> R) -> R {
    struct Close;
    impl Drop for Close {
        fn drop(&mut self) {
            SCOPES.fetch_sub(1, Ordering::Relaxed);
        }
    }
    SCOPES.fetch_add(1, Ordering::Relaxed);
    let _close = Close;
    f()
}

/// [`System`], advising large blocks to use huge pages.
pub struct HugePages;

#[cfg(target_os = "linux")]
fn advise(ptr: *mut u8, size: usize) {
    if ptr.is_null() || size < HUGE || SCOPES.load(Ordering::Relaxed) == 0 {
        return;
    }
    // madvise wants a page-aligned start: the first whole 2 MiB page inside the block on.
    const PAGE: usize = 2 << 20;
    let start = (ptr as usize).next_multiple_of(PAGE);
    let end = (ptr as usize + size) / PAGE * PAGE;
    if end > start {
        // SAFETY: [start, end) lies inside the block just allocated; advice changes no data.
        // A failure (THP off or unsupported) leaves ordinary pages, which is fine.
        unsafe {
            libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_HUGEPAGE);
        }
    }
}

#[cfg(not(target_os = "linux"))]
fn advise(_: *mut u8, _: usize) {}

// SAFETY: every call is forwarded to `System` unchanged; `advise` only adds advice on memory
// the call returned.
unsafe impl GlobalAlloc for HugePages {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let p = unsafe { System.alloc(layout) };
        advise(p, layout.size());
        p
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        let p = unsafe { System.alloc_zeroed(layout) };
        advise(p, layout.size());
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let p = unsafe { System.realloc(ptr, layout, new_size) };
        advise(p, new_size);
        p
    }
}

#[cfg(test)]
mod tests {
    /// The kernel's flags of the mapping that holds `addr` (`VmFlags` in /proc/self/smaps).
    #[cfg(target_os = "linux")]
    fn vm_flags(addr: usize) -> Option<String> {
        let smaps = std::fs::read_to_string("/proc/self/smaps").ok()?;
        let mut inside = false;
        for line in smaps.lines() {
            let range = line.split_whitespace().next().unwrap_or("");
            if let Some((a, b)) = range.split_once('-') {
                if let (Ok(a), Ok(b)) = (usize::from_str_radix(a, 16), usize::from_str_radix(b, 16))
                {
                    inside = (a..b).contains(&addr);
                    continue;
                }
            }
            if inside {
                if let Some(flags) = line.strip_prefix("VmFlags:") {
                    return Some(flags.to_string());
                }
            }
        }
        None
    }

    /// A large block allocated inside `huge_pages` is advised: the kernel marks its mapping
    /// `hg` (MADV_HUGEPAGE), whether or not huge pages were free.
    #[cfg(target_os = "linux")]
    #[test]
    fn large_blocks_inside_the_scope_are_advised() {
        if !std::path::Path::new("/sys/kernel/mm/transparent_hugepage/enabled").exists() {
            eprintln!("skipped: no transparent huge pages in this kernel");
            return;
        }
        let v: Vec<u8> = super::huge_pages(|| vec![1u8; 2 * super::HUGE]);
        let mid = v.as_ptr() as usize + v.len() / 2;
        let flags = vm_flags(mid).expect("the block's mapping in /proc/self/smaps");
        assert!(
            flags.split_whitespace().any(|f| f == "hg"),
            "VmFlags: {flags}"
        );
    }
}
