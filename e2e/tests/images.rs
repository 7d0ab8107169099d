//! What can be checked about the container images without a container engine: each
//! Dockerfile builds the workspace's own binary, copies it to where its ENTRYPOINT runs it,
//! and runs it as a numeric non-root user. (That the image's command and the arguments the
//! operator renders parse is tested beside the engine's flags.)

use std::path::Path;

fn read(rel: &str) -> String {
    std::fs::read_to_string(ferrite_e2e::workspace().join(rel))
        .unwrap_or_else(|e| panic!("{rel}: {e}"))
}

/// The JSON-array ENTRYPOINT of the final stage.
fn entrypoint(dockerfile: &str) -> Vec<String> {
    let line = dockerfile
        .lines()
        .rev()
        .find(|l| l.starts_with("ENTRYPOINT"))
        .expect("an ENTRYPOINT");
    serde_json::from_str(line.trim_start_matches("ENTRYPOINT").trim())
        .expect("exec-form ENTRYPOINT")
}

/// `[[bin]] name` of a crate's Cargo.toml.
fn bin_name(cargo_toml: &str) -> String {
    let after = cargo_toml
        .split("[[bin]]")
        .nth(1)
        .expect("a [[bin]] section");
    let line = after
        .lines()
        .find(|l| l.trim_start().starts_with("name"))
        .expect("bin name");
    line.split('"').nth(1).expect("quoted name").to_string()
}

/// Checks one Dockerfile against its crate; returns the binary name.
fn check_image(dockerfile_rel: &str, cargo_rel: &str, package: &str) -> String {
    let dockerfile = read(dockerfile_rel);
    let bin = bin_name(&read(cargo_rel));
    assert!(
        dockerfile.contains(&format!("-p {package} --bin {bin}")),
        "{dockerfile_rel} does not build {package}'s {bin}"
    );
    let entry = entrypoint(&dockerfile);
    let path = Path::new(&entry[0]);
    assert_eq!(
        path.file_name().and_then(|n| n.to_str()),
        Some(bin.as_str()),
        "{dockerfile_rel}: ENTRYPOINT {entry:?} does not run {bin}"
    );
    let copy = format!(" {}", path.display());
    assert!(
        dockerfile
            .lines()
            .any(|l| l.starts_with("COPY --from=build") && l.contains(&bin) && l.ends_with(&copy)),
        "{dockerfile_rel}: nothing copies {bin} to {}",
        path.display()
    );
    let user = dockerfile
        .lines()
        .rev()
        .find(|l| l.starts_with("USER "))
        .expect("a USER");
    let uid = user[5..].split(':').next().expect("uid");
    assert!(
        uid.parse::<u32>().is_ok_and(|u| u != 0),
        "{dockerfile_rel}: USER must be a numeric non-root uid (runAsNonRoot), got {user}"
    );
    bin
}

#[test]
fn engine_image_runs_this_binary() {
    let bin = check_image("engine/Dockerfile", "engine/Cargo.toml", "ferrite-engine");
    let built = ferrite_e2e::engine_bin();
    assert_eq!(
        built.file_name().and_then(|n| n.to_str()),
        Some(bin.as_str())
    );
    // No image pretends to use a GPU: the engine has no GPU backend to build.
    assert!(!read("engine/Dockerfile").contains("cuda"));
}

#[test]
fn operator_image_runs_the_operator_binary() {
    let bin = check_image(
        "operator/Dockerfile",
        "operator/Cargo.toml",
        "ferrite-operator",
    );
    assert_eq!(bin, "ferrite-operator");
    let dockerfile = read("operator/Dockerfile");
    assert!(
        dockerfile.contains("x86_64-unknown-linux-musl"),
        "static build"
    );
    assert!(
        dockerfile.contains("distroless/static"),
        "no libc needed at runtime"
    );
    // The chart runs the pod as the image's user.
    assert!(read("charts/ferrite/templates/deployment.yaml").contains("runAsUser: 65532"));
}

#[test]
fn router_image_runs_the_router_binary() {
    let bin = check_image("router/Dockerfile", "router/Cargo.toml", "ferrite-router");
    assert_eq!(bin, "ferrite-router");
    let dockerfile = read("router/Dockerfile");
    assert!(
        dockerfile.contains("x86_64-unknown-linux-musl")
            && dockerfile.contains("distroless/static")
    );
    assert!(dockerfile.contains("EXPOSE 8000"), "the OpenAI port");
}
