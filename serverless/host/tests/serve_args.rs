//! `rollfleet serverless serve` arguments: parsed as the CLI will parse them, and turned into
//! the host configuration they describe.

use std::time::Duration;

use clap::Parser;
use rollfleet_lambda_host::{FunctionCode, ServeArgs};
use rollfleet_rewards::RewardFunction;

#[derive(Debug, Parser)]
struct Cli {
    #[command(flatten)]
    serve: ServeArgs,
}

#[test]
fn default_arguments_serve_every_reward_function_on_loopback() {
    let cli = Cli::try_parse_from(["serve"]).expect("defaults parse");
    assert!(cli.serve.listen.ip().is_loopback());
    let config = cli.serve.host_config();
    for f in RewardFunction::ALL {
        let deployed = &config.functions[f.name()];
        assert!(matches!(deployed.code, FunctionCode::Reward(g) if g == f));
        assert_eq!(deployed.timeout, Duration::from_secs(30));
    }
    let cpus = std::thread::available_parallelism().unwrap().get() as u32;
    assert_eq!(
        config.functions["code_tests"].reserved_concurrency,
        Some(cpus)
    );
    assert_eq!(config.functions["math_answer"].reserved_concurrency, None);
}

#[test]
fn command_line_settings_reach_every_function() {
    let cli = Cli::try_parse_from([
        "serve",
        "--listen",
        "127.0.0.1:0",
        "--timeout-secs",
        "5",
        "--memory-mb",
        "1024",
        "--reserved-concurrency",
        "8",
        "--code-tests-concurrency",
        "3",
        "--cold-start-ms",
        "250",
        "--idle-ttl-secs",
        "60",
    ])
    .expect("arguments parse");
    let config = cli.serve.host_config();
    let math = &config.functions["math_answer"];
    assert_eq!(math.timeout, Duration::from_secs(5));
    assert_eq!(math.memory_mb, 1024);
    assert_eq!(math.reserved_concurrency, Some(8));
    assert_eq!(math.cold_start, Duration::from_millis(250));
    assert_eq!(math.idle_ttl, Duration::from_secs(60));
    assert_eq!(config.functions["code_tests"].reserved_concurrency, Some(3));
}

#[test]
fn malformed_arguments_are_rejected_by_the_parser() {
    assert!(Cli::try_parse_from(["serve", "--listen", "not-an-address"]).is_err());
    assert!(Cli::try_parse_from(["serve", "--timeout-secs", "-1"]).is_err());
}

#[test]
fn limit_defaults_follow_lambda_and_the_documented_host_limits() {
    let config = Cli::try_parse_from(["serve"])
        .expect("defaults parse")
        .serve
        .host_config();
    assert_eq!(config.max_sync_payload, 6 * 1024 * 1024);
    assert_eq!(config.max_event_payload, 1024 * 1024);
    assert_eq!(config.concurrency_per_function, 64);
    assert_eq!(config.event_queue_events, 1_000);
    assert_eq!(config.event_queue_bytes, 64 * 1024 * 1024);
    assert_eq!(config.event_max_age, Duration::from_secs(6 * 60 * 60));
    assert_eq!(config.header_read_timeout, Duration::from_secs(10));
    assert_eq!(config.body_read_timeout, Duration::from_secs(30));
    assert_eq!(config.max_connections, 512);
}

#[test]
fn limit_flags_reach_the_host_configuration_and_zeroes_are_raised_to_a_minimum() {
    let config = Cli::try_parse_from([
        "serve",
        "--concurrency-per-function",
        "8",
        "--event-queue-events",
        "10",
        "--event-queue-mib",
        "2",
        "--event-max-age-secs",
        "60",
        "--header-read-timeout-ms",
        "0",
        "--body-read-timeout-ms",
        "1500",
        "--max-connections",
        "0",
    ])
    .expect("arguments parse")
    .serve
    .host_config();
    assert_eq!(config.concurrency_per_function, 8);
    assert_eq!(config.event_queue_events, 10);
    assert_eq!(config.event_queue_bytes, 2 << 20);
    assert_eq!(config.event_max_age, Duration::from_secs(60));
    // A zero timeout or cap would turn every client away.
    assert_eq!(config.header_read_timeout, Duration::from_millis(1));
    assert_eq!(config.body_read_timeout, Duration::from_millis(1500));
    assert_eq!(config.max_connections, 1);
}
