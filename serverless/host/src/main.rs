//! `rollfleet-lambda-host`: the local Lambda-compatible host as a standalone program, with the
//! same arguments as `rollfleet serverless serve` (for use before or without the `rollfleet` CLI).

use std::process::ExitCode;

use clap::Parser;
use rollfleet_lambda_host::ServeArgs;

#[derive(Debug, Parser)]
#[command(
    name = "rollfleet-lambda-host",
    about = "Serve rollfleet's reward functions over the AWS Lambda Invoke API"
)]
struct Cli {
    #[command(flatten)]
    serve: ServeArgs,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    // `RUST_LOG` filters (default `info`); lines go to stderr, the first one naming the address.
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .init();
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            tracing::error!("serverless host: could not start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(rollfleet_lambda_host::run(cli.serve)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!("serverless host: {e}");
            ExitCode::FAILURE
        }
    }
}
