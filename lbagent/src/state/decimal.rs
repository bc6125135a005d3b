//! Numbers as the state file writes them: plain decimal digits.
//!
//! - Integers (ports, prefix lengths, weights, priorities, seconds,
//!   counts): `80`, or `"80"`. Rejected: signs (`+80`, `-1`), leading
//!   zeros (`080`), hex, octal and binary (`0x50`, `0o12`, `0b101`),
//!   fractions and exponents (`80.0`, `1e3`), `_` separators.
//! - Non-negative decimal quantities (rates, bursts) written as numbers or
//!   strings (`10`, `2.5`, `"0.5"`). Rejected: units (`100Mbit`), signs
//!   (`-1`, `+1`), a bare fraction (`.5`), leading zeros (`010`), exponents,
//!   hex (`0x64`), anything else. Kept as a scaled integer (millionths) so
//!   conversions are exact.
//!
//! YAML resolves `+80`, `0x50`, `0o12` and `1e3` to numbers before a field
//! sees them, so while `load::parse` reads a YAML document (`reading_yaml`)
//! these fields ask for the scalar's text instead and check it themselves.
//! JSON numbers are decimal by grammar (no sign, no leading zero); JSON
//! gives a field the number's value (an exponent is not seen there).

use std::{cell::Cell, fmt, marker::PhantomData};

use serde::{Deserialize, Deserializer, Serialize, Serializer, de};

thread_local! {
    /// Set while `load::parse` deserializes a YAML document.
    static YAML_TEXT: Cell<bool> = const { Cell::new(false) };
}

/// Runs `f` (a YAML deserialization) with number fields reading the
/// scalars' text.
pub(super) fn reading_yaml<T>(f: impl FnOnce() -> T) -> T {
    struct Restore(bool);
    impl Drop for Restore {
        fn drop(&mut self) {
            YAML_TEXT.with(|c| c.set(self.0));
        }
    }
    let _restore = Restore(YAML_TEXT.with(|c| c.replace(true)));
    f()
}

fn yaml_text() -> bool {
    YAML_TEXT.with(Cell::get)
}

/// Whether `s` is some other spelling of a number (a sign, a prefix, a
/// fraction, an exponent, `.inf`), as opposed to something else entirely.
fn looks_numeric(s: &str) -> bool {
    let t = s.trim_start_matches(['+', '-']);
    let t = t.strip_prefix('.').unwrap_or(t);
    let spelled = t.starts_with(|c: char| c.is_ascii_digit())
        && t.bytes().all(|b| b.is_ascii_alphanumeric() || b"._+-".contains(&b));
    spelled || matches!(t.to_ascii_lowercase().as_str(), "inf" | "nan")
}

/// An integer written in plain decimal digits, without a leading zero.
fn plain_integer(s: &str) -> Result<u64, Option<String>> {
    if !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit()) && (s == "0" || !s.starts_with('0')) {
        return s.parse().map_err(|_| Some(format!("{s} is too large")));
    }
    if looks_numeric(s) {
        return Err(Some(format!(
            "{s:?} is not a plain decimal integer (digits only: no sign, leading zero, 0x/0o/0b prefix, '_', \
             fraction or exponent)"
        )));
    }
    Err(None)
}

struct Integer<T>(PhantomData<T>);

impl<'de, T: TryFrom<u64>> de::Visitor<'de> for Integer<T> {
    type Value = T;
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("an integer in decimal digits")
    }
    fn visit_u64<E: de::Error>(self, v: u64) -> Result<T, E> {
        T::try_from(v).map_err(|_| E::custom(format!("{v} is too large")))
    }
    fn visit_i64<E: de::Error>(self, v: i64) -> Result<T, E> {
        match u64::try_from(v) {
            Ok(v) => self.visit_u64(v),
            Err(_) => Err(E::custom(format!("{v} is negative"))),
        }
    }
    fn visit_f64<E: de::Error>(self, v: f64) -> Result<T, E> {
        Err(E::invalid_type(de::Unexpected::Float(v), &self))
    }
    fn visit_bool<E: de::Error>(self, v: bool) -> Result<T, E> {
        Err(E::invalid_type(de::Unexpected::Bool(v), &self))
    }
    fn visit_str<E: de::Error>(self, v: &str) -> Result<T, E> {
        match plain_integer(v) {
            Ok(n) => self.visit_u64(n),
            Err(Some(e)) => Err(E::custom(e)),
            Err(None) => Err(match v {
                "true" | "false" => E::invalid_type(de::Unexpected::Bool(v == "true"), &self),
                "" | "~" | "null" => E::invalid_type(de::Unexpected::Unit, &self),
                _ => E::invalid_type(de::Unexpected::Str(v), &self),
            }),
        }
    }
}

/// `deserialize_with` for an integer field (`u8`, `u16`, `u32`): plain
/// decimal digits only.
pub fn integer<'de, D: Deserializer<'de>, T: TryFrom<u64>>(d: D) -> Result<T, D::Error> {
    if yaml_text() { d.deserialize_str(Integer(PhantomData)) } else { d.deserialize_any(Integer(PhantomData)) }
}

struct OptionalInteger<T>(PhantomData<T>);

impl<'de, T: TryFrom<u64>> de::Visitor<'de> for OptionalInteger<T> {
    type Value = Option<T>;
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("an integer in decimal digits, or nothing")
    }
    fn visit_none<E: de::Error>(self) -> Result<Option<T>, E> {
        Ok(None)
    }
    fn visit_unit<E: de::Error>(self) -> Result<Option<T>, E> {
        Ok(None)
    }
    fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<Option<T>, D::Error> {
        integer(d).map(Some)
    }
}

/// `deserialize_with` for an optional integer field (with
/// `#[serde(default)]`).
pub fn optional_integer<'de, D: Deserializer<'de>, T: TryFrom<u64>>(d: D) -> Result<Option<T>, D::Error> {
    d.deserialize_option(OptionalInteger(PhantomData))
}

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
        if int.is_empty() || !int.bytes().all(|b| b.is_ascii_digit()) || (int.len() > 1 && int.starts_with('0')) {
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
        if yaml_text() { d.deserialize_str(V) } else { d.deserialize_any(V) }
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
            "010",
            "00.5",
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
