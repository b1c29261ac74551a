//! The mixture-of-experts architecture flags (`--num-experts` and the `--moe-*` family), named and
//! defaulted as Megatron-LM's.

use super::values;
use anyhow::{Result, bail};
use clap::{Args, ValueEnum};
use megatron::models::{GptConfig, MoeConfig, MoeLayerFreq};
use megatron::moe::{DropPolicy, LoadBalancing, RouterConfig, ScoreFunction};

/// `--moe-router-load-balancing-type`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum BalancingArg {
    /// The switch loss over each micro-batch.
    #[value(name = "aux_loss")]
    AuxLoss,
    /// The switch loss over each sequence.
    #[value(name = "seq_aux_loss")]
    SeqAuxLoss,
    /// No load-balancing loss.
    #[value(name = "none")]
    None,
}

/// `--moe-router-score-function`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum ScoreArg {
    /// Softmax over the experts.
    Softmax,
    /// Sigmoid, normalised over the chosen experts.
    Sigmoid,
}

/// `--moe-token-drop-policy`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum DropArg {
    /// Keep the tokens with the highest probabilities.
    Probs,
    /// Keep the first tokens.
    Position,
}

/// Mixture-of-experts flags: given on a dense preset, `--num-experts` makes its MLPs MoE layers;
/// on a MoE preset (`gpt-moe-tiny`) they override its settings.
#[derive(Debug, Args)]
pub struct MoeArgs {
    /// Experts per MoE layer (makes the model a mixture of experts) [default: the preset's].
    #[arg(long, value_parser = values::experts)]
    num_experts: Option<usize>,
    /// Experts each token goes to [default: the preset's, or 2].
    #[arg(long, value_parser = values::experts)]
    moe_router_topk: Option<usize>,
    /// Each expert's hidden size [default: the preset's, or --ffn-hidden-size].
    #[arg(long, value_parser = values::dim)]
    moe_ffn_hidden_size: Option<usize>,
    /// Which layers are MoE: every k-th (`2`), or per layer (`[0,1,1,1]`, `[0]*1+[1]*3`)
    /// [default: the preset's, or 1: all].
    #[arg(long)]
    moe_layer_freq: Option<String>,
    /// Softmax over all experts before the top-k (else after it, over the chosen ones).
    #[arg(long)]
    moe_router_pre_softmax: bool,
    /// How logits become scores [default: the preset's, or softmax].
    #[arg(long, value_enum)]
    moe_router_score_function: Option<ScoreArg>,
    /// Multiplies the chosen experts' weights.
    #[arg(long, value_parser = values::positive_f32)]
    moe_router_topk_scaling_factor: Option<f32>,
    /// Group-limited routing (DeepSeek-V3's): the experts in N equal groups, each token
    /// choosing among the experts of its --moe-router-group-topk best groups alone.
    #[arg(long, value_name = "N", value_parser = values::dim, requires = "moe_router_group_topk")]
    moe_router_num_groups: Option<usize>,
    /// The groups each token keeps with group-limited routing: those whose best
    /// top-k / group-topk scores sum highest.
    #[arg(long, value_name = "G", value_parser = values::dim, requires = "moe_router_num_groups")]
    moe_router_group_topk: Option<usize>,
    /// The dtype of the routing computation: fp32, what megatron-rs's router always computes
    /// in (the logits' products accumulated in f32, the scores, the top-k and the weights,
    /// whatever the model's dtype: Megatron-LM's `fp32`, DeepSeek-V3's recipe); fp64 is
    /// refused.
    #[arg(long, value_parser = ["fp32", "fp64"])]
    moe_router_dtype: Option<String>,
    /// The load-balancing loss [default: the preset's, or aux_loss].
    #[arg(long, value_enum)]
    moe_router_load_balancing_type: Option<BalancingArg>,
    /// The load-balancing loss's coefficient [default: the preset's, or 0].
    #[arg(long, value_parser = values::non_negative_f32)]
    moe_aux_loss_coeff: Option<f32>,
    /// The router z loss's coefficient (none by default).
    #[arg(long, value_parser = values::non_negative_f32)]
    moe_z_loss_coeff: Option<f32>,
    /// Each expert takes at most ⌈tokens·topk/experts·factor⌉ tokens, the rest dropped
    /// (no capacity by default).
    #[arg(long, value_parser = values::positive_f32)]
    moe_expert_capacity_factor: Option<f32>,
    /// Pad every expert's input to its capacity.
    #[arg(long)]
    moe_pad_expert_input_to_capacity: bool,
    /// Which tokens an expert over capacity keeps [default: probs].
    #[arg(long, value_enum)]
    moe_token_drop_policy: Option<DropArg>,
    /// The aux-loss-free expert bias (with sigmoid scores): each step moves it towards
    /// balanced loads.
    #[arg(long)]
    moe_router_enable_expert_bias: bool,
    /// How far the expert bias moves each step [default: the preset's, or 0.001].
    #[arg(long, value_parser = values::non_negative_f32)]
    moe_router_bias_update_rate: Option<f32>,
    /// Hidden size of the shared experts every token also goes through (none by default).
    #[arg(long, value_parser = values::dim)]
    moe_shared_expert_intermediate_size: Option<usize>,
}

impl MoeArgs {
    /// Whether any MoE flag was given.
    fn any(&self) -> bool {
        self.num_experts.is_some()
            || self.moe_router_topk.is_some()
            || self.moe_ffn_hidden_size.is_some()
            || self.moe_layer_freq.is_some()
            || self.moe_router_pre_softmax
            || self.moe_router_score_function.is_some()
            || self.moe_router_topk_scaling_factor.is_some()
            || self.moe_router_num_groups.is_some()
            || self.moe_router_dtype.is_some()
            || self.moe_router_load_balancing_type.is_some()
            || self.moe_aux_loss_coeff.is_some()
            || self.moe_z_loss_coeff.is_some()
            || self.moe_expert_capacity_factor.is_some()
            || self.moe_pad_expert_input_to_capacity
            || self.moe_token_drop_policy.is_some()
            || self.moe_router_enable_expert_bias
            || self.moe_router_bias_update_rate.is_some()
            || self.moe_shared_expert_intermediate_size.is_some()
    }

    /// `--num-experts`, if given.
    pub fn num_experts(&self) -> Option<usize> {
        self.num_experts
    }

    /// Refuses a flag given where it does nothing (Megatron-LM accepts some of these and
    /// ignores them): a drop policy without a capacity, a bias update rate without the bias, an
    /// aux-loss coefficient without an aux loss.
    fn check_effect(&self, r: &RouterConfig) -> Result<()> {
        if let Some(policy) = self.moe_token_drop_policy
            && r.capacity_factor.is_none()
        {
            bail!(
                "--moe-token-drop-policy {} does nothing without --moe-expert-capacity-factor \
                 (no token is dropped): drop it or give a capacity",
                policy
                    .to_possible_value()
                    .map_or(String::new(), |v| v.get_name().to_string())
            );
        }
        if self.moe_router_pre_softmax && r.score_function == ScoreFunction::Sigmoid {
            bail!(
                "--moe-router-pre-softmax does nothing with --moe-router-score-function sigmoid \
                 (it places the softmax): drop one of them"
            );
        }
        if let Some(rate) = self.moe_router_bias_update_rate
            && !r.expert_bias
        {
            bail!(
                "--moe-router-bias-update-rate {rate} does nothing without \
                 --moe-router-enable-expert-bias: drop it or enable the bias"
            );
        }
        if let Some(coeff) = self.moe_aux_loss_coeff
            && coeff > 0.0
            && r.load_balancing == LoadBalancing::None
        {
            bail!(
                "--moe-aux-loss-coeff {coeff} does nothing with --moe-router-load-balancing-type \
                 none: drop one of them"
            );
        }
        Ok(())
    }

    /// Refuses the flags that would change the shapes of `saved`'s MoE parameters (which layers
    /// hold experts, the experts' and the shared experts' sizes, the expert bias), naming the
    /// flag and what the checkpoint holds.
    pub fn check_against(&self, saved: &GptConfig) -> Result<()> {
        let Some(moe) = &saved.moe else {
            return Ok(());
        };
        let contradiction = |flag: &str, given: String, held: String| {
            anyhow::anyhow!(
                "--{flag} {given} contradicts the checkpoint, whose model has {held}: drop the \
                 flag (a loaded model keeps its checkpoint's architecture)"
            )
        };
        if let Some(freq) = &self.moe_layer_freq {
            let given = MoeLayerFreq::parse(freq)
                .map_err(anyhow::Error::msg)?
                .layers(saved.num_layers)?;
            let held = saved.moe_layers()?;
            if given != held {
                let pattern = |l: &[bool]| {
                    let ones: Vec<&str> = l.iter().map(|&m| if m { "1" } else { "0" }).collect();
                    format!("[{}]", ones.join(","))
                };
                return Err(contradiction(
                    "moe-layer-freq",
                    freq.clone(),
                    format!("MoE layers {}", pattern(&held)),
                ));
            }
        }
        if let Some(f) = self.moe_ffn_hidden_size
            && f != moe.ffn_hidden_size
        {
            return Err(contradiction(
                "moe-ffn-hidden-size",
                f.to_string(),
                format!("experts of ffn {}", moe.ffn_hidden_size),
            ));
        }
        if let Some(f) = self.moe_shared_expert_intermediate_size
            && Some(f) != moe.shared_expert_ffn
        {
            return Err(contradiction(
                "moe-shared-expert-intermediate-size",
                f.to_string(),
                moe.shared_expert_ffn
                    .map_or("no shared experts".to_string(), |s| {
                        format!("shared experts of {s}")
                    }),
            ));
        }
        if self.moe_router_enable_expert_bias && !moe.router.expert_bias {
            bail!(
                "--moe-router-enable-expert-bias adds a parameter the checkpoint's routers do \
                 not have: drop the flag (a loaded model keeps its checkpoint's architecture)"
            );
        }
        Ok(())
    }

    /// `c`'s MoE settings with the flags applied: a dense `c` becomes MoE with
    /// `--num-experts`; MoE flags without experts are refused.
    pub fn apply(&self, c: &mut GptConfig) -> Result<()> {
        if !self.any() {
            return Ok(());
        }
        let mut moe = match (c.moe.clone(), self.num_experts) {
            (Some(moe), _) => moe,
            (None, Some(experts)) => MoeConfig {
                router: RouterConfig::new(experts, 2),
                ffn_hidden_size: c.ffn_hidden_size,
                layer_freq: MoeLayerFreq::Every(1),
                shared_expert_ffn: None,
                dispatcher: Default::default(),
            },
            (None, None) => bail!(
                "the --moe-* flags configure MoE layers: add --num-experts (the model is dense)"
            ),
        };
        if self.moe_router_dtype.as_deref() == Some("fp64") {
            bail!(
                "--moe-router-dtype fp64: megatron-rs routes in fp32 (the logits' products \
                 accumulated in f32, the scores and weights f32 in any model dtype): give fp32"
            );
        }
        let r = &mut moe.router;
        if let Some(e) = self.num_experts {
            r.num_experts = e;
        }
        if let Some(k) = self.moe_router_topk {
            r.topk = k;
        }
        r.pre_softmax |= self.moe_router_pre_softmax;
        if let Some(s) = self.moe_router_score_function {
            r.score_function = match s {
                ScoreArg::Softmax => ScoreFunction::Softmax,
                ScoreArg::Sigmoid => ScoreFunction::Sigmoid,
            };
        }
        if let Some(f) = self.moe_router_topk_scaling_factor {
            r.topk_scaling_factor = Some(f);
        }
        if let (Some(groups), Some(topk)) = (self.moe_router_num_groups, self.moe_router_group_topk)
        {
            r.group_limited = Some(megatron::moe::GroupLimited { groups, topk });
        }
        if let Some(b) = self.moe_router_load_balancing_type {
            r.load_balancing = match b {
                BalancingArg::AuxLoss => LoadBalancing::AuxLoss,
                BalancingArg::SeqAuxLoss => LoadBalancing::SeqAuxLoss,
                BalancingArg::None => LoadBalancing::None,
            };
        }
        if let Some(c) = self.moe_aux_loss_coeff {
            r.aux_loss_coeff = c;
        }
        if let Some(z) = self.moe_z_loss_coeff {
            r.z_loss_coeff = Some(z);
        }
        if let Some(f) = self.moe_expert_capacity_factor {
            r.capacity_factor = Some(f);
        }
        r.pad_to_capacity |= self.moe_pad_expert_input_to_capacity;
        if let Some(d) = self.moe_token_drop_policy {
            r.drop_policy = match d {
                DropArg::Probs => DropPolicy::Probs,
                DropArg::Position => DropPolicy::Position,
            };
        }
        r.expert_bias |= self.moe_router_enable_expert_bias;
        if let Some(rate) = self.moe_router_bias_update_rate {
            r.bias_update_rate = rate;
        }
        if let Some(f) = self.moe_ffn_hidden_size {
            moe.ffn_hidden_size = f;
        }
        if let Some(freq) = &self.moe_layer_freq {
            moe.layer_freq = MoeLayerFreq::parse(freq).map_err(anyhow::Error::msg)?;
        }
        if let Some(s) = self.moe_shared_expert_intermediate_size {
            moe.shared_expert_ffn = Some(s);
        }
        self.check_effect(&moe.router)?;
        c.moe = Some(moe);
        Ok(())
    }
}
