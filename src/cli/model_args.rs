//! The architecture flags `train` and `inspect` share: a preset, then Megatron-LM's overrides.

use anyhow::{Result, bail};
use clap::Args;
use megatron::models::{GptConfig, preset, presets};

/// A registered model and explicit overrides of its architecture.
#[derive(Debug, Args)]
pub struct ArchitectureArgs {
    /// Registered model preset; explicit architecture flags override it (see `megatron models`).
    #[arg(long, default_value = "gpt-tiny")]
    pub model: String,
    /// Transformer layers [default: the preset's].
    #[arg(long)]
    num_layers: Option<usize>,
    /// Model width [default: the preset's].
    #[arg(long)]
    hidden_size: Option<usize>,
    /// MLP width [default: 4 × hidden size].
    #[arg(long)]
    ffn_hidden_size: Option<usize>,
    /// Attention heads [default: the preset's].
    #[arg(long)]
    num_attention_heads: Option<usize>,
    /// Learned positions [default: the preset's].
    #[arg(long)]
    max_position_embeddings: Option<usize>,
    /// Real vocabulary size [default: the preset's].
    #[arg(long)]
    vocab_size: Option<usize>,
    /// Vocabulary padding unit [default: the preset's, 128].
    #[arg(long)]
    make_vocab_size_divisible_by: Option<usize>,
    /// Weight initialisation standard deviation [default: 0.02].
    #[arg(long)]
    init_method_std: Option<f32>,
    /// Dropout after embeddings and residual branches [default: the preset's, 0.1].
    #[arg(long)]
    hidden_dropout: Option<f32>,
    /// Dropout on attention weights [default: the preset's, 0.1].
    #[arg(long)]
    attention_dropout: Option<f32>,
}

impl ArchitectureArgs {
    /// The preset with the overrides applied, checked for `tp` tensor-parallel ranks.
    pub fn config(&self, tp: usize) -> Result<GptConfig> {
        let Some(p) = preset(&self.model) else {
            let names: Vec<&str> = presets().iter().map(|p| p.name).collect();
            bail!(
                "unknown model `{}`; registered models: {}",
                self.model,
                names.join(", ")
            );
        };
        self.apply((p.config)(), tp)
    }

    /// `base` (a preset, or the architecture a checkpoint records) with the overrides applied,
    /// checked for `tp` tensor-parallel ranks.
    pub fn apply(&self, base: GptConfig, tp: usize) -> Result<GptConfig> {
        let mut c = base;
        if let Some(v) = self.hidden_size {
            c.hidden_size = v;
            c.ffn_hidden_size = 4 * v;
        }
        let set = |field: &mut usize, v: Option<usize>| {
            if let Some(v) = v {
                *field = v;
            }
        };
        set(&mut c.num_layers, self.num_layers);
        set(&mut c.ffn_hidden_size, self.ffn_hidden_size);
        set(&mut c.num_attention_heads, self.num_attention_heads);
        set(&mut c.max_position_embeddings, self.max_position_embeddings);
        set(&mut c.vocab_size, self.vocab_size);
        set(
            &mut c.make_vocab_size_divisible_by,
            self.make_vocab_size_divisible_by,
        );
        for (field, v) in [
            (&mut c.init_method_std, self.init_method_std),
            (&mut c.hidden_dropout, self.hidden_dropout),
            (&mut c.attention_dropout, self.attention_dropout),
        ] {
            if let Some(v) = v {
                *field = v;
            }
        }
        c.validate(tp)?;
        Ok(c)
    }
}
