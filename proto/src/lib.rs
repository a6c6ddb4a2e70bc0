//! The rollfleet gRPC contract, package `rollfleet.v1`, as Rust types and tonic services.
//!
//! The source of truth is `proto/rollfleet/v1/rollfleet.proto`; `build.rs` compiles it at build
//! time with protox, so no system `protoc` is needed. The scheduler server, the node workers,
//! the trainer client and the CLI all speak through these types; [`auth`] is the bearer token
//! that every call carries when the scheduler was given one, and [`tls`] the certificate the
//! scheduler serves with and the CA its clients trust.

pub mod auth;
pub mod packed;
pub mod peer;
mod phase;
pub mod tls;

/// The HTTP/2 flow-control window, per stream and per connection, of the scheduler's server and
/// of its clients ([`tls::endpoint`]). A worker's work stream carries every result it sends (with
/// token ids and log-probabilities, about a kilobyte a generation), and every window's worth of
/// them waits for a WINDOW_UPDATE: with the default windows (1 MiB on the server, 64 KiB on a
/// client) the dispatch benchmark with token-level payloads stalled for up to 200 ms at a time
/// (17,000 stage completions/s against 125,000 with counts only); with 64 MiB it runs at about
/// 110,000/s (`cargo bench -p rollfleet-server --bench dispatch`, README). The receiver reads eagerly, so a
/// larger window does not let a peer hold more of its memory than the message size limit does.
pub const HTTP2_WINDOW_BYTES: u32 = 64 << 20;

/// The largest message the scheduler and its workers send each other on a work stream, and the
/// largest each takes (both sides set both limits, so that a message one side may send is one
/// the other takes). The scheduler keeps what it sends far below it: a trajectory's history, the
/// bulk of an environment step or a text engine's prompt, holds at most 1 MiB of text.
pub const MAX_MESSAGE_BYTES: usize = 4 << 20;

/// Version 1 of the contract.
pub mod v1 {
    #![allow(missing_docs, clippy::all)]
    tonic::include_proto!("rollfleet.v1");
}
