//! The client half: a blocking, authenticated connection (`Conn`) and the requests a peer
//! tier makes over it: push a replica, list, fetch a manifest, read a chunk.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::frame::*;
use super::messages::{Ident, Reply, Request};
use crate::error::{Error, Result};
use crate::format::{ChunkSource, Manifest};
use crate::scheduler::Link;

/// A blocking, authenticated client connection (the client side runs on the scheduler's
/// and the copy pool's threads, which block anyway).
pub struct Conn {
    stream: TcpStream,
    pub peer: String,
    /// The progress deadline: a read or write that moves no byte for this long fails.
    timeout: Duration,
    /// The send buffer is capped (`SEND_BUFFER`): set on the first push over a paced link.
    capped: bool,
}

/// The send buffer of a connection that pushes replicas over a paced link (`Link::paced`).
/// A replica's chunks pass their link's gate one by one, and the gate (pauses for the
/// training job's collectives, the learned spans) and the link's cost model both take a chunk
/// to be on the wire once `write` returns. The kernel's autotuned buffer (up to `tcp_wmem`'s
/// 4 MiB) would let that much more leave later, into the training job's next all-reduce, and
/// make the link look faster than it is (the writes into an empty buffer return at memcpy
/// speed). Linux doubles the value for its bookkeeping: a few hundred KiB of data stay
/// queued, which still fills a link of 10 Gbit/s at 0.2 ms RTT. Without pacing
/// (`[traffic] mode = "off"`) nothing needs the cap, and the kernel's autotuning keeps a link
/// with a larger bandwidth-delay product full (a fixed buffer caps a stream at buffer / RTT).
pub const SEND_BUFFER: libc::c_int = 256 << 10;

/// The slowest rate, in bytes per second, at which a holder is expected to copy and checksum
/// the chunks it holds of an earlier step before answering a push (one thread of a busy host
/// does several GB/s): how much longer than the progress deadline a push waits for that answer.
const SLOWEST_REUSE: f64 = 500e6;

fn set_send_buffer(stream: &TcpStream, bytes: libc::c_int) {
    use std::os::fd::AsRawFd;
    // SAFETY: setsockopt on an open socket with a pointer to a c_int and its size.
    let r = unsafe {
        libc::setsockopt(
            stream.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_SNDBUF,
            (&bytes as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    if r != 0 {
        log::debug!("SO_SNDBUF {bytes}: {}", std::io::Error::last_os_error());
    }
}

fn io_err(peer: &str, what: &str, e: std::io::Error) -> Error {
    Error::unavailable(format!("peer {peer}: {what}: {e}"))
}

/// A TCP connect within `timeout`. "No route to host" is retried until then: right after a
/// link comes back the kernel still answers from its failed neighbour entry for a moment,
/// and a step that waits that moment out replicates instead of failing. A refused
/// connection (no process on the port) fails at once, so the next holder is tried.
fn connect_tcp(sock: &SocketAddr, timeout: Duration) -> std::io::Result<TcpStream> {
    let t0 = std::time::Instant::now();
    loop {
        let left = timeout.saturating_sub(t0.elapsed());
        match TcpStream::connect_timeout(sock, left.max(Duration::from_millis(1))) {
            Err(e) if matches!(e.kind(), std::io::ErrorKind::HostUnreachable | std::io::ErrorKind::NetworkUnreachable) => {
                if t0.elapsed() + Duration::from_millis(100) >= timeout {
                    return Err(e);
                }
                std::thread::sleep(Duration::from_millis(100));
            }
            r => return r,
        }
    }
}

impl Conn {
    /// Connects to `addr`, authenticates, and exchanges identities: `me` is this process,
    /// `to_host` the host placement assigned to `addr`. Refused (an error) when the server
    /// turns out to be another job's, another host's, or this host's own.
    pub fn connect(addr: &str, secret: &[u8], timeout: Duration, me: &Ident, to_host: &str) -> Result<Conn> {
        let mut c = Conn::connect_unidentified(addr, secret, timeout)?;
        c.identify(me, to_host)?;
        Ok(c)
    }

    /// Connects and authenticates only (tests speak the protocol from there by hand).
    pub fn connect_unidentified(addr: &str, secret: &[u8], timeout: Duration) -> Result<Conn> {
        let sock: SocketAddr = addr
            .to_socket_addrs()
            .map_err(|e| io_err(addr, "cannot resolve", e))?
            .next()
            .ok_or_else(|| Error::unavailable(format!("peer {addr}: resolves to no address")))?;
        let stream = connect_tcp(&sock, timeout).map_err(|e| io_err(addr, "cannot connect", e))?;
        stream.set_nodelay(true).ok();
        stream.set_read_timeout(Some(timeout)).ok();
        stream.set_write_timeout(Some(timeout)).ok();
        let mut c = Conn { stream, peer: addr.to_string(), timeout, capped: false };
        c.handshake(secret)?;
        Ok(c)
    }

    fn identify(&mut self, me: &Ident, to_host: &str) -> Result<()> {
        let r: Reply = self.request(&Request::Ident { me: me.clone(), to_host: to_host.to_string() })?;
        let them = r.ident.ok_or_else(|| Error::unavailable(format!("peer {}: no identity in the IDENT reply", self.peer)))?;
        if them.job != me.job {
            return Err(Error::unavailable(format!(
                "peer {}: that server belongs to another job ({}), not this one ({}): a stale address or a port reused",
                self.peer, them.job, me.job
            )));
        }
        if them.host == me.host && to_host != me.host {
            return Err(Error::unavailable(format!(
                "peer {}: that address reaches this host ({}) itself, not host {to_host}: a replica there would not \
                 survive this host; advertise an address other hosts can reach (TIERCEL_ADVERTISE, or a `listen` \
                 address that is not loopback)",
                self.peer, me.host
            )));
        }
        if them.host != to_host {
            return Err(Error::unavailable(format!(
                "peer {}: that address reaches host {}, not host {to_host} that placement assigned",
                self.peer, them.host
            )));
        }
        Ok(())
    }

    /// Whether a pooled connection is still usable: not closed by the server (an idle
    /// timeout, a restart) and with nothing unread on it. Never blocks.
    pub fn is_alive(&self) -> bool {
        let mut b = [0u8; 1];
        if self.stream.set_nonblocking(true).is_err() {
            return false;
        }
        let alive = matches!(self.stream.peek(&mut b), Err(e) if e.kind() == std::io::ErrorKind::WouldBlock);
        alive && self.stream.set_nonblocking(false).is_ok()
    }

    /// An I/O error as a tiercel error; a timeout says that the transfer stalled.
    fn err(&self, what: &str, e: std::io::Error) -> Error {
        if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) {
            return Error::unavailable(format!(
                "peer {}: {what}: no progress for {} s (link down or holder stalled); transfer aborted",
                self.peer,
                self.timeout.as_secs_f64()
            ));
        }
        io_err(&self.peer, what, e)
    }

    /// Before authentication nothing longer than `MAX_PREAUTH` is read from the server.
    fn handshake(&mut self, secret: &[u8]) -> Result<()> {
        let (h, server_nonce) = self.recv_max(MAX_PREAUTH)?;
        if h.kind != Kind::Hello || server_nonce.len() != NONCE_LEN {
            return Err(Error::unavailable(format!("peer {}: expected HELLO, got {:?}", self.peer, h.kind)));
        }
        let cn = nonce();
        let mut auth = cn.to_vec();
        auth.extend_from_slice(&mac(secret, b"client", &server_nonce, &cn));
        self.send(Kind::Auth, &auth)?;
        let (h, body) = self.recv_max(MAX_PREAUTH)?;
        match h.kind {
            Kind::AuthOk if verify_mac(secret, b"server", &cn, &server_nonce, &body) => Ok(()),
            Kind::AuthOk => Err(Error::unavailable(format!(
                "peer {}: the server does not know the shared secret (is it another job's port?)",
                self.peer
            ))),
            Kind::Error => Err(self.wire_error(&body)),
            k => Err(Error::unavailable(format!("peer {}: expected AUTH_OK, got {k:?}", self.peer))),
        }
    }

    fn wire_error(&self, body: &[u8]) -> Error {
        match serde_json::from_slice::<WireError>(body) {
            Ok(w) => w.into_error(&self.peer),
            Err(_) => Error::unavailable(format!("peer {}: unreadable error frame", self.peer)),
        }
    }

    pub fn send(&mut self, kind: Kind, payload: &[u8]) -> Result<()> {
        let mut frame = encode_header(kind, payload.len() as u64).to_vec();
        frame.extend_from_slice(payload);
        let r = self.stream.write_all(&frame);
        r.map_err(|e| self.err("send", e))
    }

    /// Sends one data frame straight from `bytes` (a slice of a shared-memory segment).
    pub fn send_data(&mut self, d: &DataHeader, bytes: &[u8]) -> Result<()> {
        let head = encode_data_head(d, bytes.len());
        let r = self.stream.write_all(&head).and_then(|()| self.stream.write_all(bytes));
        r.map_err(|e| self.err("send", e))
    }

    fn recv_header(&mut self) -> Result<Header> {
        let mut h = [0u8; HEADER_LEN];
        let r = self.stream.read_exact(&mut h);
        r.map_err(|e| self.err("receive", e))?;
        decode_header(&h).map_err(|e| e.context(format!("peer {}", self.peer)))
    }

    pub fn recv(&mut self) -> Result<(Header, Vec<u8>)> {
        self.recv_max(MAX_CONTROL)
    }

    /// One control frame of at most `max` bytes (checked before anything is allocated).
    fn recv_max(&mut self, max: u64) -> Result<(Header, Vec<u8>)> {
        let h = self.recv_header()?;
        if h.len > max {
            return Err(Error::unavailable(format!(
                "peer {}: {:?} frame of {} bytes where at most {max} are accepted",
                self.peer, h.kind, h.len
            )));
        }
        let len = control_len(&h).map_err(|e| e.context(format!("peer {}", self.peer)))?;
        let mut body = vec![0u8; len];
        let r = self.stream.read_exact(&mut body);
        r.map_err(|e| self.err("receive", e))?;
        Ok((h, body))
    }

    /// Sends a JSON request and returns the JSON response (an ERROR frame becomes an Error).
    pub fn request<T: Serialize, R: for<'de> Deserialize<'de>>(&mut self, req: &T) -> Result<R> {
        self.send(Kind::Request, &serde_json::to_vec(req).unwrap())?;
        self.response()
    }

    pub fn response<R: for<'de> Deserialize<'de>>(&mut self) -> Result<R> {
        let (h, body) = self.recv()?;
        match h.kind {
            Kind::Response => {
                serde_json::from_slice(&body).map_err(|e| Error::unavailable(format!("peer {}: malformed response: {e}", self.peer)))
            }
            Kind::Error => Err(self.wire_error(&body)),
            k => Err(Error::unavailable(format!("peer {}: expected a response, got {k:?}", self.peer))),
        }
    }

    /// Receives one data frame straight into `dst`, which must be exactly its length, and
    /// checks it against the frame's checksum: each block is checksummed right after it
    /// landed in `dst` (`checksum::BLOCK`, still in cache), so verifying costs no second
    /// pass over memory. What is checked is `dst` itself.
    pub fn recv_data_into(&mut self, dst: &mut [u8]) -> Result<DataHeader> {
        let h = self.recv_header()?;
        if h.kind == Kind::Error {
            let mut body = vec![0u8; h.len as usize];
            let r = self.stream.read_exact(&mut body);
            r.map_err(|e| self.err("receive", e))?;
            return Err(self.wire_error(&body));
        }
        if h.kind != Kind::Data || h.len != (DATA_SUBHEADER_LEN + dst.len()) as u64 {
            return Err(Error::unavailable(format!(
                "peer {}: expected a data frame of {} bytes, got {:?} of {}",
                self.peer,
                dst.len(),
                h.kind,
                h.len
            )));
        }
        let mut sub = [0u8; DATA_SUBHEADER_LEN];
        let r = self.stream.read_exact(&mut sub);
        r.map_err(|e| self.err("receive", e))?;
        let d = decode_data_header(&sub);
        let mut crc = crate::checksum::Crc32c::new();
        for block in dst.chunks_mut(crate::checksum::BLOCK) {
            let r = self.stream.read_exact(block);
            r.map_err(|e| self.err("receive", e))?;
            crc.update(block);
        }
        let crc = crc.finish();
        if crc != d.crc32c {
            return Err(Error::integrity(format!("peer {}: data frame checksum mismatch ({crc:08x} != {:08x})", self.peer, d.crc32c)));
        }
        Ok(d)
    }
}

impl Conn {
    /// The socket's send buffer as the kernel reports it (for tests of `SEND_BUFFER`).
    pub fn send_buffer(&self) -> libc::c_int {
        use std::os::fd::AsRawFd;
        let mut v: libc::c_int = 0;
        let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
        // SAFETY: getsockopt on an open socket into a c_int of the given size.
        let r = unsafe {
            libc::getsockopt(self.stream.as_raw_fd(), libc::SOL_SOCKET, libc::SO_SNDBUF, (&mut v as *mut libc::c_int).cast(), &mut len)
        };
        if r == 0 {
            v
        } else {
            -1
        }
    }
}

/// The requests of the peer protocol, one method each.
impl Conn {
    /// Pushes one rank's step: the manifest (with each chunk's hash), then, as a data frame
    /// each, the chunks the holder says it lacks (straight from the source's memory when it
    /// has the bytes in place), then END; returns, once the holder has acknowledged the
    /// complete, verified copy, the bytes of the chunks sent. Only chunks that go pass the
    /// link's gate: the traffic schedule counts the bytes that move, not the step's size.
    pub fn put_replica(&mut self, m: &Manifest, src: &dyn ChunkSource, link: &Link) -> Result<u64> {
        if link.paced() && !self.capped {
            set_send_buffer(&self.stream, SEND_BUFFER);
            self.capped = true;
        }
        // The holder copies the chunks it holds before it answers: the progress deadline is
        // stretched by what that takes at a slow copy's rate, for this answer only.
        let copying = Duration::from_secs_f64(m.total_bytes() as f64 / SLOWEST_REUSE);
        self.stream.set_read_timeout(Some(self.timeout + copying)).ok();
        let r = self.request(&Request::Put { step: m.step, rank: m.rank, manifest: m.clone(), reuse: true });
        self.stream.set_read_timeout(Some(self.timeout)).ok();
        let r: Reply = r?;
        let total: usize = m.items.iter().map(|it| it.chunks.len()).sum();
        let mut send = vec![r.lacking.is_none(); total];
        for i in r.lacking.unwrap_or_default() {
            let slot = send.get_mut(i as usize).ok_or_else(|| {
                Error::unavailable(format!("peer {}: asked for chunk {i} of step {} rank {}, which has {total}", self.peer, m.step, m.rank))
            })?;
            *slot = true;
        }
        let (mut buf, mut sent) = (vec![], 0u64);
        let mut wanted = send.into_iter();
        for (i, it) in m.items.iter().enumerate() {
            for (k, ch) in it.chunks.iter().enumerate() {
                if wanted.next() != Some(true) {
                    continue;
                }
                crate::failpoint::hit("replicate");
                link.acquire(ch.len);
                let d = DataHeader { object: ch.object, offset: ch.stored_offset, crc32c: ch.crc32c };
                match src.raw_slice(i, k) {
                    Some(s) => self.send_data(&d, s)?,
                    None => {
                        buf.resize(ch.len as usize, 0);
                        src.read_raw(i, k, &mut buf)?;
                        self.send_data(&d, &buf)?;
                    }
                }
                sent += ch.len;
            }
        }
        self.send(Kind::End, &[])?;
        let _: Reply = self.response()?;
        Ok(sent)
    }

    /// The steps of `rank` this holder has a complete replica of.
    pub fn list(&mut self, rank: u32) -> Result<Vec<u64>> {
        let r: Reply = self.request(&Request::List { rank })?;
        Ok(r.steps.unwrap_or_default())
    }

    /// The manifest of `rank`'s replica of `step`, if this holder has one.
    pub fn manifest(&mut self, step: u64, rank: u32) -> Result<Option<Manifest>> {
        let r: Reply = self.request(&Request::Manifest { step, rank })?;
        Ok(r.manifest)
    }

    /// Reads `dst.len()` stored bytes at `offset` of an object of `rank`'s replica of `step`,
    /// verified against `crc32c` (the chunk's checksum in the caller's manifest) as they land.
    pub fn read(&mut self, step: u64, rank: u32, object: &str, offset: u64, crc32c: u32, dst: &mut [u8]) -> Result<()> {
        let req = Request::Read { step, rank, object: object.to_string(), offset, len: dst.len() as u64, crc32c };
        self.send(Kind::Request, &serde_json::to_vec(&req).expect("request serializes"))?;
        let d = self.recv_data_into(dst)?;
        // The holder echoes the checksum it was asked for; one it did not send back is no
        // answer to this request.
        if d.crc32c != crc32c {
            return Err(Error::integrity(format!(
                "peer {}: data frame carries checksum {:08x}, the manifest says {crc32c:08x}",
                self.peer, d.crc32c
            )));
        }
        Ok(())
    }
}
