//! Where the engine reads how much memory its batches take and may still take: the CUDA
//! driver's free memory on a GPU, the process's peak resident set on the CPU, or figures a test
//! sets. Batch budgets follow from it ([`BatchMemory`]), and so does the split of a batch that
//! ran out of memory.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// Memory the engine leaves free on a device for the driver, cuBLAS workspaces and the
/// allocator's rounding.
pub const DEVICE_HEADROOM: u64 = 1 << 30;

/// How often the device probe samples free memory while a probe batch runs.
const SAMPLE_EVERY: Duration = Duration::from_millis(1);

/// Reads memory for the engine. Cheap to clone.
#[derive(Clone)]
pub enum MemoryProbe {
    /// The CUDA driver's free memory on the worker's device (`cuMemGetInfo`). A probe batch's
    /// working memory is the fall of free memory to its lowest while the batch runs, sampled
    /// every millisecond from a thread of its own. With `precheck`, a batch is checked against
    /// the free memory before it runs ([`reserve`]); without, the allocator alone refuses a
    /// batch that does not fit, and that error splits it the same way.
    Device { device: candle_core::Device, precheck: bool },
    /// The process's peak resident set (Linux `/proc/self/status`) measures a probe batch; no
    /// figure for memory free now, since freed memory is kept by the allocator for reuse
    /// (`tern_models::allocator`) and the memory budget already bounds the batches.
    Host,
    /// Figures set by a test: the bytes free now and the bytes a probe batch takes per cost
    /// unit. How the engine's out-of-memory split is exercised without a GPU.
    #[cfg(test)]
    Fixed(Arc<FixedMemory>),
}

/// The figures of [`MemoryProbe::Fixed`].
#[cfg(test)]
#[derive(Debug)]
pub struct FixedMemory {
    pub free_bytes: AtomicU64,
    pub bytes_per_unit: u64,
}

impl MemoryProbe {
    /// The probe for `device`: [`MemoryProbe::Device`] on CUDA (batches checked against the
    /// free memory before they run where `precheck`), [`MemoryProbe::Host`] elsewhere.
    pub fn for_device(device: &candle_core::Device, precheck: bool) -> MemoryProbe {
        if device.is_cuda() {
            MemoryProbe::Device { device: device.clone(), precheck }
        } else {
            MemoryProbe::Host
        }
    }

    /// A probe with fixed figures (tests).
    #[cfg(test)]
    pub fn fixed(free_bytes: u64, bytes_per_unit: u64) -> (MemoryProbe, Arc<FixedMemory>) {
        let figures = Arc::new(FixedMemory { free_bytes: AtomicU64::new(free_bytes), bytes_per_unit });
        (MemoryProbe::Fixed(figures.clone()), figures)
    }

    /// Whether it reads a GPU's memory: batches are then sized by it, up to the device's
    /// ceilings, rather than by the CPU's.
    pub fn is_device(&self) -> bool {
        matches!(self, MemoryProbe::Device { .. })
    }

    /// What it reads: `cuda`, `host` or `fixed`.
    pub fn name(&self) -> &'static str {
        match self {
            MemoryProbe::Device { .. } => "cuda",
            MemoryProbe::Host => "host",
            #[cfg(test)]
            MemoryProbe::Fixed(_) => "fixed",
        }
    }

    /// Bytes batches may still take now, headroom left out; `None` where the probe cannot
    /// tell (the CPU: the memory budget alone bounds batches there).
    pub fn free_bytes(&self) -> Option<u64> {
        match self {
            MemoryProbe::Device { device, .. } => {
                crate::resources::device_free_bytes(device).map(|free| free.saturating_sub(DEVICE_HEADROOM))
            }
            MemoryProbe::Host => None,
            #[cfg(test)]
            MemoryProbe::Fixed(f) => Some(f.free_bytes.load(Ordering::Relaxed)),
        }
    }

    /// Runs `batch` (which returns its cost in units: windows, tokens) and returns the peak
    /// working memory it took per unit, at least 1 byte.
    pub fn measure(&self, batch: &mut dyn FnMut() -> anyhow::Result<u64>) -> anyhow::Result<u64> {
        let (units, bytes) = match self {
            MemoryProbe::Device { device, .. } => {
                let before = crate::resources::device_free_bytes(device);
                let (lowest, running) = (Arc::new(AtomicU64::new(before.unwrap_or(u64::MAX))), Arc::new(AtomicBool::new(true)));
                let sampler = {
                    let (device, lowest, running) = (device.clone(), lowest.clone(), running.clone());
                    std::thread::spawn(move || {
                        while running.load(Ordering::Relaxed) {
                            if let Some(free) = crate::resources::device_free_bytes(&device) {
                                lowest.fetch_min(free, Ordering::Relaxed);
                            }
                            std::thread::sleep(SAMPLE_EVERY);
                        }
                    })
                };
                let units = batch();
                // Kernels run asynchronously: the batch's memory is held until the device is done.
                let _ = device.synchronize();
                running.store(false, Ordering::Relaxed);
                let _ = sampler.join();
                let taken = before.map(|b| b.saturating_sub(lowest.load(Ordering::Relaxed))).unwrap_or(0);
                (units?, taken)
            }
            MemoryProbe::Host => {
                let baseline = peak_rss::reset();
                let units = batch()?;
                let grown = match (baseline, peak_rss::peak()) {
                    (Some(before), Some(peak)) => peak.saturating_sub(before),
                    _ => 0,
                };
                // A floor keeps a budget from growing without bound when the allocator reused
                // memory from an earlier load.
                (units, grown.max(64 * 1024))
            }
            #[cfg(test)]
            MemoryProbe::Fixed(f) => {
                let units = batch()?;
                (units, units * f.bytes_per_unit)
            }
        };
        Ok((bytes / units.max(1)).max(1))
    }
}

/// A batch that did not fit the memory the probe reports free.
#[derive(Debug, thiserror::Error)]
#[error("out of memory: the batch needs {needed} bytes, {free} are free")]
pub struct OutOfMemory {
    pub needed: u64,
    pub free: u64,
}

/// Checks a batch of `units` at `bytes_per_unit` against what `probe` reports free, as the
/// device's allocator would refuse it; passes every batch where the probe leaves that to the
/// allocator. `freed`: bytes the caller released since it last read the probe; a device probe
/// sees them itself once the device has finished with them, a test's figures do not.
pub fn reserve(probe: &MemoryProbe, units: usize, bytes_per_unit: u64, freed: u64) -> Result<(), OutOfMemory> {
    let extra = match probe {
        MemoryProbe::Device { precheck: false, .. } => return Ok(()),
        MemoryProbe::Device { device, .. } => {
            if freed > 0 {
                let _ = device.synchronize();
            }
            0
        }
        MemoryProbe::Host => 0,
        #[cfg(test)]
        MemoryProbe::Fixed(_) => freed,
    };
    let needed = units as u64 * bytes_per_unit;
    match probe.free_bytes().map(|free| free.saturating_add(extra)) {
        Some(free) if needed > free => Err(OutOfMemory { needed, free }),
        _ => Ok(()),
    }
}

/// Peak resident set of this process, from `/proc/self/status` (Linux).
mod peak_rss {
    use crate::resources::process_status_bytes;

    /// Resets the peak to the current resident set (writes 5 to clear_refs) and returns it.
    pub fn reset() -> Option<u64> {
        std::fs::write("/proc/self/clear_refs", "5").ok()?;
        process_status_bytes("VmRSS:")
    }

    pub fn peak() -> Option<u64> {
        process_status_bytes("VmHWM:")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn out_of_memory_is_told_from_other_errors() {
        let cuda = anyhow::anyhow!("DriverError(CUDA_ERROR_OUT_OF_MEMORY, \"out of memory\")").context("encoder");
        assert!(tern_models::family::is_out_of_memory(&cuda));
        assert!(tern_models::family::is_out_of_memory(&anyhow::anyhow!("CublasError(CUBLAS_STATUS_ALLOC_FAILED)")));
        assert!(tern_models::family::is_out_of_memory(&anyhow::Error::new(OutOfMemory { needed: 2, free: 1 }).context("batch")));
        assert!(!tern_models::family::is_out_of_memory(&anyhow::anyhow!("unknown language code \"xx\"")));
    }

    #[test]
    fn a_fixed_probe_refuses_what_does_not_fit() {
        let (probe, figures) = MemoryProbe::fixed(1000, 100);
        assert!(reserve(&probe, 10, 100, 0).is_ok());
        assert!(reserve(&probe, 11, 100, 0).is_err());
        assert!(reserve(&probe, 11, 100, 100).is_ok(), "what the caller freed counts");
        figures.free_bytes.store(50, Ordering::Relaxed);
        assert!(reserve(&probe, 1, 100, 0).is_err());
        assert_eq!(probe.measure(&mut || Ok(4)).unwrap(), 100);
        // The host probe never refuses: the memory budget bounds CPU batches.
        assert!(reserve(&MemoryProbe::Host, 1 << 20, 1 << 30, 0).is_ok());
    }
}
