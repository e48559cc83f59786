//! The plan's host memory checked against what the machine has, before anything is allocated: a plan too big
//! for the host must fail with an error that names the sizes, not abort inside the allocator.
//!
//! What the process can have is the least of three: the machine's `MemAvailable`, what its address-space limit
//! (`ulimit -v`, RLIMIT_AS) leaves above the address space already mapped, and what the memory limit of its
//! cgroup and every cgroup above it (`memory.max`, as Slurm and Kubernetes set it) leaves above their use.
//! A limit that cannot be read (not Linux, cgroup v1, no such file) is left out of the minimum.

use std::path::{Path, PathBuf};

use draftpipe_compiler::cost::format_bytes;
use draftpipe_compiler::plan::{Device, Plan};

/// Bytes of host memory the plan needs: every part the compiler placed on the CPU (parameters, gradients,
/// optimizer state and workspaces of CPU drafters) and the plan's host memory outside them (the hidden-state
/// pool, on the host whatever the drafters' devices, and a stream's receive buffers, `max_message` per producer
/// slot).
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
    parse_kib_field(meminfo, "MemAvailable:")
}

/// `key` of a `/proc` status-style text (`VmSize:   1234 kB`) in bytes.
fn parse_kib_field(text: &str, key: &str) -> Option<u64> {
    let line = text.lines().find_map(|line| line.strip_prefix(key))?;
    let kib: u64 = line.trim().strip_suffix("kB")?.trim().parse().ok()?;
    kib.checked_mul(1024)
}

/// The soft address-space limit of `/proc/self/limits` in bytes; `None` when unlimited or unreadable.
fn parse_address_space_limit(limits: &str) -> Option<u64> {
    let line = limits
        .lines()
        .find_map(|line| line.strip_prefix("Max address space"))?;
    line.split_whitespace().next()?.parse().ok()
}

/// The address space RLIMIT_AS leaves the process: the soft limit less what is mapped now (`VmSize`).
fn address_space_left(limits: &str, status: &str) -> Option<u64> {
    let limit = parse_address_space_limit(limits)?;
    Some(limit.saturating_sub(parse_kib_field(status, "VmSize:").unwrap_or(0)))
}

/// The cgroup v2 directory of this process (`0::/path` in `/proc/self/cgroup`) under `root`.
fn cgroup_dir(proc_cgroup: &str, root: &Path) -> Option<PathBuf> {
    let path = proc_cgroup
        .lines()
        .find_map(|line| line.strip_prefix("0::"))?;
    Some(root.join(path.trim().trim_start_matches('/')))
}

/// The least that `memory.max` less `memory.current` leaves, over `dir` and every directory above it up to
/// `root`, with the `memory.max` file that sets it. `max` (no limit) and unreadable files are skipped.
fn cgroup_left(dir: &Path, root: &Path) -> Option<(u64, PathBuf)> {
    let mut least: Option<(u64, PathBuf)> = None;
    for level in dir.ancestors().take_while(|level| level.starts_with(root)) {
        let max_file = level.join("memory.max");
        let Some(max) = std::fs::read_to_string(&max_file)
            .ok()
            .and_then(|text| text.trim().parse::<u64>().ok())
        else {
            continue;
        };
        let current = std::fs::read_to_string(level.join("memory.current"))
            .ok()
            .and_then(|text| text.trim().parse::<u64>().ok())
            .unwrap_or(0);
        let left = max.saturating_sub(current);
        if least.as_ref().is_none_or(|(bytes, _)| left < *bytes) {
            least = Some((left, max_file));
        }
    }
    least
}

/// Why a plan cannot run in this machine's memory.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "the plan needs {} of host memory but {} is available ({limit}); `draftpipe compile` shows the breakdown (shrink the model, the buckets' tokens or the queue capacity)",
    format_bytes(*.needed),
    format_bytes(*.available)
)]
pub struct HostMemoryError {
    /// Bytes the plan needs on the host.
    pub needed: u64,
    /// Bytes the tightest limit leaves.
    pub available: u64,
    /// Which limit that is: the machine's free memory, `ulimit -v`, or a cgroup's `memory.max`.
    pub limit: String,
}

/// Fails when the plan's host memory exceeds what the machine, the address-space limit or the cgroup leave.
pub(super) fn check(plan: &Plan) -> Result<(), HostMemoryError> {
    let read = |path: &str| std::fs::read_to_string(path).unwrap_or_default();
    let cgroup_root = Path::new("/sys/fs/cgroup");
    let limits = [
        available(Path::new("/proc/meminfo")).map(|bytes| (bytes, "MemAvailable".to_string())),
        address_space_left(&read("/proc/self/limits"), &read("/proc/self/status")).map(|bytes| {
            (
                bytes,
                "left by the address-space limit, `ulimit -v`".to_string(),
            )
        }),
        cgroup_dir(&read("/proc/self/cgroup"), cgroup_root)
            .and_then(|dir| cgroup_left(&dir, cgroup_root))
            .map(|(bytes, file)| (bytes, format!("left by the cgroup's {}", file.display()))),
    ];
    check_against(needed(plan), limits.into_iter().flatten())
}

/// Fails when `needed` exceeds the least of `limits` (bytes, and what sets them).
fn check_against(
    needed: u64,
    limits: impl IntoIterator<Item = (u64, String)>,
) -> Result<(), HostMemoryError> {
    match limits.into_iter().min_by_key(|(bytes, _)| *bytes) {
        Some((available, limit)) if needed > available => Err(HostMemoryError {
            needed,
            available,
            limit,
        }),
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
        let free = |bytes| Some((bytes, "MemAvailable".to_string()));
        assert_eq!(check_against(4 * gib, free(8 * gib)), Ok(()));
        assert_eq!(check_against(4 * gib, None), Ok(()));
        let error = check_against(913 * gib, free(20 * gib)).unwrap_err();
        assert_eq!(
            error.to_string(),
            "the plan needs 913 GiB of host memory but 20.0 GiB is available (MemAvailable); `draftpipe compile` shows the breakdown (shrink the model, the buckets' tokens or the queue capacity)"
        );
    }

    #[test]
    fn the_tightest_limit_decides_and_is_named() {
        let gib = 1 << 30;
        let limits = [
            (20 * gib, "MemAvailable".to_string()),
            (2 * gib, "the cgroup".to_string()),
            (6 * gib, "ulimit -v".to_string()),
        ];
        let error = check_against(3 * gib, limits).unwrap_err();
        assert_eq!(
            (error.available, error.limit.as_str()),
            (2 * gib, "the cgroup")
        );
    }

    #[test]
    fn the_address_space_limit_is_what_is_left_above_the_mapped_space() {
        let limits = "Limit                     Soft Limit           Hard Limit           Units\n\
                      Max file size             unlimited            unlimited            bytes\n\
                      Max address space         4294967296           unlimited            bytes\n";
        let status = "Name:\tdraftpipe\nVmPeak:\t  2000 kB\nVmSize:\t  1048576 kB\n";
        assert_eq!(address_space_left(limits, status), Some(3 << 30));
        let unlimited = limits.replace("4294967296", "unlimited ");
        assert_eq!(address_space_left(&unlimited, status), None);
    }

    #[test]
    fn the_least_cgroup_memory_max_over_the_ancestors_is_read() {
        let root = std::env::temp_dir().join(format!("draftpipe-cgroup-{}", std::process::id()));
        let leaf = root.join("job/step");
        std::fs::create_dir_all(&leaf).unwrap();
        std::fs::write(root.join("job/memory.max"), "1073741824\n").unwrap();
        std::fs::write(root.join("job/memory.current"), "73741824\n").unwrap();
        std::fs::write(leaf.join("memory.max"), "max\n").unwrap();
        let dir = cgroup_dir("0::/job/step\n", &root).unwrap();
        assert_eq!(dir, leaf);
        let (left, file) = cgroup_left(&dir, &root).unwrap();
        assert_eq!((left, file), (1_000_000_000, root.join("job/memory.max")));
        assert_eq!(cgroup_dir("12:memory:/job\n", &root), None);
        std::fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn this_machine_reports_its_available_memory() {
        if cfg!(target_os = "linux") {
            let bytes = available(Path::new("/proc/meminfo")).expect("MemAvailable on Linux");
            assert!(bytes > 0);
        }
    }
}
