//! `ferrite-engine download`: fetch a model from the Hugging Face hub (or a server that
//! speaks its API) into a folder, resuming what an earlier run left.

use ferrite_engine::download::{download, DownloadRequest};
use ferrite_engine::Result;

use crate::cli::DownloadArgs;

/// Downloads and prints each file's path.
pub fn run(args: DownloadArgs) -> Result<()> {
    let (repo, revision) = DownloadRequest::parse_source(&args.source)?;
    let token = std::env::var("HF_TOKEN")
        .ok()
        .filter(|t| !t.trim().is_empty());
    let req = DownloadRequest {
        repo,
        revision,
        file: args.file,
        to: args.to,
        endpoint: args.endpoint,
        token,
    };
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let files = runtime.block_on(download(&req))?;
    for f in files {
        println!("{}", f.display());
    }
    Ok(())
}
