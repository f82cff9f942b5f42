//! Data parallelism across processes: the few collectives the trainer needs (verl's
//! `torch.distributed` calls inside its FSDP workers), behind one small interface, and the
//! backends that carry them.
//!
//! - [`Single`]: one process, no dependency (the default).
//! - `Mpi` (cargo feature `mpi`): rsmpi over the system's Open MPI or MPICH; launched with
//!   `mpirun -np N main_ppo ...` or `srun`.
//! - `Nccl` (cargo feature `nccl`, implies `cuda`): NCCL through candle's cudarc, one GPU per
//!   rank (the local rank); launched with torchrun, or with mpirun/srun in a build that also has
//!   `mpi` (MPI then hands out the NCCL id).
//!
//! [`from_env`] picks the backend from the launcher's environment and refuses a launch this
//! build cannot serve (N copies of a single-process build would each train alone and write the
//! same checkpoints). Every collective runs under a [`Watchdog`]: a rank that waits longer than
//! `actor_rollout_ref.nccl_timeout` seconds for its peers (one died or hung) exits with an error
//! naming the collective, instead of hanging silently.
//!
//! `grads`: what the update sums over the ranks (gradients, per-token rows, scalar metrics);
//! `wire`: the byte format ranks exchange a step's rows in.
//!
//! Nothing below `trainer` imports this module.

pub mod grads;
#[cfg(feature = "mpi")]
mod mpi_backend;
#[cfg(feature = "nccl")]
mod nccl_backend;
mod watchdog;
pub mod wire;

use std::sync::Arc;
use std::time::Duration;

#[cfg(feature = "mpi")]
pub use mpi_backend::Mpi;
#[cfg(feature = "nccl")]
pub use nccl_backend::Nccl;
pub use watchdog::Watchdog;

/// Why a collective or a launch failed.
#[derive(Debug, thiserror::Error)]
pub enum DistError {
    /// The processes were started in a way this build cannot serve.
    #[error("{0}")]
    Launch(String),
    /// A collective failed or its ranks disagree.
    #[error("collective `{op}` on rank {rank}: {msg}")]
    Collective {
        op: &'static str,
        rank: usize,
        msg: String,
    },
}

pub type Result<T> = std::result::Result<T, DistError>;

/// Tensor code (the update's sums over the ranks) reports a failed collective as its error.
impl From<DistError> for candle_core::Error {
    fn from(e: DistError) -> Self {
        candle_core::Error::Msg(e.to_string())
    }
}

/// The collectives of data-parallel training. Every rank calls the same collectives in the same
/// order with buffers of the same length (the root's length for a broadcast).
pub trait Collective: Send + Sync {
    /// This process's rank, `0..world_size`.
    fn rank(&self) -> usize;
    fn world_size(&self) -> usize;
    /// Rank among the processes of this node (the device index on a GPU node).
    fn local_rank(&self) -> usize;
    /// The backend's name (`single`, `mpi`), for logs and errors.
    fn backend(&self) -> &'static str;
    /// Element-wise sum over all ranks, the result on every rank.
    fn all_reduce_sum_f64(&self, buf: &mut [f64]) -> Result<()>;
    /// Element-wise sum over all ranks, the result on every rank.
    fn all_reduce_sum_f32(&self, buf: &mut [f32]) -> Result<()>;
    /// `root`'s bytes on every rank (`buf` is replaced; its length on other ranks is ignored).
    fn broadcast_bytes(&self, buf: &mut Vec<u8>, root: usize) -> Result<()>;
    /// Returns once every rank has called it.
    fn barrier(&self) -> Result<()>;
}

/// One process: every collective is the identity.
#[derive(Debug, Clone, Copy, Default)]
pub struct Single;

impl Collective for Single {
    fn rank(&self) -> usize {
        0
    }
    fn world_size(&self) -> usize {
        1
    }
    fn local_rank(&self) -> usize {
        0
    }
    fn backend(&self) -> &'static str {
        "single"
    }
    fn all_reduce_sum_f64(&self, _: &mut [f64]) -> Result<()> {
        Ok(())
    }
    fn all_reduce_sum_f32(&self, _: &mut [f32]) -> Result<()> {
        Ok(())
    }
    fn broadcast_bytes(&self, _: &mut Vec<u8>, _: usize) -> Result<()> {
        Ok(())
    }
    fn barrier(&self) -> Result<()> {
        Ok(())
    }
}

/// A shared handle to the run's collectives.
pub type Comm = Arc<dyn Collective>;

/// The single-process handle.
pub fn single() -> Comm {
    Arc::new(Single)
}

/// Every rank's bytes, in rank order, on every rank (one broadcast per rank).
pub fn all_gather_bytes(c: &dyn Collective, mine: Vec<u8>) -> Result<Vec<Vec<u8>>> {
    if c.world_size() == 1 {
        return Ok(vec![mine]);
    }
    let mut mine = Some(mine);
    (0..c.world_size())
        .map(|root| {
            let mut buf = if root == c.rank() {
                mine.take().unwrap_or_default()
            } else {
                Vec::new()
            };
            c.broadcast_bytes(&mut buf, root)?;
            Ok(buf)
        })
        .collect()
}

/// The sum of every rank's `n` (e.g. the step's rows when each rank holds a share).
pub fn sum_count(c: &dyn Collective, n: usize) -> Result<usize> {
    let mut v = [n as f64];
    c.all_reduce_sum_f64(&mut v)?;
    Ok(v[0] as usize)
}

/// Whether any rank says yes (a stop request on one rank stops all at the same step).
pub fn any(c: &dyn Collective, yes: bool) -> Result<bool> {
    let mut v = [f64::from(u8::from(yes))];
    c.all_reduce_sum_f64(&mut v)?;
    Ok(v[0] > 0.0)
}

/// Elements per all-reduce call of [`all_reduce_sum_bucketed`]: 25 MB of f32 (PyTorch DDP's
/// default bucket size), so no second copy of a whole model's gradients is ever held.
pub const BUCKET_BYTES: usize = 25 << 20;

/// [`Collective::all_reduce_sum_f32`] in buckets of at most [`BUCKET_BYTES`].
pub fn all_reduce_sum_bucketed_f32(c: &dyn Collective, buf: &mut [f32]) -> Result<()> {
    for chunk in buf.chunks_mut((BUCKET_BYTES / 4).max(1)) {
        c.all_reduce_sum_f32(chunk)?;
    }
    Ok(())
}

/// [`Collective::all_reduce_sum_f64`] in buckets of at most [`BUCKET_BYTES`].
pub fn all_reduce_sum_bucketed_f64(c: &dyn Collective, buf: &mut [f64]) -> Result<()> {
    for chunk in buf.chunks_mut((BUCKET_BYTES / 8).max(1)) {
        c.all_reduce_sum_f64(chunk)?;
    }
    Ok(())
}

/// The world size a launcher announced in the environment, and which launcher: Open MPI's and
/// MPICH's `mpirun`, Slurm's `srun`, torchrun.
pub fn launcher_world_size() -> Option<(usize, &'static str)> {
    const VARS: &[(&str, &str)] = &[
        ("OMPI_COMM_WORLD_SIZE", "Open MPI's mpirun"),
        ("PMI_SIZE", "MPICH's mpiexec (PMI)"),
        ("PMIX_SIZE", "a PMIx launcher"),
        ("SLURM_NTASKS", "srun"),
        ("WORLD_SIZE", "torchrun"),
    ];
    VARS.iter().find_map(|(var, who)| {
        let n = std::env::var(var).ok()?.trim().parse::<usize>().ok()?;
        Some((n, *who))
    })
}

/// The collectives of this run, chosen from the environment:
/// - torchrun's variables (`RANK`, `WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT`) in a build with
///   `nccl`: NCCL, bootstrapped from them;
/// - an MPI launcher (or srun) in a build with `mpi`: MPI, or NCCL bootstrapped over MPI when
///   the build also has `nccl` and a GPU is present;
/// - one process otherwise.
///
/// `MAIN_PPO_DIST_BACKEND=mpi|nccl` overrides the choice. A launch of several processes that
/// this build cannot connect is an error naming the launcher and the cargo feature to build
/// with. `timeout`: how long a rank waits for its peers in one collective.
pub fn from_env(timeout: Duration) -> Result<Comm> {
    let launched = launcher_world_size();
    let wanted = match std::env::var("MAIN_PPO_DIST_BACKEND") {
        Ok(v) if v == "mpi" || v == "nccl" => Some(v),
        Ok(v) if v.is_empty() => None,
        Ok(v) => {
            return Err(DistError::Launch(format!(
                "MAIN_PPO_DIST_BACKEND=`{v}`: expected `mpi` or `nccl`"
            )))
        }
        Err(_) => None,
    };
    let missing = |feature: &str| {
        DistError::Launch(format!(
            "MAIN_PPO_DIST_BACKEND asks for {feature}, but this main_ppo was built without it: \
             build with `cargo build --release --features {feature}`"
        ))
    };
    if cfg!(not(feature = "nccl")) && wanted.as_deref() == Some("nccl") {
        return Err(missing("nccl"));
    }
    if cfg!(not(feature = "mpi")) && wanted.as_deref() == Some("mpi") {
        return Err(missing("mpi"));
    }
    #[cfg(feature = "nccl")]
    {
        if wanted.as_deref() != Some("mpi") && nccl_backend::torchrun_launch() {
            let comm: Comm = Arc::new(Watchdog::new(Nccl::from_torchrun()?, timeout));
            return Ok(comm);
        }
    }
    #[cfg(feature = "mpi")]
    {
        let mpi_launch = ["OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMI_RANK", "PMIX_RANK"]
            .iter()
            .any(|v| std::env::var_os(v).is_some());
        let srun = launched.is_some_and(|(_, who)| who == "srun");
        if mpi_launch || srun {
            let mpi = Mpi::init()?;
            #[cfg(feature = "nccl")]
            {
                let gpu = candle_core::utils::cuda_is_available();
                if wanted.as_deref() == Some("nccl") || (wanted.is_none() && gpu) {
                    let comm: Comm = Arc::new(Watchdog::new(Nccl::over_mpi(mpi)?, timeout));
                    return Ok(comm);
                }
            }
            let comm: Comm = Arc::new(Watchdog::new(mpi, timeout));
            return Ok(comm);
        }
    }
    let _ = timeout;
    match launched {
        Some((n, who)) if n > 1 => Err(DistError::Launch(format!(
            "{who} started {n} processes, but this main_ppo was built without a backend that \
             connects them: build with `cargo build --release --features mpi` and launch with \
             mpirun or srun, or with `--features nccl` and launch with torchrun"
        ))),
        _ => Ok(single()),
    }
}

/// A rank's error prefix in logs (`rank 1/2: `), empty with one process.
pub fn rank_prefix(c: &dyn Collective) -> String {
    if c.world_size() == 1 {
        String::new()
    } else {
        format!("rank {}/{}: ", c.rank(), c.world_size())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A world of `n` ranks held by threads of one process (channels carry the data), so the
    /// helpers above can be tested without a launcher: each collective sums or copies through
    /// a shared slot under a barrier.
    struct Threads {
        rank: usize,
        n: usize,
        slot: Arc<std::sync::Mutex<Vec<Vec<f64>>>>,
        bytes: Arc<std::sync::Mutex<Vec<u8>>>,
        gate: Arc<std::sync::Barrier>,
    }

    impl Collective for Threads {
        fn rank(&self) -> usize {
            self.rank
        }
        fn world_size(&self) -> usize {
            self.n
        }
        fn local_rank(&self) -> usize {
            self.rank
        }
        fn backend(&self) -> &'static str {
            "threads"
        }
        fn all_reduce_sum_f64(&self, buf: &mut [f64]) -> Result<()> {
            self.slot.lock().unwrap()[self.rank] = buf.to_vec();
            self.gate.wait();
            let all = self.slot.lock().unwrap().clone();
            for (i, b) in buf.iter_mut().enumerate() {
                *b = all.iter().map(|v| v[i]).sum();
            }
            self.gate.wait();
            Ok(())
        }
        fn all_reduce_sum_f32(&self, buf: &mut [f32]) -> Result<()> {
            let mut v: Vec<f64> = buf.iter().map(|&x| x as f64).collect();
            self.all_reduce_sum_f64(&mut v)?;
            for (b, x) in buf.iter_mut().zip(v) {
                *b = x as f32;
            }
            Ok(())
        }
        fn broadcast_bytes(&self, buf: &mut Vec<u8>, root: usize) -> Result<()> {
            if self.rank == root {
                *self.bytes.lock().unwrap() = buf.clone();
            }
            self.gate.wait();
            *buf = self.bytes.lock().unwrap().clone();
            self.gate.wait();
            Ok(())
        }
        fn barrier(&self) -> Result<()> {
            self.gate.wait();
            Ok(())
        }
    }

    fn world(n: usize) -> Vec<Threads> {
        let slot = Arc::new(std::sync::Mutex::new(vec![Vec::new(); n]));
        let bytes = Arc::new(std::sync::Mutex::new(Vec::new()));
        let gate = Arc::new(std::sync::Barrier::new(n));
        (0..n)
            .map(|rank| Threads {
                rank,
                n,
                slot: slot.clone(),
                bytes: bytes.clone(),
                gate: gate.clone(),
            })
            .collect()
    }

    /// Three ranks each contribute `rank + 1` bytes of value `rank`: every rank gets all three
    /// lists in rank order; `any` is true when one rank says so and false when none does.
    #[test]
    fn gather_and_any_over_three_ranks() {
        let handles: Vec<_> = world(3)
            .into_iter()
            .map(|c| {
                std::thread::spawn(move || {
                    let mine = vec![c.rank() as u8; c.rank() + 1];
                    let all = all_gather_bytes(&c, mine).unwrap();
                    let one = any(&c, c.rank() == 2).unwrap();
                    let none = any(&c, false).unwrap();
                    (all, one, none)
                })
            })
            .collect();
        for h in handles {
            let (all, one, none) = h.join().unwrap();
            assert_eq!(all, vec![vec![0], vec![1, 1], vec![2, 2, 2]]);
            assert!(one);
            assert!(!none);
        }
    }

    #[test]
    fn single_process_collectives_are_the_identity() {
        let c = Single;
        let mut v = vec![1.5f64, -2.0];
        c.all_reduce_sum_f64(&mut v).unwrap();
        assert_eq!(v, vec![1.5, -2.0]);
        assert_eq!(all_gather_bytes(&c, vec![7, 8]).unwrap(), vec![vec![7, 8]]);
        assert_eq!(rank_prefix(&c), "");
    }
}
