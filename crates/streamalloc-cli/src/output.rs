//! Output files that are replaced whole or not at all: what `record`, `import`, `plot` and
//! `replay --plot` write goes into a new hidden file beside the output, which replaces the
//! output only once it is complete. The output is checked first: a regular file (or a new
//! one), never a FIFO, a device or a directory (writing to a FIFO would block until a reader
//! came).

use std::path::{Path, PathBuf};

/// The file an output replaces, checked before anything is written.
pub struct Target {
    /// The output, or the file a symbolic link there points to.
    pub path: PathBuf,
    /// Whether it exists (then it is a regular file the user may write).
    pub existed: bool,
    /// Its permissions, which the file replacing it takes.
    permissions: Option<std::fs::Permissions>,
}

impl Target {
    /// Follows a symbolic link at `output`; refuses what is not a regular file or missing (a
    /// directory, a device, a FIFO, a link to nothing) and a file the user may not write.
    /// `what` names the output in errors (`the trace`, `the plot`).
    pub fn check(output: &Path, what: &str) -> Result<Self, String> {
        let cannot = |e: &dyn std::fmt::Display| format!("cannot write {what} to {}: {e}", output.display());
        let (path, meta) = match std::fs::symlink_metadata(output) {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Ok(Self { path: output.to_path_buf(), existed: false, permissions: None })
            }
            Err(e) => return Err(cannot(&e)),
            Ok(meta) if meta.file_type().is_symlink() => {
                let path = std::fs::canonicalize(output).map_err(|e| {
                    format!(
                        "{} is a symbolic link to nothing that can be written ({e}): give the path of the \
                         file itself",
                        output.display()
                    )
                })?;
                let meta = std::fs::metadata(&path).map_err(|e| cannot(&e))?;
                (path, meta)
            }
            Ok(meta) => (output.to_path_buf(), meta),
        };
        if !meta.is_file() {
            return Err(cannot(&format!("it is not a regular file but {}", file_kind(&meta.file_type()))));
        }
        // Opened for writing, not truncated, and closed at once: may the user write it?
        std::fs::OpenOptions::new().write(true).open(&path).map_err(|e| cannot(&e))?;
        Ok(Self { path, existed: true, permissions: Some(meta.permissions()) })
    }
}

/// What a file that is not a regular one is, for an error.
fn file_kind(kind: &std::fs::FileType) -> &'static str {
    #[cfg(unix)]
    {
        use std::os::unix::fs::FileTypeExt;
        if kind.is_char_device() || kind.is_block_device() {
            return "a device";
        }
        if kind.is_fifo() {
            return "a FIFO";
        }
        if kind.is_socket() {
            return "a socket";
        }
    }
    if kind.is_dir() {
        "a directory"
    } else {
        "neither a file nor a directory"
    }
}

/// A new hidden file beside a [`Target`], which replaces it on [`Pending::replace`]; removed
/// when dropped otherwise.
pub struct Pending {
    /// Absolute, so that a program that changes directory writes it all the same.
    pub path: PathBuf,
    kept: bool,
}

impl Pending {
    /// Creates a new empty file (never an existing one) in the directory of `target`; `what`
    /// and `output` name the output in errors.
    pub fn create(target: &Target, output: &Path, what: &str) -> Result<Self, String> {
        let cannot = |e: &dyn std::fmt::Display| format!("cannot write {what} to {}: {e}", output.display());
        let dir = target.path.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(Path::new("."));
        let dir = std::path::absolute(dir).map_err(|e| cannot(&e))?;
        // The extension of the output, so that what writes it by its name writes the same.
        let extension = target.path.extension().map(|e| e.to_string_lossy().into_owned()).unwrap_or_default();
        let mut n = 0;
        loop {
            let path = dir.join(format!(".streamalloc-{}-{n}.{extension}", std::process::id()));
            match std::fs::OpenOptions::new().write(true).create_new(true).open(&path) {
                Ok(_) => return Ok(Self { path, kept: false }),
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists && n < 100 => n += 1,
                Err(e) => return Err(cannot(&e)),
            }
        }
    }

    /// Moves the file to `target`, with the permissions of the file it replaces.
    pub fn replace(mut self, target: &Target) -> Result<(), String> {
        let failed = |e: std::io::Error| {
            format!(
                "cannot move {} to {}: {e}; it is kept where it is",
                self.path.display(),
                target.path.display()
            )
        };
        if let Some(permissions) = &target.permissions {
            std::fs::set_permissions(&self.path, permissions.clone()).map_err(failed)?;
        }
        self.kept = true;
        std::fs::rename(&self.path, &target.path).map_err(failed)
    }
}

impl Drop for Pending {
    fn drop(&mut self) {
        if !self.kept {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

/// Writes `output` through `write`, given the path of a new file to write: `output` is
/// replaced once `write` succeeds, and left as it was when it fails. `what` names the output
/// in errors.
pub fn write_whole<T>(
    output: &Path,
    what: &str,
    write: impl FnOnce(&Path) -> Result<T, String>,
) -> Result<T, String> {
    let target = Target::check(output, what)?;
    let pending = Pending::create(&target, output, what)?;
    let value = write(&pending.path)?;
    pending.replace(&target)?;
    Ok(value)
}
