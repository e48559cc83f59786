//! How every figure a command prints is written: the run's status line, `diagnose`, `simulate` and the errors
//! that quote a value found in a file or on the command line all go through these two functions, so a rate
//! or a duration reads the same everywhere and no value, however corrupt, prints as a 300-digit number.
//!
//! ```text
//!  f64 ──▶ amount:  1234567 → "1.23M"   117684 → "118k"   57.26 → "57.3"   2.5 → "2.5"   1e-300 → "1e-300"
//!     └──▶ seconds: 0.0042 → "4.2 ms"   3.25 → "3.25 s"   86400 → "24 h"   1e308 → "1.16e303 days"
//! ```
//!
//! Three significant digits with the zeros a fixed precision pads with dropped, an SI prefix (k, M, G, T, P, E)
//! from a thousand up, and the exponent form below a thousandth and from 10^21; infinities read "unbounded"
//! (what an infinitely fast side of the simulation has), NaN "not a number".

/// A count or rate without its unit: three significant digits, an SI prefix from a thousand up (see the
/// module docs). The unit follows it: `format!("{} slots/s", amount(rate))`.
pub fn amount(value: f64) -> String {
    if value.is_nan() {
        return "not a number".into();
    }
    if value < 0.0 {
        return format!("-{}", amount(-value));
    }
    if value.is_infinite() {
        return "unbounded".into();
    }
    // The exponent form rounds to three significant digits; the prefix and the decimals follow from it.
    let exponent_form = format!("{value:.2e}");
    let (mantissa, exponent) = exponent_form
        .split_once('e')
        .and_then(|(m, e)| Some((m.parse::<f64>().ok()?, e.parse::<i32>().ok()?)))
        .unwrap_or((value, 0));
    if !(-3..21).contains(&exponent) {
        return format!(
            "{}e{exponent}",
            without_trailing_zeros(&format!("{mantissa:.2}"))
        );
    }
    let group = exponent.max(0) / 3;
    let prefix = ["", "k", "M", "G", "T", "P", "E"][group as usize];
    let digits_before_point = exponent - 3 * group;
    let shifted = mantissa * 10f64.powi(digits_before_point);
    let decimals = (2 - digits_before_point).max(0) as usize;
    format!(
        "{}{prefix}",
        without_trailing_zeros(&format!("{shifted:.decimals$}"))
    )
}

/// `2.50` → `2.5`, `3.00` → `3`: the digits a fixed precision pads with say nothing.
fn without_trailing_zeros(text: &str) -> String {
    if text.contains('.') {
        text.trim_end_matches('0').trim_end_matches('.').to_string()
    } else {
        text.to_string()
    }
}

/// A duration with its unit, chosen so the number stays short: ns, µs, ms, s, h (from 10,000 s), days (from a
/// million seconds), each written by [`amount`] (whole seconds from 1,000 to 10,000 s, never `3.6k s`).
pub fn seconds(value: f64) -> String {
    let magnitude = value.abs();
    let (scaled, unit) = match magnitude {
        m if !m.is_finite() || m == 0.0 => (value, "s"),
        m if m >= 1e6 => (value / 86_400.0, "days"),
        m if m >= 1e4 => (value / 3600.0, "h"),
        // Up to 10,000 s the seconds are four digits at most: "3600 s" reads better than "3.6k s".
        m if m >= 1e3 => return format!("{value:.0} s"),
        m if m >= 1.0 => (value, "s"),
        m if m >= 1e-3 => (value * 1e3, "ms"),
        m if m >= 1e-6 => (value * 1e6, "µs"),
        m if m >= 1e-9 => (value * 1e9, "ns"),
        _ => (value, "s"),
    };
    format!("{} {unit}", amount(scaled))
}
