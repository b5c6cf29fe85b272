//! Regenerates the Rust code of the Cap'n Proto schemas when the `capnp` program is installed:
//! `schema/pinq.capnp` (the client protocol) into `src/rpc/pinq_capnp.rs` and
//! `schema/replication.capnp` (node to node) into `src/rpc/replication_capnp.rs`.
//!
//! The generated files are committed, so pinq builds on machines without `capnp`; where the
//! program is present, each file is regenerated into `OUT_DIR` and copied over the committed one
//! only if it differs (an unchanged file keeps its timestamp and triggers no rebuild).
//! `schema/check-generated.sh` sets `PINQ_CAPNP_CHECK_DIR` to make this script write the fresh
//! code there instead of touching `src/`, and compares it with the committed copy.

use std::path::{Path, PathBuf};
use std::process::Command;

/// Each schema with the committed file its code goes to (the generated file's name is the
/// schema's, `.capnp` replaced by `_capnp.rs`).
const SCHEMAS: [(&str, &str); 2] = [
    ("schema/pinq.capnp", "src/rpc/pinq_capnp.rs"),
    ("schema/replication.capnp", "src/rpc/replication_capnp.rs"),
];
const CHECK_DIR_VAR: &str = "PINQ_CAPNP_CHECK_DIR";

fn main() {
    for (schema, generated) in SCHEMAS {
        println!("cargo:rerun-if-changed={schema}");
        println!("cargo:rerun-if-changed={generated}");
    }
    println!("cargo:rerun-if-env-changed={CHECK_DIR_VAR}");
    if !capnp_installed() {
        // No compiler: the committed copy is used as it is.
        return;
    }
    if let Err(e) = regenerate() {
        // A broken schema must not go unnoticed where the compiler is present.
        panic!("regenerating the Cap'n Proto code of {SCHEMAS:?}: {e}");
    }
}

fn capnp_installed() -> bool {
    Command::new("capnp")
        .arg("--version")
        .output()
        .is_ok_and(|out| out.status.success())
}

fn regenerate() -> Result<(), Box<dyn std::error::Error>> {
    let out_dir = PathBuf::from(std::env::var("OUT_DIR")?).join("capnp");
    std::fs::create_dir_all(&out_dir)?;
    let mut command = capnpc::CompilerCommand::new();
    command
        .src_prefix("schema")
        // The schemas import nothing: the output must not depend on what else a machine has
        // installed.
        .no_standard_import()
        .default_parent_module(vec!["rpc".into()])
        .output_path(&out_dir);
    for (schema, _) in SCHEMAS {
        command.file(schema);
    }
    command.run()?;
    for (_, generated) in SCHEMAS {
        let generated = Path::new(generated);
        let name = generated
            .file_name()
            .ok_or("a generated path without a file name")?;
        let fresh = std::fs::read(out_dir.join(name))?;
        let target = match std::env::var_os(CHECK_DIR_VAR) {
            Some(dir) if !dir.is_empty() => Path::new(&dir).join(name),
            _ => PathBuf::from(generated),
        };
        let current = std::fs::read(&target).unwrap_or_default();
        if without_tool_version(&current) != without_tool_version(&fresh) {
            std::fs::write(&target, &fresh)?;
        }
    }
    Ok(())
}

/// The generated code minus the line naming the `capnp` program's version, so that another
/// version of the tool producing the same code does not rewrite the committed file.
fn without_tool_version(code: &[u8]) -> Vec<&[u8]> {
    code.split(|&b| b == b'\n')
        .filter(|line| !line.starts_with(b"// capnp binary version:"))
        .collect()
}
