//! Connecting to etcd: endpoints and TLS from the command line, one
//! endpoint at a time (rotating on failure: the client library does not
//! fail over by itself), every request requiring a leader, and a jittered
//! exponential backoff between attempts.
//!
//! Trust is enforced: without a CA, a client certificate and its key the
//! agent and `lbagent fleet` refuse to connect, unless `--etcd-insecure`
//! says plain HTTP is meant (then every connect warns). The TLS files are
//! read again at every connect, so a rotated certificate is used from the
//! next connection on, without a restart.

use std::{
    path::PathBuf,
    time::{Duration, Instant},
};

use anyhow::{Context, Result, bail};
use etcd_client::{Certificate, Client, ConnectOptions, Identity, TlsOptions};

/// `--etcd`, `--etcd-ca`, `--etcd-cert`, `--etcd-key`, `--etcd-insecure`.
#[derive(clap::Args, Clone, Debug, Default)]
pub struct EtcdArgs {
    /// etcd endpoints, comma separated (`host:port`; `https://` is implied
    /// unless `--etcd-insecure`).
    #[arg(long = "etcd", value_delimiter = ',')]
    pub endpoints: Vec<String>,
    /// Client certificate (PEM) for mutual TLS; its CN is the etcd user.
    #[arg(long = "etcd-cert")]
    pub cert: Option<PathBuf>,
    /// Client key (PEM) for `--etcd-cert`.
    #[arg(long = "etcd-key")]
    pub key: Option<PathBuf>,
    /// CA bundle (PEM) that signed the etcd servers' certificates.
    #[arg(long = "etcd-ca")]
    pub ca: Option<PathBuf>,
    /// Talk to etcd over plain HTTP with no client identity (labs and
    /// tests only; every connect logs a warning).
    #[arg(long = "etcd-insecure")]
    pub insecure: bool,
}

/// Where the TLS material lives (read at every connect).
#[derive(Clone, Debug)]
struct TlsFiles {
    ca: PathBuf,
    cert: PathBuf,
    key: PathBuf,
}

impl TlsFiles {
    fn load(&self) -> Result<TlsOptions> {
        let read = |p: &PathBuf, what: &str| {
            std::fs::read(p).with_context(|| format!("--etcd-{what} {}: cannot read", p.display()))
        };
        Ok(TlsOptions::new()
            .ca_certificate(Certificate::from_pem(read(&self.ca, "ca")?))
            .identity(Identity::from_pem(read(&self.cert, "cert")?, read(&self.key, "key")?)))
    }
}

/// A validated connection recipe.
#[derive(Clone)]
pub struct Etcd {
    endpoints: Vec<String>,
    /// `None`: `--etcd-insecure`.
    tls: Option<TlsFiles>,
}

impl Etcd {
    pub fn new(args: &EtcdArgs) -> Result<Etcd> {
        if args.endpoints.is_empty() {
            bail!("--etcd: give at least one endpoint (host:port)");
        }
        let tls = match (&args.ca, &args.cert, &args.key, args.insecure) {
            (None, None, None, true) => None,
            (_, _, _, true) => bail!("--etcd-insecure: cannot be combined with --etcd-ca, --etcd-cert or --etcd-key"),
            (Some(ca), Some(cert), Some(key), false) => {
                let files = TlsFiles { ca: ca.clone(), cert: cert.clone(), key: key.clone() };
                files.load()?;
                Some(files)
            }
            (ca, cert, key, false) => {
                let missing: Vec<&str> = [(ca, "--etcd-ca"), (cert, "--etcd-cert"), (key, "--etcd-key")]
                    .into_iter()
                    .filter(|(v, _)| v.is_none())
                    .map(|(_, n)| n)
                    .collect();
                bail!(
                    "etcd needs mutual TLS: {} missing (give --etcd-ca, --etcd-cert and --etcd-key; \
                     --etcd-insecure allows plain HTTP with no client identity, for labs and tests)",
                    missing.join(", ")
                )
            }
        };
        let mut endpoints = Vec::new();
        for e in &args.endpoints {
            let e = e.trim();
            if e.is_empty() || e.chars().any(|c| c.is_whitespace() || c.is_control()) {
                bail!("--etcd: bad endpoint {e:?}");
            }
            let scheme = if tls.is_some() { "https://" } else { "http://" };
            let url = match e.split_once("://") {
                None => format!("{scheme}{e}"),
                Some(("http", _)) if tls.is_some() => {
                    bail!("--etcd: {e} is plain HTTP but TLS is configured (use https:// or host:port)")
                }
                Some(("https", _)) if tls.is_none() => {
                    bail!("--etcd: {e} is HTTPS but --etcd-insecure has no CA to check it with")
                }
                Some(("http" | "https", _)) => e.to_string(),
                Some((other, _)) => bail!("--etcd: {e}: unknown scheme {other:?} (http or https)"),
            };
            endpoints.push(url);
        }
        Ok(Etcd { endpoints, tls })
    }

    pub fn describe(&self) -> String {
        format!("etcd {}", self.endpoints.join(","))
    }

    /// The connection options, with the TLS material read now.
    fn options(&self) -> Result<ConnectOptions> {
        let mut o = ConnectOptions::new()
            .with_require_leader(true)
            .with_connect_timeout(Duration::from_secs(3))
            .with_timeout(Duration::from_secs(5))
            .with_keep_alive(Duration::from_secs(5), Duration::from_secs(3))
            .with_keep_alive_while_idle(true);
        match &self.tls {
            Some(files) => o = o.with_tls(files.load()?),
            None => tracing::warn!(
                "etcd: connecting over plain HTTP with no client identity (--etcd-insecure): \
                 anyone on the path can read and change this host's desired state"
            ),
        }
        Ok(o)
    }

    /// One connection to endpoint `i` (mod the number of endpoints), proven
    /// by a status request (which also gives the cluster id).
    pub async fn connect_one(&self, i: usize) -> Result<(Client, u64)> {
        let ep = &self.endpoints[i % self.endpoints.len()];
        let mut c =
            Client::connect([ep], Some(self.options()?)).await.with_context(|| format!("connecting to {ep}"))?;
        let st = c.status().await.with_context(|| format!("{ep}: status"))?;
        let cluster = st.header().map(|h| h.cluster_id()).unwrap_or(0);
        Ok((c, cluster))
    }

    /// Connects to the first endpoint that answers, trying each once from
    /// `*next`; `*next` then points at the one that answered. When none
    /// answers, the error names every endpoint with its own failure.
    pub async fn connect_any(&self, next: &mut usize) -> Result<(Client, u64)> {
        let mut failures = Vec::new();
        for _ in 0..self.endpoints.len() {
            match self.connect_one(*next).await {
                Ok(c) => return Ok(c),
                Err(e) => {
                    failures.push(format!("{e:#}"));
                    *next = (*next + 1) % self.endpoints.len();
                }
            }
        }
        bail!("no endpoint answered: {}", failures.join("; "))
    }

    /// Connects, retrying with backoff until one endpoint answers. The
    /// backoff is not reset here: a connection that fails right after it
    /// was made (a refused certificate, a denied key) keeps backing off
    /// ([`Backoff::settle`]).
    pub async fn connect_retrying(&self, next: &mut usize, backoff: &mut Backoff, what: &str) -> (Client, u64) {
        loop {
            match self.connect_any(next).await {
                Ok(c) => return c,
                Err(e) => {
                    let wait = backoff.wait();
                    tracing::warn!("{what}: etcd unreachable ({e:#}); retrying in {wait:.1?}");
                    tokio::time::sleep(wait).await;
                }
            }
        }
    }
}

/// Jittered exponential backoff, 0.5 s doubling to 30 s; each wait is
/// drawn from [half, full] of the current step. It starts again from
/// 0.5 s only after a session that lasted [`Backoff::STABLE`]: failures
/// that follow a successful connect still back off.
pub struct Backoff {
    step: Duration,
    rng: u64,
}

impl Default for Backoff {
    fn default() -> Self {
        let rng = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(1, |d| d.as_nanos() as u64);
        Backoff { step: Self::MIN, rng: rng | 1 }
    }
}

impl Backoff {
    pub const MIN: Duration = Duration::from_millis(500);
    pub const MAX: Duration = Duration::from_secs(30);
    /// A session that stayed up this long before failing was healthy: the
    /// next wait starts from [`Backoff::MIN`] again.
    pub const STABLE: Duration = Duration::from_secs(60);

    pub fn reset(&mut self) {
        self.step = Self::MIN;
    }

    /// Called when a session that began at `since` failed: resets the
    /// backoff when the session had been stable.
    pub fn settle(&mut self, since: Instant) {
        if since.elapsed() >= Self::STABLE {
            self.reset();
        }
    }

    pub fn wait(&mut self) -> Duration {
        // xorshift64: jitter only, no security role.
        self.rng ^= self.rng << 13;
        self.rng ^= self.rng >> 7;
        self.rng ^= self.rng << 17;
        let full = self.step;
        self.step = (self.step * 2).min(Self::MAX);
        let half = full / 2;
        half + Duration::from_nanos(self.rng % (half.as_nanos() as u64 + 1))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_stays_between_half_a_second_and_thirty() {
        let mut b = Backoff::default();
        let waits: Vec<Duration> = (0..12).map(|_| b.wait()).collect();
        assert!(waits[0] >= Duration::from_millis(250) && waits[0] <= Backoff::MIN);
        assert!(waits.iter().all(|w| *w <= Backoff::MAX));
        assert!(waits[11] >= Backoff::MAX / 2);
        b.reset();
        assert!(b.wait() <= Backoff::MIN);
    }

    #[test]
    fn backoff_resets_only_after_a_stable_session() {
        let mut b = Backoff::default();
        for _ in 0..4 {
            b.wait();
        }
        // A session that failed at once keeps the grown step.
        b.settle(Instant::now());
        assert!(b.wait() >= Duration::from_secs(4));
        let long_ago = Instant::now().checked_sub(Backoff::STABLE).unwrap();
        b.settle(long_ago);
        assert!(b.wait() <= Backoff::MIN);
    }

    #[test]
    fn endpoints_and_tls_are_checked() {
        let args = |eps: &[&str], insecure: bool| EtcdArgs {
            endpoints: eps.iter().map(|e| e.to_string()).collect(),
            insecure,
            ..Default::default()
        };
        assert!(Etcd::new(&EtcdArgs::default()).is_err());
        // No TLS and no explicit --etcd-insecure: refused, naming what is missing.
        let e = format!("{:#}", Etcd::new(&args(&["127.0.0.1:1"], false)).err().unwrap());
        assert!(e.contains("--etcd-ca") && e.contains("--etcd-insecure"), "{e}");
        let e = Etcd::new(&args(&["127.0.0.1:1"], true)).unwrap();
        assert_eq!(e.describe(), "etcd http://127.0.0.1:1");
        assert!(Etcd::new(&args(&["a b"], true)).is_err());
        assert!(Etcd::new(&args(&["https://x:1"], true)).is_err());
        assert!(Etcd::new(&args(&["ftp://x:1"], true)).is_err());
        let mut half = args(&["x:1"], false);
        half.ca = Some("/nonexistent".into());
        let e = format!("{:#}", Etcd::new(&half).err().unwrap());
        assert!(e.contains("--etcd-cert") && e.contains("--etcd-key"), "{e}");
        let mut both = args(&["x:1"], true);
        both.ca = Some("/nonexistent".into());
        assert!(format!("{:#}", Etcd::new(&both).err().unwrap()).contains("--etcd-insecure"));
        let mut missing = args(&["x:1"], false);
        missing.ca = Some("/nonexistent".into());
        missing.cert = Some("/nonexistent".into());
        missing.key = Some("/nonexistent".into());
        assert!(format!("{:#}", Etcd::new(&missing).err().unwrap()).contains("--etcd-ca /nonexistent"));
    }
}
