//! The optimizer's update of the served weights in their own layout (fused, packed): the
//! learner lays its step out with [`Model::lay_out`] and turns it into the new weights with
//! [`Model::prepare_update`] while the engine keeps serving, then [`Model::commit_update`]
//! makes them the served ones under the write guard (buffer swaps where possible).

use super::{Fused, LayerWeights, Model, ParamId, ParamKind};
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

/// A weight's update in the model's own layout, from [`Model::lay_out`]: the step `Δ`, then
/// (after [`Model::prepare_update`]) the new weight, then (after [`Model::commit_update`])
/// the old values, to drop.
pub enum WeightDelta {
    /// Norm weights, an untied embedding, biases.
    Dense(Tensor),
    /// A linear weight, packed like the one it updates (the LM head: also a tied embedding).
    Packed(PackedWeight),
}

enum Weight<'a> {
    Dense(&'a Tensor),
    Packed(&'a PackedWeight),
}

enum WeightMut<'a> {
    Dense(&'a mut Tensor),
    Packed(&'a mut PackedWeight),
}

/// One served weight buffer ([`Model::slots`]).
#[derive(Clone, Copy)]
enum Slot {
    /// An untied embedding.
    Embed,
    FinalNorm,
    /// The LM head (a tied embedding's only copy).
    LmHead,
    /// Layer `l`'s buffer whose first table row is this kind (a fused buffer: its first block).
    Layer(usize, ParamKind),
}

/// A layer's buffer for `kind` as `$w::Dense` / `$w::Packed`, borrowed with `$($r)+` (`&` or
/// `&mut`) and `Option::$as` (`as_ref` or `as_mut`): one match for both borrows.
macro_rules! layer_buffer {
    ($l:expr, $kind:expr, $w:ident, $as:ident, $($r:tt)+) => {{
        // The layer was loaded from the same config: it holds what its table lists.
        const HELD: &str = "a layer holds the weights its table lists";
        match ($kind.fused(), $kind) {
            (Fused::Qkv(_), _) => $w::Packed($($r)+ $l.qkv_proj),
            (Fused::QkvBias(_), _) => $w::Dense($l.qkv_bias.$as().expect(HELD)),
            (Fused::GateUp(_), _) => $w::Packed($($r)+ $l.gate_up_proj),
            (Fused::Own, ParamKind::InputNorm) => $w::Dense($($r)+ $l.input_layernorm),
            (Fused::Own, ParamKind::PostNorm) => $w::Dense($($r)+ $l.post_attention_layernorm),
            (Fused::Own, ParamKind::QNorm) => $w::Dense($($r)+ $l.qk_norm.$as().expect(HELD).0),
            (Fused::Own, ParamKind::KNorm) => $w::Dense($($r)+ $l.qk_norm.$as().expect(HELD).1),
            (Fused::Own, ParamKind::OProj) => $w::Packed($($r)+ $l.o_proj),
            (Fused::Own, ParamKind::DownProj) => $w::Packed($($r)+ $l.down_proj),
            (Fused::Own, other) => unreachable!("{other:?} is not a layer weight"),
        }
    }};
}

fn layer_buffer(l: &LayerWeights, kind: ParamKind) -> Weight<'_> {
    layer_buffer!(l, kind, Weight, as_ref, &)
}

fn layer_buffer_mut(l: &mut LayerWeights, kind: ParamKind) -> WeightMut<'_> {
    layer_buffer!(l, kind, WeightMut, as_mut, &mut)
}

impl Model {
    /// Every weight buffer (fused, packed), in the order of [`Self::lay_out`]: per layer the
    /// table's served buffers ([`buffers`]).
    fn slots(&self) -> Vec<Slot> {
        let table = self.config.layer_params();
        // A tied embedding is the LM head's buffer: no buffer of its own.
        let mut out: Vec<Slot> = self.embed_tokens.iter().map(|_| Slot::Embed).collect();
        out.extend([Slot::FinalNorm, Slot::LmHead]);
        for l in 0..self.layers.len() {
            out.extend(buffers(&table).map(|r| Slot::Layer(l, table[r.start].0)));
        }
        out
    }

    fn weight(&self, s: Slot) -> Weight<'_> {
        const TIED: &str = "an untied model has an embedding";
        match s {
            Slot::Embed => Weight::Dense(self.embed_tokens.as_ref().expect(TIED)),
            Slot::FinalNorm => Weight::Dense(&self.norm),
            Slot::LmHead => Weight::Packed(&self.lm_head),
            Slot::Layer(l, kind) => layer_buffer(&self.layers[l], kind),
        }
    }

    fn weight_mut(&mut self, s: Slot) -> WeightMut<'_> {
        const TIED: &str = "an untied model has an embedding";
        match s {
            Slot::Embed => WeightMut::Dense(self.embed_tokens.as_mut().expect(TIED)),
            Slot::FinalNorm => WeightMut::Dense(&mut self.norm),
            Slot::LmHead => WeightMut::Packed(&mut self.lm_head),
            Slot::Layer(l, kind) => layer_buffer_mut(&mut self.layers[l], kind),
        }
    }

    /// The step of every weight from `src`, laid out like this model's weights: fused
    /// (q/k/v, gate/up stacked), packed by the backend, the tied LM head laid out once for
    /// both its uses: the first of the update's three calls ([`Self::prepare_update`],
    /// [`Self::commit_update`]), all but the last outside the write guard.
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

    /// `Δ ← scale · w + Δ` for every weight: the new weights in the step's buffers,
    /// `deltas` from [`Self::lay_out`]. Only reads the served weights, so it runs under a
    /// read guard while the engine serves; [`Self::commit_update`] then makes them the
    /// served ones. Errors: `deltas` not laid out for this model (nothing is changed then).
    pub fn prepare_update(&self, deltas: &mut [WeightDelta], scale: f32) -> Result<()> {
        let slots = self.slots();
        self.check_laid_out(&slots, deltas)?;
        for (&s, d) in slots.iter().zip(deltas) {
            match (self.weight(s), d) {
                (Weight::Dense(w), WeightDelta::Dense(d)) => ops::scale_add_into(w, scale, d)?,
                (Weight::Packed(w), WeightDelta::Packed(d)) => ops::scale_add_packed_into(w, scale, d)?,
                _ => unreachable!("checked by check_laid_out"),
            }
        }
        Ok(())
    }

    /// Makes the weights [`Self::prepare_update`] wrote into `new` the served ones, under
    /// the write guard; `new` is left holding the old values (drop it after releasing the
    /// guard). The shortest possible hold: on the CPU every buffer is swapped (no copy); on
    /// a GPU serving bf16 copies a linear weight's f32 buffers are swapped and its bf16 copy
    /// rewritten (6 B per parameter), while a buffer the engine reads in f32 at an address
    /// a decode graph recorded (norms, biases, an embedding, the tied LM head's rows) is
    /// copied in (8 B, 10 B with a bf16 copy) ([`ops::commit_packed`]). Errors: `new` not
    /// laid out for this model, checked before anything changes; a device error.
    pub fn commit_update(&mut self, new: &mut [WeightDelta]) -> Result<()> {
        let slots = self.slots();
        self.check_laid_out(&slots, new)?;
        let tied = self.config.tie_word_embeddings;
        for (&s, d) in slots.iter().zip(new) {
            match (self.weight_mut(s), d) {
                (WeightMut::Dense(w), WeightDelta::Dense(d)) => ops::commit(w, d, true)?,
                (WeightMut::Packed(w), WeightDelta::Packed(d)) => {
                    ops::commit_packed(w, d, tied && matches!(s, Slot::LmHead))?
                }
                _ => unreachable!("checked by check_laid_out"),
            }
        }
        Ok(())
    }

    /// Errors unless `deltas` match this model's buffers one to one, kind and shape.
    fn check_laid_out(&self, slots: &[Slot], deltas: &[WeightDelta]) -> Result<()> {
        let bad = |detail: String| kernels::KernelError::Shape { op: "update", detail };
        if slots.len() != deltas.len() {
            return Err(bad(format!("{} deltas for {} weight buffers", deltas.len(), slots.len())).into());
        }
        for (&s, d) in slots.iter().zip(deltas) {
            let same = match (self.weight(s), d) {
                (Weight::Dense(w), WeightDelta::Dense(d)) => w.shape() == d.shape(),
                (Weight::Packed(w), WeightDelta::Packed(d)) => w.shape() == d.shape(),
                _ => return Err(bad("a dense delta for a packed weight, or the reverse".into()).into()),
            };
            if !same {
                return Err(bad("a delta of another shape than its weight".into()).into());
            }
        }
        Ok(())
    }
}

/// A layer's served buffers as ranges of its table rows:
/// consecutive rows of one fused buffer are its row blocks, any other row a buffer of its own
/// (rows from `ModelConfig::layer_params`).
/// [`Model::lay_out`] and [`Model::slots`] both walk these, so their orders agree.
fn buffers(table: &[(ParamKind, Vec<usize>)]) -> impl Iterator<Item = std::ops::Range<usize>> {
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
    out.into_iter()
}
