//! Prometheus metrics through the `metrics` crate, named like vLLM's (`vllm:` → `rlserve:`),
//! units in the names, labelled with `model_name`.

use engine::EngineStats;
use metrics::{counter, gauge, histogram};
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};
use std::sync::OnceLock;
use std::time::Duration;

/// Latency buckets in seconds (vLLM's TTFT buckets).
const BUCKETS: &[f64] =
    &[0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0];

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
                PrometheusBuilder::new()
                    .set_buckets(BUCKETS)
                    .expect("non-empty buckets")
                    .install_recorder()
                    .expect("installing the Prometheus recorder")
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

    /// Engine gauges and counters, refreshed at scrape time.
    pub fn engine(&self, s: &EngineStats) {
        let m = || metrics::Label::new("model_name", self.model.clone());
        gauge!("rlserve:num_requests_running", vec![m()]).set(s.num_running as f64);
        gauge!("rlserve:num_requests_waiting", vec![m()]).set(s.num_waiting as f64);
        gauge!("rlserve:kv_cache_usage_perc", vec![m()])
            .set(1.0 - s.num_free_blocks as f64 / s.num_blocks.max(1) as f64);
        gauge!("rlserve:kv_cache_free_blocks", vec![m()]).set(s.num_free_blocks as f64);
        gauge!("rlserve:policy_version", vec![m()]).set(s.version as f64);
        counter!("rlserve:prefix_cache_queries_total", vec![m()]).absolute(s.prefix_cache_queries);
        counter!("rlserve:prefix_cache_hits_total", vec![m()]).absolute(s.prefix_cache_hits);
        counter!("rlserve:prompt_tokens_total", vec![m()]).absolute(s.prefill_tokens);
        counter!("rlserve:generation_tokens_total", vec![m()]).absolute(s.generation_tokens);
        counter!("rlserve:num_preemptions_total", vec![m()]).absolute(s.num_preemptions);
    }

    /// One training step (a job's or the feedback learner's): every learner metric as a
    /// `rlserve:train_*` gauge, the engine pause and the staleness of every trained token.
    pub fn learner_step(&self, r: &crate::rl::report::StepRecord, samples: &[learner::TrainSample]) {
        let m = || metrics::Label::new("model_name", self.model.clone());
        if r.updated {
            histogram!("rlserve:engine_pause_seconds", vec![m()]).record(r.learner.pause_seconds);
            counter!("rlserve:train_steps_total", vec![m()]).increment(1);
            counter!("rlserve:train_tokens_total", vec![m()]).increment(r.learner.loss.tokens as u64);
        }
        if let Ok(serde_json::Value::Object(o)) = serde_json::to_value(r) {
            for (k, v) in o {
                let x = match v {
                    serde_json::Value::Number(n) => n.as_f64(),
                    serde_json::Value::Bool(b) => Some(b as u8 as f64),
                    _ => None,
                };
                if let Some(x) = x {
                    gauge!(format!("rlserve:train_{k}"), vec![m()]).set(x);
                }
            }
        }
        gauge!("rlserve:entropy_collapse_alarm", vec![m()]).set(r.entropy_collapse as u8 as f64);
        for s in samples {
            if let (Some(v), true) = (s.versions.as_ref().and_then(|v| v.iter().min()), r.updated) {
                let staleness = r.learner.version.saturating_sub(1).saturating_sub(*v) as f64;
                let h = histogram!("rlserve:trained_token_staleness", vec![m()]);
                for _ in 0..s.completion_ids.len() {
                    h.record(staleness);
                }
            }
        }
    }

    /// Feedback counters: (accepted, rejected, trained samples, samples ready).
    pub fn feedback(&self, (accepted, rejected, trained, ready): (u64, u64, u64, usize)) {
        let m = || metrics::Label::new("model_name", self.model.clone());
        counter!("rlserve:feedback_accepted_total", vec![m()]).absolute(accepted);
        counter!("rlserve:feedback_rejected_total", vec![m()]).absolute(rejected);
        counter!("rlserve:feedback_trained_samples_total", vec![m()]).absolute(trained);
        gauge!("rlserve:feedback_samples_ready", vec![m()]).set(ready as f64);
    }

    /// A greedy evaluation of a training job.
    pub fn eval(&self, r: &crate::rl::job::EvalRecord) {
        let m = || metrics::Label::new("model_name", self.model.clone());
        gauge!("rlserve:eval_reward", vec![m()]).set(r.eval_reward);
        if let Some(a) = r.eval_accuracy {
            gauge!("rlserve:eval_accuracy", vec![m()]).set(a);
        }
    }

    pub fn render(&self) -> String {
        self.handle.render()
    }
}
