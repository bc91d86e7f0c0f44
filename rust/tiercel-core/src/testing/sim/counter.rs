//! `SimCounter`: the job-wide counter of the counted commit (`store::StepCounter`), as a
//! coordinator's key-value store answers it (torch's TCPStore `add`): each call takes a
//! round trip, half before the server sees it and half after, and `service` of the one
//! server's time, for which calls queue behind each other.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use crate::error::Result;
use crate::store::{LocalCounter, StepCounter};

pub struct SimCounter {
    counts: LocalCounter,
    latency: Duration,
    service: Duration,
    /// When the server is free again.
    busy_until: Mutex<Instant>,
    ops: AtomicU64,
}

impl SimCounter {
    pub fn new(latency: Duration, service: Duration) -> SimCounter {
        SimCounter { counts: LocalCounter::default(), latency, service, busy_until: Mutex::new(Instant::now()), ops: AtomicU64::new(0) }
    }

    /// Calls since the last `take_ops`.
    pub fn take_ops(&self) -> u64 {
        self.ops.swap(0, Ordering::Relaxed)
    }

    fn call<T>(&self, op: impl FnOnce() -> T) -> T {
        self.ops.fetch_add(1, Ordering::Relaxed);
        std::thread::sleep(self.latency / 2);
        let done = {
            let mut busy = self.busy_until.lock();
            *busy = (*busy).max(Instant::now()) + self.service;
            *busy
        };
        let out = op();
        std::thread::sleep(done.saturating_duration_since(Instant::now()) + self.latency / 2);
        out
    }
}

impl StepCounter for SimCounter {
    fn add(&self, key: &str, by: i64) -> Result<i64> {
        self.call(|| self.counts.add(key, by))
    }

    fn delete(&self, key: &str) -> Result<()> {
        self.call(|| self.counts.delete(key))
    }
}
