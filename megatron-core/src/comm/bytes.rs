//! Bytes between ranks: every rank's byte string, of any length, gathered over a group (a
//! trace's spans, serialized), through the collectives that move tensors.

use super::{Communicator, Result};
use crate::tensor::{DType, Tensor};

/// Every member's `mine`, in group-rank order: their lengths all-gathered, then the strings
/// padded to the longest, eight bytes to an i64, all-gathered (a collective: every member
/// calls it).
pub fn all_gather_bytes(group: &dyn Communicator, mine: Vec<u8>) -> Result<Vec<Vec<u8>>> {
    let n = group.size();
    let lengths = group.place(&Tensor::zeros([n], DType::I64))?;
    let length = group.place(&Tensor::from_vec(vec![mine.len() as i64], [1])?)?;
    group.all_gather(&length, &lengths)?;
    let lengths: Vec<usize> = lengths
        .to_vec::<i64>()?
        .iter()
        .map(|&l| usize::try_from(l).unwrap_or(0))
        .collect();
    let words = lengths.iter().max().copied().unwrap_or(0).div_ceil(8);
    let mut padded = mine;
    padded.resize(words * 8, 0);
    let packed: Vec<i64> = padded
        .chunks_exact(8)
        .map(|c| i64::from_le_bytes(c.try_into().unwrap_or([0; 8])))
        .collect();
    let all = group.place(&Tensor::zeros([n * words], DType::I64))?;
    group.all_gather(&group.place(&Tensor::from_vec(packed, [words])?)?, &all)?;
    let bytes: Vec<u8> = all
        .to_vec::<i64>()?
        .iter()
        .flat_map(|w| w.to_le_bytes())
        .collect();
    Ok(lengths
        .iter()
        .enumerate()
        .map(|(r, &len)| bytes[r * words * 8..r * words * 8 + len].to_vec())
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::comm::World;
    use crate::comm::threads::launch;

    #[test]
    fn strings_of_every_length_come_back_in_rank_order() {
        let out = launch(3, |w| -> Result<Vec<Vec<u8>>> {
            let group = w.communicator("world", &[0, 1, 2])?;
            let mine: Vec<u8> = (0..[0usize, 5, 17][w.rank()])
                .map(|i| i as u8 + 1)
                .collect();
            all_gather_bytes(group.as_ref(), mine)
        })
        .unwrap();
        let want: Vec<Vec<u8>> = [0usize, 5, 17]
            .iter()
            .map(|&n| (0..n).map(|i| i as u8 + 1).collect())
            .collect();
        for got in out {
            assert_eq!(got, want);
        }
    }
}
