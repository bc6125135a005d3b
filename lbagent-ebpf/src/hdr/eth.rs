//! Ethernet II (no VLAN tag: the kernel strips it before TC sees the frame).

/// The header's length: the IPv4 header follows.
pub const LEN: usize = 14;
/// The EtherType.
pub const TYPE: usize = 12;
/// EtherType IPv4.
pub const P_IP: [u8; 2] = [0x08, 0x00];

/// Whether the frame starting with `h` (at least the Ethernet header) is
/// IPv4.
#[inline(always)]
pub fn is_ipv4<const N: usize>(h: &[u8; N]) -> bool {
    h[TYPE] == P_IP[0] && h[TYPE + 1] == P_IP[1]
}
