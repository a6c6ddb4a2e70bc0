//! The rollfleet job spec: one YAML format for an RL job, and its validation.
//!
//! A job file names the policy model, the RL settings, the task mix, the reward functions and
//! the hardware pools (see `examples/jobs/` and `docs/job-spec.md`). This crate turns bytes into
//! a [`ValidatedJob`] or into errors that name the field: a syntax or type error stops the parse
//! at its field (`spec.pools[0].count: invalid type: string "many", expected i64`), and every
//! semantic problem is reported at once (`spec.pools[1].gpu: unknown GPU "H900" (known: ...)`).
//!
//! Nothing here panics on any input; the crate is pure (no I/O besides [`load_job_file`]) so the
//! scheduler core, the simulator, the CLI and the Kubernetes operator share one definition.

mod distribution;
mod manifest;
mod model;
mod validate;

use std::path::Path;

pub use distribution::{Dist, Distribution, TraceColumn, TraceName, lognormal_sigma};
pub use manifest::{
    API_VERSION, CatalogAdditions, JobManifest, JobSpec, KIND, Metadata, NetworkSpec, PoolKind,
    PoolSpec, RewardPlacement, RewardSpec, RlSpec, Role, TaskSpec,
};
pub use model::ModelSpec;
pub use validate::{Problem, USABLE_MEMORY_FRACTION, replica_bytes};

use rollfleet_catalog::Catalog;

/// Largest job file accepted. Real specs are a few kilobytes; the limit keeps a wrong file (a
/// dataset, a binary) from being parsed into memory.
pub const MAX_SPEC_BYTES: usize = 1024 * 1024;

/// Why a job spec was rejected.
#[derive(Debug, thiserror::Error)]
pub enum SpecError {
    /// The file could not be read.
    #[error("{origin}: cannot read: {source}")]
    Read {
        /// The file.
        origin: String,
        /// The I/O error.
        source: std::io::Error,
    },
    /// The input is larger than [`MAX_SPEC_BYTES`].
    #[error("{origin}: {size} bytes is too large for a job spec (the limit is {limit} bytes)")]
    TooLarge {
        /// The file.
        origin: String,
        /// Its size.
        size: u64,
        /// The limit.
        limit: usize,
    },
    /// The input is not UTF-8 text.
    #[error("{origin}: not UTF-8 text: invalid byte at offset {offset}")]
    NotUtf8 {
        /// The file.
        origin: String,
        /// Offset of the first invalid byte.
        offset: usize,
    },
    /// The YAML is malformed, or a field has the wrong type, or a field is missing or unknown.
    #[error("{origin}: {path}: {message}")]
    Syntax {
        /// The file.
        origin: String,
        /// Field path where the parse stopped (`.` for the document itself).
        path: String,
        /// The parser's message, with line and column where known.
        message: String,
    },
    /// The spec parsed, but has problems; all of them are listed.
    #[error("{origin}: {} problem{}:\n{}", problems.len(), if problems.len() == 1 { "" } else { "s" },
        problems.iter().map(|p| format!("  {p}")).collect::<Vec<_>>().join("\n"))]
    Invalid {
        /// The file.
        origin: String,
        /// Every problem, in document order.
        problems: Vec<Problem>,
    },
}

impl SpecError {
    /// Every problem as `(path, message)`, whatever the kind of error.
    pub fn problems(&self) -> Vec<Problem> {
        match self {
            SpecError::Invalid { problems, .. } => problems.clone(),
            SpecError::Syntax { path, message, .. } => vec![Problem {
                path: path.clone(),
                message: message.clone(),
            }],
            other => vec![Problem {
                path: ".".to_owned(),
                message: other.to_string(),
            }],
        }
    }
}

/// A job that passed validation, with the catalogue it was validated against.
#[derive(Debug, Clone)]
pub struct ValidatedJob {
    /// The job as written (defaults filled in).
    pub manifest: JobManifest,
    /// The built-in catalogue plus the job's own additions.
    pub catalog: Catalog,
    /// Things that are allowed but probably not meant.
    pub warnings: Vec<Problem>,
}

impl ValidatedJob {
    /// The job spec.
    pub fn spec(&self) -> &JobSpec {
        &self.manifest.spec
    }
}

/// Reads, parses and validates a job file.
pub fn load_job_file(path: &Path) -> Result<ValidatedJob, SpecError> {
    let origin = path.display().to_string();
    let metadata = std::fs::metadata(path).map_err(|source| SpecError::Read {
        origin: origin.clone(),
        source,
    })?;
    // Check the size before reading, so a huge file is never pulled into memory.
    if metadata.len() > MAX_SPEC_BYTES as u64 {
        return Err(SpecError::TooLarge {
            origin,
            size: metadata.len(),
            limit: MAX_SPEC_BYTES,
        });
    }
    let bytes = std::fs::read(path).map_err(|source| SpecError::Read {
        origin: origin.clone(),
        source,
    })?;
    parse_job(&bytes, &origin)
}

/// Parses and validates a job from bytes; `origin` names the input in error messages.
pub fn parse_job(bytes: &[u8], origin: &str) -> Result<ValidatedJob, SpecError> {
    if bytes.len() > MAX_SPEC_BYTES {
        return Err(SpecError::TooLarge {
            origin: origin.to_owned(),
            size: bytes.len() as u64,
            limit: MAX_SPEC_BYTES,
        });
    }
    let text = std::str::from_utf8(bytes).map_err(|e| SpecError::NotUtf8 {
        origin: origin.to_owned(),
        offset: e.valid_up_to(),
    })?;
    if text.trim().is_empty() {
        return Err(SpecError::Syntax {
            origin: origin.to_owned(),
            path: ".".to_owned(),
            message:
                "the file is empty; a job spec starts with `apiVersion: rollfleet.dev/v1alpha1`"
                    .to_owned(),
        });
    }
    let deserializer = serde_yaml_ng::Deserializer::from_str(text);
    let manifest: JobManifest = serde_path_to_error::deserialize(deserializer).map_err(|e| {
        let path = e.path().to_string();
        let message = e.inner().to_string();
        // The YAML parser prefixes some messages with the path (or its parent); say it once.
        let message = match message.split_once(": ") {
            Some((prefix, rest)) if !prefix.is_empty() && path.starts_with(prefix) => {
                rest.to_owned()
            }
            _ => message,
        };
        SpecError::Syntax {
            origin: origin.to_owned(),
            path,
            message,
        }
    })?;
    let outcome = validate::validate(&manifest);
    if !outcome.errors.is_empty() {
        return Err(SpecError::Invalid {
            origin: origin.to_owned(),
            problems: outcome.errors,
        });
    }
    Ok(ValidatedJob {
        manifest,
        catalog: outcome.catalog,
        warnings: outcome.warnings,
    })
}
