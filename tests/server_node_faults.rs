//! Faults that concern the whole node, against real `pinq serve` processes: a shard that
//! panics, or one of whose long-lived tasks ends, stops the node (never one dead shard beside
//! live ones), a second broker on the same
//! port or data directory is refused at start-up naming the holder, and `pinq consume` notices
//! a broker killed under it.

mod support;

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use support::{cli_within, pinq_bin, Server};

/// Runs `pinq serve ARGS` that is expected to stop by itself; returns (status, stderr).
fn serve_expecting_exit(args: &[&str], env: &[(&str, &str)], within: Duration) -> (i32, String) {
    let mut child = Command::new(pinq_bin())
        .arg("serve")
        .args(args)
        .envs(env.iter().copied())
        .env("RUST_BACKTRACE", "0")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn pinq serve");
    let deadline = Instant::now() + within;
    loop {
        if let Some(status) = child.try_wait().expect("wait") {
            let mut stderr = String::new();
            use std::io::Read as _;
            if let Some(mut pipe) = child.stderr.take() {
                let _ = pipe.read_to_string(&mut stderr);
            }
            return (status.code().unwrap_or(-1), stderr);
        }
        if Instant::now() >= deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("pinq serve {args:?} did not exit within {within:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn a_shard_that_panics_stops_the_whole_node_with_an_error() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let data = tmp.path().join("data");
    let data = data.to_str().expect("utf-8 path");
    let (status, stderr) = serve_expecting_exit(
        &[
            "--cpus",
            "0,1",
            "--listen",
            "127.0.0.1:0",
            "--metrics-listen",
            "127.0.0.1:0",
            "--data-dir",
            data,
        ],
        &[("PINQ_FAULT_PANIC_SHARD", "1")],
        Duration::from_secs(60),
    );
    assert_eq!(status, 1, "non-zero exit: {stderr}");
    assert!(
        stderr.contains("pinq: error:") && stderr.contains("panicked"),
        "the exit error names the panic: {stderr}"
    );
    assert!(
        stderr.contains("shard-1"),
        "it names the shard that panicked: {stderr}"
    );
}

/// The one failure rule: a long-lived shard task that returns outside a shutdown (here one
/// injected with `PINQ_FAULT_END_TASK_SHARD`) stops the node with the reason, never leaving the
/// shard serving without it.
#[test]
fn a_shard_task_that_ends_stops_the_whole_node_with_an_error() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let data = tmp.path().join("data");
    let data = data.to_str().expect("utf-8 path");
    let (status, stderr) = serve_expecting_exit(
        &[
            "--cpus",
            "0,1",
            "--listen",
            "127.0.0.1:0",
            "--metrics-listen",
            "127.0.0.1:0",
            "--data-dir",
            data,
        ],
        &[("PINQ_FAULT_END_TASK_SHARD", "1")],
        Duration::from_secs(60),
    );
    assert_eq!(status, 1, "non-zero exit: {stderr}");
    assert!(
        stderr.contains("pinq: error:")
            && stderr.contains("shard 1: an injected task ended unexpectedly"),
        "the exit error names the task and its shard: {stderr}"
    );
}

#[test]
fn a_second_broker_on_the_same_port_is_refused_naming_the_holder() {
    let first = Server::start(&["--cpus", "0"]);
    let tmp = tempfile::tempdir().expect("tempdir");
    let other = tmp.path().join("other");
    let listen = first.addr.to_string();
    let (status, stderr) = serve_expecting_exit(
        &[
            "--cpus",
            "0",
            "--listen",
            &listen,
            "--metrics-listen",
            "127.0.0.1:0",
            "--data-dir",
            other.to_str().expect("utf-8 path"),
        ],
        &[],
        Duration::from_secs(30),
    );
    assert_ne!(status, 0, "refused: {stderr}");
    assert!(
        stderr.contains("already in use"),
        "says the port is taken: {stderr}"
    );
    assert!(
        stderr.contains(&format!("pid {}", first.pid())),
        "names the broker holding it: {stderr}"
    );
}

#[test]
fn a_second_broker_on_the_same_data_directory_is_refused() {
    let first = Server::start(&["--cpus", "0"]);
    let data = first.data_dir.to_str().expect("utf-8 path").to_string();
    let (status, stderr) = serve_expecting_exit(
        &[
            "--cpus",
            "0",
            "--listen",
            "127.0.0.1:0",
            "--metrics-listen",
            "127.0.0.1:0",
            "--data-dir",
            &data,
        ],
        &[],
        Duration::from_secs(30),
    );
    assert_ne!(status, 0, "refused: {stderr}");
    assert!(
        stderr.contains("is in use by another pinq")
            && stderr.contains(&format!("pid {}", first.pid())),
        "names the directory's holder: {stderr}"
    );
}

#[test]
fn a_data_directory_left_by_a_killed_broker_opens_again() {
    let mut first = Server::start(&["--cpus", "0"]);
    let data = first.data_dir.clone();
    first.kill9();
    // The lock died with the process: a restart on the same directory starts.
    let second = Server::start_in(&data, &["--cpus", "0"], &[]);
    let holder = std::fs::read_to_string(data.join("pinq.lock")).expect("lock file");
    assert_eq!(
        holder.trim(),
        second.pid().to_string(),
        "the new broker holds the lock"
    );
}

#[test]
fn consume_ends_with_an_error_when_its_broker_is_killed() {
    let mut server = Server::start(&["--cpus", "0"]);
    let addr = server.server_arg();
    let consumer = {
        let addr = addr.clone();
        std::thread::spawn(move || {
            let started = Instant::now();
            let out = cli_within(
                &[
                    "consume",
                    "--server",
                    &addr,
                    "--topic",
                    "gone",
                    "--group",
                    "g",
                    "--timeout",
                    "120s",
                ],
                None,
                Duration::from_secs(150),
            );
            (out, started.elapsed())
        })
    };
    // Let the consumer subscribe, then kill the broker under it.
    std::thread::sleep(Duration::from_millis(1500));
    let killed_at = Instant::now();
    server.kill9();
    let ((status, _stdout, stderr), _ran) = consumer.join().expect("consumer thread");
    let after_kill = killed_at.elapsed();
    eprintln!("pinq consume exited {after_kill:?} after the broker's kill -9");
    assert_eq!(status, 1, "consume fails when its broker dies: {stderr}");
    assert!(
        stderr.contains("connection") || stderr.contains("broker"),
        "and says why: {stderr}"
    );
    assert!(
        after_kill < Duration::from_secs(30),
        "it ends soon after the kill, not at --timeout (ended {after_kill:?} after it): {stderr}"
    );
}
