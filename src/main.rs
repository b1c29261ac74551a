//! The `megatron` command-line program.

mod cli;

use clap::{CommandFactory, Parser, Subcommand};

/// megatron-rs: Megatron-LM's parallel training in Rust.
#[derive(Debug, Parser)]
#[command(name = "megatron", version, about, args_override_self = true)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Print Megatron's process groups (tp, cp, dp, pp, ep, ...) for a parallel configuration.
    Groups(cli::groups::GroupsArgs),
    /// Benchmarks against this machine's limits: a model's training step (tokens/s, MFU, a
    /// pipeline's bubble), `gemm`, `grouped-gemm`, `attention`, `generate`, `allreduce`.
    Bench(cli::bench::BenchArgs),
    /// Train a model with tensor, sequence, context, pipeline, data and expert parallelism on
    /// thread ranks, MPI processes or GPUs.
    Train(Box<cli::train::TrainArgs>),
    /// A checkpoint's loss and perplexity on a held-out set, read whole and in order, at any
    /// layout, with the training masks (Megatron-LM's --skip-train with evaluation).
    Eval(Box<cli::eval::EvalArgs>),
    /// Show a model's vocabulary padding, parameters (logical, local, split) and per-layer collectives.
    Inspect(Box<cli::inspect::InspectArgs>),
    /// List the registered models.
    Models,
    /// Draw the loss curve of a `megatron train --log-json` log as a PNG.
    Plot(cli::plot::PlotArgs),
    /// Convert a Hugging Face model (GPT-2, Llama, Mistral, Qwen2, Qwen3, Mixtral, Qwen3-MoE) to a
    /// megatron-rs checkpoint, or a checkpoint to the architecture that holds it.
    Convert(cli::convert::ConvertArgs),
    /// Generate text from a checkpoint (greedy or sampled, with tensor parallelism too).
    Generate(cli::generate::GenerateArgs),
    /// Tokenize JSON lines into Megatron-LM's indexed dataset (PREFIX_KEY_document.bin/.idx).
    Preprocess(cli::preprocess::PreprocessArgs),
    /// Indexed datasets: `inspect`.
    Data(cli::data_cmd::DataArgs),
    /// Tokenizers: `train` a byte-level BPE tokenizer on JSON lines.
    Tokenizer(cli::tokenizer_cmd::TokenizerArgs),
    /// A pipeline schedule (1F1B, interleaved, ZB-H1, ZB-H2, ZB-V or DualPipeV) per rank, with
    /// its timeline and bubble.
    Schedule(cli::schedule::ScheduleArgs),
    /// The CUDA graphs and static buffers --cuda-graph-scope captures, per pipeline rank.
    Graphs(Box<cli::graphs::GraphsArgs>),
    /// The distributed optimizer's buffers, buckets and per-rank shards for a parameter list.
    Layout(Box<cli::layout::LayoutArgs>),
}

fn main() -> std::process::ExitCode {
    // As the OS gives them: a path need not be UTF-8.
    let args = match cli::config_file::expand(std::env::args_os().collect(), &Cli::command()) {
        Ok(args) => args,
        Err(err) => {
            cli::output::error_line(&format!("error: {err:#}"));
            return std::process::ExitCode::FAILURE;
        }
    };
    let cli = match Cli::try_parse_from(&args) {
        // A value that is not UTF-8 where text is needed: named by its flag.
        Err(e) if e.kind() == clap::error::ErrorKind::InvalidUtf8 => {
            cli::output::error_line(&cli::arguments::not_utf8(&args));
            return std::process::ExitCode::from(2);
        }
        Ok(cli) => cli,
        // Help and the version are the command's output: written as any report is.
        Err(e) if !e.use_stderr() => {
            return match cli::output::text(&e.render().to_string()) {
                Err(err) if !err.reader_left() => {
                    cli::output::error_line(&format!("error: {:#}", anyhow::Error::new(err)));
                    std::process::ExitCode::FAILURE
                }
                _ => std::process::ExitCode::SUCCESS,
            };
        }
        Err(e) => e.exit(),
    };
    // A kernel cap that names no instruction set is refused before any work.
    if let Err(e) = megatron::kernels::isa::check_env() {
        cli::output::error_line(&format!("error: {e}"));
        return std::process::ExitCode::from(2);
    }
    let result = match &cli.command {
        Command::Groups(args) => cli::groups::run(args),
        Command::Bench(args) => cli::bench::run(args),
        Command::Train(args) => cli::train::run(args),
        Command::Eval(args) => cli::eval::run(args),
        Command::Inspect(args) => cli::inspect::run(args),
        Command::Models => cli::models::run(),
        Command::Plot(args) => cli::plot::run(args),
        Command::Convert(args) => cli::convert::run(args),
        Command::Generate(args) => cli::generate::run(args),
        Command::Preprocess(args) => cli::preprocess::run(args),
        Command::Data(args) => cli::data_cmd::run(args),
        Command::Tokenizer(args) => cli::tokenizer_cmd::run(args),
        Command::Schedule(args) => cli::schedule::run(args),
        Command::Graphs(args) => cli::graphs::run(args),
        Command::Layout(args) => cli::layout::run(args),
    };
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        // A reader that left (`| head`) ends a command quietly, as Unix tools end.
        Err(err)
            if err
                .downcast_ref::<cli::output::StdoutError>()
                .is_some_and(cli::output::StdoutError::reader_left) =>
        {
            std::process::ExitCode::SUCCESS
        }
        Err(err) => {
            cli::output::error_line(&format!("error: {err:#}"));
            std::process::ExitCode::FAILURE
        }
    }
}
