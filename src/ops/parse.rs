//! Pure parsers for the `/sys` and `/proc` text `pinq doctor` reads. No I/O: each function takes
//! the file's text, so the tests run on fixture strings copied from real hosts.
//!
//! CPU lists (`cpulist` files, `isolated`, `nohz_full`, `smp_affinity_list`) use the one parser
//! the project has, [`CpuList::parse`].

use crate::config::CpuList;

/// Parses a kernel CPU list file; an empty file (no CPU isolated, say) is an empty list.
pub fn cpu_list(text: &str) -> Option<Vec<usize>> {
    if text.trim().is_empty() {
        return Some(Vec::new());
    }
    CpuList::parse(text).ok().map(|l| l.cpus().to_vec())
}

/// The selected mode of a `[bracketed]` sysfs choice such as
/// `/sys/kernel/mm/transparent_hugepage/enabled` (`always [madvise] never` → `madvise`).
pub fn bracketed_choice(text: &str) -> Option<&str> {
    text.split_whitespace()
        .find_map(|word| word.strip_prefix('[')?.strip_suffix(']'))
}

/// A resource limit (bytes, files); `None` for `unlimited`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limit(pub Option<u64>);

/// The soft and hard `Max locked memory` limits from `/proc/self/limits`.
pub fn memlock_limits(limits: &str) -> Option<(Limit, Limit)> {
    resource_limits(limits, "Max locked memory")
}

/// The soft and hard `Max open files` limits from `/proc/self/limits`.
pub fn open_files_limits(limits: &str) -> Option<(Limit, Limit)> {
    resource_limits(limits, "Max open files")
}

/// The soft and hard limits of the `/proc/self/limits` line that starts with `name`.
fn resource_limits(limits: &str, name: &str) -> Option<(Limit, Limit)> {
    let line = limits.lines().find(|line| line.starts_with(name))?;
    let mut fields = line[name.len()..].split_whitespace();
    let parse = |field: Option<&str>| -> Option<Limit> {
        match field? {
            "unlimited" => Some(Limit(None)),
            number => number.parse().ok().map(|n| Limit(Some(n))),
        }
    };
    Some((parse(fields.next())?, parse(fields.next())?))
}

/// `/proc/sys/kernel/io_uring_disabled`: 0 = allowed, 1 = only for `io_uring_group` members and
/// CAP_SYS_ADMIN, 2 = disabled for everyone. A missing file (kernels before 6.6) reads as 0.
pub fn io_uring_disabled(text: &str) -> Option<u8> {
    text.trim().parse().ok()
}

/// The file system type and mount point of `path` from `/proc/self/mountinfo`: the mount whose
/// mount point is the longest prefix of `path` (which must be absolute and canonical).
pub fn mount_of<'a>(mountinfo: &'a str, path: &str) -> Option<(&'a str, &'a str)> {
    let mut best: Option<(&str, &str)> = None;
    for line in mountinfo.lines() {
        let Some((left, right)) = line.split_once(" - ") else {
            continue;
        };
        let Some(mount_point) = left.split_whitespace().nth(4) else {
            continue;
        };
        let Some(fs_type) = right.split_whitespace().next() else {
            continue;
        };
        let inside = path == mount_point
            || mount_point == "/"
            || path
                .strip_prefix(mount_point)
                .is_some_and(|rest| rest.starts_with('/'));
        if inside && best.is_none_or(|(m, _)| mount_point.len() >= m.len()) {
            best = Some((mount_point, fs_type));
        }
    }
    best.map(|(m, t)| (t, m))
}

/// The NUMA nodes and their CPUs, from `(node directory name, cpulist text)` pairs such as
/// `("node0", "0-3")`. Entries that are not `node<N>` are skipped.
pub fn numa_nodes<'a>(
    entries: impl IntoIterator<Item = (&'a str, &'a str)>,
) -> Vec<(usize, Vec<usize>)> {
    let mut nodes: Vec<(usize, Vec<usize>)> = entries
        .into_iter()
        .filter_map(|(name, cpulist)| {
            let node = name.strip_prefix("node")?.parse().ok()?;
            Some((node, cpu_list(cpulist)?))
        })
        .collect();
    nodes.sort_by_key(|(node, _)| *node);
    nodes
}

#[cfg(test)]
mod tests {
    use super::*;

    const LIMITS: &str =
        "Limit                     Soft Limit           Hard Limit           Units     \n\
Max cpu time              unlimited            unlimited            seconds   \n\
Max locked memory         8388608              unlimited            bytes     \n\
Max open files            1024                 524288               files     \n\
Max address space         unlimited            unlimited            bytes     \n";

    const MOUNTINFO: &str = "22 27 0:21 / /proc rw,relatime - proc proc rw\n\
27 1 253:0 / / rw,relatime - ext4 /dev/vda rw\n\
25 24 0:23 / /dev/shm rw,relatime - tmpfs tmpfs rw,size=24684084k\n\
40 27 259:1 / /data rw,noatime - xfs /dev/nvme0n1 rw\n\
41 27 0:50 / /data2 rw - overlay overlay rw\n";

    #[test]
    fn cpu_lists_parse_ranges_and_empty_files() {
        assert_eq!(cpu_list("0-3,8\n"), Some(vec![0, 1, 2, 3, 8]));
        assert_eq!(cpu_list("\n"), Some(vec![]));
        assert_eq!(cpu_list("x"), None);
    }

    #[test]
    fn thp_mode_is_the_bracketed_word() {
        assert_eq!(
            bracketed_choice("always [madvise] never\n"),
            Some("madvise")
        );
        assert_eq!(bracketed_choice("[always] madvise never"), Some("always"));
        assert_eq!(bracketed_choice("always madvise never"), None);
    }

    #[test]
    fn memlock_limits_read_soft_and_hard_with_unlimited() {
        assert_eq!(
            memlock_limits(LIMITS),
            Some((Limit(Some(8_388_608)), Limit(None)))
        );
        assert_eq!(
            memlock_limits("Max cpu time  unlimited unlimited seconds"),
            None
        );
    }

    #[test]
    fn open_files_limits_read_soft_and_hard() {
        assert_eq!(
            open_files_limits(LIMITS),
            Some((Limit(Some(1024)), Limit(Some(524_288))))
        );
    }

    #[test]
    fn io_uring_disabled_reads_the_number() {
        assert_eq!(io_uring_disabled("0\n"), Some(0));
        assert_eq!(io_uring_disabled("2"), Some(2));
        assert_eq!(io_uring_disabled(""), None);
    }

    #[test]
    fn mount_of_picks_the_longest_mount_point_prefix() {
        assert_eq!(mount_of(MOUNTINFO, "/data/pinq"), Some(("xfs", "/data")));
        assert_eq!(mount_of(MOUNTINFO, "/data"), Some(("xfs", "/data")));
        assert_eq!(mount_of(MOUNTINFO, "/data2/x"), Some(("overlay", "/data2")));
        // "/datax" is not under "/data".
        assert_eq!(mount_of(MOUNTINFO, "/datax"), Some(("ext4", "/")));
        assert_eq!(
            mount_of(MOUNTINFO, "/dev/shm/q"),
            Some(("tmpfs", "/dev/shm"))
        );
    }

    #[test]
    fn numa_nodes_are_sorted_and_skip_other_entries() {
        let nodes = numa_nodes([("node1", "4-7\n"), ("possible", "0-1"), ("node0", "0-3")]);
        assert_eq!(nodes, vec![(0, vec![0, 1, 2, 3]), (1, vec![4, 5, 6, 7])]);
    }
}
