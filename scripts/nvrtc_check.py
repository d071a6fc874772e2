#!/usr/bin/env python3
"""Compiles every kernels/cuda/*.cu with NVRTC, as the CUDA backend will at run time.

For each file and each architecture (sm_90, sm_80) it compiles twice: to CUBIN
(--gpu-architecture=sm_XX, nvrtcGetCUBIN) and to PTX (compute_XX, nvrtcGetPTX), with the
options of kernels/cuda/nvrtc_options.txt. It prints one line per file and architecture
with the number of kernels (`.entry` in the PTX), the NVRTC log on failure, and exits 1 on
any failure. No GPU is needed.

NVRTC 13 comes from the PyPI package nvidia-cuda-nvrtc 13.x (nvidia/cu13/lib/libnvrtc.so.13,
the library the GPU machines load); run it with a Python that has it installed. The kernels include no CUDA header (common.cuh), so the
runtime package's headers are not needed.
"""
import ctypes
import glob
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KERNELS = os.path.join(ROOT, "kernels", "cuda")
ARCHS = ["90", "80"]


def nvidia_dir(sub):
    """A directory of the installed nvidia-* wheels (they share the `nvidia` namespace)."""
    import nvidia  # noqa: PLC0415 (namespace package of the wheels)

    for base in nvidia.__path__:
        path = os.path.join(base, sub)
        if os.path.isdir(path):
            return path
    sys.exit(f"{sub} not found under {list(nvidia.__path__)}: install nvidia-cuda-nvrtc 13.x")


def load_nvrtc():
    libdir = nvidia_dir(os.path.join("cu13", "lib"))
    libs = sorted(glob.glob(os.path.join(libdir, "libnvrtc.so.13*")))
    if not libs:
        sys.exit(f"libnvrtc.so.13 not found in {libdir}")
    lib = ctypes.CDLL(libs[0])
    lib.nvrtcGetErrorString.restype = ctypes.c_char_p
    return lib


def options():
    subst = {"{KERNELS_DIR}": KERNELS}
    out = []
    with open(os.path.join(KERNELS, "nvrtc_options.txt")) as f:
        for line in f:
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            for k, v in subst.items():
                line = line.replace(k, v)
            out.append(line)
    return out


def compile_one(lib, path, opts, arch_opt, want_cubin):
    """Returns (ok, log, ptx or None)."""
    src = open(path, "rb").read()
    prog = ctypes.c_void_p()
    name = os.path.basename(path).encode()
    rc = lib.nvrtcCreateProgram(ctypes.byref(prog), src, name, 0, None, None)
    if rc != 0:
        return False, lib.nvrtcGetErrorString(rc).decode(), None
    all_opts = [o.encode() for o in opts + [arch_opt]]
    arr = (ctypes.c_char_p * len(all_opts))(*all_opts)
    rc = lib.nvrtcCompileProgram(prog, len(all_opts), arr)
    size = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetProgramLog(prog, log)
    log = log.value.decode(errors="replace")
    ptx = None
    ok = rc == 0
    if ok:
        get_size, get = (lib.nvrtcGetCUBINSize, lib.nvrtcGetCUBIN) if want_cubin else (lib.nvrtcGetPTXSize, lib.nvrtcGetPTX)
        rc2 = get_size(prog, ctypes.byref(size))
        buf = ctypes.create_string_buffer(size.value)
        rc3 = get(prog, buf)
        ok = rc2 == 0 and rc3 == 0 and size.value > 0
        if not want_cubin:
            ptx = buf.raw.decode(errors="replace")
    if not ok:
        log = f"{lib.nvrtcGetErrorString(rc).decode()}\n{log}"
    lib.nvrtcDestroyProgram(ctypes.byref(prog))
    return ok, log, ptx


def main():
    lib = load_nvrtc()
    opts = options()
    sources = sorted(glob.glob(os.path.join(KERNELS, "*.cu")))
    if not sources:
        sys.exit(f"no .cu files in {KERNELS}")
    failed = 0
    for path in sources:
        for arch in ARCHS:
            ok_bin, log_bin, _ = compile_one(lib, path, opts, f"--gpu-architecture=sm_{arch}", True)
            ok_ptx, log_ptx, ptx = compile_one(lib, path, opts, f"--gpu-architecture=compute_{arch}", False)
            n = ptx.count(".entry ") if ptx else 0
            status = "ok" if ok_bin and ok_ptx else "FAILED"
            print(f"{os.path.basename(path):24} sm_{arch}: {status}, {n} kernels")
            for ok, log in ((ok_bin, log_bin), (ok_ptx, log_ptx)):
                if not ok or log.strip():
                    print(log.rstrip())
            failed += not (ok_bin and ok_ptx)
    if failed:
        print(f"{failed} compilation(s) failed")
        sys.exit(1)


if __name__ == "__main__":
    main()
