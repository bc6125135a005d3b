//! TCP (RFC 9293).

pub const SPORT: usize = 0;
pub const DPORT: usize = 2;
pub const SEQ: usize = 4;
/// Data offset: the header's length in 32-bit words (high nibble).
pub const DOFF: usize = 12;
pub const FLAGS: usize = 13;
pub const WINDOW: usize = 14;
pub const CSUM: usize = 16;
/// A header without options.
pub const MIN_LEN: usize = 20;

pub const FIN: u8 = 0x01;
pub const SYN: u8 = 0x02;
pub const RST: u8 = 0x04;
pub const ACK: u8 = 0x10;

/// Option kinds.
pub const OPT_EOL: u8 = 0;
pub const OPT_NOP: u8 = 1;
pub const OPT_WSCALE: u8 = 3;
/// The largest window-scale shift (RFC 7323).
pub const WSCALE_MAX: u8 = 14;
