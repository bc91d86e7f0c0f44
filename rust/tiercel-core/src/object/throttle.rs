//! The throttle of one object-store tier: how fast its requests may go, learned from the
//! server's "slow down" answers (S3's `503 SlowDown`, GCS's `429` and `503`).
//!
//! Pure logic on a clock the caller passes in (seconds since any fixed instant), so that tests
//! drive it without sleeping; `gate` applies it to every HTTP request of the tier.
//!
//! - Until the first throttled answer the tier is unlimited.
//! - A throttled answer halves the allowed rate: multiplicative decrease, at most once per
//!   second, however many requests in flight are refused at once, and never below `MIN_RATE`.
//!   The first halves what was sent in the last second, but at least `FIRST_RATE`: requests
//!   come in bursts, and a refusal of a rank's first request (one sent in the last second)
//!   must not hold the tier to the floor for the ramp's whole climb back.
//! - Every answer that is not throttled raises it again along a ramp in wall time since the
//!   last decrease: additive within each `ramp_period` (from r to 2r in a straight line), the
//!   slope doubling from one period to the next, so the rate doubles once per period and never
//!   more than doubles within any span of one period (GCS asks for at most 2x per 20 minutes).
//!   A straight line alone would take 100 periods back from the floor to 50 requests/s.
//! - Requests are paced to the limit: each is handed the next free slot, `1 / limit` after the
//!   one before it.
//! - The request that was refused waits `backoff` before it goes again (exponential, with
//!   jitter), then takes its slot like any other.

use std::collections::VecDeque;
use std::time::Duration;

/// The lowest rate a throttled tier is held to, requests per second: below this a storm is
/// met by the backoff of each request, not by the pace.
pub(super) const MIN_RATE: f64 = 0.5;
/// The least rate the first decrease halves, requests per second (see the module's doc).
const FIRST_RATE: f64 = 64.0;
/// What a decrease multiplies the rate by.
const DECREASE: f64 = 0.5;
/// Answers refused within this many seconds of a decrease are one event (the requests that
/// were in flight when the server started refusing).
const DECREASE_GAP: f64 = 1.0;
/// The window the sent rate is measured over, seconds.
const WINDOW: f64 = 1.0;
/// The first backoff of a refused request, and the longest, seconds.
const BACKOFF_FIRST: f64 = 0.2;
const BACKOFF_MAX: f64 = 20.0;

/// A tier's settings for it (`ramp_period`, `throttle_timeout` in the policy).
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) struct ThrottleConfig {
    /// The time the ramp takes to double the rate after a decrease.
    pub ramp_period: Duration,
    /// How long one request may keep being refused before it fails.
    pub give_up_after: Duration,
}

#[derive(Debug)]
pub(super) struct Throttle {
    cfg: ThrottleConfig,
    /// Requests per second allowed now; None: unlimited (never throttled yet).
    limit: Option<f64>,
    /// The limit right after the last decrease: where the ramp starts.
    base: f64,
    /// When the next request may go.
    next_free: f64,
    /// When the limit was last lowered (the ramp counts from there).
    last_decrease: Option<f64>,
    /// When each request of the last `WINDOW` went.
    sent: VecDeque<f64>,
}

impl Throttle {
    pub(super) fn new(cfg: ThrottleConfig) -> Throttle {
        Throttle { cfg, limit: None, base: 0.0, next_free: 0.0, last_decrease: None, sent: VecDeque::new() }
    }

    /// Requests per second allowed now (None: unlimited).
    pub(super) fn limit(&self) -> Option<f64> {
        self.limit
    }

    pub(super) fn config(&self) -> ThrottleConfig {
        self.cfg
    }

    /// A request wants to go at `now`: how long it waits first, seconds. Its slot is taken.
    pub(super) fn admit(&mut self, now: f64) -> f64 {
        let at = match self.limit {
            Some(l) => {
                let at = self.next_free.max(now);
                self.next_free = at + 1.0 / l;
                at
            }
            None => now,
        };
        while self.sent.front().is_some_and(|t| *t < now - WINDOW) {
            self.sent.pop_front();
        }
        self.sent.push_back(at);
        at - now
    }

    /// Requests per second sent over the last `WINDOW` before `now` (at least one).
    fn sent_rate(&self, now: f64) -> f64 {
        let n = self.sent.iter().filter(|t| **t >= now - WINDOW && **t <= now).count();
        (n as f64 / WINDOW).max(1.0)
    }

    /// The server refused a request at `now` as too many: lower the rate (once per
    /// `DECREASE_GAP`). Returns whether it was lowered.
    pub(super) fn throttled(&mut self, now: f64) -> bool {
        if self.last_decrease.is_some_and(|t| now - t < DECREASE_GAP) {
            return false;
        }
        let current = self.limit.unwrap_or_else(|| self.sent_rate(now).max(FIRST_RATE));
        let lowered = (current * DECREASE).max(MIN_RATE);
        self.limit = Some(lowered);
        self.base = lowered;
        self.last_decrease = Some(now);
        // The slots handed out at the old pace are not taken back; the next ones are farther apart.
        true
    }

    /// A request at `now` got an answer that was not "slow down": ramp the limit up.
    pub(super) fn succeeded(&mut self, now: f64) {
        let (Some(_), Some(since)) = (self.limit, self.last_decrease) else { return };
        // Wall time, not only time with requests: a job that saves every half hour gets its
        // rate back over a few saves instead of never.
        let periods = ((now - since) / self.cfg.ramp_period.as_secs_f64().max(1e-9)).max(0.0);
        let (whole, part) = (periods.floor().min(60.0), periods.fract());
        self.limit = Some(self.base * 2f64.powf(whole) * (1.0 + part));
    }

    /// How long a request refused for the `attempt`-th time (1, 2, ...) waits before it goes
    /// again, seconds: doubling from `BACKOFF_FIRST` up to `BACKOFF_MAX`, the upper half of
    /// that drawn by `jitter` (in 0..1) so that refused requests do not return together.
    pub(super) fn backoff(attempt: u32, jitter: f64) -> f64 {
        let cap = (BACKOFF_FIRST * 2f64.powi(attempt.saturating_sub(1).min(30) as i32)).min(BACKOFF_MAX);
        cap * (0.5 + 0.5 * jitter.clamp(0.0, 1.0))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn throttle(ramp_s: u64) -> Throttle {
        Throttle::new(ThrottleConfig { ramp_period: Duration::from_secs(ramp_s), give_up_after: Duration::from_secs(600) })
    }

    /// Sends `n` requests evenly over `[t, t + secs)`, each admitted at its time.
    fn send(th: &mut Throttle, t: f64, secs: f64, n: usize) {
        for i in 0..n {
            th.admit(t + secs * i as f64 / n as f64);
        }
    }

    #[test]
    fn unlimited_until_the_first_refusal() {
        let mut th = throttle(1200);
        for i in 0..1000 {
            assert_eq!(th.admit(i as f64 * 0.001), 0.0);
            th.succeeded(i as f64 * 0.001);
        }
        assert_eq!(th.limit(), None);
    }

    #[test]
    fn a_refusal_halves_what_was_sent_and_a_burst_of_refusals_counts_once() {
        let mut th = throttle(1200);
        send(&mut th, 0.0, 1.0, 100); // 100 requests/s
        assert!(th.throttled(1.0));
        assert_eq!(th.limit(), Some(50.0));
        // The other requests in flight are refused too: one event.
        for k in 0..20 {
            assert!(!th.throttled(1.0 + k as f64 * 0.04));
        }
        assert_eq!(th.limit(), Some(50.0));
        // Refused again a second later: the limit is halved again.
        send(&mut th, 1.0, 1.0, 50);
        assert!(th.throttled(2.0));
        assert_eq!(th.limit(), Some(25.0));
        // A storm that never ends stops at the floor.
        for s in 3..40 {
            th.throttled(s as f64);
        }
        assert_eq!(th.limit(), Some(MIN_RATE));
    }

    #[test]
    fn requests_are_paced_to_the_limit() {
        let mut th = throttle(1200);
        send(&mut th, 0.0, 1.0, 20);
        th.throttled(1.0); // 20/s sent: FIRST_RATE halved, 32/s
        let waits: Vec<f64> = (0..5).map(|_| th.admit(1.0)).collect();
        for (i, w) in waits.iter().enumerate() {
            assert!((w - i as f64 / 32.0).abs() < 1e-9, "{waits:?}");
        }
        // A request after a pause goes at once.
        assert_eq!(th.admit(10.0), 0.0);
    }

    /// GCS: at most 2x per ramp period. The ramp takes one whole period to double, and less
    /// than doubles in any later one, however often requests succeed.
    #[test]
    fn the_ramp_never_more_than_doubles_per_period() {
        let period = 1200.0;
        let mut th = throttle(period as u64);
        send(&mut th, 0.0, 1.0, 40);
        th.throttled(1.0);
        let start = th.limit().unwrap();
        assert_eq!(start, FIRST_RATE / 2.0); // 40/s sent, fewer than FIRST_RATE
        let mut at = vec![(1.0, start)];
        let mut t = 1.0;
        // Requests at the pace of the limit, each succeeding, for three periods.
        while t < 1.0 + 3.0 * period {
            let l = th.limit().unwrap();
            t += 1.0 / l;
            th.admit(t);
            th.succeeded(t);
            at.push((t, th.limit().unwrap()));
        }
        // `at` is in time order: the limit in force at `when` by binary search (a scan from the
        // start for each of the ~10^5 points took minutes).
        let limit_at = |when: f64| at[at.partition_point(|(s, _)| *s <= when) - 1].1;
        let one = limit_at(1.0 + period);
        assert!((one / start - 2.0).abs() < 0.01, "after one period: {one} from {start}");
        for (s, l) in &at {
            let later = limit_at(s + period);
            if s + period <= t {
                assert!(later <= 2.0 * l + 1e-6, "{l} at {s} became {later} one period later");
            }
        }
        // Half a period: 1.5x (a straight line within the period); two periods: 4x.
        let half = limit_at(1.0 + period / 2.0);
        assert!((half / start - 1.5).abs() < 0.01, "{half}");
        let two = limit_at(1.0 + 2.0 * period);
        assert!((two / start - 4.0).abs() < 0.02, "{two}");
    }

    /// Between saves (no requests) the ramp goes on at the same slope: a job that saves
    /// every half hour gets its rate back, and still never faster than 2x per period.
    #[test]
    fn time_between_saves_ramps_at_the_same_slope() {
        let mut th = throttle(1200);
        send(&mut th, 0.0, 1.0, 20);
        th.throttled(1.0); // 32/s
        th.succeeded(1.0);
        // Twenty minutes without requests, then one success: doubled, no more.
        th.succeeded(1201.0);
        assert!((th.limit().unwrap() - 64.0).abs() < 1e-9, "{:?}", th.limit());
        // A storm of seven seconds halves it seven times, to the floor; 64/s is then seven
        // periods away (a straight line would take a hundred).
        for k in 0..7 {
            th.throttled(1202.0 + k as f64);
        }
        assert_eq!(th.limit(), Some(MIN_RATE));
        th.succeeded(1208.0 + 7.0 * 1200.0);
        assert_eq!(th.limit(), Some(64.0));
    }

    #[test]
    fn backoff_doubles_with_jitter_up_to_a_cap() {
        assert_eq!(Throttle::backoff(1, 1.0), 0.2);
        assert_eq!(Throttle::backoff(1, 0.0), 0.1);
        assert_eq!(Throttle::backoff(3, 1.0), 0.8);
        assert_eq!(Throttle::backoff(20, 1.0), BACKOFF_MAX);
        assert_eq!(Throttle::backoff(u32::MAX, 0.0), BACKOFF_MAX / 2.0);
    }
}
