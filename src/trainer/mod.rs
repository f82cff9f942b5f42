//! The training loop and its parts. So far: the optimizer and learning-rate schedule
//! (`optim`); the loop itself (rollout → reward → log-probs → values → advantages → updates)
//! comes next.

pub mod optim;

pub use optim::{clip_grad_norm, AdamW, LrSchedule};
