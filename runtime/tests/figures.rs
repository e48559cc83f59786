//! The one rule for printed figures (`draftpipe_runtime::figures`): three significant digits, SI prefixes, a
//! unit that keeps the number short, and no value, however corrupt, longer than a few characters.

use draftpipe_runtime::figures::{amount, seconds};

#[test]
fn amounts_keep_three_significant_digits_and_a_prefix() {
    for (value, expected) in [
        (0.0, "0"),
        (2.5, "2.5"),
        (50.0, "50"),
        (57.26, "57.3"),
        (999.4, "999"),
        (999.7, "1k"),
        (1600.0, "1.6k"),
        (1620.0, "1.62k"),
        (117_684.0, "118k"),
        (89_202.0, "89.2k"),
        (1.234e6, "1.23M"),
        (3e9, "3G"),
        (1e308, "1e308"),
        (1e-300, "1e-300"),
        (0.25, "0.25"),
        (0.001234, "0.00123"),
        (-3.0, "-3"),
        (f64::INFINITY, "unbounded"),
        (f64::NAN, "not a number"),
    ] {
        assert_eq!(amount(value), expected, "{value}");
    }
}

#[test]
fn durations_pick_a_unit_that_keeps_the_number_short() {
    for (value, expected) in [
        (0.0, "0 s"),
        (0.0042, "4.2 ms"),
        (4.2e-7, "420 ns"),
        (3.25, "3.25 s"),
        (3600.0, "3600 s"),
        (86_400.0, "24 h"),
        (1e308, "1.16e303 days"),
        (1e-300, "1e-300 s"),
    ] {
        assert_eq!(seconds(value), expected, "{value}");
    }
}
