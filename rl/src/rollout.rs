//! Rollouts (token in, token out): the engine's per-step outputs of a batch of prompts ×
//! `n` samples gathered into one record per sample, with everything the learner needs.

use learner::TrainSample;
use engine::{FinishReason, RequestStream, SeqOutput};
use serde::Serialize;

/// One sample of one prompt.
#[derive(Debug, Clone, Serialize)]
pub struct Rollout {
    /// Index of the prompt in the request, and of the sample within its group.
    pub prompt_index: usize,
    pub index: usize,
    pub prompt_token_ids: Vec<u32>,
    pub completion_ids: Vec<u32>,
    pub text: String,
    /// μ per token: log-probability under the distribution actually sampled.
    pub behavior_logprobs: Vec<f32>,
    /// `log_softmax(logits)[token]` at temperature 1, no processing.
    pub raw_logprobs: Vec<f32>,
    /// Policy version that computed each token.
    pub versions: Vec<u64>,
    pub finish_reason: Option<FinishReason>,
}

impl Rollout {
    fn absorb(&mut self, o: SeqOutput) {
        for t in o.tokens {
            self.completion_ids.push(t.token_id);
            self.behavior_logprobs.push(t.behavior_logprob);
            self.raw_logprobs.push(t.raw_logprob);
            self.versions.push(t.version);
        }
        self.text.push_str(&o.text);
        if o.finish_reason.is_some() {
            self.finish_reason = o.finish_reason;
        }
    }

    /// `finish_reason` as the learner's string (`stop`, `length`, `abort`).
    pub fn finish_reason_str(&self) -> Option<String> {
        self.finish_reason.map(|f| match f {
            FinishReason::Stop => "stop".into(),
            FinishReason::Length => "length".into(),
            FinishReason::Abort => "abort".into(),
        })
    }

    /// The learner's sample, with the reward and group (GRPO) it was scored with.
    pub fn to_sample(&self, reward: f32, group: u64) -> TrainSample {
        TrainSample {
            prompt_ids: self.prompt_token_ids.clone(),
            completion_ids: self.completion_ids.clone(),
            behavior_logprobs: self.behavior_logprobs.clone(),
            advantage: None,
            reward: Some(reward),
            group: Some(group),
            versions: Some(self.versions.clone()),
            finish_reason: self.finish_reason_str(),
        }
    }
}

/// The samples of several requests, filled as outputs arrive.
pub struct RolloutSet {
    pub rollouts: Vec<Rollout>,
    n: usize,
}

impl RolloutSet {
    /// One slot per (prompt, sample), prompt-major.
    pub fn new(prompts: &[Vec<u32>], n: usize) -> Self {
        let rollouts = prompts
            .iter()
            .enumerate()
            .flat_map(|(p, ids)| {
                (0..n).map(move |index| Rollout {
                    prompt_index: p,
                    index,
                    prompt_token_ids: ids.clone(),
                    completion_ids: vec![],
                    text: String::new(),
                    behavior_logprobs: vec![],
                    raw_logprobs: vec![],
                    versions: vec![],
                    finish_reason: None,
                })
            })
            .collect();
        Self { rollouts, n }
    }

    pub fn push(&mut self, prompt: usize, o: SeqOutput) {
        let i = prompt * self.n + o.index;
        self.rollouts[i].absorb(o);
    }

    /// Blocks until every stream (stream `p` = prompt `p`) has finished.
    pub fn collect_blocking(mut self, streams: Vec<RequestStream>) -> Vec<Rollout> {
        for (p, mut s) in streams.into_iter().enumerate() {
            while let Some(o) = s.recv() {
                self.push(p, o);
            }
        }
        self.rollouts
    }

    /// Like [`Self::collect_blocking`], on the async runtime (the HTTP handlers).
    pub async fn collect_async(mut self, streams: Vec<RequestStream>) -> Vec<Rollout> {
        for (p, mut s) in streams.into_iter().enumerate() {
            while let Some(o) = s.recv_async().await {
                self.push(p, o);
            }
        }
        self.rollouts
    }
}
