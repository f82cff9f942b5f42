//! A team of helper threads that *spin* between parallel loops, for code that runs hundreds
//! of short loops back to back (a decode step: ~150 products and attention passes of 10-200
//! µs each).
//!
//! Through rayon, each such loop started from a thread outside its pool costs a wake-up of a
//! sleeping worker, a sleep of the caller, and a wake-up of the caller at the end: measured on
//! a 2-vCPU VM, a 32×576×576 bf16 product that takes 17 µs on one thread took 33-38 µs on
//! two (`cargo bench --bench decode_products`). Here the caller takes part in the work, and
//! the helpers watch a shared slot for the next loop instead of sleeping, so starting and
//! finishing a loop is a few cache-line transfers.
//!
//! The helpers spin only while a [`session`] is open (one decode step), and park otherwise:
//! outside sessions they cost nothing, and rayon's pool keeps the machine to itself. One
//! thread at a time owns the team; a second thread opening a session meanwhile (tests run in
//! parallel), a thread without a session, and loops nested inside a team task all run
//! [`for_each`] through rayon or in place instead, with the same results.
//!
//! Helpers: rayon's thread count minus one (the caller is the last member), started at the
//! first session.

use std::any::Any;
use std::cell::Cell;
use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicU64, AtomicUsize, Ordering::*};
use std::sync::{Mutex, OnceLock};
use std::thread::Thread;
use std::time::{Duration, Instant};

use rayon::prelude::*;

/// One parallel loop: tasks `0..n` of `f`, claimed one at a time through `next`.
struct Job<'a> {
    f: &'a (dyn Fn(usize) + Sync),
    n: usize,
    next: AtomicUsize,
    /// The loop's number (helpers join each loop once).
    seq: u64,
    /// The first panic of a task, re-raised on the caller.
    panic: Mutex<Option<Box<dyn Any + Send>>>,
}

impl Job<'_> {
    /// Claims and runs tasks until none are left; a panicking task is recorded, not unwound
    /// (the caller must outlive every helper's use of the job).
    fn work(&self) {
        loop {
            let i = self.next.fetch_add(1, Relaxed);
            if i >= self.n {
                return;
            }
            if let Err(p) = catch_unwind(AssertUnwindSafe(|| (self.f)(i))) {
                let mut slot = self.panic.lock().unwrap_or_else(|e| e.into_inner());
                slot.get_or_insert(p);
            }
        }
    }
}

struct Shared {
    /// The loop running now, or null. Its owner clears it, then waits for `busy` to reach 0
    /// before the job (on the owner's stack) goes away.
    slot: AtomicPtr<Job<'static>>,
    /// The number of the last loop published (helpers poll it, cheaper than the slot).
    seq: AtomicU64,
    /// Helpers between announcing themselves and leaving a job.
    busy: AtomicUsize,
    /// Whether a session is open (helpers spin) or not (they park).
    open: AtomicBool,
    /// Held by the thread whose session owns the team.
    owner: Mutex<()>,
    /// The helper threads, started at the first session.
    helpers: OnceLock<Vec<Thread>>,
}

static SHARED: Shared = Shared {
    slot: AtomicPtr::new(std::ptr::null_mut()),
    seq: AtomicU64::new(0),
    busy: AtomicUsize::new(0),
    open: AtomicBool::new(false),
    owner: Mutex::new(()),
    helpers: OnceLock::new(),
};

/// How long a helper spins without a loop before it yields its core between polls (inside a
/// session, e.g. while the caller samples between two steps).
const SPIN: Duration = Duration::from_micros(500);

thread_local! {
    /// Whether this thread owns the team now (inside its session).
    static OWNER: Cell<bool> = const { Cell::new(false) };
    /// Whether this thread runs a team task now (helpers always count as inside one).
    static IN_TASK: Cell<bool> = const { Cell::new(false) };
}

/// The helpers (rayon's thread count − 1), started on first use; fewer if the OS refuses one.
fn helpers() -> &'static [Thread] {
    SHARED.helpers.get_or_init(|| {
        let n = rayon::current_num_threads().saturating_sub(1);
        let mut helpers = Vec::with_capacity(n);
        for i in 0..n {
            let h = std::thread::Builder::new()
                .name(format!("main_ppo-team-{i}"))
                .spawn(|| {
                    IN_TASK.with(|c| c.set(true));
                    helper(&SHARED)
                });
            match h {
                Ok(h) => helpers.push(h.thread().clone()),
                Err(e) => {
                    tracing::warn!("kernels::team: cannot start a helper thread ({e}); parallel loops of decode steps run through rayon");
                    break;
                }
            }
        }
        helpers
    })
}

/// A helper's life: park outside sessions, spin on `seq` inside them, join each new loop.
fn helper(s: &'static Shared) -> ! {
    let mut last = 0u64;
    let mut idle = Instant::now();
    let mut polls = 0u32;
    loop {
        if !s.open.load(Acquire) {
            std::thread::park();
            idle = Instant::now();
            continue;
        }
        let seen = s.seq.load(Acquire);
        if seen == last {
            polls = polls.wrapping_add(1);
            if polls.is_multiple_of(256) && idle.elapsed() > SPIN {
                std::thread::yield_now();
            } else {
                std::hint::spin_loop();
            }
            continue;
        }
        // Announce first, then look: an owner that cleared the slot after this load waits
        // for `busy` to fall back, so the job stays alive while it is used here.
        s.busy.fetch_add(1, SeqCst);
        let p = s.slot.load(SeqCst);
        if p.is_null() {
            // That loop ended without this helper.
            last = seen;
        } else {
            // SAFETY: non-null and loaded after announcing (see above): the job lives until
            // `busy` is decremented below.
            let job = unsafe { &*p };
            if job.seq != last {
                last = job.seq;
                job.work();
            }
        }
        s.busy.fetch_sub(1, SeqCst);
        idle = Instant::now();
    }
}

/// Runs `f` with the team spinning for this thread's parallel loops ([`for_each`] and the
/// helpers built on it) — unless one thread is all rayon has, another thread owns the team, or
/// this thread is already inside a session or a team task: then `f` runs as it is.
pub fn session<R>(f: impl FnOnce() -> R) -> R {
    if rayon::current_num_threads() < 2 || OWNER.with(Cell::get) || IN_TASK.with(Cell::get) {
        return f();
    }
    let s = &SHARED;
    if helpers().is_empty() {
        return f();
    }
    let _guard = match s.owner.try_lock() {
        Ok(g) => g,
        // A panic in an earlier session left the lock poisoned; the team is unaffected.
        Err(std::sync::TryLockError::Poisoned(e)) => e.into_inner(),
        Err(std::sync::TryLockError::WouldBlock) => return f(),
    };
    /// Closes the session on every way out of `f`.
    struct Close(&'static Shared);
    impl Drop for Close {
        fn drop(&mut self) {
            self.0.open.store(false, Release);
            OWNER.with(|c| c.set(false));
        }
    }
    OWNER.with(|c| c.set(true));
    s.open.store(true, Release);
    helpers().iter().for_each(Thread::unpark);
    let _close = Close(s);
    f()
}

/// `f(i)` for `i` in `0..n`, in parallel: on the team inside a [`session`], in place inside a
/// team task, through rayon otherwise. Every index runs exactly once, in no given order.
pub fn for_each(n: usize, f: impl Fn(usize) + Sync) {
    if n == 0 {
        return;
    }
    if n == 1 || IN_TASK.with(Cell::get) {
        (0..n).for_each(f);
        return;
    }
    if !OWNER.with(Cell::get) {
        let f = &f;
        (0..n).into_par_iter().for_each(f);
        return;
    }
    let s = &SHARED;
    let job = Job {
        f: &f,
        n,
        next: AtomicUsize::new(0),
        seq: s.seq.load(Relaxed) + 1,
        panic: Mutex::new(None),
    };
    // SAFETY (lifetime): the job is unpublished and every helper has left it before this
    // function returns (the slot is cleared, then `busy` awaited).
    let p = &job as *const Job<'_> as *mut Job<'static>;
    s.slot.store(p, SeqCst);
    s.seq.store(job.seq, Release);
    // Loops inside this thread's tasks run in place (the slot holds this loop).
    IN_TASK.with(|c| c.set(true));
    job.work();
    IN_TASK.with(|c| c.set(false));
    s.slot.store(std::ptr::null_mut(), SeqCst);
    // Helpers still in their last task. One preempted by the OS (more threads than cores)
    // would keep this thread spinning through its time slice: past ~16k polls it yields.
    let mut polls = 0u32;
    while s.busy.load(SeqCst) != 0 {
        polls = polls.saturating_add(1);
        if polls > 1 << 14 {
            std::thread::yield_now();
        } else {
            std::hint::spin_loop();
        }
    }
    let panic = job.panic.lock().unwrap_or_else(|e| e.into_inner()).take();
    if let Some(p) = panic {
        resume_unwind(p);
    }
}

/// A raw pointer that crosses to the team's threads; each task touches its own part.
struct Parts<T>(*mut T);
impl<T> Clone for Parts<T> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<T> Copy for Parts<T> {}
unsafe impl<T: Send> Send for Parts<T> {}
unsafe impl<T: Send> Sync for Parts<T> {}

impl<T> Parts<T> {
    fn get(self) -> *mut T {
        self.0
    }
}

/// `f(i, chunk)` for each chunk `i` of `len` values of `out` (the last may be shorter), as
/// [`for_each`] runs its tasks.
pub fn chunks<T: Send>(out: &mut [T], len: usize, f: impl Fn(usize, &mut [T]) + Sync) {
    if out.is_empty() {
        return;
    }
    let len = len.max(1);
    let total = out.len();
    let base = Parts(out.as_mut_ptr());
    for_each(total.div_ceil(len), |i| {
        let at = i * len;
        // SAFETY: chunk i is `at..min(at + len, total)` of `out`, disjoint from every other
        // chunk, and `out` is borrowed mutably for the whole loop.
        let c = unsafe { std::slice::from_raw_parts_mut(base.get().add(at), len.min(total - at)) };
        f(i, c)
    });
}

/// `f(r, row)` for each row `r` of `width` values of `out`, in jobs of at least `min_rows` rows
/// (a single job runs on this thread).
pub fn rows<T: Send>(
    out: &mut [T],
    width: usize,
    min_rows: usize,
    f: impl Fn(usize, &mut [T]) + Sync,
) {
    let width = width.max(1);
    let n = out.len() / width;
    let per = min_rows.max(1);
    if n <= per {
        out.chunks_mut(width)
            .enumerate()
            .for_each(|(r, row)| f(r, row));
        return;
    }
    // Jobs of `per` rows or more, a few per thread at most.
    let threads = rayon::current_num_threads().max(1);
    let per = per.max(n.div_ceil(4 * threads));
    chunks(out, per * width, |j, c| {
        c.chunks_mut(width)
            .enumerate()
            .for_each(|(r, row)| f(j * per + r, row))
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicU32;

    /// Every index runs exactly once, in and out of a session, with loops of 1 to 1,000 tasks
    /// back to back (a helper that joined a loop twice, or missed the end of one, would count
    /// wrong); `chunks` and `rows` cover their slice exactly once.
    #[test]
    fn every_task_runs_once_in_and_out_of_sessions() {
        let check = || {
            for n in [1usize, 2, 3, 7, 64, 1000] {
                for _ in 0..50 {
                    let hits: Vec<AtomicU32> = (0..n).map(|_| AtomicU32::new(0)).collect();
                    for_each(n, |i| {
                        hits[i].fetch_add(1, Relaxed);
                    });
                    assert!(hits.iter().all(|h| h.load(Relaxed) == 1), "n {n}");
                }
                let mut v = vec![0u32; n * 3 + 1];
                chunks(&mut v, 5, |i, c| {
                    c.iter_mut().for_each(|x| *x += i as u32 + 1)
                });
                for (j, &x) in v.iter().enumerate() {
                    assert_eq!(x, j as u32 / 5 + 1, "chunks: n {n}, value {j}");
                }
                let mut v = vec![0u32; n * 4];
                rows(&mut v, 4, 2, |r, row| {
                    row.iter_mut().for_each(|x| *x += r as u32 + 1)
                });
                for (j, &x) in v.iter().enumerate() {
                    assert_eq!(x, j as u32 / 4 + 1, "rows: n {n}, value {j}");
                }
            }
        };
        check();
        session(check);
        // A second session on another thread at the same time gets no team and still works.
        std::thread::scope(|sc| {
            sc.spawn(|| session(check));
            sc.spawn(|| session(check));
        });
    }

    /// A panicking task reaches the caller as its panic, after the loop's other tasks are
    /// done (on the team); the team keeps working afterwards.
    #[test]
    fn a_task_panic_reaches_the_caller_and_the_team_survives() {
        session(|| {
            let done = AtomicU32::new(0);
            let r = catch_unwind(AssertUnwindSafe(|| {
                for_each(100, |i| {
                    if i == 37 {
                        panic!("task 37 fails");
                    }
                    done.fetch_add(1, Relaxed);
                })
            }));
            let p = r.expect_err("the panic must reach the caller");
            assert_eq!(p.downcast_ref::<&str>(), Some(&"task 37 fails"));
            // The team runs every other task (rayon, standing in when another test owns the
            // team, may stop early).
            if OWNER.with(Cell::get) {
                assert_eq!(done.load(Relaxed), 99);
            }
            let sum = AtomicU32::new(0);
            for_each(10, |i| {
                sum.fetch_add(i as u32, Relaxed);
            });
            assert_eq!(sum.load(Relaxed), 45);
        });
    }

    /// Inside a session, tasks run on more than one thread (when rayon has two or more), and
    /// a loop nested in a task runs in place.
    #[test]
    fn a_session_spreads_tasks_and_nested_loops_run_in_place() {
        if rayon::current_num_threads() < 2 {
            eprintln!("skipped: one thread");
            return;
        }
        session(|| {
            if !OWNER.with(Cell::get) {
                eprintln!("skipped: another test owns the team");
                return;
            }
            let threads = Mutex::new(std::collections::HashSet::new());
            // Tasks long enough for a spinning helper to claim some.
            for _ in 0..20 {
                for_each(64, |_| {
                    threads.lock().unwrap().insert(std::thread::current().id());
                    let t = Instant::now();
                    while t.elapsed() < Duration::from_micros(50) {
                        std::hint::spin_loop();
                    }
                    let here = std::thread::current().id();
                    for_each(4, |_| assert_eq!(std::thread::current().id(), here));
                });
            }
            assert!(
                threads.lock().unwrap().len() >= 2,
                "all tasks ran on one thread"
            );
        });
    }
}
