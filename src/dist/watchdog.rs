//! A deadline on every collective: a rank whose peers do not arrive within the timeout (one
//! died without its launcher noticing, hung in a reward function, or took another branch)
//! prints which collective it was waiting in and exits with status 1, so no rank waits forever.
//! A blocking MPI call cannot be cancelled, so the process itself ends; the launcher (mpirun,
//! srun) then stops the rest.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::{Collective, Result};

/// What the rank is waiting in: the collective's name and when it started.
#[derive(Default)]
struct Pending {
    op: Option<(&'static str, Instant)>,
}

/// A [`Collective`] whose every call must finish within `timeout`.
pub struct Watchdog<C: Collective> {
    inner: C,
    pending: Arc<Mutex<Pending>>,
    /// Collectives called so far (named in the timeout message).
    calls: Arc<AtomicU64>,
}

impl<C: Collective> Watchdog<C> {
    /// Starts the watching thread (it lives as long as the process).
    pub fn new(inner: C, timeout: Duration) -> Self {
        let pending = Arc::new(Mutex::new(Pending::default()));
        let calls = Arc::new(AtomicU64::new(0));
        let (p, n) = (pending.clone(), calls.clone());
        let (rank, world) = (inner.rank(), inner.world_size());
        let tick = (timeout / 10).clamp(Duration::from_millis(50), Duration::from_secs(5));
        std::thread::Builder::new()
            .name("dist-watchdog".into())
            .spawn(move || loop {
                std::thread::sleep(tick);
                let late = p
                    .lock()
                    .ok()
                    .and_then(|g| g.op)
                    .filter(|(_, since)| since.elapsed() > timeout);
                if let Some((op, since)) = late {
                    eprintln!(
                        "error: rank {rank} of {world}: collective `{op}` (call {}) has waited {:.0} s for the other ranks, \
                         past actor_rollout_ref.nccl_timeout={} s: another rank died or hung; exiting",
                        n.load(Ordering::SeqCst),
                        since.elapsed().as_secs_f64(),
                        timeout.as_secs_f64()
                    );
                    // A blocked collective cannot be unwound: end the process (the launcher
                    // then stops the other ranks).
                    unsafe { libc::_exit(1) };
                }
            })
            .ok();
        Self {
            inner,
            pending,
            calls,
        }
    }

    fn guarded<T>(&self, op: &'static str, f: impl FnOnce(&C) -> Result<T>) -> Result<T> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        if let Ok(mut g) = self.pending.lock() {
            g.op = Some((op, Instant::now()));
        }
        let out = f(&self.inner);
        if let Ok(mut g) = self.pending.lock() {
            g.op = None;
        }
        out
    }
}

impl<C: Collective> Collective for Watchdog<C> {
    fn rank(&self) -> usize {
        self.inner.rank()
    }
    fn world_size(&self) -> usize {
        self.inner.world_size()
    }
    fn local_rank(&self) -> usize {
        self.inner.local_rank()
    }
    fn backend(&self) -> &'static str {
        self.inner.backend()
    }
    fn all_reduce_sum_f64(&self, buf: &mut [f64]) -> Result<()> {
        self.guarded("all_reduce", |c| c.all_reduce_sum_f64(buf))
    }
    fn all_reduce_sum_f32(&self, buf: &mut [f32]) -> Result<()> {
        self.guarded("all_reduce", |c| c.all_reduce_sum_f32(buf))
    }
    fn broadcast_bytes(&self, buf: &mut Vec<u8>, root: usize) -> Result<()> {
        self.guarded("broadcast", |c| c.broadcast_bytes(buf, root))
    }
    fn barrier(&self) -> Result<()> {
        self.guarded("barrier", |c| c.barrier())
    }
}
