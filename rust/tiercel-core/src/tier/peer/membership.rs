//! The peer tier's view of the job: which host each known rank is on, where each known
//! rank's peer server listens, and from it whom a rank pushes its replicas to (`holders`)
//! and whom a read of a saved rank's copy asks (`sources`, which also finds the copies of a
//! job that ran on other hosts: an elastic restore).
//!
//! A process knows its own host and its placement neighbours only (O(m) hosts however many
//! the job has: docs/scale.md, "Coordination"), so `sources` asks among those.

use std::collections::{BTreeSet, HashMap};

use crate::placement::Placement;
use crate::transport::Ident;

/// One host of the job as a process learns it when the store opens: its index in the
/// placement, its name, and its ranks with their peer servers' addresses.
#[derive(Clone, Debug)]
pub struct HostMembers {
    pub index: usize,
    pub name: String,
    /// (rank, "ip:port"), ascending by rank.
    pub ranks: Vec<(u32, String)>,
}

/// Who is where, as far as this process needs to know: its own host and the hosts the
/// placement pairs with it (those that hold its replicas and those whose replicas it holds),
/// O(m) hosts however many the job has. Filled in once the store joined its cluster.
pub struct Cluster {
    /// The job every member belongs to (connections from or to another job are refused).
    pub job: String,
    /// How many ranks the job has (a step saved by another number was saved by a job of
    /// another shape: `sources` looks for it beyond the placement's holders).
    pub world_size: u32,
    /// Host index of each rank known here (failure domain = host).
    pub host_of: HashMap<u32, usize>,
    /// Host names, by host index, of the hosts known here.
    pub names: HashMap<usize, String>,
    /// Address ("ip:port") of the peer server of each rank known here.
    pub addrs: HashMap<u32, String>,
    /// The ranks of each host known here, ascending.
    ranks_on: HashMap<usize, Vec<u32>>,
    pub placement: Placement,
}

/// The processes of one peer host that may hold a rank's replicas.
pub(super) struct HolderHost {
    pub(super) name: String,
    pub(super) addrs: Vec<String>,
}

impl Cluster {
    pub(super) fn new(job: &str, world_size: u32, members: &[HostMembers], placement: Placement) -> Cluster {
        let mut c = Cluster {
            job: job.to_string(),
            world_size,
            host_of: HashMap::new(),
            names: HashMap::new(),
            addrs: HashMap::new(),
            ranks_on: HashMap::new(),
            placement,
        };
        for h in members {
            c.names.insert(h.index, h.name.clone());
            let mut ranks: Vec<u32> = h.ranks.iter().map(|(r, _)| *r).collect();
            ranks.sort_unstable();
            c.ranks_on.insert(h.index, ranks);
            for (r, a) in &h.ranks {
                c.host_of.insert(*r, h.index);
                c.addrs.insert(*r, a.clone());
            }
        }
        c
    }

    /// The processes of known host `h`, the one with local index `local_index` first (it
    /// received the replicas), then its neighbours, which serve the same shared-memory root
    /// if that one is gone. None for a host not known here.
    fn host(&self, h: usize, local_index: usize) -> Option<HolderHost> {
        let ranks = self.ranks_on.get(&h)?;
        let n = ranks.len();
        Some(HolderHost {
            name: self.names[&h].clone(),
            addrs: (0..n).map(|i| self.addrs[&ranks[(local_index + i) % n]].clone()).collect(),
        })
    }

    /// `rank`'s index among the ranks of its host (0 for a rank not known here).
    fn local_index(&self, rank: u32) -> usize {
        let Some(host) = self.host_of.get(&rank) else { return 0 };
        self.ranks_on[host].iter().position(|r| *r == rank).unwrap_or(0)
    }

    /// Addresses that may hold `rank`'s replicas, grouped by peer host. None when `rank` is
    /// on a host this process does not know (neither its own nor a placement neighbour's); a
    /// holder host it does not know is left out.
    pub(super) fn holders(&self, rank: u32) -> Option<Vec<HolderHost>> {
        let host = *self.host_of.get(&rank)?;
        let i = self.local_index(rank);
        Some(self.placement.peers(host).into_iter().filter_map(|h| self.host(h, i)).collect())
    }

    /// Where a read of saved rank `rank`'s copy may find it, host by host: the holders the
    /// placement names and the rank's own host (when the rank is one of this job's: its
    /// server serves the rank's own copy, which a replaced host needs of what another rank
    /// wrote); with `elastic` (the step was saved by a job of another shape:
    /// `PeerTier::sources` decides), every other known host but `reader`'s own instead. A job
    /// restarted on fewer (or other) hosts holds the steps of the job before it where that
    /// job's placement put them, which this job's placement does not know: each surviving
    /// host's server answers for its replicas and for its own ranks' copies. Only the hosts
    /// this process knows are asked (its placement neighbours): a copy elsewhere is read
    /// from another tier. On each host the process with `reader`'s local index first.
    pub(super) fn sources(&self, rank: u32, reader: u32, elastic: bool) -> Vec<HolderHost> {
        let mut out = self.holders(rank).unwrap_or_default();
        let mine = self.host_of.get(&reader).copied();
        let i = self.local_index(reader);
        let more: Vec<usize> = if elastic {
            self.names.keys().copied().collect::<BTreeSet<usize>>().into_iter().collect()
        } else {
            self.host_of.get(&rank).copied().into_iter().collect()
        };
        for h in more {
            if Some(h) == mine || out.iter().any(|o| o.name == self.names[&h]) {
                continue;
            }
            out.extend(self.host(h, i));
        }
        out
    }

    pub(super) fn ident(&self, rank: u32) -> Ident {
        Ident { job: self.job.clone(), host: self.names[&self.host_of[&rank]].clone(), rank }
    }
}

/// The hosts each host talks to under `placement` (those holding its replicas and those it
/// holds replicas for), by host index, ascending: what a host must learn of the others.
pub fn neighbours(placement: &Placement, hosts: usize) -> Vec<Vec<usize>> {
    let mut out: Vec<BTreeSet<usize>> = vec![Default::default(); hosts];
    for h in 0..hosts {
        for p in placement.peers(h) {
            out[h].insert(p);
            out[p].insert(h);
        }
    }
    out.into_iter().map(|s| s.into_iter().collect()).collect()
}
