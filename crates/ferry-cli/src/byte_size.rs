//! Memory sizes on the command line: `1073741824`, `512MiB`, `1GiB`, `2GB`, `1.5G`.
//!
//! Binary suffixes (`KiB`, `MiB`, `GiB`, `TiB`, or bare `K`/`M`/`G`/`T`) are powers of 1024;
//! decimal ones (`KB`, `MB`, `GB`, `TB`) powers of 1000. Small enough that a crate is not
//! worth its dependency.

use std::str::FromStr;

/// A size in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ByteSize(pub u64);

impl FromStr for ByteSize {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let s = s.trim();
        let split = s
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .unwrap_or(s.len());
        let (number, unit) = s.split_at(split);
        let value: f64 = number
            .parse()
            .map_err(|_| format!("{s:?} is not a size (examples: 1073741824, 512MiB, 1GiB)"))?;
        let scale: u64 = match unit.trim().to_ascii_lowercase().as_str() {
            "" | "b" => 1,
            "k" | "kib" => 1 << 10,
            "m" | "mib" => 1 << 20,
            "g" | "gib" => 1 << 30,
            "t" | "tib" => 1 << 40,
            "kb" => 1_000,
            "mb" => 1_000_000,
            "gb" => 1_000_000_000,
            "tb" => 1_000_000_000_000,
            other => return Err(format!("unknown size unit {other:?} in {s:?}")),
        };
        let bytes = value * scale as f64;
        if !bytes.is_finite() || bytes >= u64::MAX as f64 {
            return Err(format!("{s:?} is too large"));
        }
        Ok(Self(bytes as u64))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse_with_binary_and_decimal_units() {
        let parse = |s: &str| s.parse::<ByteSize>().map(|b| b.0);
        assert_eq!(parse("1073741824"), Ok(1 << 30));
        assert_eq!(parse("1GiB"), Ok(1 << 30));
        assert_eq!(parse("512MiB"), Ok(512 << 20));
        assert_eq!(parse("1.5G"), Ok(3 << 29));
        assert_eq!(parse("2GB"), Ok(2_000_000_000));
        assert_eq!(parse(" 64 KiB "), Ok(64 << 10));
        assert!(parse("lots").unwrap_err().contains("not a size"));
        assert!(parse("3 parsecs")
            .unwrap_err()
            .contains("unknown size unit"));
        assert!(parse("1e30").is_err());
    }
}
