//! The kernel table's declaration of which body runs where ([`HOST_BODIES`]) against what it names and what
//! docs/kernels.md says: every kernel it lists is a table entry, every host body's file exists, and the docs'
//! table is the declaration's rendering (so a reader of either is not misled).

use draftpipe_gpu_kernels::table::{HOST_BODIES, KERNELS};

/// The workspace root (this crate's parent).
fn workspace() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("the crate sits in the workspace")
        .to_path_buf()
}

/// docs/kernels.md's table of [`HOST_BODIES`], as it must read.
fn rendered() -> String {
    let mut table = String::from(
        "| operation | CPU: its own body | other backends (CUDA): the table's kernels |\n| --- | --- | --- |\n",
    );
    for body in HOST_BODIES {
        let kernels: Vec<String> = body.kernels.iter().map(|k| format!("`{k}`")).collect();
        table.push_str(&format!(
            "| `{}` | `{}` | {} |\n",
            body.operation,
            body.body,
            kernels.join(", ")
        ));
    }
    table
}

#[test]
fn host_bodies_name_table_kernels_and_existing_files() {
    for body in HOST_BODIES {
        for kernel in body.kernels {
            assert!(
                KERNELS.iter().any(|k| k.name == *kernel),
                "{}: `{kernel}` is no kernel of the table",
                body.operation
            );
        }
        assert!(
            workspace().join(body.body).is_file(),
            "{}: no host body at {}",
            body.operation,
            body.body
        );
    }
}

#[test]
fn docs_list_the_declared_host_bodies() {
    let docs =
        std::fs::read_to_string(workspace().join("docs/kernels.md")).expect("docs/kernels.md");
    let table = rendered();
    assert!(
        docs.contains(&table),
        "docs/kernels.md must hold the table of HOST_BODIES exactly as:\n{table}"
    );
}
