//! RAG workload generator and JSONL trace format.
//!
//! A request is a list of segment texts: a shared system prompt, `k` documents
//! drawn by Zipf popularity (without replacement) in shuffled order, and a question.
//! A fraction of requests continue an earlier session: the previous turn's segments,
//! a synthetic answer, and a new question (the private pool's prefix case).
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::{Deserialize, Serialize};
use std::io::{BufRead, Write};
use std::path::Path;

/// One request of a workload (one JSONL line of a trace).
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct TraceRecord {
    /// Arrival time in seconds from the start (optional in a trace file; the
    /// arrival process fills it otherwise).
    #[serde(default)]
    pub t: Option<f64>,
    /// Segment texts in prompt order; the last is the query.
    pub segments: Vec<String>,
    /// Generated tokens (default: the bench's `--max-tokens`).
    #[serde(default)]
    pub max_tokens: Option<usize>,
    /// Session id (multi-turn requests share one).
    #[serde(default)]
    pub session: Option<u64>,
}

/// Workload generator settings.
#[derive(Clone, Debug, Serialize)]
pub struct WorkloadSpec {
    /// Requests.
    pub requests: usize,
    /// Documents in the corpus.
    pub docs: usize,
    /// Documents per request.
    pub docs_per_request: usize,
    /// Zipf exponent of document popularity.
    pub zipf_s: f64,
    /// Words per document.
    pub doc_words: usize,
    /// Words of the shared system prompt.
    pub system_words: usize,
    /// Words per question.
    pub query_words: usize,
    /// Fraction of requests that continue an earlier session.
    pub multi_turn: f64,
    /// RNG seed.
    pub seed: u64,
}

const WORDS: &[&str] = &[
    "the",
    "of",
    "and",
    "to",
    "in",
    "is",
    "that",
    "for",
    "it",
    "as",
    "was",
    "with",
    "be",
    "by",
    "on",
    "not",
    "he",
    "this",
    "are",
    "or",
    "his",
    "from",
    "at",
    "which",
    "but",
    "have",
    "an",
    "had",
    "they",
    "you",
    "were",
    "their",
    "one",
    "all",
    "we",
    "can",
    "her",
    "has",
    "there",
    "been",
    "if",
    "more",
    "when",
    "will",
    "would",
    "who",
    "so",
    "no",
    "model",
    "cache",
    "state",
    "segment",
    "document",
    "layer",
    "token",
    "memory",
    "river",
    "city",
    "market",
    "system",
    "light",
    "water",
    "north",
    "south",
    "year",
    "time",
    "people",
    "way",
    "day",
    "man",
    "thing",
    "woman",
    "life",
    "child",
    "world",
    "school",
    "family",
    "student",
    "group",
    "country",
    "problem",
    "hand",
    "part",
    "place",
    "case",
    "week",
    "company",
    "number",
    "night",
    "point",
    "home",
    "room",
    "mother",
    "area",
    "money",
    "story",
    "fact",
    "month",
    "lot",
    "right",
    "study",
    "book",
    "eye",
    "job",
    "word",
    "business",
    "issue",
    "side",
    "kind",
    "head",
    "house",
    "service",
    "friend",
    "father",
    "power",
    "hour",
    "game",
    "line",
    "end",
    "member",
    "law",
    "car",
    "name",
    "president",
    "team",
    "minute",
    "idea",
    "kid",
    "body",
    "information",
    "back",
    "parent",
    "face",
    "others",
    "level",
    "office",
    "door",
    "health",
    "person",
    "art",
    "war",
    "history",
    "party",
    "result",
    "change",
    "morning",
    "reason",
    "research",
    "girl",
    "guy",
    "moment",
    "air",
    "teacher",
    "force",
    "education",
    "small",
    "large",
    "new",
    "old",
    "great",
    "high",
    "early",
    "young",
    "important",
    "few",
    "public",
    "bad",
    "same",
    "able",
    "green",
    "quiet",
    "bright",
    "heavy",
    "simple",
    "ancient",
    "modern",
    "local",
    "rapid",
    "steady",
];

fn words(rng: &mut StdRng, n: usize) -> String {
    let mut s = String::with_capacity(n * 6);
    for i in 0..n {
        if i > 0 {
            s.push(' ');
        }
        s.push_str(WORDS[rng.random_range(0..WORDS.len())]);
    }
    s
}

/// Zipf sampler over `0..n` with exponent `s` (rank 0 most popular).
pub struct Zipf {
    cdf: Vec<f64>,
}

impl Zipf {
    /// New sampler.
    pub fn new(n: usize, s: f64) -> Self {
        let mut acc = 0.0;
        let mut cdf: Vec<f64> = (0..n.max(1))
            .map(|k| {
                acc += 1.0 / ((k + 1) as f64).powf(s);
                acc
            })
            .collect();
        let total = acc;
        cdf.iter_mut().for_each(|x| *x /= total);
        Zipf { cdf }
    }
    /// One draw.
    pub fn sample(&self, rng: &mut StdRng) -> usize {
        let u: f64 = rng.random();
        self.cdf.partition_point(|&c| c < u).min(self.cdf.len() - 1)
    }
}

/// Generates a workload (arrival times left empty).
pub fn generate(spec: &WorkloadSpec) -> Vec<TraceRecord> {
    let mut rng = StdRng::seed_from_u64(spec.seed);
    let system = format!(
        "You are a helpful assistant. Answer from the documents. {}",
        words(&mut rng, spec.system_words)
    );
    let docs: Vec<String> = (0..spec.docs)
        .map(|i| format!("Document {i}. {}", words(&mut rng, spec.doc_words)))
        .collect();
    let zipf = Zipf::new(spec.docs, spec.zipf_s);
    let k = spec.docs_per_request.min(spec.docs).max(1);
    let mut sessions: Vec<(u64, Vec<String>)> = vec![];
    let mut out = Vec::with_capacity(spec.requests);
    for _ in 0..spec.requests {
        let cont = !sessions.is_empty() && rng.random::<f64>() < spec.multi_turn;
        if cont {
            let j = rng.random_range(0..sessions.len());
            let (sid, prev) = sessions[j].clone();
            let mut segs = prev;
            segs.push(format!("Answer: {}", words(&mut rng, 12)));
            segs.push(format!(
                "Follow-up question: {}?",
                words(&mut rng, spec.query_words)
            ));
            sessions[j].1 = segs.clone();
            out.push(TraceRecord {
                t: None,
                segments: segs,
                max_tokens: None,
                session: Some(sid),
            });
            continue;
        }
        let mut picked: Vec<usize> = Vec::with_capacity(k);
        let mut guard = 0;
        while picked.len() < k && guard < 10_000 {
            let d = zipf.sample(&mut rng);
            if !picked.contains(&d) {
                picked.push(d);
            }
            guard += 1;
        }
        // Shuffle the retrieved order (Fisher–Yates).
        for i in (1..picked.len()).rev() {
            let j = rng.random_range(0..=i);
            picked.swap(i, j);
        }
        let mut segs = vec![system.clone()];
        segs.extend(picked.iter().map(|&d| docs[d].clone()));
        segs.push(format!("Question: {}?", words(&mut rng, spec.query_words)));
        let sid = sessions.len() as u64;
        sessions.push((sid, segs.clone()));
        out.push(TraceRecord {
            t: None,
            segments: segs,
            max_tokens: None,
            session: Some(sid),
        });
    }
    out
}

/// Poisson arrivals at `rate` requests/s (exponential gaps), seeded.
pub fn poisson_arrivals(n: usize, rate: f64, seed: u64) -> Vec<f64> {
    let mut rng = StdRng::seed_from_u64(seed ^ 0x9e37_79b9_7f4a_7c15);
    let mut t = 0.0;
    (0..n)
        .map(|_| {
            let u: f64 = rng.random();
            let at = t;
            t += -(1.0 - u).ln() / rate.max(1e-9);
            at
        })
        .collect()
}

/// Reads a JSONL trace (blank lines and `#` comments skipped).
pub fn read_trace(path: &Path) -> anyhow::Result<Vec<TraceRecord>> {
    let f = std::fs::File::open(path)
        .map_err(|e| anyhow::anyhow!("opening trace {}: {e}", path.display()))?;
    let mut out = vec![];
    for (i, line) in std::io::BufReader::new(f).lines().enumerate() {
        let line = line?;
        let l = line.trim();
        if l.is_empty() || l.starts_with('#') {
            continue;
        }
        let r: TraceRecord = serde_json::from_str(l)
            .map_err(|e| anyhow::anyhow!("{}:{}: {e}", path.display(), i + 1))?;
        if r.segments.is_empty() || r.segments.iter().all(|s| s.is_empty()) {
            anyhow::bail!(
                "{}:{}: a record needs non-empty segments",
                path.display(),
                i + 1
            );
        }
        out.push(r);
    }
    if out.is_empty() {
        anyhow::bail!("trace {} has no records", path.display());
    }
    Ok(out)
}

/// Writes a JSONL trace.
pub fn write_trace(path: &Path, recs: &[TraceRecord]) -> anyhow::Result<()> {
    if let Some(d) = path.parent() {
        std::fs::create_dir_all(d)?;
    }
    let mut f = std::io::BufWriter::new(std::fs::File::create(path)?);
    for r in recs {
        writeln!(f, "{}", serde_json::to_string(r)?)?;
    }
    Ok(())
}
