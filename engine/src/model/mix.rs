//! llama.cpp's K-quant mixes (`llama-quantize`'s file types Q3_K_S … Q5_K_M): the format each
//! matrix of a dense Llama-family model takes, chosen as llama.cpp's `llama_tensor_get_type`
//! chooses it, so a checkpoint quantized at load holds the formats `llama-quantize` gives it.

use ferrite_kernels::quant::kquant::QK_K;
use ferrite_kernels::quant::{KFormat, WeightFormat};

use super::config::{Architecture, ModelConfig};
use super::weights::WeightName;

/// A K-quant mix, named after llama.cpp's file type.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mix {
    /// Q3_K_S: Q3_K everywhere but the output projection.
    Q3KS,
    /// Q3_K_M: Q3_K, with Q4_K and Q5_K in the value, attention output and down projections.
    Q3KM,
    /// Q3_K_L: Q3_K, with Q5_K in the value, attention output and down projections.
    Q3KL,
    /// Q4_K_S: Q4_K, with Q5_K in the first layers' value and down projections.
    Q4KS,
    /// Q4_K_M: Q4_K, with Q6_K in about half the value and down projections.
    Q4KM,
    /// Q5_K_S: Q5_K everywhere but the output projection.
    Q5KS,
    /// Q5_K_M: Q5_K, with Q6_K in about half the value and down projections.
    Q5KM,
}

/// What a mix's choices depend on beyond the matrix itself.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MixModel {
    layers: usize,
    /// The embedding is the output projection, and quantized as one.
    tied: bool,
    /// llama.cpp's `LLM_TYPE_70B`: a Llama of 80 layers with grouped-query attention, whose
    /// value projections take at least Q5_K.
    seventy: bool,
}

impl MixModel {
    /// The model `config` describes.
    pub fn new(config: &ModelConfig) -> Self {
        MixModel {
            layers: config.num_layers,
            tied: config.tie_word_embeddings,
            seventy: config.architecture == Architecture::Llama
                && config.num_layers == 80
                && config.num_heads != config.num_kv_heads,
        }
    }
}

/// llama.cpp's `use_more_bits`: the first and last eighth of the layers, and every third
/// layer between.
fn more_bits(layer: usize, layers: usize) -> bool {
    layer < layers / 8 || layer >= 7 * layers / 8 || (layer - layers / 8) % 3 == 2
}

/// The output projection's format, and a tied embedding's: Q6_K, or Q8_0 where its rows are
/// not whole 256-value blocks.
fn output(cols: usize) -> WeightFormat {
    if cols.is_multiple_of(QK_K) {
        WeightFormat::K(KFormat::Q6K)
    } else {
        WeightFormat::Q8_0
    }
}

impl Mix {
    /// Every mix, in the order `--quantization` lists them.
    pub const ALL: [Mix; 7] = [
        Mix::Q3KS,
        Mix::Q3KM,
        Mix::Q3KL,
        Mix::Q4KS,
        Mix::Q4KM,
        Mix::Q5KS,
        Mix::Q5KM,
    ];

    /// The `--quantization` value that names it: llama.cpp's file type in lower case.
    pub fn name(self) -> &'static str {
        match self {
            Mix::Q3KS => "q3_k_s",
            Mix::Q3KM => "q3_k_m",
            Mix::Q3KL => "q3_k_l",
            Mix::Q4KS => "q4_k_s",
            Mix::Q4KM => "q4_k_m",
            Mix::Q5KS => "q5_k_s",
            Mix::Q5KM => "q5_k_m",
        }
    }

    /// The format most matrices take.
    fn base(self) -> KFormat {
        match self {
            Mix::Q3KS | Mix::Q3KM | Mix::Q3KL => KFormat::Q3K,
            Mix::Q4KS | Mix::Q4KM => KFormat::Q4K,
            Mix::Q5KS | Mix::Q5KM => KFormat::Q5K,
        }
    }

    /// The format the mix asks for matrix `name` (rows of `cols` values) of `model`, before
    /// llama.cpp's fallback for rows its blocks do not fit
    /// ([`ferrite_kernels::quant::quantize::format_for`]).
    pub fn choose(self, name: WeightName, cols: usize, model: &MixModel) -> WeightFormat {
        use KFormat::{Q3K, Q4K, Q5K, Q6K};
        let base = self.base();
        let f = match name {
            WeightName::Output => return output(cols),
            WeightName::Embed if model.tied => return output(cols),
            WeightName::V(l) => {
                let f = match self {
                    Mix::Q3KM if l < 2 => Q5K,
                    Mix::Q3KM => Q4K,
                    Mix::Q3KL => Q5K,
                    Mix::Q4KM | Mix::Q5KM if more_bits(l, model.layers) => Q6K,
                    Mix::Q4KS if l < 4 => Q5K,
                    _ => base,
                };
                if model.seventy && matches!(f, Q3K | Q4K) {
                    Q5K
                } else {
                    f
                }
            }
            WeightName::Down(l) => match self {
                Mix::Q3KM if l < model.layers / 16 => Q5K,
                Mix::Q3KM => Q4K,
                Mix::Q3KL => Q5K,
                Mix::Q4KM | Mix::Q5KM if more_bits(l, model.layers) => Q6K,
                Mix::Q4KS if l < model.layers / 8 => Q5K,
                _ => base,
            },
            WeightName::O(_) => match self {
                Mix::Q3KM => Q4K,
                Mix::Q3KL => Q5K,
                _ => base,
            },
            _ => base,
        };
        WeightFormat::K(f)
    }
}

#[cfg(test)]
mod tests {
    use ferrite_kernels::quant::quantize;

    use super::*;

    /// The weight a GGUF tensor name stands for, and the row width of its matrix.
    fn weight(name: &str, hidden: usize, ffn: usize) -> Option<(WeightName, usize)> {
        match name {
            "token_embd.weight" => return Some((WeightName::Embed, hidden)),
            "output.weight" => return Some((WeightName::Output, hidden)),
            _ => {}
        }
        let rest = name.strip_prefix("blk.")?;
        let (layer, tensor) = rest.split_once('.')?;
        let l: usize = layer.parse().ok()?;
        Some(match tensor {
            "attn_q.weight" => (WeightName::Q(l), hidden),
            "attn_k.weight" => (WeightName::K(l), hidden),
            "attn_v.weight" => (WeightName::V(l), hidden),
            "attn_output.weight" => (WeightName::O(l), hidden),
            "ffn_gate.weight" => (WeightName::Gate(l), hidden),
            "ffn_up.weight" => (WeightName::Up(l), hidden),
            "ffn_down.weight" => (WeightName::Down(l), ffn),
            _ => return None,
        })
    }

    #[test]
    fn each_mix_chooses_what_llama_quantize_chooses() {
        // llama-quantize --dry-run's choice for every matrix of three model shapes
        // (scripts/ggml-reference/regenerate.sh): 32 layers with GQA; SmolLM2's widths with
        // tied embeddings (the fallbacks); 80 layers with GQA (the 70B rule).
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../tests/fixtures/llama-quantize-mixes.json"
        );
        let text = std::fs::read_to_string(path).expect("the mixes fixture");
        let all: serde_json::Value = serde_json::from_str(&text).expect("JSON");
        let models = all["models"].as_array().expect("models");
        assert_eq!(models.len(), 3);
        let mut compared = 0;
        for m in models {
            let field = |k: &str| m[k].as_u64().expect("a size") as usize;
            let (layers, heads, kv) = (field("layers"), field("heads"), field("kv_heads"));
            let (hidden, ffn) = (field("hidden"), field("ffn"));
            let model = MixModel {
                layers,
                tied: m["tied"].as_bool().expect("tied"),
                seventy: layers == 80 && heads != kv,
            };
            let types = m["types"].as_object().expect("types");
            assert_eq!(types.len(), Mix::ALL.len());
            for mix in Mix::ALL {
                let name = mix.name();
                let theirs = types[name].as_object().expect("a mix's types");
                assert!(!theirs.is_empty(), "{name}");
                for (tensor, want) in theirs {
                    let (w, cols) = weight(tensor, hidden, ffn).expect("a matrix");
                    let got = quantize::format_for(mix.choose(w, cols, &model), cols)
                        .map(WeightFormat::name);
                    assert_eq!(got, want.as_str(), "{}: {name}, {tensor}", m["name"]);
                    compared += 1;
                }
            }
        }
        assert!(compared > 5000, "{compared}");
    }

    #[test]
    fn more_bits_is_llama_cpps_use_more_bits() {
        // 32 layers: the first four, the last four, and every third from the fifth's second.
        let chosen: Vec<usize> = (0..32).filter(|&l| more_bits(l, 32)).collect();
        assert_eq!(
            chosen,
            [0, 1, 2, 3, 6, 9, 12, 15, 18, 21, 24, 27, 28, 29, 30, 31]
        );
    }
}
