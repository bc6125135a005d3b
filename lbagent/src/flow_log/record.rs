//! A flow event as exporters use it: wall-clock times, names for the zone
//! and the rules, addresses as `IpAddr`.

use std::{
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
    sync::Arc,
    time::{Duration, SystemTime, UNIX_EPOCH},
};

use lbagent_common::*;

use super::Names;
use crate::state::flow_log::RuleKind;

/// CLOCK_MONOTONIC (the programs' `bpf_ktime_get_ns`) to wall-clock time:
/// the offset between the two clocks, read between two monotonic reads
/// (the closest of three tries: a thread preempted between its reads
/// would shift every record of the batch by the pause). It is read again
/// for each batch of records, so a step of the wall clock (NTP) shows from
/// the next batch on; records of one batch share one offset.
#[derive(Clone, Copy, Debug)]
pub struct Clock {
    /// Wall-clock ns since the epoch minus monotonic ns.
    offset_ns: i128,
}

impl Clock {
    pub fn now() -> Clock {
        let mut best: Option<(i128, i128)> = None;
        for _ in 0..3 {
            let before = crate::dataplane::tables::monotonic_ns() as i128;
            let wall = SystemTime::now().duration_since(UNIX_EPOCH).unwrap_or_default().as_nanos() as i128;
            let after = crate::dataplane::tables::monotonic_ns() as i128;
            let gap = after - before;
            if best.is_none_or(|(g, _)| gap < g) {
                best = Some((gap, wall - (before + after) / 2));
            }
        }
        Clock { offset_ns: best.map_or(0, |(_, o)| o) }
    }

    /// The wall-clock time of monotonic `ns`.
    pub fn wall(&self, ns: u64) -> SystemTime {
        let t = (ns as i128 + self.offset_ns).max(0) as u128;
        UNIX_EPOCH + Duration::new((t / 1_000_000_000) as u64, (t % 1_000_000_000) as u32)
    }
}

/// One end of a flow as the record shows it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Endpoints {
    pub src: IpAddr,
    pub sport: u16,
    pub dst: IpAddr,
    pub dport: u16,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Event {
    Start,
    End(u8),
}

/// A flow record ready to export.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FlowRecord {
    pub event: Event,
    /// The event's time (start: the first packet; end: the close or, for
    /// a flow that ended idle or was deleted, its last packet).
    pub time: SystemTime,
    /// The flow's first packet.
    pub start: SystemTime,
    pub zone: u16,
    /// `natgw/<gw>` or `lb/<id>` (None: a zone the agent no longer runs).
    pub object: Option<Arc<str>>,
    pub dnat_rule: Option<Arc<str>>,
    pub snat_rule: Option<Arc<str>>,
    pub proto: u8,
    pub orig: Endpoints,
    pub xlate: Endpoints,
    /// End: original direction, then reply.
    pub packets: [u64; 2],
    pub bytes: [u64; 2],
}

fn addr(family: u8, a: &[u8; 16]) -> IpAddr {
    if family == 4 { IpAddr::V4(Ipv4Addr::from(v4_of(a))) } else { IpAddr::V6(Ipv6Addr::from(*a)) }
}

impl FlowRecord {
    pub fn of(e: &FlowEvent, clock: &Clock, names: &Names) -> FlowRecord {
        let event = if e.kind == FLOW_EVENT_START { Event::Start } else { Event::End(e.reason) };
        FlowRecord {
            event,
            time: clock.wall(e.time_ns),
            start: clock.wall(e.start_ns),
            zone: e.zone,
            object: names.object(
                e.zone,
                e.dnat_rule | e.snat_rule != 0,
                names.rule(e.snat_rule).or_else(|| names.rule(e.dnat_rule)).as_ref(),
            ),
            dnat_rule: names.rule(e.dnat_rule),
            snat_rule: names.rule(e.snat_rule),
            proto: e.proto,
            orig: Endpoints {
                src: addr(e.family, &e.orig_saddr),
                sport: e.orig_sport,
                dst: addr(e.family, &e.orig_daddr),
                dport: e.orig_dport,
            },
            xlate: Endpoints {
                src: addr(e.family, &e.xlate_saddr),
                sport: e.xlate_sport,
                dst: addr(e.family, &e.xlate_daddr),
                dport: e.xlate_dport,
            },
            packets: e.packets,
            bytes: e.bytes,
        }
    }

    /// The kinds of the rules that made the flow.
    pub fn kinds(&self) -> impl Iterator<Item = RuleKind> + '_ {
        [&self.dnat_rule, &self.snat_rule].into_iter().flatten().filter_map(|k| RuleKind::of_key(k))
    }

    /// The rule a record names first: the SNAT rule (whose EIP and port it
    /// used), else the DNAT rule.
    pub fn rule(&self) -> Option<&Arc<str>> {
        self.snat_rule.as_ref().or(self.dnat_rule.as_ref())
    }

    pub fn duration(&self) -> Duration {
        self.time.duration_since(self.start).unwrap_or_default()
    }
}

/// RFC 3339 UTC with milliseconds: `2026-12-07T16:30:00.123Z`.
pub fn rfc3339(t: SystemTime) -> String {
    let d = t.duration_since(UNIX_EPOCH).unwrap_or_default();
    let secs = d.as_secs();
    let (days, rem) = ((secs / 86_400) as i64, secs % 86_400);
    let (y, m, day) = civil_from_days(days);
    format!("{y:04}-{m:02}-{day:02}T{:02}:{:02}:{:02}.{:03}Z", rem / 3600, rem / 60 % 60, rem % 60, d.subsec_millis())
}

/// (year, month, day) of the day `z` days after 1970-01-01 (the proleptic
/// Gregorian calendar; Howard Hinnant's `civil_from_days`).
fn civil_from_days(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let y = yoe + era * 400 + i64::from(m <= 2);
    (y, m, d)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn times_print_as_rfc3339_utc() {
        assert_eq!(rfc3339(UNIX_EPOCH), "1970-01-01T00:00:00.000Z");
        assert_eq!(rfc3339(UNIX_EPOCH + Duration::from_millis(951_782_400_123)), "2000-02-29T00:00:00.123Z");
        // 2026-12-07T16:30:05Z
        assert_eq!(rfc3339(UNIX_EPOCH + Duration::from_secs(1_796_661_005)), "2026-12-07T16:30:05.000Z");
    }
}
