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
    /// Every [`Error::kind`], for metrics that start each at zero.
    pub const KINDS: [&'static str; 7] = [
        "api",
        "client",
        "invalid_spec",
        "missing_field",
        "serialize",
        "leader",
        "io",
    ];

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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_kind_an_error_reports_starts_at_zero() {
        let errors = [
            Error::MissingField("metadata.name"),
            Error::Leader("lost".into()),
            Error::Io(std::io::Error::other("bind")),
            Error::Serialize(serde_json::from_str::<u8>("x").expect_err("not JSON")),
            Error::Kube(kube::Error::LinesCodecMaxLineLengthExceeded),
        ];
        for e in &errors {
            assert!(Error::KINDS.contains(&e.kind()), "{e}: {}", e.kind());
        }
    }
}
