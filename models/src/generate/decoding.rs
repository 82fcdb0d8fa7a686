//! One request's decoding: its next token picked from the logits, the text so far decoded
//! incrementally, stop sequences found across token boundaries, the end decided.

use anyhow::Result;
use candle_core::Tensor;

use super::sampling::{pick_tokens, Sampler};
use super::tools::{named_call, read_calls, settled_text, CallFormat, ObjectEnd};
use super::vocabulary::Vocabulary;
use super::{FinishReason, GenerateError, GenerateOptions, Generation, Llm};

/// The byte-level decoder turns an incomplete UTF-8 sequence into this character.
pub(super) const REPLACEMENT: char = '\u{FFFD}';

/// A request being decoded: its sampler, the tokens and text so far, and its stop checks.
pub(super) struct Decoding<'a> {
    pub(super) opts: &'a GenerateOptions,
    pub(super) on_text: &'a mut dyn FnMut(&str, usize) -> bool,
    pub(super) sampler: Sampler,
    pub(super) prompt_tokens: usize,
    pub(super) generated: Vec<u32>,
    pub(super) text: IncrementalText,
    /// Length of the text already searched for stop sequences and found settled.
    pub(super) searched: usize,
    /// Longest stop sequence, in bytes.
    pub(super) max_stop: usize,
    /// Where the model may call tools: how its calls are read.
    pub(super) tools: Option<CallReading>,
}

/// How a request's tool calls are read from its answer.
pub(super) struct CallReading {
    pub(super) format: CallFormat,
    /// The text the answer was begun with in the prompt (the opening of a required call),
    /// part of the answer that is read.
    pub(super) opening: String,
    /// Whether several calls are kept.
    pub(super) parallel: bool,
    /// The function `tool_choice` names, if it names one: the answer is then that call's
    /// arguments, and decoding ends where they close (see [`ObjectEnd`]).
    pub(super) named: Option<String>,
    pub(super) arguments_end: ObjectEnd,
}

/// What a decoding step decided.
pub(super) enum Step {
    /// Feed this token and go on.
    Next(u32),
    Done(Generation),
}

impl Decoding<'_> {
    /// Picks the next token from `logits` (the vocabulary's, for the newest position, `(1,
    /// vocabulary)` or `(vocabulary,)`, on any device) and decides whether the request goes on.
    pub(super) fn step(&mut self, llm: &Llm, logits: &Tensor) -> Result<Step> {
        let logits = if logits.rank() == 1 { logits.unsqueeze(0)? } else { logits.clone() };
        let next = pick_tokens(&logits, &[self.sampler.next_row()])?[0];
        self.accept(llm, next)
    }

    /// [`Self::step`] once `next` is sampled.
    pub(super) fn accept(&mut self, llm: &Llm, next: u32) -> Result<Step> {
        if llm.end_ids.contains(&next) {
            return Ok(Step::Done(self.finish(FinishReason::Stop, None)));
        }
        self.generated.push(next);
        let so_far = self.text.update(&llm.vocabulary, &self.generated)?;

        // A new match must end in the new text, so it starts at most max_stop - 1 bytes
        // before it.
        let mut from = self.searched.saturating_sub(self.max_stop);
        while !so_far.is_char_boundary(from) {
            from -= 1;
        }
        if let Some(at) = find_stop(so_far, from, &self.opts.stop) {
            return Ok(Step::Done(self.finish(FinishReason::Stop, Some(at))));
        }
        self.searched = so_far.trim_end_matches(REPLACEMENT).len();
        // A named function's arguments end the answer once they close, as the reference
        // (vLLM) writes only them, its decoding guided by their schema; a small model would
        // ramble on, often leaving the call's own object unclosed.
        if let Some(tools) = self.tools.as_mut().filter(|t| t.named.is_some()) {
            if let Some(end) = tools.arguments_end.find(&so_far[..self.searched]) {
                return Ok(Step::Done(self.finish(FinishReason::Stop, Some(end))));
            }
        }

        let mut shown = &so_far[..settled_len(so_far, &self.opts.stop)];
        if let Some(tools) = &self.tools {
            // Calls are not text: only what surely is not one is shown as it comes.
            shown = if tools.opening.is_empty() { settled_text(shown) } else { "" };
        }
        if !(self.on_text)(shown, self.generated.len()) {
            return Err(GenerateError::Canceled.into());
        }
        if self.generated.len() == self.opts.max_tokens {
            // The logits of one more position would not be used.
            return Ok(Step::Done(self.finish(FinishReason::Length, None)));
        }
        Ok(Step::Next(next))
    }

    pub(super) fn finish(&mut self, mut finish_reason: FinishReason, stop_at: Option<usize>) -> Generation {
        let mut text = std::mem::take(&mut self.text).into_string();
        if let Some(at) = stop_at {
            text.truncate(at);
        }
        let mut tool_calls = Vec::new();
        if let Some(tools) = &self.tools {
            match tools.named.as_deref().and_then(|name| named_call(name, &text, tools.format)) {
                Some(call) => (text, tool_calls) = (String::new(), vec![call]),
                None => {
                    let answer = format!("{}{text}", tools.opening);
                    (text, tool_calls) = read_calls(&answer, tools.format, tools.parallel);
                }
            }
            if !tool_calls.is_empty() {
                finish_reason = FinishReason::ToolCalls;
            }
        }
        Generation { text, tool_calls, prompt_tokens: self.prompt_tokens, completion_tokens: self.generated.len(), finish_reason }
    }
}

/// Decodes the generated ids step by step. Only the ids after the last point where the text
/// was complete UTF-8 are decoded again, so each step costs the new tokens, not the whole
/// answer; the result equals decoding all ids at once because both decoders (byte-level BPE,
/// SentencePiece) only concatenate each token's bytes, and the split falls on a character
/// boundary.
#[derive(Default)]
pub(super) struct IncrementalText {
    pub(super) text: String,
    /// `text[..settled_bytes]` is the decoding of `ids[..settled_ids]`, ending on a whole
    /// character.
    pub(super) settled_bytes: usize,
    pub(super) settled_ids: usize,
}

impl IncrementalText {
    pub(super) fn update(&mut self, vocabulary: &Vocabulary, ids: &[u32]) -> Result<&str> {
        let tail = vocabulary.decode(&ids[self.settled_ids..])?;
        self.text.truncate(self.settled_bytes);
        self.text.push_str(&tail);
        // A trailing U+FFFD is (almost always) a character whose last bytes are still to come.
        if !tail.ends_with(REPLACEMENT) {
            self.settled_bytes = self.text.len();
            self.settled_ids = ids.len();
        }
        Ok(self.text.as_str())
    }

    pub(super) fn into_string(self) -> String {
        self.text
    }
}

/// Byte offset of the earliest stop sequence that occurs in `text[from..]`.
pub(super) fn find_stop(text: &str, from: usize, stops: &[String]) -> Option<usize> {
    stops
        .iter()
        .filter_map(|s| text[from..].find(s.as_str()).map(|i| from + i))
        .min()
}

/// Length of the part of `text` that later tokens cannot take back: without a trailing
/// unfinished character and without a tail that is the beginning of a stop sequence.
pub(super) fn settled_len(text: &str, stops: &[String]) -> usize {
    let head = text.trim_end_matches(REPLACEMENT);
    let held = stops
        .iter()
        .flat_map(|stop| stop.char_indices().skip(1).map(move |(i, _)| &stop[..i]))
        .filter(|prefix| head.ends_with(prefix))
        .map(str::len)
        .max()
        .unwrap_or(0);
    head.len() - held
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stops(s: &[&str]) -> Vec<String> {
        s.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn settled_len_holds_back_stop_prefixes_and_unfinished_chars() {
        let s = stops(&["\n\n", "END"]);
        assert_eq!(settled_len("abc", &s), 3);
        assert_eq!(settled_len("abc\n", &s), 3);
        assert_eq!(settled_len("abcEN", &s), 3);
        assert_eq!(settled_len("abcE", &s), 3);
        assert_eq!(settled_len("abc\u{FFFD}", &s), 3);
        assert_eq!(settled_len("a\u{FFFD}b", &s), 5);
        assert_eq!(settled_len("abc", &[]), 3);
    }

    #[test]
    fn find_stop_takes_the_earliest_match() {
        let s = stops(&["lo", "he"]);
        assert_eq!(find_stop("the hello", 0, &s), Some(1));
        assert_eq!(find_stop("the hello", 2, &s), Some(4));
        assert_eq!(find_stop("the hello", 8, &s), None);
    }
}
