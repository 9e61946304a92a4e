//! Lets libtorch's MKL run its AVX-512 code on AMD CPUs that have AVX-512.
//!
//! MKL picks its code path once per process, and takes the AVX-512 kernels only when
//! `mkl_serv_intel_cpu_true()` says the CPU is Intel; on an AMD Zen 4/5 it falls back to AVX2 kernels
//! although the CPU runs AVX-512. On this project's 2-core EPYC that halves the rate of every libtorch
//! matmul: a (612×576)·(576×1536) product runs at 190 GFLOP/s on the AVX2 path and 410 GFLOP/s on the
//! AVX-512 one (`cargo run --release -p cotrain-model --example bench_linear`). libtorch exports that
//! function, so before MKL's first call we overwrite its entry with `mov eax, 1; ret` — the in-process
//! equivalent of the usual `LD_PRELOAD` shim that defines the symbol. MKL still reads the CPU's feature
//! bits to choose among its Intel paths, so the patch is applied only when the CPU has the AVX-512
//! subsets MKL's AVX-512 path needs (F, CD, BW, DQ, VL); elsewhere nothing changes.
//!
//! Set `COTRAIN_MKL_AVX512=0` to keep MKL's own choice. The patch must come before the first MKL call
//! of the process to take effect (MKL caches its choice), and while no other thread can be inside
//! that function (it rewrites live code): [`prefer_avx512`] is an `unsafe fn` with that contract,
//! and cotrain's binaries call it first thing in `main`; the library never calls it.
//!
//! On a CPU that runs AVX-512 as two 256-bit halves (AMD Zen 4) the AVX-512 path was still 1.10× the
//! AVX2 one in `bench_mkl_dispatch`; the patch is applied wherever the subsets are present.

use std::sync::OnceLock;

/// What [`prefer_avx512`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Dispatch {
    /// MKL now takes its AVX-512 path on this non-Intel CPU.
    Patched,
    /// Nothing to do: an Intel CPU (MKL already takes its best path).
    Intel,
    /// Left as it was, and why (no AVX-512, not x86-64, disabled by the environment, symbol absent…).
    Unchanged(String),
}

/// The environment switch: `0`, `false` or `off` keeps MKL's own dispatch.
pub const ENV_SWITCH: &str = "COTRAIN_MKL_AVX512";

/// Applies the patch once per process and returns what happened (the same value on every call).
///
/// # Safety
/// Call it at the start of `main`, before the process has other threads and before any libtorch
/// or MKL call: it rewrites the code of an MKL function in place, which is undefined behaviour if
/// another thread is running it, and is ignored by MKL after its first call.
pub unsafe fn prefer_avx512() -> Dispatch {
    static OUTCOME: OnceLock<Dispatch> = OnceLock::new();
    OUTCOME
        .get_or_init(|| {
            let outcome = apply();
            tracing::debug!(?outcome, "MKL dispatch");
            outcome
        })
        .clone()
}

#[cfg(target_arch = "x86_64")]
fn apply() -> Dispatch {
    if let Ok(v) = std::env::var(ENV_SWITCH)
        && matches!(
            v.trim().to_ascii_lowercase().as_str(),
            "0" | "false" | "off"
        )
    {
        return Dispatch::Unchanged(format!("{ENV_SWITCH}={v}"));
    }
    if cpu_vendor() == *b"GenuineIntel" {
        return Dispatch::Intel;
    }
    let needed = [
        ("avx512f", is_x86_feature_detected!("avx512f")),
        ("avx512cd", is_x86_feature_detected!("avx512cd")),
        ("avx512bw", is_x86_feature_detected!("avx512bw")),
        ("avx512dq", is_x86_feature_detected!("avx512dq")),
        ("avx512vl", is_x86_feature_detected!("avx512vl")),
    ];
    if let Some((name, _)) = needed.iter().find(|(_, has)| !has) {
        return Dispatch::Unchanged(format!("the CPU lacks {name}"));
    }
    // SAFETY: `dlsym` with `RTLD_DEFAULT` only looks a name up in the loaded objects.
    let entry = unsafe { libc::dlsym(libc::RTLD_DEFAULT, c"mkl_serv_intel_cpu_true".as_ptr()) };
    if entry.is_null() {
        return Dispatch::Unchanged(
            "libtorch exports no mkl_serv_intel_cpu_true (not an MKL build)".into(),
        );
    }
    // SAFETY: `entry` is the start of a loaded function of at least 6 bytes (it reads a cache, runs
    // cpuid and compares three registers). Its pages are made writable only for the 6-byte store, and
    // no thread can be inside it yet: the patch runs before MKL's first call (see the module docs).
    unsafe { overwrite_with_return_one(entry.cast()) }
}

#[cfg(not(target_arch = "x86_64"))]
fn apply() -> Dispatch {
    Dispatch::Unchanged("not an x86-64 CPU".into())
}

/// `mov eax, 1; ret`
#[cfg(target_arch = "x86_64")]
const RETURN_ONE: [u8; 6] = [0xb8, 0x01, 0x00, 0x00, 0x00, 0xc3];

#[cfg(target_arch = "x86_64")]
unsafe fn overwrite_with_return_one(entry: *mut u8) -> Dispatch {
    // SAFETY (whole body): see the caller; the range [entry, entry + 6) lies within the pages given
    // to mprotect, which are restored to read + execute afterwards.
    unsafe {
        if std::slice::from_raw_parts(entry, RETURN_ONE.len()) == RETURN_ONE {
            return Dispatch::Patched;
        }
        let page = libc::sysconf(libc::_SC_PAGESIZE) as usize;
        let start = (entry as usize) & !(page - 1);
        let len = (entry as usize + RETURN_ONE.len()) - start;
        if libc::mprotect(
            start as *mut libc::c_void,
            len,
            libc::PROT_READ | libc::PROT_WRITE | libc::PROT_EXEC,
        ) != 0
        {
            return Dispatch::Unchanged(format!(
                "mprotect refused: {}",
                std::io::Error::last_os_error()
            ));
        }
        std::ptr::copy_nonoverlapping(RETURN_ONE.as_ptr(), entry, RETURN_ONE.len());
        if libc::mprotect(
            start as *mut libc::c_void,
            len,
            libc::PROT_READ | libc::PROT_EXEC,
        ) != 0
        {
            // The patch is in place; the pages merely stay writable.
            tracing::warn!(
                error = %std::io::Error::last_os_error(),
                "MKL dispatch: could not make libtorch's code read-only again"
            );
        }
        Dispatch::Patched
    }
}

#[cfg(target_arch = "x86_64")]
fn cpu_vendor() -> [u8; 12] {
    // cpuid leaf 0 (the vendor string) exists on every x86-64 CPU.
    let r = std::arch::x86_64::__cpuid(0);
    let mut v = [0u8; 12];
    v[..4].copy_from_slice(&r.ebx.to_le_bytes());
    v[4..8].copy_from_slice(&r.edx.to_le_bytes());
    v[8..].copy_from_slice(&r.ecx.to_le_bytes());
    v
}

// Tested in `tests/mkl_dispatch.rs`, a process of its own: patching here, while other unit tests may be
// inside MKL on other threads, would rewrite code they could be running.
