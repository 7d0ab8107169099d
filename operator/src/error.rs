//! The operator's one error type.

/// Everything a reconcile or the operator's startup can fail with.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A Kubernetes API call failed.
    #[error("kubernetes API: {0}")]
    Kube(#[from] kube::Error),
    /// The spec cannot be turned into objects (the API server's validation should have caught
    /// it; an older CRD may not have).
    #[error("invalid spec: {0}")]
    InvalidSpec(#[from] ferrite_crds::engine_args::SourceError),
    /// An object lacks a field the operator needs.
    #[error("object has no {0}")]
    MissingField(&'static str),
    /// A rendered object could not be (de)serialized.
    #[error("rendering: {0}")]
    Serialize(#[from] serde_json::Error),
    /// Leader election failed.
    #[error("leader election: {0}")]
    Leader(String),
    /// The metrics server failed.
    #[error("metrics server: {0}")]
    Io(#[from] std::io::Error),
}

impl Error {
    /// A short label for the `errors by kind` metric.
    pub fn kind(&self) -> &'static str {
        match self {
            Error::Kube(kube::Error::Api(_)) => "api",
            Error::Kube(_) => "client",
            Error::InvalidSpec(_) => "invalid_spec",
            Error::MissingField(_) => "missing_field",
            Error::Serialize(_) => "serialize",
            Error::Leader(_) => "leader",
            Error::Io(_) => "io",
        }
    }
}
