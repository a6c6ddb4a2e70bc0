//! `bootstrap`: the executable of rollfleet's reward functions as an AWS Lambda custom runtime
//! (`provided.al2023`). Reads `AWS_LAMBDA_RUNTIME_API` and `_HANDLER` and runs the event loop.

use std::process::ExitCode;

use rollfleet_lambda_bootstrap::{RuntimeError, run};
use rollfleet_rewards::Handler;

fn main() -> ExitCode {
    // Lambda sends a function's stderr to its log group: plain lines, no colours, `RUST_LOG`
    // filters (default `info`).
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(false)
        .with_writer(std::io::stderr)
        .init();
    let Ok(api) = std::env::var("AWS_LAMBDA_RUNTIME_API") else {
        tracing::error!("bootstrap: {}", RuntimeError::NoRuntimeApi);
        return ExitCode::FAILURE;
    };
    let handler_name = std::env::var("_HANDLER").unwrap_or_default();
    match run(&api, &handler_name, &Handler::default()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!("bootstrap: {e}");
            ExitCode::FAILURE
        }
    }
}
