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

/// Binds one UDP socket per local port in `ports`, sends from each to `to`,
/// and returns what the server reported for each (its view of the sender).
/// Every socket must get exactly its own answer.
pub fn udp_many(ns: &str, to: SocketAddr, ports: std::ops::Range<u16>) -> Result<Vec<String>> {
    spawn_in(ns, move || {
        let socks: Vec<UdpSocket> =
            ports.clone().map(|p| UdpSocket::bind((Ipv4Addr::UNSPECIFIED, p))).collect::<Result<_, _>>()?;
        for s in &socks {
            s.set_read_timeout(Some(Duration::from_secs(5)))?;
            s.send_to(b"who am i", to)?;
        }
        let mut out = Vec::new();
        for s in &socks {
            let mut buf = [0u8; 256];
            let (n, from) = s
                .recv_from(&mut buf)
                .with_context(|| format!("reply to local port {}", s.local_addr().unwrap().port()))?;
            ensure!(from == to, "reply from {from}, expected {to}");
            out.push(String::from_utf8_lossy(&buf[..n]).into_owned());
        }
        Ok(out)
    })
    .join()
    .map_err(|_| anyhow::anyhow!("client thread panicked"))?
}

/// A TCP connection kept open: each `ping` sends a line and expects it back.
pub struct OpenConn {
    tx: std::sync::mpsc::Sender<Option<String>>,
    rx: std::sync::mpsc::Receiver<Result<String>>,
}

impl OpenConn {
    /// Connects from `ns` to `to`, where a `line_echo_server` answers.
    pub fn open(ns: &str, to: SocketAddr) -> Result<OpenConn> {
        Self::open_with(ns, to, None)
    }

    /// Like `open`, from the local address and port `from`.
    pub fn open_from(ns: &str, from: SocketAddr, to: SocketAddr) -> Result<OpenConn> {
        Self::open_with(ns, to, Some(from))
    }

    fn open_with(ns: &str, to: SocketAddr, from: Option<SocketAddr>) -> Result<OpenConn> {
        let (tx, crx) = std::sync::mpsc::channel::<Option<String>>();
        let (ctx, rx) = std::sync::mpsc::channel();
        spawn_in(ns, move || {
            let s = match from {
                None => TcpStream::connect_timeout(&to, Duration::from_secs(5)),
                Some(from) => connect_from(from, to),
            };
            let mut s = match s {
                Ok(s) => {
                    ctx.send(Ok("connected".into())).ok();
                    s
                }
                Err(e) => {
                    ctx.send(Err(e.into())).ok();
                    return Ok(());
                }
            };
            s.set_read_timeout(Some(Duration::from_secs(3)))?;
            let mut r = std::io::BufReader::new(s.try_clone()?);
            while let Ok(Some(line)) = crx.recv() {
                let res = (|| {
                    s.write_all(format!("{line}\n").as_bytes())?;
                    let mut back = String::new();
                    std::io::BufRead::read_line(&mut r, &mut back)?;
                    ensure!(!back.is_empty(), "connection closed");
                    Ok(back.trim().to_string())
                })();
                ctx.send(res).ok();
            }
            Ok(())
        });
        let first = rx.recv_timeout(Duration::from_secs(10)).context("connect timed out")??;
        ensure!(first == "connected");
        Ok(OpenConn { tx, rx })
    }

    pub fn ping(&self, line: &str) -> Result<String> {
        self.tx.send(Some(line.to_string()))?;
        self.rx.recv_timeout(Duration::from_secs(10)).context("no answer")?
    }

    /// Sends one line without waiting for its answer ([`OpenConn::answer`]).
    pub fn send(&self, line: &str) -> Result<()> {
        Ok(self.tx.send(Some(line.to_string()))?)
    }

    /// The answer to the line [`OpenConn::send`] sent.
    pub fn answer(&self) -> Result<String> {
        self.rx.recv_timeout(Duration::from_secs(10)).context("no answer")?
    }

    /// `ping` on every connection at once (a dead one waits out its read
    /// timeout: one after the other, hundreds would take minutes).
    pub fn ping_all(conns: &[OpenConn], line: &str) -> Vec<Result<String>> {
        let sent: Vec<Result<()>> =
            conns.iter().map(|c| c.tx.send(Some(line.to_string())).map_err(anyhow::Error::from)).collect();
        conns
            .iter()
            .zip(sent)
            .map(|(c, sent)| sent.and_then(|()| c.rx.recv_timeout(Duration::from_secs(10)).context("no answer")?))
            .collect()
    }
}

impl Drop for OpenConn {
    fn drop(&mut self) {
        let _ = self.tx.send(None);
    }
}

/// A UDP flow kept open: one socket, so every `ask` travels the same
/// 5-tuple (and, through SNAT, must keep the same translated port).
pub struct UdpFlow {
    tx: std::sync::mpsc::Sender<Option<String>>,
    rx: std::sync::mpsc::Receiver<Result<String>>,
}

impl UdpFlow {
    /// A socket in `ns` on local port `port` (0: an ephemeral one),
    /// connected to `to`.
    pub fn open(ns: &str, port: u16, to: SocketAddr) -> Result<UdpFlow> {
        let (tx, crx) = std::sync::mpsc::channel::<Option<String>>();
        let (ctx, rx) = std::sync::mpsc::channel();
        spawn_in(ns, move || {
            let s = UdpSocket::bind((Ipv4Addr::UNSPECIFIED, port))?;
            s.connect(to)?;
            s.set_read_timeout(Some(Duration::from_secs(2)))?;
            let mut buf = [0u8; 2048];
            while let Ok(Some(line)) = crx.recv() {
                let res = (|| {
                    s.send(line.as_bytes())?;
                    let n = s.recv(&mut buf)?;
                    Ok(String::from_utf8_lossy(&buf[..n]).into_owned())
                })();
                ctx.send(res).ok();
            }
            Ok(())
        });
        Ok(UdpFlow { tx, rx })
    }

    /// Sends one datagram; the answer (a lost one is an error after 2 s).
    pub fn ask(&self, line: &str) -> Result<String> {
        self.tx.send(Some(line.to_string()))?;
        self.rx.recv_timeout(Duration::from_secs(10)).context("client thread gone")?
    }
}

impl Drop for UdpFlow {
    fn drop(&mut self) {
        let _ = self.tx.send(None);
    }
}

/// A blocking TCP connection from the bound address `from` to `to` (IPv4).
fn connect_from(from: SocketAddr, to: SocketAddr) -> std::io::Result<TcpStream> {
    use std::os::fd::FromRawFd;
    let sockaddr = |a: SocketAddr| {
        let SocketAddr::V4(a) = a else { unreachable!("IPv4 only") };
        libc::sockaddr_in {
            sin_family: libc::AF_INET as libc::sa_family_t,
            sin_port: a.port().to_be(),
            sin_addr: libc::in_addr { s_addr: u32::from(*a.ip()).to_be() },
            sin_zero: [0; 8],
        }
    };
    let len = std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t;
    // SAFETY: plain socket calls on a fresh fd with valid sockaddr_in values;
    // the fd is owned by the TcpStream (or closed) on every path.
    unsafe {
        let fd = libc::socket(libc::AF_INET, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0);
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        let stream = TcpStream::from_raw_fd(fd);
        let one: libc::c_int = 1;
        libc::setsockopt(fd, libc::SOL_SOCKET, libc::SO_REUSEADDR, (&one as *const libc::c_int).cast(), 4);
        let (f, t) = (sockaddr(from), sockaddr(to));
        if libc::bind(fd, (&f as *const libc::sockaddr_in).cast(), len) != 0
            || libc::connect(fd, (&t as *const libc::sockaddr_in).cast(), len) != 0
        {
            return Err(std::io::Error::last_os_error());
        }
        Ok(stream)
    }
}

/// TCP server in `ns` running `conn` on a thread per accepted connection;
/// it runs until the process ends (tests own their namespaces, which go away).
fn tcp_server(ns: &str, port: u16, conn: impl Fn(TcpStream, String) + Send + Clone + 'static) -> Result<()> {
    let (tx, rx) = std::sync::mpsc::channel();
    spawn_in(ns, move || {
        let l = TcpListener::bind(("0.0.0.0", port))?;
        tx.send(()).ok();
        for s in l.incoming() {
            let Ok(s) = s else { continue };
            let peer = s.peer_addr().map(|p| p.to_string()).unwrap_or_default();
            let conn = conn.clone();
            std::thread::spawn(move || conn(s, peer));
        }
        Ok(())
    });
    rx.recv_timeout(Duration::from_secs(5)).context("server did not start")?;
    Ok(())
}

/// TCP server answering each line with `<tag> <peer>`.
pub fn line_echo_server(ns: &str, port: u16, tag: &str) -> Result<()> {
    let tag = tag.to_string();
    tcp_server(ns, port, move |mut s, peer| {
        let mut r = std::io::BufReader::new(s.try_clone().unwrap());
        let mut line = String::new();
        while matches!(std::io::BufRead::read_line(&mut r, &mut line), Ok(n) if n > 0) {
            if s.write_all(format!("{tag} {peer}\n").as_bytes()).is_err() {
                break;
            }
            line.clear();
        }
    })
}

/// TCP sink: reads each connection to its end, then answers with the
/// number of bytes it read (`<n>\n`).
pub fn tcp_bulk_server(ns: &str, port: u16) -> Result<()> {
    tcp_server(ns, port, move |mut s, _| {
        let mut buf = vec![0u8; 1 << 16];
        let mut n = 0usize;
        while let Ok(k) = s.read(&mut buf) {
            if k == 0 {
                break;
            }
            n += k;
        }
        let _ = s.write_all(format!("{n}\n").as_bytes());
    })
}

/// Sends `len` bytes from `ns` to a `tcp_bulk_server` at `to` in large
/// writes (a TSO sender's 64 KB packets), then half-closes; returns the
/// byte count the server read (within 60 s).
pub fn tcp_bulk_send(ns: &str, to: SocketAddr, len: usize) -> Result<usize> {
    spawn_in(ns, move || {
        let mut s = TcpStream::connect_timeout(&to, Duration::from_secs(5))?;
        s.set_write_timeout(Some(Duration::from_secs(60)))?;
        s.set_read_timeout(Some(Duration::from_secs(60)))?;
        let chunk = vec![0x5au8; 1 << 16];
        let mut left = len;
        while left > 0 {
            let k = left.min(chunk.len());
            s.write_all(&chunk[..k]).context("sending")?;
            left -= k;
        }
        s.shutdown(std::net::Shutdown::Write)?;
        let mut answer = String::new();
        s.read_to_string(&mut answer).context("waiting for the server's count")?;
        answer.trim().parse::<usize>().with_context(|| format!("server answered {answer:?}"))
    })
    .join()
    .map_err(|_| anyhow::anyhow!("sender thread panicked"))?
}

/// One request on a fresh connection: returns the server's `<tag> <peer>`.
pub fn ask_tcp(ns: &str, to: SocketAddr) -> Result<String> {
    OpenConn::open(ns, to)?.ping("hello")
}

/// UDP server answering forever with the sender's address.
pub fn udp_echo_forever(ns: &str, port: u16) -> Result<()> {
    udp_answer_forever(ns, port, |peer| peer.to_string())
}

/// UDP server answering every datagram, forever, with `<tag> <sender>`
/// (which backend answered, as `line_echo_server` does for TCP).
pub fn udp_tag_forever(ns: &str, port: u16, tag: &str) -> Result<()> {
    let tag = tag.to_string();
    udp_answer_forever(ns, port, move |peer| format!("{tag} {peer}"))
}

/// UDP server answering every datagram, forever, with `answer(sender)`.
fn udp_answer_forever(ns: &str, port: u16, answer: impl Fn(SocketAddr) -> String + Send + 'static) -> Result<()> {
    let (tx, rx) = std::sync::mpsc::channel();
    spawn_in(ns, move || {
        let s = UdpSocket::bind(("0.0.0.0", port))?;
        tx.send(()).ok();
        let mut buf = [0u8; 2048];
        loop {
            let (_, peer) = s.recv_from(&mut buf)?;
            s.send_to(answer(peer).as_bytes(), peer)?;
        }
        #[allow(unreachable_code)]
        Ok::<(), anyhow::Error>(())
    });
    rx.recv_timeout(Duration::from_secs(5)).context("server did not start")?;
    Ok(())
}

/// One datagram from a fresh socket bound to address `from` (port chosen
/// by the kernel: a new flow each time); returns the answer.
pub fn udp_ask_from(ns: &str, from: Ipv4Addr, to: SocketAddr) -> Result<String> {
    spawn_in(ns, move || {
        let s = UdpSocket::bind((from, 0))?;
        s.set_read_timeout(Some(Duration::from_secs(5)))?;
        s.send_to(b"who am i", to)?;
        let mut buf = [0u8; 256];
        let (n, _) = s.recv_from(&mut buf)?;
        Ok(String::from_utf8_lossy(&buf[..n]).into_owned())
    })
    .join()
    .map_err(|_| anyhow::anyhow!("client thread panicked"))?
}

/// UDP server answering every datagram, forever, with `<sender>\n` and the
/// datagram's bytes: a large datagram comes back as large (fragmented both ways).
pub fn udp_big_echo_forever(ns: &str, port: u16) -> Result<()> {
    let (tx, rx) = std::sync::mpsc::channel();
    spawn_in(ns, move || {
        let s = UdpSocket::bind(("0.0.0.0", port))?;
        tx.send(()).ok();
        let mut buf = vec![0u8; 65536];
        loop {
            let (n, peer) = s.recv_from(&mut buf)?;
            let mut answer = format!("{peer}\n").into_bytes();
            answer.extend_from_slice(&buf[..n]);
            s.send_to(&answer, peer)?;
        }
        #[allow(unreachable_code)]
        Ok::<(), anyhow::Error>(())
    });
    rx.recv_timeout(Duration::from_secs(5)).context("server did not start")?;
    Ok(())
}

/// Client of `udp_big_echo_forever`: sends one `len`-byte datagram, checks
/// the bytes that come back; returns (server's view of us, reply source).
pub fn udp_big_ask(ns: &str, to: SocketAddr, len: usize) -> Result<(String, SocketAddr)> {
    spawn_in(ns, move || {
        let s = UdpSocket::bind((Ipv4Addr::UNSPECIFIED, 0))?;
        s.set_read_timeout(Some(Duration::from_secs(5)))?;
        let data: Vec<u8> = (0..len).map(|i| (i * 13 + i / 253) as u8).collect();
        s.send_to(&data, to)?;
        let mut buf = vec![0u8; 65536];
        let (n, from) = s.recv_from(&mut buf).context("no answer to the large datagram")?;
        let nl = buf[..n].iter().position(|b| *b == b'\n').context("no peer line")?;
        ensure!(buf[nl + 1..n] == data[..], "answer differs ({} of {len} bytes back)", n - nl - 1);
        Ok((String::from_utf8_lossy(&buf[..nl]).into_owned(), from))
    })
    .join()
    .map_err(|_| anyhow::anyhow!("client thread panicked"))?
}

/// A raw IPv4 socket for protocol `proto` (the kernel writes the IP header;
/// reads return it).
fn raw_socket(proto: u8) -> Result<std::os::fd::OwnedFd> {
    use std::os::fd::FromRawFd;
    // SAFETY: socket() returns a fresh fd or -1; the fd is owned at once.
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_RAW | libc::SOCK_CLOEXEC, proto as libc::c_int) };
    ensure!(fd >= 0, "raw socket: {}", std::io::Error::last_os_error());
    // SAFETY: fd is a valid, unowned descriptor.
    let fd = unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) };
    let tv = libc::timeval { tv_sec: 3, tv_usec: 0 };
    // SAFETY: setsockopt reads a valid timeval of the given size.
    unsafe {
        libc::setsockopt(
            std::os::fd::AsRawFd::as_raw_fd(&fd),
            libc::SOL_SOCKET,
            libc::SO_RCVTIMEO,
            (&tv as *const libc::timeval).cast(),
            std::mem::size_of::<libc::timeval>() as libc::socklen_t,
        );
    }
    Ok(fd)
}

fn raw_send(fd: &std::os::fd::OwnedFd, to: Ipv4Addr, payload: &[u8]) -> Result<()> {
    let sa = libc::sockaddr_in {
        sin_family: libc::AF_INET as libc::sa_family_t,
        sin_port: 0,
        sin_addr: libc::in_addr { s_addr: u32::from(to).to_be() },
        sin_zero: [0; 8],
    };
    // SAFETY: sendto reads `payload` and a valid sockaddr_in.
    let n = unsafe {
        libc::sendto(
            std::os::fd::AsRawFd::as_raw_fd(fd),
            payload.as_ptr().cast(),
            payload.len(),
            0,
            (&sa as *const libc::sockaddr_in).cast(),
            std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t,
        )
    };
    ensure!(n == payload.len() as isize, "raw sendto: {}", std::io::Error::last_os_error());
    Ok(())
}

/// Receives one packet whose payload starts with `prefix`: (source, payload).
fn raw_recv(fd: &std::os::fd::OwnedFd, prefix: &[u8]) -> Result<(Ipv4Addr, Vec<u8>)> {
    let mut buf = vec![0u8; 65536];
    loop {
        // SAFETY: recv writes at most buf.len() bytes into buf.
        let n = unsafe { libc::recv(std::os::fd::AsRawFd::as_raw_fd(fd), buf.as_mut_ptr().cast(), buf.len(), 0) };
        ensure!(n > 0, "raw recv: {}", std::io::Error::last_os_error());
        let pkt = &buf[..n as usize];
        let ihl = ((pkt[0] & 0x0f) as usize) * 4;
        let src = Ipv4Addr::new(pkt[12], pkt[13], pkt[14], pkt[15]);
        if pkt[ihl..].starts_with(prefix) {
            return Ok((src, pkt[ihl..].to_vec()));
        }
    }
}

/// Answers, forever, every IP-protocol-`proto` packet starting with `ask`
/// with `said <source address seen>`.
pub fn raw_ip_echo_forever(ns: &str, proto: u8) -> Result<()> {
    let (tx, rx) = std::sync::mpsc::channel();
    spawn_in(ns, move || {
        let fd = raw_socket(proto)?;
        tx.send(()).ok();
        loop {
            let Ok((src, _)) = raw_recv(&fd, b"ask") else { continue };
            raw_send(&fd, src, format!("said {src}").as_bytes())?;
        }
        #[allow(unreachable_code)]
        Ok::<(), anyhow::Error>(())
    });
    rx.recv_timeout(Duration::from_secs(5)).context("raw server did not start")?;
    Ok(())
}

/// Sends one IP-protocol-`proto` packet to `to` from `ns`; returns (the
/// source the far end saw, the source of its answer).
pub fn raw_ip_ask(ns: &str, proto: u8, to: Ipv4Addr) -> Result<(String, Ipv4Addr)> {
    spawn_in(ns, move || {
        let fd = raw_socket(proto)?;
        raw_send(&fd, to, b"ask")?;
        let (from, payload) = raw_recv(&fd, b"said ")?;
        Ok((String::from_utf8_lossy(&payload[5..]).into_owned(), from))
    })
    .join()
    .map_err(|_| anyhow::anyhow!("client thread panicked"))?
}

/// Minimal HTTP/1.1 server: every request gets `<tag> <peer>` as its body.
pub fn http_server(ns: &str, port: u16, tag: &str) -> Result<()> {
    let tag = tag.to_string();
    tcp_server(ns, port, move |mut s, peer| {
        let mut r = std::io::BufReader::new(s.try_clone().unwrap());
        let mut line = String::new();
        loop {
            line.clear();
            match std::io::BufRead::read_line(&mut r, &mut line) {
                Ok(0) | Err(_) => return,
                Ok(_) if line == "\r\n" => break,
                Ok(_) => {}
            }
        }
        let body = format!("{tag} {peer}");
        let head = format!("HTTP/1.1 200 OK\r\nContent-Length: {}\r\nConnection: close\r\n\r\n", body.len());
        let _ = s.write_all(format!("{head}{body}").as_bytes());
    })
}

/// `GET /` from `ns`; returns the body.
pub fn http_get(ns: &str, to: SocketAddr) -> Result<String> {
    spawn_in(ns, move || {
        let mut s = TcpStream::connect_timeout(&to, Duration::from_secs(5))?;
        s.set_read_timeout(Some(Duration::from_secs(10)))?;
        s.write_all(format!("GET / HTTP/1.1\r\nHost: {to}\r\nConnection: close\r\n\r\n").as_bytes())?;
        let mut out = String::new();
        s.read_to_string(&mut out)?;
        ensure!(out.starts_with("HTTP/1.1 200"), "unexpected answer: {out:?}");
        Ok(out.split("\r\n\r\n").nth(1).unwrap_or_default().to_string())
    })
    .join()
    .map_err(|_| anyhow::anyhow!("client thread panicked"))?
}

/// Captures ARP frames arriving in `ns` on any interface for `dur`.
pub fn capture_arp(ns: &str, dur: Duration) -> std::thread::JoinHandle<Result<Vec<Vec<u8>>>> {
    spawn_in(ns, move || {
        use nix::sys::socket::{
            AddressFamily, MsgFlags, SockFlag, SockProtocol, SockType, recv, setsockopt, socket, sockopt,
        };
        let fd = socket(AddressFamily::Packet, SockType::Raw, SockFlag::SOCK_CLOEXEC, SockProtocol::EthAll)
            .context("packet socket")?;
        setsockopt(&fd, sockopt::ReceiveTimeout, &nix::sys::time::TimeVal::new(0, 200_000)).context("SO_RCVTIMEO")?;
        let end = std::time::Instant::now() + dur;
        let mut frames = Vec::new();
        while std::time::Instant::now() < end {
            let mut buf = [0u8; 256];
            // Every protocol arrives (nix names no ARP protocol): keep ARP.
            if let Ok(n) = recv(std::os::fd::AsRawFd::as_raw_fd(&fd), &mut buf, MsgFlags::empty())
                && n >= 14
                && buf[12..14] == [0x08, 0x06]
            {
                frames.push(buf[..n].to_vec());
            }
        }
        Ok(frames)
    })
}

/// Sends `frame` out of `ifname` in `ns` as a *non-linear* skb: through a
/// packet socket with a virtio-net header (`PACKET_VNET_HDR`), whose
/// `hdr_len` is how many bytes the kernel puts in the linear area (at least
/// the Ethernet header); the rest goes to page fragments. The kernel only
/// splits frames longer than a page, so `frame` must be (and the link's MTU
/// must allow it).
pub fn send_split(ns: &str, ifname: &str, frame: Vec<u8>, linear: u16) -> Result<()> {
    ensure!(frame.len() > 4096, "a frame of {} bytes would stay linear", frame.len());
    let ifname = ifname.to_string();
    spawn_in(ns, move || {
        use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
        /// `struct virtio_net_hdr` without offloads: `GSO_NONE`, no
        /// checksum to complete; only `hdr_len` (little endian) matters.
        const VNET_HDR_LEN: usize = 10;
        let index = lbagent::netns::ifindex(&ifname)?;
        // SAFETY: plain socket(2) call; the result is checked below.
        let raw = unsafe { libc::socket(libc::AF_PACKET, libc::SOCK_RAW | libc::SOCK_CLOEXEC, 0) };
        ensure!(raw >= 0, "packet socket: {}", std::io::Error::last_os_error());
        // SAFETY: `raw` is a fresh descriptor nothing else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        let on: libc::c_int = 1;
        // SAFETY: setsockopt with a pointer to a live c_int and its size.
        let rc = unsafe {
            libc::setsockopt(
                fd.as_raw_fd(),
                libc::SOL_PACKET,
                libc::PACKET_VNET_HDR,
                (&on as *const libc::c_int).cast(),
                std::mem::size_of::<libc::c_int>() as u32,
            )
        };
        ensure!(rc == 0, "PACKET_VNET_HDR: {}", std::io::Error::last_os_error());
        let mut msg = vec![0u8; VNET_HDR_LEN];
        msg[2..4].copy_from_slice(&linear.to_le_bytes());
        msg.extend_from_slice(&frame);
        // SAFETY: sockaddr_ll is plain old data; zeroed is a valid value.
        let mut to: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
        to.sll_family = libc::AF_PACKET as u16;
        to.sll_ifindex = index as i32;
        to.sll_halen = 6;
        to.sll_addr[..6].copy_from_slice(&frame[..6]);
        // SAFETY: sendto with a live buffer and a sockaddr_ll of the given size.
        let sent = unsafe {
            libc::sendto(
                fd.as_raw_fd(),
                msg.as_ptr().cast(),
                msg.len(),
                0,
                (&to as *const libc::sockaddr_ll).cast(),
                std::mem::size_of::<libc::sockaddr_ll>() as u32,
            )
        };
        ensure!(sent == msg.len() as isize, "sendto: {}", std::io::Error::last_os_error());
        Ok(())
    })
    .join()
    .map_err(|_| anyhow::anyhow!("sender thread panicked"))?
}

/// A UDP probe: one flow from `ns` to a `udp_echo_forever` server, a
/// datagram every `every`, each answer timed. [`UdpProbe::finish`] tells
/// the longest gap between two answers and how many probes went
/// unanswered: what a failover costs a flow.
pub struct UdpProbe {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    done: std::sync::mpsc::Receiver<(Duration, u64, u64, std::collections::BTreeSet<String>)>,
}

/// What a [`UdpProbe`] saw.
#[derive(Debug)]
pub struct ProbeReport {
    pub longest_gap: Duration,
    pub sent: u64,
    pub lost: u64,
    /// Every answer's text (the echo server answers with the sender's
    /// address: one external address and port, if the flow kept it).
    pub seen: std::collections::BTreeSet<String>,
}

impl UdpProbe {
    pub fn start(ns: &str, to: SocketAddr, every: Duration) -> Result<UdpProbe> {
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let (tx, done) = std::sync::mpsc::channel();
        let halt = stop.clone();
        spawn_in(ns, move || {
            let s = UdpSocket::bind((Ipv4Addr::UNSPECIFIED, 0))?;
            s.connect(to)?;
            s.set_read_timeout(Some(every))?;
            let (mut sent, mut answered) = (0u64, 0u64);
            let mut seen = std::collections::BTreeSet::new();
            let mut last: Option<std::time::Instant> = None;
            let mut longest = Duration::ZERO;
            let mut buf = [0u8; 256];
            let mut next = std::time::Instant::now();
            while !halt.load(std::sync::atomic::Ordering::Relaxed) {
                if std::time::Instant::now() >= next {
                    s.send(&sent.to_be_bytes())?;
                    sent += 1;
                    next += every;
                }
                if let Ok(n) = s.recv(&mut buf) {
                    let now = std::time::Instant::now();
                    if let Some(l) = last {
                        longest = longest.max(now - l);
                    }
                    last = Some(now);
                    answered += 1;
                    seen.insert(String::from_utf8_lossy(&buf[..n]).into_owned());
                }
            }
            // Answers still on their way are not lost.
            let until = std::time::Instant::now() + Duration::from_millis(100);
            while std::time::Instant::now() < until {
                if let Ok(n) = s.recv(&mut buf) {
                    answered += 1;
                    seen.insert(String::from_utf8_lossy(&buf[..n]).into_owned());
                }
            }
            tx.send((longest, sent, sent.saturating_sub(answered), seen)).ok();
            Ok(())
        });
        Ok(UdpProbe { stop, done })
    }

    pub fn finish(self) -> ProbeReport {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        let (longest_gap, sent, lost, seen) = self.done.recv_timeout(Duration::from_secs(10)).expect("the probe");
        ProbeReport { longest_gap, sent, lost, seen }
    }
}
