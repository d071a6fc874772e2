//! Prometheus metrics through the `metrics` crate, named like vLLM's (`vllm:` → `rlserve:`),
//! units in the names, labelled with `model_name`. This module installs the exporter and
//! records the HTTP and engine series; the `rl` crate records its own (training steps,
//! evaluations, feedback) through the same facade.

use engine::EngineStats;
use metrics::{counter, gauge, histogram};
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};
use std::sync::OnceLock;
use std::time::Duration;

/// Latency buckets in seconds (vLLM's TTFT buckets).
const BUCKETS: &[f64] =
    &[0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0];

/// Token-count buckets of the per-request histograms (vLLM's 1-2-5 series, to a million).
const TOKEN_BUCKETS: &[f64] =
    &[1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0, 1e3, 2e3, 5e3, 1e4, 2e4, 5e4, 1e5, 2e5, 5e5, 1e6];

/// Every fixed series' `# HELP` text (vLLM's wording where it has the series), this crate's
/// and the `rl` crate's. The learner's per-step `rlserve:train_*` gauges are named after
/// `StepMetrics`' keys and go without one.
const HELP: &[(&str, &str)] = &[
    ("rlserve:num_requests_running", "Number of requests in model execution batches."),
    ("rlserve:num_requests_waiting", "Number of requests waiting to be processed."),
    ("rlserve:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage."),
    ("rlserve:kv_cache_free_blocks", "KV-cache blocks free (neither in use nor cached)."),
    ("rlserve:policy_version", "Version of the served weights: +1 per optimizer update."),
    ("rlserve:prefix_cache_queries_total", "Prefix cache queries, in terms of number of queried tokens."),
    ("rlserve:prefix_cache_hits_total", "Prefix cache hits, in terms of number of cached tokens."),
    ("rlserve:prompt_tokens_total", "Number of prefill tokens processed."),
    ("rlserve:generation_tokens_total", "Number of generation tokens processed."),
    ("rlserve:num_preemptions_total", "Cumulative number of preemptions from the engine."),
    ("rlserve:time_to_first_token_seconds", "Histogram of time to first token in seconds."),
    ("rlserve:inter_token_latency_seconds", "Histogram of inter-token latency in seconds."),
    ("rlserve:e2e_request_latency_seconds", "Histogram of end-to-end request latency in seconds."),
    ("rlserve:request_success_total", "Count of successfully processed requests."),
    ("rlserve:request_prompt_tokens", "Number of prefill tokens processed."),
    ("rlserve:request_generation_tokens", "Number of generation tokens processed."),
    ("rlserve:request_queue_time_seconds", "Histogram of time spent in WAITING phase for request."),
    ("rlserve:request_prefill_time_seconds", "Histogram of time spent in PREFILL phase for request."),
    ("rlserve:request_decode_time_seconds", "Histogram of time spent in DECODE phase for request."),
    ("rlserve:request_inference_time_seconds", "Histogram of time spent in RUNNING phase for request."),
    ("rlserve:engine_pause_seconds", "Seconds the engine waited for each optimizer update's write."),
    ("rlserve:train_steps_total", "Learner steps taken by training jobs and the feedback learner."),
    ("rlserve:train_tokens_total", "Tokens the learner's losses were taken over."),
    ("rlserve:trained_token_staleness", "Policy versions between each trained token's sampling and its update."),
    ("rlserve:entropy_collapse_alarm", "1 while the job's policy entropy has collapsed below its alarm fraction."),
    ("rlserve:eval_reward", "Mean reward of the job's last evaluation."),
    ("rlserve:eval_accuracy", "Accuracy of the job's last evaluation (a verifiable reward)."),
    ("rlserve:feedback_accepted_total", "Feedback ratings accepted."),
    ("rlserve:feedback_rejected_total", "Feedback ratings rejected."),
    ("rlserve:feedback_trained_samples_total", "Feedback samples the learner has trained on."),
    ("rlserve:feedback_samples_ready", "Feedback samples waiting for the next learner batch."),
];

/// The phases of one finished engine request (vLLM's per-request intervals): `queue` from
/// arrival to the scheduler's first admission, `prefill` from there to the first token,
/// `decode` from the first token to the last, `inference` = prefill + decode.
#[derive(Debug, Clone, Copy)]
pub struct RequestTimes {
    pub queue: Duration,
    pub prefill: Duration,
    pub decode: Duration,
    pub inference: Duration,
}

/// The process-wide recorder (installed once) and this server's `model_name` label.
#[derive(Clone)]
pub struct Metrics {
    handle: PrometheusHandle,
    model: String,
}

impl Metrics {
    pub fn new(model_name: &str) -> Self {
        static HANDLE: OnceLock<PrometheusHandle> = OnceLock::new();
        let handle = HANDLE
            .get_or_init(|| {
                let handle = PrometheusBuilder::new()
                    .set_buckets(BUCKETS)
                    .and_then(|b| {
                        let tokens = ["rlserve:request_prompt_tokens", "rlserve:request_generation_tokens"];
                        tokens
                            .into_iter()
                            .try_fold(b, |b, name| b.set_buckets_for_metric(Matcher::Full(name.into()), TOKEN_BUCKETS))
                    })
                    .expect("non-empty buckets")
                    .install_recorder()
                    .expect("installing the Prometheus recorder");
                // The exporter keeps one description per name, whatever the series' kind.
                for &(name, help) in HELP {
                    metrics::describe_gauge!(name, help);
                }
                handle
            })
            .clone();
        Metrics { handle, model: model_name.to_string() }
    }

    pub fn ttft(&self, d: Duration) {
        histogram!("rlserve:time_to_first_token_seconds", "model_name" => self.model.clone()).record(d.as_secs_f64());
    }

    pub fn itl(&self, d: Duration) {
        histogram!("rlserve:inter_token_latency_seconds", "model_name" => self.model.clone()).record(d.as_secs_f64());
    }

    pub fn e2e(&self, d: Duration) {
        histogram!("rlserve:e2e_request_latency_seconds", "model_name" => self.model.clone()).record(d.as_secs_f64());
    }

    /// One engine request (a prompt with its `n` samples) that finished: vLLM's
    /// `request_success_total` by `finished_reason` (`stop` or `length`; an aborted one
    /// never gets here) and its prompt and generated token counts.
    pub fn request_finished(&self, reason: engine::FinishReason, prompt_tokens: usize, generation_tokens: usize) {
        let reason = match reason {
            engine::FinishReason::Stop => "stop",
            engine::FinishReason::Length => "length",
            engine::FinishReason::Abort => "abort",
        };
        counter!("rlserve:request_success_total", "model_name" => self.model.clone(), "finished_reason" => reason)
            .increment(1);
        histogram!("rlserve:request_prompt_tokens", "model_name" => self.model.clone()).record(prompt_tokens as f64);
        histogram!("rlserve:request_generation_tokens", "model_name" => self.model.clone())
            .record(generation_tokens as f64);
    }

    /// One finished engine request's phases: vLLM's `request_{queue,prefill,decode,inference}_time_seconds`.
    pub fn request_times(&self, t: RequestTimes) {
        let m = || self.model.clone();
        histogram!("rlserve:request_queue_time_seconds", "model_name" => m()).record(t.queue.as_secs_f64());
        histogram!("rlserve:request_prefill_time_seconds", "model_name" => m()).record(t.prefill.as_secs_f64());
        histogram!("rlserve:request_decode_time_seconds", "model_name" => m()).record(t.decode.as_secs_f64());
        histogram!("rlserve:request_inference_time_seconds", "model_name" => m()).record(t.inference.as_secs_f64());
    }

    /// Engine gauges and counters, refreshed at scrape time.
    pub fn engine(&self, s: &EngineStats) {
        let m = || metrics::Label::new("model_name", self.model.clone());
        gauge!("rlserve:num_requests_running", vec![m()]).set(s.num_running as f64);
        gauge!("rlserve:num_requests_waiting", vec![m()]).set(s.num_waiting as f64);
        gauge!("rlserve:kv_cache_usage_perc", vec![m()]).set(s.kv_cache_usage());
        gauge!("rlserve:kv_cache_free_blocks", vec![m()]).set(s.num_free_blocks as f64);
        gauge!("rlserve:policy_version", vec![m()]).set(s.version as f64);
        counter!("rlserve:prefix_cache_queries_total", vec![m()]).absolute(s.prefix_cache_queries);
        counter!("rlserve:prefix_cache_hits_total", vec![m()]).absolute(s.prefix_cache_hits);
        counter!("rlserve:prompt_tokens_total", vec![m()]).absolute(s.prefill_tokens);
        counter!("rlserve:generation_tokens_total", vec![m()]).absolute(s.generation_tokens);
        counter!("rlserve:num_preemptions_total", vec![m()]).absolute(s.num_preemptions);
    }

    pub fn render(&self) -> String {
        self.handle.render()
    }
}
