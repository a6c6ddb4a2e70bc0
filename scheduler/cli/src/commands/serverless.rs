//! `rollfleet serverless serve`: the local function host that speaks the AWS Lambda Invoke API
//! for rollfleet's reward functions (the embedded default for rewards; see docs/serverless.md).

use std::io::Write;

use anyhow::Result;
use rollfleet_lambda_host::ServeArgs;

use crate::output::exit;

/// `rollfleet serverless ...`.
#[derive(Debug, clap::Subcommand)]
pub enum ServerlessCommand {
    /// Serve the reward functions over the Lambda Invoke API until Ctrl-C.
    #[command(after_help = "Examples:\n  \
        rollfleet serverless serve\n  \
        rollfleet serverless serve --listen 127.0.0.1:9001\n  \
        aws lambda invoke --endpoint-url http://127.0.0.1:9001 --function-name math_answer \\\n    \
        --payload '{\"response\":\"\\\\boxed{42}\",\"reference\":\"42\"}' --cli-binary-format raw-in-base64-out out.json")]
    Serve(ServeArgs),
}

/// Runs the command; returns the exit code.
pub fn run(command: &ServerlessCommand, stderr: &mut dyn Write) -> Result<u8> {
    match command {
        ServerlessCommand::Serve(args) => {
            let runtime = tokio::runtime::Builder::new_multi_thread()
                .enable_all()
                .build()?;
            match runtime.block_on(rollfleet_lambda_host::run(args.clone())) {
                Ok(()) => Ok(exit::OK),
                Err(error) => {
                    writeln!(stderr, "error: {error}")?;
                    Ok(exit::FAILED)
                }
            }
        }
    }
}
