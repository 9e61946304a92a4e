//! `y = x · wᵀ` for a few rows of f32 `x`, with AVX-512 dot products over `w`'s rows (many rows:
//! broadcasts, [`super::gemm_broadcast`]), in f32
//! arithmetic whatever the weights' element type ([`Elem`]: f32, or bf16 widened as it is loaded,
//! which halves the bytes streamed per decode step).
//!
//! `w` is a weight stored (N, K) row-major, so each output `y[j, i]` is the dot product of two
//! contiguous K-vectors: no packing is needed. A tile holds [`NR`] weight rows × up to [`MR`] input
//! rows in `NR · MR` zmm accumulators, runs along K sixteen floats at a time (the last step
//! masked), and folds the accumulators into `NR` sums per input row at the end. Each thread walks
//! its share of the weight rows once, one `NR`-row block at a time, and runs every input-row
//! block against that block while it is in L1; the inputs stay in L2. The weights thus stream from
//! memory once per call, which is what bounds decoding.
//!
//! Measured over SmolLM2-135M's 211 weight matrices (538 MB), ms per decode step, best of 9
//! interleaved runs, 2 threads, on the 2-core Zen 4 development machine (`examples/bench_linear`;
//! the machine is shared and noisy):
//!
//! | rows                                        |    1 |    2 |    8 |   16 |   32 |    64 |
//! | ---                                         | ---: | ---: | ---: | ---: | ---: |  ---: |
//! | libtorch 2.13 / MKL, best route             | 16.4 | 15.3 | 31.6 | 46.4 | 68.2 | 108.7 |
//! | oneDNN `mkldnn_linear`, weight pre-converted | 21.2 | 24.2 | 27.0 | 31.6 | 43.3 |  65.9 |
//! | this kernel                                 | 13.2 | 14.6 | 17.2 | 20.5 | 31.1 |  51.0 |
//! | earlier: 6-row tiles (spilling)             | 13.5 | 14.5 | 16.9 | 33.8 | 48.9 |  82.7 |
//! | earlier: 6-row tiles, no prefetch           | 14.1 | 15.2 | 23.2 | 37.8 | 54.3 |  88.2 |
//!
//! Up to 8 rows that is the weights' streaming time; at 64 rows it is 340 GFLOP/s. oneDNN's
//! `mkldnn_linear` is the only oneDNN linear tch reaches (the weight converted to its layout once, the
//! input per call). End to end (`examples/bench_generate`, 128 tokens) decoding went from 49–50 to
//! 61–63 tokens/s at batch 1, 144–160 to 324–331 at batch 8 and 235–306 to 571–578 at batch 32.
//!
//! Since MKL takes its AVX-512 path here ([`crate::mkl_dispatch`]) its large matmuls run at 470–500
//! GFLOP/s, but not these shapes: a later run (quieter machine) gave 20.6 / 21.5 / 19.6 / 21.3 / 59.9 /
//! 61.1 ms for the libtorch route against 9.9 / 11.2 / 12.7 / 20.0 / 29.5 / 48.3 ms for this kernel at
//! 1 / 2 / 8 / 16 / 32 / 64 rows. The dot-product tiles top out near 300 GFLOP/s even with the
//! weights in cache (8×2 tiles measured the same as 4×4), and near 125 GFLOP/s on split AVX-512
//! units (Zen 4), where their horizontal sums and input reloads cost as much as the multiply-adds
//! they feed. From [`BROADCAST_MIN_ROWS`] input rows the product therefore takes
//! [`super::gemm_broadcast`] instead (inputs transposed, weights broadcast, no horizontal sums): on
//! Zen 4 that is 24.8 against 29.5 ms per decode step at 8 rows, 47–49 against 70–72 at 32.
//!
//! On the split-AVX-512 Zen 4 (AMD EPYC family 25, model 17; 32 KB L1) the tiles' prefetches into
//! L1 evicted lines before their loads; prefetched into L2 instead, the decode step's products took
//! 14.4 / 14.4 / 22.4 / 27.7 / 45.4 ms at 1 / 4 / 8 / 16 / 32 rows (2 threads; 22.0 / 24.1 / 26.3 /
//! 27.0 / 45.5 before) and 25.5–26.4 ms at 4 rows on one thread (41.7–43.4 before): about 21 GB/s
//! from one core, against 13 before. The dot-product tiles then beat the broadcasts up to 8 rows.
//!
//! Threads come from libtorch's own OpenMP team (`GOMP_parallel`, found at run time): the team
//! spin-waits after each of libtorch's parallel regions, so a thread of our own would compete with
//! it for the two cores (not measured), while reusing the team wakes threads already spinning.

use std::arch::x86_64::*;
use std::ffi::{c_uint, c_void};
use std::sync::OnceLock;
use std::sync::atomic::{AtomicUsize, Ordering};

use super::elem::Elem;
use super::omp::{OmpGetThreadNum, gomp};

/// Weight rows per tile.
const NR: usize = 4;
/// Input rows per tile: `NR · MR` accumulators, `NR` weight vectors and one input vector would
/// fit 6 rows into the 32 zmm registers, but LLVM then spills accumulators inside the loop (18
/// stack accesses per 24 FMAs at 6 rows, 10 at 5, none at 4).
const MR: usize = 4;

/// Input rows from which [`matmul_nt`] transposes the inputs and broadcasts the weights
/// ([`super::gemm_broadcast`]) instead of running dot-product tiles, for f32 and bf16 weights, unless
/// [`set_broadcast_min_rows`] changed them. Measured over the default model's 211 matrices on Zen 4
/// (`examples/bench_linear`, 2 threads, ms per decode step, broadcast against dot tiles, since the
/// tiles prefetch into L2): f32 26.0 against 22.4 at 8 rows, 26.4 against 28.4 at 12, 27.7 against
/// 38.0 at 16, 45.4 against 59.4 at 32; bf16 27.8 against 25.2 at 16 rows, 45.9 against 35.3 at 24,
/// 48.0 against 45.9 at 32, 89.5 against 85.9 at 64 (widening each tile's rows to f32 costs what the
/// halved bytes save; near a tie from 32 rows).
///
/// `COTRAIN_BROADCAST_MIN_ROWS` (a row count for both dtypes, or `off`) overrides them. The two paths
/// add in different orders, so a seeded sampled run may end elsewhere on one than on the other.
pub const BROADCAST_MIN_ROWS: [usize; 2] = [12, 32];

/// The environment override of [`BROADCAST_MIN_ROWS`].
pub const BROADCAST_ENV: &str = "COTRAIN_BROADCAST_MIN_ROWS";

static BROADCAST_FROM: [AtomicUsize; 2] = [
    AtomicUsize::new(BROADCAST_MIN_ROWS[0]),
    AtomicUsize::new(BROADCAST_MIN_ROWS[1]),
];

/// Moves the row counts (f32, bf16 weights) from which the broadcast path runs (`usize::MAX`:
/// never), process-wide, so that benchmarks and tests can run both paths on the same shapes.
/// Either path computes the same products up to the order of the additions.
pub fn set_broadcast_min_rows(rows: [usize; 2]) {
    read_env();
    for (slot, r) in BROADCAST_FROM.iter().zip(rows) {
        slot.store(r, Ordering::Relaxed);
    }
}

/// Applies [`BROADCAST_ENV`] once per process, before the first product.
fn read_env() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let Ok(v) = std::env::var(BROADCAST_ENV) else {
            return;
        };
        let rows = match v.trim() {
            "off" => usize::MAX,
            n => match n.parse() {
                Ok(r) => r,
                Err(_) => {
                    tracing::warn!("{BROADCAST_ENV}={v} is neither a row count nor `off`; ignored");
                    return;
                }
            },
        };
        for slot in &BROADCAST_FROM {
            slot.store(rows, Ordering::Relaxed);
        }
    });
}

/// Whether [`matmul_nt`] can run here (the CPU has AVX-512F).
pub fn is_available() -> bool {
    static AVAILABLE: OnceLock<bool> = OnceLock::new();
    *AVAILABLE.get_or_init(|| is_x86_feature_detected!("avx512f"))
}

/// `y = x · wᵀ` for `x` (m, k), `w` (n, k) and `y` (m, n), all row-major and contiguous, on up to
/// `threads` threads.
///
/// # Panics
/// If AVX-512F is missing ([`is_available`]) or a slice is shorter than its shape says.
pub fn matmul_nt<W: Elem>(
    x: &[f32],
    w: &[W],
    y: &mut [f32],
    m: usize,
    n: usize,
    k: usize,
    threads: usize,
) {
    let bf16_dot = matches!(W::KIND, tch::Kind::BFloat16) && super::gemm_bf16dot::applies(k);
    matmul_nt_on(x, w, y, m, n, k, threads, bf16_dot);
}

/// As [`matmul_nt`] for bf16 weights, always on the AVX512_BF16 path ([`super::gemm_bf16dot`]: the
/// rows rounded to bf16) whether or not the option is on, for benchmarks and tests of that path.
///
/// # Panics
/// If the CPU lacks AVX512_BF16 ([`super::gemm_bf16dot::is_available`]), `k` is odd, or as
/// [`matmul_nt`].
#[allow(clippy::too_many_arguments)]
pub fn matmul_nt_bf16_dot(
    x: &[f32],
    w: &[half::bf16],
    y: &mut [f32],
    m: usize,
    n: usize,
    k: usize,
    threads: usize,
) {
    assert!(
        super::gemm_bf16dot::is_available(),
        "matmul_nt_bf16_dot needs avx512_bf16"
    );
    assert!(
        k.is_multiple_of(2),
        "matmul_nt_bf16_dot needs an even width, got {k}"
    );
    matmul_nt_on(x, w, y, m, n, k, threads, true);
}

/// [`matmul_nt`] with the AVX512_BF16 path chosen by the caller (`bf16_dot`: bf16 weights, even
/// `k`, a CPU that has it).
#[allow(clippy::too_many_arguments)]
fn matmul_nt_on<W: Elem>(
    x: &[f32],
    w: &[W],
    y: &mut [f32],
    m: usize,
    n: usize,
    k: usize,
    threads: usize,
    bf16_dot: bool,
) {
    assert!(is_available(), "matmul_nt needs avx512f");
    assert!(
        x.len() >= m * k && w.len() >= n * k && y.len() >= m * n,
        "matmul_nt: slices shorter than their shapes"
    );
    if m == 0 || n == 0 {
        return;
    }
    let job = Job {
        x: x.as_ptr(),
        w: w.as_ptr(),
        y: y.as_mut_ptr(),
        m,
        n,
        k,
        bf16_dot,
    };
    let blocks = n.div_ceil(job.block());
    // Below a few hundred kFLOP a second thread costs more to wake than it saves.
    let threads = if 2 * m * n * k < 1 << 18 {
        1
    } else {
        threads.clamp(1, blocks)
    };
    match gomp() {
        Some(g) if threads > 1 => {
            let data = GompData {
                job: &job,
                omp_get_thread_num: g.thread_num,
                omp_get_num_threads: g.num_threads,
                threads,
            };
            // SAFETY: `GOMP_parallel` runs `gomp_part` on `threads` threads of libgomp's team and
            // returns once all have finished, so `data` (and the slices behind `job`) outlive every
            // use; the parts write disjoint column ranges of `y`.
            unsafe {
                (g.parallel)(
                    gomp_part::<W>,
                    (&raw const data).cast_mut().cast(),
                    threads as c_uint,
                    0,
                )
            };
        }
        // SAFETY: the asserts above bound every index `run` touches; AVX-512F is present.
        _ => unsafe { job.run(0, n) },
    }
}

/// The shapes and buffers of one call, shared by the threads.
struct Job<W> {
    x: *const f32,
    w: *const W,
    y: *mut f32,
    m: usize,
    n: usize,
    k: usize,
    /// bf16 weights on the AVX512_BF16 path, decided once by the calling thread.
    bf16_dot: bool,
}

impl<W: Elem> Job<W> {
    /// Whether this product takes the broadcast path.
    fn broadcast(&self) -> bool {
        let slot = usize::from(!matches!(W::KIND, tch::Kind::Float));
        read_env();
        self.m >= BROADCAST_FROM[slot].load(Ordering::Relaxed)
    }

    /// Weight rows per unit of work: threads split the weights in whole blocks.
    fn block(&self) -> usize {
        if self.bf16_dot {
            super::gemm_bf16dot::block(self.m)
        } else if self.broadcast() {
            super::gemm_broadcast::BLOCK
        } else {
            NR
        }
    }

    /// Weight rows `[n_lo, n_hi)`, by the path [`Self::block`] chose.
    ///
    /// # Safety
    /// As for [`run`].
    #[target_feature(enable = "avx512f")]
    unsafe fn run(&self, n_lo: usize, n_hi: usize) {
        // SAFETY: forwarded from this function's contract.
        unsafe {
            if self.bf16_dot {
                // `bf16_dot` is only set for bf16 weights of even width on a CPU with AVX512_BF16
                // (`matmul_nt`, `matmul_nt_bf16_dot`).
                super::gemm_bf16dot::run(
                    self.x,
                    self.w.cast(),
                    self.y,
                    self.m,
                    self.n,
                    self.k,
                    n_lo,
                    n_hi,
                )
            } else if self.broadcast() {
                super::gemm_broadcast::run(
                    self.x, self.w, self.y, self.m, self.n, self.k, n_lo, n_hi,
                )
            } else {
                run(self, n_lo, n_hi)
            }
        }
    }
}

/// Weight rows `[n_lo, n_hi)` of `job`: every output column in that range, for every input row.
///
/// # Safety
/// `job`'s pointers must cover its shapes, `n_hi <= job.n`, AVX-512F must be present, and no other
/// thread may write columns `[n_lo, n_hi)` of `y` meanwhile.
#[target_feature(enable = "avx512f")]
unsafe fn run<W: Elem>(job: &Job<W>, n_lo: usize, n_hi: usize) {
    let Job {
        x, w, y, m, n, k, ..
    } = *job;
    // Input rows split into tiles of nearly equal height (6 rows: 3 + 3, not 4 + 2).
    let tiles = m.div_ceil(MR);
    let mut n0 = n_lo;
    while n0 < n_hi {
        let nr = NR.min(n_hi - n0);
        let mut j0 = 0;
        for t in 0..tiles {
            let mr = (m - j0) / (tiles - t) + usize::from((m - j0) % (tiles - t) != 0);
            // The first tile of a block prefetches the block after next, so that the weights
            // stream from memory under the arithmetic rather than between it (one block ahead
            // measured slower at 8 rows, four ahead no better).
            let next = if t == 0 && n0 + 2 * NR < n_hi {
                w.wrapping_add((n0 + 2 * NR) * k)
            } else {
                std::ptr::null()
            };
            // SAFETY: rows `j0..j0 + mr <= m` of `x`, rows `n0..n0 + nr <= n` of `w` and that block
            // of `y` lie within the buffers the caller vouched for; `next` is only prefetched.
            unsafe {
                tile_dispatch(
                    nr,
                    mr,
                    x.add(j0 * k),
                    w.add(n0 * k),
                    next,
                    y.add(j0 * n + n0),
                    k,
                    n,
                )
            };
            j0 += mr;
        }
        n0 += nr;
    }
}

/// [`tile`] for a run-time `nr ≤ NR`, `mr ≤ MR`.
///
/// # Safety
/// As for [`tile`].
#[allow(clippy::too_many_arguments)] // a tile's pointers and strides; a struct would hide them
#[target_feature(enable = "avx512f")]
unsafe fn tile_dispatch<W: Elem>(
    nr: usize,
    mr: usize,
    x: *const f32,
    w: *const W,
    next: *const W,
    y: *mut f32,
    k: usize,
    ldy: usize,
) {
    macro_rules! by_mr {
        ($nr:literal) => {
            // SAFETY: forwarded from this function's contract.
            unsafe {
                match mr {
                    1 => tile::<W, $nr, 1>(x, w, next, y, k, ldy),
                    2 => tile::<W, $nr, 2>(x, w, next, y, k, ldy),
                    3 => tile::<W, $nr, 3>(x, w, next, y, k, ldy),
                    _ => tile::<W, $nr, 4>(x, w, next, y, k, ldy),
                }
            }
        };
    }
    match nr {
        1 => by_mr!(1),
        2 => by_mr!(2),
        3 => by_mr!(3),
        _ => by_mr!(4),
    }
}

/// `y[j, i] = x[j, ..] · w[i, ..]` for `i < R` weight rows and `j < C` input rows (`R ≤ 4`),
/// prefetching the `NR` rows at `next` unless it is null.
///
/// # Safety
/// `x` must hold `C` rows of `k` floats and `w` `R` rows of `k` elements, `y` `C` rows of stride `ldy` with `R`
/// writable floats each; AVX-512F must be present.
#[inline]
#[allow(clippy::needless_range_loop)] // register tiles read best as acc[i][j]
#[target_feature(enable = "avx512f")]
unsafe fn tile<W: Elem, const R: usize, const C: usize>(
    x: *const f32,
    w: *const W,
    next: *const W,
    y: *mut f32,
    k: usize,
    ldy: usize,
) {
    let mut acc = [[_mm512_setzero_ps(); C]; R];
    let whole = k - k % 16;
    let mut p = 0;
    while p < whole {
        // One prefetch per 64-byte line: every step for f32, every other step for bf16. Into L2,
        // not L1: the block after next lies 8 rows ahead, 18–48 KB for these widths, more than
        // Zen 4's 32 KB L1 holds, so T0 prefetches evicted lines before their loads and the
        // weights came from memory twice. On Zen 4, one core, 4 rows over the default model's
        // 211 matrices: 25.5–26.4 ms per decode step with T1 against 41.7–43.4 with T0 (f32).
        if !next.is_null() && (p * size_of::<W>()).is_multiple_of(64) {
            for i in 0..NR {
                // A prefetch never faults, so rows past the end of `w` are harmless.
                _mm_prefetch::<_MM_HINT_T1>(next.wrapping_add(i * k + p).cast());
            }
        }
        let mut wv = [_mm512_setzero_ps(); R];
        for (i, v) in wv.iter_mut().enumerate() {
            // SAFETY: `p + 16 <= k` elements of row `i < R` of `w`.
            *v = unsafe { W::load16(w.add(i * k + p)) };
        }
        for j in 0..C {
            // SAFETY: `p + 16 <= k` floats of row `j < C` of `x`.
            let xv = unsafe { _mm512_loadu_ps(x.add(j * k + p)) };
            for i in 0..R {
                acc[i][j] = _mm512_fmadd_ps(wv[i], xv, acc[i][j]);
            }
        }
        p += 16;
    }
    if p < k {
        let mask: __mmask16 = ((1u32 << (k - p)) - 1) as u16;
        let mut wv = [_mm512_setzero_ps(); R];
        for (i, v) in wv.iter_mut().enumerate() {
            // SAFETY: reads only the `k - p` elements left in row `i` of `w`.
            *v = unsafe { W::load_partial(w.add(i * k + p), k - p) };
        }
        for j in 0..C {
            // SAFETY: as above, for row `j` of `x`.
            let xv = unsafe { _mm512_maskz_loadu_ps(mask, x.add(j * k + p)) };
            for i in 0..R {
                acc[i][j] = _mm512_fmadd_ps(wv[i], xv, acc[i][j]);
            }
        }
    }
    let zero = _mm512_setzero_ps();
    for j in 0..C {
        let lane = |i: usize| if i < R { acc[i][j] } else { zero };
        let sums = super::elem::sum4(lane(0), lane(1), lane(2), lane(3));
        if R == 4 {
            // SAFETY: four writable floats at row `j` of `y`.
            unsafe { _mm_storeu_ps(y.add(j * ldy), sums) };
        } else {
            let mut out = [0f32; 4];
            // SAFETY: `out` holds four floats.
            unsafe { _mm_storeu_ps(out.as_mut_ptr(), sums) };
            for (i, &v) in out.iter().take(R).enumerate() {
                // SAFETY: `i < R` writable floats at row `j` of `y`.
                unsafe { *y.add(j * ldy + i) = v };
            }
        }
    }
}

/// What each thread of a `GOMP_parallel` region gets.
struct GompData<'a, W> {
    job: &'a Job<W>,
    omp_get_thread_num: OmpGetThreadNum,
    omp_get_num_threads: OmpGetThreadNum,
    threads: usize,
}

/// One thread's part: a contiguous share of the weight rows, in whole tiles.
extern "C" fn gomp_part<W: Elem>(data: *mut c_void) {
    // SAFETY: `matmul_nt` passes a `GompData` that outlives the parallel region.
    let data = unsafe { &*data.cast::<GompData<'_, W>>() };
    // SAFETY: called inside a parallel region, as libgomp requires.
    let (t, team) = unsafe { ((data.omp_get_thread_num)(), (data.omp_get_num_threads)()) };
    let (t, team) = (t.max(0) as usize, team.max(1) as usize);
    let block = data.job.block();
    let blocks = data.job.n.div_ceil(block);
    let share = |t: usize| (blocks * t / data.threads * block).min(data.job.n);
    // libgomp may give a smaller team than asked (OMP_THREAD_LIMIT, OMP_DYNAMIC, a nested region):
    // then a thread takes every `team`-th share, so that every column is still written.
    for part in (t..data.threads).step_by(team) {
        // SAFETY: shares of different parts are disjoint and within `n`, and each part runs on one
        // thread; `matmul_nt` checked AVX-512F and the buffers.
        unsafe { data.job.run(share(part), share(part + 1)) };
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;

    use super::*;

    struct Outer {
        x: Vec<f32>,
        w: Vec<f32>,
        y: Mutex<Vec<f32>>,
        shape: (usize, usize, usize),
        thread_num: OmpGetThreadNum,
    }

    /// Thread 0 of an outer region calls the kernel, whose own region is then nested and gets a
    /// team of one thread (libgomp runs nested regions serially by default).
    extern "C" fn outer(data: *mut c_void) {
        // SAFETY: the test passes an `Outer` that outlives the region.
        let o = unsafe { &*data.cast::<Outer>() };
        // SAFETY: inside a parallel region.
        if unsafe { (o.thread_num)() } == 0 {
            let (m, n, k) = o.shape;
            matmul_nt(&o.x, &o.w, &mut o.y.lock().unwrap(), m, n, k, 4);
        }
    }

    #[test]
    fn a_smaller_team_than_asked_still_writes_every_column() {
        let (true, Some(g)) = (is_available(), gomp()) else {
            eprintln!("skipped: no AVX-512F or no libgomp in this process");
            return;
        };
        // Large enough for the kernel to ask for several threads.
        let (m, n, k) = (4, 256, 256);
        let x: Vec<f32> = (0..m * k).map(|i| (i % 7) as f32 - 3.0).collect();
        let w: Vec<f32> = (0..n * k).map(|i| (i % 5) as f32 * 0.5).collect();
        let o = Outer {
            x,
            w,
            y: Mutex::new(vec![f32::NAN; m * n]),
            shape: (m, n, k),
            thread_num: g.thread_num,
        };
        // SAFETY: `outer` only reads `o`, which outlives the region.
        unsafe { (g.parallel)(outer, (&raw const o).cast_mut().cast(), 2, 0) };
        let y = o.y.into_inner().unwrap();
        for i in 0..m {
            for j in 0..n {
                let want: f32 = (0..k).map(|q| o.x[i * k + q] * o.w[j * k + q]).sum();
                assert_eq!(y[i * n + j], want, "row {i}, column {j}");
            }
        }
    }
}
