//! The `[preemption]` section of a policy: what a store does when the job is told it will be
//! stopped (a spot reclaim, Slurm's `--signal`, Kubernetes' grace period). The Python side
//! installs the signal handler and runs the flush (`tiercel.preempt`); the core moves the
//! bytes (`Store::persist_now`).

use std::time::Duration;

/// `[preemption]`. A policy without the section installs no handler (`Policy::preemption`
/// is None); `store.preempt()` works either way, with `DEFAULT_GRACE`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PreemptionConfig {
    /// How long the flush may take from the signal on; what is not durable by then is not.
    pub grace: Duration,
    /// The signals that announce a preemption, canonical names ("SIGTERM", "SIGUSR1").
    pub signals: Vec<String>,
    /// After the flush, end the process as the signal would have (true), or return to the
    /// training loop (false).
    pub exit: bool,
}

pub const DEFAULT_GRACE: Duration = Duration::from_secs(30);

/// Signals a handler may take: those that end a process by default and can be caught
/// (SIGKILL and SIGSTOP cannot), and those schedulers send as a notice (SIGUSR1/2).
pub const SIGNALS: &[&str] = &["SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2", "SIGALRM", "SIGXCPU"];

impl Default for PreemptionConfig {
    fn default() -> Self {
        PreemptionConfig { grace: DEFAULT_GRACE, signals: vec!["SIGTERM".into()], exit: true }
    }
}

/// The canonical name of a signal written `"SIGUSR1"` or `"USR1"` (as Slurm's `--signal`
/// writes it), if a handler may take it.
pub fn signal_name(s: &str) -> Option<&'static str> {
    let upper = s.trim().to_ascii_uppercase();
    let full = if upper.starts_with("SIG") { upper } else { format!("SIG{upper}") };
    SIGNALS.iter().copied().find(|n| *n == full)
}
