//! The serving half: one task per connection on the peer runtime. It authenticates the
//! client, learns who it is (IDENT), then answers requests until the client goes away,
//! through a `Handler` that owns the stored replicas (the peer tier's replica store). A
//! stranger, a wrong secret, a wrong job or host, or a malformed frame ends that connection
//! with a (rate-limited) logged reason; the server never stops for it.
//!
//! Unauthenticated connections are bounded in number (`Limits::max_unauthenticated`; more are
//! closed at once) and in time (`Limits::handshake`), and read no frame above `MAX_PREAUTH`,
//! so strangers cannot exhaust the process's memory or file descriptors.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::RwLock;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Semaphore;

use super::frame::*;
use super::messages::{Ident, Reply, Request};
use super::throttle::Throttle;
use crate::error::{Error, ErrorKind, Result};
use crate::format::Manifest;
use crate::shm::{Segment, View};

/// What the server stores and serves: the replicas a host holds for other hosts.
pub trait Handler: Send + Sync + 'static {
    /// The tier's name, for logs.
    fn tier(&self) -> &str;
    /// This server's identity, once its job's membership is known (None before).
    fn identity(&self) -> Option<Ident>;
    /// Admits an authenticated client that says it is `client` and meant to reach `to_host`:
    /// refuses another job, the wrong host, this host itself, or a rank placed elsewhere.
    fn admit(&self, client: &Ident, to_host: &str) -> Result<()>;
    /// Whether `client` may push a replica of `rank` here (only its own rank, and only to a
    /// host placement assigns to hold it).
    fn may_receive(&self, client: &Ident, rank: u32) -> Result<()>;
    /// Takes a replica described by `m` (its step and rank match the request and its chunk
    /// table is sound): checks its objects and allocates one writable segment per object.
    fn begin_put(&self, m: &mut Manifest) -> Result<Vec<Arc<Segment>>>;
    /// Fills the chunks of `m` (a put under way, into `segs`) that this host holds already,
    /// each checked against its CRC32C as it is copied; returns, by chunk in manifest order,
    /// which it filled. Runs off the async workers (it copies memory).
    fn reuse(&self, m: &Manifest, segs: &[Arc<Segment>]) -> Vec<bool>;
    /// Ends a put. `received` is Ok when every chunk arrived with a matching checksum: the
    /// replica is then published (and retention applied); otherwise it is discarded.
    fn end_put(&self, m: &Manifest, received: Result<()>) -> Result<()>;
    /// Runs after a put was acknowledged, off the connection's path, with the sizes of the
    /// segments it used (to pre-fault segments for the next replica of the same shape).
    fn after_put(&self, sizes: Vec<u64>);
    /// The steps of `rank` held here.
    fn list(&self, rank: u32) -> Result<Vec<u64>>;
    fn manifest(&self, step: u64, rank: u32) -> Result<Manifest>;
    /// A read view of one of `rank`'s objects of `step` (refused for objects not `rank`'s).
    fn view(&self, step: u64, rank: u32, object: &str) -> Result<Arc<View>>;
}

/// The server's bounds on its clients.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// An authenticated connection idle this long is closed (the client's pool notices and
    /// reconnects).
    pub idle: Duration,
    /// From HELLO to AUTH (and from AUTH_OK to IDENT): a client slower than this is dropped.
    pub handshake: Duration,
    /// Connections not yet authenticated at once; more are closed on accept.
    pub max_unauthenticated: usize,
}

impl Default for Limits {
    fn default() -> Limits {
        Limits { idle: Duration::from_secs(600), handshake: Duration::from_secs(10), max_unauthenticated: 64 }
    }
}

/// What the server has seen, for logs and for tests that wait on events instead of time.
#[derive(Debug, Default)]
pub struct Stats {
    /// Connections open now (authenticated or not).
    pub open: AtomicUsize,
    /// Connections open now that have not authenticated yet.
    pub unauthenticated: AtomicUsize,
    /// Connections closed on accept because too many were unauthenticated.
    pub refused: AtomicU64,
    /// Authenticated connections closed for idling.
    pub idle_closed: AtomicU64,
}

/// How long a connection waits for this process's secret and membership, which may still be
/// on their way through the coordinator while a peer that got them earlier already knocks.
const SECRET_WAIT: Duration = Duration::from_secs(30);

/// Decrements a counter when dropped (a connection's task ends however it ends).
struct Count<'a>(&'a AtomicUsize);
impl<'a> Count<'a> {
    fn new(c: &'a AtomicUsize) -> Count<'a> {
        c.fetch_add(1, Ordering::SeqCst);
        Count(c)
    }
}
impl Drop for Count<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Serves `handler` on `listener` until the runtime it runs on shuts down.
pub async fn serve(
    listener: TcpListener,
    handler: Arc<dyn Handler>,
    secret: Arc<RwLock<Option<Vec<u8>>>>,
    limits: Limits,
    stats: Arc<Stats>,
) {
    let unauth = Arc::new(Semaphore::new(limits.max_unauthenticated));
    let warn = Arc::new(Throttle::new(Duration::from_secs(5)));
    loop {
        let (sock, addr) = match listener.accept().await {
            Ok(x) => x,
            Err(e) => {
                warn.warn(|| format!("tier '{}': accept failed: {e}", handler.tier()));
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let Ok(permit) = unauth.clone().try_acquire_owned() else {
            drop(sock);
            stats.refused.fetch_add(1, Ordering::SeqCst);
            warn.warn(|| {
                format!(
                    "tier '{}': {} connections have not authenticated yet; closed one more from {addr}",
                    handler.tier(),
                    limits.max_unauthenticated
                )
            });
            continue;
        };
        sock.set_nodelay(true).ok();
        let (handler, secret, stats, warn) = (handler.clone(), secret.clone(), stats.clone(), warn.clone());
        tokio::spawn(async move {
            let _open = Count::new(&stats.open);
            if let Err(e) = connection(sock, &handler, &secret, limits, &stats, permit).await {
                warn.warn(|| format!("tier '{}': connection from {addr} dropped: {e}", handler.tier()));
            }
        });
    }
}

async fn connection(
    mut s: TcpStream,
    handler: &Arc<dyn Handler>,
    secret: &RwLock<Option<Vec<u8>>>,
    limits: Limits,
    stats: &Stats,
    permit: tokio::sync::OwnedSemaphorePermit,
) -> Result<()> {
    let pending = Count::new(&stats.unauthenticated);
    let secret = match wait_for(|| secret.read().clone()).await {
        Some(k) => k,
        None => {
            send_error(&mut s, &Error::unavailable("this peer has no shared secret yet")).await;
            return Err(Error::unavailable("refused: no shared secret yet"));
        }
    };
    handshake(&mut s, &secret, limits.handshake).await?;
    drop(pending);
    drop(permit);
    let client = identify(&mut s, &**handler, limits.handshake).await?;
    let mut views: HashMap<(u64, u32, String), Arc<View>> = HashMap::new();
    loop {
        let (h, body) = match tokio::time::timeout(limits.idle, recv(&mut s, MAX_CONTROL)).await {
            Err(_) => {
                stats.idle_closed.fetch_add(1, Ordering::SeqCst);
                return Ok(()); // idle: the client's pool notices and reconnects
            }
            Ok(Err(e)) if e.kind == ErrorKind::NotFound => return Ok(()), // clean close
            Ok(r) => r?,
        };
        if h.kind != Kind::Request {
            return Err(Error::unavailable(format!("expected a request, got {:?}", h.kind)));
        }
        let req: Request = serde_json::from_slice(&body).map_err(|e| Error::unavailable(format!("malformed request: {e}")))?;
        match req {
            Request::Put { step, rank, manifest, reuse } => {
                if let Err(e) = handler.may_receive(&client, rank) {
                    send_error(&mut s, &e).await;
                    return Err(e);
                }
                match put(&mut s, handler, step, rank, manifest, reuse).await {
                    Ok(()) => reply(&mut s, Reply::default()).await?,
                    Err(e) => {
                        // The client may still be streaming data frames: tell it why, then
                        // drop the connection rather than parse the rest as requests.
                        send_error(&mut s, &e).await;
                        return Err(e);
                    }
                }
            }
            // Errors about what was asked go back to the client; the connection stays.
            Request::Read { step, rank, object, offset, len, crc32c } => {
                match read(&**handler, &mut views, step, rank, &object, offset, len) {
                    Ok(view) => {
                        let head = encode_data_head(&DataHeader { object: 0, offset, crc32c }, len as usize);
                        s.write_all(&head).await.map_err(io)?;
                        s.write_all(&view[offset as usize..(offset + len) as usize]).await.map_err(io)?;
                    }
                    Err(e) => send_error(&mut s, &e).await,
                }
            }
            Request::List { rank } => match handler.list(rank) {
                Ok(steps) => reply(&mut s, Reply { steps: Some(steps), ..Default::default() }).await?,
                Err(e) => send_error(&mut s, &e).await,
            },
            Request::Manifest { step, rank } => match handler.manifest(step, rank) {
                Ok(m) => reply(&mut s, Reply { manifest: Some(m), ..Default::default() }).await?,
                Err(e) => send_error(&mut s, &e).await,
            },
            Request::Ident { .. } => {
                let e = Error::invalid("IDENT sent twice");
                send_error(&mut s, &e).await;
                return Err(e);
            }
        }
    }
}

/// Polls `get` until it yields a value or `SECRET_WAIT` has passed.
async fn wait_for<T>(get: impl Fn() -> Option<T>) -> Option<T> {
    let step = Duration::from_millis(50);
    let mut waited = Duration::ZERO;
    loop {
        if let Some(v) = get() {
            return Some(v);
        }
        if waited >= SECRET_WAIT {
            return None;
        }
        tokio::time::sleep(step).await;
        waited += step;
    }
}

/// The first request of an authenticated connection: who the client is and whom it meant to
/// reach. Answered with this server's identity, or refused (and the connection closed).
async fn identify(s: &mut TcpStream, handler: &dyn Handler, within: Duration) -> Result<Ident> {
    let Some(me) = wait_for(|| handler.identity()).await else {
        let e = Error::unavailable("this peer does not know its job's members yet");
        send_error(s, &e).await;
        return Err(e);
    };
    let (h, body) = tokio::time::timeout(within, recv(s, MAX_PREAUTH))
        .await
        .map_err(|_| Error::unavailable(format!("no IDENT within {} s", within.as_secs_f64())))??;
    let req = if h.kind == Kind::Request { serde_json::from_slice::<Request>(&body).ok() } else { None };
    let Some(Request::Ident { me: client, to_host }) = req else {
        let e = Error::invalid("the first request must be IDENT (an older tiercel on the other side?)");
        send_error(s, &e).await;
        return Err(e);
    };
    if let Err(e) = handler.admit(&client, &to_host) {
        send_error(s, &e).await;
        return Err(e.context(format!("refused rank {} of host {} (job {})", client.rank, client.host, client.job)));
    }
    reply(s, Reply { ident: Some(me), ..Default::default() }).await?;
    Ok(client)
}

/// HELLO, AUTH, AUTH_OK (see the module docs of `transport`): both sides prove they know the
/// secret before anything else is read.
/// Only the AUTH frame's size is ever read before authentication.
async fn handshake(s: &mut TcpStream, secret: &[u8], within: Duration) -> Result<()> {
    let sn = nonce();
    send(s, Kind::Hello, &sn).await?;
    let auth_len = Kind::Auth.max_len();
    let (h, body) = tokio::time::timeout(within, recv(s, auth_len))
        .await
        .map_err(|_| Error::unavailable(format!("no authentication within {} s", within.as_secs_f64())))??;
    if h.kind != Kind::Auth || body.len() != NONCE_LEN + MAC_LEN {
        return Err(Error::unavailable(format!("expected AUTH, got {:?}", h.kind)));
    }
    let (cn, got) = body.split_at(NONCE_LEN);
    if !verify_mac(secret, b"client", &sn, cn, got) {
        send_error(s, &Error::unavailable("authentication failed (wrong shared secret)")).await;
        return Err(Error::unavailable("authentication failed (wrong shared secret)"));
    }
    send(s, Kind::AuthOk, &mac(secret, b"server", cn, &sn)).await
}

/// The view of a READ's object, with the range checked against it. Views stay cached for
/// the connection: a restore reads one chunk after another of the same objects.
fn read(
    handler: &dyn Handler,
    views: &mut HashMap<(u64, u32, String), Arc<View>>,
    step: u64,
    rank: u32,
    object: &str,
    offset: u64,
    len: u64,
) -> Result<Arc<View>> {
    let key = (step, rank, object.to_string());
    let view = match views.get(&key) {
        Some(v) => v.clone(),
        None => {
            let v = handler.view(step, rank, object)?;
            views.insert(key, v.clone());
            v
        }
    };
    if offset.checked_add(len).is_none_or(|end| end > view.len() as u64) {
        // The replica's manifest says the bytes are there: a short object is damage.
        return Err(Error::integrity(format!(
            "step {step} rank {rank} object {object} is shorter than its manifest says (needs bytes {offset}..{}, has {})",
            offset as u128 + len as u128,
            view.len()
        ))
        .at(step, rank));
    }
    Ok(view)
}

/// Receives one rank's step: segments come from the handler, which fills (with `reuse`) the
/// chunks it holds already; the reply names the others, and every data frame lands straight
/// in its segment and must match its chunk's checksum; the handler publishes the replica
/// only after every chunk has arrived or was filled.
async fn put(s: &mut TcpStream, handler: &Arc<dyn Handler>, step: u64, rank: u32, m: Manifest, reuse: bool) -> Result<()> {
    if m.step != step || m.rank != rank {
        return Err(Error::invalid("manifest does not match the put request"));
    }
    // From a peer: checked like a manifest read from a tier before anything is allocated.
    let mut m = Manifest::from_json(&m.to_json(), &format!("replica of step {step} rank {rank}"))?;
    let segs = handler.begin_put(&mut m)?;
    // chunk lookup: (object, stored offset) -> (len, crc, received)
    let mut expect: HashMap<(u32, u64), (u64, u32, bool)> = HashMap::new();
    for it in &m.items {
        for c in &it.chunks {
            expect.insert((c.object, c.stored_offset), (c.len, c.crc32c, false));
        }
    }
    let received: Result<()> = async {
        let lacking = if reuse {
            let (h, held, segs) = (handler.clone(), m.clone(), segs.clone());
            let filled = tokio::task::spawn_blocking(move || h.reuse(&held, &segs))
                .await
                .map_err(|e| Error::unavailable(format!("filling held chunks failed: {e}")))?;
            let chunks = m.items.iter().flat_map(|it| &it.chunks);
            let mut lacking = vec![];
            for (i, c) in chunks.enumerate() {
                if filled.get(i).copied().unwrap_or(false) {
                    // Counted as arrived; a data frame for it anyway (an older sender)
                    // lands over it, checked like any other.
                    expect.get_mut(&(c.object, c.stored_offset)).expect("every chunk is expected").2 = true;
                } else {
                    lacking.push(i as u64);
                }
            }
            Some(lacking)
        } else {
            None
        };
        reply(s, Reply { lacking, ..Default::default() }).await?;
        loop {
            let h = recv_header(s).await?;
            match h.kind {
                Kind::End => break,
                Kind::Data => {}
                k => return Err(Error::unavailable(format!("expected data, got {k:?}"))),
            }
            let mut sub = [0u8; DATA_SUBHEADER_LEN];
            s.read_exact(&mut sub).await.map_err(io)?;
            let d = decode_data_header(&sub);
            let len = h.len - DATA_SUBHEADER_LEN as u64;
            let slot = expect.get_mut(&(d.object, d.offset)).filter(|(l, crc, _)| *l == len && *crc == d.crc32c).ok_or_else(|| {
                Error::integrity(format!("data frame (object {}, offset {}, {len} bytes) matches no chunk", d.object, d.offset))
            })?;
            let seg = &segs[d.object as usize];
            // Safety: the chunk lies inside the segment (manifest checked by from_json, the
            // segment allocated by its object's length), and this connection is the only
            // writer of this fresh segment.
            let dst = unsafe { std::slice::from_raw_parts_mut(seg.ptr().add(d.offset as usize), len as usize) };
            // Each block is checksummed right after it landed, while it is in cache: the
            // chunk is verified without a second pass over it.
            let mut crc = crate::checksum::Crc32c::new();
            for block in dst.chunks_mut(crate::checksum::BLOCK) {
                s.read_exact(block).await.map_err(io)?;
                crc.update(block);
            }
            if crc.finish() != d.crc32c {
                return Err(Error::integrity(format!("chunk at object {} offset {} arrived corrupted", d.object, d.offset)));
            }
            slot.2 = true;
        }
        if let Some(((o, off), _)) = expect.iter().find(|(_, v)| !v.2) {
            return Err(Error::integrity(format!("chunk at object {o} offset {off} never arrived")));
        }
        Ok(())
    }
    .await;
    let sizes: Vec<u64> = segs.iter().map(|s| s.len() as u64).collect();
    drop(segs);
    // On an error nothing more is drained: the connection is dropped, the partial replica too.
    handler.end_put(&m, received).map_err(|e| e.context(format!("receiving step {step} of rank {rank}")).at(step, rank))?;
    // Off the connection's path: allocating fresh shared memory runs at ~1 GB/s, writing
    // into touched pages at 10+.
    let handler = handler.clone();
    tokio::task::spawn_blocking(move || handler.after_put(sizes));
    Ok(())
}

fn io(e: std::io::Error) -> Error {
    if e.kind() == std::io::ErrorKind::UnexpectedEof {
        Error::not_found("connection closed")
    } else {
        Error::unavailable(e.to_string())
    }
}

async fn send(s: &mut TcpStream, kind: Kind, payload: &[u8]) -> Result<()> {
    s.write_all(&encode_header(kind, payload.len() as u64)).await.map_err(io)?;
    s.write_all(payload).await.map_err(io)
}

async fn reply(s: &mut TcpStream, r: Reply) -> Result<()> {
    send(s, Kind::Response, &serde_json::to_vec(&r).expect("reply serializes")).await
}

async fn send_error(s: &mut TcpStream, e: &Error) {
    let _ = send(s, Kind::Error, &serde_json::to_vec(&WireError::from_error(e)).expect("error serializes")).await;
}

async fn recv_header(s: &mut TcpStream) -> Result<Header> {
    let mut h = [0u8; HEADER_LEN];
    s.read_exact(&mut h).await.map_err(io)?;
    decode_header(&h)
}

/// One control frame of at most `max` bytes; the limit is checked on the header, before
/// anything is allocated or read.
async fn recv(s: &mut TcpStream, max: u64) -> Result<(Header, Vec<u8>)> {
    let h = recv_header(s).await?;
    if h.len > max {
        return Err(Error::unavailable(format!("{:?} frame of {} bytes where at most {max} are accepted", h.kind, h.len)));
    }
    let mut body = vec![0u8; control_len(&h)?];
    s.read_exact(&mut body).await.map_err(io)?;
    Ok((h, body))
}
