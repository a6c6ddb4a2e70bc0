//! The packed form of a generation's token ids and log-probabilities on the worker-to-scheduler
//! hop (`StageOutput.packed_*`): 4 little-endian bytes per value. Decoding one `bytes` field is a
//! copy; decoding the same ids as `repeated uint32` is a varint and a buffer advance per id,
//! which made token-level results cost the scheduler half again the CPU of count-only ones.

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

fn chunks(field: &str, bytes: &[u8]) -> Result<impl Iterator<Item = [u8; 4]>, String> {
    if !bytes.len().is_multiple_of(4) {
        return Err(format!(
            "{field}: {} bytes, not a whole number of 4-byte values",
            bytes.len()
        ));
    }
    Ok(bytes.chunks_exact(4).map(|c| [c[0], c[1], c[2], c[3]]))
}

/// Moves a result's packed ids and log-probabilities into its repeated fields, so that the
/// rest of the scheduler reads one form. A field given both ways, or packed bytes that are not
/// whole values, is an error naming the field.
pub fn unpack(output: &mut StageOutput) -> Result<(), String> {
    fn ids(field: &str, packed: &mut Vec<u8>, into: &mut Vec<u32>) -> Result<(), String> {
        if packed.is_empty() {
            return Ok(());
        }
        if !into.is_empty() {
            return Err(format!(
                "{field}: given both packed and as a list; send one"
            ));
        }
        *into = chunks(field, packed)?.map(u32::from_le_bytes).collect();
        packed.clear();
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
        output.logprobs = chunks("packed_logprobs", &output.packed_logprobs)?
            .map(f32::from_le_bytes)
            .collect();
        output.packed_logprobs.clear();
    }
    Ok(())
}

/// Packs a result's ids and log-probabilities (the repeated fields are emptied).
pub fn pack(output: &mut StageOutput) {
    output.packed_tokens = pack_u32(&std::mem::take(&mut output.tokens));
    output.packed_prompt_tokens = pack_u32(&std::mem::take(&mut output.prompt_tokens));
    output.packed_logprobs = pack_f32(&std::mem::take(&mut output.logprobs));
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
            packed_logprobs: vec![0; 6],
            ..Default::default()
        };
        let error = unpack(&mut torn).unwrap_err();
        assert!(error.starts_with("packed_logprobs: 6 bytes"), "{error}");
        let mut twice = StageOutput {
            tokens: vec![1],
            packed_tokens: pack_u32(&[1]),
            ..Default::default()
        };
        let error = unpack(&mut twice).unwrap_err();
        assert!(error.starts_with("packed_tokens: given both"), "{error}");
    }
}
