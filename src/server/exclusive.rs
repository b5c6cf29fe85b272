//! One broker per port and per data directory.
//!
//! glommio binds every listener with `SO_REUSEPORT` (each shard accepts on the shared port), and
//! Linux lets any other socket of the same user that also sets it share the port: a second
//! `pinq serve` on the same `--listen` would start, say "listening" and take half the clients.
//! Before any shard binds, [`ensure_port_free`] binds each port once without `SO_REUSEPORT`,
//! which fails while anyone listens on it, and names the holder from `/proc` when it can.
//! (Two brokers started in the same instant can still both pass; the data directory lock below
//! catches that case when they share a directory.)
//!
//! [`lock_data_dir`] takes an advisory lock (`flock`) on `pinq.lock` in the data directory for
//! the life of the process and writes the holder's pid into it; a second broker on the same
//! directory is refused naming that pid. The lock is released by the kernel when the process
//! ends, however it ends (kill -9 included), so a stale file never blocks a restart.

use std::fs::{File, OpenOptions};
use std::io::{Read as _, Seek as _, Write as _};
use std::net::{SocketAddr, TcpListener};
use std::path::{Path, PathBuf};

/// The lock file's name inside the data directory.
pub const LOCK_FILE: &str = "pinq.lock";

/// Held for the life of the broker; dropping it releases the data directory.
#[derive(Debug)]
pub struct DirLock {
    _file: File,
    pub path: PathBuf,
}

/// Takes the data directory for this process, creating it if needed.
pub fn lock_data_dir(dir: &Path) -> anyhow::Result<DirLock> {
    std::fs::create_dir_all(dir)
        .map_err(|e| anyhow::anyhow!("cannot create the data directory {}: {e}", dir.display()))?;
    let path = dir.join(LOCK_FILE);
    let mut file = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(&path)
        .map_err(|e| anyhow::anyhow!("cannot open {}: {e}", path.display()))?;
    // `File::try_lock` is std's flock(LOCK_EX | LOCK_NB), stable since 1.89; the toolchain
    // these machines have is newer, the declared MSRV older.
    #[allow(clippy::incompatible_msrv)]
    let locked = file.try_lock();
    match locked {
        Ok(()) => {}
        Err(std::fs::TryLockError::WouldBlock) => {
            let mut holder = String::new();
            let _ = file.read_to_string(&mut holder);
            let holder = holder.trim();
            let who = if holder.is_empty() {
                "another process".to_string()
            } else {
                format!("another pinq (pid {holder})")
            };
            anyhow::bail!(
                "the data directory {} is in use by {who}: {} is locked; stop that broker or \
                 give this one its own --data-dir",
                dir.display(),
                path.display()
            );
        }
        Err(std::fs::TryLockError::Error(e)) => {
            anyhow::bail!("cannot lock {}: {e}", path.display())
        }
    }
    let pid = std::process::id();
    let written = file
        .set_len(0)
        .and_then(|()| file.rewind())
        .and_then(|()| writeln!(file, "{pid}"));
    if let Err(e) = written {
        tracing::warn!("could not write the pid into {}: {e}", path.display());
    }
    Ok(DirLock { _file: file, path })
}

/// Refuses a port another process listens on (with or without `SO_REUSEPORT`). Port 0 is
/// always free.
pub fn ensure_port_free(addr: SocketAddr, what: &str) -> anyhow::Result<()> {
    if addr.port() == 0 {
        return Ok(());
    }
    let deadline = std::time::Instant::now() + ORPHAN_WAIT;
    loop {
        match TcpListener::bind(addr) {
            Ok(probe) => {
                drop(probe);
                return Ok(());
            }
            Err(e) if e.kind() == std::io::ErrorKind::AddrInUse => {}
            Err(e) => anyhow::bail!("cannot listen on {what} {addr}: {e}"),
        }
        // Connections a stopped broker left behind (FIN_WAIT, TIME_WAIT) also fail this bind,
        // without anyone listening: only a listener is another broker.
        if !is_listened_on(addr.port()) {
            return Ok(());
        }
        if let Some(holder) = port_holder(addr.port()) {
            anyhow::bail!(
                "{what} {addr} is already in use by {holder}: another broker (or program) \
                 listens there; stop it or choose another port"
            );
        }
        // A listener no process holds: a broker killed a moment ago whose io_uring still
        // references its socket until the kernel tears the ring down. Wait for that; should it
        // outlast the wait, let the real bind (with SO_REUSEPORT) decide.
        if std::time::Instant::now() >= deadline {
            tracing::warn!(%addr, "{what}: a socket no process holds still listens there; binding beside it");
            return Ok(());
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
}

/// How long [`ensure_port_free`] waits for a listener without an owner to go away.
const ORPHAN_WAIT: std::time::Duration = std::time::Duration::from_secs(3);

/// Whether any socket listens on TCP `port` (`/proc/net/tcp`, `/proc/net/tcp6`). When the
/// tables cannot be read, assume so (refusing is the safe side).
fn is_listened_on(port: u16) -> bool {
    let tables: Vec<String> = ["/proc/net/tcp", "/proc/net/tcp6"]
        .iter()
        .filter_map(|table| std::fs::read_to_string(table).ok())
        .collect();
    tables.is_empty() || tables.iter().any(|t| !listening_inodes(t, port).is_empty())
}

/// `pid N (comm)` of a process listening on TCP `port`, read from `/proc` (best effort: `None`
/// when it cannot be told, for example for another user's process).
fn port_holder(port: u16) -> Option<String> {
    let inodes: Vec<String> = ["/proc/net/tcp", "/proc/net/tcp6"]
        .iter()
        .filter_map(|table| std::fs::read_to_string(table).ok())
        .flat_map(|text| listening_inodes(&text, port))
        .collect();
    if inodes.is_empty() {
        return None;
    }
    for entry in std::fs::read_dir("/proc").ok()?.flatten() {
        let name = entry.file_name();
        let Some(pid) = name
            .to_str()
            .filter(|n| n.bytes().all(|b| b.is_ascii_digit()))
        else {
            continue;
        };
        let Ok(fds) = std::fs::read_dir(entry.path().join("fd")) else {
            continue;
        };
        let holds = fds.flatten().any(|fd| {
            std::fs::read_link(fd.path()).is_ok_and(|link| {
                let link = link.to_string_lossy();
                inodes.iter().any(|i| link == format!("socket:[{i}]"))
            })
        });
        if holds {
            let comm = std::fs::read_to_string(entry.path().join("comm")).unwrap_or_default();
            return Some(format!("pid {pid} ({})", comm.trim()));
        }
    }
    None
}

/// Socket inodes listening on `port` in one `/proc/net/tcp` table.
fn listening_inodes(table: &str, port: u16) -> Vec<String> {
    const LISTEN: &str = "0A";
    table
        .lines()
        .skip(1)
        .filter_map(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            let local = fields.get(1)?;
            let state = fields.get(3)?;
            let inode = fields.get(9)?;
            let local_port = u16::from_str_radix(local.rsplit(':').next()?, 16).ok()?;
            (local_port == port && *state == LISTEN).then(|| inode.to_string())
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_second_lock_on_the_same_directory_is_refused_naming_the_pid() {
        let dir = tempfile::tempdir().unwrap();
        let first = lock_data_dir(dir.path()).unwrap();
        let err = lock_data_dir(dir.path()).unwrap_err().to_string();
        assert!(err.contains("is in use by another pinq"), "{err}");
        assert!(
            err.contains(&format!("pid {}", std::process::id())),
            "{err}"
        );
        drop(first);
        lock_data_dir(dir.path()).expect("free again once the first lock is dropped");
    }

    #[test]
    fn a_port_someone_listens_on_is_refused_naming_the_holder() {
        let held = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = held.local_addr().unwrap();
        let err = ensure_port_free(addr, "client port")
            .unwrap_err()
            .to_string();
        assert!(err.contains("already in use"), "{err}");
        assert!(
            err.contains(&format!("pid {}", std::process::id())),
            "{err}"
        );
        drop(held);
        ensure_port_free(addr, "client port").expect("free once closed");
    }

    #[test]
    fn listening_inodes_reads_the_proc_table() {
        let table = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n   0: 0100007F:1CE8 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 4242 1 0000000000000000 100 0 0 10 0\n   1: 0100007F:1CE8 0100007F:9C40 01 00000000:00000000 00:00000000 00000000     0        0 4343 1\n";
        assert_eq!(listening_inodes(table, 0x1CE8), vec!["4242".to_string()]);
        assert!(listening_inodes(table, 80).is_empty());
    }
}
