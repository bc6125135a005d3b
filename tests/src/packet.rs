//! Crafted Ethernet/IPv4 packets with checksums computed here, independently
//! of the dataplane, plus a verifier that recomputes every checksum.

pub const PROTO_ICMP: u8 = 1;
pub const PROTO_TCP: u8 = 6;
pub const PROTO_UDP: u8 = 17;
pub const PROTO_DCCP: u8 = 33;
pub const PROTO_UDPLITE: u8 = 136;

pub const SYN: u8 = 0x02;
pub const ACK: u8 = 0x10;
pub const FIN: u8 = 0x01;
pub const RST: u8 = 0x04;
pub const PSH: u8 = 0x08;

/// One's-complement sum of `data` (big-endian words), not yet inverted.
pub fn sum(data: &[u8], mut acc: u32) -> u32 {
    for c in data.chunks(2) {
        acc += u32::from(u16::from_be_bytes([c[0], *c.get(1).unwrap_or(&0)]));
    }
    acc
}

pub fn fold(mut acc: u32) -> u16 {
    while acc > 0xffff {
        acc = (acc & 0xffff) + (acc >> 16);
    }
    acc as u16
}

pub fn checksum(data: &[u8]) -> u16 {
    !fold(sum(data, 0))
}

/// An address-only L4 body (`L4::Raw`) of `proto` (DCCP or UDP-Lite) from
/// `src` to `dst`, whose checksum at offset 6 covers its pseudo header and
/// what the body's coverage field says (`covered`).
pub fn pseudo_checksummed(proto: u8, src: [u8; 4], dst: [u8; 4], mut body: Vec<u8>) -> Vec<u8> {
    body[6] = 0;
    body[7] = 0;
    let c = !fold(sum(covered(proto, &body), pseudo(src, dst, proto, body.len())));
    body[6..8].copy_from_slice(&c.to_be_bytes());
    body
}

/// The bytes of an address-only L4 body its checksum covers: UDP-Lite's
/// coverage field (bytes 4–5; 0 = all), DCCP's CsCov (low nibble of byte 5;
/// 0 = all, else the header and CsCov − 1 words of data).
fn covered(proto: u8, l4: &[u8]) -> &[u8] {
    let n = match proto {
        PROTO_UDPLITE => usize::from(u16::from_be_bytes([l4[4], l4[5]])),
        _ => match l4[5] & 0x0f {
            0 => 0,
            cs => usize::from(l4[4]) * 4 + (usize::from(cs) - 1) * 4,
        },
    };
    if n == 0 { l4 } else { &l4[..n.min(l4.len())] }
}

fn pseudo(src: [u8; 4], dst: [u8; 4], proto: u8, len: usize) -> u32 {
    let mut p = Vec::with_capacity(12);
    p.extend_from_slice(&src);
    p.extend_from_slice(&dst);
    p.extend_from_slice(&[0, proto]);
    p.extend_from_slice(&(len as u16).to_be_bytes());
    sum(&p, 0)
}

#[derive(Clone, Debug)]
pub struct Ip {
    pub src: [u8; 4],
    pub dst: [u8; 4],
    pub ttl: u8,
    pub id: u16,
    /// IP options (padded to 4 bytes by the builder).
    pub options: Vec<u8>,
}

impl Ip {
    pub fn new(src: [u8; 4], dst: [u8; 4]) -> Self {
        Ip { src, dst, ttl: 64, id: 0x1234, options: vec![] }
    }
}

#[derive(Clone, Debug)]
pub enum L4 {
    Tcp {
        sport: u16,
        dport: u16,
        seq: u32,
        ack: u32,
        flags: u8,
        payload: Vec<u8>,
    },
    Udp {
        sport: u16,
        dport: u16,
        payload: Vec<u8>,
        zero_csum: bool,
    },
    Echo {
        request: bool,
        id: u16,
        seq: u16,
        payload: Vec<u8>,
    },
    /// An ICMP error carrying `inner` (an IPv4 packet without Ethernet header).
    Error {
        kind: u8,
        code: u8,
        inner: Vec<u8>,
    },
    /// Any other IP protocol (GRE, ESP, SCTP, ...) or ICMP type: bytes as given.
    Raw {
        proto: u8,
        payload: Vec<u8>,
    },
}

impl L4 {
    pub fn proto(&self) -> u8 {
        match self {
            L4::Tcp { .. } => PROTO_TCP,
            L4::Udp { .. } => PROTO_UDP,
            L4::Raw { proto, .. } => *proto,
            _ => PROTO_ICMP,
        }
    }
}

/// The IPv4 packet (no Ethernet header) with correct checksums.
pub fn ipv4(ip: &Ip, l4: &L4) -> Vec<u8> {
    let mut opts = ip.options.clone();
    while opts.len() % 4 != 0 {
        opts.push(0);
    }
    let body = l4_bytes(ip, l4);
    let ihl = 20 + opts.len();
    let total = ihl + body.len();
    let mut h = vec![0x40 | (ihl / 4) as u8, 0];
    h.extend_from_slice(&(total as u16).to_be_bytes());
    h.extend_from_slice(&ip.id.to_be_bytes());
    h.extend_from_slice(&[0x40, 0]); // DF
    h.extend_from_slice(&[ip.ttl, l4.proto(), 0, 0]);
    h.extend_from_slice(&ip.src);
    h.extend_from_slice(&ip.dst);
    h.extend_from_slice(&opts);
    let c = checksum(&h);
    h[10..12].copy_from_slice(&c.to_be_bytes());
    h.extend_from_slice(&body);
    h
}

fn l4_bytes(ip: &Ip, l4: &L4) -> Vec<u8> {
    match l4 {
        L4::Tcp { sport, dport, seq, ack, flags, payload } => {
            let mut b = Vec::new();
            b.extend_from_slice(&sport.to_be_bytes());
            b.extend_from_slice(&dport.to_be_bytes());
            b.extend_from_slice(&seq.to_be_bytes());
            b.extend_from_slice(&ack.to_be_bytes());
            b.extend_from_slice(&[0x50, *flags, 0xfa, 0xf0, 0, 0, 0, 0]);
            b.extend_from_slice(payload);
            let c = !fold(sum(&b, pseudo(ip.src, ip.dst, PROTO_TCP, b.len())));
            b[16..18].copy_from_slice(&c.to_be_bytes());
            b
        }
        L4::Udp { sport, dport, payload, zero_csum } => {
            let mut b = Vec::new();
            b.extend_from_slice(&sport.to_be_bytes());
            b.extend_from_slice(&dport.to_be_bytes());
            b.extend_from_slice(&((8 + payload.len()) as u16).to_be_bytes());
            b.extend_from_slice(&[0, 0]);
            b.extend_from_slice(payload);
            if !zero_csum {
                let mut c = !fold(sum(&b, pseudo(ip.src, ip.dst, PROTO_UDP, b.len())));
                if c == 0 {
                    c = 0xffff;
                }
                b[6..8].copy_from_slice(&c.to_be_bytes());
            }
            b
        }
        L4::Echo { request, id, seq, payload } => {
            let mut b = vec![if *request { 8 } else { 0 }, 0, 0, 0];
            b.extend_from_slice(&id.to_be_bytes());
            b.extend_from_slice(&seq.to_be_bytes());
            b.extend_from_slice(payload);
            let c = checksum(&b);
            b[2..4].copy_from_slice(&c.to_be_bytes());
            b
        }
        L4::Raw { payload, .. } => payload.clone(),
        L4::Error { kind, code, inner } => {
            let mut b = vec![*kind, *code, 0, 0, 0, 0, 0, 0];
            b.extend_from_slice(inner);
            let c = checksum(&b);
            b[2..4].copy_from_slice(&c.to_be_bytes());
            b
        }
    }
}

pub const SRC_MAC: [u8; 6] = [0x02, 0, 0, 0, 0, 0x01];
pub const DST_MAC: [u8; 6] = [0x02, 0, 0, 0, 0, 0x02];

/// Ethernet + IPv4 frame.
pub fn frame(ip: &Ip, l4: &L4) -> Vec<u8> {
    let mut f = Vec::new();
    f.extend_from_slice(&DST_MAC);
    f.extend_from_slice(&SRC_MAC);
    f.extend_from_slice(&[0x08, 0x00]);
    f.extend_from_slice(&ipv4(ip, l4));
    f
}

/// The datagram `ip`/`l4` fragmented as a router would: IP payload chunks of
/// `chunk` bytes (a multiple of 8), DF clear, MF on all but the last, every
/// header checksum computed. Returns Ethernet frames in order.
pub fn fragments(ip: &Ip, l4: &L4, chunk: usize) -> Vec<Vec<u8>> {
    assert!(chunk % 8 == 0 && ip.options.is_empty());
    let whole = ipv4(ip, l4);
    let body = &whole[20..];
    let mut out = Vec::new();
    for (i, part) in body.chunks(chunk).enumerate() {
        let offset = i * chunk;
        let more = offset + part.len() < body.len();
        let mut h = whole[..20].to_vec();
        h[2..4].copy_from_slice(&((20 + part.len()) as u16).to_be_bytes());
        let field = (offset / 8) as u16 | if more { 0x2000 } else { 0 };
        h[6..8].copy_from_slice(&field.to_be_bytes());
        h[10..12].copy_from_slice(&[0, 0]);
        let c = checksum(&h);
        h[10..12].copy_from_slice(&c.to_be_bytes());
        let mut f = Vec::new();
        f.extend_from_slice(&DST_MAC);
        f.extend_from_slice(&SRC_MAC);
        f.extend_from_slice(&[0x08, 0x00]);
        f.extend_from_slice(&h);
        f.extend_from_slice(part);
        out.push(f);
    }
    out
}

/// What a frame carries, read back from bytes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Summary {
    pub src: [u8; 4],
    pub dst: [u8; 4],
    pub proto: u8,
    /// Ports; for ICMP echo (id, 0); for ICMP errors (type, code).
    pub sport: u16,
    pub dport: u16,
}

pub fn ihl(ip: &[u8]) -> usize {
    ((ip[0] & 0x0f) as usize) * 4
}

pub fn summary(frame: &[u8]) -> Summary {
    let ip = &frame[14..];
    let l4 = &ip[ihl(ip)..];
    let (sport, dport) = match ip[9] {
        PROTO_ICMP if l4[0] == 0 || l4[0] == 8 => (u16::from_be_bytes([l4[4], l4[5]]), 0),
        PROTO_ICMP => (l4[0] as u16, l4[1] as u16),
        _ => (u16::from_be_bytes([l4[0], l4[1]]), u16::from_be_bytes([l4[2], l4[3]])),
    };
    Summary { src: ip[12..16].try_into().unwrap(), dst: ip[16..20].try_into().unwrap(), proto: ip[9], sport, dport }
}

/// Recomputes every checksum of an IPv4 packet (no Ethernet header), and of
/// the packet embedded in an ICMP error. UDP checksum 0 means "none".
pub fn verify_ipv4(ip: &[u8]) -> Result<(), String> {
    let hl = ihl(ip);
    if checksum(&ip[..hl]) != 0 {
        return Err(format!("bad IPv4 header checksum {:02x?}", &ip[10..12]));
    }
    let total = u16::from_be_bytes([ip[2], ip[3]]) as usize;
    let l4 = &ip[hl..total.min(ip.len())];
    let (src, dst): ([u8; 4], [u8; 4]) = (ip[12..16].try_into().unwrap(), ip[16..20].try_into().unwrap());
    match ip[9] {
        PROTO_TCP if fold(sum(l4, pseudo(src, dst, PROTO_TCP, l4.len()))) != 0xffff => Err("bad TCP checksum".into()),
        PROTO_UDP if l4[6..8] != [0, 0] && fold(sum(l4, pseudo(src, dst, PROTO_UDP, l4.len()))) != 0xffff => {
            Err("bad UDP checksum".into())
        }
        PROTO_UDPLITE | PROTO_DCCP if l4.len() >= 8 => {
            if fold(sum(covered(ip[9], l4), pseudo(src, dst, ip[9], l4.len()))) != 0xffff {
                return Err(format!("bad checksum of protocol {}", ip[9]));
            }
            Ok(())
        }
        PROTO_ICMP => {
            if checksum(l4) != 0 {
                return Err("bad ICMP checksum".into());
            }
            if [3, 11, 12].contains(&l4[0]) {
                verify_ipv4(&l4[8..]).map_err(|e| format!("embedded packet: {e}"))?;
            }
            Ok(())
        }
        _ => Ok(()),
    }
}

pub fn verify(frame: &[u8]) -> Result<(), String> {
    verify_ipv4(&frame[14..])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn built_packets_verify() {
        let ip = Ip { options: vec![1, 1, 1, 0], ..Ip::new([10, 0, 0, 1], [10, 0, 0, 2]) };
        for l4 in [
            L4::Tcp { sport: 1, dport: 2, seq: 3, ack: 4, flags: SYN, payload: b"abc".to_vec() },
            L4::Udp { sport: 1, dport: 2, payload: b"hello".to_vec(), zero_csum: false },
            L4::Echo { request: true, id: 7, seq: 1, payload: vec![1, 2, 3] },
        ] {
            verify(&frame(&ip, &l4)).unwrap();
        }
        let mut bad = frame(&ip, &L4::Udp { sport: 1, dport: 2, payload: b"x".to_vec(), zero_csum: false });
        *bad.last_mut().unwrap() ^= 1;
        assert!(verify(&bad).is_err());
    }
}
