//! `megatron train`'s LoRA flags, named as Megatron-Bridge's `LoRA` config: rank-r adapters
//! beside the linear layers `--lora-target-modules` names (Megatron-LM's module names:
//! `linear_qkv`, `linear_proj`, `linear_fc1`, `linear_fc2`, and multi-latent attention's
//! `linear_q_proj`, `linear_q_down_proj`, `linear_q_up_proj`, `linear_kv_down_proj`,
//! `linear_kv_up_proj`), the base frozen.

use anyhow::{Result, bail};
use clap::Args;
use megatron::models::GptConfig;
use megatron::tensor_parallel::lora::LoraConfig;

/// The GPT's linear layers that can carry an adapter: Megatron-LM's module name, our layer
/// (the end of its dotted name) and Megatron-LM's path to it in a transformer layer.
const LAYERS: [(&str, &str, &str); 13] = [
    ("linear_qkv", "attn.qkv", "self_attention.linear_qkv"),
    ("linear_q_proj", "attn.q", "self_attention.linear_q_proj"),
    (
        "linear_q_down_proj",
        "attn.q_down",
        "self_attention.linear_q_down_proj",
    ),
    (
        "linear_q_up_proj",
        "attn.q_up",
        "self_attention.linear_q_up_proj",
    ),
    (
        "linear_kv_down_proj",
        "attn.kv_down",
        "self_attention.linear_kv_down_proj",
    ),
    (
        "linear_kv_up_proj",
        "attn.kv_up",
        "self_attention.linear_kv_up_proj",
    ),
    ("linear_proj", "attn.proj", "self_attention.linear_proj"),
    ("linear_fc1", "mlp.fc1", "mlp.linear_fc1"),
    ("linear_fc2", "mlp.fc2", "mlp.linear_fc2"),
    ("linear_fc1", "mlp.experts.fc1", "mlp.experts.linear_fc1"),
    ("linear_fc2", "mlp.experts.fc2", "mlp.experts.linear_fc2"),
    (
        "linear_fc1",
        "mlp.shared.fc1",
        "mlp.shared_experts.linear_fc1",
    ),
    (
        "linear_fc2",
        "mlp.shared.fc2",
        "mlp.shared_experts.linear_fc2",
    ),
];

/// Megatron-Bridge's four default targets (those the model has: with multi-latent attention
/// there is no `linear_qkv`, and its projections are named one by one, as Megatron-Bridge's
/// Moonlight recipe names `linear_q_proj linear_kv_down_proj linear_kv_up_proj linear_proj`).
const DEFAULT_TARGETS: [&str; 4] = ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"];

/// Whether the target `t` names the layer whose Megatron-LM module name is `module` and path
/// `path`: as Megatron-Bridge's matcher, a bare module name names every layer of that name
/// (dense, routed and shared experts alike), and a pattern `*.…` the layers whose path ends
/// with what follows the `*.` (`*.experts.linear_fc1`: the routed experts' fc1 alone).
fn names(t: &str, module: &str, path: &str) -> bool {
    match t.strip_prefix("*.") {
        Some(tail) => {
            path == tail
                || path
                    .strip_suffix(tail)
                    .is_some_and(|rest| rest.ends_with('.'))
        }
        None => t == module,
    }
}

/// LoRA's flags.
#[derive(Debug, Args)]
pub struct LoraArgs {
    /// LoRA: train rank-R adapters beside the linear layers --lora-target-modules names, the
    /// rest of the model frozen (no gradient, no optimizer state); saves hold the adapters and
    /// name the checkpoint loaded as their base (Megatron-Bridge's and PEFT's LoRA).
    #[arg(long, value_name = "R")]
    lora_rank: Option<usize>,
    /// LoRA's α: an adapter's output is scaled by α / R [default: 32, Megatron-Bridge's, or
    /// the loaded checkpoint's].
    #[arg(long, value_name = "ALPHA", requires = "lora_rank")]
    lora_alpha: Option<f32>,
    /// Dropout on the adapters' input, before A (PEFT's `lora_dropout`, Megatron-Bridge's
    /// `dropout` at its default position) [default: 0, or the loaded checkpoint's].
    #[arg(long, value_name = "P", requires = "lora_rank")]
    lora_dropout: Option<f32>,
    /// The layers that get adapters, by Megatron-LM's module names: linear_qkv, linear_proj,
    /// linear_fc1, linear_fc2 (every layer of the name: dense MLPs and experts alike),
    /// multi-latent attention's linear_q_proj, linear_q_down_proj, linear_q_up_proj,
    /// linear_kv_down_proj, linear_kv_up_proj, or Megatron-Bridge's patterns such as
    /// `*.experts.linear_fc1` (the routed experts' alone) or `*.mlp.linear_fc2` (the dense
    /// MLPs') [default: linear_qkv, linear_proj, linear_fc1, linear_fc2, those the model has].
    #[arg(long, value_name = "MODULE", num_args = 1.., requires = "lora_rank")]
    lora_target_modules: Vec<String>,
}

impl LoraArgs {
    /// The model's LoRA config: the flags' (a loaded LoRA checkpoint's adapters must be the
    /// same shape), else `saved`'s; what was taken from `saved` is noted in `taken`.
    pub fn config(
        &self,
        model: &GptConfig,
        saved: Option<&LoraConfig>,
        taken: &mut Vec<String>,
    ) -> Result<Option<LoraConfig>> {
        let Some(rank) = self.lora_rank else {
            if let Some(s) = saved {
                taken.push(format!("--lora-rank {} --lora-alpha {}", s.rank, s.alpha));
            }
            return Ok(saved.cloned());
        };
        if rank == 0 {
            bail!("--lora-rank 0 adapts nothing: give a rank of at least 1");
        }
        let alpha = self.lora_alpha.or(saved.map(|s| s.alpha)).unwrap_or(32.0);
        if !(alpha.is_finite() && alpha > 0.0) {
            bail!("--lora-alpha {alpha} must be a number above 0");
        }
        let dropout = self
            .lora_dropout
            .or(saved.map(|s| s.dropout))
            .unwrap_or(0.0);
        if !(0.0..1.0).contains(&dropout) {
            bail!("--lora-dropout {dropout} must be a probability in [0, 1)");
        }
        let present = present_layers(model)?;
        let given: Vec<&str> = match self.lora_target_modules.as_slice() {
            [] => DEFAULT_TARGETS
                .into_iter()
                .filter(|t| {
                    LAYERS
                        .iter()
                        .any(|(module, layer, _)| module == t && present.contains(layer))
                })
                .collect(),
            given => given.iter().map(String::as_str).collect(),
        };
        let mut targets = Vec::new();
        for t in given {
            let layers: Vec<&str> = LAYERS
                .iter()
                .filter(|(module, _, path)| names(t, module, path))
                .map(|(_, layer, _)| *layer)
                .filter(|layer| present.contains(layer))
                .collect();
            if layers.is_empty() {
                bail!(
                    "--lora-target-modules: the model has no `{t}` (its linear layers are {})",
                    LAYERS
                        .iter()
                        .filter(|(_, layer, _)| present.contains(layer))
                        .map(|(_, _, path)| *path)
                        .collect::<Vec<_>>()
                        .join(", ")
                );
            }
            for layer in layers {
                if !targets.iter().any(|x: &String| x == layer) {
                    targets.push(layer.to_string());
                }
            }
        }
        if dropout > 0.0
            && let Some(experts) = targets.iter().find(|t| t.starts_with("mlp.experts."))
        {
            bail!(
                "--lora-dropout {dropout} with adapters beside the routed experts ({experts}): \
                 their adapters are merged into each expert's weight (as PEFT's \
                 target_parameters, which refuses dropout too), which cannot drop the \
                 adapters' input alone; leave the experts out (--lora-target-modules \
                 linear_qkv linear_proj *.mlp.linear_fc1 ...) or --lora-dropout out"
            );
        }
        let config = LoraConfig {
            rank,
            alpha,
            dropout,
            targets,
        };
        if let Some(s) = saved
            && (s.rank != config.rank || s.targets != config.targets)
        {
            bail!(
                "--lora-rank {rank} with targets {:?}: the loaded checkpoint's adapters are of \
                 rank {} on {:?}; a run goes on with the adapters it has",
                config.targets,
                s.rank,
                s.targets
            );
        }
        Ok(Some(config))
    }
}

/// Our layers `model` has (see [`LAYERS`]).
fn present_layers(model: &GptConfig) -> Result<Vec<&'static str>> {
    let mut present = match &model.mla {
        None => vec!["attn.qkv"],
        Some(mla) if mla.q_lora_rank.is_some() => vec!["attn.q_down", "attn.q_up"],
        Some(_) => vec!["attn.q"],
    };
    if model.mla.is_some() {
        present.extend(["attn.kv_down", "attn.kv_up"]);
    }
    present.push("attn.proj");
    let routed = match &model.moe {
        Some(_) => model.moe_layers()?,
        None => vec![false; model.num_layers],
    };
    if routed.iter().any(|&r| !r) {
        present.extend(["mlp.fc1", "mlp.fc2"]);
    }
    if routed.iter().any(|&r| r) {
        present.extend(["mlp.experts.fc1", "mlp.experts.fc2"]);
        if model
            .moe
            .as_ref()
            .is_some_and(|m| m.shared_expert_ffn.is_some())
        {
            present.extend(["mlp.shared.fc1", "mlp.shared.fc2"]);
        }
    }
    Ok(present)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn targets(model: &str, given: &[&str]) -> Result<Vec<String>> {
        let args = LoraArgs {
            lora_rank: Some(4),
            lora_alpha: None,
            lora_dropout: None,
            lora_target_modules: given.iter().map(|s| s.to_string()).collect(),
        };
        let preset = megatron::models::registry::preset(model).expect("a preset");
        let config = args.config(&(preset.config)(), None, &mut Vec::new())?;
        Ok(config.expect("LoRA is on").targets)
    }

    #[test]
    fn the_default_targets_are_those_the_model_has() {
        let llama = targets("llama-tiny", &[]).unwrap();
        assert_eq!(llama, ["attn.qkv", "attn.proj", "mlp.fc1", "mlp.fc2"]);
        // Multi-latent attention has no linear_qkv: the other three names.
        let deepseek = targets("deepseek-v3-tiny", &[]).unwrap();
        assert_eq!(
            deepseek,
            [
                "attn.proj",
                "mlp.fc1",
                "mlp.experts.fc1",
                "mlp.shared.fc1",
                "mlp.fc2",
                "mlp.experts.fc2",
                "mlp.shared.fc2"
            ]
        );
        // Megatron-Bridge's Moonlight recipe's targets (queries projected directly).
        let moonlight = targets(
            "moonlight-16b-a3b",
            &[
                "linear_q_proj",
                "linear_kv_down_proj",
                "linear_kv_up_proj",
                "linear_proj",
            ],
        )
        .unwrap();
        assert_eq!(
            moonlight,
            ["attn.q", "attn.kv_down", "attn.kv_up", "attn.proj"]
        );
        let err = targets("moonlight-16b-a3b", &["linear_q_down_proj"]).unwrap_err();
        assert!(
            err.to_string()
                .contains("the model has no `linear_q_down_proj`"),
            "{err}"
        );
    }
}
