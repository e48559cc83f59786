//! The project's bitcode linker (`gpu-kernels/ptx-linker.sh`) on hand-written NVPTX IR: it keeps exactly the
//! exported kernels (an unexported function is internalised and dropped) and refuses, without writing
//! anything, IR that calls an undefined function.
//!
//! Needs the nightly toolchain's `llvm-tools`; without them it prints one line and passes, except under
//! `CI=true`, where their absence is a failure (scripts/ci-gpu-prereqs.sh installs them).

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

const GOOD_IR: &str = r#"target triple = "nvptx64-nvidia-cuda"
define ptx_kernel void @fill_one(ptr %p) {
  store float 1.0, ptr %p
  ret void
}
define void @unexported_helper(ptr %p) {
  store float 2.0, ptr %p
  ret void
}
"#;

const BAD_IR: &str = r#"target triple = "nvptx64-nvidia-cuda"
declare void @undefined_helper()
define ptx_kernel void @fill_one(ptr %p) {
  call void @undefined_helper()
  ret void
}
"#;

fn llvm_bin() -> Option<PathBuf> {
    let out = Command::new("rustup")
        .args(["run", "nightly", "rustc", "--print", "sysroot"])
        .output()
        .ok()?;
    let sysroot = PathBuf::from(String::from_utf8(out.stdout).ok()?.trim());
    let bin = sysroot.join("lib/rustlib/x86_64-unknown-linux-gnu/bin");
    (out.status.success() && bin.join("llvm-as").is_file()).then_some(bin)
}

fn assemble(llvm: &Path, dir: &Path, name: &str, ir: &str) -> PathBuf {
    let ll = dir.join(format!("{name}.ll"));
    let bc = dir.join(format!("{name}.o"));
    std::fs::write(&ll, ir).expect("write IR");
    let status = Command::new(llvm.join("llvm-as"))
        .arg(&ll)
        .arg("-o")
        .arg(&bc)
        .status()
        .expect("run llvm-as");
    assert!(status.success(), "llvm-as {name}");
    bc
}

fn link(llvm: &Path, object: &Path, output: &Path) -> Output {
    let linker = Path::new(env!("CARGO_MANIFEST_DIR")).join("../gpu-kernels/ptx-linker.sh");
    Command::new(linker)
        .env("DRAFTPIPE_LLVM_BIN", llvm)
        .args(["--export-symbol", "fill_one"])
        .arg(object)
        .args([
            "--target",
            "nvptx64-nvidia-cuda",
            "--target-cpu",
            "sm_90",
            "-O3",
            "--debug",
            "-o",
        ])
        .arg(output)
        .output()
        .expect("run the linker")
}

#[test]
fn keeps_exported_kernels_and_refuses_undefined_calls() {
    let Some(llvm) = llvm_bin() else {
        let in_ci = std::env::var("CI").is_ok_and(|v| v == "true");
        assert!(!in_ci, "CI=true but the nightly llvm-tools are missing");
        return eprintln!("ptx_linker skipped: nightly llvm-tools not installed");
    };
    let dir = std::env::temp_dir().join(format!("draftpipe-ptx-linker-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");

    let good = assemble(&llvm, &dir, "good", GOOD_IR);
    let good_ptx = dir.join("good.ptx");
    let out = link(&llvm, &good, &good_ptx);
    assert!(
        out.status.success(),
        "linking good IR failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let ptx = std::fs::read_to_string(&good_ptx).expect("PTX written");
    assert!(
        ptx.contains(".target sm_90") && ptx.contains(".visible .entry fill_one("),
        "{ptx}"
    );
    assert!(
        !ptx.contains("unexported_helper"),
        "unexported function survived internalize:\n{ptx}"
    );

    let bad = assemble(&llvm, &dir, "bad", BAD_IR);
    let bad_ptx = dir.join("bad.ptx");
    let out = link(&llvm, &bad, &bad_ptx);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "linker accepted an undefined call");
    assert!(
        stderr.contains("undefined_helper"),
        "the error names the undefined function: {stderr}"
    );
    assert!(!bad_ptx.exists(), "no PTX may be written for bad IR");
    std::fs::remove_dir_all(&dir).ok();
}
