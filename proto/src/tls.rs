//! TLS on the gRPC connections (rustls, through tonic): the scheduler serves with a certificate
//! and its key (`rollfleet scheduler --tls-cert FILE --tls-key FILE`), and its clients (workers,
//! `rollfleet job`) reach it at an `https://` URL, trusting the CA that signed that certificate
//! (`--tls-ca FILE`). With a token ([`crate::auth`]), that keeps the token off the wire in clear.
//!
//! The server is authenticated by its certificate; clients are by the token, and also by a
//! certificate of their own when the scheduler requires one (`--tls-client-ca`: mutual TLS, a
//! key per node). There are no system roots: an `https://` scheduler needs the CA given, as a
//! cluster's own CA is what signs a scheduler's certificate.

use std::path::{Path, PathBuf};

use tonic::transport::{Certificate, ClientTlsConfig, Endpoint, Identity, ServerTlsConfig};

/// What is wrong with a TLS setting.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    /// A certificate or key file could not be read.
    #[error("{flag} {path}: {source}")]
    Read {
        /// The flag that named it.
        flag: &'static str,
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// A file holds no PEM block of the kind needed.
    #[error("{flag} {path}: no PEM {what} in it (expected a \"-----BEGIN {what}\" block)")]
    NotPem {
        /// The flag that named it.
        flag: &'static str,
        /// The file.
        path: PathBuf,
        /// The kind of block expected.
        what: &'static str,
    },
    /// The scheduler's URL is not one.
    #[error("--scheduler {url:?}: not a URL ({reason})")]
    Url {
        /// The URL given.
        url: String,
        /// Why.
        reason: String,
    },
    /// An `https://` URL without the CA to trust.
    #[error(
        "--scheduler {url}: an https:// scheduler needs --tls-ca FILE, the CA certificate that \
         signed its certificate"
    )]
    NoCa {
        /// The URL given.
        url: String,
    },
    /// A CA given for a plain `http://` URL, which would not use it.
    #[error(
        "--scheduler {url}: --tls-ca is for an https:// scheduler; this URL is plain http:// \
         (the token and everything else would go in clear)"
    )]
    CaWithoutHttps {
        /// The URL given.
        url: String,
    },
    /// The certificate and key parse as PEM but cannot serve (a corrupt key, a key of another
    /// certificate, an unsupported algorithm).
    #[error("--tls-cert {cert} and --tls-key {key}: not a usable certificate and key: {reason}")]
    Identity {
        /// The certificate file.
        cert: PathBuf,
        /// The key file.
        key: PathBuf,
        /// What rustls said.
        reason: String,
    },
    /// tonic refused the configuration.
    #[error("TLS: {0}")]
    Config(#[from] tonic::transport::Error),
}

/// Reads `path` (named by `flag`) and checks it holds a PEM block `what`.
fn read_pem(flag: &'static str, path: &Path, what: &'static str) -> Result<Vec<u8>, TlsError> {
    let bytes = std::fs::read(path).map_err(|source| TlsError::Read {
        flag,
        path: path.to_owned(),
        source,
    })?;
    let text = String::from_utf8_lossy(&bytes);
    let found = match what {
        // PKCS#8, PKCS#1 and SEC1 keys all say "PRIVATE KEY" at the end of their label.
        "PRIVATE KEY" => text
            .lines()
            .any(|l| l.starts_with("-----BEGIN ") && l.ends_with("PRIVATE KEY-----")),
        _ => text.contains(&format!("-----BEGIN {what}-----")),
    };
    if !found {
        return Err(TlsError::NotPem {
            flag,
            path: path.to_owned(),
            what,
        });
    }
    Ok(bytes)
}

/// The scheduler's side: its certificate chain (`--tls-cert`) and private key (`--tls-key`), PEM.
/// Both are parsed here, so a scheduler that could not serve them fails before it listens.
pub fn server_config(cert_path: &Path, key_path: &Path) -> Result<ServerTlsConfig, TlsError> {
    let cert = read_pem("--tls-cert", cert_path, "CERTIFICATE")?;
    let key = read_pem("--tls-key", key_path, "PRIVATE KEY")?;
    let config = ServerTlsConfig::new().identity(Identity::from_pem(cert, key));
    tonic::transport::Server::builder()
        .tls_config(config.clone())
        .map_err(|e| TlsError::Identity {
            cert: cert_path.to_owned(),
            key: key_path.to_owned(),
            reason: std::error::Error::source(&e)
                .map_or_else(|| e.to_string(), |s| format!("{e}: {s}")),
        })?;
    Ok(config)
}

/// Makes a scheduler's TLS `config` require every client to present a certificate signed by the
/// CA in `client_ca` (`--tls-client-ca`, PEM): mutual TLS, so that each node holds a key of its
/// own rather than only the job's shared token.
pub fn require_client_certificates(
    config: ServerTlsConfig,
    client_ca: &Path,
) -> Result<ServerTlsConfig, TlsError> {
    let ca = read_pem("--tls-client-ca", client_ca, "CERTIFICATE")?;
    Ok(config.client_ca_root(Certificate::from_pem(ca)))
}

/// A client's endpoint for the scheduler at `url`: plain for `http://`, TLS trusting the CA
/// certificate `ca` (PEM) for `https://`, presenting the certificate and key `identity` (PEM
/// files, `--tls-cert` and `--tls-key` of a client) when the scheduler asks for one.
pub fn endpoint(
    url: &str,
    ca: Option<&Path>,
    identity: Option<(&Path, &Path)>,
) -> Result<Endpoint, TlsError> {
    // A plain URL with a CA is refused before the file is read: the mistake is the URL's.
    if let (false, Some(_)) = (url.starts_with("https://"), ca) {
        return Err(TlsError::CaWithoutHttps {
            url: url.to_owned(),
        });
    }
    let ca = match ca {
        Some(path) => Some(read_pem("--tls-ca", path, "CERTIFICATE")?),
        None => None,
    };
    let endpoint = endpoint_trusting(url, ca.clone())?;
    let Some((cert, key)) = identity else {
        return Ok(endpoint);
    };
    let Some(ca) = ca else {
        return Err(TlsError::NoCa {
            url: url.to_owned(),
        });
    };
    let cert = read_pem("--tls-cert", cert, "CERTIFICATE")?;
    let key = read_pem("--tls-key", key, "PRIVATE KEY")?;
    Ok(endpoint.tls_config(
        ClientTlsConfig::new()
            .ca_certificate(Certificate::from_pem(ca))
            .identity(Identity::from_pem(cert, key)),
    )?)
}

/// [`endpoint`], with the CA certificate given as PEM bytes (the operator reads it from a
/// Secret) rather than as a file.
pub fn endpoint_trusting(url: &str, ca_pem: Option<Vec<u8>>) -> Result<Endpoint, TlsError> {
    let endpoint = Endpoint::from_shared(url.to_owned())
        .map_err(|e| TlsError::Url {
            url: url.to_owned(),
            reason: e.to_string(),
        })?
        .initial_stream_window_size(crate::HTTP2_WINDOW_BYTES)
        .initial_connection_window_size(crate::HTTP2_WINDOW_BYTES);
    match (url.starts_with("https://"), ca_pem) {
        (false, None) => Ok(endpoint),
        (false, Some(_)) => Err(TlsError::CaWithoutHttps {
            url: url.to_owned(),
        }),
        (true, None) => Err(TlsError::NoCa {
            url: url.to_owned(),
        }),
        (true, Some(ca)) => Ok(endpoint
            .tls_config(ClientTlsConfig::new().ca_certificate(Certificate::from_pem(ca)))?),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scratch(name: &str, text: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("rollfleet-tls-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join(name);
        std::fs::write(&path, text).unwrap();
        path
    }

    #[test]
    fn a_plain_url_needs_no_ca_and_refuses_one() {
        assert!(endpoint("http://127.0.0.1:7070", None, None).is_ok());
        let ca = scratch("unused-ca.pem", "-----BEGIN CERTIFICATE-----\n");
        let err = endpoint("http://127.0.0.1:7070", Some(&ca), None).unwrap_err();
        assert!(err.to_string().contains("plain http://"), "{err}");
    }

    #[test]
    fn an_https_url_needs_the_ca_and_a_file_that_holds_one() {
        let err = endpoint("https://scheduler:7070", None, None).unwrap_err();
        assert!(err.to_string().contains("needs --tls-ca"), "{err}");
        let not = scratch("not-a-ca.pem", "hello\n");
        let err = endpoint("https://scheduler:7070", Some(&not), None).unwrap_err();
        assert!(
            err.to_string().contains("--tls-ca") && err.to_string().contains("not-a-ca.pem"),
            "{err}"
        );
        let missing = Path::new("/nonexistent/ca.pem");
        let err = endpoint("https://scheduler:7070", Some(missing), None).unwrap_err();
        assert!(err.to_string().contains("/nonexistent/ca.pem"), "{err}");
    }

    #[test]
    fn a_certificate_and_key_that_are_pem_but_not_usable_are_refused_naming_both() {
        let cert = scratch(
            "bad-cert.pem",
            "-----BEGIN CERTIFICATE-----\nAA==\n-----END CERTIFICATE-----\n",
        );
        let key = scratch(
            "bad-key.pem",
            "-----BEGIN PRIVATE KEY-----\nAA==\n-----END PRIVATE KEY-----\n",
        );
        let err = server_config(&cert, &key).unwrap_err().to_string();
        assert!(
            err.contains("bad-cert.pem") && err.contains("bad-key.pem") && err.contains("usable"),
            "{err}"
        );
    }

    #[test]
    fn a_key_file_without_a_private_key_is_named() {
        let cert = scratch(
            "cert.pem",
            "-----BEGIN CERTIFICATE-----\nAA==\n-----END CERTIFICATE-----\n",
        );
        let key = scratch("key.pem", "-----BEGIN CERTIFICATE-----\n");
        let err = server_config(&cert, &key).unwrap_err();
        assert!(
            err.to_string().contains("--tls-key") && err.to_string().contains("PRIVATE KEY"),
            "{err}"
        );
    }
}
