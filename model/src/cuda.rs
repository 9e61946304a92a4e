//! CUDA, loaded at run time, and the device a process asks for.
//!
//! torch-sys links `-ltorch_cuda` when the libtorch it builds against has CUDA, but rustc passes
//! native libraries with `-Wl,--as-needed` and no Rust code names a `torch_cuda` symbol, so the
//! linker drops the library: the binary starts without libtorch's CUDA backend registered, and
//! `tch::Cuda::device_count()` says 0 on a machine full of GPUs. Rather than depend on link flags,
//! every device query in cotrain goes through this module, which first `dlopen`s
//! `libtorch_cuda.so` with `RTLD_GLOBAL` (its static initialisers register the backend). On a CPU
//! build the library is absent or its CUDA dependencies are, which is fine: the reason is kept and
//! reported only when someone asks for a GPU.
//!
//! Where the library is looked for, in order: `$COTRAIN_LIBTORCH_CUDA` (a file), the directory the
//! process's `libtorch_cpu.so` was loaded from (so a binary run against another PyTorch of the same
//! version through `LD_LIBRARY_PATH` takes that PyTorch's CUDA too), then the loader's own search
//! (`LD_LIBRARY_PATH`, the binary's RUNPATH).

use std::ffi::{CStr, CString};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use tch::{Device, Kind, Tensor};

use crate::error::{ModelError, Result};

/// Names a file to load as `libtorch_cuda.so` instead of searching for it.
pub const LIBRARY_ENV: &str = "COTRAIN_LIBTORCH_CUDA";

/// What loading `libtorch_cuda.so` gave: the path it was loaded from, or why it could not be.
pub fn load() -> &'static std::result::Result<PathBuf, String> {
    static LOADED: OnceLock<std::result::Result<PathBuf, String>> = OnceLock::new();
    LOADED.get_or_init(|| {
        let loaded = load_library();
        match &loaded {
            Ok(path) => {
                tracing::debug!(library = %path.display(), "loaded libtorch's CUDA backend")
            }
            Err(why) => tracing::debug!("no CUDA backend: {why}"),
        }
        loaded
    })
}

fn load_library() -> std::result::Result<PathBuf, String> {
    let mut candidates: Vec<PathBuf> = Vec::new();
    if let Some(file) = std::env::var_os(LIBRARY_ENV).filter(|v| !v.is_empty()) {
        // An explicit choice is the only candidate: falling back would hide a wrong path.
        candidates.push(PathBuf::from(file));
    } else {
        if let Some(dir) = loaded_library_dir("libtorch_cpu.so") {
            candidates.push(dir.join("libtorch_cuda.so"));
        }
        candidates.push(PathBuf::from("libtorch_cuda.so"));
    }
    let mut errors = Vec::new();
    for candidate in &candidates {
        // A path with a directory that does not exist is not worth a dlopen error message.
        if candidate.components().count() > 1 && !candidate.exists() {
            errors.push(format!("{}: no such file", candidate.display()));
            continue;
        }
        match dlopen_global(candidate) {
            Ok(()) => {
                return Ok(loaded_library_dir("libtorch_cuda.so")
                    .map(|d| d.join("libtorch_cuda.so"))
                    .unwrap_or(candidate.clone()));
            }
            Err(e) if !errors.contains(&e) => errors.push(e),
            Err(_) => {}
        }
    }
    Err(format!(
        "libtorch_cuda.so could not be loaded ({})",
        errors.join("; ")
    ))
}

fn dlopen_global(path: &Path) -> std::result::Result<(), String> {
    let c = CString::new(path.as_os_str().as_encoded_bytes())
        .map_err(|_| format!("{}: NUL in path", path.display()))?;
    // SAFETY: a NUL-terminated path; the handle is deliberately never closed (the backend must stay
    // registered for the life of the process). dlerror is read right after the failing call.
    unsafe {
        let handle = libc::dlopen(c.as_ptr(), libc::RTLD_NOW | libc::RTLD_GLOBAL);
        if handle.is_null() {
            let e = libc::dlerror();
            return Err(if e.is_null() {
                format!("{}: dlopen failed", path.display())
            } else {
                CStr::from_ptr(e).to_string_lossy().into_owned()
            });
        }
    }
    Ok(())
}

/// The directory of the loaded shared object whose file name is `name`, if it is loaded.
pub fn loaded_library_dir(name: &str) -> Option<PathBuf> {
    struct Search<'a> {
        name: &'a str,
        found: Option<PathBuf>,
    }
    unsafe extern "C" fn visit(
        info: *mut libc::dl_phdr_info,
        _size: libc::size_t,
        data: *mut libc::c_void,
    ) -> libc::c_int {
        // SAFETY: the loader hands us a valid info record; `data` is the `Search` passed below.
        let (info, search) = unsafe { (&*info, &mut *(data as *mut Search)) };
        if info.dlpi_name.is_null() {
            return 0;
        }
        // SAFETY: dlpi_name is a NUL-terminated string owned by the loader.
        let path = PathBuf::from(
            unsafe { CStr::from_ptr(info.dlpi_name) }
                .to_string_lossy()
                .into_owned(),
        );
        if path.file_name().and_then(|f| f.to_str()) == Some(search.name) {
            search.found = path.parent().map(Path::to_path_buf);
            return 1;
        }
        0
    }
    let mut search = Search { name, found: None };
    // SAFETY: `visit` only reads the records and writes into `search`, which outlives the call.
    unsafe { libc::dl_iterate_phdr(Some(visit), &mut search as *mut Search as *mut libc::c_void) };
    search.found
}

/// How many CUDA devices this process sees (after loading the backend; 0 without one).
pub fn device_count() -> usize {
    if load().is_err() {
        return 0;
    }
    tch::Cuda::device_count().max(0) as usize
}

/// Whether at least one CUDA device is usable.
pub fn is_available() -> bool {
    device_count() > 0
}

/// Why `cuda:{ordinal}` cannot be used, or `None` when it can.
pub fn unavailable_reason(ordinal: usize) -> Option<String> {
    if let Err(why) = load() {
        return Some(format!(
            "{why}; this libtorch has no usable CUDA backend (a CPU set-up: use COTRAIN_TORCH=cuda or system)"
        ));
    }
    let count = device_count();
    if ordinal < count {
        return None;
    }
    if count == 0 {
        // libtorch knows why better than a count does: no driver, a driver too old, no device.
        let why = match Tensor::f_zeros([1], (Kind::Float, Device::Cuda(0))) {
            Err(e) => first_line(&e.to_string()),
            Ok(_) => "libtorch reports no CUDA device".to_string(),
        };
        return Some(format!("CUDA backend loaded but no GPU is usable: {why}"));
    }
    let visible = std::env::var("CUDA_VISIBLE_DEVICES")
        .map(|v| format!(" (CUDA_VISIBLE_DEVICES={v})"))
        .unwrap_or_default();
    Some(format!(
        "no device {ordinal}: this process sees {count} CUDA device(s){visible}"
    ))
}

fn first_line(message: &str) -> String {
    message
        .lines()
        .map(str::trim)
        .find(|l| !l.is_empty())
        .unwrap_or("unknown error")
        .to_string()
}

/// A device as a user writes it: `auto`, `cpu`, `cuda` (this process's GPU) or `cuda:N`.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, Default, serde::Serialize, serde::Deserialize,
)]
#[serde(try_from = "String", into = "String")]
pub enum DeviceRequest {
    /// A GPU when one is usable, else the CPU (logged).
    #[default]
    Auto,
    Cpu,
    /// This process's GPU: `cuda:(local rank)` under a launcher, `cuda:0` otherwise.
    Cuda,
    /// Exactly this ordinal (among the devices `CUDA_VISIBLE_DEVICES` leaves visible).
    CudaOrdinal(usize),
}

impl std::str::FromStr for DeviceRequest {
    type Err = ModelError;

    fn from_str(s: &str) -> Result<Self> {
        let lower = s.trim().to_ascii_lowercase();
        match lower.as_str() {
            "auto" => Ok(Self::Auto),
            "cpu" => Ok(Self::Cpu),
            "cuda" | "gpu" => Ok(Self::Cuda),
            other => match other.strip_prefix("cuda:").map(str::parse::<usize>) {
                Some(Ok(i)) => Ok(Self::CudaOrdinal(i)),
                _ => Err(ModelError::UnknownDevice(s.to_string())),
            },
        }
    }
}

impl TryFrom<String> for DeviceRequest {
    type Error = ModelError;

    fn try_from(s: String) -> Result<Self> {
        s.parse()
    }
}

impl From<DeviceRequest> for String {
    fn from(d: DeviceRequest) -> String {
        d.to_string()
    }
}

impl std::fmt::Display for DeviceRequest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Auto => f.write_str("auto"),
            Self::Cpu => f.write_str("cpu"),
            Self::Cuda => f.write_str("cuda"),
            Self::CudaOrdinal(i) => write!(f, "cuda:{i}"),
        }
    }
}

impl DeviceRequest {
    /// The device this request names for the process that is local rank `local_rank` on its node.
    ///
    /// `cuda` is `cuda:(local_rank)`, torchrun's convention, except when the launcher left each
    /// rank a single visible device (Slurm's `--gpus-per-task`, a per-rank `CUDA_VISIBLE_DEVICES`):
    /// then it is `cuda:0`. A CUDA request that cannot be met is an error naming why; `auto` falls
    /// back to the CPU and logs why.
    pub fn resolve(self, local_rank: usize) -> Result<Device> {
        let ordinal = |count: usize| if count == 1 { 0 } else { local_rank };
        let unavailable =
            |device: String, reason: String| ModelError::CudaUnavailable { device, reason };
        match self {
            Self::Cpu => Ok(Device::Cpu),
            Self::CudaOrdinal(i) => match unavailable_reason(i) {
                None => Ok(Device::Cuda(i)),
                Some(reason) => Err(unavailable(self.to_string(), reason)),
            },
            Self::Cuda => {
                let i = ordinal(device_count());
                match unavailable_reason(i) {
                    None => Ok(Device::Cuda(i)),
                    Some(reason) if local_rank == 0 => Err(unavailable("cuda".into(), reason)),
                    Some(reason) => Err(unavailable(
                        format!("cuda (cuda:{i} for local rank {local_rank})"),
                        reason,
                    )),
                }
            }
            Self::Auto => {
                let i = ordinal(device_count());
                match unavailable_reason(i) {
                    None => {
                        tracing::info!("device auto: cuda:{i}");
                        Ok(Device::Cuda(i))
                    }
                    Some(reason) => {
                        tracing::info!("device auto: cpu ({reason})");
                        Ok(Device::Cpu)
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_parse_and_print_back() {
        for s in ["auto", "cpu", "cuda", "cuda:3"] {
            assert_eq!(s.parse::<DeviceRequest>().unwrap().to_string(), s);
        }
        assert_eq!("GPU".parse::<DeviceRequest>().unwrap(), DeviceRequest::Cuda);
        for bad in ["tpu", "cuda:", "cuda:x", "cuda:-1"] {
            let e = bad.parse::<DeviceRequest>().unwrap_err().to_string();
            assert!(e.contains(&format!("unknown device `{bad}`")), "{e}");
        }
    }

    #[test]
    fn cpu_is_always_the_cpu_and_auto_falls_back_without_a_gpu() {
        assert_eq!(DeviceRequest::Cpu.resolve(3).unwrap(), Device::Cpu);
        if device_count() == 0 {
            assert_eq!(DeviceRequest::Auto.resolve(0).unwrap(), Device::Cpu);
        }
    }

    /// The state CI's machines are in: no GPU. Asking for one names the device and the reason.
    #[test]
    fn a_cuda_request_without_a_gpu_says_why() {
        if device_count() > 0 {
            return;
        }
        for request in [DeviceRequest::Cuda, DeviceRequest::CudaOrdinal(1)] {
            let e = request.resolve(1).unwrap_err().to_string();
            assert!(e.contains("CUDA is unavailable"), "{e}");
            assert!(e.contains("cuda:1"), "{e}");
            // Either the library is not there/loadable (a CPU set-up) or it is and there is no GPU.
            assert!(
                e.contains("libtorch_cuda.so") || e.contains("no GPU is usable"),
                "{e}"
            );
        }
    }

    #[test]
    fn libtorch_cpu_is_found_among_the_loaded_libraries() {
        // Touch libtorch so that it is certainly mapped, then find it where tch's build linked it.
        let _ = Tensor::zeros([1], (Kind::Float, Device::Cpu));
        let dir = loaded_library_dir("libtorch_cpu.so").expect("libtorch_cpu.so is loaded");
        assert!(dir.join("libtorch_cpu.so").exists(), "{}", dir.display());
        assert!(loaded_library_dir("libnot_a_library.so").is_none());
    }
}
