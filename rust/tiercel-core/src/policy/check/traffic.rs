//! `[traffic]`: how checkpoint traffic makes way for the training job's own communication
//! (see `scheduler::signals`).

use super::super::source::{Node, Value};
use super::super::units::parse_bandwidth;
use super::Checker;
use crate::error::Result;
use crate::policy::{TrafficConfig, TrafficMode};

pub(in crate::policy) const TRAFFIC_KEYS: &[&str] = &["mode", "mu", "floor", "warmup"];
/// More warmup iterations than this profile a job that has long changed its pace.
const MAX_WARMUP: usize = 100_000;

impl Checker<'_> {
    pub(super) fn traffic(&self, node: &Node) -> Result<TrafficConfig> {
        let entries = self.table(node, "traffic")?;
        self.check_keys(entries, "traffic", TRAFFIC_KEYS)?;
        let mut cfg = TrafficConfig::default();
        for (key, value) in entries {
            let path = format!("traffic.{key}");
            match key.as_str() {
                "mode" => {
                    let s = self.string(value, &path)?;
                    cfg.mode = TrafficMode::parse(s)
                        .ok_or_else(|| self.expected(value, &path, "\"off\", \"signals\" (the default) or \"learned\""))?;
                }
                "mu" => {
                    let mu = match value.value {
                        Value::Float(x) => x,
                        Value::Int(n) => n as f64,
                        _ => f64::NAN,
                    };
                    if !(mu > 0.0 && mu <= 1.0) {
                        return Err(self.expected(value, &path, "a share of each idle span above 0 and at most 1 (e.g. 0.8)"));
                    }
                    cfg.mu = mu;
                }
                "floor" => {
                    cfg.floor = match value.value {
                        // 0: checkpoint traffic pauses (the default).
                        Value::Int(0) => None,
                        _ => Some(self.bytes(value, &path, parse_bandwidth, "a bandwidth such as \"10MB/s\" (0: pause)")?),
                    }
                }
                "warmup" => cfg.warmup = self.bounded(value, &path, MAX_WARMUP)? as u32,
                _ => unreachable!("check_keys admits only TRAFFIC_KEYS"),
            }
        }
        Ok(cfg)
    }
}
