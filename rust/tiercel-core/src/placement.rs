//! Where each host's in-memory checkpoint is replicated (GEMINI, SOSP'23), and how likely a
//! burst of host failures is to lose every copy of some host's shards.
//!
//! The failure domain is the **host**, not the rank: every rank on a host dies with it, so
//! placement is computed over host indices and [`host_of_ranks`] maps ranks to hosts. Each
//! host's shards live on `m` distinct hosts (`m` = `replicas`, the host itself included):
//!
//! * **group**: the `N` hosts form `N/m` groups of `m` consecutive hosts that replicate to
//!   each other. Only valid when `m` divides `N`.
//! * **ring**: host `i` keeps its own shards and sends replicas to hosts `i+1 .. i+m-1`
//!   (mod `N`).
//! * **mixed** (GEMINI's strategy): `floor(N/m)` groups of `m` when `m` divides `N` (the same
//!   as group); otherwise the first `floor(N/m) - 1` groups of `m` hosts, and the last
//!   `m + N mod m` hosts form a ring (every host still has `m - 1` replicas on distinct
//!   other hosts).
//!
//! [`Placement::survival_probability`] is exact: it counts the `k`-subsets of hosts that
//! contain no host's whole holder set, with `u128` integers, and divides by `C(N, k)` only at
//! the end. Groups contribute `(sum_{j<m} C(m, j) x^j)` each to a generating polynomial; the
//! ring part contributes the number of cyclic binary strings with `j` ones and no `m`
//! cyclically consecutive ones (a transfer-matrix count); the coefficient of `x^k` of their
//! product is the number of surviving failure sets. All arithmetic is checked: a count that
//! does not fit `u128` is an error, never a wrong number. Every count is at most
//! `C(N', j) <= C(N, N/2)`, so it always fits for `N <= MAX_EXACT_HOSTS` (128); for larger
//! clusters it fits whenever `k <= N/2` and `C(N, k) < 2^128` (e.g. N = 1000 up to k ~ 15).

use std::fmt;
use std::str::FromStr;

use crate::error::{Error, Result};

/// The largest host count for which [`Placement::survival_probability`] counts exactly for
/// every `k`: `C(128, 64) ~ 2.4e37` fits `u128` (max ~3.4e38); `C(132, 66)` does not. Larger
/// clusters are counted exactly as long as the numbers fit (see the module documentation).
pub const MAX_EXACT_HOSTS: usize = 128;

/// How replicas are placed; see the module documentation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Strategy {
    Group,
    Ring,
    Mixed,
}

impl Strategy {
    pub const ALL: [Strategy; 3] = [Strategy::Group, Strategy::Ring, Strategy::Mixed];

    pub fn name(self) -> &'static str {
        match self {
            Strategy::Group => "group",
            Strategy::Ring => "ring",
            Strategy::Mixed => "mixed",
        }
    }

    /// "group", "ring" or "mixed" (case-insensitive, surrounding blanks ignored).
    pub fn parse(s: &str) -> Result<Strategy> {
        match s.trim().to_ascii_lowercase().as_str() {
            "group" => Ok(Strategy::Group),
            "ring" => Ok(Strategy::Ring),
            "mixed" => Ok(Strategy::Mixed),
            _ => Err(Error::invalid(format!("unknown placement strategy '{s}': expected \"group\", \"ring\" or \"mixed\""))),
        }
    }
}

impl FromStr for Strategy {
    type Err = Error;
    fn from_str(s: &str) -> Result<Strategy> {
        Strategy::parse(s)
    }
}

impl fmt::Display for Strategy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Which hosts keep a copy of which host's shards.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Placement {
    pub hosts: usize,
    pub replicas: usize,
    pub strategy: Strategy,
    /// Groups of exactly `replicas` hosts that replicate to each other.
    groups: Vec<Vec<usize>>,
    /// The hosts that form a ring, in ring order (empty when there is none).
    ring: Vec<usize>,
    /// `holders[h]`: the hosts that keep `h`'s shards, `h` first.
    holders: Vec<Vec<usize>>,
}

impl Placement {
    pub fn new(hosts: usize, replicas: usize, strategy: Strategy) -> Result<Placement> {
        let (n, m) = (hosts, replicas);
        if n == 0 {
            return Err(Error::invalid("placement needs at least one host (hosts = 0)"));
        }
        if m == 0 {
            return Err(Error::invalid("replicas must be at least 1 (the host's own copy counts as one replica)"));
        }
        if m > n {
            return Err(Error::invalid(format!(
                "replicas = {m} exceeds hosts = {n}: every copy must live on a distinct host \
                 (the failure domain is the host)"
            )));
        }
        if strategy == Strategy::Group && !n.is_multiple_of(m) {
            return Err(Error::invalid(format!(
                "group placement needs replicas to divide hosts, but {m} does not divide {n}; \
                 use \"mixed\" (groups plus a ring of the last {} hosts) or \"ring\"",
                m + n % m
            )));
        }
        let (groups, ring): (Vec<Vec<usize>>, Vec<usize>) = match strategy {
            Strategy::Ring => (Vec::new(), (0..n).collect()),
            Strategy::Group | Strategy::Mixed => {
                if n.is_multiple_of(m) {
                    ((0..n / m).map(|g| (g * m..(g + 1) * m).collect()).collect(), Vec::new())
                } else {
                    let full = n / m - 1;
                    ((0..full).map(|g| (g * m..(g + 1) * m).collect()).collect(), (full * m..n).collect())
                }
            }
        };
        let mut holders = vec![Vec::new(); n];
        // Within a group or a ring, a host's holders are itself and the next m-1 members in
        // cyclic order (a group of m is a ring of m, where "next m-1" is everyone else).
        for cycle in groups.iter().chain(std::iter::once(&ring)).filter(|c| !c.is_empty()) {
            let len = cycle.len();
            for (pos, &h) in cycle.iter().enumerate() {
                holders[h] = (0..m).map(|d| cycle[(pos + d) % len]).collect();
            }
        }
        Ok(Placement { hosts: n, replicas: m, strategy, groups, ring, holders })
    }

    /// The hosts that keep a copy of `host`'s shards: `host` itself first, then its peers;
    /// `replicas` distinct entries. Panics if `host >= hosts`.
    pub fn holders(&self, host: usize) -> Vec<usize> {
        assert!(host < self.hosts, "host {host} out of range (placement has {} hosts)", self.hosts);
        self.holders[host].clone()
    }

    /// The other hosts that keep a copy of `host`'s shards (its `replicas - 1` peers).
    pub fn peers(&self, host: usize) -> Vec<usize> {
        let mut h = self.holders(host);
        h.remove(0);
        h
    }

    /// The hosts whose shards `host` keeps: itself first, then the hosts it is a peer of
    /// (the inverse of [`Placement::holders`]; also `replicas` entries, by balance).
    pub fn keeps(&self, host: usize) -> Vec<usize> {
        assert!(host < self.hosts, "host {host} out of range (placement has {} hosts)", self.hosts);
        let mut out = vec![host];
        out.extend((0..self.hosts).filter(|&h| h != host && self.holders[h].contains(&host)));
        out
    }

    /// For printing: the groups of `replicas` hosts, then the ring part (if any) as the last
    /// entry, in ring order.
    pub fn groups(&self) -> Vec<Vec<usize>> {
        let mut out = self.groups.clone();
        if !self.ring.is_empty() {
            out.push(self.ring.clone());
        }
        out
    }

    /// The hosts in the ring part, in ring order (empty for pure group placement).
    pub fn ring(&self) -> &[usize] {
        &self.ring
    }

    /// Exactly how many `failures`-subsets of the hosts lose no host's every copy, and how
    /// many subsets there are: `(surviving, C(N, k))`.
    pub fn survival_count(&self, failures: usize) -> Result<(u128, u128)> {
        let (n, m, k) = (self.hosts, self.replicas, failures);
        if k > n {
            return Err(Error::invalid(format!("failures = {k} exceeds hosts = {n}")));
        }
        let too_big = |_| {
            Error::invalid(format!(
                "exact survival count for {n} hosts and {k} failures does not fit 128-bit integers \
                 (always fits for at most {MAX_EXACT_HOSTS} hosts; beyond that, only when \
                 k <= hosts/2 and C(hosts, k) < 2^128)"
            ))
        };
        let total = binomial(n, k).map_err(too_big)?;
        // Generating polynomial of the surviving failure sets, by number of failed hosts.
        // A group of m survives unless all m fail: C(m, j) ways for each j < m.
        let per_group = (0..m.min(k + 1)).map(|j| binomial(m, j)).collect::<Result<Vec<_>>>().map_err(too_big)?;
        let mut poly = vec![1u128];
        for _ in &self.groups {
            poly = convolve(&poly, &per_group, k).map_err(too_big)?;
        }
        if !self.ring.is_empty() {
            let ring = cyclic_no_run(self.ring.len(), m, k).map_err(too_big)?;
            poly = convolve(&poly, &ring, k).map_err(too_big)?;
        }
        Ok((poly.get(k).copied().unwrap_or(0), total))
    }

    /// The exact probability that no host loses every copy of its shards when `failures`
    /// hosts, chosen uniformly at random, fail at once. Errors when `failures > hosts` or
    /// the exact count does not fit 128 bits (never for `hosts <= MAX_EXACT_HOSTS`).
    pub fn survival_probability(&self, failures: usize) -> Result<f64> {
        let (good, total) = self.survival_count(failures)?;
        Ok(good as f64 / total as f64)
    }

    /// `1 - survival_probability`, computed from the exact counts (keeps its precision when
    /// the loss is tiny).
    pub fn loss_probability(&self, failures: usize) -> Result<f64> {
        let (good, total) = self.survival_count(failures)?;
        Ok((total - good) as f64 / total as f64)
    }
}

/// GEMINI's closed form for group placement: `1 - N*C(N-m, k-m) / (m*C(N, k))`, and 1 when
/// `k < m`. Exact for `m <= k < 2m` with `m | N` (at most one group can lose all its hosts,
/// so the N/m "group g is lost" events are disjoint); for `k >= 2m` it is only a lower bound
/// (the union bound), and may be negative. Computed as `1 - (N/m) * prod_{i<m} (k-i)/(N-i)`,
/// which needs no large numbers. Returns NaN unless `1 <= m <= N` and `k <= N`.
pub fn gemini_closed_form(n: usize, m: usize, k: usize) -> f64 {
    if m == 0 || m > n || k > n {
        return f64::NAN;
    }
    if k < m {
        return 1.0;
    }
    let ratio: f64 = (0..m).map(|i| (k - i) as f64 / (n - i) as f64).product();
    1.0 - (n as f64 / m as f64) * ratio
}

/// Whether [`gemini_closed_form`] is the exact survival probability of group placement.
pub fn gemini_closed_form_is_exact(n: usize, m: usize, k: usize) -> bool {
    m >= 1 && m <= n && k <= n && n.is_multiple_of(m) && k < 2 * m
}

/// Maps each rank to the index of its host (hosts numbered in first-seen order), so that
/// ranks sharing a host share a failure domain. Returns `(host index per rank, host names)`.
pub fn host_of_ranks(hosts_by_rank: &[String]) -> (Vec<usize>, Vec<String>) {
    let mut names: Vec<String> = Vec::new();
    let mut index = std::collections::HashMap::new();
    let per_rank = hosts_by_rank
        .iter()
        .map(|h| {
            *index.entry(h.as_str()).or_insert_with(|| {
                names.push(h.clone());
                names.len() - 1
            })
        })
        .collect();
    (per_rank, names)
}

fn gcd(mut a: u128, mut b: u128) -> u128 {
    while b != 0 {
        (a, b) = (b, a % b);
    }
    a
}

/// `C(n, k)`, or an error when it does not fit `u128`. Each partial product `C(n, i+1)` is
/// formed as `(c / g) * ((n - i) / ((i + 1) / g))` with `g = gcd(c, i + 1)`, which is exact and
/// never exceeds the final value, so it overflows only when the answer does.
fn binomial(n: usize, k: usize) -> Result<u128> {
    if k > n {
        return Ok(0);
    }
    let k = k.min(n - k);
    let mut c: u128 = 1;
    for i in 0..k as u128 {
        let (top, bottom) = (n as u128 - i, i + 1);
        let g = gcd(c, bottom);
        c = (c / g).checked_mul(top / (bottom / g)).ok_or_else(overflow)?;
    }
    Ok(c)
}

fn overflow() -> Error {
    Error::invalid("exact survival count overflowed 128 bits")
}

/// Product of two polynomials, truncated after degree `max_deg`, with checked arithmetic.
fn convolve(a: &[u128], b: &[u128], max_deg: usize) -> Result<Vec<u128>> {
    let len = (a.len() + b.len() - 1).min(max_deg + 1);
    let mut out = vec![0u128; len];
    for (i, &x) in a.iter().enumerate().take(len) {
        for (j, &y) in b.iter().enumerate().take(len - i) {
            let p = x.checked_mul(y).ok_or_else(overflow)?;
            out[i + j] = out[i + j].checked_add(p).ok_or_else(overflow)?;
        }
    }
    Ok(out)
}

/// `c[j]` for `j <= max_deg`: the number of ways to fail `j` of the `r` hosts of a ring in
/// which each host's holders are `m` cyclically consecutive hosts, such that no `m`
/// cyclically consecutive hosts all fail (i.e. cyclic binary strings of length `r` with `j`
/// ones and no cyclic run of `m` ones). Requires `1 <= m <= r`.
///
/// Method: the all-ones string is always excluded (it contains a window). Any other string
/// has a first zero, at position `a` (the leading run of ones has length `a < m`). The
/// `L = r - a - 1` positions after it form a linear string whose inner runs are `< m` and
/// whose trailing run `b` joins the leading one across the wrap: `a + b < m`. One
/// transfer-matrix pass over the linear length, with state (trailing run, ones), serves every
/// `a`: length `L` is consumed by `a = r - 1 - L`.
fn cyclic_no_run(r: usize, m: usize, max_deg: usize) -> Result<Vec<u128>> {
    debug_assert!(1 <= m && m <= r);
    let mut out = vec![0u128; max_deg.min(r) + 1];
    // dp[run][ones] over linear strings of the current length with all runs < m.
    let deg = max_deg.min(r);
    let mut dp = vec![vec![0u128; deg + 1]; m];
    dp[0][0] = 1;
    for len in 0..r {
        let a = r - 1 - len;
        if a < m {
            // Trailing runs b = 0 .. m-a-1, so that a + b < m.
            for row in dp.iter().take(m - a) {
                for (ones, &c) in row.iter().enumerate() {
                    if c != 0 && ones + a < out.len() {
                        out[ones + a] = out[ones + a].checked_add(c).ok_or_else(overflow)?;
                    }
                }
            }
        }
        if len + 1 == r {
            break;
        }
        let mut next = vec![vec![0u128; deg + 1]; m];
        for run in 0..m {
            for ones in 0..=len.min(deg) {
                let c = dp[run][ones];
                if c == 0 {
                    continue;
                }
                next[0][ones] = next[0][ones].checked_add(c).ok_or_else(overflow)?;
                if run + 1 < m && ones < deg {
                    next[run + 1][ones + 1] = next[run + 1][ones + 1].checked_add(c).ok_or_else(overflow)?;
                }
            }
        }
        dp = next;
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Surviving subsets per failure count, by enumerating every subset of hosts.
    fn brute_force(p: &Placement) -> Vec<u128> {
        let n = p.hosts;
        let masks: Vec<u64> = (0..n).map(|h| p.holders(h).iter().fold(0u64, |acc, &x| acc | 1 << x)).collect();
        let mut good = vec![0u128; n + 1];
        for failed in 0u64..(1u64 << n) {
            if masks.iter().all(|&hm| hm & failed != hm) {
                good[failed.count_ones() as usize] += 1;
            }
        }
        good
    }

    fn all_valid(n: usize) -> Vec<Placement> {
        let mut out = Vec::new();
        for m in 1..=n {
            for s in Strategy::ALL {
                if let Ok(p) = Placement::new(n, m, s) {
                    out.push(p);
                }
            }
        }
        out
    }

    #[test]
    fn placement_exact_matches_brute_force_up_to_12_hosts() {
        let mut cases = 0;
        for n in 1..=12 {
            let binom: Vec<u128> = (0..=n).map(|k| binomial(n, k).unwrap()).collect();
            for p in all_valid(n) {
                let bf = brute_force(&p);
                for k in 0..=n {
                    let (good, total) = p.survival_count(k).unwrap();
                    assert_eq!(total, binom[k]);
                    assert_eq!(good, bf[k], "N={n} m={} k={k} {}", p.replicas, p.strategy);
                    let prob = p.survival_probability(k).unwrap();
                    assert!((prob - bf[k] as f64 / binom[k] as f64).abs() < 1e-15);
                    let loss = p.loss_probability(k).unwrap();
                    assert!((prob + loss - 1.0).abs() < 1e-12);
                    cases += 1;
                }
            }
        }
        // Group is valid for the divisors, ring and mixed for every m.
        assert!(cases > 1000, "{cases}");
        // A few larger clusters (2^20 failure sets), where groups and a ring coexist.
        for n in [17, 20] {
            for m in [2, 3, 4, 7] {
                for s in Strategy::ALL {
                    let Ok(p) = Placement::new(n, m, s) else { continue };
                    let bf = brute_force(&p);
                    for (k, &want) in bf.iter().enumerate() {
                        assert_eq!(p.survival_count(k).unwrap().0, want, "N={n} m={m} k={k} {s}");
                    }
                }
            }
        }
    }

    #[test]
    fn placement_holders_distinct_and_balanced() {
        for n in 1..=40 {
            for p in all_valid(n) {
                let m = p.replicas;
                let mut times = vec![0usize; n];
                for h in 0..n {
                    let hs = p.holders(h);
                    assert_eq!(hs.len(), m);
                    assert_eq!(hs[0], h, "host first");
                    let mut sorted = hs.clone();
                    sorted.sort();
                    sorted.dedup();
                    assert_eq!(sorted.len(), m, "distinct holders for N={n} m={m} {}", p.strategy);
                    assert_eq!(p.peers(h), hs[1..].to_vec());
                    for &x in &hs {
                        times[x] += 1;
                    }
                    let keeps = p.keeps(h);
                    assert_eq!(keeps.len(), m);
                    for &o in &keeps {
                        assert!(p.holders(o).contains(&h));
                    }
                }
                assert!(times.iter().all(|&t| t == m), "balance N={n} m={m} {}: {times:?}", p.strategy);
                // groups() covers every host exactly once.
                let mut all: Vec<usize> = p.groups().concat();
                all.sort();
                assert_eq!(all, (0..n).collect::<Vec<_>>());
            }
        }
    }

    #[test]
    fn placement_shapes() {
        let g = Placement::new(8, 2, Strategy::Group).unwrap();
        assert_eq!(g.groups(), vec![vec![0, 1], vec![2, 3], vec![4, 5], vec![6, 7]]);
        assert_eq!(g.holders(3), vec![3, 2]);
        assert_eq!(Placement::new(8, 2, Strategy::Mixed).unwrap().groups(), g.groups());
        let mixed = Placement::new(8, 3, Strategy::Mixed).unwrap();
        assert_eq!(mixed.groups(), vec![vec![0, 1, 2], vec![3, 4, 5, 6, 7]]);
        assert_eq!(mixed.ring(), &[3, 4, 5, 6, 7]);
        assert_eq!(mixed.holders(6), vec![6, 7, 3]);
        assert_eq!(mixed.holders(1), vec![1, 2, 0]);
        let ring = Placement::new(5, 3, Strategy::Ring).unwrap();
        assert_eq!(ring.holders(4), vec![4, 0, 1]);
        assert_eq!(ring.peers(4), vec![0, 1]);
        assert_eq!(ring.keeps(4), vec![4, 2, 3]);
        // m < N < 2m with m not dividing N: the whole cluster is one ring.
        assert_eq!(Placement::new(5, 3, Strategy::Mixed).unwrap().groups(), vec![vec![0, 1, 2, 3, 4]]);
    }

    #[test]
    fn placement_errors() {
        let msg = |r: Result<Placement>| r.unwrap_err().message;
        assert!(msg(Placement::new(4, 0, Strategy::Ring)).contains("at least 1"));
        assert!(msg(Placement::new(4, 5, Strategy::Mixed)).contains("exceeds hosts"));
        assert!(msg(Placement::new(0, 1, Strategy::Mixed)).contains("at least one host"));
        let m = msg(Placement::new(8, 3, Strategy::Group));
        assert!(m.contains("3 does not divide 8") && m.contains("mixed"), "{m}");
        assert!(Strategy::parse("bogus").unwrap_err().message.contains("\"group\""));
        assert_eq!(" Mixed ".parse::<Strategy>().unwrap(), Strategy::Mixed);
        assert_eq!(Strategy::parse("ring").unwrap().to_string(), "ring");
        let p = Placement::new(4, 2, Strategy::Group).unwrap();
        assert!(p.survival_probability(5).unwrap_err().message.contains("exceeds hosts"));
        let big = Placement::new(400, 2, Strategy::Ring).unwrap();
        let m = big.survival_probability(200).unwrap_err().message;
        assert!(m.contains("does not fit 128-bit") && m.contains("400 hosts"), "{m}");
    }

    #[test]
    fn placement_large_clusters_do_not_overflow() {
        for n in [64, 100, 127, 128] {
            for m in [1, 2, 3, 5, 8] {
                for s in Strategy::ALL {
                    let Ok(p) = Placement::new(n, m, s) else { continue };
                    let mut total = 0u128;
                    for k in 0..=n {
                        let (good, all) = p.survival_count(k).unwrap();
                        assert!(good <= all);
                        total = total.wrapping_add(all);
                        let prob = p.survival_probability(k).unwrap();
                        assert!((0.0..=1.0).contains(&prob));
                    }
                    // The sum of C(n, k) is 2^n (which wraps to 0 in u128 for n = 128).
                    assert_eq!(total, if n < 128 { 1u128 << n } else { 0 }, "sum of C(n, k) is 2^n");
                }
            }
        }
        // Beyond 128 hosts, small k still counts exactly: ring N=200, m=2, k=2 loses the 200
        // adjacent pairs; group N=1000, m=4, k=5 matches GEMINI's closed form (4 <= k < 8).
        let r = Placement::new(200, 2, Strategy::Ring).unwrap();
        assert_eq!(r.survival_count(2).unwrap(), (19900 - 200, 19900));
        let g = Placement::new(1000, 4, Strategy::Group).unwrap();
        assert!((g.survival_probability(5).unwrap() - gemini_closed_form(1000, 4, 5)).abs() < 1e-12);
        let mixed = Placement::new(1001, 4, Strategy::Mixed).unwrap();
        assert!(mixed.survival_probability(12).is_ok());
        assert_eq!(binomial(128, 64).unwrap(), 23951146041928082866135587776380551750);
        assert!(binomial(132, 66).is_err());
        assert_eq!(binomial(1000, 3).unwrap(), 166167000);
        // Closed-form checks at N = 64: with one failure per group at most, survival is
        // C(N/m, k) * m^k / C(N, k).
        let p = Placement::new(64, 2, Strategy::Group).unwrap();
        let (good, _) = p.survival_count(32).unwrap();
        assert_eq!(good, 1u128 << 32);
    }

    #[test]
    fn placement_gemini_closed_form_exact_in_range() {
        let mut exact_cases = 0;
        let mut inexact_seen = None;
        for n in 1usize..=24 {
            for m in (1..=n).filter(|&m| n.is_multiple_of(m)) {
                let p = Placement::new(n, m, Strategy::Group).unwrap();
                for k in 0..=n {
                    let exact = p.survival_probability(k).unwrap();
                    let cf = gemini_closed_form(n, m, k);
                    if gemini_closed_form_is_exact(n, m, k) {
                        assert!((exact - cf).abs() < 1e-12, "N={n} m={m} k={k}: {exact} vs {cf}");
                        exact_cases += 1;
                    } else {
                        // Outside the range it is the union bound: never above the truth.
                        assert!(cf <= exact + 1e-12, "N={n} m={m} k={k}: {cf} > {exact}");
                        if (exact - cf).abs() > 1e-6 && inexact_seen.is_none() {
                            inexact_seen = Some((n, m, k, exact, cf));
                        }
                    }
                }
            }
        }
        assert!(exact_cases > 100);
        assert!(inexact_seen.is_some());
        // A concrete case outside the range: N=8, m=2, k=4. Two whole groups can fail at
        // once, so the closed form 1 - 4*C(6,2)/C(8,4) = 1 - 60/70 undercounts survival
        // (exact: 2^4 = 16 sets with one failure per group, of 70).
        let p = Placement::new(8, 2, Strategy::Group).unwrap();
        assert_eq!(p.survival_count(4).unwrap(), (16, 70));
        assert!((gemini_closed_form(8, 2, 4) - (1.0 - 60.0 / 70.0)).abs() < 1e-15);
        assert!((p.survival_probability(4).unwrap() - 16.0 / 70.0).abs() < 1e-15);
        assert_eq!(gemini_closed_form(8, 2, 1), 1.0);
        assert!(gemini_closed_form(8, 9, 1).is_nan());
    }

    #[test]
    fn placement_ring_worse_than_group_by_about_m() {
        // GEMINI: ring's failure term is about m times group's.
        for (n, m) in [(16, 2), (18, 3), (64, 4)] {
            let g = Placement::new(n, m, Strategy::Group).unwrap();
            let r = Placement::new(n, m, Strategy::Ring).unwrap();
            let k = m;
            let ratio = r.loss_probability(k).unwrap() / g.loss_probability(k).unwrap();
            assert!((ratio - m as f64).abs() < 1e-9, "N={n} m={m}: ratio {ratio}");
            assert!(r.survival_probability(k).unwrap() < g.survival_probability(k).unwrap());
        }
        // N=16, m=2, k=2: group loses 8 of C(16,2)=120 pairs, ring 16.
        let g = Placement::new(16, 2, Strategy::Group).unwrap();
        let r = Placement::new(16, 2, Strategy::Ring).unwrap();
        assert_eq!(g.survival_count(2).unwrap(), (112, 120));
        assert_eq!(r.survival_count(2).unwrap(), (104, 120));
        // Slightly above k = m the ratio stays close to m.
        let ratio = r.loss_probability(3).unwrap() / g.loss_probability(3).unwrap();
        assert!(ratio > 1.5 && ratio < 2.5, "{ratio}");
    }

    #[test]
    fn placement_host_of_ranks() {
        let ranks: Vec<String> = ["b", "b", "a", "a", "b", "c"].iter().map(|s| s.to_string()).collect();
        let (idx, names) = host_of_ranks(&ranks);
        assert_eq!(idx, vec![0, 0, 1, 1, 0, 2]);
        assert_eq!(names, vec!["b", "a", "c"]);
        assert_eq!(host_of_ranks(&[]), (vec![], vec![]));
    }
}
