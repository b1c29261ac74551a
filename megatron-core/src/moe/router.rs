//! The MoE router's numerics (Megatron-LM's `TopKRouter` with `topk_routing_with_score_function`,
//! `apply_router_token_dropping`, the load-balancing and z losses), on one rank's router
//! logits `[tokens, experts]` in f32, tokens in `[seq, batch]` order:
//!
//! - scores: softmax after the top-k (Megatron-LM's default), softmax before it
//!   (`--moe-router-pre-softmax`), or sigmoid normalised over the chosen experts, whose choice
//!   may add the aux-loss-free expert bias (`--moe-router-enable-expert-bias`);
//! - group-limited routing (`--moe-router-num-groups`, `--moe-router-group-topk`, DeepSeek-V3's
//!   node-limited routing, Megatron-LM's `group_limited_topk`): each token first keeps its best
//!   groups of experts, by the sum of each group's best `topk / group_topk` scores (those the
//!   top-k ranks: with the expert bias, biased), then takes its top-k among their experts;
//! - capacity (`--moe-expert-capacity-factor`): each expert keeps at most
//!   ⌈tokens·k/experts·factor⌉ tokens, by probability or by position, or exactly that many with
//!   `--moe-pad-expert-input-to-capacity`;
//! - losses: the switch load-balancing loss over the micro-batch (`aux_loss`) or per sequence
//!   (`seq_aux_loss`), and the z loss, whose gradients [`route_backward`] adds to the logits'.
//!
//! Ties in a top-k go to the lower expert (or token) index.

use thiserror::Error;

/// A router configuration that cannot route.
#[derive(Debug, Clone, PartialEq, Error)]
pub enum RouterError {
    /// No experts.
    #[error("a MoE layer needs at least one expert, got --num-experts 0")]
    NoExperts,
    /// A top-k outside 1..=experts.
    #[error("--moe-router-topk {topk} must be between 1 and --num-experts {experts}")]
    TopK {
        /// The top-k.
        topk: usize,
        /// The experts.
        experts: usize,
    },
    /// A capacity factor that is not a positive number.
    #[error("--moe-expert-capacity-factor {0} must be a finite number above 0")]
    Capacity(f32),
    /// Padding to a capacity without one.
    #[error("--moe-pad-expert-input-to-capacity needs --moe-expert-capacity-factor")]
    PadWithoutCapacity,
    /// The expert bias with softmax scores.
    #[error(
        "--moe-router-enable-expert-bias needs --moe-router-score-function sigmoid (the bias \
         moves the choice of sigmoid scores)"
    )]
    BiasWithSoftmax,
    /// Logits or gradients of the wrong size.
    #[error("the router {what} has {len} values, {tokens} tokens × {experts} experts need {need}")]
    Shape {
        /// Which input.
        what: &'static str,
        /// Its length.
        len: usize,
        /// Tokens.
        tokens: usize,
        /// Experts.
        experts: usize,
        /// tokens × experts.
        need: usize,
    },
    /// A routing read back from the device without what its backward reads.
    #[error(
        "this routing was read back from the device without what its backward reads: run the \
         backward there (cuda::DeviceRouting::backward)"
    )]
    NothingSaved,
    /// Tokens that do not cut into sequences of the given length.
    #[error("{tokens} tokens do not cut into sequences of {seq}")]
    Sequences {
        /// Tokens.
        tokens: usize,
        /// The sequence length.
        seq: usize,
    },
    /// Groups that do not divide the experts.
    #[error(
        "--moe-router-num-groups {groups} does not divide --num-experts {experts} into equal \
         groups"
    )]
    Groups {
        /// The groups.
        groups: usize,
        /// The experts.
        experts: usize,
    },
    /// A group top-k outside 1..=groups, or one the top-k cannot share.
    #[error(
        "--moe-router-group-topk {group_topk} must be between 1 and --moe-router-num-groups \
         {groups}, and --moe-router-topk {topk} a multiple of it no larger than its groups' \
         {in_groups} experts"
    )]
    GroupTopK {
        /// The groups each token keeps.
        group_topk: usize,
        /// The groups.
        groups: usize,
        /// The top-k.
        topk: usize,
        /// The experts of `group_topk` groups.
        in_groups: usize,
    },
    /// The load-balancing counts could not be summed over the ranks that share the sequence.
    #[error("summing the router's load-balancing counts over the tensor-parallel group: {0}")]
    Counts(String),
}

/// The ranks a micro-batch's tokens are split over, each routing its own part (with sequence
/// parallelism: the tensor-parallel group, each rank holding its shard of the sequence). The
/// load-balancing loss counts every rank's tokens (Megatron-LM's `tokens_per_expert` all-reduced
/// over the tp·cp group, with the total tokens of all of them), so that the ranks' losses sum to
/// the whole sequence's; the z loss's coefficient is divided by the ranks (each rank's mean,
/// summed, is the mean over all of them).
#[derive(Clone, Copy)]
pub struct Partition<'a> {
    /// The ranks (1: every token is here).
    pub ranks: usize,
    /// Sums a rank's counts over the ranks, in place (an all-reduce).
    pub sum_counts: &'a dyn Fn(&mut [f32]) -> Result<(), RouterError>,
}

/// Nothing to sum: the counts are already every token's.
fn counts_are_whole(_: &mut [f32]) -> Result<(), RouterError> {
    Ok(())
}

impl Partition<'_> {
    /// Every token of the micro-batch on this rank.
    pub const WHOLE: Partition<'static> = Partition {
        ranks: 1,
        sum_counts: &counts_are_whole,
    };

    /// The z loss's coefficient on each rank.
    pub(crate) fn z_coeff(&self, coeff: f32) -> f32 {
        coeff / self.ranks.max(1) as f32
    }
}

/// Group-limited routing (`--moe-router-num-groups`, `--moe-router-group-topk`): the experts
/// in `groups` equal groups of consecutive experts, each token choosing among the experts of its
/// `topk` best groups alone.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct GroupLimited {
    /// The groups (`--moe-router-num-groups`).
    pub groups: usize,
    /// The groups each token keeps (`--moe-router-group-topk`).
    pub topk: usize,
}

/// How the router turns logits into scores (`--moe-router-score-function`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ScoreFunction {
    /// Softmax over the experts.
    Softmax,
    /// Sigmoid of each logit, normalised over the chosen experts (for top-k > 1).
    Sigmoid,
}

/// The load-balancing loss (`--moe-router-load-balancing-type`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LoadBalancing {
    /// None.
    None,
    /// The switch loss over the micro-batch's tokens.
    AuxLoss,
    /// The switch loss over each sequence, averaged.
    SeqAuxLoss,
}

/// Which tokens an expert over capacity keeps (`--moe-token-drop-policy`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DropPolicy {
    /// Those with the highest routing probabilities.
    Probs,
    /// The first ones.
    Position,
}

/// The router's settings, as Megatron-LM's flags name them.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct RouterConfig {
    /// `--num-experts`.
    pub num_experts: usize,
    /// `--moe-router-topk`.
    pub topk: usize,
    /// `--moe-router-pre-softmax`: softmax over all experts before the top-k.
    pub pre_softmax: bool,
    /// `--moe-router-score-function`.
    pub score_function: ScoreFunction,
    /// `--moe-router-topk-scaling-factor`: multiplies the chosen probabilities.
    pub topk_scaling_factor: Option<f32>,
    /// `--moe-router-load-balancing-type`.
    pub load_balancing: LoadBalancing,
    /// `--moe-aux-loss-coeff`.
    pub aux_loss_coeff: f32,
    /// `--moe-z-loss-coeff`.
    pub z_loss_coeff: Option<f32>,
    /// `--moe-expert-capacity-factor`.
    pub capacity_factor: Option<f32>,
    /// `--moe-pad-expert-input-to-capacity`.
    pub pad_to_capacity: bool,
    /// `--moe-token-drop-policy`.
    pub drop_policy: DropPolicy,
    /// `--moe-router-enable-expert-bias`.
    pub expert_bias: bool,
    /// `--moe-router-bias-update-rate`: how far the expert bias moves each step.
    #[serde(default = "default_bias_update_rate")]
    pub bias_update_rate: f32,
    /// Group-limited routing, when set.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub group_limited: Option<GroupLimited>,
}

/// Megatron-LM's `--moe-router-bias-update-rate` default.
fn default_bias_update_rate() -> f32 {
    1e-3
}

impl RouterConfig {
    /// Top-k routing over `num_experts` experts with Megatron-LM's defaults (softmax after the
    /// top-k, the micro-batch aux loss with coefficient 0, no capacity).
    pub fn new(num_experts: usize, topk: usize) -> RouterConfig {
        RouterConfig {
            num_experts,
            topk,
            pre_softmax: false,
            score_function: ScoreFunction::Softmax,
            topk_scaling_factor: None,
            load_balancing: LoadBalancing::AuxLoss,
            aux_loss_coeff: 0.0,
            z_loss_coeff: None,
            capacity_factor: None,
            pad_to_capacity: false,
            drop_policy: DropPolicy::Probs,
            expert_bias: false,
            bias_update_rate: default_bias_update_rate(),
            group_limited: None,
        }
    }

    /// Checks the settings, naming the numbers that cannot work.
    pub fn validate(&self) -> Result<(), RouterError> {
        if self.num_experts == 0 {
            return Err(RouterError::NoExperts);
        }
        if self.topk == 0 || self.topk > self.num_experts {
            return Err(RouterError::TopK {
                topk: self.topk,
                experts: self.num_experts,
            });
        }
        if let Some(f) = self.capacity_factor
            && !(f.is_finite() && f > 0.0)
        {
            return Err(RouterError::Capacity(f));
        }
        if self.pad_to_capacity && self.capacity_factor.is_none() {
            return Err(RouterError::PadWithoutCapacity);
        }
        if self.expert_bias && self.score_function == ScoreFunction::Softmax {
            return Err(RouterError::BiasWithSoftmax);
        }
        if let Some(GroupLimited { groups, topk }) = self.group_limited {
            let experts = self.num_experts;
            if groups == 0 || !experts.is_multiple_of(groups) {
                return Err(RouterError::Groups { groups, experts });
            }
            let in_groups = topk * (experts / groups);
            if topk == 0
                || topk > groups
                || !self.topk.is_multiple_of(topk)
                || self.topk > in_groups
            {
                return Err(RouterError::GroupTopK {
                    group_topk: topk,
                    groups,
                    topk: self.topk,
                    in_groups,
                });
            }
        }
        Ok(())
    }

    /// Each expert's capacity for `tokens` tokens (Megatron-LM's `get_capacity` of
    /// tokens × top-k), when a capacity factor is set.
    pub fn capacity(&self, tokens: usize) -> Option<usize> {
        self.capacity_factor.map(|f| {
            let per_expert = (tokens * self.topk) as f64 / self.num_experts as f64;
            (per_expert * f64::from(f)).ceil() as usize
        })
    }
}

/// What routing a micro-batch's tokens gave.
#[derive(Debug, Clone, PartialEq)]
pub struct Routing {
    /// Tokens routed.
    pub tokens: usize,
    /// Experts.
    pub experts: usize,
    /// `[tokens, experts]`: each token's weight for each expert it goes to, 0 elsewhere.
    pub probs: Vec<f32>,
    /// `[tokens, experts]`: whether the token goes to the expert (after capacity).
    pub map: Vec<bool>,
    /// Tokens each expert receives.
    pub tokens_per_expert: Vec<usize>,
    /// The load-balancing loss, coefficient included (0 without).
    pub aux_loss: f32,
    /// The z loss, coefficient included (0 without).
    pub z_loss: f32,
    /// Token-expert pairs the top-k chose that capacity dropped.
    pub dropped: usize,
    /// Each token's chosen experts (top-k, before capacity), best first.
    chosen: Vec<usize>,
    /// What the backward needs of the forward.
    saved: Saved,
}

/// A routing's parts, as [`route`] (or the device's kernels, `crate::cuda::DeviceRouting`) computes
/// them.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct RoutingParts {
    pub tokens: usize,
    pub experts: usize,
    pub probs: Vec<f32>,
    pub map: Vec<bool>,
    pub tokens_per_expert: Vec<usize>,
    pub aux_loss: f32,
    pub z_loss: f32,
    pub dropped: usize,
    pub chosen: Vec<usize>,
    pub scores: Vec<f32>,
    pub aux_grad: Vec<f32>,
    pub aux_scores: Vec<f32>,
    pub lse: Vec<f32>,
    /// The z loss's coefficient on this rank (divided over a [`Partition`]'s ranks).
    pub z_coeff: f32,
}

impl Routing {
    /// The routing whose parts `parts` are.
    pub(crate) fn from_parts(parts: RoutingParts) -> Routing {
        let RoutingParts {
            tokens,
            experts,
            probs,
            map,
            tokens_per_expert,
            aux_loss,
            z_loss,
            dropped,
            chosen,
            scores,
            aux_grad,
            aux_scores,
            lse,
            z_coeff,
        } = parts;
        Routing {
            tokens,
            experts,
            probs,
            map,
            tokens_per_expert,
            aux_loss,
            z_loss,
            dropped,
            chosen,
            saved: Saved {
                scores,
                aux_grad,
                aux_scores,
                lse,
                z_coeff,
            },
        }
    }
}

/// Intermediate values [`route_backward`] reuses.
#[derive(Debug, Clone, PartialEq)]
struct Saved {
    /// The scores the chosen probabilities came from: `[tokens, experts]` softmax of all
    /// logits (pre-softmax), sigmoid of each, or `[tokens, topk]` softmax over the chosen.
    scores: Vec<f32>,
    /// For the aux loss: `d aux / d score[t, e]` of the aux-loss scores (softmax, or the
    /// normalised sigmoid), and those scores; empty without the loss.
    aux_grad: Vec<f32>,
    aux_scores: Vec<f32>,
    /// Each token's log-sum-exp of its logits (for the z loss).
    lse: Vec<f32>,
    /// The z loss's coefficient on this rank.
    z_coeff: f32,
}

fn softmax(row: &[f32], out: &mut [f32]) {
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0.0f32;
    for (o, &x) in out.iter_mut().zip(row) {
        *o = (x - max).exp();
        sum += *o;
    }
    out.iter_mut().for_each(|o| *o /= sum);
}

fn log_sum_exp(row: &[f32]) -> f32 {
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    max + row.iter().map(|&x| (x - max).exp()).sum::<f32>().ln()
}

fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

/// The indices of the `k` largest of `values`, largest first (ties to the lower index).
fn top_k(values: &[f32], k: usize) -> Vec<usize> {
    let mut order: Vec<usize> = (0..values.len()).collect();
    order.sort_by(|&a, &b| values[b].total_cmp(&values[a]).then(a.cmp(&b)));
    order.truncate(k);
    order
}

/// The indices of the `k` largest of `values` (largest first, ties to the lower index) for the
/// routing's top-k: with group-limited routing, among the experts of the `groups.topk` groups
/// whose best `k / groups.topk` values sum highest (ties to the lower group), as Megatron-LM's
/// `group_limited_topk` (which masks the other groups' scores with -inf: the same choice for
/// finite scores).
pub(crate) fn choose(values: &[f32], k: usize, groups: Option<GroupLimited>) -> Vec<usize> {
    let Some(GroupLimited { groups, topk }) = groups else {
        return top_k(values, k);
    };
    let per = values.len() / groups.max(1);
    let best = k / topk.max(1);
    let sums: Vec<f32> = values
        .chunks(per.max(1))
        .map(|g| top_k(g, best).iter().fold(0.0f32, |s, &j| s + g[j]))
        .collect();
    let kept = top_k(&sums, topk);
    let mut order: Vec<usize> = (0..values.len())
        .filter(|j| kept.contains(&(j / per.max(1))))
        .collect();
    order.sort_by(|&a, &b| values[b].total_cmp(&values[a]).then(a.cmp(&b)));
    order.truncate(k);
    order
}

fn check_len(
    what: &'static str,
    len: usize,
    tokens: usize,
    experts: usize,
) -> Result<(), RouterError> {
    let need = tokens * experts;
    if len != need {
        return Err(RouterError::Shape {
            what,
            len,
            tokens,
            experts,
            need,
        });
    }
    Ok(())
}

/// Checks what [`route`] is given: the settings, `len` logits (whole tokens, in sequences of
/// `seq`) and the expert bias's length; returns the tokens.
pub(crate) fn check_route(
    config: &RouterConfig,
    len: usize,
    seq: usize,
    bias: Option<usize>,
) -> Result<usize, RouterError> {
    config.validate()?;
    let e = config.num_experts;
    let tokens = len / e;
    check_len("logits", len, tokens, e)?;
    if seq == 0 || !tokens.is_multiple_of(seq) {
        return Err(RouterError::Sequences { tokens, seq });
    }
    if let Some(bias) = bias {
        check_len("expert bias", bias, 1, e)?;
    }
    Ok(tokens)
}

/// Routes `logits` (`[tokens, experts]`, tokens in `[seq, batch]` order with sequences of
/// `seq` tokens) as `config` says, with the expert bias when it is enabled.
pub fn route(
    logits: &[f32],
    seq: usize,
    config: &RouterConfig,
    expert_bias: Option<&[f32]>,
) -> Result<Routing, RouterError> {
    route_partitioned(logits, seq, config, expert_bias, Partition::WHOLE)
}

/// [`route`] of this rank's part of a micro-batch split over `partition`'s ranks (sequence
/// parallelism; `seq` is this rank's part of each sequence).
pub fn route_partitioned(
    logits: &[f32],
    seq: usize,
    config: &RouterConfig,
    expert_bias: Option<&[f32]>,
    partition: Partition<'_>,
) -> Result<Routing, RouterError> {
    let tokens = check_route(config, logits.len(), seq, expert_bias.map(<[f32]>::len))?;
    let (e, k) = (config.num_experts, config.topk);
    let scale = config.topk_scaling_factor.unwrap_or(1.0);
    let mut probs = vec![0.0f32; tokens * e];
    let mut chosen = Vec::with_capacity(tokens * k);
    let pre = config.pre_softmax || config.score_function == ScoreFunction::Sigmoid;
    let mut scores = vec![0.0f32; tokens * if pre { e } else { k }];
    for t in 0..tokens {
        let row = &logits[t * e..(t + 1) * e];
        let p = &mut probs[t * e..(t + 1) * e];
        match (config.score_function, config.pre_softmax) {
            (ScoreFunction::Softmax, true) => {
                let s = &mut scores[t * e..(t + 1) * e];
                softmax(row, s);
                let top = choose(s, k, config.group_limited);
                for &j in &top {
                    p[j] = s[j] * scale;
                }
                chosen.extend(top);
            }
            (ScoreFunction::Softmax, false) => {
                let top = choose(row, k, config.group_limited);
                let picked: Vec<f32> = top.iter().map(|&j| row[j]).collect();
                let s = &mut scores[t * k..(t + 1) * k];
                softmax(&picked, s);
                for (i, &j) in top.iter().enumerate() {
                    p[j] = s[i] * scale;
                }
                chosen.extend(top);
            }
            (ScoreFunction::Sigmoid, _) => {
                let s = &mut scores[t * e..(t + 1) * e];
                s.iter_mut().zip(row).for_each(|(o, &x)| *o = sigmoid(x));
                let top = match expert_bias.filter(|_| config.expert_bias) {
                    Some(bias) => {
                        let biased: Vec<f32> = s.iter().zip(bias).map(|(a, b)| a + b).collect();
                        choose(&biased, k, config.group_limited)
                    }
                    None => choose(s, k, config.group_limited),
                };
                let sum: f32 = top.iter().map(|&j| s[j]).sum::<f32>() + 1e-20;
                for &j in &top {
                    p[j] = if k > 1 { s[j] / sum } else { s[j] } * scale;
                }
                chosen.extend(top);
            }
        }
    }
    let mut map = vec![false; tokens * e];
    for (t, experts) in chosen.chunks_exact(k).enumerate() {
        for &j in experts {
            map[t * e + j] = true;
        }
    }
    // Capacity: each expert keeps its best (or first) tokens.
    let mut dropped = 0;
    let capacity = config.capacity(tokens);
    if config.pad_to_capacity && capacity.is_some_and(|c| c > tokens) {
        // Room for every token: each expert takes them all, as Megatron-LM pads.
        map.iter_mut().for_each(|m| *m = true);
    }
    if let Some(capacity) = capacity.filter(|&c| c <= tokens) {
        let mut keep = vec![false; tokens * e];
        for j in 0..e {
            let mut order: Vec<usize> = (0..tokens).collect();
            match config.drop_policy {
                DropPolicy::Probs => order.sort_by(|&a, &b| {
                    probs[b * e + j]
                        .total_cmp(&probs[a * e + j])
                        .then(a.cmp(&b))
                }),
                DropPolicy::Position => order.sort_by_key(|&t| (!map[t * e + j], t)),
            }
            for &t in &order[..capacity] {
                keep[t * e + j] = true;
            }
        }
        for i in 0..tokens * e {
            let kept = if config.pad_to_capacity {
                keep[i]
            } else {
                map[i] && keep[i]
            };
            if map[i] && !keep[i] {
                dropped += 1;
            }
            map[i] = kept;
            if !kept {
                probs[i] = 0.0;
            }
        }
    }
    let mut tokens_per_expert = vec![0usize; e];
    for t in 0..tokens {
        for j in 0..e {
            tokens_per_expert[j] += usize::from(map[t * e + j]);
        }
    }
    let mut lse = Vec::new();
    let mut z_loss = 0.0f32;
    if let Some(coeff) = config.z_loss_coeff {
        lse = (0..tokens)
            .map(|t| log_sum_exp(&logits[t * e..(t + 1) * e]))
            .collect();
        z_loss = lse.iter().map(|l| l * l).sum::<f32>() / tokens as f32 * partition.z_coeff(coeff);
    }
    let (aux_loss, aux_grad, aux_scores) = aux_loss(logits, tokens, seq, config, partition)?;
    Ok(Routing::from_parts(RoutingParts {
        tokens,
        experts: e,
        probs,
        map,
        tokens_per_expert,
        aux_loss,
        z_loss,
        dropped,
        chosen,
        scores,
        aux_grad,
        aux_scores,
        lse,
        z_coeff: config.z_loss_coeff.map_or(0.0, |c| partition.z_coeff(c)),
    }))
}

/// The groups of tokens the load-balancing loss balances over, when there is one.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct AuxGroups {
    /// The groups: 1 (the micro-batch), or each sequence (token t in group t % groups).
    pub groups: usize,
    /// loss = factor · Σ_groups Σ_e count_e · Σ_t score[t, e], with factor = E·coeff /
    /// (k·T²) / groups (T the tokens per group): the mean over the groups.
    pub factor: f32,
}

/// The load-balancing loss's groups for `tokens` tokens in sequences of `seq`, each group's
/// tokens split over `ranks` ranks (the counts summed over them), or `None` without the loss
/// (no balancing, or a coefficient of 0).
pub(crate) fn aux_groups(
    config: &RouterConfig,
    tokens: usize,
    seq: usize,
    ranks: usize,
) -> Option<AuxGroups> {
    if config.load_balancing == LoadBalancing::None || config.aux_loss_coeff == 0.0 {
        return None;
    }
    let (e, k) = (config.num_experts, config.topk);
    let (groups, per_group) = match config.load_balancing {
        LoadBalancing::SeqAuxLoss => (tokens / seq, seq * ranks),
        _ => (1, tokens * ranks),
    };
    let factor = e as f32 * config.aux_loss_coeff
        / (k as f32 * per_group as f32 * per_group as f32)
        / groups as f32;
    Some(AuxGroups { groups, factor })
}

/// The load-balancing loss (Megatron-LM's `switch_load_balancing_loss_func` on the scores
/// `compute_routing_scores_for_aux_loss` gives: a fresh top-k, no capacity), its gradient
/// with respect to those scores, and the scores.
fn aux_loss(
    logits: &[f32],
    tokens: usize,
    seq: usize,
    config: &RouterConfig,
    partition: Partition<'_>,
) -> Result<(f32, Vec<f32>, Vec<f32>), RouterError> {
    let (e, k) = (config.num_experts, config.topk);
    let Some(AuxGroups { groups, factor }) = aux_groups(config, tokens, seq, partition.ranks)
    else {
        return Ok((0.0, Vec::new(), Vec::new()));
    };
    let mut scores = vec![0.0f32; tokens * e];
    for t in 0..tokens {
        let (row, s) = (&logits[t * e..(t + 1) * e], &mut scores[t * e..(t + 1) * e]);
        match config.score_function {
            ScoreFunction::Softmax => softmax(row, s),
            ScoreFunction::Sigmoid => {
                s.iter_mut().zip(row).for_each(|(o, &x)| *o = sigmoid(x));
                let sum = s.iter().sum::<f32>() + 1e-20;
                s.iter_mut().for_each(|o| *o /= sum);
            }
        }
    }
    let group_of = |t: usize| if groups == 1 { 0 } else { t % groups };
    let mut counts = vec![0.0f32; groups * e];
    for t in 0..tokens {
        for j in top_k(&scores[t * e..(t + 1) * e], k) {
            counts[group_of(t) * e + j] += 1.0;
        }
    }
    if partition.ranks > 1 {
        (partition.sum_counts)(&mut counts)?;
    }
    let mut loss = 0.0f32;
    let mut grad = vec![0.0f32; tokens * e];
    for t in 0..tokens {
        for j in 0..e {
            let c = counts[group_of(t) * e + j];
            loss += scores[t * e + j] * c * factor;
            grad[t * e + j] = c * factor;
        }
    }
    Ok((loss, grad, scores))
}

/// The gradient of the router's logits from the gradient of its probabilities `dprobs`
/// (`[tokens, experts]`; only routed entries matter), plus `loss_scale` times the gradients of
/// the aux and z losses (Megatron-LM's `MoEAuxLossAutoScaler`: the main loss's backward
/// scale, e.g. 1 / micro-batches).
pub fn route_backward(
    routing: &Routing,
    logits: &[f32],
    dprobs: &[f32],
    loss_scale: f32,
    config: &RouterConfig,
) -> Result<Vec<f32>, RouterError> {
    let (tokens, e, k) = (routing.tokens, routing.experts, config.topk);
    if routing.chosen.len() != tokens * k {
        return Err(RouterError::NothingSaved);
    }
    check_len("logits", logits.len(), tokens, e)?;
    check_len("probability gradient", dprobs.len(), tokens, e)?;
    let scale = config.topk_scaling_factor.unwrap_or(1.0);
    let saved = &routing.saved;
    let mut dlogits = vec![0.0f32; tokens * e];
    for t in 0..tokens {
        let d = &mut dlogits[t * e..(t + 1) * e];
        let top = &routing.chosen[t * k..(t + 1) * k];
        // Only the probabilities that survived capacity reach the output.
        let dp = |j: usize| {
            if routing.map[t * e + j] {
                dprobs[t * e + j] * scale
            } else {
                0.0
            }
        };
        match (config.score_function, config.pre_softmax) {
            (ScoreFunction::Softmax, true) => {
                let s = &saved.scores[t * e..(t + 1) * e];
                let dot: f32 = top.iter().map(|&j| s[j] * dp(j)).sum();
                for j in 0..e {
                    let ds = if top.contains(&j) { dp(j) } else { 0.0 };
                    d[j] = s[j] * (ds - dot);
                }
            }
            (ScoreFunction::Softmax, false) => {
                let s = &saved.scores[t * k..(t + 1) * k];
                let dot: f32 = top.iter().enumerate().map(|(i, &j)| s[i] * dp(j)).sum();
                for (i, &j) in top.iter().enumerate() {
                    d[j] = s[i] * (dp(j) - dot);
                }
            }
            (ScoreFunction::Sigmoid, _) => {
                let s = &saved.scores[t * e..(t + 1) * e];
                let sum: f32 = top.iter().map(|&j| s[j]).sum::<f32>() + 1e-20;
                let dot: f32 = top.iter().map(|&j| dp(j) * s[j]).sum();
                for &j in top {
                    let ds = if k > 1 {
                        dp(j) / sum - dot / (sum * sum)
                    } else {
                        dp(j)
                    };
                    d[j] = ds * s[j] * (1.0 - s[j]);
                }
            }
        }
        if !saved.aux_grad.is_empty() {
            let (s, g) = (
                &saved.aux_scores[t * e..(t + 1) * e],
                &saved.aux_grad[t * e..(t + 1) * e],
            );
            match config.score_function {
                ScoreFunction::Softmax => {
                    let dot: f32 = s.iter().zip(g).map(|(a, b)| a * b).sum();
                    for j in 0..e {
                        d[j] += loss_scale * s[j] * (g[j] - dot);
                    }
                }
                ScoreFunction::Sigmoid => {
                    // s = σ / (Σσ + ε): through the normalisation, then the sigmoid.
                    let row = &logits[t * e..(t + 1) * e];
                    let sig: Vec<f32> = row.iter().map(|&x| sigmoid(x)).collect();
                    let sum = sig.iter().sum::<f32>() + 1e-20;
                    let dot: f32 = g.iter().zip(&sig).map(|(a, b)| a * b).sum();
                    for j in 0..e {
                        let dsig = g[j] / sum - dot / (sum * sum);
                        d[j] += loss_scale * dsig * sig[j] * (1.0 - sig[j]);
                    }
                }
            }
        }
        if config.z_loss_coeff.is_some() {
            // z = coeff · mean_t lse_t²: d/dlogit = coeff · 2 lse_t · softmax_t / T (the
            // coefficient this rank's: divided over a partition's ranks).
            let mut sm = vec![0.0f32; e];
            softmax(&logits[t * e..(t + 1) * e], &mut sm);
            let c = loss_scale * saved.z_coeff * 2.0 * saved.lse[t] / tokens as f32;
            for j in 0..e {
                d[j] += c * sm[j];
            }
        }
    }
    Ok(dlogits)
}

/// Megatron-LM's aux-loss-free balancing step (`get_updated_expert_bias`): each expert's bias
/// moves by `rate` towards the mean load: up for experts below it, down above it.
pub fn update_expert_bias(bias: &mut [f32], tokens_per_expert: &[f32], rate: f32) {
    let mean = tokens_per_expert.iter().sum::<f32>() / tokens_per_expert.len().max(1) as f32;
    for (b, &n) in bias.iter_mut().zip(tokens_per_expert) {
        let offset = mean - n;
        let sign = if offset > 0.0 {
            1.0
        } else if offset < 0.0 {
            -1.0
        } else {
            0.0
        };
        *b += sign * rate;
    }
}

#[cfg(test)]
mod tests;
