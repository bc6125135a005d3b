//! The desired state: model, parsing, validation.

pub mod decimal;
pub mod flow_log;
pub mod ha;
pub mod limits;
pub mod load;
pub mod model;
pub mod names;
pub mod nodes;
pub mod problem;
pub mod spec;
pub mod validate;
mod yaml;

pub use load::{Accepted, Earlier, Format, Problem, Problems, accept_file, accept_str, load_file, load_str};
pub use model::StateFile;
pub use spec::Desired;
