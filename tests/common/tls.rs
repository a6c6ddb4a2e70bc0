//! Certificates for the TLS tests, made with the `openssl` command (installed by `.ci/run`).

use std::path::{Path, PathBuf};
use std::process::Command;

/// A CA and a certificate it signed for 127.0.0.1, made with the `openssl` command (P-256 keys,
/// two days): `(ca.pem, server.pem, server.key)` in `dir`, named with `prefix`.
pub fn tls_files(dir: &Path, prefix: &str) -> (PathBuf, PathBuf, PathBuf) {
    let file = |name: &str| dir.join(format!("{prefix}-{name}"));
    let openssl = |args: &[&str]| {
        let out = Command::new("openssl").args(args).output().unwrap();
        assert!(out.status.success(), "openssl {args:?}: {out:?}");
    };
    let s = |p: &PathBuf| p.to_str().unwrap().to_owned();
    let (ca_key, ca, key, csr, cert, ext) = (
        file("ca.key"),
        file("ca.pem"),
        file("server.key"),
        file("server.csr"),
        file("server.pem"),
        file("server.ext"),
    );
    let ec = [
        "-newkey",
        "ec",
        "-pkeyopt",
        "ec_paramgen_curve:prime256v1",
        "-nodes",
    ];
    openssl(
        &[
            &["req", "-x509"][..],
            &ec[..],
            &["-keyout", &s(&ca_key), "-out", &s(&ca)],
        ]
        .concat()
        .into_iter()
        .chain(["-days", "2", "-subj", "/CN=rollfleet test CA"])
        .collect::<Vec<_>>(),
    );
    openssl(
        &[
            &["req"][..],
            &ec[..],
            &["-keyout", &s(&key), "-out", &s(&csr)],
        ]
        .concat()
        .into_iter()
        .chain(["-subj", "/CN=scheduler"])
        .collect::<Vec<_>>(),
    );
    std::fs::write(
        &ext,
        "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth\n",
    )
    .unwrap();
    openssl(&[
        "x509",
        "-req",
        "-in",
        &s(&csr),
        "-CA",
        &s(&ca),
        "-CAkey",
        &s(&ca_key),
        "-CAcreateserial",
        "-out",
        &s(&cert),
        "-days",
        "2",
        "-extfile",
        &s(&ext),
    ]);
    (ca, cert, key)
}

/// A client certificate and key signed by the CA [`tls_files`] made with `prefix`:
/// `(client.pem, client.key)` in `dir`.
#[allow(dead_code)] // not every test binary that includes this module uses it
pub fn client_files(dir: &Path, prefix: &str) -> (PathBuf, PathBuf) {
    let file = |name: &str| dir.join(format!("{prefix}-{name}"));
    let s = |p: &PathBuf| p.to_str().unwrap().to_owned();
    let (ca_key, ca, key, csr, cert, ext) = (
        file("ca.key"),
        file("ca.pem"),
        file("client.key"),
        file("client.csr"),
        file("client.pem"),
        file("client.ext"),
    );
    let openssl = |args: &[&str]| {
        let out = Command::new("openssl").args(args).output().unwrap();
        assert!(out.status.success(), "openssl {args:?}: {out:?}");
    };
    openssl(&[
        "req",
        "-newkey",
        "ec",
        "-pkeyopt",
        "ec_paramgen_curve:prime256v1",
        "-nodes",
        "-keyout",
        &s(&key),
        "-out",
        &s(&csr),
        "-subj",
        "/CN=worker",
    ]);
    std::fs::write(&ext, "extendedKeyUsage=clientAuth\n").unwrap();
    openssl(&[
        "x509",
        "-req",
        "-in",
        &s(&csr),
        "-CA",
        &s(&ca),
        "-CAkey",
        &s(&ca_key),
        "-CAcreateserial",
        "-out",
        &s(&cert),
        "-days",
        "2",
        "-extfile",
        &s(&ext),
    ]);
    (cert, key)
}
