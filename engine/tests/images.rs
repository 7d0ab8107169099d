//! What can be checked about the container images without a container engine: each
//! Dockerfile builds the workspace's own binary, copies it to where its ENTRYPOINT runs it,
//! runs it as a numeric non-root user, and the arguments the operator gives engine pods (the
//! render snapshots) are ones this binary accepts.

mod common;

use std::path::Path;

use clap::Parser;
use ferrite_engine::cli::Cli;

fn read(rel: &str) -> String {
    std::fs::read_to_string(common::workspace().join(rel)).unwrap_or_else(|e| panic!("{rel}: {e}"))
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
    let built = Path::new(env!("CARGO_BIN_EXE_ferrite-engine"));
    assert_eq!(
        built.file_name().and_then(|n| n.to_str()),
        Some(bin.as_str())
    );
    // The CUDA variant builds the feature this crate has.
    let dockerfile = read("engine/Dockerfile");
    assert!(dockerfile.contains("--features cuda"));
    assert!(read("engine/Cargo.toml").contains("\ncuda = ["));
    // The image's default command is a valid invocation.
    let cmd_line = dockerfile
        .lines()
        .rev()
        .find(|l| l.starts_with("CMD"))
        .expect("CMD");
    let cmd: Vec<String> = serde_json::from_str(cmd_line[3..].trim()).expect("exec-form CMD");
    let parsed = Cli::try_parse_from(std::iter::once(bin.clone()).chain(cmd));
    // `--help` ends parsing with a help "error"; anything else is a wrong flag.
    if let Err(e) = parsed {
        assert_eq!(e.kind(), clap::error::ErrorKind::DisplayHelp, "{e}");
    }
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
fn every_engine_invocation_the_operator_renders_parses() {
    let dir = common::workspace().join("operator/tests/snapshots");
    let mut checked = 0;
    for entry in std::fs::read_dir(&dir).expect("snapshots") {
        let path = entry.expect("entry").path();
        let text = std::fs::read_to_string(&path).expect("snapshot");
        for doc in serde_yaml::Deserializer::from_str(&text) {
            let v: serde_json::Value = serde::Deserialize::deserialize(doc).expect("yaml");
            if v["kind"] != "Deployment" {
                continue;
            }
            let pod = &v["spec"]["template"]["spec"];
            let containers = pod["containers"].as_array().into_iter().flatten();
            let init = pod["initContainers"].as_array().into_iter().flatten();
            for c in containers.chain(init) {
                let args: Vec<String> = c["args"]
                    .as_array()
                    .expect("args")
                    .iter()
                    .map(|a| a.as_str().expect("string").to_string())
                    .collect();
                Cli::try_parse_from(
                    std::iter::once("ferrite-engine".to_string()).chain(args.clone()),
                )
                .unwrap_or_else(|e| panic!("{}: {args:?} rejected: {e}", path.display()));
                assert!(
                    c.get("command").is_none(),
                    "the image's ENTRYPOINT must run"
                );
                checked += 1;
            }
        }
    }
    assert!(checked >= 9, "only {checked} invocations found");
}
