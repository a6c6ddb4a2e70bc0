//! Generates the Rust types and tonic services for `rollfleet/v1/rollfleet.proto`.
//!
//! protox (a protobuf compiler written in Rust) parses the file, so building needs no system
//! `protoc`; tonic-prost-build then generates code from the resulting descriptors.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let proto = "rollfleet/v1/rollfleet.proto";
    println!("cargo:rerun-if-changed={proto}");
    let descriptors = protox::compile([proto], ["."])?;
    let mut config = tonic_prost_build::configure()
        .build_server(true)
        .build_client(true);
    // A result's packed ids and log-probabilities decode as slices of the receive buffer
    // (`Bytes`), not copies of it: the scheduler unpacks them once, into its own vectors.
    for field in ["packed_tokens", "packed_logprobs", "packed_prompt_tokens"] {
        config = config.bytes(format!(".rollfleet.v1.StageOutput.{field}"));
    }
    config.compile_fds(descriptors)?;
    Ok(())
}
