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
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("rollfleet-lambda-host: could not start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(rollfleet_lambda_host::run(cli.serve)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("rollfleet-lambda-host: {e}");
            ExitCode::FAILURE
        }
    }
}
