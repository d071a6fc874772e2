//! A GGUF reader (llama.cpp's model format, spec: ggml `docs/gguf.md`) with exact
//! dequantization of the types the default model uses. Only the converter uses it.

use crate::error::{ModelError, Result};
use half::f16;
use memmap2::Mmap;
use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// A metadata value.
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    Int(i64),
    UInt(u64),
    Float(f64),
    Bool(bool),
    Str(String),
    Array(Vec<Value>),
}

impl Value {
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            Value::UInt(v) => Some(v),
            Value::Int(v) if v >= 0 => Some(v as u64),
            _ => None,
        }
    }
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            Value::Float(v) => Some(v),
            Value::UInt(v) => Some(v as f64),
            Value::Int(v) => Some(v as f64),
            _ => None,
        }
    }
    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::Str(s) => Some(s),
            _ => None,
        }
    }
    pub fn as_array(&self) -> Option<&[Value]> {
        match self {
            Value::Array(a) => Some(a),
            _ => None,
        }
    }
}

/// ggml tensor types this reader dequantizes (ids from ggml's `enum ggml_type`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GgmlType {
    F32,
    F16,
    Q4_0,
    Q4_1,
    Q8_0,
    BF16,
}

impl GgmlType {
    fn from_id(id: u32) -> Option<Self> {
        Some(match id {
            0 => Self::F32,
            1 => Self::F16,
            2 => Self::Q4_0,
            3 => Self::Q4_1,
            8 => Self::Q8_0,
            30 => Self::BF16,
            _ => return None,
        })
    }
    /// (elements per block, bytes per block)
    fn block(self) -> (usize, usize) {
        match self {
            Self::F32 => (1, 4),
            Self::F16 | Self::BF16 => (1, 2),
            Self::Q4_0 => (32, 18),
            Self::Q4_1 => (32, 20),
            Self::Q8_0 => (32, 34),
        }
    }
}

/// One tensor's header. `dims` are in ggml order (`dims[0]` varies fastest), so the
/// row-major (PyTorch) shape is `dims` reversed.
#[derive(Debug, Clone)]
pub struct TensorInfo {
    pub name: String,
    pub dims: Vec<usize>,
    pub ty: GgmlType,
    offset: usize,
}

impl TensorInfo {
    /// Row-major shape (`dims` reversed).
    pub fn shape(&self) -> Vec<usize> {
        self.dims.iter().rev().cloned().collect()
    }
    pub fn numel(&self) -> usize {
        self.dims.iter().product()
    }
}

/// A memory-mapped GGUF file.
pub struct Gguf {
    path: PathBuf,
    pub metadata: HashMap<String, Value>,
    pub tensors: Vec<TensorInfo>,
    data_start: usize,
    mmap: Mmap,
}

struct Cursor<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Cursor<'a> {
    fn take(&mut self, n: usize) -> std::result::Result<&'a [u8], String> {
        let end = self
            .pos
            .checked_add(n)
            .filter(|&e| e <= self.buf.len())
            .ok_or_else(|| format!("truncated file at byte {}", self.pos))?;
        let s = &self.buf[self.pos..end];
        self.pos = end;
        Ok(s)
    }
    fn u32(&mut self) -> std::result::Result<u32, String> {
        Ok(u32::from_le_bytes(self.take(4)?.try_into().unwrap()))
    }
    fn u64(&mut self) -> std::result::Result<u64, String> {
        Ok(u64::from_le_bytes(self.take(8)?.try_into().unwrap()))
    }
    fn string(&mut self) -> std::result::Result<String, String> {
        let n = self.u64()? as usize;
        String::from_utf8(self.take(n)?.to_vec()).map_err(|e| format!("invalid UTF-8 string: {e}"))
    }
    fn value(&mut self, ty: u32) -> std::result::Result<Value, String> {
        let b = |c: &mut Self, n| c.take(n).map(|s: &[u8]| s.to_vec());
        Ok(match ty {
            0 => Value::UInt(b(self, 1)?[0] as u64),
            1 => Value::Int(b(self, 1)?[0] as i8 as i64),
            2 => Value::UInt(u16::from_le_bytes(b(self, 2)?.try_into().unwrap()) as u64),
            3 => Value::Int(i16::from_le_bytes(b(self, 2)?.try_into().unwrap()) as i64),
            4 => Value::UInt(self.u32()? as u64),
            5 => Value::Int(self.u32()? as i32 as i64),
            6 => Value::Float(f32::from_le_bytes(b(self, 4)?.try_into().unwrap()) as f64),
            7 => Value::Bool(b(self, 1)?[0] != 0),
            8 => Value::Str(self.string()?),
            9 => {
                let et = self.u32()?;
                let n = self.u64()? as usize;
                let mut v = Vec::with_capacity(n.min(1 << 20));
                for _ in 0..n {
                    v.push(self.value(et)?);
                }
                Value::Array(v)
            }
            10 => Value::UInt(self.u64()?),
            11 => Value::Int(self.u64()? as i64),
            12 => Value::Float(f64::from_le_bytes(b(self, 8)?.try_into().unwrap())),
            t => return Err(format!("unknown metadata value type {t}")),
        })
    }
}

impl Gguf {
    /// Parses the header of a GGUF v2/v3 file.
    pub fn open(path: &Path) -> Result<Self> {
        let err = |msg: String| ModelError::Gguf { path: path.into(), msg };
        let file = std::fs::File::open(path).map_err(|e| ModelError::io(path, e))?;
        // SAFETY: read-only mapping of a file nothing else writes while we convert it.
        let mmap = unsafe { Mmap::map(&file) }.map_err(|e| ModelError::io(path, e))?;
        let mut c = Cursor { buf: &mmap, pos: 0 };
        if c.take(4).map_err(err)? != b"GGUF" {
            return Err(err("not a GGUF file (bad magic)".into()));
        }
        let version = c.u32().map_err(err)?;
        if !(2..=3).contains(&version) {
            return Err(err(format!("GGUF version {version} is not supported (2 or 3)")));
        }
        let n_tensors = c.u64().map_err(err)? as usize;
        let n_kv = c.u64().map_err(err)? as usize;
        let mut metadata = HashMap::new();
        for _ in 0..n_kv {
            let key = c.string().map_err(err)?;
            let ty = c.u32().map_err(err)?;
            let v = c.value(ty).map_err(|m| err(format!("metadata `{key}`: {m}")))?;
            metadata.insert(key, v);
        }
        let mut tensors = Vec::with_capacity(n_tensors);
        for _ in 0..n_tensors {
            let name = c.string().map_err(err)?;
            let nd = c.u32().map_err(err)? as usize;
            let dims = (0..nd)
                .map(|_| c.u64().map(|d| d as usize))
                .collect::<std::result::Result<Vec<_>, _>>()
                .map_err(err)?;
            let tid = c.u32().map_err(err)?;
            let ty = GgmlType::from_id(tid).ok_or_else(|| {
                err(format!("tensor `{name}` has ggml type {tid}, supported: F32, F16, BF16, Q4_0, Q4_1, Q8_0"))
            })?;
            let offset = c.u64().map_err(err)? as usize;
            tensors.push(TensorInfo { name, dims, ty, offset });
        }
        let align = metadata.get("general.alignment").and_then(Value::as_u64).unwrap_or(32) as usize;
        let data_start = c.pos.div_ceil(align) * align;
        let g = Gguf { path: path.into(), metadata, tensors, data_start, mmap };
        for t in &g.tensors {
            g.bytes(t)?;
        }
        Ok(g)
    }

    pub fn get(&self, key: &str) -> Option<&Value> {
        self.metadata.get(key)
    }

    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.tensors.iter().find(|t| t.name == name)
    }

    fn bytes(&self, t: &TensorInfo) -> Result<&[u8]> {
        let (per, size) = t.ty.block();
        let n = t.numel();
        if !n.is_multiple_of(per) {
            return Err(ModelError::Gguf {
                path: self.path.clone(),
                msg: format!("tensor `{}`: {n} elements not a multiple of block size {per}", t.name),
            });
        }
        let start = self.data_start + t.offset;
        let end = start + n / per * size;
        self.mmap.get(start..end).ok_or_else(|| ModelError::Gguf {
            path: self.path.clone(),
            msg: format!("tensor `{}` extends past the end of the file", t.name),
        })
    }

    /// Dequantizes a tensor to f32, in ggml element order (= row-major of [`TensorInfo::shape`]).
    pub fn dequantize(&self, t: &TensorInfo) -> Result<Vec<f32>> {
        Ok(dequantize(t.ty, self.bytes(t)?))
    }
}

fn h(b: &[u8]) -> f32 {
    f16::from_le_bytes([b[0], b[1]]).to_f32()
}

/// Exact dequantization, following ggml's `dequantize_row_*` reference code.
pub fn dequantize(ty: GgmlType, data: &[u8]) -> Vec<f32> {
    match ty {
        GgmlType::F32 => data.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect(),
        GgmlType::F16 => data.chunks_exact(2).map(h).collect(),
        GgmlType::BF16 => data.chunks_exact(2).map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32()).collect(),
        // Q8_0: d (f16), 32 × i8; x = q·d
        GgmlType::Q8_0 => data
            .chunks_exact(34)
            .flat_map(|blk| {
                let d = h(blk);
                blk[2..].iter().map(move |&q| q as i8 as f32 * d)
            })
            .collect(),
        // Q4_0: d (f16), 16 bytes; x[j] = (lo - 8)·d, x[j+16] = (hi - 8)·d
        GgmlType::Q4_0 => data
            .chunks_exact(18)
            .flat_map(|blk| {
                let d = h(blk);
                let qs = &blk[2..];
                (0..32).map(move |j| {
                    let q = if j < 16 { qs[j] & 0xF } else { qs[j - 16] >> 4 };
                    (q as i32 - 8) as f32 * d
                })
            })
            .collect(),
        // Q4_1: d (f16), m (f16), 16 bytes; x[j] = lo·d + m, x[j+16] = hi·d + m
        GgmlType::Q4_1 => data
            .chunks_exact(20)
            .flat_map(|blk| {
                let (d, m) = (h(blk), h(&blk[2..]));
                let qs = &blk[4..];
                (0..32).map(move |j| {
                    let q = if j < 16 { qs[j] & 0xF } else { qs[j - 16] >> 4 };
                    q as f32 * d + m
                })
            })
            .collect(),
    }
}
