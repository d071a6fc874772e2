//! The engine loop on its own thread, fed by a `flume` channel (DESIGN-NOTES §5). The
//! public API: [`EngineHandle::add_request`] (blocking, for threads) or
//! [`EngineHandle::add_request_async`] / [`EngineHandle::add_requests_async`] (for async
//! code; the latter queues a request's prompts together) → a [`RequestStream`] of
//! [`StreamItem`]s, [`EngineHandle::abort`], [`EngineHandle::stats`]. Dropping a stream
//! before it finishes aborts the request, which frees its KV blocks at once.
//!
//! A failed engine step ([`StepError`]) ends each request it had scheduled with one
//! `Err(`[`EngineFault`]`)` item; the other requests go on.

use crate::engine::{EngineStats, LLMEngine, StepError};
use crate::outputs::{EngineFault, SeqOutput};
use crate::sampling::SamplingParams;
use crate::validation::ValidationError;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::JoinHandle;

/// One item of a request's stream: an output, or the fault that ended the request (always
/// the last item).
pub type StreamItem = Result<SeqOutput, EngineFault>;

enum Command {
    /// The prompts of one client request, queued together: the engine takes them in one go,
    /// so they are admitted in the same step (never a step of one before the other arrives).
    Add(Vec<Add>),
    Abort(String),
}

/// A request's stream and the channel of the engine's answer to it (accepted or rejected).
type Submitted = (RequestStream, flume::Receiver<Result<(), ValidationError>>);

/// One prompt of a [`Command::Add`].
struct Add {
    request_id: String,
    prompt: Vec<u32>,
    params: Box<SamplingParams>,
    out: flume::Sender<StreamItem>,
    reply: flume::Sender<Result<(), ValidationError>>,
}

/// A cloneable handle to the engine thread. The thread ends when the last handle is dropped.
#[derive(Clone)]
pub struct EngineHandle {
    tx: flume::Sender<Command>,
    next_id: Arc<AtomicU64>,
    /// The engine's counters, published by the engine thread after each step and before it
    /// waits for work, so reading them never waits for a step.
    stats: Arc<Mutex<EngineStats>>,
    thread: Arc<JoinHandle<()>>,
}

/// The outputs of one request, in order; ends after the output with `request_finished`, or
/// after an `Err` item when the engine could not finish the request.
pub struct RequestStream {
    pub request_id: String,
    rx: flume::Receiver<StreamItem>,
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
    /// The next item (blocking): an output, or the fault that ended the request; `None`
    /// after the last one. A stream whose engine thread died ends with a fault too, never
    /// silently.
    pub fn recv_item(&mut self) -> Option<StreamItem> {
        if self.done {
            return None;
        }
        let item = self.rx.recv();
        Some(self.take(item))
    }

    /// [`Self::recv_item`] for async code: waits without blocking the runtime's thread.
    pub async fn recv_item_async(&mut self) -> Option<StreamItem> {
        if self.done {
            return None;
        }
        let item = self.rx.recv_async().await;
        Some(self.take(item))
    }

    /// Collects every remaining output (blocking), or the fault that ended the request.
    pub fn collect(mut self) -> Result<Vec<SeqOutput>, EngineFault> {
        std::iter::from_fn(|| self.recv_item()).collect()
    }

    fn take(&mut self, item: Result<StreamItem, flume::RecvError>) -> StreamItem {
        // The engine drops a stream's sender only after its last item: a disconnect before
        // that means the engine thread is gone.
        let item = item.unwrap_or_else(|_| Err(EngineFault(EngineStopped.to_string())));
        self.done = item.as_ref().map_or(true, |o| o.request_finished);
        item
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
        let stats = Arc::new(Mutex::new(engine.stats()));
        let published = stats.clone();
        let thread = std::thread::Builder::new()
            .name("rlserve-engine".into())
            .spawn(move || run(engine, rx, published))
            .expect("spawning the engine thread");
        Self { tx, next_id: Arc::new(AtomicU64::new(0)), stats, thread: Arc::new(thread) }
    }

    /// Submits a request; the engine validates it before accepting. Blocks until the engine
    /// thread has taken it (up to one engine step): async code uses
    /// [`Self::add_request_async`].
    pub fn add_request(&self, prompt: Vec<u32>, params: SamplingParams) -> Result<RequestStream, AddError> {
        self.add_request_with_id(self.new_id(), prompt, params)
    }

    /// Like [`Self::add_request`] with a caller-chosen id (unique among running requests).
    pub fn add_request_with_id(
        &self,
        request_id: String,
        prompt: Vec<u32>,
        params: SamplingParams,
    ) -> Result<RequestStream, AddError> {
        let (mut stream, answer) = self.submit(vec![(request_id, prompt)], params)?.pop().expect("one stream");
        Self::accepted(&mut stream, answer.recv())?;
        Ok(stream)
    }

    /// [`Self::add_request`] for async code: waits for the engine's answer without blocking
    /// the runtime's thread. Dropping the future before it resolves aborts the request.
    pub async fn add_request_async(&self, prompt: Vec<u32>, params: SamplingParams) -> Result<RequestStream, AddError> {
        Ok(self.add_requests_async(vec![prompt], params).await?.pop().expect("one stream"))
    }

    /// The prompts of one client request (OpenAI's `prompt` list), each its own engine
    /// request with `params`, sent to the engine thread together so that they are admitted
    /// in the same step. Waits for every answer; the first rejection fails the whole call
    /// (the accepted ones are aborted as their streams drop).
    pub async fn add_requests_async(
        &self,
        prompts: Vec<Vec<u32>>,
        params: SamplingParams,
    ) -> Result<Vec<RequestStream>, AddError> {
        let submitted = self.submit(prompts.into_iter().map(|p| (self.new_id(), p)).collect(), params)?;
        let (mut streams, mut first_error) = (Vec::with_capacity(submitted.len()), Ok(()));
        for (mut stream, answer) in submitted {
            first_error = first_error.and(Self::accepted(&mut stream, answer.recv_async().await));
            streams.push(stream);
        }
        first_error.map(|()| streams)
    }

    fn new_id(&self) -> String {
        format!("req-{}", self.next_id.fetch_add(1, Ordering::Relaxed))
    }

    /// Sends the requests to the engine thread in one command (never blocks: the channel is
    /// unbounded); returns each one's stream and answer channel. The streams exist from here
    /// on, so dropping one (or a future holding it) aborts its request.
    fn submit(
        &self,
        requests: Vec<(String, Vec<u32>)>,
        params: SamplingParams,
    ) -> Result<Vec<Submitted>, EngineStopped> {
        let (mut adds, mut submitted) = (Vec::new(), Vec::new());
        for (request_id, prompt) in requests {
            let (out, rx) = flume::unbounded();
            let (reply, answer) = flume::bounded(1);
            submitted
                .push((RequestStream { request_id: request_id.clone(), rx, tx: self.tx.clone(), done: false }, answer));
            adds.push(Add { request_id, prompt, params: Box::new(params.clone()), out, reply });
        }
        if self.tx.send(Command::Add(adds)).is_err() {
            // Never queued: nothing to abort.
            submitted.iter_mut().for_each(|(s, _)| s.done = true);
            return Err(EngineStopped);
        }
        Ok(submitted)
    }

    /// Applies the engine's answer to a submitted request. A rejected request was never
    /// queued: its stream must not send an abort (the id may belong to another request).
    fn accepted(
        stream: &mut RequestStream,
        answer: Result<Result<(), ValidationError>, flume::RecvError>,
    ) -> Result<(), AddError> {
        let r = answer.map_err(|_| AddError::Stopped(EngineStopped)).and_then(|r| r.map_err(AddError::Invalid));
        if r.is_err() {
            stream.done = true;
        }
        r
    }

    /// Aborts a request; its blocks are freed before the next step. Its stream, if still
    /// read, ends with a fault saying so.
    pub fn abort(&self, request_id: &str) {
        let _ = self.tx.send(Command::Abort(request_id.into()));
    }

    /// The engine's counters as of its last step (or of the last request it took while
    /// idle). Never waits for the engine thread.
    pub fn stats(&self) -> Result<EngineStats, EngineStopped> {
        if !self.is_alive() {
            return Err(EngineStopped);
        }
        Ok(self.stats.lock().unwrap_or_else(PoisonError::into_inner).clone())
    }

    /// Whether the engine thread is still running.
    pub fn is_alive(&self) -> bool {
        !self.thread.is_finished()
    }
}

type Streams = HashMap<String, flume::Sender<StreamItem>>;

fn run(mut engine: LLMEngine, rx: flume::Receiver<Command>, stats: Arc<Mutex<EngineStats>>) {
    let mut streams = Streams::new();
    let publish = |engine: &LLMEngine| *stats.lock().unwrap_or_else(PoisonError::into_inner) = engine.stats();
    loop {
        // Block while idle; otherwise take what has arrived and step.
        if !engine.has_unfinished() {
            publish(&engine);
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
        let step = engine.step();
        // Before the outputs go out: a client that reads the stats after its last output
        // sees its blocks freed.
        publish(&engine);
        match step {
            Ok(outputs) => deliver(&mut engine, &mut streams, outputs),
            Err(e) => fail(&mut streams, e),
        }
    }
}

fn deliver(engine: &mut LLMEngine, streams: &mut Streams, outputs: Vec<SeqOutput>) {
    for o in outputs {
        let finished = o.request_finished;
        let id = o.request_id.clone();
        let gone = streams.get(&id).is_none_or(|tx| tx.send(Ok(o)).is_err());
        if finished || gone {
            streams.remove(&id);
        }
        if gone && !finished {
            engine.abort(&id);
        }
    }
}

/// A failed step: its requests are already aborted by the engine; each of their streams
/// gets the fault as its last item. The other requests go on.
fn fail(streams: &mut Streams, e: StepError) {
    eprintln!("rlserve engine: {e}; aborted {} request(s): {}", e.requests.len(), e.requests.join(", "));
    let fault = EngineFault(format!("{e}; the request was aborted"));
    for id in &e.requests {
        if let Some(tx) = streams.remove(id) {
            let _ = tx.send(Err(fault.clone()));
        }
    }
}

fn handle(engine: &mut LLMEngine, streams: &mut Streams, cmd: Command) {
    match cmd {
        Command::Add(adds) => {
            for Add { request_id, prompt, params, out, reply } in adds {
                let r = engine.add_request(&request_id, prompt, *params);
                if r.is_ok() {
                    streams.insert(request_id, out);
                }
                let _ = reply.send(r);
            }
        }
        Command::Abort(id) => {
            engine.abort(&id);
            if let Some(tx) = streams.remove(&id) {
                let _ = tx.send(Err(EngineFault(format!("request {id} was aborted by the server"))));
            }
        }
    }
}
