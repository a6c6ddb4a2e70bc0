//! The rollfleet job spec: one YAML format for an RL job, and its validation.
//!
//! A job file names the policy model, the RL settings, the task mix, the reward functions and
//! the hardware pools (see `examples/jobs/` and `docs/job-spec.md`). This crate turns bytes into
//! a [`ValidatedJob`] or into errors that name the field: a syntax or type error stops the parse
//! at its field (`spec.pools[0].count: invalid type: string "many", expected i64`), and every
//! semantic problem is reported at once (`spec.pools[1].gpu: unknown GPU "H900" (known: ...)`).
//!
//! Nothing here panics on any input; the crate is pure (no I/O besides [`load_job_file`] and the
//! CSV files a job's distributions name, read once when it is parsed) so the
//! scheduler core, the simulator, the CLI and the Kubernetes operator share one definition.

mod csv_column;
mod distribution;
mod kubernetes;
mod manifest;
mod model;
mod names;
mod nesting;
mod platform_limits;
#[cfg(feature = "schema")]
mod schema;
mod validate;

use std::path::Path;

pub use csv_column::{CsvRows, MAX_CSV_BYTES, MAX_CSV_ROWS, absolute_csv_paths};
pub use distribution::{
    Dist, Distribution, TraceColumn, TraceName, lognormal_moment, lognormal_sigma, normal_cdf,
};
pub use kubernetes::{
    GPU_RESOURCE, KubernetesJob, KubernetesPlacement, Quantity, Resources, TaintEffect, Toleration,
    TolerationOperator,
};
pub use manifest::{
    API_VERSION, CatalogAdditions, EnvironmentServer, EnvironmentSpec, JobManifest, JobSpec, KIND,
    Metadata, NetworkSpec, PoolKind, PoolSpec, RewardPlacement, RewardSpec, RlSpec, Role, TaskSpec,
    TrainerMode,
};
pub use model::{ModelSpec, WeightReads, causal_attention_flops, train_attention_flops};
pub use names::{BUILTIN_ENVIRONMENTS, BUILTIN_REWARD_FUNCTIONS, did_you_mean};
pub use validate::{Problem, USABLE_MEMORY_FRACTION, replica_bytes};

use rollfleet_catalog::Catalog;

/// Largest job file accepted. Real specs are a few kilobytes; the limit keeps a wrong file (a
/// dataset, a binary) from being parsed into memory.
pub const MAX_SPEC_BYTES: usize = 1024 * 1024;

/// Deepest nesting accepted, counting block collections (indented mappings and lists) and flow
/// collections (`[...]`, `{...}`) together. A job spec nests five levels deep (the map of
/// `spec.tasks[0].actionTokens`); the YAML parser's time grows with the flow nesting depth times
/// the document's length, so a document nested far deeper is refused before it is parsed.
pub const MAX_NESTING: usize = 64;

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
    /// The input nests deeper than [`MAX_NESTING`] levels.
    #[error(
        "{origin}: line {line}: nested deeper than {limit} levels; a job spec needs fewer than \
         ten, and the YAML parser's time grows with the depth times the length, so the document \
         is refused before parsing"
    )]
    TooDeep {
        /// The file.
        origin: String,
        /// Line (from 1) where the document first goes deeper than the limit.
        line: usize,
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

    /// The same job on other pools (a cluster inventory, `origin`), validated again as a whole:
    /// the pools' own problems are named by their path in the inventory (`pools[1].count`),
    /// the job's problems with them (a reward on a pool the inventory lacks) by their path in
    /// the job.
    pub fn with_pools(
        &self,
        pools: Vec<PoolSpec>,
        origin: &str,
    ) -> Result<ValidatedJob, SpecError> {
        let mut manifest = self.manifest.clone();
        manifest.spec.pools = pools;
        let outcome = validate::validate(&manifest);
        if !outcome.errors.is_empty() {
            let problems = outcome
                .errors
                .into_iter()
                .map(|p| match p.path.strip_prefix("spec.pools") {
                    Some(rest) => Problem {
                        path: format!("pools{rest}"),
                        message: p.message,
                    },
                    None => Problem {
                        path: format!("the job's {}", p.path),
                        message: p.message,
                    },
                })
                .collect();
            return Err(SpecError::Invalid {
                origin: origin.to_owned(),
                problems,
            });
        }
        Ok(ValidatedJob {
            manifest,
            catalog: outcome.catalog,
            warnings: outcome.warnings,
        })
    }

    /// The same job on the pools of an inventory file ([`Inventory`], read as a job file is:
    /// bounded, UTF-8, unknown fields refused), validated as [`ValidatedJob::with_pools`] does.
    pub fn with_inventory_file(&self, path: &Path) -> Result<ValidatedJob, SpecError> {
        let origin = path.display().to_string();
        let bytes = read_limited(path)?;
        let text = std::str::from_utf8(&bytes).map_err(|e| SpecError::NotUtf8 {
            origin: origin.clone(),
            offset: e.valid_up_to(),
        })?;
        let inventory: Inventory = parse_yaml(text, &origin)?;
        if inventory.pools.is_empty() {
            return Err(SpecError::Invalid {
                origin,
                problems: vec![Problem {
                    path: "pools".into(),
                    message: "the inventory has no pools".into(),
                }],
            });
        }
        self.with_pools(inventory.pools, &origin)
    }
}

/// A cluster inventory: pools in the job spec's own format, to plan or simulate a job on
/// instead of its own pools (rewards still refer to pools by name).
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Inventory {
    /// The pools.
    pub pools: Vec<PoolSpec>,
}

/// The problems of a job's `spec.kubernetes` block, each with its field path
/// (`spec.kubernetes.tokenSecret`), as [`parse_job`] reports them; for the operator, which reads
/// the block apart from the job file.
pub fn kubernetes_job_problems(block: &KubernetesJob) -> Vec<Problem> {
    kubernetes::job_problems(Some(block))
}

/// Reads, parses and validates a job file. A CSV distribution's relative path is resolved
/// against the job file's directory.
pub fn load_job_file(path: &Path) -> Result<ValidatedJob, SpecError> {
    let bytes = read_limited(path)?;
    let dir = path.parent().unwrap_or(Path::new(""));
    parse_job_in(&bytes, &path.display().to_string(), Some(dir))
}

/// Reads a file of at most [`MAX_SPEC_BYTES`] (a job, or a file in one of its formats), checking
/// the size before reading, so a huge file is never pulled into memory.
pub fn read_limited(path: &Path) -> Result<Vec<u8>, SpecError> {
    use std::io::Read;
    let origin = path.display().to_string();
    let read_error = |source| SpecError::Read {
        origin: origin.clone(),
        source,
    };
    let file = std::fs::File::open(path).map_err(read_error)?;
    let size = file.metadata().map_err(read_error)?.len();
    let too_large = |size| SpecError::TooLarge {
        origin: origin.clone(),
        size,
        limit: MAX_SPEC_BYTES,
    };
    if size > MAX_SPEC_BYTES as u64 {
        return Err(too_large(size));
    }
    // Bounded again while reading: the file may have grown since (or be a pipe).
    let mut bytes = Vec::new();
    file.take(MAX_SPEC_BYTES as u64 + 1)
        .read_to_end(&mut bytes)
        .map_err(read_error)?;
    if bytes.len() > MAX_SPEC_BYTES {
        return Err(too_large(bytes.len() as u64));
    }
    Ok(bytes)
}

/// Parses YAML into `T` (a job, or a file in one of its formats such as an inventory), naming
/// the field path where it stops.
///
/// Text over [`MAX_SPEC_BYTES`] or nested deeper than [`MAX_NESTING`] levels is refused before
/// the parser sees it: the parser's time grows with the nesting depth times the length (a minute
/// for 200 KB of `[[[...]]]`), and its own recursion limit applies only after it has read the
/// whole document.
pub fn parse_yaml<T: serde::de::DeserializeOwned>(
    text: &str,
    origin: &str,
) -> Result<T, SpecError> {
    if text.len() > MAX_SPEC_BYTES {
        return Err(SpecError::TooLarge {
            origin: origin.to_owned(),
            size: text.len() as u64,
            limit: MAX_SPEC_BYTES,
        });
    }
    nesting::check(text, MAX_NESTING).map_err(|too_deep| SpecError::TooDeep {
        origin: origin.to_owned(),
        line: too_deep.line,
        limit: MAX_NESTING,
    })?;
    let deserializer = serde_yaml_ng::Deserializer::from_str(text);
    serde_path_to_error::deserialize(deserializer).map_err(|e| {
        let path = e.path().to_string();
        let message = e.inner().to_string();
        // The YAML parser prefixes some messages with the path (or its parent); say it once.
        let message = match message.split_once(": ") {
            Some((prefix, rest)) if !prefix.is_empty() && path.starts_with(prefix) => {
                rest.to_owned()
            }
            _ => message,
        };
        let message = names::with_field_suggestion(message);
        SpecError::Syntax {
            origin: origin.to_owned(),
            path,
            message,
        }
    })
}

/// Parses and validates a job from bytes; `origin` names the input in error messages. A CSV
/// distribution's relative path is resolved against the current directory (see
/// [`parse_job_in`]).
pub fn parse_job(bytes: &[u8], origin: &str) -> Result<ValidatedJob, SpecError> {
    parse_job_in(bytes, origin, None)
}

/// The job `yaml` as a scheduler elsewhere should be sent it: parsed and validated with its
/// relative CSV paths resolved against `dir` (the job file's directory), and written again with
/// those paths absolute when it names any; otherwise exactly as given. A scheduler resolves a
/// relative path against its own working directory.
pub fn job_yaml_for_dir(yaml: &[u8], origin: &str, dir: &Path) -> Result<String, SpecError> {
    let mut manifest = parse_job_in(yaml, origin, Some(dir))?.manifest;
    let rewritten = absolute_csv_paths(&mut manifest, dir).map_err(|source| SpecError::Read {
        origin: format!("{origin}: its CSV paths against {}", dir.display()),
        source,
    })?;
    if rewritten {
        return serde_yaml_ng::to_string(&manifest).map_err(|e| SpecError::Syntax {
            origin: origin.to_owned(),
            path: ".".to_owned(),
            message: e.to_string(),
        });
    }
    // Validated, so UTF-8.
    String::from_utf8(yaml.to_vec()).map_err(|e| SpecError::NotUtf8 {
        origin: origin.to_owned(),
        offset: e.utf8_error().valid_up_to(),
    })
}

/// Parses and validates a job from bytes, reading the CSV files its distributions name (the
/// only I/O besides [`load_job_file`]): a relative path is resolved against `dir`, or the current
/// directory when `None`. A file that cannot be used is a problem of the distribution's field.
pub fn parse_job_in(
    bytes: &[u8],
    origin: &str,
    dir: Option<&Path>,
) -> Result<ValidatedJob, SpecError> {
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
    let mut manifest: JobManifest = parse_yaml(text, origin)?;
    let unreadable = csv_column::load_csv_distributions(&mut manifest, dir);
    let outcome = validate::validate(&manifest);
    // Every CSV distribution was read here, or its failure is in `unreadable`: the validator's
    // "not read" would say the same again.
    let problems: Vec<Problem> = unreadable
        .into_iter()
        .chain(
            outcome
                .errors
                .into_iter()
                .filter(|p| p.message != csv_column::NOT_READ),
        )
        .collect();
    if !problems.is_empty() {
        return Err(SpecError::Invalid {
            origin: origin.to_owned(),
            problems,
        });
    }
    Ok(ValidatedJob {
        manifest,
        catalog: outcome.catalog,
        warnings: outcome.warnings,
    })
}
