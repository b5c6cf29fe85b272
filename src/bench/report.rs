//! What a bench run reports, and the files it writes: the JSON summary (exactly the keys scripts
//! read), HdrHistogram `.hgrm` percentile-distribution text, and an SVG latency-by-percentile
//! plot with the x axis in "nines" like HdrHistogram's plotter.
//!
//! Pure: every function here turns numbers into a `String` or a struct; the driver writes them
//! to files. Latencies are recorded in microseconds.

use std::fmt::Write as _;

use hdrhistogram::Histogram;
use serde::Serialize;

/// Highest latency a histogram holds, in µs (one hour); larger values are clamped to it.
pub const LATENCY_US_MAX: u64 = 3_600_000_000;
/// Significant decimal digits of every latency histogram.
pub const LATENCY_SIGFIG: u8 = 3;
// HdrHistogram's bounds rules (high >= 2 * low with low = 1, at most 5 significant figures),
// checked when this file compiles.
const _: () = assert!(LATENCY_US_MAX >= 2 && LATENCY_SIGFIG <= 5);

/// An empty latency histogram with the bench's bounds.
pub fn latency_histogram() -> Histogram<u64> {
    // The bounds are the constants asserted above: this cannot fail.
    Histogram::new_with_bounds(1, LATENCY_US_MAX, LATENCY_SIGFIG)
        .unwrap_or_else(|e| unreachable!("constant histogram bounds rejected: {e}"))
}

/// Percentiles of one latency, in µs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Percentiles {
    pub p50: u64,
    pub p95: u64,
    pub p99: u64,
    pub p999: u64,
    pub p9999: u64,
    pub max: u64,
}

impl Percentiles {
    /// Zeros for an empty histogram.
    pub fn of(h: &Histogram<u64>) -> Percentiles {
        if h.is_empty() {
            return Percentiles::default();
        }
        Percentiles {
            p50: h.value_at_quantile(0.50),
            p95: h.value_at_quantile(0.95),
            p99: h.value_at_quantile(0.99),
            p999: h.value_at_quantile(0.999),
            p9999: h.value_at_quantile(0.9999),
            max: h.max(),
        }
    }
}

/// The `--json` summary: these keys and no others (scripts and the comparison read them).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Summary {
    pub msgs_per_sec: f64,
    pub mb_per_sec: f64,
    pub sent: u64,
    pub received: u64,
    pub duplicates: u64,
    pub missing: u64,
    pub e2e_us: Percentiles,
    pub publish_ack_us: Percentiles,
    pub ack_us: Percentiles,
}

/// The broker's resource use during the measured window, when the bench can see its process.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct BrokerUsage {
    /// User + system CPU seconds spent in the measured window.
    pub cpu_secs: f64,
    /// Peak resident set (VmHWM), in bytes.
    pub peak_rss_bytes: u64,
    /// CPU seconds while the bench waited for the last deliveries after sending ended (delayed
    /// messages waiting, or a backlog draining), and how long that wait was.
    pub drain_cpu_secs: f64,
    pub drain_secs: f64,
    /// Seconds the broker's threads waited for a CPU in the measured window (other processes
    /// on the machine), when known.
    pub runqueue_wait_secs: Option<f64>,
}

/// Throughput from counts over a window.
pub fn throughput(messages: u64, payload_bytes: usize, window_secs: f64) -> (f64, f64) {
    if window_secs <= 0.0 {
        return (0.0, 0.0);
    }
    let per_sec = messages as f64 / window_secs;
    (per_sec, per_sec * payload_bytes as f64 / 1_000_000.0)
}

/// The human-readable report printed at the end of a run.
pub fn text_report(
    summary: &Summary,
    window_secs: f64,
    broker: Option<BrokerUsage>,
    foreign: u64,
) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "throughput: {:.0} msgs/s, {:.2} MB/s end to end over {:.2} s",
        summary.msgs_per_sec, summary.mb_per_sec, window_secs
    );
    let _ = writeln!(
        out,
        "messages:   sent {}, received {}, duplicates {}, missing {}{}",
        summary.sent,
        summary.received,
        summary.duplicates,
        summary.missing,
        if foreign > 0 {
            format!(", foreign {foreign}")
        } else {
            String::new()
        }
    );
    match broker {
        Some(b) => {
            let _ = writeln!(
                out,
                "broker:     {:.2} CPU s ({:.0} % of one core), peak RSS {:.1} MiB",
                b.cpu_secs,
                if window_secs > 0.0 {
                    100.0 * b.cpu_secs / window_secs
                } else {
                    0.0
                },
                b.peak_rss_bytes as f64 / (1024.0 * 1024.0)
            );
            if let Some(wait) = b.runqueue_wait_secs {
                let _ = writeln!(
                    out,
                    "            waited {wait:.2} s for a CPU (runnable, not running) in the window"
                );
            }
            if b.drain_secs > 0.0 {
                let _ = writeln!(
                    out,
                    "            after sending: {:.2} CPU s over {:.2} s of draining/waiting",
                    b.drain_cpu_secs, b.drain_secs
                );
            }
        }
        None => {
            let _ = writeln!(out, "broker:     not measured (no --broker-pid)");
        }
    }
    let _ = writeln!(
        out,
        "{:<14} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9}",
        "latency (µs)", "p50", "p95", "p99", "p99.9", "p99.99", "max"
    );
    for (name, p) in [
        ("end to end", &summary.e2e_us),
        ("publish ack", &summary.publish_ack_us),
        ("ack", &summary.ack_us),
    ] {
        let _ = writeln!(
            out,
            "{:<14} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9}",
            name, p.p50, p.p95, p.p99, p.p999, p.p9999, p.max
        );
    }
    out
}

/// HdrHistogram's percentile-distribution text (as `outputPercentileDistribution(out, 5,
/// 1000.0)` writes it), with values converted from µs to milliseconds.
pub fn hgrm(h: &Histogram<u64>) -> String {
    const SCALE: f64 = 1000.0;
    let mut out = String::new();
    let _ = write!(
        out,
        "{:>12} {:>14} {:>10} {:>14}\n\n",
        "Value", "Percentile", "TotalCount", "1/(1-Percentile)"
    );
    let mut total = 0u64;
    if !h.is_empty() {
        for v in h.iter_quantiles(5) {
            total += v.count_since_last_iteration();
            let q = v.quantile_iterated_to();
            let value = v.value_iterated_to() as f64 / SCALE;
            if q < 1.0 {
                let _ = writeln!(
                    out,
                    "{value:>12.3} {q:>2.12} {total:>10} {:>14.2}",
                    1.0 / (1.0 - q)
                );
            } else {
                let _ = writeln!(out, "{value:>12.3} {q:>2.12} {total:>10}");
            }
        }
    }
    let _ = writeln!(
        out,
        "#[Mean    = {:>12.3}, StdDeviation   = {:>12.3}]",
        h.mean() / SCALE,
        h.stdev() / SCALE
    );
    let _ = writeln!(
        out,
        "#[Max     = {:>12.3}, Total count    = {:>12}]",
        h.max() as f64 / SCALE,
        h.len()
    );
    let _ = writeln!(
        out,
        "#[Buckets = {:>12}, SubBuckets     = {:>12}]",
        h.buckets(),
        sub_bucket_count(h.sigfig())
    );
    out
}

/// HdrHistogram's sub-bucket count for a precision: 2^ceil(log2(2·10^sigfig)).
fn sub_bucket_count(sigfig: u8) -> u64 {
    let single_unit_max = 2 * 10u64.pow(u32::from(sigfig));
    single_unit_max.next_power_of_two()
}

/// One curve of the plot.
pub struct Series<'a> {
    pub name: &'a str,
    pub histogram: &'a Histogram<u64>,
    pub color: &'a str,
}

/// Plot geometry, in SVG user units.
const SVG_WIDTH: f64 = 900.0;
const SVG_HEIGHT: f64 = 520.0;
const PLOT_LEFT: f64 = 80.0;
const PLOT_RIGHT: f64 = 860.0;
const PLOT_TOP: f64 = 50.0;
const PLOT_BOTTOM: f64 = 450.0;
/// The x axis ends at 99.9999 % (six nines).
const NINES_MAX: f64 = 6.0;

/// An SVG plot of latency (ms, linear y) by percentile (x = log10(1/(1-q)), "nines").
pub fn svg_plot(title: &str, series: &[Series<'_>]) -> String {
    let y_max_ms = series
        .iter()
        .map(|s| s.histogram.max() as f64 / 1000.0)
        .fold(0.0f64, f64::max);
    let y_top = nice_ceiling(y_max_ms.max(0.001));
    let x_of = |nines: f64| PLOT_LEFT + (PLOT_RIGHT - PLOT_LEFT) * nines.min(NINES_MAX) / NINES_MAX;
    let y_of = |ms: f64| PLOT_BOTTOM - (PLOT_BOTTOM - PLOT_TOP) * (ms / y_top).min(1.0);

    let mut out = String::new();
    let _ = writeln!(
        out,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{SVG_WIDTH}" height="{SVG_HEIGHT}" viewBox="0 0 {SVG_WIDTH} {SVG_HEIGHT}" font-family="sans-serif" font-size="12">"#
    );
    let _ = writeln!(
        out,
        r#"<rect width="100%" height="100%" fill="white"/><text x="{}" y="28" font-size="16" text-anchor="middle">{}</text>"#,
        SVG_WIDTH / 2.0,
        escape(title)
    );
    // Grid and tick labels.
    for nines in 0..=NINES_MAX as u32 {
        let x = x_of(f64::from(nines));
        let _ = writeln!(
            out,
            r##"<line x1="{x:.1}" y1="{PLOT_TOP}" x2="{x:.1}" y2="{PLOT_BOTTOM}" stroke="#ddd"/><text x="{x:.1}" y="{:.1}" text-anchor="middle">{}</text>"##,
            PLOT_BOTTOM + 18.0,
            nines_label(nines)
        );
    }
    for step in 0..=5 {
        let ms = y_top * f64::from(step) / 5.0;
        let y = y_of(ms);
        let _ = writeln!(
            out,
            r##"<line x1="{PLOT_LEFT}" y1="{y:.1}" x2="{PLOT_RIGHT}" y2="{y:.1}" stroke="#ddd"/><text x="{:.1}" y="{:.1}" text-anchor="end">{}</text>"##,
            PLOT_LEFT - 6.0,
            y + 4.0,
            format_ms(ms)
        );
    }
    let _ = writeln!(
        out,
        r##"<rect x="{PLOT_LEFT}" y="{PLOT_TOP}" width="{}" height="{}" fill="none" stroke="#333"/>"##,
        PLOT_RIGHT - PLOT_LEFT,
        PLOT_BOTTOM - PLOT_TOP
    );
    let _ = writeln!(
        out,
        r#"<text x="{}" y="{}" text-anchor="middle">Percentile</text><text x="20" y="{}" text-anchor="middle" transform="rotate(-90 20 {})">Latency (milliseconds)</text>"#,
        (PLOT_LEFT + PLOT_RIGHT) / 2.0,
        PLOT_BOTTOM + 40.0,
        (PLOT_TOP + PLOT_BOTTOM) / 2.0,
        (PLOT_TOP + PLOT_BOTTOM) / 2.0
    );
    // Curves, each a line through the points of its percentile distribution.
    for (index, s) in series.iter().enumerate() {
        let mut points = String::new();
        if !s.histogram.is_empty() {
            for v in s.histogram.iter_quantiles(5) {
                let q = v.quantile_iterated_to();
                let nines = if q >= 1.0 {
                    NINES_MAX
                } else {
                    (1.0 / (1.0 - q)).log10()
                };
                let ms = v.value_iterated_to() as f64 / 1000.0;
                let _ = write!(points, "{:.1},{:.1} ", x_of(nines), y_of(ms));
                if nines >= NINES_MAX {
                    break;
                }
            }
        }
        let _ = writeln!(
            out,
            r#"<polyline fill="none" stroke="{}" stroke-width="2" points="{}"/>"#,
            escape(s.color),
            points.trim_end()
        );
        let ly = PLOT_TOP + 18.0 + 18.0 * index as f64;
        let _ = writeln!(
            out,
            r#"<line x1="{:.1}" y1="{ly:.1}" x2="{:.1}" y2="{ly:.1}" stroke="{}" stroke-width="2"/><text x="{:.1}" y="{:.1}">{} (n={})</text>"#,
            PLOT_LEFT + 12.0,
            PLOT_LEFT + 36.0,
            escape(s.color),
            PLOT_LEFT + 42.0,
            ly + 4.0,
            escape(s.name),
            s.histogram.len()
        );
    }
    out.push_str("</svg>\n");
    out
}

/// "0%", "90%", "99%", "99.9%", …
fn nines_label(nines: u32) -> String {
    match nines {
        0 => "0%".to_owned(),
        1 => "90%".to_owned(),
        n => format!("99.{}%", "9".repeat(n as usize - 2)).replace("99.%", "99%"),
    }
}

fn format_ms(ms: f64) -> String {
    if ms == 0.0 {
        "0".to_owned()
    } else if ms >= 10.0 {
        format!("{ms:.0}")
    } else if ms >= 1.0 {
        format!("{ms:.1}")
    } else {
        format!("{ms:.3}")
    }
}

/// The smallest 1, 2 or 5 × 10^k at or above `v`.
fn nice_ceiling(v: f64) -> f64 {
    let magnitude = 10f64.powf(v.log10().floor());
    for m in [1.0, 2.0, 5.0, 10.0] {
        if m * magnitude >= v {
            return m * magnitude;
        }
    }
    10.0 * magnitude
}

fn escape(text: &str) -> String {
    text.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn histogram(values: impl IntoIterator<Item = u64>) -> Histogram<u64> {
        let mut h = latency_histogram();
        for v in values {
            h.saturating_record(v);
        }
        h
    }

    #[test]
    fn percentiles_of_a_uniform_histogram() {
        let h = histogram(1..=10_000);
        let p = Percentiles::of(&h);
        assert!((4_990..=5_010).contains(&p.p50), "{p:?}");
        assert!((9_890..=9_910).contains(&p.p99), "{p:?}");
        assert_eq!(p.max, h.max());
        assert_eq!(
            Percentiles::of(&latency_histogram()),
            Percentiles::default()
        );
    }

    #[test]
    fn summary_json_has_exactly_the_documented_keys() {
        let summary = Summary {
            msgs_per_sec: 1.5,
            mb_per_sec: 0.1,
            sent: 3,
            received: 3,
            duplicates: 0,
            missing: 0,
            e2e_us: Percentiles::default(),
            publish_ack_us: Percentiles::default(),
            ack_us: Percentiles::default(),
        };
        let value = serde_json::to_value(&summary).expect("serializes");
        let mut keys: Vec<&str> = value
            .as_object()
            .expect("an object")
            .keys()
            .map(String::as_str)
            .collect();
        keys.sort_unstable();
        assert_eq!(
            keys,
            [
                "ack_us",
                "duplicates",
                "e2e_us",
                "mb_per_sec",
                "missing",
                "msgs_per_sec",
                "publish_ack_us",
                "received",
                "sent"
            ]
        );
        let mut latency_keys: Vec<&str> = value["e2e_us"]
            .as_object()
            .expect("an object")
            .keys()
            .map(String::as_str)
            .collect();
        latency_keys.sort_unstable();
        assert_eq!(latency_keys, ["max", "p50", "p95", "p99", "p999", "p9999"]);
    }

    #[test]
    fn hgrm_follows_the_percentile_distribution_format() {
        // Values below 2048 are exact at three significant digits.
        let h = histogram([100, 200, 300, 400]);
        let text = hgrm(&h);
        let mut lines = text.lines();
        assert_eq!(
            lines.next(),
            Some("       Value     Percentile TotalCount 1/(1-Percentile)")
        );
        assert_eq!(lines.next(), Some(""));
        let first: Vec<&str> = lines.next().expect("a row").split_whitespace().collect();
        assert_eq!(first, ["0.100", "0.000000000000", "1", "1.00"]);
        assert!(text.contains("#[Max     =        0.400, Total count    =            4]"));
        assert!(text.contains("SubBuckets     =         2048]"));
        // The last row is the 100th percentile with the whole count and no inverse column.
        let last_row = text
            .lines()
            .rfind(|l| !l.starts_with('#') && !l.is_empty())
            .expect("rows");
        assert_eq!(
            last_row.split_whitespace().collect::<Vec<_>>(),
            ["0.400", "1.000000000000", "4"]
        );
    }

    #[test]
    fn svg_plot_draws_one_curve_per_series_with_nines_labels() {
        let a = histogram(1..=1000);
        let b = histogram([50, 60]);
        let svg = svg_plot(
            "t <1>",
            &[
                Series {
                    name: "e2e",
                    histogram: &a,
                    color: "#1f77b4",
                },
                Series {
                    name: "ack",
                    histogram: &b,
                    color: "#d62728",
                },
            ],
        );
        assert!(svg.starts_with("<svg"));
        assert!(svg.trim_end().ends_with("</svg>"));
        assert_eq!(svg.matches("<polyline").count(), 2);
        for label in [">0%<", ">90%<", ">99%<", ">99.9%<", ">99.9999%<"] {
            assert!(svg.contains(label), "missing {label}");
        }
        assert!(svg.contains("t &lt;1&gt;"));
    }

    #[test]
    fn nice_ceiling_rounds_up_to_1_2_5() {
        assert_eq!(nice_ceiling(0.7), 1.0);
        assert_eq!(nice_ceiling(1.5), 2.0);
        assert_eq!(nice_ceiling(30.0), 50.0);
        assert_eq!(nice_ceiling(100.0), 100.0);
    }

    #[test]
    fn throughput_of_an_empty_window_is_zero() {
        assert_eq!(throughput(10, 100, 0.0), (0.0, 0.0));
        assert_eq!(throughput(200, 100, 2.0), (100.0, 0.01));
    }
}
