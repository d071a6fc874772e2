use thiserror::Error;

/// Errors raised by tensor ops: always a caller bug or an unavailable device.
#[derive(Debug, Error)]
pub enum KernelError {
    /// Two tensors (or a tensor and a parameter) disagree on a dimension.
    #[error("shape mismatch in {op}: {detail}")]
    Shape { op: &'static str, detail: String },
    /// The tensors of one op live on different devices.
    #[error("device mismatch in {op}")]
    DeviceMismatch { op: &'static str },
    /// The op (or this form of it) has no kernel on the tensors' device.
    #[error("{op}: {detail}")]
    Unsupported { op: &'static str, detail: String },
    /// Host access to a tensor that lives on a device.
    #[error("the tensor is on a device; copy it to the host with `to_vec`")]
    NotOnHost,
    /// CUDA was requested but this binary has no CUDA backend.
    #[error("CUDA requested but rlserve was built without the `cuda` feature")]
    CudaUnavailable,
    /// CUDA libraries the `cuda` build loads at run time are missing (names joined by `/`).
    #[error(
        "CUDA requested but {0} not found: install the NVIDIA driver (libcuda) and the CUDA \
         libraries (libnvrtc, libcublas), or add their directory to LD_LIBRARY_PATH"
    )]
    CudaLibraryMissing(String),
    /// A driver, NVRTC or cuBLAS call failed (`cuda` feature).
    #[error("CUDA: {0}")]
    Cuda(String),
}

pub(crate) fn shape_err(op: &'static str, detail: impl Into<String>) -> KernelError {
    KernelError::Shape { op, detail: detail.into() }
}
