//! One writer per save directory. A run that saves holds an exclusive `flock` on the directory's
//! `.megatron.lock` for as long as it runs, with its process id written in the file: a second
//! run saving into the same directory is refused, naming the process that holds it. The kernel
//! releases the lock when its process ends, however it ends, so a lock is never stale: a file
//! that still names a process that is gone (killed before it could clear it) is taken over, and
//! [`SaveLock::took_over`] says whose it was.

use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, SeekFrom, Write};
use std::os::fd::AsRawFd;
use std::path::Path;

use super::CheckpointError;

/// The lock file's name in a save directory.
pub const LOCK_FILE: &str = ".megatron.lock";

/// The exclusive right to write checkpoints into a save directory, held until dropped.
#[derive(Debug)]
pub struct SaveLock {
    file: File,
    took_over: Option<u32>,
}

impl SaveLock {
    /// Takes the lock of the save directory `save` (created if needed) for this process, or
    /// says which process holds it.
    pub fn acquire(save: &Path) -> Result<SaveLock, CheckpointError> {
        let failed = |path: &Path, message: String| CheckpointError::Io {
            path: path.to_path_buf(),
            message,
        };
        super::create_dir(save)?;
        let path = save.join(LOCK_FILE);
        let mut file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&path)
            .map_err(|e| failed(&path, e.to_string()))?;
        let mut recorded = String::new();
        // SAFETY: `flock` on a file descriptor this function owns; it touches no memory.
        let locked = unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
        let _ = file.read_to_string(&mut recorded);
        let holder = recorded.trim().parse::<u32>().ok();
        if locked != 0 {
            let err = std::io::Error::last_os_error();
            if err.raw_os_error() == Some(libc::EWOULDBLOCK) {
                return Err(failed(
                    save,
                    format!(
                        "another run saves into this directory ({}): wait for it to end, or \
                         give this run another --save",
                        holder.map_or("its process is not recorded".to_string(), |pid| {
                            format!("process {pid}")
                        })
                    ),
                ));
            }
            return Err(failed(&path, format!("cannot lock it: {err}")));
        }
        let pid = std::process::id();
        file.set_len(0)
            .and_then(|()| file.seek(SeekFrom::Start(0)).map(drop))
            .and_then(|()| file.write_all(pid.to_string().as_bytes()))
            .and_then(|()| file.sync_all())
            .map_err(|e| failed(&path, e.to_string()))?;
        Ok(SaveLock {
            file,
            took_over: holder.filter(|&p| p != pid),
        })
    }

    /// The process whose lock this one took over: it ended without clearing its lock file.
    pub fn took_over(&self) -> Option<u32> {
        self.took_over
    }
}

impl Drop for SaveLock {
    /// Clears the process id (the next run has nothing to take over); closing the file
    /// releases the lock.
    fn drop(&mut self) {
        let _ = self.file.set_len(0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fs;

    #[test]
    fn a_second_lock_is_refused_naming_the_holder_and_a_dead_ones_taken_over() {
        let dir = std::env::temp_dir().join(format!("megatron-lock-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        let first = SaveLock::acquire(&dir).unwrap();
        assert_eq!(first.took_over(), None);
        // flock locks belong to the open file: a second open, even in this process, conflicts.
        let err = SaveLock::acquire(&dir).unwrap_err().to_string();
        assert!(
            err.contains(&format!(
                "another run saves into this directory (process {})",
                std::process::id()
            )),
            "{err}"
        );
        drop(first);
        // A lock file left by a process that is gone (no lock held) is taken over.
        fs::write(dir.join(LOCK_FILE), "4194303").unwrap();
        let second = SaveLock::acquire(&dir).unwrap();
        assert_eq!(second.took_over(), Some(4194303));
        drop(second);
        assert_eq!(fs::read_to_string(dir.join(LOCK_FILE)).unwrap(), "");
        fs::remove_dir_all(&dir).unwrap();
    }
}
