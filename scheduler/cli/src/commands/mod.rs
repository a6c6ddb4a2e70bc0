//! One module per subcommand; each exposes its clap `Args` and a `run` that returns an exit code.

pub mod catalog;
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
