//! Shifting a sequence-first value one position earlier, as multi-token prediction reads the
//! next token at every depth: Megatron-LM's `roll_tensor(x, shifts=-1)` along the sequence,
//! the vacated last position filled with zeros (a target id 0, a loss-mask weight 0).
//!
//! With context parallelism each rank holds two chunks of the sequence (chunks `r` and
//! `2·cp − 1 − r` of `2·cp`), and a chunk's last position takes the next chunk's first, which
//! another rank may hold: the ranks all-gather their chunks' first positions over the group
//! (`2 · b` values each), as Megatron-LM's `roll_tensor` exchanges them. Packed documents would
//! need the shift to stop at each document's end: refused by name (Megatron-LM rolls each
//! document on its own).

use crate::error::Result;
use crate::invalid;
use crate::module::Cx;
use crate::parallel::GroupKind;
use crate::tensor::{DType, Tensor};

/// `x` (`[s, ...]`, sequence first, any dtype) shifted one position earlier: row `i` of the
/// result is row `i + 1` of `x`, and the last row is zeros; with context parallelism, `x` is
/// this rank's two chunks and the shift is along the whole sequence.
pub fn shift_left(cx: &Cx, x: &Tensor) -> Result<Tensor> {
    if cx.documents().is_some() {
        return invalid!(
            "shifting along the sequence (multi-token prediction) over packed documents: the \
             shift would carry one document's first token into the previous one's last \
             position (a shift per document is not built yet)"
        );
    }
    match cx.parallel().groups().config().cp {
        1 => shift_rows_left(x),
        _ => shift_chunks_left(cx, x),
    }
}

/// [`shift_left`] of this rank's two chunks of a sequence cut over the context-parallel group.
fn shift_chunks_left(cx: &Cx, x: &Tensor) -> Result<Tensor> {
    let group = cx.parallel().comm(GroupKind::Cp);
    let (cp, rank) = (group.size(), group.index());
    let rows = x.dims().first().copied().unwrap_or(0);
    if rows == 0 || !rows.is_multiple_of(2) {
        return invalid!(
            "shift_left with context parallelism {cp}: this rank's part of the sequence has \
             {rows} positions, not two chunks of equal length"
        );
    }
    let c = rows / 2;
    // Within each chunk, as on one rank.
    let out = Tensor::zeros_near(x.shape().clone(), x.dtype(), x)?;
    for chunk in [0, c] {
        if c > 1 {
            out.narrow(0, chunk, c - 1)?
                .copy_from(&x.narrow(0, chunk + 1, c - 1)?)?;
        }
    }
    // Every chunk's first position, rank by rank: rank q's are chunks q and 2·cp − 1 − q.
    let mut dims = x.dims().to_vec();
    dims[0] = 2;
    let firsts = Tensor::zeros_near(dims.clone(), x.dtype(), x)?;
    firsts.narrow(0, 0, 1)?.copy_from(&x.narrow(0, 0, 1)?)?;
    firsts.narrow(0, 1, 1)?.copy_from(&x.narrow(0, c, 1)?)?;
    // Where the group moves tensors (token ids stay on the host in a GPU run), and back.
    let firsts = group.place(&firsts)?;
    dims[0] = 2 * cp;
    let gathered = Tensor::zeros_near(dims, x.dtype(), &firsts)?;
    group.all_gather(&firsts, &gathered)?;
    let gathered = crate::backend::of(x).place(&gathered)?;
    let first_of = |g: usize| match g < cp {
        true => 2 * g,
        false => 2 * (2 * cp - 1 - g) + 1,
    };
    // Chunk r's last position takes chunk r + 1's first; chunk 2·cp − 1 − r's takes chunk
    // 2·cp − r's, unless it is the sequence's last chunk (rank 0's second): zeros.
    for (row, g) in [(c - 1, rank), (2 * c - 1, 2 * cp - 1 - rank)] {
        if g + 1 < 2 * cp {
            out.narrow(0, row, 1)?
                .copy_from(&gathered.narrow(0, first_of(g + 1), 1)?)?;
        }
    }
    Ok(out)
}

/// The 0/1 weights of `targets` (`[s, b]` ids) as f32 on their device: the data's loss mask
/// ([`Cx::loss_mask`]) when the run has one, else ones. Multi-token prediction shifts it with
/// the targets, as Megatron-LM rolls its `loss_mask`.
pub fn loss_mask(cx: &Cx, targets: &Tensor) -> Result<Tensor> {
    let mask = match cx.loss_mask() {
        Some(mask) if mask.shape() == targets.shape() => mask.to_contiguous(DType::F32)?,
        Some(mask) => {
            return invalid!(
                "the loss mask {} does not fit the targets {}",
                mask.shape(),
                targets.shape()
            );
        }
        None => Tensor::from_vec(vec![1.0f32; targets.numel()], targets.dims().to_vec())?,
    };
    crate::backend::of(targets).place(&mask)
}

/// The shift itself, without the context's checks.
pub(crate) fn shift_rows_left(x: &Tensor) -> Result<Tensor> {
    let Some(&s) = x.dims().first() else {
        return invalid!("shift_left: a scalar has no sequence to shift along");
    };
    let out = Tensor::zeros_near(x.shape().clone(), x.dtype(), x)?;
    if s > 1 {
        out.narrow(0, 0, s - 1)?
            .copy_from(&x.narrow(0, 1, s - 1)?)?;
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_row_takes_the_next_and_the_last_is_zero() {
        // [s = 4, b = 2] ids, sequence first.
        let ids = Tensor::from_vec(vec![1i64, 2, 3, 4, 5, 6, 7, 8], [4, 2]).unwrap();
        let shifted = shift_rows_left(&ids).unwrap();
        assert_eq!(shifted.dtype(), DType::I64);
        assert_eq!(shifted.to_vec::<i64>().unwrap(), [3, 4, 5, 6, 7, 8, 0, 0]);
        // Twice: two positions ahead, the last two rows zero (a mask of ones becomes the
        // positions that still have a target two ahead).
        let mask = Tensor::from_vec(vec![1.0f32; 6], [3, 2, 1]).unwrap();
        let twice = shift_rows_left(&shift_rows_left(&mask).unwrap()).unwrap();
        assert_eq!(
            twice.to_vec::<f32>().unwrap(),
            [1.0, 1.0, 0.0, 0.0, 0.0, 0.0]
        );
        // One position: nothing is left.
        let one = Tensor::from_vec(vec![9i64, 9], [1, 2]).unwrap();
        assert_eq!(
            shift_rows_left(&one).unwrap().to_vec::<i64>().unwrap(),
            [0, 0]
        );
    }

    #[test]
    fn the_loss_mask_is_the_datas_or_ones() {
        use crate::comm::ParallelState;
        use crate::comm::threads::launch;
        use crate::parallel::{ParallelConfig, ParallelLayout};
        let layout = ParallelLayout::new(&ParallelConfig::new(1)).unwrap();
        launch(1, |w| -> Result<()> {
            let ps = ParallelState::new(&w, &layout)?;
            let cx = Cx::new(&ps, 1);
            let targets = Tensor::from_vec(vec![5i64, 6, 7, 8], [2, 2])?;
            assert_eq!(loss_mask(&cx, &targets)?.to_vec::<f32>()?, [1.0; 4]);
            let data = Tensor::from_vec(vec![1.0f32, 0.0, 1.0, 1.0], [2, 2])?;
            let masked = cx.with_loss_mask(&data);
            assert_eq!(
                loss_mask(&masked, &targets)?.to_vec::<f32>()?,
                [1.0, 0.0, 1.0, 1.0]
            );
            let other = Tensor::from_vec(vec![5i64, 6], [2, 1])?;
            let e = loss_mask(&masked, &other).unwrap_err().to_string();
            assert!(e.contains("does not fit the targets"), "{e}");
            Ok(())
        })
        .unwrap();
    }

    #[test]
    fn with_context_parallelism_the_chunks_shift_along_the_whole_sequence() {
        use crate::comm::ParallelState;
        use crate::comm::threads::launch;
        use crate::context_parallel::CpChunks;
        use crate::parallel::{ParallelConfig, ParallelLayout};
        // 8 positions × 2 sequences of ids, and a mask; each cp rank shifts its chunks.
        let whole: Vec<i64> = (0..16).map(|i| 100 + i).collect();
        let whole = Tensor::from_vec(whole, [8, 2]).unwrap();
        let want = shift_rows_left(&whole).unwrap();
        for cp in [1, 2, 4] {
            let layout = ParallelLayout::new(&ParallelConfig::new(cp).with_cp(cp)).unwrap();
            let out = launch(cp, |w| -> Result<bool> {
                let ps = ParallelState::new(&w, &layout)?;
                let chunks = CpChunks::new(8, cp, ps.groups().cp_rank())?;
                let local = match cp {
                    1 => whole.clone(),
                    _ => chunks.take_local(&whole)?,
                };
                let got = shift_left(&Cx::new(&ps, 1), &local)?;
                let expected = match cp {
                    1 => want.clone(),
                    _ => chunks.take_local(&want)?,
                };
                Ok(got.to_vec::<i64>()? == expected.to_vec::<i64>()?)
            })
            .unwrap();
            assert!(out.iter().all(|&same| same), "cp {cp}: {out:?}");
        }
    }
}
