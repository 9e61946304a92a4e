//! The bf16-activation path of [`super::gemm_f32::matmul_nt`] for bf16 weights: `y = x · wᵀ` with
//! AVX512_BF16 dot products (`vdpbf16ps`), each of which multiplies 32 bf16 pairs and adds them into
//! 16 f32 sums: twice the multiply-adds per instruction of the f32 path, and no widening of the
//! weights. The price is that the input rows are rounded to bf16 (round to nearest even) before
//! each product, as libtorch's own bf16 decode rounds them; the products are exact and the sums
//! f32. It is therefore a named option, off unless asked for ([`set_enabled`]: the rollout worker's
//! `--bf16-dot-products`, the learner's `rollout.bf16_dot_products`), and only serves bf16 weights.
//!
//! Two layouts, as for f32 weights:
//! - up to [`BROADCAST_MIN_ROWS`] input rows, dot-product tiles ([`NR`] weight rows × up to
//!   [`MR`] input rows) walk each weight row in place 32 elements (one cache line) at a time against
//!   the rows rounded to bf16 once per call, and fold the sums horizontally at the end;
//! - from there on, the rounded inputs are transposed into bf16 pairs (`xp[q][i]` holds
//!   `x[i][2q]` and `x[i][2q + 1]`), and each weight pair is broadcast against 16 input rows
//!   ([`WROWS`] weight rows × 32 input rows per tile, as [`super::gemm_broadcast`]).
//!
//! Measured on Zen 4 (AMD EPYC family 25 model 17: split AVX-512, avx512_bf16) over the default
//! model's 211 matrices (`examples/bench_linear --no-mkldnn`, ms per decode step, 2 threads), against
//! the bf16-weight kernel with f32 rows: 9.7 / 10.9 / 17.4 / 23.6 / 24.5 against 9.8 / 13.6 / 25.1 /
//! 35.6 / 48.4 at 4 / 8 / 16 / 24 / 32 rows. Few rows stream the weights from memory either way
//! (one core, 4 rows: 14.2–14.7 ms both); from 8 rows on the products are bound by arithmetic, which
//! this path halves.

use std::arch::x86_64::*;
use std::cell::RefCell;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicBool, Ordering};

use half::bf16;

use super::gemm_broadcast::Prefetch;

/// Weight rows per dot-product tile.
const NR: usize = 4;
/// Input rows per dot-product tile (16 accumulators, four weight and one input vector).
const MR: usize = 4;
/// Blocks of [`NR`] weight rows ahead that a block's first tile prefetches, into L2 as the f32
/// tiles do (2, 4 and 8 measured alike on Zen 4, one core, 1 and 4 rows, with L1 prefetches).
const AHEAD: usize = 2;
/// Weight rows per broadcast tile (16 accumulators against two vectors of input pairs).
pub(crate) const WROWS: usize = 8;
/// Input rows from which the broadcast layout runs: on Zen 4 (2 threads, the default model's 211
/// matrices, ms per decode step, the tiles prefetching into L2) 10.9 ms at 8 rows on dot tiles
/// against 17.0 broadcast, and 17.2–17.4 broadcast at 12 rows against 18.4 for the f32-row tiles.
pub const BROADCAST_MIN_ROWS: usize = 12;

static ENABLED: AtomicBool = AtomicBool::new(false);

thread_local! {
    /// Each thread's rounded inputs: rows padded to a multiple of 32 (dot tiles), or pairs
    /// transposed (broadcast tiles), kept between calls.
    static INPUTS: RefCell<Vec<u32>> = const { RefCell::new(Vec::new()) };
}

/// Whether this CPU can run the path: AVX-512F, BW (masked 16-bit loads) and BF16.
pub fn is_available() -> bool {
    static AVAILABLE: OnceLock<bool> = OnceLock::new();
    *AVAILABLE.get_or_init(|| {
        is_x86_feature_detected!("avx512f")
            && is_x86_feature_detected!("avx512bw")
            && is_x86_feature_detected!("avx512bf16")
    })
}

/// Turns the path on or off for this process (bf16 weights only; see the module docs). Turning it
/// on where the CPU lacks AVX512_BF16 is refused with an error naming what is missing.
pub fn set_enabled(on: bool) -> Result<(), String> {
    if on && !is_available() {
        return Err(
            "bf16 dot products need a CPU with AVX512_BF16 (and AVX-512F/BW); this one has not"
                .into(),
        );
    }
    ENABLED.store(on, Ordering::Relaxed);
    Ok(())
}

/// Turns the path on for a model loaded as `kind` on `device`, as the option named `option` asks,
/// or says why it cannot: the path reads bf16 weights on a CPU with AVX512_BF16.
pub fn enable_for(kind: tch::Kind, device: tch::Device, option: &str) -> Result<(), String> {
    if kind != tch::Kind::BFloat16 {
        let name = match kind {
            tch::Kind::Float => "f32".to_string(),
            tch::Kind::Half => "f16".to_string(),
            other => format!("{other:?}"),
        };
        return Err(format!(
            "{option} applies to bf16 weights only, and the model is loaded as {name} (--dtype bf16, rollout.dtype: bf16)"
        ));
    }
    if device != tch::Device::Cpu {
        return Err(format!(
            "{option} is a CPU kernel; the model is on {device:?}"
        ));
    }
    set_enabled(true).map_err(|e| format!("{option}: {e}"))
}

/// Whether bf16-weight products take this path.
pub fn enabled() -> bool {
    ENABLED.load(Ordering::Relaxed)
}

/// Whether a product of `m` rows of width `k` takes this path (it needs an even `k`: pairs of
/// weights are read whole).
pub(crate) fn applies(k: usize) -> bool {
    enabled() && k.is_multiple_of(2)
}

/// Weight rows per unit of work when threads split a product of `m` rows.
pub(crate) fn block(m: usize) -> usize {
    if m >= BROADCAST_MIN_ROWS { WROWS } else { NR }
}

/// Weight rows `[n_lo, n_hi)` of `y = x · wᵀ` (`x` (m, k) f32, `w` (n, k) bf16, `y` (m, n),
/// row-major), `x` rounded to bf16.
///
/// # Safety
/// The pointers must cover those shapes, `n_hi <= n`, `k` even, the CPU must have what
/// [`is_available`] checks, and no other thread may write columns `[n_lo, n_hi)` of `y` meanwhile.
#[allow(clippy::too_many_arguments)] // the product's buffers and shapes, as `gemm_f32::Job` holds them
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
pub(crate) unsafe fn run(
    x: *const f32,
    w: *const bf16,
    y: *mut f32,
    m: usize,
    n: usize,
    k: usize,
    n_lo: usize,
    n_hi: usize,
) {
    let w = w.cast::<u16>();
    INPUTS.with_borrow_mut(|buf| {
        if m >= BROADCAST_MIN_ROWS {
            let mpad = m.div_ceil(16) * 16;
            let need = mpad * k / 2;
            if buf.len() < need {
                buf.resize(need, 0);
            }
            // SAFETY: `x` holds m rows of k floats, `buf` k/2 rows of `mpad` pairs.
            unsafe { pack_pairs(x, m, k, mpad, buf.as_mut_ptr()) };
            // SAFETY: forwarded from this function's contract; `buf` as packed.
            unsafe { run_broadcast(buf.as_ptr(), mpad, w, y, m, n, k, n_lo, n_hi) };
        } else {
            let kpad = k.div_ceil(32) * 32;
            let need = m * kpad / 2;
            if buf.len() < need {
                buf.resize(need, 0);
            }
            // SAFETY: as above, `buf` m rows of `kpad` bf16.
            unsafe { round_rows(x, m, k, kpad, buf.as_mut_ptr().cast()) };
            // SAFETY: as above.
            unsafe { run_dot(buf.as_ptr().cast(), kpad, w, y, m, n, k, n_lo, n_hi) };
        }
    });
}

/// `xb[i][q] = bf16(x[i][q])` for `q < k`, zero up to `kpad`.
///
/// # Safety
/// `x` must hold `m` rows of `k` floats and `xb` `m · kpad` u16, `kpad` a multiple of 32 ≥ `k`.
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
unsafe fn round_rows(x: *const f32, m: usize, k: usize, kpad: usize, xb: *mut u16) {
    for i in 0..m {
        let mut q = 0;
        while q < kpad {
            let lo = k.saturating_sub(q).min(16);
            let hi = k.saturating_sub(q + 16).min(16);
            let mask = |n: usize| ((1u32 << n) - 1) as __mmask16;
            // SAFETY: only the `lo` and `hi` floats of row `i` that lie below `k` are read; the
            // 32 u16 written lie within row `i` of `xb`.
            unsafe {
                let a = _mm512_maskz_loadu_ps(mask(lo), x.add(i * k + q));
                let b = _mm512_maskz_loadu_ps(mask(hi), x.add(i * k + q + 16));
                let both: __m512i = std::mem::transmute(_mm512_cvtne2ps_pbh(b, a));
                _mm512_storeu_si512(xb.add(i * kpad + q).cast(), both);
            }
            q += 32;
        }
    }
}

/// `xp[q · mpad + i]` = the pair (`bf16(x[i][2q])`, `bf16(x[i][2q + 1])`), low half first, zero for
/// `m ≤ i < mpad`.
///
/// # Safety
/// `x` must hold `m` rows of `k` floats, `k` even, and `xp` `mpad · k / 2` u32, `mpad` a multiple
/// of 16 ≥ `m`.
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
unsafe fn pack_pairs(x: *const f32, m: usize, k: usize, mpad: usize, xp: *mut u32) {
    // 16 rows × 32 columns at a time: each row's 32 floats become 16 pairs in one conversion
    // (`cvtne2ps_pbh` keeps them in order), and a 16 × 16 transpose of the pairs (as floats: the
    // transpose only moves 32-bit lanes) puts each pair column into a row of `xp`.
    for i0 in (0..mpad).step_by(16) {
        let rows = m.saturating_sub(i0).min(16);
        let mut q = 0;
        while q < k {
            let width = 32.min(k - q);
            let mask = |n: usize| ((1u32 << n) - 1) as __mmask16;
            let (lo, hi) = (width.min(16), width.saturating_sub(16));
            let mut r = [_mm512_setzero_ps(); 16];
            for (c, v) in r.iter_mut().enumerate().take(rows) {
                // SAFETY: `width` floats of input row `i0 + c < m` from column `q`.
                unsafe {
                    let row = x.add((i0 + c) * k + q);
                    let a = _mm512_maskz_loadu_ps(mask(lo), row);
                    let b = _mm512_maskz_loadu_ps(mask(hi), row.add(lo));
                    *v = _mm512_castsi512_ps(std::mem::transmute::<__m512bh, __m512i>(
                        _mm512_cvtne2ps_pbh(b, a),
                    ));
                }
            }
            for (d, v) in super::gemm_broadcast::transpose16(r)
                .iter()
                .enumerate()
                .take(width / 2)
            {
                // SAFETY: pair row `q / 2 + d < k / 2` of `xp`, columns `i0..i0 + 16 <= mpad`.
                unsafe { _mm512_storeu_ps(xp.add((q / 2 + d) * mpad + i0).cast(), *v) };
            }
            q += width;
        }
    }
}

/// Dot-product tiles over weight rows `[n_lo, n_hi)` against `m` rounded rows of stride `kpad`.
///
/// # Safety
/// As for [`run`], with `xb` holding `m` rows of `kpad` bf16, zero beyond `k`.
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
unsafe fn run_dot(
    xb: *const u16,
    kpad: usize,
    w: *const u16,
    y: *mut f32,
    m: usize,
    n: usize,
    k: usize,
    n_lo: usize,
    n_hi: usize,
) {
    let tiles = m.div_ceil(MR);
    let mut n0 = n_lo;
    while n0 < n_hi {
        let nr = NR.min(n_hi - n0);
        let mut j0 = 0;
        for t in 0..tiles {
            let mr = (m - j0) / (tiles - t) + usize::from(!(m - j0).is_multiple_of(tiles - t));
            // The first tile of a block prefetches the block after next (as the f32 tiles do).
            let next = if t == 0 && n0 + AHEAD * NR < n_hi {
                w.wrapping_add((n0 + AHEAD * NR) * k)
            } else {
                std::ptr::null()
            };
            macro_rules! by_mr {
                ($nr:literal) => {
                    // SAFETY: rows `j0..j0 + mr <= m` of `xb`, rows `n0..n0 + nr <= n` of `w`, that
                    // block of `y`; `next` is only prefetched.
                    unsafe {
                        match mr {
                            1 => dot_tile::<$nr, 1>(
                                xb.add(j0 * kpad),
                                kpad,
                                w.add(n0 * k),
                                next,
                                y.add(j0 * n + n0),
                                k,
                                n,
                            ),
                            2 => dot_tile::<$nr, 2>(
                                xb.add(j0 * kpad),
                                kpad,
                                w.add(n0 * k),
                                next,
                                y.add(j0 * n + n0),
                                k,
                                n,
                            ),
                            3 => dot_tile::<$nr, 3>(
                                xb.add(j0 * kpad),
                                kpad,
                                w.add(n0 * k),
                                next,
                                y.add(j0 * n + n0),
                                k,
                                n,
                            ),
                            _ => dot_tile::<$nr, 4>(
                                xb.add(j0 * kpad),
                                kpad,
                                w.add(n0 * k),
                                next,
                                y.add(j0 * n + n0),
                                k,
                                n,
                            ),
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
            j0 += mr;
        }
        n0 += nr;
    }
}

/// `y[j, i] = Σ_q xb[j, q] · w[i, q]` for `i < R` weight rows and `j < C` rounded input rows, 32
/// elements per step, prefetching the [`NR`] rows at `next` unless it is null.
///
/// # Safety
/// `xb` must hold `C` rows of stride `kpad ≥ k` (a multiple of 32), `w` `R` rows of `k` bf16, `y`
/// `C` rows of stride `ldy` with `R` writable floats; the CPU as for [`run`].
#[inline]
#[allow(clippy::needless_range_loop)] // register tiles read best as acc[i][j]
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
unsafe fn dot_tile<const R: usize, const C: usize>(
    xb: *const u16,
    kpad: usize,
    w: *const u16,
    next: *const u16,
    y: *mut f32,
    k: usize,
    ldy: usize,
) {
    let mut acc = [[_mm512_setzero_ps(); C]; R];
    let mut p = 0;
    while p < k {
        let left = k - p;
        if !next.is_null() {
            for i in 0..NR {
                // A prefetch never faults, so rows past the end of `w` are harmless.
                _mm_prefetch::<_MM_HINT_T1>(next.wrapping_add(i * k + p).cast());
            }
        }
        let mut wv = [_mm512_setzero_si512(); R];
        for (i, v) in wv.iter_mut().enumerate() {
            // SAFETY: at most the `left` elements still in row `i < R` of `w`.
            *v = unsafe {
                if left >= 32 {
                    _mm512_loadu_si512(w.add(i * k + p).cast())
                } else {
                    _mm512_maskz_loadu_epi16(
                        ((1u64 << left) - 1) as __mmask32,
                        w.add(i * k + p).cast(),
                    )
                }
            };
        }
        for j in 0..C {
            // SAFETY: 32 u16 of row `j < C` of `xb` from `p < kpad` (a multiple of 32).
            let xv: __m512bh =
                unsafe { std::mem::transmute(_mm512_loadu_si512(xb.add(j * kpad + p).cast())) };
            for i in 0..R {
                // SAFETY: both are 512-bit vectors; the transmute reinterprets the lanes as bf16.
                let wi: __m512bh = unsafe { std::mem::transmute(wv[i]) };
                acc[i][j] = _mm512_dpbf16_ps(acc[i][j], wi, xv);
            }
        }
        p += 32;
    }
    let zero = _mm512_setzero_ps();
    for j in 0..C {
        let lane = |i: usize| if i < R { acc[i][j] } else { zero };
        let sums = super::elem::sum4(lane(0), lane(1), lane(2), lane(3));
        let mut out = [0f32; 4];
        // SAFETY: `out` holds four floats.
        unsafe { _mm_storeu_ps(out.as_mut_ptr(), sums) };
        for (i, &v) in out.iter().take(R).enumerate() {
            // SAFETY: `i < R` writable floats at row `j` of `y`.
            unsafe { *y.add(j * ldy + i) = v };
        }
    }
}

/// Broadcast tiles over weight rows `[n_lo, n_hi)` against the pairs `xp` (`k / 2` rows of `mpad`).
///
/// # Safety
/// As for [`run`], with `xp` as [`pack_pairs`] writes it.
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
unsafe fn run_broadcast(
    xp: *const u32,
    mpad: usize,
    w: *const u16,
    y: *mut f32,
    m: usize,
    n: usize,
    k: usize,
    n_lo: usize,
    n_hi: usize,
) {
    let mut n0 = n_lo;
    while n0 < n_hi {
        let rows = WROWS.min(n_hi - n0);
        let next = WROWS.min(n_hi - n0 - rows);
        let mut ahead = Prefetch::new(
            w.wrapping_add((n0 + rows) * k).cast(),
            (next * k * 2).div_ceil(64),
        );
        let mut i0 = 0;
        while i0 < m {
            let take = 32.min(m - i0);
            macro_rules! by_rows {
                ($v:literal) => {
                    // SAFETY: weight rows `n0..n0 + rows <= n_hi`, pair columns `i0..i0 + 16V <=
                    // mpad`, the matching block of `y`.
                    unsafe {
                        let (wb, xb, yb) = (w.add(n0 * k), xp.add(i0), y.add(i0 * n + n0));
                        match rows {
                            1 => pair_tile::<1, $v>(wb, k, xb, mpad, yb, n, take, &mut ahead),
                            2 => pair_tile::<2, $v>(wb, k, xb, mpad, yb, n, take, &mut ahead),
                            3 => pair_tile::<3, $v>(wb, k, xb, mpad, yb, n, take, &mut ahead),
                            4 => pair_tile::<4, $v>(wb, k, xb, mpad, yb, n, take, &mut ahead),
                            5 => pair_tile::<5, $v>(wb, k, xb, mpad, yb, n, take, &mut ahead),
                            6 => pair_tile::<6, $v>(wb, k, xb, mpad, yb, n, take, &mut ahead),
                            7 => pair_tile::<7, $v>(wb, k, xb, mpad, yb, n, take, &mut ahead),
                            _ => pair_tile::<8, $v>(wb, k, xb, mpad, yb, n, take, &mut ahead),
                        }
                    }
                };
            }
            if take > 16 {
                by_rows!(2)
            } else {
                by_rows!(1)
            }
            i0 += take;
        }
        n0 += rows;
    }
}

/// `y[j, i] = Σ_q (pairs)` for `i < R` weight rows and `j < take ≤ 16V` input rows: each step
/// broadcasts one weight pair of each row against `V` vectors of 16 input pairs.
///
/// # Safety
/// `w` must hold `R` rows of `k` bf16 (`k` even), `xp` `k / 2` rows of stride `ldx` with `16V`
/// readable pairs, `y` `take` rows of stride `ldy` with `R` writable floats; the CPU as for [`run`].
#[inline]
#[allow(clippy::too_many_arguments, clippy::needless_range_loop)]
#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
unsafe fn pair_tile<const R: usize, const V: usize>(
    w: *const u16,
    k: usize,
    xp: *const u32,
    ldx: usize,
    y: *mut f32,
    ldy: usize,
    take: usize,
    ahead: &mut Prefetch,
) {
    let mut acc = [[_mm512_setzero_ps(); V]; R];
    for q in 0..k / 2 {
        ahead.step();
        let mut xv: [__m512bh; V] =
            [unsafe { std::mem::transmute::<__m512i, __m512bh>(_mm512_setzero_si512()) }; V];
        for (v, r) in xv.iter_mut().enumerate() {
            // SAFETY: 16 pairs of row `q < k / 2` of `xp` from column `16v < 16V`.
            *r = unsafe {
                std::mem::transmute::<__m512i, __m512bh>(_mm512_loadu_si512(
                    xp.add(q * ldx + 16 * v).cast(),
                ))
            };
        }
        for i in 0..R {
            // SAFETY: elements `2q, 2q + 1 < k` of weight row `i < R`.
            let pair = unsafe { w.add(i * k + 2 * q).cast::<u32>().read_unaligned() };
            // SAFETY: reinterprets 16 copies of the pair as 32 bf16.
            let wb: __m512bh = unsafe { std::mem::transmute(_mm512_set1_epi32(pair as i32)) };
            for v in 0..V {
                acc[i][v] = _mm512_dpbf16_ps(acc[i][v], wb, xv[v]);
            }
        }
    }
    let mut out = [[0f32; 32]; R];
    for i in 0..R {
        for v in 0..V {
            // SAFETY: 16 floats of `out[i]` from `16v < 32`.
            unsafe { _mm512_storeu_ps(out[i].as_mut_ptr().add(16 * v), acc[i][v]) };
        }
    }
    for j in 0..take {
        for i in 0..R {
            // SAFETY: column `i < R` of output row `j < take`.
            unsafe { *y.add(j * ldy + i) = out[i][j] };
        }
    }
}
