//! `pinq doctor`: inspects the host pinq would run on and prints one line per check with what to
//! change. Exit status: 0 nothing to change, 1 warnings only, 2 pinq cannot run as configured.
//!
//! Reads the host through `host.rs` and judges through `checks.rs`; it starts no shard and
//! writes nothing but one probe file in the data directory, removed at once. It also reads
//! every table of the data directory and names those with unreadable blocks (run it on a
//! stopped broker's directory, or accept that a table compaction just replaced may be gone).

use std::path::Path;

use super::checks::{self, Finding, Level};
use super::host;
use crate::config::{online_cpus, CpuList};

/// Runs every check for shards on `cpus` (the `--cpus` syntax, `"all"` by default) with data in
/// `data_dir`; returns the findings in report order.
pub fn inspect(cpus_text: &str, data_dir: &Path) -> Vec<Finding> {
    let mut findings = Vec::new();
    let cpus = match CpuList::resolve(cpus_text, &online_cpus()) {
        Ok(list) => {
            findings.push(Finding {
                check: "cpu set",
                level: Level::Ok,
                detail: format!(
                    "{} shard(s) on CPUs {} (--cpus {})",
                    list.len(),
                    crate::config::format_cpu_list(list.cpus()),
                    list.text()
                ),
                advice: None,
            });
            list.cpus().to_vec()
        }
        Err(e) => {
            findings.push(Finding {
                check: "cpu set",
                level: Level::Block,
                detail: format!("--cpus {cpus_text:?}: {e}"),
                advice: Some("pass CPUs this process may use (see /sys/devices/system/cpu/online and taskset -p $$)".into()),
            });
            Vec::new()
        }
    };
    // Without a valid CPU set the per-CPU checks would judge nothing: leave them out.
    if !cpus.is_empty() {
        findings.push(checks::governor(&host::governors(&cpus)));
        findings.push(checks::smt(&cpus, &host::siblings(&cpus)));
        findings.push(checks::isolation(
            &cpus,
            &host::cpu_list_file("isolated"),
            &host::cpu_list_file("nohz_full"),
        ));
        findings.push(checks::irq_affinity(&cpus, &host::nic_irqs()));
        findings.push(checks::numa(&cpus, &host::numa_nodes()));
    }
    findings.push(checks::thp(host::thp_mode().as_deref()));
    findings.extend(limits(cpus.len().max(1)));
    findings.push(checks::io_uring(
        host::io_uring_disabled(),
        &host::io_uring_setup_works(),
    ));
    findings.push(match host::existing_dir(data_dir) {
        Some((dir, exact)) => {
            let shown = if exact {
                dir.display().to_string()
            } else {
                format!(
                    "{} (nearest existing parent of {})",
                    dir.display(),
                    data_dir.display()
                )
            };
            checks::data_dir(
                &shown,
                host::fs_type(&dir).as_deref(),
                &host::o_direct_works(&dir),
            )
        }
        None => Finding {
            check: "data directory",
            level: Level::Block,
            detail: format!("{}: no existing directory on its path", data_dir.display()),
            advice: Some("create it, or pass --data-dir".into()),
        },
    });
    findings.extend(checks::table_blocks(&host::table_reports(data_dir)));
    findings
}

/// The process limits the broker needs: locked memory and open files, for `shards` shards.
fn limits(shards: usize) -> [Finding; 2] {
    let unreadable = |check: &'static str, detail: String, advice: &str| Finding {
        check,
        level: Level::Warn,
        detail,
        advice: Some(advice.into()),
    };
    let memlock = match host::memlock_soft() {
        Ok(limit) => checks::memlock(limit, shards, host::is_root()),
        Err(e) => unreadable("memlock limit", e, "check ulimit -l"),
    };
    let connections_max = crate::config::ServerConfig::default()
        .client
        .connections_max;
    let open_files = match host::open_files_soft() {
        Ok(limit) => checks::open_files(limit, shards, connections_max as u64),
        Err(e) => unreadable("open files limit", e, "check ulimit -n"),
    };
    [memlock, open_files]
}

/// The expiry of the server certificate at `path` (its first certificate), judged now.
pub fn tls_certificate(path: &Path) -> Finding {
    let shown = path.display().to_string();
    let validity = crate::security::tls::load_certs(path)
        .and_then(|certs| crate::security::tls::validity(path, &certs[0]))
        .map_err(|e| e.to_string());
    super::cert::certificate_expiry(&shown, validity, crate::security::tls::unix_now_s())
}

/// `pinq doctor`: prints the report to stdout and returns the exit status. `tls_cert` is the
/// server certificate when TLS is configured.
pub fn run(cpus_text: &str, data_dir: &Path, tls_cert: Option<&Path>) -> u8 {
    let mut findings = inspect(cpus_text, data_dir);
    if let Some(path) = tls_cert {
        findings.push(tls_certificate(path));
    }
    print!("{}", checks::render(&findings));
    checks::exit_code(&findings)
}
