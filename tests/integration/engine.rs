//! The serving engine: paged attention vs dense, batch invariance, preemption, prefix
//! caching, stop strings, n > 1, logprobs vs the llama.cpp fixture, validation, leaks, and
//! a failing forward pass (its requests fail, the others go on).

use engine::outputs::{FinishReason, SeqOutput, StopReason};
use engine::{
    ChatMessage, EngineConfig, EngineHandle, LLMEngine, Model, SamplingParams, SharedModel, Tokenizer, ValidationError,
};
use kernels::{ops, Device, Tensor};
use std::collections::BTreeMap;
use std::sync::{Arc, OnceLock};
use tests::tiny::TinySpec;
use tests::{default_model, temp_dir};

/// Everything one sample produced.
#[derive(Debug, Clone, Default, PartialEq)]
struct Sample {
    tokens: Vec<u32>,
    text: String,
    raw: Vec<f32>,
    behavior: Vec<f32>,
    finish: Option<FinishReason>,
    stop_reason: Option<StopReason>,
}

fn collect(outputs: impl IntoIterator<Item = SeqOutput>, into: &mut BTreeMap<(String, usize), Sample>) {
    for o in outputs {
        let s = into.entry((o.request_id.clone(), o.index)).or_default();
        for t in &o.tokens {
            s.tokens.push(t.token_id);
            s.raw.push(t.raw_logprob);
            s.behavior.push(t.behavior_logprob);
        }
        s.text.push_str(&o.text);
        s.finish = o.finish_reason.or(s.finish);
        s.stop_reason = o.stop_reason.or(s.stop_reason.take());
    }
}

/// Runs `requests` to completion on one engine; asserts no KV block leaked.
fn run(engine: &mut LLMEngine, requests: &[(Vec<u32>, SamplingParams)]) -> Vec<Vec<Sample>> {
    for (i, (p, params)) in requests.iter().enumerate() {
        engine.add_request(&format!("r{i}"), p.clone(), params.clone()).unwrap();
    }
    let mut got = BTreeMap::new();
    while engine.has_unfinished() {
        collect(engine.step().unwrap(), &mut got);
    }
    assert_eq!(engine.num_free_blocks(), engine.stats().num_blocks, "KV blocks leaked");
    requests
        .iter()
        .enumerate()
        .map(|(i, (_, params))| (0..params.n).map(|j| got.remove(&(format!("r{i}"), j)).unwrap_or_default()).collect())
        .collect()
}

fn tiny(seed: u64) -> (SharedModel, Arc<Tokenizer>) {
    let dir = temp_dir(&format!("engine-tiny-{seed}"));
    TinySpec { architecture: "Qwen2ForCausalLM", seed, ..Default::default() }.write(&dir);
    (SharedModel::new(Model::load(&dir, &Device::Cpu).unwrap()), Arc::new(Tokenizer::from_dir(&dir).unwrap()))
}

fn real() -> &'static (SharedModel, Arc<Tokenizer>) {
    static M: OnceLock<(SharedModel, Arc<Tokenizer>)> = OnceLock::new();
    M.get_or_init(|| {
        let dir = default_model();
        (SharedModel::new(Model::load(&dir, &Device::Cpu).unwrap()), Arc::new(Tokenizer::from_dir(&dir).unwrap()))
    })
}

fn engine(m: &(SharedModel, Arc<Tokenizer>), cfg: EngineConfig) -> LLMEngine {
    LLMEngine::new(m.0.clone(), m.1.clone(), cfg).unwrap()
}

fn greedy(max_tokens: usize) -> SamplingParams {
    SamplingParams { temperature: 0.0, max_tokens: Some(max_tokens), ignore_eos: true, ..Default::default() }
}

#[test]
fn paged_attention_with_odd_chunks_equals_dense() {
    let m = tiny(41);
    let prompts: Vec<Vec<u32>> = vec![
        (0..37).map(|i| (i * 7 % 250) as u32).collect(),
        (0..23).map(|i| (i * 13 % 250) as u32).collect(),
        vec![3, 1, 4],
    ];
    // block_size 4 and 7-token steps: prompts cross many blocks and are prefilled in odd chunks.
    let mut e = engine(
        &m,
        EngineConfig { block_size: 4, num_blocks: Some(64), max_num_batched_tokens: 7, ..Default::default() },
    );
    let got = run(&mut e, &prompts.iter().map(|p| (p.clone(), greedy(9))).collect::<Vec<_>>());
    let model = m.0.read();
    for (p, g) in prompts.iter().zip(&got) {
        // The dense reference: the contiguous cache, one token per forward, argmax.
        let mut cache = model.new_cache(p.len() + 9).unwrap();
        let mut dense = vec![];
        let mut logits = model.forward(p, &mut cache, false).unwrap();
        for _ in 0..9 {
            dense.push(engine::sampling::argmax(logits.as_slice().unwrap()) as u32);
            logits = model.forward(&dense[dense.len() - 1..], &mut cache, false).unwrap();
        }
        assert_eq!(g[0].tokens, dense);
        let all: Vec<u32> = p.iter().chain(&dense).cloned().collect();
        let lp =
            ops::log_softmax(&model.forward(&all, &mut model.new_cache(all.len()).unwrap(), true).unwrap()).unwrap();
        let v = model.config.vocab_size;
        for (i, &t) in dense.iter().enumerate() {
            let want = lp.as_slice().unwrap()[(p.len() - 1 + i) * v + t as usize];
            assert!((g[0].raw[i] - want).abs() < 1e-5, "step {i}: {} vs dense {want}", g[0].raw[i]);
        }
    }
}

/// 32 mixed-length requests: the first 8 are checked, greedy and seeded alternating.
fn mixed_requests() -> Vec<(Vec<u32>, SamplingParams)> {
    (0..32u32)
        .map(|i| {
            let prompt: Vec<u32> = (0..(5 + (i * 11) % 40)).map(|j| 200 + (i * 97 + j * 31) % 20000).collect();
            let params = if i % 2 == 0 {
                greedy(6 + (i as usize % 5))
            } else {
                SamplingParams {
                    temperature: 0.9,
                    top_p: 0.95,
                    seed: Some(i as u64),
                    max_tokens: Some(8),
                    ignore_eos: true,
                    ..Default::default()
                }
            };
            (prompt, params)
        })
        .collect()
}

#[test]
fn outputs_are_identical_alone_batched_and_after_preemption() {
    let m = real();
    let reqs = mixed_requests();
    let alone: Vec<Vec<Sample>> = reqs[..8]
        .iter()
        .map(|r| {
            run(&mut engine(m, EngineConfig { num_blocks: Some(64), ..Default::default() }), std::slice::from_ref(r))
                .remove(0)
        })
        .collect();
    let batched = run(&mut engine(m, EngineConfig { num_blocks: Some(256), ..Default::default() }), &reqs);
    // A tiny pool (15 blocks of 16 tokens) forces preemption by recompute; it is also
    // written at start (`kv_cache_prefault`), which must change nothing.
    let mut small = engine(m, EngineConfig { num_blocks: Some(15), kv_cache_prefault: true, ..Default::default() });
    let preempted = run(&mut small, &reqs);
    assert!(small.stats().num_preemptions > 0, "the small pool must preempt");
    for i in 0..8 {
        assert_eq!(alone[i][0].tokens, batched[i][0].tokens, "request {i}: alone vs batch of 32");
        assert_eq!(alone[i][0].raw, batched[i][0].raw, "request {i}: logprobs alone vs batch of 32");
        assert_eq!(alone[i][0].tokens, preempted[i][0].tokens, "request {i}: alone vs preempted");
        assert_eq!(alone[i][0].behavior, preempted[i][0].behavior, "request {i}: μ alone vs preempted");
    }
}

#[test]
fn prefix_cache_hits_match_a_cold_run_and_are_salted_by_version() {
    let m = tiny(42);
    let prompt: Vec<u32> = (0..30).map(|i| (i * 5 % 250) as u32).collect();
    let mut e = engine(&m, EngineConfig { block_size: 4, num_blocks: Some(64), ..Default::default() });
    let params = SamplingParams { logprobs: Some(3), ..greedy(5) };
    let cold = run(&mut e, &[(prompt.clone(), params.clone())]);
    let hits0 = e.stats().prefix_cache_hits;
    let warm = run(&mut e, &[(prompt.clone(), params.clone())]);
    let s = e.stats();
    // (30 − 1) / 4 = 7 full blocks reused.
    assert_eq!(s.prefix_cache_hits - hits0, 28);
    assert_eq!(cold, warm);
    m.0.write().version += 1;
    let after = run(&mut e, &[(prompt, params)]);
    assert_eq!(e.stats().prefix_cache_hits, s.prefix_cache_hits, "no reuse across versions");
    assert_eq!(after, cold);
}

#[test]
fn a_group_of_n_pays_for_one_prefill() {
    let m = tiny(43);
    let prompt: Vec<u32> = (0..101).map(|i| (i * 3 % 250) as u32).collect();
    let params = SamplingParams {
        n: 8,
        seed: Some(5),
        max_tokens: Some(6),
        ignore_eos: true,
        logprobs: Some(2),
        ..Default::default()
    };
    let cfg = EngineConfig { block_size: 4, num_blocks: Some(256), ..Default::default() };
    let mut e = engine(&m, cfg.clone());
    let out = run(&mut e, &[(prompt.clone(), params.clone())]);
    // Sample 0 prefills 101 tokens; each sibling reuses (101 − 1)/4 = 25 cached blocks, copies
    // nothing more (the tail is empty), and computes its last prompt token.
    assert_eq!((e.stats().prefill_tokens, e.stats().prefix_cache_hits), (101 + 7, 7 * 100));
    let distinct: std::collections::HashSet<_> = out[0].iter().map(|s| s.tokens.clone()).collect();
    assert!(distinct.len() > 1, "samples of one request differ");
    // A prompt whose last block is partial: the siblings copy its tail (positions 100..102)
    // from sample 0 and compute only position 102. Tokens and μ are bitwise those of samples
    // that each computed their whole prompt (no prefix caching).
    let prompt = [prompt, vec![7, 8]].concat();
    let mut e = engine(&m, cfg.clone());
    let forked = run(&mut e, &[(prompt.clone(), params.clone())]);
    assert_eq!((e.stats().prefill_tokens, e.stats().prefix_cache_hits), (103 + 7, 7 * 102));
    let mut cold = engine(&m, EngineConfig { enable_prefix_caching: false, ..cfg });
    let alone = run(&mut cold, &[(prompt, params)]);
    assert_eq!(cold.stats().prefill_tokens, 8 * 103);
    assert_eq!(forked, alone);
}

#[test]
fn n_samples_are_reproducible_with_a_seed() {
    let m = tiny(44);
    let p = vec![1u32, 2, 3, 4, 5];
    let params = SamplingParams { n: 4, seed: Some(9), max_tokens: Some(12), ignore_eos: true, ..Default::default() };
    let a = run(&mut engine(&m, EngineConfig::default()), &[(p.clone(), params.clone())]);
    let b = run(&mut engine(&m, EngineConfig::default()), &[(p.clone(), params.clone())]);
    assert_eq!(a, b);
    assert_eq!(a[0].iter().map(|s| s.tokens.clone()).collect::<std::collections::HashSet<_>>().len(), 4);
    // Sample 0 of n = 4 is the n = 1 sample with the same seed.
    let one = run(&mut engine(&m, EngineConfig::default()), &[(p, SamplingParams { n: 1, ..params })]);
    assert_eq!(one[0][0], a[0][0]);
}

#[test]
fn stop_strings_cut_text_across_and_inside_tokens() {
    let m = real();
    let prompt = m.1.encode("The history of the Roman Empire", false).unwrap();
    let free = run(&mut engine(m, EngineConfig::default()), &[(prompt.clone(), greedy(24))]).remove(0).remove(0);
    let text = free.text.clone();
    // A stop string starting one char into token 2 and ending one char into token 4.
    let piece = |i: usize| m.1.decode(&free.tokens[..i], true).unwrap().chars().count();
    let (a, b) = (piece(2) + 1, piece(4) + 1);
    let chars: Vec<char> = text.chars().collect();
    let stop: String = chars[a..b].iter().collect();
    let cut = text.find(&stop).unwrap();
    for s in [stop.clone(), "zzz-never".into()] {
        let params = SamplingParams { stop: vec!["zzz-never".into(), s.clone()], ..greedy(24) };
        let got = run(&mut engine(m, EngineConfig::default()), &[(prompt.clone(), params)]).remove(0).remove(0);
        if s == stop {
            assert_eq!(got.text, text[..cut], "stop {stop:?}");
            assert_eq!((got.finish, got.stop_reason), (Some(FinishReason::Stop), Some(StopReason::Text(stop.clone()))));
        } else {
            assert_eq!((got.text.as_str(), got.finish), (text.as_str(), Some(FinishReason::Length)));
        }
    }
}

#[test]
fn eos_min_tokens_and_stop_token_ids() {
    let m = real();
    let chat = m.1.apply_chat_template(&[ChatMessage::new("user", "What is the capital of France?")], true).unwrap();
    let prompt = m.1.encode(&chat, true).unwrap();
    let base = SamplingParams { temperature: 0.0, max_tokens: Some(40), ..Default::default() };
    let plain = run(&mut engine(m, EngineConfig::default()), &[(prompt.clone(), base.clone())]).remove(0).remove(0);
    assert_eq!(plain.finish, Some(FinishReason::Stop));
    assert_eq!(*plain.tokens.last().unwrap(), 2, "ends with <|im_end|>");
    let n = plain.tokens.len();
    let longer = run(
        &mut engine(m, EngineConfig::default()),
        &[(prompt.clone(), SamplingParams { min_tokens: n + 3, ..base.clone() })],
    )
    .remove(0)
    .remove(0);
    assert!(longer.tokens.len() >= n + 3 && !longer.tokens[..n + 2].contains(&2), "{:?}", longer.tokens);
    let stop_tok = plain.tokens[1];
    let cut = run(
        &mut engine(m, EngineConfig::default()),
        &[(prompt, SamplingParams { stop_token_ids: vec![stop_tok], ..base })],
    )
    .remove(0)
    .remove(0);
    assert_eq!(cut.tokens, plain.tokens[..2]);
    assert_eq!(cut.stop_reason, Some(StopReason::Token(stop_tok)));
}

#[test]
fn logprobs_match_the_llama_cpp_fixture() {
    #[derive(serde::Deserialize)]
    struct P {
        name: String,
        ids: Vec<u32>,
        greedy: Vec<u32>,
    }
    #[derive(serde::Deserialize)]
    struct R {
        prompts: Vec<P>,
        vocab: usize,
        steps: usize,
    }
    let r: R = serde_json::from_str(&std::fs::read_to_string(tests::fixture("reference.json")).unwrap()).unwrap();
    let all = {
        use std::io::Read;
        let mut b = Vec::new();
        flate2::read::GzDecoder::new(std::fs::File::open(tests::fixture("reference_logprobs.f32.gz")).unwrap())
            .read_to_end(&mut b)
            .unwrap();
        b.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect::<Vec<_>>()
    };
    let m = real();
    let reqs: Vec<_> =
        r.prompts.iter().map(|p| (p.ids.clone(), SamplingParams { logprobs: Some(5), ..greedy(r.steps) })).collect();
    let got = run(&mut engine(m, EngineConfig::default()), &reqs);
    for (pi, (p, g)) in r.prompts.iter().zip(&got).enumerate() {
        assert_eq!(g[0].tokens, p.greedy, "{}", p.name);
        for (s, &t) in p.greedy.iter().enumerate() {
            let want = all[(pi * r.steps + s) * r.vocab + t as usize];
            assert!((g[0].raw[s] - want).abs() < 1e-3, "{} step {s}: raw {} vs llama.cpp {want}", p.name, g[0].raw[s]);
            assert_eq!(g[0].behavior[s], 0.0, "greedy μ is 0");
        }
    }
    // Temperature 1 without truncation or penalties: μ equals the raw logprob.
    let s = run(
        &mut engine(m, EngineConfig::default()),
        &[(r.prompts[0].ids.clone(), SamplingParams { seed: Some(1), max_tokens: Some(8), ..Default::default() })],
    )
    .remove(0)
    .remove(0);
    for (b, raw) in s.behavior.iter().zip(&s.raw) {
        assert!((b - raw).abs() < 1e-5, "μ {b} vs raw {raw}");
    }
}

#[test]
fn invalid_requests_are_rejected_and_the_engine_keeps_serving() {
    let m = tiny(45);
    let mut e = engine(&m, EngineConfig { num_blocks: Some(4), block_size: 16, ..Default::default() });
    let d = SamplingParams::default;
    let check = |e: &mut LLMEngine, prompt: Vec<u32>, p: SamplingParams, want: &str| {
        let err = e.add_request("x", prompt, p).unwrap_err();
        assert!(err.to_string().contains(want), "{err} lacks {want}");
    };
    check(&mut e, vec![], d(), "the prompt is empty");
    check(&mut e, vec![1, 999], d(), "prompt token id 999 is out of range: the vocabulary has 259 tokens");
    check(&mut e, vec![1; 100], SamplingParams { max_tokens: Some(40), ..d() }, "maximum context length is 128 tokens. However, you requested 140 tokens (100 in the prompt, 40 for the completion)");
    check(
        &mut e,
        vec![1; 60],
        SamplingParams { max_tokens: Some(10), ..d() },
        "the prompt (60 tokens) and the completion (`max_tokens` 10) need 5 KV-cache blocks but the pool has only 4",
    );
    check(
        &mut e,
        vec![1],
        SamplingParams { temperature: -0.5, ..d() },
        "`temperature` must be a finite number >= 0, got -0.5",
    );
    e.add_request("dup", vec![1], greedy(2)).unwrap();
    assert_eq!(
        e.add_request("dup", vec![1], greedy(2)).unwrap_err(),
        ValidationError::DuplicateRequestId("dup".into())
    );
    let ok = run(&mut e, &[(vec![1, 2, 3], greedy(3))]);
    assert_eq!(ok[0][0].tokens.len(), 3);
}

#[test]
fn dropping_a_stream_aborts_and_frees_blocks() {
    // The default model: 100 tokens take seconds, so the request is still running when the
    // first token arrives (the tiny model could finish them before `stats` is read).
    let h =
        EngineHandle::spawn(engine(real(), EngineConfig { block_size: 4, num_blocks: Some(64), ..Default::default() }));
    let mut s = h
        .add_request(
            vec![1, 2, 3, 4, 5, 6, 7],
            SamplingParams { max_tokens: Some(100), ignore_eos: true, ..Default::default() },
        )
        .unwrap();
    assert!(matches!(s.recv_item(), Some(Ok(_))));
    assert!(h.stats().unwrap().num_free_blocks < 64);
    drop(s);
    // The engine notices the drop after its current step; under a loaded test run a step of
    // the default model can take seconds, so wait up to 30 s (a liveness check, not a timing).
    let mut free = 0;
    for _ in 0..3000 {
        free = h.stats().unwrap().num_free_blocks;
        if free == 64 {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    assert_eq!(free, 64);
    // The engine still serves, and a finished stream ends.
    let out = h.add_request(vec![9, 8, 7], greedy(3)).unwrap().collect().unwrap();
    assert_eq!(out.iter().map(|o| o.tokens.len()).sum::<usize>(), 3);
    assert!(out.last().unwrap().request_finished);
    assert!(matches!(
        h.add_request(vec![], greedy(1)),
        Err(engine::handle::AddError::Invalid(ValidationError::EmptyPrompt))
    ));
}

#[test]
fn in_flight_sequences_keep_or_recompute_their_kv_after_an_update() {
    let prompt: Vec<u32> = (0..10).map(|i| (i * 7 % 250) as u32).collect();
    let mut outs = vec![];
    for mode in [engine::KvOnUpdate::Keep, engine::KvOnUpdate::Recompute] {
        let m = tiny(44);
        let mut e =
            engine(&m, EngineConfig { block_size: 4, num_blocks: Some(64), kv_on_update: mode, ..Default::default() });
        e.add_request("r", prompt.clone(), greedy(6)).unwrap();
        let (mut tokens, mut versions, mut steps) = (vec![], vec![], 0);
        while e.has_unfinished() {
            for o in e.step().unwrap() {
                tokens.extend(o.tokens.iter().map(|t| t.token_id));
                versions.extend(o.tokens.iter().map(|t| t.version));
            }
            steps += 1;
            if steps == 3 {
                m.0.write().version += 1; // an update lands between two steps
            }
        }
        // Each token records the version of the step that computed it.
        assert_eq!(versions, [0, 0, 0, 1, 1, 1], "{mode:?}");
        let recomputes = if mode == engine::KvOnUpdate::Recompute { 1 } else { 0 };
        assert_eq!(e.stats().num_kv_recomputes, recomputes, "{mode:?}");
        assert_eq!(e.num_free_blocks(), 64);
        outs.push(tokens);
    }
    // The weights did not change, so recomputed KV gives the same tokens (batch invariance).
    assert_eq!(outs[0], outs[1]);
}

/// Makes the model's forward fail for one token id, as a weight update of the wrong shape
/// would: the tied model gets an embedding table of its own, one row short (the LM head
/// keeps every row, so requests holding the id still validate, and sampling is unchanged).
/// Returns that id.
pub(crate) fn drop_last_embedding_row(model: &SharedModel) -> u32 {
    let mut m = model.write();
    let (vocab, hidden) = (m.config.vocab_size, m.config.hidden_size);
    let mut table = kernels::ops::unpack_weight(&m.lm_head).unwrap().to_vec().unwrap();
    table.truncate((vocab - 1) * hidden);
    m.embed_tokens = Some(Tensor::from_vec(table, &[vocab - 1, hidden]).unwrap());
    (vocab - 1) as u32
}

#[test]
fn a_failed_step_aborts_the_requests_it_ran_and_the_engine_keeps_serving() {
    let m = tiny(47);
    let bad = drop_last_embedding_row(&m.0);
    let cfg = EngineConfig { block_size: 4, num_blocks: Some(64), max_num_seqs: 2, ..Default::default() };
    let mut e = engine(&m, cfg.clone());
    // One step runs "bad" and sample 0 of "mate" (max_num_seqs 2); mate's sample 1 waits for
    // its prompt, "later" for a free slot.
    e.add_request("bad", vec![1, 2, bad], greedy(4)).unwrap();
    e.add_request("mate", vec![3, 4, 5, 6, 7], SamplingParams { n: 2, ..greedy(4) }).unwrap();
    e.add_request("later", vec![6, 7, 8], greedy(4)).unwrap();
    let err = e.step().unwrap_err();
    assert_eq!(err.requests, ["bad", "mate"], "the requests of the failed step");
    let want = format!("token id {bad} >= vocab size {bad}");
    assert!(err.to_string().contains(&want), "{err} lacks {want:?}");
    // Both requests are gone (mate's waiting sample too) and their blocks are free.
    let st = e.stats();
    assert_eq!((st.num_running, st.num_waiting), (0, 1), "only `later` is left");
    assert_eq!(e.num_free_blocks(), 64, "the failed step's blocks are freed");
    let mut got = BTreeMap::new();
    while e.has_unfinished() {
        collect(e.step().unwrap(), &mut got);
    }
    assert_eq!(got.keys().cloned().collect::<Vec<_>>(), [("later".to_string(), 0)]);
    assert_eq!(got[&("later".to_string(), 0)].tokens.len(), 4);
    assert_eq!(got[&("later".to_string(), 0)].finish, Some(FinishReason::Length));
    assert_eq!(e.num_free_blocks(), 64);

    // Through the handle: the failed request's stream ends with the fault, never as if it
    // had finished; the next request is served.
    let h = EngineHandle::spawn(engine(&m, cfg));
    let mut s = h.add_request(vec![1, bad], greedy(3)).unwrap();
    let fault = s.recv_item().unwrap().unwrap_err();
    assert!(fault.0.contains(&want) && fault.0.contains("aborted"), "{fault}");
    assert!(s.recv_item().is_none(), "the fault is the last item");
    let out = h.add_request(vec![1, 2], greedy(3)).unwrap().collect().unwrap();
    assert_eq!(out.iter().map(|o| o.tokens.len()).sum::<usize>(), 3);
    assert!(out.last().unwrap().request_finished);
    assert_eq!(h.stats().unwrap().num_free_blocks, 64);
}

/// Runs a script of block-pool operations and checks the id each `alloc` hands out.
/// Ops: `a` alloc (pushes the block), `f i` drop the i-th held block, `r i h s` register the
/// i-th held block as content `h` under salt `s`, `l h` lookup (pushes on a hit; `-` on a
/// miss), `x s` retire salts below `s`.
fn check_blocks(num_blocks: usize, script: &str, expected: &str) {
    use engine::block_manager::BlockManager;
    let bm = BlockManager::new(num_blocks, 4);
    let mut held = Vec::new();
    let mut got = Vec::new();
    for op in script.split(',') {
        let w: Vec<&str> = op.split_whitespace().collect();
        let n = |k: usize| w[k].parse::<u64>().unwrap();
        match w[0] {
            "a" => {
                let b = bm.allocate().expect("a free block");
                got.push(b.id().to_string());
                held.push(Some(b));
            }
            "f" => held[n(1) as usize] = None,
            "r" => bm.register(held[n(1) as usize].as_ref().unwrap(), n(2), n(3)),
            "l" => match bm.lookup(n(1)) {
                Some(b) => {
                    got.push(format!("l{}", b.id()));
                    held.push(Some(b));
                }
                None => got.push("-".into()),
            },
            "x" => bm.retire_salts_below(n(1)),
            op => panic!("unknown op {op}"),
        }
    }
    assert_eq!(got.join(" "), expected, "script: {script}");
    let live = held.iter().flatten().map(|b| b.id()).collect::<std::collections::HashSet<_>>().len();
    assert_eq!(bm.num_free(), num_blocks - live, "free count after: {script}");
    drop(held);
    assert_eq!(bm.num_free(), num_blocks, "every block free again");
}

#[test]
fn kv_blocks_are_reused_before_untouched_ones_and_cached_ones_evicted_last() {
    // A freed plain block is handed out again (most recent first), not a never-used one.
    check_blocks(4, "a,a,a,f 0,f 2,a,a,a", "0 1 2 2 0 3");
    // A freed cached block stays cached while never-used blocks remain; then a hit.
    check_blocks(3, "a,r 0 7 0,f 0,a,a,l 7", "0 1 2 l0");
    // Full pool: the least recently freed cached block is evicted first.
    check_blocks(2, "a,a,r 0 7 0,r 1 8 0,f 1,f 0,a,l 7,l 8", "0 1 1 l0 -");
    // Retiring a salt turns its free cached blocks into plain ones (reused first, no hit)
    // and keeps that salt out of the cache.
    check_blocks(3, "a,r 0 7 0,f 0,x 1,l 7,a,r 1 9 0,l 9", "0 - 0 -");
    // A retired block still in use is uncached, and becomes plain when freed.
    check_blocks(3, "a,r 0 7 0,x 1,f 0,a,l 7", "0 0 -");
    // The newer salt's entries survive the retirement.
    check_blocks(3, "a,a,r 0 7 0,r 1 8 1,f 0,f 1,x 1,l 7,l 8", "0 1 - l1");
}
