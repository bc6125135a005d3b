//! Prometheus text exposition on `--metrics ADDR` (any path).

use std::{
    fmt::Write as _,
    path::{Path, PathBuf},
    sync::{Arc, Mutex},
    time::Duration,
};

use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::TcpListener,
    sync::Semaphore,
};

use super::status::Status;
use crate::dataplane::tables::Tables;

pub fn render(bpffs: &Path, status: &Status) -> String {
    let mut out = String::new();
    out += "# HELP lbagent_dataplane_packets_total Packets by engine outcome (counters map, summed over CPUs).\n";
    out += "# TYPE lbagent_dataplane_packets_total counter\n";
    if let Ok(t) = Tables::open(bpffs) {
        for (c, v) in t.counters().unwrap_or_default() {
            let _ = writeln!(out, "lbagent_dataplane_packets_total{{counter=\"{}\"}} {v}", c.name());
        }
        let stats = t.rule_stats().unwrap_or_default();
        out += "# HELP lbagent_rule_packets_total Packets translated per rule (listener, backend, FIP, DNAT, SNAT).\n";
        out += "# TYPE lbagent_rule_packets_total counter\n";
        let name = |id: u32| status.rule_names.get(&id).cloned().unwrap_or_else(|| format!("id/{id}"));
        for (id, st) in &stats {
            let _ = writeln!(out, "lbagent_rule_packets_total{{rule=\"{}\"}} {}", name(*id), st.packets);
        }
        out += "# TYPE lbagent_rule_bytes_total counter\n";
        for (id, st) in &stats {
            let _ = writeln!(out, "lbagent_rule_bytes_total{{rule=\"{}\"}} {}", name(*id), st.bytes);
        }
        let qos = t.qos_stats_of(status.qos_names.keys().copied()).unwrap_or_default();
        out += "# HELP lbagent_qos_packets_total Packets by QoS rule instance and outcome (passed includes marked).\n";
        out += "# TYPE lbagent_qos_packets_total counter\n";
        out += "# HELP lbagent_qos_bytes_total Layer-2 bytes by QoS rule instance and outcome.\n";
        out += "# TYPE lbagent_qos_bytes_total counter\n";
        for (id, st) in &qos {
            for (outcome, p, b) in [
                ("passed", st.passed_packets, st.passed_bytes),
                ("marked", st.marked_packets, st.marked_bytes),
                ("dropped", st.dropped_packets, st.dropped_bytes),
            ] {
                let key = &status.qos_names[id];
                let _ = writeln!(out, "lbagent_qos_packets_total{{rule=\"{key}\",outcome=\"{outcome}\"}} {p}");
                let _ = writeln!(out, "lbagent_qos_bytes_total{{rule=\"{key}\",outcome=\"{outcome}\"}} {b}");
            }
        }
        // Each object's share of the conntrack tables; objects (zones), not
        // clients, label them: bounded by the objects the host runs.
        let zones = t.zone_ct().unwrap_or_default();
        let named = || zones.iter().filter_map(|(z, v)| Some((status.zone_names.get(z)?, v)));
        out += "# HELP lbagent_conntrack_zone_flows Flows an object holds per conntrack table (established: ct, new: ct_new).\n";
        out += "# TYPE lbagent_conntrack_zone_flows gauge\n";
        out += "# HELP lbagent_conntrack_zone_limit The object's share of each table (flows).\n";
        out += "# TYPE lbagent_conntrack_zone_limit gauge\n";
        out += "# HELP lbagent_conntrack_zone_refused_total Packets the object's share refused: promotions (established), new flows (new).\n";
        out += "# TYPE lbagent_conntrack_zone_refused_total counter\n";
        for (object, v) in named() {
            for (table, flows, limit, refused) in [
                ("established", v.flows.established, v.limits.established, v.refused.established),
                ("new", v.flows.new, v.limits.new, v.refused.new),
            ] {
                let labels = format!("object=\"{object}\",table=\"{table}\"");
                let _ = writeln!(out, "lbagent_conntrack_zone_flows{{{labels}}} {flows}");
                let _ = writeln!(out, "lbagent_conntrack_zone_limit{{{labels}}} {limit}");
                let _ = writeln!(out, "lbagent_conntrack_zone_refused_total{{{labels}}} {refused}");
            }
        }
        out += "# HELP lbagent_rule_acl_drops_total New flows a listener's ACL refused.\n";
        out += "# TYPE lbagent_rule_acl_drops_total counter\n";
        for (id, st) in &stats {
            let _ = writeln!(out, "lbagent_rule_acl_drops_total{{rule=\"{}\"}} {}", name(*id), st.acl_drops);
        }
    }
    let doc = &status.document;
    let ok = doc.last_apply.as_ref().map(|l| l.ok as u8).unwrap_or(0);
    let _ = writeln!(out, "# TYPE lbagent_applies_total counter\nlbagent_applies_total {}", doc.applies);
    let _ = writeln!(out, "# TYPE lbagent_last_apply_success gauge\nlbagent_last_apply_success {ok}");
    let _ = writeln!(
        out,
        "# TYPE lbagent_state_rejected gauge\nlbagent_state_rejected {}",
        doc.rejected_state.is_some() as u8
    );
    let _ = writeln!(out, "# TYPE lbagent_load_balancers gauge\nlbagent_load_balancers {}", doc.load_balancers.len());
    let _ = writeln!(out, "# TYPE lbagent_nat_gateways gauge\nlbagent_nat_gateways {}", doc.nat_gateways.len());
    let p = &doc.health_prober;
    out +=
        "# HELP lbagent_health_prober_running Whether the direct-mode health prober runs (0: the status says why).\n";
    let _ =
        writeln!(out, "# TYPE lbagent_health_prober_running gauge\nlbagent_health_prober_running {}", p.running as u8);
    out += "# HELP lbagent_health_prober_failures_total Times the prober could not start or stopped.\n";
    let _ = writeln!(
        out,
        "# TYPE lbagent_health_prober_failures_total counter\nlbagent_health_prober_failures_total {}",
        p.failures
    );
    let _ = writeln!(out, "# TYPE lbagent_health_probes_total counter\nlbagent_health_probes_total {}", p.probes);
    out += "# HELP lbagent_health_checks_late_total Checks skipped: the backend already had a check waiting for a probe slot.\n";
    let _ =
        writeln!(out, "# TYPE lbagent_health_checks_late_total counter\nlbagent_health_checks_late_total {}", p.late);
    let _ =
        writeln!(out, "# TYPE lbagent_health_probes_in_flight gauge\nlbagent_health_probes_in_flight {}", p.in_flight);
    let _ = writeln!(
        out,
        "# TYPE lbagent_health_backends_down gauge\nlbagent_health_backends_down {}",
        doc.backends_down.len()
    );
    out
}

/// Scrapes served at once (more wait in the backlog).
pub const MAX_CLIENTS: usize = 8;
/// A scraper has this long to send its request and take the answer.
pub const IO_TIMEOUT: Duration = Duration::from_secs(5);
/// Most request bytes read (the request itself is ignored: any path).
const MAX_REQUEST: usize = 4096;

/// Serves scrapes: at most `MAX_CLIENTS` at once, each bounded by
/// `IO_TIMEOUT`, rendered on a blocking thread (reading the maps) and never
/// on the accept loop; accept errors back off instead of spinning.
pub async fn serve(listener: TcpListener, bpffs: PathBuf, status: Arc<Mutex<Status>>) {
    let slots = Arc::new(Semaphore::new(MAX_CLIENTS));
    let mut backoff = Duration::from_millis(10);
    loop {
        let Ok(permit) = slots.clone().acquire_owned().await else { return };
        let mut s = match listener.accept().await {
            Ok((s, _)) => {
                backoff = Duration::from_millis(10);
                s
            }
            Err(e) => {
                tracing::warn!("metrics accept: {e}; retrying in {backoff:?}");
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(1));
                continue;
            }
        };
        let (bpffs, status) = (bpffs.clone(), status.clone());
        tokio::spawn(async move {
            let _permit = permit;
            let _ = tokio::time::timeout(IO_TIMEOUT, async move {
                // The request head (ignored); a client that sends nothing
                // runs into the timeout.
                let mut buf = vec![0u8; MAX_REQUEST];
                let _ = s.read(&mut buf).await;
                let snapshot = status.lock().unwrap().clone();
                let Ok(body) = tokio::task::spawn_blocking(move || render(&bpffs, &snapshot)).await else { return };
                let resp = format!(
                    "HTTP/1.1 200 OK\r\ncontent-type: text/plain; version=0.0.4\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                    body.len()
                );
                let _ = s.write_all(resp.as_bytes()).await;
            })
            .await;
        });
    }
}
