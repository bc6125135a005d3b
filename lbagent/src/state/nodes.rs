//! The nodes of a YAML document once its aliases are expanded, counted
//! before the document is turned into a `StateFile`.
//!
//! An alias (`*a`) stands for the whole node its anchor (`&a`) names, so
//! a few KB of nested aliases ("billion laughs") stand for millions of
//! listeners, prefixes or backends. Without aliases a document has at most
//! about one node per byte (`[a,b]`, `{a, b}`: an entry and a separator);
//! a document may expand to `max_nodes(len)`: twice its size in bytes, or
//! `MIN_NODE_BUDGET`, whichever is more. A small document may still share a
//! health check or an ACL through an alias; no document becomes much
//! larger in memory than it is on disk. The count stops at the budget, so
//! a bomb costs as much time as a document of its budget.

use std::cell::Cell;

use serde::de::{self, DeserializeSeed, Deserializer, EnumAccess, MapAccess, SeqAccess, VariantAccess, Visitor};

/// Nodes any document may expand to (aliases included), however short.
pub const MIN_NODE_BUDGET: u64 = 100_000;

/// Nodes a document of `len` bytes may expand to.
pub fn max_nodes(len: usize) -> u64 {
    (2 * len as u64).max(MIN_NODE_BUDGET)
}

/// The message when a document expands to more than `budget` nodes.
fn too_many(budget: u64) -> String {
    format!(
        "the document expands to more than {budget} nodes through YAML aliases (`*name`: a document may expand to \
         twice its size in bytes, or {MIN_NODE_BUDGET} nodes); write the repeated parts out"
    )
}

/// One node, and every node under it, counted against what is `left`.
#[derive(Clone, Copy)]
pub struct Count<'a> {
    pub left: &'a Cell<u64>,
    pub budget: u64,
}

impl Count<'_> {
    fn tick<E: de::Error>(&self) -> Result<(), E> {
        match self.left.get() {
            0 => Err(E::custom(too_many(self.budget))),
            n => {
                self.left.set(n - 1);
                Ok(())
            }
        }
    }
}

impl<'de> DeserializeSeed<'de> for Count<'_> {
    type Value = ();
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for Count<'_> {
    type Value = ();
    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("any YAML node")
    }
    fn visit_bool<E: de::Error>(self, _: bool) -> Result<(), E> {
        self.tick()
    }
    fn visit_i64<E: de::Error>(self, _: i64) -> Result<(), E> {
        self.tick()
    }
    fn visit_i128<E: de::Error>(self, _: i128) -> Result<(), E> {
        self.tick()
    }
    fn visit_u64<E: de::Error>(self, _: u64) -> Result<(), E> {
        self.tick()
    }
    fn visit_u128<E: de::Error>(self, _: u128) -> Result<(), E> {
        self.tick()
    }
    fn visit_f64<E: de::Error>(self, _: f64) -> Result<(), E> {
        self.tick()
    }
    fn visit_str<E: de::Error>(self, _: &str) -> Result<(), E> {
        self.tick()
    }
    fn visit_bytes<E: de::Error>(self, _: &[u8]) -> Result<(), E> {
        self.tick()
    }
    fn visit_unit<E: de::Error>(self) -> Result<(), E> {
        self.tick()
    }
    fn visit_none<E: de::Error>(self) -> Result<(), E> {
        self.tick()
    }
    fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        self.tick()?;
        self.deserialize(d)
    }
    fn visit_newtype_struct<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        self.tick()?;
        self.deserialize(d)
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        self.tick()?;
        while seq.next_element_seed(self)?.is_some() {}
        Ok(())
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        self.tick()?;
        while map.next_key_seed(self)?.is_some() {
            map.next_value_seed(self)?;
        }
        Ok(())
    }
    /// A tagged node (`!tag value`).
    fn visit_enum<A: EnumAccess<'de>>(self, data: A) -> Result<(), A::Error> {
        self.tick()?;
        let ((), variant) = data.variant_seed(self)?;
        variant.newtype_variant_seed(self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Nodes of `text` as this module counts them.
    fn nodes(text: &str) -> u64 {
        let left = Cell::new(u64::MAX);
        Count { left: &left, budget: u64::MAX }.deserialize(serde_yaml::Deserializer::from_str(text)).unwrap();
        u64::MAX - left.get()
    }

    #[test]
    fn without_aliases_a_document_has_at_most_two_nodes_per_byte() {
        // The densest forms: empty values, one-character entries, nesting.
        for text in [
            "{a, b, c, d, e, f}",
            "{a,b,c,d,e,f}",
            "[a,b,c,d,e,f]",
            "[[[[[[[[]]]]]]]]",
            "- - - - - -",
            "-\n-\n-\n-\n",
            "? a\n? b\n? c\n",
            "a:\nb:\nc:\n",
            "{? a, ? b}",
            "[a: , b: ]",
            "",
            "x",
        ] {
            let n = nodes(text);
            assert!(n <= 2 * text.len() as u64 + 1, "{text:?}: {n} nodes");
        }
    }

    #[test]
    fn aliases_count_as_what_they_stand_for() {
        assert_eq!(nodes("[1, 2]"), 3);
        // The sequence, its anchored element (a sequence of three) and two aliases of it.
        assert_eq!(nodes("[&a [1, 2, 3], *a, *a]"), 1 + 3 * 4);
    }
}
