//! The command line as the operating system gives it: arguments are read as OS strings, so a
//! path that is not UTF-8 (any byte string Linux allows) reaches the file system as it is;
//! a flag that takes text refuses such a value by name, with why it must be text.

use std::ffi::OsString;

/// Why each flag that takes text must be UTF-8 (the others: "it takes text").
const WHY_TEXT: &[(&str, &str)] = &[
    (
        "--prompt",
        "a prompt is text, encoded as UTF-8 for the tokenizer",
    ),
    (
        "--tokenizer",
        "a tokenizer is `byte` or a tokenizer.json's path, recorded in checkpoints as text",
    ),
    (
        "--data",
        "the datasets' paths are recorded in checkpoints as text, to resume from",
    ),
    (
        "--data-path",
        "the datasets' paths are recorded in checkpoints as text, to resume from",
    ),
];

/// The error line for the first argument of `args` that is not UTF-8 where text was needed,
/// naming its flag (the nearest `--flag` before it, or its own `--flag=`).
pub fn not_utf8(args: &[OsString]) -> String {
    let Some(at) = args.iter().position(|a| a.to_str().is_none()) else {
        return "error: an argument is not valid UTF-8".to_string();
    };
    let bytes = args[at].as_encoded_bytes();
    let flag = if bytes.starts_with(b"--") {
        let name = bytes.split(|&b| b == b'=').next().unwrap_or(bytes);
        Some(String::from_utf8_lossy(name).into_owned())
    } else {
        args[..at]
            .iter()
            .rev()
            .find(|a| a.as_encoded_bytes().starts_with(b"-"))
            .map(|a| a.to_string_lossy().into_owned())
    };
    match flag {
        Some(flag) => {
            let why = WHY_TEXT
                .iter()
                .find(|(f, _)| *f == flag)
                .map_or("it takes text", |(_, why)| why);
            format!(
                "error: {flag}: {:?} is not valid UTF-8, and {why} (paths are taken as the OS \
                 gives them, not text)",
                args[at]
            )
        }
        None => format!(
            "error: argument {at} ({:?}) is not valid UTF-8 and is no path: commands and \
             subcommands are text",
            args[at]
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::ffi::OsStringExt;

    #[test]
    fn the_flag_of_a_value_that_is_not_utf8_is_named() {
        let bad = OsString::from_vec(b"caf\xe9".to_vec());
        let args = vec![
            OsString::from("megatron"),
            OsString::from("generate"),
            OsString::from("--prompt"),
            bad.clone(),
        ];
        let line = not_utf8(&args);
        assert!(
            line.starts_with("error: --prompt: \"caf\\xE9\" is not valid UTF-8"),
            "{line}"
        );
        assert!(line.contains("a prompt is text"), "{line}");
        let mut joined = b"--model=".to_vec();
        joined.extend_from_slice(b"\xff");
        let args = vec![
            OsString::from("megatron"),
            OsString::from("train"),
            OsString::from_vec(joined),
        ];
        assert!(not_utf8(&args).starts_with("error: --model: "));
        let args = vec![OsString::from("megatron"), bad];
        assert!(not_utf8(&args).contains("argument 1"));
    }
}
