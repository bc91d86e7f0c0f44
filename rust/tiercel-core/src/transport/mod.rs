//! The peer data plane: a framed, versioned TCP protocol between hosts.
//!
//! Every connection starts with a challenge-response on a shared secret (HMAC-SHA256 over
//! both sides' nonces, so each side proves it knows the secret) before any data moves.
//! Frames are length-prefixed with a fixed 16-byte header; data frames carry the CRC32C of
//! their payload, which is the chunk's checksum from the manifest, so a receiver verifies
//! every chunk as it lands. A stranger, a wrong secret or a malformed frame ends that
//! connection with a logged reason; the server itself never stops for it.
//!
//! ```text
//! header: magic "TCL" + version (1) | kind u8 | 3 reserved bytes | payload length u64 LE
//! HELLO    server -> client   32-byte server nonce
//! AUTH     client -> server   32-byte client nonce + HMAC(secret, "client" | ns | nc)
//! AUTH_OK  server -> client   HMAC(secret, "server" | nc | ns)
//! REQUEST  {"op": "ident", "me": {job, host, rank}, "to_host"}  (first, always)
//! RESPONSE {"ident": {job, host, rank}}   or ERROR when refused
//! REQUEST  JSON {"op": ...}   RESPONSE JSON   ERROR JSON {"kind", "message"}
//! DATA     object u32 | offset u64 | crc32c u32 | bytes       END (no payload)
//!
//! A push: REQUEST {"op": "put", manifest, "reuse": true} -> RESPONSE {"lacking": [chunk
//! indexes]} (the holder filled the others from its own earlier replica of the rank), then
//! DATA for each chunk lacking, END -> RESPONSE once the replica is complete and verified.
//! ```
//!
//! `frame` is the wire format, `messages` the requests and replies, `client` the blocking
//! half a peer tier sends with, `server` the async half every process serves its host's
//! replicas with (through a `server::Handler`, which the peer tier implements).

pub mod client;
pub mod frame;
pub mod messages;
pub mod relay;
pub mod server;
pub mod throttle;

pub use client::Conn;
pub use frame::*;
pub use messages::Ident;
