//! `DataError`: what can go wrong reading, writing or indexing a dataset, naming the file.

use std::path::{Path, PathBuf};

use thiserror::Error;

/// An error of the data pipeline. File errors name the file and what is wrong with it.
#[derive(Debug, Error)]
pub enum DataError {
    /// A file of an indexed dataset is not there.
    #[error("{}: no such file (an indexed dataset is PREFIX.bin with PREFIX.idx)", path.display())]
    Missing {
        /// The missing file.
        path: PathBuf,
    },
    /// The operating system refused an operation on a file. Its words are part of the
    /// message (not a separate `source`, which reports that print after the message would
    /// repeat).
    #[error("{}: cannot {action}: {cause}", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// What was being done ("open", "map", "write", ...).
        action: &'static str,
        /// The system's error.
        cause: std::io::Error,
    },
    /// A file is not in the format it should be, or is inconsistent with its partner file.
    #[error("{}: {message}", path.display())]
    Format {
        /// The file at fault.
        path: PathBuf,
        /// What is wrong, with the numbers.
        message: String,
    },
    /// A dataset was configured or queried in a way that cannot work; names the numbers.
    #[error("{0}")]
    Invalid(String),
}

impl DataError {
    /// The system's error `cause` of `action` on `path`: a dataset file missing when opened
    /// is [`DataError::Missing`]; anything else keeps the system's words.
    pub(crate) fn io(path: &Path, action: &'static str, cause: std::io::Error) -> Self {
        if action == "open" && cause.kind() == std::io::ErrorKind::NotFound {
            DataError::Missing {
                path: path.to_path_buf(),
            }
        } else {
            DataError::Io {
                path: path.to_path_buf(),
                action,
                cause,
            }
        }
    }

    pub(crate) fn format(path: &Path, message: impl Into<String>) -> Self {
        DataError::Format {
            path: path.to_path_buf(),
            message: message.into(),
        }
    }
}

/// The data errors flow into megatron-core's [`crate::Error`], keeping their type.
impl From<DataError> for crate::Error {
    fn from(err: DataError) -> Self {
        crate::Error::Data(std::sync::Arc::new(err))
    }
}

/// Shorthand for results of the data pipeline.
pub type Result<T, E = DataError> = std::result::Result<T, E>;

/// Returns [`DataError::Invalid`] with a formatted message.
macro_rules! data_invalid {
    ($($arg:tt)*) => {
        ::std::result::Result::Err($crate::data::DataError::Invalid(::std::format!($($arg)*)))
    };
}
pub(crate) use data_invalid;
