//! Checks of a decoder layer's attention arguments, shared by the families that have one (`dflash`, ...):
//! grouped-query heads, an even RoPE head width, a positive RoPE base.

use crate::ast::Value;
use crate::check::fields::Fields;
use crate::check::values::{self, out_of_range};
use crate::diagnostic::Diagnostic;
use crate::family::interface::Errs;

/// Largest `head_dim`: the attention kernels keep a head in a warp's registers, four elements per lane
/// (`draftpipe_gpu_kernels::plane::MAX_ROW`), and the backends reject longer heads.
pub(crate) const MAX_HEAD_DIM: u64 = 128;

/// A count and the value it was read from.
pub(crate) type Counted<'a> = Option<(usize, &'a Value)>;

/// `heads` is a multiple of `kv_heads` (grouped-query attention) and `head_dim` is even (RoPE rotates pairs);
/// records what is not and says whether both hold (arguments already wrong are not checked again).
pub(crate) fn check_heads(
    errs: &mut Errs,
    heads: Counted<'_>,
    kv_heads: Counted<'_>,
    head_dim: Counted<'_>,
) -> bool {
    let mut ok = true;
    if let (Some((heads, _)), Some((kv_heads, kv_value))) = (heads, kv_heads)
        && heads % kv_heads != 0
    {
        errs.push(
            Diagnostic::error(
                kv_value.span,
                format!("`heads` ({heads}) is not a multiple of `kv_heads` ({kv_heads})"),
            )
            .label("does not divide `heads`")
            .help("grouped-query attention shares each key/value head by `heads / kv_heads` query heads: pick a divisor of `heads`"),
        );
        ok = false;
    }
    if let Some((head_dim, value)) = head_dim
        && head_dim % 2 != 0
    {
        out_of_range(
            errs,
            "head_dim",
            value,
            "must be even (RoPE rotates pairs of dimensions)",
            head_dim,
            "for example `head_dim = 128`",
        );
        ok = false;
    }
    ok
}

/// The required `rope_theta`: a positive base that is finite in f32.
pub(crate) fn rope_theta(errs: &mut Errs, f: &mut Fields<'_>) -> Option<f32> {
    f.required("rope_theta", "1000000").and_then(|v| {
        values::real_where(
            errs,
            "rope_theta",
            v,
            ("must be positive", "1000000"),
            |x| x > 0.0 && x.is_finite() && (x as f32).is_finite() && (x as f32) > 0.0,
        )
        .map(|x| x as f32)
    })
}
