//! Writing a folder or file that other processes may read or write at the same time: build
//! it under a staging name unique to this writer (`.<name>.partial-<pid>-<n>` beside the
//! destination), fsync every file and the folder, then rename it into place and fsync the
//! parent. A reader sees the destination absent or complete, never half-written, deleted or
//! replaced; concurrent writers never share a staging name; for folders the first complete
//! one wins and later writers discard their own copy (an existing folder is never deleted).
//! A staging path that is not published is removed when dropped: it is this writer's alone.

use crate::error::{ModelError, Result};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

/// A staging folder or file for one destination.
#[derive(Debug)]
pub struct Staging {
    path: PathBuf,
    dir: bool,
    published: bool,
}

fn staging_path(dest: &Path) -> PathBuf {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let name = dest.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    dest.with_file_name(format!(".{name}.partial-{}-{n}", std::process::id()))
}

/// fsyncs `path` (a file or a folder).
pub fn sync(path: &Path) -> Result<()> {
    std::fs::File::open(path).and_then(|f| f.sync_all()).map_err(|e| ModelError::io(path, e))
}

fn sync_parent(path: &Path) -> Result<()> {
    match path.parent().filter(|p| !p.as_os_str().is_empty()) {
        Some(p) => sync(p),
        None => sync(Path::new(".")),
    }
}

impl Staging {
    /// A new, empty staging folder beside `dest`.
    pub fn dir(dest: &Path) -> Result<Self> {
        let path = staging_path(dest);
        std::fs::create_dir_all(&path).map_err(|e| ModelError::io(&path, e))?;
        Ok(Self { path, dir: true, published: false })
    }

    /// A staging file name beside `dest` (nothing created yet).
    pub fn file(dest: &Path) -> Self {
        Self { path: staging_path(dest), dir: false, published: false }
    }

    /// Where to write.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Moves the staging folder to `dest` once its files and itself are on disk. When `dest`
    /// already exists and `complete(dest)` holds (another writer finished first), keeps that
    /// folder and discards this one; an existing incomplete `dest` is an error and is left
    /// as it is.
    pub fn publish_dir(mut self, dest: &Path, complete: impl Fn(&Path) -> bool) -> Result<()> {
        let entries = std::fs::read_dir(&self.path).map_err(|e| ModelError::io(&self.path, e))?;
        for e in entries {
            let e = e.map_err(|err| ModelError::io(&self.path, err))?;
            sync(&e.path())?;
        }
        sync(&self.path)?;
        if complete(dest) {
            return Ok(());
        }
        match std::fs::rename(&self.path, dest) {
            Ok(()) => {
                self.published = true;
                sync_parent(dest)
            }
            // A non-empty folder is in the way: another writer's (complete), or not ours.
            Err(_) if complete(dest) => Ok(()),
            Err(e) => Err(ModelError::io(
                dest,
                std::io::Error::new(e.kind(), format!("{e}; the folder exists but is incomplete: remove it and retry")),
            )),
        }
    }

    /// Moves the staging file to `dest` (replacing it) once it is on disk.
    pub fn publish_file(mut self, dest: &Path) -> Result<()> {
        sync(&self.path)?;
        std::fs::rename(&self.path, dest).map_err(|e| ModelError::io(dest, e))?;
        self.published = true;
        sync_parent(dest)
    }
}

impl Drop for Staging {
    fn drop(&mut self) {
        if !self.published {
            let _ = if self.dir { std::fs::remove_dir_all(&self.path) } else { std::fs::remove_file(&self.path) };
        }
    }
}
