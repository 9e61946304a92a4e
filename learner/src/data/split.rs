//! Split expressions as the original configs write them: `test`, `test[16:]`, `train[:1100]`,
//! `test[33:163]`, negative indices (`test[-10:]`) and percentages (`train[:10%]`).

use std::fmt;
use std::ops::Range;

/// A parsed split expression.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SplitSpec {
    /// The split's name (`train`, `test`, `val`, ...).
    pub name: String,
    pub start: Option<Bound>,
    pub end: Option<Bound>,
}

/// One end of a slice.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Bound {
    /// A row index; negative counts from the end, as in Python.
    Index(i64),
    /// A percentage of the split's rows (0–100; negative counts from the end).
    Percent(i64),
}

/// Why a split expression is wrong.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SplitError {
    /// The text is not `name` or `name[start:end]`.
    #[error(
        "bad split syntax `{0}` (expected `name` or `name[start:end]`, e.g. `test[16:]`, `train[:1100]`)"
    )]
    Syntax(String),
    /// The slice does not fit the split's rows.
    #[error("split `{spec}` is out of range: split `{name}` has {len} rows")]
    OutOfRange {
        spec: String,
        name: String,
        len: usize,
    },
    /// The slice selects no rows.
    #[error("split `{spec}` selects no rows (start {start} >= end {end})")]
    Empty {
        spec: String,
        start: usize,
        end: usize,
    },
}

impl SplitSpec {
    /// Parses `name` or `name[start:end]`.
    pub fn parse(text: &str) -> Result<Self, SplitError> {
        let bad = || SplitError::Syntax(text.to_string());
        let text_trim = text.trim();
        let (name, slice) = match text_trim.find('[') {
            None => (text_trim, None),
            Some(open) => {
                let inner = text_trim[open + 1..].strip_suffix(']').ok_or_else(bad)?;
                (&text_trim[..open], Some(inner))
            }
        };
        let name_ok = !name.is_empty()
            && name
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-' || c == '.');
        if !name_ok {
            return Err(bad());
        }
        let (start, end) = match slice {
            None => (None, None),
            Some(inner) => {
                let (a, b) = inner.split_once(':').ok_or_else(bad)?;
                (
                    parse_bound(a).ok_or_else(bad)?,
                    parse_bound(b).ok_or_else(bad)?,
                )
            }
        };
        Ok(Self {
            name: name.to_string(),
            start,
            end,
        })
    }

    /// The rows selected out of a split of `len` rows.
    pub fn resolve(&self, len: usize) -> Result<Range<usize>, SplitError> {
        let out = || SplitError::OutOfRange {
            spec: self.to_string(),
            name: self.name.clone(),
            len,
        };
        let resolve_bound = |b: Bound| -> Result<usize, SplitError> {
            let (value, is_pct) = match b {
                Bound::Index(i) => (i, false),
                Bound::Percent(p) => (p, true),
            };
            let magnitude = if is_pct {
                if value.unsigned_abs() > 100 {
                    return Err(out());
                }
                // HF rounds percent boundaries to the closest row.
                ((value.unsigned_abs() as f64) * len as f64 / 100.0).round() as usize
            } else {
                value.unsigned_abs() as usize
            };
            if magnitude > len {
                return Err(out());
            }
            Ok(if value < 0 {
                len - magnitude
            } else {
                magnitude
            })
        };
        let start = self.start.map(resolve_bound).transpose()?.unwrap_or(0);
        let end = self.end.map(resolve_bound).transpose()?.unwrap_or(len);
        if start >= end {
            return Err(SplitError::Empty {
                spec: self.to_string(),
                start,
                end,
            });
        }
        Ok(start..end)
    }
}

fn parse_bound(text: &str) -> Option<Option<Bound>> {
    let t = text.trim();
    if t.is_empty() {
        return Some(None);
    }
    if let Some(p) = t.strip_suffix('%') {
        return p.trim().parse().ok().map(|v| Some(Bound::Percent(v)));
    }
    t.parse().ok().map(|v| Some(Bound::Index(v)))
}

impl fmt::Display for Bound {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Bound::Index(i) => write!(f, "{i}"),
            Bound::Percent(p) => write!(f, "{p}%"),
        }
    }
}

impl fmt::Display for SplitSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.name)?;
        if self.start.is_some() || self.end.is_some() {
            let s = self.start.map(|b| b.to_string()).unwrap_or_default();
            let e = self.end.map(|b| b.to_string()).unwrap_or_default();
            write!(f, "[{s}:{e}]")?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seed_config_splits_resolve_like_python_slices() {
        assert_eq!(
            SplitSpec::parse("test[33:163]")
                .unwrap()
                .resolve(164)
                .unwrap(),
            33..163
        );
        assert_eq!(
            SplitSpec::parse("test[:32]").unwrap().resolve(164).unwrap(),
            0..32
        );
        assert_eq!(
            SplitSpec::parse("test[16:]").unwrap().resolve(82).unwrap(),
            16..82
        );
        assert_eq!(
            SplitSpec::parse("test").unwrap().resolve(82).unwrap(),
            0..82
        );
        assert_eq!(
            SplitSpec::parse("test[-10:]").unwrap().resolve(82).unwrap(),
            72..82
        );
        assert_eq!(
            SplitSpec::parse("test[:-2]").unwrap().resolve(82).unwrap(),
            0..80
        );
        assert_eq!(
            SplitSpec::parse("train[:10%]")
                .unwrap()
                .resolve(1945)
                .unwrap(),
            0..195
        );
    }

    #[test]
    fn bad_syntax_and_ranges_are_errors() {
        for bad in ["test[16]", "test[a:]", "[1:2]", "test[1:2", "te st"] {
            assert!(
                matches!(SplitSpec::parse(bad), Err(SplitError::Syntax(_))),
                "{bad}"
            );
        }
        let e = SplitSpec::parse("test[33:200]")
            .unwrap()
            .resolve(164)
            .unwrap_err();
        assert_eq!(
            e.to_string(),
            "split `test[33:200]` is out of range: split `test` has 164 rows"
        );
        assert!(matches!(
            SplitSpec::parse("test[5:5]").unwrap().resolve(10),
            Err(SplitError::Empty { .. })
        ));
        assert!(SplitSpec::parse("test[-11:]").unwrap().resolve(10).is_err());
    }
}
