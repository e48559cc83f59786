//! Assembles the embedded PTX with NVIDIA's `ptxas` for sm_90, without a GPU.
//!
//! Fails on any assembler error, on calls to undefined functions, on a kernel the CUDA backend launches that
//! the PTX lacks, and on stack frames or register spills in any kernel (every entry point is on the hot path of
//! a step). Prints the registers per kernel (docs/gpu.md keeps the table).
//!
//! A second test reads the `.entry` parameter lists of the embedded PTX and checks each against the argument
//! list the CUDA launcher pushes (count and byte widths, both generated from the kernel table): a launch whose
//! arguments do not match its entry point would read garbage without any error.
//!
//! `ptxas` comes from `scripts/install-ptxas.sh` (or `PTXAS=/path/to/ptxas`). Without it, or in a build without
//! PTX, the test prints one line and passes, except under `CI=true`, where either absence is a failure.

use std::path::PathBuf;
use std::process::Command;

use draftpipe_gpu_kernels::flash::{key_major_smem_bytes, query_major_smem_bytes};
use draftpipe_gpu_kernels::table::FLASH_KERNELS;
use draftpipe_runtime::backend::cuda::{
    EMBEDDED_PTX, FLASH_LAUNCH_ARGUMENT_WIDTHS, KERNEL_NAMES, LAUNCH_ARGUMENT_WIDTHS,
};

fn in_ci() -> bool {
    std::env::var("CI").is_ok_and(|v| v == "true")
}

fn skip_or_fail(reason: &str) {
    assert!(!in_ci(), "CI=true but {reason}");
    eprintln!("ptx_check skipped: {reason}");
}

fn find_ptxas() -> Option<PathBuf> {
    if let Some(explicit) = std::env::var_os("PTXAS") {
        return Some(PathBuf::from(explicit));
    }
    let installed = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target/ptxas/bin/ptxas");
    if installed.is_file() {
        return Some(installed);
    }
    let on_path = Command::new("ptxas")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success());
    on_path.then(|| PathBuf::from("ptxas"))
}

/// What `ptxas -v` reports for one entry point.
#[derive(Debug, Default)]
struct KernelResources {
    name: String,
    registers: u32,
    stack_frame_bytes: u32,
    spill_store_bytes: u32,
    spill_load_bytes: u32,
    shared_bytes: u32,
}

fn number_before(line: &str, unit: &str) -> Option<u32> {
    let end = line.find(unit)?;
    line[..end].split_whitespace().last()?.parse().ok()
}

/// Parses `ptxas -v` output: an entry starts at "Compiling entry function 'NAME'", then its "Function
/// properties" line gives stack and spills and "Used N registers" closes it.
fn parse_resources(report: &str) -> Vec<KernelResources> {
    let mut kernels = Vec::new();
    let mut current: Option<KernelResources> = None;
    for line in report.lines() {
        if let Some(rest) = line.split("Compiling entry function '").nth(1) {
            let name = rest.split('\'').next().unwrap_or_default().to_owned();
            current = Some(KernelResources {
                name,
                ..Default::default()
            });
        } else if let Some(kernel) = current.as_mut() {
            if line.contains("bytes stack frame") {
                kernel.stack_frame_bytes =
                    number_before(line, "bytes stack frame").unwrap_or(u32::MAX);
                kernel.spill_store_bytes =
                    number_before(line, "bytes spill stores").unwrap_or(u32::MAX);
                kernel.spill_load_bytes =
                    number_before(line, "bytes spill loads").unwrap_or(u32::MAX);
            } else if line.contains("Used ") && line.contains(" registers") {
                kernel.registers = number_before(line, "registers").unwrap_or(u32::MAX);
                kernel.shared_bytes = number_before(line, "bytes smem").unwrap_or(0);
                kernels.extend(current.take());
            }
        }
    }
    kernels
}

/// The embedded PTX and ptxas's report on it, or `None` (after `skip_or_fail`) without PTX or ptxas.
fn assemble() -> Option<(&'static str, Vec<KernelResources>, String)> {
    let ptx = match EMBEDDED_PTX {
        Ok(ptx) => ptx,
        Err(reason) => {
            skip_or_fail(&format!("the runtime was built without PTX: {reason}"));
            return None;
        }
    };
    let Some(ptxas) = find_ptxas() else {
        skip_or_fail("ptxas not found (run scripts/install-ptxas.sh or set PTXAS)");
        return None;
    };
    let dir = std::env::temp_dir().join(format!(
        "draftpipe-ptx-check-{}-{:?}",
        std::process::id(),
        std::thread::current().id()
    ));
    std::fs::create_dir_all(&dir).expect("create a temp dir");
    let ptx_path = dir.join("kernels.ptx");
    std::fs::write(&ptx_path, ptx).expect("write the PTX");
    let output = Command::new(&ptxas)
        .args(["-arch=sm_90", "-v", "-o", "/dev/null"])
        .arg(&ptx_path)
        .output()
        .unwrap_or_else(|e| panic!("run {}: {e}", ptxas.display()));
    std::fs::remove_dir_all(&dir).ok();
    let report = format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(output.status.success(), "ptxas rejected the PTX:\n{report}");
    assert!(
        !report.to_lowercase().contains("error"),
        "ptxas reported errors:\n{report}"
    );
    let kernels = parse_resources(&report);
    Some((ptx, kernels, report))
}

#[test]
fn every_kernel_assembles_for_sm90_without_spills() {
    let Some((ptx, kernels, report)) = assemble() else {
        return;
    };
    let undefined: Vec<&str> = ptx
        .lines()
        .filter(|l| l.starts_with(".extern .func"))
        .collect();
    assert!(
        undefined.is_empty(),
        "the PTX calls undefined functions: {undefined:?}"
    );
    for name in KERNEL_NAMES {
        assert!(
            ptx.contains(&format!(".visible .entry {name}(")),
            "kernel {name} is launched by the CUDA backend but missing from the PTX"
        );
    }
    assert_eq!(
        kernels.len(),
        KERNEL_NAMES.len() + FLASH_KERNELS.len(),
        "ptxas reported other entry points than expected:\n{report}"
    );
    eprintln!(
        "{:<36} {:>9} {:>7} {:>7} {:>7}",
        "kernel (sm_90)", "registers", "stack", "spills", "smem"
    );
    for k in &kernels {
        eprintln!(
            "{:<36} {:>9} {:>7} {:>7} {:>7}",
            k.name,
            k.registers,
            k.stack_frame_bytes,
            k.spill_store_bytes + k.spill_load_bytes,
            k.shared_bytes
        );
    }
    let heavy: Vec<&KernelResources> = kernels
        .iter()
        .filter(|k| KERNEL_NAMES.contains(&k.name.as_str()))
        .filter(|k| k.stack_frame_bytes != 0 || k.spill_store_bytes != 0 || k.spill_load_bytes != 0)
        .collect();
    assert!(
        heavy.is_empty(),
        "kernels with a stack frame or spills: {heavy:?}"
    );
}

/// Registers of an SM (sm_90) and the shared memory two blocks may use between them (228 KiB less the 1 KiB
/// the driver reserves per block).
const SM_REGISTERS: u32 = 65536;
const SM_SHARED_FOR_TWO_BLOCKS: u32 = 228 * 1024 - 2 * 1024;

/// The flash-attention entries (gpu-kernels/src/flash): the tensor-core instruction in each, the shared memory
/// the table declares, neither a stack frame nor spills, and two blocks per SM at Qwen3-8B's group of 4
/// query heads per kv head (4 warps; the key-major pass always has 4).
#[test]
fn flash_entries_use_tensor_cores_within_their_budgets() {
    let Some((ptx, kernels, report)) = assemble() else {
        return;
    };
    for entry in FLASH_KERNELS {
        let name = entry.name;
        let body = ptx
            .split(&format!(".visible .entry {name}("))
            .nth(1)
            .unwrap_or_else(|| panic!("flash entry {name} missing from the PTX"));
        let body = &body[..body.find("\n}\n").unwrap_or(body.len())];
        assert!(
            body.contains("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32"),
            "{name} has no bf16 mma.m16n8k16"
        );
        assert!(
            body.contains("ldmatrix.sync.aligned.m8n8.x4"),
            "{name} has no ldmatrix"
        );
        let k = kernels
            .iter()
            .find(|k| k.name == name)
            .unwrap_or_else(|| panic!("ptxas did not report {name}:\n{report}"));
        let head_dim = if name.ends_with("_d64") { 64 } else { 128 };
        let shared = if name.contains("_kv_") {
            key_major_smem_bytes(head_dim)
        } else {
            query_major_smem_bytes(head_dim)
        };
        assert_eq!(k.shared_bytes as usize, shared, "{name}: shared memory");
        // Registers are allocated per warp in units of 256.
        let per_warp = (k.registers * 32).div_ceil(256) * 256;
        assert!(
            2 * 4 * per_warp <= SM_REGISTERS && 2 * k.shared_bytes <= SM_SHARED_FOR_TWO_BLOCKS,
            "{name}: two blocks of 4 warps do not fit an SM ({} registers, {} bytes shared)",
            k.registers,
            k.shared_bytes
        );
        let spilled = k.spill_store_bytes + k.spill_load_bytes;
        assert!(
            k.stack_frame_bytes == 0 && spilled == 0,
            "{name}: stack frame {} bytes, {spilled} bytes spilled",
            k.stack_frame_bytes
        );
    }
}

/// The statements of every inline-assembly block of `ptx` (between llc's `// begin inline asm` and `// end
/// inline asm` markers), comments and braces dropped.
fn inline_asm_statements(ptx: &str) -> Vec<String> {
    let mut statements = Vec::new();
    let mut inside = false;
    for line in ptx.lines() {
        let line = line.trim();
        if line == "// begin inline asm" {
            inside = true;
        } else if line == "// end inline asm" {
            inside = false;
        } else if inside {
            let code = line.split("//").next().unwrap_or_default();
            statements.extend(
                code.split(';')
                    .map(|s| {
                        s.trim()
                            .trim_start_matches('{')
                            .trim_end_matches('}')
                            .trim()
                    })
                    .filter(|s| !s.is_empty())
                    .map(str::to_owned),
            );
        }
    }
    statements
}

/// The inline assembly the kernels may still emit (docs/gpu.md, "Warp instructions"): `ldmatrix` with the
/// address add and scratch register around it (its intrinsic costs the flash entries registers and spills), the
/// shared-array address of a flash entry (`cvta.shared` of a module-scope symbol Rust cannot name), the empty
/// `// opaque` pin (a comment, dropped above), and the `exit` of LLVM's trap.
const ALLOWED_INLINE_ASM: &[&str] = &[
    "ldmatrix.sync.aligned.m8n8.x4.b16 ",
    "ldmatrix.sync.aligned.m8n8.x4.trans.b16 ",
    ".reg .b64 at",
    "add.s64 at, ",
    "cvta.shared.u64 ",
    "exit",
];

/// Every warp-synchronous instruction but `ldmatrix`, and the approximate maths, come from LLVM's NVVM
/// intrinsics (LLVM knows the former are convergent and the latter pure), so the PTX has each instruction and no
/// inline-assembly block holds anything but the listed leftovers.
#[test]
fn warp_instructions_come_from_intrinsics_not_inline_asm() {
    let ptx = match EMBEDDED_PTX {
        Ok(ptx) => ptx,
        Err(reason) => {
            return skip_or_fail(&format!("the runtime was built without PTX: {reason}"));
        }
    };
    for instruction in [
        "shfl.sync.bfly.b32",
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32",
        "bar.sync",
        "ex2.approx.ftz.f32",
        "lg2.approx.ftz.f32",
        "rsqrt.approx.ftz.f32",
    ] {
        assert!(ptx.contains(instruction), "the PTX has no {instruction}");
    }
    let statements = inline_asm_statements(ptx);
    let stray: Vec<&String> = statements
        .iter()
        .filter(|s| {
            !ALLOWED_INLINE_ASM
                .iter()
                .any(|allowed| s.starts_with(allowed))
        })
        .collect();
    assert!(
        stray.is_empty(),
        "inline assembly beyond the allowed leftovers: {stray:?}"
    );
}

#[test]
fn inline_asm_reader_finds_a_stray_shuffle() {
    let ptx = "\tadd.s32 %r1, %r2, 1;\n\t// begin inline asm\n\t// opaque %rd4\n\t// end inline asm\n\
               \t// begin inline asm\n\tshfl.sync.bfly.b32 %r3, %r1, 16, 0x1f, 0xffffffff;\n\t// end inline asm\n\
               \t// begin inline asm\n\t{ .reg .b64 at; add.s64 at, %rd1, %rd2;\n\
               \tldmatrix.sync.aligned.m8n8.x4.b16 {%r4, %r5, %r6, %r7}, [at]; }\n\t// end inline asm\n";
    let statements = inline_asm_statements(ptx);
    assert_eq!(
        statements,
        [
            "shfl.sync.bfly.b32 %r3, %r1, 16, 0x1f, 0xffffffff",
            ".reg .b64 at",
            "add.s64 at, %rd1, %rd2",
            "ldmatrix.sync.aligned.m8n8.x4.b16 {%r4, %r5, %r6, %r7}, [at]",
        ]
    );
    let stray: Vec<&String> = statements
        .iter()
        .filter(|s| {
            !ALLOWED_INLINE_ASM
                .iter()
                .any(|allowed| s.starts_with(allowed))
        })
        .collect();
    assert_eq!(stray.len(), 1, "{stray:?}");
}

/// The byte width of each `.param` of every `.entry` in `ptx`, in order: `(name, widths)`.
fn entry_parameters(ptx: &str) -> Vec<(String, Vec<usize>)> {
    let mut entries = Vec::new();
    let mut lines = ptx.lines();
    while let Some(line) = lines.next() {
        let Some(rest) = line.split(".entry ").nth(1) else {
            continue;
        };
        let name = rest.split('(').next().unwrap_or_default().trim().to_owned();
        let mut widths = Vec::new();
        for param in lines.by_ref() {
            let param = param.trim();
            if param.starts_with(')') {
                break;
            }
            let kind = param
                .strip_prefix(".param .")
                .and_then(|p| p.split_whitespace().next())
                .unwrap_or_else(|| panic!("entry {name}: unexpected parameter line `{param}`"));
            let bits: usize = kind[1..]
                .parse()
                .unwrap_or_else(|_| panic!("entry {name}: parameter type `{kind}`"));
            widths.push(bits / 8);
        }
        entries.push((name, widths));
    }
    entries
}

#[test]
fn entry_parameters_match_the_launchers_arguments() {
    let ptx = match EMBEDDED_PTX {
        Ok(ptx) => ptx,
        Err(reason) => {
            return skip_or_fail(&format!("the runtime was built without PTX: {reason}"));
        }
    };
    let entries = entry_parameters(ptx);
    assert_eq!(
        entries.len(),
        LAUNCH_ARGUMENT_WIDTHS.len() + FLASH_KERNELS.len(),
        "PTX entries {:?}",
        entries.iter().map(|(n, _)| n).collect::<Vec<_>>()
    );
    for (name, pushed) in LAUNCH_ARGUMENT_WIDTHS {
        let (_, declared) = entries
            .iter()
            .find(|(entry, _)| entry == name)
            .unwrap_or_else(|| panic!("kernel {name} is launched but has no .entry in the PTX"));
        assert_eq!(
            declared.as_slice(),
            *pushed,
            "kernel {name}: PTX parameter widths vs the launcher's arguments"
        );
    }
    for entry in FLASH_KERNELS {
        let (_, declared) = entries
            .iter()
            .find(|(name, _)| name == entry.name)
            .unwrap_or_else(|| panic!("flash kernel {} has no .entry in the PTX", entry.name));
        assert_eq!(
            declared.as_slice(),
            entry.argument_widths,
            "flash kernel {}",
            entry.name
        );
        let (_, pushed) = FLASH_LAUNCH_ARGUMENT_WIDTHS
            .iter()
            .find(|(name, _)| *name == entry.name)
            .unwrap_or_else(|| panic!("flash kernel {} has no CUDA launcher", entry.name));
        assert_eq!(
            declared.as_slice(),
            *pushed,
            "flash kernel {}: PTX parameter widths vs the flash launcher's arguments",
            entry.name
        );
    }
}

#[test]
fn entry_parameter_parser_reads_llc_output() {
    let ptx = "// .globl\tk\n.visible .entry k(\n\t.param .u64 k_param_0,\n\t.param .f32 k_param_1,\n\
               \t.param .u32 k_param_2\n)\n{\n}\n";
    assert_eq!(entry_parameters(ptx), vec![("k".to_owned(), vec![8, 4, 4])]);
}

#[test]
fn parser_reads_ptxas_verbose_output() {
    let report = "ptxas info    : Compiling entry function 'adamw' for 'sm_90'\n\
                  ptxas info    : Function properties for adamw\n    \
                  16 bytes stack frame, 4 bytes spill stores, 8 bytes spill loads\n\
                  ptxas info    : Used 24 registers, used 0 barriers, 392 bytes cmem[0]\n";
    let kernels = parse_resources(report);
    assert_eq!(kernels.len(), 1);
    assert_eq!(kernels[0].shared_bytes, 0);
    let k = &kernels[0];
    assert_eq!(
        (
            k.name.as_str(),
            k.registers,
            k.stack_frame_bytes,
            k.spill_store_bytes,
            k.spill_load_bytes
        ),
        ("adamw", 24, 16, 4, 8)
    );
}
