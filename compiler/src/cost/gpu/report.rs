//! The GPU model as `compile` prints it: per bucket the phases and kernel kinds, the MFU per bucket and over
//! the mix, what takes the time, the attention beside today's CUDA-core estimate, and the assumptions with
//! their sources (short; `docs/gpu.md` has the table).

use std::fmt;

use super::{GpuStepModel, KINDS, KernelKind, PHASES};

fn ms(seconds: f64) -> String {
    format!("{:.1} ms", seconds * 1e3)
}

impl fmt::Display for GpuStepModel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "GPU step model (a model, not a measurement: {} assumed, precision {}, {}, {} replica{})",
            self.gpu.name,
            self.precision.name(),
            if self.graph {
                "CUDA graphs"
            } else {
                "eager launches priced as graph nodes"
            },
            self.replicas,
            if self.replicas == 1 { "" } else { "s" }
        )?;
        write!(f, "  {:>8}", "bucket")?;
        for phase in PHASES {
            write!(f, " {:>10}", phase.name())?;
        }
        write!(f, " {:>10} │", "step")?;
        for kind in &KINDS[..4] {
            write!(f, " {:>10}", kind.name())?;
        }
        writeln!(f, " {:>9} {:>7}", "TFLOP", "MFU")?;
        for b in &self.buckets {
            write!(f, "  {:>8}", b.padded_len)?;
            for s in b.phase_s {
                write!(f, " {:>10}", ms(s))?;
            }
            write!(f, " {:>10} │", ms(b.step_s()))?;
            for s in &b.kind_s[..4] {
                write!(f, " {:>10}", ms(*s))?;
            }
            writeln!(f, " {:>9.1} {:>6.1}%", b.model_flops / 1e12, 100.0 * b.mfu)?;
        }
        let mix: Vec<String> = self
            .buckets
            .iter()
            .zip(&self.shares)
            .map(|(b, s)| format!("{} {:.1}%", b.padded_len, 100.0 * s))
            .collect();
        let mean_step: f64 = self
            .buckets
            .iter()
            .zip(&self.shares)
            .map(|(b, s)| s * b.step_s())
            .sum();
        writeln!(
            f,
            "  over the bucket mix (weighted by the items each bucket is fed: {}): {} per step, MFU {:.1}%",
            mix.join(", "),
            ms(mean_step),
            100.0 * self.mfu
        )?;
        if mean_step > 0.0 {
            let shares: Vec<String> = KINDS
                .iter()
                .map(|&kind| {
                    let s: f64 = self
                        .buckets
                        .iter()
                        .zip(&self.shares)
                        .map(|(b, share)| share * b.of_kind(kind))
                        .sum();
                    format!("{} {:.1}%", kind.name(), 100.0 * s / mean_step)
                })
                .collect();
            writeln!(
                f,
                "  where the time goes over the mix: {}",
                shares.join(", ")
            )?;
        }
        for b in &self.buckets {
            writeln!(
                f,
                "  largest at {}: {} ({}), {}",
                b.padded_len,
                b.largest.0,
                b.largest.1.name(),
                ms(b.largest.2)
            )?;
        }
        if let Some(b) = self.buckets.iter().max_by_key(|b| b.padded_len) {
            let (slow, fast) = b.cuda_core_attention_s;
            writeln!(
                f,
                "  attention at {} (the largest bucket): {} modelled; today's f32 CUDA-core kernels at 5-8 \
                 TFLOP/s: {:.2}-{:.2} s",
                b.padded_len,
                ms(b.of_kind(KernelKind::Attention)),
                fast,
                slow
            )?;
        }
        writeln!(
            f,
            "  model FLOPs: 2mnk of every GEMM launched (lm_head over the labelled rows only) + attention's \
             unmasked pairs, 4·head_dim per pair and head forward, twice that backward (no recompute, no \
             element-wise work); MFU against {:.0} TFLOP/s",
            self.gpu.bf16_flops / 1e12
        )?;
        writeln!(f, "  assumptions (docs/gpu.md, \"The GPU time model\"):")?;
        let width = self
            .assumptions
            .iter()
            .map(|a| a.what.chars().count())
            .max()
            .unwrap_or(0);
        for (i, a) in self.assumptions.iter().enumerate() {
            let pad = width - a.what.chars().count();
            write!(
                f,
                "    {}{} {}; {}",
                a.what,
                " ".repeat(pad),
                a.value,
                a.source
            )?;
            if i + 1 < self.assumptions.len() {
                writeln!(f)?;
            }
        }
        Ok(())
    }
}
