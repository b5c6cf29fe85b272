//! Mutual TLS between nodes (`[cluster.tls]`) with three real `pinq serve` processes on
//! 127.0.0.1 and certificates made by the test with the `openssl` program: a cluster CA, one
//! certificate per node naming it by the DNS subjectAltName `pinq-node-<id>` (all nodes share
//! 127.0.0.1, so an IP would not tell them apart), and a second CA. A cluster with node TLS elects
//! a leader and serves a durable publish and its consumption; a node with a certificate from the
//! other CA, and a node presenting another member's certificate, are refused at the handshake
//! with the reason in the logs while the other two keep serving; a missing certificate file and a
//! key of another certificate stop `pinq serve` naming the file. Every member is stopped by its
//! pid (the `Cluster` helper); the tests run one at a time (three brokers each on 2 cores).

mod support;

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use support::cli_within;
use support::cluster::Cluster;

const ENV: &[(&str, &str)] = &[("PINQ_DELIVERY_DELETE_BATCH_INTERVAL", "50ms")];
const SHARD: u32 = 0;
const FIRST_ELECTION_TIMEOUT: Duration = Duration::from_secs(15);
const CLI_LIMIT: Duration = Duration::from_secs(20);

static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

fn openssl(dir: &Path, args: &[&str]) {
    let out = Command::new("openssl")
        .args(args)
        .current_dir(dir)
        .output()
        .expect("run openssl (Debian package openssl)");
    assert!(
        out.status.success(),
        "openssl {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

const EC: [&str; 5] = [
    "-newkey",
    "ec",
    "-pkeyopt",
    "ec_paramgen_curve:P-256",
    "-nodes",
];

/// `name.pem` and `name.key`, a CA.
fn make_ca(dir: &Path, name: &str) {
    let (key, pem, subj) = (
        format!("{name}.key"),
        format!("{name}.pem"),
        format!("/CN=pinq {name}"),
    );
    let mut args = vec!["req", "-x509"];
    args.extend(EC);
    args.extend(["-keyout", &key, "-out", &pem, "-days", "2", "-subj", &subj]);
    openssl(dir, &args);
}

/// `name.pem` and `name.key`: a node certificate for `pinq-node-<id>` signed by CA `ca`, as the
/// README's Security section makes it.
fn make_node_cert(dir: &Path, name: &str, id: u64, ca: &str) {
    let (key, csr, pem, ext) = (
        format!("{name}.key"),
        format!("{name}.csr"),
        format!("{name}.pem"),
        format!("{name}.ext"),
    );
    std::fs::write(
        dir.join(&ext),
        format!("subjectAltName=DNS:pinq-node-{id}\nextendedKeyUsage=serverAuth,clientAuth\n"),
    )
    .expect("ext file");
    let subj = format!("/CN=pinq-node-{id}");
    let mut req = vec!["req"];
    req.extend(EC);
    req.extend(["-keyout", &key, "-out", &csr, "-subj", &subj]);
    openssl(dir, &req);
    let (ca_pem, ca_key) = (format!("{ca}.pem"), format!("{ca}.key"));
    openssl(
        dir,
        &[
            "x509",
            "-req",
            "-in",
            &csr,
            "-CA",
            &ca_pem,
            "-CAkey",
            &ca_key,
            "-CAcreateserial",
            "-out",
            &pem,
            "-days",
            "2",
            "-extfile",
            &ext,
        ],
    );
}

/// The cluster CA with node certificates `node1`..`node3`, and `other-ca` with `rogue3` (a
/// certificate for node 3 signed by it).
fn make_pki() -> tempfile::TempDir {
    let dir = tempfile::tempdir().expect("temp dir");
    let d = dir.path();
    make_ca(d, "ca");
    for id in 1..=3 {
        make_node_cert(d, &format!("node{id}"), id, "ca");
    }
    make_ca(d, "other-ca");
    make_node_cert(d, "rogue3", 3, "other-ca");
    dir
}

/// A config file with `[cluster.tls]` presenting `cert` (and its key), trusting `ca.pem`.
fn tls_config(pki: &Path, name: &str, cert: &str) -> PathBuf {
    let path = pki.join(format!("{name}.toml"));
    let file = |f: String| pki.join(f).display().to_string();
    std::fs::write(
        &path,
        format!(
            "[cluster.tls]\ncertFile = \"{}\"\nkeyFile = \"{}\"\ncaFile = \"{}\"\n",
            file(format!("{cert}.pem")),
            file(format!("{cert}.key")),
            file("ca.pem".to_owned()),
        ),
    )
    .expect("config file");
    path
}

/// Starts members 1..=3, member `id` presenting `certs[id - 1]`.
fn start_with_certs(pki: &Path, certs: [&str; 3]) -> Cluster {
    let mut cluster = Cluster::new(3, ENV);
    let args = (1..=3u64)
        .map(|id| {
            let config = tls_config(pki, &format!("member{id}"), certs[id as usize - 1]);
            cluster.args(id, &[("--config", &config.display().to_string())])
        })
        .collect();
    cluster.start_nodes(&[1, 2, 3], args);
    cluster
}

fn publish(addr: &str, topic: &str, payloads: &[String]) {
    let mut input = payloads.join("\n");
    input.push('\n');
    let (code, out, err) = cli_within(
        &[
            "publish", "--server", addr, "--topic", topic, "--ack", "durable",
        ],
        Some(&input),
        CLI_LIMIT,
    );
    assert_eq!(code, 0, "publishing through {addr} failed:\n{out}\n{err}");
}

fn consume(addr: &str, topic: &str, count: usize) -> BTreeSet<String> {
    let (code, out, err) = cli_within(
        &[
            "consume",
            "--server",
            addr,
            "--topic",
            topic,
            "--group",
            "g",
            "--count",
            &count.to_string(),
            "--timeout",
            "10s",
        ],
        None,
        CLI_LIMIT,
    );
    assert_eq!(code, 0, "consuming through {addr} failed:\n{err}");
    out.lines().map(str::to_owned).collect()
}

/// A durable publish through `among`'s leader, consumed back whole.
fn publish_and_consume(cluster: &Cluster, among: &[u64], topic: &str) {
    let leader = cluster.wait_for_leader(SHARD, among, FIRST_ELECTION_TIMEOUT);
    let sent: Vec<String> = (0..5).map(|i| format!("{topic}-{i}")).collect();
    publish(&cluster.addr(leader), topic, &sent);
    let got = consume(&cluster.addr(leader), topic, sent.len());
    assert_eq!(got, sent.into_iter().collect::<BTreeSet<_>>());
}

/// Collects member `id`'s output until a line contains every one of `words`; returns it.
fn wait_for_log_line(cluster: &Cluster, id: u64, words: &[&str], timeout: Duration) -> String {
    let deadline = Instant::now() + timeout;
    let mut seen = Vec::new();
    loop {
        seen.extend(cluster.server(id).drain_output());
        if let Some(line) = seen.iter().find(|l| words.iter().all(|w| l.contains(w))) {
            return line.clone();
        }
        assert!(
            Instant::now() < deadline,
            "node {id} logged no line with {words:?} within {timeout:?}; it printed:\n{}",
            seen.join("\n")
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn three_nodes_with_node_tls_elect_a_leader_and_serve_a_durable_publish() {
    let _serial = serial();
    let pki = make_pki();
    let cluster = start_with_certs(pki.path(), ["node1", "node2", "node3"]);
    publish_and_consume(&cluster, &[1, 2, 3], "tls-all");
    // Every member sees every other connected, and none refused anyone.
    let deadline = Instant::now() + Duration::from_secs(10);
    for id in 1..=3 {
        loop {
            let all = cluster
                .status(id, Duration::from_secs(1))
                .is_some_and(|s| s.nodes.len() == 3 && s.nodes.iter().all(|n| n.reachable));
            if all {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "node {id} does not see all peers"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        let lines = cluster.server(id).drain_output();
        assert!(
            !lines.iter().any(|l| l.contains("refused")),
            "node {id}:\n{}",
            lines.join("\n")
        );
    }
}

#[test]
fn a_node_with_a_certificate_from_another_ca_is_refused_and_the_others_serve() {
    let _serial = serial();
    let pki = make_pki();
    let cluster = start_with_certs(pki.path(), ["node1", "node2", "rogue3"]);
    // Nodes 1 and 2 dial node 3 and refuse its server certificate.
    for id in [1, 2] {
        let line = wait_for_log_line(
            &cluster,
            id,
            &["refused a peer at the handshake", "tls", "UnknownIssuer"],
            Duration::from_secs(10),
        );
        eprintln!("node {id} logged: {line}");
    }
    publish_and_consume(&cluster, &[1, 2], "tls-other-ca");
    assert!(
        cluster.claimed_leaders(SHARD, &[3]).is_empty(),
        "the refused node leads nothing"
    );
}

#[test]
fn a_node_presenting_another_members_certificate_is_refused_and_the_others_serve() {
    let _serial = serial();
    let pki = make_pki();
    // Node 1 presents node 2's certificate (signed by the cluster CA, naming pinq-node-2).
    let cluster = start_with_certs(pki.path(), ["node2", "node2", "node3"]);
    for id in [2, 3] {
        let line = wait_for_log_line(
            &cluster,
            id,
            &[
                "refused a peer at the handshake",
                "certificateMismatch",
                "presented for node 1 names DNS:pinq-node-2",
            ],
            Duration::from_secs(10),
        );
        eprintln!("node {id} logged: {line}");
    }
    wait_for_log_line(
        &cluster,
        1,
        &["refused by a peer at the handshake", "certificateMismatch"],
        Duration::from_secs(10),
    );
    publish_and_consume(&cluster, &[2, 3], "tls-impostor");
    assert!(
        cluster.claimed_leaders(SHARD, &[1]).is_empty(),
        "the refused node leads nothing"
    );
}

#[test]
fn a_bad_node_tls_file_stops_start_up_naming_the_file() {
    let _serial = serial();
    let pki = make_pki();
    let d = pki.path();
    let cluster = Cluster::new(1, ENV);
    // A certificate file that is not there, then a key of another certificate.
    let missing = tls_config(d, "missing", "node9");
    let mismatched = d.join("mismatched.toml");
    let text = std::fs::read_to_string(tls_config(d, "base", "node1")).expect("config");
    std::fs::write(&mismatched, text.replace("node1.key", "node2.key")).expect("config");
    for (config, named) in [(missing, "node9.pem"), (mismatched, "node2.key")] {
        let mut args = vec!["serve".to_owned()];
        args.extend(cluster.args(1, &[("--config", &config.display().to_string())]));
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let (code, out, err) = cli_within(&args, None, CLI_LIMIT);
        assert_ne!(code, 0, "pinq serve started:\n{out}\n{err}");
        assert!(
            err.contains("[cluster.tls]") && err.contains(named),
            "the error does not name {named}:\n{err}"
        );
    }
}
