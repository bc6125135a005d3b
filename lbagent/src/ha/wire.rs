//! The sync link's datagrams: what the two hosts of a pair send each other
//! over UDP, authenticated with HMAC-SHA256 under the pair's shared secret.
//!
//! ```text
//! header (32 bytes): "LBHA", version, kind, 0, 0,
//!                    session (u64), seq (u64), echo (u64)   all big-endian
//! body:              by kind (below)
//! mac (32 bytes):    HMAC-SHA256(secret, header ‖ body)
//! ```
//!
//! *session* is the sender's start time (Unix ns), so a restarted sender's
//! session is newer than any it had before; *seq* counts its datagrams;
//! *echo* is the receiver's own session as the sender last heard it. A
//! receiver ([`Replay`]) takes a datagram only when its MAC is right, its
//! session is the newest it has heard (a newer one only from a hello), its
//! seq is new within that session, and, for everything but a hello, it
//! echoes the receiver's current session: a datagram recorded before the
//! receiver started, or replayed within a session, is refused, so a
//! forged or replayed datagram can neither create, change nor delete a
//! flow nor move a role.
//!
//! Flow records carry 16-byte addresses (IPv4-mapped for IPv4, as flow-log
//! records do) and name their zone and rules by key (`natgw/<name>`,
//! rule keys): ids are local to each host.

use anyhow::{Result, bail, ensure};
use ring::hmac;

pub const MAGIC: &[u8; 4] = b"LBHA";
pub const VERSION: u8 = 1;
pub const HEADER: usize = 32;
pub const MAC: usize = 32;
/// Largest datagram sent (fits a 1500-byte MTU with IP and UDP headers).
pub const MAX_DATAGRAM: usize = 1400;

/// What a datagram is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum Kind {
    /// Every 100 ms both ways: the sender's role and readiness.
    Hello = 1,
    /// Flow records.
    Flows = 2,
    /// The end of a bulk pass: its id and how many records it sent.
    PassEnd = 3,
    /// The receiver wrote the flows of datagram `seq`.
    Ack = 4,
    /// A planned switchover: the receiver takes the active role.
    Takeover = 5,
}

impl Kind {
    fn of(b: u8) -> Option<Kind> {
        Some(match b {
            1 => Kind::Hello,
            2 => Kind::Flows,
            3 => Kind::PassEnd,
            4 => Kind::Ack,
            5 => Kind::Takeover,
            _ => return None,
        })
    }
}

/// A datagram's header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Header {
    pub kind: Kind,
    pub session: u64,
    pub seq: u64,
    pub echo: u64,
}

/// A hello's body.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Hello {
    pub active: bool,
    /// The sender holds every flow of its peer (a bulk pass completed).
    pub ready: bool,
    /// The sender asks for a bulk pass.
    pub want_bulk: bool,
    /// The sender's role term (`crate::ha`: every promotion takes one
    /// above both hosts' last).
    pub term: u64,
}

/// One flow, as both hosts understand it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct FlowRec {
    pub family: u8,
    pub proto: u8,
    /// `CT_*` state.
    pub state: u8,
    /// `CT_F_SNAT | CT_F_DNAT | CT_F_LOCAL` of the original direction.
    pub flags: u8,
    /// The flow is in the established table.
    pub established: bool,
    pub orig_saddr: [u8; 16],
    pub orig_daddr: [u8; 16],
    pub orig_sport: u16,
    pub orig_dport: u16,
    pub xlate_saddr: [u8; 16],
    pub xlate_daddr: [u8; 16],
    pub xlate_sport: u16,
    pub xlate_dport: u16,
    /// Milliseconds since its last packet, and since it was created.
    pub idle_ms: u32,
    pub age_ms: u32,
    pub zone: String,
    /// Rule keys; empty: none.
    pub dnat_rule: String,
    pub snat_rule: String,
}

const REC_FIXED: usize = 5 + 4 * 16 + 8 + 8;

impl FlowRec {
    pub fn encoded_len(&self) -> usize {
        REC_FIXED + 3 + self.zone.len() + self.dnat_rule.len() + self.snat_rule.len()
    }

    fn encode(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&[self.family, self.proto, self.state, self.flags, u8::from(self.established)]);
        for a in [&self.orig_saddr, &self.orig_daddr, &self.xlate_saddr, &self.xlate_daddr] {
            out.extend_from_slice(a);
        }
        for p in [self.orig_sport, self.orig_dport, self.xlate_sport, self.xlate_dport] {
            out.extend_from_slice(&p.to_be_bytes());
        }
        out.extend_from_slice(&self.idle_ms.to_be_bytes());
        out.extend_from_slice(&self.age_ms.to_be_bytes());
        for s in [&self.zone, &self.dnat_rule, &self.snat_rule] {
            out.push(s.len() as u8);
            out.extend_from_slice(s.as_bytes());
        }
    }

    fn decode(b: &mut Reader) -> Result<FlowRec> {
        let f = b.take(5)?;
        let mut r = FlowRec {
            family: f[0],
            proto: f[1],
            state: f[2],
            flags: f[3],
            established: f[4] != 0,
            ..FlowRec::default()
        };
        r.orig_saddr = b.array()?;
        r.orig_daddr = b.array()?;
        r.xlate_saddr = b.array()?;
        r.xlate_daddr = b.array()?;
        r.orig_sport = b.u16()?;
        r.orig_dport = b.u16()?;
        r.xlate_sport = b.u16()?;
        r.xlate_dport = b.u16()?;
        r.idle_ms = b.u32()?;
        r.age_ms = b.u32()?;
        r.zone = b.string()?;
        r.dnat_rule = b.string()?;
        r.snat_rule = b.string()?;
        Ok(r)
    }
}

/// A datagram's body.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Body {
    Hello(Hello),
    /// `pass`: the bulk pass they belong to (0: new flows and changes).
    Flows {
        pass: u32,
        flows: Vec<FlowRec>,
    },
    PassEnd {
        pass: u32,
        records: u32,
    },
    Ack {
        seq: u64,
    },
    Takeover,
}

impl Body {
    fn kind(&self) -> Kind {
        match self {
            Body::Hello(_) => Kind::Hello,
            Body::Flows { .. } => Kind::Flows,
            Body::PassEnd { .. } => Kind::PassEnd,
            Body::Ack { .. } => Kind::Ack,
            Body::Takeover => Kind::Takeover,
        }
    }
}

/// `Body::Flows::pass` of new flows from the ring (each datagram is
/// acknowledged: the sync lag).
pub const NEW_FLOWS: u32 = 0;
/// `Body::Flows::pass` of the changes sent every second.
pub const CHANGES: u32 = u32::MAX;

/// Room for flow records in one datagram.
pub const FLOWS_ROOM: usize = MAX_DATAGRAM - HEADER - MAC - 4 - 2;

/// The signing key.
pub struct Key(hmac::Key);

impl Key {
    pub fn new(secret: &[u8]) -> Key {
        Key(hmac::Key::new(hmac::HMAC_SHA256, secret))
    }
}

/// Encodes and signs one datagram.
pub fn encode(key: &Key, session: u64, seq: u64, echo: u64, body: &Body) -> Vec<u8> {
    let mut out = Vec::with_capacity(MAX_DATAGRAM);
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&[VERSION, body.kind() as u8, 0, 0]);
    out.extend_from_slice(&session.to_be_bytes());
    out.extend_from_slice(&seq.to_be_bytes());
    out.extend_from_slice(&echo.to_be_bytes());
    match body {
        Body::Hello(h) => {
            out.extend_from_slice(&[u8::from(h.active), u8::from(h.ready), u8::from(h.want_bulk), 0]);
            out.extend_from_slice(&h.term.to_be_bytes());
        }
        Body::Flows { pass, flows } => {
            out.extend_from_slice(&pass.to_be_bytes());
            out.extend_from_slice(&(flows.len() as u16).to_be_bytes());
            for f in flows {
                f.encode(&mut out);
            }
        }
        Body::PassEnd { pass, records } => {
            out.extend_from_slice(&pass.to_be_bytes());
            out.extend_from_slice(&records.to_be_bytes());
        }
        Body::Ack { seq } => out.extend_from_slice(&seq.to_be_bytes()),
        Body::Takeover => {}
    }
    let tag = hmac::sign(&key.0, &out);
    out.extend_from_slice(tag.as_ref());
    out
}

/// Checks the MAC and decodes one datagram (the replay checks are
/// [`Replay`]'s).
pub fn decode(key: &Key, d: &[u8]) -> Result<(Header, Body)> {
    ensure!(d.len() >= HEADER + MAC, "{} bytes: too short", d.len());
    ensure!(d.len() <= MAX_DATAGRAM, "{} bytes: longer than any datagram of the link", d.len());
    let (signed, tag) = d.split_at(d.len() - MAC);
    ensure!(hmac::verify(&key.0, signed, tag).is_ok(), "bad MAC (another secret, or forged)");
    ensure!(&signed[..4] == MAGIC && signed[4] == VERSION, "not an lbagent sync datagram of version {VERSION}");
    let Some(kind) = Kind::of(signed[5]) else { bail!("unknown kind {}", signed[5]) };
    let mut r = Reader(&signed[8..]);
    let h = Header { kind, session: r.u64()?, seq: r.u64()?, echo: r.u64()? };
    let body = match kind {
        Kind::Hello => {
            let f = r.take(4)?;
            let (active, ready, want_bulk) = (f[0] != 0, f[1] != 0, f[2] != 0);
            Body::Hello(Hello { active, ready, want_bulk, term: r.u64()? })
        }
        Kind::Flows => {
            let pass = r.u32()?;
            let n = r.u16()?;
            let flows = (0..n).map(|_| FlowRec::decode(&mut r)).collect::<Result<_>>()?;
            Body::Flows { pass, flows }
        }
        Kind::PassEnd => Body::PassEnd { pass: r.u32()?, records: r.u32()? },
        Kind::Ack => Body::Ack { seq: r.u64()? },
        Kind::Takeover => Body::Takeover,
    };
    ensure!(r.0.is_empty(), "{} bytes after the body", r.0.len());
    Ok((h, body))
}

struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8]> {
        ensure!(self.0.len() >= n, "truncated");
        let (a, b) = self.0.split_at(n);
        self.0 = b;
        Ok(a)
    }
    fn array<const N: usize>(&mut self) -> Result<[u8; N]> {
        Ok(self.take(N)?.try_into().unwrap())
    }
    fn u16(&mut self) -> Result<u16> {
        Ok(u16::from_be_bytes(self.array()?))
    }
    fn u32(&mut self) -> Result<u32> {
        Ok(u32::from_be_bytes(self.array()?))
    }
    fn u64(&mut self) -> Result<u64> {
        Ok(u64::from_be_bytes(self.array()?))
    }
    fn string(&mut self) -> Result<String> {
        let n = self.take(1)?[0] as usize;
        Ok(std::str::from_utf8(self.take(n)?)?.to_string())
    }
}

/// The receiver's replay guard: the peer's newest session and a window of
/// the sequence numbers seen in it (64 wide, as IPsec's).
#[derive(Debug, Default)]
pub struct Replay {
    pub peer_session: u64,
    top: u64,
    window: u64,
}

impl Replay {
    /// Whether to take a datagram with header `h`, `mine` being this host's
    /// session; records it when taken. A hello is taken without echoing
    /// `mine` (the peer may not have heard this host yet), so what a hello
    /// says is trusted only when it does echo it (the caller's part).
    pub fn admit(&mut self, h: &Header, mine: u64) -> Result<(), &'static str> {
        if h.kind != Kind::Hello && h.echo != mine {
            return Err("not addressed to the current run of this host's link (stale or replayed)");
        }
        if h.session < self.peer_session {
            return Err("an older session of the peer (replayed)");
        }
        if h.session > self.peer_session {
            if h.kind != Kind::Hello {
                return Err("a new session that has not said hello");
            }
            self.peer_session = h.session;
            self.top = h.seq;
            self.window = 1;
            return Ok(());
        }
        if h.seq > self.top {
            let shift = h.seq - self.top;
            self.window = if shift >= 64 { 1 } else { (self.window << shift) | 1 };
            self.top = h.seq;
            return Ok(());
        }
        let back = self.top - h.seq;
        if back >= 64 || self.window & (1 << back) != 0 {
            return Err("a sequence number already seen (replayed)");
        }
        self.window |= 1 << back;
        Ok(())
    }
}

/// Packs `flows` into datagram bodies of at most [`FLOWS_ROOM`] bytes.
pub fn pack(pass: u32, flows: Vec<FlowRec>) -> Vec<Body> {
    let mut out = Vec::new();
    let (mut cur, mut used) = (Vec::new(), 0);
    for f in flows {
        let n = f.encoded_len();
        if used + n > FLOWS_ROOM && !cur.is_empty() {
            out.push(Body::Flows { pass, flows: std::mem::take(&mut cur) });
            used = 0;
        }
        used += n;
        cur.push(f);
    }
    if !cur.is_empty() {
        out.push(Body::Flows { pass, flows: cur });
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(i: u16) -> FlowRec {
        FlowRec {
            family: 4,
            proto: 6,
            orig_sport: i,
            zone: "natgw/gw1".into(),
            snat_rule: "natgw/gw1/snat/10.0.0.0/24".into(),
            ..FlowRec::default()
        }
    }

    #[test]
    fn round_trip_and_a_flipped_bit_is_refused() {
        let key = Key::new(b"0123456789abcdef");
        let body = Body::Flows { pass: 3, flows: vec![rec(1), rec(2)] };
        let d = encode(&key, 10, 1, 20, &body);
        let (h, b) = decode(&key, &d).unwrap();
        assert_eq!((h.kind, h.session, h.seq, h.echo), (Kind::Flows, 10, 1, 20));
        assert_eq!(b, body);
        for i in [0, 9, HEADER + 3, d.len() - 1] {
            let mut bad = d.clone();
            bad[i] ^= 1;
            assert!(decode(&key, &bad).is_err(), "byte {i}");
        }
        assert!(decode(&Key::new(b"another secret!!"), &d).is_err());
        let mut long = d.clone();
        long.resize(MAX_DATAGRAM + 1, 0);
        let why = decode(&key, &long).unwrap_err().to_string();
        assert!(why.contains("longer than any datagram"), "refused before its MAC is computed: {why}");
    }

    #[test]
    fn replays_and_stale_sessions_are_refused() {
        let mut r = Replay::default();
        let h = |kind, session, seq, echo| Header { kind, session, seq, echo };
        assert!(r.admit(&h(Kind::Flows, 5, 1, 7), 7).is_err(), "no hello yet");
        assert!(r.admit(&h(Kind::Hello, 5, 1, 0), 7).is_ok());
        assert!(r.admit(&h(Kind::Flows, 5, 2, 6), 7).is_err(), "addressed to another session of ours");
        assert!(r.admit(&h(Kind::Flows, 5, 3, 7), 7).is_ok());
        assert!(r.admit(&h(Kind::Flows, 5, 3, 7), 7).is_err(), "replayed");
        assert!(r.admit(&h(Kind::Flows, 5, 2, 7), 7).is_ok(), "late but new");
        assert!(r.admit(&h(Kind::Hello, 4, 99, 7), 7).is_err(), "an older session");
        assert!(r.admit(&h(Kind::Hello, 6, 1, 7), 7).is_ok(), "the peer restarted");
        assert!(r.admit(&h(Kind::Takeover, 5, 50, 7), 7).is_err(), "the old session is over");
    }

    #[test]
    fn packing_fills_datagrams_under_the_limit() {
        let bodies = pack(0, (0..100).map(rec).collect());
        assert!(bodies.len() > 1);
        let key = Key::new(b"0123456789abcdef");
        let mut n = 0;
        for b in &bodies {
            let d = encode(&key, 1, 1, 1, b);
            assert!(d.len() <= MAX_DATAGRAM, "{}", d.len());
            if let Body::Flows { flows, .. } = b {
                n += flows.len();
            }
        }
        assert_eq!(n, 100);
    }
}
