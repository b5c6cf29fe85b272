//! CPU lists: which cores get a shard (`server.cpus`, `--cpus`).
//!
//! The syntax is the kernel's cpulist format (`"0-3,8"`, as in `/sys/devices/system/cpu/online`,
//! `isolcpus=` and `taskset -c`), plus `"all"` for every online CPU this process may run on.
//! Shard `i` runs on the `i`-th CPU of the list in ascending order, so the list is kept sorted and a
//! CPU may appear only once. The original text is kept beside the parsed list so logs and
//! `topology()` can show what the operator wrote.
//!
//! Reading the host (`online_cpus`) is the only I/O here; parsing is pure so `pinq doctor` and
//! tests can use it on fixture text.

use std::fmt;

/// Largest CPU number accepted: far above any machine pinq runs on, low enough that a typo such as
/// `"0-40000"` is caught instead of becoming 40 001 shards.
pub const CPU_INDEX_MAX: usize = 4095;

/// The text that selects every online CPU.
pub const ALL_CPUS: &str = "all";

/// A sorted, duplicate-free list of CPU numbers with the text it was parsed from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CpuList {
    cpus: Vec<usize>,
    text: String,
}

/// Why a CPU list was refused.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum CpuListError {
    #[error("empty CPU list: write e.g. \"0-3,8\" or \"all\"")]
    Empty,
    #[error("\"{item}\" is not a CPU number or range: write e.g. \"0-3,8\" or \"all\"")]
    Malformed { item: String },
    #[error("range {start}-{end} runs backwards")]
    Backwards { start: usize, end: usize },
    #[error("CPU {cpu} is listed twice")]
    Duplicate { cpu: usize },
    #[error("CPU {cpu} is above the limit of {CPU_INDEX_MAX}")]
    TooLarge { cpu: usize },
    #[error("CPU {cpu} is not online for this process (online: {online})")]
    NotOnline { cpu: usize, online: String },
}

impl CpuList {
    /// Parses an explicit list such as `"0-3,8"` (whitespace around items is allowed). `"all"` is
    /// not accepted here: it needs the host's CPUs, see [`CpuList::resolve`].
    pub fn parse(text: &str) -> Result<CpuList, CpuListError> {
        let trimmed = text.trim();
        if trimmed.is_empty() {
            return Err(CpuListError::Empty);
        }
        let mut cpus = Vec::new();
        for item in trimmed.split(',') {
            let item = item.trim();
            let (start, end) = match item.split_once('-') {
                Some((start, end)) => (parse_cpu(start, item)?, parse_cpu(end, item)?),
                None => {
                    let cpu = parse_cpu(item, item)?;
                    (cpu, cpu)
                }
            };
            if start > end {
                return Err(CpuListError::Backwards { start, end });
            }
            cpus.extend(start..=end);
        }
        cpus.sort_unstable();
        if let Some(pair) = cpus.windows(2).find(|pair| pair[0] == pair[1]) {
            return Err(CpuListError::Duplicate { cpu: pair[0] });
        }
        Ok(CpuList {
            cpus,
            text: trimmed.to_owned(),
        })
    }

    /// Parses `text` against the CPUs this process may use: `"all"` selects every one of them, and
    /// an explicit list must name only CPUs among them.
    pub fn resolve(text: &str, online: &[usize]) -> Result<CpuList, CpuListError> {
        if text.trim() == ALL_CPUS {
            return Ok(CpuList::all_of(online));
        }
        let list = CpuList::parse(text)?;
        if let Some(&cpu) = list.cpus.iter().find(|cpu| !online.contains(cpu)) {
            return Err(CpuListError::NotOnline {
                cpu,
                online: format_cpu_list(online),
            });
        }
        Ok(list)
    }

    /// Every CPU in `online`, written as `"all"`.
    pub fn all_of(online: &[usize]) -> CpuList {
        let mut cpus = online.to_vec();
        cpus.sort_unstable();
        cpus.dedup();
        CpuList {
            cpus,
            text: ALL_CPUS.to_owned(),
        }
    }

    /// Every CPU this process may run on (see [`online_cpus`]).
    pub fn all_online() -> CpuList {
        CpuList::all_of(&online_cpus())
    }

    /// The CPUs, ascending; shard `i` runs on `cpus()[i]`.
    pub fn cpus(&self) -> &[usize] {
        &self.cpus
    }

    /// The text as the operator wrote it (`"all"` for the default).
    pub fn text(&self) -> &str {
        &self.text
    }

    /// Number of CPUs, which is the number of shards.
    pub fn len(&self) -> usize {
        self.cpus.len()
    }

    /// Never true for a parsed list; here for completeness of the collection API.
    pub fn is_empty(&self) -> bool {
        self.cpus.is_empty()
    }
}

impl fmt::Display for CpuList {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.text == ALL_CPUS {
            write!(f, "all ({})", format_cpu_list(&self.cpus))
        } else {
            f.write_str(&self.text)
        }
    }
}

fn parse_cpu(number: &str, item: &str) -> Result<usize, CpuListError> {
    let number = number.trim();
    if number.is_empty() || !number.bytes().all(|b| b.is_ascii_digit()) {
        return Err(CpuListError::Malformed {
            item: item.to_owned(),
        });
    }
    match number.parse::<usize>() {
        Ok(cpu) if cpu <= CPU_INDEX_MAX => Ok(cpu),
        Ok(cpu) => Err(CpuListError::TooLarge { cpu }),
        Err(_) => Err(CpuListError::TooLarge { cpu: usize::MAX }),
    }
}

/// Writes CPUs in cpulist form with runs collapsed (`[0, 1, 2, 3, 8]` → `"0-3,8"`).
pub fn format_cpu_list(cpus: &[usize]) -> String {
    let mut sorted = cpus.to_vec();
    sorted.sort_unstable();
    sorted.dedup();
    let mut parts: Vec<String> = Vec::new();
    let mut index = 0;
    while index < sorted.len() {
        let start = sorted[index];
        let mut end = start;
        while index + 1 < sorted.len() && sorted[index + 1] == end + 1 {
            index += 1;
            end = sorted[index];
        }
        parts.push(if start == end {
            start.to_string()
        } else {
            format!("{start}-{end}")
        });
        index += 1;
    }
    parts.join(",")
}

/// The CPUs this process may run on: the online CPUs (`/sys/devices/system/cpu/online`)
/// intersected with the process's affinity (`Cpus_allowed_list` in `/proc/self/status`), so a
/// broker started under `taskset` or a cgroup cpuset never tries to pin outside it. Falls back to
/// `0..available_parallelism` where those files are missing.
pub fn online_cpus() -> Vec<usize> {
    let online = std::fs::read_to_string("/sys/devices/system/cpu/online")
        .ok()
        .and_then(|text| CpuList::parse(&text).ok());
    let allowed = std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|status| allowed_cpus_from_status(&status));
    let cpus: Vec<usize> = match (online, allowed) {
        (Some(online), Some(allowed)) => online
            .cpus()
            .iter()
            .copied()
            .filter(|cpu| allowed.cpus().contains(cpu))
            .collect(),
        (Some(list), None) | (None, Some(list)) => list.cpus().to_vec(),
        (None, None) => Vec::new(),
    };
    if cpus.is_empty() {
        let count = std::thread::available_parallelism().map_or(1, |n| n.get());
        (0..count).collect()
    } else {
        cpus
    }
}

/// Reads `Cpus_allowed_list` out of the text of `/proc/<pid>/status`.
pub fn allowed_cpus_from_status(status: &str) -> Option<CpuList> {
    status
        .lines()
        .find_map(|line| line.strip_prefix("Cpus_allowed_list:"))
        .and_then(|list| CpuList::parse(list).ok())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_list_parses_ranges_and_single_cpus() {
        let list = CpuList::parse("0-3,8").unwrap();
        assert_eq!(list.cpus(), &[0, 1, 2, 3, 8]);
        assert_eq!(list.text(), "0-3,8");
        assert_eq!(CpuList::parse("5").unwrap().cpus(), &[5]);
        assert_eq!(CpuList::parse(" 8, 0 - 1 ").unwrap().cpus(), &[0, 1, 8]);
        assert_eq!(CpuList::parse("2-2").unwrap().cpus(), &[2]);
    }

    #[test]
    fn cpu_list_rejects_bad_input() {
        assert_eq!(CpuList::parse(""), Err(CpuListError::Empty));
        assert_eq!(CpuList::parse("  "), Err(CpuListError::Empty));
        for bad in ["a", "0,,1", "0,", "-1", "1-", "0-3-5", "1.5", "0;1", "all"] {
            assert!(
                matches!(CpuList::parse(bad), Err(CpuListError::Malformed { .. })),
                "{bad}: {:?}",
                CpuList::parse(bad)
            );
        }
        assert_eq!(
            CpuList::parse("3-1"),
            Err(CpuListError::Backwards { start: 3, end: 1 })
        );
        assert_eq!(
            CpuList::parse("0-3,2"),
            Err(CpuListError::Duplicate { cpu: 2 })
        );
        assert_eq!(
            CpuList::parse("0-40000"),
            Err(CpuListError::TooLarge { cpu: 40000 })
        );
        assert!(matches!(
            CpuList::parse("99999999999999999999999"),
            Err(CpuListError::TooLarge { .. })
        ));
    }

    #[test]
    fn all_selects_every_online_cpu_and_keeps_its_text() {
        let list = CpuList::resolve("all", &[0, 1, 2, 3]).unwrap();
        assert_eq!(list.cpus(), &[0, 1, 2, 3]);
        assert_eq!(list.text(), "all");
        assert_eq!(list.to_string(), "all (0-3)");
    }

    #[test]
    fn resolve_refuses_a_cpu_that_is_not_online() {
        assert_eq!(
            CpuList::resolve("0,8", &[0, 1, 2, 3]),
            Err(CpuListError::NotOnline {
                cpu: 8,
                online: "0-3".to_owned()
            })
        );
        assert_eq!(CpuList::resolve("1", &[0, 1]).unwrap().cpus(), &[1]);
    }

    #[test]
    fn cpu_lists_format_with_runs_collapsed() {
        assert_eq!(format_cpu_list(&[8, 0, 1, 2, 3, 10, 11]), "0-3,8,10-11");
        assert_eq!(format_cpu_list(&[]), "");
        assert_eq!(format_cpu_list(&[4]), "4");
    }

    #[test]
    fn allowed_cpus_are_read_from_proc_status_text() {
        let status =
            "Name:\tpinq\nCpus_allowed:\t0f\nCpus_allowed_list:\t0-2,3\nMems_allowed:\t1\n";
        assert_eq!(
            allowed_cpus_from_status(status).unwrap().cpus(),
            &[0, 1, 2, 3]
        );
        assert_eq!(allowed_cpus_from_status("Name:\tpinq\n"), None);
    }

    #[test]
    fn this_host_has_at_least_one_online_cpu() {
        assert!(!online_cpus().is_empty());
    }
}
