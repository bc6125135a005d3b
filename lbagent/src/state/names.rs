//! Syntax of the strings the agent turns into kernel and OVS objects, and
//! the address/CIDR parsers validation and plumbing share.

use std::net::Ipv4Addr;

/// Interface names: 1–15 chars of `[A-Za-z0-9_-]`, not starting with `-`.
pub fn check_ifname(s: &str) -> Result<(), String> {
    if s.is_empty() || s.len() > 15 {
        return Err(format!("{s:?}: interface names have 1 to 15 characters"));
    }
    if !s.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-') {
        return Err(format!("{s:?}: interface names use only letters, digits, '_' and '-'"));
    }
    not_an_option(s)
}

/// Object ids and names that become part of namespace/link names.
pub fn check_id(s: &str, min: usize, max: usize) -> Result<(), String> {
    if s.len() < min || s.len() > max {
        return Err(format!("{s:?}: must have {min} to {max} characters"));
    }
    if !s.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_') {
        return Err(format!("{s:?}: only letters, digits, '-' and '_' are allowed"));
    }
    not_an_option(s)
}

/// Names reach command lines (`ovs-vsctl br-exists <bridge>`, `add-port
/// <bridge> <port>`) and link names as whole arguments: one that starts
/// with `-` would be read as an option there.
fn not_an_option(s: &str) -> Result<(), String> {
    if s.starts_with('-') {
        return Err(format!("{s:?} starts with '-' (it would read as an option on a command line)"));
    }
    Ok(())
}

/// Unicode format characters (general category Cf, Unicode 15): bidi
/// embeddings, overrides and isolates, zero-width spaces and joiners, the
/// byte order mark, invisible operators, tag characters.
const FORMAT_CHARS: [(u32, u32); 21] = [
    (0x00AD, 0x00AD),
    (0x0600, 0x0605),
    (0x061C, 0x061C),
    (0x06DD, 0x06DD),
    (0x070F, 0x070F),
    (0x0890, 0x0891),
    (0x08E2, 0x08E2),
    (0x180E, 0x180E),
    (0x200B, 0x200F),
    (0x202A, 0x202E),
    (0x2060, 0x2064),
    (0x2066, 0x206F),
    (0xFEFF, 0xFEFF),
    (0xFFF9, 0xFFFB),
    (0x110BD, 0x110BD),
    (0x110CD, 0x110CD),
    (0x13430, 0x1343F),
    (0x1BCA0, 0x1BCA3),
    (0x1D173, 0x1D17A),
    (0xE0001, 0xE0001),
    (0xE0020, 0xE007F),
];

/// Whether `c` is a format character (general category Cf).
pub fn is_format_char(c: char) -> bool {
    let c = c as u32;
    FORMAT_CHARS.iter().any(|(lo, hi)| (*lo..=*hi).contains(&c))
}

/// Free text an operator reads back (a load balancer's `name`, shown by
/// `lbagent status` and in logs): at most `max` characters, none that
/// hides or reorders what is shown: control characters (Cc), line and
/// paragraph separators, format characters (Cf: bidi controls such as
/// U+202E, zero-width characters such as U+200B).
pub fn check_free_text(s: &str, max: usize) -> Result<(), String> {
    if s.chars().count() > max {
        return Err(format!("names have at most {max} characters"));
    }
    if let Some(c) = s.chars().find(|c| c.is_control() || matches!(c, '\u{2028}' | '\u{2029}')) {
        return Err(format!("control character U+{:04X}: names have no control characters", c as u32));
    }
    if let Some(c) = s.chars().find(|c| is_format_char(*c)) {
        return Err(format!(
            "format character U+{:04X}: names have no invisible or bidi control characters (Unicode Cf)",
            c as u32
        ));
    }
    Ok(())
}

/// A dotted-quad IPv4 address (no leading zeros, no other forms).
pub fn parse_ip(s: &str) -> Result<Ipv4Addr, String> {
    let ip: Ipv4Addr = s.parse().map_err(|_| format!("{s:?} is not an IPv4 address"))?;
    Ok(ip)
}

/// `a.b.c.d/len` or a bare address (= /32). Host bits must be zero.
pub fn parse_cidr(s: &str) -> Result<(Ipv4Addr, u8), String> {
    let (addr, len) = match s.split_once('/') {
        Some((a, l)) => {
            let len: u8 = l
                .parse()
                .ok()
                .filter(|n| *n <= 32 && l.bytes().all(|b| b.is_ascii_digit()))
                .ok_or_else(|| format!("{s:?}: prefix length must be 0 to 32"))?;
            (a, len)
        }
        None => (s, 32),
    };
    let ip = parse_ip(addr).map_err(|_| format!("{s:?} is not an IPv4 CIDR"))?;
    if u32::from(ip) & !mask(len) != 0 {
        return Err(format!(
            "{s:?} has host bits set (did you mean {}/{len}?)",
            Ipv4Addr::from(u32::from(ip) & mask(len))
        ));
    }
    Ok((ip, len))
}

/// A unicast host address a tenant may use: not `0.0.0.0/8`, loopback,
/// link-local (the agent's own `169.254/16` plumbing lives there),
/// multicast, reserved (`240/4`) or broadcast.
pub fn check_host_class(ip: Ipv4Addr) -> Result<(), String> {
    let class = match ip.octets() {
        [0, ..] => Some("in 0.0.0.0/8 (\"this network\")"),
        [127, ..] => Some("a loopback address"),
        [169, 254, ..] => Some("a link-local address"),
        [224..=239, ..] => Some("a multicast address"),
        [255, 255, 255, 255] => Some("the broadcast address"),
        [240..=255, ..] => Some("a reserved (240.0.0.0/4) address"),
        _ => None,
    };
    match class {
        Some(c) => Err(format!("{ip} is {c}")),
        None => Ok(()),
    }
}

/// `ip` as a host of `net/len`: of the right class and, on subnets with
/// more than two addresses, neither the network nor the broadcast address.
pub fn check_host_in(ip: Ipv4Addr, net: Ipv4Addr, len: u8) -> Result<(), String> {
    check_host_class(ip)?;
    if len <= 30 {
        let m = mask(len);
        let host = u32::from(ip) & !m;
        let base = Ipv4Addr::from(u32::from(net) & m);
        if host == 0 {
            return Err(format!("{ip} is the network address of {base}/{len}"));
        }
        if host == !m {
            return Err(format!("{ip} is the broadcast address of {base}/{len}"));
        }
    }
    Ok(())
}

/// A routable network prefix: its address is not of a special class.
pub fn check_net_class((net, len): (Ipv4Addr, u8)) -> Result<(), String> {
    if len == 0 {
        return Ok(());
    }
    check_host_class(net).map_err(|e| format!("{net}/{len}: {e}"))
}

/// Whether two prefixes overlap.
pub fn overlaps((a, al): (Ipv4Addr, u8), (b, bl): (Ipv4Addr, u8)) -> bool {
    let l = al.min(bl);
    in_subnet(a, b, l)
}

pub fn mask(len: u8) -> u32 {
    if len == 0 { 0 } else { u32::MAX << (32 - len.min(32) as u32) }
}

pub fn in_subnet(ip: Ipv4Addr, net: Ipv4Addr, len: u8) -> bool {
    u32::from(ip) & mask(len) == u32::from(net) & mask(len)
}

/// A unicast MAC `aa:bb:cc:dd:ee:ff`.
pub fn parse_mac(s: &str) -> Result<[u8; 6], String> {
    let parts: Vec<&str> = s.split(':').collect();
    let bad = || format!("{s:?} is not a MAC address like 02:00:0a:0a:00:05");
    if parts.len() != 6 {
        return Err(bad());
    }
    let mut mac = [0u8; 6];
    for (i, p) in parts.iter().enumerate() {
        // Two hex digits: `from_str_radix` alone would take `+5`.
        if p.len() != 2 || !p.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Err(bad());
        }
        mac[i] = u8::from_str_radix(p, 16).map_err(|_| bad())?;
    }
    if mac[0] & 1 != 0 {
        return Err(format!("{s:?} is a multicast MAC"));
    }
    if mac == [0; 6] {
        return Err(format!("{s:?} is the zero MAC"));
    }
    Ok(mac)
}
