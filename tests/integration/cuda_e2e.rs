//! `--device` end to end. `device_flag`: the flag's parsing and its errors on every command
//! (no GPU needed; runs in CI). `gpu_vs_cpu`: the CUDA engine and learner against the CPU ones
//! on the same random weights, on the emulated device in CI (`::emu`) and, with the tests
//! crate's `cuda` feature, on a GPU (`::gpu`; each prints why and passes when
//! `Device::cuda(0)` fails). On a GPU machine `scripts/gpu-check.sh` runs them.

mod device_flag;
mod gpu_vs_cpu;
