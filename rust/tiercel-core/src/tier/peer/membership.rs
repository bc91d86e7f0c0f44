//! The peer tier's view of the job: which host each rank is on, where each rank's peer
//! server listens, and from it whom a rank pushes its replicas to (`holders`) and whom a
//! read of a saved rank's copy asks (`sources`, which also finds the copies of a job that
//! ran on other hosts: an elastic restore).

use crate::placement::Placement;
use crate::transport::Ident;

/// Who is where: filled in once every rank has published its address via the coordinator.
pub struct Cluster {
    /// The job every member belongs to (connections from or to another job are refused).
    pub job: String,
    /// Host index of each rank (failure domain = host).
    pub host_of: Vec<usize>,
    /// Host names, by host index.
    pub names: Vec<String>,
    /// Address ("ip:port") of each rank's peer server.
    pub addrs: Vec<String>,
    pub placement: Placement,
}

/// The processes of one peer host that may hold a rank's replicas.
pub(super) struct HolderHost {
    pub(super) name: String,
    pub(super) addrs: Vec<String>,
}

impl Cluster {
    /// Addresses that may hold `rank`'s replicas, grouped by peer host: on each peer host the
    /// process with the same local index first (it received them), then its neighbours,
    /// which serve the same shared-memory root if that one is gone.
    pub(super) fn holders(&self, rank: u32) -> Vec<HolderHost> {
        let host = self.host_of[rank as usize];
        let local: Vec<usize> = (0..self.host_of.len()).filter(|r| self.host_of[*r] == host).collect();
        let my_index = local.iter().position(|r| *r == rank as usize).unwrap_or(0);
        self.placement
            .peers(host)
            .into_iter()
            .map(|h| {
                let ranks: Vec<usize> = (0..self.host_of.len()).filter(|r| self.host_of[*r] == h).collect();
                let n = ranks.len();
                HolderHost { name: self.names[h].clone(), addrs: (0..n).map(|i| self.addrs[ranks[(my_index + i) % n]].clone()).collect() }
            })
            .collect()
    }

    /// Where a read of saved rank `rank`'s copy may find it, host by host: the holders the
    /// placement names and the rank's own host (when the rank is one of this job's: its
    /// server serves the rank's own copy, which a replaced host needs of what another rank
    /// wrote); with `elastic` (the step was saved by a job of another shape:
    /// `PeerTier::sources` decides), every other host but `reader`'s own instead of the
    /// rank's own host. A job restarted on fewer (or other) hosts holds the steps of the
    /// job before it where that job's placement put them, which this job's placement does
    /// not know: each surviving host's server answers for its replicas and for its own
    /// ranks' copies (an elastic restore). On each host the process with `reader`'s local
    /// index first, then its neighbours (they serve the same shared memory).
    pub(super) fn sources(&self, rank: u32, reader: u32, elastic: bool) -> Vec<HolderHost> {
        let ours = (rank as usize) < self.host_of.len();
        let mut out = if ours { self.holders(rank) } else { vec![] };
        let mine = self.host_of[reader as usize];
        let local: Vec<usize> = (0..self.host_of.len()).filter(|r| self.host_of[*r] == mine).collect();
        let my_index = local.iter().position(|r| *r == reader as usize).unwrap_or(0);
        let more: Vec<usize> = match (elastic, ours) {
            (true, _) => (0..self.names.len()).collect(),
            (false, true) => vec![self.host_of[rank as usize]],
            (false, false) => vec![],
        };
        for h in more {
            let name = &self.names[h];
            if h == mine || out.iter().any(|o| &o.name == name) {
                continue;
            }
            let ranks: Vec<usize> = (0..self.host_of.len()).filter(|r| self.host_of[*r] == h).collect();
            let n = ranks.len();
            out.push(HolderHost { name: name.clone(), addrs: (0..n).map(|i| self.addrs[ranks[(my_index + i) % n]].clone()).collect() });
        }
        out
    }

    pub(super) fn ident(&self, rank: u32) -> Ident {
        Ident { job: self.job.clone(), host: self.names[self.host_of[rank as usize]].clone(), rank }
    }
}
