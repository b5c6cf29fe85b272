//! `pinq doctor` on this host: it runs, prints one line per check and a verdict that agrees with
//! its exit status, and a CPU set pinq cannot use makes it exit 2. Which warnings a host has
//! depends on the host; these tests check only what holds everywhere.

mod support;

use support::cli;

const CHECKS: &[&str] = &[
    "cpu set",
    "cpu governor",
    "smt siblings",
    "isolated cores",
    "nic irq affinity",
    "numa layout",
    "transparent huge pages",
    "memlock limit",
    "open files limit",
    "io_uring",
    "data directory",
];

#[test]
fn doctor_reports_every_check_and_a_verdict_matching_its_exit_status() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().to_str().unwrap();
    let (code, out, err) = cli(&["doctor", "--data-dir", dir, "--cpus", "0"], None);
    assert!((0..=2).contains(&code), "exit {code}: {out}{err}");
    for check in CHECKS {
        assert!(
            out.lines()
                .any(|l| l.get(6..).is_some_and(|rest| rest.starts_with(check))),
            "no line for {check}:\n{out}"
        );
    }
    let verdict = out.lines().last().unwrap_or_default();
    let expected = match code {
        0 => "nothing to change",
        1 => "warnings",
        _ => "cannot run",
    };
    assert!(verdict.contains(expected), "exit {code} but {verdict}");
    assert_eq!(
        out.contains("\nBLOCK ") || out.starts_with("BLOCK "),
        code == 2,
        "{out}"
    );
    // The O_DIRECT probe leaves nothing behind.
    assert_eq!(std::fs::read_dir(tmp.path()).unwrap().count(), 0);
}

#[test]
fn doctor_exits_2_when_the_cpu_set_is_unusable() {
    let (code, out, _) = cli(&["doctor", "--cpus", "4095"], None);
    assert_eq!(code, 2, "{out}");
    assert!(out.starts_with("BLOCK cpu set"), "{out}");
}
