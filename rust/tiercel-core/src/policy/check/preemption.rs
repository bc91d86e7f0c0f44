//! `[preemption]`: the grace period, the signals that announce a preemption, and whether the
//! process ends after the flush (see `policy::preemption`).

use super::super::preemption::{signal_name, PreemptionConfig, SIGNALS};
use super::super::source::{Node, Value};
use super::super::units::parse_duration;
use super::Checker;
use crate::error::Result;

pub(in crate::policy) const PREEMPTION_KEYS: &[&str] = &["grace", "signals", "exit"];

impl Checker<'_> {
    pub(super) fn preemption(&self, node: &Node) -> Result<PreemptionConfig> {
        let entries = self.table(node, "preemption")?;
        self.check_keys(entries, "preemption", PREEMPTION_KEYS)?;
        let mut cfg = PreemptionConfig::default();
        for (key, value) in entries {
            let path = format!("preemption.{key}");
            match key.as_str() {
                "grace" => {
                    cfg.grace = match &value.value {
                        Value::Str(s) => parse_duration(s).map_err(|m| self.at(value, &path, m))?,
                        Value::Int(n) if *n > 0 => std::time::Duration::from_secs(*n as u64),
                        _ => return Err(self.expected(value, &path, "a duration such as \"30s\" or \"2m\"")),
                    };
                    if cfg.grace.is_zero() {
                        return Err(self.expected(value, &path, "a duration above zero"));
                    }
                }
                "signals" => {
                    let Value::List(items) = &value.value else {
                        return Err(self.expected(value, &path, "a list of signal names such as [\"SIGTERM\", \"SIGUSR1\"]"));
                    };
                    if items.is_empty() {
                        return Err(self.expected(value, &path, "at least one signal (leave out [preemption] for no handler)"));
                    }
                    cfg.signals = vec![];
                    for (i, item) in items.iter().enumerate() {
                        let at = format!("{path}[{i}]");
                        let name = self.string(item, &at)?;
                        let known = signal_name(name).ok_or_else(|| {
                            let why = if matches!(name.trim().to_ascii_uppercase().trim_start_matches("SIG"), "KILL" | "STOP") {
                                "cannot be caught, so no handler can flush on it".to_string()
                            } else {
                                "is not a signal a handler may take".to_string()
                            };
                            self.at(item, &at, format!("{name:?} {why}; use one of {}", SIGNALS.join(", ")))
                        })?;
                        if !cfg.signals.iter().any(|s| s == known) {
                            cfg.signals.push(known.to_string());
                        }
                    }
                }
                "exit" => {
                    cfg.exit = match value.value {
                        Value::Bool(b) => b,
                        _ => {
                            return Err(self.expected(value, &path, "true (end the process after the flush) or false (return to training)"))
                        }
                    }
                }
                _ => unreachable!("check_keys admits only PREEMPTION_KEYS"),
            }
        }
        Ok(cfg)
    }
}
