//! The element types cotrain's decode kernels read weights and KV caches in: `f32`, and `bf16`
//! (half the bytes, so half the memory traffic that bounds decoding). Arithmetic is always f32: a
//! bf16 value is the top half of an f32, so widening it is a 16-bit shift, exact.
//!
//! The vector loads are `#[inline(always)]` without a target feature of their own: they are only
//! called from the kernels' `#[target_feature(enable = "avx512f")]` bodies, into which they inline.

use std::arch::x86_64::*;

use half::bf16;
use tch::Kind;

/// An element type the decode kernels read (see the module docs).
pub trait Elem: Copy + Send + Sync + 'static {
    /// The libtorch dtype of a tensor of these elements.
    const KIND: Kind;

    /// Sixteen consecutive elements at `p`, widened to f32.
    ///
    /// # Safety
    /// `p` must point at 16 readable elements and the CPU must have AVX-512F (the caller is an
    /// `avx512f` function).
    unsafe fn load16(p: *const Self) -> __m512;

    /// The element as f32 (exact).
    fn to_f32(self) -> f32;

    /// The nearest element to `v` (round to nearest, ties to even).
    fn from_f32(v: f32) -> Self;

    /// The first `n < 16` elements at `p` widened to f32, the other lanes zero.
    ///
    /// # Safety
    /// As [`Elem::load16`], for `n` elements.
    #[inline(always)]
    unsafe fn load_partial(p: *const Self, n: usize) -> __m512 {
        let mut lanes = [0f32; 16];
        for (i, l) in lanes.iter_mut().enumerate().take(n) {
            // SAFETY: `i < n` elements are readable at `p`.
            *l = unsafe { *p.add(i) }.to_f32();
        }
        // SAFETY: `lanes` holds 16 floats; AVX-512F per the contract.
        unsafe { _mm512_loadu_ps(lanes.as_ptr()) }
    }
}

impl Elem for f32 {
    const KIND: Kind = Kind::Float;

    #[inline(always)]
    unsafe fn load16(p: *const f32) -> __m512 {
        // SAFETY: forwarded from the contract.
        unsafe { _mm512_loadu_ps(p) }
    }

    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }

    #[inline(always)]
    fn from_f32(v: f32) -> f32 {
        v
    }
}

impl Elem for bf16 {
    const KIND: Kind = Kind::BFloat16;

    #[inline(always)]
    unsafe fn load16(p: *const bf16) -> __m512 {
        // SAFETY: 16 bf16 are the 32 bytes loaded; AVX-512F per the contract. Each 16-bit lane is
        // zero-extended to 32 bits and shifted into the high half: the f32 with the same bits.
        unsafe {
            let h = _mm256_loadu_si256(p.cast());
            _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(h)))
        }
    }

    #[inline(always)]
    fn to_f32(self) -> f32 {
        bf16::to_f32(self)
    }

    #[inline(always)]
    fn from_f32(v: f32) -> bf16 {
        bf16::from_f32(v)
    }
}

/// The horizontal sums of four vectors, as one: 512 → 256 bits by halves, then a `hadd` tree.
#[inline]
#[target_feature(enable = "avx512f")]
pub(crate) fn sum4(a: __m512, b: __m512, c: __m512, d: __m512) -> __m128 {
    let half = |v: __m512| {
        let hi = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(v)));
        _mm256_add_ps(_mm512_castps512_ps256(v), hi)
    };
    let ab = _mm256_hadd_ps(half(a), half(b));
    let cd = _mm256_hadd_ps(half(c), half(d));
    let abcd = _mm256_hadd_ps(ab, cd);
    _mm_add_ps(
        _mm256_castps256_ps128(abcd),
        _mm256_extractf128_ps::<1>(abcd),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[target_feature(enable = "avx512f")]
    fn widen<E: Elem>(xs: &[E; 16], n: usize) -> [f32; 16] {
        let mut out = [0f32; 16];
        // SAFETY: 16 elements (or `n` of them) and 16 floats; AVX-512F is enabled here.
        unsafe {
            let v = if n == 16 {
                E::load16(xs.as_ptr())
            } else {
                E::load_partial(xs.as_ptr(), n)
            };
            _mm512_storeu_ps(out.as_mut_ptr(), v);
        }
        out
    }

    #[test]
    #[cfg_attr(not(host_avx512), ignore = "this CPU has no AVX-512")]
    fn bf16_widens_exactly_and_partial_loads_zero_the_rest() {
        if !is_x86_feature_detected!("avx512f") {
            return;
        }
        let vals: [f32; 16] =
            std::array::from_fn(|i| (i as f32 - 7.3) * 1.37e3_f32.powi(i as i32 % 3 - 1));
        let b: [bf16; 16] = vals.map(bf16::from_f32);
        // SAFETY: AVX-512F is present.
        let wide = unsafe { widen(&b, 16) };
        for (w, x) in wide.iter().zip(b) {
            assert_eq!(*w, x.to_f32());
        }
        // SAFETY: as above.
        let part = unsafe { widen(&b, 5) };
        assert_eq!(&part[..5], &wide[..5]);
        assert!(part[5..].iter().all(|&v| v == 0.0));
        // SAFETY: as above.
        assert_eq!(unsafe { widen(&vals, 16) }, vals);
    }
}
