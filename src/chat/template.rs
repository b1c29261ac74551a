//! A tokenizer directory's chat template, rendered as Hugging Face transformers'
//! `apply_chat_template` renders it: Jinja with `trim_blocks` and `lstrip_blocks`, loop
//! controls, Python's string methods, and transformers' globals (`raise_exception`,
//! `strftime_now`) and `tojson` filter (Python's `json.dumps` with `ensure_ascii=False`).

use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use minijinja::{Environment, Error, ErrorKind, Value};
use serde_json::{Map, Value as Json};

/// The template's name inside the environment.
const NAME: &str = "chat";

/// A chat template with the special tokens it is rendered with.
pub struct ChatTemplate {
    env: Environment<'static>,
    /// `bos_token`, `eos_token`, ... as the template sees them.
    special: Map<String, Json>,
    /// Where it came from, for messages.
    source: PathBuf,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("source", &self.source)
            .field("special", &self.special)
            .finish()
    }
}

/// The special tokens transformers passes to a template (its `special_tokens_map`).
const SPECIAL: [&str; 7] = [
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
];

impl ChatTemplate {
    /// The chat template of a tokenizer directory: `chat_template.jinja` when there is one,
    /// else `tokenizer_config.json`'s `chat_template` (a string, or named templates of which
    /// `default` is taken), with the special tokens of `tokenizer_config.json`.
    pub fn from_dir(dir: &Path) -> Result<ChatTemplate> {
        let config_path = dir.join("tokenizer_config.json");
        let config: Map<String, Json> = match std::fs::read_to_string(&config_path) {
            Ok(text) => serde_json::from_str(&text)
                .with_context(|| format!("{}: not a JSON object", config_path.display()))?,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Map::new(),
            Err(e) => {
                return Err(e).with_context(|| format!("reading {}", config_path.display()));
            }
        };
        let jinja = dir.join("chat_template.jinja");
        let (source, template) = if jinja.is_file() {
            let text = std::fs::read_to_string(&jinja)
                .with_context(|| format!("reading {}", jinja.display()))?;
            (jinja, text)
        } else {
            let template = match config.get("chat_template") {
                Some(Json::String(s)) => s.clone(),
                Some(Json::Array(named)) => named
                    .iter()
                    .find(|t| t.get("name").and_then(Json::as_str) == Some("default"))
                    .and_then(|t| t.get("template"))
                    .and_then(Json::as_str)
                    .map(str::to_string)
                    .with_context(|| {
                        format!(
                            "{}: chat_template lists templates but none named \"default\"",
                            config_path.display()
                        )
                    })?,
                _ => bail!(
                    "{}: no chat template (neither chat_template.jinja nor a chat_template in \
                     tokenizer_config.json): chat data needs the tokenizer's own template",
                    dir.display()
                ),
            };
            (config_path.clone(), template)
        };
        let mut special = Map::new();
        for name in SPECIAL {
            if let Some(token) = config.get(name) {
                special.insert(name.to_string(), token_text(token));
            }
        }
        if let Some(extra) = config.get("additional_special_tokens") {
            let list = extra
                .as_array()
                .map(|a| a.iter().map(token_text).collect())
                .unwrap_or_default();
            special.insert("additional_special_tokens".into(), Json::Array(list));
        }
        ChatTemplate::new(&template, special, source)
    }

    /// A template from its source, with the special tokens it sees.
    pub fn new(template: &str, special: Map<String, Json>, source: PathBuf) -> Result<Self> {
        let mut env = Environment::new();
        env.set_syntax(
            minijinja::syntax::SyntaxConfig::builder()
                .trim_blocks(true)
                .lstrip_blocks(true)
                .build()
                .map_err(|e| anyhow::anyhow!("the chat template's syntax: {e}"))?,
        );
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.add_filter("tojson", tojson);
        env.add_template_owned(NAME.to_string(), without_generation_tags(template))
            .map_err(|e| {
                anyhow::anyhow!(
                    "{}: the chat template does not parse: {e:#}",
                    source.display()
                )
            })?;
        Ok(ChatTemplate {
            env,
            special,
            source,
        })
    }

    /// The text of `messages` (and `tools` when given), with the generation prompt when
    /// `add_generation_prompt`; an error is the template's own (`raise_exception`) or a
    /// rendering error, with the template's file.
    pub fn render(
        &self,
        messages: &[Json],
        tools: Option<&Json>,
        add_generation_prompt: bool,
    ) -> Result<String> {
        let mut context = self.special.clone();
        context.insert("messages".into(), Json::Array(messages.to_vec()));
        context.insert(
            "add_generation_prompt".into(),
            Json::Bool(add_generation_prompt),
        );
        if let Some(tools) = tools {
            context.insert("tools".into(), tools.clone());
        }
        let template = self.env.get_template(NAME)?;
        template
            .render(Value::from(minijinja::value::Serde(&context)))
            .map_err(|e| match e.kind() {
                ErrorKind::InvalidOperation if e.detail().is_some() => anyhow::anyhow!(
                    "the chat template raised: {}",
                    e.detail().unwrap_or_default()
                ),
                _ => anyhow::anyhow!("{}: the chat template failed: {e:#}", self.source.display()),
            })
    }

    /// The special token `name` (`bos_token`, `eos_token`, ...) if the configuration has it.
    pub fn special_token(&self, name: &str) -> Option<&str> {
        self.special.get(name).and_then(Json::as_str)
    }
}

/// A special token as `tokenizer_config.json` gives it: a string, or an added token object.
fn token_text(token: &Json) -> Json {
    match token {
        Json::Object(o) => o.get("content").cloned().unwrap_or(Json::Null),
        other => other.clone(),
    }
}

/// The template without transformers' `{% generation %}` / `{% endgeneration %}` markers
/// (which only mark the assistant's spans for `return_assistant_tokens_mask`; the answer-only
/// mask here is derived by rendering, for every template alike).
fn without_generation_tags(template: &str) -> String {
    let mut out = String::with_capacity(template.len());
    let mut rest = template;
    while let Some(open) = rest.find("{%") {
        let Some(close) = rest[open..].find("%}") else {
            break;
        };
        let tag = &rest[open + 2..open + close];
        let word = tag.trim_matches(|c: char| c == '-' || c == '+' || c.is_whitespace());
        out.push_str(&rest[..open]);
        if word != "generation" && word != "endgeneration" {
            out.push_str(&rest[open..open + close + 2]);
        }
        rest = &rest[open + close + 2..];
    }
    out.push_str(rest);
    out
}

/// transformers' `raise_exception(message)`: the rendering fails with the message.
fn raise_exception(message: String) -> Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, message))
}

/// transformers' `tojson(x, ensure_ascii=False, indent=None, separators=None,
/// sort_keys=False)`: Python's `json.dumps` of the value.
fn tojson(value: Value, kwargs: minijinja::value::Kwargs) -> Result<Value, Error> {
    let indent: Option<usize> = kwargs.get("indent")?;
    let sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    let _: Option<bool> = kwargs.get("ensure_ascii")?;
    kwargs.assert_all_used()?;
    let mut json = serde_json::to_value(&value)
        .map_err(|e| Error::new(ErrorKind::InvalidOperation, format!("tojson: {e}")))?;
    if sort_keys == Some(true) {
        json = sorted(json);
    }
    Ok(Value::from_safe_string(python_dumps(&json, indent)))
}

fn sorted(v: Json) -> Json {
    match v {
        Json::Object(o) => {
            let mut entries: Vec<(String, Json)> = o.into_iter().collect();
            entries.sort_by(|a, b| a.0.cmp(&b.0));
            Json::Object(entries.into_iter().map(|(k, v)| (k, sorted(v))).collect())
        }
        Json::Array(a) => Json::Array(a.into_iter().map(sorted).collect()),
        other => other,
    }
}

/// Python's `json.dumps(v, ensure_ascii=False, indent=indent)`: `", "` and `": "` between
/// items without an indent, each item on its own line with one.
pub fn python_dumps(v: &Json, indent: Option<usize>) -> String {
    let mut out = String::new();
    dump(v, indent, 0, &mut out);
    out
}

fn dump(v: &Json, indent: Option<usize>, depth: usize, out: &mut String) {
    let newline = |out: &mut String, depth: usize| {
        if let Some(n) = indent {
            out.push('\n');
            out.push_str(&" ".repeat(n * depth));
        }
    };
    let separator = if indent.is_some() { "," } else { ", " };
    match v {
        Json::Array(items) if !items.is_empty() => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(separator);
                }
                newline(out, depth + 1);
                dump(item, indent, depth + 1, out);
            }
            newline(out, depth);
            out.push(']');
        }
        Json::Object(map) if !map.is_empty() => {
            out.push('{');
            for (i, (k, item)) in map.iter().enumerate() {
                if i > 0 {
                    out.push_str(separator);
                }
                newline(out, depth + 1);
                out.push_str(&Json::String(k.clone()).to_string());
                out.push_str(": ");
                dump(item, indent, depth + 1, out);
            }
            newline(out, depth);
            out.push('}');
        }
        other => out.push_str(&other.to_string()),
    }
}

/// transformers' `strftime_now(format)`: the current UTC time formatted by a `strftime`
/// subset (`%Y %m %d %b %B %H %M %S %%`; Llama 3.1's templates use `%d %b %Y`).
fn strftime_now(format: String) -> Result<Value, Error> {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    Ok(Value::from(strftime(&format, secs)))
}

/// `format` at `secs` seconds after the Unix epoch (UTC).
pub fn strftime(format: &str, secs: u64) -> String {
    const MONTHS: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    // Howard Hinnant's days-to-civil.
    let days = (secs / 86_400) as i64;
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1_460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    let (h, m, s) = ((secs / 3600) % 24, (secs / 60) % 60, secs % 60);
    let name = MONTHS[(month - 1) as usize];
    let mut out = String::new();
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('Y') => out.push_str(&year.to_string()),
            Some('m') => out.push_str(&format!("{month:02}")),
            Some('d') => out.push_str(&format!("{day:02}")),
            Some('b') => out.push_str(&name[..3]),
            Some('B') => out.push_str(name),
            Some('H') => out.push_str(&format!("{h:02}")),
            Some('M') => out.push_str(&format!("{m:02}")),
            Some('S') => out.push_str(&format!("{s:02}")),
            Some('%') => out.push('%'),
            Some(other) => {
                out.push('%');
                out.push(other);
            }
            None => out.push('%'),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn render(template: &str, messages: Json) -> Result<String> {
        let t = ChatTemplate::new(template, Map::new(), PathBuf::from("test"))?;
        t.render(messages.as_array().unwrap(), None, false)
    }

    #[test]
    fn tojson_writes_as_python_json_dumps() {
        let v: Json = serde_json::json!({"b": [1, 2.5, "x<y"], "a": {"é": null}});
        assert_eq!(
            python_dumps(&v, None),
            r#"{"b": [1, 2.5, "x<y"], "a": {"é": null}}"#
        );
        assert_eq!(
            python_dumps(&serde_json::json!({"k": [1]}), Some(2)),
            "{\n  \"k\": [\n    1\n  ]\n}"
        );
        assert_eq!(
            python_dumps(&serde_json::json!({"k": []}), Some(2)),
            "{\n  \"k\": []\n}"
        );
        let out = render(
            "{{ messages[0] | tojson }}",
            serde_json::json!([{"role": "user", "content": "<b>"}]),
        )
        .unwrap();
        assert_eq!(out, r#"{"role": "user", "content": "<b>"}"#);
    }

    #[test]
    fn raise_exception_fails_the_rendering_with_its_message() {
        let err = render(
            "{{ raise_exception('roles must alternate') }}",
            serde_json::json!([]),
        )
        .unwrap_err();
        assert_eq!(
            err.to_string(),
            "the chat template raised: roles must alternate"
        );
    }

    #[test]
    fn python_string_methods_and_blocks_render_as_in_jinja2() {
        let out = render(
            "{% for m in messages %}\n  {{- m.content.strip().upper() }}{% if not loop.last %},{% endif %}\n{% endfor %}",
            serde_json::json!([{"content": " a "}, {"content": "b\n"}]),
        )
        .unwrap();
        assert_eq!(out, "A,B");
    }

    #[test]
    fn generation_markers_are_dropped() {
        assert_eq!(
            without_generation_tags(
                "a{% generation %}b{%- endgeneration -%}c{% if x %}d{% endif %}"
            ),
            "abc{% if x %}d{% endif %}"
        );
    }

    #[test]
    fn dates_are_civil() {
        // 2024-07-26 00:00:00 UTC.
        assert_eq!(strftime("%d %b %Y", 1_721_952_000), "26 Jul 2024");
        assert_eq!(
            strftime("%Y-%m-%dT%H:%M:%S %B %%", 951_782_400 + 3_661),
            "2000-02-29T01:01:01 February %"
        );
    }
}
