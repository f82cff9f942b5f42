//! CPU kernels that know no model: the ground floor of the crate (what `candle-core/src/cpu`
//! and llm.c's `llmc/` are to theirs). Nothing here imports the rest of the crate; the model,
//! the decode engine and the optimizer build on these.
//!
//! - `cpu`: which vector instructions the paths below use (AVX-512, AVX2 + FMA, NEON or
//!   portable loops), detected once per process or forced with `MAIN_PPO_CPU`,
//! - `elem`: the element types of the hand-written paths (f32, f64; bf16 cache bits) and the
//!   lane-wise reductions (`dot`, `sum`, `max`),
//! - `simd`: element-wise loops compiled at the CPU's vector width, and `Par` (rayon or the
//!   calling thread),
//! - `gemm`: strided matrix products on host slices, and the mixed f32/bf16 form,
//! - `attend`: decode attention of one token over its cached keys and values,
//! - `bf16`: bf16 products with f32 sums: AMX tiles, AVX512-BF16, NEON's BFDOT, or bf16
//!   operands widened to f32 for FMA (AVX2, NEON, portable loops),
//! - `adamw`: AdamW's element-wise rule, in place on a parameter's storage,
//! - `adam_lowbit`: Adam with block-quantised moments (torchao's 8-bit, 4-bit and FP8 forms),
//! - `storage`: CPU storage as host slices (custom ops, in-place gradient accumulation),
//! - `team`: helper threads that spin between the short parallel loops of a decode step,
//! - `alloc`: the process's allocator (the system's, large blocks on transparent huge pages),
//! - `cuda` (feature `cuda`): the GPU kernels: sampling, AdamW and accumulation in place, the
//!   memory pool's statistics.
//!
//! [`supported`] is the one rule that says where the hand-written paths serve: the training
//! layer, the fused LM head and the packed decode engine all run on the CPU in f32 or f64;
//! everything else (CUDA, half precision) runs candle's op composition.

pub mod adam_lowbit;
pub mod adamw;
pub mod alloc;
pub mod attend;
pub mod bf16;
pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod elem;
pub mod gemm;
pub mod simd;
pub mod storage;
pub mod team;

use candle_core::{DType, Device};

/// Whether the hand-written CPU paths serve tensors of `dtype` on `device` (CPU, f32 or f64).
pub fn supported(device: &Device, dtype: DType) -> bool {
    matches!(device, Device::Cpu) && matches!(dtype, DType::F32 | DType::F64)
}

#[cfg(test)]
mod tests {
    use candle_core::{DType, Device};

    #[test]
    fn hand_written_paths_serve_cpu_f32_and_f64_only() {
        assert!(super::supported(&Device::Cpu, DType::F32));
        assert!(super::supported(&Device::Cpu, DType::F64));
        for d in [DType::BF16, DType::F16, DType::U32] {
            assert!(!super::supported(&Device::Cpu, d), "{d:?}");
        }
    }
}
