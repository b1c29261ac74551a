//! Where an output file may be written. Every file megatron-rs writes (a checkpoint's files, a
//! tokenizer, a dataset's `.bin`/`.idx`, a plot, a converted model) goes to a temporary name
//! and is renamed into place, so that an interrupted write leaves the old file or none. A rename
//! replaces whatever has the name: [`output_path`] is asked first, and it writes through a
//! symbolic link (to the file it names) and refuses a name that is a directory, a device, a
//! pipe or a socket, so that `--output /dev/full` never replaces the device with a file.

use std::fs::{self, File};
use std::io::{self, Write};
use std::path::{Path, PathBuf};

/// How many links [`output_path`] follows before it gives up (as the kernel's `ELOOP`).
const MAX_LINKS: usize = 40;

/// What kind of file `meta` describes, for messages.
fn kind(meta: &fs::Metadata) -> &'static str {
    use std::os::unix::fs::FileTypeExt;
    let t = meta.file_type();
    if t.is_dir() {
        "a directory"
    } else if t.is_char_device() {
        "a character device"
    } else if t.is_block_device() {
        "a block device"
    } else if t.is_fifo() {
        "a named pipe"
    } else if t.is_socket() {
        "a socket"
    } else {
        "not a regular file"
    }
}

/// The path a file meant for `path` is renamed onto: `path` itself when nothing or a regular
/// file has the name, the file a symbolic link names (followed to its end) when `path` is
/// one; an error naming the path when it is (or links to) anything but a regular file.
pub fn output_path(path: &Path) -> io::Result<PathBuf> {
    let mut current = path.to_path_buf();
    for _ in 0..MAX_LINKS {
        let meta = match fs::symlink_metadata(&current) {
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(current),
            Err(e) => return Err(e),
            Ok(meta) => meta,
        };
        if meta.file_type().is_symlink() {
            let target = fs::read_link(&current)?;
            current = match current.parent() {
                Some(dir) if target.is_relative() => dir.join(target),
                _ => target,
            };
            continue;
        }
        if meta.is_file() {
            return Ok(current);
        }
        let through = if current == path {
            String::new()
        } else {
            format!(" (where the link {} leads)", path.display())
        };
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!(
                "{} is {}{through}, not a regular file: megatron-rs writes only regular files \
                 (give a file's path)",
                current.display(),
                kind(&meta)
            ),
        ));
    }
    Err(io::Error::new(
        io::ErrorKind::InvalidInput,
        format!(
            "{}: more than {MAX_LINKS} symbolic links in a row",
            path.display()
        ),
    ))
}

/// A temporary name beside `path` for this process.
pub fn temporary_beside(path: &Path) -> PathBuf {
    let mut name = path.file_name().unwrap_or_default().to_os_string();
    name.push(format!(".tmp-{}", std::process::id()));
    path.with_file_name(name)
}

/// Writes `content` to `path` ([`output_path`]'s answer for it) through a temporary file,
/// synced, then renamed into place; on failure the temporary file is removed. Errors name the
/// file.
pub fn write_atomically(path: &Path, content: &[u8]) -> Result<(), (PathBuf, io::Error)> {
    let target = output_path(path).map_err(|e| (path.to_path_buf(), e))?;
    let tmp = temporary_beside(&target);
    let result = (|| {
        let mut f = File::create(&tmp).map_err(|e| (tmp.clone(), e))?;
        f.write_all(content).map_err(|e| (tmp.clone(), e))?;
        f.sync_all().map_err(|e| (tmp.clone(), e))?;
        fs::rename(&tmp, &target).map_err(|e| (target.clone(), e))
    })();
    if result.is_err() {
        let _ = fs::remove_file(&tmp);
    }
    result
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scratch(name: &str) -> PathBuf {
        let dir =
            std::env::temp_dir().join(format!("megatron-files-{name}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(&dir).unwrap();
        dir
    }

    #[test]
    fn a_link_is_written_through_and_a_device_or_directory_refused() {
        let dir = scratch("links");
        let file = dir.join("out.json");
        assert_eq!(output_path(&file).unwrap(), file);
        write_atomically(&file, b"1").unwrap();
        assert_eq!(output_path(&file).unwrap(), file);
        // A link (relative, through a second link) is followed; the file it names changes.
        let link = dir.join("link.json");
        std::os::unix::fs::symlink("out.json", &link).unwrap();
        let link2 = dir.join("link2.json");
        std::os::unix::fs::symlink(&link, &link2).unwrap();
        write_atomically(&link2, b"2").unwrap();
        assert!(
            fs::symlink_metadata(&link2)
                .unwrap()
                .file_type()
                .is_symlink()
        );
        assert!(
            fs::symlink_metadata(&link)
                .unwrap()
                .file_type()
                .is_symlink()
        );
        assert_eq!(fs::read(&file).unwrap(), b"2");
        // A dangling link: the file it names is created.
        let dangling = dir.join("dangling.json");
        std::os::unix::fs::symlink("new.json", &dangling).unwrap();
        write_atomically(&dangling, b"3").unwrap();
        assert_eq!(fs::read(dir.join("new.json")).unwrap(), b"3");
        // A directory, a device, and a link to a device are refused, and stay.
        let err = write_atomically(&dir, b"4").unwrap_err().1.to_string();
        assert!(err.contains("is a directory, not a regular file"), "{err}");
        let err = output_path(Path::new("/dev/null")).unwrap_err().to_string();
        assert!(err.contains("/dev/null is a character device"), "{err}");
        let to_device = dir.join("null");
        std::os::unix::fs::symlink("/dev/null", &to_device).unwrap();
        let err = write_atomically(&to_device, b"5")
            .unwrap_err()
            .1
            .to_string();
        assert!(
            err.contains("(where the link") && err.contains("character device"),
            "{err}"
        );
        // A loop of links is named.
        std::os::unix::fs::symlink("b", dir.join("a")).unwrap();
        std::os::unix::fs::symlink("a", dir.join("b")).unwrap();
        let err = output_path(&dir.join("a")).unwrap_err().to_string();
        assert!(err.contains("symbolic links in a row"), "{err}");
        // Nothing was left under a temporary name.
        let left: Vec<_> = fs::read_dir(&dir)
            .unwrap()
            .flatten()
            .filter(|e| e.file_name().to_string_lossy().contains(".tmp-"))
            .collect();
        assert!(left.is_empty(), "{left:?}");
        fs::remove_dir_all(&dir).unwrap();
    }
}
