//! A shard whose disk fills up heals once space returns, with a real `pinq serve`:
//! - durable publishes are refused with `diskFull` while the disk is full (nothing grows);
//! - messages stored before are still delivered meanwhile, and `/healthz` answers 503 naming
//!   the full disk;
//! - once a ballast file beside the data directory is deleted, durable publishes are accepted
//!   again within seconds and `/healthz` answers 200;
//! - every acknowledged message is delivered in the end, and the log holds a few warnings, not
//!   a flood.
//!
//! The disk is a 32 MiB ext4 image mounted through a loop device, so this needs root and
//! `mkfs.ext4`; where either is missing the test says so and passes without checking (CI runs
//! as root with e2fsprogs, and `PINQ_REQUIRE_LOOP_MOUNT=1` makes a missing mount a failure).

mod support;

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use pinq::client::{AckLevel, ClientError, PublishMessage};
use pinq::rpc::refusal::Code;
use support::{http_get, with_client, Server};

/// A small file system mounted for the test; unmounted when dropped.
struct SmallDisk {
    mount: PathBuf,
}

impl SmallDisk {
    fn mount(dir: &Path) -> Result<SmallDisk, String> {
        let image = dir.join("disk.img");
        let mount = dir.join("mnt");
        std::fs::create_dir_all(&mount).map_err(|e| e.to_string())?;
        let file = std::fs::File::create(&image).map_err(|e| e.to_string())?;
        file.set_len(32 << 20).map_err(|e| e.to_string())?;
        let run = |cmd: &mut Command| -> Result<(), String> {
            match cmd.status() {
                Ok(s) if s.success() => Ok(()),
                Ok(s) => Err(format!("{cmd:?} exited with {s}")),
                Err(e) => Err(format!("{cmd:?}: {e}")),
            }
        };
        run(Command::new("mkfs.ext4").args(["-q", "-F"]).arg(&image))?;
        run(Command::new("mount")
            .args(["-o", "loop"])
            .arg(&image)
            .arg(&mount))?;
        Ok(SmallDisk { mount })
    }
}

impl Drop for SmallDisk {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(&self.mount).status();
    }
}

/// Message `m` of batch `b`: names both, 16 KiB.
fn payload(b: u32, m: u32) -> Vec<u8> {
    let mut p = format!("b{b:05}-m{m:02}-").into_bytes();
    p.resize(16 << 10, b'#');
    p
}

const PER_BATCH: u32 = 16;

fn batch(b: u32) -> Vec<PublishMessage> {
    (0..PER_BATCH)
        .map(|m| PublishMessage::new("full", payload(b, m)))
        .collect()
}

/// The refusal of a full disk, by its code (the text is the fallback while the connection
/// layer sends it as a plain `failed` exception).
fn is_disk_full(e: &ClientError) -> bool {
    e.refusal() == Some(Code::DiskFull) || e.to_string().contains("disk full")
}

/// Receives (batch, message) pairs from `group` until nothing comes for 3 s or `max` arrived.
fn receive(addr: String, group: &'static str, max: usize) -> BTreeSet<(u32, u32)> {
    with_client(addr, move |client| async move {
        let sub = client
            .subscribe("full", group, 4096)
            .await
            .expect("subscribe");
        let mut got = BTreeSet::new();
        let deadline = Instant::now() + Duration::from_secs(120);
        while got.len() < max && Instant::now() < deadline {
            let batch = futures_lite::future::or(
                async { sub.recv_batch(1024).await.expect("stream open") },
                async {
                    glommio::timer::sleep(Duration::from_secs(3)).await;
                    Vec::new()
                },
            )
            .await;
            if batch.is_empty() {
                break;
            }
            for d in batch {
                let text = String::from_utf8_lossy(&d.payload[..10]).into_owned();
                let b: u32 = text[1..6].parse().expect("payload names its batch");
                let m: u32 = text[8..10].parse().expect("payload names its message");
                assert_eq!(d.payload, payload(b, m), "payload intact");
                got.insert((b, m));
            }
        }
        got
    })
}

/// Polls `/healthz` (bounded) until its status is `want`; returns the last answer.
fn healthz_until(addr: std::net::SocketAddr, want: u16, within: Duration) -> (u16, String) {
    let deadline = Instant::now() + within;
    loop {
        let answer = http_get(addr, "/healthz");
        if answer.0 == want || Instant::now() > deadline {
            return answer;
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

#[test]
fn a_full_disk_refuses_writes_serves_reads_and_heals_when_space_returns() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let disk = match SmallDisk::mount(tmp.path()) {
        Ok(disk) => disk,
        Err(why) => {
            assert!(
                std::env::var_os("PINQ_REQUIRE_LOOP_MOUNT").is_none(),
                "cannot mount a loop file system: {why}"
            );
            eprintln!("skipped: cannot mount a loop file system here ({why})");
            return;
        }
    };
    // The ballast is written before the broker fills the rest; deleting it gives space back.
    let ballast = disk.mount.join("ballast");
    std::fs::write(&ballast, vec![0x5au8; 8 << 20]).expect("ballast");
    let data_dir = disk.mount.join("data");
    let env = [
        ("PINQ_PUBLISH_MAX_MESSAGE_BYTES", "64KiB"),
        ("PINQ_STORAGE_MEMTABLE_BYTES", "1MiB"),
    ];
    let mut server = Server::start_in(&data_dir, &["--cpus", "0", "--storage", "lsm"], &env);
    let metrics = server.metrics_addr.expect("metrics endpoint");

    // Durable publishes until the store refuses one (24 MiB cannot hold 64 MiB), and on until
    // `/healthz` reports the full disk: the disk has room again for a moment whenever a failed
    // compaction removes its output, and a refusal is only reported while writes fail.
    let addr = server.server_arg();
    let (mut acked, refusals, health) = with_client(addr, move |client| async move {
        let mut acked = Vec::new();
        let mut refusals = Vec::new();
        let deadline = Instant::now() + Duration::from_secs(120);
        let mut b = 0u32;
        while Instant::now() < deadline {
            match client.publish(batch(b), AckLevel::Durable).await {
                Ok(_) => acked.push(b),
                Err(e) => {
                    refusals.push((is_disk_full(&e), e.to_string()));
                    let answer = http_get(metrics, "/healthz");
                    if answer.0 == 503 {
                        return (acked, refusals, Some(answer.1));
                    }
                    glommio::timer::sleep(Duration::from_millis(100)).await;
                }
            }
            b += 1;
        }
        (acked, refusals, None)
    });
    assert!(
        !refusals.is_empty(),
        "a 32 MiB disk took {} batches of 256 KiB",
        acked.len()
    );
    assert!(
        refusals.iter().all(|(coded, _)| *coded),
        "every refusal is diskFull: {refusals:?}"
    );
    let body = health.expect("/healthz answered 503 while publishes were refused");
    assert!(body.contains("disk full"), "/healthz names it: {body}");
    assert!(
        acked.len() > 10,
        "some batches were stored first: {}",
        acked.len()
    );

    // Reads go on: stored messages are delivered while writes are refused.
    let early = receive(server.server_arg(), "reader", 64);
    assert!(
        early.len() >= 64,
        "stored messages are delivered while the disk is full: {}",
        early.len()
    );

    // Space comes back: durable publishes are accepted again within seconds.
    std::fs::remove_file(&ballast).expect("remove ballast");
    let freed = Instant::now();
    let healed = with_client(server.server_arg(), |client| async move {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            match client.publish(batch(99_999), AckLevel::Durable).await {
                Ok(_) => return Ok(()),
                Err(e) if is_disk_full(&e) && Instant::now() < deadline => {
                    glommio::timer::sleep(Duration::from_millis(200)).await;
                }
                Err(e) => return Err(e.to_string()),
            }
        }
    });
    healed.expect("a durable publish is accepted once space returns");
    eprintln!(
        "figures: {} batches stored, {} refused, first durable publish accepted {:?} after space returned",
        acked.len(),
        refusals.len(),
        freed.elapsed()
    );
    acked.push(99_999);
    let (status, body) = healthz_until(metrics, 200, Duration::from_secs(15));
    assert_eq!(status, 200, "/healthz once space is back: {body}");

    // Nothing acknowledged is lost. The same group: its copies the first consumer held are
    // delivered again, and a group only sees messages from the first scan after it existed.
    let want = acked.len() * PER_BATCH as usize;
    let all = receive(server.server_arg(), "reader", usize::MAX);
    for &b in &acked {
        for m in 0..PER_BATCH {
            assert!(
                all.contains(&(b, m)),
                "acknowledged message {b}/{m} delivered"
            );
        }
    }
    assert!(
        all.len() >= want,
        "{} delivered, {want} acknowledged",
        all.len()
    );

    let status = server.signal_and_wait("TERM", Duration::from_secs(60));
    assert_eq!(
        status,
        Some(0),
        "a graceful stop after the disk healed exits 0"
    );
    let output = server.drain_output();
    let noisy = output
        .iter()
        .filter(|l| l.contains("ERROR") || l.contains("WARN"))
        .count();
    eprintln!("figures: {noisy} WARN/ERROR lines in the whole run");
    assert!(
        noisy <= 40,
        "warnings are rate-limited, not a flood: {noisy} lines"
    );
    assert!(!output.iter().any(|l| l.contains("panicked")), "no panic");
}

/// The cluster's one failure rule: a member whose disk fills cannot heal as the standalone store
/// does (its Raft log cannot refuse what the group committed), so its Raft driver stops and the
/// node exits naming the reason, never serving with a dead driver; the two others keep
/// serving durable publishes.
#[test]
fn a_cluster_member_whose_disk_fills_stops_and_the_others_serve_on() {
    use support::cluster::Cluster;
    let env = [
        ("PINQ_PUBLISH_MAX_MESSAGE_BYTES", "64KiB"),
        ("PINQ_STORAGE_MEMTABLE_BYTES", "1MiB"),
    ];
    let mut cluster = Cluster::new(3, &env);
    let disk = match SmallDisk::mount(&cluster.scratch_dir("small")) {
        Ok(disk) => disk,
        Err(why) => {
            assert!(
                std::env::var_os("PINQ_REQUIRE_LOOP_MOUNT").is_none(),
                "cannot mount a loop file system: {why}"
            );
            eprintln!("skipped: cannot mount a loop file system here ({why})");
            return;
        }
    };
    let small = disk.mount.join("node3");
    let args = vec![
        cluster.args(1, &[]),
        cluster.args(2, &[]),
        cluster.args(3, &[("--data-dir", &small.display().to_string())]),
    ];
    cluster.start_nodes(&[1, 2, 3], args);

    // Durable publishes through whichever node leads, until node 3 (every member stores every
    // message; its disk holds 32 MiB) has stopped.
    let deadline = Instant::now() + Duration::from_secs(180);
    let mut stored = 0u32;
    let mut b = 0u32;
    let status = loop {
        assert!(
            Instant::now() < deadline,
            "node 3 still runs after {stored} batches of 256 KiB on a 32 MiB disk"
        );
        if !cluster.server_mut(3).is_running() {
            break cluster.server_mut(3).wait_exit(Duration::from_secs(5));
        }
        let among = cluster.running();
        let leader = cluster.wait_for_leader(0, &among, Duration::from_secs(30));
        let addr = cluster.addr(leader);
        let first = b;
        let ok = with_client(addr, move |client| async move {
            let mut ok = 0u32;
            for b in first..first + 8 {
                if client.publish(batch(b), AckLevel::Durable).await.is_err() {
                    break;
                }
                ok += 1;
            }
            ok
        });
        stored += ok;
        b += 8;
    };
    assert!(
        matches!(status, Some(code) if code != 0),
        "node 3 exits with an error status: {status:?}"
    );
    let lines = cluster.server(3).drain_output().join("\n");
    assert!(
        lines.contains("the raft driver stop"),
        "node 3 says why it stopped:\n{lines}"
    );
    assert!(stored > 10, "batches were stored first: {stored}");

    // The two others serve on: a durable publish through the leader among them succeeds.
    let leader = cluster.wait_for_leader(0, &[1, 2], Duration::from_secs(30));
    let published = with_client(cluster.addr(leader), move |client| async move {
        client.publish(batch(b), AckLevel::Durable).await
    });
    assert!(published.is_ok(), "{published:?}");
    drop(disk);
}
