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
    i: usize,
    layer: &str,
) -> Option<(TensorRef<'a>, TensorRef<'a>)> {
    let name = |m: &str| format!("blocks.{i}.{layer}.{m}.weight");
    Some((
        tensors.find(&name("lora_a"))?,
        tensors.find(&name("lora_b"))?,
    ))
}

/// `name`, the rows `ranges` of weight `w` with the adapter of `lora` (A, B and the scale
/// α / r) merged into them: `W[rows] + (α / r)·B[rows]·A`, computed when written (f32, one
/// range at a time); without an adapter, the rows themselves.
pub(crate) fn merged_rows<'a>(
    name: String,
    w: TensorRef<'a>,
    lora: Option<(TensorRef<'a>, TensorRef<'a>, f32)>,
    ranges: Vec<Range<usize>>,
) -> OutTensor<'a> {
    let cols: usize = w.shape().iter().skip(1).product();
    let rows: usize = ranges.iter().map(|r| r.len()).sum();
    let mut shape = w.shape().to_vec();
    shape[0] = rows;
    let Some((a, b, scale)) = lora else {
        let slices = ranges.into_iter().map(|r| w.rows(r)).collect();
        return OutTensor::concat(name, shape, slices);
    };
    OutTensor::computed(name, w.dtype(), shape, move || {
        let a_values = a.read_all()?;
        let r = a.shape()[0];
        let mut out = Vec::with_capacity(rows * cols);
        for range in &ranges {
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

/// The adapter of our layer `layer` of block `i` for merging, if the checkpoint has one.
pub(crate) fn merge_source<'a>(
    tensors: &'a CheckpointTensors,
    lora: Option<&LoraConfig>,
    i: usize,
    layer: &str,
) -> Option<(TensorRef<'a>, TensorRef<'a>, f32)> {
    let lora = lora?;
    let (a, b) = adapter(tensors, i, layer)?;
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
    for i in 0..c.num_layers {
        for layer in &lora.targets {
            let Some((a, b)) = adapter(&tensors, i, layer) else {
                continue;
            };
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
        .meta()
        .base
        .as_ref()
        .and_then(|b| checkpoint::read_meta(b).ok())
        .and_then(|m| m.run["imported_from"].as_str().map(str::to_string))
        .unwrap_or_default();
    let config = json!({
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": lora.rank,
        "lora_alpha": super::float(lora.alpha),
        "lora_dropout": super::float(lora.dropout),
        "target_modules": modules,
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
