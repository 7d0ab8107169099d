//! The committed CRD YAML — in `crds/` and in the Helm chart's `crds/` — is what the types
//! generate (`make crds` regenerates both).

#[test]
fn committed_crds_match_the_types() {
    let generated = ferrite_crds::crd_yaml().expect("renders");
    for rel in ["llmservice.yaml", "../charts/ferrite/crds/llmservice.yaml"] {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(rel);
        let committed =
            std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        assert!(
            committed == generated,
            "{} is stale: run `make crds`",
            path.display()
        );
    }
}
