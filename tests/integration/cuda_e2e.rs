//! `--device` end to end. `device_flag`: the flag's parsing and its errors on every command
//! (no GPU needed; runs in CI). `gpu_vs_cpu` (tests crate's `cuda` feature): the GPU engine and
//! learner against the CPU ones on the same random weights; each test prints why and passes
//! when `Device::cuda(0)` fails (no GPU), so the binary stays green without one. On a GPU
//! machine `scripts/gpu-check.sh` runs them with the filter `cuda_e2e::gpu_vs_cpu`.

mod device_flag;
#[cfg(feature = "cuda")]
mod gpu_vs_cpu;
