//! Packet header layout: every offset, length and flag of the headers the
//! engine reads or writes, one module per header (an IPv6 twin of `ipv4`
//! goes beside it). Offsets are from the start of their own header; the
//! modules above add the header's position (`Packet::l3`, `Packet::l4`).
//! Nothing here touches a packet: reading and writing is `parse`'s and
//! `rewrite`'s.

pub mod eth;
pub mod icmp;
pub mod ipv4;
pub mod tcp;
pub mod udp;

/// The 16-bit big-endian field at `off` of `h`.
#[inline(always)]
pub fn be16_at<const N: usize>(h: &[u8; N], off: usize) -> u16 {
    u16::from_be_bytes([h[off], h[off + 1]])
}
