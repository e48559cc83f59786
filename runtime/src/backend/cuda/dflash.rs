//! The CUDA backend's launches of the DFlash kernels (embedding gather, RoPE, the weighted loss, attention),
//! kept beside the backend (`mod.rs`) so that file stays one idea: the trait methods there call these. Each checks the
//! views' sizes (a mismatch is a bug in the model: it panics, as the CPU backend does) and enqueues on the
//! compute stream through the generated [`Launcher`]; nothing syncs, so the calls can be captured in a graph.
//! The ranges inside the block plan are device data and are not checked here; the kernels clamp them to their
//! key sets, and the CPU backend checks them (the same plan runs through both in the tests).

use super::{CudaBackend, Launcher, ptr, ptr_mut};
use crate::backend::attention::{AttentionSizes, check_backward_lens};
use crate::backend::{
    AttentionGrads, AttentionInputs, AttentionSaved, AttentionShape, BackendResult, Dst, Src,
};

pub(super) fn embedding_gather(
    kernels: &Launcher,
    table: Src<'_, CudaBackend, f32>,
    ids: Src<'_, CudaBackend, u32>,
    out: Dst<'_, CudaBackend, f32>,
) -> BackendResult {
    let (rows, n) = (ids.len(), out.len());
    assert!(
        rows > 0 && n.is_multiple_of(rows),
        "embedding_gather: sizes"
    );
    let hidden = n / rows;
    assert!(
        hidden > 0 && table.len().is_multiple_of(hidden),
        "embedding_gather: table sizes"
    );
    kernels.embedding_gather(
        ptr(table),
        ptr(ids),
        ptr_mut(out),
        table.len() / hidden,
        hidden,
        n,
    )?;
    Ok(())
}

pub(super) fn rope(
    kernels: &Launcher,
    x: Dst<'_, CudaBackend, f32>,
    positions: Src<'_, CudaBackend, u32>,
    theta: f32,
    heads: usize,
    head_dim: usize,
    inverse: bool,
) -> BackendResult {
    let rows = positions.len();
    assert!(
        x.len() == rows * heads * head_dim && head_dim.is_multiple_of(2) && theta > 0.0,
        "rope: sizes"
    );
    kernels.rope(
        ptr(positions),
        ptr_mut(x),
        rows,
        heads,
        head_dim,
        theta,
        u32::from(inverse),
    )?;
    Ok(())
}

#[allow(clippy::too_many_arguments)]
pub(super) fn weighted_vocab_loss(
    kernels: &Launcher,
    logits: Dst<'_, CudaBackend, f32>,
    labels: Src<'_, CudaBackend, i32>,
    weights: Src<'_, CudaBackend, f32>,
    norm: Src<'_, CudaBackend, f32>,
    row_loss: Dst<'_, CudaBackend, f32>,
    correct: Dst<'_, CudaBackend, f32>,
    vocab: usize,
) -> BackendResult {
    let rows = labels.len();
    assert!(
        vocab > 0
            && logits.len() == rows * vocab
            && weights.len() == rows
            && norm.len() == 1
            && row_loss.len() == rows
            && correct.len() == rows,
        "weighted_vocab_loss: sizes"
    );
    kernels.weighted_vocab_loss_row(
        ptr(labels),
        ptr(weights),
        ptr(norm),
        ptr_mut(logits),
        ptr_mut(row_loss),
        ptr_mut(correct),
        vocab,
        rows,
    )?;
    Ok(())
}

pub(super) fn attention_forward(
    kernels: &Launcher,
    inputs: AttentionInputs<'_, CudaBackend>,
    shape: AttentionShape,
    out: Dst<'_, CudaBackend, f32>,
    lse: Dst<'_, CudaBackend, f32>,
) -> BackendResult {
    let AttentionSizes { queries, context } = shape.sizes(inputs.lens());
    assert!(
        out.len() == inputs.q.len() && lse.len() == queries * shape.heads,
        "attention_forward: output sizes"
    );
    kernels.attention_forward(
        ptr(inputs.q),
        ptr(inputs.k_ctx),
        ptr(inputs.v_ctx),
        ptr(inputs.k_blk),
        ptr(inputs.v_blk),
        ptr(inputs.query_ranges),
        ptr_mut(out),
        ptr_mut(lse),
        queries,
        context,
        shape.heads,
        shape.kv_heads,
        shape.head_dim,
        shape.scale,
    )?;
    Ok(())
}

pub(super) fn attention_backward(
    kernels: &Launcher,
    inputs: AttentionInputs<'_, CudaBackend>,
    shape: AttentionShape,
    saved: AttentionSaved<'_, CudaBackend>,
    delta: Dst<'_, CudaBackend, f32>,
    grads: AttentionGrads<'_, CudaBackend>,
) -> BackendResult {
    let sizes = shape.sizes(inputs.lens());
    check_backward_lens(
        &shape,
        sizes,
        [
            saved.out.len(),
            saved.dout.len(),
            saved.lse.len(),
            saved.key_ranges_ctx.len(),
            saved.key_ranges_blk.len(),
        ],
        delta.len(),
        [
            grads.dq.len(),
            grads.dk_ctx.len(),
            grads.dv_ctx.len(),
            grads.dk_blk.len(),
            grads.dv_blk.len(),
        ],
    );
    let AttentionSizes { queries, context } = sizes;
    let AttentionShape {
        heads,
        kv_heads,
        head_dim,
        scale,
    } = shape;
    let delta = ptr_mut(delta);
    kernels.attention_delta(
        ptr(saved.out),
        ptr(saved.dout),
        delta,
        head_dim,
        queries * heads,
    )?;
    kernels.attention_backward_q(
        ptr(inputs.q),
        ptr(inputs.k_ctx),
        ptr(inputs.v_ctx),
        ptr(inputs.k_blk),
        ptr(inputs.v_blk),
        ptr(inputs.query_ranges),
        ptr(saved.dout),
        ptr(saved.lse),
        delta,
        ptr_mut(grads.dq),
        queries,
        context,
        heads,
        kv_heads,
        head_dim,
        scale,
    )?;
    for (keys, k, v, ranges, dk, dv) in [
        (
            context,
            inputs.k_ctx,
            inputs.v_ctx,
            saved.key_ranges_ctx,
            grads.dk_ctx,
            grads.dv_ctx,
        ),
        (
            queries,
            inputs.k_blk,
            inputs.v_blk,
            saved.key_ranges_blk,
            grads.dk_blk,
            grads.dv_blk,
        ),
    ] {
        kernels.attention_backward_kv(
            ptr(inputs.q),
            ptr(saved.dout),
            ptr(saved.lse),
            delta,
            ptr(k),
            ptr(v),
            ptr(ranges),
            ptr_mut(dk),
            ptr_mut(dv),
            keys,
            queries,
            heads,
            kv_heads,
            head_dim,
            scale,
        )?;
    }
    Ok(())
}
