//! The committed CRD YAML is what the types generate (`make crds` regenerates it).

#[test]
fn committed_crd_matches_the_types() {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/llmservice.yaml");
    let committed = std::fs::read_to_string(path).expect("crds/llmservice.yaml exists");
    let generated = ferrite_crds::crd_yaml().expect("renders");
    assert!(
        committed == generated,
        "crds/llmservice.yaml is stale: run `make crds`"
    );
}
