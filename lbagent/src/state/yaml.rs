//! The YAML reader: one streaming parser (`serde-saphyr`), configured in
//! one place.
//!
//! Events go from the parser straight into the deserializing type, so a
//! document costs its typed result and little more. (serde_yaml 0.9
//! records every event of a document before the first field is read: a
//! 7.3 MB document of 100 000 rules peaked at 134 MB of RSS in
//! `lbagent validate`, against 29 MB now and 28 MB for the same document as
//! JSON; 2026-12-07.)
//!
//! Aliases: the parser counts the events its aliases replay (a scalar is
//! one, a list or a mapping two) and stops at `nodes::max_nodes`, with the
//! path where it ran out. An anchored node's events are kept for its
//! aliases (copied once per anchor it is inside): at most
//! `ANCHOR_EVENTS` copies and `ANCHOR_BYTES` of text in all, so anchors
//! share small parts (a health check, an ACL), and a document that anchors
//! a large one is refused rather than copied whole. The events of a
//! document without aliases are bounded by its size.
//!
//! What is read as serde_yaml read it: booleans are `true` and `false` only
//! (not YAML 1.1's `yes`, `no`, `on`, `off`); a `!!binary` tag is ignored
//! (the text is read as written, never decoded); merge keys (`<<`) are
//! refused: a document spells its mappings out or shares them whole
//! through an alias. A key written twice reaches the typed model, which
//! refuses it (`duplicate field`). Unlike serde_yaml, a quoted `"true"` is
//! accepted for a boolean and an explicit `!!int` tag is refused.

use serde_saphyr::{
    Budget, Deserializer, Error, Options,
    budget::BudgetBreach,
    options::{DuplicateKeyPolicy, MergeKeyPolicy},
};

use super::nodes;

/// Event copies kept for anchors, in all (each ~100 bytes: ~10 MB).
const ANCHOR_EVENTS: usize = 100_000;

/// Text kept for anchors, in all.
const ANCHOR_BYTES: usize = 4 << 20;

/// The parser's options for a document of `len` bytes.
fn options(len: usize) -> Options {
    let budget = nodes::max_nodes(len);
    let replayed = usize::try_from(budget).unwrap_or(usize::MAX);
    // Events without aliases: a few per byte at most.
    let events = len.saturating_mul(4).saturating_add(replayed);
    let mut opts = Options::default();
    opts.with_snippet = false;
    opts.merge_keys = MergeKeyPolicy::Error;
    opts.duplicate_keys = DuplicateKeyPolicy::PassThrough;
    opts.strict_booleans = true;
    opts.ignore_binary_tag_for_string = true;
    let mut limits = Budget::default();
    limits.max_events = events;
    limits.max_nodes = events;
    limits.max_aliases = events;
    limits.max_anchors = events;
    limits.max_recorded_anchor_events = ANCHOR_EVENTS;
    limits.max_recorded_anchor_bytes = ANCHOR_BYTES;
    limits.enforce_alias_anchor_ratio = false;
    opts.budget = Some(limits);
    opts.alias_limits.max_total_replayed_events = replayed;
    opts
}

/// Runs `f` on a streaming deserializer of `text` (one document; anything
/// after it is an error).
pub(super) fn read<'de, R>(
    text: &'de str,
    f: impl for<'e> FnOnce(Deserializer<'de, 'e>) -> Result<R, Error>,
) -> Result<R, Error> {
    serde_saphyr::with_deserializer_from_str_with_options(text, options(text.len()), f)
}

/// [`read`] of a reader (a file of `len` bytes), parsed as it is read.
pub(super) fn read_from<R: std::io::Read, T>(
    reader: R,
    len: u64,
    f: impl for<'de, 'e> FnOnce(Deserializer<'de, 'e>) -> Result<T, Error>,
) -> Result<T, Error> {
    let len = usize::try_from(len).unwrap_or(usize::MAX);
    serde_saphyr::with_deserializer_from_reader_with_options(reader, options(len), f)
}

/// How an error reads: the parser's message, and the start of the line it
/// points at when that says more (a torn document's last word, a stray
/// key), escaped and cut short. An empty document is missing its
/// `version`, as any document without one; one that expands past its
/// budget through aliases says so.
pub(super) fn message(text: &str, e: &Error) -> String {
    if text.lines().all(|l| l.trim().is_empty() || l.trim_start().starts_with('#')) {
        return "missing field `version`: the document is empty".into();
    }
    match original(e) {
        Error::AliasReplayLimitExceeded { .. } | Error::AliasReplayCounterOverflow { .. } => {
            return nodes::too_many(nodes::max_nodes(text.len()));
        }
        Error::Budget {
            breach: BudgetBreach::RecordedAnchorEvents { .. } | BudgetBreach::RecordedAnchorBytes { .. },
            ..
        } => return anchored_too_much(),
        _ => {}
    }
    let msg = e.to_string();
    let line = e.location().and_then(|l| usize::try_from(l.line()).ok()).filter(|&l| l > 0);
    let Some(near) = line.and_then(|l| text.lines().nth(l - 1)).map(str::trim).filter(|l| !l.is_empty()) else {
        return msg;
    };
    let near: String = near.chars().take(NEAR_CHARS).collect::<String>().escape_debug().collect();
    if msg.contains(&near) { msg } else { format!("{msg} (near `{near}`)") }
}

/// The error under the parser's wrappers (the alias it was replaying, a
/// snippet).
fn original(mut e: &Error) -> &Error {
    while let Error::AliasError { error, .. } | Error::WithSnippet { error, .. } = e {
        e = error;
    }
    e
}

/// The message when the parts a document's anchors name are too large.
fn anchored_too_much() -> String {
    format!(
        "the document's anchors (`&name`) name more than {ANCHOR_EVENTS} YAML events or {} MiB of text for \
         their aliases (an anchor inside another counts for each, one around aliases counts them expanded): share \
         small parts through YAML aliases, or write them out",
        ANCHOR_BYTES >> 20
    )
}

/// How much of the line an error points at is quoted.
const NEAR_CHARS: usize = 40;

#[cfg(test)]
mod tests {
    use super::*;

    fn value(text: &str) -> Result<serde_json::Value, String> {
        read(text, |de| serde::Deserialize::deserialize(de)).map_err(|e| message(text, &e))
    }

    #[test]
    fn aliases_expand_within_the_budget_and_no_further() {
        // Shared through aliases: accepted, and expanded.
        let v = value("a: &h {interval_s: 4}\nb: *h\nc: *h\n").unwrap();
        assert_eq!(v["c"]["interval_s"], 4);
        // Nine levels of nine aliases each: 9^9 nodes from 300 bytes.
        let mut doc = String::from("a0: &a0 [x, x, x, x, x, x, x, x, x]\n");
        for i in 1..9 {
            let prev = format!("*a{}", i - 1);
            doc += &format!("a{i}: &a{i} [{}]\n", [prev.as_str(); 9].join(", "));
        }
        let started = std::time::Instant::now();
        let err = value(&doc).unwrap_err();
        assert!(err.contains("through YAML aliases"), "{err}");
        assert!(started.elapsed() < std::time::Duration::from_secs(2));
    }

    #[test]
    fn an_error_quotes_the_line_it_points_at_escaped() {
        let err = value("a: 1\nb: [1, 2\n").unwrap_err();
        assert!(err.contains("line 2") && err.contains("(near `b: [1, 2`)"), "{err}");
        let err = value("a: 1\n\"\\u001b[31m\": {\n").unwrap_err();
        assert!(!err.contains('\u{1b}'), "{err:?}");
    }

    #[test]
    fn merge_keys_are_refused() {
        assert!(value("a: &m {x: 1}\nb: {<<: *m, y: 2}\n").is_err());
    }

    #[test]
    fn a_large_anchored_part_is_refused_in_bounded_memory() {
        // Anchors nested six deep around 200 000 scalars: every event would
        // be kept six times.
        let items = ["a"; 200_000].join(",");
        let doc = format!("x: &a [&b [&c [&d [&e [&f [{items}]]]]]]\n");
        let started = std::time::Instant::now();
        let err = value(&doc).unwrap_err();
        assert!(err.contains("anchors (`&name`) name more than"), "{err}");
        assert!(started.elapsed() < std::time::Duration::from_secs(5), "took {:?}", started.elapsed());
        // A small shared part is fine.
        assert!(value("a: &h {path: /healthz, interval_s: 2}\nb: [*h, *h]\n").is_ok());
    }

    #[test]
    fn booleans_are_true_and_false_and_binary_tags_are_not_decoded() {
        #[derive(serde::Deserialize)]
        struct Doc {
            on: bool,
        }
        let bool_of = |t: &str| read(t, |de| <Doc as serde::Deserialize>::deserialize(de)).map(|d| d.on);
        assert!(bool_of("on: true").unwrap());
        assert!(!bool_of("on: false").unwrap());
        for t in ["on: yes", "on: no", "on: off", "on: on", "on: y", "on: Y"] {
            assert!(bool_of(t).is_err(), "{t}");
        }
        #[derive(serde::Deserialize)]
        struct Text {
            s: String,
        }
        let s = read("s: !!binary ODA=", |de| <Text as serde::Deserialize>::deserialize(de)).unwrap().s;
        assert_eq!(s, "ODA=");
    }
}
