//! GGUF parsing and exact dequantization on hand-built files; the Q/K unpermutation;
//! concurrent conversions of a hand-built llama GGUF publish one complete folder that a
//! reader never sees missing or half-written.

use engine::convert::gguf::{GgmlType, Gguf, Value};
use engine::convert::{convert_gguf, unpermute_rows};
use half::f16;
use std::sync::atomic::{AtomicBool, Ordering};

fn string(b: &mut Vec<u8>, s: &str) {
    b.extend((s.len() as u64).to_le_bytes());
    b.extend(s.as_bytes());
}

/// A GGUF v3 file with the given tensors `(name, ggml dims, type id, data)`.
fn gguf_file(tensors: &[(&str, Vec<u64>, u32, Vec<u8>)]) -> Vec<u8> {
    let mut b = b"GGUF".to_vec();
    b.extend(3u32.to_le_bytes());
    b.extend((tensors.len() as u64).to_le_bytes());
    b.extend(2u64.to_le_bytes());
    string(&mut b, "general.architecture");
    b.extend(8u32.to_le_bytes());
    string(&mut b, "llama");
    string(&mut b, "test.list");
    b.extend(9u32.to_le_bytes());
    b.extend(5u32.to_le_bytes()); // i32 elements
    b.extend(2u64.to_le_bytes());
    b.extend((-7i32).to_le_bytes());
    b.extend(9i32.to_le_bytes());
    let mut offset = 0u64;
    let mut data = Vec::new();
    for (name, dims, ty, bytes) in tensors {
        string(&mut b, name);
        b.extend((dims.len() as u32).to_le_bytes());
        for d in dims {
            b.extend(d.to_le_bytes());
        }
        b.extend(ty.to_le_bytes());
        b.extend(offset.to_le_bytes());
        data.extend(bytes);
        while data.len() % 32 != 0 {
            data.push(0);
        }
        offset = data.len() as u64;
    }
    while !b.len().is_multiple_of(32) {
        b.push(0);
    }
    b.extend(data);
    b
}

#[test]
fn dequantizes_q4_1_q8_0_q4_0_and_f32_exactly() {
    // Q4_1: d = 0.5, m = −1; byte j holds (lo = j, hi = 15 − j) → x[j] = 0.5j − 1, x[j+16] = 0.5(15 − j) − 1.
    let mut q41 = Vec::new();
    q41.extend(f16::from_f32(0.5).to_le_bytes());
    q41.extend(f16::from_f32(-1.0).to_le_bytes());
    q41.extend((0..16u8).map(|j| j | ((15 - j) << 4)));
    // Q8_0 two blocks: d = 0.25 with q = −16..16, and d = 2 with q = 1.
    let mut q80 = Vec::new();
    q80.extend(f16::from_f32(0.25).to_le_bytes());
    q80.extend((0..32).map(|j| (j as i8 - 16) as u8));
    q80.extend(f16::from_f32(2.0).to_le_bytes());
    q80.extend([1u8; 32]);
    // Q4_0: d = 1; every nibble 3 → x = 3 − 8 = −5.
    let mut q40 = f16::from_f32(1.0).to_le_bytes().to_vec();
    q40.extend([0x33u8; 16]);
    let f32s: Vec<u8> = [1.5f32, -2.25, 3.0].iter().flat_map(|v| v.to_le_bytes()).collect();
    let bytes = gguf_file(&[
        ("a", vec![32], 3, q41),
        ("b", vec![32, 2], 8, q80),
        ("c", vec![32], 2, q40),
        ("d", vec![3], 0, f32s),
    ]);
    let path = tests::temp_dir("gguf").join("t.gguf");
    std::fs::write(&path, bytes).unwrap();
    let g = Gguf::open(&path).unwrap();
    assert_eq!(g.get("general.architecture"), Some(&Value::Str("llama".into())));
    assert_eq!(g.get("test.list"), Some(&Value::Array(vec![Value::Int(-7), Value::Int(9)])));
    let a = g.tensor("a").unwrap();
    assert_eq!(a.ty, GgmlType::Q4_1);
    let want: Vec<f32> =
        (0..16).map(|j| 0.5 * j as f32 - 1.0).chain((0..16).map(|j| 0.5 * (15 - j) as f32 - 1.0)).collect();
    assert_eq!(g.dequantize(a).unwrap(), want);
    let b = g.tensor("b").unwrap();
    assert_eq!(b.shape(), vec![2, 32]);
    let want: Vec<f32> = (0..32).map(|j| 0.25 * (j - 16) as f32).chain(std::iter::repeat_n(2.0, 32)).collect();
    assert_eq!(g.dequantize(b).unwrap(), want);
    assert_eq!(g.dequantize(g.tensor("c").unwrap()).unwrap(), vec![-5.0; 32]);
    assert_eq!(g.dequantize(g.tensor("d").unwrap()).unwrap(), vec![1.5, -2.25, 3.0]);
}

#[test]
fn rejects_truncated_and_foreign_files() {
    let dir = tests::temp_dir("gguf-bad");
    let p = dir.join("x.gguf");
    std::fs::write(&p, b"GGML....").unwrap();
    assert!(Gguf::open(&p).err().unwrap().to_string().contains("not a GGUF file"));
    let mut bytes = gguf_file(&[("d", vec![3], 0, vec![0; 12])]);
    bytes.truncate(bytes.len() - 40);
    std::fs::write(&p, bytes).unwrap();
    let e = Gguf::open(&p).err().unwrap().to_string();
    assert!(e.contains("x.gguf") && e.contains("`d` extends past the end"), "{e}");
}

#[test]
fn unpermute_inverts_llama_cpp_permute() {
    // llama.cpp convert_hf_to_gguf.py LlamaModel.permute:
    //   w.reshape(n_head, 2, rows/n_head/2, cols).swapaxes(1, 2).reshape(rows, cols)
    // i.e. GGUF row h·D + 2i + s holds HF row h·D + s·D/2 + i.
    let (n_head, d, cols) = (3, 8, 2);
    let rows = n_head * d;
    let hf: Vec<f32> = (0..rows * cols).map(|v| v as f32).collect();
    let mut permuted = vec![0.0; hf.len()];
    for h in 0..n_head {
        for s in 0..2 {
            for i in 0..d / 2 {
                let (src, dst) = (h * d + s * d / 2 + i, h * d + 2 * i + s);
                permuted[dst * cols..(dst + 1) * cols].copy_from_slice(&hf[src * cols..(src + 1) * cols]);
            }
        }
    }
    assert_eq!(permuted[2 * cols], hf[cols], "GGUF row 2 is HF row 1");
    assert_eq!(unpermute_rows(&permuted, rows, cols, n_head), hf);
}

/// A metadata value of [`llama_gguf`].
enum Meta {
    U32(u32),
    F32(f32),
    Str(&'static str),
    Strs(Vec<String>),
    I32s(Vec<i32>),
}

/// A one-layer llama GGUF (hidden 8, 2 heads, 1 KV head, FFN 16, F32 weights) with a
/// byte-level tokenizer (256 byte symbols + `<|im_start|>`, `<|im_end|>`).
fn llama_gguf() -> Vec<u8> {
    let mut tokens: Vec<String> =
        tokenizers::pre_tokenizers::byte_level::ByteLevel::alphabet().into_iter().map(String::from).collect();
    tokens.sort();
    tokens.extend(["<|im_start|>".to_string(), "<|im_end|>".to_string()]);
    let types: Vec<i32> = (0..tokens.len()).map(|i| if i < 256 { 1 } else { 3 }).collect();
    let vocab = tokens.len() as u64;
    let meta = [
        ("general.architecture", Meta::Str("llama")),
        ("llama.block_count", Meta::U32(1)),
        ("llama.embedding_length", Meta::U32(8)),
        ("llama.attention.head_count", Meta::U32(2)),
        ("llama.attention.head_count_kv", Meta::U32(1)),
        ("llama.feed_forward_length", Meta::U32(16)),
        ("llama.context_length", Meta::U32(64)),
        ("llama.attention.layer_norm_rms_epsilon", Meta::F32(1e-5)),
        ("tokenizer.ggml.model", Meta::Str("gpt2")),
        ("tokenizer.ggml.pre", Meta::Str("smollm")),
        ("tokenizer.ggml.tokens", Meta::Strs(tokens)),
        ("tokenizer.ggml.merges", Meta::Strs(vec![])),
        ("tokenizer.ggml.token_type", Meta::I32s(types)),
        ("tokenizer.ggml.bos_token_id", Meta::U32(256)),
        ("tokenizer.ggml.eos_token_id", Meta::U32(257)),
    ];
    // (name, ggml dims: columns first)
    let tensors: Vec<(&str, Vec<u64>)> = vec![
        ("token_embd.weight", vec![8, vocab]),
        ("blk.0.attn_norm.weight", vec![8]),
        ("blk.0.attn_q.weight", vec![8, 8]),
        ("blk.0.attn_k.weight", vec![8, 4]),
        ("blk.0.attn_v.weight", vec![8, 4]),
        ("blk.0.attn_output.weight", vec![8, 8]),
        ("blk.0.ffn_norm.weight", vec![8]),
        ("blk.0.ffn_gate.weight", vec![8, 16]),
        ("blk.0.ffn_up.weight", vec![8, 16]),
        ("blk.0.ffn_down.weight", vec![16, 8]),
        ("output_norm.weight", vec![8]),
    ];
    let mut b = b"GGUF".to_vec();
    b.extend(3u32.to_le_bytes());
    b.extend((tensors.len() as u64).to_le_bytes());
    b.extend((meta.len() as u64).to_le_bytes());
    for (key, v) in &meta {
        string(&mut b, key);
        match v {
            Meta::U32(x) => b.extend(4u32.to_le_bytes().into_iter().chain(x.to_le_bytes())),
            Meta::F32(x) => b.extend(6u32.to_le_bytes().into_iter().chain(x.to_le_bytes())),
            Meta::Str(s) => {
                b.extend(8u32.to_le_bytes());
                string(&mut b, s);
            }
            Meta::Strs(v) => {
                b.extend(9u32.to_le_bytes().into_iter().chain(8u32.to_le_bytes()));
                b.extend((v.len() as u64).to_le_bytes());
                v.iter().for_each(|s| string(&mut b, s));
            }
            Meta::I32s(v) => {
                b.extend(9u32.to_le_bytes().into_iter().chain(5u32.to_le_bytes()));
                b.extend((v.len() as u64).to_le_bytes());
                v.iter().for_each(|x| b.extend(x.to_le_bytes()));
            }
        }
    }
    let mut data = Vec::new();
    for (i, (name, dims)) in tensors.iter().enumerate() {
        string(&mut b, name);
        b.extend((dims.len() as u32).to_le_bytes());
        dims.iter().for_each(|d| b.extend(d.to_le_bytes()));
        b.extend(0u32.to_le_bytes()); // F32
        b.extend((data.len() as u64).to_le_bytes());
        let n: u64 = dims.iter().product();
        data.extend((0..n).flat_map(|j| (((i as u64 * 31 + j * 7) % 13) as f32 * 0.05 - 0.3).to_le_bytes()));
        while data.len() % 32 != 0 {
            data.push(0);
        }
    }
    while !b.len().is_multiple_of(32) {
        b.push(0);
    }
    b.extend(data);
    b
}

#[test]
fn concurrent_conversions_publish_one_complete_folder() {
    let dir = tests::temp_dir("gguf-race");
    let gguf = dir.join("tiny.gguf");
    std::fs::write(&gguf, llama_gguf()).unwrap();
    let out = dir.join("model");
    // Twice: converters racing from scratch, then racing over the finished folder. A reader
    // loads the folder as `serve --model` would: once it exists it must always load.
    for round in 0..2 {
        let done = AtomicBool::new(false);
        std::thread::scope(|s| {
            let reader = s.spawn(|| {
                let (mut seen, mut loads) = (out.exists(), 0);
                while !done.load(Ordering::SeqCst) {
                    if !out.exists() {
                        assert!(!seen, "round {round}: the folder disappeared after it existed");
                        continue;
                    }
                    seen = true;
                    engine::Tokenizer::from_dir(&out).unwrap_or_else(|e| panic!("round {round}: {e}"));
                    engine::ModelConfig::from_dir(&out).unwrap_or_else(|e| panic!("round {round}: {e}"));
                    loads += 1;
                }
                loads
            });
            let writers: Vec<_> = (0..4).map(|_| s.spawn(|| convert_gguf(&gguf, &out, &|_| {}))).collect();
            let results: Vec<_> = writers.into_iter().map(|w| w.join()).collect();
            done.store(true, Ordering::SeqCst);
            reader.join().unwrap();
            for r in results {
                r.unwrap().unwrap_or_else(|e| panic!("round {round}: a conversion failed: {e}"));
            }
        });
        let mut left: Vec<String> =
            std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
        left.sort();
        assert_eq!(left, ["model", "tiny.gguf"], "round {round}: no staging folder left behind");
        let model = engine::Model::load(&out, &kernels::Device::Cpu).unwrap();
        assert_eq!((model.config.vocab_size, model.config.num_hidden_layers), (258, 1));
        let tok = engine::Tokenizer::from_dir(&out).unwrap();
        assert_eq!((tok.token_to_id("<|im_end|>"), tok.eos_token_ids.clone()), (Some(257), vec![257]));
    }
}
