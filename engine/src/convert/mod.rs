//! GGUF (llama.cpp) → Hugging Face model folder: `config.json`, `model.safetensors` (f32),
//! `tokenizer.json`, `tokenizer_config.json`, `generation_config.json`.
//!
//! The quantized weights are dequantized exactly and stored as f32. llama.cpp's converter
//! permutes the rows of `q_proj`/`k_proj` for its interleaved RoPE
//! (`convert_hf_to_gguf.py: LlamaModel.permute`); [`unpermute_rows`] undoes it.

pub mod gguf;

use crate::error::{ModelError, Result};
use crate::model::write_f32_safetensors;
use crate::publish::Staging;
use gguf::{Gguf, Value};
use serde_json::json;
use std::collections::BTreeMap;
use std::path::Path;
use tokenizers::models::bpe::BPE;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::{AddedToken, Tokenizer};

/// Undoes llama.cpp's Q/K permutation: GGUF row `h·D + 2i + s` is HF row `h·D + s·D/2 + i`
/// (numpy: `w.reshape(n_head, rows/n_head/2, 2, cols).swapaxes(1, 2).reshape(rows, cols)`).
pub fn unpermute_rows(w: &[f32], rows: usize, cols: usize, n_head: usize) -> Vec<f32> {
    let d = rows / n_head;
    let half = d / 2;
    let mut out = vec![0.0; w.len()];
    for hd in 0..n_head {
        for i in 0..half {
            for s in 0..2 {
                let src = hd * d + 2 * i + s;
                let dst = hd * d + s * half + i;
                out[dst * cols..(dst + 1) * cols].copy_from_slice(&w[src * cols..(src + 1) * cols]);
            }
        }
    }
    out
}

fn meta<'a>(g: &'a Gguf, path: &Path, key: &str) -> Result<&'a Value> {
    g.get(key).ok_or_else(|| ModelError::Gguf { path: path.into(), msg: format!("missing metadata `{key}`") })
}

fn meta_u(g: &Gguf, path: &Path, key: &str) -> Result<usize> {
    meta(g, path, key)?
        .as_u64()
        .map(|v| v as usize)
        .ok_or_else(|| ModelError::Gguf { path: path.into(), msg: format!("metadata `{key}` is not an integer") })
}

fn meta_strs(g: &Gguf, path: &Path, key: &str) -> Result<Vec<String>> {
    let a = meta(g, path, key)?
        .as_array()
        .ok_or_else(|| ModelError::Gguf { path: path.into(), msg: format!("metadata `{key}` is not an array") })?;
    a.iter()
        .map(|v| {
            v.as_str().map(String::from).ok_or_else(|| ModelError::Gguf {
                path: path.into(),
                msg: format!("metadata `{key}` holds a non-string"),
            })
        })
        .collect()
}

/// Converts a `llama`-architecture GGUF with a `gpt2` (byte-level BPE) tokenizer into a HF
/// model folder at `out`. Writes into a staging folder of this process's own, fsyncs it and
/// renames it to `out` ([`Staging::publish_dir`]): a reader never sees `out` half-written or
/// missing once it existed, and when several processes convert at once the first complete
/// folder stays (an existing `out` is never deleted).
pub fn convert_gguf(gguf_path: &Path, out: &Path, progress: &dyn Fn(&str)) -> Result<()> {
    let p = gguf_path;
    let g = Gguf::open(p)?;
    let arch = meta(&g, p, "general.architecture")?.as_str().unwrap_or_default().to_string();
    if arch != "llama" {
        return Err(ModelError::Gguf {
            path: p.into(),
            msg: format!("architecture {arch:?} is not supported by the converter (supported: llama)"),
        });
    }
    let n_layer = meta_u(&g, p, "llama.block_count")?;
    let hidden = meta_u(&g, p, "llama.embedding_length")?;
    let n_head = meta_u(&g, p, "llama.attention.head_count")?;
    let n_head_kv = meta_u(&g, p, "llama.attention.head_count_kv")?;
    let ffn = meta_u(&g, p, "llama.feed_forward_length")?;
    let ctx = meta_u(&g, p, "llama.context_length")?;
    let eps = meta(&g, p, "llama.attention.layer_norm_rms_epsilon")?.as_f64().unwrap_or(1e-5);
    let theta = g.get("llama.rope.freq_base").and_then(Value::as_f64).unwrap_or(10000.0);
    let tokens = meta_strs(&g, p, "tokenizer.ggml.tokens")?;
    let merges = meta_strs(&g, p, "tokenizer.ggml.merges")?;
    let token_types: Vec<u64> = meta(&g, p, "tokenizer.ggml.token_type")?
        .as_array()
        .unwrap_or_default()
        .iter()
        .map(|v| v.as_u64().unwrap_or(1))
        .collect();
    let bos = g.get("tokenizer.ggml.bos_token_id").and_then(Value::as_u64);
    let eos = g.get("tokenizer.ggml.eos_token_id").and_then(Value::as_u64);
    let pad = g.get("tokenizer.ggml.padding_token_id").and_then(Value::as_u64);
    let tied = g.tensor("output.weight").is_none();

    // Written under a name of this process's own, published by one rename (crate::publish).
    let staging = Staging::dir(out)?;
    let tmp = staging.path().to_path_buf();

    // Weights.
    progress(&format!("converting {} tensors to f32", g.tensors.len()));
    let mut tensors: Vec<(String, Vec<usize>, Vec<f32>)> = Vec::new();
    let head_dim = hidden / n_head;
    for t in &g.tensors {
        let name = hf_name(&t.name)
            .ok_or_else(|| ModelError::Gguf { path: p.into(), msg: format!("unexpected tensor `{}`", t.name) })?;
        let shape = t.shape();
        let mut data = g.dequantize(t)?;
        if t.name.ends_with("attn_q.weight") {
            data = unpermute_rows(&data, shape[0], shape[1], n_head);
        } else if t.name.ends_with("attn_k.weight") {
            data = unpermute_rows(&data, shape[0], shape[1], n_head_kv);
        }
        tensors.push((name, shape, data));
    }
    let st_path = tmp.join("model.safetensors");
    progress(&format!("writing {}", st_path.display()));
    let views: BTreeMap<String, (Vec<usize>, &[f32])> =
        tensors.iter().map(|(n, s, d)| (n.clone(), (s.clone(), d.as_slice()))).collect();
    write_f32_safetensors(&st_path, &views)?;

    // config.json
    let config = json!({
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": ffn,
        "num_hidden_layers": n_layer,
        "num_attention_heads": n_head,
        "num_key_value_heads": n_head_kv,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": eps,
        "rope_theta": theta,
        "max_position_embeddings": ctx,
        "vocab_size": tokens.len(),
        "tie_word_embeddings": tied,
        "attention_bias": false,
        "bos_token_id": bos,
        "eos_token_id": eos,
        "pad_token_id": pad,
        "torch_dtype": "float32",
    });
    write_json(&tmp.join("config.json"), &config)?;
    let gen = json!({ "bos_token_id": bos, "eos_token_id": eos, "pad_token_id": pad });
    write_json(&tmp.join("generation_config.json"), &gen)?;

    // Tokenizer.
    progress("building tokenizer.json");
    let pre = g.get("tokenizer.ggml.pre").and_then(Value::as_str).unwrap_or("default");
    let model = meta(&g, p, "tokenizer.ggml.model")?.as_str().unwrap_or_default();
    if model != "gpt2" || pre != "smollm" {
        return Err(ModelError::Gguf {
            path: p.into(),
            msg: format!("tokenizer {model:?} with pre-tokenizer {pre:?} is not supported (supported: gpt2 + smollm)"),
        });
    }
    let tok_path = tmp.join("tokenizer.json");
    build_tokenizer(&tokens, &merges, &token_types, &tok_path)?;
    let name = |id: Option<u64>| id.and_then(|i| tokens.get(i as usize)).cloned();
    let mut tok_cfg = json!({
        "tokenizer_class": "GPT2Tokenizer",
        "add_bos_token": false,
        "add_eos_token": false,
        "bos_token": name(bos),
        "eos_token": name(eos),
        "pad_token": name(pad),
        "model_max_length": ctx,
        "clean_up_tokenization_spaces": false,
    });
    if let Some(t) = g.get("tokenizer.chat_template").and_then(Value::as_str) {
        tok_cfg["chat_template"] = json!(t);
    }
    write_json(&tmp.join("tokenizer_config.json"), &tok_cfg)?;

    staging.publish_dir(out, is_complete)
}

/// Whether `dir` is a complete converted folder (config, weights and tokenizer files).
pub fn is_complete(dir: &Path) -> bool {
    ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"].iter().all(|f| dir.join(f).exists())
}

/// GGUF tensor name → HF name (llama.cpp `gguf-py/gguf/tensor_mapping.py`).
fn hf_name(n: &str) -> Option<String> {
    let fixed = match n {
        "token_embd.weight" => Some("model.embed_tokens.weight"),
        "output_norm.weight" => Some("model.norm.weight"),
        "output.weight" => Some("lm_head.weight"),
        _ => None,
    };
    if let Some(f) = fixed {
        return Some(f.into());
    }
    let rest = n.strip_prefix("blk.")?;
    let (layer, part) = rest.split_once('.')?;
    let layer: usize = layer.parse().ok()?;
    let hf = match part {
        "attn_norm.weight" => "input_layernorm.weight",
        "attn_q.weight" => "self_attn.q_proj.weight",
        "attn_k.weight" => "self_attn.k_proj.weight",
        "attn_v.weight" => "self_attn.v_proj.weight",
        "attn_output.weight" => "self_attn.o_proj.weight",
        "ffn_norm.weight" => "post_attention_layernorm.weight",
        "ffn_gate.weight" => "mlp.gate_proj.weight",
        "ffn_up.weight" => "mlp.up_proj.weight",
        "ffn_down.weight" => "mlp.down_proj.weight",
        _ => return None,
    };
    Some(format!("model.layers.{layer}.{hf}"))
}

/// Byte-level BPE with the `smollm` pre-tokenizer (individual digits, then byte-level
/// without prefix space); tokens of type CONTROL (3) become special added tokens.
fn build_tokenizer(tokens: &[String], merges: &[String], types: &[u64], path: &Path) -> Result<()> {
    let err = |msg: String| ModelError::Tokenizer { path: path.into(), msg };
    let vocab: tokenizers::models::bpe::Vocab = tokens.iter().enumerate().map(|(i, t)| (t.clone(), i as u32)).collect();
    let merges: Vec<(String, String)> = merges
        .iter()
        .map(|m| {
            m.split_once(' ')
                .map(|(a, b)| (a.to_string(), b.to_string()))
                .ok_or_else(|| err(format!("bad merge {m:?}")))
        })
        .collect::<Result<_>>()?;
    let bpe = BPE::builder().vocab_and_merges(vocab, merges).build().map_err(|e| err(e.to_string()))?;
    let mut tk = Tokenizer::new(bpe);
    tk.with_pre_tokenizer(Some(Sequence::new(vec![
        Digits::new(true).into(),
        ByteLevel::new(false, true, true).into(),
    ])));
    tk.with_decoder(Some(ByteLevel::default()));
    let special: Vec<AddedToken> =
        tokens.iter().zip(types).filter(|(_, &t)| t == 3).map(|(s, _)| AddedToken::from(s.clone(), true)).collect();
    tk.add_special_tokens(&special);
    tk.save(path, true).map_err(|e| err(e.to_string()))
}

fn write_json(path: &Path, v: &serde_json::Value) -> Result<()> {
    let text = serde_json::to_string_pretty(v).expect("JSON values serialize");
    std::fs::write(path, text).map_err(|e| ModelError::io(path, e))
}
