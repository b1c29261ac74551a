//! Models registered by name: `megatron train --model NAME` looks them up here.

use crate::config::GptConfig;

/// A named architecture.
#[derive(Debug)]
pub struct ModelPreset {
    /// The name, e.g. `gpt2-small`.
    pub name: &'static str,
    /// One line about it.
    pub description: &'static str,
    /// Its architecture.
    pub config: fn() -> GptConfig,
}

inventory::collect!(ModelPreset);

/// Every registered preset, sorted by name.
pub fn presets() -> Vec<&'static ModelPreset> {
    let mut all: Vec<&'static ModelPreset> = inventory::iter::<ModelPreset>.into_iter().collect();
    all.sort_by_key(|p| p.name);
    all
}

/// The preset called `name`.
pub fn preset(name: &str) -> Option<&'static ModelPreset> {
    inventory::iter::<ModelPreset>
        .into_iter()
        .find(|p| p.name == name)
}

inventory::submit! {
    ModelPreset {
        name: "gpt-tiny",
        description: "4 layers, hidden 128, 4 heads, byte vocabulary: trains on a laptop CPU in minutes",
        config: || GptConfig::new(4, 128, 4, 256, 256),
    }
}

inventory::submit! {
    ModelPreset {
        name: "gpt2-small",
        description: "GPT-2 small (124M): 12 layers, hidden 768, 12 heads, vocabulary 50,257",
        config: || GptConfig::new(12, 768, 12, 50257, 1024),
    }
}

inventory::submit! {
    ModelPreset {
        name: "gpt2-medium",
        description: "GPT-2 medium (355M): 24 layers, hidden 1024, 16 heads, vocabulary 50,257",
        config: || GptConfig::new(24, 1024, 16, 50257, 1024),
    }
}

inventory::submit! {
    ModelPreset {
        name: "gpt-1.2b",
        description: "Megatron-LM paper's 1.2B: 40 layers, hidden 1536, 16 heads, vocabulary 50,257",
        config: || GptConfig::new(40, 1536, 16, 50257, 1024),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn presets_are_registered() {
        let names: Vec<&str> = presets().iter().map(|p| p.name).collect();
        assert_eq!(names, ["gpt-1.2b", "gpt-tiny", "gpt2-medium", "gpt2-small"]);
        let big = (preset("gpt-1.2b").unwrap().config)();
        let params = big.num_params(1) as f64 / 1e9;
        assert!((1.15..1.3).contains(&params), "{params}");
        assert!(preset("gpt-3").is_none());
    }
}
