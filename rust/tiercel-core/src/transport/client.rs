//! The client half: a blocking, authenticated connection (`Conn`) and the requests a peer
//! tier makes over it: push a replica, list, fetch a manifest, read a chunk.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::frame::*;
use super::messages::{Reply, Request};
use crate::error::{Error, Result};
use crate::format::Manifest;
use crate::scheduler::Link;
use crate::tier::ChunkSource;

/// A blocking, authenticated client connection (the client side runs on the scheduler's
/// and the copy pool's threads, which block anyway).
pub struct Conn {
    stream: TcpStream,
    pub peer: String,
}

fn io_err(peer: &str, what: &str, e: std::io::Error) -> Error {
    Error::unavailable(format!("peer {peer}: {what}: {e}"))
}

impl Conn {
    pub fn connect(addr: &str, secret: &[u8], timeout: Duration) -> Result<Conn> {
        let sock: SocketAddr = addr
            .to_socket_addrs()
            .map_err(|e| io_err(addr, "cannot resolve", e))?
            .next()
            .ok_or_else(|| Error::unavailable(format!("peer {addr}: resolves to no address")))?;
        let stream = TcpStream::connect_timeout(&sock, timeout).map_err(|e| io_err(addr, "cannot connect", e))?;
        stream.set_nodelay(true).ok();
        stream.set_read_timeout(Some(timeout)).ok();
        stream.set_write_timeout(Some(timeout)).ok();
        let mut c = Conn { stream, peer: addr.to_string() };
        c.handshake(secret)?;
        Ok(c)
    }

    fn handshake(&mut self, secret: &[u8]) -> Result<()> {
        let (h, server_nonce) = self.recv()?;
        if h.kind != Kind::Hello || server_nonce.len() != NONCE_LEN {
            return Err(Error::unavailable(format!("peer {}: expected HELLO, got {:?}", self.peer, h.kind)));
        }
        let cn = nonce();
        let mut auth = cn.to_vec();
        auth.extend_from_slice(&mac(secret, b"client", &server_nonce, &cn));
        self.send(Kind::Auth, &auth)?;
        let (h, body) = self.recv()?;
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
        let peer = self.peer.clone();
        self.stream.write_all(&encode_header(kind, payload.len() as u64)).map_err(|e| io_err(&peer, "send", e))?;
        self.stream.write_all(payload).map_err(|e| io_err(&peer, "send", e))
    }

    /// Sends one data frame straight from `bytes` (a slice of a shared-memory segment).
    pub fn send_data(&mut self, d: &DataHeader, bytes: &[u8]) -> Result<()> {
        let peer = self.peer.clone();
        let head = encode_data_head(d, bytes.len());
        self.stream.write_all(&head).map_err(|e| io_err(&peer, "send", e))?;
        self.stream.write_all(bytes).map_err(|e| io_err(&peer, "send", e))
    }

    fn recv_header(&mut self) -> Result<Header> {
        let mut h = [0u8; HEADER_LEN];
        let peer = self.peer.clone();
        self.stream.read_exact(&mut h).map_err(|e| io_err(&peer, "receive", e))?;
        decode_header(&h).map_err(|e| e.context(format!("peer {peer}")))
    }

    pub fn recv(&mut self) -> Result<(Header, Vec<u8>)> {
        let h = self.recv_header()?;
        let len = control_len(&h).map_err(|e| e.context(format!("peer {}", self.peer)))?;
        let mut body = vec![0u8; len];
        let peer = self.peer.clone();
        self.stream.read_exact(&mut body).map_err(|e| io_err(&peer, "receive", e))?;
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

    /// Receives one data frame straight into `dst`, which must be exactly its length.
    /// `verify`: check the frame's checksum here; a caller that checks the chunk against its
    /// manifest right after (a restore) passes false, so the bytes are read once, not twice.
    pub fn recv_data_into(&mut self, dst: &mut [u8], verify: bool) -> Result<DataHeader> {
        let h = self.recv_header()?;
        if h.kind == Kind::Error {
            let mut body = vec![0u8; h.len as usize];
            let peer = self.peer.clone();
            self.stream.read_exact(&mut body).map_err(|e| io_err(&peer, "receive", e))?;
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
        let peer = self.peer.clone();
        self.stream.read_exact(&mut sub).map_err(|e| io_err(&peer, "receive", e))?;
        self.stream.read_exact(dst).map_err(|e| io_err(&peer, "receive", e))?;
        let d = decode_data_header(&sub);
        if !verify {
            return Ok(d);
        }
        let crc = crc32c::crc32c(dst);
        if crc != d.crc32c {
            return Err(Error::integrity(format!("peer {}: data frame checksum mismatch ({crc:08x} != {:08x})", self.peer, d.crc32c)));
        }
        Ok(d)
    }
}

/// The requests of the peer protocol, one method each.
impl Conn {
    /// Pushes one rank's step: the manifest, then every chunk as a data frame (straight from
    /// the source's memory when it has the bytes in place), then END; returns once the holder
    /// has acknowledged the complete, verified copy.
    pub fn put_replica(&mut self, m: &Manifest, src: &dyn ChunkSource, link: &Link) -> Result<()> {
        let _: Reply = self.request(&Request::Put { step: m.step, rank: m.rank, manifest: m.clone() })?;
        let mut buf = vec![];
        for (i, it) in m.items.iter().enumerate() {
            for (k, ch) in it.chunks.iter().enumerate() {
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
            }
        }
        self.send(Kind::End, &[])?;
        let _: Reply = self.response()?;
        Ok(())
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

    /// Reads `dst.len()` stored bytes at `offset` of an object of `rank`'s replica of `step`.
    /// The caller checks them against `crc32c` (the chunk's checksum) right after.
    pub fn read(&mut self, step: u64, rank: u32, object: &str, offset: u64, crc32c: u32, dst: &mut [u8]) -> Result<()> {
        let req = Request::Read { step, rank, object: object.to_string(), offset, len: dst.len() as u64, crc32c };
        self.send(Kind::Request, &serde_json::to_vec(&req).expect("request serializes"))?;
        self.recv_data_into(dst, false)?;
        Ok(())
    }
}
