//! The `megatron` command line: one module per subcommand.

pub mod bench;
pub mod data_cmd;
pub mod groups;
pub mod inspect;
pub mod model_args;
pub mod models;
pub mod preprocess;
pub mod train;
