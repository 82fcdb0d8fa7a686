//! Where a Hugging Face-style folder keeps a component's weights: `STEM.safetensors`, else the
//! fp16 variant `STEM.fp16.safetensors`, else the shards an `STEM.safetensors.index.json` (or
//! its fp16 variant) names. Diffusers' components and Whisper's Hugging Face folders alike.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};

/// The safetensors files of the component `stem` in `dir` (shards sorted, each once).
pub(crate) fn safetensors_files(dir: &Path, stem: &str) -> Result<Vec<PathBuf>> {
    for name in [format!("{stem}.safetensors"), format!("{stem}.fp16.safetensors")] {
        if dir.join(&name).is_file() {
            return Ok(vec![dir.join(name)]);
        }
    }
    for index in [format!("{stem}.safetensors.index.json"), format!("{stem}.safetensors.index.fp16.json")] {
        let path = dir.join(&index);
        if path.is_file() {
            let text = std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
            let index: serde_json::Value = serde_json::from_str(&text).with_context(|| format!("parsing {}", path.display()))?;
            let mut files: Vec<PathBuf> = index
                .get("weight_map")
                .and_then(serde_json::Value::as_object)
                .context("weight_map missing")?
                .values()
                .filter_map(serde_json::Value::as_str)
                .map(|f| dir.join(f))
                .collect();
            files.sort();
            files.dedup();
            return Ok(files);
        }
    }
    bail!("{}: no {stem}.safetensors (or .fp16.safetensors, or an index of shards)", dir.display())
}
