//! The plan's host memory checked against what the machine has, before anything is allocated: a plan too big
//! for the host must fail with an error that names the sizes, not abort inside the allocator.

use std::path::Path;

use draftpipe_compiler::cost::format_bytes;
use draftpipe_compiler::plan::{Device, Plan};

/// Bytes of host memory the plan needs: every part the compiler placed on the CPU (parameters, gradients,
/// optimizer state and workspaces of CPU drafters) and the hidden-state pool, which is on the host whatever the
/// drafters' devices.
pub(super) fn needed(plan: &Plan) -> u64 {
    plan.memory
        .iter()
        .filter(|memory| memory.device == Device::Cpu)
        .map(|memory| memory.total())
        .sum::<u64>()
        .saturating_add(plan.host_memory.total())
}

/// `MemAvailable` of `/proc/meminfo` in bytes: what the kernel can give without swapping. `None` where the file
/// or the field is missing (not Linux, or a kernel before 3.14); the check is then skipped.
fn available(meminfo: &Path) -> Option<u64> {
    let text = std::fs::read_to_string(meminfo).ok()?;
    parse_mem_available(&text)
}

fn parse_mem_available(meminfo: &str) -> Option<u64> {
    let line = meminfo
        .lines()
        .find_map(|line| line.strip_prefix("MemAvailable:"))?;
    let kib: u64 = line.trim().strip_suffix("kB")?.trim().parse().ok()?;
    kib.checked_mul(1024)
}

/// Why a plan cannot run in this machine's memory.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "the plan needs {} of host memory but {} is available; `draftpipe compile` shows the breakdown (shrink the model, the buckets' tokens or the queue capacity)",
    format_bytes(*.needed),
    format_bytes(*.available)
)]
pub struct HostMemoryError {
    /// Bytes the plan needs on the host.
    pub needed: u64,
    /// Bytes the machine reports available.
    pub available: u64,
}

/// Fails when the plan's host memory exceeds what `/proc/meminfo` reports available.
pub(super) fn check(plan: &Plan) -> Result<(), HostMemoryError> {
    check_against(needed(plan), available(Path::new("/proc/meminfo")))
}

fn check_against(needed: u64, available: Option<u64>) -> Result<(), HostMemoryError> {
    match available {
        Some(available) if needed > available => Err(HostMemoryError { needed, available }),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MEMINFO: &str = "MemTotal:       24588256 kB\nMemFree:         1204112 kB\nMemAvailable:   20112344 kB\nBuffers:          392012 kB\n";

    #[test]
    fn mem_available_is_read_in_bytes() {
        assert_eq!(parse_mem_available(MEMINFO), Some(20_112_344 * 1024));
        assert_eq!(parse_mem_available("MemTotal: 5 kB\n"), None);
        assert_eq!(parse_mem_available("MemAvailable: lots\n"), None);
    }

    #[test]
    fn a_plan_over_the_available_memory_is_refused_with_both_sizes() {
        let gib = 1 << 30;
        assert_eq!(check_against(4 * gib, Some(8 * gib)), Ok(()));
        assert_eq!(check_against(4 * gib, None), Ok(()));
        let error = check_against(913 * gib, Some(20 * gib)).unwrap_err();
        assert_eq!(
            error.to_string(),
            "the plan needs 913 GiB of host memory but 20.0 GiB is available; `draftpipe compile` shows the breakdown (shrink the model, the buckets' tokens or the queue capacity)"
        );
    }

    #[test]
    fn this_machine_reports_its_available_memory() {
        if cfg!(target_os = "linux") {
            let bytes = available(Path::new("/proc/meminfo")).expect("MemAvailable on Linux");
            assert!(bytes > 0);
        }
    }
}
