//! The sampler against hand-derived distributions.

use engine::sampling::{is_greedy_temperature, sample, SampleContext, SamplingParams, GREEDY_EPS};

/// Draws per [`check`]: enough for a chi-square test to see a 2% error in a probability.
const DRAWS: u64 = 10_000;

/// Samples `logits` with `params` for seeds 0..DRAWS; returns, per token, (count, behaviour logprob).
fn draws(logits: &[f32], params: &SamplingParams, output: &[u32]) -> Vec<(usize, Option<f32>)> {
    let mut seen = vec![(0usize, None); logits.len()];
    for seed in 0..DRAWS {
        let ctx = SampleContext { prompt_ids: &[], output_ids: output, eos_token_ids: &[], seed };
        let s = sample(logits, params, &ctx);
        assert!(s.behavior_logprob.is_finite() && s.raw_logprob.is_finite(), "{s:?}");
        let e = &mut seen[s.token as usize];
        e.0 += 1;
        e.1 = Some(s.behavior_logprob);
    }
    seen
}

/// `check(logits, params, expected behaviour probabilities (0 = never drawn))`: every drawn
/// token's μ is ln of its probability, never-drawn tokens are never drawn, and the counts of
/// DRAWS seeded draws pass a chi-square goodness-of-fit test at p = 0.001.
fn check(logits: &[f32], params: SamplingParams, output: &[u32], expected: &[f64]) {
    assert_eq!(expected.len(), logits.len(), "one expected probability per token");
    let got = draws(logits, &params, output);
    let mut chi2 = 0.0;
    for (t, (&want, (count, lp))) in expected.iter().zip(&got).enumerate() {
        if want == 0.0 {
            assert_eq!(*count, 0, "token {t} must never be drawn with {params:?}");
            continue;
        }
        let lp = lp.unwrap_or_else(|| panic!("token {t} (p = {want}) never drawn in {DRAWS} with {params:?}"));
        assert!((lp as f64 - want.ln()).abs() < 1e-5, "token {t}: μ = {lp}, want ln {want} with {params:?}");
        let e = want * DRAWS as f64;
        chi2 += (*count as f64 - e).powi(2) / e;
    }
    // Critical values of χ² at p = 0.001 for 1..=3 degrees of freedom.
    let df = expected.iter().filter(|&&p| p > 0.0).count() - 1;
    if df > 0 {
        let critical = [10.83, 13.82, 16.27][df - 1];
        assert!(
            chi2 < critical,
            "χ² = {chi2:.2} ≥ {critical} ({df} dof): counts {got:?} vs {expected:?} with {params:?}"
        );
    }
}

#[test]
fn truncation_and_temperature_renormalise() {
    let p = [0.5f64, 0.3, 0.2];
    let l: Vec<f32> = p.iter().map(|x| x.ln() as f32).collect();
    let base = SamplingParams::default;
    check(&l, base(), &[], &p);
    // top_p 0.6: 0.5 < 0.6 ≤ 0.8 → keep {0, 1}, renormalised by 0.8.
    check(&l, SamplingParams { top_p: 0.6, ..base() }, &[], &[0.5 / 0.8, 0.3 / 0.8, 0.0]);
    // top_k 2 → the same set.
    check(&l, SamplingParams { top_k: 2, ..base() }, &[], &[0.5 / 0.8, 0.3 / 0.8, 0.0]);
    // min_p 0.5: floor 0.25 → {0, 1}.
    check(&l, SamplingParams { min_p: 0.5, ..base() }, &[], &[0.5 / 0.8, 0.3 / 0.8, 0.0]);
    // top_k 1 → always token 0 with μ = ln 1 = 0.
    check(&l, SamplingParams { top_k: 1, ..base() }, &[], &[1.0, 0.0, 0.0]);
    // T = 0.5: p ∝ p² = (0.25, 0.09, 0.04) / 0.38.
    check(&l, SamplingParams { temperature: 0.5, ..base() }, &[], &[0.25 / 0.38, 0.09 / 0.38, 0.04 / 0.38]);
}

#[test]
fn penalties_follow_vllm() {
    // repetition_penalty 2 on seen tokens {0, 1}: 2 → 1, −1 → −2; 0.5 unseen.
    let l = [2.0f32, -1.0, 0.5];
    let z = 1f64.exp() + (-2f64).exp() + 0.5f64.exp();
    check(
        &l,
        SamplingParams { repetition_penalty: 2.0, ..Default::default() },
        &[0, 1],
        &[1f64.exp() / z, (-2f64).exp() / z, 0.5f64.exp() / z],
    );
    // frequency 0.5, presence 0.1 with outputs [0, 0, 1]: 1 − 1.1, 1 − 0.6, 1.
    let l = [1.0f32, 1.0, 1.0];
    let z = (-0.1f64).exp() + 0.4f64.exp() + 1f64.exp();
    check(
        &l,
        SamplingParams { frequency_penalty: 0.5, presence_penalty: 0.1, ..Default::default() },
        &[0, 0, 1],
        &[(-0.1f64).exp() / z, 0.4f64.exp() / z, 1f64.exp() / z],
    );
}

#[test]
fn logit_bias_comes_before_penalties_and_temperature() {
    let base = SamplingParams::default;
    let p = [0.5f64, 0.3, 0.2];
    let l: Vec<f32> = p.iter().map(|x| x.ln() as f32).collect();
    // + ln 4 on token 2: weights (0.5, 0.3, 0.8) / 1.6; μ is the biased probability.
    let bias = |b: Vec<(u32, f64)>| SamplingParams { logit_bias: b, ..base() };
    check(&l, bias(vec![(2, 4f64.ln())]), &[], &[0.5 / 1.6, 0.3 / 1.6, 0.8 / 1.6]);
    // Before temperature: T = 0.5 squares (0.5, 0.3·2, 0.2) → (0.25, 0.36, 0.04) / 0.65
    // (after it, token 1 would weigh 0.09·2 instead).
    let hot = SamplingParams { temperature: 0.5, ..bias(vec![(1, 2f64.ln())]) };
    check(&l, hot, &[], &[0.25 / 0.65, 0.36 / 0.65, 0.04 / 0.65]);
    // Before the repetition penalty 2 on seen {0, 1}: token 1 is −1 + 2 = 1 > 0, so halved
    // to 0.5 (penalised first it would be −2 + 2 = 0); token 0: 2 / 2; token 2 unseen.
    let rep = SamplingParams { repetition_penalty: 2.0, ..bias(vec![(1, 2.0)]) };
    let w = [1f64.exp(), 0.5f64.exp(), 0.5f64.exp()];
    let z: f64 = w.iter().sum();
    check(&[2.0, -1.0, 0.5], rep, &[0, 1], &[w[0] / z, w[1] / z, w[2] / z]);
    // A repeated id adds up; greedy takes the biased argmax; raw logprobs ignore the bias.
    let ctx = SampleContext { prompt_ids: &[], output_ids: &[], eos_token_ids: &[], seed: 3 };
    let g = sample(&l, &SamplingParams { temperature: 0.0, ..bias(vec![(2, 0.5), (2, 0.5)]) }, &ctx);
    assert_eq!((g.token, g.behavior_logprob), (2, 0.0), "ln 0.2 + 1 > ln 0.5");
    assert!((g.raw_logprob as f64 - 0.2f64.ln()).abs() < 1e-6, "{g:?}");
    let g = sample(&l, &SamplingParams { temperature: 0.0, ..bias(vec![(2, 0.4)]) }, &ctx);
    assert_eq!(g.token, 0, "ln 0.2 + 0.4 < ln 0.5");
    // −100 bans a token for practical purposes.
    check(&l, bias(vec![(0, -100.0)]), &[], &[0.0, 0.6, 0.4]);
}

#[test]
fn greedy_tiny_temperature_and_min_tokens_never_give_nan() {
    let l = [3.0f32, 3.0 - 1e-3, -50.0, f32::NEG_INFINITY];
    for t in [0.0f32, 1e-6, 1e-4, 1e-2] {
        let params = SamplingParams { temperature: t, ..Default::default() };
        let s = sample(&l, &params, &SampleContext { prompt_ids: &[], output_ids: &[], eos_token_ids: &[], seed: 1 });
        assert_eq!(s.token, 0, "T = {t}");
        assert!(s.behavior_logprob.is_finite() && s.behavior_logprob <= 0.0 && s.raw_logprob.is_finite());
        if t == 0.0 {
            assert_eq!(s.behavior_logprob, 0.0, "greedy μ is 0 by definition");
        }
    }
    // min_tokens masks EOS (id 0) while the output is shorter.
    let params = SamplingParams { min_tokens: 2, temperature: 0.0, ..Default::default() };
    let s = sample(&l, &params, &SampleContext { prompt_ids: &[], output_ids: &[5], eos_token_ids: &[0], seed: 1 });
    assert_eq!(s.token, 1);
    // Raw logprob ignores processing: ln softmax(l)[1].
    let z = (3f64).exp() + (3.0f64 - 1e-3).exp() + (-50f64).exp();
    assert!((s.raw_logprob as f64 - ((3.0f64 - 1e-3).exp() / z).ln()).abs() < 1e-6);
}

#[test]
fn greedy_is_one_rule_a_temperature_below_greedy_eps() {
    // Two tied best tokens: a draw picks either with μ = ln ½; greedy takes the first, μ = 0.
    let l = [2.0f32, 2.0, -1.0];
    for t in [0.0, 1e-6, GREEDY_EPS * 0.99] {
        let params = SamplingParams { temperature: t, ..Default::default() };
        assert!(is_greedy_temperature(t) && params.is_greedy(), "T = {t}");
        assert_eq!(draws(&l, &params, &[])[0], (DRAWS as usize, Some(0.0)), "T = {t}: the argmax every time, μ = 0");
    }
    assert!(is_greedy_temperature(f32::NAN), "NaN is never a sampling temperature");
    for t in [GREEDY_EPS, 1e-4] {
        let params = SamplingParams { temperature: t, ..Default::default() };
        assert!(!is_greedy_temperature(t) && !params.is_greedy(), "T = {t}");
        let got = draws(&l, &params, &[]);
        assert!(got[0].0 > 0 && got[1].0 > 0, "T = {t}: a draw between the tied tokens: {got:?}");
        assert!((got[0].1.unwrap() - 0.5f32.ln()).abs() < 1e-6, "T = {t}: {got:?}");
    }
}

#[test]
fn validation_messages_name_parameter_value_and_range() {
    let check = |p: SamplingParams, msg: &str| {
        let e = p.validate().unwrap_err().to_string();
        assert_eq!(e, msg);
    };
    let d = SamplingParams::default;
    check(SamplingParams { temperature: -1.0, ..d() }, "`temperature` must be a finite number >= 0, got -1");
    check(SamplingParams { top_p: 0.0, ..d() }, "`top_p` must be in (0, 1], got 0");
    check(SamplingParams { top_p: 1.5, ..d() }, "`top_p` must be in (0, 1], got 1.5");
    check(SamplingParams { n: 0, ..d() }, "`n` must be in [1, 256], got 0");
    check(SamplingParams { n: 257, ..d() }, "`n` must be in [1, 256], got 257");
    check(SamplingParams { max_tokens: Some(0), ..d() }, "`max_tokens` must be at least 1, got 0");
    check(SamplingParams { top_k: -2, ..d() }, "`top_k` must be -1 (off), 0 (off) or a positive integer, got -2");
    check(SamplingParams { min_p: 1.5, ..d() }, "`min_p` must be in [0, 1], got 1.5");
    check(SamplingParams { presence_penalty: 3.0, ..d() }, "`presence_penalty` must be in [-2, 2], got 3");
    check(SamplingParams { logprobs: Some(21), ..d() }, "`logprobs` must be at most 20, got 21");
    check(
        SamplingParams { logit_bias: vec![(1, 0.0), (2, -100.5)], ..d() },
        "`logit_bias` must be a map of token ids to biases in [-100, 100], got -100.5 (token 2)",
    );
    assert!(SamplingParams { logit_bias: vec![(0, -100.0), (1, 100.0)], ..d() }.validate().is_ok());
    let ids = SamplingParams { stop_token_ids: vec![3, 10], logit_bias: vec![(9, 1.0)], ..d() };
    assert!(ids.validate_ids(11).is_ok());
    let e = ids.validate_ids(10).unwrap_err().to_string();
    assert_eq!(
        e,
        "`stop_token_ids` holds token id 10, which is out of range: the vocabulary has 10 tokens (ids 0..10)"
    );
    let e = ids.validate_ids(9).unwrap_err().to_string();
    assert!(e.starts_with("`stop_token_ids` holds token id 10"), "{e}");
    let e = SamplingParams { logit_bias: vec![(9, 1.0)], ..d() }.validate_ids(9).unwrap_err().to_string();
    assert!(e.starts_with("`logit_bias` holds token id 9, which is out of range"), "{e}");
    assert!(d().validate().is_ok());
}

/// At T = 1 with nothing to process, the sampler reuses the raw row's exponentials as the
/// draw's weights. A zero `logit_bias` leaves every logit as it is but takes the general path
/// (its own pass of `exp((l − max) / T)`): both must draw the same token with the same μ
/// for every seed, and `raw_logprob` must be the learner's formula
/// (`kernels::cpu::logprob::token_logprob`) bitwise (μ rounds to the same f32 here).
#[test]
fn the_shared_exponentials_draw_what_the_general_path_draws() {
    let l: Vec<f32> = (0..4099u64).map(|i| (engine::sampling::splitmix64(i) % 2000) as f32 / 97.0 - 9.0).collect();
    let plain = SamplingParams::default();
    let biased = SamplingParams { logit_bias: vec![(7, 0.0)], ..Default::default() };
    let mut distinct = std::collections::HashSet::new();
    for seed in 0..300 {
        let ctx = SampleContext { prompt_ids: &[], output_ids: &[], eos_token_ids: &[], seed };
        let (a, b) = (sample(&l, &plain, &ctx), sample(&l, &biased, &ctx));
        assert_eq!((a.token, a.behavior_logprob.to_bits()), (b.token, b.behavior_logprob.to_bits()), "seed {seed}");
        let want = kernels::cpu::logprob::token_logprob(&l, a.token as usize, 1.0);
        assert_eq!(a.raw_logprob.to_bits(), want.to_bits(), "seed {seed}: raw_logprob");
        assert_eq!(a.behavior_logprob.to_bits(), want.to_bits(), "seed {seed}: μ = ℓ at T = 1, untruncated");
        distinct.insert(a.token);
    }
    assert!(distinct.len() > 50, "the draws spread over the vocabulary: {} distinct", distinct.len());
}
