//! The `[traffic]` section of a policy: how checkpoint traffic makes way for the training
//! job's own (`scheduler::Traffic` applies it).

/// `[traffic] mode`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TrafficMode {
    /// Checkpoint chunks go whenever their link's bandwidth allows.
    Off,
    /// Chunks on network links wait while the training job communicates.
    Signals,
    /// As `signals`, and chunks are fitted into the idle spans learned from the first
    /// iterations.
    Learned,
}

impl TrafficMode {
    pub const NAMES: [&'static str; 3] = ["off", "signals", "learned"];

    pub fn parse(s: &str) -> Option<TrafficMode> {
        match s {
            "off" => Some(TrafficMode::Off),
            "signals" => Some(TrafficMode::Signals),
            "learned" => Some(TrafficMode::Learned),
            _ => None,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            TrafficMode::Off => "off",
            TrafficMode::Signals => "signals",
            TrafficMode::Learned => "learned",
        }
    }
}

/// The `[traffic]` section of a policy.
#[derive(Debug, Clone, PartialEq)]
pub struct TrafficConfig {
    pub mode: TrafficMode,
    /// The share of a learned idle span that checkpoint chunks may fill.
    pub mu: f64,
    /// Bytes per second checkpoint traffic keeps while the training job communicates (None:
    /// it pauses).
    pub floor: Option<u64>,
    /// Iterations profiled before the learned schedule starts.
    pub warmup: u32,
}

pub const DEFAULT_MU: f64 = 0.8;
pub const DEFAULT_WARMUP: u32 = 20;

impl Default for TrafficConfig {
    fn default() -> Self {
        TrafficConfig { mode: TrafficMode::Signals, mu: DEFAULT_MU, floor: None, warmup: DEFAULT_WARMUP }
    }
}
