//! `--config run.toml`: command-line flags from a TOML file, the command line winning.
//!
//! Each key (in the file's sorted key order) is a flag name (`lr`, `micro-batch-size` or `micro_batch_size`); strings and numbers
//! become `--key value`, `true` becomes `--key`, `false` nothing, and an array repeats the flag.
//! The file's flags are placed before the command line's, and a later flag overrides an earlier
//! one.

use std::path::Path;

use anyhow::{Context, Result, bail};

/// The flags of a TOML config file, in file order.
pub fn flags(path: &Path) -> Result<Vec<String>> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("reading --config {}", path.display()))?;
    let table: toml::Table = text
        .parse()
        .with_context(|| format!("--config {}: not valid TOML", path.display()))?;
    let mut out = Vec::new();
    for (key, value) in &table {
        let flag = format!("--{}", key.replace('_', "-"));
        let values = match value {
            toml::Value::Array(items) => items.clone(),
            other => vec![other.clone()],
        };
        for v in values {
            match v {
                toml::Value::Boolean(true) => out.push(flag.clone()),
                toml::Value::Boolean(false) => {}
                toml::Value::String(s) => out.extend([flag.clone(), s]),
                toml::Value::Integer(i) => out.extend([flag.clone(), i.to_string()]),
                toml::Value::Float(f) => out.extend([flag.clone(), f.to_string()]),
                other => bail!(
                    "--config {}: `{key}` = {other} is not a flag value",
                    path.display()
                ),
            }
        }
    }
    Ok(out)
}

/// `args` with `--config PATH` replaced by the file's flags, placed before the first flag of the
/// command line so that every flag given there wins.
pub fn expand(args: Vec<String>) -> Result<Vec<String>> {
    let Some(at) = args
        .iter()
        .position(|a| a == "--config" || a.starts_with("--config="))
    else {
        return Ok(args);
    };
    let mut args = args;
    let path = if let Some(p) = args[at].strip_prefix("--config=") {
        let p = p.to_string();
        args.remove(at);
        p
    } else {
        if at + 1 >= args.len() {
            bail!("--config needs a file");
        }
        let p = args.remove(at + 1);
        args.remove(at);
        p
    };
    let first_flag = args
        .iter()
        .skip(1)
        .position(|a| a.starts_with('-'))
        .map_or(args.len(), |i| i + 1);
    let from_file = flags(Path::new(&path))?;
    args.splice(first_flag..first_flag, from_file);
    Ok(args)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn file_flags_come_before_the_command_line() {
        let path =
            std::env::temp_dir().join(format!("megatron-config-{}.toml", std::process::id()));
        std::fs::write(&path, "lr = 0.002\nmicro_batch_size = 2\nquiet = true\ncomm-report = false\nmodel = \"gpt-tiny\"\n").unwrap();
        let args: Vec<String> = [
            "megatron",
            "train",
            "--config",
            path.to_str().unwrap(),
            "--lr",
            "0.01",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        let out = expand(args).unwrap();
        assert_eq!(
            out,
            [
                "megatron",
                "train",
                "--lr",
                "0.002",
                "--micro-batch-size",
                "2",
                "--model",
                "gpt-tiny",
                "--quiet",
                "--lr",
                "0.01"
            ]
        );
        std::fs::write(&path, "lr = { a = 1 }\n").unwrap();
        let args = vec![
            "megatron".into(),
            "train".into(),
            format!("--config={}", path.display()),
        ];
        assert!(
            expand(args)
                .unwrap_err()
                .to_string()
                .contains("is not a flag value")
        );
        std::fs::remove_file(&path).ok();
    }
}
