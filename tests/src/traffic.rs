//! Real sockets on both ends of a topology: servers that report the peer
//! address they see, and clients that check what they see.

use std::{
    io::{Read, Write},
    net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream, UdpSocket},
    time::Duration,
};

use anyhow::{Context, Result, bail, ensure};

use crate::topology::spawn_in;

/// TCP server in `ns` on `port`: for each of `conns` connections, reads a
/// request of `len` bytes, then answers `<peer addr>\n` followed by the bytes.
pub fn tcp_echo_server(ns: &str, port: u16, conns: usize) -> Result<std::thread::JoinHandle<Result<Vec<SocketAddr>>>> {
    let (tx, rx) = std::sync::mpsc::channel();
    let h = spawn_in(ns, move || {
        let l = TcpListener::bind(("0.0.0.0", port))?;
        tx.send(()).ok();
        let mut peers = Vec::new();
        for _ in 0..conns {
            let (mut s, peer) = l.accept()?;
            s.set_read_timeout(Some(Duration::from_secs(10)))?;
            let mut len = [0u8; 4];
            s.read_exact(&mut len)?;
            let mut buf = vec![0u8; u32::from_be_bytes(len) as usize];
            s.read_exact(&mut buf)?;
            s.write_all(format!("{peer}\n").as_bytes())?;
            s.write_all(&buf)?;
            peers.push(peer);
        }
        Ok(peers)
    });
    rx.recv_timeout(Duration::from_secs(5)).context("server did not start")?;
    Ok(h)
}

/// Client side of `tcp_echo_server`: returns (what the server saw as our
/// address, the peer address our socket sees). Checks the echoed bytes.
pub fn tcp_echo(ns: &str, to: SocketAddr, len: usize) -> Result<(String, SocketAddr)> {
    spawn_in(ns, move || {
        let mut s = TcpStream::connect_timeout(&to, Duration::from_secs(5))?;
        s.set_read_timeout(Some(Duration::from_secs(10)))?;
        let data: Vec<u8> = (0..len).map(|i| (i * 7 + i / 251) as u8).collect();
        s.write_all(&(len as u32).to_be_bytes())?;
        s.write_all(&data)?;
        let mut out = Vec::new();
        s.read_to_end(&mut out)?;
        let nl = out.iter().position(|b| *b == b'\n').context("no peer line")?;
        ensure!(out[nl + 1..] == data[..], "echoed bytes differ ({} of {len} bytes back)", out.len() - nl - 1);
        Ok((String::from_utf8_lossy(&out[..nl]).into_owned(), s.peer_addr()?))
    })
    .join()
    .map_err(|_| anyhow::anyhow!("client thread panicked"))?
}

/// UDP server in `ns`: answers `n` datagrams with the sender's address.
pub fn udp_server(ns: &str, port: u16, n: usize) -> Result<std::thread::JoinHandle<Result<()>>> {
    let (tx, rx) = std::sync::mpsc::channel();
    let h = spawn_in(ns, move || {
        let s = UdpSocket::bind(("0.0.0.0", port))?;
        s.set_read_timeout(Some(Duration::from_secs(10)))?;
        tx.send(()).ok();
        let mut buf = [0u8; 2048];
        for _ in 0..n {
            let (_, peer) = s.recv_from(&mut buf)?;
            s.send_to(peer.to_string().as_bytes(), peer)?;
        }
        Ok(())
    });
    rx.recv_timeout(Duration::from_secs(5)).context("server did not start")?;
    Ok(h)
}

/// Sends one datagram to `to`; returns (server's view of us, reply source).
pub fn udp_ask(ns: &str, to: SocketAddr) -> Result<(String, SocketAddr)> {
    spawn_in(ns, move || {
        let s = UdpSocket::bind((Ipv4Addr::UNSPECIFIED, 0))?;
        s.set_read_timeout(Some(Duration::from_secs(5)))?;
        s.send_to(b"who am i", to)?;
        let mut buf = [0u8; 256];
        let (n, from) = s.recv_from(&mut buf)?;
        Ok((String::from_utf8_lossy(&buf[..n]).into_owned(), from))
    })
    .join()
    .map_err(|_| anyhow::anyhow!("client thread panicked"))?
}

/// Sends to a port nobody listens on through a connected socket: the
/// translated ICMP port unreachable must surface as ECONNREFUSED.
pub fn udp_expect_refused(ns: &str, to: SocketAddr) -> Result<()> {
    spawn_in(ns, move || {
        let s = UdpSocket::bind((Ipv4Addr::UNSPECIFIED, 0))?;
        s.connect(to)?;
        s.set_read_timeout(Some(Duration::from_secs(3)))?;
        s.send(b"anyone?")?;
        let mut buf = [0u8; 64];
        match s.recv(&mut buf) {
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused => Ok(()),
            Err(e) => bail!("expected connection refused, got {e}"),
            Ok(_) => bail!("expected connection refused, got a reply"),
        }
    })
    .join()
    .map_err(|_| anyhow::anyhow!("client thread panicked"))?
}
