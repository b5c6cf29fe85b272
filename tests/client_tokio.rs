//! `pinq::client` on a tokio runtime (a current-thread runtime with a `LocalSet`, no glommio
//! executor), against a real `pinq serve`: connect, pipelined publishes, a group subscription,
//! receive, NACK and redelivery, ACK groups (whose timers are tokio's), stats, the router, TLS,
//! and the connection's RPC task ending when the last handle is dropped. Also runs the body of
//! `examples/tokio_client.rs`. Every wait is bounded.

mod support;

use std::time::Duration;

use pinq::client::runtime::{self, Executor};
use pinq::client::{AckLevel, Client, ClientOptions, PublishMessage, Router, RouterOptions};
use pinq::security::client::{ClientSecurity, ClientTls};
use pinq::security::tls::ClientTlsFiles;
use support::Server;

/// `examples/tokio_client.rs`, whose `run` the last test calls (its `main` is not used here).
#[allow(dead_code)]
#[path = "../examples/tokio_client.rs"]
mod example;

const WAIT: Duration = Duration::from_secs(60);

/// Runs `body` on a fresh current-thread tokio runtime inside a `LocalSet`, bounded by [`WAIT`].
fn on_tokio<F: std::future::Future<Output = ()>>(body: F) {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a tokio runtime");
    let local = tokio::task::LocalSet::new();
    local.block_on(&runtime, async {
        tokio::time::timeout(WAIT, body)
            .await
            .expect("the test body finished in time");
    });
}

async fn publish(client: &Client, topic: &str, count: usize) {
    // Several batches in flight on the one connection before any reply is awaited.
    let pending: Vec<_> = (0..count)
        .map(|i| {
            let message = PublishMessage::new(topic, format!("m{i}"));
            client.publish([message], AckLevel::Durable)
        })
        .collect();
    for reply in pending {
        assert_eq!(reply.await.expect("publish").len(), 1);
    }
}

async fn active_consumers(addr: &str) -> u64 {
    let client = Client::connect(addr).await.expect("connect");
    let stats = client.stats().await.expect("stats");
    client.close().await.expect("close");
    stats.shards.iter().map(|s| s.active_consumers).sum()
}

#[test]
fn the_client_publishes_consumes_and_acks_on_tokio() {
    let server = Server::start(&["--storage", "memory", "--cpus", "0"]);
    let addr = server.server_arg();
    on_tokio(async move {
        assert_eq!(runtime::current(), Executor::Tokio);
        let client = Client::connect(addr.as_str()).await.expect("connect");
        let sub = client
            .subscribe("jobs", "workers", 32)
            .await
            .expect("subscribe");
        publish(&client, "jobs", 20).await;

        let first = sub.recv().await.expect("a delivery");
        let results = sub.nack(&[first.tag], 0).await.expect("nack");
        assert_eq!(results.len(), 1);
        let acks = sub.ack_group(Duration::from_millis(5), 1024);
        let mut payloads = Vec::new();
        while payloads.len() < 20 {
            let d = sub.recv().await.expect("a delivery");
            acks.ack(&[d.tag]).await.expect("grouped ack");
            payloads.push(String::from_utf8(d.payload).expect("utf-8"));
        }
        payloads.sort();
        payloads.dedup();
        assert_eq!(
            payloads.len(),
            20,
            "each message, the NACKed one again: {payloads:?}"
        );
        let stats = client.stats().await.expect("stats");
        let g = stats
            .groups
            .iter()
            .find(|g| g.topic == "jobs" && g.group == "workers")
            .expect("the group");
        assert_eq!((g.acked, g.nacked), (20, 1), "{g:?}");

        // The router (retries, timers) works on tokio too.
        let router = Router::connect(addr.as_str(), RouterOptions::default())
            .await
            .expect("router");
        let tags = router
            .publish(&[PublishMessage::new("routed", "r")], AckLevel::Leader)
            .await
            .expect("routed publish");
        assert_eq!(tags.len(), 1);

        // Dropping the last handles ends the connection's task: the broker sees the consumer go.
        assert_eq!(active_consumers(&addr).await, 1);
        drop((acks, sub, client, router));
        let deadline = tokio::time::Instant::now() + WAIT;
        while active_consumers(&addr).await != 0 && tokio::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        assert_eq!(active_consumers(&addr).await, 0);
    });
}

#[test]
fn a_connect_to_nothing_fails_in_time_on_tokio() {
    let port = support::cluster::free_port(0);
    on_tokio(async move {
        let addr = format!("127.0.0.1:{port}");
        let err = Client::connect(addr.as_str())
            .await
            .expect_err("nobody listens");
        assert!(err.to_string().contains(&addr), "{err}");
    });
}

#[test]
fn the_tokio_example_runs_against_a_broker() {
    let server = Server::start(&["--storage", "memory", "--cpus", "0"]);
    let addr = server.server_arg();
    on_tokio(async move {
        example::run(addr).await.expect("the example runs");
    });
}

fn openssl(dir: &std::path::Path, args: &[&str]) {
    let out = std::process::Command::new("openssl")
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

/// A CA and a server certificate for 127.0.0.1 signed by it, in `dir`: ca.pem, server.pem,
/// server.key.
fn certificates(dir: &std::path::Path) {
    let ec = [
        "-newkey",
        "ec",
        "-pkeyopt",
        "ec_paramgen_curve:P-256",
        "-nodes",
    ];
    let mut ca = vec![
        "req",
        "-x509",
        "-days",
        "30",
        "-subj",
        "/CN=pinq tokio test CA",
    ];
    ca.extend(ec);
    ca.extend(["-keyout", "ca.key", "-out", "ca.pem"]);
    openssl(dir, &ca);
    let ext = "subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth\n";
    std::fs::write(dir.join("server.ext"), ext).expect("ext file");
    let mut req = vec!["req", "-subj", "/CN=127.0.0.1"];
    req.extend(ec);
    req.extend(["-keyout", "server.key", "-out", "server.csr"]);
    openssl(dir, &req);
    openssl(
        dir,
        &[
            "x509",
            "-req",
            "-in",
            "server.csr",
            "-CA",
            "ca.pem",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-out",
            "server.pem",
            "-days",
            "30",
            "-extfile",
            "server.ext",
        ],
    );
}

#[test]
fn the_client_speaks_tls_on_tokio() {
    let tmp = tempfile::tempdir().expect("tempdir");
    certificates(tmp.path());
    let path = |name: &str| tmp.path().join(name).display().to_string();
    let args = [
        "--storage",
        "memory",
        "--cpus",
        "0",
        "--tls-cert",
        &path("server.pem"),
        "--tls-key",
        &path("server.key"),
    ];
    let server = Server::start(&args);
    let files = ClientTlsFiles {
        ca_file: Some(tmp.path().join("ca.pem")),
        cert_file: None,
        key_file: None,
    };
    let options = ClientOptions {
        security: ClientSecurity {
            tls: Some(ClientTls::from_files(&files, None).expect("client TLS files")),
            token: None,
        },
        ..ClientOptions::default()
    };
    let addr = server.server_arg();
    on_tokio(async move {
        let client = Client::connect_with(addr.as_str(), &options)
            .await
            .expect("connect over TLS");
        let sub = client.subscribe("secret", "", 8).await.expect("subscribe");
        publish(&client, "secret", 2).await;
        for _ in 0..2 {
            let d = sub.recv().await.expect("a delivery");
            sub.ack(&[d.tag]).await.expect("ack");
        }
        // A plain client on the TLS port gets no broker.
        let plain = ClientOptions {
            connect_timeout: Duration::from_secs(2),
            ..ClientOptions::default()
        };
        let refused = runtime::within(WAIT, Client::connect_with(addr.as_str(), &plain)).await;
        assert!(matches!(refused, Some(Err(_))), "a plain client connected");
        client.close().await.expect("close");
    });
}
