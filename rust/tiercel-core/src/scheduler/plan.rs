//! The learned schedule (GEMINI, SOSP'23), as pure functions of what was observed: no clock,
//! no network, so that tests can feed synthetic timelines and check the plan.
//!
//! - `learn`: from the training-communication intervals of the first iterations, the idle
//!   spans of one iteration (mean offset, mean length and the spread of the length);
//! - `fit_link`: from observed chunk transfers (bytes, seconds), the link's cost model
//!   `alpha + s / B` (least squares; alpha is taken as 0 when all chunks had one size);
//! - `plan`: how many chunks fit into each span discounted by `mu` (chunks sent back to back,
//!   each costing `alpha + s / B`), the bytes one iteration carries, and how many iterations
//!   a checkpoint of a given size takes (by the chunks, and by how long whole persists of the
//!   link really took): when that is more than the policy's `every`, the effective
//!   checkpoint interval is longer (`every` times a power of two), and the plan says so.

/// A time interval in seconds since the start of its iteration.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Interval {
    pub start: f64,
    pub end: f64,
}

/// One profiled iteration: its length and when the training job's own communication ran.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct IterationTrace {
    pub length: f64,
    pub busy: Vec<Interval>,
}

/// An idle span of the learned iteration.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Span {
    /// Mean start, seconds after the iteration starts.
    pub offset: f64,
    /// Mean length and its standard deviation over the profiled iterations.
    pub length: f64,
    pub spread: f64,
}

/// What `learn` found: the mean iteration and its idle spans.
#[derive(Debug, Clone, PartialEq)]
pub struct IdleProfile {
    pub iteration: f64,
    pub iteration_spread: f64,
    pub spans: Vec<Span>,
    /// Iterations the spans were averaged over (those with the most common number of spans).
    pub iterations: usize,
}

impl IdleProfile {
    /// Idle seconds in one iteration.
    pub fn idle(&self) -> f64 {
        self.spans.iter().map(|s| s.length).sum()
    }
}

/// Times within this many seconds are equal (sums of measured floats are not exact).
pub const EPS: f64 = 1e-9;

/// Gaps shorter than this are not idle spans: no chunk fits them and they come and go with
/// the jitter of the signals themselves.
pub const MIN_SPAN: f64 = 0.000_5;

/// The idle parts of one iteration: the complement of its busy intervals in `[0, length]`.
pub fn idle_intervals(t: &IterationTrace) -> Vec<Interval> {
    let mut busy: Vec<Interval> = t.busy.iter().map(|b| Interval { start: b.start.max(0.0), end: b.end.min(t.length) }).collect();
    busy.retain(|b| b.end > b.start);
    busy.sort_by(|a, b| a.start.total_cmp(&b.start));
    let mut idle = vec![];
    let mut at = 0.0f64;
    for b in busy {
        if b.start - at >= MIN_SPAN {
            idle.push(Interval { start: at, end: b.start });
        }
        at = at.max(b.end);
    }
    if t.length - at >= MIN_SPAN {
        idle.push(Interval { start: at, end: t.length });
    }
    idle
}

fn mean_sd(xs: impl Iterator<Item = f64> + Clone) -> (f64, f64) {
    let n = xs.clone().count().max(1) as f64;
    let mean = xs.clone().sum::<f64>() / n;
    let var = xs.map(|x| (x - mean).powi(2)).sum::<f64>() / n;
    (mean, var.sqrt())
}

/// Learns the idle spans of one iteration from profiled iterations. Iterations differ in how
/// many gaps their communication leaves (a bucket's all-reduce may end just before the next
/// one starts); the spans are averaged, index by index, over the iterations with the most
/// common count. None without iterations.
pub fn learn(traces: &[IterationTrace]) -> Option<IdleProfile> {
    if traces.is_empty() {
        return None;
    }
    let idle: Vec<Vec<Interval>> = traces.iter().map(idle_intervals).collect();
    let mut counts = std::collections::BTreeMap::new();
    for v in &idle {
        *counts.entry(v.len()).or_insert(0usize) += 1;
    }
    // The most common count; among equally common ones, the smaller (the safer) one.
    let (&count, _) = counts.iter().max_by(|a, b| a.1.cmp(b.1).then(b.0.cmp(a.0)))?;
    let same: Vec<&Vec<Interval>> = idle.iter().filter(|v| v.len() == count).collect();
    let spans = (0..count)
        .map(|k| {
            let (offset, _) = mean_sd(same.iter().map(|v| v[k].start));
            let (length, spread) = mean_sd(same.iter().map(|v| v[k].end - v[k].start));
            Span { offset, length, spread }
        })
        .collect();
    let (iteration, iteration_spread) = mean_sd(traces.iter().map(|t| t.length));
    Some(IdleProfile { iteration, iteration_spread, spans, iterations: same.len() })
}

/// A link's cost per chunk: `alpha + bytes / bandwidth` seconds.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LinkModel {
    pub alpha: f64,
    /// Bytes per second.
    pub bandwidth: f64,
}

impl LinkModel {
    pub fn cost(&self, bytes: u64) -> f64 {
        self.alpha + bytes as f64 / self.bandwidth
    }

    /// The model of a link whose bandwidth is also capped at `cap` bytes per second.
    pub fn capped(self, cap: Option<f64>) -> LinkModel {
        match cap {
            Some(c) if c < self.bandwidth => LinkModel { bandwidth: c, ..self },
            _ => self,
        }
    }
}

/// Fits `alpha + s / B` to observed (bytes, seconds) transfers by least squares. With one
/// chunk size only (the usual case) alpha cannot be told apart from the bandwidth: it is 0
/// and all of the time counts as transfer (the third-quartile chunk's), which errs on the side of
/// smaller plans.
pub fn fit_link(obs: &[(u64, f64)]) -> Option<LinkModel> {
    let obs: Vec<(f64, f64)> = obs.iter().filter(|(b, t)| *b > 0 && t.is_finite() && *t > 0.0).map(|&(b, t)| (b as f64, t)).collect();
    if obs.is_empty() {
        return None;
    }
    let n = obs.len() as f64;
    let (mx, my) = (obs.iter().map(|o| o.0).sum::<f64>() / n, obs.iter().map(|o| o.1).sum::<f64>() / n);
    let sxx: f64 = obs.iter().map(|o| (o.0 - mx).powi(2)).sum();
    let sxy: f64 = obs.iter().map(|o| (o.0 - mx) * (o.1 - my)).sum();
    // Sizes that hardly differ (or a fit with a negative slope or intercept, from noise) fall
    // back to the throughput of all chunks together.
    if sxx > 0.0 && sxx / n > (0.05 * mx).powi(2) {
        let slope = sxy / sxx;
        let alpha = my - slope * mx;
        if slope > 0.0 && alpha >= 0.0 {
            return Some(LinkModel { alpha, bandwidth: 1.0 / slope });
        }
    }
    // The third-quartile chunk (slower than three in four), not the mean: the first chunk
    // after a pause is written into an emptied send buffer and returns at memory speed, which
    // the mean would count as a faster link, and a plan that fills its spans by the middle
    // chunk overruns them about as often as not (measured: 12% overlap with the median).
    let mut per_byte: Vec<f64> = obs.iter().map(|o| o.1 / o.0).collect();
    per_byte.sort_by(f64::total_cmp);
    let q3 = per_byte[(per_byte.len() * 3 / 4).min(per_byte.len() - 1)];
    Some(LinkModel { alpha: 0.0, bandwidth: 1.0 / q3 })
}

/// One span of the plan.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SpanPlan {
    /// Seconds after the iteration starts, and the usable time: mu x the span's mean length.
    pub offset: f64,
    pub usable: f64,
    /// Whole chunks sent back to back in it, and their bytes.
    pub chunks: u64,
    pub bytes: u64,
}

/// The learned schedule of one link for checkpoints of one size.
#[derive(Debug, Clone, PartialEq)]
pub struct Plan {
    pub spans: Vec<SpanPlan>,
    /// Checkpoint bytes one iteration carries (at least one chunk: see `note`).
    pub bytes_per_iteration: u64,
    /// Iterations one checkpoint takes.
    pub iterations: u64,
    /// Iterations between two checkpoints that reach the link: `every`, or the next multiple
    /// of it that is not shorter than `iterations` (saves in between are skipped).
    pub effective_interval: u64,
    /// The largest chunk size (4 KiB multiple) that fits the longest span, when some span is
    /// usable at all.
    pub largest_chunk: Option<u64>,
    /// Why the interval is longer than `every`, or that no idle time exists; None when the
    /// checkpoint fits.
    pub note: Option<String>,
}

/// Plans the chunks of a `checkpoint`-byte checkpoint, cut in `chunk`-byte chunks, into the
/// idle spans of `profile`, each discounted by `mu`, on a link of model `link`, for a
/// checkpoint wanted every `every` iterations. `whole`: the seconds a persist of that many
/// bytes took on the link lately, from its start to its commit (`Link::whole_seconds`), if
/// one was measured.
pub fn plan(profile: &IdleProfile, link: LinkModel, mu: f64, chunk: u64, checkpoint: u64, every: u64, whole: Option<f64>) -> Plan {
    let chunk = chunk.max(1);
    let cost = link.cost(chunk);
    let spans: Vec<SpanPlan> = profile
        .spans
        .iter()
        .map(|s| {
            let usable = mu * s.length;
            // (EPS: 0.8 x 10 ms holds four 2 ms chunks, not 3.99999.)
            let chunks = if cost > 0.0 { (usable / cost + EPS).floor().max(0.0) as u64 } else { 0 };
            SpanPlan { offset: s.offset, usable, chunks, bytes: chunks * chunk }
        })
        .collect();
    let longest = spans.iter().map(|s| s.usable).fold(0.0, f64::max);
    let fit = ((longest - link.alpha) * link.bandwidth).max(0.0) as u64 / 4096 * 4096;
    let largest_chunk = (fit > 0).then_some(fit);
    let planned: u64 = spans.iter().map(|s| s.bytes).sum();
    let every = every.max(1);
    let mut note = None;
    // No span carries a whole chunk: one chunk per iteration still moves the checkpoint (at
    // the cost of some overlap with training traffic), and the note says what would help.
    let per_iter = if planned == 0 {
        note = Some(if spans.is_empty() {
            "no idle time between training communications on this link: one chunk per iteration".to_string()
        } else {
            let hint = largest_chunk.map_or(String::new(), |c| format!(" (chunk_size <= {c} bytes would fit)"));
            format!("no idle span fits one chunk of {chunk} bytes ({:.4} s > {:.4} s usable): one chunk per iteration{hint}", cost, longest)
        });
        chunk
    } else {
        planned
    };
    let by_chunks = checkpoint.div_ceil(per_iter).max(1);
    // The chunk model times what each chunk's hand-off cost; a writer that buffers (an
    // object store's multipart parts) returns long before its bytes are on the wire, and the
    // commit is not a chunk at all. A whole persist, start to commit, says what it cost.
    let by_whole =
        whole.filter(|w| w.is_finite() && profile.iteration > 0.0).map_or(0, |w| (w / profile.iteration - EPS).ceil().max(1.0) as u64);
    let iterations = by_chunks.max(by_whole);
    // A power of two times `every`: ranks whose links measured a little differently still
    // persist common steps (a multiple of 8 is one of 4), so the tier commits some of them.
    let effective_interval = iterations.div_ceil(every).next_power_of_two() * every;
    if effective_interval > every {
        let took = if by_whole > by_chunks {
            format!("a persist of {checkpoint} bytes took {:.2} s ({by_whole} iterations)", whole.unwrap_or_default())
        } else {
            format!("a checkpoint of {checkpoint} bytes takes {iterations} iterations of idle time ({per_iter} bytes per iteration)")
        };
        let why = format!("{took}: effective interval {effective_interval} iterations instead of {every}");
        note = Some(match note {
            Some(n) => format!("{n}; {why}"),
            None => why,
        });
    }
    Plan { spans, bytes_per_iteration: per_iter, iterations, effective_interval, largest_chunk, note }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn iv(start: f64, end: f64) -> Interval {
        Interval { start, end }
    }

    /// A synthetic iteration of 100 ms: forward idle until 30 ms, all-reduces at 30-50 and
    /// 60-80 ms (so idle 0-30, 50-60, 80-100), each shifted by `jitter`.
    fn trace(jitter: f64) -> IterationTrace {
        IterationTrace { length: 0.1, busy: vec![iv(0.03 + jitter, 0.05 + jitter), iv(0.06, 0.08)] }
    }

    #[test]
    fn learns_the_idle_spans_with_mean_and_spread() {
        let traces: Vec<IterationTrace> = (0..20).map(|i| trace(if i % 2 == 0 { 0.001 } else { -0.001 })).collect();
        let p = learn(&traces).unwrap();
        assert_eq!(p.spans.len(), 3);
        assert_eq!(p.iterations, 20);
        assert!((p.iteration - 0.1).abs() < 1e-12);
        let want = [(0.0, 0.03, 0.001), (0.05, 0.01, 0.001), (0.08, 0.02, 0.0)];
        for (s, (o, l, sd)) in p.spans.iter().zip(want) {
            assert!((s.offset - o).abs() < 1e-9, "{s:?}");
            assert!((s.length - l).abs() < 1e-9, "{s:?}");
            assert!((s.spread - sd).abs() < 1e-9, "{s:?}");
        }
    }

    #[test]
    fn iterations_with_an_odd_number_of_gaps_are_left_out() {
        let mut traces: Vec<IterationTrace> = (0..9).map(|_| trace(0.0)).collect();
        // One iteration whose two all-reduces touch: one gap fewer.
        traces.push(IterationTrace { length: 0.1, busy: vec![iv(0.03, 0.06), iv(0.06, 0.08)] });
        let p = learn(&traces).unwrap();
        assert_eq!((p.spans.len(), p.iterations), (3, 9));
        assert!(learn(&[]).is_none());
    }

    #[test]
    fn fits_alpha_and_bandwidth() {
        // 1 ms + s / (100 MB/s), exactly.
        let obs: Vec<(u64, f64)> = [1u64 << 16, 1 << 18, 1 << 20, 1 << 22].iter().map(|&s| (s, 0.001 + s as f64 / 1e8)).collect();
        let m = fit_link(&obs).unwrap();
        assert!((m.alpha - 0.001).abs() < 1e-9, "{m:?}");
        assert!((m.bandwidth - 1e8).abs() / 1e8 < 1e-9, "{m:?}");
        // One size: all of the time is transfer time.
        let m = fit_link(&[(1 << 20, 0.01), (1 << 20, 0.01)]).unwrap();
        assert_eq!(m.alpha, 0.0);
        assert!((m.bandwidth - (1 << 20) as f64 / 0.01).abs() < 1e-3);
        assert!(fit_link(&[]).is_none());
        // Bursts of four chunks whose first went into an empty send buffer (1 ms instead of
        // 10): the link is as fast as the chunks that waited for it, not 30% faster.
        let burst: Vec<(u64, f64)> = (0..12).map(|i| (1 << 20, if i % 4 == 0 { 0.001 } else { 0.01 })).collect();
        let m = fit_link(&burst).unwrap();
        assert!((m.bandwidth - (1 << 20) as f64 / 0.01).abs() < 1e-3, "{m:?}");
        assert_eq!(LinkModel { alpha: 0.0, bandwidth: 1e9 }.capped(Some(1e6)).bandwidth, 1e6);
    }

    #[test]
    fn plans_chunks_into_mu_times_each_span() {
        let p = learn(&[trace(0.0), trace(0.0)]).unwrap();
        // 1 ms + 1 MB at 1 GB/s: 2 ms per chunk. mu = 0.8: spans of 24, 8 and 16 ms usable.
        let link = LinkModel { alpha: 0.001, bandwidth: 1e9 };
        let pl = plan(&p, link, 0.8, 1_000_000, 50_000_000, 1, None);
        let chunks: Vec<u64> = pl.spans.iter().map(|s| s.chunks).collect();
        assert_eq!(chunks, vec![12, 4, 8]);
        assert_eq!(pl.bytes_per_iteration, 24_000_000);
        // 50 MB at 24 MB per iteration: 3 iterations, so every 4th save reaches the link
        // (a power of two: a rank that measured 2 iterations persists every 2nd, and the
        // two share every 4th).
        assert_eq!((pl.iterations, pl.effective_interval), (3, 4));
        assert!(pl.note.as_deref().unwrap().contains("effective interval 4 iterations instead of 1"), "{:?}", pl.note);
        // A checkpoint that fits: the interval is `every`, no note.
        let pl = plan(&p, link, 0.8, 1_000_000, 20_000_000, 2, None);
        assert_eq!((pl.iterations, pl.effective_interval, pl.note.clone()), (1, 2, None));
        // Longer than `every` = 2: 2 x a power of two.
        let pl = plan(&p, link, 0.8, 1_000_000, 60_000_000, 2, None);
        assert_eq!((pl.iterations, pl.effective_interval), (3, 4));
        let pl = plan(&p, link, 0.8, 1_000_000, 120_000_000, 2, None);
        assert_eq!((pl.iterations, pl.effective_interval), (5, 8));
        // The largest chunk that fits the longest usable span (24 ms - 1 ms at 1 GB/s).
        assert_eq!(pl.largest_chunk, Some(23_000_000 / 4096 * 4096));
    }

    #[test]
    fn a_whole_persist_slower_than_its_chunks_sets_the_interval() {
        let p = learn(&[trace(0.0), trace(0.0)]).unwrap();
        let link = LinkModel { alpha: 0.001, bandwidth: 1e9 };
        // The chunks say one iteration (20 MB of 24 per iteration); whole persists took
        // 0.35 s, 3.5 iterations of 100 ms: every 4th save.
        let pl = plan(&p, link, 0.8, 1_000_000, 20_000_000, 1, Some(0.35));
        assert_eq!((pl.iterations, pl.effective_interval), (4, 4));
        let note = pl.note.unwrap();
        assert!(note.contains("a persist of 20000000 bytes took 0.35 s (4 iterations)") && note.contains("effective interval 4"), "{note}");
        // Faster than the chunks: the chunks decide; within one iteration: no change.
        assert_eq!(plan(&p, link, 0.8, 1_000_000, 50_000_000, 1, Some(0.05)).effective_interval, 4);
        assert_eq!(plan(&p, link, 0.8, 1_000_000, 20_000_000, 1, Some(0.1)).effective_interval, 1);
    }

    #[test]
    fn no_idle_time_lowers_the_frequency_and_says_so() {
        // The all-reduce runs the whole iteration.
        let busy: Vec<IterationTrace> = (0..5).map(|_| IterationTrace { length: 0.1, busy: vec![iv(0.0, 0.1)] }).collect();
        let p = learn(&busy).unwrap();
        assert!(p.spans.is_empty());
        let pl = plan(&p, LinkModel { alpha: 0.0, bandwidth: 1e8 }, 0.8, 1 << 20, 10 << 20, 1, None);
        assert_eq!(pl.bytes_per_iteration, 1 << 20);
        assert_eq!((pl.iterations, pl.effective_interval), (10, 16));
        let note = pl.note.unwrap();
        assert!(note.contains("no idle time") && note.contains("effective interval 16 iterations"), "{note}");
        // Gaps too short for one chunk: the note names a chunk size that would fit.
        let short: Vec<IterationTrace> = (0..5).map(|_| IterationTrace { length: 0.1, busy: vec![iv(0.002, 0.1)] }).collect();
        let pl = plan(&learn(&short).unwrap(), LinkModel { alpha: 0.0, bandwidth: 1e8 }, 0.8, 1 << 20, 1 << 20, 1, None);
        let note = pl.note.unwrap();
        assert!(note.contains("no idle span fits one chunk") && note.contains("chunk_size <= 159744"), "{note}");
    }
}
