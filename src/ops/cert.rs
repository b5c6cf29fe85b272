//! `pinq doctor`'s TLS check: how long the server certificate of `[server.tls]` stays valid.
//! Pure: it judges a validity period already read (`crate::security::tls::validity`) at a
//! given moment, so the verdicts are unit-tested at any date.

use super::checks::{Finding, Level};
use crate::security::tls::Validity;

/// A certificate expiring within this many days is a warning.
pub const EXPIRY_WARN_DAYS: i64 = 14;

const DAY_S: i64 = 24 * 3600;

/// The verdict on the certificate file `path` at `now_s` (Unix seconds).
pub fn certificate_expiry(path: &str, validity: Result<Validity, String>, now_s: i64) -> Finding {
    let finding = |level, detail: String, advice: Option<&str>| Finding {
        check: "TLS certificate",
        level,
        detail,
        advice: advice.map(str::to_owned),
    };
    let v = match validity {
        Ok(v) => v,
        Err(e) => return finding(Level::Block, e, Some("fix server.tls.certFile")),
    };
    let left_s = v.not_after_s - now_s;
    if left_s < 0 {
        return finding(
            Level::Block,
            format!(
                "{path} expired {} day(s) ago: pinq serve refuses it",
                -left_s / DAY_S
            ),
            Some("renew the certificate"),
        );
    }
    if now_s < v.not_before_s {
        return finding(
            Level::Block,
            format!("{path} is not valid yet: pinq serve refuses it"),
            Some("check the clock, or the certificate's notBefore"),
        );
    }
    let days = left_s / DAY_S;
    if days < EXPIRY_WARN_DAYS {
        return finding(
            Level::Warn,
            format!("{path} expires in {days} day(s)"),
            Some("renew the certificate and restart pinq before it expires"),
        );
    }
    finding(
        Level::Ok,
        format!("{path} valid for {days} more day(s)"),
        None,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    const NOW: i64 = 1_800_000_000;

    fn valid_until(not_after_s: i64) -> Result<Validity, String> {
        Ok(Validity {
            not_before_s: NOW - 100 * DAY_S,
            not_after_s,
        })
    }

    #[test]
    fn a_certificate_expiring_within_14_days_is_a_warning() {
        let f = certificate_expiry("s.pem", valid_until(NOW + 13 * DAY_S), NOW);
        assert_eq!(f.level, Level::Warn);
        assert!(f.detail.contains("13 day(s)"), "{}", f.detail);
        let f = certificate_expiry("s.pem", valid_until(NOW + 15 * DAY_S), NOW);
        assert_eq!(f.level, Level::Ok);
    }

    #[test]
    fn an_expired_or_unreadable_certificate_blocks() {
        let f = certificate_expiry("s.pem", valid_until(NOW - 2 * DAY_S), NOW);
        assert_eq!(f.level, Level::Block);
        assert!(f.detail.contains("expired 2 day(s) ago"), "{}", f.detail);
        let f = certificate_expiry("s.pem", Err("TLS file s.pem: cannot read it".into()), NOW);
        assert_eq!(f.level, Level::Block);
        assert!(f.detail.contains("s.pem"));
    }
}
