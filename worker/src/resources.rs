//! The worker's compute device and memory budget: parsed from config, or derived from the RAM
//! available.

/// Headroom left to the rest of the process and the machine when the budget is derived.
const HEADROOM: u64 = 1 << 30;
/// Smallest derived budget.
const MIN_BUDGET: u64 = 256 << 20;

/// Parses `2GiB`, `800MB`, `512M`, `1.5G` or a plain number of bytes. Decimal units (KB, MB,
/// GB) are powers of 1000; binary ones (KiB, MiB, GiB, or K, M, G alone) powers of 1024.
pub fn parse_bytes(s: &str) -> Result<u64, String> {
    let s = s.trim();
    let split = s.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(s.len());
    let (number, unit) = s.split_at(split);
    let number: f64 = number.parse().map_err(|_| format!("{s:?} is not a size like 2GiB or 800MB"))?;
    let factor: u64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "kb" => 1_000,
        "mb" => 1_000_000,
        "gb" => 1_000_000_000,
        "k" | "kib" => 1 << 10,
        "m" | "mib" => 1 << 20,
        "g" | "gib" => 1 << 30,
        other => return Err(format!("unknown size unit {other:?}; use B, KB, MB, GB, KiB, MiB or GiB")),
    };
    Ok((number * factor as f64) as u64)
}

/// The memory budget when none is configured: on a CUDA device its free memory minus
/// [`HEADROOM`]; otherwise (CPU, Metal's unified memory) MemAvailable minus [`HEADROOM`]. At
/// least [`MIN_BUDGET`]; 4 GiB where neither can be read.
pub fn default_budget(device: &candle_core::Device) -> u64 {
    match device_free_bytes(device) {
        Some(free) => free.saturating_sub(HEADROOM).max(MIN_BUDGET),
        None => ram_budget(),
    }
}

/// Free memory of a CUDA device from its driver; `None` for other devices.
pub fn device_free_bytes(device: &candle_core::Device) -> Option<u64> {
    #[cfg(feature = "cuda")]
    if let candle_core::Device::Cuda(cuda) = device {
        return cuda.cuda_stream().context().mem_get_info().ok().map(|(free, _total)| free as u64);
    }
    let _ = device;
    None
}

/// MemAvailable minus [`HEADROOM`], at least [`MIN_BUDGET`]; 4 GiB where /proc/meminfo is missing.
fn ram_budget() -> u64 {
    let available = std::fs::read_to_string("/proc/meminfo").ok().and_then(|m| {
        let line = m.lines().find(|l| l.starts_with("MemAvailable:"))?;
        line.split_whitespace().nth(1)?.parse::<u64>().ok().map(|kb| kb * 1024)
    });
    match available {
        Some(bytes) => bytes.saturating_sub(HEADROOM).max(MIN_BUDGET),
        None => 4 << 30,
    }
}

/// Parses `cpu`, `cuda`, `cuda:N`, `metal` or `metal:N` into a candle device. A GPU device
/// needs the worker built with the matching cargo feature (`cuda`, `metal`); otherwise this
/// fails with candle's "not compiled with ... support".
pub fn parse_device(s: &str) -> Result<candle_core::Device, String> {
    let (kind, ordinal) = match s.trim().split_once(':') {
        Some((k, n)) => (k, n.parse::<usize>().map_err(|_| format!("bad device ordinal in {s:?}"))?),
        None => (s.trim(), 0),
    };
    match kind {
        "cpu" => Ok(candle_core::Device::Cpu),
        "cuda" => candle_core::Device::new_cuda(ordinal).map_err(|e| format!("CUDA device {ordinal}: {e}")),
        "metal" => candle_core::Device::new_metal(ordinal).map_err(|e| format!("Metal device {ordinal}: {e}")),
        other => Err(format!("unknown device {other:?}; use cpu, cuda[:N] or metal[:N]")),
    }
}

/// A `/proc/self/status` field in bytes (Linux): `VmRSS:` (resident now), `VmHWM:` (peak).
pub fn process_status_bytes(field: &str) -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with(field))?;
    Some(line.split_whitespace().nth(1)?.parse::<u64>().ok()? * 1024)
}

#[cfg(test)]
mod tests {
    use super::parse_bytes;

    #[test]
    fn sizes_parse() {
        assert_eq!(parse_bytes("1024").unwrap(), 1024);
        assert_eq!(parse_bytes("2GiB").unwrap(), 2 << 30);
        assert_eq!(parse_bytes("800MB").unwrap(), 800_000_000);
        assert_eq!(parse_bytes("1.5G").unwrap(), 3 << 29);
        assert!(parse_bytes("lots").is_err());
        assert!(parse_bytes("3 parsecs").is_err());
    }

    #[test]
    fn devices_parse() {
        assert!(super::parse_device("cpu").unwrap().is_cpu());
        assert!(super::parse_device("tpu").is_err());
        assert!(super::parse_device("cuda:x").is_err());
    }
}
