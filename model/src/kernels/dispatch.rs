//! Whether cotrain's own CPU decode kernels ([`super::gemm_f32`], [`super::decode_f32`]) serve
//! decode steps instead of libtorch.
//!
//! By default, wherever the CPU has AVX-512F (the kernels need it). `COTRAIN_CPU_KERNELS=probe`
//! decides by measurement instead: a start-up probe times the kernels against libtorch's route on
//! the decode-step products of a small model (x · wᵀ with 1, 8 and 32 rows of width 576 against a
//! 1536 × 576 weight, on the calling thread's libtorch threads) and keeps them only when they are
//! not slower in total. The probe is not the default because its answer depends on what else the
//! machine is doing at that moment, and the two routes round differently, so a seeded run would
//! sample differently from one start to the next. `on` and `off` force either route.

use std::sync::OnceLock;
use std::time::Instant;

use tch::{Device, Kind, Tensor};

/// The environment switch: `on`/`1`, `off`/`0`, or `probe`.
pub const ENV: &str = "COTRAIN_CPU_KERNELS";

/// What was decided, and on what grounds.
#[derive(Clone, Debug)]
pub struct Decision {
    /// cotrain's kernels serve decode steps.
    pub own_kernels: bool,
    pub reason: String,
    /// Summed median microseconds of the probe's products: cotrain's kernel, libtorch.
    pub probe_us: Option<(f64, f64)>,
}

/// The decision, made once per process (with `probe`, the first call runs it: about 10–30 ms).
pub fn decision() -> &'static Decision {
    static DECISION: OnceLock<Decision> = OnceLock::new();
    DECISION.get_or_init(|| {
        let d = decide();
        tracing::info!(own_kernels = d.own_kernels, reason = %d.reason, "CPU decode kernels");
        d
    })
}

/// Whether cotrain's kernels serve decode steps (see the module docs).
pub fn own_kernels() -> bool {
    decision().own_kernels
}

fn decide() -> Decision {
    let fixed = |own: bool, reason: String| Decision { own_kernels: own, reason, probe_us: None };
    #[cfg(not(target_arch = "x86_64"))]
    return fixed(false, "not an x86-64 CPU".into());
    #[cfg(target_arch = "x86_64")]
    {
        if !super::gemm_f32::is_available() {
            return fixed(false, "the CPU lacks AVX-512F".into());
        }
        let mode = std::env::var(ENV).unwrap_or_default();
        match mode.trim().to_ascii_lowercase().as_str() {
            "" | "on" | "1" | "true" => return fixed(true, if mode.is_empty() { "the CPU has AVX-512F".into() } else { format!("{ENV}={mode}") }),
            "off" | "0" | "false" => return fixed(false, format!("{ENV}={mode}")),
            "probe" => {}
            _ => {
                tracing::warn!("{ENV}={mode} is not on, off or probe: using the kernels");
                return fixed(true, format!("{ENV}={mode} not understood"));
            }
        }
        let (ours, theirs) = probe();
        Decision {
            own_kernels: ours <= theirs,
            reason: format!("probe: cotrain's kernel {ours:.0} µs, libtorch {theirs:.0} µs"),
            probe_us: Some((ours, theirs)),
        }
    }
}

/// Summed medians (µs) over the probe's shapes: cotrain's kernel, libtorch's `linear` (needs
/// AVX-512F).
#[cfg(target_arch = "x86_64")]
pub fn probe() -> (f64, f64) {
    let _guard = tch::no_grad_guard();
    let (n, k) = (1536i64, 576i64);
    // Deterministic values: the probe must not draw from libtorch's global generator.
    let w = (Tensor::arange(n * k, (Kind::Float, Device::Cpu)) * 0.37).sin().reshape([n, k]) * 0.05;
    let median = |f: &mut dyn FnMut()| {
        f();
        let mut t: Vec<f64> = (0..9)
            .map(|_| {
                let s = Instant::now();
                f();
                s.elapsed().as_secs_f64() * 1e6
            })
            .collect();
        t.sort_by(f64::total_cmp);
        t[t.len() / 2]
    };
    let (mut ours, mut theirs) = (0.0, 0.0);
    for m in [1i64, 8, 32] {
        let x = (Tensor::arange(m * k, (Kind::Float, Device::Cpu)) * 0.11).cos().reshape([m, k]);
        ours += median(&mut || {
            let _ = std::hint::black_box(super::kernel_linear_nt(&x, &w));
        });
        theirs += median(&mut || {
            let _ = std::hint::black_box(x.linear::<Tensor>(&w, None));
        });
    }
    (ours, theirs)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_decision_is_explained_and_the_probe_times_both_routes() {
        let d = decision();
        assert!(!d.reason.is_empty());
        if let Some((ours, theirs)) = d.probe_us {
            assert_eq!(d.own_kernels, ours <= theirs, "{d:?}");
        }
        assert_eq!(own_kernels(), d.own_kernels);
        #[cfg(target_arch = "x86_64")]
        if super::super::gemm_f32::is_available() {
            let (ours, theirs) = probe();
            assert!(ours > 0.0 && theirs > 0.0);
            eprintln!("{d:?}; probe now: kernel {ours:.0} µs, libtorch {theirs:.0} µs");
        }
    }
}
