//! The default model against llama.cpp (fixtures from tests/fixtures/make_reference.py):
//! tokenization, chat template, greedy tokens and full next-token log-softmax for 20 steps,
//! teacher-forced logprobs. Tolerance 1e-3 (max abs) on log-probabilities.

use engine::{ChatMessage, Model, Tokenizer};
use flate2::read::GzDecoder;
use kernels::{ops, Device};
use serde::Deserialize;
use std::io::Read;
use std::sync::OnceLock;
use tests::{default_model, fixture, max_abs_diff};

const TOL: f32 = 1e-3;

#[derive(Deserialize)]
struct Reference {
    steps: usize,
    vocab: usize,
    chat_messages: Vec<ChatMessage>,
    tokenization: Vec<Tokenized>,
    prompts: Vec<Prompt>,
    teacher_forced: Vec<TeacherForced>,
}
#[derive(Deserialize)]
struct Tokenized {
    text: String,
    ids: Vec<u32>,
}
#[derive(Deserialize)]
struct Prompt {
    name: String,
    ids: Vec<u32>,
    greedy: Vec<u32>,
}
#[derive(Deserialize)]
struct TeacherForced {
    prompt_ids: Vec<u32>,
    continuation_ids: Vec<u32>,
    logprobs: Vec<f32>,
}

fn reference() -> &'static Reference {
    static R: OnceLock<Reference> = OnceLock::new();
    R.get_or_init(|| serde_json::from_str(&std::fs::read_to_string(fixture("reference.json")).unwrap()).unwrap())
}

fn model() -> &'static (Tokenizer, Model) {
    static M: OnceLock<(Tokenizer, Model)> = OnceLock::new();
    M.get_or_init(|| {
        let dir = default_model();
        (Tokenizer::from_dir(&dir).unwrap(), Model::load(&dir, &Device::Cpu).unwrap())
    })
}

#[test]
fn default_model_config_matches_the_checked_facts() {
    let c = &model().1.config;
    assert_eq!((c.num_hidden_layers, c.hidden_size, c.intermediate_size), (30, 576, 1536));
    assert_eq!((c.num_attention_heads, c.num_key_value_heads, c.head_dim), (9, 3, 64));
    assert_eq!((c.rms_norm_eps, c.rope_theta, c.vocab_size), (1e-5, 1e5, 49152));
    assert!(c.tie_word_embeddings);
    assert_eq!(c.num_parameters(), 134_515_008);
    let tok = &model().0;
    assert_eq!((tok.token_to_id("<|im_start|>"), tok.token_to_id("<|im_end|>")), (Some(1), Some(2)));
    assert_eq!(tok.eos_token_ids, vec![2]);
}

#[test]
fn tokenizer_matches_llama_cpp() {
    let tok = &model().0;
    for t in &reference().tokenization {
        assert_eq!(tok.encode(&t.text, true).unwrap(), t.ids, "tokens of {:?}", t.text);
        assert_eq!(tok.decode(&t.ids, false).unwrap(), t.text, "round trip of {:?}", t.text);
    }
}

#[test]
fn chat_template_matches_jinja2() {
    let r = reference();
    let chat = r.prompts.iter().find(|p| p.name == "chat").unwrap();
    let text = model().0.apply_chat_template(&r.chat_messages, true).unwrap();
    assert_eq!(model().0.encode(&text, true).unwrap(), chat.ids, "rendered: {text:?}");
    // The chat path (contents as plain text) gives the same ids when no content holds a
    // special-token string.
    assert_eq!(model().0.encode_chat(&r.chat_messages, engine::ChatOptions::default()).unwrap(), chat.ids);
}

fn reference_logprobs() -> Vec<f32> {
    let mut bytes = Vec::new();
    GzDecoder::new(std::fs::File::open(fixture("reference_logprobs.f32.gz")).unwrap()).read_to_end(&mut bytes).unwrap();
    bytes.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect()
}

#[test]
fn greedy_decode_and_log_softmax_match_llama_cpp() {
    let r = reference();
    let all = reference_logprobs();
    let (v, steps) = (r.vocab, r.steps);
    assert_eq!(all.len(), r.prompts.len() * steps * v);
    assert!(r.prompts.iter().any(|p| p.ids.len() > 500), "one prompt is over 500 tokens");
    let model = &model().1;
    for (pi, p) in r.prompts.iter().enumerate() {
        let mut cache = model.new_cache(p.ids.len() + steps).unwrap();
        let mut logits = model.forward(&p.ids, &mut cache, false).unwrap();
        let mut worst = 0.0f32;
        for s in 0..steps {
            let lp = ops::log_softmax(&logits).unwrap();
            let lp = lp.as_slice().unwrap();
            let want = &all[(pi * steps + s) * v..(pi * steps + s + 1) * v];
            let diff = max_abs_diff(lp, want);
            worst = worst.max(diff);
            assert!(diff < TOL, "{}: step {s}: max |Δ log-softmax| = {diff}", p.name);
            assert_eq!(engine::sampling::argmax(lp) as u32, p.greedy[s], "{}: greedy token at step {s}", p.name);
            logits = model.forward(&[p.greedy[s]], &mut cache, false).unwrap();
        }
        eprintln!("{} ({} prompt tokens): max |Δ log-softmax| over {steps} steps = {worst:.2e}", p.name, p.ids.len());
    }
}

#[test]
fn teacher_forced_logprobs_match_llama_cpp() {
    let model = &model().1;
    for tf in &reference().teacher_forced {
        let ids: Vec<u32> = tf.prompt_ids.iter().chain(&tf.continuation_ids).cloned().collect();
        let logits = model.forward(&ids, &mut model.new_cache(ids.len()).unwrap(), true).unwrap();
        let lp = ops::log_softmax(&logits).unwrap();
        let v = model.config.vocab_size;
        let got: Vec<f32> = tf
            .continuation_ids
            .iter()
            .enumerate()
            .map(|(i, &t)| lp.as_slice().unwrap()[(tf.prompt_ids.len() - 1 + i) * v + t as usize])
            .collect();
        let diff = max_abs_diff(&got, &tf.logprobs);
        assert!(diff < TOL, "teacher-forced: max |Δ logprob| = {diff}");
    }
}
