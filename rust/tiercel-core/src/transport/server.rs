//! The serving half: one task per connection on the peer runtime. It authenticates the
//! client, then answers requests until the client goes away, through a `Handler` that owns
//! the stored replicas (the peer tier's replica store). A stranger, a wrong secret or a
//! malformed frame ends that connection with a logged reason; the server never stops for it.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use parking_lot::RwLock;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use super::frame::*;
use super::messages::{Reply, Request};
use crate::error::{Error, ErrorKind, Result};
use crate::format::Manifest;
use crate::tier::memory::{Segment, View};

/// What the server stores and serves: the replicas a host holds for other hosts.
pub trait Handler: Send + Sync + 'static {
    /// The tier's name, for logs.
    fn tier(&self) -> &str;
    /// Takes a replica described by `m` (its step and rank match the request and its chunk
    /// table is sound): checks its objects and allocates one writable segment per object.
    fn begin_put(&self, m: &mut Manifest) -> Result<Vec<Arc<Segment>>>;
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

const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
const IDLE_TIMEOUT: Duration = Duration::from_secs(600);
/// How long a connection waits for this process's secret, which may still be on its way
/// through the coordinator while a peer that got it earlier already knocks.
const SECRET_WAIT: Duration = Duration::from_secs(30);

/// Serves `handler` on `listener` until the runtime it runs on shuts down.
pub async fn serve(listener: TcpListener, handler: Arc<dyn Handler>, secret: Arc<RwLock<Option<Vec<u8>>>>) {
    loop {
        let (sock, addr) = match listener.accept().await {
            Ok(x) => x,
            Err(e) => {
                log::warn!("tier '{}': accept failed: {e}", handler.tier());
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        sock.set_nodelay(true).ok();
        let (handler, secret) = (handler.clone(), secret.clone());
        tokio::spawn(async move {
            if let Err(e) = connection(sock, &handler, &secret).await {
                log::warn!("tier '{}': connection from {addr} dropped: {e}", handler.tier());
            }
        });
    }
}

async fn connection(mut s: TcpStream, handler: &Arc<dyn Handler>, secret: &RwLock<Option<Vec<u8>>>) -> Result<()> {
    let step = Duration::from_millis(100);
    let mut waited = Duration::ZERO;
    let secret = loop {
        if let Some(k) = secret.read().clone() {
            break k;
        }
        if waited >= SECRET_WAIT {
            send_error(&mut s, &Error::unavailable("this peer has no shared secret yet")).await;
            return Err(Error::unavailable("refused: no shared secret yet"));
        }
        tokio::time::sleep(step).await;
        waited += step;
    };
    handshake(&mut s, &secret).await?;
    let mut views: HashMap<(u64, u32, String), Arc<View>> = HashMap::new();
    loop {
        let (h, body) = match tokio::time::timeout(IDLE_TIMEOUT, recv(&mut s)).await {
            Err(_) => return Ok(()),                                      // idle: the client reconnects when it needs to
            Ok(Err(e)) if e.kind == ErrorKind::NotFound => return Ok(()), // clean close
            Ok(r) => r?,
        };
        if h.kind != Kind::Request {
            return Err(Error::unavailable(format!("expected a request, got {:?}", h.kind)));
        }
        let req: Request = serde_json::from_slice(&body).map_err(|e| Error::unavailable(format!("malformed request: {e}")))?;
        match req {
            Request::Put { step, rank, manifest } => match put(&mut s, handler, step, rank, manifest).await {
                Ok(()) => reply(&mut s, Reply::default()).await?,
                Err(e) => {
                    // The client may still be streaming data frames: tell it why, then drop
                    // the connection rather than parse the rest as requests.
                    send_error(&mut s, &e).await;
                    return Err(e);
                }
            },
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
        }
    }
}

/// HELLO, AUTH, AUTH_OK (see the module docs of `transport`): both sides prove they know the
/// secret before anything else is read.
async fn handshake(s: &mut TcpStream, secret: &[u8]) -> Result<()> {
    let sn = nonce();
    send(s, Kind::Hello, &sn).await?;
    let (h, body) =
        tokio::time::timeout(HANDSHAKE_TIMEOUT, recv(s)).await.map_err(|_| Error::unavailable("no authentication within 10 s"))??;
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
        return Err(Error::invalid(format!("step {step} rank {rank} object {object}: range {offset}+{len} is outside it")));
    }
    Ok(view)
}

/// Receives one rank's step: segments come from the handler, every data frame lands straight
/// in its segment and must match its chunk's checksum; the handler publishes the replica
/// only after every chunk has arrived.
async fn put(s: &mut TcpStream, handler: &Arc<dyn Handler>, step: u64, rank: u32, m: Manifest) -> Result<()> {
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
        reply(s, Reply::default()).await?;
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
            s.read_exact(dst).await.map_err(io)?;
            if crc32c::crc32c(dst) != d.crc32c {
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

async fn recv(s: &mut TcpStream) -> Result<(Header, Vec<u8>)> {
    let h = recv_header(s).await?;
    let mut body = vec![0u8; control_len(&h)?];
    s.read_exact(&mut body).await.map_err(io)?;
    Ok((h, body))
}
