//! IPv4 (RFC 791).

/// Version and header length (in 32-bit words, low nibble).
pub const VER_IHL: usize = 0;
/// Type of service: DSCP and the two ECN bits.
pub const TOS: usize = 1;
pub const TOT_LEN: usize = 2;
pub const ID: usize = 4;
/// Flags and fragment offset.
pub const FRAG_OFF: usize = 6;
/// The TTL; the protocol follows it, and the header checksum covers the two
/// as one 16-bit word.
pub const TTL: usize = 8;
pub const PROTO: usize = 9;
pub const CSUM: usize = 10;
pub const SADDR: usize = 12;
pub const DADDR: usize = 16;
/// A header without options.
pub const MIN_LEN: usize = 20;
/// A header with the most options.
pub const MAX_LEN: usize = 60;

/// More fragments follow.
pub const MF: u16 = 0x2000;
/// The fragment offset's bits of `FRAG_OFF`.
pub const OFFSET_MASK: u16 = 0x1fff;

/// The ECN codepoints of `TOS` (its low two bits) and Congestion
/// Experienced.
pub const ECN_MASK: u8 = 0x03;
pub const ECN_CE: u8 = 0x03;

/// A copy of the fixed header (what parsing, QoS and the proxy guard read),
/// with its fields by name.
#[derive(Clone, Copy)]
pub struct Head(pub [u8; MIN_LEN]);

impl Head {
    /// The fixed header inside a frame copied from its start (`N` at least
    /// the Ethernet and the fixed IPv4 header).
    #[inline(always)]
    pub fn in_frame<const N: usize>(frame: &[u8; N]) -> Head {
        let mut h = [0u8; MIN_LEN];
        h.copy_from_slice(&frame[super::eth::LEN..super::eth::LEN + MIN_LEN]);
        Head(h)
    }

    #[inline(always)]
    pub fn version(&self) -> u8 {
        self.0[VER_IHL] >> 4
    }

    /// The header's length in bytes, options included.
    #[inline(always)]
    pub fn header_len(&self) -> usize {
        ((self.0[VER_IHL] & 0x0f) as usize) * 4
    }

    #[inline(always)]
    pub fn total_len(&self) -> u16 {
        super::be16_at(&self.0, TOT_LEN)
    }

    #[inline(always)]
    pub fn id(&self) -> u16 {
        super::be16_at(&self.0, ID)
    }

    /// A fragment other than the first: no L4 header.
    #[inline(always)]
    pub fn is_later_fragment(&self) -> bool {
        super::be16_at(&self.0, FRAG_OFF) & OFFSET_MASK != 0
    }

    #[inline(always)]
    pub fn has_more_fragments(&self) -> bool {
        super::be16_at(&self.0, FRAG_OFF) & MF != 0
    }

    #[inline(always)]
    pub fn proto(&self) -> u8 {
        self.0[PROTO]
    }

    #[inline(always)]
    pub fn saddr(&self) -> [u8; 4] {
        [self.0[SADDR], self.0[SADDR + 1], self.0[SADDR + 2], self.0[SADDR + 3]]
    }

    #[inline(always)]
    pub fn daddr(&self) -> [u8; 4] {
        [self.0[DADDR], self.0[DADDR + 1], self.0[DADDR + 2], self.0[DADDR + 3]]
    }
}
