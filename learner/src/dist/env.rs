//! Which rank this process is, read from the launcher's environment: Open MPI's `mpirun`
//! (`OMPI_COMM_WORLD_*`), a PMIx launcher such as `srun --mpi=pmix` (`PMIX_RANK` with Slurm's
//! `SLURM_*`), torchrun (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR`, `MASTER_PORT`) or Slurm
//! alone (`SLURM_PROCID`, `SLURM_NTASKS`, `SLURM_LOCALID`, the first host of `SLURM_JOB_NODELIST`).
//! Nothing set: one rank.

use std::collections::HashMap;

/// Who started the ranks, which decides which backends can join them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Launcher {
    /// No launcher: a single process.
    None,
    /// An MPI launcher (`mpirun`, `learner launch`, `srun --mpi=pmix`): MPI_Init finds its peers.
    Mpi,
    /// torchrun or `learner launch --backend nccl`: peers meet at `MASTER_ADDR:MASTER_PORT`.
    Torchrun,
    /// Slurm's `srun` without an MPI plugin: peers meet at the first node of the allocation.
    Slurm,
}

/// This process's place in the job.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RankEnv {
    pub rank: usize,
    pub world: usize,
    /// The rank among the ranks on this node (the GPU it uses).
    pub local_rank: usize,
    /// Where the ranks meet (torchrun and Slurm; MPI launchers need no address).
    pub master: Option<(String, u16)>,
    pub launcher: Launcher,
}

/// The port ranks meet on when Slurm gives no `MASTER_PORT` (torchrun's default).
pub const DEFAULT_MASTER_PORT: u16 = 29500;

impl RankEnv {
    /// One rank, no launcher.
    pub fn single() -> Self {
        Self {
            rank: 0,
            world: 1,
            local_rank: 0,
            master: None,
            launcher: Launcher::None,
        }
    }

    /// From this process's environment.
    pub fn from_env() -> Result<Self, String> {
        Self::from_vars(&std::env::vars().collect())
    }

    /// From the given variables (see the module docs for the order in which launchers are tried).
    pub fn from_vars(vars: &HashMap<String, String>) -> Result<Self, String> {
        let num = |key: &str| -> Result<Option<usize>, String> {
            vars.get(key)
                .map(|v| {
                    v.trim()
                        .parse::<usize>()
                        .map_err(|_| format!("{key}={v:?} is not a number"))
                })
                .transpose()
        };
        let master_port = || -> Result<u16, String> {
            match vars.get("MASTER_PORT") {
                Some(p) => p
                    .trim()
                    .parse()
                    .map_err(|_| format!("MASTER_PORT={p:?} is not a port")),
                None => Ok(DEFAULT_MASTER_PORT),
            }
        };
        let env = if let (Some(rank), Some(world)) =
            (num("OMPI_COMM_WORLD_RANK")?, num("OMPI_COMM_WORLD_SIZE")?)
        {
            let local_rank = num("OMPI_COMM_WORLD_LOCAL_RANK")?.unwrap_or(0);
            Self {
                rank,
                world,
                local_rank,
                master: None,
                launcher: Launcher::Mpi,
            }
        } else if let (Some(rank), Some(world)) = (
            num("PMIX_RANK")?,
            num("SLURM_NTASKS")?.or(num("PMIX_SIZE")?),
        ) {
            let local_rank = num("SLURM_LOCALID")?.unwrap_or(0);
            Self {
                rank,
                world,
                local_rank,
                master: None,
                launcher: Launcher::Mpi,
            }
        } else if let (Some(rank), Some(world)) = (num("RANK")?, num("WORLD_SIZE")?) {
            let local_rank = num("LOCAL_RANK")?.unwrap_or(0);
            let addr = vars
                .get("MASTER_ADDR")
                .cloned()
                .unwrap_or_else(|| "127.0.0.1".into());
            Self {
                rank,
                world,
                local_rank,
                master: Some((addr, master_port()?)),
                launcher: Launcher::Torchrun,
            }
        } else if let (Some(rank), Some(world)) = (num("SLURM_PROCID")?, num("SLURM_NTASKS")?) {
            let local_rank = num("SLURM_LOCALID")?.unwrap_or(0);
            let addr = match vars.get("MASTER_ADDR") {
                Some(a) => a.clone(),
                None => {
                    let list = vars
                        .get("SLURM_JOB_NODELIST")
                        .or(vars.get("SLURM_NODELIST"))
                        .ok_or("SLURM_PROCID is set but SLURM_JOB_NODELIST is not")?;
                    first_host(list)?
                }
            };
            Self {
                rank,
                world,
                local_rank,
                master: Some((addr, master_port()?)),
                launcher: Launcher::Slurm,
            }
        } else {
            return Ok(Self::single());
        };
        if env.world == 0 || env.rank >= env.world {
            return Err(format!(
                "rank {} of a world of {} (from the {:?} environment)",
                env.rank, env.world, env.launcher
            ));
        }
        Ok(env)
    }
}

/// The first host of a Slurm node list: `n[1-3,7],gpu5` → `n1`, `node07` → `node07`,
/// `rack[02-04]-gpu` → `rack02-gpu`.
pub fn first_host(list: &str) -> Result<String, String> {
    let list = list.trim();
    let bad = || format!("cannot read the Slurm node list {list:?}");
    // The first entry ends at the first comma outside brackets.
    let mut depth = 0;
    let end = list
        .char_indices()
        .find(|&(_, c)| {
            match c {
                '[' => depth += 1,
                ']' => depth -= 1,
                _ => {}
            }
            c == ',' && depth == 0
        })
        .map(|(i, _)| i)
        .unwrap_or(list.len());
    let first = &list[..end];
    if first.is_empty() {
        return Err(bad());
    }
    let Some(open) = first.find('[') else {
        return Ok(first.to_string());
    };
    let close = first[open..].find(']').map(|c| open + c).ok_or_else(bad)?;
    let range = &first[open + 1..close];
    let lowest = range
        .split(',')
        .next()
        .and_then(|r| r.split('-').next())
        .filter(|s| !s.is_empty())
        .ok_or_else(bad)?;
    Ok(format!(
        "{}{}{}",
        &first[..open],
        lowest,
        &first[close + 1..]
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vars(pairs: &[(&str, &str)]) -> HashMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn slurm_node_lists_give_their_first_host() {
        assert_eq!(first_host("n[1-3,7],gpu5").unwrap(), "n1");
        assert_eq!(first_host("node07").unwrap(), "node07");
        assert_eq!(first_host("rack[02-04]-gpu,x").unwrap(), "rack02-gpu");
        assert_eq!(first_host("a,b").unwrap(), "a");
        assert!(first_host("").is_err());
        assert!(first_host("n[1-3").is_err());
    }

    #[test]
    fn launchers_are_read_in_order() {
        assert_eq!(RankEnv::from_vars(&vars(&[])).unwrap(), RankEnv::single());
        let torchrun = RankEnv::from_vars(&vars(&[
            ("RANK", "1"),
            ("WORLD_SIZE", "4"),
            ("LOCAL_RANK", "1"),
            ("MASTER_ADDR", "h0"),
            ("MASTER_PORT", "1234"),
        ]))
        .unwrap();
        assert_eq!(
            torchrun,
            RankEnv {
                rank: 1,
                world: 4,
                local_rank: 1,
                master: Some(("h0".into(), 1234)),
                launcher: Launcher::Torchrun
            }
        );
        let slurm = RankEnv::from_vars(&vars(&[
            ("SLURM_PROCID", "3"),
            ("SLURM_NTASKS", "4"),
            ("SLURM_LOCALID", "1"),
            ("SLURM_JOB_NODELIST", "n[4-5]"),
        ]))
        .unwrap();
        assert_eq!(
            slurm,
            RankEnv {
                rank: 3,
                world: 4,
                local_rank: 1,
                master: Some(("n4".into(), DEFAULT_MASTER_PORT)),
                launcher: Launcher::Slurm
            }
        );
        // mpirun inside a Slurm allocation: MPI's own numbering wins.
        let mpi = RankEnv::from_vars(&vars(&[
            ("OMPI_COMM_WORLD_RANK", "0"),
            ("OMPI_COMM_WORLD_SIZE", "2"),
            ("SLURM_PROCID", "0"),
            ("SLURM_NTASKS", "1"),
        ]))
        .unwrap();
        assert_eq!((mpi.rank, mpi.world, mpi.launcher), (0, 2, Launcher::Mpi));
        let pmix = RankEnv::from_vars(&vars(&[
            ("PMIX_RANK", "1"),
            ("SLURM_NTASKS", "2"),
            ("SLURM_PROCID", "1"),
            ("SLURM_LOCALID", "1"),
        ]))
        .unwrap();
        assert_eq!(
            (pmix.rank, pmix.world, pmix.local_rank, pmix.launcher),
            (1, 2, 1, Launcher::Mpi)
        );
    }

    #[test]
    fn inconsistent_environments_are_refused_with_the_variable() {
        assert!(
            RankEnv::from_vars(&vars(&[("RANK", "2"), ("WORLD_SIZE", "2")]))
                .unwrap_err()
                .contains("rank 2 of a world of 2")
        );
        assert!(
            RankEnv::from_vars(&vars(&[("RANK", "x"), ("WORLD_SIZE", "2")]))
                .unwrap_err()
                .contains("RANK=\"x\"")
        );
        assert!(
            RankEnv::from_vars(&vars(&[
                ("RANK", "0"),
                ("WORLD_SIZE", "2"),
                ("MASTER_PORT", "http")
            ]))
            .unwrap_err()
            .contains("MASTER_PORT")
        );
    }
}
