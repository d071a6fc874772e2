//! What completions and chat share: sampling parameters from the request, submitting
//! prompts to the engine, merging their output streams, latency metrics.

use super::error::ApiError;
use super::protocol::Usage;
use super::protocol::{SamplingFields, StreamUsage};
use super::{AppState, InFlight};
use crate::metrics::RequestTimes;
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::IntoResponse;
use engine::outputs::EngineFault;
use engine::sampling::MAX_LOGIT_BIAS;
use engine::{RequestStream, SamplingParams, SeqOutput};
use futures_util::stream::{self, BoxStream, StreamExt};
use serde_json::{json, Value};
use std::convert::Infallible;
use std::sync::Arc;
use std::time::Instant;

/// Builds engine sampling parameters (vLLM defaults where the request is silent). Ranges are
/// checked by the engine; here only what the engine cannot see: `logit_bias` keys that are
/// not token ids.
pub fn sampling_params(
    f: &SamplingFields,
    max_tokens: Option<usize>,
    logprobs: Option<usize>,
) -> Result<SamplingParams, ApiError> {
    let d = SamplingParams::default();
    let logit_bias = f
        .logit_bias
        .iter()
        .flatten()
        .map(|(k, &v)| match k.trim().parse::<u32>() {
            Ok(id) => Ok((id, v.clamp(-MAX_LOGIT_BIAS, MAX_LOGIT_BIAS))),
            Err(_) => Err(ApiError::bad(
                format!("`logit_bias` keys must be token ids (non-negative integers), got {k:?}"),
                Some("logit_bias"),
            )),
        })
        .collect::<Result<Vec<_>, _>>()?;
    if f.stream_options.is_some() && !f.stream() {
        return Err(ApiError::bad("`stream_options` can only be set when `stream` is true", Some("stream_options")));
    }
    if f.prompt_logprobs.is_some() && f.stream() {
        return Err(ApiError::bad("`prompt_logprobs` is not available when `stream` is true", Some("prompt_logprobs")));
    }
    let seed = match f.seed {
        None | Some(-1) => None,
        Some(s) => Some(u64::try_from(s).map_err(|_| {
            ApiError::bad(format!("`seed` must be in [0, 2^64) or -1 (random), got {s}"), Some("seed"))
        })?),
    };
    Ok(SamplingParams {
        n: f.n.unwrap_or(1),
        temperature: f.temperature.unwrap_or(d.temperature),
        top_p: f.top_p.unwrap_or(d.top_p),
        top_k: f.top_k.unwrap_or(d.top_k),
        min_p: f.min_p.unwrap_or(d.min_p),
        repetition_penalty: f.repetition_penalty.unwrap_or(d.repetition_penalty),
        presence_penalty: f.presence_penalty.unwrap_or(d.presence_penalty),
        frequency_penalty: f.frequency_penalty.unwrap_or(d.frequency_penalty),
        seed,
        max_tokens,
        min_tokens: f.min_tokens.unwrap_or(0),
        stop: f.stop.clone().map(|s| s.into_vec()).unwrap_or_default(),
        stop_token_ids: f.stop_token_ids.clone().unwrap_or_default(),
        ignore_eos: f.ignore_eos.unwrap_or(false),
        logprobs,
        prompt_logprobs: f.prompt_logprobs,
        skip_special_tokens: f.skip_special_tokens.unwrap_or(true),
        logit_bias,
    })
}

/// A unique response id with the given prefix (`cmpl-`, `chatcmpl-`).
pub fn response_id(prefix: &str) -> String {
    format!("{prefix}{:032x}", rand::random::<u128>())
}

pub fn unix_now() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0)
}

/// One output event, tagged with the prompt it belongs to.
pub struct Event {
    pub prompt: usize,
    pub out: SeqOutput,
}

/// The merged outputs of all prompts of one HTTP request, plus latency bookkeeping.
pub struct Generation {
    /// Outputs in arrival order; an `Err` means the engine failed one of the prompts (that
    /// prompt's stream ends there), and the response has failed.
    pub events: BoxStream<'static, Result<Event, EngineFault>>,
    pub prompt_lens: Vec<usize>,
    pub n: usize,
    _in_flight: InFlight,
}

/// Admitted requests: one engine stream per prompt, counted in flight until dropped.
pub struct Submitted {
    pub streams: Vec<RequestStream>,
    pub in_flight: InFlight,
}

/// Submits every prompt (each with `params.n` samples), all at once, and waits for the
/// engine to accept them without blocking the runtime. A validation error of any prompt
/// fails the whole request; the already submitted ones are aborted when their streams drop.
pub async fn submit_streams_async(
    state: &Arc<AppState>,
    prompts: Vec<Vec<u32>>,
    params: SamplingParams,
) -> Result<Submitted, ApiError> {
    let in_flight = state.admit()?;
    let streams = state.engine.add_requests_async(prompts, params).await?;
    Ok(Submitted { streams, in_flight })
}

/// Where one prompt's outputs are: the times the per-request metrics are taken from.
#[derive(Default)]
struct Progress {
    /// The earliest admission by the scheduler among the prompt's samples.
    scheduled: Option<Instant>,
    first_token: Option<Instant>,
    last: Option<Instant>,
    /// Tokens generated so far over the `n` samples.
    generated: usize,
}

/// [`submit_streams_async`], merged into one event stream with latency metrics. With
/// feedback learning on, the finished response is kept under `id` for `POST /v1/feedback`.
pub async fn submit(
    state: &Arc<AppState>,
    prompts: Vec<Vec<u32>>,
    params: SamplingParams,
    id: &str,
) -> Result<Generation, ApiError> {
    let n = params.n;
    let prompt_lens: Vec<usize> = prompts.iter().map(Vec::len).collect();
    let lens = prompt_lens.clone();
    let recorder = state.feedback.as_ref().map(|fb| fb.recorder(id, &prompts, &params));
    // The request's arrival: before the engine has it, so its admission is after this.
    let start = Instant::now();
    let Submitted { streams, in_flight } = submit_streams_async(state, prompts, params).await?;
    let metrics = state.metrics.clone();
    let per_prompt = streams.into_iter().enumerate().map(move |(i, s)| {
        let metrics = metrics.clone();
        let prompt_len = lens[i];
        stream::unfold((s, Progress::default()), move |(mut s, mut p)| {
            let metrics = metrics.clone();
            async move {
                let out = match s.recv_item_async().await? {
                    Ok(out) => out,
                    Err(fault) => return Some((Err(fault), (s, p))),
                };
                let now = Instant::now();
                match p.last {
                    None => metrics.ttft(now - start),
                    Some(t) => metrics.itl(now - t),
                }
                p.first_token.get_or_insert(now);
                p.last = Some(now);
                p.generated += out.tokens.len();
                p.scheduled = match (p.scheduled, out.first_scheduled) {
                    (Some(a), Some(b)) => Some(a.min(b)),
                    (a, b) => a.or(b),
                };
                if out.request_finished {
                    metrics.e2e(now - start);
                    if let Some(reason) = out.finish_reason {
                        metrics.request_finished(reason, prompt_len, p.generated);
                    }
                    let scheduled = p.scheduled.unwrap_or(start).max(start);
                    let first_token = p.first_token.unwrap_or(now);
                    metrics.request_times(RequestTimes {
                        queue: scheduled - start,
                        prefill: first_token.saturating_duration_since(scheduled),
                        decode: now - first_token,
                        inference: now - scheduled,
                    });
                }
                Some((Ok(Event { prompt: i, out }), (s, p)))
            }
        })
        .boxed()
    });
    let mut events = stream::select_all(per_prompt).boxed();
    if let Some(mut recorder) = recorder {
        // A failed prompt never finishes, so a failed response is never kept.
        events = events
            .inspect(move |ev: &Result<Event, EngineFault>| {
                if let Ok(ev) = ev {
                    recorder.observe(ev.prompt, &ev.out)
                }
            })
            .boxed();
    }
    Ok(Generation { events, prompt_lens, n, _in_flight: in_flight })
}

impl Generation {
    /// Choice index of sample `index` of prompt `prompt` (prompt-major, as OpenAI).
    pub fn choice(&self, prompt: usize, index: usize) -> usize {
        prompt * self.n + index
    }

    pub fn prompt_tokens(&self) -> usize {
        self.prompt_lens.iter().sum()
    }
}

/// The SSE body of a streamed response: one `data: {chunk}` event per output with content
/// (`on_output(prompt, choice index, output)` builds the choice object or skips it), then a
/// usage chunk when asked, then `data: [DONE]`; keep-alive comments while idle. Dropping the
/// body (client gone) drops the engine streams, which aborts the requests.
///
/// When the engine fails a prompt, the status is already 200, so (as vLLM) the failure is
/// one `data: {"error": {...}}` event (the 500 envelope of [`ApiError`]) followed by
/// `data: [DONE]`: no `finish_reason`, no usage chunk, and the other prompts are aborted.
pub fn sse<E, F>(gen: Generation, usage: StreamUsage, envelope: E, on_output: F) -> impl IntoResponse
where
    E: Fn(Value) -> Value + Send + 'static,
    F: FnMut(usize, usize, &SeqOutput) -> Option<Value> + Send + 'static,
{
    enum Phase {
        Events,
        Usage,
        Done,
        End,
    }
    struct St<E, F> {
        gen: Generation,
        phase: Phase,
        completion_tokens: usize,
        envelope: E,
        on_output: F,
    }
    let st = St { gen, phase: Phase::Events, completion_tokens: 0, envelope, on_output };
    let data = |v: Value| Ok::<_, Infallible>(SseEvent::default().data(v.to_string()));
    let so_far = |st: &St<E, F>| {
        let p = st.gen.prompt_tokens();
        Usage { prompt_tokens: p, completion_tokens: st.completion_tokens, total_tokens: p + st.completion_tokens }
    };
    let body = stream::unfold(st, move |mut st| async move {
        loop {
            match st.phase {
                Phase::Events => match st.gen.events.next().await {
                    Some(Err(fault)) => {
                        st.phase = Phase::Done;
                        // Drops the other prompts' engine streams: their requests are aborted.
                        st.gen.events = stream::empty().boxed();
                        return Some((data(ApiError::from(fault).envelope()), st));
                    }
                    Some(Ok(ev)) => {
                        st.completion_tokens += ev.out.tokens.len();
                        let idx = st.gen.choice(ev.prompt, ev.out.index);
                        if let Some(choice) = (st.on_output)(ev.prompt, idx, &ev.out) {
                            let mut chunk = (st.envelope)(json!([choice]));
                            match usage {
                                StreamUsage::Off => {}
                                StreamUsage::Last => chunk["usage"] = Value::Null,
                                StreamUsage::Continuous => chunk["usage"] = json!(so_far(&st)),
                            }
                            return Some((data(chunk), st));
                        }
                    }
                    None => st.phase = if usage == StreamUsage::Off { Phase::Done } else { Phase::Usage },
                },
                Phase::Usage => {
                    st.phase = Phase::Done;
                    let mut chunk = (st.envelope)(json!([]));
                    chunk["usage"] = json!(so_far(&st));
                    return Some((data(chunk), st));
                }
                Phase::Done => {
                    st.phase = Phase::End;
                    return Some((Ok(SseEvent::default().data("[DONE]")), st));
                }
                Phase::End => return None,
            }
        }
    });
    // UTF-8 said outright (as vLLM's `text/event-stream; charset=utf-8`): a client that
    // decodes by the header alone gets the text right.
    let utf8 = [(axum::http::header::CONTENT_TYPE, "text/event-stream; charset=utf-8")];
    (utf8, Sse::new(body).keep_alive(KeepAlive::default()))
}

/// `finish_reason` as JSON (`null` while running).
/// `return_token_ids` (vLLM's): a choice's (or a streamed chunk's) tokens as `token_ids`,
/// with rlserve's `behavior_logprobs` (μ) and policy `versions` beside them.
pub fn set_token_fields(v: &mut Value, tokens: &[engine::TokenOutput]) {
    v["token_ids"] = json!(tokens.iter().map(|t| t.token_id).collect::<Vec<_>>());
    v["behavior_logprobs"] = json!(tokens.iter().map(|t| t.behavior_logprob).collect::<Vec<_>>());
    v["versions"] = json!(tokens.iter().map(|t| t.version).collect::<Vec<_>>());
}

pub fn finish_json(f: Option<engine::FinishReason>) -> Value {
    f.map(|f| json!(f)).unwrap_or(Value::Null)
}

/// `stop_reason` as JSON: the stop token id, the stop string, or `null`.
pub fn stop_json(s: &Option<engine::StopReason>) -> Value {
    s.as_ref().map(|s| json!(s)).unwrap_or(Value::Null)
}
