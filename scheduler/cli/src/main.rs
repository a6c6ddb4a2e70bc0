//! `rollfleet`: the command-line tool for RL jobs on disaggregated hardware.
//!
//! Every subcommand follows the conventions in `output.rs`: `-o table|json|yaml`, results on
//! stdout, errors on stderr, the exit codes of `output::exit`, an example in `--help`, and a
//! closed stdout pipe as a clean end.

mod commands;
mod output;
mod window;

use std::io::Write;
use std::process::ExitCode;

use clap::{CommandFactory, Parser, Subcommand};

use crate::output::{OutputFormat, exit};

/// The scheduler allocates and frees buffers of a few KB for every result's token ids and
/// log-probabilities; glibc's allocator spent a fifth of the scheduler's CPU on them in the
/// dispatch benchmark (`cargo bench -p rollfleet-server --bench dispatch`, which runs the
/// scheduler with this same allocator), mimalloc about half that.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// rollfleet: a disaggregated, heterogeneous-hardware scheduler for agentic RL training.
#[derive(Debug, Parser)]
#[command(
    name = "rollfleet",
    version,
    after_help = "Examples:\n  \
        rollfleet validate examples/jobs/quickstart.yaml\n  \
        rollfleet run examples/jobs/quickstart.yaml   # the whole job on this machine, GPUs emulated\n  \
        rollfleet sim examples/jobs/rollart-agentic.yaml\n  \
        rollfleet plan examples/jobs/rollart-agentic.yaml\n  \
        rollfleet serverless serve\n  \
        rollfleet catalog -o json\n  \
        rollfleet completion bash > ~/.local/share/bash-completion/completions/rollfleet\n\n\
        Exit codes: 0 success (a closed stdout pipe included), 1 failure while running, 2 bad \
        command line, 3 invalid or unreadable input.\n\
        Environment: ROLLFLEET_SCHEDULER (the default of every --scheduler), ROLLFLEET_TOKEN (the \
        scheduler's token), ROLLFLEET_ENGINE_API_KEY (a real engine's API key), RUST_LOG (log \
        levels, e.g. info,rollfleet_server=debug), ROLLFLEET_LOG_FORMAT (text or json).\n\
        Docs: docs/cli.md"
)]
struct Cli {
    /// Output format of the result (errors and progress always go to stderr as text).
    #[arg(short = 'o', long = "output", global = true, value_enum, default_value_t = OutputFormat::Table)]
    output: OutputFormat,

    /// How the scheduler and workers write their log to stderr: text for people, or one JSON
    /// object per line for a log collector. `RUST_LOG` sets the levels (default `info`).
    #[arg(long, global = true, value_enum, default_value_t = LogFormatArg::Text, env = "ROLLFLEET_LOG_FORMAT")]
    log_format: LogFormatArg,

    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Clone, Copy, clap::ValueEnum)]
enum LogFormatArg {
    Text,
    Json,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Check a job spec: every problem with its field path, or the figures it implies.
    Validate(commands::validate::ValidateArgs),
    /// Print the hardware catalogue (GPUs, CPU node shapes, serverless platforms).
    Catalog(commands::catalog::CatalogArgs),
    /// Simulate a job under rollfleet and the baselines (sync, sync-disaggregated,
    /// one-step-off) on a virtual clock, against the lower bound.
    #[command(after_help = "Examples:\n  \
        rollfleet sim examples/jobs/rollart-agentic.yaml\n  \
        rollfleet sim examples/jobs/quickstart.yaml --baseline rollfleet --baseline sync --seed 7\n  \
        rollfleet sim examples/jobs/rollart-agentic.yaml --timeline timeline.svg -o json > report.json\n  \
        rollfleet sim JOB.yaml --inventory cluster.yaml --baseline rollfleet\n\n\
        All hardware figures in the output are modelled (a roofline of published peaks), not measured.")]
    Sim(rollfleet_sim::cli::SimArgs),
    /// Plan a job: which work goes on which hardware, how many replicas of what size, the
    /// predicted utilisation, step time and cost, and why.
    #[command(after_help = "Examples:\n  \
        rollfleet plan examples/jobs/rollart-agentic.yaml\n  \
        rollfleet plan examples/jobs/rollart-agentic.yaml --compare -o json\n  \
        rollfleet plan JOB.yaml --inventory cluster.yaml\n\n\
        Predictions come from the planner's roofline model of published peaks, not from a GPU.")]
    Plan(commands::plan::PlanArgs),
    /// Profiles the planner uses (model, measured, probed): show them, export and import them.
    #[command(subcommand)]
    Profile(commands::profile::ProfileCommand),
    /// Reward functions over the AWS Lambda Invoke API.
    #[command(subcommand)]
    Serverless(commands::serverless::ServerlessCommand),
    /// List this node's GPUs (NVML) and optionally probe their real speed (CUDA, cuBLAS).
    Gpus(commands::gpus::GpusArgs),
    /// Run a job on this machine: a scheduler and one worker per pool as child processes on
    /// loopback, GPUs emulated (time-scaled), live progress, a summary at the end.
    #[command(after_help = "Examples:\n  \
        rollfleet run examples/jobs/quickstart.yaml\n  \
        rollfleet run examples/jobs/quickstart.yaml --workers-per-pool 2 --metrics-addr 127.0.0.1:9464\n\n\
        GPU figures are emulated (the simulator's roofline on the real clock), never measured.")]
    Run(commands::runtime::RunArgs),
    /// Serve one job as the scheduler (gRPC: workers, jobs): the job given, or the first one
    /// submitted with `rollfleet job submit`.
    #[command(after_help = "Examples:\n  \
        rollfleet scheduler examples/jobs/quickstart.yaml --expect-workers 5\n  \
        rollfleet scheduler --listen 0.0.0.0:7070 --metrics-addr 0.0.0.0:9464   # then: rollfleet job submit JOB.yaml")]
    Scheduler(commands::runtime::SchedulerArgs),
    /// Submit a job to a scheduler, and follow, inspect or cancel it.
    #[command(subcommand)]
    Job(commands::job::JobCommand),
    /// A scheduler's journal (`rollfleet scheduler --journal`): replay it offline to see where
    /// its job stood, and how to resume it.
    #[command(subcommand)]
    Journal(commands::journal::JournalCommand),
    /// A reference external trainer for a job with `rl.trainer: external`: reads the trainer
    /// feed, checks each step's trajectories (tokens, staleness), writes a checkpoint and
    /// publishes it as the next version. It trains no model.
    #[command(after_help = "Examples:\n  \
        rollfleet train examples/jobs/quickstart-external.yaml --scheduler http://127.0.0.1:7070 --checkpoints /tmp/ckpt")]
    Train(commands::train::TrainArgs),
    /// The node daemon: register with a scheduler and run what it assigns.
    #[command(after_help = "Examples:\n  \
        rollfleet worker --scheduler http://127.0.0.1:7070 --pool decode\n  \
        rollfleet worker --pool decode --engine openai --engine-url http://127.0.0.1:8000   # vLLM, SGLang")]
    Worker(commands::runtime::WorkerArgs),
    /// Print a shell completion script (bash, zsh, fish, elvish, powershell) for `rollfleet`.
    Completion(commands::completion::CompletionArgs),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let log_format = match cli.log_format {
        LogFormatArg::Text => rollfleet_server::logs::LogFormat::Text,
        LogFormatArg::Json => rollfleet_server::logs::LogFormat::Json,
    };
    if let Err(e) = rollfleet_server::logs::init(log_format) {
        eprintln!("error: {e}");
        return ExitCode::from(exit::USAGE);
    }
    // Unlocked handles: the runtime commands log from worker threads, which a lock held here
    // for the whole run would block forever.
    let mut stdout = output::Stdout::new();
    let mut stderr = std::io::stderr();
    let result = match &cli.command {
        Command::Validate(args) => {
            commands::validate::run(args, cli.output, &mut stdout, &mut stderr)
        }
        Command::Catalog(args) => {
            commands::catalog::run(args, cli.output, &mut stdout, &mut stderr)
        }
        Command::Sim(args) => commands::sim::run(args, cli.output, &mut stdout, &mut stderr),
        Command::Plan(args) => commands::plan::run(args, cli.output, &mut stdout, &mut stderr),
        Command::Profile(command) => {
            commands::profile::run(command, cli.output, &mut stdout, &mut stderr)
        }
        Command::Serverless(command) => commands::serverless::run(command, &mut stderr),
        Command::Gpus(args) => commands::gpus::run(args, cli.output, &mut stdout, &mut stderr),
        Command::Run(args) => commands::runtime::run(args, cli.output, &mut stdout, &mut stderr),
        Command::Scheduler(args) => commands::runtime::scheduler(args, &mut stderr),
        Command::Job(command) => commands::job::run(command, cli.output, &mut stdout, &mut stderr),
        Command::Journal(command) => {
            commands::journal::run(command, cli.output, &mut stdout, &mut stderr)
        }
        Command::Worker(args) => commands::runtime::worker(args, &mut stderr),
        Command::Train(args) => commands::train::run(args, &mut stderr),
        Command::Completion(args) => commands::completion::run(args, Cli::command(), &mut stdout),
    };
    // A reader that went away (`rollfleet catalog -o json | head -1`) wanted no more: that is
    // no failure, whatever shape the write error took on its way up.
    if output::stdout_closed() {
        return ExitCode::from(exit::OK);
    }
    match result {
        Ok(code) => ExitCode::from(code),
        Err(error) => {
            let _ = writeln!(stderr, "error: {error:#}");
            ExitCode::from(exit::FAILED)
        }
    }
}
