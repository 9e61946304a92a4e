//! Ragged per-token rows as one right-padded tensor, the shape the losses take.

use tch::Tensor;

/// Right-pads rows of per-token values into a (K, width) f32 tensor.
pub fn pad_values<'a>(rows: impl Iterator<Item = &'a [f32]>, width: usize) -> Tensor {
    let rows: Vec<&[f32]> = rows.collect();
    let mut flat = vec![0f32; rows.len() * width];
    for (i, r) in rows.iter().enumerate() {
        let n = r.len().min(width);
        flat[i * width..i * width + n].copy_from_slice(&r[..n]);
    }
    Tensor::from_slice(&flat).view([rows.len() as i64, width as i64])
}
