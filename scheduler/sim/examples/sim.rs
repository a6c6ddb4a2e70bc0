//! `cargo run --release -p rollfleet-sim --example sim -- JOB.yaml [-o json] [--baseline ...]`:
//! the `rollfleet sim` command without the `rollfleet` binary.

use clap::Parser;
use rollfleet_sim::{OutputFormat, SimArgs};

#[derive(Parser)]
struct Cli {
    /// Output format.
    #[arg(short, long, value_enum, default_value_t = OutputFormat::Table)]
    output: OutputFormat,
    #[command(flatten)]
    sim: SimArgs,
}

fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    match rollfleet_sim::run(
        &cli.sim,
        cli.output,
        &mut std::io::stdout(),
        &mut std::io::stderr(),
    ) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}
