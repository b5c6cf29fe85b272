//! Reading the host for `pinq doctor` and `--numa auto`: `/sys`, `/proc`, one `io_uring_setup`
//! and one O_DIRECT write+read. The only I/O of `crate::ops`; every parse is in `parse.rs`.
//! A file that is missing (an older kernel, a VM without cpufreq) reads as "not there", never as
//! an error: each check says what it could not see.

use std::fs;
use std::io::{Read, Seek, SeekFrom, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use super::checks::NicIrq;
use super::parse;

fn read(path: impl AsRef<Path>) -> Option<String> {
    fs::read_to_string(path).ok()
}

/// `scaling_governor` of each CPU, `None` where cpufreq is absent.
pub fn governors(cpus: &[usize]) -> Vec<(usize, Option<String>)> {
    cpus.iter()
        .map(|cpu| {
            let path = format!("/sys/devices/system/cpu/cpu{cpu}/cpufreq/scaling_governor");
            (*cpu, read(path).map(|g| g.trim().to_owned()))
        })
        .collect()
}

/// `thread_siblings_list` of each CPU.
pub fn siblings(cpus: &[usize]) -> Vec<(usize, Vec<usize>)> {
    cpus.iter()
        .filter_map(|cpu| {
            let path = format!("/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list");
            Some((*cpu, parse::cpu_list(&read(path)?)?))
        })
        .collect()
}

/// A CPU list file under `/sys/devices/system/cpu/` (`isolated`, `nohz_full`); empty if absent.
pub fn cpu_list_file(name: &str) -> Vec<usize> {
    read(format!("/sys/devices/system/cpu/{name}"))
        .and_then(|text| parse::cpu_list(&text))
        .unwrap_or_default()
}

/// Network interfaces backed by a device (not `lo`, bridges or tunnels).
fn nics() -> Vec<(String, PathBuf)> {
    let Ok(entries) = fs::read_dir("/sys/class/net") else {
        return Vec::new();
    };
    let mut nics: Vec<(String, PathBuf)> = entries
        .filter_map(Result::ok)
        .filter_map(|e| {
            let device = e.path().join("device");
            device
                .exists()
                .then(|| (e.file_name().to_string_lossy().into_owned(), device))
        })
        .collect();
    nics.sort();
    nics
}

/// The interrupts of each NIC's queues (MSI vectors of its device, or of the PCI function above
/// a virtio device) and the CPUs each may be delivered to.
pub fn nic_irqs() -> Vec<NicIrq> {
    let mut out = Vec::new();
    for (nic, device) in nics() {
        let dir = [device.join("msi_irqs"), device.join("../msi_irqs")]
            .into_iter()
            .find(|d| d.is_dir());
        let Some(Ok(entries)) = dir.map(fs::read_dir) else {
            continue;
        };
        let mut irqs: Vec<u32> = entries
            .filter_map(Result::ok)
            .filter_map(|e| e.file_name().to_string_lossy().parse().ok())
            .collect();
        irqs.sort_unstable();
        for irq in irqs {
            let cpus = ["effective_affinity_list", "smp_affinity_list"]
                .iter()
                .find_map(|f| {
                    read(format!("/proc/irq/{irq}/{f}")).and_then(|t| parse::cpu_list(&t))
                })
                .filter(|cpus| !cpus.is_empty());
            if let Some(cpus) = cpus {
                out.push(NicIrq {
                    nic: nic.clone(),
                    irq,
                    cpus,
                });
            }
        }
    }
    out
}

/// The NUMA node of the first NIC that reports one (`numa_node` ≥ 0).
pub fn nic_numa_node() -> Option<(String, usize)> {
    nics().into_iter().find_map(|(nic, device)| {
        let node = [device.join("numa_node"), device.join("../numa_node")]
            .iter()
            .find_map(|p| read(p)?.trim().parse::<i64>().ok())?;
        usize::try_from(node).ok().map(|node| (nic, node))
    })
}

/// NUMA nodes and their CPUs.
pub fn numa_nodes() -> Vec<(usize, Vec<usize>)> {
    let Ok(entries) = fs::read_dir("/sys/devices/system/node") else {
        return Vec::new();
    };
    let files: Vec<(String, String)> = entries
        .filter_map(Result::ok)
        .filter_map(|e| {
            let name = e.file_name().to_string_lossy().into_owned();
            let text = read(e.path().join("cpulist"))?;
            Some((name, text))
        })
        .collect();
    parse::numa_nodes(files.iter().map(|(n, t)| (n.as_str(), t.as_str())))
}

/// The selected transparent huge pages mode.
pub fn thp_mode() -> Option<String> {
    read("/sys/kernel/mm/transparent_hugepage/enabled")
        .and_then(|t| parse::bracketed_choice(&t).map(str::to_owned))
}

/// The soft memlock limit in bytes (`None`: unlimited); `Err` if it could not be read.
pub fn memlock_soft() -> Result<Option<u64>, String> {
    let limits = read("/proc/self/limits").ok_or("cannot read /proc/self/limits")?;
    parse::memlock_limits(&limits)
        .map(|(soft, _)| soft.0)
        .ok_or_else(|| "no \"Max locked memory\" line in /proc/self/limits".to_owned())
}

/// The soft open-files limit (`None`: unlimited); `Err` if it could not be read.
pub fn open_files_soft() -> Result<Option<u64>, String> {
    let limits = read("/proc/self/limits").ok_or("cannot read /proc/self/limits")?;
    parse::open_files_limits(&limits)
        .map(|(soft, _)| soft.0)
        .ok_or_else(|| "no \"Max open files\" line in /proc/self/limits".to_owned())
}

/// Whether this process runs as root (root may lock memory past the limit).
pub fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() == 0 }
}

/// `kernel.io_uring_disabled` (0 when the file is absent, as on kernels before 6.6).
pub fn io_uring_disabled() -> u8 {
    read("/proc/sys/kernel/io_uring_disabled")
        .and_then(|t| parse::io_uring_disabled(&t))
        .unwrap_or(0)
}

/// Creates and closes a small io_uring, which is what every shard does at start.
pub fn io_uring_setup_works() -> Result<(), String> {
    // struct io_uring_params is 120 bytes; all zero asks for the defaults.
    let mut params = [0u8; 120];
    // SAFETY: io_uring_setup reads and writes exactly one io_uring_params, which `params` is
    // large enough and suitably aligned (u8, the kernel copies it) to hold.
    let fd = unsafe { libc::syscall(libc::SYS_io_uring_setup, 4u32, params.as_mut_ptr()) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error().to_string());
    }
    // SAFETY: `fd` was just returned by the kernel and is closed once.
    unsafe { libc::close(fd as libc::c_int) };
    Ok(())
}

/// The directory to probe: `dir` itself, or its nearest existing ancestor (canonical), and
/// whether that is `dir`.
pub fn existing_dir(dir: &Path) -> Option<(PathBuf, bool)> {
    let absolute = std::path::absolute(dir).ok()?;
    let mut probe = absolute.as_path();
    loop {
        if probe.is_dir() {
            return Some((probe.canonicalize().ok()?, probe == absolute));
        }
        probe = probe.parent()?;
    }
}

/// The file system type under `dir` (canonical) from `/proc/self/mountinfo`.
pub fn fs_type(dir: &Path) -> Option<String> {
    let mountinfo = read("/proc/self/mountinfo")?;
    parse::mount_of(&mountinfo, &dir.to_string_lossy()).map(|(t, _)| t.to_owned())
}

/// Block size of the O_DIRECT probe: the largest logical block size in use (4 KiB).
const PROBE_BYTES: usize = 4096;

/// Writes, syncs and reads back one block with O_DIRECT in `dir`, then removes the file.
pub fn o_direct_works(dir: &Path) -> Result<(), String> {
    let path = dir.join(format!(".pinq-doctor-{}", std::process::id()));
    let result = o_direct_probe(&path);
    let _ = fs::remove_file(&path);
    result
}

fn o_direct_probe(path: &Path) -> Result<(), String> {
    let mut file = fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .custom_flags(libc::O_DIRECT)
        .open(path)
        .map_err(|e| format!("open with O_DIRECT: {e}"))?;
    // O_DIRECT wants the buffer aligned to the block: take an aligned window of a larger buffer.
    let mut out = vec![0u8; PROBE_BYTES * 2];
    let start = out.as_ptr().align_offset(PROBE_BYTES);
    let block = &mut out[start..start + PROBE_BYTES];
    block.fill(0xA5);
    file.write_all(block).map_err(|e| format!("write: {e}"))?;
    file.sync_data().map_err(|e| format!("fdatasync: {e}"))?;
    file.seek(SeekFrom::Start(0))
        .map_err(|e| format!("seek: {e}"))?;
    let mut back = vec![0u8; PROBE_BYTES * 2];
    let start = back.as_ptr().align_offset(PROBE_BYTES);
    let read_block = &mut back[start..start + PROBE_BYTES];
    file.read_exact(read_block)
        .map_err(|e| format!("read: {e}"))?;
    if read_block.iter().any(|b| *b != 0xA5) {
        return Err("read back different bytes".into());
    }
    Ok(())
}

/// Every table file under `data_dir` (its `shard-*` directories, or `data_dir` itself when it
/// is one shard's directory), read whole and checked block by block. Names are relative to
/// `data_dir`; sorted.
pub fn table_reports(data_dir: &Path) -> Vec<super::checks::TableReport> {
    use crate::storage::table::{parse_table_name, reader::check_table_bytes};
    let mut dirs = vec![data_dir.to_path_buf()];
    if let Ok(entries) = std::fs::read_dir(data_dir) {
        for entry in entries.flatten() {
            let name = entry.file_name();
            if name.to_string_lossy().starts_with("shard-") && entry.path().is_dir() {
                dirs.push(entry.path());
            }
        }
    }
    let mut reports = Vec::new();
    for dir in dirs {
        let Ok(entries) = std::fs::read_dir(&dir) else {
            continue;
        };
        for entry in entries.flatten() {
            let file = entry.file_name();
            if parse_table_name(&file.to_string_lossy()).is_none() {
                continue;
            }
            let path = entry.path();
            let name = path
                .strip_prefix(data_dir)
                .unwrap_or(&path)
                .display()
                .to_string();
            let check = match std::fs::read(&path) {
                Ok(bytes) => check_table_bytes(&bytes).map_err(|e| e.to_string()),
                Err(e) => Err(e.to_string()),
            };
            reports.push(super::checks::TableReport { name, check });
        }
    }
    reports.sort_by(|a, b| a.name.cmp(&b.name));
    reports
}
