//! Certificates for the TLS tests, made with the `openssl` command (installed by `.ci/run`).

use std::path::{Path, PathBuf};
use std::process::Command;

fn openssl(args: &[&str]) {
    let out = Command::new("openssl").args(args).output().unwrap();
    assert!(out.status.success(), "openssl {args:?}: {out:?}");
}

fn text(path: &Path) -> &str {
    path.to_str().unwrap()
}

/// A new P-256 key `key` and, for `subject`, a self-signed CA certificate (`ca`) or a signing
/// request to `out`.
fn key_and(ca: bool, key: &Path, out: &Path, subject: &str) {
    let mut args = vec!["req"];
    if ca {
        args.extend(["-x509", "-days", "2"]);
    }
    args.extend([
        "-newkey",
        "ec",
        "-pkeyopt",
        "ec_paramgen_curve:prime256v1",
        "-nodes",
        "-keyout",
        text(key),
        "-out",
        text(out),
        "-subj",
        subject,
    ]);
    openssl(&args);
}

/// A key and a certificate for `subject` with the extensions `extensions`, signed by the CA
/// [`tls_files`] made with `prefix`: `({prefix}-{name}.pem, {prefix}-{name}.key)` in `dir`.
fn signed(
    dir: &Path,
    prefix: &str,
    name: &str,
    subject: &str,
    extensions: &str,
) -> (PathBuf, PathBuf) {
    let file = |suffix: &str| dir.join(format!("{prefix}-{name}.{suffix}"));
    let (key, csr, cert, ext) = (file("key"), file("csr"), file("pem"), file("ext"));
    key_and(false, &key, &csr, subject);
    std::fs::write(&ext, extensions).unwrap();
    let (ca, ca_key) = (
        dir.join(format!("{prefix}-ca.pem")),
        dir.join(format!("{prefix}-ca.key")),
    );
    openssl(&[
        "x509",
        "-req",
        "-in",
        text(&csr),
        "-CA",
        text(&ca),
        "-CAkey",
        text(&ca_key),
        "-CAcreateserial",
        "-out",
        text(&cert),
        "-days",
        "2",
        "-extfile",
        text(&ext),
    ]);
    (cert, key)
}

/// A CA and a certificate it signed for 127.0.0.1 (P-256 keys, two days):
/// `(ca.pem, server.pem, server.key)` in `dir`, named with `prefix`.
pub fn tls_files(dir: &Path, prefix: &str) -> (PathBuf, PathBuf, PathBuf) {
    let ca = dir.join(format!("{prefix}-ca.pem"));
    key_and(
        true,
        &dir.join(format!("{prefix}-ca.key")),
        &ca,
        "/CN=rollfleet test CA",
    );
    let (cert, key) = signed(
        dir,
        prefix,
        "server",
        "/CN=scheduler",
        "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth\n",
    );
    (ca, cert, key)
}

/// A client certificate and key signed by the CA [`tls_files`] made with `prefix`:
/// `(client.pem, client.key)` in `dir`.
#[allow(dead_code)] // not every test binary that includes this module uses it
pub fn client_files(dir: &Path, prefix: &str) -> (PathBuf, PathBuf) {
    signed(
        dir,
        prefix,
        "client",
        "/CN=worker",
        "extendedKeyUsage=clientAuth\n",
    )
}
