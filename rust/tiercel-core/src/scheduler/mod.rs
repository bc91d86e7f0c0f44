//! The one scheduler of background byte movement. Every job has a link (the tier it moves
//! bytes to or from), a priority and a size; priorities make a restore overtake a flush, a
//! flush overtake replication, replication overtake persistence.
//!
//! Jobs are whole steps, but their bytes pass their link one chunk at a time (`Link::acquire`
//! before each chunk), and that is where the rest of the scheduling happens, chunk-granular:
//! - `link`: per-link token buckets (the policy's `bandwidth`), restore reads that take their
//!   link first, and the measurements of each chunk's cost;
//! - `signals`: the training loop's communication signals (`Traffic`): checkpoint chunks on
//!   network links wait while the job's own collectives run, and a restore preempts background
//!   writes between two chunks;
//! - `plan`: the learned schedule (GEMINI): idle spans per iteration and the link's alpha and
//!   bandwidth learned from the first iterations, and chunks planned to fit mu x span.
//!
//! Jobs that replace each other (`Supersede`: a tier's persists) carry their save's place in
//! the process's save order: a queued job is replaced only by a job of a later save, and a
//! job that reaches the scheduler after a later save's job (background flushes finish out of
//! order) is the one skipped, so the newest save is never dropped for an older one.
//!
//! `threads` jobs run at once. A job whose chunk waits at its link (the traffic gate, the
//! token bucket) lends its slot meanwhile to the next queued job on another link (`lend`), so
//! that a flush to memory or a persist to local disk never waits behind a replica paused
//! while the training job communicates. Spare workers, as many again, take the lent slots.

mod link;
pub mod plan;
mod signals;

pub use link::{Link, LinkClosed, LinkKind, ReadGuard};
pub use signals::{Clock, Event, SystemClock, Traffic};

use std::cell::RefCell;
use std::collections::BinaryHeap;
use std::sync::Arc;
use std::thread::JoinHandle;

use parking_lot::{Condvar, Mutex};

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Priority {
    /// A restore, and a preemption's flush (`Store::persist_now`): nothing waits behind them
    /// but each other.
    Restore = 0,
    Flush = 1,
    Replicate = 2,
    Persist = 3,
}

/// How a job is started: run it, or tell it that a newer job with the same key replaced it
/// while it was still waiting (a persist that fell behind is skipped, never queued forever).
pub enum Start {
    Run,
    Superseded {
        by: String,
    },
    /// The scheduler was closed with the job still queued (`Scheduler::abandon`).
    Abandoned,
}

/// Jobs with the same `key` replace each other while queued, and never run at the same time
/// (two persists to one tier would race each other's retention). `order` is the job's save
/// in the process's save order: only a later save replaces an earlier one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Supersede {
    pub key: SupersedeKey,
    pub order: u64,
}

/// What makes two jobs one another's replacement (`Supersede`).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum SupersedeKey {
    /// A save's persist to the tier of this name: a later save's replaces it while it waits.
    Persist { tier: String },
}

pub struct Job {
    pub link: Arc<Link>,
    pub priority: Priority,
    pub size: u64,
    pub label: String,
    pub supersede: Option<Supersede>,
    pub run: Box<dyn FnOnce(Start) + Send>,
}

impl Job {
    fn key(&self) -> Option<&SupersedeKey> {
        self.supersede.as_ref().map(|s| &s.key)
    }
}

/// A job queued or running, as `Scheduler::pending_jobs` lists it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PendingJob {
    /// The job's link: the tier it moves bytes to or from.
    pub link: String,
    pub label: String,
    pub size: u64,
    pub running: bool,
}

struct Queued {
    priority: Priority,
    seq: u64,
    job: Job,
}

impl PartialEq for Queued {
    fn eq(&self, o: &Self) -> bool {
        self.priority == o.priority && self.seq == o.seq
    }
}
impl Eq for Queued {}
impl PartialOrd for Queued {
    fn partial_cmp(&self, o: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(o))
    }
}
impl Ord for Queued {
    // BinaryHeap pops the greatest: the most urgent priority, then the oldest.
    fn cmp(&self, o: &Self) -> std::cmp::Ordering {
        o.priority.cmp(&self.priority).then(o.seq.cmp(&self.seq))
    }
}

#[derive(Default)]
struct State {
    queue: BinaryHeap<Queued>,
    /// Jobs that may run at once (the rest of the workers take slots that waiting jobs lend).
    slots: usize,
    running: usize,
    /// The links of the running jobs whose chunk waits at its link now, one entry per job.
    waiting_on: Vec<u64>,
    running_keys: Vec<SupersedeKey>,
    /// The running jobs, as `pending_jobs` lists them (by their `seq`).
    running_jobs: Vec<(u64, PendingJob)>,
    /// Per supersede key, the latest save submitted (order, label): a job of an earlier save
    /// that arrives after it is skipped at once.
    newest: std::collections::HashMap<SupersedeKey, (u64, String)>,
    seq: u64,
    shutdown: bool,
}

struct Shared {
    state: Mutex<State>,
    wake: Condvar,
    idle: Condvar,
}

pub struct Scheduler {
    shared: Arc<Shared>,
    workers: Mutex<Vec<JoinHandle<()>>>,
}

impl Scheduler {
    pub fn new(threads: usize) -> Arc<Scheduler> {
        let slots = threads.max(1);
        let state = State { slots, ..State::default() };
        let shared = Arc::new(Shared { state: Mutex::new(state), wake: Condvar::new(), idle: Condvar::new() });
        let workers = (0..2 * slots)
            .map(|i| {
                let s = shared.clone();
                std::thread::Builder::new().name(format!("tiercel-io-{i}")).spawn(move || worker(s)).expect("spawn scheduler worker")
            })
            .collect();
        Arc::new(Scheduler { shared, workers: Mutex::new(workers) })
    }

    pub fn submit(&self, job: Job) {
        let mut superseded = vec![];
        {
            let mut st = self.shared.state.lock();
            let mut job = Some(job);
            if let Some(Supersede { key, order }) = job.as_ref().and_then(|j| j.supersede.clone()) {
                match st.newest.get(&key) {
                    // A later save's job came first: this one is the older, and it goes.
                    Some((newer, by)) if *newer > order => superseded.push((job.take().expect("set"), by.clone())),
                    _ => {
                        let by = job.as_ref().map(|j| j.label.clone()).unwrap_or_default();
                        let old = std::mem::take(&mut st.queue);
                        for q in old.into_vec() {
                            if q.job.key() == Some(&key) {
                                superseded.push((q.job, by.clone()));
                            } else {
                                st.queue.push(q);
                            }
                        }
                        st.newest.insert(key, (order, by));
                    }
                }
            }
            if let Some(job) = job {
                st.seq += 1;
                let seq = st.seq;
                st.queue.push(Queued { priority: job.priority, seq, job });
            }
        }
        self.shared.wake.notify_one();
        for (j, by) in superseded {
            (j.run)(Start::Superseded { by });
        }
    }

    /// Blocks until no job is queued or running.
    pub fn wait_idle(&self) {
        let mut st = self.shared.state.lock();
        while !st.queue.is_empty() || st.running > 0 {
            self.shared.idle.wait(&mut st);
        }
    }

    /// Blocks until no job is queued or running, or `timeout` passed; true when idle.
    pub fn wait_idle_for(&self, timeout: std::time::Duration) -> bool {
        let deadline = std::time::Instant::now() + timeout;
        let mut st = self.shared.state.lock();
        while !st.queue.is_empty() || st.running > 0 {
            if self.shared.idle.wait_until(&mut st, deadline).timed_out() {
                return st.queue.is_empty() && st.running == 0;
            }
        }
        true
    }

    /// The jobs queued or running: running first, then the queue in the order it would run.
    pub fn pending_jobs(&self) -> Vec<PendingJob> {
        let st = self.shared.state.lock();
        let mut out: Vec<PendingJob> = st.running_jobs.iter().map(|(_, j)| j.clone()).collect();
        let mut queued: Vec<&Queued> = st.queue.iter().collect();
        queued.sort_by(|a, b| b.cmp(a));
        out.extend(queued.into_iter().map(|q| PendingJob {
            link: q.job.link.name.clone(),
            label: q.job.label.clone(),
            size: q.job.size,
            running: false,
        }));
        out
    }

    /// Stops without finishing: every queued job is told it was abandoned, the workers stop
    /// taking jobs, and the running ones are left to end on their own threads (not joined).
    /// Returns what was queued or running.
    pub fn abandon(&self) -> Vec<PendingJob> {
        let pending = self.pending_jobs();
        let dropped: Vec<Queued> = {
            let mut st = self.shared.state.lock();
            st.shutdown = true;
            std::mem::take(&mut st.queue).into_vec()
        };
        self.shared.wake.notify_all();
        for q in dropped {
            (q.job.run)(Start::Abandoned);
        }
        // Running jobs keep their threads until they end; the process may exit before.
        self.workers.lock().clear();
        pending
    }

    /// Number of jobs queued or running.
    pub fn pending(&self) -> usize {
        let st = self.shared.state.lock();
        st.queue.len() + st.running
    }

    /// Finishes the queued jobs, then stops the workers.
    pub fn shutdown(&self) {
        self.wait_idle();
        self.shared.state.lock().shutdown = true;
        self.shared.wake.notify_all();
        for w in self.workers.lock().drain(..) {
            let _ = w.join();
        }
    }
}

/// The most urgent queued job whose key is not running already, if a slot is free: one of
/// the `slots`, or one that a waiting job lends, which only a job on another link may take.
fn take_runnable(st: &mut State) -> Option<Job> {
    if st.running >= st.slots + st.waiting_on.len() {
        return None;
    }
    let lent_only = st.running >= st.slots;
    let mut held = vec![];
    let mut found = None;
    while let Some(q) = st.queue.pop() {
        let key_runs = q.job.key().is_some_and(|k| st.running_keys.contains(k));
        if key_runs || (lent_only && st.waiting_on.contains(&q.job.link.id())) {
            held.push(q);
        } else {
            found = Some(q.job);
            break;
        }
    }
    st.queue.extend(held);
    found
}

thread_local! {
    /// The scheduler whose worker this thread is (`lend` needs it).
    static WORKER: RefCell<Option<Arc<Shared>>> = const { RefCell::new(None) };
}

/// A job's chunk waiting at its link: while it lives, the job's slot is lent (see the module).
pub(crate) struct Lent {
    shared: Arc<Shared>,
    link: u64,
}

/// Lends the slot of the job this thread runs until the returned guard drops; None off a
/// worker thread (a restore on the caller's thread, a tool).
pub(crate) fn lend(link: u64) -> Option<Lent> {
    let shared = WORKER.with(|w| w.borrow().clone())?;
    shared.state.lock().waiting_on.push(link);
    shared.wake.notify_one();
    Some(Lent { shared, link })
}

impl Drop for Lent {
    fn drop(&mut self) {
        let mut st = self.shared.state.lock();
        if let Some(i) = st.waiting_on.iter().position(|&l| l == self.link) {
            st.waiting_on.swap_remove(i);
        }
    }
}

fn worker(s: Arc<Shared>) {
    WORKER.with(|w| *w.borrow_mut() = Some(s.clone()));
    loop {
        let job = {
            let mut st = s.state.lock();
            loop {
                if st.shutdown && st.queue.is_empty() {
                    return;
                }
                if let Some(job) = take_runnable(&mut st) {
                    st.running += 1;
                    if let Some(k) = job.key() {
                        st.running_keys.push(k.clone());
                    }
                    st.seq += 1;
                    let id = st.seq;
                    let shown = PendingJob { link: job.link.name.clone(), label: job.label.clone(), size: job.size, running: true };
                    st.running_jobs.push((id, shown));
                    break (id, job);
                }
                s.wake.wait(&mut st);
            }
        };
        let (id, job) = job;
        // A panicking job must not take the worker (and every later job) down with it.
        let key = job.key().cloned();
        let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| (job.run)(Start::Run)));
        let mut st = s.state.lock();
        st.running -= 1;
        st.running_jobs.retain(|(i, _)| *i != id);
        if let Some(k) = key {
            if let Some(i) = st.running_keys.iter().position(|x| *x == k) {
                st.running_keys.swap_remove(i);
            }
            // A job held back by this key may run now.
            s.wake.notify_all();
        }
        if st.queue.is_empty() && st.running == 0 {
            s.idle.notify_all();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::{TrafficConfig, TrafficMode};
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::time::Duration;

    fn job(link: &Arc<Link>, p: Priority, key: Option<&str>, log: &Arc<Mutex<Vec<String>>>, label: &str) -> Job {
        ordered(link, p, key, 0, log, label)
    }

    fn ordered(link: &Arc<Link>, p: Priority, key: Option<&str>, order: u64, log: &Arc<Mutex<Vec<String>>>, label: &str) -> Job {
        let log = log.clone();
        let label2 = label.to_string();
        Job {
            link: link.clone(),
            priority: p,
            size: 0,
            label: label.into(),
            supersede: key.map(|k| Supersede { key: SupersedeKey::Persist { tier: k.into() }, order }),
            run: Box::new(move |start| {
                let tag = match start {
                    Start::Run => label2,
                    Start::Superseded { by } => format!("{label2} skipped for {by}"),
                    Start::Abandoned => format!("{label2} abandoned"),
                };
                log.lock().push(tag);
            }),
        }
    }

    #[test]
    fn priorities_and_supersede() {
        let s = Scheduler::new(1);
        let link = Link::new("l", None);
        let log = Arc::new(Mutex::new(vec![]));
        // Block the single worker so that the next submissions queue up.
        let gate = block_worker(&s, &link);
        s.submit(ordered(&link, Priority::Persist, Some("p"), 1, &log, "persist-1"));
        s.submit(job(&link, Priority::Replicate, None, &log, "replicate"));
        s.submit(ordered(&link, Priority::Persist, Some("p"), 2, &log, "persist-2"));
        s.submit(job(&link, Priority::Restore, None, &log, "restore"));
        open(&gate);
        s.wait_idle();
        let got = log.lock().clone();
        assert_eq!(got, vec!["persist-1 skipped for persist-2", "restore", "replicate", "persist-2"]);
        s.shutdown();
    }

    /// A job blocking the single worker of `s` until the returned gate opens.
    fn block_worker(s: &Scheduler, link: &Arc<Link>) -> Arc<(Mutex<bool>, Condvar)> {
        let gate = Arc::new((Mutex::new(false), Condvar::new()));
        let g = gate.clone();
        let (started_tx, started) = std::sync::mpsc::channel();
        s.submit(Job {
            link: link.clone(),
            priority: Priority::Restore,
            size: 0,
            label: "gate".into(),
            supersede: None,
            run: Box::new(move |_| {
                started_tx.send(()).unwrap();
                let mut open = g.0.lock();
                while !*open {
                    g.1.wait(&mut open);
                }
            }),
        });
        started.recv().unwrap();
        gate
    }

    fn open(gate: &(Mutex<bool>, Condvar)) {
        *gate.0.lock() = true;
        gate.1.notify_all();
    }

    /// Background flushes finish out of order: the persist of save 8 reaches the scheduler
    /// before that of save 7. Save 7's job is the one skipped, queued or not (issue 28, 8).
    #[test]
    fn an_older_save_arriving_late_never_replaces_a_newer_one() {
        let s = Scheduler::new(1);
        let link = Link::new("disk", None);
        let log = Arc::new(Mutex::new(vec![]));
        let gate = block_worker(&s, &link);
        s.submit(ordered(&link, Priority::Persist, Some("disk"), 8, &log, "step 8"));
        s.submit(ordered(&link, Priority::Persist, Some("disk"), 7, &log, "step 7"));
        open(&gate);
        s.wait_idle();
        // And after save 8 ran: a late save 7 still does not run after it.
        s.submit(ordered(&link, Priority::Persist, Some("disk"), 7, &log, "step 7 again"));
        s.submit(ordered(&link, Priority::Persist, Some("disk"), 9, &log, "step 9"));
        s.wait_idle();
        assert_eq!(*log.lock(), vec!["step 7 skipped for step 8", "step 8", "step 7 again skipped for step 8", "step 9"]);
        s.shutdown();
    }

    #[test]
    fn abandon_drops_the_queue_and_says_what_was_pending() {
        let s = Scheduler::new(1);
        let link = Link::new("disk", Some(1 << 20));
        let log = Arc::new(Mutex::new(vec![]));
        let gate = block_worker(&s, &link);
        let mut j = job(&link, Priority::Persist, None, &log, "step 3");
        j.size = 100;
        s.submit(j);
        assert!(!s.wait_idle_for(Duration::from_millis(20)));
        let pending = s.abandon();
        let shown: Vec<(&str, bool, u64)> = pending.iter().map(|p| (p.label.as_str(), p.running, p.size)).collect();
        assert_eq!(shown, vec![("gate", true, 0), ("step 3", false, 100)]);
        assert_eq!(*log.lock(), vec!["step 3 abandoned"]);
        open(&gate);
    }

    #[test]
    fn jobs_with_one_key_never_overlap() {
        let s = Scheduler::new(3);
        let link = Link::new("l", None);
        let active = Arc::new(AtomicUsize::new(0));
        let worst = Arc::new(AtomicUsize::new(0));
        for i in 0..6 {
            let (a, w) = (active.clone(), worst.clone());
            s.submit(Job {
                link: link.clone(),
                priority: Priority::Persist,
                size: 0,
                label: format!("p{i}"),
                // Distinct keys per pair: p0/p1 share "a", etc. Superseding may skip some.
                supersede: Some(Supersede { key: SupersedeKey::Persist { tier: "disk".into() }, order: i }),
                run: Box::new(move |start| {
                    if let Start::Run = start {
                        let now = a.fetch_add(1, Ordering::SeqCst) + 1;
                        w.fetch_max(now, Ordering::SeqCst);
                        std::thread::sleep(Duration::from_millis(20));
                        a.fetch_sub(1, Ordering::SeqCst);
                    }
                }),
            });
        }
        s.wait_idle();
        assert_eq!(worst.load(Ordering::SeqCst), 1);
        s.shutdown();
    }

    /// Waits (polling, up to 10 s) until `f` holds of the scheduler's state.
    fn until(s: &Scheduler, f: impl Fn(&State) -> bool) {
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while !f(&s.shared.state.lock()) {
            assert!(std::time::Instant::now() < deadline, "the scheduler never got there");
            std::thread::sleep(Duration::from_millis(2));
        }
    }

    #[test]
    fn a_job_waiting_at_its_link_lends_its_slot_to_another_link() {
        let traffic = Traffic::new(TrafficConfig { mode: TrafficMode::Signals, ..Default::default() }, SystemClock::shared());
        let net = Link::with_traffic("peer", None, LinkKind::Network, traffic.clone());
        let local = Link::with_traffic("memory", None, LinkKind::Local, traffic.clone());
        let s = Scheduler::new(1);
        let log = Arc::new(Mutex::new(vec![]));
        let run = |link: &Arc<Link>, p: Priority, label: &'static str| {
            let (l, log) = (link.clone(), log.clone());
            Job {
                link: link.clone(),
                priority: p,
                size: 1,
                label: label.into(),
                supersede: None,
                run: Box::new(move |_| {
                    l.acquire(1);
                    log.lock().push(label);
                }),
            }
        };
        traffic.busy(); // the training job communicates: chunks on the network link wait
        s.submit(run(&net, Priority::Replicate, "replica"));
        until(&s, |st| st.waiting_on == vec![net.id()]);
        // The one slot is lent: a flush to memory runs now, a second chunk for the paused
        // link does not take it.
        s.submit(run(&net, Priority::Persist, "persist on the same link"));
        s.submit(run(&local, Priority::Flush, "flush"));
        until(&s, |st| st.queue.len() == 1 && st.running == 1);
        assert_eq!(*log.lock(), vec!["flush"]);
        traffic.idle().unwrap();
        s.wait_idle();
        assert_eq!(*log.lock(), vec!["flush", "replica", "persist on the same link"]);
        s.shutdown();
    }

    #[test]
    fn panicking_job_does_not_kill_worker() {
        let s = Scheduler::new(1);
        let link = Link::new("l", None);
        let n = Arc::new(AtomicUsize::new(0));
        s.submit(Job {
            link: link.clone(),
            priority: Priority::Flush,
            size: 0,
            label: "boom".into(),
            supersede: None,
            run: Box::new(|_| panic!("boom")),
        });
        let n2 = n.clone();
        s.submit(Job {
            link,
            priority: Priority::Flush,
            size: 0,
            label: "ok".into(),
            supersede: None,
            run: Box::new(move |_| {
                n2.fetch_add(1, Ordering::SeqCst);
            }),
        });
        s.wait_idle();
        assert_eq!(n.load(Ordering::SeqCst), 1);
        s.shutdown();
    }
}
