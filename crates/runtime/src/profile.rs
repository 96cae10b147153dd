//! What a batched run did and where its time went (ACROBAT Table 6's breakdown).

use std::collections::BTreeMap;
use std::fmt;
use std::time::Duration;

use crate::batched::OpStats;
use crate::fused::FusedStats;

#[derive(Default, Debug, Clone)]
pub struct BlockStats {
    pub launches: u64,
    pub invocations: u64,
    pub max_batch: u64,
    /// Time in this block's kernels (gathering its inputs not included).
    pub kernels: std::time::Duration,
}

impl BlockStats {
    /// `o`'s launches, invocations and kernel time added to these; the larger largest batch.
    pub fn add(&mut self, o: &BlockStats) {
        self.launches += o.launches;
        self.invocations += o.invocations;
        self.max_batch = self.max_batch.max(o.max_batch);
        self.kernels += o.kernels;
    }
}

#[derive(Default, Debug, Clone)]
pub struct Profile {
    pub instances: u64,
    pub mini_batches: u64,
    /// Dataflow nodes recorded (block invocations that were deferred).
    pub nodes: u64,
    /// Block invocations run on the host at once because every input was known and small.
    pub host_invocations: u64,
    /// Invocations of two-term `add` blocks kept as deferred sums (sum fusion), and the terms of
    /// the sums read by launches.
    pub sums: u64,
    pub sum_terms: u64,
    /// Times an invocation's launch waited one level for more of its kind (`Options::defer`).
    pub deferred: u64,
    /// Ragged launches (invocations of different `?` lengths together), the rows their
    /// row-wise segments ran over in all, and the kernel calls of their mixing segments (one
    /// per group of equal length).
    pub ragged_launches: u64,
    pub ragged_rows: u64,
    /// Padding rows the row-wise segments computed and dropped (`Options::ragged_padding`).
    pub ragged_padding_rows: u64,
    pub ragged_groups: u64,
    /// Time in the mixing segments (groups of equal length, attention kernels and row slices
    /// alike), a part of the kernels' time.
    pub time_ragged_mixing: Duration,
    /// Mixing segments run as one attention kernel over every invocation of their launch.
    pub ragged_attention: u64,
    /// Mixing segments that were whole-row slices, taken as ranges of rows where they lie.
    pub ragged_row_slices: u64,
    /// Mixing segments that took rows of every invocation's table where it lies.
    pub ragged_gathers: u64,
    /// Mixing segments that were a query against every invocation's rows where they lie.
    pub ragged_queries: u64,
    /// The largest bytes of segment results one ragged launch held at once.
    pub ragged_peak_bytes: u64,
    pub launches: u64,
    /// Times the instances all stopped (done or waiting for a value) and the graph was evaluated.
    pub flushes: u64,
    pub per_block: BTreeMap<String, BlockStats>,
    pub ops: OpStats,
    pub fused: FusedStats,
    /// Launch inputs the analysis marked shared but that differed between invocations (gathered).
    pub reuse_misses: u64,
    /// Launch inputs passed once for the whole batch.
    pub shared_inputs: u64,
    /// Launch inputs that were already one contiguous batch (no copy).
    pub zero_copy_inputs: u64,
    /// Launch inputs stacked by copying rows.
    pub gathered_inputs: u64,
    /// Launch inputs passed as lists of rows where they lie (gather fusion).
    pub row_list_inputs: u64,
    /// Peak bytes of launch outputs held at once in a mini-batch (until the mini-batch ends, or
    /// their early release).
    pub activation_bytes: u64,
    /// Launch outputs placed in buffers recycled from earlier ones (`tumble_tensor::pool`).
    pub pooled_outputs: u64,
    /// Scans of the host's values for early release (see `dfg/release.rs`).
    pub release_scans: u64,
    /// Invocations that took the results of an identical one in their launch instead of
    /// computing their own (`Dfg::identical_invocations`).
    pub memoized: u64,
    /// Invocations that took the results an earlier launch of the job computed
    /// ([`crate::memo`]).
    pub job_memoized: u64,
    pub time_program: Duration,
    /// Evaluation steps of the instances' host programs (`time_program` is spent on them).
    pub host_steps: u64,
    pub time_dfg: Duration,
    pub time_schedule: Duration,
    pub time_gather: Duration,
    pub time_kernels: Duration,
    /// A launch's bookkeeping around its gather and kernels: the keys of identical invocations,
    /// each invocation's output slots stored on its node, the inputs it consumed let go and the
    /// outputs no one reads any more released; and the scans of the host's values for early
    /// release. (Untimed before the twenty-sixth session, it was most of `other`.)
    pub time_outputs: Duration,
    /// Time inside mini-batches, summed over them (so over workers too).
    pub time_total: Duration,
    /// Decoding the mini-batches' instances into values (`load`) and encoding their results
    /// (`finish`), inside the job's wall time but outside the mini-batches' own
    /// ([`crate::run_batches`]).
    pub time_decode: Duration,
    pub time_encode: Duration,
    /// The whole job's wall time when its mini-batches ran through [`crate::workers`] (zero: the
    /// profile of mini-batches run directly, whose wall time is `time_total`).
    pub time_wall: Duration,
    /// Mini-batches run at once, and kernel threads of each (zero when not run as a job).
    pub workers: u64,
    pub kernel_threads: u64,
}

impl Profile {
    /// Counts a launch of `invocations` invocations of block `block` whose kernels took
    /// `kernels`.
    pub(crate) fn record_launch(
        &mut self,
        block: &str,
        invocations: usize,
        kernels: std::time::Duration,
    ) {
        self.time_kernels += kernels;
        self.launches += 1;
        let st = match self.per_block.get_mut(block) {
            Some(st) => st,
            None => self.per_block.entry(block.to_string()).or_default(),
        };
        st.launches += 1;
        st.invocations += invocations as u64;
        st.max_batch = st.max_batch.max(invocations as u64);
        st.kernels += kernels;
    }

    /// The blocks whose names `keep` accepts, their figures added up (a block's parts after a
    /// split, `name:op` blocks of one function).
    pub fn blocks_where(&self, keep: impl Fn(&str) -> bool) -> BlockStats {
        let mut sum = BlockStats::default();
        for (_, s) in self.per_block.iter().filter(|(name, _)| keep(name)) {
            sum.add(s);
        }
        sum
    }

    pub fn add(&mut self, o: &Profile) {
        self.instances += o.instances;
        self.mini_batches += o.mini_batches;
        self.nodes += o.nodes;
        self.host_invocations += o.host_invocations;
        self.sums += o.sums;
        self.sum_terms += o.sum_terms;
        self.deferred += o.deferred;
        self.ragged_launches += o.ragged_launches;
        self.ragged_rows += o.ragged_rows;
        self.ragged_padding_rows += o.ragged_padding_rows;
        self.ragged_groups += o.ragged_groups;
        self.time_ragged_mixing += o.time_ragged_mixing;
        self.ragged_attention += o.ragged_attention;
        self.ragged_row_slices += o.ragged_row_slices;
        self.ragged_gathers += o.ragged_gathers;
        self.ragged_queries += o.ragged_queries;
        self.ragged_peak_bytes = self.ragged_peak_bytes.max(o.ragged_peak_bytes);
        self.launches += o.launches;
        self.flushes += o.flushes;
        for (k, v) in &o.per_block {
            self.per_block.entry(k.clone()).or_default().add(v);
        }
        self.ops.batched += o.ops.batched;
        self.ops.looped += o.ops.looped;
        self.ops.shared += o.ops.shared;
        self.ops.kept_fused += o.ops.kept_fused;
        self.fused.dense_stages += o.fused.dense_stages;
        self.fused.row_programs += o.fused.row_programs;
        self.fused.row_program_ops += o.fused.row_program_ops;
        self.fused.epilogues += o.fused.epilogues;
        self.fused.row_compiles += o.fused.row_compiles;
        self.fused.hfused_stages += o.fused.hfused_stages;
        self.fused.hfused_denses += o.fused.hfused_denses;
        self.fused.row_time += o.fused.row_time;
        self.fused.row_compile_time += o.fused.row_compile_time;
        self.fused.row_splits += o.fused.row_splits;
        self.fused.direct_matmuls += o.fused.direct_matmuls;
        self.fused.gather_views += o.fused.gather_views;
        self.fused.dense_sums += o.fused.dense_sums;
        self.fused.fallbacks += o.fused.fallbacks;
        self.fused.dense_flops += o.fused.dense_flops;
        self.fused.dense_time += o.fused.dense_time;
        self.fused.device_stages += o.fused.device_stages;
        self.fused.host_stages += o.fused.host_stages;
        self.fused.device_time += o.fused.device_time;
        self.fused.device_uploads += o.fused.device_uploads;
        self.fused.device_upload_bytes += o.fused.device_upload_bytes;
        self.fused.device_upload_time += o.fused.device_upload_time;
        self.fused.device_waits += o.fused.device_waits;
        self.fused.device_wait_time += o.fused.device_wait_time;
        self.fused.device_host_stage_time += o.fused.device_host_stage_time;
        self.fused.device_gathers += o.fused.device_gathers;
        self.fused.device_in_place += o.fused.device_in_place;
        self.reuse_misses += o.reuse_misses;
        self.shared_inputs += o.shared_inputs;
        self.zero_copy_inputs += o.zero_copy_inputs;
        self.gathered_inputs += o.gathered_inputs;
        self.row_list_inputs += o.row_list_inputs;
        self.fused.row_lists_stacked += o.fused.row_lists_stacked;
        self.activation_bytes = self.activation_bytes.max(o.activation_bytes);
        self.pooled_outputs += o.pooled_outputs;
        self.release_scans += o.release_scans;
        self.memoized += o.memoized;
        self.job_memoized += o.job_memoized;
        self.time_program += o.time_program;
        self.host_steps += o.host_steps;
        self.time_dfg += o.time_dfg;
        self.time_schedule += o.time_schedule;
        self.time_gather += o.time_gather;
        self.time_kernels += o.time_kernels;
        self.time_outputs += o.time_outputs;
        self.time_total += o.time_total;
        self.time_decode += o.time_decode;
        self.time_encode += o.time_encode;
    }

    /// What recording and launching nodes took (counted in those parts, not in the program's).
    pub fn inner(&self) -> std::time::Duration {
        self.time_dfg
            + self.time_schedule
            + self.time_gather
            + self.time_kernels
            + self.time_outputs
    }

    /// The parts of the time spent running mini-batches, in ms: `program P + dfg D + scheduling
    /// S + gather G + kernels K + outputs O` (no decoding, encoding or other).
    pub fn run_split(&self) -> String {
        format!(
            "program {:.3} + dfg {:.3} + scheduling {:.3} + gather {:.3} + kernels {:.3} + outputs {:.3}",
            ms(self.time_program),
            ms(self.time_dfg),
            ms(self.time_schedule),
            ms(self.time_gather),
            ms(self.time_kernels),
            ms(self.time_outputs),
        )
    }

    /// The job's wall time: measured around the workers, else the mini-batches' own.
    pub fn wall(&self) -> Duration {
        if self.time_wall.is_zero() {
            self.time_total
        } else {
            self.time_wall
        }
    }

    pub fn mean_batch(&self) -> f64 {
        if self.launches == 0 {
            0.0
        } else {
            self.nodes as f64 / self.launches as f64
        }
    }
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

impl fmt::Display for Profile {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "instances {}  mini-batches {}  DFG nodes {}  host-run invocations {}  batched launches {}  flushes {}",
            self.instances, self.mini_batches, self.nodes, self.host_invocations, self.launches, self.flushes
        )?;
        writeln!(f, "mean batch size {:.2}", self.mean_batch())?;
        if self.host_steps > 0 {
            writeln!(
                f,
                "host program: {} evaluation steps, {:.1} ns each (recording invocations excluded)",
                self.host_steps,
                self.time_program.as_secs_f64() * 1e9 / self.host_steps as f64
            )?;
        }
        if self.memoized > 0 {
            writeln!(
                f,
                "identical invocations: {} took the results of an identical one in their launch",
                self.memoized
            )?;
        }
        if self.job_memoized > 0 {
            writeln!(
                f,
                "kept results: {} invocations took the results an earlier launch of the job computed",
                self.job_memoized
            )?;
        }
        if self.sums > 0 {
            writeln!(
                f,
                "sum fusion: {} add invocations kept as sums, {} terms summed inside launches",
                self.sums, self.sum_terms
            )?;
        }
        if self.ragged_launches > 0 {
            writeln!(
                f,
                "ragged batching: {} launches of mixed lengths, {} rows in their row-wise segments \
                 (mean {:.1} per launch); mixing segments: {} equal-length groups, {} attention \
                 kernels, {} row slices, {} row gathers and {} queries over every length ({:.3} \
                 ms); peak {} bytes of segment results in one launch",
                self.ragged_launches,
                self.ragged_rows,
                self.ragged_rows as f64 / self.ragged_launches as f64,
                self.ragged_groups,
                self.ragged_attention,
                self.ragged_row_slices,
                self.ragged_gathers,
                self.ragged_queries,
                ms(self.time_ragged_mixing),
                self.ragged_peak_bytes
            )?;
            if self.ragged_padding_rows > 0 {
                writeln!(
                    f,
                    "ragged padding baseline: {} padding rows computed and dropped ({:.2}× the real rows)",
                    self.ragged_padding_rows,
                    (self.ragged_rows + self.ragged_padding_rows) as f64
                        / self.ragged_rows.max(1) as f64
                )?;
            }
        }
        if self.deferred > 0 {
            writeln!(
                f,
                "deferred launches: invocations waited {} levels in all for more of their kind",
                self.deferred
            )?;
        }
        writeln!(
            f,
            "operators: {} batched, {} per-invocation (no batching rule), {} shared-only",
            self.ops.batched, self.ops.looped, self.ops.shared
        )?;
        writeln!(
            f,
            "kernel plans: {} dense stages ({} horizontally fused from {} denses), {} fused row programs ({} operators; {} run as GEMM epilogues), {} stages fell back",
            self.fused.dense_stages, self.fused.hfused_stages, self.fused.hfused_denses, self.fused.row_programs, self.fused.row_program_ops, self.fused.epilogues, self.fused.fallbacks
        )?;
        if self.fused.direct_matmuls + self.fused.gather_views + self.fused.dense_sums > 0 {
            writeln!(
                f,
                "in place: {} direct products (rows packed where they lie), {} embedding lookups as row references, {} sums of products as one GEMM",
                self.fused.direct_matmuls, self.fused.gather_views, self.fused.dense_sums
            )?;
        }
        if self.fused.device_stages + self.fused.host_stages > 0 {
            writeln!(
                f,
                "device: {} stages on the GPU, {} on the host (gathers, other operators); {:.3} ms queuing stages and copying outputs back",
                self.fused.device_stages,
                self.fused.host_stages,
                ms(self.fused.device_time)
            )?;
            writeln!(
                f,
                "device copies: {} row lists gathered on the device, {} inputs read in place there, {} uploads ({:.2} MB) in {:.3} ms, {} waits for outputs in {:.3} ms; host stages {:.3} ms",
                self.fused.device_gathers,
                self.fused.device_in_place,
                self.fused.device_uploads,
                self.fused.device_upload_bytes as f64 / 1e6,
                ms(self.fused.device_upload_time),
                self.fused.device_waits,
                ms(self.fused.device_wait_time),
                ms(self.fused.device_host_stage_time)
            )?;
        }
        let secs = self.fused.dense_time.as_secs_f64();
        writeln!(
            f,
            "dense stages (epilogues included): {:.3} GFLOP in {:.3} ms = {:.1} GFLOP/s; whole run {:.1} GFLOP/s",
            self.fused.dense_flops as f64 / 1e9,
            secs * 1e3,
            if secs > 0.0 {
                self.fused.dense_flops as f64 / 1e9 / secs
            } else {
                0.0
            },
            self.fused.dense_flops as f64 / 1e9 / self.wall().as_secs_f64().max(1e-9)
        )?;
        writeln!(
            f,
            "row programs (separate passes): {:.3} ms, {} split across threads, {} compiled in {:.3} ms",
            ms(self.fused.row_time),
            self.fused.row_splits,
            self.fused.row_compiles,
            ms(self.fused.row_compile_time)
        )?;
        writeln!(
            f,
            "launch inputs: {} shared, {} zero-copy, {} row lists ({} stacked in the launch), {} gathered; reuse misses {}",
            self.shared_inputs,
            self.zero_copy_inputs,
            self.row_list_inputs,
            self.fused.row_lists_stacked,
            self.gathered_inputs,
            self.reuse_misses
        )?;
        writeln!(
            f,
            "peak activation bytes {}; {} outputs in recycled buffers; {} early-release scans",
            self.activation_bytes, self.pooled_outputs, self.release_scans
        )?;
        // One worker: the breakdown adds up to the wall time, decoding the instances and encoding
        // the results included; several: to the mini-batches' summed time.
        let (whole, io) = if self.workers > 1 {
            (self.time_total, Duration::ZERO)
        } else {
            (self.wall(), self.time_decode + self.time_encode)
        };
        let other = whole.saturating_sub(
            self.time_program
                + self.time_dfg
                + self.time_schedule
                + self.time_gather
                + self.time_kernels
                + self.time_outputs
                + io,
        );
        let io_parts = if self.workers > 1 {
            String::new()
        } else {
            format!(
                " + decode {:.3} + encode {:.3}",
                ms(self.time_decode),
                ms(self.time_encode)
            )
        };
        let parts = format!("{}{io_parts} + other {:.3}", self.run_split(), ms(other));
        if self.workers > 1 {
            writeln!(
                f,
                "time (ms): total {:.3} (wall) on {} workers x {} kernel threads; mini-batches summed {:.3} = {parts}",
                ms(self.wall()),
                self.workers,
                self.kernel_threads,
                ms(self.time_total),
            )?;
        } else {
            writeln!(f, "time (ms): total {:.3} = {parts}", ms(whole))?;
        }
        writeln!(
            f,
            "{:<40} {:>9} {:>12} {:>10} {:>9} {:>11}",
            "block", "launches", "invocations", "mean batch", "max batch", "kernels ms"
        )?;
        for (name, s) in &self.per_block {
            let mean = if s.launches == 0 {
                0.0
            } else {
                s.invocations as f64 / s.launches as f64
            };
            writeln!(
                f,
                "{:<40} {:>9} {:>12} {:>10.2} {:>9} {:>11.3}",
                name,
                s.launches,
                s.invocations,
                mean,
                s.max_batch,
                ms(s.kernels)
            )?;
        }
        Ok(())
    }
}
