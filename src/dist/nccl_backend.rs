//! The NCCL backend (cargo feature `nccl`, which implies `cuda`): candle-core's `nccl` feature
//! exposes cudarc's NCCL communicator; each rank drives the GPU of its local rank.
//!
//! Two ways to connect the ranks:
//! - **torchrun** (`torchrun --no-python --nproc-per-node N main_ppo ...`): rank, world size and
//!   local rank come from `RANK`, `WORLD_SIZE`, `LOCAL_RANK`; NCCL's bootstrap root listens at
//!   `NCCL_COMM_ID`, which defaults to `MASTER_ADDR:(MASTER_PORT + 1)` (torchrun's own store
//!   holds `MASTER_PORT`). With `NCCL_COMM_ID` set, every rank derives the same unique id and
//!   rank 0 opens the root.
//! - **mpirun / srun** in a build that also has `mpi`: MPI numbers the ranks and broadcasts
//!   rank 0's NCCL id; MPI then carries the byte broadcasts and barriers, NCCL the sums.
//!
//! The trainer's buffers live on the host (the [`Collective`] interface), so a sum copies the
//! buffer to the device, reduces it in place and copies it back, then waits for the stream: a
//! peer that never arrives leaves this rank waiting in that synchronisation, where the
//! [`super::Watchdog`] catches it.

use std::sync::{Arc, Mutex};

use candle_core::cuda_backend::cudarc::driver::{CudaContext, CudaStream, DeviceRepr};
use candle_core::cuda_backend::cudarc::nccl::safe::{Comm, Id, NcclType, ReduceOp};

use super::{Collective, DistError, Result};

/// The communicator, moved between threads only under [`Nccl`]'s lock.
struct Shared(Comm);

// SAFETY: an NCCL communicator may be used from any thread as long as no two threads issue
// operations on it at once; every use holds `Nccl::comm`'s lock.
unsafe impl Send for Shared {}
unsafe impl Sync for Shared {}

/// The NCCL world of this run.
pub struct Nccl {
    comm: Mutex<Shared>,
    stream: Arc<CudaStream>,
    rank: usize,
    size: usize,
    local_rank: usize,
    /// The launcher's host-side collectives (MPI), used for byte broadcasts and barriers;
    /// `None` under torchrun. Last field: dropped after the communicator.
    host: Option<Box<dyn Collective>>,
}

/// Bytes of an NCCL unique id.
const ID_BYTES: usize = 128;

fn launch(msg: String) -> DistError {
    DistError::Launch(msg)
}

/// Whether torchrun (or a launcher that sets the same variables) started this process.
pub fn torchrun_launch() -> bool {
    ["RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"]
        .iter()
        .all(|v| std::env::var_os(v).is_some())
}

impl Nccl {
    /// Connects the ranks torchrun started (see the module documentation).
    pub fn from_torchrun() -> Result<Self> {
        let var = |k: &str| {
            std::env::var(k).map_err(|_| {
                launch(format!(
                    "torchrun launch: the environment variable {k} is not set"
                ))
            })
        };
        let num = |k: &str| -> Result<usize> {
            let v = var(k)?;
            v.trim().parse().map_err(|_| {
                launch(format!(
                    "torchrun launch: {k}=`{v}` is not a non-negative integer"
                ))
            })
        };
        let rank = num("RANK")?;
        let size = num("WORLD_SIZE")?;
        let local_rank = if std::env::var_os("LOCAL_RANK").is_some() {
            num("LOCAL_RANK")?
        } else {
            rank
        };
        if rank >= size {
            return Err(launch(format!(
                "torchrun launch: RANK={rank} is not below WORLD_SIZE={size}"
            )));
        }
        if std::env::var_os("NCCL_COMM_ID").is_none() {
            let addr = var("MASTER_ADDR")?;
            let port = num("MASTER_PORT")?;
            if port >= 65535 {
                return Err(launch(format!(
                    "torchrun launch: MASTER_PORT={port} leaves no port above it for NCCL's \
                     bootstrap; set NCCL_COMM_ID=<host>:<port> yourself"
                )));
            }
            // Set before the first NCCL call (NCCL reads its environment once).
            std::env::set_var("NCCL_COMM_ID", format!("{addr}:{}", port + 1));
        }
        let id = Id::new().map_err(|e| {
            launch(format!(
                "rank {rank}: NCCL could not make its unique id from NCCL_COMM_ID: {e:?}"
            ))
        })?;
        Self::connect(rank, size, local_rank, id, None)
    }

    /// Connects the ranks an MPI launcher started: rank 0's NCCL id travels over MPI.
    #[cfg(feature = "mpi")]
    pub fn over_mpi(mpi: super::Mpi) -> Result<Self> {
        let (rank, size, local_rank) = (mpi.rank(), mpi.world_size(), mpi.local_rank());
        let mut bytes = if rank == 0 {
            let id = Id::new()
                .map_err(|e| launch(format!("rank 0: NCCL could not make its unique id: {e:?}")))?;
            id.internal().iter().map(|&c| c as u8).collect()
        } else {
            Vec::new()
        };
        mpi.broadcast_bytes(&mut bytes, 0)?;
        if bytes.len() != ID_BYTES {
            return Err(launch(format!(
                "rank {rank}: received an NCCL id of {} bytes, not {ID_BYTES}",
                bytes.len()
            )));
        }
        let mut internal = [0 as std::ffi::c_char; ID_BYTES];
        for (d, s) in internal.iter_mut().zip(&bytes) {
            *d = *s as std::ffi::c_char;
        }
        Self::connect(
            rank,
            size,
            local_rank,
            Id::uninit(internal),
            Some(Box::new(mpi)),
        )
    }

    fn connect(
        rank: usize,
        size: usize,
        local_rank: usize,
        id: Id,
        host: Option<Box<dyn Collective>>,
    ) -> Result<Self> {
        let ctx = CudaContext::new(local_rank).map_err(|e| {
            launch(format!(
                "rank {rank}: CUDA device {local_rank} (this rank's local rank) is not \
                 available: {e}"
            ))
        })?;
        ctx.bind_to_thread()
            .map_err(|e| launch(format!("rank {rank}: CUDA device {local_rank}: {e}")))?;
        let stream = ctx
            .new_stream()
            .map_err(|e| launch(format!("rank {rank}: CUDA stream: {e}")))?;
        let comm = Comm::from_rank(stream.clone(), rank, size, id).map_err(|e| {
            launch(format!(
                "rank {rank}: NCCL could not connect {size} ranks: {e:?} (set NCCL_DEBUG=INFO \
                 for NCCL's own account)"
            ))
        })?;
        Ok(Self {
            comm: Mutex::new(Shared(comm)),
            stream,
            rank,
            size,
            local_rank,
            host,
        })
    }

    fn failed(&self, op: &'static str, what: impl std::fmt::Debug) -> DistError {
        DistError::Collective {
            op,
            rank: self.rank,
            msg: format!("{what:?}"),
        }
    }

    /// Element-wise sum of `buf` over the ranks, through the device.
    fn sum<T: NcclType + DeviceRepr>(&self, buf: &mut [T]) -> Result<()> {
        if buf.is_empty() {
            return Ok(());
        }
        let g = self
            .comm
            .lock()
            .map_err(|_| self.failed("all_reduce", "a previous collective panicked"))?;
        self.stream
            .context()
            .bind_to_thread()
            .map_err(|e| self.failed("all_reduce", e))?;
        let mut dev = self
            .stream
            .clone_htod(buf)
            .map_err(|e| self.failed("all_reduce", e))?;
        g.0.all_reduce_in_place(&mut dev, &ReduceOp::Sum)
            .map_err(|e| self.failed("all_reduce", e))?;
        self.stream
            .memcpy_dtoh(&dev, buf)
            .map_err(|e| self.failed("all_reduce", e))?;
        self.stream
            .synchronize()
            .map_err(|e| self.failed("all_reduce", e))
    }

    /// `root`'s bytes on every rank, over NCCL (torchrun: no host-side launcher library).
    fn broadcast_device(&self, buf: &mut Vec<u8>, root: usize) -> Result<()> {
        let g = self
            .comm
            .lock()
            .map_err(|_| self.failed("broadcast", "a previous collective panicked"))?;
        let s = &self.stream;
        s.context()
            .bind_to_thread()
            .map_err(|e| self.failed("broadcast", e))?;
        let mut len = s
            .clone_htod(&[buf.len() as u64])
            .map_err(|e| self.failed("broadcast", e))?;
        g.0.broadcast_in_place(&mut len, root as i32)
            .map_err(|e| self.failed("broadcast", e))?;
        let mut n = [0u64];
        s.memcpy_dtoh(&len, &mut n)
            .map_err(|e| self.failed("broadcast", e))?;
        s.synchronize().map_err(|e| self.failed("broadcast", e))?;
        buf.resize(n[0] as usize, 0);
        if buf.is_empty() {
            return Ok(());
        }
        let mut dev = s
            .clone_htod(buf.as_slice())
            .map_err(|e| self.failed("broadcast", e))?;
        g.0.broadcast_in_place(&mut dev, root as i32)
            .map_err(|e| self.failed("broadcast", e))?;
        s.memcpy_dtoh(&dev, buf.as_mut_slice())
            .map_err(|e| self.failed("broadcast", e))?;
        s.synchronize().map_err(|e| self.failed("broadcast", e))
    }
}

impl Collective for Nccl {
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
        "nccl"
    }
    fn all_reduce_sum_f64(&self, buf: &mut [f64]) -> Result<()> {
        self.sum(buf)
    }
    fn all_reduce_sum_f32(&self, buf: &mut [f32]) -> Result<()> {
        self.sum(buf)
    }
    fn broadcast_bytes(&self, buf: &mut Vec<u8>, root: usize) -> Result<()> {
        if root >= self.size {
            return Err(self.failed(
                "broadcast",
                format!("root {root} is not a rank of a world of {}", self.size),
            ));
        }
        match &self.host {
            Some(h) => h.broadcast_bytes(buf, root),
            None => self.broadcast_device(buf, root),
        }
    }
    fn barrier(&self) -> Result<()> {
        match &self.host {
            Some(h) => h.barrier(),
            // A one-element sum: returns once every rank has contributed.
            None => self.sum(&mut [0f32]),
        }
    }
}
