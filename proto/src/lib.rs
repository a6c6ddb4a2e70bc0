//! The rollfleet gRPC contract, package `rollfleet.v1`, as Rust types and tonic services.
//!
//! The source of truth is `proto/rollfleet/v1/rollfleet.proto`; `build.rs` compiles it at build
//! time with protox, so no system `protoc` is needed. The scheduler server, the node workers,
//! the trainer client and the CLI all speak through these types; [`auth`] is the bearer token
//! that every call carries when the scheduler was given one, and [`tls`] the certificate the
//! scheduler serves with and the CA its clients trust.

pub mod auth;
pub mod tls;

/// Version 1 of the contract.
pub mod v1 {
    #![allow(missing_docs, clippy::all)]
    tonic::include_proto!("rollfleet.v1");
}
