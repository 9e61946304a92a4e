//! The MPI backend: Open MPI (or any MPI the `mpi` crate links) on CPU tensors. MPI's own launcher
//! (`mpirun`, `srun --mpi=pmix`) gives each process its rank; a failed peer makes MPI abort the job
//! (its default error handler), which is what stops every rank when one dies.

use mpi::collective::SystemOperation;
use mpi::environment::Universe;
use mpi::topology::SimpleCommunicator;
use mpi::traits::*;
use tch::{Device, Kind, Tensor};

use super::{Collective, DistError, RankEnv};

pub struct MpiCollective {
    world: SimpleCommunicator,
    // Finalises MPI when dropped: declared after `world` so that it is dropped last.
    _universe: Universe,
}

impl MpiCollective {
    pub fn init(env: &RankEnv) -> Result<Self, DistError> {
        let universe = mpi::initialize().ok_or_else(|| DistError("MPI was already initialised in this process".into()))?;
        let world = universe.world();
        let (rank, size) = (world.rank() as usize, world.size() as usize);
        if (rank, size) != (env.rank, env.world) {
            return Err(DistError(format!(
                "MPI says rank {rank} of {size}, the launcher's environment rank {} of {}: was this process started by another MPI's launcher?",
                env.rank, env.world
            )));
        }
        Ok(Self { world, _universe: universe })
    }
}

fn check_cpu(t: &Tensor) -> Result<(), DistError> {
    if t.device() != Device::Cpu || !t.is_contiguous() {
        return Err(DistError(format!("the MPI backend reduces contiguous CPU tensors, got one on {:?}", t.device())));
    }
    Ok(())
}

/// The tensor's storage as a mutable slice of `T` (the caller checked kind, device and contiguity).
fn slice_mut<T>(t: &mut Tensor) -> &mut [T] {
    // SAFETY: `t` is a contiguous CPU tensor of `numel` elements of `T` (checked by the callers),
    // borrowed mutably for the slice's lifetime.
    unsafe { std::slice::from_raw_parts_mut(t.data_ptr() as *mut T, t.numel()) }
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
            Kind::Float => {
                let buf = slice_mut::<f32>(t);
                let send = buf.to_vec();
                self.world.all_reduce_into(&send[..], buf, SystemOperation::sum());
            }
            Kind::Double => {
                let buf = slice_mut::<f64>(t);
                let send = buf.to_vec();
                self.world.all_reduce_into(&send[..], buf, SystemOperation::sum());
            }
            Kind::Int64 => {
                let buf = slice_mut::<i64>(t);
                let send = buf.to_vec();
                self.world.all_reduce_into(&send[..], buf, SystemOperation::sum());
            }
            k => return Err(DistError(format!("the MPI backend sums f32, f64 and i64 tensors, got {k:?}"))),
        }
        Ok(())
    }

    fn broadcast(&self, t: &mut Tensor, root: usize) -> Result<(), DistError> {
        check_cpu(t)?;
        let root = self.world.process_at_rank(root as i32);
        match t.kind() {
            Kind::Float => root.broadcast_into(slice_mut::<f32>(t)),
            Kind::Double => root.broadcast_into(slice_mut::<f64>(t)),
            Kind::Int64 => root.broadcast_into(slice_mut::<i64>(t)),
            Kind::Uint8 => root.broadcast_into(slice_mut::<u8>(t)),
            k => return Err(DistError(format!("the MPI backend broadcasts f32, f64, i64 and u8 tensors, got {k:?}"))),
        }
        Ok(())
    }

    fn all_gather(&self, t: &Tensor) -> Result<Tensor, DistError> {
        let mut t = t.contiguous();
        check_cpu(&t)?;
        let mut size = t.size();
        size.insert(0, self.world() as i64);
        let mut out = Tensor::zeros(size.as_slice(), (t.kind(), Device::Cpu));
        match t.kind() {
            Kind::Float => self.world.all_gather_into(&slice_mut::<f32>(&mut t)[..], slice_mut::<f32>(&mut out)),
            Kind::Double => self.world.all_gather_into(&slice_mut::<f64>(&mut t)[..], slice_mut::<f64>(&mut out)),
            Kind::Int64 => self.world.all_gather_into(&slice_mut::<i64>(&mut t)[..], slice_mut::<i64>(&mut out)),
            Kind::Uint8 => self.world.all_gather_into(&slice_mut::<u8>(&mut t)[..], slice_mut::<u8>(&mut out)),
            k => return Err(DistError(format!("the MPI backend gathers f32, f64, i64 and u8 tensors, got {k:?}"))),
        }
        Ok(out)
    }

    fn barrier(&self) -> Result<(), DistError> {
        self.world.barrier();
        Ok(())
    }
}
