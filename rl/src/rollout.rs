//! Rollouts (token in, token out): the engine's per-step outputs of a batch of prompts ×
//! `n` samples gathered into one record per sample, with everything the learner needs.

use engine::outputs::EngineFault;
use engine::{FinishReason, RequestStream, SeqOutput};
use learner::TrainSample;
use serde::Serialize;

/// One sample of one prompt.
#[derive(Debug, Clone, Serialize)]
pub struct Rollout {
    /// Index of the prompt in the request.
    pub prompt_index: usize,
    /// Index of the sample within its group (the prompt's `n` samples).
    pub index: usize,
    /// The prompt's token ids.
    pub prompt_token_ids: Vec<u32>,
    /// The sampled tokens.
    pub completion_ids: Vec<u32>,
    /// The completion's text.
    pub text: String,
    /// μ per token: log-probability under the distribution actually sampled.
    pub behavior_logprobs: Vec<f32>,
    /// `log_softmax(logits)[token]` at temperature 1, no processing.
    pub raw_logprobs: Vec<f32>,
    /// Policy version that computed each token.
    pub versions: Vec<u64>,
    /// Why the sample ended (`None` while running).
    pub finish_reason: Option<FinishReason>,
    /// The prompt's raw logprobs (`None` for the first token), on sample 0 when requested.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prompt_logprobs: Option<Vec<Option<f32>>>,
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
        if let Some(p) = o.prompt_logprobs {
            self.prompt_logprobs = Some(p.iter().map(|x| x.logprob).collect());
        }
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

    /// The learner's sample of this rollout (tokens, μ, versions, finish reason), not yet
    /// scored: no reward, advantage or group.
    pub fn sample(&self) -> TrainSample {
        TrainSample {
            prompt_ids: self.prompt_token_ids.clone(),
            completion_ids: self.completion_ids.clone(),
            behavior_logprobs: self.behavior_logprobs.clone(),
            advantage: None,
            reward: None,
            group: None,
            versions: Some(self.versions.clone()),
            finish_reason: self.finish_reason_str(),
        }
    }

    /// The learner's sample, with the reward and group (GRPO) it was scored with.
    pub fn to_sample(&self, reward: f32, group: u64) -> TrainSample {
        TrainSample { reward: Some(reward), group: Some(group), ..self.sample() }
    }
}

/// The choices of one or more requests (prompts × `n` samples), filled as the engine's
/// outputs arrive: the one place per-choice tokens, μ, raw logprobs and versions are
/// gathered (rollout requests, training jobs, the feedback recorder).
pub struct RolloutSet {
    rollouts: Vec<Rollout>,
    n: usize,
    /// Requests that have not finished yet.
    open: usize,
    /// A request ended by abort (client gone, engine stopped): the set stays incomplete.
    aborted: bool,
}

impl RolloutSet {
    /// One slot per (prompt, sample), prompt-major; one request per prompt.
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
                    prompt_logprobs: None,
                })
            })
            .collect();
        Self { rollouts, n, open: prompts.len(), aborted: false }
    }

    /// Adds one output of prompt `prompt`'s request. True when it finished the last open
    /// request and no request was aborted: every choice is complete.
    pub fn push(&mut self, prompt: usize, o: SeqOutput) -> bool {
        if o.request_finished {
            self.open = self.open.saturating_sub(1);
            self.aborted |= o.finish_reason == Some(FinishReason::Abort);
        }
        let i = prompt * self.n + o.index;
        self.rollouts[i].absorb(o);
        self.open == 0 && !self.aborted
    }

    /// The choices, prompt-major.
    pub fn into_rollouts(self) -> Vec<Rollout> {
        self.rollouts
    }

    /// Waits until every stream (stream `p` = prompt `p`) has finished, or returns the fault
    /// of a failed engine step (the remaining streams are dropped, which aborts them). A
    /// plain thread runs it through its runtime handle's `block_on` (flume's async receive
    /// needs no reactor).
    pub async fn collect(mut self, streams: Vec<RequestStream>) -> Result<Vec<Rollout>, EngineFault> {
        for (p, mut s) in streams.into_iter().enumerate() {
            while let Some(item) = s.recv_item_async().await {
                self.push(p, item?);
            }
        }
        Ok(self.rollouts)
    }
}
