//! A hidden-state file far larger than a batch is read by the pages a batch touches: the first batch of a
//! 2 GiB file (sparse on disk) is produced while the process grows by a small fraction of that.

mod source_support;

use std::io::Write;

use draftpipe_compiler::plan::{HsDtype, SourceSpec};
use draftpipe_runtime::batch::HsData;
use draftpipe_runtime::source::{BucketShapes, open_sources, resolve_hs_dtype};
use source_support::temp_dir;

const ROWS: usize = 64;
const SEQ: usize = 1024;
const D: usize = 16_384; // hidden 8192 × 2 tap layers
const VOCAB: usize = 16;

/// Resident memory of this process in bytes (`VmRSS`: anonymous and file pages it has touched).
fn resident_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let kib: u64 = status
        .lines()
        .find_map(|line| line.strip_prefix("VmRSS:"))?
        .trim()
        .strip_suffix("kB")?
        .trim()
        .parse()
        .ok()?;
    Some(kib * 1024)
}

/// Writes a safetensors file whose `input_ids` come first and whose bf16 `hidden_states` (all zero) are a hole
/// at the end, so 2 GiB of data take no disk space.
fn write_sparse(path: &std::path::Path) -> u64 {
    let ids_bytes = ROWS * SEQ * 8;
    let hs_bytes = ROWS * SEQ * D * 2;
    let header = format!(
        r#"{{"input_ids":{{"dtype":"I64","shape":[{ROWS},{SEQ}],"data_offsets":[0,{ids_bytes}]}},"hidden_states":{{"dtype":"BF16","shape":[{ROWS},{SEQ},{D}],"data_offsets":[{ids_bytes},{}]}}}}"#,
        ids_bytes + hs_bytes
    );
    let mut header = header.into_bytes();
    header.resize(header.len().next_multiple_of(8), b' ');
    let mut file = std::fs::File::create(path).unwrap();
    file.write_all(&(header.len() as u64).to_le_bytes())
        .unwrap();
    file.write_all(&header).unwrap();
    let ids: Vec<u8> = (0..ROWS * SEQ)
        .flat_map(|i| ((i % VOCAB) as i64).to_le_bytes())
        .collect();
    file.write_all(&ids).unwrap();
    let total = (8 + header.len() + ids_bytes + hs_bytes) as u64;
    file.set_len(total).unwrap();
    total
}

#[test]
fn the_first_batch_of_a_large_file_reads_only_its_own_pages() {
    let Some(before) = resident_bytes() else {
        eprintln!("skipped: /proc/self/status has no VmRSS on this system");
        return;
    };
    let dir = temp_dir("mmap_large");
    let path = dir.join("large.safetensors");
    let file_bytes = write_sparse(&path);
    assert!(file_bytes > 2 << 30);
    let source = SourceSpec::Safetensors {
        pattern: path.to_string_lossy().into_owned(),
        epochs: 2,
        shuffle_seed: Some(3),
    };
    let plan = source_support::plan(source, VOCAB, D / 2, 2, &[SEQ], SEQ, 1);
    let plan = resolve_hs_dtype(&plan).unwrap();
    assert_eq!(plan.target.hs_dtype, Some(HsDtype::Bf16));
    let shapes = BucketShapes::from_plan(&plan);
    let mut source = open_sources(&plan).unwrap().remove(0);
    let mut batch = shapes.buffer();
    let bucket = source.next_bucket().unwrap().unwrap();
    shapes.shape_for(&mut batch, bucket);
    batch.hs.fill(1.0);
    source.fill_next(&mut batch).unwrap();
    let grown = resident_bytes().unwrap().saturating_sub(before);

    // One row of 1024 tokens × 16384 bf16 is 32 MiB, held once in the batch and once as touched file pages.
    let row_bytes = (SEQ * D * 2) as u64;
    assert!(
        grown < 4 * row_bytes,
        "the process grew by {grown} bytes for a {row_bytes}-byte row of a {file_bytes}-byte file"
    );
    assert_eq!(batch.seq_lens, vec![SEQ as u32]);
    let HsData::Bf16(hs) = &batch.hs else {
        panic!("bf16 file into a {:?} batch", batch.hs.dtype())
    };
    assert!(
        hs.iter().all(|v| v.to_bits() == 0),
        "the hole reads as zeros"
    );
    // Whichever row the shuffle put first, its ids are `t mod 16` (rows are 1024 = 64·16 tokens long).
    let want: Vec<u32> = (0..SEQ).map(|t| (t % VOCAB) as u32).collect();
    assert_eq!(batch.input_ids, want);
}
