//! Tiny random models: forward vs the independent f64 reference, cached vs full forward,
//! loading formats and error messages, tokenizer and chat template.

use engine::{ChatMessage, Model, ModelConfig, Tokenizer};
use kernels::Device;
use safetensors::Dtype;
use tests::tiny::{TinySpec, VOCAB};
use tests::{max_abs_diff, naive, temp_dir};

const PROMPT: [u32; 9] = [5, 200, 17, 99, 3, 255, 42, 42, 7];

/// Writes `spec`, loads it, and compares all-position logits with the f64 reference.
fn check(name: &str, spec: TinySpec, tol: f32) {
    let dir = temp_dir(&format!("tiny-{name}"));
    let weights = spec.write(&dir);
    let model = Model::load(&dir, &Device::Cpu).unwrap();
    let mut cache = model.new_cache(32).unwrap();
    let got = model.forward(&PROMPT, &mut cache, true).unwrap();
    assert_eq!(got.shape(), &[PROMPT.len(), VOCAB]);
    let want: Vec<f32> = naive::forward(&spec, &weights, &PROMPT).into_iter().flatten().map(|v| v as f32).collect();
    let diff = max_abs_diff(got.as_slice().unwrap(), &want);
    assert!(diff < tol, "{name}: max |logit diff| {diff} >= {tol}");
}

#[test]
fn forward_matches_f64_reference() {
    check("llama-gqa-tied", TinySpec::default(), 1e-4);
    check("llama-untied", TinySpec { tied: false, seed: 8, ..Default::default() }, 1e-4);
    check("llama-mha", TinySpec { kv_heads: 4, seed: 9, ..Default::default() }, 1e-4);
    check("qwen2-bias", TinySpec { architecture: "Qwen2ForCausalLM", seed: 10, ..Default::default() }, 1e-4);
    check("llama3-rope", TinySpec { llama3_rope: Some((8.0, 1.0, 4.0, 16.0)), seed: 11, ..Default::default() }, 1e-4);
    check("bf16", TinySpec { dtype: Dtype::BF16, seed: 12, ..Default::default() }, 1e-4);
    check("f16", TinySpec { dtype: Dtype::F16, seed: 13, ..Default::default() }, 1e-4);
}

#[test]
fn cached_forward_equals_full_forward() {
    let spec = TinySpec { architecture: "Qwen2ForCausalLM", seed: 21, ..Default::default() };
    let dir = temp_dir("tiny-cached");
    spec.write(&dir);
    let model = Model::load(&dir, &Device::Cpu).unwrap();
    let full = model.forward(&PROMPT, &mut model.new_cache(16).unwrap(), true).unwrap();
    // Chunks of 4, 1, 3, 1 tokens.
    let mut cache = model.new_cache(16).unwrap();
    let mut start = 0;
    for n in [4, 1, 3, 1] {
        let part = model.forward(&PROMPT[start..start + n], &mut cache, true).unwrap();
        let want = &full.as_slice().unwrap()[start * VOCAB..(start + n) * VOCAB];
        assert!(max_abs_diff(part.as_slice().unwrap(), want) < 1e-5, "chunk at {start}");
        start += n;
    }
    assert_eq!(cache.len(), PROMPT.len());
    let err = model.forward(&[1; 8], &mut cache, false).unwrap_err();
    assert!(err.to_string().contains("9 cached + 8 new tokens exceed the context of 16"), "{err}");
}

#[test]
fn sharded_weights_load_like_a_single_file() {
    let spec = TinySpec { seed: 31, ..Default::default() };
    let single = temp_dir("tiny-single");
    let weights = spec.write(&single);
    let sharded = temp_dir("tiny-sharded");
    spec.write(&sharded);
    std::fs::remove_file(sharded.join("model.safetensors")).unwrap();
    let (a, b): (Vec<_>, Vec<_>) = weights.into_iter().enumerate().partition(|(i, _)| i % 2 == 0);
    let mut map = serde_json::Map::new();
    for (file, part) in [("model-00001-of-00002.safetensors", a), ("model-00002-of-00002.safetensors", b)] {
        let part: std::collections::BTreeMap<_, _> = part.into_iter().map(|(_, kv)| kv).collect();
        for k in part.keys() {
            map.insert(k.clone(), file.into());
        }
        tests::tiny::write_safetensors(&sharded.join(file), &part, Dtype::F32);
    }
    std::fs::write(
        sharded.join("model.safetensors.index.json"),
        serde_json::json!({"metadata": {}, "weight_map": map}).to_string(),
    )
    .unwrap();
    let l1 = Model::load(&single, &Device::Cpu)
        .unwrap()
        .forward(&PROMPT, &mut Model::load(&single, &Device::Cpu).unwrap().new_cache(16).unwrap(), false)
        .unwrap();
    let m2 = Model::load(&sharded, &Device::Cpu).unwrap();
    let l2 = m2.forward(&PROMPT, &mut m2.new_cache(16).unwrap(), false).unwrap();
    assert_eq!(l1.as_slice().unwrap(), l2.as_slice().unwrap());
}

/// Writes a tiny model, applies `edit` to its folder, and checks the load error text.
fn check_load_error(name: &str, edit: impl FnOnce(&std::path::Path), expected: &[&str]) {
    let dir = temp_dir(&format!("bad-{name}"));
    TinySpec::default().write(&dir);
    edit(&dir);
    let err = match Model::load(&dir, &Device::Cpu) {
        Ok(_) => panic!("{name}: loaded"),
        Err(e) => e.to_string(),
    };
    for e in expected {
        assert!(err.contains(e), "{name}: {err:?} lacks {e:?}");
    }
}

fn edit_config(dir: &std::path::Path, f: impl FnOnce(&mut serde_json::Value)) {
    let p = dir.join("config.json");
    let mut v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
    f(&mut v);
    std::fs::write(p, v.to_string()).unwrap();
}

fn rewrite_weights(
    dir: &std::path::Path,
    f: impl FnOnce(&mut std::collections::BTreeMap<String, (Vec<usize>, Vec<f32>)>),
) {
    let mut w = TinySpec::default().weights();
    f(&mut w);
    tests::tiny::write_safetensors(&dir.join("model.safetensors"), &w, Dtype::F32);
}

#[test]
fn load_errors_name_file_tensor_and_shape() {
    check_load_error(
        "arch",
        |d| edit_config(d, |c| c["architectures"] = serde_json::json!(["GPT2LMHeadModel"])),
        &["config.json", "unsupported architecture \"GPT2LMHeadModel\"", "LlamaForCausalLM"],
    );
    check_load_error(
        "json",
        |d| std::fs::write(d.join("config.json"), "{\"hidden_size\": 32,").unwrap(),
        &["config.json", "invalid JSON"],
    );
    check_load_error(
        "heads",
        |d| edit_config(d, |c| c["num_key_value_heads"] = serde_json::json!(3)),
        &["num_attention_heads 4 must be a positive multiple of num_key_value_heads 3"],
    );
    check_load_error(
        "missing",
        |d| rewrite_weights(d, |w| drop(w.remove("model.layers.1.mlp.up_proj.weight"))),
        &["model.safetensors", "missing tensor `model.layers.1.mlp.up_proj.weight`", "[48, 32]"],
    );
    check_load_error(
        "shape",
        |d| {
            rewrite_weights(d, |w| {
                drop(w.insert("model.layers.0.self_attn.k_proj.weight".into(), (vec![8, 32], vec![0.0; 256])))
            })
        },
        &["model.safetensors", "`model.layers.0.self_attn.k_proj.weight` has shape [8, 32], expected [16, 32]"],
    );
    check_load_error(
        "nofile",
        |d| std::fs::remove_file(d.join("model.safetensors")).unwrap(),
        &["model.safetensors", "No such file"],
    );
}

#[test]
fn config_parses_llama3_rope_scaling() {
    // Llama 3.1 8B values; inv_freq[i] = 500000^(−2i/128), then (HF _compute_llama3_parameters):
    // wavelen < 8192/4 kept, wavelen > 8192/1 divided by 8, else smoothly interpolated.
    let text = r#"{"architectures":["LlamaForCausalLM"],"hidden_size":4096,"intermediate_size":14336,"num_hidden_layers":32,
      "num_attention_heads":32,"num_key_value_heads":8,"vocab_size":128256,"rope_theta":500000.0,"eos_token_id":[128001,128008,128009],
      "rope_scaling":{"factor":8.0,"low_freq_factor":1.0,"high_freq_factor":4.0,"original_max_position_embeddings":8192,"rope_type":"llama3"}}"#;
    let c = ModelConfig::from_json(text, "config.json".as_ref()).unwrap();
    assert_eq!(c.head_dim, 128);
    assert_eq!(c.eos_token_ids, vec![128001, 128008, 128009]);
    let f = c.rope_inv_freq();
    assert_eq!(f[0], 1.0);
    // i = 63: wavelen = 2π·500000^(126/128) ≈ 2.5e6 > 8192 → divided by 8.
    assert!((f[63] - 500000f64.powf(-126.0 / 128.0) / 8.0).abs() < 1e-15);
    // i = 40: f = 500000^(-80/128) = 2.7384e-4, wavelen = 22944 > 8192 → f / 8.
    assert!((f[40] - 500000f64.powf(-80.0 / 128.0) / 8.0).abs() < 1e-15);
    // i = 30: f = 500000^(-60/128) = 2.13112e-3, wavelen = 2948.30 in (2048, 8192):
    // smooth = (8192/2948.30 − 1)/3 = 0.59285; f·(1 − smooth)/8 + f·smooth.
    let f30 = 500000f64.powf(-60.0 / 128.0);
    let smooth = (8192.0 / (2.0 * std::f64::consts::PI / f30) - 1.0) / 3.0;
    assert!((smooth - 0.592849).abs() < 1e-6);
    assert!((f[30] - (f30 * (1.0 - smooth) / 8.0 + f30 * smooth)).abs() < 1e-15);
    // A Qwen2 config always carries q/k/v biases.
    let q =
        ModelConfig::from_json(&text.replace("LlamaForCausalLM", "Qwen2ForCausalLM"), "config.json".as_ref()).unwrap();
    assert!(q.qkv_bias);
    let e = ModelConfig::from_json(&text.replace("llama3", "yarn"), "x/config.json".as_ref()).unwrap_err();
    assert!(e.to_string().contains("x/config.json: rope_scaling.rope_type \"yarn\" is not supported"), "{e}");
}

/// Checkpoints saved by transformers itself (5.x and 4.x `config.json` formats; fixtures
/// from tests/fixtures/make_hf_reference.py, and Qwen3's from make_qwen3_reference.py)
/// against HF's float64 logits at every position.
#[test]
fn transformers_checkpoints_match_hf_logits() {
    let (mut seen, mut summary) = (0, vec![]);
    for entry in std::fs::read_dir(tests::fixture("hf")).unwrap() {
        let dir = entry.unwrap().path();
        let name = dir.file_name().unwrap().to_string_lossy().to_string();
        let reference: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join("reference.json")).unwrap()).unwrap();
        let ids: Vec<u32> = serde_json::from_value(reference["input_ids"].clone()).unwrap();
        let want: Vec<Vec<f64>> = serde_json::from_value(reference["logits"].clone()).unwrap();
        let model = Model::load(&dir, &Device::Cpu).unwrap_or_else(|e| panic!("{name}: {e}"));
        let got = model.forward(&ids, &mut model.new_cache(ids.len()).unwrap(), true).unwrap();
        let want: Vec<f32> = want.into_iter().flatten().map(|v| v as f32).collect();
        let diff = max_abs_diff(got.as_slice().unwrap(), &want);
        summary.push(format!("{name}: {diff:.2e}"));
        assert!(diff < 1e-4, "{name}: max |logit − HF| {diff} (θ = {})", model.config.rope_theta);
        seen += 1;
    }
    eprintln!("HF checkpoints, max |logit diff|: {}", summary.join(", "));
    assert_eq!(seen, 6, "fixtures: {summary:?}");
}

/// `(rope_theta, llama3 (factor, original_max_position_embeddings))` of a parsed config.
type Rope = (f64, Option<(f64, f64)>);

/// One `config.json` edit and the expected outcome: `Ok(Rope)` or an error containing the text.
fn check_config(base: &str, edit: serde_json::Value, expected: Result<Rope, &str>) {
    let mut c: serde_json::Value = serde_json::from_str(base).unwrap();
    for (k, v) in edit.as_object().unwrap() {
        c[k] = v.clone();
    }
    let got = ModelConfig::from_json(&c.to_string(), "m/config.json".as_ref())
        .map(|c| (c.rope_theta, c.rope_scaling.map(|s| (s.factor, s.original_max_position_embeddings))))
        .map_err(|e| e.to_string());
    match (&got, expected) {
        (Ok(g), Ok(w)) => assert_eq!(*g, w, "{edit}"),
        (Err(g), Err(w)) => assert!(g.contains(w) && g.starts_with("m/config.json: "), "{edit}: {g:?} lacks {w:?}"),
        _ => panic!("{edit}: got {got:?}, expected {expected:?}"),
    }
}

#[test]
fn config_fields_that_change_the_math_are_read_or_refused() {
    use serde_json::json;
    // Qwen2.5-0.5B-Instruct's config.json (transformers 4.43): a sliding_window that
    // use_sliding_window = false switches off, max_window_layers below the depth.
    let qwen25 = r#"{"architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643,
      "eos_token_id": 151645, "hidden_act": "silu", "hidden_size": 896, "initializer_range": 0.02,
      "intermediate_size": 4864, "max_position_embeddings": 32768, "max_window_layers": 21, "model_type": "qwen2",
      "num_attention_heads": 14, "num_hidden_layers": 24, "num_key_value_heads": 2, "rms_norm_eps": 1e-06,
      "rope_theta": 1000000.0, "sliding_window": 131072, "tie_word_embeddings": true, "torch_dtype": "bfloat16",
      "transformers_version": "4.43.1", "use_cache": true, "use_sliding_window": false, "vocab_size": 151936}"#;
    let llama = r#"{"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 96,
      "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 96,
      "max_position_embeddings": 1024}"#;
    let l3 = |extra: serde_json::Value| {
        let mut p = json!({"rope_type": "llama3", "rope_theta": 5e5, "factor": 32.0, "low_freq_factor": 1.0,
                           "high_freq_factor": 4.0, "original_max_position_embeddings": 8192});
        for (k, v) in extra.as_object().unwrap() {
            p[k] = v.clone();
        }
        p
    };
    check_config(qwen25, json!({}), Ok((1e6, None)));
    // transformers 5: no top-level rope_theta, the settings under rope_parameters.
    let v5 = json!({"rope_theta": null, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}});
    check_config(qwen25, v5, Ok((1e6, None)));
    check_config(qwen25, json!({"layer_types": vec!["full_attention"; 24]}), Ok((1e6, None)));
    // Inside the dict wins over the top level; the legacy rope_scaling over rope_parameters (HF order).
    check_config(qwen25, json!({"rope_parameters": {"rope_theta": 5e5}}), Ok((5e5, None)));
    check_config(llama, json!({"rope_parameters": l3(json!({}))}), Ok((5e5, Some((32.0, 8192.0)))));
    check_config(
        llama,
        json!({"rope_theta": 5e5, "rope_scaling": l3(json!({"rope_theta": null})), "rope_parameters": {"rope_theta": 1.0}}),
        Ok((5e5, Some((32.0, 8192.0)))),
    );
    // Nested by layer type; a missing original_max_position_embeddings is max_position_embeddings (HF).
    let nested = json!({"rope_parameters": {"full_attention": l3(json!({"original_max_position_embeddings": null}))}});
    check_config(llama, nested, Ok((5e5, Some((32.0, 1024.0)))));
    check_config(llama, json!({}), Ok((10000.0, None)));
    // Refused, naming the field.
    check_config(
        llama,
        json!({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}),
        Err("rope_parameters.rope_type \"yarn\" is not supported (supported: default, llama3)"),
    );
    check_config(llama, json!({"rope_parameters": l3(json!({"factor": null}))}), Err("rope_parameters.factor missing"));
    check_config(
        llama,
        json!({"rope_parameters": {"rope_theta": 1e4, "partial_rotary_factor": 0.5}}),
        Err("partial_rotary_factor 0.5 is not supported"),
    );
    check_config(
        qwen25,
        json!({"rope_parameters": {"rope_theta": "big"}}),
        Err("rope_parameters.rope_theta must be a number"),
    );
    let mut types = vec!["full_attention"; 24];
    types[21] = "sliding_attention";
    check_config(
        qwen25,
        json!({"layer_types": types}),
        Err("layer_types[21] = \"sliding_attention\" is not supported"),
    );
    check_config(
        qwen25,
        json!({"layer_types": ["full_attention"]}),
        Err("layer_types has 1 entries, num_hidden_layers is 24"),
    );
    check_config(
        qwen25,
        json!({"use_sliding_window": true}),
        Err("use_sliding_window = true makes layers 21.. sliding-window attention"),
    );
    check_config(qwen25, json!({"use_sliding_window": true, "max_window_layers": 24}), Ok((1e6, None)));
    check_config(qwen25, json!({"hidden_act": "gelu"}), Err("hidden_act \"gelu\" is not supported"));
    check_config(llama, json!({"mlp_bias": true}), Err("mlp_bias = true is not supported"));
    check_config(
        llama,
        json!({"attention_bias": true}),
        Err("attention_bias = true (biases on q/k/v_proj and o_proj)"),
    );
    check_config(
        llama,
        json!({"final_logit_softcapping": 30.0}),
        Err("final_logit_softcapping = 30.0: logit soft-capping"),
    );
    check_config(llama, json!({"attn_logit_softcapping": 50.0}), Err("attn_logit_softcapping = 50.0"));
}

#[test]
fn tokenizer_and_chat_template_of_a_model_folder() {
    let dir = temp_dir("tiny-tok");
    TinySpec::default().write(&dir);
    let tok = Tokenizer::from_dir(&dir).unwrap();
    assert_eq!(tok.vocab_size(), VOCAB);
    assert_eq!(tok.eos_token_ids, vec![258]);
    let text = tok.apply_chat_template(&[ChatMessage::new("user", "hé")], true).unwrap();
    assert_eq!(text, "<|im_start|>user\nhé<|im_end|>\n<|im_start|>assistant\n");
    let ids = tok.encode(&text, true).unwrap();
    // Byte-level symbols (GPT-2's byte→char map): "\n" → 'Ċ', "é" = C3 A9 → 'Ã' '©'.
    let mut want = vec!["<|im_start|>", "u", "s", "e", "r", "Ċ", "h", "Ã", "©", "<|im_end|>", "Ċ", "<|im_start|>"];
    want.extend(["a", "s", "s", "i", "s", "t", "a", "n", "t", "Ċ"]);
    let pieces: Vec<String> = ids.iter().map(|&i| tok.inner().id_to_token(i).unwrap()).collect();
    assert_eq!(pieces, want);
    assert_eq!((ids[0], ids[9]), (257, 258));
    assert_eq!(tok.decode(&ids, false).unwrap(), text);
    // Streaming decode never emits half a character.
    let mut stream = tok.decode_stream(false);
    let pieces: Vec<String> = ids.iter().filter_map(|&i| stream.step(i).unwrap()).collect();
    assert_eq!(pieces.concat(), text);
    assert!(pieces.iter().all(|p| !p.contains('\u{FFFD}')));
}

/// Qwen3-0.6B's `config.json` shape: `head_dim` 128 is not hidden/heads (64), and HF's
/// `Qwen3Config` default when the key is missing; q/k norms on, no q/k/v bias; what Qwen3
/// does not implement here is refused naming the field, and an unknown architecture names
/// the supported list.
#[test]
fn qwen3_configs_take_their_head_dim_and_refuse_what_is_not_implemented() {
    let base = serde_json::json!({"architectures": ["Qwen3ForCausalLM"], "hidden_size": 1024,
        "intermediate_size": 3072, "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8,
        "head_dim": 128, "vocab_size": 151936, "tie_word_embeddings": true, "attention_bias": false,
        "use_sliding_window": false, "max_window_layers": 28,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0}});
    let parse = |edit: serde_json::Value| {
        let mut c = base.clone();
        for (k, v) in edit.as_object().unwrap() {
            c[k] = v.clone();
        }
        ModelConfig::from_json(&c.to_string(), "q/config.json".as_ref()).map_err(|e| e.to_string())
    };
    let c = parse(serde_json::json!({})).unwrap();
    assert_eq!((c.head_dim, c.qk_norm, c.qkv_bias, c.rope_theta), (128, true, false, 1e6));
    let mut no_head_dim = base.clone();
    no_head_dim.as_object_mut().unwrap().remove("head_dim");
    assert_eq!(ModelConfig::from_json(&no_head_dim.to_string(), "q/config.json".as_ref()).unwrap().head_dim, 128);
    let err = |edit, want: &str| {
        let e = parse(edit).unwrap_err();
        assert!(e.contains(want), "{e:?} lacks {want:?}");
    };
    err(serde_json::json!({"attention_bias": true}), "attention_bias = true");
    err(serde_json::json!({"use_sliding_window": true, "max_window_layers": 20}), "use_sliding_window = true");
    err(serde_json::json!({"layer_types": vec!["sliding_attention"; 28]}), "layer_types[0]");
    err(
        serde_json::json!({"architectures": ["MistralForCausalLM"]}),
        "unsupported architecture \"MistralForCausalLM\" (supported: LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM)",
    );
}

/// The parameter table (`engine::model::params`) names every weight as HF does: for each
/// architecture (tied Llama, untied Qwen2 with biases, Qwen3 with q/k norms) the table's
/// names and shapes (`weight_shapes`), the served weights split back (`named_weights`) and
/// the tensors of the folder written by the test's own HF-layout writer are the same set,
/// and the weights round-trip bitwise through loading and splitting.
#[test]
fn the_parameter_table_names_every_hf_weight() {
    for (arch, tied) in [("LlamaForCausalLM", true), ("Qwen2ForCausalLM", false), ("Qwen3ForCausalLM", true)] {
        let dir = tests::temp_dir("param-table");
        let spec = tests::tiny::TinySpec { architecture: arch, tied, ..Default::default() };
        let written = spec.write(&dir);
        let model = Model::load(&dir, &Device::Cpu).unwrap();
        let table: Vec<(String, Vec<usize>)> = model.weight_shapes();
        let mut sorted = table.clone();
        sorted.sort();
        let files: Vec<(String, Vec<usize>)> = written.iter().map(|(n, (s, _))| (n.clone(), s.clone())).collect();
        assert_eq!(sorted, files, "{arch}: the table vs the HF tensors");
        let named = model.named_weights().unwrap();
        for (name, (shape, values)) in &written {
            let t = &named[name];
            assert_eq!(t.shape(), shape.as_slice(), "{arch}: {name}");
            assert_eq!(&t.to_vec().unwrap(), values, "{arch}: {name} round trip");
        }
        assert_eq!(named.len(), written.len(), "{arch}");
    }
}

/// The released configs of the models people train (Qwen3 0.6B/1.7B/4B, Qwen2.5
/// 0.5B/1.5B/7B, Llama 3.2 1B/3B; the values of their `config.json`, transformers 5 RoPE
/// format for the Qwen3s) parse with their real widths, GQA ratios and vocabularies, and every
/// one loads with random weights at one layer and runs a forward to finite logits: the three
/// smallest with their real vocabularies, the others with their real layer widths, GQA, head
/// dims and tying but a vocabulary of 4,096 (Qwen2.5-7B's untied 152,064-row embedding and
/// head alone would take 4.4 GB of CI memory).
#[test]
fn released_configs_load_at_reduced_depth_and_run() {
    type Case = (&'static str, &'static str, [usize; 6], bool, serde_json::Value);
    let rope = |theta: f64| serde_json::json!({"rope_parameters": {"rope_type": "default", "rope_theta": theta}});
    let llama3 = serde_json::json!({"rope_theta": 500000.0, "rope_scaling": {"rope_type": "llama3", "factor": 32.0,
        "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}});
    // (name, architecture, [hidden, intermediate, layers, heads, kv heads, vocab], tied, extra keys)
    let cases: Vec<Case> = vec![
        ("Qwen3-0.6B", "Qwen3ForCausalLM", [1024, 3072, 28, 16, 8, 151936], true, rope(1e6)),
        ("Qwen3-1.7B", "Qwen3ForCausalLM", [2048, 6144, 28, 16, 8, 151936], true, rope(1e6)),
        ("Qwen3-4B", "Qwen3ForCausalLM", [2560, 9728, 36, 32, 8, 151936], true, rope(1e6)),
        (
            "Qwen2.5-0.5B",
            "Qwen2ForCausalLM",
            [896, 4864, 24, 14, 2, 151936],
            true,
            serde_json::json!({"rope_theta": 1e6}),
        ),
        (
            "Qwen2.5-1.5B",
            "Qwen2ForCausalLM",
            [1536, 8960, 28, 12, 2, 151936],
            true,
            serde_json::json!({"rope_theta": 1e6}),
        ),
        (
            "Qwen2.5-7B",
            "Qwen2ForCausalLM",
            [3584, 18944, 28, 28, 4, 152064],
            false,
            serde_json::json!({"rope_theta": 1e6}),
        ),
        ("Llama-3.2-1B", "LlamaForCausalLM", [2048, 8192, 16, 32, 8, 128256], true, llama3.clone()),
        ("Llama-3.2-3B", "LlamaForCausalLM", [3072, 8192, 28, 24, 8, 128256], true, llama3),
    ];
    let head_dims = [128, 128, 128, 64, 128, 128, 64, 128];
    for ((name, arch, [h, i, l, nh, kv, v], tied, extra), want_hd) in cases.into_iter().zip(head_dims) {
        let mut c = serde_json::json!({"architectures": [arch], "hidden_size": h, "intermediate_size": i,
            "num_hidden_layers": l, "num_attention_heads": nh, "num_key_value_heads": kv, "vocab_size": v,
            "tie_word_embeddings": tied, "rms_norm_eps": 1e-6, "max_position_embeddings": 32768});
        if arch == "Qwen3ForCausalLM" {
            c["head_dim"] = serde_json::json!(128);
        }
        c.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
        let config =
            ModelConfig::from_json(&c.to_string(), "config.json".as_ref()).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(
            (config.head_dim, config.num_attention_heads / config.num_key_value_heads),
            (want_hd, nh / kv),
            "{name}"
        );
        assert_eq!(
            (config.qk_norm, config.qkv_bias),
            (arch == "Qwen3ForCausalLM", arch == "Qwen2ForCausalLM"),
            "{name}"
        );
        let vocab_size = if matches!(name, "Qwen3-0.6B" | "Qwen2.5-0.5B" | "Llama-3.2-1B") { v } else { 4096 };
        let config = ModelConfig { num_hidden_layers: 1, vocab_size, ..config };
        let random = |n: &str, shape: &[usize]| -> engine::Result<kernels::Tensor> {
            let mut s = n.bytes().fold(7u64, |a, b| a.wrapping_mul(31).wrapping_add(b as u64));
            let scale = if n.contains("norm") { 0.0 } else { 0.05 };
            let vals = (0..shape.iter().product::<usize>())
                .map(|_| {
                    s = engine::sampling::splitmix64(s);
                    let u = (s >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0;
                    if n.contains("norm") {
                        1.0
                    } else {
                        scale * u
                    }
                })
                .collect();
            Ok(kernels::Tensor::from_vec(vals, shape)?)
        };
        let model = Model::from_source(config, &random, &Device::Cpu).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(model.embed_tokens.is_none(), tied, "{name}: a tied embedding is the LM head's buffer");
        let ids = [1u32, 500, 2000, 4095, 7];
        let logits = model.forward(&ids, &mut model.new_cache(ids.len()).unwrap(), false).unwrap();
        assert_eq!(logits.shape(), [1, vocab_size], "{name}");
        assert!(logits.to_vec().unwrap().iter().all(|x| x.is_finite()), "{name}: non-finite logits");
        eprintln!("{name}: 1 layer of {h}/{i}, GQA {nh}/{kv}, head_dim {want_hd}, vocab {vocab_size}: forward ok");
    }
}
