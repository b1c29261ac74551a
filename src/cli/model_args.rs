//! The architecture flags `train` and `inspect` share: a preset, then Megatron-LM's overrides.

use anyhow::{Result, bail};
use clap::Args;
use megatron::models::{GptConfig, MlaConfig, MtpConfig, PositionEmbeddingType, preset, presets};
use megatron::tensor_parallel::{Llama3Scaling, Normalization, Yarn};

use super::moe_args::MoeArgs;
use super::values;

/// A registered model and explicit overrides of its architecture.
#[derive(Debug, Args)]
pub struct ArchitectureArgs {
    /// Registered model preset; explicit architecture flags override it (see `megatron models`)
    /// [default: gpt-tiny, or a loaded checkpoint's model].
    #[arg(long)]
    model: Option<String>,
    /// Transformer layers [default: the preset's].
    #[arg(long, value_parser = values::layers)]
    num_layers: Option<usize>,
    /// Model width [default: the preset's].
    #[arg(long, value_parser = values::dim)]
    hidden_size: Option<usize>,
    /// MLP width [default: 4 × hidden size].
    #[arg(long, value_parser = values::dim)]
    ffn_hidden_size: Option<usize>,
    /// Attention heads [default: the preset's].
    #[arg(long, value_parser = values::dim)]
    num_attention_heads: Option<usize>,
    /// Learned positions [default: the preset's].
    #[arg(long, value_parser = values::dim)]
    max_position_embeddings: Option<usize>,
    /// Real vocabulary size [default: the preset's].
    #[arg(long, value_parser = values::vocab)]
    vocab_size: Option<usize>,
    /// Vocabulary padding unit [default: the preset's, 128].
    #[arg(long, value_parser = values::dim)]
    make_vocab_size_divisible_by: Option<usize>,
    /// Weight initialisation standard deviation [default: 0.02].
    #[arg(long, value_parser = values::non_negative_f32)]
    init_method_std: Option<f32>,
    /// Dropout after embeddings and residual branches [default: the preset's, 0.1].
    #[arg(long, value_parser = values::dropout)]
    hidden_dropout: Option<f32>,
    /// Dropout on attention weights [default: the preset's, 0.1].
    #[arg(long, value_parser = values::dropout)]
    attention_dropout: Option<f32>,
    /// The norms: LayerNorm or RMSNorm (no mean, no bias) [default: the preset's, LayerNorm].
    #[arg(long, value_enum)]
    normalization: Option<NormalizationArg>,
    /// The norms' ε [default: the preset's, 1e-5].
    #[arg(long, value_parser = values::non_negative_f32)]
    norm_epsilon: Option<f32>,
    /// The gated MLP: fc1 holds the gate and the up projection, joined by SwiGLU (without
    /// --ffn-hidden-size the MLP width becomes Megatron-LM's ⌊8h/3 / 64⌋·64).
    #[arg(long)]
    swiglu: bool,
    /// No biases in the linear layers (QKV, attention output, fc1, fc2).
    #[arg(long)]
    disable_bias_linear: bool,
    /// A bias in the QKV projection even with --disable-bias-linear (Qwen2's).
    #[arg(long)]
    add_qkv_bias: bool,
    /// How the model knows positions: learned_absolute, rope (rotary embeddings in attention)
    /// or none [default: the preset's, learned_absolute].
    #[arg(long, value_parser = position_embedding_type)]
    position_embedding_type: Option<PositionEmbeddingType>,
    /// RoPE's base (Hugging Face's rope_theta) [default: the preset's, 10000].
    #[arg(long, value_parser = values::positive_f32)]
    rotary_base: Option<f32>,
    /// The fraction of each head RoPE turns [default: the preset's, 1].
    #[arg(long, value_parser = values::positive_f32)]
    rotary_percent: Option<f32>,
    /// RoPE turns pairs (2j, 2j + 1) instead of rotate-half's (j, j + rot/2).
    #[arg(long)]
    rotary_interleaved: bool,
    /// Llama 3.1's RoPE frequency scaling (low 1, high 4, original context 8192, as
    /// Megatron-LM), by --rope-scaling-factor.
    #[arg(long)]
    use_rope_scaling: bool,
    /// The factor of --use-rope-scaling [default: 8].
    #[arg(long, value_parser = values::positive_f32, requires = "use_rope_scaling")]
    rope_scaling_factor: Option<f32>,
    /// The rotary embeddings' frequencies: rope, or yarn (YaRN's blend, by
    /// --rotary-scaling-factor from --original-max-position-embeddings, with --mscale and
    /// --mscale-all-dim) [default: the preset's, rope].
    #[arg(long, value_parser = ["rope", "yarn"])]
    rope_type: Option<String>,
    /// YaRN's factor [default: 1, as Megatron-LM].
    #[arg(long, value_parser = values::positive_f32)]
    rotary_scaling_factor: Option<f32>,
    /// YaRN's original context [default: 4096].
    #[arg(long, value_parser = values::dim)]
    original_max_position_embeddings: Option<usize>,
    /// YaRN's mscale [default: 1].
    #[arg(long, value_parser = values::non_negative_f32)]
    mscale: Option<f32>,
    /// YaRN's mscale_all_dim [default: 0].
    #[arg(long, value_parser = values::non_negative_f32)]
    mscale_all_dim: Option<f32>,
    /// An output layer of its own instead of the word embedding's table.
    #[arg(long)]
    untie_embeddings_and_output_weights: bool,
    /// Grouped-query attention: --num-query-groups key/value heads, each shared by
    /// heads / groups query heads.
    #[arg(long)]
    group_query_attention: bool,
    /// The key/value heads of --group-query-attention [default: 1, as Megatron-LM].
    #[arg(long, value_parser = values::dim, requires = "group_query_attention")]
    num_query_groups: Option<usize>,
    /// The heads' size [default: hidden size / heads].
    #[arg(long, value_parser = values::dim)]
    kv_channels: Option<usize>,
    /// Each query and key head normalised over its size before rotary embeddings (Qwen3's
    /// q_norm and k_norm; the norm of --normalization, with --norm-epsilon).
    #[arg(long)]
    qk_layernorm: bool,
    /// Sliding-window attention, Megatron-LM's "LEFT,RIGHT": each query sees itself and the
    /// LEFT keys before it (Hugging Face's sliding_window W is W−1,0); RIGHT must be 0 (causal).
    #[arg(long, value_parser = window_size, allow_hyphen_values = true)]
    window_size: Option<usize>,
    /// With --window-size, every N-th layer (layer numbers from 1 divisible by N) attends to
    /// every earlier key instead (without it, every layer has the window).
    #[arg(long, value_parser = values::dim, requires = "window_size")]
    window_attn_skip_freq: Option<usize>,
    /// Multi-latent attention (DeepSeek's): keys and values through a latent of
    /// --kv-lora-rank features, heads of --qk-head-dim position-free and --qk-pos-emb-head-dim
    /// rotary features, values of --v-head-dim; with rope positions and --qk-layernorm (the
    /// latents' norms).
    #[arg(long)]
    multi_latent_attention: bool,
    /// MLA's query latent [default: none, the queries projected from the hidden state].
    #[arg(long, value_parser = values::dim)]
    q_lora_rank: Option<usize>,
    /// MLA's key/value latent [default: 32].
    #[arg(long, value_parser = values::dim)]
    kv_lora_rank: Option<usize>,
    /// MLA's position-free query and key features per head [default: 128].
    #[arg(long, value_parser = values::dim)]
    qk_head_dim: Option<usize>,
    /// MLA's rotary query and key features per head [default: 64].
    #[arg(long, value_parser = values::dim)]
    qk_pos_emb_head_dim: Option<usize>,
    /// MLA's value features per head [default: 128].
    #[arg(long, value_parser = values::dim)]
    v_head_dim: Option<usize>,
    /// Multi-token prediction (DeepSeek-V3's): N depths after the model, each a layer like
    /// the last predicting one token further, their losses added to the gradient.
    #[arg(long, value_parser = values::dim)]
    mtp_num_layers: Option<usize>,
    /// The depths' losses' weight together: each adds factor / N times its mean [default: 0.1].
    #[arg(long)]
    mtp_loss_scaling_factor: Option<f32>,
    #[command(flatten)]
    moe: MoeArgs,
}

/// `--window-size LEFT,RIGHT`: the left part (the keys before a query it sees); the right part
/// must be 0, as causal attention has it.
fn window_size(s: &str) -> Result<usize, String> {
    let parts: Vec<&str> = s.split(',').collect();
    let [left, right] = parts[..] else {
        return Err(format!(
            "`{s}` has {} part{}, not two: write LEFT,RIGHT (e.g. 4095,0)",
            parts.len(),
            if parts.len() == 1 { "" } else { "s" }
        ));
    };
    let left: i64 = left
        .trim()
        .parse()
        .map_err(|_| format!("`{left}` in `{s}` is not a number"))?;
    if right.trim() != "0" {
        return Err(format!(
            "the right part of `{s}` must be 0: causal attention sees no later key"
        ));
    }
    match usize::try_from(left) {
        Ok(left) => Ok(left),
        Err(_) => Err(format!(
            "the left part of `{s}` must be 0 or more (the keys before each query it sees), \
             got {left}"
        )),
    }
}

/// `--position-embedding-type`: Megatron-LM's names; the types it has that megatron-rs does
/// not (yet) are refused by name.
fn position_embedding_type(s: &str) -> Result<PositionEmbeddingType, String> {
    match s {
        "learned_absolute" => Ok(PositionEmbeddingType::LearnedAbsolute),
        "rope" => Ok(PositionEmbeddingType::Rope),
        "none" => Ok(PositionEmbeddingType::None),
        "yarn" | "mrope" | "relative" => Err(format!(
            "{s} positions are not built in megatron-rs yet (learned_absolute, rope and none are)"
        )),
        other => Err(format!(
            "unknown type `{other}`: learned_absolute, rope or none"
        )),
    }
}

/// `--normalization`'s values, spelt as Megatron-LM's.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum NormalizationArg {
    /// LayerNorm: mean and variance, weight and bias.
    #[value(name = "LayerNorm")]
    LayerNorm,
    /// RMSNorm: the root mean square, a weight.
    #[value(name = "RMSNorm")]
    RmsNorm,
}

impl From<NormalizationArg> for Normalization {
    fn from(n: NormalizationArg) -> Normalization {
        match n {
            NormalizationArg::LayerNorm => Normalization::LayerNorm,
            NormalizationArg::RmsNorm => Normalization::RmsNorm,
        }
    }
}

/// The preset a run uses when none is named.
pub const DEFAULT_MODEL: &str = "gpt-tiny";

/// The architecture of the registered preset `name`.
fn preset_config(name: &str) -> Result<GptConfig> {
    let Some(p) = preset(name) else {
        let names: Vec<&str> = presets().iter().map(|p| p.name).collect();
        bail!(
            "--model: unknown model `{name}`; registered models: {}",
            names.join(", ")
        );
    };
    Ok((p.config)())
}

impl ArchitectureArgs {
    /// The model named with `--model`, if it was.
    pub fn model(&self) -> Option<&str> {
        self.model.as_deref()
    }

    /// The model's name: `--model`'s, else [`DEFAULT_MODEL`].
    pub fn model_name(&self) -> &str {
        self.model().unwrap_or(DEFAULT_MODEL)
    }

    /// `--vocab-size`, if given.
    pub fn vocab_size(&self) -> Option<usize> {
        self.vocab_size
    }

    /// The preset with the overrides applied, checked for `tp` tensor-parallel and `ep`
    /// expert-parallel ranks, with or without sequence parallelism.
    pub fn config(&self, tp: usize, ep: usize, sequence_parallel: bool) -> Result<GptConfig> {
        self.apply(preset_config(self.model_name())?, tp, ep, sequence_parallel)
    }

    /// Refuses flags that contradict the architecture of a checkpoint (`saved`, recorded as
    /// model `saved_name` when the checkpoint says): a flag that changes a parameter's shape,
    /// or a `--model` other than the checkpoint's, would load weights into another model.
    /// Dropout, initialisation and vocabulary padding may differ (they do not change what the
    /// checkpoint holds).
    pub fn check_against(&self, saved: &GptConfig, saved_name: Option<&str>) -> Result<()> {
        for (flag, given, held) in [
            ("num-layers", self.num_layers, saved.num_layers),
            ("hidden-size", self.hidden_size, saved.hidden_size),
            (
                "ffn-hidden-size",
                self.ffn_hidden_size,
                saved.ffn_hidden_size,
            ),
            (
                "num-attention-heads",
                self.num_attention_heads,
                saved.num_attention_heads,
            ),
            (
                "max-position-embeddings",
                self.max_position_embeddings,
                saved.max_position_embeddings,
            ),
            ("vocab-size", self.vocab_size, saved.vocab_size),
            (
                "num-query-groups",
                self.group_query_attention
                    .then(|| self.num_query_groups.unwrap_or(1)),
                saved.query_groups(),
            ),
            ("kv-channels", self.kv_channels, saved.head_dim()),
            (
                "q-lora-rank",
                self.q_lora_rank,
                saved.mla.and_then(|m| m.q_lora_rank).unwrap_or(0),
            ),
            (
                "kv-lora-rank",
                self.kv_lora_rank,
                saved.mla.map_or(0, |m| m.kv_lora_rank),
            ),
            (
                "qk-head-dim",
                self.qk_head_dim,
                saved.mla.map_or(0, |m| m.qk_head_dim),
            ),
            (
                "qk-pos-emb-head-dim",
                self.qk_pos_emb_head_dim,
                saved.mla.map_or(0, |m| m.qk_pos_emb_head_dim),
            ),
            (
                "v-head-dim",
                self.v_head_dim,
                saved.mla.map_or(0, |m| m.v_head_dim),
            ),
            (
                "num-experts",
                self.moe.num_experts(),
                saved.moe.as_ref().map_or(0, |m| m.router.num_experts),
            ),
            ("mtp-num-layers", self.mtp_num_layers, saved.mtp_depths()),
        ] {
            if let Some(given) = given
                && given != held
            {
                bail!(
                    "--{flag} {given} contradicts the checkpoint, whose model has {held}: drop the \
                     flag (a loaded model keeps its checkpoint's architecture)"
                );
            }
        }
        if let Some(n) = self.normalization
            && Normalization::from(n) != saved.normalization
        {
            bail!(
                "--normalization {n:?} contradicts the checkpoint, whose model uses {:?}: drop the \
                 flag",
                saved.normalization
            );
        }
        if let Some(p) = self.position_embedding_type
            && p != saved.position_embedding_type
        {
            bail!(
                "--position-embedding-type {p:?} contradicts the checkpoint, whose model has \
                 {:?} positions: drop the flag",
                saved.position_embedding_type
            );
        }
        for (flag, given, held) in [
            ("--swiglu", self.swiglu, saved.swiglu),
            (
                "--disable-bias-linear",
                self.disable_bias_linear,
                !saved.add_bias_linear,
            ),
            (
                "--untie-embeddings-and-output-weights",
                self.untie_embeddings_and_output_weights,
                saved.untie_embeddings_and_output_weights,
            ),
            ("--qk-layernorm", self.qk_layernorm, saved.qk_layernorm),
            (
                "--multi-latent-attention",
                self.multi_latent_attention,
                saved.mla.is_some(),
            ),
            (
                "--window-size",
                self.window_size
                    .is_some_and(|w| saved.window_size != Some(w)),
                false,
            ),
            (
                "--add-qkv-bias",
                self.add_qkv_bias,
                saved.add_qkv_bias || saved.add_bias_linear,
            ),
        ] {
            if given && !held {
                bail!(
                    "{flag} contradicts the checkpoint, whose model is built without it: drop it"
                );
            }
        }
        self.moe.check_against(saved)?;
        let Some(model) = self.model() else {
            return Ok(());
        };
        let contradicts = match saved_name {
            Some(name) => name != model,
            // A checkpoint that does not record its preset: compare the preset's shapes.
            None => {
                let p = preset_config(model)?;
                (
                    p.num_layers,
                    p.hidden_size,
                    p.ffn_hidden_size,
                    p.num_attention_heads,
                    p.max_position_embeddings,
                ) != (
                    saved.num_layers,
                    saved.hidden_size,
                    saved.ffn_hidden_size,
                    saved.num_attention_heads,
                    saved.max_position_embeddings,
                )
            }
        };
        if contradicts {
            bail!(
                "--model {model} contradicts the checkpoint, which holds {} ({} layers, hidden \
                 size {}, {} heads): drop --model to train the checkpoint's model",
                saved_name.unwrap_or("another model"),
                saved.num_layers,
                saved.hidden_size,
                saved.num_attention_heads
            );
        }
        Ok(())
    }

    /// `base` (a preset, or the architecture a checkpoint records) with the overrides applied,
    /// checked for `tp` tensor-parallel and `ep` expert-parallel ranks, with or without
    /// sequence parallelism.
    pub fn apply(
        &self,
        base: GptConfig,
        tp: usize,
        ep: usize,
        sequence_parallel: bool,
    ) -> Result<GptConfig> {
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
        if let Some(n) = self.normalization {
            c.normalization = n.into();
        }
        if let Some(eps) = self.norm_epsilon {
            c.layernorm_epsilon = eps;
        }
        if self.swiglu {
            c.swiglu = true;
            // Megatron-LM's width for a gated MLP of about 4h's parameters.
            if self.ffn_hidden_size.is_none() {
                c.ffn_hidden_size = (8 * c.hidden_size / 3 / 64) * 64;
            }
        }
        if self.disable_bias_linear {
            c.add_bias_linear = false;
        }
        if self.add_qkv_bias {
            c.add_qkv_bias = true;
        }
        if let Some(p) = self.position_embedding_type {
            c.position_embedding_type = p;
        }
        if let Some(base) = self.rotary_base {
            c.rotary.base = base;
        }
        if let Some(percent) = self.rotary_percent {
            c.rotary.percent = percent;
        }
        if self.rotary_interleaved {
            c.rotary.interleaved = true;
        }
        if self.use_rope_scaling {
            c.rotary.scaling = Some(Llama3Scaling::megatron(
                self.rope_scaling_factor.unwrap_or(8.0),
            ));
        }
        self.apply_yarn(&mut c)?;
        if self.untie_embeddings_and_output_weights {
            c.untie_embeddings_and_output_weights = true;
        }
        if self.group_query_attention {
            c.num_query_groups = Some(self.num_query_groups.unwrap_or(1));
        }
        if let Some(d) = self.kv_channels {
            c.kv_channels = Some(d);
        }
        if self.qk_layernorm {
            c.qk_layernorm = true;
        }
        if let Some(left) = self.window_size {
            c.window_size = Some(left);
            c.window_layers = self
                .window_attn_skip_freq
                .map(|n| (1..=c.num_layers).map(|l| l % n != 0).collect());
        }
        self.apply_mla(&mut c)?;
        if let Some(n) = self.mtp_num_layers {
            let mut mtp = MtpConfig::new(n);
            if let Some(f) = self.mtp_loss_scaling_factor {
                mtp.loss_scaling_factor = f;
            }
            c.mtp = Some(mtp);
        } else if let Some(f) = self.mtp_loss_scaling_factor {
            let Some(mtp) = &mut c.mtp else {
                bail!(
                    "--mtp-loss-scaling-factor {f} weighs multi-token prediction's losses, which \
                     the model does not have: add --mtp-num-layers"
                );
            };
            mtp.loss_scaling_factor = f;
        }
        self.moe.apply(&mut c)?;
        self.refuse_flags_that_do_nothing(&c)?;
        c.validate_parallel(tp, ep, sequence_parallel)?;
        Ok(c)
    }

    /// `--rope-type` and YaRN's settings, on Megatron-LM's defaults or the preset's; a setting
    /// without YaRN is refused.
    fn apply_yarn(&self, c: &mut GptConfig) -> Result<()> {
        match self.rope_type.as_deref() {
            Some("yarn") if c.rotary.yarn.is_none() => {
                c.rotary.yarn = Some(Yarn::megatron(1.0));
            }
            Some("rope") => c.rotary.yarn = None,
            _ => {}
        }
        let settings = [
            (
                "--rotary-scaling-factor",
                self.rotary_scaling_factor.is_some(),
            ),
            (
                "--original-max-position-embeddings",
                self.original_max_position_embeddings.is_some(),
            ),
            ("--mscale", self.mscale.is_some()),
            ("--mscale-all-dim", self.mscale_all_dim.is_some()),
        ];
        let Some(yarn) = &mut c.rotary.yarn else {
            if let Some((flag, _)) = settings.iter().find(|(_, given)| *given) {
                bail!("{flag} sets YaRN, which the model does not use: add --rope-type yarn");
            }
            return Ok(());
        };
        if self.use_rope_scaling || c.rotary.scaling.is_some() {
            bail!(
                "--rope-type yarn and Llama 3.1's --use-rope-scaling both rescale the \
                 frequencies: choose one"
            );
        }
        for (field, v) in [
            (&mut yarn.factor, self.rotary_scaling_factor),
            (&mut yarn.mscale, self.mscale),
            (&mut yarn.mscale_all_dim, self.mscale_all_dim),
        ] {
            if let Some(v) = v {
                *field = v;
            }
        }
        if let Some(n) = self.original_max_position_embeddings {
            yarn.original_max_position_embeddings = n;
        }
        Ok(())
    }

    /// `--multi-latent-attention` and MLA's sizes, on Megatron-LM's defaults or the preset's;
    /// a size without multi-latent attention is refused.
    fn apply_mla(&self, c: &mut GptConfig) -> Result<()> {
        if self.multi_latent_attention && self.group_query_attention {
            bail!(
                "--multi-latent-attention has one key head per query head (its latent is what \
                 the heads share): drop --group-query-attention"
            );
        }
        if self.multi_latent_attention && c.mla.is_none() {
            // In place of the preset's attention, key/value groups and all.
            c.mla = Some(MlaConfig::default());
            c.num_query_groups = None;
        }
        let sizes = [
            ("--q-lora-rank", self.q_lora_rank),
            ("--kv-lora-rank", self.kv_lora_rank),
            ("--qk-head-dim", self.qk_head_dim),
            ("--qk-pos-emb-head-dim", self.qk_pos_emb_head_dim),
            ("--v-head-dim", self.v_head_dim),
        ];
        let Some(mla) = &mut c.mla else {
            if let Some((flag, _)) = sizes.iter().find(|(_, v)| v.is_some()) {
                bail!(
                    "{flag} sizes multi-latent attention, which the model does not have: add \
                     --multi-latent-attention"
                );
            }
            return Ok(());
        };
        if self.q_lora_rank.is_some() {
            mla.q_lora_rank = self.q_lora_rank;
        }
        for (field, v) in [
            (&mut mla.kv_lora_rank, self.kv_lora_rank),
            (&mut mla.qk_head_dim, self.qk_head_dim),
            (&mut mla.qk_pos_emb_head_dim, self.qk_pos_emb_head_dim),
            (&mut mla.v_head_dim, self.v_head_dim),
        ] {
            if let Some(v) = v {
                *field = v;
            }
        }
        Ok(())
    }

    /// Refuses a flag given that changes nothing of the model `c` it was applied to (a rotary
    /// setting without rotary positions, a QKV bias beside every bias, a window every layer
    /// skips): a silently ignored flag is a run other than the one asked for.
    fn refuse_flags_that_do_nothing(&self, c: &GptConfig) -> Result<()> {
        if c.position_embedding_type != PositionEmbeddingType::Rope {
            let positions = match c.position_embedding_type {
                PositionEmbeddingType::None => "no position embeddings",
                _ => "learned absolute positions",
            };
            for (flag, given) in [
                ("--rotary-base", self.rotary_base.is_some()),
                ("--rotary-percent", self.rotary_percent.is_some()),
                ("--rotary-interleaved", self.rotary_interleaved),
                ("--use-rope-scaling", self.use_rope_scaling),
                ("--rope-type", self.rope_type.is_some()),
            ] {
                if given {
                    bail!(
                        "{flag} does nothing without rotary positions (the model has \
                         {positions}): add --position-embedding-type rope, or drop it"
                    );
                }
            }
        }
        if self.add_qkv_bias && c.add_bias_linear {
            bail!(
                "--add-qkv-bias does nothing: the model's linear layers all have biases (add \
                 --disable-bias-linear for a QKV bias alone, as Qwen2's)"
            );
        }
        if let Some(n) = self.window_attn_skip_freq {
            if n == 1 {
                bail!(
                    "--window-attn-skip-freq 1 gives every layer full attention: the window \
                     applies to none (drop --window-size, or skip fewer layers)"
                );
            }
            if n > c.num_layers {
                let or = match c.num_layers {
                    0 | 1 => String::new(),
                    l => format!(", or give 2 to {l}"),
                };
                bail!(
                    "--window-attn-skip-freq {n} skips no layer of the model's {} (every layer \
                     keeps the window): drop it{or}",
                    c.num_layers
                );
            }
        }
        Ok(())
    }
}
