//! The static optimizations of ACROBAT §4.1/§5.1 run over a lowered program, in order: hoisting
//! (marks sites), ghost operators (which count only non-hoisted sites), automatic phases. Each is
//! switchable; what each found is reported for `tumble explain`.

use crate::ghosts::GhostSite;
use crate::program::Program;

/// Which static optimizations run.
#[derive(Debug, Clone, Copy)]
pub struct StaticOptions {
    pub hoist: bool,
    pub ghosts: bool,
    pub phases: bool,
}

impl StaticOptions {
    pub fn all() -> Self {
        StaticOptions {
            hoist: true,
            ghosts: true,
            phases: true,
        }
    }

    pub fn none() -> Self {
        StaticOptions {
            hoist: false,
            ghosts: false,
            phases: false,
        }
    }
}

/// What the static optimizations found and did.
#[derive(Debug, Clone, Default)]
pub struct StaticReport {
    /// Sites marked hoisted (indices into `Program::sites`).
    pub hoisted: Vec<u32>,
    /// Conditionals padded with ghost operators.
    pub ghosts: Vec<GhostSite>,
    /// Automatic phase boundaries: before which element of the entry's top-level `let` chain.
    pub phases: Vec<usize>,
}

pub fn optimize(program: &mut Program, entry: &str, opts: StaticOptions) -> StaticReport {
    let mut report = StaticReport::default();
    if opts.hoist {
        let h = crate::hoist::analyze(program, entry);
        for (i, site) in program.sites.iter_mut().enumerate() {
            site.hoisted = h.hoisted.get(i).copied().unwrap_or(false);
            if site.hoisted {
                report.hoisted.push(i as u32);
            }
        }
    }
    if opts.ghosts {
        report.ghosts = crate::ghosts::insert(program);
    }
    if opts.phases {
        report.phases = crate::phases::insert(program, entry);
    }
    report
}
