//! A shard whose disk fills up stops the whole broker, once and cleanly: the failure is logged
//! once, `pinq serve` exits with status 1 and an error naming the file, and no shard keeps
//! retrying and warning beside a `/healthz` that says ok.
//!
//! The disk is a 24 MiB ext4 image mounted through a loop device, so this needs root and
//! `mkfs.ext4`; where either is missing the test says so and passes without checking (CI runs
//! as root with e2fsprogs, and `PINQ_REQUIRE_LOOP_MOUNT=1` makes a missing mount a failure).

mod support;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use pinq::client::{AckLevel, PublishMessage};
use support::{with_client, Server};

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
        file.set_len(24 << 20).map_err(|e| e.to_string())?;
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

#[test]
fn a_full_disk_stops_the_broker_with_one_error_naming_the_file() {
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
    let data_dir = disk.mount.join("data");
    let env = [("PINQ_PUBLISH_MAX_MESSAGE_BYTES", "64KiB")];
    let mut server = Server::start_in(&data_dir, &["--cpus", "0", "--storage", "lsm"], &env);
    // Durable publishes until the store refuses one (24 MiB cannot hold 64 MiB of log).
    let refused = with_client(server.server_arg(), |client| async move {
        for b in 0..4096u32 {
            let messages: Vec<PublishMessage> = (0..16)
                .map(|m| PublishMessage::new("full", vec![(b + m) as u8; 16 << 10]))
                .collect();
            if let Err(e) = client.publish(&messages, AckLevel::Durable).await {
                return Some(e.to_string());
            }
        }
        None
    });
    let refused = refused.expect("a 24 MiB disk took 1 GiB of durable publishes");
    assert!(
        refused.contains("No space left"),
        "the refusal says why: {refused}"
    );
    let status = server.wait_exit(Duration::from_secs(60));
    assert_eq!(status, Some(1), "the broker stops with an error");
    let output = server.drain_output();
    let fatal: Vec<&String> = output
        .iter()
        .filter(|l| l.contains("storage failed for good"))
        .collect();
    assert_eq!(fatal.len(), 1, "logged once: {output:#?}");
    assert!(
        output.iter().any(|l| l.starts_with("pinq: error:")
            && l.contains("wal-")
            && l.contains("No space left")),
        "the exit error names the file and the cause: {output:#?}"
    );
    assert!(!output.iter().any(|l| l.contains("panicked")), "no panic");
}
