//! ICMP (RFC 792).

pub const TYPE: usize = 0;
pub const CSUM: usize = 2;
/// An echo request's or reply's identifier.
pub const ECHO_ID: usize = 4;
/// The header; an error quotes the offending packet's IPv4 header after it.
pub const LEN: usize = 8;

pub const ECHO_REPLY: u8 = 0;
pub const DEST_UNREACH: u8 = 3;
pub const ECHO_REQUEST: u8 = 8;
pub const TIME_EXCEEDED: u8 = 11;
pub const PARAM_PROBLEM: u8 = 12;
/// The error types the engine translates.
pub const ERRORS: [u8; 3] = [DEST_UNREACH, TIME_EXCEEDED, PARAM_PROBLEM];
