//! `config.json` of a Hugging Face model folder.

use crate::error::{ModelError, Result};
use serde::Deserialize;
use std::path::Path;

/// The supported architectures (`architectures[0]` in `config.json`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Architecture {
    /// `LlamaForCausalLM`: SmolLM2, Llama 3.x, TinyLlama.
    Llama,
    /// `Qwen2ForCausalLM`: like Llama with q/k/v biases.
    Qwen2,
}

/// Llama 3 frequency-dependent RoPE scaling (`rope_scaling.rope_type == "llama3"`), as in
/// HF `_compute_llama3_parameters`.
#[derive(Debug, Clone, PartialEq)]
pub struct Llama3RopeScaling {
    pub factor: f64,
    pub low_freq_factor: f64,
    pub high_freq_factor: f64,
    pub original_max_position_embeddings: f64,
}

/// The model hyper-parameters the engine needs, validated.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelConfig {
    pub architecture: Architecture,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub head_dim: usize,
    pub rms_norm_eps: f32,
    pub rope_theta: f64,
    pub rope_scaling: Option<Llama3RopeScaling>,
    pub max_position_embeddings: usize,
    pub vocab_size: usize,
    pub tie_word_embeddings: bool,
    /// q/k/v projections carry a bias (always for Qwen2; `attention_bias` for Llama).
    pub qkv_bias: bool,
    pub bos_token_id: Option<u32>,
    pub eos_token_ids: Vec<u32>,
    /// `pad_token_id`: HF Llama/Qwen2 build `nn.Embedding(vocab, hidden, padding_idx =
    /// pad_token_id)`, whose lookup passes no gradient to that row, so the learner's
    /// embedding backward skips it too (a tied LM head still trains the row as an output).
    /// SmolLM2's pad is `<|im_end|>`, the chat template's turn end.
    pub pad_token_id: Option<u32>,
}

#[derive(Deserialize)]
struct RawConfig {
    architectures: Option<Vec<String>>,
    hidden_size: usize,
    intermediate_size: usize,
    num_hidden_layers: usize,
    num_attention_heads: usize,
    num_key_value_heads: Option<usize>,
    head_dim: Option<usize>,
    rms_norm_eps: Option<f64>,
    rope_theta: Option<f64>,
    rope_scaling: Option<serde_json::Value>,
    max_position_embeddings: Option<usize>,
    vocab_size: usize,
    tie_word_embeddings: Option<bool>,
    attention_bias: Option<bool>,
    bos_token_id: Option<u32>,
    eos_token_id: Option<serde_json::Value>,
    pad_token_id: Option<u32>,
}

impl ModelConfig {
    /// Reads and validates `dir/config.json`.
    pub fn from_dir(dir: &Path) -> Result<Self> {
        let path = dir.join("config.json");
        let text = std::fs::read_to_string(&path).map_err(|e| ModelError::io(&path, e))?;
        Self::from_json(&text, &path)
    }

    /// Parses `config.json` text; `path` is only used in error messages.
    pub fn from_json(text: &str, path: &Path) -> Result<Self> {
        let raw: RawConfig =
            serde_json::from_str(text).map_err(|source| ModelError::Json { path: path.into(), source })?;
        let bad = |msg: String| ModelError::Config { path: path.into(), msg };
        let arch_name = raw.architectures.as_ref().and_then(|a| a.first()).cloned().unwrap_or_default();
        let architecture = match arch_name.as_str() {
            "LlamaForCausalLM" => Architecture::Llama,
            "Qwen2ForCausalLM" => Architecture::Qwen2,
            _ => return Err(ModelError::UnknownArchitecture { path: path.into(), arch: arch_name }),
        };
        let heads = raw.num_attention_heads;
        let kv_heads = raw.num_key_value_heads.unwrap_or(heads);
        if heads == 0 || kv_heads == 0 || !heads.is_multiple_of(kv_heads) {
            return Err(bad(format!(
                "num_attention_heads {heads} must be a positive multiple of num_key_value_heads {kv_heads}"
            )));
        }
        let head_dim = raw.head_dim.unwrap_or(raw.hidden_size / heads);
        if head_dim == 0 || !head_dim.is_multiple_of(2) {
            return Err(bad(format!("head_dim {head_dim} must be positive and even")));
        }
        if raw.hidden_size == 0 || raw.intermediate_size == 0 || raw.num_hidden_layers == 0 || raw.vocab_size == 0 {
            return Err(
                bad("hidden_size, intermediate_size, num_hidden_layers and vocab_size must be positive".into()),
            );
        }
        let rope_scaling = match &raw.rope_scaling {
            None | Some(serde_json::Value::Null) => None,
            Some(v) => {
                let kind = v.get("rope_type").or_else(|| v.get("type")).and_then(|t| t.as_str()).unwrap_or("");
                let num = |k: &str| {
                    v.get(k)
                        .and_then(|x| x.as_f64())
                        .ok_or_else(|| bad(format!("rope_scaling.{k} missing or not a number")))
                };
                match kind {
                    "llama3" => Some(Llama3RopeScaling {
                        factor: num("factor")?,
                        low_freq_factor: num("low_freq_factor")?,
                        high_freq_factor: num("high_freq_factor")?,
                        original_max_position_embeddings: num("original_max_position_embeddings")?,
                    }),
                    "default" => None,
                    other => {
                        return Err(bad(format!("rope_scaling type {other:?} is not supported (supported: llama3)")))
                    }
                }
            }
        };
        let eos_token_ids = match raw.eos_token_id {
            None | Some(serde_json::Value::Null) => vec![],
            Some(serde_json::Value::Number(n)) => {
                vec![n.as_u64().ok_or_else(|| bad("eos_token_id must be a token id".into()))? as u32]
            }
            Some(serde_json::Value::Array(a)) => a
                .iter()
                .map(|x| x.as_u64().map(|v| v as u32).ok_or_else(|| bad("eos_token_id must hold token ids".into())))
                .collect::<Result<_>>()?,
            Some(other) => return Err(bad(format!("eos_token_id {other} is not a token id or list"))),
        };
        Ok(ModelConfig {
            architecture,
            hidden_size: raw.hidden_size,
            intermediate_size: raw.intermediate_size,
            num_hidden_layers: raw.num_hidden_layers,
            num_attention_heads: heads,
            num_key_value_heads: kv_heads,
            head_dim,
            rms_norm_eps: raw.rms_norm_eps.unwrap_or(1e-6) as f32,
            rope_theta: raw.rope_theta.unwrap_or(10000.0),
            rope_scaling,
            max_position_embeddings: raw.max_position_embeddings.unwrap_or(2048),
            vocab_size: raw.vocab_size,
            tie_word_embeddings: raw.tie_word_embeddings.unwrap_or(false),
            qkv_bias: architecture == Architecture::Qwen2 || raw.attention_bias.unwrap_or(false),
            bos_token_id: raw.bos_token_id,
            eos_token_ids,
            pad_token_id: raw.pad_token_id,
        })
    }

    /// RoPE inverse frequencies `θ^(-2i/d)` for `i < head_dim/2` (Su et al. 2021, eq. 15),
    /// with Llama 3 scaling applied when configured (HF `_compute_llama3_parameters`).
    pub fn rope_inv_freq(&self) -> Vec<f64> {
        let d = self.head_dim as f64;
        (0..self.head_dim / 2)
            .map(|i| {
                let f = 1.0 / self.rope_theta.powf(2.0 * i as f64 / d);
                match &self.rope_scaling {
                    None => f,
                    Some(s) => {
                        let low_wavelen = s.original_max_position_embeddings / s.low_freq_factor;
                        let high_wavelen = s.original_max_position_embeddings / s.high_freq_factor;
                        let wavelen = 2.0 * std::f64::consts::PI / f;
                        if wavelen < high_wavelen {
                            f
                        } else if wavelen > low_wavelen {
                            f / s.factor
                        } else {
                            let smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor)
                                / (s.high_freq_factor - s.low_freq_factor);
                            (1.0 - smooth) * f / s.factor + smooth * f
                        }
                    }
                }
            })
            .collect()
    }

    /// Total parameter count implied by the config (tied embeddings counted once).
    pub fn num_parameters(&self) -> usize {
        let (h, i, v) = (self.hidden_size, self.intermediate_size, self.vocab_size);
        let (q, kv) = (self.num_attention_heads * self.head_dim, self.num_key_value_heads * self.head_dim);
        let bias = if self.qkv_bias { q + 2 * kv } else { 0 };
        let layer = h * q + 2 * h * kv + q * h + bias + 3 * h * i + 2 * h;
        let head = if self.tie_word_embeddings { 0 } else { v * h };
        v * h + self.num_hidden_layers * layer + h + head
    }
}
