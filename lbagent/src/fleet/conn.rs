//! Connecting to etcd: endpoints and TLS from the command line, one
//! endpoint at a time (rotating on failure: the client library does not
//! fail over by itself), every request requiring a leader, and a jittered
//! exponential backoff between attempts.

use std::{path::PathBuf, time::Duration};

use anyhow::{Context, Result, bail};
use etcd_client::{Certificate, Client, ConnectOptions, Identity, TlsOptions};

/// `--etcd`, `--etcd-cert`, `--etcd-key`, `--etcd-ca`.
#[derive(clap::Args, Clone, Debug, Default)]
pub struct EtcdArgs {
    /// etcd endpoints, comma separated (`host:port`; `https://` is implied
    /// when a CA is given).
    #[arg(long = "etcd", value_delimiter = ',')]
    pub endpoints: Vec<String>,
    /// Client certificate (PEM) for mutual TLS; its CN is the etcd user.
    #[arg(long = "etcd-cert", requires = "key")]
    pub cert: Option<PathBuf>,
    /// Client key (PEM) for `--etcd-cert`.
    #[arg(long = "etcd-key", id = "key")]
    pub key: Option<PathBuf>,
    /// CA bundle (PEM) that signed the etcd servers' certificates.
    #[arg(long = "etcd-ca")]
    pub ca: Option<PathBuf>,
}

/// A validated connection recipe.
#[derive(Clone)]
pub struct Etcd {
    endpoints: Vec<String>,
    tls: Option<TlsOptions>,
}

impl Etcd {
    pub fn new(args: &EtcdArgs) -> Result<Etcd> {
        if args.endpoints.is_empty() {
            bail!("--etcd: give at least one endpoint (host:port)");
        }
        let tls = match (&args.ca, &args.cert, &args.key) {
            (None, None, None) => None,
            (ca, cert, key) => {
                let read = |p: &PathBuf, what: &str| {
                    std::fs::read(p).with_context(|| format!("--etcd-{what} {}: cannot read", p.display()))
                };
                let mut t = TlsOptions::new();
                if let Some(ca) = ca {
                    t = t.ca_certificate(Certificate::from_pem(read(ca, "ca")?));
                }
                match (cert, key) {
                    (Some(c), Some(k)) => t = t.identity(Identity::from_pem(read(c, "cert")?, read(k, "key")?)),
                    (None, None) => {}
                    _ => bail!("--etcd-cert and --etcd-key go together"),
                }
                Some(t)
            }
        };
        let mut endpoints = Vec::new();
        for e in &args.endpoints {
            let e = e.trim();
            if e.is_empty() || e.chars().any(|c| c.is_whitespace() || c.is_control()) {
                bail!("--etcd: bad endpoint {e:?}");
            }
            let scheme = if tls.is_some() { "https://" } else { "http://" };
            endpoints.push(if e.contains("://") { e.to_string() } else { format!("{scheme}{e}") });
        }
        Ok(Etcd { endpoints, tls })
    }

    pub fn describe(&self) -> String {
        format!("etcd {}", self.endpoints.join(","))
    }

    fn options(&self) -> ConnectOptions {
        let mut o = ConnectOptions::new()
            .with_require_leader(true)
            .with_connect_timeout(Duration::from_secs(3))
            .with_timeout(Duration::from_secs(5))
            .with_keep_alive(Duration::from_secs(5), Duration::from_secs(3))
            .with_keep_alive_while_idle(true);
        if let Some(t) = &self.tls {
            o = o.with_tls(t.clone());
        }
        o
    }

    /// One connection to endpoint `i` (mod the number of endpoints), proven
    /// by a status request (which also gives the cluster id).
    pub async fn connect_one(&self, i: usize) -> Result<(Client, u64)> {
        let ep = &self.endpoints[i % self.endpoints.len()];
        let mut c = Client::connect([ep], Some(self.options())).await.with_context(|| format!("connecting to {ep}"))?;
        let st = c.status().await.with_context(|| format!("{ep}: status"))?;
        let cluster = st.header().map(|h| h.cluster_id()).unwrap_or(0);
        Ok((c, cluster))
    }

    /// Connects to the first endpoint that answers, trying each once from
    /// `*next`; `*next` then points at the one that answered.
    pub async fn connect_any(&self, next: &mut usize) -> Result<(Client, u64)> {
        let mut last = None;
        for _ in 0..self.endpoints.len() {
            match self.connect_one(*next).await {
                Ok(c) => return Ok(c),
                Err(e) => {
                    last = Some(e);
                    *next = (*next + 1) % self.endpoints.len();
                }
            }
        }
        Err(last.unwrap())
    }

    /// Connects, retrying with backoff until one endpoint answers.
    pub async fn connect_retrying(&self, next: &mut usize, backoff: &mut Backoff, what: &str) -> (Client, u64) {
        loop {
            match self.connect_any(next).await {
                Ok(c) => {
                    backoff.reset();
                    return c;
                }
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
/// drawn from [half, full] of the current step.
pub struct Backoff {
    step: Duration,
    seed: u64,
}

impl Default for Backoff {
    fn default() -> Self {
        let seed =
            std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(1, |d| d.as_nanos() as u64);
        Backoff { step: Self::MIN, seed: seed | 1 }
    }
}

impl Backoff {
    pub const MIN: Duration = Duration::from_millis(500);
    pub const MAX: Duration = Duration::from_secs(30);

    pub fn reset(&mut self) {
        self.step = Self::MIN;
    }

    pub fn wait(&mut self) -> Duration {
        // xorshift64: jitter only, no security role.
        self.seed ^= self.seed << 13;
        self.seed ^= self.seed >> 7;
        self.seed ^= self.seed << 17;
        let full = self.step;
        self.step = (self.step * 2).min(Self::MAX);
        let half = full / 2;
        half + Duration::from_nanos(self.seed % (half.as_nanos() as u64 + 1))
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
    fn endpoints_and_tls_are_checked() {
        assert!(Etcd::new(&EtcdArgs::default()).is_err());
        let e = Etcd::new(&EtcdArgs { endpoints: vec!["127.0.0.1:1".into()], ..Default::default() }).unwrap();
        assert_eq!(e.describe(), "etcd http://127.0.0.1:1");
        let bad = EtcdArgs { endpoints: vec!["a b".into()], ..Default::default() };
        assert!(Etcd::new(&bad).is_err());
        let missing = EtcdArgs { endpoints: vec!["x:1".into()], ca: Some("/nonexistent".into()), ..Default::default() };
        assert!(format!("{:#}", Etcd::new(&missing).err().unwrap()).contains("--etcd-ca"));
    }
}
