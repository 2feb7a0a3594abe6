//! Incremental detokenisation with stop sequences.
//!
//! Token ids arrive one at a time and go through the data plane's windowed
//! detokeniser ([`DecodeStream`]: only recent ids are decoded, and a character
//! split across tokens is released by the token that completes it); of the text it
//! releases, any suffix that could still grow into a stop sequence is held back.
//! When a stop sequence appears, the text before it is released and the stream ends.
use dataplane::tokenizer::{DecodeStream, Tokenizer};

/// Text of one generated sequence.
pub struct TextStream {
    dec: DecodeStream,
    stops: Vec<String>,
    /// Text the detokeniser released (complete characters).
    text: String,
    /// Bytes of `text` released to the client.
    emitted: usize,
    stopped: bool,
}

/// What one token released.
#[derive(Debug, Default, PartialEq)]
pub struct Step {
    /// New text for the client.
    pub delta: String,
    /// A stop sequence matched: the sequence is over.
    pub stopped: bool,
}

impl TextStream {
    /// A stream ending at any of `stops` (empty strings are ignored).
    pub fn new(stops: Vec<String>) -> Self {
        TextStream {
            dec: DecodeStream::new(),
            stops: stops.into_iter().filter(|s| !s.is_empty()).collect(),
            text: String::new(),
            emitted: 0,
            stopped: false,
        }
    }

    /// Text released so far.
    pub fn text(&self) -> &str {
        &self.text[..self.emitted]
    }

    /// Whether a stop sequence ended the stream.
    pub fn stopped(&self) -> bool {
        self.stopped
    }

    /// Adds a token.
    pub fn push(&mut self, tok: &Tokenizer, id: u32) -> Step {
        if self.stopped {
            return Step {
                delta: String::new(),
                stopped: true,
            };
        }
        let piece = self.dec.step(tok, id).unwrap_or_default();
        if piece.is_empty() {
            return Step::default();
        }
        self.text.push_str(&piece);
        let full = self.text.as_str();
        // Earliest stop match, searched from where a new match could start.
        let max_stop = self.stops.iter().map(|s| s.len()).max().unwrap_or(0);
        let mut from = self.emitted.saturating_sub(max_stop);
        while !full.is_char_boundary(from) {
            from -= 1;
        }
        let hit = self
            .stops
            .iter()
            .filter_map(|s| full[from..].find(s.as_str()).map(|p| from + p))
            .min();
        if let Some(p) = hit {
            let delta = if p > self.emitted {
                full[self.emitted..p].to_string()
            } else {
                String::new()
            };
            self.emitted += delta.len();
            self.stopped = true;
            return Step {
                delta,
                stopped: true,
            };
        }
        let end = full.len();
        // Hold back the longest suffix that is a proper prefix of a stop sequence.
        let mut hold = 0;
        for s in &self.stops {
            for k in (1..s.len()).rev() {
                if k <= end && s.is_char_boundary(k) && full.ends_with(&s[..k]) {
                    hold = hold.max(k);
                    break;
                }
            }
        }
        let end = end - hold;
        if end <= self.emitted {
            return Step::default();
        }
        let delta = full[self.emitted..end].to_string();
        self.emitted = end;
        Step {
            delta,
            stopped: false,
        }
    }

    /// The sequence ended without a stop sequence: releases everything held back
    /// (an incomplete last character as U+FFFD).
    pub fn finish(&mut self, tok: &Tokenizer) -> String {
        if self.stopped {
            return String::new();
        }
        let rest = self.dec.flush(tok).unwrap_or_default();
        self.text.push_str(&rest);
        let d = self.text[self.emitted..].to_string();
        self.emitted = self.text.len();
        d
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bundled() -> Tokenizer {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../models/hypic-tiny");
        Tokenizer::from_dir(&dir).expect("bundled tokenizer")
    }

    #[test]
    fn streamed_cjk_and_emoji_with_stops_concatenate_to_the_decode() {
        let tok = bundled();
        let text = "你好，世界！🙂👍🏽 日本語のテキスト STOP after";
        let ids = tok.encode(text).unwrap();
        let mut ts = TextStream::new(vec!["STOP".into(), "🙂x".into()]);
        let mut out = String::new();
        for &id in &ids {
            let st = ts.push(&tok, id);
            assert!(!st.delta.contains('\u{FFFD}'), "{:?}", st.delta);
            out.push_str(&st.delta);
            if st.stopped {
                break;
            }
        }
        assert!(ts.stopped());
        assert_eq!(out, "你好，世界！🙂👍🏽 日本語のテキスト ");
        assert_eq!(ts.text(), out);

        let mut ts = TextStream::new(vec![]);
        let mut out = String::new();
        for &id in &ids {
            out.push_str(&ts.push(&tok, id).delta);
        }
        out.push_str(&ts.finish(&tok));
        assert_eq!(out, tok.decode(&ids).unwrap());
    }
}
