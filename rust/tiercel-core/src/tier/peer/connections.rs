//! The peer tier's connections to other hosts' servers: a pool of idle ones per address,
//! and the short probe timeout of an address marked down until it answers again.

use super::*;

/// After a transfer to an address stalled or its connect failed, later connects to it use
/// this shorter timeout until it answers again: a later step then fails fast instead of
/// waiting out the full deadline behind a dead link, and the link's recovery is noticed by
/// the next step's connect.
const PROBE_TIMEOUT: Duration = Duration::from_secs(2);

impl PeerTier {
    pub(super) fn me(&self) -> Result<Ident> {
        let c = self.cluster.read();
        c.as_ref()
            .map(|c| c.ident(self.rank))
            .ok_or_else(|| Error::unavailable(format!("tier '{}': the peers are not known yet", self.name)))
    }

    /// A fresh connection to `addr` on host `host` (a short connect timeout while the
    /// address is marked down).
    pub(super) fn connect(&self, addr: &str, host: &str) -> Result<Conn> {
        let down = self.down.lock().contains_key(addr);
        let connect_timeout = if down { self.timeout.min(PROBE_TIMEOUT) } else { self.timeout };
        let r = Conn::connect(addr, &self.secret()?, connect_timeout, &self.me()?, host);
        match &r {
            Ok(_) if down => {
                log::info!("tier '{}': peer {addr} (host {host}) answers again", self.name);
                self.down.lock().remove(addr);
            }
            Err(e) if e.kind == ErrorKind::TierUnavailable => self.mark_down(addr, e),
            _ => {}
        }
        r
    }

    pub(super) fn mark_down(&self, addr: &str, e: &Error) {
        if self.down.lock().insert(addr.to_string(), Instant::now()).is_none() {
            log::warn!("tier '{}': peer {addr} marked down until it answers again: {e}", self.name);
        }
    }

    /// A pooled connection that is still alive (one the server closed is dropped here).
    pub(super) fn pooled(&self, addr: &str) -> Option<Conn> {
        let mut idle = self.idle.lock();
        let pool = idle.get_mut(addr)?;
        while let Some(c) = pool.pop() {
            if c.is_alive() {
                return Some(c);
            }
        }
        None
    }

    pub(super) fn give_back(&self, addr: &str, c: Conn) {
        self.idle.lock().entry(addr.to_string()).or_default().push(c);
    }

    /// Runs `f` on a connection to `addr` (on host `host`); a connection that failed is
    /// dropped, one that worked is kept for the next call. A pooled connection that fails
    /// (closed by the server between the liveness check and the request) is retried once on
    /// a fresh one: every request of the protocol is idempotent.
    pub(super) fn with_conn<T>(&self, addr: &str, host: &str, mut f: impl FnMut(&mut Conn) -> Result<T>) -> Result<T> {
        if let Some(mut c) = self.pooled(addr) {
            match f(&mut c) {
                Ok(r) => {
                    self.give_back(addr, c);
                    return Ok(r);
                }
                Err(e) if e.kind == ErrorKind::TierUnavailable => {
                    // Closed for idling, or a link that went down: the retry connects with
                    // the short probe timeout, so a dead link costs one deadline, not two.
                    log::info!("tier '{}': pooled connection to {addr} failed ({e}); retrying on a fresh one", self.name);
                    self.mark_down(addr, &e);
                }
                Err(e) => return Err(e),
            }
        }
        let mut c = self.connect(addr, host)?;
        match f(&mut c) {
            Ok(r) => {
                self.give_back(addr, c);
                Ok(r)
            }
            Err(e) => {
                if e.kind == ErrorKind::TierUnavailable {
                    self.mark_down(addr, &e);
                }
                Err(e)
            }
        }
    }
}
