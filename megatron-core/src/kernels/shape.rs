//! Dimension arithmetic shared by the kernels: element counts that cannot overflow.

use super::KernelError;

/// Product of `dims`, or [`KernelError::Invalid`] naming `kernel` when it overflows `usize`.
pub(crate) fn numel(kernel: &'static str, dims: &[usize]) -> Result<usize, KernelError> {
    dims.iter()
        .try_fold(1usize, |acc, &d| acc.checked_mul(d))
        .ok_or_else(|| KernelError::Invalid {
            kernel,
            message: format!("dimensions {dims:?} overflow the address space"),
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numel_multiplies_and_detects_overflow() {
        assert_eq!(numel("k", &[2, 3, 4]), Ok(24));
        assert_eq!(numel("k", &[]), Ok(1));
        assert_eq!(numel("k", &[5, 0, usize::MAX]), Ok(0));
        assert!(matches!(
            numel("k", &[usize::MAX, 2]),
            Err(KernelError::Invalid { kernel: "k", .. })
        ));
    }
}
