//! A Hugging Face `config.json` read with the command line's bounds: every field is checked for
//! its type and range before anything is sized by it, and each refusal names the field (never a
//! command-line flag the user did not give). The architecture comes from `architectures` and
//! `model_type`, which must agree.

use anyhow::{Result, bail};
use megatron_core::limits::{MAX_DIM, MAX_EXPERTS, MAX_LAYERS, MAX_PARAMS, MAX_VOCAB};
use megatron_models::GptConfig;
use serde_json::Value;

/// The architectures megatron-rs reads and writes, with their `model_type`.
pub const ARCHITECTURES: [(&str, &str); 9] = [
    ("GPT2LMHeadModel", "gpt2"),
    ("LlamaForCausalLM", "llama"),
    ("MistralForCausalLM", "mistral"),
    ("Qwen2ForCausalLM", "qwen2"),
    ("Qwen3ForCausalLM", "qwen3"),
    ("MixtralForCausalLM", "mixtral"),
    ("Qwen3MoeForCausalLM", "qwen3_moe"),
    ("DeepseekV3ForCausalLM", "deepseek_v3"),
    // GPT-2 without its head (the head is the embedding, tied).
    ("GPT2Model", "gpt2"),
];

/// The `model_type` of architecture `arch`.
pub fn model_type(arch: &str) -> Option<&'static str> {
    ARCHITECTURES
        .iter()
        .find(|(a, _)| *a == arch)
        .map(|(_, t)| *t)
}

/// The architectures' names, for messages.
fn names() -> String {
    ARCHITECTURES[..8]
        .iter()
        .map(|(a, _)| *a)
        .collect::<Vec<_>>()
        .join(", ")
}

/// The ranges the whole numbers of a config take: those of the command line's flags.
#[derive(Debug, Clone, Copy)]
pub enum Bound {
    /// Transformer layers: 1 to 2^14.
    Layers,
    /// A model dimension (width, heads, positions): 1 to 2^24.
    Dim,
    /// A vocabulary: 1 to 2^24 tokens.
    Vocab,
    /// Experts of a layer, or experts per token: 1 to 2^16.
    Experts,
    /// A layer's index or a step between layers: 0 to 2^14.
    LayerIndex,
}

impl Bound {
    /// The least and the most value, and what the most stands for.
    fn range(self) -> (u64, u64, &'static str) {
        match self {
            Bound::Layers => (1, MAX_LAYERS as u64, "a model's layers"),
            Bound::Dim => (1, MAX_DIM as u64, "a model dimension"),
            Bound::Vocab => (1, MAX_VOCAB as u64, "a vocabulary's tokens"),
            Bound::Experts => (1, MAX_EXPERTS as u64, "experts per MoE layer"),
            Bound::LayerIndex => (0, MAX_LAYERS as u64, "a model's layers"),
        }
    }
}

/// A `config.json`'s fields, read by name with their checks.
#[derive(Debug, Clone, Copy)]
pub struct HfConfig<'a> {
    value: &'a Value,
}

impl<'a> HfConfig<'a> {
    /// The config `value` (a JSON object, else refused).
    pub fn new(value: &'a Value) -> Result<Self> {
        if !value.is_object() {
            bail!("config.json is {}, not a JSON object", kind(value));
        }
        Ok(HfConfig { value })
    }

    /// The raw field `key` (`Null` when absent).
    pub fn get(&self, key: &str) -> &'a Value {
        &self.value[key]
    }

    /// Whether `key` is absent or null.
    pub fn absent(&self, key: &str) -> bool {
        self.value[key].is_null()
    }

    /// The whole number `key`, required, within `bound`.
    pub fn int(&self, key: &str, bound: Bound) -> Result<usize> {
        match self.opt_int(key, bound)? {
            Some(v) => Ok(v),
            None => bail!("config.json: `{key}` is missing"),
        }
    }

    /// The whole number `key` within `bound`, `None` when absent or null.
    pub fn opt_int(&self, key: &str, bound: Bound) -> Result<Option<usize>> {
        let v = &self.value[key];
        if v.is_null() {
            return Ok(None);
        }
        whole(v, &format!("`{key}`"), bound).map(Some)
    }

    /// The first of `keys` present (several names for one field), within `bound`.
    pub fn int_of(&self, keys: &[&str], bound: Bound) -> Result<usize> {
        match keys.iter().find(|k| !self.absent(k)) {
            Some(key) => self.int(key, bound),
            None => bail!("config.json: `{}` is missing", keys[0]),
        }
    }

    /// The finite number `key`, `None` when absent or null; a string or anything else is
    /// refused (never replaced by a default).
    pub fn opt_float(&self, key: &str) -> Result<Option<f64>> {
        let v = &self.value[key];
        if v.is_null() {
            return Ok(None);
        }
        number(v, &format!("`{key}`")).map(Some)
    }

    /// The number `key` above 0, or `default` when absent.
    pub fn positive(&self, key: &str, default: f64) -> Result<f64> {
        let v = self.opt_float(key)?.unwrap_or(default);
        positive(v, &format!("`{key}`"))
    }

    /// The number `key` in `[0, 1)` (a dropout), or `default` when absent.
    pub fn fraction(&self, key: &str, default: f64) -> Result<f64> {
        let v = self.opt_float(key)?.unwrap_or(default);
        if !(0.0..1.0).contains(&v) {
            bail!("config.json: `{key}` {v} must be at least 0 and less than 1");
        }
        Ok(v)
    }

    /// The number `key` at least 0, or `default` when absent.
    pub fn non_negative(&self, key: &str, default: f64) -> Result<f64> {
        let v = self.opt_float(key)?.unwrap_or(default);
        if v < 0.0 {
            bail!("config.json: `{key}` {v} must be at least 0");
        }
        as_f32(v, &format!("`{key}`")).map(f64::from)
    }

    /// The boolean `key`, `None` when absent or null.
    pub fn opt_bool(&self, key: &str) -> Result<Option<bool>> {
        match &self.value[key] {
            Value::Null => Ok(None),
            Value::Bool(b) => Ok(Some(*b)),
            other => bail!("config.json: `{key}` is {}, not true or false", kind(other)),
        }
    }

    /// The boolean `key`, `false` when absent.
    pub fn flag(&self, key: &str) -> Result<bool> {
        Ok(self.opt_bool(key)?.unwrap_or(false))
    }

    /// The string `key`, `None` when absent or null.
    pub fn opt_str(&self, key: &str) -> Result<Option<&'a str>> {
        match &self.value[key] {
            Value::Null => Ok(None),
            Value::String(s) => Ok(Some(s)),
            other => bail!("config.json: `{key}` is {}, not a string", kind(other)),
        }
    }

    /// The architecture the config describes: `architectures`' first entry, or without it the
    /// one of `model_type`; the two must agree, and one of them must be there.
    pub fn architecture(&self) -> Result<&'static str> {
        let named = match &self.value["architectures"] {
            Value::Null => None,
            Value::Array(list) => match list.first() {
                Some(Value::String(s)) => Some(s.as_str()),
                None => None,
                Some(other) => bail!(
                    "config.json: `architectures` starts with {}, not a name",
                    kind(other)
                ),
            },
            other => bail!(
                "config.json: `architectures` is {}, not a list",
                kind(other)
            ),
        };
        let model_type = self.opt_str("model_type")?;
        let known = |arch: &str| ARCHITECTURES.iter().find(|(a, _)| *a == arch);
        match (named, model_type) {
            (Some(arch), model_type) => {
                let Some(&(arch, want)) = known(arch) else {
                    bail!(
                        "config.json: architecture {arch} is not supported ({})",
                        names()
                    );
                };
                // Kimi K2 ships DeepSeek-V3's architecture under a model type of its own.
                let alias = arch == "DeepseekV3ForCausalLM" && model_type == Some("kimi_k2");
                if let Some(t) = model_type
                    && t != want
                    && !alias
                {
                    bail!(
                        "config.json: `model_type` \"{t}\" is not {arch}'s (\"{want}\"): the \
                         file names two architectures"
                    );
                }
                Ok(arch)
            }
            (None, Some(t)) => match ARCHITECTURES.iter().find(|(_, m)| *m == t) {
                Some(&(arch, _)) => Ok(arch),
                None => bail!(
                    "config.json: `model_type` \"{t}\" is not one megatron-rs reads ({})",
                    ARCHITECTURES[..8]
                        .iter()
                        .map(|(_, t)| *t)
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
            },
            (None, None) => bail!(
                "config.json names no architecture: neither `architectures` nor `model_type` is \
                 there ({} are read)",
                names()
            ),
        }
    }
}

/// Refuses a model megatron-rs cannot build from a config whose fields passed their checks:
/// more parameters than it accepts, or a combination [`GptConfig::validate`] refuses.
pub fn check_model(c: &GptConfig) -> Result<()> {
    let params = c.num_params(1);
    if params > MAX_PARAMS {
        bail!(
            "config.json describes a model of {params} parameters or more, more than megatron-rs \
             accepts (at most {MAX_PARAMS}, a thousand times the largest models trained)"
        );
    }
    c.validate(1)
        .map_err(|e| anyhow::anyhow!("config.json describes a model megatron-rs cannot build: {e}"))
}

/// What a JSON value is, for messages.
fn kind(v: &Value) -> String {
    match v {
        Value::String(s) => format!("the string {s:?}"),
        Value::Array(_) => "a list".to_string(),
        Value::Object(_) => "an object".to_string(),
        other => other.to_string(),
    }
}

/// `v` as a whole number within `bound`; `what` names it.
pub fn whole(v: &Value, what: &str, bound: Bound) -> Result<usize> {
    let (min, max, stands_for) = bound.range();
    let n = match v {
        Value::Number(n) => match (n.as_u64(), n.as_f64()) {
            (Some(n), _) => n,
            (None, Some(f)) if f < 0.0 => {
                bail!("config.json: {what} {v} must be at least {min}")
            }
            (None, Some(f)) if f.fract() == 0.0 && f > max as f64 => bail!(
                "config.json: {what} {v} is more than megatron-rs accepts (at most {max}: \
                 {stands_for})"
            ),
            _ => bail!("config.json: {what} {v} is not a whole number"),
        },
        other => bail!("config.json: {what} is {}, not a whole number", kind(other)),
    };
    if n < min {
        bail!("config.json: {what} {n} must be at least {min}");
    }
    if n > max {
        bail!(
            "config.json: {what} {n} is more than megatron-rs accepts (at most {max}: \
             {stands_for})"
        );
    }
    Ok(n as usize)
}

/// `v` as a finite number; `what` names it.
pub fn number(v: &Value, what: &str) -> Result<f64> {
    match v.as_f64() {
        Some(x) if x.is_finite() => Ok(x),
        Some(x) => bail!("config.json: {what} {x} is not a finite number"),
        None => bail!("config.json: {what} is {}, not a number", kind(v)),
    }
}

/// `v` when it is above 0 and finite in f32, the precision it is used in.
pub fn positive(v: f64, what: &str) -> Result<f64> {
    if v.is_nan() || v <= 0.0 {
        bail!("config.json: {what} {v} must be more than 0");
    }
    as_f32(v, what).map(f64::from)
}

/// `v` in f32, refused where it is infinite or a nonzero value rounds to 0.
fn as_f32(v: f64, what: &str) -> Result<f32> {
    let single = v as f32;
    if !single.is_finite() {
        bail!("config.json: {what} {v:e} is infinite in f32, the precision it is used in");
    }
    if v != 0.0 && single == 0.0 {
        bail!("config.json: {what} {v:e} is 0 in f32, the precision it is used in");
    }
    Ok(single)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn err(config: Value, f: impl Fn(&HfConfig) -> Result<()>) -> String {
        let c = HfConfig::new(&config).unwrap();
        f(&c).unwrap_err().to_string()
    }

    #[test]
    fn fields_are_bounded_as_the_command_line_is_and_named() {
        let e = err(json!({"num_hidden_layers": 1_000_000_000_000u64}), |c| {
            c.int("num_hidden_layers", Bound::Layers).map(drop)
        });
        assert_eq!(
            e,
            "config.json: `num_hidden_layers` 1000000000000 is more than megatron-rs accepts \
             (at most 16384: a model's layers)"
        );
        let e = err(json!({"max_position_embeddings": (1 << 24) + 1}), |c| {
            c.int("max_position_embeddings", Bound::Dim).map(drop)
        });
        assert!(e.contains("at most 16777216"), "{e}");
        let e = err(json!({"num_key_value_heads": 0}), |c| {
            c.int("num_key_value_heads", Bound::Dim).map(drop)
        });
        assert_eq!(e, "config.json: `num_key_value_heads` 0 must be at least 1");
        let e = err(json!({"head_dim": -4}), |c| {
            c.opt_int("head_dim", Bound::Dim).map(drop)
        });
        assert_eq!(e, "config.json: `head_dim` -4 must be at least 1");
        let e = err(json!({"hidden_size": 32.5}), |c| {
            c.int("hidden_size", Bound::Dim).map(drop)
        });
        assert_eq!(e, "config.json: `hidden_size` 32.5 is not a whole number");
        let e = err(json!({}), |c| c.int("hidden_size", Bound::Dim).map(drop));
        assert_eq!(e, "config.json: `hidden_size` is missing");
    }

    #[test]
    fn a_number_written_as_a_string_is_refused_not_defaulted() {
        let e = err(json!({"rms_norm_eps": "1e-5"}), |c| {
            c.positive("rms_norm_eps", 1e-6).map(drop)
        });
        assert_eq!(
            e,
            "config.json: `rms_norm_eps` is the string \"1e-5\", not a number"
        );
        let e = err(json!({"rms_norm_eps": -1.0}), |c| {
            c.positive("rms_norm_eps", 1e-6).map(drop)
        });
        assert_eq!(e, "config.json: `rms_norm_eps` -1 must be more than 0");
        let e = err(json!({"rms_norm_eps": 1e-60}), |c| {
            c.positive("rms_norm_eps", 1e-6).map(drop)
        });
        assert!(e.contains("is 0 in f32"), "{e}");
        let c = json!({});
        assert_eq!(
            HfConfig::new(&c)
                .unwrap()
                .positive("rms_norm_eps", 1e-6)
                .unwrap(),
            f64::from(1e-6f32)
        );
    }

    #[test]
    fn the_architecture_and_the_model_type_must_agree() {
        let arch = |v: Value| HfConfig::new(&v).unwrap().architecture();
        assert_eq!(
            arch(json!({"architectures": ["LlamaForCausalLM"], "model_type": "llama"})).unwrap(),
            "LlamaForCausalLM"
        );
        assert_eq!(
            arch(json!({"model_type": "qwen3"})).unwrap(),
            "Qwen3ForCausalLM"
        );
        let e = arch(json!({"architectures": ["LlamaForCausalLM"], "model_type": "gpt2"}))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("`model_type` \"gpt2\" is not LlamaForCausalLM's"),
            "{e}"
        );
        let e = arch(json!({"vocab_size": 3})).unwrap_err().to_string();
        assert!(e.contains("names no architecture"), "{e}");
        let e = arch(json!({"architectures": ["BertModel"]}))
            .unwrap_err()
            .to_string();
        assert!(e.contains("architecture BertModel is not supported"), "{e}");
        assert!(HfConfig::new(&json!([1])).is_err());
    }
}
