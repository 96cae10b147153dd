//! Byte-offset spans into a source registered in a [`crate::SourceMap`].

use crate::source::SourceId;

/// A half-open byte range `[lo, hi)` in one source file.
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize,
)]
pub struct Span {
    pub src: SourceId,
    pub lo: u32,
    pub hi: u32,
}

impl Span {
    pub fn new(src: SourceId, lo: u32, hi: u32) -> Self {
        Span { src, lo, hi }
    }

    /// The smallest span covering both (both must be in the same source; `self`'s source wins).
    pub fn to(self, other: Span) -> Span {
        Span {
            src: self.src,
            lo: self.lo.min(other.lo),
            hi: self.hi.max(other.hi),
        }
    }

    pub fn range(self) -> std::ops::Range<usize> {
        self.lo as usize..self.hi as usize
    }
}
