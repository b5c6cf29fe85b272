//! Tests of the node identity rule and of `[cluster.tls]`'s start-up checks, on certificates
//! made by the `openssl` program in a temporary directory.

use super::*;
use std::path::Path;
use std::process::Command;

/// A self-signed certificate with `san` (openssl's `subjectAltName` syntax) at `dir/name.pem`,
/// its key at `dir/name.key`.
fn make_cert(dir: &Path, name: &str, san: &str) -> CertificateDer<'static> {
    let out = Command::new("openssl")
        .args([
            "req",
            "-x509",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:P-256",
            "-nodes",
            "-days",
            "2",
            "-subj",
            &format!("/CN={name}"),
            "-addext",
            &format!("subjectAltName={san}"),
            "-keyout",
            &format!("{name}.key"),
            "-out",
            &format!("{name}.pem"),
        ])
        .current_dir(dir)
        .output()
        .expect("run openssl");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    tls::load_certs(&dir.join(format!("{name}.pem"))).unwrap()[0].clone()
}

fn identity(node_id: u64, ip: &str) -> NodeIdentity {
    NodeIdentity {
        node_id,
        ip: ip.parse().unwrap(),
    }
}

#[test]
fn a_certificate_names_a_node_by_its_dns_name_or_its_members_ip() {
    let dir = tempfile::tempdir().unwrap();
    let by_dns = make_cert(dir.path(), "dns", "DNS:pinq-node-2");
    let by_ip = make_cert(dir.path(), "ip", "IP:10.0.0.2,DNS:broker.example");
    assert_eq!(check_identity(&by_dns, &identity(2, "127.0.0.1")), Ok(()));
    assert_eq!(check_identity(&by_ip, &identity(2, "10.0.0.2")), Ok(()));
    // An IPv4 member matches its IPv4-mapped IPv6 form.
    assert_eq!(
        check_identity(&by_ip, &identity(7, "::ffff:10.0.0.2")),
        Ok(())
    );

    let err = check_identity(&by_dns, &identity(3, "127.0.0.1")).unwrap_err();
    assert_eq!(
        err.to_string(),
        "the certificate presented for node 3 names DNS:pinq-node-2, not IP 127.0.0.1 \
         (its address in cluster.peers) nor DNS pinq-node-3"
    );
    let err = check_identity(&by_ip, &identity(2, "10.0.0.3")).unwrap_err();
    let IdentityError::NotThisNode { presented, .. } = err else {
        panic!("{err:?}");
    };
    assert_eq!(presented, ["IP:10.0.0.2", "DNS:broker.example"]);
}

#[test]
fn only_the_exact_node_name_counts() {
    let dir = tempfile::tempdir().unwrap();
    let wildcard = make_cert(dir.path(), "wild", "DNS:*.pinq-node-1,DNS:pinq-node-12");
    assert!(check_identity(&wildcard, &identity(1, "127.0.0.1")).is_err());
    let upper = make_cert(dir.path(), "upper", "DNS:PINQ-NODE-1");
    assert_eq!(check_identity(&upper, &identity(1, "127.0.0.1")), Ok(()));
}

fn peers() -> BTreeMap<u64, SocketAddr> {
    [
        (1, "127.0.0.1:7101".parse().unwrap()),
        (2, "127.0.0.1:7102".parse().unwrap()),
    ]
    .into_iter()
    .collect()
}

#[test]
fn node_tls_checks_its_files_at_start_up_naming_each() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    make_cert(d, "node1", "DNS:pinq-node-1");
    make_cert(d, "node2", "DNS:pinq-node-2");
    let files = |cert: &str, key: &str, ca: &str| NodeTlsFiles {
        cert_file: d.join(cert),
        key_file: d.join(key),
        ca_file: d.join(ca),
    };
    let now = tls::unix_now_s();
    let (node, own) = NodeTls::from_files(
        &files("node1.pem", "node1.key", "node1.pem"),
        1,
        &peers(),
        now,
    )
    .unwrap();
    assert_eq!(own, None);
    assert!(node.dialer(2).is_some());
    assert!(node.dialer(1).is_none(), "a node never dials itself");

    // This node's certificate names node 2: it starts, and says its peers will refuse it.
    let (_, own) = NodeTls::from_files(
        &files("node2.pem", "node2.key", "node1.pem"),
        1,
        &peers(),
        now,
    )
    .unwrap();
    assert!(
        matches!(own, Some(IdentityError::NotThisNode { .. })),
        "{own:?}"
    );

    let err = NodeTls::from_files(
        &files("none.pem", "node1.key", "node1.pem"),
        1,
        &peers(),
        now,
    )
    .unwrap_err();
    assert!(err.to_string().contains("none.pem"), "{err}");
    let err = NodeTls::from_files(
        &files("node1.pem", "node2.key", "node1.pem"),
        1,
        &peers(),
        now,
    )
    .unwrap_err();
    assert!(matches!(err, TlsError::KeyMismatch { .. }), "{err}");
    let err = NodeTls::from_files(
        &files("node1.pem", "node1.key", "node1.key"),
        1,
        &peers(),
        now,
    )
    .unwrap_err();
    assert!(err.to_string().contains("node1.key"), "{err}");
    // Three days on, the two-day certificates have expired.
    let err = NodeTls::from_files(
        &files("node1.pem", "node1.key", "node1.pem"),
        1,
        &peers(),
        now + 3 * 86_400,
    )
    .unwrap_err();
    assert!(err.to_string().contains("expired"), "{err}");
}

#[test]
fn the_accepting_side_refuses_a_certificate_of_another_member() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let node2 = make_cert(d, "node2", "DNS:pinq-node-2");
    let files = NodeTlsFiles {
        cert_file: d.join("node2.pem"),
        key_file: d.join("node2.key"),
        ca_file: d.join("node2.pem"),
    };
    let (node, _) = NodeTls::from_files(&files, 2, &peers(), tls::unix_now_s()).unwrap();
    assert_eq!(node.check_peer(2, Some(&node2)), Ok(()));
    assert!(matches!(
        node.check_peer(1, Some(&node2)),
        Err(IdentityError::NotThisNode { .. })
    ));
    assert_eq!(
        node.check_peer(1, None),
        Err(IdentityError::NoCertificate { node_id: 1 })
    );
}
