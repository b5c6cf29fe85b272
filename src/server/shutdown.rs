//! Graceful shutdown: SIGTERM/SIGINT handling and the flag every shard watches.
//!
//! The first SIGTERM or SIGINT sets [`ShutdownFlag`]; each shard notices it within
//! [`SHUTDOWN_POLL`] (a timer in its background queue: a glommio executor cannot be woken from a
//! plain thread without a channel end, and one relaxed load every 50 ms costs nothing), stops
//! accepting, lets in-flight publishes finish, closes its subscriptions, flushes its deleter,
//! closes its store and returns, which ends its executor; `run` then joins them and `pinq serve`
//! exits 0. A second signal exits at once with status 128 + the signal number (130 for SIGINT,
//! 143 for SIGTERM), as shells report a process killed by that signal.
//!
//! Who calls it: `super::run` installs the handler; `super::shard_main` waits on the flag.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use signal_hook::consts::{SIGINT, SIGTERM};
use signal_hook::iterator::Signals;

/// How often an idle shard looks at the flag.
pub const SHUTDOWN_POLL: Duration = Duration::from_millis(50);

/// The longest a shard waits for in-flight publishes and delete flushes before it closes its
/// store anyway (a store that hangs must not keep the process up forever).
pub const DRAIN_MAX: Duration = Duration::from_secs(30);

/// Set once a shutdown was asked for: by a signal, or by a shard whose store failed for good
/// (an environmental failure the node cannot survive ends the whole process, never one dead
/// shard beside live ones).
#[derive(Clone, Debug, Default)]
pub struct ShutdownFlag {
    requested: Arc<AtomicBool>,
    failure: Arc<OnceLock<String>>,
}

impl ShutdownFlag {
    pub fn request(&self) {
        self.requested.store(true, Ordering::Relaxed);
    }

    /// Asks for a shutdown because of `reason`, after which `pinq serve` exits with an error.
    /// Returns whether this was the first failure (the caller logs only then).
    pub fn fail(&self, reason: String) -> bool {
        let first = self.failure.set(reason).is_ok();
        self.request();
        first
    }

    /// The first failure that asked for the shutdown, if one did.
    pub fn failure(&self) -> Option<&str> {
        self.failure.get().map(String::as_str)
    }

    pub fn is_requested(&self) -> bool {
        self.requested.load(Ordering::Relaxed)
    }

    /// The shared flag, for the metrics endpoint's `/healthz`.
    pub fn shared(&self) -> Arc<AtomicBool> {
        self.requested.clone()
    }

    /// Resolves once a shutdown was asked for (call on a shard's executor).
    pub async fn requested(&self) {
        while !self.is_requested() {
            glommio::timer::sleep(SHUTDOWN_POLL).await;
        }
    }
}

/// Makes a panic anywhere in the broker stop the whole node: the panic is printed as usual, the
/// failure is recorded in `flag` (every other shard drains and closes its store, then
/// `pinq serve` exits 1 naming the panic), and should the drain itself hang, a watchdog ends
/// the process with status 70 once [`DRAIN_MAX`] and a grace period have passed. A node never
/// goes on serving with one dead shard beside live ones.
pub fn stop_node_on_panic(flag: ShutdownFlag) {
    let print = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        print(info);
        let thread = std::thread::current()
            .name()
            .unwrap_or("a thread")
            .to_string();
        let reason = format!("{thread} panicked: {}", panic_text(info));
        if !flag.fail(reason.clone()) {
            return;
        }
        eprintln!("pinq: {reason}; stopping the node");
        let _ = std::thread::Builder::new()
            .name("pinq-panic-watchdog".into())
            .spawn(|| {
                std::thread::sleep(DRAIN_MAX + PANIC_GRACE);
                eprintln!(
                    "pinq: the node did not stop within {:?} of a panic: exiting",
                    DRAIN_MAX + PANIC_GRACE
                );
                std::process::exit(70);
            });
    }));
}

/// Beyond [`DRAIN_MAX`], how long the panic watchdog waits for an orderly stop.
const PANIC_GRACE: Duration = Duration::from_secs(5);

fn panic_text(info: &std::panic::PanicHookInfo<'_>) -> String {
    let payload = info
        .payload()
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| info.payload().downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "(no message)".into());
    match info.location() {
        Some(at) => format!("{payload} at {at}"),
        None => payload,
    }
}

/// Installs the SIGTERM/SIGINT handler thread for `flag`.
pub fn install(flag: ShutdownFlag) -> anyhow::Result<()> {
    let mut signals = Signals::new([SIGTERM, SIGINT])
        .map_err(|e| anyhow::anyhow!("cannot install the SIGTERM/SIGINT handler: {e}"))?;
    std::thread::Builder::new()
        .name("pinq-signals".into())
        .spawn(move || {
            for signal in signals.forever() {
                if flag.is_requested() {
                    eprintln!("pinq: second signal {signal}: exiting at once");
                    std::process::exit(128 + signal);
                }
                tracing::info!(signal, "shutting down: draining publishes, flushing deletes (send the signal again to exit at once)");
                flag.request();
            }
        })?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_failure_requests_the_shutdown_and_the_first_reason_is_kept() {
        let flag = ShutdownFlag::default();
        assert!(!flag.is_requested() && flag.failure().is_none());
        assert!(flag.fail("shard 0: disk gone".into()));
        assert!(
            !flag.fail("shard 1: disk gone too".into()),
            "later failures are not logged"
        );
        assert!(flag.is_requested() && flag.shared().load(Ordering::Relaxed));
        assert_eq!(flag.failure(), Some("shard 0: disk gone"));
    }
}
