//! Results of pure invocations kept for the whole job, by the values of their inputs.
//!
//! A launch already runs identical invocations once (`Dfg::identical_invocations`: a mini-batch's
//! leaves repeat ",", "the", "."). Across mini-batches — and across the steps of a serving
//! session, which see a request's words again and again — the same invocations come back: 48% of
//! the leaves of 64 SST trees repeat one of the batch, 80% of the test set's repeat one of the
//! set. A block invocation whose inputs are all host values (no computed input) and that draws
//! no random numbers is a function of those values, so its results are kept here, keyed like
//! the launch's identical invocations (small values by content, large ones — weights — by
//! buffer), and later launches take them instead of computing them again.
//!
//! Bounded: entries stop being added once they hold the memo's capacity in bytes (an eighth of
//! the memory budget at most; no eviction: a job's first words are its most frequent ones). An
//! entry is a row of its launch's output, not a copy, when every invocation the launch computed
//! has a key: all of them go in, so holding the output holds only rows the memo counts (but at
//! the launch where it fills up); copying each row out cost TreeLSTM-small ~3% of a run. A
//! launch that also computed invocations without a key (a computed input) has its kept rows
//! copied, so that the memo holds none of theirs. `Options::job_memo` (`--no-job-memo`) turns it
//! off.

use std::sync::Mutex;

use tumble_tensor::Tensor;

use crate::intern::WordMap;

/// Default capacity of a [`JobMemo`]: TreeLSTM-large's leaf results (4 KiB a word) for 16k words.
pub const DEFAULT_JOB_MEMO_BYTES: usize = 64 << 20;

/// A kept result: row `row` of `tensor` (a launch's batched output), or the whole tensor.
#[derive(Clone)]
pub(crate) struct KeptResult {
    pub(crate) tensor: Tensor,
    pub(crate) row: Option<u32>,
}

impl KeptResult {
    /// The bytes of the result itself (a row's, not its launch's).
    fn bytes(&self) -> usize {
        let all = self.tensor.len() * self.tensor.dtype().size();
        match (self.row, self.tensor.shape().first()) {
            (Some(_), Some(&rows)) if rows > 0 => all / rows,
            _ => all,
        }
    }
}

/// The keys of a launch's invocations, one after the other in one buffer: a key per invocation
/// in a vector of its own was an allocation per invocation of every launch the memo looks at,
/// and the launch's identical invocations were keyed a second time
/// (`Dfg::identical_invocations` now reads these).
#[derive(Default)]
pub(crate) struct InvocationKeys {
    words: Vec<u64>,
    /// Per invocation, in order: where its key lies in `words`, or `None` (it has none).
    spans: Vec<Option<(u32, u32)>>,
}

impl InvocationKeys {
    pub(crate) fn with_capacity(invocations: usize) -> Self {
        InvocationKeys {
            words: Vec::new(),
            spans: Vec::with_capacity(invocations),
        }
    }

    /// Appends the next invocation's key, which `build` writes at the end of the buffer it is
    /// given; `build` returning false (no key: a computed input) leaves the invocation without one.
    /// Returns what `build` did.
    pub(crate) fn push_with(&mut self, build: impl FnOnce(&mut Vec<u64>) -> bool) -> bool {
        let start = self.words.len();
        let keyed = build(&mut self.words);
        if keyed {
            let end = self.words.len();
            if start == 0 {
                // A launch's keys are mostly alike in length (a block's inputs of one shape):
                // room for the rest at the first one's, instead of doubling (and copying) the
                // buffer while the keys of words of 64 characters come in.
                let rest = self.spans.capacity().saturating_sub(self.spans.len() + 1);
                self.words.reserve(end.saturating_mul(rest));
            }
            self.spans.push(Some((start as u32, (end - start) as u32)));
        } else {
            self.words.truncate(start);
            self.spans.push(None);
        }
        keyed
    }

    /// Invocation `i`'s key, if it has one.
    pub(crate) fn get(&self, i: usize) -> Option<&[u64]> {
        let (start, len) = (*self.spans.get(i)?)?;
        self.words
            .get(start as usize..start as usize + len as usize)
    }

    pub(crate) fn len(&self) -> usize {
        self.spans.len()
    }

    /// Each invocation's key, in order.
    pub(crate) fn iter(&self) -> impl Iterator<Item = Option<&[u64]>> + '_ {
        (0..self.spans.len()).map(|i| self.get(i))
    }
}

#[derive(Default)]
struct Entries {
    /// (block, input key) → the invocation's results, one per block output.
    results: WordMap<Vec<u64>, Box<[KeptResult]>>,
    /// Tensors keyed by buffer identity, held so that no other tensor can take their buffer's
    /// address while a key names it (by buffer id).
    pinned: WordMap<usize, Tensor>,
    bytes: usize,
}

/// Invocations looked at before deciding whether a block's invocations repeat enough to keep.
const TRIAL_INVOCATIONS: u64 = 256;

/// What a job has learned of a block's invocations.
#[derive(Clone, Copy)]
enum Trial {
    /// Invocations looked at so far, and how many repeated one (kept, or earlier in their
    /// launch); and invocations in launches none of which could be keyed (a computed input).
    Open {
        seen: u64,
        repeats: u64,
        unkeyed: u64,
    },
    /// Decided: look them up (at least one in eight repeated), or not.
    Decided(bool),
}

/// One job's kept results (see the module doc).
pub(crate) struct JobMemo {
    entries: Mutex<Entries>,
    capacity: usize,
    /// Per block: a block whose first [`TRIAL_INVOCATIONS`] invocations repeat fewer than one
    /// in eight (inputs that are instance data, a float vector per character) stops being
    /// looked up for the job: its keys, hashing and copied rows would only cost.
    trials: Mutex<WordMap<u32, Trial>>,
}

impl Default for JobMemo {
    fn default() -> Self {
        JobMemo::with_capacity(DEFAULT_JOB_MEMO_BYTES)
    }
}

impl JobMemo {
    pub(crate) fn with_capacity(capacity: usize) -> JobMemo {
        JobMemo {
            entries: Mutex::new(Entries::default()),
            capacity,
            trials: Mutex::default(),
        }
    }

    /// What the job has decided for `block` (see [`JobMemo::trials`]): `None` while on trial
    /// (look its invocations up and count their repeats for [`JobMemo::record`]), else whether
    /// to look them up.
    pub(crate) fn trial(&self, block: u32) -> Option<bool> {
        match self.trials.lock().ok()?.get(&block) {
            Some(Trial::Decided(d)) => Some(*d),
            _ => None,
        }
    }

    /// Counts `seen` invocations of `block`, `repeats` of which repeated an earlier one; decides
    /// once [`TRIAL_INVOCATIONS`] were seen.
    pub(crate) fn record(&self, block: u32, seen: usize, repeats: usize) {
        self.on_trial(block, |e| {
            if let Trial::Open {
                seen: s,
                repeats: r,
                unkeyed,
            } = *e
            {
                let (s, r) = (s + seen as u64, r + repeats as u64);
                *e = if s >= TRIAL_INVOCATIONS {
                    Trial::Decided(r * 8 >= s)
                } else {
                    Trial::Open {
                        seen: s,
                        repeats: r,
                        unkeyed,
                    }
                };
            }
        });
    }

    /// Counts `n` invocations of `block` in a launch none of which could be keyed: a block
    /// whose first [`TRIAL_INVOCATIONS`] such invocations come before any keyed one (an RNN step
    /// merged with its input transform, every invocation reading the state) stops being looked
    /// at; once a keyed one was seen (a first step from a constant state), only keyed ones
    /// count.
    pub(crate) fn record_unkeyed(&self, block: u32, n: usize) {
        self.on_trial(block, |e| {
            if let Trial::Open {
                seen: 0, unkeyed, ..
            } = e
            {
                *unkeyed += n as u64;
                if *unkeyed >= TRIAL_INVOCATIONS {
                    *e = Trial::Decided(false);
                }
            }
        });
    }

    /// `f` on `block`'s trial, a fresh one the first time.
    fn on_trial(&self, block: u32, f: impl FnOnce(&mut Trial)) {
        if let Ok(mut t) = self.trials.lock() {
            f(t.entry(block).or_insert(Trial::Open {
                seen: 0,
                repeats: 0,
                unkeyed: 0,
            }));
        }
    }

    /// The results kept under each key (`None` where there are none), looked up under one lock.
    pub(crate) fn lookup(&self, keys: &InvocationKeys) -> Vec<Option<Box<[KeptResult]>>> {
        let Ok(e) = self.entries.lock() else {
            return vec![None; keys.len()];
        };
        if e.results.is_empty() {
            return vec![None; keys.len()];
        }
        keys.iter()
            .map(|k| k.and_then(|k| e.results.get(k).cloned()))
            .collect()
    }

    /// Keeps `results` under `key` while there is room; `pinned` are the tensors the key names
    /// by buffer identity.
    pub(crate) fn insert(&self, key: &[u64], results: Box<[KeptResult]>, pinned: &[Tensor]) {
        let bytes: usize = results.iter().map(KeptResult::bytes).sum::<usize>() + key.len() * 8;
        let Ok(mut e) = self.entries.lock() else {
            return;
        };
        // Under a memory budget, at most an eighth of it, and never what the budget cannot spare:
        // kept results are an optimization, never the reason a run stops.
        let capacity = tumble_limits::limit().map_or(self.capacity, |l| self.capacity.min(l / 8));
        if e.bytes + bytes > capacity
            || e.results.contains_key(key)
            || tumble_limits::reserve(bytes).is_err()
        {
            return;
        }
        for t in pinned {
            e.pinned.entry(t.buffer_id()).or_insert_with(|| t.clone());
        }
        e.bytes += bytes;
        e.results.insert(key.to_vec(), results);
    }

    /// Drops every entry and what it learned of each block (the next launches compute
    /// everything again).
    pub(crate) fn clear(&self) {
        if let Ok(mut e) = self.entries.lock() {
            *e = Entries::default();
        }
        if let Ok(mut t) = self.trials.lock() {
            t.clear();
        }
    }

    /// Entries kept, and their bytes.
    #[cfg(test)]
    pub(crate) fn size(&self) -> (usize, usize) {
        self.entries
            .lock()
            .map_or((0, 0), |e| (e.results.len(), e.bytes))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn keys(each: &[Option<&[u64]>]) -> InvocationKeys {
        let mut keys = InvocationKeys::default();
        for k in each {
            let keyed = keys.push_with(|w| match k {
                Some(k) => {
                    w.extend_from_slice(k);
                    true
                }
                None => {
                    // Words written for an invocation without a key are dropped.
                    w.push(99);
                    false
                }
            });
            assert_eq!(keyed, k.is_some());
        }
        keys
    }

    #[test]
    fn invocation_keys_lie_one_after_the_other() {
        let k = keys(&[Some(&[1, 2, 3]), None, Some(&[]), Some(&[4])]);
        assert_eq!(k.len(), 4);
        let got: Vec<Option<Vec<u64>>> = k.iter().map(|k| k.map(<[u64]>::to_vec)).collect();
        assert_eq!(
            got,
            [Some(vec![1, 2, 3]), None, Some(vec![]), Some(vec![4])]
        );
        assert_eq!(k.get(4), None);
    }

    fn row(v: f32) -> Box<[KeptResult]> {
        vec![KeptResult {
            tensor: Tensor::from_f32(vec![1, 4], vec![v; 4]).expect("a tensor"),
            row: None,
        }]
        .into_boxed_slice()
    }

    #[test]
    fn keeps_results_until_full_and_never_replaces_one() {
        // Each entry: 16 bytes of results and a two-word key.
        let memo = JobMemo::with_capacity(3 * (16 + 16));
        let weight = Tensor::from_f32(vec![100], vec![0.5; 100]).expect("a tensor");
        for k in 0..5u64 {
            memo.insert(&[7, k], row(k as f32), std::slice::from_ref(&weight));
        }
        assert_eq!(
            memo.size(),
            (3, 96),
            "past its capacity the memo keeps nothing more"
        );
        memo.insert(&[7, 0], row(9.0), &[]);
        let got = memo.lookup(&keys(&[Some(&[7, 0]), Some(&[7, 4]), None]));
        let first = got[0]
            .as_ref()
            .and_then(|r| r[0].tensor.as_f32().map(|d| d[0]));
        assert_eq!(first, Some(0.0), "an entry is never replaced");
        assert!(got[1].is_none() && got[2].is_none());
        // The weight a key names by identity is held by the memo.
        assert_eq!(weight.holders(), 2);
        // A row of a launch's output counts its own bytes, not the launch's.
        let memo = JobMemo::with_capacity(1 << 20);
        let out = Tensor::from_f32(vec![10, 4], vec![1.0; 40]).expect("a tensor");
        let kept = |r| {
            vec![KeptResult {
                tensor: out.clone(),
                row: Some(r),
            }]
            .into_boxed_slice()
        };
        memo.insert(&[1], kept(3), &[]);
        memo.insert(&[2], kept(4), &[]);
        assert_eq!(memo.size(), (2, 2 * (16 + 8)));
    }

    #[test]
    fn blocks_whose_invocations_rarely_repeat_stop_being_looked_up() {
        let memo = JobMemo::default();
        memo.record(1, 200, 0);
        assert_eq!(memo.trial(1), None, "still on trial");
        memo.record(1, 100, 30);
        assert_eq!(memo.trial(1), Some(false), "30 repeats in 300 invocations");
        memo.record(1, 1000, 1000);
        assert_eq!(memo.trial(1), Some(false), "a decision stands");
        memo.record(2, 300, 40);
        assert_eq!(memo.trial(2), Some(true), "40 repeats in 300");
        memo.clear();
        assert_eq!(memo.trial(1), None, "a cleared memo tries again");
        // Launches none of whose invocations could be keyed: off once 256 came before any
        // keyed one; after a keyed one, they do not count.
        memo.record_unkeyed(3, 200);
        assert_eq!(memo.trial(3), None);
        memo.record_unkeyed(3, 56);
        assert_eq!(memo.trial(3), Some(false), "never keyed");
        memo.record(4, 8, 8);
        memo.record_unkeyed(4, 10_000);
        assert_eq!(
            memo.trial(4),
            None,
            "a first step from a constant state was keyed"
        );
        memo.record(4, 248, 40);
        assert_eq!(
            memo.trial(4),
            Some(true),
            "48 repeats in 256 keyed invocations"
        );
    }
}
