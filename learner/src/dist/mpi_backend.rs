//! The MPI backend: Open MPI (or any MPI the `mpi` crate links) on CPU tensors. MPI's own launcher
//! (`mpirun`, `srun --mpi=pmix`) gives each process its rank; a failed peer makes MPI abort the job
//! (its default error handler), which is what stops every rank when one dies. MPI's counts are C
//! `int`s: tensors are sent in calls of at most [`MAX_COUNT`] elements.

use mpi::collective::SystemOperation;
use mpi::environment::Universe;
use mpi::topology::SimpleCommunicator;
use mpi::traits::*;
use tch::{Device, Kind, Tensor};

use super::buckets::{MAX_COUNT, chunks};
use super::{Collective, DistError, RankEnv};

/// The most one all-reduce call sends: MPI sums into a buffer other than the one it sends
/// (`MPI_IN_PLACE` is not in the `mpi` crate, and its value differs between Open MPI and MPICH), so
/// each call sends a copy, which this bounds whatever the tensor's size.
const SEND_COPY_BYTES: usize = 64 << 20;

pub struct MpiCollective {
    world: SimpleCommunicator,
    // Finalises MPI when dropped: declared after `world` so that it is dropped last.
    _universe: Universe,
}

impl MpiCollective {
    pub fn init(env: &RankEnv) -> Result<Self, DistError> {
        let universe = mpi::initialize()
            .ok_or_else(|| DistError("MPI was already initialised in this process".into()))?;
        let world = universe.world();
        let (rank, size) = (world.rank() as usize, world.size() as usize);
        if (rank, size) != (env.rank, env.world) {
            return Err(DistError(format!(
                "MPI says rank {rank} of {size}, the launcher's environment rank {} of {}: was this process started by another MPI's launcher?",
                env.rank, env.world
            )));
        }
        Ok(Self {
            world,
            _universe: universe,
        })
    }
}

fn check_cpu(t: &Tensor) -> Result<(), DistError> {
    if t.device() != Device::Cpu || !t.is_contiguous() {
        return Err(DistError(format!(
            "the MPI backend reduces contiguous CPU tensors, got one on {:?}",
            t.device()
        )));
    }
    Ok(())
}

/// The tensor's storage as a mutable slice of `T` (the caller checked kind, device and contiguity).
fn slice_mut<T>(t: &mut Tensor) -> &mut [T] {
    // SAFETY: `t` is a contiguous CPU tensor of `numel` elements of `T` (checked by the callers),
    // borrowed mutably for the slice's lifetime.
    unsafe { std::slice::from_raw_parts_mut(t.data_ptr() as *mut T, t.numel()) }
}

impl MpiCollective {
    /// Sums `buf` over the ranks in calls of at most [`SEND_COPY_BYTES`], through one send copy of
    /// that size.
    fn all_reduce_slice<T: Equivalence + Copy>(&self, buf: &mut [T]) {
        let max = (SEND_COPY_BYTES / std::mem::size_of::<T>()).min(MAX_COUNT);
        let mut send = Vec::with_capacity(max.min(buf.len()));
        for r in chunks(buf.len(), max) {
            send.clear();
            send.extend_from_slice(&buf[r.clone()]);
            self.world
                .all_reduce_into(&send[..], &mut buf[r], SystemOperation::sum());
        }
    }

    /// Rank `root`'s `buf` into every rank's, in calls of at most [`MAX_COUNT`] elements.
    fn broadcast_slice<T: Equivalence>(&self, buf: &mut [T], root: usize) {
        let root = self.world.process_at_rank(root as i32);
        for r in chunks(buf.len(), MAX_COUNT) {
            root.broadcast_into(&mut buf[r]);
        }
    }
}

impl Collective for MpiCollective {
    fn rank(&self) -> usize {
        self.world.rank() as usize
    }
    fn world(&self) -> usize {
        self.world.size() as usize
    }
    fn backend(&self) -> &'static str {
        "mpi"
    }
    fn device(&self) -> Device {
        Device::Cpu
    }

    fn all_reduce_sum(&self, t: &mut Tensor) -> Result<(), DistError> {
        check_cpu(t)?;
        match t.kind() {
            Kind::Float => self.all_reduce_slice(slice_mut::<f32>(t)),
            Kind::Double => self.all_reduce_slice(slice_mut::<f64>(t)),
            Kind::Int64 => self.all_reduce_slice(slice_mut::<i64>(t)),
            k => {
                return Err(DistError(format!(
                    "the MPI backend sums f32, f64 and i64 tensors, got {k:?}"
                )));
            }
        }
        Ok(())
    }

    fn broadcast(&self, t: &mut Tensor, root: usize) -> Result<(), DistError> {
        check_cpu(t)?;
        match t.kind() {
            Kind::Float => self.broadcast_slice(slice_mut::<f32>(t), root),
            Kind::Double => self.broadcast_slice(slice_mut::<f64>(t), root),
            Kind::Int64 => self.broadcast_slice(slice_mut::<i64>(t), root),
            Kind::Uint8 => self.broadcast_slice(slice_mut::<u8>(t), root),
            k => {
                return Err(DistError(format!(
                    "the MPI backend broadcasts f32, f64, i64 and u8 tensors, got {k:?}"
                )));
            }
        }
        Ok(())
    }

    fn all_gather(&self, t: &Tensor) -> Result<Tensor, DistError> {
        let mut t = t.contiguous();
        check_cpu(&t)?;
        let mut size = t.size();
        size.insert(0, self.world() as i64);
        // The `mpi` crate panics on a receive count beyond an MPI `int`; gathers carry metadata.
        if t.numel() * self.world() > MAX_COUNT {
            return Err(DistError(format!(
                "an all-gather of {} elements from each of {} ranks exceeds MPI's count limit of {MAX_COUNT}",
                t.numel(),
                self.world()
            )));
        }
        let mut out = Tensor::zeros(size.as_slice(), (t.kind(), Device::Cpu));
        match t.kind() {
            Kind::Float => self
                .world
                .all_gather_into(&slice_mut::<f32>(&mut t)[..], slice_mut::<f32>(&mut out)),
            Kind::Double => self
                .world
                .all_gather_into(&slice_mut::<f64>(&mut t)[..], slice_mut::<f64>(&mut out)),
            Kind::Int64 => self
                .world
                .all_gather_into(&slice_mut::<i64>(&mut t)[..], slice_mut::<i64>(&mut out)),
            Kind::Uint8 => self
                .world
                .all_gather_into(&slice_mut::<u8>(&mut t)[..], slice_mut::<u8>(&mut out)),
            k => {
                return Err(DistError(format!(
                    "the MPI backend gathers f32, f64, i64 and u8 tensors, got {k:?}"
                )));
            }
        }
        Ok(out)
    }

    fn barrier(&self) -> Result<(), DistError> {
        self.world.barrier();
        Ok(())
    }
}
