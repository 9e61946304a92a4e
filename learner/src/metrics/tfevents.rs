//! TensorBoard event files written by hand: TFRecord framing (u64 length, masked CRC-32C of the length,
//! data, masked CRC-32C of the data) around `tensorflow.Event` protobufs carrying
//! `summary.value { tag, simple_value }`.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

/// CRC-32C (Castagnoli, reflected polynomial 0x82F63B78).
pub fn crc32c(data: &[u8]) -> u32 {
    static TABLE: std::sync::OnceLock<[u32; 256]> = std::sync::OnceLock::new();
    let table = TABLE.get_or_init(|| {
        let mut t = [0u32; 256];
        for (i, slot) in t.iter_mut().enumerate() {
            let mut c = i as u32;
            for _ in 0..8 {
                c = if c & 1 != 0 {
                    (c >> 1) ^ 0x82F6_3B78
                } else {
                    c >> 1
                };
            }
            *slot = c;
        }
        t
    });
    let mut crc = !0u32;
    for &b in data {
        crc = table[((crc ^ b as u32) & 0xff) as usize] ^ (crc >> 8);
    }
    !crc
}

/// TFRecord's masking of a CRC, so that CRCs of data containing CRCs stay well distributed.
pub fn masked_crc32c(data: &[u8]) -> u32 {
    let c = crc32c(data);
    (c.rotate_right(15)).wrapping_add(0xa282_ead8)
}

fn varint(mut v: u64, out: &mut Vec<u8>) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

fn len_delimited(field: u32, bytes: &[u8], out: &mut Vec<u8>) {
    varint(((field << 3) | 2) as u64, out);
    varint(bytes.len() as u64, out);
    out.extend_from_slice(bytes);
}

/// `Event { wall_time = 1 (double), step = 2 (int64), file_version = 3 | summary = 5 }`.
fn event(
    wall_time: f64,
    step: i64,
    file_version: Option<&str>,
    scalars: &[(&str, f32)],
) -> Vec<u8> {
    let mut out = Vec::new();
    out.push(0x09); // field 1, 64-bit
    out.extend_from_slice(&wall_time.to_le_bytes());
    out.push(0x10); // field 2, varint
    varint(step as u64, &mut out);
    if let Some(v) = file_version {
        len_delimited(3, v.as_bytes(), &mut out);
    }
    if !scalars.is_empty() {
        let mut summary = Vec::new();
        for (tag, value) in scalars {
            // Summary.Value { tag = 1 (string), simple_value = 2 (float) }
            let mut val = Vec::new();
            len_delimited(1, tag.as_bytes(), &mut val);
            val.push(0x15); // field 2, 32-bit
            val.extend_from_slice(&value.to_le_bytes());
            len_delimited(1, &val, &mut summary);
        }
        len_delimited(5, &summary, &mut out);
    }
    out
}

/// Frames one record.
pub(crate) fn tfrecord(data: &[u8]) -> Vec<u8> {
    let len = (data.len() as u64).to_le_bytes();
    let mut out = Vec::with_capacity(data.len() + 16);
    out.extend_from_slice(&len);
    out.extend_from_slice(&masked_crc32c(&len).to_le_bytes());
    out.extend_from_slice(data);
    out.extend_from_slice(&masked_crc32c(data).to_le_bytes());
    out
}

/// An `events.out.tfevents.*` file.
pub struct EventWriter {
    out: BufWriter<File>,
    path: PathBuf,
}

impl EventWriter {
    pub fn create(dir: &Path) -> std::io::Result<Self> {
        let host = std::fs::read_to_string("/etc/hostname")
            .map(|h| h.trim().to_string())
            .unwrap_or_else(|_| "localhost".into());
        let now = super::now_secs();
        let path = dir.join(format!(
            "events.out.tfevents.{}.{host}.{}",
            now as u64,
            std::process::id()
        ));
        let mut w = Self {
            out: BufWriter::new(File::create(&path)?),
            path,
        };
        w.out
            .write_all(&tfrecord(&event(now, 0, Some("brain.Event:2"), &[])))?;
        w.out.flush()?;
        Ok(w)
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn write_scalars(
        &mut self,
        step: i64,
        wall_time: f64,
        scalars: &[(&str, f32)],
    ) -> std::io::Result<()> {
        self.out
            .write_all(&tfrecord(&event(wall_time, step, None, scalars)))?;
        self.out.flush()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn crc32c_matches_the_standard_check_value() {
        // The CRC catalogue's check value for CRC-32C over "123456789".
        assert_eq!(crc32c(b"123456789"), 0xE306_9283);
        assert_eq!(crc32c(b""), 0);
    }

    #[test]
    fn event_bytes_encode_the_summary_protobuf() {
        let e = event(1.0, 7, None, &[("a", 2.0)]);
        // wall_time, step 7, then summary (field 5) { value (field 1) { tag "a", simple_value 2.0 } }
        let mut expected = vec![0x09];
        expected.extend_from_slice(&1.0f64.to_le_bytes());
        expected.extend_from_slice(&[0x10, 7, 0x2a, 10, 0x0a, 8, 0x0a, 1, b'a', 0x15]);
        expected.extend_from_slice(&2.0f32.to_le_bytes());
        assert_eq!(e, expected);
        let rec = tfrecord(&e);
        assert_eq!(
            u64::from_le_bytes(rec[..8].try_into().unwrap()),
            e.len() as u64
        );
        assert_eq!(
            u32::from_le_bytes(rec[8..12].try_into().unwrap()),
            masked_crc32c(&rec[..8])
        );
        assert_eq!(&rec[12..12 + e.len()], &e[..]);
    }
}
