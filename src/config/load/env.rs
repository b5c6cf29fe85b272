//! Environment variables as configuration: `PINQ_<SECTION>_<KEY>`, the TOML key in
//! SCREAMING_SNAKE_CASE, their values, and the near-miss hints for misspelled names.

#![allow(unused_imports)]
use super::*;

/// `PINQ_SECTION_REST` → (`section`, `REST`) when SECTION is a config section.
pub(super) fn env_section(name: &str) -> Option<(&'static str, &str)> {
    let rest = name.strip_prefix(ENV_PREFIX)?;
    let (section, key_part) = rest.split_once('_')?;
    let section = sections()
        .iter()
        .copied()
        .find(|known| known.eq_ignore_ascii_case(section))?;
    Some((section, key_part))
}

/// `inFlightTimeout` → `IN_FLIGHT_TIMEOUT`.
pub(super) fn env_key_part(key: &str) -> String {
    let mut out = String::with_capacity(key.len() + 4);
    for c in key.chars() {
        if c.is_ascii_uppercase() {
            out.push('_');
        }
        out.push(c.to_ascii_uppercase());
    }
    out
}

/// The environment variable that sets `section.key`.
pub fn env_var_name(section: &str, key: &str) -> String {
    format!(
        "{ENV_PREFIX}{}_{}",
        section.to_ascii_uppercase(),
        env_key_part(key)
    )
}

/// An environment value as a TOML value: integers as integers, everything else as a string.
pub(super) fn env_value(text: &str) -> toml::Value {
    match text.trim().parse::<i64>() {
        Ok(number) => toml::Value::Integer(number),
        Err(_) => toml::Value::String(text.to_owned()),
    }
}

pub(super) fn normalized(name: &str) -> String {
    name.chars()
        .filter(|c| *c != '_' && *c != '-')
        .map(|c| c.to_ascii_lowercase())
        .collect()
}

/// ` (did you mean "x"?)` when a known name differs from `found` only in case or separators.
pub(super) fn file_hint(candidates: impl Iterator<Item = String>, found: &str) -> String {
    let wanted = normalized(found);
    candidates
        .into_iter()
        .find(|candidate| normalized(candidate) == wanted)
        .map(|candidate| format!(" (did you mean \"{candidate}\"?)"))
        .unwrap_or_default()
}

/// Builds `{ section = { key = value } }` out of settings.
pub(super) fn nest<'a>(
    settings: impl Iterator<Item = (&'a (&'static str, &'static str), &'a Setting)>,
) -> toml::Value {
    let mut root = toml::Table::new();
    for ((section, key), setting) in settings {
        let entry = root
            .entry(section.to_string())
            .or_insert_with(|| toml::Value::Table(toml::Table::new()));
        if let toml::Value::Table(table) = entry {
            table.insert(key.to_string(), setting.value.clone());
        }
    }
    toml::Value::Table(root)
}

/// The `PINQ_…` configuration variables of this process, for [`ConfigLoader::add_env`].
pub fn env_from_process() -> Result<Vec<(String, String)>, ConfigError> {
    let mut vars = Vec::new();
    for (name, value) in std::env::vars_os() {
        let Some(name) = name.to_str() else {
            continue;
        };
        if env_section(name).is_none() {
            continue;
        }
        let value = value
            .into_string()
            .map_err(|_| ConfigError::EnvNotUnicode {
                name: name.to_owned(),
            })?;
        vars.push((name.to_owned(), value));
    }
    Ok(vars)
}
