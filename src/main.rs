//! `main_ppo`: see the library crate for everything; this only hands argv (as OS strings) over and sets the exit status.

fn main() {
    std::process::exit(main_ppo::cli::main_with_args(std::env::args_os()));
}
