//! The `megatron` command line: one module per subcommand.

pub mod arguments;
pub mod bench;
pub mod config_file;
pub mod convert;
pub mod data_cmd;
pub mod generate;
pub mod graphs;
pub mod groups;
pub mod inspect;
pub mod inspect_balance;
pub mod inspect_cp;
pub mod layout;
pub mod logging;
pub mod model_args;
pub mod models;
pub mod moe_args;
pub mod observers;
pub mod output;
pub mod plot;
pub mod preprocess;
pub mod resume;
pub mod schedule;
pub mod tokenizer_cmd;
pub mod train;
pub mod values;
