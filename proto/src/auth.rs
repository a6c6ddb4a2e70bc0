//! A shared bearer token on every gRPC call: who may register a worker, submit or cancel the job,
//! or read the trainer feed.
//!
//! A scheduler started with a token refuses every call that does not carry it in the
//! `authorization: Bearer ...` header, with `Unauthenticated`; without one it takes every call,
//! as before. Workers, the CLI and the operator send the token they were given. One secret per
//! job, shared by its scheduler and its workers, is the model of the operator's own deployments
//! (a Kubernetes Secret mounted as [`TOKEN_ENV`]); it is authentication only, not transport
//! security: on an untrusted network, terminate TLS in front of the scheduler.
//!
//! The comparison takes the same time whatever the first differing byte, so a peer cannot find
//! the token a byte at a time.

use std::path::Path;
use std::sync::Arc;

use tonic::metadata::{AsciiMetadataValue, MetadataValue};
use tonic::service::Interceptor;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::Channel;
use tonic::{Request, Status};

/// The environment variable every rollfleet process reads its token from when no file is given.
pub const TOKEN_ENV: &str = "ROLLFLEET_TOKEN";

/// The shortest token accepted: 16 characters of a random token are 96 bits and more.
pub const MIN_TOKEN_CHARS: usize = 16;

/// Longest token accepted (it travels in a header on every call).
pub const MAX_TOKEN_CHARS: usize = 1024;

/// Most bytes of a token file read: its first line, with room to say it is too long.
const FILE_BYTES_READ: u64 = 64 * 1024;

/// Why a token could not be used.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum TokenError {
    /// Shorter than [`MIN_TOKEN_CHARS`].
    #[error("{origin}: the token has {chars} characters; at least {MIN_TOKEN_CHARS} are needed")]
    TooShort {
        /// Where it came from.
        origin: String,
        /// Its length.
        chars: usize,
    },
    /// Longer than [`MAX_TOKEN_CHARS`].
    #[error("{origin}: the token has {chars} characters; at most {MAX_TOKEN_CHARS} are allowed")]
    TooLong {
        /// Where it came from.
        origin: String,
        /// Its length.
        chars: usize,
    },
    /// A character a header cannot carry, or a space inside it.
    #[error(
        "{origin}: the token has a space, a control or a non-ASCII character at position \
         {position} (a token is printable ASCII without spaces)"
    )]
    BadCharacter {
        /// Where it came from.
        origin: String,
        /// Where the character is (0-based, in characters).
        position: usize,
    },
    /// The file could not be read.
    #[error("{origin}: {reason}")]
    Unreadable {
        /// The file.
        origin: String,
        /// The error.
        reason: String,
    },
}

/// A bearer token shared by a job's scheduler, its workers and its clients.
#[derive(Clone, PartialEq, Eq)]
pub struct Token(Arc<str>);

impl std::fmt::Debug for Token {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // A token never reaches a log line, a report or a panic message.
        f.write_str("Token(..)")
    }
}

impl Token {
    /// Checks a token's text; `origin` names where it came from in the error. Surrounding
    /// whitespace (a file's final newline) is not part of it.
    pub fn parse(text: &str, origin: &str) -> Result<Token, TokenError> {
        let text = text.trim();
        if let Some(position) = text.chars().position(|c| !c.is_ascii_graphic()) {
            return Err(TokenError::BadCharacter {
                origin: origin.to_owned(),
                position,
            });
        }
        let chars = text.len();
        if chars < MIN_TOKEN_CHARS {
            return Err(TokenError::TooShort {
                origin: origin.to_owned(),
                chars,
            });
        }
        if chars > MAX_TOKEN_CHARS {
            return Err(TokenError::TooLong {
                origin: origin.to_owned(),
                chars,
            });
        }
        Ok(Token(text.into()))
    }

    /// The token in `path` (its first line). Only the file's first bytes are read, so a path to
    /// something endless (`/dev/zero`) is refused rather than read forever.
    pub fn from_file(path: &Path) -> Result<Token, TokenError> {
        use std::io::Read;
        let origin = path.display().to_string();
        let unreadable = |e: std::io::Error| TokenError::Unreadable {
            origin: origin.clone(),
            reason: e.to_string(),
        };
        let mut bytes = Vec::new();
        std::fs::File::open(path)
            .and_then(|f| f.take(FILE_BYTES_READ).read_to_end(&mut bytes))
            .map_err(unreadable)?;
        let text = String::from_utf8_lossy(&bytes);
        Token::parse(text.lines().next().unwrap_or_default(), &origin)
    }

    /// The token a process was given: `file` when set, else [`TOKEN_ENV`] when set and not
    /// empty, else none.
    pub fn configured(file: Option<&Path>) -> Result<Option<Token>, TokenError> {
        if let Some(path) = file {
            return Token::from_file(path).map(Some);
        }
        // Not UTF-8 is an error too: its bytes show as U+FFFD, which no token may hold.
        match std::env::var_os(TOKEN_ENV).map(|v| v.to_string_lossy().into_owned()) {
            Some(text) if !text.trim().is_empty() => Token::parse(&text, TOKEN_ENV).map(Some),
            _ => Ok(None),
        }
    }

    /// The token's text, for a process that hands it on (a child's environment).
    pub fn expose(&self) -> &str {
        &self.0
    }

    fn header(&self) -> AsciiMetadataValue {
        // `parse` admits printable ASCII only, which a header value always takes.
        MetadataValue::try_from(format!("Bearer {}", self.0))
            .unwrap_or_else(|_| MetadataValue::from_static(""))
    }
}

/// Adds the token to every call a client makes (nothing when it has none).
#[derive(Clone, Default)]
pub struct ClientAuth {
    header: Option<AsciiMetadataValue>,
}

impl ClientAuth {
    /// A client that sends `token`, or nothing.
    pub fn new(token: Option<&Token>) -> ClientAuth {
        ClientAuth {
            header: token.map(Token::header),
        }
    }
}

impl Interceptor for ClientAuth {
    fn call(&mut self, mut request: Request<()>) -> Result<Request<()>, Status> {
        if let Some(header) = &self.header {
            request
                .metadata_mut()
                .insert("authorization", header.clone());
        }
        Ok(request)
    }
}

/// A channel whose calls carry the client's token.
pub type AuthChannel = InterceptedService<Channel, ClientAuth>;

/// Refuses every call that does not carry the server's token (takes every call when it has none).
#[derive(Clone, Default)]
pub struct ServerAuth {
    expected: Option<Arc<[u8]>>,
}

impl ServerAuth {
    /// A server that requires `token`, or nothing.
    pub fn new(token: Option<&Token>) -> ServerAuth {
        ServerAuth {
            expected: token.map(|t| Arc::from(format!("Bearer {}", t.0).into_bytes())),
        }
    }

    /// Whether calls must carry a token.
    pub fn required(&self) -> bool {
        self.expected.is_some()
    }

    /// Whether `request` may be served; why not, when not.
    pub fn check<T>(&self, request: &Request<T>) -> Result<(), Refusal> {
        let Some(expected) = &self.expected else {
            return Ok(());
        };
        match request.metadata().get("authorization") {
            None => Err(Refusal::Missing),
            Some(given) if constant_time_eq(given.as_bytes(), expected) => Ok(()),
            Some(_) => Err(Refusal::Wrong),
        }
    }
}

/// Why a call was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// It carried no token.
    Missing,
    /// It carried another token.
    Wrong,
}

impl Refusal {
    /// A short name, for a metric's label.
    pub fn label(self) -> &'static str {
        match self {
            Refusal::Missing => "missing",
            Refusal::Wrong => "wrong",
        }
    }

    /// The answer the caller gets.
    pub fn status(self) -> Status {
        match self {
            Refusal::Missing => Status::unauthenticated(format!(
                "this scheduler requires a token: none was sent (set {TOKEN_ENV} or pass \
                 --token-file)"
            )),
            Refusal::Wrong => Status::unauthenticated("the token sent is not this scheduler's"),
        }
    }
}

impl Interceptor for ServerAuth {
    fn call(&mut self, request: Request<()>) -> Result<Request<()>, Status> {
        self.check(&request).map_err(Refusal::status)?;
        Ok(request)
    }
}

/// Equality whose time depends on the lengths only, not on where the inputs differ.
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    const GOOD: &str = "0123456789abcdef-token";

    fn call_with(header: Option<&str>) -> Request<()> {
        let mut request = Request::new(());
        if let Some(h) = header {
            request.metadata_mut().insert(
                "authorization",
                MetadataValue::try_from(h).expect("ascii header"),
            );
        }
        request
    }

    #[test]
    fn a_token_is_trimmed_and_must_be_long_printable_ascii() {
        let t = Token::parse(&format!("  {GOOD}\n"), "test").expect("valid");
        assert_eq!(t.expose(), GOOD);
        assert_eq!(
            Token::parse("short", "--token-file t"),
            Err(TokenError::TooShort {
                origin: "--token-file t".into(),
                chars: 5
            })
        );
        assert_eq!(
            Token::parse("0123456789 abcdefgh", "env"),
            Err(TokenError::BadCharacter {
                origin: "env".into(),
                position: 10
            })
        );
        assert_eq!(
            Token::parse("0123456789abcdefé", "env"),
            Err(TokenError::BadCharacter {
                origin: "env".into(),
                position: 16
            })
        );
        let long = "x".repeat(MAX_TOKEN_CHARS + 1);
        assert!(matches!(
            Token::parse(&long, "env"),
            Err(TokenError::TooLong { .. })
        ));
    }

    #[test]
    fn a_token_file_is_read_for_its_first_line_only_and_an_endless_one_is_refused() {
        let dir = std::env::temp_dir().join(format!("rollfleet-auth-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let file = dir.join("token");
        std::fs::write(&file, format!("{GOOD}\nsecond line\n")).expect("write");
        assert_eq!(Token::from_file(&file).expect("valid").expose(), GOOD);
        // `/dev/zero` has no end: only its first bytes are read, and NULs are no token.
        assert!(matches!(
            Token::from_file(Path::new("/dev/zero")),
            Err(TokenError::BadCharacter { position: 0, .. })
        ));
        assert!(matches!(
            Token::from_file(&dir.join("missing")),
            Err(TokenError::Unreadable { .. })
        ));
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_token_never_shows_in_debug_output() {
        let t = Token::parse(GOOD, "test").expect("valid");
        assert!(!format!("{t:?}").contains("0123"));
    }

    #[test]
    fn a_server_with_a_token_takes_only_calls_that_carry_it() {
        let token = Token::parse(GOOD, "test").expect("valid");
        let mut server = ServerAuth::new(Some(&token));
        assert!(server.required());
        assert!(
            server
                .call(call_with(Some(&format!("Bearer {GOOD}"))))
                .is_ok()
        );
        assert_eq!(server.check(&call_with(None)), Err(Refusal::Missing));
        assert_eq!(
            server.check(&call_with(Some("Bearer another-token-0123"))),
            Err(Refusal::Wrong)
        );
        let missing = server.call(call_with(None)).expect_err("no header");
        assert_eq!(missing.code(), tonic::Code::Unauthenticated);
        assert!(
            missing.message().contains(TOKEN_ENV),
            "{}",
            missing.message()
        );
        for wrong in [
            format!("Bearer {GOOD}x"),
            format!("Bearer {}", &GOOD[1..]),
            GOOD.to_owned(),
            "Bearer 0123456789abcdef-tokeN".to_owned(),
        ] {
            let refused = server.call(call_with(Some(&wrong))).expect_err(&wrong);
            assert_eq!(refused.code(), tonic::Code::Unauthenticated);
        }
    }

    #[test]
    fn a_server_without_a_token_takes_every_call() {
        let mut server = ServerAuth::new(None);
        assert!(!server.required());
        assert!(server.call(call_with(None)).is_ok());
        assert!(server.call(call_with(Some("Bearer anything"))).is_ok());
    }

    #[test]
    fn a_client_sends_its_token_as_a_bearer_header_and_nothing_without_one() {
        let token = Token::parse(GOOD, "test").expect("valid");
        let sent = ClientAuth::new(Some(&token))
            .call(Request::new(()))
            .expect("ok");
        assert_eq!(
            sent.metadata()
                .get("authorization")
                .and_then(|v| v.to_str().ok()),
            Some(format!("Bearer {GOOD}").as_str())
        );
        let bare = ClientAuth::new(None).call(Request::new(())).expect("ok");
        assert!(bare.metadata().get("authorization").is_none());
        // What a client sends is what a server with the same token takes.
        assert!(ServerAuth::new(Some(&token)).call(sent).is_ok());
    }
}
