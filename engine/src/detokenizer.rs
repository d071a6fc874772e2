//! Incremental detokenization and stop strings.
//!
//! Text grows by decoding a sliding window of ids (the prefix/read offsets of vLLM's and
//! TGI's detokenizers) so a multi-byte character split across tokens is emitted only once
//! complete. Stop strings are searched in the whole output text, so they may span tokens
//! or end inside one; the text is cut where the match starts. Text that could still become
//! the start of a stop string is held back, so no part of a stop string is ever emitted.

use crate::tokenizer::Tokenizer;

#[derive(Debug, Clone, Default)]
pub struct Detokenizer {
    prefix_offset: usize,
    read_offset: usize,
    /// The output text so far (cut at a matched stop string).
    pub text: String,
    /// Bytes of `text` already handed out.
    emitted: usize,
}

/// Length of the longest suffix of `text` that is a proper prefix of some stop string.
fn partial_stop_len(text: &str, stops: &[String]) -> usize {
    let mut best = 0;
    for s in stops {
        for (end, _) in s.char_indices().skip(1) {
            if end > best && text.ends_with(&s[..end]) {
                best = end;
            }
        }
    }
    best
}

impl Detokenizer {
    /// Extends `text` with the characters completed by the newest id of `ids` (all output
    /// ids so far). Returns the byte offset where the new text starts.
    pub fn push(&mut self, tok: &Tokenizer, ids: &[u32], skip_special_tokens: bool) -> usize {
        let start = self.text.len();
        let prefix = tok.decode(&ids[self.prefix_offset..self.read_offset], skip_special_tokens).unwrap_or_default();
        let full = tok.decode(&ids[self.prefix_offset..], skip_special_tokens).unwrap_or_default();
        if full.len() > prefix.len() && !full.ends_with('\u{FFFD}') {
            if let Some(new) = full.get(prefix.len()..) {
                self.text.push_str(new);
                self.prefix_offset = self.read_offset;
                self.read_offset = ids.len();
            }
        }
        start
    }

    /// Searches `stops` in the text added since byte `from` (plus the overlap a match may
    /// need). On a match, cuts the text where it starts and returns the stop string.
    pub fn find_stop(&mut self, from: usize, stops: &[String]) -> Option<String> {
        let mut hit: Option<(usize, &String)> = None;
        for s in stops {
            let mut lo = from.saturating_sub(s.len() - 1);
            while !self.text.is_char_boundary(lo) {
                lo -= 1;
            }
            if let Some(p) = self.text[lo..].find(s.as_str()) {
                if hit.is_none_or(|(q, _)| lo + p < q) {
                    hit = Some((lo + p, s));
                }
            }
        }
        let (at, s) = hit?;
        self.text.truncate(at);
        Some(s.clone())
    }

    /// The text not yet handed out, holding back a tail that may begin a stop string
    /// unless `finished`.
    pub fn take_delta(&mut self, stops: &[String], finished: bool) -> String {
        let mut end = self.text.len();
        if !finished {
            end -= partial_stop_len(&self.text, stops);
        }
        if end <= self.emitted {
            return String::new();
        }
        let delta = self.text[self.emitted..end].to_string();
        self.emitted = end;
        delta
    }
}
