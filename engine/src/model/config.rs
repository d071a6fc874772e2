//! `config.json` of a Hugging Face model folder.

use crate::error::{ModelError, Result};
use serde::Deserialize;
use std::path::Path;

/// The supported architectures (`architectures[0]` in `config.json`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Architecture {
    /// `LlamaForCausalLM`: SmolLM2, Llama 3.x, TinyLlama.
    Llama,
    /// `Qwen2ForCausalLM`: like Llama with q/k/v biases (Qwen2, Qwen2.5).
    Qwen2,
    /// `Qwen3ForCausalLM` (dense): like Llama with a per-head RMSNorm on q and k before RoPE
    /// (`q_norm`, `k_norm`, weights `[head_dim]`) and `head_dim` from the config (HF
    /// `Qwen3Config`'s default 128, not `hidden_size / num_attention_heads`).
    Qwen3,
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
    /// q/k/v projections carry a bias (always for Qwen2; Llama's `attention_bias`, which
    /// would also give `o_proj` a bias, is refused at load).
    pub qkv_bias: bool,
    /// q and k are RMS-normalised per head (weights `q_norm`, `k_norm` of `[head_dim]`, the
    /// layer's `rms_norm_eps`) after the projection and before RoPE (Qwen3).
    pub qk_norm: bool,
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
    /// transformers ≥ 5: `rope_type`, `rope_theta` and the scaling factors in one dict.
    rope_parameters: Option<serde_json::Value>,
    partial_rotary_factor: Option<f64>,
    max_position_embeddings: Option<usize>,
    vocab_size: usize,
    tie_word_embeddings: Option<bool>,
    attention_bias: Option<bool>,
    mlp_bias: Option<bool>,
    hidden_act: Option<String>,
    use_sliding_window: Option<bool>,
    max_window_layers: Option<usize>,
    layer_types: Option<Vec<String>>,
    attn_logit_softcapping: Option<serde_json::Value>,
    final_logit_softcapping: Option<serde_json::Value>,
    bos_token_id: Option<u32>,
    eos_token_id: Option<serde_json::Value>,
    pad_token_id: Option<u32>,
}

/// HF's default `rope_theta` (`RotaryEmbeddingConfigMixin.default_theta`).
const DEFAULT_ROPE_THETA: f64 = 10000.0;

/// The RoPE base and scaling, read as transformers reads them
/// (`RotaryEmbeddingConfigMixin.convert_rope_params_to_dict`, transformers 5): the
/// settings dict is the legacy `rope_scaling` if set, else `rope_parameters` (5.x writes
/// `{"rope_type", "rope_theta", ...}` there and no top-level `rope_theta`); a value inside
/// the dict wins over the top-level `rope_theta` / `partial_rotary_factor`, and
/// `rope_theta` defaults to 10000. A dict nested by layer type (`{"full_attention": {...}}`)
/// is read at its `full_attention` entry (every layer is full attention, see
/// [`unsupported_math`]). Errors name the field: a RoPE type other than `default` and
/// `llama3`, a partial rotary factor ≠ 1, a missing or non-numeric factor.
fn rope(
    raw: &RawConfig,
    max_position_embeddings: usize,
) -> std::result::Result<(f64, Option<Llama3RopeScaling>), String> {
    use serde_json::Value;
    let present = |v: &Option<Value>| match v {
        None | Some(Value::Null) => false,
        Some(Value::Object(m)) => !m.is_empty(),
        Some(_) => true,
    };
    let (mut key, mut params) = if present(&raw.rope_scaling) {
        ("rope_scaling".to_string(), raw.rope_scaling.clone().unwrap())
    } else if present(&raw.rope_parameters) {
        ("rope_parameters".to_string(), raw.rope_parameters.clone().unwrap())
    } else {
        (String::new(), Value::Object(Default::default()))
    };
    if !params.is_object() {
        return Err(format!("{key} must be an object, got {params}"));
    }
    if let Some(inner) = params.get("full_attention").cloned() {
        key = format!("{key}.full_attention");
        params = inner;
        if !params.is_object() {
            return Err(format!("{key} must be an object, got {params}"));
        }
    }
    let num = |k: &str| -> std::result::Result<Option<f64>, String> {
        match params.get(k) {
            None | Some(Value::Null) => Ok(None),
            Some(v) => v.as_f64().map(Some).ok_or_else(|| format!("{key}.{k} must be a number, got {v}")),
        }
    };
    let theta = num("rope_theta")?.or(raw.rope_theta).unwrap_or(DEFAULT_ROPE_THETA);
    if !(theta.is_finite() && theta > 0.0) {
        return Err(format!("rope_theta {theta} must be a positive number"));
    }
    let partial = num("partial_rotary_factor")?.or(raw.partial_rotary_factor).unwrap_or(1.0);
    if partial != 1.0 {
        return Err(format!("partial_rotary_factor {partial} is not supported (RoPE over the whole head_dim only)"));
    }
    let kind = match params.get("rope_type").or_else(|| params.get("type")) {
        None | Some(Value::Null) => "default",
        Some(Value::String(s)) => s.as_str(),
        Some(v) => return Err(format!("{key}.rope_type must be a string, got {v}")),
    };
    let scaling = match kind {
        "default" => None,
        "llama3" => {
            let need = |k: &str| num(k)?.ok_or_else(|| format!("{key}.{k} missing (rope_type \"llama3\")"));
            Some(Llama3RopeScaling {
                factor: need("factor")?,
                low_freq_factor: need("low_freq_factor")?,
                high_freq_factor: need("high_freq_factor")?,
                // HF `standardize_rope_params`: defaults to max_position_embeddings.
                original_max_position_embeddings: num("original_max_position_embeddings")?
                    .unwrap_or(max_position_embeddings as f64),
            })
        }
        other => return Err(format!("{key}.rope_type {other:?} is not supported (supported: default, llama3)")),
    };
    Ok((theta, scaling))
}

/// Refuses config fields that change the model's math in a way rlserve does not implement,
/// naming the field, instead of computing a different model: an activation other than
/// SiLU, MLP biases, Llama's `attention_bias` (it also biases `o_proj`), attention or
/// final-logit soft-capping, and sliding-window layers (`layer_types` entries other than
/// `full_attention`; without `layer_types`, Qwen2's `use_sliding_window` with
/// `max_window_layers` below the depth, as HF's `Qwen2Config` derives them).
fn unsupported_math(raw: &RawConfig, arch: Architecture) -> std::result::Result<(), String> {
    if let Some(act) = raw.hidden_act.as_deref().filter(|a| !matches!(*a, "silu" | "swish")) {
        return Err(format!("hidden_act {act:?} is not supported (supported: silu)"));
    }
    if raw.mlp_bias == Some(true) {
        return Err("mlp_bias = true is not supported (MLP projections without bias only)".into());
    }
    if arch != Architecture::Qwen2 && raw.attention_bias == Some(true) {
        return Err(format!(
            "attention_bias = true (biases on q/k/v_proj and o_proj) is not supported for {arch:?}ForCausalLM"
        ));
    }
    for (name, v) in [
        ("attn_logit_softcapping", &raw.attn_logit_softcapping),
        ("final_logit_softcapping", &raw.final_logit_softcapping),
    ] {
        if let Some(v) = v.as_ref().filter(|v| !v.is_null()) {
            return Err(format!("{name} = {v}: logit soft-capping is not supported"));
        }
    }
    if matches!(arch, Architecture::Qwen2 | Architecture::Qwen3) {
        let layers = raw.num_hidden_layers;
        match &raw.layer_types {
            Some(types) => {
                if types.len() != layers {
                    return Err(format!("layer_types has {} entries, num_hidden_layers is {layers}", types.len()));
                }
                if let Some((i, t)) = types.iter().enumerate().find(|(_, t)| *t != "full_attention") {
                    return Err(format!(
                        "layer_types[{i}] = {t:?} is not supported (only full_attention layers; no sliding-window attention)"
                    ));
                }
            }
            None if raw.use_sliding_window == Some(true) => {
                // HF Qwen2Config's and Qwen3Config's default max_window_layers is 28.
                let first = raw.max_window_layers.unwrap_or(28);
                if first < layers {
                    return Err(format!(
                        "use_sliding_window = true makes layers {first}.. sliding-window attention \
                         (max_window_layers {first} < num_hidden_layers {layers}); sliding windows are not supported"
                    ));
                }
            }
            None => {}
        }
    }
    Ok(())
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
            "Qwen3ForCausalLM" => Architecture::Qwen3,
            _ => return Err(ModelError::UnknownArchitecture { path: path.into(), arch: arch_name }),
        };
        let heads = raw.num_attention_heads;
        let kv_heads = raw.num_key_value_heads.unwrap_or(heads);
        if heads == 0 || kv_heads == 0 || !heads.is_multiple_of(kv_heads) {
            return Err(bad(format!(
                "num_attention_heads {heads} must be a positive multiple of num_key_value_heads {kv_heads}"
            )));
        }
        let head_dim = raw.head_dim.unwrap_or(match architecture {
            Architecture::Qwen3 => 128,
            _ => raw.hidden_size / heads,
        });
        if head_dim == 0 || !head_dim.is_multiple_of(2) {
            return Err(bad(format!("head_dim {head_dim} must be positive and even")));
        }
        if raw.hidden_size == 0 || raw.intermediate_size == 0 || raw.num_hidden_layers == 0 || raw.vocab_size == 0 {
            return Err(
                bad("hidden_size, intermediate_size, num_hidden_layers and vocab_size must be positive".into()),
            );
        }
        unsupported_math(&raw, architecture).map_err(bad)?;
        let max_position_embeddings = raw.max_position_embeddings.unwrap_or(match architecture {
            Architecture::Llama => 2048,
            Architecture::Qwen2 | Architecture::Qwen3 => 32768,
        });
        let (rope_theta, rope_scaling) = rope(&raw, max_position_embeddings).map_err(bad)?;
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
            rope_theta,
            rope_scaling,
            max_position_embeddings,
            vocab_size: raw.vocab_size,
            tie_word_embeddings: raw.tie_word_embeddings.unwrap_or(false),
            qkv_bias: architecture == Architecture::Qwen2,
            qk_norm: architecture == Architecture::Qwen3,
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
