//! Conversion of GGML block formats to `f32`.
//!
//! Layouts follow the GGML format specification (`ggml-common.h` block structs); every block is
//! read with explicit little-endian byte access, so unaligned data in a memory map is fine. Large
//! tensors are split across threads by whole blocks.

use std::sync::OnceLock;

use super::{GgmlType, GgufError, Result};

/// Below this many output elements the work is not worth spawning threads for.
const PARALLEL_MIN_ELEMENTS: usize = 1 << 20;

/// Dequantises `data` (whole blocks of type `ty`) into `out`.
///
/// `out.len()` must be the number of elements the blocks encode. Returns
/// [`GgufError::UnsupportedType`] (with an empty tensor name) for types without a kernel here.
pub fn dequantize_into(ty: GgmlType, data: &[u8], out: &mut [f32]) -> Result<()> {
    let kernel: fn(&[u8], &mut [f32]) = match ty {
        GgmlType::F32 => block_f32,
        GgmlType::F16 => block_f16,
        GgmlType::BF16 => block_bf16,
        GgmlType::Q4_0 => block_q4_0,
        GgmlType::Q4_1 => block_q4_1,
        GgmlType::Q5_0 => block_q5_0,
        GgmlType::Q5_1 => block_q5_1,
        GgmlType::Q8_0 => block_q8_0,
        GgmlType::Q4K => block_q4_k,
        GgmlType::Q5K => block_q5_k,
        GgmlType::Q6K => block_q6_k,
        _ => {
            return Err(GgufError::UnsupportedType {
                tensor: String::new(),
                ty,
            });
        }
    };
    let (block_elems, block_bytes) = ty
        .block_layout()
        .expect("kernels exist only for known layouts");
    if !out.len().is_multiple_of(block_elems) || data.len() != out.len() / block_elems * block_bytes
    {
        return Err(GgufError::SizeMismatch(format!(
            "{} bytes of {ty} cannot fill {} f32 values",
            data.len(),
            out.len()
        )));
    }
    // Scalar types are processed many elements per call so the inner loops can vectorise.
    let group = if block_elems == 1 { 256 } else { 1 };
    let chunk_elems = block_elems * group;
    let chunk_bytes = block_bytes * group;
    let run = |data: &[u8], out: &mut [f32]| {
        for (src, dst) in data.chunks(chunk_bytes).zip(out.chunks_mut(chunk_elems)) {
            kernel(src, dst);
        }
    };

    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    if threads <= 1 || out.len() < PARALLEL_MIN_ELEMENTS {
        run(data, out);
        return Ok(());
    }
    let n_chunks = out.len().div_ceil(chunk_elems);
    let per_thread = n_chunks.div_ceil(threads);
    std::thread::scope(|s| {
        for (src, dst) in data
            .chunks(per_thread * chunk_bytes)
            .zip(out.chunks_mut(per_thread * chunk_elems))
        {
            s.spawn(move || run(src, dst));
        }
    });
    Ok(())
}

fn f16_table() -> &'static [f32] {
    static TABLE: OnceLock<Vec<f32>> = OnceLock::new();
    TABLE.get_or_init(|| {
        (0..=u16::MAX)
            .map(|b| half::f16::from_bits(b).to_f32())
            .collect()
    })
}

#[inline(always)]
fn f16_at(b: &[u8], i: usize) -> f32 {
    f16_table()[u16::from_le_bytes([b[i], b[i + 1]]) as usize]
}

fn block_f32(src: &[u8], dst: &mut [f32]) {
    for (d, s) in dst.iter_mut().zip(src.chunks_exact(4)) {
        *d = f32::from_le_bytes([s[0], s[1], s[2], s[3]]);
    }
}

fn block_f16(src: &[u8], dst: &mut [f32]) {
    let table = f16_table();
    for (d, s) in dst.iter_mut().zip(src.chunks_exact(2)) {
        *d = table[u16::from_le_bytes([s[0], s[1]]) as usize];
    }
}

fn block_bf16(src: &[u8], dst: &mut [f32]) {
    for (d, s) in dst.iter_mut().zip(src.chunks_exact(2)) {
        *d = f32::from_bits((u16::from_le_bytes([s[0], s[1]]) as u32) << 16);
    }
}

// block_q4_0 { f16 d; u8 qs[16]; }: x[j] = (lo(qs[j]) - 8) d, x[j+16] = (hi(qs[j]) - 8) d.
fn block_q4_0(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    let qs = &b[2..18];
    for j in 0..16 {
        y[j] = ((qs[j] & 0x0f) as i32 - 8) as f32 * d;
        y[j + 16] = ((qs[j] >> 4) as i32 - 8) as f32 * d;
    }
}

// block_q4_1 { f16 d; f16 m; u8 qs[16]; }: x = q d + m.
fn block_q4_1(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    let m = f16_at(b, 2);
    let qs = &b[4..20];
    for j in 0..16 {
        y[j] = (qs[j] & 0x0f) as f32 * d + m;
        y[j + 16] = (qs[j] >> 4) as f32 * d + m;
    }
}

// block_q5_0 { f16 d; u8 qh[4]; u8 qs[16]; }: bit j of qh is the 5th bit of element j.
fn block_q5_0(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
    let qs = &b[6..22];
    for j in 0..16 {
        let h0 = ((qh >> j) << 4) & 0x10;
        let h1 = (qh >> (j + 12)) & 0x10;
        y[j] = (((qs[j] & 0x0f) as u32 | h0) as i32 - 16) as f32 * d;
        y[j + 16] = (((qs[j] >> 4) as u32 | h1) as i32 - 16) as f32 * d;
    }
}

// block_q5_1 { f16 d; f16 m; u8 qh[4]; u8 qs[16]; }: x = q d + m.
fn block_q5_1(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    let m = f16_at(b, 2);
    let qh = u32::from_le_bytes([b[4], b[5], b[6], b[7]]);
    let qs = &b[8..24];
    for j in 0..16 {
        let h0 = ((qh >> j) << 4) & 0x10;
        let h1 = (qh >> (j + 12)) & 0x10;
        y[j] = ((qs[j] & 0x0f) as u32 | h0) as f32 * d + m;
        y[j + 16] = ((qs[j] >> 4) as u32 | h1) as f32 * d + m;
    }
}

// block_q8_0 { f16 d; i8 qs[32]; }: x = q d.
fn block_q8_0(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    for (yj, &q) in y.iter_mut().zip(&b[2..34]) {
        *yj = (q as i8) as f32 * d;
    }
}

/// The 6-bit scale and min of sub-block `j` (0..8) packed in the 12 `scales` bytes of Q4_K/Q5_K.
#[inline(always)]
fn scale_min_k4(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        (
            (q[j + 4] & 0x0f) | ((q[j - 4] >> 6) << 4),
            (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
        )
    }
}

// block_q4_K { f16 d; f16 dmin; u8 scales[12]; u8 qs[128]; }: eight sub-blocks of 32, each
// x = d*sc*q - dmin*m; two sub-blocks share 32 bytes of qs (low then high nibbles).
fn block_q4_k(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    let dmin = f16_at(b, 2);
    let scales = &b[4..16];
    let qs = &b[16..144];
    for (n, (q, out)) in qs.chunks_exact(32).zip(y.chunks_exact_mut(64)).enumerate() {
        let (sc1, m1) = scale_min_k4(2 * n, scales);
        let (sc2, m2) = scale_min_k4(2 * n + 1, scales);
        let (d1, m1) = (d * sc1 as f32, dmin * m1 as f32);
        let (d2, m2) = (d * sc2 as f32, dmin * m2 as f32);
        let (lo, hi) = out.split_at_mut(32);
        for l in 0..32 {
            lo[l] = d1 * (q[l] & 0x0f) as f32 - m1;
            hi[l] = d2 * (q[l] >> 4) as f32 - m2;
        }
    }
}

// block_q5_K { f16 d; f16 dmin; u8 scales[12]; u8 qh[32]; u8 qs[128]; }: like Q4_K with a fifth
// bit per element taken from qh, bit (2n) for the low-nibble sub-block and (2n+1) for the high one.
fn block_q5_k(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    let dmin = f16_at(b, 2);
    let scales = &b[4..16];
    let qh = &b[16..48];
    let qs = &b[48..176];
    for (n, (q, out)) in qs.chunks_exact(32).zip(y.chunks_exact_mut(64)).enumerate() {
        let (sc1, m1) = scale_min_k4(2 * n, scales);
        let (sc2, m2) = scale_min_k4(2 * n + 1, scales);
        let (d1, m1) = (d * sc1 as f32, dmin * m1 as f32);
        let (d2, m2) = (d * sc2 as f32, dmin * m2 as f32);
        let (u1, u2) = (1u8 << (2 * n), 2u8 << (2 * n));
        let (lo, hi) = out.split_at_mut(32);
        for l in 0..32 {
            let h1 = if qh[l] & u1 != 0 { 16 } else { 0 };
            let h2 = if qh[l] & u2 != 0 { 16 } else { 0 };
            lo[l] = d1 * ((q[l] & 0x0f) + h1) as f32 - m1;
            hi[l] = d2 * ((q[l] >> 4) + h2) as f32 - m2;
        }
    }
}

// block_q6_K { u8 ql[128]; u8 qh[64]; i8 scales[16]; f16 d; }: two halves of 128 elements, each
// using 64 bytes of ql (low 4 bits), 32 bytes of qh (2 high bits each) and 8 scales.
fn block_q6_k(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 208);
    for half in 0..2 {
        let ql = &b[half * 64..half * 64 + 64];
        let qh = &b[128 + half * 32..128 + half * 32 + 32];
        let sc = &b[192 + half * 8..192 + half * 8 + 8];
        let out = &mut y[half * 128..half * 128 + 128];
        for l in 0..32 {
            let is = l / 16;
            let q1 = ((ql[l] & 0x0f) | ((qh[l] & 3) << 4)) as i32 - 32;
            let q2 = ((ql[l + 32] & 0x0f) | (((qh[l] >> 2) & 3) << 4)) as i32 - 32;
            let q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i32 - 32;
            let q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i32 - 32;
            out[l] = d * (sc[is] as i8) as f32 * q1 as f32;
            out[l + 32] = d * (sc[is + 2] as i8) as f32 * q2 as f32;
            out[l + 64] = d * (sc[is + 4] as i8) as f32 * q3 as f32;
            out[l + 96] = d * (sc[is + 6] as i8) as f32 * q4 as f32;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn q8_0_block_scales_signed_bytes() {
        let mut b = vec![0u8; 34];
        b[..2].copy_from_slice(&half::f16::from_f32(0.5).to_bits().to_le_bytes());
        b[2] = 4;
        b[3] = (-6i8) as u8;
        let mut y = [0f32; 32];
        dequantize_into(GgmlType::Q8_0, &b, &mut y).unwrap();
        assert_eq!(&y[..3], &[2.0, -3.0, 0.0]);
    }

    #[test]
    fn q4_k_uses_high_scale_bits_for_upper_subblocks() {
        let mut b = vec![0u8; 144];
        b[..2].copy_from_slice(&half::f16::from_f32(1.0).to_bits().to_le_bytes());
        // Sub-block 4: scale = (scales[8] & 0xf) | ((scales[0] >> 6) << 4) = 1 | (1 << 4) = 17.
        b[4] = 0b0100_0000;
        b[4 + 8] = 0x01;
        // Element 0 of sub-block 4 is the low nibble of qs[64].
        b[16 + 64] = 0x03;
        let mut y = [0f32; 256];
        dequantize_into(GgmlType::Q4K, &b, &mut y).unwrap();
        assert_eq!(y[128], 17.0 * 3.0);
        assert_eq!(y[0], 0.0);
    }

    #[test]
    fn wrong_length_is_an_error_not_a_panic() {
        let mut y = [0f32; 32];
        assert!(matches!(
            dequantize_into(GgmlType::Q4_0, &[0u8; 17], &mut y),
            Err(GgufError::SizeMismatch(_))
        ));
        assert!(matches!(
            dequantize_into(GgmlType::Q2K, &[0u8; 84], &mut [0f32; 256]),
            Err(GgufError::UnsupportedType {
                ty: GgmlType::Q2K,
                ..
            })
        ));
    }
}
