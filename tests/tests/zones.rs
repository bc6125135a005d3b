//! Many zones on one host: 64 zones (namespaces) attached by one agent
//! engine under a 256 open-file soft limit. A zone costs the agent its
//! program fds, not one fd per pinned map (nor the object's BTF): with an
//! fd per map (27 maps) the zones would need about 1 700. A second engine
//! over the same pins (a restart) reuses every zone's programs. (The
//! agent's restart at 500 zones is measured by the benchmark, section 15.)

use lbagent::dataplane::{attach::AttachMode, engine::Engine};
use lbagent_tests::{
    engine::TestPins,
    net::{Netns, attached_programs},
    require_root, unique,
};

const ZONES: u16 = 64;
/// The open-file soft limit the zones are attached under.
const FD_LIMIT: u64 = 256;

fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd").unwrap().count()
}

#[test]
fn sixty_four_zones_under_a_256_fd_limit() {
    if !require_root() {
        return;
    }
    let mut lim = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit/setrlimit on valid rlimit values; this test binary is
    // its own process, so the lower limit touches no other test.
    unsafe {
        libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim);
        lim.rlim_cur = FD_LIMIT;
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
    let started = std::time::Instant::now();
    for (i, ns) in namespaces.iter().enumerate() {
        engine.attach(i as u16 + 1, &ns.name, "d0").unwrap_or_else(|e| panic!("zone {}: {e:#}", i + 1));
        engine.attach_loopback(i as u16 + 1, &ns.name).unwrap();
    }
    let per_zone = (open_fds() - before) as f64 / ZONES as f64;
    eprintln!("{per_zone:.2} fds per zone");
    assert!(per_zone <= 2.0, "{per_zone:.2} fds held per zone");
    for ns in [&namespaces[0], &namespaces[ZONES as usize / 2], &namespaces[ZONES as usize - 1]] {
        let filters = ns.exec(&["tc", "filter", "show", "dev", "d0", "ingress"]).unwrap();
        assert!(filters.contains("lbagent_nat"), "{}: {filters}", ns.name);
    }
    let loaded = started.elapsed();

    // A restart of the same build: a new engine over the same pins takes
    // every zone's programs from their pins instead of loading them again.
    let programs = |ns: &Netns| attached_programs(&ns.name, &pins.root).unwrap();
    let before: Vec<_> = namespaces.iter().map(programs).collect();
    assert!(before.iter().all(|p| p.len() == 3), "ingress and egress of d0, egress of lo: {:?}", before[0]);
    drop(engine);
    let mut engine = Engine::new(pins.root.clone(), AttachMode::Netlink);
    let started = std::time::Instant::now();
    for (i, ns) in namespaces.iter().enumerate() {
        engine.attach(i as u16 + 1, &ns.name, "d0").unwrap_or_else(|e| panic!("zone {}: {e:#}", i + 1));
        engine.attach_loopback(i as u16 + 1, &ns.name).unwrap();
    }
    let reattached = started.elapsed();
    eprintln!("{ZONES} zones: attached in {loaded:.1?} (loads), again in {reattached:.1?} (reused pins)");
    let after: Vec<_> = namespaces.iter().map(programs).collect();
    assert_eq!(after, before, "the pinned programs, not new loads");
    for (i, ns) in namespaces.iter().enumerate() {
        engine.release(i as u16 + 1, &ns.name, &["d0"]);
    }
    // Released zones leave no pinned program behind (a zone-0 program, the
    // one that creates the maps, stays with them).
    let left = pinned_programs(&pins.root);
    assert!(left.iter().all(|n| n.starts_with("z0_")), "{left:?}");
}

/// File names of the programs pinned under `root` (every build).
fn pinned_programs(root: &std::path::Path) -> Vec<String> {
    let progs = lbagent::dataplane::pins::versioned_dir(root).join("progs");
    let mut names: Vec<String> = std::fs::read_dir(progs)
        .into_iter()
        .flatten()
        .flatten()
        .flat_map(|build| std::fs::read_dir(build.path()).into_iter().flatten().flatten())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}
