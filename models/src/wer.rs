//! Word error rate: how far a transcript is from a reference, for tests, benchmarks and the
//! health check a new Whisper version passes before it serves jobs.

/// Lower-cased words with punctuation dropped (apostrophes inside words kept) and titles spelled
/// out as Whisper's English normaliser does (references say "mister" where Whisper writes "Mr.").
pub fn words(text: &str) -> Vec<String> {
    text.to_lowercase()
        .chars()
        .map(|c| if c.is_alphanumeric() || c == '\'' { c } else { ' ' })
        .collect::<String>()
        .split_whitespace()
        .map(|w| w.trim_matches('\''))
        .filter(|w| !w.is_empty())
        .map(|w| match w {
            "mr" => "mister",
            "mrs" => "missus",
            "dr" => "doctor",
            w => w,
        })
        .map(str::to_string)
        .collect()
}

/// Word-level edit distance: substitutions + insertions + deletions.
pub fn word_errors(reference: &[String], hypothesis: &[String]) -> usize {
    let mut prev: Vec<usize> = (0..=hypothesis.len()).collect();
    for (i, r) in reference.iter().enumerate() {
        let mut cur = vec![i + 1];
        for (j, h) in hypothesis.iter().enumerate() {
            cur.push((prev[j] + usize::from(r != h)).min(prev[j + 1] + 1).min(cur[j] + 1));
        }
        prev = cur;
    }
    prev[hypothesis.len()]
}

/// Word errors over reference words (0 is exact; can exceed 1 when the hypothesis rambles).
pub fn word_error_rate(reference: &str, hypothesis: &str) -> f64 {
    let reference = words(reference);
    word_errors(&reference, &words(hypothesis)) as f64 / reference.len().max(1) as f64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_substitutions_insertions_and_deletions_ignoring_case_and_punctuation() {
        assert_eq!(word_error_rate("He was not an ill-disposed young man.", "he was not an ill disposed young man"), 0.0);
        assert_eq!(word_error_rate("a b c d", "a x c"), 0.5);
        assert_eq!(word_error_rate("a b", "a b c d"), 1.0);
        assert_eq!(words("Mr. Dashwood's 'estate'"), ["mister", "dashwood's", "estate"]);
    }
}
