//! Incremental Internet checksum update (RFC 1624), for checksum fields the
//! kernel helpers cannot reach (headers embedded in ICMP errors) or that the
//! program writes itself (the IPv4 header in the one-store rewrite), and the
//! precomputed differences the helpers take (`bpf_l4_csum_replace` with
//! size 0).
//!
//! Words are taken in memory order (`u16::from_ne_bytes` of the wire bytes):
//! the one's-complement sum is byte-order independent, so no swaps are needed.

/// Folds a 32-bit one's-complement accumulator into 16 bits.
#[inline(always)]
pub fn fold(mut sum: u32) -> u16 {
    sum = (sum & 0xffff) + (sum >> 16);
    sum = (sum & 0xffff) + (sum >> 16);
    sum as u16
}

/// The difference a 16-bit word changing from `old` to `new` makes to a
/// checksum, unfolded (differences add up: sum them, then `apply`).
#[inline(always)]
pub fn diff16(old: u16, new: u16) -> u32 {
    (!old) as u32 + new as u32
}

/// The same for a 4-byte field (two words).
#[inline(always)]
pub fn diff32(old: [u8; 4], new: [u8; 4]) -> u32 {
    diff16(u16::from_ne_bytes([old[0], old[1]]), u16::from_ne_bytes([new[0], new[1]]))
        + diff16(u16::from_ne_bytes([old[2], old[3]]), u16::from_ne_bytes([new[2], new[3]]))
}

/// Checksum `check` after changes adding up to `diff` (RFC 1624, eqn. 3:
/// HC' = ~(~HC + ~m + m')).
#[inline(always)]
pub fn apply(check: u16, diff: u32) -> u16 {
    !fold((!check) as u32 + diff)
}

/// New checksum after a 16-bit word changes from `old` to `new`.
#[inline(always)]
pub fn replace16(check: u16, old: u16, new: u16) -> u16 {
    apply(check, diff16(old, new))
}

/// New checksum after a 4-byte field (e.g. an address) changes.
#[inline(always)]
pub fn replace32(check: u16, old: [u8; 4], new: [u8; 4]) -> u16 {
    let c = replace16(check, u16::from_ne_bytes([old[0], old[1]]), u16::from_ne_bytes([new[0], new[1]]));
    replace16(c, u16::from_ne_bytes([old[2], old[3]]), u16::from_ne_bytes([new[2], new[3]]))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Reference: full checksum over a buffer of bytes.
    fn full(bytes: &[u8]) -> u16 {
        let mut sum = 0u32;
        for c in bytes.chunks(2) {
            sum += u16::from_ne_bytes([c[0], *c.get(1).unwrap_or(&0)]) as u32;
        }
        !fold(sum)
    }

    #[test]
    fn incremental_matches_full_recompute() {
        let mut hdr = [0x45u8, 0, 0, 28, 0x12, 0x34, 0, 0, 64, 17, 0, 0, 10, 0, 1, 2, 198, 51, 100, 10];
        let c = full(&hdr);
        hdr[10..12].copy_from_slice(&c.to_ne_bytes());
        assert_eq!(full(&hdr), 0);
        let old = [198, 51, 100, 10];
        let new = [10, 0, 2, 2];
        let c2 = replace32(c, old, new);
        hdr[16..20].copy_from_slice(&new);
        hdr[10..12].copy_from_slice(&[0, 0]);
        assert_eq!(c2, full(&hdr));
        let c3 = replace16(c2, u16::from_ne_bytes([0x12, 0x34]), u16::from_ne_bytes([0xff, 0xff]));
        hdr[4..6].copy_from_slice(&[0xff, 0xff]);
        assert_eq!(c3, full(&hdr));
    }

    /// Several changes summed as differences, applied once, give what
    /// applying them one by one and a full recompute give.
    #[test]
    fn summed_differences_match_full_recompute() {
        let mut hdr = [0x45u8, 0, 0, 40, 0x12, 0x34, 0, 0, 64, 6, 0, 0, 10, 0, 1, 2, 198, 51, 100, 10];
        let c = full(&hdr);
        let (src, dst) = ([203, 0, 113, 7], [10, 0, 2, 2]);
        let ttl = diff16(u16::from_ne_bytes([64, 6]), u16::from_ne_bytes([63, 6]));
        let d = ttl + diff32([10, 0, 1, 2], src) + diff32([198, 51, 100, 10], dst);
        hdr[8] = 63;
        hdr[12..16].copy_from_slice(&src);
        hdr[16..20].copy_from_slice(&dst);
        assert_eq!(apply(c, d), full(&hdr));
        assert_eq!(
            apply(c, d),
            replace32(
                replace32(replace16(c, u16::from_ne_bytes([64, 6]), u16::from_ne_bytes([63, 6])), [10, 0, 1, 2], src),
                [198, 51, 100, 10],
                dst
            )
        );
    }
}
