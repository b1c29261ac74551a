//! `GptConfig`: the architecture of a GPT, with Megatron-LM's argument names, and its checks.

use megatron_core::Result;
use megatron_core::cuda_graphs::ScopedModel;
use megatron_core::invalid;
use megatron_core::limits::{MAX_LAYERS, MAX_PARAMS};
use megatron_core::moe::{
    DispatcherKind, GroupLimited, LoadBalancing, RouterConfig, ScoreFunction,
};
use megatron_core::tensor_parallel::lora::LoraConfig;
use megatron_core::tensor_parallel::{Normalization, Rotary, Yarn, padded_vocab_size};

use crate::mla::MlaConfig;

/// Which layers are MoE layers (`--moe-layer-freq`).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum MoeLayerFreq {
    /// Every k-th layer, starting with the first (`--moe-layer-freq k`; 1: all of them).
    Every(usize),
    /// One entry per layer, 1 for MoE and 0 for dense (`--moe-layer-freq [0,1,1,1]`).
    Pattern(Vec<u8>),
}

impl MoeLayerFreq {
    /// Parses Megatron-LM's forms: an integer, or a list of 0s and 1s such as `[0,1,1]` (a
    /// repetition such as `[0]*1+[1]*3` is also accepted, as Megatron-LM evaluates it).
    pub fn parse(text: &str) -> std::result::Result<MoeLayerFreq, String> {
        let t = text.trim();
        if let Ok(k) = t.parse::<usize>() {
            return if k == 0 {
                Err("--moe-layer-freq must be at least 1".into())
            } else {
                Ok(MoeLayerFreq::Every(k))
            };
        }
        let mut pattern = Vec::new();
        for term in t.split('+') {
            let term = term.trim();
            let (list, times) = match term.split_once('*') {
                Some((list, n)) => (
                    list.trim(),
                    n.trim()
                        .parse::<usize>()
                        .map_err(|_| format!("--moe-layer-freq {text}: `{n}` is not a count"))?,
                ),
                None => (term, 1),
            };
            let inner = list
                .strip_prefix('[')
                .and_then(|l| l.strip_suffix(']'))
                .ok_or_else(|| {
                    format!("--moe-layer-freq {text}: write an integer or a list such as [0,1,1,1]")
                })?;
            let mut items = Vec::new();
            for item in inner.split(',').map(str::trim).filter(|i| !i.is_empty()) {
                match item {
                    "0" => items.push(0),
                    "1" => items.push(1),
                    _ => {
                        return Err(format!(
                            "--moe-layer-freq {text}: `{item}` is not 0 (dense) or 1 (MoE)"
                        ));
                    }
                }
            }
            let length = pattern.len() as u128 + items.len() as u128 * times as u128;
            if length > MAX_LAYERS as u128 {
                return Err(format!(
                    "--moe-layer-freq {text}: lists {length} layers or more, more than \
                     megatron-rs accepts (at most {MAX_LAYERS}: a model's layers)"
                ));
            }
            for _ in 0..times {
                pattern.extend_from_slice(&items);
            }
        }
        Ok(MoeLayerFreq::Pattern(pattern))
    }

    /// Whether each of `layers` layers is a MoE layer, or why the pattern does not fit.
    pub fn layers(&self, layers: usize) -> Result<Vec<bool>> {
        match self {
            MoeLayerFreq::Every(k) => Ok((0..layers).map(|i| i % k.max(&1) == 0).collect()),
            MoeLayerFreq::Pattern(p) if p.len() == layers => {
                Ok(p.iter().map(|&b| b == 1).collect())
            }
            MoeLayerFreq::Pattern(p) => invalid!(
                "--moe-layer-freq lists {} layers but the model has --num-layers {layers}",
                p.len()
            ),
        }
    }
}

/// How a model knows positions (Megatron-LM's `--position-embedding-type`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PositionEmbeddingType {
    /// A learned table added to the word embedding (GPT-2).
    #[default]
    LearnedAbsolute,
    /// Rotary embeddings in attention (Llama, Mistral, Qwen, Mixtral).
    Rope,
    /// None.
    None,
}

/// A GPT's mixture-of-experts settings (Megatron-LM's `--num-experts` family).
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct MoeConfig {
    /// The router: `--num-experts`, `--moe-router-topk`, scores, losses and capacity.
    pub router: RouterConfig,
    /// Each expert's hidden layer (`--moe-ffn-hidden-size`).
    pub ffn_hidden_size: usize,
    /// Which layers are MoE layers (`--moe-layer-freq`).
    pub layer_freq: MoeLayerFreq,
    /// The shared experts' hidden layer, summed with the routed experts' output
    /// (`--moe-shared-expert-intermediate-size`); `None` without shared experts.
    pub shared_expert_ffn: Option<usize>,
    /// How tokens reach the experts (`--moe-token-dispatcher-type`).
    #[serde(default)]
    pub dispatcher: DispatcherKind,
}

/// DeepSeek-V3's mixture of experts: its routing (sigmoid scores, the expert bias, group-limited
/// routing, routed scaling, the sequence-wise aux loss of 1e-4), the experts and the dense first
/// layers.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DeepSeekMoe {
    /// Routed SwiGLU experts.
    pub experts: usize,
    /// Experts per token.
    pub topk: usize,
    /// Each expert's hidden size.
    pub ffn: usize,
    /// Shared experts beside them (of `ffn` each; 0: none).
    pub shared: usize,
    /// Routing groups (1: none).
    pub groups: usize,
    /// The groups each token keeps.
    pub group_topk: usize,
    /// The routed scaling factor.
    pub scaling: f32,
    /// The dense layers the model starts with.
    pub dense: usize,
}

impl GptConfig {
    /// The DeepSeek-V3 architecture (Kimi K2's, Moonlight's): `layers × hidden`, `heads` heads
    /// of multi-latent attention of `mla`, the dense layers' SwiGLU of `ffn`, experts of `moe`,
    /// a vocabulary of `vocab` and `positions` positions, rotary base `theta` with YaRN when
    /// given, RMSNorm of `eps` (the latents' of 1e-6, as DeepSeek's code), an untied output
    /// layer, no biases, no dropout.
    pub fn deepseek_v3(
        (layers, hidden, heads, ffn): (usize, usize, usize, usize),
        (vocab, positions): (usize, usize),
        mla: MlaConfig,
        moe: DeepSeekMoe,
        (theta, yarn): (f32, Option<Yarn>),
        eps: f32,
    ) -> GptConfig {
        let mut c = GptConfig::llama(layers, hidden, heads, heads, ffn, vocab, positions, theta);
        c.num_query_groups = None;
        // DeepSeek's code norms the latents with ε 1e-6 whatever the model's is.
        let latent = 1e-6;
        c.mla = Some(MlaConfig {
            latent_norm_epsilon: (eps != latent).then_some(latent),
            ..mla
        });
        c.qk_layernorm = true;
        c.rotary.yarn = yarn;
        c.layernorm_epsilon = eps;
        let mut pattern = vec![0u8; moe.dense.min(layers)];
        pattern.resize(layers, 1);
        c.moe = Some(MoeConfig {
            router: RouterConfig {
                score_function: ScoreFunction::Sigmoid,
                expert_bias: true,
                topk_scaling_factor: Some(moe.scaling),
                group_limited: (moe.groups > 1).then_some(GroupLimited {
                    groups: moe.groups,
                    topk: moe.group_topk,
                }),
                load_balancing: LoadBalancing::SeqAuxLoss,
                aux_loss_coeff: 1e-4,
                ..RouterConfig::new(moe.experts, moe.topk)
            },
            ffn_hidden_size: moe.ffn,
            layer_freq: MoeLayerFreq::Pattern(pattern),
            shared_expert_ffn: (moe.shared > 0).then_some(moe.shared * moe.ffn),
            dispatcher: Default::default(),
        });
        c
    }
}

/// The architecture of a GPT (GPT-2 / Megatron-LM style).
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct GptConfig {
    /// Transformer layers (`--num-layers`).
    pub num_layers: usize,
    /// Model width (`--hidden-size`).
    pub hidden_size: usize,
    /// MLP width (`--ffn-hidden-size`, 4 × hidden by default).
    pub ffn_hidden_size: usize,
    /// Attention heads (`--num-attention-heads`).
    pub num_attention_heads: usize,
    /// Real vocabulary size (the tokenizer's).
    pub vocab_size: usize,
    /// Learned positions (`--max-position-embeddings`).
    pub max_position_embeddings: usize,
    /// Dropout after embeddings and each residual branch (`--hidden-dropout`).
    pub hidden_dropout: f32,
    /// Dropout on attention weights (`--attention-dropout`).
    pub attention_dropout: f32,
    /// Standard deviation of weight initialisation (`--init-method-std`).
    pub init_method_std: f32,
    /// Vocabulary padding unit (`--make-vocab-size-divisible-by`).
    pub make_vocab_size_divisible_by: usize,
    /// The norms' ε (`--norm-epsilon`).
    pub layernorm_epsilon: f32,
    /// LayerNorm or RMSNorm (`--normalization`).
    #[serde(default)]
    pub normalization: Normalization,
    /// The gated MLP (`--swiglu`): fc1 holds the gate and the up projection, `2 × ffn` outputs,
    /// and SwiGLU joins them.
    #[serde(default)]
    pub swiglu: bool,
    /// Biases in the linear layers (`--disable-bias-linear` turns them off).
    #[serde(default = "biased")]
    pub add_bias_linear: bool,
    /// A bias in the QKV projection even without the others (`--add-qkv-bias`, Qwen2's).
    #[serde(default)]
    pub add_qkv_bias: bool,
    /// Learned positions, rotary embeddings or none (`--position-embedding-type`).
    #[serde(default)]
    pub position_embedding_type: PositionEmbeddingType,
    /// The rotary embeddings' settings (`--rotary-base`, `--rotary-percent`,
    /// `--rotary-interleaved`, `--use-rope-scaling`), read with `rope` positions.
    #[serde(default)]
    pub rotary: Rotary,
    /// An output layer of its own instead of the word embedding's table
    /// (`--untie-embeddings-and-output-weights`).
    #[serde(default)]
    pub untie_embeddings_and_output_weights: bool,
    /// Key/value heads of grouped-query attention (`--group-query-attention
    /// --num-query-groups`); `None`: multi-head attention.
    #[serde(default)]
    pub num_query_groups: Option<usize>,
    /// The heads' size (`--kv-channels`); `None`: hidden / heads.
    #[serde(default)]
    pub kv_channels: Option<usize>,
    /// Each query and key head normalised over its size before rotary embeddings
    /// (`--qk-layernorm`, Qwen3's), by `normalization` with the same ε.
    #[serde(default)]
    pub qk_layernorm: bool,
    /// Sliding-window attention (`--window-size`): each query sees itself and at most this
    /// many keys before it; `None`: every earlier key.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub window_size: Option<usize>,
    /// Which layers the window applies to, one entry per layer (`--window-attn-skip-freq`,
    /// Qwen's `max_window_layers`, Hugging Face's `layer_types`); `None`: all of them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub window_layers: Option<Vec<bool>>,
    /// Mixture of experts in the MLPs (`--num-experts` and the `--moe-*` flags); `None`: a
    /// dense GPT.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub moe: Option<MoeConfig>,
    /// Multi-latent attention (`--multi-latent-attention` and its sizes), DeepSeek's, in
    /// place of attention on a fused projection; `None`: that attention.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mla: Option<MlaConfig>,
    /// LoRA adapters beside the linear layers it names (`--lora-rank` and the `--lora-*`
    /// flags): the base frozen, the adapters trained; `None`: no adapters.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lora: Option<LoraConfig>,
    /// Multi-token prediction (`--mtp-num-layers`, DeepSeek-V3's): depths after the model
    /// predicting one token further each; `None`: none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mtp: Option<MtpConfig>,
}

/// Multi-token prediction as Megatron-LM's `--mtp-num-layers` and `--mtp-loss-scaling-factor`
/// set it: `num_layers` depths, each a transformer layer like the model's last, whose losses
/// add `loss_scaling_factor / num_layers` times their masked mean to the loss's gradient.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct MtpConfig {
    /// The depths (`--mtp-num-layers`, at least 1).
    pub num_layers: usize,
    /// The depths' losses' weight together (`--mtp-loss-scaling-factor`, 0.1 by default).
    #[serde(default = "mtp_loss_scaling_factor")]
    pub loss_scaling_factor: f32,
}

/// Megatron-LM's `--mtp-loss-scaling-factor` default.
fn mtp_loss_scaling_factor() -> f32 {
    0.1
}

impl MtpConfig {
    /// `num_layers` depths with Megatron-LM's loss scaling factor (0.1).
    pub fn new(num_layers: usize) -> Self {
        MtpConfig {
            num_layers,
            loss_scaling_factor: mtp_loss_scaling_factor(),
        }
    }
}

/// `add_bias_linear`'s value in a file written before it existed.
fn biased() -> bool {
    true
}

impl GptConfig {
    /// `b`, building this model's LoRA adapters when it has them.
    pub fn adapters(&self, b: megatron_core::module::Builder) -> megatron_core::module::Builder {
        b.with_lora(self.lora.clone())
    }

    /// With LoRA, freezes every parameter of `model` but the adapters' (the base, as PEFT and
    /// Megatron-Bridge train it) and the routers' expert biases (moved by the token counts, as
    /// Megatron-LM's buffer keeps moving); returns how many it froze (none without LoRA).
    pub fn freeze_base(&self, model: &mut impl megatron_core::module::Module) -> usize {
        use megatron_core::tensor_parallel::lora::is_adapter_param;
        match self.lora {
            Some(_) => model.freeze(&|s| {
                !is_adapter_param(&s.name) && !megatron_core::moe::is_expert_bias(&s.name)
            }),
            None => 0,
        }
    }

    /// A GPT of `num_layers × hidden_size` with `heads` heads and GPT-2 defaults elsewhere
    /// (ffn 4h, dropout 0.1, init std 0.02, vocabulary padded to multiples of 128).
    pub fn new(
        num_layers: usize,
        hidden_size: usize,
        heads: usize,
        vocab_size: usize,
        max_positions: usize,
    ) -> Self {
        GptConfig {
            num_layers,
            hidden_size,
            ffn_hidden_size: 4 * hidden_size,
            num_attention_heads: heads,
            vocab_size,
            max_position_embeddings: max_positions,
            hidden_dropout: 0.1,
            attention_dropout: 0.1,
            init_method_std: 0.02,
            make_vocab_size_divisible_by: 128,
            layernorm_epsilon: 1e-5,
            normalization: Normalization::LayerNorm,
            swiglu: false,
            add_bias_linear: true,
            add_qkv_bias: false,
            position_embedding_type: PositionEmbeddingType::LearnedAbsolute,
            rotary: Rotary::default(),
            untie_embeddings_and_output_weights: false,
            num_query_groups: None,
            kv_channels: None,
            qk_layernorm: false,
            window_size: None,
            window_layers: None,
            moe: None,
            mla: None,
            lora: None,
            mtp: None,
        }
    }

    /// A Llama-family decoder (Llama 3, as Megatron-LM's flags make one): `num_layers ×
    /// hidden_size`, `heads` query heads in `groups` key/value groups, RMSNorm (ε 1e-5), a
    /// SwiGLU MLP of `ffn`, no biases, rotary embeddings of base `rope_theta`, an untied output
    /// layer, no dropout, the vocabulary padded to multiples of 128.
    #[allow(clippy::too_many_arguments)]
    pub fn llama(
        num_layers: usize,
        hidden_size: usize,
        heads: usize,
        groups: usize,
        ffn: usize,
        vocab_size: usize,
        max_positions: usize,
        rope_theta: f32,
    ) -> Self {
        GptConfig {
            ffn_hidden_size: ffn,
            hidden_dropout: 0.0,
            attention_dropout: 0.0,
            normalization: Normalization::RmsNorm,
            swiglu: true,
            add_bias_linear: false,
            position_embedding_type: PositionEmbeddingType::Rope,
            rotary: Rotary {
                base: rope_theta,
                ..Rotary::default()
            },
            untie_embeddings_and_output_weights: true,
            num_query_groups: Some(groups),
            ..GptConfig::new(num_layers, hidden_size, heads, vocab_size, max_positions)
        }
    }

    /// The same GPT with mixture-of-experts MLPs.
    pub fn with_moe(mut self, moe: MoeConfig) -> Self {
        self.moe = Some(moe);
        self
    }

    /// Key/value heads: the query groups, or every head.
    pub fn query_groups(&self) -> usize {
        self.num_query_groups.unwrap_or(self.num_attention_heads)
    }

    /// The heads' size: `--kv-channels`, or hidden / heads.
    pub fn head_dim(&self) -> usize {
        self.kv_channels
            .unwrap_or(self.hidden_size / self.num_attention_heads.max(1))
    }

    /// The sliding window of layer `layer`'s attention (see [`GptConfig::window_size`]).
    pub fn window_of(&self, layer: usize) -> Option<usize> {
        let windowed = self
            .window_layers
            .as_ref()
            .is_none_or(|l| l.get(layer).copied().unwrap_or(false));
        self.window_size.filter(|_| windowed)
    }

    /// Whether each layer's MLP is a MoE layer (none for a dense GPT).
    pub fn moe_layers(&self) -> Result<Vec<bool>> {
        match &self.moe {
            None => Ok(vec![false; self.num_layers]),
            Some(moe) => moe.layer_freq.layers(self.num_layers),
        }
    }

    /// What the checks of `--cuda-graph-scope` need to know of this model, with full
    /// activation recompute or not.
    pub fn scoped_model(&self, full_recompute: bool) -> Result<ScopedModel> {
        let moe = self.moe_layers()?;
        let moe_layers = moe.iter().filter(|&&m| m).count();
        Ok(ScopedModel {
            dense_layers: moe.len() - moe_layers,
            moe_layers,
            full_recompute,
        })
    }

    /// Checks that the sizes divide as tensor parallelism over `tp` ranks and expert
    /// parallelism over `ep` ranks need; every message names the numbers.
    pub fn validate_parallel(&self, tp: usize, ep: usize, sequence_parallel: bool) -> Result<()> {
        self.validate(tp)?;
        let Some(moe) = &self.moe else {
            return Ok(());
        };
        if tp > 1 && !sequence_parallel {
            return invalid!(
                "MoE layers with tensor-parallel size {tp} need sequence parallelism (Megatron-LM \
                 refuses to train them without it): add --sequence-parallel, or use \
                 --tensor-model-parallel-size 1 with expert and data parallelism"
            );
        }
        moe.router.validate()?;
        let r = &moe.router;
        // Megatron-LM's TransformerConfig: a softmax over one chosen expert is always 1, so
        // top-1 softmax routing would give the router no gradient.
        if r.topk == 1
            && r.score_function == megatron_core::moe::ScoreFunction::Softmax
            && !r.pre_softmax
        {
            return invalid!(
                "--moe-router-topk 1 with softmax scores needs --moe-router-pre-softmax (a \
                 softmax over the one chosen expert is always 1: the router would learn nothing)"
            );
        }
        self.moe_layers()?;
        let experts = moe.router.num_experts;
        if !experts.is_multiple_of(ep) {
            return invalid!(
                "--num-experts {experts} is not divisible by --expert-model-parallel-size {ep}"
            );
        }
        if moe.ffn_hidden_size == 0 {
            return invalid!("--moe-ffn-hidden-size must be at least 1");
        }
        if let Some(shared) = moe.shared_expert_ffn
            && !shared.is_multiple_of(tp)
        {
            return invalid!(
                "--moe-shared-expert-intermediate-size {shared} is not divisible by \
                 --tensor-model-parallel-size {tp}"
            );
        }
        Ok(())
    }

    /// Checks that the sizes divide as tensor parallelism over `tp` ranks needs; every message
    /// names the numbers.
    pub fn validate(&self, tp: usize) -> Result<()> {
        let c = self;
        for (name, v) in [
            ("num-layers", c.num_layers),
            ("hidden-size", c.hidden_size),
            ("ffn-hidden-size", c.ffn_hidden_size),
            ("num-attention-heads", c.num_attention_heads),
            ("vocab size", c.vocab_size),
            ("max-position-embeddings", c.max_position_embeddings),
        ] {
            if v == 0 {
                return invalid!("--{name} must be at least 1");
            }
        }
        if c.kv_channels.is_none() && !c.hidden_size.is_multiple_of(c.num_attention_heads) {
            return invalid!(
                "--hidden-size {} is not divisible by --num-attention-heads {}",
                c.hidden_size,
                c.num_attention_heads
            );
        }
        if c.kv_channels == Some(0) {
            return invalid!("--kv-channels must be at least 1");
        }
        let groups = c.query_groups();
        if groups == 0 || !c.num_attention_heads.is_multiple_of(groups) {
            return invalid!(
                "--num-attention-heads {} is not divisible by --num-query-groups {groups}",
                c.num_attention_heads
            );
        }
        if !c.num_attention_heads.is_multiple_of(tp) {
            return invalid!(
                "--num-attention-heads {} is not divisible by --tensor-model-parallel-size {tp}",
                c.num_attention_heads
            );
        }
        if !groups.is_multiple_of(tp) && !tp.is_multiple_of(groups) {
            return invalid!(
                "--num-query-groups {groups} and --tensor-model-parallel-size {tp}: one must \
                 divide the other (a key/value head is split over no ranks, or shared by tp / \
                 groups of them)"
            );
        }
        if !c.hidden_size.is_multiple_of(tp) {
            return invalid!(
                "--hidden-size {} is not divisible by --tensor-model-parallel-size {tp}",
                c.hidden_size
            );
        }
        if !c.ffn_hidden_size.is_multiple_of(tp) {
            return invalid!(
                "--ffn-hidden-size {} is not divisible by --tensor-model-parallel-size {tp}",
                c.ffn_hidden_size
            );
        }
        if let Some(mla) = &c.mla {
            c.validate_mla(mla)?;
        } else if c.position_embedding_type == PositionEmbeddingType::Rope {
            c.rotary.dims(c.head_dim())?;
        }
        if let Some(mtp) = &c.mtp {
            c.validate_mtp(mtp)?;
        }
        if let Some(layers) = &c.window_layers
            && layers.len() != c.num_layers
        {
            return invalid!(
                "the sliding window's layer pattern lists {} layers but the model has \
                 --num-layers {}",
                layers.len(),
                c.num_layers
            );
        }
        let params = c.params_exact(tp, false);
        if params > MAX_PARAMS as u128 {
            return invalid!(
                "the model has {params} parameters (--num-layers {} × --hidden-size {} ...), more \
                 than megatron-rs accepts (at most {MAX_PARAMS}, a thousand times the largest \
                 models trained)",
                c.num_layers,
                c.hidden_size
            );
        }
        for (name, p) in [
            ("hidden-dropout", c.hidden_dropout),
            ("attention-dropout", c.attention_dropout),
        ] {
            if !(0.0..1.0).contains(&p) {
                return invalid!("--{name} must be in [0, 1), got {p}");
            }
        }
        Ok(())
    }

    /// Multi-latent attention's checks: sizes of at least 1, the rotary part's pairs, and what
    /// this model's MLA does not build (each refused by name).
    fn validate_mla(&self, mla: &MlaConfig) -> Result<()> {
        for (name, v) in [
            ("kv-lora-rank", mla.kv_lora_rank),
            ("qk-head-dim", mla.qk_head_dim),
            ("v-head-dim", mla.v_head_dim),
            ("q-lora-rank", mla.q_lora_rank.unwrap_or(1)),
        ] {
            if v == 0 {
                return invalid!("--{name} must be at least 1");
            }
        }
        self.rotary.dims(mla.qk_pos_emb_head_dim).map_err(|e| {
            megatron_core::Error::Invalid(format!(
                "--qk-pos-emb-head-dim {}: {e}",
                mla.qk_pos_emb_head_dim
            ))
        })?;
        if self.position_embedding_type != PositionEmbeddingType::Rope {
            return invalid!(
                "--multi-latent-attention turns its heads' rotary part: add \
                 --position-embedding-type rope (got {:?} positions)",
                self.position_embedding_type
            );
        }
        if !self.qk_layernorm {
            return invalid!(
                "--multi-latent-attention builds the latents' norms (DeepSeek's q_a_layernorm \
                 and kv_a_layernorm; Megatron-LM's with --qk-layernorm): add --qk-layernorm"
            );
        }
        if let Some(groups) = self.num_query_groups {
            return invalid!(
                "--multi-latent-attention has one key head per query head (its latent is what \
                 the heads share): drop --group-query-attention --num-query-groups {groups}"
            );
        }
        if self.attention_dropout > 0.0 {
            return invalid!(
                "--multi-latent-attention runs the general attention, which has no dropout on \
                 its weights yet: set --attention-dropout 0 (got {}; DeepSeek trains with 0)",
                self.attention_dropout
            );
        }
        Ok(())
    }

    /// Multi-token prediction's settings: at least one depth, a finite non-negative weight,
    /// and positions the depths can take (rotary or none: Megatron-LM's depths look up the
    /// next tokens with shifted learned positions, which megatron-rs does not build).
    fn validate_mtp(&self, mtp: &MtpConfig) -> Result<()> {
        if mtp.num_layers == 0 {
            return invalid!("--mtp-num-layers must be at least 1 (leave it out for none)");
        }
        if !(mtp.loss_scaling_factor.is_finite() && mtp.loss_scaling_factor >= 0.0) {
            return invalid!(
                "--mtp-loss-scaling-factor must be finite and at least 0, got {}",
                mtp.loss_scaling_factor
            );
        }
        if self.position_embedding_type == PositionEmbeddingType::LearnedAbsolute {
            return invalid!(
                "--mtp-num-layers {} with learned absolute positions: the depths would look \
                 the next tokens up at shifted positions, which megatron-rs does not build; use \
                 --position-embedding-type rope (DeepSeek-V3's) or none",
                mtp.num_layers
            );
        }
        Ok(())
    }

    /// The vocabulary padded for `tp` ranks.
    pub fn padded_vocab_size(&self, tp: usize) -> usize {
        padded_vocab_size(self.vocab_size, self.make_vocab_size_divisible_by, tp)
    }

    /// Parameters of the whole model (the padded vocabulary at `tp`; the tied output layer
    /// counted once; every expert).
    pub fn num_params(&self, tp: usize) -> usize {
        self.params(tp, false)
    }

    /// Parameters one token uses: [`GptConfig::num_params`] with each MoE layer's experts
    /// counted top-k times, not every one (the same as `num_params` for a dense GPT).
    pub fn active_params(&self, tp: usize) -> usize {
        self.params(tp, true)
    }

    fn params(&self, tp: usize, active: bool) -> usize {
        // A validated config has at most `MAX_PARAMS` parameters.
        usize::try_from(self.params_exact(tp, active)).unwrap_or(usize::MAX)
    }

    /// The parameter count in u128, where no product of sizes overflows.
    fn params_exact(&self, tp: usize, active: bool) -> u128 {
        let (h, f) = (self.hidden_size as u128, self.ffn_hidden_size as u128);
        let bias = |n: u128| if self.add_bias_linear { n } else { 0 };
        let norm = match self.normalization {
            Normalization::LayerNorm => 2 * h,
            Normalization::RmsNorm => h,
        };
        let gates = if self.swiglu { 2 } else { 1 };
        let mlp = |f: u128| (gates * f * h + bias(gates * f)) + (h * f + bias(h));
        let (heads, groups) = (
            self.num_attention_heads as u128,
            self.query_groups() as u128,
        );
        let qkv = (heads + 2 * groups) * self.head_dim() as u128;
        let qkv_bias = if self.add_bias_linear || self.add_qkv_bias {
            qkv
        } else {
            0
        };
        let per_norm = norm / h;
        let attention = match &self.mla {
            Some(mla) => mla.params(h, heads, per_norm, bias(h)),
            None => {
                let qk_norms = if self.qk_layernorm {
                    2 * per_norm * self.head_dim() as u128
                } else {
                    0
                };
                (h * qkv + qkv_bias) + (heads * self.head_dim() as u128 * h + bias(h)) + qk_norms
            }
        };
        let common = 2 * norm + attention;
        let layer = |is_moe: bool| match (&self.moe, is_moe) {
            (Some(moe), true) => {
                let e = moe.router.num_experts as u128;
                let used = if active { moe.router.topk as u128 } else { e };
                common
                    + e * h
                    + used * (gates + 1) * h * moe.ffn_hidden_size as u128
                    + moe.shared_expert_ffn.map_or(0, |s| mlp(s as u128))
            }
            _ => common + mlp(f),
        };
        let moe_layers = self.moe_layers().unwrap_or_default();
        let layers: u128 = moe_layers.iter().map(|&is_moe| layer(is_moe)).sum();
        // Each depth: its two input norms, the projection 2h → h, a layer like the last one
        // and its final norm (the embedding and the output layer are the model's).
        let mtp = self.mtp.map_or(0, |m| {
            let last_is_moe = moe_layers.last().copied().unwrap_or(false);
            m.num_layers as u128 * (3 * norm + 2 * h * h + layer(last_is_moe))
        });
        let tables = if self.untie_embeddings_and_output_weights {
            2
        } else {
            1
        };
        let positions = match self.position_embedding_type {
            PositionEmbeddingType::LearnedAbsolute => self.max_position_embeddings as u128 * h,
            _ => 0,
        };
        tables * self.padded_vocab_size(tp) as u128 * h + positions + layers + norm + mtp
    }

    /// The parameters multi-token prediction's depths add (none without them): every expert,
    /// or with `active` the ones a token uses.
    pub fn mtp_params(&self, tp: usize, active: bool) -> usize {
        let without = GptConfig {
            mtp: None,
            ..self.clone()
        };
        let all = self.params_exact(tp, active) - without.params_exact(tp, active);
        usize::try_from(all).unwrap_or(usize::MAX)
    }

    /// The depths of multi-token prediction (0 without it).
    pub fn mtp_depths(&self) -> usize {
        self.mtp.map_or(0, |m| m.num_layers)
    }

    /// Values a generation caches per token, over all layers: multi-latent attention's latent
    /// and rotary key (`kv_lora_rank + qk_pos_emb_head_dim` a layer, its compressed cache), or
    /// attention's keys and values (`2 · query groups · head size` a layer).
    pub fn kv_cache_values_per_token(&self) -> usize {
        let per_layer = match &self.mla {
            Some(mla) => mla.kv_lora_rank + mla.qk_pos_emb_head_dim,
            None => 2 * self.query_groups() * self.head_dim(),
        };
        self.num_layers * per_layer
    }

    /// Model FLOPs of one training token of a sequence of `seq` tokens: 6 per parameter the
    /// token uses (forward and backward), plus attention's two batched products
    /// (12·layers·seq·heads·head size).
    ///
    /// Multi-token prediction's depths count as layers, and each runs the output layer once
    /// more (6 · padded vocabulary · h).
    pub fn flops_per_token(&self, seq: usize, tp: usize) -> f64 {
        let layers = self.num_layers + self.mtp_depths();
        let attention = match &self.mla {
            // Queries·keys over q_head_dim features, weights·values over v_head_dim.
            Some(mla) => {
                6.0 * (layers * seq * self.num_attention_heads) as f64
                    * (mla.q_head_dim() + mla.v_head_dim) as f64
            }
            None => 12.0 * (layers * seq * self.num_attention_heads * self.head_dim()) as f64,
        };
        let heads =
            6.0 * (self.mtp_depths() * self.padded_vocab_size(tp) * self.hidden_size) as f64;
        6.0 * self.active_params(tp) as f64 + attention + heads
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gpt2_small_has_124m_parameters() {
        let c = GptConfig::new(12, 768, 12, 50257, 1024);
        assert_eq!(c.padded_vocab_size(1), 50304);
        assert_eq!(c.padded_vocab_size(8), 51200);
        // GPT-2 small: 124,439,808 parameters with the unpadded 50,257 rows.
        assert_eq!(c.num_params(1) - (50304 - 50257) * 768, 124_439_808);
    }

    #[test]
    fn bad_sizes_name_the_numbers() {
        let c = GptConfig::new(2, 96, 6, 256, 64);
        assert_eq!(
            c.validate(4).unwrap_err().to_string(),
            "--num-attention-heads 6 is not divisible by --tensor-model-parallel-size 4"
        );
        let c = GptConfig::new(2, 100, 3, 256, 64);
        assert_eq!(
            c.validate(1).unwrap_err().to_string(),
            "--hidden-size 100 is not divisible by --num-attention-heads 3"
        );
        assert!(GptConfig::new(2, 96, 6, 256, 64).validate(3).is_ok());
    }
}

#[cfg(test)]
mod init_tests {
    use megatron_core::module::{Builder, Module};

    use super::*;
    use crate::gpt::Gpt;

    #[test]
    fn a_specs_only_build_lists_the_same_parameters_without_their_values() {
        use megatron_core::parallel::GroupKind;
        let c = crate::preset("gpt-moe-tiny").map(|p| (p.config)()).unwrap();
        let specs = |b: Builder| {
            let model = Gpt::build(&c.spec(), &mut b.with_group(GroupKind::Ep, 1, 2)).unwrap();
            let mut out = Vec::new();
            model.visit_params(&mut |p| out.push((p.spec().clone(), p.value().numel())));
            out
        };
        let with_values = specs(Builder::new(0).meta());
        let without = specs(Builder::new(0).specs_only());
        assert_eq!(with_values.len(), without.len());
        for ((a, numel), (b, none)) in with_values.iter().zip(&without) {
            assert_eq!(a, b);
            assert_eq!(*numel, a.local.numel());
            assert_eq!(*none, 0, "{}", b.name);
        }
    }

    #[test]
    fn residual_output_layers_are_scaled_by_the_depth() {
        let c = GptConfig::new(8, 64, 4, 256, 64);
        let spec = c.spec();
        let out_std = 0.02 / 4.0; // 1/√(2·8)
        assert_eq!(spec.blocks[3].attn.proj().init_std, out_std);
        assert_eq!(spec.blocks[3].mlp.dense().unwrap().fc2.init_std, out_std);
        assert_eq!(spec.blocks[3].attn.fused().unwrap().qkv.init_std, 0.02);
        assert_eq!(spec.wte.init_std, 0.02);
        // The drawn weights have those spreads, and biases start at zero.
        let model = Gpt::build(&spec, &mut Builder::new(1)).unwrap();
        let std = |v: Vec<f32>| {
            (v.iter().map(|x| f64::from(*x).powi(2)).sum::<f64>() / v.len() as f64).sqrt()
        };
        let fc1 = std(model.blocks[0]
            .mlp
            .dense()
            .unwrap()
            .fc1
            .weight()
            .value()
            .to_vec()
            .unwrap());
        let fc2 = std(model.blocks[0]
            .mlp
            .dense()
            .unwrap()
            .fc2
            .weight()
            .value()
            .to_vec()
            .unwrap());
        assert!((fc1 - 0.02).abs() < 0.002, "{fc1}");
        assert!((fc2 - 0.005).abs() < 0.0005, "{fc2}");
        let bias = model.blocks[0]
            .mlp
            .dense()
            .unwrap()
            .fc1
            .bias()
            .unwrap()
            .value()
            .to_vec::<f32>()
            .unwrap();
        assert!(bias.iter().all(|&b| b == 0.0));
    }
}
