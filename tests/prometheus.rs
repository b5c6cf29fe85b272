//! The Prometheus side of `deploy/`: the scrape configuration and alerting rules pass
//! `promtool check` and the rules' unit tests (`promtool test rules`); every metric the Grafana
//! dashboard and the rules name is one a running broker exports (a live scrape of a one-node
//! cluster with TLS and the LSM store, so the Raft, storage and certificate families are there
//! too); and Debian's `prometheus` scrapes a running broker and answers
//! `pinq_messages_published_total` through its HTTP API.
//!
//! Needs `promtool` and `prometheus` (Debian package `prometheus`). Where they are missing the
//! tests say so and pass, except when `PINQ_REQUIRE_PROMETHEUS=1` (set by `.ci/run`, which
//! installs the package): then they fail. Every server binds 127.0.0.1 and is stopped by its
//! process id; every wait is bounded.

mod support;

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use support::cluster::{free_port, Cluster};
use support::{cli, http_get, Server};

const WAIT: Duration = Duration::from_secs(90);

fn deploy(path: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("deploy")
        .join(path)
}

/// Whether `program` runs (`--version`); if not, fails under `PINQ_REQUIRE_PROMETHEUS=1` and
/// otherwise says the test is skipped.
fn available(program: &str) -> bool {
    let found = Command::new(program)
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if !found {
        assert!(
            std::env::var("PINQ_REQUIRE_PROMETHEUS").as_deref() != Ok("1"),
            "PINQ_REQUIRE_PROMETHEUS=1 but {program} is missing (apt-get install prometheus)"
        );
        eprintln!("skipped: {program} is not installed (Debian package prometheus)");
    }
    found
}

/// Runs `promtool ARGS` (in `deploy/prometheus`, bounded by `timeout(1)`); fails the test with
/// its output unless it succeeds.
fn promtool(args: &[&str]) -> String {
    let out = Command::new("timeout")
        .arg("120")
        .arg("promtool")
        .args(args)
        .current_dir(deploy("prometheus"))
        .output()
        .expect("run promtool");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "promtool {args:?}: {text}");
    text
}

#[test]
fn the_scrape_config_and_rules_pass_promtool_and_their_unit_tests() {
    if !available("promtool") {
        return;
    }
    promtool(&["check", "config", "prometheus.yml"]);
    let rules = promtool(&["check", "rules", "pinq-rules.yml"]);
    assert!(rules.contains("SUCCESS"), "{rules}");
    let tests = promtool(&["test", "rules", "tests/pinq-rules.test.yml"]);
    assert!(tests.contains("SUCCESS"), "{tests}");
    // Every alert the issue asks for has a rule and a unit test that fires it.
    let written = std::fs::read_to_string(deploy("prometheus/tests/pinq-rules.test.yml"))
        .expect("rule tests");
    for alert in [
        "PinqShardUnhealthy",
        "PinqDiskFull",
        "PinqDeleteBacklogAtBound",
        "PinqShardWithoutLeader",
        "PinqFollowerLagging",
        "PinqRefusalsRising",
        "PinqCertificateExpiresSoon",
    ] {
        assert!(
            written.contains(&format!(
                "alertname: {alert}\n        exp_alerts:\n          -"
            )),
            "no unit test fires {alert}"
        );
    }
}

/// The metric names a scrape page exports: each family of a `# TYPE` line with the sample
/// names its type gives (`_total` for counters, `_bucket`, `_sum`, `_count` for histograms).
fn exported_names(page: &str) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    for line in page.lines() {
        let Some(rest) = line.strip_prefix("# TYPE ") else {
            continue;
        };
        let mut words = rest.split_whitespace();
        let (Some(name), Some(kind)) = (words.next(), words.next()) else {
            continue;
        };
        let suffixes: &[&str] = match kind {
            "counter" => &["_total", "_created"],
            "histogram" => &["_bucket", "_sum", "_count", "_created"],
            _ => &[""],
        };
        names.extend(suffixes.iter().map(|s| format!("{name}{s}")));
    }
    names
}

/// Every `pinq_…` word of a file.
fn named_metrics(text: &str) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    let mut rest = text;
    while let Some(at) = rest.find("pinq_") {
        let tail = &rest[at..];
        let end = tail
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .unwrap_or(tail.len());
        names.insert(tail[..end].to_owned());
        rest = &tail[end..];
    }
    names
}

/// A self-signed certificate for 127.0.0.1 valid 30 days, made with `openssl`: (cert, key).
fn certificate(dir: &Path) -> (String, String) {
    let cert = dir.join("server.pem");
    let key = dir.join("server.key");
    let out = Command::new("openssl")
        .args([
            "req",
            "-x509",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:P-256",
        ])
        .args(["-nodes", "-days", "30", "-subj", "/CN=127.0.0.1"])
        .args(["-addext", "subjectAltName=IP:127.0.0.1", "-keyout"])
        .arg(&key)
        .arg("-out")
        .arg(&cert)
        .output()
        .expect("run openssl (Debian package openssl)");
    assert!(
        out.status.success(),
        "openssl: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let path = |p: PathBuf| p.display().to_string();
    (path(cert), path(key))
}

/// Reads `/metrics` until `done` holds or the wait runs out.
fn page_until(addr: SocketAddr, done: impl Fn(&str) -> bool) -> String {
    let deadline = Instant::now() + WAIT;
    loop {
        let (_, page) = http_get(addr, "/metrics");
        if done(&page) || Instant::now() > deadline {
            return page;
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

#[test]
fn the_dashboard_and_the_rules_name_only_metrics_a_broker_exports() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let (cert, key) = certificate(tmp.path());
    let mut cluster = Cluster::new(1, &[]);
    let args = cluster.args(1, &[("--tls-cert", &cert), ("--tls-key", &key)]);
    cluster.start_nodes(&[1], vec![args]);
    let metrics = cluster.server(1).metrics_addr.expect("metrics address");
    // Raft and storage figures come with the shard's first snapshot as leader.
    let page = page_until(metrics, |p| {
        p.contains("pinq_raft_leader{shard=\"0\"} 1") && p.contains("pinq_storage_wal_writes")
    });
    let exported = exported_names(&page);
    assert!(
        exported.contains("pinq_tls_certificate_expiry_timestamp_seconds"),
        "{page}"
    );
    for file in ["grafana/pinq.json", "prometheus/pinq-rules.yml"] {
        let text = std::fs::read_to_string(deploy(file)).expect("read deploy file");
        let named = named_metrics(&text);
        assert!(named.len() > 5, "{file} names only {named:?}");
        let unknown: Vec<&String> = named.difference(&exported).collect();
        assert!(
            unknown.is_empty(),
            "{file} names metrics pinq does not export: {unknown:?}\nexported: {exported:?}"
        );
    }
    // The dashboard is valid JSON whose panels each query something.
    let text = std::fs::read_to_string(deploy("grafana/pinq.json")).expect("dashboard");
    let dashboard: serde_json::Value = serde_json::from_str(&text).expect("the dashboard is JSON");
    let panels = dashboard["panels"].as_array().expect("panels");
    for panel in panels.iter().filter(|p| p["type"] != "row") {
        let exprs = panel["targets"].as_array().map_or(0, |t| t.len());
        assert!(exprs > 0, "panel {} queries nothing", panel["title"]);
    }
}

/// A `prometheus` process of the test's own (its config, port and storage in a tempdir);
/// killed by its process id when dropped.
struct Prometheus {
    child: Child,
    addr: SocketAddr,
    dir: tempfile::TempDir,
}

impl Prometheus {
    /// Scrapes `target` every second, with pinq's rules loaded.
    fn start(target: SocketAddr) -> Prometheus {
        let dir = tempfile::tempdir().expect("tempdir");
        let config = format!(
            "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\nrule_files:\n  - pinq-rules.yml\n\
             scrape_configs:\n  - job_name: pinq\n    static_configs:\n      - targets: ['{target}']\n"
        );
        std::fs::write(dir.path().join("prometheus.yml"), config).expect("write config");
        std::fs::copy(
            deploy("prometheus/pinq-rules.yml"),
            dir.path().join("pinq-rules.yml"),
        )
        .expect("copy rules");
        let addr = SocketAddr::from(([127, 0, 0, 1], free_port(0)));
        let log = std::fs::File::create(dir.path().join("prometheus.log")).expect("log file");
        let child = Command::new("prometheus")
            .arg(format!(
                "--config.file={}",
                dir.path().join("prometheus.yml").display()
            ))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.path().join("data").display()
            ))
            .arg(format!("--web.listen-address={addr}"))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("start prometheus");
        Prometheus { child, addr, dir }
    }

    /// What it logged so far (for a failure message).
    fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("prometheus.log")).unwrap_or_default()
    }

    /// `GET /api/v1/…` as JSON, or `None` while it does not answer.
    fn api(&self, path: &str) -> Option<serde_json::Value> {
        std::net::TcpStream::connect_timeout(&self.addr, Duration::from_secs(1)).ok()?;
        let (status, body) = http_get(self.addr, &format!("/api/v1/{path}"));
        (status == 200).then(|| serde_json::from_str(&body).ok())?
    }

    /// The sum of an instant query's sample values, once it has any.
    fn query_sum(&self, expr: &str) -> Option<f64> {
        let answer = self.api(&format!("query?query={expr}"))?;
        let result = answer["data"]["result"].as_array()?;
        if result.is_empty() {
            return None;
        }
        result
            .iter()
            .map(|s| s["value"][1].as_str().and_then(|v| v.parse::<f64>().ok()))
            .sum()
    }
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[test]
fn prometheus_scrapes_a_broker_and_answers_its_published_total() {
    if !available("prometheus") {
        return;
    }
    let server = Server::start(&["--storage", "memory", "--cpus", "0"]);
    let target = server.server_arg();
    let (code, out, err) = cli(
        &[
            "publish", "--server", &target, "--topic", "scraped", "a", "b", "c",
        ],
        None,
    );
    assert_eq!(code, 0, "{out}{err}");
    let metrics = server.metrics_addr.expect("metrics address");
    let prometheus = Prometheus::start(metrics);
    let deadline = Instant::now() + WAIT;
    let published = loop {
        let value = prometheus.query_sum("pinq_messages_published_total");
        if value == Some(3.0) || Instant::now() > deadline {
            break value;
        }
        std::thread::sleep(Duration::from_millis(250));
    };
    assert_eq!(
        published,
        Some(3.0),
        "prometheus at {}: {}",
        prometheus.addr,
        prometheus.log()
    );
    // The rules loaded and are evaluated against the broker: none of them fires on it.
    let rules = prometheus.api("rules").expect("rules");
    let names: Vec<&str> = rules["data"]["groups"][0]["rules"]
        .as_array()
        .map(|r| r.iter().filter_map(|r| r["name"].as_str()).collect())
        .unwrap_or_default();
    assert!(names.contains(&"PinqShardUnhealthy"), "{rules}");
    let alerts = prometheus.api("alerts").expect("alerts");
    assert_eq!(alerts["data"]["alerts"], serde_json::json!([]), "{alerts}");
}
