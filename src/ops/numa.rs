//! NUMA placement for `--numa auto`: run every shard on the CPUs of one node.
//!
//! [`choose`] is the decision, pure: among the CPUs the operator allowed (`--cpus`, all online
//! CPUs by default), take the node of the NIC when one reports its node, else the node with the
//! most allowed CPUs (the lowest-numbered on a tie). [`resolve`] reads the host and applies it.
//! Memory is then first touched on the owning core because each shard builds its state inside its
//! own pinned executor (`crate::server`), and Linux's default policy allocates on the local node.

use super::host;
use crate::config::{format_cpu_list, Config, CpuList, NumaMode};

/// The node picked and its CPUs (within the allowed ones), with why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NumaChoice {
    pub node: usize,
    pub cpus: Vec<usize>,
    pub reason: String,
}

/// Picks one node. `nodes` are `(node, cpus)`; `allowed` the CPUs shards may use; `nic` the node
/// of the network interface, with its name, when the host reports one.
pub fn choose(
    nodes: &[(usize, Vec<usize>)],
    allowed: &[usize],
    nic: Option<(&str, usize)>,
) -> Option<NumaChoice> {
    let usable: Vec<(usize, Vec<usize>)> = nodes
        .iter()
        .map(|(node, cpus)| {
            let cpus: Vec<usize> = cpus
                .iter()
                .copied()
                .filter(|c| allowed.contains(c))
                .collect();
            (*node, cpus)
        })
        .filter(|(_, cpus)| !cpus.is_empty())
        .collect();
    if let Some((name, nic_node)) = nic {
        if let Some((node, cpus)) = usable.iter().find(|(node, _)| *node == nic_node) {
            return Some(NumaChoice {
                node: *node,
                cpus: cpus.clone(),
                reason: format!("the node of network interface {name}"),
            });
        }
    }
    let (node, cpus) = usable
        .iter()
        .max_by(|(na, a), (nb, b)| a.len().cmp(&b.len()).then(nb.cmp(na)))?;
    let reason = if usable.len() == 1 {
        "the only node with allowed CPUs".to_owned()
    } else {
        "the node with the most allowed CPUs".to_owned()
    };
    Some(NumaChoice {
        node: *node,
        cpus: cpus.clone(),
        reason,
    })
}

/// Reads the host's nodes and the NIC's node and chooses among `allowed`.
pub fn resolve(allowed: &[usize]) -> Result<NumaChoice, String> {
    let nodes = host::numa_nodes();
    if nodes.is_empty() {
        return Err("no NUMA node found under /sys/devices/system/node".into());
    }
    let nic = host::nic_numa_node();
    choose(
        &nodes,
        allowed,
        nic.as_ref().map(|(n, node)| (n.as_str(), *node)),
    )
    .ok_or_else(|| {
        format!(
            "no NUMA node has any of the allowed CPUs {}",
            format_cpu_list(allowed)
        )
    })
}

/// Applies `server.numa = "auto"` to `config`: narrows `server.cpus` to one node's CPUs and logs
/// the choice. Does nothing for `off`.
pub fn apply(config: &mut Config) -> anyhow::Result<()> {
    if config.server.numa != NumaMode::Auto {
        return Ok(());
    }
    let choice = resolve(config.server.cpus.cpus())
        .map_err(|e| anyhow::anyhow!("server.numa = \"auto\": {e}; use --numa off or --cpus"))?;
    let text = format_cpu_list(&choice.cpus);
    let cpus = CpuList::parse(&text)
        .map_err(|e| anyhow::anyhow!("server.numa = \"auto\" chose CPUs {text}: {e}"))?;
    tracing::info!(
        node = choice.node,
        cpus = %text,
        reason = %choice.reason,
        "numa auto: shards placed on the CPUs of one NUMA node"
    );
    config.server.cpus = cpus;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn two_nodes() -> Vec<(usize, Vec<usize>)> {
        vec![(0, vec![0, 1, 2, 3]), (1, vec![4, 5, 6, 7])]
    }

    #[test]
    fn picks_the_nics_node_when_it_has_allowed_cpus() {
        let c = choose(&two_nodes(), &[0, 1, 2, 3, 4, 5, 6, 7], Some(("eth0", 1))).unwrap();
        assert_eq!((c.node, c.cpus), (1, vec![4, 5, 6, 7]));
        assert!(c.reason.contains("eth0"));
    }

    #[test]
    fn otherwise_picks_the_node_with_most_allowed_cpus_lowest_on_tie() {
        let c = choose(&two_nodes(), &[3, 4, 5], Some(("eth0", 7))).unwrap();
        assert_eq!((c.node, c.cpus), (1, vec![4, 5]));
        let tie = choose(&two_nodes(), &[0, 1, 4, 5], None).unwrap();
        assert_eq!(tie.node, 0);
    }

    #[test]
    fn keeps_only_allowed_cpus_and_fails_without_any() {
        let c = choose(&[(0, vec![0, 1])], &[1], None).unwrap();
        assert_eq!(c.cpus, vec![1]);
        assert_eq!(choose(&two_nodes(), &[9], None), None);
    }
}
