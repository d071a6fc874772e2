//! Direct preference optimisation from preference pairs, with TRL `DPOTrainer` semantics.
//!
//! A pair is a prompt x with a chosen completion y_w and a rejected one y_l. With the
//! policy's log-probabilities `π_w = log π_θ(y_w|x)`, `π_l`, and the frozen reference's
//! `r_w`, `r_l` (the initial weights; each sequence scored once and cached,
//! `Trainer::reference_logprobs`), and `h = (π_w − r_w) − (π_l − r_l)`:
//! - `dpo` (alias `sigmoid`; Rafailov et al. 2023, "Direct Preference Optimization", eq. 7),
//!   with cDPO label smoothing ε (Mitchell 2023, "A note on DPO with noisy preferences"; TRL
//!   `label_smoothing`): `L = −(1 − ε) · log σ(β·h) − ε · log σ(−β·h)`, log-probabilities
//!   summed over the completion's tokens;
//! - `ipo` (Azar et al. 2023, "A General Theoretical Paradigm to Understand Learning from
//!   Human Preferences", eq. 17; TRL `ipo`): `L = (h − 1/(2β))²` with log-probabilities
//!   averaged over the completion's tokens (as TRL).
//!
//! The batch loss is the mean over pairs. Metrics (TRL names): `rewards/chosen` = mean
//! `β(π_w − r_w)`, `rewards/rejected` = mean `β(π_l − r_l)`, `rewards/margins` = their mean
//! difference, `rewards/accuracies` = fraction of pairs whose chosen reward is strictly the
//! larger, `logps/chosen`, `logps/rejected`; and `logps/accuracies`, the fraction of pairs
//! where the policy itself gives the chosen completion the higher log-probability. `kl`
//! (a job's `kl_to_initial`) is the k3 estimate on the chosen completions' tokens only.
//!
//! Pairs come from samples grouped by `group` (a dataset pair is a group of two with rewards
//! 1 and 0; a rated response's choices are one group): every two samples of a group whose
//! rewards differ form a pair, the higher reward chosen (the Bradley–Terry comparisons of a
//! ranking, as InstructGPT's reward model, Ouyang et al. 2022, §3.5).

use crate::algos::grpo::{LossStats, LossType};
use crate::error::{LearnerError, Result};
use crate::trainer::offsets;
use crate::{forward_batch, forward_batch_with, Grads, OutputGrads, StepMetrics, TrainConfig, TrainSample, Trainer};
use engine::Model;
use serde::Serialize;
use std::collections::BTreeMap;
use std::time::Instant;

/// DPO's metrics of one batch (TRL names).
#[derive(Debug, Clone, Default, Serialize, PartialEq)]
pub struct DpoStats {
    /// Mean implicit reward of the chosen completions, `β(π_w − r_w)`.
    #[serde(rename = "rewards/chosen")]
    pub rewards_chosen: f64,
    /// Mean implicit reward of the rejected completions, `β(π_l − r_l)`.
    #[serde(rename = "rewards/rejected")]
    pub rewards_rejected: f64,
    /// Mean of chosen − rejected reward.
    #[serde(rename = "rewards/margins")]
    pub rewards_margins: f64,
    /// Fraction of pairs whose chosen reward is larger (ties count as wrong, as TRL).
    #[serde(rename = "rewards/accuracies")]
    pub rewards_accuracies: f64,
    /// Mean policy log-probability of the chosen completions (summed over tokens; IPO: averaged).
    #[serde(rename = "logps/chosen")]
    pub logps_chosen: f64,
    /// The same for the rejected completions.
    #[serde(rename = "logps/rejected")]
    pub logps_rejected: f64,
    /// Fraction of pairs the policy itself prefers, `π_w > π_l` (no reference: meaningful
    /// before the first step, where every implicit reward is 0).
    #[serde(rename = "logps/accuracies")]
    pub logps_accuracies: f64,
    /// Pairs in the batch.
    pub pairs: usize,
}

/// The preference pairs `(chosen, rejected)` among `samples` (indices into it): within each
/// `group`, every two samples whose rewards differ. Samples without a group or reward form
/// no pair.
pub fn pairs(samples: &[&TrainSample]) -> Vec<(usize, usize)> {
    let mut groups: BTreeMap<u64, Vec<usize>> = BTreeMap::new();
    for (i, s) in samples.iter().enumerate() {
        if let (Some(g), Some(_)) = (s.group, s.reward) {
            groups.entry(g).or_default().push(i);
        }
    }
    let mut out = vec![];
    for members in groups.values() {
        for (a, &i) in members.iter().enumerate() {
            for &j in &members[a + 1..] {
                let (ri, rj) = (samples[i].reward.unwrap(), samples[j].reward.unwrap());
                if ri > rj {
                    out.push((i, j));
                } else if rj > ri {
                    out.push((j, i));
                }
            }
        }
    }
    out
}

/// `log σ(x)`, stable for large |x|.
fn log_sigmoid(x: f64) -> f64 {
    -((-x).max(0.0) + (-x.abs()).exp().ln_1p())
}

fn sigmoid(x: f64) -> f64 {
    1.0 / (1.0 + (-x).exp())
}

/// The DPO/IPO loss (module docs) of `pairs` over sequences with per-token policy `logp` and
/// reference `ref_logp`: `(loss, metrics, dL/dℓ per token of every sequence)`.
pub fn dpo_loss(
    logp: &[&[f32]],
    ref_logp: &[&[f32]],
    pairs: &[(usize, usize)],
    cfg: &TrainConfig,
) -> (f64, DpoStats, Vec<Vec<f32>>) {
    let ipo = cfg.loss_type == LossType::Ipo;
    let (beta, eps) = (cfg.beta as f64, cfg.label_smoothing as f64);
    // Sequence log-probabilities: sums (DPO) or means (IPO), and d(seq)/dℓ_t.
    let scale = |i: usize| if ipo { 1.0 / logp[i].len().max(1) as f64 } else { 1.0 };
    let seq = |v: &[f32], i: usize| v.iter().map(|&x| x as f64).sum::<f64>() * scale(i);
    let mut grads: Vec<Vec<f32>> = logp.iter().map(|l| vec![0.0; l.len()]).collect();
    let n = pairs.len().max(1) as f64;
    let (mut loss, mut st) = (0.0, DpoStats { pairs: pairs.len(), ..Default::default() });
    for &(w, l) in pairs {
        let (pw, pl) = (seq(logp[w], w), seq(logp[l], l));
        let (rw, rl) = (seq(ref_logp[w], w), seq(ref_logp[l], l));
        let h = (pw - rw) - (pl - rl);
        let (lp, dh) = if ipo {
            let d = h - 1.0 / (2.0 * beta);
            (d * d, 2.0 * d)
        } else {
            let x = beta * h;
            let lp = -(1.0 - eps) * log_sigmoid(x) - eps * log_sigmoid(-x);
            (lp, beta * (-(1.0 - eps) * sigmoid(-x) + eps * sigmoid(x)))
        };
        loss += lp / n;
        for (i, sign) in [(w, 1.0), (l, -1.0)] {
            let g = (sign * dh * scale(i) / n) as f32;
            grads[i].iter_mut().for_each(|x| *x += g);
        }
        let (cw, cl) = (beta * (pw - rw), beta * (pl - rl));
        st.rewards_chosen += cw / n;
        st.rewards_rejected += cl / n;
        st.rewards_margins += (cw - cl) / n;
        st.rewards_accuracies += (cw > cl) as u8 as f64 / n;
        st.logps_chosen += pw / n;
        st.logps_rejected += pl / n;
        st.logps_accuracies += (pw > pl) as u8 as f64 / n;
    }
    (loss, st, grads)
}

/// The samples of `batch` that are in some pair, and the pairs re-indexed into them.
fn paired(batch: &[TrainSample]) -> (Vec<&TrainSample>, Vec<(usize, usize)>) {
    let all: Vec<&TrainSample> = batch.iter().collect();
    let p = pairs(&all);
    let mut used: Vec<usize> = p.iter().flat_map(|&(w, l)| [w, l]).collect();
    used.sort_unstable();
    used.dedup();
    let pos = |i: usize| used.binary_search(&i).expect("used");
    let remapped = p.iter().map(|&(w, l)| (pos(w), pos(l))).collect();
    (used.iter().map(|&i| all[i]).collect(), remapped)
}

/// ℓ_ref of the (prompt, completion) sequences the reference has scored: each is computed
/// once (DPO revisits pairs every epoch). Cleared when it holds [`RefCache::CAPACITY`]
/// sequences.
#[derive(Default)]
pub(crate) struct RefCache(std::collections::HashMap<(Vec<u32>, Vec<u32>), Vec<f32>>);

impl RefCache {
    const CAPACITY: usize = 1 << 16;
}

impl Trainer {
    /// ℓ_ref of `seqs` under the frozen reference at the training temperature, each sequence
    /// computed once and cached ([`RefCache`]); only the sequences not seen before go
    /// through the reference forward.
    pub(crate) fn reference_logprobs(&mut self, seqs: &[(&[u32], &[u32])]) -> Result<Vec<Vec<f32>>> {
        let Some(reference) = &self.reference else {
            return Err(LearnerError::Batch("this loss needs the frozen reference weights".into()));
        };
        let cache = &mut self.ref_cache.0;
        let key = |(p, c): &(&[u32], &[u32])| (p.to_vec(), c.to_vec());
        let mut missing: Vec<(&[u32], &[u32])> = vec![];
        for s in seqs {
            if !cache.contains_key(&key(s)) && !missing.contains(s) {
                missing.push(*s);
            }
        }
        if cache.len() + missing.len() > RefCache::CAPACITY {
            cache.clear();
        }
        if !missing.is_empty() {
            let f = forward_batch(reference, &missing, self.config.temperature)?;
            let offsets = offsets(&f.lens);
            for (k, s) in missing.iter().enumerate() {
                cache.insert(key(s), f.logprobs[offsets[k]..offsets[k + 1]].to_vec());
            }
        }
        Ok(seqs.iter().map(|s| cache[&key(s)].clone()).collect())
    }

    /// DPO/IPO on the batch's pairs: one packed forward over every paired sequence, ℓ_ref from
    /// the cache or the reference, the loss and its gradient.
    pub(crate) fn dpo_gradients(&mut self, model: &Model, batch: &[TrainSample]) -> Result<(StepMetrics, Grads)> {
        let t0 = Instant::now();
        let (samples, pairs) = paired(batch);
        if pairs.is_empty() {
            return Err(LearnerError::Batch(
                "no preference pair: loss_type dpo/ipo needs groups of samples with different rewards".into(),
            ));
        }
        let c = self.config.clone();
        let seqs: Vec<(&[u32], &[u32])> =
            samples.iter().map(|s| (s.prompt_ids.as_slice(), s.completion_ids.as_slice())).collect();
        let refs = self.reference_logprobs(&seqs)?;
        let fwd = forward_batch_with(model, &seqs, c.temperature, c.recompute(model))?;
        let o = offsets(&fwd.lens);
        let logp: Vec<&[f32]> = (0..samples.len()).map(|k| &fwd.logprobs[o[k]..o[k + 1]]).collect();
        let ref_logp: Vec<&[f32]> = refs.iter().map(Vec::as_slice).collect();
        let (loss, dpo, dl) = dpo_loss(&logp, &ref_logp, &pairs, &c);
        let dl: Vec<f32> = dl.concat();
        let mut grads = Grads::default();
        fwd.backward(model, &OutputGrads::logprobs(&dl), &mut grads)?;
        // KL to the reference on the chosen completions: the rejected ones are pushed away by
        // design, so their k3 measures the loss at work, not drift.
        let chosen: std::collections::BTreeSet<usize> = pairs.iter().map(|&(w, _)| w).collect();
        let kl = k3(
            &chosen.iter().flat_map(|&k| logp[k].iter().copied()).collect::<Vec<_>>(),
            &chosen.iter().flat_map(|&k| refs[k].iter().copied()).collect::<Vec<_>>(),
        );
        let sel = crate::trainer::Selection {
            kept: batch.iter().enumerate().collect(),
            staleness: vec![],
            stale_dropped: 0,
            truncated_masked: 0,
        };
        let mut m = self.base_metrics(batch, &sel, &fwd, t0);
        m.samples = samples.len();
        m.loss = LossStats { loss, kl, tokens: fwd.logprobs.len(), ..Default::default() };
        m.dpo = Some(dpo);
        m.forward_seconds = fwd.forward_seconds;
        Ok((m, grads))
    }

    /// The DPO loss and metrics of `batch`'s pairs at the current weights, without
    /// gradients (held-out evaluation). Evaluated `chunk` pairs' sequences at a time.
    pub fn evaluate_preferences(&mut self, model: &Model, batch: &[TrainSample]) -> Result<(f64, DpoStats)> {
        let (samples, pairs) = paired(batch);
        let c = self.config.clone();
        let seqs: Vec<(&[u32], &[u32])> =
            samples.iter().map(|s| (s.prompt_ids.as_slice(), s.completion_ids.as_slice())).collect();
        let refs = self.reference_logprobs(&seqs)?;
        let mut logps: Vec<Vec<f32>> = Vec::with_capacity(seqs.len());
        for part in seqs.chunks(16) {
            let f = forward_batch(model, part, c.temperature)?;
            let o = offsets(&f.lens);
            logps.extend((0..part.len()).map(|k| f.logprobs[o[k]..o[k + 1]].to_vec()));
        }
        let logp: Vec<&[f32]> = logps.iter().map(Vec::as_slice).collect();
        let ref_logp: Vec<&[f32]> = refs.iter().map(Vec::as_slice).collect();
        let (loss, st, _) = dpo_loss(&logp, &ref_logp, &pairs, &c);
        Ok((loss, st))
    }
}

/// Mean k3 estimate of KL(π_θ ‖ π_ref) per token (reported as `kl`, as the policy losses;
/// Schulman, "Approximating KL Divergence", 2020).
fn k3(logp: &[f32], ref_logp: &[f32]) -> f64 {
    let n = logp.len().max(1) as f64;
    logp.iter()
        .zip(ref_logp)
        .map(|(&l, &r)| {
            let x = l as f64 - r as f64;
            (-x).exp() + x - 1.0
        })
        .sum::<f64>()
        / n
}
