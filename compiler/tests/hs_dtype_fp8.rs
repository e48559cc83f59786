//! `hs_dtype = fp8_e4m3`: the spelling, the pool memory `compile` reports for it (1 byte per element and a 4-byte
//! scale per token), the f32 input slots it is dequantised into, and the drafters that cannot take it yet.

use draftpipe_compiler::compile_source;
use draftpipe_compiler::plan::{HsDtype, Plan};
use draftpipe_compiler::summary::Summary;

const DFLASH: &str = include_str!("../../pipelines/dflash-5x3.pipe");
const EAGLE3: &str = include_str!("../../pipelines/eagle3-quickstart.pipe");

fn dflash_in(dtype: &str) -> Plan {
    let text = DFLASH.replace("hs_dtype     = bf16", &format!("hs_dtype     = {dtype}"));
    compile_source("dflash.pipe", &text).unwrap()
}

#[test]
fn fp8_is_spelled_fp8_e4m3_and_is_one_byte_and_a_scale_per_token() {
    let plan = dflash_in("fp8_e4m3");
    assert_eq!(plan.target.hs_dtype, Some(HsDtype::Fp8E4m3));
    assert_eq!(HsDtype::Fp8E4m3.name(), "fp8_e4m3");
    assert_eq!(HsDtype::Fp8E4m3.bytes(), 1);
    assert_eq!(HsDtype::Fp8E4m3.scale_bytes_per_row(), 4);
    assert_eq!(HsDtype::Bf16.scale_bytes_per_row(), 0);
    let summary = Summary(&plan).to_string();
    assert!(summary.contains("hidden states in fp8_e4m3"), "{summary}");
}

#[test]
fn the_fp8_pool_counts_one_byte_per_element_and_four_per_token_for_the_scale() {
    let (bf16, fp8) = (dflash_in("bf16"), dflash_in("fp8_e4m3"));
    // As in `hs_dtype.rs`: 71 buffers of 8192 tokens × (e·20480 + s + 4 + 1) bytes plus 4 per sequence (4).
    let buffer = |e: u64, s: u64| 8192 * (e * 20480 + s + 5) + 4 * 4;
    assert_eq!(fp8.host_memory.hs_pool_buffers, 71);
    assert_eq!(bf16.host_memory.hs_pool(), 71 * buffer(2, 0));
    assert_eq!(fp8.host_memory.hs_pool(), 71 * buffer(1, 4));
    // The drafters' memory is the same: the slots hold f32 (dequantised at staging) as they do for bf16 on
    // this plan's GPUs at f32 precision, or bf16 ones otherwise; never less than f32's.
    let f32_plan = dflash_in("f32");
    for (fp8_device, f32_device) in fp8.memory.iter().zip(&f32_plan.memory) {
        assert_eq!(fp8_device.workspaces, f32_device.workspaces);
    }
}

#[test]
fn a_drafter_reading_last_hidden_states_refuses_fp8_naming_the_drafter() {
    let text = EAGLE3.replace(
        "source       = synthetic(seed = 1, lengths = 32..128)",
        "source       = synthetic(seed = 1, lengths = 32..128)\n    hs_dtype     = fp8_e4m3",
    );
    assert_ne!(text, EAGLE3, "the eagle3 quick start's source line moved");
    let errors = compile_source("eagle3.pipe", &text).unwrap_err();
    let message = format!("{errors:?}");
    assert!(message.contains("last_hidden_states"), "{message}");
    assert!(message.contains("fp8_e4m3"), "{message}");
}
