//! `learner launch --nproc-per-node N -- train --config FILE [...]`: starts N ranks of the learner
//! on this machine, as torchrun does, and stops all of them when one fails.
//!
//! - MPI backend (the default on CPU): through Open MPI's `mpirun`, which starts the ranks, tags
//!   their output with the rank, and aborts the job naming the rank that failed.
//! - NCCL backend: the ranks are started here with torchrun's environment (`RANK`, `WORLD_SIZE`,
//!   `LOCAL_RANK`, `LOCAL_WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT`); when one exits with an error
//!   the others are killed and the failing rank is named.

use std::process::{Child, Command, ExitStatus};
use std::time::Duration;

use anyhow::{Context, bail};

use crate::config::DistBackend;

/// What `learner launch` was asked for.
#[derive(Debug, Clone)]
pub struct LaunchSpec {
    pub nproc: usize,
    pub backend: DistBackend,
    pub master_port: Option<u16>,
    /// The learner arguments after `--` (`train --config FILE ...`).
    pub args: Vec<String>,
    /// The cluster token file, handed to every rank as `COTRAIN_CLUSTER_TOKEN_FILE`.
    pub token_file: Option<std::path::PathBuf>,
    /// Tests only: NCCL ranks sharing one GPU (see [`one_gpu_test_env`]).
    pub nccl_one_gpu_test: bool,
    /// `--network-interface IF`: the one interface the ranks talk over (Open MPI's TCP transports,
    /// NCCL's sockets). Unset: Open MPI leaves out the bridges present (see [`bridges`]).
    pub network_interface: Option<String>,
    /// The learner's global flags given before `launch` (`--insecure`, `--tls-cert F`, ...), which
    /// every rank gets too: rank 0 serves the control plane they are about.
    pub global_flags: Vec<String>,
}

impl LaunchSpec {
    /// What every rank runs: `train`, the global flags given to `launch`, then the rest.
    pub fn rank_args(&self) -> Vec<String> {
        let mut args = self.args.clone();
        let at = args.len().min(1);
        args.splice(at..at, self.global_flags.iter().cloned());
        args
    }
}

/// The network bridges on this machine (`/sys/class/net/*/bridge`, and names Docker, libvirt and
/// CNI give theirs): Open MPI's TCP transports try every interface, and a rank that reaches for a
/// peer through a bridge such as `docker0` waits for ever.
pub fn bridges() -> Vec<String> {
    let Ok(entries) = std::fs::read_dir("/sys/class/net") else {
        return Vec::new();
    };
    let mut out: Vec<String> = entries
        .filter_map(|e| e.ok())
        .filter(|e| {
            let name = e.file_name().to_string_lossy().into_owned();
            e.path().join("bridge").is_dir()
                || ["docker", "virbr", "cni", "br-"]
                    .iter()
                    .any(|p| name.starts_with(p))
        })
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    out.sort();
    out
}

/// The Open MPI parameters that choose the ranks' network: the named interface only, or Open MPI's
/// own exclusions (loopback for the TCP transport) plus the bridges present.
pub fn mpi_network_args(interface: Option<&str>, bridges: &[String]) -> Vec<String> {
    let mut args = Vec::new();
    let mut mca = |k: &str, v: String| args.extend(["--mca".to_string(), k.to_string(), v]);
    match interface {
        Some(i) => {
            mca("btl_tcp_if_include", i.to_string());
            mca("oob_tcp_if_include", i.to_string());
        }
        None if !bridges.is_empty() => {
            mca(
                "btl_tcp_if_exclude",
                format!("127.0.0.1/8,sppp,{}", bridges.join(",")),
            );
            mca("oob_tcp_if_exclude", bridges.join(","));
        }
        None => {}
    }
    args
}

/// The environment that lets NCCL ranks share one GPU, for tests on a one-GPU machine: NCCL
/// refuses two ranks of one host on one device, so each rank claims a host of its own
/// (`NCCL_HOSTID`) and the ranks talk over sockets on loopback (no P2P or shared-memory transport,
/// which would find the same device behind both). Variables the user set are kept.
pub fn one_gpu_test_env(rank: usize) -> Vec<(&'static str, String)> {
    let mut env = vec![("NCCL_HOSTID", format!("cotrain-one-gpu-test-rank{rank}"))];
    for (key, value) in [
        ("NCCL_SOCKET_IFNAME", "lo"),
        ("NCCL_IB_DISABLE", "1"),
        ("NCCL_P2P_DISABLE", "1"),
        ("NCCL_SHM_DISABLE", "1"),
    ] {
        if std::env::var_os(key).is_none() {
            env.push((key, value.to_string()));
        }
    }
    env
}

/// Runs the job to its end; `Ok` when every rank succeeded.
pub fn launch(spec: &LaunchSpec) -> anyhow::Result<()> {
    if spec.nproc == 0 {
        bail!("--nproc-per-node must be at least 1");
    }
    if spec.args.first().map(String::as_str) != Some("train") {
        bail!(
            "learner launch runs `train`: give `learner launch --nproc-per-node N -- train --config FILE [...]`"
        );
    }
    let exe = std::env::current_exe().context("locating the learner binary")?;
    let backend = match spec.backend {
        DistBackend::Auto if cotrain_model::cuda::is_available() => DistBackend::Nccl,
        DistBackend::Auto => DistBackend::Mpi,
        b => b,
    };
    match backend {
        DistBackend::Mpi => launch_mpi(spec, &exe),
        _ => launch_torchrun_style(spec, &exe),
    }
}

/// `mpirun -np N ... learner train ...`.
pub fn mpirun_command(spec: &LaunchSpec, exe: &std::path::Path, as_root: bool) -> Command {
    let mut cmd = Command::new("mpirun");
    cmd.arg("-np").arg(spec.nproc.to_string());
    // More ranks than cores is allowed (a 2-core machine running 2 ranks and their services), each
    // rank's threads are not pinned to one core, and output lines carry their rank.
    cmd.args(["--oversubscribe", "--bind-to", "none", "--tag-output"]);
    // Open MPI refuses to run as root unless told; containers and CI machines often are root.
    if as_root {
        cmd.arg("--allow-run-as-root");
    }
    // Shared-memory transport without the ptrace-based single copy, which containers often forbid.
    cmd.args([
        "--mca",
        "btl",
        "self,vader",
        "--mca",
        "btl_vader_single_copy_mechanism",
        "none",
    ]);
    cmd.args(mpi_network_args(
        spec.network_interface.as_deref(),
        &bridges(),
    ));
    if let Some(file) = &spec.token_file {
        cmd.env(cotrain_proto::auth::TOKEN_FILE_ENV, file)
            .args(["-x", cotrain_proto::auth::TOKEN_FILE_ENV]);
    }
    cmd.arg(exe).args(spec.rank_args());
    cmd
}

fn is_root() -> bool {
    // The effective uid from /proc, without a libc dependency.
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("Uid:"))
                .and_then(|l| l.split_whitespace().nth(2))
                .map(|u| u == "0")
        })
        .unwrap_or(false)
}

fn launch_mpi(spec: &LaunchSpec, exe: &std::path::Path) -> anyhow::Result<()> {
    let mut cmd = mpirun_command(spec, exe, is_root());
    let status = cmd.status().map_err(|e| {
        anyhow::anyhow!("cannot start `mpirun` ({e}): the MPI backend needs Open MPI (Debian: apt-get install openmpi-bin; `make setup` installs it)")
    })?;
    if !status.success() {
        bail!(
            "the learner job failed ({status}); mpirun's report above names the rank that failed"
        );
    }
    Ok(())
}

fn free_port() -> anyhow::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

fn launch_torchrun_style(spec: &LaunchSpec, exe: &std::path::Path) -> anyhow::Result<()> {
    let port = match spec.master_port {
        Some(p) => p,
        None => free_port()?,
    };
    if spec.nccl_one_gpu_test {
        tracing::warn!(
            "--nccl-one-gpu-test: {} NCCL ranks share one GPU over loopback sockets (tests only)",
            spec.nproc
        );
    }
    let mut children = spawn_ranks(spec.nproc, |rank| {
        let mut one_gpu = if spec.nccl_one_gpu_test {
            one_gpu_test_env(rank)
        } else {
            Vec::new()
        };
        if let Some(i) = &spec.network_interface {
            one_gpu.retain(|(k, _)| *k != "NCCL_SOCKET_IFNAME");
            one_gpu.push(("NCCL_SOCKET_IFNAME", i.clone()));
        }
        Command::new(exe)
            .envs(one_gpu)
            .args(spec.rank_args())
            .env("RANK", rank.to_string())
            .env("WORLD_SIZE", spec.nproc.to_string())
            .env("LOCAL_RANK", rank.to_string())
            .env("LOCAL_WORLD_SIZE", spec.nproc.to_string())
            .env("MASTER_ADDR", "127.0.0.1")
            .env("MASTER_PORT", port.to_string())
            .envs(
                spec.token_file
                    .iter()
                    .map(|f| (cotrain_proto::auth::TOKEN_FILE_ENV, f)),
            )
            .spawn()
    })?;
    let failed = supervise(&mut children)?;
    match failed {
        None => Ok(()),
        Some((rank, status)) => bail!(
            "rank {rank} failed ({status}); the other ranks were stopped. Its error is in the output above."
        ),
    }
}

/// Starts ranks `0..nproc` with `spawn`. When one cannot start, the ranks already started are
/// killed and reaped before the error returns: they would otherwise wait at the rendezvous for a
/// rank that never comes, outliving the launcher.
fn spawn_ranks(
    nproc: usize,
    mut spawn: impl FnMut(usize) -> std::io::Result<Child>,
) -> anyhow::Result<Vec<Child>> {
    let mut children: Vec<Child> = Vec::with_capacity(nproc);
    for rank in 0..nproc {
        match spawn(rank) {
            Ok(child) => children.push(child),
            Err(e) => {
                for child in &mut children {
                    let _ = child.kill();
                    let _ = child.wait();
                }
                return Err(anyhow::Error::new(e).context(format!(
                    "starting rank {rank} (the {} ranks already started were stopped)",
                    children.len()
                )));
            }
        }
    }
    Ok(children)
}

/// Waits for every child; on the first failure kills the rest and returns (rank, status).
fn supervise(children: &mut [Child]) -> anyhow::Result<Option<(usize, ExitStatus)>> {
    let mut done = vec![false; children.len()];
    while done.iter().any(|d| !d) {
        for (rank, child) in children.iter_mut().enumerate() {
            if done[rank] {
                continue;
            }
            if let Some(status) = child.try_wait()? {
                done[rank] = true;
                if !status.success() {
                    for (r, other) in children.iter_mut().enumerate() {
                        if r != rank {
                            let _ = other.kill();
                            let _ = other.wait();
                        }
                    }
                    return Ok(Some((rank, status)));
                }
            }
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    Ok(None)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_ranks_network_is_the_named_interface_or_everything_but_the_bridges() {
        let bridges = vec!["docker0".to_string(), "virbr0".to_string()];
        let named = mpi_network_args(Some("eth1"), &bridges).join(" ");
        assert_eq!(
            named,
            "--mca btl_tcp_if_include eth1 --mca oob_tcp_if_include eth1"
        );
        let default = mpi_network_args(None, &bridges).join(" ");
        assert_eq!(
            default,
            "--mca btl_tcp_if_exclude 127.0.0.1/8,sppp,docker0,virbr0 --mca oob_tcp_if_exclude docker0,virbr0"
        );
        assert!(
            mpi_network_args(None, &[]).is_empty(),
            "no bridge: Open MPI's own defaults"
        );
        let spec = LaunchSpec {
            nproc: 2,
            backend: DistBackend::Mpi,
            master_port: None,
            args: vec!["train".into(), "--config".into(), "c.yaml".into()],
            token_file: None,
            nccl_one_gpu_test: false,
            network_interface: Some("eth1".into()),
            global_flags: vec!["--insecure".into()],
        };
        let cmd = mpirun_command(&spec, std::path::Path::new("/bin/learner"), false);
        let args: Vec<String> = cmd
            .get_args()
            .map(|a| a.to_string_lossy().into_owned())
            .collect();
        assert!(
            args.join(" ")
                .contains("--mca btl_tcp_if_include eth1 --mca oob_tcp_if_include eth1"),
            "{args:?}"
        );
        // `learner --insecure launch ... -- train ...`: every rank gets --insecure too.
        assert!(
            args.join(" ")
                .ends_with("/bin/learner train --insecure --config c.yaml"),
            "{args:?}"
        );
    }

    /// Regression: a rank that cannot start (here a missing program) left the ranks started before
    /// it running, unwaited, after `learner launch` returned the error.
    #[test]
    fn a_rank_that_cannot_start_stops_the_ranks_already_started() {
        let mut started = Vec::new();
        let err = spawn_ranks(3, |rank| {
            if rank == 2 {
                return Command::new("/nonexistent/cotrain-learner").spawn();
            }
            let child = Command::new("sleep").arg("600").spawn()?;
            started.push(child.id());
            Ok(child)
        })
        .unwrap_err();
        let message = format!("{err:#}");
        assert!(
            message.contains("starting rank 2")
                && message.contains("2 ranks already started were stopped"),
            "{message}"
        );
        assert_eq!(started.len(), 2);
        for pid in started {
            // Killed and reaped: no process, not even a zombie, is left under that id.
            assert!(
                !std::path::Path::new(&format!("/proc/{pid}")).exists(),
                "rank with pid {pid} outlived the failed launch"
            );
        }
    }
}
