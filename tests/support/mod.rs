//! Test support: a real `pinq serve` process on 127.0.0.1 with ephemeral ports.
//!
//! `Server::start(args)` spawns the binary Cargo built for this test run, reads the line
//! `pinq listening on ADDR with N shard(s) on CPUs [..]; shard ports P,Q` from its stdout, then
//! the line `pinq metrics on ADDR` that follows it, and returns once the broker accepts
//! connections. Dropping the `Server` kills the process.
//! Each test file that uses it declares `mod support;` and may use only part of it.
//! [`cluster::Cluster`] starts several such processes as the members of one Raft cluster.
#![allow(dead_code)]

pub mod cluster;

use std::ffi::OsString;
use std::io::{BufRead, BufReader, Read};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

/// How long a server may take to print its listening line.
const START_TIMEOUT: Duration = Duration::from_secs(30);

/// A running `pinq serve` child process.
pub struct Server {
    child: Option<Child>,
    /// The shared client address (every shard accepts on it).
    pub addr: SocketAddr,
    /// Each shard's own port, in shard order.
    pub shard_ports: Vec<u16>,
    /// The metrics endpoint (`/metrics`, `/healthz`), from the `pinq metrics on ADDR` line.
    pub metrics_addr: Option<SocketAddr>,
    /// The data directory the server was started with.
    pub data_dir: PathBuf,
    /// Everything the server printed (stdout and stderr merged), collected by a reader thread:
    /// the lines read while waiting for its address first, then the channel.
    startup_lines: std::cell::RefCell<Vec<String>>,
    output: mpsc::Receiver<String>,
    _tmp: Option<tempfile::TempDir>,
}

/// The path of the `pinq` binary built for this test run.
pub fn pinq_bin() -> &'static str {
    env!("CARGO_BIN_EXE_pinq")
}

impl Server {
    /// Starts `pinq serve --listen 127.0.0.1:0 --metrics-listen 127.0.0.1:0 --data-dir <tmp>`
    /// plus `args`, with `env` added to the environment. `args` must not repeat those three
    /// flags (clap refuses a flag given twice); [`Server::start_exact`] takes them all.
    pub fn start(args: &[&str]) -> Server {
        Server::start_with_env(args, &[])
    }

    /// Like [`Server::start`], with extra environment variables (`PINQ_DELIVERY_…`).
    pub fn start_with_env(args: &[&str], env: &[(&str, &str)]) -> Server {
        let tmp = tempfile::tempdir().expect("temp dir");
        let data_dir = tmp.path().join("data");
        let mut server = Server::start_in(&data_dir, args, env);
        server._tmp = Some(tmp);
        server
    }

    /// Starts a server on an existing data directory (to restart after a kill).
    pub fn start_in(data_dir: &Path, args: &[&str], env: &[(&str, &str)]) -> Server {
        let mut full: Vec<OsString> = [
            "--listen",
            "127.0.0.1:0",
            "--metrics-listen",
            "127.0.0.1:0",
            "--data-dir",
        ]
        .iter()
        .map(OsString::from)
        .collect();
        full.push(data_dir.into());
        full.extend(args.iter().map(OsString::from));
        Server::start_exact(data_dir, &full, env)
    }

    /// Starts `pinq serve ARGS` with exactly these arguments (a cluster member needs concrete
    /// ports); `data_dir` is what `ARGS` give as `--data-dir`, recorded in [`Server::data_dir`].
    pub fn start_exact(data_dir: &Path, args: &[OsString], env: &[(&str, &str)]) -> Server {
        let mut cmd = Command::new(pinq_bin());
        cmd.arg("serve")
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        cmd.env(
            "RUST_LOG",
            std::env::var("RUST_LOG").unwrap_or_else(|_| "warn".into()),
        );
        // A test's own environment wins (a test may ask for a module's info lines).
        for (k, v) in env {
            cmd.env(k, v);
        }
        let mut child = cmd.spawn().expect("spawn pinq serve");
        let stdout = child.stdout.take().expect("stdout");
        let stderr = child.stderr.take().expect("stderr");
        let (tx, rx) = mpsc::channel::<String>();
        let tx_err = tx.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        std::thread::spawn(move || {
            let mut reader = BufReader::new(stderr);
            let mut buf = String::new();
            loop {
                buf.clear();
                match reader.read_line(&mut buf) {
                    Ok(0) | Err(_) => break,
                    Ok(_) => {
                        eprint!("[pinq] {buf}");
                        if tx_err.send(buf.trim_end().to_string()).is_err() {
                            // Keep draining so the child never blocks on a full pipe.
                            let mut sink = Vec::new();
                            let _ = reader.read_to_end(&mut sink);
                            break;
                        }
                    }
                }
            }
        });
        let deadline = std::time::Instant::now() + START_TIMEOUT;
        let mut seen = Vec::new();
        let mut listening = None;
        loop {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            match rx.recv_timeout(left) {
                Ok(line) => {
                    if let Some(found) = parse_listening(&line) {
                        listening = Some(found);
                    } else if let (Some((addr, shard_ports)), Some(metrics_addr)) =
                        (&listening, parse_metrics(&line))
                    {
                        // The server prints the metrics line right after the listening line.
                        return Server {
                            child: Some(child),
                            addr: *addr,
                            shard_ports: shard_ports.clone(),
                            metrics_addr: Some(metrics_addr),
                            data_dir: data_dir.to_path_buf(),
                            startup_lines: std::cell::RefCell::new(std::mem::take(&mut seen)),
                            output: rx,
                            _tmp: None,
                        };
                    }
                    seen.push(line);
                }
                Err(_) => {
                    let _ = child.kill();
                    let status = child.wait().ok();
                    panic!(
                        "pinq serve did not report its address (status {status:?}); output:\n{}",
                        seen.join("\n")
                    );
                }
            }
        }
    }

    /// `127.0.0.1:PORT` of the shared client port, as the CLI's `--server` takes it.
    pub fn server_arg(&self) -> String {
        self.addr.to_string()
    }

    /// The address of shard `i`'s own port.
    pub fn shard_addr(&self, i: usize) -> SocketAddr {
        SocketAddr::new(self.addr.ip(), self.shard_ports[i])
    }

    /// The OS process id.
    pub fn pid(&self) -> u32 {
        self.child.as_ref().map(|c| c.id()).unwrap_or(0)
    }

    /// Kills the process with SIGKILL (as `kill -9` would) and reaps it.
    pub fn kill9(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Sends `signal` (e.g. `"TERM"`) with kill(1) and waits up to `timeout` for the exit.
    /// Returns the exit code, or `None` if it did not exit in time (it is then killed).
    pub fn signal_and_wait(&mut self, signal: &str, timeout: Duration) -> Option<i32> {
        let mut child = self.child.take()?;
        let _ = Command::new("kill")
            .arg(format!("-{signal}"))
            .arg(child.id().to_string())
            .status();
        let deadline = std::time::Instant::now() + timeout;
        loop {
            if let Ok(Some(status)) = child.try_wait() {
                return status.code();
            }
            if std::time::Instant::now() > deadline {
                let _ = child.kill();
                let _ = child.wait();
                return None;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Lines the server printed since start (stdout and stderr). While it runs, those read so
    /// far, without waiting. Once it has exited (or was killed), every line up to its end:
    /// stdout and stderr are read by two threads that may still be forwarding the last lines
    /// when the exit is seen, so this waits (up to 5 s) until both pipes are closed and read.
    pub fn drain_output(&self) -> Vec<String> {
        let mut lines = std::mem::take(&mut *self.startup_lines.borrow_mut());
        if self.child.is_some() {
            lines.extend(self.output.try_iter());
            return lines;
        }
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        loop {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            match self.output.recv_timeout(left) {
                Ok(line) => lines.push(line),
                Err(_) => return lines,
            }
        }
    }

    /// Waits up to `timeout` for the server to exit on its own; its exit status, or `None` if it
    /// was still running (it is then killed).
    pub fn wait_exit(&mut self, timeout: Duration) -> Option<i32> {
        let mut child = self.child.take()?;
        let deadline = std::time::Instant::now() + timeout;
        loop {
            if let Ok(Some(status)) = child.try_wait() {
                return status.code();
            }
            if std::time::Instant::now() > deadline {
                let _ = child.kill();
                let _ = child.wait();
                return None;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Whether the process is still running.
    pub fn is_running(&mut self) -> bool {
        match self.child.as_mut() {
            Some(c) => matches!(c.try_wait(), Ok(None)),
            None => false,
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.kill9();
    }
}

/// Parses `pinq listening on ADDR with N shard(s) on CPUs [..]; shard ports P,Q`.
fn parse_listening(line: &str) -> Option<(SocketAddr, Vec<u16>)> {
    let rest = line.strip_prefix("pinq listening on ")?;
    let addr: SocketAddr = rest.split_whitespace().next()?.parse().ok()?;
    let ports = rest
        .rsplit_once("shard ports ")?
        .1
        .split(',')
        .map(|p| p.trim().parse().ok())
        .collect::<Option<Vec<u16>>>()?;
    Some((addr, ports))
}

/// Parses `pinq metrics on ADDR`.
fn parse_metrics(line: &str) -> Option<SocketAddr> {
    line.strip_prefix("pinq metrics on ")?.trim().parse().ok()
}

/// `GET path` on the metrics endpoint: (status code, body). Plain HTTP/1.0 over std TCP.
pub fn http_get(addr: SocketAddr, path: &str) -> (u16, String) {
    use std::io::Write;
    let mut stream = std::net::TcpStream::connect(addr).expect("connect to the metrics endpoint");
    stream
        .set_read_timeout(Some(Duration::from_secs(30)))
        .expect("read timeout");
    write!(stream, "GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n").expect("send request");
    let mut response = String::new();
    stream.read_to_string(&mut response).expect("read response");
    let status = response
        .split_whitespace()
        .nth(1)
        .and_then(|code| code.parse().ok())
        .unwrap_or(0);
    let body = response
        .split_once("\r\n\r\n")
        .map(|(_, body)| body.to_string())
        .unwrap_or_default();
    (status, body)
}

/// Reads the value of the sample `name{labels}` (labels written exactly as the page shows
/// them, e.g. `shard="0"`) from a metrics page.
pub fn sample(page: &str, name: &str, labels: &str) -> Option<f64> {
    let prefix = format!("{name}{{{labels}}} ");
    page.lines()
        .find_map(|line| line.strip_prefix(prefix.as_str()))
        .and_then(|value| value.trim().parse().ok())
}

/// Runs `f` with a client connected to `addr`, on a glommio executor of its own.
pub fn with_client<T, F, Fut>(addr: String, f: F) -> T
where
    T: Send + 'static,
    F: FnOnce(pinq::client::Client) -> Fut + Send + 'static,
    Fut: std::future::Future<Output = T> + 'static,
{
    on_executor(move || async move {
        let client = pinq::client::Client::connect(addr.as_str())
            .await
            .expect("connect");
        f(client).await
    })
}

/// Runs an async test body on a glommio executor of its own (2 MiB of I/O memory, enough for
/// the storage engine's DMA buffers and within this machine's memlock limit) and returns its
/// result.
pub fn on_executor<T, F, Fut>(body: F) -> T
where
    T: Send + 'static,
    F: FnOnce() -> Fut + Send + 'static,
    Fut: std::future::Future<Output = T> + 'static,
{
    glommio::LocalExecutorBuilder::new(glommio::Placement::Unbound)
        .io_memory(2 << 20)
        .spawn(body)
        .expect("executor starts")
        .join()
        .expect("executor joins")
}

/// Runs the `pinq` CLI with `args` and optional stdin; returns (exit code, stdout, stderr).
pub fn cli(args: &[&str], stdin: Option<&str>) -> (i32, String, String) {
    cli_within(args, stdin, CLI_TIMEOUT)
}

/// How long [`cli`] lets a command run before it kills it and fails the test.
const CLI_TIMEOUT: Duration = Duration::from_secs(300);

/// Like [`cli`], but kills the command and panics (with what it printed) if it has not exited
/// within `timeout`: a client that keeps retrying must not hang a test.
pub fn cli_within(args: &[&str], stdin: Option<&str>, timeout: Duration) -> (i32, String, String) {
    match try_cli_within(args, stdin, timeout) {
        Ok(done) => done,
        Err((stdout, stderr)) => panic!(
            "pinq {args:?} did not exit within {timeout:?}; stdout:\n{stdout}\nstderr:\n{stderr}"
        ),
    }
}

/// Like [`cli_within`], but a command still running after `timeout` is killed and what it
/// printed until then (stdout, stderr) returned as the error, for a test that asserts on it.
pub fn try_cli_within(
    args: &[&str],
    stdin: Option<&str>,
    timeout: Duration,
) -> Result<(i32, String, String), (String, String)> {
    use std::io::Write;
    let mut child = Command::new(pinq_bin())
        .args(args)
        .stdin(if stdin.is_some() {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn pinq");
    // Stdin is written and the outputs read on threads of their own, so that a child blocked
    // on a full output pipe never waits on us writing its input (or the other way round).
    let writer = stdin.map(|input| {
        let mut pipe = child.stdin.take().expect("stdin");
        let input = input.to_owned();
        std::thread::spawn(move || {
            // A child that exits early closes its stdin: not this helper's error to report.
            let _ = pipe.write_all(input.as_bytes());
        })
    });
    let read_all = |mut pipe: Box<dyn Read + Send>| {
        std::thread::spawn(move || {
            let mut bytes = Vec::new();
            let _ = pipe.read_to_end(&mut bytes);
            String::from_utf8_lossy(&bytes).into_owned()
        })
    };
    let stdout = read_all(Box::new(child.stdout.take().expect("stdout")));
    let stderr = read_all(Box::new(child.stderr.take().expect("stderr")));
    let deadline = std::time::Instant::now() + timeout;
    let status = loop {
        if let Some(status) = child.try_wait().expect("wait pinq") {
            break Some(status);
        }
        if std::time::Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    if let Some(writer) = writer {
        let _ = writer.join();
    }
    let stdout = stdout.join().expect("stdout reader");
    let stderr = stderr.join().expect("stderr reader");
    match status {
        Some(status) => Ok((status.code().unwrap_or(-1), stdout, stderr)),
        None => Err((stdout, stderr)),
    }
}
