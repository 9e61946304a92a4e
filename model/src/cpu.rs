//! What the CPU is and what it does, for benchmark headers and kernel dispatch: its name and
//! family from /proc/cpuinfo, its AVX-512 subsets, and whether it runs 512-bit FMAs at full width
//! (twice the 256-bit rate: Intel server cores, AMD Zen 5) or as two 256-bit halves (AMD Zen 4),
//! measured by a micro-benchmark rather than guessed from the name.

use std::time::Instant;

/// How the CPU executes 512-bit vector FMAs.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Avx512Width {
    /// About twice the 256-bit rate.
    Full,
    /// About the 256-bit rate: two 256-bit halves per instruction.
    Split,
}

/// See the module docs.
#[derive(Clone, Debug)]
pub struct CpuFacts {
    pub model_name: String,
    pub family: Option<u32>,
    pub model: Option<u32>,
    pub avx512f: bool,
    pub avx512_bf16: bool,
    /// Measured, when the CPU has AVX-512F: the 512-bit FMA rate over the 256-bit one (FLOP/s).
    pub fma512_over_256: Option<f64>,
}

impl CpuFacts {
    /// Reads /proc/cpuinfo and measures the FMA widths (about 20 ms).
    pub fn probe() -> Self {
        let info = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
        let field = |key: &str| cpuinfo_field(&info, key);
        let flags = field("flags").unwrap_or_default();
        let has = |f: &str| flags.split_whitespace().any(|x| x == f);
        let avx512f = has("avx512f");
        Self {
            model_name: field("model name").unwrap_or_else(|| "unknown CPU".into()),
            family: field("cpu family").and_then(|v| v.parse().ok()),
            model: field("model").and_then(|v| v.parse().ok()),
            avx512f,
            avx512_bf16: has("avx512_bf16"),
            fma512_over_256: if avx512f { fma_ratio() } else { None },
        }
    }

    /// Full or split, from the measured ratio (above 1.5: full).
    pub fn avx512_width(&self) -> Option<Avx512Width> {
        self.fma512_over_256.map(|r| {
            if r > 1.5 {
                Avx512Width::Full
            } else {
                Avx512Width::Split
            }
        })
    }

    /// One line for benchmark headers: `AMD EPYC (family 26, model 2); AVX-512 full width (512-bit
    /// FMA 1.97x the 256-bit rate), avx512_bf16`.
    pub fn summary(&self) -> String {
        let num = |v: Option<u32>| v.map_or("?".to_string(), |v| v.to_string());
        let avx = match (self.avx512f, self.fma512_over_256) {
            (false, _) => "no AVX-512".to_string(),
            (true, Some(r)) => format!(
                "AVX-512 {} (512-bit FMA {r:.2}x the 256-bit rate)",
                if r > 1.5 {
                    "full width"
                } else {
                    "split into 256-bit halves"
                }
            ),
            (true, None) => "AVX-512 (width not measured)".to_string(),
        };
        let bf16 = if self.avx512_bf16 {
            ", avx512_bf16"
        } else {
            ""
        };
        format!(
            "{} (family {}, model {}); {avx}{bf16}",
            self.model_name,
            num(self.family),
            num(self.model)
        )
    }
}

/// The machine's limits as libtorch sees them now, with the calling thread's libtorch thread count:
/// what every benchmark prints beside its figures (`roofline: ...`), since they vary with the CPU and
/// with the machine's load.
#[derive(Clone, Copy, Debug)]
pub struct Roofline {
    /// Read bandwidth (a 1 GiB f32 `sum`), bytes/s.
    pub read_bytes_per_s: f64,
    /// f32 and bf16 matmul rates (2048³ `matmul`; 256³ for a kind that would take more than 3 s
    /// there), FLOP/s.
    pub f32_flops: f64,
    pub bf16_flops: f64,
    pub threads: i32,
}

impl Roofline {
    /// Measures the three rates (about a second).
    pub fn measure() -> Self {
        use tch::{Device, Kind, Tensor};
        let _guard = tch::no_grad_guard();
        let big = Tensor::ones([256 << 20], (Kind::Float, Device::Cpu));
        let _ = big.sum(Kind::Float).double_value(&[]);
        let t = Instant::now();
        for _ in 0..5 {
            let _ = big.sum(Kind::Float).double_value(&[]);
        }
        let read_bytes_per_s = 5.0 * 4.0 * (256u64 << 20) as f64 / t.elapsed().as_secs_f64();
        drop(big);
        let timed = |kind: Kind, n: i64, reps: usize| {
            let a = Tensor::ones([n, n], (Kind::Float, Device::Cpu)).to_kind(kind);
            let _ = a.matmul(&a);
            let t = Instant::now();
            for _ in 0..reps {
                let _ = std::hint::black_box(a.matmul(&a));
            }
            reps as f64 * 2.0 * (n as f64).powi(3) / t.elapsed().as_secs_f64()
        };
        // A 256³ probe first: where the CPU lacks a kind (bf16 without AVX512_BF16 or AMX, e.g. Zen 3)
        // libtorch runs a scalar fallback that would take minutes at 2048³ (it took 10 min here).
        let rate = |kind: Kind| {
            let probe = timed(kind, 256, 1);
            let full_seconds = 5.0 * 2.0 * 2048f64.powi(3) / probe;
            if full_seconds > 3.0 {
                probe
            } else {
                timed(kind, 2048, 5)
            }
        };
        Roofline {
            read_bytes_per_s,
            f32_flops: rate(Kind::Float),
            bf16_flops: rate(Kind::BFloat16),
            threads: tch::get_num_threads(),
        }
    }

    /// `read 33.3 GB/s, matmul f32 221 GFLOP/s, bf16 480 GFLOP/s (libtorch, 2 threads)`.
    pub fn summary(&self) -> String {
        format!(
            "read {:.1} GB/s, matmul f32 {:.0} GFLOP/s, bf16 {:.0} GFLOP/s (libtorch, {} threads)",
            self.read_bytes_per_s / 1e9,
            self.f32_flops / 1e9,
            self.bf16_flops / 1e9,
            self.threads
        )
    }
}

/// The CPU's identity as /proc/cpuinfo gives it, without measuring anything: `AMD EPYC (family
/// 25, model 17, stepping 1)`; what the kernels' dispatch pins its measured answers to.
pub fn identity() -> String {
    let info = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let field = |key: &str| cpuinfo_field(&info, key).unwrap_or_else(|| "?".into());
    format!(
        "{} (family {}, model {}, stepping {})",
        field("model name"),
        field("cpu family"),
        field("model"),
        field("stepping")
    )
}

/// The value of the first `key : value` line of /proc/cpuinfo's text `info` (the first CPU's).
fn cpuinfo_field(info: &str, key: &str) -> Option<String> {
    info.lines()
        .find(|l| l.split(':').next().is_some_and(|k| k.trim() == key))
        .and_then(|l| l.split_once(':'))
        .map(|(_, v)| v.trim().to_string())
}

/// The 512-bit over the 256-bit FMA rate on this thread, best of a few rounds.
#[cfg(target_arch = "x86_64")]
fn fma_ratio() -> Option<f64> {
    if !(is_x86_feature_detected!("avx512f")
        && is_x86_feature_detected!("avx2")
        && is_x86_feature_detected!("fma"))
    {
        return None;
    }
    const ITERS: usize = 200_000;
    let mut best = (f64::MAX, f64::MAX);
    for _ in 0..5 {
        let t = Instant::now();
        // SAFETY: the CPU has AVX-512F (checked above).
        std::hint::black_box(unsafe { fma512(ITERS) });
        let t512 = t.elapsed().as_secs_f64();
        let t = Instant::now();
        // SAFETY: the CPU has AVX2 and FMA (checked above).
        std::hint::black_box(unsafe { fma256(ITERS) });
        let t256 = t.elapsed().as_secs_f64();
        best = (best.0.min(t512), best.1.min(t256));
    }
    // Each loop does the same number of instructions; a 512-bit one does twice the FLOPs.
    Some(2.0 * best.1 / best.0)
}

#[cfg(not(target_arch = "x86_64"))]
fn fma_ratio() -> Option<f64> {
    None
}

/// Eight independent FMA chains (enough to cover the latency of two FMA pipes) of 512-bit vectors.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn fma512(iters: usize) -> f32 {
    use std::arch::x86_64::*;
    let m = _mm512_set1_ps(0.999_999);
    let c = _mm512_set1_ps(1e-7);
    let mut acc = [_mm512_set1_ps(1.0); 8];
    for _ in 0..iters {
        for a in acc.iter_mut() {
            *a = _mm512_fmadd_ps(*a, m, c);
        }
    }
    let mut s = _mm512_setzero_ps();
    for a in acc {
        s = _mm512_add_ps(s, a);
    }
    _mm512_reduce_add_ps(s)
}

/// As [`fma512`], with 256-bit vectors.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn fma256(iters: usize) -> f32 {
    use std::arch::x86_64::*;
    let m = _mm256_set1_ps(0.999_999);
    let c = _mm256_set1_ps(1e-7);
    let mut acc = [_mm256_set1_ps(1.0); 8];
    for _ in 0..iters {
        for a in acc.iter_mut() {
            *a = _mm256_fmadd_ps(*a, m, c);
        }
    }
    let mut s = _mm256_setzero_ps();
    for a in acc {
        s = _mm256_add_ps(s, a);
    }
    let mut out = [0f32; 8];
    // SAFETY: `out` holds 8 f32, the 32 bytes the store writes.
    unsafe { _mm256_storeu_ps(out.as_mut_ptr(), s) };
    out.iter().sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn facts_read_and_the_width_is_measured_where_there_is_avx512() {
        let f = CpuFacts::probe();
        assert!(!f.model_name.is_empty());
        if f.avx512f {
            let r = f.fma512_over_256.expect("measured");
            // One 512-bit FMA does the work of one or two 256-bit ones.
            assert!((0.6..2.6).contains(&r), "ratio {r}");
        }
        assert!(f.summary().contains("family"), "{}", f.summary());
    }
}
