//! Word timestamps, as OpenAI's `timing.py` finds them: the decoder reads the window's text
//! tokens again while the cross-attention weights of its alignment heads are kept; those
//! weights, normalised per frame and median-filtered, are aligned to the tokens by dynamic time
//! warping, and a word starts where the path reaches its first token.
//!
//! This module holds the steps after the decoder pass (filtering, alignment, splitting tokens
//! into words, OpenAI's duration and punctuation rules); `Whisper` runs the pass.

/// Seconds per encoder position (two 10 ms mel frames).
pub(crate) const SECONDS_PER_POSITION: f64 = 0.02;
/// Width of the median filter over frames (OpenAI's `medfilt_width`).
const MEDIAN_WIDTH: usize = 7;
/// Punctuation that joins the word after it (OpenAI's `prepend_punctuations`).
const PREPENDED: &str = "\"'“¿([{-";
/// Punctuation that joins the word before it (OpenAI's `append_punctuations`).
const APPENDED: &str = "\"'.。,，!！?？:：”)]}、";
const SENTENCE_ENDS: &str = ".。!！?？";

/// A word of a segment with its time, in seconds from the start of the audio.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Word {
    /// The word as the transcript writes it, with its leading space and attached punctuation.
    pub word: String,
    pub start: f64,
    pub end: f64,
    /// The mean probability the decoder gave the word's tokens.
    pub probability: f64,
}

/// A word found in a window, before it is placed in its segment: times are from the window's
/// start.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct WordTiming {
    pub word: String,
    pub tokens: usize,
    pub start: f64,
    pub end: f64,
    pub probability: f64,
}

/// Cross-attention weights of the alignment heads for one window: `heads[h][token][frame]`,
/// the raw (scaled) query-key products over the window's own frames, for every token fed:
/// the SOT sequence, `<|notimestamps|>`, the text tokens and EOT.
pub(crate) struct Attention {
    pub heads: Vec<Vec<Vec<f32>>>,
}

impl Attention {
    /// The alignment cost matrix, `(text tokens + 1) x frames`: per head, a softmax over
    /// frames, then each frame standardised over the tokens and median-filtered along the
    /// frames; the mean over heads, from the token after the SOT sequence (which predicts the
    /// first text token) to the one before EOT.
    pub fn matrix(&self, sot_len: usize) -> Vec<Vec<f32>> {
        let Some(first) = self.heads.first() else { return Vec::new() };
        let (tokens, frames) = (first.len(), first.first().map_or(0, Vec::len));
        let mut mean = vec![vec![0f32; frames]; tokens];
        for head in &self.heads {
            let mut w: Vec<Vec<f32>> = head.iter().map(|row| softmax(row)).collect();
            for f in 0..frames {
                let n = tokens as f32;
                let m = w.iter().map(|r| r[f]).sum::<f32>() / n;
                let var = w.iter().map(|r| (r[f] - m) * (r[f] - m)).sum::<f32>() / n;
                let sd = var.sqrt();
                for r in w.iter_mut() {
                    r[f] = (r[f] - m) / sd;
                }
            }
            for (acc, row) in mean.iter_mut().zip(&w) {
                for (a, v) in acc.iter_mut().zip(median_filter(row, MEDIAN_WIDTH)) {
                    *a += v / self.heads.len() as f32;
                }
            }
        }
        mean.into_iter().skip(sot_len).take(tokens.saturating_sub(sot_len + 1)).collect()
    }
}

fn softmax(row: &[f32]) -> Vec<f32> {
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let e: Vec<f32> = row.iter().map(|&x| (x - max).exp()).collect();
    let sum: f32 = e.iter().sum();
    e.into_iter().map(|x| x / sum).collect()
}

/// Median over a sliding window of `width` (odd), the ends padded by reflection, as OpenAI's
/// `median_filter`; rows no longer than half the width are returned as they are.
pub(crate) fn median_filter(row: &[f32], width: usize) -> Vec<f32> {
    let pad = width / 2;
    let n = row.len();
    if n <= pad {
        return row.to_vec();
    }
    // Reflect without repeating the edge: index -1 is row[1].
    let at = |i: isize| -> f32 {
        let i = if i < 0 { -i } else if i >= n as isize { 2 * (n as isize - 1) - i } else { i };
        row[i as usize]
    };
    let mut window = vec![0f32; width];
    (0..n as isize)
        .map(|i| {
            for (k, w) in window.iter_mut().enumerate() {
                *w = at(i + k as isize - pad as isize);
            }
            window.sort_by(f32::total_cmp);
            window[pad]
        })
        .collect()
}

/// The cheapest monotonic path through `cost` (`n x m`) from `(0, 0)` to `(n-1, m-1)`, as
/// OpenAI's `dtw_cpu` (ties go to the step along the frames): `(token, frame)` per step.
pub(crate) fn dtw(cost: &[Vec<f32>]) -> Vec<(usize, usize)> {
    let n = cost.len();
    let m = cost.first().map_or(0, Vec::len);
    if n == 0 || m == 0 {
        return Vec::new();
    }
    let mut acc = vec![vec![f32::INFINITY; m + 1]; n + 1];
    // 0: diagonal, 1: from the token above, 2: from the frame before.
    let mut trace = vec![vec![0u8; m + 1]; n + 1];
    acc[0][0] = 0.0;
    for j in 1..=m {
        for i in 1..=n {
            let (c0, c1, c2) = (acc[i - 1][j - 1], acc[i - 1][j], acc[i][j - 1]);
            let (c, t) = if c0 < c1 && c0 < c2 {
                (c0, 0)
            } else if c1 < c0 && c1 < c2 {
                (c1, 1)
            } else {
                (c2, 2)
            };
            acc[i][j] = cost[i - 1][j - 1] + c;
            trace[i][j] = t;
        }
    }
    for t in trace[0].iter_mut() {
        *t = 2;
    }
    for row in trace.iter_mut() {
        row[0] = 1;
    }
    let (mut i, mut j) = (n, m);
    let mut path = Vec::with_capacity(n + m);
    while i > 0 || j > 0 {
        path.push((i - 1, j - 1));
        match trace[i][j] {
            0 => {
                i -= 1;
                j -= 1;
            }
            1 => i -= 1,
            _ => j -= 1,
        }
    }
    path.reverse();
    path
}

/// Splits decoded pieces (one per token, as the tokenizer writes each alone) into words: a
/// piece that starts with a space, is punctuation or a special token starts a new word, and
/// pieces that are not whole characters on their own wait for the rest of their character.
/// `decode(tokens)` decodes a run of tokens. Returns each word's text and its token count.
pub(crate) fn split_words(tokens: &[u32], eot: u32, spaces: bool, decode: &dyn Fn(&[u32]) -> String) -> Vec<(String, usize)> {
    // Whole characters first (OpenAI's `split_tokens_on_unicode`).
    let full = decode(tokens);
    let full: Vec<char> = full.chars().collect();
    let mut pieces: Vec<(String, Vec<u32>)> = Vec::new();
    let (mut current, mut offset) = (Vec::new(), 0usize);
    for &t in tokens {
        current.push(t);
        let text = decode(&current);
        let broken = text.chars().position(|c| c == '\u{fffd}');
        if broken.is_none_or(|p| full.get(offset + p) == Some(&'\u{fffd}')) {
            offset += text.chars().count();
            pieces.push((text, std::mem::take(&mut current)));
        }
    }
    if !current.is_empty() {
        pieces.push((decode(&current), current));
    }
    if !spaces {
        return pieces.into_iter().map(|(w, t)| (w, t.len())).collect();
    }
    let mut words: Vec<(String, usize)> = Vec::new();
    for (piece, piece_tokens) in pieces {
        let special = piece_tokens[0] >= eot;
        let trimmed = piece.trim();
        let punctuation = !trimmed.is_empty() && trimmed.chars().all(|c| c.is_ascii_punctuation());
        if special || piece.starts_with(' ') || punctuation || words.is_empty() {
            words.push((piece, piece_tokens.len()));
        } else {
            let last = words.last_mut().expect("a word");
            last.0.push_str(&piece);
            last.1 += piece_tokens.len();
        }
    }
    words
}

/// Word times from the alignment path: `words` (with the EOT "word" last) over `path` of the
/// `(text tokens + 1) x frames` matrix; `probabilities[i]` is text token `i`'s. Times are from
/// the window's start.
pub(crate) fn timings(words: &[(String, usize)], path: &[(usize, usize)], probabilities: &[f64]) -> Vec<WordTiming> {
    if words.len() <= 1 {
        return Vec::new();
    }
    // The time at which the path first reaches each token.
    let mut jump_times = Vec::new();
    let mut last = None;
    for &(token, frame) in path {
        if last != Some(token) {
            jump_times.push(frame as f64 * SECONDS_PER_POSITION);
            last = Some(token);
        }
    }
    let mut out = Vec::new();
    let mut at = 0;
    for (word, count) in &words[..words.len() - 1] {
        let (from, to) = (at, at + count);
        at = to;
        let (Some(&start), Some(&end)) = (jump_times.get(from), jump_times.get(to)) else { break };
        let p = &probabilities[from.min(probabilities.len())..to.min(probabilities.len())];
        let probability = if p.is_empty() { 0.0 } else { p.iter().sum::<f64>() / p.len() as f64 };
        out.push(WordTiming { word: word.clone(), tokens: *count, start, end, probability });
    }
    out
}

/// OpenAI's rules on the raw timings: words at sentence ends are cut to twice the median word
/// length, then punctuation joins its word. Returns the median word duration (at most 0.7 s).
pub(crate) fn tidy(words: &mut [WordTiming]) -> f64 {
    let mut durations: Vec<f64> = words.iter().map(|w| w.end - w.start).filter(|&d| d != 0.0).collect();
    durations.sort_by(f64::total_cmp);
    let median = match durations.len() {
        0 => 0.0,
        n if n % 2 == 1 => durations[n / 2],
        n => (durations[n / 2 - 1] + durations[n / 2]) / 2.0,
    }
    .min(0.7);
    let max = median * 2.0;
    if !durations.is_empty() {
        for i in 1..words.len() {
            if words[i].end - words[i].start > max {
                if SENTENCE_ENDS.contains(words[i].word.as_str()) {
                    words[i].end = words[i].start + max;
                } else if SENTENCE_ENDS.contains(words[i - 1].word.as_str()) {
                    words[i].start = words[i].end - max;
                }
            }
        }
    }
    merge_punctuation(words);
    median
}

fn is_one_of(word: &str, set: &str) -> bool {
    !word.is_empty() && set.contains(word)
}

/// Prepended punctuation joins the word after it and appended punctuation the word before,
/// leaving empty words (with no tokens) behind, as OpenAI's `merge_punctuations`.
pub(crate) fn merge_punctuation(words: &mut [WordTiming]) {
    if words.len() < 2 {
        return;
    }
    let (mut i, mut j) = (words.len() as isize - 2, words.len() - 1);
    while i >= 0 {
        let p = i as usize;
        if words[p].word.starts_with(' ') && is_one_of(words[p].word.trim(), PREPENDED) {
            let (prev, next) = words.split_at_mut(j);
            let (prev, next) = (&mut prev[p], &mut next[0]);
            next.word = std::mem::take(&mut prev.word) + &next.word;
            next.tokens += std::mem::take(&mut prev.tokens);
        } else {
            j = p;
        }
        i -= 1;
    }
    let (mut i, mut j) = (0, 1);
    while j < words.len() {
        if !words[i].word.ends_with(' ') && is_one_of(&words[j].word, APPENDED) {
            let (prev, next) = words.split_at_mut(j);
            let (prev, next) = (&mut prev[i], &mut next[0]);
            prev.word.push_str(&std::mem::take(&mut next.word));
            prev.tokens += std::mem::take(&mut next.tokens);
        } else {
            i = j;
        }
        j += 1;
    }
}

/// Places a window's words (times from `offset`, the window's start) in its segments, given
/// each segment's number of text tokens, and applies OpenAI's rules at segment edges: a first
/// word after a pause, or a first or last word much longer than its segment says, is cut to
/// the segment's timestamp; otherwise the segment takes its words' times. `last_speech` is
/// where speech was last heard before the window (its start, where that is unknown).
pub(crate) fn place(
    words: &[WordTiming],
    median: f64,
    offset: f64,
    segments: &mut [(&mut f64, &mut f64, usize, &mut Option<Vec<Word>>)],
    mut last_speech: f64,
) {
    let max = median * 2.0;
    let round = |t: f64| (t * 100.0).round() / 100.0;
    let mut index = 0;
    for (seg_start, seg_end, token_count, out) in segments.iter_mut() {
        let mut saved = 0;
        let mut ws: Vec<Word> = Vec::new();
        while index < words.len() && saved < *token_count {
            let w = &words[index];
            if !w.word.is_empty() {
                ws.push(Word { word: w.word.clone(), start: round(offset + w.start), end: round(offset + w.end), probability: w.probability });
            }
            saved += w.tokens;
            index += 1;
        }
        if let Some(first) = ws.first() {
            if first.end - last_speech > median * 4.0
                && (first.end - first.start > max || (ws.len() > 1 && ws[1].end - first.start > max * 2.0))
            {
                if ws.len() > 1 && ws[1].end - ws[1].start > max {
                    let boundary = (ws[1].end / 2.0).max(ws[1].end - max);
                    ws[0].end = boundary;
                    ws[1].start = boundary;
                }
                ws[0].start = (ws[0].end - max).max(0.0);
            }
            if **seg_start < ws[0].end && **seg_start - 0.5 > ws[0].start {
                ws[0].start = (ws[0].end - median).min(**seg_start).max(0.0);
            } else {
                **seg_start = ws[0].start;
            }
            let last = ws.len() - 1;
            if **seg_end > ws[last].start && **seg_end + 0.5 < ws[last].end {
                ws[last].end = (ws[last].start + median).max(**seg_end);
            } else {
                **seg_end = ws[last].end;
            }
            last_speech = **seg_end;
        }
        **out = Some(ws);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn median_filter_reflects_at_the_edges() {
        let row = [5.0, 1.0, 4.0, 2.0, 3.0];
        // Width 3: [1,5,1] [5,1,4] [1,4,2] [4,2,3] [2,3,2].
        assert_eq!(median_filter(&row, 3), vec![1.0, 4.0, 2.0, 3.0, 2.0]);
        assert_eq!(median_filter(&[1.0, 2.0], 7), vec![1.0, 2.0]);
    }

    #[test]
    fn dtw_follows_the_cheap_diagonal_and_covers_every_token() {
        // Token 0 is cheap on frames 0-1, token 1 on frames 2-4.
        let cost = vec![vec![0.0, 0.0, 9.0, 9.0, 9.0], vec![9.0, 9.0, 0.0, 0.0, 0.0]];
        let path = dtw(&cost);
        assert_eq!(path, vec![(0, 0), (0, 1), (1, 2), (1, 3), (1, 4)]);
        let words = vec![("a".to_string(), 1), ("<eot>".to_string(), 1)];
        let t = timings(&words, &path, &[0.5]);
        assert_eq!(t.len(), 1);
        assert_eq!((t[0].start, t[0].end), (0.0, 2.0 * SECONDS_PER_POSITION));
    }

    #[test]
    fn words_start_at_spaces_and_punctuation_stands_alone_until_merged() {
        // Tokens 1..=5 decode to " Hello", ",", " wor", "ld", "!"; 9 is EOT.
        let text = |t: &u32| match t {
            1 => " Hello",
            2 => ",",
            3 => " wor",
            4 => "ld",
            5 => "!",
            _ => "<|endoftext|>",
        };
        let decode = |ts: &[u32]| ts.iter().map(text).collect::<String>();
        let words = split_words(&[1, 2, 3, 4, 5, 9], 9, true, &decode);
        let names: Vec<&str> = words.iter().map(|(w, _)| w.as_str()).collect();
        assert_eq!(names, vec![" Hello", ",", " world", "!", "<|endoftext|>"]);
        assert_eq!(words[2].1, 2);
        let mut timed: Vec<WordTiming> = words[..4]
            .iter()
            .enumerate()
            .map(|(i, (w, n))| WordTiming { word: w.clone(), tokens: *n, start: i as f64, end: i as f64 + 0.5, probability: 1.0 })
            .collect();
        merge_punctuation(&mut timed);
        let merged: Vec<&str> = timed.iter().map(|w| w.word.as_str()).collect();
        assert_eq!(merged, vec![" Hello,", "", " world!", ""]);
        assert_eq!(timed[0].tokens, 2);
    }

    #[test]
    fn a_word_that_runs_past_its_segment_end_is_cut_to_it() {
        let words = vec![
            WordTiming { word: " one".into(), tokens: 1, start: 0.0, end: 0.4, probability: 1.0 },
            WordTiming { word: " two".into(), tokens: 1, start: 0.5, end: 3.0, probability: 1.0 },
        ];
        // Segment times are from the start of the audio; the window starts at 10 s.
        let (mut start, mut end, mut out) = (10.0, 11.0, None);
        place(&words, 0.4, 10.0, &mut [(&mut start, &mut end, 2, &mut out)], 10.0);
        let out = out.unwrap();
        // The segment ends at 11 s but its last word at 13 s: the segment's end is taken.
        assert_eq!(start, 10.0);
        assert_eq!(end, 11.0);
        assert_eq!(out[1].end, 11.0);
        assert_eq!(out[0].word, " one");
    }
}
