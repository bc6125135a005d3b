//! Gratuitous ARP: announce `ip` at `mac` on interface `ifindex`, so
//! neighbours update their caches when an address moves here.

use std::{mem, net::Ipv4Addr};

use anyhow::{Result, bail};

/// The ARP request frame: sender = target = `ip`, broadcast.
pub fn frame(mac: [u8; 6], ip: Ipv4Addr) -> [u8; 42] {
    let mut f = [0u8; 42];
    f[0..6].copy_from_slice(&[0xff; 6]);
    f[6..12].copy_from_slice(&mac);
    f[12..14].copy_from_slice(&[0x08, 0x06]);
    f[14..22].copy_from_slice(&[0, 1, 0x08, 0, 6, 4, 0, 1]);
    f[22..28].copy_from_slice(&mac);
    f[28..32].copy_from_slice(&ip.octets());
    f[32..38].copy_from_slice(&[0; 6]);
    f[38..42].copy_from_slice(&ip.octets());
    f
}

/// Sends one gratuitous ARP (call inside the interface's namespace).
pub fn announce(ifindex: u32, mac: [u8; 6], ip: Ipv4Addr) -> Result<()> {
    let f = frame(mac, ip);
    use nix::sys::socket::{AddressFamily, SockFlag, SockType, socket};
    use std::os::fd::AsRawFd;
    let fd = socket(AddressFamily::Packet, SockType::Raw, SockFlag::SOCK_CLOEXEC, None)
        .map_err(|e| anyhow::anyhow!("packet socket: {e}"))?;
    let sa = libc::sockaddr_ll {
        sll_family: libc::AF_PACKET as u16,
        sll_protocol: 0,
        sll_ifindex: ifindex as i32,
        sll_hatype: 0,
        sll_pkttype: 0,
        sll_halen: 6,
        sll_addr: [0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0, 0],
    };
    // SAFETY: the buffer and the address are valid for the lengths given,
    // and the descriptor is open (owned by `fd`).
    let n = unsafe {
        libc::sendto(
            fd.as_raw_fd(),
            f.as_ptr().cast(),
            f.len(),
            0,
            (&sa as *const libc::sockaddr_ll).cast(),
            mem::size_of::<libc::sockaddr_ll>() as u32,
        )
    };
    if n < 0 {
        bail!("sending gratuitous ARP for {ip}: {}", std::io::Error::last_os_error());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    #[test]
    fn frame_layout() {
        let f = super::frame([2, 0, 0, 0, 0, 1], "198.51.100.10".parse().unwrap());
        assert_eq!(&f[12..14], &[8, 6]);
        assert_eq!(&f[20..22], &[0, 1], "request");
        assert_eq!(&f[28..32], &[198, 51, 100, 10]);
        assert_eq!(&f[38..42], &[198, 51, 100, 10]);
    }
}
