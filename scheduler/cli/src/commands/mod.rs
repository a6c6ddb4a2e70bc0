//! One module per subcommand; each exposes its clap `Args` and a `run` that returns an exit code.

pub mod catalog;
pub mod completion;
pub mod gpus;
pub mod job;
pub mod journal;
pub mod plan;
pub mod profile;
pub mod runtime;
pub mod serverless;
pub mod sim;
pub mod train;
pub mod validate;

use std::path::PathBuf;

use rollfleet_proto::auth::{Token, TokenError};

/// The environment variable every `--scheduler` flag defaults from (as `RAY_ADDRESS` does for
/// Ray), so that a shell or a pod names its scheduler once.
pub const SCHEDULER_ENV: &str = "ROLLFLEET_SCHEDULER";

/// The `--scheduler` flag of every command that talks to a scheduler.
#[derive(Debug, Clone, clap::Args)]
pub struct SchedulerArg {
    /// The scheduler's URL: http://HOST:PORT, or https://HOST:PORT with --tls-ca.
    #[arg(
        long,
        env = SCHEDULER_ENV,
        default_value = crate::commands::job::DEFAULT_SCHEDULER,
        value_name = "URL",
        value_parser = scheduler_url
    )]
    pub scheduler: String,
}

/// Checks a `--scheduler` URL (given, or from [`SCHEDULER_ENV`]) while the command line is
/// parsed, so that a slip such as `127.0.0.1:7070` is a usage error that says what to write,
/// not a scheduler reported unreachable after a connection attempt.
pub fn scheduler_url(value: &str) -> Result<String, String> {
    // Said when the value came from the environment, where the user may not think to look.
    let origin = match std::env::var(SCHEDULER_ENV) {
        Ok(from_env) if from_env == value => format!(" (from {SCHEDULER_ENV})"),
        _ => String::new(),
    };
    if value.is_empty() && !origin.is_empty() {
        return Err(format!(
            "{SCHEDULER_ENV} is set but empty; unset it, or set it to http://HOST:PORT"
        ));
    }
    let uri: tonic::transport::Uri = value.parse().map_err(|e| {
        format!("{value:?} is not a URL ({e}){origin}; use http://HOST:PORT or https://HOST:PORT")
    })?;
    match uri.scheme_str() {
        None => Err(format!(
            "{value} has no scheme{origin}; use http://{value} or https://{value} (with --tls-ca)"
        )),
        // The TLS choice downstream reads the URL's text, so the scheme is taken as written.
        Some(_) if value.starts_with("http://") || value.starts_with("https://") => {
            Ok(value.to_owned())
        }
        Some(scheme) if ["http", "https"].contains(&scheme) => Err(format!(
            "{value}: write the scheme in lower case{origin}: http:// or https://"
        )),
        Some(scheme) => Err(format!(
            "{value}: the scheme {scheme:?} is not served{origin}; use http:// or https://"
        )),
    }
}

/// The scheduler's bearer token, for every command that serves or calls it.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct TokenArgs {
    /// A file whose first line is the bearer token the scheduler requires on every call (at
    /// least 16 printable characters); without it, the ROLLFLEET_TOKEN environment variable, if
    /// set. A scheduler without a token serves any peer that reaches it.
    #[arg(long, value_name = "FILE")]
    pub token_file: Option<PathBuf>,
}

/// The CA a client trusts for an `https://` scheduler.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct TlsClientArgs {
    /// The CA certificate (PEM) that signed an https:// scheduler's certificate; needed for
    /// an https:// URL, refused with a plain http:// one.
    #[arg(long, value_name = "FILE")]
    pub tls_ca: Option<PathBuf>,
    /// This client's certificate (PEM), for a scheduler that requires one (`rollfleet scheduler
    /// --tls-client-ca`); needs --tls-key and --tls-ca.
    #[arg(long, value_name = "FILE", requires_all = ["tls_key", "tls_ca"])]
    pub tls_cert: Option<PathBuf>,
    /// The private key of --tls-cert (PEM).
    #[arg(long, value_name = "FILE", requires = "tls_cert")]
    pub tls_key: Option<PathBuf>,
}

impl TlsClientArgs {
    /// The client certificate and key given, if any.
    pub fn identity(&self) -> Option<(&std::path::Path, &std::path::Path)> {
        self.tls_cert.as_deref().zip(self.tls_key.as_deref())
    }
}

impl TokenArgs {
    /// The token given, if any; an unreadable or malformed one is an error naming its origin.
    pub fn token(&self) -> Result<Option<Token>, TokenError> {
        Token::configured(self.token_file.as_deref())
    }
}
