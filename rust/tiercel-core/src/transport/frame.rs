//! Frames: the fixed 16-byte header, data subheaders, error bodies and the handshake's MACs.
//! Both halves of the protocol (`client`, blocking; `server`, async) encode and check frames
//! only through this file.

use hmac::{Hmac, Mac};
use serde::{Deserialize, Serialize};
use sha2::Sha256;

use crate::error::{Error, ErrorKind, Fields, Result};

/// "TCL" and the protocol version: 2 since ERROR frames carry numeric kinds and fields.
pub const MAGIC: [u8; 4] = *b"TCL\x02";
pub const HEADER_LEN: usize = 16;
pub const DATA_SUBHEADER_LEN: usize = 16;
/// Control frames (JSON) larger than this are refused: a manifest of a very large model is
/// a few MB; anything beyond is garbage or an attack.
pub const MAX_CONTROL: u64 = 64 << 20;
/// Data frames carry at most one chunk (the policy caps chunks at 1 GiB).
pub const MAX_DATA: u64 = (1 << 30) + DATA_SUBHEADER_LEN as u64;
pub const NONCE_LEN: usize = 32;
pub const MAC_LEN: usize = 32;
/// Before authentication a side reads no frame longer than this (the AUTH frame is 64
/// bytes; an ERROR explaining a refusal fits easily): a stranger cannot make it buffer more.
pub const MAX_PREAUTH: u64 = 4096;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Kind {
    Hello = 1,
    Auth = 2,
    AuthOk = 3,
    Error = 4,
    Request = 10,
    Response = 11,
    Data = 12,
    End = 13,
}

impl Kind {
    fn from_u8(b: u8) -> Option<Kind> {
        Some(match b {
            1 => Kind::Hello,
            2 => Kind::Auth,
            3 => Kind::AuthOk,
            4 => Kind::Error,
            10 => Kind::Request,
            11 => Kind::Response,
            12 => Kind::Data,
            13 => Kind::End,
            _ => return None,
        })
    }

    pub fn max_len(self) -> u64 {
        match self {
            Kind::Hello => NONCE_LEN as u64,
            Kind::Auth => (NONCE_LEN + MAC_LEN) as u64,
            Kind::AuthOk => MAC_LEN as u64,
            Kind::End => 0,
            Kind::Data => MAX_DATA,
            Kind::Error | Kind::Request | Kind::Response => MAX_CONTROL,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    pub kind: Kind,
    pub len: u64,
}

pub fn encode_header(kind: Kind, len: u64) -> [u8; HEADER_LEN] {
    let mut h = [0u8; HEADER_LEN];
    h[..4].copy_from_slice(&MAGIC);
    h[4] = kind as u8;
    h[8..16].copy_from_slice(&len.to_le_bytes());
    h
}

/// Decodes and checks a frame header. Every way a header can be wrong is an error here,
/// before a single payload byte is read or allocated.
pub fn decode_header(h: &[u8; HEADER_LEN]) -> Result<Header> {
    if h[..3] != MAGIC[..3] {
        return Err(Error::integrity("not a tiercel peer frame (bad magic)"));
    }
    if h[3] != MAGIC[3] {
        return Err(Error::integrity(format!("peer protocol version {} is not supported (this side speaks {})", h[3], MAGIC[3])));
    }
    let kind = Kind::from_u8(h[4]).ok_or_else(|| Error::integrity(format!("unknown frame kind {}", h[4])))?;
    if h[5..8] != [0, 0, 0] {
        return Err(Error::integrity("reserved header bytes are not zero"));
    }
    let len = u64::from_le_bytes(h[8..16].try_into().unwrap());
    if len > kind.max_len() {
        return Err(Error::integrity(format!("{kind:?} frame of {len} bytes exceeds the limit of {}", kind.max_len())));
    }
    if kind == Kind::Data && len < DATA_SUBHEADER_LEN as u64 {
        return Err(Error::integrity("data frame shorter than its subheader"));
    }
    Ok(Header { kind, len })
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DataHeader {
    pub object: u32,
    pub offset: u64,
    pub crc32c: u32,
}

pub fn encode_data_header(d: &DataHeader) -> [u8; DATA_SUBHEADER_LEN] {
    let mut b = [0u8; DATA_SUBHEADER_LEN];
    b[..4].copy_from_slice(&d.object.to_le_bytes());
    b[4..12].copy_from_slice(&d.offset.to_le_bytes());
    b[12..16].copy_from_slice(&d.crc32c.to_le_bytes());
    b
}

/// The header and subheader of a data frame carrying `len` payload bytes, in one buffer
/// (written with one call before the payload).
pub fn encode_data_head(d: &DataHeader, len: usize) -> [u8; HEADER_LEN + DATA_SUBHEADER_LEN] {
    let mut head = [0u8; HEADER_LEN + DATA_SUBHEADER_LEN];
    head[..HEADER_LEN].copy_from_slice(&encode_header(Kind::Data, (DATA_SUBHEADER_LEN + len) as u64));
    head[HEADER_LEN..].copy_from_slice(&encode_data_header(d));
    head
}

pub fn decode_data_header(b: &[u8; DATA_SUBHEADER_LEN]) -> DataHeader {
    DataHeader {
        object: u32::from_le_bytes(b[..4].try_into().unwrap()),
        offset: u64::from_le_bytes(b[4..12].try_into().unwrap()),
        crc32c: u32::from_le_bytes(b[12..16].try_into().unwrap()),
    }
}

/// The payload length of a control frame, the only kind a receiver reads whole; a data frame
/// where a control frame belongs is a protocol error.
pub fn control_len(h: &Header) -> Result<usize> {
    if h.kind == Kind::Data {
        return Err(Error::unavailable("unexpected data frame"));
    }
    Ok(h.len as usize)
}

/// The JSON body of an ERROR frame: the error's kind as its number (`ErrorKind::code`),
/// its message and its fields, so that the client's error is the server's.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WireError {
    pub code: u8,
    pub message: String,
    #[serde(flatten)]
    pub fields: Fields,
}

impl WireError {
    pub fn from_error(e: &Error) -> WireError {
        WireError { code: e.kind.code(), message: e.message.clone(), fields: (*e.fields).clone() }
    }

    /// The error as the client sees it: the server's, said to come from `peer`. An unknown
    /// code (a newer peer) reads as the tier being unavailable.
    pub fn into_error(self, peer: &str) -> Error {
        let kind = ErrorKind::from_code(self.code).unwrap_or(ErrorKind::TierUnavailable);
        Error::new(kind, format!("peer {peer}: {}", self.message)).with_fields(self.fields)
    }
}

type HmacSha256 = Hmac<Sha256>;

pub fn mac(secret: &[u8], role: &[u8], a: &[u8], b: &[u8]) -> [u8; MAC_LEN] {
    let mut m = HmacSha256::new_from_slice(secret).expect("HMAC takes any key length");
    m.update(b"tiercel-peer-v1/");
    m.update(role);
    m.update(a);
    m.update(b);
    m.finalize().into_bytes().into()
}

/// Constant-time check, so the time to reject does not reveal how much of a MAC matched.
pub fn verify_mac(secret: &[u8], role: &[u8], a: &[u8], b: &[u8], got: &[u8]) -> bool {
    let mut m = HmacSha256::new_from_slice(secret).expect("HMAC takes any key length");
    m.update(b"tiercel-peer-v1/");
    m.update(role);
    m.update(a);
    m.update(b);
    m.verify_slice(got).is_ok()
}

pub fn nonce() -> [u8; NONCE_LEN] {
    let mut n = [0u8; NONCE_LEN];
    getrandom::fill(&mut n).expect("the OS random source works");
    n
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_round_trip() {
        for (k, len) in [(Kind::Request, 10u64), (Kind::Data, 100), (Kind::End, 0), (Kind::Hello, 32)] {
            assert_eq!(decode_header(&encode_header(k, len)).unwrap(), Header { kind: k, len });
        }
        let d = DataHeader { object: 3, offset: 1 << 40, crc32c: 0xdeadbeef };
        assert_eq!(decode_data_header(&encode_data_header(&d)), d);
    }

    #[test]
    fn bad_headers_are_errors() {
        let mut h = encode_header(Kind::Request, 5);
        h[0] = b'X';
        assert!(decode_header(&h).unwrap_err().message.contains("magic"));
        let mut h = encode_header(Kind::Request, 5);
        h[3] = 9;
        assert!(decode_header(&h).unwrap_err().message.contains("version 9"));
        let mut h = encode_header(Kind::Request, 5);
        h[4] = 99;
        assert!(decode_header(&h).unwrap_err().message.contains("kind"));
        assert!(decode_header(&encode_header(Kind::Request, MAX_CONTROL + 1)).is_err());
        assert!(decode_header(&encode_header(Kind::Hello, 33)).is_err());
        assert!(decode_header(&encode_header(Kind::Data, 3)).is_err());
    }

    #[test]
    fn macs_bind_role_and_secret() {
        let (a, b) = (nonce(), nonce());
        let m = mac(b"s3cret", b"client", &a, &b);
        assert!(verify_mac(b"s3cret", b"client", &a, &b, &m));
        assert!(!verify_mac(b"other", b"client", &a, &b, &m));
        assert!(!verify_mac(b"s3cret", b"server", &a, &b, &m));
        assert!(!verify_mac(b"s3cret", b"client", &b, &a, &m));
    }

    #[test]
    fn errors_cross_the_wire_whole() {
        let e = Error::integrity("chunk at object 0 offset 4096 arrived corrupted").with_tier("peer").at(7, 3).with_chunk(1);
        let body = serde_json::to_vec(&WireError::from_error(&e)).unwrap();
        assert_eq!(
            std::str::from_utf8(&body).unwrap(),
            r#"{"code":2,"message":"chunk at object 0 offset 4096 arrived corrupted","tier":"peer","step":7,"rank":3,"chunk":1}"#
        );
        let back = serde_json::from_slice::<WireError>(&body).unwrap().into_error("10.0.0.2:7070");
        assert_eq!(
            (back.kind, back.fields.tier.as_deref(), back.fields.step, back.fields.rank, back.fields.chunk),
            (ErrorKind::Integrity, Some("peer"), Some(7), Some(3), Some(1))
        );
        assert_eq!(back.message, "peer 10.0.0.2:7070: chunk at object 0 offset 4096 arrived corrupted");
        let unknown = WireError { code: 99, message: "x".into(), fields: Fields::default() };
        assert_eq!(unknown.into_error("p").kind, ErrorKind::TierUnavailable);
    }
}
