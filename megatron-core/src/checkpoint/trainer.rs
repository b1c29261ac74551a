//! Saving and loading a [`Trainer`]'s state: parameters (and the plain optimizer's moments)
//! gathered to whole, unpadded tensors on global rank 0; the distributed optimizer's moments
//! written by every rank as its shard, each piece with its logical elements. Loaded by every
//! rank as its own part of them, whatever the layout that saved them.

use std::collections::BTreeMap;
use std::path::Path;

use super::{CheckpointMeta, Loaded, Whole};
use crate::checkpoint;
use crate::comm::ParallelState;
use crate::comm::ReduceOp;
use crate::distributed::ReduceGroups;
use crate::error::Result;
use crate::invalid;
use crate::module::{Module, ParamSpec, assemble_logical};
use crate::parallel::GroupKind;
use crate::tensor::{DType, Tensor};
use crate::training::{LanguageModel, Trainer};

/// What to record about the run besides its tensors.
#[derive(Debug, Clone)]
pub struct SaveInfo {
    /// The model's architecture.
    pub model: serde_json::Value,
    /// Free-form facts about the run.
    pub run: serde_json::Value,
    /// Files saved beside the tensors, by name (e.g. the tokenizer's `tokenizer.json`).
    pub files: checkpoint::Files,
    /// The checkpoint that holds the frozen parameters (a LoRA fine-tune's base): they are
    /// not saved again, and the checkpoint names it ([`CheckpointMeta::base`]). `None`:
    /// frozen parameters are saved with the others.
    pub base: Option<std::path::PathBuf>,
}

/// The values of parameter `spec` this rank holds, from the checkpoint or its base; `None` for
/// a LoRA adapter neither has (a fine-tune starting from its base: the adapter keeps its
/// initial values). Anything else missing is an error naming it.
fn stored_part(spec: &ParamSpec, loaded: &Loaded) -> Result<Option<Vec<f32>>> {
    let dir = loaded.dir().display().to_string();
    match loaded.find_stored(&spec.name)? {
        Some(stored) => Ok(Some(local_part(spec, &stored, &dir)?)),
        None if crate::tensor_parallel::lora::is_adapter_param(&spec.name) => Ok(None),
        None => invalid!(
            "checkpoint {dir}: no tensor `{}`{}",
            spec.name,
            loaded
                .base()
                .map(|b| format!(" (nor in its base {})", b.dir().display()))
                .unwrap_or_default()
        ),
    }
}

/// Calls its argument on some parameters of a model (all of them, or the frozen ones).
type ParamVisit<'v> = dyn FnMut(&mut dyn FnMut(&crate::module::Param)) + 'v;

/// Sets `visit`'s parameters to their parts of the checkpoint's values (a fresh adapter keeps
/// its own); the first failure stops it.
fn set_params(loaded: &Loaded, visit: &mut ParamVisit<'_>) -> Result<()> {
    let mut failure = None;
    visit(&mut |p| {
        if failure.is_some() {
            return;
        }
        let result = (|| -> Result<()> {
            if let Some(part) = stored_part(p.spec(), loaded)? {
                p.set_values(&Tensor::from_vec(part, p.spec().local.clone())?)?;
            }
            Ok(())
        })();
        failure = result.err();
    });
    failure.map_or(Ok(()), Err)
}

/// This rank's part of a logical tensor `whole` (unpadded rows `real_rows` padded with zeros).
fn local_part(spec: &ParamSpec, whole: &dyn Elements, file: &str) -> Result<Vec<f32>> {
    let logical = spec.logical.dims();
    let mut expected = logical.to_vec();
    if let Some(rows) = spec.real_rows {
        expected[0] = rows;
    }
    if whole.shape() != expected {
        return invalid!(
            "checkpoint {file}: `{}` has shape {:?}, the model needs {:?}",
            spec.name,
            whole.shape(),
            expected
        );
    }
    let available = whole.len();
    let mut out = Vec::with_capacity(spec.local.numel());
    for run in spec.part_index().all_runs() {
        let range = run.logical as usize..run.logical as usize + run.len;
        whole.extend_from(range.clone(), &mut out);
        // Logical indices past the real rows are vocabulary padding.
        let padding = range.end - range.start.max(available).min(range.end);
        out.resize(out.len() + padding, 0.0);
    }
    Ok(out)
}

/// A whole tensor's elements, read by ranges: in memory, or in a checkpoint's mapped file.
trait Elements {
    fn shape(&self) -> &[usize];
    fn len(&self) -> usize;
    /// Appends elements `range` that exist (those before `len`) to `out`.
    fn extend_from(&self, range: std::ops::Range<usize>, out: &mut Vec<f32>);
}

impl Elements for Whole {
    fn shape(&self) -> &[usize] {
        &self.shape
    }
    fn len(&self) -> usize {
        self.data.len()
    }
    fn extend_from(&self, range: std::ops::Range<usize>, out: &mut Vec<f32>) {
        let end = range.end.min(self.data.len());
        out.extend_from_slice(&self.data[range.start.min(end)..end]);
    }
}

impl Elements for checkpoint::Stored<'_> {
    fn shape(&self) -> &[usize] {
        checkpoint::Stored::shape(self)
    }
    fn len(&self) -> usize {
        checkpoint::Stored::len(self)
    }
    fn extend_from(&self, range: std::ops::Range<usize>, out: &mut Vec<f32>) {
        checkpoint::Stored::extend_from(self, range, out)
    }
}

/// `len` f32 elements where `like` lives (the host or its GPU): a collective's output beside
/// its input.
fn empty_beside(like: &Tensor, len: usize) -> Result<Tensor> {
    Tensor::empty_near([len], DType::F32, like)
}

/// `values` as a tensor where `like` lives (the host or its GPU), for a communicator.
fn i64_beside(values: Vec<i64>, like: &Tensor) -> Result<Tensor> {
    let n = values.len();
    crate::backend::of(like).place(&Tensor::from_vec(values, [n])?)
}

/// Sends whole tensors to the pipeline's first rank: their length in bytes, then the bytes (a
/// safetensors image, padded to whole 8-byte words).
fn send_tensors(
    pp: &dyn crate::comm::Communicator,
    tensors: &BTreeMap<String, Whole>,
    like: &Tensor,
) -> Result<()> {
    let mut bytes = checkpoint::tensors_to_bytes(tensors)?;
    let len = bytes.len();
    bytes.resize(len.div_ceil(8) * 8, 0);
    let words: Vec<i64> = bytes
        .chunks_exact(8)
        .map(|w| i64::from_le_bytes(w.try_into().expect("8 bytes")))
        .collect();
    pp.send(&i64_beside(vec![len as i64], like)?, 0)?;
    pp.send(&i64_beside(words, like)?, 0)?;
    pp.flush()?;
    Ok(())
}

/// Receives what [`send_tensors`] sent from pipeline rank `from`.
fn recv_tensors(
    pp: &dyn crate::comm::Communicator,
    from: usize,
    like: &Tensor,
) -> Result<BTreeMap<String, Whole>> {
    let len = i64_beside(vec![0], like)?;
    pp.recv(&len, from)?;
    let len = len.to_vec::<i64>()?[0] as usize;
    let words = i64_beside(vec![0; len.div_ceil(8)], like)?;
    pp.recv(&words, from)?;
    let mut bytes: Vec<u8> = words
        .to_vec::<i64>()?
        .iter()
        .flat_map(|w| w.to_le_bytes())
        .collect();
    bytes.truncate(len);
    Ok(checkpoint::tensors_from_bytes(&bytes)?)
}

/// The whole, unpadded tensor of one parameter (or moment), assembled from every part over its
/// split group (a collective of that group).
fn gather_whole(parallel: &ParallelState, spec: &ParamSpec, local: &Tensor) -> Result<Whole> {
    let values = match spec.split.group() {
        None => local.to_vec::<f32>()?,
        Some(group) => {
            let comm = parallel.comm(group);
            let n = local.numel();
            let all = empty_beside(local, comm.size() * n)?;
            comm.all_gather(local, &all)?;
            let all = all.to_vec::<f32>()?;
            let specs: Vec<ParamSpec> = (0..comm.size())
                .map(|part| {
                    let mut s = spec.clone();
                    s.part = part;
                    s
                })
                .collect();
            let parts: Vec<(&ParamSpec, &[f32])> =
                specs.iter().zip(all.chunks_exact(n.max(1))).collect();
            assemble_logical(&parts)?
        }
    };
    let mut shape = spec.logical.dims().to_vec();
    let mut data = values;
    if let Some(rows) = spec.real_rows {
        let row: usize = shape[1..].iter().product();
        data.truncate(rows * row);
        shape[0] = rows;
    }
    Ok(Whole { shape, data })
}

impl<M: LanguageModel> Trainer<M> {
    /// Saves the state after `steps_done` steps into the save directory `save` (a collective:
    /// every rank calls it). Global rank 0 writes the whole parameters (and, without the
    /// distributed optimizer, the whole optimizer state); with it, every rank writes its own
    /// shard of the optimizer state into the save's working directory first.
    pub fn save_checkpoint(
        &self,
        parallel: &ParallelState,
        save: &Path,
        steps_done: u64,
        info: &SaveInfo,
    ) -> Result<()> {
        self.settle_parameters()?;
        let sharded = self.optimizer.shard().is_some();
        let tensors = self.gather_tensors(parallel, !sharded, info.base.is_none())?;
        let world = parallel.comm(crate::parallel::GroupKind::World);
        let rank0 = parallel.groups().rank() == 0;
        let config = parallel.groups().config();
        let meta = CheckpointMeta {
            format: checkpoint::FORMAT.to_string(),
            iteration: steps_done,
            adam_steps: self.optimizer.steps(),
            seed: self.config.seed,
            consumed_samples: steps_done * self.sampler.plan().global_batch as u64,
            saved_tp: config.tp,
            saved_dp: config.dp,
            saved_pp: config.pp,
            model: info.model.clone(),
            run: info.run.clone(),
            files: BTreeMap::new(),
            grad_scaler: self.scaler,
            base: info.base.clone(),
            meta_sha256: None,
        };
        let files: Vec<(&str, &[u8])> = info
            .files
            .iter()
            .map(|(name, bytes)| (name.as_str(), bytes.as_slice()))
            .collect();
        if !sharded {
            if let Some((model, optimizer)) = tensors {
                checkpoint::save(save, &model, Some(&optimizer), &files, meta)?;
            }
            return Ok(());
        }
        // Global rank 0 opens the working directory and tells every rank its writer's id (-1:
        // it could not; its error is the run's).
        let begun = if rank0 {
            Some(checkpoint::begin_save(save, steps_done))
        } else {
            None
        };
        let pid = match &begun {
            Some(Ok(_)) => i64::from(std::process::id()),
            _ => -1,
        };
        let pid_tensor = i64_beside(vec![pid], self.buffers.grads())?;
        world.broadcast(&pid_tensor, 0)?;
        let pid = pid_tensor.to_vec::<i64>()?[0];
        if let Some(Err(e)) = begun {
            return Err(e.into());
        }
        let Ok(pid) = u32::try_from(pid) else {
            return invalid!(
                "global rank 0 could not start the save in {}",
                save.display()
            );
        };
        let tmp = checkpoint::working_dir(save, steps_done, pid);
        // Every rank writes its shard; all learn whether every write succeeded.
        // With several distributed-optimizer instances the first holds every shard; the others
        // hold copies and write none of them.
        let writes = parallel.optimizer_instances().map_or([true, true], |i| {
            i.across.each_ref().map(|g| g.index() == 0)
        });
        let written = self
            .optimizer_shard(
                (parallel.groups().tp_rank(), parallel.groups().etp_rank()),
                writes,
            )
            .and_then(|shard| {
                Ok(checkpoint::write_optimizer_shard(
                    &tmp,
                    world.index(),
                    &shard,
                )?)
            });
        let failed =
            Tensor::scalar_near(f32::from(u8::from(written.is_err())), self.buffers.grads())?;
        world.all_reduce(&failed, ReduceOp::Max)?;
        let failed = failed.to_vec::<f32>()?[0] > 0.0;
        if rank0 {
            match (failed, tensors) {
                (false, Some((model, _))) => {
                    checkpoint::finish_save(save, &tmp, &model, None, &files, meta)?;
                }
                _ => checkpoint::abandon_save(&tmp),
            }
        }
        written?;
        if failed {
            return invalid!(
                "another rank could not write its optimizer shard into {}: nothing was saved",
                save.display()
            );
        }
        // Nobody returns before the checkpoint is complete (a load may follow at once).
        world.barrier()?;
        Ok(())
    }

    /// The whole parameters and (with `optimizer`) the whole optimizer state, on global rank 0
    /// (`None` elsewhere): a collective of every rank. With 16-bit parameters the values are
    /// the f32 main parameters (a loaded run rounds them to its own precision).
    #[allow(clippy::type_complexity)]
    fn gather_tensors(
        &self,
        parallel: &ParallelState,
        optimizer_state: bool,
        frozen_too: bool,
    ) -> Result<Option<(BTreeMap<String, Whole>, BTreeMap<String, Whole>)>> {
        let groups = parallel.groups();
        // With the distributed optimizer each data-parallel rank holds a shard of the main
        // parameters (and, for the whole format, of the moments): gathered first.
        let values = self
            .optimizer
            .whole_main_params(&self.buffers, ReduceGroups::of(parallel))?;
        let moments = if optimizer_state {
            Some(
                self.optimizer
                    .whole_moments(&self.buffers, ReduceGroups::of(parallel))?,
            )
        } else {
            None
        };
        // Data-parallel replicas hold the same state: the first one saves it (of the experts'
        // parameters, the first expert data-parallel replica, whose expert-parallel group
        // gathers them all).
        let (dense, experts) = (groups.dp_rank() == 0, groups.edp_rank() == 0);
        if !dense && !experts {
            return Ok(None);
        }
        let mut model = BTreeMap::new();
        let mut optimizer = BTreeMap::new();
        for slot in self.buffers.slots() {
            let spec = &slot.spec;
            if !(if spec.is_expert() { experts } else { dense }) {
                continue;
            }
            let view = |t: &Tensor| t.narrow(0, slot.offset, slot.len);
            model.insert(
                spec.name.clone(),
                gather_whole(parallel, spec, &view(&values)?)?,
            );
            if let Some((m, v)) = &moments {
                optimizer.insert(
                    format!("{}.exp_avg", spec.name),
                    gather_whole(parallel, spec, &view(m)?)?,
                );
                optimizer.insert(
                    format!("{}.exp_avg_sq", spec.name),
                    gather_whole(parallel, spec, &view(v)?)?,
                );
            }
        }
        // Frozen parameters: their values, which no optimizer holds.
        let mut frozen = Vec::new();
        if frozen_too {
            for chunk in &self.chunks.0 {
                chunk.visit_frozen_params(&mut |p| {
                    frozen.push((p.spec().clone(), p.value().clone()))
                });
            }
        }
        for (spec, value) in frozen {
            if !(if spec.is_expert() { experts } else { dense }) {
                continue;
            }
            let local = value.reshape([spec.local.numel()])?.to_dtype(DType::F32)?;
            model.insert(spec.name.clone(), gather_whole(parallel, &spec, &local)?);
        }
        if !dense {
            return Ok(None);
        }
        // With a pipeline, the first tensor-parallel rank of each stage holds its stage's whole
        // tensors: they go to the first stage (global rank 0), which writes them all.
        if groups.config().pp > 1 {
            if groups.tp_rank() != 0 {
                return Ok(None);
            }
            let pp = parallel.pp();
            let like = self.buffers.grads();
            if pp.index() != 0 {
                send_tensors(pp, &model, like)?;
                send_tensors(pp, &optimizer, like)?;
                return Ok(None);
            }
            for stage in 1..pp.size() {
                // The shared embedding arrives again from the last stage: the first copy stays.
                for (name, t) in recv_tensors(pp, stage, like)? {
                    model.entry(name).or_insert(t);
                }
                for (name, t) in recv_tensors(pp, stage, like)? {
                    optimizer.entry(name).or_insert(t);
                }
            }
        }
        Ok((groups.rank() == 0).then_some((model, optimizer)))
    }

    /// This rank's shard of the distributed optimizer's state: for each part of a parameter in
    /// its shards, the logical elements it covers and the moments there. Each element is
    /// written once: a copy another pipeline stage holds too is left to that stage, and a
    /// parameter every tensor-parallel rank holds whole to tensor-parallel rank 0 (of the
    /// experts' parameters, expert-tensor-parallel rank 0). `[dense, experts]` says whether
    /// this rank writes its shards of each kind of bucket (with several distributed-optimizer
    /// instances, only the first instance's ranks do).
    fn optimizer_shard(
        &self,
        (tp_rank, etp_rank): (usize, usize),
        [dense, experts]: [bool; 2],
    ) -> Result<checkpoint::OptimizerShard> {
        let mut shard = checkpoint::OptimizerShard::new();
        let Some(ranks) = self.optimizer.shard() else {
            return Ok(shard);
        };
        let (m, v) = self.optimizer.moments();
        let (m, v) = (m.to_vec::<f32>()?, v.to_vec::<f32>()?);
        let slots = self.buffers.slots();
        for bucket in self.buffers.buckets() {
            let written = if bucket.expert { experts } else { dense };
            let Some((_, parts)) = bucket.shard(ranks.of(bucket)).filter(|_| written) else {
                continue;
            };
            for part in parts {
                let slot = &slots[part.slot];
                let left_to_another_rank = match slot.spec.split.group() {
                    Some(GroupKind::Tp | GroupKind::Etp | GroupKind::EtpEp) => false,
                    Some(GroupKind::Ep) => etp_rank != 0,
                    _ => tp_rank != 0,
                };
                if slot.shared_copy || left_to_another_rank {
                    continue;
                }
                let spec = &slot.spec;
                let local = part.range.start - slot.offset..part.range.end - slot.offset;
                let at = self.optimizer.to_moments(&self.buffers, &part.range).start;
                // Logical elements past the real rows are the vocabulary's padding: not saved;
                // nor a copy another rank writes.
                let real = spec.real_rows.map_or(u64::MAX, |rows| {
                    (rows * spec.logical.dims()[1..].iter().product::<usize>()) as u64
                });
                let mut piece = checkpoint::ShardPiece::default();
                let (mut exp_avg, mut exp_avg_sq) = (Vec::new(), Vec::new());
                for run in spec.part_index().runs(local.clone()) {
                    let kept = real.saturating_sub(run.logical).min(run.len as u64) as usize;
                    if kept > 0 && run.owned {
                        piece.runs.push((run.logical, kept as u64));
                        let from = at + run.local - local.start;
                        exp_avg.extend_from_slice(&m[from..from + kept]);
                        exp_avg_sq.extend_from_slice(&v[from..from + kept]);
                    }
                }
                piece.values.insert("exp_avg".into(), exp_avg);
                piece.values.insert("exp_avg_sq".into(), exp_avg_sq);
                shard.insert(spec.name.clone(), piece);
            }
        }
        Ok(shard)
    }

    /// Loads a checkpoint into this rank's parameters (and optimizer moments when saved):
    /// resharded to this run's layout. Returns its metadata; training resumes at
    /// `meta.iteration`. Global rank 0 verifies the files' checksums.
    pub fn load_checkpoint(
        &mut self,
        parallel: &ParallelState,
        path: &Path,
    ) -> Result<CheckpointMeta> {
        self.settle_parameters()?;
        let loaded = open_checkpoint(parallel, path)?;
        load_into(parallel, &loaded, self)?;
        Ok(loaded.meta().clone())
    }
}

/// Opens a checkpoint on every rank of a world: global rank 0 removes what interrupted saves
/// left in its save directory and verifies the checksums while the others wait, so a corrupt
/// file is reported as such (its error stops every rank), never as a parse error of another
/// rank.
pub fn open_checkpoint(parallel: &ParallelState, path: &Path) -> Result<Loaded> {
    let world = parallel.comm(crate::parallel::GroupKind::World);
    if parallel.groups().rank() == 0 {
        if let Some(save) = checkpoint::save_dir_of(path) {
            checkpoint::remove_interrupted_saves(&save);
        }
        let loaded = checkpoint::open(path)?;
        world.barrier()?;
        Ok(loaded)
    } else {
        world.barrier()?;
        Ok(checkpoint::open_unverified(path)?)
    }
}

/// Sets every parameter of `model` to its part of the checkpoint's values (for evaluation,
/// generation or fine-tuning), resharded to this rank's layout.
pub fn load_params<M: Module>(model: &M, loaded: &Loaded) -> Result<()> {
    set_params(loaded, &mut |f| model.visit_params(&mut |p| f(p)))
}

fn load_into<M: LanguageModel>(
    parallel: &ParallelState,
    loaded: &Loaded,
    trainer: &mut Trainer<M>,
) -> Result<()> {
    let dir = loaded.dir().display().to_string();
    let with_optimizer = loaded.has_optimizer();
    let n = trainer.buffers.len();
    let (mut exp_avg, mut exp_avg_sq) = (vec![0.0f32; n], vec![0.0f32; n]);
    // The current values: what a fresh adapter keeps (gathered, when sharded).
    let mut values = trainer
        .buffers
        .gathered_values(0..n, ReduceGroups::of(parallel))?
        .to_vec_f32()?;
    for slot in trainer.buffers.slots() {
        let spec = &slot.spec;
        let r = slot.range();
        if let Some(part) = stored_part(spec, loaded)? {
            values[r.clone()].copy_from_slice(&part);
        }
        if with_optimizer {
            let mut shape = spec.logical.dims().to_vec();
            if let Some(rows) = spec.real_rows {
                shape[0] = rows;
            }
            let m = loaded.optimizer_state(&spec.name, "exp_avg", &shape)?;
            exp_avg[r.clone()].copy_from_slice(&local_part(spec, &m, &dir)?);
            let v = loaded.optimizer_state(&spec.name, "exp_avg_sq", &shape)?;
            exp_avg_sq[r].copy_from_slice(&local_part(spec, &v, &dir)?);
        }
    }
    // Frozen parameters: their values alone, each into its own tensor.
    for chunk in &trainer.chunks.0 {
        set_params(loaded, &mut |f| chunk.visit_frozen_params(&mut |p| f(p)))?;
    }
    trainer
        .optimizer
        .set_whole_main_params(&trainer.buffers, &values)?;
    trainer
        .optimizer
        .set_whole_moments(&trainer.buffers, &exp_avg, &exp_avg_sq)?;
    // A dynamic loss scale goes on from the saved one; a static scale is the flag's.
    if let (Some(scaler), Some(saved)) = (&mut trainer.scaler, loaded.meta().grad_scaler)
        && scaler.dynamic
        && saved.dynamic
    {
        *scaler = saved;
    }
    trainer.optimizer.set_steps(if with_optimizer {
        loaded.meta().adam_steps
    } else {
        0
    });
    Ok(())
}
