//! A set of a frame's slots, a bit each: the drops pass's liveness and the verifier's
//! definedness both walk a function's code with one.

/// Slots `0..capacity` a bit each (the capacity rounded up to a word of 64). A slot past the
/// words is never inserted (a slot out of its frame is the verifier's range check's to report,
/// and the drops pass never drops one it never saw read): a corrupt slot number cannot make the
/// set allocate.
#[derive(Clone, Default, PartialEq, Eq, Debug)]
pub struct SlotSet {
    words: Vec<u64>,
}

impl SlotSet {
    /// The empty set of a frame of `capacity` slots.
    pub fn new(capacity: usize) -> SlotSet {
        SlotSet {
            words: vec![0; capacity.div_ceil(64)],
        }
    }

    pub fn insert(&mut self, s: u32) {
        if let Some(w) = self.words.get_mut((s / 64) as usize) {
            *w |= 1 << (s % 64);
        }
    }

    pub fn remove(&mut self, s: u32) {
        if let Some(w) = self.words.get_mut((s / 64) as usize) {
            *w &= !(1 << (s % 64));
        }
    }

    pub fn contains(&self, s: u32) -> bool {
        self.words
            .get((s / 64) as usize)
            .is_some_and(|w| w & (1 << (s % 64)) != 0)
    }

    /// Adds `other`'s slots (its capacity too, where larger).
    pub fn union(&mut self, other: &SlotSet) {
        if self.words.len() < other.words.len() {
            self.words.resize(other.words.len(), 0);
        }
        for (w, o) in self.words.iter_mut().zip(&other.words) {
            *w |= o;
        }
    }

    /// Keeps the slots in both.
    pub fn meet(&mut self, other: &SlotSet) {
        for (k, w) in self.words.iter_mut().enumerate() {
            *w &= other.words.get(k).copied().unwrap_or(0);
        }
    }

    /// The slots in `self` and not in `other`, in increasing order.
    pub fn minus<'a>(&'a self, other: &'a SlotSet) -> impl Iterator<Item = u32> + 'a {
        self.words.iter().enumerate().flat_map(move |(i, &w)| {
            let w = w & !other.words.get(i).copied().unwrap_or(0);
            (0..64u32)
                .filter(move |b| w & (1 << b) != 0)
                .map(move |b| i as u32 * 64 + b)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::SlotSet;

    #[test]
    fn the_operations_agree_with_a_plain_set_past_one_word() {
        let mut a = SlotSet::new(130);
        let mut b = SlotSet::new(70);
        for s in [0, 63, 64, 129] {
            a.insert(s);
        }
        for s in [63, 65] {
            b.insert(s);
        }
        // Past the words (130 slots take three): ignored.
        a.insert(192);
        a.insert(u32::MAX);
        assert!(!a.contains(192) && !a.contains(u32::MAX));
        assert_eq!(a.minus(&b).collect::<Vec<_>>(), vec![0, 64, 129]);
        let mut u = b.clone();
        u.union(&a);
        assert_eq!(
            u.minus(&SlotSet::new(0)).collect::<Vec<_>>(),
            vec![0, 63, 64, 65, 129]
        );
        let mut m = a.clone();
        m.meet(&b);
        assert_eq!(m.minus(&SlotSet::new(0)).collect::<Vec<_>>(), vec![63]);
        a.remove(64);
        assert!(!a.contains(64) && a.contains(63));
    }
}
