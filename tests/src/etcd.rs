//! Real etcd servers for the fleet tests: Debian's `etcd-server`, each
//! member on free loopback ports with a temporary data dir (never 2379 or
//! the default dir), heartbeat 100 ms / election 1 s (no spurious elections
//! on two busy cores). Members can be stopped and started again on the same
//! data; everything is killed and removed on drop.

use std::{
    path::PathBuf,
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use anyhow::{Context, Result, bail};

struct Member {
    client_port: u16,
    peer_port: u16,
    child: Option<Child>,
}

/// A cluster of one or more members.
pub struct Etcd {
    pub dir: PathBuf,
    members: Vec<Member>,
    /// Mutual TLS on the client URLs (peers stay on loopback plain HTTP).
    pub pki: Option<Pki>,
}

/// Extensions of a client certificate (v3: rustls refuses v1 certificates).
pub const CLIENT: &str = "extendedKeyUsage=clientAuth";

/// A test CA and certificates made with `openssl`: the server's (SAN
/// 127.0.0.1) and clients' whose CN is their etcd user.
pub struct Pki {
    pub dir: PathBuf,
}

impl Pki {
    pub fn new(dir: PathBuf) -> Result<Pki> {
        std::fs::create_dir_all(&dir)?;
        let p = Pki { dir };
        p.openssl(
            &["req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"],
            &["-keyout", "ca-key.pem", "-out", "ca.pem", "-days", "2", "-subj", "/CN=lbagent-test-ca"],
        )?;
        p.issue("server", Some("subjectAltName=IP:127.0.0.1"))?;
        Ok(p)
    }

    fn openssl(&self, a: &[&str], b: &[&str]) -> Result<()> {
        let out = Command::new("openssl").current_dir(&self.dir).args(a).args(b).output().context("openssl")?;
        if !out.status.success() {
            bail!("openssl {a:?} {b:?}: {}", String::from_utf8_lossy(&out.stderr));
        }
        Ok(())
    }

    /// A key and certificate `<cn>.pem` / `<cn>-key.pem` signed by the CA.
    pub fn issue(&self, cn: &str, ext: Option<&str>) -> Result<()> {
        let (key, csr, cert) = (format!("{cn}-key.pem"), format!("{cn}.csr"), format!("{cn}.pem"));
        self.openssl(
            &["req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"],
            &["-keyout", &key, "-out", &csr, "-subj", &format!("/CN={cn}")],
        )?;
        let mut sign = vec!["-in", &csr, "-CA", "ca.pem", "-CAkey", "ca-key.pem", "-CAcreateserial", "-out", &cert];
        sign.extend(["-days", "2"]);
        let extfile = self.dir.join(format!("{cn}.ext"));
        if let Some(ext) = ext {
            std::fs::write(&extfile, format!("{ext}\n"))?;
            sign.extend(["-extfile", extfile.to_str().unwrap()]);
        }
        self.openssl(&["x509", "-req"], &sign)
    }

    pub fn cert(&self, cn: &str) -> PathBuf {
        self.dir.join(format!("{cn}.pem"))
    }
    pub fn key(&self, cn: &str) -> PathBuf {
        self.dir.join(format!("{cn}-key.pem"))
    }
    pub fn ca(&self) -> PathBuf {
        self.dir.join("ca.pem")
    }
}

/// Where member ports are taken from: below Linux's default ephemeral
/// range (32768–60999). A port the kernel handed out with `bind(0)` and that
/// was released again can be given as the source port of any outgoing
/// connection — etcd's own peer dials, etcdctl, the agents — before the
/// member that was meant to listen on it starts, and that member then
/// exits with "address already in use". Ports outside the ephemeral range
/// are only ever taken by an explicit bind.
const PORTS: std::ops::Range<u32> = 20_000..32_000;

/// A loopback port nobody listens on, from [`PORTS`]; each process starts
/// at its own offset and walks on, so tests running side by side never
/// pick the same one.
fn free_port() -> u16 {
    use std::sync::atomic::{AtomicU32, Ordering};
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let span = PORTS.end - PORTS.start;
    let start = std::process::id().wrapping_mul(7919) % span;
    loop {
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        assert!(n < span, "no free loopback port in {PORTS:?}");
        let port = (PORTS.start + (start + n) % span) as u16;
        if std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
}

/// `etcd` on PATH, or a failure under CI (a skip elsewhere).
pub fn available() -> bool {
    let ok = Command::new("etcd").arg("--version").output().is_ok_and(|o| o.status.success());
    if !ok {
        assert!(
            std::env::var_os("CI").is_none_or(|v| v != "true"),
            "etcd missing under CI (setup installs etcd-server)"
        );
        eprintln!("skipped: etcd not installed (`cargo xtask setup`)");
    }
    ok
}

impl Etcd {
    /// A one-member cluster, started and answering.
    pub fn start(tag: &str) -> Result<Etcd> {
        Self::cluster(tag, 1)
    }

    /// An `n`-member cluster, every member started and answering.
    pub fn cluster(tag: &str, n: usize) -> Result<Etcd> {
        Self::make(tag, n, false)
    }

    /// A one-member cluster with mutual TLS on its client URL (clients'
    /// certificate CN is their etcd user once auth is enabled; `ctl` uses
    /// the `root` certificate).
    pub fn start_tls(tag: &str) -> Result<Etcd> {
        Self::make(tag, 1, true)
    }

    fn make(tag: &str, n: usize, tls: bool) -> Result<Etcd> {
        let dir = std::env::temp_dir().join(format!("{tag}-etcd"));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir)?;
        let members =
            (0..n).map(|_| Member { client_port: free_port(), peer_port: free_port(), child: None }).collect();
        let pki = if tls {
            let pki = Pki::new(dir.join("pki"))?;
            pki.issue("root", Some(CLIENT))?;
            Some(pki)
        } else {
            None
        };
        let mut e = Etcd { dir, members, pki };
        for i in 0..n {
            e.spawn(i)?;
        }
        e.wait_healthy()?;
        Ok(e)
    }

    fn spawn(&mut self, i: usize) -> Result<()> {
        let initial: Vec<String> =
            self.members.iter().enumerate().map(|(j, m)| format!("m{j}=http://127.0.0.1:{}", m.peer_port)).collect();
        let m = &self.members[i];
        let peer = format!("http://127.0.0.1:{}", m.peer_port);
        let scheme = if self.pki.is_some() { "https" } else { "http" };
        let client = format!("{scheme}://127.0.0.1:{}", m.client_port);
        let log = std::fs::OpenOptions::new().create(true).append(true).open(self.dir.join(format!("m{i}.log")))?;
        let mut cmd = Command::new("etcd");
        if let Some(p) = &self.pki {
            cmd.arg("--cert-file").arg(p.cert("server")).arg("--key-file").arg(p.key("server"));
            cmd.arg("--trusted-ca-file").arg(p.ca()).arg("--client-cert-auth");
        }
        let child = cmd
            .args(["--name", &format!("m{i}"), "--data-dir"])
            .arg(self.dir.join(format!("m{i}")))
            .args(["--listen-client-urls", &client, "--advertise-client-urls", &client])
            .args(["--listen-peer-urls", &peer, "--initial-advertise-peer-urls", &peer])
            .args(["--initial-cluster", &initial.join(","), "--initial-cluster-state", "new"])
            .args(["--heartbeat-interval", "100", "--election-timeout", "1000"])
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .context("starting etcd")?;
        self.members[i].child = Some(child);
        Ok(())
    }

    fn wait_healthy(&self) -> Result<()> {
        let t = Instant::now();
        while self.ctl(&["endpoint", "health"]).is_err() {
            if t.elapsed() > Duration::from_secs(20) * crate::slowdown() {
                let tails: Vec<String> = (0..self.members.len())
                    .map(|i| {
                        let log = std::fs::read_to_string(self.dir.join(format!("m{i}.log"))).unwrap_or_default();
                        let tail: Vec<&str> = log.lines().rev().take(3).collect();
                        format!("m{i}: {}", tail.into_iter().rev().collect::<Vec<_>>().join(" | "))
                    })
                    .collect();
                bail!("etcd did not become healthy; see the logs in {}\n{}", self.dir.display(), tails.join("\n"));
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        Ok(())
    }

    /// Member `i`'s client endpoint.
    pub fn member_endpoint(&self, i: usize) -> String {
        format!("127.0.0.1:{}", self.members[i].client_port)
    }

    /// The first member's endpoint.
    pub fn endpoint(&self) -> String {
        self.member_endpoint(0)
    }

    /// Every member's endpoint, comma separated.
    pub fn endpoints(&self) -> String {
        (0..self.members.len()).map(|i| self.member_endpoint(i)).collect::<Vec<_>>().join(",")
    }

    fn live(&self) -> String {
        (0..self.members.len())
            .filter(|i| self.members[*i].child.is_some())
            .map(|i| self.member_endpoint(i))
            .collect::<Vec<_>>()
            .join(",")
    }

    /// Starts every stopped member again (same data) and waits until the cluster serves.
    pub fn resume(&mut self) -> Result<()> {
        for i in 0..self.members.len() {
            if self.members[i].child.is_none() {
                self.spawn(i)?;
            }
        }
        self.wait_healthy()
    }

    /// Kills member `i` (its data stays).
    pub fn stop_member(&mut self, i: usize) {
        if let Some(mut c) = self.members[i].child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Kills every member.
    pub fn stop(&mut self) {
        for i in 0..self.members.len() {
            self.stop_member(i);
        }
    }

    /// The index of the current leader (asked of the live members).
    pub fn leader(&self) -> Result<usize> {
        let out = self.ctl(&["endpoint", "status", "-w", "json"])?;
        let v: Vec<serde_json::Value> = serde_json::from_str(&out)?;
        let leader_id = v.first().and_then(|s| s["Status"]["leader"].as_u64()).context("no leader")?;
        let ep = v
            .iter()
            .find(|s| s["Status"]["header"]["member_id"].as_u64() == Some(leader_id))
            .and_then(|s| s["Endpoint"].as_str())
            .context("the leader is not among the live members")?;
        (0..self.members.len()).find(|i| ep.ends_with(&format!(":{}", self.members[*i].client_port))).context("leader")
    }

    /// `etcdctl` against the live members; its stdout.
    pub fn ctl(&self, args: &[&str]) -> Result<String> {
        self.ctl_as("root", args)
    }

    /// `etcdctl` with the client certificate of user `cn` (TLS clusters).
    pub fn ctl_as(&self, cn: &str, args: &[&str]) -> Result<String> {
        let mut cmd = Command::new("etcdctl");
        if let Some(p) = &self.pki {
            cmd.arg("--cacert").arg(p.ca()).arg("--cert").arg(p.cert(cn)).arg("--key").arg(p.key(cn));
        }
        let out = cmd
            .env("ETCDCTL_API", "3")
            .args(["--endpoints", &self.live(), "--command-timeout=3s", "--dial-timeout=1s"])
            .args(args)
            .output()
            .context("etcdctl")?;
        if !out.status.success() {
            bail!("etcdctl {args:?}: {}", String::from_utf8_lossy(&out.stderr).trim());
        }
        Ok(String::from_utf8(out.stdout)?)
    }

    /// The pids of the running members.
    pub fn pids(&self) -> Vec<u32> {
        self.members.iter().filter_map(|m| m.child.as_ref().map(Child::id)).collect()
    }

    /// The store's current revision.
    pub fn revision(&self) -> Result<i64> {
        let out = self.ctl(&["endpoint", "status", "-w", "json"])?;
        let v: serde_json::Value = serde_json::from_str(&out)?;
        v[0]["Status"]["header"]["revision"].as_i64().context("no revision in endpoint status")
    }
}

impl Drop for Etcd {
    fn drop(&mut self) {
        self.stop();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
