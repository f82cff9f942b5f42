//! Small helpers used by layers that do not import each other: paths written with `~`
//! (config, data, model, trainer), the seeded permutation (the data loader's shuffles,
//! the update's mini-batch order, `clip_cov`'s token draw) and the fault points tests inject
//! crashes at (the checkpoint save sequence, the trainer's phases).

use rand::{RngCore, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// `~/x` → `$HOME/x` (verl's paths are written with `~`).
pub fn expand_home(p: &str) -> String {
    if let Some(rest) = p.strip_prefix("~/") {
        if let Some(home) = std::env::var_os("HOME") {
            return format!("{}/{rest}", home.to_string_lossy());
        }
    } else if p == "~" {
        if let Some(home) = std::env::var_os("HOME") {
            return home.to_string_lossy().into_owned();
        }
    }
    p.to_string()
}

/// A permutation of `0..len` fixed by `(seed, stream)`: Fisher–Yates over ChaCha8, whose output
/// is fixed by its specification (so orders stay the same across releases and platforms).
pub fn permutation(len: usize, seed: u64, stream: u64) -> Vec<usize> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    rng.set_stream(stream);
    let mut p: Vec<usize> = (0..len).collect();
    for i in (1..len).rev() {
        // Multiply-shift bounded draw in [0, i].
        let j = ((rng.next_u64() as u128 * (i as u128 + 1)) >> 64) as usize;
        p.swap(i, j);
    }
    p
}

/// A point where tests inject a fault: `name` during (or, for a save, of) step `step`. Debug
/// builds only (which is what tests run; in release builds it is nothing). With
/// `MAIN_PPO_TEST_KILL_AT=<step>:<name>` in the environment the process kills itself with
/// SIGKILL on reaching the point (a crash at a known moment, not timing luck); in unit tests
/// the hook of [`with_fault_hook`] runs there instead, on the thread that set it.
#[inline]
pub fn fault_point(name: &str, step: u64) {
    #[cfg(test)]
    FAULT_HOOK.with(|h| {
        if let Some(hook) = h.borrow().as_ref() {
            hook(name, step);
        }
    });
    #[cfg(debug_assertions)]
    {
        static KILL_AT: std::sync::OnceLock<Option<(u64, String)>> = std::sync::OnceLock::new();
        let at = KILL_AT.get_or_init(|| {
            let v = std::env::var("MAIN_PPO_TEST_KILL_AT").ok()?;
            let (s, n) = v.split_once(':')?;
            Some((s.trim().parse().ok()?, n.trim().to_string()))
        });
        if let Some((s, n)) = at {
            if *s == step && n == name {
                eprintln!("MAIN_PPO_TEST_KILL_AT: killed at {name} of step {step}");
                // SAFETY: plain system calls; the process ends here.
                unsafe { libc::kill(libc::getpid(), libc::SIGKILL) };
            }
        }
    }
    let _ = (name, step);
}

#[cfg(test)]
type FaultHook = Box<dyn Fn(&str, u64)>;

#[cfg(test)]
thread_local! {
    static FAULT_HOOK: std::cell::RefCell<Option<FaultHook>> = const { std::cell::RefCell::new(None) };
}

/// Runs `body` with `hook` called at every [`fault_point`] this thread reaches (tests: a
/// panic there stands for a crash, a flag set there for a signal arriving).
#[cfg(test)]
pub fn with_fault_hook<R>(hook: impl Fn(&str, u64) + 'static, body: impl FnOnce() -> R) -> R {
    struct Reset;
    impl Drop for Reset {
        fn drop(&mut self) {
            FAULT_HOOK.with(|h| *h.borrow_mut() = None);
        }
    }
    FAULT_HOOK.with(|h| *h.borrow_mut() = Some(Box::new(hook)));
    let _reset = Reset;
    body()
}
