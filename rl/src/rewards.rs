//! Reward functions of a training job, combined as a weighted sum. A function that fails
//! (an `http` timeout or error, a bad reply) skips the sample, and the failure is counted;
//! it never crashes the job. DAPO's soft overlong shaping is the learner's
//! `overlong_buffer_len` / `overlong_penalty_factor`, applied on top.

use super::error::{Result, RlError};
use serde::Deserialize;
use serde_json::{Map, Value};
use std::time::Duration;

fn one() -> f32 {
    1.0
}

fn five() -> f64 {
    5.0
}

/// One reward function and its weight in the sum.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case", deny_unknown_fields)]
pub enum RewardSpec {
    /// 1 when the completion's final answer equals the example's `answer`, else 0. The
    /// answer is the number after the last `####` (GSM8K), else the last `\boxed{}`, else
    /// the last number in the text; numbers compare numerically (`1,000` = `1000.0`).
    /// With `first_number = true` the answer is the first number in the text instead (a
    /// "reply with only the number" task: `6 + 6 = 12` does not score 12).
    ExactAnswer {
        /// Weight in the sum (default 1).
        #[serde(default = "one")]
        weight: f32,
        /// Read the first number of the completion rather than its final answer.
        #[serde(default)]
        first_number: bool,
    },
    /// 1 when `pattern` (Rust `regex` syntax) matches the completion, else 0.
    Regex {
        /// The pattern.
        pattern: String,
        /// Weight in the sum (default 1).
        #[serde(default = "one")]
        weight: f32,
    },
    /// Length shaping toward `target` completion tokens: `−|len − target| / target`, at least −1.
    Length {
        /// The target length in tokens (>= 1).
        target: usize,
        /// Weight in the sum (default 1).
        #[serde(default = "one")]
        weight: f32,
    },
    /// `POST url` with `{"prompt", "completion", ...the example's fields}`; the reply must be
    /// `{"reward": float}`. Plain `http://` only.
    Http {
        /// The scorer's address (`http://` only).
        url: String,
        /// Seconds before the request counts as failed (default 5).
        #[serde(default = "five")]
        timeout_s: f64,
        /// Weight in the sum (default 1).
        #[serde(default = "one")]
        weight: f32,
    },
}

impl RewardSpec {
    /// Checks the function's parameters; the message names the reward and the field.
    pub fn validate(&self) -> Result<()> {
        self.compile().map(|_| ())
    }

    /// Validates and compiles the `regex` pattern (`None` for the other functions).
    fn compile(&self) -> Result<Option<regex::Regex>> {
        match self {
            RewardSpec::Regex { pattern, .. } => regex::Regex::new(pattern)
                .map(Some)
                .map_err(|e| RlError::invalid("rewards", format!("reward regex `pattern`: {e}"))),
            RewardSpec::Length { target: 0, .. } => {
                Err(RlError::invalid("rewards", "reward length `target` must be >= 1"))
            }
            RewardSpec::Http { url, .. } if !url.starts_with("http://") => {
                Err(RlError::invalid("rewards", format!("reward http `url` must start with http://, got {url:?}")))
            }
            RewardSpec::Http { timeout_s, .. } if !(*timeout_s > 0.0 && timeout_s.is_finite()) => {
                Err(RlError::invalid("rewards", format!("reward http `timeout_s` must be > 0, got {timeout_s}")))
            }
            _ => Ok(None),
        }
    }
}

/// Why a reward function could not score a sample (the sample is skipped and counted).
#[derive(Debug, thiserror::Error)]
pub enum RewardError {
    /// The `http` reward's request failed, timed out, or got a non-2xx status.
    #[error("reward http {url}: {message}")]
    Request {
        /// The scorer's address.
        url: String,
        /// The failure.
        message: String,
    },
    /// The `http` reward's reply is not `{"reward": <finite number>}`.
    #[error("reward http {url}: bad reply: {message}")]
    BadReply {
        /// The scorer's address.
        url: String,
        /// What is wrong with the reply.
        message: String,
    },
}

/// What a reward sees of one sample.
pub struct Scored<'a> {
    /// The prompt as text (what the chat template produced).
    pub prompt: &'a str,
    /// The completion's text.
    pub completion: &'a str,
    /// The completion's length in tokens.
    pub completion_tokens: usize,
    /// The dataset line's fields (`answer`, ...).
    pub fields: &'a Map<String, Value>,
}

/// The job's reward functions, ready to score.
pub struct Rewards {
    specs: Vec<(RewardSpec, Option<regex::Regex>)>,
    client: reqwest::Client,
    runtime: tokio::runtime::Handle,
}

impl Rewards {
    /// `runtime` runs the `http` rewards' requests (the caller is a plain thread).
    pub fn new(specs: &[RewardSpec], runtime: tokio::runtime::Handle) -> Result<Self> {
        let specs = specs.iter().map(|s| Ok((s.clone(), s.compile()?))).collect::<Result<_>>()?;
        Ok(Self { specs, client: reqwest::Client::new(), runtime })
    }

    /// The weighted sum, or why the sample must be skipped.
    pub fn score(&self, s: &Scored) -> Result<f32, RewardError> {
        let mut total = 0.0;
        for (spec, re) in &self.specs {
            total += match spec {
                RewardSpec::ExactAnswer { weight, first_number } => {
                    weight * answer_matches(s.completion, s.fields.get("answer"), *first_number) as u8 as f32
                }
                RewardSpec::Regex { weight, .. } => {
                    weight * re.as_ref().is_some_and(|r| r.is_match(s.completion)) as u8 as f32
                }
                RewardSpec::Length { target, weight } => {
                    let d = (s.completion_tokens as f32 - *target as f32).abs() / *target as f32;
                    weight * -d.min(1.0)
                }
                RewardSpec::Http { url, timeout_s, weight } => weight * self.http(url, *timeout_s, s)?,
            };
        }
        Ok(total)
    }

    fn http(&self, url: &str, timeout_s: f64, s: &Scored) -> Result<f32, RewardError> {
        let mut body = s.fields.clone();
        body.insert("prompt".into(), s.prompt.into());
        body.insert("completion".into(), s.completion.into());
        let req = self.client.post(url).timeout(Duration::from_secs_f64(timeout_s)).json(&body);
        let request = |message: String| RewardError::Request { url: url.to_string(), message };
        let bad_reply = |message: String| RewardError::BadReply { url: url.to_string(), message };
        let reply: Value = self.runtime.block_on(async move {
            let r = req.send().await.map_err(|e| request(e.to_string()))?;
            if !r.status().is_success() {
                return Err(request(format!("status {}", r.status())));
            }
            r.json().await.map_err(|e| bad_reply(e.to_string()))
        })?;
        reply["reward"]
            .as_f64()
            .filter(|r| r.is_finite())
            .map(|r| r as f32)
            .ok_or_else(|| bad_reply("no finite `reward`".into()))
    }
}

/// The final answer of a completion (see [`RewardSpec::ExactAnswer`]) equals `answer`.
pub fn exact_answer(completion: &str, answer: Option<&Value>) -> bool {
    answer_matches(completion, answer, false)
}

/// The completion's answer (its first number when `first_number`, else its final answer, see
/// [`RewardSpec::ExactAnswer`]) equals `answer`.
pub fn answer_matches(completion: &str, answer: Option<&Value>, first: bool) -> bool {
    let want = match answer {
        Some(Value::String(s)) => s.clone(),
        Some(Value::Number(n)) => n.to_string(),
        _ => return false,
    };
    let got = if first {
        first_number(completion)
    } else if let Some(i) = completion.rfind("####") {
        first_number(&completion[i + 4..])
    } else if let Some(i) = completion.rfind("\\boxed{") {
        let rest = &completion[i + 7..];
        rest.find('}').map(|j| rest[..j].trim().to_string())
    } else {
        last_number(completion)
    };
    let Some(got) = got else { return false };
    let num = |s: &str| s.trim().trim_start_matches('$').replace(',', "").parse::<f64>().ok();
    match (num(&got), num(&want)) {
        (Some(a), Some(b)) => a == b,
        _ => got.trim() == want.trim(),
    }
}

fn numbers(text: &str) -> impl Iterator<Item = String> + '_ {
    static RE: std::sync::OnceLock<regex::Regex> = std::sync::OnceLock::new();
    let re = RE.get_or_init(|| regex::Regex::new(r"-?\d[\d,]*(\.\d+)?").expect("valid regex"));
    re.find_iter(text).map(|m| m.as_str().trim_end_matches(',').to_string())
}

fn first_number(text: &str) -> Option<String> {
    numbers(text).next()
}

fn last_number(text: &str) -> Option<String> {
    numbers(text).last()
}
