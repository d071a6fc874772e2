//! How a training batch sits in packed rows: one row per input token, no padding, and
//! samples with identical prompts share one copy of the prompt's rows (prefix sharing: the
//! `num_generations` samples of a GRPO group run the prompt's forward and backward once).
//!
//! Rows, in batch order: at a prompt's first appearance its rows (positions `0..P`), then
//! for every sample the input rows of its completion, `completion[..C−1]` at positions
//! `P..P+C−1`. Attention sees, for the prompt rows, the prompt causally, and for a sample's
//! rows, the prompt's rows then its own: exactly the keys it would see in a private copy
//! of `prompt ++ completion`, in the same position order, so every row's attention is the
//! same reduction as without sharing (and as in the engine: ℓ = μ is unaffected). The
//! linear layers, norms and the LM head are row-wise, so sharing only removes rows.

use crate::Result;
use kernels::ops::{self, AttnBatch, AttnSeq};
use kernels::{Indices, KernelError, Tensor};
use std::collections::HashMap;
use std::ops::Range;

/// One attention sequence: query rows `rows` at positions `start_pos..`, whose position `p`
/// has its keys and values in row `keys[p]`.
struct AttnRows {
    rows: Range<usize>,
    start_pos: usize,
    keys: Vec<u32>,
}

/// The packed rows of a batch of `(prompt, completion)` pairs (see the module doc). The
/// index arrays are [`Indices`], built once per batch: on a device each is uploaded once and
/// read by every layer's forward and backward.
pub(crate) struct Layout {
    /// Token of each row.
    pub inputs: Indices,
    /// Position of each row in its sequence.
    pub positions: Indices,
    /// The row whose logits predict each completion token (all samples, batch order); the
    /// last prompt row appears once per sample of the prompt.
    pub pred_rows: Indices,
    /// The prompts' rows (shared) and the samples' completion rows, for every layer's
    /// attention ([`Self::attention`]).
    attn: AttnBatch,
    /// The attention backward's rows: each sample's span of keys (contiguous rows without
    /// sharing), or with sharing its gathered copies ([`SharedRows`]).
    backward: Backward,
}

/// How [`Layout::attention_backward`] sees the rows.
enum Backward {
    /// No prompt is shared: each sample's keys are its own contiguous rows, `spans`.
    Contiguous(Vec<Range<usize>>),
    Shared(Box<SharedRows>),
}

/// With sharing, each sample's keys gathered into a contiguous copy: rows `gather` of the
/// batch, `da` read from rows `da_rows` (row `t` is a zero row: non-carriers' prompt
/// queries), copy `s` being rows `spans[s]`.
struct SharedRows {
    gather: Indices,
    da_rows: Indices,
    spans: Vec<Range<usize>>,
}

impl Layout {
    /// The layout of `seqs`; errors when a pair is empty or longer than `max_positions`.
    pub fn new(seqs: &[(&[u32], &[u32])], max_positions: usize) -> Result<Self> {
        let mut l = Rows::default();
        let mut prompts: HashMap<&[u32], Range<usize>> = HashMap::new();
        for (prompt, comp) in seqs {
            if prompt.is_empty() || comp.is_empty() {
                return Err(bad("prompt and completion must be non-empty".into()));
            }
            let t = prompt.len() + comp.len() - 1;
            if t > max_positions {
                return Err(bad(format!("{t} positions exceed the context of {max_positions}")));
            }
            let owner = !prompts.contains_key(prompt);
            l.shared |= !owner;
            let p_rows = prompts
                .entry(prompt)
                .or_insert_with(|| {
                    let r = l.push_rows(prompt, 0);
                    l.attn.push(AttnRows { rows: r.clone(), start_pos: 0, keys: rows(&r) });
                    r
                })
                .clone();
            let own = l.push_rows(&comp[..comp.len() - 1], prompt.len());
            let keys: Vec<u32> = rows(&p_rows).into_iter().chain(rows(&own)).collect();
            if !own.is_empty() {
                l.attn.push(AttnRows { rows: own.clone(), start_pos: prompt.len(), keys: keys.clone() });
            }
            l.pred_rows.push(p_rows.end as u32 - 1);
            l.pred_rows.extend(rows(&own));
            l.samples.push((keys, prompt.len(), owner));
        }
        let seqs: Vec<AttnSeq> = l
            .attn
            .iter()
            .map(|a| AttnSeq { rows: a.rows.clone(), start_pos: a.start_pos, block_table: &a.keys })
            .collect();
        let backward =
            if l.shared { Backward::Shared(Box::new(l.shared_rows())) } else { Backward::Contiguous(l.spans()) };
        Ok(Layout {
            attn: AttnBatch::new(&seqs, 1)?,
            inputs: Indices::new(l.inputs),
            positions: l.positions.into_iter().map(|p| p as u32).collect(),
            pred_rows: Indices::new(l.pred_rows),
            backward,
        })
    }

    /// Causal attention of every row over its sequence ([`ops::paged_attention`] with one-row
    /// blocks: block `i` of a sequence is the row of its position `i`).
    pub fn attention(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        heads: (usize, usize, usize),
    ) -> kernels::Result<Tensor> {
        ops::paged_attention(q, k, v, &self.attn, heads.0, heads.1, heads.2, ops::KvLayout::Rows)
    }

    /// `(dq, dk, dv)` of [`Self::attention`] given `da`. Without sharing every sample's rows
    /// are one contiguous span ([`ops::attention_backward`] directly). With sharing each
    /// sample gets a contiguous copy of its keys' rows (gathered), whose prompt query rows
    /// carry `da` only in the prompt's first sample (zero elsewhere, so they add nothing);
    /// the copies' gradients are added back to the shared rows.
    pub fn attention_backward(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        da: &Tensor,
        heads: (usize, usize, usize),
    ) -> Result<(Tensor, Tensor, Tensor)> {
        let (h, kvh, d) = heads;
        let s = match &self.backward {
            Backward::Contiguous(spans) => return Ok(ops::attention_backward(q, k, v, da, spans, h, kvh, d)?),
            Backward::Shared(s) => s,
        };
        let (t, gather, spans) = (self.inputs.len(), &s.gather, &s.spans);
        let da_ext = ops::cat_rows(&[da, &Tensor::zeros(&[1, da.shape()[1]], &da.device())?])?;
        let (qc, kc, vc) = (ops::embedding(q, gather)?, ops::embedding(k, gather)?, ops::embedding(v, gather)?);
        let (dq_c, dk_c, dv_c) =
            ops::attention_backward(&qc, &kc, &vc, &ops::embedding(&da_ext, &s.da_rows)?, spans, h, kvh, d)?;
        let scatter = |src: &Tensor| -> Result<Tensor> {
            let mut out = Tensor::zeros(&[t, src.shape()[1]], &src.device())?;
            ops::scatter_add_rows(&mut out, gather, src)?;
            Ok(out)
        };
        Ok((scatter(&dq_c)?, scatter(&dk_c)?, scatter(&dv_c)?))
    }
}

/// [`Layout`] while it is built.
#[derive(Default)]
struct Rows {
    inputs: Vec<u32>,
    positions: Vec<usize>,
    pred_rows: Vec<u32>,
    attn: Vec<AttnRows>,
    samples: Vec<(Vec<u32>, usize, bool)>,
    shared: bool,
}

impl Rows {
    /// Appends rows for `tokens` at positions `start..`; returns their range.
    fn push_rows(&mut self, tokens: &[u32], start: usize) -> Range<usize> {
        let r0 = self.inputs.len();
        self.inputs.extend_from_slice(tokens);
        self.positions.extend(start..start + tokens.len());
        r0..self.inputs.len()
    }

    /// Each sample's keys as one span of rows (no prompt shared: they are contiguous).
    fn spans(&self) -> Vec<Range<usize>> {
        self.samples.iter().map(|(keys, ..)| keys[0] as usize..keys[keys.len() - 1] as usize + 1).collect()
    }

    /// The gathered copies of [`SharedRows`].
    fn shared_rows(&self) -> SharedRows {
        let t = self.inputs.len();
        let (mut gather, mut da_rows, mut spans) = (vec![], vec![], vec![]);
        for &(ref keys, p, owner) in &self.samples {
            if !owner && p == keys.len() {
                continue; // no own rows and not the prompt's carrier: nothing to add
            }
            spans.push(gather.len()..gather.len() + keys.len());
            gather.extend_from_slice(keys);
            // Rows past `t` in `da_ext` are zeros: non-owners' prompt queries read them.
            da_rows.extend(keys.iter().enumerate().map(|(i, &r)| if i < p && !owner { t as u32 } else { r }));
        }
        SharedRows { gather: Indices::new(gather), da_rows: Indices::new(da_rows), spans }
    }
}

fn rows(r: &Range<usize>) -> Vec<u32> {
    (r.start as u32..r.end as u32).collect()
}

fn bad(detail: String) -> crate::LearnerError {
    KernelError::Shape { op: "learner forward", detail }.into()
}
