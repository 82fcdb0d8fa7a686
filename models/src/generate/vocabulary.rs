//! The tokenizer of a GGUF file, rebuilt from its `tokenizer.ggml.*` metadata as llama.cpp
//! builds it, so a prompt becomes the same token ids as there:
//! - `gpt2`: byte-level BPE from the vocabulary and merges, pre-tokenised as
//!   `tokenizer.ggml.pre` names (`smollm`, `qwen2`, `llama-bpe`, `gpt-2`/`default`);
//! - `llama`: SentencePiece's BPE (Gemma, Phi-3, Llama 2): pieces merged by their scores, spaces
//!   as `▁`, unknown characters as byte tokens.
//!
//! Control (type 3) and user-defined (type 4) tokens written in a text are recognised as those
//! tokens, longest first, as llama.cpp does; decoding leaves control tokens out.

use std::cmp::Ordering;
use std::collections::{BinaryHeap, HashMap};

use anyhow::{anyhow, bail, Context, Result};
use candle_core::quantized::gguf_file::{Content, Value};
use tokenizers::models::bpe::{Vocab, BPE};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::{AddedToken, SplitDelimiterBehavior, Tokenizer};

use super::{metadata_array, metadata_int, metadata_str, value_int};

/// GGUF token types (`tokenizer.ggml.token_type`).
const NORMAL: i64 = 1;
const CONTROL: i64 = 3;
const USER_DEFINED: i64 = 4;
const BYTE: i64 = 6;

/// Qwen2's pre-tokenizer (llama.cpp's `LLAMA_VOCAB_PRE_TYPE_QWEN2`): numbers one digit at a time.
const QWEN2_SPLIT: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// Llama 3's (`llama-bpe`): numbers in groups of up to three digits.
const LLAMA3_SPLIT: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// A model's tokenizer and its special tokens.
pub(crate) struct Vocabulary {
    codec: Codec,
    /// The text of each token, as the file lists them, and its type.
    tokens: Vec<String>,
    types: Vec<i64>,
    /// Put first in every prompt (`tokenizer.ggml.add_bos_token`; by default only for
    /// SentencePiece vocabularies, as in llama.cpp).
    pub(crate) bos: Option<u32>,
    /// `tokenizer.ggml.eos_token_id`.
    pub(crate) eos: Option<u32>,
}

enum Codec {
    Bpe(Box<Tokenizer>),
    Spm(SentencePiece),
}

/// Token texts that end a turn when they are control tokens, whatever the metadata says (the
/// list llama.cpp keeps for models whose files name only their EOS).
const END_OF_TURN: [&str; 9] = ["<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|eom_id|>", "<EOT>", "<|end_of_text|>", "<｜end▁of▁sentence｜>"];

impl Vocabulary {
    pub(crate) fn from_gguf(content: &Content) -> Result<Vocabulary> {
        let tokens: Vec<String> = metadata_array(content, "tokenizer.ggml.tokens")?
            .iter()
            .map(|v| v.to_string().cloned())
            .collect::<candle_core::Result<_>>()
            .context("tokenizer.ggml.tokens")?;
        // Absent types: every token normal (no special tokens).
        let types: Vec<i64> = match content.metadata.get("tokenizer.ggml.token_type") {
            Some(v) => v
                .to_vec()
                .context("tokenizer.ggml.token_type")?
                .iter()
                .map(|t| value_int(t).context("tokenizer.ggml.token_type holds a non-integer"))
                .collect::<Result<_>>()?,
            None => vec![NORMAL; tokens.len()],
        };
        if types.len() != tokens.len() {
            bail!("tokenizer.ggml.token_type lists {} types for {} tokens", types.len(), tokens.len());
        }
        let id = |key: &str| -> Result<Option<u32>> {
            match metadata_int(content, key) {
                None => Ok(None),
                Some(v) => {
                    let id = u32::try_from(v).ok().filter(|&i| (i as usize) < tokens.len());
                    id.map(Some).with_context(|| format!("{key} {v} is not a token of the vocabulary"))
                }
            }
        };
        let model = metadata_str(content, "tokenizer.ggml.model");
        let codec = match model {
            Some("gpt2") => Codec::Bpe(Box::new(byte_level_bpe(content, &tokens, &types)?)),
            Some("llama") => Codec::Spm(SentencePiece::new(content, &tokens, &types)?),
            other => bail!("tokenizer.ggml.model is {other:?}: only \"gpt2\" (byte-level BPE) and \"llama\" (SentencePiece) are supported"),
        };
        let add_bos = match content.metadata.get("tokenizer.ggml.add_bos_token") {
            Some(Value::Bool(b)) => *b,
            _ => model == Some("llama"),
        };
        let bos = if add_bos { id("tokenizer.ggml.bos_token_id")? } else { None };
        let eos = id("tokenizer.ggml.eos_token_id")?;
        Ok(Vocabulary { codec, tokens, types, bos, eos })
    }

    /// Token ids of `text` (no BOS); control and user-defined tokens written in it become
    /// those tokens.
    pub(crate) fn encode(&self, text: &str) -> Result<Vec<u32>> {
        match &self.codec {
            Codec::Bpe(t) => Ok(t.encode_fast(text, false).map_err(|e| anyhow!("tokenizing: {e}"))?.get_ids().to_vec()),
            Codec::Spm(s) => Ok(s.encode(text)),
        }
    }

    /// Text of `ids`; control tokens are left out.
    pub(crate) fn decode(&self, ids: &[u32]) -> Result<String> {
        match &self.codec {
            Codec::Bpe(t) => t.decode(ids, true).map_err(|e| anyhow!("detokenizing: {e}")),
            Codec::Spm(_) => Ok(self.decode_pieces(ids)),
        }
    }

    /// SentencePiece's decoding: `▁` as a space, byte tokens as their byte, user-defined
    /// tokens as written, control tokens left out.
    fn decode_pieces(&self, ids: &[u32]) -> String {
        let mut bytes = Vec::new();
        for &id in ids {
            let (Some(&ty), Some(piece)) = (self.types.get(id as usize), self.token_text(id)) else { continue };
            match ty {
                CONTROL => {}
                BYTE => {
                    // `<0xXX>`
                    if let Ok(b) = u8::from_str_radix(piece.trim_start_matches("<0x").trim_end_matches('>'), 16) {
                        bytes.push(b);
                    }
                }
                USER_DEFINED => bytes.extend_from_slice(piece.as_bytes()),
                _ => bytes.extend_from_slice(piece.replace('▁', " ").as_bytes()),
            }
        }
        String::from_utf8_lossy(&bytes).into_owned()
    }

    /// The id of the token spelled `text`.
    pub(crate) fn token_id(&self, text: &str) -> Option<u32> {
        match &self.codec {
            Codec::Bpe(t) => t.token_to_id(text),
            Codec::Spm(s) => s.ids.get(text).copied(),
        }
    }

    /// The text of token `id` as the file spells it (`▁` for a SentencePiece space).
    pub(crate) fn token_text(&self, id: u32) -> Option<&str> {
        self.tokens.get(id as usize).map(String::as_str)
    }

    /// Tokens that end generation: the EOS, `tokenizer.ggml.eot_token_id` /
    /// `eom_token_id`, and the control tokens of [`END_OF_TURN`].
    pub(crate) fn end_ids(&self, content: &Content) -> Vec<u32> {
        let mut ids: Vec<u32> = self.eos.into_iter().collect();
        for key in ["tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"] {
            if let Some(id) = metadata_int(content, key).and_then(|v| u32::try_from(v).ok()) {
                ids.push(id);
            }
        }
        for text in END_OF_TURN {
            if let Some(id) = self.token_id(text) {
                ids.push(id);
            }
        }
        ids.sort_unstable();
        ids.dedup();
        ids
    }
}

/// Byte-level BPE as the `gpt2` vocabularies' `tokenizer.json` sets it up, with the
/// pre-tokenizer `tokenizer.ggml.pre` names.
fn byte_level_bpe(content: &Content, tokens: &[String], types: &[i64]) -> Result<Tokenizer> {
    let merges: Vec<(String, String)> = metadata_array(content, "tokenizer.ggml.merges")?
        .iter()
        .map(|v| -> Result<(String, String)> {
            let merge = v.to_string().context("tokenizer.ggml.merges")?;
            // Byte-level tokens spell a space as 'Ġ', so the one space is the separator.
            let (a, b) = merge.split_once(' ').with_context(|| format!("malformed merge {merge:?}"))?;
            Ok((a.to_string(), b.to_string()))
        })
        .collect::<Result<_>>()?;
    let vocab: Vocab = tokens.iter().enumerate().map(|(id, t)| (t.clone(), id as u32)).collect();
    if vocab.len() != tokens.len() {
        // The id of a repeated token would be lost for decoding.
        bail!("tokenizer.ggml.tokens holds repeated tokens");
    }
    let bpe = BPE::builder().vocab_and_merges(vocab, merges).build().map_err(|e| anyhow!("building the BPE model: {e}"))?;
    let mut tokenizer = Tokenizer::new(bpe);
    let split = |pattern: &str| -> Result<Split> {
        Split::new(SplitPattern::Regex(pattern.into()), SplitDelimiterBehavior::Isolated, false).map_err(|e| anyhow!("pre-tokenizer: {e}"))
    };
    let pre = metadata_str(content, "tokenizer.ggml.pre").unwrap_or("default");
    let pre_tokenizer = match pre {
        // Digits one by one, then GPT-2's split (SmolLM's tokenizer.json).
        "smollm" => Sequence::new(vec![Digits::new(true).into(), ByteLevel::new(false, true, true).into()]),
        "qwen2" | "deepseek-r1-qwen" => Sequence::new(vec![split(QWEN2_SPLIT)?.into(), ByteLevel::new(false, true, false).into()]),
        "llama-bpe" | "llama3" => Sequence::new(vec![split(LLAMA3_SPLIT)?.into(), ByteLevel::new(false, true, false).into()]),
        "gpt-2" | "gpt2" | "default" => Sequence::new(vec![ByteLevel::new(false, true, true).into()]),
        other => bail!("tokenizer.ggml.pre {other:?} is not supported: smollm, qwen2, llama-bpe and gpt-2 are"),
    };
    tokenizer.with_pre_tokenizer(Some(pre_tokenizer));
    tokenizer.with_decoder(Some(ByteLevel::default()));
    // Control tokens (<|im_start|>, <|endoftext|>, ...) are left out of decoded text;
    // user-defined ones are kept.
    let added = |kind: i64| -> Vec<AddedToken> {
        tokens.iter().zip(types).filter(|(_, t)| **t == kind).map(|(tok, _)| AddedToken::from(tok.clone(), kind == CONTROL)).collect()
    };
    tokenizer.add_special_tokens(&added(CONTROL));
    tokenizer.add_tokens(&added(USER_DEFINED));
    Ok(tokenizer)
}

/// SentencePiece's BPE as llama.cpp runs it (`llm_tokenizer_spm`): a text's characters are
/// merged pairwise, the pair whose merged piece scores highest first (the leftmost among
/// equals), as long as the merged piece is in the vocabulary; characters no piece covers become
/// byte tokens (`<0x41>`).
struct SentencePiece {
    ids: HashMap<String, u32>,
    scores: Vec<f32>,
    /// Each byte's token, `<0xXX>`.
    bytes: Vec<Option<u32>>,
    unknown: Option<u32>,
    /// `tokenizer.ggml.add_space_prefix`: a space is put before the text and after each special
    /// token (default true, as in llama.cpp).
    space_prefix: bool,
    /// Control and user-defined tokens, longest first, as they may be written in a text.
    specials: Vec<(String, u32)>,
}

/// A candidate merge of two adjacent symbols.
#[derive(PartialEq)]
struct Bigram {
    left: usize,
    right: usize,
    score: f32,
    len: usize,
}

impl Eq for Bigram {}

impl Ord for Bigram {
    /// The highest score first; among equal scores the leftmost.
    fn cmp(&self, other: &Self) -> Ordering {
        self.score.total_cmp(&other.score).then_with(|| other.left.cmp(&self.left))
    }
}

impl PartialOrd for Bigram {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

/// A piece of the text being merged: `text[start..start + len]`, linked to its neighbours.
#[derive(Clone, Copy)]
struct Symbol {
    start: usize,
    len: usize,
    prev: Option<usize>,
    next: Option<usize>,
}

impl SentencePiece {
    fn new(content: &Content, tokens: &[String], types: &[i64]) -> Result<SentencePiece> {
        let scores: Vec<f32> = match content.metadata.get("tokenizer.ggml.scores") {
            Some(v) => v
                .to_vec()
                .context("tokenizer.ggml.scores")?
                .iter()
                .map(|s| match s {
                    Value::F32(x) => Ok(*x),
                    Value::F64(x) => Ok(*x as f32),
                    _ => Err(anyhow!("tokenizer.ggml.scores holds a non-number")),
                })
                .collect::<Result<_>>()?,
            None => vec![0.0; tokens.len()],
        };
        if scores.len() != tokens.len() {
            bail!("tokenizer.ggml.scores lists {} scores for {} tokens", scores.len(), tokens.len());
        }
        let mut ids = HashMap::with_capacity(tokens.len());
        for (id, t) in tokens.iter().enumerate() {
            // llama.cpp keeps the last id of a repeated piece.
            ids.insert(t.clone(), id as u32);
        }
        let bytes = (0..=255u8).map(|b| ids.get(&format!("<0x{b:02X}>")).copied()).collect();
        let unknown = metadata_int(content, "tokenizer.ggml.unknown_token_id").and_then(|v| u32::try_from(v).ok());
        let space_prefix = match content.metadata.get("tokenizer.ggml.add_space_prefix") {
            Some(Value::Bool(b)) => *b,
            _ => true,
        };
        let mut specials: Vec<(String, u32)> =
            tokens.iter().zip(types).enumerate().filter(|(_, (t, ty))| matches!(**ty, CONTROL | USER_DEFINED) && !t.is_empty()).map(|(id, (t, _))| (t.clone(), id as u32)).collect();
        specials.sort_by(|a, b| b.0.len().cmp(&a.0.len()).then(a.1.cmp(&b.1)));
        Ok(SentencePiece { ids, scores, bytes, unknown, space_prefix, specials })
    }

    fn encode(&self, text: &str) -> Vec<u32> {
        let mut out = Vec::new();
        let mut after_special = true;
        for part in self.partition(text) {
            match part {
                Part::Special(id) => {
                    out.push(id);
                    after_special = true;
                }
                Part::Text(t) => {
                    let mut escaped = String::with_capacity(t.len() + 3);
                    if self.space_prefix && after_special {
                        escaped.push('▁');
                    }
                    escaped.extend(t.chars().map(|c| if c == ' ' { '▁' } else { c }));
                    self.encode_piece(&escaped, &mut out);
                    after_special = false;
                }
            }
        }
        out
    }

    /// `text` cut at the special tokens written in it, longest match first from the left
    /// (llama.cpp matches each special token, longest first, across the whole text; the same
    /// cuts for texts where no two special tokens overlap).
    fn partition<'t>(&self, text: &'t str) -> Vec<Part<'t>> {
        let mut parts = Vec::new();
        let (mut plain_from, mut at) = (0, 0);
        while at < text.len() {
            let rest = &text[at..];
            match self.specials.iter().find(|(s, _)| rest.starts_with(s.as_str())) {
                Some((s, id)) => {
                    if plain_from < at {
                        parts.push(Part::Text(&text[plain_from..at]));
                    }
                    parts.push(Part::Special(*id));
                    at += s.len();
                    plain_from = at;
                }
                None => at += rest.chars().next().map_or(1, char::len_utf8),
            }
        }
        if plain_from < text.len() {
            parts.push(Part::Text(&text[plain_from..]));
        }
        parts
    }

    fn encode_piece(&self, text: &str, out: &mut Vec<u32>) {
        let mut symbols: Vec<Symbol> = Vec::new();
        for (i, (start, c)) in text.char_indices().enumerate() {
            symbols.push(Symbol { start, len: c.len_utf8(), prev: i.checked_sub(1), next: Some(i + 1) });
        }
        let Some(last) = symbols.last_mut() else { return };
        last.next = None;
        let mut queue = BinaryHeap::new();
        let try_add = |symbols: &[Symbol], left: Option<usize>, right: Option<usize>, queue: &mut BinaryHeap<Bigram>| {
            let (Some(l), Some(r)) = (left, right) else { return };
            let (a, b) = (symbols[l], symbols[r]);
            let piece = &text[a.start..a.start + a.len + b.len];
            if let Some(&id) = self.ids.get(piece) {
                queue.push(Bigram { left: l, right: r, score: self.scores[id as usize], len: piece.len() });
            }
        };
        for i in 1..symbols.len() {
            try_add(&symbols, Some(i - 1), Some(i), &mut queue);
        }
        while let Some(bigram) = queue.pop() {
            let (l, r) = (symbols[bigram.left], symbols[bigram.right]);
            if l.len == 0 || r.len == 0 || l.len + r.len != bigram.len {
                continue; // one of them has merged since
            }
            symbols[bigram.left].len += r.len;
            symbols[bigram.right].len = 0;
            symbols[bigram.left].next = r.next;
            if let Some(n) = r.next {
                symbols[n].prev = Some(bigram.left);
            }
            let left = symbols[bigram.left];
            try_add(&symbols, left.prev, Some(bigram.left), &mut queue);
            try_add(&symbols, Some(bigram.left), left.next, &mut queue);
        }
        // Every merged piece is a token; a single character that is none becomes its bytes.
        let mut i = Some(0);
        while let Some(s) = i {
            let sym = symbols[s];
            let piece = &text[sym.start..sym.start + sym.len];
            match self.ids.get(piece) {
                Some(&id) => out.push(id),
                None => out.extend(piece.bytes().filter_map(|b| self.bytes[b as usize].or(self.unknown))),
            }
            i = sym.next;
        }
    }

}

enum Part<'t> {
    Text(&'t str),
    Special(u32),
}
