//! Learner ranks: one process per rank, started by a launcher ([`env`](mod@env)), working together through a
//! [`Collective`] on an existing library: MPI (Open MPI, through the `mpi` crate) for CPU tensors,
//! NCCL (through cudarc, the `cuda` feature) for CUDA tensors. `learner launch` ([`launch`]) starts
//! the ranks of one machine.
//!
//! What the trainers do with it ([`crate::trainer`]): every rank holds the same policies (broadcast
//! from rank 0 at start and after a resume), rolls out and trains on its share of each step's items,
//! and all-reduces the gradients (scaled by the global sample count, in [`buckets`]) before the
//! optimiser step, so that every rank takes the same step as one process would on all the items.
//! Rank 0 alone pushes weights to the rollout workers and writes metrics, plots and checkpoints.

pub mod buckets;
pub mod env;
pub mod launch;
#[cfg(feature = "mpi")]
mod mpi_backend;
#[cfg(feature = "cuda")]
mod nccl;
// Plain TCP, built (and tested) without CUDA too; only the NCCL backend calls it.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
mod rendezvous;
pub mod watchdog;

use tch::{Device, Kind, Tensor};

pub use buckets::{DEFAULT_BUCKET_BYTES, all_reduce_grads_bucketed};
pub use env::{Launcher, RankEnv};

use crate::config::DistBackend;

/// A failed collective, or ranks that cannot be joined.
#[derive(Debug, thiserror::Error)]
#[error("learner ranks: {0}")]
pub struct DistError(pub String);

/// The collectives the trainers need. Every rank must call the same operations in the same order
/// (as with MPI and NCCL themselves).
pub trait Collective {
    fn rank(&self) -> usize;
    fn world(&self) -> usize;
    /// `mpi`, `nccl` or `single`.
    fn backend(&self) -> &'static str;
    /// Where the tensors given to this collective must live.
    fn device(&self) -> Device;
    /// Element-wise sum over the ranks, in place (a contiguous f32, f64 or i64 tensor of any length:
    /// the backends split it into calls of at most [`buckets::MAX_COUNT`] elements).
    fn all_reduce_sum(&self, t: &mut Tensor) -> Result<(), DistError>;
    /// Rank `root`'s values into every rank's `t` (same shape and kind everywhere; any length, as
    /// for [`Collective::all_reduce_sum`]).
    fn broadcast(&self, t: &mut Tensor, root: usize) -> Result<(), DistError>;
    /// Every rank's `t` (same shape everywhere), stacked in rank order.
    fn all_gather(&self, t: &Tensor) -> Result<Tensor, DistError>;

    fn is_root(&self) -> bool {
        self.rank() == 0
    }

    /// Rank `root`'s bytes into every rank's `bytes`.
    fn broadcast_bytes(&self, bytes: &mut Vec<u8>, root: usize) -> Result<(), DistError> {
        if self.world() == 1 {
            return Ok(());
        }
        let mut len = Tensor::from_slice(&[bytes.len() as i64]).to_device(self.device());
        self.broadcast(&mut len, root)?;
        let n = len.int64_value(&[0]) as usize;
        let mut data = if self.rank() == root {
            Tensor::from_slice(bytes.as_slice())
        } else {
            Tensor::zeros([n as i64], (Kind::Uint8, Device::Cpu))
        }
        .to_device(self.device());
        self.broadcast(&mut data, root)?;
        *bytes = tensor_bytes(&data.to_device(Device::Cpu));
        Ok(())
    }

    /// Every rank's bytes, in rank order.
    fn all_gather_bytes(&self, mine: &[u8]) -> Result<Vec<Vec<u8>>, DistError> {
        if self.world() == 1 {
            return Ok(vec![mine.to_vec()]);
        }
        let lens = self
            .all_gather(&Tensor::from_slice(&[mine.len() as i64]).to_device(self.device()))?
            .to_device(Device::Cpu);
        let lens: Vec<usize> = (0..self.world())
            .map(|r| lens.int64_value(&[r as i64, 0]) as usize)
            .collect();
        let width = lens.iter().copied().max().unwrap_or(0);
        let mut padded = mine.to_vec();
        padded.resize(width, 0);
        let all = self
            .all_gather(&Tensor::from_slice(&padded).to_device(self.device()))?
            .to_device(Device::Cpu);
        Ok(lens
            .iter()
            .enumerate()
            .map(|(r, &n)| tensor_bytes(&all.get(r as i64).narrow(0, 0, n as i64)))
            .collect())
    }

    /// Waits for every rank.
    fn barrier(&self) -> Result<(), DistError> {
        let mut t = Tensor::zeros([1], (Kind::Float, self.device()));
        self.all_reduce_sum(&mut t)
    }

    /// Rank `root`'s value on every rank.
    fn broadcast_u64(&self, v: u64, root: usize) -> Result<u64, DistError> {
        if self.world() == 1 {
            return Ok(v);
        }
        let mut t = Tensor::from_slice(&[v as i64]).to_device(self.device());
        self.broadcast(&mut t, root)?;
        Ok(t.to_device(Device::Cpu).int64_value(&[0]) as u64)
    }

    /// Sums f64 scalars over the ranks (counts, flags, statistics).
    fn sum_f64(&self, values: &[f64]) -> Result<Vec<f64>, DistError> {
        if self.world() == 1 {
            return Ok(values.to_vec());
        }
        let mut t = Tensor::from_slice(values).to_device(self.device());
        self.all_reduce_sum(&mut t)?;
        Vec::<f64>::try_from(&t.to_device(Device::Cpu)).map_err(|e| DistError(e.to_string()))
    }
}

fn tensor_bytes(t: &Tensor) -> Vec<u8> {
    let t = t.contiguous();
    let mut out = vec![0u8; t.numel()];
    t.copy_data_u8(&mut out, t.numel());
    out
}

/// The one-process "job": every collective is the identity.
pub struct SingleRank;

impl Collective for SingleRank {
    fn rank(&self) -> usize {
        0
    }
    fn world(&self) -> usize {
        1
    }
    fn backend(&self) -> &'static str {
        "single"
    }
    fn device(&self) -> Device {
        Device::Cpu
    }
    fn all_reduce_sum(&self, _t: &mut Tensor) -> Result<(), DistError> {
        Ok(())
    }
    fn broadcast(&self, _t: &mut Tensor, _root: usize) -> Result<(), DistError> {
        Ok(())
    }
    fn all_gather(&self, t: &Tensor) -> Result<Tensor, DistError> {
        Ok(t.unsqueeze(0))
    }
}

/// A handle on a collective that the caller keeps while a trainer owns another: see [`run_ranked`].
pub struct Shared(pub std::rc::Rc<dyn Collective>);

impl Collective for Shared {
    fn rank(&self) -> usize {
        self.0.rank()
    }
    fn world(&self) -> usize {
        self.0.world()
    }
    fn backend(&self) -> &'static str {
        self.0.backend()
    }
    fn device(&self) -> Device {
        self.0.device()
    }
    fn all_reduce_sum(&self, t: &mut Tensor) -> Result<(), DistError> {
        self.0.all_reduce_sum(t)
    }
    fn broadcast(&self, t: &mut Tensor, root: usize) -> Result<(), DistError> {
        self.0.broadcast(t, root)
    }
    fn all_gather(&self, t: &Tensor) -> Result<Tensor, DistError> {
        self.0.all_gather(t)
    }
}

/// Runs `job` (a trainer's whole run) on `dist`, so that a rank that fails on its own stops the
/// job instead of hanging it: leaving MPI (`MPI_Finalize`) waits for every rank, while the others
/// wait in their next collective for this one. A failed rank of several therefore leaves without
/// it (the error goes back to `main`, which prints it and exits non-zero), and the launcher, seeing
/// a rank exit without finalising, stops the others.
pub fn run_ranked<T, E>(
    dist: Box<dyn Collective>,
    job: impl FnOnce(Box<dyn Collective>) -> Result<T, E>,
) -> Result<T, E> {
    let dist: std::rc::Rc<dyn Collective> = std::rc::Rc::from(dist);
    let result = job(Box::new(Shared(dist.clone())));
    if result.is_err() && dist.world() > 1 {
        tracing::error!(
            rank = dist.rank(),
            world = dist.world(),
            "this rank failed: it leaves the job without finalising MPI, so that the launcher stops the other ranks"
        );
        std::mem::forget(dist);
    }
    result
}

/// Joins the job this process was launched into (one rank when no launcher is in the environment).
/// `device` is where the learner's tensors live; `backend` the config's `learner.backend`.
pub fn init(backend: DistBackend, device: Device) -> Result<Box<dyn Collective>, DistError> {
    init_with_timeout(backend, device, None)
}

/// As [`init`], with every collective of several ranks bounded by `timeout`
/// (`learner.collective_timeout_secs`; see [`watchdog`]).
pub fn init_with_timeout(
    backend: DistBackend,
    device: Device,
    timeout: Option<std::time::Duration>,
) -> Result<Box<dyn Collective>, DistError> {
    let inner = init_backend(backend, device)?;
    Ok(match timeout {
        Some(t) if inner.world() > 1 => Box::new(watchdog::Watched::new(inner, t)),
        _ => inner,
    })
}

fn init_backend(backend: DistBackend, device: Device) -> Result<Box<dyn Collective>, DistError> {
    let env = RankEnv::from_env().map_err(DistError)?;
    if env.world == 1 && env.launcher != Launcher::Mpi {
        return Ok(Box::new(SingleRank));
    }
    let backend = match backend {
        DistBackend::Auto if device.is_cuda() => DistBackend::Nccl,
        DistBackend::Auto => DistBackend::Mpi,
        b => b,
    };
    match backend {
        DistBackend::Mpi => init_mpi(&env),
        DistBackend::Nccl => init_nccl(&env, device),
        DistBackend::Auto => unreachable!("resolved above"),
    }
}

#[cfg(feature = "mpi")]
fn init_mpi(env: &RankEnv) -> Result<Box<dyn Collective>, DistError> {
    if env.launcher != Launcher::Mpi {
        return Err(DistError(format!(
            "{} ranks from the {:?} environment, but learner.backend mpi needs ranks started by an MPI launcher: \
             `learner launch --nproc-per-node N -- train ...`, `mpirun -np N learner train ...`, or `srun --mpi=pmix learner train ...` \
             (torchrun-style environments work with learner.backend: nccl)",
            env.world, env.launcher
        )));
    }
    Ok(Box::new(mpi_backend::MpiCollective::init(env)?))
}

#[cfg(not(feature = "mpi"))]
fn init_mpi(env: &RankEnv) -> Result<Box<dyn Collective>, DistError> {
    Err(DistError(format!(
        "{} ranks need the MPI backend, and this learner was built without the `mpi` feature",
        env.world
    )))
}

#[cfg(feature = "cuda")]
fn init_nccl(env: &RankEnv, device: Device) -> Result<Box<dyn Collective>, DistError> {
    Ok(Box::new(nccl::NcclCollective::init(env, device)?))
}

#[cfg(not(feature = "cuda"))]
fn init_nccl(env: &RankEnv, _device: Device) -> Result<Box<dyn Collective>, DistError> {
    Err(DistError(format!(
        "{} ranks with learner.backend nccl, but this learner was built without the `cuda` feature (cargo build --features cuda)",
        env.world
    )))
}

/// Sums the gradients of `params` over the ranks, in buckets of [`DEFAULT_BUCKET_BYTES`] (see
/// [`buckets`]). A parameter with a gradient on some rank gets the sum on every rank (zeros where a
/// rank has none); one without a gradient on any rank keeps none, as on one rank, so AdamW leaves it
/// alone (no weight decay): a critic's unused LM head, say.
pub fn all_reduce_grads(coll: &dyn Collective, params: &[Tensor]) -> Result<(), DistError> {
    if coll.world() == 1 {
        return Ok(());
    }
    let has: Vec<f64> = params
        .iter()
        .map(|p| p.grad().defined() as u8 as f64)
        .collect();
    let any = coll.sum_f64(&has)?;
    let used: Vec<Tensor> = params
        .iter()
        .zip(&any)
        .filter(|(_, n)| **n > 0.0)
        .map(|(p, _)| p.shallow_clone())
        .collect();
    all_reduce_grads_bucketed(coll, &used, DEFAULT_BUCKET_BYTES)
}

/// Copies rank `root`'s values of `tensors` into every rank's (weights, optimiser moments).
pub fn broadcast_tensors(
    coll: &dyn Collective,
    tensors: &[Tensor],
    root: usize,
) -> Result<(), DistError> {
    if coll.world() == 1 {
        return Ok(());
    }
    tch::no_grad(|| {
        for t in tensors {
            let mut buf = t
                .detach()
                .to_kind(Kind::Float)
                .to_device(coll.device())
                .contiguous();
            coll.broadcast(&mut buf, root)?;
            t.detach()
                .copy_(&buf.to_device(t.device()).to_kind(t.kind()));
        }
        Ok(())
    })
}

/// Checks that every rank holds the same `tensors` (a sum and a sum of squares compared over the
/// ranks); an error names the ranks that differ from rank 0.
pub fn check_same(coll: &dyn Collective, what: &str, tensors: &[Tensor]) -> Result<(), DistError> {
    if coll.world() == 1 {
        return Ok(());
    }
    let (mut sum, mut sq) = (0f64, 0f64);
    for t in tensors {
        let d = t.detach().to_kind(Kind::Double);
        sum += d.sum(Kind::Double).double_value(&[]);
        sq += (&d * &d).sum(Kind::Double).double_value(&[]);
    }
    let all = coll
        .all_gather(&Tensor::from_slice(&[sum, sq]).to_device(coll.device()))?
        .to_device(Device::Cpu);
    let at = |r: usize, k: usize| all.double_value(&[r as i64, k as i64]);
    let close = |a: f64, b: f64| (a - b).abs() <= 1e-6 * a.abs().max(b.abs()).max(1e-12);
    let differ: Vec<String> = (1..coll.world())
        .filter(|&r| !(close(at(r, 0), at(0, 0)) && close(at(r, 1), at(0, 1))))
        .map(|r| {
            format!(
                "rank {r} (sum {:.9e}, sum of squares {:.9e})",
                at(r, 0),
                at(r, 1)
            )
        })
        .collect();
    if differ.is_empty() {
        Ok(())
    } else {
        Err(DistError(format!(
            "{what} diverged between ranks: rank 0 has sum {:.9e}, sum of squares {:.9e}; {}",
            at(0, 0),
            at(0, 1),
            differ.join("; ")
        )))
    }
}

// Here rather than beside `TrainError`: errors are the lowest layer and import nothing above them.
impl From<DistError> for crate::error::TrainError {
    fn from(e: DistError) -> Self {
        crate::error::TrainError::Dist(e.to_string())
    }
}

/// The run directory every rank writes to: rank 0's (its name may carry a time stamp).
pub fn shared_run_dir(
    dist: &dyn Collective,
    run_dir: std::path::PathBuf,
) -> Result<std::path::PathBuf, crate::error::TrainError> {
    if dist.world() == 1 {
        return Ok(run_dir);
    }
    let mut name = run_dir.to_string_lossy().into_owned().into_bytes();
    dist.broadcast_bytes(&mut name, 0)?;
    let run_dir = std::path::PathBuf::from(String::from_utf8_lossy(&name).into_owned());
    tracing::info!(rank = dist.rank(), world = dist.world(), backend = dist.backend(), run_dir = %run_dir.display(), "learner rank started");
    Ok(run_dir)
}

/// The rows of a step that rank `rank` of `world` rolls out and trains on: every world-th.
pub fn rank_share(rows: &[usize], rank: usize, world: usize) -> Vec<usize> {
    rows.iter()
        .copied()
        .skip(rank)
        .step_by(world.max(1))
        .collect()
}
