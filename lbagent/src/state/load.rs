//! Reading a state file: YAML or JSON by extension, then validation.

use std::{fmt, path::Path};

use super::{model::StateFile, validate::validate};

/// One problem in a state file, with the path of the offending field.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Problem {
    pub path: String,
    pub message: String,
}

impl fmt::Display for Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.path.is_empty() { write!(f, "{}", self.message) } else { write!(f, "{}: {}", self.path, self.message) }
    }
}

/// Every problem found, in file order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Problems(pub Vec<Problem>);

impl fmt::Display for Problems {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, p) in self.0.iter().enumerate() {
            if i > 0 {
                writeln!(f)?;
            }
            write!(f, "{p}")?;
        }
        Ok(())
    }
}

impl std::error::Error for Problems {}

fn one(path: impl Into<String>, message: impl Into<String>) -> Problems {
    Problems(vec![Problem { path: path.into(), message: message.into() }])
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    Yaml,
    Json,
}

impl Format {
    pub fn of(path: &Path) -> Option<Format> {
        match path.extension()?.to_str()? {
            "yaml" | "yml" => Some(Format::Yaml),
            "json" => Some(Format::Json),
            _ => None,
        }
    }
}

/// Parses (no validation). Errors carry the field path where serde stopped.
pub fn parse(text: &str, format: Format) -> Result<StateFile, Problems> {
    let res = match format {
        Format::Yaml => {
            let de = serde_yaml::Deserializer::from_str(text);
            serde_path_to_error::deserialize(de).map_err(|e| (e.path().to_string(), e.into_inner().to_string()))
        }
        Format::Json => {
            let mut de = serde_json::Deserializer::from_str(text);
            serde_path_to_error::deserialize(&mut de).map_err(|e| (e.path().to_string(), e.into_inner().to_string()))
        }
    };
    res.map_err(|(path, msg)| one(if path == "." { String::new() } else { path }, msg))
}

/// Parses and validates text.
pub fn load_str(text: &str, format: Format) -> Result<StateFile, Problems> {
    let state = parse(text, format)?;
    let problems = validate(&state);
    if problems.is_empty() { Ok(state) } else { Err(Problems(problems)) }
}

/// Reads, parses and validates a state file.
pub fn load_file(path: &Path) -> Result<StateFile, Problems> {
    let format = Format::of(path)
        .ok_or_else(|| one("", format!("{}: unknown extension (use .yaml, .yml or .json)", path.display())))?;
    let text = std::fs::read_to_string(path).map_err(|e| one("", format!("{}: {e}", path.display())))?;
    load_str(&text, format)
}
