//! The desired state: model, parsing, validation.

pub mod decimal;
pub mod load;
pub mod model;
pub mod names;
pub mod problem;
pub mod validate;

pub use load::{Format, Problem, Problems, load_file, load_str};
pub use model::StateFile;
