//! `make cluster`: runs the test control plane in the foreground for development, installs the
//! CRDs named on the command line, prints the kubeconfig path, and stops everything on Ctrl-C.

#![forbid(unsafe_code)]

use std::path::PathBuf;

use ferrite_testcluster::{install_crds, TestCluster};

#[tokio::main(flavor = "current_thread")]
async fn main() {
    if let Err(e) = run().await {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
}

async fn run() -> Result<(), Box<dyn std::error::Error>> {
    let crd_files: Vec<PathBuf> = std::env::args_os().skip(1).map(PathBuf::from).collect();
    eprintln!(
        "starting etcd, kube-apiserver, kube-controller-manager, kube-scheduler, kwok and \
         LeaderWorkerSet..."
    );
    let cluster = tokio::task::spawn_blocking(TestCluster::start).await??;
    let client = cluster.client().await?;
    for f in &crd_files {
        for name in install_crds(&client, f).await? {
            eprintln!("installed CRD {name}");
        }
    }
    let kc = cluster.kubeconfig_path().display();
    println!("API server: {}", cluster.server());
    println!("kubeconfig: {kc}");
    println!("try:        kubectl --kubeconfig {kc} get nodes,llms -A");
    println!("logs:       {}/*.log", cluster.data_dir().display());
    println!("Ctrl-C stops the cluster and deletes its data.");
    ferrite_util::shutdown_signal().await;
    eprintln!("stopping...");
    drop(cluster);
    Ok(())
}
