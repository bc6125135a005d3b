//! eBPF-side logs: off by default (no records), on request the program's
//! records reach the `log` facade with their fields formatted.

use std::sync::Mutex;

use lbagent::dataplane::logs::{self, EbpfLogLevel};
use lbagent_tests::{
    engine::TestZone,
    packet::{Ip, L4, frame},
    require_root,
};

static RECORDS: Mutex<Vec<String>> = Mutex::new(Vec::new());

struct Capture;

impl log::Log for Capture {
    fn enabled(&self, _: &log::Metadata) -> bool {
        true
    }
    fn log(&self, r: &log::Record) {
        // Only the program's records (not the loader's own debug output).
        if r.target().starts_with("lbagent_ebpf") {
            RECORDS.lock().unwrap().push(format!("{} {}", r.level(), r.args()));
        }
    }
    fn flush(&self) {}
}

fn new_flow(e: &mut TestZone, sport: u16) {
    let pkt = frame(
        &Ip::new([10, 0, 1, 2], [198, 51, 100, 10]),
        &L4::Udp { sport, dport: 53, payload: vec![1], zero_csum: false },
    );
    e.run(&pkt).unwrap();
}

fn engine() -> TestZone {
    TestZone::with_dns_rule(4, 7).unwrap()
}

#[test]
fn ebpf_logs_are_off_by_default_and_flow_when_enabled() {
    if !require_root() {
        return;
    }
    log::set_logger(&Capture).unwrap();
    log::set_max_level(log::LevelFilter::Trace);

    // Off: the program loads with level 0 and logs nothing.
    logs::set_level(EbpfLogLevel(0));
    let mut quiet = engine();
    new_flow(&mut quiet, 1000);

    // Debug: records arrive, formatted.
    logs::set_level("debug".parse().unwrap());
    let mut loud = engine();
    new_flow(&mut loud, 2000);
    let mut found = Vec::new();
    for _ in 0..30 {
        std::thread::sleep(std::time::Duration::from_millis(100));
        found = RECORDS.lock().unwrap().clone();
        if !found.is_empty() {
            break;
        }
    }
    assert_eq!(found.len(), 1, "exactly the debug engine's new flow: {found:?}");
    assert!(
        found[0].starts_with("DEBUG zone 4 new flow proto 17 10.0.1.2:2000 -> 198.51.100.10:53 dnat rule 7"),
        "{found:?}"
    );
    assert!("loud".parse::<EbpfLogLevel>().is_err());
}
