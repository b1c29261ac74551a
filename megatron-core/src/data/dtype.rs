//! The token types of an indexed dataset and their codes in the `.idx` header.

use std::fmt;
use std::str::FromStr;

/// The element type of a `.bin` file, with Megatron-LM's numeric code (`indexed_dataset.DType`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DType {
    /// Code 1.
    U8,
    /// Code 2.
    I8,
    /// Code 3.
    I16,
    /// Code 4.
    I32,
    /// Code 5.
    I64,
    /// Code 6 (a code of the format; token files never hold floats).
    F64,
    /// Code 7 (a code of the format; token files never hold floats).
    F32,
    /// Code 8.
    U16,
}

impl DType {
    /// Every type of the format, in code order.
    pub const ALL: [DType; 8] = [
        DType::U8,
        DType::I8,
        DType::I16,
        DType::I32,
        DType::I64,
        DType::F64,
        DType::F32,
        DType::U16,
    ];

    /// The type's code in the `.idx` header.
    pub fn code(self) -> u8 {
        match self {
            DType::U8 => 1,
            DType::I8 => 2,
            DType::I16 => 3,
            DType::I32 => 4,
            DType::I64 => 5,
            DType::F64 => 6,
            DType::F32 => 7,
            DType::U16 => 8,
        }
    }

    /// The type of a header code, if the code is one of the format's.
    pub fn from_code(code: u8) -> Option<DType> {
        DType::ALL.into_iter().find(|d| d.code() == code)
    }

    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            DType::U8 | DType::I8 => 1,
            DType::I16 | DType::U16 => 2,
            DType::I32 | DType::F32 => 4,
            DType::I64 | DType::F64 => 8,
        }
    }

    /// NumPy's name of the type (`uint16`, `int32`, ...).
    pub fn name(self) -> &'static str {
        match self {
            DType::U8 => "uint8",
            DType::I8 => "int8",
            DType::I16 => "int16",
            DType::I32 => "int32",
            DType::I64 => "int64",
            DType::F64 => "float64",
            DType::F32 => "float32",
            DType::U16 => "uint16",
        }
    }

    /// Whether the type holds integers (token ids); the float codes exist in the format only.
    pub fn is_integer(self) -> bool {
        !matches!(self, DType::F32 | DType::F64)
    }

    /// The type Megatron-LM's `DType.optimal_dtype` picks for a vocabulary: `uint16` below
    /// 65,500 symbols, `int32` otherwise.
    pub fn optimal(vocab_size: usize) -> DType {
        if vocab_size < 65_500 {
            DType::U16
        } else {
            DType::I32
        }
    }

    /// Decodes element `i` of little-endian `bytes` of this type as an integer.
    ///
    /// Float types decode to their value truncated toward zero (the format allows them; token
    /// files never use them).
    #[inline]
    pub(crate) fn decode(self, bytes: &[u8], i: usize) -> i64 {
        let s = self.size();
        let b = &bytes[i * s..(i + 1) * s];
        match self {
            DType::U8 => i64::from(b[0]),
            DType::I8 => i64::from(b[0] as i8),
            DType::I16 => i64::from(i16::from_le_bytes([b[0], b[1]])),
            DType::U16 => i64::from(u16::from_le_bytes([b[0], b[1]])),
            DType::I32 => i64::from(i32::from_le_bytes([b[0], b[1], b[2], b[3]])),
            DType::I64 => i64::from_le_bytes(b.try_into().expect("8 bytes")),
            DType::F32 => f32::from_le_bytes([b[0], b[1], b[2], b[3]]) as i64,
            DType::F64 => f64::from_le_bytes(b.try_into().expect("8 bytes")) as i64,
        }
    }

    /// The smallest and largest token id the type can hold.
    pub fn range(self) -> (i64, i64) {
        match self {
            DType::U8 => (0, i64::from(u8::MAX)),
            DType::I8 => (i64::from(i8::MIN), i64::from(i8::MAX)),
            DType::I16 => (i64::from(i16::MIN), i64::from(i16::MAX)),
            DType::U16 => (0, i64::from(u16::MAX)),
            DType::I32 => (i64::from(i32::MIN), i64::from(i32::MAX)),
            DType::I64 | DType::F64 | DType::F32 => (i64::MIN, i64::MAX),
        }
    }

    /// Appends `value` to `out` as little-endian bytes of this type. The caller checks the range.
    #[inline]
    pub(crate) fn encode(self, value: i64, out: &mut Vec<u8>) {
        match self {
            DType::U8 => out.push(value as u8),
            DType::I8 => out.push(value as i8 as u8),
            DType::I16 => out.extend_from_slice(&(value as i16).to_le_bytes()),
            DType::U16 => out.extend_from_slice(&(value as u16).to_le_bytes()),
            DType::I32 => out.extend_from_slice(&(value as i32).to_le_bytes()),
            DType::I64 => out.extend_from_slice(&value.to_le_bytes()),
            DType::F32 => out.extend_from_slice(&(value as f32).to_le_bytes()),
            DType::F64 => out.extend_from_slice(&(value as f64).to_le_bytes()),
        }
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for DType {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        DType::ALL
            .into_iter()
            .find(|d| d.name() == s)
            .ok_or_else(|| format!("unknown dtype {s:?} (expected one of uint8, int8, int16, int32, int64, float64, float32, uint16)"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_are_megatrons() {
        let codes: Vec<(u8, &str)> = DType::ALL.iter().map(|d| (d.code(), d.name())).collect();
        assert_eq!(
            codes,
            [
                (1, "uint8"),
                (2, "int8"),
                (3, "int16"),
                (4, "int32"),
                (5, "int64"),
                (6, "float64"),
                (7, "float32"),
                (8, "uint16")
            ]
        );
        assert_eq!(DType::from_code(0), None);
        assert_eq!(DType::from_code(9), None);
        assert_eq!(DType::optimal(50_257), DType::U16);
        assert_eq!(DType::optimal(65_499), DType::U16);
        assert_eq!(DType::optimal(65_500), DType::I32);
        assert_eq!(DType::optimal(128_256), DType::I32);
    }

    #[test]
    fn encode_decode_round_trip() {
        for d in DType::ALL {
            let (lo, hi) = d.range();
            let vals: Vec<i64> = if d.is_integer() {
                vec![lo, 0, 1, hi]
            } else {
                vec![0, 1, 1000]
            };
            let mut bytes = Vec::new();
            for &v in &vals {
                d.encode(v, &mut bytes);
            }
            assert_eq!(bytes.len(), vals.len() * d.size());
            for (i, &v) in vals.iter().enumerate() {
                assert_eq!(d.decode(&bytes, i), v, "{d}");
            }
        }
    }
}
