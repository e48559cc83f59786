//! The `eagle3` step's backward pass: the unroll in reverse, step `K − 1` first, carrying the gradient of each
//! step's input `h_k` (its midlayer output feeds step `k + 1` twice: the residual and `hidden_norm`), then `fc`
//! and the four norms' weight gradients in one pass over every step's rows.
//!
//! Step `k`'s keys and values are read by the queries of steps `k..K`; the attention backward of step `j` adds
//! its queries' share into the stacked `dk`, `dv` of every step `≤ j`, so when step `k` is reached its keys'
//! gradients are complete and its `k_proj`/`v_proj` backward runs then.
//!
//! The projections' backward is the shared `layers::linear_backward`; the SwiGLU block's is written here because
//! the shared `layers::swiglu_mlp_backward` overwrites its weight gradients, and the unroll accumulates them
//! over the TTT steps (the first step processed overwrites, the others add).

use crate::backend::{Backend, BackendResult, HsOperand, Operand};
use crate::model::layers;
use crate::model::step::StepShape;

use super::{Eagle3, UnrollAttention, UnrollSaved};

impl<B: Backend> Eagle3<B> {
    /// Overwrites every gradient but `lm_head`'s (the loss wrote it) from the `dz` of every step.
    pub(super) fn backward(&mut self, be: &mut B, shape: StepShape, slot: usize) -> BackendResult {
        let spec = self.offsets.spec();
        let (h, d, i) = (spec.hidden, spec.taps * spec.hidden, spec.intermediate);
        let (heads, kvh, hd) = (spec.heads, spec.kv_heads, spec.head_dim);
        let (qd, kd) = (heads * hd, kvh * hd);
        let (theta, steps) = (spec.rope_theta, spec.ttt);
        let (t, len) = (shape.tokens(), shape.padded_len);
        let th = t * h;
        let (p, at) = (self.precision, &self.offsets);
        let (ws, state) = (&mut self.ws, &mut self.state);
        let (params, grads) = (&state.params, &mut state.grads);
        let input = &ws.inputs[slot];
        let scale = 1.0 / (hd as f32).sqrt();
        be.fill(ws.dk.at_mut(0, steps * t * kd), 0.0)?;
        be.fill(ws.dv.at_mut(0, steps * t * kd), 0.0)?;
        for k in (0..steps).rev() {
            let (kth, kt) = (k * th, k * t);
            // A weight gradient is overwritten by the first step processed and accumulated after.
            let beta = if k + 1 == steps { 0.0 } else { 1.0 };
            // dh = d h_{k+1}: the final norm's share, added to what step k + 1 sent back (none for the last).
            be.rmsnorm_backward_input(
                ws.xs.at(kth + th, th),
                params.at(at.norm, h),
                ws.final_inv_rms.at(kt, t),
                ws.dz.at(kth, th),
                ws.dh.at_mut(0, th),
                k + 1 < steps,
            )?;
            // MLP: h_{k+1} = m + act·Wdᵀ.
            let dh = Operand::new(ws.dh.at(0, th), t, h);
            be.gemm(
                grads.at_mut(at.down_proj, h * i),
                dh.t(),
                Operand::new(ws.act.at(kt * i, t * i), t, i),
                1.0,
                beta,
                p,
            )?;
            be.gemm(
                ws.dact.at_mut(0, t * i),
                dh,
                Operand::new(params.at(at.down_proj, h * i), h, i),
                1.0,
                0.0,
                p,
            )?;
            be.swiglu_backward(
                ws.gate_up.at(kt * 2 * i, t * 2 * i),
                ws.dact.at(0, t * i),
                ws.dgate_up.at_mut(0, t * 2 * i),
                i,
            )?;
            let dgu = Operand::new(ws.dgate_up.at(0, t * 2 * i), t, 2 * i);
            be.gemm(
                grads.at_mut(at.gate_up, 2 * i * h),
                dgu.t(),
                Operand::new(ws.normed2.at(kth, th), t, h),
                1.0,
                beta,
                p,
            )?;
            be.gemm(
                ws.dnormed2.at_mut(kth, th),
                dgu,
                Operand::new(params.at(at.gate_up, 2 * i * h), 2 * i, h),
                1.0,
                0.0,
                p,
            )?;
            // dm = dh + post_attention_layernorm's input gradient.
            be.copy(ws.dmid.at_mut(0, th), ws.dh.at(0, th))?;
            be.rmsnorm_backward_input(
                ws.mid.at(kth, th),
                params.at(at.post_attention_layernorm, h),
                ws.inv_rms2.at(kt, t),
                ws.dnormed2.at(kth, th),
                ws.dmid.at_mut(0, th),
                true,
            )?;
            // Attention: m = h_k + a·Woᵀ.
            layers::linear_backward(
                be,
                (
                    Operand::new(ws.dmid.at(0, th), t, h).into(),
                    Operand::new(ws.attn.at(kt * qd, t * qd), t, qd).into(),
                    Operand::new(params.at(at.o_proj, h * qd), h, qd).into(),
                ),
                (grads.at_mut(at.o_proj, h * qd), beta),
                (ws.dattn.at_mut(0, t * qd), 0.0),
                p,
            )?;
            be.eagle3_attention_backward(
                UnrollSaved {
                    q: ws.q.at(kt * qd, t * qd),
                    k_all: ws.k.at(0, (k + 1) * t * kd),
                    v_all: ws.v.at(0, (k + 1) * t * kd),
                    out: ws.attn.at(kt * qd, t * qd),
                    lse: ws.lse.at(kt * heads, t * heads),
                },
                ws.dattn.at(0, t * qd),
                ws.attn_delta.at_mut(0, t * heads),
                (
                    ws.dq.at_mut(0, t * qd),
                    ws.dk.at_mut(0, (k + 1) * t * kd),
                    ws.dv.at_mut(0, (k + 1) * t * kd),
                ),
                UnrollAttention {
                    rows: t,
                    padded_len: len,
                    step: k,
                    heads,
                    kv_heads: kvh,
                    head_dim: hd,
                    scale,
                },
            )?;
            // Step k's keys are complete now (every later step added its share): undo RoPE, then the q/k/v
            // projections' backward over c = [input_layernorm(e) | hidden_norm(h_k)].
            be.step_positions(ws.positions.at_mut(0, t), len, k)?;
            let positions = ws.positions.at(0, t);
            be.rope(ws.dq.at_mut(0, t * qd), positions, theta, heads, hd, true)?;
            be.rope(
                ws.dk.at_mut(kt * kd, t * kd),
                positions,
                theta,
                kvh,
                hd,
                true,
            )?;
            let cat = Operand::new(ws.cat.at(2 * kth, 2 * th), t, 2 * h);
            for (n, (grad, offset, width)) in [
                (ws.dq.at(0, t * qd), at.q_proj, qd),
                (ws.dk.at(kt * kd, t * kd), at.k_proj, kd),
                (ws.dv.at(kt * kd, t * kd), at.v_proj, kd),
            ]
            .into_iter()
            .enumerate()
            {
                layers::linear_backward(
                    be,
                    (
                        Operand::new(grad, t, width).into(),
                        cat.into(),
                        Operand::new(params.at(offset, width * 2 * h), width, 2 * h).into(),
                    ),
                    (grads.at_mut(offset, width * 2 * h), beta),
                    (ws.dcat.at_mut(0, 2 * th), if n == 0 { 0.0 } else { 1.0 }),
                    p,
                )?;
            }
            be.split_columns(
                ws.dcat.at(0, 2 * th),
                ws.d_emb_normed.at_mut(kth, th),
                ws.d_h_normed.at_mut(kth, th),
                h,
                h,
            )?;
            // d h_k = dm (the residual) + hidden_norm's input gradient: what step k − 1 adds its share to.
            be.copy(ws.dh.at_mut(0, th), ws.dmid.at(0, th))?;
            be.rmsnorm_backward_input(
                ws.xs.at(kth, th),
                params.at(at.hidden_norm, h),
                ws.h_inv_rms.at(kt, t),
                ws.d_h_normed.at(kth, th),
                ws.dh.at_mut(0, th),
                true,
            )?;
        }
        // The norms' weight gradients, each over the rows of every step at once.
        let kth = steps * th;
        for (x, inv, dy, offset) in [
            (
                ws.xs.at(th, kth),
                ws.final_inv_rms.at(0, steps * t),
                ws.dz.at(0, kth),
                at.norm,
            ),
            (
                ws.mid.at(0, kth),
                ws.inv_rms2.at(0, steps * t),
                ws.dnormed2.at(0, kth),
                at.post_attention_layernorm,
            ),
            (
                ws.xs.at(0, kth),
                ws.h_inv_rms.at(0, steps * t),
                ws.d_h_normed.at(0, kth),
                at.hidden_norm,
            ),
            (
                ws.emb.at(0, kth),
                ws.emb_inv_rms.at(0, steps * t),
                ws.d_emb_normed.at(0, kth),
                at.input_layernorm,
            ),
        ] {
            be.rmsnorm_weight_grad(
                x,
                inv,
                dy,
                grads.at_mut(offset, h),
                ws.norm_partials.all_mut(),
            )?;
        }
        // fc: h₀ = hs·fcᵀ (its input is data: the weight gradient only).
        be.gemm_hs(
            grads.at_mut(at.fc, h * d),
            Operand::new(ws.dh.at(0, th), t, h).t().into(),
            HsOperand::new(input.hs.at(0, t * d), t, d),
            1.0,
            0.0,
            p,
        )
    }
}
