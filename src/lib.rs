//! main_ppo: verl's PPO trainer (`python -m verl.trainer.main_ppo`) as one Rust binary.
//!
//! Layers, lowest first (a module never imports one above it):
//! `config` (every key and default) → `data` (rows → tokenised prompts) → `model` (the
//! transformer and its files) → `rollout` (generation) → `reward` (scores) and `algo` (PPO
//! mathematics) → `metrics` (names, sinks) and `checkpoint` (folder layout, atomic saves) →
//! `trainer` (the loop) → `cli` (argv, logging, signals, exit codes); `util` (paths, the
//! seeded permutation) sits below them all.

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
