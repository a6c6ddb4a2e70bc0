//! Generates the Rust types and tonic services for `rollfleet/v1/rollfleet.proto`.
//!
//! protox (a protobuf compiler written in Rust) parses the file, so building needs no system
//! `protoc`; tonic-prost-build then generates code from the resulting descriptors.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let proto = "rollfleet/v1/rollfleet.proto";
    println!("cargo:rerun-if-changed={proto}");
    let descriptors = protox::compile([proto], ["."])?;
    tonic_prost_build::configure()
        .build_server(true)
        .build_client(true)
        .compile_fds(descriptors)?;
    Ok(())
}
