//! The MPI backend (cargo feature `mpi`): rsmpi over the system's Open MPI or MPICH.
//!
//! MPI is initialised with `MPI_THREAD_SERIALIZED` and every call goes through one lock, so the
//! trainer may call collectives from any thread (never two at once). MPI's default error
//! handler stays (errors are fatal: the process aborts and the launcher stops the others).
//! Dropping the backend finalises MPI.

use std::sync::Mutex;

use mpi::collective::SystemOperation;
use mpi::topology::{Communicator, SimpleCommunicator};
use mpi::traits::*;
use mpi::Threading;

use super::{Collective, DistError, Result};

/// The world communicator, moved between threads only under [`Mpi`]'s lock.
struct World(SimpleCommunicator);

// SAFETY: MPI runs with at least MPI_THREAD_SERIALIZED (checked in `Mpi::init`), and every use
// of the communicator holds `Mpi::world`'s lock, so no two threads call MPI at once.
unsafe impl Send for World {}
unsafe impl Sync for World {}

/// The MPI world of this run.
pub struct Mpi {
    world: Mutex<World>,
    rank: usize,
    size: usize,
    local_rank: usize,
    // Last field: dropped after the communicator, finalising MPI.
    _universe: mpi::environment::Universe,
}

/// Elements per MPI call: MPI counts are C ints.
const MAX_COUNT: usize = 1 << 30;

impl Mpi {
    /// Initialises MPI (once per process).
    pub fn init() -> Result<Self> {
        let (universe, provided) = mpi::initialize_with_threading(Threading::Serialized)
            .ok_or_else(|| DistError::Launch("MPI was already initialised".into()))?;
        if provided < Threading::Serialized {
            return Err(DistError::Launch(format!(
                "the MPI library provides thread level {provided:?}; main_ppo needs MPI_THREAD_SERIALIZED"
            )));
        }
        let world = universe.world();
        let rank = world.rank() as usize;
        let size = world.size() as usize;
        // Ranks sharing this node's memory, ordered by world rank.
        let local_rank = world.split_shared(world.rank()).rank() as usize;
        Ok(Self {
            world: Mutex::new(World(world)),
            rank,
            size,
            local_rank,
            _universe: universe,
        })
    }

    fn with<T>(&self, op: &'static str, f: impl FnOnce(&SimpleCommunicator) -> T) -> Result<T> {
        let g = self.world.lock().map_err(|_| DistError::Collective {
            op,
            rank: self.rank,
            msg: "a previous collective panicked".into(),
        })?;
        Ok(f(&g.0))
    }
}

impl Collective for Mpi {
    fn rank(&self) -> usize {
        self.rank
    }
    fn world_size(&self) -> usize {
        self.size
    }
    fn local_rank(&self) -> usize {
        self.local_rank
    }
    fn backend(&self) -> &'static str {
        "mpi"
    }
    fn all_reduce_sum_f64(&self, buf: &mut [f64]) -> Result<()> {
        self.with("all_reduce", |w| {
            for chunk in buf.chunks_mut(MAX_COUNT) {
                let send = chunk.to_vec();
                w.all_reduce_into(&send[..], chunk, SystemOperation::sum());
            }
        })
    }
    fn all_reduce_sum_f32(&self, buf: &mut [f32]) -> Result<()> {
        self.with("all_reduce", |w| {
            for chunk in buf.chunks_mut(MAX_COUNT) {
                let send = chunk.to_vec();
                w.all_reduce_into(&send[..], chunk, SystemOperation::sum());
            }
        })
    }
    fn broadcast_bytes(&self, buf: &mut Vec<u8>, root: usize) -> Result<()> {
        if root >= self.size {
            return Err(DistError::Collective {
                op: "broadcast",
                rank: self.rank,
                msg: format!("root {root} is not a rank of a world of {}", self.size),
            });
        }
        self.with("broadcast", |w| {
            let p = w.process_at_rank(root as i32);
            let mut len = buf.len() as u64;
            p.broadcast_into(&mut len);
            buf.resize(len as usize, 0);
            for chunk in buf.chunks_mut(MAX_COUNT) {
                p.broadcast_into(chunk);
            }
        })
    }
    fn barrier(&self) -> Result<()> {
        self.with("barrier", |w| w.barrier())
    }
}
