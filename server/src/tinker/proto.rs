//! The protobuf messages of the Tinker API that rlserve reads (`ForwardBackwardRequest`) and
//! writes (`ForwardBackwardOutput`, `SampleResponse`), derived with prost from
//! `tinker_public.proto` (package `tinker_public`; field numbers and types as there). The
//! SDK's encoding conventions (`tinker/proto/request_conv.py`, `response_conv.py`): token ids
//! are int32 little-endian bytes, per-token floats f32 little-endian bytes, and a
//! `BatchedTensor` concatenates its datums' values with `N + 1` int64 byte offsets.

use prost::{Enumeration, Message};
use std::collections::HashMap;

#[derive(Clone, PartialEq, Message)]
pub struct ForwardBackwardRequest {
    #[prost(string, tag = "1")]
    pub model_id: String,
    #[prost(int32, tag = "2")]
    pub seq_id: i32,
    #[prost(message, repeated, tag = "3")]
    pub data: Vec<Datum>,
    #[prost(string, tag = "4")]
    pub loss_fn: String,
    #[prost(map = "string, double", tag = "5")]
    pub loss_fn_config: HashMap<String, f64>,
    #[prost(bool, tag = "6")]
    pub forward_only: bool,
    #[prost(map = "string, message", tag = "7")]
    pub loss_fn_config_v2: HashMap<String, LossConfigValue>,
}

#[derive(Clone, PartialEq, Message)]
pub struct LossConfigValue {
    #[prost(oneof = "loss_config_value::Value", tags = "1, 2")]
    pub value: Option<loss_config_value::Value>,
}

pub mod loss_config_value {
    #[derive(Clone, PartialEq, prost::Oneof)]
    pub enum Value {
        #[prost(double, tag = "1")]
        Number(f64),
        #[prost(string, tag = "2")]
        Text(String),
    }
}

#[derive(Clone, PartialEq, Message)]
pub struct Datum {
    #[prost(message, repeated, tag = "1")]
    pub model_input: Vec<Chunk>,
    #[prost(map = "string, message", tag = "2")]
    pub loss_fn_inputs: HashMap<String, Tensor>,
}

#[derive(Clone, PartialEq, Message)]
pub struct Chunk {
    #[prost(oneof = "chunk::Chunk", tags = "1, 2, 3")]
    pub chunk: Option<chunk::Chunk>,
}

pub mod chunk {
    /// Image and dmel chunks are decoded only to be refused by name.
    #[derive(Clone, PartialEq, prost::Oneof)]
    pub enum Chunk {
        #[prost(message, tag = "1")]
        EncodedText(super::EncodedTextChunk),
        #[prost(message, tag = "2")]
        Image(super::Opaque),
        #[prost(message, tag = "3")]
        Dmel(super::Opaque),
    }
}

#[derive(Clone, PartialEq, Message)]
pub struct EncodedTextChunk {
    /// int32 little-endian token ids.
    #[prost(bytes = "vec", tag = "1")]
    pub tokens: Vec<u8>,
}

/// A message whose fields rlserve does not read (`ImageChunk`, `DmelChunk`).
#[derive(Clone, PartialEq, Message)]
pub struct Opaque {}

#[derive(Clone, PartialEq, Message)]
pub struct Tensor {
    #[prost(oneof = "tensor::Encoding", tags = "1, 2")]
    pub encoding: Option<tensor::Encoding>,
    #[prost(enumeration = "DType", tag = "3")]
    pub dtype: i32,
    #[prost(int64, repeated, tag = "4")]
    pub shape: Vec<i64>,
}

pub mod tensor {
    #[derive(Clone, PartialEq, prost::Oneof)]
    pub enum Encoding {
        /// C-order values in the tensor's dtype, little-endian.
        #[prost(bytes, tag = "1")]
        Dense(Vec<u8>),
        #[prost(message, tag = "2")]
        SparseCsr(super::SparseCsr),
    }
}

#[derive(Clone, PartialEq, Message)]
pub struct SparseCsr {
    #[prost(bytes = "vec", tag = "1")]
    pub values: Vec<u8>,
    #[prost(bytes = "vec", tag = "2")]
    pub crow_indices: Vec<u8>,
    #[prost(bytes = "vec", tag = "3")]
    pub col_indices: Vec<u8>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Enumeration)]
#[repr(i32)]
pub enum DType {
    Unspecified = 0,
    Float32 = 1,
    Int64 = 2,
    Int32 = 3,
    Bfloat16 = 4,
}

#[derive(Clone, PartialEq, Message)]
pub struct BatchedTensor {
    #[prost(bytes = "vec", tag = "1")]
    pub data: Vec<u8>,
    /// `N + 1` int64 little-endian byte offsets into `data`.
    #[prost(bytes = "vec", tag = "2")]
    pub offsets: Vec<u8>,
    #[prost(enumeration = "DType", tag = "3")]
    pub dtype: i32,
    #[prost(int64, repeated, tag = "4")]
    pub trailing_shape: Vec<i64>,
}

#[derive(Clone, PartialEq, Message)]
pub struct ArrayRecord {
    #[prost(string, tag = "1")]
    pub type_tag: String,
    #[prost(map = "string, message", tag = "2")]
    pub fields: HashMap<String, BatchedTensor>,
    #[prost(int64, tag = "3")]
    pub num_datums: i64,
}

#[derive(Clone, PartialEq, Message)]
pub struct ForwardBackwardOutput {
    #[prost(string, tag = "1")]
    pub loss_fn_output_type: String,
    #[prost(message, repeated, tag = "2")]
    pub loss_fn_outputs: Vec<ArrayRecord>,
    /// `name:reduction` keys (the SDK splits every key at its one `:`).
    #[prost(map = "string, double", tag = "3")]
    pub metrics: HashMap<String, f64>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Enumeration)]
#[repr(i32)]
pub enum StopReason {
    Stop = 0,
    Length = 1,
}

#[derive(Clone, PartialEq, Message)]
pub struct SampledSequence {
    #[prost(enumeration = "StopReason", tag = "1")]
    pub stop_reason: i32,
    /// int32 little-endian token ids.
    #[prost(bytes = "vec", tag = "2")]
    pub tokens: Vec<u8>,
    /// f32 little-endian logprob of each token.
    #[prost(bytes = "vec", optional, tag = "3")]
    pub logprobs: Option<Vec<u8>>,
}

#[derive(Clone, PartialEq, Message)]
pub struct SampleResponse {
    #[prost(message, repeated, tag = "1")]
    pub sequences: Vec<SampledSequence>,
    /// f32 little-endian per prompt token, NaN where not scored (the first).
    #[prost(bytes = "vec", optional, tag = "2")]
    pub prompt_logprobs: Option<Vec<u8>>,
    #[prost(int32, tag = "4")]
    pub prompt_cache_hit_tokens: i32,
}

/// `values` as little-endian bytes.
pub fn f32_bytes(values: &[f32]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_le_bytes()).collect()
}

/// Token ids as int32 little-endian bytes.
pub fn token_bytes(ids: &[u32]) -> Vec<u8> {
    ids.iter().flat_map(|&t| (t as i32).to_le_bytes()).collect()
}

/// The `ForwardBackwardOutput` of per-datum `logprobs` and `metrics`: one `ArrayRecord`
/// holding a `logprobs` field of every datum in order.
pub fn forward_backward_output(logprobs: &[Vec<f32>], metrics: HashMap<String, f64>) -> ForwardBackwardOutput {
    let mut data = Vec::new();
    let mut offsets = 0i64.to_le_bytes().to_vec();
    for lp in logprobs {
        data.extend(f32_bytes(lp));
        offsets.extend((data.len() as i64).to_le_bytes());
    }
    let field = BatchedTensor { data, offsets, dtype: DType::Float32 as i32, trailing_shape: vec![] };
    ForwardBackwardOutput {
        loss_fn_output_type: "ArrayRecord".into(),
        loss_fn_outputs: vec![ArrayRecord {
            type_tag: "ArrayRecord".into(),
            fields: HashMap::from([("logprobs".to_string(), field)]),
            num_datums: logprobs.len() as i64,
        }],
        metrics,
    }
}
