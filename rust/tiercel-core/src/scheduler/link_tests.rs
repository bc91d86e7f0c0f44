//! Links and the traffic gate: bandwidth caps on a real socket, pauses during training
//! communication, restores first, and the learned gate on a synthetic timeline (fake clock).

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::*;
use crate::policy::{TrafficConfig, TrafficMode};
use crate::scheduler::signals::{Clock, Decision};

/// A clock the test moves by hand.
struct FakeClock(parking_lot::Mutex<f64>);
impl Clock for FakeClock {
    fn now(&self) -> f64 {
        *self.0.lock()
    }
}
impl FakeClock {
    fn set(&self, t: f64) {
        *self.0.lock() = t;
    }
}

fn traffic(mode: TrafficMode, floor: Option<u64>) -> Arc<Traffic> {
    Traffic::new(TrafficConfig { mode, floor, ..Default::default() }, super::super::SystemClock::shared())
}

/// A loopback connection whose receiving end counts bytes as they arrive (a reader thread).
struct Counted {
    tx: TcpStream,
    received: Arc<AtomicU64>,
    first_last: Arc<parking_lot::Mutex<(Option<Instant>, Option<Instant>)>>,
}

fn counted() -> Counted {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let tx = TcpStream::connect(l.local_addr().unwrap()).unwrap();
    let (mut rx, _) = l.accept().unwrap();
    let received = Arc::new(AtomicU64::new(0));
    let first_last = Arc::new(parking_lot::Mutex::new((None, None)));
    let (r, fl) = (received.clone(), first_last.clone());
    std::thread::spawn(move || {
        let mut buf = vec![0u8; 1 << 16];
        while let Ok(n) = rx.read(&mut buf) {
            if n == 0 {
                break;
            }
            let now = Instant::now();
            let mut g = fl.lock();
            g.0.get_or_insert(now);
            g.1 = Some(now);
            r.fetch_add(n as u64, Ordering::SeqCst);
        }
    });
    Counted { tx, received, first_last }
}

/// Sends `n` chunks of `size` through `link` into a socket, on a thread; true in `stop` ends it.
fn sender(link: Arc<Link>, mut tx: TcpStream, size: usize, n: usize, stop: Arc<AtomicBool>) -> std::thread::JoinHandle<()> {
    std::thread::spawn(move || {
        let chunk = vec![7u8; size];
        for _ in 0..n {
            if stop.load(Ordering::SeqCst) {
                break;
            }
            link.acquire(size as u64);
            tx.write_all(&chunk).unwrap();
        }
    })
}

#[test]
fn bandwidth_cap_holds_within_ten_percent_on_a_socket() {
    let rate = 20_000_000u64; // 20 MB/s, 1.5 s of 64 KiB chunks
    let link = Link::new("capped", Some(rate));
    let c = counted();
    let total = 30_000_000usize / 65536 * 65536;
    sender(link, c.tx, 65536, total / 65536, Arc::new(AtomicBool::new(false))).join().unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    while c.received.load(Ordering::SeqCst) < total as u64 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(5));
    }
    let (first, last) = *c.first_last.lock();
    // Bytes after the first chunk arrived, over the time until the last one did.
    let secs = last.unwrap().duration_since(first.unwrap()).as_secs_f64();
    let measured = (total - 65536) as f64 / secs;
    let ratio = measured / rate as f64;
    assert!((0.9..=1.1).contains(&ratio), "measured {measured:.0} B/s for a cap of {rate} B/s ({ratio:.3})");
    // No cap: 1 TB of tokens are there at once.
    let t = Instant::now();
    Link::new("fast", None).acquire(1 << 40);
    assert!(t.elapsed() < Duration::from_secs(5));
}

#[test]
fn no_chunk_leaves_a_network_link_while_the_training_job_communicates() {
    let t = traffic(TrafficMode::Signals, None);
    let link = Link::with_traffic("peer", Some(8_000_000), LinkKind::Network, t.clone());
    let local = Link::with_traffic("disk", None, LinkKind::Local, t.clone());
    let c = counted();
    let stop = Arc::new(AtomicBool::new(false));
    let h = sender(link.clone(), c.tx, 16384, 100_000, stop.clone());
    while c.received.load(Ordering::SeqCst) < 200_000 {
        std::thread::sleep(Duration::from_millis(2));
    }
    t.busy();
    // The chunk that was admitted before busy() finishes: give it its time (2 ms at 8 MB/s),
    // generously, then nothing more may arrive.
    std::thread::sleep(Duration::from_millis(100));
    let at_pause = c.received.load(Ordering::SeqCst);
    let local_t = Instant::now();
    local.acquire(1 << 20); // a local link does not wait for the network's signals
    assert!(local_t.elapsed() < Duration::from_millis(500));
    std::thread::sleep(Duration::from_millis(400));
    assert_eq!(c.received.load(Ordering::SeqCst), at_pause, "checkpoint bytes left during training communication");
    t.idle().unwrap();
    let resumed = Instant::now();
    while c.received.load(Ordering::SeqCst) == at_pause {
        assert!(resumed.elapsed() < Duration::from_secs(10), "no bytes after idle()");
        std::thread::sleep(Duration::from_millis(2));
    }
    stop.store(true, Ordering::SeqCst);
    h.join().unwrap();
    assert!(t.idle().is_err(), "idle() without busy() is refused");
    let st = t.stats();
    assert!(st.waits >= 1 && st.wait_seconds >= 0.3, "{st:?}");
}

#[test]
fn the_floor_keeps_checkpoint_traffic_at_its_rate_during_communication() {
    let t = traffic(TrafficMode::Signals, Some(1_000_000)); // 1 MB/s while busy
    let link = Link::with_traffic("peer", None, LinkKind::Network, t.clone());
    t.busy();
    let start = Instant::now();
    for _ in 0..5 {
        link.acquire(100_000); // 0.5 MB at the floor: ~0.5 s
    }
    let dt = start.elapsed().as_secs_f64();
    assert!(dt > 0.45, "took {dt}");
    t.idle().unwrap();
    let start = Instant::now();
    link.acquire(10_000_000);
    assert!(start.elapsed() < Duration::from_millis(500), "no floor outside communication");
}

#[test]
fn a_restore_preempts_a_persist_between_chunks() {
    let t = traffic(TrafficMode::Off, None);
    // 20 ms per 200 KB chunk: the persist is slow, the restore must not wait for all of it.
    let persist = Link::with_traffic("disk", Some(10_000_000), LinkKind::Local, t.clone());
    let other = Link::with_traffic("peer", None, LinkKind::Network, t.clone());
    let c = counted();
    let stop = Arc::new(AtomicBool::new(false));
    let h = sender(persist.clone(), c.tx, 200_000, 10_000, stop.clone());
    while persist.bytes_sent() < 1_000_000 {
        std::thread::sleep(Duration::from_millis(2));
    }
    let asked = Instant::now();
    let guard = other.read(1 << 20);
    let started = asked.elapsed();
    assert!(started < Duration::from_millis(20 * 5), "the restore started after {started:?}");
    // While it reads, the persist sends nothing more (at most the chunk it had been admitted).
    std::thread::sleep(Duration::from_millis(30));
    let held = persist.bytes_sent();
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(persist.bytes_sent(), held, "a persist chunk went during the restore");
    drop(guard);
    let (done_tx, done) = mpsc::channel();
    let p = persist.clone();
    std::thread::spawn(move || {
        while p.bytes_sent() == held {
            std::thread::sleep(Duration::from_millis(2));
        }
        done_tx.send(()).unwrap();
    });
    done.recv_timeout(Duration::from_secs(10)).expect("the persist resumes after the restore");
    stop.store(true, Ordering::SeqCst);
    h.join().unwrap();
}

/// A learned iteration of 100 ms: idle 0-30 ms, all-reduce 30-50, idle 50-60, all-reduce
/// 60-80, idle 80-100; fed through the signals with a fake clock.
fn learned(clock: &Arc<FakeClock>, warmup: u32) -> Arc<Traffic> {
    let t = Traffic::new(TrafficConfig { mode: TrafficMode::Learned, mu: 0.8, floor: None, warmup }, clock.clone());
    for i in 0..warmup as usize {
        let base = i as f64 * 0.1;
        clock.set(base);
        t.iteration();
        for (a, b) in [(0.03, 0.05), (0.06, 0.08)] {
            clock.set(base + a);
            t.busy();
            clock.set(base + b);
            t.idle().unwrap();
        }
    }
    clock.set(warmup as f64 * 0.1);
    t.iteration();
    t
}

/// `d` is a wait until `want` (up to rounding: spans are means of measured times).
fn assert_until(d: Decision, want: f64) {
    match d {
        Decision::Until(t) if (t - want).abs() < 1e-9 => {}
        _ => panic!("{d:?}, expected a wait until {want}"),
    }
}

#[test]
fn the_learned_gate_fits_chunks_into_the_learned_spans() {
    let clock = Arc::new(FakeClock(parking_lot::Mutex::new(0.0)));
    let t = learned(&clock, 20);
    let p = t.profile().expect("learned after the warmup iterations");
    assert_eq!(p.spans.len(), 3);
    let it = 2.0; // the 21st iteration started at 2.0 s
    let view = |cost: f64, pipeline_end: f64| LinkView { network: true, bytes: 1, cost: Some(cost), pipeline_end };
    let d = |now: f64, cost: f64, pipe: f64| {
        clock.set(now);
        t.decide_at(&view(cost, pipe), now)
    };
    // 5 ms chunks: the first span (24 ms usable) takes them back to back until 24 ms.
    assert_eq!(d(it, 0.005, f64::NEG_INFINITY), Decision::Go);
    assert_eq!(d(it + 0.001, 0.005, it + 0.015), Decision::Go);
    // One that would end at 25 ms does not fit: wait for the second span (50 ms).
    assert_until(d(it + 0.016, 0.005, it + 0.020), it + 0.05);
    // The second span has 8 ms: a 5 ms chunk fits once.
    assert_eq!(d(it + 0.05, 0.005, f64::NEG_INFINITY), Decision::Go);
    assert_until(d(it + 0.051, 0.005, it + 0.055), it + 0.08);
    // A 10 ms chunk skips the 8 ms span altogether.
    assert_until(d(it + 0.03, 0.010, f64::NEG_INFINITY), it + 0.08);
    // After the last span: the next iteration's first span.
    assert_until(d(it + 0.097, 0.005, f64::NEG_INFINITY), it + 0.1);
    // A chunk longer than every span goes once, at the start of the longest.
    assert_eq!(d(it + 0.001, 0.050, f64::NEG_INFINITY), Decision::Go);
    assert_until(d(it + 0.06, 0.050, it + 0.051), it + 0.1);
    // During communication (a signal) nothing goes, whatever the plan says.
    clock.set(it + 0.001);
    t.busy();
    assert_eq!(t.decide_at(&view(0.001, f64::NEG_INFINITY), it + 0.001), Decision::Wait);
    t.idle().unwrap();
    // Training stopped (no iteration for more than two): chunks go.
    assert_eq!(d(it + 0.5, 0.005, f64::NEG_INFINITY), Decision::Go);
}

#[test]
fn the_learned_spans_follow_the_idle_signal_when_the_collectives_drift() {
    let clock = Arc::new(FakeClock(parking_lot::Mutex::new(0.0)));
    let view = |cost: f64, pipeline_end: f64| LinkView { network: true, bytes: 1, cost: Some(cost), pipeline_end };
    let it = 2.0;
    // One iteration of `learned`, the 21st, with one all-reduce signalled at `busy`-`idle`.
    let drifted = |busy: f64, idle: f64| {
        let t = learned(&clock, 20);
        clock.set(it + busy);
        t.busy();
        clock.set(it + idle);
        t.idle().unwrap();
        t
    };
    // The learned second span is 50-60 ms (8 ms usable). The all-reduce before it ends 4 ms
    // early, so the span really is 46-56 ms: a 7 ms chunk goes at once (by the offsets alone
    // it would wait until 50 ms and run into the all-reduce at 56 ms).
    let t = drifted(0.026, 0.046);
    assert_eq!(t.decide_at(&view(0.007, f64::NEG_INFINITY), it + 0.046), Decision::Go);
    // Behind it, a 5 ms chunk would end at 58 ms, past the usable part (54 ms): it waits
    // for the third span, moved as much (80 - 4 ms).
    assert_until(t.decide_at(&view(0.005, it + 0.053), it + 0.047), it + 0.076);

    // The all-reduce ends 4 ms late: the span is 54-64 ms, and a 6 ms chunk fits it (against
    // the learned 50-58 ms it would wait for the third span).
    let t = drifted(0.034, 0.054);
    assert_eq!(t.decide_at(&view(0.006, f64::NEG_INFINITY), it + 0.054), Decision::Go);
    assert_until(t.decide_at(&view(0.006, it + 0.060), it + 0.055), it + 0.084);

    // A short gap 20 ms into the first span, after a collective the profile never saw: its
    // drift from every learned span differs from the iteration's so far (0) by more than 5%
    // of the iteration, so it is not given the first span's 24 ms. A 10 ms chunk fits no span from there on but the third.
    let t = drifted(0.015, 0.020);
    assert_until(t.decide_at(&view(0.010, f64::NEG_INFINITY), it + 0.020), it + 0.08);

    // Drift adds up through the iteration: 4 ms early at the second span, 8 ms at the third
    // (more than 5% of the iteration from its learned 80 ms, but 4 ms from the drift before).
    // A 10 ms chunk then fits the third span's 16 usable ms from 72 ms.
    let t = drifted(0.026, 0.046);
    clock.set(it + 0.052);
    t.busy();
    clock.set(it + 0.072);
    t.idle().unwrap();
    assert_eq!(t.decide_at(&view(0.010, f64::NEG_INFINITY), it + 0.072), Decision::Go);
    // The next iteration starts where it learned to.
    clock.set(it + 0.1);
    t.iteration();
    assert_until(t.decide_at(&view(0.010, it + 0.12), it + 0.101), it + 0.18);
}

#[test]
fn before_the_warmup_ends_and_without_a_model_chunks_go() {
    let clock = Arc::new(FakeClock(parking_lot::Mutex::new(0.0)));
    let t = learned(&clock, 3);
    assert!(t.profile().is_some());
    let t5 = Traffic::new(TrafficConfig { mode: TrafficMode::Learned, warmup: 50, ..Default::default() }, clock.clone());
    t5.iteration();
    assert!(t5.profile().is_none());
    let v = LinkView { network: true, bytes: 1, cost: Some(0.5), pipeline_end: f64::NEG_INFINITY };
    assert_eq!(t5.decide_at(&v, 0.01), Decision::Go);
    // No model yet: the chunk goes and is measured.
    let v = LinkView { network: true, bytes: 1, cost: None, pipeline_end: f64::NEG_INFINITY };
    clock.set(0.3 + 0.035);
    assert_eq!(t.decide_at(&v, 0.3 + 0.035), Decision::Go);
}

#[test]
fn a_link_learns_its_cost_from_the_chunks_it_sends() {
    let t = traffic(TrafficMode::Signals, None);
    let link = Link::with_traffic("peer", Some(5_000_000), LinkKind::Network, t);
    assert!(link.model().is_none());
    for _ in 0..20 {
        link.acquire(100_000);
        std::thread::sleep(Duration::from_millis(2)); // "sending" takes 2 ms
    }
    let m = link.model().unwrap();
    // The cap (5 MB/s) is slower than the 50 MB/s the gaps show: the model keeps the cap. (A
    // loaded machine stretches the 2 ms sleeps; only a tenfold stretch would reach the cap.)
    assert_eq!(m.bandwidth, 5_000_000.0);
    assert_eq!(link.bytes_sent(), 2_000_000);
}

#[test]
fn the_model_prefers_chunks_that_went_back_to_back() {
    // Chunks after a pause "send" in 1 ms (into an emptied send buffer), chunks right behind
    // another in 4 ms (the wire). Most chunks start after a pause, as in mode `learned`: the
    // model still reads the wire's rate, not the buffer's.
    let link = Link::with_traffic("peer", None, LinkKind::Network, traffic(TrafficMode::Signals, None));
    let pause = || LAST.with(|l| l.set(None));
    for _ in 0..6 {
        for _ in 0..3 {
            link.acquire(100_000);
            std::thread::sleep(Duration::from_millis(1));
            link.observe_previous(Instant::now());
            pause();
        }
        link.acquire(100_000);
        std::thread::sleep(Duration::from_millis(1));
        for _ in 0..2 {
            link.acquire(100_000);
            std::thread::sleep(Duration::from_millis(4));
        }
        link.observe_previous(Instant::now());
        pause();
    }
    let m = link.model().unwrap();
    // About 100 kB / 4 ms = 25 MB/s; every chunk alike would read about 50 MB/s (2 ms on
    // average). A loaded machine stretches the sleeps, which only lowers the rate: the bound
    // below is loose, the one above tells the two readings apart.
    assert!((8e6..35e6).contains(&m.bandwidth), "{} B/s: want about 100 kB / 4 ms", m.bandwidth);
}

#[test]
fn background_chunks_wait_while_a_restore_runs_outside_the_links() {
    // A replicated restore's relay moves bytes on no link of the store: its guard still holds
    // every background chunk back, on local and network links, until it ends.
    let clock = Arc::new(FakeClock(parking_lot::Mutex::new(1.0)));
    let t = Traffic::new(TrafficConfig { mode: TrafficMode::Off, ..Default::default() }, clock.clone());
    let local = LinkView { network: false, bytes: 1, cost: None, pipeline_end: f64::NEG_INFINITY };
    assert_eq!(t.decide_at(&local, 1.0), Decision::Go);
    let guard = ReadGuard::restoring(&t);
    assert_eq!(t.decide_at(&local, 1.0), Decision::Wait);
    assert_eq!(t.decide_at(&LinkView { network: true, ..local }, 1.0), Decision::Wait);
    drop(guard);
    assert!(matches!(t.decide_at(&local, 1.0), Decision::Until(_)), "a grace period after the restore");
}

/// A preemption's flush (`Traffic::set_unthrottled`): a chunk waiting at the gate while the
/// training job communicates, and one sleeping for its tokens at 1 MB/s, both go at once;
/// once it is over, the limit applies again.
#[test]
fn a_preemption_lifts_the_gate_and_the_bandwidth_limit_until_it_ends() {
    let t = traffic(TrafficMode::Signals, None);
    let net = Link::with_traffic("peer", None, LinkKind::Network, t.clone());
    let disk = Link::with_traffic("disk", Some(1_000_000), LinkKind::Local, t.clone());
    t.busy();
    let (n, d) = (net.clone(), disk.clone());
    let waiting = std::thread::spawn(move || n.acquire(1 << 20));
    // 10 MB at 1 MB/s: 10 s unless the limit is lifted.
    let sleeping = std::thread::spawn(move || d.acquire(10_000_000));
    std::thread::sleep(Duration::from_millis(200));
    assert!(!waiting.is_finished() && !sleeping.is_finished());
    let lifted = Instant::now();
    t.set_unthrottled(true);
    waiting.join().unwrap();
    sleeping.join().unwrap();
    assert!(lifted.elapsed() < Duration::from_secs(2), "{:?}", lifted.elapsed());
    t.set_unthrottled(false);
    let again = Instant::now();
    disk.acquire(500_000);
    disk.acquire(500_000);
    assert!(again.elapsed() >= Duration::from_millis(400), "the limit is back: {:?}", again.elapsed());
    t.idle().unwrap();
}

#[test]
fn whole_persists_give_the_seconds_of_the_next_at_their_rate() {
    let link = Link::new("bucket", None);
    assert_eq!(link.whole_seconds(100), None, "nothing measured yet");
    // 100 MB in 4 s and 100 MB in 6 s: 20 MB/s, so 50 MB take 2.5 s.
    link.whole_took(100_000_000, 4.0);
    link.whole_took(100_000_000, 6.0);
    assert!((link.whole_seconds(50_000_000).unwrap() - 2.5).abs() < 1e-9);
    // Only the last four count: four fast ones later, the slow start is forgotten.
    for _ in 0..4 {
        link.whole_took(100_000_000, 1.0);
    }
    assert!((link.whole_seconds(100_000_000).unwrap() - 1.0).abs() < 1e-9);
    // Nothing moved (a peer tier whose holders had every chunk) says nothing of the link.
    link.whole_took(0, 3.0);
    assert!((link.whole_seconds(100_000_000).unwrap() - 1.0).abs() < 1e-9);
    // Small persists (mostly fixed costs) do not speak for a whole checkpoint: 1 MB in
    // 0.1 s is not 10 s per 100 MB. They do for one of their size.
    let small = Link::new("peer", None);
    for _ in 0..4 {
        small.whole_took(1_000_000, 0.1);
    }
    assert_eq!(small.whole_seconds(100_000_000), None);
    assert!((small.whole_seconds(2_000_000).unwrap() - 0.2).abs() < 1e-9);
}
