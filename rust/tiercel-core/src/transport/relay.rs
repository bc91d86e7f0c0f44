//! The relay: how the ranks of a replica group pass chunks of replicated items to each other
//! during a restore (`store::broadcast`). Each rank serves the chunks it holds for others
//! from a bounded table (`offer`ed with the ranks that will take them); a rank that needs a
//! chunk asks the rank that has it (`fetch`), whose server waits, up to a deadline, until the
//! chunk is there. The protocol is the peer protocol's (frames, shared-secret handshake,
//! IDENT, data frames carrying the chunk's CRC32C), with one request of its own:
//!
//! ```text
//! REQUEST {"op": "chunk", "step", "owner", "item", "chunk", "len"}   ->   DATA (the chunk) or ERROR
//! ```
//!
//! Blocking threads, one per connection: a request waits on the table, not on I/O.
//! A connection that ends marks its rank gone: what was kept for it is dropped at once, so a
//! receiver that dies holds nobody up.

use std::collections::{HashMap, HashSet};
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};
use serde::{Deserialize, Serialize};

use super::frame::*;
use super::messages::{Ident, Reply, Request};
use super::Conn;
use crate::error::{Error, ErrorKind, Result};
use crate::policy::check_secret;
use crate::scheduler::Link;

/// One chunk of one shared item of one step: by the rank whose copy it is (`owner`) and the
/// item's name there, which every rank reading it names alike.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct ChunkKey {
    pub step: u64,
    pub owner: u32,
    pub item: String,
    pub chunk: u32,
}

#[derive(Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
enum RelayRequest {
    Chunk {
        #[serde(flatten)]
        key: ChunkKey,
        len: u64,
    },
}

struct Entry {
    data: Arc<Vec<u8>>,
    crc32c: u32,
    /// Ranks that will still take it; the entry goes when none is left.
    waiting: Vec<u32>,
    window: u64,
}

#[derive(Default)]
struct Table {
    entries: HashMap<ChunkKey, Entry>,
    /// Ranks whose last connection ended: nothing more is kept for them.
    gone: HashSet<u32>,
    /// Open connections per rank (a rank fetches over several at once).
    conns: HashMap<u32, usize>,
}

pub struct Relay {
    addr: SocketAddr,
    me: Ident,
    secret: Vec<u8>,
    /// How long a request waits for its chunk to be offered.
    wait: Duration,
    table: Mutex<Table>,
    changed: Condvar,
    stop: AtomicBool,
    pool: Mutex<HashMap<String, Vec<Conn>>>,
    /// The link its chunks leave by (the peer tier's, when the store has one: the same
    /// network between hosts, under the same bandwidth limit).
    link: Arc<Link>,
    /// Bytes this rank's server has sent to other ranks.
    pub served: AtomicU64,
}

impl Relay {
    /// Listens on `listen` ("ip:port", port 0 for any) and serves until `stop`; every chunk
    /// it sends takes `link`'s tokens first.
    pub fn start(listen: &str, me: Ident, secret: Vec<u8>, wait: Duration, link: Arc<Link>) -> Result<Arc<Relay>> {
        check_secret(&secret, "the relay secret")?;
        let listener = TcpListener::bind(listen).map_err(|e| Error::unavailable(format!("relay: cannot listen on {listen}: {e}")))?;
        let addr = listener.local_addr().map_err(|e| Error::unavailable(format!("relay: {e}")))?;
        let relay = Arc::new(Relay {
            addr,
            me,
            secret,
            wait,
            table: Mutex::new(Table::default()),
            changed: Condvar::new(),
            stop: AtomicBool::new(false),
            pool: Mutex::new(HashMap::new()),
            link,
            served: AtomicU64::new(0),
        });
        let weak = Arc::downgrade(&relay);
        std::thread::Builder::new()
            .name("tiercel-relay".into())
            .spawn(move || {
                for sock in listener.incoming() {
                    let Some(relay) = weak.upgrade() else { return };
                    if relay.stop.load(Ordering::SeqCst) {
                        return;
                    }
                    let Ok(sock) = sock else { continue };
                    std::thread::spawn(move || {
                        if let Err(e) = relay.connection(sock) {
                            log::debug!("relay of rank {}: connection ended: {e}", relay.me.rank);
                        }
                    });
                }
            })
            .map_err(|e| Error::unavailable(format!("relay: cannot start its thread: {e}")))?;
        Ok(relay)
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Stops accepting connections (open ones end with their clients).
    pub fn stop(&self) {
        self.stop.store(true, Ordering::SeqCst);
        let _ = TcpStream::connect_timeout(&self.addr, Duration::from_millis(200));
        self.pool.lock().clear();
    }

    /// Before a new restore: every rank counts as alive again, nothing is kept.
    pub fn reset(&self) {
        let mut t = self.table.lock();
        t.entries.clear();
        t.gone.clear();
    }

    /// Keeps a copy of a chunk for `ranks` (those not gone) until each has taken it.
    pub fn offer(&self, key: ChunkKey, bytes: &[u8], crc32c: u32, ranks: &[u32], window: u64) {
        let mut t = self.table.lock();
        let waiting: Vec<u32> = ranks.iter().copied().filter(|r| !t.gone.contains(r)).collect();
        if waiting.is_empty() {
            return;
        }
        t.entries.insert(key, Entry { data: Arc::new(bytes.to_vec()), crc32c, waiting, window });
        self.changed.notify_all();
    }

    /// Waits until every chunk offered in windows up to `window` (all: None) was taken, at most
    /// `timeout`. Ranks that had not taken theirs by then count as gone (their chunks are
    /// dropped); they are returned, for the caller's warning.
    pub fn drain(&self, window: Option<u64>, timeout: Duration) -> Vec<u32> {
        let until = Instant::now() + timeout;
        let mut t = self.table.lock();
        let pending = |t: &Table| t.entries.values().any(|e| window.is_none_or(|w| e.window <= w));
        while pending(&t) {
            if self.changed.wait_until(&mut t, until).timed_out() && pending(&t) {
                let late: HashSet<u32> =
                    t.entries.values().filter(|e| window.is_none_or(|w| e.window <= w)).flat_map(|e| e.waiting.clone()).collect();
                let late: Vec<u32> = late.into_iter().collect();
                for r in &late {
                    mark_gone(&mut t, *r);
                }
                self.changed.notify_all();
                return late;
            }
        }
        vec![]
    }

    /// Bytes held for other ranks right now.
    pub fn held(&self) -> u64 {
        self.table.lock().entries.values().map(|e| e.data.len() as u64).sum()
    }

    /// Fetches chunk `key` from the relay of `rank` at `addr` (on host `host`) into `dst`,
    /// verified against `crc32c` (the chunk's checksum in this rank's own manifest).
    pub fn fetch(&self, addr: &str, host: &str, key: &ChunkKey, crc32c: u32, dst: &mut [u8]) -> Result<()> {
        let pooled = self.pool.lock().get_mut(addr).and_then(|v| v.pop());
        let mut conn = match pooled.filter(|c| c.is_alive()) {
            Some(c) => c,
            // The server waits up to `wait` for the chunk: the client's progress deadline is longer.
            None => Conn::connect(addr, &self.secret, self.wait + Duration::from_secs(5), &self.me, host)?,
        };
        let req = RelayRequest::Chunk { key: key.clone(), len: dst.len() as u64 };
        conn.send(Kind::Request, &serde_json::to_vec(&req).expect("request serializes"))?;
        let res = conn.recv_data_into(dst);
        // A refusal (ERROR frame) or a frame read whole whose checksum failed leaves the
        // connection in step; a broken transfer does not.
        let reusable = res.is_ok() || matches!(&res, Err(e) if matches!(e.kind, ErrorKind::NotFound | ErrorKind::Integrity));
        if reusable {
            self.pool.lock().entry(addr.to_string()).or_default().push(conn);
        }
        let d = res.map_err(|e| e.context(format!("relay of rank at {addr}")))?;
        if d.crc32c != crc32c {
            return Err(Error::integrity(format!(
                "relay {addr}: chunk {} of item '{}' has checksum {:08x}, this rank's manifest says {crc32c:08x}",
                key.chunk, key.item, d.crc32c
            )));
        }
        Ok(())
    }

    /// Connects to `addr` ahead of the first fetch, so that its server knows this rank (and
    /// notices when it goes).
    pub fn warm(&self, addr: &str, host: &str) -> Result<()> {
        if self.pool.lock().get(addr).is_some_and(|v| !v.is_empty()) {
            return Ok(());
        }
        let c = Conn::connect(addr, &self.secret, self.wait + Duration::from_secs(5), &self.me, host)?;
        self.pool.lock().entry(addr.to_string()).or_default().push(c);
        Ok(())
    }

    // -- the serving half ------------------------------------------------------------------

    fn connection(&self, mut s: TcpStream) -> Result<()> {
        s.set_nodelay(true).ok();
        s.set_read_timeout(Some(Duration::from_secs(10))).ok();
        s.set_write_timeout(Some(self.wait)).ok();
        handshake(&mut s, &self.secret)?;
        let client = self.identify(&mut s)?;
        // Idle between requests for as long as a restore may take.
        s.set_read_timeout(Some(Duration::from_secs(3600))).ok();
        *self.table.lock().conns.entry(client.rank).or_default() += 1;
        let res = self.requests(&mut s, client.rank);
        // However it ended: once its last connection is gone, this rank takes nothing more
        // from here (a process that died closes all of them at once).
        let mut t = self.table.lock();
        let n = t.conns.entry(client.rank).or_default();
        *n = n.saturating_sub(1);
        if *n == 0 {
            mark_gone(&mut t, client.rank);
        }
        self.changed.notify_all();
        res
    }

    fn identify(&self, s: &mut TcpStream) -> Result<Ident> {
        let (h, body) = recv(s, MAX_PREAUTH)?;
        let req = if h.kind == Kind::Request { serde_json::from_slice::<Request>(&body).ok() } else { None };
        let Some(Request::Ident { me: client, to_host }) = req else {
            return Err(send_error(s, Error::invalid("the first request must be IDENT")));
        };
        if client.job != self.me.job || to_host != self.me.host {
            return Err(send_error(
                s,
                Error::unavailable(format!("relay of rank {}: not for job {} on host {to_host}", self.me.rank, client.job)),
            ));
        }
        send(s, Kind::Response, &serde_json::to_vec(&Reply { ident: Some(self.me.clone()), ..Default::default() }).expect("reply"))?;
        Ok(client)
    }

    fn requests(&self, s: &mut TcpStream, rank: u32) -> Result<()> {
        loop {
            let (h, body) = match recv(s, MAX_CONTROL) {
                Err(e) if e.kind == ErrorKind::NotFound => return Ok(()), // clean close
                r => r?,
            };
            let req = if h.kind == Kind::Request { serde_json::from_slice::<RelayRequest>(&body).ok() } else { None };
            let Some(RelayRequest::Chunk { key, len }) = req else {
                return Err(send_error(s, Error::invalid("relay: expected a chunk request")));
            };
            let Some((data, crc)) = self.wait_for(&key, rank) else {
                let e = Error::not_found(format!(
                    "relay of rank {}: chunk {} of item '{}' (step {}) was not here within {} s",
                    self.me.rank,
                    key.chunk,
                    key.item,
                    key.step,
                    self.wait.as_secs_f64()
                ));
                send_error(s, e);
                continue;
            };
            if data.len() as u64 != len {
                send_error(
                    s,
                    Error::integrity(format!("relay: item '{}' chunk {} has {} bytes, not {len}", key.item, key.chunk, data.len())),
                );
                continue;
            }
            crate::failpoint::hit("relay_send");
            self.link.send_restored(data.len() as u64);
            let head = encode_data_head(&DataHeader { object: 0, offset: 0, crc32c: crc }, data.len());
            s.write_all(&head).map_err(io)?;
            if crate::failpoint::fires("relay_corrupt") {
                let mut bad = data.to_vec();
                bad[0] ^= 1;
                s.write_all(&bad).map_err(io)?;
            } else {
                s.write_all(&data).map_err(io)?;
            }
            self.served.fetch_add(data.len() as u64, Ordering::Relaxed);
            self.taken(&key, rank);
        }
    }

    /// The chunk once offered, within the deadline; None when it is not (or `rank` is gone).
    fn wait_for(&self, key: &ChunkKey, rank: u32) -> Option<(Arc<Vec<u8>>, u32)> {
        let until = Instant::now() + self.wait;
        let mut t = self.table.lock();
        loop {
            if t.gone.contains(&rank) {
                return None;
            }
            if let Some(e) = t.entries.get(key) {
                return Some((e.data.clone(), e.crc32c));
            }
            if self.changed.wait_until(&mut t, until).timed_out() {
                return t.entries.get(key).map(|e| (e.data.clone(), e.crc32c));
            }
        }
    }

    fn taken(&self, key: &ChunkKey, rank: u32) {
        let mut t = self.table.lock();
        if let Some(e) = t.entries.get_mut(key) {
            e.waiting.retain(|r| *r != rank);
            if e.waiting.is_empty() {
                t.entries.remove(key);
            }
        }
        self.changed.notify_all();
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
    }
}

fn mark_gone(t: &mut Table, rank: u32) {
    t.gone.insert(rank);
    t.entries.retain(|_, e| {
        e.waiting.retain(|r| *r != rank);
        !e.waiting.is_empty()
    });
}

fn io(e: std::io::Error) -> Error {
    if matches!(e.kind(), std::io::ErrorKind::UnexpectedEof | std::io::ErrorKind::ConnectionReset) {
        return Error::not_found("connection closed");
    }
    Error::unavailable(format!("relay: {e}"))
}

fn send(s: &mut TcpStream, kind: Kind, payload: &[u8]) -> Result<()> {
    let mut frame = encode_header(kind, payload.len() as u64).to_vec();
    frame.extend_from_slice(payload);
    s.write_all(&frame).map_err(io)
}

/// Sends `e` as an ERROR frame (best effort) and returns it.
fn send_error(s: &mut TcpStream, e: Error) -> Error {
    let _ = send(s, Kind::Error, &serde_json::to_vec(&WireError::from_error(&e)).expect("error serializes"));
    e
}

fn recv(s: &mut TcpStream, max: u64) -> Result<(Header, Vec<u8>)> {
    let mut h = [0u8; HEADER_LEN];
    s.read_exact(&mut h).map_err(io)?;
    let h = decode_header(&h)?;
    if h.len > max || h.kind == Kind::Data {
        return Err(Error::unavailable(format!("relay: unexpected {:?} frame of {} bytes", h.kind, h.len)));
    }
    let mut body = vec![0u8; h.len as usize];
    s.read_exact(&mut body).map_err(io)?;
    Ok((h, body))
}

/// The server's side of HELLO, AUTH, AUTH_OK (see the module docs of `transport`).
fn handshake(s: &mut TcpStream, secret: &[u8]) -> Result<()> {
    let sn = nonce();
    send(s, Kind::Hello, &sn)?;
    let (h, body) = recv(s, Kind::Auth.max_len())?;
    if h.kind != Kind::Auth || body.len() != NONCE_LEN + MAC_LEN {
        return Err(Error::unavailable(format!("relay: expected AUTH, got {:?}", h.kind)));
    }
    let (cn, got) = body.split_at(NONCE_LEN);
    if !verify_mac(secret, b"client", &sn, cn, got) {
        return Err(send_error(s, Error::unavailable("authentication failed (wrong shared secret)")));
    }
    send(s, Kind::AuthOk, &mac(secret, b"server", cn, &sn))
}

#[cfg(test)]
mod tests {
    use super::*;

    const SECRET: &[u8] = b"relay-test-secret-0123456789";

    fn relay(rank: u32, wait_ms: u64) -> Arc<Relay> {
        let me = Ident { job: "job".into(), host: format!("h{rank}"), rank };
        Relay::start("127.0.0.1:0", me, SECRET.to_vec(), Duration::from_millis(wait_ms), Link::new("relay", None)).unwrap()
    }

    fn key(chunk: u32) -> ChunkKey {
        ChunkKey { step: 7, owner: 0, item: "model/w".into(), chunk }
    }

    #[test]
    fn a_chunk_offered_later_is_served_verified_and_then_let_go() {
        let (a, b) = (relay(0, 5000), relay(1, 5000));
        let addr = a.local_addr().to_string();
        let data = vec![7u8; 1000];
        let crc = crc32c::crc32c(&data);
        let a2 = a.clone();
        let d2 = data.clone();
        let t = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(100));
            a2.offer(key(0), &d2, crc, &[1], 0);
        });
        let mut dst = vec![0u8; 1000];
        b.fetch(&addr, "h0", &key(0), crc, &mut dst).unwrap();
        t.join().unwrap();
        assert_eq!(dst, data);
        assert!(a.drain(None, Duration::from_secs(5)).is_empty());
        assert_eq!(a.held(), 0);
        assert_eq!(a.served.load(Ordering::Relaxed), 1000);
        // A checksum other than this rank's manifest's: refused, not used.
        a.offer(key(1), &data, crc, &[1], 0);
        let e = b.fetch(&addr, "h0", &key(1), crc ^ 1, &mut dst).unwrap_err();
        assert_eq!(e.kind, ErrorKind::Integrity, "{e}");
    }

    #[test]
    fn nothing_waits_past_its_deadline() {
        let (a, b) = (relay(0, 300), relay(1, 300));
        let addr = a.local_addr().to_string();
        // Never offered: an error after the server's wait, not a hang.
        let t0 = Instant::now();
        let e = b.fetch(&addr, "h0", &key(3), 0, &mut [0u8; 8]).unwrap_err();
        assert_eq!(e.kind, ErrorKind::NotFound, "{e}");
        assert!(t0.elapsed() < Duration::from_secs(3));
        // Kept for a rank that never takes it: dropped at the deadline, and named.
        a.offer(key(4), &[1, 2, 3], 0, &[2], 0);
        assert_eq!(a.drain(Some(0), Duration::from_millis(200)), vec![2]);
        assert_eq!(a.held(), 0);
    }

    #[test]
    fn a_rank_whose_connections_end_is_dropped_at_once() {
        let (a, b) = (relay(0, 5000), relay(1, 5000));
        let addr = a.local_addr().to_string();
        b.warm(&addr, "h0").unwrap();
        std::thread::sleep(Duration::from_millis(100));
        b.stop(); // closes its pooled connections, as a dying process would
        std::thread::sleep(Duration::from_millis(300));
        // Nothing is kept for it: a sender never waits on a rank that is gone.
        a.offer(key(5), &[1, 2, 3], 0, &[1], 0);
        assert_eq!(a.held(), 0);
    }

    #[test]
    fn the_chunks_it_sends_keep_to_its_links_bandwidth() {
        let rate = 8_000_000u64;
        let me = Ident { job: "job".into(), host: "h0".into(), rank: 0 };
        let link = Link::new("peer", Some(rate));
        let a = Relay::start("127.0.0.1:0", me, SECRET.to_vec(), Duration::from_secs(5), link.clone()).unwrap();
        let b = relay(1, 5000);
        let addr = a.local_addr().to_string();
        let data = vec![3u8; 1 << 20];
        let crc = crc32c::crc32c(&data);
        let n = 8u32;
        for c in 0..n {
            a.offer(key(c), &data, crc, &[1], 0);
        }
        let mut dst = vec![0u8; 1 << 20];
        let t0 = Instant::now();
        for c in 0..n {
            b.fetch(&addr, "h0", &key(c), crc, &mut dst).unwrap();
        }
        let took = t0.elapsed().as_secs_f64();
        let want = f64::from(n) * data.len() as f64 / rate as f64;
        // The bucket starts empty and holds at most 50 ms of tokens.
        assert!(took > 0.9 * want && took < 1.1 * want + 0.1, "{took:.3} s for {want:.3} s at the limit");
        assert_eq!(link.bytes_sent(), u64::from(n) << 20);
    }

    #[test]
    fn another_jobs_client_is_refused() {
        let a = relay(0, 1000);
        let stranger = Ident { job: "other".into(), host: "h1".into(), rank: 1 };
        let e = Conn::connect(&a.local_addr().to_string(), SECRET, Duration::from_secs(2), &stranger, "h0");
        assert!(e.is_err());
    }
}
