//! Chat prompts to token ids where only the chat template's own markers are control tokens.
//!
//! The rule: a special token (an added token the tokenizer marks `special`, such as
//! `<|im_start|>`) is produced only by the template's text or by its `bos_token` /
//! `eos_token`. The same string written inside a message's content is encoded as plain text
//! (the ids of its characters, as HF's `split_special_tokens=True` would), so a message can
//! never open or close a turn.
//!
//! How: before rendering, every special-token string in a message's content (and a proper
//! prefix at its end or suffix at its start, which could join the neighbouring text into one)
//! is replaced by a private-use escape `U+E000 <index> U+E001`. The template sees ordinary
//! text (string methods such as `trim` or `split` behave as on the original content), and in
//! the rendered text every special-token string outside the escapes is the template's. The
//! escapes are restored as protected ranges, the text is split at the template's markers
//! exactly where HF's added-vocabulary split would split it, and each piece between markers
//! is encoded with special-token matching off. Without special-token strings in the
//! contents the ids equal HF `apply_chat_template(tokenize=True)`.

use aho_corasick::{AhoCorasick, MatchKind};
use std::ops::Range;
use tokenizers::pre_tokenizers::metaspace::PrependScheme;
use tokenizers::pre_tokenizers::PreTokenizerWrapper;
use tokenizers::AddedToken;

/// Opens an escape in rendered text: `OPEN <decimal index> CLOSE`.
const OPEN: char = '\u{E000}';
const CLOSE: char = '\u{E001}';

/// One piece of an encoded chat: text to encode as plain text, or a template marker.
#[derive(Debug, Clone, PartialEq)]
pub enum Piece {
    /// A byte range of the rendered text, encoded without special-token matching.
    Text(Range<usize>),
    /// A special token the template wrote.
    Special(u32),
}

/// The tokenizer's special tokens and the matchers that find them.
pub struct Specials {
    tokens: Vec<(String, u32, AddedToken)>,
    /// Leftmost-longest over the special strings and the two escape characters.
    escaper: Option<AhoCorasick>,
    /// Every (overlapping) occurrence of a special string.
    finder: Option<AhoCorasick>,
}

impl Specials {
    /// The special added tokens of `tok` (non-special added tokens are ordinary vocabulary).
    pub fn new(tok: &tokenizers::Tokenizer) -> Self {
        let mut tokens: Vec<(String, u32, AddedToken)> = tok
            .get_added_tokens_decoder()
            .into_iter()
            .filter(|(_, t)| t.special && !t.content.is_empty())
            .map(|(id, t)| (t.content.clone(), id, t))
            .collect();
        tokens.sort_by_key(|t| t.1);
        let strings: Vec<&str> = tokens.iter().map(|t| t.0.as_str()).collect();
        let mut escaped = strings.clone();
        let (open, close) = (OPEN.to_string(), CLOSE.to_string());
        escaped.extend([open.as_str(), close.as_str()]);
        let build = |kind, pats: &[&str]| AhoCorasick::builder().match_kind(kind).build(pats).ok();
        let finder = if strings.is_empty() { None } else { build(MatchKind::Standard, &strings) };
        Self { escaper: build(MatchKind::LeftmostLongest, &escaped), finder, tokens }
    }

    /// `content` with every special-token string, escape character and boundary fragment of
    /// a special string replaced by an escape whose original is pushed onto `table`.
    pub fn escape(&self, content: &str, table: &mut Vec<String>) -> String {
        let Some(esc) = &self.escaper else { return content.to_string() };
        let mut out = String::with_capacity(content.len());
        let push = |out: &mut String, s: &str, table: &mut Vec<String>| {
            out.push(OPEN);
            out.push_str(&table.len().to_string());
            out.push(CLOSE);
            table.push(s.to_string());
        };
        let mut last = 0;
        for m in esc.find_iter(content) {
            out.push_str(&content[last..m.start()]);
            push(&mut out, &content[m.range()], table);
            last = m.end();
        }
        out.push_str(&content[last..]);
        // A special string's proper prefix at the end (or suffix at the start) of the trimmed
        // content could become a special string together with the text next to it.
        let body = out.trim();
        let (lead, trail) = (out.len() - out.trim_start().len(), out.trim_end().len());
        let head = self.longest(|s| proper_suffixes(s).filter(|x| body.starts_with(x)).map(str::len).max());
        let tail = self.longest(|s| proper_prefixes(s).filter(|x| body.ends_with(x)).map(str::len).max());
        if head == 0 && tail == 0 {
            return out;
        }
        let (head_end, tail_start) = (lead + head, (trail - tail).max(lead + head));
        let mut fixed = out[..lead].to_string();
        if head > 0 {
            push(&mut fixed, &out[lead..head_end], table);
        }
        fixed.push_str(&out[head_end..tail_start]);
        if tail_start < trail {
            push(&mut fixed, &out[tail_start..trail], table);
        }
        fixed.push_str(&out[trail..]);
        fixed
    }

    fn longest(&self, f: impl Fn(&str) -> Option<usize>) -> usize {
        self.tokens.iter().filter_map(|t| f(&t.0)).max().unwrap_or(0)
    }

    /// Splits `text` (escapes already restored; `protected` are the restored ranges) at the
    /// template's markers: HF's leftmost-longest split, ignoring any occurrence that
    /// overlaps a protected range, with each marker's `lstrip` / `rstrip` applied.
    pub fn split(&self, text: &str, protected: &[Range<usize>]) -> Vec<Piece> {
        let Some(finder) = &self.finder else { return vec![Piece::Text(0..text.len())] };
        let overlaps = |r: &Range<usize>| protected.iter().any(|p| p.start < r.end && r.start < p.end);
        let mut found: Vec<(Range<usize>, usize)> = finder
            .find_overlapping_iter(text)
            .map(|m| (m.range(), m.pattern().as_usize()))
            .filter(|(r, _)| !overlaps(r))
            .collect();
        found.sort_by_key(|(r, _)| (r.start, std::cmp::Reverse(r.end)));
        let mut pieces = vec![];
        let mut last = 0;
        for (r, k) in found {
            if r.start < last {
                continue;
            }
            let (_, id, tok) = &self.tokens[k];
            let mut start = r.start;
            if tok.lstrip {
                start = last.max(text[..start].trim_end().len());
            }
            let mut end = r.end;
            if tok.rstrip {
                end = text.len() - text[end..].trim_start().len();
            }
            if last < start {
                pieces.push(Piece::Text(last..start));
            }
            pieces.push(Piece::Special(*id));
            last = end;
        }
        if last < text.len() {
            pieces.push(Piece::Text(last..text.len()));
        }
        pieces
    }
}

fn proper_prefixes(s: &str) -> impl Iterator<Item = &str> {
    s.char_indices().skip(1).map(move |(i, _)| &s[..i])
}

fn proper_suffixes(s: &str) -> impl Iterator<Item = &str> {
    s.char_indices().skip(1).map(move |(i, _)| &s[i..])
}

/// Restores the escapes of `rendered`: the text and the byte ranges of restored originals.
/// An `OPEN` that does not start a valid escape is kept as it is.
pub fn unescape(rendered: &str, table: &[String]) -> (String, Vec<Range<usize>>) {
    let mut text = String::with_capacity(rendered.len());
    let mut protected = vec![];
    let mut rest = rendered;
    while let Some(i) = rest.find(OPEN) {
        text.push_str(&rest[..i]);
        let after = &rest[i + OPEN.len_utf8()..];
        let parsed = after.find(CLOSE).and_then(|j| Some((after[..j].parse::<usize>().ok()?, j)));
        match parsed.and_then(|(k, j)| Some((table.get(k)?, j))) {
            Some((orig, j)) => {
                protected.push(text.len()..text.len() + orig.len());
                text.push_str(orig);
                rest = &after[j + CLOSE.len_utf8()..];
            }
            None => {
                text.push(OPEN);
                rest = after;
            }
        }
    }
    text.push_str(rest);
    (text, protected)
}

/// `tok` with special-token matching off (special strings are plain text), and, when its
/// pre-tokenizer prepends a word marker only to the text's first piece (Metaspace
/// `prepend_scheme: first`), a second copy that never prepends, for the pieces after a
/// marker (HF prepends by the piece's offset in the whole text).
pub fn plain_tokenizers(tok: &tokenizers::Tokenizer) -> (tokenizers::Tokenizer, Option<tokenizers::Tokenizer>) {
    let mut plain = tok.clone();
    plain.set_encode_special_tokens(true);
    let mut rest = plain.clone();
    let changed = match rest.get_pre_tokenizer().cloned() {
        Some(mut pt) => {
            let changed = never_prepend(&mut pt);
            rest.with_pre_tokenizer(Some(pt));
            changed
        }
        None => false,
    };
    (plain, changed.then_some(rest))
}

fn never_prepend(pt: &mut PreTokenizerWrapper) -> bool {
    match pt {
        PreTokenizerWrapper::Metaspace(m) if m.get_prepend_scheme() == PrependScheme::First => {
            m.set_prepend_scheme(PrependScheme::Never);
            true
        }
        PreTokenizerWrapper::Sequence(s) => s.as_mut().iter_mut().fold(false, |acc, p| never_prepend(p) | acc),
        _ => false,
    }
}
