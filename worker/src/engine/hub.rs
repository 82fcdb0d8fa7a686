//! Models named `hf:OWNER/NAME[@REVISION]` come from the Hugging Face hub: the files a family
//! needs are downloaded once into `<models dir>/hf/OWNER--NAME--REVISION/`, then loaded like any
//! local folder. A thin path for machines with the internet: plain HTTPS GETs of
//! `{HF_ENDPOINT}/{repo}/resolve/{revision}/{file}` (HF_ENDPOINT defaults to
//! `https://huggingface.co`; HF_TOKEN, when set, is sent as a bearer token).
//!
//! GGUF repositories hold many files: name the one to load, `hf:OWNER/NAME/FILE.gguf`.

use super::cache::Family;
use anyhow::{bail, Context, Result};
use std::path::{Path, PathBuf};

/// The prefix that marks a hub model id in a model name.
pub const PREFIX: &str = "hf:";

/// A parsed `hf:` model name.
#[derive(Debug, PartialEq, Eq)]
struct HubModel<'a> {
    repo: &'a str,
    revision: &'a str,
    /// The GGUF file, for repositories that hold several.
    file: Option<&'a str>,
}

fn parse(name: &str) -> Result<HubModel<'_>> {
    let id = name.strip_prefix(PREFIX).context("not a hub model name")?;
    let (id, revision) = id.split_once('@').unwrap_or((id, "main"));
    let parts: Vec<&str> = id.split('/').collect();
    let (repo, file) = match parts.as_slice() {
        [owner, _] if !owner.is_empty() => (id, None),
        [owner, repo, file] if !owner.is_empty() && !repo.is_empty() => (&id[..owner.len() + 1 + repo.len()], Some(*file)),
        _ => bail!("hub model names look like hf:OWNER/NAME[@REVISION] or hf:OWNER/NAME/FILE.gguf, not {name:?}"),
    };
    if [repo, revision].iter().chain(file.iter()).any(|s| s.contains("..") || s.is_empty()) {
        bail!("bad hub model name {name:?}");
    }
    Ok(HubModel { repo, revision, file })
}

/// The local folder holding the hub model `name`, downloading what is missing.
pub fn fetch(models_dir: &Path, name: &str, family: Family, runtime: &tokio::runtime::Handle) -> Result<PathBuf> {
    let model = parse(name)?;
    let endpoint = std::env::var("HF_ENDPOINT").unwrap_or_else(|_| "https://huggingface.co".into());
    let folder = format!("{}--{}", model.repo.replace('/', "--"), model.revision);
    let dir = models_dir.join("hf").join(folder);
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let http = reqwest::Client::new();
    let files = family.plugin().hub_files(model.repo, model.file)?;
    let other = family.plugin().hub_other_files(model.repo);
    // The repository's other layout where the first file of the usual one is not there.
    let layout = match files.first() {
        Some((first, _)) if !other.is_empty() && !dir.join(first).is_file() => {
            let url = format!("{}/{}/resolve/{}/{first}", endpoint.trim_end_matches('/'), model.repo, model.revision);
            match runtime.block_on(http.head(&url).send()) {
                Ok(r) if r.status() == reqwest::StatusCode::NOT_FOUND => other,
                _ => files,
            }
        }
        _ => files,
    };
    for (remote, local) in layout {
        let target = dir.join(local);
        if target.is_file() {
            continue;
        }
        // Diffusers repositories keep each component in a folder of its own.
        if let Some(parent) = target.parent() {
            std::fs::create_dir_all(parent).with_context(|| format!("creating {}", parent.display()))?;
        }
        let url = format!("{}/{}/resolve/{}/{remote}", endpoint.trim_end_matches('/'), model.repo, model.revision);
        tracing::info!(%url, "downloading from the hub");
        runtime
            .block_on(download(&http, &url, &target))
            .with_context(|| format!("downloading {url}"))?;
    }
    Ok(dir)
}

/// Streams `url` into `target` through a temporary file, so a partial download is never taken
/// for a complete one.
async fn download(http: &reqwest::Client, url: &str, target: &Path) -> Result<()> {
    use tokio::io::AsyncWriteExt;
    let mut request = http.get(url);
    if let Ok(token) = std::env::var("HF_TOKEN") {
        request = request.bearer_auth(token);
    }
    let mut response = request.send().await?.error_for_status()?;
    let partial = target.with_extension("partial");
    let mut file = tokio::fs::File::create(&partial).await?;
    while let Some(chunk) = response.chunk().await? {
        file.write_all(&chunk).await?;
    }
    file.sync_all().await?;
    tokio::fs::rename(&partial, target).await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::{parse, HubModel};

    #[test]
    fn names_parse() {
        assert_eq!(
            parse("hf:Systran/faster-whisper-tiny.en").unwrap(),
            HubModel { repo: "Systran/faster-whisper-tiny.en", revision: "main", file: None }
        );
        assert_eq!(
            parse("hf:bartowski/SmolLM2-135M-Instruct-GGUF/SmolLM2-135M-Instruct-Q4_1.gguf@v2").unwrap(),
            HubModel { repo: "bartowski/SmolLM2-135M-Instruct-GGUF", revision: "v2", file: Some("SmolLM2-135M-Instruct-Q4_1.gguf") }
        );
        for bad in ["hf:", "hf:justone", "hf:/x", "hf:a/b/c/d", "hf:a/../b"] {
            assert!(parse(bad).is_err(), "{bad}");
        }
    }
}
