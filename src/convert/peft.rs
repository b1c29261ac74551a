//! LoRA adapters out of megatron-rs: written in PEFT's format (`adapter_config.json` and
//! `adapter_model.safetensors`, which `peft`'s `PeftModel.from_pretrained` loads on the Hugging
//! Face base), or merged into the weights they sit beside (`--to hf --merge-lora`).
//!
//! megatron-rs's adapters sit beside Megatron-LM's fused layers, as Megatron-Bridge's do: one
//! beside `linear_qkv` (the fused QKV, per query group) and one beside `linear_fc1` (`[gate;
//! up]`). PEFT's sit beside transformers' separate projections. As Bridge's export does, a
//! fused adapter becomes one per projection: each gets the same A (`lora_A`), and B's rows are
//! split as the fused weight's are (q, k and v out of each query group; the gate's rows, then
//! the up projection's). The scale is the same on both sides: `lora_alpha / r`.

use std::collections::BTreeMap;
use std::ops::Range;
use std::path::Path;

use anyhow::{Context, Result, bail};
use megatron_core::checkpoint;
use megatron_core::tensor_parallel::lora::LoraConfig;
use megatron_models::GptConfig;
use safetensors::tensor::Dtype;
use serde_json::json;

use super::stream::{self, Check, OutTensor, TensorRef};
use super::{CheckpointTensors, ExportOptions, hf_files, hf_llama};

/// PEFT's name of our layer `layer` (`attn.qkv`, ...) of block `i`, projection `proj`.
fn peft_name(i: usize, module: &str, matrix: &str) -> String {
    format!("base_model.model.model.layers.{i}.{module}.{matrix}.weight")
}

/// transformers' projections beside our fused layer `layer`: (module path, which rows of the
/// fused output they are), for a model `c`.
fn projections(c: &GptConfig, layer: &str) -> Result<Vec<(&'static str, Part)>> {
    Ok(match layer {
        "attn.qkv" => vec![
            ("self_attn.q_proj", Part::Qkv(0)),
            ("self_attn.k_proj", Part::Qkv(1)),
            ("self_attn.v_proj", Part::Qkv(2)),
        ],
        "attn.proj" => vec![("self_attn.o_proj", Part::All)],
        "mlp.fc1" if c.swiglu => vec![
            ("mlp.gate_proj", Part::Rows(0..c.ffn_hidden_size)),
            (
                "mlp.up_proj",
                Part::Rows(c.ffn_hidden_size..2 * c.ffn_hidden_size),
            ),
        ],
        "mlp.fc2" => vec![("mlp.down_proj", Part::All)],
        other => bail!("no Hugging Face projection of the Llama family is beside `{other}`"),
    })
}

/// Our experts' layers and transformers' fused expert weights they sit beside, in the order
/// the export lists them in `target_parameters`.
const EXPERT_PARAMETERS: [(&str, &str); 2] = [
    ("mlp.experts.fc1", "gate_up_proj"),
    ("mlp.experts.fc2", "down_proj"),
];

/// Our experts' adapter (A `[E, r, in]`, B `[E, out, r]`) of block `i` as PEFT's adapter of a
/// fused expert weight at `module`: `lora_A` `[E·r, in]` (expert e's rows e·r..), `lora_B`
/// `[out, r·E]` with expert e's column k at k·E + e (PEFT's `ParamWrapper` reshapes A to
/// `[E, r, in]` and B to `[out, r, E]`).
fn expert_adapter<'a>(
    i: usize,
    module: &str,
    a: TensorRef<'a>,
    b: TensorRef<'a>,
    dtype: Dtype,
) -> Result<[OutTensor<'a>; 2]> {
    let (&[e, r, inp], &[_, out, _]) = (a.shape(), b.shape()) else {
        bail!(
            "block {i}'s experts' adapter has A {:?} and B {:?}, not [experts, r, in] and \
             [experts, out, r]",
            a.shape(),
            b.shape()
        );
    };
    let mut a_out = OutTensor::concat(
        peft_name(i, module, "lora_A"),
        vec![e * r, inp],
        vec![a.all()],
    );
    a_out.dtype = dtype;
    let mut b_out = OutTensor::computed(
        peft_name(i, module, "lora_B"),
        Dtype::F32,
        vec![out, r * e],
        move || {
            let values = b.read_all()?;
            let mut permuted = vec![0.0; values.len()];
            for x in 0..e {
                for o in 0..out {
                    for k in 0..r {
                        permuted[o * r * e + k * e + x] = values[(x * out + o) * r + k];
                    }
                }
            }
            Ok(permuted)
        },
    );
    b_out.dtype = dtype;
    Ok([a_out, b_out])
}

/// Which rows of a fused layer's output a projection is.
#[derive(Debug, Clone)]
enum Part {
    /// All of them.
    All,
    /// q, k or v of a QKV fused per query group.
    Qkv(usize),
    /// A range (the gate's or the up projection's half).
    Rows(Range<usize>),
}

impl Part {
    /// The row ranges of a fused `[rows, ..]` tensor this part is, for model `c`.
    fn ranges(&self, c: &GptConfig, rows: usize) -> Vec<Range<usize>> {
        match self {
            Part::All => std::iter::once(0..rows).collect(),
            Part::Rows(r) => std::iter::once(r.clone()).collect(),
            Part::Qkv(part) => {
                hf_llama::qkv_rows(*part, c.num_attention_heads, c.query_groups(), c.head_dim())
            }
        }
    }
}

/// Our layer `layer` of block `i`'s adapter in `tensors`, if it has one: (A, B).
fn adapter<'a>(
    tensors: &'a CheckpointTensors,
    at: &str,
    layer: &str,
) -> Option<(TensorRef<'a>, TensorRef<'a>)> {
    let name = |m: &str| format!("{at}{layer}.{m}.weight");
    Some((
        tensors.find(&name("lora_a"))?,
        tensors.find(&name("lora_b"))?,
    ))
}

/// `name`, the rows `ranges` of weight `w` with the adapter of `lora` (A, B and the scale
/// α / r) merged into them: `W[rows] + (α / r)·B[rows]·A`, computed when written (f32, one
/// range at a time); without an adapter, the rows themselves. The rows are those of `w` seen as
/// `[rows, last dim]`: for the experts' `[experts, rows, cols]` weights, expert e's row j is row
/// `e·rows + j`, merged with expert e's adapter (A `[experts, r, cols]`, B `[experts, rows,
/// r]`); a range stays within one expert.
pub(crate) fn merged_rows<'a>(
    name: String,
    w: TensorRef<'a>,
    lora: Option<(TensorRef<'a>, TensorRef<'a>, f32)>,
    ranges: Vec<Range<usize>>,
) -> OutTensor<'a> {
    let cols = w.shape().last().copied().unwrap_or(1);
    let rows: usize = ranges.iter().map(|r| r.len()).sum();
    let shape = vec![rows, cols];
    let Some((a, b, scale)) = lora else {
        let slices = ranges
            .into_iter()
            .map(|r| w.elems(r.start * cols..r.end * cols))
            .collect();
        return OutTensor::concat(name, shape, slices);
    };
    // Rows per expert (all of them for a dense layer's weight).
    let per_expert = w.shape().iter().rev().nth(1).copied().unwrap_or(1).max(1);
    OutTensor::computed(name, w.dtype(), shape, move || {
        let r = a.shape().iter().rev().nth(1).copied().unwrap_or(1);
        let mut out = Vec::with_capacity(rows * cols);
        for range in &ranges {
            let e = range.start / per_expert;
            let a_values = a.read_f32(e * r * cols..(e + 1) * r * cols)?;
            let mut block = w.read_f32(range.start * cols..range.end * cols)?;
            let b_rows = b.read_f32(range.start * r..range.end * r)?;
            for (row, b_row) in block.chunks_mut(cols).zip(b_rows.chunks(r)) {
                for (k, &bk) in b_row.iter().enumerate() {
                    let s = scale * bk;
                    if s != 0.0 {
                        for (x, &ak) in row.iter_mut().zip(&a_values[k * cols..(k + 1) * cols]) {
                            *x += s * ak;
                        }
                    }
                }
            }
            out.extend(block);
        }
        Ok(out)
    })
}

/// The adapter of our layer `layer` of the module at `at` (`blocks.{i}.`) for merging, if the
/// checkpoint has one.
pub(crate) fn merge_source<'a>(
    tensors: &'a CheckpointTensors,
    lora: Option<&LoraConfig>,
    at: &str,
    layer: &str,
) -> Option<(TensorRef<'a>, TensorRef<'a>, f32)> {
    let lora = lora?;
    let (a, b) = adapter(tensors, at, layer)?;
    Some((a, b, lora.scale()))
}

/// Writes the LoRA adapters of the checkpoint `ckpt` as PEFT's adapter in the directory `dir`
/// (new or empty): `adapter_config.json` and `adapter_model.safetensors` (in `options.dtype`,
/// f32 by default). Returns the model and the number of adapter tensors written.
pub fn export(ckpt: &Path, dir: &Path, options: &ExportOptions) -> Result<(GptConfig, usize)> {
    let loaded = checkpoint::open(ckpt)?;
    let c: GptConfig = serde_json::from_value(loaded.meta().model.clone())
        .with_context(|| format!("{}: the model config", loaded.dir().display()))?;
    let Some(lora) = c.lora.clone() else {
        bail!(
            "{}: the checkpoint holds no LoRA adapters (train with --lora-rank to make some)",
            loaded.dir().display()
        );
    };
    super::architecture::llama_family(&c).map_err(|lacks| {
        anyhow::anyhow!(
            "{}: PEFT's adapters are written for a Llama-family base, which cannot hold: {}",
            loaded.dir().display(),
            lacks.join("; ")
        )
    })?;
    let tensors = CheckpointTensors::open(&loaded)?;
    let dtype = options.dtype.unwrap_or(Dtype::F32);
    let mut out: BTreeMap<String, OutTensor<'_>> = BTreeMap::new();
    let mut modules = Vec::new();
    // transformers' fused expert weights each adapted as a parameter (PEFT's
    // `target_parameters`), in this order: PEFT wraps the experts once per parameter, the
    // first innermost, so that with both the first's adapter sits under `base_layer`.
    let expert_params: Vec<(&str, &str)> = EXPERT_PARAMETERS
        .into_iter()
        .filter(|(layer, _)| lora.targets.iter().any(|t| t == layer))
        .collect();
    for i in 0..c.num_layers {
        for layer in &lora.targets {
            let Some((a, b)) = adapter(&tensors, &format!("blocks.{i}."), layer) else {
                continue;
            };
            if let Some(at) = expert_params.iter().position(|(l, _)| l == layer) {
                let module = match (at, expert_params.len()) {
                    (0, 2) => "mlp.experts.base_layer",
                    _ => "mlp.experts",
                };
                for t in expert_adapter(i, module, a, b, dtype)? {
                    out.insert(t.name.clone(), t);
                }
                continue;
            }
            for (module, part) in projections(&c, layer)? {
                let leaf = module.rsplit('.').next().unwrap_or(module);
                if !modules.contains(&leaf) {
                    modules.push(leaf);
                }
                let mut a_out = OutTensor::copy(peft_name(i, module, "lora_A"), a);
                a_out.dtype = dtype;
                out.insert(a_out.name.clone(), a_out);
                let ranges = part.ranges(&c, b.shape()[0]);
                let rows = ranges.iter().map(|r| r.len()).sum();
                let slices = ranges.into_iter().map(|r| b.rows(r)).collect();
                let mut b_out = OutTensor::concat(
                    peft_name(i, module, "lora_B"),
                    vec![rows, lora.rank],
                    slices,
                );
                b_out.dtype = dtype;
                out.insert(b_out.name.clone(), b_out);
            }
        }
    }
    if out.is_empty() {
        bail!(
            "{}: the model names LoRA targets {:?} but the checkpoint holds none of their \
             adapters",
            loaded.dir().display(),
            lora.targets
        );
    }
    let base_name = loaded
        .base()
        .and_then(|b| b.meta().run["imported_from"].as_str().map(str::to_string))
        .unwrap_or_default();
    let config = json!({
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": lora.rank,
        "lora_alpha": super::float(lora.alpha),
        "lora_dropout": super::float(lora.dropout),
        "target_modules": modules,
        "target_parameters": if expert_params.is_empty() {
            serde_json::Value::Null
        } else {
            json!(expert_params.iter().map(|(_, p)| format!("experts.{p}")).collect::<Vec<_>>())
        },
        "bias": "none",
        "fan_in_fan_out": false,
        "inference_mode": true,
        "init_lora_weights": true,
        "use_rslora": false,
        "use_dora": false,
        "modules_to_save": null,
        "layers_to_transform": null,
        "rank_pattern": {},
        "alpha_pattern": {},
        "base_model_name_or_path": base_name,
    });
    let staging = hf_files::Staging::new(dir)?;
    let tensors_out: Vec<OutTensor<'_>> = out.into_values().collect();
    let metadata = BTreeMap::from([("format".to_string(), "pt".to_string())]);
    stream::write_file(
        &staging.dir().join("adapter_model.safetensors"),
        &tensors_out,
        &metadata,
        Check::Nothing,
    )?;
    let mut text = serde_json::to_string_pretty(&config)?;
    text.push('\n');
    staging.write("adapter_config.json", text.as_bytes())?;
    staging.commit()?;
    Ok((c, tensors_out.len()))
}

/// transformers' projections and the fused layer of ours each is part of.
const FUSED: [(&str, &str); 7] = [
    ("q_proj", "attn.qkv"),
    ("k_proj", "attn.qkv"),
    ("v_proj", "attn.qkv"),
    ("o_proj", "attn.proj"),
    ("gate_proj", "mlp.fc1"),
    ("up_proj", "mlp.fc1"),
    ("down_proj", "mlp.fc2"),
];

/// The module path of projection `proj` in a Llama-family decoder layer.
fn module_of(proj: &str) -> String {
    match proj {
        "q_proj" | "k_proj" | "v_proj" | "o_proj" => format!("self_attn.{proj}"),
        _ => format!("mlp.{proj}"),
    }
}

/// Imports PEFT's LoRA adapter in `dir` (`adapter_config.json`, `adapter_model.safetensors`)
/// as a megatron-rs LoRA checkpoint in `out` whose base is the checkpoint `base` (a
/// Llama-family model, the adapter's base imported): the adapters beside transformers'
/// projections become ours beside the fused layers, which needs the projections fused into
/// one layer to share their A (`q_proj`, `k_proj`, `v_proj`; `gate_proj`, `up_proj`: an
/// adapter megatron-rs or Megatron-Bridge wrote does; a missing one's B is zero). A layout
/// megatron-rs cannot express is refused by name: separate A's, rsLoRA or DoRA, per-module
/// ranks, biases, layers left out, modules saved whole, another base's shapes.
pub fn import(dir: &Path, base: &Path, out: &Path) -> Result<GptConfig> {
    super::hf_gpt2::refuse_existing(out)?;
    let config_path = dir.join("adapter_config.json");
    let text = std::fs::read_to_string(&config_path)
        .with_context(|| format!("reading {}", config_path.display()))?;
    let config: serde_json::Value = serde_json::from_str(&text)
        .with_context(|| format!("{}: not JSON", config_path.display()))?;
    let refuse = |what: String| -> Result<()> {
        bail!(
            "{}: {what}, which megatron-rs's LoRA cannot express",
            config_path.display()
        )
    };
    if config["peft_type"].as_str() != Some("LORA") {
        refuse(format!("`peft_type` is {}, not LORA", config["peft_type"]))?;
    }
    for flag in ["use_rslora", "use_dora", "fan_in_fan_out"] {
        if config[flag].as_bool() == Some(true) {
            refuse(format!("`{flag}` is true"))?;
        }
    }
    if config["bias"].as_str().is_some_and(|b| b != "none") {
        refuse(format!("`bias` is {}", config["bias"]))?;
    }
    for key in ["rank_pattern", "alpha_pattern"] {
        if config[key].as_object().is_some_and(|m| !m.is_empty()) {
            refuse(format!(
                "`{key}` gives modules ranks or alphas of their own"
            ))?;
        }
    }
    for key in ["layers_to_transform", "modules_to_save"] {
        if !config[key].is_null() {
            refuse(format!("`{key}` is {}", config[key]))?;
        }
    }
    let rank = config["r"]
        .as_u64()
        .context("adapter_config.json: no `r`")? as usize;
    let alpha = config["lora_alpha"]
        .as_f64()
        .context("adapter_config.json: no `lora_alpha`")? as f32;
    let dropout = config["lora_dropout"].as_f64().unwrap_or(0.0) as f32;
    let modules: Vec<String> = match &config["target_modules"] {
        serde_json::Value::Array(list) => list
            .iter()
            .map(|m| m.as_str().map(str::to_string))
            .collect::<Option<_>>()
            .context("adapter_config.json: `target_modules` is not a list of names")?,
        serde_json::Value::String(s) => vec![s.clone()],
        other => bail!("adapter_config.json: `target_modules` is {other}"),
    };
    let mut targets: Vec<String> = Vec::new();
    for m in &modules {
        let Some((_, layer)) = FUSED.iter().find(|(p, _)| p == m) else {
            bail!(
                "{}: `target_modules` names `{m}`, which megatron-rs's LoRA cannot express (it \
                 adapts {})",
                config_path.display(),
                FUSED.map(|(p, _)| p).join(", ")
            );
        };
        if !targets.iter().any(|t| t == layer) {
            targets.push(layer.to_string());
        }
    }
    let loaded_base = checkpoint::open(base)?;
    let mut c: GptConfig = serde_json::from_value(loaded_base.meta().model.clone())
        .with_context(|| format!("{}: the model config", loaded_base.dir().display()))?;
    if c.lora.is_some() {
        bail!("{}: the base holds LoRA adapters already", base.display());
    }
    super::architecture::llama_family(&c).map_err(|lacks| {
        anyhow::anyhow!(
            "{}: a PEFT adapter goes on a Llama-family base, which cannot hold: {}",
            base.display(),
            lacks.join("; ")
        )
    })?;
    if c.moe.is_some() && targets.iter().any(|t| t.starts_with("mlp.")) {
        refuse("adapters beside a mixture of experts' MLP projections as modules".to_string())?;
    }
    // transformers' fused expert weights adapted as parameters (`target_parameters`).
    let parameters: Vec<String> = match &config["target_parameters"] {
        serde_json::Value::Null => Vec::new(),
        serde_json::Value::Array(list) => list
            .iter()
            .map(|m| m.as_str().map(str::to_string))
            .collect::<Option<_>>()
            .context("adapter_config.json: `target_parameters` is not a list of names")?,
        other => bail!("adapter_config.json: `target_parameters` is {other}"),
    };
    let mut expert_targets: Vec<&str> = Vec::new();
    for p in &parameters {
        let Some((layer, _)) = EXPERT_PARAMETERS.iter().find(|(_, name)| {
            let tail = format!("experts.{name}");
            *p == tail || p.ends_with(&format!(".{tail}"))
        }) else {
            bail!(
                "{}: `target_parameters` names `{p}`, which megatron-rs's LoRA cannot express \
                 (it adapts experts.gate_up_proj and experts.down_proj)",
                config_path.display()
            );
        };
        if c.moe.is_none() {
            bail!(
                "{}: `target_parameters` names `{p}`, but the base {} has no experts: an \
                 adapter for another base",
                config_path.display(),
                base.display()
            );
        }
        expert_targets.push(layer);
    }
    let file = stream::SafetensorsFile::open(&dir.join("adapter_model.safetensors"))?;
    let get = |i: usize, proj: &str, m: &str| {
        let name = peft_name(i, &module_of(proj), m);
        file.tensor(&name)
            .or_else(|| file.tensor(&name.replace(".weight", ".default.weight")))
    };
    let (h, f) = (c.hidden_size, c.ffn_hidden_size);
    let (heads, groups, d) = (c.num_attention_heads, c.query_groups(), c.head_dim());
    let shape_of = |proj: &str| -> (usize, usize) {
        match proj {
            "q_proj" => (h, heads * d),
            "k_proj" | "v_proj" => (h, groups * d),
            "o_proj" => (heads * d, h),
            "gate_proj" | "up_proj" => (h, f),
            _ => (f, h),
        }
    };
    let mut tensors: Vec<OutTensor<'_>> = Vec::new();
    for i in 0..c.num_layers {
        for layer in &targets {
            let projs: Vec<&str> = FUSED
                .iter()
                .filter(|(_, l)| l == layer)
                .map(|(p, _)| *p)
                .collect();
            let mut a_shared: Option<TensorRef<'_>> = None;
            let mut bs = Vec::new();
            for proj in &projs {
                let (inp, outp) = shape_of(proj);
                let (Some(a), Some(b)) = (get(i, proj, "lora_A"), get(i, proj, "lora_B")) else {
                    bs.push((outp, None));
                    continue;
                };
                if a.shape() != [rank, inp] || b.shape() != [outp, rank] {
                    bail!(
                        "{}: layer {i}'s {proj} adapter has A {:?} and B {:?}; the base {} \
                         needs [{rank}, {inp}] and [{outp}, {rank}]: an adapter for another base",
                        dir.display(),
                        a.shape(),
                        b.shape(),
                        base.display()
                    );
                }
                if let Some(first) = a_shared {
                    if !first.same_values(&a)? {
                        bail!(
                            "{}: layer {i}'s {} and {proj} adapters have different lora_A: \
                             megatron-rs's fused {} has one A beside it (Megatron-Bridge's \
                             layout), which cannot express separate ones",
                            dir.display(),
                            projs[0],
                            bridge_name(layer)
                        );
                    }
                } else {
                    a_shared = Some(a);
                }
                bs.push((outp, Some(b)));
            }
            let Some(a) = a_shared else {
                bail!(
                    "{}: layer {i} has no adapter beside {} though `target_modules` names it",
                    dir.display(),
                    projs.join(", ")
                );
            };
            let ours = |m: &str| format!("blocks.{i}.{layer}.{m}.weight");
            tensors.push(OutTensor::copy(ours("lora_a"), a));
            let rows: usize = bs.iter().map(|(o, _)| o).sum();
            let name = ours("lora_b");
            let b_tensor = if bs.iter().all(|(_, b)| b.is_some()) {
                let parts: Vec<TensorRef<'_>> = bs.iter().filter_map(|(_, b)| *b).collect();
                let slices = match parts.as_slice() {
                    [q, k, v] => hf_llama::fuse_qkv(*q, *k, *v, groups, d),
                    other => other.iter().map(|t| t.all()).collect(),
                };
                OutTensor::concat(name, vec![rows, rank], slices)
            } else {
                // A projection left out: its rows of B are zero.
                let parts: Vec<(usize, Option<TensorRef<'_>>)> = bs.clone();
                let qkv = layer == "attn.qkv";
                OutTensor::computed(name, Dtype::F32, vec![rows, rank], move || {
                    let mut each = Vec::new();
                    for (outp, b) in &parts {
                        each.push(match b {
                            Some(b) => b.read_all()?,
                            None => vec![0.0; outp * rank],
                        });
                    }
                    if !qkv {
                        return Ok(each.concat());
                    }
                    let per_group = heads / groups;
                    let mut out = Vec::with_capacity(rows * rank);
                    for g in 0..groups {
                        out.extend_from_slice(
                            &each[0][g * per_group * d * rank..(g + 1) * per_group * d * rank],
                        );
                        out.extend_from_slice(&each[1][g * d * rank..(g + 1) * d * rank]);
                        out.extend_from_slice(&each[2][g * d * rank..(g + 1) * d * rank]);
                    }
                    Ok(out)
                })
            };
            tensors.push(b_tensor);
        }
    }
    if let Some(moe) = &c.moe {
        let (e, ef) = (moe.router.num_experts, moe.ffn_hidden_size);
        for (i, routed) in c.moe_layers()?.into_iter().enumerate() {
            for (at, layer) in expert_targets.iter().enumerate() {
                if !routed {
                    continue;
                }
                let module = match (at, expert_targets.len()) {
                    (0, 2) => "mlp.experts.base_layer",
                    _ => "mlp.experts",
                };
                let (inp, outp) = match *layer {
                    "mlp.experts.fc1" => (h, 2 * ef),
                    _ => (ef, h),
                };
                let get = |m: &str| {
                    let name = peft_name(i, module, m);
                    file.tensor(&name)
                        .or_else(|| file.tensor(&name.replace(".weight", ".default.weight")))
                };
                let (Some(a), Some(b)) = (get("lora_A"), get("lora_B")) else {
                    bail!(
                        "{}: layer {i} has no adapter of its experts' {} at {module} though \
                         `target_parameters` names it",
                        dir.display(),
                        parameters[at]
                    );
                };
                if a.shape() != [e * rank, inp] || b.shape() != [outp, rank * e] {
                    bail!(
                        "{}: layer {i}'s experts' {} adapter has A {:?} and B {:?}; the base {} \
                         needs [{}, {inp}] and [{outp}, {}]: an adapter for another base",
                        dir.display(),
                        parameters[at],
                        a.shape(),
                        b.shape(),
                        base.display(),
                        e * rank,
                        rank * e
                    );
                }
                let ours = |m: &str| format!("blocks.{i}.{layer}.{m}.weight");
                tensors.push(OutTensor::concat(
                    ours("lora_a"),
                    vec![e, rank, inp],
                    vec![a.all()],
                ));
                tensors.push(OutTensor::computed(
                    ours("lora_b"),
                    Dtype::F32,
                    vec![e, outp, rank],
                    move || {
                        let values = b.read_all()?;
                        let mut ours = vec![0.0; values.len()];
                        for x in 0..e {
                            for o in 0..outp {
                                for k in 0..rank {
                                    ours[(x * outp + o) * rank + k] =
                                        values[o * rank * e + k * e + x];
                                }
                            }
                        }
                        Ok(ours)
                    },
                ));
            }
        }
    }
    targets.extend(expert_targets.iter().map(|t| t.to_string()));
    c.lora = Some(LoraConfig {
        rank,
        alpha,
        dropout,
        targets,
    });
    let base_dir = std::fs::canonicalize(loaded_base.dir())
        .with_context(|| format!("{}", loaded_base.dir().display()))?;
    let mut files: Vec<(String, Vec<u8>)> = hf_files::carried_in(base)?;
    if let Some(path) = loaded_base.file(checkpoint::TOKENIZER_FILE) {
        files.push((
            checkpoint::TOKENIZER_FILE.to_string(),
            std::fs::read(&path)?,
        ));
    }
    let mut run = loaded_base.meta().run.clone();
    run["peft_adapter"] = json!(dir.display().to_string());
    super::save_converted(out, &c, &tensors, &files, run, Some(base_dir))?;
    Ok(c)
}

/// Megatron-LM's name of our layer `layer` (`attn.qkv` → `linear_qkv`).
pub fn bridge_name(layer: &str) -> &'static str {
    match layer {
        "attn.qkv" => "linear_qkv",
        "attn.proj" => "linear_proj",
        "mlp.fc1" => "linear_fc1",
        _ => "linear_fc2",
    }
}
