//! The decoder-only transformer (Llama / Qwen2 family) and its inference forward pass.
//!
//! Forward, per layer (HF `LlamaDecoderLayer`):
//! `h = x + o_proj(attn(rope(q_proj(n1)), rope(k_proj(n1)), v_proj(n1)))` with `n1 = rms_norm(x)`,
//! `x' = h + down_proj(silu(gate_proj(n2)) · up_proj(n2))` with `n2 = rms_norm(h)`;
//! then `logits = lm_head(rms_norm(x_L))` (the embedding matrix when tied).

pub mod config;
mod kv_cache;
mod params;
mod shared;
mod update;
mod weights;

pub use config::{Architecture, ModelConfig};
pub use kv_cache::KvCache;
pub use params::{Fused, Param, ParamId, ParamKind};
pub use shared::SharedModel;
pub use update::{StepSource, WeightDelta};

pub use weights::{write_f32_safetensors, WeightFiles};

use crate::error::Result;
use kernels::ops::{AttnBatch, AttnSeq, PackedWeight};
use kernels::Indices;
use kernels::{ops, Device, Tensor};
use std::collections::BTreeMap;
use std::path::Path;

/// Weights of one decoder layer. Linear weights are `[out, in]`. As in vLLM, the HF
/// projections are fused at load time: `qkv_proj` stacks the rows of `q_proj`, `k_proj`,
/// `v_proj` (`[(H + 2·KVH)·D, hidden]`) and `gate_up_proj` those of `gate_proj`, `up_proj`
/// (`[2·intermediate, hidden]`), so decode reads each layer's weights in 4 passes, not 7.
pub struct LayerWeights {
    pub input_layernorm: Tensor,
    pub qkv_proj: PackedWeight,
    /// `[(H + 2·KVH)·D]` when the model has q/k/v biases (Qwen2).
    pub qkv_bias: Option<Tensor>,
    /// `(q_norm, k_norm)`, `[D]` each, when q and k are RMS-normalised per head (Qwen3).
    pub qk_norm: Option<(Tensor, Tensor)>,
    pub o_proj: PackedWeight,
    pub post_attention_layernorm: Tensor,
    pub gate_up_proj: PackedWeight,
    pub down_proj: PackedWeight,
}

/// A layer's activations, kept by [`Model::layer`] for the learner's backward.
pub struct LayerActs {
    /// The layer's input `[t, hidden]`.
    pub x_in: Tensor,
    /// `input_layernorm(x_in)`.
    pub n1: Tensor,
    /// q and k before the per-head RMSNorm (Qwen3's `q_norm`, `k_norm`).
    pub qk_pre: Option<(Tensor, Tensor)>,
    /// q `[t, H·D]`, k and v `[t, KVH·D]` as attention read them (normed, rotated).
    pub q: Tensor,
    pub k: Tensor,
    pub v: Tensor,
    /// The attention output `[t, H·D]`.
    pub a: Tensor,
    /// `x_in + o_proj(a)`.
    pub x_mid: Tensor,
    /// `post_attention_layernorm(x_mid)`.
    pub n2: Tensor,
    /// `gate_up_proj(n2)` `[t, 2·intermediate]`.
    pub gu: Tensor,
    /// `silu(gate) · up` `[t, intermediate]`.
    pub act: Tensor,
}

impl LayerWeights {
    /// q `[t, H·D]` and k `[t, KVH·D]` RMS-normalised per head with `q_norm`, `k_norm` (each
    /// head's `D` values a row; HF `Qwen3Attention`, before RoPE); unchanged without them.
    /// Part of [`Model::layer`].
    fn norm_qk(&self, c: &ModelConfig, q: Tensor, k: Tensor) -> Result<(Tensor, Tensor)> {
        let Some((qn, kn)) = &self.qk_norm else { return Ok((q, k)) };
        let norm = |x: Tensor, w: &Tensor| -> Result<Tensor> {
            let (shape, n) = (x.shape().to_vec(), x.len());
            let rows = x.reshape(&[n / c.head_dim, c.head_dim])?;
            Ok(ops::rms_norm(&rows, w, c.rms_norm_eps)?.reshape(&shape)?)
        };
        Ok((norm(q, qn)?, norm(k, kn)?))
    }
}

/// A loaded model: config, f32 weights and RoPE tables, on one device.
pub struct Model {
    pub config: ModelConfig,
    /// The embedding `[vocab, hidden]`; `None` when tied: the lookup reads the LM head's
    /// rows ([`Self::embed`]), so the matrix has one copy, updated once.
    pub embed_tokens: Option<Tensor>,
    pub layers: Vec<LayerWeights>,
    pub norm: Tensor,
    /// The LM head `[vocab, hidden]`, packed (the tied embedding's only copy).
    pub lm_head: PackedWeight,
    /// Policy version (DESIGN-NOTES §2): 0 for loaded weights (or the checkpoint's version
    /// on resume), +1 per optimizer step. Every generated token records it.
    pub version: u64,
    /// Unique per loaded set of weight buffers ([`Self::weights_id`]).
    weights_id: u64,
    rope_cos: Tensor,
    rope_sin: Tensor,
    device: Device,
}

impl Model {
    /// Loads `config.json` and the safetensors weights of a HF model folder.
    /// Errors name the file, the tensor and the expected shape.
    pub fn load(dir: &Path, device: &Device) -> Result<Self> {
        let config = ModelConfig::from_dir(dir)?;
        let files = WeightFiles::open(dir)?;
        Self::from_files(config, &files, device)
    }

    /// Builds the model from already opened weight files.
    pub fn from_files(config: ModelConfig, files: &WeightFiles, device: &Device) -> Result<Self> {
        Self::from_source(config, &|name, shape| files.load(name, shape), device)
    }

    /// Builds the model from HF-named host tensors: `host(name, expected shape)`.
    pub fn from_source(
        config: ModelConfig,
        host: &dyn Fn(&str, &[usize]) -> Result<Tensor>,
        device: &Device,
    ) -> Result<Self> {
        use ParamKind::*;
        let c = &config;
        let table = c.layer_params();
        let shape = |kind: ParamKind| &table.iter().find(|(k, _)| *k == kind).expect("a row of the table").1;
        // Loaded on the host, fused, then moved to the device.
        let dev = |t: Tensor| -> Result<Tensor> { Ok(t.to_device(device)?) };
        let mut layers = Vec::with_capacity(c.num_hidden_layers);
        for l in 0..c.num_hidden_layers {
            let get = |kind: ParamKind| host(&ParamId::layer(l, kind).name(), shape(kind));
            let gets = |kinds: &[ParamKind]| kinds.iter().map(|&k| get(k)).collect::<Result<Vec<_>>>();
            let qkv_w = gets(&[QProj, KProj, VProj])?;
            let qkv_bias = if c.qkv_bias {
                let b = gets(&[QBias, KBias, VBias])?;
                let len = b.iter().map(|t| t.len()).sum::<usize>();
                Some(dev(ops::cat_cols(&b.iter().collect::<Vec<_>>())?.reshape(&[len])?)?)
            } else {
                None
            };
            let qk_norm = if c.qk_norm { Some((dev(get(QNorm)?)?, dev(get(KNorm)?)?)) } else { None };
            let gate_up = gets(&[GateProj, UpProj])?;
            layers.push(LayerWeights {
                input_layernorm: dev(get(InputNorm)?)?,
                qkv_proj: ops::pack_weight(&dev(ops::cat_rows(&qkv_w.iter().collect::<Vec<_>>())?)?)?,
                qkv_bias,
                qk_norm,
                o_proj: ops::pack_weight(&dev(get(OProj)?)?)?,
                post_attention_layernorm: dev(get(PostNorm)?)?,
                gate_up_proj: ops::pack_weight(&dev(ops::cat_rows(&gate_up.iter().collect::<Vec<_>>())?)?)?,
                down_proj: ops::pack_weight(&dev(get(DownProj)?)?)?,
            });
        }
        let h = c.hidden_size;
        let get = |kind: ParamKind, shape: &[usize]| dev(host(kind.suffix(), shape)?);
        // Some tied checkpoints still ship lm_head.weight; the tie wins, as in HF.
        let (embed_tokens, lm_head) = if c.tie_word_embeddings {
            (None, ops::pack_weight(&get(Embed, &[c.vocab_size, h])?)?)
        } else {
            (Some(get(Embed, &[c.vocab_size, h])?), ops::pack_weight(&get(LmHead, &[c.vocab_size, h])?)?)
        };
        let norm = get(FinalNorm, &[h])?;
        let (rope_cos, rope_sin) = rope_tables(c, device)?;
        Ok(Model {
            config,
            embed_tokens,
            layers,
            norm,
            lm_head,
            version: 0,
            weights_id: {
                static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
                NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
            },
            rope_cos,
            rope_sin,
            device: device.clone(),
        })
    }

    pub fn device(&self) -> &Device {
        &self.device
    }

    /// Names this model's weight buffers: unique per [`Model`] built in the process, kept by
    /// an in-place update (the buffers stay where they are), new when a checkpoint's weights
    /// replace the model. A captured CUDA graph holds the addresses of the buffers it was
    /// captured with, so it is replayed only while this id is unchanged.
    pub fn weights_id(&self) -> u64 {
        self.weights_id
    }

    /// A KV cache on this model's device for up to `capacity` tokens (blocks of
    /// [`CONTIGUOUS_BLOCK`] slots, used in order).
    pub fn new_cache(&self, capacity: usize) -> Result<KvCache> {
        let blocks = capacity.div_ceil(CONTIGUOUS_BLOCK);
        let mut cache = KvCache::new(&self.config, blocks, CONTIGUOUS_BLOCK, &self.device, false)?;
        cache.set_capacity(capacity);
        Ok(cache)
    }

    /// Single-sequence forward over a contiguous cache: runs `tokens` (new tokens at
    /// positions `cache.len()..`), appending their K/V to `cache`. Returns logits
    /// `[tokens.len(), vocab]` when `all_logits`, else the last row only, `[1, vocab]`.
    /// Errors on an empty input, a token id ≥ vocab or a full cache.
    pub fn forward(&self, tokens: &[u32], cache: &mut KvCache, all_logits: bool) -> Result<Tensor> {
        let (t, past) = (tokens.len(), cache.len());
        if t == 0 {
            return Err(kernels::KernelError::Shape { op: "forward", detail: "no input tokens".into() }.into());
        }
        let context = cache.capacity().min(self.max_positions());
        if past + t > context {
            let detail = format!("{past} cached + {t} new tokens exceed the context of {context}");
            return Err(kernels::KernelError::Shape { op: "forward", detail }.into());
        }
        // The contiguous cache's blocks hold the positions in order: slot p is position p.
        let bs = cache.block_size();
        let batch = ForwardBatch {
            tokens: tokens.to_vec(),
            positions: (past..past + t).collect(),
            slot_mapping: (past as u32..(past + t) as u32).collect(),
            seqs: vec![BatchSeq {
                rows: 0..t,
                start_pos: past,
                block_table: (0..(past + t).div_ceil(bs) as u32).collect(),
            }],
            block_size: bs,
            logit_rows: if all_logits { (0..t).collect() } else { vec![t - 1] },
        };
        let logits = self.forward_batch(&batch, cache)?;
        cache.advance(t);
        Ok(logits)
    }

    /// The HF name and shape of every weight [`Self::named_weights`] returns, without
    /// touching the weights (what a gradient of the whole model is keyed by).
    pub fn weight_shapes(&self) -> Vec<(String, Vec<usize>)> {
        self.config.params().into_iter().map(|p| (p.id.name(), p.shape)).collect()
    }

    /// Every weight under its HF name and shape (the fused and packed projections split
    /// back), on the model's device. With tied embeddings there is no `lm_head.weight`.
    pub fn named_weights(&self) -> Result<BTreeMap<String, Tensor>> {
        use ParamKind::*;
        let c = &self.config;
        let table = c.layer_params();
        let rows = |kinds: &[ParamKind]| -> Vec<usize> {
            kinds.iter().map(|k| table.iter().find(|(t, _)| t == k).map_or(0, |(_, s)| s[0])).collect()
        };
        let mut out = BTreeMap::new();
        let embed = match &self.embed_tokens {
            Some(e) => e.clone(),
            None => ops::unpack_weight(&self.lm_head)?,
        };
        out.insert(ParamId::model(Embed).name(), embed);
        out.insert(ParamId::model(FinalNorm).name(), self.norm.clone());
        if !c.tie_word_embeddings {
            out.insert(ParamId::model(LmHead).name(), ops::unpack_weight(&self.lm_head)?);
        }
        for (l, w) in self.layers.iter().enumerate() {
            // The fused buffers split back into their row blocks (the table's `Fused`).
            let qkv = ops::split_rows(&ops::unpack_weight(&w.qkv_proj)?, &rows(&[QProj, KProj, VProj]))?;
            let gate_up = ops::split_rows(&ops::unpack_weight(&w.gate_up_proj)?, &rows(&[GateProj, UpProj]))?;
            let bias = match &w.qkv_bias {
                Some(b) => ops::split_cols(&b.clone().reshape(&[1, b.len()])?, &rows(&[QBias, KBias, VBias]))?,
                None => vec![],
            };
            for (kind, shape) in &table {
                let t = match (kind.fused(), kind) {
                    (Fused::Qkv(j), _) => qkv[j].clone(),
                    (Fused::GateUp(j), _) => gate_up[j].clone(),
                    (Fused::QkvBias(j), _) => bias[j].clone(),
                    (Fused::Own, InputNorm) => w.input_layernorm.clone(),
                    (Fused::Own, PostNorm) => w.post_attention_layernorm.clone(),
                    (Fused::Own, QNorm | KNorm) => {
                        let (qn, kn) = w.qk_norm.as_ref().expect("the table lists q/k norms only when loaded");
                        if *kind == QNorm {
                            qn.clone()
                        } else {
                            kn.clone()
                        }
                    }
                    (Fused::Own, OProj) => ops::unpack_weight(&w.o_proj)?,
                    (Fused::Own, DownProj) => ops::unpack_weight(&w.down_proj)?,
                    (Fused::Own, other) => unreachable!("{other:?} is not a layer weight"),
                };
                out.insert(ParamId::layer(l, *kind).name(), t.reshape(shape)?);
            }
        }
        Ok(out)
    }

    /// RoPE `(cos, sin)` tables `[max_positions, head_dim/2]`.
    pub fn rope_tables(&self) -> (&Tensor, &Tensor) {
        (&self.rope_cos, &self.rope_sin)
    }

    /// Positions the RoPE tables cover (`max_position_embeddings`).
    pub fn max_positions(&self) -> usize {
        self.rope_cos.shape()[0]
    }

    /// Forward pass of a batch of sequences' new tokens over a slot-addressed KV cache:
    /// writes each token's K/V to `slot_mapping`, attends through each sequence's slots, and
    /// returns the logits of `logit_rows`, `[logit_rows.len(), vocab]`. Every row's result is
    /// independent of the rest of the batch (batch-invariant kernels).
    pub fn forward_batch(&self, batch: &ForwardBatch, cache: &mut KvCache) -> Result<Tensor> {
        // Run on a rayon worker so each op's parallel loop starts without a cross-thread handoff.
        // A small batch's products are short (0.05–0.5 ms): the other workers are kept polling
        // between them instead of falling asleep ([`kernels::cpu::hot_pool`]). Not for larger
        // batches, whose products are long enough that no worker sleeps between them, and
        // where the polling only contended with the caller's queue (64-sequence decode,
        // 8 alternations: 258 vs 277 tok/s median). Not on CUDA either: its products run on the
        // device, and polling workers would only take the host's cores from the launches.
        rayon::scope(|_| {
            if batch.tokens.len() <= HOT_POOL_TOKENS && matches!(self.device, Device::Cpu) {
                kernels::cpu::hot_pool::hot(|| self.forward_inner(batch, cache))
            } else {
                self.forward_inner(batch, cache)
            }
        })
    }

    fn forward_inner(&self, b: &ForwardBatch, cache: &mut KvCache) -> Result<Tensor> {
        let seqs: Vec<AttnSeq> = b
            .seqs
            .iter()
            .map(|s| AttnSeq { rows: s.rows.clone(), start_pos: s.start_pos, block_table: &s.block_table })
            .collect();
        // The step's indices, built once: a device uploads each once and every layer reads
        // the resident copy (docs/ARCHITECTURE.md, "The step's indices").
        let inputs = StepInputs {
            tokens: Indices::new(b.tokens.clone()),
            positions: b.positions.iter().map(|&p| p as u32).collect(),
            slots: Indices::new(b.slot_mapping.clone()),
            attn: AttnBatch::new(&seqs, b.block_size)?,
            logit_rows: b.logit_rows.iter().map(|&r| r as u32).collect(),
        };
        self.forward_step(&inputs, cache)
    }

    /// One decoder layer over `x [t, hidden]` at `positions` (pre-norm, HF `LlamaDecoderLayer`
    /// / `Qwen2DecoderLayer` / `Qwen3DecoderLayer`): `x + o_proj(attend(q, k, v))`, then
    /// `+ down_proj(silu(gate) · up)` of its post-attention norm. `attend` maps the rotated
    /// q `[t, H·D]`, k and v `[t, KVH·D]` to the attention output `[t, H·D]`: the engine's
    /// writes k, v into the KV cache and reads it (paged attention), the learner's attends
    /// within its packed sequences. The one layer forward of both, so the learner's ℓ is the
    /// engine's computation by construction. With `keep`, also the activations the
    /// learner's backward reads.
    pub fn layer(
        &self,
        w: &LayerWeights,
        x: Tensor,
        positions: &Indices,
        attend: impl FnOnce(&Tensor, &Tensor, &Tensor) -> Result<Tensor>,
        keep: bool,
    ) -> Result<(Tensor, Option<LayerActs>)> {
        let c = &self.config;
        let (q_dim, kv_dim) = (c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim);
        let n1 = ops::rms_norm(&x, &w.input_layernorm, c.rms_norm_eps)?;
        let qkv = ops::linear(&n1, &w.qkv_proj, w.qkv_bias.as_ref())?;
        let [q, k, v]: [Tensor; 3] = ops::split_cols(&qkv, &[q_dim, kv_dim, kv_dim])?.try_into().expect("three parts");
        let qk_pre = (keep && w.qk_norm.is_some()).then(|| (q.clone(), k.clone()));
        let (mut q, mut k) = w.norm_qk(c, q, k)?;
        ops::rope_inplace(&mut q, positions, &self.rope_cos, &self.rope_sin, c.head_dim)?;
        ops::rope_inplace(&mut k, positions, &self.rope_cos, &self.rope_sin, c.head_dim)?;
        let a = attend(&q, &k, &v)?;
        let x_in = keep.then(|| x.clone());
        let mut x = x;
        ops::add_inplace(&mut x, &ops::linear(&a, &w.o_proj, None)?)?;
        let x_mid = keep.then(|| x.clone());
        let n2 = ops::rms_norm(&x, &w.post_attention_layernorm, c.rms_norm_eps)?;
        let gu = ops::linear(&n2, &w.gate_up_proj, None)?;
        let act = ops::silu_mul(&gu)?;
        ops::add_inplace(&mut x, &ops::linear(&act, &w.down_proj, None)?)?;
        let acts = match (x_in, x_mid) {
            (Some(x_in), Some(x_mid)) => Some(LayerActs { x_in, n1, qk_pre, q, k, v, a, x_mid, n2, gu, act }),
            _ => None,
        };
        Ok((x, acts))
    }

    /// The embedding rows of `tokens` `[tokens.len(), hidden]` (from the LM head's buffer
    /// when tied). Errors on an id ≥ vocab.
    pub fn embed<'a>(&self, tokens: impl Into<kernels::Idx<'a>>) -> Result<Tensor> {
        Ok(match &self.embed_tokens {
            Some(e) => ops::embedding(e, tokens)?,
            None => ops::embedding_packed(&self.lm_head, tokens)?,
        })
    }

    /// The forward of one step's [`StepInputs`] over `cache`: logits `[logit_rows, vocab]`.
    /// [`Self::forward_batch`] builds the inputs from a [`ForwardBatch`]; the model runner's
    /// decode graphs build them over a step plan's device buffer and capture this call.
    pub fn forward_step(&self, inputs: &StepInputs, cache: &mut KvCache) -> Result<Tensor> {
        let c = &self.config;
        let StepInputs { tokens, positions, slots, attn, logit_rows } = inputs;
        let mut x = self.embed(tokens)?;
        let heads = (c.num_attention_heads, c.num_key_value_heads, c.head_dim);
        for (l, w) in self.layers.iter().enumerate() {
            let attend = |q: &Tensor, k: &Tensor, v: &Tensor| -> Result<Tensor> {
                cache.write(l, slots, k, v)?;
                let (kc, vc) = cache.layer(l);
                Ok(ops::paged_attention(q, kc, vc, attn, heads.0, heads.1, heads.2, cache.layout())?)
            };
            x = self.layer(w, x, positions, attend, false)?.0;
        }
        // Only the requested rows go through the final norm and LM head (a row gather).
        let x = ops::embedding(&x, logit_rows)?;
        let x = ops::rms_norm(&x, &self.norm, c.rms_norm_eps)?;
        Ok(ops::linear(&x, &self.lm_head, None)?)
    }
}

/// Slots per block of [`Model::new_cache`]'s contiguous cache (a multiple of 16, so the CPU
/// stores its keys as columns: [`kernels::ops::KvLayout::Blocked`]).
const CONTIGUOUS_BLOCK: usize = 16;

/// Batches of at most this many new tokens run with the rayon pool kept awake
/// ([`Model::forward_batch`]).
const HOT_POOL_TOKENS: usize = 16;

/// One sequence of a [`ForwardBatch`].
#[derive(Debug, Clone)]
pub struct BatchSeq {
    /// Rows of the batch holding this sequence's new tokens.
    pub rows: std::ops::Range<usize>,
    /// Position of the first new token.
    pub start_pos: usize,
    /// The KV blocks of positions `0..start_pos + rows.len()`, in order.
    pub block_table: Vec<u32>,
}

/// A step's index arguments as the forward reads them ([`Model::forward_step`]): on a CUDA
/// device each is uploaded once per step (or is a view of a step plan) and read by every
/// layer.
pub struct StepInputs {
    /// Token id per row `[t]`.
    pub tokens: Indices,
    /// Position per row (RoPE) `[t]`.
    pub positions: Indices,
    /// KV slot per row `[t]`.
    pub slots: Indices,
    pub attn: AttnBatch,
    /// The rows whose logits are returned, in order.
    pub logit_rows: Indices,
}

/// The new tokens of several sequences, flattened, for [`Model::forward_batch`].
#[derive(Debug, Clone, Default)]
pub struct ForwardBatch {
    pub tokens: Vec<u32>,
    /// Position of each token (for RoPE).
    pub positions: Vec<usize>,
    /// KV slot each token's K/V is written to (`block · block_size + offset`).
    pub slot_mapping: Vec<u32>,
    pub seqs: Vec<BatchSeq>,
    /// Token slots per KV block.
    pub block_size: usize,
    /// Rows whose logits are returned, in this order.
    pub logit_rows: Vec<usize>,
}

/// cos/sin tables `[max_position_embeddings, head_dim/2]`, computed in f64 then rounded.
fn rope_tables(c: &ModelConfig, device: &Device) -> Result<(Tensor, Tensor)> {
    let inv = c.rope_inv_freq();
    let n = c.max_position_embeddings;
    let (mut cos, mut sin) = (Vec::with_capacity(n * inv.len()), Vec::with_capacity(n * inv.len()));
    for p in 0..n {
        for f in &inv {
            let a = p as f64 * f;
            cos.push(a.cos() as f32);
            sin.push(a.sin() as f32);
        }
    }
    let shape = [n, inv.len()];
    Ok((Tensor::from_vec(cos, &shape)?.to_device(device)?, Tensor::from_vec(sin, &shape)?.to_device(device)?))
}
