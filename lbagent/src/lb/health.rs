//! Health checks for direct-mode listeners (proxy-mode listeners are checked
//! by haproxy). A prober thread runs each backend's check from inside the
//! load balancer's namespace at its interval; `rise` successes bring a
//! backend up, `fall` failures take it down, and a change re-applies the
//! load balancer so new flows only go to backends that are up (flows already
//! on a backend keep their conntrack entry and drain).

use std::{
    collections::HashMap,
    io::{Read, Write},
    net::{Ipv4Addr, SocketAddr, TcpStream, UdpSocket},
    time::{Duration, Instant},
};

use crate::{
    naming, netns,
    state::spec::{HealthCheckType, Lb, ListenerMode},
};

/// (load balancer id, listener id, backend id).
pub type Key = (String, String, String);

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BackendHealth {
    pub up: bool,
    /// Consecutive results that disagree with `up`.
    streak: u32,
}

impl Default for BackendHealth {
    /// Unknown backends count as up, so a restart never blackholes traffic.
    fn default() -> Self {
        BackendHealth { up: true, streak: 0 }
    }
}

impl BackendHealth {
    /// Records one check result; returns whether `up` changed.
    pub fn observe(&mut self, ok: bool, rise: u32, fall: u32) -> bool {
        if ok == self.up {
            self.streak = 0;
            return false;
        }
        self.streak += 1;
        let needed = if self.up { fall } else { rise };
        if self.streak >= needed.max(1) {
            self.up = ok;
            self.streak = 0;
            return true;
        }
        false
    }
}

#[derive(Default)]
pub struct Health {
    states: HashMap<Key, BackendHealth>,
}

impl Health {
    pub fn is_up(&self, lb: &str, listener: &str, backend: &str) -> bool {
        self.states.get(&(lb.to_string(), listener.to_string(), backend.to_string())).is_none_or(|s| s.up)
    }

    pub fn observe(&mut self, key: &Key, ok: bool, rise: u32, fall: u32) -> bool {
        self.states.entry(key.clone()).or_default().observe(ok, rise, fall)
    }

    /// Forgets backends that are no longer checked.
    pub fn retain(&mut self, keep: &[Key]) {
        self.states.retain(|k, _| keep.contains(k));
    }

    pub fn down(&self) -> Vec<&Key> {
        self.states.iter().filter(|(_, s)| !s.up).map(|(k, _)| k).collect()
    }
}

/// One backend check to run.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Target {
    pub key: Key,
    pub netns: String,
    pub kind: HealthCheckType,
    pub addr: SocketAddr,
    pub interval: Duration,
    pub timeout: Duration,
    pub rise: u32,
    pub fall: u32,
    pub path: String,
    pub expect_status: Option<u16>,
}

/// Every check the applied load balancers ask for (direct listeners only).
pub fn targets<'a>(lbs: impl IntoIterator<Item = &'a Lb>) -> Vec<Target> {
    let mut out = Vec::new();
    for lb in lbs {
        for l in lb.listeners.iter().filter(|l| l.mode == ListenerMode::Direct) {
            let Some(h) = &l.health else { continue };
            for b in &l.group.backends {
                out.push(Target {
                    key: (lb.id.clone(), l.id.clone(), b.id.clone()),
                    netns: naming::lb_netns(&lb.id),
                    kind: h.kind,
                    addr: SocketAddr::from((b.addr, b.port)),
                    interval: Duration::from_secs(h.interval_s as u64),
                    timeout: Duration::from_secs(h.timeout_s as u64),
                    rise: h.rise,
                    fall: h.fall,
                    path: h.path.clone(),
                    expect_status: h.expect_status,
                });
            }
        }
    }
    out
}

/// What one check found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Probe {
    Up,
    Down,
    /// The check could not run here (namespace, sockets, local ports or
    /// memory): says nothing about the backend, which keeps its state.
    LocalError(String),
}

/// Errors that are the prober's own, not the backend's answer.
fn local(e: &std::io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(
            libc::EMFILE
                | libc::ENFILE
                | libc::ENOBUFS
                | libc::ENOMEM
                | libc::EADDRNOTAVAIL
                | libc::EADDRINUSE
                | libc::EACCES
                | libc::EPERM
                | libc::EAFNOSUPPORT
                | libc::EINVAL
        )
    )
}

fn verdict(r: std::io::Result<bool>) -> Probe {
    match r {
        Ok(true) => Probe::Up,
        Ok(false) => Probe::Down,
        Err(e) if local(&e) => Probe::LocalError(e.to_string()),
        Err(_) => Probe::Down,
    }
}

/// Runs one check from inside the load balancer's namespace.
pub fn probe(t: &Target) -> Probe {
    let t = t.clone();
    match netns::run_in(Some(&t.netns.clone()), move || Ok(check(&t))) {
        Ok(p) => p,
        Err(e) => Probe::LocalError(format!("entering the load balancer's namespace: {e:#}")),
    }
}

fn check(t: &Target) -> Probe {
    match t.kind {
        HealthCheckType::Tcp => verdict(TcpStream::connect_timeout(&t.addr, t.timeout).map(|_| true)),
        HealthCheckType::Http => verdict(http(t)),
        HealthCheckType::Udp => verdict(udp(t)),
    }
}

fn http(t: &Target) -> std::io::Result<bool> {
    let mut s = TcpStream::connect_timeout(&t.addr, t.timeout)?;
    s.set_read_timeout(Some(t.timeout))?;
    // Once connected, any failure to get a good answer is the backend's.
    let answer = (|| {
        s.write_all(format!("GET {} HTTP/1.0\r\nHost: {}\r\n\r\n", t.path, t.addr.ip()).as_bytes())?;
        let mut head = [0u8; 12];
        s.read_exact(&mut head)?;
        Ok::<_, std::io::Error>(head)
    })();
    let Ok(head) = answer else { return Ok(false) };
    let status: u16 = std::str::from_utf8(&head[9..12]).ok().and_then(|x| x.parse().ok()).unwrap_or(0);
    Ok(match t.expect_status {
        Some(want) => status == want,
        None => (200..400).contains(&status),
    })
}

/// UDP has no handshake: an ICMP port unreachable (ECONNREFUSED) means down;
/// an answer or silence means up.
fn udp(t: &Target) -> std::io::Result<bool> {
    let s = UdpSocket::bind((Ipv4Addr::UNSPECIFIED, 0))?;
    s.connect(t.addr)?;
    s.set_read_timeout(Some(t.timeout))?;
    s.send(b"lbagent-health")?;
    let mut buf = [0u8; 64];
    Ok(!matches!(s.recv(&mut buf), Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused))
}

/// Schedules checks at each target's interval.
#[derive(Default)]
pub struct Scheduler {
    next: HashMap<Key, Instant>,
}

impl Scheduler {
    /// Targets due now (and reschedules them).
    pub fn due(&mut self, targets: &[Target], now: Instant) -> Vec<Target> {
        self.next.retain(|k, _| targets.iter().any(|t| &t.key == k));
        targets
            .iter()
            .filter(|t| {
                let next = self.next.entry(t.key.clone()).or_insert(now);
                if *next <= now {
                    *next = now + t.interval;
                    true
                } else {
                    false
                }
            })
            .cloned()
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rise_and_fall() {
        let mut h = BackendHealth::default();
        assert!(h.up);
        assert!(!h.observe(false, 2, 3));
        assert!(!h.observe(false, 2, 3));
        assert!(!h.observe(true, 2, 3), "a success resets the failure streak");
        assert!(!h.observe(false, 2, 3));
        assert!(!h.observe(false, 2, 3));
        assert!(h.observe(false, 2, 3), "third failure in a row: down");
        assert!(!h.up);
        assert!(!h.observe(true, 2, 3));
        assert!(h.observe(true, 2, 3), "second success: up");
        assert!(h.up);
    }

    #[test]
    fn scheduler_honours_intervals() {
        let t = Target {
            key: ("lb".into(), "l".into(), "b".into()),
            netns: "x".into(),
            kind: HealthCheckType::Tcp,
            addr: "10.0.0.1:80".parse().unwrap(),
            interval: Duration::from_secs(5),
            timeout: Duration::from_secs(1),
            rise: 1,
            fall: 1,
            path: "/".into(),
            expect_status: None,
        };
        let mut s = Scheduler::default();
        let now = Instant::now();
        assert_eq!(s.due(std::slice::from_ref(&t), now).len(), 1);
        assert!(s.due(std::slice::from_ref(&t), now + Duration::from_secs(1)).is_empty());
        assert_eq!(s.due(&[t], now + Duration::from_secs(5)).len(), 1);
    }
}
