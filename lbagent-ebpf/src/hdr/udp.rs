//! UDP (RFC 768), and the two protocols whose checksum sits where UDP's
//! does and covers the same pseudo header: UDP-Lite (RFC 3828) and DCCP
//! (RFC 4340).

pub const SPORT: usize = 0;
pub const DPORT: usize = 2;
pub const CSUM: usize = 6;
pub const LEN: usize = 8;
/// UDP-Lite's checksum (a 0 there is invalid, not "none").
pub const UDPLITE_CSUM: usize = 6;
pub const DCCP_CSUM: usize = 6;
