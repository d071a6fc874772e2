//! The device-runtime seam: everything the CUDA host code asks of the driver goes through
//! here: allocate ([`Runtime::zeros`]), copy host→device, device→host and device→device,
//! launch a named kernel with a grid/block/shared-memory configuration and arguments
//! ([`Runtime::launch`]), the two GEMM calls ([`Runtime::sgemm`], [`Runtime::gemm_bf16`])
//! and stream synchronisation. Two implementations: the driver (cudarc: NVRTC-compiled
//! PTX, cuBLAS, one stream the backend creates) and, with the `cuda-emu` feature, the
//! emulated device ([`super::emu`]: host memory behind bounds-checked handles, the kernels'
//! sources run through the SIMT emulation, a column-major reference GEMM).
//!
//! Copies are bounds-checked here, for both runtimes, before they reach either: a copy past
//! a buffer's end is an error naming the copy, not a driver fault.

use super::compile;
use crate::{DeviceCounters, KernelError, Result};
use cudarc::cublas::CudaBlas;
use cudarc::driver::{CudaContext, CudaFunction, CudaModule, CudaSlice, CudaStream, DeviceRepr, ValidAsZeroBits};
use std::collections::HashMap;
use std::fmt;
use std::mem::ManuallyDrop;
use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

/// Any CUDA-side failure as a [`KernelError::Cuda`].
pub(super) fn cuda_err(e: impl fmt::Debug) -> KernelError {
    KernelError::Cuda(format!("{e:?}"))
}

/// The element types of device buffers (the kernels' pointer parameters; the emulated
/// device checks each pointer argument's type against the kernel's signature).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[cfg_attr(not(feature = "cuda-emu"), allow(dead_code))]
pub(super) enum ElemKind {
    F32,
    F64,
    I32,
    U32,
    U64,
    /// bf16 bits.
    U16,
}

/// An element type of a device buffer.
pub(super) trait Elem: DeviceRepr + ValidAsZeroBits + Copy + Default + Send + Sync + 'static {
    #[cfg_attr(not(feature = "cuda-emu"), allow(dead_code))]
    const KIND: ElemKind;
    /// The buffer as a kernel argument the kernel only reads.
    fn read(b: &DevBuf<Self>) -> Arg<'_>;
    /// The buffer as a kernel argument the kernel may write.
    fn write(b: &mut DevBuf<Self>) -> Arg<'_>;
}

macro_rules! elems {
    ($($t:ty => $kind:ident),+) => {
        /// A buffer the kernel reads.
        pub(super) enum BufRef<'a> { $($kind(&'a DevBuf<$t>)),+ }
        /// A buffer the kernel may write.
        pub(super) enum BufMut<'a> { $($kind(&'a mut DevBuf<$t>)),+ }
        $(impl Elem for $t {
            const KIND: ElemKind = ElemKind::$kind;
            fn read(b: &DevBuf<Self>) -> Arg<'_> { Arg::In(BufRef::$kind(b)) }
            fn write(b: &mut DevBuf<Self>) -> Arg<'_> { Arg::Out(BufMut::$kind(b)) }
        })+
        /// Pushes one argument onto a cudarc launch.
        fn push_driver<'a>(b: &mut cudarc::driver::LaunchArgs<'a>, arg: &'a mut Arg<'_>) {
            use cudarc::driver::PushKernelArg;
            match arg {
                Arg::I32(v) => { b.arg(&*v); }
                Arg::I64(v) => { b.arg(&*v); }
                Arg::F32(v) => { b.arg(&*v); }
                Arg::F64(v) => { b.arg(&*v); }
                Arg::Null(v) => { b.arg(&*v); }
                $(Arg::In(BufRef::$kind(x)) => { let x: &'a DevBuf<$t> = x; b.arg(x.driver()); })+
                $(Arg::Out(BufMut::$kind(x)) => { b.arg(x.driver_mut()); })+
                #[cfg(feature = "cuda-emu")]
                Arg::Emu(..) => unreachable!("an emulated buffer on the driver runtime"),
            }
        }
    };
}
elems!(f32 => F32, f64 => F64, i32 => I32, u32 => U32, u64 => U64, u16 => U16);

/// One kernel argument, in the order of the kernel's signature.
pub(super) enum Arg<'a> {
    I32(i32),
    I64(i64),
    F32(f32),
    F64(f64),
    /// A null pointer (an optional input the kernel does not read).
    Null(u64),
    In(BufRef<'a>),
    Out(BufMut<'a>),
    /// A buffer of a recorded graph replayed on the emulated device: its kind, its memory,
    /// whether the kernel may write it.
    #[cfg(feature = "cuda-emu")]
    Emu(ElemKind, &'a super::emu::EmuBuf, bool),
}

/// A read-only buffer argument.
pub(super) fn r<T: Elem>(b: &DevBuf<T>) -> Arg<'_> {
    T::read(b)
}

/// A written buffer argument.
pub(super) fn w<T: Elem>(b: &mut DevBuf<T>) -> Arg<'_> {
    T::write(b)
}

/// A device buffer of `len` values of `T` (the allocation has at least one element). Dropped,
/// it goes back to its home [`Pool`] for reuse (the runtime's workspace, or, made during a
/// graph capture, the graph's pool); a view's home ([`Runtime::view`]) frees nothing.
pub struct DevBuf<T: Elem> {
    pub(super) inner: ManuallyDrop<BufInner<T>>,
    len: usize,
    home: Arc<Pool>,
}

impl<T: Elem> Drop for DevBuf<T> {
    fn drop(&mut self) {
        // SAFETY: `inner` is taken once, here, and never used again.
        let inner = unsafe { ManuallyDrop::take(&mut self.inner) };
        self.home.give(inner, self.len);
    }
}

/// The workspace: a caching allocator (as PyTorch's) of freed buffers by element type and
/// exact length, so a step that repeats the previous step's shapes (every decode step at a
/// batch size, every learner batch of a shape) allocates nothing after the first. At most
/// [`Pool::cap`] bytes are kept (beyond it a freed buffer is freed); the backend runs one
/// stream, so a buffer freed while queued kernels still read it is only rewritten by work
/// queued after them.
pub(super) struct Pool {
    free: Mutex<HashMap<(ElemKind, usize), Vec<FreeBuf>>>,
    bytes: AtomicU64,
    cap: u64,
    /// A view's home: the buffer whose memory the view is (kept alive; nothing is freed).
    viewed: Option<Arc<dyn std::any::Any + Send + Sync>>,
}

/// A freed `BufInner<T>` (its `T` is the key's element kind).
type FreeBuf = Box<dyn std::any::Any + Send>;

impl Pool {
    fn new(cap: u64) -> Self {
        Self { free: Mutex::new(HashMap::new()), bytes: AtomicU64::new(0), cap, viewed: None }
    }

    /// The home of views of `viewed`'s memory.
    fn view(viewed: Arc<dyn std::any::Any + Send + Sync>) -> Self {
        Self { viewed: Some(viewed), ..Self::new(0) }
    }

    /// A pool without a cap (a graph's: [`GraphPool`]).
    fn unbounded() -> Self {
        Self::new(u64::MAX)
    }

    fn take<T: Elem>(&self, n: usize) -> Option<BufInner<T>> {
        let mut free = self.free.lock().unwrap_or_else(|e| e.into_inner());
        let b = free.get_mut(&(T::KIND, n))?.pop()?;
        self.bytes.fetch_sub((n.max(1) * std::mem::size_of::<T>()) as u64, Ordering::Relaxed);
        Some(*b.downcast::<BufInner<T>>().expect("the key names the element type"))
    }

    fn give<T: Elem>(&self, inner: BufInner<T>, n: usize) {
        if self.viewed.is_some() {
            // The memory is the viewed buffer's: not freed here.
            #[allow(irrefutable_let_patterns)] // without `cuda-emu`, the one variant
            if let BufInner::Driver(s) = inner {
                s.leak();
            }
            return;
        }
        let size = (n.max(1) * std::mem::size_of::<T>()) as u64;
        if self.bytes.fetch_add(size, Ordering::Relaxed) + size > self.cap {
            self.bytes.fetch_sub(size, Ordering::Relaxed);
            return; // dropped: freed
        }
        let mut free = self.free.lock().unwrap_or_else(|e| e.into_inner());
        free.entry((T::KIND, n)).or_default().push(Box::new(inner));
    }
}

pub(super) enum BufInner<T: Elem> {
    Driver(CudaSlice<T>),
    #[cfg(feature = "cuda-emu")]
    Emu(super::emu::EmuBuf),
}

impl<T: Elem> DevBuf<T> {
    /// Values in the buffer.
    pub(super) fn len(&self) -> usize {
        self.len
    }

    fn driver(&self) -> &CudaSlice<T> {
        match &*self.inner {
            BufInner::Driver(s) => s,
            #[cfg(feature = "cuda-emu")]
            BufInner::Emu(_) => unreachable!("an emulated buffer on the driver runtime"),
        }
    }

    fn driver_mut(&mut self) -> &mut CudaSlice<T> {
        match &mut *self.inner {
            BufInner::Driver(s) => s,
            #[cfg(feature = "cuda-emu")]
            BufInner::Emu(_) => unreachable!("an emulated buffer on the driver runtime"),
        }
    }
}

impl<T: Elem> Clone for DevBuf<T> {
    /// A deep copy (cudarc's `CudaSlice::clone` copies on the device).
    fn clone(&self) -> Self {
        let inner = match &*self.inner {
            BufInner::Driver(s) => BufInner::Driver(s.clone()),
            #[cfg(feature = "cuda-emu")]
            BufInner::Emu(b) => BufInner::Emu(b.deep_copy()),
        };
        // A copy of a view is a buffer of its own, freed when dropped (a pool of no capacity).
        let home = if self.home.viewed.is_some() { Arc::new(Pool::new(0)) } else { self.home.clone() };
        Self { inner: ManuallyDrop::new(inner), len: self.len, home }
    }
}

/// `C = α·op(A)·op(B) + β·C` in cuBLAS's column-major terms: `op(A)` is `m × k`, `op(B)`
/// `k × n`, `C` `m × n`; `trans_a` means A is stored `k × m` and read transposed; leading
/// dimensions in elements (the cuBLAS `cublasSgemm` / `cublasGemmEx` contract).
#[derive(Debug, Clone, Copy)]
pub(super) struct GemmArgs {
    pub trans_a: bool,
    pub trans_b: bool,
    pub m: i32,
    pub n: i32,
    pub k: i32,
    pub alpha: f32,
    pub lda: i32,
    pub ldb: i32,
    pub beta: f32,
    pub ldc: i32,
}

/// A kernel launch's geometry (CUDA's grid, block and dynamic shared memory in bytes).
#[derive(Debug, Clone, Copy)]
pub(super) struct LaunchCfg {
    pub grid: (u32, u32, u32),
    pub block: (u32, u32, u32),
    pub smem: u32,
}

/// The driver runtime: context, the backend's own stream, loaded modules, cuBLAS.
pub(super) struct Driver {
    stream: Arc<CudaStream>,
    blas: CudaBlas,
    /// cuBLAS's workspace, set once ([`CUBLAS_WORKSPACE`]).
    _blas_workspace: CudaSlice<u8>,
    modules: HashMap<&'static str, Arc<CudaModule>>,
    functions: Mutex<HashMap<&'static str, CudaFunction>>,
}

/// Bytes of cuBLAS's workspace (its recommendation for Hopper: 32 MiB).
const CUBLAS_WORKSPACE: usize = 32 << 20;

/// Which runtime a device runs on.
pub(super) enum Backend {
    Driver(Driver),
    #[cfg(feature = "cuda-emu")]
    Emu(super::emu::Emu),
}

/// A device's runtime and the counts of what the host asked of it.
pub(super) struct Runtime {
    pub(super) backend: Backend,
    counters: Counters,
    pool: Arc<Pool>,
    gate: Gate,
}

/// The device's one stream is shared by the engine's and the learner's threads: while one
/// thread captures a graph ([`Runtime::capture`]), every other thread's request waits at this
/// gate (work queued by another thread would otherwise land in the graph). A request holds
/// the read side while it is queued; a capture holds the write side from start to end, and
/// the capturing thread's own requests pass by `capturer`.
#[derive(Default)]
struct Gate {
    stream: std::sync::RwLock<()>,
    /// The capturing thread's [`thread_id`], 0 when none.
    capturer: AtomicU64,
    capture: Mutex<Option<Capture>>,
}

/// A capture in progress: the graph pool its buffers come from and go back to, and on the
/// emulated device the recorded work.
struct Capture {
    pool: Arc<Pool>,
    #[cfg(feature = "cuda-emu")]
    ops: Vec<super::emu::Op>,
}

/// This thread's id for the [`Gate`] (`std::thread::ThreadId` has no stable integer form).
fn thread_id() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    thread_local!(static ID: u64 = NEXT.fetch_add(1, Ordering::Relaxed));
    ID.with(|id| *id)
}

/// Passage through the [`Gate`] for one request: the read side for a thread that is not
/// capturing, the capture itself for the capturing thread.
enum Pass<'a> {
    #[allow(dead_code)] // held, never read
    Shared(std::sync::RwLockReadGuard<'a, ()>),
    Capturing(std::sync::MutexGuard<'a, Option<Capture>>),
}

impl Pass<'_> {
    /// The capture in progress, for the capturing thread.
    fn capture(&mut self) -> Option<&mut Capture> {
        match self {
            Pass::Capturing(c) => c.as_mut(),
            Pass::Shared(_) => None,
        }
    }
}

impl Gate {
    fn enter(&self) -> Pass<'_> {
        if self.capturer.load(Ordering::Acquire) == thread_id() {
            return Pass::Capturing(self.capture.lock().unwrap_or_else(|e| e.into_inner()));
        }
        Pass::Shared(self.stream.read().unwrap_or_else(|e| e.into_inner()))
    }
}

/// The buffers graphs are captured with ([`Runtime::capture`]): a capture takes its buffers
/// from here (or from the workspace, moving them here) and gives them back here, so the
/// addresses a graph was captured with stay the graph's. Graphs captured with one pool share
/// its buffers: they must never run at the same time (one stream, replays in turn, each
/// step's outputs read before the next replay), as vLLM's decode graphs share one memory pool.
#[derive(Clone)]
pub struct GraphPool(Arc<Pool>);

impl Default for GraphPool {
    fn default() -> Self {
        Self(Arc::new(Pool::unbounded()))
    }
}

/// Host memory a step plan's upload goes through ([`Runtime::host_staging`]): page-locked
/// (pinned) on a GPU, so the copy is one DMA from it; plain memory on the emulated device.
pub(super) enum HostStaging {
    Driver(cudarc::driver::PinnedHostSlice<u32>),
    #[cfg(feature = "cuda-emu")]
    Emu(Vec<u32>),
}

impl HostStaging {
    fn len(&self) -> usize {
        match self {
            HostStaging::Driver(p) => p.len(),
            #[cfg(feature = "cuda-emu")]
            HostStaging::Emu(v) => v.len(),
        }
    }
}

/// A point in a device's queue of work ([`Runtime::mark`]), for device-side timing.
pub enum Mark {
    /// A CUDA event recorded on the stream (with timing).
    Driver(cudarc::driver::CudaEvent),
    /// The host clock when the emulated device reached the point.
    #[cfg(feature = "cuda-emu")]
    Host(std::time::Instant),
}

/// A captured graph: replayed by [`Runtime::replay`].
pub(super) enum GraphExec {
    Driver(cudarc::driver::CudaGraph),
    #[cfg(feature = "cuda-emu")]
    Emu(Vec<super::emu::Op>),
}

// SAFETY: a `CudaGraph` is used only through `Runtime::replay`, which launches it behind the
// gate (one request at a time per thread; cuGraphLaunch on the backend's stream); the
// emulated ops are plain data.
unsafe impl Send for GraphExec {}
unsafe impl Sync for GraphExec {}

/// Bytes of freed buffers the workspace keeps ([`Pool`]).
const WORKSPACE_CAP: u64 = 1 << 30;

/// Running totals behind [`DeviceCounters`].
#[derive(Default)]
struct Counters {
    htod_copies: AtomicU64,
    htod_bytes: AtomicU64,
    dtoh_copies: AtomicU64,
    dtoh_bytes: AtomicU64,
    allocations: AtomicU64,
    zero_fills: AtomicU64,
    launches: AtomicU64,
    gemms: AtomicU64,
    syncs: AtomicU64,
    graph_launches: AtomicU64,
}

fn bump(c: &AtomicU64, by: u64) {
    c.fetch_add(by, Ordering::Relaxed);
}

/// Errors unless libcuda, libnvrtc and libcublas can be loaded (cudarc's calls would panic
/// without them).
fn check_libraries() -> Result<()> {
    // SAFETY: these only try to dlopen the libraries.
    let present = unsafe {
        [
            ("libcuda", cudarc::driver::sys::is_culib_present()),
            ("libnvrtc", cudarc::nvrtc::sys::is_culib_present()),
            ("libcublas", cudarc::cublas::sys::is_culib_present()),
        ]
    };
    let missing: Vec<&str> = present.iter().filter(|p| !p.1).map(|p| p.0).collect();
    if missing.is_empty() {
        return Ok(());
    }
    Err(KernelError::CudaLibraryMissing(missing.join("/")))
}

impl Driver {
    /// The GPU with this ordinal: a stream of the backend's own (not the legacy default
    /// stream, which cannot be captured into a CUDA graph), its kernels compiled (or read
    /// from the PTX cache) for its architecture, and a cuBLAS handle on that stream.
    pub(super) fn new(ordinal: usize) -> Result<Self> {
        check_libraries()?;
        let ctx = CudaContext::new(ordinal).map_err(cuda_err)?;
        // One stream, ordered: cudarc's per-buffer events (made for several streams) would
        // only add an event record per argument per launch, and waits on events recorded
        // outside a graph capture invalidate the capture.
        // SAFETY: called before any buffer is made; every buffer is used on this one stream.
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx.new_stream().map_err(cuda_err)?;
        let (major, minor) = ctx.compute_capability().map_err(cuda_err)?;
        let mut modules = HashMap::new();
        for (name, ptx) in compile::compile_all(major, minor)? {
            modules.insert(name, ctx.load_module(ptx).map_err(cuda_err)?);
        }
        let blas = CudaBlas::new(stream.clone()).map_err(cuda_err)?;
        // A workspace of cuBLAS's own that never moves: without it cuBLAS may allocate one
        // inside a graph capture (an allocation node; PyTorch sets one for the same reason).
        let mut ws = stream.alloc_zeros::<u8>(CUBLAS_WORKSPACE).map_err(cuda_err)?;
        {
            use cudarc::driver::DevicePtrMut;
            let (ptr, _record) = ws.device_ptr_mut(&stream);
            // SAFETY: the workspace lives as long as the handle (both owned by `Driver`).
            let status =
                unsafe { cudarc::cublas::sys::cublasSetWorkspace_v2(*blas.handle(), ptr as *mut _, CUBLAS_WORKSPACE) };
            if status != cudarc::cublas::sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
                return Err(KernelError::Cuda(format!("cublasSetWorkspace: {status:?}")));
            }
        }
        Ok(Self { stream, blas, _blas_workspace: ws, modules, functions: Mutex::default() })
    }

    /// Kernel `name` of source `file` (looked up once).
    fn function(&self, file: &'static str, name: &'static str) -> Result<CudaFunction> {
        let mut cache = self.functions.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(f) = cache.get(name) {
            return Ok(f.clone());
        }
        let module = self.modules.get(file).ok_or_else(|| KernelError::Cuda(format!("no module {file}")))?;
        let f = module.load_function(name).map_err(cuda_err)?;
        cache.insert(name, f.clone());
        Ok(f)
    }
}

/// The error of a copy that does not fit its buffers.
fn copy_err(what: &str, range: &Range<usize>, len: usize) -> KernelError {
    KernelError::Cuda(format!(
        "{what} of elements {}..{} past the end of a buffer of {len} (out-of-bounds copy)",
        range.start, range.end
    ))
}

impl Runtime {
    pub(super) fn new(backend: Backend) -> Self {
        Self { backend, counters: Counters::default(), pool: Arc::new(Pool::new(WORKSPACE_CAP)), gate: Gate::default() }
    }

    /// A freed buffer of `n` values from the workspace, or a new allocation (counted). During
    /// a capture the buffer comes from (and will go back to) the graph's pool, or from the
    /// workspace; a new allocation there is an error: a graph is captured after an eager
    /// warm-up step of the same shapes, which leaves every buffer it needs in the workspace
    /// (an allocation inside a capture would become the graph's own, freed at each replay).
    fn take_or<T: Elem>(
        &self,
        pass: &mut Pass<'_>,
        n: usize,
        new: impl FnOnce() -> Result<BufInner<T>>,
    ) -> Result<(DevBuf<T>, bool)> {
        let wrap = |inner, pool: &Arc<Pool>| DevBuf { inner: ManuallyDrop::new(inner), len: n, home: pool.clone() };
        if let Some(c) = pass.capture() {
            let inner = c.pool.take::<T>(n).or_else(|| self.pool.take::<T>(n));
            return match inner {
                Some(inner) => Ok((wrap(inner, &c.pool), true)),
                None => Err(KernelError::Cuda(format!(
                    "a graph capture allocated {n} {:?} values that no warm-up step left in the workspace",
                    T::KIND
                ))),
            };
        }
        match self.pool.take::<T>(n) {
            Some(inner) => Ok((wrap(inner, &self.pool), true)),
            None => {
                bump(&self.counters.allocations, 1);
                Ok((wrap(new()?, &self.pool), false))
            }
        }
    }

    /// The error of a request a graph cannot hold.
    fn not_in_capture(what: &str) -> KernelError {
        KernelError::Cuda(format!("{what} during a graph capture (a graph's inputs are uploaded before its replay)"))
    }

    /// Whether this is the emulated device (a host thread per CUDA thread).
    pub(super) fn emulated(&self) -> bool {
        !matches!(self.backend, Backend::Driver(_))
    }

    /// The totals so far.
    pub(super) fn counters(&self) -> DeviceCounters {
        let c = &self.counters;
        let g = |a: &AtomicU64| a.load(Ordering::Relaxed);
        DeviceCounters {
            htod_copies: g(&c.htod_copies),
            htod_bytes: g(&c.htod_bytes),
            dtoh_copies: g(&c.dtoh_copies),
            dtoh_bytes: g(&c.dtoh_bytes),
            allocations: g(&c.allocations),
            zero_fills: g(&c.zero_fills),
            launches: g(&c.launches),
            gemms: g(&c.gemms),
            syncs: g(&c.syncs),
            graph_launches: g(&c.graph_launches),
        }
    }
    /// `n` zeroed values (the driver allocates at least one, as cudarc refuses an empty
    /// allocation; the emulated device exactly `n`, so that any access to an empty buffer
    /// is a memcheck failure).
    pub(super) fn zeros<T: Elem>(&self, n: usize) -> Result<DevBuf<T>> {
        let mut pass = self.gate.enter();
        bump(&self.counters.zero_fills, 1);
        let (mut b, reused) = self.take_or(&mut pass, n, || match &self.backend {
            Backend::Driver(d) => Ok(BufInner::Driver(d.stream.alloc_zeros(n.max(1)).map_err(cuda_err)?)),
            #[cfg(feature = "cuda-emu")]
            Backend::Emu(_) => Ok(BufInner::Emu(super::emu::EmuBuf::zeroed::<T>(n))),
        })?;
        if reused {
            match (&self.backend, &mut *b.inner) {
                (Backend::Driver(d), BufInner::Driver(s)) => d.stream.memset_zeros(s).map_err(cuda_err)?,
                #[cfg(feature = "cuda-emu")]
                (Backend::Emu(_), BufInner::Emu(e)) => match pass.capture() {
                    Some(c) => c.ops.push(super::emu::Op::Fill(e.share(), 0)),
                    None => e.fill(0),
                },
                #[cfg(feature = "cuda-emu")]
                _ => unreachable!("a buffer of another runtime"),
            }
        }
        Ok(b)
    }

    /// `n` values left as the allocator gives them, for an output a kernel writes in full
    /// (no zero fill). The emulated device fills them with `0xFF` bytes (NaN as f32 or f64,
    /// the largest index as u32): a kernel that reads an element it did not write gets NaN
    /// or an out-of-range index, which the tests see (compute-sanitizer's initcheck).
    /// A buffer from the workspace is as its last user left it (on the emulated device
    /// poisoned again).
    pub(super) fn alloc<T: Elem>(&self, n: usize) -> Result<DevBuf<T>> {
        let mut pass = self.gate.enter();
        #[cfg_attr(not(feature = "cuda-emu"), allow(unused_mut))]
        let (mut b, reused) = self.take_or(&mut pass, n, || match &self.backend {
            // SAFETY: the buffer is only read after a kernel or copy has written it (the
            // callers' contract, checked on the emulated device by the poison fill).
            Backend::Driver(d) => Ok(BufInner::Driver(unsafe { d.stream.alloc(n.max(1)) }.map_err(cuda_err)?)),
            #[cfg(feature = "cuda-emu")]
            Backend::Emu(_) => Ok(BufInner::Emu(super::emu::EmuBuf::poisoned::<T>(n))),
        })?;
        #[cfg(feature = "cuda-emu")]
        if let (true, BufInner::Emu(e)) = (reused, &mut *b.inner) {
            e.fill(0xFF);
        }
        let _ = reused;
        Ok(b)
    }

    /// Host values as a new device buffer.
    pub(super) fn htod<T: Elem>(&self, data: &[T]) -> Result<DevBuf<T>> {
        if data.is_empty() {
            return self.zeros(0);
        }
        let mut pass = self.gate.enter();
        if pass.capture().is_some() {
            return Err(Self::not_in_capture("a host→device copy"));
        }
        bump(&self.counters.htod_copies, 1);
        bump(&self.counters.htod_bytes, std::mem::size_of_val(data) as u64);
        let (mut b, reused) = self.take_or(&mut pass, data.len(), || match &self.backend {
            Backend::Driver(d) => Ok(BufInner::Driver(d.stream.clone_htod(data).map_err(cuda_err)?)),
            #[cfg(feature = "cuda-emu")]
            Backend::Emu(_) => Ok(BufInner::Emu(super::emu::EmuBuf::from_host(data))),
        })?;
        if reused {
            Self::write(&self.backend, data, &mut b)?;
        }
        Ok(b)
    }

    /// Host staging of `n` words for [`Self::htod_staged`]: page-locked on a GPU.
    pub(super) fn host_staging(&self, n: usize) -> Result<HostStaging> {
        match &self.backend {
            // SAFETY: u32 is valid for any bits, and every word is written before it is
            // read (`htod_staged` copies only what it just wrote).
            Backend::Driver(d) => {
                Ok(HostStaging::Driver(unsafe { d.stream.context().alloc_pinned::<u32>(n.max(1)) }.map_err(cuda_err)?))
            }
            #[cfg(feature = "cuda-emu")]
            Backend::Emu(_) => Ok(HostStaging::Emu(vec![0; n.max(1)])),
        }
    }

    /// `data` through `staging` into the start of `dst`: one host→device copy. On a GPU the
    /// copy is a DMA from page-locked memory and returns before it ends: the caller writes
    /// `staging` again only after the stream has passed this copy (a step plan's next
    /// upload comes after its step's download, which waits for the stream).
    pub(super) fn htod_staged(&self, staging: &mut HostStaging, data: &[u32], dst: &mut DevBuf<u32>) -> Result<()> {
        if data.len() > dst.len || data.len() > staging.len() {
            return Err(copy_err("host→device copy", &(0..data.len()), dst.len.min(staging.len())));
        }
        if data.is_empty() {
            return Ok(());
        }
        let mut pass = self.gate.enter();
        if pass.capture().is_some() {
            return Err(Self::not_in_capture("a host→device copy"));
        }
        bump(&self.counters.htod_copies, 1);
        bump(&self.counters.htod_bytes, std::mem::size_of_val(data) as u64);
        match (&self.backend, staging, &mut *dst.inner) {
            (Backend::Driver(d), HostStaging::Driver(pinned), BufInner::Driver(s)) => {
                let host = pinned.as_mut_slice().map_err(cuda_err)?;
                host[..data.len()].copy_from_slice(data);
                d.stream.memcpy_htod(&host[..data.len()], &mut s.slice_mut(0..data.len())).map_err(cuda_err)
            }
            #[cfg(feature = "cuda-emu")]
            (Backend::Emu(_), HostStaging::Emu(host), BufInner::Emu(e)) => {
                host[..data.len()].copy_from_slice(data);
                e.write_host(&host[..data.len()]);
                Ok(())
            }
            #[cfg(feature = "cuda-emu")]
            _ => unreachable!("staging or a buffer of another runtime"),
        }
    }

    /// `data` into the start of `b`.
    fn write<T: Elem>(backend: &Backend, data: &[T], b: &mut DevBuf<T>) -> Result<()> {
        match (backend, &mut *b.inner) {
            (Backend::Driver(d), BufInner::Driver(s)) => {
                d.stream.memcpy_htod(data, &mut s.slice_mut(0..data.len())).map_err(cuda_err)
            }
            #[cfg(feature = "cuda-emu")]
            (Backend::Emu(_), BufInner::Emu(e)) => {
                e.write_host(data);
                Ok(())
            }
            #[cfg(feature = "cuda-emu")]
            _ => unreachable!("a buffer of another runtime"),
        }
    }

    /// `len` values of `U` starting `offset` values of `T` into `base`: a buffer sharing
    /// `base`'s memory (kept alive by `keep`, which owns `base`; freeing nothing). `offset · size_of::<T>()` must be
    /// a multiple of `size_of::<U>()`.
    pub(super) fn view<T: Elem, U: Elem>(
        &self,
        base: &DevBuf<T>,
        offset: usize,
        len: usize,
        keep: Arc<dyn std::any::Any + Send + Sync>,
    ) -> Result<DevBuf<U>> {
        let (bytes, size) = (offset * std::mem::size_of::<T>(), std::mem::size_of::<U>());
        if bytes % size != 0 || bytes + len * size > base.len * std::mem::size_of::<T>() {
            return Err(KernelError::Cuda(format!(
                "a view of {len} {:?} values at byte {bytes} does not fit a buffer of {} {:?} values",
                U::KIND,
                base.len,
                T::KIND
            )));
        }
        let inner = match (&self.backend, &*base.inner) {
            (Backend::Driver(d), BufInner::Driver(s)) => {
                use cudarc::driver::DevicePtr;
                let (ptr, _record) = s.device_ptr(&d.stream);
                // SAFETY: the range lies inside `base`'s allocation (checked above), which the
                // view keeps alive; the view is leaked, never freed, when dropped.
                BufInner::Driver(unsafe { d.stream.upgrade_device_ptr::<U>(ptr + bytes as u64, len.max(1)) })
            }
            #[cfg(feature = "cuda-emu")]
            (Backend::Emu(_), BufInner::Emu(e)) => BufInner::Emu(e.view(bytes, len * size)),
            #[cfg(feature = "cuda-emu")]
            _ => unreachable!("a buffer of another runtime"),
        };
        Ok(DevBuf { inner: ManuallyDrop::new(inner), len, home: Arc::new(Pool::view(keep)) })
    }

    /// The buffer's `len` values on the host (waits for the stream).
    pub(super) fn dtoh<T: Elem>(&self, b: &DevBuf<T>) -> Result<Vec<T>> {
        self.dtoh_prefix(b, b.len)
    }

    /// The buffer's first `n` values on the host (waits for the stream).
    pub(super) fn dtoh_prefix<T: Elem>(&self, b: &DevBuf<T>, n: usize) -> Result<Vec<T>> {
        if n > b.len {
            return Err(copy_err("device→host copy", &(0..n), b.len));
        }
        let mut pass = self.gate.enter();
        if pass.capture().is_some() {
            return Err(Self::not_in_capture("a device→host copy"));
        }
        bump(&self.counters.dtoh_copies, 1);
        bump(&self.counters.dtoh_bytes, (n * std::mem::size_of::<T>()) as u64);
        bump(&self.counters.syncs, 1);
        let mut v = match &*b.inner {
            BufInner::Driver(s) => match &self.backend {
                Backend::Driver(d) => d.stream.clone_dtoh(&s.slice(0..n.min(s.len()))).map_err(cuda_err)?,
                #[cfg(feature = "cuda-emu")]
                Backend::Emu(_) => unreachable!("a driver buffer on the emulated device"),
            },
            #[cfg(feature = "cuda-emu")]
            BufInner::Emu(e) => e.to_host::<T>(),
        };
        v.truncate(n);
        Ok(v)
    }

    /// `dst[dst_off..dst_off + n] = src[src_off..src_off + n]` on the device.
    pub(super) fn dtod<T: Elem>(
        &self,
        src: &DevBuf<T>,
        src_off: usize,
        dst: &mut DevBuf<T>,
        dst_off: usize,
        n: usize,
    ) -> Result<()> {
        let (sr, dr) = (src_off..src_off + n, dst_off..dst_off + n);
        if sr.end > src.len {
            return Err(copy_err("device copy read", &sr, src.len));
        }
        if dr.end > dst.len {
            return Err(copy_err("device copy write", &dr, dst.len));
        }
        if n == 0 {
            return Ok(());
        }
        #[cfg_attr(not(feature = "cuda-emu"), allow(unused_mut, unused_variables))]
        let mut pass = self.gate.enter();
        match (&self.backend, &*src.inner, &mut *dst.inner) {
            (Backend::Driver(d), BufInner::Driver(s), BufInner::Driver(t)) => {
                d.stream.memcpy_dtod(&s.slice(sr), &mut t.slice_mut(dr)).map_err(cuda_err)
            }
            #[cfg(feature = "cuda-emu")]
            (Backend::Emu(_), BufInner::Emu(s), BufInner::Emu(t)) => {
                let size = std::mem::size_of::<T>();
                match pass.capture() {
                    Some(c) => c.ops.push(super::emu::Op::Copy {
                        src: s.share(),
                        dst: t.share(),
                        from: src_off * size,
                        to: dst_off * size,
                        bytes: n * size,
                    }),
                    None => t.copy_bytes(s, src_off * size, dst_off * size, n * size),
                }
                Ok(())
            }
            #[cfg(feature = "cuda-emu")]
            _ => unreachable!("buffers of another runtime"),
        }
    }

    /// A new buffer holding `src[range]`.
    pub(super) fn clone_range<T: Elem>(&self, src: &DevBuf<T>, range: Range<usize>) -> Result<DevBuf<T>> {
        let mut out = self.zeros::<T>(range.len())?;
        self.dtod(src, range.start, &mut out, 0, range.len())?;
        Ok(out)
    }

    /// Raises kernel `name`'s dynamic shared memory limit to `bytes` (above the default
    /// 48 KiB a launch must ask for it first, as `cudaFuncSetAttribute` does).
    pub(super) fn set_max_dynamic_smem(&self, file: &'static str, name: &'static str, bytes: u32) -> Result<()> {
        match &self.backend {
            Backend::Driver(d) => {
                use cudarc::driver::sys::CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES;
                let f = d.function(file, name)?;
                f.set_attribute(CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, bytes as i32).map_err(cuda_err)
            }
            #[cfg(feature = "cuda-emu")]
            Backend::Emu(e) => {
                e.set_max_dynamic_smem(name, bytes);
                Ok(())
            }
        }
    }

    /// Launches kernel `name` of source `file` with `args` in the order of its signature.
    pub(super) fn launch(
        &self,
        file: &'static str,
        name: &'static str,
        cfg: LaunchCfg,
        args: &mut [Arg<'_>],
    ) -> Result<()> {
        #[cfg_attr(not(feature = "cuda-emu"), allow(unused_mut, unused_variables))]
        let mut pass = self.gate.enter();
        bump(&self.counters.launches, 1);
        match &self.backend {
            Backend::Driver(d) => {
                let f = d.function(file, name)?;
                let mut b = d.stream.launch_builder(&f);
                for a in args.iter_mut() {
                    push_driver(&mut b, a);
                }
                let cfg = cudarc::driver::LaunchConfig {
                    grid_dim: cfg.grid,
                    block_dim: cfg.block,
                    shared_mem_bytes: cfg.smem,
                };
                // SAFETY: every kernel's argument list is built next to its launch, in the
                // order of the kernel's signature (documented in its .cu header; the emulated
                // device checks each argument's kind against it), with buffers of the sizes
                // it reads (the emulated device checks every access).
                unsafe { b.launch(cfg) }.map(|_| ()).map_err(cuda_err)
            }
            #[cfg(feature = "cuda-emu")]
            Backend::Emu(e) => match pass.capture() {
                Some(c) => {
                    c.ops.push(super::emu::Op::launch(name, cfg, args));
                    Ok(())
                }
                None => e.launch(name, cfg, args),
            },
        }
    }

    /// Records the work this thread queues while `f` runs into a graph instead of running it
    /// (CUDA stream capture, thread-local mode; on the emulated device the requests are
    /// recorded), and returns the graph with `f`'s result. Other threads' requests wait
    /// until the capture ends. Inside `f`: no host↔device copy (an error), buffers only from
    /// `pool` or the workspace (see [`Self::take_or`]); `f`'s work does not run until
    /// [`Self::replay`]. A failed capture (an error from `f` or the driver) returns the error
    /// and leaves no capture behind.
    pub(super) fn capture<R, E: From<KernelError>>(
        &self,
        pool: &GraphPool,
        f: impl FnOnce() -> std::result::Result<R, E>,
    ) -> std::result::Result<(GraphExec, R), E> {
        let me = thread_id();
        if self.gate.capturer.load(Ordering::Acquire) == me {
            return Err(KernelError::Cuda("a graph capture inside a graph capture".into()).into());
        }
        // Waits for other threads' requests in flight; theirs wait for the capture's end.
        let _exclusive = self.gate.stream.write().unwrap_or_else(|e| e.into_inner());
        #[allow(irrefutable_let_patterns)]
        if let Backend::Driver(d) = &self.backend {
            use cudarc::driver::sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL;
            d.stream.begin_capture(CU_STREAM_CAPTURE_MODE_THREAD_LOCAL).map_err(|e| E::from(cuda_err(e)))?;
        }
        *self.gate.capture.lock().unwrap_or_else(|e| e.into_inner()) = Some(Capture {
            pool: pool.0.clone(),
            #[cfg(feature = "cuda-emu")]
            ops: Vec::new(),
        });
        self.gate.capturer.store(me, Ordering::Release);
        let out = f();
        self.gate.capturer.store(0, Ordering::Release);
        #[cfg_attr(not(feature = "cuda-emu"), allow(unused_variables))]
        let capture = self.gate.capture.lock().unwrap_or_else(|e| e.into_inner()).take().expect("this capture");
        let exec = match &self.backend {
            Backend::Driver(d) => {
                use cudarc::driver::sys::CUgraphInstantiate_flags;
                match d.stream.end_capture(CUgraphInstantiate_flags(0)).map_err(cuda_err) {
                    Ok(Some(g)) => Ok(GraphExec::Driver(g)),
                    Ok(None) => Err(KernelError::Cuda("the stream capture returned no graph".into())),
                    Err(e) => Err(e),
                }
            }
            #[cfg(feature = "cuda-emu")]
            Backend::Emu(_) => Ok(GraphExec::Emu(capture.ops)),
        };
        // `f`'s own error first: a failed request also invalidates a driver capture.
        let out = out?;
        Ok((exec.map_err(E::from)?, out))
    }

    /// A [`Mark`] after the work queued on the stream so far (a CUDA event with timing; on
    /// the emulated device, whose requests run when queued, the host clock). Errors inside a
    /// graph capture (the event would be the graph's) or from the driver.
    pub(super) fn mark(&self) -> Result<Mark> {
        #[cfg_attr(not(feature = "cuda-emu"), allow(unused_mut))]
        let mut pass = self.gate.enter();
        if pass.capture().is_some() {
            return Err(Self::not_in_capture("a timing mark"));
        }
        match &self.backend {
            Backend::Driver(d) => {
                use cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT;
                d.stream.record_event(Some(CU_EVENT_DEFAULT)).map(Mark::Driver).map_err(cuda_err)
            }
            #[cfg(feature = "cuda-emu")]
            Backend::Emu(_) => Ok(Mark::Host(std::time::Instant::now())),
        }
    }

    /// Seconds of device time from `start` to `end` (`cuEventElapsedTime`, resolution about
    /// 0.5 µs); waits for the work before `end` (a sync, counted). Errors: marks of two
    /// runtimes, a driver error (also one left by earlier asynchronous work).
    pub(super) fn seconds_between(&self, start: &Mark, end: &Mark) -> Result<f64> {
        bump(&self.counters.syncs, 1);
        match (start, end) {
            (Mark::Driver(a), Mark::Driver(b)) => a.elapsed_ms(b).map(|ms| f64::from(ms) / 1e3).map_err(cuda_err),
            #[cfg(feature = "cuda-emu")]
            (Mark::Host(a), Mark::Host(b)) => Ok(b.saturating_duration_since(*a).as_secs_f64()),
            #[cfg(feature = "cuda-emu")]
            _ => Err(KernelError::Cuda("timing marks of two devices".into())),
        }
    }

    /// Runs a captured graph on the stream (one graph launch).
    pub(super) fn replay(&self, graph: &GraphExec) -> Result<()> {
        let _pass = self.gate.enter();
        bump(&self.counters.graph_launches, 1);
        match (&self.backend, graph) {
            (Backend::Driver(_), GraphExec::Driver(g)) => g.launch().map_err(cuda_err),
            #[cfg(feature = "cuda-emu")]
            (Backend::Emu(e), GraphExec::Emu(ops)) => ops.iter().try_for_each(|op| op.run(e)),
            #[cfg(feature = "cuda-emu")]
            _ => unreachable!("a graph of another runtime"),
        }
    }

    /// f32 SGEMM ([`GemmArgs`]) over device buffers.
    pub(super) fn sgemm(&self, g: &GemmArgs, a: &DevBuf<f32>, b: &DevBuf<f32>, c: &mut DevBuf<f32>) -> Result<()> {
        #[cfg_attr(not(feature = "cuda-emu"), allow(unused_mut, unused_variables))]
        let mut pass = self.gate.enter();
        bump(&self.counters.gemms, 1);
        match &self.backend {
            Backend::Driver(d) => {
                use cudarc::cublas::sys::cublasOperation_t::{CUBLAS_OP_N, CUBLAS_OP_T};
                use cudarc::cublas::{Gemm, GemmConfig};
                let op = |t: bool| if t { CUBLAS_OP_T } else { CUBLAS_OP_N };
                let cfg = GemmConfig {
                    transa: op(g.trans_a),
                    transb: op(g.trans_b),
                    m: g.m,
                    n: g.n,
                    k: g.k,
                    alpha: g.alpha,
                    lda: g.lda,
                    ldb: g.ldb,
                    beta: g.beta,
                    ldc: g.ldc,
                };
                // SAFETY: the dimensions and leading dimensions describe buffers of the sizes
                // the contract's shapes give (checked by ops; the emulated device checks them
                // against the buffers).
                unsafe { d.blas.gemm(cfg, a.driver(), b.driver(), c.driver_mut()) }.map_err(cuda_err)
            }
            #[cfg(feature = "cuda-emu")]
            Backend::Emu(_) => super::emu::gemm(pass.capture().map(|c| &mut c.ops), false, g, a, b, c),
        }
    }

    /// `cublasGemmEx` with A and B in bf16 (`CUDA_R_16BF`), C in f32, f32 compute
    /// (`CUBLAS_COMPUTE_32F`); the layout as [`Self::sgemm`].
    pub(super) fn gemm_bf16(&self, g: &GemmArgs, a: &DevBuf<u16>, b: &DevBuf<u16>, c: &mut DevBuf<f32>) -> Result<()> {
        #[cfg_attr(not(feature = "cuda-emu"), allow(unused_mut, unused_variables))]
        let mut pass = self.gate.enter();
        bump(&self.counters.gemms, 1);
        match &self.backend {
            Backend::Driver(d) => {
                use cudarc::cublas::sys::cublasOperation_t::{CUBLAS_OP_N, CUBLAS_OP_T};
                use cudarc::cublas::sys::{cublasComputeType_t, cublasGemmAlgo_t, cudaDataType_t};
                use cudarc::driver::{DevicePtr, DevicePtrMut};
                let op = |t: bool| if t { CUBLAS_OP_T } else { CUBLAS_OP_N };
                let (alpha, beta) = (g.alpha, g.beta);
                let stream = &d.stream;
                let (ap, _a_in_use) = a.driver().device_ptr(stream);
                let (bp, _b_in_use) = b.driver().device_ptr(stream);
                let (cp, _c_in_use) = c.driver_mut().device_ptr_mut(stream);
                // SAFETY: as `sgemm`; the scalars are f32 as the compute type requires; the
                // records keep the buffers in use until the call is queued.
                unsafe {
                    cudarc::cublas::result::gemm_ex(
                        *d.blas.handle(),
                        op(g.trans_a),
                        op(g.trans_b),
                        g.m,
                        g.n,
                        g.k,
                        (&alpha) as *const f32 as *const _,
                        ap as *const _,
                        cudaDataType_t::CUDA_R_16BF,
                        g.lda,
                        bp as *const _,
                        cudaDataType_t::CUDA_R_16BF,
                        g.ldb,
                        (&beta) as *const f32 as *const _,
                        cp as *mut _,
                        cudaDataType_t::CUDA_R_32F,
                        g.ldc,
                        cublasComputeType_t::CUBLAS_COMPUTE_32F,
                        cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
                    )
                }
                .map_err(cuda_err)
            }
            #[cfg(feature = "cuda-emu")]
            Backend::Emu(_) => super::emu::gemm(pass.capture().map(|c| &mut c.ops), true, g, a, b, c),
        }
    }
}
