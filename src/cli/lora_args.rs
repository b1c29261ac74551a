//! `megatron train`'s LoRA flags, named as Megatron-Bridge's `LoRA` config: rank-r adapters
//! beside the linear layers `--lora-target-modules` names (Megatron-LM's module names:
//! `linear_qkv`, `linear_proj`, `linear_fc1`, `linear_fc2`), the base frozen.

use anyhow::{Result, bail};
use clap::Args;
use megatron::models::GptConfig;
use megatron::tensor_parallel::lora::LoraConfig;

/// Megatron-Bridge's module names and the GPT's layers they are.
const MODULES: [(&str, &str); 4] = [
    ("linear_qkv", "attn.qkv"),
    ("linear_proj", "attn.proj"),
    ("linear_fc1", "mlp.fc1"),
    ("linear_fc2", "mlp.fc2"),
];

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
    /// Dropout on the adapters' input [default: 0, or the loaded checkpoint's]. Only 0 is
    /// supported yet.
    #[arg(long, value_name = "P", requires = "lora_rank")]
    lora_dropout: Option<f32>,
    /// The layers that get adapters, by Megatron-LM's module names: linear_qkv, linear_proj,
    /// linear_fc1, linear_fc2 [default: all four].
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
        if dropout != 0.0 {
            bail!(
                "--lora-dropout {dropout}: dropout on the adapters' input is not supported yet \
                 (0 is): leave it out"
            );
        }
        let names: Vec<&str> = match self.lora_target_modules.as_slice() {
            [] => MODULES.iter().map(|(name, _)| *name).collect(),
            given => given.iter().map(String::as_str).collect(),
        };
        let mut targets = Vec::new();
        for name in names {
            let Some((_, layer)) = MODULES.iter().find(|(n, _)| *n == name) else {
                bail!(
                    "--lora-target-modules: the model has no `{name}` (its linear layers are \
                     {})",
                    MODULES.map(|(n, _)| n).join(", ")
                );
            };
            if layer.starts_with("mlp.") && model.moe.is_some() {
                let routed = model.moe_layers()?.iter().filter(|&&m| m).count();
                if routed == model.num_layers {
                    bail!(
                        "--lora-target-modules {name}: every MLP of the model is a mixture of \
                         experts, and LoRA beside the experts' layers is not supported yet: \
                         target linear_qkv and linear_proj"
                    );
                }
                bail!(
                    "--lora-target-modules {name}: {routed} of the model's {} MLPs are mixtures \
                     of experts, and LoRA beside the experts' layers is not supported yet: \
                     target linear_qkv and linear_proj",
                    model.num_layers
                );
            }
            if !targets.contains(&layer.to_string()) {
                targets.push(layer.to_string());
            }
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
