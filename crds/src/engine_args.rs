//! The one mapping from an `LLMService` to the engine's command line, used by the operator
//! for the pod and by `ferrite-engine serve --from-manifest` locally. Flags carry vLLM's
//! names, so what users know from vLLM carries over.

use std::path::PathBuf;

use crate::llmservice::{LLMService, LLMServiceSpec};

/// Where a model's weights come from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ModelSource {
    /// A Hugging Face repository, fetched before the engine starts.
    HuggingFace {
        /// `org/repo`.
        repo: String,
        /// Branch, tag or commit; `main` when absent.
        revision: Option<String>,
    },
    /// A path inside a PersistentVolumeClaim, mounted read-only.
    Pvc {
        /// The claim's name.
        claim: String,
        /// Path inside the volume.
        path: String,
    },
    /// An absolute path already present on the node or in the image.
    File(PathBuf),
}

/// A model source that cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("spec.model.source `{value}`: {reason}; expected hf://org/repo, pvc://claim/path or file:///abs/path")]
pub struct SourceError {
    value: String,
    reason: &'static str,
}

impl ModelSource {
    /// Parses `spec.model.source` (with `revision` for `hf://`).
    pub fn parse(source: &str, revision: Option<&str>) -> Result<Self, SourceError> {
        let bad = |reason| SourceError {
            value: source.to_string(),
            reason,
        };
        if let Some(repo) = source.strip_prefix("hf://") {
            let mut parts = repo.split('/');
            match (parts.next(), parts.next(), parts.next()) {
                (Some(org), Some(name), None) if !org.is_empty() && !name.is_empty() => {
                    Ok(ModelSource::HuggingFace {
                        repo: repo.to_string(),
                        revision: revision.map(str::to_string),
                    })
                }
                _ => Err(bad("a Hugging Face source names exactly org/repo")),
            }
        } else if revision.is_some() {
            Err(bad("`revision` is only allowed with hf:// sources"))
        } else if let Some(rest) = source.strip_prefix("pvc://") {
            match rest.split_once('/') {
                Some((claim, path)) if !claim.is_empty() => Ok(ModelSource::Pvc {
                    claim: claim.to_string(),
                    path: path.to_string(),
                }),
                _ => Err(bad("a PVC source names pvc://claim/path")),
            }
        } else if let Some(path) = source.strip_prefix("file://") {
            if path.starts_with('/') {
                Ok(ModelSource::File(PathBuf::from(path)))
            } else {
                Err(bad("a file source needs an absolute path (file:///...)"))
            }
        } else {
            Err(bad("unknown scheme"))
        }
    }
}

/// Engine flags for `spec.engine` (and `--device cuda` when `spec.gpuResource` asks for
/// GPUs, which the engine refuses with a message until it has a GPU backend), in a fixed
/// order; unset fields are left to the engine's defaults and `extraArgs` come last.
pub fn engine_args(spec: &LLMServiceSpec) -> Vec<String> {
    let engine = &spec.engine;
    let mut args = Vec::new();
    let mut flag = |name: &str, value: Option<String>| {
        if let Some(v) = value {
            args.push(format!("--{name}"));
            args.push(v);
        }
    };
    flag(
        "tensor-parallel-size",
        engine.tensor_parallel_size.map(|v| v.to_string()),
    );
    flag(
        "pipeline-parallel-size",
        engine.pipeline_parallel_size.map(|v| v.to_string()),
    );
    flag(
        "gpu-memory-utilization",
        engine.gpu_memory_utilization.map(|v| v.to_string()),
    );
    flag("max-model-len", engine.max_model_len.map(|v| v.to_string()));
    flag("max-num-seqs", engine.max_num_seqs.map(|v| v.to_string()));
    flag(
        "max-num-batched-tokens",
        engine.max_num_batched_tokens.map(|v| v.to_string()),
    );
    flag("block-size", engine.block_size.map(|v| v.to_string()));
    flag(
        "quantization",
        engine.quantization.map(|q| q.flag_value().to_string()),
    );
    match engine.enable_prefix_caching {
        Some(true) => args.push("--enable-prefix-caching".into()),
        Some(false) => args.push("--no-enable-prefix-caching".into()),
        None => {}
    }
    if spec.gpu_resource.is_some() {
        args.extend(["--device".to_string(), "cuda".into()]);
    }
    args.extend(engine.extra_args.iter().cloned());
    args
}

/// The `model` name clients use: `spec.model.servedName`, else `metadata.name`.
pub fn served_model_name(svc: &LLMService) -> String {
    svc.spec
        .model
        .served_name
        .clone()
        .or_else(|| svc.metadata.name.clone())
        .unwrap_or_else(|| "model".into())
}

/// Every `model` name the LLMService answers to: [`served_model_name`] first (it names the
/// engine's metrics), then `spec.model.aliases`, each once.
pub fn served_model_names(svc: &LLMService) -> Vec<String> {
    let mut names = vec![served_model_name(svc)];
    for alias in &svc.spec.model.aliases {
        if !names.contains(alias) {
            names.push(alias.clone());
        }
    }
    names
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::llmservice::{EngineSpec, Quantization};

    /// A spec with `engine` and, if given, GPUs of `gpu`.
    fn spec(engine: EngineSpec, gpu: Option<&str>) -> LLMServiceSpec {
        let mut s: LLMServiceSpec =
            serde_json::from_value(serde_json::json!({"model": {"source": "hf://a/b"}}))
                .expect("minimal spec");
        s.engine = engine;
        s.gpu_resource = gpu.map(str::to_string);
        s
    }

    #[test]
    fn every_engine_field_maps_to_its_vllm_flag() {
        let engine = EngineSpec {
            tensor_parallel_size: Some(2),
            pipeline_parallel_size: Some(1),
            gpu_memory_utilization: Some(0.85),
            max_model_len: Some(4096),
            max_num_seqs: Some(64),
            max_num_batched_tokens: Some(1024),
            block_size: Some(32),
            enable_prefix_caching: Some(false),
            quantization: Some(Quantization::Q4K),
            extra_args: vec!["--seed".into(), "1".into()],
        };
        assert_eq!(
            engine_args(&spec(engine.clone(), None)).join(" "),
            "--tensor-parallel-size 2 --pipeline-parallel-size 1 --gpu-memory-utilization 0.85 \
             --max-model-len 4096 --max-num-seqs 64 --max-num-batched-tokens 1024 --block-size 32 \
             --quantization q4_k --no-enable-prefix-caching --seed 1"
        );
        assert!(engine_args(&spec(EngineSpec::default(), None)).is_empty());
        // GPUs requested: the engine is told, before the user's extra arguments.
        assert!(engine_args(&spec(engine, Some("nvidia.com/gpu")))
            .join(" ")
            .ends_with("--no-enable-prefix-caching --device cuda --seed 1"));
    }

    #[test]
    fn sources_parse_and_bad_ones_say_what_is_expected() {
        assert_eq!(
            ModelSource::parse("hf://HuggingFaceTB/SmolLM2-135M-Instruct", Some("main")),
            Ok(ModelSource::HuggingFace {
                repo: "HuggingFaceTB/SmolLM2-135M-Instruct".into(),
                revision: Some("main".into())
            })
        );
        assert_eq!(
            ModelSource::parse("pvc://models/llama/8b", None),
            Ok(ModelSource::Pvc {
                claim: "models".into(),
                path: "llama/8b".into()
            })
        );
        assert_eq!(
            ModelSource::parse("file:///m/x.gguf", None),
            Ok(ModelSource::File("/m/x.gguf".into()))
        );
        let err = ModelSource::parse("s3://bucket/x", None)
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(
            err.contains("unknown scheme") && err.contains("hf://org/repo"),
            "{err}"
        );
        assert!(ModelSource::parse("file:///x", Some("v1")).is_err());
        assert!(ModelSource::parse("hf://only-org", None).is_err());
    }
}
