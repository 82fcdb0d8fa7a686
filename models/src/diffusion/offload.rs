//! Memory states, as ComfyUI-style servers keep them: the UNet stays on the device, while the
//! text encoders and the VAE decoder, each used once a batch, either stay there too
//! ([`MemoryState::Resident`]) or wait in host memory and move to the device for their step
//! ([`MemoryState::Offloaded`]), so that a device short of memory still runs the UNet's batches.

use std::collections::HashMap;
use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;
use serde::{Deserialize, Serialize};

/// Where the text encoders and the VAE decoder wait between the steps that use them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum MemoryState {
    /// On the device with the UNet, all the time.
    Resident,
    /// In host memory; each batch builds them on the device for its prompts' encoding and its
    /// decode, and frees them after.
    Offloaded,
}

/// How the state is chosen: `TERN_IMAGE_MEMORY` = `auto` (the default), `resident` or
/// `offloaded`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MemoryPolicy {
    /// Resident while the memory free holds a batch's working memory; offloaded when it does
    /// not (their bytes then make room), resident again once the memory free holds the batch and
    /// them. Resident wherever the memory free cannot be told (the CPU).
    Auto,
    /// Always this state.
    Fixed(MemoryState),
}

impl MemoryPolicy {
    /// `TERN_IMAGE_MEMORY`, [`MemoryPolicy::Auto`] when unset.
    pub fn from_env() -> Result<MemoryPolicy> {
        match std::env::var("TERN_IMAGE_MEMORY") {
            Err(_) => Ok(MemoryPolicy::Auto),
            Ok(v) => MemoryPolicy::parse(&v),
        }
    }

    pub fn parse(value: &str) -> Result<MemoryPolicy> {
        Ok(match value {
            "" | "auto" => MemoryPolicy::Auto,
            "resident" => MemoryPolicy::Fixed(MemoryState::Resident),
            "offloaded" => MemoryPolicy::Fixed(MemoryState::Offloaded),
            other => bail!("TERN_IMAGE_MEMORY must be auto, resident or offloaded, not {other:?}"),
        })
    }

    /// The state a batch runs in, from the state now, the memory free (`None` where it cannot
    /// be told), the batch's working memory and the bytes of the components that can wait in
    /// host memory.
    pub fn choose(self, now: MemoryState, free: Option<u64>, batch_bytes: u64, offloadable_bytes: u64) -> MemoryState {
        match (self, free) {
            (MemoryPolicy::Fixed(state), _) => state,
            (MemoryPolicy::Auto, None) => MemoryState::Resident,
            (MemoryPolicy::Auto, Some(free)) => match now {
                MemoryState::Resident if batch_bytes > free => MemoryState::Offloaded,
                // The memory free leaves their bytes out while they wait in host memory.
                MemoryState::Offloaded if free < batch_bytes.saturating_add(offloadable_bytes) => MemoryState::Offloaded,
                _ => MemoryState::Resident,
            },
        }
    }
}

/// A component that can wait in host memory: a text encoder or the VAE decoder.
pub(crate) struct Placed<T> {
    /// Its safetensors, and the prefixes of the tensors it reads (the VAE file's encoder is
    /// never loaded).
    files: Vec<PathBuf>,
    prefixes: &'static [&'static str],
    build: Box<dyn Fn(VarBuilder) -> Result<T> + Send>,
    dtype: DType,
    /// Bytes its weights take in `dtype`.
    pub bytes: u64,
    resident: Option<T>,
    /// Its weights in host memory, in `dtype`, while offloaded.
    host: Option<HashMap<String, Tensor>>,
}

impl<T> Placed<T> {
    /// Builds it on `device` from `files` (resident).
    pub fn load(files: Vec<PathBuf>, prefixes: &'static [&'static str], build: Box<dyn Fn(VarBuilder) -> Result<T> + Send>, dtype: DType, device: &Device) -> Result<Placed<T>> {
        let bytes = tensor_bytes(&files, prefixes, dtype)?;
        // Safety: the files are memory-mapped read-only; tern never writes model folders while a
        // worker runs them.
        let vb = unsafe { VarBuilder::from_mmaped_safetensors(&files, dtype, device)? };
        let resident = Some(build(vb)?);
        Ok(Placed { files, prefixes, build, dtype, bytes, resident, host: None })
    }

    /// Whether `name` is one of its tensors.
    fn reads(prefixes: &[&str], name: &str) -> bool {
        prefixes.is_empty() || prefixes.iter().any(|p| name.starts_with(p))
    }

    pub fn state(&self) -> MemoryState {
        if self.resident.is_some() {
            MemoryState::Resident
        } else {
            MemoryState::Offloaded
        }
    }

    /// Moves it to `state`: to host memory (read from its files, the device's copy freed), or
    /// built on `device` from host memory (the host copy freed).
    pub fn place(&mut self, state: MemoryState, device: &Device) -> Result<()> {
        match (state, self.state()) {
            (MemoryState::Offloaded, MemoryState::Resident) => {
                let mut host = HashMap::new();
                for file in &self.files {
                    let tensors = candle_core::safetensors::load(file, &Device::Cpu).with_context(|| format!("reading {}", file.display()))?;
                    for (name, tensor) in tensors {
                        if Self::reads(self.prefixes, &name) {
                            host.insert(name, tensor.to_dtype(self.dtype)?);
                        }
                    }
                }
                self.host = Some(host);
                self.resident = None;
            }
            (MemoryState::Resident, MemoryState::Offloaded) => {
                let host = self.host.take().context("offloaded without host weights")?;
                self.resident = Some((self.build)(VarBuilder::from_tensors(host, self.dtype, device))?);
            }
            _ => {}
        }
        Ok(())
    }

    /// Runs `f` on it: as it is when resident, else built on `device` for this call and freed
    /// after.
    pub fn with<R>(&self, device: &Device, f: impl FnOnce(&T) -> Result<R>) -> Result<R> {
        match (&self.resident, &self.host) {
            (Some(model), _) => f(model),
            (None, Some(host)) => {
                let model = (self.build)(VarBuilder::from_tensors(host.clone(), self.dtype, device))?;
                f(&model)
            }
            (None, None) => bail!("a component is neither on the device nor in host memory"),
        }
    }
}

/// Bytes the tensors of `files` under `prefixes` (all where none) take in `dtype`, from the
/// files' headers.
pub(crate) fn tensor_bytes(files: &[PathBuf], prefixes: &[&str], dtype: DType) -> Result<u64> {
    // Safety: as in `Placed::load`.
    let mapped = unsafe { candle_core::safetensors::MmapedSafetensors::multi(files)? };
    Ok(mapped
        .tensors()
        .iter()
        .filter(|(name, _)| Placed::<()>::reads(prefixes, name))
        .map(|(_, view)| (view.shape().iter().product::<usize>() * dtype.size_in_bytes()) as u64)
        .sum())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn auto_offloads_when_a_batch_would_not_fit_and_comes_back_when_both_fit() {
        use MemoryState::*;
        let auto = MemoryPolicy::Auto;
        assert_eq!(auto.choose(Resident, None, u64::MAX, 10), Resident, "the CPU cannot tell: resident");
        assert_eq!(auto.choose(Resident, Some(100), 100, 10), Resident);
        assert_eq!(auto.choose(Resident, Some(100), 101, 10), Offloaded);
        assert_eq!(auto.choose(Offloaded, Some(105), 100, 10), Offloaded, "not room for the batch and them");
        assert_eq!(auto.choose(Offloaded, Some(110), 100, 10), Resident);
        assert_eq!(MemoryPolicy::parse("offloaded").unwrap().choose(Resident, None, 0, 0), Offloaded);
        assert_eq!(MemoryPolicy::parse("resident").unwrap().choose(Offloaded, Some(0), 1, 1), Resident);
        assert!(MemoryPolicy::parse("low").is_err());
    }
}
