//! Pure checks of `pinq doctor`: each takes facts already read from the host (see `host.rs`) and
//! returns one [`Finding`] with what to change. No I/O, so every verdict is unit-tested.

use std::fmt::Write;

/// How much a finding matters.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Level {
    Ok,
    /// pinq runs, but slower or with a worse tail than the host allows.
    Warn,
    /// pinq cannot run as configured.
    Block,
}

/// One check's verdict.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Finding {
    pub check: &'static str,
    pub level: Level,
    pub detail: String,
    /// What to change, when something should change.
    pub advice: Option<String>,
}

impl Finding {
    fn ok(check: &'static str, detail: impl Into<String>) -> Finding {
        Finding {
            check,
            level: Level::Ok,
            detail: detail.into(),
            advice: None,
        }
    }

    fn warn(check: &'static str, detail: impl Into<String>, advice: impl Into<String>) -> Finding {
        Finding {
            check,
            level: Level::Warn,
            detail: detail.into(),
            advice: Some(advice.into()),
        }
    }

    fn block(check: &'static str, detail: impl Into<String>, advice: impl Into<String>) -> Finding {
        Finding {
            check,
            level: Level::Block,
            detail: detail.into(),
            advice: Some(advice.into()),
        }
    }
}

/// glommio refuses to start below this memlock limit.
pub const MEMLOCK_MIN_BYTES: u64 = 512 * 1024;

/// Memory each glommio executor registers with io_uring by default (10 MiB).
pub const IO_MEMORY_PER_SHARD_BYTES: u64 = 10 << 20;

fn list(cpus: &[usize]) -> String {
    crate::config::format_cpu_list(cpus)
}

/// CPU frequency governor of each shard CPU (`None`: no cpufreq, as in most VMs).
pub fn governor(governors: &[(usize, Option<String>)]) -> Finding {
    const CHECK: &str = "cpu governor";
    let slow: Vec<String> = governors
        .iter()
        .filter_map(|(cpu, g)| match g.as_deref() {
            Some("performance") | None => None,
            Some(other) => Some(format!("cpu{cpu}={other}")),
        })
        .collect();
    if !slow.is_empty() {
        return Finding::warn(
            CHECK,
            format!("not \"performance\": {}", slow.join(" ")),
            "cpupower frequency-set -g performance (or write performance to /sys/devices/system/cpu/cpuN/cpufreq/scaling_governor for the shard CPUs); also consider disabling deep C-states",
        );
    }
    if governors.iter().all(|(_, g)| g.is_none()) {
        return Finding::ok(
            CHECK,
            "no cpufreq exposed (virtual machine or fixed frequency)",
        );
    }
    Finding::ok(CHECK, "performance on every shard CPU")
}

/// SMT siblings inside the shard CPU set: `siblings` maps each shard CPU to its
/// `thread_siblings_list`.
pub fn smt(cpus: &[usize], siblings: &[(usize, Vec<usize>)]) -> Finding {
    const CHECK: &str = "smt siblings";
    let mut pairs = Vec::new();
    for (cpu, sibs) in siblings {
        for sib in sibs {
            if sib > cpu && cpus.contains(sib) {
                pairs.push(format!("{cpu}+{sib}"));
            }
        }
    }
    if pairs.is_empty() {
        Finding::ok(CHECK, "no two shards share a physical core")
    } else {
        Finding::warn(
            CHECK,
            format!("shards on hyper-thread siblings of one core: {}", pairs.join(" ")),
            "keep one CPU per physical core in --cpus (see /sys/devices/system/cpu/cpuN/topology/thread_siblings_list) or disable SMT",
        )
    }
}

/// Shard CPUs that other tasks and the timer tick may still use.
pub fn isolation(cpus: &[usize], isolated: &[usize], nohz_full: &[usize]) -> Finding {
    const CHECK: &str = "isolated cores";
    let shared: Vec<usize> = cpus
        .iter()
        .copied()
        .filter(|c| !isolated.contains(c))
        .collect();
    let ticking: Vec<usize> = cpus
        .iter()
        .copied()
        .filter(|c| !nohz_full.contains(c))
        .collect();
    if shared.is_empty() && ticking.is_empty() {
        return Finding::ok(
            CHECK,
            format!("shard CPUs {} are isolated and nohz_full", list(cpus)),
        );
    }
    let mut detail = String::new();
    if !shared.is_empty() {
        let _ = write!(detail, "not isolated: {}", list(&shared));
    }
    if !ticking.is_empty() {
        if !detail.is_empty() {
            detail.push_str("; ");
        }
        let _ = write!(detail, "not nohz_full: {}", list(&ticking));
    }
    Finding::warn(
        CHECK,
        detail,
        format!(
            "boot with isolcpus=managed_irq,domain,{c} nohz_full={c} rcu_nocbs={c} (keep one core per node for the OS), or a cgroup cpuset that keeps other work off these cores",
            c = list(cpus)
        ),
    )
}

/// One network queue interrupt and the CPUs it may land on.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NicIrq {
    pub nic: String,
    pub irq: u32,
    pub cpus: Vec<usize>,
}

/// Network queue interrupts that land on shard CPUs.
pub fn irq_affinity(cpus: &[usize], irqs: &[NicIrq]) -> Finding {
    const CHECK: &str = "nic irq affinity";
    if irqs.is_empty() {
        return Finding::ok(CHECK, "no NIC interrupt found to check");
    }
    let on_shards: Vec<String> = irqs
        .iter()
        .filter(|i| i.cpus.iter().any(|c| cpus.contains(c)))
        .map(|i| format!("{} irq {} -> {}", i.nic, i.irq, list(&i.cpus)))
        .collect();
    if on_shards.is_empty() {
        return Finding::ok(
            CHECK,
            format!("{} NIC interrupt(s), none on shard CPUs", irqs.len()),
        );
    }
    Finding::warn(
        CHECK,
        format!("NIC interrupts on shard CPUs: {}", on_shards.join(", ")),
        "steer NIC queue interrupts to non-shard CPUs of the same NUMA node: echo LIST > /proc/irq/N/smp_affinity_list (stop irqbalance, or set IRQBALANCE_BANNED_CPULIST to the shard CPUs)",
    )
}

/// Transparent huge pages mode (`always`, `madvise`, `never`).
pub fn thp(mode: Option<&str>) -> Finding {
    const CHECK: &str = "transparent huge pages";
    match mode {
        Some("always") => Finding::warn(
            CHECK,
            "enabled = always: khugepaged and compaction stalls show up in the latency tail",
            "echo madvise > /sys/kernel/mm/transparent_hugepage/enabled (or boot with transparent_hugepage=madvise)",
        ),
        Some(mode) => Finding::ok(CHECK, format!("enabled = {mode}")),
        None => Finding::ok(CHECK, "not available"),
    }
}

/// The memlock limit against what `shards` glommio executors register.
pub fn memlock(soft: Option<u64>, shards: usize, privileged: bool) -> Finding {
    const CHECK: &str = "memlock limit";
    let Some(limit) = soft else {
        return Finding::ok(CHECK, "unlimited");
    };
    let advice = "raise it: LimitMEMLOCK=infinity in the systemd unit, or memlock in /etc/security/limits.conf";
    if limit < MEMLOCK_MIN_BYTES {
        return Finding::block(
            CHECK,
            format!("{limit} bytes: glommio refuses to start below {MEMLOCK_MIN_BYTES}"),
            advice,
        );
    }
    let wanted = IO_MEMORY_PER_SHARD_BYTES.saturating_mul(shards as u64);
    if limit < wanted && !privileged {
        return Finding::warn(
            CHECK,
            format!("{limit} bytes, below the {wanted} bytes {shards} shard(s) register for I/O buffers"),
            advice,
        );
    }
    let note = if limit < wanted {
        " (root: registration is not limited)"
    } else {
        ""
    };
    Finding::ok(CHECK, format!("{limit} bytes{note}"))
}

/// Files each shard may keep open besides client connections: its WAL segments, tables being
/// read, flushed and compacted, and the Raft log in a cluster.
pub const FILES_PER_SHARD: u64 = 256;

/// The open-files limit against what the broker may open: one descriptor per client
/// connection, up to `connections_max` (`server.maxConnections`), plus [`FILES_PER_SHARD`]
/// per shard.
pub fn open_files(soft: Option<u64>, shards: usize, connections_max: u64) -> Finding {
    const CHECK: &str = "open files limit";
    let Some(limit) = soft else {
        return Finding::ok(CHECK, "unlimited");
    };
    let wanted = connections_max.saturating_add(FILES_PER_SHARD.saturating_mul(shards as u64));
    if limit < wanted {
        return Finding::warn(
            CHECK,
            format!("{limit}, below the {wanted} that {connections_max} connections (server.maxConnections) and {shards} shard(s) may open"),
            "raise it: LimitNOFILE=1048576 in the systemd unit (deploy/systemd/pinq.service), or nofile in /etc/security/limits.conf; past the limit, new connections fail to be accepted",
        );
    }
    Finding::ok(CHECK, format!("{limit}"))
}

/// io_uring availability: the sysctl and the result of a real `io_uring_setup`.
pub fn io_uring(disabled: u8, setup: &Result<(), String>) -> Finding {
    const CHECK: &str = "io_uring";
    let advice = "sysctl kernel.io_uring_disabled=0 (or add the user to kernel.io_uring_group); in containers, allow io_uring_setup/enter/register in the seccomp profile";
    match setup {
        Ok(()) => Finding::ok(CHECK, format!("available (io_uring_disabled = {disabled})")),
        Err(e) => Finding::block(
            CHECK,
            format!("io_uring_setup failed: {e} (io_uring_disabled = {disabled})"),
            advice,
        ),
    }
}

/// O_DIRECT in the data directory and the file system under it.
pub fn data_dir(dir: &str, fs_type: Option<&str>, direct: &Result<(), String>) -> Finding {
    const CHECK: &str = "data directory";
    let fs = fs_type.unwrap_or("unknown file system");
    if let Err(e) = direct {
        return Finding::block(
            CHECK,
            format!("O_DIRECT write+read in {dir} ({fs}) failed: {e}"),
            "put server.dataDir on a local file system with O_DIRECT (XFS or ext4 on NVMe); tmpfs, overlayfs and network file systems do not fit",
        );
    }
    match fs_type {
        Some("xfs" | "ext4") => Finding::ok(CHECK, format!("{dir}: {fs}, O_DIRECT works")),
        _ => Finding::warn(
            CHECK,
            format!("{dir}: {fs}, O_DIRECT works"),
            "XFS or ext4 on a local NVMe disk is what pinq is measured on; expect other latency here",
        ),
    }
}

/// Whether the shard CPUs sit on one NUMA node.
pub fn numa(cpus: &[usize], nodes: &[(usize, Vec<usize>)]) -> Finding {
    const CHECK: &str = "numa layout";
    let used: Vec<usize> = nodes
        .iter()
        .filter(|(_, node_cpus)| node_cpus.iter().any(|c| cpus.contains(c)))
        .map(|(node, _)| *node)
        .collect();
    match used.len() {
        0 => Finding::ok(CHECK, "no NUMA information"),
        1 => Finding::ok(
            CHECK,
            format!("{} node(s); shard CPUs all on node {}", nodes.len(), used[0]),
        ),
        _ => Finding::warn(
            CHECK,
            format!("shard CPUs span nodes {used:?}: cross-node channels and memory cost latency"),
            "pick one node's CPUs: pinq serve --numa auto, or --cpus with the node's cpulist (/sys/devices/system/node/nodeN/cpulist), ideally the node of the NIC and the disk",
        ),
    }
}

/// The exit status for a set of findings: 0 nothing to change, 1 warnings, 2 cannot run.
pub fn exit_code(findings: &[Finding]) -> u8 {
    match findings.iter().map(|f| f.level).max() {
        Some(Level::Block) => 2,
        Some(Level::Warn) => 1,
        _ => 0,
    }
}

/// The report as printed: one line per check, then what to change indented below it.
/// One table file of the data directory as `pinq doctor` read it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TableReport {
    /// The file, relative to the data directory (`shard-0/tbl-….sst`).
    pub name: String,
    /// What its blocks hold, or why the file cannot be read as a table at all.
    pub check: Result<crate::storage::table::reader::TableCheck, String>,
}

/// The "table blocks" findings: one line when every block of every table reads back, else one
/// per damaged table naming it and its unreadable blocks. A table whose metadata is damaged
/// stops start-up (BLOCK); damaged data blocks are skipped by the broker (WARN).
pub fn table_blocks(tables: &[TableReport]) -> Vec<Finding> {
    const CHECK: &str = "table blocks";
    let mut findings = Vec::new();
    for t in tables {
        match &t.check {
            Err(e) => findings.push(Finding::block(
                CHECK,
                format!("{}: not a readable table: {e}", t.name),
                "pinq serve refuses this directory; restore the shard from a copy or a replica",
            )),
            Ok(c) if !c.unreadable.is_empty() => {
                let blocks: Vec<String> = c
                    .unreadable
                    .iter()
                    .take(8)
                    .map(|(i, why)| format!("block {i}: {why}"))
                    .collect();
                let more = c.unreadable.len().saturating_sub(blocks.len());
                let more = if more > 0 {
                    format!("; {more} more")
                } else {
                    String::new()
                };
                findings.push(Finding::warn(
                    CHECK,
                    format!(
                        "{}: {} of {} data block(s) unreadable ({}{more})",
                        t.name,
                        c.unreadable.len(),
                        c.blocks,
                        blocks.join("; ")
                    ),
                    "pinq serves the rest: reads skip these blocks (their messages are lost, counted in pinq_unreadable_values_total) and compaction drops them",
                ));
            }
            Ok(_) => {}
        }
    }
    if findings.is_empty() {
        let blocks: usize = tables
            .iter()
            .filter_map(|t| t.check.as_ref().ok())
            .map(|c| c.blocks)
            .sum();
        findings.push(Finding::ok(
            CHECK,
            format!(
                "{} table(s), {blocks} data block(s), all readable",
                tables.len()
            ),
        ));
    }
    findings
}

pub fn render(findings: &[Finding]) -> String {
    let mut out = String::new();
    for f in findings {
        let tag = match f.level {
            Level::Ok => "ok   ",
            Level::Warn => "WARN ",
            Level::Block => "BLOCK",
        };
        let _ = writeln!(out, "{tag} {:<24} {}", f.check, f.detail);
        if let Some(advice) = &f.advice {
            let _ = writeln!(out, "      {:<24} fix: {advice}", "");
        }
    }
    let verdict = match exit_code(findings) {
        0 => "nothing to change",
        1 => "pinq runs here; the warnings above cost latency or throughput",
        _ => "pinq cannot run here as configured: fix the BLOCK lines",
    };
    let _ = writeln!(out, "verdict: {verdict}");
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table_blocks_name_each_damaged_table_and_pass_clean_ones() {
        use crate::storage::table::reader::TableCheck;
        let clean = TableReport {
            name: "shard-0/tbl-1.sst".into(),
            check: Ok(TableCheck {
                blocks: 4,
                entries: 40,
                unreadable: vec![],
            }),
        };
        let ok = table_blocks(std::slice::from_ref(&clean));
        assert_eq!(ok.len(), 1);
        assert_eq!(ok[0].level, Level::Ok);
        assert!(ok[0].detail.contains("1 table(s), 4 data block(s)"));
        let damaged = TableReport {
            name: "shard-1/tbl-2.sst".into(),
            check: Ok(TableCheck {
                blocks: 9,
                entries: 90,
                unreadable: vec![(3, "checksum mismatch".into())],
            }),
        };
        let broken = TableReport {
            name: "shard-1/tbl-3.sst".into(),
            check: Err("footer: bad magic".into()),
        };
        let found = table_blocks(&[clean, damaged, broken]);
        assert_eq!(found.len(), 2);
        assert_eq!(found[0].level, Level::Warn);
        assert!(
            found[0].detail.starts_with("shard-1/tbl-2.sst: 1 of 9"),
            "{}",
            found[0].detail
        );
        assert!(found[0].detail.contains("block 3: checksum mismatch"));
        assert_eq!(found[1].level, Level::Block);
        assert_eq!(exit_code(&found), 2);
    }

    #[test]
    fn governor_other_than_performance_warns_and_missing_cpufreq_is_fine() {
        assert_eq!(governor(&[(0, None), (1, None)]).level, Level::Ok);
        assert_eq!(
            governor(&[(0, Some("performance".into()))]).level,
            Level::Ok
        );
        let f = governor(&[
            (0, Some("performance".into())),
            (1, Some("powersave".into())),
        ]);
        assert_eq!(f.level, Level::Warn);
        assert!(f.detail.contains("cpu1=powersave"));
    }

    #[test]
    fn smt_siblings_both_in_the_set_warn_once_per_pair() {
        let siblings = vec![(0, vec![0, 4]), (4, vec![0, 4]), (1, vec![1, 5])];
        let f = smt(&[0, 1, 4], &siblings);
        assert_eq!(f.level, Level::Warn);
        assert!(f.detail.ends_with("0+4"), "{}", f.detail);
        assert_eq!(smt(&[0, 1], &siblings).level, Level::Ok);
    }

    #[test]
    fn isolation_names_the_cpus_that_are_not_isolated() {
        assert_eq!(isolation(&[2, 3], &[2, 3], &[2, 3]).level, Level::Ok);
        let f = isolation(&[2, 3], &[2], &[]);
        assert_eq!(f.level, Level::Warn);
        assert!(f.detail.contains("not isolated: 3"), "{}", f.detail);
        assert!(f.detail.contains("not nohz_full: 2-3"), "{}", f.detail);
    }

    #[test]
    fn nic_irqs_on_shard_cpus_warn() {
        let irqs = vec![
            NicIrq {
                nic: "eth0".into(),
                irq: 38,
                cpus: vec![1],
            },
            NicIrq {
                nic: "eth0".into(),
                irq: 39,
                cpus: vec![0],
            },
        ];
        let f = irq_affinity(&[1], &irqs);
        assert_eq!(f.level, Level::Warn);
        assert!(f.detail.contains("eth0 irq 38 -> 1"));
        assert!(!f.detail.contains("39"));
        assert_eq!(irq_affinity(&[2], &irqs).level, Level::Ok);
        assert_eq!(irq_affinity(&[1], &[]).level, Level::Ok);
    }

    #[test]
    fn thp_always_warns() {
        assert_eq!(thp(Some("always")).level, Level::Warn);
        assert_eq!(thp(Some("madvise")).level, Level::Ok);
    }

    #[test]
    fn open_files_below_connections_plus_shard_files_warns() {
        assert_eq!(open_files(Some(1024), 2, 4096).level, Level::Warn);
        assert_eq!(open_files(Some(4096 + 512), 2, 4096).level, Level::Ok);
        assert_eq!(open_files(Some(65_536), 64, 4096).level, Level::Ok);
        assert_eq!(open_files(None, 64, 4096).level, Level::Ok);
    }

    #[test]
    fn memlock_below_glommios_floor_blocks_and_small_warns_unless_root() {
        assert_eq!(memlock(Some(64 * 1024), 1, true).level, Level::Block);
        assert_eq!(memlock(Some(8 << 20), 2, false).level, Level::Warn);
        assert_eq!(memlock(Some(8 << 20), 2, true).level, Level::Ok);
        assert_eq!(memlock(None, 64, false).level, Level::Ok);
    }

    #[test]
    fn io_uring_setup_failure_blocks() {
        assert_eq!(io_uring(0, &Ok(())).level, Level::Ok);
        assert_eq!(io_uring(2, &Err("EPERM".into())).level, Level::Block);
    }

    #[test]
    fn data_dir_without_o_direct_blocks_and_unusual_fs_warns() {
        assert_eq!(data_dir("/d", Some("xfs"), &Ok(())).level, Level::Ok);
        assert_eq!(data_dir("/d", Some("btrfs"), &Ok(())).level, Level::Warn);
        assert_eq!(
            data_dir("/d", Some("tmpfs"), &Err("EINVAL".into())).level,
            Level::Block
        );
    }

    #[test]
    fn shard_cpus_across_nodes_warn() {
        let nodes = vec![(0, vec![0, 1]), (1, vec![2, 3])];
        assert_eq!(numa(&[0, 1], &nodes).level, Level::Ok);
        assert_eq!(numa(&[1, 2], &nodes).level, Level::Warn);
    }

    #[test]
    fn exit_code_is_the_worst_level() {
        let ok = Finding::ok("a", "x");
        let warn = Finding::warn("b", "y", "z");
        let block = Finding::block("c", "y", "z");
        assert_eq!(exit_code(std::slice::from_ref(&ok)), 0);
        assert_eq!(exit_code(&[ok.clone(), warn.clone()]), 1);
        assert_eq!(exit_code(&[warn, block, ok]), 2);
    }
}
