//! Many zones on one host: 200 zones (namespaces) attached by one agent
//! engine under a 1 024 open-file soft limit. A zone costs the agent its two
//! program fds and the object's BTF fd, not one fd per pinned map.

use lbagent::dataplane::{attach::AttachMode, engine::Engine};
use lbagent_tests::{engine::TestPins, net::Netns, require_root, unique};

const ZONES: u16 = 200;

fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd").unwrap().count()
}

#[test]
fn two_hundred_zones_under_a_1024_fd_limit() {
    if !require_root() {
        return;
    }
    let mut lim = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit/setrlimit on valid rlimit values; this test binary is
    // its own process, so the lower limit touches no other test.
    unsafe {
        libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim);
        lim.rlim_cur = 1024;
        assert_eq!(libc::setrlimit(libc::RLIMIT_NOFILE, &lim), 0);
    }
    let pins = TestPins::new();
    let mut engine = Engine::new(pins.root.clone(), AttachMode::Netlink);
    let namespaces: Vec<Netns> = (0..ZONES)
        .map(|_| {
            let ns = Netns::new(&unique("lbaz")).unwrap();
            ns.exec(&["ip", "link", "add", "d0", "type", "veth", "peer", "name", "d1"]).unwrap();
            ns.exec(&["ip", "link", "set", "d0", "up"]).unwrap();
            ns
        })
        .collect();
    let before = open_fds();
    for (i, ns) in namespaces.iter().enumerate() {
        engine.attach(i as u16 + 1, &ns.name, "d0").unwrap_or_else(|e| panic!("zone {}: {e:#}", i + 1));
    }
    let per_zone = (open_fds() - before) as f64 / ZONES as f64;
    eprintln!("{per_zone:.2} fds per zone");
    assert!(per_zone <= 3.0, "{per_zone:.2} fds held per zone");
    for ns in [&namespaces[0], &namespaces[ZONES as usize / 2], &namespaces[ZONES as usize - 1]] {
        let filters = ns.exec(&["tc", "filter", "show", "dev", "d0", "ingress"]).unwrap();
        assert!(filters.contains("lbagent_nat"), "{}: {filters}", ns.name);
    }
    for (i, ns) in namespaces.iter().enumerate() {
        engine.release(i as u16 + 1, &ns.name, &["d0"]);
    }
}
