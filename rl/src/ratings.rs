//! The feedback window: the responses kept for rating, the checks a rating must pass, and
//! how accepted ratings become trainable samples (GRPO groups, preference pairs, or
//! REINFORCE with a running-mean baseline). No I/O here: `feedback.rs` logs and replays the
//! ratings.

use super::error::{Result, RlError};
use learner::TrainSample;
use serde::{Deserialize, Serialize};
use std::collections::{HashMap, HashSet, VecDeque};

/// `POST /v1/feedback` body: `{"id", "choice", "reward"}`, `{"id", "preferred"}` or
/// `{"id", "chosen", "rejected"}`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FeedbackRequest {
    /// The response's id (`cmpl-…`, `chatcmpl-…`).
    pub id: String,
    /// The rated choice's index.
    pub choice: Option<usize>,
    /// The choice's reward, in [−1, 1].
    pub reward: Option<f64>,
    /// The preferred choice's index (it gets 1, the others 0).
    pub preferred: Option<usize>,
    /// A preference between two choices: the better one's index (it gets 1)...
    pub chosen: Option<usize>,
    /// ...and the worse one's (it gets 0). The two form one group (a DPO pair) at once.
    pub rejected: Option<usize>,
}

/// One line of `feedback.jsonl`: a rating with the data of every choice of its response
/// (the learner's samples, unscored).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct LogLine {
    pub seq: u64,
    pub id: String,
    /// Rewards set by this rating, by choice index.
    pub ratings: Vec<(usize, f32)>,
    /// A `chosen` / `rejected` preference: the two rated choices are one group, and the
    /// response is then fully rated.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub pair: bool,
    /// The response left the window partly rated: its rated choices become single samples
    /// now, under this line's sequence number (no ratings or choices on this line). Logged,
    /// so the queue of trainable samples is in sequence order and a checkpoint's position
    /// (`feedback_seq`) says exactly which samples its weights hold.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub flush: bool,
    #[serde(default)]
    pub choices: Vec<TrainSample>,
}

/// A response in the window.
struct Kept {
    choices: Vec<TrainSample>,
    /// Sampled at temperature 0: μ is not a sampling probability, so it is not trained on.
    greedy: bool,
    rewards: Vec<Option<f32>>,
    /// Log sequence number of the latest rating.
    seq: u64,
}

/// The window of rateable responses and the samples its ratings made.
#[derive(Default)]
pub(crate) struct Ratings {
    order: VecDeque<String>,
    kept: HashMap<String, Kept>,
    /// Ids evicted from the window (410), and ids whose every choice is rated (409).
    expired: HashSet<String>,
    done: HashSet<String>,
    /// Trainable samples with the log position that made them.
    pub ready: VecDeque<(u64, TrainSample)>,
    pub next_seq: u64,
    next_group: u64,
    baseline: (f64, u64),
    pub accepted: u64,
    pub rejected: u64,
    pub trained: u64,
}

impl Ratings {
    /// An empty window whose first rating gets sequence number 1.
    pub fn new() -> Self {
        Self { next_seq: 1, ..Default::default() }
    }

    /// Keeps a finished response (its choices as unscored samples) for rating; returns the
    /// flush lines of the partly rated responses it pushes out of the window ([`Self::evict`]).
    pub fn register(&mut self, id: String, choices: Vec<TrainSample>, greedy: bool, window: usize) -> Vec<LogLine> {
        let n = choices.len();
        self.push(id, Kept { choices, greedy, rewards: vec![None; n], seq: 0 });
        self.evict(window)
    }

    fn push(&mut self, id: String, kept: Kept) {
        self.order.push_back(id.clone());
        self.kept.insert(id, kept);
    }

    /// Shrinks the window to `window` responses, oldest first (rated again later: 410). An
    /// unrated response is dropped; a partly rated one waits, out of the window, for the
    /// returned flush line (log it, then [`Self::apply`] it) to make its samples.
    pub fn evict(&mut self, window: usize) -> Vec<LogLine> {
        let mut flushes = vec![];
        while self.order.len() > window.max(1) {
            let old = self.order.pop_front().expect("non-empty");
            if self.kept.get(&old).is_some_and(|k| k.rewards.iter().any(Option::is_some)) {
                flushes.push(LogLine {
                    seq: self.next_seq,
                    id: old.clone(),
                    ratings: vec![],
                    pair: false,
                    flush: true,
                    choices: vec![],
                });
                self.next_seq += 1;
            } else {
                self.kept.remove(&old);
            }
            self.expired.insert(old);
        }
        flushes
    }

    /// Checks a rating against the window; the log line that records it (the next sequence
    /// number, the rewards it sets, the response's choices).
    pub fn check(&self, req: &FeedbackRequest) -> Result<LogLine> {
        if self.done.contains(&req.id) {
            return Err(RlError::AlreadyRated(format!("every choice of `{}` is already rated", req.id)));
        }
        if self.expired.contains(&req.id) {
            return Err(RlError::Expired(req.id.clone()));
        }
        let k = self.kept.get(&req.id).ok_or_else(|| {
            RlError::NotFound(format!(
                "unknown response id `{}`: not served by this server, served while feedback learning was off, or \
                 cut off before it finished (a stream the client closed is not kept for rating)",
                req.id
            ))
        })?;
        if k.greedy {
            return Err(RlError::invalid(
                "id",
                format!(
                    "response `{}` was generated greedily (temperature 0): greedy tokens are not on-policy samples \
                     and are not trained on; request with temperature > 0 to rate",
                    req.id
                ),
            ));
        }
        let n = k.choices.len();
        let pair = req.chosen.is_some() || req.rejected.is_some();
        let ratings = match (req.choice, req.reward, req.preferred, req.chosen, req.rejected) {
            (None, None, None, Some(w), Some(l)) => {
                for (key, c) in [("chosen", w), ("rejected", l)] {
                    if c >= n {
                        return Err(RlError::invalid(
                            key,
                            format!("`{key}` {c} is out of range: the response has {n} choice(s)"),
                        ));
                    }
                }
                if w == l {
                    return Err(RlError::invalid(
                        "rejected",
                        format!("`chosen` and `rejected` must be two different choices, got {w} and {l}"),
                    ));
                }
                if k.choices[w].prompt_ids != k.choices[l].prompt_ids {
                    return Err(RlError::invalid(
                        "rejected",
                        format!(
                            "`chosen` {w} and `rejected` {l} answer different prompts of `{}`: a preference pair \
                             is two answers to one prompt",
                            req.id
                        ),
                    ));
                }
                if k.rewards.iter().any(Option::is_some) {
                    return Err(RlError::AlreadyRated(format!("response `{}` already has ratings", req.id)));
                }
                vec![(w, 1.0), (l, 0.0)]
            }
            (Some(c), Some(r), None, None, None) => {
                if c >= n {
                    return Err(RlError::invalid(
                        "choice",
                        format!("`choice` {c} is out of range: the response has {n} choice(s)"),
                    ));
                }
                if !(r.is_finite() && (-1.0..=1.0).contains(&r)) {
                    return Err(RlError::invalid("reward", format!("`reward` must be a number in [-1, 1], got {r}")));
                }
                if k.rewards[c].is_some() {
                    return Err(RlError::AlreadyRated(format!("choice {c} of `{}` is already rated", req.id)));
                }
                vec![(c, r as f32)]
            }
            (None, None, Some(p), None, None) => {
                if n < 2 {
                    return Err(RlError::invalid(
                        "preferred",
                        format!(
                            "response `{}` has one choice: `preferred` picks one of several answers; rate this one \
                             with `choice` and `reward`",
                            req.id
                        ),
                    ));
                }
                if p >= n {
                    return Err(RlError::invalid(
                        "preferred",
                        format!("`preferred` {p} is out of range: the response has {n} choice(s)"),
                    ));
                }
                if k.choices.iter().any(|c| c.prompt_ids != k.choices[0].prompt_ids) {
                    return Err(RlError::invalid(
                        "preferred",
                        format!(
                            "response `{}` answers several prompts: `preferred` picks one of the answers to one \
                             prompt; rate its choices with `choice` and `reward`, or pair two answers to one \
                             prompt with `chosen` and `rejected`",
                            req.id
                        ),
                    ));
                }
                if k.rewards.iter().any(Option::is_some) {
                    return Err(RlError::AlreadyRated(format!("response `{}` already has ratings", req.id)));
                }
                (0..n).map(|i| (i, if i == p { 1.0 } else { 0.0 })).collect()
            }
            _ => {
                return Err(RlError::invalid_input(
                    "give one of: `choice` and `reward`; `preferred` (a choice index); `chosen` and `rejected` \
                     (two choice indices)",
                ))
            }
        };
        Ok(LogLine { seq: self.next_seq, id: req.id.clone(), ratings, pair, flush: false, choices: k.choices.clone() })
    }

    /// Applies a logged line (a rating, from a request or the replay; a flush). Lines at or
    /// before `covered` are already in the checkpoint's weights: they count (and feed the
    /// REINFORCE baseline) but their samples are not queued. The replay keeps every rated
    /// response (no eviction: the flush lines say when the live window pushed one out), then
    /// shrinks the window with [`Self::evict`].
    pub fn apply(&mut self, line: &LogLine, covered: u64) {
        self.next_seq = self.next_seq.max(line.seq + 1);
        let queue = line.seq > covered;
        if line.flush {
            if let Some(mut k) = self.kept.remove(&line.id) {
                self.order.retain(|x| x != &line.id);
                self.expired.insert(line.id.clone());
                k.seq = line.seq;
                self.flush_partial(&k, queue);
            }
            return;
        }
        if !self.kept.contains_key(&line.id) {
            let n = line.choices.len();
            let kept = Kept { choices: line.choices.clone(), greedy: false, rewards: vec![None; n], seq: 0 };
            self.push(line.id.clone(), kept);
        }
        let Some(k) = self.kept.get_mut(&line.id) else { return };
        for &(c, r) in &line.ratings {
            if c < k.rewards.len() {
                k.rewards[c] = Some(r);
            }
        }
        k.seq = line.seq;
        if line.pair {
            // A preference: the two rated choices are one group now; the response is done.
            let k = self.retire(&line.id).expect("present");
            if queue {
                self.next_group += 1;
                for &(c, r) in &line.ratings {
                    if let Some(choice) = k.choices.get(c) {
                        let sample = TrainSample { reward: Some(r), group: Some(self.next_group), ..choice.clone() };
                        self.ready.push_back((k.seq, sample));
                    }
                }
            }
            return;
        }
        let complete = k.rewards.iter().all(Option::is_some);
        let n = k.choices.len();
        if n == 1 || !complete {
            if n == 1 {
                let k = self.retire(&line.id).expect("present");
                self.flush_partial(&k, queue);
            }
            return;
        }
        // One group per prompt (a completions request with several prompts is one
        // response): a group never mixes answers to different prompts; a prompt answered
        // once is a single sample (REINFORCE with the baseline).
        let k = self.retire(&line.id).expect("present");
        let mut prompts: Vec<&[u32]> = Vec::new();
        for c in &k.choices {
            if !prompts.contains(&c.prompt_ids.as_slice()) {
                prompts.push(&c.prompt_ids);
            }
        }
        for p in prompts {
            let of_p = |c: &&TrainSample| c.prompt_ids == p;
            if k.choices.iter().filter(of_p).count() < 2 {
                let single = Kept {
                    choices: k.choices.iter().filter(of_p).cloned().collect(),
                    rewards: k
                        .choices
                        .iter()
                        .zip(&k.rewards)
                        .filter(|(c, _)| c.prompt_ids == p)
                        .map(|(_, r)| *r)
                        .collect(),
                    greedy: false,
                    seq: k.seq,
                };
                self.flush_partial(&single, queue);
                continue;
            }
            if !queue {
                continue;
            }
            self.next_group += 1;
            for (c, r) in k.choices.iter().zip(&k.rewards).filter(|(c, _)| c.prompt_ids == p) {
                let sample = TrainSample { reward: *r, group: Some(self.next_group), ..c.clone() };
                self.ready.push_back((k.seq, sample));
            }
        }
    }

    /// Takes a response out of the window as fully rated.
    fn retire(&mut self, id: &str) -> Option<Kept> {
        let k = self.kept.remove(id);
        self.order.retain(|x| x != id);
        self.done.insert(id.to_string());
        k
    }

    /// Rated choices of a response that will not be completed: REINFORCE with a baseline
    /// (updated by every reward, queued or not; queued when `queue`).
    fn flush_partial(&mut self, k: &Kept, queue: bool) {
        for (c, r) in k.choices.iter().zip(&k.rewards) {
            let Some(r) = *r else { continue };
            let (sum, count) = self.baseline;
            let base = if count == 0 { 0.0 } else { sum / count as f64 };
            self.baseline = (sum + r as f64, count + 1);
            if queue {
                let sample = TrainSample { advantage: Some(r - base as f32), reward: Some(r), ..c.clone() };
                self.ready.push_back((k.seq, sample));
            }
        }
    }

    /// The next batch: at least `batch_size` samples when that many are ready, extended to
    /// whole groups (a group's advantages need all of its samples). With the log position it
    /// covers.
    pub fn next_batch(&self, batch_size: usize) -> Option<(Vec<TrainSample>, u64)> {
        let mut take = batch_size.max(1);
        if self.ready.len() < take {
            return None;
        }
        while take < self.ready.len()
            && self.ready[take].1.group.is_some()
            && self.ready[take].1.group == self.ready[take - 1].1.group
        {
            take += 1;
        }
        let batch = self.ready.iter().take(take);
        let through = batch.clone().map(|(seq, _)| *seq).max().unwrap_or(0);
        Some((batch.map(|(_, s)| s.clone()).collect(), through))
    }

    /// Marks the oldest `n` ready samples as trained.
    pub fn trained(&mut self, n: usize) {
        for _ in 0..n {
            self.ready.pop_front();
        }
        self.trained += n as u64;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(prompt: &[u32]) -> TrainSample {
        TrainSample {
            prompt_ids: prompt.to_vec(),
            completion_ids: vec![7],
            behavior_logprobs: vec![-1.0],
            advantage: None,
            reward: None,
            group: None,
            versions: None,
            finish_reason: None,
        }
    }

    fn req(json: serde_json::Value) -> FeedbackRequest {
        serde_json::from_value(json).unwrap()
    }

    /// A partly rated response pushed out of the window becomes a sample under its flush
    /// line's sequence number, so a checkpoint's `feedback_seq` says exactly whether the
    /// sample is in its weights: a replay covered past the flush queues nothing (and rating
    /// the response again is a 410), one covered only past the rating queues it once; the
    /// REINFORCE baseline counts the reward either way. A log without flush lines (written
    /// before them) keeps the response in the window, as before.
    #[test]
    fn a_flushed_partial_rating_is_trained_once_across_a_restart() {
        let rate = |r: &mut Ratings, choice: usize| {
            let line = r.check(&req(serde_json::json!({"id": "a", "choice": choice, "reward": 1.0}))).unwrap();
            r.apply(&line, 0);
            line
        };
        let mut live = Ratings::new();
        assert!(live.register("a".into(), vec![sample(&[1]), sample(&[1])], false, 1).is_empty());
        let rating = rate(&mut live, 0);
        assert!(live.ready.is_empty(), "one of two choices rated: not a sample yet");
        let flushes = live.register("b".into(), vec![sample(&[2])], false, 1);
        assert_eq!(flushes.iter().map(|l| (l.seq, l.id.as_str(), l.flush)).collect::<Vec<_>>(), [(2, "a", true)]);
        for l in &flushes {
            live.apply(l, 0);
        }
        assert_eq!(live.ready.iter().map(|(seq, s)| (*seq, s.advantage)).collect::<Vec<_>>(), [(2, Some(1.0))]);
        let log: Vec<LogLine> = [&rating, &flushes[0]]
            .iter()
            .map(|l| serde_json::from_str(&serde_json::to_string(l).unwrap()).unwrap())
            .collect();
        let replay = |covered: u64, lines: &[LogLine]| {
            let mut r = Ratings::new();
            for l in lines {
                r.apply(l, covered);
            }
            assert!(r.evict(1).is_empty());
            r
        };
        // Trained and checkpointed through the flush: nothing to train again.
        let r = replay(2, &log);
        assert!(r.ready.is_empty(), "trained before the checkpoint: not queued again");
        assert_eq!((r.baseline, r.next_seq), ((1.0, 1), 3), "the baseline holds the reward");
        assert!(matches!(
            r.check(&req(serde_json::json!({"id": "a", "choice": 1, "reward": 0.0}))),
            Err(RlError::Expired(_))
        ));
        // Checkpointed after the rating but before the flush was trained: queued once.
        let r = replay(1, &log);
        assert_eq!(r.ready.iter().map(|(seq, _)| *seq).collect::<Vec<_>>(), [2]);
        // A log from before flush lines: the response is still in the window, rateable.
        let mut r = replay(1, &log[..1]);
        assert!(r.ready.is_empty());
        rate(&mut r, 1);
        assert_eq!(r.ready.len(), 2, "rated in full: one group of two");
    }

    /// A completions request with two prompts is one response: choices 0, 1 answer prompt A,
    /// choice 2 prompt B. Pairs and `preferred` across prompts are refused naming why; rated
    /// in full, A's answers are one group and B's answer a single sample (REINFORCE: the
    /// baseline is 0 before any single-choice reward, so its advantage is its reward).
    #[test]
    fn groups_and_pairs_never_mix_prompts() {
        let mut r = Ratings::new();
        r.register("x".into(), vec![sample(&[1, 2]), sample(&[1, 2]), sample(&[3])], false, 8);
        let e = r.check(&req(serde_json::json!({"id": "x", "chosen": 0, "rejected": 2}))).unwrap_err();
        assert!(e.to_string().contains("answer different prompts"), "{e}");
        let e = r.check(&req(serde_json::json!({"id": "x", "preferred": 0}))).unwrap_err();
        assert!(e.to_string().contains("answers several prompts"), "{e}");
        assert!(r.check(&req(serde_json::json!({"id": "x", "chosen": 1, "rejected": 0}))).is_ok());
        for (c, reward) in [(0, 1.0), (1, 0.0), (2, 0.5)] {
            let line = r.check(&req(serde_json::json!({"id": "x", "choice": c, "reward": reward}))).unwrap();
            r.apply(&line, 0);
        }
        let got: Vec<_> = r.ready.iter().map(|(_, s)| (s.prompt_ids.clone(), s.group, s.reward, s.advantage)).collect();
        assert_eq!(
            got,
            vec![
                (vec![1, 2], Some(1), Some(1.0), None),
                (vec![1, 2], Some(1), Some(0.0), None),
                (vec![3], None, Some(0.5), Some(0.5)),
            ]
        );
    }
}
