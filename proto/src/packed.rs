//! The packed form of a generation's token ids and log-probabilities on the worker-to-scheduler
//! hop (`StageOutput.packed_*`): 4 little-endian bytes per value. Decoding one `bytes` field is a
//! copy; decoding the same ids as `repeated uint32` is a varint and a buffer advance per id,
//! which made token-level results cost the scheduler half again the CPU of count-only ones. The
//! packed fields are `Bytes`, so that decoding them takes a slice of the receive buffer instead
//! of a copy.

use prost::bytes::Bytes;

use crate::v1::StageOutput;

/// `ids` as 4 little-endian bytes each.
pub fn pack_u32(ids: &[u32]) -> Vec<u8> {
    let mut packed = Vec::with_capacity(ids.len() * 4);
    for id in ids {
        packed.extend_from_slice(&id.to_le_bytes());
    }
    packed
}

/// `values` as 4 little-endian bytes each (IEEE 754 single precision).
pub fn pack_f32(values: &[f32]) -> Vec<u8> {
    let mut packed = Vec::with_capacity(values.len() * 4);
    for v in values {
        packed.extend_from_slice(&v.to_le_bytes());
    }
    packed
}

/// The 4-byte values of a packed field, decoded by `decode`; an error naming the field when the
/// bytes are not whole values.
fn values<T>(field: &str, bytes: &[u8], decode: impl Fn([u8; 4]) -> T) -> Result<Vec<T>, String> {
    let chunks = bytes.chunks_exact(4);
    if !chunks.remainder().is_empty() {
        return Err(format!(
            "{field}: {} bytes, not a whole number of 4-byte values",
            bytes.len()
        ));
    }
    // An exact-size iterator: one allocation, no zeroing, a loop the compiler vectorizes.
    Ok(chunks.map(|c| decode([c[0], c[1], c[2], c[3]])).collect())
}

/// Moves a result's packed ids and log-probabilities into its repeated fields, so that the
/// rest of the scheduler reads one form. A field given both ways, or packed bytes that are not
/// whole values, is an error naming the field.
pub fn unpack(output: &mut StageOutput) -> Result<(), String> {
    fn ids(field: &str, packed: &mut Bytes, into: &mut Vec<u32>) -> Result<(), String> {
        if packed.is_empty() {
            return Ok(());
        }
        if !into.is_empty() {
            return Err(format!(
                "{field}: given both packed and as a list; send one"
            ));
        }
        *into = values(field, packed, u32::from_le_bytes)?;
        *packed = Bytes::new();
        Ok(())
    }
    ids(
        "packed_tokens",
        &mut output.packed_tokens,
        &mut output.tokens,
    )?;
    ids(
        "packed_prompt_tokens",
        &mut output.packed_prompt_tokens,
        &mut output.prompt_tokens,
    )?;
    if !output.packed_logprobs.is_empty() {
        if !output.logprobs.is_empty() {
            return Err("packed_logprobs: given both packed and as a list; send one".into());
        }
        output.logprobs = values(
            "packed_logprobs",
            &output.packed_logprobs,
            f32::from_le_bytes,
        )?;
        output.packed_logprobs = Bytes::new();
    }
    Ok(())
}

/// Packs a result's ids and log-probabilities (the repeated fields are emptied).
pub fn pack(output: &mut StageOutput) {
    output.packed_tokens = pack_u32(&std::mem::take(&mut output.tokens)).into();
    output.packed_prompt_tokens = pack_u32(&std::mem::take(&mut output.prompt_tokens)).into();
    output.packed_logprobs = pack_f32(&std::mem::take(&mut output.logprobs)).into();
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn packed_ids_and_log_probabilities_unpack_to_the_same_values() {
        let mut output = StageOutput {
            tokens: vec![0, 7, 151_935, u32::MAX],
            prompt_tokens: vec![1, 2],
            logprobs: vec![0.0, -0.5, -17.25, f32::MIN],
            ..Default::default()
        };
        let original = output.clone();
        pack(&mut output);
        assert!(output.tokens.is_empty() && output.logprobs.is_empty());
        assert_eq!(output.packed_tokens.len(), 16);
        unpack(&mut output).unwrap();
        assert_eq!(output, original);
    }

    #[test]
    fn packed_bytes_that_are_not_whole_values_or_a_field_given_twice_are_refused_by_name() {
        let mut torn = StageOutput {
            packed_logprobs: vec![0; 6].into(),
            ..Default::default()
        };
        let error = unpack(&mut torn).unwrap_err();
        assert!(error.starts_with("packed_logprobs: 6 bytes"), "{error}");
        let mut twice = StageOutput {
            tokens: vec![1],
            packed_tokens: pack_u32(&[1]).into(),
            ..Default::default()
        };
        let error = unpack(&mut twice).unwrap_err();
        assert!(error.starts_with("packed_tokens: given both"), "{error}");
    }
}
