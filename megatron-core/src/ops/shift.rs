//! Shifting a sequence-first value one position earlier, as multi-token prediction reads the
//! next token at every depth: Megatron-LM's `roll_tensor(x, shifts=-1)` along the sequence,
//! the vacated last position filled with zeros (a target id 0, a loss-mask weight 0).
//!
//! The value must be whole along the sequence on this rank (token ids and loss masks are).
//! Context parallelism gives each rank chunks of the sequence, and packed documents would need
//! the shift to stop at each document's end: both are refused by name, not built yet
//! (Megatron-LM's `roll_tensor` exchanges the chunks' first positions over the context-parallel
//! group, and rolls each packed document on its own).

use crate::error::Result;
use crate::invalid;
use crate::module::Cx;
use crate::tensor::{DType, Tensor};

/// `x` (`[s, ...]`, sequence first, any dtype) shifted one position earlier: row `i` of the
/// result is row `i + 1` of `x`, and the last row is zeros.
pub fn shift_left(cx: &Cx, x: &Tensor) -> Result<Tensor> {
    let cp = cx.parallel().groups().config().cp;
    if cp > 1 {
        return invalid!(
            "shifting along the sequence (multi-token prediction) with context parallelism \
             {cp}: each rank holds chunks of the sequence, so the next position may be another \
             rank's, an exchange megatron-rs does not build yet"
        );
    }
    if cx.documents().is_some() {
        return invalid!(
            "shifting along the sequence (multi-token prediction) over packed documents: the \
             shift would carry one document's first token into the previous one's last \
             position (a shift per document is not built yet)"
        );
    }
    shift_rows_left(x)
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
    fn context_parallelism_is_refused_by_name_and_one_rank_shifts() {
        use crate::comm::ParallelState;
        use crate::comm::threads::launch;
        use crate::parallel::{ParallelConfig, ParallelLayout};
        for cp in [1, 2] {
            let layout = ParallelLayout::new(&ParallelConfig::new(cp).with_cp(cp)).unwrap();
            let out = launch(cp, |w| -> Result<Vec<i64>> {
                let ps = ParallelState::new(&w, &layout)?;
                let ids = Tensor::from_vec(vec![1i64, 2, 3], [3, 1])?;
                Ok(shift_left(&Cx::new(&ps, 1), &ids)?.to_vec::<i64>()?)
            });
            match cp {
                1 => assert_eq!(out.unwrap(), [vec![2, 3, 0]]),
                _ => {
                    let e = out.unwrap_err().to_string();
                    assert!(e.contains("context parallelism 2"), "{e}");
                }
            }
        }
    }
}
