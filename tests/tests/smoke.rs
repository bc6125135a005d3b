use lbagent_tests::{engine::Engine, require_root};

#[test]
fn loads() {
    if !require_root() { return; }
    let mut e = Engine::new(1).unwrap();
    let f = lbagent_tests::packet::frame(&lbagent_tests::packet::Ip::new([1,2,3,4],[5,6,7,8]), &lbagent_tests::packet::L4::Udp{sport:1,dport:2,payload:vec![1],zero_csum:false});
    let (r, out) = e.run(&f).unwrap();
    assert_eq!(r, 0);
    assert_eq!(out, f);
}
