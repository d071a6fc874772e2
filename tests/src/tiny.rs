//! Tiny random models written to disk in the HF folder format, so most tests need no download.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use safetensors::tensor::{Dtype, TensorView};
use serde_json::json;
use std::collections::BTreeMap;
use std::path::Path;
use tokenizers::models::bpe::BPE;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::{AddedToken, Tokenizer};

/// Shape and options of a tiny model.
#[derive(Clone, Debug)]
pub struct TinySpec {
    pub architecture: &'static str,
    pub hidden: usize,
    pub intermediate: usize,
    pub layers: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub tied: bool,
    pub dtype: Dtype,
    /// Llama 3 rope scaling `(factor, low, high, original_max)`.
    pub llama3_rope: Option<(f64, f64, f64, f64)>,
    pub seed: u64,
}

/// Special tokens of the tiny tokenizer (ids 256, 257, 258).
pub const SPECIALS: [&str; 3] = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"];
pub const VOCAB: usize = 256 + SPECIALS.len();
pub const CHAT_TEMPLATE: &str = "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

impl Default for TinySpec {
    fn default() -> Self {
        Self {
            architecture: "LlamaForCausalLM",
            hidden: 32,
            intermediate: 48,
            layers: 2,
            heads: 4,
            kv_heads: 2,
            tied: true,
            dtype: Dtype::F32,
            llama3_rope: None,
            seed: 7,
        }
    }
}

impl TinySpec {
    /// `hidden / heads`; for Qwen3 12, not 8 (its `head_dim` is its own config field).
    pub fn head_dim(&self) -> usize {
        if self.is_qwen3() {
            12
        } else {
            self.hidden / self.heads
        }
    }
    pub fn is_qwen3(&self) -> bool {
        self.architecture == "Qwen3ForCausalLM"
    }
    pub fn has_bias(&self) -> bool {
        self.architecture == "Qwen2ForCausalLM"
    }

    /// `config.json` contents.
    pub fn config(&self) -> serde_json::Value {
        let mut c = json!({
            "architectures": [self.architecture],
            "hidden_size": self.hidden, "intermediate_size": self.intermediate,
            "num_hidden_layers": self.layers, "num_attention_heads": self.heads,
            "num_key_value_heads": self.kv_heads, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
            "max_position_embeddings": 128, "vocab_size": VOCAB, "tie_word_embeddings": self.tied,
            "bos_token_id": 257, "eos_token_id": 258,
        });
        if self.is_qwen3() {
            c["head_dim"] = json!(self.head_dim());
        }
        if let Some((f, lo, hi, orig)) = self.llama3_rope {
            c["rope_scaling"] = json!({"rope_type": "llama3", "factor": f, "low_freq_factor": lo, "high_freq_factor": hi, "original_max_position_embeddings": orig});
        }
        c
    }

    /// Random f32 weights by HF name → (shape, values).
    pub fn weights(&self) -> BTreeMap<String, (Vec<usize>, Vec<f32>)> {
        let mut rng = StdRng::seed_from_u64(self.seed);
        let mut w = BTreeMap::new();
        let (h, i, hd) = (self.hidden, self.intermediate, self.head_dim());
        let (q, kv) = (self.heads * hd, self.kv_heads * hd);
        let mut put = |name: String, shape: Vec<usize>, center: f32, scale: f32| {
            let n = shape.iter().product();
            let v = (0..n).map(|_| center + scale * (rng.gen::<f32>() * 2.0 - 1.0)).collect();
            w.insert(name, (shape, v));
        };
        put("model.embed_tokens.weight".into(), vec![VOCAB, h], 0.0, 1.0);
        for l in 0..self.layers {
            let p = format!("model.layers.{l}.");
            put(format!("{p}input_layernorm.weight"), vec![h], 1.0, 0.2);
            put(format!("{p}self_attn.q_proj.weight"), vec![q, h], 0.0, 0.4);
            put(format!("{p}self_attn.k_proj.weight"), vec![kv, h], 0.0, 0.4);
            put(format!("{p}self_attn.v_proj.weight"), vec![kv, h], 0.0, 0.3);
            if self.has_bias() {
                put(format!("{p}self_attn.q_proj.bias"), vec![q], 0.0, 0.5);
                put(format!("{p}self_attn.k_proj.bias"), vec![kv], 0.0, 0.5);
                put(format!("{p}self_attn.v_proj.bias"), vec![kv], 0.0, 0.5);
            }
            if self.is_qwen3() {
                put(format!("{p}self_attn.q_norm.weight"), vec![hd], 1.0, 0.2);
                put(format!("{p}self_attn.k_norm.weight"), vec![hd], 1.0, 0.2);
            }
            put(format!("{p}self_attn.o_proj.weight"), vec![h, q], 0.0, 0.3);
            put(format!("{p}post_attention_layernorm.weight"), vec![h], 1.0, 0.2);
            put(format!("{p}mlp.gate_proj.weight"), vec![i, h], 0.0, 0.3);
            put(format!("{p}mlp.up_proj.weight"), vec![i, h], 0.0, 0.3);
            put(format!("{p}mlp.down_proj.weight"), vec![h, i], 0.0, 0.3);
        }
        put("model.norm.weight".into(), vec![h], 1.0, 0.2);
        if !self.tied {
            put("lm_head.weight".into(), vec![VOCAB, h], 0.0, 0.3);
        }
        w
    }

    /// Writes the whole folder and returns the weights (as stored: rounded to `dtype`).
    pub fn write(&self, dir: &Path) -> BTreeMap<String, (Vec<usize>, Vec<f32>)> {
        self.write_weights(dir, self.weights())
    }

    /// [`Self::write`] with the given weights (e.g. [`Self::weights`] edited by a test).
    pub fn write_weights(
        &self,
        dir: &Path,
        mut w: BTreeMap<String, (Vec<usize>, Vec<f32>)>,
    ) -> BTreeMap<String, (Vec<usize>, Vec<f32>)> {
        std::fs::create_dir_all(dir).unwrap();
        std::fs::write(dir.join("config.json"), serde_json::to_string_pretty(&self.config()).unwrap()).unwrap();
        for (_, v) in w.values_mut() {
            for x in v.iter_mut() {
                *x = match self.dtype {
                    Dtype::BF16 => half::bf16::from_f32(*x).to_f32(),
                    Dtype::F16 => half::f16::from_f32(*x).to_f32(),
                    _ => *x,
                };
            }
        }
        write_safetensors(&dir.join("model.safetensors"), &w, self.dtype);
        write_tokenizer(dir);
        w
    }
}

/// Writes `tensors` as one safetensors file in `dtype` (F32, BF16 or F16).
pub fn write_safetensors(path: &Path, tensors: &BTreeMap<String, (Vec<usize>, Vec<f32>)>, dtype: Dtype) {
    let bytes: Vec<(String, Vec<usize>, Vec<u8>)> = tensors
        .iter()
        .map(|(n, (s, v))| {
            let b: Vec<u8> = match dtype {
                Dtype::BF16 => v.iter().flat_map(|x| half::bf16::from_f32(*x).to_le_bytes()).collect(),
                Dtype::F16 => v.iter().flat_map(|x| half::f16::from_f32(*x).to_le_bytes()).collect(),
                _ => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
            };
            (n.clone(), s.clone(), b)
        })
        .collect();
    let views: Vec<(String, TensorView)> =
        bytes.iter().map(|(n, s, b)| (n.clone(), TensorView::new(dtype, s.clone(), b).unwrap())).collect();
    safetensors::serialize_to_file(views, &None, path).unwrap();
}

/// A byte-level tokenizer: the 256 byte symbols (no merges) plus [`SPECIALS`], and a
/// `tokenizer_config.json` with [`CHAT_TEMPLATE`].
pub fn write_tokenizer(dir: &Path) {
    let mut alphabet: Vec<char> = ByteLevel::alphabet().into_iter().collect();
    alphabet.sort();
    let vocab: tokenizers::models::bpe::Vocab =
        alphabet.iter().enumerate().map(|(i, c)| (c.to_string(), i as u32)).collect();
    let bpe = BPE::builder().vocab_and_merges(vocab, vec![]).build().unwrap();
    let mut tk = Tokenizer::new(bpe);
    tk.with_pre_tokenizer(Some(ByteLevel::new(false, true, true)));
    tk.with_decoder(Some(ByteLevel::default()));
    tk.add_special_tokens(&SPECIALS.iter().map(|s| AddedToken::from(*s, true)).collect::<Vec<_>>());
    tk.save(dir.join("tokenizer.json"), false).unwrap();
    let cfg = json!({"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "chat_template": CHAT_TEMPLATE, "add_bos_token": false});
    std::fs::write(dir.join("tokenizer_config.json"), cfg.to_string()).unwrap();
}
