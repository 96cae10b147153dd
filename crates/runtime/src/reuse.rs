//! Parameter reuse (ACROBAT §5.1): which block inputs are the same value for every invocation in a
//! launch (derived only from model parameters and constants), so they are passed once, never gathered.

use tumble_compile::Program;

/// Per block, per input: shared by every invocation?
#[derive(Debug, Clone, Default)]
pub struct Reuse {
    pub shared: Vec<Vec<bool>>,
}

impl Reuse {
    /// No input is known to be shared (the runtime still detects identical inputs at launch).
    pub fn none(program: &Program) -> Reuse {
        Reuse {
            shared: program
                .blocks
                .iter()
                .map(|b| vec![false; b.inputs.len()])
                .collect(),
        }
    }

    pub fn is_shared(&self, block: u32, input: usize) -> bool {
        self.shared
            .get(block as usize)
            .and_then(|v| v.get(input))
            .copied()
            .unwrap_or(false)
    }
}
