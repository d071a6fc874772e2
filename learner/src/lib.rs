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
//! → inverse RoPE → per-head q/k RMSNorm (Qwen3) → qkv_proj (+bias) → input RMSNorm; then the embedding scatter-add
//! (plus the LM-head gradient when tied). Gradients are keyed by the parameter table's ids ([`ParamKey`]) in HF layouts.

pub mod algos;
pub mod checkpoint;
mod error;
mod grads;
mod layout;
pub mod optim;
mod trainer;

pub use error::{LearnerError, Result};
pub use grads::{Grads, ParamKey};
pub use trainer::{StepMetrics, TrainConfig, TrainSample, Trainer, Update};

use engine::model::{LayerActs, ParamId, ParamKind};
use engine::Model;
use kernels::{ops, Tensor};
use layout::Layout;

/// What the forward keeps of one layer: everything, or only its input (gradient
/// checkpointing: the rest is recomputed in backward, bitwise the same).
enum Saved {
    Full(Box<LayerActs>),
    Input(Tensor),
}

/// One decoder layer's training forward ([`Model::layer`], attention within the packed
/// sequences): its activations and its output.
fn layer_forward(
    model: &Model,
    w: &engine::model::LayerWeights,
    x: Tensor,
    layout: &Layout,
) -> Result<(LayerActs, Tensor)> {
    let attend = |q: &Tensor, k: &Tensor, v: &Tensor| Ok(layout.attention(q, k, v, heads(model))?);
    let (x_out, acts) = model.layer(w, x, &layout.positions, attend, true)?;
    Ok((acts.expect("kept"), x_out))
}

/// `(n_heads, n_kv_heads, head_dim)` of the model's attention.
fn heads(model: &Model) -> (usize, usize, usize) {
    let c = &model.config;
    (c.num_attention_heads, c.num_key_value_heads, c.head_dim)
}

/// The saved activations of a packed batch's training forward.
pub struct SeqForward {
    /// Where every sequence's tokens sit in the packed rows (prompts shared).
    layout: Layout,
    /// Completion tokens of all sequences, concatenated.
    completion: Vec<u32>,
    /// Completion length of each sequence.
    pub lens: Vec<usize>,
    temperature: f32,
    layers: Vec<Saved>,
    /// Final hidden states of the completion-predicting rows, before the last norm.
    h_rows: Tensor,
    normed: Tensor,
    /// Logits of the completion-predicting rows `[Σ C, vocab]`, when kept
    /// ([`Recompute::head_rows`] unset or covering every row); else backward recomputes them.
    logits: Option<Tensor>,
    /// Rows of logits computed at once ([`Recompute::head_rows`]; `Σ C` when unset).
    head_rows: usize,
    /// ℓ of each completion token (all sequences, concatenated).
    pub logprobs: Vec<f32>,
    /// Entropy of π_θ(· | prefix) at temperature T for each completion position (nats).
    pub entropies: Vec<f32>,
    /// Wall-clock seconds this forward took.
    pub forward_seconds: f64,
}

/// Training forward of one `prompt ++ completion` at `temperature`.
pub fn forward(model: &Model, prompt: &[u32], completion: &[u32], temperature: f32) -> Result<SeqForward> {
    forward_batch(model, &[(prompt, completion)], temperature)
}

/// Training forward of a packed batch of `(prompt, completion)` pairs: saves what backward needs.
pub fn forward_batch(model: &Model, seqs: &[(&[u32], &[u32])], temperature: f32) -> Result<SeqForward> {
    forward_batch_with(model, seqs, temperature, Recompute::default())
}

/// What a training forward keeps for backward, and what backward recomputes instead
/// ([`forward_batch_with`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Recompute {
    /// Keep only each layer's input and recompute the rest in backward (gradient
    /// checkpointing; bitwise the same gradients, one more forward of the layers).
    pub layers: bool,
    /// Compute the LM head's logits `[Σ C, vocab]` at most this many rows at a time, in the
    /// forward (for ℓ and the entropies) and again in backward (for their gradient), instead
    /// of keeping them: the logits and their gradient then take `2 · rows · vocab` floats
    /// instead of `2 · Σ C · vocab` (the largest activations under gradient checkpointing:
    /// 1.2 MB per completion token for a 152k vocabulary), for one more LM-head matmul.
    /// ℓ, the entropies and every other gradient are bitwise the same; the LM head's
    /// gradient is summed chunk by chunk (another f32 summation order). `None`: keep them.
    pub head_rows: Option<usize>,
}

impl Recompute {
    /// Logit elements per chunk under [`Self::checkpointing`]: 64 MiB of f32 (1365 rows of
    /// SmolLM2's 49152-token vocabulary, 441 of Qwen3's 151936).
    pub const HEAD_CHUNK_ELEMENTS: usize = 1 << 24;

    /// TRL's `gradient_checkpointing`: the layers recomputed, and the LM head in chunks of
    /// [`Self::HEAD_CHUNK_ELEMENTS`] logits; `false`: everything kept.
    pub fn checkpointing(on: bool, vocab_size: usize) -> Self {
        match on {
            true => Self { layers: true, head_rows: Some((Self::HEAD_CHUNK_ELEMENTS / vocab_size.max(1)).max(1)) },
            false => Self::default(),
        }
    }
}

/// [`forward_batch`], keeping less for backward as `recompute` says.
pub fn forward_batch_with(
    model: &Model,
    seqs: &[(&[u32], &[u32])],
    temperature: f32,
    recompute: Recompute,
) -> Result<SeqForward> {
    rayon::scope(|_| forward_inner(model, seqs, temperature, recompute))
}

/// Row ranges of `0..n`, `rows` at a time (one range, `0..n`, when `n ≤ rows`).
fn chunks(n: usize, rows: usize) -> impl Iterator<Item = std::ops::Range<usize>> {
    let rows = rows.max(1);
    (0..n.div_ceil(rows).max(1)).map(move |i| i * rows..((i + 1) * rows).min(n))
}

/// Rows `r` of `x [m, c]`: `x` itself when `r` is all of them, else a copy.
fn row_range(x: &Tensor, r: std::ops::Range<usize>) -> Result<std::borrow::Cow<'_, Tensor>> {
    use std::borrow::Cow;
    Ok(if r.len() == x.shape()[0] { Cow::Borrowed(x) } else { Cow::Owned(ops::rows(x, r)?) })
}

fn forward_inner(
    model: &Model,
    seqs: &[(&[u32], &[u32])],
    temperature: f32,
    recompute: Recompute,
) -> Result<SeqForward> {
    let t0 = std::time::Instant::now();
    let c = &model.config;
    let layout = Layout::new(seqs, model.max_positions())?;
    let completion: Vec<u32> = seqs.iter().flat_map(|(_, comp)| comp.iter().copied()).collect();
    let lens: Vec<usize> = seqs.iter().map(|(_, comp)| comp.len()).collect();
    let mut x = model.embed(&layout.inputs)?;
    let mut layers = Vec::with_capacity(model.layers.len());
    for w in &model.layers {
        let (acts, x_out) = layer_forward(model, w, x, &layout)?;
        layers.push(if recompute.layers { Saved::Input(acts.x_in) } else { Saved::Full(Box::new(acts)) });
        x = x_out;
    }
    let h_rows = ops::embedding(&x, &layout.pred_rows)?;
    let normed = ops::rms_norm(&h_rows, &model.norm, c.rms_norm_eps)?;
    let n = completion.len();
    let head_rows = recompute.head_rows.unwrap_or(n).max(1);
    let (mut logits, mut logprobs, mut entropies) = (None, Vec::with_capacity(n), Vec::with_capacity(n));
    for r in chunks(n, head_rows) {
        let z = ops::linear(&*row_range(&normed, r.clone())?, &model.lm_head, None)?;
        let (lp, ent) = ops::token_logprobs(&z, &completion[r.clone()], temperature)?;
        logprobs.extend(lp);
        entropies.extend(ent);
        // One chunk covers every row: kept for backward (no recompute).
        if r.len() == n {
            logits = Some(z);
        }
    }
    Ok(SeqForward {
        layout,
        completion,
        lens,
        temperature,
        layers,
        h_rows,
        normed,
        logits,
        head_rows,
        logprobs,
        entropies,
        forward_seconds: t0.elapsed().as_secs_f64(),
    })
}

/// What a loss hands to [`SeqForward::backward`]: its derivatives w.r.t. the forward's
/// outputs, one row per completion token (all sequences, concatenated).
#[derive(Debug, Clone, Copy)]
pub struct OutputGrads<'a> {
    /// `dL/dℓ_i` per completion logprob (the policy loss).
    pub dl_dlogp: &'a [f32],
    /// `dL/dH_i` per completion position's entropy (the entropy bonus), if any:
    /// `dH/dz_j = −(1/T)·p_j·(ln p_j + H)`.
    pub dl_dentropy: Option<&'a [f32]>,
    /// `dL/dh_i [Σ C, hidden]` w.r.t. [`SeqForward::hidden`] (a value head on the final
    /// hidden states), if any.
    pub dl_dhidden: Option<&'a Tensor>,
}

impl<'a> OutputGrads<'a> {
    /// Only the policy loss's `dL/dℓ`.
    pub fn logprobs(dl_dlogp: &'a [f32]) -> Self {
        Self { dl_dlogp, dl_dentropy: None, dl_dhidden: None }
    }
}

impl SeqForward {
    /// The final hidden states (after the last RMSNorm) of the rows that predict the
    /// completion tokens, `[Σ C, hidden]`: what the LM head (and a value head) reads.
    pub fn hidden(&self) -> &Tensor {
        &self.normed
    }

    /// Accumulates into `grads` the gradient of a loss whose derivatives w.r.t. the
    /// forward's outputs are `g` (by parameter id, in HF layouts), and the time it took into
    /// `grads.backward_seconds`.
    ///
    /// When every derivative is zero (a GRPO step whose groups all have zero reward variance:
    /// every advantage is 0) and the forward is finite, every weight's gradient is exactly
    /// zero: they are added as zeros ([`Self::add_zero_grads`]) without running the backward,
    /// so AdamW still takes its step (momentum, moment decay), bitwise as after a backward
    /// (a −0 gradient steps AdamW exactly like +0).
    pub fn backward(&self, model: &Model, g: &OutputGrads, grads: &mut Grads) -> Result<()> {
        let t0 = std::time::Instant::now();
        let zero = |d: &[f32]| d.iter().all(|&x| x == 0.0);
        if zero(g.dl_dlogp)
            && g.dl_dentropy.is_none_or(zero)
            && g.dl_dhidden.is_none()
            && self.logprobs.iter().chain(&self.entropies).all(|x| x.is_finite())
        {
            Self::add_zero_grads(model, grads)?;
        } else {
            rayon::scope(|_| self.backward_inner(model, g, grads))?;
        }
        grads.backward_seconds += t0.elapsed().as_secs_f64();
        Ok(())
    }

    /// Zeros for every weight [`Self::backward_inner`] gives a gradient (all of
    /// the model's parameter table; those `grads` already holds are left as they are).
    fn add_zero_grads(model: &Model, grads: &mut Grads) -> Result<()> {
        for p in model.config.params() {
            if let std::collections::btree_map::Entry::Vacant(e) = grads.tensors.entry(p.id.into()) {
                e.insert(Tensor::zeros(&p.shape, model.device())?);
            }
        }
        Ok(())
    }

    fn backward_inner(&self, model: &Model, g: &OutputGrads, grads: &mut Grads) -> Result<()> {
        let c = &model.config;
        let (h, t) = (c.hidden_size, self.layout.inputs.len());
        let (q_dim, kv_dim, i_dim) =
            (c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim, c.intermediate_size);
        let bad = |d: String| kernels::KernelError::Shape { op: "learner backward", detail: d };
        let n = self.completion.len();
        if g.dl_dlogp.len() != n || g.dl_dentropy.is_some_and(|d| d.len() != n) {
            return Err(bad(format!("{} gradients for {n} completion tokens", g.dl_dlogp.len())).into());
        }
        // The LM head, chunk by chunk of rows when its logits were not kept (`Recompute`).
        let head = ParamId::model(if c.tie_word_embeddings { ParamKind::Embed } else { ParamKind::LmHead });
        let mut d_normed = Vec::new();
        for r in chunks(n, self.head_rows) {
            let x = row_range(&self.normed, r.clone())?;
            let recomputed;
            let z = match &self.logits {
                Some(z) => z,
                None => {
                    recomputed = ops::linear(&x, &model.lm_head, None)?;
                    &recomputed
                }
            };
            let dz = ops::token_logprobs_backward(
                z,
                &self.completion[r.clone()],
                self.temperature,
                &g.dl_dlogp[r.clone()],
                g.dl_dentropy.map(|d| &d[r.clone()]),
                &self.entropies[r.clone()],
            )?;
            d_normed.push(ops::linear_grad_input(&dz, &model.lm_head)?);
            grads.add(head, ops::linear_grad_weight(&dz, &x)?)?;
        }
        let mut d_normed = match d_normed.len() {
            1 => d_normed.pop().expect("one"),
            _ => ops::cat_rows(&d_normed.iter().collect::<Vec<_>>())?,
        };
        if let Some(dh) = g.dl_dhidden {
            ops::add_inplace(&mut d_normed, dh)?;
        }
        let (dh_rows, dnorm) = ops::rms_norm_backward(&self.h_rows, &model.norm, &d_normed, c.rms_norm_eps)?;
        grads.add(ParamId::model(ParamKind::FinalNorm), dnorm)?;
        // Add the completion-row gradients to their rows (a shared prompt's last row predicts
        // the first token of each of its samples).
        let mut dx = Tensor::zeros(&[t, h], model.device())?;
        ops::scatter_add_rows(&mut dx, &self.layout.pred_rows, &dh_rows)?;
        let positions = &self.layout.positions;
        let (cos, sin) = model.rope_tables();
        let neg_sin = ops::scale(sin, -1.0)?;
        for (l, (w, saved)) in model.layers.iter().zip(&self.layers).enumerate().rev() {
            let recomputed;
            let s = match saved {
                Saved::Full(a) => a,
                Saved::Input(x) => {
                    recomputed = layer_forward(model, w, x.clone(), &self.layout)?.0;
                    &recomputed
                }
            };
            // Gradients by the parameter table's ids (engine::model::params).
            let p = |kind: ParamKind| ParamId::layer(l, kind);
            // MLP.
            let d_act = ops::linear_grad_input(&dx, &w.down_proj)?;
            grads.add(p(ParamKind::DownProj), ops::linear_grad_weight(&dx, &s.act)?)?;
            let d_gu = ops::silu_mul_backward(&s.gu, &d_act)?;
            let [gate, up]: [Tensor; 2] =
                ops::split_rows(&ops::linear_grad_weight(&d_gu, &s.n2)?, &[i_dim, i_dim])?.try_into().expect("two");
            grads.add(p(ParamKind::GateProj), gate)?;
            grads.add(p(ParamKind::UpProj), up)?;
            let d_n2 = ops::linear_grad_input(&d_gu, &w.gate_up_proj)?;
            let (d_mid, dw_post) =
                ops::rms_norm_backward(&s.x_mid, &w.post_attention_layernorm, &d_n2, c.rms_norm_eps)?;
            grads.add(p(ParamKind::PostNorm), dw_post)?;
            ops::add_inplace(&mut dx, &d_mid)?;
            // Attention, per sequence; then RoPE's inverse rotation.
            let d_a = ops::linear_grad_input(&dx, &w.o_proj)?;
            grads.add(p(ParamKind::OProj), ops::linear_grad_weight(&dx, &s.a)?)?;
            let (mut dq, mut dk, dv) = self.layout.attention_backward(&s.q, &s.k, &s.v, &d_a, heads(model))?;
            ops::rope_inplace(&mut dq, positions, cos, &neg_sin, c.head_dim)?;
            ops::rope_inplace(&mut dk, positions, cos, &neg_sin, c.head_dim)?;
            if let (Some((qn, kn)), Some((q_pre, k_pre))) = (&w.qk_norm, &s.qk_pre) {
                // The per-head RMSNorm's backward, each head's D values a row.
                let rows = |x: &Tensor| x.clone().reshape(&[x.len() / c.head_dim, c.head_dim]);
                for (n, wn, pre, d) in [(ParamKind::QNorm, qn, q_pre, &mut dq), (ParamKind::KNorm, kn, k_pre, &mut dk)]
                {
                    let (dx, dw) = ops::rms_norm_backward(&rows(pre)?, wn, &rows(d)?, c.rms_norm_eps)?;
                    grads.add(p(n), dw)?;
                    *d = dx.reshape(pre.shape())?;
                }
            }
            let dqkv = ops::cat_cols(&[&dq, &dk, &dv])?;
            let dw_qkv = ops::split_rows(&ops::linear_grad_weight(&dqkv, &s.n1)?, &[q_dim, kv_dim, kv_dim])?;
            for (n, g) in [ParamKind::QProj, ParamKind::KProj, ParamKind::VProj].into_iter().zip(dw_qkv) {
                grads.add(p(n), g)?;
            }
            if c.qkv_bias {
                let db = ops::split_cols(&ops::sum_rows(&dqkv)?, &[q_dim, kv_dim, kv_dim])?;
                for (n, g) in [ParamKind::QBias, ParamKind::KBias, ParamKind::VBias].into_iter().zip(db) {
                    let len = g.len();
                    grads.add(p(n), g.reshape(&[len])?)?;
                }
            }
            let d_n1 = ops::linear_grad_input(&dqkv, &w.qkv_proj)?;
            let (d_in, dw_in) = ops::rms_norm_backward(&s.x_in, &w.input_layernorm, &d_n1, c.rms_norm_eps)?;
            grads.add(p(ParamKind::InputNorm), dw_in)?;
            ops::add_inplace(&mut dx, &d_in)?;
        }
        // Embedding: scatter-add rows (into the tied LM head's gradient when there is one),
        // none for the pad token (HF's `nn.Embedding(padding_idx = pad_token_id)`).
        if let Some(pad) = c.pad_token_id {
            let at: Vec<u32> = (0..t as u32).filter(|&i| self.layout.inputs.host()[i as usize] == pad).collect();
            if !at.is_empty() {
                ops::scatter_rows(&mut dx, &at, &Tensor::zeros(&[at.len(), h], model.device())?)?;
            }
        }
        grads.scatter_add_rows(ParamId::model(ParamKind::Embed), &[c.vocab_size, h], &self.layout.inputs, &dx)?;
        Ok(())
    }
}
