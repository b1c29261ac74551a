//! `tracing` output to stderr that does not tear the progress bar: lines are written while the
//! bar is suspended. `RUST_LOG` sets the level (default `info`).

use std::io::{IsTerminal, Write};

use indicatif::ProgressBar;
use tracing_subscriber::EnvFilter;
use tracing_subscriber::fmt::MakeWriter;

/// A writer that prints above a progress bar.
#[derive(Clone)]
pub struct BarWriter {
    bar: ProgressBar,
}

impl Write for BarWriter {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.bar.suspend(|| std::io::stderr().write_all(buf))?;
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        std::io::stderr().flush()
    }
}

impl<'a> MakeWriter<'a> for BarWriter {
    type Writer = BarWriter;

    fn make_writer(&'a self) -> BarWriter {
        self.clone()
    }
}

/// Installs the subscriber for this process (once; later calls keep the first); the guard is
/// only a reminder that logging is scoped to the command.
pub fn init(bar: ProgressBar) -> Option<()> {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_target(false)
        .with_ansi(std::io::stderr().is_terminal())
        .with_writer(BarWriter { bar })
        .try_init()
        .ok()
}
