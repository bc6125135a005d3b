fn main() {
    if let Err(e) = lbagent::cli::main() {
        eprintln!("lbagent: {e:#}");
        std::process::exit(1);
    }
}
