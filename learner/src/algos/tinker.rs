//! The built-in losses of the Tinker training API (`loss_fn` of `forward_backward`), on
//! per-token learner logprobs. Tinker defines each as a **sum** over every token of every
//! datum (no normalisation, no KL term), minimised by `optim_step` (Thinking Machines'
//! Tinker docs, "Losses"; tinker-cookbook `docs/losses.mdx`). Per target token t: `ℓ_t` the
//! learner's logprob (temperature 1), `q_t` the sampler's logprob sent by the client (never
//! recomputed), `A_t` the advantage, `w_t` the weight, `r_t = exp(ℓ_t − q_t)`:
//!
//! | `loss_fn` | loss | `dL/dℓ_t` |
//! | --- | --- | --- |
//! | `cross_entropy` | `Σ −w_t ℓ_t` | `−w_t` |
//! | `importance_sampling` | `Σ −r_t A_t` | `−r_t A_t` |
//! | `ppo` | `Σ −min(r_t A_t, clip(r_t, lo, hi) A_t)` | `−r_t A_t`, 0 where the clipped term is the smaller |
//! | `cispo` | `Σ −sg(clip(r_t, lo, hi)) ℓ_t A_t` (MiniMax-M1, eq. 4) | `−clip(r_t, lo, hi) A_t` |
//! | `dro` | `Σ −(ℓ_t A_t − ½β (ℓ_t − q_t)²)` | `−(A_t − β(ℓ_t − q_t))` |
//!
//! `lo`/`hi` are `loss_fn_config`'s `clip_low_threshold`/`clip_high_threshold`, absolute ratio
//! bounds (default 0.8 and 1.2: Tinker's fixed ε = 0.2); `dro` needs `beta`.

use crate::{forward_batch, Grads, OutputGrads, Result};
use engine::Model;
use std::collections::BTreeMap;

/// One of Tinker's built-in losses with its settings.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum TinkerLoss {
    CrossEntropy,
    ImportanceSampling,
    Ppo { clip_low: f64, clip_high: f64 },
    Cispo { clip_low: f64, clip_high: f64 },
    Dro { beta: f64 },
}

/// The losses `loss_fn` may name.
pub const SUPPORTED: &str = "cross_entropy, importance_sampling, ppo, cispo, dro";

/// A datum's per-token inputs (`loss_fn_inputs`), each as long as its targets.
#[derive(Debug, Clone, Copy, Default)]
pub struct TokenInputs<'a> {
    /// `weights` (cross_entropy).
    pub weights: Option<&'a [f32]>,
    /// `logprobs`: the sampler's, `q_t`.
    pub sampler_logprobs: Option<&'a [f32]>,
    /// `advantages`.
    pub advantages: Option<&'a [f32]>,
}

impl TinkerLoss {
    /// The loss `name` with `config` (`loss_fn_config`). Errors name the loss or key: an
    /// unknown loss (listing [`SUPPORTED`]), a config key the loss does not take, a missing
    /// `beta` for `dro`, or clip bounds outside `0 < lo ≤ 1 ≤ hi`.
    pub fn new(name: &str, config: &BTreeMap<String, f64>) -> std::result::Result<Self, String> {
        let allowed: &[&str] = match name {
            "ppo" | "cispo" => &["clip_low_threshold", "clip_high_threshold"],
            "dro" => &["beta"],
            "cross_entropy" | "importance_sampling" => &[],
            "stable_reinforce" | "gspo" | "custom" => {
                return Err(format!(
                    "loss_fn `{name}` is not supported by rlserve; the supported losses are {SUPPORTED} (a custom \
                     loss runs on the client with forward_backward_custom, which needs only cross_entropy)"
                ))
            }
            _ => return Err(format!("unknown loss_fn `{name}`; the supported losses are {SUPPORTED}")),
        };
        if let Some(k) = config.keys().find(|k| !allowed.contains(&k.as_str())) {
            return Err(format!(
                "loss_fn_config key `{k}` is not a setting of `{name}` (it takes {})",
                if allowed.is_empty() { "none".to_string() } else { allowed.join(", ") }
            ));
        }
        let clip = || -> std::result::Result<(f64, f64), String> {
            let lo = config.get("clip_low_threshold").copied().unwrap_or(0.8);
            let hi = config.get("clip_high_threshold").copied().unwrap_or(1.2);
            if !(lo > 0.0 && lo <= 1.0 && hi >= 1.0 && hi.is_finite()) {
                return Err(format!(
                    "loss_fn_config: clip_low_threshold {lo} and clip_high_threshold {hi} must satisfy 0 < low ≤ 1 ≤ \
                     high (they bound the ratio exp(ℓ − q))"
                ));
            }
            Ok((lo, hi))
        };
        Ok(match name {
            "cross_entropy" => Self::CrossEntropy,
            "importance_sampling" => Self::ImportanceSampling,
            "ppo" => clip().map(|(clip_low, clip_high)| Self::Ppo { clip_low, clip_high })?,
            "cispo" => clip().map(|(clip_low, clip_high)| Self::Cispo { clip_low, clip_high })?,
            _ => match config.get("beta") {
                Some(&beta) if beta.is_finite() && beta >= 0.0 => Self::Dro { beta },
                Some(beta) => return Err(format!("loss_fn_config: `beta` {beta} must be a finite number ≥ 0")),
                None => return Err("loss_fn `dro` needs `beta` in loss_fn_config".into()),
            },
        })
    }

    /// The `loss_fn_inputs` keys the loss reads, besides `target_tokens`.
    pub fn input_keys(&self) -> &'static [&'static str] {
        match self {
            Self::CrossEntropy => &["weights"],
            _ => &["logprobs", "advantages"],
        }
    }

    /// The loss summed over the tokens of one datum and `dL/dℓ_t` per token (module table),
    /// `lp` the learner's logprobs `[T]`. Errors when an input the loss needs is missing or
    /// not `T` long.
    pub fn loss(&self, lp: &[f32], x: &TokenInputs) -> std::result::Result<(f64, Vec<f32>), String> {
        let n = lp.len();
        let need = |name: &str, v: Option<&'_ [f32]>| -> std::result::Result<Vec<f64>, String> {
            match v {
                Some(v) if v.len() == n => Ok(v.iter().map(|&x| x as f64).collect()),
                Some(v) => Err(format!("loss_fn_inputs `{name}` has {} values for {n} target tokens", v.len())),
                None => Err(format!("loss_fn_inputs needs `{name}`")),
            }
        };
        let lp64: Vec<f64> = lp.iter().map(|&x| x as f64).collect();
        let per_token: Vec<(f64, f64)> = match *self {
            Self::CrossEntropy => {
                let w = need("weights", x.weights)?;
                lp64.iter().zip(&w).map(|(l, w)| (-w * l, -w)).collect()
            }
            _ => {
                let (q, a) = (need("logprobs", x.sampler_logprobs)?, need("advantages", x.advantages)?);
                (0..n)
                    .map(|t| {
                        let (l, q, a) = (lp64[t], q[t], a[t]);
                        let r = (l - q).exp();
                        match *self {
                            Self::ImportanceSampling => (-r * a, -r * a),
                            Self::Ppo { clip_low, clip_high } => {
                                let clipped = r.clamp(clip_low, clip_high) * a;
                                if clipped < r * a {
                                    (-clipped, 0.0)
                                } else {
                                    (-r * a, -r * a)
                                }
                            }
                            Self::Cispo { clip_low, clip_high } => {
                                let c = r.clamp(clip_low, clip_high);
                                (-c * l * a, -c * a)
                            }
                            Self::Dro { beta } => (-(l * a - 0.5 * beta * (l - q).powi(2)), -(a - beta * (l - q))),
                            Self::CrossEntropy => unreachable!("handled above"),
                        }
                    })
                    .collect()
            }
        };
        Ok((per_token.iter().map(|p| p.0).sum(), per_token.iter().map(|p| p.1 as f32).collect()))
    }
}

/// One Tinker datum: the model reads `model_input` `[T]` and position `i` predicts
/// `target_tokens[i]`, which must be `model_input[i + 1]` for `i < T − 1` (the next-token
/// alignment every Tinker client uses; the last target is free).
#[derive(Debug, Clone, Default)]
pub struct Datum {
    pub model_input: Vec<u32>,
    pub target_tokens: Vec<u32>,
    pub weights: Option<Vec<f32>>,
    pub sampler_logprobs: Option<Vec<f32>>,
    pub advantages: Option<Vec<f32>>,
}

impl Datum {
    fn inputs(&self) -> TokenInputs<'_> {
        TokenInputs {
            weights: self.weights.as_deref(),
            sampler_logprobs: self.sampler_logprobs.as_deref(),
            advantages: self.advantages.as_deref(),
        }
    }
}

/// What [`forward_backward`] returns: the loss summed over every datum and token, and each
/// datum's learner logprobs of its targets (`[T]`, temperature 1).
#[derive(Debug, Clone)]
pub struct Output {
    pub loss: f64,
    pub logprobs: Vec<Vec<f32>>,
}

/// Tinker's `forward_backward` (and, with `grads` `None`, `forward`): one packed forward of
/// every datum at temperature 1, the loss of each, and the gradient of their sum added to
/// `grads` (accumulated until the optimizer step).
///
/// Errors: a datum that is empty, whose targets are not its input shifted by one, or whose
/// inputs the loss cannot read ([`TinkerLoss::loss`]), as `LearnerError::Batch` naming the
/// datum; nothing is added to `grads` then.
pub fn forward_backward(model: &Model, data: &[Datum], loss: &TinkerLoss, grads: Option<&mut Grads>) -> Result<Output> {
    let bad = |i: usize, m: String| crate::LearnerError::Batch(format!("datum {i}: {m}"));
    for (i, d) in data.iter().enumerate() {
        let n = d.model_input.len();
        if n == 0 || d.target_tokens.len() != n {
            return Err(bad(
                i,
                format!("{} target_tokens for {n} model_input tokens (need as many, ≥ 1)", d.target_tokens.len()),
            ));
        }
        if let Some(j) = (0..n - 1).find(|&j| d.target_tokens[j] != d.model_input[j + 1]) {
            return Err(bad(
                i,
                format!(
                    "target_tokens[{j}] = {} but model_input[{}] = {}: targets must be the input shifted by one                      (target_tokens[i] = model_input[i + 1])",
                    d.target_tokens[j],
                    j + 1,
                    d.model_input[j + 1]
                ),
            ));
        }
    }
    if data.is_empty() {
        return Ok(Output { loss: 0.0, logprobs: vec![] });
    }
    // The first input token is the prompt, the targets the completion: the learner's packed
    // rows are then exactly `model_input`, and its predictions the targets.
    let seqs: Vec<(&[u32], &[u32])> = data.iter().map(|d| (&d.model_input[..1], d.target_tokens.as_slice())).collect();
    let fwd = forward_batch(model, &seqs, 1.0)?;
    let (mut total, mut dl, mut logprobs, mut start) = (0.0, Vec::with_capacity(fwd.logprobs.len()), vec![], 0);
    for (i, d) in data.iter().enumerate() {
        let lp = &fwd.logprobs[start..start + d.target_tokens.len()];
        let (l, g) = loss.loss(lp, &d.inputs()).map_err(|m| bad(i, m))?;
        total += l;
        dl.extend(g);
        logprobs.push(lp.to_vec());
        start += d.target_tokens.len();
    }
    if let Some(grads) = grads {
        fwd.backward(model, &OutputGrads::logprobs(&dl), grads)?;
    }
    Ok(Output { loss: total, logprobs })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn loss(name: &str, config: &[(&str, f64)]) -> std::result::Result<TinkerLoss, String> {
        TinkerLoss::new(name, &config.iter().map(|(k, v)| (k.to_string(), *v)).collect())
    }

    /// Each loss and its derivative on hand-computed tokens; the derivatives also agree with
    /// central finite differences of the loss in ℓ (except cispo's, whose clipped ratio is
    /// detached by definition: its derivative is not the loss's).
    #[test]
    fn losses_match_hand_values_and_finite_differences() {
        let lp = [-1.0f32, -0.5, -2.0];
        let q = [-1.2f32, -0.2, -2.0];
        let a = [1.0f32, -2.0, 0.5];
        let w = [1.0f32, 0.0, 2.0];
        let x = TokenInputs { weights: Some(&w), sampler_logprobs: Some(&q), advantages: Some(&a) };
        let r: Vec<f64> = (0..3).map(|t| ((lp[t] - q[t]) as f64).exp()).collect();
        // r = [e^0.2, e^-0.3, 1] = [1.2214, 0.7408, 1].
        let check = |l: TinkerLoss, want_loss: f64, want_d: [f64; 3]| {
            let (got, d) = l.loss(&lp, &x).unwrap();
            assert!((got - want_loss).abs() < 1e-6, "{l:?}: loss {got} vs {want_loss}");
            for t in 0..3 {
                assert!((d[t] as f64 - want_d[t]).abs() < 1e-5, "{l:?}: d[{t}] {} vs {}", d[t], want_d[t]);
                let h = 1e-3f32;
                let at = |dx: f32| {
                    let mut p = lp;
                    p[t] += dx;
                    l.loss(&p, &x).unwrap().0
                };
                if matches!(l, TinkerLoss::Cispo { .. }) {
                    continue;
                }
                let fd = (at(h) - at(-h)) / (2.0 * h as f64);
                // Away from a clip boundary the loss is smooth in ℓ_t.
                assert!((fd - d[t] as f64).abs() < 2e-3, "{l:?}: d[{t}] {} vs finite difference {fd}", d[t]);
            }
        };
        check(TinkerLoss::CrossEntropy, 1.0 + 4.0, [-1.0, 0.0, -2.0]);
        check(TinkerLoss::ImportanceSampling, -(r[0] - 2.0 * r[1] + 0.5), [-r[0], 2.0 * r[1], -0.5]);
        // ppo at 0.8/1.2: token 0 (A > 0, r = 1.2214 > 1.2) takes the clipped term, no gradient;
        // token 1 (A < 0, r = 0.7408 < 0.8): min(−1.4816, −1.6) = −1.6, clipped, no gradient.
        let ppo = loss("ppo", &[]).unwrap();
        check(ppo, -(1.2 - 1.6 + 0.5), [0.0, 0.0, -0.5]);
        // Wider bounds clip nothing: the importance-sampling loss.
        let wide = loss("ppo", &[("clip_low_threshold", 0.5), ("clip_high_threshold", 2.0)]).unwrap();
        check(wide, -(r[0] - 2.0 * r[1] + 0.5), [-r[0], 2.0 * r[1], -0.5]);
        // cispo: −Σ clip(r) ℓ A with clip(r) = [1.2, 0.8, 1].
        let cispo = loss("cispo", &[]).unwrap();
        // Σ clip(r)·ℓ·A = 1.2·(−1)·1 + 0.8·(−0.5)·(−2) + 1·(−2)·0.5.
        check(cispo, -(-1.2 + 0.8 - 1.0), [-1.2, 1.6, -0.5]);
        // dro, β = 0.5: −Σ (ℓA − ¼(ℓ − q)²), ℓ − q = [0.2, −0.3, 0].
        let dro = loss("dro", &[("beta", 0.5)]).unwrap();
        let want = -((-1.0 - 0.25 * 0.04) + (1.0 - 0.25 * 0.09) + (-1.0));
        check(dro, want, [-(1.0 - 0.1), -(-2.0 + 0.15), -0.5]);
    }

    #[test]
    fn bad_losses_and_inputs_are_named() {
        type Case<'a> = (&'a str, &'a [(&'a str, f64)], &'a str);
        let cases: [Case; 6] = [
            ("gspo", &[], "loss_fn `gspo` is not supported by rlserve"),
            ("kl", &[], "unknown loss_fn `kl`; the supported losses are cross_entropy, importance_sampling, ppo"),
            ("ppo", &[("beta", 0.1)], "loss_fn_config key `beta` is not a setting of `ppo`"),
            ("ppo", &[("clip_low_threshold", 1.1)], "clip_low_threshold 1.1 and clip_high_threshold 1.2 must satisfy"),
            ("dro", &[], "loss_fn `dro` needs `beta` in loss_fn_config"),
            ("cross_entropy", &[("beta", 0.1)], "it takes none"),
        ];
        for (name, config, want) in cases {
            let e = loss(name, config).unwrap_err();
            assert!(e.contains(want), "{name}: {e}");
        }
        let l = loss("importance_sampling", &[]).unwrap();
        let e = l.loss(&[-1.0, -2.0], &TokenInputs { sampler_logprobs: Some(&[-1.0]), ..Default::default() });
        assert_eq!(e.unwrap_err(), "loss_fn_inputs `logprobs` has 1 values for 2 target tokens");
        let e = l.loss(&[-1.0], &TokenInputs { sampler_logprobs: Some(&[-1.0]), ..Default::default() });
        assert_eq!(e.unwrap_err(), "loss_fn_inputs needs `advantages`");
    }
}
