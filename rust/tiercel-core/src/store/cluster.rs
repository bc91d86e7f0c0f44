//! `Cluster`: the Store's one handle on the tier that joins the job's cluster (its
//! capabilities say `cluster`: today the peer tier). The Store and the bindings ask it to join
//! the job's members, for its address, whether it runs degraded, and what a closing store must
//! still wait for; they never name the tier's type. A cluster kind of another make plugs in
//! here (and in `tier::open`), not at each of those calls.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use crate::error::Result;
use crate::scheduler::Link;
use crate::tier::peer::{HostMembers, PeerTier};
use crate::tier::Tier;

/// The cluster tier of a Store, with the link its bytes between hosts travel on.
pub struct Cluster {
    tier: Arc<PeerTier>,
    link: Arc<Link>,
}

/// Connection counters of a cluster tier's server.
pub struct ServerStats {
    pub open: u64,
    pub unauthenticated: u64,
    pub refused: u64,
    pub idle_closed: u64,
}

impl Cluster {
    pub(super) fn new(tier: Arc<PeerTier>, link: Arc<Link>) -> Cluster {
        Cluster { tier, link }
    }

    /// The cluster tier's name, as the policy gives it.
    pub fn name(&self) -> &str {
        self.tier.name()
    }

    /// The address this process serves the cluster on ("ip:port" as bound).
    pub fn local_addr(&self) -> SocketAddr {
        self.tier.local_addr()
    }

    /// Whether the shared secret is known yet (from the policy or the environment).
    pub fn has_secret(&self) -> bool {
        self.tier.has_secret()
    }

    /// Sets the shared secret handed out through the coordinator.
    pub fn set_secret(&self, secret: Vec<u8>) -> Result<()> {
        self.tier.set_secret(secret)
    }

    /// Joins the job `job`'s members: every rank's host name and server address, by rank.
    pub fn join(&self, job: &str, hosts_by_rank: &[String], addrs: &[String]) -> Result<()> {
        self.tier.set_cluster(job, hosts_by_rank, addrs)
    }

    /// For each of `hosts` hosts, by index, the hosts it must know to join (its placement
    /// neighbours); None when so few hosts leave the tier degraded.
    pub fn neighbours(&self, hosts: usize) -> Result<Option<Vec<Vec<usize>>>> {
        self.tier.neighbours(hosts)
    }

    /// Joins the job `job` of `hosts` hosts knowing only the members of this process's own
    /// host and of its placement neighbours (`neighbours`).
    pub fn join_hosts(&self, job: &str, world_size: u32, hosts: usize, members: &[HostMembers]) -> Result<()> {
        self.tier.set_members(job, world_size, hosts, members)
    }

    /// Joins a job of one process: its one host, this process's own address. Too few hosts
    /// for any `replicas`, so the tier runs degraded from the start.
    pub(super) fn join_alone(&self, job: &str) -> Result<()> {
        self.join(job, &["this host".to_string()], &[self.local_addr().to_string()])
    }

    /// Why the tier cannot take a step now ("not enough hosts (1 < 2)"), if it cannot.
    pub fn degraded(&self) -> Option<String> {
        self.tier.degraded()
    }

    /// The link bytes between hosts travel on (the cluster tier's slot's: its limit and
    /// traffic gate).
    pub fn link(&self) -> &Arc<Link> {
        &self.link
    }

    /// The server's connection counters.
    pub fn server_stats(&self) -> ServerStats {
        use std::sync::atomic::Ordering::SeqCst;
        let s = self.tier.server_stats();
        ServerStats {
            open: s.open.load(SeqCst) as u64,
            unauthenticated: s.unauthenticated.load(SeqCst) as u64,
            refused: s.refused.load(SeqCst),
            idle_closed: s.idle_closed.load(SeqCst),
        }
    }

    /// For a closing store whose own work is done and which has waited `waited` for the
    /// cluster since: what other hosts still send here, while it is worth waiting for;
    /// None when nothing is coming, or when the tier's wait limit has passed (then logged).
    pub(super) fn still_coming(&self, waited: Duration) -> Option<String> {
        let what = self.tier.replicas_expected()?;
        if waited >= self.tier.drain_limit() {
            self.tier.gave_up_on(&what, waited);
            return None;
        }
        Some(what)
    }

    /// Stops serving; `drain`: first waits (bounded) for what other hosts still send here.
    pub(super) fn close(&self, drain: bool) {
        if drain {
            self.tier.drain();
        }
        self.tier.stop();
    }
}
