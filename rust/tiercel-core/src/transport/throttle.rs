//! Rate-limited warnings: a flood of strangers or broken connections must not flood the
//! log (nor cost the server more than the connections themselves).

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use parking_lot::Mutex;

/// Logs at most one warning per `every`; the next one says how many were held back.
pub struct Throttle {
    every: Duration,
    last: Mutex<Option<Instant>>,
    suppressed: AtomicU64,
}

impl Throttle {
    pub fn new(every: Duration) -> Throttle {
        Throttle { every, last: Mutex::new(None), suppressed: AtomicU64::new(0) }
    }

    /// Logs `msg()` (built only when it is logged) unless a warning went out less than
    /// `every` ago; returns whether it was logged.
    pub fn warn(&self, msg: impl FnOnce() -> String) -> bool {
        let now = Instant::now();
        {
            let mut last = self.last.lock();
            if last.is_some_and(|t| now.duration_since(t) < self.every) {
                self.suppressed.fetch_add(1, Ordering::Relaxed);
                return false;
            }
            *last = Some(now);
        }
        match self.suppressed.swap(0, Ordering::Relaxed) {
            0 => log::warn!("{}", msg()),
            n => log::warn!("{} ({n} similar warnings suppressed)", msg()),
        }
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn logs_once_per_interval() {
        let t = Throttle::new(Duration::from_secs(3600));
        assert!(t.warn(|| "first".into()));
        for _ in 0..100 {
            assert!(!t.warn(|| unreachable!("not built when suppressed")));
        }
        assert_eq!(t.suppressed.load(Ordering::Relaxed), 100);
    }
}
