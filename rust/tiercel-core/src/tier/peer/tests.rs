//! The peer tier between processes on loopback: replication, restore with holder fallback,
//! what strangers and corrupt frames get.

use std::io::{Read, Write};

use super::*;
use crate::format;
use crate::transport::messages::{Reply, Request};
use crate::transport::{self, DataHeader, Kind};

pub(super) struct VecSource(pub Vec<Vec<u8>>);
impl ChunkSource for VecSource {
    fn read_raw(&self, item: usize, chunk: usize, dst: &mut [u8]) -> Result<()> {
        let off = chunk * 1024;
        dst.copy_from_slice(&self.0[item][off..off + dst.len()]);
        Ok(())
    }
}

pub(super) fn manifest(step: u64, rank: u32, data: &[Vec<u8>]) -> Manifest {
    let mut m = Manifest::new(step, rank, 2, "ram", 1024);
    let mut pos = 0;
    for (i, d) in data.iter().enumerate() {
        let chunks = format::chunk_ranges(d.len() as u64, 1024)
            .map(|(off, len)| ChunkMeta {
                offset: off,
                len,
                crc32c: crate::checksum::crc32c(&d[off as usize..(off + len) as usize]),
                object: 0,
                stored_offset: pos + off,
                stored_len: len,
                codec: "raw".into(),
                hash: None,
            })
            .collect();
        m.items.push(format::ItemMeta {
            name: format!("m/{i}"),
            kind: "array".into(),
            dtype: "uint8".into(),
            shape: vec![d.len() as u64],
            nbytes: d.len() as u64,
            meta: serde_json::Value::Null,
            shard: None,
            replica: None,
            chunks,
        });
        pos = format::align_up(pos + d.len() as u64, 64);
    }
    m.objects.push(format::ObjectMeta { name: format::part_name(rank, 0), len: pos, key: None });
    m
}

pub(super) const SECRET: &[u8] = b"0123456789abcdef-test";

/// Opens rank `rank`'s peer tier on host `host` under `dir` (loopback, a free port).
pub(super) fn open_tier(dir: &std::path::Path, rank: u32, host: &str, replicas: usize, timeout: Duration, limits: Limits) -> Arc<PeerTier> {
    PeerTier::open(
        "peer",
        rank,
        &dir.join(host),
        PeerOptions {
            listen: "127.0.0.1:0".into(),
            replicas,
            strategy: Strategy::Mixed,
            keep: 2,
            secret: Some(SECRET.to_vec()),
            timeout,
            limits,
        },
    )
    .unwrap()
}

pub(super) fn shm_dir() -> tempfile::TempDir {
    tempfile::Builder::new().prefix("tiercel-peer-test").tempdir_in("/dev/shm").unwrap()
}

/// Ranks 0 and 1 on hosts A and B, each holding the other's replicas.
pub(super) fn pair_with(limits: Limits, timeout: Duration) -> (tempfile::TempDir, Arc<PeerTier>, Arc<PeerTier>) {
    let dir = shm_dir();
    let (a, b) = (open_tier(dir.path(), 0, "hostA", 2, timeout, limits), open_tier(dir.path(), 1, "hostB", 2, timeout, limits));
    let hosts = vec!["hostA".to_string(), "hostB".to_string()];
    let addrs = vec![a.local_addr().to_string(), b.local_addr().to_string()];
    a.set_cluster("job", &hosts, &addrs).unwrap();
    b.set_cluster("job", &hosts, &addrs).unwrap();
    (dir, a, b)
}

fn pair() -> (tempfile::TempDir, Arc<PeerTier>, Arc<PeerTier>) {
    pair_with(Limits::default(), Duration::from_secs(5))
}

/// A peer that dies mid-transfer: the rest of the chunks come from another holder.
#[test]
fn a_holder_dying_mid_restore_is_replaced_by_another() {
    let dir = shm_dir();
    let tiers: Vec<Arc<PeerTier>> =
        (0..3).map(|r| open_tier(dir.path(), r, &format!("h{r}"), 3, Duration::from_secs(5), Limits::default())).collect();
    let hosts: Vec<String> = (0..3).map(|h| format!("h{h}")).collect();
    let addrs: Vec<String> = tiers.iter().map(|t| t.local_addr().to_string()).collect();
    for t in &tiers {
        t.set_cluster("job", &hosts, &addrs).unwrap();
    }
    let data = vec![(0..8192u32).map(|i| (i % 251) as u8).collect::<Vec<u8>>()];
    let m = manifest(1, 0, &data);
    tiers[0].write_rank(&m, &VecSource(data.clone()), &Link::new("p", None)).unwrap();
    let got = tiers[0].read_manifest(1, 0).unwrap();
    let first = tiers[0].manifests.lock().get(&(1, 0)).unwrap().1.clone();
    let n = got.items[0].chunks.len();
    assert!(n >= 4);
    let mut buf = vec![0u8; 8192];
    for (c, ch) in got.items[0].chunks.iter().enumerate() {
        if c == n / 2 {
            // The holder that served so far goes away in the middle of the restore.
            let dead = tiers.iter().find(|t| t.local_addr().to_string() == first).unwrap();
            dead.shutdown();
        }
        crate::tier::read_chunk(&*tiers[0], &got, 0, c, &mut buf[ch.offset as usize..(ch.offset + ch.len) as usize]).unwrap();
    }
    assert_eq!(buf, data[0]);
    for t in &tiers {
        t.shutdown();
    }
}

#[test]
fn replicate_and_read_back() {
    let (_dir, a, b) = pair();
    let data = vec![(0..3000u32).map(|i| (i * 7) as u8).collect::<Vec<u8>>(), vec![5u8; 10], vec![]];
    let m = manifest(3, 0, &data);
    let link = Link::new("peer", None);
    a.write_rank(&m, &VecSource(data.clone()), &link).unwrap();
    // Rank 0's copy now lives on host B; rank 0 sees it through its peer tier.
    assert_eq!(a.committed_steps().unwrap(), vec![3]);
    let got = a.read_manifest(3, 0).unwrap();
    assert_eq!(got.items, m.items);
    for (i, it) in got.items.iter().enumerate() {
        let mut buf = vec![0u8; it.nbytes as usize];
        for (c, ch) in it.chunks.iter().enumerate() {
            crate::tier::read_chunk(&*a, &got, i, c, &mut buf[ch.offset as usize..(ch.offset + ch.len) as usize]).unwrap();
        }
        assert_eq!(buf, data[i]);
    }
    // Host B holds it; host A holds nothing of its own rank.
    assert_eq!(b.replicas.all_steps().unwrap(), vec![3]);
    // Retention on the holder: keep = 2.
    for step in 4..7 {
        a.write_rank(&manifest(step, 0, &data), &VecSource(data.clone()), &link).unwrap();
    }
    assert_eq!(a.committed_steps().unwrap(), vec![5, 6]);
    a.shutdown();
    b.shutdown();
}

#[test]
fn strangers_and_garbage_are_refused_and_the_server_lives_on() {
    let (_dir, a, b) = pair();
    let addr = b.local_addr().to_string();
    // 1. Garbage instead of AUTH.
    let mut s = std::net::TcpStream::connect(&addr).unwrap();
    let mut hello = [0u8; transport::HEADER_LEN + transport::NONCE_LEN];
    s.read_exact(&mut hello).unwrap();
    s.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n").unwrap();
    let mut rest = vec![];
    let _ = s.read_to_end(&mut rest); // the server closes the connection
                                      // 2. A client with the wrong secret is told so and gets nothing.
    let e = Conn::connect_unidentified(&addr, b"wrong-but-long-enough", Duration::from_secs(5)).err().expect("refused");
    assert!(e.message.contains("secret") || e.message.contains("authentication"), "{}", e.message);
    // 3. A huge length prefix is refused before anything is allocated.
    let mut s = std::net::TcpStream::connect(&addr).unwrap();
    s.read_exact(&mut hello).unwrap();
    s.write_all(&transport::encode_header(Kind::Auth, 64)[..8]).unwrap();
    s.write_all(&u64::MAX.to_le_bytes()).unwrap();
    let _ = s.read_to_end(&mut rest);
    // 4. An authenticated client sending a malformed request and a bad data frame.
    let mut c = Conn::connect(&addr, SECRET, Duration::from_secs(5), &a.me().unwrap(), "hostB").unwrap();
    c.send(Kind::Request, b"{not json").unwrap();
    assert!(c.recv().is_err(), "connection dropped after a malformed request");
    // The server still serves the real client.
    let data = vec![vec![1u8; 5000]];
    a.write_rank(&manifest(1, 0, &data), &VecSource(data.clone()), &Link::new("p", None)).unwrap();
    assert_eq!(a.committed_steps().unwrap(), vec![1]);
    a.shutdown();
    b.shutdown();
}

#[test]
fn corrupt_data_frame_is_rejected_and_leaves_no_replica() {
    let (_dir, a, b) = pair();
    let data = vec![vec![9u8; 2048]];
    let m = manifest(2, 0, &data);
    let mut c = Conn::connect(&b.local_addr().to_string(), SECRET, Duration::from_secs(5), &a.me().unwrap(), "hostB").unwrap();
    let _: Reply = c.request(&Request::Put { step: 2, rank: 0, manifest: m.clone() }).unwrap();
    let ch = &m.items[0].chunks[0];
    let bad = vec![8u8; ch.len as usize];
    c.send_data(&DataHeader { object: 0, offset: ch.stored_offset, crc32c: ch.crc32c }, &bad).unwrap();
    c.send(Kind::End, &[]).unwrap();
    let e = c.response::<Reply>().unwrap_err();
    assert!(e.message.contains("corrupted"), "{}", e.message);
    assert!(a.committed_steps().unwrap().is_empty());
    a.shutdown();
    b.shutdown();
}

#[test]
fn a_chunk_damaged_on_its_holder_is_refused_on_arrival() {
    let (dir, a, b) = pair();
    let data = vec![(0..5000u32).map(|i| (i * 13) as u8).collect::<Vec<u8>>()];
    a.write_rank(&manifest(3, 0, &data), &VecSource(data.clone()), &Link::new("peer", None)).unwrap();
    let got = a.read_manifest(3, 0).unwrap();
    // One byte of chunk 2 flips in host B's copy, behind the holder's back.
    let path = dir.path().join("hostB").join(REPLICA_DIR).join(format::step_dir(3)).join(format::part_name(0, 0));
    let mut bytes = std::fs::read(&path).unwrap();
    bytes[2 * 1024 + 7] ^= 0x10;
    std::fs::write(&path, &bytes).unwrap();
    let it = &got.items[0];
    let mut buf = vec![0u8; it.nbytes as usize];
    for (c, ch) in it.chunks.iter().enumerate() {
        let dst = &mut buf[ch.offset as usize..(ch.offset + ch.len) as usize];
        let r = crate::tier::read_chunk(&*a, &got, 0, c, dst);
        // The peer tier checks each chunk as it lands (read_chunk does not check it again).
        if c == 2 {
            let e = r.unwrap_err();
            assert_eq!(e.kind, ErrorKind::Integrity, "{e}");
        } else {
            r.unwrap();
            assert_eq!(dst, &data[0][ch.offset as usize..(ch.offset + ch.len) as usize]);
        }
    }
    a.shutdown();
    b.shutdown();
}

#[test]
fn only_pushes_over_a_paced_link_cap_their_send_buffer() {
    use crate::policy::{TrafficConfig, TrafficMode};
    use crate::scheduler::{LinkKind, SystemClock, Traffic};
    let (_dir, a, b) = pair();
    let data = vec![vec![9u8; 8 << 20]];
    for (step, mode) in [(1, TrafficMode::Off), (2, TrafficMode::Signals), (3, TrafficMode::Learned)] {
        let traffic = Traffic::new(TrafficConfig { mode, ..Default::default() }, SystemClock::shared());
        let link = Link::with_traffic("peer", None, LinkKind::Network, traffic);
        a.idle.lock().clear(); // a fresh connection for each mode
        a.write_rank(&manifest(step, 0, &data), &VecSource(data.clone()), &link).unwrap();
        let bufs: Vec<i32> = a.idle.lock().values().flatten().map(|c| c.send_buffer()).collect();
        assert_eq!(bufs.len(), 1);
        let capped = transport::client::SEND_BUFFER;
        if mode == TrafficMode::Off {
            // The kernel's autotuning grew it while 8 MiB went out: nothing paces the chunks.
            assert!(bufs[0] > 2 * capped, "{mode:?}: {bufs:?}");
        } else {
            // Linux doubles the value (its bookkeeping) and no longer autotunes it upwards.
            assert!((capped..=2 * capped).contains(&bufs[0]), "{mode:?}: {bufs:?}");
        }
    }
    a.shutdown();
    b.shutdown();
}

/// Four hosts of one rank each, `replicas = 2` (groups {h0, h1} and {h2, h3}): each tier is
/// told only its own host and its placement neighbour, as a Store learns them when it opens.
/// Replication and reads go on as with every member known; a rank on a host it was not told
/// of is NotFound (read from another tier), and members that lack a neighbour are refused.
#[test]
fn a_tier_that_knows_only_its_neighbours_replicates_and_reads_back() {
    let dir = shm_dir();
    let tiers: Vec<Arc<PeerTier>> =
        (0..4).map(|r| open_tier(dir.path(), r, &format!("h{r}"), 2, Duration::from_secs(5), Limits::default())).collect();
    let host = |i: usize| HostMembers { index: i, name: format!("h{i}"), ranks: vec![(i as u32, tiers[i].local_addr().to_string())] };
    let around = tiers[0].neighbours(4).unwrap().unwrap();
    assert_eq!(around, vec![vec![1], vec![0], vec![3], vec![2]]);
    for (i, t) in tiers.iter().enumerate() {
        let mut known = vec![host(i)];
        known.extend(around[i].iter().map(|&k| host(k)));
        t.set_members("job", 4, 4, &known).unwrap();
    }
    let data = vec![(0..5000u32).map(|i| (i % 13) as u8).collect::<Vec<u8>>()];
    let m = manifest(2, 0, &data);
    tiers[0].write_rank(&m, &VecSource(data.clone()), &Link::new("p", None)).unwrap();
    assert_eq!(tiers[0].committed_steps().unwrap(), vec![2]);
    let got = tiers[0].read_manifest(2, 0).unwrap();
    let mut buf = vec![0u8; 5000];
    for (c, ch) in got.items[0].chunks.iter().enumerate() {
        crate::tier::read_chunk(&*tiers[0], &got, 0, c, &mut buf[ch.offset as usize..(ch.offset + ch.len) as usize]).unwrap();
    }
    assert_eq!(buf, data[0]);
    // Host h1 holds rank 0's replica and knows rank 0; host h2's rank does not.
    assert_eq!(tiers[1].read_manifest(2, 0).unwrap().items, m.items);
    let e = tiers[2].read_manifest(2, 0).unwrap_err();
    assert_eq!(e.kind, ErrorKind::NotFound, "{e}");
    assert!(e.message.contains("no host this process knows holds step 2 of rank 0"), "{e}");
    // Members without the placement neighbour: refused, naming what is missing.
    let e = tiers[0].set_members("job", 4, 4, &[host(0)]).unwrap_err();
    assert!(e.message.contains("placement neighbours [1]"), "{e}");
    for t in &tiers {
        t.shutdown();
    }
}

/// Reads `rank`'s step `step` whole through `tier` (manifest, then every chunk).
fn read_whole(tier: &PeerTier, step: u64, rank: u32) -> Result<Vec<Vec<u8>>> {
    let m = tier.read_manifest(step, rank)?;
    let mut out = vec![];
    for (i, it) in m.items.iter().enumerate() {
        let mut buf = vec![0u8; it.nbytes as usize];
        for (c, ch) in it.chunks.iter().enumerate() {
            crate::tier::read_chunk(tier, &m, i, c, &mut buf[ch.offset as usize..(ch.offset + ch.len) as usize])?;
        }
        out.push(buf);
    }
    Ok(out)
}

/// A job of 3 hosts (ring: A's replicas on B, B's on C, C's on A) loses host C and goes on
/// with 2: each saved rank's copy is read from wherever one is left, though this job's
/// placement places none of them: rank 2's from host A's replica store (on A, from its files;
/// on B, from A's server), rank 1's from host B's own memory tier (its replica was on C).
#[test]
fn a_job_on_fewer_hosts_reads_every_saved_rank_from_the_survivors() {
    let dir = shm_dir();
    let timeout = Duration::from_secs(5);
    let hosts: Vec<String> = ["hostA", "hostB", "hostC"].map(String::from).to_vec();
    let old: Vec<Arc<PeerTier>> = (0..3).map(|r| open_tier(dir.path(), r, &hosts[r as usize], 2, timeout, Limits::default())).collect();
    let addrs: Vec<String> = old.iter().map(|t| t.local_addr().to_string()).collect();
    let data: Vec<Vec<Vec<u8>>> = (0..3u32).map(|r| vec![(0..5000u32).map(|i| (i * (r + 3)) as u8).collect()]).collect();
    let link = Link::new("peer", None);
    for t in &old {
        t.set_cluster("job", &hosts, &addrs).unwrap();
    }
    for (r, t) in old.iter().enumerate() {
        let mut m = manifest(1, r as u32, &data[r]);
        m.world_size = 3;
        t.write_rank(&m, &VecSource(data[r].clone()), &link).unwrap();
    }
    // Host B's own memory tier holds (and committed) rank 1's step, as its Store would.
    let own_b = MemoryTier::open("ram", &dir.path().join("hostB"), None).unwrap();
    own_b.set_local_ranks(vec![1]);
    let mut m1 = manifest(1, 1, &data[1]);
    m1.world_size = 3;
    own_b.write_rank(&m1, &VecSource(data[1].clone()), &link).unwrap();
    assert!(own_b.try_commit(1, 3).unwrap());
    // A step of this job's shape is looked for where the placement put it (and another
    // rank's on that rank's own host), nowhere else; one saved by another number of ranks on
    // every other host too.
    let names = |hs: Vec<HolderHost>| hs.into_iter().map(|h| h.name).collect::<Vec<_>>();
    assert_eq!(names(old[0].sources(0, Some(3)).unwrap()), ["hostB"]);
    assert_eq!(names(old[0].sources(1, Some(3)).unwrap()), ["hostC", "hostB"]);
    assert_eq!(names(old[0].sources(0, Some(4)).unwrap()), ["hostB", "hostC"]);
    for t in &old {
        t.shutdown();
    }
    std::fs::remove_dir_all(dir.path().join("hostC")).unwrap(); // host C is lost
                                                                // The job restarts on hosts A and B: rank 0 on A, rank 1 on B.
    let new: Vec<Arc<PeerTier>> = (0..2).map(|r| open_tier(dir.path(), r, &hosts[r as usize], 2, timeout, Limits::default())).collect();
    new[1].serve_own(own_b.clone());
    let addrs: Vec<String> = new.iter().map(|t| t.local_addr().to_string()).collect();
    for t in &new {
        t.set_cluster("job2", &hosts[..2], &addrs).unwrap();
    }
    assert_eq!(read_whole(&new[0], 1, 2).unwrap(), data[2]);
    assert_eq!(new[0].manifests.lock().get(&(1, 2)).unwrap().1, LOCAL, "host A's own replica store, no connection");
    assert_eq!(read_whole(&new[1], 1, 2).unwrap(), data[2]);
    assert_eq!(read_whole(&new[0], 1, 1).unwrap(), data[1]);
    assert_eq!(read_whole(&new[1], 1, 0).unwrap(), data[0]);
    // Rank 1's copy is on no peer of B: its commit record comes from a replica B holds.
    assert_eq!(new[1].commit_record(1).unwrap().world_size, 3);
    // B's peer tier never asks its own host (B's RAM is its memory tier's to read), and no
    // other host has rank 1: a clear NotFound.
    let e = read_whole(&new[1], 1, 1).unwrap_err();
    assert_eq!(e.kind, ErrorKind::NotFound, "{e}");
    for t in &new {
        t.shutdown();
    }
}
