//! The peer tier sends a holder only the chunks it lacks: the bytes on the wire (counted at a
//! TCP proxy on the link), a holder that lost or damaged its copy of the earlier step, chunks
//! without a hash, and the estimate the traffic schedule plans with.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicU64, Ordering};

use super::tests::{open_tier, shm_dir, VecSource};
use super::*;
use crate::format;

/// Forwards connections to `target`, counting the bytes that go towards it.
struct CountingProxy {
    addr: String,
    sent: Arc<AtomicU64>,
}

impl CountingProxy {
    fn start(target: String) -> CountingProxy {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let sent = Arc::new(AtomicU64::new(0));
        let counter = sent.clone();
        std::thread::spawn(move || {
            for client in listener.incoming() {
                let Ok(client) = client else { return };
                let Ok(server) = TcpStream::connect(&target) else { continue };
                let (c2, s2) = (client.try_clone().unwrap(), server.try_clone().unwrap());
                let counter = counter.clone();
                std::thread::spawn(move || pipe(client, server, Some(&counter)));
                std::thread::spawn(move || pipe(s2, c2, None));
            }
        });
        CountingProxy { addr, sent }
    }

    fn sent(&self) -> u64 {
        self.sent.load(Ordering::SeqCst)
    }
}

fn pipe(mut from: TcpStream, mut to: TcpStream, count: Option<&AtomicU64>) {
    let mut buf = vec![0u8; 1 << 16];
    while let Ok(n) = from.read(&mut buf) {
        if n == 0 {
            break;
        }
        if let Some(c) = count {
            c.fetch_add(n as u64, Ordering::SeqCst);
        }
        if to.write_all(&buf[..n]).is_err() {
            break;
        }
    }
    let _ = to.shutdown(std::net::Shutdown::Both);
    let _ = from.shutdown(std::net::Shutdown::Both);
}

/// Rank 0 on host A replicates to host B through a counting proxy; rank 1 on host B.
struct Proxied {
    dir: tempfile::TempDir,
    a: Arc<PeerTier>,
    b: Arc<PeerTier>,
    proxy: CountingProxy,
}

fn proxied() -> Proxied {
    let dir = shm_dir();
    let limits = Limits::default();
    let (a, b) = (
        open_tier(dir.path(), 0, "hostA", 2, Duration::from_secs(5), limits),
        open_tier(dir.path(), 1, "hostB", 2, Duration::from_secs(5), limits),
    );
    let proxy = CountingProxy::start(b.local_addr().to_string());
    let hosts = vec!["hostA".to_string(), "hostB".to_string()];
    a.set_cluster("job", &hosts, &[a.local_addr().to_string(), proxy.addr.clone()]).unwrap();
    b.set_cluster("job", &hosts, &[a.local_addr().to_string(), b.local_addr().to_string()]).unwrap();
    Proxied { dir, a, b, proxy }
}

/// `tests::manifest` with each chunk's hash, as the memory flush records it.
fn hashed(step: u64, data: &[Vec<u8>]) -> Manifest {
    let mut m = super::tests::manifest(step, 0, data);
    for (it, d) in m.items.iter_mut().zip(data) {
        for c in &mut it.chunks {
            c.hash = Some(crate::checksum::crc32c_and_hash(&d[c.offset as usize..(c.offset + c.len) as usize]).1);
        }
    }
    m
}

/// A large item that never changes and a small one that changes every step.
fn state(step: u64) -> Vec<Vec<u8>> {
    let base: Vec<u8> = (0..256 * 1024u32).map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8).collect();
    vec![base, vec![step as u8; 2048]]
}

/// Every chunk of `m` read back through rank 0's peer tier equals `data`.
fn read_back(t: &PeerTier, step: u64, data: &[Vec<u8>]) {
    t.manifests.lock().clear();
    let got = t.read_manifest(step, 0).unwrap();
    for (i, it) in got.items.iter().enumerate() {
        let mut buf = vec![0u8; it.nbytes as usize];
        for (c, ch) in it.chunks.iter().enumerate() {
            crate::tier::read_chunk(t, &got, i, c, &mut buf[ch.offset as usize..(ch.offset + ch.len) as usize]).unwrap();
        }
        assert!(buf == data[i], "step {step} item {i} differs");
    }
}

/// The JSON of a PUT and its manifest, with room for the frames around it.
fn manifest_bytes(m: &Manifest) -> u64 {
    m.to_json().len() as u64 + 4096
}

fn corrupt(dir: &std::path::Path, step: u64, at: usize) {
    let path = dir.join("hostB").join(REPLICA_DIR).join(format::step_dir(step)).join(format::part_name(0, 0));
    let mut f = std::fs::OpenOptions::new().read(true).write(true).open(&path).unwrap();
    use std::io::{Seek, SeekFrom};
    let mut b = [0u8; 1];
    f.seek(SeekFrom::Start(at as u64)).unwrap();
    f.read_exact(&mut b).unwrap();
    f.seek(SeekFrom::Start(at as u64)).unwrap();
    f.write_all(&[b[0] ^ 0x40]).unwrap();
}

#[test]
fn a_holder_with_the_previous_step_is_sent_only_the_changed_chunks() {
    let p = proxied();
    let link = Link::new("peer", None);
    let (s1, s2) = (state(1), state(2));
    let (m1, m2) = (hashed(1, &s1), hashed(2, &s2));
    p.a.write_rank(&m1, &VecSource(s1.clone()), &link).unwrap();
    let first = p.proxy.sent();
    assert!(first >= m1.total_bytes(), "step 1 goes whole: {first} bytes on the wire");
    // The schedule expects only the changed item to move.
    assert_eq!(p.a.bytes_to_move(&m2), 2048);
    p.a.write_rank(&m2, &VecSource(s2.clone()), &link).unwrap();
    let second = p.proxy.sent() - first;
    assert!(second <= 2048 + manifest_bytes(&m2), "step 2 put {second} bytes on the wire for 2048 changed");
    assert_eq!(p.a.sent.last(), (2048, m2.total_bytes()));
    assert_eq!(p.a.sent.total(), (m1.total_bytes() + 2048, m1.total_bytes() + m2.total_bytes()));
    assert_eq!(link.bytes_sent(), m1.total_bytes() + 2048, "the link's gate saw only the chunks that moved");
    read_back(&p.a, 1, &s1);
    read_back(&p.a, 2, &s2);
    // Rebuilt from rebuilt replicas, a step later.
    let s3 = state(3);
    p.a.write_rank(&hashed(3, &s3), &VecSource(s3.clone()), &link).unwrap();
    assert_eq!(p.a.sent.last().0, 2048);
    read_back(&p.a, 3, &s3);
    p.a.shutdown();
    p.b.shutdown();
}

#[test]
fn a_holder_that_lost_the_previous_step_gets_the_whole_step() {
    let p = proxied();
    let link = Link::new("peer", None);
    let (s1, s2) = (state(1), state(2));
    p.a.write_rank(&hashed(1, &s1), &VecSource(s1), &link).unwrap();
    // Host B's retention (or a restart) dropped its replica of step 1.
    p.b.replicas.evict(1).unwrap();
    let before = p.proxy.sent();
    let m2 = hashed(2, &s2);
    p.a.write_rank(&m2, &VecSource(s2.clone()), &link).unwrap();
    assert!(p.proxy.sent() - before >= m2.total_bytes());
    assert_eq!(p.a.sent.last(), (m2.total_bytes(), m2.total_bytes()));
    read_back(&p.a, 2, &s2);
    p.a.shutdown();
    p.b.shutdown();
}

#[test]
fn a_held_chunk_damaged_since_it_arrived_is_sent_again() {
    let p = proxied();
    let link = Link::new("peer", None);
    let (s1, s2) = (state(1), state(2));
    p.a.write_rank(&hashed(1, &s1), &VecSource(s1), &link).unwrap();
    // One byte of chunk 5 of the unchanged item flips in host B's copy of step 1.
    corrupt(p.dir.path(), 1, 5 * 1024 + 3);
    let m2 = hashed(2, &s2);
    p.a.write_rank(&m2, &VecSource(s2.clone()), &link).unwrap();
    assert_eq!(p.a.sent.last().0, 2048 + 1024, "the changed item and the damaged chunk");
    read_back(&p.a, 2, &s2);
    p.a.shutdown();
    p.b.shutdown();
}

#[test]
fn chunks_without_a_hash_are_always_sent() {
    let p = proxied();
    let link = Link::new("peer", None);
    let (s1, s2) = (state(1), state(2));
    // Manifests of a writer that recorded no hashes.
    p.a.write_rank(&super::tests::manifest(1, 0, &s1), &VecSource(s1), &link).unwrap();
    let m2 = super::tests::manifest(2, 0, &s2);
    assert_eq!(p.a.bytes_to_move(&m2), m2.total_bytes());
    p.a.write_rank(&m2, &VecSource(s2.clone()), &link).unwrap();
    assert_eq!(p.a.sent.last().0, m2.total_bytes());
    read_back(&p.a, 2, &s2);
    p.a.shutdown();
    p.b.shutdown();
}

/// A base that retention removed before its chunks were copied fills nothing: they are sent.
#[test]
fn a_base_removed_before_the_copy_fills_nothing() {
    let p = proxied();
    let link = Link::new("peer", None);
    let (s1, s2) = (state(1), state(2));
    p.a.write_rank(&hashed(1, &s1), &VecSource(s1), &link).unwrap();
    let m2 = hashed(2, &s2);
    let held = p.b.replicas.allocate(2, 0, 0, m2.objects[0].len).unwrap();
    let segs = vec![held];
    // Listed (and pinned) before the removal, as a retention that planned earlier would do.
    let bases = p.b.holding.pin_bases(2, 0);
    assert_eq!(bases, vec![1]);
    let filled = reuse::fill("peer", &p.b.replicas, &m2, &segs, &bases);
    assert_eq!(filled.iter().filter(|f| **f).count(), 256, "the unchanged item's chunks are filled");
    p.b.replicas.evict(1).unwrap();
    let filled = reuse::fill("peer", &p.b.replicas, &m2, &segs, &bases);
    assert!(filled.iter().all(|f| !f));
    p.b.holding.unpin(&bases);
    drop(segs);
    p.a.shutdown();
    p.b.shutdown();
}
