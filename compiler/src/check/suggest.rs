//! "Did you mean" suggestions by edit distance.

/// The candidate closest to `word`, when it is close enough to be a plausible typo.
pub fn closest<'a>(word: &str, candidates: impl IntoIterator<Item = &'a str>) -> Option<&'a str> {
    let limit = (word.chars().count() / 3).max(1);
    candidates
        .into_iter()
        .map(|c| (edit_distance(word, c), c))
        .filter(|&(d, _)| d <= limit)
        .min_by_key(|&(d, _)| d)
        .map(|(_, c)| c)
}

/// `", did you mean `X`?"`-style help text, or a list of the valid words when none is close.
pub(crate) fn help(word: &str, what: &str, candidates: &[&str]) -> String {
    match closest(word, candidates.iter().copied()) {
        Some(best) => format!("did you mean `{best}`?"),
        None => format!(
            "{what}: {}",
            candidates
                .iter()
                .map(|c| format!("`{c}`"))
                .collect::<Vec<_>>()
                .join(", ")
        ),
    }
}

/// Levenshtein distance over `char`s.
fn edit_distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut row: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut diagonal = row[0];
        row[0] = i + 1;
        for (j, &cb) in b.iter().enumerate() {
            let substitution = diagonal + usize::from(ca != cb);
            diagonal = row[j + 1];
            row[j + 1] = substitution.min(row[j] + 1).min(row[j + 1] + 1);
        }
    }
    row[b.len()]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn distance_matches_known_values() {
        assert_eq!(edit_distance("kitten", "sitting"), 3);
        assert_eq!(edit_distance("", "abc"), 3);
        assert_eq!(edit_distance("capcity", "capacity"), 1);
    }

    #[test]
    fn suggests_only_close_words() {
        assert_eq!(
            closest("capcity", ["capacity", "min_ready"]),
            Some("capacity")
        );
        assert_eq!(closest("zzz", ["capacity", "min_ready"]), None);
    }
}
