//! Compiles the CUDA kernels (`kernels/cuda/*.cu`) for the CPU through the SIMT emulation
//! (`kernels/cuda/emu/simt.h`, force-included), so `integration/cuda_emu.rs` can run every
//! kernel on the host and compare it with the CPU backend — no GPU, no CUDA toolkit.
//!
//! For each kernel `extern "C" __global__ void name(params)` it generates a launch shim
//! `extern "C" void emu_name(const unsigned geom[6], size_t smem_bytes, params)` (grid x y z,
//! block x y z) that runs the kernel with `emu_launch`; the kernels and shims go into one
//! static library, `cuda_emu`.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

/// `(name, [(type, parameter name)])` of every `extern "C" __global__` kernel of a source.
fn kernels(src: &str) -> Vec<(String, Vec<(String, String)>)> {
    const MARK: &str = "extern \"C\" __global__ void ";
    let mut out = Vec::new();
    let mut rest = src;
    while let Some(at) = rest.find(MARK) {
        rest = &rest[at + MARK.len()..];
        let open = rest.find('(').expect("kernel without a parameter list");
        let close = rest.find(')').expect("kernel without a closing parenthesis");
        let name = rest[..open].trim().to_string();
        let params = rest[open + 1..close]
            .split(',')
            .map(|p| p.split_whitespace().collect::<Vec<_>>().join(" "))
            .filter(|p| !p.is_empty())
            .map(|p| {
                let split = p.rfind(|c: char| !(c.is_alphanumeric() || c == '_')).map_or(0, |i| i + 1);
                (p[..split].trim().to_string(), p[split..].to_string())
            })
            .collect();
        out.push((name, params));
        rest = &rest[close..];
    }
    out
}

/// The emulation translation unit of one `.cu`: the source, then one launch shim per kernel.
fn shim_unit(cu: &Path, src: &str) -> String {
    let mut unit = format!("#include \"{}\"\n#include <cstddef>\n", cu.display());
    for (name, params) in kernels(src) {
        let decl: Vec<String> = params.iter().map(|(t, n)| format!("{t} {n}")).collect();
        let args: Vec<&str> = params.iter().map(|(_, n)| n.as_str()).collect();
        let _ = writeln!(
            unit,
            "extern \"C\" void emu_{name}(const unsigned* geom, std::size_t smem, {}) {{\n    \
             emu_launch({name}, dim3(geom[0], geom[1], geom[2]), dim3(geom[3], geom[4], geom[5]), smem, {});\n}}",
            decl.join(", "),
            args.join(", ")
        );
    }
    unit
}

fn main() {
    let root = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").unwrap()).join("..");
    let cuda = root.join("kernels/cuda");
    let out = PathBuf::from(std::env::var("OUT_DIR").unwrap());
    println!("cargo:rerun-if-changed={}", cuda.display());
    println!("cargo:rerun-if-changed={}", cuda.join("emu").display());
    let mut sources: Vec<PathBuf> = std::fs::read_dir(&cuda)
        .expect("kernels/cuda")
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "cu"))
        .collect();
    sources.sort();
    let mut build = cc::Build::new();
    build
        .cpp(true)
        .flag("-std=c++20")
        .flag("-include")
        .flag(cuda.join("emu/simt.h").to_str().unwrap())
        .flag("-ffp-contract=off")
        .flag("-pthread")
        .flag("-w")
        .include(&cuda)
        .opt_level(2);
    for cu in &sources {
        println!("cargo:rerun-if-changed={}", cu.display());
        let src = std::fs::read_to_string(cu).unwrap();
        let unit = out.join(format!("{}_emu.cpp", cu.file_stem().unwrap().to_str().unwrap()));
        std::fs::write(&unit, shim_unit(cu, &src)).unwrap();
        build.file(&unit);
    }
    build.compile("cuda_emu");
}
