//! main_ppo: verl's PPO trainer (`python -m verl.trainer.main_ppo`) as one Rust binary.
//!
//! Rooms, lowest first (a room never names one above it; `scripts/layering.py` checks it):
//! `util` (paths, the seeded permutation) and `kernels` (CPU kernels that know no model) →
//! `config` (every key and default) → `data` (rows → tokenised prompts) and `dist`
//! (collectives, the rank wire format) → `model` (the network and how its forwards run) →
//! `weights` (model files ↔ the network) → `rollout` (generation) and `algo` (PPO mathematics)
//! → `reward` (scores) → `metrics` (names, sinks), `checkpoint` (folder layout, atomic saves)
//! and `control` (the live reward-weight API) → `trainer` (the loop) → `cli` (argv, logging,
//! signals, exit codes). `docs/design.md` has the conventions and the facts the code relies on.

pub mod algo;
pub mod checkpoint;
pub mod cli;
pub mod config;
pub mod control;
pub mod data;
pub mod dist;
pub mod kernels;
pub mod metrics;
pub mod model;
pub mod reward;
pub mod rollout;
#[doc(hidden)]
pub mod testing;
pub mod trainer;
pub mod util;
pub mod weights;

/// Every binary and test of the crate allocates through `kernels::alloc::HugePages`: malloc for
/// small blocks; large ones mapped on huge-page boundaries, advised to use huge pages and kept
/// for reuse inside `kernels::alloc::huge_pages` (a training update).
#[global_allocator]
static ALLOCATOR: kernels::alloc::HugePages = kernels::alloc::HugePages;
