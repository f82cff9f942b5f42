//! Logging to stderr through `tracing`; `RUST_LOG` filters (default `info`).

use std::io::IsTerminal;

use tracing_subscriber::EnvFilter;

/// Installs the stderr logger once (later calls do nothing).
pub fn init() {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .with_target(false)
        .without_time()
        .try_init();
}
