//! The target section's loss-mask settings (`end_of_turn`, `max_bad_mask_share`), checked on their own: the
//! runtime's sources count bad masks with them (`plan::MaskChecks`).

use crate::check::fields::Fields;
use crate::check::values;
use crate::diagnostic::Diagnostic;
use crate::plan::{DEFAULT_MAX_BAD_MASK_SHARE, MaskChecks};

/// The section's mask settings: `None` when one had errors (already in `errs`). `vocab` is the section's
/// vocabulary when it is valid; the end-of-turn token must lie in it.
pub(crate) fn check_masks(
    f: &mut Fields<'_>,
    errs: &mut Vec<Diagnostic>,
    vocab: Option<usize>,
) -> Option<MaskChecks> {
    let end_of_turn = f.optional("end_of_turn").map(|v| {
        let id = values::count(errs, "end_of_turn", v, 0)?;
        match vocab {
            Some(vocab) if id >= vocab => {
                errs.push(
                    Diagnostic::error(
                        v.span,
                        format!(
                            "`end_of_turn` must be a token of the vocabulary (below `vocab` = {vocab}), \
                             found {id}"
                        ),
                    )
                    .label("not a token id")
                    .help("write the tokenizer's end-of-turn id, e.g. `end_of_turn = 151645` (<|im_end|>)"),
                );
                None
            }
            _ => u32::try_from(id).ok(),
        }
    });
    let max_bad_share = f.optional("max_bad_mask_share").map(|v| {
        values::real_where(
            errs,
            "max_bad_mask_share",
            v,
            ("must be a share between 0 and 1", "0.01"),
            |x| (0.0..=1.0).contains(&x),
        )
    });
    Some(MaskChecks {
        end_of_turn: match end_of_turn {
            Some(id) => Some(id?),
            None => None,
        },
        max_bad_share: match max_bad_share {
            Some(share) => share?,
            None => DEFAULT_MAX_BAD_MASK_SHARE,
        },
    })
}
