//! The operator's log: `tracing` events to stderr, for people (text) or for a cluster's log
//! collector (one JSON object per line), at the levels `RUST_LOG` sets (default `info`).

use tracing_subscriber::EnvFilter;

/// How log lines are written to stderr.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum LogFormat {
    /// One line per event for people: time, level, message.
    #[default]
    Text,
    /// One JSON object per line (time, level, target, message, fields).
    Json,
}

/// Why the log could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum LogError {
    #[error("RUST_LOG: {0}")]
    Filter(String),
    #[error("a logger is already installed in this process")]
    AlreadyInstalled,
}

/// Installs the process's logger.
pub fn init(format: LogFormat) -> Result<(), LogError> {
    let filter = match std::env::var("RUST_LOG") {
        Ok(directives) if !directives.trim().is_empty() => {
            EnvFilter::try_new(&directives).map_err(|e| LogError::Filter(e.to_string()))?
        }
        _ => EnvFilter::new("info"),
    };
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    let installed = match format {
        LogFormat::Text => builder
            .with_target(false)
            .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
            .try_init(),
        LogFormat::Json => builder.json().with_current_span(false).try_init(),
    };
    installed.map_err(|_| LogError::AlreadyInstalled)
}
