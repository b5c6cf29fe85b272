//! `deploy/systemd/pinq.service`: it runs `pinq serve` as an unprivileged user, and the limits
//! and capabilities it sets pass the checks `pinq doctor` makes (memlock for the most shards a
//! host may run, open files for the default `server.maxConnections`). Where `systemd-analyze`
//! is installed, it also verifies the unit (with `ExecStart` pointed at the binary Cargo built).

use std::path::Path;
use std::process::Command;

use pinq::ops::checks::{self, Level};

fn unit() -> String {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy/systemd/pinq.service");
    std::fs::read_to_string(path).expect("read deploy/systemd/pinq.service")
}

/// The values of `key=` in the unit, in order (comments left out).
fn values<'a>(unit: &'a str, key: &str) -> Vec<&'a str> {
    unit.lines()
        .filter(|l| !l.trim_start().starts_with('#'))
        .filter_map(|l| l.strip_prefix(key)?.strip_prefix('='))
        .map(str::trim)
        .collect()
}

fn one<'a>(unit: &'a str, key: &str) -> &'a str {
    match values(unit, key)[..] {
        [value] => value,
        ref found => panic!("{key}= should be set once, found {found:?}"),
    }
}

/// A systemd limit as `pinq doctor` reads it from `/proc/self/limits` (`None`: unlimited).
fn limit(text: &str) -> Option<u64> {
    match text {
        "infinity" => None,
        n => Some(n.parse().expect("a limit is a number or infinity")),
    }
}

#[test]
fn the_unit_runs_pinq_serve_unprivileged_within_the_limits_doctor_checks() {
    let unit = unit();
    let user = one(&unit, "User");
    assert!(!user.is_empty() && user != "root", "User={user}");
    assert!(one(&unit, "ExecStart").contains("pinq serve"));
    assert_eq!(one(&unit, "NoNewPrivileges"), "true");
    // Only memory locking: what lets the I/O buffers of glommio's io_uring be registered.
    assert_eq!(one(&unit, "AmbientCapabilities"), "CAP_IPC_LOCK");
    assert_eq!(one(&unit, "CapabilityBoundingSet"), "CAP_IPC_LOCK");
    // As many shards as a large host runs, not privileged (the user is not root).
    let shards = 256;
    let memlock = checks::memlock(limit(one(&unit, "LimitMEMLOCK")), shards, false);
    assert_eq!(memlock.level, Level::Ok, "{memlock:?}");
    let connections_max = pinq::config::ServerConfig::default().client.connections_max as u64;
    let files = checks::open_files(limit(one(&unit, "LimitNOFILE")), shards, connections_max);
    assert_eq!(files.level, Level::Ok, "{files:?}");
    // SIGTERM is the graceful drain, given time to finish.
    assert_eq!(one(&unit, "KillSignal"), "SIGTERM");
}

#[test]
fn systemd_analyze_verifies_the_unit() {
    let installed = Command::new("systemd-analyze")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success());
    if !installed {
        eprintln!("skipped: systemd-analyze is not installed");
        return;
    }
    let tmp = tempfile::tempdir().expect("tempdir");
    let unit = unit().replace("/usr/local/bin/pinq", env!("CARGO_BIN_EXE_pinq"));
    let path = tmp.path().join("pinq.service");
    std::fs::write(&path, unit).expect("write the unit");
    let out = Command::new("timeout")
        .args(["60", "systemd-analyze", "verify", "--man=no"])
        .arg(&path)
        .output()
        .expect("run systemd-analyze");
    assert!(
        out.status.success() && out.stderr.is_empty(),
        "systemd-analyze verify: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}
