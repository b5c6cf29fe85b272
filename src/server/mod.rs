//! (being built)

pub fn run(_config: crate::config::Config) -> anyhow::Result<()> {
    anyhow::bail!("the server is not built yet")
}
