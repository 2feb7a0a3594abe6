//! Scheduler behaviour: streaming order, stop tokens, cancellation frees state,
//! bounded queue, queue timeout, KV-budget admission, the token-budget loop, and
//! prefills of several requests batched into one forward (each as alone).
use dataplane::model::Model;
use dataplane::pic::{Mode, PicEngine, SegmentRef};
use dataplane::sampling::{Constraint, ConstraintSpec, SamplingParams, TokenConstraint};
use dataplane::scheduler::{
    ErrorKind, FinishReason, GenEvent, GenRequest, Scheduler, SchedulerConfig, SubmitError,
};
use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

fn engine() -> Arc<PicEngine> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/golden/qwen3_next");
    Arc::new(PicEngine::new(
        Arc::new(Model::load(&dir, &mut |_, _| {}).unwrap()),
        "g",
        1 << 28,
        1 << 28,
    ))
}

fn req(seed: u32, max_tokens: usize) -> GenRequest {
    GenRequest {
        segments: vec![
            SegmentRef {
                tokens: (0..20).map(|i| (i * 7 + seed) % 300).collect(),
                isolation: "t".into(),
            },
            SegmentRef {
                tokens: (0..30).map(|i| (i * 11 + seed) % 300).collect(),
                isolation: "t".into(),
            },
        ],
        mode: Mode::hypic_default(),
        tenant: "t".into(),
        sampling: SamplingParams::default(),
        max_tokens,
        stop_token_ids: vec![],
        top_logprobs: 2,
        logprobs: true,
        score: None,
    }
}

fn collect(h: &mut dataplane::scheduler::RequestHandle) -> Vec<GenEvent> {
    let mut v = vec![];
    while let Some(e) = h.events.blocking_recv() {
        let end = matches!(e, GenEvent::Done { .. } | GenEvent::Error { .. });
        v.push(e);
        if end {
            break;
        }
    }
    v
}

#[test]
fn streams_started_tokens_done_and_matches_engine_greedy() {
    let e = engine();
    let s = Scheduler::start(e.clone(), SchedulerConfig::default());
    let mut h = s.submit(req(1, 6)).unwrap();
    let ev = collect(&mut h);
    assert!(matches!(
        ev[0],
        GenEvent::Started {
            prompt_tokens: 50,
            ..
        }
    ));
    let toks: Vec<u32> = ev
        .iter()
        .filter_map(|e| match e {
            GenEvent::Token {
                id, logprob, top, ..
            } => {
                assert_eq!(top.len(), 2);
                assert!(*logprob <= 0.0 && top[0].1 >= *logprob - 1e-6);
                Some(*id)
            }
            _ => None,
        })
        .collect();
    assert_eq!(toks.len(), 6);
    assert!(matches!(
        ev.last(),
        Some(GenEvent::Done {
            reason: FinishReason::Length,
            generated: 6
        })
    ));
    // Same as running the engine and greedy-decoding by hand.
    let r = req(1, 6);
    let out = e.run(&r.segments, Mode::FullRecompute, "other").unwrap();
    let mut st = out.state;
    let mut want = vec![dataplane::sampling::argmax(&out.logits)];
    while want.len() < 6 {
        let l = e.model().decode(*want.last().unwrap(), &mut st).unwrap();
        want.push(dataplane::sampling::argmax(&l));
    }
    // hypic with a 2-segment prompt reuses only the first segment whole: exact.
    assert_eq!(toks, want);
    // A stop token ends the stream without being emitted.
    let mut r = req(1, 6);
    r.stop_token_ids = vec![want[2]];
    let ev = collect(&mut s.submit(r).unwrap());
    let n = ev
        .iter()
        .filter(|e| matches!(e, GenEvent::Token { .. }))
        .count();
    let first = want.iter().position(|&t| t == want[2]).unwrap();
    assert_eq!(n, first);
    assert!(matches!(
        ev.last(),
        Some(GenEvent::Done {
            reason: FinishReason::Stop,
            ..
        })
    ));
}

#[test]
fn cancellation_frees_state_and_slots() {
    let s = Scheduler::start(
        engine(),
        SchedulerConfig {
            max_running: 2,
            ..Default::default()
        },
    );
    let m = s.metrics();
    let mut handles: Vec<_> = (0..2).map(|i| s.submit(req(i, 4000)).unwrap()).collect();
    // Wait until both are decoding.
    for h in handles.iter_mut() {
        assert!(matches!(
            h.events.blocking_recv(),
            Some(GenEvent::Started { .. })
        ));
    }
    let t0 = Instant::now();
    while m.running.load(Ordering::Relaxed) != 2 {
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "both requests should be running"
        );
        std::thread::sleep(Duration::from_millis(2));
    }
    assert!(m.state_bytes.load(Ordering::Relaxed) > 0);
    drop(handles);
    let t0 = Instant::now();
    while m.running.load(Ordering::Relaxed) != 0 || m.state_bytes.load(Ordering::Relaxed) != 0 {
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "cancelled requests still running"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_eq!(m.kv_reserved_bytes.load(Ordering::Relaxed), 0);
    assert!(m.cancelled.load(Ordering::Relaxed) >= 2);
    // The freed slots serve new requests.
    let ev = collect(&mut s.submit(req(5, 3)).unwrap());
    assert!(matches!(
        ev.last(),
        Some(GenEvent::Done {
            reason: FinishReason::Length,
            ..
        })
    ));
}

#[test]
fn full_queue_is_refused_and_queue_timeout_is_reported() {
    let cfg = SchedulerConfig {
        queue_capacity: 2,
        max_running: 1,
        queue_timeout: Duration::from_millis(300),
        ..Default::default()
    };
    let s = Scheduler::start(engine(), cfg);
    let mut busy = s.submit(req(0, 4000)).unwrap();
    assert!(matches!(
        busy.events.blocking_recv(),
        Some(GenEvent::Started { .. })
    ));
    let mut a = s.submit(req(1, 2)).unwrap();
    let _b = s.submit(req(2, 2)).unwrap();
    let err = s.submit(req(3, 2)).err().unwrap();
    assert!(matches!(
        err,
        SubmitError::QueueFull {
            capacity: 2,
            retry_after_s: 1
        }
    ));
    // `a` cannot be admitted while `busy` holds the only slot: it times out.
    match a.events.blocking_recv() {
        Some(GenEvent::Error {
            kind: ErrorKind::QueueTimeout,
            ..
        }) => {}
        other => panic!("expected a queue timeout, got {other:?}"),
    }
    assert!(s.metrics().queue_timeouts.load(Ordering::Relaxed) >= 1);
    busy.cancel();
}

#[test]
fn invalid_requests_are_refused_at_submit() {
    let s = Scheduler::start(
        engine(),
        SchedulerConfig {
            kv_budget_bytes: 100_000,
            ..Default::default()
        },
    );
    let mut r = req(0, 0);
    assert!(
        matches!(s.submit(r.clone()), Err(SubmitError::Invalid(m)) if m.contains("max_tokens"))
    );
    r.max_tokens = 10_000_000;
    assert!(
        matches!(s.submit(r.clone()), Err(SubmitError::Invalid(m)) if m.contains("context limit"))
    );
    r.max_tokens = 3000;
    assert!(matches!(s.submit(r.clone()), Err(SubmitError::Invalid(m)) if m.contains("KV")));
    r.max_tokens = 2;
    r.segments[1].tokens.clear();
    assert!(
        matches!(s.submit(r.clone()), Err(SubmitError::Invalid(m)) if m.contains("segment 1 is empty"))
    );
    r.segments.clear();
    assert!(matches!(s.submit(r), Err(SubmitError::Invalid(_))));
}

/// `GenRequest::score`: a continuation scored teacher-forced on a fork of the
/// prompt state, inside the batched decode step (here beside another running
/// request): `Scored` comes after `Started` and before the first token, carries the
/// prompt's logits and each target's NLL as single-token decoding computes them,
/// and the generated tokens are those of the same request without `score`.
#[test]
fn a_scored_request_reports_the_teacher_forced_nll_and_generates_as_without() {
    let e = engine();
    let s = Scheduler::start(e.clone(), SchedulerConfig::default());
    let targets = vec![5u32, 77, 140, 9];
    let plain = collect(&mut s.submit(req(3, 5)).unwrap());
    let toks = |ev: &[GenEvent]| -> Vec<u32> {
        ev.iter()
            .filter_map(|e| match e {
                GenEvent::Token { id, .. } => Some(*id),
                _ => None,
            })
            .collect()
    };
    let mut busy = s.submit(req(8, 40)).unwrap();
    let mut r = req(3, 5);
    r.score = Some(targets.clone());
    let ev = collect(&mut s.submit(r).unwrap());
    assert!(matches!(ev[0], GenEvent::Started { .. }), "{:?}", ev[0]);
    let GenEvent::Scored {
        prompt_logits,
        token_nll,
    } = &ev[1]
    else {
        panic!("second event {:?}", ev[1]);
    };
    assert!(matches!(ev[2], GenEvent::Token { .. }));
    assert_eq!(toks(&ev), toks(&plain));
    assert!(matches!(
        ev.last(),
        Some(GenEvent::Done { generated: 5, .. })
    ));
    // By hand: the engine's prompt logits, then one decode per target.
    let rq = req(3, 5);
    let out = e.run(&rq.segments, rq.mode, "other").unwrap();
    let nll = |l: &[f32], t: u32| {
        let m = l.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
        let lse = m + l.iter().map(|&x| (x as f64 - m).exp()).sum::<f64>().ln();
        lse - l[t as usize] as f64
    };
    let rel = |a: &[f32], b: &[f32]| {
        let d: f32 = a.iter().zip(b).map(|(x, y)| (x - y) * (x - y)).sum();
        let n: f32 = b.iter().map(|y| y * y).sum();
        (d / n).sqrt()
    };
    assert!(rel(prompt_logits, &out.logits) < 1e-5);
    let (mut st, mut l) = (out.state, out.logits);
    assert_eq!(token_nll.len(), targets.len());
    for (k, &t) in targets.iter().enumerate() {
        let want = nll(&l, t);
        assert!(
            (token_nll[k] - want).abs() < 1e-4 * (1.0 + want.abs()),
            "target {k}: {} vs {want}",
            token_nll[k]
        );
        l = e.model().decode(t, &mut st).unwrap();
    }
    busy.cancel();
    let _ = collect(&mut busy);
    // A scored token outside the vocabulary is refused at submission.
    let mut bad = req(3, 2);
    bad.score = Some(vec![1, u32::MAX]);
    assert!(matches!(s.submit(bad), Err(SubmitError::Invalid(m)) if m.contains("vocabulary")));
    // One target: scored by the prompt's logits alone, no fork.
    let mut one = req(3, 2);
    one.score = Some(vec![targets[0]]);
    let ev = collect(&mut s.submit(one).unwrap());
    assert!(
        matches!(&ev[1], GenEvent::Scored { token_nll, .. } if token_nll.len() == 1),
        "{:?}",
        ev[1]
    );
    assert_eq!(toks(&ev), toks(&plain)[..2].to_vec());
}

/// Allows `script[i]` at step i, then only `end`; rejects anything else at commit.
struct Script {
    script: Vec<u32>,
    end: u32,
}
struct ScriptState(Vec<u32>, u32);
impl ConstraintSpec for Script {
    fn describe(&self) -> String {
        "script".into()
    }
    fn start(&self) -> Result<Box<dyn TokenConstraint>, String> {
        Ok(Box::new(ScriptState(
            self.script.iter().rev().copied().collect(),
            self.end,
        )))
    }
}
impl TokenConstraint for ScriptState {
    fn mask(&mut self, logits: &mut [f32]) -> Result<(), String> {
        let allow = *self.0.last().unwrap_or(&self.1);
        if allow == u32::MAX {
            return Err("the grammar is in an error state".into());
        }
        for (i, l) in logits.iter_mut().enumerate() {
            if i as u32 != allow {
                *l = f32::NEG_INFINITY;
            }
        }
        Ok(())
    }
    fn commit(&mut self, token: u32) -> Result<(), String> {
        let want = self.0.pop().unwrap_or(self.1);
        (token == want)
            .then_some(())
            .ok_or_else(|| format!("token {token} not allowed"))
    }
}

#[test]
fn a_constraint_drives_each_sequence_of_a_batch_and_its_failure_is_an_error_event() {
    let e = engine();
    let s = Scheduler::start(e.clone(), SchedulerConfig::default());
    let with = |script: Vec<u32>, end: u32, seed: u32| {
        let mut r = req(seed, 8);
        r.stop_token_ids = vec![end];
        r.sampling.constraint = Some(Constraint(Arc::new(Script { script, end })));
        r
    };
    // Two constrained sequences and one free one decode in the same batch.
    let mut a = s.submit(with(vec![5, 6, 5], 9, 1)).unwrap();
    let mut b = s.submit(with(vec![17, 18], 11, 2)).unwrap();
    let mut free = s.submit(req(3, 4)).unwrap();
    let ids = |ev: &[GenEvent]| -> Vec<u32> {
        ev.iter()
            .filter_map(|e| match e {
                GenEvent::Token { id, .. } => Some(*id),
                _ => None,
            })
            .collect()
    };
    let (ea, eb, ef) = (collect(&mut a), collect(&mut b), collect(&mut free));
    assert_eq!(ids(&ea), vec![5, 6, 5]);
    assert!(matches!(
        ea.last(),
        Some(GenEvent::Done {
            reason: FinishReason::Stop,
            generated: 3
        })
    ));
    assert_eq!(ids(&eb), vec![17, 18]);
    assert_eq!(ids(&ef).len(), 4);
    // A constraint in an error state after one token ends its sequence with an error.
    let mut bad = s.submit(with(vec![5, u32::MAX], 9, 4)).unwrap();
    let ev = collect(&mut bad);
    assert_eq!(ids(&ev), vec![5]);
    match ev.last() {
        Some(GenEvent::Error { kind, message }) => {
            assert_eq!(*kind, ErrorKind::Internal);
            assert!(message.contains("error state"), "{message}");
        }
        other => panic!("expected an error, got {other:?}"),
    }
    // Nothing leaks: all slots and reservations are back.
    let m = s.metrics();
    let t0 = Instant::now();
    while m.running.load(Ordering::Relaxed) != 0 && t0.elapsed() < Duration::from_secs(5) {
        std::thread::sleep(Duration::from_millis(10));
    }
    assert_eq!(m.running.load(Ordering::Relaxed), 0);
    assert_eq!(m.kv_reserved_bytes.load(Ordering::Relaxed), 0);
}

/// A prompt of one segment of `len` tokens (full recompute: every token computed).
fn long_req(seed: u32, len: usize, max_tokens: usize) -> GenRequest {
    GenRequest {
        segments: vec![SegmentRef {
            tokens: (0..len as u32).map(|i| (i * 13 + seed) % 300).collect(),
            isolation: "t".into(),
        }],
        mode: Mode::FullRecompute,
        top_logprobs: 0,
        ..req(seed, max_tokens)
    }
}

/// `(admitted_step, step)` of the `Started` event.
fn started_step(ev: &[GenEvent]) -> (u64, u64) {
    ev.iter()
        .find_map(|e| match e {
            GenEvent::Started {
                step,
                admitted_step,
                ..
            } => Some((*admitted_step, *step)),
            _ => None,
        })
        .expect("a Started event")
}

fn token_steps(ev: &[GenEvent]) -> Vec<u64> {
    ev.iter()
        .filter_map(|e| match e {
            GenEvent::Token { step, .. } => Some(*step),
            _ => None,
        })
        .collect()
}

/// The token-budget loop, by step numbers: a short request submitted after a long
/// cold prompt gets its first token while the long one is still being prefilled
/// (in pieces of at most the step budget), and the long prompt, processed in many
/// steps, still gives the tokens of the one-call engine.
#[test]
fn a_short_request_behind_a_long_prompt_starts_before_the_long_one_finishes() {
    let e = engine();
    let cfg = SchedulerConfig {
        step_tokens: 128,
        prefill_chunk_tokens: 64,
        ..Default::default()
    };
    let s = Scheduler::start(e.clone(), cfg);
    let long = long_req(3, 2000, 3);
    let mut hl = s.submit(long.clone()).unwrap();
    let mut hs = s.submit(long_req(5, 27, 3)).unwrap();
    let (el, es) = (collect(&mut hl), collect(&mut hs));
    let ((al, sl), (a_s, ss)) = (started_step(&el), started_step(&es));
    // 2000 tokens at most 128 a step: at least 16 steps of prefill.
    assert!(sl >= al + 15, "long admitted at step {al}, started at {sl}");
    assert!(ss < sl, "short started at step {ss}, long at {sl}");
    // Bounded waiting: the short one gets its whole prompt in the step that admits
    // it (the long one takes 64 tokens of that step's first pass).
    assert_eq!(ss, a_s, "short admitted at step {a_s}, started at {ss}");
    let prefill = s.metrics().prefill_tokens.load(Ordering::Relaxed);
    assert_eq!(prefill, 2027);
    // Same tokens as the one-call engine, greedy.
    let out = e.run(&long.segments, Mode::FullRecompute, "other").unwrap();
    let mut st = out.state;
    let mut want = vec![dataplane::sampling::argmax(&out.logits)];
    while want.len() < 3 {
        let l = e.model().decode(*want.last().unwrap(), &mut st).unwrap();
        want.push(dataplane::sampling::argmax(&l));
    }
    let got: Vec<u32> = el
        .iter()
        .filter_map(|e| match e {
            GenEvent::Token { id, .. } => Some(*id),
            _ => None,
        })
        .collect();
    assert_eq!(got, want);
}

/// A running stream gets a token in every step while a long prompt is prefilled
/// beside it: its tokens' step numbers are consecutive across the long prompt's
/// prefill, which takes many steps.
#[test]
fn decode_streams_emit_every_step_during_a_long_prefill() {
    let e = engine();
    let cfg = SchedulerConfig {
        step_tokens: 128,
        prefill_chunk_tokens: 64,
        ..Default::default()
    };
    let s = Scheduler::start(e, cfg);
    let mut stream = s.submit(long_req(1, 20, 4000)).unwrap();
    assert!(matches!(
        stream.events.blocking_recv(),
        Some(GenEvent::Started { .. })
    ));
    let mut hl = s.submit(long_req(2, 1500, 1)).unwrap();
    let el = collect(&mut hl);
    let (al, sl) = started_step(&el);
    stream.cancel();
    let es = collect(&mut stream);
    let steps = token_steps(&es);
    // 1500 tokens at most 127 a step beside one decode token: ≥ 12 steps.
    assert!(sl >= al + 11, "long admitted at step {al}, started at {sl}");
    // The stream's tokens in the steps of the long prompt's prefill: one per step
    // (the last such step left out: the stream may be cancelled before its decode).
    let during: Vec<u64> = steps
        .iter()
        .copied()
        .filter(|&t| (al..sl).contains(&t))
        .collect();
    assert_eq!(
        during,
        (al..sl).collect::<Vec<_>>(),
        "a step without a token"
    );
}

/// Segment registration through the scheduler (`POST /v1/segments`): a long
/// segment is built in pieces of the step budget while a running stream keeps
/// getting a token every step, its entries land in the public pool, and a request
/// that uses them gives the logits of entries built in one pass (up to the fp32
/// rounding of composing the pieces' transition pairs).
#[test]
fn a_segment_registration_is_built_in_pieces_beside_running_streams() {
    let e = engine();
    let cfg = SchedulerConfig {
        step_tokens: 128,
        prefill_chunk_tokens: 64,
        ..Default::default()
    };
    let s = Scheduler::start(e.clone(), cfg);
    let mut stream = s.submit(long_req(1, 20, 4000)).unwrap();
    assert!(matches!(
        stream.events.blocking_recv(),
        Some(GenEvent::Started { .. })
    ));
    let seg: Vec<u32> = (0..1500u32).map(|i| (i * 17 + 5) % 300).collect();
    let w = Mode::hypic_default().body_start(1);
    let before = s.metrics().steps.load(Ordering::Relaxed);
    let rx = s.register(seg.clone(), "t".into(), vec![0, w]).unwrap();
    let got = rx.blocking_recv().expect("an answer").expect("built");
    let after = s.metrics().steps.load(Ordering::Relaxed);
    stream.cancel();
    let steps = token_steps(&collect(&mut stream));
    assert_eq!(got.len(), 2);
    for (st, bytes) in &got {
        assert_eq!(*st, dataplane::pic::Prefetch::Stored);
        assert!(*bytes > 0);
    }
    assert_eq!(
        s.metrics().registration_tokens.load(Ordering::Relaxed),
        1500
    );
    assert_eq!(s.metrics().registering.load(Ordering::Relaxed), 0);
    // 1500 tokens at most 127 a step beside one decode token: ≥ 12 steps, and the
    // stream got a token in each of them.
    assert!(after >= before + 11, "steps {before}..{after}");
    // (The step that ends the stream's prefill carries its first token and its
    // first decoded one.)
    let mut during: Vec<u64> = steps
        .iter()
        .copied()
        .filter(|&t| (before + 1..after).contains(&t))
        .collect();
    during.dedup();
    assert_eq!(
        during,
        (before + 1..after).collect::<Vec<_>>(),
        "a step without a token"
    );
    // A request over the registered segment hits it; its logits equal those of an
    // engine whose entries were built in one pass.
    let segments = vec![
        SegmentRef {
            tokens: (0..40).map(|i| (i * 3 + 1) % 300).collect(),
            isolation: "t".into(),
        },
        SegmentRef {
            tokens: seg.clone(),
            isolation: "t".into(),
        },
        SegmentRef {
            tokens: (0..12).map(|i| (i * 5 + 2) % 300).collect(),
            isolation: "t".into(),
        },
    ];
    let a = e.run(&segments, Mode::hypic_default(), "t").unwrap();
    assert_eq!(
        a.stats.segments[1].outcome,
        dataplane::pic::Outcome::Hit,
        "{:?}",
        a.stats.segments
    );
    let fresh = engine();
    let one = fresh.prefetch_many(&seg, "t", &[0, w]).unwrap();
    assert_eq!(
        one.iter().map(|r| r.0).collect::<Vec<_>>(),
        vec![dataplane::pic::Prefetch::Stored; 2]
    );
    let b = fresh.run(&segments, Mode::hypic_default(), "t").unwrap();
    let scale = b.logits.iter().fold(0f32, |m, x| m.max(x.abs()));
    let diff = a
        .logits
        .iter()
        .zip(&b.logits)
        .fold(0f32, |m, (x, y)| m.max((x - y).abs()));
    assert!(diff <= 1e-4 * scale, "max |Δ| {diff} (scale {scale})");
    // Bad input is refused at submission.
    assert!(matches!(
        s.register(vec![], "t".into(), vec![0]),
        Err(SubmitError::Invalid(_))
    ));
    assert!(matches!(
        s.register(vec![1_000_000], "t".into(), vec![0]),
        Err(SubmitError::Invalid(_))
    ));
}

/// Requests prefilling at the same time share batched forwards (one forward runs
/// several requests' pieces: the scheduler's metrics count them), every prompt
/// token is run once, and each request answers what it answers alone (greedy,
/// against the one-call engine).
#[test]
fn concurrent_prefills_share_batched_forwards_and_answer_as_alone() {
    let e = engine();
    let cfg = SchedulerConfig {
        step_tokens: 256,
        prefill_chunk_tokens: 64,
        ..Default::default()
    };
    let s = Scheduler::start(e.clone(), cfg);
    let reqs: Vec<GenRequest> = (0..4u32)
        .map(|i| long_req(40 + i, 300 + 37 * i as usize, 4))
        .collect();
    let mut hs: Vec<_> = reqs.iter().map(|r| s.submit(r.clone()).unwrap()).collect();
    let got: Vec<Vec<u32>> = hs
        .iter_mut()
        .map(|h| {
            collect(h)
                .iter()
                .filter_map(|e| match e {
                    GenEvent::Token { id, .. } => Some(*id),
                    _ => None,
                })
                .collect()
        })
        .collect();
    let m = s.metrics();
    let (batches, in_batches) = (
        m.batched_prefills.load(Ordering::Relaxed),
        m.batched_prefill_requests.load(Ordering::Relaxed),
    );
    assert!(
        batches >= 1 && in_batches >= 2 * batches,
        "{batches} batched forwards of {in_batches} requests' pieces"
    );
    let prompt: usize = reqs.iter().map(|r| r.segments[0].tokens.len()).sum();
    assert_eq!(m.prefill_tokens.load(Ordering::Relaxed), prompt as u64);
    for (i, (r, g)) in reqs.iter().zip(&got).enumerate() {
        let out = e.run(&r.segments, Mode::FullRecompute, "alone").unwrap();
        let mut st = out.state;
        let mut want = vec![dataplane::sampling::argmax(&out.logits)];
        while want.len() < 4 {
            let l = e.model().decode(*want.last().unwrap(), &mut st).unwrap();
            want.push(dataplane::sampling::argmax(&l));
        }
        assert_eq!(g, &want, "request {i}");
    }
}

// Batched prefills across requests (each request as alone: start step, statistics,
// pool counters, prefix reuse). Requests submitted together are usually admitted in
// the same step; the tests retry until they were, and check only those runs.

/// One segment of `len` tokens (ids below 300).
fn bseg(seed: u32, len: usize) -> SegmentRef {
    SegmentRef {
        tokens: (0..len as u32).map(|i| (i * 13 + seed) % 300).collect(),
        isolation: "t".into(),
    }
}

/// A request over `segments` (greedy, 3 top log-probabilities).
fn breq(segments: Vec<SegmentRef>, mode: Mode, tenant: &str, max_tokens: usize) -> GenRequest {
    GenRequest {
        segments,
        mode,
        tenant: tenant.into(),
        sampling: SamplingParams::default(),
        max_tokens,
        stop_token_ids: vec![],
        top_logprobs: 3,
        logprobs: true,
        score: None,
    }
}

/// `(admitted_step, step)` of the `Started` event.
fn started_at(ev: &[GenEvent]) -> (u64, u64) {
    ev.iter()
        .find_map(|e| match e {
            GenEvent::Started {
                step,
                admitted_step,
                ..
            } => Some((*admitted_step, *step)),
            _ => None,
        })
        .unwrap_or_else(|| panic!("no Started: {ev:?}"))
}

/// Two short queries admitted together whose pieces fill the step budget exactly:
/// both finish their prompts in the batched forward, so both should start (and get
/// their first token) in the step that admitted them, as each would alone.
#[test]
fn batched_queries_that_end_their_prompt_start_in_that_step() {
    let mut checked = 0;
    for attempt in 0..6u32 {
        let e = engine();
        let cfg = SchedulerConfig {
            step_tokens: 10,
            prefill_chunk_tokens: 64,
            ..Default::default()
        };
        let s = Scheduler::start(e, cfg);
        let mut h1 = s
            .submit(breq(
                vec![bseg(attempt * 2 + 1, 5)],
                Mode::FullRecompute,
                "a",
                2,
            ))
            .unwrap();
        let mut h2 = s
            .submit(breq(
                vec![bseg(attempt * 2 + 2, 5)],
                Mode::FullRecompute,
                "b",
                2,
            ))
            .unwrap();
        let (e1, e2) = (collect(&mut h1), collect(&mut h2));
        let ((a1, s1), (a2, s2)) = (started_at(&e1), started_at(&e2));
        println!("attempt {attempt}: r1 admitted {a1} started {s1}; r2 admitted {a2} started {s2}; batches {}",
            s.metrics().batched_prefills.load(Ordering::Relaxed));
        assert_eq!(s.metrics().prefill_tokens.load(Ordering::Relaxed), 10);
        if a1 != a2 {
            continue;
        }
        checked += 1;
        assert_eq!(
            (s1, s2),
            (a1, a2),
            "a batched request finished its prompt a step late"
        );
    }
    assert!(checked > 0, "never admitted together");
}

/// The head of the queue is a whole-prompt prefix hit (no compute); the request
/// behind it should become the head and get its must-run piece even when the decode
/// tokens fill the budget.
#[test]
fn the_request_behind_a_prefix_hit_head_gets_the_head_piece() {
    let mut checked = 0;
    for attempt in 0..4u32 {
        let e = engine();
        let cfg = SchedulerConfig {
            step_tokens: 1,
            prefill_chunk_tokens: 64,
            ..Default::default()
        };
        let s = Scheduler::start(e, cfg);
        let hit = breq(vec![bseg(100, 12), bseg(101, 9)], Mode::PrefixCache, "p", 1);
        // Warm the private pool.
        let mut h = s.submit(hit.clone()).unwrap();
        collect(&mut h);
        // A stream that keeps the decode budget full (step_tokens 1, one running).
        let mut stream = s
            .submit(breq(vec![bseg(7, 5)], Mode::FullRecompute, "s", 4000))
            .unwrap();
        assert!(matches!(
            stream.events.blocking_recv(),
            Some(GenEvent::Started { .. })
        ));
        let mut hh = s.submit(hit.clone()).unwrap();
        let mut hh2 = s.submit(hit.clone()).unwrap();
        let mut hb = s
            .submit(breq(
                vec![bseg(200 + attempt, 20)],
                Mode::FullRecompute,
                "b",
                1,
            ))
            .unwrap();
        let (eh, eh2, eb) = (collect(&mut hh), collect(&mut hh2), collect(&mut hb));
        stream.cancel();
        let ((ah, sh), (ah2, sh2), (ab, sb)) = (started_at(&eh), started_at(&eh2), started_at(&eb));
        println!("attempt {attempt}: hit {ah}->{sh}, hit2 {ah2}->{sh2}, b {ab}->{sb}");
        if ah != ab || ah2 != ab {
            continue;
        }
        checked += 1;
        assert_eq!(sh, ah);
        assert_eq!(sh2, ah2, "the second prefix hit waited a step");
        assert_eq!(
            sb, ab,
            "the request behind prefix hits did not get the head piece"
        );
    }
    assert!(checked > 0, "never admitted together");
}

/// The first token's top log-probabilities.
fn first_logprobs(ev: &[GenEvent]) -> Vec<(u32, f32)> {
    ev.iter()
        .find_map(|e| match e {
            GenEvent::Token { top, .. } => Some(top.iter().map(|t| (t.0, t.1)).collect()),
            _ => None,
        })
        .unwrap()
}

/// Mixed modes in one batch (full recompute, prefix cache, HYPIC over warm public
/// entries): stats, first-token top logprobs and greedy tokens as alone.
#[test]
fn mixed_modes_batched_match_alone() {
    let reqs = vec![
        breq(vec![bseg(1, 40), bseg(2, 23)], Mode::FullRecompute, "a", 4),
        breq(vec![bseg(3, 30), bseg(4, 17)], Mode::PrefixCache, "b", 4),
        breq(
            vec![bseg(5, 50), bseg(6, 33), bseg(8, 11)],
            Mode::hypic_default(),
            "c",
            4,
        ),
        breq(vec![bseg(9, 50), bseg(10, 15)], Mode::NaiveAddition, "d", 4),
    ];
    // Alone: one scheduler each, fresh engine, public pool warmed for HYPIC / naive.
    let mut alone = vec![];
    for r in &reqs {
        let e = engine();
        if matches!(r.mode, Mode::Hypic { .. } | Mode::NaiveAddition) {
            e.run(&r.segments, r.mode, "warm").unwrap();
        }
        let s = Scheduler::start(
            e,
            SchedulerConfig {
                step_tokens: 256,
                prefill_chunk_tokens: 64,
                ..Default::default()
            },
        );
        let mut h = s.submit(r.clone()).unwrap();
        alone.push(collect(&mut h));
    }
    for attempt in 0..4 {
        let e = engine();
        for r in &reqs {
            if matches!(r.mode, Mode::Hypic { .. } | Mode::NaiveAddition) {
                e.run(&r.segments, r.mode, "warm").unwrap();
            }
        }
        let s = Scheduler::start(
            e,
            SchedulerConfig {
                step_tokens: 256,
                prefill_chunk_tokens: 64,
                ..Default::default()
            },
        );
        let mut hs: Vec<_> = reqs.iter().map(|r| s.submit(r.clone()).unwrap()).collect();
        let got: Vec<_> = hs.iter_mut().map(collect).collect();
        let m = s.metrics();
        println!(
            "attempt {attempt}: batches {} reqs {} prefill_tokens {}",
            m.batched_prefills.load(Ordering::Relaxed),
            m.batched_prefill_requests.load(Ordering::Relaxed),
            m.prefill_tokens.load(Ordering::Relaxed)
        );
        for (i, (g, a)) in got.iter().zip(&alone).enumerate() {
            let st = |ev: &[GenEvent]| {
                ev.iter()
                    .find_map(|e| match e {
                        GenEvent::Started { stats, .. } => Some(stats.clone()),
                        _ => None,
                    })
                    .unwrap()
            };
            assert_eq!(st(g), st(a), "request {i} stats");
            let toks = |ev: &[GenEvent]| {
                ev.iter()
                    .filter_map(|e| match e {
                        GenEvent::Token { id, .. } => Some(*id),
                        _ => None,
                    })
                    .collect::<Vec<_>>()
            };
            assert_eq!(toks(g), toks(a), "request {i} tokens");
            let (lg, la) = (first_logprobs(g), first_logprobs(a));
            for (x, y) in lg.iter().zip(&la) {
                assert_eq!(x.0, y.0, "request {i}");
                assert!((x.1 - y.1).abs() < 1e-3, "request {i}: {lg:?} vs {la:?}");
            }
            println!("request {i}: {lg:?} vs {la:?}");
        }
        if m.batched_prefills.load(Ordering::Relaxed) > 0 {
            return;
        }
    }
    panic!("never batched");
}

/// Public-pool lookups: a cold HYPIC request through the scheduler counts the same
/// misses as the one-call engine (each cold segment looked up once).
#[test]
fn scheduler_counts_each_public_miss_once() {
    let r = breq(
        vec![bseg(1, 40), bseg(2, 23), bseg(3, 9)],
        Mode::hypic_default(),
        "a",
        1,
    );
    let e1 = engine();
    e1.run(&r.segments, r.mode, "a").unwrap();
    let run_stats = e1.public_usage().2;
    let e2 = engine();
    let s = Scheduler::start(
        e2.clone(),
        SchedulerConfig {
            step_tokens: 256,
            prefill_chunk_tokens: 64,
            ..Default::default()
        },
    );
    let mut h = s.submit(r.clone()).unwrap();
    let ev = collect(&mut h);
    let sched_stats = e2.public_usage().2;
    println!("run: {run_stats:?}\nsched: {sched_stats:?}");
    let stats = ev
        .iter()
        .find_map(|e| match e {
            GenEvent::Started { stats, .. } => Some(stats.clone()),
            _ => None,
        })
        .unwrap();
    assert_eq!(stats.misses, 2);
    assert_eq!(
        sched_stats.misses, run_stats.misses,
        "public-pool misses double counted"
    );
}

/// Two identical prefix-cache requests admitted together: the second finds the
/// first one's snapshots (a full prefix hit, nothing computed), as it would behind
/// it alone.
#[test]
fn identical_prefix_cache_requests_admitted_together_reuse() {
    let mut checked = 0;
    for attempt in 0..4u32 {
        let e = engine();
        let s = Scheduler::start(
            e,
            SchedulerConfig {
                step_tokens: 256,
                prefill_chunk_tokens: 256,
                ..Default::default()
            },
        );
        let r = breq(
            vec![bseg(300 + attempt, 30), bseg(301, 12)],
            Mode::PrefixCache,
            "p",
            1,
        );
        let mut h1 = s.submit(r.clone()).unwrap();
        let mut h2 = s.submit(r.clone()).unwrap();
        let (e1, e2) = (collect(&mut h1), collect(&mut h2));
        let ((a1, _), (a2, _)) = (started_at(&e1), started_at(&e2));
        let st = |ev: &[GenEvent]| {
            ev.iter()
                .find_map(|e| match e {
                    GenEvent::Started { stats, .. } => Some(stats.clone()),
                    _ => None,
                })
                .unwrap()
        };
        let pt = s.metrics().prefill_tokens.load(Ordering::Relaxed);
        println!("attempt {attempt}: admitted {a1} {a2}; prefill_tokens {pt}; second: hits {} computed {}", st(&e2).hits, st(&e2).tokens_computed);
        if a1 != a2 {
            continue;
        }
        checked += 1;
        assert_eq!(pt, 42, "the second identical request was computed again");
    }
    assert!(checked > 0);
}

/// The RAG case: requests of different tenants whose documents are cached (HYPIC
/// over warm public entries) place their documents, then their questions run as one
/// batched forward in the same step, and each answers (statistics, greedy tokens)
/// as alone.
#[test]
fn questions_after_cached_documents_are_batched() {
    let docs = [bseg(61, 40), bseg(62, 33), bseg(63, 27)];
    let reqs: Vec<GenRequest> = (0..4u32)
        .map(|i| {
            let mut segs = vec![
                docs[(i % 3) as usize].clone(),
                docs[((i + 1) % 3) as usize].clone(),
            ];
            segs.push(bseg(70 + i, 9 + i as usize));
            breq(segs, Mode::hypic_default(), &format!("tenant{i}"), 3)
        })
        .collect();
    let warm = |e: &PicEngine| {
        // Each document's entries at the head of a prompt and after a segment.
        for d in &docs {
            let q = bseg(99, 5);
            e.run(&[d.clone(), q.clone()], Mode::hypic_default(), "warm")
                .unwrap();
            e.run(&[q.clone(), d.clone(), q], Mode::hypic_default(), "warm")
                .unwrap();
        }
    };
    let cfg = || SchedulerConfig {
        step_tokens: 256,
        prefill_chunk_tokens: 64,
        ..Default::default()
    };
    let mut alone = vec![];
    for r in &reqs {
        let e = engine();
        warm(&e);
        let s = Scheduler::start(e, cfg());
        let mut h = s.submit(r.clone()).unwrap();
        alone.push(collect(&mut h));
    }
    let stats = |ev: &[GenEvent]| {
        ev.iter()
            .find_map(|e| match e {
                GenEvent::Started { stats, .. } => Some(stats.clone()),
                _ => None,
            })
            .unwrap()
    };
    let toks = |ev: &[GenEvent]| {
        ev.iter()
            .filter_map(|e| match e {
                GenEvent::Token { id, .. } => Some(*id),
                _ => None,
            })
            .collect::<Vec<_>>()
    };
    for attempt in 0..4 {
        let e = engine();
        warm(&e);
        let s = Scheduler::start(e, cfg());
        let mut hs: Vec<_> = reqs.iter().map(|r| s.submit(r.clone()).unwrap()).collect();
        let got: Vec<_> = hs.iter_mut().map(collect).collect();
        for (i, (g, a)) in got.iter().zip(&alone).enumerate() {
            assert_eq!(stats(g), stats(a), "request {i}");
            assert!(stats(g).hits >= 2, "request {i}: {:?}", stats(g));
            assert_eq!(toks(g), toks(a), "request {i}");
        }
        let b = s.metrics().batched_prefills.load(Ordering::Relaxed);
        println!("attempt {attempt}: {b} batched forwards");
        if b > 0 {
            return;
        }
    }
    panic!("the questions were never batched");
}

/// Requests of one tenant sharing a system prompt that is already cached (its
/// snapshot in the private pool) do not wait for each other: their questions batch,
/// and each answers as alone.
#[test]
fn requests_sharing_a_cached_system_prompt_batch() {
    let sys = bseg(81, 30);
    let reqs: Vec<GenRequest> = (0..4u32)
        .map(|i| {
            breq(
                vec![sys.clone(), bseg(90 + i, 7 + i as usize)],
                Mode::PrefixCache,
                "t",
                3,
            )
        })
        .collect();
    let cfg = || SchedulerConfig {
        step_tokens: 256,
        prefill_chunk_tokens: 64,
        ..Default::default()
    };
    let warm = |e: &PicEngine| {
        e.run(&[sys.clone(), bseg(99, 5)], Mode::PrefixCache, "t")
            .unwrap();
    };
    let toks = |ev: &[GenEvent]| {
        ev.iter()
            .filter_map(|e| match e {
                GenEvent::Token { id, .. } => Some(*id),
                _ => None,
            })
            .collect::<Vec<_>>()
    };
    let mut alone = vec![];
    for r in &reqs {
        let e = engine();
        warm(&e);
        let s = Scheduler::start(e, cfg());
        let mut h = s.submit(r.clone()).unwrap();
        alone.push(toks(&collect(&mut h)));
    }
    for attempt in 0..4 {
        let e = engine();
        warm(&e);
        let s = Scheduler::start(e, cfg());
        let mut hs: Vec<_> = reqs.iter().map(|r| s.submit(r.clone()).unwrap()).collect();
        let got: Vec<_> = hs.iter_mut().map(|h| toks(&collect(h))).collect();
        assert_eq!(got, alone);
        let b = s.metrics().batched_prefills.load(Ordering::Relaxed);
        println!("attempt {attempt}: {b} batched forwards");
        if b > 0 {
            return;
        }
    }
    panic!("requests sharing a cached system prompt never batched");
}
