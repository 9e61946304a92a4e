//! The element-wise and attention parts of one decode step in f32, on plain slices: RMSNorm, RoPE,
//! the KV-cache write, attention of one new query per row over that row's cached keys, SiLU·up.
//!
//! A decode step through libtorch runs some 25 small ops per layer (views, RoPE's halves, scatters
//! into the cache, GQA's key expansion, SDPA's own matmuls); at a few dozen rows each costs more in
//! dispatch, allocation and the other thread's idle spin than in arithmetic (perf: 10% of the
//! cycles of a batch-32 step were libgomp spinning while the main thread ran such ops). Here each is
//! one loop, the attention parallel over (row, kv head) pairs, so the step is the weight matmuls
//! plus little else. [`crate::families`] uses them for CPU decoding on AVX-512 machines. The
//! activations are f32; weights (norm scales, biases) and the KV cache are f32 or bf16 ([`Elem`]).

use std::arch::x86_64::*;

use super::elem::Elem;

/// Rows of `x` (each `w.len()` wide) scaled to unit root-mean-square, times `w`, into `out`:
/// `x / sqrt(mean(x²) + eps) · w`, as `torch.nn.functional.rms_norm`.
pub fn rms_norm<W: Elem>(x: &[f32], w: &[W], eps: f64, out: &mut [f32]) {
    let dim = w.len();
    assert!(
        dim > 0 && x.len() == out.len() && x.len().is_multiple_of(dim),
        "rms_norm: shapes"
    );
    for (xr, or) in x.chunks_exact(dim).zip(out.chunks_exact_mut(dim)) {
        let ss: f32 = xr.iter().map(|v| v * v).sum();
        let inv = 1.0 / ((ss / dim as f32) as f64 + eps).sqrt() as f32;
        for ((o, &v), &g) in or.iter_mut().zip(xr).zip(w) {
            *o = v * inv * g.to_f32();
        }
    }
}

/// Rotates each `dim`-wide head of each row of `x` (rows × heads × dim) by its row's position, the
/// Hugging Face layout: `x·cos + rotate_half(x)·sin`, with `cos`/`sin` tables of `dim` per position.
pub fn rope(
    x: &mut [f32],
    heads: usize,
    dim: usize,
    positions: &[usize],
    cos: &[f32],
    sin: &[f32],
) {
    let half = dim / 2;
    assert!(x.len() == positions.len() * heads * dim, "rope: shapes");
    for (row, &pos) in x.chunks_exact_mut(heads * dim).zip(positions) {
        let (c, s) = (
            &cos[pos * dim..(pos + 1) * dim],
            &sin[pos * dim..(pos + 1) * dim],
        );
        for head in row.chunks_exact_mut(dim) {
            for i in 0..half {
                let (a, b) = (head[i], head[i + half]);
                head[i] = a * c[i] - b * s[i];
                head[i + half] = b * c[i + half] + a * s[i + half];
            }
        }
    }
}

/// `x += y`.
pub fn add_assign(x: &mut [f32], y: &[f32]) {
    assert_eq!(x.len(), y.len(), "add_assign: lengths");
    for (a, b) in x.iter_mut().zip(y) {
        *a += b;
    }
}

/// Adds `bias` to every row of `x`.
pub fn add_bias<W: Elem>(x: &mut [f32], bias: &[W]) {
    for row in x.chunks_exact_mut(bias.len()) {
        for (a, b) in row.iter_mut().zip(bias) {
            *a += b.to_f32();
        }
    }
}

/// `gate = silu(gate) · up`, element-wise.
pub fn silu_mul(gate: &mut [f32], up: &[f32]) {
    assert_eq!(gate.len(), up.len(), "silu_mul: lengths");
    // SAFETY: the AVX-512 body runs only where the CPU has AVX-512F.
    if is_x86_feature_detected!("avx512f") {
        unsafe { silu_mul_avx512(gate, up) }
    } else {
        for (g, &u) in gate.iter_mut().zip(up) {
            *g = *g / (1.0 + (-*g).exp()) * u;
        }
    }
}

#[target_feature(enable = "avx512f")]
fn silu_mul_avx512(gate: &mut [f32], up: &[f32]) {
    let one = _mm512_set1_ps(1.0);
    let mut gc = gate.chunks_exact_mut(16);
    let mut uc = up.chunks_exact(16);
    for (g, u) in (&mut gc).zip(&mut uc) {
        // SAFETY: both chunks hold 16 floats.
        unsafe {
            let gv = _mm512_loadu_ps(g.as_ptr());
            let e = exp512(_mm512_sub_ps(_mm512_setzero_ps(), gv));
            let y = _mm512_mul_ps(
                _mm512_div_ps(gv, _mm512_add_ps(one, e)),
                _mm512_loadu_ps(u.as_ptr()),
            );
            _mm512_storeu_ps(g.as_mut_ptr(), y);
        }
    }
    for (g, &u) in gc.into_remainder().iter_mut().zip(uc.remainder()) {
        *g = *g / (1.0 + (-*g).exp()) * u;
    }
}

/// `e^x` in 16 lanes, within ~2 ulp for the arguments decoding meets (x ≤ 88; lanes below −87 give
/// 0 or a denormal): x = n·ln2 + r with |r| ≤ ln2/2, e^r by its Taylor series to r⁷ (truncation
/// below 6e-9 relative), scaled by 2ⁿ.
#[target_feature(enable = "avx512f")]
fn exp512(x: __m512) -> __m512 {
    // ln 2 split in a part exact in f32 and the rest, so that n·LN2_HI is exact.
    const LN2_HI: f32 = 0.693_145_75;
    const LN2_LO: f32 = 1.428_606_8e-6;
    // MAXPS returns its second operand when either is NaN: a NaN argument stays NaN.
    let x = _mm512_max_ps(_mm512_set1_ps(-104.0), x);
    let n = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
        _mm512_mul_ps(x, _mm512_set1_ps(std::f32::consts::LOG2_E)),
    );
    let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(LN2_HI), x);
    let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(LN2_LO), r);
    // Horner: 1 + r(1 + r/2(1 + r/3(1 + … r/7))).
    let mut p = _mm512_set1_ps(1.0 / 5040.0);
    for c in [
        1.0 / 720.0,
        1.0 / 120.0,
        1.0 / 24.0,
        1.0 / 6.0,
        0.5,
        1.0,
        1.0,
    ] {
        p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
    }
    _mm512_scalef_ps(p, n)
}

/// The softmax of one row of logits at inverse temperature `inv_temp`, unnormalised: writes
/// `e[i] = exp((x[i] − max)·inv_temp)` and returns `(max, Σ e)`. What sampling needs from a row of
/// 50–150k logits, in two vector passes.
pub fn softmax_row(x: &[f32], inv_temp: f32, e: &mut [f32]) -> (f32, f64) {
    assert_eq!(x.len(), e.len(), "softmax_row: lengths");
    let max = if is_x86_feature_detected!("avx512f") {
        // SAFETY: AVX-512F is present.
        unsafe { max_avx512(x) }
    } else {
        x.iter().copied().fold(f32::NEG_INFINITY, f32::max)
    };
    let sum = if is_x86_feature_detected!("avx512f") {
        // SAFETY: AVX-512F is present; `e` is as long as `x`.
        unsafe { exp_into_avx512(x, max, inv_temp, e) }
    } else {
        x.iter()
            .zip(e.iter_mut())
            .map(|(&v, o)| {
                *o = ((v - max) * inv_temp).exp();
                *o as f64
            })
            .sum()
    };
    (max, sum)
}

#[target_feature(enable = "avx512f")]
fn max_avx512(x: &[f32]) -> f32 {
    let mut m = _mm512_set1_ps(f32::NEG_INFINITY);
    let mut chunks = x.chunks_exact(16);
    for c in &mut chunks {
        // SAFETY: 16 floats.
        m = _mm512_max_ps(m, unsafe { _mm512_loadu_ps(c.as_ptr()) });
    }
    chunks
        .remainder()
        .iter()
        .copied()
        .fold(_mm512_reduce_max_ps(m), f32::max)
}

#[target_feature(enable = "avx512f")]
fn exp_into_avx512(x: &[f32], max: f32, inv_temp: f32, e: &mut [f32]) -> f64 {
    let (maxv, tv) = (_mm512_set1_ps(max), _mm512_set1_ps(inv_temp));
    let mut sum = 0.0f64;
    let mut xc = x.chunks_exact(16);
    let mut ec = e.chunks_exact_mut(16);
    for (a, o) in (&mut xc).zip(&mut ec) {
        // SAFETY: both chunks hold 16 floats.
        unsafe {
            let v = exp512(_mm512_mul_ps(
                _mm512_sub_ps(_mm512_loadu_ps(a.as_ptr()), maxv),
                tv,
            ));
            _mm512_storeu_ps(o.as_mut_ptr(), v);
            sum += _mm512_reduce_add_ps(v) as f64;
        }
    }
    for (&a, o) in xc.remainder().iter().zip(ec.into_remainder()) {
        *o = ((a - max) * inv_temp).exp();
        sum += *o as f64;
    }
    sum
}

/// The shapes of a KV cache as the decode step sees it: per layer (rows, kv_heads, capacity, dim).
#[derive(Debug, Clone, Copy)]
pub struct CacheShape {
    pub kv_heads: usize,
    pub capacity: usize,
    pub dim: usize,
}

impl CacheShape {
    fn offset(&self, row: usize, head: usize, pos: usize) -> usize {
        ((row * self.kv_heads + head) * self.capacity + pos) * self.dim
    }
}

/// Writes each row's new key and value (rows × kv_heads × dim) at its position in the cache
/// (rounded to the cache's element type).
pub fn write_cache<C: Elem>(
    k_cache: &mut [C],
    v_cache: &mut [C],
    shape: CacheShape,
    k: &[f32],
    v: &[f32],
    positions: &[usize],
) {
    let d = shape.dim;
    for (row, &pos) in positions.iter().enumerate() {
        assert!(
            pos < shape.capacity,
            "write_cache: position {pos} beyond the cache"
        );
        for h in 0..shape.kv_heads {
            let src = (row * shape.kv_heads + h) * d;
            let dst = shape.offset(row, h, pos);
            for (c, &x) in k_cache[dst..dst + d].iter_mut().zip(&k[src..src + d]) {
                *c = C::from_f32(x);
            }
            for (c, &x) in v_cache[dst..dst + d].iter_mut().zip(&v[src..src + d]) {
                *c = C::from_f32(x);
            }
        }
    }
}

/// Attention of one query per row: `out[b, h] = softmax(q[b, h]·K[b, g]ᵀ · scale) · V[b, g]` over
/// cached positions `0..lens[b]`, where query head `h` reads kv head `g = h / (heads / kv_heads)`
/// (grouped-query attention without expanding K and V). `q` and `out` are rows × heads × dim. Runs on
/// `threads` threads over the (row, kv head) pairs.
#[allow(clippy::too_many_arguments)] // the attention's operands and shapes; a struct would hide them
pub fn attend<C: Elem>(
    q: &[f32],
    k_cache: &[C],
    v_cache: &[C],
    shape: CacheShape,
    heads: usize,
    lens: &[usize],
    scale: f32,
    out: &mut [f32],
    threads: usize,
) {
    let (rows, d, kvh) = (lens.len(), shape.dim, shape.kv_heads);
    assert!(
        kvh > 0 && heads.is_multiple_of(kvh),
        "attend: {heads} heads over {kvh} kv heads"
    );
    assert!(
        q.len() == rows * heads * d && out.len() == q.len(),
        "attend: shapes"
    );
    assert!(
        lens.iter().all(|&l| (1..=shape.capacity).contains(&l)),
        "attend: lengths beyond the cache"
    );
    // Checked here, outside the parallel region: a panic inside it cannot unwind and would abort.
    let cache_len = rows * kvh * shape.capacity * d;
    assert!(
        k_cache.len() >= cache_len && v_cache.len() >= cache_len,
        "attend: the cache is smaller than its shape"
    );
    let out_addr = out.as_mut_ptr() as usize;
    let avx512 = is_x86_feature_detected!("avx512f");
    super::omp::parallel_for(rows * kvh, threads, &|lo, hi| {
        let group = heads / kvh;
        let mut scores = Vec::new();
        for item in lo..hi {
            let (b, g) = (item / kvh, item % kvh);
            let len = lens[b];
            let base = shape.offset(b, g, 0);
            let keys = &k_cache[base..base + len * d];
            let values = &v_cache[base..base + len * d];
            for h in g * group..(g + 1) * group {
                let off = (b * heads + h) * d;
                // SAFETY: items own disjoint (row, head) slices of `out`, which outlives the region.
                let o =
                    unsafe { std::slice::from_raw_parts_mut((out_addr as *mut f32).add(off), d) };
                scores.resize(len, 0.0);
                let qh = &q[off..off + d];
                if !(avx512 && attend_head_avx512(qh, keys, values, scale, &mut scores, o)) {
                    attend_head(qh, keys, values, scale, &mut scores, o);
                }
            }
        }
    });
}

/// One head, scalar: scores, softmax, weighted sum of the values.
fn attend_head<C: Elem>(
    q: &[f32],
    keys: &[C],
    values: &[C],
    scale: f32,
    scores: &mut [f32],
    out: &mut [f32],
) {
    let d = q.len();
    for (s, k) in scores.iter_mut().zip(keys.chunks_exact(d)) {
        *s = q.iter().zip(k).map(|(a, b)| a * b.to_f32()).sum::<f32>() * scale;
    }
    let max = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0.0;
    for s in scores.iter_mut() {
        *s = (*s - max).exp();
        sum += *s;
    }
    out.fill(0.0);
    for (s, v) in scores.iter().zip(values.chunks_exact(d)) {
        for (o, x) in out.iter_mut().zip(v) {
            *o += s * x.to_f32();
        }
    }
    for o in out.iter_mut() {
        *o /= sum;
    }
}

/// One head in zmm registers, for `dim` = 16·V with V ≤ 8 (head widths 16 to 128): returns false
/// (doing nothing) for other widths. The caller has checked AVX-512F.
fn attend_head_avx512<C: Elem>(
    q: &[f32],
    keys: &[C],
    values: &[C],
    scale: f32,
    scores: &mut [f32],
    out: &mut [f32],
) -> bool {
    assert!(
        keys.len() == scores.len() * q.len() && values.len() == keys.len() && out.len() == q.len()
    );
    macro_rules! widths {
        ($($v:literal)*) => {
            match q.len() {
                // SAFETY: AVX-512F (the caller's check) and the lengths asserted above.
                $(n if n == 16 * $v => unsafe { attend_head_vecs::<C, $v>(q, keys, values, scale, scores, out) },)*
                _ => return false,
            }
        };
    }
    widths!(1 2 3 4 5 6 7 8);
    true
}

/// [`attend_head`] with the query and the output accumulators held in `V` zmm registers each; the
/// scores of four keys at a time are folded together (one horizontal-add tree per four).
///
/// # Safety
/// AVX-512F must be present; `q` and `out` hold 16·V floats, `keys` and `values` `scores.len()` rows
/// of them.
#[target_feature(enable = "avx512f")]
unsafe fn attend_head_vecs<C: Elem, const V: usize>(
    q: &[f32],
    keys: &[C],
    values: &[C],
    scale: f32,
    scores: &mut [f32],
    out: &mut [f32],
) {
    let d = 16 * V;
    let len = scores.len();
    // SAFETY (whole body): every load reads 16 floats within row `t < len` of `keys`/`values` or
    // within `q`; every store writes within `scores` (chunks) or `out`.
    unsafe {
        let mut qv = [_mm512_setzero_ps(); V];
        for (c, v) in qv.iter_mut().enumerate() {
            *v = _mm512_loadu_ps(q.as_ptr().add(16 * c));
        }
        let dot = |t: usize| {
            let k = keys.as_ptr().add(t * d);
            let mut acc = _mm512_mul_ps(qv[0], C::load16(k));
            for (c, &qc) in qv.iter().enumerate().skip(1) {
                acc = _mm512_fmadd_ps(qc, C::load16(k.add(16 * c)), acc);
            }
            acc
        };
        let mut t = 0;
        while t + 4 <= len {
            let s4 = super::elem::sum4(dot(t), dot(t + 1), dot(t + 2), dot(t + 3));
            _mm_storeu_ps(
                scores.as_mut_ptr().add(t),
                _mm_mul_ps(s4, _mm_set1_ps(scale)),
            );
            t += 4;
        }
        while t < len {
            scores[t] = _mm512_reduce_add_ps(dot(t)) * scale;
            t += 1;
        }
        let max = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let maxv = _mm512_set1_ps(max);
        let mut sums = _mm512_setzero_ps();
        let mut chunks = scores.chunks_exact_mut(16);
        for c in &mut chunks {
            let e = exp512(_mm512_sub_ps(_mm512_loadu_ps(c.as_ptr()), maxv));
            _mm512_storeu_ps(c.as_mut_ptr(), e);
            sums = _mm512_add_ps(sums, e);
        }
        let mut sum = _mm512_reduce_add_ps(sums);
        for s in chunks.into_remainder() {
            *s = (*s - max).exp();
            sum += *s;
        }
        let mut acc = [_mm512_setzero_ps(); V];
        for (t, &p) in scores.iter().enumerate() {
            let v = values.as_ptr().add(t * d);
            let pv = _mm512_set1_ps(p);
            for (c, a) in acc.iter_mut().enumerate() {
                *a = _mm512_fmadd_ps(pv, C::load16(v.add(16 * c)), *a);
            }
        }
        let inv = _mm512_set1_ps(1.0 / sum);
        for (c, a) in acc.iter().enumerate() {
            _mm512_storeu_ps(out.as_mut_ptr().add(16 * c), _mm512_mul_ps(*a, inv));
        }
    }
}

#[cfg(test)]
mod tests {
    use tch::{Device, Kind, Tensor};

    use super::*;

    fn tensor(v: &[f32], shape: &[i64]) -> Tensor {
        Tensor::from_slice(v).view(shape)
    }

    fn values(t: &Tensor) -> Vec<f32> {
        Vec::<f32>::try_from(t.flatten(0, -1).to_kind(Kind::Float)).unwrap()
    }

    fn max_diff(a: &[f32], b: &[f32]) -> f32 {
        assert_eq!(a.len(), b.len());
        a.iter()
            .zip(b)
            .map(|(x, y)| (x - y).abs())
            .fold(0.0, f32::max)
    }

    fn randn(n: usize) -> Vec<f32> {
        values(&Tensor::randn([n as i64], (Kind::Float, Device::Cpu)))
    }

    #[test]
    #[cfg_attr(not(host_avx512), ignore = "this CPU has no AVX-512")]
    fn exp_matches_libm_over_the_range_softmax_and_silu_meet() {
        if !is_x86_feature_detected!("avx512f") {
            return;
        }
        let xs: Vec<f32> = (0..4000).map(|i| -100.0 + i as f32 * 0.047).collect();
        for c in xs.chunks_exact(16) {
            let mut out = [0f32; 16];
            // SAFETY: AVX-512F is present; both buffers hold 16 floats.
            unsafe { _mm512_storeu_ps(out.as_mut_ptr(), exp512(_mm512_loadu_ps(c.as_ptr()))) };
            for (x, y) in c.iter().zip(out) {
                let want = (*x as f64).exp();
                let err = ((y as f64 - want) / want.max(f32::MIN_POSITIVE as f64)).abs();
                assert!(
                    err < 5e-7 || (want < 1e-37 && (y as f64) < 1e-37),
                    "exp({x}) = {y}, want {want}"
                );
            }
        }
    }

    #[test]
    fn norm_rope_and_silu_match_libtorch() {
        tch::manual_seed(3);
        let (rows, heads, dim) = (5, 3, 8);
        let x = randn(rows * heads * dim);
        let w = randn(dim);
        let mut out = vec![0.0; x.len()];
        rms_norm(&x, &w, 1e-5, &mut out);
        let want = tensor(&x, &[(rows * heads) as i64, dim as i64]).rms_norm(
            [dim as i64],
            Some(&tensor(&w, &[dim as i64])),
            1e-5,
        );
        assert!(max_diff(&out, &values(&want)) < 1e-5);

        let positions = [0usize, 3, 7, 1, 12];
        let (cos, sin) = (randn(16 * dim), randn(16 * dim));
        let mut r = x.clone();
        rope(&mut r, heads, dim, &positions, &cos, &sin);
        let xt = tensor(&x, &[rows as i64, heads as i64, dim as i64]);
        let pos = Tensor::from_slice(&positions.map(|p| p as i64));
        let ct = tensor(&cos, &[16, dim as i64])
            .index_select(0, &pos)
            .unsqueeze(1);
        let st = tensor(&sin, &[16, dim as i64])
            .index_select(0, &pos)
            .unsqueeze(1);
        let half = dim as i64 / 2;
        let rot = Tensor::cat(
            &[xt.narrow(-1, half, half).neg(), xt.narrow(-1, 0, half)],
            -1,
        );
        let want = &xt * ct + rot * st;
        assert!(max_diff(&r, &values(&want)) < 1e-5);

        let (g, u) = (randn(37), randn(37));
        let mut s = g.clone();
        silu_mul(&mut s, &u);
        let want = tensor(&g, &[37]).silu() * tensor(&u, &[37]);
        assert!(max_diff(&s, &values(&want)) < 1e-5);
    }

    /// GQA attention over ragged lengths equals libtorch's SDPA on the live prefix of each row, for
    /// head widths the AVX-512 bodies serve (64, 128, 80) and one the scalar body does (24).
    #[test]
    fn attention_matches_sdpa_on_ragged_rows() {
        tch::manual_seed(4);
        for dim in [64usize, 128, 24, 80] {
            let (rows, heads, kvh, cap) = (4usize, 6usize, 2usize, 40usize);
            let shape = CacheShape {
                kv_heads: kvh,
                capacity: cap,
                dim,
            };
            let kc = randn(rows * kvh * cap * dim);
            let vc = randn(rows * kvh * cap * dim);
            let q = randn(rows * heads * dim);
            let lens = [1usize, 17, 40, 33];
            let scale = 1.0 / (dim as f32).sqrt();
            let mut out = vec![0.0; q.len()];
            attend(&q, &kc, &vc, shape, heads, &lens, scale, &mut out, 2);
            let kt = tensor(&kc, &[rows as i64, kvh as i64, cap as i64, dim as i64]);
            let vt = tensor(&vc, &[rows as i64, kvh as i64, cap as i64, dim as i64]);
            for (b, &len) in lens.iter().enumerate() {
                let qb = tensor(
                    &q[b * heads * dim..(b + 1) * heads * dim],
                    &[1, heads as i64, 1, dim as i64],
                );
                let kb = kt.narrow(0, b as i64, 1).narrow(2, 0, len as i64);
                let vb = vt.narrow(0, b as i64, 1).narrow(2, 0, len as i64);
                let want = Tensor::scaled_dot_product_attention(
                    &qb,
                    &kb,
                    &vb,
                    None::<Tensor>,
                    0.0,
                    false,
                    None,
                    true,
                );
                let got = &out[b * heads * dim..(b + 1) * heads * dim];
                assert!(max_diff(got, &values(&want)) < 1e-5, "dim {dim}, row {b}");
            }
        }
    }

    /// A bf16 cache is read widened: attention over it equals attention over its f32 widening
    /// (head widths through the AVX-512 body and the scalar one), and writes round to nearest.
    #[test]
    fn bf16_cache_reads_its_widening_and_writes_round_to_nearest() {
        use half::bf16;
        tch::manual_seed(6);
        for dim in [64usize, 24] {
            let (rows, heads, kvh, cap) = (3usize, 4usize, 2usize, 21usize);
            let shape = CacheShape {
                kv_heads: kvh,
                capacity: cap,
                dim,
            };
            let kc: Vec<bf16> = randn(rows * kvh * cap * dim)
                .into_iter()
                .map(bf16::from_f32)
                .collect();
            let vc: Vec<bf16> = randn(rows * kvh * cap * dim)
                .into_iter()
                .map(bf16::from_f32)
                .collect();
            let widen = |c: &[bf16]| c.iter().map(|x| x.to_f32()).collect::<Vec<f32>>();
            let q = randn(rows * heads * dim);
            let lens = [21usize, 1, 9];
            let scale = 1.0 / (dim as f32).sqrt();
            let (mut got, mut want) = (vec![0.0; q.len()], vec![0.0; q.len()]);
            attend(&q, &kc, &vc, shape, heads, &lens, scale, &mut got, 2);
            attend(
                &q,
                &widen(&kc),
                &widen(&vc),
                shape,
                heads,
                &lens,
                scale,
                &mut want,
                2,
            );
            assert!(max_diff(&got, &want) < 1e-6, "dim {dim}");
        }
        let shape = CacheShape {
            kv_heads: 1,
            capacity: 2,
            dim: 2,
        };
        let (mut kc, mut vc) = (vec![bf16::ZERO; 4], vec![bf16::ZERO; 4]);
        write_cache(
            &mut kc,
            &mut vc,
            shape,
            &[1.0 + 1.0 / 256.0, 3.3],
            &[-2.5e-3, 7.0],
            &[1],
        );
        assert_eq!(
            kc[2..].iter().map(|x| x.to_f32()).collect::<Vec<_>>(),
            [
                bf16::from_f32(1.0 + 1.0 / 256.0).to_f32(),
                bf16::from_f32(3.3).to_f32()
            ]
        );
        assert_eq!(vc[3].to_f32(), 7.0);
    }

    #[test]
    fn cache_writes_land_at_each_rows_position() {
        let shape = CacheShape {
            kv_heads: 2,
            capacity: 5,
            dim: 3,
        };
        let mut kc = vec![0.0; 2 * 2 * 5 * 3];
        let mut vc = kc.clone();
        let k: Vec<f32> = (1..=12).map(|i| i as f32).collect();
        let v: Vec<f32> = k.iter().map(|x| -x).collect();
        write_cache(&mut kc, &mut vc, shape, &k, &v, &[4, 0]);
        assert_eq!(
            &kc[shape.offset(0, 1, 4)..shape.offset(0, 1, 4) + 3],
            &[4.0, 5.0, 6.0]
        );
        assert_eq!(
            &vc[shape.offset(1, 0, 0)..shape.offset(1, 0, 0) + 3],
            &[-7.0, -8.0, -9.0]
        );
        assert_eq!(kc.iter().filter(|x| **x != 0.0).count(), 12);
    }
}
