//! Standard output of the commands. A describing command (`schedule`, `layout`, `graphs`, ...)
//! writes with [`line`] and [`text`]: a reader that leaves (`| head -1`) ends it quietly, as Unix
//! tools end, and any other failure (`> /dev/full`) is an error that names standard output.
//! Training writes with [`note`]: its progress may go nowhere, the run goes on and writes its
//! logs and checkpoints.

use std::fmt;
use std::io::{self, Write};
use std::sync::atomic::{AtomicBool, Ordering};

/// Standard output could not take a command's report.
#[derive(Debug, thiserror::Error)]
#[error("writing to standard output")]
pub struct StdoutError(
    #[from]
    #[source]
    io::Error,
);

impl StdoutError {
    /// Whether the reader closed the pipe: the command ends quietly, successfully.
    pub fn reader_left(&self) -> bool {
        self.0.kind() == io::ErrorKind::BrokenPipe
    }
}

/// Writes `args` and a newline to standard output, flushed.
pub fn line(args: fmt::Arguments<'_>) -> Result<(), StdoutError> {
    let mut out = io::stdout().lock();
    out.write_fmt(args)?;
    out.write_all(b"\n")?;
    out.flush()?;
    Ok(())
}

/// Writes `s` as it is to standard output, flushed.
pub fn text(s: &str) -> Result<(), StdoutError> {
    let mut out = io::stdout().lock();
    out.write_all(s.as_bytes())?;
    out.flush()?;
    Ok(())
}

/// Set once a [`note`] failed: later notes are not tried.
static NOTES_LOST: AtomicBool = AtomicBool::new(false);

/// Writes a line of a run's progress to standard output if it can; a closed or full standard
/// output never stops the run (the logs and checkpoints are written all the same).
pub fn note_line(args: fmt::Arguments<'_>) {
    if !NOTES_LOST.load(Ordering::Relaxed) && line(args).is_err() {
        NOTES_LOST.store(true, Ordering::Relaxed);
    }
}

/// Writes `message` and a newline to standard error, ignoring a failure: there is nowhere
/// left to say it.
pub fn error_line(message: &str) {
    let mut err = io::stderr().lock();
    let _ = err.write_all(message.as_bytes());
    let _ = err.write_all(b"\n");
    let _ = err.flush();
}

/// `println!` for describing commands: `say!(...)?` ends the command on a failed write.
macro_rules! say {
    ($($arg:tt)*) => {
        $crate::cli::output::line(format_args!($($arg)*))
    };
}

/// `println!` for a run's progress: never fails.
macro_rules! note {
    ($($arg:tt)*) => {
        $crate::cli::output::note_line(format_args!($($arg)*))
    };
}

pub(crate) use {note, say};
