//! The scale simulator (docs/scale.md, "Simulated scale"): N ranks, as threads of one
//! process, each doing on one object-store tier what a rank's persist does
//! (`store::persist`: `write_and_commit`, then `Store::retain` where the rank retains, then
//! `Tier::sweep` of its own rank area),
//! through tiercel's own `BlobTier`, `StepLayout` and gc code, against `SimBlobs`, a
//! simulated object store with S3's request latency and per-prefix rates, and, for the
//! counted commit, `SimCounter`, a job-wide counter with a coordinator's latency. Only the
//! stores are simulated; every request the protocol makes is the one it makes on S3.
//! `examples/scale_sim.rs` prints a run as JSON.

pub mod counter;
pub mod store;

use std::collections::HashMap;
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use crate::codec::Compression;
use crate::error::Result;
use crate::format::{self, ChunkMeta, ChunkSource, ItemMeta, Manifest};
use crate::gc::GcOptions;
use crate::scheduler::Link;
use crate::store::records::{self, Records};
use crate::store::StepCounter;
use crate::tier::blob::BlobTier;
use crate::tier::{run_gc, Tier};
use counter::SimCounter;
use store::{SimBlobs, SimOptions, Tally};

/// How a rank commits a step, and which ranks run retention after it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Protocol {
    /// As before issue 34: every rank LISTs the step after writing its manifest, a rank that
    /// sees every manifest reads them all (the generation rule) and writes the commit
    /// record, and every rank runs retention.
    ListAll,
    /// The same commit, with retention by rank 0 alone: a job without a coordinator now
    /// (`Store::commit_persisted` without a counter).
    List,
    /// The counted commit (`store::commit`): each rank adds 1 to the save's counter key
    /// after its manifest; the rank whose add returns N writes the record
    /// (`Tier::commit_counted`, no LIST, no manifest read) and alone runs retention.
    Counter,
}

impl Protocol {
    pub const ALL: [Protocol; 3] = [Protocol::ListAll, Protocol::List, Protocol::Counter];

    pub fn name(self) -> &'static str {
        match self {
            Protocol::ListAll => "list-all",
            Protocol::List => "list",
            Protocol::Counter => "counter",
        }
    }
}

/// One run: N ranks saving `steps` steps of `state_bytes` each to one tier that keeps `keep`.
#[derive(Debug, Clone)]
pub struct SimConfig {
    pub ranks: u32,
    pub steps: u64,
    pub keep: usize,
    pub state_bytes: usize,
    pub protocol: Protocol,
    /// Ranks one after another (deterministic counts, for tests) instead of all at once.
    pub sequential: bool,
    /// A step still running after this long is stopped: its requests fail from then on.
    pub time_limit: Duration,
    pub store: SimOptions,
    /// The counter's round trip and its server's time per call (`Protocol::Counter`).
    pub counter_latency: Duration,
    pub counter_service: Duration,
}

impl Default for SimConfig {
    fn default() -> Self {
        SimConfig {
            ranks: 8,
            steps: 3,
            keep: 1,
            state_bytes: 4096,
            protocol: Protocol::ListAll,
            sequential: false,
            time_limit: Duration::from_secs(600),
            store: SimOptions::default(),
            counter_latency: Duration::from_millis(1),
            counter_service: Duration::from_micros(10),
        }
    }
}

/// What one step of a run did.
#[derive(Debug, Clone)]
pub struct StepReport {
    pub step: u64,
    /// Every request of the step (its saves, commits and retention), by kind and object.
    pub tally: Tally,
    /// From the first rank starting to the last one done.
    pub wall: Duration,
    /// From the last rank's manifest (its data complete) to the commit record, as the
    /// store saw them; None when the step did not commit.
    pub commit_delay: Option<Duration>,
    /// Ranks whose persist failed, with the first few errors.
    pub failed: u32,
    pub errors: Vec<String>,
    /// Whether the step ran past `time_limit` and was stopped.
    pub stopped: bool,
    /// Calls to the job-wide counter (adds and deletes).
    pub counter_ops: u64,
    /// Ranks whose sweep of their own area failed (their saves stand).
    pub sweep_failures: u64,
}

impl StepReport {
    pub fn to_json(&self, ranks: u32) -> serde_json::Value {
        let kinds: serde_json::Map<String, serde_json::Value> =
            store::Req::ALL.iter().map(|k| (k.name().to_string(), self.tally.by_kind(*k).into())).collect();
        let by_object: serde_json::Map<String, serde_json::Value> =
            self.tally.requests.iter().map(|((k, c), n)| (format!("{} {c}", k.name()), (*n).into())).collect();
        serde_json::json!({
            "step": self.step,
            "requests": self.tally.total(),
            "per_rank": self.tally.total() as f64 / ranks as f64,
            "by_kind": kinds,
            "by_object": by_object,
            "slowdowns": self.tally.slowdowns,
            "peak_prefix_writes_per_s": self.tally.peak_writes.0,
            "peak_prefix_writes_at": self.tally.peak_writes.1,
            "peak_prefix_reads_per_s": self.tally.peak_reads.0,
            "peak_prefix_reads_at": self.tally.peak_reads.1,
            "prefixes_written": self.tally.writes_by_prefix.len(),
            "busiest_prefix_writes": self.tally.writes_by_prefix.values().max().copied().unwrap_or(0),
            "wall_s": self.wall.as_secs_f64(),
            "commit_delay_s": self.commit_delay.map(|d| d.as_secs_f64()),
            "failed_ranks": self.failed,
            "errors": self.errors,
            "stopped": self.stopped,
            "counter_ops": self.counter_ops,
            "sweep_failures": self.sweep_failures,
        })
    }
}

/// One rank's state: a data item of `state_bytes`, in one chunk.
struct State(Vec<u8>);

impl ChunkSource for State {
    fn read_raw(&self, _item: usize, _chunk: usize, dst: &mut [u8]) -> Result<()> {
        dst.copy_from_slice(&self.0[..dst.len()]);
        Ok(())
    }
}

/// Rank `rank`'s manifest of `step` as the memory tier hands it to a persist (raw chunks),
/// and its bytes.
fn logical(step: u64, rank: u32, world: u32, bytes: usize) -> (Manifest, State) {
    let data: Vec<u8> = (0..bytes).map(|i| (i as u64 ^ step ^ rank as u64) as u8).collect();
    let len = bytes as u64;
    let mut m = Manifest::new(step, rank, world, "logical", len.max(1));
    let chunks = format::chunk_ranges(len, len.max(1))
        .map(|(offset, len)| ChunkMeta {
            offset,
            len,
            crc32c: crate::checksum::crc32c(&data[offset as usize..(offset + len) as usize]),
            object: 0,
            stored_offset: offset,
            stored_len: len,
            codec: "raw".into(),
            hash: None,
        })
        .collect();
    m.items.push(ItemMeta {
        name: "state".into(),
        kind: "array".into(),
        dtype: "uint8".into(),
        shape: vec![len],
        nbytes: len,
        meta: serde_json::json!({}),
        shard: None,
        replica: None,
        chunks,
    });
    // One save of the step: every rank's manifest carries its generation.
    m.generation = Some(generation_of(step));
    (m, State(data))
}

/// The generation of the one save of `step` (launch "sim").
fn generation_of(step: u64) -> String {
    format!("sim.{step}")
}

/// One rank: its tier (over the shared store) and what its process remembers between steps.
struct Rank {
    rank: u32,
    tier: BlobTier,
    counter: Arc<SimCounter>,
    link: Arc<Link>,
    /// `Store::other_job`'s cache: a step's commit record is read once per process.
    records_seen: HashMap<u64, ()>,
    /// Sweeps that failed (every rank's, shared).
    sweep_failures: Arc<std::sync::atomic::AtomicU64>,
}

impl Rank {
    /// What `PersistJob::run` does on one tier: `write_and_commit`, then `Store::retain`.
    fn persist(&mut self, cfg: &SimConfig, step: u64) -> Result<bool> {
        let (m, src) = logical(step, self.rank, cfg.ranks, cfg.state_bytes);
        self.tier.write_rank(&m, &src, &self.link)?;
        let (committed, retains) = match cfg.protocol {
            Protocol::ListAll => (self.tier.try_commit(step, cfg.ranks)?, true),
            Protocol::List => (self.tier.try_commit(step, cfg.ranks)?, self.rank == 0),
            Protocol::Counter => {
                // `Store::commit_counted`: count in once the manifest is durable; the rank
                // whose add makes N writes the record, deletes the key and retains.
                let generation = m.generation.as_deref().unwrap_or_default();
                let key = crate::store::counter_key("sim", "sim", step, generation);
                let world = i64::from(cfg.ranks);
                if self.counter.add(&key, 1)? == world {
                    self.tier.commit_counted(step, cfg.ranks, &m.generation)?;
                    self.counter.delete(&key)?;
                    // Recorded for the sweeps, and the keys of a step none asks about go.
                    self.records().committed(step, generation);
                    if let Some(old) = records::to_forget(1..step, step, Some(cfg.keep)) {
                        self.records().forget(old, &[generation_of(old)]);
                    }
                    (true, true)
                } else {
                    (false, false)
                }
            }
        };
        if retains {
            self.retain(cfg)?;
        }
        // Then each rank sweeps its own area (version 3), as `PersistJob::run` does: a
        // failure is logged there and fails nothing; here it is counted.
        // With a counter, whether a step is committed comes from it first (`store::records`).
        let records = self.records();
        let known = |t: u64| if cfg.protocol == Protocol::Counter { records.state(t, &generation_of(t)) } else { None };
        if let Err(e) = self.tier.sweep(self.rank, Some(cfg.keep), &known) {
            self.sweep_failures.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            log::warn!("rank {}'s sweep after step {step}: {e}", self.rank);
        }
        Ok(committed)
    }

    /// `Store::retain`: one listing of the tier's steps, each committed step's record read
    /// once per process (`Store::foreign_among`, for other jobs' steps), then the gc plan
    /// with the tier's `keep` over that listing.
    fn retain(&mut self, cfg: &SimConfig) -> Result<()> {
        let listed = self.tier.list_steps()?;
        for &s in &listed.committed {
            if let std::collections::hash_map::Entry::Vacant(e) = self.records_seen.entry(s) {
                if self.tier.commit_record(s).is_ok() {
                    e.insert(());
                }
            }
        }
        let opts = GcOptions { keep: Some(cfg.keep), listed: Some(listed), ..Default::default() };
        if cfg.protocol == Protocol::Counter {
            // `Store::run_retention`: the commits it removes are recorded.
            self.records().retain(&self.tier, &opts, &|s| vec![generation_of(s)])?;
        } else {
            run_gc(&self.tier, &opts)?;
        }
        Ok(())
    }

    /// The tier's commit records on the job's counter (`store::records`).
    fn records(&self) -> Records<'_> {
        Records { counter: &*self.counter, launch: "sim", tier: "sim" }
    }
}

/// Runs `cfg`: one report per step.
pub fn run(cfg: &SimConfig) -> Vec<StepReport> {
    let blobs = SimBlobs::new(cfg.store.clone());
    let shared: Arc<dyn crate::blobs::Blobs> = Arc::new(blobs.clone());
    let counter = Arc::new(SimCounter::new(cfg.counter_latency, cfg.counter_service));
    let sweep_failures = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let ranks: Vec<Rank> = (0..cfg.ranks)
        .map(|r| Rank {
            rank: r,
            tier: BlobTier::new("sim", shared.clone(), Compression::none()),
            counter: counter.clone(),
            link: Link::new("sim", None),
            records_seen: HashMap::new(),
            sweep_failures: sweep_failures.clone(),
        })
        .collect();
    let env = Env { blobs, counter, sweep_failures };
    if cfg.sequential {
        run_sequential(cfg, &env, ranks)
    } else {
        run_threads(cfg, &env, ranks)
    }
}

type Outcome = std::result::Result<bool, String>;

/// The simulated stores every rank shares.
struct Env {
    blobs: SimBlobs,
    counter: Arc<SimCounter>,
    sweep_failures: Arc<std::sync::atomic::AtomicU64>,
}

fn report(env: &Env, step: u64, started: Instant, outcomes: &[Outcome]) -> StepReport {
    let blobs = &env.blobs;
    let wall = started.elapsed();
    let errors: Vec<String> = outcomes.iter().filter_map(|o| o.as_ref().err().cloned()).collect();
    // The step's own manifests and commit record are the only ones put during it, wherever
    // the layout keeps them.
    let tally = blobs.take_tally();
    StepReport {
        step,
        commit_delay: match (tally.last_manifest, tally.last_commit) {
            (Some(l), Some(c)) => Some(c.saturating_duration_since(l)),
            _ => None,
        },
        tally,
        wall,
        failed: errors.len() as u32,
        errors: errors.into_iter().take(3).collect(),
        stopped: blobs.stop.swap(false, std::sync::atomic::Ordering::Relaxed),
        counter_ops: env.counter.take_ops(),
        sweep_failures: env.sweep_failures.swap(0, std::sync::atomic::Ordering::Relaxed),
    }
}

fn run_sequential(cfg: &SimConfig, env: &Env, mut ranks: Vec<Rank>) -> Vec<StepReport> {
    (1..=cfg.steps)
        .map(|step| {
            let started = Instant::now();
            let outcomes: Vec<Outcome> = ranks.iter_mut().map(|r| r.persist(cfg, step).map_err(|e| e.to_string())).collect();
            report(env, step, started, &outcomes)
        })
        .collect()
}

/// Every rank a thread (small stacks: 10,000 of them), all starting each step together, as
/// the ranks of a synchronous job do; the main thread takes each step's tally between steps
/// and stops a step that runs past the time limit.
fn run_threads(cfg: &SimConfig, env: &Env, ranks: Vec<Rank>) -> Vec<StepReport> {
    let n = ranks.len();
    let start = Arc::new(Barrier::new(n + 1));
    let done = Arc::new(Barrier::new(n + 1));
    let (tx, rx) = std::sync::mpsc::channel::<(u64, Outcome)>();
    let handles: Vec<_> = ranks
        .into_iter()
        .map(|mut r| {
            let (start, done, tx, cfg) = (start.clone(), done.clone(), tx.clone(), cfg.clone());
            std::thread::Builder::new()
                .name(format!("rank-{}", r.rank))
                .stack_size(256 << 10)
                .spawn(move || {
                    for step in 1..=cfg.steps {
                        start.wait();
                        let _ = tx.send((step, r.persist(&cfg, step).map_err(|e| e.to_string())));
                        done.wait();
                    }
                })
                .expect("cannot start a rank thread (raise `ulimit -u`?)")
        })
        .collect();
    drop(tx);
    let mut out = vec![];
    for step in 1..=cfg.steps {
        start.wait();
        let started = Instant::now();
        let mut outcomes = Vec::with_capacity(n);
        while outcomes.len() < n {
            let left = cfg.time_limit.saturating_sub(started.elapsed());
            match rx.recv_timeout(left.max(Duration::from_millis(1))) {
                Ok((_, o)) => outcomes.push(o),
                Err(std::sync::mpsc::RecvTimeoutError::Timeout) => env.blobs.stop.store(true, std::sync::atomic::Ordering::Relaxed),
                Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => break,
            }
        }
        done.wait();
        out.push(report(env, step, started, &outcomes));
    }
    for h in handles {
        let _ = h.join();
    }
    out
}

#[cfg(test)]
mod tests;
