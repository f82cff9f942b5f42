//! Compiles the project's own CUDA kernels (`src/kernels/cuda/*.cu`) to PTX when the `cuda`
//! feature is on; the CPU build does nothing here. The PTX is embedded in the binary and
//! loaded by the driver at run time (`kernels::cuda`). nvcc is the one candle's kernels are
//! built with (`nvcc` on PATH, or under CUDA_ROOT / CUDA_PATH); `CUDA_COMPUTE_CAP` names the
//! virtual architecture (default 80: the PTX is compiled further for any newer GPU, H100/H200
//! included, by the driver).

use std::path::{Path, PathBuf};
use std::process::Command;

const KERNELS: &[&str] = &["sampling", "optim"];

fn main() {
    println!("cargo::rerun-if-changed=build.rs");
    println!("cargo::rerun-if-env-changed=CUDA_COMPUTE_CAP");
    for k in KERNELS {
        println!("cargo::rerun-if-changed=src/kernels/cuda/{k}.cu");
    }
    if std::env::var_os("CARGO_FEATURE_CUDA").is_none() {
        return;
    }
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("cargo sets OUT_DIR"));
    let cap = std::env::var("CUDA_COMPUTE_CAP")
        .ok()
        .map(|c| c.replace('.', ""))
        .filter(|c| !c.is_empty() && c.chars().all(|d| d.is_ascii_digit()))
        .unwrap_or_else(|| "80".into());
    let nvcc = nvcc();
    for k in KERNELS {
        let src = Path::new("src/kernels/cuda").join(format!("{k}.cu"));
        let ptx = out.join(format!("{k}.ptx"));
        let status = Command::new(&nvcc)
            .args(["--ptx", "-O3", "-std=c++17", "--expt-relaxed-constexpr"])
            .arg(format!("-arch=compute_{cap}"))
            .arg("-o")
            .arg(&ptx)
            .arg(&src)
            .status()
            .unwrap_or_else(|e| {
                panic!(
                    "{}: cannot run nvcc ({e}); the `cuda` feature needs the CUDA toolkit's nvcc on PATH or under CUDA_ROOT",
                    nvcc.display()
                )
            });
        if !status.success() {
            panic!("nvcc failed on {}", src.display());
        }
    }
}

/// nvcc under CUDA_ROOT / CUDA_PATH / CUDA_HOME, else the one on PATH.
fn nvcc() -> PathBuf {
    for var in ["CUDA_ROOT", "CUDA_PATH", "CUDA_HOME"] {
        if let Some(root) = std::env::var_os(var) {
            let p = Path::new(&root).join("bin").join("nvcc");
            if p.is_file() {
                return p;
            }
        }
    }
    PathBuf::from("nvcc")
}
