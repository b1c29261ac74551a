//! Layout: how a tensor's shape maps onto its storage (strides and offset, in elements).

use std::fmt;

/// A tensor's dimensions.
#[derive(Clone, PartialEq, Eq, Hash, Default)]
pub struct Shape(pub Vec<usize>);

impl Shape {
    /// The dimensions as a slice.
    pub fn dims(&self) -> &[usize] {
        &self.0
    }

    /// Number of dimensions.
    pub fn rank(&self) -> usize {
        self.0.len()
    }

    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.0.iter().product()
    }

    /// Row-major strides of a contiguous tensor of this shape.
    pub fn contiguous_strides(&self) -> Vec<usize> {
        let mut strides = vec![1; self.0.len()];
        for i in (0..self.0.len().saturating_sub(1)).rev() {
            strides[i] = strides[i + 1] * self.0[i + 1];
        }
        strides
    }
}

impl fmt::Debug for Shape {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{self}")
    }
}

impl fmt::Display for Shape {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let dims: Vec<String> = self.0.iter().map(usize::to_string).collect();
        write!(f, "[{}]", dims.join(", "))
    }
}

impl From<&[usize]> for Shape {
    fn from(dims: &[usize]) -> Self {
        Shape(dims.to_vec())
    }
}

impl<const N: usize> From<[usize; N]> for Shape {
    fn from(dims: [usize; N]) -> Self {
        Shape(dims.to_vec())
    }
}

impl From<Vec<usize>> for Shape {
    fn from(dims: Vec<usize>) -> Self {
        Shape(dims)
    }
}

impl From<usize> for Shape {
    fn from(n: usize) -> Self {
        Shape(vec![n])
    }
}

/// Shape, strides and offset of a view into a storage.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Layout {
    /// The view's dimensions.
    pub shape: Shape,
    /// Elements to step in storage per index of each dimension.
    pub strides: Vec<usize>,
    /// Index in storage of the view's first element.
    pub offset: usize,
}

impl Layout {
    /// A contiguous row-major layout starting at `offset`.
    pub fn contiguous(shape: Shape, offset: usize) -> Self {
        let strides = shape.contiguous_strides();
        Layout {
            shape,
            strides,
            offset,
        }
    }

    /// Whether the elements are dense and row-major (size-1 dimensions' strides do not matter).
    pub fn is_contiguous(&self) -> bool {
        let mut expected = 1;
        for (&dim, &stride) in self.shape.0.iter().zip(&self.strides).rev() {
            if dim != 1 && stride != expected {
                return false;
            }
            expected *= dim;
        }
        true
    }

    /// One past the largest storage index the view touches (its offset when empty).
    pub fn end(&self) -> usize {
        if self.shape.numel() == 0 {
            return self.offset;
        }
        self.offset
            + self
                .shape
                .0
                .iter()
                .zip(&self.strides)
                .map(|(&d, &s)| (d - 1) * s)
                .sum::<usize>()
            + 1
    }
}
