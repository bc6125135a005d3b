//! Prometheus text exposition on `--metrics ADDR` (any path).

use std::{
    path::{Path, PathBuf},
    sync::{Arc, Mutex},
    time::Duration,
};

use anyhow::{Context, Result};
use prometheus_client::{
    encoding::{EncodeLabelSet, text::encode},
    metrics::{counter::Counter, family::Family, gauge::Gauge},
    registry::Registry,
};
use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::TcpListener,
    sync::Semaphore,
};

use super::status::Status;
use crate::{dataplane::tables::Tables, outcome::ErrorKind};

/// The content type of the OpenMetrics text the renderer writes.
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ByCounter {
    counter: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ByRule {
    rule: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ByQosOutcome {
    rule: String,
    outcome: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ByObjectTable {
    object: String,
    table: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ByErrorKind {
    kind: &'static str,
}

fn counter(registry: &mut Registry, name: &str, help: &str, value: u64) {
    let c = Counter::<u64>::default();
    c.inc_by(value);
    registry.register(name, help, c);
}

fn gauge(registry: &mut Registry, name: &str, help: &str, value: i64) {
    let g = Gauge::<i64>::default();
    g.set(value);
    registry.register(name, help, g);
}

/// The metrics of one scrape, read from the pinned maps and the daemon's
/// status. A map that cannot be read fails the scrape (answered 500): a
/// value read as zero would look like traffic that stopped.
pub fn render(bpffs: &Path, status: &Status) -> Result<String> {
    let mut r = Registry::with_prefix("lbagent");
    // Nothing loaded yet (no object was ever applied): no dataplane series.
    if crate::dataplane::pins::versioned_dir(bpffs).join(lbagent_common::MAP_CT.name).exists() {
        dataplane(&mut r, bpffs, status)?;
    }
    let doc = &status.document;
    let last = doc.last_apply.as_ref();
    counter(&mut r, "applies", "Applies of desired state (documents, repair passes, health changes).", doc.applies);
    gauge(&mut r, "last_apply_success", "Whether the last apply succeeded.", last.is_some_and(|l| l.ok) as i64);
    let errors = Family::<ByErrorKind, Gauge>::default();
    for kind in ErrorKind::ALL {
        let n = last.map_or(0, |l| l.errors.iter().filter(|e| e.kind == kind).count());
        errors.get_or_create(&ByErrorKind { kind: kind.name() }).set(n as i64);
    }
    r.register(
        "last_apply_errors",
        "Objects the last apply could not bring to their spec, by the kind of step that failed.",
        errors,
    );
    gauge(
        &mut r,
        "state_rejected",
        "Whether the newest document was refused (the last good one runs).",
        doc.rejected_state.is_some() as i64,
    );
    gauge(&mut r, "load_balancers", "Load balancers applied.", doc.load_balancers.len() as i64);
    gauge(&mut r, "nat_gateways", "NAT gateways applied.", doc.nat_gateways.len() as i64);
    let p = &doc.health_prober;
    gauge(
        &mut r,
        "health_prober_running",
        "Whether the direct-mode health prober runs (0: the status says why).",
        p.running as i64,
    );
    counter(&mut r, "health_prober_failures", "Times the prober could not start or stopped.", p.failures);
    counter(&mut r, "health_probes", "Health probes sent.", p.probes);
    counter(
        &mut r,
        "health_checks_late",
        "Checks skipped: the backend already had a check waiting for a probe slot.",
        p.late,
    );
    gauge(&mut r, "health_probes_in_flight", "Health probes waiting for their answer.", p.in_flight as i64);
    gauge(&mut r, "health_backends_down", "Backends their health checks hold down.", doc.backends_down.len() as i64);
    flow_logs(&mut r, doc);
    ha(&mut r, doc);
    let mut out = String::new();
    encode(&mut out, &r).context("encoding the metrics")?;
    Ok(out)
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ByLabel {
    kind: &'static str,
}

/// The flow logger's records, exports and losses (only while it is
/// configured).
fn ha(r: &mut Registry, doc: &super::status::StatusDoc) {
    let Some(h) = &doc.ha else { return };
    gauge(r, "ha_active", "Whether this host is the active one of its HA pair.", i64::from(h.role == "active"));
    gauge(r, "ha_ready", "Whether this host holds every flow of its peer (a bulk pass completed).", i64::from(h.ready));
    gauge(r, "ha_peer_active", "Whether the peer says it is active.", i64::from(h.peer.active));
    gauge(
        r,
        "ha_peer_heard_ms",
        "Milliseconds since the peer's last hello (-1: never heard).",
        h.peer.last_heard_ms.map(|v| v as i64).unwrap_or(-1),
    );
    counter(r, "ha_synced_out", "Flow records sent to the peer.", h.synced_out);
    counter(r, "ha_synced_in", "Flow records from the peer written into the conntrack tables.", h.synced_in);
    counter(r, "ha_bulk_passes_sent", "Bulk passes (every flow) sent to the peer.", h.bulk_passes_sent);
    counter(r, "ha_bulk_passes_received", "Complete bulk passes received from the peer.", h.bulk_passes_received);
    gauge(
        r,
        "ha_last_bulk_received",
        "Unix time of the last complete bulk pass received (0: never).",
        h.last_bulk_received.unwrap_or(0) as i64,
    );
    gauge(r, "ha_sync_lag_p50_us", "Sync lag of new flows, median (µs; -1: no sample).", lag_us(h.lag_ms_p50));
    gauge(r, "ha_sync_lag_p99_us", "Sync lag of new flows, 99th percentile (µs; -1: no sample).", lag_us(h.lag_ms_p99));
    let d = &h.dropped;
    let by_reason = [
        ("ring_full", d.ring_full),
        ("feed_full", d.feed_full),
        ("send_failed", d.send_failed),
        ("refused", d.refused),
        ("unknown", d.unknown),
        ("table_full", d.table_full),
    ];
    r.register("ha_dropped", "Sync records or datagrams lost or refused, by reason.", by(&by_reason));
}

/// Counters labelled `kind`.
fn by(pairs: &[(&'static str, u64)]) -> Family<ByLabel, Counter<u64>> {
    let family = Family::<ByLabel, Counter<u64>>::default();
    for (kind, v) in pairs {
        family.get_or_create(&ByLabel { kind }).inc_by(*v);
    }
    family
}

fn lag_us(ms: Option<f64>) -> i64 {
    ms.map(|v| (v * 1000.0) as i64).unwrap_or(-1)
}

fn flow_logs(r: &mut Registry, doc: &super::status::StatusDoc) {
    let Some(f) = &doc.flow_logs else { return };
    gauge(r, "flow_log_running", "Whether the flow logger runs (0: the status says why).", f.running as i64);
    r.register(
        "flow_log_records",
        "Flow records taken for export, by event (start, end).",
        by(&[("start", f.start_records), ("end", f.end_records)]),
    );
    r.register(
        "flow_log_exported",
        "Flow records exported, by destination (ipfix: per collector, summed; jsonl).",
        by(&[("ipfix", f.ipfix_sent), ("jsonl", f.jsonl_written)]),
    );
    r.register("flow_log_dropped", "Flow records lost, by reason.", by(&f.dropped.by_name()));
    counter(r, "flow_log_filtered", "Flow records left out by the rule-kind filter.", f.filtered);
    gauge(r, "flow_log_logged_flows", "Logged flows alive at the last scan.", f.logged_flows as i64);
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ByEipProtocol {
    eip: String,
    protocol: &'static str,
}

/// SNAT port usage, from the last conntrack pass's census in the status:
/// by EIP and protocol. Per rule, only the refusals (`snat_no_free_port`):
/// a series per SNAT rule and protocol was 300 000 series at 50 000 busy
/// rules (a 150 MB scrape); the status lists each rule's flows and ports.
fn ports(r: &mut Registry, doc: &super::status::StatusDoc) {
    let Some(p) = &doc.snat_ports else { return };
    let in_use = Family::<ByEipProtocol, Gauge>::default();
    for e in &p.eips {
        for (protocol, n) in e.ports.by_name() {
            in_use.get_or_create(&ByEipProtocol { eip: e.eip.clone(), protocol }).set(n as i64);
        }
    }
    r.register(
        "eip_ports_in_use",
        "Distinct source ports (ICMP: echo ids) an EIP's SNAT'ed flows hold, at the last conntrack pass.",
        in_use,
    );
    gauge(r, "snat_port_range", "Ports in a SNAT rule's range.", p.range as i64);
}

/// The series read from the pinned maps.
fn dataplane(r: &mut Registry, bpffs: &Path, status: &Status) -> Result<()> {
    let t = Tables::open(bpffs).context("opening the pinned maps")?;
    let packets = Family::<ByCounter, Counter>::default();
    for (c, v) in t.counters().context("reading counters")? {
        packets.get_or_create(&ByCounter { counter: c.name() }).inc_by(v);
    }
    r.register("dataplane_packets", "Packets by engine outcome (counters map, summed over CPUs).", packets);

    let stats = t.rule_stats().context("reading rule_stats")?;
    // Names of the rules with statistics, from one walk of the rule keys
    // (no reverse map is kept between scrapes).
    let mut names: std::collections::HashMap<u32, &str> = stats.iter().map(|(id, _)| (*id, "")).collect();
    for (key, id) in status.document.rules.iter() {
        if let Some(n) = names.get_mut(&id) {
            *n = key;
        }
    }
    let name = |id: u32| match names.get(&id) {
        Some(n) if !n.is_empty() => n.to_string(),
        _ => format!("id/{id}"),
    };
    let (rule_packets, rule_bytes, acl_drops, no_port) = (
        Family::<ByRule, Counter>::default(),
        Family::<ByRule, Counter>::default(),
        Family::<ByRule, Counter>::default(),
        Family::<ByRule, Counter>::default(),
    );
    for (id, st) in &stats {
        let rule = ByRule { rule: name(*id) };
        rule_packets.get_or_create(&rule).inc_by(st.packets);
        rule_bytes.get_or_create(&rule).inc_by(st.bytes);
        // What a rule refuses: a SNAT rule, new flows it had no port for;
        // any other, new flows its ACL refused.
        let refused = if crate::naming::is_gw_source_rule(&rule.rule) { &no_port } else { &acl_drops };
        refused.get_or_create(&rule).inc_by(st.refused);
    }
    r.register("rule_packets", "Packets translated per rule (listener, backend, FIP, DNAT, SNAT).", rule_packets);
    r.register("rule_bytes", "Bytes translated per rule.", rule_bytes);
    r.register("rule_acl_drops", "New flows a listener's ACL refused.", acl_drops);
    r.register(
        "snat_no_free_port",
        "New flows a SNAT rule dropped for want of a free port (or ICMP echo id) toward their destination.",
        no_port,
    );
    ports(r, &status.document);

    let qos = t.qos_stats_of(status.qos_names.keys().copied()).context("reading qos_stats")?;
    let (qos_packets, qos_bytes) =
        (Family::<ByQosOutcome, Counter>::default(), Family::<ByQosOutcome, Counter>::default());
    for (id, st) in &qos {
        for (outcome, p, b) in [
            ("passed", st.passed_packets, st.passed_bytes),
            ("marked", st.marked_packets, st.marked_bytes),
            ("dropped", st.dropped_packets, st.dropped_bytes),
        ] {
            let labels = ByQosOutcome { rule: status.qos_names[id].clone(), outcome };
            qos_packets.get_or_create(&labels).inc_by(p);
            qos_bytes.get_or_create(&labels).inc_by(b);
        }
    }
    r.register("qos_packets", "Packets by QoS rule instance and outcome (passed includes marked).", qos_packets);
    r.register("qos_bytes", "Layer-2 bytes by QoS rule instance and outcome.", qos_bytes);

    // Each object's share of the conntrack tables; objects (zones), not
    // clients, label them: bounded by the objects the host runs.
    let zones = t.zone_ct().context("reading the zones' conntrack shares")?;
    let (flows, limits, refused) = (
        Family::<ByObjectTable, Gauge>::default(),
        Family::<ByObjectTable, Gauge>::default(),
        Family::<ByObjectTable, Counter>::default(),
    );
    for (object, v) in zones.iter().filter_map(|(z, v)| Some((status.zone_names.get(z)?, v))) {
        for (table, n, limit, refusals) in [
            ("established", v.flows.established, v.limits.established, v.refused.established),
            ("new", v.flows.new, v.limits.new, v.refused.new),
        ] {
            let labels = ByObjectTable { object: object.clone(), table };
            flows.get_or_create(&labels).set(n as i64);
            limits.get_or_create(&labels).set(limit as i64);
            refused.get_or_create(&labels).inc_by(refusals);
        }
    }
    r.register(
        "conntrack_zone_flows",
        "Flows an object holds per conntrack table (established: ct, new: ct_new).",
        flows,
    );
    r.register("conntrack_zone_limit", "The object's share of each table (flows).", limits);
    r.register(
        "conntrack_zone_refused",
        "Packets the object's share refused: promotions (established), new flows (new).",
        refused,
    );
    Ok(())
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
                let (code, ctype, body) = match body {
                    Ok(b) => ("200 OK", CONTENT_TYPE, b),
                    Err(e) => {
                        tracing::warn!("metrics scrape failed: {e:#}");
                        ("500 Internal Server Error", "text/plain; charset=utf-8", format!("scrape failed: {e:#}\n"))
                    }
                };
                let resp = format!(
                    "HTTP/1.1 {code}\r\ncontent-type: {ctype}\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                    body.len()
                );
                let _ = s.write_all(resp.as_bytes()).await;
            })
            .await;
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{
        daemon::status::LastApply,
        outcome::{ErrorKind, ObjectError},
    };

    #[test]
    fn renders_typed_families_and_counts_errors_by_kind() {
        let dir = std::env::temp_dir().join(format!("lbagent-metrics-{}", std::process::id()));
        let mut status = Status::default();
        status.document.applies = 3;
        let err = |kind| ObjectError { object: "lb/a".into(), kind, error: "boom".into() };
        status.document.last_apply = Some(LastApply {
            errors: vec![err(ErrorKind::Ovs), err(ErrorKind::Ovs), err(ErrorKind::Plumbing)],
            ..Default::default()
        });
        // No maps pinned: no dataplane series, the daemon's own are there.
        let text = render(&dir, &status).unwrap();
        assert!(text.contains("lbagent_applies_total 3\n"), "{text}");
        assert!(text.contains("lbagent_last_apply_success 0\n"), "{text}");
        assert!(text.contains("lbagent_last_apply_errors{kind=\"ovs\"} 2\n"), "{text}");
        assert!(text.contains("lbagent_last_apply_errors{kind=\"plumbing\"} 1\n"), "{text}");
        assert!(text.contains("lbagent_last_apply_errors{kind=\"rules\"} 0\n"), "{text}");
        assert!(!text.contains("lbagent_dataplane_packets"), "{text}");
        assert!(text.ends_with("# EOF\n"), "{text}");
    }

    #[test]
    fn a_map_that_cannot_be_read_fails_the_scrape() {
        let dir = std::env::temp_dir().join(format!("lbagent-metrics-bad-{}", std::process::id()));
        let maps = crate::dataplane::pins::versioned_dir(&dir);
        std::fs::create_dir_all(&maps).unwrap();
        // A plain file where the conntrack table's pin should be.
        std::fs::write(maps.join(lbagent_common::MAP_CT.name), b"not a map").unwrap();
        let e = render(&dir, &Status::default()).unwrap_err();
        let _ = std::fs::remove_dir_all(&dir);
        assert!(format!("{e:#}").contains("pinned maps") || format!("{e:#}").contains("counters"), "{e:#}");
    }
}
