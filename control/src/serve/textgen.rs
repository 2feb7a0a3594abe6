//! Incremental detokenisation with stop sequences.
//!
//! Token ids arrive one at a time; the text is re-decoded and only the stable part is
//! released: an incomplete UTF-8 sequence at the end (decoded as U+FFFD) and any
//! suffix that could still grow into a stop sequence are held back. When a stop
//! sequence appears, the text before it is released and the stream ends.
use dataplane::tokenizer::Tokenizer;

/// Text of one generated sequence.
pub struct TextStream {
    ids: Vec<u32>,
    stops: Vec<String>,
    emitted: String,
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
            ids: vec![],
            stops: stops.into_iter().filter(|s| !s.is_empty()).collect(),
            emitted: String::new(),
            stopped: false,
        }
    }

    /// Text released so far.
    pub fn text(&self) -> &str {
        &self.emitted
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
        self.ids.push(id);
        let full = tok.decode(&self.ids).unwrap_or_default();
        if !full.starts_with(self.emitted.as_str()) {
            // Decoding is not prefix-stable here (should not happen with byte-level
            // BPE); wait for more tokens.
            return Step::default();
        }
        // Earliest stop match, searched from where a new match could start.
        let max_stop = self.stops.iter().map(|s| s.len()).max().unwrap_or(0);
        let mut from = self.emitted.len().saturating_sub(max_stop);
        while !full.is_char_boundary(from) {
            from -= 1;
        }
        let hit = self
            .stops
            .iter()
            .filter_map(|s| full[from..].find(s.as_str()).map(|p| from + p))
            .min();
        if let Some(p) = hit {
            let delta = if p > self.emitted.len() {
                full[self.emitted.len()..p].to_string()
            } else {
                String::new()
            };
            self.emitted.push_str(&delta);
            self.stopped = true;
            return Step {
                delta,
                stopped: true,
            };
        }
        let mut end = full.len();
        if full.ends_with('\u{FFFD}') {
            end -= '\u{FFFD}'.len_utf8();
        }
        // Hold back the longest suffix that is a proper prefix of a stop sequence.
        let mut hold = 0;
        for s in &self.stops {
            for k in (1..s.len()).rev() {
                if k <= end && s.is_char_boundary(k) && full[..end].ends_with(&s[..k]) {
                    hold = hold.max(k);
                    break;
                }
            }
        }
        let end = end - hold;
        if end <= self.emitted.len() {
            return Step::default();
        }
        let delta = full[self.emitted.len()..end].to_string();
        self.emitted.push_str(&delta);
        Step {
            delta,
            stopped: false,
        }
    }

    /// The sequence ended without a stop sequence: releases everything held back.
    pub fn finish(&mut self, tok: &Tokenizer) -> String {
        if self.stopped {
            return String::new();
        }
        let full = tok.decode(&self.ids).unwrap_or_default();
        match full.strip_prefix(self.emitted.as_str()) {
            Some(rest) if !rest.is_empty() => {
                let d = rest.to_string();
                self.emitted.push_str(&d);
                d
            }
            _ => String::new(),
        }
    }
}
