//! Typed reading of values: each function accepts one kind of value, and on anything else records an error
//! that says what was expected and what was found (and returns `None`, so checking goes on).

use crate::ast::{Call, Value, ValueKind};
use crate::check::suggest;
use crate::diagnostic::Diagnostic;

type Errs = Vec<Diagnostic>;

/// Byte multipliers of the size units.
const SIZE_UNITS: [(&str, u64); 5] = [
    ("B", 1),
    ("KiB", 1 << 10),
    ("MiB", 1 << 20),
    ("GiB", 1 << 30),
    ("TiB", 1 << 40),
];
/// Millisecond multipliers of the duration units.
const DURATION_UNITS: [(&str, f64); 3] = [("ms", 1.0), ("s", 1e3), ("m", 60e3)];

/// "an integer", "a size", ...: how an error names what it found.
fn describe(kind: &ValueKind) -> &'static str {
    match kind {
        ValueKind::Integer(_) => "an integer",
        ValueKind::Float(_) => "a float",
        ValueKind::Quantity { unit, .. } if SIZE_UNITS.iter().any(|(u, _)| *u == unit.name) => {
            "a size"
        }
        ValueKind::Quantity { unit, .. } if DURATION_UNITS.iter().any(|(u, _)| *u == unit.name) => {
            "a duration"
        }
        ValueKind::Quantity { .. } => "a number with a unit",
        ValueKind::Str(_) => "a string",
        ValueKind::Range(..) => "a range",
        ValueKind::List(_) => "a list",
        ValueKind::Tuple(_) => "a tuple",
        ValueKind::Call(_) => "a call",
        ValueKind::Env(_) => "an environment variable",
        ValueKind::Ident(_) => "a name",
        ValueKind::Invalid => "an invalid literal",
    }
}

/// Records "`key` expects X, found Y" unless the value was already reported by the parser.
fn mismatch(errs: &mut Errs, key: &str, value: &Value, expected: &str, example: &str) {
    if value.kind != ValueKind::Invalid {
        errs.push(
            Diagnostic::error(
                value.span,
                format!(
                    "`{key}` expects {expected}, found {}",
                    describe(&value.kind)
                ),
            )
            .label(format!("expected {expected}"))
            .help(format!("for example `{key} = {example}`")),
        );
    }
}

/// Records that `value` is out of range: `"`{key}` {rule}, found {found}"`, with a help line.
pub(crate) fn out_of_range(
    errs: &mut Errs,
    key: &str,
    value: &Value,
    rule: &str,
    found: impl std::fmt::Display,
    help: &str,
) {
    errs.push(
        Diagnostic::error(value.span, format!("`{key}` {rule}, found {found}"))
            .label("out of range")
            .help(help),
    );
}

/// An integer literal.
pub(crate) fn integer(errs: &mut Errs, key: &str, value: &Value) -> Option<i64> {
    match value.kind {
        ValueKind::Integer(i) => Some(i),
        _ => {
            mismatch(errs, key, value, "an integer", "16");
            None
        }
    }
}

/// An integer that is at least `min` (counts, sizes in elements, ordinals).
pub(crate) fn count(errs: &mut Errs, key: &str, value: &Value, min: u64) -> Option<usize> {
    let i = integer(errs, key, value)?;
    match usize::try_from(i) {
        Ok(n) if n as u64 >= min => Some(n),
        _ => {
            out_of_range(
                errs,
                key,
                value,
                &format!("must be at least {min}"),
                i,
                &format!("use an integer >= {min}"),
            );
            None
        }
    }
}

/// Largest accepted model or batch dimension: beyond any real model, and it keeps the cost model's products
/// inside 128 bits.
pub(crate) const MAX_DIM: u64 = 1 << 32;
/// Largest accepted count of blocks, heads or tapped layers (each becomes a list entry or a named tensor).
pub(crate) const MAX_REPEATS: u64 = 1024;
/// Largest accepted queue capacity (the HS pool holds this many items).
pub(crate) const MAX_CAPACITY: u64 = 1 << 20;

/// An integer in `min..=max`.
pub(crate) fn count_in(
    errs: &mut Errs,
    key: &str,
    value: &Value,
    min: u64,
    max: u64,
) -> Option<usize> {
    let n = count(errs, key, value, min)?;
    if n as u64 > max {
        out_of_range(
            errs,
            key,
            value,
            &format!("must be at most {max}"),
            n,
            &format!("use an integer <= {max}"),
        );
        return None;
    }
    Some(n)
}

/// A real number (integer or float literal).
pub(crate) fn real(errs: &mut Errs, key: &str, value: &Value) -> Option<f64> {
    match value.kind {
        ValueKind::Integer(i) => Some(i as f64),
        ValueKind::Float(x) => Some(x),
        _ => {
            mismatch(errs, key, value, "a number", "0.5");
            None
        }
    }
}

/// A real number `x` with `ok(x)`; `rule` says what `ok` means ("must be positive"), `example` is a valid
/// value for the help line.
pub(crate) fn real_where(
    errs: &mut Errs,
    key: &str,
    value: &Value,
    (rule, example): (&str, &str),
    ok: impl Fn(f64) -> bool,
) -> Option<f64> {
    let x = real(errs, key, value)?;
    if ok(x) {
        Some(x)
    } else {
        out_of_range(
            errs,
            key,
            value,
            rule,
            x,
            &format!("for example `{key} = {example}`"),
        );
        None
    }
}

/// A size such as `141GiB`, in bytes.
pub(crate) fn size_bytes(errs: &mut Errs, key: &str, value: &Value) -> Option<u64> {
    let ValueKind::Quantity { amount, unit } = &value.kind else {
        mismatch(errs, key, value, "a size", "80GiB");
        return None;
    };
    let Some((_, scale)) = SIZE_UNITS.iter().find(|(u, _)| *u == unit.name) else {
        errs.push(
            Diagnostic::error(
                unit.span,
                format!("`{key}` expects a size unit, found `{}`", unit.name),
            )
            .label("not a size unit")
            .help("size units are binary: B, KiB, MiB, GiB, TiB (1GiB = 2^30 bytes)"),
        );
        return None;
    };
    let bytes = amount * *scale as f64;
    if *amount > 0.0 && bytes < u64::MAX as f64 {
        Some(bytes.round() as u64)
    } else {
        out_of_range(
            errs,
            key,
            value,
            "must be a positive size",
            format!("{amount}{}", unit.name),
            "for example `80GiB`",
        );
        None
    }
}

/// A duration such as `1s` or `250ms`, in whole milliseconds (at least 1).
pub(crate) fn duration_ms(errs: &mut Errs, key: &str, value: &Value) -> Option<u64> {
    let ValueKind::Quantity { amount, unit } = &value.kind else {
        mismatch(errs, key, value, "a duration", "1s");
        return None;
    };
    let Some((_, scale)) = DURATION_UNITS.iter().find(|(u, _)| *u == unit.name) else {
        let units: Vec<&str> = DURATION_UNITS.iter().map(|(u, _)| *u).collect();
        errs.push(
            Diagnostic::error(
                unit.span,
                format!("`{key}` expects a duration unit, found `{}`", unit.name),
            )
            .label("not a duration unit")
            .help(suggest::help(&unit.name, "duration units are", &units)),
        );
        return None;
    };
    let ms = (amount * scale).round();
    if (1.0..1e15).contains(&ms) {
        Some(ms as u64)
    } else {
        let found = format!("{amount}{}", unit.name);
        out_of_range(
            errs,
            key,
            value,
            "must be at least 1ms",
            found,
            "for example `500ms` or `1s`",
        );
        None
    }
}

/// A string literal.
pub(crate) fn string<'v>(errs: &mut Errs, key: &str, value: &'v Value) -> Option<&'v str> {
    match &value.kind {
        ValueKind::Str(s) => Some(s),
        _ => {
            mismatch(errs, key, value, "a string", "\"path\"");
            None
        }
    }
}

/// A non-empty string literal.
pub(crate) fn nonempty_string<'v>(errs: &mut Errs, key: &str, value: &'v Value) -> Option<&'v str> {
    let s = string(errs, key, value)?;
    if s.is_empty() {
        out_of_range(
            errs,
            key,
            value,
            "must not be empty",
            "\"\"",
            "write a non-empty string",
        );
        return None;
    }
    Some(s)
}

/// A half-open integer range `start..end`.
pub(crate) fn int_range(errs: &mut Errs, key: &str, value: &Value) -> Option<(i64, i64)> {
    let ValueKind::Range(start, end) = &value.kind else {
        mismatch(errs, key, value, "a range", "64..512");
        return None;
    };
    let start = integer(errs, key, start);
    let end = integer(errs, key, end);
    Some((start?, end?))
}

/// A list literal's elements.
pub(crate) fn list<'v>(errs: &mut Errs, key: &str, value: &'v Value) -> Option<&'v [Value]> {
    match &value.kind {
        ValueKind::List(items) => Some(items),
        _ => {
            mismatch(errs, key, value, "a list", "[1, 2]");
            None
        }
    }
}

/// A tuple literal with exactly `n` elements.
pub(crate) fn tuple<'v>(
    errs: &mut Errs,
    key: &str,
    value: &'v Value,
    n: usize,
    example: &str,
) -> Option<&'v [Value]> {
    match &value.kind {
        ValueKind::Tuple(items) if items.len() == n => Some(items),
        ValueKind::Tuple(items) => {
            errs.push(
                Diagnostic::error(
                    value.span,
                    format!("`{key}` expects {n} elements, found {}", items.len()),
                )
                .label(format!("expected {n} elements"))
                .help(format!("for example `{key} = {example}`")),
            );
            None
        }
        _ => {
            mismatch(errs, key, value, "a tuple", example);
            None
        }
    }
}

/// A bare name out of `options`, mapped to its meaning.
pub(crate) fn choice<T: Copy>(
    errs: &mut Errs,
    key: &str,
    value: &Value,
    options: &[(&str, T)],
) -> Option<T> {
    let names: Vec<&str> = options.iter().map(|(n, _)| *n).collect();
    let ValueKind::Ident(name) = &value.kind else {
        mismatch(
            errs,
            key,
            value,
            &format!("one of {}", names.join(", ")),
            names[0],
        );
        return None;
    };
    match options.iter().find(|(n, _)| n == name) {
        Some((_, meaning)) => Some(*meaning),
        None => {
            errs.push(
                Diagnostic::error(value.span, format!("unknown `{key}` value `{name}`"))
                    .label("not an option")
                    .help(suggest::help(name, "the options are", &names)),
            );
            None
        }
    }
}

/// A call to one of the functions in `names`.
pub(crate) fn call<'v>(
    errs: &mut Errs,
    key: &str,
    value: &'v Value,
    names: &[&str],
    example: &str,
) -> Option<&'v Call> {
    let ValueKind::Call(call) = &value.kind else {
        mismatch(errs, key, value, "a call", example);
        return None;
    };
    if names.contains(&call.name.name.as_str()) {
        return Some(call);
    }
    errs.push(
        Diagnostic::error(
            call.name.span,
            format!("unknown `{key}` kind `{}`", call.name.name),
        )
        .label("unknown here")
        .help(suggest::help(&call.name.name, "the kinds are", names)),
    );
    None
}
