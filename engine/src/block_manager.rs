//! The KV block pool's bookkeeping: reference-counted blocks freed in `Drop`, and
//! automatic prefix caching (vLLM APC): a full block is keyed by
//! `hash(parent block hash, its tokens, salt)`, the salt carrying the policy version so KV
//! computed by other weights is never reused.
//!
//! Allocation order (the pool's memory is touched as little as it can be: on the CPU a block
//! never written is untouched memory, whose first write faults pages in, seconds per GiB on
//! some VMs, and with transparent huge pages a whole 2 MiB page per layer at once):
//! 1. the most recently freed block holding no cached content (LIFO: still in cache);
//! 2. a never-used block, lowest id first (so cached content is evicted only when the pool
//!    is full, as in vLLM);
//! 3. the least recently freed cached block, evicting its entry.
//!
//! When the policy version moves on, [`BlockManager::retire_salts_below`] drops the cache
//! entries of older versions (no lookup can hit them again), so their blocks go back to 1.

use std::collections::{HashMap, VecDeque};
use std::hash::{Hash, Hasher};
use std::sync::{Arc, Mutex, MutexGuard};

struct State {
    ref_count: Vec<u32>,
    /// Content hash and salt of a block that is registered in `cached`.
    hash: Vec<Option<(u64, u64)>>,
    cached: HashMap<u64, u32>,
    /// Free blocks holding no cached content, most recently freed last.
    plain: Vec<u32>,
    /// Blocks `next_unused..` have never been handed out.
    next_unused: u32,
    /// Free cached blocks, least recently freed first; an entry is stale unless its
    /// generation equals `generation[id]` (lazy deletion).
    lru: VecDeque<(u32, u64)>,
    generation: Vec<u64>,
    num_free: usize,
    /// Salts below this are retired: never registered again.
    min_salt: u64,
}

impl State {
    fn release(&mut self, id: u32) {
        let i = id as usize;
        self.ref_count[i] -= 1;
        if self.ref_count[i] == 0 {
            self.num_free += 1;
            if self.hash[i].is_some() {
                self.generation[i] += 1;
                self.lru.push_back((id, self.generation[i]));
            } else {
                self.plain.push(id);
            }
        }
    }

    /// Forgets block `i`'s cache entry; a free block moves to `plain`.
    fn uncache(&mut self, i: usize) {
        if let Some((h, _)) = self.hash[i].take() {
            if self.cached.get(&h) == Some(&(i as u32)) {
                self.cached.remove(&h);
            }
            if self.ref_count[i] == 0 {
                self.generation[i] += 1; // its `lru` entry is now stale
                self.plain.push(i as u32);
            }
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
            plain: Vec::new(),
            next_unused: 0,
            lru: VecDeque::new(),
            generation: vec![0; num_blocks],
            num_free: num_blocks,
            min_salt: 0,
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

    /// Takes a free block in the order of the module doc; `None` when all are in use.
    pub fn allocate(&self) -> Option<Block> {
        let mut s = lock(&self.state);
        let id = if let Some(id) = s.plain.pop() {
            id
        } else if (s.next_unused as usize) < self.num_blocks {
            s.next_unused += 1;
            s.next_unused - 1
        } else {
            loop {
                let (id, generation) = s.lru.pop_front()?;
                let i = id as usize;
                if generation == s.generation[i] && s.ref_count[i] == 0 {
                    if let Some((h, _)) = s.hash[i].take() {
                        s.cached.remove(&h);
                    }
                    break id;
                }
            }
        };
        s.ref_count[id as usize] = 1;
        s.num_free -= 1;
        Some(Block { id, state: self.state.clone() })
    }

    /// A prefix-cache hit: a new reference to the block holding content `hash`, if any.
    pub fn lookup(&self, hash: u64) -> Option<Block> {
        let mut s = lock(&self.state);
        let id = *s.cached.get(&hash)?;
        let i = id as usize;
        if s.ref_count[i] == 0 {
            s.generation[i] += 1; // its entry in `lru` is now stale
            s.num_free -= 1;
        }
        s.ref_count[i] += 1;
        Some(Block { id, state: self.state.clone() })
    }

    /// Records that `block` (full, computed) holds content `hash`, computed under `salt`. A
    /// block already cached under that hash is kept; a retired salt is not cached.
    pub fn register(&self, block: &Block, hash: u64, salt: u64) {
        let mut s = lock(&self.state);
        if salt < s.min_salt || s.cached.contains_key(&hash) || s.hash[block.id as usize].is_some() {
            return;
        }
        s.cached.insert(hash, block.id);
        s.hash[block.id as usize] = Some((hash, salt));
    }

    /// Drops every cache entry whose salt is below `salt` (the KV of policy versions older
    /// than the served one: no lookup can hit it again); their free blocks become plain free
    /// blocks, reused before untouched ones. O(cached entries) when `salt` rises, O(1) else.
    pub fn retire_salts_below(&self, salt: u64) {
        let mut s = lock(&self.state);
        if salt <= s.min_salt {
            return;
        }
        s.min_salt = salt;
        let old: Vec<u32> =
            s.cached.values().copied().filter(|&id| s.hash[id as usize].is_some_and(|(_, x)| x < salt)).collect();
        for id in old {
            s.uncache(id as usize);
        }
    }
}
