//! `--quantization` turns a checkpoint's floating-point matrices into the blocks llama.cpp's
//! own quantizer writes for the same weights: the tiny F16 model quantized at load computes
//! exactly what `llama-quantize --pure` makes of it (committed under `tests/fixtures/tiny/`),
//! and the same weights as an HF safetensors checkpoint hold the same blocks (HF keeps its
//! own Q/K row order, so those products are compared row by row).

mod common;

use std::collections::HashMap;
use std::path::Path;

use candle_core::quantized::{gguf_file, GgmlDType};
use candle_core::{DType, Device, Tensor};
use ferrite_engine::model::llama::Llama;
use ferrite_engine::model::{
    load_model, load_model_with, load_part_with, parse_quantization, LoadOptions, Quantization,
};
use ferrite_kernels::quant::{quantize, KFormat, WeightFormat};

const IDS: [u32; 12] = [10, 20, 30, 40, 50, 104, 101, 108, 108, 111, 32, 119];

fn quantized(path: &Path, name: &str) -> Llama {
    let options = LoadOptions {
        quantization: Some(parse_quantization(name).expect("a CPU format")),
        ..Default::default()
    };
    load_model_with(path, &Device::Cpu, &options).expect("loads quantized")
}

fn logits(model: &Llama) -> Vec<Vec<f32>> {
    common::prefill_logits(model, &IDS).expect("forward")
}

fn bits(rows: &[Vec<f32>]) -> Vec<Vec<u32>> {
    rows.iter()
        .map(|r| r.iter().map(|v| v.to_bits()).collect())
        .collect()
}

#[test]
fn quantizing_the_f16_model_at_load_reproduces_llama_quantize() {
    let f16 = common::fixture("tiny/tiny-F16.gguf");
    for (name, file) in [("q8_0", "Q8_0"), ("q4_k", "Q4_K")] {
        let theirs = load_model(
            &common::fixture(&format!("tiny/tiny-F16-pure-{file}.gguf")),
            &Device::Cpu,
        )
        .expect("llama-quantize's file loads");
        let ours = quantized(&f16, name);
        assert_eq!(
            ours.resident_weight_bytes(),
            theirs.resident_weight_bytes(),
            "{name}: the same blocks take the same bytes"
        );
        assert_eq!(
            bits(&logits(&ours)),
            bits(&logits(&theirs)),
            "{name}: every logit equal to the bit"
        );
    }
}

/// The GGUF F16 model as an HF checkpoint: f16 safetensors under HF's names, Q/K rows back
/// in HF's order (llama.cpp's converter interleaves each head's two halves).
fn write_hf_from_gguf(gguf: &Path, dir: &Path) {
    let mut file = std::fs::File::open(gguf).expect("opens");
    let content = gguf_file::Content::read(&mut file).expect("GGUF");
    let meta = |k: &str| content.metadata[k].to_u32().expect("a u32") as usize;
    let (hidden, layers) = (meta("llama.embedding_length"), meta("llama.block_count"));
    let (heads, kv_heads) = (
        meta("llama.attention.head_count"),
        meta("llama.attention.head_count_kv"),
    );
    let vocab = content.tensor_infos["token_embd.weight"].shape.dims()[0];
    let mut read = |name: &str| {
        content
            .tensor(&mut file, name, &Device::Cpu)
            .and_then(|q| q.dequantize(&Device::Cpu))
            .unwrap_or_else(|e| panic!("{name}: {e}"))
    };
    let unpermute = |t: Tensor, heads: usize| {
        let (rows, cols) = t.dims2().expect("2d");
        t.reshape((heads, rows / heads / 2, 2, cols))
            .and_then(|x| x.transpose(1, 2))
            .and_then(|x| x.contiguous())
            .and_then(|x| x.reshape((rows, cols)))
            .expect("unpermute")
    };
    let mut tensors: HashMap<String, Tensor> = HashMap::new();
    tensors.insert(
        "model.embed_tokens.weight".into(),
        read("token_embd.weight"),
    );
    tensors.insert("lm_head.weight".into(), read("output.weight"));
    tensors.insert("model.norm.weight".into(), read("output_norm.weight"));
    for l in 0..layers {
        let p = format!("model.layers.{l}");
        let b = format!("blk.{l}");
        let q = unpermute(read(&format!("{b}.attn_q.weight")), heads);
        let k = unpermute(read(&format!("{b}.attn_k.weight")), kv_heads);
        for (hf, t) in [
            ("self_attn.q_proj", q),
            ("self_attn.k_proj", k),
            ("self_attn.v_proj", read(&format!("{b}.attn_v.weight"))),
            ("self_attn.o_proj", read(&format!("{b}.attn_output.weight"))),
            ("mlp.gate_proj", read(&format!("{b}.ffn_gate.weight"))),
            ("mlp.up_proj", read(&format!("{b}.ffn_up.weight"))),
            ("mlp.down_proj", read(&format!("{b}.ffn_down.weight"))),
            ("input_layernorm", read(&format!("{b}.attn_norm.weight"))),
            (
                "post_attention_layernorm",
                read(&format!("{b}.ffn_norm.weight")),
            ),
        ] {
            tensors.insert(format!("{p}.{hf}.weight"), t);
        }
    }
    let tensors: HashMap<String, Tensor> = tensors
        .into_iter()
        .map(|(n, t)| {
            let dtype = if t.rank() == 2 {
                DType::F16
            } else {
                DType::F32
            };
            (n, t.to_dtype(dtype).expect("exact: the values are f16"))
        })
        .collect();
    candle_core::safetensors::save(&tensors, dir.join("model.safetensors")).expect("save");
    let config = serde_json::json!({
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": hidden,
        "intermediate_size": meta("llama.feed_forward_length"),
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "vocab_size": vocab,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "max_position_embeddings": 512,
        "tie_word_embeddings": false,
    });
    std::fs::write(dir.join("config.json"), config.to_string()).expect("config");
}

/// For each output of llama.cpp's Q/K/V product (interleaved Q/K rows), the output of the
/// HF-ordered product that holds the same weight row.
fn hf_order(heads: usize, kv_heads: usize, hd: usize) -> Vec<usize> {
    let mut map = Vec::new();
    for (base, heads) in [(0, heads), (heads * hd, kv_heads)] {
        for h in 0..heads {
            for i in 0..hd / 2 {
                for p in 0..2 {
                    map.push(base + h * hd + p * (hd / 2) + i);
                }
            }
        }
    }
    map.extend((heads + kv_heads) * hd..(heads + 2 * kv_heads) * hd);
    map
}

#[test]
fn an_hf_checkpoint_quantized_at_load_holds_the_blocks_llama_quantize_writes() {
    let dir = tempfile::tempdir().expect("tempdir");
    write_hf_from_gguf(&common::fixture("tiny/tiny-F16.gguf"), dir.path());
    for (name, file) in [("q8_0", "Q8_0"), ("q4_k", "Q4_K")] {
        let theirs = load_model(
            &common::fixture(&format!("tiny/tiny-F16-pure-{file}.gguf")),
            &Device::Cpu,
        )
        .expect("llama-quantize's file loads");
        let ours = quantized(dir.path(), name);
        assert_eq!(
            ours.resident_weight_bytes(),
            theirs.resident_weight_bytes(),
            "{name}: HF weights quantized to the same number of blocks"
        );
        let c = theirs.config();
        let qkv = hf_order(c.num_heads, c.num_kv_heads, c.head_dim);
        let mut compared = 0;
        for (p, (a, b)) in ours.products().zip(theirs.products()).enumerate() {
            // Three input rows, so the batched kernels run too.
            let x: Vec<f32> = (0..3 * a.cols)
                .map(|i| ((i * 37 % 101) as f32 - 50.0) * 0.021)
                .collect();
            let (a, b) = (a.run(&x), b.run(&x));
            let width = b.len() / 3;
            for (t, (a, b)) in a.chunks_exact(width).zip(b.chunks_exact(width)).enumerate() {
                for (o, want) in b.iter().enumerate() {
                    // Every block's first product of a layer is Q/K/V.
                    let at = if p % 4 == 0 && p / 4 < c.num_layers {
                        qkv[o]
                    } else {
                        o
                    };
                    assert_eq!(
                        a[at].to_bits(),
                        want.to_bits(),
                        "{name}: product {p}, row {t}, output {o}"
                    );
                }
            }
            compared += 1;
        }
        assert_eq!(
            compared,
            4 * c.num_layers + 1,
            "{name}: every product compared"
        );
    }
}

/// The block format of a GGUF tensor type, where `--quantization` writes it.
fn quantizable(dtype: GgmlDType) -> Option<WeightFormat> {
    let k = |f| Some(WeightFormat::K(f));
    match dtype {
        GgmlDType::Q8_0 => Some(WeightFormat::Q8_0),
        GgmlDType::Q4_0 => Some(WeightFormat::Q4_0),
        GgmlDType::Q4_1 => Some(WeightFormat::Q4_1),
        GgmlDType::Q5_0 => Some(WeightFormat::Q5_0),
        GgmlDType::Q5_1 => Some(WeightFormat::Q5_1),
        GgmlDType::Q2K => k(KFormat::Q2K),
        GgmlDType::Q3K => k(KFormat::Q3K),
        GgmlDType::Q4K => k(KFormat::Q4K),
        GgmlDType::Q5K => k(KFormat::Q5K),
        GgmlDType::Q6K => k(KFormat::Q6K),
        _ => None,
    }
}

#[test]
fn every_matrix_llama_quantize_wrote_is_what_quantizing_at_load_writes() {
    // llama-quantize's files of the tiny F16 model: every matrix in one format (`--pure`), or
    // one matrix in each format `--quantization` knows (`--tensor-type`). Every matrix must
    // be, byte for byte, what the quantizer `--quantization` runs writes from the F16 values.
    let f16_path = common::fixture("tiny/tiny-F16.gguf");
    let mut f16_file = std::fs::File::open(&f16_path).expect("opens");
    let f16 = gguf_file::Content::read(&mut f16_file).expect("GGUF");
    let mut checked = std::collections::BTreeSet::new();
    for file in [
        "tiny-F16-every-format",
        "tiny-F16-pure-Q8_0",
        "tiny-F16-pure-Q4_K",
    ] {
        let path = common::fixture(&format!("tiny/{file}.gguf"));
        let mut theirs_file = std::fs::File::open(&path).expect("opens");
        let theirs = gguf_file::Content::read(&mut theirs_file).expect("GGUF");
        for (name, info) in &theirs.tensor_infos {
            let Some(format) = quantizable(info.ggml_dtype) else {
                continue;
            };
            let want = theirs
                .tensor(&mut theirs_file, name, &Device::Cpu)
                .and_then(|q| q.data().map(|d| d.into_owned()))
                .expect("their bytes");
            let values: Vec<f32> = f16
                .tensor(&mut f16_file, name, &Device::Cpu)
                .and_then(|q| q.dequantize(&Device::Cpu))
                .and_then(|t| t.flatten_all())
                .and_then(|t| t.to_vec1())
                .expect("the F16 values");
            let got = quantize::quantize_row(format, &values).expect("a quantizer");
            assert!(got == want, "{file}: {name} ({format:?}) differs");
            checked.insert(format!("{format:?}"));
        }
    }
    for format in quantize::QUANTIZABLE.map(|f| format!("{f:?}")) {
        assert!(checked.contains(&format), "no {format} matrix compared");
    }
}

#[test]
fn every_quantization_value_loads_the_model_smaller_and_runs_it() {
    let path = common::fixture("tiny/tiny-F16.gguf");
    let floats = load_model(&path, &Device::Cpu).expect("loads");
    for name in Quantization::all().map(Quantization::name) {
        let model = quantized(&path, name);
        assert!(
            model.resident_weight_bytes() < floats.resident_weight_bytes(),
            "{name}: quantized matrices take fewer bytes"
        );
        let rows = logits(&model);
        assert!(
            rows.iter().flatten().all(|v| v.is_finite()),
            "{name}: finite logits"
        );
    }
}

/// The values of the first `quantization` property's `enum` under `node`.
fn quantization_enum(node: &serde_yaml::Value) -> Option<Vec<String>> {
    match node {
        serde_yaml::Value::Mapping(map) => {
            if let Some(values) = map
                .get("quantization")
                .and_then(|q| q.get("enum"))
                .and_then(|e| e.as_sequence())
            {
                return Some(
                    values
                        .iter()
                        .filter_map(|v| v.as_str().map(str::to_owned))
                        .collect(),
                );
            }
            map.values().find_map(quantization_enum)
        }
        serde_yaml::Value::Sequence(items) => items.iter().find_map(quantization_enum),
        _ => None,
    }
}

#[test]
fn the_llmservice_quantization_values_are_the_engines() {
    // `spec.engine.quantization` reaches the engine as `--quantization`: every value the API
    // server accepts must be one the engine quantizes to, and every one it quantizes to
    // accepted.
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../crds/llmservice.yaml");
    let crd: serde_yaml::Value =
        serde_yaml::from_str(&std::fs::read_to_string(path).expect("the CRD")).expect("YAML");
    let accepted = quantization_enum(&crd).expect("spec.engine.quantization's enum");
    let names: Vec<String> = Quantization::all().map(|q| q.name().to_string()).collect();
    assert_eq!(accepted, names);
    for name in names {
        let value: ferrite_crds::llmservice::Quantization =
            serde_yaml::from_str(&name).expect("a CRD value");
        assert_eq!(value.flag_value(), name);
        assert!(parse_quantization(value.flag_value()).is_ok(), "{name}");
    }
}

#[test]
fn a_k_quant_mix_gives_each_matrix_the_format_llama_quantize_gives_it() {
    // llama-quantize's Q3_K_M, Q4_K_M and Q5_K_M files of the tiny model: quantizing the F16
    // model at load with the same mix must give every matrix the same format (the model's
    // fingerprint hashes each matrix's name, shape and format as held) and so the same bytes
    // in memory; each format's blocks are checked above.
    let f16 = common::fixture("tiny/tiny-F16.gguf");
    for (name, file) in [
        ("q3_k_m", "Q3_K_M"),
        ("q4_k_m", "Q4_K_M"),
        ("q5_k_m", "Q5_K_M"),
    ] {
        let theirs_path = common::fixture(&format!("tiny/tiny-{file}.gguf"));
        let (theirs, their_print) =
            load_part_with(&theirs_path, &Device::Cpu, &LoadOptions::default()).expect("loads");
        let options = LoadOptions {
            quantization: Some(parse_quantization(name).expect("a mix")),
            ..Default::default()
        };
        let (ours, our_print) = load_part_with(&f16, &Device::Cpu, &options).expect("loads");
        assert_eq!(our_print, their_print, "{name}: every matrix's format");
        assert_eq!(
            ours.resident_weight_bytes(),
            theirs.resident_weight_bytes(),
            "{name}"
        );
    }
}
