//! The many-rows path of [`super::gemm_f32::matmul_nt`]: `y = x · wᵀ` as broadcast
//! multiply-adds, each element of a weight row against a vector of 16 inputs.
//!
//! Why: the dot-product tiles of `gemm_f32` reduce every accumulator horizontally and load one
//! input vector per four multiply-adds; at 32 rows that holds them near 125 GFLOP/s on split
//! AVX-512 units (Zen 4), where libtorch's large products reach 180–220. Here the inputs are
//! transposed once per call (`xt[q][i] = x[i][q]`: they are small, up to a few dozen rows of K), and
//! a tile of [`WROWS`] weight rows × up to 32 input rows runs along K with two vector loads and eight
//! broadcasts per 16 multiply-adds and no horizontal sums. The weights are read in place, each
//! element once per 32 input rows, so the worker needs no packed copy of them (a second copy would
//! double a 3B model's 12 GB); the next tile's weight rows are prefetched under the current tile's
//! arithmetic, so the stream from memory overlaps the multiply-adds. bf16 weights are widened into a
//! small per-thread buffer one tile at a time.
//!
//! Measured on Zen 4 over the default model's 211 matrices (`examples/bench_linear`, ms per decode
//! step, 2 threads): 24.6 against the dot-product tiles' 29.6 at 8 rows, 44.3 against 68.6 at 32.
//! An earlier version packed (transposed) the weights instead, 48 rows at a time: its transpose cost
//! about six vector operations per 16 weights, and it was slower than this at every row count.

use std::arch::x86_64::*;
use std::cell::RefCell;

use super::elem::Elem;

/// Weight rows per tile: against 32 input rows (two vectors) that is 16 accumulators, two input
/// vectors and the broadcasts, which LLVM loads into registers ahead of their multiply-adds
/// (twelve rows spilled accumulators to the stack; ten measured slower than eight, and sixteen
/// rows against one vector no faster than eight).
pub(crate) const WROWS: usize = 8;
/// Weight rows per unit of work when threads split a product.
pub(crate) const BLOCK: usize = WROWS;

thread_local! {
    /// Each thread's transposed inputs (`mpad · K` floats) and widened bf16 weight rows
    /// (`WROWS · K`), kept between calls.
    static BUFFERS: RefCell<(Vec<f32>, Vec<f32>)> = const { RefCell::new((Vec::new(), Vec::new())) };
}

/// Weight rows `[n_lo, n_hi)` of `y = x · wᵀ` (`x` (m, k), `w` (n, k), `y` (m, n), row-major).
///
/// # Safety
/// The pointers must cover those shapes, `n_hi <= n`, AVX-512F must be present, and no other
/// thread may write columns `[n_lo, n_hi)` of `y` meanwhile.
#[allow(clippy::too_many_arguments)] // the product's buffers and shapes, as `gemm_f32::Job` holds them
#[target_feature(enable = "avx512f")]
pub(crate) unsafe fn run<W: Elem>(
    x: *const f32,
    w: *const W,
    y: *mut f32,
    m: usize,
    n: usize,
    k: usize,
    n_lo: usize,
    n_hi: usize,
) {
    let mpad = m.div_ceil(16) * 16;
    let widen = !matches!(W::KIND, tch::Kind::Float);
    BUFFERS.with_borrow_mut(|(xt, wide)| {
        if xt.len() < mpad * k {
            xt.resize(mpad * k, 0.0);
        }
        if widen && wide.len() < WROWS * k {
            wide.resize(WROWS * k, 0.0);
        }
        // SAFETY: `x` holds `m` rows of `k` floats, `xt` `mpad · k` floats.
        unsafe { pack_inputs(x, m, k, mpad, xt.as_mut_ptr()) };
        let xt = xt.as_ptr();
        let mut n0 = n_lo;
        while n0 < n_hi {
            let rows = WROWS.min(n_hi - n0);
            let next = WROWS.min(n_hi - n0 - rows);
            let lines = (next * k * size_of::<W>()).div_ceil(64);
            let mut ahead = Prefetch::new(w.wrapping_add((n0 + rows) * k).cast(), lines);
            // bf16 rows are widened once per tile into `wide` (8 rows of K floats: L1 or L2), so
            // that the broadcasts read f32 as they do for f32 weights.
            let block: *const f32 = if widen {
                // SAFETY: rows `n0..n0 + rows <= n` of `w`; `wide` holds `WROWS · k` floats.
                unsafe { widen_rows(w.add(n0 * k), rows * k, wide.as_mut_ptr()) };
                wide.as_ptr()
            } else {
                w.wrapping_add(n0 * k).cast()
            };
            let mut i0 = 0;
            while i0 < m {
                let take = 32.min(m - i0);
                // SAFETY: weight rows `n0..n0 + rows <= n_hi` (as f32 at `block`), input rows
                // `i0..i0 + take <= m` (transposed: columns `i0..i0 + 16V <= mpad` of `xt`), the
                // matching block of `y`.
                unsafe {
                    tile_dispatch(
                        rows,
                        take,
                        block,
                        k,
                        xt.add(i0),
                        mpad,
                        y.add(i0 * n + n0),
                        n,
                        &mut ahead,
                    )
                };
                i0 += take;
            }
            n0 += rows;
        }
    });
}

/// `out[i] = w[i]` as f32 for `i < len`.
///
/// # Safety
/// `w` must hold `len` elements and `out` `len` floats; AVX-512F.
#[target_feature(enable = "avx512f")]
unsafe fn widen_rows<W: Elem>(w: *const W, len: usize, out: *mut f32) {
    let mut i = 0;
    while i + 16 <= len {
        // SAFETY: elements `i..i + 16 <= len`.
        unsafe { _mm512_storeu_ps(out.add(i), W::load16(w.add(i))) };
        i += 16;
    }
    if i < len {
        let mask = ((1u32 << (len - i)) - 1) as __mmask16;
        // SAFETY: the `len - i` elements left.
        unsafe { _mm512_mask_storeu_ps(out.add(i), mask, W::load_partial(w.add(i), len - i)) };
    }
}

/// Writes `xt[q · mpad + i] = x[i · k + q]` (zero for `m ≤ i < mpad`), 16 × 16 blocks at a time.
///
/// # Safety
/// `x` must hold `m` rows of `k` floats and `xt` `mpad · k` floats, `mpad` a multiple of 16 ≥ `m`;
/// AVX-512F.
#[target_feature(enable = "avx512f")]
unsafe fn pack_inputs(x: *const f32, m: usize, k: usize, mpad: usize, xt: *mut f32) {
    for i0 in (0..mpad).step_by(16) {
        let rows = m.saturating_sub(i0).min(16);
        let mut q = 0;
        while q < k {
            let width = 16.min(k - q);
            let mask = ((1u32 << width) - 1) as __mmask16;
            let mut r = [_mm512_setzero_ps(); 16];
            for (c, v) in r.iter_mut().enumerate().take(rows) {
                // SAFETY: `width` floats of input row `i0 + c < m` from column `q`.
                *v = unsafe { _mm512_maskz_loadu_ps(mask, x.add((i0 + c) * k + q)) };
            }
            for (d, v) in transpose16(r).iter().enumerate().take(width) {
                // SAFETY: row `q + d < k` of `xt`, columns `i0..i0 + 16 <= mpad`.
                unsafe { _mm512_storeu_ps(xt.add((q + d) * mpad + i0), *v) };
            }
            q += width;
        }
    }
}

/// Cache lines still to fetch ahead of the arithmetic.
pub(crate) struct Prefetch {
    next: *const u8,
    left: usize,
}

impl Prefetch {
    /// `lines` cache lines from `next` on.
    pub(crate) fn new(next: *const u8, lines: usize) -> Self {
        Self { next, left: lines }
    }

    /// Issues this step's prefetch (one line: callers spread a tile's lines over at least as many
    /// steps).
    #[inline(always)]
    pub(crate) fn step(&mut self) {
        if self.left > 0 {
            // SAFETY: a prefetch never faults.
            unsafe { _mm_prefetch::<_MM_HINT_T1>(self.next.cast()) };
            self.next = self.next.wrapping_add(64);
            self.left -= 1;
        }
    }
}

/// The 16 × 16 transpose of `r` (row `i` of the result is column `i` of `r`): pairs of lanes,
/// then quadruples, then 128-bit lanes in two steps.
#[inline]
#[target_feature(enable = "avx512f")]
pub(crate) fn transpose16(r: [__m512; 16]) -> [__m512; 16] {
    let mut t = [_mm512_setzero_ps(); 16];
    for i in 0..8 {
        t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    let mut u = [_mm512_setzero_ps(); 16];
    for g in 0..4 {
        let b = 4 * g;
        u[b] = _mm512_shuffle_ps::<0x44>(t[b], t[b + 2]);
        u[b + 1] = _mm512_shuffle_ps::<0xEE>(t[b], t[b + 2]);
        u[b + 2] = _mm512_shuffle_ps::<0x44>(t[b + 1], t[b + 3]);
        u[b + 3] = _mm512_shuffle_ps::<0xEE>(t[b + 1], t[b + 3]);
    }
    for h in 0..2 {
        let b = 8 * h;
        for j in 0..4 {
            t[b + j] = _mm512_shuffle_f32x4::<0x88>(u[b + j], u[b + 4 + j]);
            t[b + 4 + j] = _mm512_shuffle_f32x4::<0xDD>(u[b + j], u[b + 4 + j]);
        }
    }
    for j in 0..8 {
        u[j] = _mm512_shuffle_f32x4::<0x88>(t[j], t[8 + j]);
        u[8 + j] = _mm512_shuffle_f32x4::<0xDD>(t[j], t[8 + j]);
    }
    u
}

/// [`tile`] for run-time `rows ≤ WROWS` weight rows and `take ≤ 32` input rows.
///
/// # Safety
/// As for [`tile`], with `V = take.div_ceil(16)`.
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx512f")]
unsafe fn tile_dispatch(
    rows: usize,
    take: usize,
    w: *const f32,
    k: usize,
    xt: *const f32,
    ldxt: usize,
    y: *mut f32,
    ldy: usize,
    ahead: &mut Prefetch,
) {
    macro_rules! by_rows {
        ($v:literal) => {
            // SAFETY: forwarded from this function's contract.
            unsafe {
                match rows {
                    1 => tile::<1, $v>(w, k, xt, ldxt, y, ldy, take, ahead),
                    2 => tile::<2, $v>(w, k, xt, ldxt, y, ldy, take, ahead),
                    3 => tile::<3, $v>(w, k, xt, ldxt, y, ldy, take, ahead),
                    4 => tile::<4, $v>(w, k, xt, ldxt, y, ldy, take, ahead),
                    5 => tile::<5, $v>(w, k, xt, ldxt, y, ldy, take, ahead),
                    6 => tile::<6, $v>(w, k, xt, ldxt, y, ldy, take, ahead),
                    7 => tile::<7, $v>(w, k, xt, ldxt, y, ldy, take, ahead),
                    _ => tile::<8, $v>(w, k, xt, ldxt, y, ldy, take, ahead),
                }
            }
        };
    }
    if take > 16 { by_rows!(2) } else { by_rows!(1) }
}

/// `y[j, i] = Σ_q x[j, q] · w[i, q]` for `i < R` weight rows and `j < take ≤ 16V` input rows:
/// each step along K broadcasts one element of each weight row against `V` vectors of 16
/// transposed inputs.
///
/// # Safety
/// `w` must hold `R` rows of `k` elements, `xt` `k` rows of stride `ldxt` with `16V` readable
/// floats each, `y` `take` rows of stride `ldy` with `R` writable floats each; AVX-512F.
#[inline]
#[allow(clippy::too_many_arguments, clippy::needless_range_loop)] // register tiles read best as acc[i][v]
#[target_feature(enable = "avx512f")]
unsafe fn tile<const R: usize, const V: usize>(
    w: *const f32,
    k: usize,
    xt: *const f32,
    ldxt: usize,
    y: *mut f32,
    ldy: usize,
    take: usize,
    ahead: &mut Prefetch,
) {
    let mut acc = [[_mm512_setzero_ps(); V]; R];
    for q in 0..k {
        ahead.step();
        let mut xv = [_mm512_setzero_ps(); V];
        for (v, r) in xv.iter_mut().enumerate() {
            // SAFETY: 16 floats of transposed row `q < k`, from column `16v < 16V`.
            *r = unsafe { _mm512_loadu_ps(xt.add(q * ldxt + 16 * v)) };
        }
        for i in 0..R {
            // SAFETY: element `q < k` of weight row `i < R`.
            let wb = _mm512_set1_ps(unsafe { *w.add(i * k + q) });
            for v in 0..V {
                acc[i][v] = _mm512_fmadd_ps(wb, xv[v], acc[i][v]);
            }
        }
    }
    // acc[i][v] holds output column `i` for input rows 16v..16v + 16: written out through a
    // small transposed buffer.
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn transpose16_transposes() {
        if !super::super::gemm_f32::is_available() {
            eprintln!("skipped: no AVX-512F");
            return;
        }
        let src: Vec<f32> = (0..256).map(|i| i as f32).collect();
        // SAFETY: AVX-512F checked; 16 rows of 16 floats.
        let out = unsafe {
            let r: [__m512; 16] =
                std::array::from_fn(|i| _mm512_loadu_ps(src.as_ptr().add(16 * i)));
            transpose16(r)
        };
        for (i, v) in out.iter().enumerate() {
            let mut row = [0f32; 16];
            // SAFETY: 16 floats.
            unsafe { _mm512_storeu_ps(row.as_mut_ptr(), *v) };
            for (j, &e) in row.iter().enumerate() {
                assert_eq!(e, src[16 * j + i], "out[{i}][{j}]");
            }
        }
    }
}
