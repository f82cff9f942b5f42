//! Which vector instructions the hand-written CPU paths use, decided once per process.
//!
//! Every fast path of `kernels` (the element-wise loops of [`super::simd`], decode attention,
//! AdamW, the bf16 products and their packing, the f32/f64 products handed to the `gemm`
//! crate) asks [`isa`] which form to run:
//!
//! | [`Isa`]     | CPUs                                             | element-wise loops        |
//! |-------------|--------------------------------------------------|---------------------------|
//! | `Avx512`    | x86-64 with AVX-512 F/BW/VL (Intel Xeon, AMD Zen 4/5) | compiled 16 lanes wide |
//! | `Avx2`      | x86-64 with AVX2 and FMA (Haswell on, AMD Zen 1-3) | compiled 8 lanes wide    |
//! | `Neon`      | aarch64 (Graviton, Ampere, Apple silicon)        | the target's own (NEON)   |
//! | `Portable`  | anything: no hand-written vector code            | the crate's baseline (SSE2 on x86-64) |
//!
//! `MAIN_PPO_CPU=avx512|avx2|neon|portable` forces a form the CPU has (to compare them, or
//! to test a path this machine would not choose); unset or `auto` chooses the widest.
//! [`check_choice`] refuses other values and forms this CPU lacks at start-up, naming the
//! value and what the CPU offers.
//!
//! Every form computes the same results where the code says so (element-wise loops and the
//! reductions written with explicit lanes are bit-identical across forms, since Rust never
//! fuses a multiply and an add on its own); the matrix products of the `gemm` crate and the
//! bf16 kernels sum in their own orders and are compared with tolerances.

use std::sync::OnceLock;

/// The vector instruction set of the hand-written CPU paths.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Isa {
    /// x86-64 AVX-512 (F, BW, VL) with AVX2 and FMA.
    Avx512,
    /// x86-64 AVX2 with FMA.
    Avx2,
    /// aarch64 Advanced SIMD.
    Neon,
    /// No hand-written vector code: plain loops at the crate's baseline target.
    Portable,
}

impl Isa {
    /// The name `MAIN_PPO_CPU` takes.
    pub fn name(self) -> &'static str {
        match self {
            Isa::Avx512 => "avx512",
            Isa::Avx2 => "avx2",
            Isa::Neon => "neon",
            Isa::Portable => "portable",
        }
    }

    /// The form named `s`, whether or not this CPU has it.
    fn parse(s: &str) -> Option<Isa> {
        [Isa::Avx512, Isa::Avx2, Isa::Neon, Isa::Portable]
            .into_iter()
            .find(|i| i.name() == s)
    }

    /// Whether this CPU runs the form.
    pub fn here(self) -> bool {
        match self {
            Isa::Avx512 => has_avx512(),
            Isa::Avx2 => has_avx2(),
            Isa::Neon => cfg!(target_arch = "aarch64"),
            Isa::Portable => true,
        }
    }
}

#[cfg(target_arch = "x86_64")]
fn has_avx512() -> bool {
    use std::arch::is_x86_feature_detected as has;
    has!("avx512f") && has!("avx512bw") && has!("avx512vl") && has_avx2()
}

#[cfg(not(target_arch = "x86_64"))]
fn has_avx512() -> bool {
    false
}

#[cfg(target_arch = "x86_64")]
fn has_avx2() -> bool {
    use std::arch::is_x86_feature_detected as has;
    has!("avx2") && has!("fma")
}

#[cfg(not(target_arch = "x86_64"))]
fn has_avx2() -> bool {
    false
}

/// The forms this CPU runs, widest first (the last is always `Portable`).
pub fn available() -> Vec<Isa> {
    [Isa::Avx512, Isa::Avx2, Isa::Neon, Isa::Portable]
        .into_iter()
        .filter(|i| i.here())
        .collect()
}

/// The widest form this CPU runs.
pub fn detected() -> Isa {
    available()[0]
}

/// The form of this process: `MAIN_PPO_CPU` when set to a form this CPU runs, else the
/// widest. A value [`check_choice`] refuses stops the process here with that error (the
/// command line checks it first and reports it as a configuration error): running a form the
/// CPU lacks would fault, and quietly running another would measure the wrong code.
pub fn isa() -> Isa {
    static ISA: OnceLock<Isa> = OnceLock::new();
    *ISA.get_or_init(|| {
        let value = std::env::var("MAIN_PPO_CPU").ok();
        match chosen(value.as_deref()) {
            Ok(Some(isa)) => isa,
            Ok(None) => detected(),
            Err(e) => panic!("MAIN_PPO_CPU: {e}"),
        }
    })
}

/// The form `value` (of `MAIN_PPO_CPU`) asks for: `None` for unset, empty or `auto`; an error
/// naming the value for an unknown name or a form this CPU lacks.
fn chosen(value: Option<&str>) -> Result<Option<Isa>, String> {
    let offered = || {
        let names: Vec<&str> = available().iter().map(|i| i.name()).collect();
        names.join(", ")
    };
    match value.map(str::trim) {
        None | Some("") | Some("auto") => Ok(None),
        Some(v) => match Isa::parse(&v.to_ascii_lowercase()) {
            Some(isa) if isa.here() => Ok(Some(isa)),
            Some(isa) => Err(format!(
                "`{v}`: this CPU has no {} instructions; it offers auto, {}",
                isa.name(),
                offered()
            )),
            None => Err(format!(
                "`{v}` is not a choice: auto (the default), avx512, avx2, neon or portable \
                 (this CPU offers {})",
                offered()
            )),
        },
    }
}

/// Whether `value` (of `MAIN_PPO_CPU`) names a form this CPU can run (or none); the error
/// names the value and the choices (the caller names the variable).
pub fn check_choice(value: Option<&str>) -> Result<(), String> {
    chosen(value).map(|_| ())
}

/// The form in use, in words (for the log).
pub fn describe() -> String {
    let isa = isa();
    let how = match isa {
        Isa::Avx512 => "AVX-512",
        Isa::Avx2 => "AVX2 + FMA",
        Isa::Neon => "NEON",
        Isa::Portable => "portable loops (no hand-written vector code)",
    };
    match isa == detected() {
        true => how.to_string(),
        false => format!("{how} (MAIN_PPO_CPU={}; this CPU offers {})", isa.name(), {
            let names: Vec<&str> = available().iter().map(|i| i.name()).collect();
            names.join(", ")
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The choices: unset/auto choose, every form the CPU has is accepted (and is what
    /// `chosen` returns), a form it lacks and an unknown name are errors naming the value and
    /// what the CPU offers.
    #[test]
    fn choices_are_checked_against_this_cpu() {
        for v in [None, Some(""), Some("auto"), Some(" auto ")] {
            assert_eq!(chosen(v), Ok(None), "{v:?}");
        }
        for isa in [Isa::Avx512, Isa::Avx2, Isa::Neon, Isa::Portable] {
            match chosen(Some(isa.name())) {
                Ok(got) => {
                    assert!(isa.here(), "{isa:?} accepted on a CPU without it");
                    assert_eq!(got, Some(isa));
                }
                Err(e) => {
                    assert!(!isa.here(), "{isa:?} refused on a CPU that has it: {e}");
                    assert!(e.contains(isa.name()) && e.contains("offers"), "{e}");
                }
            }
        }
        let e = chosen(Some("sse9")).unwrap_err();
        assert!(
            e.contains("`sse9` is not a choice") && e.contains("portable"),
            "{e}"
        );
        assert_eq!(chosen(Some("AVX2")).is_ok(), Isa::Avx2.here());
        // Portable is always offered, and the widest form is the first offered.
        assert_eq!(available().last(), Some(&Isa::Portable));
        assert_eq!(detected(), available()[0]);
        // The x86 forms nest: AVX-512 implies AVX2 (the AVX-512 form runs AVX2 code too).
        if Isa::Avx512.here() {
            assert!(Isa::Avx2.here());
        }
        assert!(!describe().is_empty());
    }
}
