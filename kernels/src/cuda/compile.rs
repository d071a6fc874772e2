//! NVRTC compilation of the embedded kernel sources, with a PTX cache on disk keyed by a
//! hash of the source, `common.cuh`, the options, the architecture and the NVRTC version
//! (a newer NVRTC may emit PTX an older driver cannot load, and the other way round).

use crate::{KernelError, Result};
use cudarc::nvrtc::{compile_ptx_with_opts, CompileOptions, Ptx};
use std::path::{Path, PathBuf};

/// The kernel sources, embedded at build time: `(file name, source)`.
pub(super) const SOURCES: &[(&str, &str)] = &[
    ("adamw.cu", include_str!("../../cuda/adamw.cu")),
    ("attention_backward.cu", include_str!("../../cuda/attention_backward.cu")),
    ("copy.cu", include_str!("../../cuda/copy.cu")),
    ("elementwise.cu", include_str!("../../cuda/elementwise.cu")),
    ("embedding.cu", include_str!("../../cuda/embedding.cu")),
    ("gemm.cu", include_str!("../../cuda/gemm.cu")),
    ("kv_cache.cu", include_str!("../../cuda/kv_cache.cu")),
    ("logprob.cu", include_str!("../../cuda/logprob.cu")),
    ("paged_attention.cu", include_str!("../../cuda/paged_attention.cu")),
    ("reduce.cu", include_str!("../../cuda/reduce.cu")),
    ("rms_norm.cu", include_str!("../../cuda/rms_norm.cu")),
    ("rope.cu", include_str!("../../cuda/rope.cu")),
    ("sampler.cu", include_str!("../../cuda/sampler.cu")),
    ("softmax.cu", include_str!("../../cuda/softmax.cu")),
];

/// The header every source includes.
const COMMON: &str = include_str!("../../cuda/common.cuh");

/// `kernels/cuda/nvrtc_options.txt`: one option per line, `#` lines are comments.
const OPTIONS: &str = include_str!("../../cuda/nvrtc_options.txt");

/// FNV-1a, 64 bits (Fowler–Noll–Vo): a hash that is stable across runs and Rust versions.
fn fnv1a(parts: &[&[u8]]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for p in parts {
        for &b in p.iter().chain(&[0xffu8]) {
            h = (h ^ b as u64).wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
    h
}

/// `$RLSERVE_CUDA_CACHE`, else `$XDG_CACHE_HOME/rlserve/cuda`, else `~/.cache/rlserve/cuda`,
/// else a directory under the system temp dir.
fn cache_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("RLSERVE_CUDA_CACHE") {
        return d.into();
    }
    let base = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))
        .unwrap_or_else(std::env::temp_dir);
    base.join("rlserve").join("cuda")
}

fn io_err(what: &str, path: &Path, e: std::io::Error) -> KernelError {
    KernelError::Cuda(format!("{what} {}: {e}", path.display()))
}

/// Writes `data` to `path` through a temp file and a rename (a concurrent reader never sees
/// a partial file).
fn write_atomic(path: &Path, data: &[u8]) -> Result<()> {
    let tmp = path.with_extension(format!("tmp{}", std::process::id()));
    std::fs::write(&tmp, data).map_err(|e| io_err("writing", &tmp, e))?;
    std::fs::rename(&tmp, path).map_err(|e| io_err("renaming", &tmp, e))
}

/// The NVRTC options of every source for `compute_<arch>`, with `{KERNELS_DIR}` → `include`.
fn options(include: &Path, arch: &str) -> Vec<String> {
    OPTIONS
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .map(|l| l.replace("{KERNELS_DIR}", &include.display().to_string()))
        .chain([format!("--gpu-architecture=compute_{arch}")])
        .collect()
}

/// `major.minor` of the loaded libnvrtc.
fn nvrtc_version() -> Result<String> {
    let (mut major, mut minor) = (0, 0);
    // SAFETY: nvrtcVersion writes two ints; the library was checked to be loadable.
    let rc = unsafe { cudarc::nvrtc::sys::nvrtcVersion(&mut major, &mut minor) };
    if rc != cudarc::nvrtc::sys::nvrtcResult::NVRTC_SUCCESS {
        return Err(KernelError::Cuda(format!("nvrtcVersion failed: {rc:?}")));
    }
    Ok(format!("{major}.{minor}"))
}

/// PTX of every source for compute capability `major.minor`, from the cache or compiled
/// (and then cached). Errors name the file and carry NVRTC's log.
pub(super) fn compile_all(major: i32, minor: i32) -> Result<Vec<(&'static str, Ptx)>> {
    let arch = format!("{major}{minor}");
    let nvrtc = nvrtc_version()?;
    let dir = cache_dir();
    let include = dir.join(format!("include-{:016x}", fnv1a(&[COMMON.as_bytes()])));
    std::fs::create_dir_all(&include).map_err(|e| io_err("creating", &include, e))?;
    let header = include.join("common.cuh");
    if !header.exists() {
        write_atomic(&header, COMMON.as_bytes())?;
    }
    let opts = options(&include, &arch);
    SOURCES
        .iter()
        .map(|&(name, src)| {
            let joined = opts.join("\n");
            let parts = [src.as_bytes(), COMMON.as_bytes(), joined.as_bytes(), arch.as_bytes(), nvrtc.as_bytes()];
            let key = fnv1a(&parts);
            let path = dir.join(format!("{}-sm{arch}-{key:016x}.ptx", name.trim_end_matches(".cu")));
            if let Ok(ptx) = std::fs::read_to_string(&path) {
                return Ok((name, Ptx::from_src(ptx)));
            }
            let compile = CompileOptions { options: opts.clone(), name: Some(name.into()), ..Default::default() };
            let ptx = compile_ptx_with_opts(src, compile)
                .map_err(|e| KernelError::Cuda(format!("NVRTC failed on {name} for sm_{arch}: {e}")))?;
            write_atomic(&path, ptx.to_src().as_bytes())?;
            Ok((name, ptx))
        })
        .collect()
}
