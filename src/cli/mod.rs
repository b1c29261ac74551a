//! The `megatron` command line: one module per subcommand.

pub mod bench;
pub mod groups;
pub mod inspect;
pub mod model_args;
pub mod models;
pub mod train;
