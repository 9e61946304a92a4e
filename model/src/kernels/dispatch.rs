//! Which route decodes on the CPU.
//!
//! Two decisions. [`fused_decode`]: whether a decode step runs as cotrain's fused step
//! (`families/transformer/decode_cpu.rs`: norms, RoPE, the cache write, attention and SiLU as plain
//! loops over flat buffers, [`super::decode_f32`]) instead of libtorch's ops: wherever the CPU has
//! AVX-512F, since it does the same arithmetic as those ops without their per-op dispatch and
//! allocation (some 25 ops per layer), which is what a decode step of a few rows spends its time on.
//! [`own_kernels`]: whether the weight products (inside that step, and `linear` on a few rows) run
//! in cotrain's matrix kernel ([`super::gemm_f32`]) or in libtorch, for each weight dtype the kernel
//! reads (f32, bf16). libtorch's products are well tuned on some CPUs (oneDNN's bf16 products use
//! AVX512_BF16 dot products, which the kernel uses only when asked: `gemm_bf16dot`, since they
//! round the rows to bf16), so this one is measured.
//!
//! The products are decided by measurement, once per CPU: a probe times the kernel against the plain libtorch route
//! ([`super::libtorch_route::libtorch_linear`]) on the products of a few decoder layers of
//! the default model's shapes (more bytes than an L3 cache holds, so that they stream from memory
//! as they do when a model decodes) at 1, 8 and 32 rows, the two routes interleaved so that a change in the
//! machine's load hits both, and keeps the kernels where they are not slower in total. The answer
//! is then pinned: written to `cpu-dispatch.json` in cotrain's cache directory under a key naming
//! the CPU (model name, family, model, stepping), the thread count, the dtype, the kernels'
//! revision and the build profile, and read by every later process on such a CPU. Pinning matters beyond speed: the two
//! routes round differently, so a decision that changed from one start to the next (as a probe's
//! would with the machine's load) would change a seeded run's samples. The first process measures
//! under a file lock; the others wait for its answer.
//!
//! `COTRAIN_CPU_KERNELS`: `auto` (the default, as above), `on` (the kernels for every product),
//! `off` (libtorch for everything, the fused step included), `probe` (measure again now and pin the
//! new answer). Without AVX-512F there is no kernel and nothing is measured.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::time::Instant;

use tch::{Device, Kind, Tensor};

/// The environment switch: `auto`, `on`/`1`, `off`/`0`, or `probe`.
pub const ENV: &str = "COTRAIN_CPU_KERNELS";

/// Bumped when the kernels change enough that pinned answers should be measured again.
const KERNEL_REVISION: u32 = 6;

/// What was decided for the products of one dtype, and on what grounds.
#[derive(Clone, Debug)]
pub struct Decision {
    /// cotrain's kernels serve decode steps.
    pub own_kernels: bool,
    pub reason: String,
    /// Summed median microseconds of the probe's products, cotrain's kernel and libtorch, when
    /// measured or read from the pin.
    pub probe_us: Option<(f64, f64)>,
}

/// The decision for weights of `kind` (f32 or bf16; any other dtype has no kernel), made once per
/// process (see the module docs).
pub fn decision(kind: Kind) -> &'static Decision {
    static F32: OnceLock<Decision> = OnceLock::new();
    static BF16: OnceLock<Decision> = OnceLock::new();
    static NONE: OnceLock<Decision> = OnceLock::new();
    let (cell, kind) = match kind {
        Kind::Float => (&F32, Kind::Float),
        Kind::BFloat16 => (&BF16, Kind::BFloat16),
        _ => {
            return NONE.get_or_init(|| Decision {
                own_kernels: false,
                reason: "the kernels read f32 or bf16 only".into(),
                probe_us: None,
            });
        }
    };
    cell.get_or_init(|| {
        let mode = std::env::var(ENV).unwrap_or_default();
        let d = decide(kind, &mode, cache_dir().as_deref());
        tracing::info!(dtype = ?kind, own_kernels = d.own_kernels, reason = %d.reason, "CPU decode kernels");
        d
    })
}

/// Whether cotrain's matrix kernel serves the products of weights of `kind` (see the module docs).
/// bf16 weights always do while the AVX512_BF16 option is on (`gemm_bf16dot`): it names this kernel.
pub fn own_kernels(kind: Kind) -> bool {
    #[cfg(target_arch = "x86_64")]
    if kind == Kind::BFloat16 && super::gemm_bf16dot::enabled() {
        return true;
    }
    decision(kind).own_kernels
}

/// Whether decode steps run as cotrain's fused step (see the module docs): AVX-512F, unless
/// `COTRAIN_CPU_KERNELS=off`.
pub fn fused_decode() -> bool {
    static FUSED: OnceLock<bool> = OnceLock::new();
    *FUSED.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        let avx512 = super::gemm_f32::is_available();
        #[cfg(not(target_arch = "x86_64"))]
        let avx512 = false;
        let off = matches!(
            std::env::var(ENV)
                .unwrap_or_default()
                .trim()
                .to_ascii_lowercase()
                .as_str(),
            "off" | "0" | "false"
        );
        avx512 && !off
    })
}

/// cotrain's cache directory, as `scripts/setup.sh` names it: `$COTRAIN_CACHE`, else
/// `$XDG_CACHE_HOME/cotrain`, else `~/.cache/cotrain`.
pub fn cache_dir() -> Option<PathBuf> {
    let var = |k: &str| {
        std::env::var_os(k)
            .filter(|v| !v.is_empty())
            .map(PathBuf::from)
    };
    var("COTRAIN_CACHE")
        .or_else(|| var("XDG_CACHE_HOME").map(|d| d.join("cotrain")))
        .or_else(|| var("HOME").map(|d| d.join(".cache/cotrain")))
}

/// The decision under switch value `mode`, pinned in `cache` (none: measured, not pinned).
fn decide(kind: Kind, mode: &str, cache: Option<&Path>) -> Decision {
    let fixed = |own: bool, reason: String| Decision {
        own_kernels: own,
        reason,
        probe_us: None,
    };
    #[cfg(not(target_arch = "x86_64"))]
    return fixed(false, "not an x86-64 CPU".into());
    #[cfg(target_arch = "x86_64")]
    {
        if !super::gemm_f32::is_available() {
            return fixed(false, "the CPU lacks AVX-512F".into());
        }
        let remeasure = match mode.trim().to_ascii_lowercase().as_str() {
            "" | "auto" => false,
            "probe" => true,
            "on" | "1" | "true" => return fixed(true, format!("{ENV}={mode}")),
            "off" | "0" | "false" => return fixed(false, format!("{ENV}={mode}")),
            _ => {
                tracing::warn!("{ENV}={mode} is not auto, on, off or probe: deciding as auto");
                false
            }
        };
        let key = pin_key(kind);
        let measured = |how: &str| {
            let (ours, theirs) = probe(kind);
            let d = Decision {
                own_kernels: ours <= theirs,
                reason: format!("{how}: cotrain's kernel {ours:.0} µs, libtorch {theirs:.0} µs"),
                probe_us: Some((ours, theirs)),
            };
            (
                d,
                Pinned {
                    own_kernels: ours <= theirs,
                    kernel_us: ours,
                    libtorch_us: theirs,
                },
            )
        };
        let Some(dir) = cache else {
            return measured("measured (no cache directory to pin it in)").0;
        };
        match pin::with_lock(dir, &key, |pins| {
            if !remeasure && let Some(p) = pins.get(&key) {
                return (p.decision(&key), None);
            }
            let (d, p) = measured(if remeasure {
                "measured again"
            } else {
                "measured on this CPU's first use"
            });
            (d, Some(p))
        }) {
            Ok(d) => d,
            Err(e) => {
                tracing::warn!(
                    "cannot pin the CPU kernel decision in {}: {e}",
                    dir.display()
                );
                measured("measured (not pinned)").0
            }
        }
    }
}

/// The pin's key: the CPU's identity, the thread count, the dtype, the kernels' revision and the
/// build (a debug build's kernels are compiled with fewer optimisations than a release build's).
fn pin_key(kind: Kind) -> String {
    format!(
        "{} | {} threads | {kind:?} | kernels r{KERNEL_REVISION} | {} build",
        crate::cpu::identity(),
        tch::get_num_threads().max(1),
        if cfg!(debug_assertions) {
            "debug"
        } else {
            "release"
        }
    )
}

/// A pinned answer as stored.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
struct Pinned {
    own_kernels: bool,
    kernel_us: f64,
    libtorch_us: f64,
}

impl Pinned {
    fn decision(&self, key: &str) -> Decision {
        Decision {
            own_kernels: self.own_kernels,
            reason: format!(
                "pinned for `{key}`: cotrain's kernel {:.0} µs, libtorch {:.0} µs when measured",
                self.kernel_us, self.libtorch_us
            ),
            probe_us: Some((self.kernel_us, self.libtorch_us)),
        }
    }
}

/// The pin file, read and written under an exclusive lock.
mod pin {
    use std::io::Write;
    use std::os::fd::AsRawFd;

    use super::*;

    const FILE: &str = "cpu-dispatch.json";

    /// Runs `f` on the pins while holding `dir/cpu-dispatch.lock`; what `f` returns to pin is
    /// stored under `key` before the lock is released.
    pub(super) fn with_lock(
        dir: &Path,
        key: &str,
        f: impl FnOnce(&BTreeMap<String, Pinned>) -> (Decision, Option<Pinned>),
    ) -> std::io::Result<Decision> {
        std::fs::create_dir_all(dir)?;
        let lock = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(dir.join("cpu-dispatch.lock"))?;
        // SAFETY: flock on a descriptor this function owns; released when `lock` is closed.
        if unsafe { libc::flock(lock.as_raw_fd(), libc::LOCK_EX) } != 0 {
            return Err(std::io::Error::last_os_error());
        }
        let path = dir.join(FILE);
        // A missing or unreadable file is an empty one: the answer is measured and written anew.
        let mut pins: BTreeMap<String, Pinned> = std::fs::read(&path)
            .ok()
            .and_then(|b| serde_json::from_slice(&b).ok())
            .unwrap_or_default();
        let (decision, new) = f(&pins);
        if let Some(p) = new {
            pins.insert(key.to_string(), p);
            let tmp = dir.join(format!("{FILE}.tmp-{}", std::process::id()));
            let mut file = std::fs::File::create(&tmp)?;
            file.write_all(&serde_json::to_vec_pretty(&pins).map_err(std::io::Error::other)?)?;
            file.sync_all()?;
            std::fs::rename(&tmp, &path)?;
        }
        drop(lock);
        Ok(decision)
    }
}

/// Summed medians (µs) over the probe's row counts: cotrain's kernel, libtorch's route, for
/// weights of `kind`. The weights are decoder layers of the default model's shapes (SmolLM2-135M:
/// q, k, v, o, gate, up, down of a 576-wide model with 192-wide k/v and a 1536-wide MLP), 42 MB of
/// them: a step's mix of large and small products, each call's own overhead included, which a
/// probe of a few large matrices misses (libtorch's bf16 route measured even with the kernel on
/// such matrices and 1.3–2× slower on the model's), each route as the fused decode step calls it.
/// Deterministic inputs: the probe must not draw from libtorch's generator.
#[cfg(target_arch = "x86_64")]
pub fn probe(kind: Kind) -> (f64, f64) {
    let _guard = tch::no_grad_guard();
    const LAYER: [(i64, i64); 7] = [
        (576, 576),
        (192, 576),
        (192, 576),
        (576, 576),
        (1536, 576),
        (1536, 576),
        (576, 1536),
    ];
    // 14.2 MB per layer in f32: 3 layers in f32, 6 in bf16, more than the L3 caches of the CPUs
    // this runs on, so the weights stream from memory as a model's do.
    let layers = if kind == Kind::Float { 3 } else { 6 };
    let weights: Vec<Tensor> = (0..layers)
        .flat_map(|_| LAYER)
        .enumerate()
        .map(|(i, (n, k))| {
            let w = (Tensor::arange(n * k, (Kind::Float, Device::Cpu)) * (0.37 + 0.01 * i as f64))
                .sin()
                .reshape([n, k])
                * 0.05;
            w.to_kind(kind)
        })
        .collect();
    let time = |f: &mut dyn FnMut()| {
        let s = Instant::now();
        f();
        s.elapsed().as_secs_f64() * 1e6
    };
    let median = |mut t: Vec<f64>| {
        t.sort_by(f64::total_cmp);
        t[t.len() / 2]
    };
    let (mut ours, mut theirs) = (0.0, 0.0);
    for m in [1i64, 8, 32] {
        // Both routes as the fused decode step runs them: f32 rows on flat buffers in and out.
        let m = m as usize;
        let x: Vec<f32> = (0..m * 1536).map(|i| (i as f32 * 0.11).cos()).collect();
        let (mut out_k, mut out_l) = (vec![0f32; m * 1536], vec![0f32; m * 1536]);
        let threads = tch::get_num_threads().max(1) as usize;
        let mut kernel = || {
            for w in &weights {
                let (n, k) = (w.size()[0] as usize, w.size()[1] as usize);
                // SAFETY: a contiguous CPU tensor of n·k elements of its kind, read-only here.
                unsafe {
                    match kind {
                        Kind::BFloat16 => super::gemm_f32::matmul_nt(
                            &x[..m * k],
                            std::slice::from_raw_parts(w.data_ptr() as *const half::bf16, n * k),
                            &mut out_k,
                            m,
                            n,
                            k,
                            threads,
                        ),
                        _ => super::gemm_f32::matmul_nt(
                            &x[..m * k],
                            std::slice::from_raw_parts(w.data_ptr() as *const f32, n * k),
                            &mut out_k,
                            m,
                            n,
                            k,
                            threads,
                        ),
                    }
                }
            }
        };
        let mut libtorch = || {
            for w in &weights {
                super::libtorch_route::libtorch_product_into(&x, m, w, None, &mut out_l);
            }
        };
        kernel();
        libtorch();
        let (mut a, mut b) = (Vec::new(), Vec::new());
        for _ in 0..5 {
            a.push(time(&mut kernel));
            b.push(time(&mut libtorch));
        }
        ours += median(a);
        theirs += median(b);
    }
    (ours, theirs)
}

/// libtorch's rate (GFLOP/s) for a training-sized product in `kind` on the CPU, median of 5: a
/// (1024 × 576) · (576 × 1536) matmul, the shape of a projection over a batch of sequences. What
/// the learner compares bf16 against f32 with when a config asks for bf16 products, since some
/// CPUs with `avx512_bf16` run libtorch's bf16 matmuls slower than its f32 ones.
pub fn product_gflops(kind: Kind) -> f64 {
    let _guard = tch::no_grad_guard();
    let (m, k, n) = (1024i64, 576i64, 1536i64);
    let a = ((Tensor::arange(m * k, (Kind::Float, Device::Cpu)) * 0.13)
        .sin()
        .reshape([m, k]))
    .to_kind(kind);
    let b = ((Tensor::arange(n * k, (Kind::Float, Device::Cpu)) * 0.29)
        .cos()
        .reshape([n, k]))
    .to_kind(kind);
    let _ = a.linear::<Tensor>(&b, None);
    let mut t: Vec<f64> = (0..5)
        .map(|_| {
            let s = Instant::now();
            let _ = std::hint::black_box(a.linear::<Tensor>(&b, None));
            s.elapsed().as_secs_f64()
        })
        .collect();
    t.sort_by(f64::total_cmp);
    2.0 * (m * k * n) as f64 / t[2] / 1e9
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_decision_is_explained_and_forced_modes_measure_nothing() {
        for kind in [Kind::Float, Kind::BFloat16] {
            let d = decision(kind);
            assert!(!d.reason.is_empty());
            if let Some((ours, theirs)) = d.probe_us {
                assert!(ours > 0.0 && theirs > 0.0, "{d:?}");
            }
            assert_eq!(own_kernels(kind), d.own_kernels);
        }
        assert!(!own_kernels(Kind::Half));
        let dir = tempfile::tempdir().unwrap();
        for (mode, own) in [("on", true), ("off", false)] {
            let d = decide(Kind::Float, mode, Some(dir.path()));
            if super::super::gemm_f32::is_available() {
                assert_eq!(d.own_kernels, own, "{d:?}");
                assert!(d.probe_us.is_none());
            }
        }
        assert!(
            !dir.path().join("cpu-dispatch.json").exists(),
            "forced modes pin nothing"
        );
    }

    /// The first decision is measured and pinned; later ones read the pin (even one that says the
    /// opposite of what a measurement would, which is how a pin is told from a new measurement),
    /// and `probe` measures again and re-pins.
    #[test]
    fn the_first_measurement_is_pinned_and_read_back() {
        if !super::super::gemm_f32::is_available() {
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        let first = decide(Kind::BFloat16, "auto", Some(dir.path()));
        assert!(
            first.reason.starts_with("measured on this CPU's first use"),
            "{first:?}"
        );
        let path = dir.path().join("cpu-dispatch.json");
        let mut pins: BTreeMap<String, Pinned> =
            serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
        let key = pin_key(Kind::BFloat16);
        assert_eq!(pins[&key].own_kernels, first.own_kernels);
        pins.get_mut(&key).unwrap().own_kernels = !first.own_kernels;
        std::fs::write(&path, serde_json::to_vec(&pins).unwrap()).unwrap();
        let again = decide(Kind::BFloat16, "", Some(dir.path()));
        assert_eq!(again.own_kernels, !first.own_kernels, "{again:?}");
        assert!(again.reason.starts_with("pinned for"), "{again:?}");
        let remeasured = decide(Kind::BFloat16, "probe", Some(dir.path()));
        assert!(
            remeasured.reason.starts_with("measured again"),
            "{remeasured:?}"
        );
        let pins: BTreeMap<String, Pinned> =
            serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
        assert_eq!(pins[&key].own_kernels, remeasured.own_kernels);
        eprintln!("{first:?}\n{remeasured:?}");
    }
}
