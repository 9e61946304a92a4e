//! The NCCL backend (the `cuda` feature): cudarc's NCCL bindings, loaded at run time, on the CUDA
//! tensors libtorch owns. Torch's device memory is lent to cudarc for each call (never freed by it),
//! and both sides synchronise around the call so that NCCL's stream and torch's agree. NCCL's
//! all-reduce and broadcast work in place; counts are split at MPI's limit as well
//! ([`MAX_COUNT`]), so that no backend is trusted with more than an `int` of elements.

use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaStream};
use cudarc::nccl::safe::{Comm, Id, ReduceOp};
use tch::{Device, Kind, Tensor};

use super::buckets::{MAX_COUNT, chunks};
use super::{Collective, DistError, RankEnv, rendezvous};

pub struct NcclCollective {
    comm: Comm,
    stream: Arc<CudaStream>,
    device: Device,
}

fn err(e: impl std::fmt::Debug) -> DistError {
    DistError(format!("NCCL: {e:?}"))
}

/// Checks that cudarc will find NCCL, which it looks for as `libnccl.so`, `libnccl.so.12`, …,
/// `libnccl.so.1` but never as `libnccl.so.2`, the only name pip's `nvidia-nccl-cu13` (the NCCL
/// PyTorch wheels bring) ships. Without this check cudarc panics on its first NCCL call.
fn check_nccl_loadable() -> Result<(), DistError> {
    let names = cudarc::get_lib_name_candidates("nccl");
    for name in &names {
        let Ok(c) = std::ffi::CString::new(name.as_str()) else {
            continue;
        };
        // SAFETY: a NUL-terminated name; the handle stays open (cudarc opens the same library).
        if !unsafe { libc::dlopen(c.as_ptr(), libc::RTLD_LAZY) }.is_null() {
            return Ok(());
        }
    }
    // libtorch_cuda needs libnccl.so.2, so with the CUDA backend loaded the file is known.
    let found = cotrain_model::cuda::loaded_library_dir("libnccl.so.2")
        .map(|d| {
            format!(
                " (this process has {} loaded)",
                d.join("libnccl.so.2").display()
            )
        })
        .unwrap_or_default();
    Err(DistError(format!(
        "NCCL not found under the names the NCCL backend loads ({}); pip's nvidia-nccl-cu13 ships only libnccl.so.2{found}: \
         `COTRAIN_TORCH=cuda make setup` (or `system`) links it as libnccl.so into the binaries' run path, or put a directory \
         holding a libnccl.so link to it on LD_LIBRARY_PATH",
        names.join(", ")
    )))
}

impl NcclCollective {
    pub fn init(env: &RankEnv, device: Device) -> Result<Self, DistError> {
        let Device::Cuda(ordinal) = device else {
            return Err(DistError(format!(
                "learner.backend nccl needs CUDA tensors, the learner's device is {device:?}"
            )));
        };
        check_nccl_loadable()?;
        let (addr, port) = env.master.clone().ok_or_else(|| {
            DistError("learner.backend nccl needs MASTER_ADDR/MASTER_PORT (torchrun, Slurm or `learner launch --backend nccl`)".into())
        })?;
        let id = if env.rank == 0 {
            let id = Id::new().map_err(err)?;
            let bytes: [u8; 128] = id.internal().map(|c| c as u8);
            rendezvous::serve(&addr, port, &bytes, env.world)?;
            id
        } else {
            Id::uninit(rendezvous::fetch(&addr, port, env.rank)?.map(|b| b as core::ffi::c_char))
        };
        let ctx = CudaContext::new(ordinal).map_err(err)?;
        let stream = ctx.default_stream();
        let comm = Comm::from_rank(stream.clone(), env.rank, env.world, id).map_err(err)?;
        Ok(Self {
            comm,
            stream,
            device,
        })
    }

    /// Runs `f` on `t`'s memory as a cudarc slice of `T`, synchronising torch before and NCCL after.
    fn on_slice<T>(
        &self,
        t: &Tensor,
        f: impl FnOnce(&mut cudarc::driver::CudaSlice<T>) -> Result<(), DistError>,
    ) -> Result<(), DistError> {
        if t.device() != self.device || !t.is_contiguous() {
            return Err(DistError(format!(
                "the NCCL backend works on contiguous tensors on {:?}, got one on {:?}",
                self.device,
                t.device()
            )));
        }
        tch::Cuda::synchronize(match self.device {
            Device::Cuda(i) => i as i64,
            _ => 0,
        });
        // SAFETY: `t` is a live contiguous allocation of `numel` elements of `T` on this device; the
        // slice is leaked back below, so cudarc never frees torch's memory.
        let mut slice = unsafe {
            self.stream
                .upgrade_device_ptr::<T>(t.data_ptr() as u64, t.numel())
        };
        let out = f(&mut slice);
        slice.leak();
        self.stream.synchronize().map_err(err)?;
        out
    }
}

impl Collective for NcclCollective {
    fn rank(&self) -> usize {
        self.comm.rank()
    }
    fn world(&self) -> usize {
        self.comm.world_size()
    }
    fn backend(&self) -> &'static str {
        "nccl"
    }
    fn device(&self) -> Device {
        self.device
    }

    fn all_reduce_sum(&self, t: &mut Tensor) -> Result<(), DistError> {
        macro_rules! sum {
            ($ty:ty) => {
                self.on_slice::<$ty>(t, |s| {
                    for r in chunks(s.len(), MAX_COUNT) {
                        self.comm
                            .all_reduce_in_place(&mut s.slice_mut(r), &ReduceOp::Sum)
                            .map_err(err)?;
                    }
                    Ok(())
                })
            };
        }
        match t.kind() {
            Kind::Float => sum!(f32),
            Kind::Double => sum!(f64),
            Kind::Int64 => sum!(i64),
            k => Err(DistError(format!(
                "the NCCL backend sums f32, f64 and i64 tensors, got {k:?}"
            ))),
        }
    }

    fn broadcast(&self, t: &mut Tensor, root: usize) -> Result<(), DistError> {
        let root = root as i32;
        macro_rules! broadcast {
            ($ty:ty) => {
                self.on_slice::<$ty>(t, |s| {
                    for r in chunks(s.len(), MAX_COUNT) {
                        self.comm
                            .broadcast_in_place(&mut s.slice_mut(r), root)
                            .map_err(err)?;
                    }
                    Ok(())
                })
            };
        }
        match t.kind() {
            Kind::Float => broadcast!(f32),
            Kind::Double => broadcast!(f64),
            Kind::Int64 => broadcast!(i64),
            Kind::Uint8 => broadcast!(u8),
            k => Err(DistError(format!(
                "the NCCL backend broadcasts f32, f64, i64 and u8 tensors, got {k:?}"
            ))),
        }
    }

    fn all_gather(&self, t: &Tensor) -> Result<Tensor, DistError> {
        let t = t.contiguous();
        let mut size = t.size();
        size.insert(0, self.world() as i64);
        // Kept to MPI's limit too (gathers carry metadata), rather than trusting every NCCL
        // version with larger counts.
        if t.numel() > MAX_COUNT {
            return Err(DistError(format!(
                "an all-gather of {} elements per rank exceeds the count limit of {MAX_COUNT}",
                t.numel()
            )));
        }
        let out = Tensor::zeros(size.as_slice(), (t.kind(), self.device));
        macro_rules! gather {
            ($ty:ty) => {
                self.on_slice::<$ty>(&t, |src| {
                    self.on_slice::<$ty>(&out, |dst| {
                        self.comm.all_gather(src, dst).map(|_| ()).map_err(err)
                    })
                })
            };
        }
        match t.kind() {
            Kind::Float => gather!(f32),
            Kind::Double => gather!(f64),
            Kind::Int64 => gather!(i64),
            Kind::Uint8 => gather!(u8),
            k => {
                return Err(DistError(format!(
                    "the NCCL backend gathers f32, f64, i64 and u8 tensors, got {k:?}"
                )));
            }
        }?;
        Ok(out)
    }
}
