//! `pinq bench` end to end through the binary: it starts its own broker, runs a short load and
//! writes the JSON summary, the `.hgrm` files and the SVG plot.

use std::process::Command;

/// Runs `pinq bench` with a short load plus `extra` flags; returns the JSON summary (as text
/// and parsed), the stderr, and the report directory.
fn run_bench(extra: &[&str]) -> (String, serde_json::Value, String, tempfile::TempDir) {
    let dir = tempfile::tempdir().expect("temp dir");
    let json = dir.path().join("out.json");
    let out_dir = dir.path().join("out");
    let output = Command::new(env!("CARGO_BIN_EXE_pinq"))
        .args([
            "bench",
            "--size",
            "100",
            "--warmup",
            "0s",
            "--duration",
            "1s",
        ])
        .args(extra)
        .arg("--json")
        .arg(&json)
        .arg("--out-dir")
        .arg(&out_dir)
        .env("RUST_LOG", "warn")
        .output()
        .expect("run pinq bench");
    let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
    assert!(
        output.status.success(),
        "pinq bench failed: {}\n{stderr}",
        String::from_utf8_lossy(&output.stdout),
    );
    let text = std::fs::read_to_string(&json).expect("JSON summary written");
    let summary: serde_json::Value = serde_json::from_str(&text).expect("valid JSON");
    (text, summary, stderr, dir)
}

#[test]
fn short_bench_delivers_every_message_and_writes_its_reports() {
    let (text, summary, _, dir) = run_bench(&["--producers", "2", "--consumers", "2"]);
    let out_dir = dir.path().join("out");
    for key in [
        "msgs_per_sec",
        "mb_per_sec",
        "sent",
        "received",
        "duplicates",
        "missing",
    ] {
        assert!(summary[key].is_number(), "{key} missing in {text}");
    }
    for latency in ["e2e_us", "publish_ack_us", "ack_us"] {
        for p in ["p50", "p95", "p99", "p999", "p9999", "max"] {
            assert!(
                summary[latency][p].is_u64(),
                "{latency}.{p} missing in {text}"
            );
        }
    }
    let count = |key: &str| summary[key].as_u64().expect("a count");
    assert!(count("sent") > 0, "nothing was sent: {text}");
    assert_eq!(count("missing"), 0, "{text}");
    assert!(count("received") >= count("sent"), "{text}");

    let svg = std::fs::read_to_string(out_dir.join("latency.svg")).expect("SVG written");
    assert!(svg.starts_with("<svg") && svg.contains("<polyline"));
    let hgrm = std::fs::read_to_string(out_dir.join("e2e.hgrm")).expect(".hgrm written");
    assert!(hgrm.starts_with("       Value     Percentile TotalCount"));
    assert!(hgrm.contains("#[Max"));
}

#[test]
fn grouped_acks_settle_every_message_without_a_failed_call() {
    let (text, summary, stderr, _dir) = run_bench(&["--rate", "2000", "--ack-group", "2ms"]);
    let count = |key: &str| summary[key].as_u64().expect("a count");
    assert!(count("sent") > 0, "nothing was sent: {text}");
    assert_eq!(count("missing"), 0, "{text}");
    assert!(
        !stderr.contains("failed"),
        "a grouped ack call failed: {stderr}"
    );
    assert!(
        summary["ack_us"]["max"].as_u64().expect("ack latency") > 0,
        "{text}"
    );
}
