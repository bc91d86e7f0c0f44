//! The scale simulator's command line (bench/scale.py runs it): tiercel's commit and
//! retention code for N ranks on a simulated object store (`tiercel_core::testing::sim`).
//! Prints one JSON object per run on stdout.
//!
//!   cargo run --release -p tiercel-core --features testing --example scale_sim -- \
//!       --ranks 8,128 [--steps 3] [--keep 1] [--bytes 4096] [--latency-ms 20] \
//!       [--write-rate 3500] [--read-rate 5500] [--protocol list-all|list|counter] \
//!       [--kv-latency-ms 1] [--kv-service-us 10] [--time-limit-s 600] [--sequential] \
//!       [--prefix-depth 2]

use std::time::Duration;

use tiercel_core::testing::sim::{self, Protocol, SimConfig};

fn main() {
    let mut cfg = SimConfig::default();
    let mut ranks = vec![8u32];
    let mut args = std::env::args().skip(1);
    let fail = |m: String| -> ! {
        eprintln!("scale_sim: {m} (see the usage at the top of examples/scale_sim.rs)");
        std::process::exit(2)
    };
    while let Some(flag) = args.next() {
        if flag == "--sequential" {
            cfg.sequential = true;
            continue;
        }
        let value = args.next().unwrap_or_else(|| fail(format!("{flag} needs a value")));
        let num = |v: &str| v.parse::<f64>().unwrap_or_else(|_| fail(format!("{flag}: '{v}' is not a number")));
        match flag.as_str() {
            "--ranks" => ranks = value.split(',').map(|v| num(v) as u32).collect(),
            "--steps" => cfg.steps = num(&value) as u64,
            "--keep" => cfg.keep = num(&value) as usize,
            "--bytes" => cfg.state_bytes = num(&value) as usize,
            "--latency-ms" => cfg.store.latency = Duration::from_secs_f64(num(&value) / 1000.0),
            "--write-rate" => cfg.store.write_rate = num(&value),
            "--read-rate" => cfg.store.read_rate = num(&value),
            "--prefix-depth" => cfg.store.prefix_depth = num(&value) as usize,
            "--time-limit-s" => cfg.time_limit = Duration::from_secs_f64(num(&value)),
            "--kv-latency-ms" => cfg.counter_latency = Duration::from_secs_f64(num(&value) / 1000.0),
            "--kv-service-us" => cfg.counter_service = Duration::from_secs_f64(num(&value) / 1e6),
            "--protocol" => {
                cfg.protocol = Protocol::ALL.into_iter().find(|p| p.name() == value).unwrap_or_else(|| {
                    let names: Vec<&str> = Protocol::ALL.iter().map(|p| p.name()).collect();
                    fail(format!("--protocol: '{value}' is none of: {}", names.join(", ")))
                })
            }
            other => fail(format!("unknown option {other}")),
        }
    }
    for n in ranks {
        let run = SimConfig { ranks: n, ..cfg.clone() };
        let steps: Vec<serde_json::Value> = sim::run(&run).iter().map(|s| s.to_json(n)).collect();
        let out = serde_json::json!({
            "ranks": n,
            "protocol": run.protocol.name(),
            "latency_ms": run.store.latency.as_secs_f64() * 1000.0,
            "write_rate": run.store.write_rate,
            "read_rate": run.store.read_rate,
            "prefix_depth": run.store.prefix_depth,
            "keep": run.keep,
            "counter_latency_ms": run.counter_latency.as_secs_f64() * 1000.0,
            "counter_service_us": run.counter_service.as_secs_f64() * 1e6,
            "state_bytes": run.state_bytes,
            "sequential": run.sequential,
            "steps": steps,
        });
        println!("{out}");
    }
}
