//! `bootstrap`: the executable of rollfleet's reward functions as an AWS Lambda custom runtime
//! (`provided.al2023`). Reads `AWS_LAMBDA_RUNTIME_API` and `_HANDLER` and runs the event loop.

use std::process::ExitCode;

use rollfleet_lambda_bootstrap::{RuntimeError, run};
use rollfleet_rewards::Handler;

fn main() -> ExitCode {
    let Ok(api) = std::env::var("AWS_LAMBDA_RUNTIME_API") else {
        eprintln!("rollfleet bootstrap: {}", RuntimeError::NoRuntimeApi);
        return ExitCode::FAILURE;
    };
    let handler_name = std::env::var("_HANDLER").unwrap_or_default();
    match run(&api, &handler_name, &Handler::default()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("rollfleet bootstrap: {e}");
            ExitCode::FAILURE
        }
    }
}
