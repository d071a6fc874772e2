//! The KV block pool's bookkeeping: reference-counted blocks freed in `Drop`, and
//! automatic prefix caching (vLLM APC): a full block is keyed by
//! `hash(parent block hash, its tokens, salt)`, the salt carrying the policy version so KV
//! computed by other weights is never reused. Unreferenced cached blocks stay reusable
//! until evicted, least recently freed first.

use std::collections::{HashMap, VecDeque};
use std::hash::{Hash, Hasher};
use std::sync::{Arc, Mutex, MutexGuard};

struct State {
    ref_count: Vec<u32>,
    /// Content hash of a block that is registered in `cached`.
    hash: Vec<Option<u64>>,
    cached: HashMap<u64, u32>,
    /// Blocks with `ref_count == 0`, least recently freed first; an entry is stale unless
    /// its generation equals `generation[id]` (lazy deletion).
    free: VecDeque<(u32, u64)>,
    generation: Vec<u64>,
    num_free: usize,
}

impl State {
    fn release(&mut self, id: u32) {
        let i = id as usize;
        self.ref_count[i] -= 1;
        if self.ref_count[i] == 0 {
            self.generation[i] += 1;
            self.free.push_back((id, self.generation[i]));
            self.num_free += 1;
        }
    }
}

/// Allocator of `num_blocks` blocks of `block_size` token slots.
#[derive(Clone)]
pub struct BlockManager {
    state: Arc<Mutex<State>>,
    block_size: usize,
    num_blocks: usize,
}

/// A reference to one block; dropping the last reference frees it (RAII: no path leaks one).
pub struct Block {
    id: u32,
    state: Arc<Mutex<State>>,
}

fn lock(s: &Mutex<State>) -> MutexGuard<'_, State> {
    // The state stays consistent even if a holder panicked: every update is a few stores.
    s.lock().unwrap_or_else(|e| e.into_inner())
}

impl Block {
    pub fn id(&self) -> u32 {
        self.id
    }
}

impl Clone for Block {
    fn clone(&self) -> Self {
        lock(&self.state).ref_count[self.id as usize] += 1;
        Block { id: self.id, state: self.state.clone() }
    }
}

impl Drop for Block {
    fn drop(&mut self) {
        lock(&self.state).release(self.id);
    }
}

impl std::fmt::Debug for Block {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Block({})", self.id)
    }
}

/// The hash of a full block: `hash(parent, tokens, salt)` (SipHash with fixed keys, so
/// stable within a process).
pub fn block_hash(parent: Option<u64>, tokens: &[u32], salt: u64) -> u64 {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    parent.hash(&mut h);
    tokens.hash(&mut h);
    salt.hash(&mut h);
    h.finish()
}

impl BlockManager {
    pub fn new(num_blocks: usize, block_size: usize) -> Self {
        assert!(num_blocks > 0 && block_size > 0 && num_blocks <= u32::MAX as usize);
        let state = State {
            ref_count: vec![0; num_blocks],
            hash: vec![None; num_blocks],
            cached: HashMap::new(),
            free: (0..num_blocks as u32).map(|i| (i, 0)).collect(),
            generation: vec![0; num_blocks],
            num_free: num_blocks,
        };
        Self { state: Arc::new(Mutex::new(state)), block_size, num_blocks }
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    pub fn num_blocks(&self) -> usize {
        self.num_blocks
    }

    /// Blocks with no reference (free or cached-but-unused).
    pub fn num_free(&self) -> usize {
        lock(&self.state).num_free
    }

    /// Takes the least recently freed block, evicting its cache entry; `None` when all are in use.
    pub fn allocate(&self) -> Option<Block> {
        let mut s = lock(&self.state);
        while let Some((id, generation)) = s.free.pop_front() {
            let i = id as usize;
            if generation != s.generation[i] || s.ref_count[i] != 0 {
                continue;
            }
            if let Some(h) = s.hash[i].take() {
                if s.cached.get(&h) == Some(&id) {
                    s.cached.remove(&h);
                }
            }
            s.ref_count[i] = 1;
            s.num_free -= 1;
            return Some(Block { id, state: self.state.clone() });
        }
        None
    }

    /// A prefix-cache hit: a new reference to the block holding content `hash`, if any.
    pub fn lookup(&self, hash: u64) -> Option<Block> {
        let mut s = lock(&self.state);
        let id = *s.cached.get(&hash)?;
        let i = id as usize;
        if s.ref_count[i] == 0 {
            s.generation[i] += 1; // its entry in `free` is now stale
            s.num_free -= 1;
        }
        s.ref_count[i] += 1;
        Some(Block { id, state: self.state.clone() })
    }

    /// Records that `block` (full, computed) holds content `hash`. A block already cached
    /// under that hash is kept.
    pub fn register(&self, block: &Block, hash: u64) {
        let mut s = lock(&self.state);
        if s.cached.contains_key(&hash) || s.hash[block.id as usize].is_some() {
            return;
        }
        s.cached.insert(hash, block.id);
        s.hash[block.id as usize] = Some(hash);
    }
}
