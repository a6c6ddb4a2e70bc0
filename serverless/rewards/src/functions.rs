//! The reward functions as Lambda-style handlers: a function name, a JSON payload in, a JSON
//! result or a Lambda-shaped error (`errorType`, `errorMessage`) out.
//!
//! The local host and the custom-runtime `bootstrap` both call [`Handler::invoke`], so a reward
//! computes the same thing on a laptop and on AWS Lambda.
//!
//! Every payload may carry an `idempotency_key` (set by the invoker per trajectory and attempt);
//! it is echoed back so the caller can check that a result belongs to the request it sent.

use std::time::Duration;

use serde::Deserialize;
use serde_json::{Value, json};

use crate::format;
use crate::math;
use crate::sandbox::{CodeTests, Sandbox, SandboxLimits, run_code_tests};

/// The reward functions this crate provides, by their Lambda function name.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RewardFunction {
    /// `{response, reference}`: 1 if the trimmed strings are equal.
    ExactMatch,
    /// `{response, reference}`: 1 if the final answer (`\boxed{}` or last number) is
    /// mathematically the reference.
    MathAnswer,
    /// `{response, pattern, full_match?}`: 1 if the pattern matches.
    RegexMatch,
    /// `{response}`: 1 for a well-formed `<think>…</think><answer>…</answer>` response.
    ThinkAnswerFormat,
    /// `{response}`: 1 if the response is a JSON object.
    JsonFormat,
    /// `{code, tests, limits?}`: the fraction of tests the code passes, run in the sandbox.
    CodeTests,
}

impl RewardFunction {
    pub const ALL: [RewardFunction; 6] = [
        RewardFunction::ExactMatch,
        RewardFunction::MathAnswer,
        RewardFunction::RegexMatch,
        RewardFunction::ThinkAnswerFormat,
        RewardFunction::JsonFormat,
        RewardFunction::CodeTests,
    ];

    pub fn name(self) -> &'static str {
        match self {
            RewardFunction::ExactMatch => "exact_match",
            RewardFunction::MathAnswer => "math_answer",
            RewardFunction::RegexMatch => "regex_match",
            RewardFunction::ThinkAnswerFormat => "think_answer_format",
            RewardFunction::JsonFormat => "json_format",
            RewardFunction::CodeTests => "code_tests",
        }
    }

    pub fn from_name(name: &str) -> Option<RewardFunction> {
        Self::ALL.into_iter().find(|f| f.name() == name)
    }
}

/// A function error in the shape Lambda runtimes report it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{error_type}: {error_message}")]
pub struct FunctionError {
    pub error_type: String,
    pub error_message: String,
}

impl FunctionError {
    /// The payload was not valid for the function: retrying cannot help.
    pub const INVALID_PAYLOAD: &'static str = "InvalidPayload";
    /// The sandbox could not be set up (e.g. no Python): an infrastructure fault, retryable
    /// on another instance.
    pub const SANDBOX_UNAVAILABLE: &'static str = "Sandbox.Unavailable";

    pub fn new(error_type: &str, message: impl Into<String>) -> Self {
        Self {
            error_type: error_type.to_owned(),
            error_message: message.into(),
        }
    }

    pub fn to_json(&self) -> Vec<u8> {
        json!({"errorType": self.error_type, "errorMessage": self.error_message})
            .to_string()
            .into_bytes()
    }
}

#[derive(Deserialize)]
struct MatchPayload {
    response: String,
    reference: String,
    idempotency_key: Option<String>,
}

#[derive(Deserialize)]
struct RegexPayload {
    response: String,
    pattern: String,
    #[serde(default)]
    full_match: bool,
    idempotency_key: Option<String>,
}

#[derive(Deserialize)]
struct ResponsePayload {
    response: String,
    idempotency_key: Option<String>,
}

#[derive(Deserialize)]
struct CodePayload {
    code: String,
    tests: CodeTests,
    limits: Option<SandboxLimits>,
    idempotency_key: Option<String>,
}

/// Runs reward functions. Holds the sandbox's upper limits; payloads may only lower them.
#[derive(Debug, Clone)]
pub struct Handler {
    sandbox: Sandbox,
    code_budget: Duration,
}

impl Default for Handler {
    fn default() -> Self {
        Self::new(
            Sandbox::new(SandboxLimits::default()),
            Duration::from_secs(30),
        )
    }
}

impl Handler {
    /// `code_budget` bounds the total wall time of one `code_tests` call.
    pub fn new(sandbox: Sandbox, code_budget: Duration) -> Self {
        Self {
            sandbox,
            code_budget,
        }
    }

    /// Runs `function` on a JSON `payload` and returns the JSON result.
    pub fn invoke(
        &self,
        function: RewardFunction,
        payload: &[u8],
    ) -> Result<Vec<u8>, FunctionError> {
        let result = match function {
            RewardFunction::ExactMatch => {
                let p: MatchPayload = parse(payload)?;
                let o = math::exact_match(&p.response, &p.reference);
                reward(o.matched, json!(o), p.idempotency_key)
            }
            RewardFunction::MathAnswer => {
                let p: MatchPayload = parse(payload)?;
                let o = math::math_answer_match(&p.response, &p.reference);
                reward(o.matched, json!(o), p.idempotency_key)
            }
            RewardFunction::RegexMatch => {
                let p: RegexPayload = parse(payload)?;
                let matched =
                    format::regex_match(&p.response, &p.pattern, p.full_match).map_err(|e| {
                        FunctionError::new(FunctionError::INVALID_PAYLOAD, e.to_string())
                    })?;
                reward(matched, json!({"matched": matched}), p.idempotency_key)
            }
            RewardFunction::ThinkAnswerFormat => {
                let p: ResponsePayload = parse(payload)?;
                let o = format::think_answer_format(&p.response);
                reward(o.well_formed, json!(o), p.idempotency_key)
            }
            RewardFunction::JsonFormat => {
                let p: ResponsePayload = parse(payload)?;
                let ok = format::is_json_object(&p.response);
                reward(ok, json!({"json_object": ok}), p.idempotency_key)
            }
            RewardFunction::CodeTests => {
                let p: CodePayload = parse(payload)?;
                if p.tests.is_empty() {
                    return Err(FunctionError::new(
                        FunctionError::INVALID_PAYLOAD,
                        "tests must not be empty",
                    ));
                }
                let sandbox = match p.limits {
                    Some(l) => self
                        .sandbox
                        .with_limits(l.clamped_to(self.sandbox.limits())),
                    None => self.sandbox.clone(),
                };
                let report = run_code_tests(&sandbox, &p.code, &p.tests, self.code_budget)
                    .map_err(|e| {
                        FunctionError::new(FunctionError::SANDBOX_UNAVAILABLE, e.to_string())
                    })?;
                json!({
                    "reward": report.pass_rate(),
                    "details": report,
                    "idempotency_key": p.idempotency_key,
                })
            }
        };
        Ok(result.to_string().into_bytes())
    }
}

fn parse<'a, T: Deserialize<'a>>(payload: &'a [u8]) -> Result<T, FunctionError> {
    serde_json::from_slice(payload)
        .map_err(|e| FunctionError::new(FunctionError::INVALID_PAYLOAD, e.to_string()))
}

fn reward(ok: bool, details: Value, key: Option<String>) -> Value {
    json!({
        "reward": if ok { 1.0 } else { 0.0 },
        "details": details,
        "idempotency_key": key,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn call(f: RewardFunction, payload: Value) -> Result<Value, FunctionError> {
        let out = Handler::default().invoke(f, payload.to_string().as_bytes())?;
        Ok(serde_json::from_slice(&out).expect("handlers return JSON"))
    }

    #[test]
    fn every_function_is_found_by_its_own_name_and_unknown_names_are_not() {
        for f in RewardFunction::ALL {
            assert_eq!(RewardFunction::from_name(f.name()), Some(f));
        }
        assert_eq!(RewardFunction::from_name("rm -rf"), None);
    }

    #[test]
    fn math_answer_scores_one_for_an_equivalent_boxed_answer_and_echoes_the_key() {
        let v = call(
            RewardFunction::MathAnswer,
            json!({"response": "... so \\boxed{\\frac{3}{4}}", "reference": "0.75", "idempotency_key": "t1:0"}),
        )
        .unwrap();
        assert_eq!(v["reward"], 1.0);
        assert_eq!(v["idempotency_key"], "t1:0");
    }

    #[test]
    fn regex_function_reports_a_bad_pattern_as_invalid_payload() {
        let e = call(
            RewardFunction::RegexMatch,
            json!({"response": "x", "pattern": "("}),
        )
        .unwrap_err();
        assert_eq!(e.error_type, FunctionError::INVALID_PAYLOAD);
    }

    #[test]
    fn malformed_json_and_wrong_shapes_are_invalid_payload_errors() {
        let h = Handler::default();
        for bad in [
            &b"{not json"[..],
            b"",
            b"null",
            b"[1,2]",
            b"{\"response\": 5}",
            &[0xff, 0xfe],
        ] {
            for f in RewardFunction::ALL {
                let e = h.invoke(f, bad).unwrap_err();
                assert_eq!(e.error_type, FunctionError::INVALID_PAYLOAD, "{f:?}");
            }
        }
    }

    #[test]
    fn empty_test_suite_is_rejected_rather_than_scored() {
        let e = call(
            RewardFunction::CodeTests,
            json!({"code": "print(1)", "tests": {"io": []}}),
        )
        .unwrap_err();
        assert_eq!(e.error_type, FunctionError::INVALID_PAYLOAD);
    }

    #[test]
    fn function_error_serialises_in_the_lambda_error_shape() {
        let e = FunctionError::new("X", "boom");
        let v: Value = serde_json::from_slice(&e.to_json()).unwrap();
        assert_eq!(v, json!({"errorType": "X", "errorMessage": "boom"}));
    }
}
