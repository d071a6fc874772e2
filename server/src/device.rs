//! `--device cpu|cuda|cuda:N`: the one parser of the device flag, and opening the device.
//!
//! The binary's commands take the flag through `cli::DeviceArg`; `serve`'s state builder
//! gets the opened [`Device`] through [`crate::serve::ServeArgs::device`].

use kernels::{CudaOptions, Device};
use std::fmt;

/// A parsed `--device` value (nothing opened yet).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum DeviceSpec {
    /// The host (rayon pool).
    #[default]
    Cpu,
    /// The CUDA device with this ordinal (`cuda` is `cuda:0`).
    Cuda(usize),
    /// The emulated CUDA device (`cuda-emu`): the CUDA code paths on the host, for tests.
    CudaEmu,
}

impl DeviceSpec {
    /// Parses `cpu`, `cuda`, `cuda:N` (N a decimal ordinal) or `cuda-emu`. Errors name the
    /// flag and the value: `--device must be cpu, cuda, cuda:N or cuda-emu, got "gpu"`.
    pub fn parse(s: &str) -> Result<Self, String> {
        let bad = || format!("--device must be cpu, cuda, cuda:N or cuda-emu, got {s:?}");
        match s {
            "cpu" => Ok(Self::Cpu),
            "cuda" => Ok(Self::Cuda(0)),
            "cuda-emu" => Ok(Self::CudaEmu),
            _ => {
                let n = s.strip_prefix("cuda:").ok_or_else(bad)?;
                // `usize::from_str` takes a leading `+`; an ordinal is digits only.
                if n.is_empty() || !n.bytes().all(|b| b.is_ascii_digit()) {
                    return Err(bad());
                }
                n.parse().map(Self::Cuda).map_err(|_| bad())
            }
        }
    }

    /// Opens the device. Errors (never a panic): the kernels crate's
    /// [`kernels::KernelError::CudaUnavailable`] in a build without the `cuda` feature, its
    /// `CUDA requested but libcuda/... not found` when the CUDA libraries are missing, or the
    /// driver's error for an ordinal with no GPU; each prefixed with `--device <value>`.
    pub fn open(self) -> anyhow::Result<Device> {
        self.open_with(CudaOptions::default())
    }

    /// [`Self::open`] with `--batch-invariant` / `--dtype` as [`CudaOptions`]
    /// ([`Device::cuda_with`]; the CPU ignores them: it is always batch-invariant and f32).
    pub fn open_with(self, options: CudaOptions) -> anyhow::Result<Device> {
        match self {
            Self::Cpu => Ok(Device::Cpu),
            Self::Cuda(n) => Device::cuda_with(n, options).map_err(|e| anyhow::anyhow!("--device {self}: {e}")),
            Self::CudaEmu => Device::cuda_emu(options).map_err(|e| anyhow::anyhow!("--device {self}: {e}")),
        }
    }
}

impl fmt::Display for DeviceSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Cpu => write!(f, "cpu"),
            Self::Cuda(n) => write!(f, "cuda:{n}"),
            Self::CudaEmu => write!(f, "cuda-emu"),
        }
    }
}
