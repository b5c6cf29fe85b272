//! The broker a bench run drives: a `pinq serve` child process the bench starts (the default),
//! or one already running (`--server`), and the reading of its CPU time and peak memory from
//! `/proc/<pid>`.
//!
//! Why a child process and not shards inside the bench process: the broker's CPU time and peak
//! resident memory must be the broker's alone, not mixed with the load generator's, and a
//! separate process is measured from `/proc/<pid>` exactly the way a broker started by hand is
//! (`--server ADDR --broker-pid PID`). It also runs the very binary and start-up path users run.
//! The child is killed when the [`Broker`] is dropped; its data directory is removed.

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use anyhow::Context;

/// How long a child broker may take to print its listening line.
const START_TIMEOUT: Duration = Duration::from_secs(30);
/// Clock ticks per second of `/proc/<pid>/stat` times: USER_HZ, 100 in Linux's user ABI.
const USER_HZ: f64 = 100.0;

/// How to start a child broker.
#[derive(Clone, Debug)]
pub struct ChildSpec {
    /// `--cpus` of `pinq serve`.
    pub cpus: String,
    /// `--storage` of `pinq serve`.
    pub storage: String,
    /// Extra `PINQ_…` settings for the child.
    pub env: Vec<(String, String)>,
}

/// The broker under test.
pub struct Broker {
    pub addr: String,
    /// Its process id, when known: resource use is read from `/proc/<pid>`.
    pub pid: Option<u32>,
    child: Option<Child>,
    data_dir: Option<PathBuf>,
}

impl Broker {
    /// A broker someone else runs.
    pub fn external(addr: String, pid: Option<u32>) -> Broker {
        Broker {
            addr,
            pid,
            child: None,
            data_dir: None,
        }
    }

    /// Starts `pinq serve` (this very executable) on ephemeral ports and waits for its
    /// `pinq listening on ADDR …` line.
    pub fn start_child(spec: &ChildSpec) -> anyhow::Result<Broker> {
        let exe = std::env::current_exe().context("finding the pinq executable")?;
        let data_dir = std::env::temp_dir().join(format!(
            "pinq-bench-{}-{}",
            std::process::id(),
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos())
                .unwrap_or(0)
        ));
        let mut cmd = Command::new(&exe);
        cmd.arg("serve")
            .args(["--listen", "127.0.0.1:0", "--metrics-listen", "127.0.0.1:0"])
            .arg("--data-dir")
            .arg(&data_dir)
            .args(["--cpus", &spec.cpus, "--storage", &spec.storage])
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        if std::env::var_os("RUST_LOG").is_none() {
            cmd.env("RUST_LOG", "warn");
        }
        for (k, v) in &spec.env {
            cmd.env(k, v);
        }
        let mut child = cmd
            .spawn()
            .with_context(|| format!("starting {} serve", exe.display()))?;
        let pid = child.id();
        let Some(stdout) = child.stdout.take() else {
            anyhow::bail!("the broker's stdout was not captured");
        };
        let (tx, rx) = mpsc::channel::<String>();
        std::thread::spawn(move || {
            let mut sent = false;
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if !sent {
                    if let Some(addr) = listening_addr(&line) {
                        let _ = tx.send(addr.to_owned());
                        sent = true;
                    }
                }
                // Keep reading so the child never blocks on a full pipe.
            }
        });
        let mut broker = Broker {
            addr: String::new(),
            pid: Some(pid),
            child: Some(child),
            data_dir: Some(data_dir),
        };
        match rx.recv_timeout(START_TIMEOUT) {
            Ok(addr) => broker.addr = addr,
            Err(_) => anyhow::bail!(
                "the broker (pid {pid}) did not print its listening line within {START_TIMEOUT:?}"
            ),
        }
        Ok(broker)
    }

    /// CPU seconds (user + system) the broker has used so far.
    pub fn cpu_secs(&self) -> Option<f64> {
        let stat = std::fs::read_to_string(format!("/proc/{}/stat", self.pid?)).ok()?;
        cpu_secs_from_stat(&stat)
    }

    /// Seconds the broker's threads have spent runnable but waiting for a CPU (the sum of the
    /// second field of `/proc/<pid>/task/*/schedstat`): on a shared machine, how much the
    /// broker was held back by other processes.
    pub fn runqueue_wait_secs(&self) -> Option<f64> {
        let tasks = std::fs::read_dir(format!("/proc/{}/task", self.pid?)).ok()?;
        let mut wait_ns = 0u64;
        for task in tasks.flatten() {
            if let Ok(text) = std::fs::read_to_string(task.path().join("schedstat")) {
                wait_ns += wait_ns_from_schedstat(&text).unwrap_or(0);
            }
        }
        Some(wait_ns as f64 / 1e9)
    }

    /// Peak resident set so far, in bytes.
    pub fn peak_rss_bytes(&self) -> Option<u64> {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.pid?)).ok()?;
        peak_rss_from_status(&status)
    }
}

impl Drop for Broker {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
        if let Some(dir) = self.data_dir.take() {
            let _ = std::fs::remove_dir_all(dir);
        }
    }
}

/// The address in `pinq listening on ADDR with …`.
fn listening_addr(line: &str) -> Option<&str> {
    line.strip_prefix("pinq listening on ")?
        .split_whitespace()
        .next()
}

/// utime + stime (fields 14 and 15) of `/proc/<pid>/stat`, in seconds. The command name (field
/// 2) may hold spaces, so fields are counted after its closing parenthesis.
fn cpu_secs_from_stat(stat: &str) -> Option<f64> {
    let rest = &stat[stat.rfind(')')? + 1..];
    let mut fields = rest.split_whitespace();
    // After ")" come field 3 (state) onwards: utime is field 14, the 12th from here.
    let utime: u64 = fields.nth(11)?.parse().ok()?;
    let stime: u64 = fields.next()?.parse().ok()?;
    Some((utime + stime) as f64 / USER_HZ)
}

/// Run-queue wait (the second of `schedstat`'s three fields), in ns.
fn wait_ns_from_schedstat(text: &str) -> Option<u64> {
    text.split_whitespace().nth(1)?.parse().ok()
}

/// `VmHWM` of `/proc/<pid>/status`, in bytes.
fn peak_rss_from_status(status: &str) -> Option<u64> {
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn listening_line_gives_the_shared_address() {
        assert_eq!(
            listening_addr(
                "pinq listening on 127.0.0.1:4242 with 1 shard(s) on CPUs [0]; shard ports 5"
            ),
            Some("127.0.0.1:4242")
        );
        assert_eq!(listening_addr("something else"), None);
    }

    #[test]
    fn stat_times_are_read_after_the_command_name() {
        let stat = "42 (pinq shard 0) S 1 42 42 0 -1 4194560 100 0 0 0 250 50 0 0 20 0 3 0";
        assert_eq!(cpu_secs_from_stat(stat), Some(3.0));
    }

    #[test]
    fn peak_rss_is_read_from_vmhwm() {
        let status = "Name:\tpinq\nVmPeak:\t 9000 kB\nVmHWM:\t    2048 kB\nVmRSS:\t 1000 kB\n";
        assert_eq!(peak_rss_from_status(status), Some(2048 * 1024));
    }

    #[test]
    fn schedstat_wait_is_the_second_field() {
        assert_eq!(wait_ns_from_schedstat("123 456 7\n"), Some(456));
        assert_eq!(wait_ns_from_schedstat("123"), None);
    }

    #[test]
    fn own_process_has_readable_usage() {
        let me = Broker::external(String::new(), Some(std::process::id()));
        assert!(me.cpu_secs().is_some());
        assert!(me.peak_rss_bytes().is_some_and(|b| b > 0));
    }
}
