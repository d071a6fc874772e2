//! `--reasoning-parser qwen3` (vLLM's name): a chat answer that opens with `<think>` returns
//! the text up to `</think>` as `reasoning_content` and the rest as `content` (leading
//! newlines after `</think>` dropped, as vLLM's parser strips them); an answer that does not
//! open with `<think>` is all content (Qwen3 with `enable_thinking: false`, whose template
//! closes an empty think block in the prompt). The same split for whole answers and streams,
//! so a streamed answer's deltas add up to the non-streamed message. Token ids, log-probs
//! and what feedback trains on are the generated tokens, thinking included.

const OPEN: &str = "<think>";
const CLOSE: &str = "</think>";

/// The parsers `--reasoning-parser` accepts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum ReasoningParser {
    /// Qwen3's `<think>…</think>`.
    Qwen3,
}

/// Where a stream is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// Not yet known whether the answer opens with `<think>` (the text so far is a prefix).
    Start,
    Reasoning,
    /// After `</think>`, before the first character that is not a newline.
    AfterClose,
    Content,
}

/// An incremental splitter of one answer; text it cannot place yet (a possible tag's
/// beginning) is held until the next delta or [`Splitter::finish`].
#[derive(Debug, Clone)]
pub struct Splitter {
    state: State,
    held: String,
    /// Whether the answer opened with `<think>`.
    thinks: bool,
}

impl Default for Splitter {
    fn default() -> Self {
        Self { state: State::Start, held: String::new(), thinks: false }
    }
}

/// `(reasoning, content)` produced by one step.
pub type Parts = (String, String);

impl Splitter {
    /// Takes the next text delta.
    pub fn push(&mut self, delta: &str) -> Parts {
        self.held.push_str(delta);
        let (mut reasoning, mut content) = (String::new(), String::new());
        loop {
            match self.state {
                State::Start => {
                    if let Some(rest) = self.held.strip_prefix(OPEN) {
                        self.held = rest.to_string();
                        self.state = State::Reasoning;
                        self.thinks = true;
                    } else if OPEN.starts_with(self.held.as_str()) {
                        return (reasoning, content); // maybe the tag's beginning: wait
                    } else {
                        self.state = State::Content;
                    }
                }
                State::Reasoning => match self.held.find(CLOSE) {
                    Some(at) => {
                        reasoning.push_str(&self.held[..at]);
                        self.held = self.held[at + CLOSE.len()..].to_string();
                        self.state = State::AfterClose;
                    }
                    None => {
                        // Keep a suffix that could begin `</think>`.
                        let keep = (1..CLOSE.len()).rev().find(|&n| self.held.ends_with(&CLOSE[..n])).unwrap_or(0);
                        let cut = self.held.len() - keep;
                        reasoning.push_str(&self.held[..cut]);
                        self.held = self.held[cut..].to_string();
                        return (reasoning, content);
                    }
                },
                State::AfterClose => {
                    let rest = self.held.trim_start_matches('\n');
                    if rest.is_empty() {
                        self.held.clear();
                        return (reasoning, content);
                    }
                    self.held = rest.to_string();
                    self.state = State::Content;
                }
                State::Content => {
                    content.push_str(&self.held);
                    self.held.clear();
                    return (reasoning, content);
                }
            }
        }
    }

    /// The end of the answer: what was held goes where it was (a `<think>` prefix that
    /// never completed is content; a partial `</think>` is reasoning).
    pub fn finish(&mut self) -> Parts {
        let held = std::mem::take(&mut self.held);
        match self.state {
            State::Start | State::Content => (String::new(), held),
            State::Reasoning => (held, String::new()),
            State::AfterClose => (String::new(), String::new()),
        }
    }

    /// Whether the answer opened with `<think>` (known once its start has been read).
    pub fn thinks(&self) -> bool {
        self.thinks
    }

    /// A whole answer's `(reasoning, content)`; `None` reasoning when it does not think (the
    /// tests' reference for streamed answers).
    #[cfg(test)]
    pub fn split(text: &str) -> (Option<String>, String) {
        let mut s = Splitter::default();
        let (mut r, mut c) = s.push(text);
        let (r2, c2) = s.finish();
        r.push_str(&r2);
        c.push_str(&c2);
        (s.thinks.then_some(r), c)
    }
}

/// The ways the tests stream `text`: cut once at every character boundary, and cut at every
/// character (the cut points, in order).
#[cfg(test)]
pub(crate) fn stream_cuts(text: &str) -> Vec<Vec<usize>> {
    (0..=text.len())
        .filter(|&i| text.is_char_boundary(i))
        .map(|i| vec![i])
        .chain([text.char_indices().map(|(i, _)| i).collect()])
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Whole answers, and the same answers streamed in every split into two deltas and one
    /// character at a time: the parts add up to the whole answer's.
    #[test]
    fn splits_whole_and_streamed_answers_alike() {
        let check = |text: &str, want: (Option<&str>, &str)| {
            let (r, c) = Splitter::split(text);
            assert_eq!((r.as_deref(), c.as_str()), want, "{text:?}");
            for cut in stream_cuts(text) {
                let mut s = Splitter::default();
                let (mut rs, mut cs, mut last) = (String::new(), String::new(), 0);
                for &at in cut.iter().chain([&text.len()]) {
                    let (r, c) = s.push(&text[last..at]);
                    rs.push_str(&r);
                    cs.push_str(&c);
                    last = at;
                }
                let (r, c) = s.finish();
                rs.push_str(&r);
                cs.push_str(&c);
                assert_eq!((rs.as_str(), cs.as_str()), (want.0.unwrap_or(""), want.1), "{text:?} cut at {cut:?}");
            }
        };
        check("<think>\nplan</think>\n\nThe answer.", (Some("\nplan"), "The answer."));
        check("<think></think>Hi", (Some(""), "Hi"));
        check("Hi there", (None, "Hi there"));
        check("<thin", (None, "<thin"));
        check("<think>never closed </thi", (Some("never closed </thi"), ""));
        check("a <think>b</think>c", (None, "a <think>b</think>c"));
        check("<think>x</think>\n\n", (Some("x"), ""));
        check("<think>é</think>ü", (Some("é"), "ü"));
    }
}
