//! The parameter table: every architecture's weights declared once — HF name, shape, the
//! served (fused) buffer and row block each lands in. Loading, [`super::Model::weight_shapes`],
//! [`super::Model::named_weights`], the update's layout ([`super::Model::lay_out`]) and the
//! learner's gradients and AdamW moments (keyed by [`ParamId`]) all go through it. Adding an
//! architecture is adding its rows here ([`ModelConfig::params`]) and its layer differences
//! in the one layer forward.

use super::config::ModelConfig;

/// What a parameter is (with its layer, the typed id of an HF weight: [`ParamId`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum ParamKind {
    Embed,
    FinalNorm,
    /// Absent when tied to the embedding.
    LmHead,
    InputNorm,
    PostNorm,
    QProj,
    KProj,
    VProj,
    /// Qwen2's q/k/v biases.
    QBias,
    KBias,
    VBias,
    /// Qwen3's per-head q/k RMSNorm weights.
    QNorm,
    KNorm,
    OProj,
    GateProj,
    UpProj,
    DownProj,
}

/// The served buffer a parameter lands in: its own, or a row block of a fused one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fused {
    /// Served as is (norms, the embedding, `o_proj`, `down_proj`, an untied head).
    Own,
    /// Row block `i` of `qkv_proj` (`[q; k; v]`).
    Qkv(usize),
    /// Block `i` of `qkv_bias`.
    QkvBias(usize),
    /// Row block `i` of `gate_up_proj` (`[gate; up]`).
    GateUp(usize),
}

impl ParamKind {
    /// Every kind, in declaration order.
    pub const ALL: [ParamKind; 17] = {
        use ParamKind::*;
        [
            Embed, FinalNorm, LmHead, InputNorm, PostNorm, QProj, KProj, VProj, QBias, KBias, VBias, QNorm, KNorm,
            OProj, GateProj, UpProj, DownProj,
        ]
    };

    /// A model-level weight (embedding, final norm, LM head), not one of a layer's.
    pub fn is_model_level(self) -> bool {
        matches!(self, ParamKind::Embed | ParamKind::FinalNorm | ParamKind::LmHead)
    }

    /// The HF name's suffix (after `model.layers.{l}.` for a layer's parameter).
    pub fn suffix(self) -> &'static str {
        use ParamKind::*;
        match self {
            Embed => "model.embed_tokens.weight",
            FinalNorm => "model.norm.weight",
            LmHead => "lm_head.weight",
            InputNorm => "input_layernorm.weight",
            PostNorm => "post_attention_layernorm.weight",
            QProj => "self_attn.q_proj.weight",
            KProj => "self_attn.k_proj.weight",
            VProj => "self_attn.v_proj.weight",
            QBias => "self_attn.q_proj.bias",
            KBias => "self_attn.k_proj.bias",
            VBias => "self_attn.v_proj.bias",
            QNorm => "self_attn.q_norm.weight",
            KNorm => "self_attn.k_norm.weight",
            OProj => "self_attn.o_proj.weight",
            GateProj => "mlp.gate_proj.weight",
            UpProj => "mlp.up_proj.weight",
            DownProj => "mlp.down_proj.weight",
        }
    }

    /// Where the parameter is served.
    pub fn fused(self) -> Fused {
        use ParamKind::*;
        match self {
            QProj => Fused::Qkv(0),
            KProj => Fused::Qkv(1),
            VProj => Fused::Qkv(2),
            QBias => Fused::QkvBias(0),
            KBias => Fused::QkvBias(1),
            VBias => Fused::QkvBias(2),
            GateProj => Fused::GateUp(0),
            UpProj => Fused::GateUp(1),
            _ => Fused::Own,
        }
    }
}

/// The typed id of one HF weight: its layer (`None` for the model-level weights) and kind.
/// Gradients and AdamW moments are keyed by it; its [`std::fmt::Display`] is the HF tensor
/// name and [`ParamId::parse`] the inverse.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ParamId {
    pub layer: Option<usize>,
    pub kind: ParamKind,
}

impl ParamId {
    /// A model-level weight (embedding, final norm, LM head).
    pub const fn model(kind: ParamKind) -> Self {
        Self { layer: None, kind }
    }

    /// A weight of layer `l`.
    pub const fn layer(l: usize, kind: ParamKind) -> Self {
        Self { layer: Some(l), kind }
    }

    /// The HF tensor name.
    pub fn name(self) -> String {
        self.to_string()
    }

    /// The id of an HF tensor name (`model.layers.{l}.{suffix}` or a model-level name);
    /// `None` for a name no architecture has. Whether this model has it is the table's
    /// question ([`ModelConfig::params`]).
    pub fn parse(name: &str) -> Option<Self> {
        if let Some(rest) = name.strip_prefix("model.layers.") {
            let (l, suffix) = rest.split_once('.')?;
            let l = l.parse().ok().filter(|_| !l.starts_with('+') && (l == "0" || !l.starts_with('0')))?;
            let kind = ParamKind::ALL.into_iter().find(|k| !k.is_model_level() && k.suffix() == suffix)?;
            return Some(Self::layer(l, kind));
        }
        ParamKind::ALL.into_iter().find(|k| k.is_model_level() && k.suffix() == name).map(Self::model)
    }
}

impl std::fmt::Display for ParamId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.layer {
            Some(l) => write!(f, "model.layers.{l}.{}", self.kind.suffix()),
            None => f.write_str(self.kind.suffix()),
        }
    }
}

/// One HF weight: its id and shape.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Param {
    pub id: ParamId,
    pub shape: Vec<usize>,
}

impl ModelConfig {
    /// The weights of one decoder layer, in order, with their shapes (`[out, in]` linear
    /// weights): the architecture's rows of the table.
    pub fn layer_params(&self) -> Vec<(ParamKind, Vec<usize>)> {
        use ParamKind::*;
        let (h, i, d) = (self.hidden_size, self.intermediate_size, self.head_dim);
        let (q, kv) = (self.num_attention_heads * d, self.num_key_value_heads * d);
        let mut p = vec![(InputNorm, vec![h]), (PostNorm, vec![h]), (QProj, vec![q, h]), (KProj, vec![kv, h])];
        p.push((VProj, vec![kv, h]));
        if self.qkv_bias {
            p.extend([(QBias, vec![q]), (KBias, vec![kv]), (VBias, vec![kv])]);
        }
        if self.qk_norm {
            p.extend([(QNorm, vec![d]), (KNorm, vec![d])]);
        }
        p.extend([(OProj, vec![h, q]), (GateProj, vec![i, h]), (UpProj, vec![i, h]), (DownProj, vec![h, i])]);
        p
    }

    /// Every HF weight of the model: the embedding, the final norm, the LM head unless tied,
    /// then each layer's [`Self::layer_params`].
    pub fn params(&self) -> Vec<Param> {
        let (h, v) = (self.hidden_size, self.vocab_size);
        let mut out = vec![
            Param { id: ParamId::model(ParamKind::Embed), shape: vec![v, h] },
            Param { id: ParamId::model(ParamKind::FinalNorm), shape: vec![h] },
        ];
        if !self.tie_word_embeddings {
            out.push(Param { id: ParamId::model(ParamKind::LmHead), shape: vec![v, h] });
        }
        let layer = self.layer_params();
        for l in 0..self.num_hidden_layers {
            out.extend(layer.iter().map(|(kind, shape)| Param { id: ParamId::layer(l, *kind), shape: shape.clone() }));
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every id's name parses back to it; names of no architecture do not parse.
    #[test]
    fn names_parse_back() {
        for kind in ParamKind::ALL {
            let id = if kind.is_model_level() { ParamId::model(kind) } else { ParamId::layer(12, kind) };
            assert_eq!(ParamId::parse(&id.name()), Some(id), "{id}");
        }
        assert_eq!(ParamId::parse("model.layers.3.self_attn.q_norm.weight"), Some(ParamId::layer(3, ParamKind::QNorm)));
        assert_eq!(ParamId::parse("lm_head.weight"), Some(ParamId::model(ParamKind::LmHead)));
        for bad in [
            "model.layers.03.mlp.up_proj.weight",
            "model.layers.+3.mlp.up_proj.weight",
            "model.layers.x.mlp.up_proj.weight",
            "model.layers.0.lm_head.weight",
            "model.layers.0.mlp.up_proj.bias",
            "model.norm.bias",
            "value_head.weight",
            "",
        ] {
            assert_eq!(ParamId::parse(bad), None, "{bad}");
        }
    }
}
