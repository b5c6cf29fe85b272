//! Byte sizes as written in the config: an integer count of bytes, or a string with a binary unit
//! (`"64MiB"`, `"512 KiB"`, `"1GiB"`).
//!
//! Only powers of 1024 spelled the IEC way (`KiB`, `MiB`, `GiB`, `TiB`, case-insensitive) and
//! plain bytes (`B`) are accepted. `"64MB"` is refused rather than guessed: half the world reads it
//! as 64 000 000 and the other half as 64 MiB, and a memtable or segment bound off by 5 % is the
//! kind of mistake nobody notices until it matters. Used only while loading the config.

/// Why a byte size did not parse.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ByteSizeError {
    #[error("\"{text}\" is not a byte size: write a whole number of bytes or e.g. \"64MiB\"")]
    Malformed { text: String },
    #[error("unit \"{unit}\" in \"{text}\" is not accepted: use B, KiB, MiB, GiB or TiB (powers of 1024)")]
    UnknownUnit { text: String, unit: String },
    #[error("\"{text}\" does not fit in 64 bits")]
    Overflow { text: String },
}

const UNITS: [(&str, u64); 5] = [
    ("b", 1),
    ("kib", 1 << 10),
    ("mib", 1 << 20),
    ("gib", 1 << 30),
    ("tib", 1 << 40),
];

/// Parses `"64MiB"`, `"64 MiB"`, `"4096"` or `"4096B"` into bytes.
pub fn parse_byte_size(text: &str) -> Result<u64, ByteSizeError> {
    let trimmed = text.trim();
    let digits_end = trimmed
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(trimmed.len());
    let (digits, unit) = trimmed.split_at(digits_end);
    if digits.is_empty() {
        return Err(ByteSizeError::Malformed {
            text: text.to_owned(),
        });
    }
    let count: u64 = digits.parse().map_err(|_| ByteSizeError::Overflow {
        text: text.to_owned(),
    })?;
    let unit = unit.trim();
    let multiplier = if unit.is_empty() {
        1
    } else {
        let lower = unit.to_ascii_lowercase();
        match UNITS.iter().find(|(name, _)| *name == lower) {
            Some((_, multiplier)) => *multiplier,
            None if unit.chars().all(|c| c.is_ascii_alphabetic()) => {
                return Err(ByteSizeError::UnknownUnit {
                    text: text.to_owned(),
                    unit: unit.to_owned(),
                })
            }
            None => {
                return Err(ByteSizeError::Malformed {
                    text: text.to_owned(),
                })
            }
        }
    };
    count
        .checked_mul(multiplier)
        .ok_or_else(|| ByteSizeError::Overflow {
            text: text.to_owned(),
        })
}

/// Writes a byte count in the largest binary unit that divides it exactly (`67108864` → `"64MiB"`),
/// so that [`parse_byte_size`] reads it back to the same number.
pub fn format_byte_size(bytes: u64) -> String {
    let unit = UNITS
        .iter()
        .rev()
        .find(|(_, multiplier)| bytes != 0 && bytes % multiplier == 0);
    match unit {
        Some((name, multiplier)) if *multiplier > 1 => {
            let spelled = match *name {
                "kib" => "KiB",
                "mib" => "MiB",
                "gib" => "GiB",
                _ => "TiB",
            };
            format!("{}{spelled}", bytes / multiplier)
        }
        _ => bytes.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn binary_units_multiply_by_powers_of_1024() {
        assert_eq!(parse_byte_size("64MiB"), Ok(64 << 20));
        assert_eq!(parse_byte_size("64 MiB"), Ok(64 << 20));
        assert_eq!(parse_byte_size("512kib"), Ok(512 << 10));
        assert_eq!(parse_byte_size("2GiB"), Ok(2 << 30));
        assert_eq!(parse_byte_size("1TiB"), Ok(1 << 40));
        assert_eq!(parse_byte_size("4096"), Ok(4096));
        assert_eq!(parse_byte_size("4096B"), Ok(4096));
        assert_eq!(parse_byte_size("0"), Ok(0));
    }

    #[test]
    fn decimal_and_abbreviated_units_are_refused_not_guessed() {
        for text in ["64MB", "64M", "1k", "1GB"] {
            assert!(
                matches!(
                    parse_byte_size(text),
                    Err(ByteSizeError::UnknownUnit { .. })
                ),
                "{text}"
            );
        }
    }

    #[test]
    fn malformed_and_overflowing_sizes_are_errors() {
        for text in ["", "MiB", "-1", "1.5MiB", "12 34"] {
            assert!(
                matches!(parse_byte_size(text), Err(ByteSizeError::Malformed { .. })),
                "{text}"
            );
        }
        assert!(matches!(
            parse_byte_size("99999999999999999999"),
            Err(ByteSizeError::Overflow { .. })
        ));
        assert!(matches!(
            parse_byte_size("17000000TiB"),
            Err(ByteSizeError::Overflow { .. })
        ));
    }

    #[test]
    fn formatted_sizes_parse_back_to_the_same_count() {
        for bytes in [0, 1, 1000, 4096, 1 << 20, 64 << 20, 3 << 30, (1 << 20) + 1] {
            assert_eq!(parse_byte_size(&format_byte_size(bytes)), Ok(bytes));
        }
        assert_eq!(format_byte_size(64 << 20), "64MiB");
        assert_eq!(format_byte_size(1000), "1000");
    }
}
