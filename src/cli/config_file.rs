//! `--config run.toml`: command-line flags from a TOML file, the command line winning.
//!
//! Each key (in the file's sorted key order) is a flag name (`lr`, `micro-batch-size` or
//! `micro_batch_size`); strings and numbers become `--key value`, `true` becomes `--key`, `false`
//! nothing, and an array gives the flag its list (`cuda-graph-scope = ["attn", "mlp"]`). A flag
//! the command line gives, under any of its names, takes the command line's value alone: the
//! file's is dropped, lists included. A key that is no flag of the command is refused by name.

use std::ffi::{OsStr, OsString};
use std::path::Path;

use anyhow::{Context, Result, bail};

/// One flag of a config file: its name (`--key`) and the values that follow it.
#[derive(Debug, Clone, PartialEq)]
pub struct FileFlag {
    /// `--key`, with `-` for `_`.
    pub flag: String,
    /// The values, one per occurrence (`None`: a switch).
    pub values: Vec<Option<String>>,
}

/// The flags of a TOML config file, in file order.
pub fn flags(path: &Path) -> Result<Vec<FileFlag>> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("reading --config {}", path.display()))?;
    let table: toml::Table = text
        .parse()
        .with_context(|| format!("--config {}: not valid TOML", path.display()))?;
    let mut out = Vec::new();
    for (key, value) in &table {
        let flag = format!("--{}", key.replace('_', "-"));
        let items = match value {
            toml::Value::Array(items) => items.clone(),
            other => vec![other.clone()],
        };
        let mut values = Vec::new();
        for v in items {
            match v {
                toml::Value::Boolean(true) => values.push(None),
                toml::Value::Boolean(false) => {}
                toml::Value::String(s) => values.push(Some(s)),
                toml::Value::Integer(i) => values.push(Some(i.to_string())),
                toml::Value::Float(f) => values.push(Some(f.to_string())),
                other => bail!(
                    "--config {}: `{key}` = {other} is not a flag value",
                    path.display()
                ),
            }
        }
        if !values.is_empty() {
            out.push(FileFlag { flag, values });
        }
    }
    Ok(out)
}

/// The long name of the argument of `command` that `flag` (`--name` or `--name=value`) gives,
/// under any of its aliases; `None` for a flag the command does not have.
fn arg_id<'c>(command: &'c clap::Command, flag: &OsStr) -> Option<&'c str> {
    let bytes = flag.as_encoded_bytes();
    let name = bytes.strip_prefix(b"--")?;
    let name = name.split(|&b| b == b'=').next().unwrap_or(name);
    let name = std::str::from_utf8(name).ok()?;
    command
        .get_arguments()
        .find(|a| {
            a.get_long() == Some(name)
                || a.get_all_aliases()
                    .is_some_and(|aliases| aliases.contains(&name))
        })
        .map(|a| a.get_id().as_str())
}

/// The subcommand `args` run (the command path of their leading words), for its flags.
fn subcommand<'c>(cli: &'c clap::Command, args: &[OsString]) -> &'c clap::Command {
    let mut command = cli;
    for word in args.iter().skip(1) {
        match word.to_str().and_then(|w| command.find_subcommand(w)) {
            Some(sub) => command = sub,
            None => break,
        }
    }
    command
}

/// `args` with `--config PATH` replaced by the file's flags, placed before the first flag of the
/// command line; the file's flags that the command line also gives are dropped, so that the
/// command line's value wins (a list's too, not merged). `cli` is the command whose
/// subcommand's flags are looked up.
pub fn expand(args: Vec<OsString>, cli: &clap::Command) -> Result<Vec<OsString>> {
    let is_config =
        |a: &OsString| a == "--config" || a.as_encoded_bytes().starts_with(b"--config=");
    let Some(at) = args.iter().position(is_config) else {
        return Ok(args);
    };
    let mut args = args;
    let path = match args[at].as_encoded_bytes().strip_prefix(b"--config=") {
        Some(p) => {
            // SAFETY: `p` is what follows an ASCII prefix of an OS string's encoded bytes,
            // which is an OS string's encoding again (`OsStr::from_encoded_bytes_unchecked`).
            let p = unsafe { OsStr::from_encoded_bytes_unchecked(p) }.to_os_string();
            args.remove(at);
            p
        }
        None => {
            if at + 1 >= args.len() {
                bail!("--config needs a file");
            }
            let p = args.remove(at + 1);
            args.remove(at);
            p
        }
    };
    let command = subcommand(cli, &args);
    let given: Vec<&str> = args.iter().filter_map(|a| arg_id(command, a)).collect();
    let name = command.get_name();
    let mut from_file = Vec::new();
    for FileFlag { flag, values } in flags(Path::new(&path))? {
        let Some(id) = arg_id(command, OsStr::new(&flag)) else {
            bail!(
                "--config {}: `{}` is not a flag of `megatron {name}`",
                Path::new(&path).display(),
                &flag[2..]
            );
        };
        if given.contains(&id) {
            continue;
        }
        for value in values {
            from_file.push(OsString::from(&flag));
            from_file.extend(value.map(OsString::from));
        }
    }
    let first_flag = args
        .iter()
        .skip(1)
        .position(|a| a.as_encoded_bytes().starts_with(b"-"))
        .map_or(args.len(), |i| i + 1);
    args.splice(first_flag..first_flag, from_file);
    Ok(args)
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::{Arg, ArgAction, Command};

    fn cli() -> Command {
        Command::new("megatron").subcommand(
            Command::new("train")
                .arg(Arg::new("lr").long("lr"))
                .arg(Arg::new("micro_batch_size").long("micro-batch-size"))
                .arg(Arg::new("quiet").long("quiet").action(ArgAction::SetTrue))
                .arg(
                    Arg::new("comm_report")
                        .long("comm-report")
                        .action(ArgAction::SetTrue),
                )
                .arg(Arg::new("model").long("model"))
                .arg(
                    Arg::new("tp")
                        .long("tensor-model-parallel-size")
                        .visible_alias("tp"),
                )
                .arg(
                    Arg::new("cuda_graph_scope")
                        .long("cuda-graph-scope")
                        .num_args(1..)
                        .action(ArgAction::Append),
                ),
        )
    }

    fn os(args: &[&str]) -> Vec<OsString> {
        args.iter().map(OsString::from).collect()
    }

    #[test]
    fn file_flags_come_before_the_command_line_which_wins() {
        let path =
            std::env::temp_dir().join(format!("megatron-config-{}.toml", std::process::id()));
        std::fs::write(
            &path,
            "lr = 0.002\nmicro_batch_size = 2\nquiet = true\ncomm-report = false\n\
             model = \"gpt-tiny\"\ncuda-graph-scope = [\"attn\", \"mlp\"]\n\
             tensor_model_parallel_size = 2\n",
        )
        .unwrap();
        let p = path.to_str().unwrap();
        // A single flag and a list the command line gives (under an alias too) keep its value
        // alone.
        let out = expand(
            os(&[
                "megatron",
                "train",
                "--config",
                p,
                "--lr",
                "0.01",
                "--cuda-graph-scope",
                "moe_router",
                "--tp=4",
            ]),
            &cli(),
        )
        .unwrap();
        assert_eq!(
            out,
            os(&[
                "megatron",
                "train",
                "--micro-batch-size",
                "2",
                "--model",
                "gpt-tiny",
                "--quiet",
                "--lr",
                "0.01",
                "--cuda-graph-scope",
                "moe_router",
                "--tp=4"
            ])
        );
        // Without them, the file's list is the flag's list.
        let out = expand(os(&["megatron", "train", &format!("--config={p}")]), &cli()).unwrap();
        let parsed = cli().try_get_matches_from(&out).unwrap();
        let train = parsed.subcommand_matches("train").unwrap();
        let scopes: Vec<&String> = train.get_many("cuda_graph_scope").unwrap().collect();
        assert_eq!(scopes, ["attn", "mlp"]);
        std::fs::write(&path, "lr = { a = 1 }\n").unwrap();
        let err = expand(os(&["megatron", "train", "--config", p]), &cli()).unwrap_err();
        assert!(err.to_string().contains("is not a flag value"), "{err}");
        std::fs::write(&path, "learning_rate = 1\n").unwrap();
        let err = expand(os(&["megatron", "train", "--config", p]), &cli()).unwrap_err();
        assert!(
            err.to_string()
                .contains("`learning-rate` is not a flag of `megatron train`"),
            "{err}"
        );
        std::fs::remove_file(&path).ok();
    }
}
