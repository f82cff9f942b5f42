//! How the process keeps tensor memory.
//!
//! glibc's malloc serves blocks of 128 KiB and more with fresh `mmap`s and gives them back on
//! free (and trims the heap top above 128 KiB), so every training step would pay first-touch
//! page faults again for each activation it allocates (~0.37 s per fresh GB measured here).
//! [`keep_freed_memory`] raises the mmap threshold to its maximum (32 MiB on 64-bit) and the
//! trim threshold far above a step's working set, so freed blocks stay in the process for reuse
//! (the CLI and the benchmarks call it at start-up). A third setting covers the threads:
//! blocks allocated on a worker thread (rayon's, which allocate the kernels' packed operands
//! and products) come from that thread's arena, a chain of heaps of at most 64 MiB each, and
//! glibc unmaps a heap beyond the first as soon as everything in it is free, whatever the trim
//! threshold says: the next packed operand of a few MiB lands in fresh pages again. A top pad
//! of 64 MiB (a heap's largest size) keeps those heaps mapped; it only reserves address space
//! ahead, pages are touched when used.
//!
//! Blocks of [`LARGE`] (32 MiB, glibc's cap) and more are this module's: the process's allocator
//! ([`HugePages`]) maps them itself, on 2 MiB boundaries in whole 2 MiB pages, and everything
//! smaller goes to the system's malloc. Two things keep them cheap:
//! - inside [`huge_pages`] — a training update's forwards, backwards and optimizer steps — fresh
//!   ones are advised to use transparent huge pages (Linux, THP in `madvise` mode, the usual
//!   default): each first write to a fresh page is a fault and the kernel zeroing the page; on
//!   the 2-core VMs this project measures on, faulting in the 1 GiB gradient of a 248k-token
//!   embedding in 4 KiB pages took ~3 s of a 24 s forward+backward, 512 times fewer faults in
//!   2 MiB pages. Not outside the scope: loading a model while its file fills the page cache,
//!   the kernel's compaction to find huge pages cost more than it saved (a 3 GB model took
//!   7.7-8.7 s to load instead of 5.2 s);
//! - freed blocks are kept (up to [`keep_limit`] bytes, the longest-kept handed back first) and
//!   handed out again for the next request of the same rounded size (or of up to half a kept
//!   block's size), so a second micro-batch writes into pages that are already there: even in
//!   huge pages the kernel's zeroing of fresh memory was ~15 % of a Qwen3.5 fwd+bwd's CPU time.
//!   They stay kept from one training step to the next (when the last scope closes, only those
//!   its requests never took go back): on VMs whose balloon reports free memory to the host
//!   (virtio-balloon free page reporting), a huge page given back is returned to the host within
//!   seconds and faulting it in again cost 1.6-3.9 s per GB instead of 0.13 s for one freed a
//!   moment ago (`scripts/bench/page_faults.c`; 0.38-0.49 s per GB in 4 KiB pages either way):
//!   handing the update's blocks back at its end cost a SmolLM2 GRPO step ~3 s of CPU in the
//!   kernel's page clearing. Kept blocks never lift the large blocks' footprint above the most
//!   those in use have needed (see [`Kept`]): a request no kept block serves hands back the
//!   longest-kept first. (Kept without that bound, up to the byte limit alone, they raised the
//!   peak RSS of a Qwen3.5-0.8B-shaped fwd+bwd with recomputation from 7.4 to 9.3 GB at 512
//!   tokens and from 13.9 to 16.5 GB at 8 × 1024.)

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

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
                libc::mallopt(libc::M_TOP_PAD, THREAD_HEAP);
            }
        });
    }
}

/// The largest heap of a thread's malloc arena (glibc: twice the largest mmap threshold),
/// the top pad that keeps emptied heaps from being unmapped (see the module's notes).
#[cfg(all(target_os = "linux", target_env = "gnu"))]
const THREAD_HEAP: i32 = 64 << 20;

/// Blocks at least this large are advised (smaller ones come from malloc's arenas, reused).
pub const HUGE: usize = 64 << 20;

/// Blocks at least this large are mapped by [`HugePages`] itself, in whole 2 MiB pages on 2 MiB
/// boundaries (malloc's largest mmap threshold: with [`keep_freed_memory`] malloc never sees
/// them).
pub const LARGE: usize = 32 << 20;

/// A huge page: the rounding of large blocks' sizes and their alignment.
const PAGE: usize = 2 << 20;

/// Most bytes of freed large blocks kept for reuse inside [`huge_pages`]: 4 GiB, or a quarter
/// of the machine's memory where that is less. (A Qwen3.5-0.8B-shaped fwd+bwd of 512 tokens
/// cycles ~3.7 GB of blocks this large: its 248k-row vocabulary's gradients, their sum, the
/// head's packed weight and logit chunks; at 2 GiB the oldest were handed back before reuse.)
fn keep_limit() -> usize {
    static LIMIT: AtomicUsize = AtomicUsize::new(0);
    match LIMIT.load(Ordering::Relaxed) {
        0 => {
            let limit = (physical_memory() / 4).clamp(LARGE, 4 << 30);
            LIMIT.store(limit, Ordering::Relaxed);
            limit
        }
        l => l,
    }
}

/// The machine's memory in bytes (sysconf; 16 GiB assumed where it does not say).
fn physical_memory() -> usize {
    #[cfg(unix)]
    {
        // SAFETY: sysconf reads system constants and allocates nothing.
        let (pages, size) = unsafe {
            (
                libc::sysconf(libc::_SC_PHYS_PAGES),
                libc::sysconf(libc::_SC_PAGESIZE),
            )
        };
        if pages > 0 && size > 0 {
            return pages as usize * size as usize;
        }
    }
    16 << 30
}

/// A vector of `len` values written by `write`, without clearing them first (zero-filled
/// buffers that a product or a map then overwrites were ~6 % of a forward+backward's time, in
/// `memset`). Builds with debug assertions (the tests) fill the buffer with `poison` first
/// (NaN, or a bf16 NaN's bits), so a value `write` leaves unset shows in every result that
/// reads it.
///
/// # Safety
/// `write` must write every one of the `len` values it is given (reading any of them before
/// writing it reads uninitialised memory).
pub unsafe fn filled_with<T: Copy>(
    len: usize,
    poison: T,
    write: impl FnOnce(&mut [std::mem::MaybeUninit<T>]),
) -> Vec<T> {
    let mut v: Vec<T> = Vec::with_capacity(len);
    let values = &mut v.spare_capacity_mut()[..len];
    if cfg!(debug_assertions) {
        values.fill(std::mem::MaybeUninit::new(poison));
    }
    write(values);
    // SAFETY: every value was written (this function's contract).
    unsafe { v.set_len(len) };
    v
}

/// [`filled_with`] NaN.
///
/// # Safety
/// As [`filled_with`].
pub unsafe fn filled<T: super::elem::Elem>(
    len: usize,
    write: impl FnOnce(&mut [std::mem::MaybeUninit<T>]),
) -> Vec<T> {
    // SAFETY: the caller's promise, passed on.
    unsafe { filled_with(len, T::nan(), write) }
}

/// Open [`huge_pages`] scopes, over all threads (rayon's workers allocate for the caller).
static SCOPES: AtomicUsize = AtomicUsize::new(0);

/// How many times a first [`huge_pages`] scope has opened: the age of kept blocks.
static EPOCH: AtomicU64 = AtomicU64::new(0);

/// Runs `f` with large blocks allocated by any thread advised to use huge pages: a backward
/// pass frees and allocates blocks of the same few sizes (each layer's activations and
/// gradients), which the kept blocks serve (see [`Kept`]). When the last scope closes, the kept
/// blocks that no request of this scope took go back to the kernel; those freed or reused
/// during it stay for the next scope (the next training step asks for the same sizes).
pub fn huge_pages<R>(f: impl FnOnce() -> R) -> R {
    struct Close;
    impl Drop for Close {
        fn drop(&mut self) {
            if SCOPES.fetch_sub(1, Ordering::AcqRel) == 1 {
                lock().age(EPOCH.load(Ordering::Acquire), unmap);
            }
        }
    }
    if SCOPES.fetch_add(1, Ordering::AcqRel) == 0 {
        EPOCH.fetch_add(1, Ordering::AcqRel);
    }
    let _close = Close;
    f()
}

/// Freed large blocks kept for reuse: up to [`SLOTS`] blocks and `limit` bytes, each with its
/// size (a multiple of [`PAGE`]), when it was freed and in which scope epoch; the blocks lent
/// out larger than their request; and the bytes of large blocks in use (`live`) with the most
/// they have ever been (`peak`). Kept blocks never make the large blocks' footprint (`live +
/// bytes`) exceed `peak`: keeping a freed block leaves the sum as it was, and a request no kept
/// block serves first hands back the longest-kept until the new block fits under the (possibly
/// new) peak. So the cache never raises the memory of large blocks above the most the same
/// allocations needed at one time without it. Pure bookkeeping: mapping and unmapping are the
/// caller's (the allocator's, or a test's).
struct Kept {
    slots: [Slot; SLOTS],
    /// `(address, mapped size)` of blocks handed out for a smaller request (address 0: free).
    loans: [(usize, usize); SLOTS],
    bytes: usize,
    tick: u64,
    live: usize,
    peak: usize,
}

/// A kept block; address 0 is a free slot.
#[derive(Clone, Copy, Default)]
struct Slot {
    addr: usize,
    size: usize,
    /// When it was kept (larger: more recent).
    tick: u64,
    /// The [`EPOCH`] it was kept in.
    epoch: u64,
}

const SLOTS: usize = 64;

impl Kept {
    const fn new() -> Self {
        const FREE: Slot = Slot {
            addr: 0,
            size: 0,
            tick: 0,
            epoch: 0,
        };
        Kept {
            slots: [FREE; SLOTS],
            loans: [(0, 0); SLOTS],
            bytes: 0,
            tick: 0,
            live: 0,
            peak: 0,
        }
    }

    /// A kept block for a request of `size` bytes, taken out for use: one of exactly that size
    /// (the most recently freed), else the smallest of at most twice the size (lent: its mapped
    /// size is remembered for [`Kept::returned`]; none while every loan slot is taken).
    fn take(&mut self, size: usize) -> Option<usize> {
        let loan = self.loans.iter().position(|l| l.0 == 0);
        let fits = |s: &Slot| {
            s.addr != 0
                && (s.size == size || (loan.is_some() && s.size > size && s.size <= 2 * size))
        };
        let i = (0..SLOTS)
            .filter(|&i| fits(&self.slots[i]))
            .min_by_key(|&i| (self.slots[i].size, std::cmp::Reverse(self.slots[i].tick)))?;
        let s = std::mem::take(&mut self.slots[i]);
        if s.size != size {
            self.loans[loan.expect("checked by fits")] = (s.addr, s.size);
        }
        self.bytes -= s.size;
        self.live += s.size;
        Some(s.addr)
    }

    /// The mapped size of the block at `addr` freed as a request of `size` bytes: a lent
    /// block's own size (and the loan ends), else `size`.
    fn returned(&mut self, addr: usize, size: usize) -> usize {
        match self.loans.iter_mut().find(|l| l.0 == addr) {
            Some(l) => std::mem::take(l).1,
            None => size,
        }
    }

    /// A fresh block of `size` bytes is about to be mapped: the longest-kept blocks go to
    /// `unmap` until it fits under the peak.
    fn grow(&mut self, size: usize, mut unmap: impl FnMut(usize, usize)) {
        self.live += size;
        self.peak = self.peak.max(self.live);
        while self.bytes + self.live > self.peak {
            self.hand_back_oldest(&mut unmap);
        }
    }

    /// A block of `size` bytes is no longer in use and will be unmapped by the caller (or was
    /// never mapped).
    fn release(&mut self, size: usize) {
        self.live -= size;
    }

    /// Keeps the freed block at `addr` of `size` bytes (freed in `epoch`), handing the
    /// longest-kept blocks to `unmap` until it fits in `limit` bytes and a slot; a block larger
    /// than `limit` goes to `unmap` itself.
    fn put(
        &mut self,
        addr: usize,
        size: usize,
        limit: usize,
        epoch: u64,
        mut unmap: impl FnMut(usize, usize),
    ) {
        self.live -= size;
        if size > limit {
            return unmap(addr, size);
        }
        loop {
            let free = self.slots.iter().position(|s| s.addr == 0);
            if let (Some(i), true) = (free, self.bytes + size <= limit) {
                self.tick += 1;
                self.slots[i] = Slot {
                    addr,
                    size,
                    tick: self.tick,
                    epoch,
                };
                self.bytes += size;
                return;
            }
            self.hand_back_oldest(&mut unmap);
        }
    }

    fn hand_back_oldest(&mut self, unmap: &mut impl FnMut(usize, usize)) {
        let oldest = (0..SLOTS)
            .filter(|&i| self.slots[i].addr != 0)
            .min_by_key(|&i| self.slots[i].tick)
            .expect("kept bytes are in some slot");
        let s = std::mem::take(&mut self.slots[oldest]);
        self.bytes -= s.size;
        unmap(s.addr, s.size);
    }

    /// Hands the blocks kept before `epoch` (none of whose scope's requests took them) to
    /// `unmap`.
    fn age(&mut self, epoch: u64, mut unmap: impl FnMut(usize, usize)) {
        for slot in self
            .slots
            .iter_mut()
            .filter(|s| s.addr != 0 && s.epoch < epoch)
        {
            let s = std::mem::take(slot);
            self.bytes -= s.size;
            unmap(s.addr, s.size);
        }
    }
}

static KEPT: std::sync::Mutex<Kept> = std::sync::Mutex::new(Kept::new());

fn lock() -> std::sync::MutexGuard<'static, Kept> {
    // The bookkeeping is consistent between statements: a panic elsewhere cannot break it.
    KEPT.lock().unwrap_or_else(|e| e.into_inner())
}

/// Whether [`HugePages`] maps a block of this layout itself.
fn own(layout: &Layout) -> bool {
    cfg!(unix) && layout.size() >= LARGE && layout.align() <= PAGE
}

#[cfg(unix)]
fn unmap(addr: usize, size: usize) {
    // SAFETY: [addr, addr + size) is a whole mapping this module made and nothing uses.
    unsafe {
        libc::munmap(addr as *mut libc::c_void, size);
    }
}

#[cfg(not(unix))]
fn unmap(_: usize, _: usize) {}

/// A fresh anonymous mapping of `size` bytes (a multiple of [`PAGE`]) starting on a
/// [`PAGE`] boundary, zero-filled by the kernel; null when the kernel refuses.
#[cfg(unix)]
fn map(size: usize) -> *mut u8 {
    // SAFETY: an anonymous private mapping; the parts outside the aligned range are unmapped
    // at once and never handed out.
    unsafe {
        let p = libc::mmap(
            std::ptr::null_mut(),
            size + PAGE,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        );
        if p == libc::MAP_FAILED {
            return std::ptr::null_mut();
        }
        let base = p as usize;
        let start = base.next_multiple_of(PAGE);
        if start > base {
            libc::munmap(p, start - base);
        }
        let tail = base + size + PAGE - (start + size);
        if tail > 0 {
            libc::munmap((start + size) as *mut libc::c_void, tail);
        }
        start as *mut u8
    }
}

#[cfg(not(unix))]
fn map(_: usize) -> *mut u8 {
    std::ptr::null_mut()
}

/// A large block: a kept one (`zeroed`: cleared first), else a fresh mapping (advised to use
/// huge pages inside [`huge_pages`]).
fn large(want: usize, zeroed: bool) -> *mut u8 {
    let size = want.next_multiple_of(PAGE);
    let kept = {
        let mut k = lock();
        let hit = k.take(size);
        if hit.is_none() {
            k.grow(size, unmap);
        }
        hit
    };
    if let Some(addr) = kept {
        let p = addr as *mut u8;
        if zeroed {
            // SAFETY: the block is this allocation's, at least `want` bytes.
            unsafe { std::ptr::write_bytes(p, 0, want) };
        }
        return p;
    }
    let p = map(size);
    if p.is_null() {
        lock().release(size);
    } else if SCOPES.load(Ordering::Acquire) > 0 {
        advise(p, size);
    }
    p
}

/// Frees a large block: kept for reuse (see [`Kept`]).
fn free_large(p: *mut u8, size: usize) {
    let epoch = EPOCH.load(Ordering::Acquire);
    let mut k = lock();
    let size = k.returned(p as usize, size.next_multiple_of(PAGE));
    k.put(p as usize, size, keep_limit(), epoch, unmap);
}

/// [`System`] for small blocks; large ones ([`LARGE`] and up) mapped here, advised to use huge
/// pages and recycled inside [`huge_pages`].
pub struct HugePages;

#[cfg(target_os = "linux")]
fn advise(ptr: *mut u8, size: usize) {
    if ptr.is_null() || size < HUGE {
        return;
    }
    // SAFETY: the block starts on a 2 MiB boundary and is whole 2 MiB pages; advice changes
    // no data. A failure (THP off or unsupported) leaves ordinary pages, which is fine.
    unsafe {
        libc::madvise(ptr as *mut libc::c_void, size, libc::MADV_HUGEPAGE);
    }
}

#[cfg(not(target_os = "linux"))]
fn advise(_: *mut u8, _: usize) {}

// SAFETY: small blocks are `System`'s unchanged; large ones are whole private mappings of at
// least the requested size, aligned to 2 MiB (≥ any alignment they are used for), each handed
// out once until freed.
unsafe impl GlobalAlloc for HugePages {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        match own(&layout) {
            true => large(layout.size(), false),
            false => unsafe { System.alloc(layout) },
        }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        match own(&layout) {
            true => large(layout.size(), true),
            false => unsafe { System.alloc_zeroed(layout) },
        }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        match own(&layout) {
            true => free_large(ptr, layout.size()),
            false => unsafe { System.dealloc(ptr, layout) },
        }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY (all below): the caller guarantees `layout` is `ptr`'s and `new_size` valid
        // for its alignment.
        let new = unsafe { Layout::from_size_align_unchecked(new_size, layout.align()) };
        match (own(&layout), own(&new)) {
            (false, false) => unsafe { System.realloc(ptr, layout, new_size) },
            (true, true)
                if layout.size().next_multiple_of(PAGE) == new_size.next_multiple_of(PAGE) =>
            {
                ptr
            }
            _ => {
                let p = unsafe { self.alloc(new) };
                if !p.is_null() {
                    unsafe {
                        std::ptr::copy_nonoverlapping(ptr, p, layout.size().min(new_size));
                        self.dealloc(ptr, layout);
                    }
                }
                p
            }
        }
    }
}

#[cfg(test)]
mod tests {
    /// Minor page faults of the calling thread so far.
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    fn thread_faults() -> i64 {
        // SAFETY: getrusage writes the struct it is given.
        unsafe {
            let mut r: libc::rusage = std::mem::zeroed();
            libc::getrusage(libc::RUSAGE_THREAD, &mut r);
            r.ru_minflt
        }
    }

    /// A worker thread that allocates, writes and frees blocks of 12-17 MiB (more than one
    /// heap of its arena) over and over writes into pages it already has after the first
    /// round: with only the mmap and trim thresholds raised, each round faulted in the ~33 MB
    /// of its second heap again (measured: 22k faults in round 1, then 8.4k every round). Run
    /// in a child process of its own (malloc's settings are per process, and other tests'
    /// threads would share the arena).
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    #[test]
    fn freed_heaps_of_worker_threads_stay_mapped() {
        let out = std::process::Command::new(std::env::current_exe().unwrap())
            .env("MAIN_PPO_ALLOC_INNER", "1")
            .args([
                "--exact",
                "kernels::alloc::tests::inner_worker_heaps",
                "--ignored",
                "--nocapture",
                "--test-threads=1",
            ])
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout).to_string()
            + &String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{text}");
        assert!(text.contains("worker heaps: rounds"), "{text}");
    }

    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    #[test]
    #[ignore = "run by freed_heaps_of_worker_threads_stay_mapped in a process of its own"]
    fn inner_worker_heaps() {
        if std::env::var_os("MAIN_PPO_ALLOC_INNER").is_none() {
            return;
        }
        super::keep_freed_memory();
        let rounds = std::thread::spawn(|| {
            (0..4)
                .map(|_| {
                    let before = thread_faults();
                    let blocks: Vec<Vec<u8>> = (12..18).map(|mb| vec![1u8; mb << 20]).collect();
                    let sum: usize = blocks.iter().map(|b| b[b.len() / 2] as usize).sum();
                    assert_eq!(sum, 6);
                    drop(blocks);
                    thread_faults() - before
                })
                .collect::<Vec<i64>>()
        })
        .join()
        .unwrap();
        println!("worker heaps: rounds {rounds:?} page faults");
        // Round 1 writes 87 MiB (~22k pages of 4 KiB); later rounds reuse them.
        if rounds[0] < 10_000 {
            println!("skipped: the first round faulted in larger pages (THP `always`?)");
            return;
        }
        for (i, &f) in rounds.iter().enumerate().skip(1) {
            assert!(
                f < rounds[0] / 20,
                "round {}: {f} faults ({rounds:?})",
                i + 1
            );
        }
    }

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

    /// Inside the scope a freed large block is handed out again for the next request of its
    /// rounded size, cleared when the request wants zeros (the kernel's fresh pages are).
    #[cfg(unix)]
    #[test]
    fn freed_large_blocks_are_reused_and_cleared() {
        // An odd size (50 MiB + 1, rounded to 52 MiB) that no other test asks for meanwhile.
        let n = (50 << 20) + 1;
        super::huge_pages(|| {
            let v = vec![7u8; n];
            let p = v.as_ptr();
            drop(v);
            let w = vec![0u8; n];
            assert_eq!(w.as_ptr(), p, "the freed block is reused");
            assert!(w.iter().all(|&b| b == 0), "a zeroed request gets zeros");
        });
    }

    /// Growing a vector across the large-block threshold and shrinking it back keeps its
    /// contents (realloc between malloc's blocks and this module's mappings).
    #[test]
    fn realloc_across_the_threshold_keeps_the_contents() {
        let mut v: Vec<u32> = (0..1000).collect();
        v.reserve(super::LARGE); // 4·(1000 + LARGE) bytes: a large block
        assert!(v.capacity() * 4 >= super::LARGE);
        v.extend(1000..2000u32);
        v.shrink_to_fit(); // back to malloc
        assert!(v.iter().enumerate().all(|(i, &x)| x == i as u32));
        super::huge_pages(|| {
            let mut w: Vec<u32> = Vec::with_capacity(super::LARGE / 4 + 1);
            w.extend(0..5u32);
            w.reserve(super::LARGE); // large to larger
            w.extend(5..10u32);
            assert_eq!(w, (0..10).collect::<Vec<_>>());
        });
    }

    /// The bookkeeping of kept blocks: exact sizes only, the most recent first; the oldest go
    /// back when the byte limit or the slots run out; a block over the limit is never kept;
    /// draining hands back everything.
    #[test]
    fn kept_blocks_stay_within_their_limit() {
        let mut k = super::Kept::new();
        let mut unmapped = Vec::new();
        for _ in 0..3 {
            k.grow(4, |_, _| unreachable!("nothing kept yet"));
        }
        k.grow(11, |_, _| unreachable!());
        k.put(0x1000, 4, 10, 1, |a, s| unmapped.push((a, s)));
        k.put(0x2000, 4, 10, 1, |a, s| unmapped.push((a, s)));
        assert_eq!((k.bytes, unmapped.len()), (8, 0));
        k.put(0x3000, 4, 10, 1, |a, s| unmapped.push((a, s))); // 12 > 10: the oldest goes
        assert_eq!(unmapped, vec![(0x1000, 4)]);
        k.put(0x4000, 11, 10, 1, |a, s| unmapped.push((a, s))); // over the limit alone
        assert_eq!(unmapped[1], (0x4000, 11));
        assert_eq!(k.take(6), None);
        assert_eq!(k.take(4), Some(0x3000), "the most recently freed");
        assert_eq!((k.bytes, k.live), (4, 4));
        k.put(0x3000, 4, 10, 1, |a, s| unmapped.push((a, s)));
        let n = super::SLOTS + 1;
        for _ in 0..n {
            k.grow(1, |a, s| unmapped.push((a, s)));
        }
        for i in 0..n {
            k.put(0x10000 * (i + 1), 1, usize::MAX, 1, |a, s| {
                unmapped.push((a, s))
            });
        }
        // Growing past the peak (23) handed back 0x2000 and 0x3000 (oldest first); then the 65th
        // freed block found the 64 slots full and the first of them went.
        assert_eq!(&unmapped[2..], &[(0x2000, 4), (0x3000, 4), (0x10000, 1)]);
        let mut rest = 0;
        k.age(2, |_, s| rest += s);
        assert_eq!((rest, k.bytes, k.take(1)), (super::SLOTS, 0, None));
    }

    /// Kept blocks never lift the large blocks' footprint over the peak of those in use: a
    /// request no kept block serves first hands back the oldest kept ones.
    #[test]
    fn kept_blocks_never_raise_the_peak() {
        let mut k = super::Kept::new();
        let mut unmapped = Vec::new();
        // In use: 8 then 2 more (peak 10); freed: the 8 and the 2 (kept).
        k.grow(8, |_, _| unreachable!());
        k.grow(2, |_, _| unreachable!());
        k.put(0xa000, 8, 100, 1, |a, s| unmapped.push((a, s)));
        k.put(0xb000, 2, 100, 1, |a, s| unmapped.push((a, s)));
        assert_eq!((k.live, k.bytes, k.peak), (0, 10, 10));
        // A request of 6 (no kept block that size): 6 + 10 > 10, so both kept blocks go back,
        // the oldest first, until 6 + kept fits (the 8 alone leaves 2 + 6 = 8 ≤ 10).
        k.grow(6, |a, s| unmapped.push((a, s)));
        assert_eq!(unmapped, vec![(0xa000, 8)]);
        assert_eq!((k.live, k.bytes), (6, 2));
        assert!(k.live + k.bytes <= k.peak);
        // A request that raises the peak: the footprint stays at the new peak (26), so the
        // kept 2 goes too.
        k.grow(20, |a, s| unmapped.push((a, s)));
        assert_eq!((k.live, k.bytes, k.peak), (26, 0, 26));
        assert_eq!(unmapped[1], (0xb000, 2));
        k.release(20);
        k.age(2, |a, s| unmapped.push((a, s)));
        assert_eq!((k.bytes, k.peak), (0, 26), "the peak outlives the scope");
    }

    /// A request no kept block of its size serves takes the smallest kept block of at most
    /// twice its size; freeing it (as the smaller request) keeps the block at its mapped size.
    #[test]
    fn a_larger_kept_block_is_lent_and_comes_back_whole() {
        let mut k = super::Kept::new();
        let mut unmapped = Vec::new();
        for s in [16, 9, 6] {
            k.grow(s, |_, _| unreachable!());
        }
        k.put(0xa000, 16, 100, 1, |_, _| unreachable!());
        k.put(0xb000, 9, 100, 1, |_, _| unreachable!());
        k.put(0xc000, 6, 100, 1, |_, _| unreachable!());
        // 10: nothing that size, 9 too small, 16 ≤ 20: lent.
        assert_eq!(k.take(10), Some(0xa000));
        assert_eq!(
            (k.live, k.bytes),
            (16, 15),
            "a loan counts at its mapped size"
        );
        // 5: the smallest of 6 and 9.
        assert_eq!(k.take(5), Some(0xc000));
        assert_eq!(k.take(4), None, "9 is more than twice 4");
        assert_eq!(k.returned(0xa000, 10), 16);
        assert_eq!(k.returned(0xa000, 10), 10, "the loan ended");
        k.put(0xa000, 16, 100, 1, |_, _| unreachable!());
        assert_eq!(k.take(16), Some(0xa000));
        assert_eq!(k.returned(0xc000, 5), 6);
        // With every loan slot taken, only exact sizes are served.
        k.put(0xc000, 6, 100, 1, |_, _| unreachable!());
        k.loans = [(1, 1); super::SLOTS];
        assert_eq!(k.take(5), None);
        assert_eq!(k.take(6), Some(0xc000));
        k.loans = [(0, 0); super::SLOTS];
        k.put(0xc000, 6, 100, 2, |_, _| unreachable!());
        // Aging at the end of epoch 2 hands back what was kept before it (the 9), not the 6.
        k.age(2, |a, s| unmapped.push((a, s)));
        assert_eq!(unmapped, vec![(0xb000, 9)]);
        assert_eq!(k.take(6), Some(0xc000));
    }

    /// A block freed in one scope is handed out again in the next: the kept blocks outlive the
    /// scope that freed them.
    #[cfg(unix)]
    #[test]
    fn kept_blocks_outlive_the_scope() {
        // An odd size (54 MiB + 3, rounded to 56 MiB) that no other test asks for meanwhile.
        let n = (54 << 20) + 3;
        let p = super::huge_pages(|| {
            let v = vec![7u8; n];
            v.as_ptr() as usize
        });
        // (mmap often hands a just-unmapped address out again: the bookkeeping says it stayed.)
        assert!(
            super::lock().slots.iter().any(|s| s.addr == p),
            "kept after its scope closed"
        );
        super::huge_pages(|| {
            let w = vec![0u8; n];
            assert_eq!(w.as_ptr() as usize, p, "the block freed in the last scope");
            assert!(w.iter().all(|&b| b == 0));
        });
    }
}
