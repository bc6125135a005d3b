//! IPFIX export (RFC 7011) with the NAT information elements of RFC 8158,
//! over UDP. One template per address family; a record per flow event,
//! the reply direction's counts as RFC 5103's reverse elements. Over UDP
//! a collector learns templates only from what it receives: they go out
//! first and again every `template_refresh` (RFC 7011, 8.4).

use std::{
    io,
    net::{IpAddr, SocketAddr, UdpSocket},
    time::{Instant, SystemTime, UNIX_EPOCH},
};

use lbagent_common::*;

use super::record::{Event, FlowRecord};
use crate::state::flow_log::IpfixSpec;

/// IPFIX version number in the message header.
const VERSION: u16 = 10;
const HEADER_LEN: usize = 16;
const SET_HEADER_LEN: usize = 4;
const TEMPLATE_SET_ID: u16 = 2;
pub const TEMPLATE_V4: u16 = 256;
pub const TEMPLATE_V6: u16 = 257;
/// Largest message sent: fits a 1500-byte path with IPv6 and UDP headers.
const MAX_MESSAGE: usize = 1400;
/// The socket's send buffer (the kernel caps it at `wmem_max`).
const SEND_BUFFER: usize = 4 << 20;
/// The longest a send waits for room in the buffer before its records
/// count as lost.
const SEND_WAIT: std::time::Duration = std::time::Duration::from_millis(50);
/// RFC 5103's private enterprise number for reverse information elements.
const REVERSE_PEN: u32 = 29305;
/// Enterprise bit of a field specifier's element id.
const ENTERPRISE: u16 = 0x8000;
/// A variable-length field's length in a template.
const VARIABLE: u16 = 0xffff;

/// Information elements (IANA's IPFIX registry).
mod ie {
    pub const OCTET_DELTA_COUNT: u16 = 1;
    pub const PACKET_DELTA_COUNT: u16 = 2;
    pub const PROTOCOL_IDENTIFIER: u16 = 4;
    pub const SOURCE_TRANSPORT_PORT: u16 = 7;
    pub const SOURCE_IPV4_ADDRESS: u16 = 8;
    pub const DESTINATION_TRANSPORT_PORT: u16 = 11;
    pub const DESTINATION_IPV4_ADDRESS: u16 = 12;
    pub const SOURCE_IPV6_ADDRESS: u16 = 27;
    pub const DESTINATION_IPV6_ADDRESS: u16 = 28;
    pub const FLOW_END_REASON: u16 = 136;
    pub const FLOW_START_MILLISECONDS: u16 = 152;
    pub const FLOW_END_MILLISECONDS: u16 = 153;
    pub const POST_NAT_SOURCE_IPV4_ADDRESS: u16 = 225;
    pub const POST_NAT_DESTINATION_IPV4_ADDRESS: u16 = 226;
    pub const POST_NAPT_SOURCE_TRANSPORT_PORT: u16 = 227;
    pub const POST_NAPT_DESTINATION_TRANSPORT_PORT: u16 = 228;
    pub const NAT_EVENT: u16 = 230;
    pub const INGRESS_VRFID: u16 = 234;
    pub const POST_NAT_SOURCE_IPV6_ADDRESS: u16 = 281;
    pub const POST_NAT_DESTINATION_IPV6_ADDRESS: u16 = 282;
    pub const NAT_POOL_NAME: u16 = 284;
    pub const OBSERVATION_TIME_MILLISECONDS: u16 = 323;
}

/// `natEvent` values (RFC 8158, IANA's registry): a NAT44 session created,
/// deleted (1 and 2 are the historic translation events).
pub const NAT_EVENT_CREATE: u8 = 4;
pub const NAT_EVENT_DELETE: u8 = 5;

/// `flowEndReason` (RFC 5102) of an end reason.
pub fn flow_end_reason(reason: u8) -> u8 {
    match reason {
        FLOW_END_TIMEOUT => 0x01,                       // idle timeout
        FLOW_END_FIN | FLOW_END_RST => 0x03,            // end of flow detected
        FLOW_END_FLUSH | FLOW_END_RULE_REMOVED => 0x04, // forced end
        FLOW_END_EVICTED => 0x05,                       // lack of resources
        _ => 0,
    }
}

/// A field specifier: element id, length, and the enterprise number for
/// an enterprise-specific element.
type Field = (u16, u16, Option<u32>);

/// The fields of a template, in record order. `v6`: the IPv6 addresses.
fn fields(v6: bool) -> Vec<Field> {
    let (src, dst, post_src, post_dst, alen) = if v6 {
        (
            ie::SOURCE_IPV6_ADDRESS,
            ie::DESTINATION_IPV6_ADDRESS,
            ie::POST_NAT_SOURCE_IPV6_ADDRESS,
            ie::POST_NAT_DESTINATION_IPV6_ADDRESS,
            16,
        )
    } else {
        (
            ie::SOURCE_IPV4_ADDRESS,
            ie::DESTINATION_IPV4_ADDRESS,
            ie::POST_NAT_SOURCE_IPV4_ADDRESS,
            ie::POST_NAT_DESTINATION_IPV4_ADDRESS,
            4,
        )
    };
    vec![
        (ie::FLOW_START_MILLISECONDS, 8, None),
        (ie::FLOW_END_MILLISECONDS, 8, None),
        (ie::OBSERVATION_TIME_MILLISECONDS, 8, None),
        (src, alen, None),
        (dst, alen, None),
        (ie::SOURCE_TRANSPORT_PORT, 2, None),
        (ie::DESTINATION_TRANSPORT_PORT, 2, None),
        (ie::PROTOCOL_IDENTIFIER, 1, None),
        (post_src, alen, None),
        (post_dst, alen, None),
        (ie::POST_NAPT_SOURCE_TRANSPORT_PORT, 2, None),
        (ie::POST_NAPT_DESTINATION_TRANSPORT_PORT, 2, None),
        (ie::NAT_EVENT, 1, None),
        (ie::FLOW_END_REASON, 1, None),
        (ie::INGRESS_VRFID, 4, None),
        (ie::PACKET_DELTA_COUNT, 8, None),
        (ie::OCTET_DELTA_COUNT, 8, None),
        (ie::PACKET_DELTA_COUNT | ENTERPRISE, 8, Some(REVERSE_PEN)),
        (ie::OCTET_DELTA_COUNT | ENTERPRISE, 8, Some(REVERSE_PEN)),
        (ie::NAT_POOL_NAME, VARIABLE, None),
    ]
}

/// The template set announcing both templates.
pub fn template_set() -> Vec<u8> {
    let mut set = Vec::new();
    for (id, v6) in [(TEMPLATE_V4, false), (TEMPLATE_V6, true)] {
        let f = fields(v6);
        set.extend_from_slice(&id.to_be_bytes());
        set.extend_from_slice(&(f.len() as u16).to_be_bytes());
        for (id, len, pen) in f {
            set.extend_from_slice(&id.to_be_bytes());
            set.extend_from_slice(&len.to_be_bytes());
            if let Some(pen) = pen {
                set.extend_from_slice(&pen.to_be_bytes());
            }
        }
    }
    with_set_header(TEMPLATE_SET_ID, set)
}

fn with_set_header(id: u16, body: Vec<u8>) -> Vec<u8> {
    let mut out = Vec::with_capacity(SET_HEADER_LEN + body.len());
    out.extend_from_slice(&id.to_be_bytes());
    out.extend_from_slice(&((SET_HEADER_LEN + body.len()) as u16).to_be_bytes());
    out.extend_from_slice(&body);
    out
}

fn millis(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH).unwrap_or_default().as_millis() as u64
}

fn put_addr(out: &mut Vec<u8>, a: IpAddr) {
    match a {
        IpAddr::V4(a) => out.extend_from_slice(&a.octets()),
        IpAddr::V6(a) => out.extend_from_slice(&a.octets()),
    }
}

/// A record's template and its bytes under it.
pub fn data_record(r: &FlowRecord) -> (u16, Vec<u8>) {
    let v6 = r.orig.src.is_ipv6();
    let mut out = Vec::with_capacity(128);
    let (first, last, nat_event, reason) = match r.event {
        Event::Start => (r.start, r.start, NAT_EVENT_CREATE, 0),
        Event::End(why) => (r.start, r.time, NAT_EVENT_DELETE, flow_end_reason(why)),
    };
    out.extend_from_slice(&millis(first).to_be_bytes());
    out.extend_from_slice(&millis(last).to_be_bytes());
    out.extend_from_slice(&millis(r.time).to_be_bytes());
    put_addr(&mut out, r.orig.src);
    put_addr(&mut out, r.orig.dst);
    out.extend_from_slice(&r.orig.sport.to_be_bytes());
    out.extend_from_slice(&r.orig.dport.to_be_bytes());
    out.push(r.proto);
    put_addr(&mut out, r.xlate.src);
    put_addr(&mut out, r.xlate.dst);
    out.extend_from_slice(&r.xlate.sport.to_be_bytes());
    out.extend_from_slice(&r.xlate.dport.to_be_bytes());
    out.push(nat_event);
    out.push(reason);
    out.extend_from_slice(&u32::from(r.zone).to_be_bytes());
    for v in [r.packets[0], r.bytes[0], r.packets[1], r.bytes[1]] {
        out.extend_from_slice(&v.to_be_bytes());
    }
    // Variable length (RFC 7011, 7): one byte below 255, else 255 and two.
    let name: &str = r.rule().map_or("", |n| n);
    let mut cut = name.len().min(1024);
    while !name.is_char_boundary(cut) {
        cut -= 1;
    }
    let name = &name.as_bytes()[..cut];
    if name.len() < 255 {
        out.push(name.len() as u8);
    } else {
        out.push(255);
        out.extend_from_slice(&(name.len() as u16).to_be_bytes());
    }
    out.extend_from_slice(name);
    (if v6 { TEMPLATE_V6 } else { TEMPLATE_V4 }, out)
}

/// Builds messages for one exporting process (one observation domain):
/// sequence numbers count the data records sent before each message.
pub struct Encoder {
    domain: u32,
    sequence: u32,
}

impl Encoder {
    pub fn new(domain: u32) -> Self {
        Encoder { domain, sequence: 0 }
    }

    /// A message of `sets` carrying `records` data records.
    pub fn message(&mut self, sets: &[Vec<u8>], records: u32, export_time: SystemTime) -> Vec<u8> {
        let len = HEADER_LEN + sets.iter().map(Vec::len).sum::<usize>();
        let mut out = Vec::with_capacity(len);
        out.extend_from_slice(&VERSION.to_be_bytes());
        out.extend_from_slice(&(len as u16).to_be_bytes());
        let secs = export_time.duration_since(UNIX_EPOCH).unwrap_or_default().as_secs() as u32;
        out.extend_from_slice(&secs.to_be_bytes());
        out.extend_from_slice(&self.sequence.to_be_bytes());
        out.extend_from_slice(&self.domain.to_be_bytes());
        for s in sets {
            out.extend_from_slice(s);
        }
        self.sequence = self.sequence.wrapping_add(records);
        out
    }

    /// Messages carrying `records` (each at most [`MAX_MESSAGE`] bytes,
    /// one data set per template in each), with the records each carries.
    pub fn messages(&mut self, records: &[FlowRecord], export_time: SystemTime) -> Vec<(Vec<u8>, u32)> {
        let mut out = Vec::new();
        let mut sets: Vec<(u16, Vec<u8>, u32)> = Vec::new();
        let mut size = HEADER_LEN;
        for r in records {
            let (template, bytes) = data_record(r);
            let grows = bytes.len() + if sets.iter().any(|(t, _, _)| *t == template) { 0 } else { SET_HEADER_LEN };
            if size + grows > MAX_MESSAGE && !sets.is_empty() {
                out.push(self.flush(&mut sets, export_time));
                size = HEADER_LEN;
            }
            match sets.iter_mut().find(|(t, _, _)| *t == template) {
                Some((_, body, n)) => {
                    body.extend_from_slice(&bytes);
                    *n += 1;
                    size += bytes.len();
                }
                None => {
                    size += SET_HEADER_LEN + bytes.len();
                    sets.push((template, bytes, 1));
                }
            }
        }
        if !sets.is_empty() {
            out.push(self.flush(&mut sets, export_time));
        }
        out
    }

    fn flush(&mut self, sets: &mut Vec<(u16, Vec<u8>, u32)>, export_time: SystemTime) -> (Vec<u8>, u32) {
        let n = sets.iter().map(|(_, _, n)| n).sum();
        let sets: Vec<Vec<u8>> = sets.drain(..).map(|(t, body, _)| with_set_header(t, body)).collect();
        (self.message(&sets, n, export_time), n)
    }
}

/// Sets `SO_SNDBUF` on `socket`.
fn set_send_buffer(socket: &UdpSocket, bytes: usize) -> io::Result<()> {
    use std::os::fd::AsRawFd;
    let v = bytes as libc::c_int;
    // SAFETY: a valid socket descriptor for the call, and a pointer to an
    // int with its size, as `setsockopt(SO_SNDBUF)` takes.
    let rc = unsafe {
        libc::setsockopt(
            socket.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_SNDBUF,
            (&raw const v).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    if rc == 0 { Ok(()) } else { Err(io::Error::last_os_error()) }
}

/// One collector: its socket, its encoder, when templates went out last.
pub struct Exporter {
    pub spec: IpfixSpec,
    socket: UdpSocket,
    encoder: Encoder,
    templates_sent: Option<Instant>,
}

impl Exporter {
    pub fn new(spec: IpfixSpec) -> io::Result<Self> {
        let bind: SocketAddr = if spec.collector.is_ipv4() { "0.0.0.0:0" } else { "[::]:0" }.parse().unwrap();
        let socket = UdpSocket::bind(bind)?;
        socket.connect(spec.collector)?;
        // A burst (a mass end: a flush, an object removed) fills the
        // socket's buffer: sends wait a little for room, never long.
        set_send_buffer(&socket, SEND_BUFFER)?;
        socket.set_write_timeout(Some(SEND_WAIT))?;
        let encoder = Encoder::new(spec.observation_domain);
        Ok(Exporter { spec, socket, encoder, templates_sent: None })
    }

    /// Sends `records` (templates first when due). Returns the records
    /// sent and the records lost to send errors (a collector that refuses
    /// them, a socket buffer still full after [`SEND_WAIT`]).
    pub fn send(&mut self, records: &[FlowRecord]) -> (u64, u64) {
        let now = SystemTime::now();
        if self.templates_sent.is_none_or(|t| t.elapsed() >= self.spec.template_refresh) {
            let msg = self.encoder.message(&[template_set()], 0, now);
            if self.socket.send(&msg).is_ok() {
                self.templates_sent = Some(Instant::now());
            }
        }
        if records.is_empty() {
            return (0, 0);
        }
        let (mut sent, mut lost) = (0, 0);
        let mut full = false;
        for (msg, n) in self.encoder.messages(records, now) {
            // After one send waited in vain, the batch's rest is lost
            // without waiting again.
            if full {
                lost += u64::from(n);
                continue;
            }
            match self.socket.send(&msg) {
                Ok(_) => sent += u64::from(n),
                Err(e) => {
                    full = matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut);
                    lost += u64::from(n);
                }
            }
        }
        (sent, lost)
    }
}

#[cfg(test)]
mod tests {
    use std::{net::Ipv4Addr, sync::Arc, time::Duration};

    use super::*;
    use crate::flow_log::record::Endpoints;

    fn record(i: u16) -> FlowRecord {
        let t = UNIX_EPOCH + Duration::from_millis(1_796_661_005_123);
        FlowRecord {
            event: Event::End(FLOW_END_FIN),
            time: t + Duration::from_millis(2500),
            start: t,
            zone: 7,
            object: Some("natgw/gw1".into()),
            dnat_rule: None,
            snat_rule: Some(Arc::from("natgw/gw1/snat/10.0.0.0/24")),
            proto: PROTO_TCP,
            orig: Endpoints {
                src: Ipv4Addr::new(10, 0, 0, 5).into(),
                sport: 40_000 + i,
                dst: Ipv4Addr::new(198, 51, 100, 7).into(),
                dport: 443,
            },
            xlate: Endpoints {
                src: Ipv4Addr::new(203, 0, 113, 20).into(),
                sport: 50_000 + i,
                dst: Ipv4Addr::new(198, 51, 100, 7).into(),
                dport: 443,
            },
            packets: [10, 8],
            bytes: [1000, 8000],
        }
    }

    fn u16_at(b: &[u8], at: usize) -> u16 {
        u16::from_be_bytes([b[at], b[at + 1]])
    }

    #[test]
    fn a_record_is_laid_out_as_its_template_says() {
        let (template, bytes) = data_record(&record(0));
        assert_eq!(template, TEMPLATE_V4);
        let fixed: usize = fields(false).iter().filter(|f| f.1 != VARIABLE).map(|f| f.1 as usize).sum();
        let name = b"natgw/gw1/snat/10.0.0.0/24";
        assert_eq!(bytes.len(), fixed + 1 + name.len());
        assert_eq!(&bytes[..8], &1_796_661_005_123u64.to_be_bytes());
        assert_eq!(&bytes[8..16], &1_796_661_007_623u64.to_be_bytes());
        assert_eq!(&bytes[24..28], &[10, 0, 0, 5]);
        assert_eq!(u16_at(&bytes, 32), 40_000);
        assert_eq!(bytes[36], PROTO_TCP);
        assert_eq!(&bytes[37..41], &[203, 0, 113, 20]);
        assert_eq!(u16_at(&bytes, 45), 50_000);
        assert_eq!((bytes[49], bytes[50]), (NAT_EVENT_DELETE, 0x03));
        assert_eq!(bytes[fixed] as usize, name.len());
        assert_eq!(&bytes[fixed + 1..], name);
    }

    #[test]
    fn messages_stay_within_their_size_and_number_their_records() {
        let records: Vec<FlowRecord> = (0..40).map(record).collect();
        let mut enc = Encoder::new(9);
        let t = UNIX_EPOCH + Duration::from_secs(1_796_661_005);
        let msgs = enc.messages(&records, t);
        assert!(msgs.len() > 1);
        let mut seq = 0;
        let mut total = 0;
        for (m, carried) in &msgs {
            assert!(m.len() <= MAX_MESSAGE);
            assert_eq!(u16_at(m, 0), VERSION);
            assert_eq!(u16_at(m, 2) as usize, m.len());
            assert_eq!(u32::from_be_bytes(m[8..12].try_into().unwrap()), seq);
            assert_eq!(u32::from_be_bytes(m[12..16].try_into().unwrap()), 9);
            assert_eq!(u16_at(m, 16), TEMPLATE_V4);
            assert_eq!(u16_at(m, 18) as usize, m.len() - HEADER_LEN);
            let n = (m.len() - HEADER_LEN - SET_HEADER_LEN) / data_record(&records[0]).1.len();
            assert_eq!(n as u32, *carried);
            seq += n as u32;
            total += n;
        }
        assert_eq!(total, 40);
    }

    #[test]
    fn templates_list_their_fields() {
        let set = template_set();
        assert_eq!(u16_at(&set, 0), TEMPLATE_SET_ID);
        assert_eq!(u16_at(&set, 2) as usize, set.len());
        assert_eq!(u16_at(&set, 4), TEMPLATE_V4);
        assert_eq!(u16_at(&set, 6) as usize, fields(false).len());
    }
}
