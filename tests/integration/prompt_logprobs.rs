//! Prompt log-probabilities and the prefix cache. A request with `prompt_logprobs` never
//! reads cached blocks (it computes every prompt position) but its blocks are cached for
//! others: its values are bitwise the same with the cache on or off, before or after a
//! request that filled the cache, batched with it, or repeated; and a request that reuses
//! its blocks gets the outputs of a cold run.

use engine::outputs::{PromptLogprob, SeqOutput, TokenOutput};
use engine::{EngineConfig, LLMEngine, Model, SamplingParams, SharedModel, Tokenizer};
use kernels::Device;
use std::collections::BTreeMap;
use std::sync::Arc;
use tests::temp_dir;
use tests::tiny::TinySpec;

/// Per request id: its output tokens and its prompt log-probabilities (sample 0).
type Got = BTreeMap<String, (Vec<TokenOutput>, Vec<PromptLogprob>)>;

/// Runs `(id, prompt, params)` submitted together; the prefix-cache hits they made.
fn run(e: &mut LLMEngine, reqs: &[(&str, &[u32], SamplingParams)], got: &mut Got) -> u64 {
    let hits = e.stats().prefix_cache_hits;
    for (id, p, params) in reqs {
        e.add_request(id, p.to_vec(), params.clone()).unwrap();
    }
    while e.has_unfinished() {
        for o in e.step().unwrap() {
            let SeqOutput { request_id, index, tokens, prompt_logprobs, .. } = o;
            let g = got.entry(request_id).or_default();
            if index == 0 {
                g.0.extend(tokens);
                g.1.extend(prompt_logprobs.into_iter().flatten());
            }
        }
    }
    assert_eq!(e.num_free_blocks(), e.stats().num_blocks, "KV blocks leaked");
    e.stats().prefix_cache_hits - hits
}

#[test]
fn prompt_logprobs_are_identical_with_the_cache_on_off_and_in_any_order() {
    let dir = temp_dir("prompt-logprobs-tiny");
    TinySpec { architecture: "Qwen2ForCausalLM", seed: 61, ..Default::default() }.write(&dir);
    let m = SharedModel::new(Model::load(&dir, &Device::Cpu).unwrap());
    let tok = Arc::new(Tokenizer::from_dir(&dir).unwrap());
    let new = |cache: bool| {
        let cfg =
            EngineConfig { block_size: 4, num_blocks: Some(64), enable_prefix_caching: cache, ..Default::default() };
        LLMEngine::new(m.clone(), tok.clone(), cfg).unwrap()
    };
    let prompt: Vec<u32> = (0..30).map(|i| (i * 7 % 250) as u32).collect();
    let plain = SamplingParams {
        temperature: 0.0,
        max_tokens: Some(4),
        ignore_eos: true,
        logprobs: Some(2),
        ..Default::default()
    };
    let with_pl = SamplingParams { prompt_logprobs: Some(2), ..plain.clone() };
    let full: u64 = 28; // (30 − 1) / 4 = 7 full blocks of 4 tokens reusable

    // Reference: the cache off.
    let mut reference = Got::new();
    run(&mut new(false), &[("pl", &prompt, with_pl.clone()), ("plain", &prompt, plain.clone())], &mut reference);
    let (ref_out, ref_pl) = reference["pl"].clone();
    assert_eq!(ref_pl.len(), prompt.len(), "one entry per prompt token");
    assert!(ref_pl[0].logprob.is_none() && ref_pl[1..].iter().all(|p| p.logprob.is_some_and(|l| l < 0.0)));
    assert!(ref_pl[1..].iter().all(|p| p.top_logprobs.len() == 2));
    let check = |got: &Got, id: &str, what: &str| {
        assert_eq!(got[id].1, ref_pl, "{what}: prompt logprobs");
        assert_eq!(got[id].0, ref_out, "{what}: outputs");
    };

    // The cache filled by a plain request first: the prompt-logprobs request reads nothing.
    let mut e = new(true);
    let mut got = Got::new();
    assert_eq!(run(&mut e, &[("plain", &prompt, plain.clone())], &mut got), 0);
    assert_eq!(run(&mut e, &[("pl", &prompt, with_pl.clone())], &mut got), 0, "never reads the cache");
    check(&got, "pl", "after a plain request");
    // Repeated: still computed, still the same.
    let mut again = Got::new();
    assert_eq!(run(&mut e, &[("pl", &prompt, with_pl.clone())], &mut again), 0);
    check(&again, "pl", "repeated");
    // A plain request reuses the blocks a prompt-logprobs request wrote, with a cold run's outputs.
    let mut e = new(true);
    let mut got = Got::new();
    assert_eq!(run(&mut e, &[("pl", &prompt, with_pl.clone())], &mut got), 0);
    assert_eq!(run(&mut e, &[("plain", &prompt, plain.clone())], &mut got), full, "its blocks are cached");
    check(&got, "pl", "first");
    assert_eq!(got["plain"].0, reference["plain"].0, "outputs over cached blocks = cold");
    // Submitted together in either order, and with n = 3 (samples 1 and 2 reuse sample 0's
    // blocks once its prompt is computed and copy its partial last block; only sample 0
    // reports prompt logprobs).
    for order in [["pl", "plain"], ["plain", "pl"]] {
        let mut got = Got::new();
        let reqs: Vec<(&str, &[u32], SamplingParams)> = order
            .iter()
            .map(|&id| (id, prompt.as_slice(), if id == "pl" { with_pl.clone() } else { plain.clone() }))
            .collect();
        run(&mut new(true), &reqs, &mut got);
        check(&got, "pl", &format!("together, {order:?}"));
    }
    let mut got = Got::new();
    let hits = run(&mut new(true), &[("pl", &prompt, SamplingParams { n: 3, ..with_pl.clone() })], &mut got);
    assert_eq!(hits, 2 * (full + 1), "the two siblings reuse sample 0's blocks and its tail (position 28)");
    check(&got, "pl", "n = 3");
}
