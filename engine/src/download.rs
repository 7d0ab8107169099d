//! `ferrite-engine download hf://org/repo[@revision] --to DIR [--file F]`: fetches a model from
//! the Hugging Face hub (or any server speaking its HTTP API, via `HF_ENDPOINT`), the way the
//! operator's init container does before the engine starts.
//!
//! - The file list, sizes and LFS sha256 come from `GET /api/models/{repo}/revision/{rev}`.
//! - Each file comes from `GET /{repo}/resolve/{rev}/{file}` (redirects followed; the token is
//!   sent only to the hub, never to the redirect target on another host).
//! - A file is written to `.{file}.incomplete` and renamed once its size and hash are right; an
//!   interrupted download resumes with a `Range` request (restarting when the server ignores it
//!   or the partial file turns out corrupt); a file already complete is not fetched again.

use std::io::Write;
use std::path::{Path, PathBuf};

use futures::StreamExt;
use serde::Deserialize;
use sha2::{Digest, Sha256};

use crate::{Error, Result};

/// The default hub.
pub const DEFAULT_ENDPOINT: &str = "https://huggingface.co";

/// What to download.
#[derive(Debug, Clone)]
pub struct DownloadRequest {
    /// `org/repo`.
    pub repo: String,
    /// Branch, tag or commit.
    pub revision: String,
    /// Only this file (e.g. one GGUF of several); otherwise every file the engine loads.
    pub file: Option<String>,
    /// Destination folder.
    pub to: PathBuf,
    /// The hub's base URL (`HF_ENDPOINT`).
    pub endpoint: String,
    /// Bearer token (`HF_TOKEN`); never printed.
    pub token: Option<String>,
}

impl DownloadRequest {
    /// Parses `hf://org/repo[@revision]`.
    pub fn parse_source(source: &str) -> Result<(String, String)> {
        let bad = |why: &str| {
            Error::Download(format!(
                "model source `{source}`: {why}; expected hf://org/repo or hf://org/repo@revision"
            ))
        };
        let rest = source
            .strip_prefix("hf://")
            .ok_or_else(|| bad("not an hf:// source"))?;
        let (repo, revision) = match rest.split_once('@') {
            Some((r, rev)) if !rev.is_empty() => (r, rev),
            Some(_) => return Err(bad("empty revision after @")),
            None => (rest, "main"),
        };
        let mut parts = repo.split('/');
        match (parts.next(), parts.next(), parts.next()) {
            (Some(o), Some(n), None) if !o.is_empty() && !n.is_empty() => {
                Ok((repo.to_string(), revision.to_string()))
            }
            _ => Err(bad("the repository must be org/repo")),
        }
    }
}

#[derive(Debug, Deserialize)]
struct RepoInfo {
    #[serde(default)]
    sha: Option<String>,
    #[serde(default)]
    siblings: Vec<Sibling>,
}

#[derive(Debug, Deserialize, Clone)]
struct Sibling {
    rfilename: String,
    #[serde(default)]
    size: Option<u64>,
    #[serde(default)]
    lfs: Option<Lfs>,
}

#[derive(Debug, Deserialize, Clone)]
struct Lfs {
    sha256: String,
    size: u64,
}

/// Files the engine needs from a repository holding several.
fn wanted(name: &str) -> bool {
    let base = name.rsplit('/').next().unwrap_or(name);
    matches!(
        base,
        "config.json"
            | "tokenizer.json"
            | "tokenizer_config.json"
            | "generation_config.json"
            | "special_tokens_map.json"
            | "model.safetensors.index.json"
    ) || base.ends_with(".safetensors")
}

fn pick_files(info: &RepoInfo, file: Option<&str>, repo: &str) -> Result<Vec<Sibling>> {
    if let Some(f) = file {
        return info
            .siblings
            .iter()
            .find(|s| s.rfilename == f)
            .cloned()
            .map(|s| vec![s])
            .ok_or_else(|| {
                Error::Download(format!("hf://{repo} has no file `{f}` at this revision"))
            });
    }
    let files: Vec<Sibling> = info
        .siblings
        .iter()
        .filter(|s| wanted(&s.rfilename))
        .cloned()
        .collect();
    if files.iter().any(|s| s.rfilename.ends_with(".safetensors")) {
        return Ok(files);
    }
    let ggufs: Vec<&Sibling> = info
        .siblings
        .iter()
        .filter(|s| s.rfilename.ends_with(".gguf"))
        .collect();
    match ggufs.as_slice() {
        [one] => Ok(vec![(*one).clone()]),
        [] => Err(Error::Download(format!(
            "hf://{repo} holds neither *.safetensors nor *.gguf weights"
        ))),
        many => Err(Error::Download(format!(
            "hf://{repo} holds {} GGUF files; choose one with --file (spec.model.file): {}",
            many.len(),
            many.iter()
                .map(|s| s.rfilename.as_str())
                .collect::<Vec<_>>()
                .join(", ")
        ))),
    }
}

fn http_error(what: &str, status: reqwest::StatusCode, has_token: bool) -> Error {
    let hint = match status.as_u16() {
        401 | 403 if has_token => "; the token does not grant access to this repository",
        401 | 403 => {
            "; the repository is gated or private: set HF_TOKEN (spec.model.tokenHubSecret)"
        }
        404 => "; check the repository, revision and file names",
        _ => "",
    };
    Error::Download(format!("{what}: the hub answered {status}{hint}"))
}

fn sha256_file(path: &Path) -> Result<String> {
    let mut f = std::fs::File::open(path)?;
    let mut h = Sha256::new();
    std::io::copy(&mut f, &mut h)?;
    Ok(format!("{:x}", h.finalize()))
}

/// Whether `path` already holds the complete file.
fn complete(path: &Path, s: &Sibling) -> Result<bool> {
    let Ok(meta) = std::fs::metadata(path) else {
        return Ok(false);
    };
    let size = s.lfs.as_ref().map(|l| l.size).or(s.size);
    if size.is_some_and(|n| n != meta.len()) {
        return Ok(false);
    }
    match &s.lfs {
        Some(l) => Ok(sha256_file(path)? == l.sha256),
        None => Ok(size.is_some()),
    }
}

/// Downloads the repository's files; returns the paths written (or already complete).
pub async fn download(req: &DownloadRequest) -> Result<Vec<PathBuf>> {
    let client = reqwest::Client::builder()
        .user_agent(concat!("ferrite-engine/", env!("CARGO_PKG_VERSION")))
        .build()
        .map_err(|e| Error::Download(format!("HTTP client: {e}")))?;
    let endpoint = req.endpoint.trim_end_matches('/');
    let auth = |r: reqwest::RequestBuilder| match &req.token {
        Some(t) => r.bearer_auth(t),
        None => r,
    };
    let what = format!("hf://{}@{}", req.repo, req.revision);
    let info_url = format!(
        "{endpoint}/api/models/{}/revision/{}?blobs=true",
        req.repo, req.revision
    );
    let resp = auth(client.get(&info_url))
        .send()
        .await
        .map_err(|e| Error::Download(format!("{what}: cannot reach {endpoint}: {e}")))?;
    if !resp.status().is_success() {
        return Err(http_error(&what, resp.status(), req.token.is_some()));
    }
    let info: RepoInfo = resp
        .json()
        .await
        .map_err(|e| Error::Download(format!("{what}: unexpected answer from the hub: {e}")))?;
    // Pin the commit so every file comes from the same one, even if the branch moves.
    let commit = info.sha.clone().unwrap_or_else(|| req.revision.clone());
    let files = pick_files(&info, req.file.as_deref(), &req.repo)?;
    std::fs::create_dir_all(&req.to)?;

    let mut written = Vec::new();
    for s in files {
        let dest = req.to.join(&s.rfilename);
        if complete(&dest, &s)? {
            tracing::info!(file = %s.rfilename, "already complete");
            written.push(dest);
            continue;
        }
        let parent = dest.parent().unwrap_or(&req.to).to_path_buf();
        std::fs::create_dir_all(&parent)?;
        let base = dest
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        let partial = parent.join(format!(".{base}.incomplete"));
        let url = format!("{endpoint}/{}/resolve/{commit}/{}", req.repo, s.rfilename);
        for attempt in 0..2 {
            fetch(
                &client,
                &url,
                &partial,
                req.token.as_deref(),
                &what,
                &s.rfilename,
            )
            .await?;
            let expected = s.lfs.as_ref().map(|l| l.size).or(s.size);
            let len = std::fs::metadata(&partial)?.len();
            let size_ok = expected.is_none_or(|n| n == len);
            let hash_ok = match &s.lfs {
                Some(l) if size_ok => sha256_file(&partial)? == l.sha256,
                _ => size_ok,
            };
            if hash_ok {
                std::fs::rename(&partial, &dest)?;
                break;
            }
            // A corrupt partial file: start over once, then give up.
            std::fs::remove_file(&partial)?;
            if attempt == 1 {
                return Err(Error::Download(format!(
                    "{what}: {} does not match its published size or sha256 after two attempts",
                    s.rfilename
                )));
            }
        }
        tracing::info!(file = %s.rfilename, "downloaded");
        written.push(dest);
    }
    Ok(written)
}

/// Appends the rest of `url` to `partial`, resuming from its current length.
async fn fetch(
    client: &reqwest::Client,
    url: &str,
    partial: &Path,
    token: Option<&str>,
    what: &str,
    file: &str,
) -> Result<()> {
    let have = std::fs::metadata(partial).map(|m| m.len()).unwrap_or(0);
    let mut r = client.get(url);
    if let Some(t) = token {
        r = r.bearer_auth(t);
    }
    if have > 0 {
        r = r.header(reqwest::header::RANGE, format!("bytes={have}-"));
    }
    let resp = r
        .send()
        .await
        .map_err(|e| Error::Download(format!("{what}: {file}: {e}; run again to resume")))?;
    let status = resp.status();
    let mut out = if status == reqwest::StatusCode::PARTIAL_CONTENT && have > 0 {
        std::fs::OpenOptions::new().append(true).open(partial)?
    } else if status.is_success() {
        // The server sent the whole file: start from zero.
        std::fs::File::create(partial)?
    } else if status == reqwest::StatusCode::RANGE_NOT_SATISFIABLE {
        // The partial file is as long as (or longer than) the file: let the checks decide.
        return Ok(());
    } else {
        return Err(http_error(
            &format!("{what}: {file}"),
            status,
            token.is_some(),
        ));
    };
    let mut body = resp.bytes_stream();
    while let Some(chunk) = body.next().await {
        let chunk = chunk.map_err(|e| {
            Error::Download(format!(
                "{what}: {file}: the download broke off ({e}); run again to resume"
            ))
        })?;
        out.write_all(&chunk)?;
    }
    out.flush()?;
    Ok(())
}
