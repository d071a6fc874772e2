//! The learner's training forward and hand-written backward over the served weights.
//!
//! A sequence is `prompt ++ completion`; the learner logprob of completion token `i` is
//! `ℓ_i = log softmax(z_{p−1+i} / T)[c_i]` (p = prompt length) with the temperature the
//! token was sampled at (DESIGN-NOTES §3). A batch is packed: the sequences' rows are
//! concatenated without padding, every linear layer runs once over all rows, and attention
//! is per sequence (each row sees only its own sequence). Only completion rows carry loss:
//! prompt positions get gradient only through attention, exactly as in autodiff.
//!
//! Backward per layer (reverse of `Model::forward_inner`): down_proj → SwiGLU →
//! gate_up_proj → post-attention RMSNorm → o_proj → attention (probabilities recomputed)
//! → inverse RoPE → qkv_proj (+bias) → input RMSNorm; then the embedding scatter-add
//! (plus the LM-head gradient when tied). Gradients use HF tensor names and layouts.

pub mod advantages;
mod error;
pub mod checkpoint;
mod grads;
pub mod loss;
pub mod optim;
mod trainer;

pub use error::{LearnerError, Result};
pub use grads::Grads;
pub use trainer::{StepMetrics, TrainConfig, TrainSample, Trainer};


use engine::Model;
use engine::sampling::token_logprob;
use kernels::ops::AttnSeq;
use kernels::{ops, Tensor};

struct LayerActs {
    x_in: Tensor,
    n1: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    a: Tensor,
    x_mid: Tensor,
    n2: Tensor,
    gu: Tensor,
    act: Tensor,
}

/// What the forward keeps of one layer: everything, or only its input (gradient
/// checkpointing: the rest is recomputed in backward, bitwise the same).
enum Saved {
    Full(LayerActs),
    Input(Tensor),
}

/// One decoder layer's training forward: its activations and its output.
fn layer_forward(
    model: &Model,
    w: &engine::model::LayerWeights,
    x: Tensor,
    positions: &[usize],
    attn: &[AttnSeq],
) -> Result<(LayerActs, Tensor)> {
    let c = &model.config;
    let (q_dim, kv_dim) = (c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim);
    let (cos, sin) = model.rope_tables();
    let n1 = ops::rms_norm(&x, &w.input_layernorm, c.rms_norm_eps)?;
    let qkv = ops::linear(&n1, &w.qkv_proj, w.qkv_bias.as_ref())?;
    let [mut q, mut k, v]: [Tensor; 3] =
        ops::split_cols(&qkv, &[q_dim, kv_dim, kv_dim])?.try_into().expect("three parts");
    ops::rope_inplace(&mut q, positions, cos, sin, c.head_dim)?;
    ops::rope_inplace(&mut k, positions, cos, sin, c.head_dim)?;
    let a = ops::paged_attention(&q, &k, &v, attn, c.num_attention_heads, c.num_key_value_heads, c.head_dim)?;
    let mut x_mid = x.clone();
    ops::add_inplace(&mut x_mid, &ops::linear(&a, &w.o_proj, None)?)?;
    let n2 = ops::rms_norm(&x_mid, &w.post_attention_layernorm, c.rms_norm_eps)?;
    let gu = ops::linear(&n2, &w.gate_up_proj, None)?;
    let act = ops::silu_mul(&gu)?;
    let mut x_out = x_mid.clone();
    ops::add_inplace(&mut x_out, &ops::linear(&act, &w.down_proj, None)?)?;
    Ok((LayerActs { x_in: x, n1, q, k, v, a, x_mid, n2, gu, act }, x_out))
}

/// Per-sequence attention views of a packed batch (each row sees its own sequence).
fn attn_seqs<'a>(spans: &[std::ops::Range<usize>], slots: &'a [Vec<u32>]) -> Vec<AttnSeq<'a>> {
    spans.iter().zip(slots).map(|(s, sl)| AttnSeq { rows: s.clone(), start_pos: 0, slots: sl }).collect()
}

/// The saved activations of a packed batch's training forward.
pub struct SeqForward {
    inputs: Vec<u32>,
    /// Row range of each sequence in the packed batch.
    spans: Vec<std::ops::Range<usize>>,
    /// Rows whose logits predict the completion tokens.
    pred_rows: Vec<u32>,
    /// Completion tokens of all sequences, concatenated.
    completion: Vec<u32>,
    /// Completion length of each sequence.
    pub lens: Vec<usize>,
    temperature: f32,
    layers: Vec<Saved>,
    /// Final hidden states of the completion-predicting rows, before the last norm.
    h_rows: Tensor,
    normed: Tensor,
    /// Logits of the completion-predicting rows `[Σ C, vocab]`.
    logits: Tensor,
    /// ℓ of each completion token (all sequences, concatenated).
    pub logprobs: Vec<f32>,
    /// Entropy of π_θ(· | prefix) at temperature T for each completion position (nats).
    pub entropies: Vec<f32>,
}

/// Training forward of one `prompt ++ completion` at `temperature`.
pub fn forward(model: &Model, prompt: &[u32], completion: &[u32], temperature: f32) -> Result<SeqForward> {
    forward_batch(model, &[(prompt, completion)], temperature)
}

/// Training forward of a packed batch of `(prompt, completion)` pairs: saves what backward needs.
pub fn forward_batch(model: &Model, seqs: &[(&[u32], &[u32])], temperature: f32) -> Result<SeqForward> {
    forward_batch_with(model, seqs, temperature, false)
}

/// [`forward_batch`]; with `gradient_checkpointing` only each layer's input is kept and the
/// rest is recomputed during backward (less memory, one more forward of compute).
pub fn forward_batch_with(
    model: &Model,
    seqs: &[(&[u32], &[u32])],
    temperature: f32,
    gradient_checkpointing: bool,
) -> Result<SeqForward> {
    rayon::scope(|_| forward_inner(model, seqs, temperature, gradient_checkpointing))
}

fn forward_inner(
    model: &Model,
    seqs: &[(&[u32], &[u32])],
    temperature: f32,
    gradient_checkpointing: bool,
) -> Result<SeqForward> {
    let c = &model.config;
    let bad = |d: String| -> Result<SeqForward> {
        Err(kernels::KernelError::Shape { op: "learner forward", detail: d }.into())
    };
    let (mut inputs, mut positions, mut spans, mut pred_rows, mut completion, mut lens) =
        (vec![], vec![], vec![], vec![], vec![], vec![]);
    for (prompt, comp) in seqs {
        if prompt.is_empty() || comp.is_empty() {
            return bad("prompt and completion must be non-empty".into());
        }
        let r0 = inputs.len();
        inputs.extend(prompt.iter().chain(&comp[..comp.len() - 1]));
        let t = inputs.len() - r0;
        if t > model.max_positions() {
            return bad(format!("{t} positions exceed the context of {}", model.max_positions()));
        }
        positions.extend(0..t);
        spans.push(r0..r0 + t);
        pred_rows.extend((r0 + prompt.len() - 1..r0 + t).map(|r| r as u32));
        completion.extend_from_slice(comp);
        lens.push(comp.len());
    }
    let slots: Vec<Vec<u32>> = spans.iter().map(|s| (s.start as u32..s.end as u32).collect()).collect();
    let attn = attn_seqs(&spans, &slots);
    let mut x = ops::embedding(&model.embed_tokens, &inputs)?;
    let mut layers = Vec::with_capacity(model.layers.len());
    for w in &model.layers {
        let (acts, x_out) = layer_forward(model, w, x, &positions, &attn)?;
        layers.push(if gradient_checkpointing { Saved::Input(acts.x_in) } else { Saved::Full(acts) });
        x = x_out;
    }
    let h_rows = ops::embedding(&x, &pred_rows)?;
    let normed = ops::rms_norm(&h_rows, &model.norm, c.rms_norm_eps)?;
    let logits = ops::linear(&normed, &model.lm_head, None)?;
    let v = c.vocab_size;
    let ls = logits.as_slice()?;
    let logprobs = completion
        .iter()
        .enumerate()
        .map(|(i, &tok)| token_logprob(&ls[i * v..(i + 1) * v], tok as usize, temperature))
        .collect();
    let entropies = ls.chunks(v).map(|row| entropy(row, temperature)).collect();
    Ok(SeqForward {
        inputs,
        spans,
        pred_rows,
        completion,
        lens,
        temperature,
        layers,
        h_rows,
        normed,
        logits,
        logprobs,
        entropies,
    })
}

impl SeqForward {
    /// Accumulates into `grads` the gradient of a loss whose derivative w.r.t. each
    /// completion logprob ℓ_i (all sequences, concatenated) is `dl_dlogp[i]`.
    pub fn backward(&self, model: &Model, dl_dlogp: &[f32], grads: &mut Grads) -> Result<()> {
        rayon::scope(|_| self.backward_inner(model, dl_dlogp, None, grads))
    }

    /// Like [`Self::backward`], with an extra loss term whose derivative w.r.t. each
    /// completion position's entropy `H_i` is `dl_dentropy[i]` (the entropy bonus):
    /// `dH/dz_j = −(1/T)·p_j·(ln p_j + H)`.
    pub fn backward_with_entropy(
        &self,
        model: &Model,
        dl_dlogp: &[f32],
        dl_dentropy: &[f32],
        grads: &mut Grads,
    ) -> Result<()> {
        rayon::scope(|_| self.backward_inner(model, dl_dlogp, Some(dl_dentropy), grads))
    }

    fn backward_inner(
        &self,
        model: &Model,
        dl_dlogp: &[f32],
        dl_dentropy: Option<&[f32]>,
        grads: &mut Grads,
    ) -> Result<()> {
        let c = &model.config;
        let (h, v, t) = (c.hidden_size, c.vocab_size, self.inputs.len());
        let (q_dim, kv_dim) = (c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim);
        assert_eq!(dl_dlogp.len(), self.completion.len(), "one gradient per completion token");
        // dℓ/dz = (onehot − softmax(z/T)) / T, scaled by dL/dℓ; plus the entropy term.
        let tinv = 1.0 / self.temperature as f64;
        let mut dz = ops::softmax(&scale(&self.logits, tinv as f32)?)?.to_vec();
        for (i, (&tok, &g)) in self.completion.iter().zip(dl_dlogp).enumerate() {
            let row = &mut dz[i * v..(i + 1) * v];
            let (e, hh) = (dl_dentropy.map_or(0.0, |d| d[i] as f64), self.entropies[i] as f64);
            for (j, x) in row.iter_mut().enumerate() {
                let p = *x as f64;
                let onehot = if j == tok as usize { 1.0 } else { 0.0 };
                let dh = if p > 0.0 { -tinv * p * (p.ln() + hh) } else { 0.0 };
                *x = (g as f64 * tinv * (onehot - p) + e * dh) as f32;
            }
        }
        let dz = Tensor::from_vec(dz, &[self.completion.len(), v])?;
        let d_normed = ops::linear_grad_input(&dz, &model.lm_head)?;
        let d_head = ops::linear_grad_weight(&dz, &self.normed)?;
        let head_name = if c.tie_word_embeddings { "model.embed_tokens.weight" } else { "lm_head.weight" };
        grads.add(head_name, &[v, h], d_head.as_slice()?);
        let (dh_rows, dnorm) = ops::rms_norm_backward(&self.h_rows, &model.norm, &d_normed, c.rms_norm_eps)?;
        grads.add("model.norm.weight", &[h], dnorm.as_slice()?);
        // Scatter the completion-row gradients back to their rows.
        let mut dx = Tensor::zeros(&[t, h], model.device());
        ops::scatter_rows(&mut dx, &self.pred_rows, &dh_rows)?;
        let positions: Vec<usize> = self.spans.iter().flat_map(|s| 0..s.len()).collect();
        let (cos, sin) = model.rope_tables();
        let neg_sin = scale(sin, -1.0)?;
        let slots: Vec<Vec<u32>> = self.spans.iter().map(|s| (s.start as u32..s.end as u32).collect()).collect();
        let attn = attn_seqs(&self.spans, &slots);
        for (l, (w, saved)) in model.layers.iter().zip(&self.layers).enumerate().rev() {
            let recomputed;
            let s = match saved {
                Saved::Full(a) => a,
                Saved::Input(x) => {
                    recomputed = layer_forward(model, w, x.clone(), &positions, &attn)?.0;
                    &recomputed
                }
            };
            let p = format!("model.layers.{l}.");
            // MLP.
            let d_act = ops::linear_grad_input(&dx, &w.down_proj)?;
            grads.add(
                &format!("{p}mlp.down_proj.weight"),
                &[h, c.intermediate_size],
                ops::linear_grad_weight(&dx, &s.act)?.as_slice()?,
            );
            let d_gu = ops::silu_mul_backward(&s.gu, &d_act)?;
            let dw_gu = ops::linear_grad_weight(&d_gu, &s.n2)?;
            let (gate, up) = dw_gu.as_slice()?.split_at(c.intermediate_size * h);
            grads.add(&format!("{p}mlp.gate_proj.weight"), &[c.intermediate_size, h], gate);
            grads.add(&format!("{p}mlp.up_proj.weight"), &[c.intermediate_size, h], up);
            let d_n2 = ops::linear_grad_input(&d_gu, &w.gate_up_proj)?;
            let (d_mid, dw_post) =
                ops::rms_norm_backward(&s.x_mid, &w.post_attention_layernorm, &d_n2, c.rms_norm_eps)?;
            grads.add(&format!("{p}post_attention_layernorm.weight"), &[h], dw_post.as_slice()?);
            ops::add_inplace(&mut dx, &d_mid)?;
            // Attention, per sequence.
            let d_a = ops::linear_grad_input(&dx, &w.o_proj)?;
            grads.add(
                &format!("{p}self_attn.o_proj.weight"),
                &[h, q_dim],
                ops::linear_grad_weight(&dx, &s.a)?.as_slice()?,
            );
            let mut dq = Tensor::zeros(&[t, q_dim], model.device());
            let mut dk = Tensor::zeros(&[t, kv_dim], model.device());
            let mut dv = Tensor::zeros(&[t, kv_dim], model.device());
            for span in &self.spans {
                let rows: Vec<u32> = (span.start as u32..span.end as u32).collect();
                let g = |x: &Tensor| ops::embedding(x, &rows);
                let (q, k, vv, da) = (g(&s.q)?, g(&s.k)?, g(&s.v)?, g(&d_a)?);
                let (sq, sk, sv) = ops::attention_backward(
                    &q,
                    &k,
                    &vv,
                    &da,
                    c.num_attention_heads,
                    c.num_key_value_heads,
                    c.head_dim,
                )?;
                ops::scatter_rows(&mut dq, &rows, &sq)?;
                ops::scatter_rows(&mut dk, &rows, &sk)?;
                ops::scatter_rows(&mut dv, &rows, &sv)?;
            }
            ops::rope_inplace(&mut dq, &positions, cos, &neg_sin, c.head_dim)?;
            ops::rope_inplace(&mut dk, &positions, cos, &neg_sin, c.head_dim)?;
            let dqkv = ops::cat_cols(&[&dq, &dk, &dv])?;
            let dw_qkv = ops::linear_grad_weight(&dqkv, &s.n1)?;
            let (dwq, rest) = dw_qkv.as_slice()?.split_at(q_dim * h);
            let (dwk, dwv) = rest.split_at(kv_dim * h);
            grads.add(&format!("{p}self_attn.q_proj.weight"), &[q_dim, h], dwq);
            grads.add(&format!("{p}self_attn.k_proj.weight"), &[kv_dim, h], dwk);
            grads.add(&format!("{p}self_attn.v_proj.weight"), &[kv_dim, h], dwv);
            if c.qkv_bias {
                let n = q_dim + 2 * kv_dim;
                let mut db = vec![0.0f32; n];
                for row in dqkv.as_slice()?.chunks(n) {
                    for (b, g) in db.iter_mut().zip(row) {
                        *b += g;
                    }
                }
                grads.add(&format!("{p}self_attn.q_proj.bias"), &[q_dim], &db[..q_dim]);
                grads.add(&format!("{p}self_attn.k_proj.bias"), &[kv_dim], &db[q_dim..q_dim + kv_dim]);
                grads.add(&format!("{p}self_attn.v_proj.bias"), &[kv_dim], &db[q_dim + kv_dim..]);
            }
            let d_n1 = ops::linear_grad_input(&dqkv, &w.qkv_proj)?;
            let (d_in, dw_in) = ops::rms_norm_backward(&s.x_in, &w.input_layernorm, &d_n1, c.rms_norm_eps)?;
            grads.add(&format!("{p}input_layernorm.weight"), &[h], dw_in.as_slice()?);
            ops::add_inplace(&mut dx, &d_in)?;
        }
        // Embedding: scatter-add rows.
        let mut de = vec![0.0f32; v * h];
        let dxs = dx.as_slice()?;
        for (r, &tok) in self.inputs.iter().enumerate() {
            for (a, b) in de[tok as usize * h..(tok as usize + 1) * h].iter_mut().zip(&dxs[r * h..(r + 1) * h]) {
                *a += b;
            }
        }
        grads.add("model.embed_tokens.weight", &[v, h], &de);
        Ok(())
    }
}

/// Entropy `−Σ p log p` of `softmax(row / T)`, in f64.
fn entropy(row: &[f32], temperature: f32) -> f32 {
    let t = temperature as f64;
    let max = row.iter().cloned().fold(f32::NEG_INFINITY, f32::max) as f64;
    let w: Vec<f64> = row.iter().map(|&v| ((v as f64 - max) / t).exp()).collect();
    let z: f64 = w.iter().sum();
    -w.iter().filter(|&&x| x > 0.0).map(|&x| (x / z) * (x / z).ln()).sum::<f64>() as f32
}

/// `x · s` elementwise.
fn scale(x: &Tensor, s: f32) -> Result<Tensor> {
    Ok(Tensor::from_vec(x.as_slice()?.iter().map(|v| v * s).collect(), x.shape())?)
}
