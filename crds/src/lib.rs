//! Ferrite's Kubernetes API: the `LLMService` custom resource and the mapping from its spec
//! to engine flags that the operator and `ferrite-engine --from-manifest` share.

#![forbid(unsafe_code)]

pub mod engine_args;
pub mod llmservice;

pub use engine_args::{engine_args, served_model_name, served_model_names, ModelSource};
pub use llmservice::{
    EngineSpec, LLMService, LLMServiceSpec, LLMServiceStatus, ModelSpec, ParallelismStatus,
};

/// The CustomResourceDefinition as YAML, as `crdgen` writes it to `crds/llmservice.yaml`.
pub fn crd_yaml() -> Result<String, serde_yaml::Error> {
    use kube::CustomResourceExt;
    serde_yaml::to_string(&LLMService::crd())
}
