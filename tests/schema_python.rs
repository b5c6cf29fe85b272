//! A client in another language, written from `schema/` alone: `schema/examples/python_client.py`
//! (pycapnp) speaks protocol 2 (reads a refused publish's code and index from the results),
//! publishes, subscribes, receives through `deliver` and ACKs against a real `pinq serve`.
//!
//! Needs `python3` with `pycapnp`. Where it is missing the test says so and passes, except when
//! `PINQ_REQUIRE_PYTHON_CLIENT=1` (set by `.ci/run`, which installs pycapnp): then it fails.

mod support;

use std::process::Command;

use support::Server;

fn pycapnp_available() -> bool {
    Command::new("python3")
        .args(["-c", "import capnp"])
        .output()
        .is_ok_and(|o| o.status.success())
}

#[test]
fn a_python_client_built_from_the_schema_publishes_consumes_and_acks() {
    if !pycapnp_available() {
        assert!(
            std::env::var("PINQ_REQUIRE_PYTHON_CLIENT").as_deref() != Ok("1"),
            "PINQ_REQUIRE_PYTHON_CLIENT=1 but python3 cannot import capnp (pip install pycapnp)"
        );
        eprintln!("skipped: python3 with pycapnp is not installed (pip install pycapnp)");
        return;
    }
    let server = Server::start(&["--storage", "memory", "--cpus", "0"]);
    let script = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/schema/examples/python_client.py"
    );
    let out = Command::new("timeout")
        .args(["60", "python3", script, &server.server_arg()])
        .output()
        .expect("run python3");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "python client failed ({}):\n{stdout}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        stdout.contains("delivered and acked 5 message(s)"),
        "unexpected output:\n{stdout}"
    );
    assert!(
        stdout.contains("refused: invalidTopic at message 1 (retryable: False)"),
        "the typed refusal is missing:\n{stdout}"
    );
    for i in 0..5 {
        assert!(
            stdout.contains(&format!("hello {i} from python (attempt 1)")),
            "message {i} missing:\n{stdout}"
        );
    }
}
