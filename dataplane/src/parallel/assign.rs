//! Assignment of a request's cold segments to workers (docs/segment-parallelism.md).
//!
//! Longest processing time first (LPT): sort the segments by token count, largest
//! first, and give each to the worker whose load (tokens already assigned, divided
//! by its speed) is least. A segment already resident on a live worker goes to that
//! worker (its holder), which ships it without a prefill; its load there is 0.
//! Round robin is kept as the baseline the tests and the simulation compare against.

/// One segment to place.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Job {
    /// Index of the segment in its request.
    pub index: usize,
    /// Token count (the prefill cost).
    pub tokens: usize,
    /// The live worker (index into the worker list) that holds its entry, if any.
    pub holder: Option<usize>,
}

/// Where each job went: `per_worker[w]` = the request indices given to worker `w`,
/// in the order the worker should build them (largest first).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Assignment {
    /// Segment indices per worker, in build order.
    pub per_worker: Vec<Vec<usize>>,
}

impl Assignment {
    /// The worker a segment (request index) was given to.
    pub fn worker_of(&self, index: usize) -> Option<usize> {
        self.per_worker.iter().position(|v| v.contains(&index))
    }
}

/// LPT over `speeds.len()` workers; `speeds[w]` is worker `w`'s relative prefill
/// speed (tokens per unit time, > 0; all 1.0 for identical workers). Jobs with a
/// live holder go to it at no cost. Ties go to the lowest worker index, so the
/// result is deterministic. No workers: everything unassigned (empty lists).
pub fn lpt(jobs: &[Job], speeds: &[f64]) -> Assignment {
    let n = speeds.len();
    let mut per_worker = vec![vec![]; n];
    if n == 0 {
        return Assignment { per_worker };
    }
    let mut load = vec![0f64; n];
    let mut order: Vec<&Job> = jobs.iter().collect();
    // Largest first; equal sizes keep request order.
    order.sort_by(|a, b| b.tokens.cmp(&a.tokens).then(a.index.cmp(&b.index)));
    for j in order {
        if let Some(h) = j.holder.filter(|&h| h < n) {
            per_worker[h].push(j.index);
            continue;
        }
        let speed = |w: usize| speeds[w].max(f64::MIN_POSITIVE);
        let w = (0..n)
            .min_by(|&a, &b| {
                let fa = load[a] + j.tokens as f64 / speed(a);
                let fb = load[b] + j.tokens as f64 / speed(b);
                fa.total_cmp(&fb)
            })
            .unwrap_or(0);
        load[w] += j.tokens as f64 / speed(w);
        per_worker[w].push(j.index);
    }
    Assignment { per_worker }
}

/// Round robin in request order over `workers` workers (the baseline; ignores sizes
/// and holders).
pub fn round_robin(jobs: &[Job], workers: usize) -> Assignment {
    let mut per_worker = vec![vec![]; workers];
    if workers == 0 {
        return Assignment { per_worker };
    }
    for (k, j) in jobs.iter().enumerate() {
        per_worker[k % workers].push(j.index);
    }
    Assignment { per_worker }
}

/// Makespan of an assignment: the largest per-worker time, with `cost(index)` the
/// time of one segment (e.g. tokens / throughput) and workers working through their
/// lists one after the other. Units are those of `cost`.
pub fn makespan(a: &Assignment, cost: impl Fn(usize) -> f64) -> f64 {
    a.per_worker
        .iter()
        .map(|v| v.iter().map(|&i| cost(i)).sum::<f64>())
        .fold(0.0, f64::max)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn jobs(sizes: &[usize]) -> Vec<Job> {
        sizes
            .iter()
            .enumerate()
            .map(|(index, &tokens)| Job {
                index,
                tokens,
                holder: None,
            })
            .collect()
    }

    /// On unequal segments LPT's makespan beats round robin's and is within 4/3 of
    /// the lower bound (total / workers, largest segment); on equal segments both
    /// are optimal.
    #[test]
    fn parallel_lpt_beats_round_robin_on_unequal_segments() {
        // 8 segments, 32k tokens in all, unequal (the simulation's unequal case).
        let sizes = [8192, 1024, 6144, 2048, 5120, 3072, 4096, 3072];
        let js = jobs(&sizes);
        let cost = |i: usize| sizes[i] as f64;
        let lp = lpt(&js, &[1.0; 4]);
        let rr = round_robin(&js, 4);
        let (ml, mr) = (makespan(&lp, cost), makespan(&rr, cost));
        assert!(ml < mr, "LPT {ml} vs round robin {mr}");
        let total: usize = sizes.iter().sum();
        let bound = (total as f64 / 4.0).max(8192.0);
        assert!(ml <= bound * 4.0 / 3.0, "LPT {ml} vs bound {bound}");
        // Every segment is placed exactly once.
        let mut all: Vec<usize> = lp.per_worker.concat();
        all.sort_unstable();
        assert_eq!(all, (0..8).collect::<Vec<_>>());
        // Build order on a worker: largest first.
        for v in &lp.per_worker {
            assert!(v.windows(2).all(|w| sizes[w[0]] >= sizes[w[1]]));
        }
        // Equal segments: both give one segment per worker per round.
        let eq = jobs(&[4096; 8]);
        let c = |_: usize| 4096.0;
        assert_eq!(makespan(&lpt(&eq, &[1.0; 8]), c), 4096.0);
        assert_eq!(makespan(&round_robin(&eq, 8), c), 4096.0);
    }

    /// A resident segment goes to its holder at no cost; a faster worker gets more;
    /// no workers places nothing.
    #[test]
    fn parallel_lpt_holders_and_speeds() {
        let mut js = jobs(&[100, 100, 100]);
        js[2].holder = Some(1);
        let a = lpt(&js, &[1.0, 1.0]);
        assert_eq!(a.worker_of(2), Some(1));
        assert_eq!(a.worker_of(0), Some(0));
        assert_eq!(a.worker_of(1), Some(1));
        let b = lpt(&jobs(&[100, 100, 100]), &[4.0, 1.0]);
        assert_eq!(b.per_worker[0].len(), 3);
        assert!(lpt(&js, &[]).per_worker.is_empty());
        assert!(round_robin(&js, 0).per_worker.is_empty());
    }
}
