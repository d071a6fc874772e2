//! The engine loop on its own thread, fed by a `flume` channel (DESIGN-NOTES §5). The
//! public API: [`EngineHandle::add_request`] → a [`RequestStream`] of [`SeqOutput`]s,
//! [`EngineHandle::abort`], [`EngineHandle::stats`]. Dropping a stream before it finishes
//! aborts the request, which frees its KV blocks at once.

use crate::engine::{EngineStats, LLMEngine};
use crate::outputs::SeqOutput;
use crate::sampling::SamplingParams;
use crate::validation::ValidationError;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;

enum Command {
    Add {
        request_id: String,
        prompt: Vec<u32>,
        params: SamplingParams,
        out: flume::Sender<SeqOutput>,
        reply: flume::Sender<Result<(), ValidationError>>,
    },
    Abort(String),
    Stats(flume::Sender<EngineStats>),
}

/// A cloneable handle to the engine thread. The thread ends when the last handle is dropped.
#[derive(Clone)]
pub struct EngineHandle {
    tx: flume::Sender<Command>,
    next_id: Arc<AtomicU64>,
    thread: Arc<JoinHandle<()>>,
}

/// The outputs of one request, in order; ends after the output with `request_finished`.
pub struct RequestStream {
    pub request_id: String,
    rx: flume::Receiver<SeqOutput>,
    tx: flume::Sender<Command>,
    done: bool,
}

/// The engine thread is gone (it panicked or was shut down).
#[derive(Debug, thiserror::Error)]
#[error("the engine thread has stopped")]
pub struct EngineStopped;

/// Why a request was not accepted.
#[derive(Debug, thiserror::Error)]
pub enum AddError {
    #[error(transparent)]
    Invalid(#[from] ValidationError),
    #[error(transparent)]
    Stopped(#[from] EngineStopped),
}

impl RequestStream {
    /// The next output (blocking); `None` after the last one.
    pub fn recv(&mut self) -> Option<SeqOutput> {
        if self.done {
            return None;
        }
        let o = self.rx.recv().ok()?;
        self.done = o.request_finished;
        Some(o)
    }

    /// The next output (async, for the server); `None` after the last one.
    pub async fn recv_async(&mut self) -> Option<SeqOutput> {
        if self.done {
            return None;
        }
        let o = self.rx.recv_async().await.ok()?;
        self.done = o.request_finished;
        Some(o)
    }

    /// Collects every remaining output.
    pub fn collect(mut self) -> Vec<SeqOutput> {
        std::iter::from_fn(|| self.recv()).collect()
    }
}

impl Drop for RequestStream {
    fn drop(&mut self) {
        if !self.done {
            let _ = self.tx.send(Command::Abort(self.request_id.clone()));
        }
    }
}

impl EngineHandle {
    /// Starts the engine loop on a new thread.
    pub fn spawn(engine: LLMEngine) -> Self {
        let (tx, rx) = flume::unbounded();
        let thread = std::thread::Builder::new()
            .name("rlserve-engine".into())
            .spawn(move || run(engine, rx))
            .expect("spawning the engine thread");
        Self { tx, next_id: Arc::new(AtomicU64::new(0)), thread: Arc::new(thread) }
    }

    /// Submits a request; the engine validates it before accepting.
    pub fn add_request(&self, prompt: Vec<u32>, params: SamplingParams) -> Result<RequestStream, AddError> {
        let request_id = format!("req-{}", self.next_id.fetch_add(1, Ordering::Relaxed));
        self.add_request_with_id(request_id, prompt, params)
    }

    /// Like [`Self::add_request`] with a caller-chosen id (unique among running requests).
    pub fn add_request_with_id(
        &self,
        request_id: String,
        prompt: Vec<u32>,
        params: SamplingParams,
    ) -> Result<RequestStream, AddError> {
        let (out, rx) = flume::unbounded();
        let (reply, answer) = flume::bounded(1);
        self.tx
            .send(Command::Add { request_id: request_id.clone(), prompt, params, out, reply })
            .map_err(|_| EngineStopped)?;
        answer.recv().map_err(|_| EngineStopped)??;
        Ok(RequestStream { request_id, rx, tx: self.tx.clone(), done: false })
    }

    /// Aborts a request; its blocks are freed before the next step.
    pub fn abort(&self, request_id: &str) {
        let _ = self.tx.send(Command::Abort(request_id.into()));
    }

    pub fn stats(&self) -> Result<EngineStats, EngineStopped> {
        let (tx, rx) = flume::bounded(1);
        self.tx.send(Command::Stats(tx)).map_err(|_| EngineStopped)?;
        rx.recv().map_err(|_| EngineStopped)
    }

    /// Whether the engine thread is still running.
    pub fn is_alive(&self) -> bool {
        !self.thread.is_finished()
    }
}

fn run(mut engine: LLMEngine, rx: flume::Receiver<Command>) {
    let mut streams: HashMap<String, flume::Sender<SeqOutput>> = HashMap::new();
    loop {
        // Block while idle; otherwise take what has arrived and step.
        if !engine.has_unfinished() {
            match rx.recv() {
                Ok(cmd) => handle(&mut engine, &mut streams, cmd),
                Err(_) => return,
            }
        }
        while let Ok(cmd) = rx.try_recv() {
            handle(&mut engine, &mut streams, cmd);
        }
        if !engine.has_unfinished() {
            continue;
        }
        match engine.step() {
            Ok(outputs) => {
                for o in outputs {
                    let finished = o.request_finished;
                    let gone = streams.get(&o.request_id).is_none_or(|tx| tx.send(o.clone()).is_err());
                    if finished || gone {
                        streams.remove(&o.request_id);
                    }
                    if gone && !finished {
                        engine.abort(&o.request_id);
                    }
                }
            }
            Err(e) => {
                // A model error is a bug, not a client's fault: fail every request, keep serving.
                eprintln!("engine step failed: {e}");
                for id in streams.keys().cloned().collect::<Vec<_>>() {
                    engine.abort(&id);
                }
                streams.clear();
            }
        }
    }
}

fn handle(engine: &mut LLMEngine, streams: &mut HashMap<String, flume::Sender<SeqOutput>>, cmd: Command) {
    match cmd {
        Command::Add { request_id, prompt, params, out, reply } => {
            let r = engine.add_request(&request_id, prompt, params);
            if r.is_ok() {
                streams.insert(request_id, out);
            }
            let _ = reply.send(r);
        }
        Command::Abort(id) => {
            engine.abort(&id);
            streams.remove(&id);
        }
        Command::Stats(tx) => {
            let _ = tx.send(engine.stats());
        }
    }
}
