//! The optimizer's update of the served weights in their own layout (fused, packed): the
//! learner lays its step out with [`Model::lay_out`] while the engine keeps serving, then
//! [`Model::apply_deltas`] applies it under the write guard in one elementwise pass.

use super::{Fused, Model, ParamId, ParamKind};
use crate::error::Result;
use kernels::ops::{self, PackedWeight};
use kernels::Tensor;

/// Where [`Model::lay_out`] gets each weight's step (the learner's optimizer), by HF name.
pub trait StepSource {
    /// The step of a dense weight (a norm, a bias, an untied embedding), `shape` as in HF.
    fn dense(&mut self, id: ParamId, shape: &[usize]) -> kernels::Result<Tensor>;
    /// The step of a linear weight stacking the rows of the HF weights `parts`
    /// (`(id, rows)` in order, `k` columns each), laid out like the served weight:
    /// [`ops::pack_weight`] of the stacked steps (or [`ops::adamw_delta_packed`], which is
    /// that in one pass).
    fn packed(&mut self, parts: &[(ParamId, usize)], k: usize) -> kernels::Result<PackedWeight>;
}

/// A weight's update in the model's own layout, from [`Model::lay_out`].
pub enum WeightDelta {
    /// Norm weights, an untied embedding, biases.
    Dense(Tensor),
    /// A linear weight, packed like the one it updates (the LM head: also a tied embedding).
    Packed(PackedWeight),
}

enum WeightMut<'a> {
    Dense(&'a mut Tensor),
    Packed(&'a mut PackedWeight),
}

impl Model {
    /// Every weight buffer (fused, packed), in the order of [`Self::lay_out`]: per layer the
    /// table's served buffers ([`buffers`]).
    fn weights_mut(&mut self) -> Vec<WeightMut<'_>> {
        let table = self.config.layer_params();
        // A tied embedding is the LM head's buffer: no buffer of its own.
        let mut out: Vec<WeightMut> = self.embed_tokens.iter_mut().map(WeightMut::Dense).collect();
        out.extend([WeightMut::Dense(&mut self.norm), WeightMut::Packed(&mut self.lm_head)]);
        for w in &mut self.layers {
            let super::LayerWeights {
                input_layernorm,
                qkv_proj,
                qkv_bias,
                qk_norm,
                o_proj,
                post_attention_layernorm,
                gate_up_proj,
                down_proj,
            } = w;
            let (mut qn, mut kn) = match qk_norm {
                Some((q, k)) => (Some(q), Some(k)),
                None => (None, None),
            };
            let (mut input, mut post, mut qkv, mut bias) =
                (Some(input_layernorm), Some(post_attention_layernorm), Some(qkv_proj), qkv_bias.as_mut());
            let (mut o, mut gate_up, mut down) = (Some(o_proj), Some(gate_up_proj), Some(down_proj));
            for r in buffers(&table) {
                // The layer was loaded from the same config: it holds what its table lists.
                const HELD: &str = "a layer holds the weights its table lists";
                out.push(match (table[r.start].0.fused(), table[r.start].0) {
                    (Fused::Qkv(_), _) => WeightMut::Packed(qkv.take().expect(HELD)),
                    (Fused::QkvBias(_), _) => WeightMut::Dense(bias.take().expect(HELD)),
                    (Fused::GateUp(_), _) => WeightMut::Packed(gate_up.take().expect(HELD)),
                    (Fused::Own, ParamKind::InputNorm) => WeightMut::Dense(input.take().expect(HELD)),
                    (Fused::Own, ParamKind::PostNorm) => WeightMut::Dense(post.take().expect(HELD)),
                    (Fused::Own, ParamKind::QNorm) => WeightMut::Dense(qn.take().expect(HELD)),
                    (Fused::Own, ParamKind::KNorm) => WeightMut::Dense(kn.take().expect(HELD)),
                    (Fused::Own, ParamKind::OProj) => WeightMut::Packed(o.take().expect(HELD)),
                    (Fused::Own, ParamKind::DownProj) => WeightMut::Packed(down.take().expect(HELD)),
                    (Fused::Own, other) => unreachable!("{other:?} is not a layer weight"),
                });
            }
        }
        out
    }

    /// The step of every weight from `src`, laid out like this model's weights: fused
    /// (q/k/v, gate/up stacked), packed by the backend, the tied LM head laid out once for
    /// both its uses. With [`Self::apply_deltas`] the optimizer's update is prepared outside
    /// the write guard.
    pub fn lay_out(&self, src: &mut dyn StepSource) -> Result<Vec<WeightDelta>> {
        let c = &self.config;
        let h = c.hidden_size;
        let (embed, head) = (ParamId::model(ParamKind::Embed), ParamId::model(ParamKind::LmHead));
        // A tied embedding's step is the LM head's (its gradient under the embedding's id).
        let mut out = Vec::new();
        if !c.tie_word_embeddings {
            out.push(WeightDelta::Dense(src.dense(embed, &[c.vocab_size, h])?));
        }
        out.push(WeightDelta::Dense(src.dense(ParamId::model(ParamKind::FinalNorm), &[h])?));
        let head = if c.tie_word_embeddings { embed } else { head };
        out.push(WeightDelta::Packed(src.packed(&[(head, c.vocab_size)], h)?));
        let table = c.layer_params();
        for l in 0..self.layers.len() {
            for r in buffers(&table) {
                let rows = &table[r];
                let (kind, shape) = &rows[0];
                out.push(match (kind.fused(), kind) {
                    (Fused::QkvBias(_), _) => {
                        let b = rows
                            .iter()
                            .map(|(k, s)| src.dense(ParamId::layer(l, *k), s))
                            .collect::<kernels::Result<Vec<_>>>()?;
                        let len = b.iter().map(|t| t.len()).sum::<usize>();
                        WeightDelta::Dense(ops::cat_cols(&b.iter().collect::<Vec<_>>())?.reshape(&[len])?)
                    }
                    (Fused::Own, ParamKind::InputNorm | ParamKind::PostNorm | ParamKind::QNorm | ParamKind::KNorm) => {
                        WeightDelta::Dense(src.dense(ParamId::layer(l, *kind), shape)?)
                    }
                    // Linear weights: one packed step over the row blocks.
                    _ => {
                        let parts: Vec<(ParamId, usize)> =
                            rows.iter().map(|(k, s)| (ParamId::layer(l, *k), s[0])).collect();
                        WeightDelta::Packed(src.packed(&parts, shape[1])?)
                    }
                });
            }
        }
        Ok(out)
    }

    /// `w ← scale · w + Δ` for every weight, `deltas` from [`Self::lay_out`]: one
    /// elementwise pass over the weights, the shortest possible write-guard hold.
    pub fn apply_deltas(&mut self, deltas: &[WeightDelta], scale: f32) -> Result<()> {
        let bad = |detail: String| kernels::KernelError::Shape { op: "apply_deltas", detail };
        let weights = self.weights_mut();
        if weights.len() != deltas.len() {
            return Err(bad(format!("{} deltas for {} weight buffers", deltas.len(), weights.len())).into());
        }
        for (w, d) in weights.into_iter().zip(deltas) {
            match (w, d) {
                (WeightMut::Dense(w), WeightDelta::Dense(d)) => ops::scale_add_inplace(w, scale, d)?,
                (WeightMut::Packed(w), WeightDelta::Packed(d)) => ops::scale_add_packed(w, scale, d)?,
                _ => return Err(bad("a dense delta for a packed weight, or the reverse".into()).into()),
            }
        }
        Ok(())
    }
}

/// A layer's served buffers as ranges of its table rows:
/// consecutive rows of one fused buffer are its row blocks, any other row a buffer of its own
/// (rows from `ModelConfig::layer_params`).
/// [`Model::lay_out`] and [`Model::weights_mut`] both walk these, so their orders agree.
fn buffers(table: &[(ParamKind, Vec<usize>)]) -> Vec<std::ops::Range<usize>> {
    let same = |a: Fused, b: Fused| {
        matches!(
            (a, b),
            (Fused::Qkv(_), Fused::Qkv(_))
                | (Fused::QkvBias(_), Fused::QkvBias(_))
                | (Fused::GateUp(_), Fused::GateUp(_))
        )
    };
    let mut out = vec![];
    let mut i = 0;
    while i < table.len() {
        let mut j = i + 1;
        while j < table.len() && same(table[i].0.fused(), table[j].0.fused()) {
            j += 1;
        }
        out.push(i..j);
        i = j;
    }
    out
}
