//! Non-negative decimal quantities written as numbers or strings
//! (`10`, `2.5`, `"0.5"`). Rejected: units (`100Mbit`), signs (`-1`), a bare
//! fraction (`.5`), exponents, hex (`0x64`), anything else. Kept as a scaled
//! integer (millionths) so conversions are exact.

use std::fmt;

use serde::{Deserialize, Deserializer, Serialize, Serializer, de};

/// Fixed point with 6 decimal places.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Decimal {
    micros: u64,
}

const SCALE: u64 = 1_000_000;

impl Decimal {
    pub fn parse(s: &str) -> Result<Decimal, String> {
        let bad = || format!("{s:?} is not a non-negative decimal number (like 10 or 2.5)");
        let (int, frac) = match s.split_once('.') {
            Some((i, f)) => (i, f),
            None => (s, ""),
        };
        if int.is_empty() || !int.bytes().all(|b| b.is_ascii_digit()) {
            return Err(bad());
        }
        if s.contains('.') && (frac.is_empty() || !frac.bytes().all(|b| b.is_ascii_digit())) {
            return Err(bad());
        }
        if frac.len() > 6 {
            return Err(format!("{s:?} has more than 6 decimal places"));
        }
        let i: u64 = int.parse().map_err(|_| bad())?;
        let f: u64 = if frac.is_empty() { 0 } else { format!("{frac:0<6}").parse().map_err(|_| bad())? };
        i.checked_mul(SCALE)
            .and_then(|v| v.checked_add(f))
            .map(|micros| Decimal { micros })
            .ok_or_else(|| format!("{s:?} is too large"))
    }

    pub fn from_f64(v: f64) -> Result<Decimal, String> {
        if !v.is_finite() || v < 0.0 {
            return Err(format!("{v} is not a non-negative decimal number"));
        }
        Decimal::parse(&format!("{v}"))
    }

    pub fn micros(self) -> u64 {
        self.micros
    }

    pub fn is_zero(self) -> bool {
        self.micros == 0
    }

    /// Mbit/s (SI) → bytes per second.
    pub fn mbps_to_bytes_per_sec(self) -> u64 {
        // micros × 10⁶ bit / 10⁶ / 8
        self.micros / 8
    }

    /// MB (binary) → bytes.
    pub fn mb_to_bytes(self) -> u64 {
        ((self.micros as u128 * (1u128 << 20)) / SCALE as u128) as u64
    }
}

impl fmt::Display for Decimal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (i, frac) = (self.micros / SCALE, self.micros % SCALE);
        if frac == 0 { write!(f, "{i}") } else { write!(f, "{i}.{}", format!("{frac:06}").trim_end_matches('0')) }
    }
}

impl Serialize for Decimal {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.to_string())
    }
}

impl<'de> Deserialize<'de> for Decimal {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl de::Visitor<'_> for V {
            type Value = Decimal;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a non-negative decimal number or string")
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<Decimal, E> {
                Decimal::parse(&v.to_string()).map_err(E::custom)
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<Decimal, E> {
                if v < 0 {
                    return Err(E::custom(format!("{v} is negative")));
                }
                self.visit_u64(v as u64)
            }
            fn visit_f64<E: de::Error>(self, v: f64) -> Result<Decimal, E> {
                Decimal::from_f64(v).map_err(E::custom)
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Decimal, E> {
                Decimal::parse(v).map_err(E::custom)
            }
        }
        d.deserialize_any(V)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_and_rejects() {
        assert_eq!(Decimal::parse("10").unwrap().micros(), 10_000_000);
        assert_eq!(Decimal::parse("0.5").unwrap().micros(), 500_000);
        assert_eq!(Decimal::parse("2.5").unwrap().to_string(), "2.5");
        assert_eq!(Decimal::parse("0").unwrap().to_string(), "0");
        for bad in [
            "100Mbit",
            "-1",
            ".5",
            "5.",
            "",
            " 5",
            "1e3",
            "0x64",
            "1.2.3",
            "+1",
            "1,5",
            "0.1234567",
            "$(reboot)",
            "100;rm -rf /",
        ] {
            assert!(Decimal::parse(bad).is_err(), "{bad} accepted");
        }
    }

    #[test]
    fn unit_conversions_are_exact() {
        // 10 Mbit/s = 1 250 000 B/s; 1 MB = 1 048 576 B; 0.3 MB = 314 572 B (floor).
        assert_eq!(Decimal::parse("10").unwrap().mbps_to_bytes_per_sec(), 1_250_000);
        assert_eq!(Decimal::parse("2.5").unwrap().mbps_to_bytes_per_sec(), 312_500);
        assert_eq!(Decimal::parse("1").unwrap().mb_to_bytes(), 1 << 20);
        assert_eq!(Decimal::parse("0.3").unwrap().mb_to_bytes(), 314_572);
    }
}
