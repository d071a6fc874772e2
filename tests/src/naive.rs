//! An independent reference forward pass: scalar f64 loops written straight from the
//! HF `LlamaForCausalLM` / `Qwen2ForCausalLM` definitions, no KV cache, no kernels crate.

use crate::tiny::TinySpec;
use std::collections::BTreeMap;

type Weights = BTreeMap<String, (Vec<usize>, Vec<f32>)>;

fn w<'a>(ws: &'a Weights, name: &str) -> &'a [f32] {
    &ws.get(name).unwrap_or_else(|| panic!("no {name}")).1
}

/// `x [t, k] · W[n, k]ᵀ (+ b)`.
fn linear(x: &[Vec<f64>], wt: &[f32], b: Option<&[f32]>, n: usize) -> Vec<Vec<f64>> {
    x.iter()
        .map(|row| {
            let k = row.len();
            (0..n)
                .map(|j| (0..k).map(|l| row[l] * wt[j * k + l] as f64).sum::<f64>() + b.map_or(0.0, |b| b[j] as f64))
                .collect()
        })
        .collect()
}

fn rms(x: &[Vec<f64>], g: &[f32], eps: f64) -> Vec<Vec<f64>> {
    x.iter()
        .map(|r| {
            let inv = 1.0 / (r.iter().map(|v| v * v).sum::<f64>() / r.len() as f64 + eps).sqrt();
            r.iter().zip(g).map(|(v, g)| v * inv * *g as f64).collect()
        })
        .collect()
}

/// HF `_compute_default_rope_parameters` / `_compute_llama3_parameters`.
pub fn inv_freq(spec: &TinySpec) -> Vec<f64> {
    let d = spec.head_dim();
    (0..d / 2)
        .map(|i| {
            let f = 1.0 / 10000f64.powf((2 * i) as f64 / d as f64);
            let Some((factor, lo, hi, orig)) = spec.llama3_rope else { return f };
            let wavelen = 2.0 * std::f64::consts::PI / f;
            if wavelen < orig / hi {
                f
            } else if wavelen > orig / lo {
                f / factor
            } else {
                let s = (orig / wavelen - lo) / (hi - lo);
                (1.0 - s) * f / factor + s * f
            }
        })
        .collect()
}

fn rope(x: &mut [Vec<f64>], heads: usize, d: usize, freqs: &[f64]) {
    for (pos, row) in x.iter_mut().enumerate() {
        for h in 0..heads {
            let v = &mut row[h * d..(h + 1) * d];
            let rot: Vec<f64> = (0..d).map(|i| if i < d / 2 { -v[i + d / 2] } else { v[i - d / 2] }).collect();
            for i in 0..d {
                let a = pos as f64 * freqs[i % (d / 2)];
                v[i] = v[i] * a.cos() + rot[i] * a.sin();
            }
        }
    }
}

/// Logits `[tokens.len()][vocab]` of the whole sequence.
pub fn forward(spec: &TinySpec, ws: &Weights, tokens: &[u32]) -> Vec<Vec<f64>> {
    let (h, d, nh, nkv) = (spec.hidden, spec.head_dim(), spec.heads, spec.kv_heads);
    let emb = w(ws, "model.embed_tokens.weight");
    let mut x: Vec<Vec<f64>> =
        tokens.iter().map(|&t| emb[t as usize * h..(t as usize + 1) * h].iter().map(|&v| v as f64).collect()).collect();
    let freqs = inv_freq(spec);
    let t = tokens.len();
    for l in 0..spec.layers {
        let p = format!("model.layers.{l}.");
        let b = |n: &str| spec.has_bias().then(|| w(ws, &format!("{p}self_attn.{n}_proj.bias")));
        let n1 = rms(&x, w(ws, &format!("{p}input_layernorm.weight")), 1e-5);
        let mut q = linear(&n1, w(ws, &format!("{p}self_attn.q_proj.weight")), b("q"), nh * d);
        let mut k = linear(&n1, w(ws, &format!("{p}self_attn.k_proj.weight")), b("k"), nkv * d);
        let v = linear(&n1, w(ws, &format!("{p}self_attn.v_proj.weight")), b("v"), nkv * d);
        rope(&mut q, nh, d, &freqs);
        rope(&mut k, nkv, d, &freqs);
        let mut att = vec![vec![0.0; nh * d]; t];
        for i in 0..t {
            for hh in 0..nh {
                let g = hh / (nh / nkv);
                let s: Vec<f64> = (0..=i)
                    .map(|j| (0..d).map(|e| q[i][hh * d + e] * k[j][g * d + e]).sum::<f64>() / (d as f64).sqrt())
                    .collect();
                let m = s.iter().cloned().fold(f64::MIN, f64::max);
                let z: f64 = s.iter().map(|v| (v - m).exp()).sum();
                for (j, sj) in s.iter().enumerate() {
                    for e in 0..d {
                        att[i][hh * d + e] += (sj - m).exp() / z * v[j][g * d + e];
                    }
                }
            }
        }
        let o = linear(&att, w(ws, &format!("{p}self_attn.o_proj.weight")), None, h);
        for (xr, or) in x.iter_mut().zip(&o) {
            for (a, b) in xr.iter_mut().zip(or) {
                *a += b;
            }
        }
        let n2 = rms(&x, w(ws, &format!("{p}post_attention_layernorm.weight")), 1e-5);
        let gt = linear(&n2, w(ws, &format!("{p}mlp.gate_proj.weight")), None, spec.intermediate);
        let up = linear(&n2, w(ws, &format!("{p}mlp.up_proj.weight")), None, spec.intermediate);
        let act: Vec<Vec<f64>> = gt
            .iter()
            .zip(&up)
            .map(|(g, u)| g.iter().zip(u).map(|(g, u)| g / (1.0 + (-g).exp()) * u).collect())
            .collect();
        let dn = linear(&act, w(ws, &format!("{p}mlp.down_proj.weight")), None, h);
        for (xr, dr) in x.iter_mut().zip(&dn) {
            for (a, b) in xr.iter_mut().zip(dr) {
                *a += b;
            }
        }
    }
    let xn = rms(&x, w(ws, "model.norm.weight"), 1e-5);
    let head = if spec.tied { w(ws, "model.embed_tokens.weight") } else { w(ws, "lm_head.weight") };
    linear(&xn, head, None, crate::tiny::VOCAB)
}
