//! TLS and tokens against a real `pinq serve`, with certificates made by the test with the
//! `openssl` program (a CA, a server certificate for `localhost` and 127.0.0.1, a client
//! certificate, an expired one): publish and consume over TLS with a token; a missing, a wrong
//! and an insufficient token each refused with its typed error and nothing stored; a plain client
//! on the TLS port closed; a required client certificate; bad files stopping start-up; and, on
//! a plain port, `hello` enforced as the first call.

mod support;

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use pinq::client::{Client, ClientOptions};
use pinq::security::client::{ClientSecurity, ClientTls, Token};
use pinq::security::tls::ClientTlsFiles;
use support::{http_get, on_executor, sample, try_cli_within, Server};

const BILLING_SECRET: &str = "billing-secret-0123456789";
const OPS_SECRET: &str = "ops-secret-9876543210";
const PYTHON_SECRET: &str = "python-secret-5555";

/// Certificates and keys made with `openssl` in a temporary directory.
struct Pki {
    dir: tempfile::TempDir,
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

impl Pki {
    fn new() -> Pki {
        let dir = tempfile::tempdir().expect("temp dir");
        let d = dir.path();
        let ec = [
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:P-256",
            "-nodes",
        ];
        let mut ca = vec!["req", "-x509"];
        ca.extend(ec);
        ca.extend([
            "-keyout",
            "ca.key",
            "-out",
            "ca.pem",
            "-days",
            "30",
            "-subj",
            "/CN=pinq test CA",
        ]);
        openssl(d, &ca);
        for (name, cn, ext) in [
            (
                "server",
                "localhost",
                "subjectAltName=DNS:localhost,IP:127.0.0.1\nextendedKeyUsage=serverAuth\n",
            ),
            (
                "client",
                "pinq test client",
                "extendedKeyUsage=clientAuth\n",
            ),
        ] {
            std::fs::write(d.join(format!("{name}.ext")), ext).expect("ext file");
            let (key, csr, pem, extfile, subj) = (
                format!("{name}.key"),
                format!("{name}.csr"),
                format!("{name}.pem"),
                format!("{name}.ext"),
                format!("/CN={cn}"),
            );
            let mut req = vec!["req"];
            req.extend(ec);
            req.extend(["-keyout", &key, "-out", &csr, "-subj", &subj]);
            openssl(d, &req);
            openssl(
                d,
                &[
                    "x509",
                    "-req",
                    "-in",
                    &csr,
                    "-CA",
                    "ca.pem",
                    "-CAkey",
                    "ca.key",
                    "-CAcreateserial",
                    "-out",
                    &pem,
                    "-days",
                    "30",
                    "-extfile",
                    &extfile,
                ],
            );
        }
        // A key that belongs to no certificate here.
        let mut other = vec!["req", "-x509"];
        other.extend(ec);
        other.extend([
            "-keyout",
            "other.key",
            "-out",
            "other.pem",
            "-days",
            "30",
            "-subj",
            "/CN=other",
        ]);
        openssl(d, &other);
        // A certificate that expired in 2020 (`openssl ca` sets both dates).
        std::fs::write(d.join("index.txt"), "").expect("index");
        std::fs::write(d.join("serial"), "1000\n").expect("serial");
        std::fs::write(
            d.join("ca.cnf"),
            "[ca]\ndefault_ca=d\n[d]\ndatabase=index.txt\nnew_certs_dir=.\nserial=serial\n\
             default_md=sha256\npolicy=p\n[p]\ncommonName=supplied\n",
        )
        .expect("ca.cnf");
        openssl(
            d,
            &[
                "ca",
                "-batch",
                "-config",
                "ca.cnf",
                "-cert",
                "ca.pem",
                "-keyfile",
                "ca.key",
                "-in",
                "server.csr",
                "-out",
                "expired.pem",
                "-startdate",
                "20200101000000Z",
                "-enddate",
                "20200201000000Z",
                "-notext",
            ],
        );
        std::fs::write(d.join("billing.token"), format!("{BILLING_SECRET}\n")).expect("token");
        std::fs::write(d.join("ops.token"), format!("{OPS_SECRET}\n")).expect("token");
        std::fs::write(d.join("python.token"), format!("{PYTHON_SECRET}\n")).expect("token");
        std::fs::write(d.join("wrong.token"), "billing-secret-0123456780\n").expect("token");
        let hash = |s: &str| pinq::security::auth::sha256_hex(s.as_bytes());
        std::fs::write(
            d.join("pinq.toml"),
            format!(
                "[[auth.tokens]]\nname = \"billing\"\nsha256 = \"{}\"\npublish = [\"orders\"]\n\
                 consume = [\"orders\"]\nadmin = false\n\n[[auth.tokens]]\nname = \"ops\"\n\
                 sha256 = \"{}\"\nadmin = true\n\n[[auth.tokens]]\nname = \"python\"\n\
                 sha256 = \"{}\"\npublish = [\"python-\"]\nconsume = [\"python-\"]\n",
                hash(BILLING_SECRET),
                hash(OPS_SECRET),
                hash(PYTHON_SECRET)
            ),
        )
        .expect("config");
        Pki { dir }
    }

    fn path(&self, name: &str) -> String {
        self.dir.path().join(name).to_string_lossy().into_owned()
    }

    fn file(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    /// A TLS broker with the tokens of `pinq.toml`.
    fn server(&self, extra: &[&str], env: &[(&str, &str)]) -> Server {
        let (config, cert, key) = (
            self.path("pinq.toml"),
            self.path("server.pem"),
            self.path("server.key"),
        );
        let mut args = vec![
            "--storage",
            "memory",
            "--cpus",
            "0",
            "--config",
            &config,
            "--tls-cert",
            &cert,
            "--tls-key",
            &key,
        ];
        args.extend_from_slice(extra);
        Server::start_with_env(&args, env)
    }

    fn client_options(&self, token: Option<&str>, client_cert: bool) -> ClientOptions {
        let files = ClientTlsFiles {
            ca_file: Some(self.file("ca.pem")),
            cert_file: client_cert.then(|| self.file("client.pem")),
            key_file: client_cert.then(|| self.file("client.key")),
        };
        ClientOptions {
            connect_timeout: Duration::from_secs(5),
            security: ClientSecurity {
                tls: Some(ClientTls::from_files(&files, None).expect("client TLS files")),
                token: token.and_then(Token::new),
            },
            ..ClientOptions::default()
        }
    }
}

fn pinq(args: &[&str]) -> (i32, String, String) {
    try_cli_within(args, None, Duration::from_secs(60))
        .unwrap_or_else(|(out, err)| panic!("pinq {args:?} hung; stdout:\n{out}\nstderr:\n{err}"))
}

/// Runs `body` on an executor of its own, failing the test if it takes longer than `limit`.
fn within<T: Send + 'static>(limit: Duration, body: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(body());
    });
    rx.recv_timeout(limit)
        .unwrap_or_else(|_| panic!("did not finish within {limit:?}"))
}

#[test]
fn publish_and_consume_over_tls_with_a_valid_token() {
    let pki = Pki::new();
    let server = pki.server(&[], &[]);
    let addr = server.server_arg();
    let (ca, token) = (pki.path("ca.pem"), pki.path("billing.token"));
    // The certificate names 127.0.0.1: no --tls-server-name needed.
    let (code, _, err) = pinq(&[
        "publish",
        "--server",
        &addr,
        "--topic",
        "orders",
        "--tls-ca",
        &ca,
        "--token-file",
        &token,
        "first",
        "second",
    ]);
    assert_eq!(code, 0, "publish over TLS: {err}");
    let (code, out, err) = pinq(&[
        "consume",
        "--server",
        &addr,
        "--topic",
        "orders",
        "--count",
        "2",
        "--timeout",
        "20s",
        "--tls-ca",
        &ca,
        "--tls-server-name",
        "localhost",
        "--token-file",
        &token,
    ]);
    assert_eq!(code, 0, "consume over TLS: {err}");
    let got: Vec<&str> = out.lines().collect();
    assert_eq!(got, ["first", "second"], "stderr: {err}");

    // The library too, on a shard's own port (also TLS).
    let options = pki.client_options(Some(BILLING_SECRET), false);
    let own = format!("127.0.0.1:{}", server.shard_ports[0]);
    let tags = within(Duration::from_secs(30), move || {
        on_executor(move || async move {
            let client = Client::connect_with(own.as_str(), &options)
                .await
                .expect("connect");
            assert_eq!(client.server().shard_id, Some(0));
            let message = pinq::client::PublishMessage::new("orders".to_owned(), b"x".to_vec());
            client
                .publish([message], pinq::client::AckLevel::Durable)
                .await
                .expect("publish")
                .len()
        })
    });
    assert_eq!(tags, 1);
}

#[test]
fn a_missing_wrong_or_insufficient_token_is_refused_typed_and_nothing_is_stored() {
    let pki = Pki::new();
    let server = pki.server(&[], &[]);
    let addr = server.server_arg();
    let ca = pki.path("ca.pem");
    let publish = |topic: &str, token: Option<&str>| {
        let mut args = vec![
            "publish", "--server", &addr, "--topic", topic, "--tls-ca", &ca,
        ];
        let file;
        if let Some(name) = token {
            file = pki.path(name);
            args.extend(["--token-file", file.as_str()]);
        }
        args.push("must-not-be-stored");
        pinq(&args)
    };

    let (code, _, err) = publish("orders", None);
    assert_ne!(code, 0);
    assert!(err.contains("unauthenticated: "), "no token: {err}");
    assert!(err.contains("requires a token"), "{err}");

    let (code, _, err) = publish("orders", Some("wrong.token"));
    assert_ne!(code, 0);
    assert!(err.contains("unauthenticated: "), "wrong token: {err}");
    assert!(
        !err.contains("billing-secret"),
        "a refusal never shows a secret: {err}"
    );

    let (code, _, err) = publish("billing.eu", Some("billing.token"));
    assert_ne!(code, 0);
    assert!(err.contains("forbidden: "), "no publish right: {err}");
    assert!(
        err.contains("\"billing\" may not publish to topic \"billing.eu\""),
        "the refusal names the token, the action and the topic: {err}"
    );

    // Stats are an admin call: refused to billing, answered to ops, and nothing was stored.
    let (code, _, err) = pinq(&[
        "stats",
        "--server",
        &addr,
        "--tls-ca",
        &ca,
        "--token-file",
        &pki.path("billing.token"),
    ]);
    assert_ne!(code, 0);
    assert!(
        err.contains("forbidden: ") && err.contains("stats"),
        "{err}"
    );
    let options = pki.client_options(Some(OPS_SECRET), false);
    let target = addr.clone();
    let published = within(Duration::from_secs(30), move || {
        on_executor(move || async move {
            let client = Client::connect_with(target.as_str(), &options)
                .await
                .expect("connect");
            let stats = client.stats().await.expect("stats as admin");
            stats.shards.iter().map(|s| s.published).sum::<u64>()
        })
    });
    assert_eq!(published, 0, "a refused publish stores nothing");

    // Every refusal is counted by reason (snapshots are published once a second).
    let metrics = server.metrics_addr.expect("metrics address");
    let deadline = Instant::now() + Duration::from_secs(15);
    let wanted = [
        "missingToken",
        "unknownToken",
        "publishForbidden",
        "adminForbidden",
    ];
    loop {
        let (_, page) = http_get(metrics, "/metrics");
        let counted = |reason: &str| {
            sample(
                &page,
                "pinq_auth_refusals_total",
                &format!("shard=\"0\",reason=\"{reason}\""),
            )
            .unwrap_or(0.0)
        };
        if wanted.iter().all(|r| counted(r) >= 1.0) {
            assert!(
                sample(
                    &page,
                    "pinq_refusals_total",
                    "shard=\"0\",code=\"unauthenticated\""
                )
                .unwrap_or(0.0)
                    >= 2.0
            );
            break;
        }
        assert!(
            Instant::now() < deadline,
            "auth refusals not counted: {:?}",
            wanted.map(|r| (r, counted(r)))
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

#[test]
fn a_plain_client_on_the_tls_port_is_closed_never_left_hanging() {
    let pki = Pki::new();
    let server = pki.server(&[], &[("PINQ_SERVER_FRAME_TIMEOUT", "1s")]);
    let addr = server.server_arg();

    // The Rust client without TLS: its Cap'n Proto hello is not a TLS record.
    let target = addr.clone();
    let outcome = within(Duration::from_secs(20), move || {
        on_executor(move || async move {
            Client::connect(target.as_str())
                .await
                .map(|_| ())
                .map_err(|e| e.to_string())
        })
    });
    assert!(
        outcome.is_err(),
        "a plain client must not get through: {outcome:?}"
    );

    // Garbage bytes: closed at once.
    let mut raw = std::net::TcpStream::connect(&addr).expect("connect");
    raw.set_read_timeout(Some(Duration::from_secs(10)))
        .expect("timeout");
    raw.write_all(&[0u8; 64]).expect("write");
    let mut buf = [0u8; 256];
    let closed = loop {
        match raw.read(&mut buf) {
            Ok(0) => break true,
            Ok(_) => continue, // a TLS alert first
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => break true,
            Err(e) => panic!("the broker kept a plain connection open: {e}"),
        }
    };
    assert!(closed);

    // A silent client: closed once server.frameTimeout (1 s here) passes without a handshake.
    let started = Instant::now();
    let mut silent = std::net::TcpStream::connect(&addr).expect("connect");
    silent
        .set_read_timeout(Some(Duration::from_secs(10)))
        .expect("timeout");
    match silent.read(&mut buf) {
        Ok(0) => {}
        Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => {}
        other => panic!("a silent client was not closed: {other:?}"),
    }
    eprintln!("silent client closed after {:?}", started.elapsed());
}

#[test]
fn a_required_client_certificate_that_is_missing_is_refused() {
    let pki = Pki::new();
    let ca = pki.path("ca.pem");
    let server = pki.server(&["--tls-client-ca", &ca], &[]);
    let addr = server.server_arg();
    let token = pki.path("ops.token");
    let (code, out, err) = pinq(&[
        "topology",
        "--server",
        &addr,
        "--tls-ca",
        &ca,
        "--token-file",
        &token,
    ]);
    assert_ne!(code, 0, "no client certificate, yet: {out}");
    eprintln!("refused without a client certificate: {err}");
    let (cert, key) = (pki.path("client.pem"), pki.path("client.key"));
    let (code, out, err) = pinq(&[
        "topology",
        "--server",
        &addr,
        "--tls-ca",
        &ca,
        "--tls-cert",
        &cert,
        "--tls-key",
        &key,
        "--token-file",
        &token,
    ]);
    assert_eq!(code, 0, "with the client certificate: {err}");
    assert!(out.contains("shard 0"), "{out}");
    // A certificate the client CA did not sign (self-signed) is refused too.
    let (cert, key) = (pki.path("other.pem"), pki.path("other.key"));
    let (code, _, _) = pinq(&[
        "topology",
        "--server",
        &addr,
        "--tls-ca",
        &ca,
        "--tls-cert",
        &cert,
        "--tls-key",
        &key,
        "--token-file",
        &token,
    ]);
    assert_ne!(
        code, 0,
        "a client certificate of another CA must be refused"
    );
}

#[test]
fn a_bad_certificate_file_stops_start_up_naming_the_file() {
    let pki = Pki::new();
    let data = tempfile::tempdir().expect("temp dir");
    let data_dir = data.path().to_string_lossy().into_owned();
    let serve = |cert: &str, key: &str| {
        pinq(&[
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--metrics-listen",
            "127.0.0.1:0",
            "--data-dir",
            &data_dir,
            "--storage",
            "memory",
            "--cpus",
            "0",
            "--tls-cert",
            cert,
            "--tls-key",
            key,
        ])
    };
    let missing = pki.path("no-such.pem");
    let cases = [
        (
            missing.clone(),
            pki.path("server.key"),
            missing.clone(),
            "cannot read",
        ),
        (
            pki.path("server.pem"),
            pki.path("other.key"),
            pki.path("other.key"),
            "does not belong",
        ),
        (
            pki.path("expired.pem"),
            pki.path("server.key"),
            pki.path("expired.pem"),
            "expired",
        ),
        (
            pki.path("server.key"),
            pki.path("server.key"),
            pki.path("server.key"),
            "CERTIFICATE",
        ),
    ];
    for (cert, key, named, why) in cases {
        let (code, out, err) = serve(&cert, &key);
        assert_ne!(code, 0, "started with {cert} and {key}: {out}");
        assert!(!out.contains("pinq listening"), "{out}");
        assert!(
            err.contains(&named) && err.contains(why),
            "{cert} / {key}: {err}"
        );
    }
}

#[test]
fn calls_before_hello_are_refused_and_an_unknown_version_too() {
    use pinq::rpc::pinq_capnp::broker;
    let server = Server::start(&["--storage", "memory", "--cpus", "0"]);
    let addr = server.addr;
    let texts = within(Duration::from_secs(30), move || {
        on_executor(move || async move {
            let stream = glommio::net::TcpStream::connect(addr)
                .await
                .expect("connect");
            let (reader, writer) = futures_lite::io::split(stream);
            let network = capnp_rpc::twoparty::VatNetwork::new(
                futures_lite::io::BufReader::new(reader),
                futures_lite::io::BufWriter::new(writer),
                capnp_rpc::rpc_twoparty_capnp::Side::Client,
                Default::default(),
            );
            let mut rpc = capnp_rpc::RpcSystem::new(Box::new(network), None);
            let broker: broker::Client = rpc.bootstrap(capnp_rpc::rpc_twoparty_capnp::Side::Server);
            let _task = glommio::spawn_local(rpc);
            let text = |r: Result<(), capnp::Error>| match r {
                Ok(()) => "ok".to_owned(),
                Err(e) => e.extra,
            };
            let before = text(broker.topology_request().send().promise.await.map(|_| ()));
            let stats = text(broker.stats_request().send().promise.await.map(|_| ()));
            let mut hello = broker.hello_request();
            hello.get().set_client_version(999);
            let unknown = text(hello.send().promise.await.map(|_| ()));
            let mut hello = broker.hello_request();
            hello.get().set_client_version(pinq::rpc::PROTOCOL_VERSION);
            let good = text(hello.send().promise.await.map(|_| ()));
            let after = text(broker.topology_request().send().promise.await.map(|_| ()));
            [before, stats, unknown, good, after]
        })
    });
    let [before, stats, unknown, good, after] = texts;
    assert!(before.contains("helloRequired: "), "{before}");
    assert!(stats.contains("helloRequired: "), "{stats}");
    assert!(
        unknown.contains("unsupportedVersion: ") && unknown.contains("999"),
        "{unknown}"
    );
    assert_eq!(good, "ok");
    assert_eq!(after, "ok", "after a hello, calls are served");
}

/// The Python example of `schema/examples/` over TLS with a token (skipped without pycapnp,
/// unless `PINQ_REQUIRE_PYTHON_CLIENT=1`, as in `tests/schema_python.rs`).
#[test]
fn the_python_example_speaks_tls_with_a_token() {
    let has_pycapnp = Command::new("python3")
        .args(["-c", "import capnp"])
        .output()
        .map(|o| o.status.success())
        .unwrap_or(false);
    if !has_pycapnp {
        assert!(
            std::env::var("PINQ_REQUIRE_PYTHON_CLIENT").as_deref() != Ok("1"),
            "PINQ_REQUIRE_PYTHON_CLIENT=1 but python3 cannot import capnp"
        );
        eprintln!("skipped: python3 with pycapnp is not installed");
        return;
    }
    let pki = Pki::new();
    let server = pki.server(&[], &[]);
    let script = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/schema/examples/python_client.py"
    );
    let run = |token: &str| {
        Command::new("timeout")
            .args(["60", "python3", script, &server.server_arg(), "--tls-ca"])
            .arg(pki.path("ca.pem"))
            .args(["--tls-server-name", "localhost", "--token-file"])
            .arg(pki.path(token))
            .output()
            .expect("run python3")
    };
    let out = run("python.token");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && stdout.contains("delivered and acked 5 message(s)"),
        "python client over TLS failed ({}):\n{stdout}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    // The billing token may not use the example's topic: refused, typed.
    let out = run("billing.token");
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("forbidden: "), "{stderr}");
}
