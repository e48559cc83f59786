//! Builds the PTX of `draftpipe-gpu-kernels` and embeds it in the runtime (docs/gpu.md, "PTX build").
//!
//! ```text
//!  gpu-kernels/src ──cargo +nightly -Zbuild-std=core --target nvptx64-nvidia-cuda──▶ bitcode
//!      ──gpu-kernels/ptx-linker.sh (llvm-link → opt → llc -mcpu=sm_90)──▶ OUT_DIR/draftpipe_kernels.ptx
//!      ──include_str!──▶ runtime::cuda::ptx
//! ```
//!
//! The PTX is optional: without the nightly toolchain (or its `rust-src`/`llvm-tools` components), with
//! `DRAFTPIPE_NO_PTX=1`, or when the nested build fails for any reason (no network to fetch the standard
//! library's own dependencies, a kernel that does not compile), the runtime builds without PTX, a line says why
//! once, when this script runs (on the build's terminal, else as a `cargo:warning`: see `build_notice.rs`), and
//! the CUDA backend answers "built without GPU kernels: <reason>". With
//! `DRAFTPIPE_REQUIRE_PTX=1` (CI sets it) every one of those is a build failure instead.
//!
//! The nested cargo runs online: `-Zbuild-std=core` resolves the standard library's workspace, whose lock file
//! names crates (`rustc-literal-escaper`, ...) that a fresh cargo home has never downloaded.
//!
//! The nested cargo runs on a generated manifest (no workspace, its own target dir under the outer target dir),
//! so it never waits on the outer build's locks and inherits nothing from the outer build's environment but the
//! essentials. The PTX is copied into `OUT_DIR` and embedded from there.

use std::env;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

#[path = "build_notice.rs"]
mod build_notice;

const NVPTX_TARGET: &str = "nvptx64-nvidia-cuda";
const CUDA_ARCH: &str = "sm_90";

fn main() {
    let manifest_dir =
        PathBuf::from(env::var_os("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR"));
    let out_dir = PathBuf::from(env::var_os("OUT_DIR").expect("cargo sets OUT_DIR"));
    let kernels_dir = manifest_dir.join("../gpu-kernels");
    println!(
        "cargo:rerun-if-changed={}",
        kernels_dir.join("src").display()
    );
    println!(
        "cargo:rerun-if-changed={}",
        kernels_dir.join("ptx-linker.sh").display()
    );
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-changed=build_notice.rs");
    println!("cargo:rerun-if-env-changed=DRAFTPIPE_NO_PTX");
    println!("cargo:rerun-if-env-changed={REQUIRE_PTX}");

    let embed = match build_ptx(&kernels_dir, &out_dir) {
        Ok(ptx) => format!("Ok(include_str!({:?}))", ptx.display().to_string()),
        Err(Unavailable(reason)) if ptx_required() => {
            panic!("{REQUIRE_PTX} is set but the GPU kernels did not build: {reason}")
        }
        Err(Unavailable(reason)) => {
            let first_line = reason.lines().next().unwrap_or_default();
            // Once, on the build's terminal: a `cargo:warning` would be replayed on every later build.
            let mut terminal = fs::OpenOptions::new().write(true).open("/dev/tty").ok();
            let terminal = terminal.as_mut().map(|tty| tty as &mut dyn std::io::Write);
            if let Some(directive) = build_notice::announce(first_line, terminal) {
                println!("{directive}");
            }
            format!("Err({first_line:?})")
        }
    };
    let generated = format!(
        "/// The kernels' PTX for `{CUDA_ARCH}`, or why this build has none.\n\
         pub const EMBEDDED_PTX: Result<&str, &str> = {embed};\n"
    );
    fs::write(out_dir.join("embedded_ptx.rs"), generated).expect("write OUT_DIR/embedded_ptx.rs");
}

/// Makes every reason for a build without PTX a build failure (CI sets it).
const REQUIRE_PTX: &str = "DRAFTPIPE_REQUIRE_PTX";

fn ptx_required() -> bool {
    env::var_os(REQUIRE_PTX).is_some_and(|v| !v.is_empty() && v != "0")
}

/// Why this build carries no PTX: tools missing, opted out, or the nested build failed (first line: the reason
/// for the warning; the rest: the nested cargo's output, shown when the PTX is required).
struct Unavailable(String);

fn build_ptx(kernels_dir: &Path, out_dir: &Path) -> Result<PathBuf, Unavailable> {
    if env::var_os("DRAFTPIPE_NO_PTX").is_some_and(|v| !v.is_empty() && v != "0") {
        return Err(Unavailable("DRAFTPIPE_NO_PTX is set".into()));
    }
    let rustup = find_rustup()
        .ok_or_else(|| Unavailable("rustup not found on PATH or in CARGO_HOME".into()))?;
    let sysroot = nightly_sysroot(&rustup)?;
    if !sysroot.join("lib/rustlib/src/rust/library/core").is_dir() {
        return Err(Unavailable(
            "nightly lacks rust-src (rustup component add rust-src --toolchain nightly)".into(),
        ));
    }
    let host = env::var("HOST").expect("cargo sets HOST");
    let llvm_bin = sysroot.join("lib/rustlib").join(&host).join("bin");
    if !llvm_bin.join("llvm-link").is_file() {
        return Err(Unavailable(
            "nightly lacks llvm-tools (rustup component add llvm-tools --toolchain nightly)".into(),
        ));
    }

    let kernels_dir = kernels_dir
        .canonicalize()
        .expect("gpu-kernels directory exists");
    let work_dir = shared_work_dir(out_dir);
    let crate_dir = work_dir.join("crate");
    fs::create_dir_all(&crate_dir).expect("create the PTX crate directory");
    let manifest = ptx_manifest(&kernels_dir);
    let manifest_path = crate_dir.join("Cargo.toml");
    // Rewriting an identical manifest would only make the nested cargo rebuild.
    if fs::read_to_string(&manifest_path).ok().as_deref() != Some(manifest.as_str()) {
        fs::write(&manifest_path, manifest).expect("write the PTX crate manifest");
    }

    let target_dir = work_dir.join("target");
    let mut cargo = Command::new(&rustup);
    cargo
        .args([
            "run",
            "nightly",
            "cargo",
            "build",
            "--release",
            "--quiet",
            "-Zbuild-std=core",
        ])
        .args(["--target", NVPTX_TARGET])
        .arg("--manifest-path")
        .arg(crate_dir.join("Cargo.toml"))
        .arg("--target-dir")
        .arg(&target_dir)
        .env_clear()
        .envs(env::vars_os().filter(|(key, _)| inherited(key.to_str().unwrap_or(""))))
        .env(
            "CARGO_TARGET_NVPTX64_NVIDIA_CUDA_LINKER",
            kernels_dir.join("ptx-linker.sh"),
        )
        .env(
            "CARGO_TARGET_NVPTX64_NVIDIA_CUDA_RUSTFLAGS",
            format!("-Ctarget-cpu={CUDA_ARCH}"),
        )
        .env("DRAFTPIPE_LLVM_BIN", &llvm_bin)
        .stdout(Stdio::inherit())
        .stderr(Stdio::piped());
    let output = cargo
        .output()
        .map_err(|e| Unavailable(format!("cannot run the nested nightly cargo: {e}")))?;
    if !output.status.success() {
        let stderr = String::from_utf8_lossy(&output.stderr);
        let first_error = stderr
            .lines()
            .find(|line| line.trim_start().starts_with("error"))
            .or_else(|| stderr.lines().find(|line| !line.trim().is_empty()))
            .unwrap_or("no output")
            .trim();
        return Err(Unavailable(format!(
            "the nested nightly build for {NVPTX_TARGET} failed ({}): {first_error}\n{stderr}",
            output.status
        )));
    }
    let built = target_dir
        .join(NVPTX_TARGET)
        .join("release/draftpipe_gpu_kernels.ptx");
    let embedded = out_dir.join("draftpipe_kernels.ptx");
    fs::copy(&built, &embedded)
        .map_err(|e| Unavailable(format!("copy {} to OUT_DIR: {e}", built.display())))?;
    Ok(embedded)
}

/// Where the nested build lives: `<target>/draftpipe-ptx`, shared by the dev, test and bench profiles of the
/// outer build (all build the same release PTX, and building `core` for nvptx is most of the time), or inside
/// `OUT_DIR` when it does not have cargo's usual `<target>/<profile>/build/<pkg>/out` shape. The nested cargo
/// locks that directory itself, so two outer builds at once wait for each other instead of clashing.
fn shared_work_dir(out_dir: &Path) -> PathBuf {
    let in_build_dir = out_dir
        .parent()
        .and_then(Path::parent)
        .is_some_and(|p| p.ends_with("build"));
    match out_dir.ancestors().nth(4) {
        Some(target) if in_build_dir => target.join("draftpipe-ptx"),
        _ => out_dir.join("ptx"),
    }
}

/// The environment the nested cargo keeps: where tools live, temp space, and the outer jobserver (the build
/// machines have two cores). Everything else (RUSTC, RUSTFLAGS, CARGO_TARGET_DIR, RUSTUP_TOOLCHAIN, ...) would
/// point the nested build at the outer build's toolchain, flags or directories.
fn inherited(key: &str) -> bool {
    matches!(
        key,
        "PATH" | "HOME" | "CARGO_HOME" | "RUSTUP_HOME" | "TMPDIR" | "CARGO_MAKEFLAGS"
    )
}

fn find_rustup() -> Option<PathBuf> {
    let on_path = env::var_os("PATH")
        .into_iter()
        .flat_map(|p| env::split_paths(&p).collect::<Vec<_>>());
    let cargo_home = env::var_os("CARGO_HOME")
        .map(PathBuf::from)
        .or_else(|| env::var_os("HOME").map(|h| PathBuf::from(h).join(".cargo")));
    on_path
        .chain(cargo_home.map(|h| h.join("bin")))
        .map(|dir| dir.join("rustup"))
        .find(|candidate| candidate.is_file())
}

fn nightly_sysroot(rustup: &Path) -> Result<PathBuf, Unavailable> {
    let output = Command::new(rustup)
        .args(["run", "nightly", "rustc", "--print", "sysroot"])
        .env_remove("RUSTUP_TOOLCHAIN")
        .env_remove("RUSTC")
        .output()
        .map_err(|e| Unavailable(format!("cannot run rustup: {e}")))?;
    if !output.status.success() {
        return Err(Unavailable(format!(
            "no nightly toolchain (rustup toolchain install nightly): {}",
            String::from_utf8_lossy(&output.stderr).trim()
        )));
    }
    Ok(PathBuf::from(
        String::from_utf8_lossy(&output.stdout).trim(),
    ))
}

/// A standalone manifest over the gpu-kernels sources: a cdylib (so rustc calls our linker, which writes PTX),
/// fat LTO (so `core` is inside the bitcode and bounds-check paths resolve), one codegen unit, abort on panic.
fn ptx_manifest(kernels_dir: &Path) -> String {
    let lib = kernels_dir.join("src/lib.rs");
    format!(
        "[package]\nname = \"draftpipe-gpu-kernels-ptx\"\nversion = \"0.0.0\"\nedition = \"2024\"\npublish = false\n\n\
         [lib]\nname = \"draftpipe_gpu_kernels\"\npath = {:?}\ncrate-type = [\"cdylib\"]\n\n\
         [profile.release]\nopt-level = 3\nlto = \"fat\"\ncodegen-units = 1\npanic = \"abort\"\ndebug = false\n\n\
         [workspace]\n",
        lib.display().to_string()
    )
}
