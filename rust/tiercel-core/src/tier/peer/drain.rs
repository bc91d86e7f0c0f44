//! A closing store's wait for the replicas other hosts still push to this one: a rank that
//! closes first must not stop the server a slower rank still replicates to.

use super::*;

impl PeerTier {
    /// The longest a closing store waits for replicas still coming (`replicas_expected`).
    pub fn drain_limit(&self) -> Duration {
        self.timeout
    }

    /// Waits (at most `drain_limit`) until `replicas_expected` is None; then says what did
    /// not come.
    pub fn drain(&self) {
        let start = Instant::now();
        let mut told = false;
        while let Some(what) = self.replicas_expected() {
            let waited = start.elapsed();
            if waited >= self.timeout {
                self.gave_up_on(&what, waited);
                return;
            }
            if !told && waited >= DRAIN_NOTE_AFTER {
                told = true;
                log::warn!("rank {}: waiting (up to {:.0} s) before closing for {what}", self.rank, self.timeout.as_secs_f64());
            }
            std::thread::sleep(DRAIN_POLL);
        }
    }

    /// Logs that the store closes without the replicas `what` names.
    pub fn gave_up_on(&self, what: &str, waited: Duration) {
        log::warn!("rank {}: closing after {:.0} s without {what}: they are not kept on this host", self.rank, waited.as_secs_f64());
    }

    /// What replication to this host is still to come before its server may stop, or None:
    /// replicas on their way in now, and the newest step this rank pushed (the ranks of a
    /// job save the same steps) from every rank that places its replicas on this host and
    /// whose peer server still listens (one whose server is gone, closed or dead, has
    /// nothing more to push). A rank that closes first must not stop the server a slower
    /// rank still replicates to.
    pub fn replicas_expected(&self) -> Option<String> {
        let arriving = self.holding.receiving();
        let step = self.pushed.lock().last().copied();
        let missing: Vec<u32> = match step {
            None => vec![],
            Some(step) => {
                let have = self.replicas.ranks_written(step).unwrap_or_default();
                let c = self.cluster.read();
                match c.as_ref() {
                    None => vec![],
                    Some(c) => {
                        // The ranks that push here are all on this host's neighbours.
                        let mine = c.host_of[&self.rank];
                        let mut ranks: Vec<u32> = c
                            .host_of
                            .iter()
                            .filter(|&(r, &theirs)| theirs != mine && c.placement.peers(theirs).contains(&mine) && !have.contains(r))
                            .map(|(r, _)| *r)
                            .collect();
                        ranks.sort_unstable();
                        ranks.retain(|r| serves(&c.addrs[r]));
                        ranks
                    }
                }
            }
        };
        if missing.is_empty() && arriving == 0 {
            return None;
        }
        let mut parts = vec![];
        if let (Some(step), false) = (step, missing.is_empty()) {
            let ranks: Vec<String> = missing.iter().map(u32::to_string).collect();
            parts.push(format!("the replicas of step {step} from rank(s) {}", ranks.join(", ")));
        }
        if arriving > 0 {
            parts.push(format!("{arriving} replica(s) arriving"));
        }
        Some(format!("tier '{}': {}", self.name, parts.join(" and ")))
    }
}

/// How often `drain` looks again, and when it says what it waits for.
const DRAIN_POLL: Duration = Duration::from_millis(50);
const DRAIN_NOTE_AFTER: Duration = Duration::from_secs(2);

/// Whether a peer server still listens at `addr` (a TCP connect, nothing sent).
fn serves(addr: &str) -> bool {
    use std::net::ToSocketAddrs;
    let Some(a) = addr.to_socket_addrs().ok().and_then(|mut a| a.next()) else { return false };
    std::net::TcpStream::connect_timeout(&a, Duration::from_millis(500)).is_ok()
}
