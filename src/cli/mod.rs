//! The `megatron` command line: one module per subcommand.

pub mod bench;
pub mod groups;
pub mod train;
